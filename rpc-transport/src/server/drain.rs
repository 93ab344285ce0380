//! Graceful shutdown of one connection: `GoAway`, then the calls in flight finish or are
//! answered at the drain deadline.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rpc_core::wire::frame::Kind;
use rpc_core::wire::Ping;
use rpc_core::StatusCode;
use tokio::io::AsyncRead;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::admission::FrameCtx;
use super::handler::{draining, error_result, go_away};
use super::options::{ServerOptions, PAUSED_KEEPALIVE};
use crate::reader::FrameReader;

/// How long a drained connection waits for the client to close before closing itself.
pub(super) const DRAIN_LINGER: Duration = Duration::from_millis(500);

/// Shutdown: `GoAway`, then wait for the calls in flight (reading on, for `Cancel`) until the
/// server's drain deadline `hard`; calls still running then are answered 520 and dropped.
/// Ends with a last `GoAway` 200 once every call read is answered and no more is read (the
/// client may then send its unanswered calls elsewhere: the server never read them); or
/// returns why the connection ends otherwise, as the main loop's end does (`None`: nothing
/// more can be written).
pub(super) async fn drain<R: AsyncRead + Unpin>(
    ctx: &FrameCtx<'_>,
    frames: &mut FrameReader<R>,
    options: &ServerOptions,
    hard: Instant,
) -> Option<String> {
    let conn = ctx.conn;
    conn.sender.send(draining("server shutting down"));
    if let Err(end) = drain_calls(ctx, frames, options, hard).await {
        return end;
    }
    conn.sender.send(go_away(
        StatusCode::Success,
        "server shut down: every call it read was answered",
    ));
    None
}

/// The drain's wait for the calls in flight: `Ok` once every call read is answered and no
/// more will be read, else why not (see [`drain`]).
async fn drain_calls<R: AsyncRead + Unpin>(
    ctx: &FrameCtx<'_>,
    frames: &mut FrameReader<R>,
    options: &ServerOptions,
    hard: Instant,
) -> Result<(), Option<String>> {
    let conn = ctx.conn;
    let deadline = tokio::time::sleep_until(hard);
    tokio::pin!(deadline);
    let mut lingering = false;
    // The client closed its side (a half-close: it sends nothing more and still reads). The
    // calls in flight are still answered: closing now would drop them after GoAway 200, which
    // tells the client they never ran, and it would send them elsewhere.
    let mut input_ended = false;
    loop {
        // In this order: a call finishing queues its answer before it leaves the calls in
        // flight, so once none is in flight (read first), the bytes read next include every
        // answer; read the other way round, an answer queued in between would start the
        // linger with it unsent, and a slow reader would lose it.
        let finished = conn.in_flight.load(Ordering::Acquire) == 0;
        let unsent = conn.sender.backlog().bytes();
        if finished && unsent == 0 && input_ended {
            // Every answer written, and nothing more can come to read.
            return Ok(());
        }
        if !lingering && finished && unsent == 0 {
            // Nothing left to finish, and every answer written (a client reading slowly gets
            // them all before the connection closes: the drain deadline, not the linger, ends
            // its wait). Keep reading a little, answering calls sent before the client saw
            // GoAway ("not run"), until the client closes: closing with its calls unread in
            // our buffer would reset the connection and could destroy the GoAway.
            lingering = true;
            deadline
                .as_mut()
                .reset(hard.min(Instant::now() + DRAIN_LINGER));
        }
        // Each call read now is answered "not run": from a client that leaves its answers
        // unread, no more is read until the queue is back within its limit, as before the drain.
        let backlogged = unsent > options.max_unsent_bytes;
        if backlogged || input_ended {
            // Not read meanwhile (see `FrameReader::stop_waiting`).
            frames.stop_waiting();
        }
        let next = tokio::select! {
            biased;
            _ = conn.idle.notified() => continue,
            _ = &mut deadline => break,
            // Nothing more can be written: the client is gone.
            _ = conn.sender.backlog().stopped() => return Err(None),
            _ = conn.sender.backlog().written(), if backlogged || (finished && unsent > 0) => {
                continue
            }
            f = frames.next(), if !backlogged && !input_ended => f,
        };
        if next.is_none() {
            input_ended = true;
            end_streams(
                ctx,
                "the client closed its side of the connection while the server was draining: \
                 the stream cannot go on; it may have partly run",
            );
            continue;
        }
        ctx.on_frame(next, true)?;
    }
    if lingering {
        return Ok(());
    }
    // Every call the server read gets an answer, so the client knows that calls still pending
    // when the connection closes were never read.
    let dropped: Vec<_> = conn.tasks().drain().collect();
    end_at_drain(
        ctx,
        (dropped, true),
        &format!(
            "the server shut down before the call finished (drain deadline of {} ms); it may \
             have partly run",
            options.drain_timeout.as_millis()
        ),
    );
    Ok(())
}

