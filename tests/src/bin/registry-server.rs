//! A server registered in any registry a URL names, run as a separate process by the registry
//! tests (`tests/tests/integration/registry_suite.rs`, `zookeeper.rs`) so that a test can kill it
//! with SIGKILL, or stop it with SIGSTOP, and watch what becomes of its registration.
//!
//! ```text
//! registry-server <registry URL> <lease seconds>
//! ```
//! Serves `t.Who` (answering `child`) on 127.0.0.1 on a free port, registered through
//! `<dyn Registry>::from_url_with_lease` (the lease: etcd's TTL, ZooKeeper's session timeout),
//! prints `listening on <addr>`, and exits when its standard input closes, so that it never
//! outlives the test that started it.

use std::io::Write;
use std::time::Duration;

use rpc::{Registry, Server};
use tests::who::{Node, WhoServer};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: registry-server <registry URL> <lease seconds>";
    let url = args.next().ok_or(usage)?;
    let lease: u64 = args.next().ok_or(usage)?.parse()?;
    let registry =
        <dyn Registry>::from_url_with_lease(&url, Some(Duration::from_secs(lease))).await?;
    let server = Server::builder()
        .shared_registry(registry)
        .add_service(WhoServer::new(Node("child".into())))
        .serve("127.0.0.1:0")
        .await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.local_addr())?;
        out.flush()?;
    }
    tests::parent::stdin_closed().await;
    server.abort();
    Ok(())
}
