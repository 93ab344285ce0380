//! Traffic-control scenarios: each runs against loopback server processes with a policy off
//! (today's behaviour) and, once the policy exists, on, in the same run, and prints one table.
//!
//! ```text
//! cargo run --release -p examples --bin scenarios -- [--only a,b,c,d,e] [--seconds S]
//! ```
//!
//! - (a) three servers, one ten times slower: throughput and p50/p99 of round robin and of the
//!   load-aware picker (`least_loaded`), beside an all-healthy cluster.
//! - (b) offered load three times capacity: goodput and the admitted calls' p99 under the fixed
//!   cap of 50, beside the unloaded p99.
//! - (c) 1 % of answers fifty times slower: p99 without hedging, hedging after a fixed delay
//!   and after the entry's p95 latency.
//! - (d) a three-level chain whose leaf fails: calls reaching the leaf per top-level call.
//! - (e) a greedy caller beside a well-behaved one: the well-behaved caller's throughput beside
//!   what it gets alone.
//!
//! Servers are this program started again with `--role server` (one process each), so client
//! and servers do not share a runtime. Figures, not assertions: the goals are checked by reading
//! the table.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use examples::{Echo, EchoClient, EchoServer};
use hdrhistogram::Histogram;
use rpc::{
    Client, GovernanceOverrides, RpcError, Server, ShuntStrategy, StaticRegistry, StatusCode,
};
use tokio::sync::Semaphore;

#[derive(Parser, Debug, Clone)]
#[command(about = "Traffic-control scenarios against loopback server processes")]
struct Args {
    /// `client` (the default: runs the scenarios) or `server` (started by the client).
    #[arg(long, default_value = "client")]
    role: String,
    /// Scenarios to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "a,b,c,d,e")]
    only: Vec<String>,
    /// Measured seconds per case.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Server: milliseconds each call takes.
    #[arg(long, default_value_t = 1.0)]
    delay_ms: f64,
    /// Server: one call in this many takes `slow_factor` times longer (0: none).
    #[arg(long, default_value_t = 0)]
    slow_every: u64,
    /// Server: how much longer the slow calls take.
    #[arg(long, default_value_t = 50.0)]
    slow_factor: f64,
    /// Server: calls that can make progress at once (a resource the handlers share, like a
    /// connection pool); 0 = unlimited. Calls beyond it wait for it inside the handler.
    #[arg(long, default_value_t = 0)]
    capacity: usize,
    /// Server: the concurrency cap (`max_concurrent_handling_count`).
    #[arg(long, default_value_t = 50)]
    cap: u32,
    /// Server: an adaptive concurrency limit (at most `--cap`) instead of the fixed cap.
    #[arg(long)]
    adaptive: bool,
    /// Server: each caller's quota, calls per second (by client id; 0: none), with a burst of
    /// a tenth of a second's worth.
    #[arg(long, default_value_t = 0)]
    caller_quota: u32,
    /// Server: answer every call with Overflow (a failing leaf).
    #[arg(long)]
    fail: bool,
    /// Server: call this address's echo for every call (a middle tier), and answer its result.
    #[arg(long)]
    next: Option<String>,
    /// Server: the client calling `--next` has no circuit breaker (so that retries, not the
    /// breaker, decide how often a failing leaf is called).
    #[arg(long)]
    no_breaker: bool,
    /// Server: the client calling `--next` retries even while serving a retried call
    /// (`retry_chain_stop = false`: today's behaviour before the chain stop).
    #[arg(long)]
    no_chain_stop: bool,
}

// ------------------------------------------------------------------------------------ servers

/// The scenarios' echo: waits its delay (holding a slot of the shared resource, if any), fails
/// when told to, or forwards to the next tier.
struct Tier {
    delay: Duration,
    slow_every: u64,
    slow_factor: f64,
    resource: Option<Semaphore>,
    fail: bool,
    next: Option<EchoClient>,
    calls: Arc<AtomicU64>,
}

impl Echo for Tier {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail {
            return Err(RpcError::new(
                StatusCode::OverflowMaxServerHandle,
                "this leaf refuses every call",
            ));
        }
        if let Some(next) = &self.next {
            return next.echo(text).await;
        }
        let slow = self.slow_every > 0 && n.is_multiple_of(self.slow_every);
        let delay = if slow {
            self.delay.mul_f64(self.slow_factor)
        } else {
            self.delay
        };
        let _slot = match &self.resource {
            Some(r) => Some(
                r.acquire()
                    .await
                    .map_err(|_| RpcError::new(StatusCode::ServerError, "closed"))?,
            ),
            None => None,
        };
        tokio::time::sleep(delay).await;
        Ok(text)
    }
}

