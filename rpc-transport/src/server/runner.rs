//! Call tasks, reused. Every call runs in a task of its own, so that a handler blocking before
//! its first `.await` stalls only itself; but tokio aligns each task to 128 bytes, which
//! glibc's allocator serves through `posix_memalign`, its slow path: about 800 instructions
//! per call with the free, more than the rest of spawning. So a task whose call has ended does
//! not end with it: it waits, idle, for the next call of its connection. A connection keeps as
//! many such tasks as it had calls running at once (at most its in-flight limit), and they end
//! with it. A call is handed to its task boxed, a small allocation served from the
//! allocator's per-thread cache.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;
use rpc_core::wire::RemoteResultMessage;
use rpc_core::StatusCode;

use super::handler::error_result;

/// A call's future as its task runs it.
pub(super) type CallFuture = Pin<Box<dyn Future<Output = RemoteResultMessage> + Send>>;

/// What owns call tasks (a connection): where their answers go, and where they wait idle.
pub(super) trait CallSink: Send + Sync + 'static {
    /// Answers call `id`, the call of `tag`, with `answer` (unless `Cancel` got there first,
    /// or the id now names another call).
    fn finish(&self, id: u64, tag: CallTag, answer: RemoteResultMessage);
    /// The idle call tasks.
    fn runners(&self) -> &Runners;
}

/// One reusable call task, as the connection sees it.
#[derive(Default)]
struct Runner {
    state: Mutex<State>,
    waker: AtomicWaker,
}

#[derive(Default)]
struct State {
    /// A call handed over, not yet taken up by the task.
    next: Option<(u64, CallFuture)>,
    /// Counts the calls handed over: the generation of the latest.
    generation: u64,
    /// The generation of the call `Cancel` aborted last (0: none).
    cancelled: u64,
    /// Why that call was aborted.
    cancelled_by: DropCause,
    /// From the hand-over of a call until the task is idle again.
    busy: bool,
    /// The connection ended: the task ends.
    stop: bool,
}

impl Runner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands `call` over; returns its generation.
    fn start(&self, id: u64, call: CallFuture) -> u64 {
        let generation = {
            let mut s = self.state();
            s.generation += 1;
            s.next = Some((id, call));
            s.busy = true;
            s.generation
        };
        self.waker.wake();
        generation
    }

    /// Drops the call of `generation`, at once if its task has not taken it up yet, else at the
    /// task's next poll (as aborting a task would), marked with `cause` while it is dropped.
    fn cancel(&self, generation: u64, cause: DropCause) {
        let dropped = {
            let mut s = self.state();
            s.cancelled = generation;
            s.cancelled_by = cause;
            if s.generation == generation {
                s.next.take()
            } else {
                None
            }
        };
        drop_call(dropped, cause);
        self.waker.wake();
    }

    /// Ends the task, dropping its call if it has one.
    fn stop(&self) {
        let dropped = {
            let mut s = self.state();
            s.stop = true;
            s.next.take()
        };
        drop(dropped);
        self.waker.wake();
    }
}

/// Which call a task ran: its task and the call's generation there. A client may send a new
/// call under the id of one it cancelled while that call's task is still finishing: the tag
/// tells the two apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CallTag {
    runner: usize,
    generation: u64,
}

impl CallTag {
    fn of(runner: &Arc<Runner>, generation: u64) -> Self {
        CallTag {
            runner: Arc::as_ptr(runner) as usize,
            generation,
        }
    }
}

/// A call running in a reused task: what `Cancel` aborts it with.
pub(super) struct Running {
    runner: Arc<Runner>,
    generation: u64,
}

impl Running {
    /// Which call this is.
    pub(super) fn tag(&self) -> CallTag {
        CallTag::of(&self.runner, self.generation)
    }

    /// Drops the call's future (and with it the handler) at its task's next poll.
    pub(super) fn abort(&self) {
        self.runner.cancel(self.generation, DropCause::Cancel);
    }

    /// As [`abort`](Self::abort), because another attempt of the same call answered first
    /// (`Cancel` said so): while the future is dropped, [`dropped_as_superseded`] says so.
    pub(super) fn abort_superseded(&self) {
        self.runner.cancel(self.generation, DropCause::Superseded);
    }

