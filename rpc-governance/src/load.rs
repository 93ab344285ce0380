//! Load-aware endpoint choice: peak-EWMA latency × √(outstanding calls per unit of weight),
//! power of two choices.
//!
//! Round robin sends a slow server as many calls as a fast one; they queue there, and the
//! cluster's p99 becomes the slow server's. Asking every server for its load before each call
//! costs a round trip. The answer Finagle and Linkerd use costs nothing extra: each client keeps,
//! per endpoint, a latency estimate that jumps up at once when a call is slow and decays slowly
//! when calls are fast again (peak EWMA), multiplied by the calls it has outstanding there; for
//! each call it draws two endpoints at random and takes the one with the lower score ("power of
//! two choices": nearly as good as asking everyone, and without the herd that always picking the
//! single best would cause).
//!
//! Three inputs refine the score:
//! - what the server reports on each answer ([`ServerLoad`]: its calls in flight against its
//!   cap), so a server busy with other clients' calls looks busy to this one too;
//! - the instance's `weight` from its registry metadata (a weight-2 instance gets about twice
//!   the calls of a weight-1 one);
//! - slow start: an instance that just appeared has its weight ramped up from a tenth over
//!   `slow_start`, so a cold cache or JIT is not flooded on its first second.
//!
//! Two refinements over the textbook rule, both found measuring a cluster with one server ten
//! times slower (`scenarios`, case a), where the slow server kept 3.5–6 % of the calls and set
//! the p99:
//! - A peak decays with time ([`DECAY`]) *or* over [`PEAK_ANSWERS`] faster answers, whichever
//!   is sooner. With time alone, a pause every endpoint saw at once (the client's process not
//!   scheduled for 20 ms) raised every cost to the same peak and kept them level for seconds,
//!   hiding which endpoint is slow; an endpoint answering thousands of calls a second now
//!   forgets such a peak within milliseconds, while a rarely called one still keeps it.
//! - The load term is `√((outstanding + 1) / weight)`, not its first power: the latency weighs
//!   more. Under two choices a server's share settles where scores are equal; with the first
//!   power a server k times slower keeps about 1/k² of a fast one's calls, with the square root
//!   about 1/k³. The square root keeps the order of endpoints of equal latency (fewer calls
//!   outstanding per unit of weight still wins, so weights share calls out as before) and the
//!   guard against herding (every call sent raises the score at once).
//!
//! An endpoint nothing is known about yet scores as if its calls took [`DEFAULT_RTT`], so new
//! endpoints are tried but not preferred blindly. Time is tokio's clock, so the paused clock
//! drives the decay in tests.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// The latency assumed for an endpoint before its first answer.
pub const DEFAULT_RTT: Duration = Duration::from_millis(30);

/// How long a peak takes to decay to about a third (1/e) once calls are fast again.
pub const DECAY: Duration = Duration::from_secs(10);

/// The latency an endpoint is scored with when it refuses a call or fails it without running
/// it through (overloaded, rate-limited, a handler failure): such answers come back fast, and
/// scored by their speed they would make the failing endpoint the preferred one. Taken as a
/// peak, it fades like any other ([`DECAY`]), so the endpoint is tried again later.
pub const FAILURE_PENALTY: Duration = Duration::from_millis(250);

/// Faster answers over which a peak decays to about a third (1/e) at the latest: each moves
/// the cost at least 1/`PEAK_ANSWERS` of the way to its latency.
pub const PEAK_ANSWERS: u32 = 20;

/// What a server says of its load on an answer: calls it is handling and its cap (0: no cap
/// known).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerLoad {
    /// Calls being handled by the server (all clients), the answered one included.
    pub in_flight: u32,
    /// The server's concurrency cap or current adaptive limit for the entry (0: unknown).
    pub limit: u32,
}

impl ServerLoad {
    /// Packs into one word, for a lock-free cell.
    fn pack(self) -> u64 {
        (u64::from(self.in_flight) << 32) | u64::from(self.limit)
    }

