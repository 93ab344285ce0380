//! Compression figures: what the `compression` option does to a large compressible payload.
//!
//! ```text
//! cargo run --release -p examples --bin compression -- [--payload 65536] [--concurrency 16]
//!       [--duration 3] [--warmup 0.5]
//! ```
//!
//! One process serves `echo.Echo` on 127.0.0.1 and calls it over TCP with a JSON-like payload
//! (records with repeated keys, as APIs send), once per setting of `compression` (`off`,
//! `zstd`, `lz4`, turned on for the client's handle; the server answers with the algorithm the
//! call came with). Per setting it prints one line:
//!
//! `compression=<alg> payload=<bytes> ratio=<x> compress_mb_s=<MB/s> decompress_mb_s=<MB/s>
//! calls_per_s=<n> mb_per_s=<MB/s> p50_us=<us> p99_us=<us>`
//!
//! `ratio` is the encoded parameters' size over their compressed size; `compress_mb_s` and
//! `decompress_mb_s` are one thread's speed on that payload (`rpc::crates::transport::compression`
//! alone); `calls_per_s` is echo calls completed per second with `--concurrency` callers on one
//! connection, and `mb_per_s` the payload bytes echoed per second (one direction). Figures, not
//! assertions: the machine and what else runs on it set them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use examples::{Echo, EchoClient, EchoServer, EchoService};
use hdrhistogram::Histogram;
use rpc::crates::transport::compression::{compress, decompress};
use rpc::{Client, Codec, Compression, GovernanceOverrides, Server, StaticRegistry};

#[derive(Parser, Debug)]
#[command(about = "Compression ratio and throughput for a large compressible payload")]
struct Args {
    /// Payload bytes (the echoed string).
    #[arg(long, default_value_t = 64 * 1024)]
    payload: usize,
    /// Callers at once, on one connection.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Measured seconds per setting.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Seconds of load before measuring, per setting.
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
}

/// JSON-like text of exactly `n` bytes: records with repeated keys and varying values.
fn json_like(n: usize) -> String {
    let mut out = String::with_capacity(n + 128);
    let mut i = 0u64;
    out.push('[');
    while out.len() < n {
        out.push_str(&format!(
            "{{\"id\":{i},\"user\":\"user-{}\",\"status\":\"{}\",\"amount\":{}.{:02},\
             \"tags\":[\"retail\",\"eu\"]}},",
            i * 7919 % 10_007,
            ["active", "pending", "closed"][(i % 3) as usize],
            i * 31 % 1000,
            i % 100
        ));
        i += 1;
    }
    out.truncate(n);
    out
}

/// One thread's speed on `data`, in MB/s, for `f` run until `at_least` has passed.
fn speed(data_len: usize, at_least: Duration, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < at_least || n < 10 {
        f();
        n += 1;
    }
    (n as f64 * data_len as f64) / start.elapsed().as_secs_f64() / 1e6
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    let duration = Duration::try_from_secs_f64(args.duration)
        .map_err(|_| "--duration: give a non-negative number of seconds".to_string())?;
    let warmup = Duration::try_from_secs_f64(args.warmup)
        .map_err(|_| "--warmup: give a non-negative number of seconds".to_string())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("could not start the tokio runtime: {e}"))?;
    rt.block_on(run(&args, duration, warmup))
}

async fn run(args: &Args, duration: Duration, warmup: Duration) -> Result<(), String> {
    let server = Server::builder()
        .add_service(EchoServer::new(EchoService::default()))
        .serve("127.0.0.1:0")
        .await
        .map_err(|e| format!("serve: {e}"))?;
    let base = Client::builder()
        .registry(StaticRegistry::new([server.local_addr().to_string()]))
        .connections_per_endpoint(1)
        .build();
    let payload = json_like(args.payload);
    let encoded = Codec::MsgPack
        .encode(&(payload.as_str(),))
        .map_err(|e| e.to_string())?;
    for algorithm in [Compression::Off, Compression::Zstd, Compression::Lz4] {
        let (ratio, c_speed, d_speed) = if algorithm == Compression::Off {
            (1.0, 0.0, 0.0)
        } else {
            let packed = compress(algorithm, &encoded);
            let ratio = encoded.len() as f64 / packed.len() as f64;
            let c = speed(encoded.len(), Duration::from_millis(500), || {
                std::hint::black_box(compress(algorithm, &encoded));
            });
            let d = speed(encoded.len(), Duration::from_millis(500), || {
                let out = decompress(algorithm.to_wire(), &packed, usize::MAX);
                std::hint::black_box(out.map(|b| b.len()).unwrap_or_default());
            });
            (ratio, c, d)
        };
        let client = Arc::new(EchoClient::new(base.with_options(GovernanceOverrides {
            compression: Some(algorithm),
            ..GovernanceOverrides::NONE
        })));
        let (calls, secs, hist) =
            load(&client, &payload, args.concurrency, warmup, duration).await?;
        let per_s = calls as f64 / secs;
        println!(
            "compression={} payload={} ratio={ratio:.2} compress_mb_s={c_speed:.0} \
             decompress_mb_s={d_speed:.0} calls_per_s={per_s:.0} mb_per_s={:.1} p50_us={} \
             p99_us={}",
            algorithm.name(),
            args.payload,
            per_s * args.payload as f64 / 1e6,
            hist.value_at_quantile(0.5) / 1000,
            hist.value_at_quantile(0.99) / 1000,
        );
    }
    server.shutdown().await;
    Ok(())
}

/// `concurrency` closed-loop callers: calls completed in the measured window, its length in
/// seconds, and their latencies (ns).
async fn load(
    client: &Arc<EchoClient>,
    payload: &str,
    concurrency: usize,
    warmup: Duration,
    duration: Duration,
) -> Result<(u64, f64, Histogram<u64>), String> {
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let client = client.clone();
        let payload = payload.to_string();
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
                .map_err(|e| e.to_string())?;
            let mut calls = 0u64;
            loop {
                let began = Instant::now();
                if began >= end {
                    break;
                }
                let back = client
                    .echo(payload.clone())
                    .await
                    .map_err(|e| format!("echo: {e}"))?;
                if back.len() != payload.len() {
                    return Err("echo answered another payload".to_string());
                }
                if began >= measure_from {
                    calls += 1;
                    let _ = hist.record(began.elapsed().as_nanos() as u64);
                }
            }
            Ok::<_, String>((calls, hist))
        }));
    }
    let mut total = 0;
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| e.to_string())?;
    for t in tasks {
        let (calls, h) = t.await.map_err(|e| e.to_string())??;
        total += calls;
        hist.add(h).map_err(|e| e.to_string())?;
    }
    Ok((total, duration.as_secs_f64(), hist))
}
