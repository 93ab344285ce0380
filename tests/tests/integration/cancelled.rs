//! Cancelled work is visible: a call dropped by its caller or at its deadline ends its client
//! and server spans with a status, is counted in the call and duration metrics and leaves a
//! debug line with its elapsed time and budget; timeout events name the endpoint; a fallback's
//! answer is counted apart from real successes, `answered_by` says "fallback", and the fallback
//! can read why it runs; the gauges reach the final flush after the client is gone.
//!
//! Each test installs its own subscriber (spans to an in-memory OpenTelemetry exporter, log
//! lines to a buffer) for its own current-thread runtime, and hands its own meter to the
//! clients and servers.

use crate::common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::otel::{attr, counter, gauge, histogram_count, Meters};
use common::{recv_one, within, DropSignal};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use rpc::{
    Client, EventKind, GovernanceOverrides, RpcError, Server, ServerHandle, StaticRegistry,
    StatusCode,
};
use tokio::sync::mpsc;
use tracing_subscriber::layer::SubscriberExt;

#[rpc::service(name = "cancel.Slow")]
pub trait Slow {
    /// Never answers; reports when it starts and when its future is dropped.
    #[governance(retry_times = 0)]
    async fn forever(&self) -> Result<(), RpcError>;
    /// Fails with a server error.
    #[governance(retry_times = 0)]
    async fn broken(&self) -> Result<u32, RpcError>;
}

struct Hang {
    entered: mpsc::UnboundedSender<String>,
    dropped: mpsc::UnboundedSender<String>,
}

impl Slow for Hang {
    async fn forever(&self) -> Result<(), RpcError> {
        let _guard = DropSignal::new("forever", self.dropped.clone());
        let _ = self.entered.send("forever".into());
        std::future::pending::<()>().await;
        Ok(())
    }
    async fn broken(&self) -> Result<u32, RpcError> {
        Err(RpcError::new(StatusCode::ServerError, "database down"))
    }
}

/// A fallback that answers with the status code of the failure it answers for.
struct Cause;

impl Slow for Cause {
    async fn forever(&self) -> Result<(), RpcError> {
        Ok(())
    }
    async fn broken(&self) -> Result<u32, RpcError> {
        Ok(rpc::fallback_cause().map_or(0, |e| e.code().as_u32()))
    }
}

/// A fallback that fails in turn, with a business error.
struct Refusing;

impl Slow for Refusing {
    async fn forever(&self) -> Result<(), RpcError> {
        Err(RpcError::business("no"))
    }
    async fn broken(&self) -> Result<u32, RpcError> {
        Err(RpcError::business("no"))
    }
}

/// A writer for the log lines, shared with the test.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// What this test's subscriber and meter collect.
struct Seen {
    spans: SdkTracerProvider,
    span_exporter: InMemorySpanExporter,
    meters: Meters,
    meter: opentelemetry::metrics::Meter,
    lines: Lines,
}

