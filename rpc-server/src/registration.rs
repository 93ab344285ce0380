//! Which servers of this process publish each instance id, in each registry.
//!
//! A server's handle dropped without `shutdown` deregisters its instance in a task of its own,
//! later; so does a `serve` given up while it registered. A newer server of this process may
//! have published the same id in the same registry meanwhile (a shard restarted under its
//! stable `instance_id`), and registries remove by id: the late deregistration would unpublish
//! the newer server for good, while it reports itself registered and ready. So each
//! publication takes a [`Ticket`] before it registers, and a deregistration goes ahead only
//! while its ticket is the latest of the id in its registry. A deregistration skipped for a
//! newer publication is left to it: should that publication fail to register, it removes the
//! id itself once no publication of the process holds it ([`Ticket::release_unregistered`]).
//!
//! The check and the registry's answer are apart by an `.await` (a registry removes or
//! publishes over the network): a publication registering meanwhile would be removed by the
//! removal decided before it. So the publication of an id and its removal take turns: each
//! holds the id's [`IdLock`] from its check to the registry's answer.
//!
//! Registries are told apart by [`Registry::state_id`]: clones of one registry are one, two
//! `InProcessRegistry`s are two, and so are two `EtcdRegistry` objects on one cluster (each
//! removes only the registrations it made). This covers servers of one process. Two processes publishing one
//! id are the registry's concern (each id is one instance there).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use rpc_registry::Registry;

/// An instance id in one registry (the registry by its [`Registry::state_id`], alive as long
/// as a publication holds it: each ticket's server keeps its registry).
type Key = (usize, String);

/// The publications of one id in one registry.
#[derive(Default)]
struct Holders {
    /// Live publications, oldest first: the last is the latest.
    live: Vec<u64>,
    /// Whether a publication gave up deregistering for a newer one.
    deferred: bool,
}

fn holders() -> std::sync::MutexGuard<'static, HashMap<Key, Holders>> {
    static HOLDERS: OnceLock<Mutex<HashMap<Key, Holders>>> = OnceLock::new();
    HOLDERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

fn key(registry: &Arc<dyn Registry>, id: &str) -> Key {
    (registry.state_id(), id.to_string())
}

/// The turns of the publications and removals of one id in one registry (see the module's
/// documentation): held from a publication's ticket to its registry's answer, and from a
/// removal's check to its registry's answer.
pub(crate) type IdLock = Arc<tokio::sync::Mutex<()>>;

/// The lock of instance `id` in `registry`: one per id while a publication or a removal
/// holds it.
pub(crate) fn id_lock(registry: &Arc<dyn Registry>, id: &str) -> IdLock {
    static LOCKS: OnceLock<Mutex<HashMap<Key, std::sync::Weak<tokio::sync::Mutex<()>>>>> =
        OnceLock::new();
    let mut locks = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let key = key(registry, id);
    if let Some(lock) = locks.get(&key).and_then(std::sync::Weak::upgrade) {
        return lock;
    }
    // (The ids no one holds any more go as a new one comes.)
    locks.retain(|_, lock| lock.strong_count() > 0);
    let lock = IdLock::default();
    locks.insert(key, Arc::downgrade(&lock));
    lock
}

/// One publication of an instance id in a registry by this process.
#[derive(Debug)]
pub(crate) struct Ticket {
    key: Key,
    n: u64,
    /// The id's turns, for its removal.
    lock: IdLock,
}

impl Ticket {
    /// Taken before the instance `id` is registered in `registry` (with its `lock` held until
    /// the registry answers): from now on it is the latest, so an older server's late
    /// deregistration leaves the id alone.
    pub(crate) fn take(registry: &Arc<dyn Registry>, id: &str, lock: IdLock) -> Ticket {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let key = key(registry, id);
        holders().entry(key.clone()).or_default().live.push(n);
        Ticket { key, n, lock }
    }

    /// Waits for the id's turn: held from the check whether to remove the id to the
    /// registry's answer, no publication of the id goes on meanwhile.
    pub(crate) async fn turn(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.lock.clone().lock_owned().await
    }

    /// Whether to deregister: no later publication of the id took its place. When one did, the
    /// deregistration is left to it.
    pub(crate) fn should_deregister(&self) -> bool {
        let mut holders = holders();
        let Some(h) = holders.get_mut(&self.key) else {
            return true;
        };
        let latest = h.live.last() == Some(&self.n);
        if !latest {
            h.deferred = true;
        }
        latest
    }

    /// The publication ended (deregistered, or its deregistration left to a newer one).
    pub(crate) fn release(&self) {
        self.remove(false);
    }

    /// The publication ended without its registration having landed for sure (a `serve`
    /// given up while it registered): whether to deregister the id, which the registry may
    /// have taken, that is whether no other publication of the process holds it now.
    pub(crate) fn release_given_up(&self) -> bool {
        // The id may hold this publication's registration: should the others end
        // unregistered, the last of them removes it.
        !matches!(self.remove(true), Removal::OthersHold)
    }

    /// The registration failed: whether to deregister the id all the same, that is whether an
    /// older publication left its deregistration to this one and none holds the id now.
    pub(crate) fn release_unregistered(&self) -> bool {
        matches!(self.remove(false), Removal::Last { deferred: true })
    }

