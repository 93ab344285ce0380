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
use rpc_core::{
    Codec, Compression, HeldContext, MethodDescriptor, RemoteError, RpcContext, RpcError,
    StatusCode, StreamMode,
};
use rpc_governance::calls::{CallObservers, Side};
use rpc_governance::events::{EventBus, EventKind};
use rpc_governance::fallback;
use rpc_transport::{error_result, Caller, Dispatch, Invoke, InvokeHandler, Refusal, StreamEvent};
use tokio::time::Instant;
use tracing::Instrument;

use crate::admission::{Admission, Slot, CRITICALITY_ATTACHMENT};
use crate::middleware::{LayerFuture, Next, ServerLayer, ServerRequest};
use crate::telemetry;
use crate::Service;

/// Where one entry id leads.
pub(crate) struct Route {
    pub(crate) service: Arc<dyn Service>,
    pub(crate) index: usize,
    pub(crate) method: &'static MethodDescriptor,
    pub(crate) entry: Arc<str>,
    pub(crate) admission: Arc<Admission>,
    pub(crate) fallback: Option<Arc<FallbackTo>>,
    /// The user's layers and what runs after them, when the server has layers.
    pub(crate) layered: Option<Arc<Layered>>,
    /// The method's shape: unary, or which way it streams.
    pub(crate) stream: StreamMode,
}

/// An entry's chain on a server with layers: shared by its calls, so that a call takes one
/// reference to it rather than one to each part.
pub(crate) struct Layered {
    pub(crate) layers: Arc<[Arc<dyn ServerLayer>]>,
    pub(crate) end: Terminal,
}

impl Layered {
    /// Runs `req` through the chain: its first layer is called here rather than through
    /// `Next::run`, whose future has room for the end of the chain, so the future returned
    /// holds only the layer's box. (The first layer's code before its first `.await` runs in
    /// this call: a caller guarding against panics makes it inside its guard.)
    pub(crate) fn start<'a>(
        chain: &'a Arc<Layered>,
        req: &'a mut ServerRequest,
    ) -> LayerFuture<'a> {
        match chain.layers.first() {
            Some(layer) => layer.call(req, Next { chain, at: 1 }),
            None => Box::pin(chain.end.run(req)),
        }
    }
}

/// What follows the last layer: entry admission (rate limits, cap or adaptive limit), the handler under the deadline and
/// in the caller's context, and the server fallback.
pub(crate) struct Terminal {
    pub(crate) service: Arc<dyn Service>,
    pub(crate) index: usize,
    pub(crate) entry: Arc<str>,
    pub(crate) admission: Arc<Admission>,
    pub(crate) fallback: Option<Arc<FallbackTo>>,
    pub(crate) events: EventBus,
    pub(crate) send_panic_text: bool,
}

impl Terminal {
    /// Admits `req` at its entry (rate limits, then the cap or adaptive limit) and runs its
    /// handler (and the fallback, should the handler fail), handing them the arguments and the
    /// attachments.
    pub(crate) async fn run(&self, req: &mut ServerRequest) -> Result<Bytes, RpcError> {
        let admitted = match req.admitted.take() {
            Some(slot) => Ok(slot),
            None => self.admission.admit(
                &self.entry,
                req.caller.client_id(),
                req.attachments
                    .get(CRITICALITY_ATTACHMENT)
                    .map(String::as_str),
                req.deadline
                    .map(|(d, _)| d.saturating_duration_since(Instant::now())),
            ),
        };
        let permit = match admitted {
            Ok(p) => p,
            Err(e) => {
                self.events.emit_parts(
                    refusal_event(&e),
                    &self.entry,
                    Some(&req.caller.peer().to_string()),
                    0,
                    Some(e.message().to_string()),
                );
                return Err(e);
            }
        };
        let parameters = std::mem::take(&mut req.parameters);
        if let Some(opened) = req.stream.clone() {
            // A stream: its set-up is what the layers see (with the caller's items, for a
            // stream taking them); its items, holding the entry's slot until they end, are
            // left for the dispatcher.
            let attachments = std::mem::take(&mut req.attachments);
            let retry_depth = req.retry_depth;
            let inbound = req.inbound.as_ref().and_then(|slot| {
                slot.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
            });
            let for_fallback = self.fallback.as_ref().map(|_| parameters.clone());
            let setup = crate::streams::carried(
                panic_at_poll(|| {
                    self.service
                        .call_stream(self.index, parameters, inbound, req.codec)
                }),
                req.codec,
            );
            let mode = self.service.stream_mode(self.index);
            let cause = crate::streams::FallbackCause::default();
            let setup = crate::streams::with_fallback(
                setup,
                self.fallback.as_ref(),
                mode,
                (for_fallback, req.codec),
                req.deadline,
                &cause,
            );
            // A panic of the set-up is its answer here, as a unary handler's is, so the layers
            // around it see a 520 rather than being unwound.
            let items =
                AssertUnwindSafe(crate::streams::in_context(setup, attachments, retry_depth))
                    .catch_unwind()
                    .await;
            req.fallback_cause = cause.get();
            // Failed past the deadline: the layers see the timeout the caller gets, as for a
            // unary call.
            let items = match settle(items, &self.entry, self.send_panic_text)
                .map_err(|e| past_deadline(e, req.deadline, &self.entry))
            {
                Ok(items) => items,
                Err(e) => {
                    // A fallback that ran and failed still says what it answered for, behind
                    // a tower layer too (which runs this on a copy of the request).
                    req.report_back();
                    return Err(e);
                }
            };
            *opened
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(crate::streams::holding(items, permit.for_stream()));
            req.load = Some(self.admission.load());
            req.report_back();
            return Ok(Bytes::new());
        }
        let fallback = self.fallback.as_ref().map(|to| ServerFallback {
            to: to.clone(),
            parameters: parameters.clone(),
        });
        let (codec, deadline) = (req.codec, req.deadline);
        let handler = panic_at_poll(|| self.service.call(self.index, parameters, codec));
        let attachments = std::mem::take(&mut req.attachments);
        let retry_depth = req.retry_depth;
        let entry: &str = &self.entry;
        let run = async move {
            match (
                run_guarded(handler, (deadline, codec), entry, self.send_panic_text).await,
                fallback,
            ) {
                (Err(e), Some(fb)) if fb.runs_for(&e, deadline) => {
                    let cause = e.code();
                    (
                        run_fallback(fb, e, codec, deadline, entry).await,
                        Some(cause),
                    )
                }
                (result, _) => (result, None),
            }
        };
        let (result, cause) = if attachments.is_empty() && retry_depth == 0 {
            run.await
        } else {
            RpcContext::scope_served(attachments, retry_depth, run).await
        };
        req.fallback_cause = cause;
        req.load = Some(self.admission.load());
        req.report_back();
        permit.completed();
        result
    }
}

