//! The client: entry pipelines, endpoint selection, remote execution under governance.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use futures_util::future::Either;
use rpc_core::wire::RemoteResultMessage;
use rpc_core::{
    Codec, Compression, GovernanceOptions, GovernanceOverrides, MethodDescriptor, RpcError,
    Service, ShuntStrategy, StatusCode,
};
use rpc_governance::breaker::BreakerState;
use rpc_governance::calls::{CallObserver, CallObservers};
use rpc_governance::config::{GovernanceConfig, Layers};
use rpc_governance::engine::{EntryOptions, Governance};
use rpc_governance::events::{EventBus, EventKind};
use rpc_governance::load::{EndpointLoad, ServerLoad};
use rpc_governance::routing::RoutingRules;
use rpc_governance::stack::{
    self, Balance, CallCx, ClientParts, Fallbacks, Middleware, Service as _,
};
use rpc_registry::{InProcessRegistry, Registry, ServiceWatch};
use rpc_transport::compression::{self, Accepted};
use rpc_transport::{Call, ConnectOptions, ConnectionPool};
use tokio::time::Instant;
use tracing::Instrument;

use crate::balance::ring::RingKey;
use crate::balance::routing::Router;
use crate::balance::{Picker, ServiceState};
use crate::status::{EndpointStatus, FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL};
use crate::telemetry;

/// Calls remote services. Cheap to clone; clones share connections, endpoint views, entry
/// pipelines and their state.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
    /// Options this handle's calls apply above every other level
    /// ([`with_options`](Client::with_options)).
    pub(crate) call_options: Option<Arc<GovernanceOverrides>>,
}

pub(crate) struct Inner {
    /// What is wrong with the options the builder was given in code, if anything: every call
    /// fails with it (`build` cannot fail).
    misconfigured: Option<RpcError>,
    registry: Arc<dyn Registry>,
    pool: ConnectionPool,
    pub(crate) codec: Codec,
    pub(crate) governance: Governance,
    services: DashMap<&'static str, Arc<ServiceState>, ahash::RandomState>,
    /// The states of the first services called, by the address and length of their
    /// `'static` id: every call looks its service up, and a slot read is one load and a
    /// compare where the map hashes the id and takes a shard lock. A slot is set once; a
    /// service's state is never replaced or removed, so it cannot go stale.
    fast_services: [OnceLock<ServiceSlot>; FAST_SLOTS],
    pub(crate) fallbacks: Fallbacks,
    /// User layers around each call, outermost first.
    pub(crate) layers: Vec<Arc<dyn Middleware>>,
    /// User layers around each attempt, outermost first.
    pub(crate) attempt_layers: Vec<Arc<dyn Middleware>>,
    pub(crate) metrics: telemetry::Metrics,
    /// Where the gauges' callbacks find the client while it lives (emptied as it drops).
    #[cfg(feature = "otel")]
    gauge_slot: telemetry::GaugeSlot<Inner>,
    /// Told of every call as it ends ([`Client::observe_calls`]).
    pub(crate) calls: CallObservers,
    /// Removed endpoints a background task is probing.
    probing: Mutex<HashSet<String>>,
    /// The service state of appointed calls whose service is not known yet: no endpoint,
    /// made once.
    unlisted: OnceLock<Arc<ServiceState>>,
    ring_keys: RingKeys,
    /// The rule versions in force ([`ClientBuilder::rules`]).
    rules: Arc<rpc_registry::rules::RulesInForce>,
    /// The task following the rules, stopped with the client.
    rules_task: OnceLock<crate::rules::AbortOnDrop>,
    /// Where outlier ejections in observe mode (`outlier_observe`) go: a view of endpoint
    /// health no picker reads.
    observed_health: rpc_governance::health::EndpointHealth,
    /// The routing rules in force.
    routing: Router,
    /// The entry ids called by id ([`Client::invoke_json`]) that no instance publishes, at
    /// most [`MAX_UNPUBLISHED_ENTRIES`](crate::generic::MAX_UNPUBLISHED_ENTRIES).
    pub(crate) unpublished: Mutex<HashSet<String>>,
}

/// The most connections a client opens to one endpoint
/// ([`ClientBuilder::connections_per_endpoint`]): the pool makes a slot for each at once.
pub const MAX_CONNECTIONS_PER_ENDPOINT: usize = 1024;

/// What places instances on each service's hash ring.
#[derive(Default)]
struct RingKeys {
    default: RingKey,
    services: HashMap<String, RingKey>,
}

/// Builds a [`Client`].
pub struct ClientBuilder {
    registry: Option<Arc<dyn Registry>>,
    codec: Codec,
    connect: ConnectOptions,
    connections_per_endpoint: usize,
    layers: Layers,
    fallbacks: Fallbacks,
    middleware: Vec<Arc<dyn Middleware>>,
    attempt_middleware: Vec<Arc<dyn Middleware>>,
    ring_keys: RingKeys,
    rules: Option<Arc<dyn rpc_registry::RuleSource>>,
    routing: RoutingRules,
    #[cfg(feature = "otel")]
    meter: Option<opentelemetry::metrics::Meter>,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        ClientBuilder {
            registry: None,
            codec: Codec::MsgPack,
            connect: ConnectOptions::default(),
            connections_per_endpoint: 1,
            layers: Layers::default(),
            fallbacks: Fallbacks::default(),
            middleware: Vec::new(),
            attempt_middleware: Vec::new(),
            ring_keys: RingKeys::default(),
            rules: None,
            routing: RoutingRules::default(),
            #[cfg(feature = "otel")]
            meter: None,
        }
    }
}

impl ClientBuilder {
    /// Where endpoints come from. Without one, the client uses an empty in-process registry.
    pub fn registry(mut self, registry: impl Registry) -> Self {
        self.registry = Some(Arc::new(registry));
        self
    }

    /// Where endpoints come from, shared with other parts of the process.
    pub fn shared_registry(mut self, registry: Arc<dyn Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// The codec of parameters and results (MessagePack by default).
    pub fn codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// The token sent in every handshake.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.connect.token = Some(token.into());
        self
    }

