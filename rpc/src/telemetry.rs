//! Exporting traces and metrics (feature `otel`).
//!
//! The framework instruments itself with `tracing` spans and OpenTelemetry metrics; this module
//! installs what turns them into OpenTelemetry data: a `tracing` subscriber (formatted logs
//! filtered by `RUST_LOG`, plus the `tracing-opentelemetry` layer taking `info` spans and
//! above whatever `RUST_LOG` says), the W3C trace-context
//! propagator and the global tracer and meter providers.
//!
//! [`init_stdout`] exports to standard output, for the demo programs and for trying things out;
//! `init_otlp` (feature `otlp`) exports over OTLP/gRPC to anything that takes it (Jaeger, Tempo,
//! Grafana, an OpenTelemetry collector), configured by the standard `OTEL_*` environment
//! variables; [`init_with`] takes providers built with any exporter.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let telemetry = rpc::telemetry::init_stdout()?;
//! // ... serve and call ...
//! telemetry.shutdown(); // flushes what is buffered
//! # Ok(()) }
//! ```

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer as _;

/// The OpenTelemetry crates this build uses, to build providers and exporters of matching
/// versions.
pub use {opentelemetry, opentelemetry_sdk, tracing_opentelemetry};

/// The installed providers. [`shutdown`](Self::shutdown) (or dropping it) flushes and stops
/// them.
#[derive(Debug)]
pub struct Telemetry {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
}

impl Telemetry {
    /// The tracer provider in use.
    pub fn tracer_provider(&self) -> &SdkTracerProvider {
        &self.tracer_provider
    }

    /// The meter provider in use.
    pub fn meter_provider(&self) -> &SdkMeterProvider {
        &self.meter_provider
    }

    /// Exports what is buffered and stops the providers, blocking this thread until done
    /// (as dropping it does). Exporters that send on the tokio runtime they were built in
    /// (`init_otlp`'s) need that runtime to run meanwhile: inside a runtime, await
    /// [`shutdown_async`](Self::shutdown_async) instead. On a current-thread runtime this
    /// blocks the very thread the export needs: it waits out the exporters' timeouts and
    /// loses what they had not sent.
    pub fn shutdown(self) {
        // Drop does the work.
    }

    /// [`shutdown`](Self::shutdown) on a blocking thread, awaited: the runtime goes on
    /// running (its exporters' sends among its tasks) until everything buffered is exported,
    /// on a current-thread runtime too. What an async `main` calls before it returns.
    pub async fn shutdown_async(self) {
        // (A panic in an exporter's shutdown is not this caller's to re-raise.)
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let _ = self.tracer_provider.force_flush();
        let _ = self.meter_provider.force_flush();
        let _ = self.tracer_provider.shutdown();
        let _ = self.meter_provider.shutdown();
    }
}

/// Why telemetry could not be installed.
#[derive(Debug)]
pub struct TelemetryError(String);

impl std::fmt::Display for TelemetryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TelemetryError {}

/// Installs telemetry exporting spans (as each ends) and metrics (every 60 s and at shutdown)
/// to standard output, plus formatted logs on standard error filtered by `RUST_LOG` (default
/// `info`). Call it once, before building clients and servers (they take the global meter
/// when built).
pub fn init_stdout() -> Result<Telemetry, TelemetryError> {
    let tracer_provider = SdkTracerProvider::builder()
        .with_simple_exporter(opentelemetry_stdout::SpanExporter::default())
        .build();
    let meter_provider = SdkMeterProvider::builder()
        .with_periodic_exporter(opentelemetry_stdout::MetricExporter::default())
        .build();
    init_with(tracer_provider, meter_provider)
}

/// Installs telemetry exporting spans and metrics over OTLP/gRPC, configured by the standard
/// environment variables: `OTEL_EXPORTER_OTLP_ENDPOINT` (default `http://localhost:4317`),
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `..._METRICS_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`,
/// `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`. Spans are sent
/// in batches, metrics every 60 s (`OTEL_METRIC_EXPORT_INTERVAL`) and at shutdown. Call it from
/// within a tokio runtime. An unreachable collector is not an error here: exports fail later
/// and are reported through the SDK's internal logs.
#[cfg(feature = "otlp")]
pub fn init_otlp() -> Result<Telemetry, TelemetryError> {
    let spans = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| TelemetryError(format!("OTLP span exporter: {e}")))?;
    let metrics = opentelemetry_otlp::MetricExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| TelemetryError(format!("OTLP metric exporter: {e}")))?;
    let tracer_provider = SdkTracerProvider::builder()
        .with_batch_exporter(spans)
        .build();
    let meter_provider = SdkMeterProvider::builder()
        .with_periodic_exporter(metrics)
        .build();
    init_with(tracer_provider, meter_provider)
}

/// Installs telemetry with providers built elsewhere (any exporter): the W3C trace-context
/// propagator and `meter_provider` become global, and a `tracing` subscriber (logs filtered by
/// `RUST_LOG` on standard error, formatted as [`crate::logging::layer`] does; spans at `info`
/// and above to `tracer_provider`, whatever `RUST_LOG` says) becomes the global default.
/// `RUST_LOG` filters the logs only: `RUST_LOG=warn` quiets them and still exports the calls'
/// spans and sends their trace context on.
/// Fails when a global subscriber is already set, and then makes nothing global.
pub fn init_with(
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
) -> Result<Telemetry, TelemetryError> {
    let tracer = tracer_provider.tracer("rpc");
    let (filter, problem) = crate::logging::env_filter();
    // The subscriber first: when it cannot be installed, nothing is made global (a meter
    // provider left global would be one nobody shuts down, its last export lost).
    crate::logging::install(
        tracing_subscriber::registry()
            .with(crate::logging::layer().with_filter(filter))
            .with(
                tracing_opentelemetry::layer()
                    .with_tracer(tracer)
                    .with_filter(LevelFilter::INFO),
            ),
    )
    .map_err(TelemetryError)?;
    crate::logging::warn_about(problem);
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(tracer_provider.clone());
    opentelemetry::global::set_meter_provider(meter_provider.clone());
    Ok(Telemetry {
        tracer_provider,
        meter_provider,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a global subscriber set already, installing fails and leaves the global
    /// propagator (and providers) as they were: the default propagator injects nothing.
    #[test]
    fn a_failed_install_makes_nothing_global() {
        tracing::subscriber::set_global_default(tracing_subscriber::registry())
            .expect("the first global subscriber");
        let installed = init_with(
            SdkTracerProvider::builder().build(),
            SdkMeterProvider::builder().build(),
        );
        assert!(installed.is_err(), "a second global subscriber");
        let fields = opentelemetry::global::get_text_map_propagator(|p| p.fields().count());
        assert_eq!(fields, 0, "the trace-context propagator was made global");
    }
}
