//! Deadlines and cancellation: the caller's budget travels with the call, and when it runs out
//! (or the caller gives up) the server drops the handler's future.

use crate::common;

use std::time::Duration;

use common::{no_retry, recv_one, until_entered, within, DropSignal, RawConn};
use rpc::crates::core::wire::{frame::Kind, HelloAck, RemoteInvokeMessage, RemoteResultMessage};
use rpc::crates::core::NoArgs;
use rpc::crates::transport::{ConnectOptions, Connection};
use rpc::{
    Client, Codec, GovernanceOverrides, InProcessRegistry, RpcError, Server, ServerHandle,
    StaticRegistry, StatusCode,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

#[rpc::service(name = "t.Deadline")]
trait Deadline {
    /// Never answers; holds a guard that reports when the future is dropped.
    async fn forever(&self) -> Result<(), RpcError>;
    /// The same, under the method's own deadline.
    #[governance(timeout_ms = 100, retry_times = 0)]
    async fn forever_short(&self) -> Result<(), RpcError>;
    async fn quick(&self) -> Result<u8, RpcError>;
}

struct Sleeper {
    entered: mpsc::UnboundedSender<String>,
    dropped: mpsc::UnboundedSender<String>,
}

impl Sleeper {
    async fn hang(&self, tag: &str) -> Result<(), RpcError> {
        let _guard = DropSignal::new(tag, self.dropped.clone());
        let _ = self.entered.send(tag.to_string());
        std::future::pending::<()>().await;
        Ok(())
    }
}

impl Deadline for Sleeper {
    async fn forever(&self) -> Result<(), RpcError> {
        self.hang("forever").await
    }
    async fn forever_short(&self) -> Result<(), RpcError> {
        self.hang("forever_short").await
    }
    async fn quick(&self) -> Result<u8, RpcError> {
        Ok(7)
    }
}

struct Probe {
    entered: mpsc::UnboundedReceiver<String>,
    dropped: mpsc::UnboundedReceiver<String>,
}

async fn serve(reg: &InProcessRegistry, cap: usize) -> (ServerHandle, Probe) {
    serve_configured(reg, |b| b.max_concurrency(cap)).await
}

/// [`serve`], with the builder's options set by `configure`.
async fn serve_configured(
    reg: &InProcessRegistry,
    configure: impl FnOnce(rpc::ServerBuilder) -> rpc::ServerBuilder,
) -> (ServerHandle, Probe) {
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let (dropped_tx, dropped) = mpsc::unbounded_channel();
    let server = configure(Server::builder().registry(reg.clone()))
        .add_service(DeadlineServer::new(Sleeper {
            entered: entered_tx,
            dropped: dropped_tx,
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (server, Probe { entered, dropped })
}

fn timeout_of(ms: u64) -> GovernanceOverrides {
    GovernanceOverrides {
        timeout_ms: Some(ms),
        retry_times: Some(0),
        ..GovernanceOverrides::NONE
    }
}

/// (On the paused clock: the deadline is checked to the millisecond, not against a busy
/// machine's wall clock.)
#[tokio::test(start_paused = true)]
async fn the_client_deadline_times_out_and_the_server_handler_is_dropped() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 1).await;
    let d = DeadlineClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options("t.Deadline.forever", timeout_of(100))
            .override_options("t.Deadline.quick", no_retry())
            .build(),
    );
    let started = tokio::time::Instant::now();
    let err = within("call under a 100 ms deadline", d.forever())
        .await
        .expect_err("the handler never answers");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    assert_eq!(err.code().as_u32(), 519);
    assert!(err.message().contains("t.Deadline.forever"), "{err}");
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(100),
        "the deadline"
    );
    assert_eq!(
        recv_one("handler entered", &mut probe.entered).await,
        "forever"
    );
    assert_eq!(
        recv_one("the handler's future was dropped", &mut probe.dropped).await,
        "forever"
    );
    // Its slot under the cap of 1 is free again.
    assert_eq!(d.quick().await.expect("quick after the timeout"), 7);
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_governance_attribute_timeout_applies_without_any_override() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 10).await;
    let d = DeadlineClient::new(Client::builder().registry(reg.clone()).build());
    let err = within("call under the attribute's deadline", d.forever_short())
        .await
        .expect_err("the handler never answers");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    // Whichever side's timer fired first, the error names the entry.
    assert!(err.message().contains("t.Deadline.forever_short"), "{err}");
    assert_eq!(
        recv_one("the handler's future was dropped", &mut probe.dropped).await,
        "forever_short"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn the_server_deadline_alone_stops_the_handler_and_answers_519() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 10).await;
    // A raw connection that never cancels: only the budget in the message can stop the work.
    let conn = Connection::connect(&server.local_addr().to_string(), &ConnectOptions::default())
        .await
        .expect("connect");
    let answer = within(
        "answer from the server's deadline",
        conn.call(
            RemoteInvokeMessage {
                service_entry_id: "t.Deadline.forever".into(),
                codec: Codec::MsgPack.to_wire(),
                parameters: Codec::MsgPack.encode(&NoArgs).expect("encode []"),
                timeout_ms: 100,
                ..Default::default()
            },
            None,
        ),
    )
    .await
    .expect("the server answers");
    assert_eq!(answer.status_code, 519, "{answer:?}");
    assert!(answer.exception_message.contains("100 ms"), "{answer:?}");
    assert_eq!(
        recv_one("the handler's future was dropped", &mut probe.dropped).await,
        "forever"
    );
    assert!(conn.is_usable(), "the connection outlives a timed-out call");
    within("shutdown", server.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn dropping_the_call_future_cancels_the_handler_and_frees_its_slot() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 1).await;
    // No deadline at all: neither side has a timer that could stop the handler.
    let d = DeadlineClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(DeadlineClient::SERVICE_ID, timeout_of(0))
            .build(),
    );
    let call = until_entered(Box::pin(d.forever()), "forever", &mut probe.entered).await;
    // The caller gives up: dropping its future sends Cancel.
    drop(call);
    assert_eq!(
        recv_one("the Cancel dropped the handler", &mut probe.dropped).await,
        "forever"
    );
    // The cap of 1 is free again, and the connection is still good.
    assert_eq!(d.quick().await.expect("quick after the cancel"), 7);

    // The same through a caller-side timeout around the call, which expires (on the paused
    // clock) only once the handler is known to run: no race between the timeout and the call.
    let call = until_entered(
        Box::pin(tokio::time::timeout(Duration::from_secs(60), d.forever())),
        "forever",
        &mut probe.entered,
    )
    .await;
    tokio::time::advance(Duration::from_secs(60)).await;
    let gave_up = call.await;
    assert!(gave_up.is_err(), "forever answered: {gave_up:?}");
    assert_eq!(
        recv_one("the Cancel dropped the handler", &mut probe.dropped).await,
        "forever"
    );
    assert_eq!(d.quick().await.expect("quick after the cancel"), 7);
    within("shutdown", server.shutdown()).await;
}

