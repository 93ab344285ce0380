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
use std::time::Instant;

use stream_peer::{cpu, measure, print_server_line, print_stream_line, Args};

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

const USAGE: &str = "usage: tonic-stream --mode server|client --addr 127.0.0.1:PORT \
[--streams S] [--size BYTES] [--duration SECS] [--warmup SECS]";

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
    print_server_line("tonic", SENT.load(Ordering::Relaxed), cpu0, wall0);
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
    let mut readers = Vec::with_capacity(a.streams as usize);
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
    let window = measure(a, &items).await;
    stop.store(true, Ordering::Relaxed);
    print_stream_line("tonic", a, window, errors.load(Ordering::Relaxed));
    if errors.load(Ordering::Relaxed) > 0 {
        return Err("some streams failed or carried wrong items".into());
    }
    std::process::exit(0);
}

fn main() {
    match stream_peer::parse(std::env::args().skip(1), USAGE, |_, _| Ok(false)) {
        Ok(a) => stream_peer::run("tonic-stream", USAGE, &a, serve, client),
        Err(e) => stream_peer::fail_on("tonic-stream", Err(e)),
    }
}
