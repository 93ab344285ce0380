//! Failures held against the endpoint that caused them, over real TCP: a half-open probe
//! answered by the callee settles the breaker; one sick or frozen server among healthy ones
//! loses its own traffic instead of taking the entry down; a crash with calls in flight counts
//! once; a removed endpoint is probed in the background and gets traffic again after a restart
//! on the same address; `Client::endpoints` and `Client::readmit` show and steer it.

use crate::common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{recv_one, within};
use rpc::crates::governance::breaker::BreakerState;
use rpc::crates::governance::events::{EventKind, GovernanceEvent};
use rpc::{
    answered_by, Client, GovernanceOptions, GovernanceOverrides, RpcError, Server, ServerHandle,
    StaticRegistry, StatusCode,
};
use rpc::{EndpointState, EndpointStatus};
use tokio::sync::{broadcast, mpsc};

#[rpc::service(name = "h.Shard")]
trait Shard {
    /// Hash-routed by key; not retried, so each call shows where its key went.
    #[governance(shunt_strategy = "hash", retry_times = 0)]
    async fn get(&self, #[hash_key] key: u32) -> Result<String, RpcError>;
    /// Round robin, idempotent: may be repeated elsewhere, after 150 ms on a silent server.
    #[governance(idempotent, attempt_timeout_ms = 150)]
    async fn read(&self) -> Result<String, RpcError>;
    /// Not idempotent; reports entry and never answers.
    async fn hold(&self) -> Result<String, RpcError>;
    /// "unknown" is a business error; a server error while the node is failing.
    #[governance(retry_times = 0)]
    async fn stock(&self, item: String) -> Result<u32, RpcError>;
}

const HEALTHY: u8 = 0;
/// Handlers panic (the server answers 520).
const PANICKING: u8 = 1;
/// Handlers never answer.
const FROZEN: u8 = 2;
/// `stock` answers with a server error.
const FAILING: u8 = 3;

struct Node {
    name: String,
    mode: AtomicU8,
    /// Calls that reached a handler of this node.
    calls: AtomicU32,
    entered: mpsc::UnboundedSender<String>,
}

impl Node {
    async fn behave(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.mode.load(Ordering::SeqCst) {
            PANICKING => panic!("{} is sick", self.name),
            FROZEN => std::future::pending::<()>().await,
            _ => {}
        }
    }
}

impl Shard for Node {
    async fn get(&self, _key: u32) -> Result<String, RpcError> {
        self.behave().await;
        Ok(self.name.clone())
    }
    async fn read(&self) -> Result<String, RpcError> {
        self.behave().await;
        Ok(self.name.clone())
    }
    async fn hold(&self) -> Result<String, RpcError> {
        let _ = self.entered.send(self.name.clone());
        std::future::pending::<()>().await;
        Ok(self.name.clone())
    }
    async fn stock(&self, item: String) -> Result<u32, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if item == "unknown" {
            return Err(RpcError::business("no such item"));
        }
        if self.mode.load(Ordering::SeqCst) == FAILING {
            return Err(RpcError::new(StatusCode::ServerError, "database down"));
        }
        Ok(7)
    }
}

struct Cluster {
    nodes: BTreeMap<String, Arc<Node>>,
    servers: BTreeMap<String, ServerHandle>,
    addr: BTreeMap<String, SocketAddr>,
    entered: mpsc::UnboundedReceiver<String>,
    tx: mpsc::UnboundedSender<String>,
}

impl Cluster {
    async fn start(names: &[&str]) -> Cluster {
        let (tx, entered) = mpsc::unbounded_channel();
        let mut c = Cluster {
            nodes: BTreeMap::new(),
            servers: BTreeMap::new(),
            addr: BTreeMap::new(),
            entered,
            tx,
        };
        for name in names {
            let node = Arc::new(Node {
                name: name.to_string(),
                mode: AtomicU8::new(HEALTHY),
                calls: AtomicU32::new(0),
                entered: c.tx.clone(),
            });
            let s = Server::builder()
                .add_service(ShardServer::from_arc(node.clone()))
                .serve("127.0.0.1:0")
                .await
                .expect("serve");
            c.addr.insert(name.to_string(), s.local_addr());
            c.servers.insert(name.to_string(), s);
            c.nodes.insert(name.to_string(), node);
        }
        c
    }

    /// The static list a client of this cluster is given.
    fn registry(&self) -> StaticRegistry {
        StaticRegistry::new(self.addr.values().map(|a| a.to_string()))
    }

    fn addr(&self, name: &str) -> String {
        self.addr[name].to_string()
    }

