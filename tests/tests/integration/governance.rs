//! The governance engine end to end over real TCP: client fallback and the breaker, events,
//! configuration layers, inherited deadlines, endpoint removal.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::within;
use rpc::crates::governance::breaker::BreakerState;
use rpc::crates::governance::config::GovernanceConfig;
use rpc::crates::governance::events::EventKind;
use rpc::{
    Client, GovernanceOptions, GovernanceOverrides, InProcessRegistry, RpcError, Server,
    ServerHandle, StatusCode,
};

#[rpc::service(name = "g.Stock")]
pub trait Stock {
    #[governance(retry_times = 0)]
    async fn level(&self, item: String) -> Result<u32, RpcError>;
    #[governance(timeout_ms = 800, retry_times = 2)]
    async fn budget_left_ms(&self) -> Result<u64, RpcError>;
    /// The level of `item`, as a stream of one item.
    async fn levels(&self, item: String) -> Result<rpc::RpcStream<u32>, RpcError>;
}

/// Fails with a server error (not the callee's answer) while `failing` is set; "unknown" is a
/// business error.
struct Warehouse {
    failing: AtomicU32,
    calls: AtomicU32,
}

impl Stock for Warehouse {
    async fn level(&self, item: String) -> Result<u32, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if item == "unknown" {
            return Err(RpcError::business("no such item"));
        }
        if self.failing.load(Ordering::SeqCst) > 0 {
            return Err(RpcError::new(StatusCode::ServerError, "database down"));
        }
        Ok(7)
    }
    async fn budget_left_ms(&self) -> Result<u64, RpcError> {
        let left = rpc::crates::governance::timeout::inherited()
            .map(|d| {
                d.saturating_duration_since(tokio::time::Instant::now())
                    .as_millis() as u64
            })
            .unwrap_or(u64::MAX);
        Ok(left)
    }
    async fn levels(&self, item: String) -> Result<rpc::RpcStream<u32>, RpcError> {
        Ok(rpc::RpcStream::iter([self.level(item).await?]))
    }
}

/// The client-side fallback: answers from a cache.
struct Cached;

impl Stock for Cached {
    async fn level(&self, item: String) -> Result<u32, RpcError> {
        if item == "uncached" {
            return Err(RpcError::new(StatusCode::ServerError, "cache miss"));
        }
        Ok(1)
    }
    async fn budget_left_ms(&self) -> Result<u64, RpcError> {
        Ok(0)
    }
    async fn levels(&self, _: String) -> Result<rpc::RpcStream<u32>, RpcError> {
        Ok(rpc::RpcStream::iter([1]))
    }
}

async fn warehouse(reg: &InProcessRegistry) -> (ServerHandle, Arc<Warehouse>) {
    let w = Arc::new(Warehouse {
        failing: AtomicU32::new(0),
        calls: AtomicU32::new(0),
    });
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(StockServer::from_arc(w.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (server, w)
}

fn level_method() -> &'static rpc::MethodDescriptor {
    &StockClient::methods()[0]
}

#[tokio::test]
async fn the_fallback_answers_failures_and_an_open_breaker_but_not_business_errors() {
    let reg = InProcessRegistry::new();
    let (server, w) = warehouse(&reg).await;
    let client = Client::builder()
        .registry(reg.clone())
        .default_options(GovernanceOptions {
            exceptions_allowed_before_breaking: 3,
            ..Default::default()
        })
        .fallback(StockServer::new(Cached))
        .build();
    let mut events = client.events().subscribe();
    let stock = StockClient::new(client.clone());

    assert_eq!(stock.level("apple".into()).await.unwrap(), 7);
    // The callee's own answer reaches the caller unchanged: no fallback.
    let e = stock.level("unknown".into()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::BusinessError);

    w.failing.store(1, Ordering::SeqCst);
    for _ in 0..3 {
        assert_eq!(
            stock.level("apple".into()).await.unwrap(),
            1,
            "fallback answer"
        );
    }
    assert!(matches!(
        client.breaker_state(level_method()),
        BreakerState::Open { .. }
    ));
    let before = w.calls.load(Ordering::SeqCst);
    // Open breaker: nothing is sent, and the fallback still answers.
    assert_eq!(stock.level("apple".into()).await.unwrap(), 1);
    assert_eq!(
        w.calls.load(Ordering::SeqCst),
        before,
        "an open breaker sends nothing"
    );

    // When the fallback fails too, the error carries both causes.
    let e = stock.level("uncached".into()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::FallbackExecFail);
    assert!(
        e.message().contains("circuit breaker") && e.message().contains("cache miss"),
        "{e}"
    );

    let kinds: Vec<EventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == EventKind::Fallback).count(),
        5,
        "{kinds:?}"
    );
    assert!(kinds.contains(&EventKind::Break), "{kinds:?}");

    // Manual reset closes it; the server has recovered meanwhile.
    w.failing.store(0, Ordering::SeqCst);
    client.reset_breaker(level_method());
    assert_eq!(stock.level("apple".into()).await.unwrap(), 7);
    server.shutdown().await;
}

