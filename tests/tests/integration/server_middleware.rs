//! Server middleware over real TCP: the caller's identity reaching dispatch, and the README's
//! layers (per-method authorization, argument validation, a metrics layer, a certificate check)
//! in front of a generated service, with a generated proxy calling it.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{certs, no_retry, recv_one, within};
use rpc::crates::core::wire::RemoteResultMessage;
use rpc::crates::transport::{self as transport, Call, ConnectOptions, Connection, Dispatch};
use rpc::{
    Caller, Client, InProcessRegistry, LayerFuture, RpcContext, RpcError, Server, ServerHandle,
    ServerLayer, ServerNext, ServerRequest, StatusCode,
};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

#[rpc::service(name = "orders.Orders")]
trait Orders {
    /// Places an order; returns its number.
    async fn place(&self, item: String, quantity: u32) -> Result<u64, RpcError>;
    /// Cancels an order.
    async fn cancel(&self, order: u64) -> Result<bool, RpcError>;
    /// Waits until the test lets it go (holds the server's only cap slot).
    async fn hold(&self) -> Result<(), RpcError>;
}

/// The service: counts what its handlers ran.
struct Shop {
    placed: AtomicUsize,
    cancelled: AtomicUsize,
    entered: Option<mpsc::UnboundedSender<()>>,
    release: Arc<Semaphore>,
}

impl Orders for Shop {
    async fn place(&self, _item: String, quantity: u32) -> Result<u64, RpcError> {
        self.placed.fetch_add(1, Ordering::SeqCst);
        Ok(u64::from(quantity) * 10)
    }
    async fn cancel(&self, _order: u64) -> Result<bool, RpcError> {
        self.cancelled.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }
    async fn hold(&self) -> Result<(), RpcError> {
        if let Some(tx) = &self.entered {
            let _ = tx.send(());
        }
        let permit = self.release.acquire().await;
        permit
            .map_err(|_| RpcError::business("released for good"))?
            .forget();
        Ok(())
    }
}

/// The server fallback: counts every time it answers.
#[derive(Default)]
struct Backup {
    ran: AtomicUsize,
}

impl Orders for Backup {
    async fn place(&self, _item: String, _quantity: u32) -> Result<u64, RpcError> {
        self.ran.fetch_add(1, Ordering::SeqCst);
        Ok(0)
    }
    async fn cancel(&self, _order: u64) -> Result<bool, RpcError> {
        self.ran.fetch_add(1, Ordering::SeqCst);
        Ok(false)
    }
    async fn hold(&self) -> Result<(), RpcError> {
        self.ran.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

// ---- The layers of README "Server middleware" ----

/// Per-method authorization: only the listed client ids may cancel orders.
struct CancelAllowList {
    allowed: HashSet<String>,
}

impl ServerLayer for CancelAllowList {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            if req.entry_id() == "orders.Orders.cancel"
                && !(req.caller().token_verified()
                    && self.allowed.contains(req.caller().client_id()))
            {
                return Err(RpcError::new(
                    StatusCode::RpcUnAuthentication,
                    format!(
                        "client {:?} may not cancel orders; ask for it to be added to the \
                         allow list",
                        req.caller().client_id()
                    ),
                ));
            }
            next.run(req).await
        })
    }
}

/// Argument validation: `place` takes 1 to 100 items of a named article.
struct ValidateOrders;

impl ServerLayer for ValidateOrders {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            if req.entry_id() == "orders.Orders.place" {
                let (item, quantity): (String, u32) = req.decode_parameters()?;
                let mut refused = RpcError::validation("the order was refused");
                if item.is_empty() {
                    refused = refused.with_field_error("item", "must name an article");
                }
                if !(1..=100).contains(&quantity) {
                    refused = refused.with_field_error("quantity", "must be between 1 and 100");
                }
                if !refused.field_errors().is_empty() {
                    return Err(refused);
                }
            }
            next.run(req).await
        })
    }
}

/// A metrics layer: calls per entry and status, in its own counters.
#[derive(Default, Clone)]
struct CountCalls {
    counts: Arc<Mutex<BTreeMap<(String, u32), usize>>>,
}

impl ServerLayer for CountCalls {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            let entry = req.entry_id();
            let result = next.run(req).await;
            let status = match &result {
                Ok(_) => StatusCode::Success,
                Err(e) => e.code(),
            };
            *self
                .counts
                .lock()
                .unwrap()
                .entry((entry.to_string(), status.as_u32()))
                .or_default() += 1;
            result
        })
    }
}

