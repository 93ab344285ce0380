//! Items per second of server streams over one connection, server and client in this process
//! (two runtime workers), for 32 B and 4 KiB items, one stream and 64 at once: a first look at
//! what a stream costs, ahead of stream cases in `bench` and the comparison with tonic.
//!
//! ```text
//! stream-rate [--items N]
//! ```
//!
//! Prints one line per case:
//! `STREAM size=<bytes> streams=<n> items=<total> secs=<s> items_per_s=<r> cpu_us_per_item=<u>`
//! (CPU of the whole process, both sides, from `getrusage`).

use std::time::Instant;

use clap::Parser;
use rpc::{Client, GovernanceOverrides, RpcError, RpcStream, Server, StaticRegistry};

#[rpc::service(name = "bench.Rate")]
pub trait Rate {
    /// `n` items of `size` bytes each.
    async fn items(&self, n: u64, size: u32) -> Result<RpcStream<String>, RpcError>;
}

struct Items;

impl Rate for Items {
    async fn items(&self, n: u64, size: u32) -> Result<RpcStream<String>, RpcError> {
        let item = "x".repeat(size as usize);
        Ok(RpcStream::iter((0..n).map(move |_| item.clone())))
    }
}

#[derive(Parser)]
struct Args {
    /// Items per case (split between the streams of the case).
    #[arg(long, default_value_t = 200_000)]
    items: u64,
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the struct it is given.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(usage.ru_utime) + t(usage.ru_stime)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = Server::builder()
            .max_concurrency(1000)
            .add_service(RateServer::new(Items))
            .serve("127.0.0.1:0")
            .await?;
        let client = RateClient::new(
            Client::builder()
                .registry(StaticRegistry::new([server.local_addr().to_string()]))
                // A deadline covers a whole stream: none here, whatever the case's length.
                .override_options(
                    RateClient::SERVICE_ID,
                    GovernanceOverrides {
                        timeout_ms: Some(0),
                        ..GovernanceOverrides::NONE
                    },
                )
                .build(),
        );
        // Warm up the connection.
        client.items(100, 32).await?.collect_all().await?;
        for size in [32u32, 4096] {
            for streams in [1u64, 64] {
                let per_stream = (args.items / streams).max(1);
                let (cpu, start) = (cpu_seconds(), Instant::now());
                let runs = (0..streams).map(|_| {
                    let client = client.clone();
                    tokio::spawn(async move {
                        let mut s = client.items(per_stream, size).await?;
                        let mut n = 0u64;
                        while let Some(item) = s.next().await {
                            item?;
                            n += 1;
                        }
                        Ok::<u64, RpcError>(n)
                    })
                });
                let mut total = 0;
                for run in runs.collect::<Vec<_>>() {
                    total += run.await??;
                }
                let secs = start.elapsed().as_secs_f64();
                let cpu = cpu_seconds() - cpu;
                println!(
                    "STREAM size={size} streams={streams} items={total} secs={secs:.3} \
                     items_per_s={:.0} cpu_us_per_item={:.2}",
                    total as f64 / secs,
                    cpu * 1e6 / total as f64
                );
            }
        }
        server.shutdown().await;
        Ok(())
    })
}
