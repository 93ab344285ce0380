//! Failover (the LinFu pattern): a failed attempt moves to the next endpoint until every
//! endpoint was tried; the final error names what was tried.

use rpc_core::{GovernanceOptions, RpcError, StatusCode};
use tokio::time::Instant;

use crate::retry::{self, Decision};

/// Decides after a failed attempt, on top of [`retry::decide`]: when the failure was an
/// unreachable endpoint (the request never left) and no endpoint is left untried, the call
/// gives up at once — every endpoint is down, and trying them again would only wait.
pub fn decide(
    err: &RpcError,
    attempt: u32,
    options: &GovernanceOptions,
    deadline: Option<Instant>,
    untried_left: bool,
) -> Decision {
    if err.code() == StatusCode::CommunicationError && !err.is_maybe_delivered() && !untried_left {
        return Decision::GiveUp;
    }
    retry::decide(err, attempt, options, deadline)
}

/// The error the caller sees: failures that another endpoint might have cured carry every
/// endpoint tried, in order.
pub fn final_error(err: RpcError, tried: Vec<String>) -> RpcError {
    if err.code().is_retryable() {
        err.with_tried(tried)
    } else {
        err
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_unreachable_gives_up_and_names_them() {
        let o = GovernanceOptions::default();
        let refused = RpcError::new(StatusCode::CommunicationError, "refused");
        assert!(matches!(
            decide(&refused, 0, &o, None, true),
            Decision::Retry { .. }
        ));
        assert_eq!(decide(&refused, 0, &o, None, false), Decision::GiveUp);
        // Overflow may clear up: retried on a tried endpoint too.
        let full = RpcError::new(StatusCode::OverflowMaxServerHandle, "full");
        assert!(matches!(
            decide(&full, 0, &o, None, false),
            Decision::Retry { .. }
        ));
        let e = final_error(refused, vec!["a:1".into(), "b:1".into()]);
        assert_eq!(e.tried(), ["a:1", "b:1"]);
        let e = final_error(RpcError::business("no"), vec!["a:1".into()]);
        assert!(e.tried().is_empty());
    }
}
