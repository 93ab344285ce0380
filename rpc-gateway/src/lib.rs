//! # rpc-gateway
//!
//! An HTTP/JSON gateway: every service entry that servers publish in the registry becomes a web
//! route, so browsers, mobile apps and `curl` reach the services with no client library.
//!
//! ## Routes
//!
//! | route | what |
//! |---|---|
//! | `POST /api/{service id}/{method}` | calls the entry; the body is a JSON object of named arguments |
//! | a route declared with `#[http(get = "/orders/{id}")]` | calls the entry; path and query (or body) parameters by name |
//! | `GET /openapi.json` | the OpenAPI 3.1 document of every entry served, with JSON Schemas |
//! | `GET /docs` | a documentation page over that document (its assets are built in) |
//!
//! Arguments: a parameter named in the path template comes from the path; with `GET`, `DELETE`
//! and `HEAD` the others come from the query string (a value is read as JSON unless the
//! parameter's schema is a string, or a string or null, then taken as it is; an empty value of
//! any other parameter that accepts null is null); with other methods they come from a JSON
//! object in the body, whatever its content type (so `curl -d '{"text":"hi"}'` works). A body
//! that is a JSON array is taken as positional arguments. The answer is the method's result as
//! JSON, with status 200 (a result that cannot be JSON, a service's answer the gateway cannot
//! pass on: 502, call status 500). A path is matched with its percent-encoded text decoded (a service
//! id such as `my_crate::api.Echo`, or a method name in another script, is reached as clients
//! encode it), its `%2F` (a `/` inside a segment), `%25` and `%7B` / `%7D` (braces, which in
//! a route's path name a parameter) kept escaped.
//!
//! A failed call answers with the status [`route::http_status`] maps (business error 422,
//! overflow and open breaker 503 with `Retry-After`, timeout 504, not authenticated 401 with
//! `WWW-Authenticate: Bearer` as every 401, credentials the server refused (517) 403, unknown
//! entry 404, ...) and the body
//! [`route::error_body`] writes: `{"code": 1000, "message": "...", "error": <typed error>}`
//! (with `"fields"` for a validation error naming its arguments).
//!
//! ## What this crate must not do
//!
//! It holds no governance of its own: every call goes through the governed client
//! ([`rpc_client::Client`]), so timeouts, retries, breakers, fallbacks and routing rules apply
//! as they do to a proxy. It keeps no compiled knowledge of services: everything it serves comes
//! from what servers publish, and follows the registry as servers come and go.

