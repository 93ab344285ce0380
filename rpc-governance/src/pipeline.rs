//! The client pipeline, per entry and cached by entry id:
//! circuit breaker → timeout → retry (with failover and a budget) → attempt.
//!
//! The fallback layer sits outside, in the client, because it holds the call's arguments.

use std::future::Future;
use std::sync::{Arc, RwLock};

use arc_swap::ArcSwap;
use bytes::Bytes;
use dashmap::DashMap;
use rpc_core::{
    GovernanceOptions, GovernanceOverrides, MethodDescriptor, RpcError, ServiceEntryId, StatusCode,
};
use tokio::time::Instant;

use crate::breaker::{BreakerState, CircuitBreaker, Outcome, Transition};
use crate::budget::RetryBudget;
use crate::config::Layers;
use crate::events::{EventBus, EventKind};
use crate::failover;
use crate::health::EndpointHealth;
use crate::retry::Decision;
use crate::timeout;

/// What an attempt needs to know.
#[derive(Debug)]
pub struct AttemptCtx<'a> {
    /// 0 for the first attempt.
    pub attempt: u32,
    /// The call's deadline.
    pub deadline: Option<Instant>,
    /// Endpoints already tried by this call, in order.
    pub tried: &'a [String],
    /// The entry's options for this call.
    pub options: &'a GovernanceOptions,
}

/// The caller's side of the pipeline: choose an endpoint, run one attempt on it.
pub trait Attempts: Sync {
    /// Picks the endpoint of the next attempt, preferring ones not in `ctx.tried`. An error here
    /// (no endpoint at all) ends the call.
    fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError>;

    /// Runs one attempt on `addr`. `timeout_ms` is the budget left (0 = none), to send to the
    /// server; at `deadline` the attempt must stop (dropping what it waits for, so the server
    /// is told to stop) and fail with [`StatusCode::Timeout`]. The transport enforces this
    /// with one sweeper per connection, which is much cheaper than a timer per call.
    fn call(
        &self,
        addr: &str,
        timeout_ms: u32,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + Send;

    /// Whether some endpoint has not been tried yet.
    fn untried_left(&self, tried: &[String]) -> bool;
}

/// The cached part of one entry's pipeline: its options and runtime state.
#[derive(Debug)]
pub struct EntryPolicy {
    entry: Arc<str>,
    method: &'static MethodDescriptor,
    options: ArcSwap<GovernanceOptions>,
    breaker: CircuitBreaker,
    budget: RetryBudget,
}

impl EntryPolicy {
    /// The entry's options now.
    pub fn options(&self) -> Arc<GovernanceOptions> {
        self.options.load_full()
    }

    /// The entry's breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// The entry's method.
    pub fn method(&self) -> &'static MethodDescriptor {
        self.method
    }
}

/// The governance engine of one client: per-entry pipelines cached by entry id, the layers of
/// configuration they are resolved from, endpoint health and the event bus.
#[derive(Debug)]
pub struct Governance {
    layers: RwLock<Layers>,
    cache: DashMap<ServiceEntryId, Arc<EntryPolicy>, ahash::RandomState>,
    health: EndpointHealth,
    events: EventBus,
}

impl Governance {
    /// An engine resolving options from `layers`.
    pub fn new(layers: Layers) -> Self {
        let max_backoff =
            std::time::Duration::from_secs(layers.code_defaults.breaker_seconds.max(1));
        Governance {
            layers: RwLock::new(layers),
            cache: DashMap::with_hasher(ahash::RandomState::new()),
            health: EndpointHealth::new(max_backoff),
            events: EventBus::new(),
        }
    }

    /// Local endpoint health.
    pub fn health(&self) -> &EndpointHealth {
        &self.health
    }

    /// The event bus: `events().subscribe()` receives every decision.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// The pipeline of `method`, built on first use and cached by entry id.
    pub fn policy(&self, method: &'static MethodDescriptor) -> Arc<EntryPolicy> {
        if let Some(p) = self.cache.get(method.entry_id) {
            return p.clone();
        }
        let options = self
            .layers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .resolve(method);
        self.cache
            .entry(ServiceEntryId::from(method.entry_id))
            .or_insert_with(|| {
                Arc::new(EntryPolicy {
                    entry: Arc::from(method.entry_id),
                    method,
                    options: ArcSwap::from_pointee(options),
                    breaker: CircuitBreaker::new(),
                    budget: RetryBudget::new(),
                })
            })
            .clone()
    }

