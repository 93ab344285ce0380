//! Governance events: every policy decision, as a `tracing` event and to subscribers.

use std::fmt;
use std::sync::{Arc, OnceLock};

use tokio::sync::broadcast;

/// What a policy decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A failed attempt is tried again.
    Retry,
    /// A retry was refused because the entry's retry budget is spent.
    BudgetExhausted,
    /// A circuit breaker opened.
    Break,
    /// An open breaker admitted a probe.
    HalfOpen,
    /// A breaker closed again (after a probe, or reset by an operator).
    Reset,
    /// An operator isolated an entry: its breaker stays open until reset.
    Isolate,
    /// A call ran out of its deadline.
    Timeout,
    /// A server refused a call at its concurrency cap.
    Overflow,
    /// A server refused a call over a rate limit (the entry's, or the caller's quota).
    RateLimited,
    /// A fallback answered for a failed call.
    Fallback,
    /// A fallback was not started because the caller's deadline had already passed: the
    /// caller has its timeout, and nothing would receive the fallback's answer.
    FallbackSkipped,
    /// An entry's options changed at run time.
    Reload,
    /// An endpoint was marked unhealthy, or dropped after repeated failures.
    Ejection,
    /// A removed endpoint was taken back (a background probe reached it, or an operator
    /// re-admitted it).
    Readmission,
    /// A client dropped an attempt itself (adaptive throttling): the server keeps refusing
    /// the entry's calls for overload, so this one was not sent.
    Throttled,
    /// The first attempt of an idempotent call had not answered after `hedge_delay_ms`: a
    /// second attempt went to another endpoint.
    Hedge,
    /// A rule document (governance or routing) from the rule store was refused: it does not
    /// parse or names an impossible option. The last good version stays in force; the event's
    /// `rule_version` is the refused version and its `cause` the reason.
    RuleRejected,
    /// A new version of a rule document was applied (its `rule_version`); the entries it
    /// changes report `reload`.
    RuleApplied,
}

impl EventKind {
    /// The event's name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Retry => "retry",
            EventKind::BudgetExhausted => "budget_exhausted",
            EventKind::Break => "break",
            EventKind::HalfOpen => "half_open",
            EventKind::Reset => "reset",
            EventKind::Isolate => "isolate",
            EventKind::Timeout => "timeout",
            EventKind::Overflow => "overflow",
            EventKind::RateLimited => "rate_limited",
            EventKind::Fallback => "fallback",
            EventKind::FallbackSkipped => "fallback_skipped",
            EventKind::Reload => "reload",
            EventKind::Ejection => "ejection",
            EventKind::Readmission => "readmission",
            EventKind::Throttled => "throttled",
            EventKind::Hedge => "hedge",
            EventKind::RuleRejected => "rule_rejected",
            EventKind::RuleApplied => "rule_applied",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One governance decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GovernanceEvent {
    /// What was decided.
    pub kind: EventKind,
    /// The service entry.
    pub entry: Arc<str>,
    /// The endpoint concerned, if any.
    pub endpoint: Option<String>,
    /// The attempt number (0 for the first attempt of a call).
    pub attempt: u32,
    /// Why: the error that led to the decision.
    pub cause: Option<String>,
    /// The policy runs in observe mode (`<policy>_observe = true`): this is what it would have
    /// done, and it did not do it (the call went on).
    pub observed: bool,
    /// The version of the rule document concerned ([`EventKind::RuleRejected`]), if any.
    pub rule_version: Option<i64>,
}

impl GovernanceEvent {
    /// An event about no rule version, acted on (`observed = false`) or only observed.
    fn of(
        kind: EventKind,
        entry: &Arc<str>,
        endpoint: Option<&str>,
        attempt: u32,
        cause: Option<String>,
        observed: bool,
    ) -> Self {
        GovernanceEvent {
            kind,
            entry: entry.clone(),
            endpoint: endpoint.map(str::to_string),
            attempt,
            cause,
            observed,
            rule_version: None,
        }
    }
}

/// A function told of every event as it is emitted (metrics, for instance); see
/// [`EventBus::set_observer`].
pub type Observer = Arc<dyn Fn(&GovernanceEvent) + Send + Sync>;

/// Emits governance events as `tracing` events (target `rpc::governance`, on the current span),
/// to an optional [`Observer`] and to every subscriber. Cheap to clone; clones share the
/// subscribers and the observer.
#[derive(Clone)]
pub struct EventBus {
    tx: broadcast::Sender<GovernanceEvent>,
    observer: Arc<OnceLock<Observer>>,
}

impl fmt::Debug for EventBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventBus")
            .field("subscribers", &self.tx.receiver_count())
            .field("observer", &self.observer.get().is_some())
            .finish()
    }
}

