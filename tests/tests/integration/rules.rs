//! Rules from etcd: the rule store (validation before writing, versions, history, rollback,
//! two writers at once) and clients and servers that follow it, against a real etcd started on
//! free loopback ports (`common/etcd.rs`).

use crate::common;
use crate::etcd_harness;

use std::time::Duration;

use common::within;
use etcd_harness::Etcd;
use rpc::{EtcdOptions, EtcdRegistry, RuleError, RuleKind, RuleStore};

async fn store(etcd: &Etcd) -> RuleStore {
    let options = EtcdOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..EtcdOptions::default()
    };
    EtcdRegistry::connect(&[etcd.endpoint()], options)
        .await
        .expect("etcd registry")
        .rules()
}

/// The governance versions the history keeps, oldest first.
async fn kept_versions(rules: &RuleStore) -> Vec<i64> {
    let history = rules.history(RuleKind::Governance).await.expect("history");
    history.iter().map(|v| v.version).collect()
}

const V1: &str = "[defaults]\ntimeout_ms = 1000\n";
const V2: &str = "[defaults]\ntimeout_ms = 2000\n";

#[tokio::test]
async fn writes_are_validated_versioned_kept_in_history_and_rolled_back() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await;
    assert_eq!(rules.key(RuleKind::Governance), "/rpc/rules/governance");
    // Invalid: refused naming the line and the field, and nothing is written.
    let e = rules
        .set(
            RuleKind::Governance,
            "[defaults]\ntimeout_ms = 1\nretry_tims = 2\n",
            0,
        )
        .await
        .unwrap_err();
    assert!(matches!(e, RuleError::Invalid { .. }), "{e}");
    assert!(
        e.to_string().contains("line 3") && e.to_string().contains("retry_tims"),
        "{e}"
    );
    let mut raw = etcd.client().await;
    let all = raw
        .get(
            "/rpc/rules/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert!(all.kvs().is_empty(), "nothing written");
    assert_eq!(rules.get(RuleKind::Governance).await.unwrap(), None);

    let v1 = rules.set(RuleKind::Governance, V1, 0).await.unwrap();
    let v2 = rules.set(RuleKind::Governance, V2, v1).await.unwrap();
    assert!(v2 > v1, "{v1} then {v2}");
    let now = rules.get(RuleKind::Governance).await.unwrap().unwrap();
    assert_eq!((now.version, &*now.text), (v2, V2));
    // The version is the etcd revision of the key.
    let kv = raw.get("/rpc/rules/governance", None).await.unwrap();
    assert_eq!(kv.kvs()[0].mod_revision(), v2);

    let history = rules.history(RuleKind::Governance).await.unwrap();
    let seen: Vec<(i64, &str)> = history.iter().map(|v| (v.version, &*v.text)).collect();
    assert_eq!(seen, vec![(v1, V1), (v2, V2)]);

    // Rollback writes v1's text again, as a new version.
    let v3 = rules.rollback(RuleKind::Governance, v1).await.unwrap();
    assert!(v3 > v2);
    let now = rules.get(RuleKind::Governance).await.unwrap().unwrap();
    assert_eq!((now.version, &*now.text), (v3, V1));
    assert_eq!(rules.history(RuleKind::Governance).await.unwrap().len(), 3);
    let e = rules.rollback(RuleKind::Governance, 1).await.unwrap_err();
    assert!(matches!(e, RuleError::UnknownVersion { .. }), "{e}");
    // The kinds are apart.
    assert_eq!(rules.get(RuleKind::Routing).await.unwrap(), None);
}

#[tokio::test]
async fn of_two_writers_on_the_same_version_one_wins_and_the_other_is_told() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await;
    let v1 = rules.set(RuleKind::Governance, V1, 0).await.unwrap();
    let (a, b) = tokio::join!(
        rules.set(RuleKind::Governance, V2, v1),
        rules.set(RuleKind::Governance, "[defaults]\nretry_times = 0\n", v1),
    );
    let (won, lost) = match (a, b) {
        (Ok(v), Err(e)) | (Err(e), Ok(v)) => (v, e),
        other => panic!("exactly one write must win: {other:?}"),
    };
    match lost {
        RuleError::Conflict {
            expected, found, ..
        } => assert_eq!((expected, found), (v1, won)),
        e => panic!("{e}"),
    }
    assert_eq!(rules.history(RuleKind::Governance).await.unwrap().len(), 2);
}

