//! Bad input on the wire: oversized frames, garbage, a wrong first frame, a wrong version, no
//! `Hello` at all. The offending connection gets a `GoAway` with the reason and is closed; the
//! server keeps serving everyone else.

use crate::common;

use std::time::Duration;

use common::{within, RawConn};
use prost::Message;
use rpc::crates::core::wire::{frame::Kind, Frame, GoAway, Hello, Ping, RemoteInvokeMessage};
use rpc::{
    Client, Codec, InProcessRegistry, RpcError, Server, ServerBuilder, ServerHandle, StatusCode,
};

#[rpc::service(name = "t.Wire")]
trait Wire {
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

struct Echo;

impl Wire for Echo {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
}

const MAX: usize = 1024;

/// A server accepting frames up to [`MAX`] bytes, and a normal client of it.
async fn setup() -> (ServerHandle, WireClient) {
    let (server, client, _) = serving(|b| b.max_frame_length(MAX)).await;
    assert_eq!(client.echo("before".into()).await.expect("echo"), "before");
    (server, client)
}

/// The normal client still gets answers (on its existing connection).
async fn still_serving(client: &WireClient) {
    assert_eq!(
        within("echo after the fault", client.echo("after".into()))
            .await
            .expect("the server keeps serving other connections"),
        "after"
    );
}

/// A fresh raw connection to `server`, its handshake done when `hello`.
async fn raw_to(server: &ServerHandle, hello: bool) -> RawConn {
    let mut raw = RawConn::connect(server.local_addr()).await;
    if hello {
        raw.handshake().await;
    }
    raw
}

/// The `GoAway` `raw` gets, its reason naming each of `names`, once the server has closed the
/// connection.
async fn goes_away(raw: &mut RawConn, names: &[&str]) -> GoAway {
    let g = raw.expect_go_away().await;
    for name in names {
        assert!(g.reason.contains(name), "{name:?}: {g:?}");
    }
    raw.expect_closed().await;
    g
}

/// An echo server configured by `configure` on a fresh in-process registry, and a client of
/// it.
async fn serving(
    configure: impl FnOnce(ServerBuilder) -> ServerBuilder,
) -> (ServerHandle, WireClient, InProcessRegistry) {
    let reg = InProcessRegistry::new();
    let server = configure(Server::builder().registry(reg.clone()))
        .add_service(WireServer::new(Echo))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = WireClient::new(Client::builder().registry(reg.clone()).build());
    (server, client, reg)
}

fn echo_invoke(id: u64, text: &str) -> RemoteInvokeMessage {
    RemoteInvokeMessage {
        message_id: id,
        service_entry_id: "t.Wire.echo".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&(text,)).expect("encode"),
        ..Default::default()
    }
}

