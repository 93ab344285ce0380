//! Where an entry's options come from, lowest first: code defaults < `#[governance(...)]` on the
//! method < what the serving instances publish < config file < environment (`RPC_GOVERNANCE`)
//! < the config centre (the governance document of the rule store in etcd) < runtime updates
//! (< a call's own options, applied by the client over these).

use std::collections::HashMap;
use std::path::Path;

use rpc_core::options::OptionLevel;
use rpc_core::{
    GovernanceOptions, GovernanceOverrides, MethodDescriptor, RpcError, ShuntStrategy, StatusCode,
    OPTIONS,
};
use serde::Deserialize;

/// The environment variable read by [`GovernanceConfig::from_env`].
pub const ENV_VAR: &str = "RPC_GOVERNANCE";

/// One configuration layer: overrides for every entry, per service and per entry (the more
/// specific wins). The config file is this in TOML:
///
/// ```toml
/// [defaults]
/// timeout_ms = 3000
///
/// [services."echo.Echo"]
/// retry_times = 1
///
/// [entries."echo.Echo.echo"]
/// idempotent = true
/// shunt_strategy = "hash"
/// ```
///
/// The environment variable `RPC_GOVERNANCE` holds the same document, with `;` allowed in place
/// of line breaks: `RPC_GOVERNANCE='entries."echo.Echo.echo".timeout_ms = 800; defaults.retry_times = 1'`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GovernanceConfig {
    /// Applies to every entry.
    #[serde(default)]
    pub defaults: GovernanceOverrides,
    /// Per service id.
    #[serde(default)]
    pub services: HashMap<String, GovernanceOverrides>,
    /// Per entry id.
    #[serde(default)]
    pub entries: HashMap<String, GovernanceOverrides>,
}

fn config_error(what: impl std::fmt::Display) -> RpcError {
    RpcError::new(StatusCode::FrameworkError, what.to_string())
}

impl GovernanceConfig {
    /// Parses the TOML form.
    pub fn from_toml(text: &str) -> Result<Self, RpcError> {
        let config: Self =
            toml::from_str(text).map_err(|e| config_error(format!("governance config: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every section's values beyond their types (a percentage above 100, an address
    /// that is not `host:port`), naming the section of each wrong value.
    pub fn validate(&self) -> Result<(), RpcError> {
        let mut sections: Vec<(String, &GovernanceOverrides)> =
            vec![("[defaults]".to_string(), &self.defaults)];
        for (kind, map) in [("services", &self.services), ("entries", &self.entries)] {
            let mut ids: Vec<&String> = map.keys().collect();
            ids.sort();
            for id in ids {
                sections.push((format!("[{kind}.{id:?}]"), &map[id]));
            }
        }
        let problems: Vec<String> = sections
            .into_iter()
            .filter_map(|(section, o)| {
                o.validate()
                    .err()
                    .map(|e| format!("{section} {}", e.message()))
            })
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(config_error(format!(
                "governance config: {}; change these values: nothing of this document is applied",
                problems.join("; ")
            )))
        }
    }

    /// Reads and parses a TOML file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, RpcError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            config_error(format!(
                "cannot read governance config {}: {e}",
                path.display()
            ))
        })?;
        Self::from_toml(&text)
            .map_err(|e| config_error(format!("{}: {}", path.display(), e.message())))
    }

    /// Parses `RPC_GOVERNANCE`; an unset variable is an empty layer, one that is not UTF-8 an
    /// error.
    pub fn from_env() -> Result<Self, RpcError> {
        match std::env::var(ENV_VAR) {
            Ok(v) => Self::from_toml(&v.replace(';', "\n")).map_err(|e| {
                config_error(format!(
                    "{ENV_VAR} (where each ';' starts a line): {}",
                    e.message()
                ))
            }),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(config_error(format!(
                "{ENV_VAR} is not UTF-8 text: write the governance document in UTF-8, or unset it"
            ))),
        }
    }

    /// Sets (merging into what is there) the overrides for a service id when `is_service`,
    /// else for an entry id. [`apply`](Self::apply) looks a method up by its service id among
    /// the services and by its entry id among the entries, so an id set in the other map
    /// matches nothing.
    pub fn set(&mut self, id: &str, overrides: GovernanceOverrides, is_service: bool) {
        let map = if is_service {
            &mut self.services
        } else {
            &mut self.entries
        };
        map.entry(id.to_string()).or_default().merge(&overrides);
    }

    /// The fields this layer sets for `method`, in any of its sections.
    pub fn fields_set_for(&self, method: &MethodDescriptor) -> Vec<&'static str> {
        let mut out = self.defaults.set_fields();
        for o in [
            self.services.get(method.service_id),
            self.entries.get(method.entry_id),
        ]
        .into_iter()
        .flatten()
        {
            out.extend(o.set_fields());
        }
        out
    }

    /// Applies this layer (defaults, then the service's section, then the entry's).
    pub fn apply(&self, method: &MethodDescriptor, options: &mut GovernanceOptions) {
        self.apply_ids(method.service_id, method.entry_id, options);
    }

    /// [`apply`](Self::apply) by the ids alone.
    fn apply_ids(&self, service_id: &str, entry_id: &str, options: &mut GovernanceOptions) {
        self.defaults.apply_to(options);
        if let Some(o) = self.services.get(service_id) {
            o.apply_to(options);
        }
        if let Some(o) = self.entries.get(entry_id) {
            o.apply_to(options);
        }
    }
}