    /// The name sent in every handshake.
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.connect.client_id = id.into();
        self
    }

    /// Limit on connecting plus the handshake (3 s by default).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect.connect_timeout = t;
        self
    }

    /// Pause between pings on a quiet connection (10 s by default); a connection from which
    /// nothing arrived for three of them is closed, unless the server was meanwhile taking calls
    /// queued in the client (see [`ConnectOptions::heartbeat_interval`](rpc_transport::ConnectOptions::heartbeat_interval)).
    /// Zero turns heartbeats off.
    pub fn heartbeat_interval(mut self, t: Duration) -> Self {
        self.connect.heartbeat_interval = t;
        self
    }

    /// Largest frame accepted from servers (16 MiB by default).
    pub fn max_frame_length(mut self, n: usize) -> Self {
        self.connect.max_frame_length = n;
        self
    }

    /// Connects to every server over TLS (feature `tls`), verifying each server's certificate
    /// against the roots of `tls` and presenting its client certificate when it has one. The
    /// TLS handshake counts within the connect timeout.
    #[cfg(feature = "tls")]
    pub fn tls(mut self, tls: rpc_transport::tls::ClientTls) -> Self {
        self.connect.tls = Some(tls);
        self
    }

    /// Items per stream the client buffers before it grants the server more (8192 by
    /// default, and at most 256 KiB of them, `ConnectOptions::stream_window_bytes`, with a
    /// server that keeps byte windows, as servers do by default): a stream whose consumer
    /// stops reading holds at most this many items, and the server's producer stops until it
    /// reads on. With a server that holds streams to items only, set a smaller window for
    /// large items. At most [`MAX_STREAM_WINDOW`](rpc_transport::MAX_STREAM_WINDOW) (65 536),
    /// the largest window a server takes: a larger one counts as that.
    pub fn stream_window(mut self, items: u32) -> Self {
        self.connect.stream_window = items.clamp(1, rpc_transport::MAX_STREAM_WINDOW);
        self
    }

    /// Connections opened to each endpoint and used in turn (1 by default), at most
    /// [`MAX_CONNECTIONS_PER_ENDPOINT`] (1024): a larger number counts as that.
    pub fn connections_per_endpoint(mut self, n: usize) -> Self {
        self.connections_per_endpoint = n.clamp(1, MAX_CONNECTIONS_PER_ENDPOINT);
        self
    }

    /// The code defaults every entry starts from, before its `#[governance(...)]` attribute,
    /// the config file, the environment and runtime updates. Values a config file would
    /// refuse make every call of the client fail with an error naming them, as with
    /// [`override_options`](Self::override_options).
    pub fn default_options(mut self, options: GovernanceOptions) -> Self {
        self.layers.code_defaults = options;
        self
    }

    /// Shorthand: the default shunt strategy.
    pub fn shunt_strategy(mut self, s: ShuntStrategy) -> Self {
        self.layers.code_defaults.shunt_strategy = s;
        self
    }

    /// What places instances on the consistent-hash ring of every service (their address by
    /// default). [`RingKey::InstanceId`] or [`RingKey::Metadata`] keep a shard's keys when it
    /// restarts on another address; every client of the service should use the same choice.
    pub fn ring_key(mut self, key: RingKey) -> Self {
        self.ring_keys.default = key;
        self
    }

    /// Like [`ring_key`](Self::ring_key), for one service only.
    pub fn service_ring_key(mut self, service_id: impl Into<String>, key: RingKey) -> Self {
        self.ring_keys.services.insert(service_id.into(), key);
        self
    }

    /// Overrides for one entry (`"<service id>.<method>"`) or a whole service (`"<service id>"`),
    /// at the runtime level (above every other layer); entry overrides apply after service
    /// ones. [`Client::update_options`] changes them later. Values a config file would refuse
    /// (a percentage above 100, an address that is not `host:port`) make every call of the
    /// client fail with an error naming them.
    pub fn override_options(mut self, id: impl Into<String>, o: GovernanceOverrides) -> Self {
        set_runtime(&mut self.layers.runtime, id.into(), o);
        self
    }

    /// Loads the config file layer (TOML; see [`GovernanceConfig`]).
    pub fn config_file(mut self, path: impl AsRef<Path>) -> Result<Self, RpcError> {
        self.layers.file = GovernanceConfig::from_file(path)?;
        Ok(self)
    }

    /// Loads the environment layer from `RPC_GOVERNANCE` (see [`GovernanceConfig`]).
    pub fn config_env(mut self) -> Result<Self, RpcError> {
        self.layers.env = GovernanceConfig::from_env()?;
        Ok(self)
    }

    /// Sets the file and environment layers directly, for programs that read their
    /// configuration elsewhere.
    pub fn config_layers(mut self, file: GovernanceConfig, env: GovernanceConfig) -> Self {
        self.layers.file = file;
        self.layers.env = env;
        self
    }

    /// Follows the rules of `source` (the etcd `RuleStore`, for instance; needs a Tokio
    /// runtime when [`build`](Self::build) runs): each valid new governance document becomes
    /// the "centre" level of every entry's options (above `RPC_GOVERNANCE`, below runtime
    /// updates) from the next call, keeping breakers, budgets and endpoint health; an invalid
    /// one is refused (event `rule_rejected`, a warning) and the last good version stays in
    /// force. [`Client::rules_version`] says which version is in force.
    ///
    /// The rules are read when the client is built; each entry's first call waits for that
    /// read beside its registry lookup (within its deadline), so that it runs under the
    /// version in the store. A source that cannot be reached then holds those first calls up
    /// to its request timeout (10 s at most whatever the source) within their deadlines, as an
    /// unreachable registry does: a call whose deadline comes first times out, the others then
    /// run without the rules, which apply once the source answers. Appointed calls (by the
    /// client's own options) wait for neither.
    pub fn rules(mut self, source: impl rpc_registry::RuleSource) -> Self {
        self.rules = Some(Arc::new(source));
        self
    }

    /// The routing rules in force from the first call (none by default): which instances, by
    /// their metadata tags, the calls of a service or an entry go to (see
    /// [`rpc_governance::routing`]). Refused, with the error naming the rule and the field,
    /// when they do not validate. [`Client::set_routing_rules`] replaces them later.
    pub fn routing_rules(mut self, rules: RoutingRules) -> Result<Self, RpcError> {
        rules.validate()?;
        self.routing = rules;
        Ok(self)
    }

    /// Registers a fallback for the service it implements (a `<Trait>Server` wrapping another
    /// implementation of the trait). It receives the original arguments when a call failed
    /// (transport, timeout, overflow, open breaker, server error), never for business,
    /// validation or auth errors, which are the callee's answer.
    pub fn fallback(mut self, fallback: impl Service) -> Self {
        self.fallbacks
            .insert(fallback.service_id(), Arc::new(fallback));
        self
    }

    /// Adds a user layer around every call, outside the whole governance stack: it sees each
    /// call once, whatever its retries, and the fallback's answer. Layers run in the order they
    /// are added, the first outermost. See [`Middleware`] and the README's "Middleware".
    pub fn layer(mut self, layer: impl Middleware) -> Self {
        self.middleware.push(Arc::new(layer));
        self
    }

    /// Adds a user layer around every attempt, below the retry layer: it sees each attempt
    /// with its endpoint ([`CallCx::endpoint`]) and attempt number. Layers run in the order
    /// they are added, the first outermost.
    pub fn attempt_layer(mut self, layer: impl Middleware) -> Self {
        self.attempt_middleware.push(Arc::new(layer));
        self
    }

    /// The OpenTelemetry meter of the client's metrics (feature `otel`); by default
    /// `opentelemetry::global::meter("rpc")`, taken when the client is built, so install the
    /// global meter provider first.
    ///
    /// Instruments: `rpc.client.duration` (histogram, ms), `rpc.client.calls` (counter, by
    /// `rpc.status_code`), `rpc.client.in_flight` (up-down counter) and
    /// `rpc.governance.events` (counter, by `event` and `rpc.entry_id`, `rpc.side = "client"`).
    #[cfg(feature = "otel")]
    pub fn meter(mut self, meter: opentelemetry::metrics::Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// The client.
    pub fn build(self) -> Client {
        let misconfigured = given_options_problem(&self.layers, &self.connect);
        let governance = Governance::new(self.layers);
        let registry = self
            .registry
            .unwrap_or_else(|| Arc::new(InProcessRegistry::new()));
        let pool = ConnectionPool::new(self.connect, self.connections_per_endpoint);
        #[cfg(feature = "otel")]
        let meter = self
            .meter
            .unwrap_or_else(|| opentelemetry::global::meter("rpc"));
        let inner = Arc::new_cyclic(|this: &std::sync::Weak<Inner>| {
            // The gauges' callbacks stay registered with the meter for the process's life (the
            // SDK has no way to take one back): they reach the client through a slot the client
            // empties as it drops, so that they hold nothing of it then.
            #[cfg(feature = "otel")]
            let (metrics, gauge_slot) = {
                let slot: telemetry::GaugeSlot<Inner> =
                    Arc::new(std::sync::Mutex::new(Some(this.clone())));
                let (b, e) = (slot.clone(), slot.clone());
                let metrics = telemetry::Metrics::new(
                    &meter,
                    governance.events(),
                    Box::new(move || telemetry::read_slot(&b).map(|i| i.breaker_gauge())),
                    Box::new(move || telemetry::read_slot(&e).map(|i| i.health_gauge())),
                );
                (metrics, slot)
            };
            #[cfg(not(feature = "otel"))]
            let (metrics, _) = (telemetry::Metrics, this);
            Inner {
                misconfigured,
                registry,
                pool,
                codec: self.codec,
                governance,
                services: DashMap::with_hasher(ahash::RandomState::new()),
                fast_services: std::array::from_fn(|_| OnceLock::new()),
                fallbacks: self.fallbacks,
                layers: self.middleware,
                attempt_layers: self.attempt_middleware,
                metrics,
                #[cfg(feature = "otel")]
                gauge_slot,
                calls: CallObservers::new(),
                probing: Mutex::new(HashSet::new()),
                unlisted: OnceLock::new(),
                ring_keys: self.ring_keys,
                rules: Arc::default(),
                rules_task: OnceLock::new(),
                observed_health: rpc_governance::health::EndpointHealth::new(Duration::from_secs(
                    60,
                )),
                routing: Router::new(self.routing),
                unpublished: Mutex::new(HashSet::new()),
            }
        });
        if let Some(source) = self.rules {
            crate::rules::start(source, &inner);
        }
        Client {
            inner,
            call_options: None,
        }
    }
}

/// What is wrong with the options a builder was given in code (`default_options`,
/// `override_options`, `config_layers`), checked as a config file is: a percentage above 100, an address that is
/// not `host:port`; and connection limits no connection can work under (a frame limit or a
/// connect timeout of zero: every handshake would fail, and the servers be blamed for it).
/// `None` when nothing is.
fn given_options_problem(layers: &Layers, connect: &ConnectOptions) -> Option<RpcError> {
    let mut problems = Vec::new();
    if connect.max_frame_length == 0 {
        problems.push("max_frame_length(0): no server's answer fits in a frame of 0 bytes".into());
    }
    if connect.connect_timeout.is_zero() {
        problems.push("connect_timeout(0): no connection is made in no time".to_string());
    }
    if let Err(e) = layers.code_defaults.validate() {
        problems.push(format!("default_options: {}", e.message()));
    }
    for (given, layer) in [
        ("override_options", &layers.runtime),
        ("config_layers", &layers.file),
        ("config_layers", &layers.env),
    ] {
        let sections = std::iter::once(("defaults", &layer.defaults))
            .chain(layer.services.iter().map(|(id, o)| (id.as_str(), o)))
            .chain(layer.entries.iter().map(|(id, o)| (id.as_str(), o)));
        for (id, o) in sections {
            if let Err(e) = o.validate() {
                problems.push(format!("{given} for {id}: {}", e.message()));
            }
        }
    }
    problems.sort();
    problems.dedup();
    (!problems.is_empty()).then(|| {
        RpcError::new(
            StatusCode::FrameworkError,
            format!(
                "the client was built with options it cannot carry out ({}); every call fails \
                 until it is built with valid ones",
                problems.join("; ")
            ),
        )
    })
}

/// What is wrong with a handle's own options ([`Client::with_options`]), if anything.
fn call_options_problem(o: &GovernanceOverrides) -> Option<RpcError> {
    o.validate().err().map(|e| {
        RpcError::new(
            StatusCode::FrameworkError,
            format!(
                "this handle's options (Client::with_options) cannot be carried out: {}; its \
                 calls fail until it is made with valid ones",
                e.message()
            ),
        )
    })
}

/// An endpoint left a service's snapshot: once no service of the client lists it, its health
/// marks go (a removed endpoint is no longer probed in the background) and the pool retires
/// its connections: an idle one closes now, one carrying calls (a draining server finishing
/// them) keeps them, takes no new call (a call waiting to be sent on it goes elsewhere) and
/// closes when they end. Without this, a connection to an instance that left the registry
/// while its process lives on stayed open, pinging, for the client's life, every address ever
/// called kept its pool entry, and a removed one was probed every 30 s for good (connecting
/// to whatever took its address). An endpoint announced again gets new connections. Its
/// ejection in observe mode goes too (nothing else clears those marks: with addresses that
/// churn, they piled up for the client's life).
fn forget_departed(inner: &Inner, addr: &str) {
    if lists(inner, addr) {
        return;
    }
    inner.governance.health().forget(addr);
    inner.observed_health.forget(addr);
    inner.pool.retire(addr);
}

