//! `echo-server --registry etcd://... --admin ADDR`: the admin endpoint of the running program
//! reads and writes the rules of that etcd, and the server follows them (a real etcd on free
//! loopback ports, the program as a real process, reached over TCP).

#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// Kills the child when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The first line of `rx` starting with `prefix`, within 20 s.
fn wait_for(rx: &mpsc::Receiver<String>, prefix: &str) -> String {
    let within = Duration::from_secs(20);
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => return line,
            Ok(_) => continue,
            Err(e) => panic!("no line starting with {prefix:?} within {within:?}: {e}"),
        }
    }
}

#[tokio::test]
async fn echo_server_on_etcd_edits_its_rules_through_the_admin_endpoint_and_follows_them() {
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    let mut child = Command::new(env!("CARGO_BIN_EXE_echo-server"))
        .args([
            "--registry",
            &url,
            "--admin",
            "127.0.0.1:0",
            "--admin-token",
            "T",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start echo-server");
    let stdout = child.stdout.take().expect("stdout");
    let _running = Running(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let admin = wait_for(&rx, "admin on ")
        .strip_prefix("admin on ")
        .expect("address")
        .to_string();
    wait_for(&rx, "listening on ");
    let http = reqwest::Client::new();

    // The endpoint has the store: the kinds' versions are numbers (0: none yet).
    let all: Value = serde_json::from_str(
        &http
            .get(format!("http://{admin}/api/rules"))
            .bearer_auth("T")
            .send()
            .await
            .expect("GET /api/rules")
            .text()
            .await
            .expect("body"),
    )
    .expect("JSON");
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
    let all: Value = serde_json::from_str(
        &http
            .get(format!("http://{admin}/api/rules"))
            .bearer_auth("T")
            .send()
            .await
            .expect("GET /api/rules")
            .text()
            .await
            .expect("body"),
    )
    .expect("JSON");
    assert_eq!(all["kinds"][0]["version"], version, "{all}");
    assert_eq!(all["kinds"][0]["applied"]["server"], version, "{all}");
}
