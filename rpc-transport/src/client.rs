//! The client side of a connection: handshake, multiplexed calls, heartbeats.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use futures_util::StreamExt;
use rpc_core::wire::{
    frame::Kind, Cancel, Hello, Ping, Pong, RemoteInvokeMessage, RemoteResultMessage,
};
use rpc_core::{RpcError, StatusCode, PROTOCOL_VERSION};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use crate::codec::{FrameCodec, FrameError};
use crate::encode::InvokeFields;
use crate::writer::{spawn_writer, FrameSender};
use crate::READ_BUFFER;

/// How a client connects. Its `Debug` form shows whether a token is set, never the token.
#[derive(Clone)]
pub struct ConnectOptions {
    /// Sent in `Hello.token`; `None` sends an empty token.
    pub token: Option<String>,
    /// Sent in `Hello.client_id`.
    pub client_id: String,
    /// Largest frame accepted from the server.
    pub max_frame_length: usize,
    /// Limit on TCP connect plus handshake.
    pub connect_timeout: Duration,
    /// A `Ping` is sent after this long without traffic; the connection is closed when nothing
    /// at all arrived for three intervals.
    pub heartbeat_interval: Duration,
    /// Bytes of calls queued on one connection and not yet written (about: parameters and
    /// entry id of each call plus 64), 4 MiB by default. Above it, as when the server stalls
    /// and stops reading, a new call waits for room, within its deadline, instead of growing
    /// the client's memory without limit; a call is always let in while the queue is below
    /// the limit, however large it is.
    pub max_unsent_bytes: usize,
    /// TLS to the server (feature `tls`); `None` connects over plain TCP. The TLS handshake
    /// counts within `connect_timeout`.
    #[cfg(feature = "tls")]
    pub tls: Option<crate::tls::ClientTls>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            token: None,
            client_id: format!("rpc-client/{}", std::process::id()),
            max_frame_length: rpc_core::DEFAULT_MAX_FRAME_LENGTH,
            connect_timeout: Duration::from_secs(3),
            heartbeat_interval: Duration::from_secs(10),
            max_unsent_bytes: 4 * 1024 * 1024,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ConnectOptions");
        d.field("token", &crate::Redacted(&self.token))
            .field("client_id", &self.client_id)
            .field("max_frame_length", &self.max_frame_length)
            .field("connect_timeout", &self.connect_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("max_unsent_bytes", &self.max_unsent_bytes);
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls);
        d.finish()
    }
}

/// One call for [`Connection::call`]: a `RemoteInvokeMessage` without its `message_id`, which the
/// connection assigns. The entry id is usually a method descriptor's `&'static str`, borrowed
/// rather than copied into every call; any `RemoteInvokeMessage` converts into a `Call`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    /// Which method to run: `"<service id>.<method>"`, for example `"echo.Echo.echo"`.
    pub service_entry_id: Cow<'static, str>,
    /// How `parameters` is encoded, and how the result will be (`Codec::to_wire`).
    pub codec: i32,
    /// The encoded argument list.
    pub parameters: Bytes,
    /// Context carried with the call.
    pub attachments: BTreeMap<String, String>,
    /// The caller's remaining budget in milliseconds; 0 means no deadline.
    pub timeout_ms: u32,
}

impl Call {
    pub(crate) fn fields(&self, message_id: u64) -> InvokeFields<'_> {
        InvokeFields {
            message_id,
            service_entry_id: &self.service_entry_id,
            codec: self.codec,
            parameters: &self.parameters,
            attachments: &self.attachments,
            timeout_ms: self.timeout_ms,
        }
    }
}

impl From<RemoteInvokeMessage> for Call {
    /// Takes everything but `message_id`.
    fn from(m: RemoteInvokeMessage) -> Self {
        Call {
            service_entry_id: m.service_entry_id.into(),
            codec: m.codec,
            parameters: m.parameters,
            attachments: m.attachments,
            timeout_ms: m.timeout_ms,
        }
    }
}

type Waiter = oneshot::Sender<Result<RemoteResultMessage, RpcError>>;

/// A call waiting for its answer.
struct Pending {
    waiter: Waiter,
    /// Milliseconds after the connection's epoch at which the call times out (0: never).
    deadline_ms: u64,
}

/// No sweep scheduled.
const NO_SWEEP: u64 = u64::MAX;

