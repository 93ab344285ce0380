//! A client facing a server that stalls: its send queue is bounded (a call waits for room,
//! within its deadline, instead of growing the client's memory), and callers needing a
//! connection to an endpoint that never completes the handshake share one connect attempt, so
//! they all get its error after one connect timeout rather than one behind another. A stream's
//! set-up is bounded by its attempt's deadline as well as the stream's: past it, a set-up
//! waiting for room fails as not sent, and one waiting for the server's answer is cancelled.
//!
//! The servers are raw TCP listeners: one accepts and answers `Hello` but never reads again,
//! one accepts and never answers at all.

use crate::common;

use std::time::Duration;

use bytes::BytesMut;
use common::{recv_one, within, RawConn};
use rpc::crates::core::wire::StreamMode;
use rpc::crates::core::wire::{frame::Kind, GoAway, HelloAck, Ping};
use rpc::crates::transport::{
    Abortive, Call, ConnectOptions, Connection, ConnectionPool, Dialer, FrameCodec, PeerAddr,
    Stream, TcpDialer,
};
use rpc::{Codec, StatusCode};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const KIB: usize = 1024;

/// A server that accepts one connection, answers its `Hello`, and then never reads: what a
/// stalled server looks like to its client. Keeps the socket open until `stop` is dropped.
async fn stalled_server() -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("accept");
        let raw = common::accept_hello(stream, "stalled", 1 << 24).await;
        let _ = stopped.await;
        drop(raw);
    });
    (addr, stop)
}

/// A server that pings and never reads: the client answers its pings only while its send
/// queue is within its limit, so pongs the server never reads cannot grow the client's
/// memory without end.
#[tokio::test]
async fn a_server_that_pings_and_never_reads_cannot_grow_the_clients_send_queue() {
    // Small socket buffers on both ends, so that what the client cannot send waits in its
    // queue whatever this machine's default buffer sizes are.
    let max = 64 * KIB;
    let (mut raw, conn) = small_buffers(max, named_ack("pinger")).await;
    // A call, answered after the pings: once its answer is in, the client has read them all.
    let answered = tokio::spawn({
        let conn = conn.clone();
        async move { conn.call(call(16), None).await }
    });
    let id = raw.recv_invoke("the call").await.message_id;
    // Pongs of 17 bytes on the wire each (the largest nonces), 8.5 MB if every ping were
    // answered: over a hundred times what the two small socket buffers hold.
    let pings = 500_000u64;
    let mut frames = BytesMut::new();
    for i in 0..pings {
        let nonce = u64::MAX - i;
        FrameCodec::encode_kind(Kind::Ping(Ping { nonce }), &mut frames);
    }
    raw.send_bytes(&frames).await.expect("the pings");
    raw.answer(id, 200, "after the pings").await;
    let answer = within("the answer", answered).await.expect("join");
    assert_eq!(answer.expect("answered").status_code, 200);
    assert!(
        conn.unsent_bytes() <= max + 64,
        "{} bytes queued, limit {max}",
        conn.unsent_bytes()
    );
}

/// A server that stops reading, then says it is draining (GoAway 200): the calls waiting for
/// room in the client's send queue are not sent after it (the protocol forbids new calls
/// then) but fail at once as not sent, to go to another endpoint, instead of waiting for a
/// server that may never read again.
#[tokio::test]
async fn calls_waiting_for_room_are_not_sent_once_the_server_goes_away() {
    calls_waiting_for_room_end_unsent(
        |mut raw, _| async move {
            raw.send(Kind::GoAway(GoAway {
                status_code: 200,
                reason: "draining".into(),
                last: false,
            }))
            .await
            .expect("GoAway");
            raw
        },
        "GoAway",
    )
    .await;
}

