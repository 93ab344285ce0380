//! The server's observability: the `rpc.server` span of each handled call, the incoming call
//! context and, with feature `otel`, the W3C trace context as the span's parent and the
//! OpenTelemetry metrics.
//!
//! Integer attributes are recorded as `i64`: `tracing-opentelemetry` exports other integer
//! types as strings.
//!
//! Without a subscriber the span is disabled after one check of its callsite's interest and
//! nothing here allocates or formats; without feature `otel` the metrics are zero-sized no-ops.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bytes::Bytes;
use rpc_core::{
    Compression, MethodDescriptor, RpcError, StatusCode, CALL_ID_KEY, TRACE_CONTEXT_KEYS,
};
use rpc_governance::calls::{CallObservers, Side};
use rpc_governance::events::EventKind;
use std::sync::Arc;
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::Span;

/// The span of one handled call. With feature `otel`, its parent is the caller's attempt span
/// named by the `traceparent` attachment.
pub(crate) fn server_span(
    method: &'static MethodDescriptor,
    local: SocketAddr,
    peer: SocketAddr,
    (attachments, carried): (&BTreeMap<String, String>, &Carried),
) -> Span {
    let span = tracing::info_span!(
        "rpc.server",
        otel.kind = "server",
        rpc.system = "rpc",
        rpc.service = method.service_id,
        rpc.method = method.method,
        rpc.entry_id = method.entry_id,
        server.address = display(local.ip()),
        server.port = i64::from(local.port()),
        client.address = display(peer.ip()),
        client.port = i64::from(peer.port()),
        call_id = Empty,
        rpc.status_code = Empty,
        outcome = Empty,
        rpc.fallback.cause = Empty,
        rpc.stream.items_sent = Empty,
        rpc.stream.items_received = Empty,
        rpc.compression = Empty,
        rpc.request.size = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    );
    if let Some(id) = attachments.get(CALL_ID_KEY).filter(|id| is_call_id(id)) {
        span.record("call_id", id.as_str());
    }
    #[cfg(feature = "otel")]
    otel::set_parent(&span, carried);
    #[cfg(not(feature = "otel"))]
    let _ = carried;
    span
}

/// Records on a call's span that its parameters came compressed: the algorithm
/// (`rpc.compression`, as the caller's attempt span names it) and their size once decompressed
/// (`rpc.request.size`). Nothing for parameters that came plain.
pub(crate) fn record_compression(span: &Span, compression: i32, size: usize) {
    if span.is_disabled() {
        return;
    }
    if let Some(algorithm) = Compression::from_wire(compression).filter(|a| *a != Compression::Off)
    {
        span.record("rpc.compression", algorithm.name());
        span.record("rpc.request.size", size as i64);
    }
}

/// Whether `id` is a call id as clients send one: 1 to 16 hex digits (8 from this framework's
/// client). Anything else, from a peer, is not recorded: the id is printed bare on log lines,
/// where a newline or an escape code could forge lines or drive a terminal.
fn is_call_id(id: &str) -> bool {
    (1..=16).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Records how the call ended: `rpc.status_code` and, on a failure of the server, `otel.status_code
/// = "ERROR"` with the error as the description. The callee's own answers (business and
/// validation errors, the application's authentication refusals) leave the status unset: the
/// server did what it was asked, as OpenTelemetry's RPC conventions have server spans say.
pub(crate) fn record_result(span: &Span, result: &Result<Bytes, RpcError>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(_) => {
            span.record("rpc.status_code", i64::from(StatusCode::Success.as_u32()));
        }
        Err(e) => record_error(span, e.code(), e.message()),
    }
}

/// [`record_result`] for an error known by its parts.
pub(crate) fn record_error(span: &Span, code: StatusCode, message: &str) {
    if span.is_disabled() {
        return;
    }
    span.record("rpc.status_code", i64::from(code.as_u32()));
    if !code.is_callee_answer() {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_description", message);
    }
}