/// One multiplexed connection to a server. Cheap to clone; calls run concurrently and are matched
/// to their answers by `message_id`.
///
/// Dropping the last clone closes the connection and ends its tasks (reader, writer, deadline
/// sweeper, heartbeat): its heartbeats would otherwise keep the server's idle timeout from ever
/// closing a connection nobody can use any more.
#[derive(Clone)]
pub struct Connection {
    shared: Arc<Shared>,
    /// Held only by the clones of this `Connection`, never by its tasks.
    _owners: Arc<CloseOnDrop>,
}

/// Closes the connection when the last [`Connection`] clone goes: the connection's tasks hold
/// `Shared` themselves, so its count cannot tell when users are done with it.
struct CloseOnDrop(Arc<Shared>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.close.cancel();
    }
}

/// Ids of connections, unique in the process.
static NEXT_CONNECTION_ID: AtomicU64 = AtomicU64::new(1);

struct Shared {
    /// Unique in the process, never 0.
    id: u64,
    peer: String,
    sender: FrameSender,
    /// `ConnectOptions::max_unsent_bytes`.
    max_unsent_bytes: usize,
    pending: DashMap<u64, Pending, ahash::RandomState>,
    /// Deadlines are enforced by one sweeper task per connection instead of one timer per
    /// call: `next_sweep` is the earliest deadline not yet checked (ms after `epoch`).
    epoch: Instant,
    next_sweep: AtomicU64,
    sweep: Notify,
    in_flight: Arc<AtomicUsize>,
    next_id: AtomicU64,
    going_away: AtomicBool,
    /// Mirrors `close` for the hot path: checking a token takes a lock, this does not.
    closed: AtomicBool,
    close: CancellationToken,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.shared.peer)
            .field("in_flight", &self.shared.in_flight.load(Ordering::Relaxed))
            .field("usable", &self.is_usable())
            .finish()
    }
}

fn comm_error(peer: &str, what: impl std::fmt::Display) -> RpcError {
    RpcError::new(StatusCode::CommunicationError, format!("{peer}: {what}"))
}

impl Connection {
    /// Connects to `addr`, sends `Hello` and waits for `HelloAck`.
    ///
    /// Errors: [`StatusCode::CommunicationError`] when the server cannot be reached or the
    /// handshake fails (with TLS: also when the server's certificate is not trusted);
    /// [`StatusCode::RpcUnAuthentication`] when the server refuses the token or, with TLS, the
    /// client's certificate.
    pub async fn connect(addr: &str, options: &ConnectOptions) -> Result<Connection, RpcError> {
        tokio::time::timeout(options.connect_timeout, Self::connect_inner(addr, options))
            .await
            .unwrap_or_else(|_| {
                Err(comm_error(
                    addr,
                    format!(
                        "no connection within {} ms; is the server running?",
                        options.connect_timeout.as_millis()
                    ),
                ))
            })
    }

