//! The server side: accept loop, handshake, per-connection dispatch, cancellation, draining.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use rpc_core::wire::{
    frame::Kind, GoAway, HelloAck, Pong, RemoteInvokeMessage, RemoteResultMessage,
};
use rpc_core::{StatusCode, PROTOCOL_VERSION};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use crate::caller::Caller;
use crate::client::kind_name;
use crate::codec::FrameCodec;
use crate::reader::{FrameReader, ReadBudget};
use crate::writer::{spawn_writer, FrameSender};
use crate::HELLO_BUFFER;

/// Connection-level settings of a server. Its `Debug` form shows whether a token is set, never
/// the token.
#[derive(Clone)]
pub struct ServerOptions {
    /// Required `Hello.token`; `None` accepts any.
    pub token: Option<String>,
    /// Sent in `HelloAck.server_id`.
    pub server_id: String,
    /// Largest frame accepted from a client.
    pub max_frame_length: usize,
    /// A connection that sends no `Hello` within this time is closed.
    pub handshake_timeout: Duration,
    /// A connection on which nothing arrived for this long is closed.
    pub idle_timeout: Duration,
    /// On shutdown, how long calls in flight may take to finish.
    pub drain_timeout: Duration,
    /// Connections held at once; one more is refused with `GoAway`.
    pub max_connections: usize,
    /// Calls one connection may have running at once; one more is answered Overflow (515)
    /// without running, so a single client cannot hold the server's memory.
    pub max_in_flight_per_connection: usize,
    /// Attachments one call may carry.
    pub max_attachments: usize,
    /// Total bytes of one call's attachment keys and values. A connection whose calls break
    /// the attachment limits more than [`ABUSE_LIMIT`] times is closed.
    pub max_attachment_bytes: usize,
    /// Answers queued on one connection and not yet written, in bytes (about: payload and
    /// message of each answer plus 64). Above this, as when a client sends calls but does not
    /// read the answers, the server stops reading that connection's calls until the answers are
    /// written, so memory stays bounded and TCP pushes back on the client.
    pub max_unsent_bytes: usize,
    /// Calls one connection may start per second, with bursts of a tenth of a second's worth
    /// (at least one call). Above it the server stops reading that connection until the rate
    /// allows the next call, so TCP pushes back on the client and a client that pipelines calls
    /// as fast as it can gets no more than its share. `None` (the default): no limit.
    pub max_calls_per_second_per_connection: Option<u32>,
    /// Bytes the read buffers of frames larger than a connection's own 64 KiB buffer may hold
    /// at once, summed over every connection of the server (never less than one frame of
    /// `max_frame_length`). A frame that would need more than is left waits, and its
    /// connection is not read meanwhile, so TCP pushes back on its peer; it is read once other
    /// frames are complete. Frames before the handshake are limited to [`MAX_HELLO_FRAME`]
    /// bytes instead.
    pub max_read_buffer_bytes: usize,
    /// Whether a call's handler is first polled on the connection's reader, before a task is
    /// spawned for it: a handler that answers in that poll then costs no task. Only for
    /// servers whose handlers never block nor compute for long before their first `.await`:
    /// while one does, the reader is stalled, and with it every other call, `Cancel` and `Ping`
    /// on that connection. `false` (the default): every call runs in its own task.
    pub inline_first_poll: bool,
    /// TLS on every connection (feature `tls`); `None` serves plain TCP. The TLS handshake
    /// counts within `handshake_timeout`.
    #[cfg(feature = "tls")]
    pub tls: Option<crate::tls::ServerTls>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            token: None,
            server_id: format!("rpc-server/{}", std::process::id()),
            max_frame_length: rpc_core::DEFAULT_MAX_FRAME_LENGTH,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(10),
            max_connections: 10_000,
            max_in_flight_per_connection: 1024,
            max_attachments: 64,
            max_attachment_bytes: 16 * 1024,
            max_unsent_bytes: 1024 * 1024,
            max_calls_per_second_per_connection: None,
            max_read_buffer_bytes: 64 * 1024 * 1024,
            inline_first_poll: false,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl std::fmt::Debug for ServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ServerOptions");
        d.field("token", &crate::Redacted(&self.token))
            .field("server_id", &self.server_id)
            .field("max_frame_length", &self.max_frame_length)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("drain_timeout", &self.drain_timeout)
            .field("max_connections", &self.max_connections)
            .field(
                "max_in_flight_per_connection",
                &self.max_in_flight_per_connection,
            )
            .field("max_attachments", &self.max_attachments)
            .field("max_attachment_bytes", &self.max_attachment_bytes)
            .field("max_unsent_bytes", &self.max_unsent_bytes)
            .field(
                "max_calls_per_second_per_connection",
                &self.max_calls_per_second_per_connection,
            )
            .field("max_read_buffer_bytes", &self.max_read_buffer_bytes)
            .field("inline_first_poll", &self.inline_first_poll);
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls);
        d.finish()
    }
}

