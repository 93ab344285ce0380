//! The ZooKeeper registry against a real ZooKeeper, started by the tests on free loopback ports
//! (`common/zookeeper.rs`): its node layout, a server whose session expired registering again,
//! calls surviving a ZooKeeper restart (the sessions resumed), re-registration when ZooKeeper
//! comes back empty, malformed values. What every registry backend must do (registration,
//! removal, replacement, order, a killed server process expiring with its session) runs for
//! ZooKeeper in `registry_suite.rs`.
//!
//! Sessions time out after 2 s here, so the tests that wait for an expiry wait a few seconds of
//! real time (ZooKeeper's clock cannot be paused); every other wait ends as soon as the watch
//! reports, bounded by `common::LIMIT` only so that a hang fails. The tests that need no
//! restart share one ZooKeeper, each under its own prefix.

use crate::common;
use crate::registry_watch;
use crate::zookeeper_harness;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{within, LIMIT};
use registry_watch::{
    a_new_server_gets_calls, addresses, has, lacks, never_within, serve, spawn_registered_child,
    wait_until, watch, CallsThroughout, ChildProcess,
};
use rpc::{Client, Instance, Registry};
use rpc::{ZooKeeperOptions, ZooKeeperRegistry};
use tests::who::{Who, WhoClient};
use zookeeper_harness::ZooKeeper;

/// The session timeout of the tests' registries.
const TTL: Duration = Duration::from_secs(2);
/// How long a watcher may take to see an addition or a removal: no timing claim, only a bound
/// so that a change that never comes fails the test instead of hanging it.
const SEEN_WITHIN: Duration = LIMIT;

/// A registry on `url` with a session timeout of [`TTL`].
fn registry(url: &str) -> ZooKeeperRegistry {
    registry_within(url, Duration::from_secs(2))
}

/// A registry on `url` that gives up on ZooKeeper after 300 ms (its background tasks go on
/// trying), for tests that stop ZooKeeper.
fn quick_registry(url: &str) -> ZooKeeperRegistry {
    registry_within(url, Duration::from_millis(300))
}

/// A registry on `url` with a session timeout of [`TTL`] that gives up on opening a session,
/// and on each request, after `limit`.
fn registry_within(url: &str, limit: Duration) -> ZooKeeperRegistry {
    let options = ZooKeeperOptions {
        session_timeout: TTL,
        connect_timeout: limit,
        request_timeout: limit,
        ..ZooKeeperOptions::default()
    };
    ZooKeeperRegistry::from_url_with_options(url, options).expect("ZooKeeper registry")
}

/// The shared ZooKeeper's URL under a fresh prefix.
async fn fresh_url() -> String {
    ZooKeeper::shared()
        .await
        .url_with_prefix(&ZooKeeper::prefix())
}

/// The stat of `path`, or `None` when there is no such node.
async fn stat(raw: &zookeeper_client::Client, path: &str) -> Option<zookeeper_client::Stat> {
    within("ZooKeeper stat", raw.check_stat(path))
        .await
        .expect("ZooKeeper stat")
}