    async fn connect_inner(addr: &str, options: &ConnectOptions) -> Result<Connection, RpcError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| comm_error(addr, format!("connect failed: {e}")))?;
        stream
            .set_nodelay(true)
            .map_err(|e| comm_error(addr, format!("TCP_NODELAY: {e}")))?;
        // The connected socket becomes its reader and writer here, and only here: plain TCP
        // splits in place (no lock between the halves), TLS splits the stream after its
        // handshake. Everything after is generic over the halves.
        #[cfg(feature = "tls")]
        if let Some(tls) = &options.tls {
            let (rd, wr) = tokio::io::split(tls.connect(addr, stream).await?);
            return Self::start(addr, rd, wr, options).await;
        }
        let (rd, wr) = stream.into_split();
        Self::start(addr, rd, wr, options).await
    }

    /// Sends `Hello` on a connected stream, waits for `HelloAck` and starts the connection's
    /// tasks.
    async fn start<R, W>(
        addr: &str,
        rd: R,
        wr: W,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let close = CancellationToken::new();
        let sender = spawn_writer(wr, in_flight.clone(), close.clone());
        sender.send(Kind::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            token: options.token.clone().unwrap_or_default(),
            client_id: options.client_id.clone(),
        }));
        let mut frames =
            FramedRead::with_capacity(rd, FrameCodec::new(options.max_frame_length), READ_BUFFER);
        match frames.next().await {
            Some(Ok(Kind::HelloAck(_))) => {}
            Some(Ok(Kind::GoAway(g))) => {
                close.cancel();
                return Err(RpcError::new(
                    StatusCode::from_u32(g.status_code),
                    format!("{addr} refused the connection: {}", g.reason),
                ));
            }
            Some(Ok(other)) => {
                close.cancel();
                return Err(comm_error(
                    addr,
                    format!("expected HelloAck, got {other:?}"),
                ));
            }
            Some(Err(e)) => {
                close.cancel();
                return Err(handshake_failed(addr, e));
            }
            None => {
                close.cancel();
                return Err(comm_error(addr, "connection closed during the handshake"));
            }
        }
        let shared = Arc::new(Shared {
            id: NEXT_CONNECTION_ID.fetch_add(1, Ordering::Relaxed),
            peer: addr.to_string(),
            sender,
            max_unsent_bytes: options.max_unsent_bytes,
            pending: DashMap::with_hasher(ahash::RandomState::new()),
            epoch: Instant::now(),
            next_sweep: AtomicU64::new(NO_SWEEP),
            sweep: Notify::new(),
            in_flight,
            next_id: AtomicU64::new(1),
            going_away: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            close,
        });
        let received = Arc::new(AtomicU64::new(0));
        tokio::spawn(read_loop(frames, shared.clone(), received.clone()));
        tokio::spawn(sweeper(shared.clone()));
        tokio::spawn(heartbeat(
            Arc::downgrade(&shared),
            options.heartbeat_interval,
            received,
        ));
        Ok(Connection {
            _owners: Arc::new(CloseOnDrop(shared.clone())),
            shared,
        })
    }

    /// A number that identifies this connection in the process (never 0): calls that fail
    /// because the same connection broke can be told apart from independent failures.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The address this connection was made to.
    pub fn peer(&self) -> &str {
        &self.shared.peer
    }

    /// Whether new calls may be sent: open, and the server has not said `GoAway`.
    pub fn is_usable(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire)
            && !self.shared.going_away.load(Ordering::Relaxed)
    }

    /// Whether the server said it is draining (`GoAway` with status 200): calls that then fail
    /// without an answer never reached it.
    pub fn is_draining(&self) -> bool {
        self.shared.going_away.load(Ordering::Relaxed)
    }

    /// Bytes of calls queued on this connection and not yet written to the socket (an
    /// estimate, as [`ConnectOptions::max_unsent_bytes`] counts them).
    pub fn unsent_bytes(&self) -> usize {
        self.shared.sender.backlog().bytes()
    }

    /// Calls in flight on this connection.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// Closes the connection; calls in flight fail with a communication error.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.close.cancel();
    }

    /// Sends one call and waits for its answer; the call's `message_id` is assigned here.
    ///
    /// Dropping the returned future before the answer arrives sends `Cancel` to the server, and
    /// so does reaching `deadline`, which fails the call with [`StatusCode::Timeout`]. Other
    /// errors are [`StatusCode::CommunicationError`]; when the request may have reached the
    /// server the error says so ([`RpcError::is_maybe_delivered`]).
    pub async fn call(
        &self,
        call: impl Into<Call>,
        deadline: Option<Instant>,
    ) -> Result<RemoteResultMessage, RpcError> {
        let call = call.into();
        let shared = &self.shared;
        if !self.is_usable() {
            return Err(comm_error(&shared.peer, "connection closed"));
        }
        if shared.sender.backlog().bytes() > shared.max_unsent_bytes {
            self.wait_for_room(deadline).await?;
        }
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let deadline_ms = deadline.map_or(0, |d| {
            (d.saturating_duration_since(shared.epoch).as_millis() as u64).max(1)
        });
        shared.pending.insert(
            id,
            Pending {
                waiter: tx,
                deadline_ms,
            },
        );
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        if deadline_ms != 0
            && shared.next_sweep.fetch_min(deadline_ms, Ordering::AcqRel) > deadline_ms
        {
            // A new earliest deadline: the sweeper may be asleep until a later one.
            shared.sweep.notify_one();
        }
        let mut guard = PendingGuard {
            shared,
            id,
            armed: true,
        };
        if shared.closed.load(Ordering::Acquire) {
            // The reader ended between the check above and the insert: it will not see this
            // call, so it must not wait.
            guard.disarm_quietly();
            return Err(comm_error(&shared.peer, "connection closed"));
        }
        if !shared.sender.send_call(id, call) {
            guard.disarm_quietly();
            return Err(comm_error(&shared.peer, "connection closed"));
        }
        let result = rx.await;
        guard.armed = false;
        shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        match result {
            Ok(r) => r,
            Err(_) => Err(comm_error(&shared.peer, "connection closed").maybe_delivered(true)),
        }
    }
}

