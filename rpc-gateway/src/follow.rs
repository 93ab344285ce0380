//! Following the registry: the services it knows, each one's instances, and from them the route
//! table, rebuilt and swapped whenever any of them changes.
//!
//! Why polling beside the watches: a [`Registry`] announces the changes of a service it is asked
//! about (its watch), but has no watch over the list of services itself, so a service that
//! appears after the gateway started is found by asking [`Registry::services`] again every
//! discovery interval; from then on its own watch carries every change at once.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rpc_core::{ServiceEntry, ServiceId};
use rpc_registry::{Registry, ServiceWatch};
use tokio::sync::{mpsc, watch};
use tokio::task::{AbortHandle, JoinSet};

use crate::table::RouteTable;

/// What requests read: the current table, and its version for those waiting on a change.
pub(crate) struct Shared {
    pub table: ArcSwap<RouteTable>,
    pub version: watch::Sender<u64>,
}

/// The task keeping [`Shared`] up to date.
pub(crate) struct Follower {
    registry: Arc<dyn Registry>,
    shared: Arc<Shared>,
    /// Each followed service's watch, and its watcher task.
    watches: BTreeMap<ServiceId, (ServiceWatch, AbortHandle)>,
    watchers: JoinSet<()>,
    /// `None`: a watched service changed; `Some(id)`: its watch ended (the registry closed it),
    /// so it is dropped and watched again at the next discovery.
    events: mpsc::UnboundedSender<Option<ServiceId>>,
    received: mpsc::UnboundedReceiver<Option<ServiceId>>,
    last: Vec<ServiceEntry>,
    /// Entries the table could not be built from: not tried again until they change.
    failed: Option<Vec<ServiceEntry>>,
    /// Services whose watch the registry closed at least once: said once as a warning, then
    /// at debug level (a static list closes every watch at once, at every discovery).
    closed_before: BTreeSet<ServiceId>,
    /// Followed services the last discovery found unlisted and empty: let go if the next
    /// finds them so too (a single instance restarting is gone for a moment only).
    missing: BTreeSet<ServiceId>,
}

impl Follower {
    pub(crate) fn new(registry: Arc<dyn Registry>, shared: Arc<Shared>) -> Self {
        let (events, received) = mpsc::unbounded_channel();
        Follower {
            registry,
            shared,
            watches: BTreeMap::new(),
            watchers: JoinSet::new(),
            events,
            received,
            last: Vec::new(),
            failed: None,
            closed_before: BTreeSet::new(),
            missing: BTreeSet::new(),
        }
    }

    /// Watches every service the registry lists that is not watched yet, and lets go of the
    /// services it no longer lists that have had no instance left for two discoveries in a
    /// row (see [`apply`](Self::apply)).
    pub(crate) async fn discover(&mut self) {
        let found = find(
            self.registry.clone(),
            self.watches.keys().cloned().collect(),
        )
        .await;
        self.apply(found);
    }

    /// Takes in what a discovery found: watches the services newly listed, and lets go of the
    /// services it no longer lists that have had no instance left for two discoveries in a
    /// row (and of the tasks of watches that ended: a registry that closes its watches at
    /// once, as a static list does, would otherwise leave one more finished task per service
    /// and discovery). Service ids that come and go (`shop.Orders.v41`, then `.v42`) would
    /// otherwise each keep a watch, its task and the registry's own watch for the life of the
    /// gateway.
    fn apply(&mut self, found: Option<Found>) {
        while self.watchers.try_join_next().is_some() {}
        let Some(Found { services, watches }) = found else {
            return;
        };
        let missing = &mut self.missing;
        self.watches.retain(|service, (watch, task)| {
            if services.contains(service) || !watch.current().is_empty() {
                missing.remove(service);
                return true;
            }
            if missing.insert(service.clone()) {
                // Gone at this discovery: kept until the next, in case it is back by then.
                return true;
            }
            missing.remove(service);
            tracing::debug!(service = %service.as_str(), "the registry no longer lists a service: the gateway stops watching it");
            task.abort();
            false
        });
        for (service, mut watch) in watches {
            if self.watches.contains_key(&service) {
                continue;
            }
            let followed = watch.clone();
            let events = self.events.clone();
            let name = service.clone();
            let task = self.watchers.spawn(async move {
                while watch.changed().await.is_ok() {
                    let _ = events.send(None);
                }
                let _ = events.send(Some(name));
            });
            self.watches.insert(service, (followed, task));
        }
    }