/// The same calls once the client retires the connection (its endpoint left the registry):
/// they leave it at once, not sent, instead of waiting for room until their deadline.
#[tokio::test]
async fn calls_waiting_for_room_are_not_sent_once_the_connection_is_retired() {
    calls_waiting_for_room_end_unsent(
        |raw, conn| async move {
            assert!(!conn.close_if_idle(), "calls are in flight");
            raw
        },
        "left the registry",
    )
    .await;
}

/// Fills the send queue of a connection to a server that stops reading, then does `then`
/// (with the server's side and the connection) and expects a call waiting for room to fail,
/// not sent, with `said` in its error.
async fn calls_waiting_for_room_end_unsent<F, Fut>(then: F, said: &str)
where
    F: FnOnce(RawConn, Connection) -> Fut,
    Fut: std::future::Future<Output = RawConn>,
{
    let (mut lines, _guard) = common::log_lines(tracing::Level::DEBUG);
    let (raw, conn) = small_buffers(64 * KIB, named_ack("draining")).await;
    // 3 MiB of calls the server never reads: more than the socket buffers and the queue hold.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..48 {
        let conn = conn.clone();
        tasks.spawn(async move { conn.call(call(64 * KIB), None).await });
    }
    within("a call waits for room", async {
        while !recv_one("a log line", &mut lines)
            .await
            .contains("send queue full")
        {}
    })
    .await;
    let _raw = then(raw, conn).await;
    // (The calls written before wait for their answers.)
    let err = within("a waiting call fails", async {
        loop {
            let ended = tasks.join_next().await.expect("a call ends").expect("join");
            let err = ended.expect_err("the server answers nothing");
            if err.message().contains(said) {
                return err;
            }
        }
    })
    .await;
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(err.message().contains("was not sent"), "{err}");
    assert!(!err.is_maybe_delivered(), "never sent: {err}");
    // Retired, the endpoint is no longer listed: the call goes elsewhere with nothing held
    // against it. A draining server is still listed, and its GoAway says what it is.
    assert_eq!(
        err.is_unsupported_by_endpoint(),
        said == "left the registry",
        "{err}"
    );
}

/// A stream whose server never answers its set-up: the set-up ends at the attempt's deadline
/// (not the stream's, a minute away) with a timeout, and the server is told to stop.
#[tokio::test(start_paused = true)]
async fn a_stream_set_up_unanswered_by_its_attempt_deadline_is_cancelled() {
    let (listener, addr) = common::raw_listener().await;
    let connecting = tokio::spawn(async move {
        Connection::connect(&addr.to_string(), &ConnectOptions::default()).await
    });
    let (mut raw, _) = RawConn::accept_with(&listener, common::streaming_ack(16)).await;
    let conn = within("connect", connecting)
        .await
        .expect("join")
        .expect("connect");
    let now = tokio::time::Instant::now();
    let opening = tokio::spawn(async move {
        conn.open_stream_within(
            call(16),
            StreamMode::Server,
            Some(now + Duration::from_secs(60)),
            Some(now + Duration::from_millis(100)),
        )
        .await
        .map(|_| ())
    });
    let id = raw.recv_invoke("the stream's opening").await.message_id;
    let err = within("the set-up ends", opening)
        .await
        .expect("join")
        .expect_err("never answered");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    assert!(err.message().contains("set-up"), "{err}");
    assert!(
        tokio::time::Instant::now() < now + Duration::from_secs(60),
        "ended at the attempt's deadline, not the stream's"
    );
    let cancel = raw
        .skip_to("the Cancel", |kind| match kind {
            Kind::Cancel(c) => Some(c),
            _ => None,
        })
        .await;
    assert_eq!(cancel.message_id, id);
}

