//! What a client knows about each endpoint it calls: [`Client::endpoints`] and
//! [`Client::readmit`].
//!
//! Endpoint health is local to the client and changes on its own (marks expire, a removed
//! endpoint is probed in the background and re-admitted when it answers a handshake), so an
//! operator needs to see it, and to override it when they know better.
//!
//! [`Client::endpoints`]: crate::Client::endpoints
//! [`Client::readmit`]: crate::Client::readmit

use std::time::Duration;

pub use rpc_governance::health::EndpointState;

/// Pause before the first background probe of a removed endpoint; it doubles after each failed
/// probe, up to [`MAX_PROBE_INTERVAL`].
pub const FIRST_PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// The longest pause between background probes of a removed endpoint.
pub const MAX_PROBE_INTERVAL: Duration = Duration::from_secs(30);

/// One endpoint as this client sees it, from [`Client::endpoints`](crate::Client::endpoints).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointStatus {
    /// `host:port`.
    pub address: String,
    /// The services this client reaches there (those it has called so far).
    pub services: Vec<String>,
    /// Healthy, unhealthy until a mark expires, or removed.
    pub state: EndpointState,
    /// Failures held against it in a row (0 after a success).
    pub consecutive_failures: u32,
    /// The last failure held against it, while it has failures in a row.
    pub last_failure: Option<String>,
}