/// The client side of the protocol, seen by a server played by the test: the handshake, the
/// remaining budget in `timeout_ms`, and `Cancel` with the call's id when the deadline passes.
#[tokio::test]
async fn the_client_sends_its_budget_and_cancels_at_the_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let d = DeadlineClient::new(
        Client::builder()
            .registry(StaticRegistry::new([addr.to_string()]))
            .token("tok")
            .client_id("deadline-test")
            .override_options(DeadlineClient::SERVICE_ID, timeout_of(300))
            .build(),
    );
    let call = tokio::spawn(async move { d.forever().await });

    let ack = HelloAck {
        protocol_version: 1,
        server_id: "fake".into(),
        max_frame_length: 1 << 20,
        ..Default::default()
    };
    let (mut peer, h) = RawConn::accept_with(&listener, ack).await;
    assert_eq!(h.protocol_version, 1);
    assert_eq!(h.token, "tok");
    assert_eq!(h.client_id, "deadline-test");
    let invoke = peer.recv_invoke("the call").await;
    assert_eq!(invoke.service_entry_id, "t.Deadline.forever");
    assert_eq!(invoke.codec, 0, "MessagePack");
    assert_eq!(
        &invoke.parameters[..],
        &[0x90],
        "no arguments: an empty array"
    );
    assert!(
        invoke.timeout_ms > 0 && invoke.timeout_ms <= 300,
        "the remaining budget: {}",
        invoke.timeout_ms
    );
    // No answer: at the deadline the client must cancel exactly this call.
    match peer.recv().await {
        Some(Kind::Cancel(c)) => assert_eq!(c.message_id, invoke.message_id),
        other => panic!("expected Cancel, got {other:?}"),
    }
    let err = within("the timed-out call", call)
        .await
        .expect("join")
        .expect_err("no answer was sent");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
}

