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

use futures_util::{Stream, StreamExt};
use rpc_governance::events::GovernanceEvent;
use serde::Serialize;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

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
    /// This log's own mark (random), in the ids it gives readers (`<boot>-<seq>`): an id of
    /// another log (a process before a restart) is known as such.
    boot: u64,
    kept: usize,
    ring: Mutex<VecDeque<Arc<EventView>>>,
    seq: AtomicU64,
    live: broadcast::Sender<Arc<EventView>>,
}

impl EventLog {
    /// Keeps the last `kept` events.
    pub(crate) fn new(kept: usize) -> Self {
        EventLog {
            // Distinct per log, within a process as across restarts.
            boot: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            kept: kept.max(1),
            ring: Mutex::new(VecDeque::new()),
            seq: AtomicU64::new(0),
            live: broadcast::Sender::new(1024),
        }
    }

    /// Adds an event of `side`'s bus. Its number is taken, and it is kept and sent to the
    /// followers, under the ring's lock: the client's and the server's buses are relayed by
    /// tasks of their own, and the numbers must follow the order both the ring and the
    /// followers see.
    pub(crate) fn push(&self, side: &'static str, e: &GovernanceEvent) -> Arc<EventView> {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
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
        if ring.len() == self.kept {
            ring.pop_front();
        }
        ring.push_back(view.clone());
        let _ = self.live.send(view.clone());
        view
    }

    /// `missed` events of a bus went by unrelayed (its relay fell behind): their numbers are
    /// skipped, so that readers see the gap and are told of it, rather than a run of numbers
    /// that hides it.
    pub(crate) fn skip(&self, missed: u64) {
        let _ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        self.seq.fetch_add(missed, Ordering::Relaxed);
    }

    /// The last `limit` events, oldest first.
    pub(crate) fn recent(&self, limit: usize) -> Vec<Arc<EventView>> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let skip = ring.len().saturating_sub(limit);
        ring.iter().skip(skip).cloned().collect()
    }

    /// What the ids of this log's events for readers of the live feed (the SSE `id`) begin
    /// with: the event's number follows; [`after`](Self::after) reads them back.
    pub(crate) fn id_prefix(&self) -> String {
        format!("{:x}-", self.boot)
    }

    /// The number of the event a reader's `Last-Event-ID` names, when it is one of this log's
    /// ids; 0 (everything kept) for an id of another log (a process before a restart: all this
    /// one logged is new to the reader); `None` for any other text.
    pub(crate) fn after(&self, id: &str) -> Option<u64> {
        let (boot, seq) = id.trim().split_once('-')?;
        let boot = u64::from_str_radix(boot, 16).ok()?;
        let seq: u64 = seq.parse().ok()?;
        Some(if boot == self.boot { seq } else { 0 })
    }

    /// How many events the ring keeps.
    pub(crate) fn capacity(&self) -> usize {
        self.kept
    }

    /// Every event pushed from now on, until `stop` is cancelled; a follower that falls more
    /// than the feed's capacity (1024 events) behind is told how many it missed, then gets
    /// the events that follow, and so is one after events the log itself missed
    /// ([`skip`](Self::skip)): any gap in the numbers is told.
    ///
    /// A follower that read up to event `after` before (a reader reconnecting, with the SSE
    /// `Last-Event-ID`) first gets the kept events after it, then the live ones: nothing in
    /// between is lost or repeated, since the ring is read and the feed subscribed under the
    /// lock `push` numbers and sends under. When the ring no longer holds every event after
    /// `after`, the follower is told how many it missed first. An `after` beyond the last
    /// number given is taken as no `after` (ids of another log are sorted out by
    /// [`after`](Self::after)).
    pub(crate) fn follow(
        &self,
        after: Option<u64>,
        stop: CancellationToken,
    ) -> impl Stream<Item = Live> + use<> {
        use broadcast::error::RecvError;
        let (seen, backlog, rx) = {
            let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            let rx = self.live.subscribe();
            let last = self.seq.load(Ordering::Relaxed);
            match after.filter(|a| *a <= last) {
                Some(after) => {
                    let kept = ring.iter().filter(|e| e.seq > after).cloned();
                    (after, kept.collect::<Vec<_>>(), rx)
                }
                None => (last, Vec::new(), rx),
            }
        };
        // (A follower that lagged behind the feed sees the gap in the numbers of the events
        // that follow, and is told of it then, as of any other gap.)
        let live = futures_util::stream::unfold((rx, stop), |(mut rx, stop)| async move {
            loop {
                let next = tokio::select! {
                    biased;
                    _ = stop.cancelled() => return None,
                    next = rx.recv() => next,
                };
                match next {
                    Ok(e) => return Some((e, (rx, stop))),
                    Err(RecvError::Lagged(_)) => continue,
                    Err(RecvError::Closed) => return None,
                }
            }
        });
        // Each event, after the count of those missed before it (the numbers it skips past
        // the last one the follower had).
        let mut seen = seen;
        futures_util::stream::iter(backlog)
            .chain(live)
            .flat_map(move |e| {
                let missed = e.seq.saturating_sub(seen + 1);
                seen = seen.max(e.seq);
                let missed = (missed > 0).then_some(Live::Missed(missed));
                futures_util::stream::iter(missed.into_iter().chain([Live::Event(e)]))
            })
    }
}

