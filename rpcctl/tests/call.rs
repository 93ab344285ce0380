//! `rpcctl call ENTRY JSON` against a running echo server (the `echo.Echo` service of the
//! `echo-server` program, served over TCP on 127.0.0.1:0): the JSON answer alone on standard
//! output and exit 0; a failed call exits 1 with its status and message; an entry the service
//! does not publish is refused with the list of those it does; malformed arguments are a usage
//! error (2).

#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;
#[path = "route_support/mod.rs"]
mod support;

use std::time::Duration;

use examples::{EchoServer, EchoService};
use rpc::{InProcessRegistry, Registry, Server, ServerHandle};
use support::rpcctl;

async fn echo_server(fail_every: u64) -> ServerHandle {
    Server::builder()
        .registry(InProcessRegistry::new())
        .add_service(EchoServer::new(EchoService::new(
            fail_every,
            Duration::ZERO,
        )))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_prints_the_json_answer_of_a_running_echo_server() {
    let server = echo_server(0).await;
    let addr = server.local_addr().to_string();
    let run = rpcctl(&[
        "--registry",
        &addr,
        "call",
        "echo.Echo.echo",
        r#"["héllo \"you\""]"#,
    ])
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.stdout, "\"héllo \\\"you\\\"\"\n", "{run:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_call_exits_1_with_its_status_and_message() {
    // Every call is refused with a business error (1000).
    let server = echo_server(1).await;
    let addr = server.local_addr().to_string();
    let run = rpcctl(&["--registry", &addr, "call", "echo.Echo.echo", r#"["x"]"#]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stdout.is_empty(), "{run:?}");
    assert!(
        run.stderr
            .contains("echo.Echo.echo failed: 1000 call #1 refused on purpose"),
        "{run:?}"
    );
    server.shutdown().await;

    // Nobody serves there any more: the call fails (1), naming what it tried.
    let run = rpcctl(&["--registry", &addr, "call", "echo.Echo.echo", r#"["x"]"#]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains(&addr), "{run:?}");
}

/// A call that does not answer within `--timeout-ms` is given up (exit 1, saying so), however
/// long the entry's own options would let it wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_timeout_is_given_up_with_exit_1() {
    let server = Server::builder()
        .registry(InProcessRegistry::new())
        .add_service(EchoServer::new(EchoService::new(
            0,
            Duration::from_secs(600),
        )))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let addr = server.local_addr().to_string();
    let run = rpcctl(&[
        "--registry",
        &addr,
        "call",
        "--timeout-ms",
        "200",
        "echo.Echo.echo",
        r#"["x"]"#,
    ])
    .await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr
            .contains("echo.Echo.echo: no answer within 200 ms"),
        "{run:?}"
    );
}

#[tokio::test]
async fn malformed_arguments_are_a_usage_error() {
    for args in ["[\"unterminated", "{\"text\": \"hi\"}", "\"hi\""] {
        let run = rpcctl(&["--registry", "127.0.0.1:9", "call", "echo.Echo.echo", args]).await;
        assert_eq!(run.code, 2, "{args}: {run:?}");
        assert!(run.stderr.contains("JSON array"), "{run:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_the_service_does_not_publish_is_refused_with_those_it_does() {
    let etcd = etcd_harness::Etcd::start().await;
    let registry = <dyn Registry>::from_url_with_lease(&etcd.url(), Some(Duration::from_secs(5)))
        .await
        .expect("etcd registry");
    let server = Server::builder()
        .shared_registry(registry)
        .add_service(EchoServer::new(EchoService::default()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let url = etcd.url();
    let run = rpcctl(&["--registry", &url, "call", "echo.Echo.ehco", r#"["x"]"#]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.contains(
            "513 echo.Echo.ehco is not an entry of echo.Echo: its instances publish echo.Echo.echo"
        ),
        "{run:?}"
    );
    // The published entry, found through etcd, answers.
    let run = rpcctl(&[
        "--registry",
        &url,
        "call",
        "echo.Echo.echo",
        r#"["through etcd"]"#,
    ])
    .await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "\"through etcd\"\n"),
        "{run:?}"
    );
    server.shutdown().await;
}
