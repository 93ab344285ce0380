//! What is known about each option besides its value: its kind, policy, side, default and
//! meaning. One table of these ([`OPTIONS`](super::OPTIONS)) is what documentation, error
//! messages and tools read, so that none of them keeps its own list.

/// One governance option, as [`OPTIONS`](crate::OPTIONS) describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionDescriptor {
    /// The name: the field of [`GovernanceOptions`](crate::GovernanceOptions), the TOML key and
    /// the `#[governance(...)]` key.
    pub name: &'static str,
    /// What values it takes.
    pub kind: OptionKind,
    /// The policy it belongs to.
    pub group: OptionGroup,
    /// Which side applies it.
    pub side: OptionSide,
    /// The default, as written in a config file (`"none"` when unset).
    pub default: &'static str,
    /// One line on what it does, as the README's options table shows it.
    pub meaning: &'static str,
}

/// The values an option takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionKind {
    /// A non-negative integer up to `max`.
    Int {
        /// The largest value.
        max: u64,
    },
    /// `true` or `false`.
    Bool,
    /// A string (an address).
    Str,
    /// One of these names.
    Enum {
        /// The usual spelling of each value.
        values: &'static [&'static str],
    },
}

/// The policy an option belongs to, in the order the pipeline meets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OptionGroup {
    /// Endpoint choice.
    Balance,
    /// Deadlines.
    Timeout,
    /// Retries, their budget and failover.
    Retry,
    /// The circuit breaker.
    Breaker,
    /// Endpoint health and ejection.
    Health,
    /// The server's admission cap.
    Admission,
    /// Compression of the payloads on the wire.
    Compression,
}

impl OptionGroup {
    /// The policy's name in documentation.
    pub const fn title(self) -> &'static str {
        match self {
            OptionGroup::Balance => "balance",
            OptionGroup::Timeout => "timeout",
            OptionGroup::Retry => "retry",
            OptionGroup::Breaker => "breaker",
            OptionGroup::Health => "health",
            OptionGroup::Admission => "admission",
            OptionGroup::Compression => "compression",
        }
    }
}

/// Which side of a call applies an option.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OptionSide {
    /// The caller's pipeline.
    Client,
    /// The server, on the calls it handles.
    Server,
    /// Both.
    Both,
}
