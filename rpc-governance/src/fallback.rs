//! Fallback: when another implementation of the service answers for a failed call.
//!
//! The fallback itself (a `Service` holding the arguments) runs in the client or the server;
//! this module decides when it applies and what the caller sees when it fails too.

use rpc_core::{RpcError, StatusCode};

/// Where the fallback runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Registered on a client: answers for failed calls.
    Client,
    /// Registered on a server: answers for its handler's failures.
    Server,
}

/// Whether a fallback answers for `err`.
///
/// Never for the callee's own answers (business, validation, application auth) nor for a
/// refused connection token: those reach the caller unchanged. On the client it runs for every
/// failure of the call (transport, timeout, overflow, open breaker, server error, no endpoint);
/// on the server for the handler's failures (error, panic, deadline), never for the server's
/// own not-found (a downstream's not-found a handler passes on reaches this as the 504 it is
/// sent as, a failure).
pub fn applies(err: &RpcError, side: Side) -> bool {
    let code = err.code();
    if code.is_callee_answer() || code == StatusCode::RpcUnAuthentication {
        return false;
    }
    match side {
        Side::Client => true,
        // Every other failure of the handler, a rate limit or "not implemented" it passes on
        // among them (the server's own 429 is answered before the handler, and never reaches
        // this).
        Side::Server => !matches!(
            code,
            StatusCode::NotFindServiceRoute
                | StatusCode::NotFindLocalServiceEntry
                | StatusCode::NotFindServiceEntry
        ),
    }
}

/// The result of a fallback that ran for `cause`: its answer, or, when it failed as well, an
/// error carrying both causes ([`StatusCode::FallbackExecFail`]). A callee answer from the
/// fallback (a business error) is passed on as it is.
pub fn outcome<T>(
    entry: &str,
    cause: RpcError,
    fallback: Result<T, RpcError>,
) -> Result<T, RpcError> {
    fallback.map_err(|fe| {
        if fe.code().is_callee_answer() {
            return fe;
        }
        RpcError::new(
            StatusCode::FallbackExecFail,
            format!("{entry} failed ({cause}) and so did its fallback ({fe})"),
        )
    })
}

tokio::task_local! {
    static CAUSE: RpcError;
}

/// Why the fallback running in this task runs: the error of the call (or, on a server, of the
/// handler) it answers for. `None` outside a fallback. A fallback can use it to answer
/// differently for an open breaker than for a timeout, or to log the cause.
///
/// ```
/// # use rpc_core::{RpcError, StatusCode};
/// # use rpc_governance::fallback;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let cause = RpcError::new(StatusCode::CircuitOpen, "breaker open");
/// let seen = fallback::with_cause(cause, async { fallback::cause().map(|e| e.code()) }).await;
/// assert_eq!(seen, Some(StatusCode::CircuitOpen));
/// assert!(fallback::cause().is_none());
/// # }
/// ```
pub fn cause() -> Option<RpcError> {
    CAUSE.try_with(RpcError::clone).ok()
}

/// Runs `fallback` with `cause` readable through [`cause`].
pub async fn with_cause<F: std::future::Future>(cause: RpcError, fallback: F) -> F::Output {
    CAUSE.scope(cause, fallback).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applies_to_failures_not_to_answers() {
        for code in [
            StatusCode::CommunicationError,
            StatusCode::Timeout,
            StatusCode::OverflowMaxServerHandle,
            StatusCode::CircuitOpen,
            StatusCode::ServerError,
        ] {
            assert!(applies(&RpcError::new(code, "x"), Side::Client), "{code}");
        }
        assert!(applies(
            &RpcError::new(StatusCode::NotFindServiceRoute, "x"),
            Side::Client
        ));
        assert!(!applies(
            &RpcError::new(StatusCode::NotFindLocalServiceEntry, "x"),
            Side::Server
        ));
        for code in [
            StatusCode::BusinessError,
            StatusCode::ValidateError,
            StatusCode::UnAuthentication,
            StatusCode::RpcUnAuthentication,
        ] {
            for side in [Side::Client, Side::Server] {
                assert!(!applies(&RpcError::new(code, "x"), side), "{code}");
            }
        }
    }

    /// On a server the fallback answers every failure of the handler but the not-found ones,
    /// as documented: a rate limit (429) or "not implemented" (501) the handler passes on
    /// included (before, both were left to the caller, as a breaker leaves them, and the
    /// caller of a middle tier whose downstream limited it got that 429 as this server's own).
    #[test]
    fn a_servers_fallback_answers_a_handlers_rate_limit_or_not_implemented() {
        for code in [StatusCode::RateLimited, StatusCode::NotImplemented] {
            assert!(applies(&RpcError::new(code, "x"), Side::Server), "{code}");
        }
        for code in [
            StatusCode::NotFindServiceRoute,
            StatusCode::NotFindLocalServiceEntry,
            StatusCode::NotFindServiceEntry,
        ] {
            assert!(!applies(&RpcError::new(code, "x"), Side::Server), "{code}");
        }
    }

    #[test]
    fn a_failed_fallback_names_both_causes() {
        let cause = RpcError::new(StatusCode::Timeout, "slow");
        let e = outcome::<()>(
            "a.A.m",
            cause,
            Err(RpcError::new(StatusCode::ServerError, "cache miss")),
        )
        .unwrap_err();
        assert_eq!(e.code(), StatusCode::FallbackExecFail);
        assert!(
            e.message().contains("slow") && e.message().contains("cache miss"),
            "{e}"
        );
        let cause = RpcError::new(StatusCode::Timeout, "slow");
        let e = outcome::<()>("a.A.m", cause, Err(RpcError::business("no"))).unwrap_err();
        assert_eq!(e.code(), StatusCode::BusinessError);
    }
}
