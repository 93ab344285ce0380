//! The server pipeline for one call: entry lookup → the user's layers, if any → concurrency cap
//! → handler under the deadline (panics caught) and inside the caller's call context → server
//! fallback on failure; all in the call's `rpc.server` span.
//!
//! A server without layers takes the path it always took; one with layers runs the same steps
//! after them, as the end of the chain ([`Terminal`]).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use rpc_core::wire::{RemoteResultMessage, ValidateError};
use rpc_core::{Codec, MethodDescriptor, RpcContext, RpcError, StatusCode};
use rpc_governance::bulkhead::Bulkhead;
use rpc_governance::events::{EventBus, EventKind};
use rpc_governance::fallback;
use rpc_transport::{error_result, Caller, Dispatch, Invoke, InvokeHandler};
use tokio::time::Instant;
use tracing::Instrument;

use crate::middleware::{LayerFuture, Next, ServerLayer, ServerRequest};
use crate::telemetry;
use crate::Service;

/// Where one entry id leads.
pub(crate) struct Route {
    pub(crate) service: Arc<dyn Service>,
    pub(crate) index: usize,
    pub(crate) method: &'static MethodDescriptor,
    pub(crate) entry: Arc<str>,
    pub(crate) cap: Bulkhead,
    pub(crate) fallback: Option<Arc<dyn Service>>,
    /// The user's layers and what runs after them, when the server has layers.
    pub(crate) layered: Option<Arc<Layered>>,
}

/// An entry's chain on a server with layers: shared by its calls, so that a call takes one
/// reference to it rather than one to each part.
pub(crate) struct Layered {
    pub(crate) layers: Arc<[Arc<dyn ServerLayer>]>,
    pub(crate) end: Terminal,
}

/// What follows the last layer: entry admission (the cap), the handler under the deadline and
/// in the caller's context, and the server fallback.
pub(crate) struct Terminal {
    pub(crate) service: Arc<dyn Service>,
    pub(crate) index: usize,
    pub(crate) entry: Arc<str>,
    pub(crate) cap: Bulkhead,
    pub(crate) fallback: Option<Arc<dyn Service>>,
    pub(crate) events: EventBus,
    pub(crate) endpoint: Arc<str>,
    pub(crate) send_panic_text: bool,
}

impl Terminal {
    /// Admits `req` at its entry's cap and runs its handler (and the fallback, should the
    /// handler fail), handing them the arguments and the attachments.
    pub(crate) async fn run(&self, req: &mut ServerRequest) -> Result<Bytes, RpcError> {
        let _permit = match self.cap.try_enter(&self.entry) {
            Ok(p) => p,
            Err(e) => {
                self.events.emit_parts(
                    EventKind::Overflow,
                    &self.entry,
                    Some(&req.caller.peer().to_string()),
                    0,
                    Some(e.message().to_string()),
                );
                return Err(e);
            }
        };
        let parameters = std::mem::take(&mut req.parameters);
        let fallback = self.fallback.as_ref().map(|f| ServerFallback {
            service: f.clone(),
            index: self.index,
            parameters: parameters.clone(),
            events: self.events.clone(),
            entry_id: self.entry.clone(),
            endpoint: self.endpoint.clone(),
            send_panic_text: self.send_panic_text,
        });
        let (codec, deadline) = (req.codec, req.deadline);
        let handler = self.service.call(self.index, parameters, codec);
        let attachments = std::mem::take(&mut req.attachments);
        let entry: &str = &self.entry;
        let run = async move {
            match (
                run_guarded(handler, deadline, entry, self.send_panic_text).await,
                fallback,
            ) {
                (Err(e), Some(fb)) if fallback::applies(&e, fallback::Side::Server) => {
                    let cause = e.code();
                    (
                        run_fallback(fb, e, codec, deadline, entry).await,
                        Some(cause),
                    )
                }
                (result, _) => (result, None),
            }
        };
        let (result, cause) = if attachments.is_empty() {
            run.await
        } else {
            RpcContext::scope(attachments, run).await
        };
        req.fallback_cause = cause;
        result
    }
}

pub(crate) struct Dispatcher {
    /// Looked up with every call's entry id: a fast keyed hash (lookups only, so peers cannot
    /// degrade it).
    pub(crate) routes: HashMap<String, Route, ahash::RandomState>,
    pub(crate) events: EventBus,
    /// The bound address (`server.address` of the spans).
    pub(crate) local: SocketAddr,
    /// The published address, naming this server in governance events.
    pub(crate) endpoint: Arc<str>,
    pub(crate) metrics: telemetry::Metrics,
    /// Whether a handler's panic message goes to the caller (otherwise only to the log).
    pub(crate) send_panic_text: bool,
    /// Whether the handler's first poll runs here, on the connection's reader
    /// (`ServerBuilder::inline_first_poll`).
    pub(crate) inline_first_poll: bool,
}

