//! The streams a server connection serves: each stream's credit, the task that sends its items
//! while the client grants credit, and its end.
//!
//! A stream runs as a call does (a task of the connection, counted in flight, dropped by
//! `Cancel` or at the drain deadline, answered by one `RemoteResultMessage`), with one
//! difference: before its answer it sends items, and only as many as the client has granted.
//! The producer (the handler's stream) is not polled while the stream has no credit, so a
//! client that stops reading stops the handler, and the items queued for one stream never
//! exceed its window. The connection's reader only adds credit and wakes the stream: it never
//! waits for one, so a stalled stream stalls nothing else.
//!
//! A stream that takes the client's items (client streaming) has an inbound queue of the
//! server's window: the reader appends to it (an item beyond the window is the client's
//! protocol violation and ends the stream), and the handler's [`Inbound`] stream takes from it,
//! granting the client credit as it does: a frame's items are handed over under one lock with
//! one wake-up, and the handler's stream moves everything queued to its own buffer at once.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::Stream;
use rpc_core::RpcError;

use futures_util::stream::{BoxStream, StreamExt};
use futures_util::task::AtomicWaker;
use rpc_core::wire::{frame::Kind, RemoteResultMessage, StreamCredit};
use rpc_core::StatusCode;

use super::expansion::{ExpansionBudget, Unexpanded};
use super::handler::{error_result, StreamEvent, StreamEvents};
use crate::codec::FrameCodec;
use crate::encode::{finish_run_item, nested_len, put_run_frame, put_run_item, start_run_item};
use crate::flow::{Credit, Held, Taken};
use crate::own_bytes;
use crate::writer::{FrameSender, RoomWait, MAX_ITEMS_BYTES};

/// Items a stream sends in one poll before it lets other tasks run. Each poll's items go to
/// the writer together, so with one stream of small items this sets the bytes per `write`:
/// 256 items of 32 bytes (8.7 KB a write) cost the server 0.09 µs an item in
/// `scripts/stream-bench.sh`, 1024 cost 0.054 µs (about 50 µs a poll). Larger items reach
/// the byte window, or the send queue's limit, first.
const ITEMS_PER_POLL: usize = 1024;

/// How long a stream's poll goes on producing, looked at every [`TURN_CHECK`] items: a poll
/// ends after about the larger of this and [`TURN_CHECK`] items' time, so a producer that
/// takes long per item holds its worker, and the poll's first item (sent when the poll
/// returns), far less than [`ITEMS_PER_POLL`] of its items would.
const TURN: std::time::Duration = std::time::Duration::from_micros(100);

/// Items between two looks at the clock in a poll.
const TURN_CHECK: usize = 64;

/// One poll of a stream's task: the items it sent and when it began.
struct Turn {
    sent: usize,
    began: std::time::Instant,
}

impl Turn {
    fn new() -> Self {
        Turn {
            sent: 0,
            began: std::time::Instant::now(),
        }
    }

    /// Whether the poll has used its turn: [`ITEMS_PER_POLL`] items, or [`TURN`] (looked at
    /// every [`TURN_CHECK`] items).
    fn over(&self) -> bool {
        self.sent >= ITEMS_PER_POLL
            || (self.sent > 0
                && self.sent.is_multiple_of(TURN_CHECK)
                && self.began.elapsed() >= TURN)
    }
}

/// How a client broke a stream's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Violation {
    /// Items on a stream that takes none (server streaming).
    ItemsNotTaken = 1,
    /// Items after its request stream's end.
    ItemsAfterEnd,
    /// More items, or bytes, than it was granted.
    OverCredit,
    /// The end of a request stream the stream does not have (server streaming).
    EndNotTaken,
    /// A second end of its request stream.
    SecondEnd,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Violation::ItemsNotTaken => "sent stream items to a stream that takes none",
            Violation::ItemsAfterEnd => "sent stream items after its request stream's end",
            Violation::OverCredit => "sent more stream items than it was granted",
            Violation::EndNotTaken => "ended a request stream this stream does not have",
            Violation::SecondEnd => "ended its request stream twice",
        })
    }
}

/// The first [`Violation`] of a stream, once there is one.
#[derive(Debug, Default)]
pub(super) struct Violated(AtomicU8);

impl Violated {
    const ALL: [Violation; 5] = [
        Violation::ItemsNotTaken,
        Violation::ItemsAfterEnd,
        Violation::OverCredit,
        Violation::EndNotTaken,
        Violation::SecondEnd,
    ];

    /// Keeps `what` unless the stream broke the protocol before: the first break is the one
    /// said.
    fn set(&self, what: Violation) {
        let _ = self
            .0
            .compare_exchange(0, what as u8, Ordering::AcqRel, Ordering::Acquire);
    }

    fn get(&self) -> Option<Violation> {
        let v = self.0.load(Ordering::Acquire);
        Self::ALL.into_iter().find(|w| *w as u8 == v)
    }
}

/// One stream's state shared by its task, its inbound items' consumer and the connection's
/// reader.
pub(super) struct StreamSlot {
    /// Items of the client's request stream not yet taken by the handler (client streaming).
    inbound: Mutex<InboundQueue>,
    /// Items the server buffers of the client's request stream (0: it takes none).
    inbound_window: u32,
    /// Bytes the server buffers of the client's request stream (0: items only).
    inbound_window_bytes: u64,
    /// Items the client has granted in all since the stream began.
    granted: AtomicU64,
    /// The stream's task, woken when credit arrives or the client broke the protocol.
    waker: AtomicWaker,
    /// The client sent what this stream does not take: it ends with status 500.
    violated: Violated,
    /// The client's request stream failed, and the failure reached the handler (it read it)
    /// or never can (it dropped its request stream): the stream ends with that failure once
    /// its producer has nothing more ready, however long the handler would go on.
    failure_reached: AtomicBool,
    /// Whether the stream answers with items (bidirectional), which [`failure_reached`]
    /// ends early; a client stream's handler answers once, and is left to finish with the
    /// failure it read (its answer is replaced by the failure).
    ///
    /// [`failure_reached`]: Self::failure_reached
    answers_items: bool,
    /// The most bytes one of the client's items may decompress to.
    max_item_bytes: usize,
}

/// One of the client's items as it came: compressed (`compression`, its wire number) or plain
/// (0). It is decompressed when the handler takes it, so what waits is bounded by the window
/// as it travels, never by what a small compressed item may expand to.
pub(super) struct Queued {
    pub(super) payload: Bytes,
    pub(super) compression: i32,
}

/// The client's items waiting for the handler.
struct InboundQueue {
    items: VecDeque<Queued>,
    /// The client's `StreamEnd`: `Ok` when its stream is complete (taken by the handler when
    /// it reads it).
    end: Option<Result<(), RpcError>>,
    /// Whether the client's request stream ended (its `StreamEnd`, or the call's end), whether
    /// or not the handler read the end yet: no item nor end may follow.
    ended: bool,
    waker: Option<Waker>,
    /// Items (and bytes) received and not yet granted back.
    held: Held,
    /// How the client's request stream failed, if it did (its `StreamEnd` with another status
    /// than 200, an item that did not decompress or was beyond the budget): the stream then
    /// ends with that status, even when the handler answers as if it were complete.
    failed: Option<RpcError>,
    /// The handler dropped its request stream: a failure arriving later cannot reach it.
    dropped: bool,
    /// The connection ended the stream itself (its drain, the client's half-close, the
    /// client's `Cancel`): none of the stream's frames goes out any more, since its end may
    /// be queued already ("no frame of that stream follows").
    stopped: bool,
}

