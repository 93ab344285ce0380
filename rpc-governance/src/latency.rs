//! An entry's recent latency by percentile: what a hedge delay should follow.
//!
//! A fixed hedge delay is a guess that goes stale: set below the usual answer it doubles the
//! load, set far above it hedges too late to help, and the usual answer changes with load and
//! deployments. The rule from "The Tail at Scale" is to hedge once a call has taken longer
//! than most calls do, say its 95th percentile: then about 5 % of calls are hedged, whatever
//! the latencies are. [`LatencyWindow`] keeps an entry's call latencies over a trailing window
//! and answers a percentile of them.
//!
//! The window is [`WINDOW`] kept in [`SLICES`] slices, each an HDR histogram (two significant
//! digits: any percentile within 1 %, a record in constant time, fixed memory), so old
//! latencies leave it a slice at a time. A percentile merges the slices, so the answer is
//! cached and computed again only once [`REFRESH`] more calls were recorded or a slice left the
//! window (or at once, while the window held too few). The answer is the top of the
//! histogram's bucket holding the percentile: at most 1 % above it. Below [`MIN_SAMPLES`] latencies in the window it answers nothing: a percentile of a
//! handful of calls says little. Time is tokio's clock, so the paused clock drives it in tests.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

/// How far back latencies count.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Slices the window is kept in.
pub const SLICES: usize = 5;

/// Latencies the window must hold before it answers a percentile.
pub const MIN_SAMPLES: u64 = 20;

/// Calls recorded after which a cached percentile is computed again.
pub const REFRESH: u64 = 16;

/// The largest latency recorded as itself, in microseconds (a minute); longer ones count as a
/// minute.
const MAX_MICROS: u64 = 60_000_000;

/// One entry's call latencies over the trailing [`WINDOW`].
#[derive(Debug)]
pub struct LatencyWindow {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Per slice, latencies in microseconds; `at` is the start of the newest slice.
    slices: Vec<Histogram<u32>>,
    newest: usize,
    at: Instant,
    /// Scratch space the slices are merged into.
    merged: Histogram<u32>,
    /// The last percentile computed: (percentile, answer), and the calls recorded since.
    cached: Option<(u32, Option<Duration>)>,
    since_cached: u64,
}

fn histogram() -> Histogram<u32> {
    match Histogram::new_with_bounds(1, MAX_MICROS, 2) {
        Ok(h) => h,
        // The bounds and precision are constants within hdrhistogram's limits (every test of
        // this module makes one), never a peer's or a configuration's values.
        Err(e) => unreachable!("hdrhistogram refused constant bounds: {e:?}"),
    }
}

impl Default for LatencyWindow {
    fn default() -> Self {
        LatencyWindow::new()
    }
}

impl LatencyWindow {
    /// An empty window, starting now.
    pub fn new() -> Self {
        LatencyWindow {
            state: Mutex::new(State {
                slices: (0..SLICES).map(|_| histogram()).collect(),
                newest: 0,
                at: Instant::now(),
                merged: histogram(),
                cached: None,
                since_cached: 0,
            }),
        }
    }

    /// Records a call that took `latency`, observed at `now`.
    pub fn record_at(&self, latency: Duration, now: Instant) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(MAX_MICROS);
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.advance(now);
        let newest = s.newest;
        s.slices[newest].saturating_record(micros.clamp(1, MAX_MICROS));
        s.since_cached += 1;
        // A cached "too few calls" is stale at the next call: it may be the one that makes
        // enough.
        if s.since_cached >= REFRESH || matches!(s.cached, Some((_, None))) {
            s.cached = None;
        }
    }

    /// The latency at `percentile` (1 to 100; 100 is the slowest) of the calls recorded in the
    /// window ending at `now`; `None` while it holds fewer than [`MIN_SAMPLES`].
    pub fn percentile_at(&self, percentile: u32, now: Instant) -> Option<Duration> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.advance(now);
        if let Some((p, answer)) = s.cached {
            if p == percentile {
                return answer;
            }
        }
        let State { slices, merged, .. } = &mut *s;
        merged.reset();
        for slice in slices.iter() {
            // Same bounds and precision: adding cannot fail.
            let _ = merged.add(slice);
        }
        let answer = (merged.len() >= MIN_SAMPLES).then(|| {
            let q = f64::from(percentile.clamp(1, 100)) / 100.0;
            Duration::from_micros(merged.value_at_quantile(q))
        });
        s.cached = Some((percentile, answer));
        s.since_cached = 0;
        answer
    }

    /// Latencies in the window ending at `now`.
    pub fn len_at(&self, now: Instant) -> u64 {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.advance(now);
        s.slices.iter().map(Histogram::len).sum()
    }
}

