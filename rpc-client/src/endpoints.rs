//! A client's view of one service: its live endpoints (from the registry watch) and the state the
//! shunt strategies keep.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};

use rpc_core::{GovernanceOptions, RpcError, ShuntStrategy, StatusCode};
use rpc_governance::health::EndpointHealth;
use rpc_registry::{Endpoints, ServiceWatch};

use crate::shunt::{self, RingCache, RingKey, RingSnapshot};

pub(crate) struct ServiceState {
    watch: ServiceWatch,
    counter: AtomicUsize,
    /// The hash ring of the current snapshot, rebuilt by the watch (see [`RingCache`]).
    ring: RingCache,
    /// The snapshot last compared for re-announced endpoints.
    seen: Mutex<Endpoints>,
}

/// How acceptable an endpoint is for the next attempt; lower is better. Removed endpoints
/// (repeated transport failures) come last: used only when nothing else is left.
fn rank(addr: &str, tried: &[String], health: &EndpointHealth) -> u8 {
    if health.is_clear() {
        return if tried.iter().any(|t| t == addr) {
            2
        } else {
            0
        };
    }
    let fresh = !tried.iter().any(|t| t == addr);
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
        }
    }

    pub(crate) fn endpoints(&self) -> Endpoints {
        self.watch.current()
    }

    fn ring(&self, eps: &Endpoints) -> Arc<RingSnapshot> {
        self.ring.get(eps)
    }

    /// Called by the registry watch on every new snapshot: the hash ring is rebuilt here, off
    /// the call path.
    pub(crate) fn refresh_ring(&self) {
        self.ring.refresh(&self.endpoints());
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
        tried: &[String],
        health: &EndpointHealth,
    ) -> Result<String, RpcError> {
        if options.shunt_strategy == ShuntStrategy::Appoint {
            return options.appoint_address.clone().ok_or_else(|| {
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
            return Ok(eps[idx].address.clone());
        }
        if tried.is_empty() && health.is_clear() {
            // The common case: every endpoint is equally good, nothing to rank.
            let pick = match options.shunt_strategy {
                ShuntStrategy::Random => shunt::random(eps.len()),
                _ => shunt::polling(&self.counter, eps.len()),
            };
            return Ok(eps[pick].address.clone());
        }
        let ranks: Vec<u8> = eps
            .iter()
            .map(|i| rank(&i.address, tried, health))
            .collect();
        let best = ranks.iter().copied().min().unwrap_or(0);
        let group: Vec<usize> = (0..eps.len()).filter(|&i| ranks[i] == best).collect();
        let pick = match options.shunt_strategy {
            ShuntStrategy::Random => shunt::random(group.len()),
            _ => shunt::polling(&self.counter, group.len()),
        };
        Ok(eps[group[pick]].address.clone())
    }
}