impl StreamSlot {
    /// The state of a stream that takes up to `inbound_window` of the client's items (0: none)
    /// and `inbound_window_bytes` of their bytes (0: items only), each decompressing to at most
    /// `max_item_bytes`.
    pub(super) fn new(
        inbound_window: u32,
        inbound_window_bytes: u64,
        max_item_bytes: usize,
    ) -> Self {
        StreamSlot {
            inbound: Mutex::new(InboundQueue {
                items: VecDeque::new(),
                end: None,
                ended: false,
                waker: None,
                stopped: false,
                held: Held::new(inbound_window, inbound_window_bytes),
                failed: None,
                dropped: false,
            }),
            inbound_window,
            inbound_window_bytes,
            granted: AtomicU64::new(0),
            waker: AtomicWaker::new(),
            violated: Violated::default(),
            failure_reached: AtomicBool::new(false),
            answers_items: false,
            max_item_bytes,
        }
    }

    /// Whether the stream owes its client nothing but its answer: a client stream (it answers
    /// once) whose request stream has ended, which can finish without the client's side of
    /// the connection, as a unary call does.
    pub(super) fn owes_only_its_end(&self) -> bool {
        self.inbound_window > 0 && !self.answers_items && self.inbound().ended
    }

    /// The stream answers with items (bidirectional): once its caller's failure reached the
    /// handler, it ends as soon as the handler has nothing more ready.
    pub(super) fn answering_items(mut self) -> Self {
        self.answers_items = true;
        self
    }

