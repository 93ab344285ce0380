//! What an attempt has drawn before it leaves the client, given back unless it does.
//!
//! Two policies count an attempt before it is sent: adaptive throttling counts a request when
//! it admits one, and a hedge draws a retry from the entry's budget when its gate lets it
//! through. Between there and the transport the attempt can still end without leaving the
//! client: throttling drops it, a per-attempt layer refuses or answers it, its deadline passes
//! in a layer, or the call is dropped (a losing attempt of a hedged call, a caller's timeout,
//! an HTTP client gone from the gateway). No server saw such an attempt, so what it drew goes
//! back; and a hedge that never left is no hedge, so its `hedge` event is not sent.
//!
//! Each is a guard held in the attempt's [`CallCx`]: dropped, it gives back what it drew;
//! [`CallCx::leaves_client`], run by the stage below the per-attempt layers, disarms it (and
//! sends the hedge's event). Being guards, they also give back when the attempt's future is
//! dropped at any await: the context outlives its attempts' futures.

use std::sync::Arc;

use tokio::time::Instant;

use super::CallCx;
use crate::engine::EntryPolicy;
use crate::events::EventKind;

/// A request adaptive throttling counted at `counted_at` for an attempt not sent yet: dropped
/// armed, it is withdrawn from the throttle's window.
pub(crate) struct UnsentRequest {
    policy: Option<Arc<EntryPolicy>>,
    counted_at: Instant,
}

impl UnsentRequest {
    /// The request counted at `counted_at` by `policy`'s throttle.
    pub(crate) fn new(policy: Arc<EntryPolicy>, counted_at: Instant) -> Self {
        UnsentRequest {
            policy: Some(policy),
            counted_at,
        }
    }

    /// The attempt left the client: the request stands.
    fn sent(mut self) {
        self.policy = None;
    }
}

impl Drop for UnsentRequest {
    fn drop(&mut self) {
        if let Some(throttle) = self.policy.as_ref().and_then(|p| p.throttle.get()) {
            throttle.withdraw_request_at(self.counted_at, Instant::now());
        }
    }
}

/// A hedge its gate let through, holding the retry it drew and its `hedge` event until it
/// leaves the client: dropped armed, the retry goes back and no event is sent.
pub(crate) struct HedgeSent {
    policy: Option<Arc<EntryPolicy>>,
    /// The endpoint the event names (the call's latest).
    endpoint: Option<Arc<str>>,
    /// Why the hedge went: its delay.
    why: String,
}

impl HedgeSent {
    /// A hedge of `policy`'s entry that drew a retry from its budget; its event will name
    /// `endpoint` and say `why`.
    pub(crate) fn new(policy: Arc<EntryPolicy>, endpoint: Option<Arc<str>>, why: String) -> Self {
        HedgeSent {
            policy: Some(policy),
            endpoint,
            why,
        }
    }

    /// The hedge left the client: its retry stays drawn, and its event is sent.
    fn sent(mut self, cx: &CallCx<'_>) {
        self.policy = None;
        let why = std::mem::take(&mut self.why);
        cx.emit(EventKind::Hedge, self.endpoint.as_deref(), 1, Some(why));
    }
}

impl Drop for HedgeSent {
    fn drop(&mut self) {
        if let Some(policy) = &self.policy {
            policy.budget.give_back();
        }
    }
}

impl CallCx<'_> {
    /// The attempt passes its per-attempt layers, to the stage that sends it: what it drew
    /// stands, and a hedge's `hedge` event is sent.
    pub(crate) fn leaves_client(&mut self) {
        if let Some(request) = self.unsent_request.take() {
            request.sent();
        }
        if let Some(hedge) = self.hedge_sent.take() {
            hedge.sent(self);
        }
    }
}
