//! Entry admission: the rate limits, then the concurrency gate (fixed cap or adaptive limit).
//!
//! A server refuses work it cannot or should not take before running it, at once, so the
//! caller can go elsewhere: first "how often" (the entry's token buckets, all callers and per
//! caller: 429 with the time until the next token), then "how many at once" (the fixed cap, or
//! the adaptive limit that measures what the entry can take: 515). Every answer of an admitted
//! call then reports the entry's load (calls in flight, the limit in force) for the clients'
//! pickers.
//!
//! An entry's admission is replaced when the governance rules change its server options (see
//! `rules.rs`), keeping the parts whose options did not change (the rate limiter and its
//! buckets, the gate with its slots and measured latency). A new gate goes on counting the calls
//! that hold a slot of the cap it keeps (the server's shared cap, or the entry's own cap
//! resized), and a new adaptive limit goes on counting the calls holding the old one's slots
//! (`AdaptiveLimit::rebounded`), starting from its limit within the new bounds. (An adaptive
//! limit turned on again after rules turned it off starts counting from none: the calls
//! admitted while it was off hold no slot of it, and only the cap bounds them until they end.)
//! In observe mode (`rate_limit_observe`, `admission_observe`) a call a limit would
//! refuse is reported (the same event, `observed`) and admitted; one over its adaptive limit
//! alone still holds a slot of the cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rpc_governance::events::{EventBus, EventKind};

use rpc_core::{Compression, RpcError, StatusCode};
use rpc_governance::adaptive::{AdaptiveLimit, AdaptiveOptions, AdaptivePermit, Criticality};
use rpc_governance::bulkhead::Permit;

use crate::cap::EntryCap;
use rpc_governance::ratelimit::{RateLimiter, RateLimits, Refused};

/// The attachment a caller marks a call's criticality with: `critical`, `default` or
/// `sheddable` (anything else counts as `default`).
pub const CRITICALITY_ATTACHMENT: &str = "rpc-criticality";

/// How many calls of an entry run at once.
#[derive(Debug, Clone)]
pub(crate) enum Gate {
    /// The fixed cap.
    Cap(EntryCap),
    /// The adaptive limit, at most the cap, which still counts every call: the server's
    /// shared cap holds across entries whatever their adaptive limits.
    Adaptive(AdaptiveLimit, EntryCap),
}

/// A slot taken at an entry's gate, returned when dropped.
#[derive(Debug)]
pub(crate) enum Slot {
    Cap(#[allow(dead_code)] Permit),
    Adaptive(
        #[allow(dead_code)] AdaptivePermit,
        #[allow(dead_code)] Permit,
    ),
    /// Admitted over the gate's limit, in observe mode: holds no slot.
    Observed,
}

impl Slot {
    /// The slot for an open stream: held until the stream ends, and not measured by an
    /// adaptive limit (a stream's duration is the caller's choice, not the server's latency).
    pub(crate) fn for_stream(self) -> Slot {
        match self {
            Slot::Adaptive(p, cap) => Slot::Adaptive(p.unmeasured(), cap),
            other => other,
        }
    }

    /// Returns the slot of a call that ran to its end (answered, failed or timed out): an
    /// adaptive limit measures it. A slot dropped otherwise (the call cancelled by its caller,
    /// or dropped with its connection) is returned unmeasured.
    pub(crate) fn completed(mut self) {
        if let Slot::Adaptive(p, _) = &mut self {
            p.measure();
        }
    }
}

/// An entry's admission policy: its rate limits, if any, its gate, and which of them only
/// observe.
#[derive(Debug)]
pub(crate) struct Policy {
    /// Shared with the next policy when the rules change neither the limits nor the gate's
    /// options (its buckets carry on).
    pub(crate) limiter: Option<Arc<RateLimiter>>,
    pub(crate) gate: Gate,
    /// `rate_limit_observe`: over a rate limit, report and admit.
    pub(crate) observe_rate: bool,
    /// `admission_observe`: over the cap or adaptive limit, report and admit.
    pub(crate) observe_gate: bool,
}

/// An entry's admission: the policy in force, replaced whole when the rules change. Shared by
/// its calls.
#[derive(Debug)]
pub(crate) struct Admission {
    now: ArcSwap<Policy>,
    events: EventBus,
    /// How the entry's answers are compressed (not admission, but a server option of the entry
    /// that changes with the same rules): the algorithm's wire number in the high 32 bits,
    /// the threshold in the low ones. An atomic, so a call reads it for the price of a load.
    compression: AtomicU64,
}

impl Gate {
    /// The cap that counts every call through the gate.
    pub(crate) fn cap(&self) -> &EntryCap {
        match self {
            Gate::Cap(cap) | Gate::Adaptive(_, cap) => cap,
        }
    }