    fn inbound(&self) -> MutexGuard<'_, InboundQueue> {
        self.inbound.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Items of the client's request stream (one `StreamItem` or `StreamItems` frame's), in
    /// order, under one lock and with at most one wake-up; an item beyond the client's credit
    /// ends the stream (the items before it stay queued).
    ///
    /// Items are queued as they travel (the byte window counts that size), and decompressed
    /// when the handler takes them.
    pub(super) fn push(&self, items: impl IntoIterator<Item = Queued>) {
        let waker = {
            let mut q = self.inbound();
            if self.inbound_window == 0 || q.ended {
                drop(q);
                self.violate(if self.inbound_window == 0 {
                    Violation::ItemsNotTaken
                } else {
                    Violation::ItemsAfterEnd
                });
                return;
            }
            let q = &mut *q;
            for item in items {
                if !q.held.admit(item.payload.len()) {
                    let waker = q.waker.take();
                    self.violated.set(Violation::OverCredit);
                    self.waker.wake();
                    if let Some(w) = waker {
                        w.wake();
                    }
                    return;
                }
                q.items.push_back(Queued {
                    payload: own_bytes(item.payload),
                    compression: item.compression,
                });
            }
            q.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The end of the client's request stream (`StreamEnd`): 200 complete, else its failure.
    pub(super) fn finish(&self, end: rpc_core::wire::StreamEnd) {
        if self.inbound_window == 0 {
            self.violate(Violation::EndNotTaken);
            return;
        }
        let waker = {
            let mut q = self.inbound();
            if q.ended {
                // A second end: nothing of the stream may follow its end.
                drop(q);
                self.violate(Violation::SecondEnd);
                return;
            }
            q.ended = true;
            q.end = Some(if end.status_code == StatusCode::Success.as_u32() {
                Ok(())
            } else {
                let failed = RpcError::new(
                    StatusCode::from_u32(end.status_code),
                    format!(
                        "the caller's request stream failed: {}",
                        end.exception_message
                    ),
                );
                q.failed = Some(failed.clone());
                Err(failed)
            });
            if q.dropped && q.failed.is_some() {
                drop(q);
                self.reach_failure();
                return;
            }
            q.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The caller's failure reached the handler, or never can: the stream's task is woken to
    /// end the stream with it once its producer has nothing more ready.
    fn reach_failure(&self) {
        self.failure_reached.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// The failure the stream ends with now, if its caller's request stream failed and the
    /// failure reached the handler (see [`failure_reached`](Self::failure_reached)).
    fn reached_failure(&self) -> Option<RpcError> {
        if self.answers_items && self.failure_reached.load(Ordering::Acquire) {
            self.failed()
        } else {
            None
        }
    }

    /// The stream's task ended (its answer sent, `Cancel`, the deadline, the connection's
    /// end): the client's request stream ends with it. Code of the handler still reading it
    /// (a task of its own) takes the items already queued, then an error, instead of waiting
    /// for ever; and no more credit is granted for a stream that is over.
    pub(super) fn close(&self) {
        self.close_with(
            "the call ended before the caller's request stream did; no more of its items will \
             come",
        );
    }

    /// The connection ends the stream (see [`InboundQueue::stopped`]): its task, which may be
    /// in a poll on another thread, queues no frame of it from now on; the client's request
    /// stream ends as with [`close`](Self::close).
    pub(super) fn stop(&self) {
        self.inbound().stopped = true;
        self.close();
    }

    /// Runs `queue` (which queues frames of the stream) unless the connection has stopped
    /// the stream: under the lock [`stop`](Self::stop) takes, so that none is queued after
    /// the end the connection queues once it has stopped the stream.
    fn unless_stopped(&self, queue: impl FnOnce()) {
        let q = self.inbound();
        if !q.stopped {
            queue();
        }
    }

    /// Ends the client's request stream with `why`, as [`close`](Self::close) does.
    pub(super) fn close_with(&self, why: &str) {
        let waker = {
            let mut q = self.inbound();
            if q.ended {
                return;
            }
            q.ended = true;
            q.end = Some(Err(RpcError::new(StatusCode::CommunicationError, why)));
            q.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// How the client's request stream failed, if it did.
    fn failed(&self) -> Option<RpcError> {
        self.inbound().failed.clone()
    }

    /// Credit from the client (`StreamCredit`).
    pub(super) fn grant(&self, items: u32) {
        self.granted.fetch_add(u64::from(items), Ordering::AcqRel);
        self.waker.wake();
    }

    /// The client sent a frame this stream does not take: the stream ends with an error.
    pub(super) fn violate(&self, what: Violation) {
        self.violated.set(what);
        self.waker.wake();
        let waker = self.inbound().waker.take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The client's request stream as the handler takes it: its items in order, then its end.
/// Taking items grants the client credit for more.
pub(super) struct Inbound {
    id: u64,
    slot: Arc<StreamSlot>,
    sender: FrameSender,
    /// Items moved out of the shared queue, taken from here without locking.
    local: VecDeque<Queued>,
    /// What the handler took since credit was last granted.
    taken: Taken,
    /// The server's budget for decompressed bytes, which a compressed item's expansion takes
    /// from as a compressed call's does.
    expansion: ExpansionBudget,
    done: bool,
}

impl Inbound {
    pub(super) fn new(
        id: u64,
        slot: Arc<StreamSlot>,
        sender: FrameSender,
        expansion: ExpansionBudget,
    ) -> Self {
        let taken = Taken::new(slot.inbound_window, slot.inbound_window_bytes);
        Inbound {
            id,
            slot,
            sender,
            local: VecDeque::new(),
            taken,
            expansion,
            done: false,
        }
    }
}

impl Stream for Inbound {
    type Item = Result<Bytes, RpcError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(item) = this.local.pop_front() {
            return Poll::Ready(Some(this.take(item)));
        }
        let next = {
            let mut q = this.slot.inbound();
            if !q.items.is_empty() {
                // Everything queued at once; the shared queue keeps the emptied buffer.
                std::mem::swap(&mut q.items, &mut this.local);
                drop(q);
                let item = this.local.pop_front().expect("just moved");
                return Poll::Ready(Some(this.take(item)));
            } else if let Some(what) = this.slot.violated.get() {
                Some(Err(RpcError::new(
                    StatusCode::FrameworkError,
                    format!("protocol violation: the caller {what}"),
                )))
            } else if let Some(end) = q.end.take() {
                if end.is_err() && q.failed.is_some() {
                    drop(q);
                    this.slot.reach_failure();
                }
                end.err().map(Err)
            } else {
                match &q.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => q.waker = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            }
        };
        this.done = true;
        Poll::Ready(next)
    }
}

impl Drop for Inbound {
    /// The handler let go of its request stream: a failure of the caller's, come or to come,
    /// cannot reach it, and ends the stream instead.
    fn drop(&mut self) {
        let mut q = self.slot.inbound();
        q.dropped = true;
        let failed = q.failed.is_some();
        drop(q);
        if failed {
            self.slot.reach_failure();
        }
    }
}

impl Inbound {
    /// The handler takes `item`: counted as taken, and decompressed, holding what it gained
    /// by it from the server's expansion budget until its last bytes are dropped (as a
    /// compressed call's arguments do). One that does not decompress (within the item limit),
    /// or is beyond what is left of the budget, ends the client's request stream with 500.
    fn take(&mut self, item: Queued) -> Result<Bytes, RpcError> {
        self.took(item.payload.len());
        if item.compression == 0 {
            return Ok(item.payload);
        }
        let limit = self.slot.max_item_bytes;
        match self
            .expansion
            .expand(item.compression, &item.payload, limit)
        {
            Ok(plain) => Ok(plain),
            Err(Unexpanded::Corrupt(e)) => Err(self.fail(RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "the caller's request stream failed: stream item {}: {e}; the stream was \
                     ended: send items that decompress within the server's frame limit",
                    self.id
                ),
            ))),
            // 500, not 515: the stream was accepted and the handler may have acted on items
            // already, while 515 says that nothing ran.
            Err(Unexpanded::OverBudget { size, .. }) => Err(self.fail(RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "the caller's request stream was ended: an item decompresses to {size} \
                     bytes, more than is left of the server's budget for decompressed payloads; \
                     retry later or elsewhere, or send the items uncompressed"
                ),
            ))),
        }
    }

    /// The client's request stream failed with `error`: no more items are taken, and the
    /// stream ends with it (see [`StreamSlot::failed`]).
    fn fail(&mut self, error: RpcError) -> RpcError {
        self.done = true;
        let mut q = self.slot.inbound();
        if q.failed.is_none() {
            q.failed = Some(error.clone());
        }
        drop(q);
        self.slot.reach_failure();
        error
    }

    /// Counts an item of `len` bytes taken, granting the client credit when it is time (and
    /// the client's stream goes on).
    fn took(&mut self, len: usize) {
        let Some(items) = self.taken.take(len) else {
            return;
        };
        let mut q = self.slot.inbound();
        q.held.release(items);
        // Queued under the lock: the stream's end closes the queue under it before its answer
        // is queued, so no credit of the stream follows its end on the wire.
        if !q.ended {
            self.sender.send(Kind::StreamCredit(StreamCredit {
                message_id: self.id,
                items: u32::try_from(items).unwrap_or(u32::MAX),
            }));
        }
    }
}

/// The streams open on one connection, by `message_id`.
#[derive(Default)]
pub(super) struct StreamTable {
    slots: Mutex<HashMap<u64, Arc<StreamSlot>, ahash::RandomState>>,
}

impl StreamTable {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<StreamSlot>, ahash::RandomState>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether no stream is open now.
    pub(super) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The open stream `id`, if there is one.
    pub(super) fn get(&self, id: u64) -> Option<Arc<StreamSlot>> {
        self.lock().get(&id).cloned()
    }

    /// Registers the state of stream `id` before its task exists (a stream taking the
    /// client's items: they may arrive before the handler is set up).
    pub(super) fn open(&self, id: u64, slot: Arc<StreamSlot>) {
        self.lock().insert(id, slot);
    }

    /// Removes stream `id` if its state is `slot` (a stream refused before its task ran).
    pub(super) fn close(&self, id: u64, slot: &Arc<StreamSlot>) {
        let mut slots = self.lock();
        if slots.get(&id).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            slots.remove(&id);
        }
    }
}

/// What a stream's task takes its events from.
pub(super) enum Events {
    /// Items as their own buffers.
    Plain(BoxStream<'static, StreamEvent>),
    /// Items appended straight into the run being assembled, where the events can.
    Into(Pin<Box<dyn StreamEvents>>),
}

impl From<BoxStream<'static, StreamEvent>> for Events {
    fn from(events: BoxStream<'static, StreamEvent>) -> Self {
        Events::Plain(events)
    }
}

/// The task of one stream: sends `StreamCredit` when the stream is accepted, then its items
/// within the client's credit; its output is the stream's end, which the connection sends as
/// the call's answer. Dropping it (on `Cancel`, when the connection ends) drops the producer.
pub(super) struct StreamDriver {
    id: u64,
    events: Events,
    slot: Arc<StreamSlot>,
    table: Arc<StreamTable>,
    sender: FrameSender,
    accepted: bool,
    /// The credit granted to the client's items when the stream is accepted (0: the stream
    /// takes none).
    inbound_window: u32,
    /// What the client's credit allows this stream to send.
    credit: Credit,
    /// The client's window of items: its credit never goes above it.
    client_window: u64,
    /// The client's grants counted into `credit` so far (of the slot's `granted`).
    acked: u64,
    /// The client granted back more items than it was sent: the stream ends with 500.
    over_granted: bool,
    /// The most bytes the connection's send queue may hold before the stream produces more
    /// (`ServerOptions::max_unsent_bytes`), and the wait for it.
    max_unsent: usize,
    room: RoomWait,
    /// How long a stream whose caller sent no deadline (or of plain events, which cannot end
    /// themselves at their deadline) may wait on its client (no credit, or no room in the
    /// connection's send queue) with no progress; none for one whose events end it at its
    /// deadline, or when the server's idle timeout is 0. A client that never takes
    /// what it asked for would otherwise hold the stream, its slot under the server's cap and
    /// its connection for ever.
    stall_limit: Option<Duration>,
    /// The wait's timer (made once, re-armed) and what it waits on, if it runs.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    stalled: Option<Stalled>,
    /// The caller's failure had reached the handler before the producer was last polled (see
    /// [`StreamSlot::failure_reached`]), and the waits (for credit, room or a turn) since.
    failure_seen: bool,
    waits_after_failure: u8,
    out: Out,
}

/// The frames a stream's task assembles in one poll, and the run of items the next frame will
/// carry.
struct Out {
    id: u64,
    /// The frames of the current poll, encoded here and queued for the writer together when
    /// the poll returns: one pass of the writer's lock and one wake-up per poll instead of one
    /// per item, and each item's payload is dropped by the task that made it.
    frames: BytesMut,
    /// The client takes `StreamItems`: consecutive items go in `run`, written as one frame
    /// (else each item is a frame of its own).
    batches: bool,
    /// `run_items` items waiting to be written as one frame, all compressed with
    /// `run_compression`, as the frame's field 2 holds them: each item's key, length and
    /// bytes. Kept across polls, so the items of a stream need no allocation of their own.
    run: BytesMut,
    run_items: usize,
    run_compression: i32,
    /// Bytes held for the length of the next item encoded in place: the size of the last
    /// one's, so that items of one size are never moved.
    length_width: usize,
}

impl Out {
    /// Bytes this poll made that are not in the connection's send queue yet.
    fn pending(&self) -> usize {
        self.frames.len() + self.run.len()
    }

    /// Adds an item to this poll's frames.
    fn put_item(&mut self, payload: &[u8], compression: i32) {
        // `run` holds its items as the frame encodes them: at most MAX_ITEMS_BYTES of them
        // with more than one item.
        if self.run_items > 0
            && (compression != self.run_compression
                || self.run.len() + nested_len(payload.len()) > MAX_ITEMS_BYTES)
        {
            self.end_run();
        }
        put_run_item(&mut self.run, payload);
        self.added(compression);
    }

    /// Counts the item just added to `run` (compressed with `compression`) and ends the run
    /// when the client takes one item per frame.
    fn added(&mut self, compression: i32) {
        self.run_items += 1;
        self.run_compression = compression;
        if !self.batches {
            self.end_run();
        }
    }

    /// Counts the item appended to `run` at `mark` in place, first writing the items before it
    /// as a frame when it does not belong in their run (another compression, or too many
    /// bytes).
    fn added_in_place(&mut self, mark: usize) {
        if self.run_items > 0 && (self.run_compression != 0 || self.run.len() > MAX_ITEMS_BYTES) {
            put_run_frame(
                self.id,
                self.run_items,
                &self.run[..mark],
                self.run_compression,
                &mut self.frames,
            );
            let end = self.run.len();
            self.run.copy_within(mark..end, 0);
            self.run.truncate(end - mark);
            self.run_items = 0;
        }
        self.added(0);
    }

    /// Writes the items of `run` as one frame (one item alone as a `StreamItem`).
    fn end_run(&mut self) {
        if self.run_items > 0 {
            put_run_frame(
                self.id,
                self.run_items,
                &self.run,
                self.run_compression,
                &mut self.frames,
            );
        }
        self.run.clear();
        self.run_items = 0;
    }
}

/// Where a stream's plain items go, one after the other, while the client's credit and the
/// task's turn last: straight into the run of items its next frame carries
/// ([`StreamEvents::poll_items_into`]). Each item is begun ([`begin`](Self::begin): its key
/// and room for its length are written), its bytes appended to the buffer it returns, then
/// committed with its length or abandoned.
pub struct ItemSink<'a> {
    out: &'a mut Out,
    credit: &'a mut Credit,
    violated: &'a Violated,
    /// This poll's items and start.
    turn: &'a mut Turn,
    /// The bytes this poll may queue before the connection's send queue is over its limit.
    room: usize,
    /// Where the item begun last starts in the run, while it is not committed.
    begun: Option<usize>,
}

impl ItemSink<'_> {
    /// Whether one more item may be added now: the client has credit for it, the task has
    /// not used its turn, the connection's send queue has room (the item may take it past
    /// its limit), and the stream was not broken.
    pub fn has_room(&self) -> bool {
        self.credit.ready()
            && !self.turn.over()
            && self.out.pending() <= self.room
            && self.violated.get().is_none()
    }

    /// Begins an item: the buffer to append its bytes to (and nothing else).
    pub fn begin(&mut self) -> &mut BytesMut {
        self.abandon();
        self.begun = Some(start_run_item(&mut self.out.run, self.out.length_width));
        &mut self.out.run
    }

    /// The item begun last is complete: its `len` bytes follow what [`begin`](Self::begin)
    /// wrote.
    pub fn commit(&mut self, len: usize) {
        let Some(mark) = self.begun.take() else {
            return;
        };
        let out = &mut *self.out;
        out.length_width = finish_run_item(&mut out.run, mark, out.length_width, len);
        out.added_in_place(mark);
        self.credit.sent(len);
        self.turn.sent += 1;
    }

    /// Drops the item begun last and whatever was appended for it (when it was not
    /// committed).
    pub fn abandon(&mut self) {
        if let Some(mark) = self.begun.take() {
            self.out.run.truncate(mark);
        }
    }
}

