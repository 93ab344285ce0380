//! `tonic-stream`: tonic 0.14 server-streaming echo, the peer that the framework's streams are
//! measured beside (`scripts/stream-bench.sh`). `Items(ItemsRequest{count, size})` answers a
//! stream of `Item{payload}` of `size` bytes each (count 0: until the caller cancels). Defaults
//! throughout (prost `Vec<u8>` payloads, tonic's buffers), `TCP_NODELAY` on both sides, one
//! `Channel` (one HTTP/2 connection) carrying every stream.
//!
//! ```text
//! tonic-stream --mode server --addr 127.0.0.1:PORT
//! tonic-stream --mode client --addr 127.0.0.1:PORT --streams S --size B --duration D --warmup W
//! ```
//!
//! - `server` prints `LISTENING peer=tonic addr=<addr> pid=<pid>` when it accepts connections
//!   and, on SIGTERM or SIGINT, `SERVER peer=tonic items=<sent> cpu_s=<s> wall_s=<s>
//!   cpu_us_per_item=<u>` (CPU since the process started), then exits.
//! - `client` opens S endless streams on one connection, reads them for the warm-up and then
//!   for the measured window, and prints `STREAM peer=tonic size=B streams=S items=<n>
//!   errors=<n> secs=<s> items_per_s=<r> cpu_s=<s> cpu_us_per_item=<u>`: items received in the
//!   window, client CPU from `getrusage` over the window.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::Stream;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};

pub mod pb {
    tonic::include_proto!("streambench");
}
use pb::items_client::ItemsClient;
use pb::items_server::{Items, ItemsServer};
use pb::{Item, ItemsRequest};

/// Items the server of this process has produced.
static SENT: AtomicU64 = AtomicU64::new(0);

struct Svc;

#[tonic::async_trait]
impl Items for Svc {
    type ItemsStream = Pin<Box<dyn Stream<Item = Result<Item, Status>> + Send>>;

    async fn items(
        &self,
        req: Request<ItemsRequest>,
    ) -> Result<Response<Self::ItemsStream>, Status> {
        let req = req.into_inner();
        let payload = vec![b'x'; req.size as usize];
        let count = if req.count == 0 { u64::MAX } else { req.count };
        let items = (0..count).map(move |_| {
            SENT.fetch_add(1, Ordering::Relaxed);
            Ok(Item {
                payload: payload.clone(),
            })
        });
        Ok(Response::new(Box::pin(futures_util::stream::iter(items))))
    }
}

#[derive(Debug)]
struct Args {
    mode: String,
    addr: SocketAddr,
    streams: usize,
    size: u32,
    duration: f64,
    warmup: f64,
}

