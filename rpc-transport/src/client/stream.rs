//! The client's side of a stream: the items the server sends, buffered within the window the
//! client announced, handed to the consumer in order, with credit granted back as they are
//! taken.
//!
//! A stream holds a slot of the connection's pending table for its whole life, so the deadline
//! sweeper, `Cancel` on drop and the failure of the connection treat it as they treat a call.
//! The connection's reader only appends to a stream's buffer: it never waits for a consumer.
//! A server that sends more than the credit given breaks the protocol, and that stream (only)
//! ends with an error.
//!
//! The reader hands over every item of a frame under one lock and wakes the consumer once; the
//! consumer moves everything buffered to its own queue under one lock and takes items from
//! there without locking, so a run of small items costs one hand-over, not one per item. The
//! items of a frame stay in the frame's buffer, found one by one as they are taken and lent to
//! the decoder ([`ItemSource`]): no handle per item, whose reference count the reader, taking
//! in the next frames, would share with the consumer.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use futures_util::Stream;
use rpc_core::wire::{
    frame::Kind, Cancel, RemoteResultMessage, StreamCredit, StreamEnd, StreamItem,
};
use rpc_core::{ItemSource, LentItem, RpcError, StatusCode, StreamMode};
use tokio::sync::Notify;

use super::answer::ItemRun;
use super::connection::Connection;
use crate::client::shared::comm_error;
use crate::flow::{Credit, Held, Taken};
use crate::writer::{Backlog, RoomWait};

/// How a stream ended: the server's answer, or why there is none.
pub(super) type End = Result<RemoteResultMessage, RpcError>;

/// How a server's stream items broke the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Broken {
    /// Items before the stream was accepted (no credit was given yet).
    BeforeAccepted,
    /// More items, or bytes, than the credit given.
    OverCredit,
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Broken::BeforeAccepted => "stream items before it accepted the stream",
            Broken::OverCredit => "more stream items than it was granted",
        })
    }
}

/// One stream's state, shared by the pending table (reader, sweeper) and its consumer.
pub(super) struct StreamShared {
    inner: Mutex<Inner>,
    /// Wakes every task waiting to send (for credit, room or the end) and every task waiting
    /// for the end, when credit comes or the stream ends: a [`StreamSender`] is cloned into
    /// other tasks, and each waiting future is registered here only while it waits (dropped,
    /// it leaves), so no waiter takes another's wake-up and none is kept for good.
    changed: Notify,
    /// Items the client buffers for this stream (its `Hello.stream_window`).
    window: u32,
    /// Bytes the client buffers for this stream when the server keeps byte windows (0: items
    /// only).
    window_bytes: u64,
}

/// Items of one frame waiting for the consumer, lent from the frame's buffer as they are taken.
/// A small frame's (or lone item's) bytes are copied out of the connection's read buffer
/// ([`own_bytes`](crate::own_bytes)), so a window of items that came one by one among other
/// traffic does not keep a read buffer alive per item.
pub(super) struct Chunk {
    buf: Bytes,
    /// Where each item of a run lies in `buf` (unused for a lone item).
    places: Vec<(u32, u32)>,
    /// A lone item (all of `buf`) and its size on the wire (compressed, when it was); `None`:
    /// the items of a run, each its own size.
    lone_wire: Option<usize>,
    /// The next item's index.
    next: usize,
    /// Items in the chunk (those within the credit).
    count: usize,
    /// How a lone item is compressed (its wire number; 0: plain). It is decompressed when it is
    /// lent, so what a stream holds is bounded by its window as items travel, never by what a
    /// small compressed item may expand to.
    compression: i32,
}

impl Chunk {
    /// One plain item.
    #[cfg(test)]
    fn one(item: Bytes) -> Self {
        Chunk::compressed(item, 0)
    }

    /// One item as it came, compressed with `compression` (0: plain).
    pub(super) fn compressed(payload: Bytes, compression: i32) -> Self {
        let payload = crate::own_bytes(payload);
        Chunk {
            lone_wire: Some(payload.len()),
            buf: payload,
            places: Vec::new(),
            next: 0,
            count: 1,
            compression,
        }
    }

    /// Decompresses a compressed lone item in place, within `limit` bytes.
    fn expand(&mut self, id: u64, limit: usize) -> Result<(), String> {
        if self.compression != 0 {
            self.buf = crate::compression::unpack_payload(id, &self.buf, self.compression, limit)?;
            self.compression = 0;
        }
        Ok(())
    }

