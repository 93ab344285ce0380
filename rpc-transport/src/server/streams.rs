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
//! granting the client credit as it does.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use futures_util::Stream;
use rpc_core::RpcError;

use futures_util::stream::{BoxStream, StreamExt};
use futures_util::task::AtomicWaker;
use rpc_core::wire::{frame::Kind, RemoteResultMessage, StreamCredit, StreamItem};
use rpc_core::StatusCode;

use super::handler::{error_result, StreamEvent};
use crate::writer::FrameSender;

/// Items a stream sends in one poll before it lets other tasks run.
const ITEMS_PER_POLL: usize = 64;

/// One stream's state shared by its task, its inbound items' consumer and the connection's
/// reader.
#[derive(Default)]
pub(super) struct StreamSlot {
    /// Items of the client's request stream not yet taken by the handler (client streaming).
    inbound: Mutex<InboundQueue>,
    /// Items the server buffers of the client's request stream (0: it takes none).
    inbound_window: u32,
    /// Items the client has granted and the stream has not sent yet.
    credit: AtomicU64,
    /// The stream's task, woken when credit arrives or the client broke the protocol.
    waker: AtomicWaker,
    /// The client sent what this stream does not take: it ends with status 500.
    violated: AtomicBool,
}

/// The client's items waiting for the handler.
#[derive(Default)]
struct InboundQueue {
    items: VecDeque<Bytes>,
    /// The client's `StreamEnd`: `Ok` when its stream is complete.
    end: Option<Result<(), RpcError>>,
    waker: Option<Waker>,
    /// Items taken since credit was last granted.
    taken: u32,
}

impl StreamSlot {
    /// The state of a stream that takes up to `inbound_window` of the client's items (0: none).
    pub(super) fn new(inbound_window: u32) -> Self {
        StreamSlot {
            inbound_window,
            ..Default::default()
        }
    }

