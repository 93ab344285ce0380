//! What the tests of the distributed registry backends (`etcd.rs`, `zookeeper.rs`) do the same
//! way whatever the backend: serve `t.Who` through a registry, watch a service, and wait, bounded,
//! until a watch shows (or no longer shows) an address. Kept here so that both backends are held
//! to exactly the same checks.
#![allow(dead_code)]

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
