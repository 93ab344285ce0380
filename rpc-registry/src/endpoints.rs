//! The snapshot of a service's instances that every client reads.
//!
//! A client's consistent-hash ring, its round robin and its failover order all index this list,
//! so two clients agree on where a key goes or which endpoint comes next only if they see the
//! same instances in the same order. Backends list instances in whatever order their store
//! gives (a map, a file, etcd's key order), so the order is not left to them: the only way to
//! make an [`Endpoints`] sorts and deduplicates.

use std::cmp::Ordering;
use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::Instance;

/// A snapshot of a service's instances, in one order every client shares: by address, then by
/// instance id (plain string order, so `"127.0.0.1:10"` comes before `"127.0.0.1:9"`), with at
/// most one instance per instance id.
///
/// Every constructor sorts, so no backend can hand clients an unordered snapshot. Of several
/// instances with one id, the first in that order is kept (the one with the lowest address; on
/// the same address, the lowest by services, then metadata, then entries), so the result does
/// not depend on the order the instances were given in.
///
/// It dereferences to a slice (`eps.iter()`, `eps[0]`, `eps.len()`); cloning it clones one
/// `Arc`. [`ptr_eq`](Self::ptr_eq) tells whether two snapshots are the same one, which is how a
/// client notices that the registry announced a new snapshot without comparing contents.
///
/// ```
/// use std::sync::Arc;
/// use rpc_registry::{Endpoints, Instance};
///
/// let eps = Endpoints::new([
///     Arc::new(Instance::new("127.0.0.1:9002", ["echo.Echo"])),
///     Arc::new(Instance::new("127.0.0.1:9001", ["echo.Echo"])),
///     Arc::new(Instance::new("127.0.0.1:9002", ["echo.Echo"])),
/// ]);
/// let addresses: Vec<&str> = eps.iter().map(|i| i.address.as_str()).collect();
/// assert_eq!(addresses, ["127.0.0.1:9001", "127.0.0.1:9002"]);
/// ```
#[derive(Clone)]
pub struct Endpoints(Arc<[Arc<Instance>]>);

impl Endpoints {
    /// The snapshot of `instances`: sorted by address then instance id, one instance per id.
    pub fn new(instances: impl IntoIterator<Item = Arc<Instance>>) -> Self {
        let mut list: Vec<Arc<Instance>> = instances.into_iter().collect();
        list.sort_by(|a, b| snapshot_order(a, b));
        let mut seen = HashSet::with_capacity(list.len());
        list.retain(|i| seen.insert(i.id.clone()));
        Endpoints(Arc::from(list))
    }

    /// Whether `a` and `b` are the same snapshot (not merely equal ones): true means the
    /// registry has announced nothing new between them. Two snapshots built separately are
    /// never the same, even when equal, except that empty ones may be.
    pub fn ptr_eq(a: &Endpoints, b: &Endpoints) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

/// By address, then instance id; the rest only decides between two versions of one instance
/// at one address, so that which of them is kept does not depend on the input order.
fn snapshot_order(a: &Instance, b: &Instance) -> Ordering {
    a.address
        .cmp(&b.address)
        .then_with(|| a.id.cmp(&b.id))
        .then_with(|| a.services.cmp(&b.services))
        .then_with(|| a.metadata.cmp(&b.metadata))
        .then_with(|| {
            if a.entries == b.entries {
                Ordering::Equal
            } else {
                // Entries have no order of their own; this one is total and stable, and is
                // reached only for conflicting versions of one instance at one address.
                format!("{:?}", a.entries).cmp(&format!("{:?}", b.entries))
            }
        })
}

impl Default for Endpoints {
    /// No instance.
    fn default() -> Self {
        Endpoints::new(std::iter::empty())
    }
}

impl Deref for Endpoints {
    type Target = [Arc<Instance>];

