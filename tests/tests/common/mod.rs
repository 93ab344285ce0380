//! Helpers shared by the integration tests: bounded waits, a raw frame socket that speaks the
//! wire from `proto/rpc.proto` by hand, and small synchronisation probes for service impls.
//!
//! Every test file includes this module with `mod common;`; not every file uses every helper.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use prost::Message;
use rpc::crates::core::wire::{
    frame::Kind, Frame, GoAway, Hello, HelloAck, RemoteInvokeMessage, StreamCredit, StreamMode,
};
use rpc::crates::transport::FrameCodec;
use rpc::GovernanceOverrides;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub mod certs;
pub mod otel;
pub mod registry;

/// Upper bound of every wait in the suite: a test that would hang fails after this instead.
pub const LIMIT: Duration = Duration::from_secs(5);

/// Awaits `fut`, failing the test with `what` if it does not finish within [`LIMIT`].
pub async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {LIMIT:?}"),
    }
}

/// Client overrides that turn retries off.
pub fn no_retry() -> GovernanceOverrides {
    GovernanceOverrides {
        retry_times: Some(0),
        ..GovernanceOverrides::NONE
    }
}

/// A listener for a raw peer on a free loopback port, and its address.
pub async fn raw_listener() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    (listener, addr)
}

/// A raw server's handshake answer: version 1, streams, a window of `window` items, nothing
/// else (no batches, no byte windows, no compression), as an older server that streams gives.
pub fn streaming_ack(window: u32) -> HelloAck {
    HelloAck {
        protocol_version: 1,
        streams: true,
        stream_window: window,
        ..Default::default()
    }
}

/// The opening of stream `id` of `entry` in `mode`, its arguments `args` in MessagePack, with
/// no deadline; other fields are set with `RemoteInvokeMessage { ..stream_opening(..) }`.
pub fn stream_opening(
    id: u64,
    entry: &str,
    args: &impl serde::Serialize,
    mode: StreamMode,
) -> RemoteInvokeMessage {
    RemoteInvokeMessage {
        message_id: id,
        service_entry_id: entry.into(),
        parameters: rpc::Codec::MsgPack.encode(args).expect("encode"),
        stream_mode: mode as i32,
        ..Default::default()
    }
}

/// Installs `subscriber` for this thread until the guard is dropped, as
/// `tracing::subscriber::set_default` does, once every callsite is kept of interest process-wide.
///
/// Why: `tracing` caches each callsite's interest for the whole process. A test thread with no
/// subscriber that reaches a span's callsite while another test installs its own can leave that
/// callsite cached as of no interest (its interest is computed before the callsite is listed, so
/// the rebuild at the install misses it), and the span test then records none of those spans.
/// A global registry with no layers wants every callsite, so no callsite is ever cached as
/// unwanted; threads without a subscriber of their own record into it and nothing reads it.
pub fn trace_this_thread(
    subscriber: impl tracing::Subscriber + Send + Sync + 'static,
) -> tracing::subscriber::DefaultGuard {
    static GLOBAL: std::sync::Once = std::sync::Once::new();
    GLOBAL.call_once(|| {
        // (Another global default set first would serve as well.)
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
    });
    tracing::subscriber::set_default(subscriber)
}

/// Receives exactly one message from `rx` within [`LIMIT`].
pub async fn recv_one<T>(what: &str, rx: &mut mpsc::UnboundedReceiver<T>) -> T {
    match within(what, rx.recv()).await {
        Some(v) => v,
        None => panic!("{what}: channel closed"),
    }
}

/// Polls `call` until its handler reports `tag` on `entered`, and hands the call back still
/// pending; fails the test if the call answers first, or if another tag comes.
pub async fn until_entered<F>(
    mut call: std::pin::Pin<Box<F>>,
    tag: &str,
    entered: &mut mpsc::UnboundedReceiver<String>,
) -> std::pin::Pin<Box<F>>
where
    F: Future,
    F::Output: std::fmt::Debug,
{
    tokio::select! {
        r = &mut call => panic!("the call answered before its handler ran: {r:?}"),
        got = entered.recv() => assert_eq!(got.as_deref(), Some(tag)),
    }
    call
}

