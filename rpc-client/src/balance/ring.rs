//! Shunt strategies: choosing one endpoint among a service's live endpoints.
//!
//! The consistent-hash ring is placed by a [`RingKey`] of each instance (its address by
//! default), and built once per registry snapshot, when the snapshot changes, rather than on
//! the call path: a call reads the ring of the current snapshot without taking a lock.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use rand::Rng;
use rpc_core::stable_hash;
use rpc_registry::{Endpoints, Instance};

/// What places an instance on the consistent-hash ring. Clients that should agree on which
/// server owns a key use the same choice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RingKey {
    /// The instance's address (the default): a server that comes back on another port owns
    /// other keys.
    #[default]
    Address,
    /// The instance's id (`ServerBuilder::instance_id`; the address when the server sets
    /// none): a shard that restarts on a new port under the same id keeps its keys.
    InstanceId,
    /// The value of this metadata key (`ServerBuilder::metadata`), such as a shard name; an
    /// instance without it is placed by its address.
    Metadata(String),
}

impl RingKey {
    /// The string that places `instance` on the ring.
    pub fn of<'a>(&self, instance: &'a Instance) -> &'a str {
        match self {
            RingKey::Address => &instance.address,
            RingKey::InstanceId => &instance.id,
            RingKey::Metadata(key) => instance
                .metadata
                .get(key)
                .map_or(instance.address.as_str(), String::as_str),
        }
    }
}

/// The ring of one registry snapshot.
#[derive(Debug)]
pub(crate) struct RingSnapshot {
    /// The snapshot the ring was built from; ring indices index it.
    pub(crate) endpoints: Endpoints,
    pub(crate) ring: HashRing,
}

/// The ring of a service's current snapshot: built when the registry announces a change
/// ([`refresh`](Self::refresh)), read by calls without a lock ([`get`](Self::get)). Nothing is
/// built for a service no call has routed by hash.
#[derive(Debug, Default)]
pub(crate) struct RingCache {
    key: RingKey,
    current: ArcSwapOption<RingSnapshot>,
    builds: AtomicU64,
}

impl RingCache {
    pub(crate) fn new(key: RingKey) -> Self {
        RingCache {
            key,
            ..Default::default()
        }
    }

    /// The ring of `endpoints`. Built here only for the first hash-routed call of a service,
    /// or when a call sees a snapshot before the watch has rebuilt the ring for it.
    pub(crate) fn get(&self, endpoints: &Endpoints) -> Arc<RingSnapshot> {
        if let Some(snapshot) = self.current.load_full() {
            if Endpoints::ptr_eq(&snapshot.endpoints, endpoints) {
                return snapshot;
            }
        }
        self.build(endpoints)
    }

    /// Rebuilds the ring for a new snapshot, if any call uses the ring.
    pub(crate) fn refresh(&self, endpoints: &Endpoints) {
        match self.current.load().as_ref() {
            Some(snapshot) if !Endpoints::ptr_eq(&snapshot.endpoints, endpoints) => {}
            _ => return,
        }
        self.build(endpoints);
    }

    fn build(&self, endpoints: &Endpoints) -> Arc<RingSnapshot> {
        self.builds.fetch_add(1, Ordering::Relaxed);
        let snapshot = Arc::new(RingSnapshot {
            endpoints: endpoints.clone(),
            ring: HashRing::new(endpoints.iter().map(|i| self.key.of(i))),
        });
        self.current.store(Some(snapshot.clone()));
        snapshot
    }

    /// Rings built so far.
    #[cfg(test)]
    pub(crate) fn builds(&self) -> u64 {
        self.builds.load(Ordering::Relaxed)
    }
}

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

/// The most outstanding calls an endpoint may hold under bounded-load hashing, with `total`
/// outstanding over `endpoints` endpoints and a factor of `factor_percent` % of the mean:
/// ⌈factor × (total + 1) / endpoints⌉, the + 1 being the call now placed (as in "Consistent
/// Hashing with Bounded Loads", Mirrokni, Thorup, Zadimoghaddam).
pub fn load_bound(total: usize, endpoints: usize, factor_percent: u32) -> usize {
    let num = u128::from(factor_percent) * (total as u128 + 1);
    let den = 100 * endpoints.max(1) as u128;
    num.div_ceil(den) as usize
}

/// Which endpoints, holding `outstanding[i]` calls each, cannot take one more call without
/// going over the [`load_bound`] of `factor_percent` (0: none is ever over). A factor below
/// 100 % cannot hold (some endpoint always carries the mean), so it acts as 100 %.
pub fn over_bound(outstanding: &[usize], factor_percent: u32) -> Vec<bool> {
    if factor_percent == 0 {
        return vec![false; outstanding.len()];
    }
    let factor = factor_percent.max(100);
    let bound = load_bound(outstanding.iter().sum(), outstanding.len(), factor);
    outstanding.iter().map(|&o| o + 1 > bound).collect()
}

