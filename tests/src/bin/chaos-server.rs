//! The server of the chaos test (`tests/tests/integration/chaos.rs`), run as a separate process so that the
//! test can kill it with SIGKILL.
//!
//! ```text
//! chaos-server
//! ```
//! Binds 127.0.0.1 on a free port, prints `listening on <addr>`, and serves `chaos.Chaos`
//! (see `tests::chaos`); prints `parked` each time a `park` call enters its handler. Exits when
//! its standard input closes, so that it never outlives the test that started it.

use std::io::Write;

use rpc::{RpcError, Server};
use tests::chaos::{Chaos, ChaosServer};

struct Node {
    pid: u32,
}

impl Chaos for Node {
    async fn read(&self, n: u64) -> Result<(u64, u32), RpcError> {
        tokio::task::yield_now().await;
        Ok((n, self.pid))
    }

    async fn write(&self, n: u64) -> Result<(u64, u32), RpcError> {
        tokio::task::yield_now().await;
        Ok((n, self.pid))
    }

    async fn park(&self) -> Result<u32, RpcError> {
        say("parked");
        std::future::pending::<()>().await;
        Ok(self.pid)
    }
}

/// One line on standard output, flushed at once (the test reads it through a pipe).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = Server::builder()
        .add_service(ChaosServer::new(Node {
            pid: std::process::id(),
        }))
        .serve("127.0.0.1:0")
        .await?;
    say(&format!("listening on {}", server.local_addr()));

    tests::parent::stdin_closed().await;
    server.abort();
    Ok(())
}
