//! The service of the chaos test (`tests/tests/integration/chaos.rs`) and of its server program
//! (`src/bin/chaos-server.rs`): one idempotent entry, one that is not, and one that never
//! answers, so that a test can be sure a call is inside a server when it kills it.

use rpc::RpcError;

/// What the chaos server offers.
#[rpc::service(name = "chaos.Chaos")]
pub trait Chaos {
    /// Returns `n` and the server's process id. Idempotent: a call that may have reached a
    /// server that died is repeated on another one.
    #[governance(idempotent)]
    async fn read(&self, n: u64) -> Result<(u64, u32), RpcError>;

    /// Returns `n` and the server's process id. Not idempotent: a call that may have reached a
    /// server that died is never repeated, and its error says it may have been delivered.
    async fn write(&self, n: u64) -> Result<(u64, u32), RpcError>;

    /// Prints `parked` on the server's standard output, then never answers. Not idempotent, no
    /// deadline.
    #[governance(timeout_ms = 0)]
    async fn park(&self) -> Result<u32, RpcError>;
}
