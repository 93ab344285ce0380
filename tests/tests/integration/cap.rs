//! The server's concurrency cap: full → Overflow (515) at once, never queued; per-entry caps;
//! overflow retried on another endpoint.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{no_retry, recv_one, within};
use rpc::{
    answered_by, Client, GovernanceOverrides, InProcessRegistry, RpcError, Server, ServerHandle,
    StatusCode,
};
use tokio::sync::{mpsc, Semaphore};

#[rpc::service(name = "t.Cap")]
trait Cap {
    /// Waits for a permit the test hands out; returns the server's name.
    #[governance(shunt_strategy = "hash", retry_interval_ms = 0)]
    async fn hold(&self, #[hash_key] key: String) -> Result<String, RpcError>;
    /// Like `hold`, under an entry cap of its own.
    #[governance(max_concurrent_handling_count = 2)]
    async fn narrow(&self) -> Result<String, RpcError>;
    /// Answers at once.
    async fn quick(&self) -> Result<String, RpcError>;
}

/// Handlers report entry on `entered` and wait on `release`.
struct Gate {
    name: String,
    entered: mpsc::UnboundedSender<String>,
    release: Semaphore,
    ran: AtomicUsize,
}

impl Gate {
    fn new(name: &str) -> (Arc<Gate>, mpsc::UnboundedReceiver<String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let gate = Arc::new(Gate {
            name: name.into(),
            entered: tx,
            release: Semaphore::new(0),
            ran: AtomicUsize::new(0),
        });
        (gate, rx)
    }

