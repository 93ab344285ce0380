//! The circuit breaker over real TCP, as the README describes it: after the break,
//! `half_open_probes` calls are let through, a successful probe closes the breaker and a failed
//! one opens it again; in ratio mode it opens once the window holds `minimum_throughput` calls
//! of which `failure_ratio_percent` % failed.
//!
//! The remote side answers each call as the test says (every call waits in its handler for a
//! verdict), so which calls reached the server is known exactly. Time is tokio's paused clock:
//! the open period ends by `tokio::time::advance`, never by waiting.

use crate::common;

use std::time::Duration;

use common::{recv_one, within};
use rpc::crates::governance::breaker::BreakerState;
use rpc::crates::governance::events::{EventKind, GovernanceEvent};
use rpc::{
    Client, GovernanceOverrides, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode,
};
use tokio::sync::{broadcast, mpsc, oneshot};

#[rpc::service(name = "b.Remote")]
trait Remote {
    async fn call(&self) -> Result<u32, RpcError>;
}

/// Hands each call's verdict slot to the test: `true` answers, `false` fails with a server
/// error (520, a failure the breaker counts).
struct Judged {
    calls: mpsc::UnboundedSender<oneshot::Sender<bool>>,
}

impl Remote for Judged {
    async fn call(&self) -> Result<u32, RpcError> {
        let (verdict, rx) = oneshot::channel();
        let _ = self.calls.send(verdict);
        match rx.await {
            Ok(true) => Ok(7),
            _ => Err(RpcError::new(
                StatusCode::ServerError,
                "the remote side is down",
            )),
        }
    }
}

/// Long enough that nothing but `tokio::time::advance` ends an open period or a window.
const LONG: u64 = 3600;

struct Setup {
    server: ServerHandle,
    client: Client,
    remote: RemoteClient,
    calls: mpsc::UnboundedReceiver<oneshot::Sender<bool>>,
    events: broadcast::Receiver<GovernanceEvent>,
}