// A → B → C, B holding a fallback: B's own calls inherit A's budget less a slack, so that B can
// still answer A in time; a fallback does not start once its caller's deadline has passed.

#[rpc::service(name = "t.TierC")]
trait TierC {
    /// Never answers.
    async fn hang(&self) -> Result<u32, RpcError>;
}

#[rpc::service(name = "t.TierB")]
trait TierB {
    /// Asks C.
    async fn ask(&self) -> Result<u32, RpcError>;
}

struct Hanging;

impl TierC for Hanging {
    async fn hang(&self) -> Result<u32, RpcError> {
        std::future::pending::<()>().await;
        Ok(0)
    }
}

/// B's (client-side) fallback for C: answers 7 and reports that it ran.
struct CFallback(mpsc::UnboundedSender<&'static str>);

impl TierC for CFallback {
    async fn hang(&self) -> Result<u32, RpcError> {
        let _ = self.0.send("c-fallback");
        Ok(7)
    }
}

struct Middle(TierCClient);

impl TierB for Middle {
    async fn ask(&self) -> Result<u32, RpcError> {
        self.0.hang().await
    }
}

/// B's server-side fallback: answers 8 and reports that it ran.
struct BFallback(mpsc::UnboundedSender<&'static str>);

impl TierB for BFallback {
    async fn ask(&self) -> Result<u32, RpcError> {
        let _ = self.0.send("b-fallback");
        Ok(8)
    }
}

/// Receives events from `rx` until one of `kind` arrives (bounded by the suite's limit).
async fn next_event(
    rx: &mut tokio::sync::broadcast::Receiver<rpc::crates::governance::events::GovernanceEvent>,
    kind: rpc::crates::governance::events::EventKind,
) -> rpc::crates::governance::events::GovernanceEvent {
    within("governance event", async {
        loop {
            match rx.recv().await {
                Ok(e) if e.kind == kind => return e,
                Ok(_) => continue,
                Err(e) => panic!("event stream ended: {e}"),
            }
        }
    })
    .await
}

/// (On the paused clock: the 500 ms between B's inherited deadline and A's pass as the test
/// says, not as a busy machine stretches them.)
#[tokio::test(start_paused = true)]
async fn the_middle_tier_fallback_answers_before_the_callers_deadline() {
    use rpc::crates::governance::events::EventKind;
    let reg = InProcessRegistry::new();
    let c = Server::builder()
        .registry(reg.clone())
        .add_service(TierCServer::new(Hanging))
        .serve("127.0.0.1:0")
        .await
        .expect("serve C");
    let (ran_tx, mut ran) = mpsc::unbounded_channel();
    // B's calls to C have no timeout of their own: A's budget, inherited, bounds them.
    let b_client = Client::builder()
        .registry(reg.clone())
        .override_options(
            TierCClient::SERVICE_ID,
            GovernanceOverrides {
                deadline_slack_ms: Some(500),
                ..timeout_of(0)
            },
        )
        .fallback(TierCServer::new(CFallback(ran_tx)))
        .build();
    let mut b_events = b_client.events().subscribe();
    let b = Server::builder()
        .registry(reg.clone())
        .add_service(TierBServer::new(Middle(TierCClient::new(b_client))))
        .serve("127.0.0.1:0")
        .await
        .expect("serve B");
    let a = TierBClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(TierBClient::SERVICE_ID, timeout_of(2000))
            .build(),
    );

    // C never answers; B's call to C ends 500 ms before A's deadline (a quarter of the
    // budget, so the slack is not capped), B's fallback answers, and A receives that answer
    // instead of its own timeout.
    assert_eq!(within("A's call", a.ask()).await, Ok(7));
    assert_eq!(recv_one("B's fallback ran", &mut ran).await, "c-fallback");
    let timeout = next_event(&mut b_events, EventKind::Timeout).await;
    let cause = timeout.cause.unwrap_or_default();
    assert!(
        cause.contains("t.TierC.hang") && cause.contains("inherited from the caller's deadline"),
        "{cause}"
    );
    within("shutdown B", b.shutdown()).await;
    within("shutdown C", c.shutdown()).await;
}

#[tokio::test]
async fn a_server_fallback_does_not_start_after_the_callers_deadline() {
    use rpc::crates::governance::events::EventKind;
    let reg = InProcessRegistry::new();
    let (ran_tx, mut ran) = mpsc::unbounded_channel();
    // B's handler waits on a C that never answers, with no slack: it runs until A's deadline.
    let c = Server::builder()
        .registry(reg.clone())
        .add_service(TierCServer::new(Hanging))
        .serve("127.0.0.1:0")
        .await
        .expect("serve C");
    let b_client = Client::builder()
        .registry(reg.clone())
        .override_options(
            TierCClient::SERVICE_ID,
            GovernanceOverrides {
                deadline_slack_ms: Some(0),
                ..timeout_of(0)
            },
        )
        .build();
    // B connects to C first: on a busy machine a connect still under way at A's deadline
    // would fail B's handler with a communication error at that very instant, a race with
    // the server's own 519 that this test is not about.
    let warm = TierCClient::new(b_client.with_options(timeout_of(50)));
    let e = within("B's first call to C", warm.hang())
        .await
        .expect_err("C never answers");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    let b = Server::builder()
        .registry(reg.clone())
        .add_service(TierBServer::new(Middle(TierCClient::new(b_client))))
        .fallback(TierBServer::new(BFallback(ran_tx)))
        .serve("127.0.0.1:0")
        .await
        .expect("serve B");
    let mut b_events = b.events().subscribe();
    // A speaks the wire by hand and does not cancel: B alone decides at the deadline.
    assert_eq!(raw_ask(&b, 100).await.status_code, 519);
    let skipped = next_event(&mut b_events, EventKind::FallbackSkipped).await;
    assert_eq!(&*skipped.entry, "t.TierB.ask");
    // The skip is decided where the fallback would have been called: it never ran.
    assert!(
        ran.try_recv().is_err(),
        "B's fallback ran after A's deadline"
    );
    within("shutdown B", b.shutdown()).await;
    within("shutdown C", c.shutdown()).await;
}

/// B's answer to `ask` with a budget of `timeout_ms`, from a caller speaking the wire by hand
/// (which never cancels: B alone decides at the deadline).
async fn raw_ask(b: &rpc::ServerHandle, timeout_ms: u32) -> RemoteResultMessage {
    let mut a = RawConn::connect(b.local_addr()).await;
    a.handshake().await;
    a.send(Kind::Invoke(RemoteInvokeMessage {
        message_id: 1,
        service_entry_id: "t.TierB.ask".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&NoArgs).expect("encode"),
        timeout_ms,
        ..Default::default()
    }))
    .await
    .expect("send the call");
    match within("B's answer", a.recv()).await {
        Some(Kind::Result(r)) => r,
        other => panic!("expected B's answer, got {other:?}"),
    }
}

