//! One multiplexed connection: connect, handshake, send calls, wait for their answers.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;

use futures_util::StreamExt;
use rpc_core::wire::{frame::Kind, Cancel, CancelReason, Hello, RemoteResultMessage};
use rpc_core::{RpcError, StatusCode, PROTOCOL_VERSION};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use super::answer::{Answer, AnswerCodec};
use super::heartbeat::{beats_only, heartbeat, sweeper, STREAM_BEAT};
use super::options::ConnectOptions;
use super::pending::{PendingTable, NO_SWEEP};
use super::reader::{read_loop, EndOnDrop};
use super::shared::{comm_error, ServerLimits, Shared, NEXT_CONNECTION_ID};
use super::stream::{ClientStream, Opened, StreamShared};
use crate::call::Call;
use crate::codec::FrameError;
use crate::compression::Accepted;
use crate::transport::{Address, Dialer, Stream, TcpDialer};
use crate::writer::{spawn_writer, MAX_ITEMS_BYTES, RUN_FRAME_OVERHEAD};
use crate::READ_BUFFER;

/// One multiplexed connection to a server. Cheap to clone; calls run concurrently and are matched
/// to their answers by `message_id`.
///
/// Dropping the last clone closes the connection and ends its tasks (reader, writer, deadline
/// sweeper, heartbeat): its heartbeats would otherwise keep the server's idle timeout from ever
/// closing a connection nobody can use any more.
#[derive(Clone)]
pub struct Connection {
    pub(super) shared: Arc<Shared>,
    /// Held only by the clones of this `Connection`, never by its tasks.
    pub(super) _owners: Arc<CloseOnDrop>,
}

/// Closes the connection when the last [`Connection`] clone goes: the connection's tasks hold
/// `Shared` themselves, so its count cannot tell when users are done with it.
pub(super) struct CloseOnDrop(Arc<Shared>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.close.cancel();
    }
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

impl Connection {
    /// Connects to `addr`, sends `Hello` and waits for `HelloAck`. `addr` is `host:port`
    /// (TCP) or `unix:/path/to.sock` (a Unix domain socket); see [`Address`].
    ///
    /// The `Hello` lists every compression algorithm this build decodes, so the server may
    /// compress its answers; [`call`](Self::call) decompresses them.
    ///
    /// Errors: [`StatusCode::CommunicationError`] when the server cannot be reached or the
    /// handshake fails (with TLS: also when the server's certificate is not trusted);
    /// [`StatusCode::RpcUnAuthentication`] when the server refuses the token or, with TLS, the
    /// client's certificate.
    pub async fn connect(addr: &str, options: &ConnectOptions) -> Result<Connection, RpcError> {
        match Address::parse(addr) {
            Address::Tcp(_) => Self::connect_with(&TcpDialer, addr, options).await,
            #[cfg(unix)]
            Address::Unix(_) => {
                Self::connect_with(&crate::transport::UnixDialer, addr, options).await
            }
            #[cfg(not(unix))]
            Address::Unix(_) => Err(comm_error(addr, crate::transport::no_unix_sockets(addr))),
        }
    }

