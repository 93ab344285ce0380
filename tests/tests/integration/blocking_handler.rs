//! A handler that blocks in synchronous code before its first `.await` stalls only itself: the
//! connection's reader goes on, so another call, a `Ping` and a `Cancel` on the same connection
//! are served meanwhile. (Polling handlers first on the reader is an opt-in for services whose
//! handlers never block: `ServerBuilder::inline_first_poll`.)
//!
//! The blocked handler waits on a std channel that the test releases only after the other call
//! was answered: with the handler on the reader, that answer could never come, and the test
//! fails at its bound instead of hanging.

use crate::common;

use std::collections::BTreeMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

use common::{recv_one, within, RawConn};
use rpc::crates::core::wire::{frame::Kind, Cancel, Ping, RemoteInvokeMessage};
use rpc::{Codec, RpcError, Server};
use tokio::sync::mpsc;

#[rpc::service(name = "t.Blocking")]
trait Blocking {
    /// Blocks its thread until released (or the release side is dropped).
    async fn block(&self) -> Result<String, RpcError>;
    async fn quick(&self, text: String) -> Result<String, RpcError>;
    /// Waits (asynchronously) for ever; reports when its future is dropped.
    async fn forever(&self) -> Result<String, RpcError>;
}

struct Service {
    entered: mpsc::UnboundedSender<&'static str>,
    release: Mutex<std_mpsc::Receiver<()>>,
}

/// Reports `dropped` when the future holding it is dropped.
struct OnDrop(mpsc::UnboundedSender<&'static str>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send("dropped");
    }
}

