//! Per-entry governance settings.
//!
//! Every option is declared once, in `declared.rs`, read by this crate and by the
//! `#[governance(...)]` attribute of rpc-macros alike: an option added there is a field of
//! [`GovernanceOptions`] with its default, a field of [`GovernanceOverrides`] that every
//! configuration layer can set and clear, a key of the attribute, a line of [`OPTIONS`] and so a
//! row of the README's tables. Nothing else lists the options, so none of these can forget one.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::address::is_endpoint_address;
use crate::{RpcError, StatusCode};

mod compression;
mod descriptor;
mod level;
mod strategy;

pub use compression::Compression;
pub use descriptor::{OptionDescriptor, OptionGroup, OptionKind, OptionSide};
pub use level::OptionLevel;
pub use strategy::ShuntStrategy;

/// The type of an option of each kind in [`GovernanceOptions`].
macro_rules! option_type {
    (u64) => { u64 };
    (u32) => { u32 };
    (percent) => { u32 };
    (flag) => { bool };
    (bare_flag) => { bool };
    (strategy) => { ShuntStrategy };
    (compression) => { Compression };
    (address) => { Option<String> };
}

/// The type an override of each kind holds (inside its `Option`): a `&'static str` fits in a
/// `static` descriptor, a runtime update owns its string.
macro_rules! override_type {
    (address) => { Cow<'static, str> };
    ($kind:ident) => { option_type!($kind) };
}

/// The default written in the declaration, as a value.
macro_rules! default_value {
    (strategy, $d:ident) => {
        ShuntStrategy::$d
    };
    (compression, $d:ident) => {
        Compression::$d
    };
    (address, None) => {
        None
    };
    ($kind:ident, $d:tt) => {
        $d
    };
}

/// The default written in the declaration, as the README shows it.
macro_rules! default_text {
    (strategy, $d:ident) => {
        ShuntStrategy::$d.name()
    };
    (compression, $d:ident) => {
        Compression::$d.name()
    };
    (address, None) => {
        "none"
    };
    ($kind:ident, $d:tt) => {
        stringify!($d)
    };
}

/// An override's value as the option's value.
macro_rules! applied_value {
    (address, $v:expr) => {
        Some($v.to_string())
    };
    ($kind:ident, $v:expr) => {
        *$v
    };
}

/// What a value of each kind must be beyond its type, as an error message when it is not.
macro_rules! value_problem {
    (percent, $name:ident, $v:expr) => {
        (*$v > 100).then(|| {
            format!(
                "{} = {} is out of range: at most 100",
                stringify!($name),
                $v
            )
        })
    };
    (address, $name:ident, $v:expr) => {
        (!is_endpoint_address($v)).then(|| {
            format!(
                "{} = {:?} is not `host:port` (nor `unix:/path`), for example \"127.0.0.1:9000\"",
                stringify!($name),
                $v
            )
        })
    };
    ($kind:ident, $name:ident, $v:expr) => {{
        let _ = $v;
        None::<String>
    }};
}

/// [`value_problem!`] for a field of [`GovernanceOptions`] (an address there is optional).
macro_rules! resolved_value_problem {
    (address, $name:ident, $v:expr) => {
        $v.as_ref().and_then(|v| value_problem!(address, $name, v))
    };
    ($kind:ident, $name:ident, $v:expr) => {
        value_problem!($kind, $name, $v)
    };
}

/// What a kind is to someone writing it.
macro_rules! option_kind {
    (u64) => {
        OptionKind::Int { max: u64::MAX }
    };
    (u32) => {
        OptionKind::Int {
            max: u32::MAX as u64,
        }
    };
    (percent) => {
        OptionKind::Int { max: 100 }
    };
    (flag) => {
        OptionKind::Bool
    };
    (bare_flag) => {
        OptionKind::Bool
    };
    (strategy) => {
        OptionKind::Enum {
            values: ShuntStrategy::NAMES,
        }
    };
    (compression) => {
        OptionKind::Enum {
            values: Compression::NAMES,
        }
    };
    (address) => {
        OptionKind::Str
    };
}

/// Reads `declared.rs`: the options' types, defaults, overrides and descriptors.
macro_rules! governance_options {
    ($(
        $group:ident {$(
            $(#[doc = $doc:literal])*
            $name:ident : $kind:ident = $default:tt, $side:ident, $meaning:literal;
        )*}
    )*) => {
        /// The governance settings of one service entry, after every layer of configuration was
        /// applied. The fields, grouped by policy, are listed with their defaults in [`OPTIONS`].
        #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct GovernanceOptions {$($(
            $(#[doc = $doc])*
            pub $name: option_type!($kind),
        )*)*}

        impl Default for GovernanceOptions {
            fn default() -> Self {
                GovernanceOptions {$($(
                    $name: default_value!($kind, $default),
                )*)*}
            }
        }

        impl GovernanceOptions {
            /// The names of the fields whose values differ from `other`'s, in declaration
            /// order.
            pub fn differing_fields(&self, other: &GovernanceOptions) -> Vec<&'static str> {
                let mut out = Vec::new();
                $($(
                    if self.$name != other.$name {
                        out.push(stringify!($name));
                    }
                )*)*
                out
            }

            /// Checks what the types cannot, as [`GovernanceOverrides::validate`] does (a
            /// program's own defaults, `ClientBuilder::default_options`, are held to the same
            /// ranges as every layer above them).
            pub fn validate(&self) -> Result<(), RpcError> {
                let mut problems: Vec<String> = Vec::new();
                $($(
                    problems.extend(resolved_value_problem!($kind, $name, &self.$name));
                )*)*
                if problems.is_empty() {
                    Ok(())
                } else {
                    Err(RpcError::new(StatusCode::FrameworkError, problems.join("; ")))
                }
            }
        }

        /// A partial set of [`GovernanceOptions`]: what one configuration layer (a
        /// `#[governance(...)]` attribute, a config file section, a runtime update) changes.
        /// `None` keeps the value below.
        #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct GovernanceOverrides {$($(
            #[doc = concat!("See [`GovernanceOptions::", stringify!($name), "`].")]
            // Unset options are left out: a published entry names only what it sets.
            #[serde(skip_serializing_if = "Option::is_none")]
            pub $name: Option<override_type!($kind)>,
        )*)*}

        impl GovernanceOverrides {
            /// Changes nothing. Usable in `const` and `static` items.
            pub const NONE: GovernanceOverrides = GovernanceOverrides {$($(
                $name: None,
            )*)*};

            /// Applies this layer on top of `base`.
            pub fn apply_to(&self, base: &mut GovernanceOptions) {$($(
                if let Some(v) = &self.$name {
                    base.$name = applied_value!($kind, v);
                }
            )*)*}

            /// Merges a newer layer into this one, field by field: what `newer` sets replaces
            /// what is here, what it leaves `None` stays as it was. Runtime updates of an id
            /// combine this way.
            pub fn merge(&mut self, newer: &GovernanceOverrides) {$($(
                if let Some(v) = &newer.$name {
                    self.$name = Some(v.clone());
                }
            )*)*}

            /// The names of the fields this layer sets, in declaration order.
            pub fn set_fields(&self) -> Vec<&'static str> {
                let mut out = Vec::new();
                $($(
                    if self.$name.is_some() {
                        out.push(stringify!($name));
                    }
                )*)*
                out
            }

            /// Checks what the types cannot: a percentage is at most 100, an address is
            /// `host:port`. The error names every value that is wrong, with its key (the
            /// `#[governance(...)]` attribute refuses the same values at compile time).
            pub fn validate(&self) -> Result<(), RpcError> {
                let mut problems: Vec<String> = Vec::new();
                $($(
                    if let Some(v) = &self.$name {
                        problems.extend(value_problem!($kind, $name, v));
                    }
                )*)*
                if problems.is_empty() {
                    Ok(())
                } else {
                    Err(RpcError::new(StatusCode::FrameworkError, problems.join("; ")))
                }
            }

            /// Unsets every field whose value [`validate`](Self::validate) refuses, keeping the
            /// others, and says what was wrong with each: for layers read from peers (the
            /// options servers publish), where one wrong value must not cost the right ones.
            pub fn drop_invalid(&mut self) -> Vec<String> {
                let mut problems: Vec<String> = Vec::new();
                $($(
                    if let Some(problem) = self.$name.as_ref().and_then(|v| value_problem!($kind, $name, v)) {
                        problems.push(problem);
                        self.$name = None;
                    }
                )*)*
                problems
            }

            /// Unsets one field (named as in the config file, for example `"timeout_ms"`), so
            /// the layers below decide it again. An unknown name is an error listing the known
            /// ones.
            pub fn clear(&mut self, field: &str) -> Result<(), RpcError> {
                match field {
                    $($(stringify!($name) => self.$name = None,)*)*
                    _ => {
                        return Err(RpcError::new(
                            StatusCode::FrameworkError,
                            format!(
                                "no governance option named {field:?}; the options are: {}",
                                option_names()
                            ),
                        ))
                    }
                }
                Ok(())
            }
        }

        /// Every governance option, grouped by policy, in declaration order: what the README's
        /// tables, the `#[governance(...)]` attribute and configuration errors list.
        pub const OPTIONS: &[OptionDescriptor] = &[$($(
            OptionDescriptor {
                name: stringify!($name),
                kind: option_kind!($kind),
                group: OptionGroup::$group,
                side: OptionSide::$side,
                default: default_text!($kind, $default),
                meaning: $meaning,
            },
        )*)*];
    };
}

