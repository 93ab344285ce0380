//! Circuit breaker: stops calling an entry whose remote side keeps failing, then probes it.
//!
//! A half-open breaker must never wedge: every way a probe can end settles it. A success or an
//! exempt answer ([`Outcome::Answered`]: business, validation, not found, auth, not
//! implemented, which come from the callee's own logic and so prove the remote side is up)
//! closes it; a counted failure (timeouts included) opens it again; an outcome that says
//! nothing about the entry ([`Outcome::Ignored`]: a maybe-delivered failure held against one
//! endpoint) frees the probe slot for the next call; and a probe whose future is dropped
//! (caller cancellation, a panic) frees its slot at once through its [`Permit`]'s `Drop`. Only a
//! probe that hangs forever waits for the `breaker_seconds` expiry, after which its slot goes
//! to a new round of probes; should it end after all, its verdict still counts (a probe slower
//! than `breaker_seconds` would otherwise never settle anything, and a service that answers
//! slowly would keep its breaker half-open for good), while its freed slot is not freed twice.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rpc_core::{GovernanceOptions, RpcError, StatusCode};
use tokio::time::Instant;

/// The state of a breaker, as [`CircuitBreaker::state`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls flow; `failures` counted failures in a row so far.
    Closed {
        /// Consecutive counted failures.
        failures: u32,
    },
    /// Calls fail fast with [`StatusCode::CircuitOpen`] until `retry_after` has passed.
    Open {
        /// Time left before the breaker admits a probe.
        retry_after: Duration,
    },
    /// Probing: up to the configured number of calls go through; the first result decides.
    HalfOpen {
        /// Probes in flight.
        probes: u32,
    },
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed {
        failures: u32,
    },
    /// Opened at `since`; open until `since` + the entry's `breaker_seconds` as the options of
    /// the latest call say (a rule shortening it ends a breaker already open), `until` as last
    /// worked out (what [`CircuitBreaker::state`] reports).
    Open {
        since: Instant,
        until: Instant,
    },
    HalfOpen {
        probes: u32,
        since: Instant,
    },
    Isolated,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    /// Bumped at every transition: results of calls admitted under an older generation are
    /// ignored (a call that started before the circuit opened says nothing about now).
    generation: u64,
    /// The failure that last opened the breaker, quoted in the fail-fast error.
    last_cause: Option<String>,
    /// Failure-ratio mode: outcomes over the sampling window.
    window: Window,
    epoch: Instant,
    /// Bumped at every round of probes (entering half-open, and each expiry of a round whose
    /// probes did not report back): only a probe of the current round frees a slot.
    round: u64,
}

/// The most buckets a failure-ratio window holds: a window of up to this many seconds counts
/// its outcomes per second; a longer one (an hour, a day) in this many buckets of a few
/// seconds or more each, so its memory and upkeep stay the same whatever its length.
const MAX_BUCKETS: u64 = 60;

/// Failure-ratio mode's sampling window: outcomes per bucket, and their sums.
#[derive(Debug, Default)]
struct Window {
    buckets: VecDeque<Bucket>,
    /// Seconds per bucket, fixed by the window's length (a rule that changes the length so
    /// that the width changes starts the window over).
    width: u64,
    calls: u64,
    failures: u64,
}

/// Outcomes of one bucket of a [`Window`].
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Seconds since the breaker's epoch, divided by the window's width.
    at: u64,
    calls: u64,
    failures: u64,
}

impl Window {
    fn clear(&mut self) {
        self.buckets.clear();
        self.calls = 0;
        self.failures = 0;
    }

    /// Adds an outcome `secs` after the breaker's epoch to a window of `window_secs` and
    /// returns the window's (calls, failures). The window holds the current bucket and as
    /// many before it as make up no more than its length: an outcome leaves it up to two
    /// buckets' width early (one second for windows of up to a minute), never late.
    fn sample(&mut self, failed: bool, secs: u64, window_secs: u64) -> (u64, u64) {
        let window = window_secs.max(1);
        let width = window.div_ceil(MAX_BUCKETS);
        if width != self.width {
            self.clear();
            self.width = width;
        }
        // Whole buckets within the window: it never reaches back further than its length.
        let span = (window / width).max(1);
        let at = secs / width;
        while let Some(old) = self.buckets.front().copied() {
            if at.saturating_sub(old.at) < span {
                break;
            }
            self.buckets.pop_front();
            self.calls -= old.calls;
            self.failures -= old.failures;
        }
        let failed = u64::from(failed);
        match self.buckets.back_mut() {
            Some(b) if b.at == at => {
                b.calls += 1;
                b.failures += failed;
            }
            _ => self.buckets.push_back(Bucket {
                at,
                calls: 1,
                failures: failed,
            }),
        }
        self.calls += 1;
        self.failures += failed;
        (self.calls, self.failures)
    }
}