    /// Changes the configuration layers; every cached entry gets its new options for its next
    /// call and keeps its runtime state (an open breaker stays open, counters stay).
    pub fn update_layers(&self, change: impl FnOnce(&mut Layers)) {
        let mut layers = self.layers.write().unwrap_or_else(|p| p.into_inner());
        change(&mut layers);
        for p in self.cache.iter() {
            let new = layers.resolve(p.method);
            if *p.options.load_full() != new {
                p.options.store(Arc::new(new));
                self.events
                    .emit_parts(EventKind::Reload, &p.entry, None, 0, None);
            }
        }
    }

    /// Replaces what the instances of `service_id` publish about its entries (the registry's
    /// entry descriptors); cached entries pick the change up on their next call.
    pub fn publish(&self, service_id: &str, entries: Vec<(String, GovernanceOverrides)>) {
        let prefix = format!("{service_id}.");
        let unchanged = {
            let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
            let current: Vec<_> = layers
                .published
                .entries
                .iter()
                .filter(|(id, _)| id.starts_with(&prefix))
                .collect();
            current.len() == entries.len()
                && entries
                    .iter()
                    .all(|(id, o)| layers.published.entries.get(id) == Some(o))
        };
        if unchanged {
            return;
        }
        self.update_layers(|l| {
            l.published.entries.retain(|id, _| !id.starts_with(&prefix));
            l.published.entries.extend(entries);
        });
    }

    /// The state of every cached entry's breaker.
    pub fn breakers(&self) -> Vec<(ServiceEntryId, BreakerState)> {
        self.cache
            .iter()
            .map(|p| (p.key().clone(), p.breaker.state()))
            .collect()
    }

    fn breaker_event(&self, policy: &EntryPolicy, t: Transition, cause: Option<&RpcError>) {
        let kind = match t {
            Transition::Break => EventKind::Break,
            Transition::HalfOpen => EventKind::HalfOpen,
            Transition::Reset => EventKind::Reset,
        };
        self.events
            .emit_parts(kind, &policy.entry, None, 0, cause.map(|c| c.to_string()));
    }

    /// Runs one call through breaker → timeout → retry → attempts.
    pub async fn execute<A: Attempts>(
        &self,
        policy: &EntryPolicy,
        attempts: A,
    ) -> Result<Bytes, RpcError> {
        let options = policy.options();
        let permit = if options.enable_circuit_breaker {
            let (permit, t) = policy.breaker.try_acquire(&policy.entry, &options)?;
            if let Some(t) = t {
                self.breaker_event(policy, t, None);
            }
            Some(permit)
        } else {
            None
        };
        // One clock reading serves the deadline, the budget and the first attempt's timeout.
        let started = Instant::now();
        let deadline = timeout::deadline_from(started, &options);
        policy.budget.deposit_at(started);
        let mut endpoint_only = false;
        // The endpoint of the last failed attempt, which the timeout event names.
        let mut last_failed = None;
        let result = self
            .retry_loop(
                policy,
                &options,
                started,
                deadline,
                attempts,
                (&mut endpoint_only, &mut last_failed),
            )
            .await;
        let result = result.map_err(|e| match (e.code(), deadline) {
            (StatusCode::Timeout, Some(d)) => timeout::timeout_error(&policy.entry, started, d),
            _ => e,
        });
        if let Err(e) = &result {
            if e.code() == StatusCode::Timeout {
                self.events.emit_parts(
                    EventKind::Timeout,
                    &policy.entry,
                    last_failed.as_deref(),
                    0,
                    Some(e.to_string()),
                );
            }
        }
        if let Some(permit) = permit {
            // A call that may have reached an endpoint which then failed, and was not repeated
            // elsewhere only because the entry is not idempotent, says something about that
            // endpoint (endpoint health ejects it), not about the service: the entry's breaker
            // does not count it, or one crashed server would open it with others alive.
            let outcome = if endpoint_only {
                Outcome::Ignored
            } else {
                Outcome::of(&result)
            };
            if let Some(t) =
                policy
                    .breaker
                    .record_outcome(permit, outcome, &options, result.as_ref().err())
            {
                self.breaker_event(policy, t, result.as_ref().err());
            }
        }
        result
    }

