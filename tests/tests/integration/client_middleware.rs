//! Client middleware and per-call options over real TCP: layers around each call and each
//! attempt, in the order they were added, seeing what the stack knows; and options given for
//! one call winning over every configuration level.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::within;
use rpc::{
    BoxFuture, Bytes, CallCx, Client, GovernanceOverrides, InProcessRegistry, Middleware, Next,
    Registry, RpcContext, RpcError, Server, ServerHandle, ShuntStrategy, StatusCode,
};

#[rpc::service(name = "t.Mid")]
trait Mid {
    /// The value of the `tenant` attachment the server received.
    async fn tenant(&self) -> Result<Option<String>, RpcError>;
    /// Milliseconds left of the budget the server was given (none: `None`).
    async fn budget(&self) -> Result<Option<u64>, RpcError>;
    /// Fails with a business error when `fail`.
    async fn maybe(&self, fail: bool) -> Result<u32, RpcError>;
}

#[derive(Default)]
struct Node {
    calls: AtomicUsize,
}

impl Mid for Node {
    async fn tenant(&self) -> Result<Option<String>, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(RpcContext::get("tenant"))
    }
    async fn budget(&self) -> Result<Option<u64>, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let left = rpc::crates::governance::timeout::inherited()
            .map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
        Ok(left.map(|d| d.as_millis() as u64))
    }
    async fn maybe(&self, fail: bool) -> Result<u32, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if fail {
            Err(RpcError::business("asked to fail"))
        } else {
            Ok(7)
        }
    }
}

async fn start(registry: &InProcessRegistry) -> (ServerHandle, Arc<Node>) {
    let node = Arc::new(Node::default());
    let server = Server::builder()
        .registry(registry.clone())
        .add_service(MidServer::from_arc(node.clone()))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    (server, node)
}

/// Adds the `tenant` attachment to every call.
struct Tenant(&'static str);

impl Middleware for Tenant {
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: Next<'a>,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>> {
        cx.insert_attachment("tenant", self.0);
        next.run(cx, req)
    }
}

/// Counts calls per entry and final status, as a user's metrics layer would.
#[derive(Default, Clone)]
struct Metrics {
    seen: Arc<Mutex<BTreeMap<(String, u32), u32>>>,
}

impl Middleware for Metrics {
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: Next<'a>,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>> {
        Box::pin(async move {
            let entry = cx.entry_id().to_string();
            let result = next.run(cx, req).await;
            let code = match &result {
                Ok(_) => StatusCode::Success,
                Err(e) => e.code(),
            };
            *self
                .seen
                .lock()
                .unwrap()
                .entry((entry, code.as_u32()))
                .or_default() += 1;
            result
        })
    }
}

/// Records the order layers run in, and what each attempt layer sees.
#[derive(Clone)]
struct Trace {
    name: &'static str,
    log: Arc<Mutex<Vec<String>>>,
}

impl Middleware for Trace {
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: Next<'a>,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>> {
        let line = match cx.endpoint() {
            Some(e) => format!("{} attempt {} on {e}", self.name, cx.attempt()),
            None => self.name.to_string(),
        };
        self.log.lock().unwrap().push(line);
        next.run(cx, req)
    }
}

/// Answers every call itself, without reaching the server: an error of this status and
/// message.
struct Refuse(StatusCode, &'static str);

impl Middleware for Refuse {
    fn call<'a>(
        &'a self,
        _: &'a mut CallCx<'_>,
        _: Bytes,
        _: Next<'a>,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>> {
        Box::pin(async { Err(RpcError::new(self.0, self.1)) })
    }
}

#[tokio::test]
async fn a_client_layer_adds_an_attachment_the_server_receives() {
    let registry = InProcessRegistry::new();
    let (server, _) = start(&registry).await;
    let plain = MidClient::new(Client::builder().registry(registry.clone()).build());
    let tagged = MidClient::new(
        Client::builder()
            .registry(registry.clone())
            .layer(Tenant("acme"))
            .build(),
    );
    assert_eq!(within("plain", plain.tenant()).await.unwrap(), None);
    assert_eq!(
        within("tagged", tagged.tenant()).await.unwrap(),
        Some("acme".to_string())
    );
    server.shutdown().await;
}

