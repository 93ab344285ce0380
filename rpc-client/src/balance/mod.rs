//! Endpoint choice, in one place: a client's view of each service (its live endpoints from the
//! registry watch), the shunt strategies (round robin, random, consistent hash on a ring with an
//! optional load bound, appointed address, least loaded by power of two choices), the ranking by
//! this client's endpoint health (healthy before marked, removed last) and the picker that hands
//! the call stack its candidates in that order.
//!
//! The load-aware strategies read each endpoint's [`EndpointLoad`]: the attempt counts as
//! outstanding on its endpoint while it runs, and its latency and the server's load report
//! update the score when it is answered. An instance's weight is its registry metadata
//! [`WEIGHT_KEY`].
//!
//! Why one module: failover, hash routing and ejection all answer the same question (where does
//! the next attempt go?), and answering it in one place is what keeps them consistent. The
//! retry layer only asks for the next candidate.

pub mod ring;
pub(crate) mod routing;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use dashmap::DashMap;
use rpc_core::{GovernanceOptions, RpcError, ShuntStrategy, StatusCode};
use rpc_governance::health::EndpointHealth;
use rpc_governance::load::{two_choices, EndpointLoad};
use rpc_governance::outlier::{Outlier, SuccessRateRule, SuccessRateTracker};
use rpc_governance::stack::{CallCx, Pick};
use rpc_registry::{Endpoints, Instance, ServiceWatch};
use tokio::time::Instant;

use ring::{RingCache, RingKey, RingSnapshot};

pub(crate) struct ServiceState {
    watch: ServiceWatch,
    /// The task that follows the registry's changes for the client, ended with the state
    /// (that is, with the client): it holds a watch of its own, which would otherwise keep
    /// the registry's watch (an etcd or ZooKeeper watch) until the service next changes.
    follower: std::sync::OnceLock<crate::rules::AbortOnDrop>,
    /// The round-robin position of [`select`](Self::select), in tests: calls use their
    /// entry's.
    #[cfg(test)]
    counter: AtomicUsize,
    /// The hash ring of the current snapshot, rebuilt by the watch (see [`RingCache`]).
    ring: RingCache,
    /// The snapshot last compared for re-announced endpoints.
    seen: Mutex<Endpoints>,
    /// The addresses of the current snapshot as shared strings, so that naming the chosen
    /// endpoint for an attempt copies no string.
    addresses: ArcSwapOption<Addresses>,
    /// Each endpoint's load as this client sees it, made on its first load-aware choice.
    loads: DashMap<String, Arc<EndpointLoad>>,
    /// The `slow_start_ms` of the last load-aware call, for instances announced later.
    slow_start_ms: AtomicU64,
    /// The addresses of the last snapshot the loads were brought in line with (at first, the
    /// snapshot this client first saw): an address outside it is newly announced.
    known: Mutex<HashSet<String>>,
    /// When each endpoint announced after this client first looked was first seen: its slow
    /// start runs from then, whenever its load is made.
    announced: DashMap<String, Instant>,
    /// Calls and successes per endpoint over the current interval, for outlier ejection.
    outcomes: SuccessRateTracker,
}

/// The registry metadata key of an instance's weight: a positive number, 1 when absent. Read by
/// the `least_loaded` strategy, whose load term is divided by it (a weight-3 instance gets about
/// three times the calls of a weight-1 one); round robin, random and hash ignore it.
pub const WEIGHT_KEY: &str = "weight";

/// `instance`'s weight from its [`WEIGHT_KEY`] metadata; 1 when absent, and 1 (with a warning)
/// when it is not a positive number.
pub fn weight_of(instance: &Instance) -> f64 {
    let Some(text) = instance.metadata.get(WEIGHT_KEY) else {
        return 1.0;
    };
    match text.trim().parse::<f64>() {
        Ok(w) if w.is_finite() && w > 0.0 => w,
        _ => {
            tracing::warn!(
                target: "rpc::governance",
                endpoint = instance.address.as_str(),
                weight = text.as_str(),
                "instance metadata `weight` is not a positive number; weight 1 is used"
            );
            1.0
        }
    }
}

/// The addresses of one snapshot, in its order.
struct Addresses {
    endpoints: Endpoints,
    list: Vec<Arc<str>>,
}

/// How acceptable an endpoint is for the next attempt; lower is better. Removed endpoints
/// (repeated transport failures) come after every other one not tried yet in this call:
/// used only when nothing else untried is left, and before the call tries an endpoint again
/// (a call's failover tries every endpoint once before any twice, as `untried_left` counts
/// them). Of the endpoints tried already, the one the call tried last comes after the others
/// of its class when `avoid_last`: a retry once every endpoint was tried goes elsewhere when it
/// can, not straight back to the endpoint that just refused it. Unless that endpoint said when
/// to come back, and the call waited that long (see [`CallCx::last_failure_said_when`]): then
/// it comes first of its class, since the others the call tried may still be inside pauses of
/// their own (a 429 that asked for 5 s, where this one asked for 100 ms).
fn rank(addr: &str, tried: &[Arc<str>], avoid_last: bool, health: &EndpointHealth) -> (u8, u8) {
    let last = match (tried.last().is_some_and(|t| **t == *addr), avoid_last) {
        (false, _) => 1,
        (true, true) => 2,
        (true, false) => 0,
    };
    if health.is_clear() {
        return if tried.iter().any(|t| **t == *addr) {
            (3, last)
        } else {
            (0, last)
        };
    }
    let fresh = !tried.iter().any(|t| **t == *addr);
    let class = match (health.is_removed(addr), fresh, health.is_healthy(addr)) {
        (false, true, true) => 0,
        (false, true, false) => 1,
        (true, true, _) => 2,
        (false, false, true) => 3,
        (false, false, false) => 4,
        (true, false, _) => 5,
    };
    (class, last)
}

