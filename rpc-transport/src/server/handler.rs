//! The seam to the layer above: what a handler is asked, what it answers, and the error
//! answers the transport builds itself.

use std::sync::Arc;

use crate::caller::Caller;

use futures_util::future::BoxFuture;
use rpc_core::wire::{frame::Kind, GoAway, RemoteResultMessage};
use rpc_core::StatusCode;

use super::calls::Responder;
use crate::invoke::Invoke;

/// What the server does with one call.
pub enum Dispatch {
    /// Answer at once (overflow, unknown entry, ...), without spawning.
    Ready(RemoteResultMessage),
    /// Run this future in its own task; `Cancel` drops it.
    Spawn(BoxFuture<'static, RemoteResultMessage>),
}

/// The layer above the transport: turns a call into its answer. `message_id` of the answer is
/// filled in by the transport.
///
/// The transport calls [`dispatch`](Self::dispatch), which by default hands on what
/// [`handle`](Self::handle) decides. A handler overriding `dispatch` starts its call future
/// through the [`Responder`] as it is, without boxing it: one allocation less per call, and a
/// task the size of that future.
pub trait InvokeHandler: Send + Sync + 'static {
    /// Decides how to answer `invoke` from `caller` (the same `Arc` for every call of a
    /// connection, built at its handshake); must not block.
    fn handle(&self, invoke: Invoke, caller: &Arc<Caller>) -> Dispatch;

    /// Answers or starts `invoke` from `caller` through `respond` (exactly once, as it takes
    /// `respond` by value); must not block. By default: what [`handle`](Self::handle) decides.
    fn dispatch(&self, invoke: Invoke, caller: &Arc<Caller>, respond: Responder<'_>) {
        respond.dispatch(self.handle(invoke, caller));
    }
}

/// A result carrying an error status.
pub fn error_result(code: StatusCode, message: impl Into<String>) -> RemoteResultMessage {
    RemoteResultMessage {
        status_code: code.as_u32(),
        exception_message: message.into(),
        ..Default::default()
    }
}

pub(crate) fn go_away(code: StatusCode, reason: impl Into<String>) -> Kind {
    Kind::GoAway(GoAway {
        status_code: code.as_u32(),
        reason: reason.into(),
    })
}