    /// The adaptive limit of an entry under `cap` (its own, or the server's shared one),
    /// starting at the lesser of 20 and the cap's size, never below `min`.
    #[cfg(test)]
    pub(crate) fn adaptive(cap: EntryCap, min: usize) -> Gate {
        Gate::adaptive_after(cap, min, None)
    }

    /// The adaptive limit of an entry under `cap`, going on from the entry's adaptive limit
    /// `before` when it had one (a rules change): the calls holding its slots stay counted,
    /// and its limit and measurements carry over within the new bounds. Without one it starts
    /// at the lesser of 20 and the cap's size, never below `min`.
    pub(crate) fn adaptive_after(
        cap: EntryCap,
        min: usize,
        before: Option<&AdaptiveLimit>,
    ) -> Gate {
        let max = cap.size().max(1);
        let min = min.clamp(1, max);
        let options = AdaptiveOptions {
            initial: AdaptiveOptions::default().initial.clamp(min, max),
            min,
            max,
            ..AdaptiveOptions::default()
        };
        let limit = match before {
            Some(before) => before.rebounded(options),
            None => AdaptiveLimit::new(options),
        };
        Gate::Adaptive(limit, cap)
    }

    /// The gate's adaptive limit, if it has one.
    pub(crate) fn adaptive_limit(&self) -> Option<&AdaptiveLimit> {
        match self {
            Gate::Adaptive(limit, _) => Some(limit),
            Gate::Cap(_) => None,
        }
    }
}

impl Admission {
    /// The server's event bus, which the entry's refusals are told on.
    pub(crate) fn events(&self) -> &EventBus {
        &self.events
    }

    /// The admission of `policy`, reporting observed refusals on `events`.
    pub(crate) fn new(policy: Policy, events: EventBus) -> Self {
        Admission {
            now: ArcSwap::from_pointee(policy),
            events,
            compression: AtomicU64::new(0),
        }
    }

    /// Compresses the entry's answers with `algorithm` from `threshold` bytes on, from the next
    /// call.
    pub(crate) fn set_compression(&self, algorithm: Compression, threshold: u32) {
        let packed = (u64::from(algorithm.to_wire() as u32) << 32) | u64::from(threshold);
        self.compression.store(packed, Ordering::Relaxed);
    }

    /// The entry's answer compression: the algorithm and the threshold.
    pub(crate) fn compression(&self) -> (Compression, u32) {
        let packed = self.compression.load(Ordering::Relaxed);
        let algorithm = Compression::from_wire((packed >> 32) as i32).unwrap_or_default();
        (algorithm, packed as u32)
    }

    /// Puts `policy` in force from the next call.
    pub(crate) fn replace(&self, policy: Policy) {
        self.now.store(Arc::new(policy));
    }

    /// The policy in force.
    pub(crate) fn policy(&self) -> Arc<Policy> {
        self.now.load_full()
    }

    /// The cap in force (the adaptive limit's maximum when adaptive).
    #[cfg(test)]
    pub(crate) fn cap(&self) -> usize {
        match &self.now.load().gate {
            Gate::Cap(cap) => cap.size(),
            Gate::Adaptive(a, _) => a.limit(),
        }
    }

    fn observed(&self, kind: EventKind, entry: &str, e: &RpcError) {
        self.events.emit_observed(
            kind,
            &Arc::from(entry),
            None,
            0,
            Some(format!("would refuse, admitted (observe mode): {e}")),
        );
    }