/// Watches one handled call: however it ends (an answer, a fallback's answer, or its future
/// dropped by the caller's `Cancel` or at its deadline), its span, its metrics and the
/// server's call observers say so.
pub(crate) struct CallWatch {
    span: Span,
    metrics: CallGuard,
    /// When the call started; read only when something watches (the span or the metrics), so
    /// an unobserved call pays no clock reading for it.
    started: Option<Instant>,
    deadline: Option<Instant>,
    /// The server's call observers and the entry, when any observes calls.
    observed: Option<(CallObservers, &'static str)>,
    /// Where a call that ends with 519 is reported (at the caller's deadline, or a stream
    /// without one stalled past the idle timeout): the server's event bus, the entry and its
    /// caller (event `timeout`).
    timeouts: Option<(
        Arc<crate::admission::Admission>,
        &'static str,
        Arc<rpc_transport::Caller>,
    )>,
    done: bool,
}

impl CallWatch {
    /// The call's span.
    pub(crate) fn span(&self) -> &Span {
        &self.span
    }

    /// Records on the call's span the items a stream sent and received, as it ends.
    pub(crate) fn stream_items(&self, sent: u64, received: u64) {
        if !self.span.is_disabled() {
            // (As i64: OpenTelemetry has no unsigned integers.)
            let n = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            self.span.record("rpc.stream.items_sent", n(sent));
            self.span.record("rpc.stream.items_received", n(received));
        }
        self.metrics.items(sent, received);
    }

    pub(crate) fn new(
        span: Span,
        metrics: CallGuard,
        deadline: Option<Instant>,
        observers: &CallObservers,
        entry: &'static str,
    ) -> Self {
        let observed = observers.is_active().then(|| (observers.clone(), entry));
        let watched = !span.is_disabled() || cfg!(feature = "otel") || observed.is_some();
        CallWatch {
            span,
            metrics,
            started: watched.then(Instant::now),
            deadline,
            observed,
            timeouts: None,
            done: false,
        }
    }

    /// Reports a call of `entry` from `caller` that ends with 519 (at its deadline, whether its
    /// handler failed at it or was dropped there, or a stream without one stalled past the
    /// idle timeout) as event `timeout` on `events`, as a client reports its own.
    /// (The entry's admission, which the call holds anyway, carries the server's event bus:
    /// a clone of one `Arc` a call, not of the bus.)
    pub(crate) fn reporting_timeouts(
        mut self,
        admission: &Arc<crate::admission::Admission>,
        entry: &'static str,
        caller: &Arc<rpc_transport::Caller>,
    ) -> Self {
        self.timeouts = Some((admission.clone(), entry, caller.clone()));
        self
    }

    /// Event `timeout`, when reported, with `why`.
    fn timed_out(&self, why: &str) {
        if let Some((admission, entry, caller)) = &self.timeouts {
            self.span.in_scope(|| {
                admission.events().emit_parts(
                    EventKind::Timeout,
                    &Arc::from(*entry),
                    Some(&caller.peer().to_string()),
                    0,
                    Some(why.to_string()),
                )
            });
        }
    }

    fn tell(&self, status: Option<StatusCode>, outcome: &'static str) {
        if let (Some((observers, entry)), Some(started)) = (&self.observed, self.started) {
            observers.ended(Side::Server, entry, started, status, outcome);
        }
    }