/// The gauges' last values stay for the next collection: a program's final metrics flush
/// often comes after its client is dropped.
#[cfg(feature = "otel")]
impl Drop for Inner {
    fn drop(&mut self) {
        self.metrics
            .freeze(self.breaker_gauge(), self.health_gauge());
        // The gauges' callbacks outlive the client: they keep no hold on its memory.
        self.gauge_slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }
}

impl Inner {
    /// What is wrong with the options the builder was given, if anything.
    pub(crate) fn misconfigured(&self) -> Option<RpcError> {
        self.misconfigured.clone()
    }
}

#[cfg(feature = "otel")]
impl Inner {
    /// Breaker states for the `rpc.client.breaker_state` gauge.
    fn breaker_gauge(&self) -> Vec<(String, i64)> {
        self.governance
            .breakers()
            .into_iter()
            .map(|(id, state)| {
                let v = match state {
                    BreakerState::Closed { .. } => 0,
                    BreakerState::HalfOpen { .. } => 1,
                    BreakerState::Open { .. } => 2,
                };
                (id.to_string(), v)
            })
            .collect()
    }

    /// Endpoint health for the `rpc.client.endpoint_health` gauge: every endpoint of every
    /// service this client watches.
    fn health_gauge(&self) -> Vec<(String, i64)> {
        let health = self.governance.health();
        let mut out: Vec<(String, i64)> = Vec::new();
        for service in self.services.iter() {
            for instance in service.endpoints().iter() {
                if out.iter().any(|(a, _)| *a == instance.address) {
                    continue;
                }
                let v = if health.is_removed(&instance.address) {
                    2
                } else if health.is_healthy(&instance.address) {
                    0
                } else {
                    1
                };
                out.push((instance.address.clone(), v));
            }
        }
        out
    }
}

/// An id given without saying whether it names a service or an entry applies as both: a
/// service id never equals an entry id of the same service, so usually only the right section
/// matches. A service whose id is also an entry id of another service (`shop.Greeter.v2`, and
/// the method `v2` of `shop.Greeter`) gets both (see `Client::update_options`).
///
/// An update merges into what earlier updates set for the same id, field by field.
fn set_runtime(layer: &mut GovernanceConfig, id: String, o: GovernanceOverrides) {
    layer.services.entry(id.clone()).or_default().merge(&o);
    layer.entries.entry(id).or_default().merge(&o);
}

impl rpc_registry::rules::RuleTarget for Inner {
    fn apply(
        &self,
        kind: rpc_registry::RuleKind,
        rules: &rpc_registry::RuleVersion,
    ) -> Result<(), RpcError> {
        crate::rules::apply(&self.governance, &self.routing, kind, rules)
    }

    fn events(&self) -> &EventBus {
        self.governance.events()
    }
}

impl crate::rules::HasRules for Inner {
    fn in_force(&self) -> Arc<rpc_registry::rules::RulesInForce> {
        self.rules.clone()
    }

    fn hold(&self, task: crate::rules::AbortOnDrop) {
        let _ = self.rules_task.set(task);
    }
}

impl Client {
    /// A builder with the defaults: MessagePack, one connection per endpoint, default governance.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// The codec of parameters and results.
    pub fn codec(&self) -> Codec {
        self.inner.codec
    }

    /// The governance settings in force for `method`.
    pub fn options(&self, method: &'static MethodDescriptor) -> Arc<GovernanceOptions> {
        self.inner.governance.policy(method).options()
    }

    /// Changes the overrides of an entry or a service at run time. The update merges into the
    /// earlier runtime overrides of the same id, field by field: what `o` sets replaces, what it
    /// leaves `None` keeps its earlier runtime value ([`clear_option`](Self::clear_option) unsets
    /// one). The next call uses them; breakers, budgets and endpoint health keep their state.
    ///
    /// A value out of range (a percentage above 100, an address without a port) is refused
    /// with an error naming it, as in a config file. An update that would give an entry this
    /// client has already called options it cannot
    /// carry out (`shunt_strategy = hash` on a method without a `#[hash_key]` argument) is
    /// refused with an error naming the entry, and changes nothing. An entry not called yet is
    /// checked at its first call, which fails with that error instead of going round robin.
    ///
    /// The id names an entry or a service without saying which: a service whose id is also
    /// the entry id of another service's method (`shop.Greeter.v2`, and the method `v2` of
    /// `shop.Greeter`) is updated with that entry, and so are [`clear_option`](Self::clear_option)
    /// and [`clear_options`](Self::clear_options); give such a service another id, or use the
    /// config file's `[services."..."]` and `[entries."..."]` sections, which say which.
    pub fn update_options(
        &self,
        id: impl Into<String>,
        o: GovernanceOverrides,
    ) -> Result<(), RpcError> {
        o.validate()?;
        let id = id.into();
        self.inner
            .governance
            .try_update_layers(|l| set_runtime(&mut l.runtime, id, o))
    }

    /// Unsets one runtime override of an entry or a service (`field` named as in the config
    /// file, for example `"timeout_ms"`): the layers below decide it again from the next call.
    /// An unknown field name is an error that lists the known ones, and changes nothing.
    pub fn clear_option(&self, id: &str, field: &str) -> Result<(), RpcError> {
        // Checks the name first, so that a typo changes nothing.
        GovernanceOverrides::default().clear(field)?;
        self.inner.governance.try_update_layers(|l| {
            for map in [&mut l.runtime.services, &mut l.runtime.entries] {
                if let Some(o) = map.get_mut(id) {
                    // The name is known: clearing cannot fail.
                    let _ = o.clear(field);
                }
            }
        })
    }

    /// Removes every runtime override of an entry or a service: what the layers below
    /// (attribute, published descriptors, config file, environment) say applies again.
    /// Refused like [`update_options`](Self::update_options) when that would leave an entry
    /// with options it cannot carry out.
    pub fn clear_options(&self, id: &str) -> Result<(), RpcError> {
        self.inner.governance.try_update_layers(|l| {
            l.runtime.services.remove(id);
            l.runtime.entries.remove(id);
        })
    }

    /// Whether `text` is a rule document of `kind` to write to the store this client follows
    /// (see [`ClientBuilder::rules`]), as a rule editor asks: the error (a document that does
    /// not parse, or governance options an entry already called cannot carry out, such as
    /// consistent hashing for a method without a `#[hash_key]`), and nothing changes either
    /// way. Stricter than the client applying a document from the store, which leaves such a
    /// strategy out for those entries and applies the rest. A client that follows no rules (built without
    /// [`ClientBuilder::rules`]) applies none, and refuses none.
    pub fn check_rules(&self, kind: rpc_registry::RuleKind, text: &str) -> Result<(), RpcError> {
        if self.inner.rules_task.get().is_none() {
            return Ok(());
        }
        crate::rules::check(&self.inner.governance, kind, text)
    }

    /// Reloads the config file layer; on error (a broken file, or options an entry already
    /// called cannot carry out, as for [`update_options`](Self::update_options)) the old
    /// configuration stays in force.
    pub fn reload_config(&self, path: impl AsRef<Path>) -> Result<(), RpcError> {
        let path = path.as_ref();
        let file = GovernanceConfig::from_file(path)?;
        self.inner
            .governance
            .try_update_layers(|l| l.file = file)
            .map_err(|e| {
                RpcError::new(
                    e.code(),
                    format!("{}: {}; not loaded", path.display(), e.message()),
                )
            })?;
        // The new file's sections, checked against what the services followed publish now.
        for service in self.inner.services.iter() {
            warn_unpublished_sections(&self.inner.governance, service.key(), &service.endpoints());
        }
        Ok(())
    }

    /// The version of the rules of `kind` in force (see [`ClientBuilder::rules`]), if one was
    /// applied.
    pub fn rules_version(&self, kind: rpc_registry::RuleKind) -> Option<i64> {
        self.inner.rules.version(kind)
    }

    /// Replaces the routing rules (see [`rpc_governance::routing`]): calls that start from now
    /// on follow `rules`; calls in flight keep the group they were given. Rules that do not
    /// validate are refused with an error naming the rule and the field, and the rules in
    /// force stay. Breakers, budgets and endpoint health keep their state.
    pub fn set_routing_rules(&self, rules: RoutingRules) -> Result<(), RpcError> {
        rules.validate()?;
        let count = rules.routes.len();
        self.inner.routing.set(rules);
        tracing::info!(
            target: "rpc::routing",
            rules = count,
            "routing rules replaced; they apply from the next call"
        );
        Ok(())
    }

    /// The routing rules in force.
    pub fn routing_rules(&self) -> Arc<RoutingRules> {
        self.inner.routing.rules()
    }

    /// Governance events (retry, break, half-open, reset, timeout, fallback, reload, ejection,
    /// budget exhaustion): `events().subscribe()`.
    pub fn events(&self) -> &EventBus {
        self.inner.governance.events()
    }

    /// The state of `method`'s circuit breaker.
    pub fn breaker_state(&self, method: &'static MethodDescriptor) -> BreakerState {
        self.inner.governance.policy(method).breaker().state()
    }

    /// The state of every breaker this client has used.
    pub fn breakers(&self) -> Vec<(rpc_core::ServiceEntryId, BreakerState)> {
        self.inner.governance.breakers()
    }