    /// Admits a call of `client_id` with `criticality` and `remaining` budget, or refuses it
    /// at once: 429 over a rate limit (with its retry-after), 515 at the gate.
    pub(crate) fn admit(
        &self,
        entry: &str,
        client_id: &str,
        criticality: Option<&str>,
        remaining: Option<Duration>,
    ) -> Result<Slot, RpcError> {
        let p = self.now.load();
        // Whether the call took rate-limit tokens (given back if the gate refuses it).
        let mut took_tokens = false;
        if let Some(limiter) = &p.limiter {
            match limiter.try_admit(client_id) {
                Ok(()) => took_tokens = true,
                Err((which, after)) => {
                    let e = rate_limited(entry, client_id, limiter.limits(), which, after);
                    if !p.observe_rate {
                        return Err(e);
                    }
                    self.observed(EventKind::RateLimited, entry, &e);
                }
            }
        }
        let slot = match &p.gate {
            Gate::Cap(cap) => cap.try_enter(entry).map(Slot::Cap),
            Gate::Adaptive(limit, cap) => cap.try_enter(entry).and_then(|held| {
                // (The cap first: a call refused there is never measured by the limit.)
                let criticality = criticality.and_then(Criticality::parse).unwrap_or_default();
                // (Measured only once the call is known to have run to its end: `completed`.)
                match limit.try_enter(entry, criticality, remaining) {
                    Ok(permit) => Ok(Slot::Adaptive(permit.unmeasured(), held)),
                    // Over the adaptive limit only, in observe mode: admitted, and still
                    // counted by the cap, which holds across the entries that share it.
                    Err(e) if p.observe_gate => {
                        self.observed(EventKind::Overflow, entry, &e);
                        Ok(Slot::Cap(held))
                    }
                    Err(e) => Err(e),
                }
            }),
        };
        match slot {
            Err(e) if p.observe_gate => {
                self.observed(EventKind::Overflow, entry, &e);
                Ok(Slot::Observed)
            }
            Err(e) => {
                if let (true, Some(limiter)) = (took_tokens, &p.limiter) {
                    limiter.give_back(client_id);
                }
                Err(e)
            }
            ok => ok,
        }
    }

    /// Gives back the rate-limit tokens a call admitted here took, when it was refused further
    /// on without running (its arguments could not be decompressed for want of the budget).
    /// (One admitted over a limit in observe mode took none; what it gets back is never above
    /// the burst.)
    pub(crate) fn give_back(&self, client_id: &str) {
        if let Some(limiter) = &self.now.load().limiter {
            limiter.give_back(client_id);
        }
    }

