//! The stack's policies under tokio's paused clock, driven by scripted attempts: each test
//! scripts what the endpoints answer and checks what the layers decided.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rpc_core::{GovernanceOptions, GovernanceOverrides, MethodDescriptor, RpcError, StatusCode};
use tokio::sync::broadcast;
use tokio::time::Instant;

use super::{governed, Balance, CallCx, Pick, Service};
use crate::breaker::BreakerState;
use crate::config::Layers;
use crate::engine::{EntryPolicy, Governance};
use crate::events::{EventKind, GovernanceEvent};
use crate::throttle::Throttle;

/// What a scripted attempt knows when it picks its endpoint.
struct AttemptCtx<'a> {
    #[allow(dead_code)]
    attempt: u32,
    #[allow(dead_code)]
    deadline: Option<Instant>,
    tried: &'a [String],
    #[allow(dead_code)]
    options: &'a GovernanceOptions,
}

/// The scripted `Attempts` mock: endpoint choice and the attempt in one object, adapted to the
/// stack's [`Balance`], [`Pick`] and bottom [`Service`] by [`Scripted`].
trait Attempts: Sync {
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError>;
    fn call(
        &self,
        addr: &str,
        timeout_ms: u32,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + Send;
    fn untried_left(&self, tried: &[String]) -> bool;
    fn listed(&self, addr: &str) -> bool {
        let _ = addr;
        true
    }
    fn any_other(&self, addr: &str, usable: &dyn Fn(&str) -> bool) -> bool {
        let _ = (addr, usable);
        false
    }
    fn any_candidate(&self) -> bool {
        true
    }
}

#[derive(Clone, Copy)]
struct Scripted<A>(A);

fn tried(cx: &CallCx<'_>) -> Vec<String> {
    cx.tried().iter().map(|a| a.to_string()).collect()
}

impl<A: Attempts + Copy + Send> Balance for Scripted<A> {
    type Picker = Scripted<A>;
    async fn picker(&self, _: &CallCx<'_>) -> Result<Self::Picker, RpcError> {
        Ok(*self)
    }
    fn listed(&self, addr: &str, _: &CallCx<'_>) -> bool {
        self.0.listed(addr)
    }
}

impl<A: Attempts + Copy + Send> Pick for Scripted<A> {
    fn next(&mut self, cx: &CallCx<'_>) -> Result<Arc<str>, RpcError> {
        let tried = tried(cx);
        let ctx = AttemptCtx {
            attempt: cx.attempt(),
            deadline: cx.deadline(),
            tried: &tried,
            options: cx.options(),
        };
        self.0.select(&ctx).map(Arc::from)
    }
    fn untried_left(&self, cx: &CallCx<'_>) -> bool {
        self.0.untried_left(&tried(cx))
    }
    fn any_other_usable(&self, addr: &str, cx: &CallCx<'_>) -> bool {
        self.0.any_other(addr, &|e| cx.health().is_usable(e))
    }
    fn any_candidate(&self, _: &CallCx<'_>) -> bool {
        self.0.any_candidate()
    }
}

impl<A: Attempts + Copy + Send> Service for Scripted<A> {
    async fn call(&self, cx: &mut CallCx<'_>, _: Bytes) -> Result<Bytes, RpcError> {
        let addr = cx.endpoint().unwrap_or_default().to_string();
        self.0
            .call(&addr, cx.budget_ms(), cx.attempt_deadline())
            .await
    }
}

impl Governance {
    /// One call of `policy`'s entry through breaker → timeout → retry → the scripted attempts.
    async fn execute<A: Attempts + Copy + Send>(
        &self,
        policy: &EntryPolicy,
        attempts: A,
    ) -> Result<Bytes, RpcError> {
        let policy = self.policy(policy.method());
        let mut cx = CallCx::new(self, policy.clone(), policy.options());
        governed(Scripted(attempts), &[], Scripted(attempts))
            .call(&mut cx, Bytes::new())
            .await
    }
}

/// Scripted attempts: each takes `delay`, then returns the next scripted result (the last
/// one repeats). Records when each attempt started and on which endpoint.
struct Script {
    endpoints: Vec<String>,
    results: Vec<Result<Bytes, RpcError>>,
    delay: Duration,
    /// Whether an attempt stops at the deadline it is given (the transport does); when
    /// false it runs its whole `delay` regardless, and only the engine can stop it.
    honours_deadline: bool,
    /// Endpoints that left the service (every one is listed unless named here).
    left: Vec<String>,
    /// Endpoints that leave the service once an attempt went to them.
    leave_when_called: Vec<String>,
    log: Mutex<Vec<(Duration, String)>>,
    start: Instant,
}

impl Script {
    fn new(results: Vec<Result<Bytes, RpcError>>, delay: Duration) -> Self {
        Script {
            endpoints: vec!["a:1".into(), "b:1".into(), "c:1".into()],
            results,
            delay,
            honours_deadline: true,
            left: Vec::new(),
            leave_when_called: Vec::new(),
            log: Mutex::new(Vec::new()),
            start: Instant::now(),
        }
    }
    fn starts(&self) -> Vec<Duration> {
        self.log.lock().unwrap().iter().map(|(t, _)| *t).collect()
    }
    /// Whether `addr` has left the service.
    fn gone(&self, addr: &str) -> bool {
        self.left.iter().any(|l| l == addr)
            || (self.leave_when_called.iter().any(|l| l == addr)
                && self.log.lock().unwrap().iter().any(|(_, a)| a == addr))
    }
}

impl Attempts for &Script {
    fn listed(&self, addr: &str) -> bool {
        !self.gone(addr)
    }
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
        if !Attempts::any_candidate(self) {
            return Err(RpcError::new(
                StatusCode::NotFindServiceRoute,
                "none is live",
            ));
        }
        let fresh = self.endpoints.iter().find(|e| !ctx.tried.contains(e));
        Ok(fresh.unwrap_or(&self.endpoints[0]).clone())
    }
    async fn call(
        &self,
        addr: &str,
        _timeout_ms: u32,
        deadline: Option<Instant>,
    ) -> Result<Bytes, RpcError> {
        let n = {
            let mut log = self.log.lock().unwrap();
            log.push((self.start.elapsed(), addr.to_string()));
            log.len() - 1
        };
        let work = async {
            tokio::time::sleep(self.delay).await;
            self.results[n.min(self.results.len() - 1)].clone()
        };
        match deadline.filter(|_| self.honours_deadline) {
            Some(d) => tokio::time::timeout_at(d, work)
                .await
                .unwrap_or_else(|_| Err(RpcError::new(StatusCode::Timeout, "late"))),
            None => work.await,
        }
    }
    fn untried_left(&self, tried: &[String]) -> bool {
        self.endpoints.iter().any(|e| !tried.contains(e))
    }
    fn any_other(&self, addr: &str, usable: &dyn Fn(&str) -> bool) -> bool {
        self.endpoints.iter().any(|e| e != addr && usable(e))
    }
    fn any_candidate(&self) -> bool {
        self.endpoints.iter().any(|e| !self.gone(e))
    }
}

/// Asserts that `$p`'s breaker is in state `$state` (a [`BreakerState`] variant), showing the
/// state it is in (after `$why`, when given) otherwise.
macro_rules! assert_breaker {
    ($p:expr, $state:ident $(, $why:literal)?) => {{
        let state = $p.breaker().state();
        assert!(
            matches!(state, BreakerState::$state { .. }),
            concat!($($why, ": ",)? "{:?}"),
            state
        );
    }};
}

static M: MethodDescriptor = MethodDescriptor {
    service_id: "t.T",
    method: "m",
    entry_id: "t.T.m",
    hash_key: None,
    governance: GovernanceOverrides::NONE,
    api: None,
};

fn engine(o: GovernanceOptions) -> Governance {
    Governance::new(Layers {
        code_defaults: o,
        ..Default::default()
    })
}

/// Options that retry three times at once, with `min_per_second` retries a second from the
/// budget (and no percentage of calls), no breaker and no timeout: 0 lets the count allow
/// retries that the budget refuses, a large value leaves the count alone to decide.
fn retries_within_budget(min_per_second: u32) -> GovernanceOptions {
    GovernanceOptions {
        retry_times: 3,
        retry_interval_ms: 0,
        retry_budget_percent: 0,
        retry_budget_min_per_second: min_per_second,
        enable_circuit_breaker: false,
        timeout_ms: 0,
        ..Default::default()
    }
}

fn overflow() -> Result<Bytes, RpcError> {
    Err(RpcError::new(StatusCode::OverflowMaxServerHandle, "full"))
}

fn server_error() -> Result<Bytes, RpcError> {
    Err(RpcError::new(StatusCode::ServerError, "boom"))
}

fn ok() -> Result<Bytes, RpcError> {
    Ok(Bytes::from_static(b"ok"))
}

#[tokio::test(start_paused = true)]
async fn retries_respect_count_and_interval_on_fresh_endpoints() {
    let g = engine(GovernanceOptions {
        retry_times: 2,
        retry_interval_ms: 50,
        timeout_ms: 0,
        ..Default::default()
    });
    let s = Script::new(vec![overflow()], Duration::from_millis(10));
    let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle);
    let ms: Vec<u128> = s.starts().iter().map(|d| d.as_millis()).collect();
    assert_eq!(
        ms,
        [0, 60, 120],
        "1 + retry_times attempts, interval after each"
    );
    assert_eq!(err.tried(), ["a:1", "b:1", "c:1"]);
}

#[tokio::test(start_paused = true)]
async fn the_timeout_covers_all_retries() {
    let g = engine(GovernanceOptions {
        retry_times: 10,
        retry_interval_ms: 0,
        timeout_ms: 200,
        ..Default::default()
    });
    // Attempts ignore the deadline they are given: the engine alone must stop the call at
    // 200 ms, in the middle of the third 70 ms attempt.
    let mut s = Script::new(vec![overflow()], Duration::from_millis(70));
    s.honours_deadline = false;
    let t0 = Instant::now();
    let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::Timeout);
    assert_eq!(t0.elapsed(), Duration::from_millis(200));
    assert_eq!(
        s.starts().len(),
        3,
        "the third attempt was cut by the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn no_retry_when_the_interval_does_not_fit_before_the_deadline() {
    let g = engine(GovernanceOptions {
        retry_times: 10,
        retry_interval_ms: 50,
        timeout_ms: 200,
        ..Default::default()
    });
    let s = Script::new(vec![overflow()], Duration::from_millis(30));
    let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
    // Attempts at 0, 80, 160 ms; at 190 ms only 10 ms are left, less than the interval.
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle);
    assert_eq!(s.starts().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_retried_call_counts_once_toward_the_breaker() {
    let g = engine(GovernanceOptions {
        retry_times: 2,
        timeout_ms: 0,
        ..Default::default()
    });
    let s = Script::new(vec![overflow()], Duration::ZERO);
    let p = g.policy(&M);
    let _ = g.execute(&p, &s).await;
    assert_eq!(s.starts().len(), 3);
    assert_eq!(p.breaker().state(), BreakerState::Closed { failures: 1 });
}

fn died_mid_call() -> Result<Bytes, RpcError> {
    Err(RpcError::new(StatusCode::CommunicationError, "connection closed").maybe_delivered(true))
}

/// A failure of a call still out on an endpoint that left the service (its marks forgotten as
/// it left) is not held against it: a mark made then stayed for good (no success, no second
/// departure cleared it), and a removal had the address probed for the client's life.
/// The only endpoint answered 515 (retried on the same endpoint after the interval, as a
/// server at its cap is) and left while the attempt was out: with no endpoint left a retry
/// could not be sent, so the call ends at once with that failure, counted by the breaker,
/// with no wait, no `retry` event and nothing drawn from the budget. Before, it waited the
/// interval and ended with "no endpoint".
#[tokio::test(start_paused = true)]
async fn a_call_whose_last_endpoint_left_ends_with_its_failure_at_once() {
    let g = engine(GovernanceOptions {
        retry_times: 1,
        retry_interval_ms: 200,
        timeout_ms: 0,
        ..Default::default()
    });
    let p = g.policy(&M);
    let mut events = g.events().subscribe();
    let mut s = Script::new(vec![overflow()], Duration::ZERO);
    s.endpoints = vec!["a:1".into()];
    s.leave_when_called = vec!["a:1".into()];
    let began = Instant::now();
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert_eq!(err.tried(), ["a:1"], "{err}");
    assert_eq!(began.elapsed(), Duration::ZERO, "waited for a retry");
    assert_eq!(s.starts().len(), 1);
    let kinds: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert!(!kinds.contains(&EventKind::Retry), "{kinds:?}");
    assert_eq!(
        p.breaker().state(),
        BreakerState::Closed { failures: 1 },
        "the breaker counts it"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_on_an_endpoint_that_left_leaves_no_mark() {
    let g = engine(GovernanceOptions {
        timeout_ms: 0,
        ..Default::default()
    });
    let p = g.policy(&M);
    let mut s = Script::new(vec![died_mid_call()], Duration::ZERO);
    s.left = vec!["a:1".into()];
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(g.health().is_clear(), "a mark was made");
    // Listed, the same failure is held.
    let s = Script::new(vec![died_mid_call()], Duration::ZERO);
    let _ = g.execute(&p, &s).await;
    assert!(!g.health().is_clear(), "the failure was held");
}

#[tokio::test(start_paused = true)]
async fn one_endpoint_dying_mid_call_does_not_open_the_entry_breaker() {
    let g = engine(GovernanceOptions {
        timeout_ms: 0,
        exceptions_allowed_before_breaking: 3,
        ..Default::default()
    });
    let p = g.policy(&M);
    // Not idempotent: not repeated, but other endpoints were left untried.
    for _ in 0..5 {
        let s = Script::new(vec![died_mid_call()], Duration::ZERO);
        let err = g.execute(&p, &s).await.unwrap_err();
        assert!(err.is_maybe_delivered(), "{err}");
        assert_eq!(s.starts().len(), 1, "not repeated");
    }
    assert_eq!(p.breaker().state(), BreakerState::Closed { failures: 0 });

    // With no endpoint left to go to, the same failures do count.
    for _ in 0..3 {
        let mut s = Script::new(vec![died_mid_call()], Duration::ZERO);
        s.endpoints.truncate(1);
        let _ = g.execute(&p, &s).await;
    }
    assert_breaker!(p, Open);
}

/// Nor while the other endpoints, though the call did not try them, are all marked: with no
/// usable endpoint left, the entry as a whole is failing, and its breaker opens. Before, a
/// call that may not be repeated held every such failure against its endpoint while any
/// endpoint was untried, so the breaker of a service whose every instance dropped its calls
/// never opened.
#[tokio::test(start_paused = true)]
async fn maybe_delivered_failures_count_once_no_other_endpoint_is_usable() {
    let g = engine(GovernanceOptions {
        timeout_ms: 0,
        exceptions_allowed_before_breaking: 3,
        ..Default::default()
    });
    let p = g.policy(&M);
    // b:1 and c:1 failed before (their connections broke): marked, not usable.
    for other in ["b:1", "c:1"] {
        g.health().failure(other, 3);
        assert!(!g.health().is_usable(other));
    }
    for _ in 0..3 {
        let s = Script::new(vec![died_mid_call()], Duration::ZERO);
        let err = g.execute(&p, &s).await.unwrap_err();
        assert!(err.is_maybe_delivered(), "{err}");
        assert_eq!(s.starts().len(), 1, "not repeated");
    }
    assert_breaker!(p, Open);
}

#[tokio::test(start_paused = true)]
async fn cancellation_during_the_interval_stops_attempts_and_is_not_a_timeout() {
    let g = engine(GovernanceOptions {
        retry_times: 5,
        retry_interval_ms: 1000,
        timeout_ms: 60_000,
        ..Default::default()
    });
    let mut events = g.events().subscribe();
    let s = Script::new(vec![overflow()], Duration::ZERO);
    let p = g.policy(&M);
    // The caller gives up 1.5 s in, during the second pause.
    let r = tokio::time::timeout(Duration::from_millis(1500), g.execute(&p, &s)).await;
    assert!(r.is_err());
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(s.starts().len(), 2, "no attempt after the caller left");
    assert_eq!(
        p.breaker().state(),
        BreakerState::Closed { failures: 0 },
        "not counted"
    );
    let kinds: Vec<EventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert!(!kinds.contains(&EventKind::Timeout), "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| **k == EventKind::Retry).count(), 2);
}

#[tokio::test(start_paused = true)]
async fn budget_exhaustion_stops_retries_and_says_so() {
    let g = engine(GovernanceOptions {
        retry_times: 3,
        retry_interval_ms: 0,
        retry_budget_percent: 0,
        retry_budget_min_per_second: 1, // 10 retries per 10 s window
        enable_circuit_breaker: false,
        timeout_ms: 0,
        ..Default::default()
    });
    let mut events = g.events().subscribe();
    let p = g.policy(&M);
    let mut attempts = 0;
    let mut last = None;
    for _ in 0..5 {
        let s = Script::new(vec![overflow()], Duration::ZERO);
        last = Some(g.execute(&p, &s).await.unwrap_err());
        attempts += s.starts().len();
    }
    // 5 calls: 5 first attempts + the 10 retries the budget allows.
    assert_eq!(attempts, 15);
    let err = last.unwrap();
    assert!(err.message().contains("retry budget"), "{err}");
    let kinds: Vec<EventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert!(kinds.contains(&EventKind::BudgetExhausted));
}

/// An endpoint that cannot serve the call (its server does not stream; nothing sent): the
/// call moves on to the next endpoint at once even with the retry budget spent and inside a
/// retried call (chain stop), and a call on endpoints that all cannot names each one tried. A
/// 501 a server answered is not failed over.
#[tokio::test(start_paused = true)]
async fn an_endpoint_that_cannot_serve_the_call_is_left_for_the_next_without_budget_or_chain_stop()
{
    use rpc_core::{RpcContext, RETRY_DEPTH_KEY};
    let cannot = || {
        Err(RpcError::new(StatusCode::NotImplemented, "does not stream")
            .unsupported_by_endpoint(true))
    };
    let served = std::collections::BTreeMap::from([(RETRY_DEPTH_KEY.to_string(), "1".into())]);
    // No retry from the budget; an interval, to see that the move is at once.
    let g = engine(GovernanceOptions {
        retry_interval_ms: 100,
        ..retries_within_budget(0)
    });
    let p = g.policy(&M);
    let s = Script::new(vec![cannot(), ok()], Duration::ZERO);
    let answer = RpcContext::scope(served.clone(), g.execute(&p, &s)).await;
    assert_eq!(answer.expect("the second endpoint answers"), ok().unwrap());
    assert_eq!(s.starts(), [Duration::ZERO, Duration::ZERO], "at once");

    let s = Script::new(vec![cannot()], Duration::ZERO);
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::NotImplemented);
    assert_eq!(err.tried(), ["a:1", "b:1", "c:1"]);

    // Nor is it held against the endpoint's health, whatever its status: a call not sent on
    // the connection of an endpoint that left the registry moves on, leaving no mark.
    let left = || {
        Err(RpcError::new(
            StatusCode::CommunicationError,
            "the endpoint left the registry",
        )
        .unsupported_by_endpoint(true))
    };
    let s = Script::new(vec![left(), ok()], Duration::ZERO);
    let answer = g.execute(&p, &s).await;
    assert_eq!(answer.expect("the next endpoint answers"), ok().unwrap());
    assert!(g.health().is_clear(), "no endpoint marked");

    // With a budget that allows retries, so that only the rule can stop it.
    let g = engine(retries_within_budget(1_000_000));
    let p = g.policy(&M);
    let answered = || {
        Err(RpcError::new(
            StatusCode::NotImplemented,
            "not a streaming method",
        ))
    };
    let s = Script::new(vec![answered(), ok()], Duration::ZERO);
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::NotImplemented);
    assert_eq!(s.starts().len(), 1, "a server's 501 is not failed over");
}

#[tokio::test(start_paused = true)]
async fn reload_takes_effect_on_the_next_call_and_keeps_an_open_breaker_open() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 0,
        exceptions_allowed_before_breaking: 2,
        breaker_seconds: 30,
        ..Default::default()
    });
    let mut events = g.events().subscribe();
    let p = g.policy(&M);
    for _ in 0..2 {
        let s = single(vec![server_error()], Duration::ZERO);
        let _ = g.execute(&p, &s).await;
    }
    assert_breaker!(p, Open);
    g.update_layers(|l| {
        l.runtime.entries.insert(
            "t.T.m".into(),
            GovernanceOverrides {
                timeout_ms: Some(700),
                ..GovernanceOverrides::NONE
            },
        );
    });
    let same = g.policy(&M);
    assert!(Arc::ptr_eq(&p, &same), "the cached pipeline is kept");
    assert_eq!(
        same.options().timeout_ms,
        700,
        "new options without a cache clear"
    );
    assert!(
        matches!(same.breaker().state(), BreakerState::Open { .. }),
        "still open"
    );
    let s = Script::new(vec![ok()], Duration::ZERO);
    assert_eq!(
        g.execute(&same, &s).await.unwrap_err().code(),
        StatusCode::CircuitOpen
    );
    assert!(s.starts().is_empty(), "an open breaker sends nothing");
    let kinds: Vec<EventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert!(
        kinds.contains(&EventKind::Break) && kinds.contains(&EventKind::Reload),
        "{kinds:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn business_errors_pass_through_untouched() {
    let g = engine(GovernanceOptions::default());
    let s = Script::new(vec![Err(RpcError::business("no"))], Duration::ZERO);
    let p = g.policy(&M);
    for _ in 0..5 {
        let err = g.execute(&p, &s).await.unwrap_err();
        assert_eq!(err.code(), StatusCode::BusinessError);
        assert!(err.tried().is_empty());
    }
    assert_eq!(s.starts().len(), 5, "never retried");
    assert_eq!(p.breaker().state(), BreakerState::Closed { failures: 0 });
}

