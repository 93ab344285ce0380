//! The service of `signal-server` (`tests/tests/integration/ergonomics.rs`): a call that holds until the
//! test releases it, to show that a server stopped by a signal lets it finish.

use rpc::RpcError;

/// Held calls.
#[rpc::service(name = "signals.Hold")]
pub trait Hold {
    /// Answers `n` once the server's standard input receives a line.
    async fn hold(&self, n: u64) -> Result<u64, RpcError>;
}