/// Waits for a permit of `release` and keeps it: a handler held until the test lets it through,
/// one permit per call; an error once the semaphore is closed.
pub async fn let_through(release: &tokio::sync::Semaphore) -> Result<(), rpc::RpcError> {
    release
        .acquire()
        .await
        .map_err(|_| rpc::RpcError::business("gate closed"))?
        .forget();
    Ok(())
}

/// Signals `tag` on a channel when dropped: handed into a handler, it proves the handler's
/// future was dropped (cancelled) rather than left running.
pub struct DropSignal {
    tag: String,
    tx: mpsc::UnboundedSender<String>,
}

impl DropSignal {
    pub fn new(tag: impl Into<String>, tx: mpsc::UnboundedSender<String>) -> Self {
        DropSignal {
            tag: tag.into(),
            tx,
        }
    }
}

impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.tx.send(std::mem::take(&mut self.tag));
    }
}

/// A raw TCP connection speaking frames by hand: 4-byte big-endian length, then one protobuf
/// `Frame`. Decoding deliberately does not use the framework's codec.
pub struct RawConn {
    stream: TcpStream,
}

impl RawConn {
    pub async fn connect(addr: SocketAddr) -> Self {
        let stream = within("raw connect", TcpStream::connect(addr))
            .await
            .expect("raw connect");
        stream.set_nodelay(true).expect("nodelay");
        RawConn { stream }
    }

    /// The connection's stream, for a test that reads its bytes as they come (nothing read
    /// is held here: each frame is read to its end and no further).
    pub fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// Wraps an accepted connection (for tests that play the server).
    pub fn from_stream(stream: TcpStream) -> Self {
        stream.set_nodelay(true).expect("nodelay");
        RawConn { stream }
    }

    /// Plays a server: accepts one connection on `listener`, reads the client's `Hello`
    /// (returned, for the test to check) and answers `ack`.
    pub async fn accept_with(listener: &TcpListener, ack: HelloAck) -> (Self, Hello) {
        let (stream, _) = within("accept", listener.accept()).await.expect("accept");
        let mut peer = RawConn::from_stream(stream);
        let hello = match peer.recv().await {
            Some(Kind::Hello(h)) => h,
            other => panic!("expected Hello, got {other:?}"),
        };
        peer.send(Kind::HelloAck(ack)).await.expect("send HelloAck");
        (peer, hello)
    }

    /// The next frame, which must be a call or a stream's opening (`what` names it).
    pub async fn recv_invoke(&mut self, what: &str) -> RemoteInvokeMessage {
        match self.recv().await {
            Some(Kind::Invoke(i)) => i,
            other => panic!("expected {what}, got {other:?}"),
        }
    }

    /// Opens a client stream `id` of `entry` (a method taking only the stream) and reads its
    /// acceptance.
    pub async fn open_client_stream(&mut self, id: u64, entry: &str) {
        self.open_stream(id, entry, &(), StreamMode::Client).await;
        self.recv_acceptance(id).await;
    }

    /// Sends the opening of stream `id` of `entry` in `mode`, its arguments `args` in
    /// MessagePack (the server's answer is the caller's to read).
    pub async fn open_stream(
        &mut self,
        id: u64,
        entry: &str,
        args: &impl serde::Serialize,
        mode: StreamMode,
    ) {
        self.send(Kind::Invoke(stream_opening(id, entry, args, mode)))
            .await
            .expect("open");
    }

    /// Reads stream `id`'s acceptance (its first `StreamCredit`).
    pub async fn recv_acceptance(&mut self, id: u64) {
        match within("the stream's acceptance", self.recv()).await {
            Some(Kind::StreamCredit(c)) => assert_eq!(c.message_id, id, "{c:?}"),
            other => panic!("expected the stream's acceptance, got {other:?}"),
        }
    }

    /// Sends one item of stream `id` (`compression`: its algorithm's wire number, 0 plain).
    pub async fn send_item(&mut self, id: u64, payload: bytes::Bytes, compression: i32) {
        self.send(Kind::StreamItem(rpc::crates::core::wire::StreamItem {
            message_id: id,
            payload,
            compression,
        }))
        .await
        .expect("send StreamItem");
    }

