//! Endpoint health as one client sees it: local, expiring marks that are never written to a
//! registry.
//!
//! Failures that belong to one endpoint are held against that endpoint first, so that one sick
//! server among healthy ones loses its share of the traffic (and, under hash routing, its keys
//! move to the next server on the ring) while the others keep serving, instead of opening the
//! entry's breaker for everyone. Two kinds count ([`Fault`]):
//!
//! - **transport** (unreachable, connection broken): the endpoint is marked unhealthy at once,
//!   and removed after `unhealthy_times_allowed_before_removing` of them in a row. Calls that
//!   fail together because one connection broke count once: a crash with k calls in flight is
//!   one failure of the endpoint, not k.
//! - **sick** (reached, but no answer before the attempt's deadline, or a server error): the
//!   endpoint is marked unhealthy after `exceptions_allowed_before_breaking` of them in a row
//!   (the entry breaker's threshold, applied per endpoint), and marked again at once by each
//!   further one until a success.
//!
//! Each kind counts in a row to its own threshold: a failure of the other kind starts its count
//! over (two timeouts then a reset connection are one transport failure, not three).
//!
//! A mark lasts 1 s, 2 s, 4 s, ... (doubling per failure of its kind in a row, capped); when it
//! expires the
//! endpoint gets traffic again, which probes it. A removed endpoint gets no traffic while any
//! other is left: the client probes it in the background (a connect and handshake) and
//! re-admits it on success, or [`EndpointHealth::readmit`] does it by hand.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use rpc_core::{GovernanceOptions, RpcError, StatusCode};
use tokio::time::Instant;

/// A failure that belongs to one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The endpoint could not be reached, or the connection to it broke.
    Transport,
    /// The endpoint was reached but failed the call: no answer in time, or a server error.
    Sick,
}

impl Fault {
    /// The fault `err` shows in the endpoint that returned it, if any: communication errors are
    /// transport faults; timeouts and server errors (520: the handler failed or panicked) are
    /// sick answers. Business, validation, auth, not-found, overflow (load, not sickness),
    /// framework (a request the server refused, which any endpoint would refuse) and
    /// open-breaker errors say nothing against the endpoint.
    pub fn of(err: &RpcError) -> Option<Fault> {
        match err.code() {
            StatusCode::CommunicationError => Some(Fault::Transport),
            StatusCode::Timeout | StatusCode::ServerError => Some(Fault::Sick),
            _ => None,
        }
    }
}

/// What [`EndpointHealth::record_failure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// Failures in a row so far.
    pub consecutive: u32,
    /// Whether this failure counted (one per broken connection).
    pub counted: bool,
    /// The endpoint is now marked unhealthy for this long.
    pub ejected_for: Option<Duration>,
    /// The endpoint was removed by this failure.
    pub removed: bool,
}

/// How an endpoint stands, as [`EndpointHealth::view`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// Chosen like any other.
    Healthy,
    /// Avoided while another endpoint is usable, for `retry_in` more.
    Unhealthy {
        /// Time left on the mark.
        retry_in: Duration,
    },
    /// Dropped after repeated transport failures: used only when nothing else is left, until
    /// a background probe, the registry or [`EndpointHealth::readmit`] brings it back.
    Removed,
}

/// One endpoint's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointHealthView {
    /// Its state.
    pub state: EndpointState,
    /// Failures in a row (0 after a success).
    pub consecutive_failures: u32,
    /// The last failure held against it, while it has failures in a row.
    pub last_failure: Option<String>,
}

/// Local marks on endpoints that failed (see the module documentation).
///
/// Clients prefer healthy endpoints and use unhealthy ones only when nothing else is left.
#[derive(Debug)]
pub struct EndpointHealth {
    marks: DashMap<String, Mark>,
    /// How many marks exist: lets the hot path skip the map (whose `is_empty` locks every
    /// shard) when every endpoint is healthy.
    marked: AtomicUsize,
    max_backoff: Duration,
}

#[derive(Debug, Clone)]
struct Mark {
    until: Instant,
    /// Until when an outlier ejection ([`EndpointHealth::eject`]) keeps the endpoint out: a
    /// success does not end it (calls still in flight to the outlier mostly succeed), nor does
    /// a failure's shorter backoff.
    ejected_until: Option<Instant>,
    /// Failures in a row, of either kind.
    consecutive: u32,
    /// Of those, the last run of one kind: `run` failures of `run_of` in a row. Each kind
    /// has its own threshold (removal after transport failures, a mark after sick answers),
    /// so a failure of the other kind starts the run over.
    run: u32,
    run_of: Option<Fault>,
    removed: bool,
    /// The connections whose breaking was counted since the last success (the latest
    /// [`COUNTED_CONNECTIONS`]): the calls failing on any of them count no more, in whatever
    /// order they report (calls on two connections of one crashed endpoint interleave).
    connections: Vec<u64>,
    reason: String,
}

