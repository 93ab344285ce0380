//! `GET /metrics`: the process's calls, latencies, governance events, breakers and endpoint
//! health in the Prometheus text format (OpenMetrics 1.0), by the Prometheus project's own
//! client library (`prometheus-client`).
//!
//! Why not the OpenTelemetry metrics the framework already has (feature `otel`): the
//! OpenTelemetry Prometheus exporter for Rust was discontinued at 0.29 and cannot follow
//! opentelemetry 0.33, and an admin endpoint must work in a build without `otel`. So the call
//! path feeds these instruments directly ([`CallObserver`]), and the events come from the
//! buses' subscriptions.
//!
//! Series:
//! - `rpc_calls_total{side, entry, status, outcome}`: calls ended (`status` is the final
//!   status code, `other` for every status the framework does not define, `none` for a call
//!   its caller gave up on; `outcome` as in the OpenTelemetry
//!   metrics: success, error, fallback, timeout, cancelled, superseded, and a server's
//!   aborted);
//! - `rpc_call_duration_seconds{side, entry, outcome}`: their latency (histogram), by outcome
//!   as the OpenTelemetry `rpc.client.duration` is: a call its caller dropped (`cancelled`) or
//!   a hedge dropped for another attempt's answer (`superseded`) ends when its caller stops
//!   waiting, and its time is no latency of the service's;
//! - `rpc_governance_events_total{side, kind, observed}`: governance decisions by kind,
//!   `observed="true"` for those a policy in observe mode only reported;
//! - `rpc_breaker_state{entry}`: 0 closed, 1 half-open, 2 open (an isolated breaker is open);
//! - `rpc_endpoint_health{address}`: 0 healthy, 1 unhealthy for now, 2 removed;
//! - `rpc_server_ready`: 1 when the server is registered (or has no registry) and not
//!   draining, or when the endpoint has no server (a client's), as `/readyz` answers;
//! - `rpc_admin_events_lost_total`: events the admin endpoint fell too far behind to read.

use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use rpc_governance::calls::{CallObserver, CallRecord};

/// The content type of [`Metrics::render`]'s text.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

// The labels of the per-call series borrow `'static` strings (entry ids are their
// descriptors'): counting a call whose series exists allocates nothing.

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    side: &'static str,
    entry: &'static str,
    status: Status,
    outcome: &'static str,
}

/// A final status code (`other` for every status the framework does not define), or `none`
/// for a call its caller gave up on.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Status(Option<u32>);

