//! The governance engine of one client: the per-entry state cached by entry id (options
//! resolved from the configuration layers, circuit breaker, retry budget), endpoint health and
//! the event bus. The layers of the call stack ([`crate::stack`]) read and update it through
//! each call's [`CallCx`](crate::stack::CallCx).
//!
//! Failures that belong to one endpoint (see [`Fault`](crate::health::Fault)) are held against
//! that endpoint first ([`EndpointHealth`]): while another endpoint of the service is usable,
//! such a failure does not count toward the entry's breaker, so one sick server loses its own
//! traffic (and its keys under hash routing) instead of taking the whole entry down. Once no
//! other endpoint is usable (or there is only one), the same failures count for the entry
//! exactly as before: the breaker opens when the entry as a whole fails.
use std::sync::{Arc, OnceLock, RwLock};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use rpc_core::options::OptionLevel;
use rpc_core::{
    GovernanceOptions, GovernanceOverrides, MethodDescriptor, RpcError, ServiceEntryId,
};

use crate::breaker::{BreakerState, CircuitBreaker};
use crate::budget::RetryBudget;
use crate::config::{GovernanceConfig, Layers};
use crate::events::{EventBus, EventKind};
use crate::health::EndpointHealth;

/// The cached part of one entry's pipeline: its options and runtime state.
#[derive(Debug)]
pub struct EntryPolicy {
    pub(crate) entry: Arc<str>,
    method: &'static MethodDescriptor,
    options: ArcSwap<GovernanceOptions>,
    breaker: CircuitBreaker,
    pub(crate) budget: RetryBudget,
    /// Adaptive throttling's counts, made when the entry first has `throttle_k_percent` set.
    pub(crate) throttle: std::sync::OnceLock<crate::throttle::Throttle>,
    /// The entry's recent call latencies, made when the entry first has `hedge_percentile`
    /// set.
    pub(crate) latency: std::sync::OnceLock<crate::latency::LatencyWindow>,
    /// A later descriptor with more of the method (its attribute, its hash key) than the
    /// first one seen (see `policy_by_id`).
    attributed: arc_swap::ArcSwapOption<&'static MethodDescriptor>,
    /// Whether the caller has looked up the entry's service, so that what its instances
    /// publish is a level of the entry's options (see [`EntryPolicy::service_known`]).
    service_known: std::sync::atomic::AtomicBool,
    /// Whether a lookup of the entry's service was started in the background (for appointed
    /// calls, which do not wait for it).
    background_lookup: std::sync::atomic::AtomicBool,
    /// The background lookup failed: the next call starts another.
    lookup_again: std::sync::atomic::AtomicBool,
    /// The entry's round-robin position (see [`round_robin`](Self::round_robin)).
    round_robin: std::sync::atomic::AtomicUsize,
}

impl EntryPolicy {
    /// The entry's round-robin position, which a balancer advances by one per call it spreads
    /// by turns. One per entry, not per service: entries of one service called in turn (or
    /// routed to groups of their own) would otherwise each keep landing on the same
    /// endpoints. It starts at a random place, so that short-lived clients, and a fleet
    /// started together, do not all begin with the same endpoint.
    pub fn round_robin(&self) -> &std::sync::atomic::AtomicUsize {
        &self.round_robin
    }