/// The client closed its side of the connection (a half-close: it sends nothing more, and
/// may still read) while the server was not draining: the calls in flight are finished and
/// answered, as in a drain but with no `GoAway` (closing at once would drop them unanswered,
/// and the client could not tell they ran); streams, which need the client's side to go on,
/// are answered at once. The calls run as they would on an open connection (their deadlines
/// bound them). Returns once every answer is written, once nothing more can be written, once
/// answers have waited for `idle` with the client taking none of their bytes (a client that
/// reads nothing holds the connection no longer than an idle one), or once the server begins
/// to shut down (the drain then takes over, with its deadline).
///
/// A client that closed the connection altogether reads the same end of stream: it is found
/// out by a `Ping` every [`PAUSED_KEEPALIVE`] while calls run and no answer waits to be
/// written (its system answers the first with a reset, and the next write fails; an answer
/// waiting finds it out the same way), and its calls are then dropped.
pub(super) async fn finish_half_closed(
    ctx: &FrameCtx<'_>,
    shutdown: &CancellationToken,
    idle: Duration,
) {
    let conn = ctx.conn;
    end_streams(
        ctx,
        "the client closed its side of the connection: the stream cannot go on; it may have \
         partly run",
    );
    let backlog = conn.sender.backlog();
    let ping = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(ping);
    let mut last_sent = backlog.sent();
    let still = tokio::time::sleep(idle);
    tokio::pin!(still);
    // Whether answers were waiting at the last turn: the bound starts when they begin to.
    let mut waiting = false;
    loop {
        // In this order, as in `drain`: an answer is queued before its call leaves the calls
        // in flight.
        let finished = conn.in_flight.load(Ordering::Acquire) == 0;
        let unsent = backlog.bytes();
        if finished && unsent == 0 {
            return;
        }
        // The bound runs only while answers wait for the client, from when they began to:
        // the client taking bytes (however slowly) starts it again.
        let sent = backlog.sent();
        if sent != last_sent || unsent == 0 || !waiting {
            last_sent = sent;
            still.as_mut().reset(Instant::now() + idle);
        }
        waiting = unsent > 0;
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = backlog.stopped() => return,
            _ = &mut still, if unsent > 0 => {
                if backlog.sent() == last_sent {
                    return;
                }
            }
            // Only while nothing waits to be written: a write waiting finds a closed client out
            // as a ping would, and pings queued behind it would pile up unsent.
            _ = &mut ping, if !finished && unsent == 0 => {
                conn.sender.send(Kind::Ping(Ping { nonce: 0 }));
                ping.as_mut().reset(Instant::now() + PAUSED_KEEPALIVE);
            }
            _ = conn.idle.notified() => {}
            _ = conn.finished.notified() => {}
            _ = backlog.written() => {}
        }
    }
}

/// Answers the streams in flight at once with 520 and `why`: each needs the client's side of
/// the connection (credit, items, its end), which has ended. Unary calls are left to finish,
/// and so are client streams whose request stream had ended: they owe the client nothing but
/// their answer, as a unary call does.
fn end_streams(ctx: &FrameCtx<'_>, why: &str) {
    let conn = ctx.conn;
    let streams: Vec<_> = {
        let mut tasks = conn.tasks();
        let ids: Vec<u64> = tasks
            .keys()
            .copied()
            .filter(|id| {
                conn.streams
                    .get(*id)
                    .is_some_and(|slot| !slot.owes_only_its_end())
            })
            .collect();
        ids.into_iter()
            .filter_map(|id| tasks.remove(&id).map(|t| (id, t)))
            .collect()
    };
    end_at_drain(ctx, (streams, false), why);
}

/// Stops the calls `dropped` (taken out of the connection's tasks) and answers each 520 with
/// `why`; they leave the calls in flight, as a call cancelled by its client does. `deadline`:
/// dropped at the drain's deadline (their telemetry says so), else for the connection's end.
fn end_at_drain(
    ctx: &FrameCtx<'_>,
    (dropped, deadline): (Vec<(u64, super::runner::Running)>, bool),
    why: &str,
) {
    let conn = ctx.conn;
    for (id, handle) in dropped {
        if deadline {
            handle.abort_at_drain_deadline();
        } else {
            handle.abort();
        }
        // A stream is stopped before its answer is queued: its task, perhaps in a poll on
        // another thread, queues no item after the end, nor does a handler reading its request
        // stream in a task of its own grant credit after it.
        if let Some(slot) = conn.streams.get(id) {
            slot.stop();
        }
        let mut r = error_result(StatusCode::ServerError, why);
        r.message_id = id;
        conn.sender.send(Kind::Result(r));
        // (After its answer is queued, as a call finishing does: see `drain`.)
        if conn.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            conn.idle.notify_one();
        }
        conn.finished.notify_one();
    }
}
