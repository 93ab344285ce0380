//! The one writer task of a connection: drains queued frames into one buffer, one write per batch.
//!
//! Frames wait in a queue under a lock, not in a channel: a sender pushes onto a `VecDeque`
//! and wakes the writer only when the queue was empty (the writer is then waiting, or about to
//! look), and the writer takes the whole queue at once by swapping it with its own, emptied
//! one. A channel paid a slot, a permit and a waker check per frame on each side; at 256
//! calls in flight that was a tenth of a call's cost on each side.
//!
//! Once the peer has said in its handshake that it takes `StreamItems`, the writer also
//! carries each run of queued items of one stream (compressed alike) in one such frame: the
//! peer then decodes and hands over a run of small items once instead of once per item.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rpc_core::wire::{frame::Kind, StreamItem};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::transport::Abortive;

use crate::call::Call;
use crate::codec::FrameCodec;
use crate::encode::{nested_len, put_invoke_frame, put_item_frame, put_items_frame};

/// The writer yields to gather more frames only when more than this many calls beyond the
/// batch are in flight: with a few calls in flight, waiting a scheduler round costs more
/// latency than the shared write saves.
///
/// Measured with `bench` (32 B echo, one connection): with 32 calls in flight a margin of 32
/// never yielded, and each call's request and answer took a `sendto` of its own (1.9 per call
/// through the gateway); a margin of 8 lets them share writes and took 32 calls in flight from
/// 103–125 k to 174–191 k calls/s, while 1 and 4 calls in flight still write at once.
const YIELD_MARGIN: usize = 8;

/// ... and only while the batch holds fewer bytes than this: a write's fixed cost (the system
/// call) is then most of what it costs, and sharing it pays for the scheduler round the yield
/// waits. Past a few KiB the bytes themselves cost more than the call, and the wait is only
/// latency.
///
/// Measured with `bench` (governance off, one connection, four alternating runs each): with
/// 4 KiB calls and 16 in flight the yield took 101.6 k calls/s to 93.7 k (p50 142 → 157 µs)
/// while 32 B calls with 32 in flight gained 131 k → 187 k from it. With this bound (three
/// runs each against no yield at all): 4 KiB × 16 90.3 k → 94.6 k (within the spread), 1 KiB
/// × 32 105 k → 141 k, 32 B × 32 117 k → 163 k.
const YIELD_BYTES: usize = 4 * 1024;

/// Bytes of a `StreamItems` frame's items at most, as the frame encodes them (each item's key,
/// length and bytes): far below the default frame limit, and large enough that a run of small
/// items takes a frame or two. Counting the encoding, not the payloads, keeps a run of tiny
/// items within it too.
pub(crate) const MAX_ITEMS_BYTES: usize = 64 * 1024;

/// What a `StreamItems` frame holds besides its items, at most (the frame's own key and
/// length, the stream's id, the compression): a run of `limit - RUN_FRAME_OVERHEAD` item bytes
/// fits a frame limit of `limit`. A peer whose limit is below `MAX_ITEMS_BYTES` plus this is
/// not offered batches; a client sends runs no larger than the server's limit allows.
pub(crate) const RUN_FRAME_OVERHEAD: usize = 32;

/// Frames encoded by their sender (a stream's items of one poll) of this many bytes or more
/// are written from their own buffer rather than copied into the writer's.
const DIRECT_WRITE: usize = 32 * 1024;

/// Bytes gathered before a write is issued even if more frames are queued.
const MAX_BATCH: usize = 256 * 1024;
/// Initial capacity of the write buffer; it grows with the batches it carries and keeps its
/// size (up to `4 * MAX_BATCH`), so short-lived connections stay small.
const BUFFER: usize = 4 * 1024;

/// The queue in front of a connection's writer task. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct FrameSender {
    senders: Arc<Senders>,
    backlog: Arc<Backlog>,
}

/// Held by every [`FrameSender`] clone: when the last one goes, the writer is told so (it then
/// writes what is queued and ends, as a channel's receiver does when every sender is gone).
#[derive(Debug)]
struct Senders(Arc<Queue>);

impl Drop for Senders {
    fn drop(&mut self) {
        self.0.senders_gone.store(true, Ordering::Release);
        self.0.ready.notify_one();
    }
}

/// Frames waiting for the writer.
#[derive(Debug, Default)]
struct Queue {
    state: Mutex<QueueState>,
    /// Woken when a frame arrives in an empty queue, and when the last sender goes. A wake-up
    /// while the writer is busy is kept as a permit, so none is lost.
    ready: Notify,
    senders_gone: AtomicBool,
    /// The peer takes `StreamItems`: runs of one stream's items go in one frame.
    batches: AtomicBool,
    /// The most item bytes a run holds (see [`MAX_ITEMS_BYTES`]), once `batches` is set.
    items_cap: AtomicUsize,
}

