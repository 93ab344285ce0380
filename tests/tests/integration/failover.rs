//! Failover across endpoints: dead servers are skipped, a total outage names every endpoint
//! tried, and a call that may have run is repeated only for idempotent entries.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{recv_one, within};
use rpc::{answered_by, Client, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode};
use tokio::sync::mpsc;

#[rpc::service(name = "t.Fail")]
trait Fail {
    #[governance(idempotent)]
    async fn read(&self) -> Result<String, RpcError>;
    /// Not idempotent.
    async fn write(&self) -> Result<String, RpcError>;
    /// Not idempotent; reports entry and never answers.
    async fn stuck_write(&self) -> Result<String, RpcError>;
    #[governance(idempotent, shunt_strategy = "hash")]
    async fn lookup(&self, #[hash_key] key: String) -> Result<String, RpcError>;
}

struct Node {
    name: String,
    writes: AtomicUsize,
    stuck: AtomicUsize,
    entered: mpsc::UnboundedSender<String>,
}

impl Fail for Node {
    async fn read(&self) -> Result<String, RpcError> {
        Ok(self.name.clone())
    }
    async fn write(&self) -> Result<String, RpcError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        Ok(self.name.clone())
    }
    async fn stuck_write(&self) -> Result<String, RpcError> {
        self.stuck.fetch_add(1, Ordering::SeqCst);
        let _ = self.entered.send(self.name.clone());
        std::future::pending::<()>().await;
        Ok(self.name.clone())
    }
    async fn lookup(&self, _key: String) -> Result<String, RpcError> {
        Ok(self.name.clone())
    }
}

struct Cluster {
    servers: BTreeMap<String, ServerHandle>,
    nodes: BTreeMap<String, Arc<Node>>,
    addr: BTreeMap<String, String>,
    entered: mpsc::UnboundedReceiver<String>,
}

impl Cluster {
    async fn start(reg: &InProcessRegistry) -> Cluster {
        let (tx, entered) = mpsc::unbounded_channel();
        let mut c = Cluster {
            servers: BTreeMap::new(),
            nodes: BTreeMap::new(),
            addr: BTreeMap::new(),
            entered,
        };
        for name in ["a", "b", "c"] {
            let node = Arc::new(Node {
                name: name.into(),
                writes: AtomicUsize::new(0),
                stuck: AtomicUsize::new(0),
                entered: tx.clone(),
            });
            let s = Server::builder()
                .registry(reg.clone())
                .add_service(FailServer::from_arc(node.clone()))
                .serve("127.0.0.1:0")
                .await
                .expect("serve");
            c.addr.insert(name.into(), s.local_addr().to_string());
            c.servers.insert(name.into(), s);
            c.nodes.insert(name.into(), node);
        }
        c
    }

    /// Kills a server as a crash would: connections drop, the registry entry stays.
    fn abort(&mut self, name: &str) {
        self.servers.remove(name).expect("running").abort();
    }

    async fn stop(self) {
        for (_, s) in self.servers {
            within("shutdown", s.shutdown()).await;
        }
    }
}

#[tokio::test]
async fn idempotent_calls_fail_over_to_the_survivor() {
    let reg = InProcessRegistry::new();
    let mut cluster = Cluster::start(&reg).await;
    let fail = FailClient::new(Client::builder().registry(reg.clone()).build());
    // Connections to all three are open and pooled.
    let warm: BTreeSet<String> = [
        fail.read().await.expect("read"),
        fail.read().await.expect("read"),
        fail.read().await.expect("read"),
    ]
    .into();
    assert_eq!(warm.len(), 3, "{warm:?}");

    cluster.abort("a");
    cluster.abort("b");
    for i in 0..20 {
        let (r, by) = answered_by(within("read after the crash", fail.read())).await;
        assert_eq!(r.expect("failover to c"), "c", "call {i}");
        assert_eq!(by.as_deref(), Some(cluster.addr["c"].as_str()));
    }
    cluster.stop().await;
}