    fn deref(&self) -> &[Arc<Instance>] {
        &self.0
    }
}

impl AsRef<[Arc<Instance>]> for Endpoints {
    fn as_ref(&self) -> &[Arc<Instance>] {
        &self.0
    }
}

impl<'a> IntoIterator for &'a Endpoints {
    type Item = &'a Arc<Instance>;
    type IntoIter = std::slice::Iter<'a, Arc<Instance>>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl FromIterator<Arc<Instance>> for Endpoints {
    /// Same as [`Endpoints::new`].
    fn from_iter<I: IntoIterator<Item = Arc<Instance>>>(iter: I) -> Self {
        Endpoints::new(iter)
    }
}

impl FromIterator<Instance> for Endpoints {
    /// Same as [`Endpoints::new`], wrapping each instance in an `Arc`.
    fn from_iter<I: IntoIterator<Item = Instance>>(iter: I) -> Self {
        Endpoints::new(iter.into_iter().map(Arc::new))
    }
}

impl PartialEq for Endpoints {
    /// Same instances (by value) in the same order.
    fn eq(&self, other: &Self) -> bool {
        Endpoints::ptr_eq(self, other) || self.0[..] == other.0[..]
    }
}

impl Eq for Endpoints {}

impl fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// A small seeded generator (splitmix64): the shuffles are the same on every run.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        /// Fisher-Yates.
        fn shuffle<T>(&mut self, v: &mut [T]) {
            for i in (1..v.len()).rev() {
                v.swap(i, self.below(i + 1));
            }
        }
    }

    fn instance(address: &str, id: &str, shard: &str) -> Arc<Instance> {
        let mut i = Instance::new(address, ["a.A"]);
        i.id = id.to_string();
        i.metadata = BTreeMap::from([("shard".to_string(), shard.to_string())]);
        Arc::new(i)
    }

    fn ids(eps: &Endpoints) -> Vec<(String, String)> {
        eps.iter()
            .map(|i| (i.address.clone(), i.id.clone()))
            .collect()
    }

    #[test]
    fn any_listing_order_gives_the_same_snapshot() {
        let mut rng = Rng(0x5EED_0012);
        for round in 0..200 {
            // Distinct instances: random ports on two hosts (string order differs from numeric
            // order), some sharing an address under different ids.
            let mut unique: Vec<Arc<Instance>> = Vec::new();
            for n in 0..1 + rng.below(12) {
                let host = ["127.0.0.1", "10.0.0.2"][rng.below(2)];
                let address = format!("{host}:{}", 1 + rng.below(30));
                let id = format!("id-{round}-{n}");
                unique.push(instance(&address, &id, "x"));
            }
            // The oracle: a sorted copy, ordered by (address, id) as tuples of strings.
            let mut expected: Vec<(String, String)> = unique
                .iter()
                .map(|i| (i.address.clone(), i.id.clone()))
                .collect();
            expected.sort();

            // The input: the same instances, some listed twice, in a random order.
            let mut input = unique.clone();
            for _ in 0..rng.below(4) {
                let again = unique[rng.below(unique.len())].clone();
                input.push(again);
            }
            for _ in 0..5 {
                rng.shuffle(&mut input);
                let eps = Endpoints::new(input.iter().cloned());
                assert_eq!(
                    ids(&eps),
                    expected,
                    "round {round}, input {:?}",
                    ids_of(&input)
                );
            }
        }
    }

    fn ids_of(list: &[Arc<Instance>]) -> Vec<(&str, &str)> {
        list.iter()
            .map(|i| (i.address.as_str(), i.id.as_str()))
            .collect()
    }

    #[test]
    fn of_two_versions_of_one_id_the_same_one_wins_in_any_order() {
        // One id at two addresses, and two versions at one address differing in metadata: the
        // lowest address wins, then the lowest metadata.
        let versions = [
            instance("127.0.0.1:2", "db", "a"),
            instance("127.0.0.1:1", "db", "c"),
            instance("127.0.0.1:1", "db", "b"),
            instance("127.0.0.1:3", "other", "a"),
        ];
        let mut rng = Rng(7);
        for _ in 0..50 {
            let mut input = versions.to_vec();
            rng.shuffle(&mut input);
            let eps = Endpoints::new(input);
            assert_eq!(eps.len(), 2);
            assert_eq!(eps[0].address, "127.0.0.1:1");
            assert_eq!(eps[0].metadata["shard"], "b");
            assert_eq!(eps[1].id, "other");
        }
    }

    #[test]
    fn identity_is_the_snapshot_not_its_contents() {
        let a = Endpoints::new([instance("127.0.0.1:1", "x", "a")]);
        let b = Endpoints::new([instance("127.0.0.1:1", "x", "a")]);
        let a2 = a.clone();
        assert!(Endpoints::ptr_eq(&a, &a2));
        assert!(!Endpoints::ptr_eq(&a, &b));
        assert_eq!(a, b, "equal contents");
        assert_ne!(a, Endpoints::default());
        assert!(Endpoints::default().is_empty());
        // The slice view callers use.
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].id, "x");
        assert_eq!((&a).into_iter().count(), 1);
    }
}