    /// Opens `method`'s breaker until [`reset_breaker`](Self::reset_breaker); emits an
    /// `isolate` event.
    pub fn isolate(&self, method: &'static MethodDescriptor) {
        self.inner.governance.isolate(method);
    }

    /// Closes `method`'s breaker and forgets its failures; emits a `reset` event.
    pub fn reset_breaker(&self, method: &'static MethodDescriptor) {
        self.inner.governance.reset_breaker(method);
    }

    /// [`isolate`](Self::isolate) by entry id (an operator's tool with no descriptor at hand:
    /// an admin endpoint). Fails with [`StatusCode::NotFindServiceRoute`], changing nothing,
    /// for an entry this client has not called.
    pub fn isolate_entry(&self, entry_id: &str) -> Result<(), RpcError> {
        if self.inner.governance.isolate_entry(entry_id) {
            Ok(())
        } else {
            Err(unknown_entry(entry_id))
        }
    }

    /// [`reset_breaker`](Self::reset_breaker) by entry id; fails like
    /// [`isolate_entry`](Self::isolate_entry) for an entry this client has not called.
    pub fn reset_breaker_entry(&self, entry_id: &str) -> Result<(), RpcError> {
        if self.inner.governance.reset_breaker_entry(entry_id) {
            Ok(())
        } else {
            Err(unknown_entry(entry_id))
        }
    }

    /// The options in force for every entry this client has called, with the level of
    /// configuration that set each ([`OptionLevel`](rpc_core::options::OptionLevel): code
    /// defaults, attribute, published descriptors, config file, environment, runtime
    /// updates), sorted by entry id. Per-call options of a handle are not included: they are
    /// that handle's, not the entry's.
    pub fn entry_options(&self) -> Vec<EntryOptions> {
        self.inner.governance.entry_options()
    }

    /// The services this client has called, each with its instances as the registry
    /// announces them now (address, id, metadata, published entries), sorted by service id.
    pub fn services(&self) -> Vec<(String, rpc_registry::Endpoints)> {
        let mut out: Vec<(String, rpc_registry::Endpoints)> = self
            .inner
            .services
            .iter()
            .map(|s| (s.key().to_string(), s.endpoints()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Tells `observer` of every call this client (and every clone of it) starts from now on,
    /// as it ends: entry, final status, outcome and duration. While no observer is attached a
    /// call reads no clock for it.
    pub fn observe_calls(&self, observer: Arc<dyn CallObserver>) {
        self.inner.calls.add(observer);
    }

    /// Stops telling `observer` (the `Arc` given to [`observe_calls`](Self::observe_calls)) of
    /// calls.
    pub fn unobserve_calls(&self, observer: &Arc<dyn CallObserver>) {
        self.inner.calls.remove(observer);
    }

    /// Every endpoint of the services this client has called, by address, with its health as
    /// this client sees it: healthy, unhealthy until a mark expires (after failures held
    /// against it: transport errors at once; timeouts and server errors after
    /// `exceptions_allowed_before_breaking` in a row), or removed (after
    /// `unhealthy_times_allowed_before_removing` transport failures in a row; probed in the
    /// background with a connect and handshake, every 250 ms doubling up to 30 s, and
    /// re-admitted when one succeeds), with its failures in a row and the last one.
    pub fn endpoints(&self) -> Vec<EndpointStatus> {
        let mut by_addr: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for service in self.inner.services.iter() {
            for instance in service.endpoints().iter() {
                let services = by_addr.entry(instance.address.clone()).or_default();
                if !services.iter().any(|s| s == service.key()) {
                    services.push(service.key().to_string());
                }
            }
        }
        let health = self.inner.governance.health();
        by_addr
            .into_iter()
            .map(|(address, services)| {
                let view = health.view(&address);
                EndpointStatus {
                    address,
                    services,
                    state: view.state,
                    consecutive_failures: view.consecutive_failures,
                    last_failure: view.last_failure,
                }
            })
            .collect()
    }

    /// Takes `addr` back at once, as an operator decision: clears its unhealthy mark or its
    /// removal, as a success would, and emits a `readmission` event. Returns whether it had a
    /// mark. (A removed endpoint is also re-admitted by itself once a background probe reaches
    /// it; see [`endpoints`](Self::endpoints).)
    pub fn readmit(&self, addr: &str) -> bool {
        let had = self.inner.governance.health().readmit(addr);
        if had {
            self.readmission_event(addr, "re-admitted by an operator".into());
        }
        had
    }

    fn readmission_event(&self, addr: &str, cause: String) {
        let services: Vec<String> = self
            .inner
            .services
            .iter()
            .filter(|s| s.endpoints().iter().any(|i| i.address == addr))
            .map(|s| s.key().to_string())
            .collect();
        self.events().emit_parts(
            EventKind::Readmission,
            &Arc::from(services.join(",")),
            Some(addr),
            0,
            Some(cause),
        );
    }

    /// Probes a removed endpoint in the background until it answers a connect and handshake
    /// (no user call is spent on it), then re-admits it: a static list recovers when a server
    /// restarts on the same address. Pauses start at [`FIRST_PROBE_INTERVAL`] and double up to
    /// [`MAX_PROBE_INTERVAL`]; the task ends when the endpoint is no longer removed (the
    /// registry announced it again, or [`readmit`](Self::readmit)) or the client is dropped.
    fn probe_in_background(&self, addr: &str) {
        let fresh = self
            .inner
            .probing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr.to_string());
        if !fresh {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        let addr = addr.to_string();
        tokio::spawn(async move {
            let mut pause = FIRST_PROBE_INTERVAL;
            loop {
                tokio::time::sleep(pause).await;
                let Some(inner) = weak.upgrade() else { return };
                let client = Client {
                    inner,
                    call_options: None,
                };
                let health = client.inner.governance.health();
                let done = if !health.is_removed(&addr) {
                    true
                } else {
                    // The connection made by the probe joins the pool for the next call.
                    match client.inner.pool.get(&addr).await {
                        Ok(_) => {
                            if health.readmit(&addr) {
                                client.readmission_event(
                                    &addr,
                                    "a background probe connected and completed the handshake"
                                        .into(),
                                );
                            }
                            true
                        }
                        Err(e) => {
                            tracing::debug!(
                                target: "rpc::governance",
                                endpoint = %addr,
                                error = %e,
                                next_probe_ms = (pause * 2).min(MAX_PROBE_INTERVAL).as_millis() as u64,
                                "removed endpoint still unreachable"
                            );
                            false
                        }
                    }
                };
                if done {
                    client
                        .inner
                        .probing
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&addr);
                    return;
                }
                pause = (pause * 2).min(MAX_PROBE_INTERVAL);
            }
        });
    }

    /// The live endpoints of `service_id` as the registry announces them.
    pub async fn watch(&self, service_id: &str) -> Result<ServiceWatch, RpcError> {
        self.inner
            .registry
            .watch(&service_id.into())
            .await
            .map_err(|e| RpcError::new(StatusCode::NotFindServiceRoute, e.to_string()))
    }

    /// Waits until the registry announces at least one endpoint of `service_id`, up to
    /// `timeout`, and returns them: for a program that starts next to its servers and should
    /// not make its first call before one is up. It waits on the registry's watch (no polling).
    ///
    /// Fails with [`StatusCode::NotFindServiceRoute`] when `timeout` passes first, or at once
    /// when the registry can announce nothing more (a static list without the service).
    pub async fn wait_for_endpoints(
        &self,
        service_id: &str,
        timeout: Duration,
    ) -> Result<rpc_registry::Endpoints, RpcError> {
        let deadline = Instant::now() + rpc_core::capped(timeout);
        let waited = || format!("none after waiting {} ms", timeout.as_millis());
        // The lookup counts in the wait: a registry slow to answer (etcd unreachable, bounded
        // by its own request timeout) must not hold the caller past its timeout.
        let mut watch = match tokio::time::timeout_at(deadline, self.watch(service_id)).await {
            Ok(watch) => watch?,
            Err(_) => {
                return Err(RpcError::new(
                    StatusCode::NotFindServiceRoute,
                    format!(
                        "no endpoint of {service_id}: {}, the registry not having answered; \
                         check that it runs and the client's registry address",
                        waited()
                    ),
                ))
            }
        };
        loop {
            let current = watch.current();
            if !current.is_empty() {
                return Ok(current);
            }
            let why = match tokio::time::timeout_at(deadline, watch.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => "the registry will announce none (a static list without it?)".into(),
                Err(_) => waited(),
            };
            return Err(RpcError::new(
                StatusCode::NotFindServiceRoute,
                format!(
                    "no endpoint of {service_id}: {why}; start a server for it, or check the \
                     client's registry"
                ),
            ));
        }
    }

    pub(crate) async fn service(
        &self,
        service_id: &'static str,
    ) -> Result<Arc<ServiceState>, RpcError> {
        let key = (service_id.as_ptr() as usize, service_id.len());
        let slot = &self.inner.fast_services[fast_slot(key.0)];
        if let Some((k, s)) = slot.get() {
            if *k == key {
                return Ok(s.clone());
            }
        }
        if let Some(s) = self.inner.services.get(service_id) {
            let s = s.clone();
            // The first service to reach a free slot keeps it.
            let _ = slot.set((key, s.clone()));
            return Ok(s);
        }
        let watch = self.watch(service_id).await?;
        let mut fresh = false;
        let state = self
            .inner
            .services
            .entry(service_id)
            .or_insert_with(|| {
                fresh = true;
                let keys = &self.inner.ring_keys;
                let key = keys.services.get(service_id).unwrap_or(&keys.default);
                Arc::new(ServiceState::new(watch.clone(), key.clone()))
            })
            .clone();
        if fresh {
            // What the serving instances publish about their entries becomes a configuration
            // layer: now, and again whenever the registry announces a change.
            publish(&self.inner.governance, service_id, &watch.current());
            let inner = Arc::downgrade(&self.inner);
            let mut watch = watch;
            let mut listed: Vec<String> =
                watch.current().iter().map(|i| i.address.clone()).collect();
            let follower = tokio::spawn(async move {
                while watch.changed().await.is_ok() {
                    let Some(strong) = inner.upgrade() else {
                        return;
                    };
                    let current = watch.current();
                    publish(&strong.governance, service_id, &current);
                    let state = strong.services.get(service_id).map(|s| s.clone());
                    if let Some(state) = state {
                        state.refresh(strong.governance.health());
                    }
                    let now: Vec<String> = current.iter().map(|i| i.address.clone()).collect();
                    for gone in listed.iter().filter(|a| !now.contains(a)) {
                        forget_departed(&strong, gone);
                    }
                    listed = now;
                }
            });
            state.follow(&follower);
        }
        Ok(state)
    }

    /// A handle whose calls apply `overrides` above every other configuration level (code
    /// defaults, attribute, published descriptors, config file, environment, runtime updates),
    /// for those calls only: for example a shorter deadline for one request. Cheap (the handle
    /// shares everything with `self`); overrides given again merge, field by field.
    ///
    /// ```no_run
    /// # fn f(client: rpc_client::Client) {
    /// use rpc_core::GovernanceOverrides;
    /// let hurried = client.with_options(GovernanceOverrides {
    ///     timeout_ms: Some(200),
    ///     retry_times: Some(0),
    ///     ..GovernanceOverrides::NONE
    /// });
    /// # let _ = hurried; }
    /// ```
    ///
    /// A proxy made from the handle (`GreeterClient::new(hurried)`, or
    /// `greeter.with_options(..)`) calls with them. Values a config file would refuse (a
    /// percentage above 100, an address that is not `host:port`) fail the handle's calls with
    /// an error naming them.
    ///
    /// State shared by every call of an entry or a service is kept once, under whichever
    /// call's options it is judged with: the breaker (its thresholds, `failure_ratio_percent`
    /// and the others, and its open time, `breaker_seconds`: the handle's calls open it for
    /// every call of the entry), the retry budget (`retry_budget_*`), the outlier window
    /// (`outlier_*`: the handle's calls judge and eject endpoints for every call of the
    /// service) and slow start (`slow_start_ms`). Give those per entry (attribute,
    /// configuration, rules), not per call.
    pub fn with_options(&self, overrides: GovernanceOverrides) -> Client {
        let mut merged = self.call_options.as_deref().cloned().unwrap_or_default();
        merged.merge(&overrides);
        Client {
            inner: self.inner.clone(),
            call_options: Some(Arc::new(merged)),
        }
    }

    /// A handle whose calls have at most `timeout` (retries included): shorthand for
    /// [`with_options`](Self::with_options) with `timeout_ms`.
    pub fn with_timeout(&self, timeout: Duration) -> Client {
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.with_options(GovernanceOverrides {
            timeout_ms: Some(ms),
            ..GovernanceOverrides::NONE
        })
    }

    /// The per-call options of this handle, if any.
    pub fn call_options(&self) -> Option<&GovernanceOverrides> {
        self.call_options.as_deref()
    }

    /// Calls `method` with its argument list already encoded by [`codec`](Self::codec), and
    /// returns the encoded result.
    ///
    /// The call passes the stack of
    /// [`rpc_governance::stack`](rpc_governance::stack#the-order): the client's per-call
    /// layers, fallback, circuit breaker, timeout (the whole call, retries included; at the
    /// deadline the attempt in flight is dropped and the server receives `Cancel`), retry and
    /// failover (overflow and unreachable endpoints, on the balancer's next candidate, within
    /// the retry budget; a call that may have reached a server that then failed is repeated
    /// only for idempotent entries), the per-attempt layers, one attempt. A final failure
    /// names every endpoint tried.
    ///
    /// `hash_key` computes the stable hash of the method's `#[hash_key]` argument; it runs when
    /// the entry's strategy is consistent hashing, and on the calls made before the entry's
    /// service is known (its strategy unknown yet), whatever the strategy turns out to be.
    ///
    /// The call runs in an `rpc.client` span with a child `rpc.client.attempt` span per attempt
    /// (OpenTelemetry RPC attributes; governance events land on them), carries the current
    /// [`RpcContext`](rpc_core::RpcContext)'s attachments and, with feature `otel`, the
    /// attempt span's W3C trace context, and is counted in the client's metrics.
    pub fn invoke<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        hash_key: Option<H>,
    ) -> impl std::future::Future<Output = Result<Bytes, RpcError>> + Send + '_ {
        self.invoke_since(method, params, hash_key, None)
    }

