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
//! This module decides; the caller counts calls per endpoint over its interval and ejects what
//! it is told, at most `max_ejection_percent` of the endpoints at once.

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
