//! Adaptive throttling as a layer: each attempt is counted as a request of its entry, dropped
//! locally with the SRE rule's probability ([`crate::throttle`]), and, when sent, counted as
//! accepted unless the server refused it for overload.
//!
//! It sits under the retry layer so that retries count (and are dropped) like first attempts:
//! retries are what keeps an overloaded server overloaded. A dropped attempt fails the call at
//! once (the retry layer does not retry it, the breaker does not count it, endpoint health does
//! not hold it against anyone): trying again right away would only be dropped again.
//!
//! An attempt that went nowhere (a detour: its endpoint cannot serve the call, so nothing was
//! sent) is taken back out of the counts: it asked no server anything. It was drawn for all
//! the same, so a call that detours draws twice.
//!
//! In observe mode (`throttle_observe`) an attempt the rule would drop is reported (event
//! `throttled`, `observed`) and sent all the same.

use std::time::Duration;

use bytes::Bytes;
use rpc_core::{RpcError, StatusCode};
use tokio::time::Instant;

use super::unsent::UnsentRequest;
use super::{CallCx, Service};
use crate::events::EventKind;
use crate::throttle::Throttle;

/// The trailing window the counts are kept over.
const WINDOW: Duration = Duration::from_secs(10);

/// Drops attempts of `S` while its entry's server keeps refusing them (`throttle_k_percent`).
#[derive(Debug, Clone)]
pub struct ThrottleLayer<S> {
    inner: S,
}

impl<S> ThrottleLayer<S> {
    /// The layer over `inner`.
    pub fn new(inner: S) -> Self {
        ThrottleLayer { inner }
    }
}

/// Whether an attempt's result counts as the server accepting it: any answer but a refusal
/// for overload (515, 429) or no answer at all (a broken connection, a deadline passed).
fn accepted(result: &Result<Bytes, RpcError>) -> bool {
    match result {
        Ok(_) => true,
        Err(e) => {
            // By number: a rate-limit refusal (429) may be a named status or `Other(429)`.
            !matches!(e.code().as_u32(), 515 | 429)
                && !matches!(
                    e.code(),
                    StatusCode::CommunicationError | StatusCode::Timeout
                )
        }
    }
}

impl<S: Service> Service for ThrottleLayer<S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let k_percent = cx.options.throttle_k_percent;
        if k_percent == 0 {
            return self.inner.call(cx, req).await;
        }
        let policy = cx.policy.clone();
        let throttle = policy
            .throttle
            .get_or_init(|| Throttle::new(f64::from(k_percent) / 100.0, WINDOW));
        let k = f64::from(k_percent) / 100.0;
        let now = Instant::now();
        let admitted = throttle.admit_with_k_at(now, throttle.draw(), k);
        if !admitted && cx.options.throttle_observe {
            let p = throttle.drop_probability_with_k_at(now, k);
            cx.emit_observed(
                EventKind::Throttled,
                cx.endpoint(),
                cx.attempt,
                Some(format!(
                    "{}: would be dropped by this client (probability {:.0} %, \
                     throttle_k_percent = {k_percent}); sent, throttle_observe is on",
                    cx.entry_id(),
                    p * 100.0
                )),
            );
        } else if !admitted {
            cx.throttled = true;
            let p = throttle.drop_probability_with_k_at(now, k);
            let err = RpcError::new(
                StatusCode::OverflowMaxRequest,
                format!(
                    "{}: dropped by this client, not sent: most recent attempts were not \
                     accepted (refused for overload, 515 or 429, timed out, or not connected), \
                     so calls are dropped with probability {:.0} % \
                     (throttle_k_percent = {k_percent}); retry later, and check the server's \
                     health and capacity",
                    cx.entry_id(),
                    p * 100.0
                ),
            );
            cx.emit(
                EventKind::Throttled,
                cx.endpoint(),
                cx.attempt,
                Some(err.to_string()),
            );
            return Err(err);
        }
        // Withdrawn unless the attempt leaves the client, however it ends (see `unsent`).
        cx.unsent_request = Some(UnsentRequest::new(policy.clone(), now));
        let result = self.inner.call(cx, req).await;
        // Still held: a per-attempt layer answered the attempt, and nothing reached a server;
        // dropped, the request is withdrawn.
        if cx.unsent_request.take().is_some() {
            return result;
        }
        match &result {
            // A detour (an endpoint that cannot serve the call; nothing sent) asked no server
            // anything: neither a request nor an accept.
            Err(e) if e.is_unsupported_by_endpoint() => {
                throttle.withdraw_request_at(now, Instant::now());
            }
            result if accepted(result) => throttle.accepted_at(Instant::now()),
            _ => {}
        }
        result
    }

    fn enforces_attempt_deadline(&self) -> bool {
        self.inner.enforces_attempt_deadline()
    }
}