    /// [`invoke`](Self::invoke) of a call that began at `began` (when given): its time, and
    /// its deadline, count from then (a generic call that looked its service up first).
    pub(crate) fn invoke_since<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        hash_key: Option<H>,
        began: Option<tokio::time::Instant>,
    ) -> impl std::future::Future<Output = Result<Bytes, RpcError>> + Send + '_ {
        let policy = self.inner.governance.policy(method);
        if policy.service_known() {
            // The call's span is made when the call is first polled (`None`): its parent is
            // the span the caller awaits it in, as for an entry's first call below.
            return Either::Left(self.invoke_entry(method, policy, params, hash_key, began, None));
        }
        // An entry's first call: its service is looked up first (the key is hashed now,
        // whatever the strategy turns out to be: once per entry), within the call's span.
        let hash = hash_key.map(|h| h());
        Either::Right(Box::pin(async move {
            let span = telemetry::call_span(method);
            // Before the lookup, so that what is logged in it carries the call's id.
            let call_id = telemetry::call_id(&span);
            let learnt_from = self.learn_service(method, &policy, &span).await;
            let started = began.unwrap_or(learnt_from);
            let hash_key = hash.map(|h| move || h);
            self.invoke_entry(
                method,
                policy,
                params,
                hash_key,
                Some(started),
                Some((span, call_id)),
            )
            .await
        }))
    }

    /// Looks the service of an appointed entry up in the background, once per entry until one
    /// succeeds: calls appointed by per-call options ask every time, and after a failed
    /// lookup (the registry unreachable, or slower than `BACKGROUND_LOOKUP_LIMIT`) a call
    /// made a second or more later starts another.
    pub(crate) fn look_up_in_background(
        &self,
        method: &'static MethodDescriptor,
        policy: &rpc_governance::engine::EntryPolicy,
    ) {
        if !policy.start_background_lookup() {
            return;
        }
        let client = self.clone();
        let policy = self.inner.governance.policy(method);
        tokio::spawn(async move {
            let lookup = client.service(method.service_id);
            let found = tokio::time::timeout(BACKGROUND_LOOKUP_LIMIT, lookup).await;
            // A dropped client is not kept for the pause below.
            drop(client);
            if !matches!(found, Ok(Ok(_))) {
                // Not at once: a registry that is down is not asked by every call.
                tokio::time::sleep(LOOKUP_AGAIN_AFTER).await;
                policy.background_lookup_failed();
            }
        });
    }

    /// Before an entry's first call or stream: looks its service up, and waits for the
    /// rules' first read beside it (when the client follows rules, see
    /// [`ClientBuilder::rules`]), so that what the
    /// service's instances publish for the entry is a level of the call's options too. The
    /// lookup (a registry that is slow or down can take its whole request timeout) counts
    /// against the call's deadline: it waits no longer than the deadline the call's options
    /// give before it, and the call's deadline runs from the returned start. It runs in the
    /// call's `span`, which ends cancelled should the call be dropped meanwhile.
    pub(crate) async fn learn_service(
        &self,
        method: &'static MethodDescriptor,
        policy: &rpc_governance::engine::EntryPolicy,
        span: &tracing::Span,
    ) -> tokio::time::Instant {
        let lookup = telemetry::LookupWatch::new(
            span.clone(),
            self.inner.metrics.start(method),
            &self.inner.calls,
            method.entry_id,
        );
        let started = self
            .look_up_service(method, policy)
            .instrument(span.clone())
            .await;
        lookup.done();
        started
    }

    /// [`learn_service`](Self::learn_service)'s lookup.
    async fn look_up_service(
        &self,
        method: &'static MethodDescriptor,
        policy: &rpc_governance::engine::EntryPolicy,
    ) -> tokio::time::Instant {
        let started = tokio::time::Instant::now();
        let options = match &self.call_options {
            None => policy.options(),
            Some(o) => Arc::new(o.applied(&policy.options())),
        };
        if options.shunt_strategy == ShuntStrategy::Appoint {
            // Appointed: the registry has no say in where the call goes (see the picker), so
            // the call does not wait for it either, nor for the rules, and later calls take
            // the fast path. The service is looked up in the background all the same, so that
            // what its instances publish becomes a level of the entry's options for the calls
            // after it lands; bounded, so that a registry that hangs keeps no dropped client
            // alive for long. Only an appoint of the entry's own options marks the service
            // known for every call: one asked by this handle's per-call options leaves the
            // entry's other calls to wait for the lookup and the rules as first calls do.
            if policy.options().shunt_strategy == ShuntStrategy::Appoint {
                policy.set_service_known();
            }
            self.look_up_in_background(method, policy);
            return started;
        }
        let deadline = rpc_governance::timeout::deadline_from(started, &options);
        // Beside the lookup, the rules' first read (started when the client was built), when
        // the client follows rules: the first call runs under the rules in the store, not the
        // options they replace. Each wait is bounded on its own, the rules' also by
        // `FIRST_READ_LIMIT` (a rule source need not bound its reads).
        let rules = async {
            if self.inner.rules_task.get().is_some() {
                let limit = started + rpc_registry::rules::FIRST_READ_LIMIT;
                let until = deadline.map_or(limit, |d| d.min(limit));
                let _ = tokio::time::timeout_at(until, self.inner.rules.first_read()).await;
            }
        };
        let lookup = async {
            let lookup = self.service(method.service_id);
            match deadline {
                Some(d) => tokio::time::timeout_at(d, lookup).await.ok(),
                None => Some(lookup.await),
            }
        };
        let (found, ()) = tokio::join!(lookup, rules);
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match &found {
            Some(Ok(_)) => {
                policy.set_service_known();
                tracing::debug!(
                    elapsed_ms,
                    service = method.service_id,
                    "the entry's first call looked its service up in the registry"
                );
            }
            Some(Err(e)) => tracing::debug!(
                elapsed_ms,
                service = method.service_id,
                "the entry's first call could not look its service up: {e}"
            ),
            None => tracing::debug!(
                elapsed_ms,
                service = method.service_id,
                "the entry's first call gave up looking its service up at its deadline"
            ),
        }
        started
    }

    /// [`invoke`](Self::invoke) with the entry's policy, in the call's span (with its call id,
    /// when it has one; `None`: a new one, made at the first poll); `started`: when the call
    /// started, if before this (its deadline runs from then).
    fn invoke_entry<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        policy: Arc<rpc_governance::engine::EntryPolicy>,
        params: Bytes,
        hash_key: Option<H>,
        started: Option<tokio::time::Instant>,
        span: Option<(tracing::Span, Option<String>)>,
    ) -> impl std::future::Future<Output = Result<Bytes, RpcError>> + Send + '_ {
        let options = match &self.call_options {
            None => policy.options(),
            Some(o) => Arc::new(o.applied(&policy.options())),
        };
        let (hash_key, misconfigured) = self.hash_or_refusal(method, &options, hash_key);
        self.governed_call(
            method,
            policy,
            options,
            params,
            (hash_key, misconfigured),
            started,
            span,
        )
    }

    /// The body of [`invoke_entry`](Self::invoke_entry), its options and hash key known; its
    /// span made at its first poll when not given.
    #[allow(clippy::too_many_arguments)]
    async fn governed_call(
        &self,
        method: &'static MethodDescriptor,
        policy: Arc<rpc_governance::engine::EntryPolicy>,
        options: Arc<GovernanceOptions>,
        params: Bytes,
        (hash_key, misconfigured): (Option<u64>, Option<RpcError>),
        started: Option<tokio::time::Instant>,
        span: Option<(tracing::Span, Option<String>)>,
    ) -> Result<Bytes, RpcError> {
        // An appointed entry whose service lookup failed asks again (at the first poll, as
        // the rest: making the future starts nothing).
        if policy.wants_lookup_again() {
            self.look_up_in_background(method, &policy);
        }
        // (The body of an async fn runs at its first poll: a new span's parent is the span
        // the call is awaited in.)
        let (span, call_id) = span.unwrap_or_else(|| {
            let span = telemetry::call_span(method);
            let call_id = telemetry::call_id(&span);
            (span, call_id)
        });
        let governance = &self.inner.governance;
        let call_span = span.clone();
        let call = async move {
            let deadline = || match started {
                Some(at) => rpc_governance::timeout::deadline_from(at, &options),
                None => rpc_governance::timeout::deadline(&options),
            };
            let watch = telemetry::CallWatch::new(
                call_span,
                self.inner.metrics.start_at(method, started),
                deadline,
                &self.inner.calls,
                (method.entry_id, started),
            );
            // Refused before any attempt, and counted as a call all the same: a dashboard of an
            // entry whose every call fails so must not show no traffic.
            if let Some(e) = misconfigured {
                let refused = Err(e);
                watch.finish(&refused, None);
                return refused;
            }
            // The watch has read the options already: the context takes them over.
            let mut cx = CallCx::new(governance, policy, options)
                .with_hash_key(hash_key)
                .with_call_id(call_id);
            if let Some(at) = started {
                cx = cx.with_started(at);
            }
            let stack = stack::client_stack(ClientParts {
                outer: &self.inner.layers,
                fallbacks: &self.inner.fallbacks,
                codec: self.inner.codec,
                balance: ClientBalance { client: self },
                per_attempt: &self.inner.attempt_layers,
                attempt: Attempt { client: self },
            });
            let result = stack.call(&mut cx, params).await;
            if result.is_ok() && cx.fallback_cause().is_some() {
                crate::answered_by::record("fallback");
            }
            watch.finish(&result, cx.fallback_cause());
            result
        };
        // Without a subscriber the span is disabled: no wrapper, which would enter and leave it
        // on every poll.
        if span.is_disabled() {
            call.await
        } else {
            call.instrument(span).await
        }
    }

    /// Before a call or stream's first attempt: its hash key (computed only under consistent
    /// hashing), or why it is refused without one. Refused: options the builder or this handle
    /// was given out of range, hashing asked for a method with no `#[hash_key]` argument
    /// (refused, not sent round robin), or an appointed address asked for with none given
    /// (refused, not answered by a fallback as a failure to reach a server would be).
    pub(crate) fn hash_or_refusal<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        options: &GovernanceOptions,
        hash_key: Option<H>,
    ) -> (Option<u64>, Option<RpcError>) {
        let misconfigured = self
            .inner
            .misconfigured()
            .or_else(|| self.call_options.as_deref().and_then(call_options_problem));
        if misconfigured.is_some() {
            return (None, misconfigured);
        }
        let needs = match options.shunt_strategy {
            ShuntStrategy::Hash if method.hash_key.is_none() => "hash needs a #[hash_key] argument",
            ShuntStrategy::Appoint
                if options.appoint_address.as_deref().is_none_or(str::is_empty) =>
            {
                "appoint needs appoint_address = \"host:port\""
            }
            ShuntStrategy::Hash => return (hash_key.map(|h| h()), None),
            _ => return (None, None),
        };
        let by_this_handle = || {
            RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "{}: shunt_strategy = {needs}; this call's options ask for it \
                     (Client::with_options)",
                    method.entry_id
                ),
            )
        };
        // The handle's options are on top: when they choose the strategy, the levels below
        // (whose check would name one of theirs) are not why.
        let asked_here = self
            .call_options
            .as_deref()
            .is_some_and(|o| o.shunt_strategy.is_some());
        let e = if asked_here {
            by_this_handle()
        } else {
            self.inner
                .governance
                .check(method)
                .err()
                .unwrap_or_else(by_this_handle)
        };
        (None, Some(e))
    }

    /// One attempt on `addr`, the endpoint the balancer chose for it.
    ///
    /// One `async fn` (no nested one for connecting when the pool has the connection): each
    /// nested state machine costs every call on every poll.
    async fn attempt(
        &self,
        cx: &mut CallCx<'_>,
        addr: &str,
        params: Bytes,
        reported: &mut Option<ServerLoad>,
    ) -> Result<Bytes, RpcError> {
        let method = cx.method();
        let (timeout_ms, deadline) = (cx.budget_ms(), cx.attempt_deadline());
        let retry_depth = cx.retry_depth();
        // The entry's compression, when on: the parameters are compressed for the connection
        // they go on (only with an algorithm its server accepts).
        let packing = match cx.options().compression {
            Compression::Off => None,
            algorithm => Some((algorithm, cx.options().compression_threshold as usize)),
        };
        let message = |params: Bytes, attachments, accepts: Accepted, timeout_ms: u32| {
            let packed = packing.and_then(|(algorithm, threshold)| {
                let packed = compression::pack(algorithm, threshold, accepts, &params)?;
                telemetry::record_compression(algorithm, params.len(), packed.len());
                Some((packed, algorithm.to_wire()))
            });
            let (parameters, compression) = packed.unwrap_or((params, 0));
            Call {
                service_entry_id: method.entry_id.into(),
                codec: self.inner.codec.to_wire(),
                parameters,
                attachments,
                retry_depth,
                timeout_ms,
                compression,
                stream_mode: 0,
            }
        };
        'attempt: {
            // A pooled connection is taken at once, without the future that connects.
            let mut timeout_ms = timeout_ms;
            if !self.inner.attempt_layers.is_empty() {
                // The attempt's layers may have waited since the budget was taken: the
                // server is told what is left now.
                timeout_ms = rpc_governance::timeout::remaining_ms_at(Instant::now(), deadline);
            }
            let conn = match self.inner.pool.try_get(addr) {
                Some(conn) => conn,
                None => match self.connection(addr, cx).await {
                    Ok(conn) => {
                        // The server is told what is left after connecting.
                        timeout_ms =
                            rpc_governance::timeout::remaining_ms_at(Instant::now(), deadline);
                        conn
                    }
                    Err(e) => {
                        // No answer: the call's error, if it ends here, came from no endpoint.
                        let failed = Err(e);
                        crate::answered_by::attempt(addr, false, &failed);
                        break 'attempt failed;
                    }
                },
            };
            cx.set_connection(conn.id());
            let attachments = telemetry::outgoing_attachments(cx.call_id(), cx.attachments());
            let answer = match conn
                .call(
                    message(
                        params.clone(),
                        attachments,
                        conn.accept_compression(),
                        timeout_ms,
                    ),
                    deadline,
                )
                .await
            {
                Err(e) if unread_by_draining(&conn, &e) => {
                    let fresh = match self.connection(addr, cx).await {
                        Ok(conn) => conn,
                        Err(e) => {
                            let failed = Err(e);
                            crate::answered_by::attempt(addr, false, &failed);
                            break 'attempt failed;
                        }
                    };
                    let timeout_ms =
                        rpc_governance::timeout::remaining_ms_at(Instant::now(), deadline);
                    cx.set_connection(fresh.id());
                    // Rare: the attachments are gathered again rather than copied for every
                    // call.
                    let attachments =
                        telemetry::outgoing_attachments(cx.call_id(), cx.attachments());
                    let accepts = fresh.accept_compression();
                    fresh
                        .call(message(params, attachments, accepts, timeout_ms), deadline)
                        .await
                }
                other => other,
            };
            match answer {
                Ok(answer) => {
                    if answer.server_in_flight != 0 || answer.server_limit != 0 {
                        *reported = Some(ServerLoad {
                            in_flight: answer.server_in_flight,
                            limit: answer.server_limit,
                        });
                    }
                    let result = into_result(answer, self.inner.codec, addr);
                    crate::answered_by::attempt(addr, true, &result);
                    result
                }
                Err(e) => {
                    let failed = Err(e);
                    crate::answered_by::attempt(addr, false, &failed);
                    failed
                }
            }
        }
    }

    /// Whether calls under `options` need their endpoint's load counted.
    fn tracks_load(&self, options: &GovernanceOptions) -> bool {
        options.shunt_strategy == ShuntStrategy::LeastLoaded
            || (options.shunt_strategy == ShuntStrategy::Hash && options.hash_balance_factor > 0)
    }

    /// Counts an attempt's outcome for outlier ejection by success rate: an answer and what
    /// says nothing of the endpoint's health (the callee's own error answer, not found, not
    /// implemented) as a success; Overflow and a rate limit (load or policy, not sickness), a
    /// call the endpoint cannot serve (nothing sent) and the caller's own deadline passing
    /// ([`CallCx::is_callers_deadline`]) not at all; any other failure (a transport fault, a
    /// timeout, its handler's failure: 520, 500) against it. Ejections are events.
    fn count_outcome(
        &self,
        cx: &CallCx<'_>,
        addr: &str,
        result: &Result<Bytes, RpcError>,
        service_id: &'static str,
    ) {
        let ok = match result {
            Ok(_) => true,
            // Load or policy, not sickness (Overflow, a rate limit); or nothing was sent (an
            // endpoint that cannot serve the call).
            Err(e)
                if e.code().is_overflow()
                    || e.code() == StatusCode::RateLimited
                    || e.is_unsupported_by_endpoint() =>
            {
                return
            }
            // The caller's deadline, inherited: it had too little time left.
            Err(e) if cx.is_callers_deadline(e) => return,
            // What says nothing of the endpoint's health, as for the breaker (the callee's
            // own answer, not found, not implemented): the endpoint works. Any other failure
            // it gave (a transport fault, a timeout, its handler's failure: 520, 500) counts
            // against its success rate.
            Err(e) => e.code().is_breaker_exempt(),
        };
        let Some(service) = self.service_now(service_id) else {
            return;
        };
        // Observe mode: the outliers are judged as usual and marked in a view of health no
        // picker reads, so they stay in use.
        let observe = cx.options().outlier_observe;
        let health = if observe {
            &self.inner.observed_health
        } else {
            cx.health()
        };
        for o in service.record_outcome(addr, ok, cx.options(), health) {
            let cause = format!(
                "{}; avoided for {} ms",
                o.cause(),
                cx.options().outlier_interval_ms
            );
            if observe {
                cx.emit_observed(
                    EventKind::Ejection,
                    Some(&o.address),
                    cx.attempt(),
                    Some(cause),
                );
            } else {
                cx.emit(
                    EventKind::Ejection,
                    Some(&o.address),
                    cx.attempt(),
                    Some(cause),
                );
            }
        }
    }

    /// The state of a service a call has already looked up, without waiting.
    /// Whether this client has the state of `service_id` (has called it, or watched it).
    pub(crate) fn knows_service(&self, service_id: &str) -> bool {
        self.inner.services.contains_key(service_id)
    }

    fn service_now(&self, service_id: &'static str) -> Option<Arc<ServiceState>> {
        let key = (service_id.as_ptr() as usize, service_id.len());
        if let Some((k, s)) = self.inner.fast_services[fast_slot(key.0)].get() {
            if *k == key {
                return Some(s.clone());
            }
        }
        self.inner.services.get(service_id).map(|s| s.clone())
    }

    /// A pooled connection to `addr`; connecting counts against the attempt's deadline
    /// (`cx`'s). (When the connection exists it is returned at once, before any timer is
    /// armed.)
    ///
    /// Not connected by an attempt's own deadline (`attempt_timeout_ms`, before the call's):
    /// nothing was sent, so the error is a communication error, not delivered, which moves
    /// the call on to another endpoint whatever the entry, and marks this one at once. By the
    /// call's deadline: the call timed out.
    /// A connection to `addr` for the attempt `cx`. When a connect attempt fails, `cx` records
    /// its id as the attempt's connection: the calls that awaited that one attempt then count
    /// once against the endpoint, as those a broken connection fails do.
    pub(crate) async fn connection(
        &self,
        addr: &str,
        cx: &mut CallCx<'_>,
    ) -> Result<rpc_transport::Connection, RpcError> {
        if let Some(conn) = self.inner.pool.try_get(addr) {
            return Ok(conn);
        }
        // An endpoint that left the registry while the call was on its way to it (a
        // per-attempt layer waited) gets no new connection: nothing would retire it (its
        // address has gone already), and it would stay open, pinging, for the client's life.
        // The call goes elsewhere, as one a retired connection refuses does.
        if !(ClientBalance { client: self }).listed(addr, cx) {
            return Err(RpcError::new(
                StatusCode::CommunicationError,
                format!(
                    "{addr}: the call was not sent: the endpoint left the registry while the \
                     call was on its way"
                ),
            )
            .unsupported_by_endpoint(true));
        }
        let connected = match cx.attempt_deadline() {
            None => self.inner.pool.get_or_failed_attempt(addr).await,
            Some(d) => {
                match tokio::time::timeout_at(d, self.inner.pool.get_or_failed_attempt(addr)).await
                {
                    Ok(connected) => connected,
                    Err(_) => {
                        return Err(if cx.deadline() == Some(d) {
                            RpcError::new(
                                StatusCode::Timeout,
                                format!("{addr}: not connected before the call's deadline"),
                            )
                        } else {
                            RpcError::new(
                                StatusCode::CommunicationError,
                                format!(
                                    "{addr}: not connected within the attempt's timeout \
                                 (attempt_timeout_ms); nothing was sent"
                                ),
                            )
                        })
                    }
                }
            }
        };
        connected.map_err(|failed| {
            cx.set_connection(failed.attempt);
            failed.error
        })
    }

    /// Closes every connection this client holds.
    pub fn close(&self) {
        self.inner.pool.close_all();
    }
}