fn single(results: Vec<Result<Bytes, RpcError>>, delay: Duration) -> Script {
    let mut s = Script::new(results, delay);
    s.endpoints.truncate(1);
    s
}

/// An engine whose breaker for `M` is open after counted failures on the only endpoint, and
/// whose `breaker_seconds` (10 s) have just passed: the next call is the half-open probe.
async fn probing() -> (
    Governance,
    Arc<EntryPolicy>,
    broadcast::Receiver<GovernanceEvent>,
) {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 1000,
        exceptions_allowed_before_breaking: 2,
        breaker_seconds: 10,
        half_open_probes: 1,
        ..Default::default()
    });
    let p = g.policy(&M);
    for _ in 0..2 {
        let _ = g
            .execute(&p, &single(vec![server_error()], Duration::ZERO))
            .await;
    }
    assert_breaker!(p, Open);
    tokio::time::advance(Duration::from_secs(10)).await;
    let events = g.events().subscribe();
    (g, p, events)
}

fn kinds(rx: &mut broadcast::Receiver<GovernanceEvent>) -> Vec<EventKind> {
    std::iter::from_fn(|| rx.try_recv().ok())
        .map(|e| e.kind)
        .collect()
}

/// The call after a probe is admitted at once (not 522) and reaches the endpoint.
async fn next_call_goes_through(g: &Governance, p: &EntryPolicy) {
    let s = single(vec![ok()], Duration::ZERO);
    assert_eq!(g.execute(p, &s).await.unwrap(), Bytes::from_static(b"ok"));
    assert_eq!(s.starts().len(), 1);
    assert_eq!(p.breaker().state(), BreakerState::Closed { failures: 0 });
}

#[tokio::test(start_paused = true)]
async fn a_probe_answered_with_an_exempt_error_closes_the_breaker() {
    for answer in [
        RpcError::business("no such item"),
        RpcError::validation("bad name"),
        RpcError::new(StatusCode::NotFindServiceEntry, "no such entry"),
        RpcError::new(StatusCode::RpcUnAuthentication, "bad token"),
        RpcError::new(StatusCode::NotImplemented, "later"),
    ] {
        let (g, p, mut events) = probing().await;
        let s = single(vec![Err(answer.clone())], Duration::ZERO);
        let err = g.execute(&p, &s).await.unwrap_err();
        assert_eq!(
            err.code(),
            answer.code(),
            "the callee's answer reaches the caller"
        );
        assert_eq!(
            p.breaker().state(),
            BreakerState::Closed { failures: 0 },
            "{answer}: the remote side answered, so it is up"
        );
        assert_eq!(kinds(&mut events), [EventKind::HalfOpen, EventKind::Reset]);
        next_call_goes_through(&g, &p).await;
    }
}

fn cannot_serve() -> Result<Bytes, RpcError> {
    Err(RpcError::new(StatusCode::NotImplemented, "does not stream").unsupported_by_endpoint(true))
}

/// A failure retried on an endpoint that cannot serve the call (a detour: nothing sent), with
/// no attempt left after it: the call ends with the failure before the detour, not the
/// detour's 501, and names both endpoints.
#[tokio::test(start_paused = true)]
async fn a_detour_that_uses_up_the_attempts_ends_with_the_failure_before_it() {
    let g = engine(GovernanceOptions {
        retry_times: 1,
        ..retries_within_budget(1_000)
    });
    let p = g.policy(&M);
    // a refuses (515), b cannot serve; c is left untried.
    let s = Script::new(vec![overflow(), cannot_serve()], Duration::ZERO);
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert_eq!(err.tried(), ["a:1", "b:1"]);
}

/// The fallback event of a call of `retry_times` retries whose attempts answer `script` (on
/// the first `endpoints` of a:1, b:1, c:1, untried ones first), answered by a registered
/// fallback.
async fn fallback_event(
    retry_times: u32,
    endpoints: usize,
    script: Vec<Result<Bytes, RpcError>>,
) -> GovernanceEvent {
    let mut s = Script::new(script, Duration::ZERO);
    s.endpoints.truncate(endpoints);
    fallback_event_of(retry_times, &s).await
}

/// The fallback event of a call of `retry_times` retries whose attempts are `attempts`,
/// answered by a registered fallback.
async fn fallback_event_of<A: Attempts + Copy + Send>(
    retry_times: u32,
    attempts: A,
) -> GovernanceEvent {
    let g = engine(GovernanceOptions {
        retry_times,
        ..retries_within_budget(1_000)
    });
    let p = g.policy(&M);
    fallback_events(&g, &p, attempts)
        .await
        .into_iter()
        .find(|e| e.kind == EventKind::Fallback)
        .expect("a fallback event")
}

/// The events of a call of `g` with policy `p` whose attempts are `attempts`, answered by a
/// registered fallback.
async fn fallback_events<A: Attempts + Copy + Send>(
    g: &Governance,
    p: &Arc<EntryPolicy>,
    attempts: A,
) -> Vec<GovernanceEvent> {
    struct Answers;
    impl rpc_core::Service for Answers {
        fn service_id(&self) -> &'static str {
            M.service_id
        }
        fn methods(&self) -> &'static [MethodDescriptor] {
            std::slice::from_ref(&M)
        }
        fn call(&self, _: usize, _: Bytes, _: rpc_core::Codec) -> rpc_core::ServiceFuture {
            Box::pin(async { Ok(Bytes::from_static(b"fallback")) })
        }
    }
    let mut events = g.events().subscribe();
    let fallbacks: super::Fallbacks = [(M.service_id, Arc::new(Answers) as Arc<_>)]
        .into_iter()
        .collect();
    let mut cx = CallCx::new(g, p.clone(), p.options());
    let stack = super::FallbackLayer::new(
        &fallbacks,
        rpc_core::Codec::MsgPack,
        governed(Scripted(attempts), &[], Scripted(attempts)),
    );
    let answer = stack
        .call(&mut cx, Bytes::new())
        .await
        .expect("the fallback answers");
    assert_eq!(&answer[..], b"fallback");
    std::iter::from_fn(|| events.try_recv().ok()).collect()
}

/// A fallback registered for the service but without the call's entry (one older than the
/// entry) does not run: the call fails with its own error, and no `fallback` event says
/// otherwise.
#[tokio::test(start_paused = true)]
async fn a_fallback_without_the_entry_neither_runs_nor_is_reported() {
    static OTHER: MethodDescriptor = MethodDescriptor {
        service_id: "t.T",
        method: "older",
        entry_id: "t.T.older",
        hash_key: None,
        governance: GovernanceOverrides::NONE,
        api: None,
    };
    struct Older;
    impl rpc_core::Service for Older {
        fn service_id(&self) -> &'static str {
            M.service_id
        }
        fn methods(&self) -> &'static [MethodDescriptor] {
            std::slice::from_ref(&OTHER)
        }
        fn call(&self, _: usize, _: Bytes, _: rpc_core::Codec) -> rpc_core::ServiceFuture {
            Box::pin(async { Ok(Bytes::from_static(b"fallback")) })
        }
    }
    let g = engine(GovernanceOptions {
        retry_times: 0,
        ..retries_within_budget(1_000)
    });
    let p = g.policy(&M);
    let mut events = g.events().subscribe();
    let fallbacks: super::Fallbacks = [(M.service_id, Arc::new(Older) as Arc<_>)]
        .into_iter()
        .collect();
    let s = Script::new(vec![overflow()], Duration::ZERO);
    let mut cx = CallCx::new(&g, p.clone(), p.options());
    let stack = super::FallbackLayer::new(
        &fallbacks,
        rpc_core::Codec::MsgPack,
        governed(Scripted(&s), &[], Scripted(&s)),
    );
    let e = stack
        .call(&mut cx, Bytes::new())
        .await
        .expect_err("no fallback answers");
    assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
    let kinds: Vec<EventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert!(!kinds.contains(&EventKind::Fallback), "{kinds:?}");
    assert!(cx.fallback_cause().is_none());
}

/// A fallback answering for a call whose retry was a detour names the endpoint whose failure
/// it answers for, and that attempt's number, not the detour's, which could not serve the
/// call and was sent nothing.
#[tokio::test(start_paused = true)]
async fn a_fallback_after_a_detour_names_the_endpoint_that_failed() {
    // a refuses (515), b cannot serve: the call ends with a's failure, and the fallback runs.
    let fallback = fallback_event(1, 3, vec![overflow(), cannot_serve()]).await;
    assert_eq!(fallback.endpoint.as_deref(), Some("a:1"));
    assert_eq!(fallback.attempt, 0, "a's attempt, the first");
}

/// After a detour the call may go on (a's refusal is retried on a): the fallback then names
/// the last attempt, not the one before the detour.
#[tokio::test(start_paused = true)]
async fn a_fallback_after_a_detour_and_another_attempt_names_the_last_attempt() {
    // a refuses (515), b cannot serve, a refuses again: no attempt left.
    let fallback = fallback_event(2, 2, vec![overflow(), cannot_serve(), overflow()]).await;
    assert_eq!(fallback.endpoint.as_deref(), Some("a:1"));
    assert_eq!(fallback.attempt, 2);
}

/// The retry that follows a detour names the failure it retries, as the fallback does: the
/// endpoint whose failure is decided on and that attempt's number (a's first), not the
/// detour's number, which was b's.
#[tokio::test(start_paused = true)]
async fn a_retry_after_a_detour_names_the_attempt_whose_failure_it_retries() {
    let g = engine(GovernanceOptions {
        retry_times: 2,
        ..retries_within_budget(1_000)
    });
    let p = g.policy(&M);
    let mut s = Script::new(vec![overflow(), cannot_serve(), overflow()], Duration::ZERO);
    s.endpoints.truncate(2);
    let retries: Vec<(Option<String>, u32)> = fallback_events(&g, &p, &s)
        .await
        .into_iter()
        .filter(|e| e.kind == EventKind::Retry)
        .map(|e| (e.endpoint, e.attempt))
        .collect();
    let a = Some("a:1".to_string());
    assert_eq!(retries, [(a.clone(), 0), (a, 0)]);
}

