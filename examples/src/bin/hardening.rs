//! Hardening figures: a server at ten times its cap, and well-behaved clients while misbehaving
//! raw TCP clients attack. Figures, not assertions; the functional side is tested in
//! `tests/tests/integration/overload.rs`, `limits.rs` and `wire_faults.rs`.
//!
//! ```text
//! hardening overload [--cap 32] [--factor 10] [--work-us 1000] [--seconds 3]
//! hardening attack [--kinds oversized,attachments,...,all] [--seconds 1] [--rounds 3]
//!                  [--good-callers 16] [--good-connections 1]
//! hardening memory [--peers 32] [--mib 15] [--seconds 3]
//! hardening serve [...]        # the server process the modes above start
//! ```
//!
//! The server always runs in a process of its own (this program, `serve`), started on
//! 127.0.0.1 port 0; its resident memory is its `VmRSS` in `/proc/<pid>/status` and its CPU time
//! comes from `/proc/<pid>/stat`. Clients and attackers run in this process. Output is one
//! `key=value` line per figure group.
//!
//! - `overload`: `hardening.Target.work` holds each call `--work-us` (a timer, as a call to a
//!   slow dependency would). The client has no retry and no circuit breaker, so every answer of
//!   the server reaches the measurement as it is. First C = `--cap` closed-loop callers (the cap's
//!   worth: unloaded), then `--factor` × C callers: latency of admitted calls (p50/p99), latency
//!   of Overflow (515) answers, and the server's memory before, at most during and after; then
//!   the latency of Overflow answers to a single quiet caller while C calls of `hold` (100 ×
//!   `--work-us`) keep the cap full.
//! - `attack`: per attack kind, a fresh server (`--max-connections`, `--max-in-flight` per
//!   connection, 1 MiB frames, default attachment limits of 64 and 16 KiB, handshake timeout
//!   5 s, idle timeout 60 s, a call rate per connection when `--call-rate` is above 0) and
//!   `--good-callers` closed-loop callers of
//!   `hardening.Target.echo` (32 B, default governance) on `--good-connections` connections.
//!   Their QPS is measured alone and while the attack runs, in turns (alone, under attack,
//!   alone, ... `--rounds` times), so that a change of the machine's other load hits both;
//!   `ratio` is the mean QPS under attack over the mean QPS alone. The CPU of the server and of
//!   this process during the windows, and the server's memory, are printed beside. Attackers
//!   are raw TCP clients on a thread of their own (a single-threaded runtime, so they use at
//!   most one core), each kind looping until its window ends:
//!   - `oversized`: Hello, then a length prefix of 1 GiB; read until the server closes; again;
//!   - `attachments`: batches of calls with more attachments than allowed (answered 500);
//!   - `in_flight`: batches of 4 × the per-connection limit of slow calls, pipelined;
//!   - `unread_answers`: pipelined calls whose answers are never read;
//!   - `no_handshake`: connections that never send Hello, reopened when closed;
//!   - `slow_loris`: after Hello, one byte of a frame every 100 ms;
//!   - `conn_flood`: connections up to `--max-connections` held, plus connectors that retry
//!     as soon as they are refused;
//!   - `all`: every kind above at once;
//!   - `cpu_control` (not in `all`): no traffic, the attackers' thread busy for
//!     `--control-cores` (0.3 by default, about what the busiest attackers take): what taking
//!     that much CPU from the machine costs by itself;
//!   - `churn_control` (not in `all`): what `oversized` does, against a listener of the
//!     attackers' own that reads, answers 32 bytes and closes: what that connection churn costs
//!     the machine without the server taking part.
//! - `memory`: `--peers` raw TCP peers each announce a frame of 16 MiB (the default frame
//!   limit, which the server runs with here) and send `--mib` MiB of it, for at most
//!   `--seconds`, holding their connections open; once without saying `Hello` first, once after
//!   the handshake. The server's memory before, at most during (sampled every 20 ms) and after
//!   the peers closed, and how much the peers got to send.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use prost::Message;
use rpc::crates::core::wire::{frame::Kind, Frame, Hello, RemoteInvokeMessage};
use rpc::crates::transport::FrameCodec;
use rpc::{Client, Codec, GovernanceOverrides, RpcError, Server, StaticRegistry, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the server offers.
#[rpc::service(name = "hardening.Target")]
trait Target {
    /// Answers at once.
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    /// Answers after the server's `--work-us`.
    async fn work(&self, text: String) -> Result<String, RpcError>;
    /// Answers after 100 × the server's `--work-us`.
    async fn hold(&self, text: String) -> Result<String, RpcError>;
}

struct Node {
    work: Duration,
}

impl Target for Node {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
    async fn work(&self, text: String) -> Result<String, RpcError> {
        tokio::time::sleep(self.work).await;
        Ok(text)
    }
    async fn hold(&self, text: String) -> Result<String, RpcError> {
        tokio::time::sleep(self.work * 100).await;
        Ok(text)
    }
}

#[derive(Parser, Debug)]
#[command(about = "Overload and attack figures of the framework's server")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve hardening.Target (started by the other modes).
    Serve(ServeArgs),
    /// Latency and memory at the cap and at ten times the cap.
    Overload(OverloadArgs),
    /// Well-behaved clients' QPS alone and while raw TCP clients attack.
    Attack(AttackArgs),
    /// Server memory while peers announce large frames, before and after the handshake.
    Memory(MemoryArgs),
}

#[derive(ClapArgs, Debug)]
struct MemoryArgs {
    /// Peers, each on a connection of its own.
    #[arg(long, default_value_t = 32)]
    peers: usize,
    /// MiB each peer sends of its 16 MiB frame.
    #[arg(long, default_value_t = 15)]
    mib: usize,
    /// Seconds the peers may take to send (a peer the server no longer reads stops there).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
}