/// The governance event of an admission refusal: over a rate limit, or at the gate.
pub(crate) fn refusal_event(e: &RpcError) -> EventKind {
    if e.code() == StatusCode::RateLimited {
        EventKind::RateLimited
    } else {
        EventKind::Overflow
    }
}

/// Writes the entry's load (in flight, limit) into an answer.
pub(crate) fn with_load(
    mut answer: RemoteResultMessage,
    (in_flight, limit): (u32, u32),
) -> RemoteResultMessage {
    answer.server_in_flight = in_flight;
    answer.server_limit = limit;
    answer
}

pub(crate) struct Dispatcher {
    /// Looked up with every call's entry id, by its bytes: a fast keyed hash (lookups only, so
    /// peers cannot degrade it).
    pub(crate) routes: HashMap<Box<[u8]>, Route, ahash::RandomState>,
    pub(crate) events: EventBus,
    /// Told of every call as it ends (`ServerStatus::observe_calls`).
    pub(crate) calls: CallObservers,
    /// The bound address (`server.address` of the spans).
    pub(crate) local: SocketAddr,
    pub(crate) metrics: telemetry::Metrics,
    /// Whether a handler's panic message goes to the caller (otherwise only to the log).
    pub(crate) send_panic_text: bool,
    /// Whether the handler's first poll runs here, on the connection's reader
    /// (`ServerBuilder::inline_first_poll`).
    pub(crate) inline_first_poll: bool,
}

impl InvokeHandler for Dispatcher {
    fn handle(&self, invoke: Invoke, caller: &Arc<Caller>) -> Dispatch {
        self.dispatch(invoke, caller, None)
    }

    fn handle_stream(
        &self,
        invoke: Invoke,
        caller: &Arc<Caller>,
        inbound: rpc_core::ByteStream,
    ) -> Dispatch {
        self.dispatch(invoke, caller, Some(inbound))
    }

    fn serves(&self, entry_id: &str) -> bool {
        self.routes.contains_key(entry_id.as_bytes())
    }

    fn decompresses_itself(&self) -> bool {
        true
    }

    fn refused(&self, why: Refusal, code: StatusCode) {
        self.metrics.refused(why.as_str(), code);
    }
}

impl Dispatcher {
    /// Answers or starts one call; `inbound` holds the caller's items of a stream that takes
    /// them.
    #[inline]
    fn dispatch(
        &self,
        invoke: Invoke,
        caller: &Arc<Caller>,
        inbound: Option<rpc_core::ByteStream>,
    ) -> Dispatch {
        // Looked up by its bytes: the route table's keys are valid ids, so an id that matches
        // one needs no further check.
        let Some(route) = self.routes.get(invoke.service_entry_id.as_bytes()) else {
            self.metrics
                .refused("unknown_entry", StatusCode::NotFindLocalServiceEntry);
            return Dispatch::Ready(error_result(
                StatusCode::NotFindLocalServiceEntry,
                format!(
                    "this server has no service entry {}; check the service id and method name",
                    rpc_core::quoted(&invoke.service_entry_id)
                ),
            ));
        };
        match Pack::of(&route.admission, caller, invoke.compression) {
            None => self.handle_route(route, invoke, caller, inbound),
            Some(pack) => pack.wrap(self.handle_route(route, invoke, caller, inbound)),
        }
    }
}