    /// Takes this publication out (again, harmlessly, after a release); `defer`: when others
    /// hold the id, its removal is left to the last of them (in the same hold of the lock, so
    /// that none ends in between unaware of it).
    fn remove(&self, defer: bool) -> Removal {
        let mut holders = holders();
        let Some(h) = holders.get_mut(&self.key) else {
            return Removal::Last { deferred: false };
        };
        h.live.retain(|&n| n != self.n);
        if !h.live.is_empty() {
            h.deferred |= defer;
            return Removal::OthersHold;
        }
        let deferred = h.deferred;
        holders.remove(&self.key);
        Removal::Last { deferred }
    }
}

impl Drop for Ticket {
    /// A publication whose server is gone without releasing it (aborted, or its drop's task
    /// never ran on a runtime shutting down) holds the id no more.
    fn drop(&mut self) {
        self.remove(false);
    }
}

/// What taking a publication out left.
enum Removal {
    /// Other publications of the process still hold the id.
    OthersHold,
    /// None does; `deferred`: one gave up deregistering it for a newer one.
    Last { deferred: bool },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ticket of `id` in `r`, with the id's lock.
    fn take(r: &Arc<dyn Registry>, id: &str) -> Ticket {
        Ticket::take(r, id, id_lock(r, id))
    }
    use rpc_registry::InProcessRegistry;

    fn registry() -> Arc<dyn Registry> {
        Arc::new(InProcessRegistry::new())
    }

    #[test]
    fn only_the_latest_publication_of_an_id_deregisters_it() {
        let r = registry();
        let old = take(&r, "shard-1");
        let new = take(&r, "shard-1");
        assert!(!old.should_deregister(), "a newer server holds the id");
        old.release();
        assert!(new.should_deregister(), "the older one's release leaves it");
        new.release();
        let other = take(&r, "shard-2");
        assert!(other.should_deregister());
    }

    #[test]
    fn an_id_in_another_registry_is_another_publication() {
        let (r1, r2) = (registry(), registry());
        let a = take(&r1, "node-1");
        let b = take(&r2, "node-1");
        assert!(a.should_deregister(), "b is in another registry");
        assert!(b.should_deregister());
    }

    /// A registry of a type that does not tell its objects apart (`state_id`'s default): two
    /// of its objects are one registry, as clones handed to two servers must be.
    #[test]
    fn objects_of_a_registry_without_a_state_id_are_one_registry() {
        struct Plain;
        impl Registry for Plain {
            fn register(
                &self,
                _: rpc_registry::Instance,
            ) -> futures_util::future::BoxFuture<'_, Result<(), rpc_registry::RegistryError>>
            {
                Box::pin(async { Ok(()) })
            }
            fn deregister<'a>(
                &'a self,
                _: &'a str,
            ) -> futures_util::future::BoxFuture<'a, Result<(), rpc_registry::RegistryError>>
            {
                Box::pin(async { Ok(()) })
            }
            fn watch<'a>(
                &'a self,
                _: &'a rpc_core::ServiceId,
            ) -> futures_util::future::BoxFuture<
                'a,
                Result<rpc_registry::ServiceWatch, rpc_registry::RegistryError>,
            > {
                Box::pin(async { Err(rpc_registry::RegistryError::Closed) })
            }
            fn services(
                &self,
            ) -> futures_util::future::BoxFuture<
                '_,
                Result<Vec<rpc_core::ServiceId>, rpc_registry::RegistryError>,
            > {
                Box::pin(async { Ok(Vec::new()) })
            }
        }
        let (a, b): (Arc<dyn Registry>, Arc<dyn Registry>) = (Arc::new(Plain), Arc::new(Plain));
        let old = take(&a, "plain-1");
        let _new = take(&b, "plain-1");
        assert!(!old.should_deregister(), "the newer server holds the id");
    }

    /// A publication dropped without a release (its server aborted) holds the id no more.
    #[test]
    fn a_dropped_ticket_holds_the_id_no_more() {
        let r = registry();
        drop(take(&r, "shard-3"));
        let given_up = take(&r, "shard-3");
        assert!(given_up.release_given_up(), "nobody else holds it");
    }

    #[test]
    fn a_failed_registration_removes_what_an_older_publication_left_to_it() {
        let r = registry();
        let old = take(&r, "shard-1");
        let new = take(&r, "shard-1");
        assert!(!old.should_deregister());
        old.release();
        assert!(
            new.release_unregistered(),
            "the old registration is nobody's now"
        );
        // With the older publication still serving, its registration stays.
        let old = take(&r, "shard-1");
        let new = take(&r, "shard-1");
        assert!(!new.release_unregistered());
        assert!(old.should_deregister(), "the older one is the latest again");
        // Nothing left to it: a failed registration removes nothing.
        old.release();
        let alone = take(&r, "shard-1");
        assert!(!alone.release_unregistered());
    }

    #[test]
    fn a_given_up_registration_is_removed_unless_another_publication_holds_the_id() {
        let r = registry();
        let serving = take(&r, "shard-1");
        let given_up = take(&r, "shard-1");
        assert!(!given_up.release_given_up());
        assert!(serving.should_deregister());
        serving.release();
        let given_up = take(&r, "shard-1");
        assert!(given_up.release_given_up());
    }

    /// A publication given up while another holds the id (its registration may have landed)
    /// leaves the id's removal to it: should that one end unregistered, it removes the id.
    #[test]
    fn a_publication_given_up_beside_another_leaves_it_the_removal() {
        let r = registry();
        let retry = take(&r, "shard-1");
        let given_up = take(&r, "shard-1");
        assert!(!given_up.release_given_up());
        assert!(retry.release_unregistered(), "the id is removed");
    }
}
