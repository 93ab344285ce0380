//! The client: entry options, endpoint selection, remote execution under governance.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use rpc_core::wire::{RemoteInvokeMessage, RemoteResultMessage};
use rpc_core::{
    Codec, GovernanceOptions, GovernanceOverrides, MethodDescriptor, RpcError, Service,
    ShuntStrategy, StatusCode,
};
use rpc_governance::breaker::{BreakerState, CircuitBreaker, Transition};
use rpc_governance::health::EndpointHealth;
use rpc_governance::retry::{self, Decision};
use rpc_governance::timeout;
use rpc_registry::{InProcessRegistry, Registry, ServiceWatch};
use rpc_transport::{ConnectOptions, ConnectionPool};
use tokio::time::Instant;

use crate::endpoints::ServiceState;

/// Calls remote services. Cheap to clone; clones share connections, endpoint views and state.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Arc<dyn Registry>,
    pool: ConnectionPool,
    codec: Codec,
    defaults: GovernanceOptions,
    overrides: HashMap<String, GovernanceOverrides>,
    entries: DashMap<&'static str, Arc<EntryState>>,
    services: DashMap<&'static str, Arc<ServiceState>>,
    fallbacks: HashMap<&'static str, Arc<dyn Service>>,
    health: EndpointHealth,
}

/// What a client keeps per entry: its options and its circuit breaker.
struct EntryState {
    options: Arc<GovernanceOptions>,
    breaker: CircuitBreaker,
}

/// Builds a [`Client`].
pub struct ClientBuilder {
    registry: Option<Arc<dyn Registry>>,
    codec: Codec,
    connect: ConnectOptions,
    connections_per_endpoint: usize,
    defaults: GovernanceOptions,
    overrides: HashMap<String, GovernanceOverrides>,
    fallbacks: HashMap<&'static str, Arc<dyn Service>>,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        ClientBuilder {
            registry: None,
            codec: Codec::MsgPack,
            connect: ConnectOptions::default(),
            connections_per_endpoint: 1,
            defaults: GovernanceOptions::default(),
            overrides: HashMap::new(),
            fallbacks: HashMap::new(),
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

    /// Pause between pings on a quiet connection (10 s by default).
    pub fn heartbeat_interval(mut self, t: Duration) -> Self {
        self.connect.heartbeat_interval = t;
        self
    }

    /// Largest frame accepted from servers (16 MiB by default).
    pub fn max_frame_length(mut self, n: usize) -> Self {
        self.connect.max_frame_length = n;
        self
    }

    /// Connections opened to each endpoint and used in turn (1 by default).
    pub fn connections_per_endpoint(mut self, n: usize) -> Self {
        self.connections_per_endpoint = n.max(1);
        self
    }

    /// The governance settings every entry starts from, before its `#[governance(...)]`
    /// attribute and the overrides given here.
    pub fn default_options(mut self, options: GovernanceOptions) -> Self {
        self.defaults = options;
        self
    }

    /// Shorthand: the default shunt strategy.
    pub fn shunt_strategy(mut self, s: ShuntStrategy) -> Self {
        self.defaults.shunt_strategy = s;
        self
    }