/// A stream's events with their items compressed one by one ([`Pack::apply_item`]): items
/// come as buffers of their own, never through the sink; its end, and an end while it waits
/// for credit (its deadline), as the events give them.
struct PackedEvents {
    events: std::pin::Pin<Box<dyn rpc_transport::StreamEvents>>,
    pack: Pack,
}

impl futures_util::Stream for PackedEvents {
    type Item = StreamEvent;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<StreamEvent>> {
        let pack = self.pack;
        self.events
            .as_mut()
            .poll_next(cx)
            .map(|event| event.map(|e| pack.apply_item(e)))
    }
}

impl rpc_transport::StreamEvents for PackedEvents {
    fn poll_items_into(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        _sink: &mut rpc_transport::ItemSink<'_>,
    ) -> Poll<Option<StreamEvent>> {
        futures_util::Stream::poll_next(self, cx)
    }

    fn poll_ended(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<RemoteResultMessage> {
        let pack = self.pack;
        self.events
            .as_mut()
            .poll_ended(cx)
            .map(|end| pack.apply(end))
    }

    fn settled(mut self: std::pin::Pin<&mut Self>, end: &RemoteResultMessage) {
        self.events.as_mut().settled(end);
    }
}

/// How one call's answer is compressed: with `algorithm` (one the caller accepts) when its
/// result is at least `threshold` bytes and shrinks.
#[derive(Debug, Clone, Copy)]
struct Pack {
    algorithm: Compression,
    threshold: usize,
}

impl Pack {
    /// The compression of an answer of `admission`'s entry to a call from `caller` that came
    /// compressed with `came_with` (a wire number): the entry's own `compression` when set,
    /// else the call's algorithm; `None` when that is off or the caller does not decode it
    /// (the answer then goes plain, at no cost).
    fn of(admission: &Admission, caller: &Caller, came_with: i32) -> Option<Pack> {
        let (own, threshold) = admission.compression();
        let algorithm = match own {
            Compression::Off => Compression::from_wire(came_with)?,
            set => set,
        };
        caller
            .accept_compression()
            .contains(algorithm)
            .then_some(Pack {
                algorithm,
                threshold: threshold as usize,
            })
    }

    /// `dispatch` with its answer compressed: at once, or when its future ends (in the call's
    /// task).
    fn wrap(self, dispatch: Dispatch) -> Dispatch {
        match dispatch {
            Dispatch::Ready(answer) => Dispatch::Ready(self.apply(answer)),
            Dispatch::Spawn(call) => Dispatch::Spawn(Box::pin(call.map(move |a| self.apply(a)))),
            Dispatch::Polled(call) => Dispatch::Polled(Box::pin(call.map(move |a| self.apply(a)))),
            // A stream's items are compressed one by one, and its end as an answer is (a
            // client stream's end carries its answer).
            Dispatch::Stream(events) => Dispatch::Stream(Box::pin(futures_util::StreamExt::map(
                events,
                move |event| self.apply_item(event),
            ))),
            // (Compressed items are buffers of their own: taken as such, the events' other
            // abilities kept.)
            Dispatch::Events(events) => {
                Dispatch::Events(Box::pin(PackedEvents { events, pack: self }))
            }
            // A form this server does not make: as it is.
            other => other,
        }
    }

    fn apply_item(self, event: StreamEvent) -> StreamEvent {
        match event {
            StreamEvent::Item(payload) => match rpc_transport::compression::pack(
                self.algorithm,
                self.threshold,
                rpc_transport::compression::Accepted::SUPPORTED,
                &payload,
            ) {
                Some(packed) => StreamEvent::Packed(packed, self.algorithm.to_wire()),
                None => StreamEvent::Item(payload),
            },
            StreamEvent::End(end) => StreamEvent::End(Box::new(self.apply(*end))),
            other => other,
        }
    }

    fn apply(self, mut answer: RemoteResultMessage) -> RemoteResultMessage {
        if answer.compression == 0 {
            if let Some(packed) = rpc_transport::compression::pack(
                self.algorithm,
                self.threshold,
                rpc_transport::compression::Accepted::SUPPORTED,
                &answer.result,
            ) {
                tracing::trace!(
                    compression = self.algorithm.name(),
                    size = answer.result.len(),
                    compressed_size = packed.len(),
                    "answer compressed"
                );
                answer.result = packed;
                answer.compression = self.algorithm.to_wire();
            }
        }
        answer
    }
}

impl Dispatcher {
    /// Decompresses the arguments of a call once it is admitted (the connection hands
    /// compressed calls on as they came, see [`InvokeHandler::decompresses_itself`]), so that
    /// a call refused over its entry's cap or rate limit costs no decompression. On a server
    /// with layers, a unary call or a server stream is admitted after the layers, which may
    /// read the arguments: it is decompressed before them. One that does not decompress is
    /// answered 500, one beyond the server's budget for decompressed arguments 515, and
    /// neither runs; they are counted as the connection counts its own refusals. The span
    /// records the algorithm and the decompressed size.
    #[allow(clippy::result_large_err)]
    ///
    /// `admitted`: the route whose admission took the call's rate-limit tokens, if it did. A
    /// call refused for want of the decompression budget by the size its arguments say (515,
    /// nothing decompressed) gets them back, as one refused at the cap does; arguments found
    /// corrupt, or over the budget only once decompressed (they said no size), keep theirs
    /// (their decompression cost the work a token stands for).
    pub(crate) fn unpack(
        &self,
        admitted: Option<&Route>,
        invoke: &mut Invoke,
        caller: &Caller,
        span: &tracing::Span,
    ) -> Result<(), Dispatch> {
        if invoke.compression == 0 {
            return Ok(());
        }
        match caller.unpack_telling(invoke) {
            Ok(()) => {
                telemetry::record_compression(span, invoke.compression, invoke.parameters.len());
                Ok(())
            }
            Err(refused) => {
                let e = refused.error;
                if let (Some(route), StatusCode::OverflowMaxServerHandle, false) =
                    (admitted, e.code(), refused.decompressed)
                {
                    route.admission.give_back(caller.client_id());
                }
                telemetry::record_error(span, e.code(), e.message());
                self.metrics
                    .refused(Refusal::Decompression.as_str(), e.code());
                Err(Dispatch::Ready(error_result(e.code(), e.message())))
            }
        }
    }

