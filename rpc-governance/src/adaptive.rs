//! Adaptive concurrency: a server cap that finds its own value.
//!
//! A fixed cap ([`crate::bulkhead`]) must be guessed: too low and the server refuses calls it
//! could serve, too high and calls queue inside it (on its threads, its database pool, its
//! downstream calls) until every answer is late. The right number moves with the hardware, the
//! payloads and what the handlers wait on. This limiter measures it, with the gradient rule of
//! Envoy's adaptive concurrency filter (and of Netflix's concurrency-limits): what a call takes
//! without queueing (`no_load`, the shortest window average seen) against what calls take now,
//!
//! ```text
//! gradient  = clamp(tolerance × no_load / rtt, 0.5, 2)
//! new limit = limit × gradient + √limit                   within [min, max]
//! ```
//!
//! so the limit doubles at most while calls are as fast as they get, and halves at most when
//! they take longer than `tolerance` allows. The headroom √limit keeps a small queue however
//! slow calls get: under a lasting overload the limit settles at 4 (4 × 0.5 + √4), not below,
//! whatever the minimum. (Left out below tolerance, it let the limit fall to its minimum, and
//! the overload scenario's goodput fell from about 81 % to 74–79 % of capacity: kept.) It changes once per window of samples (as many as
//! the limit, at least ten: one round trip's worth at full use, averaged), not after every call,
//! whose samples all describe the same moment, and only while at least half of it is in use, so
//! a quiet server does not raise it blindly. Every 60 windows the limit is held at its minimum
//! for `min` calls, to measure `no_load` anew without the queue the limit itself allows; a server
//! that became slower for good (heavier calls, a slower disk) is then judged by its new speed.
//! The calls still running from before the probe keep their slots beside its `min` (held
//! to `min` in all, `min` calls stuck in a downstream would refuse every call, and the probe,
//! whose window only calls admitted during it fill, would never end).
//!
//! Admission is like the fixed cap's: a call takes a slot at once or is refused with Overflow
//! (515) at once, never queued. Two refinements:
//! - **Deadline-aware:** a call whose remaining budget is below what the entry's calls take
//!   recently would time out anyway; it is refused at once instead of run for nothing, while
//!   other calls run. With none running it is let through: only admitted calls are measured,
//!   so refusing it too would keep the old figure, and every shorter deadline refused, for good.
//! - **Criticality:** callers may mark a call critical, default or sheddable. Sheddable calls
//!   get 80 % of the limit, default ones all of it, critical ones a tenth more: as load rises,
//!   sheddable work is refused first.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rpc_core::{RpcError, StatusCode};
use tokio::time::Instant;

/// How much a call matters to its caller, for admission under load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Criticality {
    /// Refused last: may go a tenth over the limit.
    Critical,
    /// The limit as measured.
    #[default]
    Default,
    /// Refused first: held to 80 % of the limit.
    Sheddable,
}

impl Criticality {
    /// The criticality named `name` (`critical`, `default`, `sheddable`), as carried by a call.
    pub fn parse(name: &str) -> Option<Criticality> {
        match name {
            "critical" => Some(Criticality::Critical),
            "default" => Some(Criticality::Default),
            "sheddable" => Some(Criticality::Sheddable),
            _ => None,
        }
    }

    /// Calls of this criticality admitted at once under `limit`.
    fn share(self, limit: usize) -> usize {
        match self {
            Criticality::Critical => limit + (limit / 10).max(1),
            Criticality::Default => limit,
            Criticality::Sheddable => (limit * 4 / 5).max(1),
        }
    }
}

/// Bounds and tuning of an [`AdaptiveLimit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveOptions {
    /// The limit before any call has been measured.
    pub initial: usize,
    /// The limit never goes below this.
    pub min: usize,
    /// The limit never goes above this.
    pub max: usize,
    /// How much slower than without load calls may be before the limit shrinks (1.25: a
    /// quarter slower).
    pub tolerance: f64,
}

impl Default for AdaptiveOptions {
    fn default() -> Self {
        AdaptiveOptions {
            initial: 20,
            min: 4,
            max: 1000,
            tolerance: 1.25,
        }
    }
}

