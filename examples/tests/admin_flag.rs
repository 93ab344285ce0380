//! `echo-server --admin ADDR`, `echo-client --admin ADDR` and `demo --admin ADDR`: each prints
//! `admin on <addr>` with the real port once the admin endpoint listens, and the endpoint answers
//! there with the token of `--admin-token` (the programs run as real processes; the endpoint is reached over TCP).

mod support;

use std::time::Duration;

use support::{spawn, wait_for};

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