    /// Like [`connect`](Self::connect), over the transport of `dialer`.
    pub async fn connect_with<D: Dialer>(
        dialer: &D,
        addr: &str,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError> {
        tokio::time::timeout(
            options.connect_timeout,
            Self::connect_inner(dialer, addr, options),
        )
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

    async fn connect_inner<D: Dialer>(
        dialer: &D,
        addr: &str,
        options: &ConnectOptions,
    ) -> Result<Connection, RpcError> {
        let (stream, _peer) = dialer
            .dial(addr)
            .await
            .map_err(|e| comm_error(addr, format!("connect failed: {e}")))?;
        // The connected socket becomes its reader and writer here, and only here: a plain
        // socket splits in place (no lock between the halves), TLS splits the stream after its
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
        W: AsyncWrite + crate::transport::Abortive + Unpin + Send + 'static,
    {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let close = CancellationToken::new();
        let sender = spawn_writer(wr, in_flight.clone(), close.clone());
        sender.send(Kind::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            token: options.token.clone().unwrap_or_default(),
            client_id: options.client_id.clone(),
            accept_compression: crate::compression::supported_wire(),
            streams: options.streams,
            stream_window: options.stream_window.clamp(1, crate::MAX_STREAM_WINDOW),
            stream_window_bytes: options.stream_window_bytes,
            // Runs are up to MAX_ITEMS_BYTES of items: a client whose frame limit is below a
            // whole run takes one item per frame.
            stream_batches: options.streams
                && options.max_frame_length >= MAX_ITEMS_BYTES + RUN_FRAME_OVERHEAD,
        }));
        // Whatever arrives counts as a sign of life for the heartbeat (see `AnswerCodec`).
        let received = Arc::new(AtomicU64::new(0));
        let codec = AnswerCodec::new(options.max_frame_length, received.clone());
        let mut frames = FramedRead::with_capacity(rd, codec, READ_BUFFER);
        let (accepts, server_streams, batches, window_bytes, send_window_bytes, limits) =
            match frames.next().await {
                // (0: not said, proto3's default, taken as this version.)
                Some(Ok(Answer::Frame(Kind::HelloAck(ack))))
                    if ack.protocol_version != 0 && ack.protocol_version != PROTOCOL_VERSION =>
                {
                    close.cancel();
                    // This endpoint cannot serve the call, nothing was sent, and its health is
                    // not in question (an instance of another version in a rolling upgrade):
                    // the call goes on to another, and no breaker counts it.
                    return Err(RpcError::new(
                        StatusCode::FrameworkError,
                        format!(
                            "{addr} answered the handshake in protocol version {}; this client \
                             speaks {PROTOCOL_VERSION}: use a client and server of the same \
                             protocol",
                            ack.protocol_version
                        ),
                    )
                    .unsupported_by_endpoint(true));
                }
                Some(Ok(Answer::Frame(Kind::HelloAck(ack)))) => {
                    let streams = options.streams && ack.streams;
                    // A server announcing a byte window of its own keeps the client's too.
                    let bytes = streams && ack.stream_window_bytes > 0;
                    (
                        Accepted::from_wire(&ack.accept_compression),
                        streams,
                        // Runs no larger than the server's frame limit takes (0: not said, the
                        // protocol's default, far above a run).
                        (streams && ack.stream_batches).then(|| match ack.max_frame_length {
                            0 => MAX_ITEMS_BYTES,
                            limit => (limit as usize).saturating_sub(RUN_FRAME_OVERHEAD),
                        }),
                        if bytes {
                            u64::from(options.stream_window_bytes)
                        } else {
                            0
                        },
                        if bytes {
                            u64::from(ack.stream_window_bytes)
                        } else {
                            0
                        },
                        ServerLimits {
                            attachments: ack.max_attachments.map(|n| n as usize),
                            attachment_bytes: ack.max_attachment_bytes.map(|n| n as usize),
                            // 0: not said (a server from before the field).
                            frame_length: match ack.max_frame_length {
                                0 => usize::MAX,
                                n => n as usize,
                            },
                        },
                    )
                }
                Some(Ok(Answer::Frame(Kind::GoAway(g)))) => {
                    close.cancel();
                    // 200 is a server shutting down (it takes no new connection): nothing
                    // was sent, so another endpoint may take the call.
                    if g.status_code == StatusCode::Success.as_u32() {
                        return Err(comm_error(
                            addr,
                            format!("the server is shutting down: {}", g.reason),
                        ));
                    }
                    // The handshake refused (its version or client id, or its time), not the
                    // call: nothing was sent, and another endpoint may take it. (A refused
                    // token and a server at its connection cap keep their status: the first
                    // is the caller's to mend, the second an overflow, retried as one.)
                    let code = StatusCode::from_u32(g.status_code);
                    if matches!(code, StatusCode::FrameworkError | StatusCode::Timeout) {
                        // Nor the endpoint's health: no breaker or health mark counts it.
                        return Err(comm_error(
                            addr,
                            format!("the server refused the handshake ({code:?}): {}", g.reason),
                        )
                        .unsupported_by_endpoint(true));
                    }
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
            };
        let shared = Arc::new(Shared {
            id: NEXT_CONNECTION_ID.fetch_add(1, Ordering::Relaxed),
            peer: addr.to_string(),
            sender,
            max_unsent_bytes: options.max_unsent_bytes,
            max_frame_length: options.max_frame_length,
            accepts,
            pending: PendingTable::default(),
            epoch: Instant::now(),
            next_sweep: AtomicU64::new(NO_SWEEP),
            sweep: Notify::new(),
            sweeps: AtomicU64::new(0),
            in_flight,
            going_away: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            close,
            close_reason: std::sync::OnceLock::new(),
            beats: AtomicU64::new(0),
            server_streams,
            client_streams: options.streams,
            stream_window: options.stream_window.clamp(1, crate::MAX_STREAM_WINDOW),
            stream_window_bytes: window_bytes,
            send_window_bytes,
            limits,
        });
        if let Some(items_cap) = batches {
            shared.sender.batch_stream_items(items_cap);
        }
        let on_drop = EndOnDrop::new(shared.clone());
        tokio::spawn(read_loop(frames, shared.clone(), received.clone(), on_drop));
        tokio::spawn(sweeper(shared.clone()));
        // Zero is "no heartbeat": a zero pause would close the connection as silent three
        // ticks after the handshake, before the server could answer a ping.
        if !options.heartbeat_interval.is_zero() {
            tokio::spawn(heartbeat(
                Arc::downgrade(&shared),
                options.heartbeat_interval,
                received,
            ));
        } else if shared.client_streams && shared.server_streams {
            // Its streams' slow consumers still report their progress within a beat.
            tokio::spawn(beats_only(Arc::downgrade(&shared), STREAM_BEAT));
        }
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

    /// Whether new calls may be sent: open, the server has not said `GoAway`, and the client
    /// has not retired it ([`close_if_idle`](Self::close_if_idle)).
    pub fn is_usable(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire)
            && !self.shared.going_away.load(Ordering::Relaxed)
            && !self.shared.retired.load(Ordering::Relaxed)
    }

    /// Takes no new call from now on, and closes the connection if no call or stream is in
    /// flight; returns whether it closed. A call about to be sent meanwhile fails as not sent
    /// (to go elsewhere) rather than being cut off as maybe delivered; calls in flight go on.
    pub fn close_if_idle(&self) -> bool {
        self.shared.retired.store(true, Ordering::SeqCst);
        let idle = self.shared.in_flight.load(Ordering::SeqCst) == 0;
        if idle {
            self.close();
        } else {
            // Calls waiting for room in the send queue are not to be sent now.
            self.shared.sender.backlog().wake_room_waiters();
        }
        idle
    }

    /// Whether the server said it is draining (`GoAway` with status 200): it answers every
    /// call it read, so calls that fail without an answer when it closes the connection never
    /// reached it (a connection this client closes itself makes no such promise).
    pub fn is_draining(&self) -> bool {
        self.shared.going_away.load(Ordering::Relaxed)
    }

    /// Bytes of calls queued on this connection and not yet written to the socket (an
    /// estimate, as [`ConnectOptions::max_unsent_bytes`] counts them).
    pub fn unsent_bytes(&self) -> usize {
        self.shared.sender.backlog().bytes()
    }

    /// Whether the server listed `algorithm` in its `HelloAck` as one it decodes: a call's
    /// parameters may be compressed with it ([`Call::compression`]).
    pub fn accepts(&self, algorithm: rpc_core::Compression) -> bool {
        self.shared.accepts.contains(algorithm)
    }

    /// The compression algorithms the server decodes, as its `HelloAck` listed them.
    pub fn accept_compression(&self) -> Accepted {
        self.shared.accepts
    }

    /// Whether the server takes streams on this connection (both sides offered them in the
    /// handshake).
    pub fn supports_streams(&self) -> bool {
        self.shared.server_streams
    }

    /// Calls (and streams) in flight on this connection.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// Closes the connection; calls in flight fail with a communication error.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.close.cancel();
    }

    /// Sends one call and waits for its answer; the call's `message_id` is assigned here. A
    /// compressed answer comes back decompressed (`compression` 0): a result that does not
    /// decompress, or would exceed `ConnectOptions::max_frame_length`, fails the call with
    /// [`StatusCode::FrameworkError`] saying so. A call carrying more attachments (count or
    /// bytes) than the server said in its handshake it takes, or whose frame is longer than it
    /// reads, fails at once with [`StatusCode::ValidateError`], sending nothing.
    ///
    /// Dropping the returned future before the answer arrives sends `Cancel` to the server, and
    /// so does reaching `deadline`, which fails the call with [`StatusCode::Timeout`]; a
    /// `deadline` already past fails it so without sending it. A call asking for a stream
    /// (`stream_mode` other than unary) fails at once with [`StatusCode::FrameworkError`]:
    /// streams are opened with [`open_stream`](Self::open_stream). Other errors are
    /// [`StatusCode::CommunicationError`]; when the request may have reached the server the
    /// error says so ([`RpcError::is_maybe_delivered`]).
    pub async fn call(
        &self,
        call: impl Into<Call>,
        deadline: Option<Instant>,
    ) -> Result<RemoteResultMessage, RpcError> {
        let mut call = call.into();
        let shared = &self.shared;
        if call.stream_mode != rpc_core::StreamMode::Unary as i32 {
            // The server would open a stream whose items this call's slot cannot take.
            return Err(RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "call is for unary calls, and this one asks for stream mode {}; open a \
                     stream with open_stream",
                    call.stream_mode
                ),
            ));
        }
        if !self.is_usable() {
            return Err(shared.takes_no_call_error());
        }
        if let Some(e) = shared.over_attachment_limits(&call) {
            return Err(e);
        }
        // Over the frame limit with the shortest id already: refused before any wait for
        // room (the exact check, with the id, comes once it is assigned).
        if let Some(e) = shared.over_frame_limit(&call, 0) {
            return Err(e);
        }
        if shared.sender.backlog().bytes() > shared.max_unsent_bytes {
            self.wait_for_room(deadline).await?;
            call.timeout_ms = budget_left(call.timeout_ms, deadline);
        }
        let deadline_ms = deadline.map_or(0, |d| deadline_ms(shared.epoch, d));
        let mut guard = PendingGuard {
            shared,
            id: 0,
            armed: false,
        };
        let mut call = Some(call);
        // The call takes its slot and is sent from its first poll, so the slot gets the
        // caller's waker at once: one lock of the table fewer per call.
        let result = std::future::poll_fn(|cx| {
            let Some(call) = call.take() else {
                return shared.pending.poll(guard.id, cx);
            };
            if let Some(e) = shared.past_deadline(deadline) {
                return Poll::Ready(Err(e));
            }
            let sweeps = shared.sweeps.load(Ordering::SeqCst);
            guard.id = shared.pending.insert(deadline_ms, Some(cx.waker().clone()));
            guard.armed = true;
            shared.in_flight.fetch_add(1, Ordering::SeqCst);
            if shared.takes_no_call() {
                // The reader ended (or the connection was retired) between the check above
                // and the insert: it will not see this call, so it must not wait.
                guard.disarm_quietly();
                return Poll::Ready(Err(shared.takes_no_call_error()));
            }
            // Measured with the id it goes with, now known.
            if let Some(e) = shared.over_frame_limit(&call, guard.id) {
                guard.disarm_quietly();
                return Poll::Ready(Err(e));
            }
            if !shared.sender.send_call(guard.id, call) {
                guard.disarm_quietly();
                return Poll::Ready(Err(shared.takes_no_call_error()));
            }
            // Only once the call is queued: a sweeper woken earlier could queue its Cancel
            // ahead of it, which the server, not knowing the id yet, would drop. (A sweep
            // already running may have: then it goes again.)
            shared.cancel_again_if_swept(guard.id, deadline_ms, sweeps);
            shared.wake_sweeper_for(deadline_ms);
            Poll::Pending
        })
        .await;
        if guard.armed {
            guard.armed = false;
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        match result {
            Ok(answer) if answer.compression != 0 => self.unpack(answer),
            other => other,
        }
    }

