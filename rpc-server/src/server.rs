//! Building, starting and stopping a server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rpc_core::ServiceEntry;
use rpc_governance::bulkhead::Bulkhead;
use rpc_governance::calls::{CallObserver, CallObservers};
use rpc_governance::events::EventBus;
use rpc_governance::ratelimit::{RateLimiter, RateLimits};
use rpc_registry::{Instance, Registry};
use rpc_transport::ServerOptions;
use rpc_transport::{Listener, PeerAddr};
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admission::{Admission, Gate, Policy};
use crate::cap::EntryCap;
use crate::dispatch::{Dispatcher, FallbackTo, Layered, Route, Terminal};
use crate::middleware::ServerLayer;
use crate::Service;

/// An entry's admission from its overrides: its rate limits (when set above 0), then its own
/// cap or the server's shared one, or an adaptive limit at most that cap (per entry: latency is
/// the entry's own) when `adaptive_concurrency` is on for the entry or the server.
///
/// `before`: the entry's gate so far, on a rules change. The entry's running calls count
/// against its new cap, own or shared, until they end ([`EntryCap::next`]), and a new adaptive
/// limit goes on from the old limit with the calls holding its slots.
pub(crate) fn admission(
    o: &rpc_core::GovernanceOverrides,
    shared: &Bulkhead,
    server: &ServerDefaults,
    before: Option<&Gate>,
) -> Policy {
    let d = rpc_core::GovernanceOptions::default();
    // The entry's own rate (and burst) if it sets one, else the server's.
    let limit =
        |rate: Option<u32>, burst: Option<u32>, server: Option<(u32, u32)>, default_burst| {
            let (rate, burst) = match (rate, server) {
                (Some(r), _) => (r, burst.unwrap_or(default_burst)),
                // The server's rate, with the entry's own burst when it sets one.
                (None, Some((r, b))) => (r, burst.unwrap_or(b)),
                (None, None) => (0, default_burst),
            };
            (rate > 0).then(|| (f64::from(rate), burst.max(1)))
        };
    let limits = RateLimits {
        entry: limit(
            o.rate_limit_per_second,
            o.rate_limit_burst,
            server.rate_limit,
            d.rate_limit_burst,
        ),
        per_caller: limit(
            o.caller_rate_limit_per_second,
            o.caller_rate_limit_burst,
            server.caller_rate_limit,
            d.caller_rate_limit_burst,
        ),
    };
    let limiter = (limits.entry.is_some() || limits.per_caller.is_some())
        .then(|| Arc::new(RateLimiter::new(limits)));
    let own = o.max_concurrent_handling_count.map(|n| n as usize);
    let cap = match before {
        Some(gate) => gate.cap().next(own, shared),
        None => EntryCap::new(own, shared),
    };
    let gate = if o.adaptive_concurrency.unwrap_or(server.adaptive) {
        Gate::adaptive_after(
            cap,
            o.adaptive_min_limit.unwrap_or(d.adaptive_min_limit) as usize,
            before.and_then(Gate::adaptive_limit),
        )
    } else {
        Gate::Cap(cap)
    };
    Policy {
        limiter,
        gate,
        observe_rate: o.rate_limit_observe.unwrap_or(false),
        observe_gate: o.admission_observe.unwrap_or(false),
    }
}

/// What an entry's rate limiter is built from (with the server's defaults, which do not
/// change): a rules change that leaves these alone keeps the limiter and its buckets, and one
/// that changes one limit keeps the other's ([`RateLimiter::carried_over`]).
pub(crate) fn limiter_inputs(o: &rpc_core::GovernanceOverrides) -> impl PartialEq {
    (
        o.rate_limit_per_second,
        o.rate_limit_burst,
        o.caller_rate_limit_per_second,
        o.caller_rate_limit_burst,
    )
}

/// What an entry's gate is built from: a rules change that leaves these alone keeps the gate,
/// with the slots of the calls and streams in it and the adaptive limit's measurements.
pub(crate) fn gate_inputs(o: &rpc_core::GovernanceOverrides) -> impl PartialEq {
    (
        o.max_concurrent_handling_count,
        o.adaptive_concurrency,
        o.adaptive_min_limit,
    )
}

/// Whether the server options of an entry (what [`admission`] and [`compression`] read)
/// differ between `a` and `b`: the rest of the overrides are the clients' business.
pub(crate) fn server_options_differ(
    a: &rpc_core::GovernanceOverrides,
    b: &rpc_core::GovernanceOverrides,
) -> bool {
    limiter_inputs(a) != limiter_inputs(b)
        || gate_inputs(a) != gate_inputs(b)
        || (a.rate_limit_observe, a.admission_observe)
            != (b.rate_limit_observe, b.admission_observe)
        || compression(a) != compression(b)
}

/// How an entry's answers are compressed under its overrides: its `compression` (default
/// `off`: then answers follow the algorithm the call came with) from its
/// `compression_threshold` on.
pub(crate) fn compression(o: &rpc_core::GovernanceOverrides) -> (rpc_core::Compression, u32) {
    let d = rpc_core::GovernanceOptions::default();
    (
        o.compression.unwrap_or(d.compression),
        o.compression_threshold.unwrap_or(d.compression_threshold),
    )
}

/// What the server sets for entries that set nothing themselves.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerDefaults {
    pub(crate) adaptive: bool,
    pub(crate) rate_limit: Option<(u32, u32)>,
    pub(crate) caller_rate_limit: Option<(u32, u32)>,
}

/// Entry point: `Server::builder()`.
pub struct Server;

impl Server {
    /// A builder with the defaults: cap of 50 concurrent calls, no token, 16 MiB frames.
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }
}

