//! Status codes carried in `RemoteResultMessage.status_code`.

use std::fmt;

/// Outcome of a call. The numbers are Silky's, so that a code means the same in both ecosystems.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StatusCode {
    /// 200: the call succeeded.
    Success,
    /// 500: the framework itself failed (bad frame, unsupported protocol version, ...).
    FrameworkError,
    /// 404: no route: the service is not known to the registry.
    NotFindServiceRoute,
    /// 504: the service is known but has no usable endpoint.
    NotFindServiceRouteAddress,
    /// 506: the connection to the endpoint failed or broke.
    CommunicationError,
    /// 507: the server has no local entry with that id.
    NotFindLocalServiceEntry,
    /// 509: the fallback ran and failed too.
    FallbackExecFail,
    /// 513: the entry does not exist.
    NotFindServiceEntry,
    /// 514: over the client's concurrency limit for the entry.
    OverflowMaxRequest,
    /// 515: over the server's concurrency cap; nothing ran, retry elsewhere.
    OverflowMaxServerHandle,
    /// 517: authentication of the connection failed (bad token).
    RpcUnAuthentication,
    /// 519: the deadline passed before the call finished.
    Timeout,
    /// 520: the handler failed or panicked on the server.
    ServerError,
    /// 1000: the service answered with a business error (the callee's answer, not a failure).
    BusinessError,
    /// 1001: the service rejected the arguments.
    ValidateError,
    /// 401: the caller is not authenticated (application level).
    UnAuthentication,
    /// 403: the caller is not authorised (application level).
    UnAuthorization,
    /// 501: the method is declared but not implemented by the server.
    NotImplemented,
    /// 522: the circuit breaker of the entry is open; the call was not sent. (Not one of
    /// Silky's numbers: Silky has none for this; 503 means a route parse error there.)
    CircuitOpen,
    /// 429: over the server's rate limit for the entry (all callers, or this caller's quota);
    /// nothing ran. The answer's `retry_after` says when a token is there; another endpoint
    /// may take the call now. Says nothing about the server's health, so no breaker counts it.
    RateLimited,
    /// Any other number received from a peer, kept as it was.
    Other(u32),
}

impl StatusCode {
    /// The number sent on the wire.
    pub const fn as_u32(self) -> u32 {
        match self {
            StatusCode::Success => 200,
            StatusCode::FrameworkError => 500,
            StatusCode::NotFindServiceRoute => 404,
            StatusCode::NotFindServiceRouteAddress => 504,
            StatusCode::CommunicationError => 506,
            StatusCode::NotFindLocalServiceEntry => 507,
            StatusCode::FallbackExecFail => 509,
            StatusCode::NotFindServiceEntry => 513,
            StatusCode::OverflowMaxRequest => 514,
            StatusCode::OverflowMaxServerHandle => 515,
            StatusCode::RpcUnAuthentication => 517,
            StatusCode::Timeout => 519,
            StatusCode::ServerError => 520,
            StatusCode::BusinessError => 1000,
            StatusCode::ValidateError => 1001,
            StatusCode::UnAuthentication => 401,
            StatusCode::UnAuthorization => 403,
            StatusCode::NotImplemented => 501,
            StatusCode::CircuitOpen => 522,
            StatusCode::RateLimited => 429,
            StatusCode::Other(n) => n,
        }
    }

