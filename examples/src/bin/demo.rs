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
//!
//! Over etcd (`--registry etcd://HOST:PORT`, built with `--features etcd`) the report ends with
//! a control-plane section: rules written to etcd steer a running client, a 95/5 routing split
//! sends the canary its share of the calls, and a governance rule set with `rpcctl` changes the
//! next calls (module `control_plane`). On any other registry the section prints one line saying
//! what it needs.

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
    /// embedded (the default), etcd://host:port or zk://host:port: a registry the demo's
    /// servers publish their free ports to (a static list cannot name them).
    #[arg(long, default_value = "embedded")]
    registry: String,
    /// off, stdout (spans and metrics to standard output; build with --features otel) or otlp
    /// (OTLP/gRPC by the OTEL_* variables; --features otlp).
    #[arg(long, default_value = "off")]
    telemetry: String,
    /// Serve the admin endpoint of the demo's client and last server (gamma) on host:port, loopback
    /// (port 0 picks a free one; printed as `admin on <addr>`), and stay up after the report.
    #[arg(long)]
    admin: Option<String>,
    /// The admin endpoint's token: requests send `Authorization: Bearer <token>`.
    #[arg(long, requires = "admin")]
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
    let url = args.registry.trim();
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    let publishes =
        url.eq_ignore_ascii_case("embedded") || matches!(scheme.as_deref(), Some("etcd" | "zk"));
    if !publishes {
        eprintln!(
            "demo: --registry {url}: the demo's servers listen on free ports, which only a \
             registry they publish to can tell the client: give embedded, etcd://host:port or \
             zk://host:port"
        );
        std::process::exit(2);
    }
    let registry = <dyn Registry>::from_url(url).await?;
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

    #[cfg(feature = "etcd")]
    if rpc::EtcdRegistry::is_etcd_url(&args.registry) {
        control_plane::run(args.registry.trim()).await?;
    } else {
        control_plane_needs_etcd();
    }
    #[cfg(not(feature = "etcd"))]
    control_plane_needs_etcd();

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