impl ServiceState {
    pub(crate) fn new(watch: ServiceWatch, ring_key: RingKey) -> Self {
        let seen = Mutex::new(watch.current());
        let known = watch.current().iter().map(|i| i.address.clone()).collect();
        ServiceState {
            watch,
            follower: std::sync::OnceLock::new(),
            #[cfg(test)]
            counter: AtomicUsize::new(0),
            ring: RingCache::new(ring_key),
            seen,
            addresses: ArcSwapOption::empty(),
            loads: DashMap::new(),
            slow_start_ms: AtomicU64::new(0),
            known: Mutex::new(known),
            announced: DashMap::new(),
            outcomes: SuccessRateTracker::new(),
        }
    }

    /// Hands over the task following the service's changes, aborted when this state drops.
    pub(crate) fn follow(&self, task: &tokio::task::JoinHandle<()>) {
        let _ = self
            .follower
            .set(crate::rules::AbortOnDrop::new(task.abort_handle()));
    }

    /// Counts an attempt's outcome on `addr` for outlier ejection by success rate (when
    /// `outlier_success_rate` is on); when an interval ends, its outliers are ejected in
    /// `health` for `outlier_interval_ms` and returned, for their events.
    pub(crate) fn record_outcome(
        &self,
        addr: &str,
        ok: bool,
        options: &GovernanceOptions,
        health: &EndpointHealth,
    ) -> Vec<Outlier> {
        if !options.outlier_success_rate {
            return Vec::new();
        }
        // The outcome of a call still out on an endpoint that left the service (forgotten in
        // `health`, its counts dropped at the snapshot) would bring it back, to be judged and
        // ejected: a mark that nothing would clear, in place of a listed endpoint's ejection.
        if !self.is_listed(addr) {
            return Vec::new();
        }
        let interval = Duration::from_millis(options.outlier_interval_ms.max(1));
        let outliers = self
            .outcomes
            .record(addr, ok, interval, &SuccessRateRule::of(options));
        for o in &outliers {
            health.eject(&o.address, interval, &o.cause());
        }
        outliers
    }

    /// Whether `addr` is an endpoint of the service's last snapshot.
    fn is_listed(&self, addr: &str) -> bool {
        let known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        known.contains(addr)
    }

    /// The load of endpoint `addr`, made on first use with its weight from the current
    /// snapshot; an endpoint announced after this client first looked ramps up over
    /// `slow_start_ms` from when it was first seen (a call may see it before the watch's
    /// refresh does: it is then seen now).
    pub(crate) fn load_of(&self, addr: &str) -> Arc<EndpointLoad> {
        if let Some(l) = self.loads.get(addr) {
            return l.clone();
        }
        let weight = self
            .endpoints()
            .iter()
            .find(|i| i.address == addr)
            .map_or(1.0, |i| weight_of(i));
        let known = self
            .known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(addr);
        let since = match self.announced.get(addr) {
            Some(at) => Some(*at),
            None if known => None,
            None => Some(
                *self
                    .announced
                    .entry(addr.to_string())
                    .or_insert_with(Instant::now),
            ),
        };
        self.loads
            .entry(addr.to_string())
            .or_insert_with(|| {
                Arc::new(match since {
                    Some(since) => {
                        let ramp =
                            Duration::from_millis(self.slow_start_ms.load(Ordering::Relaxed));
                        EndpointLoad::ramping_since(weight, ramp, since)
                    }
                    None => EndpointLoad::new(weight, Duration::ZERO),
                })
            })
            .clone()
    }

    /// Brings the loads in line with a new snapshot: endpoints announced since the last one
    /// are marked (their slow start runs from now), a changed weight is taken in place (the
    /// calls outstanding and the slow start carry on), departed endpoints are dropped.
    fn refresh_loads(&self, eps: &Endpoints) {
        let now = Instant::now();
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        for i in eps.iter() {
            if !known.contains(i.address.as_str()) {
                self.announced.entry(i.address.clone()).or_insert(now);
            }
        }
        *known = eps.iter().map(|i| i.address.clone()).collect();
        self.announced.retain(|addr, _| known.contains(addr));
        self.loads.retain(|addr, _| known.contains(addr));
        self.outcomes.retain(|addr| known.contains(addr));
        drop(known);
        for i in eps.iter() {
            if let Some(load) = self.loads.get(i.address.as_str()) {
                let weight = weight_of(i);
                if load.weight() != weight.max(0.01) {
                    load.set_weight(weight);
                }
            }
        }
    }

    pub(crate) fn endpoints(&self) -> Endpoints {
        self.watch.current()
    }

    fn ring(&self, eps: &Endpoints) -> Arc<RingSnapshot> {
        self.ring.get(eps)
    }

    /// Called by the registry watch on every new snapshot: the hash ring and the shared
    /// addresses are rebuilt here, off the call path, and endpoints announced anew are no
    /// longer removed in `health` (seen here, an endpoint that left and came back between two
    /// calls is restored too).
    pub(crate) fn refresh(&self, health: &EndpointHealth) {
        let eps = self.endpoints();
        self.ring.refresh(&eps);
        self.addresses(&eps);
        self.restore_announced(&eps, health);
        self.refresh_loads(&eps);
    }

    /// The shared address string of `eps[idx]`: from the cached list when it is `eps`'s (read
    /// without touching its reference count), else from a list made for `eps`.
    fn address(&self, eps: &Endpoints, idx: usize) -> Arc<str> {
        {
            let cached = self.addresses.load();
            if let Some(a) = cached.as_deref() {
                if Endpoints::ptr_eq(&a.endpoints, eps) {
                    return a.list[idx].clone();
                }
            }
        }
        self.addresses(eps).list[idx].clone()
    }