    /// The `rpc.outcome` a call that ended with this status is counted under: `success`,
    /// `timeout` for 519 (however the deadline ended it: the call dropped, or answered so by a
    /// timeout layer or its server), `error` for any other status. (Calls that did not end
    /// with a status of their own have outcomes of their own: `fallback`, `cancelled`,
    /// `superseded`.)
    pub const fn outcome(self) -> &'static str {
        match self {
            StatusCode::Success => "success",
            StatusCode::Timeout => "timeout",
            _ => "error",
        }
    }

    /// The number metrics label this status with: its own for every status the framework
    /// defines, and 0 for any other ([`Other`](Self::Other)). A peer can send any number, and
    /// a label taking each one as it came would grow a series per number it made up.
    pub const fn metric_code(self) -> u32 {
        match self {
            StatusCode::Other(_) => 0,
            known => known.as_u32(),
        }
    }

    /// The status for a number received from the wire.
    pub const fn from_u32(n: u32) -> Self {
        match n {
            200 => StatusCode::Success,
            500 => StatusCode::FrameworkError,
            404 => StatusCode::NotFindServiceRoute,
            504 => StatusCode::NotFindServiceRouteAddress,
            506 => StatusCode::CommunicationError,
            507 => StatusCode::NotFindLocalServiceEntry,
            509 => StatusCode::FallbackExecFail,
            513 => StatusCode::NotFindServiceEntry,
            514 => StatusCode::OverflowMaxRequest,
            515 => StatusCode::OverflowMaxServerHandle,
            517 => StatusCode::RpcUnAuthentication,
            519 => StatusCode::Timeout,
            520 => StatusCode::ServerError,
            1000 => StatusCode::BusinessError,
            1001 => StatusCode::ValidateError,
            401 => StatusCode::UnAuthentication,
            403 => StatusCode::UnAuthorization,
            501 => StatusCode::NotImplemented,
            522 => StatusCode::CircuitOpen,
            429 => StatusCode::RateLimited,
            n => StatusCode::Other(n),
        }
    }

    /// Overflow on either side: nothing ran, another endpoint may take the call.
    pub const fn is_overflow(self) -> bool {
        matches!(
            self,
            StatusCode::OverflowMaxRequest | StatusCode::OverflowMaxServerHandle
        )
    }

    /// A failure that a retry on another endpoint may cure: overflow, a rate limit, or an
    /// endpoint that could not be reached or broke. Never business, validation, auth, not-found or not-implemented.
    pub const fn is_retryable(self) -> bool {
        matches!(
            self,
            StatusCode::OverflowMaxRequest
                | StatusCode::OverflowMaxServerHandle
                | StatusCode::RateLimited
                | StatusCode::CommunicationError
                | StatusCode::NotFindServiceRouteAddress
        )
    }

    /// The callee's own answer rather than a failure of the call: business and validation errors
    /// and application-level auth errors. These reach the caller unchanged, never trigger a
    /// fallback and never count toward a circuit breaker.
    pub const fn is_callee_answer(self) -> bool {
        matches!(
            self,
            StatusCode::BusinessError
                | StatusCode::ValidateError
                | StatusCode::UnAuthentication
                | StatusCode::UnAuthorization
        )
    }

    /// Errors that say nothing about the remote side's health (Silky's exemptions): the callee's
    /// answers plus not-found, not-implemented, connection authentication and a rate limit
    /// (the server refused by policy, not because it failed).
    pub const fn is_breaker_exempt(self) -> bool {
        self.is_callee_answer()
            || matches!(
                self,
                StatusCode::NotFindServiceRoute
                    | StatusCode::NotFindLocalServiceEntry
                    | StatusCode::NotFindServiceEntry
                    | StatusCode::NotImplemented
                    | StatusCode::RpcUnAuthentication
                    | StatusCode::RateLimited
                    | StatusCode::Success
            )
    }
}

impl fmt::Display for StatusCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            StatusCode::Success => "success",
            StatusCode::FrameworkError => "framework error",
            StatusCode::NotFindServiceRoute => "service route not found",
            StatusCode::NotFindServiceRouteAddress => "no usable endpoint",
            StatusCode::CommunicationError => "communication error",
            StatusCode::NotFindLocalServiceEntry => "local service entry not found",
            StatusCode::FallbackExecFail => "fallback failed",
            StatusCode::NotFindServiceEntry => "service entry not found",
            StatusCode::OverflowMaxRequest => "client concurrency limit exceeded",
            StatusCode::OverflowMaxServerHandle => "server concurrency cap exceeded",
            StatusCode::RpcUnAuthentication => "rpc authentication failed",
            StatusCode::Timeout => "timeout",
            StatusCode::ServerError => "server error",
            StatusCode::BusinessError => "business error",
            StatusCode::ValidateError => "validation error",
            StatusCode::UnAuthentication => "unauthenticated",
            StatusCode::UnAuthorization => "unauthorized",
            StatusCode::NotImplemented => "not implemented",
            StatusCode::CircuitOpen => "circuit open",
            StatusCode::RateLimited => "rate limited",
            StatusCode::Other(_) => "status",
        };
        write!(f, "{name} ({})", self.as_u32())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_label_every_undefined_status_alike() {
        assert_eq!(StatusCode::Timeout.metric_code(), 519);
        assert_eq!(StatusCode::from_u32(1000).metric_code(), 1000);
        assert_eq!(StatusCode::Other(100_001).metric_code(), 0);
        assert_eq!(StatusCode::Other(7).metric_code(), 0);
    }

    #[test]
    fn numbers_round_trip() {
        for n in [
            200, 500, 404, 504, 506, 507, 509, 513, 514, 515, 517, 519, 520, 1000, 1001, 401, 403,
            501, 522, 429, 42,
        ] {
            assert_eq!(StatusCode::from_u32(n).as_u32(), n);
        }
        assert_eq!(StatusCode::from_u32(42), StatusCode::Other(42));
    }

    #[test]
    fn classification() {
        assert!(StatusCode::OverflowMaxServerHandle.is_retryable());
        assert!(StatusCode::CommunicationError.is_retryable());
        assert!(!StatusCode::BusinessError.is_retryable());
        assert!(!StatusCode::Timeout.is_retryable());
        assert!(StatusCode::BusinessError.is_breaker_exempt());
        assert!(StatusCode::NotFindServiceEntry.is_breaker_exempt());
        assert!(!StatusCode::ServerError.is_breaker_exempt());
        assert!(!StatusCode::Timeout.is_breaker_exempt());
        // A rate limit: retried elsewhere, never held against the server, not the callee's
        // own answer (a server fallback does not replace it).
        let limited = StatusCode::from_u32(429);
        assert_eq!(limited, StatusCode::RateLimited);
        assert!(limited.is_retryable());
        assert!(limited.is_breaker_exempt());
        assert!(!limited.is_callee_answer());
        assert_eq!(limited.to_string(), "rate limited (429)");
    }
}
