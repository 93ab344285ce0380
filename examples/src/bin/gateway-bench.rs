//! What the HTTP/JSON gateway costs: one small JSON echo call measured three ways in one run.
//!
//! ```text
//! gateway-bench [--connections 32] [--requests N] [--seconds S] [--warmup-seconds W]
//!               [--text TEXT] [--cases axum,gateway,client[,hop,mux]] [--threads T]
//!               [--rounds R]
//!               [--echo-inline-first-poll | --echo-task-per-call]
//!               [--plain-echo-work-ns N]
//! ```
//!
//! - `axum`: a plain axum handler answering the call's route (`POST /api/echo.Echo/echo`,
//!   reading the same JSON body and answering the text as JSON), the limit of HTTP on this
//!   machine;
//! - `gateway`: the same request through `rpc-gateway` to an `echo.Echo` server (both in this
//!   process, found through the in-process registry), the gateway calling it with the governed
//!   client and its default options;
//! - `client`: the same call made directly with the framework's client (`EchoClient`), the
//!   cost without HTTP;
//! - `hop` and `mux` (only when asked for): reference points with no framework, the plain
//!   axum handler passing the text over one more TCP round trip to a plain echo on the echo
//!   runtime (a 4-byte length and the bytes each way). `hop` writes and reads on a connection
//!   of its own per request in flight (taken from an idle list and given back); `mux` puts
//!   every request on one connection, tagged with an id, a writer task sending all the
//!   requests of a scheduler round in one write (it yields once for them, as the gateway's
//!   writer does) and a reader task handing each answer to its request: the design of the
//!   gateway's client without anything else it does. The plain echo costs far less than a
//!   server that decodes, dispatches and governs its calls; `--plain-echo-work-ns N` makes it
//!   busy-wait N ns on each message, to see what a costlier server behind the hop takes.
//!
//! Each case runs `--connections` closed-loop callers at once (for HTTP, one keep-alive
//! connection each through hyper; for the client, that many calls in flight on its pooled
//! connections) for `--warmup-seconds`, then measures until `--requests` calls were made or
//! `--seconds` passed, whichever comes first. Latency is recorded per call in an HDR histogram
//! (microseconds, 3 significant digits). Everything listens on 127.0.0.1 on free ports. Three
//! tokio runtimes share the machine: `echo` runs the echo server, `http` the axum echo and the
//! gateway (with the gateway's client), `callers` the callers (and the client of `client`).
//! Since they share it, each gets a third of the CPUs available (at least one worker thread)
//! unless `--threads` says otherwise: with a worker per CPU in each, two CPUs would carry six
//! busy workers, and the figures would measure the operating system's scheduler more than
//! either server. This favours the gateway: on two CPUs plain axum is somewhat faster with two
//! workers per runtime, and the gateway slower (the README gives the figures). The line
//! `runtimes: ...` says how many workers each had.
//!
//! The echo server answers in its handler's first poll, on its connection's reader
//! ([`inline_first_poll`](rpc::ServerBuilder::inline_first_poll), meant for handlers that never
//! block, as an echo's), as the plain axum handler answers in its connection's task. It is the
//! service behind the gateway, not the part under test, yet on a machine where everything
//! shares the CPUs each microsecond it spends is taken from the gateway's requests per second.
//! `--echo-task-per-call` runs it with the server's defaults instead (each call in a task of
//! its own); `--echo-inline-first-poll` names the default. The line `echo: ...` says which ran.
//!
//! With `--rounds R` the cases run R times, one after the other in each round (axum, gateway,
//! client, axum, gateway, ...), and each case's line sums its rounds (calls, seconds, CPU, one
//! histogram): a machine whose speed drifts during the run then weighs on every case alike.
//! Each round's ratio is printed too (`round <k>: gateway/axum=<ratio>`), then the rounds'
//! median, lowest and highest (`rounds: gateway/axum median=<r> min=<r> max=<r>`): on a machine
//! whose speed drifts, single rounds spread widely, and the median says more than any of them.
//!
//! Output (stable for scripts), one line per case and a summary:
//!
//! ```text
//! GATEWAY case=<axum|gateway|client> rps=<n> p50_us=<n> p99_us=<n> requests=<n> secs=<s>
//!   cpu_us_per_req=<us> own_cpu_us_per_req=<us>
//! summary: gateway/axum=<ratio>
//! reference: <hop|mux>/axum=<ratio> median=<r> min=<r> max=<r>
//! ```
//!
//! (one line per case; a `reference` line for each of `hop` and `mux` that ran, with its
//! spread over the rounds when there were several.) `cpu_us_per_req` is the CPU time of the whole process over the
//! measurement divided by the calls made; `own_cpu_us_per_req` counts only the part under test:
//! the `http` runtime for `axum`, `gateway`, `hop` and `mux` (so the gateway's figure leaves out the echo
//! server and the callers, and is what the gateway itself costs a call), the `callers` runtime
//! for `client`. On a machine where the run is CPU-bound they say where a difference in
//! requests per second comes from.
//!
//! Every answer is checked (status 200, the text echoed); a run with a failed call prints what
//! failed and exits with status 1, since its figures would not measure the call. The request
//! body is `{"text": TEXT}` when the echo server publishes its parameter names, else the
//! positional `[TEXT]` the gateway takes from servers that publish none (the line
//! `body: ...` says which).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Json;
use bytes::Bytes;
use clap::Parser;
use examples::{EchoClient, EchoServer, EchoService};
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rpc::{Client, InProcessRegistry, Registry, Server};
use rpc_gateway::Gateway;
use serde_json::Value;