impl Seen {
    fn install() -> (Seen, tracing::subscriber::DefaultGuard) {
        let span_exporter = InMemorySpanExporter::default();
        let spans = SdkTracerProvider::builder()
            .with_simple_exporter(span_exporter.clone())
            .build();
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(spans.tracer("test")))
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(move || writer.clone())
                    .with_filter(tracing_subscriber::filter::LevelFilter::DEBUG),
            );
        let guard = common::trace_this_thread(subscriber);
        let meters = Meters::new();
        let meter = meters.meter.clone();
        (
            Seen {
                spans,
                span_exporter,
                meters,
                meter,
                lines,
            },
            guard,
        )
    }

    /// The spans once the server's has ended (just after the handler's future is dropped).
    async fn server_span_ended(&self) -> Vec<SpanData> {
        self.spans_once(|s| s.name == "rpc.server").await
    }

    /// The spans once one of them is `wanted` (a server's span ends as its task drops it,
    /// which may come after what the test awaited).
    async fn spans_once(&self, wanted: impl Fn(&SpanData) -> bool) -> Vec<SpanData> {
        within("the span ended", async {
            loop {
                let spans = self.spans();
                if spans.iter().any(&wanted) {
                    return spans;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
    }

    fn spans(&self) -> Vec<SpanData> {
        self.spans.force_flush().unwrap();
        self.span_exporter.get_finished_spans().unwrap()
    }

    fn metrics(&self) -> Vec<ResourceMetrics> {
        self.meters.read()
    }
}

use tracing_subscriber::Layer as _;

fn one<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    let found: Vec<&SpanData> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "{name}: {found:#?}");
    found[0]
}

fn error_description(span: &SpanData) -> String {
    match &span.status {
        Status::Error { description } => description.to_string(),
        other => panic!("{} ended with {other:?}, not an error", span.name),
    }
}

struct Probe {
    entered: mpsc::UnboundedReceiver<String>,
    dropped: mpsc::UnboundedReceiver<String>,
}

async fn serve(meter: &opentelemetry::metrics::Meter) -> (ServerHandle, Probe) {
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let (dropped_tx, dropped) = mpsc::unbounded_channel();
    let server = Server::builder()
        .meter(meter.clone())
        .add_service(SlowServer::new(Hang {
            entered: entered_tx,
            dropped: dropped_tx,
        }))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    (server, Probe { entered, dropped })
}

/// A server of `Hang` (its handlers never answer) with `fallback` registered, recording to
/// `meter`.
async fn hanging_with_fallback(
    meter: &opentelemetry::metrics::Meter,
    fallback: impl Slow + 'static,
) -> ServerHandle {
    let (entered, _) = mpsc::unbounded_channel();
    let (dropped, _) = mpsc::unbounded_channel();
    Server::builder()
        .meter(meter.clone())
        .add_service(SlowServer::new(Hang { entered, dropped }))
        .fallback(SlowServer::new(fallback))
        .serve("127.0.0.1:0")
        .await
        .unwrap()
}

/// A client of `server` with the entries' own options.
fn plain_client(server: &ServerHandle) -> SlowClient {
    SlowClient::new(
        Client::builder()
            .registry(StaticRegistry::from_list(&server.local_addr().to_string()).unwrap())
            .build(),
    )
}

fn client_of(
    server: &ServerHandle,
    meter: &opentelemetry::metrics::Meter,
    timeout_ms: u64,
) -> Client {
    Client::builder()
        .meter(meter.clone())
        .registry(StaticRegistry::from_list(&server.local_addr().to_string()).unwrap())
        .override_options(
            SlowClient::SERVICE_ID,
            GovernanceOverrides {
                timeout_ms: Some(timeout_ms),
                ..GovernanceOverrides::NONE
            },
        )
        .build()
}

#[tokio::test]
async fn a_call_its_caller_drops_ends_both_spans_cancelled_and_is_counted() {
    let (seen, _guard) = Seen::install();
    let (server, mut probe) = serve(&seen.meter).await;
    let slow = SlowClient::new(client_of(&server, &seen.meter, 60_000));

    // The caller gives up once the handler runs: its future is dropped.
    let call = tokio::spawn(async move { slow.forever().await });
    recv_one("the handler started", &mut probe.entered).await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    // The server got Cancel and dropped the handler.
    recv_one("the handler dropped", &mut probe.dropped).await;
    // The server's span ends when the call's future is dropped, just after the handler's.
    let spans = seen.server_span_ended().await;

    for name in ["rpc.client", "rpc.client.attempt", "rpc.server"] {
        let span = one(&spans, name);
        let description = error_description(span);
        assert!(
            description.contains("cancelled by"),
            "{name}: {description}"
        );
        // The call's budget, or what was left of it when the attempt started.
        let budget: u64 = description
            .rsplit_once(" ms budget")
            .and_then(|(before, _)| before.rsplit_once('(')?.1.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no budget in {description:?}"));
        assert!((59_000..=60_000).contains(&budget), "{name}: {description}");
        assert_eq!(attr(span, "outcome"), Some("cancelled".into()), "{name}");
    }

    let m = seen.metrics();
    let cancelled = [("rpc.outcome", Value::from("cancelled"))];
    assert_eq!(counter(&m, "rpc.client.calls", &cancelled), 1);
    assert_eq!(histogram_count(&m, "rpc.client.duration", &cancelled), 1);
    assert_eq!(counter(&m, "rpc.server.calls", &cancelled), 1);
    assert_eq!(histogram_count(&m, "rpc.server.duration", &cancelled), 1);

    // A debug line on each side with the time the call ran and its budget.
    let lines = seen.lines.text();
    for what in [
        "call cancelled by its caller",
        "handler cancelled by the caller",
    ] {
        let line = lines
            .lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no debug line {what:?} in:\n{lines}"));
        assert!(line.contains("DEBUG"), "{line}");
        // The call's budget, or (on the server) what was left of it once connected.
        let budget: u64 = line
            .split_once("budget_ms=")
            .and_then(|(_, rest)| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no budget_ms in {line}"));
        assert!(
            line.contains("elapsed_ms=") && (59_000..=60_000).contains(&budget),
            "{line}"
        );
        assert!(
            line.contains("cancel.Slow.forever"),
            "the line names the entry: {line}"
        );
    }
    server.shutdown().await;
}

#[tokio::test]
async fn a_call_dropped_at_its_deadline_ends_its_spans_with_519_and_the_event_names_the_endpoint() {
    let (seen, _guard) = Seen::install();
    let (server, mut probe) = serve(&seen.meter).await;
    let client = client_of(&server, &seen.meter, 100);
    let mut events = client.events().subscribe();
    let slow = SlowClient::new(client);

    let err = within("the call", slow.forever()).await.unwrap_err();
    assert_eq!(err.code(), StatusCode::Timeout);
    recv_one("the handler dropped", &mut probe.dropped).await;
    let timeout = std::iter::from_fn(|| events.try_recv().ok())
        .find(|e| e.kind == EventKind::Timeout)
        .expect("a timeout event");
    assert_eq!(
        timeout.endpoint.as_deref(),
        Some(server.local_addr().to_string().as_str())
    );

    let spans = seen.server_span_ended().await;
    for name in ["rpc.client", "rpc.client.attempt"] {
        let span = one(&spans, name);
        assert_eq!(
            attr(span, "rpc.status_code"),
            Some(Value::I64(519)),
            "{name}"
        );
        // The outcome in the words of the server's spans and the metrics.
        assert_eq!(attr(span, "outcome"), Some("timeout".into()), "{name}");
        error_description(span);
    }
    // The server's handler ends by its own deadline (519) or by the Cancel the client sends
    // at the same moment, which reaches it a little before its deadline (cancelled): either
    // way the span ends with an error status and the call is counted once.
    let span = one(&spans, "rpc.server");
    let description = error_description(span);
    let (code, outcome) = (attr(span, "rpc.status_code"), attr(span, "outcome"));
    assert!(
        code == Some(Value::I64(519)) || outcome == Some("cancelled".into()),
        "{code:?} {outcome:?}: {description}"
    );
    let m = seen.metrics();
    let timed_out = [("rpc.status_code", Value::I64(519))];
    assert_eq!(counter(&m, "rpc.client.calls", &timed_out), 1);
    assert_eq!(counter(&m, "rpc.server.calls", &[]), 1);
    assert_eq!(histogram_count(&m, "rpc.server.duration", &[]), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn a_call_dropped_at_the_servers_drain_deadline_is_recorded_as_520_not_cancelled() {
    let (seen, _guard) = Seen::install();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel();
    let server = Server::builder()
        .meter(seen.meter.clone())
        .add_service(SlowServer::new(Hang {
            entered: entered_tx,
            dropped: dropped_tx,
        }))
        .drain_timeout(std::time::Duration::from_millis(50))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let call = forever_running(&server, &seen.meter, &mut entered).await;
    // The handler never ends: the drain deadline drops it, and the caller is answered 520.
    within("shutdown", server.shutdown()).await;
    recv_one("the handler dropped", &mut dropped).await;
    let err = within("the call", call).await.unwrap().unwrap_err();
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");

    let spans = seen.server_span_ended().await;
    // The server records what its caller was told, not a cancellation by the caller.
    let span = one(&spans, "rpc.server");
    let description = error_description(span);
    assert!(description.contains("drain deadline"), "{description}");
    assert_eq!(attr(span, "rpc.status_code"), Some(Value::I64(520)));
    assert_eq!(attr(span, "outcome"), Some("error".into()));
    let m = seen.metrics();
    let drained = [
        ("rpc.outcome", Value::from("error")),
        ("rpc.status_code", Value::I64(520)),
    ];
    counted_once_and_not_as_cancelled(&m, &drained);
}

/// A call of `forever` to `server`, in a task of its own, once its handler runs (it says so on
/// `entered`).
async fn forever_running(
    server: &ServerHandle,
    meter: &opentelemetry::metrics::Meter,
    entered: &mut mpsc::UnboundedReceiver<String>,
) -> tokio::task::JoinHandle<Result<(), RpcError>> {
    let slow = SlowClient::new(client_of(server, meter, 60_000));
    let call = tokio::spawn(async move { slow.forever().await });
    recv_one("the handler started", entered).await;
    call
}

/// The server counted one call with `attributes`, in its calls and its durations, and none as
/// cancelled.
fn counted_once_and_not_as_cancelled(m: &[ResourceMetrics], attributes: &[(&'static str, Value)]) {
    assert_eq!(
        counter(m, "rpc.server.calls", attributes),
        1,
        "{attributes:?}"
    );
    assert_eq!(
        histogram_count(m, "rpc.server.duration", attributes),
        1,
        "{attributes:?}"
    );
    let cancelled = [("rpc.outcome", Value::from("cancelled"))];
    assert_eq!(counter(m, "rpc.server.calls", &cancelled), 0);
}

/// A server stopped at once (`abort`) drops the handlers it runs: their spans and metrics say
/// `aborted`, the server's doing, and not `cancelled`, which would blame a caller that is
/// still waiting (and learns only that its connection ended).
#[tokio::test]
async fn a_call_dropped_by_the_servers_abort_is_recorded_as_aborted_not_cancelled() {
    let (seen, _guard) = Seen::install();
    let (server, mut probe) = serve(&seen.meter).await;
    let call = forever_running(&server, &seen.meter, &mut probe.entered).await;
    server.abort();
    recv_one("the handler dropped", &mut probe.dropped).await;
    let err = within("the call", call).await.unwrap().unwrap_err();
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");

    let spans = seen.server_span_ended().await;
    let span = one(&spans, "rpc.server");
    let description = error_description(span);
    assert!(description.contains("stopped at once"), "{description}");
    assert_eq!(attr(span, "outcome"), Some("aborted".into()));
    assert_eq!(
        attr(span, "rpc.status_code"),
        None,
        "the caller was not answered"
    );
    let m = seen.metrics();
    counted_once_and_not_as_cancelled(&m, &[("rpc.outcome", Value::from("aborted"))]);
}

/// The runtime a server runs on shut down under a running call (a `main` returning while the
/// server still serves): the call's task is dropped without being polled again, in no set order
/// with the connection's, and its handler is recorded as `aborted` all the same.
#[tokio::test]
async fn a_call_dropped_by_its_servers_runtime_shutting_down_is_recorded_as_aborted() {
    let (seen, _guard) = Seen::install();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the server's runtime");
    let meter = seen.meter.clone();
    let (server, mut probe) = runtime
        .spawn(async move { serve(&meter).await })
        .await
        .expect("the server started");
    let call = forever_running(&server, &seen.meter, &mut probe.entered).await;
    // Returns once every task of the runtime is dropped (or at LIMIT, failing below).
    tokio::task::spawn_blocking(move || runtime.shutdown_timeout(common::LIMIT))
        .await
        .expect("the runtime shut down");
    recv_one("the handler dropped", &mut probe.dropped).await;
    let err = within("the call", call).await.unwrap().unwrap_err();
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");

    let m = seen.metrics();
    counted_once_and_not_as_cancelled(&m, &[("rpc.outcome", Value::from("aborted"))]);
    drop(server);
}

#[tokio::test]
async fn a_fallback_answer_is_counted_apart_says_fallback_and_reads_its_cause() {
    let (seen, _guard) = Seen::install();
    let (server, _probe) = serve(&seen.meter).await;
    let client = Client::builder()
        .meter(seen.meter.clone())
        .registry(StaticRegistry::from_list(&server.local_addr().to_string()).unwrap())
        .fallback(SlowServer::new(Cause))
        .build();
    let slow = SlowClient::new(client);

    let (answer, by) = rpc::answered_by(slow.broken()).await;
    // The fallback saw the server's error (520) as its cause.
    assert_eq!(answer.unwrap(), StatusCode::ServerError.as_u32());
    assert_eq!(by.as_deref(), Some("fallback"));

    let m = seen.metrics();
    let broken = ("rpc.method", Value::from("broken"));
    assert_eq!(
        counter(
            &m,
            "rpc.client.calls",
            &[broken.clone(), ("rpc.status_code", Value::I64(200))]
        ),
        0,
        "not a real success"
    );
    assert_eq!(
        counter(
            &m,
            "rpc.client.calls",
            &[
                broken,
                ("rpc.outcome", "fallback".into()),
                ("rpc.status_code", Value::I64(520)),
            ]
        ),
        1
    );
    let spans = seen.spans();
    let call = one(&spans, "rpc.client");
    assert_eq!(attr(call, "outcome"), Some("fallback".into()));
    assert_eq!(attr(call, "rpc.fallback.cause"), Some(Value::I64(520)));
    server.shutdown().await;
}

/// A fallback that fails in turn still leaves on the call's span, client's or server's, the
/// status of the failure it ran for (`rpc.fallback.cause`), beside its own error's status.
/// Before, only a fallback that answered did: one that failed left no mark that it ran.
#[tokio::test]
async fn a_fallback_that_fails_still_leaves_its_cause_on_the_span() {
    let (seen, _guard) = Seen::install();
    // The client's: the server fails (520), the client's fallback then fails (1000).
    let (server, _probe) = serve(&seen.meter).await;
    let client = Client::builder()
        .meter(seen.meter.clone())
        .registry(StaticRegistry::from_list(&server.local_addr().to_string()).unwrap())
        .fallback(SlowServer::new(Refusing))
        .build();
    let e = within("the call", SlowClient::new(client).broken())
        .await
        .expect_err("the fallback fails");
    assert_eq!(e.code(), StatusCode::BusinessError, "{e}");
    let spans = seen.spans();
    let call = one(&spans, "rpc.client");
    assert_eq!(attr(call, "rpc.fallback.cause"), Some(Value::I64(520)));
    assert_eq!(attr(call, "rpc.status_code"), Some(Value::I64(1000)));
    server.shutdown().await;

    // The server's: its handler fails (520), its fallback then fails (1000).
    let server = hanging_with_fallback(&seen.meter, Refusing).await;
    let client = plain_client(&server);
    let e = within("the call", client.broken())
        .await
        .expect_err("the server's fallback fails");
    assert_eq!(e.code(), StatusCode::BusinessError, "{e}");
    // (The first part's server span is among them: its call failed 520, with no fallback.)
    let answered_1000 = |s: &SpanData| {
        s.name == "rpc.server" && attr(s, "rpc.status_code") == Some(Value::I64(1000))
    };
    let spans = seen.spans_once(answered_1000).await;
    let handled: Vec<_> = spans.iter().filter(|s| answered_1000(s)).collect();
    assert_eq!(handled.len(), 1, "{spans:#?}");
    assert_eq!(
        attr(handled[0], "rpc.fallback.cause"),
        Some(Value::I64(520))
    );
    server.shutdown().await;
}

/// A server fallback skipped because the caller's deadline passed (the handler ran until it,
/// 519) never ran: the server span says 519 and names no fallback cause, beside the
/// `fallback_skipped` event. Before, the span carried `rpc.fallback.cause`, as if the
/// fallback had run and failed.
#[tokio::test]
async fn a_server_fallback_skipped_at_the_deadline_leaves_no_cause_on_the_span() {
    use rpc::crates::core::wire::{frame::Kind, RemoteInvokeMessage};
    let (seen, _guard) = Seen::install();
    let server = hanging_with_fallback(&seen.meter, Refusing).await;
    let mut events = server.events().subscribe();
    // A caller speaking the wire by hand, which never cancels: the server decides at the
    // deadline.
    let mut raw = common::RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        message_id: 1,
        service_entry_id: "cancel.Slow.forever".into(),
        parameters: rpc::Codec::MsgPack
            .encode(&rpc::crates::core::NoArgs)
            .expect("encode"),
        timeout_ms: 100,
        ..Default::default()
    }))
    .await
    .expect("the call");
    let answer = raw.next_result("the answer").await;
    assert_eq!(answer.status_code, 519, "{answer:?}");
    let skipped = within("the skip", async {
        loop {
            let e = events.recv().await.expect("an event");
            if matches!(e.kind, EventKind::FallbackSkipped | EventKind::Fallback) {
                return e.kind;
            }
        }
    })
    .await;
    assert_eq!(skipped, EventKind::FallbackSkipped);
    let timed_out = |s: &SpanData| {
        s.name == "rpc.server" && attr(s, "rpc.status_code") == Some(Value::I64(519))
    };
    let spans = seen.spans_once(timed_out).await;
    let span = spans
        .iter()
        .find(|s| timed_out(s))
        .expect("the server span");
    assert_eq!(attr(span, "rpc.fallback.cause"), None, "{span:#?}");
    server.shutdown().await;
}

/// A business error (the callee's own answer) leaves the server span's status unset, as
/// OpenTelemetry's RPC conventions have server spans say, while the client span of the call
/// that received it is an error; a server error marks both. Before, the server span of a
/// business error was an error too, and error rates read from server spans counted the
/// callee's answers as failures.
#[tokio::test]
async fn the_callees_own_answer_leaves_the_server_span_status_unset() {
    let (seen, _guard) = Seen::install();
    for (handler, code) in [(true, 1000), (false, 520)] {
        let (entered, _) = mpsc::unbounded_channel();
        let (dropped, _) = mpsc::unbounded_channel();
        let builder = Server::builder().meter(seen.meter.clone());
        let builder = if handler {
            builder.add_service(SlowServer::new(Refusing))
        } else {
            builder.add_service(SlowServer::new(Hang { entered, dropped }))
        };
        let server = builder.serve("127.0.0.1:0").await.unwrap();
        let client = plain_client(&server);
        let e = within("the call", client.broken())
            .await
            .expect_err("fails");
        assert_eq!(e.code().as_u32(), code, "{e}");
        let with_code = |s: &SpanData, name: &str| {
            s.name == name && attr(s, "rpc.status_code") == Some(Value::I64(i64::from(code)))
        };
        let spans = seen.spans_once(|s| with_code(s, "rpc.server")).await;
        let handled = spans.iter().find(|s| with_code(s, "rpc.server")).unwrap();
        let call = spans.iter().find(|s| with_code(s, "rpc.client")).unwrap();
        assert!(
            matches!(call.status, Status::Error { .. }),
            "{code}: {call:#?}"
        );
        if code == 1000 {
            assert!(matches!(handled.status, Status::Unset), "{handled:#?}");
        } else {
            assert!(
                matches!(handled.status, Status::Error { .. }),
                "{handled:#?}"
            );
        }
        server.shutdown().await;
    }
}

#[tokio::test]
async fn a_server_fallback_reads_its_cause_and_is_counted_apart() {
    let (seen, _guard) = Seen::install();
    let server = hanging_with_fallback(&seen.meter, Cause).await;
    let slow = plain_client(&server);
    assert_eq!(
        slow.broken().await.unwrap(),
        StatusCode::ServerError.as_u32()
    );
    let m = seen.metrics();
    assert_eq!(
        counter(
            &m,
            "rpc.server.calls",
            &[
                ("rpc.outcome", "fallback".into()),
                ("rpc.status_code", Value::I64(520))
            ]
        ),
        1
    );
    assert_eq!(
        counter(
            &m,
            "rpc.server.calls",
            &[("rpc.status_code", Value::I64(200))]
        ),
        0
    );
    server.shutdown().await;
}

#[tokio::test]
async fn the_gauges_reach_the_final_flush_after_the_client_is_dropped() {
    let (seen, _guard) = Seen::install();
    let (server, _probe) = serve(&seen.meter).await;
    let client = client_of(&server, &seen.meter, 1000);
    let slow = SlowClient::new(client.clone());
    assert!(slow.broken().await.is_err());
    client.isolate(&SlowClient::methods()[1]);
    // A program's end: the client goes first, then the telemetry flushes.
    drop((slow, client));
    let m = seen.metrics();
    assert_eq!(
        gauge(
            &m,
            "rpc.client.breaker_state",
            "rpc.entry_id",
            "cancel.Slow.broken"
        ),
        Some(2),
        "the open breaker is in the final flush"
    );
    assert_eq!(
        gauge(
            &m,
            "rpc.client.endpoint_health",
            "server.address",
            &server.local_addr().to_string()
        ),
        Some(0)
    );
    server.shutdown().await;
}

/// A hedged call whose first attempt hangs: the hedge answers, and the first attempt, dropped
/// because the other answered first, ends its span as superseded with no error status (and a
/// debug line saying why); the call's own span succeeds.
#[tokio::test]
async fn the_losing_attempt_of_a_hedged_call_ends_superseded_not_as_an_error() {
    let (seen, _guard) = Seen::install();
    let (hang, mut probe) = serve(&seen.meter).await;
    let quick = hedged_calls(&seen.meter, &hang).await;
    // Its server was told to stop.
    recv_one("the hanging handler dropped", &mut probe.dropped).await;

    // The losing attempt's span ends once the last handle to it is gone.
    let hang_port = Some(Value::I64(i64::from(hang.local_addr().port())));
    let on_hang =
        |s: &SpanData| s.name == "rpc.client.attempt" && attr(s, "server.port") == hang_port;
    let spans = within("the losing attempt's span ended", async {
        loop {
            let spans = seen.spans();
            if spans.iter().any(on_hang) {
                return spans;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    let lost: Vec<&SpanData> = spans.iter().filter(|s| on_hang(s)).collect();
    for span in lost {
        assert_eq!(attr(span, "outcome"), Some("superseded".into()));
        assert!(
            !matches!(span.status, Status::Error { .. }),
            "the losing attempt is no error: {:?}",
            span.status
        );
    }
    for span in spans.iter().filter(|s| s.name == "rpc.client") {
        assert!(!matches!(span.status, Status::Error { .. }), "{span:#?}");
    }
    let lines = seen.lines.text();
    assert!(
        lines.contains("the hedged call's other attempt answered first"),
        "{lines}"
    );
    // Its server was told why in the `Cancel`: its span and its metrics say superseded, not
    // cancelled, and no error.
    superseded_on(&seen, &hang).await;
    hang.shutdown().await;
    quick.shutdown().await;
}

/// A middle tier that calls the hanging server for each call.
struct Relay {
    downstream: SlowClient,
}

impl Slow for Relay {
    async fn forever(&self) -> Result<(), RpcError> {
        self.downstream.forever().await
    }
    async fn broken(&self) -> Result<u32, RpcError> {
        self.downstream.broken().await
    }
}

/// A hedged call whose first attempt went to a middle tier waiting on the server below it: the
/// middle tier, told by `Cancel` that its call was superseded, drops its own call to the server
/// below as superseded too, so no tier counts a failure for a call that succeeded.
#[tokio::test]
async fn a_superseded_middle_tier_supersedes_its_own_calls() {
    let (seen, _guard) = Seen::install();
    // The bottom tier: hangs, counted in the test's meter.
    let (bottom, mut probe) = serve(&seen.meter).await;
    let relay = Server::builder()
        .add_service(SlowServer::new(Relay {
            downstream: SlowClient::new(
                Client::builder()
                    .registry(StaticRegistry::new([bottom.local_addr().to_string()]))
                    .build(),
            ),
        }))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let quick = hedged_calls(&seen.meter, &relay).await;
    recv_one("the bottom tier's handler dropped", &mut probe.dropped).await;
    superseded_on(&seen, &bottom).await;
    // The middle tier's own call to it, dropped with its handler, is no failure either.
    let bottom_port = Some(Value::I64(i64::from(bottom.local_addr().port())));
    let spans = seen.spans();
    let relayed: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == "rpc.client.attempt" && attr(s, "server.port") == bottom_port)
        .collect();
    assert!(
        !relayed.is_empty(),
        "the middle tier called the bottom tier"
    );
    for span in relayed {
        assert_eq!(
            attr(span, "outcome"),
            Some("superseded".into()),
            "{span:#?}"
        );
        assert!(!matches!(span.status, Status::Error { .. }), "{span:#?}");
    }
    for span in spans.iter().filter(|s| s.name == "rpc.client") {
        assert_ne!(attr(span, "outcome"), Some("cancelled".into()), "{span:#?}");
        assert!(!matches!(span.status, Status::Error { .. }), "{span:#?}");
    }
    bottom.shutdown().await;
    relay.shutdown().await;
    quick.shutdown().await;
}

/// Two calls of `forever` with a hedge after 20 ms, round robin over `hanging` and a server
/// started here that answers at once (returned): at least one call starts on `hanging`, and its
/// hedge answers.
async fn hedged_calls(
    meter: &opentelemetry::metrics::Meter,
    hanging: &ServerHandle,
) -> ServerHandle {
    let quick = Server::builder()
        .add_service(SlowServer::new(Cause))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let servers = [hanging, &quick];
    let slow = SlowClient::new(
        Client::builder()
            .meter(meter.clone())
            .registry(StaticRegistry::new(
                servers.map(|s| s.local_addr().to_string()),
            ))
            .override_options(
                SlowClient::SERVICE_ID,
                GovernanceOverrides {
                    hedge_delay_ms: Some(20),
                    idempotent: Some(true),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    for _ in 0..2 {
        within("a hedged call", slow.forever())
            .await
            .expect("the hedge answers");
    }
    quick
}

/// Waits until every `forever` call `server` handled has ended, each superseded with no error
/// status on its span and counted so (none as cancelled); it records into `seen`'s meter. (A
/// span ends just after its call is counted.)
async fn superseded_on(seen: &Seen, server: &ServerHandle) {
    let port = Some(Value::I64(i64::from(server.local_addr().port())));
    let on_server = |s: &SpanData| s.name == "rpc.server" && attr(s, "server.port") == port;
    let calls = |m: &[ResourceMetrics], outcome: &str| {
        counter(
            m,
            "rpc.server.calls",
            &[
                ("rpc.method", "forever".into()),
                ("rpc.outcome", outcome.to_string().into()),
            ],
        )
    };
    within("the server's spans and counts", async {
        loop {
            let spans = seen.spans();
            let stopped: Vec<&SpanData> = spans.iter().filter(|s| on_server(s)).collect();
            for span in &stopped {
                assert_eq!(
                    attr(span, "outcome"),
                    Some("superseded".into()),
                    "{span:#?}"
                );
                assert!(
                    !matches!(span.status, Status::Error { .. }),
                    "a stopped handler is no error: {span:#?}"
                );
            }
            let m = seen.metrics();
            assert_eq!(calls(&m, "cancelled"), 0);
            if !stopped.is_empty() && calls(&m, "superseded") == stopped.len() as u64 {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
}

/// Two versions of one service: the second added `credit` between `get` and `debit`.
mod acct {
    pub mod v2 {
        #[rpc::service(name = "t.Acct")]
        pub trait Acct {
            async fn get(&self) -> Result<u64, rpc::RpcError>;
            async fn credit(&self, amount: u64) -> Result<u64, rpc::RpcError>;
            async fn debit(&self, amount: u64) -> Result<u64, rpc::RpcError>;
        }
    }
    pub mod v1 {
        #[rpc::service(name = "t.Acct")]
        pub trait Acct {
            async fn get(&self) -> Result<u64, rpc::RpcError>;
            async fn debit(&self, amount: u64) -> Result<u64, rpc::RpcError>;
        }
    }
}

/// A v2 account whose every method fails with 500.
struct Broken;

impl acct::v2::Acct for Broken {
    async fn get(&self) -> Result<u64, RpcError> {
        Err(RpcError::new(StatusCode::FrameworkError, "broken"))
    }
    async fn credit(&self, _: u64) -> Result<u64, RpcError> {
        Err(RpcError::new(StatusCode::FrameworkError, "broken"))
    }
    async fn debit(&self, _: u64) -> Result<u64, RpcError> {
        Err(RpcError::new(StatusCode::FrameworkError, "broken"))
    }
}

/// A v1 account as a fallback: `get` answers 7, `debit` counts its runs.
#[derive(Clone, Default)]
struct Spare(Arc<Mutex<u32>>);

impl acct::v1::Acct for Spare {
    async fn get(&self) -> Result<u64, RpcError> {
        Ok(7)
    }
    async fn debit(&self, _: u64) -> Result<u64, RpcError> {
        *self.0.lock().unwrap() += 1;
        Ok(0)
    }
}

/// A server's fallback answers an entry with its own method of that entry, found by id: a
/// fallback of another version of the service (here without `credit`) runs `get` for `get`,
/// and nothing for `credit`. Before, it was called with the service's method number: `credit`
/// (number 1) ran the fallback's number 1, `debit`, with `credit`'s arguments.
#[tokio::test]
async fn a_server_fallback_runs_its_own_method_of_the_entry_or_none() {
    use acct::v2::Acct as _;
    let reg = rpc::InProcessRegistry::new();
    let spare = Spare::default();
    let server = rpc::Server::builder()
        .registry(reg.clone())
        .add_service(acct::v2::AcctServer::new(Broken))
        .fallback(acct::v1::AcctServer::new(spare.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = acct::v2::AcctClient::new(
        Client::builder()
            .registry(reg)
            .override_options("t.Acct", common::no_retry())
            .build(),
    );
    assert_eq!(
        within("get", client.get())
            .await
            .expect("the fallback's get"),
        7
    );
    let e = within("credit", client.credit(5))
        .await
        .expect_err("no fallback for credit");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert_eq!(
        *spare.0.lock().unwrap(),
        0,
        "the fallback's debit ran for credit"
    );
    within("shutdown", server.shutdown()).await;
}