/// A stream's set-up that finds the send queue full (a server that stopped reading) waits for
/// room until its attempt's deadline, then fails as not sent: the retry layer may send it to
/// another endpoint, whatever the method.
#[tokio::test]
async fn a_stream_set_up_waiting_for_room_past_its_attempt_deadline_is_not_sent() {
    let (_raw, conn) = small_buffers(64 * KIB, common::streaming_ack(16)).await;
    // 3 MiB of calls the server never reads fill the socket buffers and the queue.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..48 {
        let conn = conn.clone();
        tasks.spawn(async move { conn.call(call(64 * KIB), None).await });
    }
    let err = within("a set-up finds the queue full", async {
        for _ in 0..40 {
            let now = tokio::time::Instant::now();
            let err = conn
                .open_stream_within(
                    call(16),
                    StreamMode::Server,
                    Some(now + Duration::from_secs(60)),
                    Some(now + Duration::from_millis(50)),
                )
                .await
                .map(|_| ())
                .expect_err("the server reads nothing");
            // (Until the socket buffers are full a set-up may get in, and time out waiting
            // for its answer instead.)
            if err.is_not_sent() {
                return err;
            }
        }
        panic!("no set-up found the send queue full");
    })
    .await;
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    assert!(err.message().contains("send queue"), "{err}");
    tasks.abort_all();
}

/// A call that waited for room in the send queue tells the server the budget left when it is
/// sent, not the one it had when it began waiting (and so a stream's set-up). Before, it was
/// told its whole budget, and ran (with the calls it made) past its caller's deadline by as
/// long as it waited. (On the real clock: the kernel's acknowledgements, which free the
/// socket's room, keep real time. The wait is measured, not assumed: the budget told must be
/// at most what was left when the server began reading, which is when room came.)
#[tokio::test]
async fn a_call_that_waited_for_room_is_sent_with_the_budget_left() {
    for stream in [false, true] {
        let (mut raw, conn) = small_buffers(64 * KIB, common::streaming_ack(16)).await;
        // 3 MiB of calls the server does not read yet: the socket buffers and the queue fill.
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..48 {
            let conn = conn.clone();
            tasks.spawn(async move { conn.call(call(64 * KIB), None).await.map(|_| ()) });
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let late = Call {
            service_entry_id: "t.Late.put".into(),
            timeout_ms: 10_000,
            ..call(16)
        };
        let waiting = conn.clone();
        tasks.spawn(async move {
            if stream {
                waiting
                    .open_stream_within(late, StreamMode::Server, Some(deadline), None)
                    .await
                    .map(|_| ())
            } else {
                waiting.call(late, Some(deadline)).await.map(|_| ())
            }
        });
        // The late call waits behind the queue for a while before the server reads anything.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released = tokio::time::Instant::now();
        let sent = loop {
            let invoke = raw.recv_invoke("the calls, in order").await;
            if invoke.service_entry_id == "t.Late.put" {
                break invoke;
            }
        };
        let left_ms = deadline.saturating_duration_since(released).as_millis() as u32 + 1;
        assert!(
            sent.timeout_ms <= left_ms,
            "stream {stream}: the server was told {} ms, with {left_ms} ms left when it read",
            sent.timeout_ms
        );
        tasks.abort_all();
    }
}

/// A server reading a long queue of the client's calls slowly (a slow link): the client's
/// heartbeat, which hears nothing back meanwhile (the server's answers and its `Pong` come after
/// those calls), counts the socket taking the calls as the server's sign of life and keeps the
/// connection. Before, it closed the connection after three heartbeats, failing every call.
/// (On the paused clock, which moves only when nothing is left to run: the server's pace and
/// the heartbeats are exact, whatever the machine's load.)
#[tokio::test(start_paused = true)]
async fn a_server_reading_a_long_queue_slowly_is_not_taken_for_dead() {
    let options = ConnectOptions {
        heartbeat_interval: Duration::from_millis(200),
        max_unsent_bytes: 8 << 20,
        ..ConnectOptions::default()
    };
    let (raw, conn) = small_buffers_with(options, plain_ack()).await;
    let mut stream = raw.into_stream();
    // 1.5 MiB of calls, queued at once.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..48 {
        let conn = conn.clone();
        tasks.spawn(async move { conn.call(call(32 * KIB), None).await });
    }
    // The server takes 8 KiB every 10 ms at most (under 1 MB/s) until it has 1 MiB: over
    // six heartbeat intervals with nothing sent back.
    within("the server reads 1 MiB", async {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 8 * KIB];
        let mut total = 0;
        while total < 1 << 20 {
            let n = stream.read(&mut buf).await.expect("read");
            assert!(
                n > 0,
                "the client closed the connection after {total} bytes"
            );
            total += n;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(conn.is_usable(), "the connection was closed");
    assert!(
        tasks.try_join_next().is_none(),
        "a call ended before its answer"
    );
    tasks.abort_all();
}

/// A server's handshake answer naming `server_id`, with frames up to 16 MiB and nothing
/// else.
fn named_ack(server_id: &str) -> HelloAck {
    HelloAck {
        protocol_version: 1,
        server_id: server_id.into(),
        max_frame_length: 1 << 24,
        ..Default::default()
    }
}

/// A connection whose client has a send buffer of [`SMALL_BUFFER`] and a send queue of
/// `max_unsent` bytes, to a listener whose receive buffer is as small (so that what the client
/// cannot send waits in its queue, whatever this machine's default buffer sizes are), the
/// server's side answering the handshake with `ack`.
async fn small_buffers(max_unsent: usize, ack: HelloAck) -> (RawConn, Connection) {
    let options = ConnectOptions {
        max_unsent_bytes: max_unsent,
        ..ConnectOptions::default()
    };
    small_buffers_with(options, ack).await
}

/// [`small_buffers`] with the client's `options`.
async fn small_buffers_with(options: ConnectOptions, ack: HelloAck) -> (RawConn, Connection) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .set_recv_buffer_size(SMALL_BUFFER)
        .expect("SO_RCVBUF");
    socket
        .bind("127.0.0.1:0".parse().expect("address"))
        .expect("bind");
    let listener = socket.listen(16).expect("listen");
    let addr = listener.local_addr().expect("addr").to_string();
    let connecting =
        tokio::spawn(
            async move { Connection::connect_with(&SmallSendBuffer, &addr, &options).await },
        );
    let (raw, _) = RawConn::accept_with(&listener, ack).await;
    let conn = within("connect", connecting)
        .await
        .expect("join")
        .expect("connect");
    (raw, conn)
}

/// The socket buffer size the ping test asks for (Linux doubles it, and keeps a minimum).
const SMALL_BUFFER: u32 = 16 * 1024;

/// Dials TCP with a send buffer of [`SMALL_BUFFER`].
struct SmallSendBuffer;

impl Dialer for SmallSendBuffer {
    type Stream = TcpStream;

    async fn dial(&self, addr: &str) -> std::io::Result<(TcpStream, PeerAddr)> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_send_buffer_size(SMALL_BUFFER)?;
        let to: std::net::SocketAddr = addr.parse().map_err(std::io::Error::other)?;
        let stream = socket.connect(to).await?;
        Ok((stream, PeerAddr::Tcp(to)))
    }
}