/// The route of the echo entry, at the gateway and at the plain axum handler alike.
const ECHO_PATH: &str = "/api/echo.Echo/echo";

/// The echo entry's id, as the gateway lists it.
const ECHO_ENTRY: &str = "echo.Echo.echo";

/// Largest latency the histograms hold: one minute, in microseconds.
const MAX_LATENCY_US: u64 = 60_000_000;

#[derive(Parser, Debug)]
#[command(about = "Gateway overhead: plain axum vs the gateway vs the direct client")]
struct Args {
    /// Callers at once (HTTP: one keep-alive connection each).
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Stop a case after this many measured calls...
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// ...or after this many seconds, whichever comes first.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Seconds of load before each case is measured.
    #[arg(long, default_value_t = 1.0)]
    warmup_seconds: f64,
    /// The echoed text (the body is 16 to 32 bytes with the default).
    #[arg(long, default_value = "hello, gateway")]
    text: String,
    /// The cases to run, in order.
    #[arg(long, value_delimiter = ',', default_value = "axum,gateway,client")]
    cases: Vec<Case>,
    /// Worker threads of each runtime (echo, http, callers); default: a third of the CPUs
    /// available, at least one.
    #[arg(long)]
    threads: Option<usize>,
    /// Times every case runs, the cases taking turns; each case's figures sum its rounds.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Let the echo server answer in its handler's first poll (the default).
    #[arg(long, conflicts_with = "echo_task_per_call")]
    echo_inline_first_poll: bool,
    /// Run the echo server with the server's defaults: each call in a task of its own.
    #[arg(long)]
    echo_task_per_call: bool,
    /// Nanoseconds of CPU the plain echo behind `hop` and `mux` spends on each message
    /// (busy-waiting), to model a server costlier than a bare echo.
    #[arg(long, default_value_t = 0)]
    plain_echo_work_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Case {
    /// A plain axum echo handler.
    Axum,
    /// The same call through the gateway.
    Gateway,
    /// The direct Rust client call.
    Client,
    /// The plain axum handler with one more plain TCP round trip, a connection per request.
    Hop,
    /// The same round trip with every request on one connection, writes batched.
    Mux,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Axum => "axum",
            Case::Gateway => "gateway",
            Case::Client => "client",
            Case::Hop => "hop",
            Case::Mux => "mux",
        }
    }
}

/// What one case measured.
struct Figures {
    requests: u64,
    secs: f64,
    /// CPU seconds the whole process (servers and callers) used over the measurement.
    cpu_secs: f64,
    /// CPU seconds of the part under test: the axum server, the gateway (its HTTP server and
    /// its client), or the calling client.
    own_cpu_secs: f64,
    histogram: Histogram<u64>,
}

