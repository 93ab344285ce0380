//! Outliers by success rate: the endpoint that fails more often than its peers.
//!
//! Consecutive-failure ejection ([`crate::health`]) catches an endpoint that is down. It misses
//! one that fails one call in five: the failures never come five in a row, yet that endpoint
//! spoils a fifth of its share of the calls. Envoy's success-rate rule compares endpoints with
//! one another instead: over an interval, among the endpoints that served enough calls to be
//! judged, those whose success rate lies more than `stdev_factor` standard deviations below
//! the mean are outliers. Comparing with the peers means a cluster-wide failure (every endpoint
//! at 50 %) ejects nobody: there is nothing better to move the calls to.
//!
//! [`success_rate_outliers`] decides; [`SuccessRateTracker`] counts calls per endpoint over an
//! interval and judges each interval when it ends (at the first call after it, so no timer
//! runs); the caller ejects what it is told through [`crate::health`], at most
//! `max_ejection_percent` of the endpoints that served calls in the interval at once.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rpc_core::GovernanceOptions;
use tokio::time::Instant;

/// When the rule judges, and how strictly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SuccessRateRule {
    /// Calls an endpoint must have served in the interval to be judged.
    pub request_volume: u64,
    /// Endpoints that must qualify before any is judged.
    pub minimum_hosts: usize,
    /// How many standard deviations below the mean make an outlier (Envoy: 1.9).
    pub stdev_factor: f64,
    /// At most this share of the endpoints (percent, at least one endpoint) are outliers at
    /// once; the worst first.
    pub max_ejection_percent: u32,
}

impl Default for SuccessRateRule {
    fn default() -> Self {
        SuccessRateRule {
            request_volume: 100,
            minimum_hosts: 5,
            stdev_factor: 1.9,
            max_ejection_percent: 10,
        }
    }
}

impl SuccessRateRule {
    /// The rule of an entry's options (`outlier_request_volume`, `outlier_minimum_hosts`,
    /// `outlier_stdev_factor_percent`, `outlier_max_ejection_percent`).
    pub fn of(o: &GovernanceOptions) -> Self {
        SuccessRateRule {
            request_volume: u64::from(o.outlier_request_volume),
            minimum_hosts: o.outlier_minimum_hosts as usize,
            stdev_factor: f64::from(o.outlier_stdev_factor_percent) / 100.0,
            max_ejection_percent: o.outlier_max_ejection_percent,
        }
    }
}

/// An endpoint judged an outlier over one interval.
#[derive(Debug, Clone, PartialEq)]
pub struct Outlier {
    /// The endpoint's address.
    pub address: String,
    /// Its calls that succeeded in the interval.
    pub successes: u64,
    /// Its calls in the interval.
    pub calls: u64,
    /// The mean success rate of the endpoints judged, 0 to 1.
    pub mean_rate: f64,
}

impl Outlier {
    /// Why it is ejected, for the ejection event.
    pub fn cause(&self) -> String {
        format!(
            "success rate {:.1} % ({} of {} calls) against a mean of {:.1} % over the interval \
             (outlier by success rate)",
            100.0 * self.successes as f64 / self.calls.max(1) as f64,
            self.successes,
            self.calls,
            100.0 * self.mean_rate
        )
    }
}

/// Calls and successes per endpoint over the current interval.
#[derive(Debug)]
pub struct SuccessRateTracker {
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    counts: HashMap<String, (u64, u64)>,
}

impl Default for SuccessRateTracker {
    fn default() -> Self {
        SuccessRateTracker::new()
    }
}

impl SuccessRateTracker {
    /// An interval starting now.
    pub fn new() -> Self {
        SuccessRateTracker {
            window: Mutex::new(Window {
                started: Instant::now(),
                counts: HashMap::new(),
            }),
        }
    }