//! ## Using it
//!
//! ```no_run
//! use std::sync::Arc;
//! use rpc_gateway::Gateway;
//! use rpc_registry::Registry;
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let registry: Arc<dyn Registry> = <dyn Registry>::from_url("etcd://127.0.0.1:2379").await?;
//! let client = rpc_client::Client::builder().shared_registry(registry.clone()).build();
//! let gateway = Gateway::builder()
//!     .client(client)
//!     .registry(registry)
//!     .token("s3cret") // optional: `Authorization: Bearer s3cret`
//!     .build()
//!     .await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! gateway.serve(listener).await?;
//! # Ok(()) }
//! ```
//!
//! [`Gateway::router`] gives the same routes as an [`axum::Router`] to nest in a larger
//! application.
//!
//! ## Following the registry
//!
//! The route table is built from what the registry's instances publish
//! ([`rpc_core::EntryApi`]: parameter names, declared route, schemas), rebuilt as soon as any
//! watched service's instances change, and swapped whole, so a request sees one table or the
//! next, never half of one. Services that appear later are found by listing the registry again
//! every [`GatewayBuilder::discovery_interval`] (1 s by default). Stream entries are not served
//! (an HTTP answer is one JSON value). Every entry's default route is its own: a declared route
//! cannot take it (nor be written as one, `POST /api/shop.Orders/cancel`, which would answer for
//! that entry while its service is down), and an entry answers at it even when it declares
//! another route, so that a caller of the default route is not cut off as other services come
//! and go (the document shows each entry once, at the route it declares). When two entries declare the same method and path, or paths that differ only
//! in their parameters' names (with any methods: one path has one spelling, as OpenAPI
//! requires), the first in entry id order keeps it and the other is served at its default
//! route, with a warning in the log; so is an entry whose declared route has more than 16
//! parameters, names one that is not among the method's, or a parameter where default routes hold the service id (`/api/{kind}/{id}`,
//! which would answer for any entry not served at the moment).
//!
//! ## Headers, tokens and traces
//!
//! Request headers travel to the service as call attachments (lower-case names), except the
//! hop-by-hop ones and those named in `Connection`, `host`, `content-*`, `accept*`,
//! `authorization` (the gateway's own token), `cookie`, `sec-*` (a browser's fetch metadata) and
//! `rpc-*` (the framework's own keys, which a caller must not set), and values that are not
//! UTF-8 (an attachment is a string). At most
//! [`MAX_ATTACHMENTS`] headers of at most [`MAX_ATTACHMENT_BYTES`] bytes in all are forwarded;
//! more is refused with 431. A W3C `traceparent` (and `tracestate`) continues the caller's trace:
//! with feature `otel`, the gateway's `rpc.gateway` span is the child of the request's span and
//! the calls it makes carry the trace on (their spans are the request's children directly when
//! a filter keeps the gateway's span from OpenTelemetry); without it, the header is forwarded
//! as it is and the server's span joins the caller's trace directly. A request with more than
//! one `traceparent` carries no trace context (as W3C Trace Context has it): neither header nor
//! its `tracestate` is forwarded, and a new trace starts (at the gateway with feature `otel`,
//! else at the server).
//!
//! With [`GatewayBuilder::token`], every route but `GET /healthz` and `GET /docs` (a static page)
//! needs `Authorization: Bearer <token>` (the scheme's name in any case; the token compared by
//! its SHA-256 digest in constant time, so the answer's timing tells nothing of its length or
//! bytes); without it or with another token the answer is 401 with
//! `WWW-Authenticate: Bearer`.
//!
//! The gateway answers no cross-origin requests (no CORS): a call whose `Origin` header names
//! another origin than the gateway's own (`Host`, or behind a proxy the first
//! `X-Forwarded-Host` or `Forwarded: host=`) is refused 403 before anything runs, since browsers
//! send `Origin` with every request other than GET and HEAD and a page of any site could
//! otherwise post to a gateway on loopback. Requests without `Origin` (curl, servers) and from
//! the gateway's own pages pass. A page whose name resolves to the gateway's address (DNS
//! rebinding) is of the same origin as far as the browser says: a gateway browsers can reach
//! needs a token.
//!
//! The gateway's own refusals (unknown route 404, wrong method 405, unreadable arguments 400,
//! body over [`GatewayBuilder::max_body_bytes`] 413, a body not sent within
//! [`GatewayBuilder::read_timeout`] 408, too many headers 431, token 401, another origin 403,
//! more calls at once than [`GatewayBuilder::max_in_flight`] 503 with `Retry-After: 1`) answer
//! `{"error": "..."}`, saying what to send instead. `GET /healthz` answers `ok`.

#![warn(missing_docs)]

mod call;
pub mod docs;
mod follow;
pub mod openapi;
pub mod route;
mod serve;
mod table;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rpc_client::Client;
use rpc_core::ServiceEntry;
use rpc_registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub use call::{MAX_ATTACHMENTS, MAX_ATTACHMENT_BYTES};

use follow::{Follower, Shared};
use table::RouteTable;

/// The gateway could not be built.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// A required part was not given to the builder.
    #[error("the gateway needs {0}: call GatewayBuilder::{0}(...) before build()")]
    Missing(&'static str),
    /// The token given is empty: it would let every request with `Authorization: Bearer `
    /// through.
    #[error("the gateway's token is empty: give a token, or none to serve without one")]
    EmptyToken,
    /// The token given could never arrive: no `Authorization` header carries it as it is, so
    /// every request would be refused.
    #[error(
        "the gateway's token cannot be sent in an HTTP header: {0}; choose a token of visible \
         ASCII characters"
    )]
    UnsendableToken(String),
}

/// Builds a [`Gateway`]: [`client`](Self::client) and [`registry`](Self::registry) are
/// required.
pub struct GatewayBuilder {
    client: Option<Client>,
    registry: Option<Arc<dyn Registry>>,
    token: Option<String>,
    title: String,
    version: String,
    discovery_interval: Duration,
    max_body_bytes: usize,
    max_in_flight: usize,
    read_timeout: Duration,
    idle_timeout: Duration,
}