fn call(size: usize) -> Call {
    Call {
        service_entry_id: "t.Stalled.put".into(),
        parameters: vec![0u8; size].into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_stalled_server_bounds_the_clients_send_queue_and_calls_wait_within_their_deadline() {
    let (mut lines, _guard) = common::log_lines(tracing::Level::DEBUG);

    let (addr, stop) = stalled_server().await;
    let max = 256 * KIB;
    let options = ConnectOptions {
        max_unsent_bytes: max,
        ..ConnectOptions::default()
    };
    let conn = within("connect", Connection::connect(&addr.to_string(), &options))
        .await
        .expect("connect");

    // Far more than the kernel's socket buffers and the queue hold together (the socket
    // buffers of loopback grow to a few MiB): 400 calls of 64 KiB, 25 MiB.
    let size = 64 * KIB;
    let calls = 400;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..calls {
        let conn = conn.clone();
        tasks.spawn(async move { conn.call(call(size), None).await });
    }
    // A call finds the queue full and waits...
    let full = within("a call waits for room", async {
        loop {
            let line = recv_one("a log line", &mut lines).await;
            if line.contains("send queue full") {
                return line;
            }
        }
    })
    .await;
    assert!(full.contains(&format!("max={max}")), "{full}");
    // ...so what the client holds queued stays within the limit and one call.
    assert!(
        conn.unsent_bytes() <= max + size + 64 + 64,
        "{} bytes queued",
        conn.unsent_bytes()
    );
    assert!(
        conn.in_flight() < calls,
        "all {calls} calls were queued: {} in flight",
        conn.in_flight()
    );

    // A call with a deadline gives up at its deadline, without being sent. (Until the kernel's
    // socket buffers are full, waiting calls may still get in: a call that got in times out
    // waiting for its answer instead; a few tries reach the steady state.)
    let err = within("a call with a deadline finds the queue full", async {
        for _ in 0..40 {
            let deadline = tokio::time::Instant::now() + Duration::from_millis(100);
            let err = conn
                .call(call(16), Some(deadline))
                .await
                .expect_err("the server never answers");
            assert_eq!(err.code(), StatusCode::Timeout, "{err}");
            if err.message().contains("send queue") {
                return err;
            }
        }
        panic!("no call found the send queue full");
    })
    .await;
    assert!(err.message().contains("was not sent"), "{err}");
    assert!(
        conn.unsent_bytes() <= max + size + 64 + 64,
        "{} bytes queued",
        conn.unsent_bytes()
    );

    // The server goes away: every call, sent or waiting, ends with an error.
    drop(stop);
    let mut failed = 0;
    while let Some(r) = within("the calls end", tasks.join_next()).await {
        assert!(r.expect("join").is_err());
        failed += 1;
    }
    assert_eq!(failed, calls);
}

/// A connection that dies with calls still in the client's send queue: those never written
/// fail as not delivered (safe to send elsewhere, even when not idempotent); those the server
/// read, and those being written, as maybe delivered.
#[tokio::test]
async fn calls_never_written_when_the_connection_dies_are_not_maybe_delivered() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (read_tx, mut read_rx) = mpsc::unbounded_channel::<u32>();
    // Reads two calls (their index is the first 4 bytes of the parameters), then nothing
    // more; closes the socket, with the rest unread, when told to.
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("accept");
        let mut raw = common::accept_hello(stream, "dies", 1 << 24).await;
        for _ in 0..2 {
            let invoke = raw.recv_invoke("a call").await;
            let index = u32::from_be_bytes(invoke.parameters[..4].try_into().expect("4 bytes"));
            let _ = read_tx.send(index);
        }
        let _ = stopped.await;
        drop(raw);
    });
    let options = ConnectOptions {
        max_unsent_bytes: 64 << 20,
        ..ConnectOptions::default()
    };
    let conn = within("connect", Connection::connect(&addr.to_string(), &options))
        .await
        .expect("connect");
    // 25 MiB: far more than the socket buffers of loopback hold (a few MiB).
    let (size, calls) = (64 * KIB, 400u32);
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..calls {
        let conn = conn.clone();
        let mut parameters = vec![0u8; size];
        parameters[..4].copy_from_slice(&index.to_be_bytes());
        tasks.spawn(async move {
            let call = Call {
                service_entry_id: "t.Dies.put".into(),
                parameters: parameters.into(),
                ..Default::default()
            };
            (index, conn.call(call, None).await)
        });
    }
    let read = [
        recv_one("a call read", &mut read_rx).await,
        recv_one("a call read", &mut read_rx).await,
    ];
    within("every call queued", async {
        while conn.in_flight() < calls as usize {
            tokio::task::yield_now().await;
        }
    })
    .await;
    drop(stop);
    let (mut maybe, mut not_sent) = (0, 0);
    while let Some(joined) = within("the calls end", tasks.join_next()).await {
        let (index, result) = joined.expect("join");
        let err = result.expect_err("the server answers nothing");
        assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
        if err.is_maybe_delivered() {
            maybe += 1;
        } else {
            assert!(
                !read.contains(&index),
                "call {index} was read by the server, and reported as never sent: {err}"
            );
            not_sent += 1;
        }
    }
    assert!(
        maybe >= 2,
        "the calls the server read may have run: {maybe}"
    );
    assert!(
        not_sent > 0,
        "every one of {calls} calls was reported as maybe delivered, though they cannot all \
         have left the client"
    );
    eprintln!("{maybe} maybe delivered, {not_sent} never sent");
}