impl Figures {
    /// Adds the figures of another round of the same case.
    fn add(&mut self, other: &Figures) -> Result<(), String> {
        self.requests += other.requests;
        self.secs += other.secs;
        self.cpu_secs += other.cpu_secs;
        self.own_cpu_secs += other.own_cpu_secs;
        self.histogram
            .add(&other.histogram)
            .map_err(|e| format!("could not merge the rounds' histograms: {e}"))
    }

    fn rps(&self) -> f64 {
        self.requests as f64 / self.secs.max(1e-9)
    }

    /// CPU microseconds per call, callers included.
    fn cpu_us_per_req(&self) -> f64 {
        self.cpu_secs * 1e6 / (self.requests.max(1) as f64)
    }

    /// CPU microseconds per call of the part under test.
    fn own_cpu_us_per_req(&self) -> f64 {
        self.own_cpu_secs * 1e6 / (self.requests.max(1) as f64)
    }
}

/// CPU seconds (user and system) this process used so far.
fn cpu_secs() -> f64 {
    // SAFETY: getrusage(2) fills the zeroed struct it is given; nothing else is touched.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("gateway-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The CPU clocks of a runtime's threads, to tell the CPU of one part of the run (the server
/// under test, the echo server, the callers) from the rest of the process.
#[derive(Clone, Default)]
struct ThreadClocks(Arc<Mutex<Vec<libc::clockid_t>>>);

impl ThreadClocks {
    /// Adds the calling thread's CPU clock.
    fn register(&self) {
        let mut clock: libc::clockid_t = 0;
        // SAFETY: pthread_getcpuclockid(3) on the calling thread's own handle writes the clock id
        // into `clock` and touches nothing else.
        let found = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) };
        if found == 0 {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(clock);
        }
    }

    /// CPU seconds the threads used so far (a thread that ended no longer counts).
    fn secs(&self) -> f64 {
        let clocks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        clocks
            .iter()
            .filter_map(|clock| {
                let mut t = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: clock_gettime(2) writes the clock's time into `t`; an ended thread's
                // clock answers an error, which is skipped.
                let read = unsafe { libc::clock_gettime(*clock, &mut t) };
                (read == 0).then(|| t.tv_sec as f64 + t.tv_nsec as f64 / 1e9)
            })
            .sum()
    }
}

/// Worker threads per runtime: `--threads`, else a third of the CPUs available (at least one),
/// since the three runtimes share them.
fn workers(threads: Option<usize>) -> usize {
    threads
        .unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get) / 3
        })
        .max(1)
}

fn runtime(
    name: &str,
    workers: usize,
    clocks: &ThreadClocks,
) -> Result<tokio::runtime::Runtime, String> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(workers);
    let on_start = clocks.clone();
    builder
        .thread_name(name)
        .on_thread_start(move || on_start.register())
        .enable_all()
        .build()
        .map_err(|e| format!("could not start the {name} runtime: {e}"))
}

