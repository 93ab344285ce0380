//! Stream flow control and batching on the wire, seen by a peer speaking frames by hand over
//! real TCP: a client that knows neither batches nor byte windows is sent one item per frame
//! within its item window; a client that takes batches gets several items per frame, yet never
//! more than its item credit nor past its byte window; a stream whose client grants no more
//! credit still ends at its deadline; a connection whose in-flight limit its streams fill
//! still reads their credit; and a server that knows neither is sent the client's items one
//! per frame.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{raw_listener, stream_opening, streaming_ack, within, RawConn};
use rpc::crates::core::wire::{
    frame::Kind, Hello, HelloAck, Ping, RemoteInvokeMessage, RemoteResultMessage, StreamMode,
};
use rpc::crates::transport::{
    Call, ClientStream, ConnectOptions, Connection, Opened, DEFAULT_CLIENT_STREAM_WINDOW,
    DEFAULT_STREAM_WINDOW_BYTES,
};
use rpc::{Codec, RpcError, RpcStream, Server, ServerHandle};

#[rpc::service(name = "t.Flow")]
pub trait Flow {
    /// Strings of `size` bytes without end; counts how often its producer is asked.
    async fn text(&self, size: u32) -> Result<RpcStream<String>, RpcError>;
    /// One item, then none and no end: a producer that keeps the credit it was given.
    async fn one_then_wait(&self) -> Result<RpcStream<String>, RpcError>;
    /// A unary method beside the streams.
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    /// A unary call that never answers (a long poll).
    async fn hold(&self) -> Result<(), RpcError>;
    /// Counts the client's items up to the end of its stream or its first error, which it
    /// ignores (a handler written `while let Some(Ok(_))`).
    async fn count(&self, items: RpcStream<u32>) -> Result<u32, RpcError>;
}

struct Texts(Arc<AtomicU64>);

impl Flow for Texts {
    async fn text(&self, size: u32) -> Result<RpcStream<String>, RpcError> {
        let polls = self.0.clone();
        let item = "x".repeat(size as usize);
        Ok(RpcStream::iter(std::iter::repeat_with(move || {
            polls.fetch_add(1, Ordering::SeqCst);
            item.clone()
        })))
    }

    async fn one_then_wait(&self) -> Result<RpcStream<String>, RpcError> {
        Ok(RpcStream::new(futures_util::StreamExt::chain(
            futures_util::stream::once(async { "x".to_string() }),
            futures_util::stream::pending(),
        )))
    }

    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }

    async fn hold(&self) -> Result<(), RpcError> {
        std::future::pending().await
    }

    async fn count(&self, mut items: RpcStream<u32>) -> Result<u32, RpcError> {
        let mut n = 0;
        while let Some(Ok(_)) = futures_util::StreamExt::next(&mut items).await {
            n += 1;
        }
        Ok(n)
    }
}

async fn serve() -> (ServerHandle, Arc<AtomicU64>) {
    let polls = Arc::new(AtomicU64::new(0));
    let server = Server::builder()
        .add_service(FlowServer::new(Texts(polls.clone())))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (server, polls)
}

/// Connects by hand with `hello`'s stream settings; returns the connection and the ack.
async fn raw_client(server: &ServerHandle, hello: Hello) -> (RawConn, HelloAck) {
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.send(Kind::Hello(Hello {
        protocol_version: 1,
        client_id: "raw-flow".into(),
        streams: true,
        ..hello
    }))
    .await
    .expect("hello");
    match raw.recv().await {
        Some(Kind::HelloAck(ack)) => (raw, ack),
        other => panic!("expected HelloAck, got {other:?}"),
    }
}

/// [`raw_client`] with a window of `items` items (and neither batches nor byte windows).
async fn raw_client_with_window(server: &ServerHandle, items: u32) -> (RawConn, HelloAck) {
    let hello = Hello {
        stream_window: items,
        ..Default::default()
    };
    raw_client(server, hello).await
}

/// Opens `text(size)` as stream `id` and reads its accepting credit.
async fn open_text(raw: &mut RawConn, id: u64, size: u32) {
    raw.open_stream(id, "t.Flow.text", &(size,), StreamMode::Server)
        .await;
    match raw.recv().await {
        Some(Kind::StreamCredit(c)) => assert_eq!((c.message_id, c.items), (id, 0)),
        other => panic!("expected the stream's acceptance, got {other:?}"),
    }
}

