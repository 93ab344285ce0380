//! One registry test suite, run against every backend: the in-process registry, the static list,
//! etcd (a real etcd per test, on free loopback ports, from `common/etcd.rs`) and ZooKeeper (one
//! real ZooKeeper for the whole suite, from `common/zookeeper.rs`, each check under its own
//! prefix).
//!
//! Clients index the snapshot a registry hands them (hash ring, round robin, failover order),
//! so every backend must give the same answers: what is registered is seen, in one order, by
//! every watcher, and what is removed or replaced goes. The checks below are written once, over
//! a [`Backend`]; each backend is one factory and one `mod` at the end of the file naming the
//! groups of checks it runs. A new backend implements [`Backend`] (and [`Writable`],
//! [`Expiring`] when they apply) and adds its `mod`.
//!
//! Every wait is on the watch's `changed()`, bounded by `common::LIMIT` only so that a change
//! that never comes fails instead of hanging. The expiry checks wait for etcd's own lease
//! clock (or ZooKeeper's session clock), which cannot be paused; one of them kills a real server
//! process (`registry-server`) with SIGKILL.

use crate::common;
use crate::etcd_harness;
use crate::registry_watch;
use crate::zookeeper_harness;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{within, LIMIT};
use rpc::crates::core::{GovernanceOverrides, ServiceEntry, ServiceId};
use rpc::crates::registry::{Endpoints, ServiceWatch};
use rpc::{Client, Instance, Registry};
use tests::who::{Who, WhoClient};

/// A registry backend under test: a factory of fresh stores, one per check.
trait Backend {
    /// One fresh store, and what the check holds it by.
    type Store: Store;

    /// A fresh store listing exactly `seed`. A writable backend registers each instance (in
    /// the order given) through [`Store::registry`]; a read-only backend is built from them.
    async fn store(seed: &[Instance]) -> Self::Store;
}

/// Handles on one store, as processes sharing it hold them.
trait Store {
    /// The handle of "this process": the one the seed was registered through.
    fn registry(&self) -> Arc<dyn Registry>;

    /// Another handle on the same store, as another process opens it: its own connection and
    /// its own watches, where the backend has such things. A watch lasts only as long as the
    /// handle it came from (dropping the last clone of an etcd registry ends its watches), so
    /// checks keep the handle while they watch.
    async fn another(&self) -> Arc<dyn Registry>;
}

/// A backend whose instances change at run time: registering, deregistering and replacing
/// are published to every watcher.
trait Writable: Backend {}

/// A backend whose registrations live only as long as someone keeps them alive.
trait Expiring: Writable {
    /// How long a registration outlives its holder, at most.
    const TTL: Duration;

    /// Another handle on the store whose end is a crash: when the returned handle is dropped,
    /// what it registered is no longer kept alive, and not removed either.
    async fn crashable(store: &Self::Store) -> Arc<dyn Registry>;

    /// The URL another process opens the store with (`<dyn Registry>::from_url_with_lease`).
    fn url(store: &Self::Store) -> String;
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// An instance of `services` at `address` with instance id `id`.
fn instance(address: &str, id: &str, services: &[&str]) -> Instance {
    let mut i = Instance::new(address, services.iter().copied());
    i.id = id.to_string();
    i
}

fn with_metadata(mut i: Instance, pairs: &[(&str, &str)]) -> Instance {
    i.metadata = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    i
}

/// `(address, id)` of each instance of a snapshot, in its order.
fn listing(eps: &Endpoints) -> Vec<(String, String)> {
    eps.iter()
        .map(|i| (i.address.clone(), i.id.clone()))
        .collect()
}

/// The same, from literals.
fn expect(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(a, i)| (a.to_string(), i.to_string()))
        .collect()
}

async fn watch(registry: &Arc<dyn Registry>, service: &str) -> ServiceWatch {
    within("watch", registry.watch(&ServiceId::from(service)))
        .await
        .expect("watch")
}

async fn register(registry: &Arc<dyn Registry>, instance: Instance) {
    within("register", registry.register(instance))
        .await
        .expect("register");
}