#[derive(Debug, Default)]
struct QueueState {
    frames: VecDeque<Outgoing>,
    /// The writer has stopped: frames are refused.
    closed: bool,
    /// The message ids of the calls still queued when the queue closed: never written, not
    /// even in part, so the peer cannot have run them. Taken by [`FrameSender::close_unsent`].
    unsent: Vec<u64>,
    /// The message ids of the calls the writer has taken and not begun to write, in the order
    /// taken: a close counts them unsent, and the writer, finding the queue closed before it
    /// writes, drops them unwritten (see [`Queue::begin_write`]).
    held: Vec<u64>,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves every queued frame to the back of `into` (which the writer has emptied: a swap),
    /// the calls among them now held by the writer.
    fn take(&self, into: &mut VecDeque<Outgoing>) {
        let mut q = self.lock();
        let QueueState { frames, held, .. } = &mut *q;
        held.extend(frames.iter().filter_map(Outgoing::call_id));
        if into.is_empty() {
            std::mem::swap(&mut q.frames, into);
        } else {
            into.append(&mut q.frames);
        }
    }

    /// Puts frames taken and not encoded back at the front of the queue, before any queued
    /// since: until they are encoded they are known unsent, whoever closes the queue.
    fn put_back(&self, frames: &mut VecDeque<Outgoing>) {
        let mut q = self.lock();
        if q.closed {
            // Closed while the writer held them: the close counted them unsent.
            drop(q);
            frames.clear();
            return;
        }
        // No longer held: the last calls taken, since frames leave the writer's hands in the
        // order they came.
        let back = frames.iter().filter_map(Outgoing::call_id).count();
        let kept = q.held.len() - back;
        q.held.truncate(kept);
        // `frames` then what was queued since, as the queue (no frame moved one at a time).
        frames.append(&mut q.frames);
        std::mem::swap(&mut q.frames, frames);
    }

    /// Refuses later frames and drops those still queued, keeping the ids of the calls among
    /// them and of those the writer holds unwritten (see [`QueueState::unsent`]).
    fn close(&self) {
        let dropped = {
            let mut q = self.lock();
            q.closed = true;
            let dropped = std::mem::take(&mut q.frames);
            let ids: Vec<u64> = dropped.iter().filter_map(Outgoing::call_id).collect();
            let QueueState { unsent, held, .. } = &mut *q;
            unsent.append(held);
            unsent.extend(ids);
            dropped
        };
        drop(dropped);
    }

    /// Whether the writer may write the batch it holds: false once the queue is closed, which
    /// counted the batch's calls unsent (so the batch must not be written); true otherwise,
    /// and from here on its calls are no longer unsent, whatever becomes of the write.
    fn begin_write(&self) -> bool {
        let mut q = self.lock();
        if q.closed {
            return false;
        }
        q.held.clear();
        true
    }
}

/// What the writer is handed: a frame, or a client's call with the id it was given.
#[derive(Debug)]
pub(crate) enum Outgoing {
    Frame(Kind),
    Call(u64, Call),
    /// Whole frames, encoded by their sender (a stream's items of one poll).
    Encoded(Bytes),
}

impl Outgoing {
    /// The message id of a client's call.
    fn call_id(&self) -> Option<u64> {
        match self {
            Outgoing::Call(id, _) => Some(*id),
            _ => None,
        }
    }

    fn encode(self, dst: &mut BytesMut) {
        match self {
            Outgoing::Frame(kind) => FrameCodec::encode_kind(kind, dst),
            Outgoing::Call(id, call) => put_invoke_frame(&call.fields(id), dst),
            Outgoing::Encoded(frames) => dst.extend_from_slice(&frames),
        }
    }
}

/// Bytes queued for the writer and not yet written (an estimate: the payload and message of
/// each frame plus a fixed overhead), so that a server can stop reading from a client that does
/// not read its answers instead of queueing them without bound.
#[derive(Debug, Default)]
pub(crate) struct Backlog {
    bytes: AtomicUsize,
    /// Bytes the socket took so far, counted as each write takes them ([`sent`](Self::sent)):
    /// what a connection or a stream waiting on its client reads as the client's progress.
    sent: AtomicU64,
    /// Woken when the writer has written a batch.
    written: Notify,
    /// Every waiter is woken when the writer has written a batch or stopped (callers waiting
    /// for room in a client's send queue, stream producers waiting in [`RoomWait`]).
    room: Arc<Notify>,
    /// Cancelled when the writer has stopped: nothing queued will be written any more.
    stopped: CancellationToken,
}

impl Backlog {
    /// Bytes queued and not yet written.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes the socket took so far (it only grows), counted within a batch's write too: a
    /// peer reading a long queue slowly shows its progress here before the batch is written.
    pub(crate) fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
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

    /// Wakes every task waiting for room, to look at its connection again (the server said
    /// it is going away: calls waiting to be sent go elsewhere).
    pub(crate) fn wake_room_waiters(&self) {
        self.room.notify_waiters();
    }

    /// Whether the writer has stopped: nothing queued will be written any more.
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.is_cancelled()
    }

    /// Resolves once the writer has stopped (a write failed, or the connection closed): a
    /// reader waiting for answers to be written must not wait for ever.
    pub(crate) fn stopped(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.stopped.cancelled()
    }
}

