//! The server of the signal test (`tests/tests/integration/ergonomics.rs`), run as a separate process so
//! that the test can send it SIGTERM.
//!
//! ```text
//! signal-server <registry url> [<listen address>]
//! ```
//! Binds the listen address (127.0.0.1 on a free port by default; `unix:/path` for a Unix
//! domain socket), publishes itself to the registry the URL names, prints
//! `listening on <addr>`, and serves `signals.Hold` until SIGINT or SIGTERM
//! (`ServerHandle::serve_until_signal`); then prints `stopped` and exits 0. Each `hold` call
//! prints `held` and waits for a line on standard input. Exits with 3 when standard input
//! closes while it serves, so that it never outlives the test that started it.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use rpc::{Registry, RpcError, Server};
use tests::signals::{Hold, HoldServer};
use tokio::sync::watch;

/// Set once the server has stopped: standard input closing after that is no reason to exit 3.
static STOPPED: AtomicBool = AtomicBool::new(false);

struct Holder {
    released: watch::Receiver<u64>,
}

impl Hold for Holder {
    async fn hold(&self, n: u64) -> Result<u64, RpcError> {
        let mut released = self.released.clone();
        let before = *released.borrow_and_update();
        say("held");
        released
            .wait_for(|r| *r > before)
            .await
            .map_err(|_| RpcError::business("standard input closed"))?;
        Ok(n)
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
    let url = std::env::args()
        .nth(1)
        .ok_or("usage: signal-server <registry url> [<listen address>]")?;
    let listen = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "127.0.0.1:0".to_string());
    let registry = <dyn Registry>::from_url(&url).await?;
    let (release, released) = watch::channel(0u64);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if line.is_err() {
                break;
            }
            release.send_modify(|n| *n += 1);
        }
        if !STOPPED.load(Ordering::SeqCst) {
            std::process::exit(3);
        }
    });
    let server = Server::builder()
        .shared_registry(registry)
        .add_service(HoldServer::new(Holder { released }))
        .serve(listen.as_str())
        .await?;
    let addr = server.address().to_string();
    let stopped = server.serve_until_signal();
    say(&format!("listening on {addr}"));
    stopped.await?;
    STOPPED.store(true, Ordering::SeqCst);
    say("stopped");
    Ok(())
}