    /// Admits one call or stream of `route` from `caller` (cap, adaptive limit, rate limits),
    /// or answers its refusal at once: the refusal event, the span's error, the rejection metric
    /// and the call observers are told, and the answer carries the entry's load. The refusal
    /// is returned by value: boxing it would allocate on the overload path, where refusals are
    /// most of the traffic.
    #[allow(clippy::result_large_err)]
    pub(crate) fn admit(
        &self,
        route: &Route,
        caller: &Caller,
        attachments: &BTreeMap<String, String>,
        timeout_ms: u32,
        span: &tracing::Span,
    ) -> Result<Slot, Dispatch> {
        let admit = || {
            route.admission.admit(
                &route.entry,
                caller.client_id(),
                attachments.get(CRITICALITY_ATTACHMENT).map(String::as_str),
                (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms.into())),
            )
        };
        // In the call's span: what admission says as it decides (an observe-mode refusal's
        // event) is on the call's span, as an enforced refusal's event is.
        let admitted = if span.is_disabled() {
            admit()
        } else {
            span.in_scope(admit)
        };
        admitted.map_err(|e| {
            span.in_scope(|| {
                self.events.emit_parts(
                    refusal_event(&e),
                    &route.entry,
                    Some(&caller.peer().to_string()),
                    0,
                    Some(e.message().to_string()),
                )
            });
            telemetry::record_error(span, e.code(), e.message());
            self.metrics.rejected(route.method, e.code());
            if let Some(started) = self.calls.start() {
                self.calls.ended(
                    Side::Server,
                    route.method.entry_id,
                    started,
                    Some(e.code()),
                    "error",
                );
            }
            Dispatch::Ready(with_load(to_message(Err(e)), route.admission.load()))
        })
    }

