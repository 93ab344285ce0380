//! Per-connection limits, each tested with a misbehaving raw TCP client: calls running at once
//! on one connection, attachments per call (count and bytes), slow loris (a frame dribbled a
//! byte at a time, before and after the handshake). Refused calls are answered at once
//! and never run; other connections are served as before.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::{within, RawConn};
use rpc::crates::core::wire::{
    frame::Kind, Frame, GoAway, Hello, RemoteInvokeMessage, RemoteResultMessage,
};
use rpc::crates::transport::FrameCodec;
use rpc::{Client, Codec, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode};

#[rpc::service(name = "t.Limits")]
trait Limits {
    async fn hold(&self, text: String) -> Result<String, RpcError>;
}

/// Holds every call until the gate opens; counts the calls that ran.
struct Gate {
    open: tokio::sync::Semaphore,
    ran: AtomicU32,
}

impl Limits for Gate {
    async fn hold(&self, text: String) -> Result<String, RpcError> {
        self.ran.fetch_add(1, Ordering::SeqCst);
        let _pass = self.open.acquire().await;
        Ok(text)
    }
}

/// A gate with `permits` passes open.
fn gate(permits: usize) -> Arc<Gate> {
    Arc::new(Gate {
        open: tokio::sync::Semaphore::new(permits),
        ran: AtomicU32::new(0),
    })
}

/// A server from [`setup`] and a raw connection to it past the handshake.
async fn connected(gate: Arc<Gate>) -> (ServerHandle, InProcessRegistry, RawConn) {
    let (server, reg) = setup(gate).await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    (server, reg, raw)
}

/// A server from [`setup`] and a connection of the transport's own to it.
async fn connected_directly(gate: Arc<Gate>) -> (ServerHandle, rpc::crates::transport::Connection) {
    use rpc::crates::transport::{ConnectOptions, Connection};
    let (server, _reg) = setup(gate).await;
    let conn = within(
        "connect",
        Connection::connect(&server.local_addr().to_string(), &ConnectOptions::default()),
    )
    .await
    .expect("connect");
    (server, conn)
}

/// One attachment more than [`setup`] allows.
fn five_attachments() -> BTreeMap<String, String> {
    (0..5).map(|i| (format!("k{i}"), "v".into())).collect()
}

/// A well-behaved client of the registry's server is served.
async fn still_served(reg: InProcessRegistry) {
    let client = LimitsClient::new(Client::builder().registry(reg).build());
    assert_eq!(
        within("a well-behaved call", client.hold("ok".into()))
            .await
            .expect("served"),
        "ok"
    );
}

async fn setup(gate: Arc<Gate>) -> (ServerHandle, InProcessRegistry) {
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .max_concurrency(1000)
        .max_in_flight_per_connection(3)
        .max_attachments(4, 64)
        .add_service(LimitsServer::from_arc(gate))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (server, reg)
}

fn invoke(id: u64, attachments: BTreeMap<String, String>) -> Kind {
    Kind::Invoke(RemoteInvokeMessage {
        message_id: id,
        service_entry_id: "t.Limits.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&("x",)).expect("encode"),
        attachments,
        ..Default::default()
    })
}