fn run(args: &Args) -> Result<(), String> {
    if args.connections == 0 {
        return Err("--connections must be at least 1".into());
    }
    if !(args.seconds > 0.0 && args.seconds.is_finite()) {
        return Err(format!(
            "--seconds {}: give a positive number",
            args.seconds
        ));
    }
    if !(args.warmup_seconds >= 0.0 && args.warmup_seconds.is_finite()) {
        return Err(format!(
            "--warmup-seconds {}: give zero or a positive number",
            args.warmup_seconds
        ));
    }
    if args.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    if args.requests == 0 {
        return Err("--requests must be at least 1".into());
    }
    let (http_clocks, echo_clocks, caller_clocks) = Default::default();
    let workers = workers(args.threads);
    let echo = runtime("echo", workers, &echo_clocks)?;
    let http = runtime("http", workers, &http_clocks)?;
    let callers = runtime("callers", workers, &caller_clocks)?;
    // `--echo-inline-first-poll` names the default; clap refuses it beside `--echo-task-per-call`.
    let echo_inline = args.echo_inline_first_poll || !args.echo_task_per_call;

    let registry: Arc<dyn Registry> = Arc::new(InProcessRegistry::new());
    let echo_server = echo.block_on(
        Server::builder()
            .shared_registry(registry.clone())
            .max_concurrency(100_000)
            .inline_first_poll(echo_inline)
            .add_service(EchoServer::new(EchoService::default()))
            .serve("127.0.0.1:0"),
    );
    let _echo_server = echo_server.map_err(|e| format!("could not start the echo server: {e}"))?;
    let (axum_addr, gateway_addr, body) = http.block_on(start_http(&registry, &args.text))?;
    let references = if args.cases.contains(&Case::Hop) || args.cases.contains(&Case::Mux) {
        let plain_echo = echo.block_on(start_plain_echo(Duration::from_nanos(
            args.plain_echo_work_ns,
        )))?;
        Some(http.block_on(start_references(plain_echo))?)
    } else {
        None
    };
    println!("body: {}", String::from_utf8_lossy(&body));
    println!("runtimes: {workers} worker thread(s) each (echo, http, callers)");
    println!(
        "echo: {}",
        if echo_inline {
            "inline_first_poll"
        } else {
            "server defaults (a task per call)"
        }
    );

    let expected = Bytes::from(
        serde_json::to_vec(&Value::String(args.text.clone())).map_err(|e| e.to_string())?,
    );
    let mut results: Vec<(Case, Figures)> = Vec::new();
    let mut round_ratios = Vec::new();
    let mut reference_ratios = [(Case::Hop, Vec::new()), (Case::Mux, Vec::new())];
    for round in 1..=args.rounds {
        let mut this_round = Vec::new();
        for case in &args.cases {
            let figures = callers.block_on(async {
                match case {
                    Case::Axum => http_case(args, axum_addr, &body, &expected, &http_clocks).await,
                    Case::Gateway => {
                        http_case(args, gateway_addr, &body, &expected, &http_clocks).await
                    }
                    Case::Client => client_case(args, &registry, &caller_clocks).await,
                    Case::Hop | Case::Mux => {
                        let (hop, mux) = references.ok_or("no reference was started")?;
                        let addr = if *case == Case::Hop { hop } else { mux };
                        http_case(args, addr, &body, &expected, &http_clocks).await
                    }
                }
            })?;
            this_round.push((*case, figures.rps()));
            match results.iter_mut().find(|(c, _)| c == case) {
                Some((_, sum)) => sum.add(&figures)?,
                None => results.push((*case, figures)),
            }
        }
        if args.rounds > 1 {
            if let Some(ratio) = ratio(&this_round) {
                println!("round {round}: gateway/axum={ratio:.3}");
                round_ratios.push(ratio);
            }
            for (case, ratios) in &mut reference_ratios {
                ratios.extend(ratio_of(&this_round, *case));
            }
        }
    }
    if let Some((median, min, max)) = spread(&mut round_ratios) {
        println!("rounds: gateway/axum median={median:.3} min={min:.3} max={max:.3}");
    }
    for (case, figures) in &results {
        println!(
            "GATEWAY case={} rps={:.0} p50_us={} p99_us={} requests={} secs={:.3} \
             cpu_us_per_req={:.1} own_cpu_us_per_req={:.1}",
            case.name(),
            figures.rps(),
            figures.histogram.value_at_quantile(0.50).max(1),
            figures.histogram.value_at_quantile(0.99).max(1),
            figures.requests,
            figures.secs,
            figures.cpu_us_per_req(),
            figures.own_cpu_us_per_req(),
        );
    }
    let rps: Vec<(Case, f64)> = results.iter().map(|(c, f)| (*c, f.rps())).collect();
    match ratio(&rps) {
        Some(ratio) => println!("summary: gateway/axum={ratio:.3}"),
        None => println!("summary: gateway/axum=n/a (run both cases for the ratio)"),
    }
    for (case, ratios) in &mut reference_ratios {
        if let Some(r) = ratio_of(&rps, *case) {
            let (median, min, max) = spread(ratios).unwrap_or((r, r, r));
            println!(
                "reference: {}/axum={r:.3} median={median:.3} min={min:.3} max={max:.3}",
                case.name()
            );
        }
    }
    callers.shutdown_timeout(Duration::from_secs(1));
    http.shutdown_timeout(Duration::from_secs(1));
    echo.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// The median, lowest and highest of the rounds' ratios (sorted in place), when there are any.
fn spread(ratios: &mut [f64]) -> Option<(f64, f64, f64)> {
    ratios.sort_by(f64::total_cmp);
    let (&min, &max) = (ratios.first()?, ratios.last()?);
    let mid = ratios.len() / 2;
    let median = if ratios.len().is_multiple_of(2) {
        (ratios[mid - 1] + ratios[mid]) / 2.0
    } else {
        ratios[mid]
    };
    Some((median, min, max))
}

/// The gateway's requests per second over axum's, when both cases ran.
fn ratio(rps: &[(Case, f64)]) -> Option<f64> {
    ratio_of(rps, Case::Gateway)
}

/// The requests per second of `case` over axum's, when both ran.
fn ratio_of(rps: &[(Case, f64)], case: Case) -> Option<f64> {
    let of = |wanted: Case| rps.iter().find(|(c, _)| *c == wanted).map(|(_, r)| *r);
    Some(of(case)? / of(Case::Axum)?)
}

/// The plain axum echo and the gateway (over the echo server published in `registry`);
/// returns the two HTTP addresses and the request body the gateway takes for the echo entry.
async fn start_http(
    registry: &Arc<dyn Registry>,
    text: &str,
) -> Result<(SocketAddr, SocketAddr, Bytes), String> {
    let axum_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("could not listen for the axum echo: {e}"))?;
    let axum_addr = axum_listener.local_addr().map_err(|e| e.to_string())?;
    let app = axum::Router::new().route(ECHO_PATH, post(axum_echo));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(axum_listener, app).await {
            eprintln!("gateway-bench: the axum echo stopped: {e}");
        }
    });

    let client = Client::builder().shared_registry(registry.clone()).build();
    let gateway = Gateway::builder()
        .client(client)
        .registry(registry.clone())
        .build()
        .await
        .map_err(|e| format!("could not build the gateway: {e}"))?;
    let served = gateway
        .wait_until(Duration::from_secs(10), |entries| {
            entries.iter().any(|e| e.id.as_str() == ECHO_ENTRY)
        })
        .await;
    if !served {
        return Err(format!(
            "the gateway did not serve {ECHO_ENTRY} within 10 s of the echo server starting"
        ));
    }
    let named = gateway
        .entries()
        .iter()
        .find(|e| e.id.as_str() == ECHO_ENTRY)
        .and_then(|e| e.api.as_ref())
        .is_some_and(|api| !api.params.is_empty());
    let body = if named {
        serde_json::json!({ "text": text })
    } else {
        serde_json::json!([text])
    };
    let body = Bytes::from(serde_json::to_vec(&body).map_err(|e| e.to_string())?);

    let gateway_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("could not listen for the gateway: {e}"))?;
    let gateway_addr = gateway_listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = gateway.serve(gateway_listener).await {
            eprintln!("gateway-bench: the gateway stopped: {e}");
        }
    });
    Ok((axum_addr, gateway_addr, body))
}