impl State {
    /// Moves the window to `now`, emptying the slices that left it.
    fn advance(&mut self, now: Instant) {
        let slice = WINDOW / SLICES as u32;
        let mut steps = 0;
        while now.saturating_duration_since(self.at) >= slice && steps < SLICES {
            self.at += slice;
            self.newest = (self.newest + 1) % SLICES;
            self.slices[self.newest].reset();
            steps += 1;
        }
        if steps > 0 {
            self.cached = None;
        }
        if now.saturating_duration_since(self.at) >= slice {
            // Idle for longer than the whole window: every slice is empty already.
            self.at = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// `got` is `want` within the histogram's precision (two significant digits: 1 %).
    fn close(got: Option<Duration>, want: Duration) -> bool {
        got.is_some_and(|g| {
            let (g, w) = (g.as_secs_f64(), want.as_secs_f64());
            (g - w).abs() <= w / 100.0
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_percentile_is_the_latency_that_share_of_calls_stays_within() {
        let w = LatencyWindow::new();
        let now = Instant::now();
        // 95 calls of 2 ms and 5 of 100 ms, interleaved: sorted, the 95th is 2 ms, the 96th
        // 100 ms.
        for i in 0..100 {
            w.record_at(if i % 20 == 7 { ms(100) } else { ms(2) }, now);
        }
        assert_eq!(w.len_at(now), 100);
        for (p, want) in [(50, ms(2)), (95, ms(2)), (96, ms(100)), (100, ms(100))] {
            let got = w.percentile_at(p, now);
            assert!(close(got, want), "p{p}: {got:?}, want {want:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn too_few_calls_give_no_percentile() {
        let w = LatencyWindow::new();
        let now = Instant::now();
        for _ in 0..MIN_SAMPLES - 1 {
            w.record_at(ms(3), now);
        }
        assert_eq!(w.percentile_at(95, now), None);
        w.record_at(ms(3), now);
        assert!(close(w.percentile_at(95, now), ms(3)));
    }

    #[tokio::test(start_paused = true)]
    async fn old_latencies_leave_the_window_a_slice_at_a_time() {
        let w = LatencyWindow::new();
        let t0 = Instant::now();
        for _ in 0..100 {
            w.record_at(ms(50), t0);
        }
        // Six seconds later, 100 faster calls: both halves count, the median is between.
        let t1 = t0 + Duration::from_secs(6);
        for _ in 0..100 {
            w.record_at(ms(5), t1);
        }
        assert_eq!(w.len_at(t1), 200);
        assert!(close(w.percentile_at(25, t1), ms(5)));
        assert!(close(w.percentile_at(75, t1), ms(50)));
        // A whole window after the slow calls, only the fast ones are left.
        let t2 = t0 + WINDOW;
        assert_eq!(w.len_at(t2), 100);
        assert!(close(w.percentile_at(99, t2), ms(5)));
        // After a long idle spell, nothing.
        let t3 = t2 + WINDOW * 10;
        assert_eq!(w.len_at(t3), 0);
        assert_eq!(w.percentile_at(99, t3), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cached_percentile_follows_new_calls_after_the_refresh_count() {
        let w = LatencyWindow::new();
        let now = Instant::now();
        for _ in 0..MIN_SAMPLES {
            w.record_at(ms(4), now);
        }
        assert!(close(w.percentile_at(90, now), ms(4)));
        // 80 slow calls make the p90 slow; the cache is computed again on the way.
        for _ in 0..80 {
            w.record_at(ms(40), now);
        }
        assert!(close(w.percentile_at(90, now), ms(40)));
        // Asking for another percentile computes it at once.
        assert!(close(w.percentile_at(10, now), ms(4)));
    }

    #[test]
    fn latencies_beyond_a_minute_count_as_a_minute() {
        let w = LatencyWindow::new();
        let now = Instant::now();
        for _ in 0..MIN_SAMPLES {
            w.record_at(Duration::from_secs(3600), now);
        }
        assert!(close(w.percentile_at(50, now), Duration::from_secs(60)));
    }
}
