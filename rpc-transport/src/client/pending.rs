//! The table of calls waiting for their answers: a slab of slots indexed by message id.
//!
//! Every call used to cost a map entry and a `oneshot` channel (an allocation) just to carry its
//! answer from the reader to the caller. Here a call takes a slot of a slab that the connection
//! keeps: the slot holds the caller's waker while it waits and the answer once it came, and is
//! reused by a later call, so a connection whose number of calls in flight has settled
//! allocates nothing per call. A slot's message id is its index in the low 32 bits and its
//! generation (bumped each time the slot is freed) in the high 32, so an answer that arrives
//! late for a call that gave up, whose slot a newer call now holds, does not match and is
//! dropped, as the protocol says.
//!
//! A stream holds a slot too, for its whole life ([`State::Stream`]): its id is then unique
//! among the connection's calls and streams, and the sweeper, the connection's failure and a
//! caller giving up end it as they end a call.
//!
//! One lock covers the table; it is held for a few instructions at a time and never across an
//! `.await`. Ending a stream under it wakes the stream's senders and end waiter (whose polls
//! take the stream's own lock, never this one); a call's waiter is woken after it is released.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use rpc_core::wire::RemoteResultMessage;
use rpc_core::RpcError;

use super::stream::StreamShared;

/// What a waiting call receives: its answer, or why there is none.
pub(super) type Outcome = Result<RemoteResultMessage, RpcError>;

/// No sweep scheduled.
pub(super) const NO_SWEEP: u64 = u64::MAX;

/// The calls of one connection waiting for their answers; see the module documentation.
#[derive(Default)]
pub(super) struct PendingTable {
    inner: Mutex<Slab>,
}

#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    /// Indexes of free slots, the most recently freed last (its memory is warm).
    free: Vec<u32>,
    /// Slots in state `Waiting` or `Stream`.
    waiting: usize,
}

struct Slot {
    /// Bumped when the slot is freed; never 0, so no message id is 0.
    generation: u32,
    state: State,
    /// Milliseconds after the connection's epoch at which the call times out (0: never).
    deadline_ms: u64,
}

enum State {
    Free,
    /// The call waits; the waker of its last poll, if it was polled.
    Waiting(Option<Waker>),
    /// The outcome is there and the caller has not taken it yet.
    Done(Outcome),
    /// A stream, from its opening until it ends (its answer, its deadline, the connection's
    /// failure) or its consumer gives up.
    Stream(Arc<StreamShared>),
}

fn key(index: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(index)
}

fn split(key: u64) -> (usize, u32) {
    ((key & u64::from(u32::MAX)) as usize, (key >> 32) as u32)
}

impl Slab {
    /// The slot `key` names, if it still belongs to that call.
    fn slot(&mut self, key: u64) -> Option<&mut Slot> {
        let (index, generation) = split(key);
        self.slots
            .get_mut(index)
            .filter(|s| s.generation == generation && !matches!(s.state, State::Free))
    }

    fn free(&mut self, key: u64) {
        let (index, _) = split(key);
        if let Some(slot) = self.slots.get_mut(index) {
            if matches!(slot.state, State::Waiting(_) | State::Stream(_)) {
                self.waiting -= 1;
            }
            slot.state = State::Free;
            slot.generation = slot.generation.wrapping_add(1).max(1);
            self.free.push(index as u32);
        }
    }

    /// Ends a waiting call with `outcome`; the waker to wake once the lock is released.
    fn finish(&mut self, key: u64, outcome: Outcome) -> Option<Option<Waker>> {
        let slot = self.slot(key)?;
        if let State::Stream(stream) = &slot.state {
            // The stream's end: the slot is free once the stream has it.
            let stream = stream.clone();
            let waker = stream.end(outcome);
            self.free(key);
            return Some(waker);
        }
        let waker = match &mut slot.state {
            State::Waiting(waker) => waker.take(),
            // Already done, and not taken yet: the deadline passed first (the sweeper's
            // timeout, its Cancel sent), or an answer came before the sweeper got to it, or a
            // second answer for the id came. The first outcome stands.
            _ => return None,
        };
        slot.state = State::Done(outcome);
        self.waiting -= 1;
        Some(waker)
    }
}