    /// The shared address strings of `eps`.
    fn addresses(&self, eps: &Endpoints) -> Arc<Addresses> {
        if let Some(a) = self.addresses.load_full() {
            if Endpoints::ptr_eq(&a.endpoints, eps) {
                return a;
            }
        }
        let a = Arc::new(Addresses {
            endpoints: eps.clone(),
            list: eps.iter().map(|i| Arc::from(i.address.as_str())).collect(),
        });
        self.addresses.store(Some(a.clone()));
        a
    }

    /// Endpoints the registry announces anew (absent from the previous snapshot) are no longer
    /// removed: the registry, not this client, has the last word on membership. Run on every
    /// snapshot by [`refresh`](Self::refresh), and by a call that sees a snapshot before the
    /// watch's refresh does.
    fn restore_announced(&self, eps: &Endpoints, health: &EndpointHealth) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if Endpoints::ptr_eq(&seen, eps) {
            return;
        }
        if !health.is_clear() {
            let before: HashSet<&str> = seen.iter().map(|s| s.address.as_str()).collect();
            for i in eps.iter() {
                if !before.contains(i.address.as_str()) {
                    health.restore(&i.address);
                }
            }
        }
        *seen = eps.clone();
    }

    /// Picks the address for the next attempt: untried healthy endpoints first, then untried
    /// unhealthy ones, then tried ones, following the strategy within the best group. (Calls go
    /// through [`select_from`](Self::select_from), with their routing rule's group.)
    #[cfg(test)]
    pub(crate) fn select(
        &self,
        service_id: &str,
        options: &GovernanceOptions,
        hash_key: Option<u64>,
        tried: &[Arc<str>],
        health: &EndpointHealth,
    ) -> Result<Arc<str>, RpcError> {
        self.select_from(
            self.endpoints(),
            None,
            service_id,
            options,
            hash_key,
            (tried, true),
            health,
            &self.counter,
        )
    }

    /// [`select`](Self::select) in the snapshot `eps`, among the endpoints at the indexes
    /// `among` only when given (the group a routing rule chose: never empty). The hash ring
    /// stays the whole service's, walked past the endpoints outside the group, so a key keeps
    /// its owner within the group as the group changes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn select_from(
        &self,
        eps: Endpoints,
        among: Option<&[usize]>,
        service_id: &str,
        options: &GovernanceOptions,
        hash_key: Option<u64>,
        (tried, avoid_last): (&[Arc<str>], bool),
        health: &EndpointHealth,
        turns: &AtomicUsize,
    ) -> Result<Arc<str>, RpcError> {
        if options.shunt_strategy == ShuntStrategy::Appoint {
            return options
                .appoint_address
                .as_deref()
                .map(Arc::from)
                .ok_or_else(|| {
                    RpcError::new(
                        StatusCode::FrameworkError,
                        format!(
                        "{service_id}: shunt strategy appoint needs appoint_address = \"host:port\""
                    ),
                    )
                });
        }
        if !health.is_clear() {
            self.restore_announced(&eps, health);
        }
        let among = among.filter(|a| !a.is_empty());
        let inside = |idx: usize| among.is_none_or(|a| a.contains(&idx));
        if eps.is_empty() {
            return Err(RpcError::new(
                StatusCode::NotFindServiceRoute,
                format!(
                    "no endpoint serves {service_id}: start a server for it, or check the \
                     client's registry or endpoint list"
                ),
            ));
        }
        if let (ShuntStrategy::Hash, Some(key)) = (options.shunt_strategy, hash_key) {
            let ring = self.ring(&eps);
            // Bounded load: an endpoint over the bound ranks after every one under it of the
            // same health.
            let mut over = vec![false; eps.len()];
            if options.hash_balance_factor > 0 {
                // The mean is the candidates': the routing group's usable endpoints (all the
                // group's when none is usable), not the whole service's, whose others hold
                // none of these calls and would pull every member over the bound.
                let usable = |&i: &usize| inside(i) && health.is_usable(&eps[i].address);
                let mut members: Vec<usize> = (0..eps.len()).filter(usable).collect();
                if members.is_empty() {
                    members = (0..eps.len()).filter(|&i| inside(i)).collect();
                }
                let outstanding: Vec<usize> = members
                    .iter()
                    .map(|&i| self.load_of(&eps[i].address).outstanding())
                    .collect();
                let bounded = ring::over_bound(&outstanding, options.hash_balance_factor);
                for (&i, is_over) in members.iter().zip(bounded) {
                    over[i] = is_over;
                }
            }
            let mut best: Option<((u8, bool, u8), usize)> = None;
            for idx in ring.ring.walk(key).filter(|&i| inside(i)) {
                let (class, last) = rank(&eps[idx].address, tried, avoid_last, health);
                let r = (class, over[idx], last);
                if best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, idx));
                    // Untried and under the bound: nothing can rank better.
                    if class == 0 && !over[idx] {
                        break;
                    }
                }
            }
            // The ring holds every endpoint, so a best one exists.
            let idx = best.map(|(_, i)| i).unwrap_or(among.map_or(0, |a| a[0]));
            return Ok(self.address(&eps, idx));
        }
        if options.shunt_strategy == ShuntStrategy::LeastLoaded {
            self.slow_start_ms
                .store(options.slow_start_ms, Ordering::Relaxed);
            let group: Vec<usize> = if tried.is_empty() && health.is_clear() {
                among.map_or_else(|| (0..eps.len()).collect(), <[usize]>::to_vec)
            } else {
                best_group(&eps, among, tried, avoid_last, health)
            };
            let loads: Vec<Arc<EndpointLoad>> = group
                .iter()
                .map(|&i| self.load_of(&eps[i].address))
                .collect();
            let now = Instant::now();
            let pick = two_choices(loads.len(), ring::random, |k| loads[k].score_at(now));
            return Ok(self.address(&eps, group[pick.unwrap_or(0)]));
        }
        if tried.is_empty() && health.is_clear() {
            // The common case: every endpoint is equally good, nothing to rank.
            let n = among.map_or(eps.len(), <[usize]>::len);
            let pick = match options.shunt_strategy {
                ShuntStrategy::Random => ring::random(n),
                _ => ring::polling(turns, n),
            };
            return Ok(self.address(&eps, among.map_or(pick, |a| a[pick])));
        }
        let group = best_group(&eps, among, tried, avoid_last, health);
        let pick = match options.shunt_strategy {
            // A failover step takes a random one of the rest: by turns, its smaller group
            // would fall on the same members after the same failures (with one endpoint
            // refusing, the one after it in the order took three calls in four).
            ShuntStrategy::Random => ring::random(group.len()),
            _ if !tried.is_empty() => ring::random(group.len()),
            _ => ring::polling(turns, group.len()),
        };
        Ok(self.address(&eps, group[pick]))
    }
}