/// Largest frame a server reads before it has accepted the client's `Hello` (8 KiB): a `Hello`
/// is a version, a token and a client id, and a peer that has not authenticated gets no more
/// of the server's memory than that. A longer frame gets `GoAway` at its length prefix.
pub const MAX_HELLO_FRAME: usize = 8 * 1024;

/// Calls breaking the attachment limits that one connection may send before it is closed: a
/// client that keeps doing it is broken or hostile, and each such call costs the server a full
/// decode.
pub const ABUSE_LIMIT: u32 = 8;

/// Calls refused in a row at a connection's in-flight limit after which the server stops
/// reading that connection until one of its calls finishes: the first are answered Overflow at
/// once, the rest wait in TCP instead of costing the server a refusal each.
pub const REFUSALS_BEFORE_PAUSE: u32 = 16;

/// What the server does with one call.
pub enum Dispatch {
    /// Answer at once (overflow, unknown entry, ...), without spawning.
    Ready(RemoteResultMessage),
    /// Run this future in its own task; `Cancel` drops it.
    Spawn(BoxFuture<'static, RemoteResultMessage>),
}

/// The layer above the transport: turns a call into its answer. `message_id` of the answer is
/// filled in by the transport.
pub trait InvokeHandler: Send + Sync + 'static {
    /// Decides how to answer `invoke` from `caller` (the same `Arc` for every call of a
    /// connection, built at its handshake); must not block.
    fn handle(&self, invoke: RemoteInvokeMessage, caller: &Arc<Caller>) -> Dispatch;
}