/// What a layer saw of one call.
#[derive(Debug)]
struct Seen {
    entry: &'static str,
    client_id: String,
    token_verified: bool,
    tenant: Option<String>,
    has_deadline: bool,
    certificate: Option<Vec<u8>>,
}

/// Reports what it sees of each call.
struct Witness(mpsc::UnboundedSender<Seen>);

impl ServerLayer for Witness {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            let _ = self.0.send(Seen {
                entry: req.entry_id(),
                client_id: req.caller().client_id().to_string(),
                token_verified: req.caller().token_verified(),
                tenant: req.attachments().get("tenant").cloned(),
                has_deadline: req.deadline().is_some(),
                certificate: req.caller().peer_certificate().map(<[u8]>::to_vec),
            });
            next.run(req).await
        })
    }
}

const TOKEN: &str = "orders-s3cret";

/// A client of `reg`'s orders service, calling as `client_id`, without retries.
fn client(reg: &InProcessRegistry, client_id: &str) -> OrdersClient {
    OrdersClient::new(
        Client::builder()
            .registry(reg.clone())
            .token(TOKEN)
            .client_id(client_id)
            .override_options(OrdersClient::SERVICE_ID, no_retry())
            .build(),
    )
}

// ---- Caller identity at the transport ----

/// Answers every call with nothing, after reporting the `Caller` it was handed.
struct Recorder(mpsc::UnboundedSender<Arc<Caller>>);

impl transport::InvokeHandler for Recorder {
    fn handle(&self, _invoke: transport::Invoke, caller: &Arc<Caller>) -> Dispatch {
        let _ = self.0.send(caller.clone());
        Dispatch::Ready(RemoteResultMessage {
            status_code: StatusCode::Success.as_u32(),
            ..Default::default()
        })
    }
}

#[tokio::test]
async fn every_call_of_a_connection_is_handed_the_caller_its_handshake_established() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let (tx, mut seen) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(transport::serve(
        listener,
        Arc::new(Recorder(tx)),
        transport::ServerOptions {
            token: Some(TOKEN.into()),
            ..Default::default()
        },
        shutdown.clone(),
    ));
    let options = ConnectOptions {
        token: Some(TOKEN.into()),
        client_id: "billing-7".into(),
        ..Default::default()
    };
    let conn = within("connect", Connection::connect(&addr.to_string(), &options))
        .await
        .expect("connect");
    let call = || Call {
        service_entry_id: "any.Any.call".into(),
        ..Default::default()
    };
    within("first call", conn.call(call(), None))
        .await
        .expect("first call");
    within("second call", conn.call(call(), None))
        .await
        .expect("second call");
    let first = recv_one("the first call's caller", &mut seen).await;
    let second = recv_one("the second call's caller", &mut seen).await;
    assert_eq!(first.client_id(), "billing-7");
    assert!(first.token_verified(), "the server required the token");
    assert!(first.peer().ip().is_loopback(), "{first:?}");
    assert_ne!(first.peer(), addr, "the peer is the client's end");
    assert_eq!(
        first.peer_certificate(),
        None,
        "plain TCP has no certificate"
    );
    assert!(
        Arc::ptr_eq(&first, &second),
        "one Caller per connection, shared by its calls"
    );
    shutdown.cancel();
    within("server stops", server).await.expect("server task");
}

#[tokio::test]
async fn without_a_required_token_the_caller_is_not_token_verified() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, mut seen) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(transport::serve(
        listener,
        Arc::new(Recorder(tx)),
        transport::ServerOptions::default(),
        shutdown.clone(),
    ));
    let options = ConnectOptions {
        token: Some("unchecked".into()),
        client_id: "anyone".into(),
        ..Default::default()
    };
    let conn = within("connect", Connection::connect(&addr.to_string(), &options))
        .await
        .expect("connect");
    within("call", conn.call(Call::default(), None))
        .await
        .expect("call");
    let caller = recv_one("the caller", &mut seen).await;
    assert_eq!(caller.client_id(), "anyone");
    assert!(
        !caller.token_verified(),
        "no token was required: {caller:?}"
    );
    shutdown.cancel();
    within("server stops", server).await.expect("server task");
}

// ---- Layers in front of a generated service ----

struct Served {
    server: ServerHandle,
    reg: InProcessRegistry,
    shop: Arc<Shop>,
    backup: Arc<Backup>,
}