    /// The items of a plain `StreamItems` frame (none, for a frame that carries none).
    pub(super) fn run(run: ItemRun) -> Self {
        Chunk {
            buf: crate::own_bytes(run.body),
            count: run.places.len(),
            places: run.places,
            lone_wire: None,
            next: 0,
            compression: 0,
        }
    }

    /// The place of the next item in `buf`.
    fn next(&mut self) -> Option<Range<usize>> {
        if self.next >= self.count {
            return None;
        }
        let range = match self.lone_wire {
            Some(_) => 0..self.buf.len(),
            None => {
                let (from, to) = self.places[self.next];
                from as usize..to as usize
            }
        };
        self.next += 1;
        Some(range)
    }

    /// The size on the wire of each item, in order.
    fn wire_sizes(&self) -> impl Iterator<Item = usize> + '_ {
        let run = match self.lone_wire {
            Some(_) => &[][..],
            None => &self.places[..],
        };
        self.lone_wire
            .into_iter()
            .chain(run.iter().map(|&(from, to)| (to - from) as usize))
    }
}

struct Inner {
    /// The server accepted the stream (its `StreamCredit` came).
    accepted: bool,
    items: VecDeque<Chunk>,
    /// Set once the stream ended; the consumer gets it after the items before it.
    end: Option<End>,
    waker: Option<Waker>,
    /// Items received so far.
    received: u64,
    /// Items (and bytes) received and not yet granted back.
    held: Held,
    /// What the server has granted for the client's own items (client and bidi streams).
    send: Credit,
    /// The stream ended (its end may have been taken by the consumer since).
    ended: bool,
    /// The client's request stream was finished (its `StreamEnd` queued): no item nor second
    /// end of it may follow, which the server would take for a protocol violation.
    finished: bool,
}

