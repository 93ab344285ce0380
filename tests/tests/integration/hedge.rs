//! Hedging over TCP: an idempotent call whose first endpoint does not answer gets a second
//! attempt on the other endpoint after `hedge_delay_ms` (or, under `hedge_percentile`, the
//! entry's recent latency at that percentile); that answer wins, and the first server is told
//! to stop (Cancel frame): its handler's future is dropped while the client is still
//! connected.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::{recv_one, within, DropSignal};
use rpc::{
    Client, EventKind, GovernanceOverrides, InProcessRegistry, RoutingRules, RpcContext, RpcError,
    Server, StaticRegistry,
};
use tokio::sync::mpsc;

#[rpc::service(name = "t.Hedge")]
trait Hedged {
    /// Answers the server's name, or (the stuck server) never answers.
    async fn who(&self) -> Result<String, RpcError>;
}

struct Node {
    name: &'static str,
    stuck: bool,
    calls: Arc<AtomicU64>,
    dropped: mpsc::UnboundedSender<String>,
    /// The `call` attachment of each call the node saw, when the calls carry one.
    seen: Arc<Mutex<Vec<String>>>,
}

impl Hedged for Node {
    async fn who(&self) -> Result<String, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(call) = RpcContext::get("call") {
            self.seen.lock().unwrap().push(call);
        }
        if self.stuck {
            let _signal = DropSignal::new(self.name, self.dropped.clone());
            std::future::pending::<()>().await;
        }
        Ok(self.name.to_string())
    }
}

