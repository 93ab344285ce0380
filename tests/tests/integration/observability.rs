//! Observability end to end: `rpc.client` / `rpc.client.attempt` / `rpc.server` spans and their
//! attributes, one trace across services through the W3C `traceparent` attachment, user
//! attachments carried A → B → C, governance events on the spans, and the OpenTelemetry
//! metrics after a scripted run (retry, open breaker, fallback).
//!
//! Each test installs its own subscriber for its own (current-thread) runtime with
//! `tracing::subscriber::set_default`, and hands its own meter to the clients and servers, so
//! tests running in parallel do not see each other's data.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::otel::{counter, gauge, histogram_count, metric_data, Meters, Traces};
use opentelemetry::trace::{SpanId, Status};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::trace::SpanData;
use rpc::crates::governance::breaker::BreakerState;
use rpc::{
    Client, GovernanceOverrides, RpcContext, RpcError, RpcStream, Server, ServerHandle,
    StaticRegistry, StatusCode,
};

#[rpc::service(name = "obs.Hop")]
pub trait Hop {
    /// `depth` more hops, then the `tenant` attachment the last server sees.
    #[governance(retry_times = 0)]
    async fn hop(&self, depth: u32) -> Result<String, RpcError>;
    /// One item: what a hop of `depth` more hops answers. With a next server, the handler
    /// makes that hop at its set-up and again while producing its item.
    async fn hops(&self, depth: u32) -> Result<RpcStream<String>, RpcError>;
    /// With a next server: its `echo_items` of two items, each made by a call of its `hop(0)`
    /// (made while the request stream is read, in the task that sends it), joined with `,`.
    async fn relay_items(&self) -> Result<String, RpcError>;
    /// The items it is sent, back.
    async fn echo_items(&self, items: RpcStream<String>) -> Result<RpcStream<String>, RpcError>;
}

/// Forwards to the next server while `depth > 0`.
struct Relay {
    next: Option<HopClient>,
}

impl Hop for Relay {
    async fn hop(&self, depth: u32) -> Result<String, RpcError> {
        match (&self.next, depth) {
            (Some(next), d) if d > 0 => next.hop(d - 1).await,
            _ => Ok(RpcContext::get("tenant").unwrap_or_else(|| "none".into())),
        }
    }

    async fn hops(&self, depth: u32) -> Result<RpcStream<String>, RpcError> {
        let Some(next) = self.next.clone() else {
            return Ok(RpcStream::iter([self.hop(depth).await?]));
        };
        let depth = depth.saturating_sub(1);
        next.hop(depth).await?;
        Ok(RpcStream::try_new(futures_util::stream::once(async move {
            next.hop(depth).await
        })))
    }

    async fn relay_items(&self) -> Result<String, RpcError> {
        let Some(next) = self.next.clone() else {
            return Ok("none".into());
        };
        let maker = next.clone();
        let items = futures_util::StreamExt::then(futures_util::stream::iter(0..2), move |_| {
            let maker = maker.clone();
            async move { maker.hop(0).await }
        });
        let back = next.echo_items(RpcStream::try_new(items)).await?;
        let back: Vec<String> = futures_util::TryStreamExt::try_collect(back).await?;
        Ok(back.join(","))
    }

    async fn echo_items(&self, items: RpcStream<String>) -> Result<RpcStream<String>, RpcError> {
        Ok(items)
    }
}

#[rpc::service(name = "obs.Flaky")]
pub trait Flaky {
    #[governance(retry_times = 2, idempotent)]
    async fn ping(&self) -> Result<u32, RpcError>;
    #[governance(retry_times = 0)]
    async fn fail(&self) -> Result<u32, RpcError>;
}

struct Db {
    calls: AtomicU32,
}

impl Flaky for Db {
    async fn ping(&self) -> Result<u32, RpcError> {
        Ok(1)
    }
    async fn fail(&self) -> Result<u32, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Err(RpcError::new(StatusCode::ServerError, "database down"))
    }
}

/// A fallback answering 0.
struct Zero;

impl Flaky for Zero {
    async fn ping(&self) -> Result<u32, RpcError> {
        Ok(0)
    }
    async fn fail(&self) -> Result<u32, RpcError> {
        Ok(0)
    }
}

