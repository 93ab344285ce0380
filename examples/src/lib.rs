//! Services shared by the example programs.
//!
//! `echo.Echo` is the service of the failover walk-through (`echo-server`, `echo-client`) and of
//! the benchmark.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rpc::RpcError;

/// The echo service: answers what it is sent.
#[rpc::service(name = "echo.Echo")]
pub trait Echo {
    /// Returns `text`. Idempotent, so a call that may have reached a server that died is
    /// repeated on another one; `text` is the hash key under the hash strategy.
    #[governance(idempotent)]
    async fn echo(&self, #[hash_key] text: String) -> Result<String, RpcError>;
}

/// The echo implementation of `echo-server`.
#[derive(Debug, Default)]
pub struct EchoService {
    /// Answer a business error on every K-th call (0: never).
    pub fail_every: u64,
    /// Hold each call this long.
    pub delay: Duration,
    calls: AtomicU64,
}

impl EchoService {
    /// An echo service with the given behaviour.
    pub fn new(fail_every: u64, delay: Duration) -> Self {
        EchoService {
            fail_every,
            delay,
            calls: AtomicU64::new(0),
        }
    }

    /// Calls handled so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

impl Echo for EchoService {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        if self.fail_every > 0 && n.is_multiple_of(self.fail_every) {
            return Err(RpcError::business(format!(
                "call #{n} refused on purpose (--fail-every {})",
                self.fail_every
            )));
        }
        Ok(text)
    }
}

/// Writes `line` and a newline to standard output, for a script reading it: a reader that went
/// away (`echo-client ... | head -1`) ends the program quietly with exit code 0, where
/// `println!` would panic (exit code 101); another failure to write (a full disk) ends it with
/// exit code 1, saying so.
pub fn print_line(program: &str, line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("{program}: cannot write to standard output: {e}");
            std::process::exit(1)
        }
    }
}

/// What `--telemetry` installed; dropping it flushes and stops the exporters.
#[derive(Debug)]
pub struct TelemetryGuard {
    #[cfg(feature = "otel")]
    _telemetry: Option<rpc::telemetry::Telemetry>,
}

/// Installs what a program's `--telemetry` flag names: `off` (the default), `stdout` (spans and
/// metrics to standard output, logs by `RUST_LOG` to standard error; feature `otel`) or `otlp`
/// (OTLP/gRPC configured by the `OTEL_*` variables; feature `otlp`).
pub fn init_telemetry(kind: &str) -> Result<TelemetryGuard, String> {
    match kind {
        "off" => Ok(TelemetryGuard {
            #[cfg(feature = "otel")]
            _telemetry: None,
        }),
        #[cfg(feature = "otel")]
        "stdout" => rpc::telemetry::init_stdout()
            .map(|t| TelemetryGuard {
                _telemetry: Some(t),
            })
            .map_err(|e| e.to_string()),
        #[cfg(feature = "otlp")]
        "otlp" => rpc::telemetry::init_otlp()
            .map(|t| TelemetryGuard {
                _telemetry: Some(t),
            })
            .map_err(|e| e.to_string()),
        #[cfg(not(feature = "otel"))]
        "stdout" => Err(
            "--telemetry stdout: this build exports nothing; rebuild with `--features otel`".into(),
        ),
        #[cfg(not(feature = "otlp"))]
        "otlp" => Err(
            "--telemetry otlp: this build has no OTLP exporter; rebuild with `--features otlp`"
                .into(),
        ),
        other => Err(format!(
            "unknown --telemetry {other:?}: expected off, stdout or otlp"
        )),
    }
}

/// Starts the admin endpoint a program's `--admin ADDR` asks for (with `--admin-token T`),
/// showing `client` and `server` when given, and prints `admin on <addr>` (the real port when
/// ADDR asked for port 0) once it listens. `None` when no `--admin` was given.
pub async fn start_admin(
    addr: Option<&str>,
    token: Option<&str>,
    client: Option<&rpc::Client>,
    server: Option<&rpc::ServerHandle>,
) -> Result<Option<rpc::admin::AdminHandle>, rpc::admin::AdminError> {
    start_admin_with(addr, token, client, server, |builder| builder).await
}

/// Like [`start_admin`], with `more` adding to the builder what a program has besides a client
/// and a server (`|b| b.rules(store)`: the rule store its `--registry etcd://...` names).
pub async fn start_admin_with(
    addr: Option<&str>,
    token: Option<&str>,
    client: Option<&rpc::Client>,
    server: Option<&rpc::ServerHandle>,
    more: impl FnOnce(rpc::admin::AdminBuilder) -> rpc::admin::AdminBuilder,
) -> Result<Option<rpc::admin::AdminHandle>, rpc::admin::AdminError> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    let mut builder = more(rpc::admin::Admin::builder());
    if let Some(token) = token {
        builder = builder.token(token);
    }
    if let Some(client) = client {
        builder = builder.client(client);
    }
    if let Some(server) = server {
        builder = builder.server(server);
    }
    let admin = builder.serve(addr).await?;
    println!("admin on {}", admin.local_addr());
    Ok(Some(admin))
}

/// The rule store of an etcd registry (feature `etcd`); nothing without etcd support.
#[cfg(feature = "etcd")]
pub type Rules = rpc::RuleStore;
/// The rule store of an etcd registry (feature `etcd`); nothing without etcd support.
#[cfg(not(feature = "etcd"))]
pub type Rules = std::convert::Infallible;

/// The registry `url` names (with `lease` as the lease of what a server publishes, when given),
/// and for an etcd URL the rule store on the same connection, which the programs follow and
/// hand to their admin endpoint.
pub async fn registry_and_rules(
    url: &str,
    lease: Option<Duration>,
) -> Result<(std::sync::Arc<dyn rpc::Registry>, Option<Rules>), rpc::RegistryError> {
    #[cfg(feature = "etcd")]
    if rpc::EtcdRegistry::is_etcd_url(url) {
        let mut options = rpc::EtcdOptions::default();
        if let Some(ttl) = lease {
            options.lease_ttl = ttl;
        }
        let etcd = rpc::EtcdRegistry::from_url_with_options(url.trim(), options).await?;
        let rules = etcd.rules();
        return Ok((std::sync::Arc::new(etcd), Some(rules)));
    }
    let registry = <dyn rpc::Registry>::from_url_with_lease(url, lease).await?;
    Ok((registry, None))
}