/// Every layer of configuration, resolved into an entry's options by [`resolve`](Self::resolve):
/// code defaults < the method's attribute < what the serving instances publish < config file <
/// environment < config centre < runtime updates.
#[derive(Debug, Clone, Default)]
pub struct Layers {
    /// What the program sets as the starting point (the builder's defaults).
    pub code_defaults: GovernanceOptions,
    /// The entry descriptors servers publish to the registry (their `#[governance(...)]`
    /// attributes): defaults a client uses unless its own configuration says otherwise.
    pub published: GovernanceConfig,
    /// The config file.
    pub file: GovernanceConfig,
    /// `RPC_GOVERNANCE`.
    pub env: GovernanceConfig,
    /// The config centre: the governance document in force from the rule store (etcd),
    /// replaced whole by each new valid version.
    pub centre: GovernanceConfig,
    /// Updates made while running.
    pub runtime: GovernanceConfig,
}

impl Layers {
    /// The options in force for `method`.
    ///
    /// A strategy the config centre's document gives an entry that cannot carry it out
    /// (consistent hashing without a `#[hash_key]` argument, appoint without an address) is
    /// left out for that entry, which keeps the strategy of the layers below
    /// ([`centre_left_out`](Self::centre_left_out) says why): one document serves many
    /// clients and services, and every client must apply it alike, whether or not it has
    /// called the entry yet.
    pub fn resolve(&self, method: &MethodDescriptor) -> GovernanceOptions {
        self.resolve_noting(method).0
    }

    /// The options in force for `method`, and whether the config centre's strategy was left
    /// out: the centre decides the strategy (it sets it and no runtime update does), and the
    /// options with it, runtime updates included, cannot be carried out. The centre's other
    /// options apply either way.
    fn resolve_noting(&self, method: &MethodDescriptor) -> (GovernanceOptions, bool) {
        let below = self.below_centre(method);
        let mut o = below.clone();
        self.centre.apply(method, &mut o);
        self.runtime.apply(method, &mut o);
        if unfit(method, &o).is_none() || !self.centre_decides_strategy(method) {
            return (o, false);
        }
        let mut kept = below;
        let strategy = kept.shunt_strategy;
        self.centre.apply(method, &mut kept);
        kept.shunt_strategy = strategy;
        self.runtime.apply(method, &mut kept);
        (kept, true)
    }

