//! Which server of this process published each instance id last.
//!
//! A server's handle dropped without `shutdown` deregisters its instance in a task of its own,
//! later; so does a `serve` given up while it registered. A newer server of this process may
//! have published the same id meanwhile (a shard restarted under its stable `instance_id`), and
//! registries remove by id: the late deregistration would unpublish the newer server for good,
//! while it reports itself registered and ready. So each publication takes a [`Ticket`], and a
//! deregistration goes ahead only while its ticket is still the latest for the id.
//!
//! This covers servers of one process. Two processes publishing one id are the registry's
//! concern (each id is one instance there).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

/// The latest ticket of each instance id published by this process.
fn latest() -> std::sync::MutexGuard<'static, HashMap<String, u64>> {
    static LATEST: OnceLock<Mutex<HashMap<String, u64>>> = OnceLock::new();
    LATEST
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// One publication of an instance id by this process.
#[derive(Debug)]
pub(crate) struct Ticket {
    id: String,
    n: u64,
}

impl Ticket {
    /// Taken once the instance `id` is registered: from now on it is the latest.
    pub(crate) fn take(id: &str) -> Ticket {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        latest().insert(id.to_string(), n);
        Ticket {
            id: id.to_string(),
            n,
        }
    }

    /// Whether a publication of `id` by this process holds it now (a server serving under it).
    pub(crate) fn is_held(id: &str) -> bool {
        latest().contains_key(id)
    }

    /// Whether to deregister: no later publication of the id took its place.
    pub(crate) fn is_latest(&self) -> bool {
        latest().get(&self.id) == Some(&self.n)
    }

    /// Deregistered: the id is this process's no more, unless a later publication holds it.
    pub(crate) fn release(&self) {
        let mut latest = latest();
        if latest.get(&self.id) == Some(&self.n) {
            latest.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_latest_publication_of_an_id_deregisters_it() {
        let old = Ticket::take("shard-test-1");
        let new = Ticket::take("shard-test-1");
        assert!(!old.is_latest(), "a newer server holds the id");
        old.release();
        assert!(new.is_latest(), "the older one's release leaves it");
        new.release();
        assert!(!new.is_latest(), "released");
        let other = Ticket::take("shard-test-2");
        assert!(other.is_latest());
    }
}
