//! `rpcctl services | instances | entries` against real registries: a static list read from a
//! file, and a real etcd and a real ZooKeeper where a running `#[rpc::service]` server publishes
//! its instance. The
//! one-per-line forms are the contract scripts rely on, so they are compared whole.

#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;
#[path = "route_support/mod.rs"]
mod support;
#[path = "../../tests/tests/common/zookeeper.rs"]
mod zookeeper_harness;

use std::time::Duration;

use examples::{EchoServer, EchoService};
use rpc::{Registry, Server};
use serde_json::{json, Value};
use support::rpcctl;

/// A static list of three endpoints, two of them named services.
fn static_list(dir: &tempfile::TempDir) -> String {
    let path = dir.path().join("endpoints.toml");
    std::fs::write(
        &path,
        r#"
[[endpoint]]
address = "127.0.0.1:7002"
services = ["shop.Orders", "echo.Echo"]
metadata = { version = "canary" }

[[endpoint]]
address = "127.0.0.1:7001"
services = ["echo.Echo"]
id = "echo-1"

[[endpoint]]
address = "127.0.0.1:7003"
"#,
    )
    .expect("write the list");
    format!("static:{}", path.display())
}

#[tokio::test]
async fn services_and_instances_from_a_static_file_one_per_line_or_json() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = static_list(&dir);

    let run = rpcctl(&["--registry", &url, "services"]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "echo.Echo\nshop.Orders\n"),
        "{run:?}"
    );
    let run = rpcctl(&["--registry", &url, "--json", "services"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let listed: Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(listed, json!(["echo.Echo", "shop.Orders"]));

    // The endpoint listed without services serves any service, so it is an instance of each.
    let run = rpcctl(&["--registry", &url, "instances", "echo.Echo"]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "127.0.0.1:7001\n127.0.0.1:7002\n127.0.0.1:7003\n"),
        "{run:?}"
    );
    let run = rpcctl(&["--registry", &url, "--json", "instances", "shop.Orders"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let listed: Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(
        listed,
        json!([
            { "id": "127.0.0.1:7002", "address": "127.0.0.1:7002", "metadata": { "version": "canary" } },
            { "id": "127.0.0.1:7003", "address": "127.0.0.1:7003", "metadata": {} },
        ])
    );
}

/// A list of addresses names no service: `services` lists nothing, and says why on stderr
/// rather than succeed in silence; `instances` still answers.
#[tokio::test]
async fn services_of_a_list_of_addresses_say_why_there_are_none() {
    let run = rpcctl(&["--registry", "127.0.0.1:7001,127.0.0.1:7002", "services"]).await;
    assert_eq!((run.code, run.stdout.as_str()), (0, ""), "{run:?}");
    assert!(run.stderr.contains("lists no service"), "{run:?}");
    let run = rpcctl(&["--registry", "127.0.0.1:7001", "instances", "echo.Echo"]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "127.0.0.1:7001\n"),
        "{run:?}"
    );
}

#[tokio::test]
async fn a_missing_or_unusable_registry_is_a_usage_error_and_an_unreachable_one_a_failure() {
    let run = rpcctl(&["services"]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("give --registry URL"), "{run:?}");
    let run = rpcctl(&["--registry", "consul://127.0.0.1:8500", "services"]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr.contains("unknown registry scheme \"consul\""),
        "{run:?}"
    );
    let run = rpcctl(&["--registry", "static:/nonexistent/list.toml", "services"]).await;
    assert_eq!(run.code, 2, "{run:?}");

    // Nobody listens there: the registry is configured right but does not answer.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let run = rpcctl(&[
        "--registry",
        &format!("etcd://127.0.0.1:{port}"),
        "services",
    ])
    .await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("unreachable"), "{run:?}");
    assert!(run.stdout.is_empty(), "{run:?}");
    let run = rpcctl(&["--registry", &format!("zk://127.0.0.1:{port}"), "services"]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr
            .contains(&format!("ZooKeeper at 127.0.0.1:{port} unreachable")),
        "{run:?}"
    );
    assert!(run.stdout.is_empty(), "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_instances_and_entries_of_a_server_publishing_in_etcd() {
    let etcd = etcd_harness::Etcd::start().await;
    what_a_server_publishes_at(&etcd.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_instances_and_entries_of_a_server_publishing_in_zookeeper() {
    let zookeeper = zookeeper_harness::ZooKeeper::start().await;
    what_a_server_publishes_at(&zookeeper.url()).await;
}

/// Serves `echo.Echo` registered at `url` and checks what `services`, `instances` and
/// `entries` show of it, then that it leaves the listing when it shuts down.
async fn what_a_server_publishes_at(url: &str) {
    let registry = <dyn Registry>::from_url_with_lease(url, Some(Duration::from_secs(5)))
        .await
        .expect("registry");
    let server = Server::builder()
        .shared_registry(registry)
        .metadata("version", "stable")
        .add_service(EchoServer::new(EchoService::default()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let addr = server.local_addr().to_string();
    let url = url.to_string();

    let run = rpcctl(&["--registry", &url, "services"]).await;
    assert_eq!(
        (run.code, run.stdout.as_str()),
        (0, "echo.Echo\n"),
        "{run:?}"
    );
    let run = rpcctl(&["--registry", &url, "instances", "echo.Echo"]).await;
    assert_eq!(
        (run.code, run.stdout.clone()),
        (0, format!("{addr}\n")),
        "{run:?}"
    );
    let run = rpcctl(&["--registry", &url, "--json", "instances", "echo.Echo"]).await;
    let listed: Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(
        listed[0]["metadata"],
        json!({ "version": "stable" }),
        "{run:?}"
    );

    // `echo` is declared `#[governance(idempotent)]` with `#[hash_key] text` (argument 0).
    let run = rpcctl(&["--registry", &url, "entries", "echo.Echo"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let row = run
        .stdout
        .lines()
        .find(|l| l.starts_with("echo.Echo.echo "))
        .unwrap_or_else(|| panic!("no row for echo.Echo.echo: {run:?}"));
    assert!(row.contains("hash_key=arg0"), "{row}");
    assert!(row.contains("idempotent=true"), "{row}");
    let run = rpcctl(&["--registry", &url, "--json", "entries", "echo.Echo"]).await;
    let listed: Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(
        listed,
        json!([{
            "id": "echo.Echo.echo", "method": "echo", "hash_key": 0,
            "governance": { "idempotent": true }, "instances": [addr],
            "instances_disagree": false,
        }])
    );

    server.shutdown().await;
    // Deregistered: the service leaves the listing.
    let run = rpcctl(&["--registry", &url, "services"]).await;
    assert_eq!((run.code, run.stdout.as_str()), (0, ""), "{run:?}");
}

/// An older build of a service, publishing no settings for its entry.
mod older {
    #[rpc::service(name = "t.Mixed")]
    pub trait Mixed {
        async fn go(&self) -> Result<u32, rpc::RpcError>;
    }
    pub struct Impl;
    impl Mixed for Impl {
        async fn go(&self) -> Result<u32, rpc::RpcError> {
            Ok(1)
        }
    }
}

/// A newer build of it, declaring a timeout for the entry.
mod newer {
    #[rpc::service(name = "t.Mixed")]
    pub trait Mixed {
        #[governance(timeout_ms = 800)]
        async fn go(&self) -> Result<u32, rpc::RpcError>;
    }
    pub struct Impl;
    impl Mixed for Impl {
        async fn go(&self) -> Result<u32, rpc::RpcError> {
            Ok(2)
        }
    }
}

/// During a rolling upgrade the first instance by address may be an older build that
/// publishes nothing: clients pass over it and apply the newer build's settings, and
/// `entries` shows those, with no disagreement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_shows_the_settings_clients_apply_when_an_older_instance_publishes_none() {
    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    let registry = || async {
        <dyn Registry>::from_url_with_lease(&url, Some(Duration::from_secs(5)))
            .await
            .expect("registry")
    };
    // Addresses advertised in order: the older build's first.
    let old = Server::builder()
        .shared_registry(registry().await)
        .advertise("127.0.0.1:1")
        .add_service(older::MixedServer::new(older::Impl))
        .serve("127.0.0.1:0")
        .await
        .expect("serve the older build");
    let new = Server::builder()
        .shared_registry(registry().await)
        .advertise("127.0.0.1:2")
        .add_service(newer::MixedServer::new(newer::Impl))
        .serve("127.0.0.1:0")
        .await
        .expect("serve the newer build");
    let run = rpcctl(&["--registry", &url, "--json", "entries", "t.Mixed"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let listed: Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(
        listed,
        json!([{
            "id": "t.Mixed.go", "method": "go", "hash_key": null,
            "governance": { "timeout_ms": 800 },
            "instances": ["127.0.0.1:1", "127.0.0.1:2"],
            "instances_disagree": false,
        }]),
        "{run:?}"
    );
    old.shutdown().await;
    new.shutdown().await;
}