#[cfg(test)]
impl Backlog {
    /// Sets the bytes queued and wakes whoever waits for room (for the tests of waiters).
    pub(crate) fn set_queued(&self, bytes: usize) {
        self.bytes.store(bytes, Ordering::Relaxed);
        self.room.notify_waiters();
    }
}

/// A poll function's wait for room in a connection's send queue: what a stream's producer
/// uses so that a peer that stops reading the connection (whatever windows it announced or
/// credit it granted) does not make it queue without bound. Costs nothing while there is room.
#[derive(Default)]
pub(crate) struct RoomWait {
    waiting: Option<Pin<Box<tokio::sync::futures::OwnedNotified>>>,
}

impl RoomWait {
    /// Ready once at most `max` bytes are queued unsent (or the writer stopped: nothing will
    /// be written any more, and the connection's end ends what waits).
    pub(crate) fn poll_room(
        &mut self,
        backlog: &Backlog,
        max: usize,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.waiting.is_none() && backlog.bytes() <= max {
            return std::task::Poll::Ready(());
        }
        loop {
            let wait = self
                .waiting
                .get_or_insert_with(|| Box::pin(backlog.room.clone().notified_owned()));
            // Enabled before the check: a batch written between the two wakes it.
            wait.as_mut().enable();
            if backlog.bytes() <= max || backlog.is_stopped() {
                self.waiting = None;
                return std::task::Poll::Ready(());
            }
            std::task::ready!(wait.as_mut().poll(cx));
            self.waiting = None;
        }
    }
}

/// Fixed part of a frame's estimate: the message's fields other than its variable parts.
const FIXED: usize = 64;

/// Fixed part of an attachment's estimate: its map entry's tags and lengths.
const ATTACHMENT_FIXED: usize = 8;

/// What a frame is counted as in the backlog: its variable parts plus the rest of the message.
fn estimate(frame: &Outgoing) -> usize {
    match frame {
        Outgoing::Frame(kind) => estimate_kind(kind),
        Outgoing::Call(_, c) => {
            FIXED
                + c.parameters.len()
                + c.service_entry_id.len()
                + c.attachments
                    .iter()
                    .map(|(k, v)| ATTACHMENT_FIXED + k.len() + v.len())
                    .sum::<usize>()
        }
        Outgoing::Encoded(frames) => frames.len(),
    }
}

/// [`estimate`] of a frame given as its kind.
fn estimate_kind(kind: &Kind) -> usize {
    FIXED
        + match kind {
            Kind::Result(r) => r.result.len() + r.exception_message.len(),
            Kind::Invoke(i) => i.parameters.len() + i.service_entry_id.len(),
            Kind::GoAway(g) => g.reason.len(),
            Kind::StreamItem(i) => i.payload.len(),
            Kind::StreamItems(i) => i.payloads.iter().map(|p| FIXED + p.len()).sum(),
            _ => 0,
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

    /// Queues whole frames encoded by the caller (length prefixes included) as they are;
    /// false when the connection is closed.
    pub(crate) fn send_encoded(&self, frames: Bytes) -> bool {
        self.push(Outgoing::Encoded(frames))
    }

    fn push(&self, frame: Outgoing) -> bool {
        // Counted before it can reach the writer, which subtracts it once written.
        let n = estimate(&frame);
        self.backlog.bytes.fetch_add(n, Ordering::Relaxed);
        let queue = &self.senders.0;
        let was_empty = {
            let mut q = queue.lock();
            if q.closed {
                drop(q);
                self.backlog.bytes.fetch_sub(n, Ordering::Relaxed);
                return false;
            }
            q.frames.push_back(frame);
            q.frames.len() == 1
        };
        // A queue that held frames already has its wake-up pending (or the writer draining it).
        if was_empty {
            queue.ready.notify_one();
        }
        true
    }

    /// Closes the queue (later sends fail, queued frames are dropped) and returns the message
    /// ids of the calls that were never written, not even in part: those queued when the
    /// queue closed, whether here or when the writer stopped, and those the writer had taken
    /// into a batch it had not begun to write (it then drops the batch). Calls whose frames
    /// the writer had begun to write are not among them: the peer may have read those.
    pub(crate) fn close_unsent(&self) -> Vec<u64> {
        let queue = &self.senders.0;
        queue.close();
        let ids = std::mem::take(&mut queue.lock().unsent);
        ids
    }

    /// The bytes queued behind this sender.
    pub(crate) fn backlog(&self) -> &Backlog {
        &self.backlog
    }

    /// From now on, runs of queued items of one stream are written as one `StreamItems`
    /// frame (the peer said in its handshake that it takes them) of at most `items_cap` item
    /// bytes as encoded ([`MAX_ITEMS_BYTES`] at most; an item larger than that goes alone).
    pub(crate) fn batch_stream_items(&self, items_cap: usize) {
        let queue = &self.senders.0;
        queue
            .items_cap
            .store(items_cap.min(MAX_ITEMS_BYTES), Ordering::Relaxed);
        queue.batches.store(true, Ordering::Release);
    }
}

/// Starts the writer task for `wr`: the write half of a TCP socket, or of a TLS stream.
///
/// `in_flight` counts calls whose frames are still to come (pending calls on a client, running
/// handlers on a server): when more are in flight than the batch holds and the batch is small,
/// the writer yields once before writing so that their frames share the write. At low load,
/// or with a batch of a few KiB, it writes at once.
pub(crate) fn spawn_writer<W: AsyncWrite + Abortive + Unpin + Send + 'static>(
    wr: W,
    in_flight: Arc<AtomicUsize>,
    close: CancellationToken,
) -> FrameSender {
    spawn_writer_resetting(wr, in_flight, close, false)
}

