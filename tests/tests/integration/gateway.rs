//! The HTTP/JSON gateway as its users use it: real servers over TCP publishing to a registry, a
//! gateway following that registry, and an HTTP client calling through it: named arguments,
//! a route declared on the trait with path and query parameters, typed errors as 422, a timeout
//! as 504, overflow as 503 with `Retry-After`, failover when an instance dies, entries that come
//! and go with their servers, headers as attachments, the W3C trace context continued, the
//! bearer token, and the gateway's own refusals. The core flow, the timeout and the failover run
//! against each registry: in-process, etcd and ZooKeeper.

use crate::common;
use crate::etcd_harness;
use crate::zookeeper_harness;

use std::sync::Arc;
use std::time::Duration;

use common::otel::Traces;
use common::{let_through, within, LIMIT};
use rpc::{Client, InProcessRegistry, Registry, RpcContext, RpcError, Server, ServerHandle};
use rpc_gateway::{Gateway, GatewayBuilder};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Order {
    id: u64,
    currency: String,
    verbose: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum OrderError {
    NotFound { id: u64 },
    Rpc(#[serde(with = "rpc::serde_rpc_error")] RpcError),
}

impl From<RpcError> for OrderError {
    fn from(e: RpcError) -> Self {
        OrderError::Rpc(e)
    }
}

#[rpc::service(name = "shop.Orders")]
pub trait Orders {
    /// One order; `NotFound` for id 0.
    #[http(get = "/orders/{id}")]
    async fn get(
        &self,
        id: u64,
        currency: String,
        verbose: Option<bool>,
    ) -> Result<Order, OrderError>;
    /// Never answers: the entry's timeout ends the call.
    #[governance(timeout_ms = 300, retry_times = 0)]
    async fn stall(&self) -> Result<(), RpcError>;
    /// Answers when the test lets it through.
    #[governance(retry_times = 0)]
    async fn hold(&self) -> Result<String, RpcError>;
    /// Its optional arguments as it got them; a count of 0 is refused (1001, naming `count`).
    #[http(get = "/notes")]
    async fn note(
        &self,
        text: Option<String>,
        count: Option<u32>,
    ) -> Result<(Option<String>, Option<u32>), RpcError>;
    /// Always refuses the caller as not authenticated (401).
    async fn locked(&self) -> Result<(), RpcError>;
}

#[rpc::service(name = "gw.Echo")]
pub trait Echo {
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    /// The address of the server that answered. Idempotent: a call that may have reached a
    /// server that died is repeated on another one.
    #[governance(idempotent)]
    async fn whoami(&self) -> Result<String, RpcError>;
    /// The call's attachment `name`, as the handler sees it.
    async fn attachment(&self, name: String) -> Result<Option<String>, RpcError>;
}

/// Declares the same route as [`BStatus`]: the one first by service id keeps it.
#[rpc::service(name = "a.Status")]
pub trait AStatus {
    #[http(get = "/status")]
    async fn status(&self) -> Result<String, RpcError>;
}

/// Declares the same route as [`AStatus`]: served at its default route instead.
#[rpc::service(name = "b.Status")]
pub trait BStatus {
    #[http(get = "/status")]
    async fn status(&self) -> Result<String, RpcError>;
}

/// Answers what JSON cannot hold.
#[rpc::service(name = "gw.Odd")]
pub trait Odd {
    /// A map keyed by lists.
    async fn keyed(&self) -> Result<std::collections::BTreeMap<Vec<u32>, u32>, RpcError>;
}

struct Lists;

impl Odd for Arc<Lists> {
    async fn keyed(&self) -> Result<std::collections::BTreeMap<Vec<u32>, u32>, RpcError> {
        Ok([(vec![1, 2], 3)].into())
    }
}

struct Named(&'static str);

impl AStatus for Arc<Named> {
    async fn status(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

impl BStatus for Arc<Named> {
    async fn status(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

struct Shop {
    gate: Arc<Semaphore>,
    entered: mpsc::UnboundedSender<String>,
}

impl Orders for Arc<Shop> {
    async fn get(
        &self,
        id: u64,
        currency: String,
        verbose: Option<bool>,
    ) -> Result<Order, OrderError> {
        if id == 0 {
            return Err(OrderError::NotFound { id });
        }
        Ok(Order {
            id,
            currency,
            verbose: verbose.unwrap_or(false),
        })
    }

    async fn stall(&self) -> Result<(), RpcError> {
        std::future::pending().await
    }

    async fn hold(&self) -> Result<String, RpcError> {
        let _ = self.entered.send("hold".into());
        let_through(&self.gate).await?;
        Ok("released".into())
    }

    async fn note(
        &self,
        text: Option<String>,
        count: Option<u32>,
    ) -> Result<(Option<String>, Option<u32>), RpcError> {
        if count == Some(0) {
            return Err(RpcError::validation("the note was refused")
                .with_field_error("count", "must be at least 1"));
        }
        Ok((text, count))
    }

    async fn locked(&self) -> Result<(), RpcError> {
        Err(RpcError::new(
            rpc::StatusCode::UnAuthentication,
            "sign in first",
        ))
    }
}

struct Voice {
    address: String,
}

impl Echo for Arc<Voice> {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }

    async fn whoami(&self) -> Result<String, RpcError> {
        Ok(self.address.clone())
    }

    async fn attachment(&self, name: String) -> Result<Option<String>, RpcError> {
        Ok(RpcContext::get(&name))
    }
}

/// A gateway over `registry`, served on a free loopback port, with the servers a test starts.
struct World {
    registry: Arc<dyn Registry>,
    /// The etcd the registry is kept in, when it is etcd: stopped when the test ends.
    _etcd: Option<etcd_harness::Etcd>,
    gateway: Gateway,
    base: String,
    http: reqwest::Client,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
    gate: Arc<Semaphore>,
    entered: mpsc::UnboundedReceiver<String>,
    entered_tx: mpsc::UnboundedSender<String>,
    /// Spans of this test's thread. Every test installs a span subscriber: `tracing` caches each
    /// callsite's interest process-wide, and a test thread without one could mark the server
    /// span's callsite as never wanted while the trace test runs.
    traces: Traces,
    _traced: tracing::subscriber::DefaultGuard,
}

impl Drop for World {
    fn drop(&mut self) {
        self.serving.abort();
    }
}

/// An answer: status, headers, body (JSON, or the text as a JSON string when it is not JSON).
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Answer {
    /// Asserts the HTTP status and the call status (`code`) of a failed call's body.
    #[track_caller]
    fn is(&self, status: u16, code: u32) {
        assert_eq!(
            (self.status, &self.body["code"]),
            (status, &json!(code)),
            "{}",
            self.body
        );
    }

    /// Asserts that the body's `field` is text holding each of `parts`.
    #[track_caller]
    fn says(&self, field: &str, parts: &[&str]) {
        let text = self.body[field].as_str().unwrap_or_default();
        assert!(
            parts.iter().all(|p| text.contains(p)),
            "{field} should hold {parts:?}: {}",
            self.body
        );
    }
}

impl World {
    /// A gateway over a fresh registry of `kind`.
    async fn of(kind: Kind) -> World {
        match kind {
            Kind::InProcess => World::in_process(None).await,
            Kind::Etcd => {
                let etcd = etcd_harness::Etcd::start().await;
                let registry = <dyn Registry>::from_url(&etcd.url())
                    .await
                    .expect("etcd registry");
                World::over(registry, Some(etcd), None).await
            }
            Kind::ZooKeeper => {
                let zk = zookeeper_harness::ZooKeeper::shared().await;
                let url = zk.url_with_prefix(&zookeeper_harness::ZooKeeper::prefix());
                let registry = <dyn Registry>::from_url(&url).await.expect("zk registry");
                World::over(registry, None, None).await
            }
        }
    }

    /// A gateway over `registry` (kept in `etcd`, when given), asking for `token` when given.
    async fn over(
        registry: Arc<dyn Registry>,
        etcd: Option<etcd_harness::Etcd>,
        token: Option<&str>,
    ) -> World {
        World::configured(registry, etcd, |builder| match token {
            Some(token) => builder.token(token),
            None => builder,
        })
        .await
    }

    /// A gateway over `registry` (kept in `etcd`, when given), its builder set up by
    /// `configure`.
    async fn configured(
        registry: Arc<dyn Registry>,
        etcd: Option<etcd_harness::Etcd>,
        configure: impl FnOnce(GatewayBuilder) -> GatewayBuilder,
    ) -> World {
        let (traces, traced) = Traces::install();
        let client = Client::builder().shared_registry(registry.clone()).build();
        let builder = Gateway::builder()
            .client(client)
            .registry(registry.clone())
            .discovery_interval(Duration::from_millis(100));
        let gateway = configure(builder).build().await.expect("build the gateway");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let serving = tokio::spawn(gateway.clone().serve(listener));
        let (entered_tx, entered) = mpsc::unbounded_channel();
        World {
            registry,
            _etcd: etcd,
            gateway,
            base,
            http: reqwest::Client::new(),
            serving,
            gate: Arc::new(Semaphore::new(0)),
            entered,
            entered_tx,
            traces,
            _traced: traced,
        }
    }

    async fn in_process(token: Option<&str>) -> World {
        World::over(Arc::new(InProcessRegistry::new()), None, token).await
    }

    /// Starts an orders server taking at most `max_concurrency` calls at once.
    async fn orders(&self, max_concurrency: usize) -> ServerHandle {
        let shop = Arc::new(Shop {
            gate: self.gate.clone(),
            entered: self.entered_tx.clone(),
        });
        Server::builder()
            .shared_registry(self.registry.clone())
            .max_concurrency(max_concurrency)
            .add_service(OrdersServer::new(shop))
            .serve("127.0.0.1:0")
            .await
            .expect("serve orders")
    }

    /// Starts an echo server.
    async fn echo(&self) -> ServerHandle {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr").to_string();
        Server::builder()
            .shared_registry(self.registry.clone())
            .add_service(EchoServer::new(Arc::new(Voice { address })))
            .serve_listener(listener)
            .await
            .expect("serve echo")
    }

    /// Starts a server of `service` alone.
    async fn server(&self, service: impl rpc::Service) -> ServerHandle {
        let id = service.service_id();
        Server::builder()
            .shared_registry(self.registry.clone())
            .add_service(service)
            .serve("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("serving {id}: {e}"))
    }

    /// Waits (on the gateway's route table changes) until every entry of `ids` is served.
    async fn serving(&self, ids: &[&str]) {
        let ok = self
            .gateway
            .wait_until(LIMIT, |entries| {
                ids.iter()
                    .all(|id| entries.iter().any(|e| e.id.as_str() == *id))
            })
            .await;
        assert!(ok, "the gateway does not serve {ids:?} within {LIMIT:?}");
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> Answer {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        if let Some(body) = body {
            request = request.body(body.to_string());
        }
        let response = within("the HTTP request", request.send())
            .await
            .expect("the gateway answers");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = within("the HTTP body", response.text())
            .await
            .expect("body");
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Answer {
            status,
            headers,
            body,
        }
    }

    async fn post(&self, path: &str, body: &str) -> Answer {
        self.send("POST", path, &[], Some(body)).await
    }
}

/// The registries the gateway is tested over, as users run it: the flows below run over each.
#[derive(Clone, Copy)]
enum Kind {
    InProcess,
    Etcd,
    ZooKeeper,
}

/// One test per registry of `$flow` (a function taking a [`Kind`]), in a module of its name:
/// `$flow::in_process`, `$flow::etcd`, `$flow::zookeeper`.
macro_rules! over_each_registry {
    ($($flow:ident),* $(,)?) => {$(
        mod $flow {
            use super::Kind;

            #[tokio::test]
            async fn in_process() {
                super::$flow(Kind::InProcess).await;
            }

            #[tokio::test]
            async fn etcd() {
                super::$flow(Kind::Etcd).await;
            }

            #[tokio::test]
            async fn zookeeper() {
                super::$flow(Kind::ZooKeeper).await;
            }
        }
    )*};
}

over_each_registry!(
    core_flow,
    a_call_past_its_timeout_is_answered_504,
    calls_fail_over_when_one_of_two_instances_dies,
);

/// The flow every registry must carry: a call by name, a typed error, a declared route with
/// path and query parameters, and an entry that appears with its server and goes with it.
async fn core_flow(kind: Kind) {
    let world = World::of(kind).await;
    let _orders = world.orders(50).await;
    world.serving(&["shop.Orders.get"]).await;

    let a = world
        .send("GET", "/orders/42?currency=EUR&verbose=true", &[], None)
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        a.body,
        json!({"id": 42, "currency": "EUR", "verbose": true})
    );

    // The published schemas decide: `currency` is a string, so `123` stays text; `verbose` is
    // an `Option`, so it may be left out.
    let a = world.send("GET", "/orders/5?currency=123", &[], None).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        a.body,
        json!({"id": 5, "currency": "123", "verbose": false})
    );

    let a = world.send("GET", "/orders/0?currency=EUR", &[], None).await;
    a.is(422, 1000);
    assert_eq!(a.body["error"], json!({"NotFound": {"id": 0}}));

    // An entry appears when its server starts, with no restart of the gateway.
    let echo = world.echo().await;
    world.serving(&["gw.Echo.echo"]).await;
    let a = world.post("/api/gw.Echo/echo", r#"{"text": "hi"}"#).await;
    assert_eq!((a.status, a.body), (200, json!("hi")));

    // ... and disappears when it stops.
    echo.shutdown().await;
    let gone = world
        .gateway
        .wait_until(LIMIT, |entries| {
            !entries.iter().any(|e| e.service_id.as_str() == "gw.Echo")
        })
        .await;
    assert!(
        gone,
        "gw.Echo is still served after its only server stopped"
    );
    let a = world.post("/api/gw.Echo/echo", r#"{"text": "hi"}"#).await;
    assert_eq!(a.status, 404, "{}", a.body);
    assert!(a.body["error"].as_str().is_some(), "{}", a.body);
}

/// The entry's timeout (300 ms) ends a call its server never answers: 504, code 519.
async fn a_call_past_its_timeout_is_answered_504(kind: Kind) {
    let world = World::of(kind).await;
    let _orders = world.orders(50).await;
    world.serving(&["shop.Orders.stall"]).await;
    let a = world.post("/api/shop.Orders/stall", "{}").await;
    a.is(504, 519);
}

#[tokio::test]
async fn overflow_is_answered_503_with_retry_after() {
    let mut world = World::in_process(None).await;
    let _orders = world.orders(1).await;
    world.serving(&["shop.Orders.hold"]).await;
    let first = {
        let http = world.http.clone();
        let url = format!("{}/api/shop.Orders/hold", world.base);
        tokio::spawn(async move { http.post(url).body("{}").send().await })
    };
    let tag = common::recv_one("the first call's handler", &mut world.entered).await;
    assert_eq!(tag, "hold");

    let a = world.post("/api/shop.Orders/hold", "{}").await;
    a.is(503, 515);
    let retry_after: u64 = a
        .headers
        .get("retry-after")
        .expect("Retry-After")
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!(retry_after >= 1);

    world.gate.add_permits(1);
    let first = within("the first call", first)
        .await
        .expect("task")
        .expect("answer");
    assert_eq!(first.status().as_u16(), 200);
    assert_eq!(first.text().await.expect("body"), "\"released\"");
}

/// Past `max_in_flight` calls at once, the gateway answers 503 with `Retry-After: 1` itself
/// (its own `{"error"}` body: no call went out), and takes calls again once one ends.
#[tokio::test]
async fn calls_past_the_in_flight_limit_are_answered_503_by_the_gateway() {
    let registry: Arc<dyn Registry> = Arc::new(InProcessRegistry::new());
    let mut world = World::configured(registry, None, |b| b.max_in_flight(2)).await;
    let _orders = world.orders(50).await;
    world
        .serving(&["shop.Orders.hold", "shop.Orders.note"])
        .await;
    let mut held = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let http = world.http.clone();
        let url = format!("{}/api/shop.Orders/hold", world.base);
        held.spawn(async move { http.post(url).body("{}").send().await });
        let tag = common::recv_one("a held call's handler", &mut world.entered).await;
        assert_eq!(tag, "hold");
    }
    let a = world.send("GET", "/notes", &[], None).await;
    assert_eq!(a.status, 503, "{}", a.body);
    a.says("error", &["at once (2)"]);
    assert_eq!(a.headers.get("retry-after").expect("Retry-After"), "1");
    // Refused before its body is read: a request announcing a body it never sends is answered
    // at once, not after the read timeout.
    let mut raw = tokio::net::TcpStream::connect(world.base.trim_start_matches("http://"))
        .await
        .expect("connect");
    raw.write_all(
        b"POST /api/shop.Orders/hold HTTP/1.1\r\nhost: gateway\r\ncontent-length: 100\r\n\r\n",
    )
    .await
    .expect("the head");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = within("the answer's head", raw.read(&mut byte))
            .await
            .expect("read");
        assert_eq!(n, 1, "closed after {:?}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");

    for left in [1, 0] {
        world.gate.add_permits(1);
        let done = within("a held call", held.join_next())
            .await
            .expect("one held")
            .expect("task")
            .expect("answer");
        assert_eq!(done.status().as_u16(), 200);
        // A permit back: the next call is taken.
        let a = world.send("GET", "/notes", &[], None).await;
        assert_eq!(a.status, 200, "{left} held: {}", a.body);
    }
}

/// One of two instances dies (its registration left behind, as after a crash): every call
/// still answers, from the other.
async fn calls_fail_over_when_one_of_two_instances_dies(kind: Kind) {
    let world = World::of(kind).await;
    let a = world.echo().await;
    let b = world.echo().await;
    let (addr_a, addr_b) = (a.local_addr().to_string(), b.local_addr().to_string());
    world.serving(&["gw.Echo.whoami"]).await;
    // Both instances answer before one dies (round robin).
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let r = world.post("/api/gw.Echo/whoami", "{}").await;
        assert_eq!(r.status, 200, "{}", r.body);
        seen.insert(r.body.as_str().expect("address").to_string());
    }
    assert_eq!(seen, [addr_a.clone(), addr_b.clone()].into());

    // Killed: connections closed, its registration left behind as after a crash.
    a.abort();
    for _ in 0..6 {
        let r = world.post("/api/gw.Echo/whoami", "{}").await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.body, json!(addr_b));
    }
}

/// A gateway nested under a prefix in a larger axum app serves its routes there, and its
/// document says so (`servers`), so that OpenAPI tools call them there rather than at `/`;
/// served at the root, the document has no `servers` (the default, `/`).
#[tokio::test]
async fn a_gateway_nested_under_a_prefix_documents_its_routes_there() {
    let world = World::in_process(None).await;
    let _echo = world.echo().await;
    world.serving(&["gw.Echo.echo"]).await;
    let app = axum::Router::new().nest("/gw", world.gateway.router());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let serving = tokio::spawn(async move { axum::serve(listener, app).await });
    let get = |url: String| async move {
        let response = within("GET", reqwest::get(url)).await.expect("answer");
        assert_eq!(response.status(), 200);
        let text = within("body", response.text()).await.expect("body");
        serde_json::from_str::<Value>(&text).expect("JSON")
    };
    let nested = get(format!("{base}/gw/openapi.json")).await;
    assert_eq!(nested["servers"], json!([{"url": "/gw"}]));
    let path = "/api/gw.Echo/echo";
    assert!(nested["paths"].get(path).is_some(), "{}", nested["paths"]);
    let called = within(
        "call",
        reqwest::Client::new()
            .post(format!("{base}/gw{path}"))
            .body(r#"{"text":"hi"}"#)
            .send(),
    )
    .await
    .expect("answer");
    assert_eq!(called.status(), 200, "served under the prefix");
    let root = world.send("GET", "/openapi.json", &[], None).await;
    assert!(root.body.get("servers").is_none(), "{}", root.body);
    serving.abort();
}

#[tokio::test]
async fn headers_travel_as_attachments_but_the_gateway_s_own_do_not() {
    let world = World::in_process(Some("s3cret")).await;
    let _echo = world.echo().await;
    world.serving(&["gw.Echo.attachment"]).await;
    let auth = ("authorization", "Bearer s3cret");
    for (name, expected) in [
        ("x-tenant", json!("acme")),
        ("authorization", Value::Null),
        ("cookie", Value::Null),
        ("host", Value::Null),
    ] {
        let a = world
            .send(
                "POST",
                "/api/gw.Echo/attachment",
                &[auth, ("X-Tenant", "acme"), ("cookie", "session=1")],
                Some(&json!({ "name": name }).to_string()),
            )
            .await;
        assert_eq!((a.status, &a.body), (200, &expected), "{name}");
    }
}

#[tokio::test]
async fn the_bearer_token_is_checked() {
    let world = World::in_process(Some("s3cret")).await;
    let _echo = world.echo().await;
    world.serving(&["gw.Echo.echo"]).await;
    let body = Some(r#"{"text": "hi"}"#);
    for headers in [vec![], vec![("authorization", "Bearer wrong")]] {
        let a = world
            .send("POST", "/api/gw.Echo/echo", &headers, body)
            .await;
        assert_eq!(a.status, 401, "{headers:?}");
        assert_eq!(
            a.headers.get("www-authenticate").expect("challenge"),
            "Bearer"
        );
        assert!(a.body["error"].as_str().expect("error").contains("Bearer"));
    }
    let a = world.send("GET", "/openapi.json", &[], None).await;
    assert_eq!(a.status, 401);
    // Another method on the document's route says nothing more.
    let a = world.send("POST", "/openapi.json", &[], None).await;
    assert_eq!(a.status, 401, "{}", a.body);
    // The scheme's name in any case (RFC 9110), the token exactly.
    for given in ["Bearer s3cret", "bearer s3cret", "BEARER s3cret"] {
        let a = world
            .send(
                "POST",
                "/api/gw.Echo/echo",
                &[("authorization", given)],
                body,
            )
            .await;
        assert_eq!((a.status, a.body), (200, json!("hi")), "{given}");
    }
    let a = world
        .send(
            "POST",
            "/api/gw.Echo/echo",
            &[("authorization", "Bearer S3CRET")],
            body,
        )
        .await;
    assert_eq!(a.status, 401);
    let a = world.send("GET", "/healthz", &[], None).await;
    assert_eq!((a.status, a.body), (200, json!("ok")));
}

/// A page of another site that posts to the gateway (a browser sends its `Origin` with every
/// request that is not a GET or HEAD) is refused 403 before anything runs, so a gateway on
/// loopback with no token cannot be driven by any web page its user opens. Requests of the
/// gateway's own origin (its documentation page), through proxies that name it first in
/// `X-Forwarded-Host` or `Forwarded`, or without `Origin` (curl, servers) are served.
#[tokio::test]
async fn a_request_from_a_page_of_another_origin_is_refused() {
    let world = World::in_process(None).await;
    let _echo = world.echo().await;
    world.serving(&["gw.Echo.echo"]).await;
    let body = Some(r#"{"text": "hi"}"#);
    let own = world.base.clone();
    for (path, headers) in [
        ("/api/gw.Echo/echo", vec![("origin", "http://evil.example")]),
        ("/api/gw.Echo/echo", vec![("origin", "null")]),
        // (The port is part of the origin.)
        ("/api/gw.Echo/echo", vec![("origin", "http://127.0.0.1:1")]),
        // Refused before the route is looked up.
        (
            "/api/nobody.Nothing/x",
            vec![("origin", "http://evil.example")],
        ),
        // A proxy's second host is not the one the browser asked for.
        (
            "/api/gw.Echo/echo",
            vec![
                ("origin", "https://inner.example"),
                ("x-forwarded-host", "api.example, inner.example"),
            ],
        ),
    ] {
        let a = world.send("POST", path, &headers, body).await;
        assert_eq!(a.status, 403, "{headers:?}: {}", a.body);
        let error = a.body["error"].as_str().expect("error");
        assert!(error.contains("another origin"), "{error}");
    }
    for headers in [
        vec![],
        vec![("origin", own.as_str())],
        vec![
            ("origin", "https://api.example"),
            ("x-forwarded-host", "api.example"),
        ],
        // Through two proxies, the first host is the one the browser asked for.
        vec![
            ("origin", "https://api.example"),
            ("x-forwarded-host", "api.example, inner.example"),
        ],
        vec![
            ("origin", "https://api.example"),
            (
                "forwarded",
                r#"for=10.0.0.1;host="api.example";proto=https, for=10.0.0.2"#,
            ),
        ],
    ] {
        let a = world
            .send("POST", "/api/gw.Echo/echo", &headers, body)
            .await;
        assert_eq!((a.status, &a.body), (200, &json!("hi")), "{headers:?}");
    }
}

#[tokio::test]
async fn the_gateway_s_own_refusals_say_what_to_send() {
    let world = World::in_process(None).await;
    let _echo = world.echo().await;
    let _orders = world.orders(50).await;
    world.serving(&["gw.Echo.echo", "shop.Orders.get"]).await;

    let a = world.post("/api/nobody.Nothing/x", "{}").await;
    assert_eq!(a.status, 404);
    let message = a.body["error"].as_str().expect("error");
    assert!(message.contains("/openapi.json"), "{message}");
    assert!(
        !message.contains("gw.Echo"),
        "a 404 lists nothing: {message}"
    );

    let a = world.post("/api/gw.Echo/echo", "{text: hi").await;
    assert_eq!(a.status, 400);
    assert!(a.body["error"]
        .as_str()
        .expect("error")
        .starts_with("the body is not JSON"));

    let a = world.post("/api/gw.Echo/echo", "{}").await;
    assert_eq!(a.status, 400);
    let message = a.body["error"].as_str().expect("error");
    assert!(
        message.contains("\"text\"") && message.contains("missing"),
        "{message}"
    );

    let a = world
        .post("/api/gw.Echo/echo", r#"{"text": "a", "txt": "b"}"#)
        .await;
    assert_eq!(a.status, 400);
    a.says("error", &["no argument \"txt\""]);

    let a = world.send("GET", "/orders/7", &[], None).await;
    assert_eq!(a.status, 400, "currency is required: {}", a.body);
    let message = a.body["error"].as_str().expect("error");
    assert!(message.contains("currency"), "{message}");

    let a = world.send("DELETE", "/orders/7", &[], None).await;
    assert_eq!(a.status, 405);
    assert_eq!(a.headers.get("allow").expect("Allow"), "GET, HEAD");
    let message = a.body["error"].as_str().expect("error");
    assert!(
        message.contains("DELETE") && message.contains("GET"),
        "{message}"
    );

    // The gateway's own routes refuse other methods the same way.
    for path in ["/healthz", "/docs", "/openapi.json"] {
        let a = world.send("POST", path, &[], Some("{}")).await;
        assert_eq!(a.status, 405, "{path}");
        assert_eq!(a.headers.get("allow").expect("Allow"), "GET, HEAD");
        let message = a.body["error"].as_str().expect("error");
        assert!(message.contains("GET"), "{path}: {message}");
    }

    // The document lists what is served, at the routes it is served at.
    let a = world.send("GET", "/openapi.json", &[], None).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.body["openapi"], "3.1.0");
    let paths = &a.body["paths"];
    assert!(paths["/orders/{id}"]["get"].is_object(), "{paths}");
    assert!(paths["/api/gw.Echo/echo"]["post"].is_object(), "{paths}");
    let a = world.send("GET", "/docs", &[], None).await;
    assert_eq!(a.status, 200);
    // In no other site's frame (a decoy over its "Send" buttons), sending no referrer.
    assert_eq!(a.headers["x-frame-options"], "DENY");
    assert_eq!(
        a.headers["content-security-policy"],
        "frame-ancestors 'none'"
    );
    assert_eq!(a.headers["referrer-policy"], "no-referrer");
}

/// HEAD on an entry's GET route, or on one of the gateway's own, answers what GET would, with
/// the GET answer's length and no body.
#[tokio::test]
async fn a_head_request_answers_the_get_answer_s_head_with_no_body() {
    let world = World::in_process(None).await;
    let _orders = world.orders(50).await;
    world.serving(&["shop.Orders.get"]).await;
    for path in ["/orders/42?currency=EUR", "/healthz"] {
        let url = format!("{}{path}", world.base);
        let get = within("GET", world.http.get(&url).send())
            .await
            .expect("GET");
        assert_eq!(get.status(), 200, "{path}");
        let length = within("GET's body", get.bytes()).await.expect("body").len();
        assert!(length > 0, "{path}");
        let head = within("HEAD", world.http.head(&url).send())
            .await
            .expect("HEAD");
        assert_eq!(head.status(), 200, "{path}");
        let said = head
            .headers()
            .get("content-length")
            .map(|v| v.to_str().ok());
        assert_eq!(said, Some(Some(length.to_string().as_str())), "{path}");
        let body = within("HEAD's body", head.bytes()).await.expect("body");
        assert!(body.is_empty(), "{path}: {body:?}");
    }
}

/// Query values of optional arguments: text for `Option<String>` whatever it looks like (an
/// empty value too); an empty value of another optional argument, or none at all, is `null`.
#[tokio::test]
async fn optional_query_arguments_are_text_or_null_as_their_schemas_say() {
    let world = World::in_process(None).await;
    let _orders = world.orders(50).await;
    world.serving(&["shop.Orders.note"]).await;
    for (query, expected) in [
        ("?text=42&count=7", json!(["42", 7])),
        ("?text=true", json!(["true", null])),
        ("?text=&count=", json!(["", null])),
        ("", json!([null, null])),
    ] {
        let a = world
            .send("GET", &format!("/notes{query}"), &[], None)
            .await;
        assert_eq!((a.status, &a.body), (200, &expected), "{query}: {}", a.body);
    }
}

/// A validation error's fields reach the HTTP caller as fields, beside the message.
#[tokio::test]
async fn a_validation_error_answers_400_naming_its_fields() {
    let world = World::in_process(None).await;
    let _orders = world.orders(50).await;
    world.serving(&["shop.Orders.note"]).await;
    let a = world.send("GET", "/notes?count=0", &[], None).await;
    a.is(400, 1001);
    assert_eq!(
        a.body["fields"],
        json!([{"member": "count", "message": "must be at least 1"}]),
        "{}",
        a.body
    );
    a.says("message", &["the note was refused"]);
}

/// A call its service refuses as not authenticated is a 401 with its challenge, as every 401.
#[tokio::test]
async fn a_401_from_the_service_carries_a_challenge() {
    let world = World::in_process(None).await;
    let _orders = world.orders(50).await;
    world.serving(&["shop.Orders.locked"]).await;
    let a = world.post("/api/shop.Orders/locked", "{}").await;
    a.is(401, 401);
    assert_eq!(
        a.headers.get("www-authenticate").expect("challenge"),
        "Bearer"
    );
}

/// A service answering with a result JSON cannot hold is a 502 (the service answered, and the
/// gateway cannot pass the answer on), not a 500 as if the gateway had failed.
#[tokio::test]
async fn a_result_that_cannot_be_json_is_answered_502() {
    let world = World::in_process(None).await;
    let _odd = world.server(OddServer::new(Arc::new(Lists))).await;
    world.serving(&["gw.Odd.keyed"]).await;
    let a = world.post("/api/gw.Odd/keyed", "{}").await;
    a.is(502, 500);
    a.says("message", &["gw.Odd.keyed", "not readable as JSON"]);
}

/// A call whose server refuses the credentials it carried (517: here the gateway's own client
/// has no token for a server that needs one) is a 403 with no challenge: no token sent to the
/// gateway would change it.
#[tokio::test]
async fn a_517_from_the_service_is_a_403_with_no_challenge() {
    let world = World::in_process(None).await;
    let _echo = Server::builder()
        .shared_registry(world.registry.clone())
        .token("the-server-s-token")
        .add_service(EchoServer::new(Arc::new(Voice {
            address: String::new(),
        })))
        .serve("127.0.0.1:0")
        .await
        .expect("serve echo");
    world.serving(&["gw.Echo.echo"]).await;
    let a = world.post("/api/gw.Echo/echo", r#"{"text":"hi"}"#).await;
    a.is(403, 517);
    assert!(
        a.headers.get("www-authenticate").is_none(),
        "{:?}",
        a.headers
    );
}

#[tokio::test]
async fn the_request_s_traceparent_continues_into_the_server_s_span() {
    let world = World::in_process(None).await;
    let _echo = world.echo().await;
    world.serving(&["gw.Echo.echo"]).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let a = world
        .send(
            "POST",
            "/api/gw.Echo/echo",
            &[("traceparent", &format!("00-{trace_id}-00f067aa0ba902b7-01"))],
            Some(r#"{"text": "traced"}"#),
        )
        .await;
    assert_eq!((a.status, a.body), (200, json!("traced")));
    // (A server's span ends as its task drops it, which may come after the answer.)
    let spans = world
        .traces
        .spans_once("the server's span", |spans| {
            spans.iter().any(|s| s.name == "rpc.server")
        })
        .await;
    let server = spans
        .iter()
        .find(|s| s.name == "rpc.server")
        .unwrap_or_else(|| {
            panic!(
                "no rpc.server span among {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(server.span_context.trace_id().to_string(), trace_id);
}

/// The gateway's span carries the answer's HTTP status as a number, and is an error for a 5xx
/// answer only: a 504 is; a 200, and a 422 (the method's business error: the caller's), are not.
#[tokio::test]
async fn the_gateway_s_span_has_its_status_as_a_number_and_fails_on_5xx_only() {
    use common::otel::attr;
    use opentelemetry::trace::Status;
    use opentelemetry::Value;
    let world = World::in_process(None).await;
    let _echo = world.echo().await;
    let _orders = world.orders(50).await;
    world
        .serving(&["gw.Echo.echo", "shop.Orders.get", "shop.Orders.stall"])
        .await;
    let answers = [
        world
            .post("/api/gw.Echo/echo", r#"{"text": "hi"}"#)
            .await
            .status,
        world
            .send("GET", "/orders/0?currency=EUR", &[], None)
            .await
            .status,
        world.post("/api/shop.Orders/stall", "{}").await.status,
    ];
    assert_eq!(answers, [200, 422, 504]);
    let spans = world
        .traces
        .spans_once("the gateway's spans", |spans| {
            spans.iter().filter(|s| s.name == "rpc.gateway").count() >= 3
        })
        .await;
    let gateway: Vec<_> = spans.iter().filter(|s| s.name == "rpc.gateway").collect();
    let seen: Vec<(Option<Value>, bool)> = gateway
        .iter()
        .map(|s| {
            let failed = matches!(s.status, Status::Error { .. });
            (attr(s, "http.response.status_code"), failed)
        })
        .collect();
    assert_eq!(
        seen,
        [
            (Some(Value::I64(200)), false),
            (Some(Value::I64(422)), false),
            (Some(Value::I64(504)), true)
        ],
        "{gateway:?}"
    );
}

/// With the gateway's own span kept from OpenTelemetry by a filter (turned off, or seen by a
/// log layer only) and the client's kept, the client's call span is the request's child (it
/// would otherwise start a trace of its own, and the server's span join that instead).
#[tokio::test]
async fn the_request_s_traceparent_continues_with_the_gateway_s_span_filtered_out() {
    for logged in [false, true] {
        let world = World::in_process(None).await;
        let (traces, _filtered) = Traces::install_without(&["rpc.gateway"], logged);
        let _echo = world.echo().await;
        world.serving(&["gw.Echo.echo"]).await;
        let (trace_id, parent) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
        let a = world
            .send(
                "POST",
                "/api/gw.Echo/echo",
                &[("traceparent", &format!("00-{trace_id}-{parent}-01"))],
                Some(r#"{"text": "traced"}"#),
            )
            .await;
        assert_eq!((a.status, a.body), (200, json!("traced")));
        let spans = traces
            .spans_once("the client's and the server's spans", |spans| {
                ["rpc.client", "rpc.server"]
                    .iter()
                    .all(|name| spans.iter().any(|s| s.name == *name))
            })
            .await;
        assert!(
            spans.iter().all(|s| s.name != "rpc.gateway"),
            "the filter keeps the gateway's span out (logged {logged})"
        );
        for name in ["rpc.client", "rpc.server"] {
            let span = spans.iter().find(|s| s.name == name).expect("span");
            assert_eq!(
                span.span_context.trace_id().to_string(),
                trace_id,
                "{name}, logged {logged}"
            );
        }
        let client = spans.iter().find(|s| s.name == "rpc.client").expect("span");
        assert_eq!(client.parent_span_id.to_string(), parent, "logged {logged}");
    }
}

#[tokio::test]
async fn of_two_services_declaring_one_route_the_first_keeps_it_and_the_other_its_default() {
    let world = World::in_process(None).await;
    // b.Status registers first: the order of service ids decides, not the order of arrival.
    let _b = world.server(BStatusServer::new(Arc::new(Named("b")))).await;
    let a_server = world.server(AStatusServer::new(Arc::new(Named("a")))).await;
    world.serving(&["a.Status.status", "b.Status.status"]).await;

    let a = world.send("GET", "/status", &[], None).await;
    assert_eq!((a.status, a.body), (200, json!("a")));
    let b = world.post("/api/b.Status/status", "{}").await;
    assert_eq!((b.status, b.body), (200, json!("b")));
    let also = world.post("/api/a.Status/status", "{}").await;
    assert_eq!(
        (also.status, also.body),
        (200, json!("a")),
        "a.Status answers at its default route too"
    );

    // The document shows each at the route it is served at.
    let doc = world.gateway.entries();
    let declared = |id: &str| {
        doc.iter()
            .find(|e| e.id.as_str() == id)
            .and_then(|e| e.api.as_ref())
            .and_then(|api| api.http.as_ref())
            .map(|h| h.path.clone())
    };
    assert_eq!(declared("a.Status.status").as_deref(), Some("/status"));
    assert_eq!(declared("b.Status.status"), None);

    // a.Status gone, b.Status takes the declared route, and its callers at the route the
    // document sent them to are still answered.
    a_server.shutdown().await;
    let gone = world
        .gateway
        .wait_until(LIMIT, |entries| {
            !entries.iter().any(|e| e.service_id.as_str() == "a.Status")
        })
        .await;
    assert!(
        gone,
        "a.Status is still served after its only server stopped"
    );
    let b = world.send("GET", "/status", &[], None).await;
    assert_eq!((b.status, b.body), (200, json!("b")));
    let b = world.post("/api/b.Status/status", "{}").await;
    assert_eq!(
        (b.status, b.body),
        (200, json!("b")),
        "b.Status still answers at its default route"
    );
}