    /// A compressed answer's result, decompressed within the client's frame limit.
    pub(super) fn unpack(
        &self,
        mut answer: RemoteResultMessage,
    ) -> Result<RemoteResultMessage, RpcError> {
        let limit = self.shared.max_frame_length;
        match crate::compression::decompress(answer.compression, &answer.result, limit) {
            Ok(plain) => {
                answer.result = plain;
                answer.compression = 0;
                Ok(answer)
            }
            Err(e) => Err(RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "{}: the answer (status {}) could not be read: {e}",
                    self.shared.peer, answer.status_code
                ),
            )),
        }
    }
}

impl Connection {
    /// Opens a stream: sends `call` with `mode` (not unary) and waits for the server's
    /// set-up. The stream's `message_id` is assigned here.
    ///
    /// The server either accepts it ([`Opened::Accepted`]: the items follow) or refuses it
    /// with its answer ([`Opened::Refused`], as a unary call's answer: nothing was streamed).
    /// `deadline` covers the set-up and the whole stream: when it passes, the stream ends with
    /// a [`StatusCode::Timeout`] error item after the items that arrived, and the server is
    /// sent `Cancel`. Dropping the future during the set-up, or the stream before its end,
    /// sends `Cancel` too.
    ///
    /// Errors: [`StatusCode::NotImplemented`] at once, sending nothing, when the server did
    /// not take streams in the handshake; otherwise as [`call`](Self::call).
    pub async fn open_stream(
        &self,
        call: impl Into<Call>,
        mode: rpc_core::StreamMode,
        deadline: Option<Instant>,
    ) -> Result<Opened, RpcError> {
        self.open_stream_within(call, mode, deadline, None).await
    }

