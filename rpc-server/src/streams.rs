//! Streaming calls on the server: admission as for a unary call, then the handler's set-up and
//! its items as the events the transport sends, under the caller's deadline, with the entry's
//! slot held until the stream ends.
//!
//! An open stream counts as one running call of its entry (the cap and adaptive limit see it)
//! and of its connection, from its admission until its end, however it ends: complete, an
//! error item, the deadline (519), `Cancel`, the connection's end or the drain deadline. The
//! transport polls the events only while the client has credit, so a handler's stream is
//! never asked for more items than the client's window holds.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{Stream, StreamExt};
use rpc_core::wire::RemoteResultMessage;
use rpc_core::{
    ByteStream, Codec, RemoteError, RpcContext, RpcError, RpcStream, StatusCode, StreamFuture,
    StreamMode,
};
use rpc_governance::events::EventKind;
use rpc_governance::fallback;
use rpc_transport::{error_result, Caller, Dispatch, Invoke, ItemSink, StreamEvent, StreamEvents};
use tokio::time::Instant;

use crate::admission::{Admission, Slot};
use crate::dispatch::{
    settle, to_message, with_load, Dispatcher, FallbackTo, Layered, Outcome, Route,
};
use crate::middleware::{ServerRequest, StreamEndHooks, StreamSlot};
use crate::telemetry;

/// The answer to a call whose shape is not its method's.
pub(crate) fn mode_mismatch(route: &Route, sent: i32) -> RemoteResultMessage {
    let sent = StreamMode::try_from(sent).map_or_else(|_| format!("mode {sent}"), describe);
    error_result(
        StatusCode::FrameworkError,
        format!(
            "{} is {}, and was called as {sent}; client and server must share the service \
             definition",
            route.method.entry_id,
            describe(route.stream)
        ),
    )
}

fn describe(mode: StreamMode) -> String {
    match mode {
        StreamMode::Unary => "a unary method",
        StreamMode::Server => "a server-streaming method",
        StreamMode::Client => "a client-streaming method",
        StreamMode::Bidi => "a bidirectional streaming method",
    }
    .to_string()
}

/// The status of the failure a server fallback answered a stream's set-up for, once it did:
/// told by the set-up, read by the stream's watch at the end (its span's
/// `rpc.fallback.cause`, its outcome `fallback`).
#[derive(Clone, Default)]
pub(crate) struct FallbackCause(Arc<AtomicU32>);

impl FallbackCause {
    pub(crate) fn set(&self, cause: StatusCode) {
        self.0.store(cause.as_u32(), Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> Option<StatusCode> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            code => Some(StatusCode::from_u32(code)),
        }
    }
}