    async fn held(&self) -> Result<String, RpcError> {
        self.ran.fetch_add(1, Ordering::SeqCst);
        let _ = self.entered.send(self.name.clone());
        common::let_through(&self.release).await?;
        Ok(self.name.clone())
    }
}

impl Cap for Gate {
    async fn hold(&self, _key: String) -> Result<String, RpcError> {
        self.held().await
    }
    async fn narrow(&self) -> Result<String, RpcError> {
        self.held().await
    }
    async fn quick(&self) -> Result<String, RpcError> {
        Ok(self.name.clone())
    }
}

async fn serve(reg: &InProcessRegistry, gate: &Arc<Gate>, cap: usize) -> ServerHandle {
    Server::builder()
        .registry(reg.clone())
        .max_concurrency(cap)
        .add_service(CapServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

/// A client of `reg`'s servers that does not retry.
fn cap_client(reg: &InProcessRegistry) -> CapClient {
    CapClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(CapClient::SERVICE_ID, no_retry())
            .build(),
    )
}

#[tokio::test]
async fn over_the_cap_fails_at_once_with_overflow_and_the_held_calls_finish() {
    const N: usize = 3;
    const K: usize = 2;
    let reg = InProcessRegistry::new();
    let (gate, mut entered) = Gate::new("only");
    let server = serve(&reg, &gate, N).await;
    let cap = cap_client(&reg);

    let (done_tx, mut done) = mpsc::unbounded_channel();
    for _ in 0..N + K {
        let (cap, done_tx) = (cap.clone(), done_tx.clone());
        tokio::spawn(async move {
            let _ = done_tx.send(cap.hold("same".into()).await);
        });
    }
    // While the N are held inside the handler, exactly K calls come back, all Overflow.
    for i in 0..K {
        let err = recv_one("an overflowed call", &mut done)
            .await
            .expect_err("the call over the cap must fail");
        assert_eq!(
            err.code(),
            StatusCode::OverflowMaxServerHandle,
            "{i}: {err}"
        );
        assert_eq!(err.code().as_u32(), 515);
        assert!(err.message().contains("cap of 3"), "{err}");
    }
    for _ in 0..N {
        recv_one("a held call entered its handler", &mut entered).await;
    }
    assert!(
        done.try_recv().is_err(),
        "no held call may finish before it is released"
    );
    assert_eq!(
        gate.ran.load(Ordering::SeqCst),
        N,
        "overflowed calls never ran"
    );

    gate.release.add_permits(N);
    for _ in 0..N {
        let ok = recv_one("a released call", &mut done).await;
        assert_eq!(ok.expect("released call succeeds"), "only");
    }
    assert_eq!(gate.ran.load(Ordering::SeqCst), N);
    // The permits came back: the server takes N calls again.
    assert_eq!(cap.quick().await.expect("quick after release"), "only");
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn an_entry_cap_is_its_own_and_leaves_other_entries_alone() {
    let reg = InProcessRegistry::new();
    let (gate, mut entered) = Gate::new("only");
    // A server-wide cap of 1: had the entry's held calls taken its slots too, nothing else
    // would run.
    let server = serve(&reg, &gate, 1).await;
    let cap = cap_client(&reg);
    let (done_tx, mut done) = mpsc::unbounded_channel();
    for _ in 0..3 {
        let (cap, done_tx) = (cap.clone(), done_tx.clone());
        tokio::spawn(async move {
            let _ = done_tx.send(cap.narrow().await);
        });
    }
    let err = recv_one("the third narrow call", &mut done)
        .await
        .expect_err("over the entry cap of 2");
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert!(err.message().contains("t.Cap.narrow"), "{err}");
    assert!(err.message().contains("cap of 2"), "{err}");
    for _ in 0..2 {
        recv_one("a narrow call entered", &mut entered).await;
    }
    // The server-wide cap of 1 still has room for other entries.
    assert_eq!(cap.quick().await.expect("quick"), "only");
    gate.release.add_permits(2);
    for _ in 0..2 {
        recv_one("a released narrow call", &mut done)
            .await
            .expect("released narrow call");
    }
    within("shutdown", server.shutdown()).await;
}

/// A call refused because the server's cap, shared by the entries without one of their own,
/// is full says so, naming the setting: not that its entry, which sets no cap and runs
/// nothing, is at "its" cap (before: "t.Cap.quick is at its cap of 1 concurrent calls", and
/// a user would give `quick` a cap, which is not what refused it).
#[tokio::test]
async fn a_refusal_of_the_shared_cap_names_the_servers_cap() {
    let reg = InProcessRegistry::new();
    let (gate, mut entered) = Gate::new("only");
    let server = serve(&reg, &gate, 1).await;
    let cap = cap_client(&reg);
    let held = tokio::spawn({
        let cap = cap.clone();
        async move { cap.hold("k".into()).await }
    });
    recv_one("the held call entered", &mut entered).await;
    let err = within("quick", cap.quick())
        .await
        .expect_err("the server's cap is full");
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert!(
        err.message().contains("the server's cap of 1")
            && err.message().contains("max_concurrency")
            && !err.message().contains("is at its cap"),
        "{err}"
    );
    gate.release.add_permits(1);
    within("the held call", held)
        .await
        .expect("joined")
        .expect("answered");
    within("shutdown", server.shutdown()).await;
}

/// What a spawned `hold` call gives back: its result and the endpoint that answered.
type HoldCall = tokio::task::JoinHandle<(Result<String, RpcError>, Option<String>)>;

/// Starts a `hold` call for key "k" and waits until it entered one of the two servers, whose
/// name it returns.
async fn start_hold(
    cap: &CapClient,
    a_entered: &mut mpsc::UnboundedReceiver<String>,
    b_entered: &mut mpsc::UnboundedReceiver<String>,
) -> (HoldCall, String) {
    let cap = cap.clone();
    let call = tokio::spawn(async move { answered_by(cap.hold("k".into())).await });
    let entered = within("a call entered a server", async {
        tokio::select! {
            n = a_entered.recv() => n,
            n = b_entered.recv() => n,
        }
    })
    .await
    .expect("a gate is alive");
    (call, entered)
}

#[tokio::test]
async fn overflow_is_retried_on_another_endpoint_and_never_ran_on_the_full_one() {
    let reg = InProcessRegistry::new();
    let (a, mut a_entered) = Gate::new("a");
    let (b, mut b_entered) = Gate::new("b");
    let servers = [serve(&reg, &a, 1).await, serve(&reg, &b, 1).await];
    let name_of = |addr: &str| {
        if addr == servers[0].local_addr().to_string() {
            "a"
        } else {
            "b"
        }
    };
    let cap = CapClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(
                CapClient::SERVICE_ID,
                GovernanceOverrides {
                    retry_times: Some(1),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    // Both calls hash to the same owner; the second finds it full.
    let (first, owner) = start_hold(&cap, &mut a_entered, &mut b_entered).await;
    let (second, other) = start_hold(&cap, &mut a_entered, &mut b_entered).await;
    assert_ne!(
        owner, other,
        "the overflowed call moved to the other server"
    );
    let (full, spare) = if owner == "a" { (&a, &b) } else { (&b, &a) };
    assert_eq!(
        full.ran.load(Ordering::SeqCst),
        1,
        "the full server ran one call"
    );
    assert_eq!(spare.ran.load(Ordering::SeqCst), 1);

    a.release.add_permits(1);
    b.release.add_permits(1);
    let (r1, by1) = within("first call", first).await.expect("join");
    let (r2, by2) = within("second call", second).await.expect("join");
    assert_eq!(r1.expect("first"), owner);
    assert_eq!(r2.expect("second"), other);
    assert_eq!(by1.map(|a| name_of(&a)), Some(owner.as_str()));
    assert_eq!(by2.map(|a| name_of(&a)), Some(other.as_str()));
    for s in servers {
        within("shutdown", s.shutdown()).await;
    }
}

/// With one endpoint there is no other to move to: an Overflow is retried on the same endpoint
/// (after `retry_interval_ms`, since a full cap may clear up), up to `retry_times`, and the
/// final error lists that endpoint once per attempt.
#[tokio::test]
async fn with_one_endpoint_overflow_is_retried_on_that_endpoint() {
    let reg = InProcessRegistry::new();
    let (gate, mut entered) = Gate::new("only");
    let server = serve(&reg, &gate, 1).await;
    let addr = server.local_addr().to_string();
    let mut refused = server.events().subscribe();
    let client = Client::builder()
        .registry(reg.clone())
        .override_options(
            CapClient::SERVICE_ID,
            GovernanceOverrides {
                retry_times: Some(2),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let mut events = client.events().subscribe();
    let cap = CapClient::new(client);
    let held = tokio::spawn({
        let cap = cap.clone();
        async move { cap.hold("k".into()).await }
    });
    recv_one("the first call holds the only slot", &mut entered).await;

    let err = within("the second call", cap.hold("k".into()))
        .await
        .expect_err("the only endpoint stays full");
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    assert_eq!(
        err.tried(),
        [addr.as_str(), addr.as_str(), addr.as_str()],
        "three attempts, all on the one endpoint"
    );
    let retries: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == rpc::crates::governance::events::EventKind::Retry)
        .map(|e| e.endpoint)
        .collect();
    assert_eq!(retries, [Some(addr.clone()), Some(addr.clone())]);
    let overflows = std::iter::from_fn(|| refused.try_recv().ok())
        .filter(|e| e.kind == rpc::crates::governance::events::EventKind::Overflow)
        .count();
    assert_eq!(
        overflows, 3,
        "the server refused each of the three attempts"
    );
    assert_eq!(gate.ran.load(Ordering::SeqCst), 1, "none of them ran");

    gate.release.add_permits(1);
    assert_eq!(
        within("the held call", held)
            .await
            .expect("join")
            .expect("held"),
        "only"
    );
    within("shutdown", server.shutdown()).await;
}
