//! `rpcctl`: the control plane from a shell.
//!
//! ```text
//! rpcctl [--registry URL] [--admin ADDR] [--token T] [--admin-timeout-ms MS] [--json] COMMAND
//!   services                      one service id per line (--json: a JSON array)
//!   instances SERVICE             one endpoint per line
//!   entries SERVICE               the entries its instances publish
//!   call ENTRY JSON               calls ENTRY with JSON arguments, prints the JSON answer
//!   rules get|set|diff|history|rollback   governance and routing rules in etcd
//!   status                        breakers, endpoint health and options of a process (--admin)
//!   events [--count N]            follows a process's governance events (--admin)
//! ```
//!
//! Exit codes scripts can trust: 0 done, 1 the operation failed (the remote side said no, a
//! call failed, a rule was invalid), 2 the command line or its configuration is wrong.
//!
//! What this program must not do: keep state between runs, or write anything it has not
//! validated first.

mod admin;
mod call;
mod exit;
mod out;
mod registry;
#[cfg(feature = "etcd")]
mod rules;

use clap::{Parser, Subcommand};

use exit::Failure;

/// The command line.
#[derive(Parser, Debug)]
#[command(name = "rpcctl", about = "The control plane from a shell", version)]
pub struct Cli {
    /// The registry: embedded, static:FILE, host:port[,host:port...], etcd://host:port or
    /// zk://host:port.
    #[arg(long, global = true, env = "RPCCTL_REGISTRY")]
    pub registry: Option<String>,
    /// A process's admin endpoint, host:port.
    #[arg(long, global = true, env = "RPCCTL_ADMIN")]
    pub admin: Option<String>,
    /// The admin endpoint's token.
    #[arg(long, global = true, env = "RPCCTL_TOKEN")]
    pub token: Option<String>,
    /// JSON for scripts instead of human tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// How long `status` and `events` wait for the admin endpoint, in milliseconds: to
    /// connect, and for each answer (for `events`, for the stream to start). A process that
    /// accepts but never answers (stopped, its runtime blocked) then fails the command (exit
    /// 1) instead of holding it.
    #[arg(
        long,
        global = true,
        env = "RPCCTL_ADMIN_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub admin_timeout_ms: u64,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Lists the services the registry knows, one per line.
    Services,
    /// Lists a service's instances, one endpoint per line.
    Instances {
        /// The service id, e.g. echo.Echo.
        service: String,
    },
    /// Lists the entries a service's instances publish.
    Entries {
        /// The service id, e.g. echo.Echo.
        service: String,
    },
    /// Calls an entry by id with JSON arguments and prints the JSON answer.
    Call {
        /// The entry id, e.g. echo.Echo.echo.
        entry: String,
        /// The arguments, a JSON array (one element per parameter). (Not named `json`: that
        /// is the global `--json` flag's id, and clap would confuse the two.)
        #[arg(value_name = "JSON")]
        args: String,
        /// The servers' handshake token, when they require one.
        #[arg(long, env = "RPCCTL_SERVER_TOKEN")]
        server_token: Option<String>,
        /// Gives the call up after this many milliseconds, whatever the entry's own timeout
        /// (0: wait as long as the entry's options let it).
        #[arg(long, default_value_t = 30_000)]
        timeout_ms: u64,
    },
    /// Status of a process: breakers, endpoint health and options (needs --admin).
    Status,
    /// Follows a process's governance events (needs --admin).
    Events {
        /// Stop after this many events (exit 1 if the stream ends first); default: follow
        /// until the process stops (exit 0) or Ctrl-C.
        #[arg(long)]
        count: Option<usize>,
    },
    /// Governance and routing rules in etcd (needs --registry etcd://...).
    #[cfg(feature = "etcd")]
    Rules {
        /// get, set, diff, history or rollback.
        #[command(subcommand)]
        command: rules::RulesCommand,
    },
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let result: Result<(), Failure> = match cli.command {
        #[cfg(feature = "etcd")]
        Command::Rules { command } => rules::run(cli.registry.as_deref(), cli.json, command).await,
        Command::Services => match registry::open(cli.registry.as_deref()).await {
            Ok(r) => registry::services(&*r, cli.json).await,
            Err(e) => Err(e),
        },
        Command::Instances { service } => match registry::open(cli.registry.as_deref()).await {
            Ok(r) => registry::instances(&*r, &service, cli.json).await,
            Err(e) => Err(e),
        },
        Command::Entries { service } => match registry::open(cli.registry.as_deref()).await {
            Ok(r) => registry::entries(&*r, &service, cli.json).await,
            Err(e) => Err(e),
        },
        Command::Call {
            entry,
            args,
            server_token,
            timeout_ms,
        } => match registry::open(cli.registry.as_deref()).await {
            Ok(r) => {
                let limit = (timeout_ms > 0).then(|| std::time::Duration::from_millis(timeout_ms));
                call::run(r, &entry, &args, server_token.as_deref(), limit).await
            }
            Err(e) => Err(e),
        },
        Command::Status => admin::status(&admin_of(&cli), cli.json).await,
        Command::Events { count } => admin::events(&admin_of(&cli), cli.json, count).await,
    };
    if let Err(failure) = result {
        eprintln!("rpcctl: {}", failure.message);
        std::process::exit(failure.code);
    }
}

/// Where `status` and `events` find the admin endpoint, and how long they wait for it.
fn admin_of(cli: &Cli) -> admin::Target<'_> {
    admin::Target {
        addr: cli.admin.as_deref(),
        token: cli.token.as_deref(),
        timeout: std::time::Duration::from_millis(cli.admin_timeout_ms.max(1)),
    }
}