impl GatewayBuilder {
    /// The client every call goes through, with its governance (timeouts, retries, breakers,
    /// fallbacks, routing rules).
    pub fn client(mut self, client: Client) -> Self {
        self.client = Some(client);
        self
    }

    /// The registry whose published entries become routes (normally the client's own).
    pub fn registry(mut self, registry: Arc<dyn Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Requires `Authorization: Bearer <token>` on every route but `/healthz` and `/docs`.
    /// [`build`](Self::build) refuses an empty token and one no header can carry as it is.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The OpenAPI document's `info.title` (`"rpc-gateway"` by default).
    pub fn title(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// The OpenAPI document's `info.version` (this crate's version by default).
    pub fn version(mut self, version: impl Into<String>) -> Self {
        self.version = version.into();
        self
    }

    /// How often the registry is listed again for services that appeared (1 s by default);
    /// changes of services already known arrive at once through their watches.
    pub fn discovery_interval(mut self, interval: Duration) -> Self {
        // Capped as the other durations: the timer's next tick would overflow the clock.
        self.discovery_interval = rpc_core::capped(interval.max(Duration::from_millis(10)));
        self
    }

    /// The largest request body read (1 MiB by default); a larger one is answered 413.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// How many calls the gateway handles at once, from reading the body to making the answer
    /// (not its writing, which hyper does after), 1024 by default, at least 1; a call past them is answered 503 with `Retry-After: 1`,
    /// before its body is read. Without a bound, callers opening connection after connection
    /// (each sending a body up to [`max_body_bytes`](Self::max_body_bytes)) would hold as much
    /// memory as they liked; with it, the bodies held are at most this many.
    pub fn max_in_flight(mut self, calls: usize) -> Self {
        self.max_in_flight = calls.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        self
    }

    /// How long a client has to send a request's head from its first byte, and again its body
    /// (30 s by default, at least 1 ms). A head not sent in time closes the connection (when
    /// served by [`Gateway::serve`]); a body not sent in time is answered 408; an answer
    /// whose write to the socket waits for as long (the client takes nothing, or so little that
    /// the socket's buffer, which the system may grow to megabytes, never has room: as nginx's
    /// `send_timeout`) is given up, its connection closed (when served by [`Gateway::serve`];
    /// checked every `min(read, idle)` timeout, so after one to two of those). Without it, a client sending a byte now and then, or not reading, would
    /// hold a connection and its buffers for as long as it liked.
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = rpc_core::capped(timeout.max(Duration::from_millis(1)));
        self
    }

    /// How long a connection served by [`Gateway::serve`] may sit idle, before its first
    /// request and between requests, before it is closed (15 min by default, at least 1 ms;
    /// checked every this long or every [`read_timeout`](Self::read_timeout) if shorter, so a
    /// connection goes within two checks past it).
    /// Keep it longer than the idle time of the load balancers and client pools in front of the
    /// gateway (60 s for an AWS load balancer, 600 s for Google Cloud's, 90 s for reqwest's
    /// pool): a connection the gateway closes first may meet their next request, which then
    /// fails.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = rpc_core::capped(timeout.max(Duration::from_millis(1)));
        self
    }

    /// Reads the registry once (a registry that does not answer is logged and asked again
    /// later, not an error) and starts following it. Must be called within a tokio runtime;
    /// the following stops when the last clone of the gateway and of its routers is dropped.
    pub async fn build(self) -> Result<Gateway, GatewayError> {
        if let Some(token) = &self.token {
            if token.is_empty() {
                return Err(GatewayError::EmptyToken);
            }
            if let Some(why) = rpc_core::token::unsendable_in_header(token) {
                return Err(GatewayError::UnsendableToken(why));
            }
        }
        let bearer_token = self.token.is_some();
        let client = self.client.ok_or(GatewayError::Missing("client"))?;
        let registry = self.registry.ok_or(GatewayError::Missing("registry"))?;
        let shared = Arc::new(Shared {
            table: ArcSwap::from_pointee(RouteTable::default()),
            version: tokio::sync::watch::channel(0).0,
        });
        let mut follower = Follower::new(registry, shared.clone());
        follower.discover().await;
        follower.rebuild();
        let task = tokio::spawn(follower.run(self.discovery_interval));
        Ok(Gateway {
            inner: Arc::new(Inner {
                client,
                shared,
                token: self.token,
                info: openapi::DocumentInfo {
                    title: self.title,
                    version: self.version,
                    description: None,
                    bearer_token,
                },
                max_body_bytes: self.max_body_bytes,
                in_flight: tokio::sync::Semaphore::new(self.max_in_flight),
                max_in_flight: self.max_in_flight,
                limits: serve::Limits {
                    read: self.read_timeout,
                    idle: self.idle_timeout,
                },
                document: std::sync::Mutex::new(None),
                task,
            }),
        })
    }
}