/// The plain echo: the text of `{"text": ...}` or of `[...]`, answered as JSON.
async fn axum_echo(Json(body): Json<Value>) -> Result<Json<Value>, axum::http::StatusCode> {
    match echo_text(&body) {
        Some(text) => Ok(Json(Value::String(text.to_owned()))),
        None => Err(axum::http::StatusCode::BAD_REQUEST),
    }
}

/// A plain echo over TCP, no framework: each message is a 4-byte big-endian length and that
/// many bytes, answered as it came, after `work` of busy-waiting when it is not zero. Returns
/// its address.
async fn start_plain_echo(work: Duration) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("could not listen for the plain echo: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let (read, write) = stream.into_split();
                let mut read = tokio::io::BufReader::new(read);
                let mut write = tokio::io::BufWriter::new(write);
                let mut message = Vec::new();
                // Ends with its connection (or a malformed message: this is a bench's peer).
                while read_message(&mut read, &mut message).await.is_ok() {
                    // The answers of all the messages read at once go in one write.
                    let flush = read.buffer().is_empty();
                    if !work.is_zero() {
                        let started = Instant::now();
                        while started.elapsed() < work {
                            std::hint::spin_loop();
                        }
                    }
                    if write_message(&mut write, &message, flush).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(addr)
}

/// Reads one length-prefixed message into `into`.
async fn read_message<S>(stream: &mut S, into: &mut Vec<u8>) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let len = stream.read_u32().await? as usize;
    into.resize(len, 0);
    stream.read_exact(into).await?;
    Ok(())
}

