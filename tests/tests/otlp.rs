//! OTLP export: `rpc::telemetry::init_otlp` sends to the endpoint the standard `OTEL_*`
//! environment variables name. (Its own test binary: it installs the global subscriber and sets
//! a process environment variable.)

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_otlp_exports_to_the_endpoint_named_by_otel_env_vars() {
    // A stand-in collector: the test only needs to see the exporter connect to it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}"));
    std::env::set_var("OTEL_EXPORTER_OTLP_TIMEOUT", "1000");

    let telemetry = rpc::telemetry::init_otlp().expect("init_otlp");
    tracing::info_span!("rpc.client", rpc.system = "rpc").in_scope(|| {
        tracing::info!("inside a span");
    });
    let accepted = tokio::spawn(async move { listener.accept().await.map(|(_, peer)| peer) });
    // Shutting down flushes the batch of spans to the endpoint.
    let flushed = tokio::task::spawn_blocking(move || telemetry.shutdown());
    let peer = tokio::time::timeout(Duration::from_secs(10), accepted)
        .await
        .expect("the exporter connected to the endpoint from OTEL_EXPORTER_OTLP_ENDPOINT")
        .expect("join")
        .expect("accept");
    assert!(peer.ip().is_loopback());
    // The stand-in never answers: the flush gives up after OTEL_EXPORTER_OTLP_TIMEOUT.
    tokio::time::timeout(Duration::from_secs(15), flushed)
        .await
        .expect("shutdown returns even when the collector does not answer")
        .expect("join");
}
