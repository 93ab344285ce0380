//! The load-aware strategy (`shunt_strategy = least_loaded`) over real servers: a slow server
//! gets few calls, and an instance's `weight` metadata shares the calls out.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::within;
use rpc::{Client, InProcessRegistry, RpcError, Server, ServerHandle, ShuntStrategy};

#[rpc::service(name = "t.Paced")]
trait Paced {
    /// Answers after the server's configured delay.
    async fn work(&self) -> Result<(), RpcError>;
}

/// A server that answers after `delay` and counts the calls it served.
struct Pace {
    delay: Duration,
    served: Arc<AtomicUsize>,
}

impl Paced for Pace {
    async fn work(&self) -> Result<(), RpcError> {
        self.served.fetch_add(1, Ordering::Relaxed);
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Ok(())
    }
}

/// A server answering after `delay`, with `weight` metadata when given, and its call counter.
async fn server(
    reg: &InProcessRegistry,
    delay: Duration,
    weight: Option<&str>,
) -> (ServerHandle, Arc<AtomicUsize>) {
    let served = Arc::new(AtomicUsize::new(0));
    let mut b = Server::builder().registry(reg.clone());
    if let Some(w) = weight {
        b = b.metadata("weight", w);
    }
    let s = b
        .add_service(PacedServer::new(Pace {
            delay,
            served: served.clone(),
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (s, served)
}

/// `calls` calls from `callers` concurrent callers through one client of `strategy`.
async fn load(reg: &InProcessRegistry, strategy: ShuntStrategy, callers: usize, calls: usize) {
    let client = PacedClient::new(
        Client::builder()
            .registry(reg.clone())
            .shunt_strategy(strategy)
            .build(),
    );
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                for _ in 0..calls / callers {
                    client.work().await.expect("work");
                }
            })
        })
        .collect();
    for t in tasks {
        within("callers", t).await.expect("caller task");
    }
}

#[tokio::test]
async fn most_calls_go_to_the_fast_server_under_least_loaded() {
    // Two servers, one answering after 100 ms, the other at once; 8 callers, 200 calls.
    // Round robin sends the slow one exactly half (the control below). Least loaded sends it
    // calls only until its first answer shows its latency (100 ms against the fast one's
    // ~1 ms: its score stays above the fast one's while that has fewer than ~100 calls
    // outstanding, and only 8 ever are): at most a few per caller at the start.
    let reg = InProcessRegistry::new();
    let (fast, fast_served) = server(&reg, Duration::ZERO, None).await;
    let (slow, slow_served) = server(&reg, Duration::from_millis(100), None).await;
    load(&reg, ShuntStrategy::LeastLoaded, 8, 200).await;
    let (f, s) = (
        fast_served.load(Ordering::Relaxed),
        slow_served.load(Ordering::Relaxed),
    );
    assert_eq!(f + s, 200);
    assert!(s <= 20, "the slow server served {s} of 200 (fast {f})");

    // The control: round robin over the same servers gives the slow one half.
    fast_served.store(0, Ordering::Relaxed);
    slow_served.store(0, Ordering::Relaxed);
    load(&reg, ShuntStrategy::RoundRobin, 8, 48).await;
    assert_eq!(slow_served.load(Ordering::Relaxed), 24);
    within("shutdown", fast.shutdown()).await;
    within("shutdown", slow.shutdown()).await;
}

#[tokio::test]
async fn a_weight_3_instance_gets_about_three_times_the_calls_of_a_weight_1_one() {
    // Both answer after 10 ms, so their latencies are alike and the weight decides: with 32
    // callers, least loaded balances (outstanding + 1) / weight, which puts about three times
    // the calls in flight, hence three times the calls, on the weight-3 instance.
    let reg = InProcessRegistry::new();
    let (heavy, heavy_served) = server(&reg, Duration::from_millis(10), Some("3")).await;
    let (light, light_served) = server(&reg, Duration::from_millis(10), None).await;
    load(&reg, ShuntStrategy::LeastLoaded, 32, 960).await;
    let (h, l) = (
        heavy_served.load(Ordering::Relaxed),
        light_served.load(Ordering::Relaxed),
    );
    assert_eq!(h + l, 960);
    let ratio = h as f64 / l.max(1) as f64;
    assert!(
        (2.2..=4.5).contains(&ratio),
        "weight 3 served {h}, weight 1 served {l}: ratio {ratio:.2}"
    );
    within("shutdown", heavy.shutdown()).await;
    within("shutdown", light.shutdown()).await;
}
