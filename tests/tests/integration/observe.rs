//! Observe mode over real TCP: outlier ejection by success rate judges and reports an outlier
//! (event `ejection`, `observed`) but keeps sending it calls, where enforcing takes it out of
//! rotation for the interval. Time is tokio's paused clock: the interval ends by `advance`.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::within;
use rpc::crates::governance::events::EventKind;
use rpc::{
    Client, GovernanceOptions, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode,
};

#[rpc::service(name = "o.Node")]
trait Node {
    /// The serving node's name; the node "e" fails every fourth call with a server error.
    async fn name(&self) -> Result<String, RpcError>;
}

struct Named {
    name: String,
    calls: AtomicU32,
}

impl Node for Arc<Named> {
    async fn name(&self) -> Result<String, RpcError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if self.name == "e" && n.is_multiple_of(4) {
            return Err(RpcError::new(StatusCode::ServerError, "e is flaky"));
        }
        Ok(self.name.clone())
    }
}

const NODES: [&str; 5] = ["a", "b", "c", "d", "e"];

async fn nodes(reg: &InProcessRegistry) -> Vec<(ServerHandle, Arc<Named>)> {
    let mut out = Vec::new();
    for name in NODES {
        let named = Arc::new(Named {
            name: name.into(),
            calls: AtomicU32::new(0),
        });
        let server = Server::builder()
            .registry(reg.clone())
            .idle_timeout(Duration::from_secs(3600))
            .add_service(NodeServer::new(named.clone()))
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        out.push((server, named));
    }
    out
}

/// Calls `n` times round robin; returns how many answers or failures came from "e".
async fn calls_to_e(node: &NodeClient, named: &[(ServerHandle, Arc<Named>)], n: usize) -> u32 {
    let before = named[4].1.calls.load(Ordering::SeqCst);
    for _ in 0..n {
        let _ = within("call", node.name()).await;
    }
    named[4].1.calls.load(Ordering::SeqCst) - before
}

#[tokio::test(start_paused = true)]
async fn an_outlier_in_observe_mode_is_reported_and_keeps_its_traffic() {
    for observe in [false, true] {
        let reg = InProcessRegistry::new();
        let named = nodes(&reg).await;
        let client = Client::builder()
            .registry(reg)
            .default_options(GovernanceOptions {
                outlier_success_rate: true,
                outlier_request_volume: 20,
                outlier_observe: observe,
                enable_circuit_breaker: false,
                retry_times: 0,
                timeout_ms: 0,
                ..GovernanceOptions::default()
            })
            .build();
        let mut events = client.events().subscribe();
        let node = NodeClient::new(client.clone());
        // 40 calls per node: e fails one in four (never three in a row, so consecutive
        // failures never mark it). Success rates 1, 1, 1, 1, 0.75: e is below the mean by more
        // than 1.9 standard deviations.
        assert_eq!(calls_to_e(&node, &named, 200).await, 40);
        tokio::time::advance(Duration::from_secs(10)).await;
        // The interval ended: the next call's outcome judges it.
        let _ = within("call", node.name()).await;
        let ejections: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
            .filter(|e| e.kind == EventKind::Ejection)
            .collect();
        assert_eq!(ejections.len(), 1, "{ejections:?}");
        assert_eq!(ejections[0].observed, observe, "{:?}", ejections[0]);
        assert_eq!(
            ejections[0].endpoint.as_deref(),
            Some(named[4].0.local_addr().to_string().as_str())
        );
        // Enforced, e gets nothing for the interval; observed, it keeps its share.
        let to_e = calls_to_e(&node, &named, 100).await;
        if observe {
            assert_eq!(to_e, 20, "observe mode keeps e in rotation");
        } else {
            assert_eq!(to_e, 0, "enforced: e is out for the interval");
        }
    }
}
