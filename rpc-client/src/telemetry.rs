//! The client's observability: `rpc.client` / `rpc.client.attempt` spans, the outgoing call
//! context (user attachments and, with feature `otel`, the W3C trace context) and, with feature
//! `otel`, the OpenTelemetry metrics.
//!
//! Integer attributes are recorded as `i64`: `tracing-opentelemetry` exports other integer
//! types as strings.
//!
//! Without a subscriber every span is disabled after one check of its callsite's interest, and
//! nothing here allocates or formats; without feature `otel` the metrics are zero-sized no-ops.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use rpc_core::{Compression, MethodDescriptor, RpcContext, RpcError, StatusCode, CALL_ID_KEY};
use rpc_governance::calls::{CallObservers, Side};
use rpc_governance::stack::{StreamEnd, StreamEndHook, Superseded};
use tokio::time::Instant;
use tracing::field::{display, Empty};
use tracing::Span;

/// A span named `$name` of OpenTelemetry kind `$kind` for one call of `$method`: the method's
/// attributes every client span carries, then `$fields` (spans' fields are fixed where the
/// span is declared, so the shared ones are spliced in here rather than added later).
macro_rules! method_span {
    ($name:literal, $kind:literal, $method:ident, $($fields:tt)*) => {
        tracing::info_span!(
            $name,
            otel.kind = $kind,
            rpc.system = "rpc",
            rpc.service = $method.service_id,
            rpc.method = $method.method,
            rpc.entry_id = $method.entry_id,
            $($fields)*
        )
    };
}

/// An `rpc.client` span for one call of `$method`: the fields a call records as it ends,
/// then `$fields`.
macro_rules! call_span_with {
    ($method:ident, $($fields:tt)*) => {
        // Internal: the call as its caller sees it, over its attempts, each of which is a
        // client span (as OpenTelemetry's conventions have a call that retries): one call
        // reads as one remote call per attempt in a service graph, not one more.
        method_span!(
            "rpc.client",
            "internal",
            $method,
            call_id = Empty,
            rpc.status_code = Empty,
            outcome = Empty,
            rpc.fallback.cause = Empty,
            rpc.route = Empty,
            rpc.route.group = Empty,
            rpc.route.fallback = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
            $($fields)*
        )
    };
}

/// The span of one call, retries and fallback included.
pub(crate) fn call_span(method: &'static MethodDescriptor) -> Span {
    call_span_with!(method,)
}

/// The span of one stream, from its set-up (retries and fallback included) to its end: the
/// call span's fields plus the items each way (`rpc.stream.items_sent`,
/// `rpc.stream.items_received`), recorded as the stream ends.
pub(crate) fn stream_span(method: &'static MethodDescriptor) -> Span {
    call_span_with!(
        method,
        rpc.stream.items_sent = Empty,
        rpc.stream.items_received = Empty,
    )
}

/// A short id for the call of `span` (8 hex digits), recorded on it as `call_id` and sent to
/// the server as the [`CALL_ID_KEY`] attachment; `None` when the span is disabled (nothing
/// logs the call, so nothing is generated or sent).
pub(crate) fn call_id(span: &Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let id = format!("{:08x}", rand::random::<u32>());
    span.record("call_id", id.as_str());
    Some(id)
}

/// The span of one attempt on `addr` (a child of the current call span).
pub(crate) fn attempt_span(method: &'static MethodDescriptor, attempt: u32, addr: &str) -> Span {
    let span = method_span!(
        "rpc.client.attempt",
        "client",
        method,
        rpc.attempt = i64::from(attempt),
        server.address = Empty,
        server.port = Empty,
        outcome = Empty,
        rpc.status_code = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
        rpc.compression = Empty,
        rpc.request.size = Empty,
        rpc.request.compressed_size = Empty,
    );
    if !span.is_disabled() {
        let (host, port) = split_address(addr);
        span.record("server.address", host);
        if let Some(port) = port {
            span.record("server.port", i64::from(port));
        }
    }
    span
}

/// Records on the current attempt span that the parameters were compressed: the algorithm
/// (`rpc.compression`) and their size before and after (`rpc.request.size`,
/// `rpc.request.compressed_size`).
pub(crate) fn record_compression(algorithm: Compression, size: usize, compressed: usize) {
    let span = Span::current();
    if !span.is_disabled() {
        span.record("rpc.compression", algorithm.name());
        span.record("rpc.request.size", size as i64);
        span.record("rpc.request.compressed_size", compressed as i64);
    }
}