/// Fails at once, as a broken handler does.
struct FailsAtOnce;

impl TierB for FailsAtOnce {
    async fn ask(&self) -> Result<u32, RpcError> {
        Err(RpcError::new(StatusCode::ServerError, "broken"))
    }
}

/// A server fallback slower than the caller's budget.
struct SlowFallback;

impl TierB for SlowFallback {
    async fn ask(&self) -> Result<u32, RpcError> {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        Ok(9)
    }
}

/// A server fallback that starts in time but is still running at the caller's deadline is
/// stopped there, and the call answered 519 as any call out of time (before, its timeout was
/// wrapped as a failed fallback, 509).
#[tokio::test(start_paused = true)]
async fn a_server_fallback_still_running_at_the_deadline_is_answered_519() {
    let b = Server::builder()
        .add_service(TierBServer::new(FailsAtOnce))
        .fallback(TierBServer::new(SlowFallback))
        .serve("127.0.0.1:0")
        .await
        .expect("serve B");
    assert_eq!(raw_ask(&b, 100).await.status_code, 519);
    within("shutdown B", b.shutdown()).await;
}

/// Inside a handler whose caller's deadline has passed, a client fallback does not start: the
/// call fails with a timeout saying so, and a `fallback_skipped` event is emitted.
#[tokio::test(start_paused = true)]
async fn a_client_fallback_does_not_start_once_the_inherited_deadline_passed() {
    use rpc::crates::governance::events::EventKind;
    use rpc::crates::governance::timeout::with_inherited;
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").to_string()
    };
    let (ran_tx, mut ran) = mpsc::unbounded_channel();
    let client = Client::builder()
        .registry(StaticRegistry::new([down]))
        .override_options(TierCClient::SERVICE_ID, no_retry())
        .fallback(TierCServer::new(CFallback(ran_tx)))
        .build();
    let mut events = client.events().subscribe();
    let c = TierCClient::new(client);
    let passed = tokio::time::Instant::now();
    let err = with_inherited(Some(passed), c.hang())
        .await
        .expect_err("the fallback must not answer");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    assert!(err.message().contains("fallback was not started"), "{err}");
    let skipped = next_event(&mut events, EventKind::FallbackSkipped).await;
    assert_eq!(&*skipped.entry, "t.TierC.hang");
    assert!(ran.try_recv().is_err(), "the fallback ran");

    // Outside any handler the same failure is answered by the fallback.
    assert_eq!(c.hang().await, Ok(7));
}