/// Reads the strategies' spellings of `declared.rs`.
macro_rules! shunt_strategy_spellings {
    ($($variant:ident = $first:literal $(| $more:literal)*,)*) => {
        impl ShuntStrategy {
            /// Each strategy's spellings in config files and attributes, the usual one first.
            pub const SPELLINGS: &[(ShuntStrategy, &[&str])] = &[
                $((ShuntStrategy::$variant, &[$first $(, $more)*]),)*
            ];

            /// The usual spelling of each strategy, as messages and the README show them.
            pub const NAMES: &[&str] = &[$($first),*];
        }
    };
}

/// Reads the compression algorithms' spellings of `declared.rs`.
macro_rules! compression_spellings {
    ($($variant:ident = $first:literal $(| $more:literal)*,)*) => {
        impl Compression {
            /// Each algorithm's spellings in config files and attributes, the usual one first.
            pub const SPELLINGS: &[(Compression, &[&str])] = &[
                $((Compression::$variant, &[$first $(, $more)*]),)*
            ];

            /// The usual spelling of each algorithm, as messages and the README show them.
            pub const NAMES: &[&str] = &[$($first),*];
        }
    };
}

include!("declared.rs");

/// The options' names, for error messages.
fn option_names() -> String {
    OPTIONS
        .iter()
        .map(|o| o.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl GovernanceOverrides {
    /// `base` with this layer applied.
    pub fn applied(&self, base: &GovernanceOptions) -> GovernanceOptions {
        let mut out = base.clone();
        self.apply_to(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

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
    fn set_and_differing_fields_name_exactly_the_fields_concerned() {
        let layer = GovernanceOverrides {
            timeout_ms: Some(800),
            shunt_strategy: Some(ShuntStrategy::Hash),
            ..GovernanceOverrides::NONE
        };
        // Declaration order: the balance block comes before the timeout block.
        assert_eq!(layer.set_fields(), ["shunt_strategy", "timeout_ms"]);
        assert!(GovernanceOverrides::NONE.set_fields().is_empty());
        let base = GovernanceOptions::default();
        let changed = GovernanceOptions {
            retry_times: 0,
            idempotent: true,
            ..base.clone()
        };
        assert_eq!(
            changed.differing_fields(&base),
            ["retry_times", "idempotent"]
        );
        assert!(base.differing_fields(&base).is_empty());
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

    #[test]
    fn defaults_are_the_documented_ones() {
        // The defaults the README and the design documents give, written out by hand.
        let want = GovernanceOptions {
            shunt_strategy: ShuntStrategy::RoundRobin,
            appoint_address: None,
            slow_start_ms: 0,
            hash_balance_factor: 0,
            outlier_success_rate: false,
            outlier_interval_ms: 10_000,
            outlier_request_volume: 100,
            outlier_minimum_hosts: 5,
            outlier_stdev_factor_percent: 190,
            outlier_max_ejection_percent: 10,
            outlier_observe: false,
            timeout_ms: 5000,
            attempt_timeout_ms: 0,
            deadline_slack_ms: 50,
            retry_times: 3,
            retry_interval_ms: 50,
            retry_budget_percent: 20,
            retry_budget_min_per_second: 10,
            retry_chain_stop: true,
            idempotent: false,
            throttle_k_percent: 0,
            hedge_delay_ms: 0,
            throttle_observe: false,
            hedge_percentile: 0,
            enable_circuit_breaker: true,
            exceptions_allowed_before_breaking: 3,
            breaker_seconds: 60,
            half_open_probes: 1,
            failure_ratio_percent: 0,
            sampling_window_seconds: 10,
            minimum_throughput: 20,
            breaker_observe: false,
            unhealthy_times_allowed_before_removing: 3,
            max_concurrent_handling_count: 50,
            rate_limit_per_second: 0,
            rate_limit_burst: 10,
            caller_rate_limit_per_second: 0,
            caller_rate_limit_burst: 10,
            rate_limit_observe: false,
            adaptive_concurrency: false,
            adaptive_min_limit: 4,
            admission_observe: false,
            compression: Compression::Off,
            compression_threshold: 1024,
        };
        assert_eq!(GovernanceOptions::default(), want);
    }

    #[test]
    fn every_descriptor_names_a_key_with_its_default_and_kind() {
        let defaults = serde_json::to_value(GovernanceOptions::default()).unwrap();
        let fields = defaults.as_object().unwrap();
        assert_eq!(fields.len(), OPTIONS.len(), "one descriptor per field");
        for o in OPTIONS {
            let value = &fields[o.name];
            // The default text is what the field serializes to.
            let shown = match value {
                Value::Null => "none".to_string(),
                Value::String(s) => match s.parse::<ShuntStrategy>() {
                    Ok(strategy) => strategy.name().to_string(),
                    Err(_) => s.parse::<Compression>().unwrap().name().to_string(),
                },
                other => other.to_string(),
            };
            assert_eq!(shown, o.default, "{}", o.name);
            // The kind says what the key takes: a value of that kind is accepted, and clearing
            // the key by its name works.
            let sample = match o.kind {
                OptionKind::Int { max } => serde_json::json!(max),
                OptionKind::Bool => serde_json::json!(true),
                OptionKind::Str => serde_json::json!("127.0.0.1:9"),
                OptionKind::Enum { values } => serde_json::json!(values[values.len() - 1]),
            };
            let mut layer: GovernanceOverrides =
                serde_json::from_value(serde_json::json!({ o.name: sample }))
                    .unwrap_or_else(|e| panic!("{}: {e}", o.name));
            assert_ne!(layer, GovernanceOverrides::NONE, "{}", o.name);
            layer.clear(o.name).unwrap();
            assert_eq!(layer, GovernanceOverrides::NONE, "{}", o.name);
        }
    }

    #[test]
    fn the_unknown_option_error_lists_every_option() {
        let mut layer = GovernanceOverrides::NONE;
        let e = layer.clear("retries").unwrap_err();
        for o in OPTIONS {
            assert!(e.message().contains(o.name), "{}: {e}", o.name);
        }
    }

    fn toml_like_json(s: &str) -> Result<GovernanceOverrides, serde_json::Error> {
        serde_json::from_str(s)
    }
}