    /// The entry's load now: calls holding a slot, and the limit in force.
    pub(crate) fn load(&self) -> (u32, u32) {
        let p = self.now.load();
        let (n, limit) = match &p.gate {
            Gate::Cap(cap) => (cap.in_use(), cap.size()),
            Gate::Adaptive(a, _) => (a.in_flight(), a.limit()),
        };
        (saturate(n), saturate(limit))
    }
}

fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The 429 answer: which limit, its rate, and when to come back.
fn rate_limited(
    entry: &str,
    client_id: &str,
    limits: RateLimits,
    which: Refused,
    after: Duration,
) -> RpcError {
    // Rounded up: a caller that waits the advertised time finds a token.
    let ms = after.as_micros().div_ceil(1000).max(1);
    let what = match (which, limits.per_caller, limits.entry) {
        (Refused::Caller, Some((rate, _)), _) => {
            format!("the quota of caller {client_id:?} ({rate} calls/s)")
        }
        (_, _, Some((rate, _))) => format!("its limit for all callers ({rate} calls/s)"),
        _ => "its rate limit".to_string(),
    };
    RpcError::new(
        StatusCode::RateLimited,
        format!(
            "{entry} refused the call over {what}; nothing ran: retry after {ms} ms, or on \
             another endpoint"
        ),
    )
    .with_retry_after(Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
}

#[cfg(test)]
mod tests {
    use rpc_core::StatusCode;
    use rpc_governance::events::GovernanceEvent;
    use tokio::sync::broadcast;

    use rpc_governance::bulkhead::Bulkhead;

    use super::*;

    /// An entry's own cap of `n` calls.
    fn own(n: usize) -> EntryCap {
        EntryCap::new(Some(n), &Bulkhead::new(0))
    }

    /// An entry's share of the server's cap `shared`.
    fn share(shared: &Bulkhead) -> EntryCap {
        EntryCap::new(None, shared)
    }

    fn admission(gate: Gate, rate: Option<(f64, u32)>, observe: bool) -> (Admission, Events) {
        let events = EventBus::new();
        let rx = events.subscribe();
        let policy = Policy {
            limiter: rate.map(|entry| {
                Arc::new(RateLimiter::new(RateLimits {
                    entry: Some(entry),
                    per_caller: None,
                }))
            }),
            gate,
            observe_rate: observe,
            observe_gate: observe,
        };
        (Admission::new(policy, events), Events(rx))
    }

    struct Events(broadcast::Receiver<GovernanceEvent>);

    impl Events {
        fn all(&mut self) -> Vec<(EventKind, bool)> {
            std::iter::from_fn(|| self.0.try_recv().ok())
                .map(|e| (e.kind, e.observed))
                .collect()
        }
    }

    fn admit(a: &Admission) -> Result<Slot, RpcError> {
        a.admit("t.T.m", "caller", None, None)
    }

    #[tokio::test(start_paused = true)]
    async fn over_a_rate_limit_observe_mode_admits_and_reports_what_enforcing_refuses() {
        // One call per second, burst 1: the second call within the second is over the limit.
        for observe in [false, true] {
            let (a, mut events) = admission(Gate::Cap(own(10)), Some((1.0, 1)), observe);
            assert!(admit(&a).is_ok());
            let second = admit(&a);
            if observe {
                assert!(second.is_ok(), "observe mode admits");
                assert_eq!(events.all(), vec![(EventKind::RateLimited, true)]);
            } else {
                let e = second.unwrap_err();
                assert_eq!(e.code(), StatusCode::RateLimited, "{e}");
                assert!(events.all().is_empty(), "the dispatcher reports refusals");
            }
            // A second later the bucket has a token again.
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(admit(&a).is_ok());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_refused_at_the_cap_gives_its_rate_limit_token_back() {
        for gate in [|| Gate::Cap(own(1)), || Gate::adaptive(own(1), 1)] {
            // Two calls a second, burst 2, one at a time.
            let (a, _events) = admission(gate(), Some((2.0, 2)), false);
            let held = admit(&a).unwrap();
            let e = admit(&a).unwrap_err();
            assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
            drop(held);
            // Only one call ran within the second: the second token is still there.
            assert!(admit(&a).is_ok(), "refused at the cap, it spent no token");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn over_the_cap_or_the_adaptive_limit_observe_mode_admits_and_reports() {
        for gate in [|| Gate::Cap(own(1)), || Gate::adaptive(own(1), 1)] {
            for observe in [false, true] {
                let (a, mut events) = admission(gate(), None, observe);
                let held = admit(&a).unwrap();
                assert_eq!(a.load(), (1, 1));
                let second = admit(&a);
                if observe {
                    assert!(matches!(second, Ok(Slot::Observed)));
                    assert_eq!(events.all(), vec![(EventKind::Overflow, true)]);
                    // An observed call holds no slot.
                    assert_eq!(a.load(), (1, 1));
                } else {
                    let e = second.unwrap_err();
                    assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
                }
                drop(held);
                assert!(admit(&a).is_ok());
            }
        }
    }

    /// A call that ran to its end is measured by the adaptive limit; one dropped half-way (its
    /// caller cancelled it) is not.
    #[tokio::test(start_paused = true)]
    async fn only_a_call_that_ran_to_its_end_is_measured() {
        let gate = Gate::adaptive(own(10), 1);
        let Gate::Adaptive(limit, _) = &gate else {
            unreachable!()
        };
        let limit = limit.clone();
        let (a, _) = admission(gate, None, false);
        let cancelled = admit(&a).unwrap();
        tokio::time::advance(Duration::from_millis(3)).await;
        drop(cancelled);
        assert_eq!(
            limit.recent_latency(),
            None,
            "a cancelled call says nothing"
        );
        assert_eq!(limit.in_flight(), 0, "its slot is back");
        let done = admit(&a).unwrap();
        tokio::time::advance(Duration::from_millis(40)).await;
        done.completed();
        assert_eq!(limit.recent_latency(), Some(Duration::from_millis(40)));
    }

    /// Entries with adaptive limits under the server's shared cap: the cap holds across them
    /// (each limit alone would let each entry run up to the cap).
    #[tokio::test(start_paused = true)]
    async fn adaptive_entries_under_the_shared_cap_never_exceed_it_together() {
        let shared = Bulkhead::new(2);
        let (a, _) = admission(Gate::adaptive(share(&shared), 1), None, false);
        let (b, _) = admission(Gate::adaptive(share(&shared), 1), None, false);
        let held = [admit(&a).unwrap(), admit(&b).unwrap()];
        let e = admit(&b).expect_err("the shared cap of 2 is full");
        assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
        // Critical calls may go over an adaptive limit, never over the cap.
        let e = a
            .admit("t.T.m", "caller", Some("critical"), None)
            .expect_err("the cap is full");
        assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
        assert_eq!(shared.in_use(), 2);
        drop(held);
        assert_eq!(shared.in_use(), 0);
        assert!(admit(&b).is_ok());
    }

    /// A call over its entry's adaptive limit that observe mode admits still holds a slot of
    /// the cap it shares with other entries: the cap holds across them whatever one observes.
    #[tokio::test(start_paused = true)]
    async fn a_call_observed_over_its_adaptive_limit_still_counts_against_the_shared_cap() {
        const CAP: usize = 30;
        let shared = Bulkhead::new(CAP);
        let gate = Gate::adaptive(share(&shared), 1);
        let Gate::Adaptive(limit, _) = &gate else {
            unreachable!()
        };
        let within = limit.limit();
        assert!(within < CAP, "the limit starts under the cap");
        let (observing, mut events) = admission(gate, None, true);
        let held: Vec<Slot> = (0..CAP).map(|_| admit(&observing).unwrap()).collect();
        assert_eq!(
            events.all(),
            vec![(EventKind::Overflow, true); CAP - within],
            "the calls over the limit are reported"
        );
        assert_eq!(shared.in_use(), CAP, "every call holds a slot of the cap");
        let (other, _) = admission(Gate::adaptive(share(&shared), 1), None, false);
        let e = admit(&other).expect_err("the shared cap is full");
        assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
        drop(held);
        assert_eq!(shared.in_use(), 0);
    }

    /// `replace` puts a policy in force for the next call; a slot taken under the one before
    /// stays with the gate it came from, and its release frees nothing of the new one. (A
    /// rules change builds the new gate with `EntryCap::next`, which counts the calls still
    /// running under the old: `cap.rs` tests that; here the new gate is a fresh one.)
    #[tokio::test(start_paused = true)]
    async fn a_replaced_policy_applies_to_the_next_call_and_a_slot_held_stays_with_the_old() {
        let (a, _events) = admission(Gate::Cap(own(1)), None, false);
        let held = admit(&a).unwrap();
        assert!(admit(&a).is_err());
        a.replace(Policy {
            limiter: None,
            gate: Gate::Cap(own(3)),
            observe_rate: false,
            observe_gate: false,
        });
        assert_eq!(a.cap(), 3);
        let more: Vec<Slot> = (0..3).map(|_| admit(&a).unwrap()).collect();
        assert!(admit(&a).is_err(), "the new cap is 3");
        drop(held);
        assert!(
            admit(&a).is_err(),
            "the old slot's release frees none of the new cap"
        );
        drop(more);
        assert!(admit(&a).is_ok());
    }
}