    fn name_at(&self, addr: &str) -> String {
        self.addr
            .iter()
            .find(|(_, a)| a.to_string() == addr)
            .map(|(n, _)| n.clone())
            .expect("a cluster address")
    }

    fn set(&self, name: &str, mode: u8) {
        self.nodes[name].mode.store(mode, Ordering::SeqCst);
    }

    /// Kills a server as a crash would: its connections drop at once.
    fn crash(&mut self, name: &str) {
        self.servers.remove(name).expect("running").abort();
    }

    /// Serves `name` again on its old address, retrying while the old listener goes away.
    async fn restart(&mut self, name: &str) {
        let addr = self.addr[name];
        let node = self.nodes[name].clone();
        node.mode.store(HEALTHY, Ordering::SeqCst);
        for _ in 0..100 {
            match Server::builder()
                .add_service(ShardServer::from_arc(node.clone()))
                .serve(addr)
                .await
            {
                Ok(s) => {
                    self.servers.insert(name.to_string(), s);
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("rebinding {addr}: {e}"),
            }
        }
        panic!("{addr} stayed in use");
    }

    fn abort_all(self) {
        for (_, s) in self.servers {
            s.abort();
        }
    }
}

fn status_of(client: &Client, addr: &str) -> EndpointStatus {
    client
        .endpoints()
        .into_iter()
        .find(|e| e.address == addr)
        .unwrap_or_else(|| panic!("{addr} missing from {:?}", client.endpoints()))
}

/// The next event of `kind` about `addr`, within [`LIMIT`].
async fn next_event(
    rx: &mut broadcast::Receiver<GovernanceEvent>,
    kind: EventKind,
    addr: &str,
) -> GovernanceEvent {
    within(&format!("a {kind} event for {addr}"), async {
        loop {
            match rx.recv().await {
                Ok(e) if e.kind == kind && e.endpoint.as_deref() == Some(addr) => return e,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => panic!("event bus closed"),
            }
        }
    })
    .await
}

/// Item 1 over real TCP: the half-open probe is answered with a business error (the callee's
/// own logic answered, so the remote side is up): the breaker closes and the next call goes
/// through instead of getting 522 for another `breaker_seconds`.
#[tokio::test(start_paused = true)]
async fn a_probe_answered_with_a_business_error_closes_the_breaker() {
    let cluster = Cluster::start(&["a"]).await;
    let client = Client::builder()
        .registry(cluster.registry())
        .default_options(GovernanceOptions {
            exceptions_allowed_before_breaking: 2,
            breaker_seconds: 1,
            ..Default::default()
        })
        .build();
    let mut events = client.events().subscribe();
    let shard = ShardClient::new(client.clone());
    let stock = &ShardClient::methods()[3];
    cluster.set("a", FAILING);
    for _ in 0..2 {
        let err = shard.stock("apple".into()).await.expect_err("failing");
        assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    }
    let BreakerState::Open { retry_after } = client.breaker_state(stock) else {
        panic!("open after 2 failures: {:?}", client.breaker_state(stock));
    };
    // The open period ends, on the paused clock.
    tokio::time::sleep(retry_after + Duration::from_millis(10)).await;
    cluster.set("a", HEALTHY);
    let err = within("the probe", shard.stock("unknown".into()))
        .await
        .expect_err("a business error");
    assert_eq!(err.code(), StatusCode::BusinessError, "{err}");
    assert_eq!(
        client.breaker_state(stock),
        BreakerState::Closed { failures: 0 }
    );
    assert_eq!(
        within("the call after the probe", shard.stock("apple".into()))
            .await
            .expect("goes through, not 522"),
        7
    );
    let kinds: Vec<EventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .filter(|k| matches!(k, EventKind::Break | EventKind::HalfOpen | EventKind::Reset))
        .collect();
    assert_eq!(
        kinds,
        [EventKind::Break, EventKind::HalfOpen, EventKind::Reset]
    );

    // Manual decisions are events too.
    client.isolate(stock);
    let err = shard.stock("apple".into()).await.expect_err("isolated");
    assert_eq!(err.code(), StatusCode::CircuitOpen);
    client.reset_breaker(stock);
    assert_eq!(shard.stock("apple".into()).await.expect("reset"), 7);
    let manual: Vec<(EventKind, Option<String>)> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| matches!(e.kind, EventKind::Isolate | EventKind::Reset))
        .map(|e| (e.kind, e.cause))
        .collect();
    assert_eq!(
        manual,
        [
            (EventKind::Isolate, Some("isolated by an operator".into())),
            (EventKind::Reset, Some("reset by an operator".into())),
        ]
    );
    cluster.abort_all();
}

