//! What the streaming peers of `scripts/stream-bench.sh` share, so that each peer's program
//! holds only what is its own (its protocol): the command line every peer takes, the
//! process's CPU time, and the measured window with the `STREAM` line the script reads.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A peer's command line:
/// `--mode server|client --addr 127.0.0.1:PORT [--streams S] [--size BYTES] [--duration SECS]
/// [--warmup SECS]`, and whatever flags the peer adds.
#[derive(Debug)]
pub struct Args {
    /// `server` or `client`.
    pub mode: String,
    /// Where the server listens (port 0: a free one) or where the client connects.
    pub addr: SocketAddr,
    /// Streams on the one connection.
    pub streams: u32,
    /// Bytes of each item.
    pub size: u32,
    /// The measured window, in seconds.
    pub duration: f64,
    /// The warm-up before it, in seconds.
    pub warmup: f64,
}

/// Parses the command line after the program's name; a flag this module does not know goes to
/// `extra` with its value, which answers whether it took it (`Ok(true)`), does not know it
/// either (`Ok(false)`), or refuses its value. `usage` ends every error.
pub fn parse(
    args: impl IntoIterator<Item = String>,
    usage: &str,
    mut extra: impl FnMut(&str, &str) -> Result<bool, String>,
) -> Result<Args, String> {
    let mut a = Args {
        mode: String::new(),
        addr: "127.0.0.1:0".parse().expect("literal address"),
        streams: 1,
        size: 32,
        duration: 3.0,
        warmup: 1.0,
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let val = it
            .next()
            .ok_or_else(|| format!("missing value for {flag}\n{usage}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {val}: {e}\n{usage}");
        match flag.as_str() {
            "--mode" => a.mode = val.clone(),
            "--addr" => a.addr = val.parse().map_err(|e| bad(&e))?,
            "--streams" => a.streams = val.parse().map_err(|e| bad(&e))?,
            "--size" => a.size = val.parse().map_err(|e| bad(&e))?,
            "--duration" => a.duration = val.parse().map_err(|e| bad(&e))?,
            "--warmup" => a.warmup = val.parse().map_err(|e| bad(&e))?,
            other => {
                if !extra(other, &val).map_err(|e| format!("{e}\n{usage}"))? {
                    return Err(format!("unknown flag {flag}\n{usage}"));
                }
            }
        }
    }
    if !a.addr.ip().is_loopback() {
        return Err(format!("{}: loopback addresses only", a.addr));
    }
    // (Written so that NaN fails too.)
    let positive = a.duration.is_finite() && a.duration > 0.0;
    let non_negative = a.warmup.is_finite() && a.warmup >= 0.0;
    if a.streams == 0 || a.size > 16 << 20 || !positive || !non_negative {
        return Err(format!(
            "--streams at least 1, --size at most 16 MiB, --duration above 0, --warmup 0 or \
             more\n{usage}"
        ));
    }
    Ok(a)
}

/// User plus system CPU of this process so far.
pub fn cpu() -> Duration {
    // SAFETY: all-zero bytes are a valid `rusage`; getrusage only writes into it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable `rusage`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    let t = |tv: libc::timeval| {
        Duration::from_secs(tv.tv_sec.max(0) as u64)
            + Duration::from_micros(tv.tv_usec.max(0) as u64)
    };
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// What one measured window saw.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// Items received in it.
    pub items: u64,
    /// Its length.
    pub secs: f64,
    /// The process's CPU time in it.
    pub cpu_s: f64,
}

/// Waits out `a.warmup`, then measures `a.duration`: the items `items` counted meanwhile and
/// the process's CPU time.
pub async fn measure(a: &Args, items: &AtomicU64) -> Window {
    tokio::time::sleep(Duration::from_secs_f64(a.warmup)).await;
    let (n0, c0, t0) = (items.load(Ordering::Relaxed), cpu(), Instant::now());
    tokio::time::sleep(Duration::from_secs_f64(a.duration)).await;
    let (n1, c1, secs) = (
        items.load(Ordering::Relaxed),
        cpu(),
        t0.elapsed().as_secs_f64(),
    );
    Window {
        items: n1 - n0,
        secs,
        cpu_s: (c1 - c0).as_secs_f64(),
    }
}

/// Prints the client's line: `STREAM peer=<peer> size=B streams=S items=<n> errors=<n>
/// secs=<s> items_per_s=<r> cpu_s=<s> cpu_us_per_item=<u>`.
pub fn print_stream_line(peer: &str, a: &Args, w: Window, errors: u64) {
    println!(
        "STREAM peer={peer} size={} streams={} items={} errors={errors} secs={:.3} \
         items_per_s={:.1} cpu_s={:.3} cpu_us_per_item={:.3}",
        a.size,
        a.streams,
        w.items,
        w.secs,
        w.items as f64 / w.secs,
        w.cpu_s,
        w.cpu_s * 1e6 / w.items.max(1) as f64
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

/// Prints the server's line as it stops: `SERVER peer=<peer> items=<sent> cpu_s=<s>
/// wall_s=<s> cpu_us_per_item=<u>`, its CPU counted from `cpu0` and its time from `wall0`.
pub fn print_server_line(peer: &str, sent: u64, cpu0: Duration, wall0: Instant) {
    let used = (cpu() - cpu0).as_secs_f64();
    println!(
        "SERVER peer={peer} items={sent} cpu_s={used:.3} wall_s={:.3} cpu_us_per_item={:.3}",
        wall0.elapsed().as_secs_f64(),
        used * 1e6 / sent.max(1) as f64
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

/// Runs a peer's `--mode` on a multi-threaded runtime: `serve` with the address to listen on,
/// or `client` with the command line (which needs the server's port); exits with status 1 and
/// `program: <error>` on standard error when either fails.
pub fn run<'a, S, C>(
    program: &str,
    usage: &str,
    a: &'a Args,
    serve: impl FnOnce(SocketAddr) -> S,
    client: impl FnOnce(&'a Args) -> C,
) where
    S: std::future::Future<Output = Result<(), String>>,
    C: std::future::Future<Output = Result<(), String>>,
{
    let outcome = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))
        .and_then(|rt| {
            rt.block_on(async {
                match a.mode.as_str() {
                    "server" => serve(a.addr).await,
                    "client" if a.addr.port() != 0 => client(a).await,
                    "client" => {
                        Err("--mode client needs the server's --addr 127.0.0.1:PORT".into())
                    }
                    other => Err(format!("--mode {other:?}: server or client\n{usage}")),
                }
            })
        });
    fail_on(program, outcome);
}

/// Exits with status 1 and `program: <error>` on standard error if `outcome` is an error.
pub fn fail_on(program: &str, outcome: Result<(), String>) {
    if let Err(e) = outcome {
        eprintln!("{program}: {e}");
        std::process::exit(1);
    }
}
