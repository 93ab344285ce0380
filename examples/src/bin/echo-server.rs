//! Serves `echo.Echo` on 127.0.0.1 for the failover walk-through.
//!
//! ```text
//! echo-server --port P [--fail-every K] [--delay-ms D] [--max-concurrency N] [--token T]
//!             [--registry embedded|static:<file>|etcd://host:port|zk://host:port]
//!             [--registry-ttl-secs S]
//!             [--admin ADDR [--admin-token T]]
//! ```
//! Prints `listening on <addr>` once it accepts connections (and `admin on <addr>` once the
//! admin endpoint listens, with `--admin`); stops gracefully on Ctrl-C or SIGTERM.
//!
//! With `--registry etcd://...` (build with `--features etcd`) the server also follows the
//! rules of that etcd's rule store, and the admin endpoint shows and edits them (its
//! `/api/rules` routes and the console's rules editor).

use std::time::Duration;

use clap::Parser;
use examples::{EchoServer, EchoService};
use rpc::Server;

#[derive(Parser, Debug)]
#[command(about = "Serves echo.Echo for the failover walk-through")]
struct Args {
    /// Port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Answer a business error on every K-th call (0: never).
    #[arg(long, default_value_t = 0)]
    fail_every: u64,
    /// Hold each call this many milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Calls handled at once before Overflow is answered.
    #[arg(long, default_value_t = 50)]
    max_concurrency: usize,
    /// Token clients must present.
    #[arg(long)]
    token: Option<String>,
    /// Where to publish the instance: embedded (nothing outside this process),
    /// static:FILE (nothing to publish), etcd://host:port or zk://host:port.
    #[arg(long, default_value = "embedded")]
    registry: String,
    /// Lease of the published instance: a killed server disappears from etcd (the lease) or
    /// ZooKeeper (the session timeout) after this long.
    #[arg(long, default_value_t = 10)]
    registry_ttl_secs: u64,
    /// off, stdout (spans and metrics to standard output; build with --features otel) or otlp
    /// (OTLP/gRPC by the OTEL_* variables; --features otlp).
    #[arg(long, default_value = "off")]
    telemetry: String,
    /// Serve the admin endpoint (health, readiness, metrics, JSON API) on host:port, loopback
    /// (port 0 picks a free one; the real address is printed as `admin on <addr>`).
    #[arg(long)]
    admin: Option<String>,
    /// The admin endpoint's token: requests send `Authorization: Bearer <token>`.
    #[arg(long, requires = "admin")]
    admin_token: Option<String>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let _telemetry = examples::init_telemetry(&args.telemetry).unwrap_or_else(|e| {
        eprintln!("echo-server: {e}");
        std::process::exit(2);
    });
    let ttl = Duration::from_secs(args.registry_ttl_secs);
    let (registry, rules) = examples::registry_and_rules(&args.registry, Some(ttl))
        .await
        .unwrap_or_else(|e| {
            eprintln!("echo-server: {e}");
            std::process::exit(2);
        });
    let mut builder = Server::builder()
        .shared_registry(registry)
        .max_concurrency(args.max_concurrency)
        .add_service(EchoServer::new(EchoService::new(
            args.fail_every,
            Duration::from_millis(args.delay_ms),
        )));
    if let Some(token) = args.token {
        builder = builder.token(token);
    }
    #[cfg(feature = "etcd")]
    if let Some(store) = &rules {
        builder = builder.rules(store.clone());
    }
    let server = builder.serve(("127.0.0.1", args.port)).await?;
    let addr = server.local_addr();
    let admin = examples::start_admin_with(
        args.admin.as_deref(),
        args.admin_token.as_deref(),
        None,
        Some(&server),
        |admin| match rules {
            #[cfg(feature = "etcd")]
            Some(store) => admin.rules(store),
            _ => admin,
        },
    )
    .await;
    let admin = match admin {
        Ok(admin) => admin,
        Err(e) => {
            eprintln!("echo-server: {e}");
            // Deregistered first: clients must not dial an instance that is going away.
            server.shutdown().await;
            std::process::exit(2);
        }
    };
    let stopped = server.serve_until_signal();
    println!("listening on {addr}");
    stopped.await?;
    if let Some(admin) = admin {
        admin.shutdown().await;
    }
    Ok(())
}