/// A listener that accepts connections and never says a word: each connect attempt to it ends
/// at the client's connect timeout. Reports the peer port of each accepted connection.
async fn silent_listener() -> (std::net::SocketAddr, mpsc::UnboundedReceiver<u16>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, peer)) = listener.accept().await {
            let _ = tx.send(peer.port());
            held.push(stream);
        }
    });
    (addr, rx)
}

/// A large answer arriving slowly (no frame completes for several heartbeats) is traffic all
/// the same: the heartbeat does not close the connection under it, and the call gets its
/// answer.
#[tokio::test(start_paused = true)]
async fn a_large_answer_arriving_slowly_keeps_the_connection_alive() {
    use rpc::crates::core::wire::{frame::Kind, RemoteResultMessage};
    use rpc::crates::transport::FrameCodec;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let text = "y".repeat(512 * 1024);
    let answer = Codec::MsgPack.encode(&text).expect("encode");
    tokio::spawn(async move {
        let ack = plain_ack();
        let (mut peer, _) = RawConn::accept_with(&listener, ack).await;
        let id = peer.recv_invoke("the call").await.message_id;
        let mut frame = bytes::BytesMut::new();
        FrameCodec::encode_kind(
            Kind::Result(RemoteResultMessage {
                message_id: id,
                status_code: 200,
                result: answer,
                ..Default::default()
            }),
            &mut frame,
        );
        // 20 pieces, 150 ms apart: 3 s for the frame, 30 heartbeats of 100 ms.
        for piece in frame.chunks(frame.len() / 20 + 1) {
            peer.send_bytes(piece).await.expect("a piece");
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        std::future::pending::<()>().await;
    });
    let (conn, call) = heartbeating_call(addr).await;
    let r = within("the slow answer", conn.call(call, None))
        .await
        .expect("answered, the connection kept");
    let got: String = Codec::MsgPack.decode(&r.result).expect("decode");
    assert_eq!(got.len(), text.len());
}

/// A server's handshake answer offering nothing beyond plain calls.
fn plain_ack() -> rpc::crates::core::wire::HelloAck {
    rpc::crates::core::wire::HelloAck {
        protocol_version: 1,
        ..Default::default()
    }
}

/// A connection to `addr` with a heartbeat every 100 ms, and a call of `t.Slow.answer`.
async fn heartbeating_call(addr: std::net::SocketAddr) -> (Connection, Call) {
    let conn = Connection::connect(
        &addr.to_string(),
        &ConnectOptions {
            heartbeat_interval: Duration::from_millis(100),
            ..ConnectOptions::default()
        },
    )
    .await
    .expect("connect");
    let call = Call {
        service_entry_id: "t.Slow.answer".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&()).expect("encode"),
        ..Default::default()
    };
    (conn, call)
}

