//! A rolling restart of three servers under steady load loses no call, even for a method that
//! is not idempotent: each server deregisters first, says GoAway, finishes what it read; calls
//! it never read go elsewhere.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::within;
use rpc::{Client, InProcessRegistry, RpcError, Server, ServerHandle};

#[rpc::service(name = "t.Orders")]
trait Orders {
    /// Not idempotent: a call that may have run is never repeated.
    async fn place(&self, n: u64) -> Result<u64, RpcError>;
}

/// Counts the orders it placed, over every server of the test.
struct Desk(Arc<AtomicU64>);

impl Orders for Desk {
    async fn place(&self, n: u64) -> Result<u64, RpcError> {
        tokio::task::yield_now().await;
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(n)
    }
}

async fn start(reg: &InProcessRegistry, placed: &Arc<AtomicU64>) -> ServerHandle {
    Server::builder()
        .registry(reg.clone())
        .add_service(OrdersServer::new(Desk(placed.clone())))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_loses_no_call() {
    let reg = InProcessRegistry::new();
    let placed = Arc::new(AtomicU64::new(0));
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(start(&reg, &placed).await);
    }
    let orders = OrdersClient::new(Client::builder().registry(reg.clone()).build());
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let done = Arc::new(AtomicBool::new(false));
    // Successful calls so far, watched by the test to pace the restarts.
    let (progress, mut answered) = tokio::sync::watch::channel(0u64);
    let progress = Arc::new(progress);
    let mut callers = Vec::new();
    for c in 0..8u64 {
        let (orders, ok, failed, done) = (orders.clone(), ok.clone(), failed.clone(), done.clone());
        let progress = progress.clone();
        callers.push(tokio::spawn(async move {
            // Bounded: at most 20 000 calls per caller, and stops once the restarts are over.
            let mut sent = 0u64;
            for i in 0..20_000u64 {
                if done.load(Ordering::Relaxed) && i > 100 {
                    break;
                }
                sent += 1;
                match orders.place(c * 1_000_000 + i).await {
                    Ok(n) if n == c * 1_000_000 + i => {
                        progress.send_modify(|n| *n += 1);
                        ok.fetch_add(1, Ordering::Relaxed)
                    }
                    Ok(_) => failed.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        eprintln!("lost call: {e}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
            sent
        }));
    }
    // Replace each server in turn while the callers run.
    for round in 0..3 {
        // 200 more calls answered (bounded: fails after LIMIT instead of spinning).
        let before = *answered.borrow_and_update();
        within(
            "200 more calls before the next restart",
            answered.wait_for(|n| *n >= before + 200),
        )
        .await
        .expect("the callers hold the sender");
        let old = servers.remove(0);
        within("graceful shutdown", old.shutdown()).await;
        servers.push(start(&reg, &placed).await);
        eprintln!("round {round}: {} calls so far", ok.load(Ordering::Relaxed));
    }
    done.store(true, Ordering::Relaxed);
    let mut sent = 0;
    for c in callers {
        sent += within("callers", c).await.expect("join");
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "calls lost during the rolling restart"
    );
    // Every call made was answered, and each was placed once: none ran twice.
    assert_eq!(ok.load(Ordering::Relaxed), sent);
    assert_eq!(placed.load(Ordering::SeqCst), sent, "orders placed");
    for s in servers {
        s.shutdown().await;
    }
}