    fn inbound(&self) -> MutexGuard<'_, InboundQueue> {
        self.inbound.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An item of the client's request stream (`StreamItem`).
    pub(super) fn push(&self, item: Bytes) {
        let waker = {
            let mut q = self.inbound();
            if self.inbound_window == 0
                || q.end.is_some()
                || q.items.len() >= self.inbound_window as usize
            {
                drop(q);
                self.violate();
                return;
            }
            q.items.push_back(item);
            q.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The end of the client's request stream (`StreamEnd`): 200 complete, else its failure.
    pub(super) fn finish(&self, end: rpc_core::wire::StreamEnd) {
        if self.inbound_window == 0 {
            self.violate();
            return;
        }
        let waker = {
            let mut q = self.inbound();
            if q.end.is_some() {
                return;
            }
            q.end = Some(if end.status_code == StatusCode::Success.as_u32() {
                Ok(())
            } else {
                Err(RpcError::new(
                    StatusCode::from_u32(end.status_code),
                    format!(
                        "the caller's request stream failed: {}",
                        end.exception_message
                    ),
                ))
            });
            q.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Credit from the client (`StreamCredit`).
    pub(super) fn grant(&self, items: u32) {
        self.credit.fetch_add(u64::from(items), Ordering::AcqRel);
        self.waker.wake();
    }

    /// The client sent a frame this stream does not take: the stream ends with an error.
    pub(super) fn violate(&self) {
        self.violated.store(true, Ordering::Release);
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
    grant_at: u32,
    done: bool,
}

impl Inbound {
    pub(super) fn new(id: u64, slot: Arc<StreamSlot>, sender: FrameSender) -> Self {
        let grant_at = (slot.inbound_window / 2).max(1);
        Inbound {
            id,
            slot,
            sender,
            grant_at,
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
        let (next, grant) = {
            let mut q = this.slot.inbound();
            if let Some(item) = q.items.pop_front() {
                q.taken += 1;
                let grant = if q.taken >= this.grant_at && q.end.is_none() {
                    std::mem::take(&mut q.taken)
                } else {
                    0
                };
                (Some(Ok(item)), grant)
            } else if this.slot.violated.load(Ordering::Acquire) {
                (
                    Some(Err(RpcError::new(
                        StatusCode::FrameworkError,
                        "protocol violation: the caller sent more stream items than it was \
                         granted",
                    ))),
                    0,
                )
            } else if let Some(end) = q.end.take() {
                (end.err().map(Err), 0)
            } else {
                match &q.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => q.waker = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            }
        };
        if grant > 0 {
            this.sender.send(Kind::StreamCredit(StreamCredit {
                message_id: this.id,
                items: grant,
            }));
        }
        if !matches!(next, Some(Ok(_))) {
            this.done = true;
        }
        Poll::Ready(next)
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

    /// Streams open now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// The task of one stream: sends `StreamCredit` when the stream is accepted, then its items
/// within the client's credit; its output is the stream's end, which the connection sends as
/// the call's answer. Dropping it (on `Cancel`, when the connection ends) drops the producer.
pub(super) struct StreamDriver {
    id: u64,
    events: BoxStream<'static, StreamEvent>,
    slot: Arc<StreamSlot>,
    table: Arc<StreamTable>,
    sender: FrameSender,
    accepted: bool,
    /// The credit granted to the client's items when the stream is accepted (0: the stream
    /// takes none).
    inbound_window: u32,
    /// Items of the current poll, queued for the writer together when the poll returns: one
    /// pass of the writer's lock and one wake-up per poll instead of one per item.
    batch: Vec<Kind>,
}

impl StreamDriver {
    /// The task of stream `id`, whose client buffers `client_window` items, with its state
    /// `slot` (already registered in `table` when the stream takes the client's items, and
    /// registered now otherwise), removed from `table` when it ends.
    pub(super) fn new(
        id: u64,
        events: BoxStream<'static, StreamEvent>,
        client_window: u32,
        slot: Option<Arc<StreamSlot>>,
        table: &Arc<StreamTable>,
        sender: FrameSender,
    ) -> Self {
        let slot = slot.unwrap_or_else(|| {
            let slot = Arc::new(StreamSlot::default());
            table.lock().insert(id, slot.clone());
            slot
        });
        slot.credit
            .store(u64::from(client_window.max(1)), Ordering::Release);
        StreamDriver {
            id,
            events,
            inbound_window: slot.inbound_window,
            slot,
            table: table.clone(),
            sender,
            accepted: false,
            batch: Vec::new(),
        }
    }

    fn accept(&mut self) {
        self.accepted = true;
        // In the batch, ahead of the items: the client must see the stream accepted first.
        self.batch.push(Kind::StreamCredit(StreamCredit {
            message_id: self.id,
            items: self.inbound_window,
        }));
    }

    /// One poll's frames and end, before the batch goes to the writer.
    fn poll_items(&mut self, cx: &mut Context<'_>) -> Poll<RemoteResultMessage> {
        let this = self;
        let mut sent = 0;
        loop {
            if this.slot.violated.load(Ordering::Acquire) {
                return Poll::Ready(error_result(
                    StatusCode::FrameworkError,
                    "protocol violation: the client sent stream items this stream does not \
                     take; the stream was ended",
                ));
            }
            // No credit, no poll: the producer waits until the client grants more.
            if this.accepted && this.slot.credit.load(Ordering::Acquire) == 0 {
                this.slot.waker.register(cx.waker());
                if this.slot.credit.load(Ordering::Acquire) == 0
                    && !this.slot.violated.load(Ordering::Acquire)
                {
                    return Poll::Pending;
                }
                continue;
            }
            if sent == ITEMS_PER_POLL {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match this.events.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
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
                    this.slot.credit.fetch_sub(1, Ordering::AcqRel);
                    this.batch.push(Kind::StreamItem(StreamItem {
                        message_id: this.id,
                        payload,
                        compression,
                    }));
                    sent += 1;
                }
                Poll::Ready(Some(StreamEvent::End(end))) => return Poll::Ready(end),
                Poll::Ready(None) => {
                    return Poll::Ready(RemoteResultMessage {
                        status_code: StatusCode::Success.as_u32(),
                        ..Default::default()
                    })
                }
            }
        }
    }
}

impl Future for StreamDriver {
    type Output = RemoteResultMessage;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RemoteResultMessage> {
        let this = &mut *self;
        let outcome = this.poll_items(cx);
        // Whatever the outcome: the items go before the end, which the connection sends once
        // this returns Ready.
        this.sender.send_all(&mut this.batch);
        outcome
    }
}

impl Drop for StreamDriver {
    fn drop(&mut self) {
        self.table.close(self.id, &self.slot);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use bytes::Bytes;
    use futures_util::stream;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::writer::spawn_writer;

    #[tokio::test]
    async fn the_producer_is_polled_only_within_the_credit_and_the_slot_goes_with_the_task() {
        let (ours, _theirs) = tokio::io::duplex(1 << 20);
        let sender = spawn_writer(
            ours,
            Arc::new(AtomicUsize::new(0)),
            CancellationToken::new(),
        );
        let polled = Arc::new(AtomicUsize::new(0));
        let p = polled.clone();
        let events = stream::iter(std::iter::once(StreamEvent::Accepted))
            .chain(stream::repeat_with(move || {
                p.fetch_add(1, Ordering::Relaxed);
                StreamEvent::Item(Bytes::from_static(b"x"))
            }))
            .boxed();
        let table = Arc::new(StreamTable::default());
        let mut driver = Box::pin(StreamDriver::new(7, events, 5, None, &table, sender));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polled.load(Ordering::Relaxed), 5, "the window");
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polled.load(Ordering::Relaxed), 5, "no credit, no poll");
        table.get(7).expect("registered").grant(3);
        assert!(driver.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polled.load(Ordering::Relaxed), 8);
        table.get(7).expect("registered").violate();
        match driver.as_mut().poll(&mut cx) {
            Poll::Ready(end) => assert_eq!(end.status_code, 500),
            Poll::Pending => panic!("a violation ends the stream"),
        }
        drop(driver);
        assert_eq!(table.len(), 0);
    }
}