    /// Counts one call of `addr` (`ok`: it succeeded). When the current interval (of length
    /// `interval`) has ended, the interval is judged by `rule` first and a new one begins with
    /// this call: the outliers of the ended interval are returned, worst first. An interval
    /// that ended an interval ago or more (no call came since) is not judged: its counts no
    /// longer say how the endpoints do.
    pub fn record(
        &self,
        addr: &str,
        ok: bool,
        interval: Duration,
        rule: &SuccessRateRule,
    ) -> Vec<Outlier> {
        let now = Instant::now();
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        let mut outliers = Vec::new();
        let age = now.saturating_duration_since(w.started);
        if age >= interval {
            let ended = std::mem::take(&mut w.counts);
            w.started = now;
            // (A stale interval is let go unjudged.)
            let ended = if age < interval.saturating_mul(2) {
                ended
            } else {
                HashMap::new()
            };
            let (addrs, counts): (Vec<String>, Vec<(u64, u64)>) = ended.into_iter().unzip();
            let judged: Vec<f64> = counts
                .iter()
                .filter(|(_, calls)| *calls >= rule.request_volume.max(1))
                .map(|(ok, calls)| *ok as f64 / *calls as f64)
                .collect();
            let mean_rate = judged.iter().sum::<f64>() / judged.len().max(1) as f64;
            outliers = success_rate_outliers(&counts, rule)
                .into_iter()
                .map(|i| Outlier {
                    address: addrs[i].clone(),
                    successes: counts[i].0,
                    calls: counts[i].1,
                    mean_rate,
                })
                .collect();
        }
        let c = w.counts.entry(addr.to_string()).or_insert((0, 0));
        c.0 += u64::from(ok);
        c.1 += 1;
        outliers
    }
}

impl SuccessRateTracker {
    /// Drops the counts of the endpoints not `listed` (they left the service): an endpoint
    /// that is gone is neither judged (an ejection it took would be another's) nor counted in
    /// the others' mean.
    pub fn retain(&self, listed: impl Fn(&str) -> bool) {
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        w.counts.retain(|addr, _| listed(addr));
    }
}