/// What a follower of the live feed gets next ([`EventLog::follow`]).
#[derive(Debug)]
pub(crate) enum Live {
    /// The next event.
    Event(Arc<EventView>),
    /// This many events went by while the follower was behind (the ring keeps the newest).
    Missed(u64),
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

    fn retry(attempt: u32) -> GovernanceEvent {
        GovernanceEvent {
            kind: EventKind::Retry,
            entry: Arc::from("a.A.m"),
            endpoint: None,
            attempt,
            cause: None,
            observed: false,
            rule_version: None,
        }
    }

    /// Events a relay missed (its bus went on past it) leave a gap in the numbers, which a
    /// follower is told of before the events after it, live or read back from the ring.
    /// Before, the numbers ran on as if nothing was missed, and no follower heard of it.
    #[tokio::test]
    async fn events_a_relay_missed_are_told_to_followers() {
        use futures_util::StreamExt;
        let log = EventLog::new(16);
        log.push("client", &retry(0));
        let live = log.follow(None, CancellationToken::new());
        let from_start = log.follow(Some(0), CancellationToken::new());
        log.skip(5);
        log.push("client", &retry(1));
        // The first `n` items a follower gets, as text (bounded: a follower told less waits).
        async fn told(follower: impl Stream<Item = Live>, n: usize) -> Vec<String> {
            let items = follower.take(n).collect::<Vec<_>>();
            let items = tokio::time::timeout(std::time::Duration::from_secs(10), items)
                .await
                .expect("the follower was told fewer items");
            items
                .into_iter()
                .map(|l| match l {
                    Live::Event(e) => format!("event {}", e.seq),
                    Live::Missed(n) => format!("missed {n}"),
                })
                .collect()
        }
        assert_eq!(told(live, 2).await, ["missed 5", "event 7"]);
        assert_eq!(
            told(from_start, 3).await,
            ["event 1", "missed 5", "event 7"]
        );
        // Read back from the ring later, the same.
        let again = log.follow(Some(0), CancellationToken::new());
        assert_eq!(told(again, 3).await, ["event 1", "missed 5", "event 7"]);
    }

