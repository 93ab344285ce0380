//! Per-connection limits, each tested with a misbehaving raw TCP client: calls running at once
//! on one connection, attachments per call (count and bytes). Refused calls are answered at once
//! and never run; other connections are served as before.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::{within, RawConn};
use rpc::crates::core::wire::{frame::Kind, RemoteInvokeMessage, RemoteResultMessage};
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

async fn answer(raw: &mut RawConn) -> RemoteResultMessage {
    match within("an answer", raw.recv()).await {
        Some(Kind::Result(r)) => r,
        other => panic!("expected a result, got {other:?}"),
    }
}

#[tokio::test]
async fn calls_over_the_connections_limit_are_refused_at_once_and_others_are_served() {
    let gate = Arc::new(Gate {
        open: tokio::sync::Semaphore::new(0),
        ran: AtomicU32::new(0),
    });
    let (server, reg) = setup(gate.clone()).await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
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
    let gate = Arc::new(Gate {
        open: tokio::sync::Semaphore::new(1000),
        ran: AtomicU32::new(0),
    });
    let (server, _reg) = setup(gate.clone()).await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;

    let many: BTreeMap<String, String> = (0..5).map(|i| (format!("k{i}"), "v".into())).collect();
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