/// The outliers among endpoints given as `(successes, calls)` over one interval: their
/// indexes, worst first.
pub fn success_rate_outliers(counts: &[(u64, u64)], rule: &SuccessRateRule) -> Vec<usize> {
    let judged: Vec<(usize, f64)> = counts
        .iter()
        .enumerate()
        .filter(|(_, (_, calls))| *calls >= rule.request_volume.max(1))
        .map(|(i, (ok, calls))| (i, *ok as f64 / *calls as f64))
        .collect();
    if judged.len() < rule.minimum_hosts.max(2) {
        return Vec::new();
    }
    let n = judged.len() as f64;
    let mean = judged.iter().map(|(_, r)| r).sum::<f64>() / n;
    let variance = judged.iter().map(|(_, r)| (r - mean).powi(2)).sum::<f64>() / n;
    let threshold = mean - rule.stdev_factor * variance.sqrt();
    let mut outliers: Vec<(usize, f64)> =
        judged.into_iter().filter(|(_, r)| *r < threshold).collect();
    outliers.sort_by(|a, b| a.1.total_cmp(&b.1));
    let most = (counts.len() * rule.max_ejection_percent as usize / 100).max(1);
    outliers.into_iter().take(most).map(|(i, _)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_failing_one_call_in_five_among_healthy_ones_is_an_outlier() {
        let mut counts = vec![(1000, 1000); 9];
        counts.push((800, 1000));
        assert_eq!(
            success_rate_outliers(&counts, &SuccessRateRule::default()),
            vec![9]
        );
    }

    #[test]
    fn a_cluster_failing_everywhere_alike_has_no_outlier() {
        let counts = vec![(500, 1000); 10];
        assert!(success_rate_outliers(&counts, &SuccessRateRule::default()).is_empty());
    }

    #[test]
    fn endpoints_with_too_few_calls_or_too_few_peers_are_not_judged() {
        let rule = SuccessRateRule::default();
        // The failing endpoint served fewer than request_volume calls.
        let mut counts = vec![(1000, 1000); 9];
        counts.push((0, 99));
        assert!(success_rate_outliers(&counts, &rule).is_empty());
        // Only four endpoints qualify: fewer than minimum_hosts.
        let counts = vec![(1000, 1000), (1000, 1000), (1000, 1000), (0, 1000)];
        assert!(success_rate_outliers(&counts, &rule).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_tracker_judges_each_interval_when_it_ends() {
        let t = SuccessRateTracker::new();
        let (interval, rule) = (Duration::from_secs(10), SuccessRateRule::default());
        // Five endpoints of 100 calls; e4 fails one call in four, never two in a row.
        for n in 0..100 {
            for e in 0..5 {
                let ok = e != 4 || n % 4 != 0;
                let out = t.record(&format!("e{e}"), ok, interval, &rule);
                assert!(out.is_empty(), "nothing is judged before the interval ends");
            }
        }
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(t.record("e0", true, interval, &rule).is_empty());
        tokio::time::advance(Duration::from_secs(1)).await;
        // Rates 1, 1, 1, 1 (e0 with 101 calls) and 0.75: mean 0.95, stdev 0.1, threshold
        // 0.95 - 1.9 x 0.1 = 0.76, so e4 alone is below it.
        let out = t.record("e1", true, interval, &rule);
        assert_eq!(
            out,
            vec![Outlier {
                address: "e4".into(),
                successes: 75,
                calls: 100,
                mean_rate: 0.95,
            }]
        );
        // A new interval began: the old counts are gone.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(t.record("e1", true, interval, &rule).is_empty());
    }

    /// An interval whose end no call saw for another interval is let go unjudged: an
    /// endpoint that failed then and was fixed since is not ejected for it an hour later.
    #[tokio::test(start_paused = true)]
    async fn an_interval_judged_an_interval_or_more_late_is_let_go() {
        let t = SuccessRateTracker::new();
        let (interval, rule) = (Duration::from_secs(10), SuccessRateRule::default());
        let fill = |t: &SuccessRateTracker| {
            // As in the test above: e4 fails one call in four, an outlier when judged.
            for n in 0..100 {
                for e in 0..5 {
                    let ok = e != 4 || n % 4 != 0;
                    assert!(t.record(&format!("e{e}"), ok, interval, &rule).is_empty());
                }
            }
        };
        fill(&t);
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(
            t.record("e1", true, interval, &rule).is_empty(),
            "judged an hour late"
        );
        // The next interval, judged in time, is judged.
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(
            t.record("e1", true, interval, &rule).is_empty(),
            "stale again"
        );
        fill(&t);
        tokio::time::advance(Duration::from_secs(19)).await;
        let out = t.record("e1", true, interval, &rule);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].address, "e4");
    }

    #[test]
    fn the_rule_follows_the_options() {
        let o = GovernanceOptions {
            outlier_request_volume: 20,
            outlier_minimum_hosts: 3,
            outlier_stdev_factor_percent: 150,
            outlier_max_ejection_percent: 50,
            ..GovernanceOptions::default()
        };
        assert_eq!(
            SuccessRateRule::of(&o),
            SuccessRateRule {
                request_volume: 20,
                minimum_hosts: 3,
                stdev_factor: 1.5,
                max_ejection_percent: 50,
            }
        );
        assert_eq!(
            SuccessRateRule::of(&GovernanceOptions::default()),
            SuccessRateRule::default(),
            "the options' defaults are Envoy's"
        );
    }

    #[test]
    fn no_more_than_the_ejection_share_worst_first() {
        // 20 endpoints, three bad ones: 10 % allows two, the two worst.
        let mut counts = vec![(1000, 1000); 17];
        counts.extend([(700, 1000), (500, 1000), (600, 1000)]);
        let rule = SuccessRateRule {
            stdev_factor: 1.0,
            ..SuccessRateRule::default()
        };
        assert_eq!(success_rate_outliers(&counts, &rule), vec![18, 19]);
    }
}