impl Drop for ItemSink<'_> {
    fn drop(&mut self) {
        self.abandon();
    }
}

impl StreamDriver {
    /// The task of stream `id`, whose client buffers `client_window` items and
    /// `client_window_bytes` bytes (0: items only) and takes `StreamItems` when `batches`, with
    /// its state `slot` (already registered in `table` when the stream takes the client's
    /// items, and registered now otherwise), removed from `table` when it ends.
    pub(super) fn new(
        id: u64,
        events: impl Into<Events>,
        (client_window, client_window_bytes, batches): (u32, u64, bool),
        slot: Option<Arc<StreamSlot>>,
        table: &Arc<StreamTable>,
        (sender, max_unsent, stall_limit): (FrameSender, usize, Option<Duration>),
    ) -> Self {
        let slot = slot.unwrap_or_else(|| {
            let slot = Arc::new(StreamSlot::new(0, 0, 0));
            table.lock().insert(id, slot.clone());
            slot
        });
        StreamDriver {
            id,
            events: events.into(),
            inbound_window: slot.inbound_window,
            credit: Credit::new(u64::from(client_window.max(1)), client_window_bytes),
            client_window: u64::from(client_window.max(1)),
            acked: 0,
            over_granted: false,
            max_unsent,
            room: RoomWait::default(),
            stall_limit,
            stall: None,
            stalled: None,
            failure_seen: false,
            waits_after_failure: 0,
            slot,
            table: table.clone(),
            sender,
            accepted: false,
            out: Out {
                id,
                frames: BytesMut::new(),
                batches,
                run: BytesMut::new(),
                run_items: 0,
                run_compression: 0,
                length_width: 1,
            },
        }
    }