/// Collects services and settings, then binds with [`serve`](Self::serve).
pub struct ServerBuilder {
    services: Vec<Arc<dyn Service>>,
    fallbacks: HashMap<&'static str, Arc<dyn Service>>,
    registry: Option<Arc<dyn Registry>>,
    options: ServerOptions,
    max_concurrency: usize,
    advertise: Option<String>,
    instance_id: Option<String>,
    metadata: Vec<(String, String)>,
    events: EventBus,
    calls: CallObservers,
    send_panic_text: bool,
    adaptive: bool,
    /// Rate limits for entries that set none: all callers, per caller (per second, burst).
    rate_limit: Option<(u32, u32)>,
    caller_rate_limit: Option<(u32, u32)>,
    layers: Vec<Arc<dyn ServerLayer>>,
    rules: Option<Arc<dyn rpc_registry::RuleSource>>,
    #[cfg(feature = "otel")]
    meter: Option<opentelemetry::metrics::Meter>,
}

impl Default for ServerBuilder {
    fn default() -> Self {
        ServerBuilder {
            services: Vec::new(),
            fallbacks: HashMap::new(),
            registry: None,
            options: ServerOptions::default(),
            max_concurrency: rpc_core::GovernanceOptions::default().max_concurrent_handling_count
                as usize,
            advertise: None,
            instance_id: None,
            metadata: Vec::new(),
            events: EventBus::new(),
            calls: CallObservers::new(),
            send_panic_text: false,
            adaptive: false,
            rate_limit: None,
            caller_rate_limit: None,
            layers: Vec::new(),
            rules: None,
            #[cfg(feature = "otel")]
            meter: None,
        }
    }
}

impl ServerBuilder {
    /// Serves `service` (a `<Trait>Server` generated by `#[rpc::service]`).
    pub fn add_service(mut self, service: impl Service) -> Self {
        self.services.push(Arc::new(service));
        self
    }

    /// Sends a handler's panic message to the caller, in the 520 answer (off by default: the
    /// text may show internals, so the server logs it with a short panic id, and the caller
    /// gets only that id). For development.
    pub fn send_panic_text(mut self, yes: bool) -> Self {
        self.send_panic_text = yes;
        self
    }

    /// Adds a user layer around dispatch (see [`crate::middleware`]): it sees each call's entry,
    /// [`Caller`](crate::Caller), attachments and deadline before the call is admitted at its
    /// entry's cap, and may answer it at once (client and bidirectional streams are admitted
    /// first: see [`crate::middleware`]). Layers run in the order they are added, the
    /// first outermost. A server without layers pays nothing for the feature; each layer costs
    /// a call one boxed future.
    pub fn layer(mut self, layer: impl ServerLayer) -> Self {
        self.layers.push(Arc::new(layer));
        self
    }

    /// Registers a server-side fallback for the service it implements: it answers with the
    /// same arguments when the handler fails (an error or a panic), never for business,
    /// validation, auth or this server's not-found errors (one the handler passes on from a
    /// downstream call is its failure, sent as 504), and never once the caller's deadline has passed
    /// (nobody waits for the fallback's answer then: the call ends with its failure, 519 when
    /// the handler was still running at the deadline).
    pub fn fallback(mut self, fallback: impl Service) -> Self {
        self.fallbacks
            .insert(fallback.service_id(), Arc::new(fallback));
        self
    }

    /// Publishes the instance to `registry` once bound, and removes it first on shutdown.
    pub fn registry(mut self, registry: impl Registry) -> Self {
        self.registry = Some(Arc::new(registry));
        self
    }

    /// Like [`registry`](Self::registry), for a registry shared with other parts of the process.
    pub fn shared_registry(mut self, registry: Arc<dyn Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Calls handled at once by the whole server (50 by default); entries that set
    /// `max_concurrent_handling_count` in `#[governance(...)]` get a cap of their own.
    pub fn max_concurrency(mut self, n: usize) -> Self {
        self.max_concurrency = n;
        self
    }

    /// Gives every entry an adaptive concurrency limit instead of its fixed cap (off by
    /// default; per entry with `#[governance(adaptive_concurrency)]`): the limit follows the
    /// entry's measured latency, between `adaptive_min_limit` and the cap, and a call over it
    /// is answered Overflow (515) at once. See [`rpc_governance::adaptive`].
    pub fn adaptive_concurrency(mut self, yes: bool) -> Self {
        self.adaptive = yes;
        self
    }

    /// Gives every entry that sets no `rate_limit_per_second` of its own a token bucket of
    /// `per_second` calls a second holding `burst` (each entry its own; an entry's own
    /// `rate_limit_burst` replaces `burst`): calls over it are answered 429 at once, with the
    /// time until the next token. 0 turns it off.
    pub fn rate_limit(mut self, per_second: u32, burst: u32) -> Self {
        self.rate_limit = Some((per_second, burst));
        self
    }

    /// Gives each caller (by the client id of its handshake) a quota of `per_second` calls a
    /// second, with `burst`, on every entry that sets no `caller_rate_limit_per_second` of its
    /// own: a caller over it is answered 429 and does not spend the entry's other limits.
    /// 0 turns it off.
    pub fn caller_rate_limit(mut self, per_second: u32, burst: u32) -> Self {
        self.caller_rate_limit = Some((per_second, burst));
        self
    }

    /// Requires this token in every client's `Hello`. An empty token is refused when the
    /// server starts (every client without a token would match it, and pass as verified), and
    /// so is one no `Hello` can carry (over about 7.8 KiB, or less with a small
    /// [`max_frame_length`](Self::max_frame_length)).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.options.token = Some(token.into());
        self
    }

    /// Largest frame accepted from clients (16 MiB by default).
    pub fn max_frame_length(mut self, n: usize) -> Self {
        self.options.max_frame_length = n;
        self
    }

    /// Closes connections on which nothing arrived for this long (60 s by default; 0: never).
    /// The idle close also ends a peer that starts a large frame and stops sending, which
    /// holds a share of the server's read budget until then: with 0 it holds it for good.
    /// A server stream whose caller sent no deadline ends (519) once it has waited this long
    /// on its client with no progress (no credit granted, nothing of the connection written);
    /// with 0 it waits for ever.
    pub fn idle_timeout(mut self, t: Duration) -> Self {
        self.options.idle_timeout = t;
        self
    }