impl InvokeHandler for Dispatcher {
    fn handle(&self, mut invoke: Invoke, caller: &Arc<Caller>) -> Dispatch {
        let peer = caller.peer();
        let Some(route) = self.routes.get(invoke.service_entry_id.as_str()) else {
            return Dispatch::Ready(error_result(
                StatusCode::NotFindLocalServiceEntry,
                format!(
                    "this server has no service entry {:?}; check the service id and method name",
                    invoke.service_entry_id
                ),
            ));
        };
        let Some(codec) = Codec::from_wire(invoke.codec) else {
            return Dispatch::Ready(error_result(
                StatusCode::FrameworkError,
                format!(
                    "unknown codec {}: use 0 (MessagePack) or 1 (JSON)",
                    invoke.codec
                ),
            ));
        };
        let attachments = std::mem::take(&mut invoke.attachments);
        let span = telemetry::server_span(route.method, self.local, peer, &attachments);
        if let Some(chain) = &route.layered {
            return self.layered(
                chain,
                route.method,
                invoke,
                codec,
                attachments,
                span,
                caller,
            );
        }
        let permit = match route.cap.try_enter(&route.entry) {
            Ok(p) => p,
            Err(e) => {
                span.in_scope(|| {
                    self.events.emit_parts(
                        EventKind::Overflow,
                        &route.entry,
                        Some(&peer.to_string()),
                        0,
                        Some(e.message().to_string()),
                    )
                });
                telemetry::record_error(&span, e.code(), e.message());
                self.metrics.rejected(route.method, e.code());
                return Dispatch::Ready(error_result(e.code(), e.message()));
            }
        };
        let metrics = self.metrics.start(route.method);
        // What only a failing call needs is cloned only when a fallback is registered.
        let fallback = route.fallback.as_ref().map(|f| ServerFallback {
            service: f.clone(),
            index: route.index,
            parameters: invoke.parameters.clone(),
            events: self.events.clone(),
            entry_id: route.entry.clone(),
            endpoint: self.endpoint.clone(),
            send_panic_text: self.send_panic_text,
        });
        let mut handler = route.service.call(route.index, invoke.parameters, codec);
        let deadline = (invoke.timeout_ms > 0).then(|| {
            (
                Instant::now() + Duration::from_millis(invoke.timeout_ms.into()),
                invoke.timeout_ms,
            )
        });
        let entry = invoke.service_entry_id;
        let attachments = telemetry::user_attachments(attachments);
        let mut watch = telemetry::CallWatch::new(span.clone(), metrics, deadline.map(|(d, _)| d));
        // Most handlers answer in their first poll. When the server is told its handlers never
        // block (`inline_first_poll`), that poll is made here, on the connection's reader, in
        // the call's context, span and inherited deadline, so such a call is answered without
        // a future of its own; the rest (a handler that waits, a fallback to run) continues in
        // one. Otherwise the whole call runs in its own task: a handler blocking before its
        // first `.await` must not stall the reader and every other call on the connection.
        let first = if self.inline_first_poll {
            poll_first(&mut handler, deadline, &attachments, &span)
        } else {
            Poll::Pending
        };
        let rest = match first {
            Poll::Ready(outcome) => match (settle(outcome, &entry, self.send_panic_text), fallback)
            {
                (Err(e), Some(fb)) if fallback::applies(&e, fallback::Side::Server) => {
                    Rest::Fallback(e, fb)
                }
                (result, _) => {
                    drop(permit);
                    return Dispatch::Ready(finish(&mut watch, result, None));
                }
            },
            Poll::Pending => Rest::Handler(handler, fallback),
        };
        let panic_text = self.send_panic_text;
        let call = async move {
            let (e, fb) = match rest {
                Rest::Handler(handler, fallback) => {
                    match (
                        run_guarded(handler, deadline, &entry, panic_text).await,
                        fallback,
                    ) {
                        (Err(e), Some(fb)) if fallback::applies(&e, fallback::Side::Server) => {
                            (e, fb)
                        }
                        (result, _) => {
                            drop(permit);
                            return finish(&mut watch, result, None);
                        }
                    }
                }
                Rest::Fallback(e, fb) => (e, fb),
            };
            let cause = e.code();
            let result = run_fallback(fb, e, codec, deadline, &entry).await;
            drop(permit);
            finish(&mut watch, result, Some(cause))
        };
        // Each wrapper moves the whole call future once more: add only the ones in use (with
        // no attachments the handler's own calls find an empty context either way).
        Dispatch::Spawn(match (span.is_disabled(), attachments.is_empty()) {
            (true, true) => Box::pin(call),
            (true, false) => Box::pin(RpcContext::scope(attachments, call)),
            (false, _) => Box::pin(RpcContext::scope(attachments, call).instrument(span)),
        })
    }
}

