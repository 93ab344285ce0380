//! The cost model: allocations per call, memory per idle connection, and memory over many
//! calls, measured in one process with a counting allocator (server and client together).
//!
//! ```text
//! cargo run --release -p examples --bin costs -- [--calls N] [--concurrency C] [--idle K] [--layers L] [--scale-only]
//! cargo run --release -p examples --features tower --bin costs -- --tower-layers L
//! ```
//! Prints `call_future_bytes=…` (the state of one proxy call), `allocs_per_call=… bytes_per_call=…`, `idle_connection_kib=…`, the resident memory
//! after each tenth of the calls, so that growth shows, and `scale:` — calls per second and
//! allocations per call before and after the client and server hold 10 000 entries and the
//! service has 1 000 endpoints. Figures, not assertions.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use examples::{Echo, EchoClient, EchoServer, EchoService};
use rpc::crates::transport::{ConnectOptions, Connection};
use rpc::{Client, Server, StaticRegistry};

/// Counts allocations and allocated bytes, then defers to the system allocator.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the same arguments; counting has no effect on
// the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Parser, Debug)]
#[command(about = "Allocations per call, memory per idle connection, memory over many calls")]
struct Args {
    /// Calls measured.
    #[arg(long, default_value_t = 1_000_000)]
    calls: u64,
    /// Callers at once.
    #[arg(long, default_value_t = 64)]
    concurrency: u64,
    /// Idle connections opened for the per-connection figure.
    #[arg(long, default_value_t = 1000)]
    idle: usize,
    /// Payload bytes.
    #[arg(long, default_value_t = 32)]
    payload: usize,
    /// Entries added for the scale figure.
    #[arg(long, default_value_t = 10_000)]
    entries: usize,
    /// Endpoints of the echo service for the scale figure.
    #[arg(long, default_value_t = 1000)]
    endpoints: usize,
    /// Pass-through server layers installed on the measured server (the cost of middleware).
    #[arg(long, default_value_t = 0)]
    layers: usize,
    /// Print only the `scale:` line (skips the allocation and memory figures).
    #[arg(long)]
    scale_only: bool,
    /// Pass-through `tower` layers installed through `rpc::tower::TowerLayer` (feature `tower`).
    #[cfg(feature = "tower")]
    #[arg(long, default_value_t = 0)]
    tower_layers: usize,
}

/// A tower layer that adds nothing: what the adapter costs by itself.
#[cfg(feature = "tower")]
struct TowerIdentity;

#[cfg(feature = "tower")]
impl rpc::tower::Layer<rpc::tower::NextService> for TowerIdentity {
    type Service = rpc::tower::NextService;
    fn layer(&self, inner: rpc::tower::NextService) -> rpc::tower::NextService {
        inner
    }
}

/// A server layer that hands every call on unchanged: what a layer costs by itself.
struct PassThrough;

impl rpc::ServerLayer for PassThrough {
    fn call<'a>(
        &'a self,
        req: &'a mut rpc::ServerRequest,
        next: rpc::ServerNext<'a>,
    ) -> rpc::LayerFuture<'a> {
        Box::pin(next.run(req))
    }
}

/// A service with many entries (`wide.Wide.m<i>`), each answering its argument list.
struct Wide(&'static [rpc::MethodDescriptor]);

impl Wide {
    fn new(n: usize) -> Self {
        let methods: Vec<rpc::MethodDescriptor> = (0..n)
            .map(|i| rpc::MethodDescriptor {
                service_id: "wide.Wide",
                method: Box::leak(format!("m{i}").into_boxed_str()),
                entry_id: Box::leak(format!("wide.Wide.m{i}").into_boxed_str()),
                hash_key: None,
                governance: rpc::GovernanceOverrides::NONE,
                api: None,
            })
            .collect();
        Wide(Box::leak(methods.into_boxed_slice()))
    }
}

impl rpc::Service for Wide {
    fn service_id(&self) -> &'static str {
        "wide.Wide"
    }
    fn methods(&self) -> &'static [rpc::MethodDescriptor] {
        self.0
    }
    fn call(&self, _method: usize, params: bytes::Bytes, _codec: rpc::Codec) -> rpc::ServiceFuture {
        Box::pin(async move { Ok(params) })
    }
}

/// Calls per second and allocations per call over `calls` calls.
async fn rate(echo: &EchoClient, calls: u64, concurrency: u64, payload: &str) -> (f64, f64) {
    let a0 = ALLOCS.load(Ordering::Relaxed);
    let t0 = Instant::now();
    run(echo, calls, concurrency, payload).await;
    let secs = t0.elapsed().as_secs_f64();
    let allocs = ALLOCS.load(Ordering::Relaxed) - a0;
    (calls as f64 / secs, allocs as f64 / calls as f64)
}

/// Resident memory in KiB, from /proc/self/statm.
fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4
}

async fn run(echo: &EchoClient, calls: u64, concurrency: u64, payload: &str) {
    let next = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for _ in 0..concurrency {
        let (echo, next, payload) = (echo.clone(), next.clone(), payload.to_string());
        callers.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < calls {
                if echo.echo(payload.clone()).await.is_err() {
                    eprintln!("costs: a call failed");
                }
            }
        }));
    }
    for c in callers {
        let _ = c.await;
    }
}