/// A script's attempts with no endpoint left to pick after the first `.0`.
struct PicksUpTo(u32, Script);

impl Attempts for &PicksUpTo {
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
        if ctx.attempt >= self.0 {
            return Err(RpcError::new(
                StatusCode::CommunicationError,
                "no endpoint left",
            ));
        }
        (&self.1).select(ctx)
    }
    async fn call(
        &self,
        addr: &str,
        timeout_ms: u32,
        deadline: Option<Instant>,
    ) -> Result<Bytes, RpcError> {
        (&self.1).call(addr, timeout_ms, deadline).await
    }
    fn untried_left(&self, tried: &[String]) -> bool {
        (&self.1).untried_left(tried)
    }
}

/// A call whose retry finds no endpoint to go to ends before a second attempt is sent: the
/// fallback names the first attempt, whose failure it answers for, and its endpoint.
#[tokio::test(start_paused = true)]
async fn a_fallback_after_a_retry_that_found_no_endpoint_names_the_attempt_that_failed() {
    let attempts = PicksUpTo(1, Script::new(vec![overflow()], Duration::ZERO));
    let fallback = fallback_event_of(1, &attempts).await;
    let cause = fallback.cause.as_deref().unwrap_or_default();
    assert!(
        cause.contains("no endpoint left"),
        "the retry picked: {cause}"
    );
    assert_eq!(fallback.endpoint.as_deref(), Some("a:1"));
    assert_eq!(
        fallback.attempt, 0,
        "the attempt sent, not the one never sent"
    );
}

/// A call whose retry after a detour finds no endpoint to go to ends before a third attempt is
/// sent: the fallback names the failure before the detour (a's refusal, attempt 0), on an
/// endpoint that could serve the call, not the detour, which was sent nothing. Before, it
/// named the detour's endpoint and number.
#[tokio::test(start_paused = true)]
async fn a_fallback_after_a_retried_detour_that_found_no_endpoint_names_the_failure_before_it() {
    // a refuses (515), b cannot serve (c is untried: retried), then no endpoint is found.
    let attempts = PicksUpTo(
        2,
        Script::new(vec![overflow(), cannot_serve()], Duration::ZERO),
    );
    let fallback = fallback_event_of(3, &attempts).await;
    let cause = fallback.cause.as_deref().unwrap_or_default();
    assert!(cause.contains("no endpoint left"), "{cause}");
    assert_eq!(
        attempts.1.log.lock().unwrap().len(),
        2,
        "a and b were tried"
    );
    assert_eq!(
        (fallback.endpoint.as_deref(), fallback.attempt),
        (Some("a:1"), 0)
    );
}

/// The call's timeout event names the attempt its deadline cut, and that attempt's endpoint:
/// here the second, after the first failed at once. Before, it always said attempt 0.
#[tokio::test(start_paused = true)]
async fn the_calls_timeout_event_names_the_attempt_the_deadline_cut() {
    let g = engine(GovernanceOptions {
        timeout_ms: 1000,
        ..retries_within_budget(1_000)
    });
    let mut events = g.events().subscribe();
    let e = Endpoints::new(&[("down:1", 0), ("slow:1", 10_000)]);
    let err = g.execute(&g.policy(&M), &e).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    let timeout = std::iter::from_fn(|| events.try_recv().ok())
        .find(|e| e.kind == EventKind::Timeout)
        .expect("a timeout event");
    assert_eq!(timeout.endpoint.as_deref(), Some("slow:1"));
    assert_eq!(timeout.attempt, 1);
}

/// A failure kept across two detours keeps the number of the attempt it came from: a's
/// refusal is retried after b cannot serve, and the retry finds a unable too.
#[tokio::test(start_paused = true)]
async fn a_fallback_after_two_detours_names_the_attempt_before_the_first() {
    // a refuses (515), b cannot serve, a cannot serve: the call ends with a's refusal.
    let fallback = fallback_event(2, 2, vec![overflow(), cannot_serve(), cannot_serve()]).await;
    assert_eq!(fallback.endpoint.as_deref(), Some("a:1"));
    assert_eq!(fallback.attempt, 0);
}

/// A failure retried on an endpoint that cannot serve the call, then retried again on an
/// endpoint that can (nothing else untried): one retry reached a server, so one retry is drawn
/// from the budget, as with no detour. The budget's floor (10 a window) then serves ten such
/// calls, and the eleventh's retry is refused.
#[tokio::test(start_paused = true)]
async fn a_detour_draws_the_retry_budget_once() {
    // Retries within a floor of WINDOW_SECONDS (10) per window, no ratio.
    let g = engine(retries_within_budget(1));
    let p = g.policy(&M);
    let detoured = || {
        // a refuses (515), b cannot serve, a answers.
        let mut s = Script::new(vec![overflow(), cannot_serve(), ok()], Duration::ZERO);
        s.endpoints.truncate(2);
        s
    };
    for call in 0..10 {
        let s = detoured();
        let answer = g.execute(&p, &s).await;
        assert_eq!(
            answer.map_err(|e| format!("call {call}: {e}")),
            ok().map_err(|e| e.to_string())
        );
        let on: Vec<String> = s
            .log
            .lock()
            .unwrap()
            .iter()
            .map(|(_, e)| e.clone())
            .collect();
        assert_eq!(on, ["a:1", "b:1", "a:1"], "call {call}");
    }
    let s = detoured();
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert!(err.message().contains("retry budget"), "{err}");
}

/// A probe whose only endpoint cannot serve the call (its server does not stream; nothing was
/// sent) says nothing of the remote side: the breaker is not closed by it.
#[tokio::test(start_paused = true)]
async fn a_probe_no_endpoint_could_serve_does_not_close_the_breaker() {
    let (g, p, mut events) = probing().await;
    let cannot =
        RpcError::new(StatusCode::NotImplemented, "does not stream").unsupported_by_endpoint(true);
    let s = single(vec![Err(cannot)], Duration::ZERO);
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::NotImplemented);
    assert!(
        !matches!(p.breaker().state(), BreakerState::Closed { .. }),
        "{:?}",
        p.breaker().state()
    );
    assert!(!kinds(&mut events).contains(&EventKind::Reset));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_probe_frees_its_slot_at_once() {
    let (g, p, _events) = probing().await;
    let slow = single(vec![ok()], Duration::from_secs(5));
    // The caller drops the probe after 100 ms, long before breaker_seconds.
    let r = tokio::time::timeout(Duration::from_millis(100), g.execute(&p, &slow)).await;
    assert!(r.is_err(), "the caller gave up");
    assert_eq!(p.breaker().state(), BreakerState::HalfOpen { probes: 0 });
    next_call_goes_through(&g, &p).await;
}

#[tokio::test(start_paused = true)]
async fn a_panicking_probe_frees_its_slot_at_once() {
    struct Panics;
    impl Attempts for &Panics {
        fn select(&self, _: &AttemptCtx<'_>) -> Result<String, RpcError> {
            Ok("a:1".into())
        }
        async fn call(&self, _: &str, _: u32, _: Option<Instant>) -> Result<Bytes, RpcError> {
            panic!("attempt panicked")
        }
        fn untried_left(&self, _: &[String]) -> bool {
            false
        }
    }
    let (g, p, _events) = probing().await;
    let g = Arc::new(g);
    let task = tokio::spawn({
        let (g, p) = (g.clone(), p.clone());
        async move { g.execute(&p, &Panics).await }
    });
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(p.breaker().state(), BreakerState::HalfOpen { probes: 0 });
    next_call_goes_through(&g, &p).await;
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_times_out_counts_as_a_failure() {
    let (g, p, mut events) = probing().await;
    let hung = single(vec![ok()], Duration::from_secs(60));
    let err = g.execute(&p, &hung).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::Timeout);
    assert_breaker!(p, Open);
    let k = kinds(&mut events);
    assert!(
        k.ends_with(&[EventKind::Timeout, EventKind::Break]),
        "{k:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_probe_failing_maybe_delivered_on_one_endpoint_frees_its_slot() {
    let (g, p, _events) = probing().await;
    // Three endpoints: not idempotent, so not repeated; held against a:1 alone.
    let s = Script::new(vec![died_mid_call()], Duration::ZERO);
    let err = g.execute(&p, &s).await.unwrap_err();
    assert!(err.is_maybe_delivered(), "{err}");
    assert_eq!(p.breaker().state(), BreakerState::HalfOpen { probes: 0 });
    next_call_goes_through(&g, &p).await;
}

/// a:1 is overloaded at the first attempt (515) and answers the next; b:1 is down (its
/// connection refused). Endpoints are picked as the balancer does: untried first, then one
/// that was reached before one that failed to connect.
struct BusyThenDown(std::sync::atomic::AtomicU32);

impl Attempts for &BusyThenDown {
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
        let tried = |e: &str| ctx.tried.iter().any(|t| t == e);
        Ok(if !tried("a:1") || tried("b:1") {
            "a:1"
        } else {
            "b:1"
        }
        .into())
    }
    async fn call(&self, addr: &str, _: u32, _: Option<Instant>) -> Result<Bytes, RpcError> {
        if addr == "b:1" {
            return Err(RpcError::new(
                StatusCode::CommunicationError,
                "connection refused",
            ));
        }
        if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            overflow()
        } else {
            Ok(Bytes::from_static(b"a:1"))
        }
    }
    fn untried_left(&self, tried: &[String]) -> bool {
        ["a:1", "b:1"].iter().any(|e| !tried.iter().any(|t| t == e))
    }
}

/// An overloaded endpoint, then a dead one with nothing untried left: the call goes back to
/// the overloaded one (its overload may have cleared) while attempts remain, rather than
/// giving up as if every endpoint were down.
#[tokio::test(start_paused = true)]
async fn after_an_overload_and_a_dead_endpoint_the_call_goes_back_to_the_overloaded_one() {
    let g = engine(retries_within_budget(10));
    let answer = g
        .execute(&g.policy(&M), &BusyThenDown(Default::default()))
        .await
        .expect("a:1 answers the third attempt");
    assert_eq!(&answer[..], b"a:1");
}

/// The only endpoint refuses the probe (515); by the retry the registry has dropped it, so
/// the retry finds none (404).
struct RefusedThenGone;

impl Attempts for &RefusedThenGone {
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
        if ctx.tried.is_empty() {
            Ok("a:1".into())
        } else {
            Err(RpcError::new(
                StatusCode::NotFindServiceRoute,
                "no endpoint",
            ))
        }
    }
    async fn call(&self, _: &str, _: u32, _: Option<Instant>) -> Result<Bytes, RpcError> {
        overflow()
    }
    fn untried_left(&self, _: &[String]) -> bool {
        true
    }
}

#[tokio::test(start_paused = true)]
async fn a_probe_whose_retry_finds_no_endpoint_does_not_close_the_breaker() {
    let (g, p, _events) = probing().await;
    g.update_layers(|l| {
        l.code_defaults.retry_times = 1;
        l.code_defaults.retry_interval_ms = 0;
    });
    let err = g.execute(&p, &RefusedThenGone).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::NotFindServiceRoute, "{err}");
    // No answer said the service is back: the probe's slot is freed, the breaker not closed.
    assert_eq!(p.breaker().state(), BreakerState::HalfOpen { probes: 0 });
}

#[tokio::test(start_paused = true)]
async fn isolate_and_reset_are_events() {
    let g = engine(GovernanceOptions::default());
    let mut events = g.events().subscribe();
    g.isolate(&M);
    let s = single(vec![ok()], Duration::ZERO);
    let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::CircuitOpen);
    g.reset_breaker(&M);
    g.execute(&g.policy(&M), &s).await.unwrap();
    let got: Vec<(EventKind, String)> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| (e.kind, e.cause.unwrap_or_default()))
        .collect();
    assert_eq!(
        got,
        [
            (EventKind::Isolate, "isolated by an operator".to_string()),
            (EventKind::Reset, "reset by an operator".to_string()),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn an_isolated_entry_stays_refused_with_its_breaker_turned_off() {
    let g = engine(GovernanceOptions {
        enable_circuit_breaker: false,
        ..GovernanceOptions::default()
    });
    let s = single(vec![ok(), ok()], Duration::ZERO);
    g.execute(&g.policy(&M), &s).await.unwrap();
    g.isolate(&M);
    let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::CircuitOpen, "{err}");
    assert!(err.message().contains("isolated by an operator"), "{err}");
    g.reset_breaker(&M);
    g.execute(&g.policy(&M), &s).await.unwrap();
}

/// Two shards: each call has an owner (as a hash key would), and goes to the owner unless
/// endpoint health says it is not usable. `sick` answers with `sick_answer`.
struct Shards<'a> {
    g: &'a Governance,
    owner: &'static str,
    sick: &'static str,
    sick_answer: Result<Bytes, RpcError>,
    answered: Mutex<Vec<String>>,
}

const SHARDS: [&str; 2] = ["a:1", "b:1"];

impl Attempts for &Shards<'_> {
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
        let other = SHARDS.iter().find(|e| **e != self.owner).unwrap();
        let usable =
            self.g.health().is_usable(self.owner) && !ctx.tried.iter().any(|t| t == self.owner);
        Ok(if usable { self.owner } else { other }.to_string())
    }
    async fn call(&self, addr: &str, _: u32, d: Option<Instant>) -> Result<Bytes, RpcError> {
        self.answered.lock().unwrap().push(addr.to_string());
        if addr == self.sick {
            let answer = self.sick_answer.clone();
            if answer
                .as_ref()
                .is_err_and(|e| e.code() == StatusCode::Timeout)
            {
                tokio::time::sleep_until(d.unwrap()).await;
            }
            answer
        } else {
            ok()
        }
    }
    fn untried_left(&self, tried: &[String]) -> bool {
        SHARDS.iter().any(|e| !tried.iter().any(|t| t == e))
    }
    fn any_other(&self, addr: &str, usable: &dyn Fn(&str) -> bool) -> bool {
        SHARDS.iter().any(|e| *e != addr && usable(e))
    }
}

fn late() -> Result<Bytes, RpcError> {
    Err(RpcError::new(StatusCode::Timeout, "late"))
}

/// A timeout of a call never sent (its deadline passed while it waited for room).
fn unsent() -> Result<Bytes, RpcError> {
    Err(RpcError::new(StatusCode::Timeout, "the send queue stayed full").not_sent(true))
}

/// The key's owner `a:1` is sick, answering `sick_answer` (after the attempt's deadline, for
/// a timeout).
fn sick_owner(g: &Governance, sick_answer: Result<Bytes, RpcError>) -> Shards<'_> {
    Shards {
        g,
        owner: "a:1",
        sick: "a:1",
        sick_answer,
        answered: Mutex::new(Vec::new()),
    }
}

#[tokio::test(start_paused = true)]
async fn a_sick_shard_is_ejected_and_the_healthy_shards_keys_keep_succeeding() {
    for sick_answer in [server_error(), late()] {
        let g = engine(GovernanceOptions {
            retry_times: 0,
            timeout_ms: 300,
            exceptions_allowed_before_breaking: 3,
            ..Default::default()
        });
        let p = g.policy(&M);
        let mut sick_failed = 0;
        for i in 0..200 {
            let owner = SHARDS[i % 2];
            let s = Shards {
                g: &g,
                owner,
                sick: "a:1",
                sick_answer: sick_answer.clone(),
                answered: Mutex::new(Vec::new()),
            };
            let r = g.execute(&p, &s).await;
            if owner == "b:1" {
                assert!(r.is_ok(), "call {i}: healthy shard's key failed: {r:?}");
            } else if let Err(e) = r {
                assert_ne!(e.code(), StatusCode::CircuitOpen, "call {i}");
                sick_failed += 1;
            }
        }
        // Ejected after exceptions_allowed_before_breaking failures; its keys then go to
        // the other shard (the calls are too quick for the 1 s mark to expire, except
        // with 300 ms timeouts: then each expiry costs one more failure).
        assert!(sick_failed >= 3, "{sick_failed}");
        assert!(sick_failed <= 3 + 100 * 300 / 1000, "{sick_failed}");
        assert_breaker!(p, Closed);
    }
}