async fn setup(overrides: GovernanceOverrides) -> Setup {
    let (tx, calls) = mpsc::unbounded_channel();
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        // The paused clock jumps by hours: the connection must not idle out meanwhile.
        .idle_timeout(Duration::from_secs(LONG * 48))
        .add_service(RemoteServer::new(Judged { calls: tx }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(reg)
        .override_options(
            RemoteClient::SERVICE_ID,
            GovernanceOverrides {
                // No deadline and no retry: every call is one attempt that ends by its verdict.
                timeout_ms: Some(0),
                retry_times: Some(0),
                breaker_seconds: Some(LONG),
                ..overrides
            },
        )
        .build();
    let events = client.events().subscribe();
    let remote = RemoteClient::new(client.clone());
    Setup {
        server,
        client,
        remote,
        calls,
        events,
    }
}

impl Setup {
    /// Starts a call and waits until it is inside the server's handler.
    async fn enter(&mut self) -> (tokio::task::JoinHandle<Result<u32, RpcError>>, Verdict) {
        let remote = self.remote.clone();
        let call = tokio::spawn(async move { remote.call().await });
        let verdict = recv_one("the call reached the server", &mut self.calls).await;
        (call, Verdict(verdict))
    }

    /// One call that reaches the server and gets `ok` as its answer.
    async fn call(&mut self, ok: bool) -> Result<u32, RpcError> {
        let (call, verdict) = self.enter().await;
        verdict.give(ok);
        within("the call ends", call).await.expect("join")
    }

    /// A call that must fail fast with 522 without reaching the server.
    async fn refused(&mut self, why: &str) {
        let err = within("a call", self.remote.call()).await.expect_err(why);
        assert_eq!(err.code(), StatusCode::CircuitOpen, "{why}: {err}");
        assert!(
            self.calls.try_recv().is_err(),
            "{why}: the call reached the server"
        );
    }

    fn state(&self) -> BreakerState {
        self.client.breaker_state(&RemoteClient::methods()[0])
    }

    /// The breaker events emitted so far, in order.
    fn breaker_events(&mut self) -> Vec<EventKind> {
        std::iter::from_fn(|| self.events.try_recv().ok())
            .map(|e| e.kind)
            .filter(|k| matches!(k, EventKind::Break | EventKind::HalfOpen | EventKind::Reset))
            .collect()
    }
}

struct Verdict(oneshot::Sender<bool>);

impl Verdict {
    fn give(self, ok: bool) {
        let _ = self.0.send(ok);
    }
}

/// Breaks the breaker with one counted failure (it opens after one) and lets the open period
/// pass on the paused clock.
async fn break_then_wait_out(s: &mut Setup) {
    let err = s.call(false).await.expect_err("the remote side fails");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    assert!(
        matches!(s.state(), BreakerState::Open { .. }),
        "{:?}",
        s.state()
    );
    s.refused("open: fails fast").await;
    tokio::time::advance(Duration::from_secs(LONG + 1)).await;
}

#[tokio::test(start_paused = true)]
async fn after_the_break_n_probes_are_let_through_and_a_successful_one_closes() {
    let mut s = setup(GovernanceOverrides {
        exceptions_allowed_before_breaking: Some(1),
        half_open_probes: Some(3),
        ..GovernanceOverrides::NONE
    })
    .await;
    break_then_wait_out(&mut s).await;

    // Three probes reach the server and are held there; a fourth call is refused.
    let mut probes = Vec::new();
    for _ in 0..3 {
        probes.push(s.enter().await);
    }
    assert_eq!(s.state(), BreakerState::HalfOpen { probes: 3 });
    s.refused("three probes in flight: a fourth is not let through")
        .await;

    // One probe succeeds: the breaker closes, and calls flow again.
    let (call, verdict) = probes.remove(0);
    verdict.give(true);
    assert_eq!(within("probe", call).await.expect("join").expect("ok"), 7);
    assert_eq!(s.state(), BreakerState::Closed { failures: 0 });
    assert_eq!(s.call(true).await.expect("closed again"), 7);
    assert_eq!(
        s.breaker_events(),
        [EventKind::Break, EventKind::HalfOpen, EventKind::Reset]
    );

    for (call, verdict) in probes {
        verdict.give(true);
        within("probe", call).await.expect("join").expect("ok");
    }
    s.server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_probe_opens_the_breaker_again() {
    let mut s = setup(GovernanceOverrides {
        exceptions_allowed_before_breaking: Some(1),
        half_open_probes: Some(2),
        ..GovernanceOverrides::NONE
    })
    .await;
    break_then_wait_out(&mut s).await;

    let (first, first_verdict) = s.enter().await;
    let (second, second_verdict) = s.enter().await;
    assert_eq!(s.state(), BreakerState::HalfOpen { probes: 2 });
    s.refused("two probes in flight: a third is not let through")
        .await;

    // The first probe to report fails: open again, for a whole new period.
    first_verdict.give(false);
    let err = within("probe", first)
        .await
        .expect("join")
        .expect_err("failed probe");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    match s.state() {
        BreakerState::Open { retry_after } => {
            assert_eq!(retry_after, Duration::from_secs(LONG), "a new open period")
        }
        other => panic!("a failed probe must reopen the breaker, it is {other:?}"),
    }
    s.refused("reopened: fails fast").await;
    assert_eq!(
        s.breaker_events(),
        [EventKind::Break, EventKind::HalfOpen, EventKind::Break]
    );

    second_verdict.give(true);
    within("probe", second).await.expect("join").ok();
    s.server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn ratio_mode_opens_at_the_ratio_once_the_minimum_throughput_is_reached() {
    let mut s = setup(GovernanceOverrides {
        failure_ratio_percent: Some(60),
        minimum_throughput: Some(10),
        sampling_window_seconds: Some(LONG),
        // Ignored in ratio mode (it would open at the first failure in consecutive mode).
        exceptions_allowed_before_breaking: Some(1),
        ..GovernanceOverrides::NONE
    })
    .await;
    // Worked out by hand, (failed / calls in the window):
    // 5 failures: 5/5 = 100 %, but only 5 calls, under the minimum of 10: closed.
    for i in 1..=5 {
        s.call(false).await.expect_err("fails");
        assert!(
            matches!(s.state(), BreakerState::Closed { .. }),
            "after {i} failures of {i} calls: {:?}",
            s.state()
        );
    }
    // 5 successes: 5/10 = 50 % < 60 %: closed.
    for _ in 0..5 {
        s.call(true).await.expect("answers");
    }
    // 6/11 = 54.5 %, 7/12 = 58.3 %: closed.
    for n in [11, 12] {
        s.call(false).await.expect_err("fails");
        assert!(
            matches!(s.state(), BreakerState::Closed { .. }),
            "after {n} calls: {:?}",
            s.state()
        );
    }
    assert!(s.breaker_events().is_empty(), "nothing opened so far");
    // 8/13 = 61.5 % >= 60 %: open.
    s.call(false).await.expect_err("fails");
    assert!(
        matches!(s.state(), BreakerState::Open { .. }),
        "{:?}",
        s.state()
    );
    assert_eq!(s.breaker_events(), [EventKind::Break]);
    s.refused("open: fails fast").await;
    s.server.shutdown().await;
}