/// What arrived of stream `id` until the answer to an echo call sent now (a round trip through
/// the server's reader, dispatcher and writer): its items and the frames that carried them.
/// The echo goes out after the frames the server had already queued; a producer held by its
/// credit queues nothing more however long one waits, so the count is what it sent.
async fn items_until_echo(raw: &mut RawConn, id: u64, echo_id: u64) -> (Vec<String>, usize) {
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        message_id: echo_id,
        service_entry_id: "t.Flow.echo".into(),
        parameters: Codec::MsgPack.encode(&("ping",)).expect("encode"),
        ..Default::default()
    }))
    .await
    .expect("echo");
    let (mut items, mut frames) = (Vec::new(), 0);
    for _ in 0..10_000 {
        match raw.recv().await {
            Some(Kind::StreamItem(i)) => {
                assert_eq!(i.message_id, id);
                frames += 1;
                items.push(Codec::MsgPack.decode(&i.payload).expect("an item"));
            }
            Some(Kind::StreamItems(i)) => {
                assert_eq!(i.message_id, id);
                frames += 1;
                for p in &i.payloads {
                    items.push(Codec::MsgPack.decode(p).expect("an item"));
                }
            }
            Some(Kind::Result(r)) if r.message_id == echo_id => {
                assert_eq!(r.status_code, 200, "{r:?}");
                return (items, frames);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    panic!("no answer to the echo among 10000 frames")
}

/// A client that does not know batches nor byte windows (its Hello leaves both unset): one item
/// per `StreamItem` frame, never a `StreamItems`, and its window of items only.
#[tokio::test]
async fn a_client_without_batches_gets_one_item_per_frame_within_its_item_window() {
    let (server, polls) = serve().await;
    let (mut raw, ack) = raw_client_with_window(&server, 4).await;
    assert!(ack.streams);
    assert!(!ack.stream_batches, "batches are not offered to it");
    // Items of 4 KiB: a byte window would stop the producer long before 4 items.
    open_text(&mut raw, 1, 4096).await;
    let (items, frames) = items_until_echo(&mut raw, 1, 2).await;
    assert_eq!(items.len(), 4, "its window of 4 items");
    assert_eq!(frames, 4, "one frame per item");
    assert!(items.iter().all(|i| i.len() == 4096));
    raw.grant(1, 3).await;
    let (items, frames) = items_until_echo(&mut raw, 1, 3).await;
    assert_eq!(
        (items.len(), frames),
        (3, 3),
        "the 3 granted, one per frame"
    );
    assert_eq!(
        polls.load(Ordering::SeqCst),
        7,
        "the producer was asked for 7"
    );
    // The raw client goes: its open stream ends with its connection.
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A client whose request stream fails (its `StreamEnd` says 1000) gets the stream ended with
/// that status, though the handler ignores the failure and answers as if the stream were
/// complete; a stream that ends complete gets the handler's answer.
#[tokio::test]
async fn a_client_stream_that_fails_ends_with_its_status_whatever_the_handler_answers() {
    let (server, _) = serve().await;
    let (mut raw, _) = raw_client_with_window(&server, 8).await;
    for (id, status) in [(1u64, 200u32), (2, 1000)] {
        raw.open_client_stream(id, "t.Flow.count").await;
        for n in 0..2u32 {
            raw.send_item(id, Codec::MsgPack.encode(&n).expect("encode"), 0)
                .await;
        }
        raw.end_stream(id, status, "the caller gave up").await;
        let end = raw.recv_end().await;
        assert_eq!((end.message_id, end.status_code), (id, status), "{end:?}");
        if status == 200 {
            assert_eq!(Codec::MsgPack.decode::<u32>(&end.result).expect("count"), 2);
        } else {
            assert!(
                end.exception_message.contains("the caller gave up"),
                "{end:?}"
            );
        }
    }
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

#[rpc::service(name = "t.Gate")]
pub trait Gate {
    /// Reads the caller's items to their end, says so, then never answers.
    async fn read_then_hold(&self, items: RpcStream<u32>) -> Result<u32, RpcError>;
    /// Sums the caller's items to their end, says so, then answers the sum once released.
    async fn sum_when_released(&self, items: RpcStream<u32>) -> Result<u32, RpcError>;
}

/// Told when a handler has read its request stream's end (`.0`); releases it (`.1`).
#[derive(Clone, Default)]
struct Gated(Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>);

impl Gate for Gated {
    async fn read_then_hold(&self, mut items: RpcStream<u32>) -> Result<u32, RpcError> {
        while futures_util::StreamExt::next(&mut items).await.is_some() {}
        self.0.notify_one();
        std::future::pending().await
    }

    async fn sum_when_released(&self, mut items: RpcStream<u32>) -> Result<u32, RpcError> {
        let mut sum = 0;
        while let Some(n) = futures_util::StreamExt::next(&mut items).await {
            sum += n?;
        }
        self.0.notify_one();
        self.1.notified().await;
        Ok(sum)
    }
}

/// A client stream whose request stream ended (its items and end sent) is answered after the
/// client closes its sending side, as a unary call is: it owes the client nothing but its
/// answer. Before, the half-close ended it at once, 520 "it may have partly run", though it
/// had all its input.
#[tokio::test]
async fn a_client_stream_whose_request_ended_is_answered_after_the_clients_half_close() {
    let gated = Gated::default();
    let server = Server::builder()
        .add_service(GateServer::new(gated.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let (mut raw, _) = raw_client_with_window(&server, 8).await;
    raw.open_client_stream(1, "t.Gate.sum_when_released").await;
    for n in [1u32, 2, 3] {
        raw.send_item(1, Codec::MsgPack.encode(&n).expect("encode"), 0)
            .await;
    }
    raw.end_stream(1, 200, "").await;
    within("the handler reads the end", gated.0.notified()).await;
    raw.half_close().await;
    // The server read the half-close: it pings a client whose calls run.
    match raw.recv().await {
        Some(Kind::Ping(_)) => {}
        other => panic!("expected the half-close's ping, got {other:?}"),
    }
    gated.1.notify_one();
    let end = raw.recv_end().await;
    assert_eq!((end.message_id, end.status_code), (1, 200), "{end:?}");
    let sum: u32 = Codec::MsgPack.decode(&end.result).expect("a sum");
    assert_eq!(sum, 6);
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// Nothing of a client's request stream may follow its end: an item sent after it ends the
/// stream with 500, even once the handler has read the end (and is still working on its
/// answer).
#[tokio::test]
async fn an_item_after_the_request_streams_end_ends_the_stream_with_500() {
    let read_end = Arc::new(tokio::sync::Notify::new());
    let server = Server::builder()
        .add_service(GateServer::new(Gated(read_end.clone(), Default::default())))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let (mut raw, _) = raw_client_with_window(&server, 8).await;
    raw.open_client_stream(1, "t.Gate.read_then_hold").await;
    let item = |n: u32| Codec::MsgPack.encode(&n).expect("encode");
    raw.send_item(1, item(1), 0).await;
    raw.end_stream(1, 200, "").await;
    within("the handler reads the end", read_end.notified()).await;
    raw.send_item(1, item(2), 0).await;
    let end = raw.recv_end().await;
    assert_eq!((end.message_id, end.status_code), (1, 500), "{end:?}");
    assert!(
        end.exception_message.contains(
            "protocol violation: the client sent stream items after its request stream's end"
        ),
        "{end:?}"
    );
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A client that takes batches gets runs of items in `StreamItems` frames, yet no more than
/// its item credit, however many items the producer has ready.
#[tokio::test]
async fn a_batch_never_carries_more_than_the_item_credit() {
    let (server, polls) = serve().await;
    let (mut raw, ack) = raw_client(
        &server,
        Hello {
            stream_window: 5,
            stream_batches: true,
            ..Default::default()
        },
    )
    .await;
    assert!(ack.stream_batches);
    open_text(&mut raw, 1, 8).await;
    let (items, frames) = items_until_echo(&mut raw, 1, 2).await;
    assert_eq!(items.len(), 5, "the window of 5 items");
    assert!(
        frames < 5,
        "the items came batched: {frames} frames for 5 items"
    );
    assert_eq!(polls.load(Ordering::SeqCst), 5);
    raw.grant(1, 2).await;
    let (items, _) = items_until_echo(&mut raw, 1, 3).await;
    assert_eq!(items.len(), 2, "the 2 granted");
    assert_eq!(polls.load(Ordering::SeqCst), 7);
    // The raw client goes: its open stream ends with its connection.
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A client announcing a byte window is sent items while the bytes in flight are below it (the
/// last may go past it), and each grant of items frees the bytes of the oldest ones.
#[tokio::test]
async fn the_byte_window_holds_the_producer_and_grants_free_the_oldest_items() {
    let (server, polls) = serve().await;
    let (mut raw, ack) = raw_client(
        &server,
        Hello {
            stream_window: 100,
            stream_window_bytes: 100,
            stream_batches: true,
            ..Default::default()
        },
    )
    .await;
    assert!(ack.stream_window_bytes > 0, "the server keeps byte windows");
    // Each item: 40 characters, 42 bytes as MessagePack (a str8 header of 2 bytes).
    let item = Codec::MsgPack
        .encode(&"x".repeat(40))
        .expect("encode")
        .len();
    assert_eq!(item, 42);
    open_text(&mut raw, 1, 40).await;
    // 0, 42, 84 bytes in flight are below 100: three items go, the third to 126.
    let (items, _) = items_until_echo(&mut raw, 1, 2).await;
    assert_eq!(items.len(), 3, "42 + 42 < 100, the third goes past it");
    // One granted frees the oldest: 84 in flight, one more goes (to 126).
    raw.grant(1, 1).await;
    let (items, _) = items_until_echo(&mut raw, 1, 3).await;
    assert_eq!(items.len(), 1);
    // Three granted free the three in flight: three go again.
    raw.grant(1, 3).await;
    let (items, _) = items_until_echo(&mut raw, 1, 4).await;
    assert_eq!(items.len(), 3);
    assert_eq!(polls.load(Ordering::SeqCst), 7);
    // The raw client goes: its open stream ends with its connection.
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A server that knows neither batches nor byte windows (its HelloAck leaves them unset): the
/// client's own items go one per `StreamItem` frame, within the server's window of items.
#[tokio::test]
async fn a_server_without_batches_gets_the_clients_items_one_per_frame() {
    let (listener, addr) = raw_listener().await;
    let old_server = tokio::spawn(async move {
        let ack = streaming_ack(3);
        let (mut peer, h) = RawConn::accept_with(&listener, ack).await;
        assert!(h.streams && h.stream_batches, "the client offers both");
        assert_eq!(h.stream_window, DEFAULT_CLIENT_STREAM_WINDOW);
        assert_eq!(h.stream_window_bytes, DEFAULT_STREAM_WINDOW_BYTES);
        let open = peer.recv_invoke("the stream's opening").await;
        assert_eq!(open.stream_mode, StreamMode::Client as i32);
        let id = open.message_id;
        peer.grant(id, 3).await;
        let mut got = Vec::new();
        for _ in 0..3 {
            match peer.recv().await {
                Some(Kind::StreamItem(i)) => {
                    assert_eq!(i.message_id, id);
                    got.push(Codec::MsgPack.decode::<u32>(&i.payload).expect("item"));
                }
                other => panic!("expected one StreamItem, got {other:?}"),
            }
        }
        peer.send(Kind::Result(RemoteResultMessage {
            message_id: id,
            status_code: 200,
            result: Codec::MsgPack
                .encode(&got.iter().sum::<u32>())
                .expect("encode"),
            ..Default::default()
        }))
        .await
        .expect("answer");
        got
    });
    let (_conn, mut s) = open_sum(addr, &ConnectOptions::default()).await;
    for n in [5u32, 6, 7] {
        assert!(within("credit", s.ready()).await, "credit for item {n}");
        s.send(Codec::MsgPack.encode(&n).expect("encode"))
            .expect("send");
    }
    // The server's window of 3 is spent: a fourth waits for credit.
    assert!(s
        .send(Codec::MsgPack.encode(&8u32).expect("encode"))
        .is_err());
    let answer = within("answer", futures_util::StreamExt::next(&mut s))
        .await
        .expect("the answer")
        .expect("ok");
    assert_eq!(Codec::MsgPack.decode::<u32>(&answer).expect("sum"), 18);
    assert_eq!(
        within("old server", old_server).await.expect("old server"),
        [5, 6, 7]
    );
}

/// A server that grants vast credit (`u32::MAX` items) and reads nothing: the client's request
/// stream is let produce only while its connection's send queue has room
/// (`ConnectOptions::max_unsent_bytes`), so such a server cannot make it queue without bound.
#[tokio::test(start_paused = true)]
async fn a_request_stream_waits_for_room_in_the_send_queue_whatever_credit_it_has() {
    let (listener, addr) = raw_listener().await;
    let greedy_server = tokio::spawn(async move {
        let ack = streaming_ack(u32::MAX);
        let (mut peer, _) = RawConn::accept_with(&listener, ack).await;
        let open = peer.recv_invoke("the stream's opening").await;
        // Accepts the stream with vast credit, then reads nothing more.
        peer.grant(open.message_id, u32::MAX).await;
        std::future::pending::<()>().await;
    });
    let options = ConnectOptions {
        max_unsent_bytes: 64 * 1024,
        ..ConnectOptions::default()
    };
    let (conn, s) = open_sum(addr, &options).await;
    // 40 MiB at most: far beyond what the sockets' buffers take before the queue grows.
    let item = rpc::Bytes::from(vec![7u8; 1024]);
    for sent in 0..40 * 1024 {
        // Once the queue is full and stays so, ready() waits: the test is over. (On the paused
        // clock the timeout fires only once nothing else can move: the socket is full and the
        // server reads nothing.)
        let Ok(ready) = tokio::time::timeout(Duration::from_secs(1), s.ready()).await else {
            assert!(sent > 0, "the first item had room");
            break;
        };
        assert!(ready, "the stream is open");
        let unsent = conn.unsent_bytes();
        assert!(
            unsent <= options.max_unsent_bytes,
            "item {sent}: ready with {unsent} bytes unsent, over the limit of {}",
            options.max_unsent_bytes
        );
        s.send(item.clone()).expect("credit");
    }
    // A sender waiting for room hears of the stream's end (here: the caller drops it).
    let sender = s.sender();
    let waiting = tokio::spawn(async move { sender.ready().await });
    tokio::task::yield_now().await;
    drop(s);
    let ready = within("ready() once the stream ended", waiting)
        .await
        .expect("the task");
    assert!(!ready, "the stream ended");
    greedy_server.abort();
}

/// A new connection to `addr` and the client stream of `t.Flow.sum` opened on it.
async fn open_sum(
    addr: std::net::SocketAddr,
    options: &ConnectOptions,
) -> (Connection, ClientStream) {
    let call = Call {
        service_entry_id: "t.Flow.sum".into(),
        ..Default::default()
    };
    open_accepted(&addr.to_string(), options, call, StreamMode::Client).await
}

/// A new connection to `addr` with `options`, and `call` opened on it as a stream of `mode`,
/// which the server must accept.
async fn open_accepted(
    addr: &str,
    options: &ConnectOptions,
    call: Call,
    mode: StreamMode,
) -> (Connection, ClientStream) {
    let conn = Connection::connect(addr, options).await.expect("connect");
    match within("open", conn.open_stream(call, mode, None))
        .await
        .expect("open")
    {
        Opened::Accepted(s) => (conn, s),
        Opened::Refused(r) => panic!("refused: {r:?}"),
    }
}

/// The client counts what its consumer takes as its byte window counts it, as the items
/// travelled: compressed items larger on the wire than once decompressed (a peer may compress
/// what does not shrink) are granted back once half the window's bytes went by on the wire.
/// Before, the grant counted their decompressed sizes, never reached the half, and the stream
/// waited on both sides until its deadline (for ever without one).
#[tokio::test]
async fn items_larger_on_the_wire_than_decompressed_are_granted_back_by_their_wire_size() {
    use rpc::crates::core::wire::{Compression, StreamItem};
    use rpc::crates::transport::compression::compress;
    let (listener, addr) = raw_listener().await;
    const WINDOW_BYTES: usize = 200;
    let plain = Codec::MsgPack.encode(&"ab").expect("encode");
    let packed = compress(rpc::Compression::Lz4, &plain);
    assert!(
        packed.len() > plain.len(),
        "{} → {}",
        plain.len(),
        packed.len()
    );
    // Half the byte window on the wire; far from half of it, and of the items, decompressed.
    let n = (WINDOW_BYTES / 2).div_ceil(packed.len());
    assert!(n * plain.len() < WINDOW_BYTES / 2 && n < 500);
    let server = tokio::spawn(async move {
        let mut ack = streaming_ack(8);
        ack.accept_compression = vec![Compression::Lz4 as i32];
        // (A server that keeps byte windows: the client's then counts too.)
        ack.stream_window_bytes = 1 << 20;
        let (mut peer, hello) = RawConn::accept_with(&listener, ack).await;
        assert!(hello
            .accept_compression
            .contains(&(Compression::Lz4 as i32)));
        let id = peer.recv_invoke("the stream's opening").await.message_id;
        peer.grant(id, 0).await;
        for _ in 0..n {
            peer.send(Kind::StreamItem(StreamItem {
                message_id: id,
                payload: packed.clone(),
                compression: Compression::Lz4 as i32,
            }))
            .await
            .expect("item");
        }
        match within("the client's credit", peer.recv()).await {
            Some(Kind::StreamCredit(c)) => assert_eq!(c.message_id, id),
            other => panic!("expected the client's credit, got {other:?}"),
        }
    });
    let options = ConnectOptions {
        stream_window: 1000,
        stream_window_bytes: WINDOW_BYTES as u32,
        ..ConnectOptions::default()
    };
    let (_conn, mut s) = open_text_stream(&addr.to_string(), &options, 2).await;
    for i in 0..n {
        let item = within("an item", futures_util::StreamExt::next(&mut s))
            .await
            .expect("an item")
            .expect("ok");
        assert_eq!(item, plain, "item {i}");
    }
    within("the server", server).await.expect("the server");
}

/// Senders of one stream waiting for credit in two tasks (a `StreamSender` is cloned into
/// them): the server's credit wakes both, not only the last to wait.
#[tokio::test]
async fn credit_wakes_every_task_waiting_to_send_on_the_stream() {
    let (listener, addr) = raw_listener().await;
    let (go, granted) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut peer, _) = RawConn::accept_with(&listener, streaming_ack(16)).await;
        let open = peer.recv_invoke("the stream's opening").await;
        // Accepted with no credit for the client's items, then one item's credit.
        peer.grant(open.message_id, 0).await;
        let _ = granted.await;
        peer.grant(open.message_id, 1).await;
        std::future::pending::<()>().await;
    });
    let (_conn, s) = open_sum(addr, &ConnectOptions::default()).await;
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let sender = s.sender();
            tokio::spawn(async move { sender.ready().await })
        })
        .collect();
    // Both wait before the credit comes (each ran once: there is none yet).
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(waiters.iter().all(|w| !w.is_finished()), "no credit yet");
    go.send(()).expect("the server waits");
    for (i, waiter) in waiters.into_iter().enumerate() {
        let ready = within("a sender hears of the credit", waiter)
            .await
            .expect("the task");
        assert!(ready, "sender {i}: credit, the stream open");
    }
    server.abort();
}

/// The deadline covers the whole stream, the time it waits for credit included: a client that
/// takes one item and grants no more (nor cancels) gets the stream's end, a timeout (519), once
/// the 200 ms it gave have passed, and the server lets the stream go.
#[tokio::test(start_paused = true)]
async fn a_stream_waiting_for_credit_ends_at_its_deadline() {
    let (server, _polls) = serve().await;
    let (mut raw, _ack) = raw_client_with_window(&server, 1).await;
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        timeout_ms: 200,
        ..stream_opening(1, "t.Flow.text", &(8u32,), StreamMode::Server)
    }))
    .await
    .expect("open");
    let (items, end) = items_then_end(&mut raw).await;
    assert_eq!(items, 1, "the client's window of one item");
    assert_eq!((end.message_id, end.status_code), (1, 519), "{end:?}");
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// The items of one stream `raw` receives (credit frames skipped), then its end.
async fn items_then_end(raw: &mut RawConn) -> (usize, RemoteResultMessage) {
    let mut items = 0;
    loop {
        match within("the stream's end", raw.recv()).await {
            Some(Kind::StreamCredit(_)) => continue,
            Some(Kind::StreamItem(_)) => items += 1,
            Some(Kind::StreamItems(run)) => items += run.payloads.len(),
            Some(Kind::Result(end)) => return (items, end),
            other => panic!("expected the stream's items or end, got {other:?}"),
        }
    }
}

/// A connection to `addr` with `options`, and `t.Flow.text(size)` opened on it (accepted).
async fn open_text_stream(
    addr: &str,
    options: &ConnectOptions,
    size: u32,
) -> (Connection, ClientStream) {
    let call = Call {
        service_entry_id: "t.Flow.text".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&(size,)).expect("encode"),
        ..Default::default()
    };
    open_accepted(addr, options, call, StreamMode::Server).await
}

/// A server of `t.Flow` whose idle timeout (and streams' stall limit) is 300 ms.
async fn serve_idle_after_300_ms() -> ServerHandle {
    Server::builder()
        .add_service(FlowServer::new(Texts(Arc::new(AtomicU64::new(0)))))
        .idle_timeout(Duration::from_millis(300))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

/// The idle timeout of a stream waiting for credit counts the stream's own credit as the
/// client's progress, not the connection's other traffic: a client whose heartbeat goes on
/// (a `Ping` every 100 ms, each answered with a `Pong`) while its consumer took nothing more
/// still gets the stream's end after the 300 ms. Before, each `Pong` written re-armed the
/// wait, and the stream held its slot for ever. (On the paused clock.)
#[tokio::test(start_paused = true)]
async fn a_heartbeat_is_no_progress_of_a_stream_waiting_for_credit() {
    let server = serve_idle_after_300_ms().await;
    let (mut raw, _ack) = raw_client_with_window(&server, 1).await;
    raw.send(Kind::Invoke(stream_opening(
        1,
        "t.Flow.text",
        &(8u32,),
        StreamMode::Server,
    )))
    .await
    .expect("open");
    let mut pongs = 0;
    let started = tokio::time::Instant::now();
    let end = within("the stream's end", async {
        let mut beat = tokio::time::interval(Duration::from_millis(100));
        // (Bounded: 50 beats are 5 s of the paused clock.)
        for nonce in 0..50u64 {
            beat.tick().await;
            raw.send(Kind::Ping(Ping { nonce })).await.expect("ping");
            loop {
                match raw.recv().await {
                    Some(Kind::Pong(_)) => {
                        pongs += 1;
                        break;
                    }
                    Some(Kind::Result(end)) => return end,
                    Some(Kind::StreamCredit(_) | Kind::StreamItem(_) | Kind::StreamItems(_)) => {}
                    other => panic!("expected a pong or the stream's end, got {other:?}"),
                }
            }
        }
        panic!("no end after 50 heartbeats")
    })
    .await;
    assert_eq!(end.status_code, 519, "{end:?}");
    assert!(
        end.exception_message.contains("granted no credit"),
        "{end:?}"
    );
    assert!(pongs >= 2, "the heartbeat went on meanwhile: {pongs} pongs");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A slow consumer is not a stalled one: taking an item every 150 ms, half its window of 8
/// takes it 600 ms, beyond the server's 300 ms idle timeout, it still grants what it took once a
/// heartbeat (every 100 ms) has passed, and its stream without a deadline goes on. (On the
/// paused clock.)
#[tokio::test(start_paused = true)]
async fn a_slow_consumer_grants_what_it_took_each_heartbeat_and_is_not_taken_for_stalled() {
    let server = serve_idle_after_300_ms().await;
    let options = ConnectOptions {
        heartbeat_interval: Duration::from_millis(100),
        stream_window: 8,
        ..ConnectOptions::default()
    };
    let (_conn, mut s) = open_text_stream(&server.local_addr().to_string(), &options, 8).await;
    // 20 items over 3 s: ten idle timeouts, more than twice the window.
    take_slowly(&mut s, 20, Duration::from_millis(150)).await;
    drop(s);
    within("shutdown", server.shutdown()).await;
}

/// Takes `n` items of `text(8)` from `s`, each checked, waiting `pause` after each (on the
/// paused clock): a consumer that reads, slowly.
async fn take_slowly(s: &mut ClientStream, n: usize, pause: Duration) {
    for i in 0..n {
        let item = within("an item", futures_util::StreamExt::next(s))
            .await
            .expect("the stream goes on")
            .unwrap_or_else(|e| panic!("item {i}: {e}"));
        assert_eq!(
            Codec::MsgPack.decode::<String>(&item).expect("text"),
            "x".repeat(8)
        );
        tokio::time::sleep(pause).await;
    }
}

/// The same slow consumer on a connection without heartbeats: the connection still counts a
/// beat every 10 s for its streams, so taking an item every 15 s (half its window of 8 taking
/// 60 s, beyond the server's 30 s idle timeout) it still grants what it took and its stream
/// goes on. Before, it granted only at half its window and the server ended the stream as
/// stalled. (On the paused clock.)
#[tokio::test(start_paused = true)]
async fn a_slow_consumer_without_heartbeats_still_grants_what_it_took() {
    let server = Server::builder()
        .add_service(FlowServer::new(Texts(Arc::new(AtomicU64::new(0)))))
        .idle_timeout(Duration::from_secs(30))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let options = ConnectOptions {
        heartbeat_interval: Duration::ZERO,
        stream_window: 8,
        ..ConnectOptions::default()
    };
    let (_conn, mut s) = open_text_stream(&server.local_addr().to_string(), &options, 8).await;
    take_slowly(&mut s, 20, Duration::from_secs(15)).await;
    drop(s);
    within("shutdown", server.shutdown()).await;
}

/// A stream without a deadline whose client grants no more credit (nor cancels) is ended once
/// it has waited the server's idle timeout, with 519 saying why, and its slot under the
/// server's cap is free again. Before, it waited for ever, holding the slot: a few such
/// streams took an entry from every other caller. One with a deadline (longer than the idle
/// timeout), opened beside it, is left to its deadline.
#[tokio::test(start_paused = true)]
async fn a_stream_without_a_deadline_waiting_for_credit_ends_after_the_idle_timeout() {
    let server = Server::builder()
        .add_service(FlowServer::new(Texts(Arc::new(AtomicU64::new(0)))))
        .max_concurrency(2)
        .idle_timeout(Duration::from_millis(300))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut events = server.events().subscribe();
    let (mut raw, _ack) = raw_client_with_window(&server, 1).await;
    for (id, timeout_ms) in [(1, 0), (2, 900)] {
        raw.send(Kind::Invoke(RemoteInvokeMessage {
            timeout_ms,
            ..stream_opening(id, "t.Flow.text", &(8u32,), StreamMode::Server)
        }))
        .await
        .expect("open");
    }
    let mut items = [0; 2];
    let mut ends = std::collections::BTreeMap::new();
    while ends.len() < 2 {
        match within("the streams' ends", raw.recv()).await {
            Some(Kind::StreamCredit(_)) => continue,
            Some(Kind::StreamItem(item)) => items[item.message_id as usize - 1] += 1,
            Some(Kind::StreamItems(run)) => {
                items[run.message_id as usize - 1] += run.payloads.len()
            }
            Some(Kind::Result(end)) => {
                ends.insert(end.message_id, end);
            }
            other => panic!("expected the streams' items or ends, got {other:?}"),
        }
    }
    assert_eq!(items, [1, 1], "the client's window of one item each");
    let (stalled, timed) = (&ends[&1], &ends[&2]);
    assert_eq!(stalled.status_code, 519, "{stalled:?}");
    assert!(
        stalled.exception_message.contains("granted no credit"),
        "{}",
        stalled.exception_message
    );
    assert_eq!(timed.status_code, 519, "{timed:?}");
    assert!(
        !timed.exception_message.contains("granted no credit"),
        "ended by its deadline, not the idle timeout: {}",
        timed.exception_message
    );
    // Both are the server's event `timeout`, the stalled one with its own reason.
    let mut reasons = within("the timeout events", async {
        let mut reasons = Vec::new();
        while reasons.len() < 2 {
            let e = events.recv().await.expect("an event");
            if e.kind == rpc::EventKind::Timeout {
                assert_eq!(&*e.entry, "t.Flow.text", "{e:?}");
                reasons.push(e.cause.clone().unwrap_or_default());
            }
        }
        reasons
    })
    .await;
    reasons.sort_by_key(|r| !r.contains("granted no credit"));
    assert!(reasons[0].contains("granted no credit"), "{reasons:?}");
    assert!(!reasons[1].contains("granted no credit"), "{reasons:?}");
    // The cap's slots are free: another caller is served.
    served_once_more(raw, server).await;
}

/// Once `raw`'s streams have ended: the cap's slots are free, another caller of `server` is
/// served; then both end.
async fn served_once_more(raw: RawConn, server: ServerHandle) {
    let client = FlowClient::new(
        rpc::Client::builder()
            .registry(rpc::StaticRegistry::from_list(&server.local_addr().to_string()).unwrap())
            .build(),
    );
    assert_eq!(
        within("echo", client.echo("x".into()))
            .await
            .expect("served"),
        "x"
    );
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A grant gives back items the client was sent: one for more than that (here `u32::MAX`
/// after its window of two) ends the stream with 500, instead of letting the producer run
/// ahead of what the client can hold.
#[tokio::test]
async fn a_grant_for_more_items_than_were_sent_ends_the_stream() {
    let (server, polls) = serve().await;
    let (mut raw, _ack) = raw_client_with_window(&server, 2).await;
    open_text(&mut raw, 1, 8).await;
    let (items, _) = items_until_echo(&mut raw, 1, 2).await;
    assert_eq!(items.len(), 2, "the client's window");
    raw.grant(1, u32::MAX).await;
    // Bounded: a producer let run ahead would send frames without end.
    let mut frames = 0;
    let end: RemoteResultMessage = loop {
        match within("the stream's end", raw.recv()).await {
            Some(Kind::Result(end)) => break end,
            Some(_) if frames < 1000 => frames += 1,
            other => panic!("expected the stream's end, got {other:?} after {frames} frames"),
        }
    };
    assert_over_granted(&end);
    assert!(polls.load(Ordering::SeqCst) <= 3, "the producer ran ahead");
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// The same while the server still has credit (its producer waits with three items of the
/// window of four left): a grant for more than the one item sent ends the stream with 500 as
/// well. Before, the grant was looked at only once the credit ran out, which this producer
/// never lets happen, and the stream went on.
#[tokio::test]
async fn a_grant_for_more_items_than_were_sent_ends_the_stream_while_credit_is_left() {
    let (server, _) = serve().await;
    let (mut raw, _ack) = raw_client_with_window(&server, 4).await;
    raw.open_stream(1, "t.Flow.one_then_wait", &(), StreamMode::Server)
        .await;
    match raw.recv().await {
        Some(Kind::StreamCredit(c)) => assert_eq!((c.message_id, c.items), (1, 0)),
        other => panic!("expected the stream's acceptance, got {other:?}"),
    }
    let (items, _) = items_until_echo(&mut raw, 1, 2).await;
    assert_eq!(items.len(), 1, "the producer's one item");
    raw.grant(1, 4).await;
    match within("the stream's end", raw.recv()).await {
        Some(Kind::Result(end)) => assert_over_granted(&end),
        other => panic!("expected the stream's end, got {other:?}"),
    };
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// Asserts that `end` ends stream 1 with 500 for a grant of more items than it was sent.
fn assert_over_granted(end: &RemoteResultMessage) {
    assert_eq!((end.message_id, end.status_code), (1, 500), "{end:?}");
    assert!(
        end.exception_message
            .contains("more items than it was sent"),
        "{end:?}"
    );
}

/// Sends `calls` echo calls, ids from 100, without waiting for their answers.
async fn send_echoes(raw: &mut RawConn, calls: u64) {
    for id in 0..calls {
        raw.send(Kind::Invoke(RemoteInvokeMessage {
            message_id: 100 + id,
            service_entry_id: "t.Flow.echo".into(),
            parameters: Codec::MsgPack.encode(&("ping",)).expect("encode"),
            ..Default::default()
        }))
        .await
        .expect("call");
    }
}

/// A server taking two calls at a time per connection, and a raw client of it with a window of
/// one item.
async fn two_at_a_time() -> (ServerHandle, RawConn) {
    let server = Server::builder()
        .max_in_flight_per_connection(2)
        .add_service(FlowServer::new(Texts(Arc::new(AtomicU64::new(0)))))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let (raw, _ack) = raw_client_with_window(&server, 1).await;
    (server, raw)
}

/// A stream and a long poll fill the connection's in-flight limit (2); the client's calls
/// beyond it are refused, many in a row. Its frames are still read while a stream is open: the
/// stream's credit arrives, and the stream goes on (before, one unary call among the running
/// ones was enough for the server to stop reading, and the stream stalled until its deadline).
#[tokio::test]
async fn a_stream_beside_a_long_poll_at_the_in_flight_limit_still_gets_its_credit_read() {
    let (server, mut raw) = two_at_a_time().await;
    open_text(&mut raw, 1, 8).await;
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        message_id: 3,
        service_entry_id: "t.Flow.hold".into(),
        parameters: Codec::MsgPack.encode(&()).expect("encode"),
        ..Default::default()
    }))
    .await
    .expect("hold");
    let mut items = 0;
    let calls = 2 * u64::from(rpc::crates::transport::REFUSALS_BEFORE_PAUSE);
    send_echoes(&mut raw, calls).await;
    raw.grant(1, 1).await;
    let mut refused = 0;
    while refused < calls || items < 2 {
        match within("the refusals and the stream's items", raw.recv()).await {
            Some(Kind::Result(r)) => {
                assert_eq!(r.status_code, 515, "{r:?}");
                refused += 1;
            }
            Some(Kind::StreamItem(item)) => {
                assert_eq!(item.message_id, 1);
                items += 1;
            }
            other => panic!("expected refusals and items, got {other:?}"),
        }
    }
    assert_eq!(items, 2, "one item per credit");
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// Streams fill the connection's in-flight limit (2) and wait for credit; the client's calls
/// beyond it are refused (515), many in a row. The server must still read the client's
/// frames: a stream finishes only through them (here: the credit that lets stream 1 go on).
#[tokio::test]
async fn streams_at_the_in_flight_limit_still_get_their_credit_read() {
    let (server, mut raw) = two_at_a_time().await;
    for id in [1, 3] {
        raw.open_stream(id, "t.Flow.text", &(8u32,), StreamMode::Server)
            .await;
    }
    // Items of stream 1 and of stream 3 so far.
    let (mut accepted, mut items) = (0, [0u32; 2]);
    let of = |id: u64| usize::from(id == 3);
    while accepted < 2 {
        match within("the streams' acceptance", raw.recv()).await {
            Some(Kind::StreamCredit(_)) => accepted += 1,
            Some(Kind::StreamItem(item)) => items[of(item.message_id)] += 1,
            other => panic!("expected the streams' acceptance, got {other:?}"),
        }
    }
    let calls = 20u64;
    send_echoes(&mut raw, calls).await;
    let mut refused = 0;
    while refused < calls {
        match within("the refusals", raw.recv()).await {
            Some(Kind::Result(r)) => {
                assert_eq!(r.status_code, 515, "{r:?}");
                refused += 1;
            }
            Some(Kind::StreamItem(item)) => items[of(item.message_id)] += 1,
            other => panic!("expected refusals and items, got {other:?}"),
        }
    }
    assert!(
        items[0] <= 1 && items[1] <= 1,
        "windows of one item: {items:?}"
    );
    raw.grant(1, 1).await;
    // Stream 1's second item, after its credit (bounded: the windows' items and this one).
    while items[0] < 2 {
        assert!(items[1] <= 1, "stream 3 went past its window");
        match within("stream 1's next item", raw.recv()).await {
            Some(Kind::StreamItem(item)) => items[of(item.message_id)] += 1,
            other => panic!("expected stream items, got {other:?}"),
        }
    }
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

#[rpc::service(name = "t.Blob")]
pub trait Blob {
    /// The bytes of the caller's items, in all.
    async fn total(&self, items: RpcStream<String>) -> Result<u64, RpcError>;
    /// `n` items of `size` bytes.
    async fn blobs(&self, n: u32, size: u32) -> Result<RpcStream<String>, RpcError>;
}

struct Blobs;

impl Blob for Blobs {
    async fn total(&self, mut items: RpcStream<String>) -> Result<u64, RpcError> {
        let mut total = 0;
        while let Some(item) = futures_util::StreamExt::next(&mut items).await {
            total += item?.len() as u64;
        }
        Ok(total)
    }

    async fn blobs(&self, n: u32, size: u32) -> Result<RpcStream<String>, RpcError> {
        let item = "b".repeat(size as usize);
        Ok(RpcStream::iter((0..n).map(move |_| item.clone())))
    }
}

/// Items of 4 KiB each, 64 of them: each fits a frame limit of 32 KiB, eight of them do not.
const BLOB: u32 = 4 * 1024;
const BLOBS: u32 = 64;
const SMALL_FRAMES: usize = 32 * 1024;

/// A server and a client over the in-process registry, built by `server` and `client`.
async fn blob_pair(
    server: impl FnOnce(rpc::ServerBuilder) -> rpc::ServerBuilder,
    client: impl FnOnce(rpc::ClientBuilder) -> rpc::ClientBuilder,
) -> (ServerHandle, BlobClient) {
    let reg = rpc::InProcessRegistry::new();
    let handle = server(
        Server::builder()
            .registry(reg.clone())
            .add_service(BlobServer::new(Blobs)),
    )
    .serve("127.0.0.1:0")
    .await
    .expect("serve");
    let proxy = BlobClient::new(
        client(rpc::Client::builder().registry(reg))
            .override_options(BlobClient::SERVICE_ID, common::no_retry())
            .build(),
    );
    (handle, proxy)
}

/// A server whose frame limit is below a whole run of items: the client batches its items in
/// runs no larger than the limit the server announced, so every item arrives and the
/// connection stays up (a larger run would be a frame the server must refuse, ending every
/// call on the connection).
#[tokio::test]
async fn a_client_batches_its_items_within_the_servers_frame_limit() {
    let (server, blob) = blob_pair(|b| b.max_frame_length(SMALL_FRAMES), |b| b).await;
    for round in 0..3 {
        let items = RpcStream::iter((0..BLOBS).map(|_| "c".repeat(BLOB as usize)));
        let total = within("total", blob.total(items))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(total, u64::from(BLOBS * BLOB), "round {round}");
    }
    within("shutdown", server.shutdown()).await;
}

/// A client whose frame limit is below a whole run of items does not offer batches: the
/// server sends it one item per frame, and every item arrives.
#[tokio::test]
async fn a_client_whose_frame_limit_is_below_a_run_is_sent_one_item_per_frame() {
    let (server, blob) = blob_pair(|b| b, |b| b.max_frame_length(SMALL_FRAMES)).await;
    for round in 0..3 {
        let mut s = within("blobs", blob.blobs(BLOBS, BLOB))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let mut bytes = 0u64;
        while let Some(item) = within("next blob", futures_util::StreamExt::next(&mut s)).await {
            bytes += item.unwrap_or_else(|e| panic!("round {round}: {e}")).len() as u64;
        }
        assert_eq!(bytes, u64::from(BLOBS * BLOB), "round {round}");
    }
    within("shutdown", server.shutdown()).await;
}

/// A stream read to its end no longer counts among its connection's calls in flight, though
/// the caller keeps it: a pool closes an idle connection to an endpoint that left the
/// registry, and a finished stream kept in a struct must not hold it busy.
#[tokio::test]
async fn a_stream_read_to_its_end_and_kept_is_no_longer_in_flight() {
    let (server, _) = blob_pair(|b| b, |b| b).await;
    let conn = Connection::connect(&server.local_addr().to_string(), &ConnectOptions::default())
        .await
        .expect("connect");
    let call = Call {
        service_entry_id: "t.Blob.blobs".into(),
        parameters: Codec::MsgPack.encode(&(3u32, 8u32)).expect("encode"),
        ..Default::default()
    };
    let mut stream = match within("open", conn.open_stream(call, StreamMode::Server, None))
        .await
        .expect("open")
    {
        Opened::Accepted(s) => s,
        Opened::Refused(r) => panic!("refused: {r:?}"),
    };
    assert_eq!(conn.in_flight(), 1, "open");
    let mut items = 0;
    while let Some(item) = within("next", futures_util::StreamExt::next(&mut stream)).await {
        item.expect("an item");
        items += 1;
    }
    assert_eq!(items, 3);
    assert_eq!(conn.in_flight(), 0, "read to its end, still held");
    drop(stream);
    assert_eq!(conn.in_flight(), 0, "counted down once");
    within("shutdown", server.shutdown()).await;
}

/// A client that closes its sending side while the server drains, with a stream open: the
/// stream, which can no longer get the client's credit, is answered 520 at once, and the drain
/// ends then, not at its deadline (10 s). (On the paused clock.)
#[tokio::test(start_paused = true)]
async fn a_stream_of_a_client_half_closing_during_the_drain_ends_the_drain_at_once() {
    let (server, _) = serve().await;
    let (mut raw, _) = raw_client_with_window(&server, 1).await;
    open_text(&mut raw, 1, 8).await;
    let started = tokio::time::Instant::now();
    let shutdown = tokio::spawn(server.shutdown());
    loop {
        match within("the GoAway", raw.recv()).await {
            Some(Kind::GoAway(g)) => {
                assert_eq!(g.status_code, 200, "{g:?}");
                break;
            }
            Some(Kind::StreamItem(_) | Kind::StreamItems(_) | Kind::StreamCredit(_)) => continue,
            other => panic!("expected the GoAway, got {other:?}"),
        }
    }
    raw.half_close().await;
    let end = raw.next_result("the stream's end").await;
    assert_eq!((end.message_id, end.status_code), (1, 520), "{end:?}");
    raw.expect_drained().await;
    within("shutdown", shutdown).await.expect("join");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the drain waited for its deadline: {:?}",
        started.elapsed()
    );
}

/// A transport server of `handler` with `options` on a free port (stopped by the token, its
/// task returned), and a raw client that handshook with streams and a window of `window`
/// items.
async fn transport_server(
    handler: Arc<dyn rpc::crates::transport::InvokeHandler>,
    options: rpc::crates::transport::ServerOptions,
    window: u32,
) -> (
    RawConn,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let (listener, addr) = raw_listener().await;
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(rpc::crates::transport::serve(
        listener,
        handler,
        options,
        stop.clone(),
    ));
    let mut raw = RawConn::connect(addr).await;
    raw.send(Kind::Hello(Hello {
        protocol_version: 1,
        streams: true,
        stream_window: window,
        ..Default::default()
    }))
    .await
    .expect("send Hello");
    assert!(matches!(raw.recv().await, Some(Kind::HelloAck(_))));
    (raw, stop, server)
}

/// A transport handler answering with plain events (`Dispatch::Stream`), to a client that
/// asked for a deadline and then grants no more credit: the events cannot end themselves at
/// the deadline while the stream waits for credit, so the server's idle timeout (the stall
/// limit) ends it, with 519 saying why. Before, the stall limit applied only to streams
/// without a deadline, and this one held its slot until its connection ended. (On the paused
/// clock.)
#[tokio::test(start_paused = true)]
async fn a_plain_event_stream_with_a_deadline_still_ends_when_its_client_grants_nothing() {
    use rpc::crates::transport::{
        Caller, Dispatch, Invoke, InvokeHandler, ServerOptions, StreamEvent,
    };

    /// Answers every call (a server stream's opening among them) with items without end.
    struct Endless;
    impl InvokeHandler for Endless {
        fn handle(&self, _: Invoke, _: &Arc<Caller>) -> Dispatch {
            Dispatch::Stream(Box::pin(futures_util::stream::repeat(StreamEvent::Item(
                bytes::Bytes::from_static(b"x"),
            ))))
        }
    }

    let (mut raw, stop, server) = transport_server(
        Arc::new(Endless),
        ServerOptions {
            idle_timeout: Duration::from_millis(300),
            ..ServerOptions::default()
        },
        1,
    )
    .await;
    // A deadline of an hour; no credit after the first item.
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        timeout_ms: 3_600_000,
        ..stream_opening(1, "t.Endless.items", &(), StreamMode::Server)
    }))
    .await
    .expect("open");
    let (items, end) = items_then_end(&mut raw).await;
    assert_eq!((end.message_id, end.status_code), (1, 519), "{end:?}");
    assert_eq!(items, 1, "the client's window of one item");
    assert!(
        end.exception_message.contains("granted no credit"),
        "{}",
        end.exception_message
    );
    stop.cancel();
    within("server stop", server).await.expect("server task");
}

/// A transport handler that answers a client stream as a unary call (`Dispatch::Spawn`, the
/// natural way to write "sum the items, then answer"): no stream task grants the client credit,
/// so none of its items can come. The handler's reading ends with an error naming that, and
/// the call is answered, instead of the handler waiting for items for ever.
#[tokio::test]
async fn a_client_stream_answered_as_a_unary_call_ends_its_items_with_an_error() {
    use rpc::crates::transport::{
        error_result, Caller, Dispatch, Invoke, InvokeHandler, ServerOptions,
    };

    struct SumLater;
    impl InvokeHandler for SumLater {
        fn handle(&self, _: Invoke, _: &Arc<Caller>) -> Dispatch {
            Dispatch::Ready(error_result(
                rpc::StatusCode::FrameworkError,
                "streams only",
            ))
        }
        fn handle_stream(
            &self,
            _: Invoke,
            _: &Arc<Caller>,
            mut inbound: rpc::crates::core::ByteStream,
        ) -> Dispatch {
            Dispatch::Spawn(Box::pin(async move {
                let mut n = 0;
                loop {
                    match futures_util::StreamExt::next(&mut inbound).await {
                        Some(Ok(_)) => n += 1,
                        Some(Err(e)) => {
                            return error_result(e.code(), format!("after {n} items: {e}"))
                        }
                        None => return error_result(rpc::StatusCode::Success, "all read"),
                    }
                }
            }))
        }
    }

    let (mut raw, stop, server) =
        transport_server(Arc::new(SumLater), ServerOptions::default(), 8).await;
    raw.open_stream(1, "t.Sum.sum", &(), StreamMode::Client)
        .await;
    let end = raw.recv_end().await;
    assert_eq!(end.message_id, 1, "{end:?}");
    assert_eq!(
        end.status_code,
        rpc::StatusCode::CommunicationError.as_u32(),
        "{end:?}"
    );
    assert!(
        end.exception_message.starts_with("after 0 items"),
        "{end:?}"
    );
    stop.cancel();
    within("server stop", server).await.expect("server task");
}