    /// The next event; once the stream is accepted (its credit frame goes first), plain items
    /// are appended to the run in place, as many as fit ([`StreamEvent::Appended`]).
    fn next_event(&mut self, cx: &mut Context<'_>, turn: &mut Turn) -> Poll<Option<StreamEvent>> {
        match &mut self.events {
            Events::Plain(events) => events.poll_next_unpin(cx),
            Events::Into(events) if !self.accepted => events.as_mut().poll_next(cx),
            Events::Into(events) => {
                let room = self
                    .max_unsent
                    .saturating_sub(self.sender.backlog().bytes());
                let mut sink = ItemSink {
                    out: &mut self.out,
                    credit: &mut self.credit,
                    violated: &self.slot.violated,
                    turn,
                    room,
                    begun: None,
                };
                events.as_mut().poll_items_into(cx, &mut sink)
            }
        }
    }

    /// Counts the client's grants that arrived since the last look into the credit.
    fn sync_credit(&mut self) {
        let granted = self.slot.granted.load(Ordering::Acquire);
        if granted > self.acked {
            let items = granted - self.acked;
            self.acked = granted;
            // A grant gives back items the client was sent: never past its window.
            if self.credit.items().saturating_add(items) > self.client_window {
                self.over_granted = true;
                return;
            }
            self.credit.grant(items);
        }
    }

    fn accept(&mut self) {
        self.accepted = true;
        // In this poll's frames, ahead of the items: the client must see the stream accepted
        // first.
        self.out.end_run();
        FrameCodec::encode_kind(
            Kind::StreamCredit(StreamCredit {
                message_id: self.id,
                items: self.inbound_window,
            }),
            &mut self.out.frames,
        );
    }

    /// One poll's frames and end, before the batch goes to the writer.
    fn poll_items(&mut self, cx: &mut Context<'_>) -> Poll<RemoteResultMessage> {
        let this = self;
        let mut turn = Turn::new();
        // Woken by the client's frames whatever the stream waits on (credit or its producer):
        // a violation ends it at once, not when the producer next yields.
        this.slot.waker.register(cx.waker());
        // A grant is looked at as it comes, credit left or not: one for more items than the
        // client was sent ends the stream even while the producer keeps credit in hand.
        if this.accepted {
            this.sync_credit();
        }
        loop {
            if let Some(what) = this.slot.violated.get() {
                return Poll::Ready(error_result(
                    StatusCode::FrameworkError,
                    format!("protocol violation: the client {what}; the stream was ended"),
                ));
            }
            if this.over_granted {
                return Poll::Ready(error_result(
                    StatusCode::FrameworkError,
                    "protocol violation: the client granted credit for more items than it was \
                     sent; the stream was ended",
                ));
            }
            // No credit, no poll: the producer waits until the client grants more, or its
            // deadline passes.
            if this.accepted && !this.credit.ready() {
                this.sync_credit();
                if !this.credit.ready() {
                    this.slot.waker.register(cx.waker());
                    this.sync_credit();
                    if !this.credit.ready()
                        && !this.over_granted
                        && this.slot.violated.get().is_none()
                    {
                        if let Events::Into(events) = &mut this.events {
                            if let Poll::Ready(end) = events.as_mut().poll_ended(cx) {
                                return Poll::Ready(end);
                            }
                        }
                        let on = this.credit_wait();
                        if let Poll::Ready(end) = this.poll_stalled(cx, on) {
                            return Poll::Ready(end);
                        }
                        if let Some(end) = this.waited_after_failure() {
                            return Poll::Ready(end);
                        }
                        return Poll::Pending;
                    }
                }
                // Credit came: the client's progress.
                this.stalled = None;
                continue;
            }
            if turn.over() {
                if let Some(end) = this.waited_after_failure() {
                    return Poll::Ready(end);
                }
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            // Nothing more is produced while the connection's send queue (with what this poll
            // made) is over its limit: a client that stops reading its socket holds the
            // producer there, whatever windows it announced. Its deadline still ends it.
            let pending = this.out.pending();
            if pending > 0 && pending >= this.max_unsent {
                if let Some(end) = this.waited_after_failure() {
                    return Poll::Ready(end);
                }
                // The next poll waits for the queue, once this poll's frames are in it.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let backlog = this.sender.backlog();
            if backlog.is_stopped() {
                // Nothing more of the stream can be written: it ends (the connection's end
                // ends its other calls too).
                return Poll::Ready(error_result(
                    StatusCode::CommunicationError,
                    "the connection's writer stopped: the stream cannot go on",
                ));
            }
            if this
                .room
                .poll_room(backlog, this.max_unsent - pending, cx)
                .is_pending()
            {
                if let Events::Into(events) = &mut this.events {
                    if let Poll::Ready(end) = events.as_mut().poll_ended(cx) {
                        return Poll::Ready(end);
                    }
                }
                let sent = this.sender.backlog().sent();
                if let Poll::Ready(end) = this.poll_stalled(cx, Stalled::Room(sent)) {
                    return Poll::Ready(end);
                }
                if let Some(end) = this.waited_after_failure() {
                    return Poll::Ready(end);
                }
                return Poll::Pending;
            }
            // Neither credit nor room is waited for: no stall.
            this.stalled = None;
            // Read before the producer is polled: what it has ready then was made before the
            // failure reached the handler, and goes first.
            if !this.failure_seen && this.slot.reached_failure().is_some() {
                this.failure_seen = true;
            }
            match this.next_event(cx, &mut turn) {
                // The handler has nothing more ready after the caller's failure reached it:
                // the stream ends with that failure, even if the handler would go on.
                Poll::Pending => {
                    return match this.slot.reached_failure().filter(|_| this.failure_seen) {
                        Some(failed) => Poll::Ready(error_result(failed.code(), failed.message())),
                        None => Poll::Pending,
                    };
                }
                Poll::Ready(Some(StreamEvent::Accepted)) => {
                    if !this.accepted {
                        this.accept();
                    }
                }
                Poll::Ready(Some(item @ (StreamEvent::Item(_) | StreamEvent::Packed(..)))) => {
                    if !this.accepted {
                        this.accept();
                    }
                    let Some((payload, compression)) = item.into_item() else {
                        unreachable!("an item")
                    };
                    this.credit.sent(payload.len());
                    this.out.put_item(&payload, compression);
                    turn.sent += 1;
                }
                // (Counted as they were appended, through the sink.)
                Poll::Ready(Some(StreamEvent::Appended(_))) => {}
                Poll::Ready(Some(StreamEvent::End(end))) => return Poll::Ready(*end),
                Poll::Ready(None) => {
                    return Poll::Ready(RemoteResultMessage {
                        status_code: StatusCode::Success.as_u32(),
                        ..Default::default()
                    })
                }
            }
        }
    }

    fn end_run(&mut self) {
        self.out.end_run();
    }

    /// The stream waits (for credit, room or its next turn) after the caller's failure
    /// reached the handler: at the second such wait it ends with that failure. A handler that
    /// is always ready would otherwise never end, and one wait lets what it made before the
    /// failure (up to a window, or a turn) go first.
    fn waited_after_failure(&mut self) -> Option<RemoteResultMessage> {
        if !self.failure_seen {
            return None;
        }
        self.waits_after_failure = self.waits_after_failure.saturating_add(1);
        if self.waits_after_failure < 2 {
            return None;
        }
        let failed = self.slot.reached_failure()?;
        Some(error_result(failed.code(), failed.message()))
    }

    /// What a wait for credit is now: while the connection's send queue is over its limit, the
    /// server reads none of the client's frames (its credit among them), so the client's
    /// progress is then the bytes of the connection it takes.
    fn credit_wait(&self) -> Stalled {
        let backlog = self.sender.backlog();
        Stalled::Credit((backlog.bytes() > self.max_unsent).then(|| backlog.sent()))
    }

    /// The stream waits on its client (`on`): its end once it has waited the stall limit
    /// with no progress. Waiting for credit, only this stream's credit is progress (and ends
    /// the wait); the connection's other traffic (a heartbeat's `Pong`, other streams) says
    /// nothing of this stream's consumer, except while the server reads nothing of the client
    /// (see [`credit_wait`](Self::credit_wait)). Waiting for room in the send queue, any byte of the
    /// connection's the client took re-arms the wait (a write in part counts: one batch of a
    /// large frame, read slowly, may take longer than the limit to complete).
    fn poll_stalled(&mut self, cx: &mut Context<'_>, on: Stalled) -> Poll<RemoteResultMessage> {
        let Some(limit) = self.stall_limit else {
            return Poll::Pending;
        };
        let mut on = on;
        loop {
            if self.stalled != Some(on) {
                // The wait begins, or the client took something since it was armed.
                self.stalled = Some(on);
                let at = tokio::time::Instant::now() + limit;
                match &mut self.stall {
                    Some(stall) => stall.as_mut().reset(at),
                    None => self.stall = Some(Box::pin(tokio::time::sleep_until(at))),
                }
            }
            let Some(stall) = &mut self.stall else {
                return Poll::Pending;
            };
            if stall.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = match on {
                Stalled::Room(_) => Stalled::Room(self.sender.backlog().sent()),
                Stalled::Credit(_) => self.credit_wait(),
            };
            if now != on {
                on = now;
                continue;
            }
            let what = match on {
                Stalled::Credit(_) => "granted no credit",
                Stalled::Room(_) => "read nothing of its connection",
            };
            return Poll::Ready(error_result(
                StatusCode::Timeout,
                format!(
                    "the client {what} for {} ms (the server's idle timeout) while the stream \
                     waited on it: the stream was ended",
                    limit.as_millis()
                ),
            ));
        }
    }
}

/// What a stream with a stall limit waits on its client for ([`StreamDriver::poll_stalled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stalled {
    /// Credit for its next item; with the bytes of the connection written when the wait was
    /// armed while the server reads nothing (its send queue over the limit, the credit perhaps
    /// unread): a byte written since then is the client's progress.
    Credit(Option<u64>),
    /// Room in the connection's send queue, with the bytes of the connection written when
    /// the wait was armed: a byte written since then is the client's progress.
    Room(u64),
}

impl Future for StreamDriver {
    type Output = RemoteResultMessage;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RemoteResultMessage> {
        let this = &mut *self;
        let mut outcome = this.poll_items(cx);
        // A stream whose caller's request stream failed ends with that failure, even when the
        // handler answers as if it were complete (RPC.proto: the server ends the stream with
        // the client's status).
        if let Poll::Ready(end) = &mut outcome {
            if end.status_code == StatusCode::Success.as_u32() && this.inbound_window > 0 {
                if let Some(failed) = this.slot.failed() {
                    *end = error_result(failed.code(), failed.message());
                }
            }
        }
        // The client's request stream ends here, before the end is queued: a handler still
        // reading it in a task of its own grants no credit after the stream's end.
        if outcome.is_ready() {
            this.slot.close();
        }
        // Whatever the outcome: the items go before the end, which the connection sends once
        // this returns Ready.
        this.end_run();
        if !this.out.frames.is_empty() {
            let frames = this.out.frames.split().freeze();
            let sender = &this.sender;
            this.slot.unless_stopped(|| {
                sender.send_encoded(frames);
            });
        }
        // (An end that cannot be written, its connection's writer having stopped, is not
        // settled: the stream was stopped with its connection.)
        if let (Poll::Ready(end), Events::Into(events)) = (&outcome, &mut this.events) {
            if !this.sender.backlog().is_stopped() {
                events.as_mut().settled(end);
            }
        }
        outcome
    }
}

impl Drop for StreamDriver {
    fn drop(&mut self) {
        self.table.close(self.id, &self.slot);
        self.slot.close();
    }
}

#[cfg(test)]
mod tests {
    /// A stream that broke the protocol more than once says how it broke it first.
    #[test]
    fn the_first_violation_is_the_one_said() {
        let v = Violated::default();
        assert_eq!(v.get(), None);
        for what in Violated::ALL {
            let v = Violated::default();
            v.set(what);
            assert_eq!(v.get(), Some(what));
        }
        v.set(Violation::ItemsAfterEnd);
        v.set(Violation::SecondEnd);
        assert_eq!(v.get(), Some(Violation::ItemsAfterEnd));
        assert_eq!(
            Violation::SecondEnd.to_string(),
            "ended its request stream twice"
        );
    }