impl StreamShared {
    /// A stream buffering `window` items and `window_bytes` bytes of the server's (0: items
    /// only), whose own items are held to the server's byte window `send_window_bytes` (0:
    /// items only).
    pub(super) fn new(window: u32, window_bytes: u64, send_window_bytes: u64) -> Self {
        let window = window.max(1);
        StreamShared {
            inner: Mutex::new(Inner {
                accepted: false,
                items: VecDeque::new(),
                end: None,
                waker: None,
                received: 0,
                held: Held::new(window, window_bytes),
                send: Credit::new(0, send_window_bytes),
                ended: false,
                finished: false,
            }),
            changed: Notify::new(),
            window,
            window_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Credit from the server: the first accepts the stream.
    pub(super) fn credit(&self, items: u32) {
        let waker = {
            let mut s = self.lock();
            s.accepted = true;
            // (The first, accepting, credit frees nothing: nothing was sent before it.)
            s.send.grant(u64::from(items));
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        self.changed.notify_waiters();
    }

    /// Items from the server, in order (one frame's); an error when they break the protocol
    /// (the stream must then be ended; the items before one beyond the credit given are
    /// kept). One lock and at most one wake-up for all of them.
    ///
    /// The byte window counts each item by its size on the wire.
    pub(super) fn push(&self, chunks: impl IntoIterator<Item = Chunk>) -> Result<(), Broken> {
        let waker = {
            let mut s = self.lock();
            if s.ended {
                return Ok(());
            }
            if !s.accepted {
                return Err(Broken::BeforeAccepted);
            }
            let s = &mut *s;
            let mut within = true;
            for mut chunk in chunks {
                let mut admitted = 0;
                for wire in chunk.wire_sizes() {
                    if !s.held.admit(wire) {
                        within = false;
                        break;
                    }
                    admitted += 1;
                }
                chunk.count = admitted;
                s.received += admitted as u64;
                if admitted > 0 {
                    s.items.push_back(chunk);
                }
                if !within {
                    break;
                }
            }
            if !within {
                // The items before the violation are woken for with the end that follows.
                return Err(Broken::OverCredit);
            }
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// Ends the stream with `end` (unless it ended already); returns the waker to wake once
    /// the caller's locks are released. A failure without an answer says how many items
    /// arrived.
    pub(super) fn end(&self, end: End) -> Option<Waker> {
        let mut s = self.lock();
        if s.ended {
            return None;
        }
        s.ended = true;
        // (Waking under the lock is fine for a sender: it takes this lock only when polled.)
        self.changed.notify_waiters();
        let end = end.map_err(|e| {
            if s.accepted {
                let n = s.received;
                RpcError::new(
                    e.code(),
                    format!(
                        "{} (the stream ended there, after {n} item{} arrived)",
                        e.message(),
                        if n == 1 { "" } else { "s" }
                    ),
                )
                .maybe_delivered(true)
            } else {
                e
            }
        });
        s.end = Some(end);
        s.waker.take()
    }

    /// Whether an item may be sent: `Some(true)` with credit, `Some(false)` once the stream
    /// ended, `None` while it waits for credit.
    fn send_state(&self) -> Option<bool> {
        let s = self.lock();
        if s.ended || s.finished {
            Some(false)
        } else if s.send.ready() {
            Some(true)
        } else {
            None
        }
    }

    /// Resolves with `true` once an item may be sent: the server granted credit and, given
    /// `room` (the connection's send queue and its limit of unsent bytes), the queue has room;
    /// with `false` once the stream ended.
    async fn wait_to_send(&self, room: Option<(&Backlog, usize)>) -> bool {
        let mut wait = RoomWait::default();
        loop {
            // Registered before the state is read: credit or the end in between wakes it.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.send_state() {
                Some(false) => return false,
                Some(true) => {
                    let Some((backlog, max)) = room else {
                        return true;
                    };
                    // Room, or the end, or more credit (which says nothing: look again).
                    let roomy = std::future::poll_fn(|cx| {
                        if wait.poll_room(backlog, max, cx).is_ready() {
                            return Poll::Ready(true);
                        }
                        std::future::Future::poll(changed.as_mut(), cx).map(|()| false)
                    })
                    .await;
                    // With room, the credit is looked at again: another sender of the stream
                    // may have used it meanwhile, or the stream ended.
                    if roomy {
                        match self.send_state() {
                            Some(ready) => return ready,
                            None => continue,
                        }
                    }
                }
                None => changed.await,
            }
        }
    }

    /// Resolves once the stream ended.
    async fn wait_for_end(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.lock().ended {
                return;
            }
            changed.await;
        }
    }

    /// Takes one item's credit for an item of `len` bytes, if there is some and the stream is
    /// open, and queues it (`queue`, whether it was) under the stream's lock: a `finish` from
    /// another clone of the sender comes wholly before or after, never between, so no item
    /// follows the request stream's end on the wire. `None`: no credit, or not open.
    fn send_with_credit(&self, len: usize, queue: impl FnOnce() -> bool) -> Option<bool> {
        let mut s = self.lock();
        if s.ended || s.finished || !s.send.ready() {
            return None;
        }
        s.send.sent(len);
        Some(queue())
    }

    /// Takes one item's credit, as [`send_with_credit`](Self::send_with_credit) does, without
    /// queueing anything.
    #[cfg(test)]
    fn take_credit(&self, len: usize) -> bool {
        self.send_with_credit(len, || true).is_some()
    }

    /// Marks the client's request stream finished and queues its end (`queue`) under the
    /// stream's lock, unless it was finished already (or the stream ended): its end is sent
    /// once, and after every item queued before. Whether it was queued now.
    fn finish(&self, queue: impl FnOnce()) -> bool {
        let mut s = self.lock();
        let first = !s.ended && !s.finished;
        s.finished = true;
        if first {
            queue();
        }
        drop(s);
        // Senders waiting for credit learn that no more items go.
        self.changed.notify_waiters();
        first
    }

    /// The set-up's outcome once known: accepted (`Ok(None)`), refused with the server's
    /// answer (`Ok(Some(..))`), or failed.
    pub(super) fn poll_open(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<RemoteResultMessage>, RpcError>> {
        let mut s = self.lock();
        if s.accepted {
            return Poll::Ready(Ok(None));
        }
        match s.end.take() {
            Some(Ok(answer)) => Poll::Ready(Ok(Some(answer))),
            Some(Err(e)) => Poll::Ready(Err(e)),
            None => {
                store(&mut s.waker, cx);
                Poll::Pending
            }
        }
    }
}

fn store(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

/// Turns a stream's error end (the server's answer, status other than 200) into its error.
pub type EndToError = Box<dyn Fn(RemoteResultMessage) -> RpcError + Send + Sync>;

/// The items of a stream the server accepted, from
/// [`Connection::open_stream`](super::Connection::open_stream): each encoded item in order,
/// then the end: nothing more when the server completed it (status 200; for a client stream,
/// its answer as the last item), one error item when it ended with an error, its deadline
/// passed (519) or the connection broke (506, saying how many items arrived). A stream that
/// takes the client's items sends them through [`send`](Self::send) or a
/// [`sender`](Self::sender).
///
/// Taking items grants the server credit for more; a consumer that stops taking them stops
/// the server's producer once the window is full. Dropping the stream before its end sends
/// `Cancel`: the server drops its producer.
pub struct ClientStream {
    tx: StreamSender,
    /// Items moved out of the shared buffer, taken from here without locking; the first
    /// holds the item lent last.
    local: VecDeque<Chunk>,
    /// A client stream's answer, lent as its last item.
    answer: Bytes,
    /// How the stream was opened: what the server may send on it (items, or one answer at
    /// its end for a client stream).
    mode: StreamMode,
    /// What the consumer took since it last granted credit.
    taken: Taken,
    /// The connection's heartbeats when the consumer last looked: one since grants what was
    /// taken at once, however little (see `Shared::beats`).
    beats_seen: u64,
    finished: bool,
    /// Still counted in its connection's calls in flight: until its end was read (or it is
    /// dropped first), so that a stream read to its end and kept no longer holds its
    /// connection busy (a pool does not close a busy connection).
    counted: bool,
    to_error: EndToError,
}

/// The sending side of a stream that takes the client's items (client or bidirectional
/// streaming), from [`ClientStream::sender`]: usable from another task while the stream's
/// items are read. Cheap to clone.
#[derive(Clone)]
pub struct StreamSender {
    conn: Connection,
    id: u64,
    shared: Arc<StreamShared>,
}

impl ClientStream {
    /// Ends the stream on an item that does not decompress, telling the server to stop it
    /// and a sender elsewhere (the caller's items) to stop too; the error to hand the consumer.
    fn broken(&mut self, why: &str) -> RpcError {
        let error = RpcError::new(
            StatusCode::FrameworkError,
            format!("{}: {why}; the stream was ended", self.tx.conn.shared.peer),
        );
        self.end_with(&error);
        error
    }

    /// Ends the stream with `error` on this side: no longer in flight, the server told to
    /// stop it, a sender elsewhere (the caller's items) told to stop too.
    fn end_with(&mut self, error: &RpcError) {
        self.ended_for_consumer();
        let shared = &self.tx.conn.shared;
        // (The waker given back is this consumer's, which is being answered now.)
        let _ = self.tx.shared.end(Err(error.clone()));
        if shared.pending.remove(self.tx.id) {
            shared.sender.send(Kind::Cancel(Cancel {
                message_id: self.tx.id,
                ..Default::default()
            }));
        }
    }

    /// The stream has ended for its consumer: it no longer counts as in flight.
    fn ended_for_consumer(&mut self) {
        self.finished = true;
        if std::mem::take(&mut self.counted) {
            self.tx
                .conn
                .shared
                .in_flight
                .fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub(super) fn new(
        conn: Connection,
        (id, mode): (u64, StreamMode),
        shared: Arc<StreamShared>,
    ) -> Self {
        let taken = Taken::new(shared.window, shared.window_bytes);
        ClientStream {
            tx: StreamSender { conn, id, shared },
            local: VecDeque::new(),
            answer: Bytes::new(),
            mode,
            taken,
            beats_seen: 0,
            finished: false,
            counted: true,
            to_error: Box::new(|r| {
                RpcError::new(StatusCode::from_u32(r.status_code), r.exception_message)
            }),
        }
    }

    /// Sets how the server's error answer ending the stream becomes the error item (by
    /// default: its status and message).
    pub fn with_end_error(mut self, to_error: EndToError) -> Self {
        self.to_error = to_error;
        self
    }

    /// The stream's `message_id` on its connection.
    pub fn message_id(&self) -> u64 {
        self.tx.id
    }

    /// Items received from the server so far.
    pub fn received(&self) -> u64 {
        self.tx.shared.lock().received
    }

    /// The sending side, for a stream taking the client's items.
    pub fn sender(&self) -> StreamSender {
        self.tx.clone()
    }

    /// See [`StreamSender::ready`].
    pub async fn ready(&self) -> bool {
        self.tx.ready().await
    }

    /// See [`StreamSender::ended`].
    pub async fn ended(&self) {
        self.tx.ended().await
    }

    /// See [`StreamSender::send`].
    pub fn send(&self, item: Bytes) -> Result<(), RpcError> {
        self.tx.send(item)
    }

    /// See [`StreamSender::finish`].
    pub fn finish(&self, end: Result<(), RpcError>) {
        self.tx.finish(end)
    }
}

impl StreamSender {
    /// Resolves with `true` once the server has granted credit for one more item and the
    /// connection's send queue has room for it (at most `ConnectOptions::max_unsent_bytes`
    /// unsent), with `false` once the stream ended (read it for why) or its request stream
    /// was finished. Only then is the next item worth producing: a server that grants credit
    /// but stops reading holds the caller's stream here, whatever it granted.
    pub async fn ready(&self) -> bool {
        let shared = &self.conn.shared;
        let room = (shared.sender.backlog(), shared.max_unsent_bytes);
        self.shared.wait_to_send(Some(room)).await
    }

    /// Resolves once the stream ended (read it for how), or its reader gave it up.
    pub async fn ended(&self) {
        self.shared.wait_for_end().await
    }

    /// Sends one item of the client's request stream, using one item of the server's credit;
    /// an error, sending nothing, when there is no credit (wait for [`ready`](Self::ready)),
    /// or the stream or the connection ended, or (a [`StatusCode::ValidateError`]) when the
    /// item's frame would be longer than the server reads. It does not look at the connection's send
    /// queue: [`ready`](Self::ready) waits for room before the next item is worth producing,
    /// and a caller sending without it may take the queue past its limit by what it sends.
    pub fn send(&self, item: Bytes) -> Result<(), RpcError> {
        self.send_packed(item, 0)
    }

    /// [`send`](Self::send) for an item compressed with the algorithm of wire number
    /// `compression` (0: plain), which must be one the server accepts
    /// ([`Connection::accept_compression`](crate::Connection::accept_compression)).
    pub fn send_packed(&self, item: Bytes, compression: i32) -> Result<(), RpcError> {
        let shared = &self.conn.shared;
        if let Some(e) = shared.item_over_frame_limit(self.id, item.len(), compression) {
            return Err(e);
        }
        let queued = self.shared.send_with_credit(item.len(), || {
            shared.sender.send(Kind::StreamItem(StreamItem {
                message_id: self.id,
                payload: item,
                compression,
            }))
        });
        let Some(queued) = queued else {
            return Err(RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "{}: the stream item was not sent: no credit from the server, or the \
                     stream ended, or its request stream was finished; wait for ready()",
                    self.conn.peer()
                ),
            ));
        };
        if !queued {
            return Err(comm_error(
                self.conn.peer(),
                "the stream item was not sent: the connection is closed",
            ));
        }
        Ok(())
    }

    /// Ends the client's request stream: `Ok` when it is complete, else with the error that
    /// stopped it (the server ends the stream with that status). Once only: a later `finish`
    /// (from any clone) does nothing, and [`send`](Self::send) refuses items after it.
    pub fn finish(&self, end: Result<(), RpcError>) {
        let (status_code, exception_message) = match end {
            Ok(()) => (StatusCode::Success.as_u32(), String::new()),
            Err(e) => (e.code().as_u32(), e.message().to_string()),
        };
        self.shared.finish(|| {
            self.conn.shared.sender.send(Kind::StreamEnd(StreamEnd {
                message_id: self.id,
                status_code,
                exception_message,
            }));
        });
    }
}

impl fmt::Debug for StreamSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamSender")
            .field("message_id", &self.id)
            .finish_non_exhaustive()
    }
}

impl ItemSource for ClientStream {
    /// An item that does not decode ends the stream as one that does not decompress does.
    fn fail(&mut self, error: &RpcError) {
        if !self.finished {
            self.end_with(error);
        }
    }

    fn poll_lend(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<LentItem<'_>, RpcError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        let limit = self.tx.conn.shared.max_frame_length;
        let next = loop {
            if let Some(chunk) = self.local.front_mut() {
                if self.mode == StreamMode::Client {
                    return Poll::Ready(Some(Err(self.broken(
                        "the server sent items on a client-streaming call, whose one answer \
                         comes with its end; is the method client-streaming on the server too?",
                    ))));
                }
                if let Err(why) = chunk.expand(self.tx.id, limit) {
                    return Poll::Ready(Some(Err(self.broken(&why))));
                }
                if let Some(range) = chunk.next() {
                    // Counted as the window counts it: as it travelled (compressed, when it
                    // was), not as it was lent.
                    let wire = chunk.lone_wire.unwrap_or(range.len());
                    break Ok((range, wire));
                }
                self.local.pop_front();
                continue;
            }
            let mut s = self.tx.shared.lock();
            if !s.items.is_empty() {
                // Everything buffered at once; the shared queue keeps the emptied one.
                std::mem::swap(&mut s.items, &mut self.local);
            } else if let Some(end) = s.end.take() {
                break Err(end);
            } else {
                store(&mut s.waker, cx);
                return Poll::Pending;
            }
        };
        let (range, wire) = match next {
            Ok(next) => next,
            Err(end) => {
                self.ended_for_consumer();
                let end = match end {
                    // The answer ending the stream may be compressed, as any answer may.
                    Ok(answer) if answer.compression != 0 => self.tx.conn.unpack(answer),
                    end => end,
                };
                return Poll::Ready(match end {
                    // A client stream's answer comes with its end; a stream of the server's
                    // items ends with none.
                    Ok(answer)
                        if answer.status_code == StatusCode::Success.as_u32()
                            && !answer.result.is_empty() =>
                    {
                        if self.mode != StreamMode::Client {
                            return Poll::Ready(Some(Err(RpcError::new(
                                StatusCode::FrameworkError,
                                format!(
                                    "{}: the server ended a stream of its items with an answer, \
                                     as a client-streaming call's; is the method streaming the \
                                     same way on the server?",
                                    self.tx.conn.shared.peer
                                ),
                            ))));
                        }
                        self.answer = answer.result;
                        Some(Ok(LentItem::whole(&self.answer)))
                    }
                    Ok(answer) if answer.status_code == StatusCode::Success.as_u32() => None,
                    Ok(answer) => Some(Err((self.to_error)(answer))),
                    Err(e) => Some(Err(e)),
                });
            }
        };
        let mut grant = self.taken.take(wire);
        if grant.is_none() {
            let beats = self.tx.conn.shared.beats.load(Ordering::Relaxed);
            if beats != self.beats_seen {
                self.beats_seen = beats;
                grant = self.taken.flush();
            }
        }
        if let Some(items) = grant {
            let open = {
                let mut s = self.tx.shared.lock();
                s.held.release(items);
                !s.ended
            };
            if open {
                self.tx
                    .conn
                    .shared
                    .sender
                    .send(Kind::StreamCredit(StreamCredit {
                        message_id: self.tx.id,
                        items: u32::try_from(items).unwrap_or(u32::MAX),
                    }));
            }
        }
        let chunk = self.local.front().expect("the item's chunk");
        Poll::Ready(Some(Ok(LentItem::new(&chunk.buf, range))))
    }
}

impl Stream for ClientStream {
    type Item = Result<Bytes, RpcError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        LentItem::owned(self.get_mut().poll_lend(cx))
    }
}

impl Drop for ClientStream {
    fn drop(&mut self) {
        self.ended_for_consumer();
        let shared = &self.tx.conn.shared;
        // Still open on the server (its slot is still held): tell it to stop, and why.
        if shared.pending.remove(self.tx.id) {
            shared.sender.send(Kind::Cancel(Cancel {
                message_id: self.tx.id,
                reason: super::connection::dropped_reason() as i32,
            }));
        }
        // A sender elsewhere stops too.
        let given_up = RpcError::new(StatusCode::FrameworkError, "the stream was given up");
        if let Some(w) = self.tx.shared.end(Err(given_up)) {
            w.wake();
        }
    }
}

impl fmt::Debug for ClientStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientStream")
            .field("peer", &self.tx.conn.peer())
            .field("message_id", &self.tx.id)
            .field("received", &self.received())
            .field("finished", &self.finished)
            .finish()
    }
}