/// Admits a streaming call and hands the transport its events; see the module documentation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dispatch(
    d: &Dispatcher,
    route: &Route,
    invoke: Invoke,
    inbound: Option<ByteStream>,
    codec: Codec,
    attachments: BTreeMap<String, String>,
    (span, trace): (tracing::Span, telemetry::Carried),
    caller: &Arc<Caller>,
) -> Dispatch {
    if let Some(chain) = &route.layered {
        return layered(
            d,
            route,
            chain.clone(),
            (invoke, inbound),
            codec,
            attachments,
            (span, trace),
            caller,
        );
    }
    let permit = match d.admit(route, caller, &attachments, invoke.timeout_ms, &span) {
        Ok(p) => p.for_stream(),
        Err(refused) => return refused,
    };
    let mut invoke = invoke;
    if let Err(refused) = d.unpack(Some(route), &mut invoke, caller, &span) {
        return refused;
    }
    let deadline = (invoke.timeout_ms > 0).then(|| {
        (
            Instant::now() + Duration::from_millis(invoke.timeout_ms.into()),
            invoke.timeout_ms,
        )
    });
    let attachments = telemetry::user_attachments(attachments);
    let invoke_depth = invoke.retry_depth;
    // The caller's items, counted as the handler takes them (for the span).
    let received = Arc::new(AtomicU64::new(0));
    let inbound = inbound.map(|items| {
        let counter = received.clone();
        RpcStream::try_new(items.inspect(move |item| {
            if item.is_ok() {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }))
    });
    let parameters = route.fallback.as_ref().map(|_| invoke.parameters.clone());
    let setup = carried(
        crate::dispatch::panic_at_poll(|| {
            route
                .service
                .call_stream(route.index, invoke.parameters, inbound, codec)
        }),
        codec,
    );
    let cause = FallbackCause::default();
    let setup = with_fallback(
        setup,
        route.fallback.as_ref(),
        route.stream,
        (parameters, codec),
        deadline,
        &cause,
    );
    let setup = in_context(setup, attachments, invoke_depth);
    Dispatch::Events(Box::pin(ServerStream::new(
        d,
        route,
        caller,
        (span, trace),
        (setup, deadline, cause),
        Some(permit),
        received,
        None,
    )))
}

/// A stream on a server with layers: the layers see its set-up as a call (they may refuse it,
/// change its attachments, look at its outcome), the end of their chain admits it at the
/// entry and sets the handler's stream up (handing it the caller's items, for a stream taking
/// them), and its items then flow as on a server without layers, within the same deadline.
/// A client or bidirectional stream is accepted before its layers run (the caller's items
/// wait within their window meanwhile), so a layer's refusal ends it after acceptance; it is
/// admitted at its entry before that, so that a refusal there (515, 429) still comes before
/// the acceptance.
#[allow(clippy::too_many_arguments)]
fn layered(
    d: &Dispatcher,
    route: &Route,
    chain: Arc<Layered>,
    (invoke, inbound): (Invoke, Option<ByteStream>),
    codec: Codec,
    attachments: BTreeMap<String, String>,
    (span, trace): (tracing::Span, telemetry::Carried),
    caller: &Arc<Caller>,
) -> Dispatch {
    let entry = route.method.entry_id;
    let deadline = (invoke.timeout_ms > 0).then(|| {
        (
            Instant::now() + Duration::from_millis(invoke.timeout_ms.into()),
            invoke.timeout_ms,
        )
    });
    // A client or bidirectional stream is accepted before its layers run: it is admitted at
    // its entry (rate limits, cap) first, as without layers, so that a refusal (515, 429) is
    // sent before the acceptance, when the caller may still go elsewhere.
    let admitted = if route.stream == StreamMode::Server {
        None
    } else {
        match d.admit(route, caller, &attachments, invoke.timeout_ms, &span) {
            Ok(slot) => Some(slot.for_stream()),
            Err(refused) => return refused,
        }
    };
    // Decompressed once admitted here, before the layers, which may read the arguments.
    let mut invoke = invoke;
    let took_tokens = admitted.as_ref().map(|_| route);
    if let Err(refused) = d.unpack(took_tokens, &mut invoke, caller, &span) {
        return refused;
    }
    let opened = StreamSlot::default();
    let hooks = StreamEndHooks::default();
    // The caller's items, counted as the handler takes them (for the span and the hooks).
    let received = Arc::new(AtomicU64::new(0));
    let inbound = inbound.map(|items| {
        let counter = received.clone();
        RpcStream::try_new(items.inspect(move |item| {
            if item.is_ok() {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }))
    });
    let mut req = ServerRequest {
        method: route.method,
        caller: caller.clone(),
        attachments: telemetry::user_attachments(attachments),
        retry_depth: invoke.retry_depth,
        deadline,
        parameters: invoke.parameters,
        codec,
        fallback_cause: None,
        load: None,
        stream: Some(opened.clone()),
        inbound: inbound.map(|items| Arc::new(std::sync::Mutex::new(Some(items)))),
        stream_end: Some(hooks.clone()),
        admitted,
        reported: None,
    };
    let cause = FallbackCause::default();
    let told = cause.clone();
    let setup: StreamFuture = Box::pin(async move {
        let started = Layered::start(&chain, &mut req).await;
        req.take_reported();
        // Whatever the layers' outcome: a fallback that ran and failed still says what it
        // answered for.
        if let Some(c) = req.fallback_cause {
            told.set(c);
        }
        started?;
        let items = opened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        items.ok_or_else(|| {
            RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "{entry} streams, and a server layer answered its set-up itself: a layer \
                     must hand a stream on with next.run or refuse it with an error"
                ),
            )
        })
    });
    // The items hold the entry's slot, taken at the end of the chain.
    Dispatch::Events(Box::pin(ServerStream::new(
        d,
        route,
        caller,
        (span, trace),
        (setup, deadline, cause),
        None,
        received,
        Some((hooks, Instant::now())),
    )))
}

