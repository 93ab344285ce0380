//! The whole call's deadline as a layer: retries and pauses included, so a caller waits at most
//! `timeout_ms` (or what is left of the deadline it inherited from the call it serves).
//!
//! The deadline itself is computed in [`crate::timeout`]; the retry layer enforces it while it
//! finds the endpoints and on every attempt. This layer sets it in the context and turns a timeout into the error that names the
//! budget.

use bytes::Bytes;
use rpc_core::{RpcError, StatusCode};
use tokio::time::Instant;

use super::{CallCx, Service};
use crate::events::EventKind;
use crate::timeout;

/// Puts `S` under the call's deadline.
#[derive(Debug, Clone)]
pub struct TimeoutLayer<S> {
    inner: S,
}

impl<S> TimeoutLayer<S> {
    /// The layer over `inner`.
    pub fn new(inner: S) -> Self {
        TimeoutLayer { inner }
    }
}

impl<S: Service> Service for TimeoutLayer<S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        // One clock reading serves the deadline, the budget and the first attempt's timeout
        // (or the call's own start, when work before the stack counts against its deadline).
        let started = cx.started.unwrap_or_else(Instant::now);
        let deadline = timeout::deadline_from(started, &cx.options);
        cx.started = Some(started);
        cx.deadline = deadline;
        cx.deadline_is_callers =
            deadline.is_some_and(|d| timeout::is_callers(started, d, &cx.options));
        let result = self
            .inner
            .call(cx, req)
            .await
            .map_err(|e| match (e.code(), deadline) {
                // The call's deadline passed: said as the call's own timeout, with what the
                // deadline cut (no endpoint known yet, the call not sent, no answer from a
                // server) after it. A callee's typed error carrying a timeout keeps its value,
                // and a 519 a server answered before the deadline (its own deadline, down the
                // chain) keeps its message.
                (StatusCode::Timeout, Some(d))
                    if e.payload().is_none() && !cx.attempt_timed_out && Instant::now() >= d =>
                {
                    let budget = timeout::timeout_error_for(cx.entry_id(), started, d, &cx.options);
                    // (What the error says of the call is kept: maybe delivered, never sent.)
                    let message = format!("{} (when it passed: {})", budget.message(), e.message());
                    e.with_message(message)
                }
                _ => e,
            });
        if let Err(e) = &result {
            let passed = deadline.is_some_and(|d| Instant::now() >= d);
            if e.code() == StatusCode::Timeout && !cx.attempt_timed_out && passed {
                // The attempt the deadline cut (or, if it passed between attempts, the one
                // before), with its endpoint.
                cx.emit(
                    EventKind::Timeout,
                    cx.last_failed.as_deref(),
                    cx.failed_attempt.unwrap_or(cx.attempt),
                    Some(e.to_string()),
                );
            }
        }
        result
    }
}