#[tokio::test]
async fn oversized_prefix_after_hello_gets_go_away_naming_the_size_and_is_closed() {
    let (server, client) = setup().await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    let ack = raw.handshake().await;
    assert_eq!(ack.protocol_version, 1);
    assert_eq!(
        ack.max_frame_length as usize, MAX,
        "HelloAck tells the limit"
    );

    // Only the prefix: the server must refuse before any payload arrives.
    raw.send_bytes(&1_000_000u32.to_be_bytes())
        .await
        .expect("send prefix");
    // The reason names the size and the limit.
    let g = goes_away(&mut raw, &["1000000", &MAX.to_string()]).await;
    assert_ne!(g.status_code, StatusCode::Success.as_u32(), "{g:?}");
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_frame_of_exactly_the_maximum_is_accepted_and_one_byte_more_is_not() {
    let (server, client) = setup().await;
    // Find a text whose invoke frame is exactly MAX bytes long.
    let text = (0..MAX)
        .map(|n| "x".repeat(n))
        .find(|t| {
            Frame {
                kind: Some(Kind::Invoke(echo_invoke(1, t))),
            }
            .encoded_len()
                == MAX
        })
        .expect("some text length gives a frame of exactly MAX bytes");

    let mut raw = raw_to(&server, true).await;
    raw.send(Kind::Invoke(echo_invoke(1, &text)))
        .await
        .expect("send");
    match raw.recv().await {
        Some(Kind::Result(r)) => {
            assert_eq!(r.status_code, 200, "{r:?}");
            assert_eq!(r.message_id, 1);
            let back: String = Codec::MsgPack.decode(&r.result).expect("decode");
            assert_eq!(back, text);
        }
        other => panic!("a frame of exactly {MAX} bytes must be served, got {other:?}"),
    }

    raw.send(Kind::Invoke(echo_invoke(2, &format!("{text}y"))))
        .await
        .expect("send");
    goes_away(&mut raw, &[&(MAX + 1).to_string()]).await;
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

/// A frame within the length limit whose repeated field holds more entries than any frame
/// needs (empty stream items, two bytes each on the wire, which decoding would give 32 bytes
/// each) is refused before it is decoded: that connection gets a GoAway saying so, and the
/// server serves the others. Before, the server allocated 16 times the frame for it.
#[tokio::test]
async fn a_frame_of_too_many_repeated_entries_is_refused_before_decoding() {
    use rpc::crates::core::wire::StreamItems;
    let (server, client, _reg) = serving(|b| b).await;
    let mut raw = raw_to(&server, true).await;
    let entries = 1 << 16;
    raw.send(Kind::StreamItems(StreamItems {
        message_id: 1,
        payloads: vec![Default::default(); entries + 1],
        ..Default::default()
    }))
    .await
    .expect("send");
    goes_away(
        &mut raw,
        &["malformed", &format!("more than {entries} entries")],
    )
    .await;
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn garbage_after_hello_closes_only_that_connection() {
    let (server, client) = setup().await;
    for garbage in [
        &[0u8, 0, 0, 5, 0xff, 0xff, 0xff, 0xff, 0xff][..],
        // A valid length and an empty `Frame`: no message inside.
        &[0u8, 0, 0, 0][..],
    ] {
        let mut raw = raw_to(&server, true).await;
        raw.send_bytes(garbage).await.expect("send garbage");
        goes_away(&mut raw, &["malformed"]).await;
        still_serving(&client).await;
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn garbage_instead_of_hello_closes_only_that_connection() {
    let (server, client) = setup().await;
    // An HTTP request: its first four bytes read as a length of about 1.2 GB.
    let mut raw = raw_to(&server, false).await;
    raw.send_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("send");
    goes_away(&mut raw, &["exceeds"]).await;
    still_serving(&client).await;

    // A short frame that is not protobuf.
    let mut raw = raw_to(&server, false).await;
    raw.send_bytes(&[0, 0, 0, 4, 0xde, 0xad, 0xbe, 0xef])
        .await
        .expect("send");
    goes_away(&mut raw, &["malformed"]).await;
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_first_frame_other_than_hello_is_refused() {
    let (server, client) = setup().await;
    let mut raw = raw_to(&server, false).await;
    raw.send(Kind::Ping(Ping { nonce: 1 })).await.expect("send");
    goes_away(&mut raw, &["Hello", "Ping"]).await;

    // An invoke before the handshake is not run either.
    let mut raw = raw_to(&server, false).await;
    raw.send(Kind::Invoke(echo_invoke(1, "sneaky")))
        .await
        .expect("send");
    goes_away(&mut raw, &["Hello"]).await;
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn an_unsupported_protocol_version_is_refused_with_the_reason() {
    let (server, client) = setup().await;
    let mut raw = raw_to(&server, false).await;
    raw.send(Kind::Hello(Hello {
        protocol_version: 2,
        token: String::new(),
        client_id: "future".into(),
        ..Default::default()
    }))
    .await
    .expect("send");
    let g = goes_away(&mut raw, &["version 2"]).await;
    assert_eq!(g.status_code, StatusCode::FrameworkError.as_u32(), "{g:?}");
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_protocol_violation_after_the_handshake_closes_the_connection() {
    let (server, client) = setup().await;
    let mut raw = raw_to(&server, true).await;
    // A second Hello is not something a client sends after the handshake.
    raw.send(Kind::Hello(Hello {
        protocol_version: 1,
        ..Default::default()
    }))
    .await
    .expect("send");
    goes_away(&mut raw, &["protocol violation"]).await;
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_silent_connection_is_closed_after_the_handshake_timeout() {
    let (server, client, _) = serving(|b| b.handshake_timeout(Duration::from_millis(150))).await;
    // A real socket that says nothing: observed until the server gives up on it.
    let mut raw = raw_to(&server, false).await;
    let g = goes_away(&mut raw, &["150 ms"]).await;
    assert_eq!(g.status_code, StatusCode::Timeout.as_u32(), "{g:?}");
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}

/// How the connection of [`pending_after_go_away`] ends.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// The client closes it.
    ClientCloses,
    /// The server resets it.
    ServerResets,
}

/// A call read by a raw server that then says GoAway 200 (`last` or not) and, once the client
/// has read it, the connection's end as `ending` says: the call's error.
async fn pending_after_go_away(last: bool, ending: Ending) -> RpcError {
    use rpc::crates::transport::{Call, ConnectOptions, Connection};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (read_tx, read_rx) = tokio::sync::oneshot::channel();
    let (reset_tx, reset_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut peer, _) = RawConn::accept_with(&listener, Default::default()).await;
        let call = peer.recv_invoke("the call").await;
        // Read, running, and now draining: GoAway 200, the answer still to come (`last`:
        // every call read was answered, and none is read any more).
        peer.send(Kind::GoAway(GoAway {
            status_code: 200,
            reason: "server shutting down".into(),
            last,
        }))
        .await
        .expect("GoAway");
        let _ = read_tx.send(call.message_id);
        if reset_rx.await.is_ok() {
            peer.reset();
            return;
        }
        // Held open until the client closes.
        while peer.recv().await.is_some() {}
    });
    let conn = Connection::connect(&addr.to_string(), &ConnectOptions::default())
        .await
        .expect("connect");
    let pending = {
        let conn = conn.clone();
        tokio::spawn(async move {
            conn.call(
                Call {
                    service_entry_id: "t.Wire.echo".into(),
                    codec: Codec::MsgPack.to_wire(),
                    parameters: Codec::MsgPack.encode(&("x",)).expect("encode"),
                    ..Default::default()
                },
                None,
            )
            .await
        })
    };
    within("the server read the call", read_rx)
        .await
        .expect("read");
    for _ in 0..10_000 {
        if conn.is_draining() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(conn.is_draining(), "the client saw the GoAway");
    match ending {
        Ending::ClientCloses => conn.close(),
        Ending::ServerResets => reset_tx.send(()).expect("the server waits"),
    }
    let e = within("the pending call", pending)
        .await
        .expect("join")
        .expect_err("the connection ended");
    server.abort();
    e
}

/// A call pending on a connection whose server said GoAway 200 (draining, it answers every
/// call it read) is "maybe delivered" when the client closes the connection itself: the server
/// read it and may be running it, so it must not be sent elsewhere as if it never arrived.
#[tokio::test]
async fn a_call_pending_when_the_client_closes_a_draining_connection_may_have_been_delivered() {
    let e = pending_after_go_away(false, Ending::ClientCloses).await;
    assert!(e.is_maybe_delivered(), "the server read it: {e}");
}

/// After the server's last word (GoAway 200 with `last`: every call it read was answered, it
/// reads no more), a call still pending was never read, however the connection ends then
/// (closed by the client, or reset by the server): it is not delivered, and may go to another
/// endpoint. Before, an end other than the server's orderly close made it maybe delivered.
#[tokio::test]
async fn a_call_pending_after_the_servers_last_word_was_not_delivered_however_the_connection_ends()
{
    for ending in [Ending::ClientCloses, Ending::ServerResets] {
        let e = pending_after_go_away(true, ending).await;
        assert_eq!(e.code(), StatusCode::CommunicationError, "{ending:?}: {e}");
        assert!(!e.is_maybe_delivered(), "{ending:?}: {e}");
    }
}

/// A server answering the handshake in another protocol version is refused by the client,
/// with an error naming both versions, instead of being spoken to as if it spoke this one.
#[tokio::test]
async fn a_handshake_answered_in_another_protocol_version_is_refused() {
    use rpc::crates::core::wire::HelloAck;
    let e = connect_to_a_hello_answered_with(Kind::HelloAck(HelloAck {
        protocol_version: 2,
        server_id: "future".into(),
        ..Default::default()
    }))
    .await;
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message().contains("protocol version 2") && e.message().contains("speaks 1"),
        "{e}"
    );
    // Not the call's failure, nor the endpoint's health: a call goes on to another endpoint,
    // and no breaker counts it.
    assert!(e.is_unsupported_by_endpoint(), "{e}");
    assert!(!e.is_maybe_delivered(), "{e}");
}

/// The error of a client connecting to a raw server that answers its `Hello` with `answer`
/// (and then reads until the client closes).
async fn connect_to_a_hello_answered_with(answer: Kind) -> rpc::RpcError {
    use rpc::crates::transport::{ConnectOptions, Connection};
    let (listener, addr) = common::raw_listener().await;
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("accept");
        let mut peer = RawConn::from_stream(stream);
        assert!(matches!(peer.recv().await, Some(Kind::Hello(_))));
        peer.send(answer).await.expect("the answer");
        while peer.recv().await.is_some() {}
    });
    let Err(e) = within(
        "connect",
        Connection::connect(&addr.to_string(), &ConnectOptions::default()),
    )
    .await
    else {
        panic!("the handshake was taken");
    };
    within("the server sees the close", server)
        .await
        .expect("server");
    e
}

/// A server refusing the handshake itself (GoAway 500: a client id or version it does not
/// take) refused the connection, not a call: the error is a communication error of a call
/// never sent, which goes on to another endpoint, not a 500 the breaker would count against
/// the entry.
#[tokio::test]
async fn a_handshake_refused_by_the_server_is_a_connection_failure_of_a_call_never_sent() {
    use rpc::crates::core::wire::GoAway;
    let e = connect_to_a_hello_answered_with(Kind::GoAway(GoAway {
        status_code: StatusCode::FrameworkError.as_u32(),
        reason: "the client id is not one this server takes".into(),
        last: false,
    }))
    .await;
    assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
    assert!(!e.is_maybe_delivered(), "{e}");
    assert!(e.is_unsupported_by_endpoint(), "{e}");
    assert!(e.message().contains("client id is not one"), "{e}");
}

/// A server that answers the client's Hello with GoAway 200 is shutting down and took nothing:
/// the call fails over to another endpoint, and never comes back as an error of status 200.
#[tokio::test]
async fn a_hello_answered_by_a_shutdown_goaway_fails_over() {
    let (server, _, _) = serving(|b| b).await;
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let closing_addr = closing.local_addr().expect("addr");
    let shutting_down = tokio::spawn(async move {
        // Every connection: its Hello answered GoAway 200, as a server shutting down does.
        for _ in 0..20 {
            let Ok(Ok((stream, _))) = tokio::time::timeout(common::LIMIT, closing.accept()).await
            else {
                return;
            };
            let mut peer = RawConn::from_stream(stream);
            if let Some(Kind::Hello(_)) = peer.recv().await {
                let _ = peer
                    .send(Kind::GoAway(GoAway {
                        status_code: 200,
                        reason: "server shutting down".into(),
                        last: true,
                    }))
                    .await;
            }
        }
    });
    let list = format!("{closing_addr},{}", server.local_addr());
    let client = WireClient::new(
        Client::builder()
            .registry(rpc::StaticRegistry::from_list(&list).expect("list"))
            .build(),
    );
    for i in 0..4 {
        let echoed = within("a call", client.echo(format!("x{i}")))
            .await
            .unwrap_or_else(|e| panic!("call {i}: {e} ({:?})", e.code()));
        assert_eq!(echoed, format!("x{i}"));
    }
    shutting_down.abort();
    within("shutdown", server.shutdown()).await;
}

/// A connection still in its handshake when the server shuts down is closed at once (it has
/// no call to finish): the shutdown does not wait out its handshake timeout.
#[tokio::test(start_paused = true)]
async fn a_connection_in_its_handshake_does_not_hold_up_the_shutdown() {
    let (server, _, _) = serving(|b| {
        b.handshake_timeout(Duration::from_secs(30))
            .drain_timeout(Duration::from_secs(2))
    })
    .await;
    let mut raw = raw_to(&server, false).await;
    let started = tokio::time::Instant::now();
    let stopping = tokio::spawn(server.shutdown());
    let g = goes_away(&mut raw, &["shutting down"]).await;
    assert_eq!(g.status_code, StatusCode::Success.as_u32(), "{g:?}");
    within("shutdown", stopping).await.expect("shutdown");
    // Held until the drain's deadline, it would end the shutdown at 2 s exactly.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the shutdown took {:?}: it waited for the drain's deadline of 2 s",
        started.elapsed()
    );
}

#[tokio::test]
async fn an_answer_above_the_clients_limit_fails_the_call_clearly_and_the_client_recovers() {
    let (server, _, reg) = serving(|b| b).await;
    let client = WireClient::new(
        Client::builder()
            .registry(reg)
            .max_frame_length(256)
            .override_options(WireClient::SERVICE_ID, common::no_retry())
            .build(),
    );
    let fits = within("answer below the limit", client.echo("z".repeat(200))).await;
    assert!(fits.is_ok(), "a 200-byte answer fits: {fits:?}");
    let err = within("oversized answer", client.echo("z".repeat(1000)))
        .await
        .expect_err("a 1000-byte answer exceeds the client's 256-byte limit");
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(
        err.message()
            .contains("this client's max_frame_length of 256"),
        "{err}"
    );
    // The broken connection is replaced on the next call.
    assert_eq!(
        within("echo after", client.echo("small".into()))
            .await
            .expect("next call reconnects"),
        "small"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn one_connection_over_the_limit_is_refused_with_the_reason() {
    let (server, first, reg) = serving(|b| b.max_connections(1)).await;
    assert_eq!(first.echo("one".into()).await.expect("first"), "one");

    // A raw second connection is told why before it is closed.
    let mut raw = raw_to(&server, false).await;
    let g = goes_away(&mut raw, &["maximum of 1"]).await;
    assert_eq!(
        g.status_code,
        StatusCode::OverflowMaxServerHandle.as_u32(),
        "{g:?}"
    );

    // A second client gets the refusal as its error.
    let second = WireClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(WireClient::SERVICE_ID, common::no_retry())
            .build(),
    );
    let err = within("refused client", second.echo("two".into()))
        .await
        .expect_err("over the connection limit");
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert!(err.message().contains("maximum of 1"), "{err}");

    // The first client is unaffected.
    assert_eq!(first.echo("still".into()).await.expect("first"), "still");
    within("shutdown", server.shutdown()).await;
}

/// A client that reuses a `message_id` while the first call still runs gets a 500 for the second
/// and loses nothing: the first call is answered, and a later graceful shutdown does not wait the
/// whole drain timeout for a call that is not running (the server once overwrote the first
/// call's entry, lost its answer and leaked its in-flight count).
///
/// The first call is held inside its handler (it waits on a channel the test controls) when the
/// duplicate arrives, so the duplicate meets a call that really is in flight.
#[tokio::test(start_paused = true)]
async fn a_reused_message_id_does_not_stall_a_later_graceful_shutdown() {
    #[rpc::service(name = "t.Held")]
    trait Held {
        async fn hold(&self, text: String) -> Result<String, RpcError>;
    }
    /// Says when a call entered its handler, then waits for the test's go.
    struct Gate {
        entered: tokio::sync::mpsc::UnboundedSender<String>,
        go: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<()>>,
    }
    impl Held for Gate {
        async fn hold(&self, text: String) -> Result<String, RpcError> {
            let _ = self.entered.send(text.clone());
            self.go.lock().await.recv().await;
            Ok(text)
        }
    }
    let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel();
    let (go, go_rx) = tokio::sync::mpsc::unbounded_channel();
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .drain_timeout(Duration::from_secs(30))
        .add_service(HeldServer::new(Gate {
            entered: entered_tx,
            go: tokio::sync::Mutex::new(go_rx),
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let hold_invoke = |id: u64, text: &str| RemoteInvokeMessage {
        message_id: id,
        service_entry_id: "t.Held.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&(text,)).expect("encode"),
        ..Default::default()
    };
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    raw.send(Kind::Invoke(hold_invoke(5, "first")))
        .await
        .expect("send");
    assert_eq!(
        common::recv_one("the first call entered its handler", &mut entered).await,
        "first"
    );
    // A protocol violation: the same id again while the first call is held in its handler.
    raw.send(Kind::Invoke(hold_invoke(5, "second")))
        .await
        .expect("send");
    match raw.recv().await {
        Some(Kind::Result(r)) => {
            assert_eq!(r.message_id, 5);
            assert_eq!(r.status_code, StatusCode::FrameworkError.as_u32(), "{r:?}");
            assert!(
                r.exception_message
                    .contains("message_id 5 is already in flight"),
                "{r:?}"
            );
        }
        other => panic!("expected the duplicate's refusal, got {other:?}"),
    }
    // The duplicate never ran.
    assert!(entered.try_recv().is_err(), "the duplicate ran its handler");
    // The first call is still there: released, it answers with its own result.
    go.send(()).expect("release the first call");
    match raw.recv().await {
        Some(Kind::Result(r)) => {
            assert_eq!(r.message_id, 5);
            assert_eq!(r.status_code, StatusCode::Success.as_u32(), "{r:?}");
            let text: String = Codec::MsgPack.decode(&r.result).expect("decode");
            assert_eq!(text, "first", "the first call's answer");
        }
        other => panic!("expected the first call's answer, got {other:?}"),
    }
    // Nothing else follows: the connection answers a ping next.
    raw.send(Kind::Ping(Ping { nonce: 1 })).await.expect("send");
    match raw.recv().await {
        Some(Kind::Pong(p)) => assert_eq!(p.nonce, 1),
        other => panic!("expected a pong, got {other:?}"),
    }
    // Nothing runs, so draining must not wait for the 30 s drain limit (it lingers half a
    // second for the connected client). On the paused clock a leaked in-flight count would
    // end the shutdown at the limit exactly.
    let started = tokio::time::Instant::now();
    server.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "shutdown waited {:?} for a call that is not running: the server's in-flight count \
         leaked",
        started.elapsed()
    );
}

/// Before its `Hello` is accepted a peer gets a few KiB of the server's memory, not a frame of
/// the full limit: a length prefix above `MAX_HELLO_FRAME` is refused at once, with nothing of
/// the payload read, while a `Hello` carrying a token of several KiB is still accepted.
#[tokio::test]
async fn a_frame_larger_than_a_few_kib_before_hello_is_refused_at_its_prefix() {
    let limit = rpc::crates::transport::MAX_HELLO_FRAME;
    assert_eq!(limit, 8 * 1024);
    // The default frame limit, 16 MiB: far above what a peer may send before its Hello.
    let (server, client, _) = serving(|b| b).await;

    // Only the prefix, announcing 1 MiB: the server answers without waiting for the payload.
    let mut raw = raw_to(&server, false).await;
    raw.send_bytes(&(1u32 << 20).to_be_bytes())
        .await
        .expect("send");
    let names = ["a frame of 1048576 bytes before the handshake exceeds the limit of 8192"];
    goes_away(&mut raw, &names).await;

    // One byte over the limit is refused as well; a Hello of about 6 KiB is accepted.
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.send_bytes(&((limit + 1) as u32).to_be_bytes())
        .await
        .expect("send");
    let g = raw.expect_go_away().await;
    assert!(g.reason.contains("exceeds the limit of 8192"), "{g:?}");
    let mut raw = RawConn::connect(server.local_addr()).await;
    match raw.hello(&"t".repeat(6 * 1024)).await {
        Some(Kind::HelloAck(_)) => {}
        other => panic!("expected HelloAck, got {other:?}"),
    }
    // After the handshake the full limit applies again.
    let big = "x".repeat(64 * 1024);
    raw.send(Kind::Invoke(echo_invoke(1, &big)))
        .await
        .expect("send");
    match raw.recv().await {
        Some(Kind::Result(r)) => assert_eq!((r.message_id, r.status_code), (1, 200), "{r:?}"),
        other => panic!("expected a result, got {other:?}"),
    }
    still_serving(&client).await;
    within("shutdown", server.shutdown()).await;
}
