//! `rpcctl rules ...` run as a program against a real etcd (started on free loopback ports by
//! the workspace's harness): set validates before writing (exit 1, nothing written), get, diff,
//! history (--json) and rollback, and `--expected` refusing to write over a version changed
//! meanwhile.

#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;

use std::process::{Command, Output};

use etcd_harness::Etcd;

fn rpcctl(etcd: &Etcd, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rpcctl"))
        .arg("--registry")
        .arg(etcd.url())
        .args(args)
        .output()
        .expect("run rpcctl")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn file(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write a rule file");
    path.display().to_string()
}

fn version_of(o: &Output) -> i64 {
    let v: serde_json::Value = serde_json::from_str(&stdout(o)).expect("JSON");
    v["version"].as_i64().expect("a version")
}

#[tokio::test]
async fn set_get_diff_history_and_rollback_through_the_program() {
    let etcd = Etcd::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let v1_file = file(
        &dir,
        "v1.toml",
        "[defaults]\ntimeout_ms = 1000\nretry_times = 1\n",
    );
    let v2_file = file(
        &dir,
        "v2.toml",
        "[defaults]\ntimeout_ms = 2000\nretry_times = 1\n",
    );
    let bad = file(
        &dir,
        "bad.toml",
        "[defaults]\ntimeout_ms = 1000\nretry_tims = 1\n",
    );

    // Nothing in force yet.
    let o = rpcctl(&etcd, &["--json", "rules", "get", "governance"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    // Version 0, as `--expected` takes it for "none in force".
    assert_eq!(v["version"], 0, "{v}");
    assert_eq!(v["text"], "", "{v}");

    // An invalid document: exit 1, the reason on stderr, nothing written.
    let o = rpcctl(&etcd, &["rules", "set", "governance", &bad]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("line 3") && stderr(&o).contains("retry_tims"),
        "{}",
        stderr(&o)
    );
    let mut raw = etcd.client().await;
    let all = raw
        .get(
            "/rpc/rules/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert!(all.kvs().is_empty(), "nothing written");

    let o = rpcctl(&etcd, &["--json", "rules", "set", "governance", &v1_file]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v1 = version_of(&o);
    // The version is the etcd revision of the key.
    let kv = raw.get("/rpc/rules/governance", None).await.unwrap();
    assert_eq!(kv.kvs()[0].mod_revision(), v1);

    // get: the text and the version.
    let o = rpcctl(&etcd, &["rules", "get", "governance"]);
    assert!(o.status.success());
    assert_eq!(
        stdout(&o),
        format!(
            "# governance rules, version {v1}\n[defaults]\ntimeout_ms = 1000\nretry_times = 1\n"
        )
    );

    // diff against v2: one line out, one in.
    let o = rpcctl(&etcd, &["rules", "diff", "governance", &v2_file]);
    assert!(o.status.success());
    let lines: Vec<String> = stdout(&o).lines().skip(2).map(str::to_string).collect();
    assert_eq!(
        lines,
        vec![
            " [defaults]",
            "-timeout_ms = 1000",
            "+timeout_ms = 2000",
            " retry_times = 1"
        ]
    );

    let o = rpcctl(&etcd, &["--json", "rules", "set", "governance", &v2_file]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v2 = version_of(&o);

    // history --json: both versions, oldest first.
    let o = rpcctl(&etcd, &["--json", "rules", "history", "governance"]);
    assert!(o.status.success());
    let h: Vec<serde_json::Value> = serde_json::from_str(&stdout(&o)).unwrap();
    let versions: Vec<Option<i64>> = h.iter().map(|e| e["version"].as_i64()).collect();
    assert_eq!(versions, vec![Some(v1), Some(v2)]);
    assert!(h[1]["text"].as_str().unwrap().contains("2000"));

    // rollback to v1: its text again, as a new version.
    let o = rpcctl(&etcd, &["rules", "rollback", "governance", &v1.to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let kv = raw.get("/rpc/rules/governance", None).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(kv.kvs()[0].value()),
        "[defaults]\ntimeout_ms = 1000\nretry_times = 1\n"
    );
    assert!(kv.kvs()[0].mod_revision() > v2);

    // A version the history does not hold: exit 1.
    let o = rpcctl(&etcd, &["rules", "rollback", "governance", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    // A document that is not UTF-8 (a Latin-1 comment) is an invalid document, as the admin
    // endpoint and the store take it: exit 1 for set and diff. A file that cannot be read at
    // all is the command line's fault: exit 2.
    let latin1 = dir.path().join("latin1.toml");
    std::fs::write(&latin1, b"[defaults]\n# d\xE9lai\ntimeout_ms = 100\n").expect("write");
    let latin1 = latin1.display().to_string();
    for command in ["set", "diff"] {
        let o = rpcctl(&etcd, &["rules", command, "governance", &latin1]);
        assert_eq!(o.status.code(), Some(1), "{command}: {}", stderr(&o));
        assert!(stderr(&o).contains("not UTF-8"), "{}", stderr(&o));
    }
    let missing = dir.path().join("missing.toml").display().to_string();
    let o = rpcctl(&etcd, &["rules", "set", "governance", &missing]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // An unknown kind, or a registry that is not etcd: exit 2.
    let o = rpcctl(&etcd, &["rules", "get", "routes"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_rpcctl"))
        .args(["--registry", "embedded", "rules", "get", "governance"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[tokio::test]
async fn set_and_rollback_with_expected_write_only_over_that_version() {
    let etcd = Etcd::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let a = file(&dir, "a.toml", "[defaults]\ntimeout_ms = 1000\n");
    let b = file(&dir, "b.toml", "[defaults]\ntimeout_ms = 2000\n");
    let c = file(&dir, "c.toml", "[defaults]\ntimeout_ms = 3000\n");
    let in_force = || async {
        let mut raw = etcd.client().await;
        let kv = raw.get("/rpc/rules/governance", None).await.unwrap();
        kv.kvs().first().map(|kv| {
            (
                kv.mod_revision(),
                String::from_utf8_lossy(kv.value()).into_owned(),
            )
        })
    };

    // `rpcctl --json rules <verb> governance <what> --expected <over>`.
    let over = |verb: &str, what: &str, expected: i64| {
        let expected = expected.to_string();
        rpcctl(
            &etcd,
            &[
                "--json",
                "rules",
                verb,
                "governance",
                what,
                "--expected",
                &expected,
            ],
        )
    };
    let refused = |o: &Output| assert_eq!(o.status.code(), Some(1), "{}", stderr(o));

    // A negative version is no version: a usage error, nothing written.
    let o = over("set", &a, -1);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(in_force().await, None);

    let o = over("set", &a, 0);
    assert!(o.status.success(), "{}", stderr(&o));
    let va = version_of(&o);
    // Only when none is in force: a second `--expected 0` is refused and writes nothing.
    let o = over("set", &b, 0);
    refused(&o);
    assert!(
        stderr(&o).contains(&va.to_string()),
        "names the version in force: {}",
        stderr(&o)
    );
    assert_eq!(in_force().await.unwrap().0, va);

    let o = over("set", &b, va);
    assert!(o.status.success(), "{}", stderr(&o));
    let vb = version_of(&o);
    // Over the version read before another operator wrote: refused, b stays.
    refused(&over("set", &c, va));
    assert_eq!(
        in_force().await,
        Some((vb, "[defaults]\ntimeout_ms = 2000\n".into()))
    );

    // Rollback likewise: over a stale version refused, over the one in force written.
    let target = va.to_string();
    refused(&over("rollback", &target, va));
    assert_eq!(in_force().await.unwrap().0, vb);
    let o = over("rollback", &target, vb);
    assert!(o.status.success(), "{}", stderr(&o));
    let (v, text) = in_force().await.unwrap();
    assert!(v > vb);
    assert_eq!(text, "[defaults]\ntimeout_ms = 1000\n");
}