impl Connection {
    /// Waits until the send queue is back within `max_unsent_bytes`: backpressure on callers
    /// when the server does not read, instead of memory growing without limit.
    async fn wait_for_room(&self, deadline: Option<Instant>) -> Result<(), RpcError> {
        let shared = &self.shared;
        let backlog = shared.sender.backlog();
        let max = shared.max_unsent_bytes;
        let mut logged = false;
        loop {
            let room = backlog.room();
            tokio::pin!(room);
            room.as_mut().enable();
            if backlog.bytes() <= max {
                return Ok(());
            }
            if shared.closed.load(Ordering::Acquire) {
                return Err(comm_error(&shared.peer, "connection closed"));
            }
            if !logged {
                logged = true;
                tracing::debug!(
                    peer = %shared.peer,
                    unsent = backlog.bytes(),
                    max,
                    "send queue full: the call waits for room"
                );
            }
            tokio::select! {
                _ = room => {}
                _ = shared.close.cancelled() => {
                    return Err(comm_error(&shared.peer, "connection closed"));
                }
                _ = sleep_until_or_never(deadline) => {
                    return Err(RpcError::new(
                        StatusCode::Timeout,
                        format!(
                            "{}: the call was not sent: the connection's send queue stayed above \
                             {max} bytes until the call's deadline (the server is not reading \
                             its calls; check that it is alive)",
                            shared.peer
                        ),
                    ));
                }
            }
        }
    }
}

async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Removes a call from the pending map and tells the server when the caller gives up.
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u64,
    armed: bool,
}

impl PendingGuard<'_> {
    fn disarm_quietly(&mut self) {
        self.armed = false;
        self.shared.pending.remove(&self.id);
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            if self.shared.pending.remove(&self.id).is_some() {
                self.shared.sender.send(Kind::Cancel(Cancel {
                    message_id: self.id,
                }));
            }
        }
    }
}

fn handshake_failed(addr: &str, e: FrameError) -> RpcError {
    // With TLS 1.3 a server that refuses the client's certificate says so after the client's
    // side of the TLS handshake is done: its alert is the first thing read.
    #[cfg(feature = "tls")]
    if let FrameError::Io(io) = &e {
        if let Some(err) = crate::tls::handshake_error(addr, io) {
            return err;
        }
    }
    if let FrameError::TooLarge { len, .. } = e {
        // The first bytes of a TLS record (an alert or a handshake, version 3.x) read as a
        // length prefix.
        if matches!(len >> 24, 0x15 | 0x16) && (len >> 16) & 0xff == 0x03 {
            return comm_error(
                addr,
                "handshake failed: the server answered with TLS; connect with TLS (feature \
                 `tls`: `ClientBuilder::tls` or `ConnectOptions::tls`)",
            );
        }
    }
    comm_error(addr, format!("handshake failed: {e}"))
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut frames: FramedRead<R, FrameCodec>,
    shared: Arc<Shared>,
    received: Arc<AtomicU64>,
) {
    let mut clean_drain = true;
    let closing = shared.close.cancelled();
    tokio::pin!(closing);
    let reason = loop {
        // Answers already read are handed out before the close signal is polled again.
        let next = match crate::codec::buffered(&mut frames) {
            Some(frame) => Some(frame),
            None => tokio::select! {
                biased;
                _ = &mut closing => break "connection closed".to_string(),
                f = frames.next() => f,
            },
        };
        received.fetch_add(1, Ordering::Relaxed);
        match next {
            Some(Ok(Kind::Result(result))) => {
                if let Some((_, p)) = shared.pending.remove(&result.message_id) {
                    let _ = p.waiter.send(Ok(result));
                }
                // An answer to a cancelled call: ignored, as the protocol says.
            }
            Some(Ok(Kind::Ping(Ping { nonce }))) => {
                shared.sender.send(Kind::Pong(Pong { nonce }));
            }
            Some(Ok(Kind::Pong(_))) => {}
            Some(Ok(Kind::GoAway(g))) => {
                if g.status_code != StatusCode::Success.as_u32() {
                    clean_drain = false;
                    break format!("server closed the connection: {}", g.reason);
                }
                shared.going_away.store(true, Ordering::Relaxed);
                tracing::debug!(peer = %shared.peer, reason = %g.reason, "server is draining");
                if shared.pending.is_empty() {
                    break "server is draining".to_string();
                }
            }
            Some(Ok(other)) => {
                clean_drain = false;
                break format!(
                    "protocol violation: unexpected {} from the server",
                    kind_name(&other)
                );
            }
            Some(Err(e)) => {
                clean_drain = false;
                break format!("bad frame from the server: {e}");
            }
            None => break "connection closed by the server".to_string(),
        }
        if shared.going_away.load(Ordering::Relaxed) && shared.pending.is_empty() {
            break "server is draining".to_string();
        }
    };
    shared.closed.store(true, Ordering::Release);
    shared.close.cancel();
    // A draining server (GoAway 200) answers every call it read, even those it drops at its
    // drain deadline: calls still pending now never reached it and may safely go elsewhere.
    let maybe_delivered = !(clean_drain && shared.going_away.load(Ordering::Relaxed));
    fail_pending(&shared, &reason, maybe_delivered);
}