    /// Closes connections that send no `Hello` within this time (5 s by default).
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.options.handshake_timeout = t;
        self
    }

    /// On shutdown, how long calls in flight may take to finish (10 s by default;
    /// `Duration::MAX`: as long as they take).
    pub fn drain_timeout(mut self, t: Duration) -> Self {
        self.options.drain_timeout = t;
        self
    }

    /// Calls one connection may have running at once (1 024 by default); one more is answered
    /// Overflow without running.
    pub fn max_in_flight_per_connection(mut self, n: usize) -> Self {
        self.options.max_in_flight_per_connection = n;
        self
    }

    /// Attachments one call may carry, and their total bytes (64 and 16 KiB by default); a call
    /// over either is answered 500 without running, and a connection that keeps sending such
    /// calls is closed (see [`rpc_transport::ABUSE_LIMIT`]). No frame holds more than 65 536
    /// entries of one field (a frame with more is malformed, and its connection is closed), so
    /// a count above that takes no more.
    pub fn max_attachments(mut self, count: usize, bytes: usize) -> Self {
        self.options.max_attachments = count;
        self.options.max_attachment_bytes = bytes;
        self
    }

    /// Bytes of answers one connection may have queued and unwritten (1 MiB by default): above
    /// it, as with a client that does not read its answers, the server takes no more calls from
    /// that connection until they are written.
    pub fn max_unsent_bytes(mut self, n: usize) -> Self {
        self.options.max_unsent_bytes = n;
        self
    }

    /// Calls one connection may start per second (bursts of a tenth of that); above it the
    /// server stops reading the connection until the rate allows the next call. Off by default;
    /// 0 turns it off, as it does the other rate limits.
    pub fn max_calls_per_second_per_connection(mut self, n: u32) -> Self {
        self.options.max_calls_per_second_per_connection = (n > 0).then_some(n);
        self
    }

    /// Bytes that the read buffers of large frames (above a connection's own 64 KiB) may hold
    /// at once over all connections (64 MiB by default, never less than one maximal frame): a
    /// frame that would need more than is left waits unread, so TCP pushes back on its peer.
    /// Frames before the handshake are limited to [`rpc_transport::MAX_HELLO_FRAME`] bytes.
    pub fn max_read_buffer_bytes(mut self, n: usize) -> Self {
        self.options.max_read_buffer_bytes = n;
        self
    }

    /// Bytes that running calls' compressed arguments may hold beyond their size on the wire,
    /// over all connections (256 MiB by default, never less than one maximal frame): a few
    /// hundred bytes of zstd can expand to a whole frame, so without it a client could make the
    /// server hold its frame limit times its in-flight limit for almost nothing sent. A
    /// compressed call beyond what is left is answered Overflow (515) without running; plain
    /// arguments take nothing from it.
    pub fn max_decompressed_bytes(mut self, n: usize) -> Self {
        self.options.max_decompressed_bytes = n;
        self
    }

    /// Polls each call's handler once on the connection's reader before giving it a task of its
    /// own (off by default). A handler that answers in that poll then costs no task, which
    /// saves about a microsecond per call (RELIABILITY.md has the figures).
    ///
    /// Only for services whose handlers never block and never compute for long before their
    /// first `.await`: while such a handler runs on the reader, every other call, `Cancel` and
    /// `Ping` on its connection waits. Without this option a blocking handler stalls only its
    /// own task.
    pub fn inline_first_poll(mut self, yes: bool) -> Self {
        self.options.inline_first_poll = yes;
        self
    }

    /// Items per stream the server buffers of a client's request stream before it grants
    /// more (512 by default).
    pub fn stream_window(mut self, items: u32) -> Self {
        self.options.stream_window = items.max(1);
        self
    }

    /// Serves every connection over TLS (feature `tls`): the server presents the certificate
    /// chain of `tls` and, when it requires client certificates, refuses clients without one
    /// signed by its client CA. The TLS handshake counts within the handshake timeout.
    #[cfg(feature = "tls")]
    pub fn tls(mut self, tls: rpc_transport::tls::ServerTls) -> Self {
        self.options.tls = Some(tls);
        self
    }

    /// Connections held at once (10 000 by default).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.options.max_connections = n;
        self
    }

    /// The address published to the registry, when it differs from the bound one. A server
    /// with a registry that listens on an unspecified address (`0.0.0.0`, `[::]`) needs it:
    /// `serve` refuses to publish an address no client can dial, this one included (it must be
    /// `host:port` with a host other than `0.0.0.0` or `[::]`, or `unix:/path`).
    pub fn advertise(mut self, addr: impl Into<String>) -> Self {
        self.advertise = Some(addr.into());
        self
    }

    /// The id the instance is published under (its address by default). A stable id, such as
    /// a shard's name, lets clients that key their hash ring by it (`RingKey::InstanceId`)
    /// keep sending the shard its keys when it restarts on another port. Two running servers
    /// must not share an id: the registry keeps one instance per id.
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = Some(id.into());
        self
    }

    /// Adds metadata (version, weight, ...) to the published instance.
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.push((key.into(), value.into()));
        self
    }

    /// Governance events of this server (overflow, fallback): `events().subscribe()`.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// The OpenTelemetry meter of the server's metrics (feature `otel`); by default
    /// `opentelemetry::global::meter("rpc")`, taken when the server starts, so install the
    /// global meter provider first.
    ///
    /// Instruments: `rpc.server.duration` (histogram, ms), `rpc.server.calls` (counter, by
    /// `rpc.status_code`; overflow rejections included), `rpc.server.in_flight` (up-down
    /// counter) and `rpc.governance.events` (counter, by `event` and `rpc.entry_id`,
    /// `rpc.side = "server"`; overflow rejections are its `event = "overflow"`).
    #[cfg(feature = "otel")]
    pub fn meter(mut self, meter: opentelemetry::metrics::Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// Follows the governance rules of `source` (the etcd `RuleStore`, for instance): each
    /// valid new version changes the entries' server options (cap, rate limits, adaptive
    /// limit, observe modes) from their next call, above their `#[governance]` attributes; an
    /// invalid one is refused (event `rule_rejected`, a warning) and the last good version
    /// stays in force. [`ServerHandle::rules_version`] says which version is in force.
    ///
    /// `serve` reads the rules before it serves the first call or publishes the instance, so
    /// the version in the store is in force from the start. A source that cannot be reached
    /// then (after its own request timeout, or 10 s when it gives no answer) does not stop
    /// the server: it serves without the rules, with a warning, and applies them once the
    /// source answers.
    pub fn rules(mut self, source: impl rpc_registry::RuleSource) -> Self {
        self.rules = Some(Arc::new(source));
        self
    }

    fn defaults(&self) -> ServerDefaults {
        ServerDefaults {
            adaptive: self.adaptive,
            rate_limit: self.rate_limit,
            caller_rate_limit: self.caller_rate_limit,
        }
    }

    /// The dispatcher of a server bound to `local` and published as `address`.
    pub(crate) fn dispatcher(
        &self,
        local: SocketAddr,
        address: &str,
        shared: &Bulkhead,
    ) -> Dispatcher {
        #[cfg(feature = "otel")]
        let metrics = crate::telemetry::Metrics::new(
            &self
                .meter
                .clone()
                .unwrap_or_else(|| opentelemetry::global::meter("rpc")),
            &self.events,
        );
        #[cfg(not(feature = "otel"))]
        let metrics = crate::telemetry::Metrics;
        let endpoint: Arc<str> = Arc::from(address);
        Dispatcher {
            routes: self.routes(&endpoint, shared),
            events: self.events.clone(),
            calls: self.calls.clone(),
            local,
            metrics,
            send_panic_text: self.send_panic_text,
            inline_first_poll: self.options.inline_first_poll,
        }
    }

    fn routes(
        &self,
        endpoint: &Arc<str>,
        shared: &Bulkhead,
    ) -> HashMap<Box<[u8]>, Route, ahash::RandomState> {
        let defaults = self.defaults();
        let layers: Arc<[Arc<dyn ServerLayer>]> = self.layers.iter().cloned().collect();
        let mut routes = HashMap::default();
        for service in &self.services {
            let fallback = self.fallbacks.get(service.service_id()).cloned();
            for (index, m) in service.methods().iter().enumerate() {
                let admission = Arc::new(Admission::new(
                    admission(&m.governance, shared, &defaults, None),
                    self.events.clone(),
                ));
                let (algorithm, threshold) = compression(&m.governance);
                admission.set_compression(algorithm, threshold);
                let entry: Arc<str> = Arc::from(m.entry_id);
                // The fallback's own method of this entry, by id: its method numbers are its
                // own (another version of the service, or one covering a few entries), and a
                // fallback without the entry does not run for it, as on the client.
                let fallback = fallback.as_ref().and_then(|service| {
                    let index = service
                        .methods()
                        .iter()
                        .position(|f| f.entry_id == m.entry_id)?;
                    Some(Arc::new(FallbackTo {
                        service: service.clone(),
                        index,
                        events: self.events.clone(),
                        entry_id: entry.clone(),
                        endpoint: endpoint.clone(),
                        send_panic_text: self.send_panic_text,
                    }))
                });
                let layered = (!layers.is_empty()).then(|| {
                    Arc::new(Layered {
                        layers: layers.clone(),
                        end: Terminal {
                            service: service.clone(),
                            index,
                            entry: entry.clone(),
                            admission: admission.clone(),
                            fallback: fallback.clone(),
                            events: self.events.clone(),
                            send_panic_text: self.send_panic_text,
                        },
                    })
                });
                routes.insert(
                    m.entry_id.as_bytes().into(),
                    Route {
                        service: service.clone(),
                        index,
                        method: m,
                        entry,
                        admission,
                        fallback,
                        layered,
                        stream: service.stream_mode(index),
                    },
                );
            }
        }
        routes
    }

    /// Binds `addr` (port 0 picks a free port), publishes the instance and starts serving.
    /// `addr` is `host:port` (or a `SocketAddr`, or `(host, port)`), or `unix:/path/to.sock`
    /// for a Unix domain socket, which is published as `unix:/path/to.sock` and which clients
    /// dial as any other address. A failure to bind names the address (in use, not permitted,
    /// not local). A configuration that would serve nobody is refused with
    /// [`InvalidInput`](std::io::ErrorKind::InvalidInput) before anything is served: an empty
    /// token, a service added twice, a limit of 0 (`max_in_flight_per_connection`,
    /// `max_connections`, `max_frame_length`, `handshake_timeout`). (A `max_concurrency` of 0
    /// is taken: a server answering every call Overflow, which clients then send elsewhere.)
    pub async fn serve(self, addr: impl Into<ListenAddr>) -> std::io::Result<ServerHandle> {
        let addr = addr.into();
        match rpc_transport::Address::parse(&addr.0) {
            rpc_transport::Address::Tcp(tcp) => {
                let listener = bind(tcp).await?;
                self.serve_listener(listener).await
            }
            #[cfg(unix)]
            rpc_transport::Address::Unix(path) => {
                let listener = bind_unix(path)?;
                self.serve_on(listener).await
            }
            #[cfg(not(unix))]
            rpc_transport::Address::Unix(_) => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                format!("cannot listen on {}: Unix domain sockets are not available on this platform; use host:port", addr.0),
            )),
        }
    }

    /// Serves on an already bound listener.
    pub async fn serve_listener(self, listener: TcpListener) -> std::io::Result<ServerHandle> {
        self.serve_on(listener).await
    }

    /// A limit set so that the server would serve nobody (every client refused, or every call
    /// refused with the connection then no longer read), said as the reason to refuse to
    /// start: a typo or a unit mix-up, not a way to run a server.
    fn unusable_limit(&self) -> Option<String> {
        let o = &self.options;
        let zero = [
            (
                o.max_in_flight_per_connection == 0,
                "max_in_flight_per_connection is 0: every call would be answered Overflow (515)",
            ),
            (
                o.max_connections == 0,
                "max_connections is 0: every client would be refused",
            ),
            (
                o.max_frame_length == 0,
                "max_frame_length is 0: no frame, not even a client's Hello, would be taken",
            ),
            (
                o.handshake_timeout.is_zero(),
                "handshake_timeout is 0: every client would be closed before its Hello",
            ),
        ];
        zero.iter()
            .find(|(is, _)| *is)
            .map(|(_, what)| format!("{what}; give it a value above 0"))
    }

    /// Why the server's token could never be admitted, if so: a client's `Hello` carries it
    /// beside a client id of up to [`MAX_CLIENT_ID`](rpc_transport::MAX_CLIENT_ID) bytes and a
    /// few small fields, in a frame of at most the handshake's limit (`max_frame_length`, and
    /// [`MAX_HELLO_FRAME`](rpc_transport::MAX_HELLO_FRAME) before the handshake). A longer token
    /// would have every client holding it refused.
    fn token_too_long(&self) -> Option<String> {
        /// What a `Hello` takes beside its token and client id: its other fields, their tags
        /// and lengths.
        const HELLO_OVERHEAD: usize = 64;
        let token = self.options.token.as_deref()?;
        let limit = self
            .options
            .max_frame_length
            .min(rpc_transport::MAX_HELLO_FRAME);
        let room = limit.saturating_sub(rpc_transport::MAX_CLIENT_ID + HELLO_OVERHEAD);
        (token.len() > room).then(|| {
            format!(
                "the server's token of {} bytes does not fit in a client's Hello: the \
                 handshake's frames are at most {limit} bytes (max_frame_length, and {} before \
                 the handshake), with room for a client id of up to {} bytes; give a token of at \
                 most {room} bytes",
                token.len(),
                rpc_transport::MAX_HELLO_FRAME,
                rpc_transport::MAX_CLIENT_ID
            )
        })
    }

    /// Serves on an already bound listener of any transport (TCP, a Unix domain socket, or
    /// another [`Listener`]).
    pub async fn serve_on<L: Listener>(self, listener: L) -> std::io::Result<ServerHandle> {
        if self.options.token.as_deref() == Some("") {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the server's token is empty, and a client that sends no token sends the empty \
                 one: give a non-empty token, or none to admit clients without one",
            ));
        }
        if let Some(problem) = self.token_too_long() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                problem,
            ));
        }
        if let Some(problem) = self.unusable_limit() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                problem,
            ));
        }
        if let Some(problem) = self.advertise.as_deref().and_then(undialable) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                problem,
            ));
        }
        let mut ids: Vec<&str> = self.services.iter().map(|s| s.service_id()).collect();
        ids.sort_unstable();
        if let Some(twice) = ids.windows(2).find(|w| w[0] == w[1]) {
            // The later would take every entry of the earlier, silently.
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the service {} is added twice (add_service): a server serves each service \
                     once; add one implementation of it",
                    twice[0]
                ),
            ));
        }
        let bound = listener.local_addr()?;
        if let Some(any) = bound.tcp().filter(|a| a.ip().is_unspecified()) {
            if self.registry.is_some() && self.advertise.is_none() {
                // Published as is, clients on other hosts would dial their own host, and every
                // instance bound so on the same port would share one id in the registry,
                // each taking the others' place.
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "the server listens on {any}, an address no client can dial, and would \
                         publish it to the registry: give the address clients reach it at with \
                         ServerBuilder::advertise (for example the pod's or host's IP and port \
                         {}), or listen on that address",
                        any.port()
                    ),
                ));
            }
        }
        // Layers that take a socket address get the unspecified one for a Unix socket.
        let local_addr = bound
            .tcp()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let address = self.advertise.clone().unwrap_or_else(|| bound.to_string());
        // The cap of entries that set none, shared by them.
        let shared = Bulkhead::new(self.max_concurrency);
        let dispatcher = Arc::new(self.dispatcher(local_addr, &address, &shared));
        let rules = self.rules.clone().map(|source| {
            crate::rules::follow(
                source,
                &dispatcher,
                shared.clone(),
                self.defaults(),
                self.events.clone(),
            )
        });
        if let Some(rules) = &rules {
            // The rules in the store are in force before the first call is read, and so
            // before the instance is announced: calls would otherwise run under the options
            // the rules replace (a cap, a rate limit) until the first read lands. A source
            // that does not answer (a `RuleSource` need not bound its reads) holds the server
            // up no longer than `FIRST_READ_LIMIT`.
            let read = rules.in_force.first_read();
            let limit = rpc_registry::rules::FIRST_READ_LIMIT;
            if tokio::time::timeout(limit, read).await.is_err() {
                tracing::warn!(
                    target: "rpc::rules",
                    "the rules were not read within {limit:?}: serving without \
                     them; they apply once the rule source answers"
                );
            }
        }
        let shutdown = CancellationToken::new();
        // Until the handle exists, nothing else can stop the server: should this future be
        // dropped (a timeout around a slow registration), it stops serving.
        let stop_if_given_up = shutdown.clone().drop_guard();
        let task = tokio::spawn(rpc_transport::serve(
            listener,
            dispatcher,
            self.options.clone(),
            shutdown.clone(),
        ));
        let mut instance = Instance::new(address, self.services.iter().map(|s| s.service_id()));
        instance.entries = self
            .services
            .iter()
            .flat_map(|s| s.methods().iter().map(ServiceEntry::from))
            .collect();
        instance.metadata.extend(self.metadata.iter().cloned());
        if let Some(id) = &self.instance_id {
            instance.id = id.clone();
        }
        let mut ticket = None;
        if let Some(registry) = &self.registry {
            // Taken before the registration: from its first write on, no older server of this
            // process that is stopping removes the id (see `crate::registration`).
            // The id's turn, until the registry answers: a removal of the id decided before
            // (an older server of this process stopping) lands first.
            let lock = crate::registration::id_lock(registry, &instance.id);
            let _turn = lock.clone().lock_owned().await;
            let publication = Arc::new(crate::registration::Ticket::take(
                registry,
                &instance.id,
                lock,
            ));
            // Given up while it registers (a timeout around a slow registry), the registry
            // may have taken the instance all the same: it is removed again.
            let unpublish_if_given_up = Unpublish {
                registry: Some(registry.clone()),
                id: instance.id.clone(),
                ticket: publication.clone(),
                runtime: tokio::runtime::Handle::try_current().ok(),
            };
            let registered = registry.register(instance.clone()).await;
            unpublish_if_given_up.disarm();
            if let Err(e) = registered {
                shutdown.cancel();
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    // An older server of this process, stopping, may have left the id to this
                    // one: removed unless a publication of the process holds it (see
                    // `spawn_deregister`).
                    spawn_deregister(
                        &runtime,
                        registry.clone(),
                        (instance.id.clone(), publication),
                        Release::Unregistered,
                    );
                }
                return Err(std::io::Error::other(format!(
                    "could not publish {} to the registry: {e}",
                    instance.address
                )));
            }
            ticket = Some(publication);
        }
        stop_if_given_up.disarm();
        tracing::info!(address = %bound, services = ?instance.services, "serving");
        let status = ServerStatus(Arc::new(StatusInner {
            registered: AtomicBool::new(self.registry.is_some()),
            has_registry: self.registry.is_some(),
            draining: AtomicBool::new(false),
            instance_id: instance.id.clone(),
            instance,
            events: self.events.clone(),
            calls: self.calls.clone(),
            rules: rules.as_ref().map(|r| r.in_force.clone()),
        }));
        Ok(ServerHandle {
            events: self.events.clone(),
            local_addr,
            bound,
            shutdown,
            task: Some(task),
            registry: self.registry,
            ticket,
            runtime: tokio::runtime::Handle::try_current().ok(),
            instance_id: status.0.instance_id.clone(),
            rules,
            status,
        })
    }
}