impl Blocking for Service {
    async fn block(&self) -> Result<String, RpcError> {
        let _ = self.entered.send("block");
        // Synchronous, before any `.await`: this thread is held until the test says so. The
        // bound only keeps a broken run from holding it for ever; the test's own bound is
        // shorter.
        let released = self
            .release
            .lock()
            .expect("lock")
            .recv_timeout(common::LIMIT * 2);
        Ok(format!("released: {}", released.is_ok()))
    }
    async fn quick(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
    async fn forever(&self) -> Result<String, RpcError> {
        let _signal = OnDrop(self.entered.clone());
        let _ = self.entered.send("forever");
        std::future::pending().await
    }
}

fn invoke(id: u64, method: &str, params: Vec<u8>) -> Kind {
    Kind::Invoke(RemoteInvokeMessage {
        message_id: id,
        service_entry_id: format!("t.Blocking.{method}"),
        codec: Codec::MsgPack.to_wire(),
        parameters: params.into(),
        attachments: BTreeMap::new(),
        ..Default::default()
    })
}

fn no_args() -> Vec<u8> {
    Codec::MsgPack.encode(&()).expect("encode").to_vec()
}

// Several worker threads: the blocked handler holds one of them, as it would in a server.
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_handler_blocked_in_sync_code_does_not_stall_other_calls_on_its_connection() {
    let (server, mut raw, mut entered, release) = connected(false).await;

    raw.send(invoke(1, "block", no_args())).await.expect("send");
    assert_eq!(recv_one("the handler starts", &mut entered).await, "block");

    // The same connection, while that handler holds its thread.
    let quick = Codec::MsgPack.encode(&("other",)).expect("encode").to_vec();
    raw.send(invoke(2, "quick", quick)).await.expect("send");
    match within("the other call's answer", raw.recv()).await {
        Some(Kind::Result(r)) => {
            assert_eq!((r.message_id, r.status_code), (2, 200), "{r:?}");
            let text: String = Codec::MsgPack.decode(&r.result).expect("decode");
            assert_eq!(text, "other");
        }
        other => panic!("expected the answer to call 2, got {other:?}"),
    }
    raw.send(Kind::Ping(Ping { nonce: 7 })).await.expect("send");
    match within("the Pong", raw.recv()).await {
        Some(Kind::Pong(p)) => assert_eq!(p.nonce, 7),
        other => panic!("expected Pong, got {other:?}"),
    }
    // A Cancel is acted on too: the cancelled handler's future is dropped.
    cancel_forever(&mut raw, &mut entered, 3).await;

    // Only now is the blocked handler released; its own call then completes.
    release.send(()).expect("release");
    match within("the blocked call's answer", raw.recv()).await {
        Some(Kind::Result(r)) => {
            assert_eq!((r.message_id, r.status_code), (1, 200), "{r:?}");
            let text: String = Codec::MsgPack.decode(&r.result).expect("decode");
            assert_eq!(text, "released: true");
        }
        other => panic!("expected the answer to call 1, got {other:?}"),
    }
    within("shutdown", server.shutdown()).await;
}

/// The opt-in keeps the first poll on the reader: calls are answered as before.
/// The blocking service (its first poll inline when `inline_first_poll`), a raw connection to
/// it past its handshake, what its handlers report, and the sender that releases `block`.
async fn connected(
    inline_first_poll: bool,
) -> (
    rpc::ServerHandle,
    RawConn,
    mpsc::UnboundedReceiver<&'static str>,
    std_mpsc::Sender<()>,
) {
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let (release, release_rx) = std_mpsc::channel();
    let server = Server::builder()
        .inline_first_poll(inline_first_poll)
        .add_service(BlockingServer::from_arc(Arc::new(Service {
            entered: entered_tx,
            release: Mutex::new(release_rx),
        })))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    (server, raw, entered, release)
}

/// Calls `forever` as call `id` on `raw`, waits until its handler started (`entered`), cancels
/// it, and waits until the server dropped the handler's future.
async fn cancel_forever(
    raw: &mut RawConn,
    entered: &mut mpsc::UnboundedReceiver<&'static str>,
    id: u64,
) {
    raw.send(invoke(id, "forever", no_args()))
        .await
        .expect("send");
    assert_eq!(recv_one("the handler starts", entered).await, "forever");
    raw.send(Kind::Cancel(Cancel {
        message_id: id,
        ..Default::default()
    }))
    .await
    .expect("send");
    assert_eq!(
        recv_one("the cancelled handler is dropped", entered).await,
        "dropped"
    );
}

#[tokio::test]
async fn with_inline_first_poll_calls_are_answered_as_before() {
    let (server, mut raw, mut entered, _release) = connected(true).await;
    for id in 1..=3u64 {
        let text = format!("call {id}");
        let params = Codec::MsgPack.encode(&(text.as_str(),)).expect("encode");
        raw.send(invoke(id, "quick", params.to_vec()))
            .await
            .expect("send");
        match within("an answer", raw.recv()).await {
            Some(Kind::Result(r)) => {
                assert_eq!((r.message_id, r.status_code), (id, 200), "{r:?}");
                let answer: String = Codec::MsgPack.decode(&r.result).expect("decode");
                assert_eq!(answer, text);
            }
            other => panic!("expected an answer, got {other:?}"),
        }
    }
    // A handler that waits is still spawned, and Cancel still drops it.
    cancel_forever(&mut raw, &mut entered, 9).await;
    within("shutdown", server.shutdown()).await;
}

#[rpc::service(name = "t.Segments")]
trait Segments {
    /// Whether the part after its first `.await` ran in another task than the part before.
    async fn moved(&self) -> Result<bool, RpcError>;
}

struct Segmented;

impl Segments for Segmented {
    async fn moved(&self) -> Result<bool, RpcError> {
        let before = tokio::task::try_id();
        tokio::task::yield_now().await;
        Ok(tokio::task::try_id() != before)
    }
}

/// With `inline_first_poll`, a handler is polled once on the connection's reader, and what
/// follows its first wait runs in the call's own task. Before, the transport polled it on the
/// reader a second time (the server had already made the first poll), so a handler that
/// yielded ran its next part on the reader too, stalling the connection's other calls.
#[tokio::test]
async fn an_inline_first_poll_is_the_only_poll_on_the_reader() {
    let server = Server::builder()
        .inline_first_poll(true)
        .add_service(SegmentsServer::new(Segmented))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = SegmentsClient::new(
        rpc::Client::builder()
            .registry(rpc::StaticRegistry::new([server.local_addr().to_string()]))
            .build(),
    );
    for _ in 0..3 {
        assert!(
            within("a call", client.moved()).await.expect("answered"),
            "the part after the handler's first wait ran on the reader"
        );
    }
}

#[rpc::service(name = "t.Late")]
trait Late {
    /// Works past any short deadline, then fails (as a downstream call it bounded would).
    async fn late(&self) -> Result<(), RpcError>;
    /// Works past any short deadline, then panics.
    async fn late_panic(&self) -> Result<(), RpcError>;
}

/// Holds its thread until the caller's deadline has passed, as the handler sees it (bounded,
/// should the deadline never reach it).
fn overrun() {
    let bound = std::time::Instant::now() + common::LIMIT;
    while !rpc::crates::governance::timeout::inherited_passed() && std::time::Instant::now() < bound
    {
        std::thread::yield_now();
    }
}

struct Overrun;

impl Late for Overrun {
    async fn late(&self) -> Result<(), RpcError> {
        overrun();
        Err(RpcError::new(
            rpc::StatusCode::FrameworkError,
            "downstream failed",
        ))
    }

