//! The main demo: three servers and a client in one process on the embedded registry, and a short
//! report of what the framework does for each call.
//!
//! ```text
//! cargo run --release -p examples --bin demo
//! cargo run --release -p examples --features etcd --bin demo -- --registry etcd://127.0.0.1:2379
//! cargo run --release -p examples --features zookeeper --bin demo -- --registry zk://127.0.0.1:2181
//! cargo run --release -p examples --bin demo -- --admin 127.0.0.1:9901 --admin-token T
//! ```
//!
//! With `--admin ADDR` the demo serves the admin endpoint of its client and of gamma, its last
//! server,
//! prints `admin on <addr>` once it listens, and after its report stays up until Ctrl-C or
//! SIGTERM, so `rpcctl --admin ADDR status` can look at it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use rpc::{
    answered_by, Client, GovernanceOverrides, Registry, RpcError, Server, ServerHandle,
    ShuntStrategy,
};
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug)]
#[command(about = "Three servers and a client in one process, with a short report")]
struct Args {
    /// embedded (the default), static:FILE, etcd://host:port or zk://host:port.
    #[arg(long, default_value = "embedded")]
    registry: String,
    /// off, stdout (spans and metrics to standard output; build with --features otel) or otlp
    /// (OTLP/gRPC by the OTEL_* variables; --features otlp).
    #[arg(long, default_value = "off")]
    telemetry: String,
    /// Serve the admin endpoint of the demo's client and first server on host:port, loopback
    /// (port 0 picks a free one; printed as `admin on <addr>`), and stay up after the report.
    #[arg(long)]
    admin: Option<String>,
    /// The admin endpoint's token: requests send `Authorization: Bearer <token>`.
    #[arg(long)]
    admin_token: Option<String>,
}

/// A typed business error: travels as status 1000 and comes back as this type.
#[derive(Debug, Serialize, Deserialize)]
pub enum InventoryError {
    /// Not enough items.
    OutOfStock {
        /// Item asked for.
        item: String,
        /// How many are left.
        available: u32,
    },
    /// The call itself failed.
    Rpc(String),
}

impl From<RpcError> for InventoryError {
    fn from(e: RpcError) -> Self {
        InventoryError::Rpc(e.to_string())
    }
}