/// The orders service behind `layers`, on a server requiring the token, with a fallback and
/// a cap of `cap` calls.
async fn serve_orders(
    cap: usize,
    entered: Option<mpsc::UnboundedSender<()>>,
    layers: impl FnOnce(rpc::ServerBuilder) -> rpc::ServerBuilder,
) -> Served {
    let reg = InProcessRegistry::new();
    let shop = Arc::new(Shop {
        placed: AtomicUsize::new(0),
        cancelled: AtomicUsize::new(0),
        entered,
        release: Arc::new(Semaphore::new(0)),
    });
    let backup = Arc::new(Backup::default());
    let builder = Server::builder()
        .registry(reg.clone())
        .token(TOKEN)
        .max_concurrency(cap)
        .add_service(OrdersServer::from_arc(shop.clone()))
        .fallback(OrdersServer::from_arc(backup.clone()));
    let server = layers(builder).serve("127.0.0.1:0").await.expect("serve");
    Served {
        server,
        reg,
        shop,
        backup,
    }
}

#[tokio::test]
async fn a_layer_refuses_cancel_to_callers_off_the_allow_list_with_517_before_cap_handler_and_fallback(
) {
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    // A cap of one call, held by `hold` while the refused call arrives: a layer running after
    // entry admission would answer it Overflow (515), not 517.
    let s = serve_orders(1, Some(entered_tx), |b| {
        b.layer(CancelAllowList {
            allowed: HashSet::from(["admin".to_string()]),
        })
    })
    .await;
    let (shop_client, admin) = (client(&s.reg, "shop"), client(&s.reg, "admin"));

    let held = tokio::spawn({
        let c = shop_client.clone();
        async move { c.hold().await }
    });
    recv_one("hold took the only cap slot", &mut entered).await;

    let refused = within("refused cancel", shop_client.cancel(7))
        .await
        .expect_err("shop may not cancel");
    assert_eq!(refused.code(), StatusCode::RpcUnAuthentication, "{refused}");
    assert_eq!(refused.code().as_u32(), 517);
    assert!(refused.message().contains("\"shop\""), "{refused}");
    assert_eq!(s.shop.cancelled.load(Ordering::SeqCst), 0, "handler ran");
    assert_eq!(s.backup.ran.load(Ordering::SeqCst), 0, "fallback ran");

    s.shop.release.add_permits(1);
    within("hold ends", held)
        .await
        .expect("task")
        .expect("hold");
    // Other methods still work for that caller; the allowed caller may cancel.
    assert_eq!(
        within("place", shop_client.place("pen".into(), 2))
            .await
            .expect("place"),
        20
    );
    assert!(within("admin cancel", admin.cancel(7))
        .await
        .expect("admin cancel"));
    assert_eq!(s.shop.cancelled.load(Ordering::SeqCst), 1);
    assert_eq!(s.shop.placed.load(Ordering::SeqCst), 1);
    assert_eq!(s.backup.ran.load(Ordering::SeqCst), 0);
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_validation_layer_answers_1001_with_the_fields_before_the_handler() {
    let s = serve_orders(50, None, |b| b.layer(ValidateOrders)).await;
    let orders = client(&s.reg, "shop");

    let refused = within("invalid order", orders.place(String::new(), 0))
        .await
        .expect_err("an empty item and no quantity are invalid");
    assert_eq!(refused.code(), StatusCode::ValidateError, "{refused}");
    assert_eq!(refused.code().as_u32(), 1001);
    // The fields arrive as fields, in the order the layer named them, and the error's text
    // lists them.
    let fields = |e: &RpcError| {
        e.field_errors()
            .iter()
            .map(|f| (f.member.clone(), f.message.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        fields(&refused),
        [
            ("item".to_string(), "must name an article".to_string()),
            (
                "quantity".to_string(),
                "must be between 1 and 100".to_string()
            )
        ],
        "{refused}"
    );
    assert!(
        refused.to_string().contains("item: must name an article")
            && refused
                .to_string()
                .contains("quantity: must be between 1 and 100"),
        "{refused}"
    );
    let one_field = within("too many", orders.place("pen".into(), 101))
        .await
        .expect_err("101 is too many");
    assert_eq!(
        fields(&one_field),
        [(
            "quantity".to_string(),
            "must be between 1 and 100".to_string()
        )],
        "{one_field}"
    );
    assert_eq!(s.shop.placed.load(Ordering::SeqCst), 0, "handler ran");
    assert_eq!(s.backup.ran.load(Ordering::SeqCst), 0, "fallback ran");

    assert_eq!(
        within("valid order", orders.place("pen".into(), 3))
            .await
            .expect("valid"),
        30
    );
    assert_eq!(s.shop.placed.load(Ordering::SeqCst), 1);
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_metrics_layer_counts_calls_per_entry_and_status_early_answers_included() {
    let metrics = CountCalls::default();
    let s = serve_orders(50, None, |b| {
        // Outermost first: the metrics layer sees what the two inner layers answer.
        b.layer(metrics.clone())
            .layer(CancelAllowList {
                allowed: HashSet::from(["admin".to_string()]),
            })
            .layer(ValidateOrders)
    })
    .await;
    let (shop, admin) = (client(&s.reg, "shop"), client(&s.reg, "admin"));

    for q in 1..=3 {
        within("place", shop.place("pen".into(), q))
            .await
            .expect("place");
    }
    within("invalid place", shop.place("pen".into(), 0))
        .await
        .expect_err("invalid");
    for _ in 0..2 {
        within("refused cancel", shop.cancel(1))
            .await
            .expect_err("refused");
    }
    within("admin cancel", admin.cancel(1))
        .await
        .expect("cancel");

    let expected: BTreeMap<(String, u32), usize> = [
        (("orders.Orders.place".to_string(), 200), 3),
        (("orders.Orders.place".to_string(), 1001), 1),
        (("orders.Orders.cancel".to_string(), 517), 2),
        (("orders.Orders.cancel".to_string(), 200), 1),
    ]
    .into_iter()
    .collect();
    assert_eq!(*metrics.counts.lock().unwrap(), expected);
    assert_eq!(s.shop.placed.load(Ordering::SeqCst), 3);
    assert_eq!(s.shop.cancelled.load(Ordering::SeqCst), 1);
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_layer_sees_the_entry_caller_attachments_and_deadline() {
    let (tx, mut seen) = mpsc::unbounded_channel();
    let s = serve_orders(50, None, |b| b.layer(Witness(tx))).await;
    let orders = client(&s.reg, "shop");
    within(
        "place with a tenant",
        RpcContext::with_attachment("tenant", "acme", orders.place("pen".into(), 1)),
    )
    .await
    .expect("place");
    let saw = recv_one("what the layer saw", &mut seen).await;
    assert_eq!(saw.entry, "orders.Orders.place");
    assert_eq!(saw.client_id, "shop");
    assert!(saw.token_verified);
    assert_eq!(saw.tenant.as_deref(), Some("acme"));
    assert!(
        saw.has_deadline,
        "the client's 5 s default timeout is the call's deadline"
    );
    assert_eq!(saw.certificate, None);
    within("shutdown", s.server.shutdown()).await;
}

/// Answers `place` itself with a fixed order number, without the handler.
struct Canned;

impl ServerLayer for Canned {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            if req.entry_id() == "orders.Orders.place" {
                return req.encode_answer(&4242u64);
            }
            next.run(req).await
        })
    }
}

#[tokio::test]
async fn a_layer_can_answer_with_a_value_of_its_own() {
    let s = serve_orders(50, None, |b| b.layer(Canned)).await;
    let orders = client(&s.reg, "shop");
    assert_eq!(
        within("place", orders.place("pen".into(), 1))
            .await
            .expect("place"),
        4242
    );
    assert!(within("cancel", orders.cancel(1)).await.expect("cancel"));
    assert_eq!(s.shop.placed.load(Ordering::SeqCst), 0);
    assert_eq!(s.shop.cancelled.load(Ordering::SeqCst), 1);
    within("shutdown", s.server.shutdown()).await;
}

/// Panics for every call.
struct Broken;

impl ServerLayer for Broken {
    fn call<'a>(&'a self, _req: &'a mut ServerRequest, _next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move { panic!("broken layer") })
    }
}

#[tokio::test]
async fn a_panicking_layer_answers_520_and_the_server_keeps_serving() {
    let s = serve_orders(50, None, |b| b.layer(Broken)).await;
    let orders = client(&s.reg, "shop");
    for _ in 0..2 {
        let e = within("place", orders.place("pen".into(), 1))
            .await
            .expect_err("the layer panics");
        assert_eq!(e.code(), StatusCode::ServerError, "{e}");
        assert!(e.message().contains("panic id"), "{e}");
    }
    assert_eq!(s.shop.placed.load(Ordering::SeqCst), 0);
    within("shutdown", s.server.shutdown()).await;
}

// ---- Early answers in the span and the server's metrics ----

mod observed {
    pub use crate::common::otel::{attr, counter, Meters, Traces};
}

#[tokio::test]
async fn an_early_answer_is_recorded_with_its_status_on_the_span_and_in_the_metrics() {
    let (traces, _guard) = observed::Traces::install();
    let meters = observed::Meters::new();
    let meter = meters.meter.clone();
    let s = serve_orders(50, None, |b| {
        b.meter(meter).layer(CancelAllowList {
            allowed: HashSet::new(),
        })
    })
    .await;
    let orders = client(&s.reg, "shop");
    within("refused cancel", orders.cancel(1))
        .await
        .expect_err("refused");
    within("place", orders.place("pen".into(), 1))
        .await
        .expect("place");

    let spans = traces.spans();
    let server_span = |method: &'static str| {
        spans
            .iter()
            .find(|s| {
                s.name == "rpc.server" && observed::attr(s, "rpc.method") == Some(method.into())
            })
            .unwrap_or_else(|| panic!("no rpc.server span for {method}"))
    };
    assert_eq!(
        observed::attr(server_span("cancel"), "rpc.status_code"),
        Some(517i64.into())
    );
    assert_eq!(
        observed::attr(server_span("place"), "rpc.status_code"),
        Some(200i64.into())
    );

    let m = meters.read();
    let calls = |method: &'static str, code: i64| {
        observed::counter(
            &m,
            "rpc.server.calls",
            &[
                ("rpc.method", method.into()),
                ("rpc.status_code", code.into()),
            ],
        )
    };
    assert_eq!(calls("cancel", 517), 1);
    assert_eq!(calls("place", 200), 1);
    within("shutdown", s.server.shutdown()).await;
}