/// ZooKeeper's layout: one ephemeral node per (service, instance) holding the instance's JSON,
/// all of one session, under a service node of no session. A new version replaces the nodes in place
/// and those it no longer has go before `register` returns; deregistering removes the rest.
/// (What every backend must show through its watches is checked in `registry_suite.rs`.)
#[tokio::test]
async fn an_instance_is_one_ephemeral_node_per_service_holding_its_json() {
    let zk = ZooKeeper::shared().await;
    let prefix = ZooKeeper::prefix();
    let reg = registry(&zk.url_with_prefix(&prefix));
    let published = Instance::new("127.0.0.1:1001", ["t.A", "t.B"]);
    within("register", reg.register(published.clone()))
        .await
        .expect("register");

    let raw = zk.client().await;
    let node_a = format!("{prefix}/services/t.A/127.0.0.1:1001");
    let node_b = format!("{prefix}/services/t.B/127.0.0.1:1001");
    assert_eq!(reg.path(&"t.A".into(), "127.0.0.1:1001"), node_a);
    let (data, stat_a) = within("get", raw.get_data(&node_a))
        .await
        .expect("the node under t.A");
    let stored: Instance = serde_json::from_slice(&data).expect("JSON instance");
    assert_eq!(stored, published);
    assert_ne!(stat_a.ephemeral_owner, 0, "an ephemeral node");
    let stat_b = stat(&raw, &node_b).await.expect("the node under t.B");
    assert_eq!(
        stat_b.ephemeral_owner, stat_a.ephemeral_owner,
        "one session for every node of the registry"
    );
    // The service node belongs to no session (it is a container, which ZooKeeper shows to
    // clients as a node without owner).
    let dir = stat(&raw, &format!("{prefix}/services/t.A")).await;
    assert_eq!(dir.map(|s| s.ephemeral_owner), Some(0), "the service node");

    // Registering the id again, now serving t.B only: t.A's node is gone when it returns, and
    // t.B's holds the new version.
    let v2 = Instance::new("127.0.0.1:1001", ["t.B"]);
    within("register again", reg.register(v2.clone()))
        .await
        .expect("register again");
    assert!(stat(&raw, &node_a).await.is_none(), "t.A's node is gone");
    let (data, _) = within("get", raw.get_data(&node_b))
        .await
        .expect("still under t.B");
    assert_eq!(serde_json::from_slice::<Instance>(&data).expect("JSON"), v2);

    // Deregistering removes the node when it returns.
    within("deregister", reg.deregister("127.0.0.1:1001"))
        .await
        .expect("deregister");
    assert!(stat(&raw, &node_b).await.is_none(), "t.B's node is gone");
}

/// Sends `signal` (`STOP`, `CONT`) to `child`.
fn signal(child: &ChildProcess, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &child.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} failed: {status}");
}

