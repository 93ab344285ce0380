//! Endpoint choice as the stack sees it: a picker per call that yields candidates in order.
//!
//! The retry layer asks the picker for each attempt's endpoint and moves to the next candidate
//! when an attempt fails; how the candidates are ordered (strategy, hash ring, health ranking,
//! ejection) is the balancer's business, in one module of the client.

use std::future::Future;
use std::sync::Arc;

use rpc_core::RpcError;

use super::CallCx;

/// Makes the picker of one call.
pub trait Balance: Send + Sync {
    /// The candidates of one call.
    type Picker: Pick;

    /// The picker of the call in `cx` (its entry, options and hash key). An error here (no
    /// endpoint known for the service) ends the call.
    fn picker(
        &self,
        cx: &CallCx<'_>,
    ) -> impl Future<Output = Result<Self::Picker, RpcError>> + Send;

    /// `addr` was just removed after repeated transport failures: the balancer may probe it in
    /// the background (the stack performs no I/O).
    fn removed(&self, addr: &str) {
        let _ = addr;
    }

    /// Whether `addr` is an endpoint the call of `cx` may still be sent to (a service lists
    /// it, or the call appoints it). A failure on an endpoint that is not (a call still out
    /// on it when it left) is not held against it: its marks were forgotten as it left, and
    /// one made now would stay, nothing clearing it. The default: every endpoint is.
    fn listed(&self, addr: &str, cx: &CallCx<'_>) -> bool {
        let _ = (addr, cx);
        true
    }
}

/// The ordered candidates of one call.
pub trait Pick: Send {
    /// The endpoint of the next attempt: the best candidate not tried yet (`cx.tried()`), or,
    /// once every one was tried, the best tried one again. An endpoint the call found unable to
    /// serve it (`cx.unable()`) is no candidate while any other is: the retry layer counts on
    /// it when it retries the failure before such a detour. An error (no endpoint at all) ends
    /// the call.
    fn next(&mut self, cx: &CallCx<'_>) -> Result<Arc<str>, RpcError>;

    /// Whether some candidate has not been tried yet.
    fn untried_left(&self, cx: &CallCx<'_>) -> bool;

    /// Whether a candidate other than `addr` is usable now (by this client's endpoint health).
    /// Failures held against `addr` do not count toward the entry's breaker while one is. The
    /// default, `false`, counts every failure for the entry.
    fn any_other_usable(&self, addr: &str, cx: &CallCx<'_>) -> bool {
        let _ = (addr, cx);
        false
    }

    /// Whether there is any candidate at all, tried or not. False when the service's endpoints,
    /// or the call's routing group, emptied while an attempt was out: a retry could not be
    /// sent, and the call ends with the attempt's failure instead of waiting for one. The
    /// default, `true`, leaves that to [`next`](Self::next).
    fn any_candidate(&self, cx: &CallCx<'_>) -> bool {
        let _ = cx;
        true
    }
}

impl<B: Balance> Balance for &B {
    type Picker = B::Picker;
    fn picker(
        &self,
        cx: &CallCx<'_>,
    ) -> impl Future<Output = Result<Self::Picker, RpcError>> + Send {
        (**self).picker(cx)
    }
    fn removed(&self, addr: &str) {
        (**self).removed(addr)
    }
    fn listed(&self, addr: &str, cx: &CallCx<'_>) -> bool {
        (**self).listed(addr, cx)
    }
}