    /// The call ended with `result`; `fallback` is the handler's failure a fallback answered
    /// for, if one did.
    pub(crate) fn finish(
        &mut self,
        result: &Result<Bytes, RpcError>,
        fallback: Option<StatusCode>,
    ) {
        self.done = true;
        record_result(&self.span, result);
        match (result, fallback) {
            (Ok(_), Some(cause)) => {
                if !self.span.is_disabled() {
                    self.span.record("outcome", "fallback");
                    self.span
                        .record("rpc.fallback.cause", i64::from(cause.as_u32()));
                    // Answered: not a failed call, whatever the failure logged inside the span
                    // (a panic's error-level line would otherwise mark it ERROR).
                    self.span.record("otel.status_code", "OK");
                }
                self.metrics.finish(cause, "fallback");
                self.tell(Some(cause), "fallback");
            }
            (Ok(_), None) => {
                self.span.record("outcome", "success");
                self.metrics.finish(StatusCode::Success, "success");
                self.tell(Some(StatusCode::Success), "success");
            }
            (Err(e), fallback) => {
                let code = e.code();
                if code == StatusCode::Timeout {
                    self.timed_out(e.message());
                }
                let outcome = code.outcome();
                self.span.record("outcome", outcome);
                if let Some(cause) = fallback {
                    // A fallback ran and failed: the span still says what it answered for.
                    self.span
                        .record("rpc.fallback.cause", i64::from(cause.as_u32()));
                }
                self.metrics.finish(code, outcome);
                self.tell(Some(code), outcome);
            }
        }
    }
}

/// Why a call's handler was dropped before it finished.
#[derive(Clone, Copy)]
enum Dropped {
    /// At the caller's deadline: answered 519.
    Timeout,
    /// At the server's drain deadline: answered 520.
    Drain,
    /// By the caller's `Cancel` or its connection's end: not answered.
    Cancelled,
    /// By the caller's `Cancel` saying another attempt of the call (a hedge) answered first:
    /// not answered, and no failure (the call succeeded).
    Superseded,
    /// By the server stopping at once (`ServerHandle::abort`): not answered.
    Aborted,
}

impl Dropped {
    /// The status (if the caller is answered one) and `rpc.outcome` it is recorded with.
    fn recorded(self) -> (Option<StatusCode>, &'static str) {
        match self {
            Dropped::Timeout => (Some(StatusCode::Timeout), "timeout"),
            Dropped::Drain => (Some(StatusCode::ServerError), "error"),
            Dropped::Cancelled => (None, "cancelled"),
            Dropped::Superseded => (None, "superseded"),
            Dropped::Aborted => (None, "aborted"),
        }
    }
}

impl Drop for CallWatch {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let now = Instant::now();
        if self.deadline.is_some_and(|d| now >= d) {
            // (Whether or not anything else watches the call.)
            self.timed_out("the handler was dropped at the caller's deadline");
        }
        let Some(started) = self.started else {
            return;
        };
        // Why the handler is dropped, as the caller learns it: its own deadline (519), the
        // server's drain deadline (520), its `Cancel` or its connection's end, or the server
        // stopping at once (no answer).
        let why = if self.deadline.is_some_and(|d| now >= d) {
            Dropped::Timeout
        } else if rpc_transport::dropped_at_drain_deadline() {
            Dropped::Drain
        } else if rpc_transport::dropped_as_superseded() {
            Dropped::Superseded
        } else if rpc_transport::dropped_at_server_abort() {
            Dropped::Aborted
        } else {
            Dropped::Cancelled
        };
        let (status, outcome) = why.recorded();
        self.metrics.dropped(status, outcome);
        self.tell(status, outcome);
        if self.span.is_disabled() {
            return;
        }
        let elapsed_ms = now.saturating_duration_since(started).as_millis() as u64;
        let budget_ms = self.deadline.map_or(0, |d| {
            d.saturating_duration_since(started)
                .as_micros()
                .div_ceil(1000) as u64
        });
        let budget = match self.deadline {
            Some(_) => format!("{budget_ms} ms budget"),
            None => "no deadline".to_string(),
        };
        if let Some(status) = status {
            self.span
                .record("rpc.status_code", i64::from(status.as_u32()));
        }
        let description = match why {
            Dropped::Timeout => {
                format!("handler dropped at the caller's deadline after {elapsed_ms} ms ({budget})")
            }
            Dropped::Drain => format!(
                "handler dropped at the server's drain deadline after {elapsed_ms} ms ({budget}); \
                 the caller was answered 520"
            ),
            Dropped::Cancelled => {
                format!("handler cancelled by the caller after {elapsed_ms} ms ({budget})")
            }
            Dropped::Superseded => format!(
                "handler stopped after {elapsed_ms} ms ({budget}): another attempt of the \
                 hedged call answered first"
            ),
            Dropped::Aborted => format!(
                "handler dropped after {elapsed_ms} ms ({budget}): the server was stopped at once \
                 (abort), and the caller was not answered"
            ),
        };
        self.span.record("outcome", outcome);
        if !matches!(why, Dropped::Superseded) {
            self.span.record("otel.status_code", "ERROR");
            self.span
                .record("otel.status_description", description.as_str());
        }
        self.span
            .in_scope(|| tracing::debug!(elapsed_ms, budget_ms, outcome, "{description}"));
    }
}