#[tokio::test]
async fn the_history_keeps_the_last_versions_only() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await.with_history_limit(3);
    let mut versions = Vec::new();
    for i in 0..5 {
        let text = format!("[defaults]\ntimeout_ms = {}\n", 100 + i);
        versions.push(
            within("put", rules.put(RuleKind::Governance, &text))
                .await
                .unwrap(),
        );
    }
    assert_eq!(kept_versions(&rules).await, versions[2..].to_vec());
}

#[tokio::test]
async fn a_document_written_again_after_it_was_deleted_is_kept_as_the_newest() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await;
    let v1 = rules.set(RuleKind::Governance, V1, 0).await.unwrap();
    // An operator deletes the document by hand; the next write replaces no version again.
    let mut raw = etcd.client().await;
    raw.delete(rules.key(RuleKind::Governance), None)
        .await
        .unwrap();
    let v2 = rules.set(RuleKind::Governance, V2, 0).await.unwrap();
    let seen: Vec<(i64, String)> = rules
        .history(RuleKind::Governance)
        .await
        .unwrap()
        .iter()
        .map(|v| (v.version, v.text.to_string()))
        .collect();
    assert_eq!(seen, vec![(v1, V1.to_string()), (v2, V2.to_string())]);
    // The newest is the one a history of one keeps.
    let one = rules.clone().with_history_limit(1);
    let v3 = one.set(RuleKind::Governance, V1, v2).await.unwrap();
    assert_eq!(kept_versions(&one).await, vec![v3]);
}

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rpc::crates::governance::breaker::BreakerState;
use rpc::crates::governance::events::{EventKind, GovernanceEvent};
use rpc::{Client, GovernanceOptions, InProcessRegistry, RpcError, Server, StatusCode};
use tokio::sync::{broadcast, mpsc, Semaphore};

#[rpc::service(name = "t.Ruled")]
trait Ruled {
    /// Reports entry, then waits for a permit the test hands out.
    async fn hold(&self) -> Result<String, RpcError>;
    /// Fails with a server error, a failure the breaker counts.
    async fn fail(&self) -> Result<String, RpcError>;
}

struct Handler {
    entered: mpsc::UnboundedSender<String>,
    release: Semaphore,
    failed: AtomicUsize,
}

impl Handler {
    /// A handler whose entries nobody waits for (and whose `hold` calls nobody releases).
    fn idle() -> Arc<Handler> {
        let (entered, _) = mpsc::unbounded_channel();
        Arc::new(Handler {
            entered,
            release: Semaphore::new(0),
            failed: AtomicUsize::new(0),
        })
    }
}

impl Ruled for Arc<Handler> {
    async fn hold(&self) -> Result<String, RpcError> {
        let _ = self.entered.send("hold".into());
        common::let_through(&self.release).await?;
        Ok("held".into())
    }
    async fn fail(&self) -> Result<String, RpcError> {
        self.failed.fetch_add(1, Ordering::SeqCst);
        Err(RpcError::new(StatusCode::ServerError, "down"))
    }
}

/// Waits for the event of `kind` about the rule `version`, skipping the others.
async fn rule_event(
    events: &mut broadcast::Receiver<GovernanceEvent>,
    kind: EventKind,
    version: i64,
) -> GovernanceEvent {
    within("the rule's event", async {
        loop {
            let e = events.recv().await.expect("events");
            if e.kind == kind && e.rule_version == Some(version) {
                return e;
            }
        }
    })
    .await
}

struct Fleet {
    _etcd: Etcd,
    rules: RuleStore,
    handler: Arc<Handler>,
    entered: mpsc::UnboundedReceiver<String>,
    server: rpc::ServerHandle,
    reg: InProcessRegistry,
    client: Client,
    ruled: RuledClient,
    /// The version of the governance document stored before the server started.
    stored: Option<i64>,
}

