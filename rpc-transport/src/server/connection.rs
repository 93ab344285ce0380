//! One connection: handshake, then its read loop until it ends or drains.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rpc_core::wire::{frame::Kind, Ping};
use rpc_core::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use super::admission::{throttle_at, CallRate, FrameCtx};
use super::calls::{Conn, ConnCleanup, Handoff};
use super::drain::{drain, finish_half_closed};
use super::expansion::{ExpansionBudget, Unpacker};
use super::handler::{go_away, InvokeHandler};
use super::handshake::handshake;
use super::options::{
    ServerOptions, HELD_FRAME_KEEPALIVE, MAX_HELLO_FRAME, PAUSED_KEEPALIVE, REFUSALS_BEFORE_PAUSE,
};
use super::runner::Runners;
use crate::caller::Caller;
use crate::codec::FrameCodec;
use crate::invoke::Incoming;
use crate::peer::PeerAddr;
use crate::reader::FrameReader;
use crate::reader::ReadBudget;
use crate::writer::{spawn_server_writer, spawn_writer};
use crate::HELLO_BUFFER;

/// What every connection of one server shares.
pub(super) struct Served {
    pub(super) handler: Arc<dyn InvokeHandler>,
    /// Shared by the read buffers of every connection's large frames.
    pub(super) budget: ReadBudget,
    /// Shared by the decompressed arguments of every connection's running calls.
    pub(super) expansion: ExpansionBudget,
    pub(super) options: ServerOptions,
    pub(super) shutdown: CancellationToken,
    /// When every connection's drain ends: `drain_timeout` after the shutdown, fixed by the
    /// first to ask (the accept loop as it stops), so a connection that starts draining later
    /// gets what is left of it, not a fresh `drain_timeout`.
    pub(super) drain_deadline: std::sync::OnceLock<Instant>,
    /// Set when the accept loop's future is dropped before it ended (`ServerHandle::abort`,
    /// the runtime shutting down): the calls its connections drop as they end are then
    /// dropped by the server, not by their callers.
    pub(super) stopped_at_once: Arc<AtomicBool>,
}

impl Served {
    /// The instant the shutdown's drain ends.
    pub(super) fn drain_deadline(&self) -> Instant {
        *self
            .drain_deadline
            .get_or_init(|| Instant::now() + rpc_core::capped(self.options.drain_timeout))
    }
}