impl PendingTable {
    fn lock(&self) -> MutexGuard<'_, Slab> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a slot for a new call, which times out at `deadline_ms` (0: never) and is woken
    /// through `waker` (given here when the call is made from its first poll, which saves
    /// locking the table once more to store it); returns the call's message id.
    pub(super) fn insert(&self, deadline_ms: u64, waker: Option<Waker>) -> u64 {
        let mut slab = self.lock();
        slab.waiting += 1;
        let state = State::Waiting(waker);
        if let Some(index) = slab.free.pop() {
            let slot = &mut slab.slots[index as usize];
            slot.state = state;
            slot.deadline_ms = deadline_ms;
            return key(index, slot.generation);
        }
        Self::push(&mut slab, state, deadline_ms)
    }

    /// Takes a slot for a new stream, which ends at `deadline_ms` (0: never); returns its
    /// message id.
    pub(super) fn insert_stream(&self, deadline_ms: u64, stream: Arc<StreamShared>) -> u64 {
        let mut slab = self.lock();
        slab.waiting += 1;
        let state = State::Stream(stream);
        if let Some(index) = slab.free.pop() {
            let slot = &mut slab.slots[index as usize];
            slot.state = state;
            slot.deadline_ms = deadline_ms;
            return key(index, slot.generation);
        }
        Self::push(&mut slab, state, deadline_ms)
    }

    /// The open stream `key` names, if it is one.
    pub(super) fn stream(&self, key: u64) -> Option<Arc<StreamShared>> {
        match &self.lock().slot(key)?.state {
            State::Stream(s) => Some(s.clone()),
            _ => None,
        }
    }

    fn push(slab: &mut Slab, state: State, deadline_ms: u64) -> u64 {
        // A u32 of slots is far more calls than a connection can hold in memory.
        let index = slab.slots.len() as u32;
        slab.slots.push(Slot {
            generation: 1,
            state,
            deadline_ms,
        });
        key(index, 1)
    }

    /// Hands `result` to the call it answers and wakes it; false when no call waits for it
    /// (it gave up, timed out, or the id is unknown): the answer is dropped.
    pub(super) fn complete(&self, message_id: u64, result: RemoteResultMessage) -> bool {
        let woken = self.lock().finish(message_id, Ok(result));
        match woken {
            Some(waker) => {
                if let Some(w) = waker {
                    w.wake();
                }
                true
            }
            None => false,
        }
    }

