//! Endpoint choice, in one place: a client's view of each service (its live endpoints from the
//! registry watch), the shunt strategies (round robin, random, consistent hash on a ring,
//! appointed address), the ranking by this client's endpoint health (healthy before marked,
//! removed last) and the picker that hands the call stack its candidates in that order.
//!
//! Why one module: failover, hash routing and ejection all answer the same question (where does
//! the next attempt go?), and answering it in one place is what keeps them consistent. The
//! retry layer only asks for the next candidate.

pub mod ring;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwapOption;
use rpc_core::{GovernanceOptions, RpcError, ShuntStrategy, StatusCode};
use rpc_governance::health::EndpointHealth;
use rpc_governance::stack::{CallCx, Pick};
use rpc_registry::{Endpoints, ServiceWatch};

use ring::{RingCache, RingKey, RingSnapshot};

pub(crate) struct ServiceState {
    watch: ServiceWatch,
    counter: AtomicUsize,
    /// The hash ring of the current snapshot, rebuilt by the watch (see [`RingCache`]).
    ring: RingCache,
    /// The snapshot last compared for re-announced endpoints.
    seen: Mutex<Endpoints>,
    /// The addresses of the current snapshot as shared strings, so that naming the chosen
    /// endpoint for an attempt copies no string.
    addresses: ArcSwapOption<Addresses>,
}

/// The addresses of one snapshot, in its order.
struct Addresses {
    endpoints: Endpoints,
    list: Vec<Arc<str>>,
}

/// How acceptable an endpoint is for the next attempt; lower is better. Removed endpoints
/// (repeated transport failures) come last: used only when nothing else is left.
fn rank(addr: &str, tried: &[Arc<str>], health: &EndpointHealth) -> u8 {
    if health.is_clear() {
        return if tried.iter().any(|t| **t == *addr) {
            2
        } else {
            0
        };
    }
    let fresh = !tried.iter().any(|t| **t == *addr);
    match (health.is_removed(addr), fresh, health.is_healthy(addr)) {
        (true, true, _) => 4,
        (true, false, _) => 5,
        (false, true, true) => 0,
        (false, true, false) => 1,
        (false, false, true) => 2,
        (false, false, false) => 3,
    }
}

impl ServiceState {
    pub(crate) fn new(watch: ServiceWatch, ring_key: RingKey) -> Self {
        let seen = Mutex::new(watch.current());
        ServiceState {
            watch,
            counter: AtomicUsize::new(0),
            ring: RingCache::new(ring_key),
            seen,
            addresses: ArcSwapOption::empty(),
        }
    }

    pub(crate) fn endpoints(&self) -> Endpoints {
        self.watch.current()
    }

    fn ring(&self, eps: &Endpoints) -> Arc<RingSnapshot> {
        self.ring.get(eps)
    }

    /// Called by the registry watch on every new snapshot: the hash ring and the shared
    /// addresses are rebuilt here, off the call path.
    pub(crate) fn refresh(&self) {
        let eps = self.endpoints();
        self.ring.refresh(&eps);
        self.addresses(&eps);
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
    /// removed: the registry, not this client, has the last word on membership.
    fn restore_announced(&self, eps: &Endpoints, health: &EndpointHealth) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if Endpoints::ptr_eq(&seen, eps) {
            return;
        }
        for i in eps.iter() {
            if !seen.iter().any(|s| s.address == i.address) {
                health.restore(&i.address);
            }
        }
        *seen = eps.clone();
    }

    /// Picks the address for the next attempt: untried healthy endpoints first, then untried
    /// unhealthy ones, then tried ones, following the strategy within the best group.
    pub(crate) fn select(
        &self,
        service_id: &str,
        options: &GovernanceOptions,
        hash_key: Option<u64>,
        tried: &[Arc<str>],
        health: &EndpointHealth,
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
        let eps = self.endpoints();
        if !health.is_clear() {
            self.restore_announced(&eps, health);
        }
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
            let mut best: Option<(u8, usize)> = None;
            for idx in ring.ring.walk(key) {
                let r = rank(&eps[idx].address, tried, health);
                if best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, idx));
                    if r == 0 {
                        break;
                    }
                }
            }
            // The ring holds every endpoint, so a best one exists.
            let idx = best.map(|(_, i)| i).unwrap_or(0);
            return Ok(self.address(&eps, idx));
        }
        if tried.is_empty() && health.is_clear() {
            // The common case: every endpoint is equally good, nothing to rank.
            let pick = match options.shunt_strategy {
                ShuntStrategy::Random => ring::random(eps.len()),
                _ => ring::polling(&self.counter, eps.len()),
            };
            return Ok(self.address(&eps, pick));
        }
        let ranks: Vec<u8> = eps
            .iter()
            .map(|i| rank(&i.address, tried, health))
            .collect();
        let best = ranks.iter().copied().min().unwrap_or(0);
        let group: Vec<usize> = (0..eps.len()).filter(|&i| ranks[i] == best).collect();
        let pick = match options.shunt_strategy {
            ShuntStrategy::Random => ring::random(group.len()),
            _ => ring::polling(&self.counter, group.len()),
        };
        Ok(self.address(&eps, group[pick]))
    }
}

/// The candidates of one call of a service, best first: asked for each attempt's endpoint, it
/// ranks the service's current endpoints by what the call has tried and this client's health
/// view, and follows the entry's strategy within the best group.
pub(crate) struct Picker {
    pub(crate) service: Arc<ServiceState>,
}

impl Pick for Picker {
    fn next(&mut self, cx: &CallCx<'_>) -> Result<Arc<str>, RpcError> {
        self.service.select(
            cx.method().service_id,
            cx.options(),
            cx.hash_key(),
            cx.tried(),
            cx.health(),
        )
    }

    fn untried_left(&self, cx: &CallCx<'_>) -> bool {
        let tried = cx.tried();
        self.service
            .endpoints()
            .iter()
            .any(|i| !tried.iter().any(|t| **t == *i.address))
    }

    fn any_other_usable(&self, addr: &str, cx: &CallCx<'_>) -> bool {
        let health = cx.health();
        self.service
            .endpoints()
            .iter()
            .any(|i| i.address != addr && health.is_usable(&i.address))
    }
}