/// The caller's trace context a received call carries (`traceparent`/`tracestate`), for its
/// handler to run under (see [`with_carried`]); nothing without feature `otel`.
#[cfg(feature = "otel")]
pub(crate) type Carried = Option<opentelemetry::Context>;
/// The caller's trace context a received call carries: nothing without feature `otel`.
#[cfg(not(feature = "otel"))]
pub(crate) struct Carried;

/// The caller's trace context in `attachments` (as received), when it holds a valid one.
pub(crate) fn carried(attachments: &BTreeMap<String, String>) -> Carried {
    #[cfg(feature = "otel")]
    return otel::carried(attachments);
    #[cfg(not(feature = "otel"))]
    {
        let _ = attachments;
        Carried
    }
}

/// Runs `f`, a poll of a handler, with `carried` as OpenTelemetry's current context: the spans
/// of the calls the handler makes are then the caller's children when the call's `rpc.server`
/// span is kept from OpenTelemetry (a filter turned it off, or the OpenTelemetry layer's own
/// filter left it out), where they would start traces of their own. With the span seen, they
/// are its children as before (the span comes first).
pub(crate) fn in_carried<R>(carried: &Carried, f: impl FnOnce() -> R) -> R {
    let _attached = attached(carried);
    f()
}

/// `carried` made OpenTelemetry's current context until the guard returned is dropped, as
/// [`in_carried`] does for one closure: enter the call's span after it, so that the span,
/// when OpenTelemetry sees it, comes first.
#[must_use]
pub(crate) fn attached(carried: &Carried) -> Attached {
    #[cfg(feature = "otel")]
    return carried.as_ref().map(|cx| cx.clone().attach());
    #[cfg(not(feature = "otel"))]
    {
        let _ = carried;
        Attached
    }
}

/// What [`attached`] returns: the caller's context stays current while it is held.
#[cfg(feature = "otel")]
pub(crate) type Attached = Option<opentelemetry::ContextGuard>;
/// What [`attached`] returns: nothing without feature `otel`.
#[cfg(not(feature = "otel"))]
pub(crate) struct Attached;

/// `call` polled as [`in_carried`] runs a poll, around the call's span (which, entered inside,
/// comes first when OpenTelemetry sees it). Boxed again only when there is a context.
pub(crate) fn with_carried<T: 'static>(
    call: futures_util::future::BoxFuture<'static, T>,
    carried: Carried,
) -> futures_util::future::BoxFuture<'static, T> {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::trace::FutureExt as _;
        match carried {
            Some(cx) => Box::pin(call.with_context(cx)),
            None => call,
        }
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = carried;
        call
    }
}

/// The user attachments of a received call: everything but the W3C trace context and the
/// call id.
pub(crate) fn user_attachments(
    mut attachments: BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    if !attachments.is_empty() {
        for key in TRACE_CONTEXT_KEYS {
            attachments.remove(key);
        }
        attachments.remove(CALL_ID_KEY);
    }
    attachments
}

#[cfg(feature = "otel")]
pub(crate) use otel::{CallGuard, Metrics};

#[cfg(feature = "otel")]
mod otel {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Instant;

    use opentelemetry::metrics::{Counter, Histogram, Meter, UpDownCounter};
    use opentelemetry::propagation::{Extractor, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry::KeyValue;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use rpc_core::{MethodDescriptor, StatusCode};
    use rpc_governance::events::EventBus;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct MapExtractor<'a>(&'a BTreeMap<String, String>);