    fn unpack(word: u64) -> Self {
        ServerLoad {
            in_flight: (word >> 32) as u32,
            limit: word as u32,
        }
    }

    /// How full the server says it is, 0 (idle or unknown) to 1 (at its limit) and beyond.
    pub fn utilization(self) -> f64 {
        if self.limit == 0 {
            0.0
        } else {
            f64::from(self.in_flight) / f64::from(self.limit)
        }
    }
}

/// One endpoint's load as this client sees it.
#[derive(Debug)]
pub struct EndpointLoad {
    /// (cost in seconds, when last updated), None before the first answer.
    ewma: Mutex<Option<(f64, Instant)>>,
    outstanding: AtomicUsize,
    reported: AtomicU64,
    /// The registry's weight, as `f64` bits: it may change while calls are outstanding.
    weight: AtomicU64,
    since: Instant,
    slow_start: Duration,
}

/// An outstanding call on an endpoint; [`finish`](Self::finish) records its latency. Dropped
/// unfinished (cancelled, or the loser of a hedge), it stops counting as outstanding, and the
/// time it had taken counts as a lower bound of its latency: it raises the score when above
/// it (an endpoint whose every call is hedged away would otherwise keep its old, fast score),
/// and never lowers it.
#[derive(Debug)]
#[must_use = "the call counts as outstanding until this is finished or dropped"]
pub struct Outstanding<'a> {
    load: &'a EndpointLoad,
    started: Instant,
    /// Whether [`finish`](Self::finish) or [`refused`](Self::refused) recorded the call.
    settled: bool,
}

impl Outstanding<'_> {
    /// The call was answered: its latency (and the server's report, if any) update the score.
    pub fn finish(mut self, reported: Option<ServerLoad>) {
        self.settled = true;
        let now = Instant::now();
        self.load.observe(now - self.started, now);
        if let Some(r) = reported {
            self.load.report(r);
        }
    }
}

impl Outstanding<'_> {
    /// The endpoint refused the call or failed it fast: scored as a latency of at least
    /// [`FAILURE_PENALTY`] (with the server's report, if any).
    pub fn refused(mut self, reported: Option<ServerLoad>) {
        self.settled = true;
        let now = Instant::now();
        self.load
            .observe((now - self.started).max(FAILURE_PENALTY), now);
        if let Some(r) = reported {
            self.load.report(r);
        }
    }
}

impl Outstanding<'_> {
    /// The call never reached the endpoint (it could not connect, or cannot serve the call):
    /// it stops counting, and says nothing of the endpoint's latency.
    pub fn forget(mut self) {
        self.settled = true;
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.load.outstanding.fetch_sub(1, Ordering::AcqRel);
        if !self.settled {
            let now = Instant::now();
            let taken = now - self.started;
            if taken.as_secs_f64() > self.load.cost_at(now) {
                self.load.observe(taken, now);
            }
        }
    }
}

impl EndpointLoad {
    /// An endpoint of `weight` (1.0 when the registry says nothing; at least 0.01), first seen
    /// now, whose weight ramps up over `slow_start` (zero: at once).
    pub fn new(weight: f64, slow_start: Duration) -> Self {
        Self::ramping_since(weight, slow_start, Instant::now())
    }

    /// [`new`](Self::new), for an endpoint announced at `since` (its slow start runs from
    /// then, not from now).
    pub fn ramping_since(weight: f64, slow_start: Duration, since: Instant) -> Self {
        EndpointLoad {
            ewma: Mutex::new(None),
            outstanding: AtomicUsize::new(0),
            reported: AtomicU64::new(0),
            weight: AtomicU64::new(weight.max(0.01).to_bits()),
            since,
            slow_start,
        }
    }

    /// The registry's weight, now `weight` (at least 0.01), for the next choices; the calls
    /// outstanding, the latency and the slow start carry on.
    pub fn set_weight(&self, weight: f64) {
        self.weight
            .store(weight.max(0.01).to_bits(), Ordering::Relaxed);
    }

