//! What the tests of the distributed registry backends (`etcd.rs`, `zookeeper.rs`) do the same
//! way whatever the backend: serve `t.Who` through a registry, start a registered server as a
//! separate process, watch a service, and wait, bounded, until a watch shows (or no longer
//! shows) an address. Kept here so that both backends are held to exactly the same checks.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rpc::crates::registry::ServiceWatch;
use rpc::{Registry, Server, ServerHandle};
use tests::who::{Node, WhoServer};

use crate::common::within;

/// Serves `t.Who` answering `name` on a free loopback port, registered in `registry`.
pub async fn serve<R: Registry + Clone>(name: &str, registry: &R) -> ServerHandle {
    Server::builder()
        .registry(registry.clone())
        .add_service(WhoServer::new(Node(name.to_string())))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

/// A child process, killed on drop.
pub struct ChildProcess(pub Child);

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the server program `program` (named `name` in failures) with `args`, and returns it
/// once it printed `listening on <addr>`, with that address; fails the test if it does not
/// within 20 s. Its standard input stays open as long as the returned process lives.
pub async fn spawn_child_server(
    name: &str,
    program: &str,
    args: &[&str],
) -> (ChildProcess, String) {
    let mut child = ChildProcess(
        Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}")),
    );
    let stdout = child.0.stdout.take().expect("child stdout");
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Reads until the child's stdout closes, so the child never writes to a closed pipe.
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(addr) = line.strip_prefix("listening on ") {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        }
    });
    let addr = match tokio::time::timeout(Duration::from_secs(20), rx).await {
        Ok(Ok(addr)) => addr,
        _ => panic!("the child server did not print its address within 20 s"),
    };
    (child, addr)
}

/// A watch of `service` in `registry`, bounded by `common::LIMIT`.
pub async fn watch(registry: &impl Registry, service: &str) -> ServiceWatch {
    within("watch", registry.watch(&service.into()))
        .await
        .expect("watch")
}

/// The addresses the watch shows now.
pub fn addresses(w: &ServiceWatch) -> Vec<String> {
    w.current().iter().map(|i| i.address.clone()).collect()
}

/// Waits until the watch's addresses satisfy `pred`, at most `limit`; returns how long it took.
pub async fn wait_until(
    w: &mut ServiceWatch,
    limit: Duration,
    what: &str,
    pred: impl Fn(&[String]) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if pred(&addresses(w)) {
            return start.elapsed();
        }
        let left = limit.saturating_sub(start.elapsed());
        match tokio::time::timeout(left, w.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{what}: the watch closed: {e}"),
            Err(_) => panic!(
                "{what}: not within {limit:?}; the watch shows {:?}",
                addresses(w)
            ),
        }
    }
}

/// A predicate for [`wait_until`]: the list holds `addr`.
pub fn has(addr: impl ToString) -> impl Fn(&[String]) -> bool {
    let addr = addr.to_string();
    move |list| list.contains(&addr)
}

/// A predicate for [`wait_until`]: the list does not hold `addr`.
pub fn lacks(addr: impl ToString) -> impl Fn(&[String]) -> bool {
    let addr = addr.to_string();
    move |list| !list.contains(&addr)
}