/// [`spawn_writer`] for a server's connection: it ends with a reset unless the writer closes
/// it in order once every frame is written: should the writer's task be dropped before it
/// finished (its runtime ending with the process), or the process die with no destructor run
/// (killed: the socket, set to reset on close from the start, is closed by the system). A
/// server's orderly close after its drain's `GoAway` 200 tells its client that every call
/// still unanswered was never read; ended with calls running, that would be false, and the
/// client would send a call that ran here again. (A client's orderly close says nothing of the
/// kind: its writer closes as it is dropped.)
pub(crate) fn spawn_server_writer<W: AsyncWrite + Abortive + Unpin + Send + 'static>(
    wr: W,
    in_flight: Arc<AtomicUsize>,
    close: CancellationToken,
) -> FrameSender {
    wr.reset_on_close();
    spawn_writer_resetting(wr, in_flight, close, true)
}

fn spawn_writer_resetting<W: AsyncWrite + Abortive + Unpin + Send + 'static>(
    wr: W,
    in_flight: Arc<AtomicUsize>,
    close: CancellationToken,
    reset_if_dropped: bool,
) -> FrameSender {
    let queue = Arc::new(Queue::default());
    let backlog = Arc::new(Backlog::default());
    tokio::spawn(write_loop(
        StopOnDrop(queue.clone(), backlog.clone()),
        ResetUnlessClosed {
            wr: Some(wr),
            if_dropped: reset_if_dropped,
        },
        in_flight,
        close,
    ));
    FrameSender {
        senders: Arc::new(Senders(queue)),
        backlog,
    }
}

/// A writer over one end of an in-memory pipe of `capacity` bytes, for tests: its sender and
/// the pipe's other end.
#[cfg(test)]
pub(crate) fn duplex_writer(capacity: usize) -> (FrameSender, tokio::io::DuplexStream) {
    let (ours, theirs) = tokio::io::duplex(capacity);
    let sender = spawn_writer(
        ours,
        Arc::new(AtomicUsize::new(0)),
        CancellationToken::new(),
    );
    (sender, theirs)
}

async fn write_loop<W: AsyncWrite + Abortive + Unpin>(
    ends: StopOnDrop,
    mut half: ResetUnlessClosed<W>,
    in_flight: Arc<AtomicUsize>,
    close: CancellationToken,
) {
    let wr = half.wr.as_mut().expect("held until the end");
    let complete = write_batches(&ends.0, wr, in_flight, &ends.1, close).await;
    // Later sends fail from here on.
    drop(ends);
    if !complete {
        // Frames were left unwritten (given up after the close, or the write failed): the
        // connection ends with a reset, not a close that would read as "that was all".
        if let Some(wr) = half.wr.take() {
            wr.reset();
        }
        return;
    }
    // The reader is not stopped here: after a failed write it still reads what the peer sent
    // before closing (a GoAway saying which calls it never read), then sees the close itself.
    // (Bounded: a TLS stream's shutdown writes, to a peer that may not read.)
    wr.close_in_order();
    let _ = tokio::time::timeout(CLOSE_GRACE, wr.shutdown()).await;
    // Closed in order: dropped as it is.
    half.wr = None;
}

/// A writer's end of the connection, which it closes in order once everything is written, or
/// with a reset when frames were left unwritten; `if_dropped`: with a reset too when the
/// writer's task is dropped before it finished (its runtime shut down with the process, the
/// queue perhaps holding the drain's last answers), for a server (see
/// [`spawn_server_writer`]).
struct ResetUnlessClosed<W: Abortive> {
    wr: Option<W>,
    if_dropped: bool,
}

impl<W: Abortive> Drop for ResetUnlessClosed<W> {
    fn drop(&mut self) {
        if let (Some(wr), true) = (self.wr.take(), self.if_dropped) {
            wr.reset();
        }
    }
}

/// Closes a writer's queue and tells that it stopped, when dropped: should the writer's task
/// be dropped before it ends (its runtime shut down, even before its first poll), the queue
/// still closes and the writer reads as stopped, so nothing waits for writes that will not
/// come.
struct StopOnDrop(Arc<Queue>, Arc<Backlog>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.close();
        self.1.stopped.cancel();
        self.1.room.notify_waiters();
    }
}