    /// The registry's weight (without the slow start's ramp).
    pub fn weight(&self) -> f64 {
        f64::from_bits(self.weight.load(Ordering::Relaxed))
    }

    /// Counts a call as outstanding until the returned guard is finished or dropped.
    pub fn start(&self) -> Outstanding<'_> {
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        Outstanding {
            load: self,
            started: Instant::now(),
            settled: false,
        }
    }

    /// Calls outstanding now.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Acquire)
    }

    /// Folds a call's latency observed at `now` into the peak EWMA: a slower call raises the
    /// cost at once, a faster one lowers it with the weight of the time since the last update,
    /// and at least by 1/[`PEAK_ANSWERS`] of the difference.
    pub fn observe(&self, rtt: Duration, now: Instant) {
        let rtt = rtt.as_secs_f64();
        let mut ewma = self.ewma.lock().unwrap_or_else(PoisonError::into_inner);
        let cost = match *ewma {
            Some((cost, at)) if rtt < cost => {
                let elapsed = now.saturating_duration_since(at).as_secs_f64();
                let w = (-elapsed / DECAY.as_secs_f64())
                    .exp()
                    .min(1.0 - 1.0 / f64::from(PEAK_ANSWERS));
                cost * w + rtt * (1.0 - w)
            }
            _ => rtt,
        };
        *ewma = Some((cost, now));
    }

    /// Records what the server said of its load.
    pub fn report(&self, load: ServerLoad) {
        self.reported.store(load.pack(), Ordering::Relaxed);
    }

    /// What the server last said of its load.
    pub fn reported(&self) -> ServerLoad {
        ServerLoad::unpack(self.reported.load(Ordering::Relaxed))
    }

    /// The weight in force at `now`: the registry's, ramped from a tenth during slow start.
    pub fn weight_at(&self, now: Instant) -> f64 {
        let weight = self.weight();
        let age = now.saturating_duration_since(self.since);
        if self.slow_start.is_zero() || age >= self.slow_start {
            return weight;
        }
        let ramp = age.as_secs_f64() / self.slow_start.as_secs_f64();
        weight * (0.1 + 0.9 * ramp)
    }

    /// The peak-EWMA latency in seconds now; see [`cost_at`](Self::cost_at).
    pub fn cost(&self) -> f64 {
        self.cost_at(Instant::now())
    }

    /// The peak-EWMA latency in seconds at `now` ([`DEFAULT_RTT`] before the first answer). A
    /// peak above [`DEFAULT_RTT`] fades towards it with time even while no answer comes (by
    /// [`DECAY`]): an endpoint that lost every choice after one slow answer gets no answers to
    /// lower it with, and would otherwise be shunned for good.
    pub fn cost_at(&self, now: Instant) -> f64 {
        let default = DEFAULT_RTT.as_secs_f64();
        match *self.ewma.lock().unwrap_or_else(PoisonError::into_inner) {
            None => default,
            Some((cost, at)) if cost > default => {
                let elapsed = now.saturating_duration_since(at).as_secs_f64();
                default + (cost - default) * (-elapsed / DECAY.as_secs_f64()).exp()
            }
            Some((cost, _)) => cost,
        }
    }

    /// The score at `now`, lower is better: cost × √((outstanding + 1) / weight in force),
    /// raised by the server's reported utilization.
    pub fn score_at(&self, now: Instant) -> f64 {
        let busy = 1.0 + self.reported().utilization();
        let load = (self.outstanding() as f64 + 1.0) / self.weight_at(now);
        self.cost_at(now) * load.sqrt() * busy
    }
}