    use std::sync::atomic::AtomicUsize;

    use bytes::Bytes;
    use futures_util::stream;

    use super::*;
    use crate::writer::duplex_writer;
    use crate::COPY_QUEUED_BELOW;

    /// A poll's turn ends after ITEMS_PER_POLL items, or once TURN has passed at a look at the
    /// clock (every TURN_CHECK items), whichever comes first.
    #[test]
    fn a_polls_turn_ends_at_its_item_count_or_its_time() {
        let long_ago = std::time::Instant::now() - 2 * TURN;
        let turn = |sent, began| Turn { sent, began };
        assert!(!turn(0, long_ago).over(), "no item yet");
        assert!(
            !turn(TURN_CHECK - 1, long_ago).over(),
            "not a look at the clock"
        );
        assert!(turn(TURN_CHECK, long_ago).over(), "a look, after the time");
        // Begun in the future: no time has passed at the look, however slow this thread is.
        let ahead = std::time::Instant::now() + std::time::Duration::from_secs(60);
        assert!(!turn(TURN_CHECK, ahead).over(), "a look, in time");
        assert!(turn(ITEMS_PER_POLL, std::time::Instant::now()).over());
    }

    /// A small item waits in a buffer of its own, not in a slice of the connection's read
    /// buffer (which it would keep whole); a large one is not copied.
    #[test]
    fn small_queued_items_do_not_keep_the_read_buffer() {
        let read = Bytes::from(vec![7u8; crate::READ_BUFFER]);
        let within = |b: &Bytes| crate::lies_in(&read, b);
        let slot = StreamSlot::new(8, 0, 1 << 20);
        slot.push([
            Queued {
                payload: read.slice(10..42),
                compression: 0,
            },
            Queued {
                payload: read.slice(..COPY_QUEUED_BELOW + 1),
                compression: 0,
            },
        ]);
        let q = slot.inbound();
        assert_eq!(q.items[0].payload, read.slice(10..42));
        assert!(!within(&q.items[0].payload), "the small item was copied");
        assert!(
            within(&q.items[1].payload),
            "the large one shares the buffer"
        );
    }