async fn deregister(registry: &Arc<dyn Registry>, id: &str) {
    within("deregister", registry.deregister(id))
        .await
        .expect("deregister");
}

/// Waits on `changed()` until the snapshot satisfies `pred`, at most `limit`; returns it.
async fn wait_for_within(
    w: &mut ServiceWatch,
    limit: Duration,
    what: &str,
    pred: impl Fn(&Endpoints) -> bool,
) -> Endpoints {
    let start = Instant::now();
    loop {
        let now = w.current();
        if pred(&now) {
            return now;
        }
        let left = limit.saturating_sub(start.elapsed());
        match tokio::time::timeout(left, w.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{what}: the watch ended ({e}); it shows {now:?}"),
            Err(_) => panic!("{what}: not within {limit:?}; the watch shows {now:?}"),
        }
    }
}

async fn wait_for(
    w: &mut ServiceWatch,
    what: &str,
    pred: impl Fn(&Endpoints) -> bool,
) -> Endpoints {
    wait_for_within(w, LIMIT, what, pred).await
}

fn has(address: &str) -> impl Fn(&Endpoints) -> bool + '_ {
    move |eps| eps.iter().any(|i| i.address == address)
}

// ---------------------------------------------------------------------------------------------
// Checks every backend runs: they need only a store listing given instances.
// ---------------------------------------------------------------------------------------------

/// Instances listed (or registered) in a scrambled order come out sorted by address, then id,
/// as plain strings ("127.0.0.1:100" before "127.0.0.1:20").
async fn the_snapshot_is_in_address_order_whatever_the_listing_order<B: Backend>() {
    let store = B::store(&[
        instance("127.0.0.1:3", "c", &["t.A"]),
        instance("127.0.0.1:20", "b", &["t.A"]),
        instance("127.0.0.1:100", "e", &["t.A"]),
        instance("127.0.0.1:20", "a", &["t.A"]),
        instance("10.0.0.9:1", "d", &["t.A"]),
    ])
    .await;
    let w = watch(&store.registry(), "t.A").await;
    assert_eq!(
        listing(&w.current()),
        expect(&[
            ("10.0.0.9:1", "d"),
            ("127.0.0.1:100", "e"),
            ("127.0.0.1:20", "a"),
            ("127.0.0.1:20", "b"),
            ("127.0.0.1:3", "c"),
        ])
    );
}

/// A watch of one service lists only the instances serving it.
async fn services_do_not_see_each_others_instances<B: Backend>() {
    let store = B::store(&[
        instance("127.0.0.1:1", "a-only", &["t.A"]),
        instance("127.0.0.1:2", "b-only", &["t.B"]),
        instance("127.0.0.1:3", "both", &["t.A", "t.B"]),
    ])
    .await;
    let registry = store.registry();
    let a = watch(&registry, "t.A").await;
    let b = watch(&registry, "t.B").await;
    let c = watch(&registry, "t.C").await;
    assert_eq!(
        listing(&a.current()),
        expect(&[("127.0.0.1:1", "a-only"), ("127.0.0.1:3", "both")])
    );
    assert_eq!(
        listing(&b.current()),
        expect(&[("127.0.0.1:2", "b-only"), ("127.0.0.1:3", "both")])
    );
    assert!(c.current().is_empty(), "{:?}", c.current());
}

/// Two watchers on two handles (two processes' views) see the same instances in the same
/// order.
async fn two_independent_watchers_see_the_same_order<B: Backend>() {
    let store = B::store(&[
        instance("127.0.0.1:4", "4", &["t.A"]),
        instance("127.0.0.1:1", "1", &["t.A"]),
        instance("127.0.0.1:3", "3", &["t.A"]),
        instance("127.0.0.1:2", "2", &["t.A"]),
    ])
    .await;
    let one = watch(&store.registry(), "t.A").await;
    let other = store.another().await;
    let two = watch(&other, "t.A").await;
    let expected = expect(&[
        ("127.0.0.1:1", "1"),
        ("127.0.0.1:2", "2"),
        ("127.0.0.1:3", "3"),
        ("127.0.0.1:4", "4"),
    ]);
    assert_eq!(listing(&one.current()), expected);
    assert_eq!(one.current(), two.current(), "same instances, same order");
}