/// Whether `e`, a call's or a stream set-up's failure on `conn`, says the server was draining
/// and closed before reading it: the endpoint may well be back (a restart), so it goes once
/// more on a fresh connection. Only then: a timeout or any other verdict on a draining
/// connection is about a call the server may have run.
pub(crate) fn unread_by_draining(conn: &rpc_transport::Connection, e: &RpcError) -> bool {
    e.code() == StatusCode::CommunicationError && conn.is_draining() && !e.is_maybe_delivered()
}

/// Whether a service this client follows lists `addr` among its endpoints now.
fn lists(inner: &Inner, addr: &str) -> bool {
    inner
        .services
        .iter()
        .any(|s| s.endpoints().iter().any(|i| i.address == addr))
}

/// The error for an entry id this client has not called.
fn unknown_entry(entry_id: &str) -> RpcError {
    RpcError::new(
        StatusCode::NotFindServiceRoute,
        format!(
            "this client has not called {entry_id:?}: its breaker does not exist yet; check the \
             entry id (\"<service id>.<method>\")"
        ),
    )
}

/// Slots of the services' fast path ([`Inner::fast_services`]).
const FAST_SLOTS: usize = 64;

/// A service's state, keyed by the address and length of its `'static` id.
type ServiceSlot = ((usize, usize), Arc<ServiceState>);

