//! The calls running on one connection: their tasks, matched by `message_id` for `Cancel`,
//! and their answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use rpc_core::wire::frame::Kind;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;

use super::handler::Dispatch;
use crate::writer::FrameSender;

pub(super) struct Conn {
    pub(super) sender: FrameSender,
    pub(super) in_flight: Arc<AtomicUsize>,
    pub(super) tasks: Mutex<HashMap<u64, AbortHandle, ahash::RandomState>>,
    pub(super) idle: Notify,
    /// Woken when a spawned call finishes (for a reader paused at the in-flight limit).
    pub(super) finished: Notify,
    /// Calls refused in a row at the in-flight limit.
    pub(super) refused_in_a_row: AtomicU32,
    /// Calls that broke the attachment limits.
    pub(super) abuses: AtomicU32,
}

impl Conn {
    pub(super) fn tasks(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, AbortHandle, ahash::RandomState>> {
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

/// Answers or starts one call. The handler runs in a task of its own, so that one blocking
/// before its first `.await` stalls only itself, never the connection's reader; with
/// `inline_first_poll` it is polled once here first and spawned only if it has to wait.
pub(super) fn dispatch(conn: &Arc<Conn>, outcome: Dispatch, id: u64, inline_first_poll: bool) {
    match outcome {
        Dispatch::Ready(mut r) => {
            r.message_id = id;
            conn.sender.send(Kind::Result(r));
        }
        Dispatch::Spawn(mut fut) => {
            // (The spawned task polls again with its own waker, so nothing is lost by this
            // first poll's no-op waker.)
            if inline_first_poll {
                let mut cx = Context::from_waker(Waker::noop());
                if let Poll::Ready(mut r) = fut.as_mut().poll(&mut cx) {
                    r.message_id = id;
                    conn.sender.send(Kind::Result(r));
                    return;
                }
            }
            conn.in_flight.fetch_add(1, Ordering::AcqRel);
            // The map stays locked until the task's handle is in it: the task looks itself up
            // there when it finishes.
            let mut tasks = conn.tasks();
            let task_conn = conn.clone();
            let task = tokio::spawn(async move {
                let conn = task_conn;
                if !inline_first_poll {
                    Handoff(false).await;
                }
                let mut r = fut.await;
                // Absent when a Cancel got there first (it aborted the task, which then ends at
                // its next `.await`, and already counted the call out).
                if conn.tasks().remove(&id).is_some() {
                    r.message_id = id;
                    conn.sender.send(Kind::Result(r));
                    if conn.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
                        conn.idle.notify_one();
                    }
                    conn.finished.notify_one();
                }
            });
            tasks.insert(id, task.abort_handle());
        }
    }
}

/// Makes a freshly spawned call task give way once before it polls the handler, so that a
/// handler which then blocks its thread does not stall the rest of the server.
///
/// A task spawned by the reader goes into its worker's "next task" slot, which other workers
/// cannot steal from and which wakes no idle worker. Were the handler to block in that first
/// run, the worker would be held, and with it the I/O driver it may have been the last to run:
/// no other worker would be woken to read the connection. A task that wakes itself and returns
/// `Pending` is put at the back of the run queue instead, which wakes an idle worker (when
/// there is one) to take over reading.
pub(super) struct Handoff(bool);

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
