//! Live statistics per entry over a sliding window: calls per second, error rate, p50 and p99
//! latency, as a console's charts poll them (`GET /api/stats`).
//!
//! Prometheus computes rates from counters over its own scrapes; a console polling one process
//! needs the figures ready, over the last few seconds only. Each entry keeps one bucket per
//! second of the window (count, errors, a latency histogram), made when a call lands in it and
//! dropped once the window has passed it: each second's first call sweeps every entry's
//! buckets (as does a snapshot), so an idle entry costs nothing but its name.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use rpc_governance::calls::{CallObserver, CallRecord, Side};
use serde::Serialize;
use tokio::time::Instant;

/// Latencies are recorded in microseconds, from 1 µs to 10 minutes, to 2 significant digits
/// (1 % precision is what a p99 panel shows).
const MAX_MICROS: u64 = 600_000_000;

/// The longest window kept: each of its seconds holds a latency histogram (about 12 KB at these
/// bounds) for every entry called in it, so an hour's window would hold some 40 MB an entry.
pub(crate) const MAX_WINDOW: Duration = Duration::from_secs(300);

/// One second of one entry.
struct Bucket {
    second: u64,
    calls: u64,
    errors: u64,
    cancelled: u64,
    latency: Histogram<u32>,
}

/// How a call ended, as the statistics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// With the entry's own answer.
    Ok,
    /// With an error (a timeout included), or with a fallback's answer in the entry's place.
    Failed,
    /// Given up on by its caller before its end, or stopped because another attempt of the
    /// same call answered first (`superseded`): neither a success nor a failure of the
    /// entry, and its time says nothing of the entry's latency.
    Cancelled,
}

/// The live statistics of every entry a process makes or handles calls of.
pub(crate) struct Stats {
    start: Instant,
    window: u64,
    entries: Mutex<Entries>,
}

/// Every entry's buckets, and the second they were last swept for buckets the window passed.
#[derive(Default)]
struct Entries {
    buckets: BTreeMap<(&'static str, &'static str), VecDeque<Bucket>>,
    swept: u64,
}

impl Entries {
    /// Drops the buckets of every entry that the window ending in `second` has passed, once
    /// a second: an entry called no more must not keep its last histograms for good.
    fn sweep(&mut self, second: u64, window: u64) {
        if second <= self.swept {
            return;
        }
        self.swept = second;
        for buckets in self.buckets.values_mut() {
            while buckets.front().is_some_and(|b| b.second + window <= second) {
                buckets.pop_front();
            }
        }
    }
}

/// One entry's figures over the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct EntryStats {
    /// `client` (calls made) or `server` (calls handled).
    pub side: &'static str,
    /// The entry id.
    pub entry: String,
    /// Calls that ended within the window.
    pub calls: u64,
    /// Of those, the ones that did not succeed (a fallback's answer counts as a failure).
    pub errors: u64,
    /// Calls their callers gave up on, or stopped because another attempt of the same call
    /// answered first (superseded), within the window (not in `calls`, `errors` nor the
    /// latencies).
    pub cancelled: u64,
    /// `calls` divided by the time the window covers: its length, less what the current
    /// second has still to run (and, in the statistics' first window, the time since they
    /// started); at least a second.
    pub calls_per_second: f64,
    /// `errors / calls`, 0 without calls.
    pub error_rate: f64,
    /// Median latency, in milliseconds.
    pub p50_ms: f64,
    /// 99th percentile latency, in milliseconds.
    pub p99_ms: f64,
}

impl Stats {
    /// Statistics over the last `window` (whole seconds, at least one, at most
    /// [`MAX_WINDOW`]).
    pub(crate) fn new(window: Duration) -> Self {
        Stats {
            start: Instant::now(),
            window: window.clamp(Duration::from_secs(1), MAX_WINDOW).as_secs(),
            entries: Mutex::new(Entries::default()),
        }
    }

    /// The window's length in seconds.
    pub(crate) fn window_seconds(&self) -> u64 {
        self.window
    }