    /// Ends the request stream `id` with `status` (200: complete) and `message`.
    pub async fn end_stream(&mut self, id: u64, status: u32, message: &str) {
        self.send(Kind::StreamEnd(rpc::crates::core::wire::StreamEnd {
            message_id: id,
            status_code: status,
            exception_message: message.into(),
        }))
        .await
        .expect("send StreamEnd");
    }

    /// The end of a stream (its result), the credit frames before it skipped.
    pub async fn recv_end(&mut self) -> rpc::crates::core::wire::RemoteResultMessage {
        loop {
            match within("the end", self.recv()).await {
                Some(Kind::Result(r)) => return r,
                Some(Kind::StreamCredit(_)) => continue,
                other => panic!("expected the end, got {other:?}"),
            }
        }
    }

    /// Answers call `id` (or ends server stream `id`) with `status` and `message`, no result.
    pub async fn answer(&mut self, id: u64, status: u32, message: &str) {
        self.send(Kind::Result(rpc::crates::core::wire::RemoteResultMessage {
            message_id: id,
            status_code: status,
            exception_message: message.into(),
            ..Default::default()
        }))
        .await
        .expect("send RemoteResultMessage");
    }

    /// Grants stream `id` credit for `items` more items (0 with the first: accepts it).
    pub async fn grant(&mut self, id: u64, items: u32) {
        self.send(Kind::StreamCredit(StreamCredit {
            message_id: id,
            items,
        }))
        .await
        .expect("send StreamCredit");
    }

    /// Sends one frame encoded by the framework's codec.
    pub async fn send(&mut self, kind: Kind) -> std::io::Result<()> {
        let mut buf = BytesMut::new();
        FrameCodec::encode_kind(kind, &mut buf);
        self.stream.write_all(&buf).await
    }

    /// Sends one frame encoded here from the proto definition alone.
    pub async fn send_by_hand(&mut self, kind: Kind) -> std::io::Result<()> {
        let body = Frame { kind: Some(kind) }.encode_to_vec();
        let mut bytes = (body.len() as u32).to_be_bytes().to_vec();
        bytes.extend_from_slice(&body);
        self.stream.write_all(&bytes).await
    }

    /// Sends raw bytes.
    pub async fn send_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Reads frames until `pick` takes one (within [`LIMIT`]), skipping the others; panics,
    /// naming `what`, if the connection closes first.
    pub async fn skip_to<T>(&mut self, what: &str, mut pick: impl FnMut(Kind) -> Option<T>) -> T {
        within(what, async {
            loop {
                match self.recv().await {
                    Some(kind) => {
                        if let Some(found) = pick(kind) {
                            return found;
                        }
                    }
                    None => panic!("closed before {what}"),
                }
            }
        })
        .await
    }

    /// The next answer (`Result`), skipping other frames (see [`skip_to`](Self::skip_to)).
    pub async fn next_result(
        &mut self,
        what: &str,
    ) -> rpc::crates::core::wire::RemoteResultMessage {
        self.skip_to(what, |kind| match kind {
            Kind::Result(r) => Some(r),
            _ => None,
        })
        .await
    }

    /// Closes the sending side only (a TCP half-close): the peer reads the end of the stream,
    /// and this side still reads.
    pub async fn half_close(&mut self) {
        use tokio::io::AsyncWriteExt;
        self.stream.shutdown().await.expect("half-close");
    }

    /// The next frame, or `None` once the peer closed the connection (end of stream or reset).
    /// Fails the test if nothing happens within [`LIMIT`].
    pub async fn recv(&mut self) -> Option<Kind> {
        within("raw recv", async {
            let mut prefix = [0u8; 4];
            if self.stream.read_exact(&mut prefix).await.is_err() {
                return None;
            }
            let len = u32::from_be_bytes(prefix) as usize;
            assert!(len <= 64 << 20, "server announced a frame of {len} bytes");
            let mut body = vec![0u8; len];
            if self.stream.read_exact(&mut body).await.is_err() {
                return None;
            }
            let frame = Frame::decode(&body[..]).expect("server sent a malformed Frame");
            Some(frame.kind.expect("server sent an empty Frame"))
        })
        .await
    }