/// How many counted connections a mark remembers: more than a client keeps to one endpoint.
const COUNTED_CONNECTIONS: usize = 64;

fn backoff(n: u32, max: Duration) -> Duration {
    Duration::from_secs(1u64 << n.min(16)).min(max)
}

impl EndpointHealth {
    /// Marks expire after at most `max_backoff`, and at most the `breaker_seconds` (at least
    /// 1 s) of the options the failure is recorded with.
    pub fn new(max_backoff: Duration) -> Self {
        EndpointHealth {
            marks: DashMap::new(),
            marked: AtomicUsize::new(0),
            max_backoff,
        }
    }

    /// Records a transport failure of `addr` with no connection to tell apart; returns how many
    /// failures of either kind came in a row. After `remove_after` transport failures in a row
    /// (0: never) the endpoint is removed: it is chosen only when nothing else is left, until
    /// [`restore`](Self::restore) (the registry announced it again), [`readmit`](Self::readmit)
    /// or a success.
    pub fn failure(&self, addr: &str, remove_after: u32) -> u32 {
        let o = GovernanceOptions {
            unhealthy_times_allowed_before_removing: remove_after,
            ..GovernanceOptions::default()
        };
        self.record_failure(addr, Fault::Transport, None, "transport failure", &o)
            .consecutive
    }

    /// Records a failure of `addr` (see the module documentation). `connection` identifies
    /// the connection a transport failure happened on: further failures on the same one do
    /// not count again. The thresholds are `o.exceptions_allowed_before_breaking` (sick
    /// answers before a mark) and `o.unhealthy_times_allowed_before_removing` (transport
    /// failures before removal, 0 = never).
    pub fn record_failure(
        &self,
        addr: &str,
        fault: Fault,
        connection: Option<u64>,
        reason: &str,
        o: &GovernanceOptions,
    ) -> Recorded {
        let now = Instant::now();
        let mut mark = self.mark_of(addr, now);
        if fault == Fault::Transport && connection.is_some_and(|c| mark.connections.contains(&c)) {
            return Recorded {
                consecutive: mark.consecutive,
                counted: false,
                ejected_for: None,
                removed: false,
            };
        }
        if let Some(c) = connection {
            if mark.connections.len() == COUNTED_CONNECTIONS {
                mark.connections.remove(0);
            }
            mark.connections.push(c);
        }
        mark.consecutive += 1;
        if mark.run_of != Some(fault) {
            mark.run_of = Some(fault);
            mark.run = 0;
        }
        mark.run += 1;
        mark.reason = reason.to_string();
        let (n, run) = (mark.consecutive, mark.run);
        let cap = self
            .max_backoff
            .min(Duration::from_secs(o.breaker_seconds.max(1)));
        let mut removed = false;
        let ejected_for = match fault {
            Fault::Transport => {
                let remove_after = o.unhealthy_times_allowed_before_removing;
                if remove_after > 0 && run >= remove_after && !mark.removed {
                    mark.removed = true;
                    removed = true;
                }
                Some(backoff(run - 1, cap))
            }
            Fault::Sick => {
                let eject_after = o.exceptions_allowed_before_breaking.max(1);
                (run >= eject_after).then(|| backoff(run - eject_after, cap))
            }
        };
        if let Some(b) = ejected_for {
            // (Never shorter than a mark already set: an outlier's ejection stands.)
            mark.until = mark.until.max(now + b);
            tracing::debug!(
                target: "rpc::governance",
                endpoint = addr,
                consecutive = n,
                backoff_ms = b.as_millis() as u64,
                "endpoint marked unhealthy"
            );
        }
        Recorded {
            consecutive: n,
            counted: true,
            ejected_for,
            removed,
        }
    }