/// A server frozen (SIGSTOP) for longer than its session timeout loses its session, and with it
/// its node; once it runs again it finds its session expired and registers on a new one.
#[tokio::test]
async fn a_server_whose_session_expired_registers_again() {
    let url = fresh_url().await;
    let (child, addr) = spawn_registered_child(&url, TTL).await;
    let client_reg = registry(&url);
    let mut w = watch(&client_reg, WhoClient::SERVICE_ID).await;
    wait_until(&mut w, SEEN_WITHIN, "child registered", has(&addr)).await;

    signal(&child, "STOP");
    let stopped = Instant::now();
    let limit = TTL + Duration::from_millis(1500);
    wait_until(&mut w, limit, "frozen server expired", lacks(&addr)).await;
    let took = stopped.elapsed();
    assert!(
        took >= TTL / 2,
        "gone after {took:?}: too early for an expiry"
    );

    signal(&child, "CONT");
    let resumed = Instant::now();
    wait_until(&mut w, SEEN_WITHIN, "registered again", has(&addr)).await;
    eprintln!(
        "frozen server's session expired after {took:?}; registered again {:?} after it resumed",
        resumed.elapsed()
    );
    let who = WhoClient::new(Client::builder().registry(client_reg.clone()).build());
    assert_eq!(within("call", who.whoami()).await.expect("call"), "child");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_keep_working_while_zookeeper_restarts_and_the_sessions_resume() {
    let mut zk = ZooKeeper::start().await;
    let url = zk.url();
    let server_reg = registry(&url);
    let server = serve("a", &server_reg).await;
    let addr = server.local_addr().to_string();
    let client_reg = registry(&url);
    let mut w = watch(&client_reg, WhoClient::SERVICE_ID).await;
    let who = WhoClient::new(Client::builder().registry(client_reg.clone()).build());
    assert_eq!(within("call", who.whoami()).await.expect("call"), "a");
    let node = server_reg.path(&WhoClient::SERVICE_ID.into(), &addr);
    let owner = stat(&zk.client().await, &node)
        .await
        .expect("registered")
        .ephemeral_owner;

    // Calls run all along, from another task: through ZooKeeper's outage and its restart.
    let calls = CallsThroughout::start(&who, "a");

    // A short outage (ZooKeeper killed and started again at once, within the session timeout):
    // both registries reconnect within their sessions, and the client's watch, which reads the
    // service again after a reconnection, goes on following it: an instance registered now is
    // seen.
    zk.restart().await;
    let other_reg = registry(&url);
    // An address nothing listens on: a call sent there meanwhile fails over to `a`.
    let other = format!("127.0.0.1:{}", zookeeper_harness::free_port());
    within(
        "register",
        other_reg.register(Instance::new(other.as_str(), [WhoClient::SERVICE_ID])),
    )
    .await
    .expect("register after the short outage");
    wait_until(&mut w, SEEN_WITHIN, "seen after reconnecting", has(&other)).await;
    within("deregister", other_reg.deregister(&other))
        .await
        .expect("deregister");
    wait_until(&mut w, SEEN_WITHIN, "gone again", lacks(&other)).await;
    let kept = stat(&zk.client().await, &node).await.expect("registered");
    assert_eq!(kept.ephemeral_owner, owner, "the same session, kept");

    // ZooKeeper goes away for twice the session timeout: long enough for both registries to
    // give their sessions up (after 7/5 of the timeout without an answer). The client keeps the
    // last known endpoints.
    zk.stop();
    never_within(
        &mut w,
        TTL * 2,
        "the client dropped its endpoints while ZooKeeper was away",
        |l| l.is_empty(),
    )
    .await;
    assert_eq!(
        addresses(&w),
        vec![addr.clone()],
        "the last known endpoints"
    );

    // ZooKeeper is back with its data, and its sessions with a fresh timeout: both registries
    // resume theirs, so the node is the one written before the outage (same session), and it
    // outlives another session timeout (a session nobody resumed would expire within it, and
    // one replaced would give the node another owner).
    zk.restart().await;
    never_within(
        &mut w,
        TTL + Duration::from_secs(1),
        "the registration went after ZooKeeper restarted",
        lacks(&addr),
    )
    .await;
    let after = stat(&zk.client().await, &node).await.expect("registered");
    assert_eq!(after.ephemeral_owner, owner, "the same session, resumed");

    calls
        .stop_and_check("through ZooKeeper's outage and restart")
        .await;

    // The client's watch follows ZooKeeper again: a server started now gets calls.
    a_new_server_gets_calls(&registry(&url), &mut w, &who, None).await;
    within("shutdown", server.shutdown()).await;
}

/// Registering an id again with no services takes the instance away, as deregistering does:
/// when ZooKeeper does not answer, the call fails and the nodes go as soon as it answers again
/// (the session lives on across the outage, so they would not go by themselves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_registered_again_without_services_goes_once_zookeeper_answers() {
    let mut zk = ZooKeeper::start().await;
    let url = zk.url();
    let reg = quick_registry(&url);
    within(
        "register",
        reg.register(Instance::new("127.0.0.1:1001", ["t.A"])),
    )
    .await
    .expect("register");
    let node = reg.path(&"t.A".into(), "127.0.0.1:1001");
    let owner = stat(&zk.client().await, &node)
        .await
        .expect("registered")
        .ephemeral_owner;

    zk.stop();
    let no_services: [&str; 0] = [];
    let refused = within(
        "register without services",
        reg.register(Instance::new("127.0.0.1:1001", no_services)),
    )
    .await;
    assert!(refused.is_err(), "ZooKeeper is down, yet the nodes went");
    zk.restart().await;

    // Another process's view, from after the outage.
    let other = registry(&url);
    let mut w = watch(&other, "t.A").await;
    wait_until(
        &mut w,
        SEEN_WITHIN,
        "the instance gone",
        lacks("127.0.0.1:1001"),
    )
    .await;
    assert!(
        stat(&zk.client().await, &node).await.is_none(),
        "the node of session {owner:#x} outlived the outage"
    );
}

/// An instance deregistered while ZooKeeper does not answer, then registered again under the
/// same id with fewer services once it does (a shard restarting under its fixed id): the
/// nodes of the services it no longer serves still go. Before, the background removal gave
/// up as soon as the id was registered again, and those nodes stayed for the session's life
/// (which resumes across the outage), so callers of that service kept calling an instance
/// that no longer served it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_deregistration_still_removes_what_a_new_registration_no_longer_serves() {
    let mut zk = ZooKeeper::start().await;
    let url = zk.url();
    let reg = quick_registry(&url);
    let id = "127.0.0.1:1002";
    within("register", reg.register(Instance::new(id, ["t.A", "t.B"])))
        .await
        .expect("register");
    zk.stop();
    let missed = within("deregister", reg.deregister(id)).await;
    assert!(missed.is_err(), "ZooKeeper is down, yet the nodes went");
    zk.restart().await;
    // (The restarted ZooKeeper may not answer within the registry's 300 ms at first.)
    let mut tries = 0;
    while let Err(e) = within("register again", reg.register(Instance::new(id, ["t.A"]))).await {
        tries += 1;
        assert!(tries < 20, "registering again: {e}");
    }

    // Another process's view, from after the outage.
    let other = registry(&url);
    let mut b = watch(&other, "t.B").await;
    wait_until(&mut b, SEEN_WITHIN, "gone from t.B", lacks(id)).await;
    let mut a = watch(&other, "t.A").await;
    wait_until(&mut a, SEEN_WITHIN, "still in t.A", has(id)).await;
}