/// Spans recorded by this test's own subscriber.
fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn attr_i64(span: &SpanData, key: &str) -> Option<i64> {
    match attr(span, key)? {
        Value::I64(v) => Some(*v),
        other => panic!("{key} is {other:?}"),
    }
}

fn attr_str(span: &SpanData, key: &str) -> Option<String> {
    attr(span, key).map(|v| v.as_str().into_owned())
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn by_port<'a>(spans: &[&'a SpanData], key: &str, port: u16) -> &'a SpanData {
    spans
        .iter()
        .copied()
        .find(|s| attr_i64(s, key) == Some(i64::from(port)))
        .unwrap_or_else(|| panic!("no span with {key} = {port}"))
}

async fn hop_server(next: Option<&ServerHandle>) -> ServerHandle {
    hop_server_with(next, |b| b).await
}

/// [`hop_server`], its builder's options set by `configure`.
async fn hop_server_with(
    next: Option<&ServerHandle>,
    configure: impl FnOnce(rpc::ServerBuilder) -> rpc::ServerBuilder,
) -> ServerHandle {
    let next = next.map(|n| {
        HopClient::new(
            Client::builder()
                .registry(StaticRegistry::from_list(&n.local_addr().to_string()).unwrap())
                .build(),
        )
    });
    configure(Server::builder())
        .add_service(HopServer::new(Relay { next }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

fn client_of(servers: &[&ServerHandle]) -> Client {
    let list: Vec<String> = servers.iter().map(|s| s.local_addr().to_string()).collect();
    Client::builder()
        .registry(StaticRegistry::from_list(&list.join(",")).unwrap())
        .build()
}

/// A call's span is a child of the span the call is awaited in, also when its future was made
/// before (`Client::invoke` directly, `.instrument(outer)`), and for an entry's later calls as
/// for its first. Before, a later call's span was made with the future, outside `outer`.
#[tokio::test]
async fn a_calls_span_is_a_child_of_the_span_it_is_awaited_in() {
    use tracing::Instrument;
    let (traces, _guard) = Traces::install();
    let server = hop_server(None).await;
    let client = client_of(&[&server]);
    let method = &HopServer::<Relay>::methods()[0];
    let params = || client.codec().encode(&(0u32,)).expect("encode");
    for round in ["first", "later"] {
        let outer = tracing::info_span!("outer", round);
        let call = client.invoke(method, params(), None::<fn() -> u64>);
        common::within("the call", call.instrument(outer))
            .await
            .expect(round);
    }
    let spans = traces.spans();
    let outers = named(&spans, "outer");
    let calls = named(&spans, "rpc.client");
    assert_eq!((outers.len(), calls.len()), (2, 2));
    for outer in outers {
        assert!(
            calls
                .iter()
                .any(|c| c.parent_span_id == outer.span_context.span_id()),
            "no rpc.client span under {outer:?}"
        );
    }
    common::within("shutdown", server.shutdown()).await;
}

/// How a server in the trace tests runs its handlers.
#[derive(Debug, Clone, Copy)]
enum Runs {
    /// Each call in a task of its own (the default).
    InTasks,
    /// The handler's first poll on the connection's reader.
    Inline,
    /// Behind a server layer.
    Layered,
}

/// Asserts that `call` continues the trace of `parent`, as its child.
#[track_caller]
fn assert_child(call: &SpanData, parent: &SpanData, case: &str) {
    assert_eq!(
        call.span_context.trace_id(),
        parent.span_context.trace_id(),
        "{case}"
    );
    assert_eq!(call.parent_span_id, parent.span_context.span_id(), "{case}");
}

/// With the servers' `rpc.server` spans kept from OpenTelemetry by a filter (turned off, or
/// seen by a log layer only), the call a handler makes downstream still continues its caller's
/// trace, its span the child of the caller's attempt, however the server runs the handler.
/// Before, it started a trace of its own.
#[tokio::test]
async fn a_handler_s_call_continues_the_trace_with_the_server_span_filtered_out() {
    let cases = [false, true]
        .into_iter()
        .flat_map(|logged| [Runs::InTasks, Runs::Inline, Runs::Layered].map(|r| (logged, r)));
    for (logged, runs) in cases {
        let (traces, _guard) = Traces::install_without(&["rpc.server"], logged);
        let configure = move |b: rpc::ServerBuilder| match runs {
            Runs::InTasks => b,
            Runs::Inline => b.inline_first_poll(true),
            Runs::Layered => b.layer(rpc::server_layer_fn(|req, next| Box::pin(next.run(req)))),
        };
        let c = hop_server(None).await;
        let b = hop_server_with(Some(&c), configure).await;
        let logged = format!("{logged}, {runs:?}");
        let client = HopClient::new(client_of(&[&b]));
        assert_eq!(client.hop(1).await.expect("two hops"), "none");
        let spans = traces.spans();
        assert!(named(&spans, "rpc.server").is_empty(), "logged {logged}");
        let attempts = named(&spans, "rpc.client.attempt");
        let calls = named(&spans, "rpc.client");
        assert_eq!((calls.len(), attempts.len()), (2, 2), "logged {logged}");
        // The outer call's attempt went to B; B's handler's call is its child.
        let outer = by_port(&attempts, "server.port", b.local_addr().port());
        let inner = calls
            .iter()
            .find(|s| s.parent_span_id != SpanId::INVALID)
            .unwrap_or_else(|| panic!("no call with a parent (logged {logged}): {calls:?}"));
        assert_child(inner, outer, &logged);
        common::within("shutdown", b.shutdown()).await;
        common::within("shutdown", c.shutdown()).await;
    }
}

/// A middle tier whose client spans OpenTelemetry does not see (a process that exports
/// nothing, here a filter on the client's spans) passes its caller's trace on: the next
/// server's span is in the first caller's trace. Before, the middle tier sent no
/// `traceparent`, and the next server started a trace of its own.
#[tokio::test]
async fn a_middle_tier_that_exports_no_client_span_passes_the_trace_on() {
    for logged in [false, true] {
        let (traces, _guard) =
            Traces::install_without(&["rpc.client", "rpc.client.attempt"], logged);
        let c = hop_server(None).await;
        let b = hop_server(Some(&c)).await;
        let client = HopClient::new(client_of(&[&b]));
        let trace_id = "5bf92f3577b34da6a3ce929d0e0e4736";
        let first = BTreeMap::from([(
            "traceparent".to_string(),
            format!("00-{trace_id}-00f067aa0ba902b7-01"),
        )]);
        let answer = RpcContext::scope(first, client.hop(1)).await;
        assert_eq!(answer.expect("two hops"), "none");
        let spans = traces
            .spans_once("both servers' spans", |spans| {
                named(spans, "rpc.server").len() == 2
            })
            .await;
        for server in named(&spans, "rpc.server") {
            assert_eq!(
                server.span_context.trace_id().to_string(),
                trace_id,
                "logged {logged}: {server:?}"
            );
        }
        common::within("shutdown", b.shutdown()).await;
        common::within("shutdown", c.shutdown()).await;
    }
}

/// The calls a streaming handler makes downstream, at its set-up and while producing its
/// items, continue its caller's trace, with and without a server layer: their spans are the
/// children of the handler's `rpc.server` span when OpenTelemetry sees it, and of the caller's
/// attempt when a filter keeps that span from it (turned off, or seen by a log layer only).
/// Before, with the span filtered, they started traces of their own.
#[tokio::test]
async fn a_stream_handler_s_calls_continue_the_trace_with_or_without_the_server_span() {
    // `None`: the server span seen; `Some(logged)`: filtered out.
    let cases = [None, Some(false), Some(true)]
        .into_iter()
        .flat_map(|filtered| [Runs::InTasks, Runs::Layered].map(|r| (filtered, r)));
    for (filtered, runs) in cases {
        let (traces, _guard) = match filtered {
            None => Traces::install(),
            Some(logged) => Traces::install_without(&["rpc.server"], logged),
        };
        let configure = move |b: rpc::ServerBuilder| match runs {
            Runs::InTasks | Runs::Inline => b,
            Runs::Layered => b.layer(rpc::server_layer_fn(|req, next| Box::pin(next.run(req)))),
        };
        let c = hop_server(None).await;
        let b = hop_server_with(Some(&c), configure).await;
        let case = format!("{filtered:?}, {runs:?}");
        let client = HopClient::new(client_of(&[&b]));
        let items: Vec<String> = futures_util::TryStreamExt::try_collect(
            client.hops(1).await.expect("the stream set up"),
        )
        .await
        .expect("its items");
        assert_eq!(items, ["none"], "{case}");
        // A stream's server span ends as its connection drops the stream, which may come after
        // the caller has its last item: with the server spans seen, waited for (three).
        let spans = traces
            .spans_once("the server spans end", |spans| {
                filtered.is_some() || named(spans, "rpc.server").len() == 3
            })
            .await;
        let servers = named(&spans, "rpc.server");
        let attempts = named(&spans, "rpc.client.attempt");
        let calls = named(&spans, "rpc.client");
        assert_eq!((calls.len(), attempts.len()), (3, 3), "{case}");
        // The stream's attempt went to B; the calls its handler made are the children of B's
        // server span, or of that attempt when the server span is filtered out.
        let outer = by_port(&attempts, "server.port", b.local_addr().port());
        let parent = match filtered {
            None => {
                assert_eq!(servers.len(), 3, "{case}");
                by_port(&servers, "server.port", b.local_addr().port())
            }
            Some(_) => {
                assert!(servers.is_empty(), "{case}");
                outer
            }
        };
        let inner: Vec<&SpanData> = calls
            .iter()
            .copied()
            .filter(|s| s.span_context.span_id() != outer.parent_span_id)
            .collect();
        assert_eq!(inner.len(), 2, "{case}: {calls:?}");
        for call in inner {
            assert_child(call, parent, &case);
        }
        common::within("shutdown", b.shutdown()).await;
        common::within("shutdown", c.shutdown()).await;
    }
}

/// The calls made to produce a bidirectional stream's request items (in the task that sends
/// them) continue the trace of the call whose handler opened the stream, also when a filter
/// keeps that handler's `rpc.server` span from OpenTelemetry: they carry its OpenTelemetry
/// context, as the handler's own calls do. (Before, the task had its span but not that
/// context, and those calls started traces of their own.)
#[tokio::test]
async fn calls_producing_a_bidi_streams_items_continue_the_trace() {
    for logged in [false, true] {
        let (traces, _guard) = Traces::install_without(&["rpc.server"], logged);
        let c = hop_server(None).await;
        let b = hop_server(Some(&c)).await;
        let client = HopClient::new(client_of(&[&b]));
        assert_eq!(client.relay_items().await.expect("relayed"), "none,none");
        let spans = traces.spans();
        let calls = named(&spans, "rpc.client");
        // The outer call, B's `echo_items` and the two `hop` calls making its items.
        assert_eq!(calls.len(), 4, "logged {logged}: {calls:?}");
        let outer = by_port(
            &named(&spans, "rpc.client.attempt"),
            "server.port",
            b.local_addr().port(),
        );
        for call in calls {
            assert_eq!(
                call.span_context.trace_id(),
                outer.span_context.trace_id(),
                "logged {logged}: {call:?}"
            );
        }
        common::within("shutdown", b.shutdown()).await;
        common::within("shutdown", c.shutdown()).await;
    }
}

#[tokio::test]
async fn one_trace_across_three_services_and_attachments_follow() {
    let (traces, _guard) = Traces::install();
    let c = hop_server(None).await;
    let b = hop_server(Some(&c)).await;
    let a = hop_server(Some(&b)).await;
    let client = HopClient::new(client_of(&[&a]));

    let attachments = BTreeMap::from([("tenant".to_string(), "acme".to_string())]);
    let tenant = RpcContext::scope(attachments, client.hop(2)).await.unwrap();
    assert_eq!(tenant, "acme", "the attachment travelled A → B → C");
    // Outside the scope there is nothing to carry.
    assert_eq!(client.hop(2).await.unwrap(), "none");

    let spans = traces.spans();
    let calls = named(&spans, "rpc.client");
    let attempts = named(&spans, "rpc.client.attempt");
    let servers = named(&spans, "rpc.server");
    assert_eq!(
        (calls.len(), attempts.len(), servers.len()),
        (6, 6, 6),
        "two calls of three hops each"
    );

    // The first call's spans: the trace of the B server span.
    let b_port = b.local_addr().port();
    let b_server = by_port(&servers, "server.port", b_port);
    let trace_id = b_server.span_context.trace_id();
    let first: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.span_context.trace_id() == trace_id)
        .collect();
    assert_eq!(first.len(), 9, "one trace holds the whole first call");

    // B's server span is a child of A's attempt span (the attempt that went to B's port).
    let first_attempts: Vec<&SpanData> = attempts
        .iter()
        .copied()
        .filter(|s| s.span_context.trace_id() == trace_id)
        .collect();
    let a_attempt = by_port(&first_attempts, "server.port", b_port);
    assert_eq!(b_server.parent_span_id, a_attempt.span_context.span_id());
    assert!(
        b_server.parent_span_is_remote,
        "the parent came over the wire"
    );
    // ... whose call span is a child of A's server span.
    let a_call = first
        .iter()
        .find(|s| s.span_context.span_id() == a_attempt.parent_span_id)
        .expect("the attempt's parent is in the trace");
    assert_eq!(a_call.name, "rpc.client");
    let a_server = by_port(&first, "server.port", a.local_addr().port());
    assert_eq!(a_server.name, "rpc.server");
    assert_eq!(a_call.parent_span_id, a_server.span_context.span_id());
    // The outermost call has no parent.
    let roots: Vec<&&SpanData> = first
        .iter()
        .filter(|s| s.parent_span_id == SpanId::INVALID)
        .collect();
    assert_eq!(roots.len(), 1);
    assert_eq!(roots[0].name, "rpc.client");

    // Attributes follow the OpenTelemetry RPC conventions.
    for s in &first {
        assert_eq!(attr_str(s, "rpc.system").as_deref(), Some("rpc"), "{s:?}");
        assert_eq!(attr_str(s, "rpc.service").as_deref(), Some("obs.Hop"));
        assert_eq!(attr_str(s, "rpc.method").as_deref(), Some("hop"));
        assert_eq!(attr_str(s, "rpc.entry_id").as_deref(), Some("obs.Hop.hop"));
        assert_eq!(attr_i64(s, "rpc.status_code"), Some(200), "{}", s.name);
        assert!(!matches!(s.status, Status::Error { .. }));
    }
    assert_eq!(
        attr_str(a_attempt, "server.address").as_deref(),
        Some("127.0.0.1")
    );
    assert_eq!(attr_i64(a_attempt, "rpc.attempt"), Some(0));
    assert_eq!(attr_str(a_attempt, "outcome").as_deref(), Some("success"));
    assert_eq!(
        attr_str(b_server, "client.address").as_deref(),
        Some("127.0.0.1")
    );
    assert_eq!(
        a_attempt.span_kind,
        opentelemetry::trace::SpanKind::Client,
        "otel.kind"
    );
    assert_eq!(a_call.span_kind, opentelemetry::trace::SpanKind::Internal);
    assert_eq!(b_server.span_kind, opentelemetry::trace::SpanKind::Server);

    for s in [a, b, c] {
        s.shutdown().await;
    }
}

fn event_fields(span: &SpanData, kind: &str) -> Option<BTreeMap<String, String>> {
    span.events.iter().find_map(|e| {
        let fields: BTreeMap<String, String> = e
            .attributes
            .iter()
            .map(|kv: &KeyValue| (kv.key.to_string(), kv.value.as_str().into_owned()))
            .collect();
        (fields.get("event").map(String::as_str) == Some(kind)).then_some(fields)
    })
}

#[rpc::service(name = "obs.Watched")]
trait Watched {
    #[governance(
        rate_limit_per_second = 1,
        rate_limit_burst = 1,
        rate_limit_observe = true
    )]
    async fn ping(&self) -> Result<(), RpcError>;
}

