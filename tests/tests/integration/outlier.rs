//! Outlier ejection by success rate over TCP: among five servers, one that fails one call in
//! four (never often enough in a row for consecutive-failure marks) is ejected when the
//! interval is judged, an `ejection` event names it, and it gets no calls while ejected.
//!
//! The interval ends on tokio's clock: the test stops it, moves it past the interval and lets
//! it run again, so no test step waits for real time to pass.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::within;
use rpc::{
    Client, EndpointState, EventKind, GovernanceOverrides, RpcError, Server, ServerHandle,
    StaticRegistry, StatusCode,
};

#[rpc::service(name = "t.Outlier")]
trait Flaky {
    /// Answers, or (on the flaky server) fails every fourth call with a server error.
    async fn work(&self) -> Result<u32, RpcError>;
}

struct Node {
    flaky: bool,
    served: Arc<AtomicUsize>,
}

impl Flaky for Node {
    async fn work(&self) -> Result<u32, RpcError> {
        let n = self.served.fetch_add(1, Ordering::SeqCst);
        if self.flaky && n.is_multiple_of(4) {
            return Err(RpcError::new(
                StatusCode::ServerError,
                "one call in four fails",
            ));
        }
        Ok(7)
    }
}

/// Calls each server serves in the judged interval: over the request volume of 20.
const ROUNDS: usize = 40;
/// The interval, ended by moving tokio's clock (shorter than the servers' 60 s idle timeout,
/// so no connection is closed by the jump).
const INTERVAL: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_server_failing_one_call_in_four_is_ejected_by_success_rate_and_gets_no_calls() {
    let mut servers: Vec<ServerHandle> = Vec::new();
    let mut served = Vec::new();
    for i in 0..5 {
        let n = Arc::new(AtomicUsize::new(0));
        served.push(n.clone());
        servers.push(
            Server::builder()
                .add_service(FlakyServer::new(Node {
                    flaky: i == 4,
                    served: n,
                }))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    let flaky_addr = servers[4].local_addr().to_string();
    let client = Client::builder()
        .registry(StaticRegistry::new(
            servers.iter().map(|s| s.local_addr().to_string()),
        ))
        .override_options(
            FlakyClient::SERVICE_ID,
            GovernanceOverrides {
                outlier_success_rate: Some(true),
                outlier_request_volume: Some(20),
                outlier_interval_ms: Some(INTERVAL.as_millis() as u64),
                retry_times: Some(0),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let mut events = client.events().subscribe();
    let flaky = FlakyClient::new(client.clone());
    // Round robin: each server gets ROUNDS calls; the flaky one fails a quarter of its own.
    let mut failed = 0;
    for _ in 0..5 * ROUNDS {
        if let Err(e) = within("a call", flaky.work()).await {
            assert_eq!(e.code(), StatusCode::ServerError, "{e}");
            failed += 1;
        }
    }
    assert_eq!(failed, ROUNDS / 4);
    let counts: Vec<usize> = served.iter().map(|n| n.load(Ordering::SeqCst)).collect();
    assert_eq!(counts, [ROUNDS; 5]);
    // Never two failures in a row: consecutive-failure marks left it alone.
    let flaky_state = client
        .endpoints()
        .into_iter()
        .find(|e| e.address == flaky_addr)
        .expect("the flaky endpoint is listed")
        .state;
    assert_eq!(flaky_state, EndpointState::Healthy);
    // The interval ends: the next call's outcome judges it (success rates 1, 1, 1, 1, 0.75).
    tokio::time::pause();
    tokio::time::advance(INTERVAL).await;
    tokio::time::resume();
    let _ = within("the call that ends the interval", flaky.work()).await;
    let ejection = within("the ejection event", async {
        loop {
            let e = events.recv().await.expect("events");
            if e.kind == EventKind::Ejection {
                break e;
            }
        }
    })
    .await;
    assert_eq!(
        ejection.endpoint.as_deref(),
        Some(flaky_addr.as_str()),
        "{ejection:?}"
    );
    let cause = ejection.cause.unwrap_or_default();
    assert!(cause.contains("success rate 75.0 %"), "{cause}");
    assert!(cause.contains("30 of 40 calls"), "{cause}");
    // While ejected (one interval, far longer than the rest of the test on tokio's clock), it
    // gets no calls: the four others serve all of them, and every one succeeds.
    let before: Vec<usize> = served.iter().map(|n| n.load(Ordering::SeqCst)).collect();
    for _ in 0..4 * 10 {
        within("a call while ejected", flaky.work())
            .await
            .expect("the healthy servers answer");
    }
    let after: Vec<usize> = served.iter().map(|n| n.load(Ordering::SeqCst)).collect();
    assert_eq!(after[4], before[4], "the ejected server got calls");
    let healthy: usize = (0..4).map(|i| after[i] - before[i]).sum();
    assert_eq!(healthy, 40);
    for s in servers {
        within("shutdown", s.shutdown()).await;
    }
}