async fn fleet() -> Fleet {
    fleet_after(None).await
}

/// A fleet whose etcd holds the governance document `stored` before the server starts.
async fn fleet_after(stored: Option<&str>) -> Fleet {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await;
    let mut stored_version = None;
    if let Some(text) = stored {
        stored_version = Some(rules.put(RuleKind::Governance, text).await.expect("put"));
    }
    let (tx, entered) = mpsc::unbounded_channel();
    let handler = Arc::new(Handler {
        entered: tx,
        release: Semaphore::new(0),
        failed: AtomicUsize::new(0),
    });
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .rules(rules.clone())
        .add_service(RuledServer::new(handler.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(reg.clone())
        .default_options(GovernanceOptions {
            retry_times: 0,
            timeout_ms: 0,
            breaker_seconds: 3600,
            ..GovernanceOptions::default()
        })
        .rules(rules.clone())
        .build();
    let ruled = RuledClient::new(client.clone());
    Fleet {
        _etcd: etcd,
        rules,
        handler,
        entered,
        server,
        reg,
        client,
        ruled,
        stored: stored_version,
    }
}

#[tokio::test]
async fn a_rule_in_etcd_switches_the_breaker_to_observe_and_back_and_a_bad_one_is_refused() {
    let f = fleet().await;
    let mut events = f.client.events().subscribe();
    let fail = &RuledClient::methods()[1];
    let observe = "[entries.\"t.Ruled.fail\"]\nexceptions_allowed_before_breaking = 2\nbreaker_observe = true\n";
    let v1 = f.rules.put(RuleKind::Governance, observe).await.unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v1).await;
    assert_eq!(f.client.rules_version(RuleKind::Governance), Some(v1));
    assert!(f.client.options(fail).breaker_observe);

    // Observing: the breaker opens after 2 failures, and all 4 calls still reach the server.
    for _ in 0..4 {
        let e = within("call", f.ruled.fail()).await.unwrap_err();
        assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    }
    assert_eq!(f.handler.failed.load(Ordering::SeqCst), 4);
    assert!(matches!(
        f.client.breaker_state(fail),
        BreakerState::Open { .. }
    ));
    let breaks: Vec<GovernanceEvent> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == EventKind::Break)
        .collect();
    assert!(breaks.len() == 1 && breaks[0].observed, "{breaks:?}");

    // Enforcing again, from the next call, with the breaker's state kept: it is open.
    let enforce = observe.replace("breaker_observe = true", "breaker_observe = false");
    let v2 = f.rules.put(RuleKind::Governance, &enforce).await.unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v2).await;
    let e = within("call", f.ruled.fail()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::CircuitOpen, "{e}");
    assert_eq!(f.handler.failed.load(Ordering::SeqCst), 4, "not sent");

    // Documents written past the store's check are refused, v2 staying in force (the breaker
    // open, not observing): one invalid, and bytes that are not UTF-8, which read as a valid
    // document with U+FFFD in place of the byte.
    let mut raw = f._etcd.client().await;
    let bad: [(&[u8], &str); 2] = [
        (
            b"[entries.\"t.Ruled.fail\"]\nbreaker_observe = \"yes\"\n",
            "breaker_observe",
        ),
        (
            b"# \xff\n[entries.\"t.Ruled.fail\"]\nbreaker_observe = true\n",
            "not UTF-8",
        ),
    ];
    for (document, why) in bad {
        let put = raw
            .put(f.rules.key(RuleKind::Governance), document, None)
            .await
            .unwrap();
        let version = put.header().unwrap().revision();
        let rejected = rule_event(&mut events, EventKind::RuleRejected, version).await;
        let cause = rejected.cause.unwrap_or_default();
        assert!(
            cause.contains(why) && cause.contains(&format!("version {v2} stays")),
            "{cause}"
        );
        assert_eq!(f.client.rules_version(RuleKind::Governance), Some(v2));
        let e = within("call", f.ruled.fail()).await.unwrap_err();
        assert_eq!(e.code(), StatusCode::CircuitOpen, "{e}");
    }

    // Rolling back to v1 observes again.
    let v4 = f.rules.rollback(RuleKind::Governance, v1).await.unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v4).await;
    let e = within("call", f.ruled.fail()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    assert_eq!(f.handler.failed.load(Ordering::SeqCst), 5);
}

