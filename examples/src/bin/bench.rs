//! The benchmark program: `echo.Echo` over the framework, server and client in separate
//! processes, measured the way the peerbench peers (`raw`, `tarpc`, `tonic`) are measured, so its
//! lines drop into their table.
//!
//! ```text
//! bench --mode server --addr 127.0.0.1:PORT [--max-concurrency N] [--inline-first-poll]
//!       [--peer-name NAME]
//! bench --mode client --addr 127.0.0.1:PORT --conns N --concurrency C --payload BYTES
//!       (--duration S | --requests N) --warmup S --label L [--governance on|off]
//!       [--peer-name NAME]
//! bench [--mode matrix] [--payloads 32,4096] [--concs 1,16,256] [--conns N]
//!       [--duration S] [--warmup S] [--governance on|off]
//! bench --mode client --addr 127.0.0.1:PORT --streams S --size BYTES [--duration S]
//!       [--warmup S] [--governance on|off] [--stream-window N] [--peer-name NAME]
//! ```
//!
//! - `server` serves `echo.Echo` through `rpc::Server`, prints
//!   `LISTENING peer=<name> addr=<addr> pid=<pid>` once it accepts connections, and on SIGTERM
//!   (or SIGINT) prints
//!   `SERVER peer=<name> served=<n> cpu_s=<s> wall_s=<s> cpu_us_per_req=<us> vcsw=<n> ivcsw=<n>
//!   maxrss_kb=<peak resident KiB>`
//!   (CPU and wall time since the process started) and exits at once.
//! - `client` runs C closed-loop callers over N pooled connections to the one address for the
//!   warm-up, then for the measured window, and prints one line
//!   `RESULT peer=<name> mode=client label=L payload=BYTES conc=C conns=N requests=<n>
//!   errors=<n> secs=<s> qps=<q> p50_us=<u> p99_us=<u> p999_us=<u> max_us=<u> mean_us=<u>
//!   cpu_s=<s> cpu_cores=<c> cpu_us_per_req=<u> vcsw=<n> ivcsw=<n> maxrss_kb=<n>`.
//!   A call is measured when it starts inside the window; latencies come from an HDR histogram
//!   (nanoseconds, 3 significant digits), CPU from `getrusage` between the start of the window
//!   and the end of the last call. `--requests N` ends the run after N calls started after the
//!   warm-up instead of after `--duration` (peerbench's flag of the same name): with
//!   `--warmup 0` the process makes exactly N calls plus one per connection before the load
//!   (and, with governance on, one more first, on a connection of its own without governance,
//!   whose failure names the cause), which makes a run under an instruction counter finite and comparable
//!   (`scripts/callgrind.sh`). `--governance off` (or `RPC_BENCH_GOVERNANCE=off` when the
//!   flag is absent) calls with `timeout_ms = 0`, `retry_times = 0` and no circuit breaker for
//!   the service, to show what the governance layers cost; `on` (the default) runs the default
//!   options with a client fallback registered, as a governed deployment would.
//! - `matrix` (the default) starts its own server process (this program, `--mode server` on
//!   port 0), then one client process per case (payloads × concurrencies), and prints each
//!   case's RESULT line and finally the server's SERVER line.
//! - Streams: the server also serves `bench.Items`, whose `items(count, size)` answers a server
//!   stream of `count` byte strings of `size` bytes (`Payload`, a `Vec<u8>` each, as tonic's
//!   peer sends; count 0: until the caller cancels). `client` with `--streams S` opens S
//!   such endless streams on one connection instead of making unary calls, reads them for the warm-up and then for the measured window (3 s by default), and
//!   prints one line `STREAM peer=<name> size=B streams=S items=<n> errors=<n> secs=<s>
//!   items_per_s=<r> cpu_s=<s> cpu_us_per_item=<u>` (items received in the window, client CPU
//!   from `getrusage` over it), the line `tonic-stream` (`bench/tonic-stream`) prints for
//!   tonic. Streams run without a deadline (a deadline covers a whole stream). A server that
//!   has sent stream items adds `items=<n> cpu_us_per_item=<u>` to its SERVER line.
//!
//! Addresses must be on the loopback interface.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use examples::{Echo, EchoClient, EchoServer};
use hdrhistogram::Histogram;
use rpc::{Client, GovernanceOverrides, RpcError, RpcStream, Server, StaticRegistry};

