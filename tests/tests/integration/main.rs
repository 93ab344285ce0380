//! The cross-crate integration, fault and conformance tests, one module per subject, in one test
//! binary: linked once instead of once per subject, which took about a third of a cold test
//! build's CPU time. Each module says what it covers in its own opening comment. Two subjects
//! stay binaries of their own because they set process-wide state: `misconfig` (a global tracing
//! subscriber) and `otlp` (the `OTEL_*` environment and OpenTelemetry's global providers).
//!
//! Run one subject with `cargo test -p tests --test integration <module>::`.

#[path = "../common/mod.rs"]
mod common;
// Harnesses of real servers, shared by the modules that start one (each keeps a shared instance).
#[path = "../common/etcd.rs"]
mod etcd_harness;
#[path = "../common/registry_watch.rs"]
mod registry_watch;
#[path = "../common/zookeeper.rs"]
mod zookeeper_harness;

mod adaptive;
mod auth;
mod backpressure;
mod blocking_handler;
mod breaker;
mod call_tasks;
mod cancelled;
mod cap;
mod chain_stop;
mod chaos;
mod client_drop;
mod client_middleware;
mod compression;
mod deadline;
mod endpoint_health;
mod ergonomics;
mod etcd;
mod failover;
mod fuzz_regressions;
mod gateway;
mod generic;
mod governance;
mod governance_env;
mod hedge;
mod least_loaded;
mod limits;
mod methods;
mod observability;
mod observe;
mod outlier;
mod overload;
mod protocol;
mod published_api;
mod rate_limit;
mod read_budget;
mod reconnect;
mod registry_suite;
mod rolling;
mod routing;
mod rules;
mod server_middleware;
mod shunting;
mod streams;
mod streams_flow;
mod streams_governance;
mod throttle;
mod tls;
mod typed_errors;
mod unix;
mod wire_faults;
mod zookeeper;