/// A deregistration given up after its first step (a timeout around a server's shutdown):
/// the registration is already forgotten, so no later deregistration would find it, and the
/// nodes belong to the registry's session, which lives on. The nodes still go, in the
/// background. Before, they stayed for the session's life, and callers kept dialling the
/// instance. (On one thread: the connection's task, which reads ZooKeeper's answers, cannot
/// run during the one poll, so the removal is surely midway when given up; with a second
/// worker it could answer within that poll.)
#[tokio::test]
async fn a_deregistration_given_up_midway_still_removes_the_nodes() {
    let zk = ZooKeeper::shared().await;
    let url = zk.url_with_prefix(&ZooKeeper::prefix());
    let reg = quick_registry(&url);
    let id = "127.0.0.1:1003";
    within("register", reg.register(Instance::new(id, ["t.A"])))
        .await
        .expect("register");
    let mut w = watch(&reg, "t.A").await;
    wait_until(&mut w, SEEN_WITHIN, "registered", has(id)).await;
    // One poll: the removal has asked for the nodes' stats, not deleted them yet.
    let given_up = tokio::time::timeout(Duration::ZERO, reg.deregister(id)).await;
    assert!(
        !matches!(given_up, Ok(Ok(()))),
        "the removal was done in one poll"
    );
    within("deregister again", reg.deregister(id))
        .await
        .expect("nothing left to deregister: the registration is forgotten");
    wait_until(&mut w, SEEN_WITHIN, "the instance gone", lacks(id)).await;
    assert!(
        stat(&zk.client().await, &reg.path(&"t.A".into(), id))
            .await
            .is_none(),
        "the node outlived the deregistration"
    );
}

/// A deregistration given up mid-way by a registry dropped at once (a server's shutdown
/// given up, its handle the registry's last owner) still removes the nodes, at once: not only
/// when the session ends, 30 s later here (before, the removal's first attempt waited out a
/// pause, and the registry gone by then, it never came).
#[tokio::test]
async fn a_deregistration_given_up_as_the_registry_goes_still_removes_the_nodes() {
    let zk = ZooKeeper::shared().await;
    let url = zk.url_with_prefix(&ZooKeeper::prefix());
    let options = ZooKeeperOptions {
        session_timeout: Duration::from_secs(30),
        connect_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_millis(300),
        ..ZooKeeperOptions::default()
    };
    let reg = ZooKeeperRegistry::from_url_with_options(&url, options).expect("registry");
    let id = "127.0.0.1:1006";
    within("register", reg.register(Instance::new(id, ["t.A"])))
        .await
        .expect("register");
    let other = registry(&url);
    let mut w = watch(&other, "t.A").await;
    wait_until(&mut w, SEEN_WITHIN, "registered", has(id)).await;
    // One poll: the removal is given up mid-way (or, ZooKeeper not answering this session at
    // that moment, failed at once): either way it is left to the background.
    let given_up = tokio::time::timeout(Duration::ZERO, reg.deregister(id)).await;
    assert!(
        !matches!(given_up, Ok(Ok(()))),
        "the removal was done in one poll"
    );
    drop(reg);
    wait_until(&mut w, SEEN_WITHIN, "the instance gone", lacks(id)).await;
}