impl Dispatcher {
    /// A call on a server with layers: the layers, then entry admission, handler and fallback
    /// ([`Terminal`]), in one future, all within the caller's deadline; a panic anywhere in the
    /// chain becomes a server error (520). The span and the metrics watch the whole chain, so
    /// an early answer is recorded with its status like any other.
    #[allow(clippy::too_many_arguments)]
    fn layered(
        &self,
        chain: &Arc<Layered>,
        method: &'static MethodDescriptor,
        invoke: Invoke,
        codec: Codec,
        attachments: BTreeMap<String, String>,
        span: tracing::Span,
        caller: &Arc<Caller>,
    ) -> Dispatch {
        let deadline = (invoke.timeout_ms > 0).then(|| {
            (
                Instant::now() + Duration::from_millis(invoke.timeout_ms.into()),
                invoke.timeout_ms,
            )
        });
        let mut watch = telemetry::CallWatch::new(
            span.clone(),
            self.metrics.start(method),
            deadline.map(|(d, _)| d),
        );
        let mut req = ServerRequest {
            method,
            caller: caller.clone(),
            attachments: telemetry::user_attachments(attachments),
            deadline,
            parameters: invoke.parameters,
            codec,
            fallback_cause: None,
        };
        let chain = chain.clone();
        let send_panic_text = self.send_panic_text;
        let call = async move {
            let entry = method.entry_id;
            // The first layer is called here rather than through `Next::run`, whose future has
            // room for the end of the chain: this future then holds only the layer's box.
            let first: LayerFuture<'_> = match chain.layers.first() {
                Some(layer) => layer.call(
                    &mut req,
                    Next {
                        chain: &chain,
                        at: 1,
                    },
                ),
                None => Box::pin(chain.end.run(&mut req)),
            };
            let chained = AssertUnwindSafe(first).catch_unwind();
            let outcome = match deadline {
                None => chained.await,
                Some((d, budget_ms)) => match tokio::time::timeout_at(d, chained).await {
                    Ok(outcome) => outcome,
                    Err(_) => Ok(Err(RpcError::new(
                        StatusCode::Timeout,
                        format!(
                            "{entry} ran out of the caller's {budget_ms} ms budget in the \
                             server's layers or handler; the call was stopped"
                        ),
                    ))),
                },
            };
            let result = settle(outcome, entry, send_panic_text);
            let cause = req.fallback_cause;
            finish(&mut watch, result, cause)
        };
        Dispatch::Spawn(if span.is_disabled() {
            Box::pin(call)
        } else {
            Box::pin(call.instrument(span))
        })
    }
}

/// What is left of a call its first poll did not answer.
enum Rest {
    /// The handler is waiting; the fallback, if any, runs should it fail.
    Handler(HandlerFuture, Option<ServerFallback>),
    /// The handler failed at once, and the fallback is to run.
    Fallback(RpcError, ServerFallback),
}

type HandlerFuture = futures_util::future::BoxFuture<'static, Result<Bytes, RpcError>>;
type Outcome = std::thread::Result<Result<Bytes, RpcError>>;