/// Writes one length-prefixed message, flushing it when `flush` (one write when buffered).
async fn write_message<S>(stream: &mut S, message: &[u8], flush: bool) -> std::io::Result<()>
where
    S: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let len = u32::try_from(message.len()).map_err(std::io::Error::other)?;
    stream.write_all(&len.to_be_bytes()).await?;
    stream.write_all(message).await?;
    if flush {
        stream.flush().await?;
    }
    Ok(())
}

/// The idle connections of the hop to the plain echo, and its address.
struct Hop {
    idle: Mutex<Vec<tokio::io::BufStream<tokio::net::TcpStream>>>,
    echo: SocketAddr,
}

/// The plain axum echo with one more round trip to the plain echo at `echo`, as `hop` and as
/// `mux`; returns their addresses.
async fn start_references(echo: SocketAddr) -> Result<(SocketAddr, SocketAddr), String> {
    let hop = Arc::new(Hop {
        idle: Mutex::new(Vec::new()),
        echo,
    });
    let hop = axum::Router::new()
        .route(ECHO_PATH, post(hop_echo))
        .with_state(hop);
    let mux = axum::Router::new()
        .route(ECHO_PATH, post(mux_echo))
        .with_state(Mux::connect(echo).await?);
    Ok((serve("hop", hop).await?, serve("mux", mux).await?))
}

/// Serves `app` on a free port of 127.0.0.1; returns its address.
async fn serve(name: &'static str, app: axum::Router) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("could not listen for the {name}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("gateway-bench: the {name} stopped: {e}");
        }
    });
    Ok(addr)
}

/// The text of the echo's body, `{"text": ...}` or `[...]`.
fn echo_text(body: &Value) -> Option<&str> {
    let text = match body {
        Value::Object(map) => map.get("text"),
        Value::Array(items) => items.first(),
        _ => None,
    };
    text.and_then(Value::as_str)
}

/// Requests waiting for their answers on the `mux` connection, by id.
type Waiting = Arc<Mutex<std::collections::HashMap<u64, tokio::sync::oneshot::Sender<Vec<u8>>>>>;

/// One connection to the plain echo shared by every request: a writer task sends the
/// requests of a scheduler round in one write (yielding once to gather them), each an 8-byte
/// id and the text in a message, and a reader task hands each answer to the request of its id.
#[derive(Clone)]
struct Mux {
    queue: tokio::sync::mpsc::UnboundedSender<(String, tokio::sync::oneshot::Sender<Vec<u8>>)>,
}