/// Records how a call or an attempt ended on its span: `rpc.status_code`, `outcome` (attempt
/// spans) and, on failure, `otel.status_code = "ERROR"` with the error as the description.
pub(crate) fn record_result(span: &Span, result: &Result<Bytes, RpcError>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(_) => {
            span.record("rpc.status_code", i64::from(StatusCode::Success.as_u32()));
            span.record("outcome", "success");
        }
        Err(e) => {
            span.record("rpc.status_code", i64::from(e.code().as_u32()));
            span.record("outcome", e.code().outcome());
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_description", display(e));
        }
    }
}

/// Records on a call span that a fallback gave its answer: `outcome = "fallback"` and the
/// status of the failure it answered for (`rpc.fallback.cause`).
fn record_fallback(span: &Span, cause: &RpcError) {
    if span.is_disabled() {
        return;
    }
    span.record("rpc.status_code", i64::from(StatusCode::Success.as_u32()));
    span.record("outcome", "fallback");
    span.record("rpc.fallback.cause", i64::from(cause.code().as_u32()));
}

/// Records on a call span the status of the failure a fallback ran for
/// (`rpc.fallback.cause`), when the fallback itself failed.
fn record_fallback_cause(span: &Span, cause: &RpcError) {
    if !span.is_disabled() {
        span.record("rpc.fallback.cause", i64::from(cause.code().as_u32()));
    }
}

/// Why a call, stream or attempt was dropped before it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// At its deadline: 519, `outcome = "timeout"`.
    Timeout,
    /// Its caller gave up: `outcome = "cancelled"`, no status.
    Cancelled,
    /// It was made for a call that another attempt answered (a hedged call's loser, or a call a
    /// handler made that its own caller's `Cancel` said was superseded): `outcome =
    /// "superseded"`, no status, and no failure.
    Superseded,
}

impl Dropped {
    /// Why, as the drop happens now: the deadline first, then the drop's
    /// [`superseding`](rpc_core::superseded::superseding) scope.
    fn now(deadline: Option<Instant>) -> Self {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            Dropped::Timeout
        } else if rpc_core::superseded::is_superseding() {
            Dropped::Superseded
        } else {
            Dropped::Cancelled
        }
    }

    /// The status (if any) and `rpc.outcome` it is recorded with.
    pub(crate) fn recorded(self) -> (Option<StatusCode>, &'static str) {
        match self {
            Dropped::Timeout => (Some(StatusCode::Timeout), "timeout"),
            Dropped::Cancelled => (None, "cancelled"),
            Dropped::Superseded => (None, "superseded"),
        }
    }
}

/// Records on `span` that the call or attempt it covers was dropped before it ended: at its
/// deadline (519, `outcome = "timeout"`), because its caller gave up (`outcome =
/// "cancelled"`), or superseded (`outcome = "superseded"`, no error: see [`Dropped`]), with a
/// debug line giving the time it ran and its budget. Returns why.
fn record_dropped(span: &Span, what: &str, started: Instant, deadline: Option<Instant>) -> Dropped {
    let why = Dropped::now(deadline);
    if span.is_disabled() {
        return why;
    }
    let elapsed_ms = Instant::now()
        .saturating_duration_since(started)
        .as_millis() as u64;
    let budget_ms = deadline.map_or(0, |d| round_ms(d.saturating_duration_since(started)));
    let budget = match deadline {
        Some(_) => format!("{budget_ms} ms budget"),
        None => "no deadline".to_string(),
    };
    let (status, outcome) = why.recorded();
    let description = match why {
        Dropped::Timeout => {
            format!("{what} dropped at its deadline after {elapsed_ms} ms ({budget})")
        }
        Dropped::Cancelled => {
            format!("{what} cancelled by its caller after {elapsed_ms} ms ({budget})")
        }
        Dropped::Superseded => format!(
            "{what} dropped after {elapsed_ms} ms ({budget}): the call it was made for was \
             answered by another attempt"
        ),
    };
    if let Some(status) = status {
        span.record("rpc.status_code", i64::from(status.as_u32()));
    }
    span.record("outcome", outcome);
    if why != Dropped::Superseded {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_description", description.as_str());
    }
    span.in_scope(|| tracing::debug!(elapsed_ms, budget_ms, outcome, "{description}"));
    why
}

