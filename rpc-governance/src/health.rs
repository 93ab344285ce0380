//! Endpoint health as one client sees it: local, expiring marks that are never written to a
//! registry.

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
    max_backoff: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Mark {
    until: Instant,
    consecutive: u32,
}

impl EndpointHealth {
    /// Marks expire after at most `max_backoff`.
    pub fn new(max_backoff: Duration) -> Self {
        EndpointHealth {
            marks: DashMap::new(),
            max_backoff,
        }
    }

    /// Records a transport failure of `addr`; returns how many failed in a row.
    pub fn failure(&self, addr: &str) -> u32 {
        let now = Instant::now();
        let mut mark = self.marks.entry(addr.to_string()).or_insert(Mark {
            until: now,
            consecutive: 0,
        });
        mark.consecutive += 1;
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
        if !self.marks.is_empty() {
            self.marks.remove(addr);
        }
    }

    /// Whether `addr` has no unexpired mark.
    pub fn is_healthy(&self, addr: &str) -> bool {
        if self.marks.is_empty() {
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
        h.failure("a");
        assert!(!h.is_healthy("a"));
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert!(h.is_healthy("a"));
        h.failure("a"); // second in a row: 2 s
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(!h.is_healthy("a"));
        tokio::time::advance(Duration::from_millis(600)).await;
        assert!(h.is_healthy("a"));
        h.failure("a");
        h.failure("a"); // would be 8 s, capped at 3 s
        tokio::time::advance(Duration::from_millis(3001)).await;
        assert!(h.is_healthy("a"));
        h.success("a");
        h.failure("a");
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert!(h.is_healthy("a"), "success reset the count");
    }
}