/// What a server says about itself (id, address, services, metadata) reaches watchers
/// unchanged.
async fn ids_services_and_metadata_round_trip<B: Backend>() {
    let published = with_metadata(
        instance("127.0.0.1:7", "db-1", &["t.A", "t.B"]),
        &[
            ("shard", "east"),
            ("weight", "3"),
            ("version", "1.2.0-rc.1+build 7"),
            ("quote \" and \\ backslash", "ключ ✓"),
        ],
    );
    let store = B::store(std::slice::from_ref(&published)).await;
    for service in ["t.A", "t.B"] {
        let other = store.another().await;
        let seen = watch(&other, service).await.current();
        assert_eq!(seen.len(), 1, "{service}: {seen:?}");
        assert_eq!(*seen[0], published, "{service}");
    }
}

/// The listing names every service some instance serves, sorted as plain strings, each once
/// (however many instances serve it), and nothing else; another process sees the same list.
async fn the_listing_names_each_service_once_in_order<B: Backend>() {
    let store = B::store(&[
        instance("127.0.0.1:1", "one", &["t.B", "t.A"]),
        instance("127.0.0.1:2", "two", &["t.A"]),
        instance("127.0.0.1:3", "three", &["a/b%c.Odd", "t.C"]),
        instance("127.0.0.1:4", "four", &["t.A", "t.B"]),
    ])
    .await;
    let expected: Vec<ServiceId> = ["a/b%c.Odd", "t.A", "t.B", "t.C"]
        .into_iter()
        .map(ServiceId::from)
        .collect();
    let here = within("list", store.registry().services())
        .await
        .expect("list");
    assert_eq!(here, expected);
    let other = store.another().await;
    let there = within("list", other.services()).await.expect("list");
    assert_eq!(there, expected, "another process's view");
}

// ---------------------------------------------------------------------------------------------
// Checks of backends that take registrations at run time.
// ---------------------------------------------------------------------------------------------

/// `register` returns once the instance is published: a watch opened afterwards, on this
/// handle or another, lists it at once.
async fn a_registered_instance_is_seen_by_a_watch<B: Writable>() {
    let store = B::store(&[]).await;
    let registry = store.registry();
    register(&registry, instance("127.0.0.1:1001", "one", &["t.A"])).await;
    let here = watch(&registry, "t.A").await;
    let other = store.another().await;
    let there = watch(&other, "t.A").await;
    for w in [&here, &there] {
        assert_eq!(listing(&w.current()), expect(&[("127.0.0.1:1001", "one")]));
    }
}

/// A watch opened on an empty service wakes up when the first instance arrives.
async fn a_watch_opened_before_any_instance_sees_the_first_arrive<B: Writable>() {
    let store = B::store(&[]).await;
    let other = store.another().await;
    let mut w = watch(&other, "t.A").await;
    assert!(w.current().is_empty(), "{:?}", w.current());
    register(
        &store.registry(),
        instance("127.0.0.1:1001", "first", &["t.A"]),
    )
    .await;
    within("the first instance is announced", w.changed())
        .await
        .expect("the watch is open");
    let seen = wait_for(&mut w, "the first instance", has("127.0.0.1:1001")).await;
    assert_eq!(listing(&seen), expect(&[("127.0.0.1:1001", "first")]));
}