/// The HTTP/JSON gateway: see the crate's documentation. Cheap to clone; clones share the
/// route table.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    shared: Arc<Shared>,
    token: Option<String>,
    info: openapi::DocumentInfo,
    max_body_bytes: usize,
    /// A permit per call being handled ([`GatewayBuilder::max_in_flight`]).
    in_flight: tokio::sync::Semaphore,
    max_in_flight: usize,
    limits: serve::Limits,
    /// The OpenAPI document of the route table it was made from: made once per table, not
    /// for every request of `/openapi.json` (which anyone may send when there is no token).
    document: std::sync::Mutex<Option<(Arc<table::RouteTable>, Arc<serde_json::Value>)>>,
    task: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Gateway {
    /// A builder with the defaults.
    pub fn builder() -> GatewayBuilder {
        GatewayBuilder {
            client: None,
            registry: None,
            token: None,
            title: "rpc-gateway".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            discovery_interval: Duration::from_secs(1),
            max_body_bytes: 1 << 20,
            max_in_flight: 1024,
            read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(15 * 60),
        }
    }

    /// The gateway's routes (see the crate's documentation) as an axum router.
    pub fn router(&self) -> axum::Router {
        call::router(self.clone())
    }

    /// Serves [`router`](Self::router) on `listener` (HTTP/1.1) until the process ends. A
    /// connection has [`GatewayBuilder::read_timeout`] to send each request's head from its
    /// first byte, and may sit idle for [`GatewayBuilder::idle_timeout`] (a router served by
    /// other means, such as `axum::serve`, needs its own such limits).
    pub async fn serve(self, listener: TcpListener) -> std::io::Result<()> {
        self.serve_with_shutdown(listener, std::future::pending())
            .await
    }

    /// As [`serve`](Self::serve) until `signal` completes, then stops accepting and lets the
    /// requests in flight finish (idle connections close at once; one still sending its
    /// request, or not taking its answer, has at most about [`GatewayBuilder::read_timeout`]
    /// more).
    pub async fn serve_with_shutdown(
        self,
        listener: TcpListener,
        signal: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let limits = self.inner.limits;
        serve::serve(listener, self, limits, signal).await
    }

    /// The entries served now, each as the OpenAPI document shows it (an entry whose declared
    /// route was taken is shown at its default route).
    pub fn entries(&self) -> Vec<ServiceEntry> {
        self.inner
            .shared
            .table
            .load()
            .served()
            .iter()
            .map(call::documented)
            .collect()
    }

    /// The OpenAPI document of the entries served now.
    pub fn openapi(&self) -> serde_json::Value {
        (*self.document()).clone()
    }

    /// The OpenAPI document of the route table in use, made when the table changed.
    pub(crate) fn document(&self) -> Arc<serde_json::Value> {
        self.document_of(self.inner.shared.table.load_full())
    }

    /// The document of `table`, a table served now or a moment ago (see
    /// [`document`](Self::document)).
    fn document_of(&self, table: Arc<RouteTable>) -> Arc<serde_json::Value> {
        let cached = || {
            self.inner
                .document
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some((made_from, document)) = &*cached() {
            if Arc::ptr_eq(made_from, &table) {
                return document.clone();
            }
        }
        // Made without the lock (requests at once may each make it, once per change).
        let entries: Vec<ServiceEntry> = table.served().iter().map(call::documented).collect();
        let document = Arc::new(openapi::document(&entries, &self.inner.info));
        // Kept only while its table is the one served (checked under the lock): a request that
        // made it from a table replaced meanwhile must not put it over the newer table's,
        // which the next request would then make again.
        let mut cache = cached();
        if Arc::ptr_eq(&self.inner.shared.table.load(), &table) {
            *cache = Some((table, document.clone()));
        }
        document
    }

    /// Waits until `ready` holds for the entries served, up to `timeout`: it is checked now and
    /// after each change of the route table (no polling). Returns whether it held.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&[ServiceEntry]) -> bool,
    ) -> bool {
        let mut version = self.inner.shared.version.subscribe();
        let wait = async {
            loop {
                version.borrow_and_update();
                if ready(&self.entries()) {
                    return true;
                }
                if version.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_empty_token_is_refused() {
        let built = Gateway::builder().token("").build().await;
        assert!(matches!(built, Err(GatewayError::EmptyToken)));
    }

    /// The OpenAPI document is made once per route table: the same one while the entries
    /// stay, a new one (of the new entries, as the document's own function makes it) once
    /// they change.
    #[tokio::test]
    async fn the_document_is_made_again_only_when_the_routes_change() {
        use rpc_registry::{InProcessRegistry, Instance, Registry};
        let registry = InProcessRegistry::new();
        registry
            .register(crate::route::test_entries::echo_instance("127.0.0.1:9"))
            .await
            .expect("register");
        let shared: Arc<dyn Registry> = Arc::new(registry.clone());
        let gateway = Gateway::builder()
            .client(Client::builder().shared_registry(shared.clone()).build())
            .registry(shared)
            .build()
            .await
            .expect("build");
        let first_table = gateway.inner.shared.table.load_full();
        let first = gateway.document();
        assert!(Arc::ptr_eq(&first, &gateway.document()), "made once");
        let mut more = Instance::new("127.0.0.1:10", ["shop.Orders"]);
        more.entries = vec![crate::route::test_entries::entry(
            "shop.Orders",
            "get",
            None,
        )];
        registry.register(more).await.expect("register");
        assert!(
            gateway
                .wait_until(Duration::from_secs(10), |entries| entries.len() == 2)
                .await,
            "the new entry served"
        );
        let second = gateway.document();
        assert!(!Arc::ptr_eq(&first, &second), "made again");
        // A request that made its document from the table served before (its build took a
        // while) does not put it over the newer one's.
        let late = gateway.document_of(first_table);
        assert_eq!(*late, *first);
        assert!(Arc::ptr_eq(&second, &gateway.document()), "kept");
        assert_eq!(
            *second,
            openapi::document(&gateway.entries(), &gateway.inner.info)
        );
        assert!(
            second["paths"]["/api/shop.Orders/get"].is_object(),
            "{second}"
        );
    }

    /// A discovery interval as long as a `Duration` holds (the program's `--discovery-secs
    /// 1e19` too) lists the registry once and still follows the known services' changes. (A
    /// review found the follower's timer would overflow the clock at its first tick; tokio's
    /// interval takes it, and the interval is capped as the other durations are anyway.)
    #[tokio::test(start_paused = true)]
    async fn the_longest_discovery_interval_still_follows_the_known_services() {
        use rpc_registry::{InProcessRegistry, Registry};
        let registry = InProcessRegistry::new();
        let instance = crate::route::test_entries::echo_instance("127.0.0.1:9");
        let id = instance.id.clone();
        registry.register(instance).await.expect("register");
        let shared: Arc<dyn Registry> = Arc::new(registry.clone());
        let gateway = Gateway::builder()
            .client(Client::builder().shared_registry(shared.clone()).build())
            .registry(shared)
            .discovery_interval(Duration::MAX)
            .build()
            .await
            .expect("build");
        assert_eq!(gateway.entries().len(), 1);
        registry.deregister(&id).await.expect("deregister");
        assert!(
            gateway
                .wait_until(Duration::from_secs(10), |entries| entries.is_empty())
                .await,
            "the entry of the instance that left is no longer served"
        );
    }

    /// A token no header carries as it is would refuse every request: refused at once.
    #[tokio::test]
    async fn a_token_no_header_can_carry_is_refused() {
        for token in ["pässwort", " padded "] {
            let built = Gateway::builder().token(token).build().await;
            assert!(
                matches!(&built, Err(GatewayError::UnsendableToken(_))),
                "{token:?}: {:?}",
                built.err()
            );
        }
    }
}