/// Watches an entry's first call (or stream) while it looks its service up in the registry,
/// before the call's own watch exists: the call counts in flight meanwhile, and one its caller
/// drops then still ends its span with a status (`outcome = "cancelled"`, an error saying so)
/// and is counted in `rpc.client.calls` as such.
pub(crate) struct LookupWatch<'a> {
    span: Span,
    /// The call counted in flight during its lookup, and counted as dropped if it is.
    metrics: CallGuard<'a>,
    /// The client's call observers and the entry, told of a call dropped meanwhile as of
    /// one dropped later.
    observed: (&'a CallObservers, &'static str),
    started: Instant,
    done: bool,
}

impl<'a> LookupWatch<'a> {
    pub(crate) fn new(
        span: Span,
        metrics: CallGuard<'a>,
        observers: &'a CallObservers,
        entry: &'static str,
    ) -> Self {
        LookupWatch {
            span,
            metrics,
            observed: (observers, entry),
            started: Instant::now(),
            done: false,
        }
    }

    /// The lookup ended (whatever it found): the call's own watch takes over.
    pub(crate) fn done(mut self) {
        self.done = true;
    }
}

impl Drop for LookupWatch<'_> {
    fn drop(&mut self) {
        if !self.done {
            let why = record_dropped(
                &self.span,
                "call (looking its service up)",
                self.started,
                None,
            );
            self.metrics.dropped(why);
            let (observers, entry) = self.observed;
            if observers.is_active() {
                let (status, outcome) = why.recorded();
                observers.ended(Side::Client, entry, self.started, status, outcome);
            }
        }
    }
}

/// Whole milliseconds, rounded to the nearest: a budget measured a few microseconds after its
/// deadline was set reads as the budget given.
fn round_ms(d: std::time::Duration) -> u64 {
    d.as_micros().saturating_add(500) as u64 / 1000
}

/// Watches one call: however it ends (an answer, a fallback's answer, or its future dropped by
/// a caller that gave up), its span, its metrics and the client's call observers say so.
pub(crate) struct CallWatch<'a> {
    span: Span,
    metrics: CallGuard<'a>,
    /// When the call started and its deadline; read only when something watches (a span or
    /// the metrics), so an unobserved call pays no clock reading for it.
    started: Option<(Instant, Option<Instant>)>,
    /// The client's call observers, the entry and the call's start, when any observes calls.
    observed: Option<(&'a CallObservers, &'static str, Instant, Option<Instant>)>,
    done: bool,
}

impl<'a> CallWatch<'a> {
    /// `started`: when the call started, if before now (an entry's first call, which looked
    /// its service up first).
    pub(crate) fn new(
        span: Span,
        metrics: CallGuard<'a>,
        deadline: impl FnOnce() -> Option<Instant>,
        observers: &'a CallObservers,
        (entry, started): (&'static str, Option<Instant>),
    ) -> Self {
        let watched = !span.is_disabled() || cfg!(feature = "otel");
        let observed = observers.is_active();
        let (started, observed) = if watched || observed {
            let deadline = deadline();
            let now = started.unwrap_or_else(Instant::now);
            (
                watched.then_some((now, deadline)),
                observed.then_some((observers, entry, now, deadline)),
            )
        } else {
            (None, None)
        };
        CallWatch {
            span,
            metrics,
            started,
            observed,
            done: false,
        }
    }

    /// The call ended with `result`; `fallback` is the failure a fallback answered for, if one
    /// did.
    pub(crate) fn finish(mut self, result: &Result<Bytes, RpcError>, fallback: Option<&RpcError>) {
        self.done = true;
        let (status, outcome) = match (result, fallback) {
            (Ok(_), Some(cause)) => {
                record_fallback(&self.span, cause);
                self.metrics.fallback(cause.code());
                (cause.code(), "fallback")
            }
            _ => {
                record_result(&self.span, result);
                if let Some(cause) = fallback {
                    // A fallback ran and failed: the span still says what it answered for.
                    record_fallback_cause(&self.span, cause);
                }
                self.metrics.finish(result);
                match result {
                    Ok(_) => (StatusCode::Success, "success"),
                    Err(e) => (e.code(), e.code().outcome()),
                }
            }
        };
        if let Some((observers, entry, started, _)) = self.observed {
            observers.ended(Side::Client, entry, started, Some(status), outcome);
        }
    }
}

impl CallWatch<'_> {
    /// The set-up of a stream succeeded (`fallback`: the failure a fallback's stream answers
    /// for): the call goes on until the stream ends, watched by the returned
    /// [`StreamWatch`], which records the status, the items each way and the duration then.
    pub(crate) fn into_stream(
        mut self,
        sent: Arc<AtomicU64>,
        fallback: Option<RpcError>,
        (hooks, deadline): (Vec<StreamEndHook>, Option<Instant>),
        opened: Instant,
    ) -> StreamWatch {
        self.done = true;
        StreamWatch {
            hooks,
            deadline,
            opened,
            span: self.span.clone(),
            metrics: self.metrics.to_stream(),
            started: self.started,
            observed: self.observed.map(|(observers, entry, started, deadline)| {
                (observers.clone(), entry, started, deadline)
            }),
            sent,
            received: 0,
            fallback,
            done: false,
        }
    }
}