impl Mux {
    async fn connect(echo: SocketAddr) -> Result<Mux, String> {
        use tokio::io::AsyncWriteExt;
        let stream = tokio::net::TcpStream::connect(echo)
            .await
            .map_err(|e| format!("could not connect to the plain echo: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let (read, mut write) = stream.into_split();
        let waiting = Waiting::default();
        let (queue, mut queued) = tokio::sync::mpsc::unbounded_channel::<(String, _)>();
        let writer_waiting = waiting.clone();
        tokio::spawn(async move {
            let mut next_id = 0u64;
            let mut buffer = Vec::new();
            while let Some(first) = queued.recv().await {
                let mut request = Some(first);
                let mut yielded = false;
                while let Some((text, answer)) = request {
                    next_id += 1;
                    writer_waiting
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(next_id, answer);
                    let len = u32::try_from(8 + text.len()).unwrap_or(u32::MAX);
                    buffer.extend_from_slice(&len.to_be_bytes());
                    buffer.extend_from_slice(&next_id.to_be_bytes());
                    buffer.extend_from_slice(text.as_bytes());
                    request = queued.try_recv().ok();
                    if request.is_none() && !yielded {
                        // The requests of this scheduler round are still to come (each
                        // handler queues its own, and this task runs right after the first):
                        // one yield lets them share the write, as the gateway's writer does.
                        yielded = true;
                        tokio::task::yield_now().await;
                        request = queued.try_recv().ok();
                    }
                }
                if write.write_all(&buffer).await.is_err() {
                    return;
                }
                buffer.clear();
            }
        });
        tokio::spawn(async move {
            let mut read = tokio::io::BufReader::new(read);
            let mut message = Vec::new();
            while read_message(&mut read, &mut message).await.is_ok() {
                let Some((id, text)) = message.split_first_chunk::<8>() else {
                    return;
                };
                let answer = waiting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&u64::from_be_bytes(*id));
                if let Some(answer) = answer {
                    let _ = answer.send(text.to_vec());
                }
            }
        });
        Ok(Mux { queue })
    }
}

/// The plain echo's handler on the `mux` connection.
async fn mux_echo(
    axum::extract::State(mux): axum::extract::State<Mux>,
    Json(body): Json<Value>,
) -> Result<Json<Value>, axum::http::StatusCode> {
    let text = echo_text(&body).ok_or(axum::http::StatusCode::BAD_REQUEST)?;
    let (answer, answered) = tokio::sync::oneshot::channel();
    mux.queue
        .send((text.to_owned(), answer))
        .map_err(|_| axum::http::StatusCode::BAD_GATEWAY)?;
    let answer = answered
        .await
        .map_err(|_| axum::http::StatusCode::BAD_GATEWAY)?;
    let text = String::from_utf8(answer).map_err(|_| axum::http::StatusCode::BAD_GATEWAY)?;
    Ok(Json(Value::String(text)))
}

/// The plain echo's handler, passing the text through the plain echo first.
async fn hop_echo(
    axum::extract::State(hop): axum::extract::State<Arc<Hop>>,
    Json(body): Json<Value>,
) -> Result<Json<Value>, axum::http::StatusCode> {
    let failed = |_| axum::http::StatusCode::BAD_GATEWAY;
    let text = echo_text(&body).ok_or(axum::http::StatusCode::BAD_REQUEST)?;
    let idle = hop
        .idle
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .pop();
    let mut stream = match idle {
        Some(stream) => stream,
        None => {
            let stream = tokio::net::TcpStream::connect(hop.echo)
                .await
                .map_err(failed)?;
            stream.set_nodelay(true).map_err(failed)?;
            tokio::io::BufStream::new(stream)
        }
    };
    write_message(&mut stream, text.as_bytes(), true)
        .await
        .map_err(failed)?;
    let mut answer = Vec::new();
    read_message(&mut stream, &mut answer)
        .await
        .map_err(failed)?;
    hop.idle
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(stream);
    let text = String::from_utf8(answer).map_err(|_| axum::http::StatusCode::BAD_GATEWAY)?;
    Ok(Json(Value::String(text)))
}

/// The callers' shared count of calls started and the end of the measurement.
struct Plan {
    started: AtomicU64,
    limit: u64,
    until: Instant,
}

impl Plan {
    fn new(limit: u64, seconds: f64) -> Arc<Plan> {
        Arc::new(Plan {
            started: AtomicU64::new(0),
            limit,
            until: Instant::now() + Duration::from_secs_f64(seconds),
        })
    }

    /// Whether one more call may start.
    fn next(&self) -> bool {
        Instant::now() < self.until && self.started.fetch_add(1, Ordering::Relaxed) < self.limit
    }
}

fn histogram() -> Histogram<u64> {
    // 3 significant digits over 1 µs .. 60 s: valid bounds, so this cannot fail.
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).unwrap_or_else(|_| unreachable!())
}

/// One closed-loop caller: an HTTP/1.1 keep-alive connection, or the framework's client.
enum Caller {
    /// Posts `body` to the echo route and expects `expected`.
    Http {
        sender: http1::SendRequest<Full<Bytes>>,
        host: String,
        body: Bytes,
        expected: Bytes,
    },
    /// Calls `echo(text)` and expects `text`.
    Client { client: EchoClient, text: String },
}