/// The longest an appointed entry's background lookup of its service may take: a registry
/// that hangs keeps a dropped client's connections alive no longer.
const BACKGROUND_LOOKUP_LIMIT: Duration = Duration::from_secs(10);

/// How long after a failed background lookup of an appointed entry's service another may
/// start.
const LOOKUP_AGAIN_AFTER: Duration = Duration::from_secs(1);

/// The slot of a `'static` string's address (Fibonacci hashing).
fn fast_slot(addr: usize) -> usize {
    ((addr as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize % FAST_SLOTS
}

/// The client's endpoint choice, as the stack asks for it: the picker of the called service.
pub(crate) struct ClientBalance<'c> {
    pub(crate) client: &'c Client,
}

impl Balance for ClientBalance<'_> {
    type Picker = Picker;

    async fn picker(&self, cx: &CallCx<'_>) -> Result<Picker, RpcError> {
        let service_id = cx.method().service_id;
        if cx.options().shunt_strategy == ShuntStrategy::Appoint {
            // The appointed address is the only candidate whatever the registry lists: the
            // call does not wait on (nor fail with) a registry that is slow or down. The
            // service as already known serves the routing rules and load counts, if it is.
            let inner = &self.client.inner;
            let service = self.client.service_now(service_id).unwrap_or_else(|| {
                inner
                    .unlisted
                    .get_or_init(|| {
                        let (_, none) =
                            tokio::sync::watch::channel(rpc_registry::Endpoints::default());
                        Arc::new(ServiceState::new(
                            ServiceWatch::new(none),
                            RingKey::default(),
                        ))
                    })
                    .clone()
            });
            return Ok(Picker {
                service,
                route: None,
            });
        }
        let service = self.client.service(service_id).await?;
        let route = self.client.inner.routing.choose(cx, &service)?;
        Ok(Picker { service, route })
    }

    fn removed(&self, addr: &str) {
        self.client.probe_in_background(addr);
    }

    fn listed(&self, addr: &str, cx: &CallCx<'_>) -> bool {
        cx.options().shunt_strategy == ShuntStrategy::Appoint || lists(&self.client.inner, addr)
    }
}