    /// As [`abort`](Self::abort), because the server's drain deadline passed: while the future
    /// is dropped, [`dropped_at_drain_deadline`] says so.
    pub(super) fn abort_at_drain_deadline(&self) {
        self.runner.cancel(self.generation, DropCause::Drain);
    }

    /// As [`abort`](Self::abort), because the server stopped at once: while the future is
    /// dropped, [`dropped_at_server_abort`] says so.
    pub(super) fn abort_at_server_abort(&self) {
        self.runner.cancel(self.generation, DropCause::Abort);
    }
}

/// The idle call tasks of one connection.
#[derive(Default)]
pub(super) struct Runners {
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    runners: Vec<Arc<Runner>>,
    /// The connection ended: tasks that become idle end instead.
    closed: bool,
}

impl Runners {
    fn idle(&self) -> MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends every idle task, and every task that becomes idle from now on.
    pub(super) fn close(&self) {
        let runners = {
            let mut idle = self.idle();
            idle.closed = true;
            std::mem::take(&mut idle.runners)
        };
        for r in runners {
            r.stop();
        }
    }

    fn put_back(&self, runner: Arc<Runner>) {
        let mut idle = self.idle();
        if idle.closed {
            drop(idle);
            runner.stop();
        } else {
            idle.runners.push(runner);
        }
    }
}

/// Runs call `id` of `conn` in an idle task of the connection, or in a new one.
pub(super) fn start<C: CallSink>(conn: &Arc<C>, id: u64, call: CallFuture) -> Running {
    let idle = conn.runners().idle().runners.pop();
    let runner = match idle {
        Some(runner) => runner,
        None => {
            let runner = Arc::new(Runner::default());
            tokio::spawn(RunnerTask {
                runner: runner.clone(),
                conn: conn.clone(),
                current: None,
            });
            runner
        }
    };
    let generation = runner.start(id, call);
    Running { runner, generation }
}

/// Polls call `id`'s future; a panic in it (code outside a handler's own guard: a raw
/// `InvokeHandler`, a layer's end hook) is the call's answer, 520, instead of ending the task
/// with the call's slot still taken and the call unanswered.
pub(super) fn poll_guarded(
    call: &mut CallFuture,
    cx: &mut Context<'_>,
    id: u64,
) -> Poll<RemoteResultMessage> {
    match std::panic::catch_unwind(AssertUnwindSafe(|| call.as_mut().poll(cx))) {
        Ok(polled) => polled,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(message_id = id, panic = %what, "a call's future panicked");
            Poll::Ready(error_result(
                StatusCode::ServerError,
                "the server failed while running the call (a panic, in its log); it may have \
                 partly run",
            ))
        }
    }
}

/// Why a call's future is dropped before it finished.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum DropCause {
    /// The caller's `Cancel` (with no reason, or one this server does not read), or the
    /// connection's end.
    #[default]
    Cancel,
    /// The caller's `Cancel` saying another attempt of the call answered first.
    Superseded,
    /// The server's drain deadline.
    Drain,
    /// The server stopped at once (its serving future dropped: `ServerHandle::abort`, or the
    /// runtime it served on shutting down).
    Abort,
}

thread_local! {
    /// Set while a call's future is dropped for another cause than a plain `Cancel`.
    static DROPPING: std::cell::Cell<DropCause> = const { std::cell::Cell::new(DropCause::Cancel) };
}

/// Whether the call being dropped on this thread is dropped because the server's drain
/// deadline passed before it finished (its caller is answered 520), rather than by the
/// caller's `Cancel` or the connection's end. For code that runs as a handler is dropped (a
/// `Drop` impl, the server's own telemetry), which could not tell the two apart otherwise.
pub fn dropped_at_drain_deadline() -> bool {
    DROPPING.with(std::cell::Cell::get) == DropCause::Drain
}

/// Whether the call being dropped on this thread is dropped because its caller's `Cancel`
/// said another attempt of the same call (a hedge) answered first: the call succeeded, and
/// this attempt's work was no longer needed. For the same code as
/// [`dropped_at_drain_deadline`].
pub fn dropped_as_superseded() -> bool {
    DROPPING.with(std::cell::Cell::get) == DropCause::Superseded
}

