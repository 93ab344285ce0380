//! Adaptive concurrency and load reports over TCP: with `adaptive_concurrency` on, a sheddable
//! call is refused (515) where a default one is admitted; a call with less budget than the
//! entry's calls take is refused at once; every answer reports the entry's calls in flight and
//! the limit in force.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{no_retry, recv_one, within, RawConn};
use rpc::crates::core::wire::{frame::Kind, RemoteInvokeMessage, RemoteResultMessage};
use rpc::{
    Client, GovernanceOverrides, InProcessRegistry, RpcContext, RpcError, Server, ServerHandle,
    StatusCode,
};
use tokio::sync::{mpsc, Semaphore};

/// The server's cap in these tests: the adaptive limit's maximum, above its initial value so
/// that an answer reporting the fixed cap is not taken for one reporting the adaptive limit.
const CAP: usize = 40;
/// The adaptive limit before any window was measured: its documented initial value (20),
/// within the cap.
const INITIAL: usize = if CAP < 20 { CAP } else { 20 };
/// Sheddable calls get 80 % of the limit.
const SHEDDABLE_SHARE: usize = INITIAL * 4 / 5;
/// What a `slow` call takes (on the paused clock).
const SLOW: Duration = Duration::from_secs(2);

#[rpc::service(name = "t.Adapt")]
trait Adapt {
    /// Waits for a permit the test hands out.
    async fn hold(&self) -> Result<u32, RpcError>;
    /// Answers at once.
    async fn quick(&self) -> Result<u32, RpcError>;
    /// Takes `SLOW`.
    async fn slow(&self) -> Result<u32, RpcError>;
}

struct Gate {
    entered: mpsc::UnboundedSender<()>,
    release: Semaphore,
    slow_ran: AtomicUsize,
}

impl Adapt for Gate {
    async fn hold(&self) -> Result<u32, RpcError> {
        let _ = self.entered.send(());
        common::let_through(&self.release).await?;
        Ok(1)
    }
    async fn quick(&self) -> Result<u32, RpcError> {
        Ok(2)
    }
    async fn slow(&self) -> Result<u32, RpcError> {
        self.slow_ran.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(SLOW).await;
        Ok(3)
    }
}

async fn serve(
    reg: &InProcessRegistry,
    adaptive: bool,
) -> (ServerHandle, Arc<Gate>, mpsc::UnboundedReceiver<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let gate = Arc::new(Gate {
        entered: tx,
        release: Semaphore::new(0),
        slow_ran: AtomicUsize::new(0),
    });
    let server = Server::builder()
        .registry(reg.clone())
        .max_concurrency(CAP)
        .adaptive_concurrency(adaptive)
        .add_service(AdaptServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (server, gate, rx)
}

fn client(reg: &InProcessRegistry, overrides: GovernanceOverrides) -> AdaptClient {
    AdaptClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(AdaptClient::SERVICE_ID, overrides)
            .build(),
    )
}

#[tokio::test]
async fn a_sheddable_call_is_refused_where_a_default_one_is_admitted() {
    let reg = InProcessRegistry::new();
    let (server, gate, mut entered) = serve(&reg, true).await;
    let adapt = client(&reg, no_retry());
    // Load: as many calls held as sheddable calls may have.
    let mut held = Vec::new();
    for _ in 0..SHEDDABLE_SHARE {
        let adapt = adapt.clone();
        held.push(tokio::spawn(async move { adapt.hold().await }));
    }
    for _ in 0..SHEDDABLE_SHARE {
        recv_one("a held call entered", &mut entered).await;
    }
    // Calls of the same entry (the limit is the entry's own).
    let shed = within(
        "a sheddable call",
        RpcContext::with_attachment("rpc-criticality", "sheddable", adapt.hold()),
    )
    .await
    .expect_err("a sheddable call over its share is refused");
    assert_eq!(shed.code(), StatusCode::OverflowMaxServerHandle, "{shed}");
    assert!(shed.message().contains("Sheddable"), "{shed}");
    // The sheddable calls' limit, and the entry's it is a share of.
    assert!(
        shed.message()
            .contains(&format!("limit of {SHEDDABLE_SHARE} for Sheddable"))
            && shed.message().contains(&format!("the limit is {INITIAL}")),
        "{shed}"
    );
    // At the same load a default call is admitted, and so is one marked default.
    let a = adapt.clone();
    held.push(tokio::spawn(async move { a.hold().await }));
    recv_one("a default call entered", &mut entered).await;
    let a = adapt.clone();
    held.push(tokio::spawn(async move {
        RpcContext::with_attachment("rpc-criticality", "default", a.hold()).await
    }));
    recv_one("a call marked default entered", &mut entered).await;
    gate.release.add_permits(held.len());
    for h in held {
        assert_eq!(
            within("a held call", h).await.expect("join").expect("ok"),
            1
        );
    }
    server.shutdown().await;
}