#[derive(ClapArgs, Debug, Clone)]
struct ServeArgs {
    /// Calls handled at once before Overflow is answered.
    #[arg(long, default_value_t = 50)]
    cap: usize,
    /// How long `work` holds a call, in microseconds.
    #[arg(long, default_value_t = 1000)]
    work_us: u64,
    /// Connections held at once.
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// Largest frame accepted.
    #[arg(long, default_value_t = 1 << 20)]
    max_frame: usize,
    /// Calls one connection may have running at once.
    #[arg(long, default_value_t = 1024)]
    max_in_flight: usize,
    /// Milliseconds a connection may take to send Hello.
    #[arg(long, default_value_t = 5000)]
    handshake_timeout_ms: u64,
    /// Milliseconds without a frame after which a connection is closed.
    #[arg(long, default_value_t = 60_000)]
    idle_timeout_ms: u64,
    /// Calls one connection may start per second; 0: no limit.
    #[arg(long, default_value_t = 0)]
    call_rate: u32,
}

impl ServeArgs {
    fn to_args(&self) -> Vec<String> {
        [
            ("--cap", self.cap.to_string()),
            ("--work-us", self.work_us.to_string()),
            ("--max-connections", self.max_connections.to_string()),
            ("--max-frame", self.max_frame.to_string()),
            ("--max-in-flight", self.max_in_flight.to_string()),
            (
                "--handshake-timeout-ms",
                self.handshake_timeout_ms.to_string(),
            ),
            ("--idle-timeout-ms", self.idle_timeout_ms.to_string()),
            ("--call-rate", self.call_rate.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }
}

#[derive(ClapArgs, Debug)]
struct OverloadArgs {
    /// The server's cap; the unloaded phase runs this many callers.
    #[arg(long, default_value_t = 32)]
    cap: usize,
    /// The loaded phase runs factor × cap callers.
    #[arg(long, default_value_t = 10)]
    factor: usize,
    /// How long the server holds each admitted call, in microseconds.
    #[arg(long, default_value_t = 1000)]
    work_us: u64,
    /// Measured seconds per phase.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Upper bound of calls per caller and phase.
    #[arg(long, default_value_t = 1_000_000)]
    max_calls: u64,
}

/// Named on the command line as in the output (`attack=in_flight`) and the documentation;
/// the hyphenated names taken before (`in-flight`) still are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
#[value(rename_all = "snake_case")]
enum AttackKind {
    Oversized,
    Attachments,
    #[value(alias = "in-flight")]
    InFlight,
    #[value(alias = "unread-answers")]
    UnreadAnswers,
    #[value(alias = "no-handshake")]
    NoHandshake,
    #[value(alias = "slow-loris")]
    SlowLoris,
    #[value(alias = "conn-flood")]
    ConnFlood,
    All,
    #[value(alias = "cpu-control")]
    CpuControl,
    #[value(alias = "churn-control")]
    ChurnControl,
}

impl AttackKind {
    const EACH: [AttackKind; 7] = [
        AttackKind::Oversized,
        AttackKind::Attachments,
        AttackKind::InFlight,
        AttackKind::UnreadAnswers,
        AttackKind::NoHandshake,
        AttackKind::SlowLoris,
        AttackKind::ConnFlood,
    ];

    fn name(self) -> &'static str {
        match self {
            AttackKind::Oversized => "oversized",
            AttackKind::Attachments => "attachments",
            AttackKind::InFlight => "in_flight",
            AttackKind::UnreadAnswers => "unread_answers",
            AttackKind::NoHandshake => "no_handshake",
            AttackKind::SlowLoris => "slow_loris",
            AttackKind::ConnFlood => "conn_flood",
            AttackKind::All => "all",
            AttackKind::CpuControl => "cpu_control",
            AttackKind::ChurnControl => "churn_control",
        }
    }
}

#[derive(ClapArgs, Debug)]
struct AttackArgs {
    /// Attack kinds, in order (each against a fresh server).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "oversized,attachments,in_flight,unread_answers,no_handshake,slow_loris,conn_flood,all,cpu_control,churn_control"
    )]
    kinds: Vec<AttackKind>,
    /// Measured seconds of each window.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Windows under attack per kind, each followed by one alone (and the first preceded by
    /// one).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Well-behaved closed-loop callers.
    #[arg(long, default_value_t = 16)]
    good_callers: usize,
    /// Connections the well-behaved callers share.
    #[arg(long, default_value_t = 1)]
    good_connections: usize,
    /// Attacking tasks per kind (connections for the connection-holding kinds).
    #[arg(long, default_value_t = 4)]
    attackers: usize,
    /// Connections held by each of no_handshake and slow_loris.
    #[arg(long, default_value_t = 64)]
    idle_attackers: usize,
    /// Calls sent without reading by unread_answers, at most.
    #[arg(long, default_value_t = 300_000)]
    unread_limit: u64,
    /// cpu_control: CPU cores the attackers' thread keeps busy.
    #[arg(long, default_value_t = 0.3)]
    control_cores: f64,
    /// The server's connection limit (conn_flood fills it).
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// The server's per-connection limit of running calls.
    #[arg(long, default_value_t = 64)]
    max_in_flight: usize,
    /// The server's cap.
    #[arg(long, default_value_t = 1000)]
    cap: usize,
    /// The server's limit of calls per second per connection; 0: none.
    #[arg(long, default_value_t = 0)]
    call_rate: u32,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let outcome = match args.cmd {
        Cmd::Serve(a) => serve_main(a),
        Cmd::Overload(a) => overload_main(a),
        Cmd::Attack(a) => attack_main(a),
        Cmd::Memory(a) => memory_main(a),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hardening: {e}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("could not start the tokio runtime: {e}"))
}

