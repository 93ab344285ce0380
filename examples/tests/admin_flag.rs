//! `echo-server --admin ADDR`, `echo-client --admin ADDR` and `demo --admin ADDR`: each prints
//! `admin on <addr>` with the real port once the admin endpoint listens, and the endpoint answers
//! there with the token of `--admin-token` (the programs run as real processes; the endpoint is reached over TCP).

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Reads a child's standard output line by line on a thread of its own.
fn lines(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The first line starting with `prefix`, within `within`.
fn wait_for(rx: &mpsc::Receiver<String>, prefix: &str, within: Duration) -> String {
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

/// Kills the child when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(program: &str, args: &[&str]) -> (Running, mpsc::Receiver<String>) {
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    let out = lines(child.stdout.take().expect("stdout"));
    (Running(child), out)
}

async fn get(addr: &str, path: &str, token: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new().get(format!("http://{addr}{path}"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.expect("GET");
    (r.status().as_u16(), r.text().await.expect("body"))
}

/// The address of an `admin on <addr>` line, checked to carry a real port.
fn admin_addr(line: &str) -> String {
    let addr = line
        .strip_prefix("admin on ")
        .expect("admin on <addr>")
        .to_string();
    let port: u16 = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port");
    assert_ne!(port, 0, "{line}: the real port, not 0");
    addr
}

#[tokio::test]
async fn echo_server_serves_the_admin_endpoint_it_prints() {
    let (_child, out) = spawn(
        env!("CARGO_BIN_EXE_echo-server"),
        &[
            "--port",
            "0",
            "--admin",
            "127.0.0.1:0",
            "--admin-token",
            "T",
        ],
    );
    let addr = admin_addr(&wait_for(&out, "admin on ", Duration::from_secs(20)));
    assert_eq!(get(&addr, "/healthz", None).await, (200, "ok".to_string()));
    assert_eq!(
        get(&addr, "/readyz", Some("T")).await,
        (200, "ready".to_string())
    );
    assert_eq!(get(&addr, "/readyz", None).await.0, 401);
    let (status, services) = get(&addr, "/api/services", Some("T")).await;
    assert_eq!(status, 200);
    assert!(services.contains("echo.Echo.echo"), "{services}");
}

#[tokio::test]
async fn demo_serves_its_clients_breakers_after_the_report() {
    let (_child, out) = spawn(
        env!("CARGO_BIN_EXE_demo"),
        &["--admin", "127.0.0.1:0", "--admin-token", "T"],
    );
    let addr = admin_addr(&wait_for(&out, "admin on ", Duration::from_secs(20)));
    wait_for(&out, "== admin endpoint on", Duration::from_secs(60));
    let (status, breakers) = get(&addr, "/api/breakers", Some("T")).await;
    assert_eq!(status, 200);
    // The report called whoami through this client.
    assert!(breakers.contains("demo.Inventory.whoami"), "{breakers}");
    assert_eq!(
        get(&addr, "/readyz", Some("T")).await,
        (200, "ready".to_string())
    );
}

#[tokio::test]
async fn echo_client_serves_its_breakers_while_its_calls_run() {
    let (_server, server_out) = spawn(env!("CARGO_BIN_EXE_echo-server"), &["--port", "0"]);
    let listening = wait_for(&server_out, "listening on ", Duration::from_secs(20));
    let server = listening.trim_start_matches("listening on ").to_string();
    // Calls paced so the client outlives the checks (it is killed when the test ends).
    let (_client, out) = spawn(
        env!("CARGO_BIN_EXE_echo-client"),
        &[
            "--endpoints",
            &server,
            "--calls",
            "100000",
            "--interval-ms",
            "10",
            "--admin",
            "127.0.0.1:0",
            "--admin-token",
            "T",
        ],
    );
    let addr = admin_addr(&wait_for(&out, "admin on ", Duration::from_secs(20)));
    // A call printed: its entry's breaker exists in the client from then on.
    wait_for(&out, "call 0: ok", Duration::from_secs(20));
    let (status, breakers) = get(&addr, "/api/breakers", Some("T")).await;
    assert_eq!(status, 200);
    assert!(breakers.contains("echo.Echo.echo"), "{breakers}");
    let (status, endpoints) = get(&addr, "/api/endpoints", Some("T")).await;
    assert_eq!(status, 200);
    assert!(endpoints.contains(&server), "{endpoints} names {server}");
    assert_eq!(get(&addr, "/api/breakers", Some("wrong")).await.0, 401);
}