/// A call on a connection the client's heartbeat took for dead (the server answered its
/// handshake, then nothing: no answer, no `Pong`) fails saying so, not with the bare
/// "connection closed" a local close gives. (On the paused clock: three heartbeats of 100 ms.)
#[tokio::test(start_paused = true)]
async fn a_call_on_a_connection_the_heartbeat_closed_says_why() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let ack = plain_ack();
        // Handshaken, then mute: what arrives is read and never answered.
        let (_mute, _) = RawConn::accept_with(&listener, ack).await;
        std::future::pending::<()>().await;
    });
    let (conn, call) = heartbeating_call(addr).await;
    let e = within("the call", conn.call(call, None))
        .await
        .expect_err("never answered");
    assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
    assert!(e.message().contains("three heartbeats"), "{e}");
}

/// A connect attempt every caller gave up on goes on by itself: a caller long after finds it
/// ended (here at its connect timeout, the first connection never answered) and makes a fresh
/// one, which the server answers, instead of resuming the stale attempt and failing at once.
#[tokio::test(start_paused = true)]
async fn a_connect_attempt_its_callers_left_ends_by_itself_and_the_next_caller_connects() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        // The first connection: accepted and never answered.
        let (_silent, _) = listener.accept().await.expect("accept");
        // The next ones: a handshake as a server makes it, the connections kept open.
        let mut answered = Vec::new();
        for _ in 0..4 {
            let ack = plain_ack();
            answered.push(RawConn::accept_with(&listener, ack).await.0);
        }
        std::future::pending::<()>().await;
    });
    let pool = ConnectionPool::new(
        ConnectOptions {
            connect_timeout: Duration::from_millis(300),
            ..ConnectOptions::default()
        },
        1,
    );
    let gave_up =
        tokio::time::timeout(Duration::from_millis(10), pool.get(&addr.to_string())).await;
    assert!(
        gave_up.is_err(),
        "the first caller gave up while connecting"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    within("a later caller", pool.get(&addr.to_string()))
        .await
        .expect("a fresh attempt, answered");
}

