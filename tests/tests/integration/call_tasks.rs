//! Each call runs in a task of its own (a handler that blocks stalls only itself), and those
//! tasks are reused: a connection keeps as many as it had calls running at once, hands each new
//! call to an idle one, and ends them all when it ends.
//!
//! Counted with the runtime's live task count on a current-thread runtime, where every step
//! completes in a known order.

use crate::common;

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
