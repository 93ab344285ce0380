//! Readers of what the in-memory OpenTelemetry exporters recorded: span attributes and the sums
//! of counter and histogram data points, filtered by attributes.

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::Value;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt;

/// An in-memory meter for a test's clients and servers, and readings of what they recorded.
pub struct Meters {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
    /// The meter to give clients and servers.
    pub meter: opentelemetry::metrics::Meter,
}

impl Meters {
    pub fn new() -> Self {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        let meter = provider.meter("rpc");
        Meters {
            provider,
            exporter,
            meter,
        }
    }

    /// Everything recorded so far, as one collection (the exporter keeps every earlier
    /// reading's export, which would count each value once per reading: they are forgotten).
    pub fn read(&self) -> Vec<ResourceMetrics> {
        self.exporter.reset();
        self.provider.force_flush().expect("flush metrics");
        self.exporter.get_finished_metrics().expect("metrics")
    }
}

/// Spans recorded by a test's own subscriber (for its current-thread runtime).
pub struct Traces {
    provider: SdkTracerProvider,
    exporter: InMemorySpanExporter,
}

impl Traces {
    /// Installs the subscriber on this thread until the guard is dropped.
    pub fn install() -> (Self, tracing::subscriber::DefaultGuard) {
        Self::install_without(&[], false)
    }

    /// As [`install`](Self::install), with the spans named in `left_out` kept from
    /// OpenTelemetry by its layer's filter; with `logged`, a log layer beside it sees every span
    /// (so those spans exist, for the log only), else they are disabled. It replaces the
    /// thread's subscriber until the guard is dropped.
    pub fn install_without(
        left_out: &'static [&'static str],
        logged: bool,
    ) -> (Self, tracing::subscriber::DefaultGuard) {
        use tracing_subscriber::Layer as _;
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let log = logged.then(|| tracing_subscriber::fmt::layer().with_writer(std::io::sink));
        let subscriber = tracing_subscriber::registry().with(log).with(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("test"))
                .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                    !left_out.contains(&meta.name())
                })),
        );
        let guard = super::trace_this_thread(subscriber);
        (Traces { provider, exporter }, guard)
    }

    /// The spans ended so far.
    pub fn spans(&self) -> Vec<SpanData> {
        self.provider.force_flush().expect("flush spans");
        self.exporter.get_finished_spans().expect("spans")
    }

    /// The spans ended so far, once `ended` holds of them (within the tests' limit). A
    /// server's span of a call ends as its task drops it, which may come after what the test
    /// awaited (the answer, even the server's shutdown).
    pub async fn spans_once(
        &self,
        what: &str,
        ended: impl Fn(&[SpanData]) -> bool,
    ) -> Vec<SpanData> {
        super::within(what, async {
            loop {
                let spans = self.spans();
                if ended(&spans) {
                    break spans;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
    }
}

/// The value of attribute `key` on `span`.
pub fn attr(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

/// The data of every exported metric called `name`.
pub fn metric_data<'a>(
    metrics: &'a [ResourceMetrics],
    name: &'a str,
) -> impl Iterator<Item = &'a AggregatedMetrics> + 'a {
    metrics
        .iter()
        .flat_map(|rm| rm.scope_metrics())
        .flat_map(|sm| sm.metrics())
        .filter(move |m| m.name() == name)
        .map(|m| m.data())
}

/// Whether the attributes `attributes()` yields include every pair of `filter`.
fn matches<'a, I>(attributes: impl Fn() -> I, filter: &[(&str, Value)]) -> bool
where
    I: Iterator<Item = &'a opentelemetry::KeyValue>,
{
    filter
        .iter()
        .all(|(k, v)| attributes().any(|kv| kv.key.as_str() == *k && kv.value == *v))
}

/// Sum of the u64 counter `name` over the data points carrying every pair of `filter`.
pub fn counter(metrics: &[ResourceMetrics], name: &str, filter: &[(&str, Value)]) -> u64 {
    metric_data(metrics, name)
        .map(|d| {
            let AggregatedMetrics::U64(MetricData::Sum(sum)) = d else {
                panic!("{name} is not a u64 counter");
            };
            sum.data_points()
                .filter(|dp| matches(|| dp.attributes(), filter))
                .map(|dp| dp.value())
                .sum::<u64>()
        })
        .sum()
}

/// Values recorded by the f64 histogram `name` in the data points carrying every pair of
/// `filter`.
pub fn histogram_count(metrics: &[ResourceMetrics], name: &str, filter: &[(&str, Value)]) -> u64 {
    metric_data(metrics, name)
        .map(|d| {
            let AggregatedMetrics::F64(MetricData::Histogram(h)) = d else {
                panic!("{name} is not an f64 histogram");
            };
            h.data_points()
                .filter(|dp| matches(|| dp.attributes(), filter))
                .map(|dp| dp.count())
                .sum::<u64>()
        })
        .sum()
}

/// The last value of the i64 gauge `name` whose `label` is `key`.
pub fn gauge(metrics: &[ResourceMetrics], name: &str, label: &str, key: &str) -> Option<i64> {
    metric_data(metrics, name)
        .filter_map(|d| {
            let AggregatedMetrics::I64(MetricData::Gauge(g)) = d else {
                panic!("{name} is not an i64 gauge");
            };
            g.data_points()
                .filter(|dp| {
                    dp.attributes()
                        .any(|kv| kv.key.as_str() == label && kv.value.as_str() == key)
                })
                .map(|dp| dp.value())
                .last()
        })
        .last()
}
