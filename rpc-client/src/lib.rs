//! # rpc-client
//!
//! What generated proxies call: [`Client::invoke`] resolves a service's live endpoints from a
//! registry watch, picks one by the entry's shunt strategy ([`shunt`]), sends the call over a
//! pooled connection and applies the entry's governance: the whole call under its deadline,
//! retries on overflow or an unreachable endpoint on another endpoint, local endpoint health.
//!
//! Observability: every call runs in an `rpc.client` span with one `rpc.client.attempt` child
//! per attempt (OpenTelemetry RPC semantic-convention attributes; governance events are
//! `tracing` events on them). Calls carry the current [`RpcContext`](rpc_core::RpcContext)'s
//! attachments. With feature `otel` they also carry the attempt span's W3C trace context
//! (`traceparent`/`tracestate`, from `tracing-opentelemetry`), and the client records
//! OpenTelemetry metrics ([`ClientBuilder::meter`]).
//!
//! The client never writes to the registry: its view of an endpoint's health stays in this
//! process and expires; [`Client::endpoints`] shows it and [`Client::readmit`] overrides it.
//!
//! ```no_run
//! use rpc_client::Client;
//! use rpc_registry::StaticRegistry;
//!
//! let client = Client::builder()
//!     .registry(StaticRegistry::from_list("127.0.0.1:9001,127.0.0.1:9002").unwrap())
//!     .token("s3cret")
//!     .build();
//! # let _ = client;
//! ```
#![warn(missing_docs)]

mod answered_by;
pub mod balance;
mod client;
mod generic;
mod rules;
mod streams;
pub use balance::ring as shunt;
pub mod status;
mod telemetry;

pub use answered_by::answered_by;
pub use balance::ring::RingKey;
pub use client::{Client, ClientBuilder, MAX_CONNECTIONS_PER_ENDPOINT};
pub use generic::{error_body, json_kind, JsonAnswer, MAX_UNPUBLISHED_ENTRIES};
pub use status::{EndpointState, EndpointStatus};