async fn server_main(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let breaker = GovernanceOverrides {
        enable_circuit_breaker: args.no_breaker.then_some(false),
        retry_chain_stop: args.no_chain_stop.then_some(false),
        ..GovernanceOverrides::NONE
    };
    let next = args.next.as_ref().map(|addr| {
        EchoClient::new(
            Client::builder()
                .registry(StaticRegistry::new([addr.clone()]))
                .override_options(EchoClient::SERVICE_ID, breaker)
                .build(),
        )
    });
    let calls = Arc::new(AtomicU64::new(0));
    let tier = Tier {
        delay: Duration::from_secs_f64(args.delay_ms / 1000.0),
        slow_every: args.slow_every,
        slow_factor: args.slow_factor,
        resource: (args.capacity > 0).then(|| Semaphore::new(args.capacity)),
        fail: args.fail,
        next,
        calls: calls.clone(),
    };
    let server = Server::builder()
        .max_concurrency(args.cap as usize)
        .adaptive_concurrency(args.adaptive)
        .caller_rate_limit(args.caller_quota, (args.caller_quota / 10).max(1))
        .add_service(EchoServer::new(tier))
        .serve("127.0.0.1:0")
        .await?;
    println!("LISTENING addr={}", server.local_addr());
    tokio::signal::ctrl_c().await?;
    println!("SERVED calls={}", calls.load(Ordering::Relaxed));
    Ok(())
}

/// A server process; killed when dropped.
struct ServerProcess {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
    addr: String,
}

impl ServerProcess {
    /// Starts `scenarios --role server` with `flags`, and waits until it listens.
    fn start(flags: &[&str]) -> Result<ServerProcess, String> {
        let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
        let mut child = Command::new(exe)
            .args(["--role", "server"])
            .args(flags)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("could not start a server process: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(a) = line.strip_prefix("LISTENING addr=") {
                        break a.to_string();
                    }
                }
                _ => {
                    let _ = child.kill();
                    return Err("a server process exited before it listened".into());
                }
            }
        };
        Ok(ServerProcess { child, lines, addr })
    }

    /// Stops the server (SIGINT) and returns the calls its handler ran.
    fn stop(mut self) -> Result<u64, String> {
        // SAFETY: a plain syscall on the pid of a child this process started and still owns.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGINT);
        }
        for line in self.lines.by_ref() {
            let line = line.map_err(|e| e.to_string())?;
            if let Some(n) = line.strip_prefix("SERVED calls=") {
                return n.parse().map_err(|_| format!("bad line {line:?}"));
            }
        }
        Err("the server stopped without saying what it served".into())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// --------------------------------------------------------------------------------------- load

/// What one load run measured.
struct Measured {
    ok: u64,
    failed: u64,
    secs: f64,
    /// Latencies of the successful calls, in microseconds.
    hist: Histogram<u64>,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.ok as f64 / self.secs
    }
    fn p(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}

/// Outcomes gathered by the callers of one run, shared between them.
#[derive(Clone)]
struct Tally(Arc<Mutex<(u64, u64, Histogram<u64>)>>);

