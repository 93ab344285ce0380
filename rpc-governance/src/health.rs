//! Endpoint health as one client sees it: local, expiring marks that are never written to a
//! registry.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

/// Local marks on endpoints that failed at the transport level.
///
/// A failure makes the endpoint unhealthy for a time that doubles with each consecutive failure
/// (1 s, 2 s, 4 s, ... up to `max_backoff`); a success clears the mark. Clients prefer healthy
/// endpoints and use unhealthy ones only when nothing else is left.
#[derive(Debug)]
pub struct EndpointHealth {
    marks: DashMap<String, Mark>,
    /// How many marks exist: lets the hot path skip the map (whose `is_empty` locks every
    /// shard) when every endpoint is healthy.
    marked: AtomicUsize,
    max_backoff: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Mark {
    until: Instant,
    consecutive: u32,
    removed: bool,
}

impl EndpointHealth {
    /// Marks expire after at most `max_backoff`.
    pub fn new(max_backoff: Duration) -> Self {
        EndpointHealth {
            marks: DashMap::new(),
            marked: AtomicUsize::new(0),
            max_backoff,
        }
    }

    /// Records a transport failure of `addr`; returns how many failed in a row. After
    /// `remove_after` failures in a row (0: never) the endpoint is removed: it is chosen only
    /// when nothing else is left, until [`restore`](Self::restore) (the registry announced it
    /// again) or a success.
    pub fn failure(&self, addr: &str, remove_after: u32) -> u32 {
        let now = Instant::now();
        let mut mark = self.marks.entry(addr.to_string()).or_insert_with(|| {
            self.marked.fetch_add(1, Ordering::Release);
            Mark {
                until: now,
                consecutive: 0,
                removed: false,
            }
        });
        mark.consecutive += 1;
        if remove_after > 0 && mark.consecutive >= remove_after {
            mark.removed = true;
        }
        let backoff =
            Duration::from_secs(1u64 << (mark.consecutive - 1).min(16)).min(self.max_backoff);
        mark.until = now + backoff;
        tracing::debug!(
            target: "rpc::governance",
            endpoint = addr,
            consecutive = mark.consecutive,
            backoff_ms = backoff.as_millis() as u64,
            "endpoint marked unhealthy"
        );
        mark.consecutive
    }

    /// Records a success of `addr`: its mark is cleared.
    pub fn success(&self, addr: &str) {
        if !self.is_clear() && self.marks.remove(addr).is_some() {
            self.marked.fetch_sub(1, Ordering::Release);
        }
    }

    /// Whether no endpoint carries a mark (the common case: nothing to check).
    pub fn is_clear(&self) -> bool {
        self.marked.load(Ordering::Acquire) == 0
    }

    /// Whether `addr` was removed after repeated failures.
    pub fn is_removed(&self, addr: &str) -> bool {
        !self.is_clear() && self.marks.get(addr).is_some_and(|m| m.removed)
    }

    /// The registry announced `addr` again: it is no longer removed (its backoff mark stays).
    pub fn restore(&self, addr: &str) {
        if let Some(mut m) = self.marks.get_mut(addr) {
            m.removed = false;
            m.consecutive = 0;
        }
    }

    /// Whether `addr` has no unexpired mark.
    pub fn is_healthy(&self, addr: &str) -> bool {
        if self.is_clear() {
            return true;
        }
        match self.marks.get(addr) {
            None => true,
            Some(m) => Instant::now() >= m.until,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn marks_grow_and_expire() {
        let h = EndpointHealth::new(Duration::from_secs(3));
        assert!(h.is_healthy("a"));
        h.failure("a", 0);
        assert!(!h.is_healthy("a"));
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert!(h.is_healthy("a"));
        h.failure("a", 0); // second in a row: 2 s
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(!h.is_healthy("a"));
        tokio::time::advance(Duration::from_millis(600)).await;
        assert!(h.is_healthy("a"));
        h.failure("a", 0);
        h.failure("a", 0); // would be 8 s, capped at 3 s
        tokio::time::advance(Duration::from_millis(3001)).await;
        assert!(h.is_healthy("a"));
        h.success("a");
        h.failure("a", 0);
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert!(h.is_healthy("a"), "success reset the count");
    }

    #[tokio::test(start_paused = true)]
    async fn removal_after_n_in_a_row_until_announced_again() {
        let h = EndpointHealth::new(Duration::from_secs(60));
        assert_eq!(h.failure("a", 3), 1);
        assert_eq!(h.failure("a", 3), 2);
        assert!(!h.is_removed("a"), "not after n - 1");
        assert_eq!(h.failure("a", 3), 3);
        assert!(h.is_removed("a"));
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(h.is_removed("a"), "removal does not expire by itself");
        h.restore("a");
        assert!(!h.is_removed("a"));
    }
}
