//! Per-entry governance settings.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{RpcError, StatusCode};

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
    /// Always the appointed address (see [`GovernanceOptions::appoint_address`]).
    Appoint,
}

impl std::str::FromStr for ShuntStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "polling" | "round_robin" | "round-robin" => Ok(ShuntStrategy::RoundRobin),
            "random" => Ok(ShuntStrategy::Random),
            "hash" | "hash_algorithm" => Ok(ShuntStrategy::Hash),
            "appoint" => Ok(ShuntStrategy::Appoint),
            other => Err(format!(
                "unknown shunt strategy {other:?}: expected polling, random, hash or appoint"
            )),
        }
    }
}

/// The governance settings of one service entry, after every layer of configuration was applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct GovernanceOptions {
    /// Endpoint selection.
    pub shunt_strategy: ShuntStrategy,
    /// The address used by [`ShuntStrategy::Appoint`], as `host:port`.
    pub appoint_address: Option<String>,
    /// Deadline of the whole call, retries included, in milliseconds; 0 means none.
    pub timeout_ms: u64,
    /// Deadline of each attempt, in milliseconds; 0 means none (an attempt may use what is left
    /// of `timeout_ms`). An attempt that runs out of it counts against its endpoint and, for an
    /// idempotent entry, is retried on another endpoint within the call's `timeout_ms`.
    pub attempt_timeout_ms: u64,
    /// Attempts after the first one, on Overflow or an unreachable endpoint.
    pub retry_times: u32,
    /// Pause before each retry, in milliseconds.
    pub retry_interval_ms: u64,
    /// Whether the entry has a circuit breaker.
    pub enable_circuit_breaker: bool,
    /// Consecutive counted failures the breaker tolerates before it opens.
    pub exceptions_allowed_before_breaking: u32,
    /// How long the breaker stays open, in seconds.
    pub breaker_seconds: u64,
    /// Probe calls a half-open breaker admits at once.
    pub half_open_probes: u32,
    /// Failure-ratio mode of the breaker: it opens when this percentage of the calls in the
    /// sampling window failed (0 = consecutive mode, driven by
    /// `exceptions_allowed_before_breaking`).
    pub failure_ratio_percent: u32,
    /// Failure-ratio mode: the window over which the ratio is computed, in seconds.
    pub sampling_window_seconds: u64,
    /// Failure-ratio mode: calls the window must hold before the ratio can open the breaker.
    pub minimum_throughput: u32,
    /// Retry budget: retries allowed as a percentage of the entry's calls over the last 10 s.
    pub retry_budget_percent: u32,
    /// Retry budget: retries per second always allowed, whatever the ratio says.
    pub retry_budget_min_per_second: u32,
    /// Server side: calls of this entry handled at once before Overflow is answered.
    pub max_concurrent_handling_count: u32,
    /// Consecutive transport failures after which a client stops using an endpoint until the
    /// registry announces it again.
    pub unhealthy_times_allowed_before_removing: u32,
    /// The method may run twice without harm: a call that may have reached a server that then
    /// died is repeated elsewhere.
    pub idempotent: bool,
    /// A call made while handling another call (B's call to C while B serves A) inherits what
    /// is left of the caller's deadline less this slack, in milliseconds, at most a quarter of
    /// what is left: B's own call times out early enough for B (its fallback, its error) to
    /// still answer A in time. Default 50 ms: a few round trips on a LAN plus a local
    /// fallback's work, and small against the default 5 s budget.
    pub deadline_slack_ms: u64,
}

impl Default for GovernanceOptions {
    fn default() -> Self {
        GovernanceOptions {
            shunt_strategy: ShuntStrategy::RoundRobin,
            appoint_address: None,
            timeout_ms: 5000,
            attempt_timeout_ms: 0,
            retry_times: 3,
            retry_interval_ms: 50,
            enable_circuit_breaker: true,
            exceptions_allowed_before_breaking: 3,
            breaker_seconds: 60,
            half_open_probes: 1,
            failure_ratio_percent: 0,
            sampling_window_seconds: 10,
            minimum_throughput: 20,
            retry_budget_percent: 20,
            retry_budget_min_per_second: 10,
            max_concurrent_handling_count: 50,
            unhealthy_times_allowed_before_removing: 3,
            idempotent: false,
            deadline_slack_ms: 50,
        }
    }
}