/// Instances joining one by one take their place in address order, on every watcher.
async fn a_second_instance_joins_in_address_order<B: Writable>() {
    let store = B::store(&[]).await;
    let registry = store.registry();
    let mut w = watch(&registry, "t.A").await;
    register(&registry, instance("127.0.0.1:2002", "b", &["t.A"])).await;
    wait_for(&mut w, "the first", has("127.0.0.1:2002")).await;
    register(&registry, instance("127.0.0.1:2001", "a", &["t.A"])).await;
    let both = wait_for(&mut w, "the second", has("127.0.0.1:2001")).await;
    assert_eq!(
        listing(&both),
        expect(&[("127.0.0.1:2001", "a"), ("127.0.0.1:2002", "b")])
    );
    register(&registry, instance("127.0.0.1:10000", "c", &["t.A"])).await;
    let three = wait_for(&mut w, "the third", has("127.0.0.1:10000")).await;
    let expected = expect(&[
        ("127.0.0.1:10000", "c"),
        ("127.0.0.1:2001", "a"),
        ("127.0.0.1:2002", "b"),
    ]);
    assert_eq!(listing(&three), expected);
    let other = store.another().await;
    let other = watch(&other, "t.A").await;
    assert_eq!(
        listing(&other.current()),
        expected,
        "another process's view"
    );
}

/// A deregistered instance leaves every watcher; deregistering an unknown id is not an error.
async fn a_deregistered_instance_is_gone<B: Writable>() {
    let store = B::store(&[
        instance("127.0.0.1:1001", "one", &["t.A"]),
        instance("127.0.0.1:1002", "two", &["t.A"]),
    ])
    .await;
    let registry = store.registry();
    let mut here = watch(&registry, "t.A").await;
    let other = store.another().await;
    let mut there = watch(&other, "t.A").await;
    deregister(&registry, "one").await;
    for w in [&mut here, &mut there] {
        let left = wait_for(w, "removal", |eps| eps.len() == 1).await;
        assert_eq!(listing(&left), expect(&[("127.0.0.1:1002", "two")]));
    }
    deregister(&registry, "no-such-instance").await;
    deregister(&registry, "two").await;
    for w in [&mut here, &mut there] {
        wait_for(w, "the last removal", |eps| eps.is_empty()).await;
    }
    let other = store.another().await;
    let late = watch(&other, "t.A").await;
    assert!(late.current().is_empty(), "{:?}", late.current());
}

/// Ids with characters one store refuses in its keys (ZooKeeper: controls, private use,
/// U+FFF0 and up, anything past U+FFFF) register, are seen, listed and deregistered as they
/// are, in every store, as plain ids are: which store a team runs must not decide which ids
/// its servers may have.
async fn ids_with_control_and_private_use_characters_round_trip<B: Writable>() {
    // (`%0A` as it is, too: a store's escaped names must not be read back as it.)
    const SERVICE: &str = "t.Ctl\u{7f}\u{9f}\u{1f600}%0A";
    const ID: &str = "db\n1\u{1}\u{e000}\u{fff0}\u{1f600}/..%0A";
    let odd = instance("127.0.0.1:3101", ID, &[SERVICE, "t.A"]);
    let store = B::store(&[]).await;
    let registry = store.registry();
    register(&registry, odd.clone()).await;
    let other = store.another().await;
    let mut w = watch(&other, SERVICE).await;
    assert_eq!(listing(&w.current()), expect(&[("127.0.0.1:3101", ID)]));
    assert_eq!(*w.current()[0], odd);
    let services = within("list", other.services()).await.expect("list");
    assert!(services.contains(&ServiceId::from(SERVICE)), "{services:?}");
    deregister(&registry, ID).await;
    within("the instance leaves", async {
        while !w.current().is_empty() {
            w.changed().await.expect("the watch goes on");
        }
    })
    .await;
}