/// Removes an instance from its registry when dropped armed, in a task of its own: a `serve`
/// given up while it registered. (Registries that remove only what they recorded as written,
/// etcd and ZooKeeper, leave a write that landed unrecorded to its lease or session.)
struct Unpublish {
    registry: Option<Arc<dyn Registry>>,
    id: String,
    ticket: Arc<crate::registration::Ticket>,
    /// The runtime `serve` ran on, where the removal runs (the future may be dropped on a
    /// thread outside it).
    runtime: Option<tokio::runtime::Handle>,
}

impl Unpublish {
    fn disarm(mut self) {
        self.registry = None;
    }
}

impl Drop for Unpublish {
    fn drop(&mut self) {
        let (Some(registry), Some(runtime)) = (self.registry.take(), self.runtime.take()) else {
            return;
        };
        let id = std::mem::take(&mut self.id);
        let publication = (id, self.ticket.clone());
        spawn_deregister(&runtime, registry, publication, Release::GivenUp);
    }
}

/// How a publication that never served ends (see [`spawn_deregister`]).
#[derive(Clone, Copy)]
enum Release {
    /// Given up while it registered: the registry may have taken the instance.
    GivenUp,
    /// Its registration failed: an older publication may have left the id to it.
    Unregistered,
}

/// Removes the instance `id` of a publication (`ticket`) that never served from `registry`,
/// in a task of its own on `runtime`, when its release (`how`) says to. The ticket is
/// released in that task, just before the removal, not before: a publication of the id this
/// process took meanwhile (a `serve` tried again at once) then holds it and keeps it, where a
/// removal decided earlier unpublished it for good, registries removing by id. (Another
/// server of the process serving under the id, a restart under a stable id whose new `serve`
/// was given up, keeps it too: the registry put its registration back.)
fn spawn_deregister(
    runtime: &tokio::runtime::Handle,
    registry: Arc<dyn Registry>,
    (id, ticket): (String, Arc<crate::registration::Ticket>),
    how: Release,
) {
    runtime.spawn(async move {
        let _turn = ticket.turn().await;
        let (remove, why) = match how {
            Release::GivenUp => (ticket.release_given_up(), "given up while it registered"),
            Release::Unregistered => (ticket.release_unregistered(), "left to it"),
        };
        if !remove {
            return;
        }
        if let Err(e) = registry.deregister(&id).await {
            tracing::warn!(error = %e, why, "could not remove a server that never served");
        }
    });
}

