//! The keys and values `#[governance(...)]` accepts, read from the one declaration of the
//! options in rpc-core (`rpc-core/src/options/declared.rs`), which rpc-core turns into
//! `GovernanceOptions`/`GovernanceOverrides`. Including the file, rather than depending on
//! rpc-core, keeps this proc-macro crate's build to syn and quote: rpc-core brings a build
//! script (protobuf generation), tokio and serde, all of which would be built a second time
//! for the host before any crate using the macro could start.

/// What a key takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An unsuffixed non-negative integer literal, at most `max`.
    Int {
        /// The largest value the field holds (or the option allows).
        max: u64,
    },
    /// `key = true | false`; with `bare`, `key` alone means `true`.
    Flag {
        /// Whether `#[governance(key)]` is allowed.
        bare: bool,
    },
    /// A string naming a `ShuntStrategy` (see [`STRATEGIES`]).
    Strategy,
    /// A string naming a `Compression` (see [`COMPRESSIONS`]).
    Compression,
    /// A `host:port` string.
    Address,
}

/// One key of the attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// The key: the field of `GovernanceOverrides`.
    pub name: &'static str,
    /// What it takes.
    pub kind: Kind,
    /// Its policy, for the list of keys in error messages.
    pub group: &'static str,
}

macro_rules! kind {
    (u64) => {
        Kind::Int { max: u64::MAX }
    };
    (u32) => {
        Kind::Int {
            max: u32::MAX as u64,
        }
    };
    (percent) => {
        Kind::Int { max: 100 }
    };
    (flag) => {
        Kind::Flag { bare: false }
    };
    (bare_flag) => {
        Kind::Flag { bare: true }
    };
    (strategy) => {
        Kind::Strategy
    };
    (compression) => {
        Kind::Compression
    };
    (address) => {
        Kind::Address
    };
}

macro_rules! governance_options {
    ($(
        $group:ident {$(
            $(#[doc = $doc:literal])*
            $name:ident : $kind:ident = $default:tt, $side:ident, $meaning:literal;
        )*}
    )*) => {
        /// Every key, grouped by policy, in declaration order.
        pub const KEYS: &[Key] = &[$($(
            Key { name: stringify!($name), kind: kind!($kind), group: stringify!($group) },
        )*)*];
    };
}

macro_rules! shunt_strategy_spellings {
    ($($variant:ident = $first:literal $(| $more:literal)*,)*) => {
        /// Each `ShuntStrategy` variant with its spellings, the usual one first.
        pub const STRATEGIES: &[(&str, &[&str])] = &[
            $((stringify!($variant), &[$first $(, $more)*]),)*
        ];
    };
}

macro_rules! compression_spellings {
    ($($variant:ident = $first:literal $(| $more:literal)*,)*) => {
        /// Each `Compression` variant with its spellings, the usual one first.
        pub const COMPRESSIONS: &[(&str, &[&str])] = &[
            $((stringify!($variant), &[$first $(, $more)*]),)*
        ];
    };
}

include!("../../rpc-core/src/options/declared.rs");

/// The key named `name`.
pub fn key(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.name == name)
}

/// Every key, by policy: `balance: shunt_strategy, appoint_address; timeout: ...`.
pub fn known_keys() -> String {
    let mut out = String::new();
    for (i, k) in KEYS.iter().enumerate() {
        if i == 0 || KEYS[i - 1].group != k.group {
            if i > 0 {
                out.push_str("; ");
            }
            out.push_str(&k.group.to_lowercase());
            out.push_str(": ");
        } else {
            out.push_str(", ");
        }
        out.push_str(k.name);
    }
    out
}

/// The `ShuntStrategy` variant spelled `s`.
pub fn strategy(s: &str) -> Option<&'static str> {
    STRATEGIES
        .iter()
        .find(|(_, spellings)| spellings.contains(&s))
        .map(|(variant, _)| *variant)
}

/// `"polling", "random", "hash" or "appoint"`.
pub fn strategy_names() -> String {
    let names: Vec<String> = STRATEGIES
        .iter()
        .map(|(_, spellings)| format!("{:?}", spellings[0]))
        .collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

/// The `Compression` variant spelled `s`.
pub fn compression(s: &str) -> Option<&'static str> {
    COMPRESSIONS
        .iter()
        .find(|(_, spellings)| spellings.contains(&s))
        .map(|(variant, _)| *variant)
}

/// `"off", "zstd" or "lz4"`.
pub fn compression_names() -> String {
    let names: Vec<String> = COMPRESSIONS
        .iter()
        .map(|(_, spellings)| format!("{:?}", spellings[0]))
        .collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.join(""),
    }
}
