//! Recent governance events of the process, for `GET /api/events` (a bounded ring) and
//! `GET /api/events/stream` (server-sent events, one JSON event per message).
//!
//! The client's and the server's event buses are subscribed to, not observed: their one
//! observer slot belongs to the OpenTelemetry counter. A subscriber that falls more than the
//! bus's capacity behind loses the oldest events; the log counts them
//! (`rpc_admin_events_lost_total`) rather than pretending they did not happen.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use rpc_governance::events::GovernanceEvent;
use serde::Serialize;
use tokio::sync::broadcast;

/// One event as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct EventView {
    /// Increasing from 1 in the order the admin endpoint received the events.
    pub seq: u64,
    /// When the admin endpoint received it, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// `client` or `server`: whose bus it came from.
    pub side: &'static str,
    /// The decision: retry, break, isolate, overflow, ...
    pub kind: &'static str,
    /// The entry.
    pub entry: String,
    /// The endpoint concerned, if any.
    pub endpoint: Option<String>,
    /// The attempt number (0 for a call's first attempt).
    pub attempt: u32,
    /// Why.
    pub cause: Option<String>,
    /// Whether a policy in observe mode only reports what it would have done.
    pub observed: bool,
    /// The rule version the event is about (`rule_applied`, `rule_rejected`).
    pub rule_version: Option<i64>,
}

/// The ring of recent events and the live feed of new ones.
pub(crate) struct EventLog {
    kept: usize,
    ring: Mutex<VecDeque<Arc<EventView>>>,
    seq: AtomicU64,
    live: broadcast::Sender<Arc<EventView>>,
}

impl EventLog {
    /// Keeps the last `kept` events.
    pub(crate) fn new(kept: usize) -> Self {
        EventLog {
            kept: kept.max(1),
            ring: Mutex::new(VecDeque::new()),
            seq: AtomicU64::new(0),
            live: broadcast::Sender::new(1024),
        }
    }

    /// Adds an event of `side`'s bus.
    pub(crate) fn push(&self, side: &'static str, e: &GovernanceEvent) -> Arc<EventView> {
        let view = Arc::new(EventView {
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            time_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            side,
            kind: e.kind.as_str(),
            entry: e.entry.to_string(),
            endpoint: e.endpoint.clone(),
            attempt: e.attempt,
            cause: e.cause.clone(),
            observed: e.observed,
            rule_version: e.rule_version,
        });
        {
            let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            if ring.len() == self.kept {
                ring.pop_front();
            }
            ring.push_back(view.clone());
        }
        let _ = self.live.send(view.clone());
        view
    }

    /// The last `limit` events, oldest first.
    pub(crate) fn recent(&self, limit: usize) -> Vec<Arc<EventView>> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let skip = ring.len().saturating_sub(limit);
        ring.iter().skip(skip).cloned().collect()
    }

    /// How many events the ring keeps.
    pub(crate) fn capacity(&self) -> usize {
        self.kept
    }

    /// Every event pushed from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<EventView>> {
        self.live.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use rpc_governance::events::EventKind;

    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_events_in_order() {
        let log = EventLog::new(3);
        for i in 0..5u32 {
            log.push(
                "client",
                &GovernanceEvent {
                    kind: EventKind::Retry,
                    entry: Arc::from("a.A.m"),
                    endpoint: None,
                    attempt: i,
                    cause: None,
                    observed: false,
                    rule_version: None,
                },
            );
        }
        let attempts: Vec<u32> = log.recent(10).iter().map(|e| e.attempt).collect();
        assert_eq!(attempts, [2, 3, 4]);
        let seqs: Vec<u64> = log.recent(2).iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [4, 5]);
    }
}