struct Pinged;

impl Watched for Pinged {
    async fn ping(&self) -> Result<(), RpcError> {
        Ok(())
    }
}

/// A call a rate limit in observe mode would refuse is admitted, and the `rate_limited` event
/// (observed) is on its `rpc.server` span, as an enforced refusal's is, on a server without
/// layers too. (Before, admission decided outside the call's span there: the event was on no
/// span, and OpenTelemetry dropped it.)
#[tokio::test(start_paused = true)]
async fn an_observed_refusal_is_on_the_calls_server_span() {
    let (traces, _guard) = Traces::install();
    let server = Server::builder()
        .add_service(WatchedServer::new(Pinged))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let watched = WatchedClient::new(client_of(&[&server]));
    // A burst of one: the second call is over the limit, and admitted all the same.
    watched.ping().await.expect("first");
    watched
        .ping()
        .await
        .expect("second, over the limit, observed");
    server.shutdown().await;
    let spans = traces.spans();
    let over: Vec<BTreeMap<String, String>> = named(&spans, "rpc.server")
        .into_iter()
        .filter_map(|s| event_fields(s, "rate_limited"))
        .collect();
    assert_eq!(over.len(), 1, "{over:?}");
    assert_eq!(over[0]["observed"], "true", "{over:?}");
    assert_eq!(over[0]["entry"], "obs.Watched.ping", "{over:?}");
}