    fn second(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.start).as_secs()
    }

    /// Records a call that ended at `at`.
    pub(crate) fn record(
        &self,
        side: Side,
        entry: &'static str,
        at: Instant,
        elapsed: Duration,
        ended: Ended,
    ) {
        let second = self.second(at);
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.sweep(second, self.window);
        let buckets = entries.buckets.entry((side.as_str(), entry)).or_default();
        if buckets.back().is_none_or(|b| b.second != second) {
            let Ok(latency) = Histogram::new_with_bounds(1, MAX_MICROS, 2) else {
                return;
            };
            buckets.push_back(Bucket {
                second,
                calls: 0,
                errors: 0,
                cancelled: 0,
                latency,
            });
        }
        if let Some(b) = buckets.back_mut() {
            if ended == Ended::Cancelled {
                b.cancelled += 1;
                return;
            }
            b.calls += 1;
            b.errors += u64::from(ended == Ended::Failed);
            let micros = u64::try_from(elapsed.as_micros()).unwrap_or(MAX_MICROS);
            b.latency.saturating_record(micros.clamp(1, MAX_MICROS));
        }
    }

    /// Every entry's figures over the window ending at `now` (entries without calls in it
    /// included, with zeros, so a chart's line does not vanish when traffic stops).
    pub(crate) fn snapshot(&self, now: Instant) -> Vec<EntryStats> {
        let second = self.second(now);
        // The buckets in the window are its whole seconds but the last, plus the current
        // second so far: dividing by the whole window would under-report a steady rate by up
        // to a second's worth, a saw-tooth on the console's chart.
        let since_start = now.saturating_duration_since(self.start).as_secs_f64();
        let into_second = since_start - second as f64;
        let covered = ((self.window - 1) as f64 + into_second)
            .min(since_start)
            .max(1.0);
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.sweep(second, self.window);
        entries
            .buckets
            .iter()
            .map(|((side, entry), buckets)| {
                let live = buckets.iter().filter(|b| b.second + self.window > second);
                let (mut calls, mut errors, mut cancelled) = (0, 0, 0);
                let mut latency: Option<Histogram<u32>> = None;
                for b in live {
                    calls += b.calls;
                    errors += b.errors;
                    cancelled += b.cancelled;
                    match &mut latency {
                        None => latency = Some(b.latency.clone()),
                        Some(h) => {
                            // Same bounds: adding cannot fail.
                            let _ = h.add(&b.latency);
                        }
                    }
                }
                let ms = |q: f64| {
                    latency
                        .as_ref()
                        .map_or(0.0, |h| h.value_at_quantile(q) as f64 / 1000.0)
                };
                EntryStats {
                    side,
                    entry: entry.to_string(),
                    calls,
                    errors,
                    cancelled,
                    calls_per_second: calls as f64 / covered,
                    error_rate: if calls == 0 {
                        0.0
                    } else {
                        errors as f64 / calls as f64
                    },
                    p50_ms: ms(0.5),
                    p99_ms: ms(0.99),
                }
            })
            .collect()
    }
}