/// A call whose inherited deadline passed before it began sends nothing, even as the entry's
/// first attempt that waited for nothing (which skips reading the clock): a frame with a 1 ms
/// budget would run a handler after the whole chain gave up.
#[tokio::test(start_paused = true)]
async fn a_call_begun_past_its_inherited_deadline_sends_nothing() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 1000,
        ..Default::default()
    });
    let p = g.policy(&M);
    let s = Script::new(vec![ok(), ok()], Duration::from_millis(1));
    assert!(g.execute(&p, &s).await.is_ok(), "the entry is known");
    let sent = s.log.lock().unwrap().len();
    let passed = Instant::now() - Duration::from_millis(1);
    let e = crate::timeout::with_inherited(Some(passed), g.execute(&p, &s))
        .await
        .expect_err("out of time");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert_eq!(s.log.lock().unwrap().len(), sent, "no attempt went out");
}

/// Calls that run out of the deadline inherited from the call they serve (5 ms left of it,
/// where the entry allows 1 s and the endpoint answers in 20 ms) say nothing of the endpoint
/// nor of the entry: none is held against an endpoint, the breaker stays closed, and a call
/// given its own time then succeeds.
#[tokio::test(start_paused = true)]
async fn running_out_of_the_callers_time_is_no_fault_of_the_endpoint() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 1000,
        deadline_slack_ms: 0,
        exceptions_allowed_before_breaking: 3,
        ..Default::default()
    });
    let p = g.policy(&M);
    let s = Script::new(vec![ok()], Duration::from_millis(20));
    for i in 0..20 {
        let left = Instant::now() + Duration::from_millis(5);
        let r = crate::timeout::with_inherited(Some(left), g.execute(&p, &s)).await;
        let e = r.expect_err("5 ms is too little");
        assert_eq!(e.code(), StatusCode::Timeout, "call {i}: {e}");
        assert!(e.message().contains("inherited"), "call {i}: {e}");
    }
    assert!(
        s.endpoints.iter().all(|e| g.health().is_usable(e)),
        "no endpoint is held to blame"
    );
    assert_breaker!(p, Closed);
    assert!(g.execute(&p, &s).await.is_ok(), "with its own time");
}

#[tokio::test(start_paused = true)]
async fn the_entry_breaker_still_opens_when_every_endpoint_fails() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 0,
        exceptions_allowed_before_breaking: 3,
        ..Default::default()
    });
    let p = g.policy(&M);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut calls = 0;
    while !matches!(p.breaker().state(), BreakerState::Open { .. }) {
        calls += 1;
        assert!(calls <= 30, "the breaker never opened");
        // Round robin over three endpoints that all fail, preferring usable ones.
        let s = Script::new(vec![server_error()], Duration::ZERO);
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let usable: Vec<&String> = s
            .endpoints
            .iter()
            .filter(|e| g.health().is_usable(e))
            .collect();
        let pick = if usable.is_empty() {
            s.endpoints[n % 3].clone()
        } else {
            usable[n % usable.len()].clone()
        };
        let mut s = s;
        s.endpoints.retain(|e| *e == pick);
        s.endpoints.extend(
            ["a:1", "b:1", "c:1"]
                .map(String::from)
                .into_iter()
                .filter(|e| *e != pick),
        );
        let _ = g.execute(&p, &s).await;
    }
    // Each endpoint is ejected after its 3rd failure (calls 7, 8, 9) and those failures
    // are held against it while another is usable; from the 9th on none is, and the
    // entry counts 3 in a row: 9, 10, 11.
    assert_eq!(calls, 11);
    // One endpoint: counted from the first failure, as before.
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 0,
        exceptions_allowed_before_breaking: 3,
        ..Default::default()
    });
    let p = g.policy(&M);
    for _ in 0..3 {
        let _ = g
            .execute(&p, &single(vec![server_error()], Duration::ZERO))
            .await;
    }
    assert_breaker!(p, Open);
}

/// Attempts of 100 ms within a call of 1 s, retried twice at once.
fn attempts_of_100_ms(idempotent: bool) -> GovernanceOptions {
    GovernanceOptions {
        retry_times: 2,
        retry_interval_ms: 0,
        timeout_ms: 1000,
        attempt_timeout_ms: 100,
        idempotent,
        ..Default::default()
    }
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_call_retries_elsewhere_after_its_attempt_timeout() {
    let g = engine(attempts_of_100_ms(true));
    let p = g.policy(&M);
    let s = sick_owner(&g, late());
    let t0 = Instant::now();
    assert!(g.execute(&p, &s).await.is_ok());
    assert_eq!(t0.elapsed(), Duration::from_millis(100));
    assert_eq!(*s.answered.lock().unwrap(), ["a:1", "b:1"]);
    // Not idempotent: the timed-out attempt may have run, so it is not repeated.
    g.update_layers(|l| l.code_defaults.idempotent = false);
    let err = g.execute(&p, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::Timeout);
    assert!(err.message().contains("attempt_timeout_ms"), "{err}");
}

/// A call whose attempt timeout passed before it was even sent (the transport's send queue
/// stayed full) reached no server: even not idempotent, it goes to the other endpoint, and is
/// not reported as maybe run. Before, it was taken for a timeout of a sent call: the
/// non-idempotent call gave up, saying the server was told to stop.
#[tokio::test(start_paused = true)]
async fn a_call_not_sent_within_its_attempt_timeout_goes_elsewhere_even_not_idempotent() {
    let g = engine(attempts_of_100_ms(false));
    let p = g.policy(&M);
    let s = sick_owner(&g, unsent());
    let t0 = Instant::now();
    g.execute(&p, &s).await.expect("b:1 answers");
    assert_eq!(t0.elapsed(), Duration::from_millis(100));
    assert_eq!(*s.answered.lock().unwrap(), ["a:1", "b:1"]);
}

/// A call whose deadline passed while it waited to be sent (not sent, no attempt timeout)
/// is told as the call's timeout, and still as one never sent: the timeout layer's message
/// keeps the error's flags. Before, it rebuilt the error with the maybe-delivered flag only.
#[tokio::test(start_paused = true)]
async fn a_call_timing_out_unsent_at_its_deadline_is_still_said_not_sent() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 1000,
        ..Default::default()
    });
    let p = g.policy(&M);
    let s = sick_owner(&g, unsent());
    let e = g.execute(&p, &s).await.expect_err("the deadline passed");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert!(e.message().contains("when it passed"), "{e}");
    assert!(e.is_not_sent(), "{e}");
    assert!(!e.is_maybe_delivered(), "{e}");
}

/// ... and with a single endpoint, it is tried again within the retries: the endpoint is
/// connected, only slow to read, not down.
#[tokio::test(start_paused = true)]
async fn a_call_not_sent_within_its_attempt_timeout_is_retried_on_its_only_endpoint() {
    let g = engine(attempts_of_100_ms(true));
    let s = single(vec![unsent(), ok()], Duration::from_millis(100));
    let t0 = Instant::now();
    g.execute(&g.policy(&M), &s)
        .await
        .expect("the second attempt answers");
    assert_eq!(t0.elapsed(), Duration::from_millis(200));
    assert_eq!(s.starts().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_519_the_server_answers_before_any_deadline_is_its_answer_not_a_timeout_of_ours() {
    let g = engine(GovernanceOptions {
        retry_times: 2,
        retry_interval_ms: 0,
        timeout_ms: 2000,
        attempt_timeout_ms: 500,
        idempotent: true,
        ..Default::default()
    });
    let mut events = g.events().subscribe();
    // The server's own deadline down the chain ran out: it answers 519 after 10 ms, once
    // plainly and once as a typed error with a payload.
    let plain = RpcError::new(
        StatusCode::Timeout,
        "the inventory service ran out of its budget",
    );
    let typed = plain
        .clone()
        .with_payload(rpc_core::Codec::Json, Bytes::from_static(b"\"typed\""));
    for answered in [plain, typed] {
        let s = Script::new(vec![Err(answered.clone())], Duration::from_millis(10));
        let t0 = Instant::now();
        let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
        assert_eq!(t0.elapsed(), Duration::from_millis(10));
        assert_eq!(s.starts().len(), 1, "a server's 519 is not retried: {err}");
        assert_eq!(err.code(), StatusCode::Timeout);
        assert_eq!(err.message(), answered.message(), "{err}");
        assert_eq!(err.payload(), answered.payload());
        assert!(!err.is_maybe_delivered(), "{err}");
        assert!(
            !kinds(&mut events).contains(&EventKind::Timeout),
            "no deadline of ours passed"
        );
    }
}

/// Work before the stack (an entry's first call finding its service) counts against the
/// call's deadline, but not against its first attempt's own: that attempt gets its whole
/// `attempt_timeout_ms` from when it really starts.
#[tokio::test(start_paused = true)]
async fn an_attempt_started_late_by_work_before_the_stack_gets_its_whole_attempt_timeout() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 1000,
        attempt_timeout_ms: 100,
        ..Default::default()
    });
    let p = g.policy(&M);
    let call_started = Instant::now();
    // 80 ms looking the service up, then an attempt answered after 90 ms.
    tokio::time::advance(Duration::from_millis(80)).await;
    let s = single(vec![ok()], Duration::from_millis(90));
    let mut cx = CallCx::new(&g, p.clone(), p.options()).with_started(call_started);
    let answer = governed(Scripted(&s), &[], Scripted(&s))
        .call(&mut cx, Bytes::new())
        .await;
    assert_eq!(answer.unwrap(), Bytes::from_static(b"ok"));
    assert_eq!(call_started.elapsed(), Duration::from_millis(170));
}

/// A bottom stage that promises to end each attempt at its deadline by itself (as the client's
/// attempt does through its connection's deadline sweeper).
struct Promising<A>(Scripted<A>);

impl<A: Attempts + Copy + Send> Service for Promising<A> {
    fn call(
        &self,
        cx: &mut CallCx<'_>,
        req: Bytes,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + Send {
        self.0.call(cx, req)
    }
    fn enforces_attempt_deadline(&self) -> bool {
        true
    }
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_ends_at_its_deadline_itself_gets_no_second_timer() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 200,
        ..Default::default()
    });
    // The attempt breaks its promise (it runs its whole 1 s): the call ending at 1 s, not at
    // 200 ms, shows that the retry layer armed no timer of its own. The same script without
    // the promise is cut at 200 ms (`the_timeout_covers_all_retries`).
    let mut s = Script::new(vec![ok()], Duration::from_millis(1_000));
    s.honours_deadline = false;
    let policy = g.policy(&M);
    let mut cx = CallCx::new(&g, policy.clone(), policy.options());
    let t0 = Instant::now();
    let answer = governed(Scripted(&s), &[], Promising(Scripted(&s)))
        .call(&mut cx, Bytes::new())
        .await;
    assert_eq!(t0.elapsed(), Duration::from_millis(1_000));
    assert_eq!(answer.unwrap(), Bytes::from_static(b"ok"));
    // Behind a user layer the promise no longer holds: the retry layer's timer is back.
    let layers: Vec<Arc<dyn super::Middleware>> = vec![Arc::new(PassOn)];
    let mut cx = CallCx::new(&g, policy.clone(), policy.options());
    let t0 = Instant::now();
    let err = governed(
        Scripted(&s),
        &[],
        super::Layered::new(&layers, Promising(Scripted(&s))),
    )
    .call(&mut cx, Bytes::new())
    .await
    .unwrap_err();
    assert_eq!(err.code(), StatusCode::Timeout);
    assert_eq!(t0.elapsed(), Duration::from_millis(200));
}

/// A user layer that passes every call on.
struct PassOn;

/// A per-attempt layer asking, on every attempt, to be told of the stream's end.
struct HooksEachAttempt<S>(S);

impl<S: Service> Service for HooksEachAttempt<S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        cx.on_stream_end(|_| ());
        self.0.call(cx, req).await
    }
}

/// Of three attempts at a stream's set-up (two refused for overload, the third accepted), only
/// the third's end hook is kept for the stream's end.
#[tokio::test(start_paused = true)]
async fn a_failed_attempts_stream_end_hooks_are_dropped() {
    let g = engine(GovernanceOptions {
        retry_times: 2,
        retry_interval_ms: 0,
        timeout_ms: 0,
        ..Default::default()
    });
    let s = Script::new(vec![overflow(), overflow(), ok()], Duration::ZERO);
    let policy = g.policy(&M);
    let mut cx = CallCx::new(&g, policy.clone(), policy.options());
    governed(Scripted(&s), &[], HooksEachAttempt(Scripted(&s)))
        .call(&mut cx, Bytes::new())
        .await
        .expect("the third attempt");
    assert_eq!(s.starts().len(), 3);
    assert_eq!(cx.take_stream_end_hooks().len(), 1);
}

impl super::Middleware for PassOn {
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: super::Next<'a>,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes, RpcError>> {
        next.run(cx, req)
    }
}

// ------------------------------------------------------------------ chain stop and throttling