/// A running server. Dropping it starts a graceful shutdown without waiting for it: the
/// instance is deregistered (in a task of its own, within a tokio runtime), then the server
/// stops accepting and drains its connections.
pub struct ServerHandle {
    events: EventBus,
    local_addr: SocketAddr,
    bound: PeerAddr,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
    registry: Option<Arc<dyn Registry>>,
    /// Its publication of `instance_id` (see [`crate::registration`]).
    ticket: Option<Arc<crate::registration::Ticket>>,
    /// The runtime it serves on, where a drop deregisters it.
    runtime: Option<tokio::runtime::Handle>,
    instance_id: String,
    rules: Option<crate::rules::Following>,
    status: ServerStatus,
}

/// What an operator's tool reads about a running server, while the [`ServerHandle`] stays
/// with the program that stops it: whether it is published and whether it is draining, what
/// it published, its events and its calls. Cheap to clone; from [`ServerHandle::status`].
#[derive(Clone)]
pub struct ServerStatus(Arc<StatusInner>);

struct StatusInner {
    registered: AtomicBool,
    has_registry: bool,
    draining: AtomicBool,
    instance_id: String,
    instance: Instance,
    events: EventBus,
    calls: CallObservers,
    rules: Option<Arc<rpc_registry::rules::RulesInForce>>,
}