/// While calls run (they will measure the entry anew), a call with less budget than the
/// entry's calls take now is refused at once.
#[tokio::test(start_paused = true)]
async fn a_call_with_less_budget_than_the_entry_needs_is_refused_at_once() {
    let reg = InProcessRegistry::new();
    let (server, gate, _entered) = serve(&reg, true).await;
    let patient = client(&reg, no_retry());
    // One measured call: the entry's calls take SLOW now.
    assert_eq!(within("a slow call", patient.slow()).await.expect("ok"), 3);
    // Another running (in its handler, for SLOW).
    let running = {
        let patient = patient.clone();
        tokio::spawn(async move { patient.slow().await })
    };
    for _ in 0..10_000 {
        if gate.slow_ran.load(Ordering::SeqCst) == 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        gate.slow_ran.load(Ordering::SeqCst),
        2,
        "the second call runs"
    );
    let budget = SLOW / 4;
    let hurried = client(
        &reg,
        GovernanceOverrides {
            timeout_ms: Some(budget.as_millis() as u64),
            ..no_retry()
        },
    );
    let started = tokio::time::Instant::now();
    let err = within("a hurried call", hurried.slow())
        .await
        .expect_err("refused: it cannot finish in its budget");
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert!(err.message().contains("refused at once"), "{err}");
    assert!(
        started.elapsed() < budget,
        "answered at once, not at the deadline: {:?}",
        started.elapsed()
    );
    assert_eq!(
        gate.slow_ran.load(Ordering::SeqCst),
        2,
        "the handler never ran"
    );
    within("the running call", running)
        .await
        .expect("join")
        .expect("ok");
    server.shutdown().await;
}

fn invoke(id: u64, method: &str) -> Kind {
    Kind::Invoke(RemoteInvokeMessage {
        message_id: id,
        service_entry_id: format!("t.Adapt.{method}"),
        codec: 0,
        parameters: Bytes::from_static(b"\x90"),
        ..Default::default()
    })
}

async fn result(raw: &mut RawConn) -> RemoteResultMessage {
    match raw.recv().await {
        Some(Kind::Result(r)) => r,
        other => panic!("expected a result, got {other:?}"),
    }
}

/// With calls held inside the handler, the answer of one let go reports the held calls and
/// itself in flight, and `limit`; once the gate is full, the refusal reports the full gate.
async fn check_load_reports(adaptive: bool, limit: usize) {
    let reg = InProcessRegistry::new();
    let (server, gate, mut entered) = serve(&reg, adaptive).await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    const HELD: usize = 3;
    for id in 0..HELD as u64 {
        raw.send(invoke(id, "hold")).await.expect("send");
    }
    for _ in 0..HELD {
        recv_one("a held call entered", &mut entered).await;
    }
    // One more, then one of them is let go: its answer counts the others and itself.
    raw.send(invoke(100, "hold")).await.expect("send");
    recv_one("a held call entered", &mut entered).await;
    gate.release.add_permits(1);
    let r = result(&mut raw).await;
    assert_eq!(r.status_code, 200);
    assert_eq!(
        r.server_in_flight as usize,
        HELD + 1,
        "held calls and this one"
    );
    assert_eq!(r.server_limit as usize, limit);
    // Fill the gate: the call over it is refused and reports a full gate.
    for id in HELD as u64..limit as u64 {
        raw.send(invoke(id, "hold")).await.expect("send");
    }
    for _ in HELD..limit {
        recv_one("a held call entered", &mut entered).await;
    }
    raw.send(invoke(200, "hold")).await.expect("send");
    let r = result(&mut raw).await;
    assert_eq!((r.message_id, r.status_code), (200, 515));
    assert_eq!(
        (r.server_in_flight as usize, r.server_limit as usize),
        (limit, limit)
    );
    gate.release.add_permits(limit);
    for _ in 0..limit {
        let r = result(&mut raw).await;
        assert_eq!(r.status_code, 200);
        assert!(
            r.server_in_flight >= 1 && r.server_in_flight as usize <= limit,
            "{r:?}"
        );
        // The adaptive limit may move once a window of calls ends; never past the cap.
        if adaptive {
            assert!((1..=CAP).contains(&(r.server_limit as usize)), "{r:?}");
        } else {
            assert_eq!(r.server_limit as usize, limit);
        }
    }
    server.shutdown().await;
}

#[tokio::test]
async fn every_answer_reports_the_entrys_load_under_the_fixed_cap() {
    check_load_reports(false, CAP).await;
}

#[tokio::test]
async fn every_answer_reports_the_adaptive_limit_in_force() {
    check_load_reports(true, INITIAL).await;
}
