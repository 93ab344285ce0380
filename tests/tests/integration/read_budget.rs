//! The server-wide read budget: frames larger than a connection's own 64 KiB buffer share one
//! budget of bytes. A frame that would need more than is left is not read (its connection
//! waits, TCP pushes back) until another large frame is complete; frames that fit in a
//! connection's buffer are not held back; a frame within the frame limit never waits for ever,
//! even when it is larger than what is left. Raw TCP peers send the frames by hand.
//!
//! The server reports, at debug level, each frame that waits for the budget: the test waits for
//! that event rather than for time to pass.

use crate::common;

use bytes::BytesMut;
use common::{recv_one, within, RawConn};
use rpc::crates::core::wire::{frame::Kind, RemoteInvokeMessage, RemoteResultMessage};
use rpc::crates::transport::FrameCodec;
use rpc::{Client, Codec, InProcessRegistry, RpcError, Server};
use tokio::sync::mpsc;

#[rpc::service(name = "t.Budget")]
trait Budget {
    async fn len(&self, text: String) -> Result<u64, RpcError>;
}

struct Len;

impl Budget for Len {
    async fn len(&self, text: String) -> Result<u64, RpcError> {
        Ok(text.len() as u64)
    }
}

/// The next logged line that contains `what`.
async fn logged(lines: &mut mpsc::UnboundedReceiver<String>, what: &str) -> String {
    within(what, async {
        loop {
            let line = recv_one(what, lines).await;
            if line.contains(what) {
                return line;
            }
        }
    })
    .await
}

/// One call to `len` with a text of `n` bytes, as a complete frame.
fn frame(id: u64, n: usize) -> Vec<u8> {
    let mut buf = BytesMut::new();
    FrameCodec::encode_kind(
        Kind::Invoke(RemoteInvokeMessage {
            message_id: id,
            service_entry_id: "t.Budget.len".into(),
            codec: Codec::MsgPack.to_wire(),
            parameters: Codec::MsgPack.encode(&("x".repeat(n),)).expect("encode"),
            ..Default::default()
        }),
        &mut buf,
    );
    buf.to_vec()
}

async fn answer(raw: &mut RawConn) -> RemoteResultMessage {
    match raw.recv().await {
        Some(Kind::Result(r)) => r,
        other => panic!("expected a result, got {other:?}"),
    }
}

fn length(r: &RemoteResultMessage) -> u64 {
    assert_eq!(r.status_code, 200, "{r:?}");
    Codec::MsgPack.decode(&r.result).expect("decode")
}

const KIB: usize = 1024;

/// A raw connection to `server` that sent half of a 200 KiB call (message id 1) and stalls:
/// it holds its share of the read budget while the rest is missing.
async fn half_a_frame(server: &rpc::ServerHandle) -> RawConn {
    let a = frame(1, 200 * KIB);
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    raw.send_bytes(&a[..a.len() / 2]).await.expect("send");
    raw
}

#[tokio::test]
async fn a_large_frame_over_the_budget_left_waits_unread_and_is_served_once_budget_frees() {
    let (mut lines, _guard) = common::log_lines(tracing::Level::TRACE);

    // Frames up to 256 KiB; 300 KiB of budget: one large frame of 200 KiB fits, two do not.
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .max_frame_length(256 * KIB)
        .max_read_buffer_bytes(300 * KIB)
        .add_service(BudgetServer::new(Len))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");

    // A: a 200 KiB frame, half of it sent. It holds its share while the rest is missing.
    let a = frame(1, 200 * KIB);
    let mut raw_a = half_a_frame(&server).await;
    let granted = logged(&mut lines, "read budget: frame granted").await;
    assert!(granted.contains(&format!("bytes={}", a.len())), "{granted}");

    // B: a complete 200 KiB frame, more than the 100 KiB left: it waits, unread.
    let b = frame(2, 200 * KIB);
    let mut raw_b = RawConn::connect(server.local_addr()).await;
    raw_b.handshake().await;
    raw_b.send_bytes(&b).await.expect("send");
    let waits = logged(&mut lines, "read budget exhausted").await;
    assert!(waits.contains(&format!("bytes={}", b.len())), "{waits}");

    // Frames that fit in a connection's own buffer are not held back meanwhile, on a new
    // connection nor on A's: a small call is served.
    let client = BudgetClient::new(Client::builder().registry(reg).build());
    assert_eq!(
        within("a small call", client.len("hi".into()))
            .await
            .expect("served"),
        2
    );

    // The rest of A: A is served, its share comes back, and B's frame is read and served.
    raw_a.send_bytes(&a[a.len() / 2..]).await.expect("send");
    let r = answer(&mut raw_a).await;
    assert_eq!((r.message_id, length(&r)), (1, 200 * KIB as u64));
    let granted = logged(&mut lines, "read budget: frame granted").await;
    assert!(granted.contains(&format!("bytes={}", b.len())), "{granted}");
    let r = answer(&mut raw_b).await;
    assert_eq!((r.message_id, length(&r)), (2, 200 * KIB as u64));

    // A frame of the maximum size (more than what is left while another frame holds a share)
    // is read too once that share is back: no frame within the limit waits for ever.
    let max_text = 256 * KIB - 64;
    let c = frame(3, max_text);
    assert!(c.len() <= 256 * KIB + 4, "{}", c.len());
    raw_a.send_bytes(&a[..a.len() / 2]).await.expect("send");
    raw_b.send_bytes(&c).await.expect("send");
    logged(&mut lines, "read budget exhausted").await;
    raw_a.send_bytes(&a[a.len() / 2..]).await.expect("send");
    let r = answer(&mut raw_a).await;
    assert_eq!((r.message_id, length(&r)), (1, 200 * KIB as u64));
    let r = answer(&mut raw_b).await;
    assert_eq!((r.message_id, length(&r)), (3, max_text as u64));
    within("shutdown", server.shutdown()).await;
}