fn fail_pending(shared: &Shared, reason: &str, maybe_delivered: bool) {
    let ids: Vec<u64> = shared.pending.iter().map(|e| *e.key()).collect();
    for id in ids {
        if let Some((_, p)) = shared.pending.remove(&id) {
            let err = comm_error(&shared.peer, reason).maybe_delivered(maybe_delivered);
            let _ = p.waiter.send(Err(err));
        }
    }
}

/// Fails calls whose deadline passed with [`StatusCode::Timeout`] and sends `Cancel` for them.
/// Sleeps until the earliest deadline, so a connection whose calls all answer in time costs one
/// timer per earliest-deadline change, not one per call.
/// Ends with the connection (the reader cancels `close` whenever it stops).
async fn sweeper(s: Arc<Shared>) {
    let closing = s.close.clone();
    let closing = closing.cancelled();
    tokio::pin!(closing);
    loop {
        let next = s.next_sweep.load(Ordering::Acquire);
        let wake = s.epoch + Duration::from_millis(next.min(u32::MAX as u64));
        tokio::select! {
            _ = &mut closing => return,
            _ = s.sweep.notified() => continue,
            _ = tokio::time::sleep_until(wake), if next != NO_SWEEP => {}
        }
        let now_ms = s.epoch.elapsed().as_millis() as u64;
        if now_ms < s.next_sweep.load(Ordering::Acquire) {
            continue;
        }
        s.next_sweep.store(NO_SWEEP, Ordering::Release);
        let mut expired = Vec::new();
        for e in s.pending.iter() {
            match e.deadline_ms {
                0 => {}
                d if d <= now_ms => expired.push(*e.key()),
                d => {
                    s.next_sweep.fetch_min(d, Ordering::AcqRel);
                }
            }
        }
        for id in expired {
            if let Some((_, p)) = s.pending.remove(&id) {
                let _ = p.waiter.send(Err(RpcError::new(
                    StatusCode::Timeout,
                    format!(
                        "{}: no answer before the call's deadline; the server was told to stop",
                        s.peer
                    ),
                )));
                s.sender.send(Kind::Cancel(Cancel { message_id: id }));
            }
        }
    }
}

/// Pings every `interval`; closes the connection when no frame at all arrived during three
/// intervals in a row (a frame counter is compared, so the reader never reads the clock).
async fn heartbeat(shared: std::sync::Weak<Shared>, interval: Duration, received: Arc<AtomicU64>) {
    let mut nonce = 0u64;
    let mut last_count = received.load(Ordering::Relaxed);
    let mut silent_ticks = 0u32;
    loop {
        let close = match shared.upgrade() {
            Some(s) => s.close.clone(),
            None => return,
        };
        tokio::select! {
            _ = close.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let Some(s) = shared.upgrade() else { return };
        let count = received.load(Ordering::Relaxed);
        if count == last_count {
            silent_ticks += 1;
        } else {
            silent_ticks = 0;
            last_count = count;
        }
        if silent_ticks >= 3 {
            tracing::debug!(peer = %s.peer, "no traffic from the server for three heartbeats: closing");
            s.closed.store(true, Ordering::Release);
            s.close.cancel();
            return;
        }
        nonce += 1;
        s.sender.send(Kind::Ping(Ping { nonce }));
    }
}

pub(crate) fn kind_name(kind: &Kind) -> &'static str {
    match kind {
        Kind::Hello(_) => "Hello",
        Kind::HelloAck(_) => "HelloAck",
        Kind::Invoke(_) => "RemoteInvokeMessage",
        Kind::Result(_) => "RemoteResultMessage",
        Kind::Cancel(_) => "Cancel",
        Kind::Ping(_) => "Ping",
        Kind::Pong(_) => "Pong",
        Kind::GoAway(_) => "GoAway",
    }
}