#[tokio::test]
async fn a_total_outage_is_a_communication_error_naming_every_endpoint() {
    let reg = InProcessRegistry::new();
    let mut cluster = Cluster::start(&reg).await;
    let fail = FailClient::new(Client::builder().registry(reg.clone()).build());
    fail.read().await.expect("read while up");
    for name in ["a", "b", "c"] {
        cluster.abort(name);
    }
    let err = within("read with every server down", fail.read())
        .await
        .expect_err("nothing is up");
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    let tried: BTreeSet<&str> = err.tried().iter().map(String::as_str).collect();
    let all: BTreeSet<&str> = cluster.addr.values().map(String::as_str).collect();
    assert_eq!(tried, all, "every endpoint was tried: {err}");
    let shown = err.to_string();
    for addr in cluster.addr.values() {
        assert!(
            shown.contains(addr.as_str()),
            "{addr} missing from: {shown}"
        );
    }
}

#[tokio::test]
async fn a_non_idempotent_call_whose_server_dies_mid_call_is_not_repeated() {
    let reg = InProcessRegistry::new();
    let mut cluster = Cluster::start(&reg).await;
    let fail = FailClient::new(Client::builder().registry(reg.clone()).build());
    let call = tokio::spawn({
        let fail = fail.clone();
        async move { fail.stuck_write().await }
    });
    let victim = recv_one("the call reached a server", &mut cluster.entered).await;
    cluster.abort(&victim);

    let err = within("the interrupted call", call)
        .await
        .expect("join")
        .expect_err("its server died");
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(
        err.is_maybe_delivered(),
        "the request had reached {victim}: {err}"
    );
    assert_eq!(
        err.tried(),
        &[cluster.addr[&victim].clone()][..],
        "tried only where it ran: {err}"
    );
    for (name, node) in &cluster.nodes {
        let expected = usize::from(*name == victim);
        assert_eq!(
            node.stuck.load(Ordering::SeqCst),
            expected,
            "{name}: the call ran only on {victim}"
        );
    }
    assert!(
        cluster.entered.try_recv().is_err(),
        "no second run anywhere"
    );
    cluster.stop().await;
}

#[tokio::test]
async fn a_non_idempotent_call_that_never_reached_a_dead_server_moves_on() {
    let reg = InProcessRegistry::new();
    let mut cluster = Cluster::start(&reg).await;
    // Dead before the client ever connects: connecting fails, so nothing was delivered.
    cluster.abort("a");
    let fail = FailClient::new(Client::builder().registry(reg.clone()).build());
    let mut answered = BTreeMap::new();
    for i in 0..9 {
        let name = within("write", fail.write())
            .await
            .unwrap_or_else(|e| panic!("write {i} should move past the dead server: {e}"));
        *answered.entry(name).or_insert(0) += 1;
    }
    assert!(!answered.contains_key("a"), "{answered:?}");
    let runs: usize = cluster
        .nodes
        .values()
        .map(|n| n.writes.load(Ordering::SeqCst))
        .sum();
    assert_eq!(runs, 9, "each write ran exactly once");
    cluster.stop().await;
}

/// An endpoint that accepts TCP connections, holds them and never answers the handshake: its
/// address, and the task holding them (abort it to let them go).
async fn silent_endpoint() -> (String, tokio::task::JoinHandle<()>) {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = silent.local_addr().expect("addr").to_string();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    (addr, held)
}