/// A registry that never answers a watch: etcd or ZooKeeper slow or down, with a request
/// timeout longer than the calls' deadlines.
fn hung_registry() -> common::registry::TestRegistry {
    common::registry::TestRegistry::new(
        common::registry::Register::Answers,
        common::registry::Watch::Hangs,
    )
}

/// An entry's first call looks its service up before its stack runs; that lookup counts
/// against the call's deadline, as finding the endpoints does, so a registry that hangs costs
/// the caller its budget and no more.
#[tokio::test(start_paused = true)]
async fn an_entrys_first_call_times_out_at_its_deadline_while_the_registry_hangs() {
    let client = Client::builder().registry(hung_registry()).build();
    let d = DeadlineClient::new(client);
    for (n, call) in ["first", "second"].into_iter().enumerate() {
        let started = tokio::time::Instant::now();
        let e = within(call, d.forever_short())
            .await
            .expect_err("no endpoint is ever found");
        assert_eq!(e.code(), StatusCode::Timeout, "{call}: {e}");
        // Saying what the deadline cut: no server was involved.
        assert!(e.message().contains("no endpoint was known"), "{call}: {e}");
        // The method's own 100 ms, on the paused clock.
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(100),
            "{call} ({n}): {e}"
        );
    }
}

/// A generic (JSON) call looks its service up before its stack runs, as a proxy's first call
/// does, and so within the call's deadline: a registry that hangs costs the caller its
/// deadline and no more (before, the call waited as long as the registry did: here, for ever).
#[tokio::test(start_paused = true)]
async fn a_json_call_times_out_at_its_deadline_while_the_registry_hangs() {
    let client = Client::builder()
        .registry(hung_registry())
        .default_options(rpc::GovernanceOptions {
            timeout_ms: 100,
            ..Default::default()
        })
        .build();
    let started = tokio::time::Instant::now();
    let call = client.invoke_json("t.Deadline.forever_short", serde_json::json!([]));
    let e = within("the JSON call", call)
        .await
        .expect_err("no endpoint is ever found");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert!(e.message().contains("no endpoint was known"), "{e}");
    assert_eq!(started.elapsed(), Duration::from_millis(100), "{e}");
}

#[rpc::service(name = "t.AtDeadline")]
trait AtDeadline {
    /// Fails with a communication error after `ms` milliseconds, as a downstream call the
    /// caller's deadline bounded would.
    async fn fail_after(&self, ms: u64) -> Result<(), RpcError>;
}