/// A governance document asking for consistent hashing on a service whose methods have no
/// `#[hash_key]` is applied alike by a client that called them and by a fresh one: the
/// strategy is left out for those entries (they keep round robin), the rest of the document
/// applies, and calls go on. Before, the client that had called the entry refused the whole
/// document while a fresh one applied it, and its calls failed 500. A rule editor is still
/// told (the client's check refuses the document, naming the centre).
#[tokio::test]
async fn a_strategy_an_entry_cannot_carry_out_is_left_out_alike_by_every_client() {
    let f = fleet().await;
    let fail = &RuledClient::methods()[1];
    let mut events = f.client.events().subscribe();
    let e = within("call", f.ruled.fail()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    let hashing = "[services.\"t.Ruled\"]\nshunt_strategy = \"hash\"\ntimeout_ms = 4321\n";
    let checked = f
        .client
        .check_rules(RuleKind::Governance, hashing)
        .expect_err("an editor is told");
    assert!(
        checked.message().contains("t.Ruled.fail")
            && checked.message().contains("#[hash_key]")
            && checked.message().contains("config centre"),
        "{checked}"
    );
    let v1 = f.rules.put(RuleKind::Governance, hashing).await.unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v1).await;
    let fresh = Client::builder()
        .registry(f.reg.clone())
        .default_options(GovernanceOptions {
            retry_times: 0,
            timeout_ms: 0,
            ..GovernanceOptions::default()
        })
        .rules(f.rules.clone())
        .build();
    let fresh_ruled = RuledClient::new(fresh.clone());
    for (who, client, ruled) in [
        ("called", &f.client, &f.ruled),
        ("fresh", &fresh, &fresh_ruled),
    ] {
        let e = within("call", ruled.fail()).await.unwrap_err();
        assert_eq!(e.code(), StatusCode::ServerError, "{who}: {e}");
        let options = client.options(fail);
        assert_eq!(
            (options.shunt_strategy, options.timeout_ms),
            (rpc::ShuntStrategy::RoundRobin, 4321),
            "{who}"
        );
        assert_eq!(
            client.rules_version(RuleKind::Governance),
            Some(v1),
            "{who}"
        );
    }
    assert_eq!(
        f.handler.failed.load(Ordering::SeqCst),
        3,
        "every call reached the server"
    );
    // The strategy left out is not in force: it refuses no later change of the client's own.
    f.client
        .update_options(
            "t.Ruled.fail",
            rpc::GovernanceOverrides {
                timeout_ms: Some(1234),
                ..rpc::GovernanceOverrides::NONE
            },
        )
        .expect("a runtime update is taken");
    assert_eq!(f.client.options(fail).timeout_ms, 1234);
}