    /// Builds the table from the watches' current snapshots, and swaps it in when its entries
    /// differ from the last one's.
    ///
    /// Instances of one service may run different builds (a rolling upgrade): each entry is
    /// described as the first instance by address that publishes a description of it says
    /// (older builds publish none), as its published governance is chosen; instances that
    /// describe it otherwise are reported.
    pub(crate) fn rebuild(&mut self) {
        let mut entries: Vec<ServiceEntry> = Vec::new();
        let mut disagree: Vec<String> = Vec::new();
        let mut misnamed: Vec<String> = Vec::new();
        for (service, (watch, _)) in &self.watches {
            for instance in watch.current().iter() {
                for entry in instance.entries.iter().filter(|e| &e.service_id == service) {
                    // Its route comes from its service and method, its calls go by its id: an
                    // entry whose id is not `<service>.<method>` would be served at one
                    // entry's route and call another (or take another's route from it).
                    // (Split as the client splits an id, at its last dot: a method named with
                    // a dot would call another service's entry.)
                    let split = entry.id.as_str().rsplit_once('.');
                    if split != Some((entry.service_id.as_str(), entry.method.as_str())) {
                        misnamed.push(format!("{} at {}", entry.id, instance.address));
                        continue;
                    }
                    match entries.iter_mut().find(|e| e.id == entry.id) {
                        None => entries.push(entry.clone()),
                        Some(kept) if kept.api.is_none() => *kept = entry.clone(),
                        Some(kept) => {
                            if entry.api.is_some() && entry.api != kept.api {
                                disagree.push(format!("{} at {}", entry.id, instance.address));
                            }
                        }
                    }
                }
            }
        }
        // In entry id order: of two entries declaring one route, the first by id keeps it.
        entries.sort_by(|a, b| a.id.cmp(&b.id));
        if entries == self.last {
            return;
        }
        if !misnamed.is_empty() {
            tracing::warn!(
                entries = %misnamed.join(", "),
                "instances publish these entries under an id that is not their service and \
                 method: the gateway does not serve them"
            );
        }
        if !disagree.is_empty() {
            tracing::warn!(
                instances = %disagree.join(", "),
                "instances describe these entries otherwise than the first instance by address \
                 that describes them, whose description the gateway serves (a rolling upgrade \
                 not finished?)"
            );
        }
        // Entries come from servers the gateway does not control: should one of them make the
        // table's building panic (the matcher panics on some templates it is not meant to be
        // given), the routes stay as they were rather than the follower ending for good, and
        // the next change of the entries tries again.
        if self.failed.as_ref() == Some(&entries) {
            return;
        }
        let built = std::panic::catch_unwind(|| RouteTable::build(entries.clone()));
        let Ok(table) = built else {
            tracing::error!("the gateway could not build its routes from the entries published; it keeps the routes it has");
            self.failed = Some(entries);
            return;
        };
        self.failed = None;
        self.last = entries;
        tracing::info!(
            entries = table.served().len(),
            "the gateway's routes changed"
        );
        self.shared.table.store(Arc::new(table));
        self.shared.version.send_modify(|v| *v += 1);
    }

    fn closed(&mut self, event: Option<ServiceId>) {
        if let Some(service) = event {
            if self.closed_before.insert(service.clone()) {
                tracing::warn!(service = %service.as_str(), "the registry closed a service's watch; the gateway watches it again at the next discovery");
            } else {
                tracing::debug!(service = %service.as_str(), "the registry closed a service's watch again");
            }
            self.watches.remove(&service);
            // Watched again afresh at the next discovery: its absences start over.
            self.missing.remove(&service);
        }
    }