/// How long a write may still take once the connection is closed: the frames queued before
/// the close (a GoAway, the drain's last answers) go out to a peer that reads, and a peer
/// that stopped reading (its window shut for good) cannot hold the writer, its socket and its
/// queue after the connection ended.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Resolves [`CLOSE_GRACE`] after `close` is cancelled.
async fn closed_for_good(close: &CancellationToken) {
    close.cancelled().await;
    tokio::time::sleep(CLOSE_GRACE).await;
}

/// Writes what is queued until the connection closes or a write fails; whether everything
/// queued was written (false: frames were left, or a write did not complete).
async fn write_batches<W: AsyncWrite + Unpin>(
    queue: &Queue,
    wr: &mut W,
    in_flight: Arc<AtomicUsize>,
    backlog: &Backlog,
    close: CancellationToken,
) -> bool {
    let mut buf = BytesMut::with_capacity(BUFFER);
    // Frames taken from the queue and not encoded yet (the rest of a batch past MAX_BATCH).
    let mut frames: VecDeque<Outgoing> = VecDeque::new();
    let closing = close.cancelled();
    tokio::pin!(closing);
    loop {
        if frames.is_empty() {
            queue.take(&mut frames);
        }
        if frames.is_empty() {
            if queue.senders_gone.load(Ordering::Acquire) {
                return true;
            }
            tokio::select! {
                biased;
                _ = queue.ready.notified() => continue,
                _ = &mut closing => return true,
            }
        }
        let mut counted = 0;
        let mut encoded = 0usize;
        let mut yielded = false;
        // Frames already encoded by their sender and large enough to be written from where
        // they are, after `buf`, instead of being copied into it.
        let mut direct: Option<Bytes> = None;
        loop {
            let batches = queue.batches.load(Ordering::Acquire);
            while buf.len() < MAX_BATCH {
                let Some(frame) = frames.pop_front() else {
                    break;
                };
                counted += estimate(&frame);
                encoded += 1;
                match frame {
                    Outgoing::Frame(Kind::StreamItem(first)) if batches => {
                        let cap = queue.items_cap.load(Ordering::Relaxed);
                        counted += put_items(first, &mut frames, &mut buf, cap);
                    }
                    Outgoing::Encoded(frames) if frames.len() >= DIRECT_WRITE => {
                        direct = Some(frames);
                        break;
                    }
                    frame => frame.encode(&mut buf),
                }
            }
            if buf.len() >= MAX_BATCH || direct.is_some() {
                // The rest waits in the queue, where a close finds it unsent.
                if !frames.is_empty() {
                    queue.put_back(&mut frames);
                }
                break;
            }
            queue.take(&mut frames);
            if !frames.is_empty() {
                continue;
            }
            if !yielded
                && buf.len() < YIELD_BYTES
                && in_flight.load(Ordering::Relaxed) > encoded + YIELD_MARGIN
            {
                yielded = true;
                tokio::task::yield_now().await;
                queue.take(&mut frames);
                continue;
            }
            break;
        }
        if !queue.begin_write() {
            // Closed while the batch was gathered: its calls were reported unsent.
            return false;
        }
        // `flush` costs nothing on a TCP socket; a TLS stream may still hold the end of the
        // batch after `write_all` when the socket was full.
        let write = async {
            write_counted(&mut *wr, &buf, &backlog.sent).await?;
            if let Some(frames) = direct.take() {
                write_counted(&mut *wr, &frames, &backlog.sent).await?;
            }
            wr.flush().await
        };
        let written = tokio::select! {
            biased;
            written = write => written.is_ok(),
            () = closed_for_good(&close) => false,
        };
        if !written {
            return false;
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
}

/// `bytes` written whole (as `write_all` writes them), each part the socket takes counted in
/// `sent` as it goes.
async fn write_counted<W: AsyncWrite + Unpin>(
    wr: &mut W,
    bytes: &[u8],
    sent: &AtomicU64,
) -> std::io::Result<()> {
    let mut at = 0;
    while at < bytes.len() {
        let n = wr.write(&bytes[at..]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        at += n;
        sent.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Encodes `first` and the items of the same stream and compression right behind it in
/// `frames` (taken out of it) as one `StreamItems` frame of at most `cap` item bytes as
/// encoded, or `first` alone as a `StreamItem` when none follows; returns the backlog
/// estimate of the items taken besides `first`.
fn put_items(
    first: StreamItem,
    frames: &mut VecDeque<Outgoing>,
    buf: &mut BytesMut,
    cap: usize,
) -> usize {
    let (id, compression) = (first.message_id, first.compression);
    let same = |f: &Outgoing, bytes: usize| match f {
        Outgoing::Frame(Kind::StreamItem(i)) => {
            i.message_id == id
                && i.compression == compression
                && bytes + nested_len(i.payload.len()) <= cap
        }
        _ => false,
    };
    let mut bytes = nested_len(first.payload.len());
    if !frames.front().is_some_and(|f| same(f, bytes)) {
        put_item_frame(id, &first.payload, compression, buf);
        return 0;
    }
    let mut counted = 0;
    let mut payloads = vec![first.payload];
    while frames.front().is_some_and(|f| same(f, bytes)) {
        let Some(Outgoing::Frame(Kind::StreamItem(item))) = frames.pop_front() else {
            unreachable!("checked above")
        };
        bytes += nested_len(item.payload.len());
        counted += FIXED + item.payload.len();
        payloads.push(item.payload);
    }
    put_items_frame(id, &payloads, compression, buf);
    counted
}

#[cfg(test)]
mod tests {
    use futures_util::{FutureExt, StreamExt};
    use rpc_core::wire::Ping;
    use std::task::Poll;
    use tokio_util::codec::FramedRead;

    use super::*;

    fn ping(nonce: u64) -> Kind {
        Kind::Ping(Ping { nonce })
    }

    /// A call is counted in the send queue for at least the bytes its frame takes, its
    /// attachments included: counted without them, calls carrying a gateway's forwarded
    /// headers queued hundreds of times `max_unsent_bytes` before a caller waited.
    #[test]
    fn a_calls_estimate_covers_its_frame_attachments_included() {
        let call = Call {
            service_entry_id: "a.B.c".into(),
            parameters: Bytes::from_static(b"x"),
            attachments: (0..16)
                .map(|i| (format!("header-{i}"), "v".repeat(1024)))
                .collect(),
            ..Default::default()
        };
        let frame = crate::encode::invoke_frame_len(&call.fields(7));
        assert!(frame > 16 * 1024, "{frame}");
        assert!(
            estimate(&Outgoing::Call(7, call)) >= frame,
            "the estimate is below the frame's {frame} bytes"
        );
    }

    /// A peer that stops reading cannot hold the writer once the connection is closed: after
    /// the close and its grace, the blocked write is given up and the writer ends (its
    /// queue closed: later sends fail), though the peer still reads nothing.
    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_never_takes_is_given_up_after_the_close() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let close = CancellationToken::new();
        let queue = Arc::new(Queue::default());
        let backlog = Arc::new(Backlog::default());
        let writer = tokio::spawn(write_loop(
            StopOnDrop(queue.clone(), backlog.clone()),
            ResetUnlessClosed {
                wr: Some(ours),
                if_dropped: false,
            },
            Arc::new(AtomicUsize::new(0)),
            close.clone(),
        ));
        let sender = FrameSender {
            senders: Arc::new(Senders(queue)),
            backlog,
        };
        assert!(sender.send(Kind::GoAway(rpc_core::wire::GoAway {
            status_code: 520,
            reason: "x".repeat(4096),
            last: false,
        })));
        // Blocked on the full pipe: still there long after.
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(
            !writer.is_finished(),
            "nothing ends an open connection's write"
        );
        close.cancel();
        tokio::time::sleep(CLOSE_GRACE + Duration::from_millis(1)).await;
        tokio::time::timeout(Duration::from_secs(1), writer)
            .await
            .expect("the writer ended")
            .expect("without a panic");
        assert!(!sender.send(ping(1)), "later sends fail");
    }

    /// A writer that gives up with frames unwritten (the connection closed, the peer reads
    /// nothing) ends a TCP connection with a reset: once the peer reads again, it finds the
    /// connection broken rather than ended in order after whole frames.
    #[tokio::test(start_paused = true)]
    async fn a_writer_giving_up_with_frames_unwritten_resets_the_tcp_connection() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (peer, accepted) = tokio::join!(
            tokio::net::TcpStream::connect(listener.local_addr().unwrap()),
            listener.accept()
        );
        let (mut peer, (ours, _)) = (peer.unwrap(), accepted.unwrap());
        let (rd, wr) = ours.into_split();
        let close = CancellationToken::new();
        let sender = spawn_writer(wr, Arc::new(AtomicUsize::new(0)), close.clone());
        // 16 MiB for a peer that reads nothing: far more than the socket buffers hold.
        for status_code in 0..16 {
            assert!(sender.send(Kind::GoAway(rpc_core::wire::GoAway {
                status_code,
                reason: "x".repeat(1 << 20),
                last: false,
            })));
        }
        close.cancel();
        // After the close's grace the writer gives up, and the socket closes.
        sender.backlog().stopped().await;
        drop(rd);
        let mut buf = vec![0u8; 1 << 16];
        let end = loop {
            match peer.read(&mut buf).await {
                Ok(0) => break None,
                Ok(_) => {}
                Err(e) => break Some(e.kind()),
            }
        };
        assert_eq!(end, Some(std::io::ErrorKind::ConnectionReset));
    }

    #[tokio::test]
    async fn frames_from_many_senders_arrive_whole_and_in_each_senders_order() {
        let (sender, theirs) = duplex_writer(1 << 16);
        let tasks: Vec<_> = (0..4u64)
            .map(|t| {
                let sender = sender.clone();
                tokio::spawn(async move {
                    for i in 0..500u64 {
                        assert!(sender.send(ping(t * 1_000 + i)));
                        if i % 7 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("sender task");
        }
        // The last sender gone, the writer writes what is queued and ends: the stream ends.
        drop(sender);
        let mut frames = FramedRead::new(theirs, crate::codec::FrameCodec::new(1024));
        let mut next = [0u64; 4];
        let mut count = 0;
        while let Some(frame) = frames.next().await {
            let Kind::Ping(Ping { nonce }) = frame.expect("a whole frame") else {
                panic!("only pings were sent")
            };
            let (t, i) = ((nonce / 1_000) as usize, nonce % 1_000);
            assert_eq!(i, next[t], "sender {t}'s frames in its order");
            next[t] += 1;
            count += 1;
        }
        assert_eq!(count, 2_000);
    }

    /// Polls `future` once.
    async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
    }

    /// What the writer writes of one queued `frame` in its first poll, with `in_flight` calls
    /// in flight; polled by hand, so no scheduler decides what runs when. A writer that
    /// yields for more frames writes the frame in its next poll.
    async fn written_in_the_first_poll(frame: usize, in_flight: usize) -> usize {
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 20);
        let (queue, backlog) = (Arc::new(Queue::default()), Arc::new(Backlog::default()));
        let sender = FrameSender {
            senders: Arc::new(Senders(queue.clone())),
            backlog: backlog.clone(),
        };
        assert!(sender.send_encoded(Bytes::from(vec![7u8; frame])));
        let in_flight = Arc::new(AtomicUsize::new(in_flight));
        let writer = write_batches(
            &queue,
            &mut ours,
            in_flight,
            &backlog,
            CancellationToken::new(),
        );
        let mut writer = std::pin::pin!(writer);
        let mut read = vec![0u8; 2 * frame];
        let mut written = || {
            let now = tokio::io::AsyncReadExt::read(&mut theirs, &mut read).now_or_never();
            now.map_or(0, |n| n.expect("the pipe is open"))
        };
        assert!(
            poll_once(writer.as_mut()).await.is_pending(),
            "the writer waits"
        );
        let first = written();
        if first < frame {
            assert!(
                poll_once(writer.as_mut()).await.is_pending(),
                "the writer waits"
            );
            assert_eq!(first + written(), frame, "written in the second poll");
        }
        first
    }

    /// Small frames with many calls in flight wait one scheduler round (the writer yields),
    /// so that the frames of the calls behind them share the write; a batch of a few KiB does
    /// not wait, since its bytes cost more than the write it would share.
    #[tokio::test]
    async fn only_a_batch_of_small_frames_waits_for_the_frames_of_other_calls() {
        let many = YIELD_MARGIN + 100;
        assert_eq!(written_in_the_first_poll(64, many).await, 0);
        assert_eq!(
            written_in_the_first_poll(YIELD_BYTES, many).await,
            YIELD_BYTES
        );
        // With few calls in flight, small frames do not wait either.
        assert_eq!(written_in_the_first_poll(64, 1).await, 64);
    }

    /// More than a batch queued at once: the writer writes a batch and leaves the rest queued
    /// (where a close finds it unsent), and frames sent meanwhile come after it.
    #[tokio::test]
    async fn frames_beyond_a_batch_stay_queued_in_order_behind_the_batch() {
        let (sender, theirs) = duplex_writer(1 << 20);
        let frame = |n: u64| {
            Kind::GoAway(rpc_core::wire::GoAway {
                status_code: n as u32,
                reason: "x".repeat(16 * 1024),
                last: false,
            })
        };
        // 64 frames of 16 KiB (4 batches' worth) before the writer first runs, then 64 more
        // while it writes.
        for n in 0..64 {
            assert!(sender.send(frame(n)));
        }
        let reader = tokio::spawn(async move {
            let mut frames = FramedRead::new(theirs, crate::codec::FrameCodec::new(64 * 1024));
            let mut seen = Vec::new();
            while let Some(frame) = frames.next().await {
                let Kind::GoAway(g) = frame.expect("a whole frame") else {
                    panic!("only GoAways were sent")
                };
                seen.push(u64::from(g.status_code));
            }
            seen
        });
        for n in 64..128 {
            tokio::task::yield_now().await;
            assert!(sender.send(frame(n)));
        }
        drop(sender);
        let seen = reader.await.expect("reader");
        assert_eq!(seen, (0..128).collect::<Vec<_>>());
    }

    /// Calls still queued when the queue closes are reported unsent; once a call's frame was
    /// taken into a batch and written it is not.
    #[tokio::test]
    async fn calls_still_queued_at_the_close_are_reported_unsent() {
        let (sender, theirs) = duplex_writer(64);
        let call = || crate::call::Call {
            service_entry_id: "t.S.m".into(),
            parameters: vec![0u8; 1024].into(),
            ..Default::default()
        };
        // The first is taken and blocks on the full pipe; the others wait behind it.
        assert!(sender.send_call(1, call()));
        tokio::task::yield_now().await;
        assert!(sender.send_call(2, call()));
        assert!(sender.send_call(3, call()));
        let mut unsent = sender.close_unsent();
        unsent.sort_unstable();
        assert_eq!(unsent, [2, 3]);
        assert!(!sender.send_call(4, call()), "the queue is closed");
        drop(theirs);
    }

    /// A call the writer has taken into a batch it has not begun to write (it yields first,
    /// for the frames of the calls in flight) is unsent if the queue closes then: the writer
    /// drops the batch instead of writing it.
    #[tokio::test]
    async fn calls_taken_into_a_batch_not_yet_written_at_the_close_are_reported_unsent() {
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 20);
        let (queue, backlog) = (Arc::new(Queue::default()), Arc::new(Backlog::default()));
        let sender = FrameSender {
            senders: Arc::new(Senders(queue.clone())),
            backlog: backlog.clone(),
        };
        let call = crate::call::Call {
            service_entry_id: "t.S.m".into(),
            ..Default::default()
        };
        assert!(sender.send_call(1, call));
        let in_flight = Arc::new(AtomicUsize::new(YIELD_MARGIN + 100));
        let close = CancellationToken::new();
        let writer = write_batches(&queue, &mut ours, in_flight, &backlog, close);
        let mut writer = std::pin::pin!(writer);
        assert!(
            poll_once(writer.as_mut()).await.is_pending(),
            "the writer took the call and waits for more"
        );
        assert_eq!(sender.close_unsent(), [1]);
        assert_eq!(
            poll_once(writer.as_mut()).await,
            Poll::Ready(false),
            "the batch is dropped, unwritten"
        );
        let mut read = [0u8; 64];
        let now = tokio::io::AsyncReadExt::read(&mut theirs, &mut read).now_or_never();
        assert!(now.is_none(), "nothing was written");
    }

    /// Once the peer takes batches, each run of queued items of one stream and compression
    /// goes in one `StreamItems` frame, in order; anything else breaks the run.
    #[tokio::test]
    async fn runs_of_one_streams_items_are_written_as_one_frame_once_the_peer_takes_them() {
        use rpc_core::wire::StreamItems;
        let (sender, theirs) = duplex_writer(1 << 16);
        let item = |id: u64, text: &'static str, compression: i32| {
            Kind::StreamItem(StreamItem {
                message_id: id,
                payload: Bytes::from_static(text.as_bytes()),
                compression,
            })
        };
        // (A current-thread runtime: the writer runs only once this test waits, with all of
        // them queued.)
        for kind in [
            item(1, "a", 0),
            item(1, "b", 0),
            item(1, "c", 0),
            item(2, "x", 0),
            item(1, "d", 1),
            item(1, "e", 1),
            ping(9),
            item(1, "f", 1),
        ] {
            assert!(sender.send(kind.clone()));
        }
        sender.batch_stream_items(MAX_ITEMS_BYTES);
        drop(sender);
        let mut frames = FramedRead::new(theirs, crate::codec::FrameCodec::new(1024));
        let mut got = Vec::new();
        while let Some(frame) = frames.next().await {
            got.push(frame.expect("a whole frame"));
        }
        let items = |id: u64, texts: &[&'static str], compression: i32| {
            Kind::StreamItems(StreamItems {
                message_id: id,
                payloads: texts
                    .iter()
                    .map(|t| Bytes::from_static(t.as_bytes()))
                    .collect(),
                compression,
            })
        };
        assert_eq!(
            got,
            [
                items(1, &["a", "b", "c"], 0),
                item(2, "x", 0),
                items(1, &["d", "e"], 1),
                ping(9),
                item(1, "f", 1),
            ]
        );
    }

    /// A run's frame stays within its cap plus [`RUN_FRAME_OVERHEAD`] however small its items:
    /// the cap counts the items as encoded (key and length too), not their payloads alone.
    #[tokio::test]
    async fn a_run_of_tiny_items_stays_within_its_cap_as_encoded() {
        const CAP: usize = 4 * 1024;
        const ITEMS: usize = 3 * CAP;
        let (sender, theirs) = duplex_writer(1 << 20);
        for _ in 0..ITEMS {
            assert!(sender.send(Kind::StreamItem(StreamItem {
                message_id: 1,
                payload: Bytes::from_static(b"t"),
                compression: 0,
            })));
        }
        sender.batch_stream_items(CAP);
        drop(sender);
        // A frame over the limit is an error of the codec.
        let limit = CAP + RUN_FRAME_OVERHEAD;
        let mut frames = FramedRead::new(theirs, crate::codec::FrameCodec::new(limit));
        let mut items = 0;
        while let Some(frame) = frames.next().await {
            match frame.expect("a frame within the limit") {
                Kind::StreamItems(run) => items += run.payloads.len(),
                Kind::StreamItem(_) => items += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(items, ITEMS);
    }

    #[tokio::test]
    async fn sends_fail_once_the_writer_has_stopped() {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let close = CancellationToken::new();
        let sender = spawn_writer(ours, Arc::new(AtomicUsize::new(0)), close.clone());
        assert!(sender.send(ping(1)));
        let mut frames = FramedRead::new(theirs, crate::codec::FrameCodec::new(1024));
        assert!(matches!(frames.next().await, Some(Ok(Kind::Ping(_)))));
        close.cancel();
        // The stream ends after the queue is closed.
        assert!(frames.next().await.is_none());
        assert!(!sender.send(ping(2)), "refused once the writer has stopped");
        assert_eq!(
            sender.backlog().bytes(),
            0,
            "a refused frame is not counted"
        );
    }
}
