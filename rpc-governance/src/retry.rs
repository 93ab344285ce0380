//! Retry: which failures are tried again, how often and after what pause.

use std::time::Duration;

use rpc_core::{GovernanceOptions, RpcError};
use tokio::time::Instant;

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Try again, preferably on an endpoint not tried yet, after `after`.
    Retry {
        /// Pause before the next attempt.
        after: Duration,
    },
    /// Return the error to the caller.
    GiveUp,
}

/// Decides after failed attempt number `attempt` (0 for the first).
///
/// Retried: overflow and unreachable or broken endpoints ([`StatusCode::is_retryable`]); a
/// failure after which the request may have reached the server only when the entry is
/// idempotent. Never retried: business, validation, auth, not-found, timeout. No retry when the
/// remaining time before `deadline` is shorter than the pause.
///
/// [`StatusCode::is_retryable`]: rpc_core::StatusCode::is_retryable
pub fn decide(
    err: &RpcError,
    attempt: u32,
    options: &GovernanceOptions,
    deadline: Option<Instant>,
) -> Decision {
    if !err.code().is_retryable() || attempt >= options.retry_times {
        return Decision::GiveUp;
    }
    if err.is_maybe_delivered() && !options.idempotent {
        return Decision::GiveUp;
    }
    let after = Duration::from_millis(options.retry_interval_ms);
    if let Some(deadline) = deadline {
        if Instant::now() + after >= deadline {
            return Decision::GiveUp;
        }
    }
    Decision::Retry { after }
}

/// Decides after attempt number `attempt` ran out of its own deadline
/// ([`GovernanceOptions::attempt_timeout_ms`]) while the call's `deadline` had time left.
///
/// The request may have reached the server, so only an idempotent entry tries again (on
/// another endpoint when one exists), within `retry_times` and only when the pause fits before
/// the call's deadline.
pub fn decide_after_attempt_timeout(
    attempt: u32,
    options: &GovernanceOptions,
    deadline: Option<Instant>,
) -> Decision {
    if !options.idempotent || attempt >= options.retry_times {
        return Decision::GiveUp;
    }
    let after = Duration::from_millis(options.retry_interval_ms);
    if deadline.is_some_and(|d| Instant::now() + after >= d) {
        return Decision::GiveUp;
    }
    Decision::Retry { after }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpc_core::StatusCode;

    fn opts() -> GovernanceOptions {
        GovernanceOptions {
            retry_times: 2,
            retry_interval_ms: 50,
            ..Default::default()
        }
    }

    #[test]
    fn retries_only_what_another_endpoint_may_cure() {
        let o = opts();
        for code in [
            StatusCode::OverflowMaxServerHandle,
            StatusCode::CommunicationError,
        ] {
            let e = RpcError::new(code, "x");
            assert_eq!(
                decide(&e, 0, &o, None),
                Decision::Retry {
                    after: Duration::from_millis(50)
                }
            );
            assert_eq!(
                decide(&e, 2, &o, None),
                Decision::GiveUp,
                "retry_times respected"
            );
        }
        for code in [
            StatusCode::BusinessError,
            StatusCode::ValidateError,
            StatusCode::RpcUnAuthentication,
            StatusCode::NotFindServiceEntry,
            StatusCode::NotImplemented,
            StatusCode::Timeout,
        ] {
            assert_eq!(
                decide(&RpcError::new(code, "x"), 0, &o, None),
                Decision::GiveUp,
                "{code}"
            );
        }
    }

    #[test]
    fn maybe_delivered_needs_idempotent() {
        let e = RpcError::new(StatusCode::CommunicationError, "reset").maybe_delivered(true);
        assert_eq!(decide(&e, 0, &opts(), None), Decision::GiveUp);
        let idem = GovernanceOptions {
            idempotent: true,
            ..opts()
        };
        assert!(matches!(decide(&e, 0, &idem, None), Decision::Retry { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn no_retry_past_the_deadline() {
        let e = RpcError::new(StatusCode::OverflowMaxServerHandle, "full");
        let soon = Instant::now() + Duration::from_millis(30);
        assert_eq!(decide(&e, 0, &opts(), Some(soon)), Decision::GiveUp);
        let later = Instant::now() + Duration::from_millis(80);
        assert!(matches!(
            decide(&e, 0, &opts(), Some(later)),
            Decision::Retry { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_timeout_is_retried_only_for_idempotent_entries_within_the_call() {
        let later = Some(Instant::now() + Duration::from_millis(500));
        assert_eq!(
            decide_after_attempt_timeout(0, &opts(), later),
            Decision::GiveUp,
            "may have run: not repeated unless idempotent"
        );
        let idem = GovernanceOptions {
            idempotent: true,
            ..opts()
        };
        assert!(matches!(
            decide_after_attempt_timeout(0, &idem, later),
            Decision::Retry { .. }
        ));
        assert_eq!(
            decide_after_attempt_timeout(2, &idem, later),
            Decision::GiveUp
        );
        let soon = Some(Instant::now() + Duration::from_millis(30));
        assert_eq!(
            decide_after_attempt_timeout(0, &idem, soon),
            Decision::GiveUp
        );
    }
}