/// Accepts connections on `listener` until `shutdown` is cancelled, then drains every connection
/// (`GoAway`, calls in flight finish within `drain_timeout`) and returns.
pub async fn serve(
    listener: TcpListener,
    handler: Arc<dyn InvokeHandler>,
    options: ServerOptions,
    shutdown: CancellationToken,
) {
    let max_connections = options.max_connections;
    let server = Arc::new(Served {
        handler,
        budget: ReadBudget::new(options.max_read_buffer_bytes, options.max_frame_length),
        options,
        shutdown: shutdown.clone(),
    });
    let slots = Arc::new(Semaphore::new(max_connections));
    let mut conns = tokio::task::JoinSet::new();
    // After refusing a connection at the limit, accepting pauses until a slot frees or
    // REFUSAL_BACKOFF passes: a flood of connects then waits in the kernel's accept queue
    // instead of costing an accept, a GoAway and a close each.
    let mut back_off: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = sleep_until_or_never(back_off), if back_off.is_some() => {
                back_off = None;
                continue;
            }
            Ok(slot) = slots.clone().acquire_owned(), if back_off.is_some() => {
                drop(slot);
                back_off = None;
                continue;
            }
            a = listener.accept(), if back_off.is_none() => a,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        match accepted {
            Ok((stream, peer)) => {
                let server = server.clone();
                match slots.clone().try_acquire_owned() {
                    Ok(permit) => {
                        conns.spawn(async move {
                            serve_connection(stream, peer, server, true).await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        tracing::warn!(%peer, max = max_connections, "connection refused: too many connections");
                        conns.spawn(serve_connection(stream, peer, server, false));
                        back_off = Some(Instant::now() + REFUSAL_BACKOFF);
                    }
                }
            }
            Err(e) => {
                // Out of file descriptors and the like: back off briefly instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// How long accepting pauses after a connection was refused at `max_connections`, unless a
/// slot frees sooner.
const REFUSAL_BACKOFF: Duration = Duration::from_millis(50);

async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What every connection of one server shares.
struct Served {
    handler: Arc<dyn InvokeHandler>,
    /// Shared by the read buffers of every connection's large frames.
    budget: ReadBudget,
    options: ServerOptions,
    shutdown: CancellationToken,
}

/// An accepted socket becomes its reader and writer here, and only here: plain TCP splits the
/// socket in place (no lock between the halves); TLS runs its handshake first, within
/// `handshake_timeout`, and splits the TLS stream. Everything after is generic over the halves,
/// so neither path pays for the other. A connection over `max_connections` (`admitted` false)
/// is told so with a `GoAway` and closed.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    server: Arc<Served>,
    admitted: bool,
) {
    let _ = stream.set_nodelay(true);
    let hello_by = Instant::now() + server.options.handshake_timeout;
    #[cfg(feature = "tls")]
    if let Some(tls) = &server.options.tls {
        let timeout = server.options.handshake_timeout;
        if let Some(stream) = tls.accept(stream, peer, hello_by, timeout).await {
            let cert = crate::tls::peer_certificate(&stream);
            let (rd, wr) = tokio::io::split(stream);
            run_connection(rd, wr, peer, cert, &server, hello_by, admitted).await;
        }
        return;
    }
    let (rd, wr) = stream.into_split();
    run_connection(rd, wr, peer, None, &server, hello_by, admitted).await;
}

async fn refuse<W: AsyncWrite + Unpin + Send + 'static>(wr: W, max: usize) {
    let close = CancellationToken::new();
    let sender = spawn_writer(wr, Arc::new(AtomicUsize::new(0)), close.clone());
    sender.send(go_away(
        StatusCode::OverflowMaxServerHandle,
        format!("the server holds its maximum of {max} connections; connect to another endpoint"),
    ));
    close.cancel();
}

fn go_away(code: StatusCode, reason: impl Into<String>) -> Kind {
    Kind::GoAway(GoAway {
        status_code: code.as_u32(),
        reason: reason.into(),
    })
}

struct Conn {
    sender: FrameSender,
    in_flight: Arc<AtomicUsize>,
    tasks: Mutex<HashMap<u64, AbortHandle, ahash::RandomState>>,
    idle: Notify,
    /// Woken when a spawned call finishes (for a reader paused at the in-flight limit).
    finished: Notify,
    /// Calls refused in a row at the in-flight limit.
    refused_in_a_row: AtomicU32,
    /// Calls that broke the attachment limits.
    abuses: AtomicU32,
}

impl Conn {
    fn tasks(&self) -> std::sync::MutexGuard<'_, HashMap<u64, AbortHandle, ahash::RandomState>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

async fn run_connection<R, W>(
    rd: R,
    wr: W,
    peer: SocketAddr,
    peer_certificate: Option<Vec<u8>>,
    server: &Served,
    hello_by: Instant,
    admitted: bool,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let Served {
        handler,
        budget,
        options,
        shutdown,
    } = server;
    if !admitted {
        refuse(wr, options.max_connections).await;
        return;
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
    let close = CancellationToken::new();
    let sender = spawn_writer(wr, in_flight.clone(), close.clone());
    // A small buffer, and frames of a few KiB at most, until the client has said Hello:
    // connections that never get that far (floods, scanners, peers announcing large frames)
    // cost little memory.
    let hello_limit = options.max_frame_length.min(MAX_HELLO_FRAME);
    let mut frames = FramedRead::with_capacity(rd, FrameCodec::new(hello_limit), HELLO_BUFFER);

    let client_id = match handshake(&mut frames, &sender, options, hello_by).await {
        Ok(client_id) => client_id,
        Err((code, reason)) => {
            tracing::info!(%peer, %reason, "handshake refused");
            sender.send(go_away(code, reason));
            close.cancel();
            return;
        }
    };
    // Who calls, once for the connection: every call is handed this `Arc`.
    let caller = Arc::new(
        Caller::new(peer, client_id)
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
        peer,
    );

    let conn = Arc::new(Conn {
        sender,
        in_flight,
        tasks: Mutex::new(HashMap::default()),
        idle: Notify::new(),
        finished: Notify::new(),
        refused_in_a_row: AtomicU32::new(0),
        abuses: AtomicU32::new(0),
    });
    // Runs however the connection ends, including when its task is aborted: running handlers
    // are dropped and the socket is closed.
    let _cleanup = ConnCleanup {
        conn: conn.clone(),
        close: close.clone(),
    };
    let shutdown_signal = shutdown.cancelled();
    tokio::pin!(shutdown_signal);
    let idle = tokio::time::sleep(options.idle_timeout);
    tokio::pin!(idle);
    // Idleness is checked when the timer fires rather than by resetting it for every frame.
    let (mut frames_seen, mut frames_at_check) = (0u64, 0u64);
    let ctx = FrameCtx {
        conn: &conn,
        options,
        handler: handler.as_ref(),
        caller,
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
        // calls in a row were refused at the in-flight limit, until a running call finishes,
        // nor above the call rate: the frames wait in the read buffer and in TCP.
        let backlogged = conn.sender.backlog().bytes() > options.max_unsent_bytes;
        let at_limit = conn.refused_in_a_row.load(Ordering::Relaxed) >= REFUSALS_BEFORE_PAUSE
            && conn.in_flight.load(Ordering::Acquire) >= options.max_in_flight_per_connection;
        let paused = backlogged || at_limit || throttled;
        // Frames already read are handled before anything else is polled: the shutdown and
        // idle checks run once per read from the socket, not once per frame. Each counts
        // against the task's scheduling budget, so one busy connection cannot hold a worker.
        if !paused {
            if let Some(next) = frames.buffered() {
                frames_seen += 1;
                let call = matches!(next, Ok(Kind::Invoke(_)));
                if let Err(end) = ctx.on_frame(Some(next), false) {
                    break end;
                }
                throttled = call && throttle_at(&mut rate, throttle.as_mut());
                tokio::task::coop::consume_budget().await;
                continue;
            }
        }
        let next = tokio::select! {
            biased;
            _ = &mut shutdown_signal => break None,
            _ = &mut idle => {
                // A connection with calls in flight is not idle, however quiet the client is.
                if frames_seen != frames_at_check || conn.in_flight.load(Ordering::Acquire) > 0 {
                    frames_at_check = frames_seen;
                    idle.as_mut().reset(Instant::now() + options.idle_timeout);
                    continue;
                }
                break Some(format!("idle for {} ms: closing", options.idle_timeout.as_millis()));
            }
            _ = conn.sender.backlog().written(), if backlogged => continue,
            _ = conn.finished.notified(), if at_limit && !backlogged => continue,
            _ = &mut throttle, if throttled => {
                throttled = false;
                continue;
            }
            f = frames.next(), if !paused => f,
        };
        frames_seen += 1;
        let call = matches!(next, Some(Ok(Kind::Invoke(_))));
        if let Err(end) = ctx.on_frame(next, false) {
            break end;
        }
        throttled = call && throttle_at(&mut rate, throttle.as_mut());
    };

    let reason = match ended {
        Some(reason) => Some(reason),
        None if shutdown.is_cancelled() => drain(&ctx, &mut frames, options).await,
        None => None,
    };
    if let Some(reason) = reason {
        tracing::info!(%peer, %reason, "closing connection");
        conn.sender
            .send(go_away(StatusCode::FrameworkError, reason));
    }
}

/// One connection's call rate: a token bucket holding a tenth of a second's calls.
struct CallRate {
    per_second: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl CallRate {
    fn new(per_second: u32, now: Instant) -> Self {
        let per_second = f64::from(per_second.max(1));
        let burst = (per_second / 10.0).max(1.0);
        CallRate {
            per_second,
            burst,
            tokens: burst,
            at: now,
        }
    }

    /// Counts a call that started at `now`; when the next one would be over the rate, the
    /// instant it may start.
    fn take(&mut self, now: Instant) -> Option<Instant> {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * self.per_second;
        self.tokens = (self.tokens + refill).min(self.burst) - 1.0;
        self.at = now;
        (self.tokens < 1.0)
            .then(|| now + Duration::from_secs_f64((1.0 - self.tokens) / self.per_second))
    }
}

/// After a call: arms `throttle` and returns true when the connection's rate says to wait.
fn throttle_at(
    rate: &mut Option<CallRate>,
    throttle: std::pin::Pin<&mut tokio::time::Sleep>,
) -> bool {
    match rate.as_mut().and_then(|r| r.take(Instant::now())) {
        Some(until) => {
            throttle.reset(until);
            true
        }
        None => false,
    }
}

/// How long a drained connection waits for the client to close before closing itself.
const DRAIN_LINGER: Duration = Duration::from_millis(500);

/// Shutdown: `GoAway`, then wait for the calls in flight (reading on, for `Cancel`) until the
/// drain deadline; calls still running then are answered 520 and dropped.
async fn drain<R: AsyncRead + Unpin>(
    ctx: &FrameCtx<'_>,
    frames: &mut FrameReader<R>,
    options: &ServerOptions,
) -> Option<String> {
    let conn = ctx.conn;
    conn.sender
        .send(go_away(StatusCode::Success, "server shutting down"));
    let hard = Instant::now() + options.drain_timeout;
    let deadline = tokio::time::sleep_until(hard);
    tokio::pin!(deadline);
    let mut lingering = false;
    loop {
        if !lingering && conn.in_flight.load(Ordering::Acquire) == 0 {
            // Nothing left to finish. Keep reading a little, answering calls sent before the
            // client saw GoAway ("not run"), until the client closes: closing with its calls
            // unread in our buffer would reset the connection and could destroy the GoAway.
            lingering = true;
            deadline
                .as_mut()
                .reset(hard.min(Instant::now() + DRAIN_LINGER));
        }
        let next = tokio::select! {
            biased;
            _ = conn.idle.notified() => continue,
            _ = &mut deadline => break,
            f = frames.next() => f,
        };
        if let Err(end) = ctx.on_frame(next, true) {
            return end;
        }
    }
    if lingering {
        return None;
    }
    // Every call the server read gets an answer, so the client knows that calls still pending
    // when the connection closes were never read.
    let dropped: Vec<(u64, AbortHandle)> = conn.tasks().drain().collect();
    for (id, handle) in dropped {
        handle.abort();
        let mut r = error_result(
            StatusCode::ServerError,
            format!(
                "the server shut down before the call finished (drain deadline of {} ms); it \
                 may have partly run",
                options.drain_timeout.as_millis()
            ),
        );
        r.message_id = id;
        conn.sender.send(Kind::Result(r));
    }
    None
}

/// What handling one frame needs.
struct FrameCtx<'a> {
    conn: &'a Arc<Conn>,
    options: &'a ServerOptions,
    handler: &'a dyn InvokeHandler,
    caller: Arc<Caller>,
}

impl FrameCtx<'_> {
    /// Why a call is refused before it runs, if it is: over the connection's in-flight limit,
    /// or carrying too many or too large attachments.
    fn refusal(&self, invoke: &RemoteInvokeMessage) -> Option<(StatusCode, String)> {
        let o = self.options;
        let running = self.conn.in_flight.load(Ordering::Acquire);
        if running >= o.max_in_flight_per_connection {
            self.conn.refused_in_a_row.fetch_add(1, Ordering::Relaxed);
            return Some((
                StatusCode::OverflowMaxServerHandle,
                format!(
                    "this connection already has {running} calls running (the limit per \
                     connection); the call was not run"
                ),
            ));
        }
        self.conn.refused_in_a_row.store(0, Ordering::Relaxed);
        let a = &invoke.attachments;
        if a.len() > o.max_attachments {
            self.conn.abuses.fetch_add(1, Ordering::Relaxed);
            return Some((
                StatusCode::FrameworkError,
                format!(
                    "{} attachments exceed the limit of {}; the call was not run",
                    a.len(),
                    o.max_attachments
                ),
            ));
        }
        if !a.is_empty() {
            let bytes: usize = a.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > o.max_attachment_bytes {
                self.conn.abuses.fetch_add(1, Ordering::Relaxed);
                return Some((
                    StatusCode::FrameworkError,
                    format!(
                        "attachments of {bytes} bytes exceed the limit of {} bytes; the call was \
                         not run",
                        o.max_attachment_bytes
                    ),
                ));
            }
        }
        None
    }

    /// Handles one frame; `Err` ends the connection (with a reason to send, or quietly).
    fn on_frame(
        &self,
        next: Option<Result<Kind, crate::FrameError>>,
        draining: bool,
    ) -> Result<(), Option<String>> {
        let conn = self.conn;
        match next {
            Some(Ok(Kind::Invoke(invoke))) => {
                let id = invoke.message_id;
                if draining {
                    let mut r = error_result(
                        StatusCode::CommunicationError,
                        "the server is shutting down and did not run the call; call another \
                         endpoint",
                    );
                    r.message_id = id;
                    conn.sender.send(Kind::Result(r));
                } else if let Some((code, why)) = self.refusal(&invoke) {
                    let mut r = error_result(code, why);
                    r.message_id = id;
                    conn.sender.send(Kind::Result(r));
                    let abuses = conn.abuses.load(Ordering::Relaxed);
                    if abuses > ABUSE_LIMIT {
                        return Err(Some(format!(
                            "{abuses} calls broke the attachment limits: closing the connection"
                        )));
                    }
                } else if conn.in_flight.load(Ordering::Acquire) > 0
                    && conn.tasks().contains_key(&id)
                {
                    // (With no call running, the map of running calls is empty.)
                    let mut r = error_result(
                        StatusCode::FrameworkError,
                        format!(
                            "message_id {id} is already in flight on this connection; use a new \
                             id per call"
                        ),
                    );
                    r.message_id = id;
                    conn.sender.send(Kind::Result(r));
                } else {
                    let outcome = self.handler.handle(invoke, &self.caller);
                    dispatch(conn, outcome, id, self.options.inline_first_poll);
                }
                Ok(())
            }
            Some(Ok(Kind::Cancel(c))) => {
                if let Some(h) = conn.tasks().remove(&c.message_id) {
                    h.abort();
                    if conn.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
                        conn.idle.notify_one();
                    }
                    conn.finished.notify_one();
                }
                Ok(())
            }
            Some(Ok(Kind::Ping(p))) => {
                conn.sender.send(Kind::Pong(Pong { nonce: p.nonce }));
                Ok(())
            }
            Some(Ok(Kind::Pong(_))) => Ok(()),
            Some(Ok(Kind::GoAway(_))) => Err(None),
            Some(Ok(other)) => Err(Some(format!(
                "protocol violation: unexpected {} after the handshake",
                kind_name(&other)
            ))),
            Some(Err(e)) => Err(Some(e.to_string())),
            None => Err(None),
        }
    }
}

struct ConnCleanup {
    conn: Arc<Conn>,
    close: CancellationToken,
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
fn dispatch(conn: &Arc<Conn>, outcome: Dispatch, id: u64, inline_first_poll: bool) {
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
struct Handoff(bool);

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

/// A result carrying an error status.
pub fn error_result(code: StatusCode, message: impl Into<String>) -> RemoteResultMessage {
    RemoteResultMessage {
        status_code: code.as_u32(),
        exception_message: message.into(),
        ..Default::default()
    }
}

/// The SHA-256 digest of a token: what the handshake compares.
fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `given` is the `expected` token. The digests of both are compared in constant time,
/// so the comparison always covers 32 bytes: neither the time taken nor an early exit on a
/// length mismatch tells a client how long the token is or how much of it was right.
fn token_matches(expected: &str, given: &str) -> bool {
    token_digest(expected).ct_eq(&token_digest(given)).into()
}

/// Reads `Hello` (by `hello_by`: `handshake_timeout` after the accept, TLS included) and answers
/// `HelloAck` (returning the client's id), or says why the client is refused.
async fn handshake<R: AsyncRead + Unpin>(
    frames: &mut FramedRead<R, FrameCodec>,
    sender: &FrameSender,
    options: &ServerOptions,
    hello_by: Instant,
) -> Result<String, (StatusCode, String)> {
    let first = tokio::time::timeout_at(hello_by, frames.next())
        .await
        .map_err(|_| {
            (
                StatusCode::Timeout,
                format!(
                    "no Hello within {} ms",
                    options.handshake_timeout.as_millis()
                ),
            )
        })?;
    let hello = match first {
        Some(Ok(Kind::Hello(h))) => h,
        Some(Ok(other)) => {
            return Err((
                StatusCode::FrameworkError,
                format!("the first frame must be Hello, got {}", kind_name(&other)),
            ))
        }
        Some(Err(crate::FrameError::TooLarge { len, max })) => {
            return Err((
                StatusCode::FrameworkError,
                format!(
                    "a frame of {len} bytes before the handshake exceeds the limit of {max} bytes \
                     for frames before Hello is accepted; send Hello first"
                ),
            ))
        }
        Some(Err(e)) => return Err((StatusCode::FrameworkError, e.to_string())),
        None => return Err((StatusCode::FrameworkError, "closed before Hello".into())),
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err((
            StatusCode::FrameworkError,
            format!(
                "protocol version {} is not supported; this server speaks {PROTOCOL_VERSION}",
                hello.protocol_version
            ),
        ));
    }
    if let Some(expected) = &options.token {
        if !token_matches(expected, &hello.token) {
            return Err((
                StatusCode::RpcUnAuthentication,
                "authentication failed: the token does not match the server's".into(),
            ));
        }
    }
    sender.send(Kind::HelloAck(HelloAck {
        protocol_version: PROTOCOL_VERSION,
        server_id: options.server_id.clone(),
        max_frame_length: options.max_frame_length.min(u32::MAX as usize) as u32,
    }));
    Ok(hello.client_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_check_compares_sha256_digests() {
        // FIPS 180-2 test vector: SHA-256("abc").
        let abc = [
            0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae,
            0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61,
            0xf2, 0x00, 0x15, 0xad,
        ];
        assert_eq!(token_digest("abc"), abc);
    }

    #[test]
    fn only_the_same_token_matches_whatever_its_length() {
        let secret = "s3cret-token";
        assert!(token_matches(secret, secret));
        for wrong in [
            "",
            "s",
            "s3cret-toke",
            "s3cret-tokem",
            "s3cret-token ",
            &secret.repeat(100),
        ] {
            assert!(!token_matches(secret, wrong), "{wrong:?} matched");
        }
        assert!(token_matches("", ""));
    }
}
