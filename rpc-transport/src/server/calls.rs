//! The calls running on one connection: their tasks, matched by `message_id` for `Cancel`,
//! and their answers.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use futures_util::FutureExt;
use rpc_core::wire::{frame::Kind, RemoteResultMessage};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::handler::Dispatch;
use crate::writer::FrameSender;

pub(super) struct Conn {
    pub(super) sender: FrameSender,
    pub(super) in_flight: Arc<AtomicUsize>,
    pub(super) tasks: Mutex<HashMap<u64, JoinHandle<()>, ahash::RandomState>>,
    pub(super) idle: Notify,
    /// Woken when a spawned call finishes (for a reader paused at the in-flight limit).
    pub(super) finished: Notify,
    /// Calls refused in a row at the in-flight limit.
    pub(super) refused_in_a_row: AtomicU32,
    /// Calls that broke the attachment limits.
    pub(super) abuses: AtomicU32,
    /// Set when the reader started a call task that is to give way before it runs (see
    /// [`Handoff`]): the reader does so once, before it waits for more frames.
    pub(super) give_way: AtomicBool,
}

impl Conn {
    pub(super) fn tasks(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, JoinHandle<()>, ahash::RandomState>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(super) struct ConnCleanup {
    pub(super) conn: Arc<Conn>,
    pub(super) close: CancellationToken,
}

impl Drop for ConnCleanup {
    fn drop(&mut self) {
        // Work for a client that is gone (or past the drain deadline) is dropped.
        for (_, h) in self.conn.tasks().drain() {
            h.abort();
        }
        self.close.cancel();
    }
}

/// Where the answer to one call goes. [`InvokeHandler::dispatch`](super::InvokeHandler::dispatch)
/// receives one with each call and either answers at once ([`answer`](Self::answer)) or
/// starts the call's future ([`spawn`](Self::spawn)).
///
/// A call future runs in a task of its own, so that a handler blocking before its first
/// `.await` stalls only itself, never the connection's reader; `Cancel` aborts that task.
pub struct Responder<'a> {
    to: To<'a>,
}

enum To<'a> {
    /// A call read from a connection, answered on it.
    Conn {
        conn: &'a Arc<Conn>,
        id: u64,
        inline_first_poll: bool,
    },
    /// Kept as a [`Dispatch`] ([`Responder::capture`]).
    Capture(&'a mut Option<Dispatch>),
}

impl<'a> Responder<'a> {
    pub(super) fn new(conn: &'a Arc<Conn>, id: u64, inline_first_poll: bool) -> Self {
        Responder {
            to: To::Conn {
                conn,
                id,
                inline_first_poll,
            },
        }
    }

    /// A responder that keeps what it is given in `slot`, as a [`Dispatch`] (a spawned future
    /// boxed): for a handler's [`handle`](super::InvokeHandler::handle) written in terms of its
    /// `dispatch`.
    pub fn capture(slot: &'a mut Option<Dispatch>) -> Self {
        Responder {
            to: To::Capture(slot),
        }
    }

    /// Answers the call with `result` (its `message_id` is filled in).
    pub fn answer(self, result: RemoteResultMessage) {
        match self.to {
            To::Conn { conn, id, .. } => send_result(conn, id, result),
            To::Capture(slot) => *slot = Some(Dispatch::Ready(result)),
        }
    }

    /// Runs `call` in a task of its own and answers with its output; `Cancel` aborts the task.
    ///
    /// The future is spawned as it is: keep it small (a few hundred bytes), since the task
    /// holding it is allocated per call, and allocations of more than about 1 KiB take the
    /// allocator's slow paths. Unless the server polls handlers inline
    /// (`ServerOptions::inline_first_poll`), the connection's reader gives way once before it
    /// waits for more frames (see `Handoff`), so that a handler blocking in its first poll
    /// does not stall the connection.
    pub fn spawn<F>(self, call: F)
    where
        F: Future<Output = RemoteResultMessage> + Send + 'static,
    {
        match self.to {
            To::Conn {
                conn,
                id,
                inline_first_poll,
            } => spawn_call(conn, id, !inline_first_poll, call),
            To::Capture(slot) => *slot = Some(Dispatch::Spawn(Box::pin(call))),
        }
    }

    /// Answers or starts the call as `dispatch` says. With `inline_first_poll`, a future is
    /// polled once here first, and spawned only if it has to wait.
    pub fn dispatch(self, dispatch: Dispatch) {
        match dispatch {
            Dispatch::Ready(r) => self.answer(r),
            Dispatch::Spawn(mut fut) => {
                if let To::Conn {
                    conn,
                    id,
                    inline_first_poll: true,
                } = &self.to
                {
                    // (The spawned task polls again with its own waker, so nothing is lost by
                    // this first poll's no-op waker.)
                    let mut cx = Context::from_waker(Waker::noop());
                    if let Poll::Ready(r) = fut.as_mut().poll(&mut cx) {
                        send_result(conn, *id, r);
                        return;
                    }
                }
                self.spawn(fut)
            }
        }
    }
}

fn send_result(conn: &Conn, id: u64, mut r: RemoteResultMessage) {
    r.message_id = id;
    conn.sender.send(Kind::Result(r));
}

/// Starts one call's task; with `hand_off`, the reader gives way before it waits for more
/// frames (see [`Handoff`]).
fn spawn_call<F>(conn: &Arc<Conn>, id: u64, hand_off: bool, call: F)
where
    F: Future<Output = RemoteResultMessage> + Send + 'static,
{
    conn.in_flight.fetch_add(1, Ordering::AcqRel);
    if hand_off {
        conn.give_way.store(true, Ordering::Relaxed);
    }
    // The map stays locked until the task's handle is in it: the task looks itself up there
    // when it finishes.
    let mut tasks = conn.tasks();
    let task_conn = conn.clone();
    // A combinator rather than an `async` block, which would hold `call` twice (as captured
    // and as awaited): the task is allocated, and moved within tokio, for every call.
    let task = tokio::spawn(call.map(move |r| task_conn.finish(id, r)));
    tasks.insert(id, task);
}

impl Conn {
    /// Answers a call whose task ended with `r`, unless a `Cancel` got there first (it aborted
    /// the task, which then ends at its next `.await`, and already counted the call out).
    fn finish(&self, id: u64, r: RemoteResultMessage) {
        if self.tasks().remove(&id).is_some() {
            send_result(self, id, r);
            if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.idle.notify_one();
            }
            self.finished.notify_one();
        }
    }
}

/// Makes the connection's reader give way once after it started call tasks, before it waits
/// for more frames, so that a handler which blocks its thread before its first `.await` does
/// not stall the rest of the connection.
///
/// A task spawned by the reader goes into its worker's "next task" slot, which other workers
/// cannot steal from and which wakes no idle worker; the worker runs it as soon as the reader
/// waits. Were that handler to block, the worker would be held, and with it the I/O driver it
/// may have been the last to run: no other worker would be woken to read the connection. A
/// task that wakes itself and returns `Pending` is put at the back of the run queue instead,
/// which wakes an idle worker (when there is one) to take the reader over. One give-way per
/// batch of frames read, rather than one per call task, keeps that promise: only the last
/// task spawned is in the slot, and the reader is in the queue, stealable, before it runs.
pub(super) struct Handoff(bool);

impl Handoff {
    pub(super) fn new() -> Self {
        Handoff(false)
    }
}

impl std::future::Future for Handoff {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
