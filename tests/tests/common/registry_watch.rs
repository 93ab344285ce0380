//! What the tests of the distributed registry backends (`etcd.rs`, `zookeeper.rs`,
//! `registry_suite.rs`) do the same way whatever the backend: serve `t.Who` through a registry,
//! start a registered server as a separate process, watch a service, wait, bounded, until a watch
//! shows (or no longer shows) an address, keep calling while the registry goes away and comes
//! back, and check that a server started later gets calls. Kept here so that both backends are
//! held to exactly the same checks.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rpc::crates::registry::ServiceWatch;
use rpc::{Registry, Server, ServerHandle};
use tests::who::{Node, Who, WhoClient, WhoServer};

use crate::common::{within, LIMIT};

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

/// Starts a `registry-server` process (`tests/src/bin/registry-server.rs`) registered in the
/// registry `url` names, with a lease (etcd's TTL, ZooKeeper's session timeout) of `lease`
/// (whole seconds); returns it and the address it serves.
pub async fn spawn_registered_child(url: &str, lease: Duration) -> (ChildProcess, String) {
    let lease = lease.as_secs().max(1).to_string();
    spawn_child_server(
        "registry-server",
        env!("CARGO_BIN_EXE_registry-server"),
        &[url, &lease],
    )
    .await
}

/// Starts server "b" registered through `registry`, waits until the watch `w` lists it (next to
/// `with`, when given), checks that some of four calls through `who` reach it, and stops it:
/// the client follows the registry.
pub async fn a_new_server_gets_calls<R: Registry + Clone>(
    registry: &R,
    w: &mut ServiceWatch,
    who: &WhoClient,
    with: Option<&str>,
) {
    let b = serve("b", registry).await;
    let b_addr = b.local_addr().to_string();
    wait_until(w, LIMIT, "new server", |l| {
        l.contains(&b_addr) && with.is_none_or(|a| l.iter().any(|x| x == a))
    })
    .await;
    let mut answers = Vec::new();
    for _ in 0..4 {
        answers.push(within("call", who.whoami()).await.expect("call"));
    }
    assert!(answers.iter().any(|a| a == "b"), "{answers:?}");
    within("shutdown", b.shutdown()).await;
}

/// Calls `whoami` from a task of its own, one call every 50 ms, until stopped: what a client
/// sees while its registry goes away and comes back. Bounded: 60 s or 2000 calls at most.
pub struct CallsThroughout {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<(u32, Vec<String>)>,
}

impl CallsThroughout {
    /// Starts calling through `who`, expecting every answer to be `expected`.
    pub fn start(who: &WhoClient, expected: &str) -> Self {
        let (stop, mut stop_rx) = tokio::sync::watch::channel(false);
        let who = who.clone();
        let expected = expected.to_string();
        let task = tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            let started = Instant::now();
            while !*stop_rx.borrow_and_update() && started.elapsed() < Duration::from_secs(60) {
                match tokio::time::timeout(Duration::from_secs(5), who.whoami()).await {
                    Ok(Ok(answer)) if answer == expected => ok += 1,
                    other => failed.push(format!("{other:?}")),
                }
                if ok as usize + failed.len() >= 2000 {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(50), stop_rx.changed()).await;
            }
            (ok, failed)
        });
        CallsThroughout { stop, task }
    }

    /// Stops the calls and checks that every one succeeded and that at least 20 ran (what
    /// happened `around`, for the failure message).
    pub async fn stop_and_check(self, around: &str) {
        let _ = self.stop.send(true);
        let (ok, failed) = within("the caller stops", self.task)
            .await
            .expect("caller task");
        assert!(failed.is_empty(), "calls failed {around}: {failed:?}");
        assert!(ok >= 20, "only {ok} calls ran");
        eprintln!("{ok} calls succeeded {around}");
    }
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

/// Watches for `period` and fails as soon as the watch's addresses satisfy `pred`: what must not
/// happen meanwhile (`what` names it in the failure).
pub async fn never_within(
    w: &mut ServiceWatch,
    period: Duration,
    what: &str,
    pred: impl Fn(&[String]) -> bool,
) {
    let end = tokio::time::Instant::now() + period;
    loop {
        let now = addresses(w);
        assert!(!pred(&now), "{what}; the watch shows {now:?}");
        match tokio::time::timeout_at(end, w.changed()).await {
            Err(_) => return,
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("the watch closed ({e}) while checking that nothing did: {what}"),
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