/// An instance whose server takes fewer attachments than a call carries (it says so in the
/// handshake; here none at all) is sent nothing: the call goes on to an instance that takes
/// them, as from an instance that cannot stream, and every call succeeds there.
#[tokio::test]
async fn a_call_over_one_instances_attachment_limits_goes_to_another() {
    let registry = InProcessRegistry::new();
    let strict = Arc::new(Node::default());
    let strict_server = Server::builder()
        .registry(registry.clone())
        .max_attachments(0, 1024)
        .add_service(MidServer::from_arc(strict.clone()))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let (server, roomy) = start(&registry).await;
    let client = Client::builder()
        .registry(registry.clone())
        .layer(Tenant("acme"))
        .build();
    let mut events = client.events().subscribe();
    let tagged = MidClient::new(client);
    for i in 0..4 {
        let tenant = within("tagged", tagged.tenant()).await;
        assert_eq!(tenant.unwrap(), Some("acme".to_string()), "call {i}");
    }
    assert_eq!(strict.calls.load(Ordering::SeqCst), 0, "sent nothing");
    assert_eq!(roomy.calls.load(Ordering::SeqCst), 4);
    // Round robin drew the strict instance first for some of them: each moved on at once.
    let strict_addr = strict_server.local_addr().to_string();
    let detours = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| {
            e.kind == rpc::crates::governance::events::EventKind::Retry
                && e.endpoint.as_deref() == Some(strict_addr.as_str())
        })
        .count();
    assert!(detours >= 1, "no call drew the strict instance first");
    strict_server.shutdown().await;
    server.shutdown().await;
}

#[tokio::test]
async fn a_metrics_layer_counts_calls_per_entry_and_status() {
    let registry = InProcessRegistry::new();
    let (server, node) = start(&registry).await;
    let metrics = Metrics::default();
    let client = MidClient::new(
        Client::builder()
            .registry(registry.clone())
            .layer(metrics.clone())
            .build(),
    );
    // The test's own record of what it did is the oracle.
    let plan = [false, true, false, false, true];
    let mut expected: BTreeMap<(String, u32), u32> = BTreeMap::new();
    for fail in plan {
        let r = within("maybe", client.maybe(fail)).await;
        assert_eq!(r.is_err(), fail);
        let code = if fail {
            StatusCode::BusinessError
        } else {
            StatusCode::Success
        };
        *expected
            .entry(("t.Mid.maybe".into(), code.as_u32()))
            .or_default() += 1;
    }
    within("tenant", client.tenant()).await.unwrap();
    *expected
        .entry(("t.Mid.tenant".into(), StatusCode::Success.as_u32()))
        .or_default() += 1;
    assert_eq!(*metrics.seen.lock().unwrap(), expected);
    assert_eq!(node.calls.load(Ordering::SeqCst), plan.len() + 1);
    server.shutdown().await;
}

#[tokio::test]
async fn call_layers_see_one_call_and_attempt_layers_each_attempt_in_order() {
    let registry = InProcessRegistry::new();
    let (server, _) = start(&registry).await;
    let live = server.local_addr().to_string();
    // An address nobody listens on: bound, then released.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let trace = |name| Trace {
        name,
        log: log.clone(),
    };
    let client = Client::builder()
        .registry(registry.clone())
        .layer(trace("outer-1"))
        .layer(trace("outer-2"))
        .attempt_layer(trace("attempt-1"))
        .attempt_layer(trace("attempt-2"))
        .build();
    // A second, dead endpoint of the service: round robin starts one of the next two calls
    // there, and that call fails over to the live one.
    registry
        .register(rpc::Instance::new(dead.clone(), ["t.Mid"]))
        .await
        .unwrap();
    client
        .wait_for_endpoints("t.Mid", common::LIMIT)
        .await
        .unwrap();
    let proxy = MidClient::new(client);
    for _ in 0..2 {
        within("maybe", proxy.maybe(false)).await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    let failed_over = [
        "outer-1".to_string(),
        "outer-2".to_string(),
        format!("attempt-1 attempt 0 on {dead}"),
        format!("attempt-2 attempt 0 on {dead}"),
        format!("attempt-1 attempt 1 on {live}"),
        format!("attempt-2 attempt 1 on {live}"),
    ];
    let direct = [
        "outer-1".to_string(),
        "outer-2".to_string(),
        format!("attempt-1 attempt 0 on {live}"),
        format!("attempt-2 attempt 0 on {live}"),
    ];
    let a: Vec<String> = [direct.to_vec(), failed_over.to_vec()].concat();
    let b: Vec<String> = [failed_over.to_vec(), direct.to_vec()].concat();
    assert!(log == a || log == b, "{log:#?}");
    server.shutdown().await;
}

#[tokio::test]
async fn a_layer_can_answer_without_reaching_the_server() {
    let registry = InProcessRegistry::new();
    let (server, node) = start(&registry).await;
    let client = MidClient::new(
        Client::builder()
            .registry(registry)
            .layer(Refuse(StatusCode::UnAuthentication, "no ticket"))
            .build(),
    );
    let err = within("refused", client.maybe(false)).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::UnAuthentication);
    assert_eq!(node.calls.load(Ordering::SeqCst), 0);
    server.shutdown().await;
}