    /// [`open_stream`](Self::open_stream), with the set-up bounded by `set_up_by` too (an
    /// attempt's deadline, earlier than the stream's): waiting for room in the send queue
    /// past it fails as not sent ([`RpcError::is_not_sent`]), and waiting for the server's
    /// set-up past it fails with [`StatusCode::Timeout`] and sends `Cancel`. The accepted
    /// stream then runs until `deadline`.
    pub async fn open_stream_within(
        &self,
        call: impl Into<Call>,
        mode: rpc_core::StreamMode,
        deadline: Option<Instant>,
        set_up_by: Option<Instant>,
    ) -> Result<Opened, RpcError> {
        let send_by = match (deadline, set_up_by) {
            (Some(d), Some(s)) => Some(d.min(s)),
            (d, s) => d.or(s),
        };
        let mut call = call.into();
        let shared = &self.shared;
        if !shared.client_streams {
            return Err(RpcError::new(
                StatusCode::NotImplemented,
                format!(
                    "{}: this client does not stream (its ConnectOptions::streams is off): \
                     turn it on to open streams",
                    shared.peer
                ),
            ));
        }
        if !shared.server_streams {
            // Another instance may stream (during a rolling upgrade): failover moves on.
            return Err(RpcError::new(
                StatusCode::NotImplemented,
                format!(
                    "{}: this connection does not stream: the server did not offer streams in \
                     its handshake (an older server); call a unary method, or upgrade the \
                     server",
                    shared.peer
                ),
            )
            .unsupported_by_endpoint(true));
        }
        if mode == rpc_core::StreamMode::Unary {
            return Err(RpcError::new(
                StatusCode::FrameworkError,
                "open_stream needs a streaming mode; use call for a unary call",
            ));
        }
        if !self.is_usable() {
            return Err(shared.takes_no_call_error());
        }
        call.stream_mode = mode as i32;
        if let Some(e) = shared.over_attachment_limits(&call) {
            return Err(e);
        }
        if let Some(e) = shared.over_frame_limit(&call, 0) {
            return Err(e);
        }
        if shared.sender.backlog().bytes() > shared.max_unsent_bytes {
            self.wait_for_room(send_by).await?;
            call.timeout_ms = budget_left(call.timeout_ms, deadline);
        }
        let deadline_ms = deadline.map_or(0, |d| deadline_ms(shared.epoch, d));
        if let Some(e) = shared.past_deadline(send_by) {
            return Err(e);
        }
        let stream = Arc::new(StreamShared::new(
            shared.stream_window,
            shared.stream_window_bytes,
            shared.send_window_bytes,
        ));
        let sweeps = shared.sweeps.load(Ordering::SeqCst);
        let id = shared.pending.insert_stream(deadline_ms, stream.clone());
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        if let Some(e) = shared.over_frame_limit(&call, id) {
            // (Never sent: the server is told nothing.)
            shared.pending.remove(id);
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err(e);
        }
        // From here the stream owns the slot: dropping it (or this future before the set-up
        // is known) frees the slot and sends Cancel while the server may still run it.
        let accepted = ClientStream::new(self.clone(), (id, mode), stream.clone());
        if shared.takes_no_call() || !shared.sender.send_call(id, call) {
            // The reader may not see this stream: it must not wait.
            return Err(shared.takes_no_call_error());
        }
        // (Once queued, as for a call.)
        shared.cancel_again_if_swept(id, deadline_ms, sweeps);
        shared.wake_sweeper_for(deadline_ms);
        let set_up = std::future::poll_fn(|cx| stream.poll_open(cx));
        let set_up = match set_up_by {
            Some(by) if deadline.is_none_or(|d| by < d) => {
                match tokio::time::timeout_at(by, set_up).await {
                    Ok(set_up) => set_up,
                    // (`accepted`, dropped on return, sends Cancel.)
                    Err(_) => Err(RpcError::new(
                        StatusCode::Timeout,
                        format!(
                            "{}: no answer to the stream's set-up before the attempt's \
                             deadline; the server was told to stop",
                            shared.peer
                        ),
                    )),
                }
            }
            _ => set_up.await,
        };
        match set_up {
            Ok(None) => Ok(Opened::Accepted(accepted)),
            Ok(Some(answer)) if answer.status_code == StatusCode::Success.as_u32() => {
                Err(RpcError::new(
                    StatusCode::FrameworkError,
                    format!(
                        "{}: the server answered the stream's opening as a unary call; is the \
                         method a streaming one on the server too?",
                        shared.peer
                    ),
                ))
            }
            // (A refusal's result may carry a typed error, compressed as any answer may be.)
            Ok(Some(refusal)) if refusal.compression != 0 => {
                self.unpack(refusal).map(Opened::Refused)
            }
            Ok(Some(refusal)) => Ok(Opened::Refused(refusal)),
            Err(e) => Err(e),
        }
    }

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
            if shared.going_away.load(Ordering::Relaxed) {
                // It takes no new calls (GoAway, which wakes this wait): this one goes
                // elsewhere, never sent here, even if room came with it.
                return Err(comm_error(
                    &shared.peer,
                    "the call was not sent: the server is draining (GoAway) and takes no new \
                     calls on this connection",
                ));
            }
            if shared.retired.load(Ordering::SeqCst) {
                // Nor once this client retired it (its endpoint left the registry).
                // No fault of the endpoint's: another serves the call, and nothing is held
                // against this one, which nobody lists any longer.
                return Err(shared.takes_no_call_error());
            }
            if backlog.bytes() <= max {
                return Ok(());
            }
            if shared.closed.load(Ordering::Acquire) {
                return Err(shared.takes_no_call_error());
            }
            if backlog.is_stopped() {
                // A write failed (or the connection closed): what is queued will never be
                // written, and the reader may go on reading for a while yet.
                return Err(comm_error(
                    &shared.peer,
                    "the call was not sent: the connection's writer stopped (a write failed)",
                ));
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
                    return Err(shared.takes_no_call_error());
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
                    )
                    .not_sent(true));
                }
            }
        }
    }
}