/// Two servers of the service, `stuck` (its handlers never answer; each one dropped says so
/// on `dropped`) then `quick`, and the calls each has seen.
async fn stuck_and_quick(
    dropped: &mpsc::UnboundedSender<String>,
) -> (Vec<rpc::ServerHandle>, Vec<Arc<AtomicU64>>) {
    let mut servers = Vec::new();
    let mut calls = Vec::new();
    for (name, stuck) in [("stuck", true), ("quick", false)] {
        let n = Arc::new(AtomicU64::new(0));
        calls.push(n.clone());
        servers.push(
            Server::builder()
                .add_service(HedgedServer::new(Node {
                    name,
                    stuck,
                    calls: n,
                    dropped: dropped.clone(),
                    seen: Arc::default(),
                }))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    (servers, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_answers_for_a_stuck_server_and_the_stuck_server_is_cancelled() {
    // A span subscriber on this thread, as the trace tests of this binary have: `tracing`
    // caches each callsite's interest process-wide, and these calls, made without one, left
    // `cancelled`'s attempt and server spans unrecorded when the two ran at once.
    let (_traces, _traced) = common::otel::Traces::install();
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel();
    let (servers, calls) = stuck_and_quick(&dropped_tx).await;
    let client = HedgedClient::new(
        Client::builder()
            .registry(StaticRegistry::new(
                servers.iter().map(|s| s.local_addr().to_string()),
            ))
            .override_options(
                HedgedClient::SERVICE_ID,
                GovernanceOverrides {
                    hedge_delay_ms: Some(50),
                    idempotent: Some(true),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    // Every call answers from the quick server: directly, or by the hedge of a first attempt
    // on the stuck one (which never answers).
    for _ in 0..4 {
        let who = within("a hedged call", client.who())
            .await
            .expect("answered");
        assert_eq!(who, "quick");
    }
    let stuck = calls[0].load(Ordering::SeqCst);
    assert!(
        stuck >= 1,
        "the balancer started some call on the stuck server"
    );
    assert_eq!(
        calls[1].load(Ordering::SeqCst),
        4,
        "each call answered once by the quick one"
    );
    // Each losing attempt was cancelled: the stuck server dropped its handler, with the
    // client still alive and connected.
    for _ in 0..stuck {
        assert_eq!(
            recv_one("a stuck handler dropped", &mut dropped).await,
            "stuck"
        );
    }
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_hedge_percentile_calls_are_hedged_once_the_entry_has_a_latency_record() {
    // A span subscriber on this thread, as the trace tests of this binary have: `tracing`
    // caches each callsite's interest process-wide, and these calls, made without one, left
    // `cancelled`'s attempt and server spans unrecorded when the two ran at once.
    let (_traces, _traced) = common::otel::Traces::install();
    // hedge_percentile = 50 and no floor: no hedge until the entry's window holds 20 calls;
    // after that, a call whose first attempt lands on the stuck server is hedged after the
    // entry's median latency (well under a millisecond here) and answered by the quick one.
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel();
    let reg = InProcessRegistry::new();
    let calls: Vec<Arc<AtomicU64>> = (0..2).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let node = |name, stuck, calls: &Arc<AtomicU64>| {
        HedgedServer::new(Node {
            name,
            stuck,
            calls: calls.clone(),
            dropped: dropped_tx.clone(),
            seen: Arc::default(),
        })
    };
    let quick = Server::builder()
        .registry(reg.clone())
        .add_service(node("quick", false, &calls[1]))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(reg.clone())
        .override_options(
            HedgedClient::SERVICE_ID,
            GovernanceOverrides {
                hedge_percentile: Some(50),
                idempotent: Some(true),
                // Far beyond the test's limit: a call left waiting on the stuck server fails
                // the test (`within`) rather than time out.
                timeout_ms: Some(60_000),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let mut events = client.events().subscribe();
    let proxy = HedgedClient::new(client.clone());
    // The quick server alone teaches the entry its latency.
    for _ in 0..25 {
        assert_eq!(
            within("a call", proxy.who()).await.expect("answered"),
            "quick"
        );
    }
    // Now the stuck server joins; round robin sends every other first attempt there.
    let stuck = Server::builder()
        .registry(reg.clone())
        .add_service(node("stuck", true, &calls[0]))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let stuck_addr = stuck.local_addr().to_string();
    within("the client sees the stuck server", async {
        while !client.endpoints().iter().any(|e| e.address == stuck_addr) {
            let _ = proxy.who().await;
            tokio::task::yield_now().await;
        }
    })
    .await;
    calls[1].store(0, Ordering::SeqCst);
    let before = calls[0].load(Ordering::SeqCst);
    for _ in 0..4 {
        let who = within("a call hedged by percentile", proxy.who())
            .await
            .expect("answered");
        assert_eq!(who, "quick");
    }
    let stuck_calls = calls[0].load(Ordering::SeqCst) - before;
    assert!(
        stuck_calls >= 1,
        "no first attempt went to the stuck server"
    );
    assert_eq!(calls[1].load(Ordering::SeqCst), 4);
    // Each hedge says it followed the percentile, and each stuck attempt was cancelled.
    let mut hedges = 0;
    while let Ok(e) = events.try_recv() {
        if e.kind == EventKind::Hedge {
            let cause = e.cause.unwrap_or_default();
            assert!(cause.contains("p50 latency"), "{cause}");
            hedges += 1;
        }
    }
    assert!(
        hedges >= stuck_calls,
        "{hedges} hedges for {stuck_calls} stuck attempts"
    );
    for _ in 0..calls[0].load(Ordering::SeqCst) {
        assert_eq!(
            recv_one("a stuck handler dropped", &mut dropped).await,
            "stuck"
        );
    }
    drop(client);
    within("shutdown", quick.shutdown()).await;
    within("shutdown", stuck.shutdown()).await;
}

/// Under `hedge_percentile` nothing is hedged before the entry's window holds its first 20
/// calls: with a stuck server from the start, a call whose first attempt lands there waits
/// for its own timeout (on the paused clock), with no `hedge` event.
#[tokio::test(start_paused = true)]
async fn under_hedge_percentile_no_call_is_hedged_before_the_entry_has_a_latency_record() {
    let (dropped_tx, _dropped) = mpsc::unbounded_channel();
    let (servers, calls) = stuck_and_quick(&dropped_tx).await;
    let client = Client::builder()
        .registry(StaticRegistry::new(
            servers.iter().map(|s| s.local_addr().to_string()),
        ))
        .override_options(
            HedgedClient::SERVICE_ID,
            GovernanceOverrides {
                hedge_percentile: Some(50),
                idempotent: Some(true),
                retry_times: Some(0),
                timeout_ms: Some(1_000),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let mut events = client.events().subscribe();
    let proxy = HedgedClient::new(client.clone());
    // Fewer calls than the window's first 20; round robin sends every other one to `stuck`.
    let mut timed_out = 0;
    for _ in 0..6 {
        match within("a call", proxy.who()).await {
            Ok(who) => assert_eq!(who, "quick"),
            Err(e) => {
                assert_eq!(e.code(), rpc::StatusCode::Timeout, "{e}");
                timed_out += 1;
            }
        }
    }
    assert_eq!(
        timed_out,
        calls[0].load(Ordering::SeqCst),
        "the stuck calls time out"
    );
    assert!(timed_out >= 1, "no call went to the stuck server");
    while let Ok(e) = events.try_recv() {
        assert_ne!(
            e.kind,
            EventKind::Hedge,
            "hedged before a latency record: {e:?}"
        );
    }
    drop(client);
    for server in servers {
        within("shutdown", server.shutdown()).await;
    }
}

/// Under a weighted routing rule, a hedge goes to the group its call's first attempt drew:
/// one call is served by one group. Each group has a stuck and a quick instance; a call whose
/// first attempt is stuck is answered by its own group's quick instance. Before, the hedge
/// drew a group of its own: half the hedges went to the other group, where its stuck
/// instance held some calls past the test's limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_goes_to_the_routing_group_its_call_drew() {
    let (_traces, _traced) = common::otel::Traces::install();
    let (dropped_tx, _dropped) = mpsc::unbounded_channel();
    let registry = InProcessRegistry::new();
    let mut servers = Vec::new();
    let mut seen = Vec::new();
    for (name, group, stuck) in [
        ("stuck-a", "a", true),
        ("quick-a", "a", false),
        ("stuck-b", "b", true),
        ("quick-b", "b", false),
    ] {
        let saw = Arc::new(Mutex::new(Vec::new()));
        seen.push((group, saw.clone()));
        servers.push(
            Server::builder()
                .registry(registry.clone())
                .metadata("group", group)
                .add_service(HedgedServer::new(Node {
                    name,
                    stuck,
                    calls: Arc::default(),
                    dropped: dropped_tx.clone(),
                    seen: saw,
                }))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    let rules = RoutingRules::from_toml(
        "[[routes]]\nname = \"halves\"\nservice = \"t.Hedge\"\n\
         to = [ { tags = { group = \"a\" } }, { tags = { group = \"b\" } } ]\n",
    )
    .expect("valid rules");
    let client = HedgedClient::new(
        Client::builder()
            .registry(registry.clone())
            .routing_rules(rules)
            .expect("valid rules")
            .override_options(
                HedgedClient::SERVICE_ID,
                GovernanceOverrides {
                    hedge_delay_ms: Some(20),
                    idempotent: Some(true),
                    timeout_ms: Some(60_000),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    for i in 0..16 {
        let call = RpcContext::with_attachment("call", i.to_string(), client.who());
        let who = within("a hedged call", call).await.expect("answered");
        let group = who
            .strip_prefix("quick-")
            .expect("answered by a quick instance");
        // Every instance that saw the call is of the group that answered it.
        for (of, saw) in &seen {
            if saw.lock().unwrap().contains(&i.to_string()) {
                assert_eq!(
                    *of, group,
                    "call {i} reached group {of} and was answered by {who}"
                );
            }
        }
    }
    let stuck: usize = [&seen[0].1, &seen[2].1]
        .iter()
        .map(|s| s.lock().unwrap().len())
        .sum();
    assert!(
        stuck > 0,
        "no call started on a stuck instance: nothing was hedged"
    );
    drop(servers);
}

#[rpc::service(name = "t.Gated")]
trait Gated {
    /// Fails with the server's name once the test releases the call, as the attempt it is.
    async fn refuse(&self) -> Result<(), RpcError>;
}

/// A server whose calls wait for the test: the first call any server gets is the first
/// attempt, the second the hedge; each is released by its own gate.
struct GatedNode {
    name: &'static str,
    arrivals: Arc<AtomicU64>,
    arrived: mpsc::UnboundedSender<&'static str>,
    gates: Arc<[tokio::sync::Notify; 2]>,
    /// The status it fails with.
    code: rpc::StatusCode,
}

impl Gated for GatedNode {
    async fn refuse(&self) -> Result<(), RpcError> {
        let nth = self.arrivals.fetch_add(1, Ordering::SeqCst) as usize;
        let _ = self.arrived.send(self.name);
        self.gates[nth.min(1)].notified().await;
        Err(RpcError::new(
            self.code,
            format!("refused by {}", self.name),
        ))
    }
}

/// An attempt layer that releases the hedge's server once the client has the first answer
/// of the call: the hedge's answer then comes last, whatever the scheduling.
fn release_after_first_answer(gates: Arc<[tokio::sync::Notify; 2]>) -> impl rpc::Middleware {
    let seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    rpc::middleware_fn(move |cx, req, next| {
        let (gates, seen) = (gates.clone(), seen.clone());
        Box::pin(async move {
            let answer = next.run(cx, req).await;
            if !seen.swap(true, Ordering::SeqCst) {
                gates[1].notify_one();
            }
            answer
        })
    })
}

/// Two gated servers failing with `code`, and a client hedging after 10 ms with no retries
/// (`more` adds to its builder, given the gates): the servers' addresses, the client, the
/// names of the servers as calls arrive, and the gates (0: the first attempt, 1: the hedge).
async fn gated_pair(
    code: rpc::StatusCode,
    timeout_ms: Option<u64>,
    more: impl FnOnce(rpc::ClientBuilder, &Arc<[tokio::sync::Notify; 2]>) -> rpc::ClientBuilder,
) -> (
    Vec<rpc::ServerHandle>,
    GatedClient,
    mpsc::UnboundedReceiver<&'static str>,
    Arc<[tokio::sync::Notify; 2]>,
) {
    let (arrived_tx, arrived) = mpsc::unbounded_channel();
    let arrivals = Arc::new(AtomicU64::new(0));
    let gates: Arc<[tokio::sync::Notify; 2]> = Arc::default();
    let mut servers = Vec::new();
    for name in ["one", "two"] {
        servers.push(
            Server::builder()
                .add_service(GatedServer::new(GatedNode {
                    name,
                    arrivals: arrivals.clone(),
                    arrived: arrived_tx.clone(),
                    gates: gates.clone(),
                    code,
                }))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    let builder = Client::builder()
        .registry(StaticRegistry::new(
            servers.iter().map(|s| s.local_addr().to_string()),
        ))
        .override_options(
            GatedClient::SERVICE_ID,
            GovernanceOverrides {
                hedge_delay_ms: Some(10),
                idempotent: Some(true),
                retry_times: Some(0),
                timeout_ms,
                ..GovernanceOverrides::NONE
            },
        );
    let client = GatedClient::new(more(builder, &gates).build());
    (servers, client, arrived, gates)
}

/// A hedged call whose first attempt fails (a server error, which waits for the hedge) after
/// the hedge was sent, and whose hedge then fails too, returns the first attempt's error:
/// `answered_by` names the endpoint that gave that error, not the hedge's, whose answer came
/// last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_by_names_the_attempt_whose_answer_a_hedged_call_returns() {
    // Not a callee's answer: the call waits for the hedge, whose answer comes last.
    let (servers, client, mut arrived, gates) =
        gated_pair(rpc::StatusCode::ServerError, None, |b, gates| {
            b.attempt_layer(release_after_first_answer(gates.clone()))
        })
        .await;
    let address_of = |name: &str| {
        let i = if name == "one" { 0 } else { 1 };
        servers[i].local_addr().to_string()
    };
    let call = tokio::spawn(async move { rpc::answered_by(client.refuse()).await });
    let first = recv_one("the first attempt", &mut arrived).await;
    let hedge = recv_one("the hedge", &mut arrived).await;
    assert_ne!(first, hedge, "the hedge goes to the other endpoint");
    // The first attempt fails; once its answer is in, the hedge (see the attempt layer).
    gates[0].notify_one();
    let (result, by) = within("the call", call).await.expect("the call's task");
    let e = result.expect_err("both attempts fail");
    assert_eq!(e.code(), rpc::StatusCode::ServerError, "{e}");
    assert_eq!(e.message(), format!("refused by {first}"), "{e}");
    assert_eq!(by, Some(address_of(first)));
}

/// The first answer wins, an error the callee answers included: a hedge refused with a
/// business error while the first attempt hangs returns that error at once, rather than
/// waiting for the first attempt until the deadline and failing with a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callee_error_from_the_hedge_is_the_answer_while_the_first_attempt_hangs() {
    let (_servers, client, mut arrived, gates) =
        gated_pair(rpc::StatusCode::BusinessError, Some(600_000), |b, _| b).await;
    let call = tokio::spawn(async move { client.refuse().await });
    let _first = recv_one("the first attempt", &mut arrived).await;
    let hedge = recv_one("the hedge", &mut arrived).await;
    // Only the hedge answers; the first attempt hangs.
    gates[1].notify_one();
    let e = within("the call", call)
        .await
        .expect("the call's task")
        .expect_err("the hedge's error");
    assert_eq!(e.code(), rpc::StatusCode::BusinessError, "{e}");
    assert_eq!(e.message(), format!("refused by {hedge}"));
}