// ---- Mutual TLS: the caller's certificate ----

/// Lets `cancel` through only for callers whose certificate is `admin`'s (compared as DER: a
/// real service would parse it and read its subject).
struct CancelByCertificate {
    admin_der: Vec<u8>,
}

impl ServerLayer for CancelByCertificate {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            if req.entry_id() == "orders.Orders.cancel"
                && req.caller().peer_certificate() != Some(&self.admin_der[..])
            {
                return Err(RpcError::new(
                    StatusCode::RpcUnAuthentication,
                    "cancelling needs the admin certificate; connect with it",
                ));
            }
            next.run(req).await
        })
    }
}

#[tokio::test]
async fn under_mutual_tls_a_layer_decides_by_the_callers_certificate() {
    use rpc::tls::{ClientTls, ServerTls};

    let (server_ca, client_ca) = (certs::Ca::new("server CA"), certs::Ca::new("client CA"));
    let server_id = server_ca.server();
    let admin = client_ca.client("admin");
    let clerk = client_ca.client("clerk");
    let (tx, mut seen) = mpsc::unbounded_channel();
    let tls = ServerTls::from_pem(server_id.cert.as_bytes(), server_id.key.as_bytes())
        .expect("server TLS")
        .require_client_certs(client_ca.pem.as_bytes())
        .expect("client CA");
    let s = serve_orders(50, None, |b| {
        b.tls(tls).layer(Witness(tx)).layer(CancelByCertificate {
            admin_der: admin.der.clone(),
        })
    })
    .await;
    let presenting = |id: &certs::Identity, client_id: &str| {
        OrdersClient::new(
            Client::builder()
                .registry(s.reg.clone())
                .token(TOKEN)
                .client_id(client_id)
                .tls(
                    ClientTls::from_pem(server_ca.pem.as_bytes())
                        .expect("roots")
                        .identity(id.cert.as_bytes(), id.key.as_bytes())
                        .expect("identity"),
                )
                .override_options(OrdersClient::SERVICE_ID, no_retry())
                .build(),
        )
    };

    let by_clerk = presenting(&clerk, "clerk");
    let refused = within("clerk cancels", by_clerk.cancel(1))
        .await
        .expect_err("the clerk's certificate may not cancel");
    assert_eq!(refused.code(), StatusCode::RpcUnAuthentication, "{refused}");
    let saw = recv_one("the clerk's call", &mut seen).await;
    assert_eq!(saw.certificate.as_deref(), Some(&clerk.der[..]));

    let by_admin = presenting(&admin, "admin");
    assert!(within("admin cancels", by_admin.cancel(1))
        .await
        .expect("admin cancel"));
    let saw = recv_one("the admin's call", &mut seen).await;
    assert_eq!(saw.certificate.as_deref(), Some(&admin.der[..]));
    assert_eq!(s.shop.cancelled.load(Ordering::SeqCst), 1);
    within("shutdown", s.server.shutdown()).await;
}