impl EncodeLabelValue for Status {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        match self.0 {
            // Every status the framework does not define is one series.
            Some(0) => encoder.write_str("other"),
            Some(code) => write!(encoder, "{code}"),
            None => encoder.write_str("none"),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LatencyLabels {
    side: &'static str,
    entry: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    side: String,
    kind: String,
    /// `"true"` for what a policy in observe mode would have done (nothing was refused).
    observed: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerLabels {
    entry: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AddressLabels {
    address: String,
}

type LatencyFamily = Family<LatencyLabels, Histogram, fn() -> Histogram>;

/// The instruments and their registry.
pub(crate) struct Metrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    latency: LatencyFamily,
    events: Family<EventLabels, Counter>,
    breakers: Family<BreakerLabels, Gauge>,
    endpoints: Family<AddressLabels, Gauge>,
    ready: Gauge,
    lost: Counter,
    /// Held while the gauges are refreshed and the text is written, so two scrapes at once do
    /// not interleave clearing and setting.
    render: Mutex<()>,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms to about 16 s, doubling.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::default();
        let calls = Family::<CallLabels, Counter>::default();
        let latency: LatencyFamily = Family::new_with_constructor(latency_histogram);
        let events = Family::<EventLabels, Counter>::default();
        let breakers = Family::<BreakerLabels, Gauge>::default();
        let endpoints = Family::<AddressLabels, Gauge>::default();
        let ready = Gauge::default();
        let lost = Counter::default();
        registry.register(
            "rpc_calls",
            "Calls ended, by side (client: made, server: handled), entry, final status and outcome",
            calls.clone(),
        );
        registry.register(
            "rpc_call_duration_seconds",
            "Duration of calls, retries and fallback included, by side, entry and outcome",
            latency.clone(),
        );
        registry.register(
            "rpc_governance_events",
            "Governance decisions (retry, break, isolate, overflow, fallback, ...) by side and kind",
            events.clone(),
        );
        registry.register(
            "rpc_breaker_state",
            "Circuit breaker per entry: 0 closed, 1 half-open, 2 open (isolated included)",
            breakers.clone(),
        );
        registry.register(
            "rpc_endpoint_health",
            "Endpoint as this client sees it: 0 healthy, 1 unhealthy for now, 2 removed",
            endpoints.clone(),
        );
        registry.register(
            "rpc_server_ready",
            "1 when the server is registered (or has no registry) and not draining",
            ready.clone(),
        );
        registry.register(
            "rpc_admin_events_lost",
            "Governance events the admin endpoint fell too far behind to read",
            lost.clone(),
        );
        Metrics {
            registry,
            calls,
            latency,
            events,
            breakers,
            endpoints,
            ready,
            lost,
            render: Mutex::new(()),
        }
    }

    /// Counts a governance event; `observed`: a policy in observe mode reporting what it would
    /// have done, counted apart so that an alert on refusals sees only real ones.
    pub(crate) fn event(&self, side: &str, kind: &str, observed: bool) {
        self.events
            .get_or_create(&EventLabels {
                side: side.to_string(),
                kind: kind.to_string(),
                observed: observed.to_string(),
            })
            .inc();
    }

    /// Counts events a subscription lost.
    pub(crate) fn lost(&self, n: u64) {
        self.lost.inc_by(n);
    }

    /// The text of a scrape, after setting the gauges to `breakers` (entry, 0/1/2),
    /// `endpoints` (address, 0/1/2) and `ready`.
    pub(crate) fn render(
        &self,
        breakers: Vec<(String, i64)>,
        endpoints: Vec<(String, i64)>,
        ready: Option<bool>,
    ) -> String {
        let _held = self.render.lock().unwrap_or_else(|p| p.into_inner());
        self.breakers.clear();
        for (entry, v) in breakers {
            self.breakers.get_or_create(&BreakerLabels { entry }).set(v);
        }
        self.endpoints.clear();
        for (address, v) in endpoints {
            self.endpoints
                .get_or_create(&AddressLabels { address })
                .set(v);
        }
        // No server attached: ready, as `/readyz` answers.
        self.ready.set(ready.map_or(1, i64::from));
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

impl CallObserver for Metrics {
    fn call_ended(&self, call: &CallRecord) {
        let (side, entry) = (call.side.as_str(), call.entry);
        self.calls
            .get_or_create(&CallLabels {
                side,
                entry,
                status: Status(call.status.map(|s| s.metric_code())),
                outcome: call.outcome,
            })
            .inc();
        self.latency
            .get_or_create(&LatencyLabels {
                side,
                entry,
                outcome: call.outcome,
            })
            .observe(call.elapsed.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call its caller dropped is timed apart from the calls that were answered: its time
    /// says when the caller stopped waiting, not how long the service took.
    #[test]
    fn dropped_calls_are_timed_apart_from_answered_ones() {
        let m = Metrics::new();
        let ended = |outcome, ms| {
            m.call_ended(&CallRecord {
                side: rpc_governance::calls::Side::Client,
                entry: "t.T.m",
                status: None,
                outcome,
                elapsed: std::time::Duration::from_millis(ms),
            })
        };
        ended("success", 1);
        ended("success", 3);
        ended("cancelled", 5_000);
        ended("superseded", 2_000);
        let text = m.render(Vec::new(), Vec::new(), None);
        let sum = |outcome: &str| {
            let head = format!(
                "rpc_call_duration_seconds_sum{{side=\"client\",entry=\"t.T.m\",outcome=\"{outcome}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(head.as_str()))
                .map(|v| v.parse::<f64>().expect("a number"))
        };
        assert_eq!(sum("success"), Some(0.004), "{text}");
        assert_eq!(sum("cancelled"), Some(5.0), "{text}");
        assert_eq!(sum("superseded"), Some(2.0), "{text}");
    }

    /// Statuses a peer made up do not each make a series: they are counted as `other`.
    #[test]
    fn undefined_statuses_are_one_series() {
        let m = Metrics::new();
        for code in [100_001, 100_002, 100_003, 7] {
            m.call_ended(&CallRecord {
                side: rpc_governance::calls::Side::Server,
                entry: "t.T.m",
                status: Some(rpc_core::StatusCode::from_u32(code)),
                outcome: "error",
                elapsed: std::time::Duration::from_millis(1),
            });
        }
        let text = m.render(Vec::new(), Vec::new(), None);
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("rpc_calls_total{"))
            .collect();
        assert_eq!(series.len(), 1, "{text}");
        assert!(
            series[0].contains("status=\"other\"") && series[0].ends_with(" 4"),
            "{text}"
        );
    }

    /// An observe-mode event is counted apart from a real one of the same kind.
    #[test]
    fn observed_events_are_a_series_of_their_own() {
        let m = Metrics::new();
        m.event("server", "overflow", false);
        m.event("server", "overflow", true);
        m.event("server", "overflow", true);
        let text = m.render(Vec::new(), Vec::new(), None);
        let line = |observed: &str| {
            format!(
                "rpc_governance_events_total{{side=\"server\",kind=\"overflow\",observed=\"{observed}\"}} "
            )
        };
        assert!(text.contains(&format!("{}1\n", line("false"))), "{text}");
        assert!(text.contains(&format!("{}2\n", line("true"))), "{text}");
    }
}