/// The measured state behind the limit.
#[derive(Debug, Clone)]
struct Estimate {
    limit: f64,
    /// The shortest window average since the last probe, in seconds.
    no_load: Option<f64>,
    /// Fast average of the calls' round trip, in seconds (for deadline-aware admission).
    recent: Option<f64>,
    /// Windows until the next probe.
    until_probe: usize,
    /// During a probe, the limit to return to and when the probe began (calls admitted
    /// before then ran under the old limit's queue and are not counted).
    probing: Option<(f64, Instant)>,
    /// During a probe, the calls admitted before it and still running: admitted beside the
    /// probe's `min`, each leaving its slot to nobody as it ends.
    before_probe: usize,
    /// The window being gathered: samples, their sum (seconds), the most calls in flight.
    window: (usize, f64, usize),
}

/// `options` made consistent: `min` at least 1, `max` at least `min`, `initial` between them,
/// `tolerance` at least 1.
fn bounded(options: AdaptiveOptions) -> AdaptiveOptions {
    let min = options.min.max(1);
    let max = options.max.max(min);
    AdaptiveOptions {
        min,
        max,
        initial: options.initial.clamp(min, max),
        tolerance: options.tolerance.max(1.0),
    }
}

/// A concurrency limit that adapts to measured latency; see the [module](self) documentation.
#[derive(Debug, Clone)]
pub struct AdaptiveLimit {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    options: AdaptiveOptions,
    /// Shared with the limiters this one was [`rebounded`](AdaptiveLimit::rebounded) from or
    /// into: a slot returned to any of them leaves the count of all.
    in_flight: Arc<AtomicUsize>,
    /// The current limit, rounded, read on every admission without the lock.
    limit: AtomicUsize,
    estimate: Mutex<Estimate>,
}

/// A slot of an [`AdaptiveLimit`]: dropping it returns the slot and records how long the call
/// took (unless [`ignore`](Self::ignore)d).
#[derive(Debug)]
#[must_use = "the slot is returned and measured when the permit is dropped"]
pub struct AdaptivePermit {
    inner: Arc<Inner>,
    started: Instant,
    measured: bool,
}

impl AdaptivePermit {
    /// Returns the slot without measuring the call: for calls that ended early (cancelled,
    /// refused further down) and say nothing about the server's latency.
    pub fn ignore(mut self) {
        self.measured = false;
    }

    /// The same slot, returned without measuring when dropped: for work whose duration is not
    /// a latency (an open stream lasts as long as its caller wants it).
    pub fn unmeasured(mut self) -> Self {
        self.measured = false;
        self
    }

    /// Measures the call when the slot is dropped after all: for a slot taken
    /// [`unmeasured`](Self::unmeasured) until its call is known to have run to its end (a call
    /// cancelled half-way says nothing of the server's latency).
    pub fn measure(&mut self) {
        self.measured = true;
    }
}

impl Drop for AdaptivePermit {
    fn drop(&mut self) {
        let in_flight = self.inner.in_flight.fetch_sub(1, Ordering::AcqRel);
        if self.measured {
            self.inner.sample(self.started, Instant::now(), in_flight);
        } else {
            self.inner.left_unmeasured(self.started);
        }
    }
}

impl AdaptiveLimit {
    /// A limiter starting at `options.initial`, within `[options.min, options.max]`.
    pub fn new(options: AdaptiveOptions) -> Self {
        let options = bounded(options);
        AdaptiveLimit {
            inner: Arc::new(Inner {
                options,
                in_flight: Arc::new(AtomicUsize::new(0)),
                limit: AtomicUsize::new(options.initial),
                estimate: Mutex::new(Estimate {
                    limit: options.initial as f64,
                    no_load: None,
                    recent: None,
                    until_probe: PROBE_EVERY,
                    probing: None,
                    before_probe: 0,
                    window: (0, 0.0, 0),
                }),
            }),
        }
    }

