//! Client-side adaptive throttling over TCP: against a server that refuses every call with
//! Overflow (515), a client with `throttle_k_percent` set drops most of its calls itself
//! (514, event `throttled`), so the server, which counts what reaches it, sees far fewer calls
//! than the client makes; without the option it sees every one.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::within;
use rpc::{Client, EventKind, GovernanceOverrides, RpcError, Server, StaticRegistry, StatusCode};

#[rpc::service(name = "t.Throttle")]
trait Refusing {
    /// Always refused for overload.
    async fn work(&self) -> Result<(), RpcError>;
}

struct Full {
    reached: Arc<AtomicUsize>,
}

impl Refusing for Full {
    async fn work(&self) -> Result<(), RpcError> {
        self.reached.fetch_add(1, Ordering::SeqCst);
        Err(RpcError::new(
            StatusCode::OverflowMaxServerHandle,
            "this server refuses every call",
        ))
    }
}

/// Calls the client makes, one after another.
const CALLS: usize = 200;

/// A client of `addr` without retries or breaker (each call is one attempt, and every attempt
/// is made), throttling with `k_percent` (0: off).
fn client(addr: &str, k_percent: u32) -> Client {
    Client::builder()
        .registry(StaticRegistry::new([addr.to_string()]))
        .override_options(
            RefusingClient::SERVICE_ID,
            GovernanceOverrides {
                throttle_k_percent: Some(k_percent),
                retry_times: Some(0),
                enable_circuit_breaker: Some(false),
                ..GovernanceOverrides::NONE
            },
        )
        .build()
}

#[tokio::test]
async fn a_throttling_client_sends_a_server_refusing_everything_far_fewer_calls() {
    let reached = Arc::new(AtomicUsize::new(0));
    let server = Server::builder()
        .add_service(RefusingServer::new(Full {
            reached: reached.clone(),
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let addr = server.local_addr().to_string();

    // The control: without throttling every call reaches the server and is refused there.
    let plain = RefusingClient::new(client(&addr, 0));
    for _ in 0..CALLS {
        let e = within("a call", plain.work()).await.expect_err("refused");
        assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
    }
    assert_eq!(reached.swap(0, Ordering::SeqCst), CALLS);

    // K = 2: with no call accepted, call r goes out with probability 1 / (r + 1), about
    // ln(200) + 0.58 ≈ 6 of 200.
    let throttling = client(&addr, 200);
    let mut events = throttling.events().subscribe();
    let proxy = RefusingClient::new(throttling.clone());
    let (mut refused_there, mut dropped_here) = (0, 0);
    for _ in 0..CALLS {
        let e = within("a call", proxy.work()).await.expect_err("refused");
        match e.code() {
            StatusCode::OverflowMaxServerHandle => refused_there += 1,
            StatusCode::OverflowMaxRequest => {
                assert!(e.message().contains("throttle_k_percent = 200"), "{e}");
                dropped_here += 1;
            }
            other => panic!("unexpected {other:?}: {e}"),
        }
    }
    let seen = reached.load(Ordering::SeqCst);
    assert_eq!(seen, refused_there, "the server counts what it refused");
    assert_eq!(refused_there + dropped_here, CALLS);
    assert!(
        seen <= CALLS / 10,
        "the server saw {seen} of {CALLS} calls despite throttling"
    );
    // Every dropped call was an event.
    let mut throttled = 0;
    while let Ok(e) = events.try_recv() {
        if e.kind == EventKind::Throttled {
            throttled += 1;
        }
    }
    assert_eq!(throttled, dropped_here);
    within("shutdown", server.shutdown()).await;
}
