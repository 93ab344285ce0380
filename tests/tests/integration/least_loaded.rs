//! Load-aware balancing over real servers: under `shunt_strategy = least_loaded` a slow server
//! gets few calls and an instance's `weight` metadata shares the calls out; under `hash` with
//! `hash_balance_factor` a key moves past its owner while that holds too many calls.

use crate::common;

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

/// A server whose handler fails at once (500: say its own downstream is gone), counting the
/// calls it got.
struct Broken(Arc<AtomicUsize>);

impl Paced for Broken {
    async fn work(&self) -> Result<(), RpcError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Err(RpcError::new(
            rpc::StatusCode::FrameworkError,
            "the downstream is gone",
        ))
    }
}

/// An instance failing fast is not the fastest instance: under least loaded its failures
/// score as penalties, not as 0 ms answers, and most calls go to the healthy one (20 ms).
/// Before, the broken instance drew nearly every call. (On the paused clock.)
#[tokio::test(start_paused = true)]
async fn an_instance_failing_fast_gets_few_calls_under_least_loaded() {
    let reg = InProcessRegistry::new();
    let (healthy, healthy_served) = server(&reg, Duration::from_millis(20), None).await;
    let broken_served = Arc::new(AtomicUsize::new(0));
    let broken = Server::builder()
        .registry(reg.clone())
        .add_service(PacedServer::new(Broken(broken_served.clone())))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = least_loaded_once(
        &reg,
        rpc::GovernanceOverrides {
            enable_circuit_breaker: Some(false),
            ..rpc::GovernanceOverrides::NONE
        },
    );
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                for _ in 0..25 {
                    let _ = client.work().await;
                }
            })
        })
        .collect();
    for t in tasks {
        within("callers", t).await.expect("caller task");
    }
    let (h, b) = (
        healthy_served.load(Ordering::Relaxed),
        broken_served.load(Ordering::Relaxed),
    );
    assert_eq!(h + b, 200);
    assert!(
        b <= 40,
        "the broken instance got {b} of 200 calls (healthy {h})"
    );
    within("shutdown", healthy.shutdown()).await;
    within("shutdown", broken.shutdown()).await;
}

