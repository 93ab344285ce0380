//! Prints the governance options a client resolves from a real process environment, for the
//! configuration test (`tests/tests/integration/governance_env.rs`): the test starts this program with
//! `RPC_GOVERNANCE` set and reads what it resolved.
//!
//! ```text
//! RPC_GOVERNANCE='...' governance-env
//! ```
//! Builds a client with `Client::builder().config_env()` and prints, for each entry of
//! `chaos.Chaos`, one line: `<entry id> timeout_ms=<n> retry_times=<n> idempotent=<bool>
//! shunt_strategy=<strategy>`. A variable that does not parse is printed on standard error and
//! the program exits with status 2.

use std::io::Write;

use rpc::{Client, InProcessRegistry};
use tests::chaos::ChaosClient;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let client = match Client::builder()
        .registry(InProcessRegistry::new())
        .config_env()
    {
        Ok(builder) => builder.build(),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let mut out = std::io::stdout().lock();
    for method in ChaosClient::methods() {
        let o = client.options(method);
        let _ = writeln!(
            out,
            "{} timeout_ms={} retry_times={} idempotent={} shunt_strategy={:?}",
            method.entry_id, o.timeout_ms, o.retry_times, o.idempotent, o.shunt_strategy
        );
    }
    let _ = out.flush();
}