impl std::fmt::Debug for ServerStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerStatus")
            .field("instance", &self.0.instance_id)
            .field("registered", &self.is_registered())
            .field("draining", &self.is_draining())
            .finish()
    }
}

impl ServerStatus {
    /// Whether the instance is published in a registry now: from a successful start until
    /// [`ServerHandle::shutdown`] (or the handle's drop) deregisters it. A deregistration that
    /// failed (the registry unreachable) leaves it `true` for good: the instance may stay
    /// published until its lease or session ends, which is not followed past the shutdown.
    /// `false` for a server without a registry.
    pub fn is_registered(&self) -> bool {
        self.0.registered.load(Ordering::Acquire)
    }

    /// Whether the server was given a registry to publish to.
    pub fn has_registry(&self) -> bool {
        self.0.has_registry
    }

    /// Whether the server is stopping (shutdown, abort or its handle dropped): it takes no
    /// new connections and tells clients to go elsewhere.
    pub fn is_draining(&self) -> bool {
        self.0.draining.load(Ordering::Acquire)
    }

    /// The instance as the server publishes it: address, id, services, entries with their
    /// declared governance, metadata.
    pub fn instance(&self) -> &Instance {
        &self.0.instance
    }

    /// The server's governance events (overflow, rate limits, fallback).
    pub fn events(&self) -> &EventBus {
        &self.0.events
    }