impl Caller {
    /// One call, checked.
    async fn call(&mut self) -> Result<(), String> {
        match self {
            Caller::Http {
                sender,
                host,
                body,
                expected,
            } => {
                let request = hyper::Request::post(ECHO_PATH)
                    .header(hyper::header::HOST, host.as_str())
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(body.clone()))
                    .map_err(|e| e.to_string())?;
                let answer = sender
                    .send_request(request)
                    .await
                    .map_err(|e| format!("request failed: {e}"))?;
                let status = answer.status();
                let got = answer
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("reading the answer: {e}"))?
                    .to_bytes();
                if status != hyper::StatusCode::OK || got != *expected {
                    return Err(format!(
                        "answer {status} {:?}, expected 200 {:?}",
                        String::from_utf8_lossy(&got),
                        String::from_utf8_lossy(expected)
                    ));
                }
                Ok(())
            }
            Caller::Client { client, text } => {
                use examples::Echo;
                let got = client
                    .echo(text.clone())
                    .await
                    .map_err(|e| format!("call failed: {e}"))?;
                if got != *text {
                    return Err(format!("answer {got:?}, expected {text:?}"));
                }
                Ok(())
            }
        }
    }
}

/// Runs the callers at once for the warm-up, then for the measurement.
async fn measure(
    args: &Args,
    mut callers: Vec<Caller>,
    own: &ThreadClocks,
) -> Result<Figures, String> {
    let mut phases = Vec::new();
    if args.warmup_seconds > 0.0 {
        phases.push((false, u64::MAX, args.warmup_seconds));
    }
    phases.push((true, args.requests, args.seconds));
    let mut figures = None;
    for (measured, limit, seconds) in phases {
        let start = Instant::now();
        let cpu_start = cpu_secs();
        let own_start = own.secs();
        let plan = Plan::new(limit, seconds);
        let mut tasks = Vec::new();
        for mut caller in callers.drain(..) {
            let plan = plan.clone();
            tasks.push(tokio::spawn(async move {
                let mut histogram = histogram();
                let mut done = 0u64;
                while plan.next() {
                    let t = Instant::now();
                    caller.call().await?;
                    let us = t.elapsed().as_micros() as u64;
                    histogram.saturating_record(us.clamp(1, MAX_LATENCY_US));
                    done += 1;
                }
                Ok::<_, String>((caller, histogram, done))
            }));
        }
        let mut total = histogram();
        let mut requests = 0;
        for task in tasks {
            let (caller, histogram, done) = task
                .await
                .map_err(|e| format!("a caller panicked: {e}"))??;
            callers.push(caller);
            total.add(&histogram).map_err(|e| e.to_string())?;
            requests += done;
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu_secs = cpu_secs() - cpu_start;
        let own_cpu_secs = own.secs() - own_start;
        if measured {
            figures = Some(Figures {
                requests,
                secs,
                cpu_secs,
                own_cpu_secs,
                histogram: total,
            });
        }
    }
    figures.ok_or_else(|| "no measurement ran".to_string())
}

/// One keep-alive HTTP/1.1 connection per caller, each posting `body` to the echo route and
/// checking the answer is `expected`.
async fn http_case(
    args: &Args,
    addr: SocketAddr,
    body: &Bytes,
    expected: &Bytes,
    own: &ThreadClocks,
) -> Result<Figures, String> {
    let mut callers = Vec::new();
    for _ in 0..args.connections {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("could not connect to {addr}: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let (sender, connection) = http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake with {addr}: {e}"))?;
        tokio::spawn(connection);
        callers.push(Caller::Http {
            sender,
            host: addr.to_string(),
            body: body.clone(),
            expected: expected.clone(),
        });
    }
    measure(args, callers, own).await
}

/// The same call made directly with the framework's client, `connections` calls in flight.
async fn client_case(
    args: &Args,
    registry: &Arc<dyn Registry>,
    own: &ThreadClocks,
) -> Result<Figures, String> {
    let client = EchoClient::new(Client::builder().shared_registry(registry.clone()).build());
    let callers = (0..args.connections)
        .map(|_| Caller::Client {
            client: client.clone(),
            text: args.text.clone(),
        })
        .collect();
    measure(args, callers, own).await
}
