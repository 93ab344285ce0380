//! The etcd registry against a real etcd, started by each test on free loopback ports
//! (`common/etcd.rs`): its key layout and leases, graceful deregistration, calls surviving an
//! etcd restart, re-registration after a lost lease, several clients, a server joining,
//! malformed values. What every registry backend must do (registration, removal, replacement,
//! order, a killed server process expiring with its lease) runs for etcd in
//! `registry_suite.rs`.
//!
//! Leases are 2 s here (etcd's minimum is about that), so the tests that wait for an expiry
//! wait a few seconds of real time (etcd's clock cannot be paused); every other wait ends as
//! soon as the watch reports, bounded by `common::LIMIT` only so that a hang fails.

use crate::common;
use crate::etcd_harness;
use crate::registry_watch;

use std::time::{Duration, Instant};

use common::{within, LIMIT};
use etcd_harness::Etcd;
use registry_watch::{
    a_new_server_gets_calls, addresses, has, lacks, never_within, serve, wait_until, watch,
    CallsThroughout,
};
use rpc::crates::registry::ServiceWatch;
use rpc::{Client, Instance, Registry};
use rpc::{EtcdOptions, EtcdRegistry};
use tests::who::{Who, WhoClient};

/// The lease of the tests' instances.
const TTL: Duration = Duration::from_secs(2);
/// How long a watcher may take to see an addition or a removal: no timing claim, only a bound
/// so that a change that never comes fails the test instead of hanging it.
const SEEN_WITHIN: Duration = LIMIT;

fn options(ttl: Duration) -> EtcdOptions {
    EtcdOptions {
        lease_ttl: ttl,
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..EtcdOptions::default()
    }
}

async fn registry(etcd: &Etcd, ttl: Duration) -> EtcdRegistry {
    EtcdRegistry::connect(&[etcd.endpoint()], options(ttl))
        .await
        .expect("etcd registry")
}

/// The lease of `key`, or `None` when the key does not exist.
async fn lease_of(etcd: &etcd_client::Client, key: &str) -> Option<i64> {
    let resp = within("etcd get", etcd.kv_client().get(key, None))
        .await
        .expect("etcd get");
    resp.kvs().first().map(|kv| kv.lease())
}

/// etcd's layout: one key per (service, instance), the instance as JSON, all keys of an
/// instance under one lease; a new version gets its own lease, and the keys it no longer has go
/// before `register` returns. (What every backend must show through its watches, this one
/// included, is checked in `registry_suite.rs`.)
#[tokio::test]
async fn an_instance_is_one_key_per_service_under_one_lease() {
    let etcd = Etcd::start().await;
    let reg = registry(&etcd, TTL).await;
    reg.register(Instance::new("127.0.0.1:1001", ["t.A", "t.B"]))
        .await
        .expect("register");

    let raw = etcd.client().await;
    let key_a = "/rpc/services/t.A/127.0.0.1:1001";
    let key_b = "/rpc/services/t.B/127.0.0.1:1001";
    assert_eq!(reg.key(&"t.A".into(), "127.0.0.1:1001"), key_a);
    let resp = raw.kv_client().get(key_a, None).await.expect("get");
    let stored: Instance = serde_json::from_slice(resp.kvs()[0].value()).expect("JSON instance");
    assert_eq!(stored, Instance::new("127.0.0.1:1001", ["t.A", "t.B"]));
    let lease = lease_of(&raw, key_a).await.expect("key under t.A");
    assert_ne!(lease, 0, "the key is bound to a lease");
    assert_eq!(
        lease_of(&raw, key_b).await,
        Some(lease),
        "one lease per instance"
    );

    // Registering the id again, now serving t.B only: t.A's key is gone at once (the old lease
    // is revoked), and t.B's is under the new version's own lease.
    reg.register(Instance::new("127.0.0.1:1001", ["t.B"]))
        .await
        .expect("register again");
    assert_eq!(lease_of(&raw, key_a).await, None);
    let new_lease = lease_of(&raw, key_b).await.expect("still under t.B");
    assert_ne!(new_lease, lease, "the new version has its own lease");

    // Deregistering revokes that lease: the key is gone when it returns.
    reg.deregister("127.0.0.1:1001").await.expect("deregister");
    assert_eq!(lease_of(&raw, key_b).await, None);
}