    /// Overrides for one entry (`"<service id>.<method>"`) or a whole service (`"<service id>"`);
    /// entry overrides apply after service ones.
    pub fn override_options(mut self, id: impl Into<String>, o: GovernanceOverrides) -> Self {
        self.overrides.insert(id.into(), o);
        self
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

    /// The client.
    pub fn build(self) -> Client {
        let max_backoff = Duration::from_secs(self.defaults.breaker_seconds.max(1));
        Client {
            inner: Arc::new(Inner {
                registry: self
                    .registry
                    .unwrap_or_else(|| Arc::new(InProcessRegistry::new())),
                pool: ConnectionPool::new(self.connect, self.connections_per_endpoint),
                codec: self.codec,
                defaults: self.defaults,
                overrides: self.overrides,
                entries: DashMap::new(),
                services: DashMap::new(),
                fallbacks: self.fallbacks,
                health: EndpointHealth::new(max_backoff),
            }),
        }
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

    /// The governance settings in force for `method`: defaults, then its `#[governance(...)]`
    /// attribute, then this client's overrides for its service and for the entry.
    pub fn options(&self, method: &'static MethodDescriptor) -> Arc<GovernanceOptions> {
        self.entry(method).options.clone()
    }

    /// The state of `method`'s circuit breaker.
    pub fn breaker_state(&self, method: &'static MethodDescriptor) -> BreakerState {
        self.entry(method).breaker.state()
    }

    /// Opens `method`'s breaker until [`reset_breaker`](Self::reset_breaker).
    pub fn isolate(&self, method: &'static MethodDescriptor) {
        self.entry(method).breaker.isolate();
    }

    /// Closes `method`'s breaker.
    pub fn reset_breaker(&self, method: &'static MethodDescriptor) {
        self.entry(method).breaker.reset();
    }

    fn entry(&self, method: &'static MethodDescriptor) -> Arc<EntryState> {
        if let Some(e) = self.inner.entries.get(method.entry_id) {
            return e.clone();
        }
        let mut o = method.governance.applied(&self.inner.defaults);
        for id in [method.service_id, method.entry_id] {
            if let Some(layer) = self.inner.overrides.get(id) {
                layer.apply_to(&mut o);
            }
        }
        self.inner
            .entries
            .entry(method.entry_id)
            .or_insert_with(|| {
                Arc::new(EntryState {
                    options: Arc::new(o),
                    breaker: CircuitBreaker::new(),
                })
            })
            .clone()
    }

    /// The live endpoints of `service_id` as the registry announces them.
    pub async fn watch(&self, service_id: &str) -> Result<ServiceWatch, RpcError> {
        self.inner
            .registry
            .watch(&service_id.into())
            .await
            .map_err(|e| RpcError::new(StatusCode::NotFindServiceRoute, e.to_string()))
    }

    async fn service(&self, service_id: &'static str) -> Result<Arc<ServiceState>, RpcError> {
        if let Some(s) = self.inner.services.get(service_id) {
            return Ok(s.clone());
        }
        let watch = self.watch(service_id).await?;
        Ok(self
            .inner
            .services
            .entry(service_id)
            .or_insert_with(|| Arc::new(ServiceState::new(watch)))
            .clone())
    }

    /// Calls `method` with its argument list already encoded by [`codec`](Self::codec), and
    /// returns the encoded result.
    ///
    /// The whole call, retries included, runs under the entry's `timeout_ms`; at the deadline
    /// the attempt in flight is dropped and the server receives `Cancel`. Overflow and
    /// unreachable endpoints are retried on another endpoint, up to `retry_times` after
    /// `retry_interval_ms`; a call that may have reached a server that then failed is repeated
    /// only for idempotent entries. A final failure names every endpoint tried.
    pub async fn invoke(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        hash_key: Option<u64>,
    ) -> Result<Bytes, RpcError> {
        let entry = self.entry(method);
        let result = self
            .governed(method, &entry, params.clone(), hash_key)
            .await;
        match result {
            Err(e) if runs_fallback(&e) => match self.inner.fallbacks.get(method.service_id) {
                Some(fallback) => {
                    run_fallback(fallback.as_ref(), method, params, self.codec(), e).await
                }
                None => Err(e),
            },
            r => r,
        }
    }

    /// Circuit breaker → timeout → retry → call.
    async fn governed(
        &self,
        method: &'static MethodDescriptor,
        entry: &EntryState,
        params: Bytes,
        hash_key: Option<u64>,
    ) -> Result<Bytes, RpcError> {
        let options = &*entry.options;
        let deadline = timeout::deadline(options);
        let call = timeout::run_until(
            deadline,
            method.entry_id,
            options.timeout_ms,
            self.attempts(method, options, params, hash_key, deadline),
        );
        if !options.enable_circuit_breaker {
            return call.await;
        }
        let (permit, transition) = entry.breaker.try_acquire(method.entry_id, options)?;
        if let Some(t) = transition {
            breaker_event(method, t);
        }
        let result = call.await;
        if let Some(t) = entry.breaker.record(permit, &result, options) {
            breaker_event(method, t);
        }
        result
    }

    async fn attempts(
        &self,
        method: &'static MethodDescriptor,
        options: &GovernanceOptions,
        params: Bytes,
        hash_key: Option<u64>,
        deadline: Option<Instant>,
    ) -> Result<Bytes, RpcError> {
        let service = self.service(method.service_id).await?;
        let health = &self.inner.health;
        let mut tried: Vec<String> = Vec::new();
        let mut attempt = 0u32;
        loop {
            let addr = service.select(method.service_id, options, hash_key, &tried, health)?;
            let outcome = self
                .call_once(method, &addr, params.clone(), deadline)
                .await;
            // An answer from the server (success, or an error that is its own verdict rather
            // than a failure to reach it) records who gave it.
            if outcome
                .as_ref()
                .map_or_else(|e| !e.code().is_retryable(), |_| true)
            {
                crate::answered_by::record(&addr);
            }
            let err = match outcome {
                Ok(bytes) => {
                    health.success(&addr);
                    return Ok(bytes);
                }
                Err(e) => e,
            };
            if err.code() == StatusCode::CommunicationError {
                health.failure(&addr);
            }
            tried.push(addr);
            let every_endpoint_tried = service
                .endpoints()
                .iter()
                .all(|i| tried.iter().any(|t| *t == i.address));
            let decision = if err.code() == StatusCode::CommunicationError && every_endpoint_tried {
                Decision::GiveUp
            } else {
                retry::decide(&err, attempt, options, deadline)
            };
            match decision {
                Decision::Retry { after } => {
                    tracing::debug!(
                        target: "rpc::governance",
                        entry = method.entry_id,
                        endpoint = %tried.last().map(String::as_str).unwrap_or(""),
                        attempt,
                        cause = %err,
                        "retry"
                    );
                    attempt += 1;
                    if !after.is_zero() {
                        tokio::time::sleep(after).await;
                    }
                }
                Decision::GiveUp => {
                    return Err(if err.code().is_retryable() {
                        err.with_tried(tried)
                    } else {
                        err
                    })
                }
            }
        }
    }

    async fn call_once(
        &self,
        method: &'static MethodDescriptor,
        addr: &str,
        params: Bytes,
        deadline: Option<Instant>,
    ) -> Result<Bytes, RpcError> {
        let message = |params: Bytes| RemoteInvokeMessage {
            message_id: 0,
            service_entry_id: method.entry_id.to_string(),
            codec: self.inner.codec.to_wire(),
            parameters: params,
            attachments: Default::default(),
            timeout_ms: timeout::remaining_ms(deadline),
        };
        let conn = self.inner.pool.get(addr).await?;
        let answer = match conn.call(message(params.clone())).await {
            // The server was draining and closed before reading the call: the endpoint may
            // well be back (a restart), so the call goes once more on a fresh connection.
            Err(e) if conn.is_draining() && !e.is_maybe_delivered() => {
                self.inner
                    .pool
                    .get(addr)
                    .await?
                    .call(message(params))
                    .await?
            }
            other => other?,
        };
        into_result(answer, self.inner.codec, addr)
    }

    /// Closes every connection this client holds.
    pub fn close(&self) {
        self.inner.pool.close_all();
    }
}

fn breaker_event(method: &MethodDescriptor, t: Transition) {
    let event = match t {
        Transition::Break => "break",
        Transition::HalfOpen => "half-open",
        Transition::Reset => "reset",
    };
    tracing::info!(target: "rpc::governance", entry = method.entry_id, event, "circuit breaker");
}

/// A fallback answers for failures of the call, not for the callee's own answers or for
/// authentication.
fn runs_fallback(e: &RpcError) -> bool {
    !e.code().is_callee_answer() && e.code() != StatusCode::RpcUnAuthentication
}

async fn run_fallback(
    fallback: &dyn Service,
    method: &'static MethodDescriptor,
    params: Bytes,
    codec: Codec,
    cause: RpcError,
) -> Result<Bytes, RpcError> {
    // Recorded on the caller's current span: a trace shows why the fallback ran.
    tracing::warn!(
        target: "rpc::governance",
        entry = method.entry_id,
        event = "fallback",
        cause = %cause,
        "call failed, running the fallback"
    );
    let Some(index) = fallback
        .methods()
        .iter()
        .position(|m| m.entry_id == method.entry_id)
    else {
        return Err(cause);
    };
    fallback.call(index, params, codec).await.map_err(|fe| {
        if fe.code().is_callee_answer() {
            return fe;
        }
        RpcError::new(
            StatusCode::FallbackExecFail,
            format!(
                "{} failed ({cause}) and so did its fallback ({fe})",
                method.entry_id
            ),
        )
    })
}

fn into_result(r: RemoteResultMessage, codec: Codec, addr: &str) -> Result<Bytes, RpcError> {
    let code = StatusCode::from_u32(r.status_code);
    if code == StatusCode::Success {
        return Ok(r.result);
    }
    let mut message = r.exception_message;
    if !r.validate_errors.is_empty() {
        let fields: Vec<String> = r
            .validate_errors
            .iter()
            .map(|v| format!("{}: {}", v.member_name, v.error_message))
            .collect();
        message = format!("{message} ({})", fields.join("; "));
    }
    if code.is_overflow() || code == StatusCode::CommunicationError {
        message = format!("{addr}: {message}");
    }
    let mut err = RpcError::new(code, message);
    if !r.result.is_empty() {
        err = err.with_payload(codec, r.result);
    }
    Err(err)
}