    /// The options of entry `entry_id` of `service_id` before the entry has a descriptor (a
    /// generic call looking its service up, for its deadline): every layer's, as
    /// [`resolve`](Self::resolve) reads them for an entry without a method attribute (a
    /// generic call has none), short of `resolve`'s check that the config centre's strategy
    /// can be carried out (which needs the descriptor, and concerns the strategy only).
    pub fn by_ids(&self, service_id: &str, entry_id: &str) -> GovernanceOptions {
        let mut o = self.code_defaults.clone();
        for layer in [
            &self.published,
            &self.file,
            &self.env,
            &self.centre,
            &self.runtime,
        ] {
            layer.apply_ids(service_id, entry_id, &mut o);
        }
        o
    }

    /// The options the layers below the config centre give `method`.
    fn below_centre(&self, method: &MethodDescriptor) -> GovernanceOptions {
        let mut o = method.governance.applied(&self.code_defaults);
        self.published.apply(method, &mut o);
        self.file.apply(method, &mut o);
        self.env.apply(method, &mut o);
        o
    }

    /// Whether the config centre's layer sets `method`'s strategy and no runtime update does.
    fn centre_decides_strategy(&self, method: &MethodDescriptor) -> bool {
        let sets =
            |layer: &GovernanceConfig| layer.fields_set_for(method).contains(&"shunt_strategy");
        sets(&self.centre) && !sets(&self.runtime)
    }

    /// Why the config centre's document asks `method` for a strategy it cannot carry out,
    /// which [`resolve`](Self::resolve) leaves out: what a client says of a document it
    /// applies, and what an editor refuses to write ([`check`](Self::check)).
    pub fn centre_left_out(&self, method: &MethodDescriptor) -> Option<RpcError> {
        if !self.resolve_noting(method).1 {
            return None;
        }
        let mut asked = self.below_centre(method);
        self.centre.apply(method, &mut asked);
        self.runtime.apply(method, &mut asked);
        unfit(method, &asked).map(|why| why.error(method, CENTRE))
    }

    /// For every option of `method`, in declaration order, the level that set the value
    /// [`resolve`](Self::resolve) gives it: the highest layer that sets the field, or
    /// [`OptionLevel::Code`] where the program's defaults differ from the framework's, or else
    /// [`OptionLevel::Default`].
    pub fn levels(&self, method: &MethodDescriptor) -> Vec<(&'static str, OptionLevel)> {
        let mut levels: Vec<(&'static str, OptionLevel)> = OPTIONS
            .iter()
            .map(|o| (o.name, OptionLevel::Default))
            .collect();
        let mut raise = |fields: Vec<&'static str>, level: OptionLevel| {
            for (name, at) in levels.iter_mut() {
                if fields.contains(name) {
                    *at = level;
                }
            }
        };
        raise(
            self.code_defaults
                .differing_fields(&GovernanceOptions::default()),
            OptionLevel::Code,
        );
        raise(method.governance.set_fields(), OptionLevel::Attribute);
        // A strategy the centre asks for and the entry cannot carry out is left out: the
        // layers below still set it.
        let left_out = self.resolve_noting(method).1;
        for (layer, level) in [
            (&self.published, OptionLevel::Published),
            (&self.file, OptionLevel::File),
            (&self.env, OptionLevel::Env),
            (&self.centre, OptionLevel::Centre),
            (&self.runtime, OptionLevel::Runtime),
        ] {
            let mut fields = layer.fields_set_for(method);
            if left_out && level == OptionLevel::Centre {
                fields.retain(|f| *f != "shunt_strategy");
            }
            raise(fields, level);
        }
        levels
    }

    /// Checks that the options these layers give `method` can be carried out: consistent
    /// hashing needs a `#[hash_key]` argument to hash (without one, every call would quietly
    /// go round robin), and an appointed endpoint needs its address (without one, every call
    /// would fail). The error names the entry and the layer that asked for the strategy. A
    /// strategy the config centre asks for and [`resolve`](Self::resolve) leaves out is an
    /// error here too: what an editor checks before it writes a document.
    pub fn check(&self, method: &MethodDescriptor) -> Result<(), RpcError> {
        self.check_in_force(method)?;
        self.centre_left_out(method).map_or(Ok(()), Err)
    }