/// Watches an accepted stream until it ends: its end status, the items each way and its
/// duration go to the call's span, the metrics (`rpc.client.calls`, `rpc.client.duration`,
/// `rpc.client.stream.items`) and the client's call observers, as [`CallWatch`] does for a
/// unary call. A stream dropped before its end was cancelled by its caller (or, past its
/// deadline, timed out).
pub(crate) struct StreamWatch {
    span: Span,
    metrics: StreamGuard,
    started: Option<(Instant, Option<Instant>)>,
    observed: Option<(CallObservers, &'static str, Instant, Option<Instant>)>,
    /// Items sent to the server (counted by the task sending them).
    sent: Arc<AtomicU64>,
    /// Items received (for a client stream, its answer).
    received: u64,
    /// The failure the stream's fallback answers for, when a fallback's stream runs.
    fallback: Option<RpcError>,
    /// What the call's layers asked to be told at the end ([`CallCx::on_stream_end`]).
    ///
    /// [`CallCx::on_stream_end`]: rpc_governance::stack::CallCx::on_stream_end
    hooks: Vec<StreamEndHook>,
    /// The stream's deadline, for `hooks`: a stream dropped past it timed out, whether or
    /// not anything traces it (`started` is read only then).
    deadline: Option<Instant>,
    /// When the set-up started.
    opened: Instant,
    done: bool,
}

impl StreamWatch {
    /// One more item received.
    pub(crate) fn received(&mut self) {
        self.received += 1;
    }

    /// The stream ended: completed (`Ok`) or with an error item.
    pub(crate) fn finish(&mut self, end: Result<(), &RpcError>) {
        if self.done {
            return;
        }
        self.done = true;
        self.record_items();
        let (status, outcome) = match (end, &self.fallback) {
            (Ok(()), Some(cause)) => {
                record_fallback(&self.span, cause);
                self.metrics.fallback(cause.code());
                (cause.code(), "fallback")
            }
            (Ok(()), None) => {
                let ok = Ok(Bytes::new());
                record_result(&self.span, &ok);
                self.metrics.finish(&ok);
                (StatusCode::Success, "success")
            }
            (Err(e), fallback) => {
                let err = Err(e.clone());
                record_result(&self.span, &err);
                if let Some(cause) = fallback {
                    record_fallback_cause(&self.span, cause);
                }
                self.metrics.finish(&err);
                (e.code(), e.code().outcome())
            }
        };
        if let Some((observers, entry, started, _)) = &self.observed {
            observers.ended(Side::Client, entry, *started, Some(status), outcome);
        }
        let status = match end {
            Ok(()) => StatusCode::Success,
            Err(e) => e.code(),
        };
        self.run_hooks(Some(status), end.err());
    }

    /// Tells the layers' hooks how the stream ended.
    fn run_hooks(&mut self, status: Option<StatusCode>, error: Option<&RpcError>) {
        if self.hooks.is_empty() {
            return;
        }
        let end = StreamEnd {
            status,
            error: error.cloned(),
            items_sent: self.sent.load(Ordering::Relaxed),
            items_received: self.received,
            elapsed: self.opened.elapsed(),
        };
        for hook in std::mem::take(&mut self.hooks) {
            hook(&end);
        }
    }