    async fn late_panic(&self) -> Result<(), RpcError> {
        overrun();
        panic!("the handler broke at the deadline");
    }
}

/// A handler failing past the caller's deadline is answered as the timeout (519), naming its
/// error, whether it answered in the inline first poll or in a task of its own. Before, the
/// inline poll's answer was the handler's own error (500), while the same call in a task was
/// 519: the caller's breaker counted the two differently.
#[tokio::test]
async fn a_failure_past_the_deadline_is_the_timeout_however_the_handler_was_polled() {
    for inline in [false, true] {
        let server = Server::builder()
            .inline_first_poll(inline)
            .add_service(LateServer::new(Overrun))
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        let mut events = server.events().subscribe();
        let answer = called_with_1_ms_left(&server, "t.Late.late").await;
        assert_eq!(answer.status_code, 519, "inline {inline}: {answer:?}");
        assert!(
            answer.exception_message.contains("downstream failed"),
            "inline {inline}: {answer:?}"
        );
        // The server reports it as a client reports its own timeouts: event `timeout`.
        let event = within("the timeout event", async {
            loop {
                let e = events.recv().await.expect("events");
                if e.kind == rpc::EventKind::Timeout {
                    break e;
                }
            }
        })
        .await;
        assert_eq!(&*event.entry, "t.Late.late", "{event:?}");
        assert!(
            event
                .cause
                .as_deref()
                .unwrap_or("")
                .contains("downstream failed"),
            "{event:?}"
        );
    }
}

/// A handler panicking past the caller's deadline is answered as the timeout (519) naming the
/// panic, as any other failure past it is, on a server with layers or without, inline or in a
/// task. Before, a panic was 520 there but 519 on a stream, or through a server fallback.
#[tokio::test]
async fn a_panic_past_the_deadline_is_the_timeout_on_every_path() {
    for (inline, layered) in [(false, false), (true, false), (false, true)] {
        let mut builder = Server::builder()
            .inline_first_poll(inline)
            .add_service(LateServer::new(Overrun));
        if layered {
            builder = builder.layer(rpc::server_layer_fn(|req, next| {
                Box::pin(async move { next.run(req).await })
            }));
        }
        let server = builder.serve("127.0.0.1:0").await.expect("serve");
        let answer = called_with_1_ms_left(&server, "t.Late.late_panic").await;
        let path = format!("inline {inline}, layered {layered}");
        assert_eq!(answer.status_code, 519, "{path}: {answer:?}");
        assert!(
            answer.exception_message.contains("panicked"),
            "{path}: {answer:?}"
        );
        within("shutdown", server.shutdown()).await;
    }
}

/// The answer to a raw call of `entry` (no arguments) on `server`, made with a budget of 1 ms.
async fn called_with_1_ms_left(
    server: &rpc::ServerHandle,
    entry: &str,
) -> rpc::crates::core::wire::RemoteResultMessage {
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        message_id: 1,
        service_entry_id: entry.into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: no_args().into(),
        timeout_ms: 1,
        ..Default::default()
    }))
    .await
    .expect("send");
    raw.recv_end().await
}