    async fn retry_loop<A: Attempts>(
        &self,
        policy: &EntryPolicy,
        options: &GovernanceOptions,
        started: Instant,
        deadline: Option<Instant>,
        attempts: A,
        (endpoint_only, last_failed): (&mut bool, &mut Option<String>),
    ) -> Result<Bytes, RpcError> {
        let mut tried: Vec<String> = Vec::new();
        let mut attempt = 0u32;
        loop {
            let ctx = AttemptCtx {
                attempt,
                deadline,
                tried: &tried,
                options,
            };
            let addr = attempts.select(&ctx)?;
            let budget_ms = if attempt == 0 {
                timeout::remaining_ms_at(started, deadline)
            } else {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(RpcError::new(StatusCode::Timeout, "deadline passed"));
                }
                timeout::remaining_ms(deadline)
            };
            let err = match attempts.call(&addr, budget_ms, deadline).await {
                Ok(bytes) => {
                    self.health.success(&addr);
                    return Ok(bytes);
                }
                Err(e) => e,
            };
            if err.code() == StatusCode::CommunicationError {
                let n = self
                    .health
                    .failure(&addr, options.unhealthy_times_allowed_before_removing);
                self.events.emit_parts(
                    EventKind::Ejection,
                    &policy.entry,
                    Some(&addr),
                    attempt,
                    Some(format!("{err} ({n} in a row)")),
                );
            }
            *last_failed = Some(addr.clone());
            tried.push(addr);
            let untried_left = attempts.untried_left(&tried);
            let decision = failover::decide(&err, attempt, options, deadline, untried_left);
            let after = match decision {
                Decision::Retry { after } => after,
                Decision::GiveUp => {
                    *endpoint_only = err.code() == StatusCode::CommunicationError
                        && err.is_maybe_delivered()
                        && untried_left;
                    return Err(failover::final_error(err, tried));
                }
            };
            if !policy.budget.try_withdraw(options) {
                self.events.emit_parts(
                    EventKind::BudgetExhausted,
                    &policy.entry,
                    tried.last().map(String::as_str),
                    attempt,
                    Some(err.to_string()),
                );
                let msg = format!(
                    "{}; not retried: the retry budget of {} is spent (retries are capped at {} % \
                     of calls, at least {}/s)",
                    err.message(),
                    policy.entry,
                    options.retry_budget_percent,
                    options.retry_budget_min_per_second
                );
                let spent =
                    RpcError::new(err.code(), msg).maybe_delivered(err.is_maybe_delivered());
                return Err(failover::final_error(spent, tried));
            }
            self.events.emit_parts(
                EventKind::Retry,
                &policy.entry,
                tried.last().map(String::as_str),
                attempt,
                Some(err.to_string()),
            );
            attempt += 1;
            if !after.is_zero() {
                tokio::time::sleep(after).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use rpc_core::GovernanceOverrides;

    use super::*;

    /// Scripted attempts: each takes `delay`, then returns the next scripted result (the last
    /// one repeats). Records when each attempt started and on which endpoint.
    struct Script {
        endpoints: Vec<String>,
        results: Vec<Result<Bytes, RpcError>>,
        delay: Duration,
        log: Mutex<Vec<(Duration, String)>>,
        start: Instant,
    }

    impl Script {
        fn new(results: Vec<Result<Bytes, RpcError>>, delay: Duration) -> Self {
            Script {
                endpoints: vec!["a:1".into(), "b:1".into(), "c:1".into()],
                results,
                delay,
                log: Mutex::new(Vec::new()),
                start: Instant::now(),
            }
        }
        fn starts(&self) -> Vec<Duration> {
            self.log.lock().unwrap().iter().map(|(t, _)| *t).collect()
        }
    }

    impl Attempts for &Script {
        fn select(&self, ctx: &AttemptCtx<'_>) -> Result<String, RpcError> {
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
            match deadline {
                Some(d) => tokio::time::timeout_at(d, work)
                    .await
                    .unwrap_or_else(|_| Err(RpcError::new(StatusCode::Timeout, "late"))),
                None => work.await,
            }
        }
        fn untried_left(&self, tried: &[String]) -> bool {
            self.endpoints.iter().any(|e| !tried.contains(e))
        }
    }

    static M: MethodDescriptor = MethodDescriptor {
        service_id: "t.T",
        method: "m",
        entry_id: "t.T.m",
        hash_key: None,
        governance: GovernanceOverrides::NONE,
    };

    fn engine(o: GovernanceOptions) -> Governance {
        Governance::new(Layers {
            code_defaults: o,
            ..Default::default()
        })
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
        let s = Script::new(vec![overflow()], Duration::from_millis(70));
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
        Err(
            RpcError::new(StatusCode::CommunicationError, "connection closed")
                .maybe_delivered(true),
        )
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
        assert!(
            matches!(p.breaker().state(), BreakerState::Open { .. }),
            "{:?}",
            p.breaker().state()
        );
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
            let s = Script::new(vec![server_error()], Duration::ZERO);
            let _ = g.execute(&p, &s).await;
        }
        assert!(matches!(p.breaker().state(), BreakerState::Open { .. }));
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
}