/// `setup` and then each poll of its items run in the caller's context (`attachments` and
/// `retry_depth`), so the calls the handler makes carry them on, while it sets up and while it
/// produces items alike (items encoded as they are taken stay so); with no context, `setup`
/// as it is.
pub(crate) fn in_context(
    setup: StreamFuture,
    attachments: std::collections::BTreeMap<String, String>,
    retry_depth: u32,
) -> StreamFuture {
    if attachments.is_empty() && retry_depth == 0 {
        return setup;
    }
    let context = Arc::new(attachments);
    Box::pin(async move {
        let items = RpcContext::scope_shared(context.clone(), retry_depth, setup).await?;
        Ok(items.in_context(context, retry_depth))
    })
}

/// `setup` answered, should it fail with an error a server fallback applies to, by the
/// fallback's own stream (given the call's `parameters` in `codec`): for a server stream only
/// (a stream taking the caller's items was accepted before its handler ran, and its items may
/// be spent), and only for the set-up's error or panic. The failure's status is told to
/// `cause` when the fallback runs. Past the caller's `deadline` the fallback does not start
/// (event `fallback_skipped`), as for a unary call: nobody would read its stream.
pub(crate) fn with_fallback(
    setup: StreamFuture,
    fallback: Option<&Arc<FallbackTo>>,
    mode: StreamMode,
    (parameters, codec): (Option<Bytes>, Codec),
    deadline: Option<(Instant, u32)>,
    cause: &FallbackCause,
) -> StreamFuture {
    let (Some(to), StreamMode::Server, Some(parameters)) = (fallback, mode, parameters) else {
        return setup;
    };
    let to = to.clone();
    let cause = cause.clone();
    Box::pin(async move {
        // Stopped at the caller's deadline with the set-up still running (the stream ends
        // 519): the fallback that would answer for that timeout does not start, as for a
        // unary call, and `fallback_skipped` says so.
        let mut at_deadline = SkippedAtDeadline {
            to: Some(to.clone()),
            deadline,
        };
        // A set-up that panics failed as a unary handler that panics does (520), so the
        // fallback answers for it too.
        let outcome = futures_util::FutureExt::catch_unwind(AssertUnwindSafe(setup)).await;
        at_deadline.to = None;
        let e = match settle(outcome, &to.entry_id, to.send_panic_text) {
            Err(e) if fallback::applies(&e, fallback::Side::Server) => e,
            other => return other,
        };
        if to.skipped_past(deadline, &e) {
            return Err(e);
        }
        cause.set(e.code());
        to.events.emit_parts(
            EventKind::Fallback,
            &to.entry_id,
            Some(&to.endpoint),
            0,
            Some(e.to_string()),
        );
        // The fallback's set-up panicking fails as it would for a unary call: 509, naming
        // both failures (not a 520 blaming the handler).
        let fallback_setup = crate::dispatch::panic_at_poll(|| {
            to.service.call_stream(to.index, parameters, None, codec)
        });
        let answer = fallback::with_cause(e.clone(), async {
            let outcome =
                futures_util::FutureExt::catch_unwind(AssertUnwindSafe(fallback_setup)).await;
            settle(outcome, &to.entry_id, to.send_panic_text)
        })
        .await;
        fallback::outcome(&to.entry_id, e, answer)
    })
}

/// While a stream's set-up runs under a server fallback: dropped then (the stream stopped),
/// once the caller's deadline has passed, the fallback's `fallback_skipped` for that timeout.
struct SkippedAtDeadline {
    to: Option<Arc<crate::dispatch::FallbackTo>>,
    deadline: Option<(Instant, u32)>,
}

impl Drop for SkippedAtDeadline {
    fn drop(&mut self) {
        let (Some(to), Some((_, budget_ms))) = (&self.to, self.deadline) else {
            return;
        };
        let timeout = RpcError::new(
            StatusCode::Timeout,
            format!(
                "{} ran out of the caller's {budget_ms} ms budget; the set-up was stopped",
                to.entry_id
            ),
        );
        to.skipped_past(self.deadline, &timeout);
    }
}

/// The handler's stream `setup`, its failure sent as a unary handler's is (see
/// `dispatch::answered`): a hand-written service's set-up passing on a downstream 507 must not
/// read to the caller as "nothing ran here".
pub(crate) fn carried(setup: StreamFuture, codec: Codec) -> StreamFuture {
    Box::pin(async move {
        setup
            .await
            .map_err(|e| RemoteError::into_rpc_error(e, codec))
    })
}

/// `items`, holding the entry's slot `permit` until they are dropped.
pub(crate) fn holding(items: ByteStream, permit: Slot) -> ByteStream {
    RpcStream::try_new(items.map(move |item| {
        let _held = &permit;
        item
    }))
}