    fn record_items(&self) {
        let sent = self.sent.load(Ordering::Relaxed);
        // The metric counts items to and from the server: a fallback's stream's items came
        // from the fallback, and the caller's went to it (the span still records what the
        // caller sent and received).
        let (to_server, from_server) = if self.fallback.is_some() {
            (0, 0)
        } else {
            (sent, self.received)
        };
        self.metrics.items(to_server, from_server);
        if !self.span.is_disabled() {
            self.span.record("rpc.stream.items_sent", sent as i64);
            self.span
                .record("rpc.stream.items_received", self.received as i64);
            // Entered once more as the stream ends: an exporter that takes a span's end from
            // its last exit ends it here, not at the set-up.
            self.span.in_scope(|| ());
        }
    }
}

impl Drop for StreamWatch {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.record_items();
        if let Some((started, deadline)) = self.started {
            let why = record_dropped(&self.span, "stream", started, deadline);
            self.metrics.dropped(why);
        }
        if let Some((observers, entry, started, deadline)) = &self.observed {
            let (status, outcome) = Dropped::now(*deadline).recorded();
            observers.ended(Side::Client, entry, *started, status, outcome);
        }
        let timed_out =
            !self.hooks.is_empty() && self.deadline.is_some_and(|d| Instant::now() >= d);
        self.run_hooks(timed_out.then_some(StatusCode::Timeout), None);
    }
}

impl Drop for CallWatch<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some((started, deadline)) = self.started {
            let why = record_dropped(&self.span, "call", started, deadline);
            self.metrics.dropped(why);
        }
        if let Some((observers, entry, started, deadline)) = self.observed {
            let (status, outcome) = Dropped::now(deadline).recorded();
            observers.ended(Side::Client, entry, started, status, outcome);
        }
    }
}

/// Watches one attempt, like [`CallWatch`] (attempts have no metrics of their own).
pub(crate) struct AttemptWatch {
    span: Span,
    /// When the attempt started and its deadline, when its span is enabled.
    started: Option<(Instant, Option<Instant>)>,
    done: bool,
    /// For an attempt of a hedged call: set once the other attempt answered.
    superseded: Option<Superseded>,
}

impl AttemptWatch {
    /// Watches the attempt of `span`, whose deadline is `deadline`; `superseded` is its hedged
    /// call's ([`CallCx::superseded`](rpc_governance::stack::CallCx::superseded)).
    pub(crate) fn new(
        span: Span,
        deadline: Option<Instant>,
        superseded: Option<Superseded>,
    ) -> Self {
        let started = (!span.is_disabled()).then(|| (Instant::now(), deadline));
        AttemptWatch {
            span,
            started,
            done: false,
            superseded,
        }
    }

    /// The attempt ended with `result`.
    pub(crate) fn finish(mut self, result: &Result<Bytes, RpcError>) {
        self.done = true;
        record_result(&self.span, result);
    }
}

impl Drop for AttemptWatch {
    fn drop(&mut self) {
        let Some((started, deadline)) = self.started.filter(|_| !self.done) else {
            return;
        };
        if self.superseded.as_ref().is_some_and(Superseded::is_set) {
            record_superseded(&self.span, started);
        } else {
            record_dropped(&self.span, "attempt", started, deadline);
        }
    }
}

/// Ends the span of a hedged call's attempt dropped because the call's other attempt answered
/// first: `outcome = "superseded"`, with no error status (the call succeeded, and nothing
/// failed on this attempt's side; its server was told to stop).
fn record_superseded(span: &Span, started: Instant) {
    let elapsed_ms = started.elapsed().as_millis() as u64;
    span.record("outcome", "superseded");
    span.in_scope(|| {
        tracing::debug!(
            elapsed_ms,
            "attempt dropped after {elapsed_ms} ms: the hedged call's other attempt answered \
             first"
        )
    });
}

/// `host:port` (or `[v6]:port`) split into host and port; no allocation.
pub(crate) fn split_address(addr: &str) -> (&str, Option<u16>) {
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => match port.parse() {
            Ok(port) => (
                host.trim_start_matches('[').trim_end_matches(']'),
                Some(port),
            ),
            Err(_) => (addr, None),
        },
        _ => (addr, None),
    }
}

/// The attachments of an outgoing call: the current [`RpcContext`]'s user attachments, the
/// call's id when it is logged and, with feature `otel`, the W3C trace context of the current
/// span (the attempt span). `added` (what the call's layers added) wins over the context's.
pub(crate) fn outgoing_attachments(
    call_id: Option<&str>,
    added: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    // The served call's retry depth is not copied: the call carries its own
    // (`CallCx::retry_depth`), which the transport sends over any entry of its key.
    #[allow(unused_mut)]
    let mut attachments = RpcContext::with_current(Clone::clone);
    for (k, v) in added {
        attachments.insert(k.clone(), v.clone());
    }
    if let Some(id) = call_id {
        attachments.insert(CALL_ID_KEY.to_string(), id.to_string());
    }
    #[cfg(feature = "otel")]
    otel::inject(&mut attachments);
    attachments
}