    /// A limiter under new bounds (a rules change of the entry's cap or minimum) that goes on
    /// from this one: it counts the calls holding this one's slots until they end, and starts
    /// from its limit (within the new bounds) and measurements. `options.initial` is not used.
    /// A new limiter instead would start its count at 0 and admit a whole limit more beside
    /// the calls already running.
    pub fn rebounded(&self, options: AdaptiveOptions) -> Self {
        let options = bounded(options);
        let mut estimate = self.inner.lock().clone();
        estimate.limit = estimate.limit.clamp(options.min as f64, options.max as f64);
        let mut limit = estimate.limit.round() as usize;
        if let Some((before, _)) = &mut estimate.probing {
            *before = before.clamp(options.min as f64, options.max as f64);
            limit += estimate.before_probe;
        }
        AdaptiveLimit {
            inner: Arc::new(Inner {
                options: AdaptiveOptions {
                    initial: limit,
                    ..options
                },
                in_flight: self.inner.in_flight.clone(),
                limit: AtomicUsize::new(limit),
                estimate: Mutex::new(estimate),
            }),
        }
    }

    /// The current limit.
    pub fn limit(&self) -> usize {
        self.inner.limit.load(Ordering::Relaxed)
    }

    /// Calls holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Acquire)
    }

    /// What the entry's calls take recently (the fast average), once measured.
    pub fn recent_latency(&self) -> Option<Duration> {
        let e = self.inner.lock();
        e.recent.map(Duration::from_secs_f64)
    }

    /// Takes a slot for a call of `criticality` with `remaining` budget (None: no deadline),
    /// or refuses it at once with Overflow (515): over the limit for its criticality, or with
    /// less time left than the entry's calls take recently.
    pub fn try_enter(
        &self,
        entry: &str,
        criticality: Criticality,
        remaining: Option<Duration>,
    ) -> Result<AdaptivePermit, RpcError> {
        if let (Some(left), Some(needs)) = (remaining, self.recent_latency()) {
            // (With nothing running, nothing would measure the entry anew: let it through.)
            if left < needs && self.in_flight() > 0 {
                return Err(RpcError::new(
                    StatusCode::OverflowMaxServerHandle,
                    format!(
                        "{entry}: the call has {} ms left and calls here take about {} ms now; \
                         refused at once rather than run for nothing: call another endpoint or \
                         allow a longer deadline",
                        left.as_millis(),
                        needs.as_millis()
                    ),
                ));
            }
        }
        let limit = self.limit();
        let share = criticality.share(limit);
        let taken = self
            .inner
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < share).then_some(n + 1)
            });
        match taken {
            Ok(_) => Ok(AdaptivePermit {
                inner: self.inner.clone(),
                started: Instant::now(),
                measured: true,
            }),
            Err(n) => Err(RpcError::new(
                StatusCode::OverflowMaxServerHandle,
                format!(
                    "{entry} is handling {n} calls, at or over its adaptive limit of {share} for \
                     {criticality:?} calls now (the limit is {limit}; sheddable calls get 80 % \
                     of it, critical ones a tenth more); call another endpoint or retry later"
                ),
            )),
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Estimate> {
        self.estimate.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Folds the round trip of one call, admitted at `started` and finished at `now` with
    /// `in_flight` calls running (itself included), into the estimate, and the limit at the end
    /// of a window.
    fn sample(&self, started: Instant, now: Instant, in_flight: usize) {
        /// Weight of a new sample in the recent average (about the last ten calls).
        const RECENT: f64 = 0.1;
        let rtt = (now - started).as_secs_f64().max(1e-6);
        let o = &self.options;
        let mut e = self.lock();
        if e.probing.is_some_and(|(_, since)| started < since) {
            self.left_before_probe(&mut e);
            return;
        }
        e.recent = Some(e.recent.map_or(rtt, |r| r + (rtt - r) * RECENT));
        let (n, sum, most) = e.window;
        let (n, sum, most) = (n + 1, sum + rtt, most.max(in_flight));
        // A probe's window is one minimum's worth of calls, so the probe ends quickly.
        let size = match e.probing {
            Some(_) => o.min,
            None => (e.limit as usize).max(10),
        };
        if n < size {
            e.window = (n, sum, most);
            return;
        }
        e.window = (0, 0.0, 0);
        let rtt = sum / n as f64;
        let next = if let Some((before, _)) = e.probing.take() {
            // The probe's window ran at the minimum: no queue, the true no-load time.
            e.no_load = Some(rtt);
            before
        } else if e.until_probe == 0 {
            e.until_probe = PROBE_EVERY;
            e.probing = Some((e.limit, now));
            // Running beside this call, which is ending.
            e.before_probe = in_flight.saturating_sub(1);
            let limit = o.min + e.before_probe;
            self.limit.store(limit, Ordering::Relaxed);
            e.limit = o.min as f64;
            return;
        } else {
            e.until_probe -= 1;
            let no_load = e.no_load.map_or(rtt, |n| n.min(rtt));
            e.no_load = Some(no_load);
            if (most as f64) * 2.0 < e.limit {
                // Not using the limit: latency says nothing about a larger one.
                return;
            }
            let gradient = (o.tolerance * no_load / rtt).clamp(0.5, 2.0);
            (e.limit * gradient + e.limit.sqrt()).clamp(o.min as f64, o.max as f64)
        };
        e.limit = next;
        e.before_probe = 0;
        self.limit.store(next.round() as usize, Ordering::Relaxed);
    }

    /// A call admitted before the probe under way ended: its slot is not given to another.
    fn left_before_probe(&self, e: &mut Estimate) {
        e.before_probe = e.before_probe.saturating_sub(1);
        let limit = self.options.min + e.before_probe;
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// An unmeasured call admitted at `started` ended (see [`sample`](Self::sample)).
    fn left_unmeasured(&self, started: Instant) {
        let mut e = self.lock();
        if e.probing.is_some_and(|(_, since)| started < since) {
            self.left_before_probe(&mut e);
        }
    }
}

/// `no_load` is measured anew every this many windows.
const PROBE_EVERY: usize = 60;

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `n` calls that each take `rtt` with `parallel` of them in flight, on the paused
    /// clock; returns how many were refused.
    async fn load(l: &AdaptiveLimit, n: usize, parallel: usize, rtt: Duration) -> usize {
        let mut refused = 0;
        for _ in 0..n / parallel {
            let permits: Vec<_> = (0..parallel)
                .filter_map(|_| l.try_enter("e", Criticality::Default, None).ok())
                .collect();
            refused += parallel - permits.len();
            tokio::time::advance(rtt).await;
            drop(permits);
        }
        refused
    }

    #[tokio::test(start_paused = true)]
    async fn steady_latency_under_full_use_raises_the_limit() {
        let l = AdaptiveLimit::new(AdaptiveOptions::default());
        let start = l.limit();
        // Offered: always as many calls as the limit allows, at a steady 10 ms.
        for _ in 0..50 {
            let parallel = l.limit();
            load(&l, parallel, parallel, Duration::from_millis(10)).await;
        }
        assert!(l.limit() > 2 * start, "{} -> {}", start, l.limit());
    }

    /// A server that runs `capacity` calls at once in 10 ms: more queue, and take longer in
    /// proportion. Offered as many calls as the limit admits, round after round; returns the
    /// limit after each round.
    async fn against_capacity(l: &AdaptiveLimit, capacity: usize, rounds: usize) -> Vec<usize> {
        let mut limits = Vec::new();
        for _ in 0..rounds {
            let parallel = l.limit();
            let rtt = Duration::from_millis(10) * parallel.div_ceil(capacity) as u32;
            load(l, parallel, parallel, rtt).await;
            limits.push(l.limit());
        }
        limits
    }

    #[tokio::test(start_paused = true)]
    async fn the_limit_settles_near_the_servers_capacity() {
        for (initial, capacity) in [(20, 100), (400, 50)] {
            let l = AdaptiveLimit::new(AdaptiveOptions {
                initial,
                ..AdaptiveOptions::default()
            });
            let limits = against_capacity(&l, capacity, 300).await;
            let mut tail = limits[200..].to_vec();
            tail.sort_unstable();
            let median = tail[tail.len() / 2];
            // Probes hold the limit at its minimum for a window now and then: a few rounds.
            let low = tail.iter().filter(|l| **l < capacity / 2).count();
            assert!(
                median >= capacity * 7 / 10 && median <= capacity * 3 / 2 && low <= 10,
                "capacity {capacity}, from {initial}: median limit of the last 100 rounds \
                 {median}, {low} rounds below half the capacity: {tail:?}"
            );
        }
    }

    /// Under an overload that lasts, the limit settles where the rule's headroom holds it,
    /// whatever the minimum: the fixed point of L = 0.5 L + √L, 4 (as documented for
    /// `adaptive_min_limit`).
    #[tokio::test(start_paused = true)]
    async fn a_lasting_overload_settles_the_limit_at_four_whatever_the_minimum() {
        let l = AdaptiveLimit::new(AdaptiveOptions {
            min: 1,
            ..AdaptiveOptions::default()
        });
        // Calls of 10 ms at full use: the no-load time.
        load(&l, 200, 20, Duration::from_millis(10)).await;
        // Then every call takes 100 times as long, the limit fully used: the gradient is at
        // its floor (1.25 × 10 ms / 1 s, clamped to 0.5) window after window.
        for _ in 0..40 {
            let p = l.limit();
            load(&l, p, p, Duration::from_secs(1)).await;
        }
        assert_eq!(l.limit(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unmeasured_slot_is_held_and_returned_without_a_latency_sample() {
        let l = AdaptiveLimit::new(AdaptiveOptions::default());
        let stream = l
            .try_enter("e", Criticality::Default, None)
            .unwrap()
            .unmeasured();
        assert_eq!(l.in_flight(), 1, "held");
        tokio::time::advance(Duration::from_secs(60)).await;
        drop(stream);
        assert_eq!(l.in_flight(), 0, "returned");
        assert_eq!(
            l.recent_latency(),
            None,
            "a minute-long stream is no latency"
        );
        let call = l.try_enter("e", Criticality::Default, None).unwrap();
        tokio::time::advance(Duration::from_millis(10)).await;
        drop(call);
        assert_eq!(l.recent_latency(), Some(Duration::from_millis(10)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_server_does_not_raise_its_limit() {
        let l = AdaptiveLimit::new(AdaptiveOptions::default());
        // One call at a time, far below half the limit of 20.
        load(&l, 500, 1, Duration::from_millis(5)).await;
        assert_eq!(l.limit(), AdaptiveOptions::default().initial);
    }

    #[tokio::test(start_paused = true)]
    async fn over_the_limit_calls_are_refused_at_once_with_overflow() {
        let l = AdaptiveLimit::new(AdaptiveOptions {
            initial: 10,
            ..AdaptiveOptions::default()
        });
        let held: Vec<_> = (0..10)
            .map(|_| l.try_enter("e", Criticality::Default, None).unwrap())
            .collect();
        let e = l.try_enter("e", Criticality::Default, None).unwrap_err();
        assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle);
        assert_eq!(l.in_flight(), 10);
        drop(held);
        assert_eq!(l.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn sheddable_calls_are_refused_before_default_and_critical_ones() {
        let l = AdaptiveLimit::new(AdaptiveOptions {
            initial: 10,
            ..AdaptiveOptions::default()
        });
        // 8 in flight: sheddable calls (80 % of 10) are refused, the others admitted; the
        // refusal names the sheddable calls' limit, 8, not the 10 of default ones.
        let mut held: Vec<_> = (0..8)
            .map(|_| l.try_enter("e", Criticality::Default, None).unwrap())
            .collect();
        let e = l
            .try_enter("e", Criticality::Sheddable, None)
            .expect_err("over the sheddable share");
        assert!(
            e.message().contains("adaptive limit of 8 for Sheddable"),
            "{e}"
        );
        held.push(l.try_enter("e", Criticality::Default, None).unwrap());
        held.push(l.try_enter("e", Criticality::Default, None).unwrap());
        // At the limit: default refused, critical still admitted (a tenth more: 11).
        assert!(l.try_enter("e", Criticality::Default, None).is_err());
        held.push(l.try_enter("e", Criticality::Critical, None).unwrap());
        assert!(l.try_enter("e", Criticality::Critical, None).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_with_less_budget_than_calls_take_is_refused_at_once() {
        let l = AdaptiveLimit::new(AdaptiveOptions::default());
        load(&l, 100, 1, Duration::from_millis(50)).await;
        let needs = l.recent_latency().expect("measured");
        assert_eq!(needs, Duration::from_millis(50));
        let running = l.try_enter("e", Criticality::Default, None).unwrap();
        let e = l
            .try_enter("e", Criticality::Default, Some(Duration::from_millis(20)))
            .unwrap_err();
        assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle);
        assert!(e.message().contains("20 ms left"), "{e}");
        assert!(l
            .try_enter("e", Criticality::Default, Some(Duration::from_millis(80)))
            .is_ok());
        drop(running);
    }

    /// After a stall every call took 5 s; callers now send 4 s deadlines. With no call
    /// running one is let through (else nothing would ever be measured again and every such
    /// call refused for good); its quick answer brings the figure down, and calls with 4 s
    /// left are admitted again.
    #[tokio::test(start_paused = true)]
    async fn with_nothing_running_a_short_deadline_is_let_through_and_measures_anew() {
        let l = AdaptiveLimit::new(AdaptiveOptions::default());
        load(&l, 20, 1, Duration::from_secs(5)).await;
        let four = Some(Duration::from_secs(4));
        let first = l
            .try_enter("e", Criticality::Default, four)
            .expect("nothing runs: let through");
        assert!(
            l.try_enter("e", Criticality::Default, four).is_err(),
            "one runs: the deadline rule holds"
        );
        tokio::time::advance(Duration::from_millis(10)).await;
        drop(first);
        // 5 s + (10 ms - 5 s) / 10 ≈ 4.5 s: still more than 4 s, so one at a time again.
        assert!(l.recent_latency().unwrap() > Duration::from_secs(4));
        for _ in 0..3 {
            let p = l
                .try_enter("e", Criticality::Default, four)
                .expect("let through");
            tokio::time::advance(Duration::from_millis(10)).await;
            drop(p);
        }
        assert!(l.recent_latency().unwrap() < Duration::from_secs(4));
        let held: Vec<_> = (0..3)
            .map(|_| {
                l.try_enter("e", Criticality::Default, four)
                    .expect("admitted")
            })
            .collect();
        drop(held);
    }

    /// Calls stuck from before a probe (a downstream that hangs, callers with no deadline)
    /// keep their slots beside the probe's `min`: `min` new calls are admitted, the probe
    /// ends, and the limit comes back. Before, the probe held every call to `min` slots in
    /// all, which the stuck calls filled: every default call was refused, and the probe,
    /// which only calls admitted during it end, never ended.
    #[tokio::test(start_paused = true)]
    async fn a_probe_admits_its_minimum_beside_the_calls_stuck_from_before_it() {
        let options = AdaptiveOptions {
            max: 40,
            ..AdaptiveOptions::default()
        };
        let l = AdaptiveLimit::new(options);
        let stuck: Vec<_> = (0..options.min)
            .map(|_| l.try_enter("e", Criticality::Default, None).unwrap())
            .collect();
        // Steady 10 ms calls filling the limit beside the stuck ones, until the limit falls:
        // steady calls only raise it or keep it, so a fall is the probe.
        let mut before = l.limit();
        let mut probing = false;
        for _ in 0..10_000 {
            let free = l.limit().saturating_sub(l.in_flight());
            let calls: Vec<_> = (0..free)
                .map(|_| l.try_enter("e", Criticality::Default, None).unwrap())
                .collect();
            tokio::time::advance(Duration::from_millis(10)).await;
            drop(calls);
            if l.limit() < before {
                probing = true;
                break;
            }
            before = l.limit();
        }
        assert!(probing, "no probe within 10 000 rounds");
        assert_eq!(before, options.max, "the limit reached its maximum first");
        // The probe's minimum of new calls is admitted beside the stuck ones; one more is not.
        let probe: Vec<_> = (0..options.min)
            .map(|_| {
                l.try_enter("e", Criticality::Default, None)
                    .expect("admitted beside the stuck calls")
            })
            .collect();
        assert!(l.try_enter("e", Criticality::Default, None).is_err());
        tokio::time::advance(Duration::from_millis(10)).await;
        drop(probe);
        assert_eq!(l.limit(), before, "the probe ended: the limit is back");
        assert_eq!(l.in_flight(), options.min, "the stuck calls still run");
        drop(stuck);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ignored_permit_returns_its_slot_without_a_sample() {
        let l = AdaptiveLimit::new(AdaptiveOptions::default());
        let p = l.try_enter("e", Criticality::Default, None).unwrap();
        tokio::time::advance(Duration::from_secs(3)).await;
        p.ignore();
        assert_eq!(l.in_flight(), 0);
        assert_eq!(l.recent_latency(), None);
    }
}
