//! Shunt strategies: choosing one endpoint among a service's live endpoints.

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;
use rpc_core::stable_hash;

/// Virtual nodes per endpoint on the consistent-hash ring.
pub const VIRTUAL_NODES: usize = 160;

/// A consistent-hash ring over a list of addresses, with [`VIRTUAL_NODES`] points per address
/// placed by [`stable_hash`], so every client builds the same ring from the same addresses.
#[derive(Debug, Clone)]
pub struct HashRing {
    points: Vec<(u64, usize)>,
}

impl HashRing {
    /// Builds the ring; point `i` of address `a` sits at `stable_hash("a#i")`.
    pub fn new<'a>(addresses: impl Iterator<Item = &'a str>) -> Self {
        let mut points = Vec::new();
        for (idx, addr) in addresses.enumerate() {
            for v in 0..VIRTUAL_NODES {
                points.push((stable_hash(format!("{addr}#{v}").as_bytes()), idx));
            }
        }
        points.sort_unstable();
        HashRing { points }
    }

    /// Indices of the addresses in ring order starting at `key`: the owner first, then the next
    /// distinct addresses clockwise (where a failed call goes next).
    pub fn walk(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|(h, _)| *h < key);
        let n = self.points.len();
        let mut seen: Vec<usize> = Vec::new();
        (0..n).filter_map(move |i| {
            let idx = self.points[(start + i) % n].1;
            if seen.contains(&idx) {
                None
            } else {
                seen.push(idx);
                Some(idx)
            }
        })
    }
}

/// Round robin over the acceptable candidates.
pub fn polling(counter: &AtomicUsize, candidates: usize) -> usize {
    counter.fetch_add(1, Ordering::Relaxed) % candidates
}

/// Uniformly random among the candidates.
pub fn random(candidates: usize) -> usize {
    rand::rng().random_range(0..candidates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_is_stable_and_spreads_keys() {
        let addrs = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"];
        let a = HashRing::new(addrs.iter().copied());
        let b = HashRing::new(addrs.iter().copied());
        let mut counts = [0usize; 3];
        for k in 0..3000u64 {
            let key = stable_hash(&k.to_le_bytes());
            let owner = a.walk(key).next().unwrap();
            assert_eq!(owner, b.walk(key).next().unwrap());
            counts[owner] += 1;
        }
        for c in counts {
            assert!(c > 600, "uneven spread {counts:?}");
        }
        let walk: Vec<_> = a.walk(42).collect();
        assert_eq!(walk.len(), 3, "the walk visits every address once");
    }

    #[test]
    fn removing_a_node_moves_only_its_keys() {
        let full = HashRing::new(["a:1", "b:1", "c:1"].into_iter());
        let less = HashRing::new(["a:1", "c:1"].into_iter());
        for k in 0..1000u64 {
            let key = stable_hash(&k.to_le_bytes());
            let before = ["a:1", "b:1", "c:1"][full.walk(key).next().unwrap()];
            let after = ["a:1", "c:1"][less.walk(key).next().unwrap()];
            if before != "b:1" {
                assert_eq!(before, after);
            }
        }
    }

    #[test]
    fn polling_cycles() {
        let c = AtomicUsize::new(0);
        let picks: Vec<_> = (0..6).map(|_| polling(&c, 3)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }
}