    /// Tells `observer` of every call the server handles from now on, as it ends (refusals at
    /// the entry's admission included). While no observer is attached a call reads no clock
    /// for it.
    pub fn observe_calls(&self, observer: Arc<dyn CallObserver>) {
        self.0.calls.add(observer);
    }

    /// Stops telling `observer` (the `Arc` given to [`observe_calls`](Self::observe_calls)) of
    /// calls.
    pub fn unobserve_calls(&self, observer: &Arc<dyn CallObserver>) {
        self.0.calls.remove(observer);
    }

    /// The version of the rules of `kind` in force on this server (see
    /// [`ServerBuilder::rules`]), if one was applied.
    pub fn rules_version(&self, kind: rpc_registry::RuleKind) -> Option<i64> {
        self.0.rules.as_ref().and_then(|r| r.version(kind))
    }

    fn draining(&self) {
        self.0.draining.store(true, Ordering::Release);
    }
}

impl ServerHandle {
    /// The version of the rules of `kind` in force on this server (see
    /// [`ServerBuilder::rules`]), if one was applied.
    pub fn rules_version(&self, kind: rpc_registry::RuleKind) -> Option<i64> {
        self.rules.as_ref().and_then(|r| r.in_force.version(kind))
    }

    /// The bound TCP address; for a server on a Unix domain socket, `0.0.0.0:0` (see
    /// [`address`](Self::address)).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The bound address as clients dial it: `127.0.0.1:9001` or `unix:/run/app.sock`.
    pub fn address(&self) -> &PeerAddr {
        &self.bound
    }

    /// Governance events of this server (overflow, fallback): `events().subscribe()`.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// The id under which the instance is published.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// Registration, draining, the published instance, events and call observers, in a handle
    /// an admin endpoint can keep while this one stays with the program.
    pub fn status(&self) -> ServerStatus {
        self.status.clone()
    }

    /// Stops gracefully: deregisters the instance first (so clients stop choosing it), then
    /// stops accepting, sends `GoAway` on every connection and waits for calls in flight, up to
    /// the drain timeout.
    pub async fn shutdown(mut self) {
        self.unpublish().await;
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// The first step of [`shutdown`](Self::shutdown): draining from now, and deregistered.
    async fn unpublish(&mut self) {
        self.status.draining();
        // Kept in the handle until deregistered: a shutdown given up while it deregisters (a
        // timeout around it) leaves the handle's drop to try again.
        if let Some(registry) = self.registry.clone() {
            let mut still_published = false;
            let _turn = match &self.ticket {
                Some(t) => Some(t.turn().await),
                None => None,
            };
            if self.ticket.as_ref().is_none_or(|t| t.should_deregister()) {
                if let Err(e) = registry.deregister(&self.instance_id).await {
                    tracing::warn!(error = %e, "could not deregister before shutdown");
                    still_published = true;
                }
            }
            if let Some(t) = &self.ticket {
                t.release();
            }
            self.registry = None;
            if !still_published {
                self.status.0.registered.store(false, Ordering::Release);
            }
        }
    }

    /// Serves until the process is asked to stop (SIGINT, i.e. Ctrl-C, or SIGTERM, what
    /// `kill`, systemd and Kubernetes send), then [`shutdown`](Self::shutdown)s gracefully:
    /// deregisters the instance, sends `GoAway`, lets the calls in flight finish (up to the
    /// drain timeout) and returns. A second signal during the drain stops at once, dropping
    /// the calls still running. What a service's `main` ends with:
    ///
    /// ```no_run
    /// # async fn f(server: rpc_server::ServerHandle) -> std::io::Result<()> {
    /// server.serve_until_signal().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// The signal handlers are installed when this is called, not when the future is first
    /// polled, so a signal arriving right after the call is not missed (and does not kill the
    /// process). Fails only when they cannot be installed. Must be called within a tokio
    /// runtime.
    pub fn serve_until_signal(
        self,
    ) -> impl std::future::Future<Output = std::io::Result<()>> + Send + 'static {
        let signals = StopSignals::install();
        async move {
            let mut signals = signals?;
            let which = signals.recv().await;
            tracing::info!(signal = which, instance = %self.instance_id, "stopping gracefully");
            // Deregistered first, whatever comes: stopping before that would leave the
            // instance published with nothing behind it.
            let mut server = self;
            server.unpublish().await;
            // A second signal while draining stops at once, as an operator pressing Ctrl-C
            // again expects: the handlers stay installed, so without this it would do nothing
            // and only SIGKILL would end the drain.
            let serving = server
                .task
                .as_ref()
                .map(tokio::task::JoinHandle::abort_handle);
            let instance = server.instance_id.clone();
            tokio::select! {
                () = server.shutdown() => {}
                again = signals.recv() => {
                    tracing::warn!(
                        signal = again,
                        %instance,
                        "stopping at once: the calls still running are dropped"
                    );
                    if let Some(serving) = serving {
                        serving.abort();
                    }
                }
            }
            Ok(())
        }
    }

    /// Stops at once: connections are closed and calls in flight are dropped, as if the process
    /// died (the registry entry stays, as it would after a crash). For failure tests.
    pub fn abort(mut self) {
        // (Not deregistered, not even by the drop that follows.)
        self.registry = None;
        self.status.draining();
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.shutdown.cancel();
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.status.draining();
        // Dropped without `shutdown` (an early return, a test's end): deregister first, as
        // `shutdown` does, so clients stop choosing the instance before it stops accepting.
        // On the runtime the server serves on, which may not be the dropping thread's.
        if let (Some(registry), Some(runtime)) = (self.registry.take(), self.runtime.clone()) {
            let (id, status) = (self.instance_id.clone(), self.status.clone());
            let shutdown = self.shutdown.clone();
            let ticket = self.ticket.clone();
            runtime.spawn(async move {
                // Not when a later server of this process published the same id meanwhile.
                let mut still_published = false;
                let _turn = match &ticket {
                    Some(t) => Some(t.turn().await),
                    None => None,
                };
                if ticket.as_ref().is_none_or(|t| t.should_deregister()) {
                    if let Err(e) = registry.deregister(&id).await {
                        tracing::warn!(error = %e, "could not deregister the dropped server");
                        still_published = true;
                    }
                }
                if let Some(t) = ticket {
                    t.release();
                }
                if !still_published {
                    status.0.registered.store(false, Ordering::Release);
                }
                shutdown.cancel();
            });
            return;
        }
        self.shutdown.cancel();
    }
}