/// The bottom of the client's stack: one attempt, in its `rpc.client.attempt` span.
struct Attempt<'c> {
    client: &'c Client,
}

impl stack::Service for Attempt<'_> {
    async fn call(&self, cx: &mut CallCx<'_>, params: Bytes) -> Result<Bytes, RpcError> {
        let Some(addr) = cx.endpoint_shared().cloned() else {
            return Err(RpcError::new(
                StatusCode::FrameworkError,
                "an attempt ran before an endpoint was chosen",
            ));
        };
        let span = telemetry::attempt_span(cx.method(), cx.attempt(), &addr);
        let watch =
            telemetry::AttemptWatch::new(span.clone(), cx.attempt_deadline(), cx.superseded());
        // Load-aware choices need the attempt counted on its endpoint while it runs.
        let load = self
            .client
            .tracks_load(cx.options())
            .then(|| self.client.service_now(cx.method().service_id))
            .flatten()
            .map(|service| service.load_of(&addr));
        let outstanding = load.as_deref().map(EndpointLoad::start);
        let mut reported = None;
        let result = if span.is_disabled() {
            // No subscriber: skip the wrapper, which would move the whole attempt future once
            // more on every call.
            self.client.attempt(cx, &addr, params, &mut reported).await
        } else {
            self.client
                .attempt(cx, &addr, params, &mut reported)
                .instrument(span.clone())
                .await
        };
        if cx.options().outlier_success_rate {
            self.client
                .count_outcome(cx, &addr, &result, cx.method().service_id);
        }
        if let Some(outstanding) = outstanding {
            // An answer (or a timeout: the endpoint was that slow) is a latency; a refusal or
            // a handler's failure, fast as it comes back, a penalty; a call that never reached
            // the endpoint only stops counting.
            match result.as_ref().map_err(RpcError::code) {
                // (A connection lost with the call on it may well have reached the endpoint:
                // its time then counts, as the drop's lower bound.)
                Err(StatusCode::CommunicationError)
                    if result.as_ref().is_err_and(|e| !e.is_maybe_delivered()) =>
                {
                    outstanding.forget()
                }
                Err(StatusCode::CommunicationError) => drop(outstanding),
                Err(_)
                    if result
                        .as_ref()
                        .is_err_and(RpcError::is_unsupported_by_endpoint) =>
                {
                    outstanding.forget()
                }
                // The callee's own answer (a business or validation error, a refused caller)
                // is an answer; a timeout, the endpoint's slowness.
                Ok(_) | Err(StatusCode::Timeout) => outstanding.finish(reported),
                Err(code) if code.is_callee_answer() => outstanding.finish(reported),
                // Any other failure the endpoint answered (a refusal, its handler's failure:
                // 520, 500, a carried 504, ...) is a penalty: an instance failing fast must not
                // look like the fastest one.
                Err(_) => outstanding.refused(reported),
            }
        }
        watch.finish(&result);
        result
    }

    /// Every wait of an attempt ends at its deadline with a timeout: connecting
    /// ([`Client::connection`]), waiting for room in the send queue, and waiting for the answer,
    /// which the connection's deadline sweeper fails (and cancels on the server) for all its
    /// calls with one timer.
    fn enforces_attempt_deadline(&self) -> bool {
        true
    }
}

/// Hands the entry descriptors the instances of `service_id` publish to the governance layers;
/// where instances disagree, the first by address wins, so every client decides alike. A
/// value the client would refuse from its own configuration (a percentage above 100, an
/// address that is not `host:port`) is left out with a warning (once: when what the instances
/// publish changes), the entry's other values kept.
fn publish(governance: &Governance, service_id: &str, instances: &rpc_registry::Endpoints) {
    let mut entries: Vec<(String, GovernanceOverrides)> = Vec::new();
    let mut ignored = Vec::new();
    for instance in instances.iter() {
        for e in &instance.entries {
            if e.service_id.as_str() == service_id
                && e.governance != GovernanceOverrides::NONE
                && !entries.iter().any(|(id, _)| id == e.id.as_str())
            {
                let mut published = e.governance.clone();
                for problem in published.drop_invalid() {
                    ignored.push((e.id.clone(), instance.address.clone(), problem));
                }
                entries.push((e.id.to_string(), published));
            }
        }
    }
    if governance.publish(service_id, entries) {
        for (entry, instance, problem) in ignored {
            tracing::warn!(
                %entry,
                %instance,
                "ignoring a governance value the instance publishes: {problem}"
            );
        }
    }
    warn_unpublished_sections(governance, service_id, instances);
}

/// Warns of the config file's and the environment's sections naming an entry of `service_id`
/// that none of its `instances` publishes (see [`Governance::unpublished_sections`]). Not when
/// an instance publishes no entry of the service at all (an older build, or a static list):
/// what it serves is not known, and a section may be for it.
fn warn_unpublished_sections(
    governance: &Governance,
    service_id: &str,
    instances: &rpc_registry::Endpoints,
) {
    let of_service = |e: &&rpc_core::ServiceEntry| e.service_id.as_str() == service_id;
    if instances
        .iter()
        .any(|i| !i.entries.iter().any(|e| of_service(&e)))
    {
        return;
    }
    let mut published: Vec<&str> = instances
        .iter()
        .flat_map(|i| i.entries.iter())
        .filter(of_service)
        .map(|e| e.id.as_str())
        .collect();
    published.sort_unstable();
    published.dedup();
    for (layer, entry) in governance.unpublished_sections(service_id, &published) {
        tracing::warn!(
            %entry,
            "the {layer} has a section for {entry}, which no instance of {service_id} \
             publishes (they publish {}): it applies to nothing; check the method's name",
            published.join(", ")
        );
    }
}

pub(crate) fn into_result(
    r: RemoteResultMessage,
    codec: Codec,
    addr: &str,
) -> Result<Bytes, RpcError> {
    let code = StatusCode::from_u32(r.status_code);
    if code == StatusCode::Success {
        return Ok(r.result);
    }
    let mut message = r.exception_message;
    if code.is_overflow()
        || code == StatusCode::CommunicationError
        || code == StatusCode::RateLimited
    {
        message = format!("{addr}: {message}");
    }
    if code == StatusCode::ValidateError {
        message = format!("{message} (answered by {addr})");
    }
    let mut err = RpcError::new(code, message);
    // The fields that failed validation stay fields (`field_errors`; the error's `Display`
    // lists them), so a program reads them without parsing the message.
    for field in r.validate_errors {
        err = err.with_field_error(field.member_name, field.error_message);
    }
    if r.retry_after_ms > 0 {
        // The server's word on when it will take the call (a rate limit's next token).
        err = err.with_retry_after(Duration::from_millis(r.retry_after_ms.into()));
    }
    if !r.result.is_empty() {
        // A typed error value carrying an infrastructure status: the handler ran, so the call
        // is repeated elsewhere only for idempotent entries.
        let carried = code != StatusCode::BusinessError;
        err = err.with_payload(codec, r.result).maybe_delivered(carried);
    } else if code == StatusCode::NotFindLocalServiceEntry {
        // The instance has no such entry (an older version during a rolling deploy that adds
        // it): nothing ran, and another instance of the service may have it.
        err = err.unsupported_by_endpoint(true);
    }
    Err(err)
}

#[cfg(all(test, feature = "otel"))]
mod gauge_tests {
    use std::sync::Arc;

    use opentelemetry::metrics::MeterProvider as _;
    use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

    use super::Client;

    /// The gauges' callbacks, which the meter keeps for the process's life, reach a client
    /// through its slot only (no reference to the client of their own), and the client empties
    /// the slot as it drops: a client gone leaves the meter nothing of its memory. (Before,
    /// each callback held a weak reference, which kept the client's allocation for good.)
    #[tokio::test]
    async fn a_dropped_client_leaves_its_gauges_nothing_of_it() {
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(InMemoryMetricExporter::default()).build())
            .build();
        let client = Client::builder().meter(provider.meter("rpc")).build();
        let weak = Arc::downgrade(&client.inner);
        assert_eq!(weak.weak_count(), 2, "this one and the slot's");
        let slot = client.inner.gauge_slot.clone();
        drop(client);
        assert!(weak.upgrade().is_none());
        assert!(
            slot.lock().unwrap().is_none(),
            "the slot lets the client's memory go"
        );
    }
}

#[cfg(test)]
mod departed_tests {
    use std::time::Duration;

    use super::{forget_departed, Client};

    /// An endpoint that left every service's snapshot leaves no mark behind, its ejection as
    /// an outlier in observe mode (`outlier_observe`) included.
    #[tokio::test]
    async fn a_departed_endpoint_leaves_no_observed_ejection_behind() {
        let client = Client::builder().build();
        let inner = &client.inner;
        inner.observed_health.eject(
            "127.0.0.1:9",
            Duration::from_secs(30),
            "an outlier, observed",
        );
        assert!(!inner.observed_health.is_clear());
        forget_departed(inner, "127.0.0.1:9");
        assert!(inner.observed_health.is_clear(), "the mark stayed");
    }
}