#[tokio::test(start_paused = true)]
async fn a_call_made_while_serving_a_retried_call_is_not_retried_again() {
    use rpc_core::{RpcContext, RETRY_DEPTH_KEY};
    let served = std::collections::BTreeMap::from([(RETRY_DEPTH_KEY.to_string(), "1".into())]);
    for (chain_stop, attempts) in [(true, 1), (false, 4)] {
        let g = engine(GovernanceOptions {
            retry_times: 3,
            retry_interval_ms: 0,
            timeout_ms: 0,
            retry_chain_stop: chain_stop,
            ..Default::default()
        });
        let s = Script::new(vec![overflow()], Duration::ZERO);
        let err = RpcContext::scope(served.clone(), g.execute(&g.policy(&M), &s))
            .await
            .unwrap_err();
        assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle);
        assert_eq!(
            s.starts().len(),
            attempts,
            "retry_chain_stop = {chain_stop}"
        );
        if chain_stop {
            assert!(err.message().contains("retry_chain_stop"), "{err}");
        }
    }
    // Outside a retried call (no attachment), retries run as configured.
    let g = engine(GovernanceOptions {
        retry_times: 3,
        retry_interval_ms: 0,
        timeout_ms: 0,
        ..Default::default()
    });
    let s = Script::new(vec![overflow()], Duration::ZERO);
    g.execute(&g.policy(&M), &s).await.unwrap_err();
    assert_eq!(s.starts().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn under_the_chain_stop_a_call_still_fails_over_from_an_endpoint_it_never_reached() {
    use rpc_core::{RpcContext, RETRY_DEPTH_KEY};
    let served = std::collections::BTreeMap::from([(RETRY_DEPTH_KEY.to_string(), "1".into())]);
    let g = engine(GovernanceOptions {
        retry_times: 3,
        retry_interval_ms: 0,
        timeout_ms: 0,
        ..Default::default()
    });
    // The first endpoint refuses the connection (nothing sent), the second answers.
    let refused = Err(RpcError::new(
        StatusCode::CommunicationError,
        "connection refused",
    ));
    let s = Script::new(vec![refused, ok()], Duration::ZERO);
    let answer = RpcContext::scope(served.clone(), g.execute(&g.policy(&M), &s))
        .await
        .expect("failed over to the second endpoint");
    assert_eq!(&answer[..], b"ok");
    assert_eq!(s.starts().len(), 2);
    // A refusal the server made is still not retried.
    let s = Script::new(vec![overflow(), ok()], Duration::ZERO);
    let err = RpcContext::scope(served, g.execute(&g.policy(&M), &s))
        .await
        .unwrap_err();
    assert_eq!(s.starts().len(), 1, "{err}");
}

fn throttled(k_percent: u32, retry_times: u32) -> Governance {
    engine(GovernanceOptions {
        throttle_k_percent: k_percent,
        retry_times,
        retry_interval_ms: 50,
        ..retries_within_budget(1_000_000)
    })
}

fn too_many_requests() -> Result<Bytes, RpcError> {
    Err(RpcError::new(StatusCode::from_u32(429), "rate limited"))
}

#[tokio::test(start_paused = true)]
async fn throttling_sends_a_server_that_refuses_everything_almost_nothing() {
    for refusal in [overflow(), too_many_requests()] {
        let g = throttled(200, 0);
        let s = Script::new(vec![refusal.clone()], Duration::ZERO);
        let mut dropped = 0;
        for _ in 0..1000 {
            let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
            if err.code() == StatusCode::OverflowMaxRequest {
                assert!(err.message().contains("dropped by this client"), "{err}");
                dropped += 1;
            }
        }
        // With no accepts the rule drops call r with probability r / (r + 1): about
        // ln(1000) + 0.58 ≈ 7.5 of 1000 calls go out (see throttle.rs); throttling off, 1000.
        let sent = s.starts().len();
        assert!(sent < 30, "{sent} of 1000 calls sent ({refusal:?})");
        assert_eq!(sent + dropped, 1000);
    }
    let g = throttled(0, 0);
    let s = Script::new(vec![overflow()], Duration::ZERO);
    for _ in 0..1000 {
        g.execute(&g.policy(&M), &s).await.unwrap_err();
    }
    assert_eq!(s.starts().len(), 1000, "throttle_k_percent = 0 is off");
}

/// A server that is down (its connections fail) is not accepting calls either, and drops
/// follow; the drop says what was not accepted, not that the server refused calls for
/// overload, which it never did (before: "the server refused most recent calls for overload
/// ... raise the server's capacity", the wrong remedy for a server that is down).
#[tokio::test(start_paused = true)]
async fn a_drop_for_calls_that_failed_to_connect_does_not_blame_overload() {
    let g = throttled(200, 0);
    let s = Script::new(
        vec![Err(RpcError::new(
            StatusCode::CommunicationError,
            "refused",
        ))],
        Duration::ZERO,
    );
    let mut dropped = None;
    for _ in 0..100 {
        let e = g.execute(&g.policy(&M), &s).await.unwrap_err();
        if e.code() == StatusCode::OverflowMaxRequest {
            dropped = Some(e);
            break;
        }
    }
    let e = dropped.expect("calls were dropped");
    assert!(
        !e.message().contains("for overload, so") && e.message().contains("not connected"),
        "{e}"
    );
}

#[tokio::test(start_paused = true)]
async fn answers_other_than_overload_refusals_count_as_accepts() {
    // Business errors and server errors are the server accepting the call: with K = 2 the
    // probability max(0, (r − 2a) / (r + 1)) stays 0 while a = r, so nothing is dropped.
    for answer in [ok(), Err(RpcError::business("no")), server_error()] {
        let g = throttled(200, 0);
        let s = Script::new(vec![answer.clone()], Duration::ZERO);
        for _ in 0..1000 {
            let _ = g.execute(&g.policy(&M), &s).await;
        }
        assert_eq!(s.starts().len(), 1000, "{answer:?}");
    }
}

/// An attempt that went nowhere (a detour: its endpoint cannot serve the call) asked no server
/// anything: it counts neither as a request nor as an accept, so calls refused for overload
/// after a detour are throttled as any refused calls are.
#[tokio::test(start_paused = true)]
async fn a_detour_counts_neither_as_a_request_nor_as_an_accept() {
    let g = throttled(200, 1);
    let mut refused = 0;
    for _ in 0..1000 {
        // a cannot serve the call, b refuses it for overload.
        let s = Script::new(vec![cannot_serve(), overflow()], Duration::ZERO);
        let _ = g.execute(&g.policy(&M), &s).await;
        refused += s
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, e)| e == "b:1")
            .count();
    }
    // One request and no accept per call: about ln(1000) + 0.58 ≈ 7.5 of 1000 calls reach b
    // (see throttle.rs). Counted as a request and an accept, the detour would keep the drop
    // probability at (2r − 2r) / (2r + 1) = 0, and all 1000 would.
    assert!(
        refused < 30,
        "{refused} of 1000 calls reached the refusing endpoint"
    );
    // With K = 1, calls answered after a detour are one request and one accept each, and
    // nothing is dropped; counted as a request, each detour would bring the probability to
    // (2r − r) / (2r + 1), about one half.
    let g = throttled(100, 1);
    for call in 0..1000 {
        let s = Script::new(vec![cannot_serve(), ok()], Duration::ZERO);
        let answer = g.execute(&g.policy(&M), &s).await;
        assert!(answer.is_ok(), "call {call}: {answer:?}");
    }
}

/// The throttle of `policy` (made with K = 2 over 10 s), having seen `requests` requests now,
/// `accepts` of them accepted.
fn throttle_with(policy: &EntryPolicy, requests: u32, accepts: u32) -> &Throttle {
    let t = policy
        .throttle
        .get_or_init(|| Throttle::new(2.0, Duration::from_secs(10)));
    for _ in 0..requests {
        t.admit_at(Instant::now(), 1.0);
    }
    for _ in 0..accepts {
        t.accepted_at(Instant::now());
    }
    t
}

#[tokio::test(start_paused = true)]
async fn a_dropped_attempt_fails_the_call_at_once_and_is_not_retried() {
    let g = throttled(200, 3);
    let policy = g.policy(&M);
    // 1000 refused requests in the window: the next one is dropped with p = 1000 / 1001.
    throttle_with(&policy, 1000, 0);
    let mut events = g.events().subscribe();
    let s = Script::new(vec![overflow()], Duration::ZERO);
    let t0 = Instant::now();
    let err = g.execute(&policy, &s).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::OverflowMaxRequest, "{err}");
    assert!(err.message().contains("throttle_k_percent"), "{err}");
    assert_eq!(s.starts().len(), 0, "nothing was sent");
    assert_eq!(
        t0.elapsed(),
        Duration::ZERO,
        "no retry pause: failed at once"
    );
    let e = events.try_recv().expect("one event");
    assert_eq!(e.kind, EventKind::Throttled);
    assert!(events.try_recv().is_err(), "no retry event after the drop");
}

/// A retry that adaptive throttling drops (never sent) ends the call with the drop: a fallback
/// answering for it names the dropped attempt's number with the endpoint it was for, as the
/// `throttled` event does. Before, it named the dropped attempt's number beside the previous
/// attempt's endpoint.
#[tokio::test(start_paused = true)]
async fn a_fallback_after_a_throttled_retry_names_the_dropped_attempt_and_its_endpoint() {
    let g = throttled(200, 1);
    let policy = g.policy(&M);
    // Drop probability about 0.5: (r - 2a) / (r + 1) with 1000 requests and 250 accepts.
    let t = throttle_with(&policy, 1000, 250);
    // The throttle's draws are a fixed sequence: skip to where the first attempt's is high
    // (sent) and the retry's low (dropped), read from a throttle of the same sequence.
    let twin = Throttle::new(2.0, Duration::from_secs(10));
    let draws: Vec<f64> = (0..10_000).map(|_| twin.draw()).collect();
    let skip = draws
        .windows(2)
        .position(|d| d[0] > 0.9 && d[1] < 0.1)
        .expect("such draws within 10 000");
    for _ in 0..skip {
        t.draw();
    }
    let s = Script::new(vec![overflow()], Duration::ZERO);
    let events = fallback_events(&g, &policy, &s).await;
    assert_eq!(s.starts().len(), 1, "the retry was dropped, not sent");
    let of = |kind| {
        events
            .iter()
            .find(|e| e.kind == kind)
            .unwrap_or_else(|| panic!("a {kind:?} event in {events:?}"))
    };
    let (dropped, fallback) = (of(EventKind::Throttled), of(EventKind::Fallback));
    assert_eq!(dropped.attempt, 1, "the retry was dropped");
    let first = s.log.lock().unwrap()[0].1.clone();
    assert_ne!(dropped.endpoint.as_deref(), Some(first.as_str()));
    assert_eq!(
        (fallback.endpoint.as_deref(), fallback.attempt),
        (dropped.endpoint.as_deref(), 1)
    );
}

/// After a runtime change of K, the drop's message states the probability the drop was decided
/// with (the new K), not the one of the K the throttle was made with.
#[tokio::test(start_paused = true)]
async fn a_drop_states_the_probability_of_the_k_in_force() {
    let g = throttled(100, 0);
    let policy = g.policy(&M);
    // Made when K was 2; 1000 requests, 400 accepted: p = (1000 - 400) / 1001 = 60 % with
    // K = 1, and (1000 - 800) / 1001 = 20 % with K = 2.
    throttle_with(&policy, 1000, 400);
    let s = Script::new(vec![overflow()], Duration::ZERO);
    let mut dropped = None;
    for _ in 0..50 {
        let err = g.execute(&policy, &s).await.unwrap_err();
        if err.code() == StatusCode::OverflowMaxRequest {
            dropped = Some(err);
            break;
        }
    }
    let err = dropped.expect("a drop within 50 calls at p = 60 %");
    assert!(
        err.message().contains("probability 60 %"),
        "the K in force is 1: {err}"
    );
}

#[tokio::test(start_paused = true)]
async fn calls_go_out_again_once_the_refusals_leave_the_window() {
    let g = throttled(200, 0);
    let refusing = Script::new(vec![overflow()], Duration::ZERO);
    for _ in 0..200 {
        let _ = g.execute(&g.policy(&M), &refusing).await;
    }
    assert!(refusing.starts().len() < 20);
    tokio::time::advance(Duration::from_secs(11)).await;
    let healthy = Script::new(vec![ok()], Duration::ZERO);
    for _ in 0..100 {
        g.execute(&g.policy(&M), &healthy)
            .await
            .expect("sent and answered");
    }
    assert_eq!(healthy.starts().len(), 100);
}

// --------------------------------------------------------------------------------- hedging

/// Per attempt: endpoint, start, and when it finished (`None`: dropped before).
type AttemptLog = Arc<Mutex<Vec<(String, Duration, Option<Duration>)>>>;