    /// One call of an entry found in the route table: everything after the lookup.
    fn handle_route(
        &self,
        route: &Route,
        mut invoke: Invoke,
        caller: &Arc<Caller>,
        inbound: Option<rpc_core::ByteStream>,
    ) -> Dispatch {
        let peer = caller.peer();
        // Refused before the call's span and metrics start: counted with the entry's calls, by
        // the metrics and the call observers alike.
        let refused = || {
            self.metrics
                .rejected(route.method, StatusCode::FrameworkError);
            if let Some(started) = self.calls.start() {
                self.calls.ended(
                    Side::Server,
                    route.method.entry_id,
                    started,
                    Some(StatusCode::FrameworkError),
                    "error",
                );
            }
        };
        let Some(codec) = Codec::from_wire(invoke.codec) else {
            refused();
            return Dispatch::Ready(error_result(
                StatusCode::FrameworkError,
                format!(
                    "unknown codec {}: use 0 (MessagePack) or 1 (JSON)",
                    invoke.codec
                ),
            ));
        };
        if invoke.stream_mode != route.stream as i32 {
            refused();
            return Dispatch::Ready(crate::streams::mode_mismatch(route, invoke.stream_mode));
        }
        let attachments = std::mem::take(&mut invoke.attachments);
        let carried = telemetry::carried(&attachments);
        let span = telemetry::server_span(route.method, self.local, peer, (&attachments, &carried));
        // A unary call on a server with layers is admitted after them, and they may read its
        // arguments: decompressed before them. (Streams decompress where they are admitted.)
        if route.layered.is_some() && route.stream == StreamMode::Unary {
            if let Err(refused) = self.unpack(None, &mut invoke, caller, &span) {
                return refused;
            }
        }
        if route.stream != StreamMode::Unary {
            return crate::streams::dispatch(
                self,
                route,
                invoke,
                inbound,
                codec,
                attachments,
                (span, carried),
                caller,
            );
        }
        if let Some(chain) = &route.layered {
            return self.layered(
                chain,
                route.method,
                invoke,
                codec,
                attachments,
                (span, carried),
                caller,
            );
        }
        let permit = match self.admit(route, caller, &attachments, invoke.timeout_ms, &span) {
            Ok(p) => p,
            Err(refused) => return refused,
        };
        if let Err(refused) = self.unpack(Some(route), &mut invoke, caller, &span) {
            return refused;
        }
        let metrics = self.metrics.start(route.method);
        // What only a failing call needs is cloned only when a fallback is registered.
        let fallback = route.fallback.as_ref().map(|to| ServerFallback {
            to: to.clone(),
            parameters: invoke.parameters.clone(),
        });
        let mut handler =
            panic_at_poll(|| route.service.call(route.index, invoke.parameters, codec));
        let deadline = (invoke.timeout_ms > 0).then(|| {
            (
                Instant::now() + Duration::from_millis(invoke.timeout_ms.into()),
                invoke.timeout_ms,
            )
        });
        let entry = route.method.entry_id;
        let attachments = telemetry::user_attachments(attachments);
        let watch = telemetry::CallWatch::new(
            span.clone(),
            metrics,
            deadline.map(|(d, _)| d),
            &self.calls,
            entry,
        )
        .reporting_timeouts(&route.admission, entry, caller);
        // Most handlers answer in their first poll. When the server is told its handlers never
        // block (`inline_first_poll`), that poll is made here, on the connection's reader, in
        // the call's context, span and inherited deadline, so such a call is answered without
        // a future of its own; the rest (a handler that waits, a fallback to run) continues in
        // one. Otherwise the whole call runs in its own task: a handler blocking before its
        // first `.await` must not stall the reader and every other call on the connection.
        // With no attachments the handler's own calls find an empty context either way.
        let depth = invoke.retry_depth;
        let mut context = (!attachments.is_empty() || depth > 0)
            .then(|| HeldContext::new(Arc::new(attachments), depth));
        let first = if self.inline_first_poll {
            telemetry::in_carried(&carried, || {
                poll_first(
                    &mut handler,
                    (deadline, codec, entry),
                    context.as_mut(),
                    &span,
                )
            })
        } else {
            Poll::Pending
        };
        let mut call = CallFuture {
            guarded: Guarded::new(handler, (deadline, codec), entry),
            fallback,
            running_fallback: None,
            permit: Some(permit),
            admission: route.admission.clone(),
            watch,
            codec,
            send_panic_text: self.send_panic_text,
        };
        if let Poll::Ready(outcome) = first {
            // In the call's span, as when the call runs in a task of its own: a panic's log
            // line carries the call's id and entry.
            if let Some(answer) = span.in_scope(|| call.settle(outcome)) {
                return Dispatch::Ready(answer);
            }
        }
        // Each wrapper moves the whole call future once more: add only the ones in use.
        let call: futures_util::future::BoxFuture<'static, _> = match (span.is_disabled(), context)
        {
            (true, None) => Box::pin(call),
            (true, Some(context)) => Box::pin(context.scope(call)),
            (false, None) => Box::pin(call.instrument(span)),
            (false, Some(context)) => Box::pin(context.scope(call).instrument(span)),
        };
        let call = telemetry::with_carried(call, carried);
        // Polled once here already: the transport must not poll it on the reader again.
        if self.inline_first_poll {
            Dispatch::Polled(call)
        } else {
            Dispatch::Spawn(call)
        }
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
        (span, carried): (tracing::Span, telemetry::Carried),
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
            &self.calls,
            method.entry_id,
        )
        .reporting_timeouts(&chain.end.admission, method.entry_id, caller);
        let mut req = ServerRequest {
            method,
            caller: caller.clone(),
            attachments: telemetry::user_attachments(attachments),
            retry_depth: invoke.retry_depth,
            deadline,
            parameters: invoke.parameters,
            codec,
            fallback_cause: None,
            load: None,
            stream: None,
            inbound: None,
            stream_end: None,
            admitted: None,
            reported: None,
        };
        let chain = chain.clone();
        let send_panic_text = self.send_panic_text;
        let call = async move {
            let entry = method.entry_id;
            // The chain is started inside the guard: the first layer's code before its first
            // `.await` may panic too.
            let chained =
                AssertUnwindSafe(async { Layered::start(&chain, &mut req).await }).catch_unwind();
            // The layers' own calls inherit the caller's deadline, as the handler's do (and
            // as a stream's layers do).
            let chained =
                rpc_governance::timeout::with_inherited(deadline.map(|(d, _)| d), chained);
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
            // A failure past the deadline (the handler's, a panic, a layer's own) is the
            // timeout, whichever path the call took.
            let result = settle(outcome, entry, send_panic_text)
                .map_err(|e| past_deadline(e, deadline, entry));
            req.take_reported();
            let cause = req.fallback_cause;
            // A call answered by a layer, or refused at admission, reports the load it found.
            let load = req.load.unwrap_or_else(|| chain.end.admission.load());
            with_load(finish(&mut watch, result, cause), load)
        };
        Dispatch::Spawn(telemetry::with_carried(
            if span.is_disabled() {
                Box::pin(call)
            } else {
                Box::pin(call.instrument(span))
            },
            carried,
        ))
    }
}