    /// A compressed item of the client's request stream takes what it gains by decompression
    /// from the server's budget while the handler holds it, as a compressed call does: one
    /// more beyond what is left ends the stream with 500, and the share comes back when the
    /// item is dropped.
    #[tokio::test]
    async fn compressed_stream_items_hold_their_expansion_from_the_servers_budget() {
        use futures_util::StreamExt as _;
        const KIB: usize = 1024;
        let (sender, _theirs) = duplex_writer(1 << 20);
        // One frame of 64 KiB: the least a budget can be.
        let budget = ExpansionBudget::new(64 * KIB, 64 * KIB);
        let item = crate::compression::compress(rpc_core::Compression::Zstd, &[0u8; 48 * KIB]);
        assert!(item.len() < KIB);
        let inbound = |id| {
            let slot = Arc::new(StreamSlot::new(8, 0, 64 * KIB));
            slot.push((0..2).map(|_| Queued {
                payload: item.clone(),
                compression: rpc_core::Compression::Zstd.to_wire(),
            }));
            Inbound::new(id, slot, sender.clone(), budget.clone())
        };
        let mut first = inbound(1);
        let held = first
            .next()
            .await
            .expect("an item")
            .expect("within the budget");
        assert_eq!(held.len(), 48 * KIB);
        let e = first
            .next()
            .await
            .expect("an item")
            .expect_err("48 KiB held, 16 KiB left: the second is refused");
        assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
        assert!(e.message().contains("budget"), "{e}");
        assert!(first.next().await.is_none(), "the stream ended");
        drop(held);
        let mut second = inbound(2);
        let again = second.next().await.expect("an item");
        let again = again.expect("the share came back");
        assert_eq!(again.len(), 48 * KIB);
        // With the budget held, an item whose header says 48 KiB is refused by that size
        // before it is decompressed: its body, no LZ4 at all, would fail as corrupt.
        let mut says_48_kib = u32::try_from(48 * KIB).unwrap().to_le_bytes().to_vec();
        says_48_kib.extend_from_slice(&[0xff; 256]);
        let slot = Arc::new(StreamSlot::new(8, 0, 64 * KIB));
        slot.push(std::iter::once(Queued {
            payload: says_48_kib.into(),
            compression: rpc_core::Compression::Lz4.to_wire(),
        }));
        let mut third = Inbound::new(3, slot, sender.clone(), budget.clone());
        let e = third
            .next()
            .await
            .expect("an item")
            .expect_err("refused by its declared size");
        assert!(e.message().contains("budget"), "{e}");
        drop(again);
    }

    /// The task of stream 7, registered in `table`, whose producer, once the stream is
    /// accepted, makes `item()`s without end for a client buffering `window` items; its frames
    /// go to `sender`, which holds at most `max_unsent` bytes, and its waits on the client end
    /// at `stall`.
    fn endless(
        item: impl FnMut() -> Bytes + Send + 'static,
        window: u32,
        table: &Arc<StreamTable>,
        (sender, max_unsent, stall): (FrameSender, usize, Option<Duration>),
    ) -> StreamDriver {
        let events = stream::iter(std::iter::once(StreamEvent::Accepted))
            .chain(stream::repeat_with(item).map(StreamEvent::Item))
            .boxed();
        let out = (sender, max_unsent, stall);
        StreamDriver::new(7, events, (window, 0, false), None, table, out)
    }

