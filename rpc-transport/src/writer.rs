//! The one writer task of a connection: drains queued frames into one buffer, one write per batch.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::BytesMut;
use rpc_core::wire::frame::Kind;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::codec::FrameCodec;

/// Bytes gathered before a write is issued even if more frames are queued.
const MAX_BATCH: usize = 256 * 1024;
/// Initial capacity of the write buffer.
const BUFFER: usize = 64 * 1024;

/// The queue in front of a connection's writer task. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct FrameSender {
    tx: mpsc::UnboundedSender<Kind>,
}

impl FrameSender {
    /// Queues a frame; false when the connection is closed.
    pub(crate) fn send(&self, kind: Kind) -> bool {
        self.tx.send(kind).is_ok()
    }
}

/// Starts the writer task for `wr`: the write half of a TCP socket, or of a TLS stream.
///
/// `in_flight` counts calls whose frames are still to come (pending calls on a client, running
/// handlers on a server): when more are in flight than the batch holds, the writer yields once
/// before writing so that their frames share the write. At low load it writes at once.
pub(crate) fn spawn_writer<W: AsyncWrite + Unpin + Send + 'static>(
    wr: W,
    in_flight: Arc<AtomicUsize>,
    close: CancellationToken,
) -> FrameSender {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(write_loop(rx, wr, in_flight, close));
    FrameSender { tx }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut rx: mpsc::UnboundedReceiver<Kind>,
    mut wr: W,
    in_flight: Arc<AtomicUsize>,
    close: CancellationToken,
) {
    let mut buf = BytesMut::with_capacity(BUFFER);
    let closing = close.cancelled();
    tokio::pin!(closing);
    loop {
        let first = tokio::select! {
            biased;
            f = rx.recv() => f,
            _ = &mut closing => None,
        };
        let Some(first) = first else { break };
        FrameCodec::encode_kind(first, &mut buf);
        let mut frames = 1usize;
        let mut yielded = false;
        loop {
            while buf.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(kind) => {
                        FrameCodec::encode_kind(kind, &mut buf);
                        frames += 1;
                    }
                    Err(_) => break,
                }
            }
            if !yielded && buf.len() < MAX_BATCH && in_flight.load(Ordering::Relaxed) > frames {
                yielded = true;
                tokio::task::yield_now().await;
                continue;
            }
            break;
        }
        // `flush` costs nothing on a TCP socket; a TLS stream may still hold the end of the
        // batch after `write_all` when the socket was full.
        if wr.write_all(&buf).await.is_err() || wr.flush().await.is_err() {
            break;
        }
        buf.clear();
        if buf.capacity() > 4 * MAX_BATCH {
            // A burst of large frames grew the buffer: give the memory back.
            buf = BytesMut::with_capacity(BUFFER);
        }
    }
    // The reader is not stopped here: after a failed write it still reads what the peer sent
    // before closing (a GoAway saying which calls it never read), then sees the close itself.
    // Later sends fail, since this task no longer receives.
    let _ = wr.shutdown().await;
}