/// One stream being served: the handler's set-up, then its items, under the deadline; every
/// poll of the handler's code catches a panic (520) and runs inside the caller's deadline as
/// the one its own calls inherit.
struct ServerStream {
    /// The caller streams its items (client and bidirectional streaming): the stream is
    /// accepted before the handler runs, since the handler takes them.
    accept_first: bool,
    /// The caller gets one answer: the handler's one item.
    client_streaming: bool,
    /// `Accepted` was produced.
    accepted: bool,
    setup: Option<StreamFuture>,
    items: Option<ByteStream>,
    deadline: Option<(Instant, u32)>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    entry: &'static str,
    /// The entry's slot, held until the stream ends.
    permit: Option<Slot>,
    admission: Arc<Admission>,
    watch: telemetry::CallWatch,
    /// The failure a server fallback answered the set-up for, once it did.
    fallback_cause: FallbackCause,
    /// The caller's trace context, current while the layers, the set-up and the producer run.
    carried: telemetry::Carried,
    send_panic_text: bool,
    /// Items produced so far.
    sent: u64,
    /// The caller's items the handler took so far.
    received: Arc<AtomicU64>,
    ended: bool,
    /// The end produced, not yet recorded: recorded once the connection says what it sent
    /// ([`StreamEvents::settled`]), or when dropped.
    unrecorded: Option<Produced>,
    /// What server layers asked to be told as the stream ends, and when it started.
    end_hooks: Option<(StreamEndHooks, Instant)>,
}

impl ServerStream {
    /// A stream of `route` whose handler `setup` is to run within `deadline`, holding `permit`
    /// (its entry's slot, or `None` when the end of a layer chain takes it), with the caller's
    /// items counted in `received` and the layers' `end_hooks`.
    #[allow(clippy::too_many_arguments)]
    fn new(
        d: &Dispatcher,
        route: &Route,
        caller: &Arc<Caller>,
        (span, carried): (tracing::Span, telemetry::Carried),
        (setup, deadline, fallback_cause): (StreamFuture, Option<(Instant, u32)>, FallbackCause),
        permit: Option<Slot>,
        received: Arc<AtomicU64>,
        end_hooks: Option<(StreamEndHooks, Instant)>,
    ) -> Self {
        let entry = route.method.entry_id;
        ServerStream {
            accept_first: route.stream != StreamMode::Server,
            client_streaming: route.stream == StreamMode::Client,
            accepted: false,
            setup: Some(setup),
            items: None,
            deadline,
            timer: None,
            entry,
            permit,
            admission: route.admission.clone(),
            watch: telemetry::CallWatch::new(
                span,
                d.metrics.start(route.method),
                deadline.map(|(d, _)| d),
                &d.calls,
                entry,
            )
            .reporting_timeouts(&route.admission, entry, caller),
            fallback_cause,
            carried,
            send_panic_text: d.send_panic_text,
            sent: 0,
            received,
            ended: false,
            unrecorded: None,
            end_hooks,
        }
    }