    /// A client announcing a vast window that reads nothing: the producer stops once the
    /// connection's send queue is over its limit, not at the window, and goes on once the
    /// peer reads again.
    #[tokio::test]
    async fn the_producer_stops_while_the_send_queue_is_over_its_limit() {
        use tokio::io::AsyncReadExt;
        const ITEM: usize = 4096;
        const MAX_UNSENT: usize = 16 * ITEM;
        let (sender, mut theirs) = duplex_writer(4 * ITEM);
        let polled = Arc::new(AtomicUsize::new(0));
        let p = polled.clone();
        let item = move || {
            p.fetch_add(1, Ordering::Relaxed);
            Bytes::from(vec![1u8; ITEM])
        };
        let table = Arc::new(StreamTable::default());
        let driver = endless(item, u32::MAX, &table, (sender, MAX_UNSENT, None));
        let mut driver = Box::pin(driver);
        // The writer task does not run between these polls: nothing leaves the queue.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for _ in 0..50 {
            assert!(driver.as_mut().poll(&mut cx).is_pending());
        }
        let produced = polled.load(Ordering::Relaxed);
        // The last item may take the queue past the limit; then nothing more.
        assert!(
            produced <= MAX_UNSENT / ITEM + 1,
            "{produced} items of {ITEM} bytes queued for a limit of {MAX_UNSENT}"
        );
        // The peer reads: the queue drains, and the producer goes on.
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            while theirs.read(&mut buf).await.is_ok_and(|n| n > 0) {}
        });
        let goes_on = std::future::poll_fn(|cx| {
            let _ = driver.as_mut().poll(cx);
            if polled.load(Ordering::Relaxed) > produced {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        tokio::time::timeout(std::time::Duration::from_secs(10), goes_on)
            .await
            .expect("the producer goes on once the peer reads");
    }

    /// Endless 4 KiB items, and an end (519) once `ended` is set, as a stream at its deadline.
    struct UntilDeadline {
        ended: Arc<AtomicBool>,
    }

    impl Stream for UntilDeadline {
        type Item = StreamEvent;
        fn poll_next(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<StreamEvent>> {
            Poll::Ready(Some(StreamEvent::Item(Bytes::from(vec![1u8; 4096]))))
        }
    }

    impl StreamEvents for UntilDeadline {
        fn poll_items_into(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            _sink: &mut ItemSink<'_>,
        ) -> Poll<Option<StreamEvent>> {
            self.poll_next(cx)
        }

        fn poll_ended(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<RemoteResultMessage> {
            if self.ended.load(Ordering::Relaxed) {
                Poll::Ready(error_result(StatusCode::Timeout, "deadline"))
            } else {
                Poll::Pending
            }
        }
    }

    /// A stream whose connection's writer stopped (the peer went) ends, rather than producing
    /// into a queue nothing will write.
    #[tokio::test]
    async fn a_stream_ends_once_its_writer_stopped() {
        let (sender, theirs) = duplex_writer(4096);
        drop(theirs);
        let events: Pin<Box<dyn StreamEvents>> = Box::pin(UntilDeadline {
            ended: Arc::new(AtomicBool::new(false)),
        });
        let table = Arc::new(StreamTable::default());
        let mut driver = StreamDriver::new(
            7,
            Events::Into(events),
            (u32::MAX, 0, false),
            None,
            &table,
            (sender, 16 * 1024, None),
        );
        let end = tokio::time::timeout(std::time::Duration::from_secs(10), &mut driver)
            .await
            .expect("the stream ends");
        assert_eq!(end.status_code, 506, "{end:?}");
    }

    /// A stream waiting for room in the send queue still ends at its deadline.
    #[tokio::test]
    async fn a_stream_waiting_for_room_ends_at_its_deadline() {
        let (sender, _theirs) = duplex_writer(4096);
        let ended = Arc::new(AtomicBool::new(false));
        let events: Pin<Box<dyn StreamEvents>> = Box::pin(UntilDeadline {
            ended: ended.clone(),
        });
        let table = Arc::new(StreamTable::default());
        let mut driver = Box::pin(StreamDriver::new(
            7,
            Events::Into(events),
            (u32::MAX, 0, false),
            None,
            &table,
            (sender, 16 * 1024, None),
        ));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for _ in 0..10 {
            assert!(driver.as_mut().poll(&mut cx).is_pending());
        }
        ended.store(true, Ordering::Relaxed);
        match driver.as_mut().poll(&mut cx) {
            Poll::Ready(end) => assert_eq!(end.status_code, 519, "{end:?}"),
            Poll::Pending => panic!("the deadline ends a stream waiting for room"),
        }
    }

    /// Reads a KiB of `theirs` every 100 ms of the paused clock for 3 s (ten times a stall
    /// `limit` of 300 ms), checking `during` and that `driver` goes on meanwhile; then reads
    /// nothing more: the stream's end (519), which must come within twice the limit.
    async fn read_slowly_then_not(
        theirs: &mut tokio::io::DuplexStream,
        driver: &mut tokio::task::JoinHandle<RemoteResultMessage>,
        limit: Duration,
        during: impl Fn(),
    ) -> RemoteResultMessage {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 1024];
        for _ in 0..30 {
            tokio::time::advance(Duration::from_millis(100)).await;
            let n = theirs.read(&mut buf).await.expect("the pipe is open");
            assert!(n > 0, "the writer writes");
            during();
            assert!(!driver.is_finished(), "ended while the client read");
        }
        let end = tokio::time::timeout(2 * limit, driver)
            .await
            .expect("a client reading nothing is stalled")
            .expect("the driver");
        assert_eq!(end.status_code, 519, "{end:?}");
        end
    }

    /// A client reading slowly, a KiB every 100 ms, is not taken for stalled while its stream
    /// waits for room, though one batch of items takes far longer than the 300 ms stall limit
    /// to write: each part the client takes is progress. Before, only a completed write was,
    /// and the stream was ended 519 ("read nothing of its connection") at the limit. A client
    /// that then reads nothing is: the stream ends at the limit. (On the paused clock.)
    #[tokio::test(start_paused = true)]
    async fn a_client_reading_slowly_is_not_taken_for_stalled_while_its_stream_waits_for_room() {
        const LIMIT: Duration = Duration::from_millis(300);
        let (sender, mut theirs) = duplex_writer(1024);
        let events: Pin<Box<dyn StreamEvents>> = Box::pin(UntilDeadline {
            ended: Arc::new(AtomicBool::new(false)),
        });
        let table = Arc::new(StreamTable::default());
        let driver = StreamDriver::new(
            7,
            Events::Into(events),
            (u32::MAX, 0, false),
            None,
            &table,
            (sender, 16 * 1024, Some(LIMIT)),
        );
        let mut driver = tokio::spawn(driver);
        let end = read_slowly_then_not(&mut theirs, &mut driver, LIMIT, || {}).await;
        assert!(end.exception_message.contains("read nothing"), "{end:?}");
    }

    /// A stream waiting for credit while the server reads nothing of its client (the
    /// connection's send queue over its limit with another stream's large frame, read slowly:
    /// the credit would wait unread) is not taken for stalled while the client takes bytes of
    /// the connection. Before, it was ended 519 "granted no credit" at the 300 ms stall limit,
    /// the credit perhaps sent and unread. A client that then reads nothing is stalled.
    /// (On the paused clock.)
    #[tokio::test(start_paused = true)]
    async fn a_stream_waiting_for_credit_the_server_does_not_read_is_not_taken_for_stalled() {
        const LIMIT: Duration = Duration::from_millis(300);
        const MAX_UNSENT: usize = 16 * 1024;
        let (sender, mut theirs) = duplex_writer(1024);
        let item = || Bytes::from_static(b"item");
        let table = Arc::new(StreamTable::default());
        let driver = endless(item, 1, &table, (sender.clone(), MAX_UNSENT, Some(LIMIT)));
        let mut driver = tokio::spawn(driver);
        // The stream's one item of credit is used; then another's large frame is queued.
        tokio::task::yield_now().await;
        assert!(!driver.is_finished());
        assert!(sender.send_encoded(Bytes::from(vec![0u8; 4 * MAX_UNSENT])));
        let over = || {
            assert!(
                sender.backlog().bytes() > MAX_UNSENT,
                "still over the limit"
            );
        };
        let end = read_slowly_then_not(&mut theirs, &mut driver, LIMIT, over).await;
        assert!(
            end.exception_message.contains("granted no credit"),
            "{end:?}"
        );
    }

    /// A stream the connection stopped (at its drain's deadline, at the client's half-close
    /// or `Cancel`, before it queues the stream's end) queues none of its items after that,
    /// though its task polls on until it is dropped. Before, a poll under way on another
    /// thread queued its items after the end ("no frame of that stream follows").
    #[tokio::test]
    async fn a_stream_the_connection_stopped_queues_none_of_its_items_after() {
        let (sender, _theirs) = duplex_writer(1 << 20);
        let item = || Bytes::from_static(b"item");
        let table = Arc::new(StreamTable::default());
        let driver = endless(item, u32::MAX, &table, (sender.clone(), 1 << 20, None));
        let mut driver = Box::pin(driver);
        // The writer task does not run between these polls: the queue only grows.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        let queued = sender.backlog().bytes();
        assert!(queued > 0, "items were queued");
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert!(sender.backlog().bytes() > queued, "more items were queued");
        table.get(7).expect("the stream's slot").stop();
        let stopped_at = sender.backlog().bytes();
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert_eq!(sender.backlog().bytes(), stopped_at, "nothing more queued");
    }

    #[tokio::test]
    async fn the_producer_is_polled_only_within_the_credit_and_the_slot_goes_with_the_task() {
        let (sender, _theirs) = duplex_writer(1 << 20);
        let polled = Arc::new(AtomicUsize::new(0));
        let p = polled.clone();
        let item = move || {
            p.fetch_add(1, Ordering::Relaxed);
            Bytes::from_static(b"x")
        };
        let table = Arc::new(StreamTable::default());
        let driver = endless(item, 5, &table, (sender, usize::MAX, None));
        let mut driver = Box::pin(driver);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polled.load(Ordering::Relaxed), 5, "the window");
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polled.load(Ordering::Relaxed), 5, "no credit, no poll");
        table.get(7).expect("registered").grant(3);
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polled.load(Ordering::Relaxed), 8);
        table
            .get(7)
            .expect("registered")
            .violate(Violation::ItemsNotTaken);
        match driver.as_mut().poll(&mut cx) {
            Poll::Ready(end) => assert_eq!(end.status_code, 500),
            Poll::Pending => panic!("a violation ends the stream"),
        }
        drop(driver);
        assert!(table.is_empty());
    }
}