#[tokio::test]
async fn each_configuration_layer_overrides_the_one_below() {
    let reg = InProcessRegistry::new();
    let (server, _w) = warehouse(&reg).await;
    let budget = &StockClient::methods()[1];

    // Code defaults < the method's attribute (timeout_ms = 800, retry_times = 2).
    let client = Client::builder()
        .registry(reg.clone())
        .default_options(GovernanceOptions {
            timeout_ms: 1000,
            retry_interval_ms: 9,
            ..Default::default()
        })
        .build();
    let o = client.options(budget);
    assert_eq!(
        (o.timeout_ms, o.retry_times, o.retry_interval_ms),
        (800, 2, 9)
    );

    // < config file.
    let dir = std::env::temp_dir().join(format!("rpc-gov-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("governance.toml");
    std::fs::write(
        &file,
        "[entries.\"g.Stock.budget_left_ms\"]\ntimeout_ms = 600\n",
    )
    .unwrap();
    let client = Client::builder()
        .registry(reg.clone())
        .config_file(&file)
        .expect("config file")
        .build();
    assert_eq!(client.options(budget).timeout_ms, 600);

    // < environment (the RPC_GOVERNANCE document).
    let env = GovernanceConfig::from_toml("services.\"g.Stock\".timeout_ms = 400").unwrap();
    let client = Client::builder()
        .registry(reg.clone())
        .config_layers(GovernanceConfig::from_file(&file).unwrap(), env)
        .build();
    assert_eq!(client.options(budget).timeout_ms, 400);

    // < runtime update, effective on the next call, observable through the inherited budget.
    client
        .update_options(
            "g.Stock.budget_left_ms",
            GovernanceOverrides {
                timeout_ms: Some(200),
                ..GovernanceOverrides::NONE
            },
        )
        .unwrap();
    assert_eq!(client.options(budget).timeout_ms, 200);
    let left = StockClient::new(client.clone())
        .budget_left_ms()
        .await
        .unwrap();
    assert!(left <= 200, "the server saw {left} ms left");

    // Reloading the file replaces that layer; a broken file is a clear error and changes nothing.
    std::fs::write(
        &file,
        "[entries.\"g.Stock.budget_left_ms\"]\ntimeout_ms = \"soon\"\n",
    )
    .unwrap();
    let e = client.reload_config(&file).unwrap_err();
    assert!(
        e.message().contains("governance.toml") && e.message().contains("timeout_ms"),
        "{e}"
    );
    assert_eq!(client.options(budget).timeout_ms, 200);
    let _ = std::fs::remove_dir_all(&dir);
    server.shutdown().await;
}

#[rpc::service(name = "g.Front")]
pub trait Front {
    #[governance(timeout_ms = 150)]
    async fn ask(&self) -> Result<u64, RpcError>;
}

struct FrontDesk {
    stock: StockClient,
}

impl Front for FrontDesk {
    async fn ask(&self) -> Result<u64, RpcError> {
        // This nested call has 800 ms of its own but inherits the caller's shorter budget.
        self.stock.budget_left_ms().await
    }
}

#[tokio::test]
async fn a_nested_call_inherits_what_is_left_of_the_callers_budget() {
    let reg = InProcessRegistry::new();
    let (back, _w) = warehouse(&reg).await;
    let inner = Client::builder().registry(reg.clone()).build();
    let front = Server::builder()
        .registry(reg.clone())
        .add_service(FrontServer::new(FrontDesk {
            stock: StockClient::new(inner),
        }))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let client = FrontClient::new(Client::builder().registry(reg.clone()).build());
    let left = within("nested call", client.ask()).await.unwrap();
    assert!(
        left <= 150,
        "the innermost handler had {left} ms, more than the outer 150 ms"
    );
    front.shutdown().await;
    back.shutdown().await;
}

/// The endpoint is the only one the client knows while it fails, so every call picks it (an
/// unhealthy endpoint is still used when nothing else is left) and the count really climbs
/// to n through the real path: select, connect, fail, health. Only then does a live server
/// appear; the removed endpoint gets none of its traffic.
#[tokio::test]
async fn an_endpoint_failing_n_times_in_a_row_is_dropped_while_others_serve() {
    use rpc::EndpointState;
    use rpc::{Instance, Registry};

    const N: u32 = 3;
    let reg = InProcessRegistry::new();
    // A dead address: nothing listens there.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    reg.register(Instance::new(dead.clone(), [StockClient::SERVICE_ID]))
        .await
        .unwrap();
    let client = Client::builder()
        .registry(reg.clone())
        .default_options(GovernanceOptions {
            unhealthy_times_allowed_before_removing: N,
            enable_circuit_breaker: false,
            ..Default::default()
        })
        .build();
    let mut events = client.events().subscribe();
    let stock = StockClient::new(client.clone());
    let state_of_dead = || {
        client
            .endpoints()
            .into_iter()
            .find(|e| e.address == dead)
            .expect("the dead endpoint is listed")
    };
    // Retries are off for `level`: one attempt, on the dead endpoint, per call.
    for i in 1..=N {
        let err = within("level", stock.level("apple".into()))
            .await
            .expect_err("nothing listens");
        assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
        let s = state_of_dead();
        assert_eq!(s.consecutive_failures, i, "{s:?}");
        if i < N {
            assert!(
                matches!(s.state, EndpointState::Unhealthy { .. }),
                "not removed after {i} < {N}: {s:?}"
            );
        } else {
            assert_eq!(s.state, EndpointState::Removed, "removed after {N}");
        }
    }
    let ejections: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.kind == EventKind::Ejection)
        .collect();
    assert_eq!(ejections.len(), N as usize, "{ejections:?}");
    for (i, e) in ejections.iter().enumerate() {
        assert_eq!(e.endpoint.as_deref(), Some(dead.as_str()));
        assert_eq!(&*e.entry, "g.Stock.level");
        let cause = e.cause.as_deref().unwrap_or("");
        assert!(cause.contains(&format!("({} in a row", i + 1)), "{cause}");
        assert_eq!(cause.contains("removed"), i + 1 == N as usize, "{cause}");
    }

    // A live server joins; the removed endpoint stays out while it serves.
    let (live, w) = warehouse(&reg).await;
    for _ in 0..20 {
        assert_eq!(
            within("level", stock.level("apple".into())).await.unwrap(),
            7
        );
    }
    assert_eq!(
        w.calls.load(Ordering::SeqCst),
        20,
        "every call went to the live server"
    );
    assert_eq!(state_of_dead().state, EndpointState::Removed);
    live.shutdown().await;
}

#[tokio::test]
async fn overflow_is_an_event_on_the_server_and_a_retry_event_on_the_client() {
    #[rpc::service(name = "g.Slow")]
    pub trait Slow {
        async fn hold(&self, #[hash_key] key: u32) -> Result<(), RpcError>;
    }
    struct Gate(tokio::sync::Semaphore, tokio::sync::Notify);
    impl Slow for Gate {
        async fn hold(&self, _key: u32) -> Result<(), RpcError> {
            self.1.notify_one();
            let _p = self.0.acquire().await;
            Ok(())
        }
    }
    let reg = InProcessRegistry::new();
    let gate = Arc::new(Gate(
        tokio::sync::Semaphore::new(0),
        tokio::sync::Notify::new(),
    ));
    let server = Server::builder()
        .registry(reg.clone())
        .max_concurrency(1)
        .add_service(SlowServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let mut server_events = server.events().subscribe();
    let client = Client::builder()
        .registry(reg.clone())
        .override_options(
            "g.Slow",
            GovernanceOverrides {
                retry_times: Some(1),
                retry_interval_ms: Some(0),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let mut client_events = client.events().subscribe();
    let slow = SlowClient::new(client);
    let first = tokio::spawn({
        let slow = slow.clone();
        async move { slow.hold(1).await }
    });
    // Once the first call holds the only slot, the second is refused at once, retried once
    // (there is no other endpoint) and refused again.
    within("first call entered", gate.1.notified()).await;
    let refused = within("second call", slow.hold(2)).await.unwrap_err();
    assert_eq!(refused.code(), StatusCode::OverflowMaxServerHandle);
    let overflow = within("server event", server_events.recv()).await.unwrap();
    assert_eq!(overflow.kind, EventKind::Overflow);
    assert_eq!(&*overflow.entry, "g.Slow.hold");
    let retry = within("client event", client_events.recv()).await.unwrap();
    assert_eq!(retry.kind, EventKind::Retry);
    assert_eq!(retry.attempt, 0);
    assert!(retry.cause.unwrap_or_default().contains("515"));
    gate.0.add_permits(10);
    within("first call", first).await.unwrap().unwrap();
    server.shutdown().await;
}

/// Options given in code are checked as a config file is: out of range, the calls fail with
/// an error naming the value, and nothing is sent (before, a `failure_ratio_percent` of 150 was
/// taken, and the breaker could never open).
#[tokio::test]
async fn options_given_in_code_out_of_range_fail_the_calls_naming_the_value() {
    let reg = InProcessRegistry::new();
    let (server, w) = warehouse(&reg).await;
    let impossible = GovernanceOverrides {
        failure_ratio_percent: Some(150),
        ..GovernanceOverrides::NONE
    };
    let built = StockClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options("g.Stock", impossible.clone())
            .build(),
    );
    let e = within("built with them", built.level("apple".into()))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message().contains("override_options for g.Stock")
            && e.message().contains("failure_ratio_percent = 150"),
        "{e}"
    );
    // The program's own defaults as well: a percentage above 100, an address without a port.
    let defaults = rpc::GovernanceOptions {
        outlier_max_ejection_percent: 101,
        appoint_address: Some("localhost".into()),
        ..Default::default()
    };
    let built = StockClient::new(
        Client::builder()
            .registry(reg.clone())
            .default_options(defaults)
            .build(),
    );
    let e = within("built with such defaults", built.level("apple".into()))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message().contains("default_options")
            && e.message().contains("outlier_max_ejection_percent = 101")
            && e.message().contains("appoint_address = \"localhost\""),
        "{e}"
    );
    let client = Client::builder().registry(reg.clone()).build();
    let handle = StockClient::new(client.with_options(impossible));
    let e = within("a handle with them", handle.level("apple".into()))
        .await
        .expect_err("refused");
    assert!(
        e.message().contains("Client::with_options")
            && e.message().contains("failure_ratio_percent = 150"),
        "{e}"
    );
    assert_eq!(w.calls.load(Ordering::SeqCst), 0, "nothing was sent");
    // The client itself is fine.
    assert_eq!(
        StockClient::new(client)
            .level("apple".into())
            .await
            .unwrap(),
        7
    );
    server.shutdown().await;
}

/// Connection limits no connection can work under are the builder's mistake, and the calls
/// fail with it, naming the setter: not with a failed handshake held against every server
/// (before, `max_frame_length(0)` made every answer too long, each endpoint was marked and
/// removed after three calls, and the breaker opened). A pool too large for memory is made
/// of at most 1024 connections per endpoint, and calls work (before, the first call panicked).
#[tokio::test]
async fn connection_limits_no_connection_works_under_fail_the_calls_naming_the_setter() {
    let reg = InProcessRegistry::new();
    let (server, w) = warehouse(&reg).await;
    for (builder, setter) in [
        (Client::builder().max_frame_length(0), "max_frame_length(0)"),
        (
            Client::builder().connect_timeout(std::time::Duration::ZERO),
            "connect_timeout(0)",
        ),
    ] {
        let client = StockClient::new(builder.registry(reg.clone()).build());
        for _ in 0..4 {
            let e = within("built so", client.level("apple".into()))
                .await
                .expect_err("refused");
            assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
            assert!(e.message().contains(setter), "{e}");
        }
    }
    assert_eq!(w.calls.load(Ordering::SeqCst), 0, "nothing was sent");
    let many = Client::builder()
        .registry(reg.clone())
        .connections_per_endpoint(usize::MAX)
        .build();
    let answer = tokio::spawn(async move { StockClient::new(many).level("apple".into()).await });
    let answer = within("a call", answer).await.expect("no panic");
    assert_eq!(answer.expect("answered"), 7);
    server.shutdown().await;
}

/// A call that first had to connect tells the server the budget left after connecting, not
/// the one it had before: here the server starts answering handshakes 300 ms after the call
/// began, so at most 800 − 300 ms are left when the call is sent. (On the paused clock: the
/// 300 ms pass as the test says, not as a busy machine stretches them.)
#[tokio::test(start_paused = true)]
async fn the_budget_sent_leaves_out_the_time_spent_connecting() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let reg = InProcessRegistry::new();
    rpc::Registry::register(&reg, rpc::Instance::new(addr.to_string(), ["g.Stock"]))
        .await
        .expect("register");
    let stock = StockClient::new(Client::builder().registry(reg.clone()).build());
    let call = tokio::spawn(async move { stock.budget_left_ms().await });
    // The client connects (the kernel accepts) and waits for the handshake's answer.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let server = Server::builder()
        .add_service(StockServer::from_arc(Arc::new(Warehouse {
            failing: AtomicU32::new(0),
            calls: AtomicU32::new(0),
        })))
        .serve_listener(listener)
        .await
        .expect("serve");
    let left = within("the call", call)
        .await
        .expect("joined")
        .expect("answered");
    assert!(
        (400..=500).contains(&left),
        "the server was told {left} ms of the 800 were left"
    );
    server.shutdown().await;
}

/// Rewrites `server`'s registry entry by hand to publish `timeout_ms` for the `g.Stock`
/// entry `method`, standing for a server whose build declares it; the instance published.
async fn publish_timeout(
    reg: &InProcessRegistry,
    server: &rpc::ServerHandle,
    method: &str,
    timeout_ms: u64,
) -> rpc::Instance {
    let mut published = rpc::Instance::new(server.local_addr().to_string(), ["g.Stock"]);
    published.id = server.instance_id().to_string();
    published.entries = vec![rpc::ServiceEntry {
        id: format!("g.Stock.{method}").into(),
        service_id: "g.Stock".into(),
        method: method.into(),
        hash_key: None,
        governance: GovernanceOverrides {
            timeout_ms: Some(timeout_ms),
            ..GovernanceOverrides::NONE
        },
        api: None,
    }];
    rpc::Registry::register(reg, published.clone())
        .await
        .unwrap();
    published
}

/// The first call of an entry already runs with what its servers publish: the client looks the
/// service up before it reads the call's options (before, only calls after the first did).
#[tokio::test]
async fn the_first_call_of_an_entry_applies_what_servers_publish() {
    let reg = InProcessRegistry::new();
    let (server, _w) = warehouse(&reg).await;
    // The server publishes 300 ms for `budget_left_ms`, whose attribute says 800.
    publish_timeout(&reg, &server, "budget_left_ms", 300).await;
    let stock = StockClient::new(Client::builder().registry(reg.clone()).build());
    let left = within("first call", stock.budget_left_ms()).await.unwrap();
    assert!(
        left <= 300,
        "the first call's budget was the attribute's, not the published 300 ms: {left} ms"
    );
    server.shutdown().await;
}

/// Options appointing `server`'s address.
fn appointed_to(server: &ServerHandle) -> GovernanceOverrides {
    GovernanceOverrides {
        shunt_strategy: Some(rpc::ShuntStrategy::Appoint),
        appoint_address: Some(server.local_addr().to_string().into()),
        ..GovernanceOverrides::NONE
    }
}

/// An appointed entry's first call waits for no registry, but its service is looked up in
/// the background: what its servers publish becomes a level of its options for later calls.
/// Before, an appointed entry never learnt it unless something else looked the service up.
#[tokio::test]
async fn an_appointed_entry_learns_what_servers_publish_after_its_first_call() {
    let reg = InProcessRegistry::new();
    let (server, _w) = warehouse(&reg).await;
    publish_timeout(&reg, &server, "level", 1234).await;
    let client = Client::builder()
        .registry(reg.clone())
        .override_options("g.Stock", appointed_to(&server))
        .build();
    let level = level_method();
    assert_ne!(client.options(level).timeout_ms, 1234);
    let stock = StockClient::new(client.clone());
    assert_eq!(stock.level("apple".into()).await.unwrap(), 7);
    within("the published level", async {
        while client.options(level).timeout_ms != 1234 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    server.shutdown().await;
}

/// `reg`, its first watch failing (unreachable), the others answered.
fn fails_once(reg: InProcessRegistry) -> common::registry::Watching {
    common::registry::Watching::new(reg, |n| {
        Box::pin(async move {
            match n {
                0 => Err(rpc::RegistryError::Unavailable("not this time".into())),
                _ => Ok(()),
            }
        })
    })
}

/// An appointed entry whose background lookup failed (the registry unreachable then) looks
/// its service up again on a later call or stream, and learns what its servers publish.
/// Before, the one lookup failed for good.
#[tokio::test(start_paused = true)]
async fn an_appointed_entry_looks_its_service_up_again_after_a_failed_lookup() {
    for (index, name) in [(0, "level"), (2, "levels")] {
        let reg = InProcessRegistry::new();
        let (server, _w) = warehouse(&reg).await;
        publish_timeout(&reg, &server, name, 1234).await;
        let client = Client::builder()
            .registry(fails_once(reg.clone()))
            .override_options("g.Stock", appointed_to(&server))
            .build();
        let method = &StockClient::methods()[index];
        let stock = StockClient::new(client.clone());
        let mut calls = 0;
        // A call every 100 ms, on the paused clock: the lookup is asked again a second after
        // it failed, by the next call.
        while client.options(method).timeout_ms != 1234 && calls < 50 {
            let level = within("a call", async {
                match index {
                    0 => stock.level("apple".into()).await,
                    _ => match stock.levels("apple".into()).await {
                        Ok(items) => items.collect_all().await.map(|l| l[0]),
                        Err(e) => Err(e),
                    },
                }
            });
            assert_eq!(level.await.unwrap(), 7);
            calls += 1;
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(
            client.options(method).timeout_ms,
            1234,
            "{name}: not learnt after {calls} calls"
        );
        server.shutdown().await;
    }
}

/// A value a server publishes that the client would refuse from its own configuration (a
/// percentage above 100) is left out, and the entry's other published values still apply.
/// Before, it was taken as it came.
#[tokio::test]
async fn a_published_value_out_of_range_is_ignored_and_the_rest_applies() {
    let reg = InProcessRegistry::new();
    let (server, _w) = warehouse(&reg).await;
    let level = level_method();
    let mut published = publish_timeout(&reg, &server, "level", 1234).await;
    published.entries[0].governance.outlier_max_ejection_percent = Some(250);
    rpc::Registry::register(&reg, published).await.unwrap();

    let client = Client::builder().registry(reg.clone()).build();
    let stock = StockClient::new(client.clone());
    assert_eq!(stock.level("apple".into()).await.unwrap(), 7);
    let options = client.options(level);
    assert_eq!(options.timeout_ms, 1234, "the published value in range");
    assert_eq!(
        options.outlier_max_ejection_percent,
        rpc::GovernanceOptions::default().outlier_max_ejection_percent,
        "the value out of range is not in force"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn what_servers_publish_is_used_unless_the_client_overrides_it() {
    let reg = InProcessRegistry::new();
    let (server, _w) = warehouse(&reg).await;
    let level = level_method();
    // A newer server publishes a longer timeout for `level` than this client's code declares
    // (the registry entry is rewritten by hand to stand for it).
    let mut published = publish_timeout(&reg, &server, "level", 1234).await;

    let client = Client::builder().registry(reg.clone()).build();
    let stock = StockClient::new(client.clone());
    assert_eq!(stock.level("apple".into()).await.unwrap(), 7);
    assert_eq!(
        client.options(level).timeout_ms,
        1234,
        "the published value"
    );
    assert_eq!(
        client.options(level).retry_times,
        0,
        "fields it does not publish stay"
    );

    // A change the registry announces reaches the cached pipeline.
    published.entries[0].governance.timeout_ms = Some(4321);
    rpc::Registry::register(&reg, published).await.unwrap();
    let deadline = tokio::time::Instant::now() + common::LIMIT;
    while client.options(level).timeout_ms != 4321 && tokio::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    assert_eq!(client.options(level).timeout_ms, 4321);

    // The client's own configuration wins over what servers publish.
    client
        .update_options(
            "g.Stock.level",
            GovernanceOverrides {
                timeout_ms: Some(99),
                ..GovernanceOverrides::NONE
            },
        )
        .unwrap();
    assert_eq!(client.options(level).timeout_ms, 99);
    server.shutdown().await;
}