/// Calls answered by the server of this process.
static SERVED: AtomicU64 = AtomicU64::new(0);

/// Stream items produced by the server of this process.
static SENT_ITEMS: AtomicU64 = AtomicU64::new(0);

/// The streaming side of the benchmark: one server stream of equal items.
#[rpc::service(name = "bench.Items")]
pub trait Items {
    /// `count` items of `size` bytes each; 0: until the caller cancels.
    async fn items(&self, count: u64, size: u32) -> Result<RpcStream<Payload>, RpcError>;
}

/// A stream item: opaque bytes in a `Vec<u8>` of their own, carried as a MessagePack `bin`.
/// What tonic's peer streams (a protobuf `bytes` field, a `Vec<u8>` in prost), so both peers
/// copy each item into an allocation of its own on each side and neither checks UTF-8.
#[derive(Debug, Clone, PartialEq)]
pub struct Payload(Vec<u8>);

impl serde::Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Payload {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Payload;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Payload, E> {
                Ok(Payload(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Payload, E> {
                Ok(Payload(v))
            }
        }
        d.deserialize_bytes(Visitor)
    }
}

/// Environment variable that turns governance off when `--governance` is not given.
const GOVERNANCE_ENV: &str = "RPC_BENCH_GOVERNANCE";

/// Latency histograms shared by the callers; a handful, not one per caller (each is ~200 KiB).
const HISTOGRAM_SHARDS: usize = 8;

/// Largest latency the histograms hold: one minute, in nanoseconds.
const MAX_LATENCY_NS: u64 = 60_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Serve echo.Echo until SIGTERM.
    Server,
    /// Load one server and print a RESULT line.
    Client,
    /// Own server process plus one client process per case.
    Matrix,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Governance {
    /// The entry's default options (timeout, retries, breaker).
    On,
    /// No timeout, no retries, no circuit breaker.
    Off,
}

impl Governance {
    fn as_str(self) -> &'static str {
        match self {
            Governance::On => "on",
            Governance::Off => "off",
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Echo benchmark of the framework, peerbench-compatible")]
struct Args {
    /// What to run.
    #[arg(long, value_enum, default_value_t = Mode::Matrix)]
    mode: Mode,
    /// Server: where to listen (port 0 picks one). Client: where to connect.
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: SocketAddr,
    /// Connections to the server (client, matrix).
    #[arg(long, default_value_t = 1)]
    conns: usize,
    /// Calls in flight at once (client).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Bytes of the echoed string (client).
    #[arg(long, default_value_t = 32)]
    payload: usize,
    /// Measured seconds (client: 10 by default; matrix: 2 per case).
    #[arg(long)]
    duration: Option<f64>,
    /// Client: stop after this many calls started after the warm-up, instead of after
    /// `--duration`.
    #[arg(long, conflicts_with = "duration")]
    requests: Option<u64>,
    /// Seconds of load before measuring (client: 1 by default; matrix: 0.5 per case).
    #[arg(long)]
    warmup: Option<f64>,
    /// Free text copied into the RESULT line.
    #[arg(long, default_value = "-")]
    label: String,
    /// Tokio worker threads (default: one per CPU this process may run on).
    #[arg(long)]
    threads: Option<usize>,
    /// The peer name printed in LISTENING / SERVER / RESULT lines.
    #[arg(long, default_value = "rpc")]
    peer_name: String,
    /// Client governance: on (entry defaults) or off (no timeout, retry or breaker). Without
    /// the flag, RPC_BENCH_GOVERNANCE=off|on decides, and "on" is the default.
    #[arg(long, value_enum)]
    governance: Option<Governance>,
    /// Server: poll each handler once on the connection's reader before spawning a task for
    /// it (`ServerBuilder::inline_first_poll`), to measure what the task per call costs.
    #[arg(long)]
    inline_first_poll: bool,
    /// Server: calls handled at once before Overflow is answered.
    #[arg(long, default_value_t = 100_000)]
    max_concurrency: usize,
    /// Matrix: payload sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "32,4096")]
    payloads: Vec<usize>,
    /// Matrix: concurrencies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    concs: Vec<usize>,
    /// Client: open this many server streams on one connection instead of making unary calls
    /// (prints a STREAM line).
    #[arg(long, conflicts_with_all = ["requests", "concurrency", "payload", "conns"])]
    streams: Option<usize>,
    /// Client with --streams: bytes of each stream item.
    #[arg(long, default_value_t = 32, requires = "streams")]
    size: u32,
    /// Client with --streams: items the client buffers per stream
    /// (`ClientBuilder::stream_window`; default: the client's default).
    #[arg(long, requires = "streams")]
    stream_window: Option<u32>,
}

impl Args {
    fn governance(&self) -> Result<Governance, String> {
        if let Some(g) = self.governance {
            return Ok(g);
        }
        match std::env::var(GOVERNANCE_ENV) {
            Err(_) => Ok(Governance::On),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "on" | "1" | "true" => Ok(Governance::On),
                "off" | "0" | "false" => Ok(Governance::Off),
                other => Err(format!("{GOVERNANCE_ENV}={other:?}: use on or off")),
            },
        }
    }

    fn duration(&self, default: f64) -> Result<Duration, String> {
        seconds("--duration", self.duration.unwrap_or(default))
    }

    fn warmup(&self, default: f64) -> Result<Duration, String> {
        seconds("--warmup", self.warmup.unwrap_or(default))
    }

    fn runtime(&self) -> Result<tokio::runtime::Runtime, String> {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.enable_all();
        if let Some(t) = self.threads {
            b.worker_threads(t.max(1));
        }
        b.build()
            .map_err(|e| format!("could not start the tokio runtime: {e}"))
    }
}

fn seconds(flag: &str, s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| format!("{flag} {s}: give a non-negative number of seconds"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.addr.ip().is_loopback() {
        eprintln!(
            "bench: {} is not a loopback address; the benchmark binds and connects to 127.0.0.1 only",
            args.addr
        );
        return ExitCode::from(2);
    }
    let outcome = match args.mode {
        Mode::Server => server_main(&args),
        Mode::Client if args.streams.is_some() => stream_client_main(&args),
        Mode::Client => client_main(&args),
        Mode::Matrix => matrix_main(&args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}

// ------------------------------------------------------------------------------------ measuring

/// What the process has used so far: CPU and context switches.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    /// User plus system CPU time.
    cpu: Duration,
    /// Voluntary context switches.
    vcsw: i64,
    /// Involuntary context switches.
    ivcsw: i64,
}

impl std::ops::Sub for Usage {
    type Output = Usage;
    fn sub(self, earlier: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(earlier.cpu),
            vcsw: self.vcsw - earlier.vcsw,
            ivcsw: self.ivcsw - earlier.ivcsw,
        }
    }
}

impl Usage {
    /// `key=value` fields for a RESULT or SERVER line, per request where it makes sense.
    fn fields(&self, requests: u64) -> String {
        let cpu_us = if requests > 0 {
            self.cpu.as_secs_f64() * 1e6 / requests as f64
        } else {
            0.0
        };
        format!(
            "cpu_us_per_req={cpu_us:.3} vcsw={} ivcsw={}",
            self.vcsw, self.ivcsw
        )
    }
}

fn process_usage() -> Usage {
    // SAFETY: `rusage` is plain data for which all-zero bytes are a valid value, and
    // `getrusage` only writes into the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable `rusage`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return Usage::default();
    }
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Usage {
        cpu: time(ru.ru_utime) + time(ru.ru_stime),
        vcsw: ru.ru_nvcsw as i64,
        ivcsw: ru.ru_nivcsw as i64,
    }
}

/// Peak resident memory of the process so far, in KiB (`ru_maxrss`).
fn peak_rss_kb() -> i64 {
    // SAFETY: as in `process_usage`.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable `rusage`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    ru.ru_maxrss as i64
}

fn histogram() -> Histogram<u64> {
    // 1 ns .. 60 s with 3 significant digits: valid bounds, cannot fail.
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect("valid histogram bounds")
}

// -------------------------------------------------------------------------------------- server

/// The echo implementation: answers what it is sent and counts the calls.
struct CountingEcho;

impl Echo for CountingEcho {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        SERVED.fetch_add(1, Ordering::Relaxed);
        Ok(text)
    }
}

/// The stream implementation: endless (or `count`) copies of one item, counted.
struct ItemSource;

impl Items for ItemSource {
    async fn items(&self, count: u64, size: u32) -> Result<RpcStream<Payload>, RpcError> {
        let item = Payload(vec![b'x'; size as usize]);
        let count = if count == 0 { u64::MAX } else { count };
        Ok(RpcStream::iter((0..count).map(move |_| {
            SENT_ITEMS.fetch_add(1, Ordering::Relaxed);
            item.clone()
        })))
    }
}

/// The client-side fallback of governed runs: its layer is in every call's path, as in a
/// governed deployment, but it answers nothing: a call it would answer (the server unreachable,
/// overflowing, or gone mid-run) fails, so that the run counts it as an error instead of
/// measuring local answers.
struct LocalEcho;

impl Echo for LocalEcho {
    async fn echo(&self, _text: String) -> Result<String, RpcError> {
        Err(RpcError::business(
            "the call failed, and the bench's fallback answers nothing",
        ))
    }
}

fn server_main(args: &Args) -> Result<(), String> {
    let wall0 = Instant::now();
    let at_start = process_usage();
    let rt = args.runtime()?;
    let peer = args.peer_name.as_str();
    rt.block_on(async {
        let server = Server::builder()
            .max_concurrency(args.max_concurrency)
            .inline_first_poll(args.inline_first_poll)
            .add_service(EchoServer::new(CountingEcho))
            .add_service(ItemsServer::new(ItemSource))
            .serve(args.addr)
            .await
            .map_err(|e| format!("could not serve on {}: {e}", args.addr))?;
        println!(
            "LISTENING peer={peer} addr={} pid={}",
            server.local_addr(),
            std::process::id()
        );
        let _ = std::io::stdout().flush();
        wait_for_signal().await?;
        // Dropping the handle would start a graceful drain; the process exits first.
        std::mem::forget(server);
        Ok::<(), String>(())
    })?;
    let used = process_usage() - at_start;
    let served = SERVED.load(Ordering::Relaxed);
    let items = SENT_ITEMS.load(Ordering::Relaxed);
    // The unary line as it always was; stream figures only after a stream run.
    let stream_fields = if items > 0 {
        format!(
            " items={items} cpu_us_per_item={:.3}",
            used.cpu.as_secs_f64() * 1e6 / items as f64
        )
    } else {
        String::new()
    };
    println!(
        "SERVER peer={peer} served={served} cpu_s={:.3} wall_s={:.3} {} maxrss_kb={}{stream_fields}",
        used.cpu.as_secs_f64(),
        wall0.elapsed().as_secs_f64(),
        used.fields(served),
        peak_rss_kb(),
    );
    let _ = std::io::stdout().flush();
    // Connection tasks are not waited for.
    std::process::exit(0);
}

async fn wait_for_signal() -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT handler: {e}"))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

// -------------------------------------------------------------------------------------- client

/// What the callers measured.
struct Measured {
    hist: Histogram<u64>,
    errors: u64,
    secs: f64,
    used: Usage,
}

fn client_main(args: &Args) -> Result<(), String> {
    if args.addr.port() == 0 {
        return Err("--mode client needs the server's --addr 127.0.0.1:PORT".into());
    }
    if args.conns == 0 || args.concurrency == 0 {
        return Err("--conns and --concurrency must be at least 1".into());
    }
    let governance = args.governance()?;
    let warmup = args.warmup(1.0)?;
    let duration = args.duration(10.0)?;
    let rt = args.runtime()?;
    let m = rt.block_on(run_load(args, governance, warmup, duration))?;
    let n = m.hist.len();
    let cpu = m.used.cpu.as_secs_f64();
    let us = |q: f64| m.hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "RESULT peer={} mode=client label={} payload={} conc={} conns={} requests={n} errors={} \
         secs={:.3} qps={:.1} p50_us={:.1} p99_us={:.1} p999_us={:.1} max_us={:.1} mean_us={:.1} \
         cpu_s={cpu:.3} cpu_cores={:.3} {} maxrss_kb={}",
        args.peer_name,
        if args.label.is_empty() {
            "-"
        } else {
            &args.label
        },
        args.payload,
        args.concurrency,
        args.conns,
        m.errors,
        m.secs,
        n as f64 / m.secs,
        us(0.5),
        us(0.99),
        us(0.999),
        m.hist.max() as f64 / 1000.0,
        m.hist.mean() / 1000.0,
        cpu / m.secs,
        m.used.fields(n),
        peak_rss_kb(),
    );
    let _ = std::io::stdout().flush();
    if m.errors > 0 {
        eprintln!("bench: {} calls failed or came back wrong", m.errors);
    }
    Ok(())
}

