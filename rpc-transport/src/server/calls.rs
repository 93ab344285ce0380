//! The calls running on one connection: their tasks, matched by `message_id` for `Cancel`,
//! and their answers.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use rpc_core::wire::{frame::Kind, RemoteResultMessage};
use rpc_core::StatusCode;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::handler::error_result;
use super::handler::Dispatch;
use super::runner::{self, CallFuture, CallSink, CallTag, Runners, Running};
use super::streams::{Events, StreamDriver, StreamSlot, StreamTable};
use crate::writer::FrameSender;

pub(super) struct Conn {
    pub(super) sender: FrameSender,
    pub(super) in_flight: Arc<AtomicUsize>,
    /// The calls running, by id: what `Cancel` aborts them with.
    pub(super) tasks: Mutex<HashMap<u64, Running, ahash::RandomState>>,
    /// The connection's idle call tasks.
    pub(super) runners: Runners,
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
    /// The streams open on the connection, for the credit and items the client sends them.
    pub(super) streams: Arc<StreamTable>,
    /// The client's `Hello.stream_window` when it can stream; `None`: it cannot, and is sent
    /// no stream frame.
    pub(super) client_window: Option<u32>,
    /// The client's `Hello.stream_window_bytes` when the server keeps byte windows (0: items
    /// only).
    pub(super) client_window_bytes: u64,
    /// The client takes `StreamItems` frames (`Hello.stream_batches`).
    pub(super) client_batches: bool,
    /// `ServerOptions::max_unsent_bytes`: beyond it, the connection stops reading and its
    /// streams stop producing.
    pub(super) max_unsent_bytes: usize,
    /// How long a stream whose caller sent no deadline (or a stream of plain events, which
    /// cannot end itself at its deadline) may wait on its client with no progress (for
    /// credit, or for room in the send queue) before it ends: the connection's idle time
    /// (`ServerOptions::idle_timeout`; 0, `None`: for ever, as idleness never closes the
    /// connection then).
    pub(super) stall_limit: Option<Duration>,
}