/// A registration over ZooKeeper's request limit (an instance is written once per service,
/// in one request) is refused as a configuration error naming its size, before anything is
/// sent: ZooKeeper would close the connection, failing it as "unreachable" and making every
/// watch of the process reconnect. One within the limit is written.
#[tokio::test]
async fn a_registration_over_zookeepers_request_limit_is_refused_as_configuration() {
    let zk = ZooKeeper::shared().await;
    let reg = registry(&zk.url_with_prefix(&ZooKeeper::prefix()));
    let with_blob = |id: &str, bytes: usize| {
        let mut instance = Instance::new(id, ["t.A", "t.B"]);
        instance.metadata.insert("blob".into(), "x".repeat(bytes));
        instance
    };
    // Twice 600 KB in one request: over 1 MiB.
    let refused = within(
        "register",
        reg.register(with_blob("127.0.0.1:1004", 600_000)),
    )
    .await
    .expect_err("over the limit");
    assert!(
        matches!(&refused, rpc::RegistryError::Config(m) if m.contains("jute.maxbuffer")),
        "{refused}"
    );
    // Twice 400 KB: within it, and ZooKeeper takes it.
    let kept = with_blob("127.0.0.1:1005", 400_000);
    within("register", reg.register(kept))
        .await
        .expect("within the limit");
    let mut w = watch(&reg, "t.B").await;
    wait_until(&mut w, SEEN_WITHIN, "registered", has("127.0.0.1:1005")).await;
}

/// An ensemble one of whose servers takes connections and never answers (hung, or its
/// answers lost): opening a session tries each server for its share of `connect_timeout`
/// (3 s of 6 s here), so registering works whichever server the client tries first. Before,
/// the client gave each server 2/5 of the session timeout (8 s of 20 s here), more than the
/// whole `connect_timeout`, and an open that tried the silent server first failed. (Each
/// registry shuffles the servers: three of them try it first at least once but one time in
/// eight.)
#[tokio::test]
async fn a_silent_server_in_the_ensemble_does_not_keep_sessions_from_opening() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_addr = silent.local_addr().expect("address");
    let zk = ZooKeeper::shared().await;
    let url = format!(
        "zk://{silent_addr},{}{}",
        zk.url().trim_start_matches("zk://"),
        ZooKeeper::prefix()
    );
    let options = ZooKeeperOptions {
        session_timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(6),
        ..ZooKeeperOptions::default()
    };
    for i in 0..3 {
        let reg = ZooKeeperRegistry::from_url_with_options(&url, options.clone())
            .expect("ZooKeeper registry");
        within(
            "register",
            reg.register(Instance::new(format!("127.0.0.1:{}", 2000 + i), ["t.S"])),
        )
        .await
        .unwrap_or_else(|e| panic!("registry {i}: {e}"));
    }
    drop(silent);
}