/// The next answer; the server's `Ping`s before it (sent while it does not read) are passed.
async fn answer(raw: &mut RawConn) -> RemoteResultMessage {
    loop {
        match within("an answer", raw.recv()).await {
            Some(Kind::Result(r)) => return r,
            Some(Kind::Ping(_)) => continue,
            other => panic!("expected a result, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn calls_over_the_connections_limit_are_refused_at_once_and_others_are_served() {
    let gate = gate(0);
    let (server, reg, mut raw) = connected(gate.clone()).await;
    for id in 1..=5 {
        raw.send(invoke(id, BTreeMap::new())).await.expect("send");
    }
    // Ids 4 and 5 are refused while 1..3 are held.
    let mut refused = Vec::new();
    for _ in 0..2 {
        let r = answer(&mut raw).await;
        assert_eq!(r.status_code, 515, "{r:?}");
        assert!(r.exception_message.contains("per connection"), "{r:?}");
        refused.push(r.message_id);
    }
    refused.sort_unstable();
    assert_eq!(refused, [4, 5]);
    assert_eq!(
        gate.ran.load(Ordering::SeqCst),
        3,
        "refused calls never ran"
    );

    // Another connection is not affected by this one's limit.
    let other = LimitsClient::new(Client::builder().registry(reg).build());
    let call = tokio::spawn(async move { other.hold("other".into()).await });
    gate.open.add_permits(100);
    assert_eq!(
        within("other client", call)
            .await
            .expect("join")
            .expect("served"),
        "other"
    );
    let mut ok = Vec::new();
    for _ in 0..3 {
        let r = answer(&mut raw).await;
        assert_eq!(r.status_code, 200, "{r:?}");
        ok.push(r.message_id);
    }
    ok.sort_unstable();
    assert_eq!(ok, [1, 2, 3]);
    server.shutdown().await;
}

#[tokio::test]
async fn too_many_or_too_large_attachments_are_refused_and_not_run() {
    let gate = gate(1000);
    let (server, _reg, mut raw) = connected(gate.clone()).await;

    let many = five_attachments();
    raw.send(invoke(1, many)).await.expect("send");
    let r = answer(&mut raw).await;
    assert_eq!((r.message_id, r.status_code), (1, 500), "{r:?}");
    assert!(
        r.exception_message
            .contains("5 attachments exceed the limit of 4"),
        "{r:?}"
    );

    let large = BTreeMap::from([("k".to_string(), "v".repeat(64))]);
    raw.send(invoke(2, large)).await.expect("send");
    let r = answer(&mut raw).await;
    assert_eq!((r.message_id, r.status_code), (2, 500), "{r:?}");
    assert!(
        r.exception_message
            .contains("65 bytes exceed the limit of 64"),
        "{r:?}"
    );
    assert_eq!(
        gate.ran.load(Ordering::SeqCst),
        0,
        "refused calls never ran"
    );

    // Within the limits the same connection is served.
    let fine = BTreeMap::from([("tenant".to_string(), "acme".to_string())]);
    raw.send(invoke(3, fine)).await.expect("send");
    let r = answer(&mut raw).await;
    assert_eq!(
        (r.message_id, r.status_code),
        (3, StatusCode::Success.as_u32()),
        "{r:?}"
    );
    assert_eq!(gate.ran.load(Ordering::SeqCst), 1);
    server.shutdown().await;
}

/// Slow loris: a client that keeps a connection busy by sending one byte of a frame at a time,
/// never completing it. Only complete frames count as traffic, so the dribbler is closed at the
/// idle timeout (or at the handshake timeout, before `Hello` is complete) however steadily its
/// bytes arrive, and the server serves everyone else meanwhile.
/// Returns the bytes dribbled before the server closed, the bytes the whole frame would have
/// needed, and the server's `GoAway`.
async fn dribble_until_closed(
    addr: std::net::SocketAddr,
    handshake: bool,
) -> (usize, usize, GoAway) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = within("connect", tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    let mut hello = bytes::BytesMut::new();
    FrameCodec::encode_kind(
        Kind::Hello(Hello {
            protocol_version: 1,
            token: String::new(),
            client_id: "slow-loris".into(),
            ..Default::default()
        }),
        &mut hello,
    );
    let mut call = bytes::BytesMut::new();
    FrameCodec::encode_kind(invoke(1, BTreeMap::new()), &mut call);
    let mut sent = 0usize;
    if handshake {
        wr.write_all(&hello).await.expect("hello");
    }
    let partial = if handshake { call } else { hello };
    let whole = partial.len();
    // The attack: one byte every 20 ms, never the last one. Bounded: the frame has at most a
    // few dozen bytes, the loop stops when the server closes.
    let dribbler = tokio::spawn(async move {
        for byte in &partial[..partial.len() - 1] {
            if wr.write_all(&[*byte]).await.is_err() {
                break;
            }
            sent += 1;
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        (sent, wr)
    });
    let mut received = Vec::new();
    within(
        "the server closes the dribbling connection",
        rd.read_to_end(&mut received),
    )
    .await
    .expect("read until closed");
    let (sent, _wr) = dribbler.await.expect("dribbler");
    // Everything the server sent: HelloAck (after a complete Hello), then its GoAway.
    let mut frames = Vec::new();
    let mut rest = &received[..];
    while rest.len() >= 4 {
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let frame = <Frame as prost::Message>::decode(&rest[4..4 + len]).expect("a Frame");
        frames.push(frame.kind.expect("a kind"));
        rest = &rest[4 + len..];
    }
    match frames.pop() {
        Some(Kind::GoAway(g)) => (sent, whole, g),
        other => panic!("expected a GoAway last, got {other:?} after {frames:?}"),
    }
}

// The paused clock: the dribble and the timeout run in virtual time.
#[tokio::test(start_paused = true)]
async fn a_slow_loris_is_closed_at_the_idle_timeout_and_others_are_served() {
    let gate = gate(1000);
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .idle_timeout(std::time::Duration::from_millis(150))
        .add_service(LimitsServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let (sent, whole, g) = dribble_until_closed(server.local_addr(), true).await;
    assert!(g.reason.contains("idle for 150 ms"), "{g:?}");
    // Bytes kept arriving, more often than the idle timeout, and did not keep the connection:
    // it was closed before the frame could have been complete.
    assert!(
        sent >= 2 && sent < whole - 1,
        "dribbled {sent} of {whole} bytes"
    );
    assert_eq!(
        gate.ran.load(Ordering::SeqCst),
        0,
        "the partial call never ran"
    );
    still_served(reg).await;
    server.shutdown().await;
}

/// A peer with a call in flight that starts a large frame (one taking a share of the server's
/// read budget) and stops sending is closed at the idle timeout all the same: the share it
/// holds is one others wait for.
#[tokio::test(start_paused = true)]
async fn a_large_frame_left_unfinished_is_closed_at_the_idle_timeout_even_with_a_call_running() {
    let gate = gate(0);
    let server = Server::builder()
        .idle_timeout(std::time::Duration::from_millis(150))
        .add_service(LimitsServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    raw.send(invoke(1, BTreeMap::new()))
        .await
        .expect("a held call");
    // Wait until the call runs (it holds until the gate opens, which it never does here).
    yield_until("the call runs", || gate.ran.load(Ordering::SeqCst) == 1).await;
    // Half of a 256 KiB frame, announced whole; the rest never comes.
    let mut large = bytes::BytesMut::new();
    FrameCodec::encode_kind(
        Kind::Invoke(RemoteInvokeMessage {
            message_id: 2,
            service_entry_id: "t.Limits.hold".into(),
            codec: Codec::MsgPack.to_wire(),
            parameters: Codec::MsgPack
                .encode(&("x".repeat(256 * 1024),))
                .expect("encode"),
            ..Default::default()
        }),
        &mut large,
    );
    raw.send_bytes(&large[..large.len() / 2])
        .await
        .expect("half a frame");
    let g = loop {
        match within("the GoAway", raw.recv()).await {
            Some(Kind::GoAway(g)) => break g,
            Some(_) => continue,
            None => panic!("closed without a GoAway"),
        }
    };
    assert!(g.reason.contains("idle for 150 ms"), "{g:?}");
    // A call was running: not the clean close of a connection with nothing in flight.
    assert_eq!(g.status_code, 500, "{g:?}");
    gate.open.add_permits(1);
    server.shutdown().await;
}

// The paused clock: the dribble and the timeout run in virtual time.
#[tokio::test(start_paused = true)]
async fn a_slow_hello_is_closed_at_the_handshake_timeout() {
    let gate = gate(1000);
    let server = Server::builder()
        .handshake_timeout(std::time::Duration::from_millis(150))
        .add_service(LimitsServer::from_arc(gate))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let (sent, whole, g) = dribble_until_closed(server.local_addr(), false).await;
    assert_eq!(g.status_code, StatusCode::Timeout.as_u32(), "{g:?}");
    assert!(g.reason.contains("150 ms"), "{g:?}");
    assert!(
        sent >= 2 && sent < whole - 1,
        "dribbled {sent} of {whole} bytes"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn a_connection_that_keeps_breaking_the_attachment_limits_is_closed() {
    let gate = gate(1000);
    let (server, reg, mut raw) = connected(gate.clone()).await;
    let many = five_attachments();
    let limit = rpc::crates::transport::ABUSE_LIMIT as u64;
    for id in 1..=limit + 5 {
        raw.send(invoke(id, many.clone())).await.expect("send");
    }
    // Each is answered 500 until the limit is passed; then the connection is closed.
    for id in 1..=limit + 1 {
        let r = answer(&mut raw).await;
        assert_eq!((r.message_id, r.status_code), (id, 500), "{r:?}");
    }
    let g = raw.expect_go_away().await;
    assert!(g.reason.contains("broke the attachment limits"), "{g:?}");
    raw.expect_closed().await;
    assert_eq!(gate.ran.load(Ordering::SeqCst), 0, "none of them ran");
    still_served(reg).await;
    server.shutdown().await;
}

/// Calls breaking the attachment limits are counted in a row: a connection that sends a
/// good call between them (a client multiplexing many callers, a few of them oversized) is
/// not closed, and its other calls go on.
#[tokio::test]
async fn attachment_limit_breaks_between_good_calls_do_not_close_the_connection() {
    let gate = gate(1000);
    let (server, _reg, mut raw) = connected(gate.clone()).await;
    let many = five_attachments();
    let limit = rpc::crates::transport::ABUSE_LIMIT as u64;
    let mut id = 0;
    for _ in 0..3 {
        for _ in 0..limit {
            id += 1;
            raw.send(invoke(id, many.clone())).await.expect("send");
            let r = answer(&mut raw).await;
            assert_eq!((r.message_id, r.status_code), (id, 500), "{r:?}");
        }
        id += 1;
        raw.send(invoke(id, BTreeMap::new())).await.expect("send");
        let r = answer(&mut raw).await;
        assert_eq!((r.message_id, r.status_code), (id, 200), "{r:?}");
    }
    assert_eq!(gate.ran.load(Ordering::SeqCst), 3, "the good calls ran");
    server.shutdown().await;
}

/// The server says its attachment limits in the handshake, and a client of the framework fails
/// a call over them itself, sending nothing: however many such calls a client multiplexing
/// many callers makes (a gateway forwarding its callers' headers), the server never holds
/// them against the connection, which goes on serving the other calls. Before, the calls
/// were sent and refused 500, and the connection closed after `ABUSE_LIMIT` of them in a row,
/// failing every call on it. The retry depth, sent as an attachment the server takes apart
/// before it counts, does not count (before, the client counted it, and refused a call the
/// server would have served). The failure is a validation error (1001) marked as the
/// endpoint's inability to serve the call.
#[tokio::test]
async fn a_client_fails_calls_over_the_servers_attachment_limits_without_sending_them() {
    use rpc::crates::transport::Call;
    let gate = gate(1000);
    let (server, conn) = connected_directly(gate.clone()).await;
    let call = |attachments: BTreeMap<String, String>, retry_depth: u32| Call {
        service_entry_id: "t.Limits.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&("x",)).expect("encode"),
        attachments,
        retry_depth,
        ..Default::default()
    };
    let four: BTreeMap<String, String> = (0..4).map(|i| (format!("k{i}"), "v".into())).collect();
    let limit = rpc::crates::transport::ABUSE_LIMIT;
    for (attachments, depth, says) in [
        (
            five_attachments(),
            0,
            "5 attachments, over the server's limit of 4",
        ),
        (
            five_attachments(),
            1,
            "5 attachments, over the server's limit of 4",
        ),
        (
            BTreeMap::from([("k".to_string(), "v".repeat(64))]),
            0,
            "attachments of 65 bytes, over the server's limit of 64",
        ),
    ] {
        for _ in 0..=limit + 1 {
            let e = within(
                "the call",
                conn.call(call(attachments.clone(), depth), None),
            )
            .await
            .expect_err("over the limits");
            // (The call's own fault, and this endpoint's inability to serve it: no breaker
            // or health count, and another endpoint may take it.)
            assert_eq!(e.code(), StatusCode::ValidateError, "{e}");
            assert!(e.is_unsupported_by_endpoint(), "{e}");
            assert!(
                e.message().contains(says) && e.message().contains("not sent"),
                "{e}"
            );
        }
    }
    // Within the limits, the same connection serves: four attachments and the retry depth
    // are within a limit of four, as the server counts them.
    for depth in [0, 7] {
        let r = within("a good call", conn.call(call(four.clone(), depth), None))
            .await
            .expect("served");
        assert_eq!(r.status_code, 200, "{r:?}");
    }
    assert_eq!(
        gate.ran.load(Ordering::SeqCst),
        2,
        "only the good calls ran"
    );
    server.shutdown().await;
}

/// Waits of `Duration::MAX` (meant as no limit) are no limit: the handshake is taken, and a
/// shutdown drains a call in flight until it ends. Added to the present they overflowed the
/// clock, and every connection task panicked.
#[tokio::test]
async fn waits_of_duration_max_are_no_limit() {
    let gate = gate(0);
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .handshake_timeout(std::time::Duration::MAX)
        .drain_timeout(std::time::Duration::MAX)
        .add_service(LimitsServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = LimitsClient::new(Client::builder().registry(reg).build());
    let call = tokio::spawn(async move { client.hold("held".into()).await });
    yield_until("the call runs", || gate.ran.load(Ordering::SeqCst) == 1).await;
    let status = server.status();
    let shutdown = tokio::spawn(async move { server.shutdown().await });
    // The drain has begun; the call ends only once the gate opens.
    yield_until("the server drains", || status.is_draining()).await;
    tokio::task::yield_now().await;
    assert!(!shutdown.is_finished(), "the drain waits for the call");
    gate.open.add_permits(1);
    assert_eq!(
        within("the drained call", call)
            .await
            .expect("join")
            .expect("answered"),
        "held"
    );
    within("the shutdown", shutdown).await.expect("join");
}

/// An idle timeout of 0 turns the idle close off: a connection idle for an hour between calls
/// is served. As a wait of 0 it closed every connection right after its handshake.
#[tokio::test(start_paused = true)]
async fn an_idle_timeout_of_zero_turns_the_idle_close_off() {
    let server = Server::builder()
        .idle_timeout(std::time::Duration::ZERO)
        .add_service(LimitsServer::from_arc(gate(1000)))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    for id in 1..=3 {
        tokio::time::advance(std::time::Duration::from_secs(3600)).await;
        raw.send(invoke(id, BTreeMap::new())).await.expect("send");
        let r = answer(&mut raw).await;
        assert_eq!((r.message_id, r.status_code), (id, 200), "{r:?}");
    }
    server.shutdown().await;
}

/// A connection limit past what the server's semaphore can count (`usize::MAX`, meant as no
/// limit) is no limit: the server serves instead of losing its accept task at start.
#[tokio::test]
async fn a_connection_limit_of_usize_max_is_no_limit() {
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .max_connections(usize::MAX)
        .add_service(LimitsServer::from_arc(gate(1)))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    still_served(reg).await;
    server.shutdown().await;
}

/// An answer longer than the client's own frame limit fails the call with the client's limit
/// named, and where to raise it: not as a bad frame of the server's (before: "bad frame from
/// the server", and the user looked for a fault in a server that had done nothing wrong).
#[tokio::test]
async fn an_answer_over_the_clients_frame_limit_names_the_clients_setting() {
    use rpc::crates::transport::{Call, ConnectOptions, Connection};
    let server = Server::builder()
        .add_service(LimitsServer::from_arc(gate(1)))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let options = ConnectOptions {
        max_frame_length: 1024,
        ..ConnectOptions::default()
    };
    let conn = within(
        "connect",
        Connection::connect(&server.local_addr().to_string(), &options),
    )
    .await
    .expect("connect");
    let call = Call {
        service_entry_id: "t.Limits.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&("x".repeat(4096),)).expect("encode"),
        ..Default::default()
    };
    let e = within("the call", conn.call(call, None))
        .await
        .expect_err("the answer is over the client's limit");
    assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
    assert!(
        e.message()
            .contains("this client's max_frame_length of 1024")
            && !e.message().contains("bad frame from the server"),
        "{e}"
    );
    server.shutdown().await;
}

/// A call whose frame is longer than the server reads (it says its limit in the handshake)
/// fails at the client, unsent, and the connection goes on serving: sent, it would have made
/// the server close the connection and fail every other call on it.
#[tokio::test]
async fn a_client_fails_a_call_over_the_servers_frame_limit_without_sending_it() {
    use rpc::crates::transport::{Call, ConnectOptions, Connection};
    const LIMIT: usize = 64 * 1024;
    let gate = gate(0);
    let server = Server::builder()
        .max_frame_length(LIMIT)
        .add_service(LimitsServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let conn = within(
        "connect",
        Connection::connect(&server.local_addr().to_string(), &ConnectOptions::default()),
    )
    .await
    .expect("connect");
    let call = |text: String| Call {
        service_entry_id: "t.Limits.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&(text,)).expect("encode"),
        ..Default::default()
    };
    // A call running on the connection while the oversized one is tried.
    let held = tokio::spawn({
        let conn = conn.clone();
        async move { conn.call(call("held".into()), None).await }
    });
    yield_until("the held call runs", || {
        gate.ran.load(Ordering::SeqCst) == 1
    })
    .await;
    let e = within("the large call", conn.call(call("x".repeat(100_000)), None))
        .await
        .expect_err("over the frame limit");
    assert_eq!(e.code(), StatusCode::ValidateError, "{e}");
    assert!(e.is_unsupported_by_endpoint(), "{e}");
    assert!(
        e.message()
            .contains(&format!("over the server's limit of {LIMIT}"))
            && e.message().contains("not sent"),
        "{e}"
    );
    gate.open.add_permits(2);
    let r = within("the held call", held)
        .await
        .expect("joined")
        .expect("the held call is answered");
    assert_eq!(r.status_code, 200, "{r:?}");
    // A call just within the limit goes through on the same connection.
    let r = within(
        "a call within the limit",
        conn.call(call("y".repeat(60_000)), None),
    )
    .await
    .expect("served");
    assert_eq!(r.status_code, 200, "{r:?}");
    assert_eq!(
        gate.ran.load(Ordering::SeqCst),
        2,
        "the large call never ran"
    );
    server.shutdown().await;
}

/// A limit of 0 that would have the server refuse every client or every call is refused when
/// the server starts, naming the setting; the default starts.
#[tokio::test]
async fn limits_that_would_serve_nobody_are_refused_at_start() {
    let zero = std::time::Duration::ZERO;
    let cases: [(&str, rpc::ServerBuilder); 4] = [
        (
            "max_in_flight_per_connection",
            Server::builder().max_in_flight_per_connection(0),
        ),
        ("max_connections", Server::builder().max_connections(0)),
        ("max_frame_length", Server::builder().max_frame_length(0)),
        (
            "handshake_timeout",
            Server::builder().handshake_timeout(zero),
        ),
    ];
    for (setting, builder) in cases {
        let started = builder
            .add_service(LimitsServer::from_arc(gate(1)))
            .serve("127.0.0.1:0")
            .await;
        let e = started
            .err()
            .unwrap_or_else(|| panic!("{setting} 0 started"));
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{setting}: {e}");
        assert!(e.to_string().starts_with(setting), "{setting}: {e}");
    }
    let server = Server::builder()
        .add_service(LimitsServer::from_arc(gate(1)))
        .serve("127.0.0.1:0")
        .await
        .expect("the defaults start");
    server.shutdown().await;
}

/// A call to an entry the server does not have, named by an id of a megabyte of control
/// characters (each quoted as six bytes): the answer names the entry by its first bytes and
/// its length, not by the whole id quoted, which would be six times the call.
#[tokio::test]
async fn an_unknown_entry_named_at_length_is_answered_briefly() {
    let (server, reg, mut raw) = connected(gate(1000)).await;
    let id = "\x7f".repeat(1 << 20);
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        message_id: 1,
        service_entry_id: id.clone(),
        codec: Codec::MsgPack.to_wire(),
        ..Default::default()
    }))
    .await
    .expect("send");
    let r = answer(&mut raw).await;
    assert_eq!(r.status_code, 507, "{:?}", r.exception_message);
    assert!(
        r.exception_message.len() < 4096,
        "{} bytes: {:.200}",
        r.exception_message.len(),
        r.exception_message
    );
    assert!(
        r.exception_message
            .contains(&format!("({} bytes in all)", id.len())),
        "{:.400}",
        r.exception_message
    );
    still_served(reg).await;
    server.shutdown().await;
}

/// Past `REFUSALS_BEFORE_PAUSE` refusals in a row the server stops reading the connection:
/// the calls behind wait unread, and are served once the held calls finish. (It reads again a
/// second later, at its keepalive, refusing up to that many more: on the paused clock, those
/// refusals are allowed for each second that passed, and no more.)
#[tokio::test(start_paused = true)]
async fn after_many_refusals_at_the_in_flight_limit_the_server_waits_for_a_call_to_finish() {
    let gate = gate(0);
    let (server, _reg, mut raw) = connected(gate.clone()).await;
    let t0 = tokio::time::Instant::now();
    // The limit is 3: three calls are held, then a hundred more arrive.
    let pause = u64::from(rpc::crates::transport::REFUSALS_BEFORE_PAUSE);
    let extra = pause + 36;
    for id in 1..=3 + extra {
        raw.send(invoke(id, BTreeMap::new())).await.expect("send");
    }
    // The first `pause` of them are refused at once...
    for _ in 0..pause {
        let r = answer(&mut raw).await;
        assert_eq!(r.status_code, 515, "{r:?}");
    }
    assert_eq!(gate.ran.load(Ordering::SeqCst), 3);
    // ...and the rest wait unread until the held calls finish; then they are served.
    gate.open.add_permits(1000);
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..3 + (extra - pause) {
        match answer(&mut raw).await.status_code {
            200 => ok += 1,
            515 => refused += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(ok + refused, 3 + extra - pause);
    let keepalives_passed = t0.elapsed().as_secs();
    assert!(
        refused <= pause * keepalives_passed,
        "{refused} refused after the pause, {keepalives_passed} s before the calls finished"
    );
    server.shutdown().await;
}

/// A connection paused at its in-flight limit (after `REFUSALS_BEFORE_PAUSE` refusals in a
/// row) pings its client, and reads again once a ping interval: the calls sent meanwhile are
/// refused (515), the limit being full still, the client's `Ping` is answered, and its `Cancel`
/// of a held call frees that call's slot for the next. Before, nothing was read until a running
/// call finished: a `Cancel`, which would have freed a slot, waited unread behind calls that
/// might never end (on the paused clock).
#[tokio::test(start_paused = true)]
async fn a_connection_paused_at_the_in_flight_limit_pings_and_reads_its_cancels() {
    let gate = gate(0);
    let (server, _reg, mut raw) = connected(gate.clone()).await;
    let pause = u64::from(rpc::crates::transport::REFUSALS_BEFORE_PAUSE);
    for id in 1..=3 + pause + 4 {
        raw.send(invoke(id, BTreeMap::new())).await.expect("send");
    }
    for _ in 0..pause {
        let r = within("a refusal", raw.recv()).await;
        assert!(
            matches!(&r, Some(Kind::Result(r)) if r.status_code == 515),
            "{r:?}"
        );
    }
    // Behind the four calls the server has not read: the client's Ping, and its Cancel of
    // the first held call.
    raw.send(Kind::Ping(rpc::crates::core::wire::Ping { nonce: 7 }))
        .await
        .expect("send");
    raw.send(Kind::Cancel(rpc::crates::core::wire::Cancel {
        message_id: 1,
        ..Default::default()
    }))
    .await
    .expect("send");
    let (mut refused, mut pong, mut pings) = (Vec::new(), false, 0);
    let began = tokio::time::Instant::now();
    while refused.len() < 4 || !pong {
        // A few ping intervals at most (the server pings every second while paused).
        assert!(
            began.elapsed() < std::time::Duration::from_secs(10),
            "after {pings} pings: refused {refused:?}, pong {pong}"
        );
        match within("the paused connection's answers", raw.recv()).await {
            Some(Kind::Ping(_)) => pings += 1,
            Some(Kind::Pong(p)) => pong = p.nonce == 7,
            Some(Kind::Result(r)) => {
                assert_eq!(r.status_code, 515, "{r:?}");
                refused.push(r.message_id);
            }
            other => panic!("expected pings, refusals and a pong, got {other:?}"),
        }
    }
    assert_eq!(refused, (3 + pause + 1..=3 + pause + 4).collect::<Vec<_>>());
    assert!(pings >= 1, "the server pinged while paused");
    assert_eq!(gate.ran.load(Ordering::SeqCst), 3, "no call more ran");
    // The cancelled call's slot takes the next call; the held calls and it are answered once
    // the gate opens, the cancelled one not.
    raw.send(invoke(100, BTreeMap::new())).await.expect("send");
    gate.open.add_permits(1000);
    let mut served = Vec::new();
    while served.len() < 3 {
        match within("answers", raw.recv()).await {
            Some(Kind::Result(r)) => {
                assert_eq!(r.status_code, 200, "{r:?}");
                served.push(r.message_id);
            }
            Some(Kind::Ping(_)) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    served.sort_unstable();
    assert_eq!(served, [2, 3, 100]);
    server.shutdown().await;
}

#[rpc::service(name = "t.Gone")]
trait Gone {
    /// An answer of `bytes` bytes.
    async fn big(&self, bytes: u32) -> Result<Vec<u8>, RpcError>;
    /// Never answers; says when it is dropped.
    async fn forever(&self) -> Result<(), RpcError>;
}

struct Vanishing {
    dropped: tokio::sync::mpsc::UnboundedSender<()>,
}

/// Sends on its channel when dropped.
struct OnDrop(tokio::sync::mpsc::UnboundedSender<()>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

impl Gone for Vanishing {
    async fn big(&self, bytes: u32) -> Result<Vec<u8>, RpcError> {
        Ok(vec![0; bytes as usize])
    }

    async fn forever(&self) -> Result<(), RpcError> {
        let _guard = OnDrop(self.dropped.clone());
        std::future::pending().await
    }
}

/// A `t.Gone` server (its builder's options set by `configure`), a raw client of it past the
/// handshake, and the channel told of each `forever` call dropped.
async fn vanishing(
    configure: impl FnOnce(rpc::ServerBuilder) -> rpc::ServerBuilder,
) -> (
    ServerHandle,
    RawConn,
    tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    let (dropped, handlers_dropped) = tokio::sync::mpsc::unbounded_channel();
    let server = configure(Server::builder())
        .add_service(GoneServer::new(Vanishing { dropped }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    (server, raw, handlers_dropped)
}

/// Call `id` of `t.Gone.<method>` with `args`.
fn gone(id: u64, method: &str, args: &impl serde::Serialize) -> Kind {
    Kind::Invoke(RemoteInvokeMessage {
        message_id: id,
        service_entry_id: format!("t.Gone.{method}"),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(args).expect("encode"),
        ..Default::default()
    })
}

/// A client reading a large answer slowly, and sending nothing meanwhile, is not idle: the
/// connection stays open until the answer is through, however longer than the idle timeout
/// that takes. Before, the reader (paused while the answer waited unwritten) saw no frame and
/// no call running, and closed the connection as idle, resetting it under the answer (on the
/// paused clock).
#[tokio::test(start_paused = true)]
async fn a_client_taking_a_large_answer_slowly_is_not_idle() {
    use tokio::io::AsyncReadExt;
    let (server, mut raw, _) = vanishing(|b| {
        b.max_unsent_bytes(1024)
            .idle_timeout(std::time::Duration::from_secs(1))
    })
    .await;
    // 12 MiB: more than the socket buffers of loopback hold, taken 256 KiB every 100 ms
    // (4.8 s, nearly five idle timeouts).
    let size = 12usize << 20;
    raw.send(gone(1, "big", &(size as u32,)))
        .await
        .expect("send");
    let mut stream = raw.into_stream();
    let mut chunk = vec![0u8; 256 << 10];
    let mut taken = 0;
    while taken < size {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let got = within("a chunk of the answer", stream.read_exact(&mut chunk)).await;
        if let Err(e) = got {
            panic!("the connection ended after {taken} bytes of the answer: {e}");
        }
        taken += chunk.len();
    }
    server.shutdown().await;
}

/// A client that vanishes (a reset) while the server waits for its answers to be written:
/// the write fails, and the connection ends with its calls, though the server no longer read
/// it (before, it waited for the write for ever: a call without a deadline kept it from
/// idling out, and the connection, its slot and its calls were held until shutdown).
#[tokio::test(start_paused = true)]
async fn a_client_that_vanishes_while_its_answers_wait_ends_its_connection_and_calls() {
    let (server, mut raw, mut handlers_dropped) = vanishing(|b| {
        b.max_unsent_bytes(1024)
            .idle_timeout(std::time::Duration::from_secs(1))
    })
    .await;
    raw.send(gone(1, "forever", &())).await.expect("send");
    // 12 MiB: more than the socket buffers of loopback hold, so the writer waits.
    raw.send(gone(2, "big", &(12u32 << 20,)))
        .await
        .expect("send");
    // The paused clock moves only once every task waits: the answer is queued and its write
    // blocked. The next frame the reader takes finds the backlog over the limit: it stops
    // reading.
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    raw.send(Kind::Ping(rpc::crates::core::wire::Ping { nonce: 1 }))
        .await
        .expect("send");
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    raw.reset();
    within("the held call is dropped", handlers_dropped.recv())
        .await
        .expect("a drop");
    server.shutdown().await;
}

/// A client reading slowly while the server drains: every call it sent is answered (run, or
/// "not run" for those read after the drain began), and only then does the connection close.
/// Before, the drain ended half a second after its last call finished, and the writer gave up
/// the answers still queued a second later: a clean close after them told the client that its
/// calls without an answer never reached the server, though they had run.
#[tokio::test(start_paused = true)]
async fn a_draining_server_writes_every_answer_to_a_slow_reader_before_it_closes() {
    let (server, mut raw, _) = vanishing(|b| b).await;
    let calls = 16u64;
    for id in 1..=calls {
        raw.send(gone(id, "big", &(1u32 << 20,)))
            .await
            .expect("send");
    }
    // Everything runs until it waits: answers fill the socket buffers, the rest is queued.
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    let shutdown = tokio::spawn(server.shutdown());
    // The client reads nothing for three seconds (of the drain's ten).
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let (mut answered, mut go_away) = (std::collections::BTreeSet::new(), false);
    while let Some(frame) = raw.recv().await {
        match frame {
            Kind::Result(r) => {
                assert!(answered.insert(r.message_id), "answered twice: {r:?}");
            }
            Kind::GoAway(g) => {
                assert_eq!(g.status_code, 200, "{g:?}");
                go_away = true;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(go_away, "the drain said GoAway");
    assert_eq!(answered, (1..=calls).collect(), "every call answered");
    within("shutdown", shutdown).await.expect("join");
}

#[tokio::test(start_paused = true)]
async fn a_client_that_never_reads_its_answers_is_no_longer_read() {
    let gate = gate(1 << 20);
    let server = Server::builder()
        .max_unsent_bytes(16 * 1024)
        .add_service(LimitsServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut stream = never_reading(server.local_addr()).await;
    let (sent, blocked) = flood(&mut stream).await;
    let ran = u64::from(gate.ran.load(Ordering::SeqCst));
    assert!(
        blocked,
        "the server read all {sent} calls of a client reading nothing"
    );
    assert!(ran < sent, "{ran} calls ran of {sent} sent");
    eprintln!("the server stopped reading after {ran} of {sent}+ calls");
    drop(stream);
    within("shutdown", server.shutdown()).await;
}

/// The same while the server drains: each call it reads then is answered "not run", and a
/// client reading none of those answers is no longer read either.
#[tokio::test(start_paused = true)]
async fn a_client_that_never_reads_is_no_longer_read_while_the_server_drains() {
    let gate = gate(0);
    let server = Server::builder()
        .max_unsent_bytes(16 * 1024)
        .drain_timeout(std::time::Duration::from_secs(600))
        .add_service(LimitsServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut stream = never_reading(server.local_addr()).await;
    // One call held: the drain lasts while it runs.
    let mut held = bytes::BytesMut::new();
    FrameCodec::encode_kind(invoke(u64::MAX, BTreeMap::new()), &mut held);
    tokio::io::AsyncWriteExt::write_all(&mut stream, &held)
        .await
        .expect("the held call");
    yield_until("the held call runs", || {
        gate.ran.load(Ordering::SeqCst) == 1
    })
    .await;
    let status = server.status();
    let shutdown = tokio::spawn(server.shutdown());
    yield_until("the server drains", || status.is_draining()).await;
    let (sent, blocked) = flood(&mut stream).await;
    assert!(
        blocked,
        "the draining server read all {sent} calls of a client reading nothing"
    );
    gate.open.add_permits(1);
    drop(stream);
    within("shutdown", shutdown).await.expect("shutdown");
}

/// Lets the other tasks run (at most 10 000 turns, no time passing) until `done` holds.
async fn yield_until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..10_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{what}: not within 10 000 turns");
}

/// A connection to `addr` past a `Hello` (no answer read), with a small receive buffer: a
/// client that reads nothing.
async fn never_reading(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stream = within("connect", socket.connect(addr))
        .await
        .expect("connect");
    let mut hello = bytes::BytesMut::new();
    FrameCodec::encode_kind(
        Kind::Hello(Hello {
            protocol_version: 1,
            token: String::new(),
            client_id: "never-reads".into(),
            ..Default::default()
        }),
        &mut hello,
    );
    stream.write_all(&hello).await.expect("hello");
    stream
}

/// Writes calls in chunks of 1 000 until a write no longer completes within a second (on the
/// paused clock: the second passes only once nothing else can run, the server reading
/// nothing more): the calls sent, and whether the writes stopped completing. Bounded: at most 2 000 chunks (2
/// million calls, about 90 MB); a server that kept reading would take them all.
async fn flood(stream: &mut tokio::net::TcpStream) -> (u64, bool) {
    use tokio::io::AsyncWriteExt;
    let mut chunk = bytes::BytesMut::new();
    for id in 0..1000 {
        FrameCodec::encode_kind(invoke(id, BTreeMap::new()), &mut chunk);
    }
    let mut sent = 0u64;
    for _ in 0..2000 {
        match tokio::time::timeout(std::time::Duration::from_secs(1), stream.write_all(&chunk))
            .await
        {
            Ok(r) => r.expect("write"),
            Err(_) => return (sent, true),
        }
        sent += 1000;
    }
    (sent, false)
}

/// After refusing a connection at `max_connections`, the server stops accepting for a moment
/// (connects wait in the kernel's queue instead of costing a refusal each), and accepts again
/// as soon as a connection slot frees. On the paused clock: the pause (50 ms) passes only if
/// nothing else wakes the server first.
#[tokio::test(start_paused = true)]
async fn after_a_refusal_at_the_connection_limit_a_freed_slot_is_taken_at_once() {
    let gate = gate(1000);
    let server = Server::builder()
        .max_connections(1)
        .add_service(LimitsServer::from_arc(gate))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut first = RawConn::connect(server.local_addr()).await;
    first.handshake().await;
    let mut refused = RawConn::connect(server.local_addr()).await;
    let g = refused.expect_go_away().await;
    assert_eq!(g.status_code, 515, "{g:?}");
    refused.expect_closed().await;
    // Connected at the TCP level (the kernel's accept queue), waiting for the server.
    let mut waiting = RawConn::connect(server.local_addr()).await;
    let freed = tokio::time::Instant::now();
    drop(first);
    // The freed slot ends the pause: the waiting connection is accepted and served, with no
    // time passing (the pause's end would be 50 ms on).
    let ack = waiting.handshake().await;
    assert_eq!(ack.protocol_version, 1);
    assert_eq!(
        freed.elapsed(),
        std::time::Duration::ZERO,
        "accepted at the pause's end"
    );
    server.shutdown().await;
}

/// A pool of two connections per endpoint to a server that takes one: the slot that cannot
/// connect leaves its turn's calls to the connection the other slot holds. Before, every
/// call whose turn fell on it waited for its connect and failed with it.
#[tokio::test]
async fn a_pool_slot_that_cannot_connect_leaves_its_turns_to_the_other_slot() {
    use rpc::crates::transport::{ConnectOptions, ConnectionPool};
    let server = Server::builder()
        .max_connections(1)
        .add_service(LimitsServer::from_arc(gate(1000)))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let addr = server.local_addr().to_string();
    let pool = ConnectionPool::new(ConnectOptions::default(), 2);
    let first = within("the first slot", pool.get(&addr))
        .await
        .expect("connected");
    for turn in 0..4 {
        let c = within("a turn", pool.get(&addr))
            .await
            .unwrap_or_else(|e| panic!("turn {turn}: {e}"));
        assert_eq!(
            c.id(),
            first.id(),
            "turn {turn}: the one connection there is"
        );
    }
    server.shutdown().await;
}

// The paused clock: the server's waits for the rate pass in virtual time, measured exactly.
#[tokio::test(start_paused = true)]
async fn a_connection_over_its_call_rate_is_read_no_faster_and_loses_nothing() {
    const RATE: u32 = 200;
    const CALLS: u64 = 100;
    let gate = gate(1000);
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .max_calls_per_second_per_connection(RATE)
        .add_service(LimitsServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    let started = tokio::time::Instant::now();
    for id in 1..=CALLS {
        raw.send(invoke(id, BTreeMap::new())).await.expect("send");
    }
    // Another connection has a rate of its own: served while this one waits.
    still_served(reg).await;
    let mut answered = Vec::new();
    for _ in 0..CALLS {
        let r = answer(&mut raw).await;
        assert_eq!(r.status_code, StatusCode::Success.as_u32(), "{r:?}");
        answered.push(r.message_id);
    }
    let elapsed = started.elapsed();
    answered.sort_unstable();
    assert_eq!(
        answered,
        (1..=CALLS).collect::<Vec<_>>(),
        "every call answered"
    );
    // A burst of a tenth of a second's calls, then one call per 1/RATE s.
    let burst = u64::from(RATE / 10);
    let least = std::time::Duration::from_secs_f64((CALLS - burst) as f64 / f64::from(RATE));
    assert!(
        elapsed >= least,
        "{CALLS} calls at {RATE}/s were all read in {elapsed:?}, less than {least:?}"
    );
    server.shutdown().await;
}

/// Calls `Connection::call` does not send: one asking for a stream (its slot could not take
/// the items; before, the server opened the stream and the call hung or lost them), and one
/// whose deadline passed before it was sent (before, it was sent and its Cancel could reach
/// the server first, which dropped it, and ran the call nobody waited for), nor a stream
/// opened past its deadline. The handler never runs for any, and the connection serves the
/// next call.
#[tokio::test]
async fn a_call_asking_for_a_stream_or_past_its_deadline_is_not_sent() {
    use rpc::crates::transport::Call;
    let gate = gate(1000);
    let (server, conn) = connected_directly(gate.clone()).await;
    let call = || Call {
        service_entry_id: "t.Limits.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&("x",)).expect("encode"),
        ..Default::default()
    };
    let streaming = Call {
        stream_mode: rpc::crates::core::StreamMode::Server as i32,
        ..call()
    };
    let e = within("the streaming call", conn.call(streaming, None))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(e.message().contains("open_stream"), "{e}");

    let past = tokio::time::Instant::now()
        .checked_sub(std::time::Duration::from_millis(50))
        .expect("a past instant");
    let e = within("the late call", conn.call(call(), Some(past)))
        .await
        .expect_err("timed out");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert!(e.message().contains("nothing was sent"), "{e}");
    let opened = conn.open_stream(call(), rpc::crates::core::StreamMode::Server, Some(past));
    match within("the late stream", opened).await {
        Err(e) => {
            assert_eq!(e.code(), StatusCode::Timeout, "{e}");
            assert!(e.message().contains("nothing was sent"), "{e}");
        }
        Ok(_) => panic!("a stream past its deadline was opened"),
    }

    // Answered in order on the connection: had either been sent, its handler ran first.
    let r = within("a good call", conn.call(call(), None))
        .await
        .expect("served");
    assert_eq!(r.status_code, 200, "{r:?}");
    assert_eq!(gate.ran.load(Ordering::SeqCst), 1, "only the good call ran");
    server.shutdown().await;
}