/// Where a server listens: `host:port` (a `&str`, a `String`, a `SocketAddr`, or a
/// `(host, port)` pair), or `unix:/path/to.sock` for a Unix domain socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenAddr(String);

impl From<&str> for ListenAddr {
    fn from(a: &str) -> Self {
        ListenAddr(a.to_string())
    }
}

impl From<String> for ListenAddr {
    fn from(a: String) -> Self {
        ListenAddr(a)
    }
}

impl From<&String> for ListenAddr {
    fn from(a: &String) -> Self {
        ListenAddr(a.clone())
    }
}

impl From<SocketAddr> for ListenAddr {
    fn from(a: SocketAddr) -> Self {
        ListenAddr(a.to_string())
    }
}

impl From<(std::net::IpAddr, u16)> for ListenAddr {
    fn from((ip, port): (std::net::IpAddr, u16)) -> Self {
        SocketAddr::from((ip, port)).into()
    }
}

impl From<(std::net::Ipv4Addr, u16)> for ListenAddr {
    fn from((ip, port): (std::net::Ipv4Addr, u16)) -> Self {
        SocketAddr::from((ip, port)).into()
    }
}

impl From<(&str, u16)> for ListenAddr {
    fn from((host, port): (&str, u16)) -> Self {
        if host.contains(':') {
            ListenAddr(format!("[{host}]:{port}"))
        } else {
            ListenAddr(format!("{host}:{port}"))
        }
    }
}

/// Binds a Unix domain socket at `path`; the error says which path and what to do.
#[cfg(unix)]
fn bind_unix(path: &std::path::Path) -> std::io::Result<rpc_transport::UnixListener> {
    rpc_transport::UnixListener::bind(path).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                "a file exists at that path: if no server uses it any more, remove it"
            }
            std::io::ErrorKind::NotFound => "its directory does not exist: create it first",
            std::io::ErrorKind::PermissionDenied => {
                "this process may not create files there: choose a directory it owns"
            }
            _ => "check the path (at most about 100 bytes long)",
        };
        std::io::Error::new(
            e.kind(),
            format!("cannot listen on unix:{}: {e}; {hint}", path.display()),
        )
    })
}

/// Binds a listener on `addr`; the error says which address could not be bound and why.
async fn bind(addr: impl ToSocketAddrs) -> std::io::Result<TcpListener> {
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot resolve the address to listen on: {e}"),
            )
        })?
        .collect();
    TcpListener::bind(&addrs[..]).await.map_err(|e| {
        let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                "another process listens there: stop it, or choose another port (0 picks a free one)"
            }
            std::io::ErrorKind::PermissionDenied => {
                "ports below 1024 need privileges: choose a port above 1023"
            }
            std::io::ErrorKind::AddrNotAvailable => {
                "the address is not one of this host's: listen on 0.0.0.0 or a local address"
            }
            _ => "check the address",
        };
        std::io::Error::new(
            e.kind(),
            format!("cannot listen on {}: {e}; {hint}", list.join(", ")),
        )
    })
}

/// The signals that ask a server to stop, listened to from the moment they are installed.
struct StopSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(StopSignals {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(StopSignals {})
    }

    /// Waits for the next stop signal and names it.
    async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.interrupt.recv() => "SIGINT",
                _ = self.terminate.recv() => "SIGTERM",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = &mut self;
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// Why clients could not dial `advertised`, if they could not: it is not `host:port` (a port
/// forgotten, two addresses run together) nor `unix:/path`, or its host is unspecified.
fn undialable(advertised: &str) -> Option<String> {
    let unix = advertised
        .strip_prefix("unix:")
        .is_some_and(|path| !path.is_empty());
    let unspecified = advertised
        .parse::<SocketAddr>()
        .is_ok_and(|a| a.ip().is_unspecified());
    if unix || (rpc_core::address::is_host_port(advertised) && !unspecified) {
        return None;
    }
    Some(format!(
        "advertise: {advertised:?} is not an address clients can dial: give host:port (a host \
         other than 0.0.0.0 or [::], and a port from 1), or unix:/path"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entrys_own_burst_applies_under_the_servers_rate() {
        let server = ServerDefaults {
            adaptive: false,
            rate_limit: Some((50, 10)),
            caller_rate_limit: Some((5, 2)),
        };
        let own_bursts = rpc_core::GovernanceOverrides {
            rate_limit_burst: Some(100),
            caller_rate_limit_burst: Some(7),
            ..rpc_core::GovernanceOverrides::NONE
        };
        let policy = admission(&own_bursts, &Bulkhead::new(10), &server, None);
        let limits = policy.limiter.expect("limited").limits();
        assert_eq!(limits.entry, Some((50.0, 100)));
        assert_eq!(limits.per_caller, Some((5.0, 7)));
        let policy = admission(
            &rpc_core::GovernanceOverrides::NONE,
            &Bulkhead::new(10),
            &server,
            None,
        );
        let limits = policy.limiter.expect("limited").limits();
        assert_eq!(
            limits.entry,
            Some((50.0, 10)),
            "the server's burst otherwise"
        );
    }

    #[test]
    fn a_per_connection_call_rate_of_0_is_off() {
        let b = Server::builder().max_calls_per_second_per_connection(0);
        assert_eq!(b.options.max_calls_per_second_per_connection, None);
        let b = b.max_calls_per_second_per_connection(5);
        assert_eq!(b.options.max_calls_per_second_per_connection, Some(5));
    }
}