impl Conn {
    pub(super) fn tasks(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, Running, ahash::RandomState>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(super) struct ConnCleanup {
    pub(super) conn: Arc<Conn>,
    pub(super) close: CancellationToken,
    /// The server's `Served::stopped_at_once`.
    pub(super) stopped_at_once: Arc<AtomicBool>,
}

impl Drop for ConnCleanup {
    fn drop(&mut self) {
        // Work for a client that is gone (or past the drain deadline) is dropped; so is all
        // work when the server stops at once, which its telemetry tells from a cancellation.
        let stopped_at_once = self.stopped_at_once.load(Ordering::Acquire);
        let mut dropped = 0;
        for (_, h) in self.conn.tasks().drain() {
            if stopped_at_once {
                h.abort_at_server_abort();
            } else {
                h.abort();
            }
            dropped += 1;
        }
        if dropped > 0 {
            // Calls read and not answered (the server stopped at once, or its task was
            // aborted): should the client still read, it learns they may have run, whatever
            // GoAway came before (a drain's 200 says every call read is answered).
            self.conn.sender.send(super::handler::go_away(
                StatusCode::ServerError,
                format!(
                    "the connection ended with {dropped} calls still running: they were \
                     dropped unanswered and may have partly run"
                ),
            ));
        }
        self.conn.runners.close();
        self.close.cancel();
    }
}

fn send_result(conn: &Conn, id: u64, mut r: RemoteResultMessage) {
    r.message_id = id;
    conn.sender.send(Kind::Result(r));
}

/// Answers or starts one call. The call's future runs in a task of its own (a reused one: see
/// `runner`), so that a handler blocking before its first `.await` stalls only itself, never
/// the connection's reader; with `inline_first_poll` it is polled once here first, and handed
/// to a task only if it has to wait.
pub(super) fn dispatch(
    conn: &Arc<Conn>,
    outcome: Dispatch,
    id: u64,
    inline_first_poll: bool,
    (slot, no_deadline): (Option<Arc<StreamSlot>>, bool),
) {
    if !matches!(outcome, Dispatch::Stream(_) | Dispatch::Events(_)) {
        // A stream refused (or answered as a call): its client's items go nowhere, and a
        // handler still reading them (a `Spawn` summing them) is told so rather than waiting.
        if let Some(slot) = &slot {
            conn.streams.close(id, slot);
            slot.close_with(
                "the server answered this stream as a unary call (not with Dispatch::Stream or \
                 Events): none of the caller's items will come",
            );
        }
    }
    match outcome {
        Dispatch::Ready(r) => send_result(conn, id, r),
        Dispatch::Spawn(mut fut) => {
            // (The task polls again with its own waker, so nothing is lost by this first
            // poll's no-op waker.)
            if inline_first_poll {
                let mut cx = Context::from_waker(Waker::noop());
                if let Poll::Ready(r) = super::runner::poll_guarded(&mut fut, &mut cx, id) {
                    send_result(conn, id, r);
                    return;
                }
            } else {
                // The reader gives way before it waits for more frames (see `Handoff`).
                conn.give_way.store(true, Ordering::Relaxed);
            }
            spawn(conn, id, fut);
        }
        Dispatch::Polled(fut) => {
            conn.give_way.store(true, Ordering::Relaxed);
            spawn(conn, id, fut);
        }
        // Plain events cannot end themselves at their deadline while the stream waits on its
        // client (no credit, no room): the stall limit bounds that wait, deadline or not.
        Dispatch::Stream(events) => stream(conn, id, Events::Plain(events), (slot, true)),
        Dispatch::Events(events) => stream(conn, id, Events::Into(events), (slot, no_deadline)),
    }
}

/// Runs stream `id` answering its call with `events` in a task of the connection; with
/// `stalls`, a wait on its client ends at the stall limit (the idle timeout).
fn stream(
    conn: &Arc<Conn>,
    id: u64,
    events: Events,
    (slot, stalls): (Option<Arc<StreamSlot>>, bool),
) {
    let Some(window) = conn.client_window else {
        // (The reader refuses stream opens from such clients before the handler.)
        send_result(
            conn,
            id,
            error_result(
                rpc_core::StatusCode::FrameworkError,
                "the server answered with a stream, but this connection did not \
                 negotiate streams (Hello.streams)",
            ),
        );
        return;
    };
    conn.give_way.store(true, Ordering::Relaxed);
    let driver = StreamDriver::new(
        id,
        events,
        (window, conn.client_window_bytes, conn.client_batches),
        slot,
        &conn.streams,
        (
            conn.sender.clone(),
            conn.max_unsent_bytes,
            conn.stall_limit.filter(|_| stalls),
        ),
    );
    spawn(conn, id, Box::pin(driver));
}

/// Runs call `id` in a task of the connection, counted in flight until it ends.
fn spawn(conn: &Arc<Conn>, id: u64, fut: CallFuture) {
    conn.in_flight.fetch_add(1, Ordering::AcqRel);
    // The map stays locked until the call is in it: its task looks it up there when it
    // finishes.
    let mut tasks = conn.tasks();
    let running = runner::start(conn, id, fut);
    tasks.insert(id, running);
}

impl CallSink for Conn {
    fn finish(&self, id: u64, tag: CallTag, r: RemoteResultMessage) {
        Conn::finish(self, id, tag, r)
    }

    fn runners(&self) -> &Runners {
        &self.runners
    }
}

impl Conn {
    /// Answers the call of `tag` whose task ended with `r`, unless a `Cancel` got there first
    /// (it aborted the call, which then ends at its task's next poll, and already counted the
    /// call out) and the id may now name another call, which keeps its place.
    pub(super) fn finish(&self, id: u64, tag: CallTag, r: RemoteResultMessage) {
        let mut tasks = self.tasks();
        let finished = match tasks.entry(id) {
            Entry::Occupied(running) if running.get().tag() == tag => {
                running.remove();
                true
            }
            _ => false,
        };
        if finished {
            // Queued before the calls are let go: a drain taking the calls still running at
            // its deadline finds this one running (and answers it) or answered, never gone
            // from the calls with its answer not yet queued (lost once the writer stops).
            send_result(self, id, r);
            drop(tasks);
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
