//! Which endpoint answered: opt-in, per task (kept in `rpc_core::answered`, where the
//! governance layers see it too).

pub use rpc_core::answered::answered_by;

/// Records `addr` when the current task is inside [`answered_by`]; free otherwise.
pub(crate) fn record(addr: &str) {
    rpc_core::answered::record(addr);
}

/// Records what an attempt on `addr` got: `answered`, whether the server answered at all,
/// and `result`, what the attempt returns. An answer saying the endpoint cannot serve the
/// call moves the call on without deciding it: it is the call's answer only when no attempt
/// came before (else the call returns the one before, whose record stands).
pub(crate) fn attempt<T>(addr: &str, answered: bool, result: &Result<T, rpc_core::RpcError>) {
    let by = answered.then_some(addr);
    match (result, by) {
        (Err(e), by) if e.is_unsupported_by_endpoint() => rpc_core::answered::record_if_first(by),
        (_, Some(addr)) => rpc_core::answered::record(addr),
        (_, None) => rpc_core::answered::record_nobody(),
    }
}