fn echo_client(args: &Args, governance: Governance) -> Result<EchoClient, String> {
    let registry = StaticRegistry::from_list(&args.addr.to_string())
        .map_err(|e| format!("endpoint list {}: {e}", args.addr))?;
    let mut builder = Client::builder()
        .registry(registry)
        .connections_per_endpoint(args.conns);
    if governance == Governance::On {
        // As a governed deployment runs: default options and a fallback registered (its layer
        // is in the path; it answers no failed call, which then counts as an error).
        builder = builder.fallback(EchoServer::new(LocalEcho));
    } else {
        builder = builder.override_options(
            EchoClient::SERVICE_ID,
            GovernanceOverrides {
                timeout_ms: Some(0),
                retry_times: Some(0),
                enable_circuit_breaker: Some(false),
                ..GovernanceOverrides::NONE
            },
        );
    }
    Ok(EchoClient::new(builder.build()))
}

async fn run_load(
    args: &Args,
    governance: Governance,
    warmup: Duration,
    duration: Duration,
) -> Result<Measured, String> {
    let echo = echo_client(args, governance)?;
    let payload = "x".repeat(args.payload);
    if governance == Governance::On {
        // Its own failure first, by a client without the fallback: the governed client's
        // error would be its fallback's, which says nothing of the cause.
        let plain = echo_client(args, Governance::Off)?;
        if let Err(e) = plain.echo(payload.clone()).await {
            return Err(format!("echo to {} failed: {e}", args.addr));
        }
    }
    // One call per pooled connection first: connections are opened on first use, and an
    // unreachable server should be an error, not a run full of failed calls.
    for _ in 0..args.conns {
        match echo.echo(payload.clone()).await {
            Ok(answer) if answer.len() == payload.len() => {}
            Ok(answer) => {
                return Err(format!(
                    "echo to {} answered {} bytes for {} sent",
                    args.addr,
                    answer.len(),
                    payload.len()
                ))
            }
            Err(e) => return Err(format!("echo to {} failed: {e}", args.addr)),
        }
    }

    let begin = Instant::now() + warmup;
    // With --requests the run ends on a count: each caller takes one from `remaining` before a
    // measured call and stops when none is left, so exactly that many measured calls are made.
    let end = args.requests.is_none().then(|| begin + duration);
    let remaining = Arc::new(AtomicI64::new(
        args.requests
            .map_or(i64::MAX, |r| i64::try_from(r).unwrap_or(i64::MAX)),
    ));
    // CPU at the start of the measured window, taken by a plain thread so that a busy runtime
    // does not delay the sample.
    let at_begin = std::thread::spawn(move || {
        std::thread::sleep(begin.saturating_duration_since(Instant::now()));
        process_usage()
    });
    let shards: Arc<Vec<Mutex<Histogram<u64>>>> = Arc::new(
        (0..HISTOGRAM_SHARDS.min(args.concurrency))
            .map(|_| Mutex::new(histogram()))
            .collect(),
    );
    let payload: Arc<str> = payload.into();
    let mut callers = Vec::with_capacity(args.concurrency);
    for i in 0..args.concurrency {
        let echo = echo.clone();
        let payload = payload.clone();
        let shards = shards.clone();
        let remaining = remaining.clone();
        callers.push(tokio::spawn(async move {
            let shard = &shards[i % shards.len()];
            let mut errors = 0u64;
            let mut last = begin;
            loop {
                let t0 = Instant::now();
                match end {
                    Some(end) if t0 >= end => break,
                    None if t0 >= begin && remaining.fetch_sub(1, Ordering::Relaxed) <= 0 => break,
                    _ => {}
                }
                let ok = matches!(
                    echo.echo(String::from(&*payload)).await,
                    Ok(answer) if answer.len() == payload.len()
                );
                let t1 = Instant::now();
                if t0 >= begin {
                    if !ok {
                        errors += 1;
                    }
                    let ns = (t1 - t0).as_nanos().clamp(1, MAX_LATENCY_NS as u128) as u64;
                    let _ = shard.lock().unwrap_or_else(|p| p.into_inner()).record(ns);
                    last = t1;
                }
            }
            (errors, last)
        }));
    }
    let mut errors = 0;
    let mut last = begin;
    for c in callers {
        let (e, l) = c.await.map_err(|e| format!("a caller task failed: {e}"))?;
        errors += e;
        last = last.max(l);
    }
    let at_end = process_usage();
    let at_begin = at_begin
        .join()
        .map_err(|_| "the CPU sampling thread panicked".to_string())?;
    let mut hist = histogram();
    for s in shards.iter() {
        hist.add(&*s.lock().unwrap_or_else(|p| p.into_inner()))
            .map_err(|e| format!("merging latency histograms: {e}"))?;
    }
    echo.client().close();
    Ok(Measured {
        hist,
        errors,
        secs: (last - begin).as_secs_f64().max(1e-9),
        used: at_end - at_begin,
    })
}

