//! Retry storms across hops, over TCP: a chain client → top → mid → leaf whose leaf refuses
//! every call with Overflow, each level's client retrying.
//!
//! The oracle is arithmetic on the options, not the code under test: with `retry_times = 3`
//! and a budget that never binds, a chain of three retrying clients sends the leaf
//! `(1 + 3)³ = 64` calls per top-level call when every level retries, and `1 + 3 = 4` when
//! only the outermost does (the chain stop). With the default budget share (20 % of calls, no
//! per-second floor), the outermost level alone retries at most a fifth of its calls: the
//! leaf sees at most about 1.2 calls per top-level call with the stop, and about 1.2³ ≈ 1.73
//! without it.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::within;
use rpc::{Client, GovernanceOverrides, RpcError, Server, StaticRegistry, StatusCode};

#[rpc::service(name = "t.Chain")]
trait Chain {
    /// Forwards to the next tier, or (the leaf) refuses.
    async fn hop(&self) -> Result<u64, RpcError>;
}

struct Tier {
    next: Option<ChainClient>,
    calls: Arc<AtomicU64>,
}

impl Chain for Tier {
    async fn hop(&self) -> Result<u64, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match &self.next {
            Some(next) => next.hop().await,
            None => Err(RpcError::new(
                StatusCode::OverflowMaxServerHandle,
                "this leaf refuses every call",
            )),
        }
    }
}

/// Every level's client: three retries with no pause, no breaker (so retries alone decide
/// what reaches the leaf), the chain stop as given, and a budget of `percent` % of calls
/// (no per-second floor) or none that binds.
fn options(chain_stop: bool, budget_percent: Option<u32>) -> GovernanceOverrides {
    GovernanceOverrides {
        retry_times: Some(3),
        // A tier passes the leaf's Overflow on with `?` after its handler ran: only an
        // idempotent entry is tried again for it.
        idempotent: Some(true),
        retry_interval_ms: Some(0),
        enable_circuit_breaker: Some(false),
        retry_chain_stop: Some(chain_stop),
        retry_budget_percent: Some(budget_percent.unwrap_or(100_000)),
        retry_budget_min_per_second: Some(if budget_percent.is_some() { 0 } else { 100_000 }),
        unhealthy_times_allowed_before_removing: Some(1_000_000),
        ..GovernanceOverrides::NONE
    }
}

fn client_of(addr: std::net::SocketAddr, o: GovernanceOverrides) -> ChainClient {
    ChainClient::new(
        Client::builder()
            .registry(StaticRegistry::new([addr.to_string()]))
            .override_options(ChainClient::SERVICE_ID, o)
            .build(),
    )
}

/// Starts leaf, mid and top; returns the top-level client and the leaf's call counter.
async fn chain(o: GovernanceOverrides) -> (ChainClient, Arc<AtomicU64>, Vec<rpc::ServerHandle>) {
    let leaf_calls = Arc::new(AtomicU64::new(0));
    let mut servers = Vec::new();
    let mut next = None;
    for level in 0..3 {
        let calls = if level == 0 {
            leaf_calls.clone()
        } else {
            Arc::new(AtomicU64::new(0))
        };
        let server = Server::builder()
            .add_service(ChainServer::new(Tier {
                next: next.take(),
                calls,
            }))
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        next = Some(client_of(server.local_addr(), o.clone()));
        servers.push(server);
    }
    (next.expect("three levels"), leaf_calls, servers)
}

/// Makes `calls` top-level calls one after the other; each must fail with Overflow.
async fn leaf_calls_for(calls: u64, o: GovernanceOverrides) -> u64 {
    let (top, leaf, _servers) = chain(o).await;
    for i in 0..calls {
        let err = within("a top-level call", top.hop())
            .await
            .expect_err("the leaf refuses everything");
        assert_eq!(
            err.code(),
            StatusCode::OverflowMaxServerHandle,
            "call {i}: {err}"
        );
    }
    leaf.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_chain_stop_only_the_outermost_level_retries() {
    assert_eq!(leaf_calls_for(1, options(true, None)).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_chain_stop_retries_multiply_at_every_hop() {
    assert_eq!(leaf_calls_for(1, options(false, None)).await, 64);
}

/// Top-level calls in the budget cases: enough for the 20 % share to be what limits retries.
const CALLS: u64 = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_default_budget_share_the_leaf_sees_at_most_1_3_calls_per_call() {
    let with = leaf_calls_for(CALLS, options(true, Some(20))).await;
    let without = leaf_calls_for(CALLS, options(false, Some(20))).await;
    let (with, without) = (with as f64 / CALLS as f64, without as f64 / CALLS as f64);
    assert!(
        with <= 1.3,
        "{with:.2} leaf calls per top-level call with the stop"
    );
    assert!(
        without >= 1.6,
        "{without:.2} leaf calls per top-level call without the stop (1.2³ ≈ 1.73 expected)"
    );
}