/// A partial set of [`GovernanceOptions`]: what one configuration layer (a `#[governance(...)]`
/// attribute, a config file section, a runtime update) changes. `None` keeps the value below.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GovernanceOverrides {
    /// See [`GovernanceOptions::shunt_strategy`].
    pub shunt_strategy: Option<ShuntStrategy>,
    /// See [`GovernanceOptions::appoint_address`].
    pub appoint_address: Option<Cow<'static, str>>,
    /// See [`GovernanceOptions::timeout_ms`].
    pub timeout_ms: Option<u64>,
    /// See [`GovernanceOptions::attempt_timeout_ms`].
    pub attempt_timeout_ms: Option<u64>,
    /// See [`GovernanceOptions::retry_times`].
    pub retry_times: Option<u32>,
    /// See [`GovernanceOptions::retry_interval_ms`].
    pub retry_interval_ms: Option<u64>,
    /// See [`GovernanceOptions::enable_circuit_breaker`].
    pub enable_circuit_breaker: Option<bool>,
    /// See [`GovernanceOptions::exceptions_allowed_before_breaking`].
    pub exceptions_allowed_before_breaking: Option<u32>,
    /// See [`GovernanceOptions::breaker_seconds`].
    pub breaker_seconds: Option<u64>,
    /// See [`GovernanceOptions::half_open_probes`].
    pub half_open_probes: Option<u32>,
    /// See [`GovernanceOptions::failure_ratio_percent`].
    pub failure_ratio_percent: Option<u32>,
    /// See [`GovernanceOptions::sampling_window_seconds`].
    pub sampling_window_seconds: Option<u64>,
    /// See [`GovernanceOptions::minimum_throughput`].
    pub minimum_throughput: Option<u32>,
    /// See [`GovernanceOptions::retry_budget_percent`].
    pub retry_budget_percent: Option<u32>,
    /// See [`GovernanceOptions::retry_budget_min_per_second`].
    pub retry_budget_min_per_second: Option<u32>,
    /// See [`GovernanceOptions::max_concurrent_handling_count`].
    pub max_concurrent_handling_count: Option<u32>,
    /// See [`GovernanceOptions::unhealthy_times_allowed_before_removing`].
    pub unhealthy_times_allowed_before_removing: Option<u32>,
    /// See [`GovernanceOptions::idempotent`].
    pub idempotent: Option<bool>,
    /// See [`GovernanceOptions::deadline_slack_ms`].
    pub deadline_slack_ms: Option<u64>,
}

impl GovernanceOverrides {
    /// Changes nothing. Usable in `const` and `static` items.
    pub const NONE: GovernanceOverrides = GovernanceOverrides {
        shunt_strategy: None,
        appoint_address: None,
        timeout_ms: None,
        attempt_timeout_ms: None,
        retry_times: None,
        retry_interval_ms: None,
        enable_circuit_breaker: None,
        exceptions_allowed_before_breaking: None,
        breaker_seconds: None,
        half_open_probes: None,
        failure_ratio_percent: None,
        sampling_window_seconds: None,
        minimum_throughput: None,
        retry_budget_percent: None,
        retry_budget_min_per_second: None,
        max_concurrent_handling_count: None,
        unhealthy_times_allowed_before_removing: None,
        idempotent: None,
        deadline_slack_ms: None,
    };

    /// Applies this layer on top of `base`.
    pub fn apply_to(&self, base: &mut GovernanceOptions) {
        macro_rules! set {
            ($($f:ident),*) => {$(
                if let Some(v) = &self.$f { base.$f = v.clone(); }
            )*};
        }
        set!(
            shunt_strategy,
            timeout_ms,
            attempt_timeout_ms,
            retry_times,
            retry_interval_ms,
            enable_circuit_breaker,
            exceptions_allowed_before_breaking,
            breaker_seconds,
            half_open_probes,
            failure_ratio_percent,
            sampling_window_seconds,
            minimum_throughput,
            retry_budget_percent,
            retry_budget_min_per_second,
            max_concurrent_handling_count,
            unhealthy_times_allowed_before_removing,
            idempotent,
            deadline_slack_ms
        );
        if let Some(a) = &self.appoint_address {
            base.appoint_address = Some(a.to_string());
        }
    }

    /// Merges a newer layer into this one, field by field: what `newer` sets replaces what is
    /// here, what it leaves `None` stays as it was. Runtime updates of an id combine this way.
    pub fn merge(&mut self, newer: &GovernanceOverrides) {
        let (Ok(Value::Object(mut mine)), Ok(Value::Object(theirs))) =
            (serde_json::to_value(&*self), serde_json::to_value(newer))
        else {
            return;
        };
        for (field, value) in theirs {
            if !value.is_null() {
                mine.insert(field, value);
            }
        }
        if let Ok(merged) = serde_json::from_value(Value::Object(mine)) {
            *self = merged;
        }
    }

