//! Each call runs in a task of its own (a handler that blocks stalls only itself), and those
//! tasks are reused: a connection keeps as many as it had calls running at once, hands each new
//! call to an idle one, and ends them all when it ends.
//!
//! Counted with the runtime's live task count on a current-thread runtime, where every step
//! completes in a known order.

use crate::common;

use std::sync::Arc;

use common::{recv_one, within};
use rpc::{Client, RpcError, Server, StaticRegistry};
use tokio::sync::{mpsc, watch};

#[rpc::service(name = "tasks.Held")]
pub trait Held {
    /// Answers once the gate opens; reports when it starts.
    #[governance(retry_times = 0)]
    async fn held(&self) -> Result<(), RpcError>;
}

struct Gate {
    entered: mpsc::UnboundedSender<()>,
    open: watch::Receiver<bool>,
}

impl Held for Gate {
    async fn held(&self) -> Result<(), RpcError> {
        let _ = self.entered.send(());
        let mut open = self.open.clone();
        let _ = open.wait_for(|open| *open).await;
        Ok(())
    }
}

fn alive() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Runs `n` calls at once through `proxy` and waits until all of them are in their handlers,
/// then opens the gate and waits for their answers.
async fn calls_at_once(
    proxy: &HeldClient,
    n: usize,
    entered: &mut mpsc::UnboundedReceiver<()>,
    gate: &watch::Sender<bool>,
) {
    gate.send_replace(false);
    let calls = futures_util::future::join_all((0..n).map(|_| proxy.held()));
    let wait = async {
        for _ in 0..n {
            recv_one("a handler starts", entered).await;
        }
        gate.send_replace(true);
    };
    let (answers, ()) = within("the calls", async { tokio::join!(calls, wait) }).await;
    for a in answers {
        a.expect("answered");
    }
}

#[tokio::test]
async fn a_connections_call_tasks_are_reused_and_end_with_it() {
    // A span subscriber on this thread too, as the trace tests of this binary have: `tracing`
    // caches each callsite's interest process-wide, and this test's calls, made without one,
    // left `cancelled`'s server span unrecorded when the two ran at once.
    let (_traces, _traced) = common::otel::Traces::install();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let (gate, open) = watch::channel(false);
    let server = Server::builder()
        .add_service(HeldServer::new(Gate {
            entered: entered_tx,
            open,
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let before_client = alive();
    let client = Client::builder()
        .registry(StaticRegistry::new([server.local_addr().to_string()]))
        .connections_per_endpoint(1)
        .build();
    let proxy = HeldClient::new(client);

    // One call: the connection's tasks (both ends) and one call task.
    calls_at_once(&proxy, 1, &mut entered, &gate).await;
    let one_call_task = alive();

    // Eight calls at once on the one connection: eight call tasks, the first one reused.
    calls_at_once(&proxy, 8, &mut entered, &gate).await;
    assert_eq!(
        alive(),
        one_call_task + 7,
        "one task per call running at once"
    );

    // Eight more, and then three: the idle tasks take them, no task is added.
    calls_at_once(&proxy, 8, &mut entered, &gate).await;
    calls_at_once(&proxy, 3, &mut entered, &gate).await;
    assert_eq!(alive(), one_call_task + 7, "idle call tasks are reused");

    // The client gone, its connection ends, and with it every call task it kept.
    drop(proxy);
    within("the connection's tasks end", async {
        for _ in 0..10_000 {
            if alive() <= before_client {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("{} tasks alive, expected {before_client}", alive());
    })
    .await;
    server.shutdown().await;
}

#[rpc::service(name = "tasks.Eager")]
pub trait Eager {
    /// Answers once the test opens its gate.
    async fn slow(&self) -> Result<(), RpcError>;
    /// Never reached: the service panics while making its future (see `PanicsEagerly`).
    async fn eager(&self) -> Result<(), RpcError>;
}

struct EagerGate(Arc<tokio::sync::Notify>, mpsc::UnboundedSender<()>);

impl Eager for EagerGate {
    async fn slow(&self) -> Result<(), RpcError> {
        let _ = self.1.send(());
        self.0.notified().await;
        Ok(())
    }

    async fn eager(&self) -> Result<(), RpcError> {
        Ok(())
    }
}

/// A hand-written `Service` that panics in `call` itself, before it has a future to return
/// (it decodes eagerly, say), for its `eager` method.
struct PanicsEagerly(EagerServer<EagerGate>);

impl rpc::Service for PanicsEagerly {
    fn service_id(&self) -> &'static str {
        rpc::Service::service_id(&self.0)
    }

    fn methods(&self) -> &'static [rpc::MethodDescriptor] {
        rpc::Service::methods(&self.0)
    }

    fn call(&self, method: usize, params: rpc::Bytes, codec: rpc::Codec) -> rpc::ServiceFuture {
        if rpc::Service::methods(&self.0)[method].method == "eager" {
            panic!("decoding eagerly, and failing");
        }
        rpc::Service::call(&self.0, method, params, codec)
    }
}

/// A service panicking while making a call's future fails that call (520), as a panic in the
/// future does; the other call on the same connection is answered. Before, the panic unwound
/// the connection's reader: every call on the connection failed and the socket closed.
#[tokio::test]
async fn a_service_panicking_before_its_future_fails_only_its_call() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel();
    let server = Server::builder()
        .add_service(PanicsEagerly(EagerServer::new(EagerGate(
            gate.clone(),
            arrived_tx,
        ))))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = EagerClient::new(
        Client::builder()
            .registry(StaticRegistry::new([server.local_addr().to_string()]))
            .build(),
    );
    let slow = tokio::spawn({
        let client = client.clone();
        async move { client.slow().await }
    });
    // The slow call is in (its handler waits) before the eager one goes out.
    recv_one("the slow call", &mut arrived).await;
    let e = within("the eager call", client.eager())
        .await
        .expect_err("its service panicked");
    assert_eq!(e.code(), rpc::StatusCode::ServerError, "{e}");
    gate.notify_one();
    within("the slow call", slow)
        .await
        .expect("the task")
        .expect("answered on the same connection");
}