/// A server reads the rules before it serves: its first calls, and any call a client makes
/// once it finds the instance, run under them. Before, the rules landed some time after the
/// instance was published, and the first calls ran under the cap they replace (50).
#[tokio::test]
async fn rules_stored_before_a_server_starts_are_in_force_from_its_first_call() {
    let mut f = fleet_after(Some(
        "[entries.\"t.Ruled.hold\"]\nmax_concurrent_handling_count = 1\n",
    ))
    .await;
    // Nothing awaited since `serve` returned.
    assert_eq!(f.server.rules_version(RuleKind::Governance), f.stored);
    assert!(f.stored.is_some());
    let first = common::until_entered(Box::pin(f.ruled.hold()), "hold", &mut f.entered).await;
    let e = within("call", f.ruled.hold()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
    f.handler.release.add_permits(1);
    assert_eq!(within("first", first).await.unwrap(), "held");
}

/// A rule source holding a governance document from the start, and no routing one.
struct Held {
    governance: tokio::sync::watch::Sender<Option<rpc::crates::registry::rules::RuleVersion>>,
    routing: tokio::sync::watch::Sender<Option<rpc::crates::registry::rules::RuleVersion>>,
}

impl rpc::RuleSource for Held {
    fn watch_rules(
        &self,
        kind: RuleKind,
    ) -> futures_util::future::BoxFuture<
        '_,
        Result<rpc::crates::registry::rules::RuleWatch, rpc::RegistryError>,
    > {
        let rx = match kind {
            RuleKind::Governance => self.governance.subscribe(),
            _ => self.routing.subscribe(),
        };
        Box::pin(async move { Ok(rx) })
    }
}

/// The config centre asks hashing of a service whose methods have no `#[hash_key]`: left out
/// for them, their calls run. A handle whose own options ask hashing has its calls refused,
/// and the error names those options, not the centre's document (which, removed, would change
/// nothing).
#[tokio::test]
async fn hashing_asked_by_a_handle_is_refused_naming_the_handle_not_the_centre() {
    let document = rpc::crates::registry::rules::RuleVersion {
        version: 3,
        text: "[services.\"t.Ruled\"]\nshunt_strategy = \"hash\"\n".into(),
        unreadable: None,
    };
    let source = Held {
        governance: tokio::sync::watch::channel(Some(document)).0,
        routing: tokio::sync::watch::channel(None).0,
    };
    let server = Server::builder()
        .add_service(RuledServer::new(Handler::idle()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(rpc::StaticRegistry::new([server.local_addr().to_string()]))
        .rules(source)
        .build();
    let e = within("call", RuledClient::new(client.clone()).fail())
        .await
        .expect_err("the handler fails");
    assert_eq!(e.code(), StatusCode::ServerError, "the call ran: {e}");
    let hashing = client.with_options(rpc::GovernanceOverrides {
        shunt_strategy: Some(rpc::ShuntStrategy::Hash),
        ..rpc::GovernanceOverrides::NONE
    });
    let e = within("call", RuledClient::new(hashing).fail())
        .await
        .expect_err("refused");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message().contains("this call's options ask for it"),
        "{e}"
    );
    assert!(!e.message().contains("centre"), "{e}");
    server.shutdown().await;
}

/// A rule source that never answers.
struct Silent;

impl rpc::RuleSource for Silent {
    fn watch_rules(
        &self,
        _: RuleKind,
    ) -> futures_util::future::BoxFuture<
        '_,
        Result<rpc::crates::registry::rules::RuleWatch, rpc::RegistryError>,
    > {
        Box::pin(std::future::pending())
    }
}

/// An entry's first call through a handle that appoints it by its per-call options does not
/// wait for the rules, and must not spare the entry's other calls that wait: the first call of
/// the client's own options still waits for the rules' first read (here a source that never
/// answers: 10 s, then it runs without them). Before, the appointed call marked the entry's
/// service known, and the plain call ran at once, under options the rules may replace.
/// (On the paused clock.)
#[tokio::test(start_paused = true)]
async fn a_per_call_appoint_does_not_spare_the_entrys_other_calls_their_first_wait() {
    let server = Server::builder()
        .add_service(RuledServer::new(Handler::idle()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let addr = server.local_addr().to_string();
    let client = Client::builder()
        .registry(rpc::StaticRegistry::new([addr.clone()]))
        .default_options(GovernanceOptions {
            retry_times: 0,
            timeout_ms: 0,
            ..GovernanceOptions::default()
        })
        .rules(Silent)
        .build();
    let appointed = RuledClient::new(client.with_options(rpc::GovernanceOverrides {
        shunt_strategy: Some(rpc::ShuntStrategy::Appoint),
        appoint_address: Some(addr.into()),
        ..rpc::GovernanceOverrides::NONE
    }));
    let start = tokio::time::Instant::now();
    let e = appointed.fail().await.expect_err("the handler fails");
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    assert_eq!(
        start.elapsed(),
        std::time::Duration::ZERO,
        "appointed: no wait"
    );
    let e = RuledClient::new(client.clone())
        .fail()
        .await
        .expect_err("the handler fails");
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    assert_eq!(
        start.elapsed(),
        rpc::crates::registry::rules::FIRST_READ_LIMIT,
        "the plain call waited for the rules' first read"
    );
    server.shutdown().await;
}

/// A rule source that never answers holds a starting server up 10 s, not for ever: it then
/// serves without the rules.
#[tokio::test(start_paused = true)]
async fn a_server_whose_rule_source_never_answers_serves_after_ten_seconds() {
    let handler = Handler::idle();
    let start = tokio::time::Instant::now();
    let serve = Server::builder()
        .rules(Silent)
        .add_service(RuledServer::new(handler))
        .serve("127.0.0.1:0");
    let server = tokio::time::timeout(Duration::from_secs(60), serve)
        .await
        .expect("serving within a minute")
        .expect("serve");
    assert_eq!(start.elapsed(), Duration::from_secs(10));
    assert_eq!(server.rules_version(RuleKind::Governance), None);
}

/// A client's first call waits for the rules' first read: it runs under the document in
/// the store (a 200 ms timeout here, where the client's own options set none). Before, it
/// ran under the options the rules replace, and the held call never ended.
#[tokio::test]
async fn rules_stored_before_a_client_is_built_apply_to_its_first_call() {
    let f = fleet_after(Some("[entries.\"t.Ruled.hold\"]\ntimeout_ms = 200\n")).await;
    let e = within("call", f.ruled.hold()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert_eq!(f.client.rules_version(RuleKind::Governance), f.stored);
}

#[tokio::test]
async fn a_running_servers_entry_cap_follows_the_rules_and_can_observe() {
    let mut f = fleet().await;
    let mut events = f.server.events().subscribe();
    let v1 = f
        .rules
        .put(
            RuleKind::Governance,
            "[entries.\"t.Ruled.hold\"]\nmax_concurrent_handling_count = 1\n",
        )
        .await
        .unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v1).await;
    assert_eq!(f.server.rules_version(RuleKind::Governance), Some(v1));
    // The cap is 1 now (50 before): a second call at once is refused.
    let first = common::until_entered(Box::pin(f.ruled.hold()), "hold", &mut f.entered).await;
    let e = within("call", f.ruled.hold()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
    f.handler.release.add_permits(1);
    assert_eq!(within("first", first).await.unwrap(), "held");

    // Observe mode: the call over the cap is admitted, and reported.
    let v2 = f
        .rules
        .put(
            RuleKind::Governance,
            "[entries.\"t.Ruled.hold\"]\nmax_concurrent_handling_count = 1\nadmission_observe = true\n",
        )
        .await
        .unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v2).await;
    let first = common::until_entered(Box::pin(f.ruled.hold()), "hold", &mut f.entered).await;
    let second = common::until_entered(Box::pin(f.ruled.hold()), "hold", &mut f.entered).await;
    let overflow = within("the observed overflow", async {
        loop {
            let e = events.recv().await.expect("events");
            if e.kind == EventKind::Overflow {
                return e;
            }
        }
    })
    .await;
    assert!(overflow.observed, "{overflow:?}");
    f.handler.release.add_permits(2);
    assert_eq!(within("first", first).await.unwrap(), "held");
    assert_eq!(within("second", second).await.unwrap(), "held");
}

#[rpc::service(name = "t.Who")]
trait Who {
    /// Answers the serving instance's name.
    async fn who(&self) -> Result<String, RpcError>;
}

struct Named(&'static str);

impl Who for Named {
    async fn who(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

#[tokio::test]
async fn a_routing_document_in_etcd_steers_a_running_clients_calls_and_a_bad_one_is_refused() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await;
    let reg = InProcessRegistry::new();
    let mut servers = Vec::new();
    for (name, version) in [("canary", "canary"), ("stable", "stable")] {
        servers.push(
            Server::builder()
                .registry(reg.clone())
                .metadata("version", version)
                .add_service(WhoServer::new(Named(name)))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    let client = Client::builder().registry(reg).rules(rules.clone()).build();
    let who = WhoClient::new(client.clone());
    let mut events = client.events().subscribe();
    async fn served(who: &WhoClient, n: usize) -> Vec<String> {
        let mut names = Vec::new();
        for _ in 0..n {
            names.push(within("call", who.who()).await.expect("call"));
        }
        names
    }
    // Without rules, round robin reaches both instances.
    let mut before = served(&who, 4).await;
    before.sort();
    before.dedup();
    assert_eq!(before, ["canary", "stable"]);

    // A valid routing document: every call goes to the canary from the next call.
    let doc = "[[routes]]\nname = \"all-canary\"\nservice = \"t.Who\"\n\
               to = [ { tags = { version = \"canary\" } } ]\n";
    let v1 = rules.set(RuleKind::Routing, doc, 0).await.unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v1).await;
    assert_eq!(client.rules_version(RuleKind::Routing), Some(v1));
    assert_eq!(client.routing_rules().routes.len(), 1);
    assert!(served(&who, 6).await.iter().all(|n| n == "canary"));

    // The store refuses a document the routing parser refuses (a weight of 0)...
    let bad = doc.replace("} } ]", "}, weight = 0 } ]");
    let e = rules.set(RuleKind::Routing, &bad, v1).await.unwrap_err();
    assert!(matches!(e, RuleError::Invalid { .. }), "{e}");
    assert!(e.to_string().contains("weight"), "{e}");
    // ...and a client refuses it when written past the store: the last good version stays.
    let mut raw = etcd.client().await;
    let put = raw
        .put(rules.key(RuleKind::Routing), bad.as_str(), None)
        .await
        .unwrap();
    let bad_version = put.header().unwrap().revision();
    rule_event(&mut events, EventKind::RuleRejected, bad_version).await;
    assert_eq!(client.rules_version(RuleKind::Routing), Some(v1));
    assert!(served(&who, 4).await.iter().all(|n| n == "canary"));
    for s in servers {
        s.shutdown().await;
    }
}

/// Deleting a rule document by hand (`etcdctl del`) puts running processes back on the lower
/// levels, as a process started then has them: before, running processes kept the deleted
/// rules and the fleet split.
#[tokio::test]
async fn a_document_deleted_from_etcd_is_withdrawn_from_running_processes() {
    let f = fleet().await;
    let mut events = f.client.events().subscribe();
    let mut served = f.server.events().subscribe();
    let fail = &RuledClient::methods()[1];
    let observe = "[entries.\"t.Ruled.fail\"]\nbreaker_observe = true\n";
    let v1 = f.rules.put(RuleKind::Governance, observe).await.unwrap();
    rule_event(&mut events, EventKind::RuleApplied, v1).await;
    rule_event(&mut served, EventKind::RuleApplied, v1).await;
    assert!(f.client.options(fail).breaker_observe);
    assert_eq!(f.server.rules_version(RuleKind::Governance), Some(v1));
    let mut raw = f._etcd.client().await;
    raw.delete(f.rules.key(RuleKind::Governance), None)
        .await
        .unwrap();
    /// The next `rule_applied` event without a version: a document withdrawn.
    async fn withdrawal(
        events: &mut tokio::sync::broadcast::Receiver<GovernanceEvent>,
    ) -> GovernanceEvent {
        within("the withdrawal", async {
            loop {
                let e = events.recv().await.expect("events");
                if e.kind == EventKind::RuleApplied && e.rule_version.is_none() {
                    return e;
                }
            }
        })
        .await
    }
    let withdrawn = withdrawal(&mut events).await;
    assert!(
        withdrawn.cause.as_deref().unwrap_or("").contains("deleted"),
        "{withdrawn:?}"
    );
    assert_eq!(f.client.rules_version(RuleKind::Governance), None);
    // The server following the same store withdraws it too.
    withdrawal(&mut served).await;
    assert_eq!(f.server.rules_version(RuleKind::Governance), None);
    assert!(
        !f.client.options(fail).breaker_observe,
        "back to the default"
    );
}
