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
use std::sync::Arc;

tokio::task_local! {
    static CONTEXT: Current;
}

/// What a scope holds: the attachments, and the retry depth a server received beside them.
#[derive(Debug)]
struct Current {
    /// Shared, so that a stream's items can each be polled in the context of its call.
    attachments: Arc<BTreeMap<String, String>>,
    /// [`RETRY_DEPTH_KEY`] as a server received it (0: look in `attachments`). A field rather
    /// than a map entry: nearly every call carries it, and an entry costs three allocations.
    retry_depth: u32,
}

/// Attachment keys reserved for the W3C trace context; they are never user attachments.
pub const TRACE_CONTEXT_KEYS: [&str; 2] = ["traceparent", "tracestate"];

/// Attachment key of the short call id a client gives each call it logs (8 hex digits), so
/// that the client's and the server's log lines of one call carry the same id. Sent only when
/// the client's call span is enabled; never a user attachment (the server takes it out).
pub const CALL_ID_KEY: &str = "rpc-call-id";

/// Attachment key of a call's retry depth: how many callers up the chain retry the call on
/// failure (`1`: the caller retries it). A client sets it on every attempt of a call it may
/// retry; the server hands it to the handler's context ([`RpcContext::retry_depth`], and
/// [`RpcContext::get`] and [`RpcContext::current_attachments`] with the other attachments), so
/// the calls the handler makes carry it too, and (under `retry_chain_stop`, the default) do not retry again:
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
        Self::scope_served(attachments, 0, fut)
    }

    /// Runs `f` with `attachments` as the call context: the synchronous form of
    /// [`scope`](Self::scope), for polling a future once in place.
    pub fn sync_scope<R>(attachments: BTreeMap<String, String>, f: impl FnOnce() -> R) -> R {
        Self::sync_scope_served(attachments, 0, f)
    }

    /// As [`scope`](Self::scope), for a server running a handler: `attachments` as received
    /// and `retry_depth`, the call's [`RETRY_DEPTH_KEY`] (0: none), which the transport decodes
    /// apart from the map. The context answers for it as if it were one of the attachments.
    pub fn scope_served<F: Future>(
        attachments: BTreeMap<String, String>,
        retry_depth: u32,
        fut: F,
    ) -> impl Future<Output = F::Output> {
        Self::scope_shared(Arc::new(attachments), retry_depth, fut)
    }

    /// [`scope_served`](Self::scope_served) with attachments shared with other scopes of the
    /// same call (a stream's set-up and each poll of its items).
    pub fn scope_shared<F: Future>(
        attachments: Arc<BTreeMap<String, String>>,
        retry_depth: u32,
        fut: F,
    ) -> impl Future<Output = F::Output> {
        CONTEXT.scope(
            Current {
                attachments,
                retry_depth,
            },
            fut,
        )
    }

    /// The synchronous form of [`scope_served`](Self::scope_served).
    pub fn sync_scope_served<R>(
        attachments: BTreeMap<String, String>,
        retry_depth: u32,
        f: impl FnOnce() -> R,
    ) -> R {
        Self::sync_scope_shared(Arc::new(attachments), retry_depth, f)
    }

    /// The synchronous form of [`scope_shared`](Self::scope_shared).
    pub fn sync_scope_shared<R>(
        attachments: Arc<BTreeMap<String, String>>,
        retry_depth: u32,
        f: impl FnOnce() -> R,
    ) -> R {
        CONTEXT.sync_scope(
            Current {
                attachments,
                retry_depth,
            },
            f,
        )
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

    /// A copy of the current attachments, the retry depth a server received among them
    /// (empty outside any scope; no allocation then).
    pub fn current_attachments() -> BTreeMap<String, String> {
        let depth = Self::served_retry_depth();
        let mut attachments = Self::with_current(BTreeMap::clone);
        if depth > 0 {
            attachments.insert(RETRY_DEPTH_KEY.to_string(), depth.to_string());
        }
        attachments
    }

    /// One attachment of the current context.
    pub fn get(key: &str) -> Option<String> {
        match Self::served_retry_depth() {
            depth if depth > 0 && key == RETRY_DEPTH_KEY => Some(depth.to_string()),
            _ => Self::with_current(|a| a.get(key).cloned()),
        }
    }

    /// The retry depth of the call being served ([`RETRY_DEPTH_KEY`]; 0 outside a handler, or
    /// when no caller up the chain retries, or when the attachment is not a number).
    pub fn retry_depth() -> u32 {
        match Self::served_retry_depth() {
            0 => Self::with_current(|a| {
                a.get(RETRY_DEPTH_KEY)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            }),
            depth => depth,
        }
    }

    /// The retry depth a server set beside the attachments ([`scope_served`](Self::scope_served)).
    fn served_retry_depth() -> u32 {
        CONTEXT.try_with(|c| c.retry_depth).unwrap_or(0)
    }

    /// Calls `f` with the current attachments (an empty map outside any scope), without
    /// copying them. The retry depth a server received is not among them: see
    /// [`retry_depth`](Self::retry_depth).
    pub fn with_current<R>(f: impl FnOnce(&BTreeMap<String, String>) -> R) -> R {
        let mut f = Some(f);
        match CONTEXT.try_with(|c| (f.take().expect("called once"))(&c.attachments)) {
            Ok(r) => r,
            Err(_) => (f.take().expect("not called"))(&BTreeMap::new()),
        }
    }
}

