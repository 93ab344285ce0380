//! The stable hash behind consistent hashing.

/// A hash that every process, build and platform computes alike (XXH3, 64 bits, seed 0), so that
/// two clients send the same key to the same server.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn is_stable() {
        // Fixed reference value: changing the algorithm would move every key to another server.
        assert_eq!(super::stable_hash(b""), 0x2d06800538d394c2);
        assert_ne!(super::stable_hash(b"a"), super::stable_hash(b"b"));
    }
}