/// A least-loaded client of `t.Paced` whose calls are not retried, with `more` options.
fn least_loaded_once(reg: &InProcessRegistry, more: rpc::GovernanceOverrides) -> PacedClient {
    let mut overrides = rpc::GovernanceOverrides {
        retry_times: Some(0),
        ..rpc::GovernanceOverrides::NONE
    };
    overrides.merge(&more);
    PacedClient::new(
        Client::builder()
            .registry(reg.clone())
            .shunt_strategy(ShuntStrategy::LeastLoaded)
            .override_options(PacedClient::SERVICE_ID, overrides)
            .build(),
    )
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

#[tokio::test(start_paused = true)]
async fn most_calls_go_to_the_fast_server_under_least_loaded() {
    // Two servers, one answering after 100 ms, the other at once; 8 callers, 200 calls (on
    // the paused clock, so that the latencies are the servers' alone, not a busy machine's).
    // Round robin sends the slow one exactly half (the control below). Least loaded sends it
    // calls only until its first answer shows its latency (100 ms against the fast one's
    // ~1 ms: its score stays above the fast one's while that has fewer than ~10 000 calls
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

#[tokio::test(start_paused = true)]
async fn a_weight_3_instance_gets_about_three_times_the_calls_of_a_weight_1_one() {
    // Both answer after 50 ms, so their latencies are alike and the weight decides: with 32
    // callers, least loaded balances (outstanding + 1) / weight, which puts about three times
    // the calls in flight, hence three times the calls, on the weight-3 instance. On the
    // paused clock, so that the latencies are the servers' alone, not a busy machine's.)
    let reg = InProcessRegistry::new();
    let (heavy, heavy_served) = server(&reg, Duration::from_millis(50), Some("3")).await;
    let (light, light_served) = server(&reg, Duration::from_millis(50), None).await;
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

#[rpc::service(name = "t.Bounded")]
trait Bounded {
    /// Reports entry, waits for a permit the test hands out; returns the server's name.
    #[governance(shunt_strategy = "hash")]
    async fn hold(&self, #[hash_key] key: String) -> Result<String, RpcError>;
}

/// A server whose handlers report entry on a channel shared by all servers and wait for a
/// permit of their own server.
struct Gate {
    name: String,
    entered: tokio::sync::mpsc::UnboundedSender<String>,
    release: Arc<tokio::sync::Semaphore>,
}

impl Bounded for Gate {
    async fn hold(&self, _key: String) -> Result<String, RpcError> {
        let _ = self.entered.send(self.name.clone());
        common::let_through(&self.release).await?;
        Ok(self.name.clone())
    }
}

#[tokio::test]
async fn bounded_load_hashing_sends_a_key_past_its_busy_owner() {
    use std::collections::BTreeMap;
    use tokio::sync::{mpsc, Semaphore};

    let reg = InProcessRegistry::new();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let mut gates: BTreeMap<String, Arc<Semaphore>> = BTreeMap::new();
    let mut servers = Vec::new();
    for i in 0..3 {
        let name = format!("s{i}");
        let release = Arc::new(Semaphore::new(0));
        gates.insert(name.clone(), release.clone());
        servers.push(
            Server::builder()
                .registry(reg.clone())
                .add_service(BoundedServer::new(Gate {
                    name,
                    entered: entered_tx.clone(),
                    release,
                }))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    let client = Client::builder()
        .registry(reg.clone())
        .override_options(
            BoundedClient::SERVICE_ID,
            rpc::GovernanceOverrides {
                hash_balance_factor: Some(125),
                ..rpc::GovernanceOverrides::NONE
            },
        )
        .build();
    let bounded = BoundedClient::new(client.clone());
    let key = || "the-key".to_string();
    async fn next_entry(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
        within("a handler entered", rx.recv())
            .await
            .expect("entered")
    }

    // Calls of one key, held in their handlers, placed one at a time so that each entry shows
    // where it went. The first, with nothing outstanding (bound ⌈1.25 × 1 / 3⌉ = 1, and
    // 0 + 1 fits), goes to the key's owner.
    let mut calls = Vec::new();
    let first = {
        let b = bounded.clone();
        tokio::spawn(async move { b.hold(key()).await })
    };
    calls.push(first);
    let owner = next_entry(&mut entered).await;
    // With the owner holding 1 of 1 outstanding calls, the bound at 125 % is
    // ⌈1.25 × 2 / 3⌉ = 1: 1 + 1 is over, so the next call of the same key goes past the owner.
    let second = {
        let b = bounded.clone();
        tokio::spawn(async move { b.hold(key()).await })
    };
    calls.push(second);
    let moved = next_entry(&mut entered).await;
    assert_ne!(moved, owner, "the busy owner kept the key");

    // The control: with the bound off for one call, the key goes to its owner, busy or not.
    let unbounded = BoundedClient::new(client.with_options(rpc::GovernanceOverrides {
        hash_balance_factor: Some(0),
        ..rpc::GovernanceOverrides::NONE
    }));
    let third = tokio::spawn(async move { unbounded.hold(key()).await });
    calls.push(third);
    assert_eq!(next_entry(&mut entered).await, owner);

    for release in gates.values() {
        release.add_permits(calls.len());
    }
    for c in calls {
        within("a held call", c)
            .await
            .expect("task")
            .expect("the held call answers once released");
    }
    for s in servers {
        within("shutdown", s.shutdown()).await;
    }
}

/// A server that refuses every call at once (a cap of 0: Overflow) beside one answering in
/// 5 ms: the refusals come back faster than any answer, yet `least_loaded` sends it no more
/// than the first call or so, each refusal scoring as the failure penalty. Before, the
/// refusing server scored as the fastest and took nearly every call.
#[tokio::test(start_paused = true)]
async fn least_loaded_does_not_prefer_a_server_that_refuses_fast() {
    let reg = InProcessRegistry::new();
    let (_answering, answered) = server(&reg, Duration::from_millis(5), None).await;
    let refused = Arc::new(AtomicUsize::new(0));
    let _refusing = Server::builder()
        .registry(reg.clone())
        .max_concurrency(0)
        .add_service(PacedServer::new(Pace {
            delay: Duration::ZERO,
            served: refused.clone(),
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = least_loaded_once(&reg, rpc::GovernanceOverrides::NONE);
    let mut failed = 0;
    for _ in 0..20 {
        if within("a call", client.work()).await.is_err() {
            failed += 1;
        }
    }
    assert_eq!(
        refused.load(Ordering::Relaxed),
        0,
        "a cap of 0 runs nothing"
    );
    assert!(
        failed <= 2,
        "{failed} of 20 calls went to the refusing server"
    );
    assert_eq!(answered.load(Ordering::Relaxed), 20 - failed);
}