/// Whether the call being dropped on this thread is dropped because its server stopped at
/// once (the future serving it was dropped, as `ServerHandle::abort` does, or the runtime it
/// ran on shut down) rather than by the caller's `Cancel` or its connection's end: the caller
/// is not answered, and did not ask for the call to end. For the same code as [`dropped_at_drain_deadline`].
pub fn dropped_at_server_abort() -> bool {
    DROPPING.with(std::cell::Cell::get) == DropCause::Abort
}

/// Drops a call taken from its task, marked with `cause` while it is dropped.
fn drop_call<T>(call: Option<T>, cause: DropCause) {
    let Some(call) = call else { return };
    if cause == DropCause::Cancel {
        drop(call);
        return;
    }
    /// Clears the mark however the drop ends (a handler's `Drop` may panic).
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            DROPPING.with(|c| c.set(DropCause::Cancel));
        }
    }
    DROPPING.with(|c| c.set(cause));
    let _clear = Clear;
    if cause == DropCause::Superseded {
        // The calls this one made in turn (a middle tier's) were superseded too: their
        // `Cancel` says so to the tiers below.
        rpc_core::superseded::superseding(|| drop(call));
    } else {
        drop(call);
    }
}

/// The task: takes up each call handed over, runs it, answers it, and becomes idle again.
struct RunnerTask<C> {
    runner: Arc<Runner>,
    conn: Arc<C>,
    /// The call being run: its id, generation and future.
    current: Option<(u64, u64, CallFuture)>,
}

impl<C> Drop for RunnerTask<C> {
    /// A task ends only when told to, idle: dropped with a call (running, or handed over and
    /// not taken up), it was dropped by its runtime shutting down, and the server with it.
    /// Its calls are dropped as by the server's abort, unless one was already aborted for a
    /// cause of its own (the drain deadline, a superseded attempt) and not dropped yet.
    fn drop(&mut self) {
        let current = self.current.take();
        let (cause, next) = {
            let mut s = self.runner.state();
            let cause = match &current {
                Some((_, generation, _))
                    if *generation == s.cancelled && s.cancelled_by != DropCause::Cancel =>
                {
                    s.cancelled_by
                }
                _ => DropCause::Abort,
            };
            (cause, s.next.take())
        };
        drop_call(current, cause);
        drop_call(next, DropCause::Abort);
    }
}

impl<C: CallSink> Future for RunnerTask<C> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        loop {
            this.runner.waker.register(cx.waker());
            let mut cancelled = None;
            let mut cause = DropCause::Cancel;
            let mut now_idle = false;
            {
                let mut s = this.runner.state();
                if matches!(&this.current, Some((_, g, _)) if *g == s.cancelled) {
                    cancelled = this.current.take();
                    cause = s.cancelled_by;
                }
                if s.stop {
                    // A call aborted with a cause (the drain deadline, a superseded attempt)
                    // just before the connection ended is still dropped with it.
                    drop(s);
                    drop_call(cancelled, cause);
                    return Poll::Ready(());
                }
                if this.current.is_none() {
                    match s.next.take() {
                        Some((id, call)) => this.current = Some((id, s.generation, call)),
                        None => now_idle = std::mem::replace(&mut s.busy, false),
                    }
                }
            }
            // Outside the lock: dropping a handler runs its code.
            drop_call(cancelled, cause);
            if now_idle {
                this.conn.runners().put_back(this.runner.clone());
            }
            let Some((id, generation, call)) = &mut this.current else {
                return Poll::Pending;
            };
            let (id, tag) = (*id, CallTag::of(&this.runner, *generation));
            let answer = match poll_guarded(call, cx, id) {
                Poll::Ready(answer) => answer,
                Poll::Pending => return Poll::Pending,
            };
            let done = this.current.take();
            // Answered first (an ended future holds nothing its caller waits on: an async
            // block drops its state as it ends, a call releases its permit before its answer):
            // the drain deadline, sweeping the calls still listed, would otherwise answer 520
            // for a call whose answer is made, and that answer would be dropped.
            this.conn.finish(id, tag, answer);
            // (A future that panicked may panic again as it is dropped: the task goes on.)
            let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(done)));
        }
    }
}