/// Registering an instance id again replaces the previous version (new metadata, new address,
/// other services) without ever listing it twice.
async fn registering_an_id_again_replaces_it_without_duplicates<B: Writable>() {
    let v1 = with_metadata(instance("127.0.0.1:3001", "db", &["t.A"]), &[("v", "1")]);
    let store = B::store(std::slice::from_ref(&v1)).await;
    let registry = store.registry();
    let mut a = watch(&registry, "t.A").await;
    let other = store.another().await;
    let mut b = watch(&other, "t.B").await;

    // New metadata, same address.
    let v2 = with_metadata(instance("127.0.0.1:3001", "db", &["t.A"]), &[("v", "2")]);
    register(&registry, v2.clone()).await;
    let seen = wait_for(&mut a, "new metadata", |eps| {
        eps.iter()
            .any(|i| i.metadata.get("v").map(String::as_str) == Some("2"))
    })
    .await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(*seen[0], v2);

    // A new address.
    let v3 = with_metadata(instance("127.0.0.1:3002", "db", &["t.A"]), &[("v", "3")]);
    register(&registry, v3.clone()).await;
    let seen = wait_for(&mut a, "new address", has("127.0.0.1:3002")).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(*seen[0], v3);

    // Another service: it leaves t.A and appears under t.B.
    let v4 = instance("127.0.0.1:3002", "db", &["t.B"]);
    register(&registry, v4.clone()).await;
    // `register` returns once the replacement is complete: a watch opened now, by another
    // process, finds only the new version, and nothing left behind under t.A.
    let later = store.another().await;
    let left = watch(&later, "t.A").await.current();
    assert!(left.is_empty(), "left behind under t.A: {left:?}");
    let seen = watch(&later, "t.B").await.current();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(*seen[0], v4);
    // And the watchers that were open follow.
    wait_for(&mut a, "gone from t.A", |eps| eps.is_empty()).await;
    let seen = wait_for(&mut b, "under t.B", |eps| !eps.is_empty()).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(*seen[0], v4);
}