#[tokio::test]
async fn callers_to_an_endpoint_that_never_answers_share_one_connect_attempt() {
    let (addr, mut accepted) = silent_listener().await;
    let timeout = Duration::from_millis(300);
    let pool = ConnectionPool::new(
        ConnectOptions {
            connect_timeout: timeout,
            ..ConnectOptions::default()
        },
        1,
    );
    let callers = 8;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..callers {
        let pool = pool.clone();
        let addr = addr.to_string();
        tasks.spawn(async move { pool.get(&addr).await.map(|_| ()) });
    }
    let mut errors = Vec::new();
    while let Some(r) = within("every caller gets an answer", tasks.join_next()).await {
        errors.push(r.expect("join").expect_err("the endpoint never answers"));
    }
    assert_eq!(errors.len(), callers);
    for e in &errors {
        assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
        assert!(e.message().contains("no connection within 300 ms"), "{e}");
    }
    // The connections the listener accepted, counted up to a marker connection of the test's
    // own (the kernel hands them over in order): one attempt, not one per caller.
    let marker = TcpStream::connect(addr).await.expect("marker");
    let marker_port = marker.local_addr().expect("addr").port();
    let mut attempts = 0;
    while recv_one("an accepted connection", &mut accepted).await != marker_port {
        attempts += 1;
    }
    assert_eq!(
        attempts, 1,
        "{callers} callers made {attempts} connect attempts"
    );

    // The failed attempt is not kept: the next caller tries again.
    let again = within("a later caller", pool.get(&addr.to_string())).await;
    assert!(again.is_err());
    assert_ne!(recv_one("a new attempt", &mut accepted).await, marker_port);
}