    /// [`check`](Self::check) of the options in force only (what calls meet), with the
    /// config centre's strategy left out where `method` cannot carry it out.
    pub fn check_in_force(&self, method: &MethodDescriptor) -> Result<(), RpcError> {
        match unfit(method, &self.resolve(method)) {
            None => Ok(()),
            Some(why) => Err(why.error(method, self.strategy_source(method))),
        }
    }

    /// The highest layer that sets `method`'s strategy in force: the one to change.
    fn strategy_source(&self, method: &MethodDescriptor) -> &'static str {
        let left_out = self.resolve_noting(method).1;
        let mut o = method.governance.applied(&self.code_defaults);
        let mut source = if method.governance.shunt_strategy.is_some() {
            "the method's #[governance] attribute"
        } else {
            "the client's default options"
        };
        for (layer, name) in [
            (&self.published, "the descriptors its servers publish"),
            (&self.file, "the config file"),
            (&self.env, "RPC_GOVERNANCE"),
            (&self.centre, CENTRE),
            (&self.runtime, "a runtime update"),
        ] {
            if left_out && name == CENTRE {
                continue;
            }
            let before = o.shunt_strategy;
            layer.apply(method, &mut o);
            let sets = [
                Some(&layer.defaults),
                layer.services.get(method.service_id),
                layer.entries.get(method.entry_id),
            ]
            .into_iter()
            .flatten()
            .any(|x| x.shunt_strategy.is_some());
            if sets || o.shunt_strategy != before {
                source = name;
            }
        }
        source
    }
}

/// How [`Layers::check`] names the config centre's layer.
const CENTRE: &str = "the governance rules in the config centre";

/// What keeps an entry from carrying out the strategy its options ask for.
#[derive(Debug, Clone, Copy)]
enum Unfit {
    /// `appoint` with no address to appoint.
    NoAddress,
    /// `hash` for a method without a `#[hash_key]` argument.
    NoHashKey,
}

/// Why `method` cannot carry out the strategy of `o`, if it cannot.
fn unfit(method: &MethodDescriptor, o: &GovernanceOptions) -> Option<Unfit> {
    match o.shunt_strategy {
        ShuntStrategy::Appoint if o.appoint_address.as_deref().is_none_or(str::is_empty) => {
            Some(Unfit::NoAddress)
        }
        ShuntStrategy::Hash if method.hash_key.is_none() => Some(Unfit::NoHashKey),
        _ => None,
    }
}