/// One call of a server without layers, from its handler's poll to its answer: the handler
/// under the caller's deadline ([`Guarded`]), then the server fallback should the handler
/// fail, with the entry's permit held and the call watched until the end.
///
/// Written out rather than as an `async` block, which would hold the handler and the fallback
/// twice (as captured and as moved out) and room for the fallback's future in every call's
/// task: this holds little more than the handler's box, a boxed fallback future once one
/// runs, and the watch.
struct CallFuture {
    guarded: Guarded<'static>,
    /// Runs should the handler fail with an error the fallback applies to.
    fallback: Option<ServerFallback>,
    /// The fallback running, and the failure it answers for.
    running_fallback: Option<(StatusCode, FallbackFuture)>,
    /// Released before the answer is sent.
    permit: Option<Slot>,
    /// The entry's admission, whose load the answer reports.
    admission: Arc<Admission>,
    watch: telemetry::CallWatch,
    codec: Codec,
    send_panic_text: bool,
}

type FallbackFuture = std::pin::Pin<Box<dyn Future<Output = Result<Bytes, RpcError>> + Send>>;

impl CallFuture {
    /// Takes the handler's outcome: the answer, or `None` when the fallback now runs.
    fn settle(&mut self, outcome: Outcome) -> Option<RemoteResultMessage> {
        let entry = self.guarded.entry;
        // A failure past the deadline (a panic too) is the timeout, whichever path the call
        // took.
        let settled = settle(outcome, entry, self.send_panic_text)
            .map_err(|e| past_deadline(e, self.guarded.deadline, entry));
        match (settled, self.fallback.take()) {
            (Err(e), Some(fb)) if fb.runs_for(&e, self.guarded.deadline) => {
                let (codec, deadline) = (self.codec, self.guarded.deadline);
                self.running_fallback = Some((
                    e.code(),
                    Box::pin(run_fallback(fb, e, codec, deadline, entry)),
                ));
                None
            }
            (result, _) => {
                let load = self.admission.load();
                if let Some(permit) = self.permit.take() {
                    permit.completed();
                }
                Some(with_load(finish(&mut self.watch, result, None), load))
            }
        }
    }
}

impl Future for CallFuture {
    type Output = RemoteResultMessage;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.running_fallback.is_none() {
            let outcome = match std::pin::Pin::new(&mut this.guarded).poll(cx) {
                Poll::Ready(outcome) => outcome,
                Poll::Pending => return Poll::Pending,
            };
            if let Some(answer) = this.settle(outcome) {
                return Poll::Ready(answer);
            }
        }
        let Some((cause, running)) = &mut this.running_fallback else {
            return Poll::Pending;
        };
        let result = match running.as_mut().poll(cx) {
            Poll::Ready(result) => result,
            Poll::Pending => return Poll::Pending,
        };
        let cause = *cause;
        this.running_fallback = None;
        let load = this.admission.load();
        if let Some(permit) = this.permit.take() {
            permit.completed();
        }
        Poll::Ready(with_load(
            finish(&mut this.watch, result, Some(cause)),
            load,
        ))
    }
}

type HandlerFuture = futures_util::future::BoxFuture<'static, Result<Bytes, RpcError>>;

/// The future `build` makes (a handler's, or a stream's set-up); a panic while making it is
/// raised again at the future's first poll, where every panic of a handler is caught and
/// answered (520). A `Service` whose `call` itself panics (decoding eagerly, say) then fails
/// its own call, not the connection its dispatcher runs on with every call on it.
pub(crate) fn panic_at_poll<T: 'static>(
    build: impl FnOnce() -> futures_util::future::BoxFuture<'static, T>,
) -> futures_util::future::BoxFuture<'static, T> {
    match std::panic::catch_unwind(AssertUnwindSafe(build)) {
        Ok(future) => future,
        Err(panic) => Box::pin(async move { std::panic::resume_unwind(panic) }),
    }
}
pub(crate) type Outcome = std::thread::Result<Result<Bytes, RpcError>>;