struct FailsLate;

impl AtDeadline for FailsLate {
    async fn fail_after(&self, ms: u64) -> Result<(), RpcError> {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Err(RpcError::new(
            StatusCode::CommunicationError,
            "the downstream connect was cut",
        ))
    }
}

/// A handler that fails at the very instant the caller's deadline passes is answered 519,
/// naming its error, whichever of the handler and the server's timer is polled first; one
/// that fails before the deadline keeps its own status.
#[tokio::test(start_paused = true)]
async fn a_handler_failing_at_the_deadline_is_answered_519() {
    let server = Server::builder()
        .add_service(AtDeadlineServer::new(FailsLate))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    // (A handler's communication error goes on the wire as 504, "no usable endpoint", as any
    // error passed on from a downstream call is carried.)
    for (id, after_ms, want) in [(1, 100, 519), (2, 40, 504)] {
        raw.send(Kind::Invoke(RemoteInvokeMessage {
            message_id: id,
            service_entry_id: "t.AtDeadline.fail_after".into(),
            codec: Codec::MsgPack.to_wire(),
            parameters: Codec::MsgPack.encode(&(after_ms,)).expect("encode"),
            timeout_ms: 100,
            ..Default::default()
        }))
        .await
        .expect("send");
        let r = match within("the answer", raw.recv()).await {
            Some(Kind::Result(r)) => r,
            other => panic!("expected an answer, got {other:?}"),
        };
        assert_eq!((r.message_id, r.status_code), (id, want), "{r:?}");
        assert!(
            r.exception_message.contains("downstream connect was cut"),
            "{}",
            r.exception_message
        );
    }
    within("shutdown", server.shutdown()).await;
}

/// Under `appoint` the appointed address is the only candidate whatever the registry lists, so
/// a registry that hangs neither holds the call nor fails it: before, every call waited on the
/// registry's watch and ran out of its deadline.
#[tokio::test]
async fn an_appointed_call_does_not_wait_for_a_registry_that_hangs() {
    let (server, _probe) = serve(&InProcessRegistry::new(), 10).await;
    let client = Client::builder()
        .registry(hung_registry())
        .override_options(
            DeadlineClient::SERVICE_ID,
            GovernanceOverrides {
                shunt_strategy: Some(rpc::ShuntStrategy::Appoint),
                appoint_address: Some(server.local_addr().to_string().into()),
                timeout_ms: Some(2_000),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let d = DeadlineClient::new(client);
    for call in ["first", "second"] {
        assert_eq!(within(call, d.quick()).await.expect(call), 7);
    }
    within("shutdown", server.shutdown()).await;
}

/// How late the watches of [`slow_lookup`] answer.
const LOOKUP: Duration = Duration::from_millis(200);

/// `reg`, its watches answering `LOOKUP` late (etcd slow to answer).
fn slow_lookup(reg: InProcessRegistry) -> common::registry::Watching {
    common::registry::Watching::new(reg, |_| {
        Box::pin(async {
            tokio::time::sleep(LOOKUP).await;
            Ok(())
        })
    })
}

/// Waiting for endpoints gives up at its timeout even while the registry has not answered
/// the lookup yet. Before, the wait began after the lookup, which a registry that does not
/// answer (etcd unreachable) held for its own request timeout.
#[tokio::test(start_paused = true)]
async fn waiting_for_endpoints_counts_the_lookup_in_its_timeout() {
    let client = Client::builder()
        .registry(slow_lookup(InProcessRegistry::new()))
        .build();
    let started = tokio::time::Instant::now();
    let err = client
        .wait_for_endpoints(DeadlineClient::SERVICE_ID, LOOKUP / 4)
        .await
        .expect_err("no endpoint");
    assert_eq!(err.code(), StatusCode::NotFindServiceRoute, "{err}");
    assert!(
        err.message().contains("the registry not having answered"),
        "{err}"
    );
    assert_eq!(started.elapsed(), LOOKUP / 4);
}

/// An entry's first call counts its service's lookup in its duration, as its deadline does:
/// what call observers (and the `rpc.client.duration` metric) are told starts when the call
/// did. Before, it started after the lookup.
#[tokio::test(start_paused = true)]
async fn a_first_calls_duration_counts_its_lookup() {
    use rpc::crates::governance::calls::{CallObserver, CallRecord};
    struct Elapsed(mpsc::UnboundedSender<Duration>);
    impl CallObserver for Elapsed {
        fn call_ended(&self, call: &CallRecord) {
            let _ = self.0.send(call.elapsed);
        }
    }
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 10).await;
    let client = Client::builder().registry(slow_lookup(reg.clone())).build();
    let (tx, mut elapsed) = mpsc::unbounded_channel();
    client.observe_calls(std::sync::Arc::new(Elapsed(tx)));
    let d = DeadlineClient::new(client);
    assert_eq!(d.quick().await.expect("quick"), 7);
    let first = recv_one("the first call's record", &mut elapsed).await;
    assert!(first >= LOOKUP, "{first:?}");
    within("shutdown", server.shutdown()).await;
}

/// A call its client's timeout layer fails with 519 is counted under `rpc.outcome =
/// "timeout"`, as one dropped at its deadline is: before, it was counted as a plain `error`,
/// and a query for timeouts missed nearly all of them.
#[tokio::test]
async fn a_call_failed_at_its_deadline_is_counted_as_a_timeout() {
    use common::otel::{counter, Meters};
    use opentelemetry::Value;
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 1).await;
    let meters = Meters::new();
    let d = DeadlineClient::new(
        Client::builder()
            .registry(reg.clone())
            .meter(meters.meter.clone())
            .override_options("t.Deadline.forever", timeout_of(100))
            .build(),
    );
    let err = within("call under a 100 ms deadline", d.forever())
        .await
        .expect_err("the handler never answers");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    recv_one("the handler's future was dropped", &mut probe.dropped).await;
    let m = meters.read();
    let timeout = [
        ("rpc.outcome", Value::from("timeout")),
        ("rpc.status_code", Value::I64(519)),
    ];
    assert_eq!(counter(&m, "rpc.client.calls", &timeout), 1);
    assert_eq!(counter(&m, "rpc.client.calls", &[]), 1, "counted once");
    within("shutdown", server.shutdown()).await;
}