/// Item 2, hash routing: with one of two shards panicking, every key the healthy shard owns
/// still succeeds (the oracle: which server answered each key while both were healthy), and
/// the sick shard's keys fail fast (520) until it is ejected, then fail over.
#[tokio::test]
async fn one_sick_shard_does_not_take_the_healthy_shards_keys_down() {
    let cluster = Cluster::start(&["a", "b"]).await;
    let client = Client::builder().registry(cluster.registry()).build();
    let mut events = client.events().subscribe();
    let shard = ShardClient::new(client.clone());
    let mut owner: BTreeMap<u32, String> = BTreeMap::new();
    for key in 0..200u32 {
        let (r, by) = answered_by(shard.get(key)).await;
        let name = r.expect("both healthy");
        assert_eq!(by.map(|a| cluster.name_at(&a)).as_deref(), Some(&*name));
        owner.insert(key, name);
    }
    let sick_keys = owner.values().filter(|n| *n == "a").count();
    assert!((20..=180).contains(&sick_keys), "{sick_keys} keys on a");
    cluster.set("a", PANICKING);
    // The sick shard's keys come first: three of them in a row would open an entry-wide
    // breaker at once.
    let mut order: Vec<u32> = owner.keys().copied().collect();
    order.sort_by_key(|k| owner[k] != "a");
    order[3..].sort();
    let (mut ok, mut sick_failed) = (0, 0);
    for key in order {
        let (r, by) = answered_by(within("get", shard.get(key))).await;
        match r {
            Ok(name) => {
                ok += 1;
                assert_eq!(name, "b", "key {key}");
                assert_eq!(by, Some(cluster.addr("b")));
            }
            Err(e) => {
                assert_eq!(
                    owner[&key], "a",
                    "key {key} of the healthy shard failed: {e}"
                );
                assert_eq!(e.code(), StatusCode::ServerError, "fails fast: {e}");
                sick_failed += 1;
            }
        }
    }
    println!("one of two shards sick: {ok} of 200 calls succeeded ({sick_failed} failed)");
    // Ejected after `exceptions_allowed_before_breaking` (3) sick answers in a row.
    let ejection = next_event(&mut events, EventKind::Ejection, &cluster.addr("a")).await;
    assert!(
        ejection
            .cause
            .as_deref()
            .unwrap_or("")
            .contains("3 in a row"),
        "{ejection:?}"
    );
    assert!(sick_failed >= 3, "{sick_failed}");
    assert!(
        matches!(
            client.breaker_state(&ShardClient::methods()[0]),
            BreakerState::Closed { .. }
        ),
        "the entry breaker stays closed"
    );
    let a = status_of(&client, &cluster.addr("a"));
    assert!(a.consecutive_failures >= 3, "{a:?}");
    let server_error = StatusCode::ServerError.to_string();
    assert!(
        a.last_failure
            .as_deref()
            .unwrap_or("")
            .starts_with(&server_error),
        "{a:?}"
    );
    cluster.abort_all();
}

