//! The call context: user attachments that travel with every call a task makes.
//!
//! A client copies the attachments of the current [`RpcContext`] into each outgoing call
//! (`RemoteInvokeMessage.attachments`); a server runs every handler inside a context holding the
//! attachments it received, so they follow a request from service to service (A → B → C)
//! without the handlers passing them along.
//!
//! The W3C trace context (`traceparent`, `tracestate`) travels in the same map but is not a user
//! attachment: the client writes it for each attempt and the server takes it out before the
//! handler's context is set (see [`TRACE_CONTEXT_KEYS`]).

use std::collections::BTreeMap;
use std::future::Future;

tokio::task_local! {
    static CONTEXT: BTreeMap<String, String>;
}

/// Attachment keys reserved for the W3C trace context; they are never user attachments.
pub const TRACE_CONTEXT_KEYS: [&str; 2] = ["traceparent", "tracestate"];

/// Attachment key of the short call id a client gives each call it logs (8 hex digits), so
/// that the client's and the server's log lines of one call carry the same id. Sent only when
/// the client's call span is enabled; never a user attachment (the server takes it out).
pub const CALL_ID_KEY: &str = "rpc-call-id";

/// Attachment key of a call's retry depth: how many callers up the chain retry the call on
/// failure (`1`: the caller retries it). A client sets it on every attempt of a call it may
/// retry; the server hands it to the handler with the other attachments, so the calls the
/// handler makes carry it too, and (under `retry_chain_stop`, the default) do not retry again:
/// the outermost caller that retries owns the retries of the whole chain, and a failing leaf
/// three hops down sees each top-level call about once instead of `(1 + retries)³` times.
pub const RETRY_DEPTH_KEY: &str = "rpc-retry-depth";

/// The task-local call context. Every function is associated: the context belongs to the task
/// running the future passed to [`scope`](Self::scope).
///
/// ```
/// use std::collections::BTreeMap;
/// use rpc_core::RpcContext;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let attachments = BTreeMap::from([("tenant".to_string(), "acme".to_string())]);
/// RpcContext::scope(attachments, async {
///     // Calls made here carry `tenant=acme`.
///     assert_eq!(RpcContext::get("tenant").as_deref(), Some("acme"));
/// })
/// .await;
/// assert!(RpcContext::current_attachments().is_empty());
/// # }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RpcContext;

impl RpcContext {
    /// Runs `fut` with `attachments` as its call context; they replace (not extend) the
    /// surrounding context while `fut` runs. Use [`with_attachment`](Self::with_attachment) to
    /// add to it.
    pub fn scope<F: Future>(
        attachments: BTreeMap<String, String>,
        fut: F,
    ) -> impl Future<Output = F::Output> {
        CONTEXT.scope(attachments, fut)
    }

    /// Runs `f` with `attachments` as the call context: the synchronous form of
    /// [`scope`](Self::scope), for polling a future once in place.
    pub fn sync_scope<R>(attachments: BTreeMap<String, String>, f: impl FnOnce() -> R) -> R {
        CONTEXT.sync_scope(attachments, f)
    }

    /// Runs `fut` with the current attachments plus `key = value`.
    pub fn with_attachment<F: Future>(
        key: impl Into<String>,
        value: impl Into<String>,
        fut: F,
    ) -> impl Future<Output = F::Output> {
        let mut attachments = Self::current_attachments();
        attachments.insert(key.into(), value.into());
        Self::scope(attachments, fut)
    }

    /// A copy of the current attachments (empty outside any scope; no allocation then).
    pub fn current_attachments() -> BTreeMap<String, String> {
        Self::with_current(Clone::clone)
    }

    /// One attachment of the current context.
    pub fn get(key: &str) -> Option<String> {
        Self::with_current(|a| a.get(key).cloned())
    }

    /// The retry depth of the call being served ([`RETRY_DEPTH_KEY`]; 0 outside a handler, or
    /// when no caller up the chain retries, or when the attachment is not a number).
    pub fn retry_depth() -> u32 {
        Self::with_current(|a| {
            a.get(RETRY_DEPTH_KEY)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        })
    }

    /// Calls `f` with the current attachments (an empty map outside any scope), without
    /// copying them.
    pub fn with_current<R>(f: impl FnOnce(&BTreeMap<String, String>) -> R) -> R {
        let mut f = Some(f);
        match CONTEXT.try_with(|a| (f.take().expect("called once"))(a)) {
            Ok(r) => r,
            Err(_) => (f.take().expect("not called"))(&BTreeMap::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll_now<F: Future>(fut: F) -> F::Output {
        let mut fut = std::pin::pin!(fut);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(r) => r,
            std::task::Poll::Pending => panic!("pending"),
        }
    }

    #[test]
    fn scopes_nest_and_end() {
        assert!(RpcContext::current_attachments().is_empty());
        let outer = BTreeMap::from([("a".to_string(), "1".to_string())]);
        poll_now(RpcContext::scope(outer, async {
            assert_eq!(RpcContext::get("a").as_deref(), Some("1"));
            poll_now(RpcContext::with_attachment("b", "2", async {
                let all = RpcContext::current_attachments();
                assert_eq!(all.len(), 2);
                assert_eq!(all["b"], "2");
            }));
            assert_eq!(RpcContext::get("b"), None);
        }));
        assert_eq!(RpcContext::get("a"), None);
    }
}