    /// The call's outcome once there; the slot is freed when it is taken.
    pub(super) fn poll(&self, key: u64, cx: &mut Context<'_>) -> Poll<Outcome> {
        let mut slab = self.lock();
        let Some(slot) = slab.slot(key) else {
            // Not reachable while the caller holds its guard; a clear answer all the same.
            return Poll::Ready(Err(RpcError::new(
                rpc_core::StatusCode::FrameworkError,
                "the call's slot in the pending table was lost; this is a bug",
            )));
        };
        match &mut slot.state {
            State::Waiting(waker) => {
                match waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
            State::Done(_) => {
                let State::Done(outcome) = std::mem::replace(&mut slot.state, State::Free) else {
                    unreachable!("matched as Done just above")
                };
                // `free` would count a Waiting slot out; this one was counted out when done.
                slab.free(key);
                Poll::Ready(outcome)
            }
            State::Stream(_) => Poll::Ready(Err(RpcError::new(
                rpc_core::StatusCode::FrameworkError,
                "a stream's slot was polled as a call's; this is a bug",
            ))),
            State::Free => unreachable!("`slot` never returns a free slot"),
        }
    }

    /// Frees the slot of a call that gives up; true when it was still waiting for its answer
    /// (then the server should be told to stop).
    pub(super) fn remove(&self, key: u64) -> bool {
        let mut slab = self.lock();
        let Some(slot) = slab.slot(key) else {
            return false;
        };
        let was_waiting = matches!(slot.state, State::Waiting(_) | State::Stream(_));
        slab.free(key);
        was_waiting
    }

    /// Calls waiting for their answers.
    pub(super) fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// Ends every waiting call with the error `make` builds for its message id.
    pub(super) fn fail_all(&self, make: impl Fn(u64) -> RpcError) {
        let mut wakers = Vec::new();
        {
            let mut slab = self.lock();
            let mut streams = Vec::new();
            for (index, slot) in slab.slots.iter_mut().enumerate() {
                let id = key(index as u32, slot.generation);
                match &mut slot.state {
                    State::Waiting(w) => {
                        wakers.extend(w.take());
                        slot.state = State::Done(Err(make(id)));
                    }
                    State::Stream(s) => {
                        wakers.extend(s.end(Err(make(id))));
                        streams.push(id);
                    }
                    _ => {}
                }
            }
            // Ended streams leave the table; their consumers have the end.
            for k in streams {
                slab.free(k);
            }
            slab.waiting = 0;
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Ends every waiting call whose deadline is at or before `now_ms` with the error `make`
    /// builds and pushes its message id to `expired`; returns the earliest deadline of the calls
    /// still waiting ([`NO_SWEEP`] if none has one).
    pub(super) fn expire(
        &self,
        now_ms: u64,
        make: impl Fn() -> RpcError,
        expired: &mut Vec<u64>,
    ) -> u64 {
        let mut wakers = Vec::new();
        let mut next = NO_SWEEP;
        {
            let mut slab = self.lock();
            let mut ended = 0;
            let mut streams = Vec::new();
            for (index, slot) in slab.slots.iter_mut().enumerate() {
                if !matches!(slot.state, State::Waiting(_) | State::Stream(_)) {
                    continue;
                }
                match slot.deadline_ms {
                    0 => {}
                    d if d <= now_ms => {
                        let k = key(index as u32, slot.generation);
                        match &mut slot.state {
                            State::Waiting(w) => {
                                wakers.extend(w.take());
                                slot.state = State::Done(Err(make()));
                                ended += 1;
                            }
                            State::Stream(s) => {
                                wakers.extend(s.end(Err(make())));
                                streams.push(k);
                            }
                            _ => {}
                        }
                        expired.push(k);
                    }
                    d => next = next.min(d),
                }
            }
            slab.waiting -= ended;
            // (`free` counts an ended stream out.)
            for k in streams {
                slab.free(k);
            }
        }
        wakers.into_iter().for_each(Waker::wake);
        next
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    use rpc_core::StatusCode;

    use super::*;

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn answer(id: u64) -> RemoteResultMessage {
        RemoteResultMessage {
            message_id: id,
            status_code: 200,
            ..Default::default()
        }
    }

    fn timeout() -> RpcError {
        RpcError::new(StatusCode::Timeout, "expired")
    }

    #[test]
    fn an_answer_wakes_its_caller_and_frees_the_slot() {
        let table = PendingTable::default();
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let id = table.insert(0, None);
        assert!(table.poll(id, &mut cx).is_pending());
        assert_eq!(table.waiting(), 1);
        assert!(table.complete(id, answer(id)));
        assert_eq!(count.0.load(Ordering::Relaxed), 1);
        assert_eq!(table.waiting(), 0);
        match table.poll(id, &mut cx) {
            Poll::Ready(Ok(r)) => assert_eq!(r.message_id, id),
            other => panic!("expected the answer, got {other:?}"),
        }
        // Freed: a second answer with the same id is dropped.
        assert!(!table.complete(id, answer(id)));
    }

    #[test]
    fn a_late_answer_for_a_recycled_slot_is_dropped() {
        let table = PendingTable::default();
        let old = table.insert(0, None);
        assert!(
            table.remove(old),
            "a waiting call that gives up tells the server"
        );
        let new = table.insert(0, None);
        assert_eq!(old & 0xffff_ffff, new & 0xffff_ffff, "the slot is reused");
        assert_ne!(old, new, "under another message id");
        assert!(
            !table.complete(old, answer(old)),
            "the late answer matches nothing"
        );
        assert_eq!(table.waiting(), 1, "the new call still waits");
        assert!(table.complete(new, answer(new)));
    }

    #[test]
    fn giving_up_after_the_answer_came_sends_no_cancel() {
        let table = PendingTable::default();
        let id = table.insert(0, None);
        assert!(table.complete(id, answer(id)));
        assert!(!table.remove(id));
        assert!(!table.remove(id), "removing twice is harmless");
    }

    #[test]
    fn expire_ends_only_calls_past_their_deadline_and_reports_the_next() {
        let table = PendingTable::default();
        let early = table.insert(10, None);
        let late = table.insert(30, None);
        let never = table.insert(0, None);
        let mut expired = Vec::new();
        assert_eq!(table.expire(20, timeout, &mut expired), 30);
        assert_eq!(expired, vec![early]);
        assert_eq!(table.waiting(), 2);
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert!(matches!(
            table.poll(early, &mut cx),
            Poll::Ready(Err(e)) if e.code() == StatusCode::Timeout
        ));
        assert!(
            !table.complete(early, answer(early)),
            "its answer comes too late"
        );
        table.fail_all(|_| RpcError::new(StatusCode::CommunicationError, "gone"));
        assert_eq!(table.waiting(), 0);
        for id in [late, never] {
            assert!(matches!(
                table.poll(id, &mut cx),
                Poll::Ready(Err(e)) if e.code() == StatusCode::CommunicationError
            ));
        }
    }

    /// The sweeper ended the call with a timeout (and sent Cancel); its answer, already on its
    /// way, is read before the caller takes the timeout: the timeout stands, and so does a
    /// first answer against a second for the same id.
    #[test]
    fn an_outcome_not_taken_yet_is_not_replaced_by_a_later_answer() {
        let table = PendingTable::default();
        let timed_out = table.insert(10, None);
        let answered = table.insert(0, None);
        let mut expired = Vec::new();
        table.expire(20, timeout, &mut expired);
        assert_eq!(expired, vec![timed_out]);
        assert!(!table.complete(timed_out, answer(timed_out)), "too late");
        assert!(table.complete(answered, answer(answered)));
        let mut second = answer(answered);
        second.status_code = 500;
        assert!(!table.complete(answered, second), "a second answer");
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(
            table.poll(timed_out, &mut cx),
            Poll::Ready(Err(e)) if e.code() == StatusCode::Timeout
        ));
        assert!(matches!(
            table.poll(answered, &mut cx),
            Poll::Ready(Ok(r)) if r.status_code == answer(answered).status_code
        ));
        assert_eq!(table.waiting(), 0);
    }

    #[test]
    fn a_settled_connection_allocates_nothing_per_call() {
        let table = PendingTable::default();
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        // 64 calls in flight at once, then the same number again and again.
        let mut ids: Vec<u64> = (0..64).map(|_| table.insert(0, None)).collect();
        for id in ids.drain(..) {
            table.remove(id);
        }
        let before = crate::alloc_count::this_thread();
        for _ in 0..1_000 {
            for _ in 0..64 {
                ids.push(table.insert(5, None));
            }
            for &id in &ids {
                assert!(table.poll(id, &mut cx).is_pending());
                table.complete(id, answer(id));
                assert!(table.poll(id, &mut cx).is_ready());
            }
            ids.clear();
        }
        assert_eq!(crate::alloc_count::this_thread() - before, 0);
    }
}