    /// Events pushed from two threads at once (the client's and the server's relays) are
    /// numbered in the order the ring keeps them and the followers get them.
    #[test]
    fn numbers_follow_the_order_of_the_ring_and_of_the_feed() {
        const EACH: u32 = 20_000;
        let log = Arc::new(EventLog::new(2 * EACH as usize));
        let mut feed = log.live.subscribe();
        let pushers: Vec<_> = ["client", "server"]
            .into_iter()
            .map(|side| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        log.push(side, &retry(i));
                    }
                })
            })
            .collect();
        // The feed's order, as far as this reader keeps up (it skips what it falls behind on).
        let mut fed = Vec::new();
        let mut last = 0;
        while last < u64::from(2 * EACH) {
            match feed.try_recv() {
                Ok(e) => {
                    last = e.seq;
                    fed.push(e.seq);
                }
                Err(broadcast::error::TryRecvError::Empty) => std::thread::yield_now(),
                Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                Err(e) => panic!("the feed: {e}"),
            }
        }
        for p in pushers {
            p.join().unwrap();
        }
        let kept: Vec<u64> = log.recent(usize::MAX).iter().map(|e| e.seq).collect();
        let in_order: Vec<u64> = (1..=u64::from(2 * EACH)).collect();
        assert!(kept == in_order, "the ring is out of order");
        let inversions = fed.windows(2).filter(|w| w[0] >= w[1]).count();
        assert_eq!(
            inversions,
            0,
            "the feed is out of order ({} events read)",
            fed.len()
        );
    }

    /// A follower more than the feed's capacity behind is told how many events it missed,
    /// then gets the next ones.
    #[tokio::test]
    async fn a_follower_that_falls_behind_is_told_how_many_it_missed() {
        use futures_util::StreamExt;
        let log = EventLog::new(10);
        let stop = CancellationToken::new();
        let mut follower = Box::pin(log.follow(None, stop.clone()));
        log.push("client", &retry(0));
        let live = follower.next().await;
        assert!(
            matches!(&live, Some(Live::Event(e)) if e.seq == 1),
            "{live:?}"
        );
        // The feed keeps 1024: 1030 more leave the follower 6 behind.
        for i in 0..1030 {
            log.push("client", &retry(i));
        }
        let live = follower.next().await;
        assert!(matches!(live, Some(Live::Missed(6))), "{live:?}");
        let live = follower.next().await;
        assert!(
            matches!(&live, Some(Live::Event(e)) if e.seq == 8),
            "{live:?}"
        );
        // Stopped: it ends, though more events wait.
        stop.cancel();
        assert!(follower.next().await.is_none());
    }

    /// The numbers of the events a follower gets until it has `n` (at most 1 s).
    async fn first_seqs(follower: impl Stream<Item = Live>, n: usize) -> Vec<String> {
        let got = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            follower
                .map(|live| match live {
                    Live::Event(e) => e.seq.to_string(),
                    Live::Missed(m) => format!("missed {m}"),
                })
                .take(n)
                .collect::<Vec<_>>(),
        )
        .await;
        got.expect("the events in time")
    }

    /// A follower resuming after event `k` (the SSE `Last-Event-ID`) gets the kept events
    /// after it, then the live ones, none twice; resuming after events the ring no longer
    /// holds, it is told how many it missed first; an id this log never gave is no resumption.
    #[tokio::test]
    async fn a_follower_resuming_after_an_event_gets_the_kept_ones_after_it_first() {
        let log = EventLog::new(4);
        let stop = CancellationToken::new();
        for i in 0..6 {
            log.push("client", &retry(i));
        }
        // The ring keeps 3 to 6.
        let resumed = log.follow(Some(4), stop.clone());
        let behind = log.follow(Some(1), stop.clone());
        let unknown = log.follow(Some(99), stop.clone());
        log.push("server", &retry(6));
        assert_eq!(first_seqs(resumed, 3).await, ["5", "6", "7"]);
        assert_eq!(
            first_seqs(behind, 6).await,
            ["missed 1", "3", "4", "5", "6", "7"]
        );
        assert_eq!(first_seqs(unknown, 1).await, ["7"]);
        let current = log.follow(Some(7), stop.clone());
        log.push("server", &retry(7));
        assert_eq!(first_seqs(current, 1).await, ["8"]);
    }
}