/// A connection whose whole frame waits for the budget is not idle: the server holds its frame
/// back, not the client. It keeps its place until the budget frees (here when the peer holding
/// it, stalled half-way through a frame, is closed at its own idle timeout), then is served.
/// Before, it was closed as idle at its timeout, its frame dropped.
#[tokio::test(start_paused = true)]
async fn a_connection_waiting_for_the_budget_is_not_closed_as_idle() {
    let idle = std::time::Duration::from_secs(2);
    let server = Server::builder()
        .max_frame_length(256 * KIB)
        .max_read_buffer_bytes(256 * KIB)
        .idle_timeout(idle)
        .add_service(BudgetServer::new(Len))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    // B first: its idle timeout comes first.
    let mut raw_b = RawConn::connect(server.local_addr()).await;
    raw_b.handshake().await;
    tokio::time::sleep(idle / 4).await;
    // A takes the whole budget with half a frame, and stalls.
    let mut raw_a = half_a_frame(&server).await;
    // The paused clock moves on only once the server has read that and waits.
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    // B's whole frame waits for A's share, past B's idle timeout, until A's.
    raw_b.send_bytes(&frame(2, 200 * KIB)).await.expect("send");
    let r = answer(&mut raw_b).await;
    assert_eq!(length(&r), 200 * KIB as u64);
    let g = raw_a.expect_go_away().await;
    assert!(g.reason.contains("idle"), "{g:?}");
    within("shutdown", server.shutdown()).await;
}

/// A call whose large frame waits for a share of the budget longer than the client's
/// heartbeat window (three intervals of 10 s with nothing arriving) is kept: the server, which
/// holds the frame unread and answers nothing meanwhile, pings the client. Before, the client
/// took the connection for dead and failed the call as maybe delivered.
#[tokio::test(start_paused = true)]
async fn a_call_waiting_for_the_budget_outlives_the_clients_heartbeat() {
    use rpc::crates::transport::{Call, ConnectOptions, Connection};
    let server = Server::builder()
        .max_frame_length(256 * KIB)
        .max_read_buffer_bytes(256 * KIB)
        .add_service(BudgetServer::new(Len))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    // A takes the whole budget with half a frame, and stalls.
    let raw_a = half_a_frame(&server).await;
    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    let options = ConnectOptions::default();
    let window = options.heartbeat_interval * 3;
    let conn = Connection::connect(&server.local_addr().to_string(), &options)
        .await
        .expect("connect");
    let call = tokio::spawn(async move {
        conn.call(
            Call {
                service_entry_id: "t.Budget.len".into(),
                codec: Codec::MsgPack.to_wire(),
                parameters: Codec::MsgPack
                    .encode(&("x".repeat(200 * KIB),))
                    .expect("encode"),
                ..Default::default()
            },
            None,
        )
        .await
    });
    // Past the client's heartbeat window, the frame still held back.
    tokio::time::sleep(window + window / 2).await;
    assert!(!call.is_finished(), "the call waits for the budget");
    drop(raw_a);
    let r = within("the call", call)
        .await
        .expect("join")
        .expect("answered once the budget freed");
    assert_eq!(length(&r), 200 * KIB as u64);
    within("shutdown", server.shutdown()).await;
}