/// Attempts whose endpoint sets how long they take (then they succeed with the endpoint's
/// name); records each attempt's start and whether it completed or was dropped.
struct Endpoints {
    delays: Vec<(&'static str, Duration)>,
    start: Instant,
    /// (endpoint, started at, finished: Some(at) or dropped: None)
    log: AttemptLog,
}

impl Endpoints {
    fn new(delays: &[(&'static str, u64)]) -> Self {
        Endpoints {
            delays: delays
                .iter()
                .map(|(e, ms)| (*e, Duration::from_millis(*ms)))
                .collect(),
            start: Instant::now(),
            log: Arc::default(),
        }
    }
    fn log(&self) -> AttemptLogView {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|(e, s, f)| (e.clone(), s.as_millis(), f.map(|f| f.as_millis())))
            .collect()
    }
}

/// Marks the attempt's log entry finished unless dropped first.
struct Finish {
    log: AttemptLog,
    i: usize,
    start: Instant,
    done: bool,
}

impl Drop for Finish {
    fn drop(&mut self) {
        if self.done {
            self.log.lock().unwrap()[self.i].2 = Some(self.start.elapsed());
        }
    }
}

impl Attempts for &Endpoints {
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
        let fresh = self
            .delays
            .iter()
            .find(|(e, _)| !ctx.tried.iter().any(|t| t == e));
        Ok(fresh.unwrap_or(&self.delays[0]).0.to_string())
    }
    async fn call(
        &self,
        addr: &str,
        _timeout_ms: u32,
        _deadline: Option<Instant>,
    ) -> Result<Bytes, RpcError> {
        let i = {
            let mut log = self.log.lock().unwrap();
            log.push((addr.to_string(), self.start.elapsed(), None));
            log.len() - 1
        };
        let mut finish = Finish {
            log: self.log.clone(),
            i,
            start: self.start,
            done: false,
        };
        let delay = self
            .delays
            .iter()
            .find(|(e, _)| *e == addr)
            .map_or(Duration::ZERO, |(_, d)| *d);
        tokio::time::sleep(delay).await;
        finish.done = true;
        if addr.starts_with("down:") {
            return Err(RpcError::new(
                StatusCode::CommunicationError,
                "connect failed",
            ));
        }
        if addr.starts_with("unable:") {
            return cannot_serve();
        }
        if addr.starts_with("busy:") {
            // The server's own refusal: it was reached, and a retry may be served.
            return Err(RpcError::new(
                StatusCode::OverflowMaxServerHandle,
                "server busy",
            ));
        }
        if addr.starts_with("over:") {
            // The transport's own refusal of a call over the server's limits: nothing sent.
            return Err(RpcError::new(
                StatusCode::ValidateError,
                "more attachments than the server takes",
            )
            .unsupported_by_endpoint(true));
        }
        Ok(Bytes::from(addr.to_string()))
    }
    fn untried_left(&self, tried: &[String]) -> bool {
        self.delays
            .iter()
            .any(|(e, _)| !tried.iter().any(|t| t == e))
    }
}

fn hedged(delay_ms: u64, idempotent: bool) -> GovernanceOptions {
    GovernanceOptions {
        hedge_delay_ms: delay_ms,
        idempotent,
        timeout_ms: 0,
        ..Default::default()
    }
}

/// A call of an entry that hedges after 50 ms over `endpoints` (name, delay in ms), which must
/// be answered by fast:1 at 60 ms with one `hedge` event first; returns the attempt log.
async fn answered_by_the_hedge_at_60_ms(endpoints: &[(&'static str, u64)]) -> AttemptLogView {
    let g = engine(hedged(50, true));
    let e = Endpoints::new(endpoints);
    let mut events = g.events().subscribe();
    let t0 = Instant::now();
    let answer = g
        .execute(&g.policy(&M), &e)
        .await
        .expect("the hedge answers");
    assert_eq!(&answer[..], b"fast:1");
    assert_eq!(t0.elapsed(), Duration::from_millis(60));
    assert_eq!(
        events.try_recv().expect("hedge event").kind,
        EventKind::Hedge
    );
    e.log()
}

/// (endpoint, started at ms, finished at ms or `None` when dropped) per attempt.
type AttemptLogView = Vec<(String, u128, Option<u128>)>;

/// An engine whose entry hedges after `delay_ms` and retries twice, `interval_ms` apart.
fn hedging(delay_ms: u64, interval_ms: u64) -> Governance {
    engine(GovernanceOptions {
        retry_times: 2,
        retry_interval_ms: interval_ms,
        ..hedged(delay_ms, true)
    })
}

/// An attempt log written out: (endpoint, started at ms, finished at ms) per attempt.
fn logged(attempts: &[(&str, u128, Option<u128>)]) -> AttemptLogView {
    attempts
        .iter()
        .map(|(e, s, f)| (e.to_string(), *s, *f))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_hedge_goes_elsewhere_after_the_delay_and_the_first_answer_wins() {
    let log = answered_by_the_hedge_at_60_ms(&[("slow:1", 1000), ("fast:1", 10)]).await;
    // Hedge sent at 50 ms, answered at 60 ms; the slow attempt was dropped, never finished.
    assert_eq!(
        log,
        [
            ("slow:1".to_string(), 0, None),
            ("fast:1".to_string(), 50, Some(60))
        ]
    );
}

/// A hedge aimed at an endpoint that cannot serve the call (nothing sent) moves on to the next
/// untried one: the hedge its budget paid for is sent where it can be served.
#[tokio::test(start_paused = true)]
async fn a_hedge_moves_past_an_endpoint_that_cannot_serve_the_call() {
    let log =
        answered_by_the_hedge_at_60_ms(&[("slow:1", 1000), ("unable:1", 0), ("fast:1", 10)]).await;
    // Hedge aimed at unable:1 at 50 ms, sent to fast:1 at once, answered at 60 ms.
    assert_eq!(
        log,
        [
            ("slow:1".to_string(), 0, None),
            ("unable:1".to_string(), 50, Some(50)),
            ("fast:1".to_string(), 50, Some(60))
        ]
    );
}

/// A hedge refused by the client's own transport with 1001 (the call is over that server's
/// limits: nothing was sent) is no answer of the callee's: the first attempt, still running,
/// is waited for and answers, instead of being dropped for the hedge's refusal.
#[tokio::test(start_paused = true)]
async fn a_hedge_refused_before_it_was_sent_does_not_win_over_the_first_attempt() {
    let g = engine(hedged(50, true));
    let e = Endpoints::new(&[("slow:1", 100), ("over:1", 0)]);
    let answer = g
        .execute(&g.policy(&M), &e)
        .await
        .expect("the first attempt answers");
    assert_eq!(&answer[..], b"slow:1");
    assert_eq!(
        e.log(),
        [
            ("slow:1".to_string(), 0, Some(100)),
            ("over:1".to_string(), 50, Some(50))
        ]
    );
}

/// A call of an entry that hedges after 50 ms and may retry twice, over `endpoints` (name,
/// delay in ms; `down:` ones fail after theirs): its answer and the attempt log.
async fn hedged_with_retries(endpoints: &[(&'static str, u64)]) -> (Bytes, AttemptLogView) {
    let g = hedging(50, 0);
    let e = Endpoints::new(endpoints);
    let answer = g.execute(&g.policy(&M), &e).await.expect("an answer");
    (answer, e.log())
}

/// A first attempt that fails over while its hedge runs goes to neither endpoint the call is
/// on: not to the hedge's, where two attempts of one call would then run at once.
#[tokio::test(start_paused = true)]
async fn a_failover_while_the_hedge_runs_avoids_the_hedges_endpoint() {
    let (answer, log) =
        hedged_with_retries(&[("down:1", 100), ("slow:1", 1000), ("fast:1", 10)]).await;
    assert_eq!(&answer[..], b"fast:1");
    // down:1 fails at 100 ms (the hedge went to slow:1 at 50 ms); the failover goes to
    // fast:1, which answers at 110 ms, and the hedge is dropped.
    assert_eq!(
        log,
        [
            ("down:1".to_string(), 0, Some(100)),
            ("slow:1".to_string(), 50, None),
            ("fast:1".to_string(), 100, Some(110))
        ]
    );
}

/// With two endpoints, a first attempt that fails while its hedge runs on the other has no
/// endpoint left untried: it does not retry onto the hedge's (nor spend the budget on it),
/// and the hedge answers.
#[tokio::test(start_paused = true)]
async fn with_two_endpoints_a_failure_while_the_hedge_runs_is_not_retried_onto_it() {
    let (answer, log) = hedged_with_retries(&[("down:1", 100), ("slow:1", 1000)]).await;
    assert_eq!(&answer[..], b"slow:1");
    assert_eq!(
        log,
        [
            ("down:1".to_string(), 0, Some(100)),
            ("slow:1".to_string(), 50, Some(1050))
        ]
    );
}

/// [`Endpoints`] picked as a balancer picks: an endpoint not tried first, else by `.1`.
#[derive(Clone, Copy)]
struct Picked<'e>(&'e Endpoints, Else);

/// Whom [`Picked`] takes once every endpoint was tried.
#[derive(Clone, Copy)]
enum Else {
    /// One other than the last tried ([`Pick::next`]'s contract, as the client's balancer).
    NotLast,
    /// This one (as a balancer prefers a healthy endpoint over one that just failed).
    Prefer(&'static str),
}

/// [`Pick::next`]'s contract over `e`.
fn as_balanced(e: &Endpoints) -> Picked<'_> {
    Picked(e, Else::NotLast)
}

impl Attempts for Picked<'_> {
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
        let names = self.0.delays.iter().map(|(e, _)| *e);
        let fresh = names.clone().find(|e| !ctx.tried.iter().any(|t| t == e));
        let then = match self.1 {
            Else::NotLast => names
                .clone()
                .find(|e| ctx.tried.last().is_none_or(|l| l != e)),
            Else::Prefer(name) => Some(name),
        };
        Ok(fresh.or(then).unwrap_or(self.0.delays[0].0).to_string())
    }
    fn call(
        &self,
        addr: &str,
        timeout_ms: u32,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + Send {
        self.0.call(addr, timeout_ms, deadline)
    }
    fn untried_left(&self, tried: &[String]) -> bool {
        self.0.untried_left(tried)
    }
}

/// A first attempt whose retry, after its pause, picks the endpoint its hedge went to
/// meanwhile: it waits for the hedge rather than run the call there twice, and the hedge
/// answers.
#[tokio::test(start_paused = true)]
async fn a_retry_after_its_pause_waits_for_the_hedge_on_the_endpoint_it_picked() {
    let g = hedging(5, 50);
    let e = Endpoints::new(&[("busy:1", 2), ("slow:1", 1000)]);
    let expected = [("busy:1", 0, Some(2)), ("slow:1", 5, Some(1005))];
    answered_by_slow_1(&g, Picked(&e, Else::Prefer("slow:1")), &e, &expected).await;
}

/// A call of `g`'s entry, picked by `attempts` over `e`, which slow:1 must answer; then the
/// attempts `e` logged must be `expected`.
async fn answered_by_slow_1<A: Attempts + Copy + Send>(
    g: &Governance,
    attempts: A,
    e: &Endpoints,
    expected: &[(&str, u128, Option<u128>)],
) {
    let answer = g
        .execute(&g.policy(&M), attempts)
        .await
        .expect("the hedge answers");
    assert_eq!(&answer[..], b"slow:1");
    assert_eq!(e.log(), logged(expected));
}

/// A first attempt that waited for its hedge keeps its retries once the hedge fails: the call
/// makes the attempts it would have made unhedged (here three, on the two overloaded servers
/// in turn), none beside the hedge on its endpoint.
#[tokio::test(start_paused = true)]
async fn a_first_attempt_keeps_its_retries_when_its_hedge_fails() {
    let g = hedging(50, 0);
    let e = Endpoints::new(&[("busy:1", 100), ("busy:2", 300)]);
    let err = g
        .execute(&g.policy(&M), as_balanced(&e))
        .await
        .expect_err("both overloaded");
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert_eq!(
        e.log(),
        logged(&[
            ("busy:1", 0, Some(100)),
            ("busy:2", 50, Some(350)),
            ("busy:2", 350, Some(650)),
            ("busy:1", 650, Some(750)),
        ])
    );
}

/// With two endpoints, a first attempt refused by an overloaded server (which a retry may
/// cure) while its hedge runs on the other: the retry would go to the hedge's endpoint, a
/// second copy of the call there, so it waits, and the hedge answers.
#[tokio::test(start_paused = true)]
async fn an_overload_while_the_hedge_runs_sends_no_retry_to_the_hedges_endpoint() {
    let g = hedging(50, 0);
    let e = Endpoints::new(&[("busy:1", 100), ("slow:1", 1000)]);
    let expected = [("busy:1", 0, Some(100)), ("slow:1", 50, Some(1050))];
    answered_by_slow_1(&g, as_balanced(&e), &e, &expected).await;
}

/// A hedging entry's failed call names each endpoint it was tried on once per attempt.
#[tokio::test(start_paused = true)]
async fn a_hedging_calls_error_names_each_attempt_once() {
    let g = hedging(50, 0);
    let e = Endpoints::new(&[("down:1", 10)]);
    let err = g.execute(&g.policy(&M), &e).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert_eq!(err.tried(), ["down:1"], "{err}");
    // Overloaded (reached, so retried on the one endpoint): three attempts, three names.
    let e = Endpoints::new(&[("busy:1", 10)]);
    let err = g.execute(&g.policy(&M), &e).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert_eq!(err.tried(), ["busy:1", "busy:1", "busy:1"], "{err}");
}

/// A hedge whose delay ends as the call's deadline passes is not sent: no `hedge` event and
/// nothing drawn from the retry budget, even when the first attempt (ending at its deadline
/// by itself, as the client's does) has not ended yet.
#[tokio::test(start_paused = true)]
async fn no_hedge_is_counted_once_the_calls_deadline_passed() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 100,
        // One retry a second from the budget, no percentage of calls: the window's 10, of
        // which a hedge drawn would take one.
        retry_budget_percent: 0,
        retry_budget_min_per_second: 1,
        ..hedged(100, true)
    });
    let e = Endpoints::new(&[("slow:1", 150), ("slow:2", 150)]);
    let mut events = g.events().subscribe();
    let policy = g.policy(&M);
    let mut cx = CallCx::new(&g, policy.clone(), policy.options());
    let _ = governed(Scripted(&e), &[], Promising(Scripted(&e)))
        .call(&mut cx, Bytes::new())
        .await;
    let kinds: Vec<EventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert!(!kinds.contains(&EventKind::Hedge), "{kinds:?}");
    let window = crate::budget::WINDOW_SECONDS;
    for n in 0..window {
        let drawn = policy.budget.try_withdraw(&policy.options());
        assert!(
            drawn,
            "retry {n} of the window's {window}: the hedge drew one"
        );
    }
    assert!(
        !policy.budget.try_withdraw(&policy.options()),
        "the floor is 10"
    );
    assert_eq!(e.log().len(), 1, "one attempt: {:?}", e.log());
}

/// A hedge sent under a deadline inherited from the call being handled runs out of the
/// caller's time as the first attempt does: neither endpoint is held to blame.
#[tokio::test(start_paused = true)]
async fn a_hedge_out_of_the_callers_time_is_no_fault_of_its_endpoint() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 1000,
        deadline_slack_ms: 0,
        exceptions_allowed_before_breaking: 3,
        ..hedged(50, true)
    });
    let p = g.policy(&M);
    let e = Endpoints::new(&[("slow:1", 1000), ("slow:2", 1000)]);
    for i in 0..10 {
        let left = Instant::now() + Duration::from_millis(80);
        let r = crate::timeout::with_inherited(Some(left), g.execute(&p, &e)).await;
        let err = r.expect_err("80 ms is too little");
        assert_eq!(err.code(), StatusCode::Timeout, "call {i}: {err}");
    }
    assert!(
        ["slow:1", "slow:2"].iter().all(|e| g.health().is_usable(e)),
        "no endpoint is held to blame"
    );
}

/// The bottom of the stack, recording the retry depth each attempt is sent with.
struct DepthsSeen<'e> {
    endpoints: &'e Endpoints,
    seen: Mutex<Vec<(String, u32)>>,
}

impl Service for DepthsSeen<'_> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let addr = cx.endpoint().unwrap_or_default().to_string();
        self.seen.lock().unwrap().push((addr, cx.retry_depth()));
        Scripted(self.endpoints).call(cx, req).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_hedge_carries_the_retry_depth_of_the_call_it_belongs_to() {
    use rpc_core::{RpcContext, RETRY_DEPTH_KEY};
    // A client that may retry marks its call 1 (outside a handler), hedge included. Serving a
    // call of depth 1 under the chain stop, it marks nothing and passes 1 on, hedge included.
    let retrying = GovernanceOptions {
        retry_times: 2,
        ..hedged(50, true)
    };
    let served = std::collections::BTreeMap::from([(RETRY_DEPTH_KEY.to_string(), "1".into())]);
    for (served, expected) in [(None, 1), (Some(served), 1)] {
        let g = engine(retrying.clone());
        let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
        let bottom = DepthsSeen {
            endpoints: &e,
            seen: Mutex::new(Vec::new()),
        };
        let policy = g.policy(&M);
        let mut cx = CallCx::new(&g, policy.clone(), policy.options());
        let stack = governed(Scripted(&e), &[], &bottom);
        let call = stack.call(&mut cx, Bytes::new());
        let answer = match served {
            Some(served) => RpcContext::scope(served, call).await,
            None => call.await,
        };
        assert_eq!(&answer.expect("the hedge answers")[..], b"fast:1");
        assert_eq!(
            *bottom.seen.lock().unwrap(),
            [
                ("slow:1".to_string(), expected),
                ("fast:1".to_string(), expected)
            ]
        );
    }
}

/// A hedge is meant for another endpoint: a service of one instance gets none (a second call
/// to the slow instance would race nothing and add load where it hurts).
#[tokio::test(start_paused = true)]
async fn no_hedge_when_the_entry_has_no_other_endpoint() {
    let g = engine(hedged(50, true));
    let e = Endpoints::new(&[("only:1", 100)]);
    let mut events = g.events().subscribe();
    let t0 = Instant::now();
    let answer = g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(&answer[..], b"only:1");
    assert_eq!(t0.elapsed(), Duration::from_millis(100));
    assert_eq!(e.log(), [("only:1".to_string(), 0, Some(100))]);
    while let Ok(event) = events.try_recv() {
        assert_ne!(event.kind, EventKind::Hedge, "{event:?}");
    }
}

/// A call that failed over from a dead endpoint to a slow one hedges to neither: the hedge
/// goes where none of the call's attempts went, and here there is no such endpoint.
#[tokio::test(start_paused = true)]
async fn a_hedge_avoids_every_endpoint_the_call_went_to() {
    let g = engine(GovernanceOptions {
        retry_times: 1,
        ..hedged(50, true)
    });
    let e = Endpoints::new(&[("down:1", 0), ("slow:1", 1000)]);
    let answer = g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(&answer[..], b"slow:1");
    let went: Vec<String> = e.log().into_iter().map(|(addr, _, _)| addr).collect();
    assert_eq!(went, ["down:1", "slow:1"], "no hedge: {:?}", e.log());
}

/// Endpoints found only after a while (a registry's first answer): every picker waits `.1`.
struct SlowToFind<B>(B, Duration);

impl<B: Balance> Balance for SlowToFind<B> {
    type Picker = B::Picker;
    async fn picker(&self, cx: &CallCx<'_>) -> Result<Self::Picker, RpcError> {
        tokio::time::sleep(self.1).await;
        self.0.picker(cx).await
    }
}

/// One call to `e` whose endpoints are found after 100 ms.
async fn found_after_100_ms(g: &Governance, e: &Endpoints) -> Bytes {
    let policy = g.policy(&M);
    let mut cx = CallCx::new(g, policy.clone(), policy.options());
    let stack = governed(
        SlowToFind(Scripted(e), Duration::from_millis(100)),
        &[],
        Scripted(e),
    );
    stack.call(&mut cx, Bytes::new()).await.expect("answered")
}