impl State {
    /// Moves to `phase` as a new generation: results of calls admitted before are ignored from
    /// now on. Every transition goes through here.
    fn enter(&mut self, phase: Phase) {
        self.generation += 1;
        self.phase = phase;
        self.window.clear();
    }

    /// Adds an outcome to the sampling window and returns the window's (calls, failures).
    fn sample(&mut self, failed: bool, now: Instant, window_secs: u64) -> (u64, u64) {
        let secs = now.duration_since(self.epoch).as_secs();
        self.window.sample(failed, secs, window_secs)
    }
}

/// Admission to call through a breaker; hand it back to [`CircuitBreaker::record`]. A probe's
/// permit dropped without a recorded outcome (the call was cancelled, or panicked) frees its
/// half-open slot at once.
#[derive(Debug)]
#[must_use = "record the outcome; a dropped probe permit only frees its slot"]
pub struct Permit<'a> {
    breaker: &'a CircuitBreaker,
    generation: u64,
    /// Admitted as a half-open probe: its slot must be settled.
    probe: bool,
    /// The round of probes it was admitted in (probes only).
    round: u64,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe {
            self.breaker.release(self.generation, self.round);
        }
    }
}

/// What a call's outcome means to the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The remote side answered.
    Success,
    /// The remote side failed (transport, timeout, overflow, server error).
    Failure,
    /// The callee's own logic answered with an error (business, validation, auth, not-found,
    /// not-implemented: Silky's exemptions). Not counted while closed; as a probe's result it
    /// proves the remote side is up and closes the breaker.
    Answered,
    /// Says nothing about the entry (a maybe-delivered failure held against one endpoint while
    /// others remain): not counted; a probe's slot is freed for the next call.
    Ignored,
}

impl Outcome {
    /// Classifies a call's result.
    pub fn of<T>(result: &Result<T, RpcError>) -> Outcome {
        match result {
            Ok(_) => Outcome::Success,
            // A rate limiter refuses before any handler runs: the call proves nothing of the
            // entry, and a probe refused so must not close the breaker (its slot is freed).
            // (A refused connection token is the server answering: it is up.)
            Err(e) if e.code() == StatusCode::RateLimited => Outcome::Ignored,
            Err(e) if e.code().is_breaker_exempt() => Outcome::Answered,
            Err(_) => Outcome::Failure,
        }
    }
}

/// What a breaker transition was, for events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Closed → open, or half-open → open after a failed probe.
    Break,
    /// Open → half-open: a probe is admitted.
    HalfOpen,
    /// Half-open → closed after a successful or answered probe, or a manual reset.
    Reset,
}

/// A per-entry circuit breaker.
///
/// Consecutive mode (`failure_ratio_percent` = 0, the default) opens after
/// `exceptions_allowed_before_breaking` counted failures in a row; failure-ratio mode opens once
/// the last `sampling_window_seconds` hold at least `minimum_throughput` calls of which
/// `failure_ratio_percent` % or more failed. Either way it stays open for
/// `breaker_seconds`, then admits `half_open_probes` probe calls: a successful or answered probe
/// closes it, a failed one opens it again, an ignored or cancelled one frees its slot. A probe
/// that never reports back frees its slot after `breaker_seconds` (at least a second).
#[derive(Debug)]
pub struct CircuitBreaker {
    state: Mutex<State>,
    /// Mirrors of the state for the hot path, written whenever the lock is released: the
    /// generation while closed (`NOT_CLOSED` otherwise), and whether it is closed with no
    /// failure counted. A healthy entry's calls then take no lock at all.
    closed_gen: AtomicU64,
    clean: AtomicBool,
    /// Whether an operator isolated the entry: read by every call of an entry whose breaker
    /// is turned off, open or not.
    isolated: AtomicBool,
}

const NOT_CLOSED: u64 = u64::MAX;

/// The breaker's state, locked; publishes the hot-path mirrors when released.
struct Locked<'a> {
    guard: std::sync::MutexGuard<'a, State>,
    breaker: &'a CircuitBreaker,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let (gen, clean) = match self.guard.phase {
            Phase::Closed { failures } => (self.guard.generation, failures == 0),
            _ => (NOT_CLOSED, false),
        };
        self.breaker.closed_gen.store(gen, Ordering::Release);
        self.breaker.clean.store(clean, Ordering::Release);
        self.breaker.isolated.store(
            matches!(self.guard.phase, Phase::Isolated),
            Ordering::Release,
        );
    }
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        CircuitBreaker {
            state: Mutex::new(State {
                phase: Phase::Closed { failures: 0 },
                generation: 0,
                last_cause: None,
                window: Window::default(),
                epoch: Instant::now(),
                round: 0,
            }),
            closed_gen: AtomicU64::new(0),
            clean: AtomicBool::new(true),
            isolated: AtomicBool::new(false),
        }
    }
}

