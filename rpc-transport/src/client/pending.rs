//! The table of calls waiting for their answers.

use rpc_core::wire::RemoteResultMessage;
use rpc_core::RpcError;
use tokio::sync::oneshot;

pub(super) type Waiter = oneshot::Sender<Result<RemoteResultMessage, RpcError>>;

/// A call waiting for its answer.
pub(super) struct Pending {
    pub(super) waiter: Waiter,
    /// Milliseconds after the connection's epoch at which the call times out (0: never).
    pub(super) deadline_ms: u64,
}

/// No sweep scheduled.
pub(super) const NO_SWEEP: u64 = u64::MAX;