/// The control-plane section's one line on a registry other than etcd.
fn control_plane_needs_etcd() {
    println!(
        "\n== control plane: needs --registry etcd://HOST:PORT and a build with --features etcd \
         (rules live in etcd); start a local etcd with `etcd --data-dir /tmp/etcd` (it listens \
         on 127.0.0.1:2379) =="
    );
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

/// The control-plane section, over etcd: rules written in one place steer a client that is
/// already running.
///
/// Three servers of `demo.Catalog` publish instance metadata `version = stable` (two) or
/// `version = canary` (one); a client built with `.rules(store)` follows the rule store. A
/// routing document splits the service 95/5 between the two versions, and the share of calls
/// the canary answered is counted from the answers themselves (each server answers with its own
/// name), not from the router. Then a governance document written with `rpcctl rules set` cuts
/// `lookup`'s deadline below the time its server takes, and the next calls time out. The
/// documents in force before the section are written back at its end.
#[cfg(feature = "etcd")]
mod control_plane {
    use std::collections::BTreeMap;
    use std::error::Error;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::time::Duration;

    use rpc::{
        Client, EtcdRegistry, EventKind, GovernanceEvent, Registry, RpcError, RuleKind, RuleStore,
        Server, StatusCode,
    };
    use tokio::sync::broadcast;

    /// How long `lookup`'s server takes.
    const LOOKUP_MS: u64 = 100;
    /// The calls the canary split is measured over.
    const SPLIT_CALLS: usize = 2000;
    /// The `lookup` calls before and after the governance rule changes.
    const LOOKUPS: usize = 5;
    /// The longest wait for the client to apply a version it was sent.
    const APPLY_WITHIN: Duration = Duration::from_secs(5);

    /// The routing document: 95 % of `demo.Catalog`'s calls to the stable instances, 5 % to the
    /// canary.
    const SPLIT: &str = r#"# demo.Catalog: 95 % of the calls to version = stable, 5 % to version = canary
[[routes]]
name = "catalog-canary-split"
service = "demo.Catalog"
to = [
  { tags = { version = "stable" }, weight = 95 },
  { tags = { version = "canary" }, weight = 5 },
]
"#;

    /// The governance document the section starts from: `lookup` has a second to answer.
    const BASELINE: &str = r#"[entries."demo.Catalog.lookup"]
timeout_ms = 1000
"#;

    /// The governance document written from the command line: `lookup`'s deadline becomes
    /// shorter than the time its server takes.
    const CUT: &str = r#"# lookup's deadline cut to 30 ms, below the 100 ms its server takes
[entries."demo.Catalog.lookup"]
timeout_ms = 30
"#;

    /// What the section writes at its end for a kind that had no document before it.
    const EMPTY: &str = "# no rules\n";

    /// The section's service.
    #[rpc::service(name = "demo.Catalog")]
    pub trait Catalog {
        /// The name of the instance that answered (`stable-1`, `stable-2` or `canary`).
        #[governance(idempotent)]
        async fn whoami(&self) -> Result<String, RpcError>;
        /// A lookup its server takes `LOOKUP_MS` to answer. No breaker, so the counts show
        /// the deadline's effect alone.
        #[governance(timeout_ms = 1000, enable_circuit_breaker = false)]
        async fn lookup(&self, item: String) -> Result<String, RpcError>;
    }

    struct Shelf {
        name: &'static str,
    }

    impl Catalog for Shelf {
        async fn whoami(&self) -> Result<String, RpcError> {
            Ok(self.name.to_string())
        }
        async fn lookup(&self, item: String) -> Result<String, RpcError> {
            tokio::time::sleep(Duration::from_millis(LOOKUP_MS)).await;
            Ok(format!("{item} on {}", self.name))
        }
    }

    /// Runs the section against the etcd of `url` (`etcd://host:port`).
    pub async fn run(url: &str) -> Result<(), Box<dyn Error>> {
        println!("\n== control plane: rules in etcd steer a running client ==");
        let etcd = EtcdRegistry::from_url(url).await?;
        let store = etcd.rules();
        let registry: Arc<dyn Registry> = Arc::new(etcd);
        let mut servers = Vec::new();
        for (name, version) in [
            ("stable-1", "stable"),
            ("stable-2", "stable"),
            ("canary", "canary"),
        ] {
            let server = Server::builder()
                .shared_registry(registry.clone())
                .metadata("version", version)
                .add_service(CatalogServer::new(Shelf { name }))
                .serve("127.0.0.1:0")
                .await?;
            println!(
                "  {name:<8} {} (demo.Catalog, version = {version})",
                server.local_addr()
            );
            servers.push(server);
        }

        let before = [
            store.get(RuleKind::Governance).await?,
            store.get(RuleKind::Routing).await?,
        ];
        let result = steer(url, &store, &registry).await;

        // Put back what was in force before the section, whatever happened in it.
        let mut restored = Vec::new();
        for (kind, old) in [RuleKind::Governance, RuleKind::Routing]
            .into_iter()
            .zip(before)
        {
            let text = old.as_ref().map_or(EMPTY, |v| &*v.text);
            match store.put(kind, text).await {
                Ok(v) => restored.push(format!("{kind} version {v}")),
                Err(e) => restored.push(format!("{kind} not restored ({e})")),
            }
        }
        println!(
            "  the rules in force before this section are written back: {} \
             (`rpcctl --registry {url} rules history governance` lists every version)",
            restored.join(", ")
        );
        for s in servers {
            s.shutdown().await;
        }
        result
    }

    /// Writes the rules and shows their effect on a client that follows them.
    async fn steer(
        url: &str,
        store: &RuleStore,
        registry: &Arc<dyn Registry>,
    ) -> Result<(), Box<dyn Error>> {
        let baseline = store.put(RuleKind::Governance, BASELINE).await?;
        let split = store.put(RuleKind::Routing, SPLIT).await?;
        println!(
            "  written to etcd: routing version {split} (95/5 stable/canary), governance \
             version {baseline} (lookup timeout_ms = 1000)"
        );
        let client = Client::builder()
            .shared_registry(registry.clone())
            .rules(store.clone())
            .build();
        let mut events = client.events().subscribe();
        let catalog = CatalogClient::new(client.clone());
        for (kind, version) in [(RuleKind::Routing, split), (RuleKind::Governance, baseline)] {
            if let Err(e) = applied(&client, &mut events, kind, version).await {
                println!("  {e}; the rest of the section is skipped");
                client.close();
                return Ok(());
            }
        }
        println!(
            "  a client built with .rules(store) applied routing version {split} and governance \
             version {baseline} (rule_applied events)"
        );

        // (a) The canary split, counted from the answers.
        let mut answers: BTreeMap<String, usize> = BTreeMap::new();
        let mut failed = 0;
        for _ in 0..SPLIT_CALLS {
            match catalog.whoami().await {
                Ok(name) => *answers.entry(name).or_default() += 1,
                Err(_) => failed += 1,
            }
        }
        let canary = answers.get("canary").copied().unwrap_or(0);
        println!(
            "  canary share: {:.1} % of {SPLIT_CALLS} calls (rule 95/5, version {})",
            100.0 * canary as f64 / SPLIT_CALLS as f64,
            client.rules_version(RuleKind::Routing).unwrap_or(split)
        );
        println!("  answered by {answers:?}, {failed} failed");

        // (b) A governance rule from the command line changes the next calls.
        let (ok, timed_out, other) = lookups(&catalog).await;
        println!(
            "  lookup x{LOOKUPS} before, governance version {} (timeout_ms = {}, the server \
             takes {LOOKUP_MS} ms): {ok} ok, {timed_out} timed out{other}",
            version_of(&client),
            lookup_timeout(&client)
        );
        let file =
            std::env::temp_dir().join(format!("demo-governance-{}.toml", std::process::id()));
        std::fs::write(&file, CUT)?;
        let written = write_from_cli(url, store, &file).await;
        let _ = std::fs::remove_file(&file);
        let cut = written?;
        if let Err(e) = applied(&client, &mut events, RuleKind::Governance, cut).await {
            println!("  {e}");
            client.close();
            return Ok(());
        }
        println!("  the running client applied governance version {cut} (rule_applied)");
        let (ok, timed_out, other) = lookups(&catalog).await;
        println!(
            "  lookup x{LOOKUPS} after,  governance version {} (timeout_ms = {}, the server \
             takes {LOOKUP_MS} ms): {ok} ok, {timed_out} timed out{other}",
            version_of(&client),
            lookup_timeout(&client)
        );
        client.close();
        Ok(())
    }

    /// The governance version the client applied, as text.
    fn version_of(client: &Client) -> String {
        client
            .rules_version(RuleKind::Governance)
            .map_or_else(|| "none".to_string(), |v| v.to_string())
    }

    /// `lookup`'s deadline in force on `client`, whichever level set it.
    fn lookup_timeout(client: &Client) -> u64 {
        CatalogClient::methods()
            .iter()
            .find(|m| m.method == "lookup")
            .map_or(0, |m| client.options(m).timeout_ms)
    }

    /// `LOOKUPS` calls of `lookup`: how many answered, how many timed out, and the other
    /// outcomes (empty when none).
    async fn lookups(catalog: &CatalogClient) -> (usize, usize, String) {
        let (mut ok, mut timed_out) = (0, 0);
        let mut other: BTreeMap<String, usize> = BTreeMap::new();
        for _ in 0..LOOKUPS {
            match catalog.lookup("apple".into()).await {
                Ok(_) => ok += 1,
                Err(e) if e.code() == StatusCode::Timeout => timed_out += 1,
                Err(e) => *other.entry(e.to_string()).or_default() += 1,
            }
        }
        let other = if other.is_empty() {
            String::new()
        } else {
            format!(", other errors {other:?}")
        };
        (ok, timed_out, other)
    }

    /// Writes the governance document in `file` the way an operator does, with `rpcctl
    /// --registry URL rules set governance FILE` (the `rpcctl` beside this program); when it is
    /// not built, or fails, through `RuleStore::put`, the call `rpcctl` makes. Returns the
    /// version written.
    async fn write_from_cli(
        url: &str,
        store: &RuleStore,
        file: &Path,
    ) -> Result<i64, Box<dyn Error>> {
        let rpcctl = rpcctl_path()?;
        let why_not = if rpcctl.is_file() {
            match run_rpcctl(&rpcctl, url, file).await {
                Ok(version) => {
                    println!(
                        "  written by rpcctl ({} --registry {url} rules set governance {}): \
                         governance version {version}",
                        rpcctl.display(),
                        file.display()
                    );
                    return Ok(version);
                }
                Err(e) => format!("{} failed: {e}", rpcctl.display()),
            }
        } else {
            format!(
                "rpcctl is not built beside the demo, at {}; `cargo build -p rpcctl` builds it",
                rpcctl.display()
            )
        };
        let version = store.put(RuleKind::Governance, CUT).await?;
        println!(
            "  written by RuleStore::put, the call `rpcctl rules set` makes ({why_not}): \
             governance version {version}"
        );
        Ok(version)
    }

    /// Where `rpcctl` is expected: beside this program.
    fn rpcctl_path() -> std::io::Result<PathBuf> {
        Ok(std::env::current_exe()?
            .with_file_name(format!("rpcctl{}", std::env::consts::EXE_SUFFIX)))
    }

    /// Runs `rpcctl --registry URL rules set governance FILE`; the version it printed
    /// (`governance rules written: version N`).
    async fn run_rpcctl(rpcctl: &Path, url: &str, file: &Path) -> Result<i64, String> {
        let mut command = std::process::Command::new(rpcctl);
        command
            .args(["--registry", url, "rules", "set", "governance"])
            .arg(file);
        // rpcctl's requests to etcd are bounded by its own timeouts (3 s each).
        let out = tokio::task::spawn_blocking(move || command.output())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        stdout
            .trim()
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("no version in its output {:?}", stdout.trim()))
    }

    /// Waits until `client` has applied `version` (or a later one) of `kind`: on its
    /// `rule_applied` events, within `APPLY_WITHIN`. A refusal (`rule_rejected`) or no answer in
    /// time is an error saying so.
    async fn applied(
        client: &Client,
        events: &mut broadcast::Receiver<GovernanceEvent>,
        kind: RuleKind,
        version: i64,
    ) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + APPLY_WITHIN;
        let entry = format!("rules/{kind}");
        // Bounded in count as in time: a busy client emits other events meanwhile.
        for _ in 0..100_000 {
            // Checked before each wait: the version may have been applied before the
            // subscription.
            if client.rules_version(kind).is_some_and(|v| v >= version) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Err(_) => break,
                Ok(Ok(e))
                    if e.kind == EventKind::RuleRejected
                        && *e.entry == *entry
                        && e.rule_version == Some(version) =>
                {
                    return Err(format!(
                        "the client refused {kind} version {version}: {}",
                        e.cause.unwrap_or_default()
                    ));
                }
                Ok(Ok(_)) | Ok(Err(broadcast::error::RecvError::Lagged(_))) => {}
                Ok(Err(broadcast::error::RecvError::Closed)) => break,
            }
        }
        Err(format!(
            "the client did not apply {kind} version {version} within {APPLY_WITHIN:?} \
             (in force: {:?})",
            client.rules_version(kind)
        ))
    }
}