/// How long the breaker stays open, capped: without a bound, `breaker_seconds = u64::MAX`
/// (meant as "until reset by hand") would overflow the clock.
fn break_duration(o: &GovernanceOptions) -> Duration {
    rpc_core::capped(Duration::from_secs(o.breaker_seconds))
}

/// The shortest round of probes. A round's probes that never report back free their slots
/// when it ends; with `breaker_seconds = 0` (probe as soon as the breaker opens) a round of
/// that length would end at once, and every call would start a new round as a probe, so
/// `half_open_probes` would bound nothing.
const SHORTEST_PROBE_ROUND: Duration = Duration::from_secs(1);

/// How long a round of probes holds its slots: `breaker_seconds`, at least
/// [`SHORTEST_PROBE_ROUND`].
fn probe_round(o: &GovernanceOptions) -> Duration {
    break_duration(o).max(SHORTEST_PROBE_ROUND)
}

fn isolated_error(entry: &str) -> RpcError {
    RpcError::new(
        StatusCode::CircuitOpen,
        format!("{entry} is isolated by an operator; reset its breaker to call it"),
    )
}

fn open_error(entry: &str, retry_after: Duration, cause: Option<&str>) -> RpcError {
    RpcError::new(
        StatusCode::CircuitOpen,
        format!(
            "the circuit breaker of {entry} is open after repeated failures, the call was not \
             sent; last failure: {}",
            cause.unwrap_or("none recorded")
        ),
    )
    .with_retry_after(retry_after)
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> Locked<'_> {
        Locked {
            guard: self.state.lock().unwrap_or_else(PoisonError::into_inner),
            breaker: self,
        }
    }

    /// Admits a call, or fails fast with [`StatusCode::CircuitOpen`] carrying `retry_after`.
    /// The second value reports a transition to half-open.
    pub fn try_acquire(
        &self,
        entry: &str,
        o: &GovernanceOptions,
    ) -> Result<(Permit<'_>, Option<Transition>), RpcError> {
        let generation = self.closed_gen.load(Ordering::Acquire);
        if generation != NOT_CLOSED {
            return Ok((self.permit(generation, false), None));
        }
        let mut s = self.lock();
        if let Phase::Closed { .. } = s.phase {
            return Ok((self.permit(s.generation, false), None));
        }
        let now = Instant::now();
        let probe_round_over = |since: Instant| now >= since + probe_round(o);
        match s.phase {
            Phase::Closed { .. } => Ok((self.permit(s.generation, false), None)),
            Phase::Isolated => Err(isolated_error(entry)),
            Phase::Open { since, .. } if now < since + break_duration(o) => {
                let until = since + break_duration(o);
                s.phase = Phase::Open { since, until };
                Err(open_error(entry, until - now, s.last_cause.as_deref()))
            }
            Phase::Open { .. } => {
                s.enter(Phase::HalfOpen {
                    probes: 1,
                    since: now,
                });
                s.round += 1;
                Ok((self.probe(&s), Some(Transition::HalfOpen)))
            }
            // An expired round first, whatever its count: admitting into it would add probes
            // to those still out, and the next round would then admit its own on top.
            Phase::HalfOpen { since, .. } if probe_round_over(since) => {
                // The probes never reported back: their slots are freed, a new round starts.
                // Same generation: should they end after all, their verdicts still count.
                s.phase = Phase::HalfOpen {
                    probes: 1,
                    since: now,
                };
                s.round += 1;
                Ok((self.probe(&s), None))
            }
            Phase::HalfOpen { probes, since } if probes < o.half_open_probes.max(1) => {
                s.phase = Phase::HalfOpen {
                    probes: probes + 1,
                    since,
                };
                Ok((self.probe(&s), None))
            }
            Phase::HalfOpen { since, .. } => Err(open_error(
                entry,
                since + probe_round(o) - now,
                s.last_cause.as_deref(),
            )),
        }
    }

    /// Whether an operator isolated the entry ([`isolate`](Self::isolate)): the one refusal
    /// observe mode does not lift.
    pub fn is_isolated(&self) -> bool {
        self.isolated.load(Ordering::Acquire)
    }

    /// For an entry whose breaker is turned off (`enable_circuit_breaker = false`): fails with
    /// [`StatusCode::CircuitOpen`] while an operator holds it isolated, which turning the
    /// breaker off does not lift; otherwise admits the call, uncounted.
    pub fn check_isolation(&self, entry: &str) -> Result<(), RpcError> {
        if self.is_isolated() {
            return Err(isolated_error(entry));
        }
        Ok(())
    }

    fn permit(&self, generation: u64, probe: bool) -> Permit<'_> {
        Permit {
            breaker: self,
            generation,
            probe,
            round: 0,
        }
    }

    /// A probe's permit, in the current round of `s`.
    fn probe(&self, s: &State) -> Permit<'_> {
        Permit {
            breaker: self,
            generation: s.generation,
            probe: true,
            round: s.round,
        }
    }

    /// Frees the slot of a probe admitted under `generation` in `round` that ended without a
    /// verdict (a probe of an earlier round had its slot freed when the round expired).
    fn release(&self, generation: u64, round: u64) {
        let mut s = self.lock();
        if s.generation != generation || s.round != round {
            return;
        }
        if let Phase::HalfOpen { probes, since } = s.phase {
            s.phase = Phase::HalfOpen {
                probes: probes.saturating_sub(1),
                since,
            };
        }
    }

    /// Records the result of an admitted call; returns the transition it caused, if any.
    pub fn record<T>(
        &self,
        permit: Permit<'_>,
        result: &Result<T, RpcError>,
        o: &GovernanceOptions,
    ) -> Option<Transition> {
        self.record_outcome(permit, Outcome::of(result), o, result.as_ref().err())
    }

    /// Records an outcome already classified; `cause` is quoted while the breaker is open.
    pub fn record_outcome(
        &self,
        mut permit: Permit<'_>,
        outcome: Outcome,
        o: &GovernanceOptions,
        cause: Option<&RpcError>,
    ) -> Option<Transition> {
        // Settled here, whatever the outcome: the permit's drop has nothing left to free.
        let probe = std::mem::replace(&mut permit.probe, false);
        // The callee's answers are calls the remote side served: counted as such in
        // failure-ratio mode, never counted in consecutive mode.
        if (!probe
            && (outcome == Outcome::Ignored
                || (outcome == Outcome::Answered && o.failure_ratio_percent == 0)))
            || (outcome == Outcome::Success
                && o.failure_ratio_percent == 0
                && self.clean.load(Ordering::Acquire)
                && self.closed_gen.load(Ordering::Acquire) == permit.generation)
        {
            // Nothing to change: closed with no failure counted, and a success keeps it so.
            return None;
        }
        let mut s = self.lock();
        if permit.generation != s.generation {
            return None;
        }
        if outcome == Outcome::Failure {
            if let Some(c) = cause {
                s.last_cause = Some(c.to_string());
            }
        }
        if let (Phase::Closed { .. }, Outcome::Success, 0) =
            (s.phase, outcome, o.failure_ratio_percent)
        {
            // The common case, without reading the clock.
            s.phase = Phase::Closed { failures: 0 };
            return None;
        }
        let now = Instant::now();
        if let Phase::Closed { .. } = s.phase {
            if o.failure_ratio_percent > 0 {
                // The ratio alone decides here: a count of failures in a row from before the
                // entry switched to ratio mode must not be found again when it switches back.
                s.phase = Phase::Closed { failures: 0 };
                let (calls, failures) =
                    s.sample(outcome == Outcome::Failure, now, o.sampling_window_seconds);
                let over = u128::from(failures) * 100
                    >= u128::from(o.failure_ratio_percent) * u128::from(calls);
                if calls >= u64::from(o.minimum_throughput.max(1)) && over {
                    s.enter(Phase::Open {
                        since: now,
                        until: now + break_duration(o),
                    });
                    return Some(Transition::Break);
                }
                return None;
            }
        }
        match (s.phase, outcome) {
            (Phase::Closed { .. }, Outcome::Success) => {
                s.phase = Phase::Closed { failures: 0 };
                None
            }
            (Phase::Closed { failures }, Outcome::Failure) => {
                let failures = failures + 1;
                if failures >= o.exceptions_allowed_before_breaking.max(1) {
                    s.enter(Phase::Open {
                        since: now,
                        until: now + break_duration(o),
                    });
                    Some(Transition::Break)
                } else {
                    s.phase = Phase::Closed { failures };
                    None
                }
            }
            (Phase::HalfOpen { .. }, Outcome::Success | Outcome::Answered) => {
                s.enter(Phase::Closed { failures: 0 });
                Some(Transition::Reset)
            }
            (Phase::HalfOpen { probes, since }, Outcome::Ignored) => {
                if permit.round == s.round {
                    s.phase = Phase::HalfOpen {
                        probes: probes.saturating_sub(1),
                        since,
                    };
                }
                None
            }
            (Phase::HalfOpen { .. }, Outcome::Failure) => {
                s.enter(Phase::Open {
                    since: now,
                    until: now + break_duration(o),
                });
                Some(Transition::Break)
            }
            _ => None,
        }
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        let s = self.lock();
        match s.phase {
            Phase::Closed { failures } => BreakerState::Closed { failures },
            Phase::Open { until, .. } => BreakerState::Open {
                retry_after: until.saturating_duration_since(Instant::now()),
            },
            Phase::HalfOpen { probes, .. } => BreakerState::HalfOpen { probes },
            Phase::Isolated => BreakerState::Open {
                retry_after: Duration::MAX,
            },
        }
    }

    /// Opens the breaker until [`reset`](Self::reset) is called.
    pub fn isolate(&self) {
        self.lock().enter(Phase::Isolated);
    }

    /// Closes the breaker and forgets past failures.
    pub fn reset(&self) {
        self.lock().enter(Phase::Closed { failures: 0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> GovernanceOptions {
        GovernanceOptions {
            exceptions_allowed_before_breaking: 3,
            breaker_seconds: 10,
            half_open_probes: 1,
            ..Default::default()
        }
    }

    fn fail(b: &CircuitBreaker, o: &GovernanceOptions) -> Option<Transition> {
        let (p, _) = b.try_acquire("e", o).unwrap();
        b.record_outcome(p, Outcome::Failure, o, None)
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_n_consecutive_failures_not_n_minus_1() {
        let (b, o) = (CircuitBreaker::new(), opts());
        assert_eq!(fail(&b, &o), None);
        assert_eq!(fail(&b, &o), None);
        assert_eq!(b.state(), BreakerState::Closed { failures: 2 });
        let (p, _) = b.try_acquire("e", &o).unwrap();
        b.record_outcome(p, Outcome::Success, &o, None);
        assert_eq!(
            b.state(),
            BreakerState::Closed { failures: 0 },
            "a success resets the count"
        );
        fail(&b, &o);
        fail(&b, &o);
        assert_eq!(fail(&b, &o), Some(Transition::Break));
        let err = b.try_acquire("e", &o).unwrap_err();
        assert_eq!(err.code(), StatusCode::CircuitOpen);
    }

    #[tokio::test(start_paused = true)]
    async fn a_break_of_u64_max_seconds_opens_without_overflowing_the_clock() {
        let (b, mut o) = (CircuitBreaker::new(), opts());
        o.breaker_seconds = u64::MAX;
        for _ in 0..3 {
            fail(&b, &o);
        }
        let e = b.try_acquire("e", &o).unwrap_err();
        assert_eq!(e.code(), StatusCode::CircuitOpen);
        tokio::time::advance(Duration::from_secs(365 * 24 * 3600)).await;
        assert!(b.try_acquire("e", &o).is_err(), "still open a year later");
    }

    /// Once a round of probes has expired with a probe still out, the next calls start a new
    /// round and no more than `half_open_probes` of them are admitted at once. Before, the
    /// first was admitted into the expired round (its count below the limit), then a new
    /// round admitted the limit again: three probes at once for a limit of two.
    #[tokio::test(start_paused = true)]
    async fn an_expired_round_admits_no_more_than_the_probes_of_one_round() {
        let (b, mut o) = (CircuitBreaker::new(), opts());
        o.half_open_probes = 2;
        for _ in 0..3 {
            fail(&b, &o);
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        // One probe goes out and never reports back.
        let (hanging, t) = b.try_acquire("e", &o).expect("the first probe");
        assert_eq!(t, Some(Transition::HalfOpen));
        tokio::time::advance(probe_round(&o)).await;
        let admitted: Vec<_> = (0..5).filter_map(|_| b.try_acquire("e", &o).ok()).collect();
        assert_eq!(admitted.len(), 2, "one round's probes");
        drop(hanging);
    }

    /// Failures in a row counted before the entry switched to failure-ratio mode are not
    /// found again when it switches back: ratio mode keeps no such count. Before, two failures
    /// from before a thousand ratio-mode successes made the next failure the third in a row.
    #[tokio::test(start_paused = true)]
    async fn a_count_in_a_row_does_not_outlive_a_spell_in_ratio_mode() {
        let (b, consecutive) = (CircuitBreaker::new(), opts());
        fail(&b, &consecutive);
        fail(&b, &consecutive);
        let ratio = GovernanceOptions {
            failure_ratio_percent: 50,
            ..consecutive.clone()
        };
        for _ in 0..1000 {
            let (p, _) = b.try_acquire("e", &ratio).unwrap();
            b.record_outcome(p, Outcome::Success, &ratio, None);
        }
        assert_eq!(fail(&b, &consecutive), None, "one failure in a row, of 3");
        assert_eq!(b.state(), BreakerState::Closed { failures: 1 });
    }

    /// With `breaker_seconds = 0` the breaker probes as soon as it opens, and still lets no
    /// more than `half_open_probes` calls through at once until a round (a second at least)
    /// has passed.
    #[tokio::test(start_paused = true)]
    async fn a_zero_break_still_bounds_the_probes_of_a_round() {
        let (b, mut o) = (CircuitBreaker::new(), opts());
        o.breaker_seconds = 0;
        o.half_open_probes = 2;
        for _ in 0..3 {
            fail(&b, &o);
        }
        let probes = [b.try_acquire("e", &o), b.try_acquire("e", &o)];
        assert!(probes.iter().all(Result::is_ok), "two probes at once");
        let Err(third) = b.try_acquire("e", &o) else {
            panic!("a third call in the round was let through");
        };
        assert_eq!(third.code(), StatusCode::CircuitOpen);
        assert_eq!(third.retry_after(), Some(Duration::from_secs(1)));
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(b.try_acquire("e", &o).is_err(), "the round is not over");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(b.try_acquire("e", &o).is_ok(), "a new round after a second");
    }

    #[tokio::test(start_paused = true)]
    async fn in_ratio_mode_the_callees_answers_are_calls_of_the_window() {
        let (b, o) = (
            CircuitBreaker::new(),
            GovernanceOptions {
                failure_ratio_percent: 50,
                minimum_throughput: 2,
                sampling_window_seconds: 10,
                ..opts()
            },
        );
        // 8 not-found answers, 1 success, 1 failure: 10 % of the window's calls failed.
        for _ in 0..8 {
            let (p, _) = b.try_acquire("e", &o).unwrap();
            assert_eq!(b.record_outcome(p, Outcome::Answered, &o, None), None);
        }
        let (p, _) = b.try_acquire("e", &o).unwrap();
        assert_eq!(b.record_outcome(p, Outcome::Success, &o, None), None);
        assert_eq!(fail(&b, &o), None, "1 failure in 10 calls is under 50 %");
        assert!(matches!(b.state(), BreakerState::Closed { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn exempt_errors_never_count() {
        let (b, o) = (CircuitBreaker::new(), opts());
        for code in [
            StatusCode::BusinessError,
            StatusCode::ValidateError,
            StatusCode::UnAuthentication,
            StatusCode::RpcUnAuthentication,
            StatusCode::NotFindLocalServiceEntry,
            StatusCode::NotImplemented,
        ] {
            for _ in 0..5 {
                let (p, _) = b.try_acquire("e", &o).unwrap();
                let r: Result<(), _> = Err(RpcError::new(code, "x"));
                b.record_outcome(p, Outcome::of(&r), &o, None);
            }
        }
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_shrinks_then_half_open_admits_one_probe() {
        let (b, o) = (CircuitBreaker::new(), opts());
        for _ in 0..3 {
            fail(&b, &o);
        }
        let first = b.try_acquire("e", &o).unwrap_err().retry_after().unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        let later = b.try_acquire("e", &o).unwrap_err().retry_after().unwrap();
        assert_eq!(first - later, Duration::from_secs(4));
        tokio::time::advance(Duration::from_secs(6)).await;
        let (probe, t) = b.try_acquire("e", &o).unwrap();
        assert_eq!(t, Some(Transition::HalfOpen));
        assert!(b.try_acquire("e", &o).is_err(), "only one probe");
        assert_eq!(
            b.record_outcome(probe, Outcome::Success, &o, None),
            Some(Transition::Reset)
        );
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
    }

    /// A probe refused by the server's rate limiter ran no handler: the breaker stays
    /// half-open (no reset) and the probe's slot goes to the next call. A callee's own answer
    /// (a business error) does close it.
    #[tokio::test(start_paused = true)]
    async fn a_rate_limited_probe_neither_closes_the_breaker_nor_keeps_its_slot() {
        let (b, o) = (CircuitBreaker::new(), opts());
        for _ in 0..3 {
            fail(&b, &o);
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        let (probe, _) = b.try_acquire("e", &o).unwrap();
        let limited: Result<(), RpcError> =
            Err(RpcError::new(StatusCode::RateLimited, "slow down"));
        assert_eq!(Outcome::of(&limited), Outcome::Ignored);
        assert_eq!(
            b.record_outcome(probe, Outcome::of(&limited), &o, None),
            None
        );
        assert!(
            matches!(b.state(), BreakerState::HalfOpen { .. }),
            "{:?}",
            b.state()
        );
        let (next, _) = b.try_acquire("e", &o).expect("the slot is free again");
        let refused: Result<(), RpcError> = Err(RpcError::new(StatusCode::BusinessError, "no"));
        assert_eq!(
            b.record_outcome(next, Outcome::of(&refused), &o, None),
            Some(Transition::Reset)
        );
    }

    /// A rule shortening `breaker_seconds` holds for a breaker already open (from the next
    /// call, as any option change): it probes once open that long, not for as long as the
    /// options it opened under said. One lengthening it keeps it open longer.
    #[tokio::test(start_paused = true)]
    async fn a_changed_breaker_seconds_holds_for_a_breaker_already_open() {
        let b = CircuitBreaker::new();
        let hour = GovernanceOptions {
            breaker_seconds: 3600,
            ..opts()
        };
        for _ in 0..3 {
            fail(&b, &hour);
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        let Err(e) = b.try_acquire("e", &hour) else {
            panic!("open for the hour")
        };
        assert_eq!(e.retry_after(), Some(Duration::from_secs(3598)), "{e}");
        let seconds = |s| GovernanceOptions {
            breaker_seconds: s,
            ..opts()
        };
        let Err(e) = b.try_acquire("e", &seconds(5)) else {
            panic!("open 5 s")
        };
        assert_eq!(e.retry_after(), Some(Duration::from_secs(3)), "{e}");
        assert_eq!(
            b.state(),
            BreakerState::Open {
                retry_after: Duration::from_secs(3)
            }
        );
        let Err(e) = b.try_acquire("e", &hour) else {
            panic!("open for the hour again")
        };
        assert_eq!(e.retry_after(), Some(Duration::from_secs(3598)), "{e}");
        let (_probe, t) = b.try_acquire("e", &seconds(1)).expect("a probe after 1 s");
        assert_eq!(t, Some(Transition::HalfOpen));
    }

    #[tokio::test(start_paused = true)]
    async fn failed_probe_reopens_and_hung_probe_frees_its_slot() {
        let (b, o) = (CircuitBreaker::new(), opts());
        for _ in 0..3 {
            fail(&b, &o);
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        let (probe, _) = b.try_acquire("e", &o).unwrap();
        assert_eq!(
            b.record_outcome(probe, Outcome::Failure, &o, None),
            Some(Transition::Break)
        );
        assert!(matches!(b.state(), BreakerState::Open { .. }));
        tokio::time::advance(Duration::from_secs(10)).await;
        let (hung, _) = b.try_acquire("e", &o).unwrap();
        assert!(b.try_acquire("e", &o).is_err());
        tokio::time::advance(Duration::from_secs(10)).await;
        let (fresh, _) = b.try_acquire("e", &o).unwrap();
        assert_eq!(
            b.record_outcome(fresh, Outcome::Success, &o, None),
            Some(Transition::Reset)
        );
        // The hung probe's late result comes after the breaker closed: it is ignored.
        assert_eq!(b.record_outcome(hung, Outcome::Failure, &o, None), None);
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
    }

    /// A probe slower than `breaker_seconds` still settles the breaker: its round expired and
    /// another probe went out, yet its answer closes the breaker (or its failure opens it),
    /// and being dropped or ignored it does not free the new round's slot.
    #[tokio::test(start_paused = true)]
    async fn a_probe_slower_than_the_round_still_settles_the_breaker() {
        let (b, o) = (CircuitBreaker::new(), opts());
        for (late, settles) in [
            (Outcome::Success, Transition::Reset),
            (Outcome::Answered, Transition::Reset),
            (Outcome::Failure, Transition::Break),
        ] {
            while !matches!(b.state(), BreakerState::Open { .. }) {
                fail(&b, &o);
            }
            tokio::time::advance(Duration::from_secs(10)).await;
            let (slow, _) = b.try_acquire("e", &o).unwrap();
            tokio::time::advance(Duration::from_secs(10)).await;
            let (next, _) = b.try_acquire("e", &o).unwrap();
            assert!(b.try_acquire("e", &o).is_err(), "one probe per round");
            tokio::time::advance(Duration::from_secs(10)).await;
            let (third, _) = b.try_acquire("e", &o).unwrap();
            // A probe of an earlier round, ignored or dropped, frees no slot of this round.
            assert_eq!(b.record_outcome(next, Outcome::Ignored, &o, None), None);
            assert!(
                b.try_acquire("e", &o).is_err(),
                "this round's slot is taken"
            );
            drop(third);
            let (fourth, _) = b.try_acquire("e", &o).expect("this round's slot, freed");
            drop(fourth);
            // The first round's probe answers at last: its verdict settles the breaker.
            assert_eq!(
                b.record_outcome(slow, late, &o, None),
                Some(settles),
                "{late:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn results_of_calls_started_before_opening_are_ignored() {
        let (b, o) = (CircuitBreaker::new(), opts());
        let (early, _) = b.try_acquire("e", &o).unwrap();
        for _ in 0..3 {
            fail(&b, &o);
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        let (probe, _) = b.try_acquire("e", &o).unwrap();
        assert_eq!(
            b.record_outcome(early, Outcome::Success, &o, None),
            None,
            "stale success ignored"
        );
        assert!(matches!(b.state(), BreakerState::HalfOpen { probes: 1 }));
        assert_eq!(
            b.record_outcome(probe, Outcome::Success, &o, None),
            Some(Transition::Reset)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ratio_mode_waits_for_throughput_then_opens_at_the_ratio() {
        let o = GovernanceOptions {
            failure_ratio_percent: 50,
            sampling_window_seconds: 10,
            minimum_throughput: 10,
            ..opts()
        };
        let b = CircuitBreaker::new();
        let record = |outcome| {
            let (p, _) = b.try_acquire("e", &o).unwrap();
            b.record_outcome(p, outcome, &o, None)
        };
        // 9 failures: 100 % but below the minimum throughput.
        for _ in 0..9 {
            assert_eq!(record(Outcome::Failure), None);
        }
        // Old samples leave the window.
        tokio::time::advance(Duration::from_secs(10)).await;
        for _ in 0..6 {
            assert_eq!(record(Outcome::Success), None);
        }
        for _ in 0..3 {
            assert_eq!(record(Outcome::Failure), None);
        }
        // 10 calls, 4 failed: 40 % < 50 %.
        assert_eq!(record(Outcome::Failure), None);
        // 11 calls, 5 failed: 45 %.
        assert_eq!(record(Outcome::Failure), None);
        // 12 calls, 6 failed: 50 % → open.
        assert_eq!(record(Outcome::Failure), Some(Transition::Break));
        assert!(matches!(b.state(), BreakerState::Open { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn isolate_and_reset() {
        let (b, o) = (CircuitBreaker::new(), opts());
        b.isolate();
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(b.try_acquire("e", &o).is_err());
        b.reset();
        assert!(b.try_acquire("e", &o).is_ok());
    }

    /// Windows of a day, of an hour and a second, and of a minute and a second, sampled every
    /// second for one and a half of their length, keep 60 buckets at most, and count the
    /// outcomes of their own length: never one older, never two buckets' worth less.
    #[test]
    fn a_long_window_keeps_sixty_buckets_and_counts_its_own_length() {
        for window in [86_400u64, 3_601, 61] {
            let width = window.div_ceil(60);
            let mut w = Window::default();
            let mut failed_at = std::collections::VecDeque::new();
            for secs in 0..(window + window / 2) {
                let failed = secs % 7 == 0;
                if failed {
                    failed_at.push_back(secs);
                }
                while failed_at.front().is_some_and(|&f| f + window <= secs) {
                    failed_at.pop_front();
                }
                let (calls, failures) = w.sample(failed, secs, window);
                assert!(
                    w.buckets.len() <= 60,
                    "{window}: {} buckets",
                    w.buckets.len()
                );
                // One call a second: the window holds min(secs + 1, window) calls.
                let exact = (secs + 1).min(window);
                assert!(
                    calls <= exact,
                    "{window}: {calls} calls at {secs} s, {exact} held"
                );
                assert!(
                    calls + 2 * width >= exact,
                    "{window}: {calls} calls at {secs} s"
                );
                let exact_failures = failed_at.len() as u64;
                assert!(
                    failures <= exact_failures,
                    "{window}: {failures} failures at {secs} s"
                );
                assert!(failures + 2 * width / 7 + 2 >= exact_failures);
            }
        }
    }

    /// The sums are wide enough for any number of calls (no wrap past 2^32).
    #[test]
    fn the_window_sums_go_past_u32() {
        let mut w = Window::default();
        w.sample(true, 0, 10);
        let b = w.buckets.back_mut().expect("a bucket");
        b.calls = u64::from(u32::MAX);
        b.failures = u64::from(u32::MAX);
        w.calls = u64::from(u32::MAX);
        w.failures = u64::from(u32::MAX);
        assert_eq!(w.sample(true, 1, 10), (1 << 32, 1 << 32));
    }

    /// A rule that changes the window's length starts it over (its buckets' widths differ).
    #[test]
    fn a_new_window_length_starts_the_window_over() {
        let mut w = Window::default();
        for secs in 0..30 {
            w.sample(true, secs, 10);
        }
        assert_eq!(
            w.sample(false, 30, 10).0,
            10,
            "ten seconds of one call each"
        );
        assert_eq!(
            w.sample(false, 31, 3_600),
            (1, 0),
            "a window of an hour starts empty"
        );
    }
}