impl Unfit {
    /// The error naming `method`'s entry and the layer (`source`) that asked for the strategy.
    fn error(self, method: &MethodDescriptor, source: &str) -> RpcError {
        let message = match self {
            Unfit::NoAddress => format!(
                "{}: shunt_strategy = appoint (set by {source}) needs appoint_address = \
                 \"host:port\", the address every call goes to; set it beside the strategy, or \
                 choose another strategy for this entry",
                method.entry_id
            ),
            Unfit::NoHashKey => format!(
                "{}: shunt_strategy = hash (set by {source}) needs an argument marked \
                 #[hash_key], and {} has none; mark the argument to hash on, or choose another \
                 strategy for this entry",
                method.entry_id, method.method
            ),
        };
        RpcError::new(StatusCode::FrameworkError, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static M: MethodDescriptor = MethodDescriptor {
        service_id: "echo.Echo",
        method: "echo",
        entry_id: "echo.Echo.echo",
        hash_key: None,
        governance: GovernanceOverrides {
            timeout_ms: Some(800),
            retry_times: Some(2),
            ..GovernanceOverrides::NONE
        },
        api: None,
    };

    /// A method of the same service with a `#[hash_key]` argument.
    static KEYED: MethodDescriptor = MethodDescriptor {
        service_id: "echo.Echo",
        method: "profile",
        entry_id: "echo.Echo.profile",
        hash_key: Some(0),
        governance: GovernanceOverrides::NONE,
        api: None,
    };

    #[test]
    fn each_layer_overrides_the_one_below() {
        let mut layers = Layers::default();
        // Code defaults < attribute.
        assert_eq!(layers.resolve(&M).timeout_ms, 800);
        assert_eq!(layers.resolve(&M).retry_interval_ms, 50);
        // < what servers publish.
        layers.published.entries.insert(
            "echo.Echo.echo".into(),
            GovernanceOverrides {
                timeout_ms: Some(850),
                ..GovernanceOverrides::NONE
            },
        );
        assert_eq!(layers.resolve(&M).timeout_ms, 850);
        // < file (service section < entry section).
        layers.file = GovernanceConfig::from_toml(
            "[defaults]\nretry_interval_ms = 7\n[services.\"echo.Echo\"]\ntimeout_ms = 900\nretry_times = 5\n\
             [entries.\"echo.Echo.echo\"]\ntimeout_ms = 1000\nshunt_strategy = \"hash\"\n",
        )
        .unwrap();
        let o = layers.resolve(&M);
        assert_eq!(
            (o.timeout_ms, o.retry_times, o.retry_interval_ms),
            (1000, 5, 7)
        );
        assert_eq!(o.shunt_strategy, rpc_core::ShuntStrategy::Hash);
        // < environment.
        layers.env =
            GovernanceConfig::from_toml("entries.\"echo.Echo.echo\".timeout_ms = 1100").unwrap();
        assert_eq!(layers.resolve(&M).timeout_ms, 1100);
        // < config centre.
        layers.centre = GovernanceConfig::from_toml(
            "[services.\"echo.Echo\"]\ntimeout_ms = 1150\nretry_interval_ms = 8\n",
        )
        .unwrap();
        assert_eq!(layers.resolve(&M).timeout_ms, 1150);
        assert_eq!(layers.resolve(&M).retry_interval_ms, 8);
        // < runtime.
        layers.runtime.set(
            "echo.Echo.echo",
            GovernanceOverrides {
                timeout_ms: Some(1200),
                ..GovernanceOverrides::NONE
            },
            false,
        );
        assert_eq!(layers.resolve(&M).timeout_ms, 1200);
        assert_eq!(
            layers.resolve(&M).retry_times,
            5,
            "untouched fields keep lower layers"
        );
    }

    #[test]
    fn each_field_reports_the_highest_level_that_set_it() {
        let layers = Layers {
            code_defaults: GovernanceOptions {
                retry_interval_ms: 75,
                ..GovernanceOptions::default()
            },
            file: GovernanceConfig::from_toml(
                "[defaults]\nbreaker_seconds = 9\n[services.\"echo.Echo\"]\nretry_times = 5\n",
            )
            .unwrap(),
            env: GovernanceConfig::from_toml("entries.\"echo.Echo.echo\".retry_times = 4").unwrap(),
            runtime: {
                let mut c = GovernanceConfig::default();
                c.set(
                    "echo.Echo.echo",
                    GovernanceOverrides {
                        idempotent: Some(true),
                        ..GovernanceOverrides::NONE
                    },
                    false,
                );
                c
            },
            ..Layers::default()
        };
        let levels: HashMap<&str, OptionLevel> = layers.levels(&M).into_iter().collect();
        // Written out from the layers above: M's attribute sets timeout_ms and retry_times.
        assert_eq!(levels["timeout_ms"], OptionLevel::Attribute);
        assert_eq!(levels["retry_times"], OptionLevel::Env);
        assert_eq!(levels["breaker_seconds"], OptionLevel::File);
        assert_eq!(levels["retry_interval_ms"], OptionLevel::Code);
        assert_eq!(levels["idempotent"], OptionLevel::Runtime);
        assert_eq!(levels["hedge_delay_ms"], OptionLevel::Default);
        assert_eq!(levels.len(), OPTIONS.len());
    }

    #[test]
    fn compression_travels_through_the_levels_like_any_option() {
        let layers = Layers {
            file: GovernanceConfig::from_toml("[defaults]\ncompression = \"lz4\"\n").unwrap(),
            env: GovernanceConfig::from_toml(
                "entries.\"echo.Echo.echo\".compression_threshold = 4096",
            )
            .unwrap(),
            ..Layers::default()
        };
        let o = layers.resolve(&M);
        assert_eq!(
            (o.compression, o.compression_threshold),
            (rpc_core::Compression::Lz4, 4096)
        );
        let levels: HashMap<&str, OptionLevel> = layers.levels(&M).into_iter().collect();
        assert_eq!(levels["compression"], OptionLevel::File);
        assert_eq!(levels["compression_threshold"], OptionLevel::Env);
        let e = GovernanceConfig::from_toml("[defaults]\ncompression = \"gzip\"\n").unwrap_err();
        assert!(
            e.message().contains("gzip") && e.message().contains("zstd"),
            "{e}"
        );
    }

    #[test]
    fn hashing_without_a_hash_key_is_refused_naming_the_entry_and_the_layer() {
        let mut layers = Layers {
            file: GovernanceConfig::from_toml(
                "[services.\"echo.Echo\"]\nshunt_strategy = \"hash\"\n",
            )
            .unwrap(),
            ..Layers::default()
        };
        assert!(layers.check(&KEYED).is_ok());
        let e = layers.check(&M).unwrap_err();
        assert!(
            e.message().contains("echo.Echo.echo")
                && e.message().contains("#[hash_key]")
                && e.message().contains("config file"),
            "{e}"
        );
        assert!(!e.message().contains("  "), "one space between words: {e}");
        layers.runtime.set(
            "echo.Echo.echo",
            GovernanceOverrides {
                shunt_strategy: Some(rpc_core::ShuntStrategy::RoundRobin),
                ..GovernanceOverrides::NONE
            },
            false,
        );
        assert!(layers.check(&M).is_ok());
    }

    #[test]
    fn appointing_without_an_address_is_refused_naming_the_entry() {
        let mut layers = Layers {
            file: GovernanceConfig::from_toml(
                "[services.\"echo.Echo\"]\nshunt_strategy = \"appoint\"\n",
            )
            .unwrap(),
            ..Layers::default()
        };
        let e = layers.check(&M).unwrap_err();
        assert!(
            e.message().contains("echo.Echo.echo") && e.message().contains("appoint_address"),
            "{e}"
        );
        layers.runtime.set(
            "echo.Echo",
            GovernanceOverrides {
                appoint_address: Some("127.0.0.1:9000".into()),
                ..GovernanceOverrides::NONE
            },
            true,
        );
        assert!(layers.check(&M).is_ok());
    }

    /// The centre's strategy is left out for the entry that cannot carry it out only: the
    /// entry keeps the file's strategy (and reports it as the file's), the keyed entry hashes,
    /// the rest of the document applies to both, and the strict check names the centre.
    #[test]
    fn a_centre_strategy_an_entry_cannot_carry_out_is_left_out_for_that_entry_only() {
        let layers = Layers {
            file: GovernanceConfig::from_toml(
                "[defaults]
shunt_strategy = \"random\"\n",
            )
            .unwrap(),
            centre: GovernanceConfig::from_toml(
                "[services.\"echo.Echo\"]\nshunt_strategy = \"hash\"\ntimeout_ms = 4321\n",
            )
            .unwrap(),
            ..Layers::default()
        };
        let (keyed, keyless) = (layers.resolve(&KEYED), layers.resolve(&M));
        assert_eq!(
            (keyed.shunt_strategy, keyed.timeout_ms),
            (ShuntStrategy::Hash, 4321)
        );
        assert_eq!(
            (keyless.shunt_strategy, keyless.timeout_ms),
            (ShuntStrategy::Random, 4321)
        );
        let levels: HashMap<_, _> = layers.levels(&M).into_iter().collect();
        assert_eq!(levels["shunt_strategy"], OptionLevel::File);
        assert_eq!(levels["timeout_ms"], OptionLevel::Centre);
        assert!(layers.check_in_force(&M).is_ok());
        assert!(layers.check(&KEYED).is_ok());
        let e = layers.check(&M).unwrap_err();
        assert!(
            e.message().contains("echo.Echo.echo")
                && e.message().contains("#[hash_key]")
                && e.message().contains("config centre"),
            "{e}"
        );
        // Appoint with no address anywhere: left out too.
        let appointing = Layers {
            centre: GovernanceConfig::from_toml(
                "[entries.\"echo.Echo.echo\"]\nshunt_strategy = \"appoint\"\n",
            )
            .unwrap(),
            ..Layers::default()
        };
        assert_eq!(
            appointing.resolve(&M).shunt_strategy,
            ShuntStrategy::RoundRobin
        );
        let e = appointing.check(&M).unwrap_err();
        assert!(
            e.message().contains("appoint_address") && e.message().contains("config centre"),
            "{e}"
        );
        // ... unless a runtime update gives the address: then it is carried out.
        let mut addressed = appointing.clone();
        addressed.runtime.set(
            "echo.Echo.echo",
            GovernanceOverrides {
                appoint_address: Some("127.0.0.1:9000".into()),
                ..GovernanceOverrides::NONE
            },
            false,
        );
        assert_eq!(addressed.resolve(&M).shunt_strategy, ShuntStrategy::Appoint);
        assert!(addressed.check(&M).is_ok());
        // A centre that sets no strategy is not blamed for the one below it.
        let below = Layers {
            file: GovernanceConfig::from_toml("[defaults]\nshunt_strategy = \"hash\"\n").unwrap(),
            centre: GovernanceConfig::from_toml("[defaults]\nappoint_address = \"127.0.0.1:1\"\n")
                .unwrap(),
            ..Layers::default()
        };
        assert!(below.centre_left_out(&M).is_none());
        let e = below.check(&M).unwrap_err();
        assert!(e.message().contains("set by the config file"), "{e}");
    }

    #[test]
    fn broken_config_is_a_clear_error() {
        let e = GovernanceConfig::from_toml("[entries.\"a.A.m\"]\ntimeout = 3").unwrap_err();
        assert!(e.message().contains("timeout"), "{e}");
        let e = GovernanceConfig::from_toml("[defaults]\nretry_times = -1").unwrap_err();
        assert!(e.message().contains("retry_times"), "{e}");
        let e = GovernanceConfig::from_file("/nonexistent/gov.toml").unwrap_err();
        assert!(e.message().contains("/nonexistent/gov.toml"), "{e}");
    }

    #[test]
    fn values_the_attribute_refuses_are_refused_in_config_naming_the_section() {
        let e = GovernanceConfig::from_toml(
            "[defaults]\nfailure_ratio_percent = 100\n\
             [entries.\"a.A.m\"]\nfailure_ratio_percent = 101\n\
             [services.\"a.A\"]\nappoint_address = \"nowhere\"\n",
        )
        .unwrap_err();
        assert_eq!(
            e.message(),
            "governance config: [services.\"a.A\"] appoint_address = \"nowhere\" is not \
             `host:port` (nor `unix:/path`), for example \"127.0.0.1:9000\"; [entries.\"a.A.m\"] \
             failure_ratio_percent = 101 is out of range: at most 100; change these values: \
             nothing of this document is applied"
        );
        let ok = GovernanceConfig::from_toml(
            "[defaults]\nfailure_ratio_percent = 100\nappoint_address = \"127.0.0.1:9000\"\n",
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn env_form_allows_semicolons() {
        let c = GovernanceConfig::from_toml(
            &"defaults.retry_times = 1; entries.\"a.A.m\".idempotent = true".replace(';', "\n"),
        )
        .unwrap();
        assert_eq!(c.defaults.retry_times, Some(1));
        assert_eq!(c.entries["a.A.m"].idempotent, Some(true));
    }

    #[test]
    fn attempt_timeout_is_an_option_of_every_layer() {
        let c = GovernanceConfig::from_toml(
            "[defaults]\nattempt_timeout_ms = 250\n[entries.\"echo.Echo.echo\"]\nattempt_timeout_ms = 90\n",
        )
        .unwrap();
        assert_eq!(c.defaults.attempt_timeout_ms, Some(250));
        let layers = Layers {
            file: c,
            ..Default::default()
        };
        assert_eq!(layers.resolve(&M).attempt_timeout_ms, 90);
    }
}
