//! The accept loop: takes sockets, refuses those over `max_connections`, hands the rest to
//! their connection loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::connection::{run_connection, Served};
use super::expansion::ExpansionBudget;
use super::handler::InvokeHandler;
use super::options::ServerOptions;
use crate::peer::PeerAddr;
use crate::reader::ReadBudget;
use crate::transport::{Listener, Stream};

/// Accepts connections on `listener` until `shutdown` is cancelled, then drains every connection
/// (`GoAway`, calls in flight finish within `drain_timeout`) and returns.
///
/// `listener` is any [`Listener`]: a `tokio::net::TcpListener`, a
/// [`UnixListener`](crate::UnixListener), or another transport's.
pub async fn serve<L: Listener>(
    listener: L,
    handler: Arc<dyn InvokeHandler>,
    options: ServerOptions,
    shutdown: CancellationToken,
) {
    let max_connections = options.max_connections;
    let server = Arc::new(Served {
        handler,
        budget: ReadBudget::new(options.max_read_buffer_bytes, options.max_frame_length),
        expansion: ExpansionBudget::new(options.max_decompressed_bytes, options.max_frame_length),
        options,
        shutdown: shutdown.clone(),
        drain_deadline: std::sync::OnceLock::new(),
        stopped_at_once: Arc::default(),
    });
    // (A limit past what a semaphore holds, `usize::MAX` for "no limit", is no limit.)
    let slots = Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS)));
    let mut conns = tokio::task::JoinSet::new();
    // Declared after `conns`, so dropped before it: the flag is up before any connection's
    // task is aborted.
    let mut stopped = StoppedAtOnce(Some(server.stopped_at_once.clone()));
    // After refusing a connection at the limit, accepting pauses until a slot frees or
    // REFUSAL_BACKOFF passes: a flood of connects then waits in the kernel's accept queue
    // instead of costing an accept, a GoAway and a close each.
    let mut back_off: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = sleep_until_or_never(back_off), if back_off.is_some() => {
                back_off = None;
                continue;
            }
            Ok(slot) = slots.clone().acquire_owned(), if back_off.is_some() => {
                drop(slot);
                back_off = None;
                continue;
            }
            a = listener.accept(), if back_off.is_none() => a,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        match accepted {
            Ok((stream, peer)) => {
                let server = server.clone();
                match slots.clone().try_acquire_owned() {
                    Ok(permit) => {
                        conns.spawn(async move {
                            serve_connection(stream, peer, server, true).await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        tracing::warn!(%peer, max = max_connections, "connection refused: too many connections");
                        conns.spawn(serve_connection(stream, peer, server, false));
                        back_off = Some(Instant::now() + REFUSAL_BACKOFF);
                    }
                }
            }
            Err(e) => {
                // Out of file descriptors and the like: back off briefly instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    drop(listener);
    // The drain's deadline runs from now, for every connection.
    server.drain_deadline();
    while conns.join_next().await.is_some() {}
    stopped.0 = None;
}

/// Raises its flag when dropped still holding it: the accept loop's future was dropped before
/// it ended.
struct StoppedAtOnce(Option<Arc<AtomicBool>>);

impl Drop for StoppedAtOnce {
    fn drop(&mut self) {
        if let Some(flag) = &self.0 {
            flag.store(true, Ordering::Release);
        }
    }
}

/// How long accepting pauses after a connection was refused at `max_connections`, unless a
/// slot frees sooner.
pub(super) const REFUSAL_BACKOFF: Duration = Duration::from_millis(50);

pub(super) async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// An accepted socket becomes its reader and writer here, and only here: a plain socket splits
/// in place (no lock between the halves); TLS runs its handshake first, within
/// `handshake_timeout`, and splits the TLS stream. Everything after is generic over the halves,
/// so neither path pays for the other. A connection over `max_connections` (`admitted` false)
/// is told so with a `GoAway` and closed.
pub(super) async fn serve_connection<S: Stream>(
    stream: S,
    peer: PeerAddr,
    server: Arc<Served>,
    admitted: bool,
) {
    let hello_by = Instant::now() + rpc_core::capped(server.options.handshake_timeout);
    #[cfg(feature = "tls")]
    if let Some(tls) = &server.options.tls {
        let timeout = server.options.handshake_timeout;
        // (A TLS handshake under way when the server shuts down is dropped, as a Hello is.)
        let accepted = tokio::select! {
            accepted = tls.accept(stream, &peer, hello_by, timeout) => accepted,
            () = server.shutdown.cancelled() => None,
        };
        if let Some(stream) = accepted {
            let cert = crate::tls::peer_certificate(&stream);
            let (rd, wr) = tokio::io::split(stream);
            run_connection(rd, wr, peer, cert, &server, hello_by, admitted).await;
        }
        return;
    }
    let (rd, wr) = stream.into_split();
    run_connection(rd, wr, peer, None, &server, hello_by, admitted).await;
}