    /// Whether [`set_service_known`](Self::set_service_known) was called: a client looks up
    /// an entry's service (whose instances publish settings for it) before it reads the
    /// options of the entry's first call, and says so here, so later calls skip the lookup.
    pub fn service_known(&self) -> bool {
        self.service_known
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records that the entry's service was looked up.
    pub fn set_service_known(&self) {
        self.service_known
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether this caller is the first to start the background lookup of the entry's
    /// service: once per entry, however many appointed calls ask, unless it failed (see
    /// [`background_lookup_failed`](Self::background_lookup_failed)).
    pub fn start_background_lookup(&self) -> bool {
        use std::sync::atomic::Ordering;
        let first = !self.background_lookup.swap(true, Ordering::AcqRel);
        if first {
            self.lookup_again.store(false, Ordering::Relaxed);
        }
        first
    }

    /// The background lookup failed (the registry unreachable, or too slow): the next call
    /// that asks starts another, one at a time (see
    /// [`wants_lookup_again`](Self::wants_lookup_again)).
    pub fn background_lookup_failed(&self) {
        use std::sync::atomic::Ordering;
        self.background_lookup.store(false, Ordering::Release);
        self.lookup_again.store(true, Ordering::Release);
    }

    /// Whether the entry's background lookup failed and no other has started since: its
    /// calls, which take the fast path (the service marked known), ask for one again.
    pub fn wants_lookup_again(&self) -> bool {
        self.lookup_again.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The entry's options now.
    pub fn options(&self) -> Arc<GovernanceOptions> {
        self.options.load_full()
    }

    /// The entry's breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// The entry's method: the first descriptor seen for the entry id, or a later one that
    /// carries the method's `#[governance(...)]` attribute or `#[hash_key]` argument where the
    /// first (a generic call's, made from the id alone) had none.
    pub fn method(&self) -> &'static MethodDescriptor {
        self.attributed
            .load()
            .as_deref()
            .copied()
            .unwrap_or(self.method)
    }
}

/// An entry's options in force and, for each option, the level of configuration that set it
/// ([`Governance::entry_options`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryOptions {
    /// The entry.
    pub entry: ServiceEntryId,
    /// Its options now.
    pub options: Arc<GovernanceOptions>,
    /// Every option's name with the level that set its value, in declaration order.
    pub levels: Vec<(&'static str, OptionLevel)>,
}

/// The governance engine of one client: per-entry pipelines cached by entry id, the layers of
/// configuration they are resolved from, endpoint health and the event bus.
#[derive(Debug)]
pub struct Governance {
    layers: RwLock<Layers>,
    cache: DashMap<ServiceEntryId, Arc<EntryPolicy>, ahash::RandomState>,
    /// The policies of the first methods seen, by the address of their `'static` descriptor:
    /// every call looks its entry's policy up, and a slot read is one load and a compare where
    /// the map hashes the entry id and takes a shard lock. A slot is set once and never
    /// changes (a policy is never replaced: options change inside it), so it cannot go stale;
    /// methods whose slot is taken use the map.
    fast: [OnceLock<(usize, Arc<EntryPolicy>)>; FAST_SLOTS],
    health: EndpointHealth,
    events: EventBus,
    /// Sections of the config file and environment already reported as naming no published
    /// entry ([`unpublished_sections`](Governance::unpublished_sections)).
    reported: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// Slots of [`Governance::policy`]'s fast path.
const FAST_SLOTS: usize = 64;

/// The slot of a descriptor's address (Fibonacci hashing: descriptors sit next to each other
/// in their service's table, and their addresses differ in the low bits only).
fn fast_slot(addr: usize) -> usize {
    ((addr as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize % FAST_SLOTS
}

impl Governance {
    /// The options of entry `entry_id` of `service_id` before the entry has a descriptor:
    /// see [`Layers::by_ids`].
    pub fn options_by_ids(&self, service_id: &str, entry_id: &str) -> GovernanceOptions {
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        layers.by_ids(service_id, entry_id)
    }

    /// An engine resolving options from `layers`.
    pub fn new(layers: Layers) -> Self {
        Governance {
            layers: RwLock::new(layers),
            cache: DashMap::with_hasher(ahash::RandomState::new()),
            fast: std::array::from_fn(|_| OnceLock::new()),
            // (Capped by each failing entry's `breaker_seconds`, as its options resolve.)
            health: EndpointHealth::new(std::time::Duration::MAX),
            events: EventBus::new(),
            reported: std::sync::Mutex::default(),
        }
    }

    /// The `[entries."..."]` sections of the config file and of `RPC_GOVERNANCE` that name an
    /// entry of `service_id` (`<service id>.<method>`) none of `published` is, each with the
    /// layer it is in (`"config file"`, `"RPC_GOVERNANCE"`) and said once for the engine's
    /// life: a misspelt method's section applies to nothing, and nothing else would tell.
    /// `published` is the entry ids the service's instances publish; instances that publish
    /// none (a static list) cannot be checked, and nothing is returned for them.
    pub fn unpublished_sections(
        &self,
        service_id: &str,
        published: &[&str],
    ) -> Vec<(&'static str, String)> {
        if published.is_empty() {
            return Vec::new();
        }
        let prefix = format!("{service_id}.");
        let of_service = |id: &str| id.strip_prefix(&prefix).is_some_and(|m| !m.contains('.'));
        let found: Vec<(&'static str, String)> = {
            let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
            [
                ("config file", &layers.file),
                ("RPC_GOVERNANCE", &layers.env),
            ]
            .into_iter()
            .flat_map(|(name, layer)| layer.entries.keys().map(move |id| (name, id)))
            .filter(|(_, id)| of_service(id) && !published.contains(&id.as_str()))
            .map(|(name, id)| (name, id.clone()))
            .collect()
        };
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        let mut new: Vec<(&'static str, String)> = found
            .into_iter()
            .filter(|(name, id)| reported.insert(format!("{name}\n{id}")))
            .collect();
        new.sort();
        new
    }

    /// Local endpoint health.
    pub fn health(&self) -> &EndpointHealth {
        &self.health
    }

    /// The event bus: `events().subscribe()` receives every decision.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// The pipeline of `method`, built on first use and cached by entry id.
    pub fn policy(&self, method: &'static MethodDescriptor) -> Arc<EntryPolicy> {
        let key = std::ptr::from_ref(method) as usize;
        let slot = &self.fast[fast_slot(key)];
        if let Some((k, p)) = slot.get() {
            if *k == key {
                return p.clone();
            }
        }
        let p = self.policy_by_id(method);
        // The first method to reach a free slot keeps it.
        let _ = slot.set((key, p.clone()));
        p
    }

    fn policy_by_id(&self, method: &'static MethodDescriptor) -> Arc<EntryPolicy> {
        if let Some(p) = self.cache.get(method.entry_id).map(|p| p.clone()) {
            // The entry was first used through a descriptor without the method's attribute (a
            // generic call, made from the id alone): this one has it, and its options from now
            // on include it.
            // So too when this one marks the `#[hash_key]` argument the one in use does not (an
            // update to consistent hashing is checked against it): each time a descriptor
            // has more of the two than the one in use, and less of neither.
            let current = p.method();
            let (attribute, key) = (
                (current.governance != GovernanceOverrides::NONE)
                    .cmp(&(method.governance != GovernanceOverrides::NONE)),
                current.hash_key.is_some().cmp(&method.hash_key.is_some()),
            );
            let better = attribute.is_le() && key.is_le() && (attribute.is_lt() || key.is_lt());
            if better {
                p.attributed.store(Some(Arc::new(method)));
                let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
                p.options.store(Arc::new(layers.resolve(method)));
            }
            return p;
        }
        // The layers stay read-locked until the entry is in the cache: an update waits, then
        // refreshes it too, rather than missing an entry built from the layers it replaced.
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let options = layers.resolve(method);
        self.cache
            .entry(ServiceEntryId::from(method.entry_id))
            .or_insert_with(|| {
                if let Some(e) = layers.centre_left_out(method) {
                    tracing::warn!(
                        target: "rpc::rules",
                        entry = method.entry_id,
                        "left out of the governance rules for this entry: {}",
                        e.message()
                    );
                }
                Arc::new(EntryPolicy {
                    entry: Arc::from(method.entry_id),
                    method,
                    options: ArcSwap::from_pointee(options),
                    breaker: CircuitBreaker::new(),
                    budget: RetryBudget::new(),
                    throttle: std::sync::OnceLock::new(),
                    latency: std::sync::OnceLock::new(),
                    service_known: std::sync::atomic::AtomicBool::new(false),
                    background_lookup: std::sync::atomic::AtomicBool::new(false),
                    lookup_again: std::sync::atomic::AtomicBool::new(false),
                    // A random start: std's per-process random hash keys.
                    round_robin: std::sync::atomic::AtomicUsize::new(
                        std::hash::BuildHasher::hash_one(
                            &std::collections::hash_map::RandomState::new(),
                            method.entry_id,
                        ) as usize,
                    ),
                    attributed: arc_swap::ArcSwapOption::empty(),
                })
            })
            .clone()
    }

    /// [`update_layers`](Self::update_layers), refused (nothing changes) when the new layers
    /// give an entry this engine has already used options in force it cannot carry out
    /// ([`Layers::check_in_force`]; a strategy of the config centre's left out for an entry
    /// is not in force, and refuses nothing here).
    pub fn try_update_layers(&self, change: impl FnOnce(&mut Layers)) -> Result<(), RpcError> {
        let mut layers = self.layers.write().unwrap_or_else(|p| p.into_inner());
        let next = self.changed(&layers, change, Layers::check_in_force)?;
        *layers = next;
        let reloaded = self.refresh(&layers);
        drop(layers);
        self.announce(reloaded);
        Ok(())
    }

    /// Replaces the config centre's layer (a governance document of the rule store): refused
    /// (nothing changes) only when the layers below would give an entry this engine has used
    /// options it cannot carry out. A strategy the document asks of an entry that cannot carry
    /// it out is left out for that entry ([`Layers::centre_left_out`]): each such entry
    /// already used is returned, to be told, and one first used later is warned of then.
    /// Every client thus applies a document alike, whichever entries it has called.
    pub fn set_centre(&self, centre: GovernanceConfig) -> Result<Vec<RpcError>, RpcError> {
        let mut layers = self.layers.write().unwrap_or_else(|p| p.into_inner());
        let mut next = layers.clone();
        next.centre = centre;
        let mut left_out = Vec::new();
        for p in self.cache.iter() {
            // Only an entry this document makes unfit refuses it: one already unfit (its calls
            // refused by what a lower level asks) says nothing of the document.
            if layers.check_in_force(p.method()).is_ok() {
                next.check_in_force(p.method())?;
            }
            left_out.extend(next.centre_left_out(p.method()));
        }
        *layers = next;
        let reloaded = self.refresh(&layers);
        drop(layers);
        self.announce(reloaded);
        Ok(left_out)
    }

    /// What a rule editor asks before it writes a document: whether `change` gives an entry
    /// this engine has already used options it cannot carry out, a strategy of the config
    /// centre's that would be left out included ([`Layers::check`], stricter than
    /// [`try_update_layers`](Self::try_update_layers)); nothing changes either way.
    pub fn check_layers(&self, change: impl FnOnce(&mut Layers)) -> Result<(), RpcError> {
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        self.changed(&layers, change, Layers::check).map(drop)
    }

    /// `layers` with `change`, checked by `check` against every entry already used that passes
    /// it now: a change is refused for an entry it makes unfit, not for one a level it does
    /// not touch made unfit before (whose calls are refused already, saying why).
    fn changed(
        &self,
        layers: &Layers,
        change: impl FnOnce(&mut Layers),
        check: fn(&Layers, &MethodDescriptor) -> Result<(), RpcError>,
    ) -> Result<Layers, RpcError> {
        let mut next = layers.clone();
        change(&mut next);
        for p in self.cache.iter() {
            if check(layers, p.method()).is_ok() {
                check(&next, p.method())?;
            }
        }
        Ok(next)
    }

    /// Checks the options the layers give `method` ([`Layers::check`]).
    pub fn check(&self, method: &MethodDescriptor) -> Result<(), RpcError> {
        self.layers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .check(method)
    }

    /// Changes the configuration layers; every cached entry gets its new options for its next
    /// call and keeps its runtime state (an open breaker stays open, counters stay).
    pub fn update_layers(&self, change: impl FnOnce(&mut Layers)) {
        let mut layers = self.layers.write().unwrap_or_else(|p| p.into_inner());
        change(&mut layers);
        let reloaded = self.refresh(&layers);
        drop(layers);
        self.announce(reloaded);
    }

    /// Gives every cached entry the options `layers` resolve for it; returns the entries
    /// whose options changed, to be announced once no lock is held.
    fn refresh(&self, layers: &Layers) -> Vec<Arc<str>> {
        let mut reloaded = Vec::new();
        for p in self.cache.iter() {
            let new = layers.resolve(p.method());
            if *p.options.load_full() != new {
                p.options.store(Arc::new(new));
                reloaded.push(p.entry.clone());
            }
        }
        reloaded
    }

    /// Emits a `reload` event for each of `entries`. Called with no lock of the engine held:
    /// an observer of the events may read or change the options from its callback.
    fn announce(&self, entries: Vec<Arc<str>>) {
        for entry in entries {
            self.events
                .emit_parts(EventKind::Reload, &entry, None, 0, None);
        }
    }

    /// Replaces what the instances of `service_id` publish about its entries (the registry's
    /// entry descriptors); cached entries pick the change up on their next call. Whether it
    /// changed anything.
    pub fn publish(&self, service_id: &str, entries: Vec<(String, GovernanceOverrides)>) -> bool {
        let prefix = format!("{service_id}.");
        // An entry id is `<service id>.<method>`, and a method name has no dot: the entries of
        // `shop.Greeter.v2` are not those of `shop.Greeter`.
        let of_service = |id: &str| id.strip_prefix(&prefix).is_some_and(|m| !m.contains('.'));
        let unchanged = {
            let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
            let current: Vec<_> = layers
                .published
                .entries
                .iter()
                .filter(|(id, _)| of_service(id))
                .collect();
            current.len() == entries.len()
                && entries
                    .iter()
                    .all(|(id, o)| layers.published.entries.get(id) == Some(o))
        };
        if unchanged {
            return false;
        }
        self.update_layers(|l| {
            l.published.entries.retain(|id, _| !of_service(id));
            l.published.entries.extend(entries);
        });
        true
    }

    /// The state of every cached entry's breaker.
    pub fn breakers(&self) -> Vec<(ServiceEntryId, BreakerState)> {
        self.cache
            .iter()
            .map(|p| (p.key().clone(), p.breaker.state()))
            .collect()
    }

    /// The options in force for every entry this engine has used, with the level that set
    /// each, sorted by entry id.
    pub fn entry_options(&self) -> Vec<EntryOptions> {
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<EntryOptions> = self
            .cache
            .iter()
            .map(|p| EntryOptions {
                entry: p.key().clone(),
                options: p.options(),
                levels: layers.levels(p.method()),
            })
            .collect();
        out.sort_by(|a, b| a.entry.as_str().cmp(b.entry.as_str()));
        out
    }

    /// The descriptor of an entry this engine has used, by its id.
    pub fn method_of(&self, entry_id: &str) -> Option<&'static MethodDescriptor> {
        self.cache.get(entry_id).map(|p| p.method())
    }

    /// [`isolate`](Self::isolate) by entry id, for an operator who has no descriptor at hand
    /// (an admin endpoint). Returns `false`, changing nothing, when this engine has not used
    /// the entry.
    pub fn isolate_entry(&self, entry_id: &str) -> bool {
        match self.method_of(entry_id) {
            Some(method) => {
                self.isolate(method);
                true
            }
            None => false,
        }
    }

    /// [`reset_breaker`](Self::reset_breaker) by entry id; `false`, changing nothing, when this
    /// engine has not used the entry.
    pub fn reset_breaker_entry(&self, entry_id: &str) -> bool {
        match self.method_of(entry_id) {
            Some(method) => {
                self.reset_breaker(method);
                true
            }
            None => false,
        }
    }

    /// Opens `method`'s breaker until [`reset_breaker`](Self::reset_breaker), as an operator
    /// decision: emits an [`EventKind::Isolate`] event.
    pub fn isolate(&self, method: &'static MethodDescriptor) {
        let policy = self.policy(method);
        policy.breaker.isolate();
        self.events.emit_parts(
            EventKind::Isolate,
            &policy.entry,
            None,
            0,
            Some("isolated by an operator".into()),
        );
    }

    /// Closes `method`'s breaker and forgets its failures, as an operator decision: emits an
    /// [`EventKind::Reset`] event.
    pub fn reset_breaker(&self, method: &'static MethodDescriptor) {
        let policy = self.policy(method);
        policy.breaker.reset();
        self.events.emit_parts(
            EventKind::Reset,
            &policy.entry,
            None,
            0,
            Some("reset by an operator".into()),
        );
    }
}

#[cfg(test)]
mod tests {
    use rpc_core::{GovernanceOverrides, MethodDescriptor, ShuntStrategy};

    use super::*;

    /// A method of `service_id` with no `#[hash_key]` and no attribute options.
    const fn keyless(
        service_id: &'static str,
        method: &'static str,
        entry_id: &'static str,
    ) -> MethodDescriptor {
        MethodDescriptor {
            service_id,
            method,
            entry_id,
            hash_key: None,
            governance: GovernanceOverrides::NONE,
            api: None,
        }
    }

    /// An observer of the events may read and change the options from its callback: the
    /// `reload` events of a change are emitted once no lock of the engine is held (before, the
    /// observer ran under the options' write lock and the entry cache's, and reading the
    /// options there, or using an entry first, hung the thread for good).
    #[test]
    fn an_event_observer_may_read_the_options_while_they_reload() {
        static FIRST: MethodDescriptor = keyless("t.T", "m", "t.T.m");
        static LATER: MethodDescriptor = keyless("t.T", "n", "t.T.n");
        let g = Arc::new(Governance::new(Layers::default()));
        g.policy(&FIRST);
        let (seen_tx, seen) = std::sync::mpsc::channel();
        let weak = Arc::downgrade(&g);
        g.events().set_observer(Arc::new(move |e| {
            if e.kind != EventKind::Reload {
                return;
            }
            if let Some(g) = weak.upgrade() {
                g.policy(&LATER);
                let _ = seen_tx.send(g.entry_options().len());
            }
        }));
        let (done_tx, done) = std::sync::mpsc::channel();
        let updating = g.clone();
        std::thread::spawn(move || {
            updating.update_layers(|l| {
                l.runtime.entries.insert(
                    "t.T.m".into(),
                    GovernanceOverrides {
                        timeout_ms: Some(1234),
                        ..GovernanceOverrides::NONE
                    },
                );
            });
            let _ = done_tx.send(());
        });
        done.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the update returned");
        assert_eq!(seen.try_recv(), Ok(2), "the observer read both entries");
        assert_eq!(g.policy(&FIRST).options().timeout_ms, 1234);
    }

    /// A section of the config file or the environment naming a method the service's
    /// instances do not publish is reported, once; sections of published entries, of another
    /// service (`shop.Orders.v2.get`), of the runtime and config-centre layers, and of a
    /// service whose instances publish nothing are not.
    #[test]
    fn a_section_naming_no_published_entry_is_reported_once() {
        let section = |text: &str| GovernanceConfig::from_toml(text).expect("toml");
        let layers = Layers {
            file: section(
                r#"
                [entries."shop.Orders.get"]
                timeout_ms = 100
                [entries."shop.Orders.gett"]
                timeout_ms = 100
                [entries."shop.Orders.v2.get"]
                timeout_ms = 100
                "#,
            ),
            env: section("[entries.\"shop.Orders.lsit\"]\nretry_times = 1\n"),
            centre: section("[entries.\"shop.Orders.old\"]\nretry_times = 1\n"),
            runtime: section("[entries.\"shop.Orders.later\"]\nretry_times = 1\n"),
            ..Layers::default()
        };
        let g = Governance::new(layers);
        let published = ["shop.Orders.get", "shop.Orders.list"];
        assert_eq!(
            g.unpublished_sections("shop.Orders", &published),
            [
                ("RPC_GOVERNANCE", "shop.Orders.lsit".to_string()),
                ("config file", "shop.Orders.gett".to_string()),
            ]
        );
        assert!(g.unpublished_sections("shop.Orders", &published).is_empty());
        assert!(g.unpublished_sections("shop.Orders.v2", &[]).is_empty());
        assert_eq!(
            g.unpublished_sections("shop.Orders.v2", &["shop.Orders.v2.list"]),
            [("config file", "shop.Orders.v2.get".to_string())]
        );
    }

    /// An entry first called by id (a descriptor without its `#[hash_key]`), then through its
    /// typed proxy (with it): an update to consistent hashing is checked against the proxy's,
    /// and taken. Before, the first descriptor's lack of a key refused it.
    #[tokio::test(start_paused = true)]
    async fn a_later_descriptors_hash_key_allows_hashing() {
        static BY_ID: MethodDescriptor = MethodDescriptor {
            service_id: "h.H",
            method: "m",
            entry_id: "h.H.m",
            hash_key: None,
            governance: GovernanceOverrides::NONE,
            api: None,
        };
        static TYPED: MethodDescriptor = MethodDescriptor {
            service_id: "h.H",
            method: "m",
            entry_id: "h.H.m",
            hash_key: Some(0),
            governance: GovernanceOverrides::NONE,
            api: None,
        };
        let g = Governance::new(Layers::default());
        g.policy(&BY_ID);
        g.policy(&TYPED);
        let hashing = GovernanceOverrides {
            shunt_strategy: Some(ShuntStrategy::Hash),
            ..GovernanceOverrides::NONE
        };
        let updated = g.try_update_layers(|l| {
            l.runtime.entries.insert("h.H.m".into(), hashing);
        });
        assert!(updated.is_ok(), "{updated:?}");
    }

    /// A check of layers the entries in use cannot carry out says why, as the update would,
    /// and changes nothing; one they can carry out changes nothing either.
    #[tokio::test(start_paused = true)]
    async fn checked_layers_are_refused_as_updated_ones_and_change_nothing() {
        static KEYLESS: MethodDescriptor = keyless("k.K", "m", "k.K.m");
        let g = Governance::new(Layers::default());
        let before = g.policy(&KEYLESS).options.load_full();
        let hashing = |l: &mut Layers| {
            l.runtime.entries.insert(
                "k.K.m".into(),
                GovernanceOverrides {
                    shunt_strategy: Some(ShuntStrategy::Hash),
                    ..GovernanceOverrides::NONE
                },
            );
        };
        let checked = g.check_layers(hashing).expect_err("no hash key");
        let updated = g.try_update_layers(hashing).expect_err("no hash key");
        assert_eq!(checked.message(), updated.message());
        let slower = |l: &mut Layers| {
            l.runtime.entries.insert(
                "k.K.m".into(),
                GovernanceOverrides {
                    timeout_ms: Some(before.timeout_ms + 1),
                    ..GovernanceOverrides::NONE
                },
            );
        };
        g.check_layers(slower)
            .expect("a timeout can be carried out");
        assert_eq!(*g.policy(&KEYLESS).options.load_full(), *before);
        g.try_update_layers(slower).expect("taken");
        assert_eq!(
            g.policy(&KEYLESS).options.load_full().timeout_ms,
            before.timeout_ms + 1
        );
    }

    /// An entry already unfit (the config file asks hashing of its service, and it has no
    /// `#[hash_key]`; its calls are refused) refuses no change that leaves it so: neither a
    /// config-centre document nor an update of another entry. A change that makes a fit entry
    /// unfit is still refused.
    #[tokio::test(start_paused = true)]
    async fn an_entry_unfit_before_refuses_no_change_of_others() {
        static KEYLESS: MethodDescriptor = keyless("k.K", "m", "k.K.m");
        static OTHER: MethodDescriptor = keyless("o.O", "m", "o.O.m");
        let file = GovernanceConfig::from_toml("[services.\"k.K\"]\nshunt_strategy = \"hash\"\n")
            .expect("toml");
        let g = Governance::new(Layers {
            file,
            ..Layers::default()
        });
        g.policy(&KEYLESS);
        g.policy(&OTHER);
        assert!(g.check(&KEYLESS).is_err(), "unfit from the start");
        let centre =
            GovernanceConfig::from_toml("[entries.\"o.O.m\"]\ntimeout_ms = 100\n").expect("toml");
        let applied = g.set_centre(centre);
        assert!(applied.is_ok(), "{applied:?}");
        assert_eq!(g.policy(&OTHER).options.load_full().timeout_ms, 100);
        let updated = g.try_update_layers(|l| {
            l.runtime.entries.insert(
                "o.O.m".into(),
                GovernanceOverrides {
                    timeout_ms: Some(200),
                    ..GovernanceOverrides::NONE
                },
            );
        });
        assert!(updated.is_ok(), "{updated:?}");
        assert_eq!(g.policy(&OTHER).options.load_full().timeout_ms, 200);
        // Hashing asked of the fit one is still refused.
        let hashing = g.try_update_layers(|l| {
            l.runtime.entries.insert(
                "o.O.m".into(),
                GovernanceOverrides {
                    shunt_strategy: Some(ShuntStrategy::Hash),
                    ..GovernanceOverrides::NONE
                },
            );
        });
        assert!(hashing.is_err());
    }

    /// `breaker_seconds` set in the config file caps an endpoint's unhealthy marks as it does
    /// when set in code: a mark doubles per failure in a row up to it (1, 2, 2, ... s here).
    #[tokio::test(start_paused = true)]
    async fn breaker_seconds_of_any_level_caps_endpoint_marks() {
        static M: MethodDescriptor = keyless("b.B", "m", "b.B.m");
        let file = GovernanceConfig::from_toml("[defaults]\nbreaker_seconds = 2\n").expect("toml");
        let g = Governance::new(Layers {
            file,
            ..Layers::default()
        });
        let options = g.policy(&M).options.load_full();
        let marks: Vec<Option<std::time::Duration>> = (0..5)
            .map(|_| {
                g.health()
                    .record_failure(
                        "10.0.0.1:1",
                        crate::health::Fault::Transport,
                        None,
                        "x",
                        &options,
                    )
                    .ejected_for
            })
            .collect();
        let secs = |n: u64| Some(std::time::Duration::from_secs(n));
        assert_eq!(marks, [secs(1), secs(2), secs(2), secs(2), secs(2)]);
    }

    /// A descriptor with less of the method than the one in use (a generic call's, with the
    /// published hash key but without the attribute the typed proxy's has) does not replace
    /// it: the attribute's options stay.
    #[tokio::test(start_paused = true)]
    async fn a_descriptor_with_less_of_the_method_does_not_replace_the_one_in_use() {
        static TYPED: MethodDescriptor = MethodDescriptor {
            service_id: "a.A",
            method: "m",
            entry_id: "a.A.m",
            hash_key: None,
            governance: GovernanceOverrides {
                timeout_ms: Some(800),
                ..GovernanceOverrides::NONE
            },
            api: None,
        };
        static GENERIC: MethodDescriptor = MethodDescriptor {
            service_id: "a.A",
            method: "m",
            entry_id: "a.A.m",
            hash_key: Some(0),
            governance: GovernanceOverrides::NONE,
            api: None,
        };
        let g = Governance::new(Layers::default());
        g.policy(&TYPED);
        let p = g.policy(&GENERIC);
        assert_eq!(p.options().timeout_ms, 800);
        assert!(std::ptr::eq(p.method(), &TYPED));
    }

    /// Descriptors of `n` entries of one service, as a generated table lays them out.
    fn table(n: usize) -> &'static [MethodDescriptor] {
        let v: Vec<MethodDescriptor> = (0..n)
            .map(|i| MethodDescriptor {
                service_id: "t.T",
                method: Box::leak(format!("m{i}").into_boxed_str()),
                entry_id: Box::leak(format!("t.T.m{i}").into_boxed_str()),
                hash_key: None,
                governance: GovernanceOverrides::NONE,
                api: None,
            })
            .collect();
        Box::leak(v.into_boxed_slice())
    }

    #[test]
    fn an_entry_first_called_generically_takes_the_attribute_of_a_later_proxy() {
        // A generic call's descriptor (made from the id alone), then a proxy's.
        static GENERIC: MethodDescriptor = MethodDescriptor {
            service_id: "shop.Greeter",
            method: "greet",
            entry_id: "shop.Greeter.greet",
            hash_key: None,
            governance: GovernanceOverrides::NONE,
            api: None,
        };
        static PROXY: MethodDescriptor = MethodDescriptor {
            service_id: "shop.Greeter",
            method: "greet",
            entry_id: "shop.Greeter.greet",
            hash_key: None,
            governance: GovernanceOverrides {
                timeout_ms: Some(800),
                ..GovernanceOverrides::NONE
            },
            api: None,
        };
        let g = Governance::new(Layers::default());
        let first = g.policy(&GENERIC);
        assert_eq!(first.options().timeout_ms, 5000, "no attribute seen yet");
        let later = g.policy(&PROXY);
        assert!(Arc::ptr_eq(&first, &later), "one entry, one state");
        assert_eq!(later.options().timeout_ms, 800, "the attribute applies");
        assert_eq!(g.policy(&GENERIC).options().timeout_ms, 800);
        // And stays through a refresh.
        g.update_layers(|_| {});
        assert_eq!(g.policy(&GENERIC).options().timeout_ms, 800);
    }

    #[test]
    fn publishing_a_service_leaves_a_service_whose_id_extends_it_alone() {
        static V2: MethodDescriptor = MethodDescriptor {
            service_id: "shop.Greeter.v2",
            method: "greet",
            entry_id: "shop.Greeter.v2.greet",
            hash_key: None,
            governance: GovernanceOverrides::NONE,
            api: None,
        };
        let g = Governance::new(Layers::default());
        let slow = GovernanceOverrides {
            timeout_ms: Some(9000),
            ..GovernanceOverrides::NONE
        };
        g.publish("shop.Greeter.v2", vec![(V2.entry_id.into(), slow.clone())]);
        assert_eq!(g.policy(&V2).options().timeout_ms, 9000);
        g.publish("shop.Greeter", vec![("shop.Greeter.greet".into(), slow)]);
        assert_eq!(
            g.policy(&V2).options().timeout_ms,
            9000,
            "shop.Greeter's snapshot did not erase shop.Greeter.v2's"
        );
    }

    #[test]
    fn every_method_gets_its_own_entrys_policy_and_runtime_updates_reach_it() {
        let g = Governance::new(Layers::default());
        // More methods than fast slots, so some share a slot and go to the map.
        let methods = table(3 * FAST_SLOTS);
        for _ in 0..2 {
            for m in methods {
                let p = g.policy(m);
                assert_eq!(p.method().entry_id, m.entry_id);
                assert!(Arc::ptr_eq(&p, &g.policy(m)), "one policy per entry");
            }
        }
        // Another descriptor of an entry already seen (same id, another address): its policy.
        let m5 = &methods[5];
        let twin: &'static MethodDescriptor = Box::leak(Box::new(MethodDescriptor {
            service_id: m5.service_id,
            method: m5.method,
            entry_id: m5.entry_id,
            hash_key: None,
            governance: GovernanceOverrides::NONE,
            api: None,
        }));
        assert!(Arc::ptr_eq(&g.policy(twin), &g.policy(&methods[5])));
        // A runtime update reaches the next lookup of each entry, whichever path it takes.
        g.update_layers(|l| {
            for m in methods {
                l.runtime.entries.insert(
                    m.entry_id.to_string(),
                    GovernanceOverrides {
                        timeout_ms: Some(1_234),
                        ..GovernanceOverrides::NONE
                    },
                );
            }
        });
        for m in methods {
            assert_eq!(g.policy(m).options().timeout_ms, 1_234, "{}", m.entry_id);
        }
    }
}