fn seconds(s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s).map_err(|_| format!("{s}: give a non-negative number"))
}

// -------------------------------------------------------------------------------------- server

fn serve_main(a: ServeArgs) -> Result<(), String> {
    runtime()?.block_on(async {
        let mut server = Server::builder();
        if a.call_rate > 0 {
            server = server.max_calls_per_second_per_connection(a.call_rate);
        }
        let server = server
            .max_concurrency(a.cap)
            .max_connections(a.max_connections)
            .max_frame_length(a.max_frame)
            .max_in_flight_per_connection(a.max_in_flight)
            .handshake_timeout(Duration::from_millis(a.handshake_timeout_ms))
            .idle_timeout(Duration::from_millis(a.idle_timeout_ms))
            .add_service(TargetServer::new(Node {
                work: Duration::from_micros(a.work_us),
            }))
            .serve("127.0.0.1:0")
            .await
            .map_err(|e| format!("could not serve: {e}"))?;
        println!(
            "LISTENING addr={} pid={}",
            server.local_addr(),
            std::process::id()
        );
        let _ = std::io::stdout().flush();
        // Until standard input closes: the parent ended, however it ended.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let mut sink = [0u8; 64];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            let _ = tx.send(());
        });
        let _ = rx.await;
        std::process::exit(0)
    })
}

/// A server process; killed and reaped on drop.
struct ServerProc {
    child: Child,
    addr: SocketAddr,
    pid: u32,
}

