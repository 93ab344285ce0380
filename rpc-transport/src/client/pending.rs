//! The table of calls waiting for their answers.

use std::sync::atomic::Ordering;

use rpc_core::wire::{frame::Kind, Cancel, RemoteResultMessage};
use rpc_core::RpcError;
use tokio::sync::oneshot;

use super::connection::{comm_error, Shared};

pub(super) type Waiter = oneshot::Sender<Result<RemoteResultMessage, RpcError>>;

/// A call waiting for its answer.
pub(super) struct Pending {
    pub(super) waiter: Waiter,
    /// Milliseconds after the connection's epoch at which the call times out (0: never).
    pub(super) deadline_ms: u64,
}

/// No sweep scheduled.
pub(super) const NO_SWEEP: u64 = u64::MAX;

/// Removes a call from the pending map and tells the server when the caller gives up.
pub(super) struct PendingGuard<'a> {
    pub(super) shared: &'a Shared,
    pub(super) id: u64,
    pub(super) armed: bool,
}

impl PendingGuard<'_> {
    pub(super) fn disarm_quietly(&mut self) {
        self.armed = false;
        self.shared.pending.remove(&self.id);
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            if self.shared.pending.remove(&self.id).is_some() {
                self.shared.sender.send(Kind::Cancel(Cancel {
                    message_id: self.id,
                }));
            }
        }
    }
}

pub(super) fn fail_pending(shared: &Shared, reason: &str, maybe_delivered: bool) {
    let ids: Vec<u64> = shared.pending.iter().map(|e| *e.key()).collect();
    for id in ids {
        if let Some((_, p)) = shared.pending.remove(&id) {
            let err = comm_error(&shared.peer, reason).maybe_delivered(maybe_delivered);
            let _ = p.waiter.send(Err(err));
        }
    }
}