/// A call context kept to be entered again and again, each time at no cost beyond moving it
/// into the task-local slot and back.
///
/// [`RpcContext::sync_scope_shared`] gives the scope its own handle on the shared attachments
/// each time: an atomic increment and decrement per entry, a sixth of a server's CPU per item
/// on a stream of small items polled in its caller's context. A server polling each item of a
/// stream, or a handler's first poll, in the call's context holds it here instead.
#[derive(Debug)]
pub struct HeldContext {
    /// Taken while entered; put back when the scope ends, by unwinding too.
    current: Option<Current>,
}

impl HeldContext {
    /// `attachments` (shared with other scopes of the same call) and the `retry_depth` a
    /// server received, as [`RpcContext::scope_shared`] takes them.
    pub fn new(attachments: Arc<BTreeMap<String, String>>, retry_depth: u32) -> Self {
        Self {
            current: Some(Current {
                attachments,
                retry_depth,
            }),
        }
    }

    /// Runs `f` in this context, as [`RpcContext::sync_scope_shared`] would.
    pub fn enter<R>(&mut self, f: impl FnOnce() -> R) -> R {
        use std::pin::Pin;
        use std::task::{Context, Poll, Waker};
        use tokio::task::futures::TaskLocalFuture;

        /// Takes the context back out of the scope when it ends, however it ends.
        struct Restore<'a, F: Future> {
            held: &'a mut Option<Current>,
            scoped: Pin<&'a mut TaskLocalFuture<Current, F>>,
        }
        impl<F: Future> Drop for Restore<'_, F> {
            fn drop(&mut self) {
                *self.held = self.scoped.as_mut().take_value();
            }
        }

        let Some(current) = self.current.take() else {
            // Only after a scope whose value tokio lost: run with the surrounding context.
            return f();
        };
        // A scope around a future that is ready at its first poll: tokio's task-local future
        // swaps the value in and out without giving it up (`sync_scope` would consume it).
        let scoped = std::pin::pin!(CONTEXT.scope(current, async move { f() }));
        let mut restore = Restore {
            held: &mut self.current,
            scoped,
        };
        match restore
            .scoped
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(r) => r,
            Poll::Pending => unreachable!("a block without `.await` is ready at its first poll"),
        }
    }

    /// Runs `fut` in this context, as [`RpcContext::scope_shared`] would.
    pub fn scope<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        let current = self.current.unwrap_or_else(|| Current {
            attachments: Arc::default(),
            retry_depth: 0,
        });
        CONTEXT.scope(current, fut)
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

    #[test]
    fn a_served_retry_depth_reads_as_an_attachment_and_yields_to_none_outside() {
        let attachments = BTreeMap::from([("a".to_string(), "1".to_string())]);
        poll_now(RpcContext::scope_served(attachments, 3, async {
            assert_eq!(RpcContext::retry_depth(), 3);
            assert_eq!(RpcContext::get(RETRY_DEPTH_KEY).as_deref(), Some("3"));
            let all = RpcContext::current_attachments();
            assert_eq!(all.get(RETRY_DEPTH_KEY).map(String::as_str), Some("3"));
            assert_eq!(all.get("a").map(String::as_str), Some("1"));
            // A nested scope made from the copy keeps the depth, as a map entry.
            poll_now(RpcContext::with_attachment("b", "2", async {
                assert_eq!(RpcContext::retry_depth(), 3);
            }));
        }));
        // A depth given as a map entry (`scope`) reads the same.
        let entry = BTreeMap::from([(RETRY_DEPTH_KEY.to_string(), "2".to_string())]);
        poll_now(RpcContext::scope(entry, async {
            assert_eq!(RpcContext::retry_depth(), 2);
        }));
        assert_eq!(RpcContext::retry_depth(), 0);
    }

    #[test]
    fn a_held_context_is_entered_again_and_again_and_survives_a_panic() {
        let attachments = Arc::new(BTreeMap::from([("a".to_string(), "1".to_string())]));
        let mut held = HeldContext::new(attachments.clone(), 2);
        for _ in 0..3 {
            let seen = held.enter(|| (RpcContext::get("a"), RpcContext::retry_depth()));
            assert_eq!(seen, (Some("1".to_string()), 2));
            assert_eq!(RpcContext::get("a"), None, "the scope ended");
        }
        // Entered inside another scope, it replaces it and gives it back.
        let outer = BTreeMap::from([("b".to_string(), "2".to_string())]);
        poll_now(RpcContext::scope(outer, async {
            assert_eq!(held.enter(|| RpcContext::get("b")), None);
            assert_eq!(RpcContext::get("b").as_deref(), Some("2"));
        }));
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            held.enter(|| panic!("in the scope"))
        }));
        assert!(panicked.is_err());
        assert_eq!(RpcContext::get("a"), None, "the scope ended by unwinding");
        assert_eq!(held.enter(|| RpcContext::get("a")).as_deref(), Some("1"));
        // Moved, not copied: the scope holds the handle `held` keeps, and no other.
        assert_eq!(held.enter(|| Arc::strong_count(&attachments)), 2);
        let seen = poll_now(held.scope(async { RpcContext::retry_depth() }));
        assert_eq!(seen, 2);
    }
}
