//! The one writer task of a connection: drains queued frames into one buffer, one write per batch.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::BytesMut;
use rpc_core::wire::frame::Kind;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use crate::call::Call;
use crate::codec::FrameCodec;
use crate::encode::put_invoke_frame;

/// The writer yields to gather more frames only when more than this many calls beyond the
/// batch are in flight: with a few calls in flight, waiting a scheduler round costs more
/// latency than the shared write saves.
const YIELD_MARGIN: usize = 32;

/// Bytes gathered before a write is issued even if more frames are queued.
const MAX_BATCH: usize = 256 * 1024;
/// Initial capacity of the write buffer; it grows with the batches it carries and keeps its
/// size (up to `4 * MAX_BATCH`), so short-lived connections stay small.
const BUFFER: usize = 4 * 1024;

/// The queue in front of a connection's writer task. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct FrameSender {
    tx: mpsc::UnboundedSender<Outgoing>,
    backlog: Arc<Backlog>,
}

/// What the writer is handed: a frame, or a client's call with the id it was given.
#[derive(Debug)]
pub(crate) enum Outgoing {
    Frame(Kind),
    Call(u64, Call),
}

impl Outgoing {
    fn encode(self, dst: &mut BytesMut) {
        match self {
            Outgoing::Frame(kind) => FrameCodec::encode_kind(kind, dst),
            Outgoing::Call(id, call) => put_invoke_frame(&call.fields(id), dst),
        }
    }
}

/// Bytes queued for the writer and not yet written (an estimate: the payload and message of
/// each frame plus a fixed overhead), so that a server can stop reading from a client that does
/// not read its answers instead of queueing them without bound.
#[derive(Debug, Default)]
pub(crate) struct Backlog {
    bytes: AtomicUsize,
    /// Woken when the writer has written a batch.
    written: Notify,
    /// Every waiter is woken when the writer has written a batch or stopped (callers waiting
    /// for room in a client's send queue).
    room: Notify,
}

impl Backlog {
    /// Bytes queued and not yet written.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Resolves after the writer's next completed write (at once if one completed since the
    /// last wait). For one waiter.
    pub(crate) fn written(&self) -> tokio::sync::futures::Notified<'_> {
        self.written.notified()
    }

    /// Resolves after the writer's next completed write, or once it stopped; for any number of
    /// waiters (enable it before checking [`bytes`](Self::bytes), so no wake-up is missed).
    pub(crate) fn room(&self) -> tokio::sync::futures::Notified<'_> {
        self.room.notified()
    }
}

/// What a frame is counted as in the backlog: its variable parts plus the rest of the message.
fn estimate(frame: &Outgoing) -> usize {
    const FIXED: usize = 64;
    FIXED
        + match frame {
            Outgoing::Frame(Kind::Result(r)) => r.result.len() + r.exception_message.len(),
            Outgoing::Frame(Kind::Invoke(i)) => i.parameters.len() + i.service_entry_id.len(),
            Outgoing::Frame(Kind::GoAway(g)) => g.reason.len(),
            Outgoing::Frame(_) => 0,
            Outgoing::Call(_, c) => c.parameters.len() + c.service_entry_id.len(),
        }
}

impl FrameSender {
    /// Queues a frame; false when the connection is closed.
    pub(crate) fn send(&self, kind: Kind) -> bool {
        self.push(Outgoing::Frame(kind))
    }

    /// Queues a client's call as an invoke frame with `message_id` `id`; false when the
    /// connection is closed.
    pub(crate) fn send_call(&self, id: u64, call: Call) -> bool {
        self.push(Outgoing::Call(id, call))
    }

    fn push(&self, frame: Outgoing) -> bool {
        // Counted before it can reach the writer, which subtracts it once written.
        let n = estimate(&frame);
        self.backlog.bytes.fetch_add(n, Ordering::Relaxed);
        if self.tx.send(frame).is_err() {
            self.backlog.bytes.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The bytes queued behind this sender.
    pub(crate) fn backlog(&self) -> &Backlog {
        &self.backlog
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
    let backlog = Arc::new(Backlog::default());
    tokio::spawn(write_loop(rx, wr, in_flight, backlog.clone(), close));
    FrameSender { tx, backlog }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    mut wr: W,
    in_flight: Arc<AtomicUsize>,
    backlog: Arc<Backlog>,
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
        let mut counted = estimate(&first);
        first.encode(&mut buf);
        let mut frames = 1usize;
        let mut yielded = false;
        loop {
            while buf.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(frame) => {
                        counted += estimate(&frame);
                        frame.encode(&mut buf);
                        frames += 1;
                    }
                    Err(_) => break,
                }
            }
            if !yielded
                && buf.len() < MAX_BATCH
                && in_flight.load(Ordering::Relaxed) > frames + YIELD_MARGIN
            {
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
        backlog.bytes.fetch_sub(counted, Ordering::Relaxed);
        // One waiter at most (the connection's reader); a permit is kept if it is not waiting
        // yet, so a write between its check and its wait is not missed.
        backlog.written.notify_one();
        backlog.room.notify_waiters();
        buf.clear();
        if buf.capacity() > 4 * MAX_BATCH {
            // A burst of large frames grew the buffer: give the memory back.
            buf = BytesMut::with_capacity(BUFFER);
        }
    }
    // The reader is not stopped here: after a failed write it still reads what the peer sent
    // before closing (a GoAway saying which calls it never read), then sees the close itself.
    // Later sends fail, since this task no longer receives.
    backlog.room.notify_waiters();
    let _ = wr.shutdown().await;
}