impl Tally {
    fn new() -> Self {
        Tally(Arc::new(Mutex::new((0, 0, histogram()))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, u64, Histogram<u64>)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one call: answered (with its latency in microseconds) or failed.
    fn record(&self, answered: Option<u64>) {
        let mut t = self.lock();
        match answered {
            Some(micros) => {
                t.0 += 1;
                let _ = t.2.record(micros);
            }
            None => t.1 += 1,
        }
    }

    /// Adds what one caller counted on its own.
    fn add(&self, ok: u64, failed: u64, hist: &Histogram<u64>) {
        let mut t = self.lock();
        t.0 += ok;
        t.1 += failed;
        let _ = t.2.add(hist);
    }

    /// The run's figures, over `secs` seconds.
    fn measured(&self, secs: f64) -> Measured {
        let (ok, failed, hist) = std::mem::replace(&mut *self.lock(), (0, 0, histogram()));
        Measured {
            ok,
            failed,
            secs,
            hist,
        }
    }
}

/// `callers` callers calling `echo` back to back for `secs` seconds (closed loop).
async fn closed_loop(echo: &EchoClient, callers: usize, secs: f64) -> Measured {
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let tally = Tally::new();
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (echo, tally) = (echo.clone(), tally.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed, mut hist) = (0, 0, histogram());
                while Instant::now() < until {
                    let t = Instant::now();
                    match echo.echo("x".repeat(32)).await {
                        Ok(_) => {
                            ok += 1;
                            let _ = hist.record(t.elapsed().as_micros() as u64);
                        }
                        Err(_) => failed += 1,
                    }
                }
                tally.add(ok, failed, &hist);
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    tally.measured(started.elapsed().as_secs_f64())
}

/// Calls started at `rate` per second for `secs` seconds whatever the answers (open loop),
/// at most `outstanding` at once (beyond that a call is counted failed without being sent).
async fn open_loop(echo: &EchoClient, rate: f64, outstanding: usize, secs: f64) -> Measured {
    let tally = Tally::new();
    let limit = Arc::new(Semaphore::new(outstanding));
    let started = Instant::now();
    let total = (rate * secs) as u64;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(total as usize);
    for _ in 0..total {
        tick.tick().await;
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            tally.record(None);
            continue;
        };
        let (echo, tally) = (echo.clone(), tally.clone());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = echo.echo("x".repeat(32)).await;
            drop(permit);
            tally.record(r.ok().map(|_| t.elapsed().as_micros() as u64));
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    tally.measured(started.elapsed().as_secs_f64())
}

fn echo_of(addrs: &[&ServerProcess], overrides: GovernanceOverrides) -> EchoClient {
    EchoClient::new(
        Client::builder()
            .registry(StaticRegistry::new(addrs.iter().map(|s| s.addr.clone())))
            .override_options(EchoClient::SERVICE_ID, overrides)
            .build(),
    )
}

/// One line of the table.
fn row(scenario: &str, case: &str, m: &Measured, note: &str) {
    println!(
        "| {scenario} | {case} | {:.0} | {:.1} | {:.1} | {} | {note} |",
        m.rate(),
        m.p(0.50),
        m.p(0.99),
        m.failed
    );
}

// ---------------------------------------------------------------------------------- scenarios

async fn scenario_a(args: &Args) -> Result<(), String> {
    let fast = || ServerProcess::start(&["--delay-ms", "1"]);
    let (f1, f2, f3) = (fast()?, fast()?, fast()?);
    let healthy = closed_loop(
        &echo_of(&[&f1, &f2, &f3], GovernanceOverrides::NONE),
        32,
        args.seconds,
    )
    .await;
    row(
        "a",
        "all healthy, round robin",
        &healthy,
        "the reference p99",
    );
    drop(f3);
    // Each case gets a slow server of its own, so that what it served is that case's share.
    let slow = ServerProcess::start(&["--delay-ms", "10"])?;
    let rr = closed_loop(
        &echo_of(&[&f1, &f2, &slow], GovernanceOverrides::NONE),
        32,
        args.seconds,
    )
    .await;
    let rr_slow = slow.stop()?;
    row(
        "a",
        "one 10x slower, round robin",
        &rr,
        &format!(
            "p99 {:.1}x the healthy cluster's; the slow server served {:.1} %",
            rr.p(0.99) / healthy.p(0.99),
            share(rr_slow, &rr)
        ),
    );
    let slow = ServerProcess::start(&["--delay-ms", "10"])?;
    let least_loaded = GovernanceOverrides {
        shunt_strategy: Some(ShuntStrategy::LeastLoaded),
        ..GovernanceOverrides::NONE
    };
    let ll = closed_loop(&echo_of(&[&f1, &f2, &slow], least_loaded), 32, args.seconds).await;
    let ll_slow = slow.stop()?;
    row(
        "a",
        "one 10x slower, least_loaded",
        &ll,
        &format!(
            "p99 {:.1}x the healthy cluster's (goal: within 2x); the slow server served {:.1} %",
            ll.p(0.99) / healthy.p(0.99),
            share(ll_slow, &ll)
        ),
    );
    Ok(())
}

/// `served` as a percentage of the calls `m` made.
fn share(served: u64, m: &Measured) -> f64 {
    100.0 * served as f64 / (m.ok + m.failed).max(1) as f64
}

async fn scenario_b(args: &Args) -> Result<(), String> {
    // Capacity: 8 calls at once, 5 ms each = 1 600 calls/s.
    let server = ServerProcess::start(&["--delay-ms", "5", "--capacity", "8", "--cap", "50"])?;
    let capacity = 8.0 / 0.005;
    // No retries and no breaker: admission alone decides what is served.
    let admission_only = GovernanceOverrides {
        retry_times: Some(0),
        enable_circuit_breaker: Some(false),
        ..GovernanceOverrides::NONE
    };
    let echo = echo_of(&[&server], admission_only.clone());
    let unloaded = closed_loop(&echo, 1, args.seconds).await;
    row("b", "unloaded, one caller", &unloaded, "the reference p99");
    let loaded = open_loop(&echo, 3.0 * capacity, 10_000, args.seconds).await;
    let figure = |m: &Measured| {
        format!(
            "goodput {:.0} % of capacity, admitted p99 {:.1}x unloaded",
            100.0 * m.rate() / capacity,
            m.p(0.99) / unloaded.p(0.99)
        )
    };
    row("b", "3x capacity, fixed cap 50", &loaded, &figure(&loaded));
    drop(server);
    // The same server with the adaptive limit (at most the cap of 50): a warm-up run lets the
    // limit find its value, then the measured one.
    let server = ServerProcess::start(&[
        "--delay-ms",
        "5",
        "--capacity",
        "8",
        "--cap",
        "50",
        "--adaptive",
    ])?;
    let echo = echo_of(&[&server], admission_only);
    let _warm = open_loop(&echo, 3.0 * capacity, 10_000, 1.0).await;
    let adaptive = open_loop(&echo, 3.0 * capacity, 10_000, args.seconds).await;
    row(
        "b",
        "3x capacity, adaptive limit (max 50)",
        &adaptive,
        &figure(&adaptive),
    );
    Ok(())
}

async fn scenario_c(args: &Args) -> Result<(), String> {
    let tail = || {
        ServerProcess::start(&[
            "--delay-ms",
            "1",
            "--slow-every",
            "100",
            "--slow-factor",
            "50",
        ])
    };
    // The hedge delay: a few times the usual answer (1 ms of work, about 2 ms with tokio's
    // timer), far below the slow answers' 50 ms.
    let hedging = GovernanceOverrides {
        hedge_delay_ms: Some(5),
        idempotent: Some(true),
        ..GovernanceOverrides::NONE
    };
    // The same after the entry's p95 latency (a delay nobody has to guess), floored at 1 ms.
    let by_percentile = GovernanceOverrides {
        hedge_delay_ms: Some(1),
        hedge_percentile: Some(95),
        idempotent: Some(true),
        ..GovernanceOverrides::NONE
    };
    let mut p99_off = None;
    for (case, overrides) in [
        ("no hedging", GovernanceOverrides::NONE),
        ("hedging after 5 ms", hedging),
        ("hedging after the p95 (hedge_percentile)", by_percentile),
    ] {
        let (s1, s2) = (tail()?, tail()?);
        let m = closed_loop(&echo_of(&[&s1, &s2], overrides), 16, args.seconds).await;
        let served = s1.stop()? + s2.stop()?;
        let calls = m.ok + m.failed;
        let extra = 100.0 * (served as f64 - calls as f64) / calls.max(1) as f64;
        // Exactly 1 % of answers are slow, so the p99 sits on their edge and swings from run
        // to run; the p99.9 is where they are.
        let mut note = format!(
            "{extra:.1} % extra calls ({served} served for {calls}); p99.9 {:.1} ms",
            m.p(0.999)
        );
        match p99_off {
            None => p99_off = Some(m.p(0.99)),
            Some(off) => note.push_str(&format!(
                "; p99 {:.2} of no hedging",
                m.p(0.99) / f64::max(off, f64::MIN_POSITIVE)
            )),
        }
        row(
            "c",
            &format!("1 % of answers 50x slower, {case}"),
            &m,
            &note,
        );
    }
    Ok(())
}

async fn scenario_d(args: &Args) -> Result<(), String> {
    let no_breaker = GovernanceOverrides {
        enable_circuit_breaker: Some(false),
        ..GovernanceOverrides::NONE
    };
    for (case, flags) in [
        (
            "without the chain stop",
            &["--no-breaker", "--no-chain-stop"][..],
        ),
        ("with the chain stop", &["--no-breaker"][..]),
    ] {
        let leaf = ServerProcess::start(&["--fail"])?;
        // Breakers off at every level: the retries alone decide how often the leaf is called.
        let mid = ServerProcess::start(&[&["--next", &leaf.addr][..], flags].concat())?;
        let top = ServerProcess::start(&[&["--next", &mid.addr][..], flags].concat())?;
        let m = closed_loop(&echo_of(&[&top], no_breaker.clone()), 16, args.seconds).await;
        drop((top, mid));
        let reached = leaf.stop()?;
        let calls = m.ok + m.failed;
        row(
            "d",
            &format!("failing leaf, chain of three, default retries, {case}"),
            &m,
            &format!(
                "{:.2} leaf calls per top-level call ({reached} for {calls})",
                reached as f64 / calls.max(1) as f64
            ),
        );
    }
    Ok(())
}

/// A client of `server` whose handshake names it `id` (the key of per-caller quotas).
fn echo_as(server: &ServerProcess, id: &str) -> EchoClient {
    EchoClient::new(
        Client::builder()
            .registry(StaticRegistry::new([server.addr.clone()]))
            .client_id(id)
            .build(),
    )
}

async fn scenario_e(args: &Args) -> Result<(), String> {
    let server = ServerProcess::start(&["--delay-ms", "1", "--cap", "1000"])?;
    let polite = echo_as(&server, "polite");
    let alone = closed_loop(&polite, 4, args.seconds).await;
    row("e", "well-behaved caller alone", &alone, "");
    let greedy = echo_as(&server, "greedy");
    let secs = args.seconds;
    let hog = tokio::spawn(async move { closed_loop(&greedy, 256, secs).await });
    let beside = closed_loop(&polite, 4, args.seconds).await;
    let _ = hog.await;
    row(
        "e",
        "beside a greedy caller, no quota",
        &beside,
        &format!("{:.0} % of alone", 100.0 * beside.rate() / alone.rate()),
    );
    drop(server);
    // Each caller's quota: half as much again as the well-behaved caller takes alone, so it
    // is not limited, while the greedy one is (the refused calls are answered 429).
    let quota = ((alone.rate() * 1.5).ceil() as u32).max(1).to_string();
    let server =
        ServerProcess::start(&["--delay-ms", "1", "--cap", "1000", "--caller-quota", &quota])?;
    let polite = echo_as(&server, "polite");
    let greedy = echo_as(&server, "greedy");
    let hog = tokio::spawn(async move { closed_loop(&greedy, 256, secs).await });
    let quota_on = closed_loop(&polite, 4, args.seconds).await;
    let hogged = hog.await.map_err(|e| format!("the greedy caller: {e}"))?;
    row(
        "e",
        &format!("beside a greedy caller, quota {quota}/s per caller"),
        &quota_on,
        &format!(
            "{:.0} % of alone; the greedy caller got {:.0}/s, {} refused",
            100.0 * quota_on.rate() / alone.rate(),
            hogged.rate(),
            hogged.failed
        ),
    );
    Ok(())
}

async fn client_main(args: &Args) -> Result<(), String> {
    println!("| scenario | case | calls/s | p50 ms | p99 ms | failed | figure |");
    println!("|---|---|---:|---:|---:|---:|---|");
    for s in &args.only {
        match s.as_str() {
            "a" => scenario_a(args).await?,
            "b" => scenario_b(args).await?,
            "c" => scenario_c(args).await?,
            "d" => scenario_d(args).await?,
            "e" => scenario_e(args).await?,
            other => return Err(format!("no scenario {other:?}: use a, b, c, d or e")),
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    for (flag, secs) in [
        ("--seconds", args.seconds),
        ("--delay-ms", args.delay_ms / 1000.0),
    ] {
        if Duration::try_from_secs_f64(secs).is_err() {
            eprintln!("scenarios: {flag}: give a non-negative number, not too large");
            return ExitCode::FAILURE;
        }
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("scenarios: no runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        if args.role == "server" {
            server_main(&args).await.map_err(|e| e.to_string())
        } else {
            client_main(&args).await
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scenarios: {e}");
            ExitCode::FAILURE
        }
    }
}