impl CallObserver for Stats {
    fn call_ended(&self, call: &CallRecord) {
        self.record(
            call.side,
            call.entry,
            Instant::now(),
            call.elapsed,
            match call.outcome {
                "success" => Ended::Ok,
                "cancelled" | "superseded" => Ended::Cancelled,
                _ => Ended::Failed,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the call observers report is counted as the outcome says: a handler stopped
    /// because another attempt of its call answered first (`superseded`) is no failure, as a
    /// cancelled call is none; a fallback's answer is one.
    #[tokio::test(start_paused = true)]
    async fn a_superseded_call_counts_as_cancelled_and_a_fallback_as_failed() {
        let stats = Stats::new(Duration::from_secs(10));
        for outcome in [
            "success",
            "superseded",
            "cancelled",
            "fallback",
            "error",
            "timeout",
        ] {
            stats.call_ended(&CallRecord {
                side: Side::Server,
                entry: "a.A.m",
                status: None,
                outcome,
                elapsed: Duration::from_millis(1),
            });
        }
        let s = &stats.snapshot(Instant::now() + Duration::from_secs(1))[0];
        assert_eq!((s.calls, s.errors, s.cancelled), (4, 3, 2), "{s:?}");
    }

    /// An entry called no more keeps no buckets once the window has passed its last call,
    /// though nothing reads the statistics: another entry's call drops them.
    #[tokio::test(start_paused = true)]
    async fn an_idle_entrys_buckets_go_once_the_window_passed_them() {
        let stats = Stats::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let call = |entry, at| stats.record(Side::Client, entry, at, Duration::ZERO, Ended::Ok);
        // `a.A.idle`: one call in each of seconds 0, 1 and 2, then none.
        for s in 0..3 {
            call("a.A.idle", t0 + Duration::from_secs(s));
        }
        let held = |stats: &Stats, entry| {
            let entries = stats.entries.lock().unwrap();
            entries.buckets.get(&("client", entry)).map(VecDeque::len)
        };
        assert_eq!(held(&stats, "a.A.idle"), Some(3));
        // At 11 s the 10 s window holds seconds 2..=11: of the idle entry's, second 2 only.
        call("a.A.busy", t0 + Duration::from_secs(11));
        assert_eq!(held(&stats, "a.A.idle"), Some(1));
        call("a.A.busy", t0 + Duration::from_secs(12));
        assert_eq!(held(&stats, "a.A.idle"), Some(0));
    }

    /// A window longer than the longest kept (the builder takes any, `Duration::MAX` too) is
    /// the longest kept, and its calls are counted: the seconds' sums once overflowed, which
    /// panicked in a debug build and dropped every call but the first second's in a release
    /// one.
    #[tokio::test(start_paused = true)]
    async fn a_window_past_the_longest_is_the_longest_and_counts_its_calls() {
        let stats = Stats::new(Duration::MAX);
        assert_eq!(stats.window_seconds(), 300);
        let t0 = Instant::now();
        let at = t0 + Duration::from_secs(2);
        stats.record(Side::Client, "a.A.m", at, Duration::ZERO, Ended::Ok);
        let s = &stats.snapshot(t0 + Duration::from_secs(3))[0];
        assert_eq!(s.calls, 1, "{s:?}");
    }

    /// A steady 100 calls a second reads 100 a second wherever in the current second the
    /// snapshot is taken (the window holds nine whole seconds and a part of the tenth).
    #[tokio::test(start_paused = true)]
    async fn a_steady_rate_reads_the_same_at_any_point_of_a_second() {
        let t0 = Instant::now();
        // 100 calls a second, one every 10 ms, up to a snapshot at 20.05 s or at 20.95 s.
        for at_ms in [20_050u64, 20_950] {
            let partial = Stats::new(Duration::from_secs(10));
            for i in 0..=(at_ms / 10) {
                let at = t0 + Duration::from_millis(10 * i);
                partial.record(
                    Side::Server,
                    "a.A.m",
                    at,
                    Duration::from_millis(1),
                    Ended::Ok,
                );
            }
            let rate = partial.snapshot(t0 + Duration::from_millis(at_ms))[0].calls_per_second;
            assert!((rate - 100.0).abs() <= 1.5, "at {at_ms} ms: {rate}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn figures_cover_the_window_and_percentiles_follow_the_recorded_latencies() {
        let stats = Stats::new(Duration::from_secs(10));
        let t0 = Instant::now();
        // 100 calls of 1..=100 ms, every tenth failing, all in the window.
        for i in 1..=100u64 {
            stats.record(
                Side::Client,
                "a.A.m",
                t0 + Duration::from_millis(20 * i),
                Duration::from_millis(i),
                if i % 10 == 0 {
                    Ended::Failed
                } else {
                    Ended::Ok
                },
            );
        }
        let now = t0 + Duration::from_secs(3);
        let s = &stats.snapshot(now)[0];
        assert_eq!((s.side, s.entry.as_str()), ("client", "a.A.m"));
        assert_eq!((s.calls, s.errors), (100, 10));
        // The statistics have run 3 s: 100 calls over 3 s.
        assert!((s.calls_per_second - 100.0 / 3.0).abs() < 1e-9, "{s:?}");
        assert!((s.error_rate - 0.1).abs() < 1e-9, "{s:?}");
        // The 50th of 1..=100 ms is 50 ms, the 99th 99 ms; within the histogram's 1 %.
        assert!((s.p50_ms - 50.0).abs() <= 0.5, "{s:?}");
        assert!((s.p99_ms - 99.0).abs() <= 1.0, "{s:?}");
        // Calls their callers gave up on are counted apart: the error rate and the latencies
        // are the entry's, as before.
        let observer: &dyn CallObserver = &stats;
        for _ in 0..5 {
            observer.call_ended(&CallRecord {
                side: Side::Client,
                entry: "a.A.m",
                status: None,
                outcome: "cancelled",
                elapsed: Duration::from_secs(60),
            });
        }
        let s = &stats.snapshot(now)[0];
        assert_eq!((s.calls, s.errors, s.cancelled), (100, 10, 5));
        assert!((s.error_rate - 0.1).abs() < 1e-9, "{s:?}");
        assert!((s.p99_ms - 99.0).abs() <= 1.0, "{s:?}");
        // Half the window later, only the calls of its second half count.
        let mid = stats.snapshot(t0 + Duration::from_millis(11_500));
        // Seconds 2.. of the calls (at 20·i ms: i = 100 at 2 s) remain: one call.
        assert_eq!(mid[0].calls, 1, "{mid:?}");
        // Ten seconds after the last call (at 2 s) nothing is left in the window, but the
        // entry stays listed.
        let later = stats.snapshot(t0 + Duration::from_secs(13));
        assert_eq!(later[0].calls, 0);
        assert_eq!(later[0].p99_ms, 0.0);
    }
}