/// Item 2, round robin: one of three servers frozen (its handler never answers). It is
/// ejected after a few timeouts, and idempotent calls with a per-attempt timeout (from the
/// method's `#[governance]` attribute) succeed elsewhere within their budget: none of 600 fails.
/// On the paused clock: the timeouts, not the machine's speed, decide what reaches it.
#[tokio::test(start_paused = true)]
async fn a_frozen_server_is_ejected_and_idempotent_calls_retry_elsewhere() {
    let cluster = Cluster::start(&["a", "b", "c"]).await;
    let client = Client::builder()
        .registry(cluster.registry())
        .override_options(
            ShardClient::SERVICE_ID,
            GovernanceOverrides {
                timeout_ms: Some(4000),
                retry_times: Some(2),
                retry_interval_ms: Some(0),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let mut events = client.events().subscribe();
    let shard = ShardClient::new(client.clone());
    // Warm: every server answers.
    for _ in 0..3 {
        shard.read().await.expect("all healthy");
    }
    cluster.set("b", FROZEN);
    let frozen = cluster.addr("b");
    let failed = Arc::new(AtomicU32::new(0));
    let mut workers = Vec::new();
    for _ in 0..6 {
        let (shard, failed) = (shard.clone(), failed.clone());
        workers.push(tokio::spawn(async move {
            for _ in 0..100 {
                match shard.read().await {
                    Ok(name) => assert_ne!(name, "b"),
                    Err(e) => {
                        eprintln!("{e}");
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }));
    }
    for w in workers {
        within("600 calls", w).await.expect("worker");
    }
    let failed = failed.load(Ordering::SeqCst);
    let reached = cluster.nodes["b"].calls.load(Ordering::SeqCst) - 1;
    println!(
        "one of three servers frozen: {failed} of 600 calls failed; {reached} attempts reached \
         the frozen server"
    );
    assert_eq!(failed, 0);
    let ejection = next_event(&mut events, EventKind::Ejection, &frozen).await;
    assert!(
        ejection
            .cause
            .as_deref()
            .unwrap_or("")
            .contains("attempt_timeout_ms"),
        "{ejection:?}"
    );
    // Its third of the traffic would be 200 calls. On the paused clock the others answer at
    // once, so the run ends within the ejection's hold: at most each worker's first attempt
    // reached it, made before the first timeout was known.
    assert!(reached <= 6, "{reached} attempts went to the frozen server");
    let b = status_of(&client, &frozen);
    assert!(b.consecutive_failures >= 3, "{b:?}");
    assert!(matches!(b.state, EndpointState::Unhealthy { .. }), "{b:?}");
    cluster.abort_all();
}

/// Item 3: a server crashes with three calls in flight on one connection: that is one failure
/// of the endpoint, not three (which would remove it at the default threshold of 3).
/// `endpoints()` shows it; after the server restarts on the same address, `readmit` takes it
/// back at once and it gets traffic again.
#[tokio::test]
async fn a_crash_with_calls_in_flight_counts_once_and_readmit_brings_it_back() {
    let mut cluster = Cluster::start(&["a", "b"]).await;
    let client = Client::builder().registry(cluster.registry()).build();
    let mut events = client.events().subscribe();
    let shard = ShardClient::new(client.clone());
    let mut held = tokio::task::JoinSet::new();
    let mut on_a = 0;
    while on_a < 3 {
        assert!(held.len() < 20, "round robin never reached a three times");
        let s = shard.clone();
        held.spawn(async move { s.hold().await });
        if recv_one("a held call arrived", &mut cluster.entered).await == "a" {
            on_a += 1;
        }
    }
    let a = cluster.addr("a");
    cluster.crash("a");
    // The calls held on b never end; the three on a end first, broken together.
    let mut broke = 0;
    while broke < 3 {
        let e = within("a call on the crashed server ends", held.join_next())
            .await
            .expect("calls left")
            .expect("join")
            .expect_err("its server crashed");
        assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
        assert!(e.is_maybe_delivered(), "{e}");
        broke += 1;
    }
    held.abort_all();
    assert_eq!(broke, 3, "the three calls on a failed");
    let status = status_of(&client, &a);
    assert_eq!(status.consecutive_failures, 1, "{status:?}");
    assert!(
        matches!(status.state, EndpointState::Unhealthy { .. }),
        "{status:?}"
    );
    assert!(
        status.last_failure.as_deref().unwrap_or("").contains(&a),
        "{status:?}"
    );
    assert_eq!(status.services, [ShardClient::SERVICE_ID]);
    let ejections: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == EventKind::Ejection)
        .collect();
    assert_eq!(ejections.len(), 1, "{ejections:?}");

    cluster.restart("a").await;
    assert!(client.readmit(&a), "it had a mark");
    assert_eq!(status_of(&client, &a).state, EndpointState::Healthy);
    let readmitted = next_event(&mut events, EventKind::Readmission, &a).await;
    assert_eq!(&*readmitted.entry, ShardClient::SERVICE_ID);
    let mut names = Vec::new();
    for _ in 0..4 {
        names.push(within("read", shard.read()).await.expect("read"));
    }
    assert!(names.iter().any(|n| n == "a"), "{names:?}");
    cluster.abort_all();
}

/// Calls that need a connection to an endpoint at once share one connect attempt; when it
/// fails they fail together, and that one failure counts once against the endpoint, as the
/// calls a broken connection fails do. Before, each counted: three calls at once removed an
/// endpoint whose first connect failed (three failures in a row, the default for removal).
#[tokio::test]
async fn calls_failed_by_one_connect_attempt_count_once() {
    let mut cluster = Cluster::start(&["a"]).await;
    let client = Client::builder().registry(cluster.registry()).build();
    let mut events = client.events().subscribe();
    let shard = ShardClient::new(client.clone());
    let a = cluster.addr("a");
    // Listed still, and nothing listens there: its connects are refused.
    cluster.crash("a");
    let (x, y, z) = within("three calls at once", async {
        tokio::join!(
            shard.stock("x".into()),
            shard.stock("y".into()),
            shard.stock("z".into())
        )
    })
    .await;
    for e in [x, y, z] {
        let e = e.expect_err("nothing listens");
        assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
        assert!(!e.is_maybe_delivered(), "{e}");
    }
    let status = status_of(&client, &a);
    assert_eq!(status.consecutive_failures, 1, "{status:?}");
    assert!(
        matches!(status.state, EndpointState::Unhealthy { .. }),
        "{status:?}"
    );
    let ejections: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == EventKind::Ejection)
        .collect();
    assert_eq!(ejections.len(), 1, "{ejections:?}");
    cluster.abort_all();
}

/// Item 3: a removed endpoint on a static list (no registry will announce it again) is probed
/// in the background with a connect and handshake; once the server restarts on the same
/// address a probe succeeds, the endpoint is re-admitted and gets traffic again.
#[tokio::test]
async fn a_removed_endpoint_is_probed_and_gets_traffic_after_a_restart() {
    let mut cluster = Cluster::start(&["a", "b"]).await;
    let client = Client::builder()
        .registry(cluster.registry())
        .default_options(GovernanceOptions {
            unhealthy_times_allowed_before_removing: 1,
            ..Default::default()
        })
        .build();
    let mut events = client.events().subscribe();
    let shard = ShardClient::new(client.clone());
    let a = cluster.addr("a");
    for _ in 0..2 {
        shard.read().await.expect("both up");
    }
    cluster.crash("a");
    // Calls keep succeeding on b; the first to pick a finds it gone.
    for _ in 0..4 {
        assert_eq!(within("read", shard.read()).await.expect("b serves"), "b");
    }
    let removal = next_event(&mut events, EventKind::Ejection, &a).await;
    assert!(
        removal.cause.as_deref().unwrap_or("").contains("removed"),
        "{removal:?}"
    );
    assert_eq!(status_of(&client, &a).state, EndpointState::Removed);
    let before = cluster.nodes["a"].calls.load(Ordering::SeqCst);
    for _ in 0..6 {
        assert_eq!(shard.read().await.expect("b serves"), "b");
    }

    cluster.restart("a").await;
    let readmitted = next_event(&mut events, EventKind::Readmission, &a).await;
    assert!(
        readmitted
            .cause
            .as_deref()
            .unwrap_or("")
            .contains("background probe"),
        "{readmitted:?}"
    );
    assert_eq!(status_of(&client, &a).state, EndpointState::Healthy);
    let mut names = Vec::new();
    for _ in 0..4 {
        names.push(within("read", shard.read()).await.expect("read"));
    }
    assert!(names.iter().any(|n| n == "a"), "{names:?}");
    assert!(cluster.nodes["a"].calls.load(Ordering::SeqCst) > before);
    cluster.abort_all();
}

/// A removed endpoint that then leaves the registry is forgotten: its mark goes and its
/// background probe ends, so the client never connects to whatever takes its address later
/// (before, the probe ran every 30 s for the client's life).
#[tokio::test(start_paused = true)]
async fn a_removed_endpoint_that_leaves_the_registry_is_no_longer_probed() {
    use rpc::{InProcessRegistry, Instance, Registry};
    let registry = InProcessRegistry::new();
    let (tx, _entered) = mpsc::unbounded_channel();
    let b = Server::builder()
        .registry(registry.clone())
        .add_service(ShardServer::new(Node {
            name: "b".into(),
            mode: AtomicU8::new(HEALTHY),
            calls: AtomicU32::new(0),
            entered: tx,
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve b");
    // `a` is announced, but nothing listens at its address: connects are refused.
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let a = gone.local_addr().expect("addr");
    drop(gone);
    let instance = Instance::new(a.to_string(), [ShardClient::SERVICE_ID]);
    let a_id = instance.id.clone();
    registry.register(instance).await.expect("register a");
    let client = Client::builder()
        .registry(registry.clone())
        .default_options(GovernanceOptions {
            unhealthy_times_allowed_before_removing: 1,
            ..Default::default()
        })
        .build();
    let shard = ShardClient::new(client.clone());
    let a = a.to_string();
    for _ in 0..4 {
        assert_eq!(within("read", shard.read()).await.expect("b serves"), "b");
    }
    assert_eq!(status_of(&client, &a).state, EndpointState::Removed);
    registry.deregister(&a_id).await.expect("deregister a");
    // Let the client see the snapshot without `a`.
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Something else takes the address: a probe still running would connect within 30 s.
    let squatter = tokio::net::TcpListener::bind(&a).await.expect("rebind a");
    let probed = tokio::time::timeout(Duration::from_secs(120), squatter.accept()).await;
    assert!(
        probed.is_err(),
        "the departed endpoint was still probed: {probed:?}"
    );
    assert!(!client.readmit(&a), "its mark stayed");
    b.abort();
}