impl Default for EventBus {
    fn default() -> Self {
        EventBus {
            tx: broadcast::Sender::new(1024),
            observer: Arc::default(),
        }
    }
}

impl EventBus {
    /// A bus keeping up to 1024 events for slow subscribers (older ones are dropped for them).
    pub fn new() -> Self {
        Self::default()
    }

    /// Receives every event emitted from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<GovernanceEvent> {
        self.tx.subscribe()
    }

    /// Installs the observer every clone of this bus calls, synchronously, for each event (the
    /// OpenTelemetry event counter of `rpc-client` and `rpc-server` uses it). One observer per
    /// bus: returns `false`, leaving the first in place, when one is already installed.
    pub fn set_observer(&self, observer: Observer) -> bool {
        self.observer.set(observer).is_ok()
    }

    /// Counts every event of this bus in the OpenTelemetry counter `rpc.governance.events`
    /// of `meter`, by `event` kind, `rpc.entry_id` and `rpc.side` (`"client"` or `"server"`);
    /// installs the bus's observer (see [`set_observer`](Self::set_observer)).
    #[cfg(feature = "otel")]
    pub fn count_in(&self, meter: &opentelemetry::metrics::Meter, side: &'static str) -> bool {
        use opentelemetry::KeyValue;
        let counter = meter
            .u64_counter("rpc.governance.events")
            .with_description(
                "Governance decisions (retry, break, overflow, fallback, ...) by kind",
            )
            .build();
        self.set_observer(Arc::new(move |e| {
            counter.add(
                1,
                &[
                    KeyValue::new("rpc.side", side),
                    KeyValue::new("event", e.kind.as_str()),
                    KeyValue::new("rpc.entry_id", e.entry.to_string()),
                    KeyValue::new("observed", e.observed),
                ],
            );
        }))
    }

    /// Emits an event.
    pub fn emit(&self, event: GovernanceEvent) {
        tracing::info!(
            target: "rpc::governance",
            event = event.kind.as_str(),
            entry = &*event.entry,
            endpoint = event.endpoint.as_deref().unwrap_or(""),
            attempt = event.attempt,
            cause = event.cause.as_deref().unwrap_or(""),
            observed = event.observed,
            "governance"
        );
        if let Some(observer) = self.observer.get() {
            observer(&event);
        }
        if self.tx.receiver_count() > 0 {
            let _ = self.tx.send(event);
        }
    }

    /// Shorthand for [`emit`](Self::emit).
    pub fn emit_parts(
        &self,
        kind: EventKind,
        entry: &Arc<str>,
        endpoint: Option<&str>,
        attempt: u32,
        cause: Option<String>,
    ) {
        self.emit(GovernanceEvent::of(
            kind, entry, endpoint, attempt, cause, false,
        ));
    }

    /// Emits what a policy in observe mode would have done (`observed: true`): the same kind
    /// of event as when it acts, so dashboards and alerts can compare the two.
    pub fn emit_observed(
        &self,
        kind: EventKind,
        entry: &Arc<str>,
        endpoint: Option<&str>,
        attempt: u32,
        cause: Option<String>,
    ) {
        self.emit(GovernanceEvent::of(
            kind, entry, endpoint, attempt, cause, true,
        ));
    }
}
