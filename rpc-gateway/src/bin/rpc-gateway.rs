//! `rpc-gateway --registry URL --listen ADDR [--token T] [--server-token T] [--config FILE]`:
//! every entry published in the registry served over HTTP/JSON (see the crate's documentation
//! for the routes).
//!
//! The gateway's client presents `--server-token` to servers that require one, takes its
//! governance options from `--config` (TOML, as `ClientBuilder::config_file`) and
//! `RPC_GOVERNANCE`, and, with an `etcd://` registry, follows the rules in that etcd
//! (governance options and routing rules, as the other programs do).
//!
//! Prints `gateway on <addr>` on standard output once it listens (the address it really bound,
//! so `--listen 127.0.0.1:0` works for scripts), then serves until Ctrl-C or SIGTERM.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use rpc_gateway::Gateway;
use rpc_registry::Registry;

#[derive(Parser, Debug)]
#[command(
    name = "rpc-gateway",
    about = "Serves every service entry published in a registry as an HTTP/JSON route"
)]
struct Args {
    /// The registry: embedded, static:FILE, host:port[,host:port...], etcd://host:port or
    /// zk://host:port[/prefix].
    #[arg(long, env = "RPC_GATEWAY_REGISTRY")]
    registry: String,
    /// Where to listen (port 0 picks a free one; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Require `Authorization: Bearer <token>` on every route but /healthz and /docs.
    #[arg(long, env = "RPC_GATEWAY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The token the gateway's client presents to servers that require one (their `--token`).
    #[arg(long, env = "RPC_GATEWAY_SERVER_TOKEN", hide_env_values = true)]
    server_token: Option<String>,
    /// A governance config file (TOML: `[defaults]`, `[services."id"]`, `[entries."id"]`) for
    /// the gateway's calls.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// The OpenAPI document's title.
    #[arg(long, default_value = "rpc-gateway")]
    title: String,
    /// The OpenAPI document's version.
    #[arg(long, default_value = env!("CARGO_PKG_VERSION"))]
    api_version: String,
    /// Seconds between two listings of the registry's services (changes of known services
    /// arrive at once).
    #[arg(long, default_value_t = 1.0)]
    discovery_secs: f64,
    /// Seconds a client has to send a request's head from its first byte, and again its body,
    /// and to take a byte of an answer waiting for it.
    #[arg(long, default_value_t = 30.0)]
    read_timeout_secs: f64,
    /// Seconds a connection may sit idle before or between requests; keep it longer than the
    /// idle time of the load balancers in front (60 s for AWS's, 600 s for Google Cloud's).
    #[arg(long, default_value_t = 900.0)]
    idle_timeout_secs: f64,
    /// Calls handled at once; one more is answered 503 with `Retry-After: 1`.
    #[arg(long, default_value_t = 1024)]
    max_in_flight: usize,
}

#[tokio::main]
async fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("rpc-gateway: {message}");
            ExitCode::FAILURE
        }
    }
}

/// `secs` given as `--flag` as a duration, or what is wrong with it.
fn seconds(flag: &str, secs: f64) -> Result<std::time::Duration, String> {
    Some(secs)
        .filter(|s| *s > 0.0)
        .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("--{flag} {secs}: give a positive number of seconds"))
}

async fn run(args: Args) -> Result<(), String> {
    let discovery = seconds("discovery-secs", args.discovery_secs)?;
    let read_timeout = seconds("read-timeout-secs", args.read_timeout_secs)?;
    let idle_timeout = seconds("idle-timeout-secs", args.idle_timeout_secs)?;
    if args.max_in_flight == 0 {
        return Err(
            "--max-in-flight 0: give the number of calls handled at once, at least 1".into(),
        );
    }
    // An empty token (a secret that did not resolve, say) must not turn the check off.
    if args.token.as_deref() == Some("") {
        return Err(
            "--token (or RPC_GATEWAY_TOKEN) is empty: give the token, or leave both \
                    unset to serve without one"
                .into(),
        );
    }
    if args.server_token.as_deref() == Some("") {
        return Err(
            "--server-token (or RPC_GATEWAY_SERVER_TOKEN) is empty: give the servers' token, \
             or leave both unset for servers that require none"
                .into(),
        );
    }
    let (registry, rules) = registry_and_rules(&args.registry)
        .await
        .map_err(|e| format!("--registry {}: {e}", args.registry))?;
    let mut client = rpc_client::Client::builder()
        .shared_registry(registry.clone())
        .config_env()
        .map_err(|e| format!("RPC_GOVERNANCE: {}", e.message()))?;
    if let Some(path) = &args.config {
        client = client
            .config_file(path)
            .map_err(|e| format!("--config {}: {}", path.display(), e.message()))?;
    }
    if let Some(token) = args.server_token {
        client = client.token(token);
    }
    if let Some(rules) = rules {
        #[cfg(feature = "etcd")]
        {
            client = client.rules(rules);
        }
        #[cfg(not(feature = "etcd"))]
        match rules {}
    }
    let client = client.build();
    let mut builder = Gateway::builder()
        .client(client)
        .registry(registry)
        .title(args.title)
        .version(args.api_version);
    builder = builder
        .discovery_interval(discovery)
        .read_timeout(read_timeout)
        .idle_timeout(idle_timeout)
        .max_in_flight(args.max_in_flight);
    if let Some(token) = args.token {
        builder = builder.token(token);
    }
    let gateway = builder.build().await.map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "gateway on {addr}");
        let _ = out.flush();
    }
    gateway
        .serve_with_shutdown(listener, stop_signal())
        .await
        .map_err(|e| format!("serving on {addr}: {e}"))
}

/// The registry `url` names, and for an `etcd://` one the rule store in the same etcd.
async fn registry_and_rules(
    url: &str,
) -> Result<(Arc<dyn Registry>, Option<RuleStore>), rpc_registry::RegistryError> {
    #[cfg(feature = "etcd")]
    if rpc_registry::EtcdRegistry::is_etcd_url(url) {
        let etcd = rpc_registry::EtcdRegistry::from_url(url.trim()).await?;
        let rules = etcd.rules();
        return Ok((Arc::new(etcd), Some(rules)));
    }
    Ok((<dyn Registry>::from_url(url).await?, None))
}

/// The rules the gateway's client follows: an etcd's rule store.
#[cfg(feature = "etcd")]
type RuleStore = rpc_registry::RuleStore;
/// Without etcd, no rule store.
#[cfg(not(feature = "etcd"))]
type RuleStore = std::convert::Infallible;

/// Ctrl-C or SIGTERM.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
