//! The programs with `--registry`, run as real processes against a real registry on free
//! loopback ports: `echo-server` and `echo-client` find each other in etcd and in ZooKeeper;
//! with etcd, the admin endpoint of the running `echo-server` reads and writes the rules of that
//! etcd, and the server follows them (reached over TCP).

#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;
mod support;
#[cfg(feature = "zookeeper")]
#[path = "../../tests/tests/common/zookeeper.rs"]
mod zookeeper_harness;

use std::time::Duration;

use serde_json::Value;
use support::{spawn, wait_for};

/// How long a program may take to print the line a test waits for.
const LIMIT: Duration = Duration::from_secs(20);

/// `echo-server --registry URL` registers where `echo-client --registry URL` finds it: the
/// client's three calls all answer.
fn the_echo_programs_find_each_other_at(url: &str) {
    let (_server, out) = spawn(
        env!("CARGO_BIN_EXE_echo-server"),
        &["--registry", url, "--port", "0"],
    );
    wait_for(&out, "listening on ", LIMIT);
    let (_client, out) = spawn(
        env!("CARGO_BIN_EXE_echo-client"),
        &["--registry", url, "--calls", "3"],
    );
    assert_eq!(
        wait_for(&out, "summary: ", LIMIT),
        "summary: 3 ok, 0 business errors, 0 failed"
    );
}

#[tokio::test]
async fn the_echo_programs_find_each_other_in_etcd() {
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    tokio::task::spawn_blocking(move || the_echo_programs_find_each_other_at(&url))
        .await
        .expect("the check");
}

#[cfg(feature = "zookeeper")]
#[tokio::test]
async fn the_echo_programs_find_each_other_in_zookeeper() {
    let zookeeper = zookeeper_harness::ZooKeeper::start().await;
    let url = zookeeper.url();
    tokio::task::spawn_blocking(move || the_echo_programs_find_each_other_at(&url))
        .await
        .expect("the check");
}

/// `echo-client --registry URL` started before any server: its first calls fail (no endpoint
/// yet), and once a server registers, its calls are answered. Before, it appointed the first
/// instance listed at its start, none, and refused every call for good.
#[tokio::test]
async fn echo_client_started_before_the_servers_calls_them_once_they_register() {
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    tokio::task::spawn_blocking(move || {
        let (_client, out) = spawn(
            env!("CARGO_BIN_EXE_echo-client"),
            &[
                "--registry",
                &url,
                "--calls",
                "100000",
                "--interval-ms",
                "20",
                "--timeout-ms",
                "500",
            ],
        );
        let failed = wait_for(&out, "call 0: ", LIMIT);
        assert!(failed.starts_with("call 0: failed"), "{failed}");
        assert!(!failed.contains("appoint"), "{failed}");
        let (_server, server_out) = spawn(
            env!("CARGO_BIN_EXE_echo-server"),
            &["--registry", &url, "--port", "0"],
        );
        wait_for(&server_out, "listening on ", LIMIT);
        let deadline = std::time::Instant::now() + LIMIT;
        let line = loop {
            let line = wait_for(&out, "call ", LIMIT);
            if !line.contains(": failed") {
                break line;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no call answered within {LIMIT:?} of the server's start: {line}"
            );
        };
        assert!(line.contains(": ok from "), "{line}");
    })
    .await
    .expect("the check");
}

/// `echo-client --strategy appoint` with no endpoint to appoint says so and exits 1, rather
/// than failing every call over an address nobody gave.
#[tokio::test]
async fn echo_client_appointing_with_no_endpoint_says_so_and_exits_1() {
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_echo-client"))
            .args(["--registry", &url, "--calls", "1", "--strategy", "appoint"])
            .output()
            .expect("run echo-client")
    })
    .await
    .expect("the run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("lists no endpoint of echo.Echo"),
        "{stderr}"
    );
}

/// `echo-server --registry URL --admin ADDR` whose admin address is taken exits 2, and takes
/// its instance out of the registry first: clients must not dial a process that is gone
/// (before, the instance stayed until its lease ran out).
#[tokio::test]
async fn echo_server_whose_admin_cannot_start_leaves_nothing_registered() {
    use rpc::Registry as _;
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let admin = taken.local_addr().expect("addr").to_string();
    let args = ["--registry", &url, "--port", "0", "--admin", &admin];
    let program = env!("CARGO_BIN_EXE_echo-server");
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(program)
            .args(&args)
            .output()
            .expect("run echo-server")
    })
    .await
    .expect("the run");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let registry = rpc::EtcdRegistry::from_url(&url).await.expect("etcd");
    let watch = registry.watch(&"echo.Echo".into()).await.expect("watch");
    assert!(watch.current().is_empty(), "{:?}", watch.current());
    drop(taken);
}

/// What `GET /api/rules` of the admin endpoint at `admin` answers.
async fn rules(http: &reqwest::Client, admin: &str) -> Value {
    let answer = http
        .get(format!("http://{admin}/api/rules"))
        .bearer_auth("T")
        .send()
        .await
        .expect("GET /api/rules");
    serde_json::from_str(&answer.text().await.expect("body")).expect("JSON")
}

#[tokio::test]
async fn echo_server_on_etcd_edits_its_rules_through_the_admin_endpoint_and_follows_them() {
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    let (_running, rx) = spawn(
        env!("CARGO_BIN_EXE_echo-server"),
        &[
            "--registry",
            &url,
            "--admin",
            "127.0.0.1:0",
            "--admin-token",
            "T",
        ],
    );
    let admin = wait_for(&rx, "admin on ", LIMIT)
        .strip_prefix("admin on ")
        .expect("address")
        .to_string();
    wait_for(&rx, "listening on ", LIMIT);
    let http = reqwest::Client::new();

    // The endpoint has the store: the kinds' versions are numbers (0: none yet).
    let all = rules(&http, &admin).await;
    assert_eq!(all["store"], true, "{all}");
    assert_eq!(all["kinds"][0]["version"], 0, "{all}");

    // Follow the server's events before writing, then write through the endpoint.
    let mut events = http
        .get(format!("http://{admin}/api/events/stream"))
        .bearer_auth("T")
        .send()
        .await
        .expect("event stream");
    let text = "[defaults]\nmax_concurrent_handling_count = 7\nadmission_observe = true\n";
    let put = http
        .put(format!("http://{admin}/api/rules/governance?expected=0"))
        .bearer_auth("T")
        .body(text)
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), 200);
    let put: Value = serde_json::from_str(&put.text().await.expect("body")).expect("JSON");
    let version = put["version"].as_i64().expect("version");

    // What etcd holds (read with a plain etcd client, the oracle).
    let mut raw = etcd.client().await;
    let got = raw
        .get("/rpc/rules/governance", None)
        .await
        .expect("etcd get");
    let kv = &got.kvs()[0];
    assert_eq!((kv.mod_revision(), kv.value()), (version, text.as_bytes()));

    // The server applies it: its rule_applied event with that version (bounded).
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buffer = String::new();
        loop {
            let chunk = events.chunk().await.expect("stream").expect("stream open");
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            let applied = buffer
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .any(|data| {
                    serde_json::from_str::<Value>(data.trim())
                        .is_ok_and(|e| e["kind"] == "rule_applied" && e["rule_version"] == version)
                });
            if applied {
                return;
            }
        }
    })
    .await;
    assert!(
        seen.is_ok(),
        "no rule_applied event of version {version} within 10 s"
    );
    let all = rules(&http, &admin).await;
    assert_eq!(all["kinds"][0]["version"], version, "{all}");
    assert_eq!(all["kinds"][0]["applied"]["server"], version, "{all}");
}
