//! The shunt strategy: how a client picks one endpoint. Its spellings come from `declared.rs`,
//! shared with the `#[governance(shunt_strategy = "...")]` attribute; the serde names are the
//! ones older processes publish and read, checked against those spellings by the tests.

use serde::{Deserialize, Serialize};

/// How a client picks one endpoint among a service's live endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShuntStrategy {
    /// Round robin (Silky's `polling`, the spelling it is written and published with).
    #[default]
    #[serde(rename = "polling", alias = "round_robin", alias = "round-robin")]
    RoundRobin,
    /// Uniformly random.
    Random,
    /// Consistent hash of the call's `#[hash_key]` argument over a ring with virtual nodes.
    /// Written and published as Silky's `hash_algorithm`; `hash` is accepted too.
    #[serde(rename = "hash_algorithm", alias = "hash")]
    Hash,
    /// Always the appointed address (see
    /// [`GovernanceOptions::appoint_address`](crate::GovernanceOptions::appoint_address)).
    Appoint,
    /// Load-aware: the better of two random endpoints (power of two choices) by the score
    /// peak-EWMA latency × √((calls in flight + 1) / the instance's weight) × (1 + the
    /// server's reported utilization); lower wins.
    /// Written `least_loaded`; `p2c` is accepted too.
    #[serde(rename = "least_loaded", alias = "p2c", alias = "least-loaded")]
    LeastLoaded,
}

impl ShuntStrategy {
    /// The usual spelling: `polling`, `random`, `hash`, `appoint` or `least_loaded`.
    pub const fn name(self) -> &'static str {
        // Indexes follow the order of `shunt_strategy_spellings!` in `declared.rs`, which the
        // tests check.
        Self::NAMES[self as usize]
    }
}

impl std::str::FromStr for ShuntStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::SPELLINGS
            .iter()
            .find(|(_, spellings)| spellings.contains(&s))
            .map(|(strategy, _)| *strategy)
            .ok_or_else(|| {
                format!(
                    "unknown shunt strategy {s:?}: expected {}",
                    one_of(Self::NAMES)
                )
            })
    }
}

/// `a, b, c or d`.
fn one_of(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_reads_the_same_through_serde_and_from_str() {
        for (strategy, spellings) in ShuntStrategy::SPELLINGS {
            assert_eq!(strategy.name(), spellings[0]);
            for s in *spellings {
                let by_serde: ShuntStrategy = serde_json::from_value(serde_json::json!(s))
                    .unwrap_or_else(|e| panic!("{s}: {e}"));
                assert_eq!(by_serde, *strategy, "{s}");
                assert_eq!(s.parse::<ShuntStrategy>(), Ok(*strategy), "{s}");
            }
        }
        let e = "nearest".parse::<ShuntStrategy>().unwrap_err();
        assert_eq!(
            e,
            "unknown shunt strategy \"nearest\": expected polling, random, hash, appoint or least_loaded"
        );
    }
}