/// The indexes of the endpoints of the best rank (see [`rank`]), among `among` when given.
fn best_group(
    eps: &Endpoints,
    among: Option<&[usize]>,
    tried: &[Arc<str>],
    avoid_last: bool,
    health: &EndpointHealth,
) -> Vec<usize> {
    let candidates: Vec<usize> = among.map_or_else(|| (0..eps.len()).collect(), <[usize]>::to_vec);
    let ranks: Vec<(u8, u8)> = candidates
        .iter()
        .map(|&i| rank(&eps[i].address, tried, avoid_last, health))
        .collect();
    let best = ranks.iter().copied().min().unwrap_or((0, 1));
    candidates
        .iter()
        .zip(&ranks)
        .filter(|(_, r)| **r == best)
        .map(|(i, _)| *i)
        .collect()
}

/// The candidates of one call of a service, best first: asked for each attempt's endpoint, it
/// ranks the service's current endpoints by what the call has tried and this client's health
/// view, and follows the entry's strategy within the best group. When a routing rule chose a
/// group of instances for the call ([`routing::Choice`]), only those are candidates.
pub(crate) struct Picker {
    pub(crate) service: Arc<ServiceState>,
    pub(crate) route: Option<routing::Choice>,
}

impl Picker {
    /// The indexes of the call's candidates in `eps`: `None` for every endpoint. An endpoint
    /// the call found unable to serve it ([`CallCx::unable`]) is no candidate, unless every
    /// one is unable (the call's next attempt then fails there again, and it gives up).
    fn among(&self, eps: &Endpoints, cx: &CallCx<'_>) -> Result<Option<Vec<usize>>, RpcError> {
        let group = match &self.route {
            None => None,
            Some(choice) => choice.candidates(eps, cx.entry_id())?,
        };
        let unable = cx.unable();
        if unable.is_empty() {
            return Ok(group);
        }
        let able = |i: &usize| !unable.iter().any(|u| **u == *eps[*i].address);
        let kept: Vec<usize> = match &group {
            None => (0..eps.len()).filter(able).collect(),
            Some(g) => g.iter().copied().filter(able).collect(),
        };
        Ok(if kept.is_empty() { group } else { Some(kept) })
    }
}

/// The address every call of `cx` goes to under `shunt_strategy = appoint`.
fn appointed<'a>(cx: &'a CallCx<'_>) -> Option<&'a str> {
    let o = cx.options();
    (o.shunt_strategy == ShuntStrategy::Appoint)
        .then_some(o.appoint_address.as_deref())
        .flatten()
}

impl Pick for Picker {
    fn next(&mut self, cx: &CallCx<'_>) -> Result<Arc<str>, RpcError> {
        let eps = self.service.endpoints();
        let among = self.among(&eps, cx)?;
        // A routing group takes turns of its own.
        let turns = self
            .route
            .as_ref()
            .and_then(routing::Choice::turns)
            .unwrap_or_else(|| cx.round_robin());
        self.service.select_from(
            eps,
            among.as_deref(),
            cx.method().service_id,
            cx.options(),
            cx.hash_key(),
            (cx.tried(), !cx.last_failure_said_when()),
            cx.health(),
            turns,
        )
    }

    fn untried_left(&self, cx: &CallCx<'_>) -> bool {
        let tried = cx.tried();
        // Appointed: that address is the only candidate, whatever the registry lists.
        if let Some(appointed) = appointed(cx) {
            return !tried.iter().any(|t| **t == *appointed);
        }
        let eps = self.service.endpoints();
        // A routing group left empty under `fallback = "fail"`: no candidate at all (not
        // every instance, which the call can never be sent to).
        let Ok(among) = self.among(&eps, cx) else {
            return false;
        };
        eps.iter().enumerate().any(|(idx, i)| {
            among.as_ref().is_none_or(|a| a.contains(&idx))
                && !tried.iter().any(|t| **t == *i.address)
        })
    }

    fn any_candidate(&self, cx: &CallCx<'_>) -> bool {
        // Appointed: that address, whatever the registry lists.
        if appointed(cx).is_some() {
            return true;
        }
        let eps = self.service.endpoints();
        match self.among(&eps, cx) {
            // A routing group left empty under `fallback = "fail"`.
            Err(_) => false,
            Ok(None) => !eps.is_empty(),
            Ok(Some(among)) => !among.is_empty(),
        }
    }

