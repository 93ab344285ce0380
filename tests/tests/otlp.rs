//! OTLP export: `rpc::telemetry::init_otlp` sends to the endpoint the standard `OTEL_*`
//! environment variables name. A real OTLP/gRPC receiver runs in the test (the collector's
//! trace service, generated from the OpenTelemetry protos and served by tonic); the spans of a
//! call are decoded from what it received. (Its own test binary: it installs the global
//! subscriber and sets process environment variables.)

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::within;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use rpc::{Client, RpcError, Server, StaticRegistry};
use tokio::sync::mpsc;

#[rpc::service(name = "otlp.Echo")]
trait Echo {
    #[governance(retry_times = 0)]
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

struct Parrot;

impl Echo for Parrot {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
}

/// The receiving end of an OpenTelemetry collector: hands every export request to the test.
struct Collector(mpsc::UnboundedSender<ExportTraceServiceRequest>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let _ = self.0.send(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn attributes(attrs: &[KeyValue]) -> BTreeMap<String, Value> {
    attrs
        .iter()
        .filter_map(|kv| {
            let v = kv.value.as_ref()?.value.clone()?;
            Some((kv.key.clone(), v))
        })
        .collect()
}

fn string(s: &str) -> Value {
    Value::StringValue(s.into())
}

/// On a current-thread runtime (the receiver, the server and the client all on it):
/// `shutdown_async` lets the runtime run the exporter's sends while it flushes.
#[tokio::test]
async fn init_otlp_exports_the_spans_of_a_call_to_the_endpoint_named_by_otel_env_vars() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (exports_tx, mut exports) = mpsc::unbounded_channel();
    let collector = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Collector(exports_tx)))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}"));
    std::env::set_var("OTEL_EXPORTER_OTLP_TIMEOUT", "5000");
    std::env::set_var("OTEL_SERVICE_NAME", "otlp-test");
    // Logs filtered to warnings: the spans are exported and the trace crosses the wire all
    // the same (before, RUST_LOG filtered the spans away too, and nothing was exported).
    std::env::set_var("RUST_LOG", "warn");

    let telemetry = rpc::telemetry::init_otlp().expect("init_otlp");
    let server = Server::builder()
        .add_service(EchoServer::new(Parrot))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let port = server.local_addr().port();
    let client = EchoClient::new(
        Client::builder()
            .registry(StaticRegistry::new([server.local_addr().to_string()]))
            .build(),
    );
    assert_eq!(
        within("call", client.echo("hi".into()))
            .await
            .expect("echo"),
        "hi"
    );
    within("shutdown", server.shutdown()).await;
    // Shutting down flushes the batch of spans to the receiver, which answers.
    within("telemetry shutdown", telemetry.shutdown_async()).await;

    let mut requests = Vec::new();
    while let Ok(r) = exports.try_recv() {
        requests.push(r);
    }
    assert!(!requests.is_empty(), "the receiver got no export");
    let mut spans: Vec<Span> = Vec::new();
    for r in requests {
        for rs in r.resource_spans {
            let resource = attributes(&rs.resource.map(|r| r.attributes).unwrap_or_default());
            assert_eq!(
                resource.get("service.name"),
                Some(&string("otlp-test")),
                "OTEL_SERVICE_NAME names the resource"
            );
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
    }
    let one = |name: &str| -> Span {
        let found: Vec<&Span> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
        found[0].clone()
    };
    let call = one("rpc.client");
    let attempt = one("rpc.client.attempt");
    let handled = one("rpc.server");

    // Kinds.
    assert_eq!(call.kind, SpanKind::Internal as i32, "rpc.client kind");
    assert_eq!(
        attempt.kind,
        SpanKind::Client as i32,
        "rpc.client.attempt kind"
    );
    assert_eq!(handled.kind, SpanKind::Server as i32, "rpc.server kind");

    // One trace: call → attempt → (over the wire) server.
    assert_eq!(call.trace_id.len(), 16);
    assert_eq!(attempt.trace_id, call.trace_id);
    assert_eq!(handled.trace_id, call.trace_id);
    assert!(call.parent_span_id.is_empty(), "the call is the root");
    assert_eq!(attempt.parent_span_id, call.span_id);
    assert_eq!(handled.parent_span_id, attempt.span_id);

    // Attributes (OpenTelemetry RPC conventions).
    for s in [&call, &attempt, &handled] {
        let a = attributes(&s.attributes);
        assert_eq!(a.get("rpc.system"), Some(&string("rpc")), "{}", s.name);
        assert_eq!(
            a.get("rpc.service"),
            Some(&string("otlp.Echo")),
            "{}",
            s.name
        );
        assert_eq!(a.get("rpc.method"), Some(&string("echo")), "{}", s.name);
        assert_eq!(
            a.get("rpc.entry_id"),
            Some(&string("otlp.Echo.echo")),
            "{}",
            s.name
        );
        assert_eq!(
            a.get("rpc.status_code"),
            Some(&Value::IntValue(200)),
            "{}",
            s.name
        );
    }
    let a = attributes(&attempt.attributes);
    assert_eq!(a.get("server.address"), Some(&string("127.0.0.1")));
    assert_eq!(
        a.get("server.port"),
        Some(&Value::IntValue(i64::from(port)))
    );
    assert_eq!(a.get("rpc.attempt"), Some(&Value::IntValue(0)));
    let h = attributes(&handled.attributes);
    assert_eq!(h.get("client.address"), Some(&string("127.0.0.1")));

    collector.abort();
    let _ = tokio::time::timeout(Duration::from_secs(1), collector).await;
}