#[tokio::test]
async fn fallback_events_land_on_the_spans_of_both_sides() {
    let (traces, _guard) = Traces::install();
    // The server answers `fail` from its own fallback.
    let server = Server::builder()
        .add_service(FlakyServer::new(Db {
            calls: AtomicU32::new(0),
        }))
        .fallback(FlakyServer::new(Zero))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let flaky = FlakyClient::new(client_of(&[&server]));
    assert_eq!(flaky.fail().await.unwrap(), 0);
    server.shutdown().await;

    // A client fallback answers when the server is gone.
    let client = Client::builder()
        .registry(StaticRegistry::from_list(&addr).unwrap())
        .fallback(FlakyServer::new(Zero))
        .build();
    assert_eq!(FlakyClient::new(client).fail().await.unwrap(), 0);

    let spans = traces.spans();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
    let server_span = *named(&spans, "rpc.server")
        .first()
        .unwrap_or_else(|| panic!("{names:?}"));
    let event = event_fields(server_span, "fallback").expect("fallback event on rpc.server");
    assert!(event["cause"].contains("database down"), "{event:?}");
    assert_eq!(event["entry"], "obs.Flaky.fail");
    assert_eq!(event["endpoint"], addr);
    assert_eq!(event["attempt"], "0");
    assert_eq!(attr_i64(server_span, "rpc.status_code"), Some(200));

    let calls = named(&spans, "rpc.client");
    assert_eq!(calls.len(), 2);
    let failed_call = calls
        .iter()
        .find(|s| event_fields(s, "fallback").is_some())
        .expect("a client fallback event");
    let event = event_fields(failed_call, "fallback").unwrap();
    assert_eq!(event["entry"], "obs.Flaky.fail");
    assert_eq!(event["endpoint"], addr, "{event:?}");
    assert_eq!(event["attempt"], "0");
    assert!(!event["cause"].is_empty());
    // The attempt failed: its span says so; the call itself was answered by the fallback.
    let attempt = named(&spans, "rpc.client.attempt")
        .into_iter()
        .find(|s| s.parent_span_id == failed_call.span_context.span_id())
        .expect("the failed attempt");
    assert!(
        matches!(attempt.status, Status::Error { .. }),
        "{attempt:?}"
    );
    assert_eq!(
        attr_i64(attempt, "rpc.status_code"),
        Some(i64::from(StatusCode::CommunicationError.as_u32()))
    );
    assert_eq!(attr_i64(failed_call, "rpc.status_code"), Some(200));
}