pub(super) async fn run_connection<R, W>(
    rd: R,
    wr: W,
    peer: PeerAddr,
    peer_certificate: Option<Vec<u8>>,
    server: &Served,
    hello_by: Instant,
    admitted: bool,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + crate::transport::Abortive + Unpin + Send + 'static,
{
    let Served {
        handler,
        budget,
        expansion,
        options,
        shutdown,
        ..
    } = server;
    if !admitted {
        refuse(wr, options.max_connections).await;
        return;
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
    let close = CancellationToken::new();
    let sender = spawn_server_writer(wr, in_flight.clone(), close.clone());
    // A small buffer, and frames of a few KiB at most, until the client has said Hello:
    // connections that never get that far (floods, scanners, peers announcing large frames)
    // cost little memory.
    let hello_limit = options.max_frame_length.min(MAX_HELLO_FRAME);
    let mut frames = FramedRead::with_capacity(rd, FrameCodec::new(hello_limit), HELLO_BUFFER);

    // A connection still saying Hello when the server shuts down is closed: it has no call
    // to finish, and waiting for its Hello would stretch the shutdown by up to the handshake
    // timeout.
    let hello = tokio::select! {
        hello = handshake(&mut frames, &sender, options, hello_by) => hello,
        () = shutdown.cancelled() => Err((StatusCode::Success, "server shutting down".into())),
    };
    let hello = match hello {
        Ok(hello) => hello,
        Err((code, reason)) => {
            tracing::info!(%peer, %reason, "handshake refused");
            sender.send(go_away(code, reason));
            close.cancel();
            return;
        }
    };
    // Who calls, once for the connection: every call is handed this `Arc`.
    let unpacker = Unpacker::new(expansion.clone(), options);
    let caller = Arc::new(
        Caller::new(peer.clone(), hello.client_id)
            .with_unpacker(unpacker.clone())
            .with_accept_compression(hello.accept_compression)
            .with_token_verified(options.token.is_some())
            .with_peer_certificate(peer_certificate),
    );
    // The connection's real buffer, under the server's read budget, holding whatever the
    // client sent right after its Hello.
    let early = frames.read_buffer().clone();
    let mut frames = FrameReader::new(
        frames.into_inner(),
        &early,
        options.max_frame_length,
        budget.clone(),
        peer.clone(),
    );

    let conn = Arc::new(Conn {
        sender,
        in_flight,
        tasks: Mutex::new(HashMap::default()),
        runners: Runners::default(),
        idle: Notify::new(),
        finished: Notify::new(),
        refused_in_a_row: AtomicU32::new(0),
        abuses: AtomicU32::new(0),
        give_way: AtomicBool::new(false),
        streams: Default::default(),
        client_window: hello.stream_window,
        client_window_bytes: hello.stream_window_bytes,
        client_batches: hello.stream_batches,
        max_unsent_bytes: options.max_unsent_bytes,
        stall_limit: match options.idle_timeout {
            Duration::ZERO => None,
            t => Some(rpc_core::capped(t)),
        },
    });
    if hello.stream_batches {
        // A client offers batches only when its frame limit takes a whole run.
        conn.sender
            .batch_stream_items(crate::writer::MAX_ITEMS_BYTES);
    }
    // Runs however the connection ends, including when its task is aborted: running handlers
    // are dropped and the socket is closed.
    let _cleanup = ConnCleanup {
        conn: conn.clone(),
        close: close.clone(),
        stopped_at_once: server.stopped_at_once.clone(),
    };
    let shutdown_signal = shutdown.cancelled();
    tokio::pin!(shutdown_signal);
    // 0: connections are never closed for idleness.
    let idle_after = match options.idle_timeout {
        Duration::ZERO => rpc_core::LONGEST_WAIT,
        t => rpc_core::capped(t),
    };
    let idle = tokio::time::sleep(idle_after);
    tokio::pin!(idle);
    // Idleness is checked when the timer fires rather than by resetting it for every frame.
    let (mut frames_seen, mut frames_at_check) = (0u64, 0u64);
    // Bytes of answers written at the last idle check: a client taking them is not idle,
    // even while the reader is paused for them and reads none of its frames.
    let mut sent_at_check = conn.sender.backlog().sent();
    let ctx = FrameCtx {
        conn: &conn,
        options,
        handler: handler.as_ref(),
        caller,
        expansion,
        unpacker,
    };

    let mut rate = options
        .max_calls_per_second_per_connection
        .map(|n| CallRate::new(n, Instant::now()));
    // Armed while the call rate pauses the connection.
    let throttle = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(throttle);
    let mut throttled = false;

    // Whether the reader gave way once since the connection reached its in-flight limit.
    let mut gave_way = false;
    // While the connection is paused at its in-flight limit: when the server's next `Ping`
    // is due (see `PAUSED_KEEPALIVE`). Armed when the pause begins.
    let keepalive = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(keepalive);
    let mut was_at_limit = false;
    // While the server holds a large frame of the connection (see `HELD_FRAME_KEEPALIVE`): a
    // check every so often, since the hold begins inside a read this loop is waiting on.
    let held_check = tokio::time::sleep(HELD_FRAME_KEEPALIVE);
    tokio::pin!(held_check);
    // The GoAway's status when the loop ends with a reason: 500 unless said otherwise.
    let mut end_status = StatusCode::FrameworkError;
    // The loop ended on the end of the client's input (a close, or a half-close).
    let mut half_closed = false;
    let ended: Option<String> = loop {
        // Calls just read run in tasks of their own: at the in-flight limit, let them run once
        // before refusing more, so that a client pipelining calls that finish at once is not
        // refused for calls that are merely not yet polled.
        if conn.in_flight.load(Ordering::Acquire) >= options.max_in_flight_per_connection {
            if !gave_way {
                gave_way = true;
                tokio::task::yield_now().await;
                continue;
            }
        } else {
            gave_way = false;
        }
        // No more calls are taken while the client leaves its answers unread, nor after many
        // calls in a row were refused at the in-flight limit, until a running call finishes
        // or the next keepalive (which reads again, for the client's `Cancel`s and `Ping`s),
        // nor above the call rate: the frames wait in the read buffer and in TCP. (Not at the
        // limit while a stream is open: a stream goes on only through the client's frames,
        // credit, items, Cancel or its end, which must then be read; the calls beyond the
        // limit are refused one by one instead.)
        let backlogged = conn.sender.backlog().bytes() > options.max_unsent_bytes;
        let at_limit = conn.refused_in_a_row.load(Ordering::Relaxed) >= REFUSALS_BEFORE_PAUSE
            && conn.in_flight.load(Ordering::Acquire) >= options.max_in_flight_per_connection
            && conn.streams.is_empty();
        if at_limit && !was_at_limit {
            keepalive.as_mut().reset(Instant::now() + PAUSED_KEEPALIVE);
        }
        was_at_limit = at_limit;
        let paused = backlogged || at_limit || throttled;
        if paused {
            // Not read meanwhile: a wait for the read budget kept for it would hold units
            // that others' frames wait for.
            frames.stop_waiting();
        }
        // Frames already read are handled before anything else is polled: the shutdown and
        // idle checks run once per read from the socket, not once per frame. Each counts
        // against the task's scheduling budget, so one busy connection cannot hold a worker.
        if !paused {
            if let Some(next) = frames.buffered() {
                frames_seen += 1;
                let call = matches!(next, Ok(Incoming::Invoke(_)));
                if let Err(end) = ctx.on_frame(Some(next), false) {
                    break end;
                }
                throttled = call && throttle_at(&mut rate, throttle.as_mut());
                tokio::task::coop::consume_budget().await;
                continue;
            }
        }
        // Before waiting: let the call tasks just started run elsewhere should one block.
        if conn.give_way.swap(false, Ordering::Relaxed) {
            Handoff::new().await;
        }
        let next = tokio::select! {
            biased;
            _ = &mut shutdown_signal => break None,
            _ = &mut idle => {
                // A connection with calls in flight is not idle, however quiet the client is;
                // but a large frame begun and not finished for as long holds a share of the
                // server's read budget that others wait for, calls in flight or not. Nor is
                // one whose next frame waits for that budget: the server holds it back (unless
                // the client leaves its answers unread: then the client holds the connection
                // up, and its large frame asks for no budget yet).
                let busy = (conn.in_flight.load(Ordering::Acquire) > 0 && !frames.holds_share())
                    || (!backlogged && frames.waits_for_share());
                // Answers still waiting, and the client took some of them since the last check
                // (not while it holds a share of the read budget with a frame it does not
                // finish: reading slowly must not keep that share from the others).
                let sent = conn.sender.backlog().sent();
                let taking = !frames.holds_share()
                    && conn.sender.backlog().bytes() > 0
                    && sent != sent_at_check;
                if frames_seen != frames_at_check || taking || busy {
                    frames_at_check = frames_seen;
                    sent_at_check = sent;
                    idle.as_mut().reset(Instant::now() + idle_after);
                    continue;
                }
                if conn.in_flight.load(Ordering::Acquire) == 0 && conn.streams.is_empty() {
                    // Every call it read was answered and it reads no more: a call the client
                    // sent meanwhile was never read, which GoAway 200 tells it (not delivered).
                    end_status = StatusCode::Success;
                }
                break Some(format!("idle for {} ms: closing", options.idle_timeout.as_millis()));
            }
            // Nothing more can be answered: a reader paused for its answers to be written (or
            // at the limit) would otherwise wait for ever, the connection's calls with it.
            _ = conn.sender.backlog().stopped() => {
                break Some("the connection can no longer be written to (the client is gone): \
                            closing".to_string());
            }
            _ = conn.sender.backlog().written(), if backlogged => continue,
            _ = conn.finished.notified(), if at_limit && !backlogged => continue,
            // The client's `Ping`s are not read meanwhile: this keeps it from taking the
            // connection for dead under calls that run for long.
            // And the reader reads again once: the client's `Cancel`s (which would free the
            // limit) and `Ping`s wait in the frames, behind calls refused one by one.
            _ = &mut keepalive, if at_limit && !backlogged => {
                conn.sender.send(Kind::Ping(Ping { nonce: 0 }));
                conn.refused_in_a_row.store(0, Ordering::Relaxed);
                keepalive.as_mut().reset(Instant::now() + PAUSED_KEEPALIVE);
                continue;
            }
            _ = &mut held_check => {
                // (Not while answers wait unwritten: that write finds a closed client out.)
                if !backlogged && (frames.waits_for_share() || frames.holds_share()) {
                    conn.sender.send(Kind::Ping(Ping { nonce: 0 }));
                }
                held_check.as_mut().reset(Instant::now() + HELD_FRAME_KEEPALIVE);
                continue;
            }
            _ = &mut throttle, if throttled => {
                throttled = false;
                continue;
            }
            f = frames.next(), if !paused => f,
        };
        frames_seen += 1;
        let call = matches!(next, Some(Ok(Incoming::Invoke(_))));
        let input_ended = next.is_none();
        if let Err(end) = ctx.on_frame(next, false) {
            half_closed = input_ended;
            break end;
        }
        throttled = call && throttle_at(&mut rate, throttle.as_mut());
    };

    if ended.is_none() && half_closed && !shutdown.is_cancelled() {
        // The client may still read: its calls in flight are answered first.
        finish_half_closed(&ctx, shutdown, idle_after).await;
    }
    let reason = match ended {
        Some(reason) => Some(reason),
        None if shutdown.is_cancelled() => {
            drain(&ctx, &mut frames, options, server.drain_deadline()).await
        }
        None => None,
    };
    if let Some(reason) = reason {
        tracing::info!(%peer, %reason, "closing connection");
        conn.sender.send(go_away(end_status, reason));
    }
}

pub(super) async fn refuse<W: AsyncWrite + crate::transport::Abortive + Unpin + Send + 'static>(
    wr: W,
    max: usize,
) {
    let close = CancellationToken::new();
    let sender = spawn_writer(wr, Arc::new(AtomicUsize::new(0)), close.clone());
    sender.send(go_away(
        StatusCode::OverflowMaxServerHandle,
        format!("the server holds its maximum of {max} connections; connect to another endpoint"),
    ));
    close.cancel();
}