#[cfg(feature = "otel")]
pub(crate) use otel::{read_slot, CallGuard, GaugeSlot, Metrics, StreamGuard};

#[cfg(feature = "otel")]
mod otel {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex, PoisonError};
    use std::time::Instant;

    use super::Dropped;

    use bytes::Bytes;
    use opentelemetry::metrics::{Counter, Histogram, Meter, ObservableGauge, UpDownCounter};
    use opentelemetry::propagation::{Injector, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry::KeyValue;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use rpc_core::{MethodDescriptor, RpcError, StatusCode, TRACE_CONTEXT_KEYS};
    use rpc_governance::events::EventBus;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct MapInjector<'a>(&'a mut BTreeMap<String, String>);

    impl Injector for MapInjector<'_> {
        fn set(&mut self, key: &str, value: String) {
            self.0.insert(key.to_string(), value);
        }
    }

    /// Writes `traceparent`/`tracestate` of the current span into `attachments`, replacing
    /// what the context carried in (which named the caller's caller). A span OpenTelemetry
    /// does not see (filtered out, or no OpenTelemetry layer in this process) has no context:
    /// then OpenTelemetry's current one goes, which a server sets to its caller's around a
    /// handler, so that a middle tier that exports nothing does not break the trace.
    pub(super) fn inject(attachments: &mut BTreeMap<String, String>) {
        let span = tracing::Span::current();
        let valid = |cx: opentelemetry::Context| cx.span().span_context().is_valid().then_some(cx);
        let own = (!span.is_disabled())
            .then(|| span.context())
            .and_then(valid);
        let Some(cx) = own.or_else(|| valid(opentelemetry::Context::current())) else {
            return;
        };
        for key in TRACE_CONTEXT_KEYS {
            attachments.remove(key);
        }
        TraceContextPropagator::new().inject_context(&cx, &mut MapInjector(attachments));
    }

    /// The client's instruments.
    pub(crate) struct Metrics {
        duration: Histogram<f64>,
        calls: Counter<u64>,
        in_flight: UpDownCounter<i64>,
        stream_items: Counter<u64>,
        _gauges: Vec<ObservableGauge<i64>>,
        /// The gauges' last values, reported by the next collection after the client is gone.
        frozen: [Frozen; 2],
    }

    /// Reads a state to report, as (label value, gauge value) pairs; `None` once the client
    /// is gone.
    pub(crate) type Probe = Box<dyn Fn() -> Option<Vec<(String, i64)>> + Send + Sync>;

    type Frozen = Arc<Mutex<Option<Vec<(String, i64)>>>>;

    /// Where a client's gauge callbacks find it: a weak reference while it lives, emptied as
    /// it drops, so that a callback (kept by the meter for the process's life) holds no more
    /// than this slot of a client gone.
    pub(crate) type GaugeSlot<T> = Arc<Mutex<Option<std::sync::Weak<T>>>>;

    /// The client behind `slot`, while it lives.
    pub(crate) fn read_slot<T>(slot: &GaugeSlot<T>) -> Option<Arc<T>> {
        slot.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(std::sync::Weak::upgrade)
    }

    fn gauge(
        meter: &Meter,
        name: &'static str,
        doc: &'static str,
        label: &'static str,
        probe: Probe,
        frozen: Frozen,
    ) -> ObservableGauge<i64> {
        meter
            .i64_observable_gauge(name)
            .with_description(doc)
            .with_callback(move |observer| {
                let values = probe().unwrap_or_else(|| {
                    frozen
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take()
                        .unwrap_or_default()
                });
                for (key, value) in values {
                    observer.observe(value, &[KeyValue::new(label, key)]);
                }
            })
            .build()
    }

    impl Metrics {
        /// The instruments, from `meter`; governance events of `events` are counted too, and
        /// `breakers` / `endpoints` are read at each collection.
        pub(crate) fn new(
            meter: &Meter,
            events: &EventBus,
            breakers: Probe,
            endpoints: Probe,
        ) -> Self {
            events.count_in(meter, "client");
            let frozen: [Frozen; 2] = Default::default();
            Metrics {
                duration: meter
                    .f64_histogram("rpc.client.duration")
                    .with_unit("ms")
                    .with_description("Duration of calls, retries and fallback included")
                    .build(),
                calls: meter
                    .u64_counter("rpc.client.calls")
                    .with_description("Calls made, by final status code")
                    .build(),
                in_flight: meter
                    .i64_up_down_counter("rpc.client.in_flight")
                    .with_description("Calls in progress")
                    .build(),
                stream_items: meter
                    .u64_counter("rpc.client.stream.items")
                    .with_description(
                        "Stream items, by entry and direction (sent to or received from the server)",
                    )
                    .build(),
                _gauges: vec![
                    gauge(
                        meter,
                        "rpc.client.breaker_state",
                        "Circuit breaker per entry: 0 closed, 1 half-open, 2 open",
                        "rpc.entry_id",
                        breakers,
                        frozen[0].clone(),
                    ),
                    gauge(
                        meter,
                        "rpc.client.endpoint_health",
                        "Endpoint as this client sees it: 0 healthy, 1 unhealthy for now, 2 removed",
                        "server.address",
                        endpoints,
                        frozen[1].clone(),
                    ),
                ],
                frozen,
            }
        }

        /// Keeps the gauges' last values for the collection after the client is dropped (the
        /// final flush of a program that drops its client before its telemetry).
        pub(crate) fn freeze(&self, breakers: Vec<(String, i64)>, endpoints: Vec<(String, i64)>) {
            for (cell, values) in self.frozen.iter().zip([breakers, endpoints]) {
                *cell.lock().unwrap_or_else(PoisonError::into_inner) = Some(values);
            }
        }

        /// Counts a call in; the guard counts it out, however it ends.
        pub(crate) fn start(&self, method: &'static MethodDescriptor) -> CallGuard<'_> {
            self.start_at(method, None)
        }

        /// [`start`](Self::start) of a call that started at `at` (`None`: now), before its
        /// service was looked up: its duration counts the lookup.
        pub(crate) fn start_at(
            &self,
            method: &'static MethodDescriptor,
            at: Option<tokio::time::Instant>,
        ) -> CallGuard<'_> {
            self.in_flight.add(1, &attributes(method)[..2]);
            CallGuard {
                metrics: self,
                method,
                // What has passed since `at` on tokio's clock (paused in tests, ahead of the
                // real one), before the present on the real one.
                started: at
                    .and_then(|at| Instant::now().checked_sub(at.elapsed()))
                    .unwrap_or_else(Instant::now),
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

    /// The status and `rpc.outcome` of a call or stream that ended with `result`.
    fn finished(result: &Result<Bytes, RpcError>) -> (Option<StatusCode>, &'static str) {
        match result {
            Ok(_) => (Some(StatusCode::Success), "success"),
            Err(e) => (Some(e.code()), e.code().outcome()),
        }
    }

    /// Records the end of a call or stream of `method` started at `started`: its duration
    /// and one count, by status and outcome.
    fn record_end(
        duration: &Histogram<f64>,
        calls: &Counter<u64>,
        method: &'static MethodDescriptor,
        started: Instant,
        code: Option<StatusCode>,
        outcome: &'static str,
    ) {
        let [service, method, system] = attributes(method);
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
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        duration.record(ms, &attrs);
        calls.add(1, &attrs);
    }

    /// One call in flight.
    pub(crate) struct CallGuard<'a> {
        metrics: &'a Metrics,
        method: &'static MethodDescriptor,
        started: Instant,
    }

    impl CallGuard<'_> {
        /// Records the call's duration and final status (`rpc.outcome` success or error).
        pub(crate) fn finish(&self, result: &Result<Bytes, RpcError>) {
            let (code, outcome) = finished(result);
            self.record(code, outcome);
        }

        /// Records a call a fallback answered for a failure with status `cause`: counted with
        /// that status and `rpc.outcome = "fallback"`, apart from real successes.
        pub(crate) fn fallback(&self, cause: StatusCode) {
            self.record(Some(cause), "fallback");
        }

        /// Records a call whose future was dropped, with the status and `rpc.outcome` of
        /// `why` (see [`Dropped`]).
        pub(crate) fn dropped(&self, why: Dropped) {
            let (code, outcome) = why.recorded();
            self.record(code, outcome);
        }

        fn record(&self, code: Option<StatusCode>, outcome: &'static str) {
            let m = &self.metrics;
            record_end(
                &m.duration,
                &m.calls,
                self.method,
                self.started,
                code,
                outcome,
            );
        }
    }

    impl CallGuard<'_> {
        /// The same call, now an accepted stream: a guard of its own that counts it in flight
        /// until the stream ends (this one counts it out as it is dropped).
        pub(crate) fn to_stream(&self) -> StreamGuard {
            self.metrics.in_flight.add(1, &attributes(self.method)[..2]);
            StreamGuard {
                duration: self.metrics.duration.clone(),
                calls: self.metrics.calls.clone(),
                in_flight: self.metrics.in_flight.clone(),
                items: self.metrics.stream_items.clone(),
                method: self.method,
                started: self.started,
            }
        }
    }

    /// One accepted stream in flight: the instruments a [`CallGuard`] uses, owned, so that
    /// they outlive the set-up's borrow of the client.
    pub(crate) struct StreamGuard {
        duration: Histogram<f64>,
        calls: Counter<u64>,
        in_flight: UpDownCounter<i64>,
        items: Counter<u64>,
        method: &'static MethodDescriptor,
        started: Instant,
    }

    impl StreamGuard {
        /// Records the stream's duration and end status, as [`CallGuard::finish`].
        pub(crate) fn finish(&self, result: &Result<Bytes, RpcError>) {
            let (code, outcome) = finished(result);
            self.record(code, outcome);
        }

        /// Records a fallback's stream that completed, as [`CallGuard::fallback`].
        pub(crate) fn fallback(&self, cause: StatusCode) {
            self.record(Some(cause), "fallback");
        }

        /// Records a stream dropped before its end, as [`CallGuard::dropped`].
        pub(crate) fn dropped(&self, why: Dropped) {
            let (code, outcome) = why.recorded();
            self.record(code, outcome);
        }

        /// Counts the stream's items each way (`rpc.stream.direction` = `sent` / `received`).
        pub(crate) fn items(&self, sent: u64, received: u64) {
            let [service, method, system] = attributes(self.method);
            for (direction, n) in [("sent", sent), ("received", received)] {
                if n > 0 {
                    self.items.add(
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

        fn record(&self, code: Option<StatusCode>, outcome: &'static str) {
            record_end(
                &self.duration,
                &self.calls,
                self.method,
                self.started,
                code,
                outcome,
            );
        }
    }

    impl Drop for StreamGuard {
        fn drop(&mut self) {
            self.in_flight.add(-1, &attributes(self.method)[..2]);
        }
    }

    impl Drop for CallGuard<'_> {
        fn drop(&mut self) {
            self.metrics
                .in_flight
                .add(-1, &attributes(self.method)[..2]);
        }
    }
}

#[cfg(not(feature = "otel"))]
pub(crate) use noop::{CallGuard, Metrics, StreamGuard};

#[cfg(not(feature = "otel"))]
mod noop {
    use bytes::Bytes;
    use rpc_core::{MethodDescriptor, RpcError, StatusCode};

    /// Without feature `otel`: nothing.
    pub(crate) struct Metrics;

    impl Metrics {
        pub(crate) fn start(&self, _: &'static MethodDescriptor) -> CallGuard<'_> {
            CallGuard(std::marker::PhantomData)
        }

        pub(crate) fn start_at(
            &self,
            method: &'static MethodDescriptor,
            _: Option<tokio::time::Instant>,
        ) -> CallGuard<'_> {
            self.start(method)
        }
    }

    pub(crate) struct CallGuard<'a>(std::marker::PhantomData<&'a ()>);

    impl CallGuard<'_> {
        pub(crate) fn finish(&self, _: &Result<Bytes, RpcError>) {}
        pub(crate) fn fallback(&self, _: StatusCode) {}
        pub(crate) fn dropped(&self, _: super::Dropped) {}
        pub(crate) fn to_stream(&self) -> StreamGuard {
            StreamGuard
        }
    }

    /// Without feature `otel`: nothing.
    pub(crate) struct StreamGuard;

    impl StreamGuard {
        pub(crate) fn finish(&self, _: &Result<Bytes, RpcError>) {}
        pub(crate) fn fallback(&self, _: StatusCode) {}
        pub(crate) fn dropped(&self, _: super::Dropped) {}
        pub(crate) fn items(&self, _: u64, _: u64) {}
    }
}

#[cfg(test)]
mod tests {
    use super::split_address;

    #[test]
    fn addresses_split_into_host_and_port() {
        assert_eq!(split_address("127.0.0.1:80"), ("127.0.0.1", Some(80)));
        assert_eq!(split_address("[::1]:9000"), ("::1", Some(9000)));
        assert_eq!(split_address("host"), ("host", None));
        assert_eq!(split_address("host:x"), ("host:x", None));
    }
}
