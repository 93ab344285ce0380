//! The `rpc-gateway` program as scripts use it: started with `--registry etcd://... --listen
//! 127.0.0.1:0` (or `zk://...`), it prints `gateway on <addr>`, and `curl -d '{"text":"hi"}'
//! http://ADDR/api/echo.Echo/echo` (a form content type, JSON body) answers `"hi"` from an echo
//! server published in the same etcd (or ZooKeeper).

#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;
#[path = "../../tests/tests/common/zookeeper.rs"]
mod zookeeper_harness;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use examples::{EchoServer, EchoService};
use rpc::{Registry, Server};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const LIMIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn the_program_serves_an_echo_server_published_in_etcd() {
    let etcd = etcd_harness::Etcd::start().await;
    the_program_serves_an_echo_server_published_at(&etcd.url()).await;
}

#[tokio::test]
async fn the_program_serves_an_echo_server_published_in_zookeeper() {
    let zookeeper = zookeeper_harness::ZooKeeper::start().await;
    the_program_serves_an_echo_server_published_at(&zookeeper.url()).await;
}

/// An echo server published in the registry `url` names, and `rpc-gateway --registry url`.
async fn the_program_serves_an_echo_server_published_at(url: &str) {
    let registry: Arc<dyn Registry> = <dyn Registry>::from_url(url).await.expect("registry");
    let server = Server::builder()
        .shared_registry(registry.clone())
        .add_service(EchoServer::new(EchoService::default()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve echo");

    let (mut child, addr) = start(&["--registry", url, "--listen", "127.0.0.1:0"]).await;

    // What `curl -d '{"text":"hi"}' http://ADDR/api/echo.Echo/echo` sends.
    let http = reqwest::Client::new();
    let response = tokio::time::timeout(
        LIMIT,
        http.post(format!("http://{addr}/api/echo.Echo/echo"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(r#"{"text":"hi"}"#)
            .send(),
    )
    .await
    .expect("an answer in time")
    .expect("the gateway answers");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.text().await.expect("body"), "\"hi\"");

    let document = http
        .get(format!("http://{addr}/openapi.json"))
        .send()
        .await
        .expect("the document");
    assert_eq!(document.status().as_u16(), 200);
    let document: serde_json::Value =
        serde_json::from_str(&document.text().await.expect("body")).expect("JSON");
    assert_eq!(document["openapi"], "3.1.0");

    child.start_kill().expect("stop rpc-gateway");
    server.shutdown().await;
}

/// Starts the program with `args`; it and the address it prints.
async fn start(args: &[&str]) -> (tokio::process::Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rpc-gateway"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start rpc-gateway");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    tokio::time::timeout(LIMIT, BufReader::new(stdout).read_line(&mut line))
        .await
        .expect("rpc-gateway prints its address in time")
        .expect("read its output");
    let addr = line
        .trim_end()
        .strip_prefix("gateway on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"));
    (child, addr.to_string())
}

/// With an `etcd://` registry the program's client follows the rules in that etcd, and it
/// presents `--server-token` to servers that require a token: a governance rule giving the
/// echo entry a deadline of 300 ms ends a call to a server that holds each call 2 s with 504
/// (the call's timeout, 519). Without the rules the call would have been answered (200, its
/// default deadline being 5 s); without the token, refused (403, call status 517).
#[tokio::test]
async fn the_program_follows_the_rules_in_etcd_and_presents_the_server_token() {
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    let registry = rpc::EtcdRegistry::from_url(&url).await.expect("etcd");
    let rule = "[entries.\"echo.Echo.echo\"]\ntimeout_ms = 300\nretry_times = 0\n";
    registry
        .rules()
        .put(rpc::RuleKind::Governance, rule)
        .await
        .expect("put the rule");
    let server = Server::builder()
        .shared_registry(Arc::new(registry))
        .token("s3cret")
        .add_service(EchoServer::new(EchoService::new(0, Duration::from_secs(2))))
        .serve("127.0.0.1:0")
        .await
        .expect("serve echo");
    let (mut child, addr) = start(&[
        "--registry",
        &url,
        "--listen",
        "127.0.0.1:0",
        "--server-token",
        "s3cret",
    ])
    .await;
    let response = tokio::time::timeout(
        LIMIT,
        reqwest::Client::new()
            .post(format!("http://{addr}/api/echo.Echo/echo"))
            .body(r#"{"text":"hi"}"#)
            .send(),
    )
    .await
    .expect("an answer in time")
    .expect("the gateway answers");
    let status = response.status().as_u16();
    let body: serde_json::Value =
        serde_json::from_str(&response.text().await.expect("body")).expect("JSON");
    assert_eq!(status, 504, "{body}");
    assert_eq!(body["code"], 519, "{body}");
    child.start_kill().expect("stop rpc-gateway");
    server.shutdown().await;
}

/// Runs the program with `args` (and no token in the environment) until it exits, within the
/// tests' limit: for arguments it refuses before it starts.
async fn run_to_exit(args: &[&str]) -> std::process::Output {
    tokio::time::timeout(
        LIMIT,
        Command::new(env!("CARGO_BIN_EXE_rpc-gateway"))
            .args(args)
            .env_remove("RPC_GATEWAY_TOKEN")
            .env_remove("RPC_GATEWAY_SERVER_TOKEN")
            .output(),
    )
    .await
    .expect("it exits in time")
    .expect("run rpc-gateway")
}

#[tokio::test]
async fn an_unknown_registry_is_refused_with_the_forms_to_use() {
    let output = run_to_exit(&[
        "--registry",
        "consul://127.0.0.1:8500",
        "--listen",
        "127.0.0.1:0",
    ])
    .await;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("unknown registry scheme") && stderr.contains("etcd://"),
        "{stderr}"
    );
    assert!(output.stdout.is_empty());
}

/// Arguments the program refuses before it starts, each with what to give instead: an empty
/// token (which would turn the check off), an empty token for the servers (a secret that did
/// not resolve), an interval or a time limit no duration holds, and a governance config file
/// that cannot be read.
#[tokio::test]
async fn an_empty_token_or_an_impossible_interval_is_refused() {
    for (flag, value, says) in [
        ("--token", "", "is empty"),
        ("--server-token", "", "is empty"),
        (
            "--discovery-secs",
            "1e20",
            "give a positive number of seconds",
        ),
        ("--discovery-secs", "0", "give a positive number of seconds"),
        (
            "--read-timeout-secs",
            "0",
            "give a positive number of seconds",
        ),
        (
            "--idle-timeout-secs",
            "NaN",
            "give a positive number of seconds",
        ),
        ("--max-in-flight", "0", "--max-in-flight 0: give the number"),
        (
            "--config",
            "/nonexistent/governance.toml",
            "/nonexistent/governance.toml",
        ),
    ] {
        let output = run_to_exit(&[
            "--registry",
            "embedded",
            "--listen",
            "127.0.0.1:0",
            flag,
            value,
        ])
        .await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{flag} {value:?}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains(says),
            "{flag} {value:?}: {stderr}"
        );
        assert!(output.stdout.is_empty(), "{flag} {value:?}");
    }
}