/// Polls the handler once in the call's span, attachments and inherited deadline, catching a
/// panic. Its waker does nothing: a handler that has to wait is polled again, with its task's
/// waker, by the future that continues the call.
fn poll_first(
    handler: &mut HandlerFuture,
    deadline: Option<(Instant, u32)>,
    attachments: &BTreeMap<String, String>,
    span: &tracing::Span,
) -> Poll<Outcome> {
    let mut poll = || {
        let mut cx = Context::from_waker(Waker::noop());
        match std::panic::catch_unwind(AssertUnwindSafe(|| handler.as_mut().poll(&mut cx))) {
            Ok(Poll::Ready(result)) => Poll::Ready(Ok(result)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => Poll::Ready(Err(panic)),
        }
    };
    let mut in_context = || {
        if attachments.is_empty() {
            poll()
        } else {
            RpcContext::sync_scope(attachments.clone(), &mut poll)
        }
    };
    let mut in_deadline = || match deadline {
        Some((d, _)) => rpc_governance::timeout::sync_with_inherited(Some(d), &mut in_context),
        None => in_context(),
    };
    if span.is_disabled() {
        in_deadline()
    } else {
        span.in_scope(in_deadline)
    }
}

/// Ends a call: its span and metrics record the result (and the failure a fallback answered
/// for, if one did), which becomes the answer.
fn finish(
    watch: &mut telemetry::CallWatch,
    result: Result<Bytes, RpcError>,
    fallback: Option<StatusCode>,
) -> RemoteResultMessage {
    watch.finish(&result, fallback);
    to_message(result)
}

/// Runs the server fallback after the handler failed with `e`.
async fn run_fallback(
    fb: ServerFallback,
    e: RpcError,
    codec: Codec,
    deadline: Option<(Instant, u32)>,
    entry: &str,
) -> Result<Bytes, RpcError> {
    // Once the caller's deadline has passed the caller has its timeout: a fallback started
    // now would act for nobody.
    if deadline.is_some_and(|(d, _)| Instant::now() >= d) {
        fb.events.emit_parts(
            EventKind::FallbackSkipped,
            &fb.entry_id,
            Some(&fb.endpoint),
            0,
            Some(e.to_string()),
        );
        return Err(e);
    }
    // On the call's span: a trace shows why the fallback ran. The server sees each attempt of
    // a caller as a call of its own: attempt 0.
    fb.events.emit_parts(
        EventKind::Fallback,
        &fb.entry_id,
        Some(&fb.endpoint),
        0,
        Some(e.to_string()),
    );
    let handler = fb.service.call(fb.index, fb.parameters, codec);
    let answer = fallback::with_cause(
        e.clone(),
        run_guarded(handler, deadline, entry, fb.send_panic_text),
    )
    .await;
    fallback::outcome(entry, e, answer)
}

/// A registered server fallback and what it needs to run after the handler failed.
struct ServerFallback {
    service: Arc<dyn Service>,
    index: usize,
    parameters: Bytes,
    events: EventBus,
    entry_id: Arc<str>,
    endpoint: Arc<str>,
    send_panic_text: bool,
}

async fn run_guarded(
    handler: HandlerFuture,
    deadline: Option<(Instant, u32)>,
    entry: &str,
    send_panic_text: bool,
) -> Result<Bytes, RpcError> {
    let inherited = deadline.map(|(d, _)| d);
    let guarded = rpc_governance::timeout::with_inherited(
        inherited,
        AssertUnwindSafe(handler).catch_unwind(),
    );
    let outcome = if let Some((deadline, budget_ms)) = deadline {
        // Most handlers answer in their first poll: the deadline's timer is armed only for one
        // that has to wait.
        let mut guarded = std::pin::pin!(guarded);
        let first = std::future::poll_fn(|cx| Poll::Ready(guarded.as_mut().poll(cx))).await;
        if let Poll::Ready(outcome) = first {
            return settle(outcome, entry, send_panic_text);
        }
        match tokio::time::timeout_at(deadline, guarded).await {
            Ok(o) => o,
            Err(_) => {
                return Err(RpcError::new(
                    StatusCode::Timeout,
                    format!(
                        "{entry} ran out of the caller's {budget_ms} ms budget; the handler was \
                         stopped"
                    ),
                ))
            }
        }
    } else {
        guarded.await
    };
    settle(outcome, entry, send_panic_text)
}

/// The handler's result, or a panic turned into an error (520) that names the entry.
///
/// The panic message may show a service's internals (paths, values, queries), so it is logged
/// here with the entry and a short panic id, and the caller receives the id to find it by;
/// the text itself only with `send_panic_text`.
fn settle(outcome: Outcome, entry: &str, send_panic_text: bool) -> Result<Bytes, RpcError> {
    outcome.unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic payload".into());
        let id = panic_id();
        tracing::error!(entry, panic_id = %id, panic = %what, "handler panicked");
        let mut message = format!(
            "{entry} failed on the server: its handler panicked; the server's log has the \
             details under panic id {id}"
        );
        if send_panic_text {
            message.push_str(&format!(" ({what})"));
        }
        Err(RpcError::new(StatusCode::ServerError, message))
    })
}

/// A short id (8 hex digits) for one panic, unlikely to repeat within a server's log.
fn panic_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static SEED: OnceLock<ahash::RandomState> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let h = SEED.get_or_init(ahash::RandomState::new).hash_one(n);
    format!("{:08x}", h as u32)
}

fn to_message(result: Result<Bytes, RpcError>) -> RemoteResultMessage {
    match result {
        Ok(bytes) => RemoteResultMessage {
            status_code: StatusCode::Success.as_u32(),
            result: bytes,
            ..Default::default()
        },
        Err(e) => RemoteResultMessage {
            status_code: e.code().as_u32(),
            result: e.payload().map(|(_, p)| p.clone()).unwrap_or_default(),
            exception_message: e.message().to_string(),
            validate_errors: e
                .field_errors()
                .iter()
                .map(|f| ValidateError {
                    member_name: f.member.clone(),
                    error_message: f.message.clone(),
                })
                .collect(),
            ..Default::default()
        },
    }
}