    /// The stream's end once the caller's deadline passed (`cx` woken then).
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<Poll<Option<StreamEvent>>> {
        let Some((deadline, budget_ms)) = self.deadline else {
            return Poll::Pending;
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        let e = RpcError::new(
            StatusCode::Timeout,
            format!(
                "{} ran out of the caller's {budget_ms} ms budget after {} stream items; the \
                 stream was stopped",
                self.entry, self.sent
            ),
        );
        Poll::Ready(self.end(Err(e)))
    }

    fn end(&mut self, result: Result<Bytes, RpcError>) -> Poll<Option<StreamEvent>> {
        // A failure at or past the caller's deadline (of the set-up, an item, a panic, the
        // layers) is the timeout, as a unary call's is.
        let result =
            result.map_err(|e| crate::dispatch::past_deadline(e, self.deadline, self.entry));
        // (The load the answer reports still counts this stream, as a unary call's does.)
        let load = self.admission.load();
        let set_up = self.release();
        let message = with_load(to_message(result.clone()), load);
        self.unrecorded = Some(Produced {
            result,
            status: message.status_code,
            set_up,
        });
        Poll::Ready(Some(StreamEvent::End(Box::new(message))))
    }

    /// Ends the stream here: the handler's stream goes first, then the entry's slot. Whether
    /// the set-up had succeeded (layers hear of the end of such a stream only).
    fn release(&mut self) -> bool {
        self.ended = true;
        let set_up = self.items.is_some();
        // The handler's code is dropped as it ran: in the caller's trace context and the call's
        // span, wherever the end is noticed (a set-up dropped at the deadline says
        // `fallback_skipped` there, as in a poll).
        let _carried = telemetry::attached(&self.carried);
        let span = self.watch.span().clone();
        let _in_span = span.enter();
        self.setup = None;
        self.items = None;
        self.permit = None;
        set_up
    }

    /// Records the stream's end as `result` (the span, the metrics, the call observers, and
    /// the layers' hooks when its set-up had succeeded).
    /// The hooks run first: one that panics makes the stream's end 520 (the connection answers
    /// so, see `poll_guarded`), which is what is recorded then; the panic is returned, to go on.
    fn record(
        &mut self,
        result: &Result<Bytes, RpcError>,
        set_up: bool,
    ) -> Option<Box<dyn std::any::Any + Send>> {
        let panicked = if set_up {
            std::panic::catch_unwind(AssertUnwindSafe(|| self.run_end_hooks(Some(result)))).err()
        } else {
            None
        };
        let failed;
        let result = match panicked {
            None => result,
            Some(_) => {
                failed = Err(RpcError::new(
                    StatusCode::ServerError,
                    "a server layer's stream end hook panicked (in the server's log)",
                ));
                &failed
            }
        };
        self.watch
            .stream_items(self.sent, self.received.load(Ordering::Relaxed));
        self.watch.finish(result, self.fallback_cause.get());
        panicked
    }

    /// Tells the layers' hooks how the stream ended (`None`: stopped before its end).
    fn run_end_hooks(&mut self, result: Option<&Result<Bytes, RpcError>>) {
        let Some((hooks, started)) = self.end_hooks.take() else {
            return;
        };
        let hooks = std::mem::take(
            &mut *hooks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        if hooks.is_empty() {
            return;
        }
        // Layer code, as the rest of the call: within the caller's trace context and the
        // call's span (the stream may end outside any poll: its connection's word, a drop).
        let _carried = telemetry::attached(&self.carried);
        let span = self.watch.span().clone();
        let _in_span = span.enter();
        let error = result.and_then(|r| r.as_ref().err()).cloned();
        let end = rpc_governance::stack::StreamEnd {
            status: result.map(|r| {
                r.as_ref()
                    .map_or_else(RpcError::code, |_| StatusCode::Success)
            }),
            error,
            items_sent: self.sent,
            items_received: self.received.load(Ordering::Relaxed),
            elapsed: started.elapsed(),
        };
        for hook in hooks {
            hook(&end);
        }
    }

    /// Polls the handler's code once, inside the deadline, catching a panic. Without a
    /// deadline no scope is entered: the stream's task has none to shadow, and the handler's
    /// calls then see none either way (this runs once per item).
    fn guarded<T>(
        deadline: Option<(Instant, u32)>,
        poll: impl FnOnce() -> Poll<T>,
    ) -> std::thread::Result<Poll<T>> {
        match deadline {
            Some((d, _)) => rpc_governance::timeout::sync_with_inherited(Some(d), || {
                std::panic::catch_unwind(AssertUnwindSafe(poll))
            }),
            None => std::panic::catch_unwind(AssertUnwindSafe(poll)),
        }
    }
}

impl Drop for ServerStream {
    fn drop(&mut self) {
        if let Some(p) = self.unrecorded.take() {
            // Ended, and dropped before the connection said what it sent (a transport that
            // does not tell, or a writer that stopped): recorded as produced. (A hook's panic
            // is not carried on out of a drop.)
            let _ = self.record(&p.result, p.set_up);
        } else if !self.ended {
            // Stopped before its end: `Cancel`, the connection's end, the drain.
            self.watch
                .stream_items(self.sent, self.received.load(Ordering::Relaxed));
            if self.items.is_some() {
                // (A hook's panic is not carried on out of a drop: it would unwind out of the
                // call's task, which drops the stream.)
                let _ = std::panic::catch_unwind(AssertUnwindSafe(|| self.run_end_hooks(None)));
            }
            self.release();
        }
    }
}

impl Stream for ServerStream {
    type Item = StreamEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<StreamEvent>> {
        self.poll_event(cx, None)
    }
}

impl StreamEvents for ServerStream {
    fn poll_items_into(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        sink: &mut ItemSink<'_>,
    ) -> Poll<Option<StreamEvent>> {
        self.poll_event(cx, Some(sink))
    }

    /// Records the end the caller gets: the one produced, or the connection's in its place
    /// (the caller's failed request stream, a protocol violation), with its status and
    /// message.
    fn settled(mut self: Pin<&mut Self>, end: &RemoteResultMessage) {
        let this = &mut *self;
        let (produced, set_up) = match this.unrecorded.take() {
            Some(p) => (Some((p.result, p.status)), p.set_up),
            None if !this.ended => (None, this.release()),
            None => return,
        };
        let result = match produced {
            Some((result, status)) if status == end.status_code => result,
            _ => Err(RpcError::new(
                StatusCode::from_u32(end.status_code),
                end.exception_message.clone(),
            )),
        };
        if let Some(panic) = this.record(&result, set_up) {
            std::panic::resume_unwind(panic);
        }
    }

    /// The deadline covers the time a stream waits for the caller's credit too.
    fn poll_ended(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RemoteResultMessage> {
        if self.ended {
            return Poll::Pending;
        }
        match self.poll_deadline(cx) {
            Poll::Ready(Poll::Ready(Some(StreamEvent::End(end)))) => Poll::Ready(*end),
            _ => Poll::Pending,
        }
    }
}

/// A stream's end as it produced it, before the connection said what it sent.
struct Produced {
    result: Result<Bytes, RpcError>,
    /// The status of the answer made of `result`.
    status: u32,
    /// Whether the set-up had succeeded (layers hear of the end of such a stream only).
    set_up: bool,
}

/// Why a run of items stopped.
enum Stop {
    /// The sink has no more room.
    Full,
    /// The handler's stream ended, or failed with this error.
    End(Result<Bytes, RpcError>),
}

impl ServerStream {
    /// The next event; with `sink`, items are encoded (or copied) into it, as many as it has
    /// room for, and [`StreamEvent::Appended`] returned once it is full.
    fn poll_event(
        &mut self,
        cx: &mut Context<'_>,
        sink: Option<&mut ItemSink<'_>>,
    ) -> Poll<Option<StreamEvent>> {
        let this = self;
        if this.ended {
            return Poll::Ready(None);
        }
        // The layers, the set-up and the producer run in the call's span, as a unary handler
        // does: their events are the call's, and the calls they make continue its trace. The
        // caller's trace context is made current first, the span entered after it: with the
        // span kept from OpenTelemetry by a filter, the calls still continue the caller's
        // trace; with the span seen, they are its children.
        let _carried = telemetry::attached(&this.carried);
        let span = this.watch.span().clone();
        let _in_span = span.enter();
        if let Poll::Ready(end) = this.poll_deadline(cx) {
            return end;
        }
        if this.accept_first && !this.accepted {
            // Admitted: the caller may send its items, which the handler takes.
            this.accepted = true;
            return Poll::Ready(Some(StreamEvent::Accepted));
        }
        if let Some(setup) = &mut this.setup {
            let outcome: Outcome = match Self::guarded(this.deadline, || setup.as_mut().poll(cx)) {
                Ok(Poll::Pending) => return Poll::Pending,
                Ok(Poll::Ready(Ok(items))) => {
                    this.setup = None;
                    this.items = Some(items);
                    if this.accepted {
                        return this.poll_event(cx, sink);
                    }
                    this.accepted = true;
                    return Poll::Ready(Some(StreamEvent::Accepted));
                }
                Ok(Poll::Ready(Err(e))) => Ok(Err(e)),
                Err(panic) => Err(panic),
            };
            let result = settle(outcome, this.entry, this.send_panic_text);
            return this.end(result);
        }
        let Some(items) = &mut this.items else {
            return Poll::Ready(None);
        };
        let sink = match sink {
            // A client stream's answer is its end, not an item.
            Some(sink) if !this.client_streaming => sink,
            _ => return this.poll_item(cx),
        };
        // One catch of a panic and one deadline scope for the whole run.
        let (sent_before, sent) = (this.sent, &mut this.sent);
        let run = Self::guarded(this.deadline, || loop {
            if !sink.has_room() {
                return Poll::Ready(Stop::Full);
            }
            match items.poll_next_into(cx, sink.begin()) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(len))) => {
                    sink.commit(len);
                    *sent += 1;
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Stop::End(Err(e))),
                Poll::Ready(None) => return Poll::Ready(Stop::End(Ok(Bytes::new()))),
            }
        });
        // Whatever an item wrote before it failed, ended or panicked is not an item.
        sink.abandon();
        let outcome: Outcome = match run {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(Stop::Full)) => {
                let appended = usize::try_from(this.sent - sent_before).unwrap_or(usize::MAX);
                return Poll::Ready(Some(StreamEvent::Appended(appended)));
            }
            Ok(Poll::Ready(Stop::End(end))) => Ok(end),
            Err(panic) => Err(panic),
        };
        let result = settle(outcome, this.entry, this.send_panic_text);
        this.end(result)
    }

    /// The next item (or end) of the handler's stream, as its own buffer (called by
    /// `poll_event`, in the call's span).
    fn poll_item(&mut self, cx: &mut Context<'_>) -> Poll<Option<StreamEvent>> {
        let this = self;
        let Some(items) = &mut this.items else {
            return Poll::Ready(None);
        };

        let outcome: Outcome = match Self::guarded(this.deadline, || items.poll_next_unpin(cx)) {
            Ok(Poll::Pending) => return Poll::Pending,
            // A client stream's answer: its end, counted as an item sent, as the caller counts
            // it received.
            Ok(Poll::Ready(Some(Ok(answer)))) if this.client_streaming => {
                this.sent += 1;
                Ok(Ok(answer))
            }
            Ok(Poll::Ready(Some(Ok(item)))) => {
                this.sent += 1;
                return Poll::Ready(Some(StreamEvent::Item(item)));
            }
            Ok(Poll::Ready(Some(Err(e)))) => Ok(Err(e)),
            Ok(Poll::Ready(None)) => Ok(Ok(Bytes::new())),
            Err(panic) => Err(panic),
        };
        let result = settle(outcome, this.entry, this.send_panic_text);
        this.end(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpc_core::{GovernanceOverrides, MethodDescriptor, RpcStream, Service, ServiceFuture};
    use rpc_transport::InvokeHandler;
    use std::net::SocketAddr;

    static METHODS: [MethodDescriptor; 1] = [MethodDescriptor {
        service_id: "t.S",
        method: "count",
        entry_id: "t.S.count",
        hash_key: None,
        governance: GovernanceOverrides::NONE,
        api: None,
    }];

    /// The server-streaming entry `t.S.count`, whose set-up is `setup`'s.
    struct Streams(fn() -> StreamFuture);

    impl Service for Streams {
        fn service_id(&self) -> &'static str {
            "t.S"
        }
        fn methods(&self) -> &'static [MethodDescriptor] {
            &METHODS
        }
        fn call(&self, _: usize, _: Bytes, _: Codec) -> ServiceFuture {
            Box::pin(async { Err(RpcError::new(StatusCode::FrameworkError, "unary")) })
        }
        fn stream_mode(&self, _: usize) -> StreamMode {
            StreamMode::Server
        }
        fn call_stream(&self, _: usize, _: Bytes, _: Option<ByteStream>, _: Codec) -> StreamFuture {
            (self.0)()
        }
    }

    /// Streams 1, 2, 3 encoded, then fails if asked for a fourth.
    fn count() -> Streams {
        Streams(|| {
            Box::pin(async {
                Ok(RpcStream::try_new(futures_util::stream::iter(vec![
                    Ok(Bytes::from_static(b"1")),
                    Ok(Bytes::from_static(b"2")),
                    Err(RpcError::new(StatusCode::BusinessError, "no more")),
                ])))
            })
        })
    }

    /// A set-up that never finishes.
    fn hangs() -> Streams {
        Streams(|| Box::pin(std::future::pending()))
    }

    /// `server`'s dispatcher (at 127.0.0.1:1, sharing `shared`) and a caller of it.
    fn dispatcher(
        server: crate::ServerBuilder,
        shared: &rpc_governance::bulkhead::Bulkhead,
    ) -> (Dispatcher, Arc<Caller>) {
        let d = server.dispatcher(SocketAddr::from(([127, 0, 0, 1], 1)), "127.0.0.1:1", shared);
        let caller = Arc::new(Caller::new(SocketAddr::from(([127, 0, 0, 1], 2)), "c"));
        (d, caller)
    }

    /// Each governance event's kind and the name of the span it was in.
    type Seen = Arc<std::sync::Mutex<Vec<(String, Option<String>)>>>;

    /// Records, for each governance event, its kind and the name of the span it is in.
    struct EventSpans(Seen);

    impl<S> tracing_subscriber::Layer<S> for EventSpans
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if event.metadata().target() != "rpc::governance" {
                return;
            }
            struct Kind(String);
            impl tracing::field::Visit for Kind {
                fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                    if field.name() == "event" {
                        self.0 = value.to_string();
                    }
                }
                fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
            }
            let mut kind = Kind(String::new());
            event.record(&mut kind);
            let span = ctx.event_span(event).map(|s| s.name().to_string());
            self.0.lock().unwrap().push((kind.0, span));
        }
    }

    /// A server stream's set-up still running at the caller's deadline, noticed while the
    /// connection waits (not in a poll of the stream's events): it is stopped, and the
    /// server fallback's `fallback_skipped` is on the call's span, as in a poll. Before, it
    /// was on no span, and a trace lost it.
    #[tokio::test(start_paused = true)]
    async fn a_set_up_stopped_at_the_deadline_outside_a_poll_says_so_on_the_calls_span() {
        use tracing_subscriber::layer::SubscriberExt;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        // A global subscriber wanting every callsite first: `tracing` caches a callsite's
        // interest process-wide, and one reached by another test's thread with no subscriber
        // would otherwise stay cached as unwanted (see tests/tests/common/mod.rs).
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
        });
        let _traced = tracing::subscriber::set_default(
            tracing_subscriber::registry().with(EventSpans(seen.clone())),
        );
        let shared = rpc_governance::bulkhead::Bulkhead::new(1);
        let (d, caller) = dispatcher(
            crate::Server::builder()
                .add_service(hangs())
                .fallback(count()),
            &shared,
        );
        let Dispatch::Events(mut events) = d.handle(
            Invoke {
                message_id: 1,
                service_entry_id: "t.S.count".into(),
                stream_mode: StreamMode::Server as i32,
                timeout_ms: 100,
                ..Default::default()
            },
            &caller,
        ) else {
            panic!("expected a stream")
        };
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(events.as_mut().poll_next(&mut cx).is_pending(), "set up");
        tokio::time::advance(Duration::from_millis(150)).await;
        let Poll::Ready(end) = events.as_mut().poll_ended(&mut cx) else {
            panic!("not ended at the deadline")
        };
        assert_eq!(end.status_code, StatusCode::Timeout.as_u32(), "{end:?}");
        let seen = seen.lock().unwrap().clone();
        let skipped: Vec<_> = seen
            .iter()
            .filter(|(k, _)| k == "fallback_skipped")
            .collect();
        assert_eq!(
            skipped,
            [&(
                "fallback_skipped".to_string(),
                Some("rpc.server".to_string())
            )],
            "{seen:?}"
        );
    }

    #[tokio::test]
    async fn a_stream_is_accepted_then_yields_its_items_then_its_error_end_and_holds_its_slot() {
        let shared = rpc_governance::bulkhead::Bulkhead::new(1);
        let (d, caller) = dispatcher(crate::Server::builder().add_service(count()), &shared);
        let invoke = |mode: StreamMode| Invoke {
            message_id: 1,
            service_entry_id: "t.S.count".into(),
            stream_mode: mode as i32,
            ..Default::default()
        };
        match d.handle(invoke(StreamMode::Unary), &caller) {
            Dispatch::Ready(r) => {
                assert_eq!(r.status_code, 500);
                assert!(r.exception_message.contains("server-streaming"), "{r:?}");
            }
            _ => panic!("a unary call of a streaming method is refused"),
        }
        let Dispatch::Events(mut events) = d.handle(invoke(StreamMode::Server), &caller) else {
            panic!("expected a stream")
        };
        // The cap of 1 is held by the open stream.
        match d.handle(invoke(StreamMode::Server), &caller) {
            Dispatch::Ready(r) => assert_eq!(r.status_code, 515),
            _ => panic!("the second stream is over the cap"),
        }
        let mut seen = Vec::new();
        while let Some(e) = events.next().await {
            seen.push(e);
        }
        assert_eq!(seen[0], StreamEvent::Accepted);
        assert_eq!(seen[1], StreamEvent::Item(Bytes::from_static(b"1")));
        assert_eq!(seen[2], StreamEvent::Item(Bytes::from_static(b"2")));
        match &seen[3] {
            StreamEvent::End(r) => {
                assert_eq!((r.status_code, &*r.exception_message), (1000, "no more"))
            }
            other => panic!("expected the end, got {other:?}"),
        }
        assert_eq!(seen.len(), 4);
        // The slot is back.
        assert!(matches!(
            d.handle(invoke(StreamMode::Server), &caller),
            Dispatch::Events(_)
        ));
    }
}