impl ServerProc {
    fn start(a: &ServeArgs) -> Result<ServerProc, String> {
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let mut child = Command::new(exe)
            .arg("serve")
            .args(a.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("could not start the server process: {e}"))?;
        let pid = child.id();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut server = ServerProc {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            pid,
        };
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| format!("reading the server's address: {e}"))?;
        let addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .ok_or_else(|| format!("unexpected first line of the server: {line:?}"))?;
        server.addr = addr
            .parse()
            .map_err(|e| format!("server address {addr:?}: {e}"))?;
        Ok(server)
    }

    /// Resident memory in KiB.
    fn rss_kib(&self) -> u64 {
        rss_kib(self.pid)
    }

    /// User plus system CPU seconds so far.
    fn cpu_secs(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        // Fields after the command name (which is in parentheses and may hold spaces):
        // state is field 3, utime 14, stime 15.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<u64> = rest
            .split_whitespace()
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
        // SAFETY: sysconf only reads a system constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        ticks as f64 / hz
    }

    fn target(&self, overrides: Option<GovernanceOverrides>, connections: usize) -> TargetClient {
        let mut b = Client::builder()
            .registry(StaticRegistry::new([self.addr.to_string()]))
            .connections_per_endpoint(connections);
        if let Some(o) = overrides {
            b = b.override_options(TargetClient::SERVICE_ID, o);
        }
        TargetClient::new(b.build())
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------- measuring

/// Latencies in microseconds.
#[derive(Default)]
struct Latencies(Vec<u32>);

impl Latencies {
    fn push(&mut self, d: Duration) {
        self.0.push(d.as_micros().min(u32::MAX as u128) as u32);
    }
    fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }
    fn sort(&mut self) {
        self.0.sort_unstable();
    }
    /// The `q` quantile of sorted latencies (0 when empty).
    fn at(&self, q: f64) -> u32 {
        if self.0.is_empty() {
            return 0;
        }
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i.min(self.0.len() - 1)]
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What closed-loop callers measured in one window.
#[derive(Default)]
struct Window {
    ok: Latencies,
    overflow: Latencies,
    errors: BTreeMap<u32, u64>,
    secs: f64,
}

impl Window {
    fn merge(&mut self, other: Window) {
        self.ok.extend(other.ok);
        self.overflow.extend(other.overflow);
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
    }
    fn errors_text(&self) -> String {
        if self.errors.is_empty() {
            return "none".into();
        }
        self.errors
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[derive(Clone, Copy)]
enum Call {
    Echo,
    Work,
    Hold,
}

/// `callers` closed-loop callers for `length` (and at most `max_calls` calls each).
async fn window(
    target: &TargetClient,
    call: Call,
    callers: usize,
    length: Duration,
    max_calls: u64,
) -> Window {
    let started = Instant::now();
    let end = started + length;
    let mut tasks = Vec::with_capacity(callers);
    for _ in 0..callers {
        let target = target.clone();
        tasks.push(tokio::spawn(async move {
            let mut w = Window::default();
            let text = "x".repeat(32);
            let mut n = 0;
            while n < max_calls && Instant::now() < end {
                n += 1;
                let t0 = Instant::now();
                let r = match call {
                    Call::Echo => target.echo(text.clone()).await,
                    Call::Work => target.work(text.clone()).await,
                    Call::Hold => target.hold(text.clone()).await,
                };
                let took = t0.elapsed();
                match r {
                    Ok(_) => w.ok.push(took),
                    Err(e) if e.code() == StatusCode::OverflowMaxServerHandle => {
                        w.overflow.push(took)
                    }
                    Err(e) => *w.errors.entry(e.code().as_u32()).or_default() += 1,
                }
            }
            w
        }));
    }
    let mut all = Window::default();
    for t in tasks {
        if let Ok(w) = t.await {
            all.merge(w);
        }
    }
    all.secs = started.elapsed().as_secs_f64();
    all.ok.sort();
    all.overflow.sort();
    all
}

// ------------------------------------------------------------------------------------ overload

fn overload_main(a: OverloadArgs) -> Result<(), String> {
    if a.cap == 0 || a.factor == 0 {
        return Err("--cap and --factor must be at least 1".into());
    }
    let length = seconds(a.seconds)?;
    let server = ServerProc::start(&ServeArgs {
        cap: a.cap,
        work_us: a.work_us,
        max_connections: 10_000,
        max_frame: 1 << 20,
        max_in_flight: 1024,
        handshake_timeout_ms: 5000,
        idle_timeout_ms: 60_000,
        call_rate: 0,
    })?;
    runtime()?.block_on(async {
        // Every answer of the server as it is: no retry, no client breaker.
        let target = server.target(
            Some(GovernanceOverrides {
                retry_times: Some(0),
                enable_circuit_breaker: Some(false),
                ..GovernanceOverrides::NONE
            }),
            1,
        );
        let warm = window(
            &target,
            Call::Work,
            a.cap,
            Duration::from_millis(500),
            a.max_calls,
        )
        .await;
        if warm.ok.is_empty() {
            return Err(format!(
                "no call succeeded in the warm-up: {}",
                warm.errors_text()
            ));
        }
        let rss_before = server.rss_kib();

        let cpu0 = server.cpu_secs();
        let unloaded = window(&target, Call::Work, a.cap, length, a.max_calls).await;
        let cpu_unloaded = (server.cpu_secs() - cpu0) / unloaded.secs;

        // Memory sampled every 50 ms while ten times the cap call (bounded by the window).
        let sampling = Arc::new(AtomicBool::new(true));
        let peak = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (sampling, peak, pid) = (sampling.clone(), peak.clone(), server.pid);
            tokio::spawn(async move {
                let stop_at = Instant::now() + length + Duration::from_secs(5);
                while sampling.load(Ordering::Relaxed) && Instant::now() < stop_at {
                    peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        let cpu0 = server.cpu_secs();
        let loaded = window(&target, Call::Work, a.cap * a.factor, length, a.max_calls).await;
        let cpu_loaded = (server.cpu_secs() - cpu0) / loaded.secs;
        sampling.store(false, Ordering::Relaxed);
        let _ = sampler.await;
        let rss_during = peak.load(Ordering::Relaxed).max(server.rss_kib());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rss_after = server.rss_kib();

        // Overflow answers to a quiet client: the cap held by slow calls, one caller asking.
        let holders = tokio::spawn({
            let target = target.clone();
            async move { window(&target, Call::Hold, a.cap, length, a.max_calls).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let quiet = window(&target, Call::Echo, 1, length / 2, a.max_calls).await;
        let _ = holders.await;

        let p99_unloaded = unloaded.ok.at(0.99);
        let p99_loaded = loaded.ok.at(0.99);
        println!(
            "overload cap={} callers_unloaded={} callers_loaded={} work_us={} seconds={}",
            a.cap,
            a.cap,
            a.cap * a.factor,
            a.work_us,
            a.seconds
        );
        println!(
            "unloaded admitted={} qps={:.0} p50_us={} p99_us={} overflows={} errors={} \
             server_cpu_cores={:.2}",
            unloaded.ok.len(),
            unloaded.ok.len() as f64 / unloaded.secs,
            unloaded.ok.at(0.5),
            p99_unloaded,
            unloaded.overflow.len(),
            unloaded.errors_text(),
            cpu_unloaded
        );
        println!(
            "loaded admitted={} qps={:.0} p50_us={} p99_us={} p99_ratio={:.2} errors={} \
             server_cpu_cores={:.2}",
            loaded.ok.len(),
            loaded.ok.len() as f64 / loaded.secs,
            loaded.ok.at(0.5),
            p99_loaded,
            p99_loaded as f64 / p99_unloaded.max(1) as f64,
            loaded.errors_text(),
            cpu_loaded
        );
        println!(
            "overflow answers={} per_s={:.0} p50_us={} p99_us={} max_us={}",
            loaded.overflow.len(),
            loaded.overflow.len() as f64 / loaded.secs,
            loaded.overflow.at(0.5),
            loaded.overflow.at(0.99),
            loaded.overflow.at(1.0)
        );
        println!(
            "overflow_quiet answers={} p50_us={} p99_us={} admitted={} (cap held by {} calls of \
             100 × work, one caller)",
            quiet.overflow.len(),
            quiet.overflow.at(0.5),
            quiet.overflow.at(0.99),
            quiet.ok.len(),
            a.cap
        );
        println!(
            "server_rss_kib before={rss_before} during_max={rss_during} after={rss_after} \
             (separate process, VmRSS)"
        );
        let _ = std::io::stdout().flush();
        Ok(())
    })
}

/// Resident memory of process `pid` in KiB (`VmRSS` of `/proc/<pid>/status`; 0 if unknown).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

// -------------------------------------------------------------------------------------- memory

fn memory_main(a: MemoryArgs) -> Result<(), String> {
    let length = seconds(a.seconds)?;
    let rt = runtime()?;
    println!(
        "memory peers={} mib={} seconds={}",
        a.peers, a.mib, a.seconds
    );
    for handshake in [false, true] {
        let server = ServerProc::start(&ServeArgs {
            cap: 50,
            work_us: 1000,
            max_connections: 10_000,
            max_frame: 16 << 20,
            max_in_flight: 1024,
            // Long enough that no connection is closed for slowness while measured.
            handshake_timeout_ms: 60_000,
            idle_timeout_ms: 60_000,
            call_rate: 0,
        })?;
        let line = rt.block_on(memory_one(&a, handshake, &server, length));
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
    Ok(())
}

/// One run of `memory`: every peer connects (and says Hello when `handshake`), announces a
/// 16 MiB frame and writes `mib` MiB of it, until done, refused or out of time.
async fn memory_one(
    a: &MemoryArgs,
    handshake: bool,
    server: &ServerProc,
    length: Duration,
) -> String {
    let rss_before = server.rss_kib();
    let stop = Arc::new(AtomicBool::new(false));
    let pid = server.pid;
    let peak = Arc::new(AtomicU64::new(rss_before));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let until = tokio::time::Instant::now() + length;
    let mut peers = tokio::task::JoinSet::new();
    for _ in 0..a.peers {
        let (addr, bytes) = (server.addr, a.mib << 20);
        peers.spawn(async move {
            let Ok(Ok(mut s)) = tokio::time::timeout_at(until, TcpStream::connect(addr)).await
            else {
                return (None, 0);
            };
            if handshake {
                let mut buf = BytesMut::new();
                frame(hello(), &mut buf);
                if s.write_all(&buf).await.is_err()
                    || !matches!(read_frame(&mut s).await, Ok(Some(Kind::HelloAck(_))))
                {
                    return (None, 0);
                }
            }
            let mut sent = 0usize;
            if s.write_all(&(16u32 << 20).to_be_bytes()).await.is_ok() {
                let chunk = vec![0u8; 64 * 1024];
                while sent < bytes {
                    match tokio::time::timeout_at(until, s.write_all(&chunk)).await {
                        Ok(Ok(())) => sent += chunk.len(),
                        _ => break,
                    }
                }
            }
            (Some(s), sent)
        });
    }
    let mut held = Vec::new();
    let mut sent_total = 0usize;
    while let Some(r) = peers.join_next().await {
        if let Ok((s, sent)) = r {
            held.extend(s);
            sent_total += sent;
        }
    }
    // Every peer has sent what it could and still holds its connection: the server holds what
    // it read of them now.
    peak.fetch_max(server.rss_kib(), Ordering::Relaxed);
    let rss_held = server.rss_kib();
    drop(held);
    // The server sees the peers close and frees what it held for them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let rss_after = server.rss_kib();
    format!(
        "memory handshake={} peers={} sent_mib={} server_rss_kib_before={rss_before} \
         server_rss_kib_during_max={} server_rss_kib_held={rss_held} \
         server_rss_kib_after={rss_after}",
        if handshake { "done" } else { "none" },
        a.peers,
        sent_total >> 20,
        peak.load(Ordering::Relaxed),
    )
}

// -------------------------------------------------------------------------------------- attack

fn attack_main(a: AttackArgs) -> Result<(), String> {
    let length = seconds(a.seconds)?;
    if a.good_callers == 0 {
        return Err("--good-callers must be at least 1".into());
    }
    let rt = runtime()?;
    println!(
        "attack good_callers={} good_connections={} seconds={} rounds={} attackers={} \
         idle_attackers={} max_connections={} max_in_flight={} cap={} call_rate={}",
        a.good_callers,
        a.good_connections,
        a.seconds,
        a.rounds,
        a.attackers,
        a.idle_attackers,
        a.max_connections,
        a.max_in_flight,
        a.cap,
        a.call_rate
    );
    for &kind in &a.kinds {
        let server = ServerProc::start(&ServeArgs {
            cap: a.cap,
            work_us: 1000,
            max_connections: a.max_connections,
            max_frame: 1 << 20,
            max_in_flight: a.max_in_flight,
            handshake_timeout_ms: 5000,
            idle_timeout_ms: 60_000,
            call_rate: a.call_rate,
        })?;
        let line = rt.block_on(attack_one(&a, kind, &server, length))?;
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
    Ok(())
}

async fn attack_one(
    a: &AttackArgs,
    kind: AttackKind,
    server: &ServerProc,
    length: Duration,
) -> Result<String, String> {
    let good = server.target(None, a.good_connections);
    let warm = window(
        &good,
        Call::Echo,
        a.good_callers,
        Duration::from_millis(300),
        u64::MAX,
    )
    .await;
    if warm.ok.is_empty() {
        return Err(format!("no good call succeeded: {}", warm.errors_text()));
    }
    let rss_before = server.rss_kib();
    // Alone and under attack in turns, so that a change of the machine's other load hits both.
    let mut alone = vec![measured(&good, a, length, server).await];
    let mut under = Vec::new();
    let mut attack = AttackReport::default();
    let mut rss_during = 0;
    for _ in 0..a.rounds.max(1) {
        let running = Attack::start(kind, server.addr, a, length + Duration::from_secs(2))?;
        // Let the attack build up (connections opened, queues filled) before measuring.
        tokio::time::sleep(Duration::from_millis(300)).await;
        under.push(measured(&good, a, length, server).await);
        rss_during = rss_during.max(server.rss_kib());
        attack.add(running.stop());
        alone.push(measured(&good, a, length, server).await);
    }
    let rss_after = server.rss_kib();
    let qps_alone = Measured::mean(&alone, |m| m.qps);
    let qps_under = Measured::mean(&under, |m| m.qps);
    let (lo, hi) = Measured::range(&alone, |m| m.qps);
    let (ulo, uhi) = Measured::range(&under, |m| m.qps);
    let errors: u64 = under.iter().map(|m| m.errors).sum();
    Ok(format!(
        "attack={} good_qps_alone={qps_alone:.0} good_qps_under_attack={qps_under:.0} \
         ratio={:.3} good_qps_alone_range={lo:.0}-{hi:.0} \
         good_qps_under_attack_range={ulo:.0}-{uhi:.0} good_p99_us_alone={:.0} \
         good_p99_us_under_attack={:.0} good_errors_under_attack={errors} attack_ops={} \
         attack_ops_per_s={:.0} attack_errors={} attacker_cpu_cores={:.2} \
         client_cpu_cores_alone={:.2} client_cpu_cores_under_attack={:.2} \
         server_cpu_cores_alone={:.2} server_cpu_cores_under_attack={:.2} \
         server_rss_kib_before={rss_before} server_rss_kib_during={rss_during} \
         server_rss_kib_after={rss_after}",
        kind.name(),
        qps_under / qps_alone.max(1e-9),
        Measured::mean(&alone, |m| m.p99_us),
        Measured::mean(&under, |m| m.p99_us),
        attack.ops,
        attack.ops as f64 / attack.secs.max(1e-9),
        attack.errors,
        attack.cpu_secs / attack.secs.max(1e-9),
        Measured::mean(&alone, |m| m.client_cores),
        Measured::mean(&under, |m| m.client_cores),
        Measured::mean(&alone, |m| m.server_cores),
        Measured::mean(&under, |m| m.server_cores),
    ))
}

/// One window of well-behaved calls, with the CPU both processes used meanwhile.
struct Measured {
    qps: f64,
    p99_us: f64,
    errors: u64,
    /// This process (well-behaved callers, and the attackers when they run).
    client_cores: f64,
    server_cores: f64,
}

impl Measured {
    fn mean(all: &[Measured], f: impl Fn(&Measured) -> f64) -> f64 {
        all.iter().map(&f).sum::<f64>() / all.len().max(1) as f64
    }
    fn range(all: &[Measured], f: impl Fn(&Measured) -> f64) -> (f64, f64) {
        all.iter()
            .map(f)
            .fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)))
    }
}

async fn measured(
    good: &TargetClient,
    a: &AttackArgs,
    length: Duration,
    server: &ServerProc,
) -> Measured {
    let (s0, c0) = (server.cpu_secs(), process_cpu());
    let w = window(good, Call::Echo, a.good_callers, length, u64::MAX).await;
    let (s1, c1) = (server.cpu_secs(), process_cpu());
    Measured {
        qps: w.ok.len() as f64 / w.secs,
        p99_us: f64::from(w.ok.at(0.99)),
        errors: w.errors.values().sum(),
        client_cores: (c1 - c0) / w.secs,
        server_cores: (s1 - s0) / w.secs,
    }
}

/// What an attack did.
#[derive(Default)]
struct AttackReport {
    ops: u64,
    errors: u64,
    /// CPU seconds of the attackers' thread.
    cpu_secs: f64,
    /// Seconds the attackers ran.
    secs: f64,
}

impl AttackReport {
    fn add(&mut self, other: AttackReport) {
        self.ops += other.ops;
        self.errors += other.errors;
        self.cpu_secs += other.cpu_secs;
        self.secs += other.secs;
    }
}

/// Attackers running on a thread of their own, in a single-threaded runtime, until stopped or
/// until their time is up.
struct Attack {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<AttackReport>,
}

/// Counters and limits shared by the attacking tasks.
struct Ctx {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    until: tokio::time::Instant,
    ops: AtomicU64,
    errors: AtomicU64,
    max_in_flight: usize,
    unread_limit: u64,
    control_cores: f64,
}

impl Ctx {
    fn done(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || tokio::time::Instant::now() >= self.until
    }
    fn op(&self, n: u64) {
        self.ops.fetch_add(n, Ordering::Relaxed);
    }
    fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }
}

impl Attack {
    fn start(
        kind: AttackKind,
        addr: SocketAddr,
        a: &AttackArgs,
        limit: Duration,
    ) -> Result<Attack, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let (attackers, idle, max_in_flight, max_connections, unread_limit, control_cores) = (
            a.attackers,
            a.idle_attackers,
            a.max_in_flight,
            a.max_connections,
            a.unread_limit,
            a.control_cores,
        );
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("attackers".into())
            .spawn(move || {
                let cpu0 = thread_cpu();
                let t0 = Instant::now();
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(_) => {
                        return AttackReport {
                            errors: 1,
                            ..AttackReport::default()
                        }
                    }
                };
                let ctx = rt.block_on(async move {
                    let ctx = Arc::new(Ctx {
                        addr,
                        stop: stop2,
                        until: tokio::time::Instant::now() + limit,
                        ops: AtomicU64::new(0),
                        errors: AtomicU64::new(0),
                        max_in_flight,
                        unread_limit,
                        control_cores,
                    });
                    let kinds: Vec<AttackKind> = if kind == AttackKind::All {
                        AttackKind::EACH.to_vec()
                    } else {
                        vec![kind]
                    };
                    let mut tasks = tokio::task::JoinSet::new();
                    for k in kinds {
                        let n = match k {
                            AttackKind::NoHandshake | AttackKind::SlowLoris => idle,
                            AttackKind::ConnFlood => max_connections + 64,
                            AttackKind::UnreadAnswers | AttackKind::CpuControl => 1,
                            _ => attackers,
                        };
                        for _ in 0..n {
                            tasks.spawn(attacker(k, ctx.clone()));
                        }
                    }
                    let until = ctx.until;
                    // Bounded: every attacker stops at `until`; tasks still running then are
                    // dropped with the runtime.
                    let _ = tokio::time::timeout_at(until + Duration::from_secs(1), async {
                        while tasks.join_next().await.is_some() {}
                    })
                    .await;
                    ctx
                });
                let report = AttackReport {
                    ops: ctx.ops.load(Ordering::Relaxed),
                    errors: ctx.errors.load(Ordering::Relaxed),
                    cpu_secs: thread_cpu() - cpu0,
                    secs: t0.elapsed().as_secs_f64(),
                };
                drop(rt);
                report
            })
            .map_err(|e| format!("attack thread: {e}"))?;
        Ok(Attack { stop, thread })
    }

    fn stop(self) -> AttackReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(AttackReport {
            errors: 1,
            ..AttackReport::default()
        })
    }
}

/// CPU seconds of the calling thread.
fn thread_cpu() -> f64 {
    cpu(libc::RUSAGE_THREAD)
}

/// CPU seconds of this process.
fn process_cpu() -> f64 {
    cpu(libc::RUSAGE_SELF)
}

fn cpu(who: libc::c_int) -> f64 {
    // SAFETY: `rusage` is plain data for which all-zero bytes are a valid value, and
    // `getrusage` only writes into the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable `rusage`.
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// How long one socket operation of an attacker may wait before it checks whether to stop.
const STEP: Duration = Duration::from_millis(100);

fn frame(kind: Kind, buf: &mut BytesMut) {
    FrameCodec::encode_kind(kind, buf);
}

fn hello() -> Kind {
    Kind::Hello(Hello {
        protocol_version: 1,
        token: String::new(),
        client_id: "attacker".into(),
        ..Default::default()
    })
}

fn invoke(id: u64, entry: &str, attachments: BTreeMap<String, String>) -> Kind {
    Kind::Invoke(RemoteInvokeMessage {
        message_id: id,
        service_entry_id: entry.into(),
        codec: Codec::MsgPack.to_wire(),
        // The argument list `("x",)` in MessagePack: a one-element array holding "x".
        parameters: bytes::Bytes::from_static(&[0x91, 0xa1, b'x']),
        attachments,
        ..Default::default()
    })
}

/// Reads one frame; `Ok(None)` when the peer closed.
async fn read_frame(s: &mut TcpStream) -> std::io::Result<Option<Kind>> {
    let mut prefix = [0u8; 4];
    match s.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(prefix) as usize;
    if len > 16 << 20 {
        return Err(std::io::Error::other("frame too large"));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    Frame::decode(&body[..])
        .map(|f| f.kind)
        .map_err(std::io::Error::other)
}

/// Reads one frame, giving up after [`STEP`].
async fn read_step(s: &mut TcpStream) -> Result<Option<Kind>, ()> {
    match tokio::time::timeout(STEP, read_frame(s)).await {
        Ok(Ok(k)) => Ok(k),
        _ => Err(()),
    }
}

/// Connects and completes the handshake; `None` when refused or failed.
async fn connect_hello(ctx: &Ctx) -> Option<TcpStream> {
    let mut s = tokio::time::timeout(STEP * 10, TcpStream::connect(ctx.addr))
        .await
        .ok()?
        .ok()?;
    let _ = s.set_nodelay(true);
    let mut buf = BytesMut::new();
    frame(hello(), &mut buf);
    s.write_all(&buf).await.ok()?;
    match tokio::time::timeout(STEP * 10, read_frame(&mut s)).await {
        Ok(Ok(Some(Kind::HelloAck(_)))) => Some(s),
        _ => None,
    }
}

/// A short pause after a failure, so that a failing attacker does not spin.
async fn back_off(ctx: &Ctx) {
    ctx.error();
    tokio::time::sleep(Duration::from_millis(5)).await;
}

async fn attacker(kind: AttackKind, ctx: Arc<Ctx>) {
    match kind {
        AttackKind::Oversized => oversized(&ctx).await,
        AttackKind::Attachments => attachments(&ctx).await,
        AttackKind::InFlight => in_flight(&ctx).await,
        AttackKind::UnreadAnswers => unread_answers(&ctx).await,
        AttackKind::NoHandshake => no_handshake(&ctx).await,
        AttackKind::SlowLoris => slow_loris(&ctx).await,
        AttackKind::ConnFlood => conn_flood(&ctx).await,
        AttackKind::CpuControl => cpu_control(&ctx).await,
        AttackKind::ChurnControl => churn_control(&ctx).await,
        AttackKind::All => {}
    }
}

/// Hello, then a frame announcing 1 GiB; the server must refuse it from the prefix alone.
async fn oversized(ctx: &Ctx) {
    oversized_at(ctx, ctx.addr).await;
}

/// What `oversized` does, against a listener of this thread that reads, answers 32 bytes and
/// closes: the cost of the connection churn alone, without the server.
async fn churn_control(ctx: &Ctx) {
    let Ok(listener) = tokio::net::TcpListener::bind("127.0.0.1:0").await else {
        ctx.error();
        return;
    };
    let Ok(addr) = listener.local_addr() else {
        ctx.error();
        return;
    };
    let until = ctx.until;
    let acceptor = tokio::spawn(async move {
        while let Ok(Ok((mut s, _))) = tokio::time::timeout_at(until, listener.accept()).await {
            let mut sink = [0u8; 64];
            let _ = s.read(&mut sink).await;
            let _ = s.write_all(&[0u8; 32]).await;
        }
    });
    oversized_at(ctx, addr).await;
    acceptor.abort();
}

async fn oversized_at(ctx: &Ctx, addr: SocketAddr) {
    let mut buf = BytesMut::new();
    frame(hello(), &mut buf);
    buf.put_u32(1 << 30);
    while !ctx.done() {
        let Ok(Ok(mut s)) = tokio::time::timeout(STEP * 10, TcpStream::connect(addr)).await else {
            back_off(ctx).await;
            continue;
        };
        if s.write_all(&buf).await.is_err() {
            back_off(ctx).await;
            continue;
        }
        // HelloAck, GoAway, then the close.
        while !ctx.done() {
            match read_step(&mut s).await {
                Ok(Some(_)) => {}
                _ => break,
            }
        }
        ctx.op(1);
    }
}

/// Batches of 32 calls carrying 100 attachments each (the limit is 64): each is answered 500.
async fn attachments(ctx: &Ctx) {
    let many: BTreeMap<String, String> = (0..100).map(|i| (format!("k{i}"), "v".into())).collect();
    let mut batch = BytesMut::new();
    for id in 1..=32 {
        frame(
            invoke(id, "hardening.Target.echo", many.clone()),
            &mut batch,
        );
    }
    batch_loop(ctx, &batch, 32).await;
}

/// Batches of 4 × the per-connection limit of slow calls: the limit's worth run, the rest are
/// answered Overflow.
async fn in_flight(ctx: &Ctx) {
    let n = (4 * ctx.max_in_flight) as u64;
    let mut batch = BytesMut::new();
    for id in 1..=n {
        frame(
            invoke(id, "hardening.Target.work", BTreeMap::new()),
            &mut batch,
        );
    }
    batch_loop(ctx, &batch, n).await;
}

/// Sends `batch` and reads its `answers`, again and again, reconnecting when needed.
async fn batch_loop(ctx: &Ctx, batch: &BytesMut, answers: u64) {
    while !ctx.done() {
        let Some(mut s) = connect_hello(ctx).await else {
            back_off(ctx).await;
            continue;
        };
        'conn: while !ctx.done() {
            if s.write_all(batch).await.is_err() {
                break;
            }
            for _ in 0..answers {
                loop {
                    match read_step(&mut s).await {
                        Ok(Some(_)) => break,
                        Ok(None) => break 'conn,
                        Err(()) if ctx.done() => return,
                        Err(()) => continue,
                    }
                }
            }
            ctx.op(answers);
        }
        back_off(ctx).await;
    }
}

/// Pipelined calls whose answers are never read, up to `unread_limit` calls.
async fn unread_answers(ctx: &Ctx) {
    let Some(mut s) = connect_hello(ctx).await else {
        back_off(ctx).await;
        return;
    };
    let mut id = 0u64;
    let mut batch = BytesMut::new();
    while !ctx.done() && id < ctx.unread_limit {
        batch.clear();
        for _ in 0..1000 {
            id += 1;
            frame(
                invoke(id, "hardening.Target.echo", BTreeMap::new()),
                &mut batch,
            );
        }
        // A write cut short would leave half a frame: wait for it, within the attack's time.
        match tokio::time::timeout_at(ctx.until, s.write_all(&batch)).await {
            Ok(Ok(())) => ctx.op(1000),
            Ok(Err(_)) => {
                ctx.error();
                return;
            }
            // The server stopped reading until the end.
            Err(_) => break,
        }
    }
    // Hold the connection, answers unread, until the attack ends.
    while !ctx.done() {
        tokio::time::sleep(STEP).await;
    }
}

/// Reads and drops whatever the server sends until it closes `s` or the window ends.
async fn hold_until_closed(ctx: &Ctx, s: &mut TcpStream) {
    let mut sink = [0u8; 256];
    while !ctx.done() {
        match tokio::time::timeout(STEP, s.read(&mut sink)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            _ => {}
        }
    }
}

/// A connection that never sends Hello, held until the server closes it; then another.
async fn no_handshake(ctx: &Ctx) {
    while !ctx.done() {
        let Ok(Ok(mut s)) = tokio::time::timeout(STEP * 10, TcpStream::connect(ctx.addr)).await
        else {
            back_off(ctx).await;
            continue;
        };
        ctx.op(1);
        hold_until_closed(ctx, &mut s).await;
    }
}

/// After Hello, a frame of 1 000 bytes sent one byte every 100 ms; reopened when closed.
async fn slow_loris(ctx: &Ctx) {
    while !ctx.done() {
        let Some(mut s) = connect_hello(ctx).await else {
            back_off(ctx).await;
            continue;
        };
        let mut bytes = 1000u32.to_be_bytes().to_vec();
        bytes.resize(1004, 0);
        for b in bytes {
            if ctx.done() || s.write_all(&[b]).await.is_err() {
                break;
            }
            ctx.op(1);
            tokio::time::sleep(STEP).await;
        }
    }
}

/// Connects again and again; a connection the server accepts is held until the end.
async fn conn_flood(ctx: &Ctx) {
    while !ctx.done() {
        let Some(mut s) = connect_hello(ctx).await else {
            // Refused (GoAway) or failed: straight back.
            ctx.op(1);
            tokio::task::yield_now().await;
            continue;
        };
        hold_until_closed(ctx, &mut s).await;
    }
}

/// No traffic: the attackers' thread keeps busy for `control_cores` of its time, to show what
/// taking that much CPU from the machine costs the well-behaved callers by itself.
async fn cpu_control(ctx: &Ctx) {
    let (t0, c0) = (Instant::now(), thread_cpu());
    while !ctx.done() {
        if thread_cpu() - c0 < ctx.control_cores * t0.elapsed().as_secs_f64() {
            let spin = Instant::now();
            while spin.elapsed() < Duration::from_micros(100) {
                std::hint::spin_loop();
            }
            ctx.op(1);
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{Parser, ValueEnum};

    use super::{Args, AttackKind};

    /// Every kind is taken by the name the output prints (`attack=<name>`) and the
    /// documentation lists, and by its hyphenated name of before.
    #[test]
    fn attack_kinds_are_taken_by_their_printed_names() {
        let every = AttackKind::EACH.into_iter().chain([
            AttackKind::All,
            AttackKind::CpuControl,
            AttackKind::ChurnControl,
        ]);
        for kind in every {
            assert_eq!(AttackKind::from_str(kind.name(), false), Ok(kind));
            let hyphenated = kind.name().replace('_', "-");
            assert_eq!(AttackKind::from_str(&hyphenated, false), Ok(kind));
        }
        let parsed = Args::try_parse_from([
            "hardening",
            "attack",
            "--kinds",
            "in_flight,slow_loris,cpu_control",
        ]);
        assert!(parsed.is_ok(), "{parsed:?}");
    }
}