    /// Sends a version-1 `Hello` with `token` and returns the server's reply.
    pub async fn hello(&mut self, token: &str) -> Option<Kind> {
        self.send(Kind::Hello(Hello {
            protocol_version: 1,
            token: token.to_string(),
            client_id: "raw-test".into(),
            ..Default::default()
        }))
        .await
        .expect("send Hello");
        self.recv().await
    }

    /// Completes the handshake without a token; fails the test unless it is accepted.
    pub async fn handshake(&mut self) -> HelloAck {
        match self.hello("").await {
            Some(Kind::HelloAck(ack)) => ack,
            other => panic!("expected HelloAck, got {other:?}"),
        }
    }

    /// The next frame must be a `GoAway`.
    pub async fn expect_go_away(&mut self) -> GoAway {
        match self.recv().await {
            Some(Kind::GoAway(g)) => g,
            other => panic!("expected GoAway, got {other:?}"),
        }
    }

    /// Drops the connection as a crashed peer does: with a reset (RST), not a close.
    pub fn reset(self) {
        self.stream.set_zero_linger().expect("SO_LINGER 0");
        drop(self.stream);
    }

    /// The end of a drain: the server's last word, a `GoAway` 200 with `last` set (every call
    /// it read is answered, it reads no more), then its close.
    pub async fn expect_drained(&mut self) {
        let g = self.expect_go_away().await;
        assert_eq!(
            (g.status_code, g.last),
            (200, true),
            "the drain's last word: {g:?}"
        );
        self.expect_closed().await;
    }

    /// The connection must be closed by the server (no further frame).
    pub async fn expect_closed(&mut self) {
        if let Some(k) = self.recv().await {
            panic!("expected the server to close the connection, got {k:?}");
        }
    }
}

/// A `tracing` writer that sends every logged line down a channel, so a test can wait for the
/// line it expects instead of sleeping.
#[derive(Clone)]
pub struct LogLines(std::sync::Arc<std::sync::Mutex<mpsc::UnboundedSender<String>>>);

impl LogLines {
    /// Lines written go to `tx`, one message per write.
    pub fn new(tx: mpsc::UnboundedSender<String>) -> Self {
        LogLines(std::sync::Arc::new(std::sync::Mutex::new(tx)))
    }
}

impl std::io::Write for LogLines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(String::from_utf8_lossy(buf).into_owned());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogLines {
    type Writer = LogLines;
    fn make_writer(&'a self) -> LogLines {
        self.clone()
    }
}

/// The server's side of a handshake on an accepted raw socket: reads `Hello` (panicking on
/// anything else) and answers `HelloAck` naming `server_id` and `max_frame_length`.
pub async fn accept_hello(stream: TcpStream, server_id: &str, max_frame_length: u32) -> RawConn {
    let mut raw = RawConn::from_stream(stream);
    match raw.recv().await {
        Some(Kind::Hello(_)) => {}
        other => panic!("expected Hello, got {other:?}"),
    }
    raw.send(Kind::HelloAck(HelloAck {
        protocol_version: 1,
        server_id: server_id.into(),
        max_frame_length,
        ..Default::default()
    }))
    .await
    .expect("send HelloAck");
    raw
}

/// The lines logged on this thread up to `level` (plain text, one per event), until the
/// guard is dropped.
pub fn log_lines(
    level: tracing::Level,
) -> (
    mpsc::UnboundedReceiver<String>,
    tracing::subscriber::DefaultGuard,
) {
    let (tx, lines) = mpsc::unbounded_channel();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(LogLines::new(tx))
        .with_ansi(false)
        .finish();
    (lines, trace_this_thread(subscriber))
}

/// Sends every call record of an observer to the test: entry, status, outcome.
struct CallRecords(
    std::sync::Mutex<mpsc::UnboundedSender<(String, Option<rpc::StatusCode>, String)>>,
);

