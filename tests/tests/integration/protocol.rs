//! Conformance with `proto/rpc.proto`, spoken by hand: frames built from the proto alone,
//! MessagePack built byte by byte, pipelined calls answered out of order, Ping/Pong, Cancel.

use crate::common;

use std::sync::Arc;

use bytes::Bytes;
use common::{recv_one, within, DropSignal, RawConn};
use rpc::crates::core::wire::{frame::Kind, Cancel, Hello, Ping, RemoteInvokeMessage};
use rpc::{Client, InProcessRegistry, RpcError, Server, ServerHandle};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, Semaphore};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Point {
    x: i32,
    y: i32,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Oops {
    Bad { code: u32 },
    Worse,
    Rpc(String),
}

impl From<RpcError> for Oops {
    fn from(e: RpcError) -> Self {
        Oops::Rpc(e.to_string())
    }
}

#[rpc::service(name = "t.Proto")]
trait Proto {
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    async fn flip(&self, p: Point) -> Result<Point, RpcError>;
    async fn fail(&self, worse: bool) -> Result<(), Oops>;
    /// Reports entry, then waits for a permit the test hands out.
    async fn hold(&self, tag: String) -> Result<String, RpcError>;
}

struct Impl {
    entered: mpsc::UnboundedSender<String>,
    dropped: mpsc::UnboundedSender<String>,
    release: Semaphore,
}

impl Proto for Impl {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
    async fn flip(&self, p: Point) -> Result<Point, RpcError> {
        Ok(Point { x: p.y, y: p.x })
    }
    async fn fail(&self, worse: bool) -> Result<(), Oops> {
        Err(if worse {
            Oops::Worse
        } else {
            Oops::Bad { code: 5 }
        })
    }
    async fn hold(&self, tag: String) -> Result<String, RpcError> {
        let _guard = DropSignal::new(tag.clone(), self.dropped.clone());
        let _ = self.entered.send(tag.clone());
        self.release
            .acquire()
            .await
            .map_err(|_| RpcError::business("closed"))?
            .forget();
        Ok(tag)
    }
}

struct Setup {
    server: ServerHandle,
    imp: Arc<Impl>,
    entered: mpsc::UnboundedReceiver<String>,
    dropped: mpsc::UnboundedReceiver<String>,
    reg: InProcessRegistry,
}

/// A raw connection, past its handshake, with call `id` of `hold` (its MessagePack arguments
/// `args`) running in the server's handler.
async fn holding(s: &mut Setup, id: u64, args: &'static [u8]) -> RawConn {
    let mut raw = RawConn::connect(s.server.local_addr()).await;
    raw.handshake().await;
    raw.send(invoke(id, "hold", args)).await.expect("send");
    recv_one("hold entered", &mut s.entered).await;
    raw
}

async fn setup() -> Setup {
    setup_with(Server::builder()).await
}

/// [`setup`] on a server built from `builder` (with a meter, say).
async fn setup_with(builder: rpc::ServerBuilder) -> Setup {
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let (dropped_tx, dropped) = mpsc::unbounded_channel();
    let imp = Arc::new(Impl {
        entered: entered_tx,
        dropped: dropped_tx,
        release: Semaphore::new(0),
    });
    let reg = InProcessRegistry::new();
    let server = builder
        .registry(reg.clone())
        .add_service(ProtoServer::from_arc(imp.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    Setup {
        server,
        imp,
        entered,
        dropped,
        reg,
    }
}

fn invoke(id: u64, method: &str, params: &'static [u8]) -> Kind {
    Kind::Invoke(RemoteInvokeMessage {
        message_id: id,
        service_entry_id: format!("t.Proto.{method}"),
        codec: 0,
        parameters: Bytes::from_static(params),
        ..Default::default()
    })
}

/// Receives frames until a result arrives; fails on anything else.
async fn result(raw: &mut RawConn) -> (u64, u32, Vec<u8>) {
    match raw.recv().await {
        Some(Kind::Result(r)) => (r.message_id, r.status_code, r.result.to_vec()),
        other => panic!("expected a result, got {other:?}"),
    }
}

#[tokio::test]
async fn a_hand_built_client_speaks_the_protocol_from_the_proto_and_msgpack_alone() {
    let s = setup().await;
    let mut raw = RawConn::connect(s.server.local_addr()).await;
    raw.send_by_hand(Kind::Hello(Hello {
        protocol_version: 1,
        token: String::new(),
        client_id: "by-hand".into(),
        ..Default::default()
    }))
    .await
    .expect("send");
    match raw.recv().await {
        Some(Kind::HelloAck(ack)) => {
            assert_eq!(ack.protocol_version, 1);
            assert_eq!(ack.max_frame_length, 16 * 1024 * 1024, "the default limit");
        }
        other => panic!("expected HelloAck, got {other:?}"),
    }
    // echo("hi"): the argument list ["hi"].
    raw.send_by_hand(invoke(1, "echo", &[0x91, 0xa2, b'h', b'i']))
        .await
        .expect("send");
    assert_eq!(result(&mut raw).await, (1, 200, vec![0xa2, b'h', b'i']));
    // flip({x: 1, y: 2}): structs are maps keyed by field name.
    raw.send_by_hand(invoke(
        2,
        "flip",
        &[0x91, 0x82, 0xa1, b'x', 0x01, 0xa1, b'y', 0x02],
    ))
    .await
    .expect("send");
    assert_eq!(
        result(&mut raw).await,
        (2, 200, vec![0x82, 0xa1, b'x', 0x02, 0xa1, b'y', 0x01])
    );
    // A typed error is status 1000 with the value in `result`: {"Bad": {"code": 5}}.
    raw.send_by_hand(invoke(3, "fail", &[0x91, 0xc2]))
        .await
        .expect("send");
    let mut bad = vec![0x81, 0xa3, b'B', b'a', b'd', 0x81, 0xa4];
    bad.extend_from_slice(b"code");
    bad.push(0x05);
    assert_eq!(result(&mut raw).await, (3, 1000, bad));
    // A unit variant is its name as a string.
    raw.send_by_hand(invoke(4, "fail", &[0x91, 0xc3]))
        .await
        .expect("send");
    let mut worse = vec![0xa5];
    worse.extend_from_slice(b"Worse");
    assert_eq!(result(&mut raw).await, (4, 1000, worse));
    // Ping is answered with the same nonce.
    raw.send_by_hand(Kind::Ping(Ping { nonce: 77 }))
        .await
        .expect("send");
    match raw.recv().await {
        Some(Kind::Pong(p)) => assert_eq!(p.nonce, 77),
        other => panic!("expected Pong, got {other:?}"),
    }
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn pipelined_calls_are_answered_out_of_order_by_message_id() {
    let mut s = setup().await;
    // hold("s") first, echo("e") second, without waiting in between.
    let mut raw = holding(&mut s, 10, &[0x91, 0xa1, b's']).await;
    raw.send(invoke(11, "echo", &[0x91, 0xa1, b'e']))
        .await
        .expect("send");
    assert_eq!(
        result(&mut raw).await,
        (11, 200, vec![0xa1, b'e']),
        "the quick one first"
    );
    s.imp.release.add_permits(1);
    assert_eq!(result(&mut raw).await, (10, 200, vec![0xa1, b's']));
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn cancel_drops_the_handler_and_no_answer_follows() {
    let mut s = setup().await;
    let mut raw = holding(&mut s, 5, &[0x91, 0xa1, b'c']).await;
    raw.send(Kind::Cancel(Cancel {
        message_id: 5,
        ..Default::default()
    }))
    .await
    .expect("send");
    assert_eq!(recv_one("handler dropped", &mut s.dropped).await, "c");
    // A Cancel for an id that is not running is ignored.
    raw.send(Kind::Cancel(Cancel {
        message_id: 999,
        ..Default::default()
    }))
    .await
    .expect("send");
    // The connection goes on, and nothing was sent for the cancelled call.
    raw.send(invoke(6, "echo", &[0x91, 0xa1, b'n']))
        .await
        .expect("send");
    assert_eq!(result(&mut raw).await, (6, 200, vec![0xa1, b'n']));
    raw.send(Kind::Ping(Ping { nonce: 1 })).await.expect("send");
    assert!(matches!(raw.recv().await, Some(Kind::Pong(_))));
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_slow_call_does_not_hold_up_others_on_the_same_client() {
    let mut s = setup().await;
    let proxy = ProtoClient::new(Client::builder().registry(s.reg.clone()).build());
    let slow = tokio::spawn({
        let proxy = proxy.clone();
        async move { proxy.hold("slow".into()).await }
    });
    recv_one("slow call entered", &mut s.entered).await;
    for i in 0..10 {
        assert_eq!(
            within("quick call", proxy.echo(format!("q{i}")))
                .await
                .expect("echo"),
            format!("q{i}")
        );
    }
    assert!(!slow.is_finished());
    s.imp.release.add_permits(1);
    assert_eq!(
        within("slow call", slow)
            .await
            .expect("join")
            .expect("hold"),
        "slow"
    );
    assert_eq!(
        proxy.fail(true).await,
        Err(Oops::Worse),
        "typed unit variant through the proxy"
    );
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_draining_server_says_go_away_refuses_new_calls_and_finishes_old_ones() {
    let mut s = setup().await;
    let mut raw = holding(&mut s, 1, &[0x91, 0xa1, b'd']).await;

    let shutdown = tokio::spawn(s.server.shutdown());
    let g = raw.expect_go_away().await;
    assert_eq!(g.status_code, 200, "a normal drain: {g:?}");
    assert!(!g.last, "a call is still to be answered: {g:?}");
    // A call sent after GoAway is answered at once and not run.
    raw.send(invoke(2, "echo", &[0x91, 0xa1, b'x']))
        .await
        .expect("send");
    match raw.recv().await {
        Some(Kind::Result(r)) => {
            assert_eq!(r.message_id, 2);
            assert_eq!(r.status_code, 506, "{r:?}");
            assert!(r.exception_message.contains("did not run"), "{r:?}");
        }
        other => panic!("expected a refusal of call 2, got {other:?}"),
    }
    assert!(!shutdown.is_finished(), "the drain waits for call 1");
    // The call in flight finishes and is answered, then the server says it has answered every
    // call it read, and closes.
    s.imp.release.add_permits(1);
    assert_eq!(result(&mut raw).await, (1, 200, vec![0xa1, b'd']));
    raw.expect_drained().await;
    within("shutdown", shutdown).await.expect("join");
}

/// Calls a connection answers itself, before any entry sees them, are counted on the server
/// in `rpc.server.refused` by why (a duplicate id, too many attachments, a stream on a
/// connection that did not negotiate streams, an entry the server does not have), and not as
/// calls of an entry; a call that reached its entry but could not be read (an unknown codec)
/// is counted with the entry's calls.
#[tokio::test]
async fn calls_refused_before_an_entry_are_counted_by_why() {
    use common::otel::{counter, Meters};
    let meters = Meters::new();
    let mut s = setup_with(Server::builder().meter(meters.meter.clone())).await;
    let mut observed = common::observe_server_calls(&s.server.status());
    // Id 5 is in flight while the next call reuses it.
    let mut raw = holding(&mut s, 5, &[0x91, 0xa1, b'h']).await;
    raw.send(invoke(5, "echo", &[0x91, 0xa1, b'x']))
        .await
        .expect("send");
    let too_many = (0..65)
        .map(|i| (format!("k{i}"), "v".to_string()))
        .collect();
    let refused = [
        Kind::Invoke(RemoteInvokeMessage {
            message_id: 6,
            service_entry_id: "t.Proto.echo".into(),
            parameters: Bytes::from_static(&[0x91, 0xa1, b'x']),
            attachments: too_many,
            ..Default::default()
        }),
        Kind::Invoke(RemoteInvokeMessage {
            message_id: 7,
            service_entry_id: "t.Proto.echo".into(),
            parameters: Bytes::from_static(&[0x91, 0xa1, b'x']),
            stream_mode: rpc::crates::core::wire::StreamMode::Server as i32,
            ..Default::default()
        }),
        invoke(8, "nope", &[0x90]),
        // An entry of the server's, with a codec it does not know: counted with its calls.
        Kind::Invoke(RemoteInvokeMessage {
            message_id: 9,
            service_entry_id: "t.Proto.echo".into(),
            codec: 7,
            parameters: Bytes::from_static(&[0x91, 0xa1, b'x']),
            ..Default::default()
        }),
    ];
    for frame in refused {
        raw.send(frame).await.expect("send");
    }
    let mut answered: Vec<(u64, u32)> = Vec::new();
    for _ in 0..5 {
        let (id, status, _) = result(&mut raw).await;
        answered.push((id, status));
    }
    answered.sort_unstable();
    assert_eq!(answered, [(5, 500), (6, 500), (7, 500), (8, 507), (9, 500)]);
    s.imp.release.add_permits(1);
    assert_eq!(result(&mut raw).await, (5, 200, vec![0xa1, b'h']));

    let m = meters.read();
    let refused = |why: &str, status: i64| {
        counter(
            &m,
            "rpc.server.refused",
            &[
                ("rpc.refusal", why.to_string().into()),
                ("rpc.status_code", opentelemetry::Value::I64(status)),
            ],
        )
    };
    assert_eq!(refused("duplicate_id", 500), 1);
    assert_eq!(refused("attachments", 500), 1);
    assert_eq!(refused("streams_not_negotiated", 500), 1);
    assert_eq!(refused("unknown_entry", 507), 1);
    assert_eq!(counter(&m, "rpc.server.refused", &[]), 4);
    assert_eq!(
        counter(&m, "rpc.server.calls", &[]),
        2,
        "only the calls that reached their entry: the held one, and the unknown codec"
    );
    // The call observers (the admin's metrics, the console) hear of the same two.
    let mut calls = Vec::new();
    for _ in 0..2 {
        calls.push(
            within("a call record", observed.recv())
                .await
                .expect("record"),
        );
    }
    calls.sort_by_key(|(_, status, _)| status.map(|s| s.as_u32()));
    assert_eq!(
        calls,
        [
            (
                "t.Proto.hold".to_string(),
                Some(rpc::StatusCode::Success),
                "success".to_string()
            ),
            (
                "t.Proto.echo".to_string(),
                Some(rpc::StatusCode::FrameworkError),
                "error".to_string()
            ),
        ]
    );
    assert!(observed.try_recv().is_err(), "no other call is recorded");
    assert_eq!(
        counter(
            &m,
            "rpc.server.calls",
            &[("rpc.status_code", opentelemetry::Value::I64(500))]
        ),
        1
    );
    within("shutdown", s.server.shutdown()).await;
}