/// A call waiting for room in the send queue fails as soon as a write fails, though the
/// connection's reader goes on (the server has not closed): nothing queued will be written
/// any more, so no room will come, and waiting would hold the caller until its deadline.
#[tokio::test]
async fn a_call_waiting_for_room_fails_once_a_write_fails() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let ack = plain_ack();
        // Handshake, then hold the connection open without reading.
        let _peer = RawConn::accept_with(&listener, ack).await;
        std::future::pending::<()>().await;
    });
    let switch = Arc::new(WriteSwitch::default());
    let dialer = SwitchedDialer(switch.clone());
    let conn = Connection::connect_with(
        &dialer,
        &addr.to_string(),
        &ConnectOptions {
            max_unsent_bytes: 1024,
            ..ConnectOptions::default()
        },
    )
    .await
    .expect("connect");
    switch.set(WriteState::Stall);
    let call = || Call {
        service_entry_id: "t.Echo.echo".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&"x".repeat(4096)).expect("encode"),
        ..Default::default()
    };
    // The first call's frame fills the queue (its write stalls); the second waits for room.
    let deadline = Some(tokio::time::Instant::now() + Duration::from_secs(600));
    let mut first = Box::pin(conn.call(call(), deadline));
    assert!(
        futures_util::poll!(&mut first).is_pending(),
        "the first call is queued"
    );
    let mut second = Box::pin(conn.call(call(), deadline));
    assert!(
        futures_util::poll!(&mut second).is_pending(),
        "the second call waits for room"
    );
    // The writer's write of the first call stalls (bounded: the writer runs at the first
    // scheduler round on this one-thread runtime).
    for _ in 0..100 {
        if switch.stalled() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(switch.stalled(), "the writer is writing the first call");
    assert!(
        futures_util::poll!(&mut second).is_pending(),
        "still no room"
    );
    switch.set(WriteState::Fail);
    let e = within("the waiting call", second)
        .await
        .expect_err("not sent: the writer stopped");
    assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
    assert!(
        !e.is_maybe_delivered(),
        "never written, so never delivered: {e}"
    );
}

/// What the writer of a [`SwitchedDialer`]'s connections does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum WriteState {
    /// Writes go to the socket.
    Pass,
    /// Writes wait.
    Stall,
    /// Writes fail (`BrokenPipe`).
    Fail,
}

/// The state of a [`SwitchedDialer`]'s writers and the waker of a stalled write.
struct WriteSwitch(std::sync::Mutex<(WriteState, Option<std::task::Waker>)>);

impl Default for WriteSwitch {
    fn default() -> Self {
        WriteSwitch(std::sync::Mutex::new((WriteState::Pass, None)))
    }
}

impl WriteSwitch {
    fn set(&self, state: WriteState) {
        let mut s = self.0.lock().expect("switch");
        s.0 = state;
        if let Some(w) = s.1.take() {
            w.wake();
        }
    }

    /// Whether a write waits on the switch.
    fn stalled(&self) -> bool {
        self.0.lock().expect("switch").1.is_some()
    }

    /// `None`: pass the write on; else what the write returns.
    fn poll(&self, cx: &mut std::task::Context<'_>) -> Option<Poll<std::io::Result<usize>>> {
        let mut s = self.0.lock().expect("switch");
        match s.0 {
            WriteState::Pass => None,
            WriteState::Stall => {
                s.1 = Some(cx.waker().clone());
                Some(Poll::Pending)
            }
            WriteState::Fail => Some(Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))),
        }
    }
}

/// Dials TCP; its connections' writers do what the switch says.
struct SwitchedDialer(Arc<WriteSwitch>);

impl Dialer for SwitchedDialer {
    type Stream = Switched<TcpStream>;

    async fn dial(&self, addr: &str) -> std::io::Result<(Switched<TcpStream>, PeerAddr)> {
        let (stream, peer) = TcpDialer.dial(addr).await?;
        Ok((Switched(stream, self.0.clone()), peer))
    }
}

/// An I/O object whose writes obey a [`WriteSwitch`]: a TCP stream, then its writing half.
struct Switched<T>(T, Arc<WriteSwitch>);

impl Stream for Switched<TcpStream> {
    type Reader = tokio::net::tcp::OwnedReadHalf;
    type Writer = Switched<tokio::net::tcp::OwnedWriteHalf>;

    fn into_split(self) -> (Self::Reader, Self::Writer) {
        let (rd, wr) = self.0.into_split();
        (rd, Switched(wr, self.1))
    }
}

impl Abortive for Switched<tokio::net::tcp::OwnedWriteHalf> {}

impl<T: AsyncWrite + Unpin> AsyncWrite for Switched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(p) = self.1.poll(cx) {
            return p;
        }
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl AsyncRead for Switched<TcpStream> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}