/// The outcome of [`Connection::open_stream`](super::Connection::open_stream) when the server
/// answered.
#[derive(Debug)]
pub enum Opened {
    /// The server accepted the stream: its items.
    Accepted(ClientStream),
    /// The server refused it (overflow, unknown entry, the handler's set-up failed, ...):
    /// its answer, as for a unary call. Nothing was streamed.
    Refused(RemoteResultMessage),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame of no items hands over none; a run hands over each of its items, from the
    /// frame's buffer.
    #[test]
    fn a_run_lends_each_of_its_items_and_an_empty_one_none() {
        let s = StreamShared::new(100, 0, 0);
        s.credit(0);
        let run = |body: &'static [u8], places: Vec<(u32, u32)>| {
            Chunk::run(ItemRun {
                message_id: 1,
                compression: 0,
                body: Bytes::from_static(body),
                places,
            })
        };
        assert_eq!(s.push([run(b"\x08\x01", vec![])]), Ok(()));
        assert_eq!(
            s.push([run(b"\x12\x02ab\x12\x01c", vec![(2, 4), (6, 7)])]),
            Ok(())
        );
        let mut inner = s.lock();
        assert_eq!(
            inner.received, 2,
            "the empty frame's none and the run's two"
        );
        let mut items = Vec::new();
        for chunk in inner.items.iter_mut() {
            while let Some(range) = chunk.next() {
                items.push(chunk.buf.slice(range));
            }
        }
        assert_eq!(items, [Bytes::from_static(b"ab"), Bytes::from_static(b"c")]);
    }

    /// A small frame of items, or a small lone item, waits in a buffer of its own, not in a
    /// slice of the connection's read buffer (which it would keep whole); a large one is not
    /// copied.
    #[test]
    fn small_chunks_do_not_keep_the_read_buffer() {
        let read = Bytes::from(vec![7u8; crate::READ_BUFFER]);
        let within = |b: &Bytes| crate::lies_in(&read, b);
        let run = |body: Bytes| {
            Chunk::run(ItemRun {
                message_id: 1,
                compression: 0,
                places: vec![(0, body.len() as u32)],
                body,
            })
        };
        let small_run = run(read.slice(10..42));
        assert_eq!(small_run.buf, read.slice(10..42));
        assert!(!within(&small_run.buf), "the small run was copied");
        let small_item = Chunk::compressed(read.slice(100..132), 0);
        assert!(!within(&small_item.buf), "the small item was copied");
        let large = crate::COPY_QUEUED_BELOW + 1;
        assert!(
            within(&run(read.slice(..large)).buf),
            "a large run shares it"
        );
        assert!(
            within(&Chunk::compressed(read.slice(..large), 0).buf),
            "a large item shares it"
        );
    }

    /// Two tasks waiting for the end and two for credit, as cloned senders allow: credit wakes
    /// both senders, the end both of the others (none takes another's wake-up).
    #[tokio::test]
    async fn credit_and_the_end_wake_every_task_waiting_for_them() {
        let s = std::sync::Arc::new(StreamShared::new(8, 0, 0));
        s.credit(0);
        let spawn_n = |n: usize, ending: bool| -> Vec<tokio::task::JoinHandle<()>> {
            (0..n)
                .map(|_| {
                    let s = s.clone();
                    tokio::spawn(async move {
                        if ending {
                            s.wait_for_end().await
                        } else {
                            assert!(s.wait_to_send(None).await, "credit");
                        }
                    })
                })
                .collect()
        };
        let (senders, enders) = (spawn_n(2, false), spawn_n(2, true));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(senders.iter().chain(&enders).all(|t| !t.is_finished()));
        s.credit(1);
        for t in senders {
            tokio::time::timeout(std::time::Duration::from_secs(5), t)
                .await
                .expect("woken by the credit")
                .expect("task");
        }
        assert!(enders.iter().all(|t| !t.is_finished()), "not ended yet");
        if let Some(w) = s.end(Err(RpcError::new(StatusCode::FrameworkError, "x"))) {
            w.wake();
        }
        for t in enders {
            tokio::time::timeout(std::time::Duration::from_secs(5), t)
                .await
                .expect("woken by the end")
                .expect("task");
        }
    }

    /// The request stream is finished once: a second `finish` is told so (its end is not sent
    /// again), a sender waiting for credit learns that no more items go, and no credit is
    /// taken after it, however much the server grants: the server would take an item or end
    /// after the end for a protocol violation and end the whole stream with 500.
    #[tokio::test]
    async fn a_finished_request_stream_takes_no_more_items_nor_a_second_end() {
        let s = std::sync::Arc::new(StreamShared::new(8, 0, 0));
        s.credit(0);
        let waiting = {
            let s = s.clone();
            tokio::spawn(async move { s.wait_to_send(None).await })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "no credit yet");
        assert!(s.finish(|| {}), "the first finish");
        assert!(
            !s.finish(|| panic!("sent twice")),
            "a second finish sends nothing"
        );
        let ready = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("woken by the finish")
            .expect("task");
        assert!(!ready, "no more items go");
        s.credit(4);
        assert!(!s.take_credit(1), "no item after the end");
    }

    /// A sender that waited for room in the send queue looks at the stream again once it has
    /// room: another sender may have used the credit meanwhile (it then waits for more), or
    /// the stream ended (it says so).
    #[tokio::test]
    async fn a_sender_given_room_looks_at_the_credit_again() {
        use crate::writer::Backlog;
        let (s, backlog) = (
            Arc::new(StreamShared::new(8, 0, 0)),
            Arc::new(Backlog::default()),
        );
        s.credit(0);
        s.credit(1);
        backlog.set_queued(100);
        let waiter = |s: Arc<StreamShared>, backlog: Arc<Backlog>| {
            tokio::spawn(async move { s.wait_to_send(Some((&backlog, 10))).await })
        };
        let settle = || async {
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        };
        let first = waiter(s.clone(), backlog.clone());
        settle().await;
        assert!(!first.is_finished(), "no room yet");
        assert!(s.take_credit(1), "another sender uses the credit");
        backlog.set_queued(0);
        settle().await;
        assert!(!first.is_finished(), "room, but no credit left");
        s.credit(1);
        let ready = tokio::time::timeout(std::time::Duration::from_secs(5), first).await;
        assert!(ready.expect("woken by the credit").expect("task"));
        // Waiting for room when the stream ends and the room comes at once.
        backlog.set_queued(100);
        let second = waiter(s.clone(), backlog.clone());
        settle().await;
        assert!(!second.is_finished(), "no room");
        let _ = s.end(Err(RpcError::new(StatusCode::FrameworkError, "x")));
        backlog.set_queued(0);
        let ready = tokio::time::timeout(std::time::Duration::from_secs(5), second).await;
        assert!(!ready.expect("woken").expect("task"), "the stream ended");
    }

    /// One task waiting for credit and another for the end, as a cloned sender allows: the
    /// end wakes both (neither took the other's waker).
    #[tokio::test]
    async fn the_end_wakes_a_task_waiting_for_credit_and_one_waiting_for_the_end() {
        let s = std::sync::Arc::new(StreamShared::new(8, 0, 0));
        let ready = {
            let s = s.clone();
            tokio::spawn(async move { s.wait_to_send(None).await })
        };
        let ended = {
            let s = s.clone();
            tokio::spawn(async move { s.wait_for_end().await })
        };
        // Both are waiting (the spawned tasks ran once each).
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        if let Some(w) = s.end(Err(RpcError::new(StatusCode::FrameworkError, "x"))) {
            w.wake();
        }
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            (
                ready.await.expect("ready task"),
                ended.await.expect("ended task"),
            )
        })
        .await
        .expect("both woken");
        assert_eq!(got, (false, ()));
    }

    /// The byte window counts each item as it travelled (compressed, when it was), not as
    /// the consumer gets it: what the server counts too.
    #[test]
    fn the_byte_window_counts_items_as_they_travelled() {
        let s = StreamShared::new(100, 100, 0);
        // Items before the server accepted the stream break the protocol, and say so.
        let early = s.push([Chunk::one(Bytes::from_static(b"x"))]);
        assert_eq!(early, Err(Broken::BeforeAccepted));
        assert_eq!(
            early.unwrap_err().to_string(),
            "stream items before it accepted the stream"
        );
        // The accepting credit.
        s.credit(0);
        // Four items of 1000 bytes once decompressed, a few bytes each on the wire.
        let packed = crate::compression::compress(
            rpc_core::Compression::Zstd,
            &Bytes::from(vec![0u8; 1000]),
        );
        let wire = packed.len();
        assert!(wire < 25, "{wire} bytes");
        let zstd = rpc_core::Compression::Zstd.to_wire();
        let pushed = s.push((0..4).map(|_| Chunk::compressed(packed.clone(), zstd)));
        assert_eq!(pushed, Ok(()));
        // 4 * wire is below the window of 100: one more may go, up to it.
        let rest = Bytes::from(vec![b'x'; 100 - 4 * wire]);
        assert_eq!(s.push([Chunk::one(rest)]), Ok(()));
        assert_eq!(
            s.push([Chunk::one(Bytes::from_static(b"y"))]),
            Err(Broken::OverCredit),
            "100 bytes held reach the window"
        );
    }
}