pub(super) async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

pub(super) fn handshake_failed(addr: &str, e: FrameError) -> RpcError {
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

/// Removes a call from the pending table and tells the server when the caller gives up.
pub(super) struct PendingGuard<'a> {
    pub(super) shared: &'a Shared,
    pub(super) id: u64,
    pub(super) armed: bool,
}

impl PendingGuard<'_> {
    pub(super) fn disarm_quietly(&mut self) {
        self.armed = false;
        self.shared.pending.remove(self.id);
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            if self.shared.pending.remove(self.id) {
                self.shared.sender.send(Kind::Cancel(Cancel {
                    message_id: self.id,
                    reason: dropped_reason() as i32,
                }));
            }
        }
    }
}

/// Why a call or stream dropped while the server still has it is cancelled: dropped as the
/// losing attempt of a call another attempt answered (a hedge, or a middle tier's handler
/// superseded in its turn), the server is told the call succeeded; otherwise it was given up.
pub(super) fn dropped_reason() -> CancelReason {
    if rpc_core::superseded::is_superseding() {
        CancelReason::Superseded
    } else {
        CancelReason::Unspecified
    }
}

/// `timeout_ms` (the caller's budget; 0, none) as it stands now for a call that waited for room
/// in the send queue: no more than what is left before `deadline`, rounded up (at least 1). The
/// server's deadline then does not fall after the caller's by the time the call waited.
fn budget_left(timeout_ms: u32, deadline: Option<Instant>) -> u32 {
    match deadline {
        Some(d) if timeout_ms != 0 => {
            let left = d
                .saturating_duration_since(Instant::now())
                .as_micros()
                .div_ceil(1000);
            timeout_ms.min(left.clamp(1, u128::from(u32::MAX)) as u32)
        }
        _ => timeout_ms,
    }
}