/// With ZooKeeper unreachable in a way that makes each attempt to open a session take the
/// whole `connect_timeout` (it takes connections and never answers), callers asking for the
/// session at once (a watch per service, a registration, a deregistration) all have their
/// answer after about one attempt: they share its failure. Before, each waited for every
/// attempt queued before its own, eight callers eight attempts (24 s here).
#[tokio::test(start_paused = true)]
async fn callers_share_a_failed_attempt_to_open_a_session() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("zk://{}/rpc", silent.local_addr().expect("address"));
    let connect_timeout = Duration::from_secs(3);
    let options = ZooKeeperOptions {
        connect_timeout,
        ..ZooKeeperOptions::default()
    };
    let reg = ZooKeeperRegistry::from_url_with_options(&url, options).expect("registry");
    let started = tokio::time::Instant::now();
    let answers = futures_util::future::join_all((0..8).map(|_| reg.services())).await;
    let mut shared = 0;
    for answer in answers {
        let e = answer.expect_err("no ZooKeeper answers");
        assert!(matches!(e, rpc::RegistryError::Unavailable(_)), "{e}");
        // A caller answered with another's failure is told so.
        shared += usize::from(e.to_string().contains("ms ago; the next one in"));
    }
    assert_eq!(shared, 7, "one attempt, seven callers sharing it");
    // One attempt and a little more: two attempts at most, where eight would take eight.
    let waited = started.elapsed();
    assert!(
        waited < 2 * connect_timeout,
        "the callers waited {waited:?}"
    );
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_registers_again_when_zookeeper_comes_back_empty() {
    let mut zk = ZooKeeper::start().await;
    let url = zk.url();
    let server_reg = registry(&url);
    let server = serve("a", &server_reg).await;
    let addr = server.local_addr().to_string();
    let client_reg = registry(&url);
    let w = watch(&client_reg, WhoClient::SERVICE_ID).await;
    let who = WhoClient::new(Client::builder().registry(client_reg.clone()).build());
    assert_eq!(within("call", who.whoami()).await.expect("call"), "a");

    // A new, empty ZooKeeper on the same address: every node and session is gone. The server
    // finds its session expired and writes its node again on a new one.
    zk.restart_empty().await;
    let started = Instant::now();
    let fresh = registry(&url);
    let mut seen = watch(&fresh, WhoClient::SERVICE_ID).await;
    wait_until(
        &mut seen,
        Duration::from_secs(10),
        "registered again",
        has(&addr),
    )
    .await;
    eprintln!(
        "registered again {:?} after ZooKeeper came back",
        started.elapsed()
    );

    // The client's watch follows the new ZooKeeper (on a new session of its own): another
    // server appears, and calls reach it.
    let mut w = w;
    a_new_server_gets_calls(&registry(&url), &mut w, &who, Some(&addr)).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn malformed_values_are_skipped() {
    let zk = ZooKeeper::shared().await;
    let prefix = ZooKeeper::prefix();
    let raw = zk.client().await;
    let persistent =
        zookeeper_client::CreateMode::Persistent.with_acls(zookeeper_client::Acls::anyone_all());
    let dir = format!("{prefix}/services/t.A");
    within("mkdir", raw.mkdir(&dir, &persistent))
        .await
        .expect("mkdir");
    let put = |name: &str, value: Vec<u8>| {
        let path = format!("{dir}/{name}");
        let raw = &raw;
        let persistent = &persistent;
        async move {
            within("create", raw.create(&path, &value, persistent))
                .await
                .expect("create");
        }
    };
    put("garbage", b"not json".to_vec()).await;
    // A node another tool made that nobody may read: skipped, not a failure of the whole
    // service (before, every read of t.A failed, and no client could resolve it).
    let unreadable = zookeeper_client::Acl::new(
        zookeeper_client::Permission::DELETE,
        zookeeper_client::AuthId::anyone(),
    );
    let unreadable = [unreadable];
    let no_read = zookeeper_client::CreateMode::Persistent
        .with_acls(zookeeper_client::Acls::new(&unreadable));
    within(
        "create",
        raw.create(&format!("{dir}/locked"), b"{}", &no_read),
    )
    .await
    .expect("create");
    let reg = registry(&zk.url_with_prefix(&prefix));
    within(
        "register",
        reg.register(Instance::new("127.0.0.1:1001", ["t.A"])),
    )
    .await
    .expect("register");
    let mut w = watch(&reg, "t.A").await;
    assert_eq!(addresses(&w), ["127.0.0.1:1001"], "the garbage is skipped");

    // Garbage arriving while watching is skipped too; a valid value after it is seen.
    put("partial", br#"{"id":"x"}"#.to_vec()).await;
    // A valid instance that does not serve t.A, under t.A's node: not an endpoint of t.A.
    let stray = serde_json::to_vec(&Instance::new("127.0.0.1:7", ["t.Other"])).expect("json");
    put("stray", stray).await;
    // A node naming one id and holding another's instance (a hand-written copy): not the
    // instance its path names, so no endpoint either (it would stand for 127.0.0.1:1001).
    let mut impostor = Instance::new("127.0.0.1:1001", ["t.A"]);
    impostor.address = "127.0.0.1:1".into();
    put("127.0.0.1:9", serde_json::to_vec(&impostor).expect("json")).await;
    // One nobody may read arriving while watching: skipped too.
    within(
        "create",
        raw.create(&format!("{dir}/locked-later"), b"{}", &no_read),
    )
    .await
    .expect("create");
    within(
        "register",
        reg.register(Instance::new("127.0.0.1:1000", ["t.A"])),
    )
    .await
    .expect("register");
    wait_until(&mut w, SEEN_WITHIN, "valid addition", has("127.0.0.1:1000")).await;
    assert_eq!(addresses(&w), ["127.0.0.1:1000", "127.0.0.1:1001"]);

    // A valid node overwritten with garbage stops being an endpoint.
    let node = format!("{dir}/127.0.0.1:1000");
    within("set", raw.set_data(&node, b"{", None))
        .await
        .expect("set");
    wait_until(&mut w, SEEN_WITHIN, "overwritten", lacks("127.0.0.1:1000")).await;
}