fn in_flight(metrics: &[ResourceMetrics], name: &str) -> i64 {
    metric_data(metrics, name)
        .map(|data| {
            let AggregatedMetrics::I64(MetricData::Sum(sum)) = data else {
                panic!("{name} is not an i64 up-down counter");
            };
            sum.data_points().map(|dp| dp.value()).sum::<i64>()
        })
        .sum()
}

#[tokio::test]
async fn metrics_after_a_retry_an_open_breaker_and_a_fallback() {
    // A subscriber here too: `tracing` caches each callsite's interest process-wide, and a
    // thread without one could register the spans' callsites as never wanted while the other
    // tests start.
    let (_traces, _guard) = Traces::install();
    let meters = Meters::new();
    let meter = meters.meter.clone();

    let db = Arc::new(Db {
        calls: AtomicU32::new(0),
    });
    let good = Server::builder()
        .meter(meter.clone())
        .add_service(FlakyServer::from_arc(db.clone()))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    // Every call to this one overflows at once.
    let full = Server::builder()
        .meter(meter.clone())
        .max_concurrency(0)
        .add_service(FlakyServer::from_arc(db.clone()))
        .serve("127.0.0.1:0")
        .await
        .unwrap();

    // Retries: round robin over both; calls starting on `full` are retried on `good`.
    let both = Client::builder()
        .meter(meter.clone())
        .registry(
            StaticRegistry::from_list(&format!("{},{}", good.local_addr(), full.local_addr()))
                .unwrap(),
        )
        .build();
    let flaky = FlakyClient::new(both);
    for _ in 0..4 {
        assert_eq!(flaky.ping().await.unwrap(), 1);
    }

    // The breaker: `fail` breaks after 2 failures; the fallback answers every call.
    let single = Client::builder()
        .meter(meter.clone())
        .registry(StaticRegistry::from_list(&good.local_addr().to_string()).unwrap())
        .override_options(
            "obs.Flaky.fail",
            GovernanceOverrides {
                exceptions_allowed_before_breaking: Some(2),
                ..GovernanceOverrides::NONE
            },
        )
        .fallback(FlakyServer::new(Zero))
        .build();
    let breaking = FlakyClient::new(single.clone());
    let mut fail_calls = 0;
    while !matches!(
        single.breaker_state(&FlakyClient::methods()[1]),
        BreakerState::Open { .. }
    ) {
        assert_eq!(breaking.fail().await.unwrap(), 0);
        fail_calls += 1;
        assert!(fail_calls < 10, "the breaker never opened");
    }
    assert_eq!(
        fail_calls, 2,
        "the breaker opens at its second failure in a row"
    );
    let reached = db.calls.load(Ordering::SeqCst);
    assert_eq!(breaking.fail().await.unwrap(), 0, "open breaker → fallback");
    fail_calls += 1;
    assert_eq!(db.calls.load(Ordering::SeqCst), reached, "not sent");

    let m = meters.read();
    let ev = |kind: &'static str, side: &'static str| {
        counter(
            &m,
            "rpc.governance.events",
            &[("event", kind.into()), ("rpc.side", side.into())],
        )
    };
    let retries = ev("retry", "client");
    let overflows = ev("overflow", "server");
    assert!(retries >= 1, "round robin started on `full` at least once");
    assert_eq!(overflows, retries, "each overflow was retried");
    assert_eq!(ev("break", "client"), 1);
    assert_eq!(ev("fallback", "client"), fail_calls);
    let ok = |method: &'static str| {
        counter(
            &m,
            "rpc.client.calls",
            &[
                ("rpc.method", method.into()),
                ("rpc.status_code", 200i64.into()),
            ],
        )
    };
    assert_eq!(ok("ping"), 4);
    // A fallback's answers are counted apart from real successes, under the status of the
    // failure each answered for.
    assert_eq!(ok("fail"), 0, "no real success");
    let fallback_answers = counter(
        &m,
        "rpc.client.calls",
        &[
            ("rpc.method", "fail".into()),
            ("rpc.outcome", "fallback".into()),
        ],
    );
    assert_eq!(fallback_answers, fail_calls, "the fallback answered");
    let server_calls = |code: StatusCode| {
        counter(
            &m,
            "rpc.server.calls",
            &[("rpc.status_code", i64::from(code.as_u32()).into())],
        )
    };
    assert_eq!(server_calls(StatusCode::Success), 4);
    assert_eq!(server_calls(StatusCode::OverflowMaxServerHandle), overflows);
    assert_eq!(
        server_calls(StatusCode::ServerError),
        u64::from(reached),
        "the open breaker sent nothing"
    );
    assert_eq!(
        histogram_count(&m, "rpc.client.duration", &[]),
        4 + fail_calls
    );
    // Every call counted is timed, the ones refused over the cap too.
    assert_eq!(
        histogram_count(&m, "rpc.server.duration", &[]),
        4 + u64::from(reached) + overflows
    );
    assert_eq!(in_flight(&m, "rpc.client.in_flight"), 0);
    assert_eq!(in_flight(&m, "rpc.server.in_flight"), 0);
    // Breaker state and endpoint health, read at collection.
    assert_eq!(
        gauge(
            &m,
            "rpc.client.breaker_state",
            "rpc.entry_id",
            "obs.Flaky.fail"
        ),
        Some(2),
        "open"
    );
    assert_eq!(
        gauge(
            &m,
            "rpc.client.breaker_state",
            "rpc.entry_id",
            "obs.Flaky.ping"
        ),
        Some(0),
        "closed"
    );
    assert_eq!(
        gauge(
            &m,
            "rpc.client.endpoint_health",
            "server.address",
            &good.local_addr().to_string()
        ),
        Some(1),
        "unhealthy: its server errors to `fail` are held against it too"
    );

    good.shutdown().await;
    full.shutdown().await;
}