/// Polls the handler once in the call's span, attachments and inherited deadline, catching a
/// panic. Its waker does nothing: a handler that has to wait is polled again, with its task's
/// waker, by the future that continues the call.
fn poll_first(
    handler: &mut HandlerFuture,
    (deadline, codec, entry): (Option<(Instant, u32)>, Codec, &str),
    context: Option<&mut HeldContext>,
    span: &tracing::Span,
) -> Poll<Outcome> {
    let mut poll = || {
        let mut cx = Context::from_waker(Waker::noop());
        match std::panic::catch_unwind(AssertUnwindSafe(|| handler.as_mut().poll(&mut cx))) {
            Ok(Poll::Ready(result)) => Poll::Ready(Ok(answered(result, (deadline, codec), entry))),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => Poll::Ready(Err(panic)),
        }
    };
    let in_context = || match context {
        None => poll(),
        Some(context) => context.enter(poll),
    };
    let in_deadline = || match deadline {
        Some((d, _)) => rpc_governance::timeout::sync_with_inherited(Some(d), in_context),
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
    let to = &fb.to;
    // On the call's span: a trace shows why the fallback ran. The server sees each attempt of
    // a caller as a call of its own: attempt 0.
    to.events.emit_parts(
        EventKind::Fallback,
        &to.entry_id,
        Some(&to.endpoint),
        0,
        Some(e.to_string()),
    );
    let handler = panic_at_poll(|| to.service.call(to.index, fb.parameters, codec));
    let answer = fallback::with_cause(
        e.clone(),
        run_guarded(handler, (deadline, codec), entry, to.send_panic_text),
    )
    .await;
    match answer {
        // Still running at the caller's deadline: the call is out of time (519), as any call
        // is, not a fallback that failed.
        Err(late)
            if late.code() == StatusCode::Timeout
                && deadline.is_some_and(|(d, _)| Instant::now() >= d) =>
        {
            Err(late)
        }
        answer => fallback::outcome(entry, e, answer),
    }
}

/// A registered server fallback of one entry and what it needs to run: built once per entry.
pub(crate) struct FallbackTo {
    pub(crate) service: Arc<dyn Service>,
    pub(crate) index: usize,
    pub(crate) events: EventBus,
    pub(crate) entry_id: Arc<str>,
    pub(crate) endpoint: Arc<str>,
    pub(crate) send_panic_text: bool,
}

impl FallbackTo {
    /// Whether the caller's `deadline` has passed, so that the fallback is not to start (it
    /// would act for nobody: the caller has its timeout); event `fallback_skipped` for the
    /// failure `e` then.
    pub(crate) fn skipped_past(&self, deadline: Option<(Instant, u32)>, e: &RpcError) -> bool {
        let passed = deadline.is_some_and(|(d, _)| Instant::now() >= d);
        if passed {
            self.events.emit_parts(
                EventKind::FallbackSkipped,
                &self.entry_id,
                Some(&self.endpoint),
                0,
                Some(e.to_string()),
            );
        }
        passed
    }
}

/// What a call keeps to run the server fallback after its handler failed.
struct ServerFallback {
    to: Arc<FallbackTo>,
    parameters: Bytes,
}

impl ServerFallback {
    /// Whether the fallback runs for the handler's failure `e`: one it answers for, while the
    /// caller's deadline has not passed (after it the caller has its timeout, and a fallback
    /// started then would act for nobody: `fallback_skipped` says so, and the call's span
    /// names no fallback cause).
    fn runs_for(&self, e: &RpcError, deadline: Option<(Instant, u32)>) -> bool {
        fallback::applies(e, fallback::Side::Server) && !self.to.skipped_past(deadline, e)
    }
}

async fn run_guarded(
    handler: HandlerFuture,
    deadline: (Option<(Instant, u32)>, Codec),
    entry: &str,
    send_panic_text: bool,
) -> Result<Bytes, RpcError> {
    settle(
        Guarded::new(handler, deadline, entry).await,
        entry,
        send_panic_text,
    )
}

/// A handler polled under the caller's deadline: each poll runs inside that deadline as the
/// one the handler's own calls inherit, and catches a panic; when the deadline passes first,
/// the outcome is a timeout (519) and the handler is dropped with this future.
///
/// Written out rather than as `with_inherited(…, timeout_at(…, catch_unwind(…)))`: most
/// handlers answer in their first poll, and this holds only the handler's box and, once the
/// handler has to wait, a boxed timer, which keeps the call's task small.
struct Guarded<'e> {
    handler: HandlerFuture,
    deadline: Option<(Instant, u32)>,
    /// The call's codec, which a failure the handler passes on is carried in.
    codec: Codec,
    entry: &'e str,
    /// Armed at the first poll the handler does not answer in.
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<'e> Guarded<'e> {
    fn new(
        handler: HandlerFuture,
        (deadline, codec): (Option<(Instant, u32)>, Codec),
        entry: &'e str,
    ) -> Self {
        Guarded {
            handler,
            deadline,
            codec,
            entry,
            timer: None,
        }
    }
}

/// A handler's `result` as its caller gets it: a failure at or after the caller's deadline
/// (not an answer of the handler's own logic: a business or validation error stands) is most
/// likely because of it (a downstream call or connect it bounded), and either way the caller's
/// time is up: the answer is the timeout, with the handler's error named, whichever of the
/// handler and the timer is polled first, and whether the handler answered in its inline
/// first poll or in a task.
///
/// Every failure is first sent as a generated service's handler sends its `RpcError`
/// ([`RemoteError::into_rpc_error`]; the generated code has done it already for the handler's
/// own errors): one a hand-written [`rpc_core::Service`] passes on from a downstream call (a
/// 507, a 515) must not read to the caller as this server's "nothing ran here", which would
/// have the call run again elsewhere.
fn answered(
    result: Result<Bytes, RpcError>,
    (deadline, codec): (Option<(Instant, u32)>, Codec),
    entry: &str,
) -> Result<Bytes, RpcError> {
    // Mapped first: the deadline's check then reads what a generated service's handler
    // would have answered.
    result.map_err(|e| past_deadline(RemoteError::into_rpc_error(e, codec), deadline, entry))
}

/// A handler's failure `e` (a unary answer's or a stream set-up's) as its caller gets it: the
/// timeout, naming `e`, when it came at or after the caller's `deadline` (see [`answered`]);
/// `e` itself when it came before, or is the timeout already, or is an answer of the
/// handler's own logic (business, validation, authentication).
pub(crate) fn past_deadline(
    e: RpcError,
    deadline: Option<(Instant, u32)>,
    entry: &str,
) -> RpcError {
    match deadline {
        Some((at, budget_ms))
            if e.code() != StatusCode::Timeout
                && !e.code().is_breaker_exempt()
                && Instant::now() >= at =>
        {
            RpcError::new(
                StatusCode::Timeout,
                format!(
                    "{entry} ran out of the caller's {budget_ms} ms budget; the handler failed \
                     at the deadline with: {e}"
                ),
            )
        }
        _ => e,
    }
}

impl Future for Guarded<'_> {
    type Output = Outcome;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        let this = &mut *self;
        let handler = &mut this.handler;
        let polled =
            rpc_governance::timeout::sync_with_inherited(this.deadline.map(|(d, _)| d), || {
                std::panic::catch_unwind(AssertUnwindSafe(|| handler.as_mut().poll(cx)))
            });
        match polled {
            Ok(Poll::Ready(result)) => {
                return Poll::Ready(Ok(answered(
                    result,
                    (this.deadline, this.codec),
                    this.entry,
                )))
            }
            Ok(Poll::Pending) => {}
            Err(panic) => return Poll::Ready(Err(panic)),
        }
        let Some((deadline, budget_ms)) = this.deadline else {
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        Poll::Ready(Ok(Err(RpcError::new(
            StatusCode::Timeout,
            format!(
                "{} ran out of the caller's {budget_ms} ms budget; the handler was stopped",
                this.entry
            ),
        ))))
    }
}