/// The entry descriptors an instance publishes (with their governance settings) reach watchers
/// unchanged. (A static list has no entries to publish: this is a writable-backend check.)
async fn entry_descriptors_round_trip<B: Writable>() {
    // The settings as a user writes them (the keys of `#[governance(...)]` and config files).
    let governance: GovernanceOverrides =
        serde_json::from_str(r#"{ "timeout_ms": 250, "retry_times": 2, "idempotent": true }"#)
            .expect("governance keys");
    assert_ne!(governance, GovernanceOverrides::NONE);
    let entry =
        |method: &str, hash_key: Option<usize>, governance: GovernanceOverrides| ServiceEntry {
            id: format!("t.A.{method}").as_str().into(),
            service_id: "t.A".into(),
            method: method.to_string(),
            hash_key,
            governance,
            api: None,
        };
    let mut published = with_metadata(
        instance("127.0.0.1:4001", "svc-1", &["t.A"]),
        &[("zone", "z1")],
    );
    published.entries = vec![
        entry("get", Some(1), governance),
        entry("put", None, GovernanceOverrides::NONE),
    ];
    let store = B::store(&[]).await;
    register(&store.registry(), published.clone()).await;
    for registry in [store.registry(), store.another().await] {
        let seen = watch(&registry, "t.A").await.current();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(*seen[0], published);
    }
}

/// A service whose last instance is deregistered leaves the listing; one registered later
/// joins it. An empty store lists nothing.
async fn the_listing_follows_registrations<B: Writable>() {
    let store = B::store(&[]).await;
    let registry = store.registry();
    let list = |r: Arc<dyn Registry>| async move {
        within("list", r.services())
            .await
            .expect("list")
            .into_iter()
            .map(|s| s.as_str().to_string())
            .collect::<Vec<String>>()
    };
    assert!(list(registry.clone()).await.is_empty());
    register(&registry, instance("127.0.0.1:1", "one", &["t.A", "t.B"])).await;
    register(&registry, instance("127.0.0.1:2", "two", &["t.B"])).await;
    assert_eq!(list(registry.clone()).await, ["t.A", "t.B"]);
    deregister(&registry, "one").await;
    // t.B keeps an instance; t.A has none left.
    assert_eq!(list(store.another().await).await, ["t.B"]);
    register(&registry, instance("127.0.0.1:3", "three", &["t.C"])).await;
    deregister(&registry, "two").await;
    assert_eq!(list(store.another().await).await, ["t.C"]);
}

// ---------------------------------------------------------------------------------------------
// Checks of backends whose registrations expire.
// ---------------------------------------------------------------------------------------------

/// A registration whose holder crashes (its lease no longer kept alive, nothing removed)
/// disappears by itself within its TTL, and not at once.
async fn a_crashed_registration_disappears_within_its_ttl<B: Expiring>() {
    let store = B::store(&[]).await;
    let mut w = watch(&store.registry(), "t.A").await;
    let doomed = B::crashable(&store).await;
    register(&doomed, instance("127.0.0.1:5001", "doomed", &["t.A"])).await;
    wait_for(&mut w, "registered", has("127.0.0.1:5001")).await;

    drop(doomed);
    let crashed = Instant::now();
    // The TTL, plus the store's expiry sweep and a margin.
    let limit = B::TTL + Duration::from_millis(1500);
    wait_for_within(&mut w, limit, "expired", |eps| eps.is_empty()).await;
    let took = crashed.elapsed();
    eprintln!(
        "a crashed registration was gone after {took:?} (TTL {:?})",
        B::TTL
    );
    // The lease was renewed at most a third of the TTL before the crash: it cannot go much
    // earlier, which shows it went by expiry, not by a removal.
    assert!(
        took >= B::TTL / 2,
        "gone after {took:?}: too early for an expiry"
    );
}

/// A server process killed with SIGKILL (nothing left that could still talk to the store) is
/// listed until then, gets calls, and disappears by itself within its TTL, and not at once.
async fn a_killed_server_process_disappears_within_its_ttl<B: Expiring>() {
    let store = B::store(&[]).await;
    let (mut child, addr) = registry_watch::spawn_registered_child(&B::url(&store), B::TTL).await;
    let mut w = watch(&store.registry(), WhoClient::SERVICE_ID).await;
    wait_for(&mut w, "child registered", has(&addr)).await;
    let who = WhoClient::new(Client::builder().shared_registry(store.registry()).build());
    assert_eq!(within("call", who.whoami()).await.expect("call"), "child");

    child.0.kill().expect("kill -9 the child server"); // SIGKILL on Unix
    let killed = Instant::now();
    let _ = child.0.wait();
    // The TTL, plus the store's expiry sweep and a margin.
    let limit = B::TTL + Duration::from_millis(1500);
    wait_for_within(&mut w, limit, "killed server expired", |eps| {
        !has(&addr)(eps)
    })
    .await;
    let took = killed.elapsed();
    eprintln!("a killed server was gone after {took:?} (TTL {:?})", B::TTL);
    // Its lease was renewed (its session heard of) a fraction of the TTL before the kill: it
    // cannot go much earlier, which shows it went by expiry.
    assert!(
        took >= B::TTL / 2,
        "gone after {took:?}: too early for an expiry"
    );
}

// ---------------------------------------------------------------------------------------------
// The groups of checks, and the backends.
// ---------------------------------------------------------------------------------------------

/// One `#[tokio::test]` per check, for backend `$backend`.
macro_rules! checks {
    ($backend:ty: $($check:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $check() {
            super::$check::<$backend>().await;
        }
    )*};
}

/// The checks every backend runs.
macro_rules! read_checks {
    ($backend:ty) => {
        checks!($backend:
            the_snapshot_is_in_address_order_whatever_the_listing_order,
            services_do_not_see_each_others_instances,
            two_independent_watchers_see_the_same_order,
            ids_services_and_metadata_round_trip,
            the_listing_names_each_service_once_in_order,
        );
    };
}

/// The checks of backends that take registrations ([`Writable`]).
macro_rules! write_checks {
    ($backend:ty) => {
        checks!($backend:
            a_registered_instance_is_seen_by_a_watch,
            a_watch_opened_before_any_instance_sees_the_first_arrive,
            a_second_instance_joins_in_address_order,
            a_deregistered_instance_is_gone,
            registering_an_id_again_replaces_it_without_duplicates,
            ids_with_control_and_private_use_characters_round_trip,
            entry_descriptors_round_trip,
            the_listing_follows_registrations,
        );
    };
}

/// The checks of backends whose registrations expire ([`Expiring`]).
macro_rules! expiry_checks {
    ($backend:ty) => {
        checks!($backend:
            a_crashed_registration_disappears_within_its_ttl,
            a_killed_server_process_disappears_within_its_ttl,
        );
    };
}

/// Registers `seed` in order through `registry`.
async fn seed(registry: &Arc<dyn Registry>, seed: &[Instance]) {
    for i in seed {
        register(registry, i.clone()).await;
    }
}

/// The in-process registry (`embedded`). One process: every handle is the same shared
/// registry, so "another process's view" is another clone of it.
struct InProcess;

struct InProcessStore(Arc<dyn Registry>);

impl Backend for InProcess {
    type Store = InProcessStore;

    async fn store(instances: &[Instance]) -> InProcessStore {
        let registry = <dyn Registry>::from_url("embedded")
            .await
            .expect("embedded registry");
        seed(&registry, instances).await;
        InProcessStore(registry)
    }
}

impl Store for InProcessStore {
    fn registry(&self) -> Arc<dyn Registry> {
        self.0.clone()
    }

    async fn another(&self) -> Arc<dyn Registry> {
        self.0.clone()
    }
}

impl Writable for InProcess {}

mod in_process {
    use super::InProcess;
    read_checks!(InProcess);
    write_checks!(InProcess);
    // No expiry checks: an in-process registration lives as long as the process.
}

/// The static list, read from a TOML file (`static:FILE`). Another process's view is the
/// same file read again.
struct StaticList;

struct StaticStore {
    path: PathBuf,
    registry: Arc<dyn Registry>,
    _dir: tempfile::TempDir,
}

impl StaticList {
    /// The TOML form of `instances` (`[[endpoint]]` tables).
    fn toml(instances: &[Instance]) -> String {
        // A TOML basic string: the same escapes as JSON.
        let quote = |s: &str| serde_json::to_string(s).expect("a string");
        let mut text = String::new();
        for i in instances {
            assert!(
                i.entries.is_empty(),
                "a static list cannot publish entries: make this a writable-backend check"
            );
            let services: Vec<String> = i.services.iter().map(|s| quote(s.as_str())).collect();
            let metadata: Vec<String> = i
                .metadata
                .iter()
                .map(|(k, v)| format!("{} = {}", quote(k), quote(v)))
                .collect();
            text += &format!(
                "[[endpoint]]\naddress = {}\nid = {}\nservices = [{}]\nmetadata = {{ {} }}\n\n",
                quote(&i.address),
                quote(&i.id),
                services.join(", "),
                metadata.join(", "),
            );
        }
        text
    }

    async fn open(path: &std::path::Path) -> Arc<dyn Registry> {
        <dyn Registry>::from_url(&format!("static:{}", path.display()))
            .await
            .expect("static registry from its file")
    }
}

impl Backend for StaticList {
    type Store = StaticStore;

    async fn store(instances: &[Instance]) -> StaticStore {
        let dir = tempfile::Builder::new()
            .prefix("rpc-static-suite-")
            .tempdir()
            .expect("temporary directory");
        let path = dir.path().join("endpoints.toml");
        std::fs::write(&path, Self::toml(instances)).expect("write the list");
        StaticStore {
            registry: Self::open(&path).await,
            path,
            _dir: dir,
        }
    }
}

impl Store for StaticStore {
    fn registry(&self) -> Arc<dyn Registry> {
        self.registry.clone()
    }

    async fn another(&self) -> Arc<dyn Registry> {
        StaticList::open(&self.path).await
    }
}

mod static_list {
    use super::StaticList;
    read_checks!(StaticList);
    // No write checks: a static list accepts `register` and `deregister` and ignores them (its
    // endpoints never change), so nothing could be seen arriving, leaving or being replaced,
    // and its file format has no entry descriptors. No expiry checks: nothing expires.
}

/// etcd: a real etcd per check, handles made by `<dyn Registry>::from_url_with_lease` (each
/// one its own connection and watches, as another process would have).
struct Etcd;

struct EtcdStore {
    registry: Arc<dyn Registry>,
    etcd: etcd_harness::Etcd,
}

impl Etcd {
    async fn open(etcd: &etcd_harness::Etcd) -> Arc<dyn Registry> {
        <dyn Registry>::from_url_with_lease(&etcd.url(), Some(<Etcd as Expiring>::TTL))
            .await
            .expect("etcd registry")
    }
}

impl Backend for Etcd {
    type Store = EtcdStore;

    async fn store(instances: &[Instance]) -> EtcdStore {
        let etcd = etcd_harness::Etcd::start().await;
        let registry = Self::open(&etcd).await;
        seed(&registry, instances).await;
        EtcdStore { registry, etcd }
    }
}

impl Store for EtcdStore {
    fn registry(&self) -> Arc<dyn Registry> {
        self.registry.clone()
    }

    async fn another(&self) -> Arc<dyn Registry> {
        Etcd::open(&self.etcd).await
    }
}

impl Writable for Etcd {}

impl Expiring for Etcd {
    /// About etcd's minimum lease.
    const TTL: Duration = Duration::from_secs(2);

    /// Dropping the last clone of an etcd registry stops its keep-alive without revoking the
    /// lease (see `EtcdRegistry`), as a killed process does.
    async fn crashable(store: &EtcdStore) -> Arc<dyn Registry> {
        Etcd::open(&store.etcd).await
    }

    fn url(store: &EtcdStore) -> String {
        store.etcd.url()
    }
}

mod etcd {
    use super::Etcd;
    read_checks!(Etcd);
    write_checks!(Etcd);
    expiry_checks!(Etcd);
}

/// ZooKeeper: one real ZooKeeper for the suite (a JVM takes about a second to start), each check
/// under a prefix of its own (`zk://host:port/test-<n>`), so that checks see only their own
/// nodes; handles made by `<dyn Registry>::from_url_with_lease` (each one its own session and
/// watches, as another process would have).
struct ZooKeeper;

struct ZooKeeperStore {
    registry: Arc<dyn Registry>,
    url: String,
}

impl ZooKeeper {
    async fn open(url: &str) -> Arc<dyn Registry> {
        <dyn Registry>::from_url_with_lease(url, Some(<ZooKeeper as Expiring>::TTL))
            .await
            .expect("ZooKeeper registry")
    }
}

impl Backend for ZooKeeper {
    type Store = ZooKeeperStore;

    async fn store(instances: &[Instance]) -> ZooKeeperStore {
        let zookeeper = zookeeper_harness::ZooKeeper::shared().await;
        let url = zookeeper.url_with_prefix(&zookeeper_harness::ZooKeeper::prefix());
        let registry = Self::open(&url).await;
        seed(&registry, instances).await;
        ZooKeeperStore { registry, url }
    }
}

impl Store for ZooKeeperStore {
    fn registry(&self) -> Arc<dyn Registry> {
        self.registry.clone()
    }

    async fn another(&self) -> Arc<dyn Registry> {
        ZooKeeper::open(&self.url).await
    }
}

impl Writable for ZooKeeper {}

impl Expiring for ZooKeeper {
    /// The session timeout: the same 2 s as etcd's lease (the harness's ZooKeeper allows
    /// sessions down to 200 ms).
    const TTL: Duration = Duration::from_secs(2);

    /// Dropping the last clone of a ZooKeeper registry closes its connection without closing
    /// its session (see `ZooKeeperRegistry`), as a killed process does: the session, and its
    /// nodes, expire.
    async fn crashable(store: &ZooKeeperStore) -> Arc<dyn Registry> {
        ZooKeeper::open(&store.url).await
    }

    fn url(store: &ZooKeeperStore) -> String {
        store.url.clone()
    }
}

mod zookeeper {
    use super::ZooKeeper;
    read_checks!(ZooKeeper);
    write_checks!(ZooKeeper);
    expiry_checks!(ZooKeeper);
}