/// The demo's service.
#[rpc::service(name = "demo.Inventory")]
pub trait Inventory {
    /// Which server answered (to show the spread). Read-only, so safe to repeat elsewhere.
    #[governance(idempotent)]
    async fn whoami(&self) -> Result<String, RpcError>;
    /// Stock of an item; the item is the hash key.
    #[governance(shunt_strategy = "hash", idempotent)]
    async fn stock(&self, #[hash_key] item: String) -> Result<u32, RpcError>;
    /// Holds the call `hold_ms` on the item's server (to fill its cap).
    #[governance(shunt_strategy = "hash", retry_interval_ms = 10)]
    async fn hold(&self, #[hash_key] item: String, hold_ms: u64) -> Result<String, RpcError>;
    /// Reserves `count` items or answers a typed error.
    async fn reserve(&self, item: String, count: u32) -> Result<u32, InventoryError>;
}

struct Store {
    name: String,
    left: AtomicU32,
}

impl Inventory for Store {
    async fn whoami(&self) -> Result<String, RpcError> {
        Ok(self.name.clone())
    }
    async fn stock(&self, _item: String) -> Result<u32, RpcError> {
        Ok(self.left.load(Ordering::Relaxed))
    }
    async fn hold(&self, _item: String, hold_ms: u64) -> Result<String, RpcError> {
        tokio::time::sleep(Duration::from_millis(hold_ms)).await;
        Ok(self.name.clone())
    }
    async fn reserve(&self, item: String, count: u32) -> Result<u32, InventoryError> {
        let available = self.left.load(Ordering::Relaxed);
        if count > available {
            return Err(InventoryError::OutOfStock { item, available });
        }
        Ok(self.left.fetch_sub(count, Ordering::Relaxed) - count)
    }
}

async fn start(
    registry: &Arc<dyn Registry>,
    name: &str,
) -> Result<ServerHandle, Box<dyn std::error::Error>> {
    Ok(Server::builder()
        .shared_registry(registry.clone())
        // A cap of 1 makes overflow easy to show.
        .max_concurrency(1)
        .add_service(InventoryServer::new(Store {
            name: name.to_string(),
            left: AtomicU32::new(10),
        }))
        .serve("127.0.0.1:0")
        .await?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let _telemetry = examples::init_telemetry(&args.telemetry).unwrap_or_else(|e| {
        eprintln!("demo: {e}");
        std::process::exit(2);
    });
    let registry = <dyn Registry>::from_url(&args.registry).await?;
    let mut servers = Vec::new();
    let mut names = BTreeMap::new();
    for name in ["alpha", "beta", "gamma"] {
        let s = start(&registry, name).await?;
        names.insert(s.local_addr().to_string(), name);
        servers.push(s);
    }
    println!("== three servers on the {} registry ==", args.registry);
    for (addr, name) in &names {
        println!("  {name:<6} {addr}");
    }
    let name_of = |addr: &Option<String>| {
        addr.as_deref()
            .and_then(|a| names.get(a).copied())
            .unwrap_or("?")
            .to_string()
    };

    let client = Client::builder().shared_registry(registry.clone()).build();
    let inventory = InventoryClient::new(client.clone());
    let admin = examples::start_admin(
        args.admin.as_deref(),
        args.admin_token.as_deref(),
        Some(&client),
        // The last server: the failover section stops the first.
        servers.last(),
    )
    .await?;

    println!("\n== round robin: 30 calls ==");
    let mut spread: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..30 {
        *spread.entry(inventory.whoami().await?).or_default() += 1;
    }
    println!("  {spread:?}");

    println!(
        "\n== consistent hash: each item always lands on the same server, for every client =="
    );
    let other = InventoryClient::new(Client::builder().shared_registry(registry.clone()).build());
    for item in ["apple", "pear", "plum", "fig", "kiwi"] {
        let mut seen = Vec::new();
        for c in [&inventory, &other, &inventory] {
            let (_, by) = answered_by(c.stock(item.to_string())).await;
            seen.push(name_of(&by));
        }
        let sticky = seen.windows(2).all(|w| w[0] == w[1]);
        println!(
            "  {item:<6} -> {} (two clients, three calls: {})",
            seen[0],
            if sticky { "same server" } else { "MOVED" }
        );
    }

    println!("\n== overflow: server cap 1, two concurrent calls for one item ==");
    let (a, b) = tokio::join!(
        answered_by(inventory.hold("apple".into(), 200)),
        answered_by(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            inventory.hold("apple".into(), 10).await
        })
    );
    println!("  first : {} (answered by {})", a.0.is_ok(), name_of(&a.1));
    let moved = a.0.is_ok() && b.0.is_ok() && a.1 != b.1;
    println!(
        "  second: {} (answered by {}){}",
        b.0.is_ok(),
        name_of(&b.1),
        if moved {
            " - the owner answered Overflow (515) at once, the call was retried on the next server of the ring"
        } else {
            " - no overflow this time"
        }
    );

    println!("\n== failover: one server stops ==");
    let victim = servers.remove(0);
    let victim_name = names[&victim.local_addr().to_string()];
    victim.abort();
    let mut ok = 0;
    let mut failed = 0;
    let mut spread: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..12 {
        match inventory.whoami().await {
            Ok(n) => {
                ok += 1;
                *spread.entry(n).or_default() += 1;
            }
            Err(e) => {
                failed += 1;
                println!("  failed: {e}");
            }
        }
    }
    println!("  {victim_name} stopped (still in the registry, as after a crash); 12 calls: {ok} ok, {failed} failed, spread {spread:?}");

    println!("\n== typed business error ==");
    let pinned = InventoryClient::new(
        Client::builder()
            .shared_registry(registry.clone())
            .override_options(
                "demo.Inventory.reserve",
                GovernanceOverrides {
                    shunt_strategy: Some(ShuntStrategy::Appoint),
                    appoint_address: Some(servers[0].local_addr().to_string().into()),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    println!(
        "  reserve 4 apples  -> {:?}",
        pinned.reserve("apple".into(), 4).await
    );
    match pinned.reserve("apple".into(), 40).await {
        Err(InventoryError::OutOfStock { item, available }) => {
            println!("  reserve 40 apples -> InventoryError::OutOfStock {{ item: {item:?}, available: {available} }} (typed, status 1000, no retry, no failover)")
        }
        other => println!("  reserve 40 apples -> unexpected {other:?}"),
    }

    governance(&registry).await?;

    if let Some(admin) = admin {
        println!(
            "\n== admin endpoint on {} (the client, and gamma as the server; Ctrl-C to stop) ==",
            admin.local_addr()
        );
        wait_for_stop().await?;
        admin.shutdown().await;
    }
    for s in servers {
        s.shutdown().await;
    }
    client.close();
    Ok(())
}

/// Prices come from a service that can fail; a cached price list answers when it does.
#[rpc::service(name = "demo.Pricing")]
pub trait Pricing {
    /// The price of an item, in cents.
    #[governance(
        retry_times = 0,
        exceptions_allowed_before_breaking = 3,
        breaker_seconds = 1
    )]
    async fn quote(&self, item: String) -> Result<u32, RpcError>;
    /// A quote that takes `ms` milliseconds to compute.
    #[governance(timeout_ms = 100)]
    async fn slow_quote(&self, item: String, ms: u64) -> Result<u32, RpcError>;
}

struct PriceEngine {
    down: std::sync::atomic::AtomicBool,
    cancelled: Arc<AtomicU32>,
}

/// Counts handlers that were stopped before they finished.
struct CountIfDropped(Arc<AtomicU32>, bool);

impl Drop for CountIfDropped {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Pricing for PriceEngine {
    async fn quote(&self, _item: String) -> Result<u32, RpcError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(RpcError::new(
                rpc::StatusCode::ServerError,
                "price database unreachable",
            ));
        }
        Ok(250)
    }
    async fn slow_quote(&self, _item: String, ms: u64) -> Result<u32, RpcError> {
        let mut guard = CountIfDropped(self.cancelled.clone(), false);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        guard.1 = true;
        Ok(260)
    }
}

/// Yesterday's prices: the client-side fallback.
struct PriceList;

impl Pricing for PriceList {
    async fn quote(&self, _item: String) -> Result<u32, RpcError> {
        Ok(240)
    }
    async fn slow_quote(&self, _item: String, _ms: u64) -> Result<u32, RpcError> {
        Ok(240)
    }
}

async fn governance(registry: &Arc<dyn Registry>) -> Result<(), Box<dyn std::error::Error>> {
    println!("\n== governance ==");
    let engine = Arc::new(PriceEngine {
        down: false.into(),
        cancelled: Arc::new(AtomicU32::new(0)),
    });
    let server = Server::builder()
        .shared_registry(registry.clone())
        .add_service(PricingServer::from_arc(engine.clone()))
        .serve("127.0.0.1:0")
        .await?;
    let client = Client::builder()
        .shared_registry(registry.clone())
        .fallback(PricingServer::new(PriceList))
        .build();
    let mut events = client.events().subscribe();
    let pricing = PricingClient::new(client.clone());
    let quote = &PricingClient::methods()[0];

    println!(
        "  quote            -> {:?} (live price)",
        pricing.quote("apple".into()).await
    );
    engine.down.store(true, Ordering::Relaxed);
    for i in 1..=3 {
        println!(
            "  quote, server failing #{i} -> {:?} (the fallback's cached price), breaker {:?}",
            pricing.quote("apple".into()).await,
            client.breaker_state(quote)
        );
    }
    println!(
        "  quote, breaker open -> {:?}: nothing is sent, the fallback still answers",
        pricing.quote("apple".into()).await
    );
    engine.down.store(false, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    println!(
        "  after breaker_seconds = 1: a probe goes through -> {:?}, breaker {:?}",
        pricing.quote("apple".into()).await,
        client.breaker_state(quote)
    );

    let no_fallback =
        PricingClient::new(Client::builder().shared_registry(registry.clone()).build());
    let started = tokio::time::Instant::now();
    let timed_out = no_fallback.slow_quote("apple".into(), 1000).await;
    println!(
        "  slow_quote(1000 ms) with timeout_ms = 100 -> {} after {} ms",
        timed_out
            .map(|v| v.to_string())
            .unwrap_or_else(|e| e.code().to_string()),
        started.elapsed().as_millis()
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    println!(
        "  server handlers stopped before finishing: {} (Cancel reached the server)",
        engine.cancelled.load(Ordering::Relaxed)
    );
    no_fallback.client().update_options(
        "demo.Pricing.slow_quote",
        GovernanceOverrides {
            timeout_ms: Some(2000),
            ..GovernanceOverrides::NONE
        },
    )?;
    println!(
        "  runtime update timeout_ms = 2000, same call -> {:?} (no restart, no cache clear)",
        no_fallback.slow_quote("apple".into(), 200).await
    );

    let mut counts: BTreeMap<&'static str, u32> = BTreeMap::new();
    while let Ok(e) = events.try_recv() {
        *counts.entry(e.kind.as_str()).or_default() += 1;
    }
    println!("  governance events seen by the first client: {counts:?}");
    server.shutdown().await;
    Ok(())
}

/// Waits for Ctrl-C or SIGTERM.
async fn wait_for_stop() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}