#[tokio::test]
async fn a_graceful_shutdown_deregisters_at_once() {
    let etcd = Etcd::start().await;
    // The default lease (10 s): the entry must go long before it would expire.
    let server_reg = registry(&etcd, Duration::from_secs(10)).await;
    let server = serve("a", &server_reg).await;
    let addr = server.local_addr();
    let client_reg = registry(&etcd, TTL).await;
    let mut w = watch(&client_reg, WhoClient::SERVICE_ID).await;
    assert_eq!(addresses(&w), [addr.to_string()]);

    // When shutdown returns, the key is already gone from etcd: deleted by the shutdown, not
    // expired (its lease has 10 s to run).
    within("shutdown", server.shutdown()).await;
    let key = server_reg.key(&WhoClient::SERVICE_ID.into(), &addr.to_string());
    assert_eq!(lease_of(&etcd.client().await, &key).await, None);
    wait_until(&mut w, SEEN_WITHIN, "gone after shutdown", lacks(addr)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_keep_working_while_etcd_restarts_and_the_registration_survives() {
    let mut etcd = Etcd::start().await;
    let server_reg = registry(&etcd, TTL).await;
    let server = serve("a", &server_reg).await;
    let addr = server.local_addr().to_string();
    let client_reg = registry(&etcd, TTL).await;
    let mut w = watch(&client_reg, WhoClient::SERVICE_ID).await;
    let who = WhoClient::new(Client::builder().registry(client_reg.clone()).build());
    assert_eq!(within("call", who.whoami()).await.expect("call"), "a");

    // Calls run all along, from another task: through etcd's outage and its restart.
    let calls = CallsThroughout::start(&who, "a");

    // etcd goes away for longer than the lease: the client keeps the last known endpoints.
    etcd.stop();
    let outage = TTL + Duration::from_secs(1);
    never_within(
        &mut w,
        outage,
        "the client dropped its endpoints while etcd was away",
        |l| l.is_empty(),
    )
    .await;
    assert_eq!(
        addresses(&w),
        vec![addr.clone()],
        "the last known endpoints"
    );

    // etcd is back (same data): the registration is still there and its keep-alive resumed:
    // it outlives another full lease. (etcd gives restored leases a fresh TTL plus about a
    // second: without keep-alive the entry would be gone well within two TTLs.)
    etcd.restart().await;
    never_within(
        &mut w,
        TTL * 2 + Duration::from_millis(500),
        "the registration expired after etcd restarted",
        lacks(&addr),
    )
    .await;
    let key = server_reg.key(&WhoClient::SERVICE_ID.into(), &addr);
    assert!(lease_of(&etcd.client().await, &key).await.is_some());

    calls
        .stop_and_check("through etcd's outage and restart")
        .await;

    // The client's watch follows etcd again: a server started now gets calls.
    a_new_server_gets_calls(&registry(&etcd, TTL).await, &mut w, &who, None).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_registers_again_when_etcd_comes_back_empty() {
    let mut etcd = Etcd::start().await;
    let server_reg = registry(&etcd, TTL).await;
    let server = serve("a", &server_reg).await;
    let addr = server.local_addr().to_string();
    let client_reg = registry(&etcd, TTL).await;
    let w = watch(&client_reg, WhoClient::SERVICE_ID).await;
    let who = WhoClient::new(Client::builder().registry(client_reg.clone()).build());
    assert_eq!(within("call", who.whoami()).await.expect("call"), "a");

    // A new, empty etcd on the same address: every lease and key is gone and revisions start
    // over. The server notices its lease is gone and writes its keys again.
    etcd.restart_empty().await;
    let started = Instant::now();
    // A watch on the new etcd reports the server's keys when they are written again.
    let fresh = registry(&etcd, TTL).await;
    let mut seen = watch(&fresh, WhoClient::SERVICE_ID).await;
    wait_until(
        &mut seen,
        Duration::from_secs(10),
        "registered again",
        has(&addr),
    )
    .await;
    let key = server_reg.key(&WhoClient::SERVICE_ID.into(), &addr);
    assert!(lease_of(&etcd.client().await, &key).await.is_some());
    eprintln!(
        "registered again {:?} after etcd came back",
        started.elapsed()
    );

    // The client's watch follows the new etcd (whose revisions started over): another server
    // appears, and calls reach it.
    let mut w = w;
    a_new_server_gets_calls(&registry(&etcd, TTL).await, &mut w, &who, Some(&addr)).await;
    within("shutdown", server.shutdown()).await;
}

/// A fresh etcd, a registry on it with instance 127.0.0.1:1001 of `t.A` registered, and a
/// watch of `t.A` that lists it.
async fn one_instance_of_t_a() -> (Etcd, EtcdRegistry, ServiceWatch) {
    let etcd = Etcd::start().await;
    let reg = registry(&etcd, TTL).await;
    reg.register(Instance::new("127.0.0.1:1001", ["t.A"]))
        .await
        .expect("register");
    let w = watch(&reg, "t.A").await;
    assert_eq!(addresses(&w), ["127.0.0.1:1001"]);
    (etcd, reg, w)
}

/// A new version etcd refuses to write (more keys than one etcd transaction takes: 128 by
/// default, which the registry is told is more) fails to register, and the version before it
/// stays registered, kept alive past its lease, and can still be deregistered.
#[tokio::test]
async fn a_version_that_fails_to_register_leaves_the_one_before_it_registered() {
    let etcd = Etcd::start().await;
    let lax = EtcdOptions {
        max_txn_ops: 1000,
        ..options(TTL)
    };
    let reg = EtcdRegistry::connect(&[etcd.endpoint()], lax)
        .await
        .expect("etcd registry");
    reg.register(Instance::new("127.0.0.1:1001", ["t.A"]))
        .await
        .expect("register");
    let mut w = watch(&reg, "t.A").await;
    assert_eq!(addresses(&w), ["127.0.0.1:1001"]);

    let services: Vec<String> = std::iter::once("t.A".to_string())
        .chain((0..200).map(|i| format!("t.S{i}")))
        .collect();
    let refused = reg
        .register(Instance::new("127.0.0.1:1001", services))
        .await;
    let refused = refused.expect_err("etcd took 201 keys in one transaction");
    assert!(
        refused.to_string().contains("too many operations"),
        "{refused}"
    );
    never_within(
        &mut w,
        TTL * 3,
        "the version before the refused one went",
        lacks("127.0.0.1:1001"),
    )
    .await;

    reg.deregister("127.0.0.1:1001").await.expect("deregister");
    wait_until(&mut w, SEEN_WITHIN, "deregistered", |l| l.is_empty()).await;
}

/// Whether etcd still holds `lease` (it answers a TTL of -1 for one it does not know).
async fn lease_alive(etcd: &etcd_client::Client, lease: i64) -> bool {
    let resp = within(
        "etcd lease TTL",
        etcd.lease_client().time_to_live(lease, None),
    )
    .await
    .expect("etcd lease TTL");
    resp.ttl() > 0
}

/// The waker of a future polled by hand: records that it was woken (an answer it waits for
/// arrived, say).
#[derive(Default)]
struct Woken(std::sync::atomic::AtomicBool);

impl std::task::Wake for Woken {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A server restarted under its stable id while the old one still serves it (one process, one
/// registry), given up as it registers once its write has landed, while it waits for the old
/// version's lease to be revoked: the old version is put back, and the given-up one's keys go.
/// Its caller cannot remove it (the id is the old server's, which still serves). Before, the
/// new version was kept as soon as written, ahead of that last wait: given up there, it stayed
/// listed with nothing behind it, and the old server, still serving, was listed nowhere.
///
/// The replacement must be caught waiting for the revocation's answer: should that answer come
/// between the last look at etcd and the poll (the poll then finds the registration done), the
/// scenario runs again under another id, a few times at most.
#[tokio::test]
async fn a_replacement_given_up_after_its_write_puts_the_previous_version_back() {
    let etcd = Etcd::start().await;
    for attempt in 1..=5 {
        if replacement_given_up_after_its_write(&etcd, &format!("shard-{attempt}")).await {
            return;
        }
    }
    panic!("the replacement was never caught waiting for the revocation's answer in 5 tries");
}

/// The scenario above for instance `id`: false when the replacement was found registered
/// before it could be given up (the race described above lost; nothing was checked).
async fn replacement_given_up_after_its_write(etcd: &Etcd, id: &str) -> bool {
    // A lease far longer than the test: nothing here goes by expiring.
    let reg = registry(etcd, Duration::from_secs(60)).await;
    let version = |address: &str, services: &[&str]| {
        let mut instance = Instance::new(address, services.iter().copied());
        instance.id = id.into();
        instance
    };
    within(
        "register",
        reg.register(version("127.0.0.1:1001", &["t.A"])),
    )
    .await
    .expect("register");
    let raw = etcd.client().await;
    let old_lease = lease_of(&raw, &reg.key(&"t.A".into(), id))
        .await
        .expect("registered");
    let other = registry(etcd, TTL).await;
    let mut on_a = watch(&other, "t.A").await;
    let mut on_b = watch(&other, "t.B").await;
    assert_eq!(addresses(&on_a), ["127.0.0.1:1001"]);

    // The replacement, polled by hand, only when woken, and only after a look at etcd, begun
    // after the wake and with none during it, found the old lease still there: whatever
    // answer it can see then, that look saw applied. So once the old lease is found gone, the
    // write has landed and the replacement waits for the revocation's answer, not yet seen.
    let mut given_up = reg.register(version("127.0.0.1:1002", &["t.A", "t.B"]));
    let woken = std::sync::Arc::new(Woken::default());
    let waker = std::task::Waker::from(woken.clone());
    let was_woken = || woken.0.swap(false, std::sync::atomic::Ordering::SeqCst);
    // (Its first poll starts it.)
    let mut to_poll = true;
    let mut revoked = false;
    for _ in 0..1000 {
        to_poll |= was_woken();
        if !lease_alive(&raw, old_lease).await {
            revoked = true;
            break;
        }
        if was_woken() {
            // Woken while etcd was asked: by an answer that look may have missed.
            to_poll = true;
            continue;
        }
        if std::mem::take(&mut to_poll) {
            let polled = given_up
                .as_mut()
                .poll(&mut std::task::Context::from_waker(&waker));
            if let std::task::Poll::Ready(registered) = polled {
                registered.expect("the replacement");
                // Registered before it was given up: this run proves nothing; leave nothing.
                drop(given_up);
                within("deregister", reg.deregister(id))
                    .await
                    .expect("deregister");
                return false;
            }
        }
    }
    assert!(revoked, "the replacement never revoked the old lease");
    // (Not polled meanwhile: still waiting.)
    wait_until(&mut on_a, SEEN_WITHIN, "the write landed", |l| {
        l == ["127.0.0.1:1002"]
    })
    .await;
    wait_until(
        &mut on_b,
        SEEN_WITHIN,
        "the write landed",
        has("127.0.0.1:1002"),
    )
    .await;
    drop(given_up);

    wait_until(&mut on_a, SEEN_WITHIN, "the old version put back", |l| {
        l == ["127.0.0.1:1001"]
    })
    .await;
    wait_until(&mut on_b, SEEN_WITHIN, "the given-up version gone", |l| {
        l.is_empty()
    })
    .await;
    let lease = lease_of(&raw, &reg.key(&"t.A".into(), id))
        .await
        .expect("put back");
    assert!(
        lease_alive(&raw, lease).await,
        "put back under a live lease"
    );
    // The version put back is the one registered: deregistering removes it.
    within("deregister", reg.deregister(id))
        .await
        .expect("deregister");
    wait_until(&mut on_a, SEEN_WITHIN, "deregistered", |l| l.is_empty()).await;
    true
}

/// A deregistration given up midway (a timeout around a server's shutdown) has already taken
/// the registration out, so a later one finds nothing: the lease is still revoked, in the
/// background, and the instance goes at once. Before, it stayed listed until its lease expired
/// (here a minute, far longer than the test waits).
#[tokio::test]
async fn a_deregistration_given_up_midway_still_revokes_the_lease() {
    let etcd = Etcd::start().await;
    let reg = registry(&etcd, Duration::from_secs(60)).await;
    let id = "127.0.0.1:1001";
    within("register", reg.register(Instance::new(id, ["t.A"])))
        .await
        .expect("register");
    let other = registry(&etcd, TTL).await;
    let mut w = watch(&other, "t.A").await;
    assert_eq!(addresses(&w), [id]);

    // One poll on this one-thread runtime: the registration is taken out and its keep-alive
    // aborted, and the deregistration waits for that task to end, which needs the runtime.
    let mut given_up = reg.deregister(id);
    assert!(
        futures_util::poll!(&mut given_up).is_pending(),
        "the deregistration was done in one poll"
    );
    drop(given_up);
    within("deregister again", reg.deregister(id))
        .await
        .expect("nothing left to deregister: the registration is forgotten");
    wait_until(&mut w, SEEN_WITHIN, "the instance gone", lacks(id)).await;
    let key = reg.key(&"t.A".into(), id);
    assert_eq!(lease_of(&etcd.client().await, &key).await, None);
}

/// A registration over etcd's request limit (an instance is written once per service, in one
/// transaction) is refused as a configuration error naming its size and the limit, before
/// anything is sent, and the version before it stays; one within the limit is written.
/// Before, etcd's refusal read as etcd being unavailable.
#[tokio::test]
async fn a_registration_over_etcds_request_limit_is_refused_as_configuration() {
    let (_etcd, reg, mut w) = one_instance_of_t_a().await;
    let with_blob = |bytes: usize| {
        let mut instance = Instance::new("127.0.0.1:1001", ["t.A", "t.B"]);
        instance.metadata.insert("blob".into(), "x".repeat(bytes));
        instance
    };
    // Twice 800 KB in one request: over 1.5 MiB.
    let refused = within("register", reg.register(with_blob(800_000)))
        .await
        .expect_err("over the limit");
    assert!(
        matches!(&refused, rpc::RegistryError::Config(m) if m.contains("--max-request-bytes")),
        "{refused}"
    );
    assert_eq!(
        addresses(&w),
        ["127.0.0.1:1001"],
        "the version before stays"
    );
    // Twice 600 KB: within it, and etcd takes it.
    within("register", reg.register(with_blob(600_000)))
        .await
        .expect("within the limit");
    let mut b = watch(&reg, "t.B").await;
    wait_until(&mut b, SEEN_WITHIN, "registered", has("127.0.0.1:1001")).await;
    wait_until(&mut w, SEEN_WITHIN, "still in t.A", has("127.0.0.1:1001")).await;
}

#[tokio::test]
async fn a_lost_lease_is_replaced_and_the_instance_reappears() {
    let (etcd, reg, mut w) = one_instance_of_t_a().await;
    let raw = etcd.client().await;
    let key = reg.key(&"t.A".into(), "127.0.0.1:1001");
    let lease = lease_of(&raw, &key).await.expect("registered");

    // Someone (an operator, etcd itself) drops the lease: the key goes with it.
    raw.lease_client().revoke(lease).await.expect("revoke");
    wait_until(&mut w, SEEN_WITHIN, "revoked", lacks("127.0.0.1:1001")).await;
    // The keep-alive notices (within TTL/3) and registers again under a new lease.
    let took = wait_until(&mut w, TTL, "registered again", has("127.0.0.1:1001")).await;
    eprintln!("registered again after {took:?}");
    let new_lease = lease_of(&raw, &key).await.expect("registered again");
    assert_ne!(new_lease, lease);

    // Deregistration revokes the new lease.
    reg.deregister("127.0.0.1:1001").await.expect("deregister");
    wait_until(&mut w, SEEN_WITHIN, "deregistered", |l| l.is_empty()).await;
}

#[tokio::test]
async fn two_clients_see_the_same_endpoints() {
    let etcd = Etcd::start().await;
    let server_reg = registry(&etcd, TTL).await;
    let mut servers = Vec::new();
    for name in ["a", "b", "c"] {
        servers.push(serve(name, &server_reg).await);
    }
    let one = registry(&etcd, TTL).await;
    let two = registry(&etcd, TTL).await;
    let mut w1 = watch(&one, WhoClient::SERVICE_ID).await;
    let mut w2 = watch(&two, WhoClient::SERVICE_ID).await;
    for w in [&mut w1, &mut w2] {
        wait_until(w, SEEN_WITHIN, "three servers", |l| l.len() == 3).await;
    }
    assert_eq!(addresses(&w1), addresses(&w2));
    assert_eq!(w1.current(), w2.current(), "same instances, same order");

    // Both clients call through their own registry connection.
    for reg in [&one, &two] {
        let who = WhoClient::new(Client::builder().registry(reg.clone()).build());
        let mut answers = Vec::new();
        for _ in 0..3 {
            answers.push(within("call", who.whoami()).await.expect("call"));
        }
        answers.sort();
        assert_eq!(answers, ["a", "b", "c"], "round robin over the same three");
    }

    // A removal reaches both.
    let gone = servers.remove(0);
    let gone_addr = gone.local_addr();
    within("shutdown", gone.shutdown()).await;
    for w in [&mut w1, &mut w2] {
        wait_until(w, SEEN_WITHIN, "removal", lacks(gone_addr)).await;
    }
    assert_eq!(addresses(&w1), addresses(&w2));
    for s in servers {
        within("shutdown", s.shutdown()).await;
    }
}

#[tokio::test]
async fn a_new_server_gets_traffic_without_restarting_clients() {
    let etcd = Etcd::start().await;
    let server_reg = registry(&etcd, TTL).await;
    let a = serve("a", &server_reg).await;
    let client_reg = registry(&etcd, TTL).await;
    let who = WhoClient::new(Client::builder().registry(client_reg.clone()).build());
    assert_eq!(within("call", who.whoami()).await.expect("call"), "a");

    let b = serve("b", &server_reg).await;
    // The client's own view of the service (the registry's watch, which its calls read): once it
    // lists b, the next two calls (round robin over a and b) reach b.
    let mut w = within("watch", who.client().watch(WhoClient::SERVICE_ID))
        .await
        .expect("watch");
    wait_until(&mut w, SEEN_WITHIN, "b joined", has(b.local_addr())).await;
    let mut answers = Vec::new();
    for _ in 0..2 {
        answers.push(within("call", who.whoami()).await.expect("call"));
    }
    assert!(
        answers.iter().any(|a| a == "b"),
        "no call reached the new server: {answers:?}"
    );
    within("shutdown", b.shutdown()).await;
    within("shutdown", a.shutdown()).await;
}

#[tokio::test]
async fn malformed_values_are_skipped() {
    let etcd = Etcd::start().await;
    let raw = etcd.client().await;
    let mut kv = raw.kv_client();
    kv.put("/rpc/services/t.A/garbage", "not json", None)
        .await
        .expect("put");
    // A key naming one id and holding another's instance (a hand-written copy): not the
    // instance its key names, so no endpoint (it would stand for 127.0.0.1:1001, and its
    // lower address would be the one clients call).
    let impostor = |address: &str| {
        let mut instance = Instance::new("127.0.0.1:1001", ["t.A"]);
        instance.address = address.into();
        serde_json::to_vec(&instance).expect("json")
    };
    kv.put(
        "/rpc/services/t.A/127.0.0.1:8",
        impostor("127.0.0.1:10"),
        None,
    )
    .await
    .expect("put");
    let reg = registry(&etcd, TTL).await;
    reg.register(Instance::new("127.0.0.1:1001", ["t.A"]))
        .await
        .expect("register");
    let mut w = watch(&reg, "t.A").await;
    assert_eq!(
        addresses(&w),
        ["127.0.0.1:1001"],
        "the garbage and the impostor are skipped"
    );

    // Garbage arriving while watching is skipped too; a valid value after it is seen.
    kv.put("/rpc/services/t.A/partial", r#"{"id":"x"}"#, None)
        .await
        .expect("put");
    // A valid instance that does not serve t.A, under t.A's prefix: not an endpoint of t.A.
    let stray = serde_json::to_vec(&Instance::new("127.0.0.1:7", ["t.Other"])).expect("json");
    kv.put("/rpc/services/t.A/stray", stray, None)
        .await
        .expect("put");
    kv.put(
        "/rpc/services/t.A/127.0.0.1:9",
        impostor("127.0.0.1:1"),
        None,
    )
    .await
    .expect("put");
    reg.register(Instance::new("127.0.0.1:1000", ["t.A"]))
        .await
        .expect("register");
    wait_until(&mut w, SEEN_WITHIN, "valid addition", has("127.0.0.1:1000")).await;
    assert_eq!(addresses(&w), ["127.0.0.1:1000", "127.0.0.1:1001"]);

    // A valid key overwritten with garbage stops being an endpoint.
    kv.put("/rpc/services/t.A/127.0.0.1:1000", "{", None)
        .await
        .expect("put");
    wait_until(&mut w, SEEN_WITHIN, "overwritten", lacks("127.0.0.1:1000")).await;
}

/// A service whose instances take more than gRPC's default 4 MiB answer (instances that
/// publish large API schemas, say) is read whole: every instance is listed, and the watch
/// that follows the read sees a change. (The watch's own limit is not reached here: etcd
/// takes no write over 1.5 MiB, and one event's answer stays under 4 MiB.)
#[tokio::test]
async fn a_service_of_more_than_four_mib_is_read_whole_and_watched() {
    let etcd = Etcd::start().await;
    let reg = registry(&etcd, TTL).await;
    let mut kv = etcd.client().await.kv_client();
    // Six instances of about 1 MiB each (etcd takes requests of up to 1.5 MiB).
    let mut expected = Vec::new();
    for i in 0..6 {
        let address = format!("127.0.0.1:{}", 2000 + i);
        let mut instance = Instance::new(address.clone(), ["t.Big"]);
        instance
            .metadata
            .insert("pad".into(), "x".repeat(1024 * 1024));
        let value = serde_json::to_vec(&instance).expect("json");
        kv.put(reg.key(&"t.Big".into(), &address), value, None)
            .await
            .expect("put");
        expected.push(address);
    }
    let mut w = watch(&reg, "t.Big").await;
    assert_eq!(addresses(&w), expected);
    reg.register(Instance::new("127.0.0.1:1999", ["t.Big"]))
        .await
        .expect("register");
    wait_until(&mut w, SEEN_WITHIN, "the addition", has("127.0.0.1:1999")).await;
}

#[tokio::test]
async fn watches_end_with_their_last_watcher_and_everything_with_the_registry() {
    let etcd = Etcd::start().await;
    let reg = registry(&etcd, TTL).await;
    // Watchers of one service share one etcd watch.
    let a1 = watch(&reg, "t.A").await;
    let a2 = watch(&reg, "t.A").await;
    let a3 = a1.clone();
    let mut b = watch(&reg, "t.B").await;
    etcd.wait_for_watchers(2).await;

    // The last watcher of t.A gone, its etcd watch ends; t.B's stays. Until then the clone
    // left follows t.A on the shared watch.
    drop((a1, a2));
    let mut a3 = a3;
    reg.register(Instance::new("127.0.0.1:1000", ["t.A"]))
        .await
        .expect("register");
    wait_until(
        &mut a3,
        SEEN_WITHIN,
        "the clone's addition",
        has("127.0.0.1:1000"),
    )
    .await;
    reg.deregister("127.0.0.1:1000").await.expect("deregister");
    wait_until(&mut a3, SEEN_WITHIN, "the clone's removal", |l| {
        l.is_empty()
    })
    .await;
    etcd.wait_for_watchers(2).await;
    drop(a3);
    etcd.wait_for_watchers(1).await;
    // Watching t.A again starts a new one, which works.
    let mut a = watch(&reg, "t.A").await;
    etcd.wait_for_watchers(2).await;
    reg.register(Instance::new("127.0.0.1:1001", ["t.A", "t.B"]))
        .await
        .expect("register");
    wait_until(&mut a, SEEN_WITHIN, "addition", has("127.0.0.1:1001")).await;
    wait_until(&mut b, SEEN_WITHIN, "addition", has("127.0.0.1:1001")).await;

    // Dropping the registry (every clone) ends its watches, which report it, and stops the
    // keep-alive without revoking: the instance goes when its lease expires, as after a crash.
    let key = reg.key(&"t.A".into(), "127.0.0.1:1001");
    let other = registry(&etcd, TTL).await;
    let mut seen_by_other = watch(&other, "t.A").await;
    etcd.wait_for_watchers(3).await;
    drop(reg);
    let dropped = Instant::now();
    etcd.wait_for_watchers(1).await;
    // (`changed` first reports a snapshot this watch has not been through `changed` for.)
    let mut ended = false;
    for _ in 0..3 {
        if within("the watch ends", a.changed()).await.is_err() {
            ended = true;
            break;
        }
    }
    assert!(ended, "the watch reports that it ended");
    assert_eq!(addresses(&b), ["127.0.0.1:1001"], "the last snapshot stays");
    let raw = etcd.client().await;
    assert!(lease_of(&raw, &key).await.is_some(), "not revoked");
    wait_until(
        &mut seen_by_other,
        TTL + Duration::from_millis(1500),
        "expired",
        lacks("127.0.0.1:1001"),
    )
    .await;
    let took = dropped.elapsed();
    assert!(
        took >= TTL / 2,
        "gone after {took:?}: too early for an expiry"
    );
}

#[tokio::test]
async fn an_unreachable_etcd_is_a_clear_error_not_a_construction_failure() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let reg =
        EtcdRegistry::from_url_with_options(&format!("etcd://127.0.0.1:{port}"), options(TTL))
            .await
            .expect("constructing does not need etcd");
    let e = within("watch", reg.watch(&"t.A".into()))
        .await
        .expect_err("nothing to watch");
    let text = e.to_string();
    assert!(
        text.contains(&format!("etcd at 127.0.0.1:{port} unreachable")),
        "{text}"
    );
    let e = within(
        "register",
        reg.register(Instance::new("127.0.0.1:1", ["t.A"])),
    )
    .await
    .expect_err("nowhere to register");
    assert!(e.to_string().contains("unreachable"), "{e}");

    let e = EtcdRegistry::from_url("http://127.0.0.1:2379")
        .await
        .expect_err("not an etcd:// URL");
    assert!(e.to_string().contains("etcd://host:port"), "{e}");
}