    fn any_other_usable(&self, addr: &str, cx: &CallCx<'_>) -> bool {
        // Appointed: no other candidate, so a failure there is the entry's (its breaker
        // counts it), not one endpoint's among others.
        if appointed(cx).is_some() {
            return false;
        }
        let health = cx.health();
        let eps = self.service.endpoints();
        let Ok(among) = self.among(&eps, cx) else {
            return false;
        };
        eps.iter().enumerate().any(|(idx, i)| {
            among.as_ref().is_none_or(|a| a.contains(&idx))
                && i.address != addr
                && health.is_usable(&i.address)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::watch;

    fn instance(address: &str, weight: Option<&str>) -> Arc<Instance> {
        let mut i = Instance::new(address, ["s.S"]);
        if let Some(w) = weight {
            i.metadata.insert(WEIGHT_KEY.into(), w.into());
        }
        Arc::new(i)
    }

    fn state(instances: Vec<Arc<Instance>>) -> (ServiceState, watch::Sender<Endpoints>) {
        let (tx, rx) = watch::channel(Endpoints::new(instances));
        (
            ServiceState::new(ServiceWatch::new(rx), RingKey::Address),
            tx,
        )
    }

    const EVERY_STRATEGY: [ShuntStrategy; 4] = [
        ShuntStrategy::RoundRobin,
        ShuntStrategy::Random,
        ShuntStrategy::Hash,
        ShuntStrategy::LeastLoaded,
    ];

    /// A call's failover tries a removed endpoint it has not tried before trying another
    /// endpoint again: A and B failed, C (removed) is next, then A.
    #[test]
    fn a_removed_endpoint_is_tried_before_an_endpoint_is_tried_again() {
        let (s, _tx) = state(vec![
            instance("a:1", None),
            instance("b:1", None),
            instance("c:1", None),
        ]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        for _ in 0..3 {
            health.failure("c:1", 3);
        }
        assert!(health.is_removed("c:1"));
        let o = GovernanceOptions::default();
        let tried: Vec<Arc<str>> = vec![Arc::from("a:1"), Arc::from("b:1")];
        assert_eq!(&*s.select("s.S", &o, None, &tried, &health).unwrap(), "c:1");
        let all: Vec<Arc<str>> = vec![Arc::from("a:1"), Arc::from("b:1"), Arc::from("c:1")];
        assert_ne!(&*s.select("s.S", &o, None, &all, &health).unwrap(), "c:1");
    }

    /// Once every endpoint was tried, the next attempt goes to one other than the endpoint
    /// tried last, under every strategy: with two endpoints both refusing, A, B, then A (before,
    /// by turns a random one of both, B again half the time; by hash, the key's owner twice in
    /// a row); unless that endpoint said when to come back (then it first: before, by turns
    /// or at random, the other half the time). With one endpoint, that one.
    #[test]
    fn a_retry_after_every_endpoint_was_tried_avoids_the_one_tried_last() {
        let (s, _tx) = state(vec![instance("a:1", None), instance("b:1", None)]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        for strategy in EVERY_STRATEGY {
            let o = GovernanceOptions {
                shunt_strategy: strategy,
                ..GovernanceOptions::default()
            };
            for key in 0..32u64 {
                for (tried, next) in [(["a:1", "b:1"], "a:1"), (["b:1", "a:1"], "b:1")] {
                    let tried: Vec<Arc<str>> = tried.into_iter().map(Arc::from).collect();
                    let pick = s.select("s.S", &o, Some(key), &tried, &health).unwrap();
                    assert_eq!(&*pick, next, "{strategy:?}, key {key}, tried {tried:?}");
                }
            }
        }
        // Unless the endpoint tried last said when to come back (the call waited that long):
        // then it comes first of the tried ones, under every strategy (the other may still be
        // inside a longer pause of its own).
        for strategy in EVERY_STRATEGY {
            let o = GovernanceOptions {
                shunt_strategy: strategy,
                ..GovernanceOptions::default()
            };
            for key in 0..32u64 {
                for tried in [["a:1", "b:1"], ["b:1", "a:1"]] {
                    let tried: Vec<Arc<str>> = tried.into_iter().map(Arc::from).collect();
                    let pick = s
                        .select_from(
                            s.endpoints(),
                            None,
                            "s.S",
                            &o,
                            Some(key),
                            (&tried, false),
                            &health,
                            &s.counter,
                        )
                        .unwrap();
                    assert_eq!(pick, tried[1], "{strategy:?}, key {key}, tried {tried:?}");
                }
            }
        }
        let (one, _tx) = state(vec![instance("a:1", None)]);
        let tried: Vec<Arc<str>> = vec![Arc::from("a:1")];
        let o = GovernanceOptions::default();
        assert_eq!(
            &*one.select("s.S", &o, None, &tried, &health).unwrap(),
            "a:1"
        );
    }

    /// An endpoint removed, gone from the registry and announced again between two calls (no
    /// call saw it missing) is no longer removed: the watch's refresh saw it leave and return.
    #[test]
    fn an_endpoint_that_left_and_returned_between_calls_is_no_longer_removed() {
        let all = || {
            vec![
                instance("a:1", None),
                instance("b:1", None),
                instance("c:1", None),
            ]
        };
        let (s, tx) = state(all());
        let health = EndpointHealth::new(Duration::from_secs(60));
        for _ in 0..3 {
            health.failure("c:1", 3);
        }
        assert!(health.is_removed("c:1"));
        tx.send(Endpoints::new(all()[..2].to_vec())).unwrap();
        s.refresh(&health);
        tx.send(Endpoints::new(all())).unwrap();
        s.refresh(&health);
        assert!(!health.is_removed("c:1"));
    }

    /// An endpoint announced while no endpoint carried a mark is not taken for new again by a
    /// later call: its failures count from the first, and it is removed after as many as the
    /// option says.
    #[test]
    fn an_endpoint_announced_while_all_were_healthy_is_removed_after_its_failures() {
        let (s, tx) = state(vec![instance("a:1", None), instance("b:1", None)]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        let o = GovernanceOptions::default();
        // A call sees the first snapshot while every endpoint is healthy.
        s.select("s.S", &o, None, &[], &health).unwrap();
        tx.send(Endpoints::new(vec![
            instance("a:1", None),
            instance("b:1", None),
            instance("c:1", None),
        ]))
        .unwrap();
        s.refresh(&health);
        for _ in 0..3 {
            health.failure("c:1", 3);
            // A call between failures.
            s.select("s.S", &o, None, &[], &health).unwrap();
        }
        assert!(health.is_removed("c:1"), "three failures of three allowed");
    }

    /// Under a routing group, the bounded-load mean is the group's: with 4 calls on the key's
    /// owner and 1 on the group's other member, the owner is over the bound (⌈1.25 × 6 / 2⌉ =
    /// 4 < 5) and the other is not; the other 8 endpoints of the service, holding none of
    /// these calls, would have put both over it (⌈1.25 × 6 / 10⌉ = 1).
    #[test]
    fn the_hash_load_bound_is_the_routing_groups() {
        let all: Vec<Arc<Instance>> = (0..10)
            .map(|i| instance(&format!("e{i}:1"), None))
            .collect();
        let (s, _tx) = state(all);
        let health = EndpointHealth::new(Duration::from_secs(60));
        let group = [0usize, 1];
        let hashed = |factor: u32| GovernanceOptions {
            shunt_strategy: ShuntStrategy::Hash,
            hash_balance_factor: factor,
            ..GovernanceOptions::default()
        };
        let pick = |key: u64, factor: u32| {
            s.select_from(
                s.endpoints(),
                Some(&group),
                "s.S",
                &hashed(factor),
                Some(key),
                (&[], true),
                &health,
                &s.counter,
            )
            .unwrap()
        };
        // Keys spread over the ring (small numbers all sit before its first point).
        let key = (1..1000u64)
            .map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .find(|&k| &*pick(k, 0) == "e0:1")
            .expect("a key e0 owns within the group");
        let (owner, other) = (s.load_of("e0:1"), s.load_of("e1:1"));
        let on_owner: Vec<_> = (0..4).map(|_| owner.start()).collect();
        let on_other = other.start();
        assert_eq!(&*pick(key, 125), "e1:1");
        drop((on_owner, on_other));
    }

    fn least_loaded() -> GovernanceOptions {
        GovernanceOptions {
            shunt_strategy: ShuntStrategy::LeastLoaded,
            ..GovernanceOptions::default()
        }
    }

    fn picks(
        s: &ServiceState,
        o: &GovernanceOptions,
        tried: &[Arc<str>],
        health: &EndpointHealth,
        n: usize,
    ) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for _ in 0..n {
            let a = s.select("s.S", o, None, tried, health).unwrap();
            *counts.entry(a.to_string()).or_default() += 1;
        }
        counts
    }

    use std::collections::HashMap;

    #[tokio::test(start_paused = true)]
    async fn least_loaded_takes_the_endpoint_with_fewer_calls_outstanding() {
        let (s, _tx) = state(vec![instance("a:1", None), instance("b:1", None)]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        // Same latency seen on both; b has three calls outstanding, so its score is twice a's
        // (√4): with two endpoints both are always drawn, and a always wins.
        let now = Instant::now();
        s.load_of("a:1").observe(Duration::from_millis(10), now);
        s.load_of("b:1").observe(Duration::from_millis(10), now);
        let b = s.load_of("b:1");
        let _busy: Vec<_> = (0..3).map(|_| b.start()).collect();
        let counts = picks(&s, &least_loaded(), &[], &health, 50);
        assert_eq!(counts.get("a:1"), Some(&50), "{counts:?}");
        // The same under round robin: half each, whatever the load.
        let rr = picks(&s, &GovernanceOptions::default(), &[], &health, 50);
        assert_eq!((rr.get("a:1"), rr.get("b:1")), (Some(&25), Some(&25)));
    }

    #[tokio::test(start_paused = true)]
    async fn least_loaded_chooses_among_healthy_untried_endpoints_first() {
        let (s, _tx) = state(vec![
            instance("a:1", None),
            instance("b:1", None),
            instance("c:1", None),
        ]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        // a is the least loaded, but marked unhealthy: b and c take every call.
        let now = Instant::now();
        s.load_of("a:1").observe(Duration::from_millis(1), now);
        s.load_of("b:1").observe(Duration::from_millis(50), now);
        s.load_of("c:1").observe(Duration::from_millis(50), now);
        health.failure("a:1", 0);
        let counts = picks(&s, &least_loaded(), &[], &health, 60);
        assert_eq!(counts.get("a:1"), None, "{counts:?}");
        // Failover: b was tried, so c is next (a still marked).
        let tried: Vec<Arc<str>> = vec![Arc::from("b:1")];
        let counts = picks(&s, &least_loaded(), &tried, &health, 20);
        assert_eq!(counts.get("c:1"), Some(&20), "{counts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_instance_announced_later_ramps_up_over_slow_start() {
        let (s, tx) = state(vec![instance("a:1", None)]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        let o = GovernanceOptions {
            slow_start_ms: 10_000,
            ..least_loaded()
        };
        assert_eq!(picks(&s, &o, &[], &health, 1).get("a:1"), Some(&1));
        tx.send(Endpoints::new([
            instance("a:1", None),
            instance("b:1", None),
        ]))
        .unwrap();
        s.refresh(&EndpointHealth::new(Duration::from_secs(60)));
        // Nothing measured on either: b's weight is a tenth of a's, so a scores lower while its
        // calls outstanding + 1 are fewer than ten (√((5 + 1) / 1) < √(1 / 0.1)): every call
        // goes to a.
        let a = s.load_of("a:1");
        let _held: Vec<_> = (0..5).map(|_| a.start()).collect();
        let counts = picks(&s, &o, &[], &health, 40);
        assert_eq!(counts.get("a:1"), Some(&40), "{counts:?}");
        // After the slow start both weigh 1: b, idle, takes every call.
        tokio::time::advance(Duration::from_secs(10)).await;
        let counts = picks(&s, &o, &[], &health, 40);
        assert_eq!(counts.get("b:1"), Some(&40), "{counts:?}");
    }

    /// A call may see a new snapshot before the watch's refresh does: an instance it meets
    /// then still ramps up from a tenth of its weight.
    #[tokio::test(start_paused = true)]
    async fn an_instance_a_call_meets_before_the_refresh_ramps_up_too() {
        let (s, tx) = state(vec![instance("a:1", None)]);
        let o = GovernanceOptions {
            slow_start_ms: 10_000,
            ..least_loaded()
        };
        let health = EndpointHealth::new(Duration::from_secs(60));
        assert_eq!(picks(&s, &o, &[], &health, 1).get("a:1"), Some(&1));
        tx.send(Endpoints::new([
            instance("a:1", None),
            instance("b:1", None),
        ]))
        .unwrap();
        // No refresh yet.
        let now = Instant::now();
        assert!((s.load_of("b:1").weight_at(now) - 0.1).abs() < 1e-9);
        s.refresh(&EndpointHealth::new(Duration::from_secs(60)));
        assert!(
            (s.load_of("b:1").weight_at(now) - 0.1).abs() < 1e-9,
            "still ramping"
        );
        assert_eq!(s.load_of("a:1").weight_at(now), 1.0);
    }

    /// An instance that was there when the client first looked never ramps, even if its load
    /// is made only later (it was outside the first calls' group, or unhealthy then).
    #[tokio::test(start_paused = true)]
    async fn an_instance_there_from_the_start_never_ramps() {
        let (s, tx) = state(vec![instance("a:1", None), instance("b:1", None)]);
        let o = GovernanceOptions {
            slow_start_ms: 10_000,
            ..least_loaded()
        };
        // Only a's load is made (b is outside the first call's candidates).
        let _ = s.load_of("a:1");
        s.slow_start_ms.store(o.slow_start_ms, Ordering::Relaxed);
        tx.send(Endpoints::new([
            instance("a:1", None),
            instance("b:1", None),
            instance("c:1", None),
        ]))
        .unwrap();
        s.refresh(&EndpointHealth::new(Duration::from_secs(60)));
        let now = Instant::now();
        assert_eq!(s.load_of("b:1").weight_at(now), 1.0, "b was there at first");
        assert!(
            (s.load_of("c:1").weight_at(now) - 0.1).abs() < 1e-9,
            "c is new"
        );
    }

    /// A weight the registry changes is taken in place: the calls outstanding still count.
    #[tokio::test(start_paused = true)]
    async fn a_changed_weight_keeps_the_calls_outstanding() {
        let (s, tx) = state(vec![instance("a:1", None)]);
        let a = s.load_of("a:1");
        let held = (a.start(), a.start());
        tx.send(Endpoints::new([instance("a:1", Some("3"))]))
            .unwrap();
        s.refresh(&EndpointHealth::new(Duration::from_secs(60)));
        let now_a = s.load_of("a:1");
        assert_eq!(now_a.outstanding(), 2);
        assert_eq!(now_a.weight_at(Instant::now()), 3.0);
        drop(held);
        assert_eq!(now_a.outstanding(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_instance_weight_divides_the_score() {
        let (s, _tx) = state(vec![instance("a:1", Some("3")), instance("b:1", None)]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        // Same latency, a of weight 3: with one call outstanding a scores 10 ms × √(2 / 3),
        // below idle b's 10 ms × √(1 / 1); with three outstanding, 10 ms × √(4 / 3), above it.
        let now = Instant::now();
        s.load_of("a:1").observe(Duration::from_millis(10), now);
        s.load_of("b:1").observe(Duration::from_millis(10), now);
        let a = s.load_of("a:1");
        let one = a.start();
        assert_eq!(
            picks(&s, &least_loaded(), &[], &health, 10).get("a:1"),
            Some(&10)
        );
        let _more = (a.start(), a.start());
        assert_eq!(
            picks(&s, &least_loaded(), &[], &health, 10).get("b:1"),
            Some(&10)
        );
        drop(one);
        // A weight that is not a positive number counts as 1.
        assert_eq!(weight_of(&instance("c:1", Some("heavy"))), 1.0);
        assert_eq!(weight_of(&instance("c:1", Some("-2"))), 1.0);
        assert_eq!(weight_of(&instance("c:1", Some("2.5"))), 2.5);
    }

    /// Outlier ejection by success rate, judging endpoints of 20 calls or more.
    fn by_success_rate() -> GovernanceOptions {
        GovernanceOptions {
            outlier_success_rate: true,
            outlier_request_volume: 20,
            ..GovernanceOptions::default()
        }
    }

    /// 40 calls to each of `addrs` in turn, call `n` to `a` succeeding when `ok(a, n)`, none
    /// ending an interval.
    fn forty_calls_each(
        s: &ServiceState,
        addrs: &[&str],
        ok: impl Fn(&str, u32) -> bool,
        health: &EndpointHealth,
    ) {
        let o = by_success_rate();
        for n in 0..40 {
            for a in addrs {
                assert!(s.record_outcome(a, ok(a, n), &o, health).is_empty());
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_failing_one_call_in_four_is_ejected_by_success_rate() {
        let addrs = ["a:1", "b:1", "c:1", "d:1", "e:1"];
        let (s, _tx) = state(addrs.iter().map(|a| instance(a, None)).collect());
        let health = EndpointHealth::new(Duration::from_secs(60));
        let o = by_success_rate();
        // e fails every fourth, never three in a row, so consecutive-failure marks never
        // catch it.
        forty_calls_each(
            &s,
            &addrs,
            |a, n| a != "e:1" || !n.is_multiple_of(4),
            &health,
        );
        assert!(health.is_usable("e:1"));
        // Off, nothing is counted or judged.
        let off = GovernanceOptions::default();
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(s.record_outcome("a:1", true, &off, &health).is_empty());
        // The interval (10 s by default) ended: the next call judges it. Rates 1, 1, 1, 1,
        // 0.75: mean 0.95, stdev 0.1, threshold 0.76.
        let out = s.record_outcome("a:1", true, &o, &health);
        let ejected: Vec<&str> = out.iter().map(|o| o.address.as_str()).collect();
        assert_eq!(ejected, ["e:1"]);
        assert!(!health.is_usable("e:1"));
        let counts = picks(&s, &GovernanceOptions::default(), &[], &health, 40);
        assert_eq!(counts.get("e:1"), None, "{counts:?}");
        // Ejected for one interval, then back.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(health.is_usable("e:1"));
    }

    /// An endpoint that left the service during an interval is not judged at its end, nor
    /// counted in the others' mean: the listed outlier is ejected, and no mark is made for the
    /// endpoint that left (nothing would clear it). Before, its counts stayed: here its
    /// failures widened the spread so that e was not found an outlier; had it been the worst,
    /// it took the one ejection the cap allows, with a mark that stayed for good.
    #[tokio::test(start_paused = true)]
    async fn an_endpoint_gone_during_an_interval_is_not_judged_at_its_end() {
        let addrs = ["a:1", "b:1", "c:1", "d:1", "e:1", "f:1"];
        let (s, tx) = state(addrs.iter().map(|a| instance(a, None)).collect());
        let health = EndpointHealth::new(Duration::from_secs(60));
        let o = by_success_rate();
        // e fails one in two, f three in four.
        let ok = |a: &str, n: u32| match a {
            "e:1" => n.is_multiple_of(2),
            "f:1" => n.is_multiple_of(4),
            _ => true,
        };
        forty_calls_each(&s, &addrs, ok, &health);
        // f leaves; a call still out on it ends after.
        let listed: Vec<_> = addrs[..5].iter().map(|a| instance(a, None)).collect();
        tx.send(Endpoints::new(listed)).expect("the watch");
        s.refresh(&health);
        health.forget("f:1");
        assert!(s.record_outcome("f:1", false, &o, &health).is_empty());
        tokio::time::advance(Duration::from_secs(10)).await;
        // Among a to e: rates 1, 1, 1, 1, 0.5; mean 0.9, stdev 0.2, threshold 0.7.
        let out = s.record_outcome("a:1", true, &o, &health);
        let ejected: Vec<&str> = out.iter().map(|o| o.address.as_str()).collect();
        assert_eq!(ejected, ["e:1"]);
        assert!(!health.is_usable("e:1"));
        // Back after its interval, and its mark cleared by a success: no mark is left then,
        // of e nor of f.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(health.is_usable("e:1"));
        health.success("e:1");
        assert!(health.is_clear(), "a mark is left");
    }

    /// A call whose routing group (under `fallback = "fail"`) emptied after it was drawn has
    /// no candidate left, untried or usable: its retry gives up at once with its attempt's
    /// error, and the entry's breaker counts the failure. Before, the empty group read as
    /// "every instance", so the instances outside it, which the call can never be sent to,
    /// counted: the retry waited and drew budget, then failed with the rule's 404 in place of
    /// the attempt's own error, and the breaker left the failure out.
    #[test]
    fn a_call_whose_routing_group_emptied_has_no_candidate_left() {
        use rpc_core::{GovernanceOverrides, MethodDescriptor};
        use rpc_governance::engine::Governance;
        use rpc_governance::routing::RoutingRules;
        use rpc_governance::stack::{CallCx, Pick};
        static M: MethodDescriptor = MethodDescriptor {
            service_id: "s.S",
            method: "m",
            entry_id: "s.S.m",
            hash_key: None,
            governance: GovernanceOverrides::NONE,
            api: None,
        };
        let rules = RoutingRules::from_toml(
            r#"
[[routes]]
name = "canary-only"
service = "s.S"
to = [ { tags = { version = "canary" } } ]
fallback = "fail"
"#,
        )
        .expect("rules");
        let mut canary = Instance::new("c:1", ["s.S"]);
        canary.metadata.insert("version".into(), "canary".into());
        let stable = instance("s:1", None);
        let (s, tx) = state(vec![Arc::new(canary), stable.clone()]);
        let g = Governance::new(Default::default());
        let p = g.policy(&M);
        let cx = CallCx::new(&g, p.clone(), p.options());
        let picker = Picker {
            service: Arc::new(s),
            route: Some(routing::Choice::drawn(Arc::new(rules), 0, 0)),
        };
        assert!(picker.untried_left(&cx), "the canary is a candidate");
        assert!(picker.any_candidate(&cx), "the canary is a candidate");
        // The canary leaves while the call's attempt on it fails.
        tx.send(Endpoints::new(vec![stable])).expect("the watch");
        assert!(!picker.untried_left(&cx), "no candidate is left");
        assert!(!picker.any_other_usable("c:1", &cx), "no other candidate");
        assert!(
            !picker.any_candidate(&cx),
            "no candidate at all: no retry to wait for"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_load_hashing_moves_a_key_off_an_owner_over_the_bound() {
        let (s, _tx) = state(vec![
            instance("a:1", None),
            instance("b:1", None),
            instance("c:1", None),
        ]);
        let health = EndpointHealth::new(Duration::from_secs(60));
        let key = 42u64;
        let eps = s.endpoints();
        let walk: Vec<usize> = s.ring(&eps).ring.walk(key).collect();
        let owner = eps[walk[0]].address.clone();
        let next = eps[walk[1]].address.clone();
        let hash = |factor| GovernanceOptions {
            shunt_strategy: ShuntStrategy::Hash,
            hash_balance_factor: factor,
            ..GovernanceOptions::default()
        };
        let load = s.load_of(&owner);
        let _held: Vec<_> = (0..6).map(|_| load.start()).collect();
        let pick = |o: &GovernanceOptions| s.select("s.S", o, Some(key), &[], &health).unwrap();
        // Off: the owner keeps its key whatever it holds.
        assert_eq!(&*pick(&hash(0)), owner.as_str());
        // 125 %: ⌈1.25 × 7 / 3⌉ = 3 < 6 + 1, so the next on the ring takes it.
        assert_eq!(&*pick(&hash(125)), next.as_str());
    }
}