const USAGE: &str = "usage: tonic-stream --mode server|client --addr 127.0.0.1:PORT \
[--streams S] [--size BYTES] [--duration SECS] [--warmup SECS]";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        mode: String::new(),
        addr: "127.0.0.1:0".parse().expect("literal address"),
        streams: 1,
        size: 32,
        duration: 3.0,
        warmup: 1.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it
            .next()
            .ok_or_else(|| format!("missing value for {flag}\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {val}: {e}\n{USAGE}");
        match flag.as_str() {
            "--mode" => a.mode = val.clone(),
            "--addr" => a.addr = val.parse().map_err(|e| bad(&e))?,
            "--streams" => a.streams = val.parse().map_err(|e| bad(&e))?,
            "--size" => a.size = val.parse().map_err(|e| bad(&e))?,
            "--duration" => a.duration = val.parse().map_err(|e| bad(&e))?,
            "--warmup" => a.warmup = val.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    if !a.addr.ip().is_loopback() {
        return Err(format!("{}: loopback addresses only", a.addr));
    }
    // (Written so that NaN fails too.)
    let positive = a.duration.is_finite() && a.duration > 0.0;
    let non_negative = a.warmup.is_finite() && a.warmup >= 0.0;
    if a.streams == 0 || !positive || !non_negative {
        return Err(format!(
            "--streams at least 1, --duration above 0, --warmup 0 or more\n{USAGE}"
        ));
    }
    Ok(a)
}

/// User plus system CPU of this process so far.
fn cpu() -> Duration {
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

async fn serve(addr: SocketAddr) -> Result<(), String> {
    let (wall0, cpu0) = (Instant::now(), cpu());
    let incoming = TcpIncoming::bind(addr)
        .map_err(|e| format!("bind {addr}: {e}"))?
        .with_nodelay(Some(true));
    let local = incoming.local_addr().map_err(|e| e.to_string())?;
    println!(
        "LISTENING peer=tonic addr={local} pid={}",
        std::process::id()
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let server = Server::builder()
        .add_service(ItemsServer::new(Svc))
        .serve_with_incoming(incoming);
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    tokio::select! {
        r = server => r.map_err(|e| format!("serve: {e}"))?,
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    let used = (cpu() - cpu0).as_secs_f64();
    let sent = SENT.load(Ordering::Relaxed);
    println!(
        "SERVER peer=tonic items={sent} cpu_s={used:.3} wall_s={:.3} cpu_us_per_item={:.3}",
        wall0.elapsed().as_secs_f64(),
        used * 1e6 / sent.max(1) as f64
    );
    let _ = std::io::stdout().flush();
    std::process::exit(0);
}

async fn client(a: &Args) -> Result<(), String> {
    let ch: Channel = Endpoint::from_shared(format!("http://{}", a.addr))
        .map_err(|e| e.to_string())?
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| format!("connect {}: {e}", a.addr))?;
    let client = ItemsClient::new(ch).max_decoding_message_size(64 << 20);
    // One short stream first: an unreachable or wrong server is an error, not a run of zeros.
    let mut first = client
        .clone()
        .items(ItemsRequest {
            count: 3,
            size: a.size,
        })
        .await
        .map_err(|e| format!("Items to {}: {e}", a.addr))?
        .into_inner();
    let mut n = 0;
    while let Some(item) = first
        .message()
        .await
        .map_err(|e| format!("first stream: {e}"))?
    {
        if item.payload.len() != a.size as usize {
            return Err(format!(
                "an item of {} bytes for {}",
                item.payload.len(),
                a.size
            ));
        }
        n += 1;
    }
    if n != 3 {
        return Err(format!("asked for 3 items, got {n}"));
    }

    let items = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::with_capacity(a.streams);
    for _ in 0..a.streams {
        let mut c = client.clone();
        let (items, errors, stop, size) = (items.clone(), errors.clone(), stop.clone(), a.size);
        readers.push(tokio::spawn(async move {
            let mut s = match c.items(ItemsRequest { count: 0, size }).await {
                Ok(r) => r.into_inner(),
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            while !stop.load(Ordering::Relaxed) {
                match s.message().await {
                    Ok(Some(item)) if item.payload.len() == size as usize => {
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
    tokio::time::sleep(Duration::from_secs_f64(a.warmup)).await;
    let (n0, c0, t0) = (items.load(Ordering::Relaxed), cpu(), Instant::now());
    tokio::time::sleep(Duration::from_secs_f64(a.duration)).await;
    let (n1, c1, secs) = (
        items.load(Ordering::Relaxed),
        cpu(),
        t0.elapsed().as_secs_f64(),
    );
    stop.store(true, Ordering::Relaxed);
    let n = n1 - n0;
    let cpu_s = (c1 - c0).as_secs_f64();
    println!(
        "STREAM peer=tonic size={} streams={} items={n} errors={} secs={secs:.3} \
         items_per_s={:.1} cpu_s={cpu_s:.3} cpu_us_per_item={:.3}",
        a.size,
        a.streams,
        errors.load(Ordering::Relaxed),
        n as f64 / secs,
        cpu_s * 1e6 / n.max(1) as f64
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    if errors.load(Ordering::Relaxed) > 0 {
        return Err("some streams failed or carried wrong items".into());
    }
    std::process::exit(0);
}

fn main() {
    let outcome = parse().and_then(|a| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        rt.block_on(async {
            match a.mode.as_str() {
                "server" => serve(a.addr).await,
                "client" if a.addr.port() != 0 => client(&a).await,
                "client" => Err("--mode client needs the server's --addr 127.0.0.1:PORT".into()),
                other => Err(format!("--mode {other:?}: server or client\n{USAGE}")),
            }
        })
    });
    if let Err(e) = outcome {
        eprintln!("tonic-stream: {e}");
        std::process::exit(1);
    }
}
