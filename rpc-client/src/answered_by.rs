//! Which endpoint answered: opt-in, per task (kept in `rpc_core::answered`, where the
//! governance layers see it too).

pub use rpc_core::answered::answered_by;

/// Records `addr` when the current task is inside [`answered_by`]; free otherwise.
pub(crate) fn record(addr: &str) {
    rpc_core::answered::record(addr);
}