    /// Unsets one field (named as in the config file, for example `"timeout_ms"`), so the
    /// layers below decide it again. An unknown name is an error listing the known ones.
    pub fn clear(&mut self, field: &str) -> Result<(), RpcError> {
        let Ok(Value::Object(mut fields)) = serde_json::to_value(&*self) else {
            return Err(RpcError::new(
                StatusCode::FrameworkError,
                "governance overrides could not be represented",
            ));
        };
        match fields.get_mut(field) {
            Some(value) => *value = Value::Null,
            None => {
                let known: Vec<&str> = fields.keys().map(String::as_str).collect();
                return Err(RpcError::new(
                    StatusCode::FrameworkError,
                    format!(
                        "no governance option named {field:?}; the options are: {}",
                        known.join(", ")
                    ),
                ));
            }
        }
        *self = serde_json::from_value(Value::Object(fields)).map_err(|e| {
            RpcError::new(StatusCode::FrameworkError, format!("clearing {field}: {e}"))
        })?;
        Ok(())
    }

    /// `base` with this layer applied.
    pub fn applied(&self, base: &GovernanceOptions) -> GovernanceOptions {
        let mut out = base.clone();
        self.apply_to(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_names_in_code_silky_spellings_on_the_wire_and_in_config() {
        for (text, want) in [
            ("\"polling\"", ShuntStrategy::RoundRobin),
            ("\"round_robin\"", ShuntStrategy::RoundRobin),
            ("\"hash\"", ShuntStrategy::Hash),
            ("\"hash_algorithm\"", ShuntStrategy::Hash),
            ("\"random\"", ShuntStrategy::Random),
            ("\"appoint\"", ShuntStrategy::Appoint),
        ] {
            let got: ShuntStrategy = serde_json::from_str(text).unwrap();
            assert_eq!(got, want, "{text}");
        }
        // Published descriptors keep the spelling older processes read.
        assert_eq!(
            serde_json::to_string(&ShuntStrategy::Hash).unwrap(),
            "\"hash_algorithm\""
        );
        assert_eq!(
            serde_json::to_string(&ShuntStrategy::RoundRobin).unwrap(),
            "\"polling\""
        );
    }

    #[test]
    fn layers_override_only_what_they_set() {
        let base = GovernanceOptions::default();
        let layer = GovernanceOverrides {
            timeout_ms: Some(800),
            idempotent: Some(true),
            ..GovernanceOverrides::NONE
        };
        let out = layer.applied(&base);
        assert_eq!(out.timeout_ms, 800);
        assert!(out.idempotent);
        assert_eq!(out.retry_times, base.retry_times);
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err = toml_like_json(r#"{"timeout_msx": 3}"#).unwrap_err();
        assert!(err.to_string().contains("timeout_msx"), "{err}");
    }

    #[test]
    fn merge_keeps_what_the_newer_layer_leaves_unset() {
        let mut runtime = GovernanceOverrides {
            timeout_ms: Some(800),
            appoint_address: Some("127.0.0.1:9".into()),
            ..GovernanceOverrides::NONE
        };
        runtime.merge(&GovernanceOverrides {
            retry_times: Some(0),
            timeout_ms: Some(900),
            ..GovernanceOverrides::NONE
        });
        let want = GovernanceOverrides {
            timeout_ms: Some(900),
            retry_times: Some(0),
            appoint_address: Some("127.0.0.1:9".into()),
            ..GovernanceOverrides::NONE
        };
        assert_eq!(runtime, want);
    }

    #[test]
    fn clear_unsets_one_field_and_names_unknown_ones() {
        let mut o = GovernanceOverrides {
            timeout_ms: Some(800),
            idempotent: Some(true),
            ..GovernanceOverrides::NONE
        };
        o.clear("timeout_ms").unwrap();
        assert_eq!(
            o,
            GovernanceOverrides {
                idempotent: Some(true),
                ..GovernanceOverrides::NONE
            }
        );
        let e = o.clear("timeout").unwrap_err();
        assert!(
            e.message().contains("\"timeout\"") && e.message().contains("timeout_ms"),
            "{e}"
        );
    }

    fn toml_like_json(s: &str) -> Result<GovernanceOverrides, serde_json::Error> {
        serde_json::from_str(s)
    }
}