/// Allocations per call, memory per idle connection, and memory over many calls.
async fn memory_figures(
    args: &Args,
    echo: &EchoClient,
    addr: &str,
    payload: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    // The state one call keeps while it waits for its answer: what a caller's task holds
    // (and moves) per call, and what a caller that boxes its calls allocates.
    let call = echo.echo(payload.to_string());
    println!("call_future_bytes={}", std::mem::size_of_val(&call));
    drop(call);

    // Allocations per call (client and server sides together), after a warm-up.
    run(echo, 20_000, args.concurrency, payload).await;
    let sample = 200_000.min(args.calls.max(1));
    let (a0, b0) = (
        ALLOCS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    );
    run(echo, sample, args.concurrency, payload).await;
    let (a1, b1) = (
        ALLOCS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    );
    println!(
        "allocs_per_call={:.2} bytes_per_call={:.0} (client + server, payload {} B, {} calls)",
        (a1 - a0) as f64 / sample as f64,
        (b1 - b0) as f64 / sample as f64,
        args.payload,
        sample
    );

    // Memory per idle connection (both ends are in this process).
    let before = rss_kib();
    let mut idle = Vec::with_capacity(args.idle);
    for _ in 0..args.idle {
        idle.push(Connection::connect(addr, &ConnectOptions::default()).await?);
    }
    let after = rss_kib();
    println!(
        "idle_connection_kib={:.1} ({} connections, client and server ends together)",
        after.saturating_sub(before) as f64 / args.idle.max(1) as f64,
        args.idle
    );
    for c in &idle {
        c.close();
    }
    drop(idle);

    // Memory over many calls: resident size after each tenth.
    let started = Instant::now();
    let tenth = (args.calls / 10).max(1);
    let mut line = String::new();
    for i in 1..=10 {
        run(echo, tenth, args.concurrency, payload).await;
        line.push_str(&format!(" {}k={}", i * tenth / 1000, rss_kib()));
    }
    println!(
        "rss_kib_by_calls:{line} ({:.0} calls/s in one process)",
        (10 * tenth) as f64 / started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut builder = Server::builder()
        .max_concurrency(100_000)
        .add_service(EchoServer::new(EchoService::default()));
    for _ in 0..args.layers {
        builder = builder.layer(PassThrough);
    }
    #[cfg(feature = "tower")]
    for _ in 0..args.tower_layers {
        builder = builder.layer(rpc::tower::TowerLayer::new(TowerIdentity));
    }
    let server = builder.serve("127.0.0.1:0").await?;
    let addr = server.local_addr().to_string();
    let echo = EchoClient::new(
        Client::builder()
            .registry(StaticRegistry::new([addr.clone()]))
            .build(),
    );
    let payload = "x".repeat(args.payload);

    if !args.scale_only {
        memory_figures(&args, &echo, &addr, &payload).await?;
    }

    // Scale: the same calls with 10 000 entries in the server's table and the client's pipeline
    // cache, and the echo service spread over 1 000 endpoints.
    let sample = 300_000.min(args.calls.max(1));
    let (base_rate, base_allocs) = rate(&echo, sample, args.concurrency, &payload).await;
    let wide_server = Server::builder()
        .add_service(Wide::new(args.entries))
        .add_service(EchoServer::new(EchoService::default()))
        .serve("127.0.0.1:0")
        .await?;
    let mut servers = vec![wide_server];
    for _ in 1..args.endpoints {
        servers.push(
            Server::builder()
                .add_service(EchoServer::new(EchoService::default()))
                .serve("127.0.0.1:0")
                .await?,
        );
    }
    let addrs: Vec<String> = servers.iter().map(|s| s.local_addr().to_string()).collect();
    let client = Client::builder()
        .registry(StaticRegistry::new(addrs.clone()))
        .build();
    // Every entry is called once through the wide server, so the client caches a pipeline for
    // each of them.
    let wide_methods = Wide::new(args.entries).0;
    let wide_client = Client::builder()
        .registry(StaticRegistry::new([addrs[0].clone()]))
        .build();
    let params = rpc::Codec::MsgPack.encode(&rpc::crates::core::NoArgs)?;
    for m in wide_methods {
        wide_client
            .invoke(m, params.clone(), None::<fn() -> u64>)
            .await?;
    }
    let wide_echo = EchoClient::new(client);
    // Connections to every endpoint are opened during the warm-up.
    run(
        &wide_echo,
        2 * args.endpoints as u64,
        args.concurrency,
        &payload,
    )
    .await;
    let (scaled_rate, scaled_allocs) = rate(&wide_echo, sample, args.concurrency, &payload).await;
    println!(
        "scale: 1 endpoint, 1 entry: {base_rate:.0} calls/s, {base_allocs:.2} allocs/call; \
         {} endpoints, {} more entries: {scaled_rate:.0} calls/s, {scaled_allocs:.2} allocs/call",
        args.endpoints, args.entries
    );
    for s in servers {
        s.abort();
    }
    server.shutdown().await;
    Ok(())
}