/// An endpoint that accepts connections and never answers the handshake, with
/// `attempt_timeout_ms` set: an attempt not connected by its own deadline sent nothing, so a
/// non-idempotent call moves on to a live server (before, it failed as a timeout that "may
/// have been delivered"), and the silent endpoint is marked at once.
#[tokio::test]
async fn a_non_idempotent_call_not_connected_by_its_attempt_timeout_moves_on() {
    let reg = InProcessRegistry::new();
    let cluster = Cluster::start(&reg).await;
    let (silent_addr, held) = silent_endpoint().await;
    rpc::Registry::register(&reg, rpc::Instance::new(silent_addr.clone(), ["t.Fail"]))
        .await
        .expect("register the silent endpoint");
    let fail = FailClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(
                FailClient::SERVICE_ID,
                rpc::GovernanceOverrides {
                    // Long beside a loopback handshake, even on a busy machine.
                    attempt_timeout_ms: Some(500),
                    retry_times: Some(3),
                    ..rpc::GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    for i in 0..8 {
        within("write", fail.write())
            .await
            .unwrap_or_else(|e| panic!("write {i} should move past the silent endpoint: {e}"));
    }
    let runs: usize = cluster
        .nodes
        .values()
        .map(|n| n.writes.load(Ordering::SeqCst))
        .sum();
    assert_eq!(runs, 8, "each write ran exactly once");
    held.abort();
    cluster.stop().await;
}

/// A call that ran out of time with no answer names no endpoint: its only endpoint accepts
/// TCP and never answers the handshake (a server, which enforces the deadline too, might
/// answer 519 first and would then rightly be named).
#[tokio::test]
async fn a_call_that_got_no_answer_names_no_endpoint() {
    let (silent_addr, held) = silent_endpoint().await;
    let fail = FailClient::new(
        Client::builder()
            .registry(rpc::StaticRegistry::from_list(&silent_addr).expect("list"))
            .override_options(
                FailClient::SERVICE_ID,
                rpc::GovernanceOverrides {
                    timeout_ms: Some(200),
                    ..rpc::GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    let (result, by) = answered_by(within("read", fail.read())).await;
    let e = result.expect_err("nothing answers");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert_eq!(by, None, "no endpoint answered: {e}");
    held.abort();
}

/// The oracle is the servers' own answers, not the library's ring: the key's owner is the
/// server that answers it, and its successor the one that answers it for a client whose
/// registry never listed the owner.
#[tokio::test]
async fn a_hash_key_whose_owner_died_goes_to_the_next_server_on_the_ring() {
    let reg = InProcessRegistry::new();
    let mut cluster = Cluster::start(&reg).await;
    let fail = FailClient::new(Client::builder().registry(reg.clone()).build());
    // A key owned by server "a" (bounded: a third of the keys are).
    let mut key = None;
    for i in 0..300 {
        let candidate = format!("key-{i}");
        if fail.lookup(candidate.clone()).await.expect("lookup") == "a" {
            key = Some(candidate);
            break;
        }
    }
    let key = key.expect("some key is owned by a");
    // The servers without "a", as a registry that never listed it has them.
    let without_a = InProcessRegistry::new();
    for (name, addr) in &cluster.addr {
        if name != "a" {
            rpc::Registry::register(
                &without_a,
                rpc::Instance::new(addr.as_str(), [FailClient::SERVICE_ID]),
            )
            .await
            .expect("register");
        }
    }
    let successor = FailClient::new(Client::builder().registry(without_a).build())
        .lookup(key.clone())
        .await
        .expect("lookup without a");
    assert_ne!(successor, "a");
    cluster.abort("a");
    for _ in 0..5 {
        assert_eq!(
            within("lookup after the owner died", fail.lookup(key.clone()))
                .await
                .expect("lookup fails over"),
            successor,
            "the next server clockwise takes the key"
        );
    }
    cluster.stop().await;
}

/// A non-idempotent call running on a server that begins to drain, whose attempt then runs out
/// of time, is not sent anywhere again: the drain's second try on a fresh connection is only
/// for calls the server closed its connection on without reading them. (Before, the attempt's
/// timeout took that path: the call ran on a second server.)
#[tokio::test(start_paused = true)]
async fn a_call_timing_out_on_a_draining_server_is_not_sent_again() {
    let reg = InProcessRegistry::new();
    let (tx, mut entered) = mpsc::unbounded_channel();
    let node = |name: &str| {
        Arc::new(Node {
            name: name.into(),
            writes: AtomicUsize::new(0),
            stuck: AtomicUsize::new(0),
            entered: tx.clone(),
        })
    };
    let serve = |node: Arc<Node>| {
        Server::builder()
            .registry(reg.clone())
            .drain_timeout(std::time::Duration::from_secs(60))
            .add_service(FailServer::from_arc(node))
            .serve("127.0.0.1:0")
    };
    let (a_node, b_node) = (node("a"), node("b"));
    let a = serve(a_node.clone()).await.expect("serve a");
    let fail = FailClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(
                "t.Fail.stuck_write",
                rpc::GovernanceOverrides {
                    timeout_ms: Some(4_000),
                    attempt_timeout_ms: Some(150),
                    retry_times: Some(2),
                    ..rpc::GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    let call = tokio::spawn(async move { fail.stuck_write().await });
    assert_eq!(recv_one("the call reached a", &mut entered).await, "a");
    let b = serve(b_node.clone()).await.expect("serve b");
    // a drains (GoAway 200) with the call running; its attempt's 150 ms then pass.
    let _draining = tokio::spawn(a.shutdown());
    let err = within("the call ends", call)
        .await
        .expect("join")
        .expect_err("it never answers");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    assert_eq!(a_node.stuck.load(Ordering::SeqCst), 1);
    assert_eq!(
        b_node.stuck.load(Ordering::SeqCst),
        0,
        "run again on b: {err}"
    );
    within("b stops", b.shutdown()).await;
}

/// The version of a service still running while a rolling deploy adds an entry to it.
mod before_the_deploy {
    use rpc::RpcError;

    #[rpc::service(name = "t.Rolling")]
    pub trait Rolling {
        async fn old(&self) -> Result<String, RpcError>;
    }

    pub struct Old;

    impl Rolling for Old {
        async fn old(&self) -> Result<String, RpcError> {
            Ok("old".into())
        }
    }
}

/// The version the deploy brings: one entry more.
mod after_the_deploy {
    use rpc::RpcError;

    #[rpc::service(name = "t.Rolling")]
    pub trait Rolling {
        async fn old(&self) -> Result<String, RpcError>;
        /// Not idempotent: repeated elsewhere only because nothing ran.
        async fn added(&self) -> Result<String, RpcError>;
    }

    pub struct New;

    impl Rolling for New {
        async fn old(&self) -> Result<String, RpcError> {
            Ok("new".into())
        }
        async fn added(&self) -> Result<String, RpcError> {
            Ok("new".into())
        }
    }
}

/// During a rolling deploy that adds an entry, a call of the new entry that lands on an
/// instance still running the old version (answered 507: it has no such entry, nothing ran)
/// goes on to an instance that has it, idempotent or not. Before, a share of the calls (half,
/// by turns over one old and one new instance) failed with 507.
#[tokio::test]
async fn a_call_of_an_entry_an_instance_lacks_goes_to_one_that_has_it() {
    use after_the_deploy::{New, Rolling, RollingClient, RollingServer};
    let reg = InProcessRegistry::new();
    let old = Server::builder()
        .registry(reg.clone())
        .add_service(before_the_deploy::RollingServer::new(
            before_the_deploy::Old,
        ))
        .serve("127.0.0.1:0")
        .await
        .expect("serve the old version");
    let new = Server::builder()
        .registry(reg.clone())
        .add_service(RollingServer::new(New))
        .serve("127.0.0.1:0")
        .await
        .expect("serve the new version");
    let client = RollingClient::new(Client::builder().registry(reg.clone()).build());
    for _ in 0..8 {
        assert_eq!(
            within("added", client.added()).await.expect("served"),
            "new"
        );
    }
    within("shutdown", new.shutdown()).await;
    // With only the old version left, the call fails with 507.
    let e = within("added", client.added())
        .await
        .expect_err("no instance has it");
    assert_eq!(e.code(), StatusCode::NotFindLocalServiceEntry, "{e}");
    within("shutdown", old.shutdown()).await;
}

/// A 507 that a hand-written service passes on from a downstream call is its answer, not
/// "this server has no such entry": the call, which ran, is not repeated on another instance
/// (it is not idempotent), with or without server layers. Before, the caller read it as
/// "nothing ran" and sent the call on.
#[tokio::test]
async fn a_507_a_hand_written_service_passes_on_does_not_send_the_call_elsewhere() {
    use after_the_deploy::{New, Rolling, RollingClient, RollingServer};
    for layered in [false, true] {
        let reg = InProcessRegistry::new();
        let (servers, runs) =
            common::PassesOnA507::serve_two(&reg, ("added", layered), || RollingServer::new(New))
                .await;
        let client = RollingClient::new(Client::builder().registry(reg.clone()).build());
        let e = within("added", client.added())
            .await
            .expect_err("the downstream's failure");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "ran once (layered {layered}): {e}"
        );
        assert!(e.message().contains("t.Downstream.gone"), "{e}");
        // Why it went no further: a failure the handler passed on, the call maybe done.
        assert_eq!(e.code(), StatusCode::NotFindServiceRouteAddress, "{e}");
        assert!(e.is_maybe_delivered(), "{e}");
        for server in servers {
            within("shutdown", server.shutdown()).await;
        }
    }
}

#[rpc::service(name = "t.Other")]
trait Other {
    async fn ping(&self) -> Result<(), RpcError>;
}

struct Pong;

impl Other for Pong {
    async fn ping(&self) -> Result<(), RpcError> {
        Ok(())
    }
}

/// `answered_by` names the endpoint whose answer the call returns. Two endpoints and one
/// retry: one serves another service (an entry it does not have: 507, which moves the call
/// on without deciding it), the other is at a cap of 0 (515). Whichever comes first, the call
/// returns the 515 (after the 507, or deciding on it after the detour to the 507), and the
/// endpoint named is the full one. Before, the one answering 507 was named either way.
#[tokio::test]
async fn answered_by_names_the_endpoint_whose_answer_the_call_returns() {
    let other = Server::builder()
        .add_service(OtherServer::new(Pong))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let full = full_server().await;
    let full_addr = full.local_addr().to_string();
    let list = format!("{},{full_addr}", other.local_addr());
    let fail = retrying_once_over(&list);
    // Round robin: both orders come up within a few calls.
    for _ in 0..4 {
        let (result, by) = answered_by(within("read", fail.read())).await;
        let e = result.expect_err("the full server refuses");
        assert!(e.code().is_overflow(), "{e}");
        assert_eq!(by.as_deref(), Some(full_addr.as_str()), "{e}");
    }
    within("shutdown", other.shutdown()).await;
    within("shutdown", full.shutdown()).await;
}

/// `answered_by` names no endpoint when the call returns the error of an attempt that got no
/// answer (a refused connect), whatever answered before it; and the endpoint when the call
/// returns its answer. Two endpoints and one retry: one at a cap of 0 (515), one where nothing
/// listens.
#[tokio::test]
async fn answered_by_names_no_endpoint_for_an_error_no_endpoint_gave() {
    let full = full_server().await;
    let full_addr = full.local_addr().to_string();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").to_string()
    };
    let fail = retrying_once_over(&format!("{full_addr},{dead}"));
    for _ in 0..6 {
        let (result, by) = answered_by(within("read", fail.read())).await;
        let e = result.expect_err("nothing serves the call");
        match e.code() {
            // The refused connect came last: nobody answered what the call returns.
            StatusCode::CommunicationError => assert_eq!(by, None, "{e}"),
            _ => {
                assert!(e.code().is_overflow(), "{e}");
                assert_eq!(by.as_deref(), Some(full_addr.as_str()), "{e}");
            }
        }
    }
    within("shutdown", full.shutdown()).await;
}

/// A server of `t.Fail` at a cap of 0: every call is refused 515.
async fn full_server() -> ServerHandle {
    let (tx, _entered) = mpsc::unbounded_channel();
    Server::builder()
        .max_concurrency(0)
        .add_service(FailServer::new(Node {
            name: "full".into(),
            writes: AtomicUsize::new(0),
            stuck: AtomicUsize::new(0),
            entered: tx,
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

/// A client of `t.Fail` over the endpoints of `list`, retrying once at once, with no breaker
/// (the refusals would open it: the calls must reach every endpoint).
fn retrying_once_over(list: &str) -> FailClient {
    FailClient::new(
        Client::builder()
            .registry(rpc::StaticRegistry::from_list(list).expect("list"))
            .override_options(
                FailClient::SERVICE_ID,
                rpc::GovernanceOverrides {
                    retry_times: Some(1),
                    retry_interval_ms: Some(0),
                    enable_circuit_breaker: Some(false),
                    ..rpc::GovernanceOverrides::NONE
                },
            )
            .build(),
    )
}
