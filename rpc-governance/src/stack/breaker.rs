//! The circuit breaker as a layer: an entry that keeps failing is failed fast for a while
//! instead of piling more calls onto a service that cannot answer them.
//!
//! The breaker's state and rules live in [`crate::breaker`]; this layer takes a permit before
//! the call and records the call's outcome after it. A failure the retry layer held against one
//! endpoint while others remain usable says something about that endpoint, not the service: it
//! is not counted (endpoint health ejects the endpoint instead).
//!
//! An entry an operator isolated stays refused even with its breaker turned off
//! (`enable_circuit_breaker = false`, as a rule or an attribute may say).
//!
//! In observe mode (`breaker_observe`) the breaker counts and changes state as usual, and its
//! events say `observed`, but a call it would fail fast goes on (uncounted, as it would not have
//! been sent): an operator can watch what a new threshold would do on live traffic first.

use bytes::Bytes;
use rpc_core::RpcError;

use super::{CallCx, Service};
use crate::breaker::{Outcome, Transition};
use crate::events::EventKind;

/// Wraps `S` in the entry's circuit breaker (when `enable_circuit_breaker`).
#[derive(Debug, Clone)]
pub struct CircuitBreakerLayer<S> {
    inner: S,
}

impl<S> CircuitBreakerLayer<S> {
    /// The layer over `inner`.
    pub fn new(inner: S) -> Self {
        CircuitBreakerLayer { inner }
    }
}

fn event(cx: &CallCx<'_>, t: Transition, cause: Option<&RpcError>) {
    let kind = match t {
        Transition::Break => EventKind::Break,
        Transition::HalfOpen => EventKind::HalfOpen,
        Transition::Reset => EventKind::Reset,
    };
    let cause = cause.map(|c| c.to_string());
    if cx.options.breaker_observe {
        cx.emit_observed(kind, None, 0, cause);
    } else {
        cx.emit(kind, None, 0, cause);
    }
}

impl<S: Service> Service for CircuitBreakerLayer<S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        if !cx.options.enable_circuit_breaker {
            // Turned off, it counts nothing; but an operator's isolation holds in any mode.
            cx.policy.breaker().check_isolation(&cx.policy.entry)?;
            return self.inner.call(cx, req).await;
        }
        let policy = cx.policy.clone();
        let (permit, t) = match policy.breaker().try_acquire(&policy.entry, &cx.options) {
            Ok(admitted) => admitted,
            // Observe mode: the call the breaker would fail fast goes on, uncounted.
            Err(_) if cx.options.breaker_observe && !policy.breaker().is_isolated() => {
                return self.inner.call(cx, req).await;
            }
            Err(e) => return Err(e),
        };
        if let Some(t) = t {
            event(cx, t, None);
        }
        let result = self.inner.call(cx, req).await;
        // A call that ran out of its caller's time (see `CallCx::out_of_callers_time`), one
        // dropped by adaptive throttling, or one that never had an endpoint to go to
        // (none known, or the deadline passed while finding them), or only endpoints that
        // cannot serve it (their servers do not stream; nothing sent), says nothing new about
        // the remote side: a local "no endpoint" must not close a half-open breaker.
        let local = cx.endpoint_held
            || cx.out_of_callers_time
            || cx.throttled
            || cx.endpoint.is_none()
            || result
                .as_ref()
                .is_err_and(RpcError::is_unsupported_by_endpoint);
        // A per-attempt layer's own answer, success or failure, asked no server anything.
        let outcome = if cx.answered_by_layer || (local && result.is_err()) {
            Outcome::Ignored
        } else {
            Outcome::of(&result)
        };
        if let Some(t) =
            policy
                .breaker()
                .record_outcome(permit, outcome, &cx.options, result.as_ref().err())
        {
            event(cx, t, result.as_ref().err());
        }
        result
    }
}
