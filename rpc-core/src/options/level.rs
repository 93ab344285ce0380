//! Where the value of an option in force came from.
//!
//! An entry's options are resolved from several levels of configuration, each overriding the
//! one below. An operator looking at a value (an admin endpoint, a console) needs to know which
//! level set it, to know where to change it: a value fixed by a per-call handle cannot be
//! changed from the config file, and a runtime update hides the file's value until cleared.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A level of configuration, lowest first: each overrides the ones before it. The order of the
/// variants is the order of precedence (`OptionLevel::File < OptionLevel::Runtime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptionLevel {
    /// The framework's default, as declared with the option.
    Default,
    /// The program's own defaults (`ClientBuilder::default_options`), where they differ from
    /// the framework's.
    Code,
    /// The method's `#[governance(...)]` attribute.
    Attribute,
    /// The entry descriptors the serving instances publish to the registry.
    Published,
    /// The config file.
    File,
    /// The `RPC_GOVERNANCE` environment variable.
    Env,
    /// The governance document of the config centre (etcd).
    Centre,
    /// Updates made while running (`Client::update_options`).
    Runtime,
    /// The options of one call's handle (`Client::with_options`).
    Call,
}

impl OptionLevel {
    /// Every level, lowest first.
    pub const ALL: [OptionLevel; 9] = [
        OptionLevel::Default,
        OptionLevel::Code,
        OptionLevel::Attribute,
        OptionLevel::Published,
        OptionLevel::File,
        OptionLevel::Env,
        OptionLevel::Centre,
        OptionLevel::Runtime,
        OptionLevel::Call,
    ];

    /// The level's name, as JSON and tables show it.
    pub fn as_str(self) -> &'static str {
        match self {
            OptionLevel::Default => "default",
            OptionLevel::Code => "code",
            OptionLevel::Attribute => "attribute",
            OptionLevel::Published => "published",
            OptionLevel::File => "file",
            OptionLevel::Env => "env",
            OptionLevel::Centre => "centre",
            OptionLevel::Runtime => "runtime",
            OptionLevel::Call => "call",
        }
    }
}

impl fmt::Display for OptionLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_by_precedence_and_named_as_serialized() {
        let mut sorted = OptionLevel::ALL;
        sorted.sort();
        assert_eq!(sorted, OptionLevel::ALL);
        assert!(
            OptionLevel::Env < OptionLevel::Centre && OptionLevel::Centre < OptionLevel::Runtime
        );
        for level in OptionLevel::ALL {
            let json = serde_json::to_string(&level).unwrap();
            assert_eq!(json, format!("\"{}\"", level.as_str()));
        }
    }
}