/// Power of two choices among `n` candidates: `draw(k)` returns a uniform index below `k`;
/// `score(i)` the score of candidate `i`. Returns the lower-scored of two distinct random
/// candidates (the first on a tie), or the only one.
pub fn two_choices(
    n: usize,
    mut draw: impl FnMut(usize) -> usize,
    score: impl Fn(usize) -> f64,
) -> Option<usize> {
    match n {
        0 => None,
        1 => Some(0),
        _ => {
            let a = draw(n);
            // A second, distinct index: draw among the n - 1 others.
            let b = (a + 1 + draw(n - 1)) % n;
            Some(if score(b) < score(a) { b } else { a })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_answer_raises_the_cost_at_once_and_it_decays_slowly() {
        let e = EndpointLoad::new(1.0, Duration::ZERO);
        let t0 = Instant::now();
        e.observe(ms(10), t0);
        assert!((e.score_at(t0) - 0.010).abs() < 1e-12);
        e.observe(ms(500), t0);
        assert!(
            (e.score_at(t0) - 0.5).abs() < 1e-12,
            "peaks are taken whole"
        );
        // One decay period later a 10 ms answer brings the cost to 500·e⁻¹ + 10·(1 − e⁻¹).
        let t1 = t0 + DECAY;
        e.observe(ms(10), t1);
        let w = (-1.0f64).exp();
        let expected = 0.5 * w + 0.010 * (1.0 - w);
        assert!((e.score_at(t1) - expected).abs() < 1e-12);
    }

    /// An endpoint that lost every choice after one slow answer gets no answers: its peak
    /// fades with time alone towards the default latency (after six decay periods less than
    /// 1 % of the excess is left: e⁻⁶ ≈ 0.25 %), and it is chosen again. A cost below the
    /// default does not rise to it.
    #[tokio::test(start_paused = true)]
    async fn a_peak_fades_with_time_while_no_answer_comes() {
        let (slow, fast) = (
            EndpointLoad::new(1.0, Duration::ZERO),
            EndpointLoad::new(1.0, Duration::ZERO),
        );
        let t0 = Instant::now();
        slow.observe(Duration::from_secs(5), t0);
        fast.observe(ms(5), t0);
        assert_eq!(slow.cost_at(t0), 5.0);
        let default = DEFAULT_RTT.as_secs_f64();
        let later = slow.cost_at(t0 + DECAY * 6);
        assert!(
            later > default && later - default < 0.01 * (5.0 - default),
            "{later}"
        );
        assert_eq!(fast.cost_at(t0 + DECAY * 6), 0.005);
        // 99 calls outstanding on the fast endpoint score it 5 ms × √100 = 50 ms, the faded
        // one 30 ms + 4970 ms · e⁻⁶ ≈ 42 ms: the faded one wins the choice.
        let busy: Vec<_> = (0..99).map(|_| fast.start()).collect();
        let scores = [slow.score_at(t0 + DECAY * 6), fast.score_at(t0 + DECAY * 6)];
        assert_eq!(two_choices(2, |_| 0, |i| scores[i]), Some(0), "{scores:?}");
        drop(busy);
    }

    /// An endpoint that refuses every call in 0.2 ms must not look faster than one answering
    /// in 10 ms: a refusal scores as at least the failure penalty, and that peak fades like
    /// any other.
    #[tokio::test(start_paused = true)]
    async fn a_fast_refusal_scores_as_the_failure_penalty_not_its_speed() {
        let (refusing, answering) = (
            EndpointLoad::new(1.0, Duration::ZERO),
            EndpointLoad::new(1.0, Duration::ZERO),
        );
        let call = answering.start();
        tokio::time::advance(ms(10)).await;
        call.finish(None);
        let call = refusing.start();
        tokio::time::advance(Duration::from_micros(200)).await;
        call.refused(None);
        let now = Instant::now();
        assert_eq!(refusing.cost_at(now), FAILURE_PENALTY.as_secs_f64());
        assert_eq!(refusing.outstanding(), 0);
        let scores = [refusing.score_at(now), answering.score_at(now)];
        assert_eq!(two_choices(2, |_| 0, |i| scores[i]), Some(1), "{scores:?}");
        // A slower refusal counts as its own time.
        let call = refusing.start();
        tokio::time::advance(Duration::from_secs(2)).await;
        call.refused(None);
        assert_eq!(refusing.cost_at(Instant::now()), 2.0);
    }

    /// A call dropped unanswered (the loser of a hedge, a cancelled call) counts the time it
    /// had taken as a lower bound of the endpoint's latency: it raises the cost when above it,
    /// and a quick drop does not lower it.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_call_raises_the_cost_by_the_time_it_took_and_never_lowers_it() {
        let e = EndpointLoad::new(1.0, Duration::ZERO);
        let call = e.start();
        tokio::time::advance(ms(10)).await;
        call.finish(None);
        assert_eq!(e.cost_at(Instant::now()), 0.010);
        let hedged_away = e.start();
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(hedged_away);
        assert_eq!(e.cost_at(Instant::now()), 1.0);
        assert_eq!(e.outstanding(), 0);
        let quick = e.start();
        let before = e.cost_at(Instant::now());
        tokio::time::advance(ms(1)).await;
        drop(quick);
        assert!(
            e.cost_at(Instant::now()) >= before - 1e-3,
            "not lowered by a quick drop"
        );
        // A call that never reached the endpoint (a connect that failed after 3 s) says
        // nothing of its latency.
        let unreached = e.start();
        let before = e.cost_at(Instant::now());
        tokio::time::advance(Duration::from_secs(3)).await;
        unreached.forget();
        assert!(
            e.cost_at(Instant::now()) <= before,
            "raised by a call that never reached it"
        );
        assert_eq!(e.outstanding(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn outstanding_calls_and_server_reports_raise_the_score() {
        let e = EndpointLoad::new(1.0, Duration::ZERO);
        let now = Instant::now();
        e.observe(ms(10), now);
        let calls: Vec<_> = (0..3).map(|_| e.start()).collect();
        // √(3 + 1) = 2.
        assert!((e.score_at(now) - 0.010 * 2.0).abs() < 1e-12);
        drop(calls);
        assert_eq!(e.outstanding(), 0);
        e.report(ServerLoad {
            in_flight: 30,
            limit: 60,
        });
        assert!((e.score_at(now) - 0.010 * 1.5).abs() < 1e-12);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peak_decays_over_twenty_faster_answers_at_the_latest() {
        let e = EndpointLoad::new(1.0, Duration::ZERO);
        let t0 = Instant::now();
        e.observe(ms(500), t0);
        // Twenty 10 ms answers at the same instant: time alone would not move the cost at all;
        // each moves it 1/20 of the way: 10 + 490 · 0.95²⁰.
        for _ in 0..PEAK_ANSWERS {
            e.observe(ms(10), t0);
        }
        let expected = 0.010 + 0.490 * 0.95f64.powi(20);
        assert!((e.cost() - expected).abs() < 1e-9, "{}", e.cost());
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_every_endpoint_saw_is_forgotten_first_by_the_busy_fast_one() {
        // A fast (2 ms) and a slow (20 ms) endpoint; then the client stalls and both see a
        // 50 ms answer. Over the next 10 ms the fast one answers 40 calls, the slow one 1.
        let (fast, slow) = (
            EndpointLoad::new(1.0, Duration::ZERO),
            EndpointLoad::new(1.0, Duration::ZERO),
        );
        let t0 = Instant::now();
        fast.observe(ms(2), t0);
        slow.observe(ms(20), t0);
        fast.observe(ms(50), t0);
        slow.observe(ms(50), t0);
        for i in 1..=40u32 {
            fast.observe(ms(2), t0 + Duration::from_micros(250) * i);
        }
        slow.observe(ms(20), t0 + ms(10));
        // Fast: 2 + 48 · 0.95⁴⁰ ≈ 8.2 ms; slow: 50 · 0.95 + 20 · 0.05 = 48.5 ms. With time alone
        // (10 s) both would still be within 0.1 % of 50 ms: the stall would hide which is slow.
        let fast_expected = 0.002 + 0.048 * 0.95f64.powi(40);
        assert!(
            (fast.cost() - fast_expected).abs() < 1e-9,
            "{}",
            fast.cost()
        );
        assert!((slow.cost() - 0.0485).abs() < 1e-9, "{}", slow.cost());
    }

    #[tokio::test(start_paused = true)]
    async fn latency_weighs_more_than_calls_outstanding() {
        // a answers in 10 ms and has 7 calls outstanding; b answers in 30 ms and has none.
        // Latency × (outstanding + 1) would pick b (80 against 30); latency × √(outstanding
        // + 1) picks a (10 · √8 ≈ 28.3 against 30).
        let (a, b) = (
            EndpointLoad::new(1.0, Duration::ZERO),
            EndpointLoad::new(1.0, Duration::ZERO),
        );
        let now = Instant::now();
        a.observe(ms(10), now);
        b.observe(ms(30), now);
        let _held: Vec<_> = (0..7).map(|_| a.start()).collect();
        assert!((a.score_at(now) - 0.010 * 8f64.sqrt()).abs() < 1e-12);
        assert!(a.score_at(now) < b.score_at(now));
        // One more outstanding on a (10 · √9 = 30) and b is no worse.
        let _one_more = a.start();
        assert!(a.score_at(now) >= b.score_at(now));
    }

    #[tokio::test(start_paused = true)]
    async fn slow_start_ramps_the_weight_from_a_tenth() {
        let e = EndpointLoad::new(2.0, Duration::from_secs(10));
        let t0 = Instant::now();
        assert!((e.weight_at(t0) - 0.2).abs() < 1e-12);
        assert!((e.weight_at(t0 + Duration::from_secs(5)) - 2.0 * 0.55).abs() < 1e-12);
        assert_eq!(e.weight_at(t0 + Duration::from_secs(10)), 2.0);
    }

    #[test]
    fn two_choices_takes_the_lower_score_of_two_distinct_candidates() {
        let scores = [5.0, 1.0, 3.0];
        // Draws 0 then 0: candidates 0 and 1 (the first of the others).
        let mut draws = [0, 0].into_iter();
        let picked = two_choices(3, |_| draws.next().unwrap(), |i| scores[i]);
        assert_eq!(picked, Some(1));
        // Draws 2 then 1: candidates 2 and (2 + 1 + 1) % 3 = 1.
        let mut draws = [2, 1].into_iter();
        assert_eq!(
            two_choices(3, |_| draws.next().unwrap(), |i| scores[i]),
            Some(1)
        );
        assert_eq!(two_choices(0, |_| 0, |_| 0.0), None);
        assert_eq!(two_choices(1, |_| 0, |_| 0.0), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_ten_times_slower_endpoint_gets_few_calls() {
        // Three endpoints, one ten times slower; a closed loop of 30 callers, each call taking
        // its endpoint's latency, simulated on the paused clock one millisecond at a time.
        let latency = [ms(10), ms(10), ms(100)];
        let loads: Vec<EndpointLoad> = (0..3)
            .map(|_| EndpointLoad::new(1.0, Duration::ZERO))
            .collect();
        let mut sent = [0u32; 3];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut draw = |k: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % k as u64) as usize
        };
        let mut running: Vec<(usize, Instant, Outstanding<'_>)> = Vec::new();
        let t0 = Instant::now();
        for step in 0..10_000u64 {
            let now = t0 + ms(step);
            let (done, still): (Vec<_>, Vec<_>) = running
                .drain(..)
                .partition(|(i, started, _)| now - *started >= latency[*i]);
            running = still;
            for (_, _, call) in done {
                call.finish(None);
            }
            while running.len() < 30 {
                let i = two_choices(3, &mut draw, |i| loads[i].score_at(now)).unwrap();
                sent[i] += 1;
                running.push((i, now, loads[i].start()));
            }
            tokio::time::advance(ms(1)).await;
        }
        let total: u32 = sent.iter().sum();
        let slow_share = f64::from(sent[2]) / f64::from(total);
        // Round robin would send it a third; latency-aware choice far less.
        assert!(slow_share < 0.1, "{sent:?}");
    }
}