/// A server's span says how a handled call ended (`outcome`), as a client's does, and a
/// call refused over the server's cap is in the duration histogram as in the call counter.
/// Before, the span had no outcome unless a fallback answered, and refusals were counted
/// but not timed.
#[tokio::test]
async fn a_servers_span_has_its_outcome_and_a_refusal_is_timed() {
    use common::otel::{attr, counter, histogram_count, Meters, Traces};
    use opentelemetry::Value;
    let (traces, _guard) = Traces::install();
    let meters = Meters::new();
    let reg = InProcessRegistry::new();
    let (server, mut probe) =
        serve_configured(&reg, |b| b.meter(meters.meter.clone()).max_concurrency(1)).await;
    let d = DeadlineClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options("t.Deadline", no_retry())
            .build(),
    );
    assert_eq!(within("quick", d.quick()).await.expect("quick"), 7);
    // One call holds the cap of 1; the next is refused 515.
    let held = tokio::spawn({
        let d = d.clone();
        async move { d.forever().await }
    });
    recv_one("the held call runs", &mut probe.entered).await;
    let err = within("over the cap", d.quick())
        .await
        .expect_err("refused");
    assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle, "{err}");
    held.abort();

    let spans = traces
        .spans_once("the quick call's server span", |spans| {
            spans.iter().any(|s| s.name == "rpc.server")
        })
        .await;
    let served = spans
        .iter()
        .find(|s| s.name == "rpc.server")
        .expect("a server span");
    assert_eq!(attr(served, "outcome"), Some(Value::from("success")));
    let m = meters.read();
    let refused = [
        ("rpc.outcome", Value::from("error")),
        ("rpc.status_code", Value::I64(515)),
    ];
    assert_eq!(counter(&m, "rpc.server.calls", &refused), 1);
    assert_eq!(histogram_count(&m, "rpc.server.duration", &refused), 1);
    within("shutdown", server.shutdown()).await;
}
