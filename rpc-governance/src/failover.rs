//! Failover (the LinFu pattern): a failed attempt moves to the next endpoint until every
//! endpoint was tried; the final error names what was tried.

use rpc_core::{GovernanceOptions, RpcError, StatusCode};
use tokio::time::Instant;

use crate::retry::{self, Decision};

/// Decides after a failed attempt, on top of [`retry::decide`]: when the failure was an
/// unreachable endpoint (the request never left), no endpoint is left untried, and none the
/// call tried was `reached` (answered it, if only to refuse it: overloaded, rate-limited), the
/// call gives up at once — every endpoint is down, and trying them again would only wait. With
/// one reached, the retry goes back to it (the balancer puts a reachable endpoint before one
/// that just failed to connect): its overload may have cleared. A refusal
/// that says when to come back (a 429's `retry_after`) is honoured when the next attempt can
/// only go to an endpoint already tried: the pause is at least that long, and the call gives up
/// (with the refusal, which carries `retry_after`) when that does not fit before the deadline.
/// With an untried endpoint left, the next attempt goes there after the usual interval.
///
/// A failure the chosen endpoint caused by lacking what the call needs
/// ([`RpcError::is_unsupported_by_endpoint`]: its server does not stream, or takes fewer
/// attachments than the call carries, and nothing was sent; or it answered 507, having no such
/// entry, and nothing ran) is
/// not retried on that endpoint, which will never serve it, but moves to an untried one at
/// once: during a rolling upgrade some instances stream (or have a new entry) and some do not yet. It counts as an
/// attempt, within `retry_times`. (With nothing untried left after such a detour, the retry
/// layer decides on the failure before it instead, and the balancer leaves the endpoint that
/// cannot serve the call out of its candidates: see [`CallCx::unable`](crate::stack::CallCx::unable).)
pub fn decide(
    err: &RpcError,
    attempt: u32,
    options: &GovernanceOptions,
    deadline: Option<Instant>,
    untried_left: bool,
    reached: bool,
) -> Decision {
    if err.code() == StatusCode::CommunicationError
        && !err.is_maybe_delivered()
        && !untried_left
        && !reached
    {
        return Decision::GiveUp;
    }
    if err.is_unsupported_by_endpoint() {
        return if untried_left && attempt < options.retry_times {
            Decision::Retry {
                after: std::time::Duration::ZERO,
            }
        } else {
            Decision::GiveUp
        };
    }
    match (
        retry::decide(err, attempt, options, deadline),
        err.retry_after(),
    ) {
        (Decision::Retry { after }, Some(wait)) if !untried_left && wait > after => {
            if deadline.is_some_and(|d| Instant::now() + wait >= d) {
                Decision::GiveUp
            } else {
                Decision::Retry { after: wait }
            }
        }
        (decision, _) => decision,
    }
}

/// The error the caller sees: failures that another endpoint might have cured carry every
/// endpoint tried, in order.
pub fn final_error(err: RpcError, tried: Vec<String>) -> RpcError {
    if err.code().is_retryable() || err.is_unsupported_by_endpoint() {
        err.with_tried(tried)
    } else {
        err
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn all_unreachable_gives_up_and_names_them() {
        let o = GovernanceOptions::default();
        let refused = RpcError::new(StatusCode::CommunicationError, "refused");
        assert!(matches!(
            decide(&refused, 0, &o, None, true, false),
            Decision::Retry { .. }
        ));
        assert_eq!(
            decide(&refused, 0, &o, None, false, false),
            Decision::GiveUp
        );
        // ... unless one endpoint tried was reached (it refused the call, overloaded): the
        // call goes back to it.
        assert!(matches!(
            decide(&refused, 0, &o, None, false, true),
            Decision::Retry { .. }
        ));
        // Overflow may clear up: retried on a tried endpoint too.
        let full = RpcError::new(StatusCode::OverflowMaxServerHandle, "full");
        assert!(matches!(
            decide(&full, 0, &o, None, false, false),
            Decision::Retry { .. }
        ));
        let e = final_error(refused, vec!["a:1".into(), "b:1".into()]);
        assert_eq!(e.tried(), ["a:1", "b:1"]);
        let e = final_error(RpcError::business("no"), vec!["a:1".into()]);
        assert!(e.tried().is_empty());
    }

    /// An endpoint that cannot serve the call (its connection does not stream) moves on to an untried endpoint at once, within
    /// `retry_times`, and is never retried on an endpoint already tried.
    #[test]
    fn a_connection_that_does_not_stream_fails_over_to_an_untried_endpoint_only() {
        let o = GovernanceOptions {
            retry_times: 1,
            retry_interval_ms: 50,
            ..GovernanceOptions::default()
        };
        let no_streams = RpcError::new(StatusCode::NotImplemented, "does not stream")
            .unsupported_by_endpoint(true);
        assert_eq!(
            decide(&no_streams, 0, &o, None, true, false),
            Decision::Retry {
                after: Duration::ZERO
            }
        );
        assert_eq!(
            decide(&no_streams, 0, &o, None, false, false),
            Decision::GiveUp
        );
        assert_eq!(
            decide(&no_streams, 1, &o, None, true, false),
            Decision::GiveUp,
            "retry_times spent"
        );
        // A 501 a server answered (or the client's own streams being off) is no endpoint's
        // lack: not failed over.
        let answered = RpcError::new(StatusCode::NotImplemented, "not a streaming method");
        assert_eq!(
            decide(&answered, 0, &o, None, true, false),
            Decision::GiveUp
        );
        let e = final_error(no_streams, vec!["a:1".into(), "b:1".into()]);
        assert_eq!(e.tried(), ["a:1", "b:1"], "the endpoints tried are named");
    }

    #[test]
    fn a_rate_limit_refusal_is_waited_out_only_when_no_other_endpoint_is_left() {
        let o = GovernanceOptions {
            retry_interval_ms: 50,
            ..GovernanceOptions::default()
        };
        let limited = RpcError::new(StatusCode::RateLimited, "over the rate")
            .with_retry_after(Duration::from_millis(300));
        // Another endpoint is left: it is tried after the usual interval.
        assert_eq!(
            decide(&limited, 0, &o, None, true, false),
            Decision::Retry {
                after: Duration::from_millis(50)
            }
        );
        // Only tried endpoints are left: the refusal's time is waited out.
        assert_eq!(
            decide(&limited, 0, &o, None, false, false),
            Decision::Retry {
                after: Duration::from_millis(300)
            }
        );
        // ... unless it does not fit before the deadline.
        let soon = Instant::now() + Duration::from_millis(200);
        assert_eq!(
            decide(&limited, 0, &o, Some(soon), false, false),
            Decision::GiveUp
        );
    }
}
