//! The `compression` option: which algorithm a service entry's payloads are compressed with.
//! Its spellings come from `declared.rs`, shared with the `#[governance(compression = "...")]`
//! attribute; its wire numbers are those of the `Compression` enum of `proto/rpc.proto`.

use serde::{Deserialize, Serialize};

/// How an entry's payloads (parameters, results) are compressed on the wire: not at all, with
/// Zstandard, or with LZ4. Payloads smaller than `compression_threshold` are always sent
/// plain, and so is every payload to a peer that did not list the algorithm in its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// No compression.
    #[default]
    Off,
    /// Zstandard (level 1): the better ratio.
    Zstd,
    /// LZ4 (block format, size prepended): the faster one.
    Lz4,
}

impl Compression {
    /// The usual spelling: `off`, `zstd` or `lz4`.
    pub const fn name(self) -> &'static str {
        // Indexes follow the order of `compression_spellings!` in `declared.rs`, which the
        // tests check.
        Self::NAMES[self as usize]
    }

    /// The number of the algorithm on the wire (`Compression` of `proto/rpc.proto`).
    pub const fn to_wire(self) -> i32 {
        match self {
            Compression::Off => crate::wire::Compression::None as i32,
            Compression::Zstd => crate::wire::Compression::Zstd as i32,
            Compression::Lz4 => crate::wire::Compression::Lz4 as i32,
        }
    }

    /// The algorithm numbered `n` on the wire; `None` for a number this version does not know.
    pub const fn from_wire(n: i32) -> Option<Compression> {
        match n {
            0 => Some(Compression::Off),
            1 => Some(Compression::Zstd),
            2 => Some(Compression::Lz4),
            _ => None,
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::SPELLINGS
            .iter()
            .find(|(_, spellings)| spellings.contains(&s))
            .map(|(c, _)| *c)
            .ok_or_else(|| {
                format!(
                    "unknown compression {s:?}: expected {}",
                    Self::NAMES.join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_names_and_wire_numbers_agree() {
        for (c, spellings) in Compression::SPELLINGS {
            assert_eq!(c.name(), spellings[0]);
            for s in *spellings {
                let by_serde: Compression = serde_json::from_value(serde_json::json!(s))
                    .unwrap_or_else(|e| panic!("{s}: {e}"));
                assert_eq!(by_serde, *c, "{s}");
                assert_eq!(s.parse::<Compression>(), Ok(*c), "{s}");
            }
            assert_eq!(Compression::from_wire(c.to_wire()), Some(*c));
        }
        // The numbers of proto/rpc.proto.
        assert_eq!(
            [Compression::Off, Compression::Zstd, Compression::Lz4].map(Compression::to_wire),
            [0, 1, 2]
        );
        assert_eq!(Compression::from_wire(3), None);
        let e = "gzip".parse::<Compression>().unwrap_err();
        assert_eq!(e, "unknown compression \"gzip\": expected off, zstd, lz4");
    }
}