/// An entry's first call looks its service up in the registry within its own `rpc.client`
/// span, which records the lookup (how long it took) as an event; later calls do not look it
/// up again.
#[tokio::test]
async fn the_first_calls_registry_lookup_is_recorded_in_its_span() {
    let (traces, _guard) = Traces::install();
    let server = hop_server(None).await;
    let client = HopClient::new(client_of(&[&server]));
    for _ in 0..2 {
        assert_eq!(client.hop(0).await.unwrap(), "none");
    }
    let spans = traces.spans();
    let calls = named(&spans, "rpc.client");
    assert_eq!(calls.len(), 2);
    let lookups: Vec<usize> = calls
        .iter()
        .map(|s| {
            s.events
                .iter()
                .filter(|e| e.name.contains("looked its service up in the registry"))
                .count()
        })
        .collect();
    assert_eq!(lookups, [1, 0], "the first call's span holds the lookup");
    server.shutdown().await;
}

/// An entry's first call dropped by its caller while it looks its service up (a registry that
/// does not answer) still ends its `rpc.client` span with a status saying so, and is counted:
/// in flight during the lookup, then once as cancelled; the client's call observers are told
/// so too (before, they never heard of it).
#[tokio::test]
async fn a_first_call_dropped_during_its_registry_lookup_ends_its_span_cancelled() {
    use common::registry::{Register, TestRegistry, Watch};
    let (traces, _guard) = Traces::install();
    let meters = Meters::new();
    let built = Client::builder()
        .meter(meters.meter.clone())
        .registry(TestRegistry::new(Register::Answers, Watch::Hangs))
        .build();
    let mut records = common::observe_calls(&built);
    let client = HopClient::new(built);
    let mut call = Box::pin(client.hop(0));
    assert!(
        futures_util::poll!(call.as_mut()).is_pending(),
        "the lookup waits for the registry"
    );
    assert_eq!(in_flight(&meters.read(), "rpc.client.in_flight"), 1);
    drop(call);
    let m = meters.read();
    assert_eq!(in_flight(&m, "rpc.client.in_flight"), 0);
    assert_eq!(
        counter(
            &m,
            "rpc.client.calls",
            &[("rpc.outcome", "cancelled".into())]
        ),
        1
    );
    assert_eq!(counter(&m, "rpc.client.calls", &[]), 1, "counted once");
    assert_eq!(
        records.try_recv().ok(),
        Some((
            HopClient::methods()[0].entry_id.to_string(),
            None,
            "cancelled".to_string()
        )),
        "the observers are told"
    );
    let spans = traces.spans();
    let calls = named(&spans, "rpc.client");
    assert_eq!(calls.len(), 1, "the dropped call's span ended");
    let description = match &calls[0].status {
        Status::Error { description } => description.to_string(),
        other => panic!("ended with {other:?}, not an error"),
    };
    assert!(
        description.contains("looking its service up") && description.contains("cancelled"),
        "{description}"
    );
}