/// A client layer's error made with status 200 is a failed call, counted as one: the caller
/// gets a business error (1000), and the call's record says so (before, the call failed and
/// was counted 200, `success`: no error rate showed it).
#[tokio::test]
async fn a_client_layers_error_of_status_200_is_a_failed_call_in_its_record() {
    let registry = InProcessRegistry::new();
    let (server, node) = start(&registry).await;
    let client = Client::builder()
        .registry(registry)
        .layer(Refuse(StatusCode::Success, "refused, oddly"))
        .build();
    let mut records = common::observe_calls(&client);
    let err = within("refused", MidClient::new(client).maybe(false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), StatusCode::BusinessError, "{err}");
    let (_, status, outcome) = within("the call's record", records.recv())
        .await
        .expect("one record");
    assert_eq!(
        (status, outcome.as_str()),
        (Some(StatusCode::BusinessError), "error")
    );
    assert_eq!(node.calls.load(Ordering::SeqCst), 0);
    server.shutdown().await;
}

/// On the paused clock: the budget a server is told is the call's whole timeout, to the
/// millisecond, which says which level's timeout the call had.
#[tokio::test(start_paused = true)]
async fn per_call_options_win_over_every_level() {
    let registry = InProcessRegistry::new();
    let (server, node) = start(&registry).await;
    let client = Client::builder()
        .registry(registry)
        // The runtime level, the highest below per-call options.
        .override_options(
            "t.Mid",
            GovernanceOverrides {
                timeout_ms: Some(30_000),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let normal = MidClient::new(client.clone());
    let hurried = MidClient::new(client.with_options(GovernanceOverrides {
        timeout_ms: Some(300),
        ..GovernanceOverrides::NONE
    }));
    // The budget the server was given says which deadline the call had.
    let left = within("normal", normal.budget()).await.unwrap().unwrap();
    assert_eq!(left, 30_000);
    let left = within("hurried", hurried.budget()).await.unwrap().unwrap();
    assert_eq!(left, 300);
    let left = within(
        "with_timeout",
        MidClient::new(client.with_timeout(std::time::Duration::from_millis(200))).budget(),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(left, 200);
    // The generated proxy offers the same, for its own calls only.
    let left = within(
        "proxy with_timeout",
        normal
            .with_timeout(std::time::Duration::from_millis(150))
            .budget(),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(left, 150);
    let left = within("proxy unchanged", normal.budget())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left, 30_000);
    // Any option: appointing an address nobody listens on, without retries, fails this call
    // only; the handle the options were not given to still reaches the server.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let before = node.calls.load(Ordering::SeqCst);
    let misrouted = MidClient::new(client.with_options(GovernanceOverrides {
        shunt_strategy: Some(ShuntStrategy::Appoint),
        appoint_address: Some(dead.clone().into()),
        retry_times: Some(0),
        ..GovernanceOverrides::NONE
    }));
    let err = within("misrouted", misrouted.maybe(false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(err.to_string().contains(&dead), "{err}");
    assert_eq!(node.calls.load(Ordering::SeqCst), before);
    within("normal again", normal.maybe(false)).await.unwrap();
    // The entry's options as the client reports them did not change.
    assert_eq!(client.options(&MidClient::methods()[2]).timeout_ms, 30_000);
    server.shutdown().await;
}

/// An attempt layer that waits `delay` before passing the attempt on (a token fetch, say).
fn waits(delay: std::time::Duration) -> impl Middleware {
    rpc::middleware_fn(move |cx, req, next| {
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            next.run(cx, req).await
        })
    })
}

/// The budget sent to the server is what is left when the attempt goes out: an attempt layer
/// that waited 1 s of a 3 s call leaves the server 2 s, not the 3 s the call had when the
/// attempt began (the handler's own calls inherit it).
#[tokio::test(start_paused = true)]
async fn the_server_is_told_the_budget_left_after_the_attempt_layers() {
    let registry = InProcessRegistry::new();
    let (_server, _node) = start(&registry).await;
    let client = MidClient::new(
        Client::builder()
            .registry(registry)
            .override_options(
                "t.Mid",
                GovernanceOverrides {
                    timeout_ms: Some(3_000),
                    ..GovernanceOverrides::NONE
                },
            )
            .attempt_layer(waits(std::time::Duration::from_millis(1_000)))
            .build(),
    );
    // A first call connects (the connecting path already re-reads the budget).
    within("connect", client.budget()).await.unwrap();
    let left = within("budget", client.budget()).await.unwrap().unwrap();
    assert_eq!(left, 2_000, "ms left at the server");
}

/// A call that runs out of a budget its handle set (`with_timeout`) is told to raise it
/// there, not only "for the entry", whose options a user would raise for nothing (the
/// handle's timeout sits above every level of them).
#[tokio::test(start_paused = true)]
async fn a_timeout_set_by_the_handle_is_named_in_its_error() {
    let registry = InProcessRegistry::new();
    let (server, _node) = start(&registry).await;
    let client = Client::builder()
        .registry(registry)
        .attempt_layer(waits(std::time::Duration::from_millis(1_000)))
        .build();
    let hurried = MidClient::new(client.with_timeout(std::time::Duration::from_millis(50)));
    let e = within("a hurried call", hurried.budget())
        .await
        .expect_err("its 50 ms pass in the attempt layer");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert!(
        e.message().contains("50 ms budget") && e.message().contains("Client::with_timeout"),
        "{e}"
    );
    server.shutdown().await;
}