    /// Follows the registry until the task is aborted: a change of any watched service
    /// rebuilds at once, while a discovery is under way too (a registry slow to list its
    /// services or to open a watch delays finding new services only); every `interval` after
    /// the last discovery ended, new services are looked for.
    pub(crate) async fn run(mut self, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut finding: Option<Pin<Box<dyn Future<Output = Option<Found>> + Send>>> = None;
        loop {
            tokio::select! {
                _ = tick.tick(), if finding.is_none() => {
                    let followed = self.watches.keys().cloned().collect();
                    finding = Some(Box::pin(find(self.registry.clone(), followed)));
                }
                found = async { finding.as_mut().expect("polled while finding").await }, if finding.is_some() => {
                    finding = None;
                    self.apply(found);
                    tick.reset();
                }
                Some(event) = self.received.recv() => self.closed(event),
            }
            // Changes that came meanwhile are in this rebuild too.
            while let Ok(event) = self.received.try_recv() {
                self.closed(event);
            }
            self.rebuild();
        }
    }
}

/// What a discovery found: the services the registry lists, and a watch of each of them not
/// followed when it began.
pub(crate) struct Found {
    services: Vec<ServiceId>,
    watches: Vec<(ServiceId, ServiceWatch)>,
}

/// Lists the registry's services and watches those not in `followed`; `None` when the list
/// cannot be had (the routes stay as they are). A service whose watch cannot be opened is
/// watched at a later discovery.
async fn find(registry: Arc<dyn Registry>, followed: BTreeSet<ServiceId>) -> Option<Found> {
    let services = match registry.services().await {
        Ok(services) => services,
        Err(e) => {
            tracing::warn!(error = %e, "the gateway cannot list the registry's services; it keeps the routes it has and asks again");
            return None;
        }
    };
    let mut watches = Vec::new();
    for service in services.iter().filter(|s| !followed.contains(*s)) {
        match registry.watch(service).await {
            Ok(watch) => watches.push((service.clone(), watch)),
            Err(e) => {
                tracing::warn!(service = %service.as_str(), error = %e, "the gateway cannot watch a service; it tries again at the next discovery");
            }
        }
    }
    Some(Found { services, watches })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service the registry no longer lists, with no instance left at two discoveries in a
    /// row, is let go: its watch and watcher task are not kept for the life of the gateway.
    /// One gone at a single discovery only (an instance restarting) is kept.
    #[tokio::test]
    async fn services_gone_from_the_registry_are_let_go() {
        use rpc_registry::{InProcessRegistry, Instance};
        let registry = InProcessRegistry::new();
        let shared = Arc::new(Shared {
            table: ArcSwap::from_pointee(RouteTable::default()),
            version: watch::channel(0).0,
        });
        let mut follower = Follower::new(Arc::new(registry.clone()), shared);
        let watched = |f: &Follower| f.watches.keys().map(|s| s.to_string()).collect::<Vec<_>>();
        for version in 41..44 {
            let id = format!("shop.Orders.v{version}");
            let address = format!("127.0.0.1:{version}");
            registry
                .register(Instance::new(address.as_str(), [id.as_str()]))
                .await
                .expect("register");
            follower.discover().await;
            follower.discover().await;
            assert_eq!(
                watched(&follower),
                std::slice::from_ref(&id),
                "v{version} only"
            );
            registry.deregister(&address).await.expect("deregister");
            // Gone at one discovery: kept, and still followed when it is back.
            follower.discover().await;
            assert_eq!(
                watched(&follower),
                std::slice::from_ref(&id),
                "v{version} gone once"
            );
            registry
                .register(Instance::new(address.as_str(), [id.as_str()]))
                .await
                .expect("register again");
            follower.discover().await;
            registry.deregister(&address).await.expect("deregister");
        }
        follower.discover().await;
        follower.discover().await;
        assert!(watched(&follower).is_empty(), "{:?}", watched(&follower));
        // The aborted watcher tasks are gone once joined.
        while follower.watchers.join_next().await.is_some() {}
        assert!(follower.watchers.is_empty());
    }

    /// An entry is served as described by the first instance that describes it, not by an
    /// older build before it (by address) that publishes no description: its declared route
    /// is served, whichever instance started first or took the lower port.
    #[tokio::test]
    async fn an_entry_is_served_as_the_instance_that_describes_it_says() {
        use crate::route::test_entries::{entry, routed};
        use rpc_registry::{InProcessRegistry, Instance};
        let with = |address: &str, e: ServiceEntry| {
            let mut instance = Instance::new(address, ["shop.Orders"]);
            instance.entries = vec![e];
            instance
        };
        let described = routed("shop.Orders", "get", &["id"], Some(("get", "/orders/{id}")));
        for (old, new) in [
            ("127.0.0.1:7001", "127.0.0.1:7002"),
            ("127.0.0.1:7002", "127.0.0.1:7001"),
        ] {
            let registry = InProcessRegistry::new();
            registry
                .register(with(old, entry("shop.Orders", "get", None)))
                .await
                .expect("register the older build");
            registry
                .register(with(new, described.clone()))
                .await
                .expect("register the newer build");
            let table = table_of(registry).await;
            let routes: Vec<String> = table
                .served()
                .iter()
                .map(|s| s.route.path.clone())
                .collect();
            assert_eq!(routes, ["/orders/{id}"], "older build at {old}");
        }
    }

    /// The route table a gateway's follower builds from what `registry` holds now.
    async fn table_of(registry: rpc_registry::InProcessRegistry) -> Arc<RouteTable> {
        let shared = Arc::new(Shared {
            table: ArcSwap::from_pointee(RouteTable::default()),
            version: watch::channel(0).0,
        });
        let mut follower = Follower::new(Arc::new(registry), shared.clone());
        follower.discover().await;
        follower.rebuild();
        shared.table.load_full()
    }

    /// An entry published under an id that is not its service and method is not served: it
    /// would take another entry's route, or be served at one route and call another entry.
    #[tokio::test]
    async fn an_entry_whose_id_is_not_its_service_and_method_is_not_served() {
        use crate::route::test_entries::{entry, routed};
        use rpc_registry::{InProcessRegistry, Instance};
        let registry = InProcessRegistry::new();
        let mut real = Instance::new("127.0.0.1:7001", ["bank.Accounts"]);
        real.entries = vec![entry("bank.Accounts", "transfer", None)];
        registry.register(real).await.expect("register");
        // Described, and of a service before the real one by id: it would be kept.
        let mut other = Instance::new("127.0.0.1:7002", ["aaa.X"]);
        let mut misnamed = routed("aaa.X", "transfer", &["to", "from"], None);
        misnamed.id = "bank.Accounts.transfer".into();
        other.entries = vec![misnamed];
        registry.register(other).await.expect("register");
        let table = table_of(registry).await;
        let served: Vec<(String, String)> = table
            .served()
            .iter()
            .map(|s| (s.route.path.clone(), s.entry.id.as_str().to_string()))
            .collect();
        assert_eq!(
            served,
            [(
                "/api/bank.Accounts/transfer".to_string(),
                "bank.Accounts.transfer".to_string()
            )]
        );
    }

    /// An entry whose method name holds a dot (`bank` + `Accounts.transfer`) has the id of
    /// another service's entry (`bank.Accounts.transfer`), which a call by that id reaches: it
    /// is misnamed, not served, and the real entry keeps its route and its parameters.
    /// (Before, service `bank` sorted first and its description was kept: the real default
    /// route answered 404, and the rogue route called the real entry with the arguments in
    /// its own order.)
    #[tokio::test]
    async fn an_entry_whose_method_holds_a_dot_is_misnamed() {
        use crate::route::test_entries::routed;
        use rpc_registry::{InProcessRegistry, Instance};
        let registry = InProcessRegistry::new();
        let mut real = Instance::new("127.0.0.1:7001", ["bank.Accounts"]);
        real.entries = vec![routed("bank.Accounts", "transfer", &["from", "to"], None)];
        registry.register(real).await.expect("register");
        let mut rogue = Instance::new("127.0.0.1:7002", ["bank"]);
        rogue.entries = vec![routed("bank", "Accounts.transfer", &["to", "from"], None)];
        registry.register(rogue).await.expect("register");
        let table = table_of(registry).await;
        let served: Vec<(String, String, Vec<String>)> = table
            .served()
            .iter()
            .map(|s| {
                let params = s.entry.api.as_ref().map(|a| a.params.clone());
                (
                    s.route.path.clone(),
                    s.entry.id.as_str().to_string(),
                    params.unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            served,
            [(
                "/api/bank.Accounts/transfer".to_string(),
                "bank.Accounts.transfer".to_string(),
                vec!["from".to_string(), "to".to_string()]
            )]
        );
    }

    /// A registry whose `services` does not answer while `stalled` (cut off, its client
    /// waiting for its timeout); everything else it does at once.
    #[derive(Default)]
    struct Stalled {
        inner: rpc_registry::InProcessRegistry,
        stalled: std::sync::atomic::AtomicBool,
        asked: tokio::sync::Notify,
    }

    impl Registry for Stalled {
        fn register(
            &self,
            instance: rpc_registry::Instance,
        ) -> futures_util::future::BoxFuture<'_, Result<(), rpc_registry::RegistryError>> {
            self.inner.register(instance)
        }
        fn deregister<'a>(
            &'a self,
            instance_id: &'a str,
        ) -> futures_util::future::BoxFuture<'a, Result<(), rpc_registry::RegistryError>> {
            self.inner.deregister(instance_id)
        }
        fn watch<'a>(
            &'a self,
            service: &'a ServiceId,
        ) -> futures_util::future::BoxFuture<'a, Result<ServiceWatch, rpc_registry::RegistryError>>
        {
            self.inner.watch(service)
        }
        fn services(
            &self,
        ) -> futures_util::future::BoxFuture<'_, Result<Vec<ServiceId>, rpc_registry::RegistryError>>
        {
            if self.stalled.load(std::sync::atomic::Ordering::SeqCst) {
                self.asked.notify_one();
                return Box::pin(std::future::pending());
            }
            self.inner.services()
        }
    }

    /// A discovery waiting on a registry that does not answer its list of services does not
    /// hold back the services already followed: the last instance of one leaving takes its
    /// routes away at once.
    #[tokio::test(start_paused = true)]
    async fn a_followed_service_s_change_is_served_while_a_discovery_waits_for_the_registry() {
        let registry = Arc::new(Stalled::default());
        let instance = crate::route::test_entries::echo_instance("127.0.0.1:9001");
        registry.register(instance).await.expect("register");
        let shared = Arc::new(Shared {
            table: ArcSwap::from_pointee(RouteTable::default()),
            version: watch::channel(0).0,
        });
        let mut follower = Follower::new(registry.clone(), shared.clone());
        follower.discover().await;
        follower.rebuild();
        assert_eq!(
            shared.table.load().served().len(),
            1,
            "echo.Echo.echo served"
        );
        let mut version = shared.version.subscribe();
        registry
            .stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let task = tokio::spawn(follower.run(Duration::from_secs(1)));
        // The next discovery is under way, and waits for ever.
        registry.asked.notified().await;
        registry
            .deregister("127.0.0.1:9001")
            .await
            .expect("deregister");
        tokio::time::timeout(Duration::from_secs(60), version.changed())
            .await
            .expect("the routes follow the change while the discovery waits")
            .expect("the follower runs");
        assert!(shared.table.load().served().is_empty());
        task.abort();
    }

    /// A static list closes every watch at once, and the next discovery watches the service
    /// again: the ended watchers' tasks do not pile up.
    #[tokio::test]
    async fn the_tasks_of_ended_watches_do_not_pile_up() {
        let registry = rpc_registry::StaticRegistry::from_toml(
            "[[endpoint]]\naddress = \"127.0.0.1:9001\"\nservices = [\"echo.Echo\"]\n",
        )
        .expect("a static list");
        let shared = Arc::new(Shared {
            table: ArcSwap::from_pointee(RouteTable::default()),
            version: watch::channel(0).0,
        });
        let mut follower = Follower::new(Arc::new(registry), shared);
        for _ in 0..20 {
            follower.discover().await;
            // The watcher says its watch ended as the last thing it does.
            let event = follower.received.recv().await.expect("the watch ended");
            follower.closed(event);
        }
        assert!(
            follower.watchers.len() <= 1,
            "{} tasks kept after 20 discoveries",
            follower.watchers.len()
        );
    }
}