/// The hedge's delay may end before the first attempt has its endpoint (both wait for the
/// endpoints): the hedge is aimed away from the first attempt's endpoint as it is when the
/// hedge picks, so a service of one instance still gets no hedge.
#[tokio::test(start_paused = true)]
async fn no_hedge_to_the_first_attempts_endpoint_found_after_the_delay() {
    let g = engine(hedged(50, true));
    let e = Endpoints::new(&[("only:1", 1000)]);
    let answer = found_after_100_ms(&g, &e).await;
    assert_eq!(&answer[..], b"only:1");
    // Found at 100 ms, answered 1000 ms later; the hedge (delay over at 50 ms, its endpoints
    // found at 150 ms) went nowhere.
    assert_eq!(e.log(), [("only:1".to_string(), 100, Some(1100))]);
    // With another endpoint the same hedge goes there once its endpoints are found.
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    let answer = found_after_100_ms(&g, &e).await;
    assert_eq!(&answer[..], b"fast:1");
    assert_eq!(
        e.log(),
        [
            ("slow:1".to_string(), 100, None),
            ("fast:1".to_string(), 150, Some(160))
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn no_hedge_when_the_first_attempt_answers_before_the_delay() {
    let g = engine(hedged(50, true));
    let e = Endpoints::new(&[("a:1", 49), ("b:1", 10)]);
    let answer = g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(&answer[..], b"a:1");
    assert_eq!(e.log(), [("a:1".to_string(), 0, Some(49))]);
    // Nothing fires later either.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(e.log().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn no_hedge_for_an_entry_that_is_not_idempotent() {
    let g = engine(hedged(50, false));
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    let answer = g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(&answer[..], b"slow:1");
    assert_eq!(e.log(), [("slow:1".to_string(), 0, Some(1000))]);
}

/// Hedges after 50 ms on a retry budget of 10 % of calls, with no per-second floor.
fn hedged_on_a_tenth_budget() -> GovernanceOptions {
    GovernanceOptions {
        retry_budget_percent: 10,
        retry_budget_min_per_second: 0,
        ..hedged(50, true)
    }
}

/// One call to a slow and a fast endpoint: `fast:1` when it hedged.
async fn slow_or_fast(g: &Governance) -> Bytes {
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    g.execute(&g.policy(&M), &e).await.expect("answered")
}

#[tokio::test(start_paused = true)]
async fn no_hedge_once_the_retry_budget_is_spent() {
    // 10 % of calls, no per-second floor: the first call has no budget, so no hedge; after
    // nine more calls, 10 deposited, one hedge is allowed.
    let g = engine(hedged_on_a_tenth_budget());
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    let answer = g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(
        &answer[..],
        b"slow:1",
        "budget spent: waited for the first attempt"
    );
    assert_eq!(e.log().len(), 1);
    let fast_first = Endpoints::new(&[("fast:1", 1)]);
    for _ in 0..9 {
        g.execute(&g.policy(&M), &fast_first)
            .await
            .expect("answered");
    }
    assert_eq!(
        &slow_or_fast(&g).await[..],
        b"fast:1",
        "one hedge allowed by the budget"
    );
}

/// A hedge refused for want of another endpoint draws nothing from the budget: after ten
/// such calls (one hedge's worth deposited at 10 %), a call with another endpoint may hedge.
#[tokio::test(start_paused = true)]
async fn a_hedge_refused_for_want_of_an_endpoint_draws_no_budget() {
    let g = engine(hedged_on_a_tenth_budget());
    let only = Endpoints::new(&[("only:1", 100)]);
    for _ in 0..10 {
        g.execute(&g.policy(&M), &only).await.expect("answered");
    }
    assert_eq!(only.log().len(), 10, "no hedge: {:?}", only.log());
    assert_eq!(
        &slow_or_fast(&g).await[..],
        b"fast:1",
        "the budget still holds one hedge"
    );
}

/// When no hedge is sent, the caller gets the first attempt's own failure, not word of the
/// hedge that was not sent.
#[tokio::test(start_paused = true)]
async fn with_no_hedge_sent_the_first_attempts_failure_is_the_answer() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        ..hedged(50, true)
    });
    let e = Endpoints::new(&[("down:1", 100)]);
    let err = g.execute(&g.policy(&M), &e).await.expect_err("failed");
    assert_eq!(err.code(), StatusCode::CommunicationError);
    assert!(err.message().contains("connect failed"), "{err}");
    assert_eq!(e.log().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_breaker_in_observe_mode_opens_and_reports_it_but_lets_calls_through() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 0,
        exceptions_allowed_before_breaking: 2,
        breaker_seconds: 30,
        breaker_observe: true,
        ..Default::default()
    });
    let mut events = g.events().subscribe();
    let p = g.policy(&M);
    let s = single(vec![server_error()], Duration::ZERO);
    for _ in 0..5 {
        let err = g.execute(&p, &s).await.unwrap_err();
        assert_eq!(err.code(), server_error().unwrap_err().code(), "{err}");
    }
    // Enforced, the 3rd to 5th calls would have failed fast unsent: here all five went out.
    assert_eq!(s.starts().len(), 5, "observe mode sends every call");
    assert_breaker!(p, Open);
    let seen: Vec<(EventKind, bool)> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind != EventKind::Ejection)
        .map(|e| (e.kind, e.observed))
        .collect();
    assert_eq!(seen, vec![(EventKind::Break, true)], "one observed break");
    // An operator's isolation is still enforced.
    g.isolate(&M);
    let s = single(vec![ok()], Duration::ZERO);
    assert_eq!(
        g.execute(&p, &s).await.unwrap_err().code(),
        StatusCode::CircuitOpen
    );
    assert!(s.starts().is_empty());
    // The isolation lifted, the breaker opens again in observe mode, calls still going out.
    g.reset_breaker(&M);
    let s = single(vec![server_error()], Duration::ZERO);
    for _ in 0..3 {
        let _ = g.execute(&p, &s).await;
    }
    assert_eq!(s.starts().len(), 3, "observe mode sends every call");
    assert_breaker!(p, Open);
    // Back to enforcing (a reload): the breaker, still open, fails fast at once.
    g.update_layers(|l| {
        l.runtime.entries.insert(
            "t.T.m".into(),
            GovernanceOverrides {
                breaker_observe: Some(false),
                ..GovernanceOverrides::NONE
            },
        );
    });
    let s = single(vec![ok()], Duration::ZERO);
    assert_eq!(
        g.execute(&p, &s).await.unwrap_err().code(),
        StatusCode::CircuitOpen
    );
    assert!(
        s.starts().is_empty(),
        "enforced: the open breaker fails the call unsent"
    );
}

#[tokio::test(start_paused = true)]
async fn throttling_in_observe_mode_sends_what_it_would_drop_and_reports_it() {
    let g = engine(GovernanceOptions {
        throttle_observe: true,
        ..throttled(200, 0).policy(&M).options().as_ref().clone()
    });
    let mut events = g.events().subscribe();
    let s = Script::new(vec![overflow()], Duration::ZERO);
    for _ in 0..1000 {
        let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
        assert_ne!(err.code(), StatusCode::OverflowMaxRequest, "{err}");
    }
    assert_eq!(s.starts().len(), 1000, "every attempt is sent");
    let observed = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == EventKind::Throttled)
        .inspect(|e| assert!(e.observed, "{e:?}"))
        .count();
    // Enforced, all but about 8 of 1000 would be dropped (see the test above): so many
    // observed drops here.
    assert!(observed > 970, "{observed} observed drops of 1000");
}

fn hedged_by_percentile(percentile: u32, floor_ms: u64) -> GovernanceOptions {
    GovernanceOptions {
        hedge_percentile: percentile,
        ..hedged(floor_ms, true)
    }
}

/// `n` calls that each answer after `ms` from one endpoint: what the entry's latency window
/// learns.
async fn teach(g: &Governance, n: usize, ms: u64) {
    let e = Endpoints::new(&[("usual:1", ms)]);
    for _ in 0..n {
        g.execute(&g.policy(&M), &e).await.expect("answered");
    }
    assert!(e.log().iter().all(|(addr, _, _)| addr == "usual:1"));
}

#[tokio::test(start_paused = true)]
async fn the_hedge_delay_follows_the_entrys_latency_percentile() {
    // No floor: until the window holds 20 calls there is no hedge at all.
    let g = engine(hedged_by_percentile(90, 0));
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    let answer = g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(&answer[..], b"slow:1", "no percentile yet: no hedge");
    assert_eq!(e.log().len(), 1);
    // 30 calls of 20 ms (the slow one above counts too: 1 of 31, beyond the p90).
    teach(&g, 30, 20).await;
    let mut events = g.events().subscribe();
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    let t0 = Instant::now();
    let answer = g
        .execute(&g.policy(&M), &e)
        .await
        .expect("the hedge answers");
    assert_eq!(&answer[..], b"fast:1");
    // Hedged at the p90, 20 ms: the histogram's bucket holding 20 ms ends at 20.095 ms, which
    // the timer rounds up to 21 ms. Answered 10 ms later.
    let log = e.log();
    assert_eq!(log[0], ("slow:1".to_string(), 0, None));
    assert_eq!((log[1].0.as_str(), log[1].1), ("fast:1", 21), "{log:?}");
    assert_eq!(t0.elapsed().as_millis(), 31);
    let event = events.try_recv().expect("hedge event");
    assert_eq!(event.kind, EventKind::Hedge);
    let cause = event.cause.unwrap_or_default();
    assert!(
        cause.contains("p90 latency") && cause.contains("hedge_percentile"),
        "{cause}"
    );
    // The first attempt, dropped at 31 ms, was learnt as at least that slow.
    let policy = g.policy(&M);
    let window = policy.latency.get().expect("the window exists");
    assert_eq!(window.len_at(Instant::now()), 32);
    let slowest = window
        .percentile_at(100, Instant::now())
        .expect("enough calls");
    assert!(slowest >= Duration::from_millis(31), "{slowest:?}");
}

#[tokio::test(start_paused = true)]
async fn hedge_delay_ms_is_the_floor_and_the_delay_before_enough_calls_were_seen() {
    let g = engine(hedged_by_percentile(90, 50));
    // Before enough calls: the floor.
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    let answer = g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(&answer[..], b"fast:1");
    assert_eq!(e.log()[1].1, 50);
    // A p90 of 20 ms is below the floor: still 50 ms.
    teach(&g, 30, 20).await;
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(e.log()[1].1, 50);
    // A p90 of 80 ms is above it: 80 ms (80.383, the top of its bucket, timed at 81).
    teach(&g, 300, 80).await;
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(e.log()[1].1, 81, "{:?}", e.log());
}

#[tokio::test(start_paused = true)]
async fn old_latencies_stop_setting_the_hedge_delay() {
    let g = engine(hedged_by_percentile(90, 0));
    teach(&g, 30, 200).await;
    // Ten seconds later the 200 ms calls have left the window; 30 calls of 20 ms set it now.
    tokio::time::advance(crate::latency::WINDOW).await;
    teach(&g, 30, 20).await;
    let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
    g.execute(&g.policy(&M), &e).await.expect("answered");
    assert_eq!(e.log()[1].1, 21, "{:?}", e.log());
}

/// A balancer that takes `.1` to know the candidates (a registry's first answer).
#[derive(Clone, Copy)]
struct SlowToPick<A>(A, Duration);

impl<A: Attempts + Copy + Send> Balance for SlowToPick<A> {
    type Picker = Scripted<A>;
    async fn picker(&self, _: &CallCx<'_>) -> Result<Self::Picker, RpcError> {
        tokio::time::sleep(self.1).await;
        Ok(Scripted(self.0))
    }
}

/// Attempts that answer at once, recording the budget each was given.
#[derive(Default)]
struct Budgets(Mutex<Vec<u32>>);

impl Attempts for &Budgets {
    fn select(&self, _: &AttemptCtx<'_>) -> Result<String, RpcError> {
        Ok("a:1".into())
    }
    async fn call(&self, _: &str, timeout_ms: u32, _: Option<Instant>) -> Result<Bytes, RpcError> {
        self.0.lock().unwrap().push(timeout_ms);
        ok()
    }
    fn untried_left(&self, _: &[String]) -> bool {
        false
    }
}

async fn execute_slow_to_pick(
    g: &Governance,
    b: &Budgets,
    wait: Duration,
) -> Result<Bytes, RpcError> {
    let policy = g.policy(&M);
    let mut cx = CallCx::new(g, policy.clone(), policy.options());
    governed(SlowToPick(b, wait), &[], Scripted(b))
        .call(&mut cx, Bytes::new())
        .await
}

#[tokio::test(start_paused = true)]
async fn the_deadline_covers_finding_the_endpoints() {
    let g = engine(GovernanceOptions {
        timeout_ms: 200,
        ..Default::default()
    });
    let b = Budgets::default();
    let t0 = Instant::now();
    let err = execute_slow_to_pick(&g, &b, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(t0.elapsed(), Duration::from_millis(200), "{err}");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    assert!(
        err.message().contains("200 ms"),
        "the budget is named: {err}"
    );
    assert!(b.0.lock().unwrap().is_empty(), "no attempt was made");
}

#[tokio::test(start_paused = true)]
async fn the_first_attempts_budget_leaves_out_the_time_spent_finding_endpoints() {
    let g = engine(GovernanceOptions {
        timeout_ms: 200,
        ..Default::default()
    });
    let b = Budgets::default();
    execute_slow_to_pick(&g, &b, Duration::from_millis(50))
        .await
        .expect("answered");
    assert_eq!(
        *b.0.lock().unwrap(),
        [150],
        "200 ms less the 50 spent picking"
    );
}

/// No endpoint at all: the balancer's own 404, before any attempt.
#[derive(Clone, Copy)]
struct NoEndpoint;

impl Attempts for NoEndpoint {
    fn select(&self, _: &AttemptCtx<'_>) -> Result<String, RpcError> {
        Err(RpcError::new(
            StatusCode::NotFindServiceRoute,
            "no instance of t.T is registered",
        ))
    }
    async fn call(&self, _: &str, _: u32, _: Option<Instant>) -> Result<Bytes, RpcError> {
        unreachable!("nothing to call")
    }
    fn untried_left(&self, _: &[String]) -> bool {
        false
    }
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_found_no_endpoint_leaves_the_breaker_half_open_and_frees_its_slot() {
    let (g, p, mut events) = probing().await;
    let err = g.execute(&p, NoEndpoint).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::NotFindServiceRoute);
    assert_breaker!(p, HalfOpen, "no remote side answered");
    assert_eq!(kinds(&mut events), [EventKind::HalfOpen]);
    // The slot is free: the next call is the probe, and its success closes the breaker.
    next_call_goes_through(&g, &p).await;
}

#[tokio::test(start_paused = true)]
async fn an_error_not_retried_for_the_budget_keeps_its_retry_after_and_payload() {
    let g = engine(retries_within_budget(0));
    let limited = RpcError::new(StatusCode::RateLimited, "over the quota")
        .with_retry_after(Duration::from_millis(300))
        .with_payload(rpc_core::Codec::MsgPack, Bytes::from_static(b"\x01"));
    let s = Script::new(vec![Err(limited)], Duration::ZERO);
    let err = g.execute(&g.policy(&M), &s).await.unwrap_err();
    assert!(err.message().contains("retry budget"), "{err}");
    assert_eq!(err.code(), StatusCode::RateLimited);
    assert_eq!(err.retry_after(), Some(Duration::from_millis(300)), "{err}");
    assert!(err.payload().is_some(), "{err:?}");
    assert_eq!(s.starts().len(), 1);
}

/// An endpoint that refused an attempt saying when to come back (a 429's `retry_after`) is not
/// sent the call again before then, though another endpoint failed in between: `a` refuses
/// for 300 ms, the call fails over to `b`, which cannot be reached, and goes back to `a` only
/// at 300 ms (before, at 100 ms: refused again, the attempt and the budget spent). When the
/// pause does not end before the deadline, the call ends with `a`'s refusal.
#[tokio::test(start_paused = true)]
async fn an_endpoints_retry_after_is_waited_out_when_the_call_comes_back_to_it() {
    let limited = || {
        Err(RpcError::new(StatusCode::RateLimited, "over the quota")
            .with_retry_after(Duration::from_millis(300)))
    };
    let refused = || Err(RpcError::new(StatusCode::CommunicationError, "refused"));
    for (timeout_ms, served) in [(5000, true), (200, false)] {
        let g = engine(GovernanceOptions {
            retry_times: 2,
            retry_interval_ms: 50,
            timeout_ms,
            ..Default::default()
        });
        let mut s = Script::new(vec![limited(), refused(), ok()], Duration::ZERO);
        s.endpoints = vec!["a:1".into(), "b:1".into()];
        let result = g.execute(&g.policy(&M), &s).await;
        let log: Vec<(u128, String)> = s
            .log
            .lock()
            .unwrap()
            .iter()
            .map(|(t, a)| (t.as_millis(), a.clone()))
            .collect();
        if served {
            assert_eq!(result.expect("served once a's pause ended"), ok().unwrap());
            assert_eq!(
                log,
                [(0, "a:1".into()), (50, "b:1".into()), (300, "a:1".into())]
            );
        } else {
            let err = result.expect_err("a's pause ends past the deadline");
            assert_eq!(err.code(), StatusCode::RateLimited, "{err}");
            assert_eq!(err.retry_after(), Some(Duration::from_millis(300)));
            assert_eq!(err.tried(), ["a:1", "b:1"]);
            assert_eq!(log, [(0, "a:1".into()), (50, "b:1".into())]);
        }
    }
}

/// The same call ended by `a`'s pause (it ends past the deadline), with a fallback: the
/// fallback's event names `a:1` and its attempt (0), whose 429 the call ends with, not the
/// last endpoint tried (`b:1`, which answered no 429).
#[tokio::test(start_paused = true)]
async fn a_fallback_for_a_paused_endpoints_refusal_names_that_endpoint() {
    let limited = || {
        Err(RpcError::new(StatusCode::RateLimited, "over the quota")
            .with_retry_after(Duration::from_millis(300)))
    };
    let refused = || Err(RpcError::new(StatusCode::CommunicationError, "refused"));
    let g = engine(GovernanceOptions {
        retry_times: 2,
        retry_interval_ms: 50,
        timeout_ms: 200,
        ..Default::default()
    });
    let p = g.policy(&M);
    let mut s = Script::new(vec![limited(), refused()], Duration::ZERO);
    s.endpoints = vec!["a:1".into(), "b:1".into()];
    let events = fallback_events(&g, &p, &s).await;
    let fallback = events
        .iter()
        .find(|e| e.kind == EventKind::Fallback)
        .expect("a fallback event");
    assert_eq!(fallback.endpoint.as_deref(), Some("a:1"), "{fallback:?}");
    assert_eq!(fallback.attempt, 0, "{fallback:?}");
}

// ------------------------------------------------------------------ per-attempt layers' own answers

/// One call of the test entry through the governed stack over `attempts`, with `layer` per
/// attempt: its result, and the endpoints it tried.
async fn through_layer<A: Attempts + Copy + Send>(
    g: &Governance,
    layer: impl super::Middleware + 'static,
    attempts: A,
) -> (Result<Bytes, RpcError>, Vec<String>) {
    let layers: Vec<Arc<dyn super::Middleware>> = vec![Arc::new(layer)];
    let p = g.policy(&M);
    let mut cx = CallCx::new(g, p.clone(), p.options());
    let result = governed(Scripted(attempts), &layers, Scripted(attempts))
        .call(&mut cx, Bytes::new())
        .await;
    (result, tried(&cx))
}

/// A per-attempt layer that refuses every attempt itself, never passing it on (no ticket for
/// the endpoint, say).
struct RefusesItself;

impl super::Middleware for RefusesItself {
    fn call<'a>(
        &'a self,
        _: &'a mut CallCx<'_>,
        _: Bytes,
        _: super::Next<'a>,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes, RpcError>> {
        Box::pin(async { Err(RpcError::new(StatusCode::UnAuthentication, "no ticket")) })
    }
}