// ---- A tower layer through the adapter (feature `tower`) ----

/// A tower middleware of a team's own: `cancel` only with the attachment `role = admin`.
#[derive(Clone)]
struct RoleGate<S> {
    inner: S,
}

struct RoleGateLayer;

impl<S> rpc::tower::Layer<S> for RoleGateLayer {
    type Service = RoleGate<S>;
    fn layer(&self, inner: S) -> RoleGate<S> {
        RoleGate { inner }
    }
}

impl<S> rpc::tower::Service<rpc::tower::TowerRequest> for RoleGate<S>
where
    S: rpc::tower::Service<rpc::tower::TowerRequest, Error = RpcError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = RpcError;
    type Future = futures_util::future::BoxFuture<'static, Result<S::Response, RpcError>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), RpcError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: rpc::tower::TowerRequest) -> Self::Future {
        let r = req.request();
        if r.entry_id() == "orders.Orders.cancel"
            && r.attachments().get("role").map(String::as_str) != Some("admin")
        {
            return Box::pin(async {
                Err(RpcError::new(
                    StatusCode::RpcUnAuthentication,
                    "cancelling needs role=admin",
                ))
            });
        }
        Box::pin(self.inner.call(req))
    }
}

/// Behind a tower layer, an answer reports the entry's load as without one, counting the call
/// itself (1 in flight of the cap of 50). Before, the tower service's copy of the request took
/// the load with it, and the load was read again after the call's slot was given back (0).
#[tokio::test]
async fn behind_a_tower_layer_an_answer_reports_the_load_counting_itself() {
    let s = serve_orders(50, None, |b| {
        b.layer(rpc::tower::TowerLayer::new(RoleGateLayer))
    })
    .await;
    let options = ConnectOptions {
        token: Some(TOKEN.into()),
        ..Default::default()
    };
    let addr = s.server.local_addr().to_string();
    let conn = within("connect", Connection::connect(&addr, &options))
        .await
        .expect("connect");
    let place = Call {
        service_entry_id: "orders.Orders.place".into(),
        parameters: rpc::Codec::MsgPack.encode(&("pen", 2u32)).expect("encode"),
        ..Default::default()
    };
    let answer = within("place", conn.call(place, None))
        .await
        .expect("answered");
    assert_eq!(answer.status_code, 200, "{answer:?}");
    assert_eq!((answer.server_in_flight, answer.server_limit), (1, 50));
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_tower_layer_runs_in_its_place_in_the_chain_and_can_refuse() {
    let metrics = CountCalls::default();
    let s = serve_orders(50, None, |b| {
        b.layer(metrics.clone())
            .layer(rpc::tower::TowerLayer::new(RoleGateLayer))
            .layer(ValidateOrders)
    })
    .await;
    let orders = client(&s.reg, "shop");
    let refused = within("cancel without the role", orders.cancel(1))
        .await
        .expect_err("no role");
    assert_eq!(refused.code(), StatusCode::RpcUnAuthentication, "{refused}");
    assert!(within(
        "cancel as admin",
        RpcContext::with_attachment("role", "admin", orders.cancel(1))
    )
    .await
    .expect("admin cancel"));
    // Behind the tower layer, the next server layer still runs.
    within("invalid place", orders.place("pen".into(), 0))
        .await
        .expect_err("invalid");
    let expected: BTreeMap<(String, u32), usize> = [
        (("orders.Orders.cancel".to_string(), 517), 1),
        (("orders.Orders.cancel".to_string(), 200), 1),
        (("orders.Orders.place".to_string(), 1001), 1),
    ]
    .into_iter()
    .collect();
    assert_eq!(*metrics.counts.lock().unwrap(), expected);
    assert_eq!(s.shop.cancelled.load(Ordering::SeqCst), 1);
    assert_eq!(s.shop.placed.load(Ordering::SeqCst), 0);
    within("shutdown", s.server.shutdown()).await;
}

/// A layer whose code panics before its first `.await` (here: at once, in `call` itself).
struct PanicsAtOnce;

impl ServerLayer for PanicsAtOnce {
    fn call<'a>(&'a self, _req: &'a mut ServerRequest, _next: ServerNext<'a>) -> LayerFuture<'a> {
        panic!("the layer fails before it returns its future")
    }
}