impl HashRing {
    /// The endpoint a call of `key` goes to under bounded load: the first on the walk from
    /// `key` that is not [`over_bound`]; the owner when every one is. `outstanding` holds one
    /// count per endpoint of the ring, in its order; the ring is not empty (an empty ring has
    /// no owner, and answers 0).
    ///
    /// # Panics
    ///
    /// When `outstanding` has fewer counts than the ring has endpoints.
    pub fn owner_bounded(&self, key: u64, outstanding: &[usize], factor_percent: u32) -> usize {
        let over = over_bound(outstanding, factor_percent);
        let mut walk = self.walk(key).peekable();
        let owner = walk.peek().copied().unwrap_or(0);
        walk.find(|&i| !over[i]).unwrap_or(owner)
    }
}

/// Round robin over the acceptable candidates.
///
/// # Panics
///
/// When `candidates` is 0: there is nothing to choose from (the caller checks first).
pub fn polling(counter: &AtomicUsize, candidates: usize) -> usize {
    counter.fetch_add(1, Ordering::Relaxed) % candidates
}

/// Uniformly random among the candidates.
///
/// # Panics
///
/// When `candidates` is 0: there is nothing to choose from (the caller checks first).
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

    fn instance(address: &str, id: &str, shard: Option<&str>) -> Arc<Instance> {
        let mut i = Instance::new(address, ["s.S"]);
        i.id = id.into();
        if let Some(shard) = shard {
            i.metadata.insert("shard".into(), shard.into());
        }
        Arc::new(i)
    }

    #[test]
    fn the_ring_key_chooses_what_places_an_instance() {
        let i = instance("10.0.0.1:7", "db-1", Some("east"));
        assert_eq!(RingKey::Address.of(&i), "10.0.0.1:7");
        assert_eq!(RingKey::InstanceId.of(&i), "db-1");
        assert_eq!(RingKey::Metadata("shard".into()).of(&i), "east");
        assert_eq!(RingKey::Metadata("zone".into()).of(&i), "10.0.0.1:7");
    }

    #[test]
    fn a_ring_is_built_once_per_snapshot_by_the_watch_not_by_the_calls() {
        let cache = RingCache::new(RingKey::Address);
        let first = Endpoints::new([instance("a:1", "a", None)]);
        // No call has used the ring: a new snapshot builds nothing.
        cache.refresh(&first);
        assert_eq!(cache.builds(), 0);
        // The first hash-routed call builds it; later calls of that snapshot share it.
        let ring = cache.get(&first);
        assert!(Arc::ptr_eq(&ring, &cache.get(&first)));
        assert_eq!(cache.builds(), 1);
        // The watch announces a change: the ring is rebuilt there, once, and the calls that
        // follow find it ready.
        let second = Endpoints::new([instance("a:1", "a", None), instance("b:1", "b", None)]);
        cache.refresh(&second);
        cache.refresh(&second);
        assert_eq!(cache.builds(), 2);
        let ring = cache.get(&second);
        assert_eq!(cache.builds(), 2);
        assert_eq!(ring.endpoints.len(), 2);
    }

    #[test]
    fn the_load_bound_is_the_factor_times_the_mean_rounded_up() {
        // 125 % of (8 + 1) / 3 = 3.75: at most 4 calls each.
        assert_eq!(load_bound(8, 3, 125), 4);
        // 100 % of (5 + 1) / 3 = 2 exactly.
        assert_eq!(load_bound(5, 3, 100), 2);
        assert_eq!(
            load_bound(0, 3, 125),
            1,
            "an idle cluster takes a call anywhere"
        );
        // A factor below 100 % acts as 100 %: ⌈(5 + 1) / 3⌉ = 2, so 1 + 1 fits and 2 + 1 not.
        assert_eq!(over_bound(&[1, 2, 2], 50), [false, true, true]);
    }

    #[test]
    fn a_bounded_ring_walks_past_an_owner_over_the_bound() {
        let ring = HashRing::new(["a:1", "b:1", "c:1"].into_iter());
        for k in 0..200u64 {
            let key = stable_hash(&k.to_le_bytes());
            let walk: Vec<usize> = ring.walk(key).collect();
            let (owner, next) = (walk[0], walk[1]);
            // The owner holds 6 of 6 outstanding calls: the bound at 125 % is
            // ⌈1.25 × 7 / 3⌉ = 3, so it cannot take a seventh; the next on the ring can.
            let mut outstanding = [0usize; 3];
            outstanding[owner] = 6;
            assert_eq!(ring.owner_bounded(key, &outstanding, 125), next, "key {k}");
            // Off (factor 0), or under the bound, the owner keeps its key.
            assert_eq!(ring.owner_bounded(key, &outstanding, 0), owner);
            let mut light = [1usize; 3];
            light[owner] = 2;
            // Bound ⌈1.25 × 5 / 3⌉ = 3: the owner's 2 + 1 fits.
            assert_eq!(ring.owner_bounded(key, &light, 125), owner);
            // The owner and the next both full: the third on the ring.
            let mut two = [0usize; 3];
            two[owner] = 6;
            two[next] = 6;
            // Bound ⌈1.25 × 13 / 3⌉ = 6: 6 + 1 is over for both.
            assert_eq!(ring.owner_bounded(key, &two, 125), walk[2]);
        }
    }

    #[test]
    fn polling_cycles() {
        let c = AtomicUsize::new(0);
        let picks: Vec<_> = (0..6).map(|_| polling(&c, 3)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }
}
