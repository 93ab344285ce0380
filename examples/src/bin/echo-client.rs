//! Calls `echo.Echo` on a list of endpoints and reports each call, for the failover
//! walk-through.
//!
//! ```text
//! echo-client --endpoints host:port,... --calls N [--interval-ms I] [--concurrency C]
//!             [--strategy polling|random|hash|appoint|least_loaded] [--timeout-ms T] [--token T]
//! echo-client --registry static:<file>|etcd://host:port|zk://host:port --calls N [...]
//! ```
//! Prints one line per call, then exactly
//! `summary: <ok> ok, <business> business errors, <failed> failed`. Exits 0 whatever the calls'
//! outcomes, and quietly when its reader goes away (`| head -1`) (2 on bad arguments, 1 when
//! `--strategy appoint` finds no endpoint).
//!
//! `--strategy` and `--timeout-ms` override the service's options when given; left out, the
//! configuration (and the rules followed, with etcd) decide, round robin and 5 s by default.
//!
//! With `--admin ADDR [--admin-token T]` the client's admin endpoint (its breakers, endpoint
//! health, calls and events; the console at `/`) serves while the calls run, and prints
//! `admin on <addr>` once it listens. With `--registry etcd://...` (build with `--features
//! etcd`) the client follows that etcd's rules, and the admin endpoint shows and edits them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use examples::{Echo, EchoClient};
use rpc::{Client, GovernanceOverrides, ShuntStrategy, StatusCode};

#[derive(Parser, Debug)]
#[command(about = "Calls echo.Echo and reports each call")]
struct Args {
    /// Comma-separated host:port list.
    #[arg(long, required_unless_present = "registry")]
    endpoints: Option<String>,
    /// Where to find the endpoints instead: static:FILE, etcd://host:port or zk://host:port.
    #[arg(long, conflicts_with = "endpoints")]
    registry: Option<String>,
    /// Number of calls.
    #[arg(long)]
    calls: u64,
    /// Pause between two calls of one caller, in milliseconds.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Callers running at once.
    #[arg(long, default_value_t = 1)]
    concurrency: u64,
    /// polling, random, hash, appoint (the first endpoint) or least_loaded; left out, as the
    /// service's options say (polling unless configured).
    #[arg(long)]
    strategy: Option<ShuntStrategy>,
    /// Deadline of each call, retries included (0: none); left out, as the service's options
    /// say (5000 unless configured).
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Token presented to the servers.
    #[arg(long)]
    token: Option<String>,
    /// off, stdout (spans and metrics to standard output; build with --features otel) or otlp
    /// (OTLP/gRPC by the OTEL_* variables; --features otlp).
    #[arg(long, default_value = "off")]
    telemetry: String,
    /// Serve the client's admin endpoint on host:port (loopback; port 0 picks a free one, printed
    /// as `admin on <addr>`) while the calls run.
    #[arg(long)]
    admin: Option<String>,
    /// The admin endpoint's token: requests send `Authorization: Bearer <token>`.
    #[arg(long, requires = "admin")]
    admin_token: Option<String>,
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    business: AtomicU64,
    failed: AtomicU64,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let _telemetry = examples::init_telemetry(&args.telemetry).unwrap_or_else(|e| {
        eprintln!("echo-client: {e}");
        std::process::exit(2);
    });
    // `--endpoints` is a static list: the same string `from_url` takes.
    let Some(url) = args.endpoints.as_ref().or(args.registry.as_ref()) else {
        eprintln!("echo-client: give --endpoints or --registry");
        std::process::exit(2);
    };
    let (registry, rules) = examples::registry_and_rules(url, None)
        .await
        .unwrap_or_else(|e| {
            eprintln!("echo-client: {e}");
            std::process::exit(2);
        });
    // appoint: the first endpoint listed, or the first the registry announces.
    let appointed = if args.strategy == Some(ShuntStrategy::Appoint) {
        let first = match &args.endpoints {
            Some(list) => list.split(',').next().map(|a| a.trim().to_string()),
            None => match registry.watch(&EchoClient::SERVICE_ID.into()).await {
                Ok(w) => w.current().first().map(|i| i.address.clone()),
                Err(e) => {
                    eprintln!("echo-client: --strategy appoint: cannot read {url}: {e}");
                    std::process::exit(1);
                }
            },
        };
        match first.filter(|a| !a.is_empty()) {
            Some(first) => Some(first.into()),
            None => {
                eprintln!(
                    "echo-client: --strategy appoint: {url} lists no endpoint of {} yet; start \
                     a server first, or give --endpoints",
                    EchoClient::SERVICE_ID
                );
                std::process::exit(1);
            }
        }
    } else {
        None
    };
    let mut builder = Client::builder()
        .shared_registry(registry)
        .override_options(
            EchoClient::SERVICE_ID,
            GovernanceOverrides {
                shunt_strategy: args.strategy,
                appoint_address: appointed,
                timeout_ms: args.timeout_ms,
                ..GovernanceOverrides::NONE
            },
        );
    if let Some(token) = &args.token {
        builder = builder.token(token.clone());
    }
    #[cfg(feature = "etcd")]
    if let Some(store) = &rules {
        builder = builder.rules(store.clone());
    }
    let client = builder.build();
    let admin = examples::start_admin_with(
        args.admin.as_deref(),
        args.admin_token.as_deref(),
        Some(&client),
        None,
        |admin| match rules {
            #[cfg(feature = "etcd")]
            Some(store) => admin.rules(store),
            _ => admin,
        },
    )
    .await
    .unwrap_or_else(|e| {
        eprintln!("echo-client: {e}");
        std::process::exit(2);
    });
    let echo = EchoClient::new(client);
    let next = Arc::new(AtomicU64::new(0));
    let tally = Arc::new(Tally::default());
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (echo, next, tally) = (echo.clone(), next.clone(), tally.clone());
        let (calls, interval) = (args.calls, Duration::from_millis(args.interval_ms));
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= calls {
                    break;
                }
                let text = format!("hello #{i}");
                let (result, by) = rpc::answered_by(echo.echo(text.clone())).await;
                let by = by.unwrap_or_else(|| "-".into());
                match result {
                    Ok(answer) if answer == text => {
                        tally.ok.fetch_add(1, Ordering::Relaxed);
                        examples::print_line("echo-client", format_args!("call {i}: ok from {by}"));
                    }
                    Ok(answer) => {
                        tally.failed.fetch_add(1, Ordering::Relaxed);
                        examples::print_line(
                            "echo-client",
                            format_args!("call {i}: failed: wrong answer {answer:?} from {by}"),
                        );
                    }
                    Err(e) if e.code() == StatusCode::BusinessError => {
                        tally.business.fetch_add(1, Ordering::Relaxed);
                        examples::print_line(
                            "echo-client",
                            format_args!("call {i}: business error from {by}: {}", e.message()),
                        );
                    }
                    Err(e) => {
                        tally.failed.fetch_add(1, Ordering::Relaxed);
                        examples::print_line(
                            "echo-client",
                            format_args!("call {i}: failed ({}): {e}", e.code().as_u32()),
                        );
                    }
                }
                if !interval.is_zero() {
                    tokio::time::sleep(interval).await;
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    examples::print_line(
        "echo-client",
        format_args!(
            "summary: {} ok, {} business errors, {} failed",
            tally.ok.load(Ordering::Relaxed),
            tally.business.load(Ordering::Relaxed),
            tally.failed.load(Ordering::Relaxed)
        ),
    );
    if let Some(admin) = admin {
        admin.shutdown().await;
    }
}