impl rpc::crates::governance::calls::CallObserver for CallRecords {
    fn call_ended(&self, call: &rpc::crates::governance::calls::CallRecord) {
        let _ = self.0.lock().unwrap().send((
            call.entry.to_string(),
            call.status,
            call.outcome.to_string(),
        ));
    }
}

/// The calls `client` makes from now on, as each ends: entry, status, outcome.
pub fn observe_calls(
    client: &rpc::Client,
) -> mpsc::UnboundedReceiver<(String, Option<rpc::StatusCode>, String)> {
    let (tx, rx) = mpsc::unbounded_channel();
    client.observe_calls(std::sync::Arc::new(CallRecords(std::sync::Mutex::new(tx))));
    rx
}

/// The calls the server of `status` handles from now on, as each ends: entry, status, outcome.
pub fn observe_server_calls(
    status: &rpc::ServerStatus,
) -> mpsc::UnboundedReceiver<(String, Option<rpc::StatusCode>, String)> {
    let (tx, rx) = mpsc::unbounded_channel();
    status.observe_calls(std::sync::Arc::new(CallRecords(std::sync::Mutex::new(tx))));
    rx
}

/// `inner`, written by hand around it: its method named `failing` acts (counted in `runs`) and
/// then passes on a downstream call's 507 as it came, whether that method is unary or a
/// stream's set-up.
pub struct PassesOnA507<S> {
    pub inner: S,
    pub failing: &'static str,
    pub runs: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<S: rpc::Service> PassesOnA507<S> {
    /// Two servers on `reg` (behind a layer that passes every call on when `layered`), each
    /// serving `inner()` with its method `failing` passing on a 507; the count of that
    /// method's runs on both.
    pub async fn serve_two(
        reg: &rpc::InProcessRegistry,
        (failing, layered): (&'static str, bool),
        inner: impl Fn() -> S,
    ) -> (
        Vec<rpc::ServerHandle>,
        std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) {
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut servers = Vec::new();
        for _ in 0..2 {
            let service = PassesOnA507 {
                inner: inner(),
                failing,
                runs: runs.clone(),
            };
            let mut builder = rpc::Server::builder().registry(reg.clone());
            if layered {
                builder = builder.layer(rpc::server_layer_fn(|req, next| Box::pin(next.run(req))));
            }
            servers.push(
                builder
                    .add_service(service)
                    .serve("127.0.0.1:0")
                    .await
                    .expect("serve"),
            );
        }
        (servers, runs)
    }
}

impl<S> PassesOnA507<S> {
    fn fails(&self, method: &rpc::MethodDescriptor) -> Option<impl Future<Output = rpc::RpcError>> {
        let runs = self.runs.clone();
        (method.method == self.failing).then_some(async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            rpc::RpcError::new(
                rpc::StatusCode::NotFindLocalServiceEntry,
                "t.Downstream.gone: no such entry",
            )
        })
    }
}

impl<S: rpc::Service> rpc::Service for PassesOnA507<S> {
    fn service_id(&self) -> &'static str {
        self.inner.service_id()
    }

    fn methods(&self) -> &'static [rpc::MethodDescriptor] {
        self.inner.methods()
    }

    fn call(&self, method: usize, params: rpc::Bytes, codec: rpc::Codec) -> rpc::ServiceFuture {
        match self.fails(&self.methods()[method]) {
            Some(failed) => Box::pin(async move { Err(failed.await) }),
            None => self.inner.call(method, params, codec),
        }
    }

    fn stream_mode(&self, method: usize) -> rpc::crates::core::StreamMode {
        self.inner.stream_mode(method)
    }

    fn call_stream(
        &self,
        method: usize,
        params: rpc::Bytes,
        inbound: Option<rpc::crates::core::ByteStream>,
        codec: rpc::Codec,
    ) -> rpc::crates::core::StreamFuture {
        match self.fails(&self.methods()[method]) {
            Some(failed) => Box::pin(async move { Err(failed.await) }),
            None => self.inner.call_stream(method, params, inbound, codec),
        }
    }
}