/// A per-attempt layer that takes `0` before passing the attempt on (a token fetch, say): on
/// every attempt, or (`1`) on the attempts to that endpoint only.
struct TakesItsTime(Duration, Option<&'static str>);

impl super::Middleware for TakesItsTime {
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: super::Next<'a>,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes, RpcError>> {
        Box::pin(async move {
            if self.1.is_none_or(|only| cx.endpoint() == Some(only)) {
                tokio::time::sleep(self.0).await;
            }
            next.run(cx, req).await
        })
    }
}

/// Attempts whose attempt timeout passes in their per-attempt layer were never sent: adaptive
/// throttling, which counts refused requests, counts none of them (before, each counted as a
/// request refused, and ten of them gave a drop probability of 10/11).
#[tokio::test(start_paused = true)]
async fn attempts_timed_out_in_their_layer_are_no_requests_of_the_throttle() {
    let g = engine(GovernanceOptions {
        throttle_k_percent: 200,
        attempt_timeout_ms: 100,
        retry_times: 0,
        timeout_ms: 0,
        ..Default::default()
    });
    let s = Script::new(vec![ok()], Duration::ZERO);
    for _ in 0..10 {
        let (result, _) =
            through_layer(&g, TakesItsTime(Duration::from_millis(150), None), &s).await;
        let err = result.expect_err("the attempt timed out in its layer");
        assert!(
            err.message()
                .contains("not sent within the attempt timeout"),
            "{err}"
        );
    }
    no_request_of_the_throttle(&g, &s);
}

/// Nothing of `s` reached a server, and adaptive throttling of `g`'s test entry, which ran,
/// counts no request for it: its drop probability is 0.
fn no_request_of_the_throttle(g: &Governance, s: &Script) {
    assert!(s.starts().is_empty(), "nothing reached a server");
    let policy = g.policy(&M);
    let throttle = policy.throttle.get().expect("the throttle ran");
    assert_eq!(throttle.drop_probability_at(Instant::now()), 0.0);
}

/// An attempt dropped with its call while its per-attempt layer holds it (the caller gave up,
/// or it was the losing attempt of a hedged call) was never sent: adaptive throttling forgets
/// the request it counted for it (before, each counted as a request never accepted, and ten of
/// them gave a drop probability of 10/11).
#[tokio::test(start_paused = true)]
async fn attempts_dropped_in_their_layer_are_no_requests_of_the_throttle() {
    let g = engine(GovernanceOptions {
        throttle_k_percent: 100,
        retry_times: 0,
        timeout_ms: 0,
        ..Default::default()
    });
    let s = Script::new(vec![ok()], Duration::ZERO);
    for _ in 0..10 {
        let call = through_layer(&g, TakesItsTime(Duration::from_secs(1), None), &s);
        let given_up = tokio::time::timeout(Duration::from_millis(80), call).await;
        assert!(given_up.is_err(), "the caller gave up at 80 ms");
    }
    no_request_of_the_throttle(&g, &s);
}

/// A hedge that drew a retry from the budget and was dropped with its call before it left
/// the client (the caller gave up while a per-attempt layer held it) gives the retry back:
/// ten such calls do not spend a budget of ten (before, they did, and the next call's hedge
/// was refused for it).
#[tokio::test(start_paused = true)]
async fn a_hedge_dropped_with_its_call_before_it_left_gives_its_retry_back() {
    let g = engine(GovernanceOptions {
        retry_budget_percent: 0,
        retry_budget_min_per_second: 1, // 10 retries per 10 s window
        ..hedged(50, true)
    });
    let mut events = g.events().subscribe();
    for _ in 0..10 {
        let e = Endpoints::new(&[("slow:1", 1000), ("fast:1", 10)]);
        let slow_layer = TakesItsTime(Duration::from_secs(1), Some("fast:1"));
        let call = through_layer(&g, slow_layer, &e);
        let given_up = tokio::time::timeout(Duration::from_millis(80), call).await;
        assert!(given_up.is_err(), "the caller gave up at 80 ms");
    }
    let e = Endpoints::new(&[("slow:1", 100), ("fast:1", 10)]);
    let (answer, _) = through_layer(&g, RefusesAt::new("elsewhere:1"), &e).await;
    assert_eq!(&answer.expect("the hedge answers")[..], b"fast:1");
    let kinds = kinds(&mut events);
    assert!(!kinds.contains(&EventKind::BudgetExhausted), "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| **k == EventKind::Hedge).count(),
        1,
        "only the hedge that left has its event: {kinds:?}"
    );
}

/// Opens the test entry's breaker (`g` allows one failure) with one failed call on `a:1`:
/// the entry's policy, and the script of that one endpoint.
async fn opened_by_one_failure(g: &Governance) -> (Arc<EntryPolicy>, Script) {
    let p = g.policy(&M);
    let mut s = Script::new(vec![server_error()], Duration::ZERO);
    s.endpoints.truncate(1);
    let _ = g.execute(&p, &s).await;
    assert_breaker!(p, Open);
    (p, s)
}

/// A hedge whose answer is the call's is judged as its own attempt, not as the first one it
/// beat: a half-open breaker's probe that the hedge answered closes the breaker, though the
/// first attempt was still in its per-attempt layer (before, the call was judged the layer's
/// own answer and the breaker stayed half-open).
#[tokio::test(start_paused = true)]
async fn a_hedge_that_answers_is_judged_by_its_own_attempt() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        exceptions_allowed_before_breaking: 1,
        breaker_seconds: 1,
        ..hedged(50, true)
    });
    let (p, _) = opened_by_one_failure(&g).await;
    tokio::time::advance(Duration::from_millis(1_001)).await;
    let e = Endpoints::new(&[("slow:1", 10), ("fast:1", 10)]);
    let (result, _) = through_layer(
        &g,
        TakesItsTime(Duration::from_millis(200), Some("slow:1")),
        &e,
    )
    .await;
    assert_eq!(result.expect("the hedge answers"), "fast:1");
    assert_breaker!(p, Closed, "the probe was answered");
}

/// An attempt a per-attempt layer answers itself asked no server anything: a half-open
/// breaker's probe refused so does not close it, and the endpoint's failures in a row stand.
/// (Before, the layer's refusal counted as the callee's answer: the breaker reset, and the
/// endpoint was taken for up.)
#[tokio::test(start_paused = true)]
async fn a_per_attempt_layers_own_answer_says_nothing_of_the_endpoint() {
    let g = engine(GovernanceOptions {
        retry_times: 0,
        timeout_ms: 0,
        exceptions_allowed_before_breaking: 1,
        breaker_seconds: 1,
        ..Default::default()
    });
    let (p, s) = opened_by_one_failure(&g).await;
    assert_eq!(g.health().view("a:1").consecutive_failures, 1);
    tokio::time::advance(Duration::from_millis(1_001)).await;
    let err = through_layer(&g, RefusesItself, &s).await.0.unwrap_err();
    assert_eq!(err.code(), StatusCode::UnAuthentication, "{err}");
    assert_eq!(s.starts().len(), 1, "the probe reached no server");
    assert!(
        !matches!(p.breaker().state(), BreakerState::Closed { .. }),
        "{:?}",
        p.breaker().state()
    );
    assert_eq!(g.health().view("a:1").consecutive_failures, 1);
}

/// An attempt whose per-attempt layer spends its attempt timeout before passing it on sent
/// nothing: the call may go elsewhere though not idempotent, is not "maybe delivered", and no
/// endpoint is held slow for it. (Before: a 519 saying the server was told to stop, maybe
/// delivered, and a mark against the endpoint.)
#[tokio::test(start_paused = true)]
async fn an_attempt_timed_out_in_its_layer_was_not_sent() {
    let g = engine(GovernanceOptions {
        retry_times: 1,
        retry_interval_ms: 0,
        timeout_ms: 0,
        attempt_timeout_ms: 100,
        idempotent: false,
        ..Default::default()
    });
    let s = Script::new(vec![ok()], Duration::ZERO);
    let (result, tried) =
        through_layer(&g, TakesItsTime(Duration::from_millis(150), None), &s).await;
    let err = result.unwrap_err();
    assert!(!err.is_maybe_delivered(), "{err}");
    assert!(s.starts().is_empty(), "nothing reached a server");
    assert_eq!(tried.len(), 2, "sent elsewhere though not idempotent");
    for addr in tried {
        assert!(g.health().is_healthy(&addr), "{addr} held against");
    }
}

/// A per-attempt layer that refuses the attempts aimed at `0` itself, counting them in `1`.
struct RefusesAt(&'static str, Arc<std::sync::atomic::AtomicUsize>);

impl RefusesAt {
    fn new(addr: &'static str) -> Self {
        RefusesAt(addr, Arc::default())
    }
}

impl super::Middleware for RefusesAt {
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: super::Next<'a>,
    ) -> futures_util::future::BoxFuture<'a, Result<Bytes, RpcError>> {
        if cx.endpoint() == Some(self.0) {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Box::pin(async {
                Err(RpcError::new(StatusCode::UnAuthentication, "no ticket"))
            });
        }
        next.run(cx, req)
    }
}

/// A hedge a per-attempt layer refuses itself never left the client: the retry budget it drew
/// goes back, so such hedges do not spend the budget the entry's retries need. (Before, ten of
/// them spent a budget of ten retries, and the next calls' hedges were refused for it.)
#[tokio::test(start_paused = true)]
async fn a_hedge_refused_by_its_layer_gives_its_retry_back_to_the_budget() {
    let g = engine(GovernanceOptions {
        retry_budget_percent: 0,
        retry_budget_min_per_second: 1, // 10 retries per 10 s window
        ..hedged(50, true)
    });
    let mut events = g.events().subscribe();
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..20 {
        let e = Endpoints::new(&[("slow:1", 100), ("fast:1", 10)]);
        let layer = RefusesAt("fast:1", refused.clone());
        let (answer, _) = through_layer(&g, layer, &e).await;
        assert_eq!(&answer.expect("the first attempt answers")[..], b"slow:1");
    }
    assert_eq!(refused.load(std::sync::atomic::Ordering::Relaxed), 20);
    let kinds = kinds(&mut events);
    assert!(!kinds.contains(&EventKind::BudgetExhausted), "{kinds:?}");
}

/// A hedge's `hedge` event says a second copy of the call went out: one a per-attempt layer
/// refuses (or adaptive throttling drops) never left the client, and has none; one the layer
/// passes on has one, naming the call's slow endpoint. (Before, every hedge the gate let
/// through had its event, sent or not.)
#[tokio::test(start_paused = true)]
async fn a_hedge_its_layer_refuses_has_no_hedge_event_and_one_it_passes_has_one() {
    let g = engine(hedged(50, true));
    let mut events = g.events().subscribe();
    let e = Endpoints::new(&[("slow:1", 100), ("fast:1", 10)]);
    let refuses = RefusesAt::new("fast:1");
    let refused = refuses.1.clone();
    let (answer, _) = through_layer(&g, refuses, &e).await;
    assert_eq!(&answer.expect("the first attempt answers")[..], b"slow:1");
    assert_eq!(refused.load(std::sync::atomic::Ordering::Relaxed), 1);
    let kinds = kinds(&mut events);
    assert!(!kinds.contains(&EventKind::Hedge), "{kinds:?}");

    let e = Endpoints::new(&[("slow:1", 100), ("fast:1", 10)]);
    let (answer, _) = through_layer(&g, RefusesAt::new("elsewhere:1"), &e).await;
    assert_eq!(&answer.expect("the hedge answers")[..], b"fast:1");
    let hedges: Vec<GovernanceEvent> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == EventKind::Hedge)
        .collect();
    assert_eq!(hedges.len(), 1, "{hedges:?}");
    assert_eq!(hedges[0].endpoint.as_deref(), Some("slow:1"));
}

/// A hedge a per-attempt layer refuses itself is no answer of a callee: the first attempt,
/// still running, answers the call. (Before, the hedge's local 401 won the race at once.)
#[tokio::test(start_paused = true)]
async fn a_hedge_refused_by_its_layer_does_not_win_the_race() {
    let g = engine(hedged(50, true));
    let e = Endpoints::new(&[("slow:1", 100), ("fast:1", 10)]);
    let t0 = Instant::now();
    let answer = through_layer(&g, RefusesAt::new("fast:1"), &e)
        .await
        .0
        .expect("the first attempt answers");
    assert_eq!(&answer[..], b"slow:1");
    assert_eq!(t0.elapsed(), Duration::from_millis(100));
}