/// The handler's result (an answer, or a stream's set-up), or a panic turned into an error (520)
/// that names the entry.
///
/// The panic message may show a service's internals (paths, values, queries), so it is logged
/// here with the entry and a short panic id, and the caller receives the id to find it by;
/// the text itself only with `send_panic_text`.
pub(crate) fn settle<T>(
    outcome: std::thread::Result<Result<T, RpcError>>,
    entry: &str,
    send_panic_text: bool,
) -> Result<T, RpcError> {
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

pub(crate) fn to_message(result: Result<Bytes, RpcError>) -> RemoteResultMessage {
    match result {
        Ok(bytes) => RemoteResultMessage {
            status_code: StatusCode::Success.as_u32(),
            result: bytes,
            ..Default::default()
        },
        Err(e) => RemoteResultMessage {
            // An error never travels as a success: a layer's `RpcError` of status 200 goes as
            // the business error `carried` makes of a handler's.
            status_code: e.code().as_u32(),
            result: e.payload().map(|(_, p)| p.clone()).unwrap_or_default(),
            exception_message: e.message().to_string(),
            retry_after_ms: e
                .retry_after()
                .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX)),
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rpc_core::{GovernanceOverrides, Service, ServiceFuture};

    /// One entry, `t.T.m`, with no overrides (shared by the crate's unit tests).
    pub(crate) static METHODS: [MethodDescriptor; 1] = [MethodDescriptor {
        service_id: "t.T",
        method: "m",
        entry_id: "t.T.m",
        hash_key: None,
        governance: GovernanceOverrides::NONE,
        api: None,
    }];

    /// Answers every call with its arguments, at once.
    struct Echo;

    impl Service for Echo {
        fn service_id(&self) -> &'static str {
            "t.T"
        }
        fn methods(&self) -> &'static [MethodDescriptor] {
            &METHODS
        }
        fn call(&self, _method: usize, params: Bytes, _codec: Codec) -> ServiceFuture {
            Box::pin(async move { Ok(params) })
        }
    }

    fn invoke(timeout_ms: u32) -> Invoke {
        Invoke {
            message_id: 1,
            service_entry_id: "t.T.m".into(),
            parameters: Bytes::from_static(b"\x91\xa2hi"),
            timeout_ms,
            ..Default::default()
        }
    }

    /// The future a call runs as, boxed per call, stays in the small allocations the allocator
    /// serves from its per-thread cache. (The bound is the allocator's, not this code's: glibc's
    /// thread cache holds blocks up to about 1 KiB; the future this replaced was larger, and
    /// every call took the allocator's slow path.)
    #[test]
    fn a_call_runs_as_a_future_of_less_than_half_a_kib() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        let _entered = rt.enter();
        let dispatcher = crate::Server::builder().add_service(Echo).dispatcher(
            SocketAddr::from(([127, 0, 0, 1], 1)),
            "127.0.0.1:1",
            &rpc_governance::bulkhead::Bulkhead::new(50),
        );
        let caller = Arc::new(Caller::new(SocketAddr::from(([127, 0, 0, 1], 2)), "c"));
        for timeout_ms in [0, 800] {
            let Dispatch::Spawn(call) = dispatcher.handle(invoke(timeout_ms), &caller) else {
                panic!("expected the call to be spawned")
            };
            let size = std::mem::size_of_val(&*call);
            assert!(size <= 512, "the call's future is {size} bytes");
        }
    }
}