// ------------------------------------------------------------------------------------- streams

fn stream_client_main(args: &Args) -> Result<(), String> {
    let streams = args.streams.unwrap_or(1);
    if args.addr.port() == 0 {
        return Err("--mode client needs the server's --addr 127.0.0.1:PORT".into());
    }
    if streams == 0 {
        return Err("--streams must be at least 1".into());
    }
    let governance = args.governance()?;
    let warmup = args.warmup(1.0)?;
    let duration = args.duration(3.0)?;
    if duration.is_zero() {
        return Err("--duration must be above 0 for a stream run".into());
    }
    let rt = args.runtime()?;
    rt.block_on(run_streams(args, streams, governance, warmup, duration))
}

async fn run_streams(
    args: &Args,
    streams: usize,
    governance: Governance,
    warmup: Duration,
    duration: Duration,
) -> Result<(), String> {
    let registry = StaticRegistry::from_list(&args.addr.to_string())
        .map_err(|e| format!("endpoint list {}: {e}", args.addr))?;
    // A deadline covers a whole stream: none here. Governance off also drops retries and the
    // breaker of the set-up.
    let overrides = match governance {
        Governance::On => GovernanceOverrides {
            timeout_ms: Some(0),
            ..GovernanceOverrides::NONE
        },
        Governance::Off => GovernanceOverrides {
            timeout_ms: Some(0),
            retry_times: Some(0),
            enable_circuit_breaker: Some(false),
            ..GovernanceOverrides::NONE
        },
    };
    let mut builder = Client::builder()
        .registry(registry)
        .connections_per_endpoint(1)
        .override_options(ItemsClient::SERVICE_ID, overrides);
    if let Some(window) = args.stream_window {
        builder = builder.stream_window(window);
    }
    let client = ItemsClient::new(builder.build());
    let size = args.size;
    // One short stream first: an unreachable or wrong server is an error, not a run of zeros.
    let first = client
        .items(3, size)
        .await
        .map_err(|e| format!("items to {} failed: {e}", args.addr))?
        .collect_all()
        .await
        .map_err(|e| format!("the first stream from {} failed: {e}", args.addr))?;
    if first.len() != 3 || first.iter().any(|i| i.0.len() != size as usize) {
        return Err(format!(
            "asked {} for 3 items of {size} bytes, got {:?} bytes",
            args.addr,
            first.iter().map(|i| i.0.len()).collect::<Vec<_>>()
        ));
    }

    let items = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (client, items, errors, stop) =
            (client.clone(), items.clone(), errors.clone(), stop.clone());
        readers.push(tokio::spawn(async move {
            let mut s = match client.items(0, size).await {
                Ok(s) => s,
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            while !stop.load(Ordering::Relaxed) {
                match s.next().await {
                    Some(Ok(item)) if item.0.len() == size as usize => {
                        items.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
        }));
    }
    // The samples are taken on this (non-worker) thread, so a busy runtime does not delay them.
    tokio::time::sleep(warmup).await;
    let (n0, u0, t0) = (
        items.load(Ordering::Relaxed),
        process_usage(),
        Instant::now(),
    );
    tokio::time::sleep(duration).await;
    let (n1, u1, secs) = (
        items.load(Ordering::Relaxed),
        process_usage(),
        t0.elapsed().as_secs_f64(),
    );
    stop.store(true, Ordering::Relaxed);
    let n = n1 - n0;
    let cpu = (u1 - u0).cpu.as_secs_f64();
    let errors = errors.load(Ordering::Relaxed);
    println!(
        "STREAM peer={} size={size} streams={streams} items={n} errors={errors} secs={secs:.3} \
         items_per_s={:.1} cpu_s={cpu:.3} cpu_us_per_item={:.3}",
        args.peer_name,
        n as f64 / secs,
        cpu * 1e6 / n.max(1) as f64
    );
    let _ = std::io::stdout().flush();
    if errors > 0 {
        return Err(format!("{errors} streams failed or carried wrong items"));
    }
    // Readers still in a stream are not waited for: the process exits.
    std::process::exit(0);
}

// -------------------------------------------------------------------------------------- matrix

/// A server process started by the matrix; stopped with SIGTERM, killed if it does not exit.
struct ServerProcess {
    child: Child,
    /// Its standard output, line by line, read on a thread of its own: a server that stops
    /// printing cannot hold the matrix, whose waits for a line all have a deadline.
    lines: std::sync::mpsc::Receiver<String>,
}

/// The command of a matrix's server process: this program in server mode, with the run's
/// server flags.
fn server_command(args: &Args, exe: &std::path::Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["--mode", "server", "--addr", "127.0.0.1:0"])
        .args(["--peer-name", &args.peer_name])
        .args(["--max-concurrency", &args.max_concurrency.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(t) = args.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    if args.inline_first_poll {
        cmd.arg("--inline-first-poll");
    }
    cmd
}

/// How long the matrix waits for a server's LISTENING line, and for its SERVER line.
const SERVER_LINE_WAIT: Duration = Duration::from_secs(10);

impl ServerProcess {
    fn start(args: &Args) -> Result<(ServerProcess, SocketAddr), String> {
        let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
        let mut child = server_command(args, &exe)
            .spawn()
            .map_err(|e| format!("could not start the server process: {e}"))?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            return Err("the server process has no stdout".into());
        };
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // (Dropped on an error below: the process is killed.)
        let server = ServerProcess { child, lines };
        let line = server
            .next_line("LISTENING ", Instant::now() + SERVER_LINE_WAIT)
            .map_err(|why| format!("the server process {why} before printing LISTENING"))?;
        let addr = field(&line["LISTENING ".len()..], "addr")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("no addr= in {line:?}"))?;
        Ok((server, addr))
    }

    /// The next line of its output starting with `prefix`, before `deadline`; otherwise why
    /// not.
    fn next_line(&self, prefix: &str, deadline: Instant) -> Result<String, &'static str> {
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(wait) {
                Ok(line) if line.starts_with(prefix) => return Ok(line.trim().to_string()),
                Ok(_) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    return Err("printed nothing more for 10 s")
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Err("exited"),
            }
        }
    }

    /// SIGTERM, then the SERVER line (none if it is not printed within 10 s: the process is
    /// then killed).
    fn stop(self) -> Option<String> {
        // SAFETY: plain syscall on the pid of a child this process started and still owns.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        self.next_line("SERVER ", Instant::now() + SERVER_LINE_WAIT)
            .ok()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of `key=` in a line of `key=value` pairs.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn matrix_main(args: &Args) -> Result<(), String> {
    let governance = args.governance()?;
    let duration = args.duration(2.0)?;
    let warmup = args.warmup(0.5)?;
    if args.conns == 0
        || args.payloads.is_empty()
        || args.concs.is_empty()
        || args.concs.contains(&0)
    {
        return Err("--conns and every --concs value must be at least 1, and --payloads and --concs non-empty".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let (server, addr) = ServerProcess::start(args)?;
    eprintln!(
        "bench: server {} on {addr}; {} cases of {:.1} s + {:.1} s warm-up, governance {}",
        server.child.id(),
        args.payloads.len() * args.concs.len(),
        duration.as_secs_f64(),
        warmup.as_secs_f64(),
        governance.as_str()
    );
    let mut failure = None;
    'cases: for &payload in &args.payloads {
        for &conc in &args.concs {
            let mut cmd = Command::new(&exe);
            cmd.args(["--mode", "client", "--addr", &addr.to_string()])
                .args(["--conns", &args.conns.min(conc).to_string()])
                .args(["--concurrency", &conc.to_string()])
                .args(["--payload", &payload.to_string()])
                .args(["--duration", &duration.as_secs_f64().to_string()])
                .args(["--warmup", &warmup.as_secs_f64().to_string()])
                .args(["--label", "matrix"])
                .args(["--peer-name", &args.peer_name])
                .args(["--governance", governance.as_str()])
                .stderr(Stdio::inherit());
            if let Some(t) = args.threads {
                cmd.args(["--threads", &t.to_string()]);
            }
            match cmd.output() {
                Ok(out) if out.status.success() => {
                    let text = String::from_utf8_lossy(&out.stdout);
                    for line in text.lines().filter(|l| l.starts_with("RESULT ")) {
                        println!("{line}");
                    }
                    let _ = std::io::stdout().flush();
                }
                Ok(out) => {
                    failure = Some(format!(
                        "client for payload {payload} conc {conc} exited with {}",
                        out.status
                    ));
                    break 'cases;
                }
                Err(e) => {
                    failure = Some(format!("could not start a client process: {e}"));
                    break 'cases;
                }
            }
        }
    }
    match server.stop() {
        Some(line) => println!("{line}"),
        None => eprintln!("bench: the server printed no SERVER line"),
    }
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The matrix's server processes run with the server flags the run was given: before,
    /// `--inline-first-poll` was taken and not passed on, so the matrix measured the default.
    #[test]
    fn a_matrix_server_gets_the_runs_server_flags() {
        let args = Args::parse_from([
            "bench",
            "--inline-first-poll",
            "--max-concurrency",
            "7",
            "--threads",
            "2",
        ]);
        let cmd = server_command(&args, std::path::Path::new("bench"));
        let given: Vec<&str> = cmd.get_args().filter_map(|a| a.to_str()).collect();
        for flag in [
            &["--mode", "server"][..],
            &["--max-concurrency", "7"],
            &["--threads", "2"],
            &["--inline-first-poll"],
        ] {
            assert!(
                given.windows(flag.len()).any(|w| w == flag),
                "{flag:?} in {given:?}"
            );
        }
        let plain = server_command(&Args::parse_from(["bench"]), std::path::Path::new("bench"));
        assert!(!plain.get_args().any(|a| a == "--inline-first-poll"));
    }
}
