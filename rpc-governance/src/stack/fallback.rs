//! The fallback as a layer: when a call fails (transport, timeout, overflow, open breaker,
//! server error, no endpoint), another implementation of the service, registered on the client,
//! answers with the original arguments. The callee's own answers (business, validation, auth)
//! pass through unchanged.
//!
//! When it applies and what a failed fallback says is [`crate::fallback`]; this layer holds the
//! arguments, runs the fallback with its cause readable through [`crate::fallback::cause`], and
//! records that cause in the context for the call's span and metrics.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use rpc_core::{Codec, RpcError};

use super::{CallCx, Service};
use crate::events::EventKind;
use crate::fallback::{self, Side};
use crate::timeout;

/// Fallbacks registered on a client, by service id.
pub type Fallbacks = HashMap<&'static str, Arc<dyn rpc_core::Service>, ahash::RandomState>;

/// Runs a registered fallback when `S` fails.
pub struct FallbackLayer<'f, S> {
    fallbacks: &'f Fallbacks,
    codec: Codec,
    inner: S,
}

impl<'f, S> FallbackLayer<'f, S> {
    /// The layer over `inner`, with the `fallbacks` of a client whose arguments are encoded by
    /// `codec`.
    pub fn new(fallbacks: &'f Fallbacks, codec: Codec, inner: S) -> Self {
        FallbackLayer {
            fallbacks,
            codec,
            inner,
        }
    }
}

impl<S: Service> Service for FallbackLayer<'_, S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let Some(fallback) = self.fallbacks.get(cx.method().service_id) else {
            return self.inner.call(cx, req).await;
        };
        let e = match self.inner.call(cx, req.clone()).await {
            Err(e) if fallback::applies(&e, Side::Client) => e,
            other => return other,
        };
        // A fallback without this entry (one older than the entry, an `invoke_json` entry it
        // does not know) does not run, and no `fallback` is said of the call.
        let Some(index) = fallback
            .methods()
            .iter()
            .position(|m| m.entry_id == cx.method().entry_id)
        else {
            return Err(e);
        };
        let (endpoint, attempt) = cx.failure(&e);
        // Inside a handler whose caller's deadline has passed, nobody would receive the
        // fallback's answer: it does not start (and does not act).
        if timeout::inherited_passed() {
            cx.emit(
                EventKind::FallbackSkipped,
                endpoint.as_deref(),
                attempt,
                Some(e.to_string()),
            );
            return Err(timeout::fallback_skipped(cx.entry_id(), &e));
        }
        // On the call span: the original error, the endpoint of the last failed attempt and
        // that attempt's number.
        cx.emit(
            EventKind::Fallback,
            endpoint.as_deref(),
            attempt,
            Some(e.to_string()),
        );
        cx.fallback_cause = Some(e.clone());
        let answer = fallback::with_cause(e.clone(), fallback.call(index, req, self.codec)).await;
        fallback::outcome(cx.entry_id(), e, answer)
    }
}