/// Deadline `d` in whole milliseconds after the connection's epoch, rounded up (at least 1):
/// the sweeper expires a call once the millisecond it is in reaches this, so never before its
/// deadline. (Rounded down, a call could time out up to a millisecond early: a middle tier
/// whose nested call ended so, just before its own caller's deadline, would start a fallback
/// its caller no longer waits for.)
fn deadline_ms(epoch: Instant, d: Instant) -> u64 {
    let nanos = d.saturating_duration_since(epoch).as_nanos();
    u64::try_from(nanos.div_ceil(1_000_000))
        .unwrap_or(u64::MAX)
        .max(1)
}

#[cfg(test)]
mod deadline_tests {
    use super::deadline_ms;
    use std::time::Duration;
    use tokio::time::Instant;

    /// The sweeper expires a call once `now_ms` (the whole milliseconds elapsed, rounded
    /// down) reaches its `deadline_ms`: rounded up, that is never before the deadline.
    #[test]
    fn a_deadline_is_rounded_up_to_the_millisecond_so_no_call_expires_before_it() {
        let epoch = Instant::now();
        for micros in [1u64, 999, 1000, 1001, 100_300, 100_999, 101_000] {
            let deadline = epoch + Duration::from_micros(micros);
            let ms = deadline_ms(epoch, deadline);
            assert_eq!(ms, micros.div_ceil(1000), "{micros} us");
            // The earliest moment the sweeper expires it: when floor(elapsed) reaches `ms`.
            assert!(epoch + Duration::from_millis(ms) >= deadline, "{micros} us");
        }
        assert_eq!(
            deadline_ms(epoch, epoch),
            1,
            "never 0, which means no deadline"
        );
    }
}