    /// `addr`'s mark, a fresh one (healthy as of `now`) if it had none.
    fn mark_of(&self, addr: &str, now: Instant) -> dashmap::mapref::one::RefMut<'_, String, Mark> {
        self.marks.entry(addr.to_string()).or_insert_with(|| {
            self.marked.fetch_add(1, Ordering::Release);
            Mark {
                until: now,
                ejected_until: None,
                consecutive: 0,
                run: 0,
                run_of: None,
                removed: false,
                connections: Vec::new(),
                reason: String::new(),
            }
        })
    }

    /// Marks `addr` unhealthy for `for_` (or longer, if it already is) without counting a
    /// failure: an outlier by success rate ([`crate::outlier`]) is avoided while other
    /// endpoints are usable, and gets traffic again when the mark expires.
    pub fn eject(&self, addr: &str, for_: Duration, reason: &str) {
        let now = Instant::now();
        let mut mark = self.mark_of(addr, now);
        mark.until = mark.until.max(now + for_);
        mark.ejected_until = mark.ejected_until.max(Some(now + for_));
        mark.reason = reason.to_string();
        tracing::debug!(
            target: "rpc::governance",
            endpoint = addr,
            ejected_ms = for_.as_millis() as u64,
            "endpoint ejected as an outlier"
        );
    }

    /// Records a success of `addr`: its failures are forgotten and its mark cleared, except an
    /// outlier ejection, which stands until it expires.
    pub fn success(&self, addr: &str) {
        if self.is_clear() {
            return;
        }
        let now = Instant::now();
        let removed =
            self.marks
                .remove_if_mut(addr, |_, m| match m.ejected_until.filter(|&t| t > now) {
                    Some(ejected) => {
                        m.until = ejected;
                        m.consecutive = 0;
                        m.run = 0;
                        m.run_of = None;
                        m.removed = false;
                        m.connections.clear();
                        false
                    }
                    None => true,
                });
        if removed.is_some() {
            self.marked.fetch_sub(1, Ordering::Release);
        }
    }

    /// Clears every mark on `addr`, removal included (an operator, or a successful background
    /// probe, says it is back). Returns whether it had one.
    pub fn readmit(&self, addr: &str) -> bool {
        if self.marks.remove(addr).is_some() {
            self.marked.fetch_sub(1, Ordering::Release);
            true
        } else {
            false
        }
    }

    /// The registry no longer lists `addr`: every mark on it goes, as [`readmit`] clears them
    /// (a removed endpoint's background probe then ends), without saying it is back.
    ///
    /// [`readmit`]: Self::readmit
    pub fn forget(&self, addr: &str) {
        self.readmit(addr);
    }

    /// Whether no endpoint carries a mark (the common case: nothing to check).
    pub fn is_clear(&self) -> bool {
        self.marked.load(Ordering::Acquire) == 0
    }

    /// Whether `addr` was removed after repeated failures.
    pub fn is_removed(&self, addr: &str) -> bool {
        !self.is_clear() && self.marks.get(addr).is_some_and(|m| m.removed)
    }

    /// Whether `addr` is neither removed nor marked unhealthy.
    pub fn is_usable(&self, addr: &str) -> bool {
        if self.is_clear() {
            return true;
        }
        match self.marks.get(addr) {
            None => true,
            Some(m) => !m.removed && Instant::now() >= m.until,
        }
    }

    /// The registry announced `addr` again: it is no longer removed (its backoff mark stays).
    pub fn restore(&self, addr: &str) {
        if let Some(mut m) = self.marks.get_mut(addr) {
            m.removed = false;
            m.consecutive = 0;
            m.run = 0;
            m.run_of = None;
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

    /// How `addr` stands now.
    pub fn view(&self, addr: &str) -> EndpointHealthView {
        let Some(m) = self.marks.get(addr) else {
            return EndpointHealthView {
                state: EndpointState::Healthy,
                consecutive_failures: 0,
                last_failure: None,
            };
        };
        let now = Instant::now();
        let state = if m.removed {
            EndpointState::Removed
        } else if now < m.until {
            EndpointState::Unhealthy {
                retry_in: m.until - now,
            }
        } else {
            EndpointState::Healthy
        };
        EndpointHealthView {
            state,
            consecutive_failures: m.consecutive,
            last_failure: (m.consecutive > 0).then(|| m.reason.clone()),
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

    /// An outlier's ejection outlasts the successes of calls still in flight to it and the
    /// shorter backoff of a failure; it ends when it expires.
    #[tokio::test(start_paused = true)]
    async fn an_ejection_stands_through_successes_and_failures_until_it_expires() {
        let h = EndpointHealth::new(Duration::from_secs(60));
        h.eject("a", Duration::from_secs(10), "success rate 40 %");
        h.success("a");
        assert!(!h.is_healthy("a"), "a success does not end the ejection");
        h.failure("a", 0); // a backoff of 1 s
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!h.is_usable("a"), "a failure does not shorten it");
        h.success("a");
        assert_eq!(
            h.view("a").consecutive_failures,
            0,
            "the failure is forgotten"
        );
        tokio::time::advance(Duration::from_millis(8001)).await;
        assert!(h.is_healthy("a"));
        h.success("a");
        assert!(h.is_clear(), "an expired ejection leaves no mark");
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

    fn sick_opts() -> GovernanceOptions {
        GovernanceOptions {
            exceptions_allowed_before_breaking: 3,
            unhealthy_times_allowed_before_removing: 3,
            ..Default::default()
        }
    }

    /// Each kind counts to its own threshold: sick answers then a transport failure do not
    /// remove the endpoint, and transport failures then a sick answer do not make that answer
    /// the third sick one.
    #[tokio::test(start_paused = true)]
    async fn sick_answers_and_transport_failures_each_count_to_their_own_threshold() {
        let (h, o) = (EndpointHealth::new(Duration::from_secs(60)), sick_opts());
        let sick = |addr| h.record_failure(addr, Fault::Sick, None, "timeout", &o);
        let broken = |addr| h.record_failure(addr, Fault::Transport, None, "reset", &o);
        assert_eq!(sick("a").ejected_for, None);
        assert_eq!(sick("a").ejected_for, None);
        let r = broken("a");
        assert_eq!(r.consecutive, 3, "three failures in a row");
        assert_eq!(
            r.ejected_for,
            Some(Duration::from_secs(1)),
            "marked at once"
        );
        assert!(
            !r.removed && !h.is_removed("a"),
            "one transport failure, not three"
        );

        broken("b");
        broken("b");
        assert!(!h.is_removed("b"));
        let r = sick("b");
        assert_eq!(r.ejected_for, None, "the first sick answer");
        assert!(!h.is_removed("b"));
    }

    #[tokio::test(start_paused = true)]
    async fn sick_answers_eject_after_the_threshold_then_each_one_again() {
        let (h, o) = (EndpointHealth::new(Duration::from_secs(60)), sick_opts());
        for n in 1..3 {
            let r = h.record_failure("a", Fault::Sick, None, "timeout", &o);
            assert_eq!((r.consecutive, r.ejected_for), (n, None));
            assert!(h.is_usable("a"), "not after {n}");
        }
        let r = h.record_failure("a", Fault::Sick, None, "timeout", &o);
        assert_eq!(r.ejected_for, Some(Duration::from_secs(1)));
        assert!(!h.is_usable("a"));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(h.is_usable("a"), "the mark expires: traffic probes it");
        let r = h.record_failure("a", Fault::Sick, None, "timeout", &o);
        assert_eq!(
            r.ejected_for,
            Some(Duration::from_secs(2)),
            "at once, doubled"
        );
        assert!(
            !r.removed && !h.is_removed("a"),
            "sick answers never remove"
        );
        let v = h.view("a");
        assert_eq!(v.consecutive_failures, 4);
        assert_eq!(v.last_failure.as_deref(), Some("timeout"));
        assert!(matches!(v.state, EndpointState::Unhealthy { .. }));
        h.success("a");
        assert_eq!(h.view("a").state, EndpointState::Healthy);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ejected_outlier_is_avoided_until_its_mark_expires() {
        let h = EndpointHealth::new(Duration::from_secs(60));
        h.eject("a", Duration::from_secs(10), "success rate 75 %");
        assert!(!h.is_usable("a") && !h.is_removed("a"));
        assert_eq!(h.view("a").consecutive_failures, 0, "no failure counted");
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(!h.is_healthy("a"));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(h.is_usable("a"), "the mark expires: traffic probes it");
    }

    #[tokio::test(start_paused = true)]
    async fn calls_failing_on_one_broken_connection_count_once() {
        let (h, o) = (EndpointHealth::new(Duration::from_secs(60)), sick_opts());
        // Three calls in flight on connection 7 fail together.
        let counted: Vec<bool> = (0..3)
            .map(|_| {
                h.record_failure("a", Fault::Transport, Some(7), "closed", &o)
                    .counted
            })
            .collect();
        assert_eq!(counted, [true, false, false]);
        assert_eq!(h.view("a").consecutive_failures, 1);
        assert!(!h.is_removed("a"));
        // Connecting again fails twice more: now three in a row.
        h.record_failure("a", Fault::Transport, None, "refused", &o);
        let r = h.record_failure("a", Fault::Transport, None, "refused", &o);
        assert!(r.removed && h.is_removed("a"));
        assert_eq!(h.view("a").state, EndpointState::Removed);
        assert!(h.readmit("a"));
        assert_eq!(h.view("a").state, EndpointState::Healthy);
        assert!(h.is_clear());
    }

    /// Calls on two broken connections of one endpoint, reporting interleaved, count once per
    /// connection: before, only the last counted connection was remembered, and the order
    /// 7, 8, 7 counted three failures and removed the endpoint at once.
    #[tokio::test(start_paused = true)]
    async fn calls_on_two_broken_connections_count_once_each_in_any_order() {
        let (h, o) = (EndpointHealth::new(Duration::from_secs(60)), sick_opts());
        let counted: Vec<bool> = [7, 8, 7, 8, 7]
            .into_iter()
            .map(|c| {
                h.record_failure("a", Fault::Transport, Some(c), "closed", &o)
                    .counted
            })
            .collect();
        assert_eq!(counted, [true, true, false, false, false]);
        assert_eq!(h.view("a").consecutive_failures, 2);
        assert!(!h.is_removed("a"));
    }
}