    impl Extractor for MapExtractor<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).map(String::as_str)
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    /// The caller's trace context in `attachments`, when it holds a valid one.
    pub(super) fn carried(
        attachments: &BTreeMap<String, String>,
    ) -> Option<opentelemetry::Context> {
        if !attachments.contains_key("traceparent") {
            return None;
        }
        let cx = TraceContextPropagator::new().extract(&MapExtractor(attachments));
        cx.span().span_context().is_valid().then_some(cx)
    }

    /// Makes the caller's span (`carried`, from `traceparent`/`tracestate`) the parent of
    /// `span`.
    pub(super) fn set_parent(span: &tracing::Span, carried: &Option<opentelemetry::Context>) {
        if span.is_disabled() {
            return;
        }
        if let Some(cx) = carried {
            // Without the OpenTelemetry layer in the subscriber there is no parent to set.
            let _ = span.set_parent(cx.clone());
        }
    }

    /// The server's instruments.
    #[derive(Clone)]
    pub(crate) struct Metrics {
        inner: Arc<Instruments>,
    }

    struct Instruments {
        duration: Histogram<f64>,
        calls: Counter<u64>,
        in_flight: UpDownCounter<i64>,
        stream_items: Counter<u64>,
        refused: Counter<u64>,
    }

    impl Metrics {
        /// The instruments, from `meter`; governance events of `events` are counted too.
        pub(crate) fn new(meter: &Meter, events: &EventBus) -> Self {
            events.count_in(meter, "server");
            Metrics {
                inner: Arc::new(Instruments {
                    duration: meter
                        .f64_histogram("rpc.server.duration")
                        .with_unit("ms")
                        .with_description("Duration of handled calls, fallback included")
                        .build(),
                    calls: meter
                        .u64_counter("rpc.server.calls")
                        .with_description("Calls answered, by status code")
                        .build(),
                    in_flight: meter
                        .i64_up_down_counter("rpc.server.in_flight")
                        .with_description("Calls being handled")
                        .build(),
                    stream_items: meter
                        .u64_counter("rpc.server.stream.items")
                        .with_description(
                            "Stream items, by entry and direction (sent to the caller, or the \
                             caller's taken by the handler)",
                        )
                        .build(),
                    refused: meter
                        .u64_counter("rpc.server.refused")
                        .with_description(
                            "Calls answered before reaching an entry, by why and status code",
                        )
                        .build(),
                }),
            }
        }

        /// Counts a call answered without running the handler (overflow), and records its
        /// duration as none: it took no handling, and a rate read from the duration
        /// histogram's count must not leave out the calls refused under load.
        pub(crate) fn rejected(&self, method: &'static MethodDescriptor, code: StatusCode) {
            let attrs = with_status(method, code);
            self.inner.duration.record(0.0, &attrs);
            self.inner.calls.add(1, &attrs);
        }

        /// Counts a call answered before it reached an entry: refused by its connection
        /// (`why` one of [`rpc_transport::Refusal`]'s names) or naming no entry of this server
        /// (`unknown_entry`). No entry attribute: the entry id a caller sends is not one of
        /// this server's, and would let any peer add series.
        pub(crate) fn refused(&self, why: &'static str, code: StatusCode) {
            self.inner.refused.add(
                1,
                &[
                    KeyValue::new("rpc.system", "rpc"),
                    KeyValue::new("rpc.refusal", why),
                    KeyValue::new("rpc.status_code", i64::from(code.metric_code())),
                ],
            );
        }

        /// Counts a call in; the guard counts it out, however it ends.
        pub(crate) fn start(&self, method: &'static MethodDescriptor) -> CallGuard {
            self.inner.in_flight.add(1, &attributes(method)[..2]);
            CallGuard {
                metrics: self.clone(),
                method,
                started: Instant::now(),
            }
        }
    }

    fn attributes(method: &'static MethodDescriptor) -> [KeyValue; 3] {
        [
            KeyValue::new("rpc.service", method.service_id),
            KeyValue::new("rpc.method", method.method),
            KeyValue::new("rpc.system", "rpc"),
        ]
    }

    fn with_status(method: &'static MethodDescriptor, code: StatusCode) -> [KeyValue; 5] {
        let [service, method, system] = attributes(method);
        [
            service,
            method,
            system,
            KeyValue::new("rpc.status_code", i64::from(code.metric_code())),
            KeyValue::new("rpc.outcome", code.outcome()),
        ]
    }

    /// One call being handled.
    pub(crate) struct CallGuard {
        metrics: Metrics,
        method: &'static MethodDescriptor,
        started: Instant,
    }

    impl CallGuard {
        /// Records the call's duration, status and `rpc.outcome` (success, error, or fallback:
        /// a fallback's answer counted with the status of the failure it answered for).
        pub(crate) fn finish(&self, code: StatusCode, outcome: &'static str) {
            self.dropped(Some(code), outcome);
        }

        /// Counts a stream's items each way (`rpc.stream.direction` = `sent` / `received`).
        pub(crate) fn items(&self, sent: u64, received: u64) {
            let [service, method, system] = attributes(self.method);
            for (direction, n) in [("sent", sent), ("received", received)] {
                if n > 0 {
                    self.metrics.inner.stream_items.add(
                        n,
                        &[
                            service.clone(),
                            method.clone(),
                            system.clone(),
                            KeyValue::new("rpc.entry_id", self.method.entry_id),
                            KeyValue::new("rpc.stream.direction", direction),
                        ],
                    );
                }
            }
        }

        /// Records a call whose handler was dropped: at its deadline (519, `timeout`), at the
        /// server's drain deadline (520, `error`), by the caller's `Cancel` (`cancelled`, no
        /// status), by a `Cancel` saying another attempt answered first (`superseded`, no
        /// status) or by the server stopping at once (`aborted`, no status).
        pub(crate) fn dropped(&self, code: Option<StatusCode>, outcome: &'static str) {
            let [service, method, system] = attributes(self.method);
            let mut attrs = vec![
                service,
                method,
                system,
                KeyValue::new("rpc.outcome", outcome),
            ];
            if let Some(code) = code {
                attrs.push(KeyValue::new(
                    "rpc.status_code",
                    i64::from(code.metric_code()),
                ));
            }
            let ms = self.started.elapsed().as_secs_f64() * 1000.0;
            self.metrics.inner.duration.record(ms, &attrs);
            self.metrics.inner.calls.add(1, &attrs);
        }
    }

    impl Drop for CallGuard {
        fn drop(&mut self) {
            self.metrics
                .inner
                .in_flight
                .add(-1, &attributes(self.method)[..2]);
        }
    }
}