/// Tells the test of each call the server handled: its status and outcome.
struct Outcomes(Mutex<mpsc::UnboundedSender<(Option<StatusCode>, &'static str)>>);

impl rpc::crates::governance::calls::CallObserver for Outcomes {
    fn call_ended(&self, call: &rpc::crates::governance::calls::CallRecord) {
        let _ = self.0.lock().unwrap().send((call.status, call.outcome));
    }
}

/// A panic in the first layer's own `call` (before its future exists) is the call's answer,
/// 520 with a panic id, and recorded as an error (before, it escaped the handler's guard: the
/// call was recorded as cancelled by its caller, and answered without the entry or the id).
#[tokio::test]
async fn a_layer_panicking_before_its_future_exists_answers_520_recorded_as_an_error() {
    let (e, record) = one_call_through(PanicsAtOnce).await;
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    assert!(e.message().contains("orders.Orders.place"), "{e}");
    assert_eq!(record, (Some(StatusCode::ServerError), "error"));
}

/// One call through a server with `layer`, which must fail it: its error, and the server's
/// record of it (status and outcome).
async fn one_call_through(
    layer: impl ServerLayer,
) -> (RpcError, (Option<StatusCode>, &'static str)) {
    let s = serve_orders(50, None, |b| b.layer(layer)).await;
    let (tx, mut outcomes) = mpsc::unbounded_channel();
    s.server
        .status()
        .observe_calls(Arc::new(Outcomes(Mutex::new(tx))));
    let orders = client(&s.reg, "shop");
    let e = within("the call", orders.place("pen".into(), 1))
        .await
        .expect_err("the layer fails the call");
    let record = recv_one("the call's record", &mut outcomes).await;
    s.server.shutdown().await;
    (e, record)
}

/// A layer that refuses every call with an error of status 200.
struct RefusesWithSuccess;

impl ServerLayer for RefusesWithSuccess {
    fn call<'a>(&'a self, _req: &'a mut ServerRequest, _next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async { Err(RpcError::new(StatusCode::Success, "refused, oddly")) })
    }
}

/// A layer's error of status 200 travels as a business error (1000), and is recorded as the
/// caller gets it: not as a success, as it was (200, `success`).
#[tokio::test]
async fn a_layers_error_of_status_200_is_recorded_as_the_business_error_it_travels_as() {
    let (e, record) = one_call_through(RefusesWithSuccess).await;
    assert_eq!(e.code(), StatusCode::BusinessError, "{e}");
    assert_eq!(record, (Some(StatusCode::BusinessError), "error"));
}

/// Reports the deadline a layer's own calls would inherit.
struct InheritedSeen(mpsc::UnboundedSender<Option<tokio::time::Instant>>);

impl ServerLayer for InheritedSeen {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            let _ = self.0.send(rpc::crates::governance::timeout::inherited());
            next.run(req).await
        })
    }
}

/// A layer's own calls (an auth layer asking another service, say) inherit the caller's
/// deadline on a unary call, as the handler's do and as a stream's layers do. Before, a unary
/// call's layers ran with none: their calls took the entry's own timeout.
#[tokio::test(start_paused = true)]
async fn a_layer_runs_within_the_callers_deadline() {
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let s = serve_orders(4, None, |b| b.layer(InheritedSeen(seen_tx))).await;
    let orders = OrdersClient::new(
        Client::builder()
            .registry(s.reg.clone())
            .token(TOKEN)
            .override_options(
                OrdersClient::SERVICE_ID,
                rpc::GovernanceOverrides {
                    timeout_ms: Some(2_000),
                    ..no_retry()
                },
            )
            .build(),
    );
    let started = tokio::time::Instant::now();
    within("place", orders.place("pen".into(), 1))
        .await
        .expect("placed");
    let inherited = recv_one("the layer's view", &mut seen)
        .await
        .expect("the layer runs within a deadline");
    // The caller's 2 s (on the paused clock, no time passes on the way): not the entry's
    // own 5 s, nor none.
    assert_eq!(inherited - started, std::time::Duration::from_secs(2));
}