#[cfg(not(feature = "otel"))]
pub(crate) use noop::{CallGuard, Metrics};

#[cfg(not(feature = "otel"))]
mod noop {
    use rpc_core::{MethodDescriptor, StatusCode};

    /// Without feature `otel`: nothing.
    #[derive(Clone)]
    pub(crate) struct Metrics;

    impl Metrics {
        pub(crate) fn rejected(&self, _: &'static MethodDescriptor, _: StatusCode) {}

        pub(crate) fn refused(&self, _: &'static str, _: StatusCode) {}

        pub(crate) fn start(&self, _: &'static MethodDescriptor) -> CallGuard {
            CallGuard
        }
    }

    pub(crate) struct CallGuard;

    impl CallGuard {
        pub(crate) fn finish(&self, _: StatusCode, _: &'static str) {}
        pub(crate) fn dropped(&self, _: Option<StatusCode>, _: &'static str) {}
        pub(crate) fn items(&self, _: u64, _: u64) {}
    }
}

#[cfg(test)]
mod call_id_tests {
    use super::is_call_id;

    #[test]
    fn only_hex_digits_are_a_call_id() {
        assert!(is_call_id("3fa9c1d2"));
        assert!(!is_call_id(""));
        assert!(!is_call_id("3fa9c1d2\n12:00:01 INFO forged"));
        assert!(!is_call_id("\u{1b}[31mred"));
        assert!(!is_call_id(&"a".repeat(17)));
    }
}
