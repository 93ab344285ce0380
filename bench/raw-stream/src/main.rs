//! `raw-stream`: the practical limit of a server stream on one TCP connection, measured beside
//! the framework's streams and tonic's (`scripts/stream-bench.sh`). No framework: the server
//! writes length-delimited items (`u32` length, `u32` stream number, the payload) into a
//! 64 KiB buffer and the buffer into the socket; the client reads into a buffer and walks the
//! items in place. No flow control, no task per stream, no allocation or copy per item beyond
//! the payload's bytes into the buffer: what any streaming protocol's items cost on this
//! machine at the least, so that a goal above this figure is beyond every framework here.
//!
//! With `--items vec` (on the server and the client alike) each side also does the per-item
//! work of the other peers' benchmark programs, which stream a `Vec<u8>` per item: the server
//! clones its item into a new `Vec` and counts it in a shared counter before writing it; the
//! client copies each item into a new `Vec`, checks its length and counts it in a shared
//! counter. The limit then holds for any framework whose users stream `Vec<u8>` items.
//!
//! ```text
//! raw-stream --mode server --addr 127.0.0.1:PORT [--items none|vec]
//! raw-stream --mode client --addr 127.0.0.1:PORT --streams S --size B --duration D --warmup W
//!            [--items none|vec]
//! ```
//!
//! The request is 16 bytes: streams (`u32`), size (`u32`), count per stream (`u64`, 0: until
//! the client leaves); the server answers items to the streams in turn and closes the
//! connection after `count` items each. Command line and output lines as `tonic-stream`'s
//! (`bench/stream-peer`), with `peer=raw` (`raw-vec` with `--items vec`): `LISTENING`,
//! `SERVER ... items=<sent> cpu_s=<s> ...` on SIGTERM or SIGINT, and the client's
//! `STREAM peer=raw size=B streams=S items=<n> errors=<n> secs=<s> items_per_s=<r> cpu_s=<s>
//! cpu_us_per_item=<u>`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use stream_peer::{cpu, measure, print_server_line, print_stream_line, Args};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Items the server of this process has written.
static SENT: AtomicU64 = AtomicU64::new(0);

/// The server's write buffer: items are written in runs of about this many bytes.
const WRITE_BUFFER: usize = 64 * 1024;

/// The client's read buffer.
const READ_BUFFER: usize = 256 * 1024;

/// An item's header: its length (stream number and payload) and its stream number.
const HEADER: usize = 8;

const USAGE: &str = "usage: raw-stream --mode server|client --addr 127.0.0.1:PORT \
[--streams S] [--size BYTES] [--duration SECS] [--warmup SECS] [--items none|vec]";

/// The command line, and whether each item is a `Vec` of its own on both sides
/// (`--items vec`).
fn parse() -> Result<(Args, bool), String> {
    let mut vec_items = false;
    let a = stream_peer::parse(std::env::args().skip(1), USAGE, |flag, val| {
        if flag != "--items" {
            return Ok(false);
        }
        vec_items = match val {
            "none" => false,
            "vec" => true,
            _ => return Err(format!("--items {val}: none or vec")),
        };
        Ok(true)
    })?;
    Ok((a, vec_items))
}

/// Answers one connection's request: `count` items (0: endless) to each of its streams, in turn.
async fn answer(mut conn: TcpStream, vec_items: bool) -> std::io::Result<()> {
    let mut request = [0u8; 16];
    conn.read_exact(&mut request).await?;
    let streams = u32::from_le_bytes(request[0..4].try_into().expect("4 bytes"));
    let size = u32::from_le_bytes(request[4..8].try_into().expect("4 bytes"));
    let count = u64::from_le_bytes(request[8..16].try_into().expect("8 bytes"));
    let count = if count == 0 { u64::MAX } else { count };
    let payload = vec![b'x'; size as usize];
    let mut buf = Vec::with_capacity(WRITE_BUFFER + HEADER + size as usize);
    for _ in 0..count {
        for stream in 0..streams {
            buf.extend_from_slice(&(size + 4).to_le_bytes());
            buf.extend_from_slice(&stream.to_le_bytes());
            if vec_items {
                let item = std::hint::black_box(payload.clone());
                SENT.fetch_add(1, Ordering::Relaxed);
                buf.extend_from_slice(&item);
            } else {
                buf.extend_from_slice(&payload);
            }
            if buf.len() >= WRITE_BUFFER {
                conn.write_all(&buf).await?;
                if !vec_items {
                    SENT.fetch_add(items_in(buf.len(), size), Ordering::Relaxed);
                }
                buf.clear();
            }
        }
    }
    conn.write_all(&buf).await?;
    if !vec_items {
        SENT.fetch_add(items_in(buf.len(), size), Ordering::Relaxed);
    }
    conn.shutdown().await
}

/// The peer's name in the output lines.
fn peer_name(vec_items: bool) -> &'static str {
    if vec_items {
        "raw-vec"
    } else {
        "raw"
    }
}

fn items_in(bytes: usize, size: u32) -> u64 {
    (bytes / (HEADER + size as usize)) as u64
}

async fn serve(addr: SocketAddr, vec_items: bool) -> Result<(), String> {
    let (wall0, cpu0) = (Instant::now(), cpu());
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("bind {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let peer = peer_name(vec_items);
    println!(
        "LISTENING peer={peer} addr={local} pid={}",
        std::process::id()
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let accept = async {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                continue;
            };
            let _ = conn.set_nodelay(true);
            tokio::spawn(answer(conn, vec_items));
        }
    };
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    tokio::select! {
        _ = accept => {}
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    print_server_line(peer, SENT.load(Ordering::Relaxed), cpu0, wall0);
    std::process::exit(0);
}

/// Opens a connection asking for `count` items (0: endless) to each of `streams` streams.
async fn open(a: &Args, streams: u32, count: u64) -> Result<TcpStream, String> {
    let mut conn = TcpStream::connect(a.addr)
        .await
        .map_err(|e| format!("connect {}: {e}", a.addr))?;
    conn.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut request = [0u8; 16];
    request[0..4].copy_from_slice(&streams.to_le_bytes());
    request[4..8].copy_from_slice(&a.size.to_le_bytes());
    request[8..16].copy_from_slice(&count.to_le_bytes());
    conn.write_all(&request).await.map_err(|e| e.to_string())?;
    Ok(conn)
}

/// Reads items until the server closes the connection or `stop` is set, adding each run read
/// to `items` (or, with `vec_items`, each item as it is copied out); an item of the wrong length
/// or stream is an error.
async fn read(
    mut conn: TcpStream,
    (streams, size, vec_items): (u32, u32, bool),
    items: &AtomicU64,
    stop: &AtomicBool,
) -> Result<(), String> {
    // Room for a whole item after a partial one, however large the items.
    let mut buf = vec![0u8; READ_BUFFER.max(2 * (HEADER + size as usize))];
    let (mut start, mut end) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        if start == end {
            (start, end) = (0, 0);
        } else if buf.len() - end < HEADER + size as usize {
            buf.copy_within(start..end, 0);
            (start, end) = (0, end - start);
        }
        let n = conn
            .read(&mut buf[end..])
            .await
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return if start == end {
                Ok(())
            } else {
                Err("the connection ended inside an item".into())
            };
        }
        end += n;
        let mut read = 0;
        while end - start >= HEADER {
            let len = u32::from_le_bytes(buf[start..start + 4].try_into().expect("4 bytes"));
            let stream = u32::from_le_bytes(buf[start + 4..start + 8].try_into().expect("4 bytes"));
            if len != size + 4 || stream >= streams {
                return Err(format!("an item of {len} bytes to stream {stream}"));
            }
            if end - start < 4 + len as usize {
                break;
            }
            if vec_items {
                let item =
                    std::hint::black_box(buf[start + HEADER..start + 4 + len as usize].to_vec());
                if item.len() != size as usize {
                    return Err(format!("an item of {} bytes", item.len()));
                }
                items.fetch_add(1, Ordering::Relaxed);
            } else {
                read += 1;
            }
            start += 4 + len as usize;
        }
        items.fetch_add(read, Ordering::Relaxed);
    }
    Ok(())
}

async fn client(a: &Args, vec_items: bool) -> Result<(), String> {
    // One short stream first: an unreachable or wrong server is an error, not a run of zeros.
    let first = AtomicU64::new(0);
    let conn = open(a, 1, 3).await?;
    let shape = (1, a.size, vec_items);
    read(conn, shape, &first, &AtomicBool::new(false)).await?;
    if first.load(Ordering::Relaxed) != 3 {
        return Err(format!("asked for 3 items, got {}", first.into_inner()));
    }

    let items = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let conn = open(a, a.streams, 0).await?;
    let reader = {
        let (items, errors, stop) = (items.clone(), errors.clone(), stop.clone());
        let shape = (a.streams, a.size, vec_items);
        tokio::spawn(async move {
            if let Err(e) = read(conn, shape, &items, &stop).await {
                eprintln!("raw-stream: {e}");
                errors.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let window = measure(a, &items).await;
    // (Before `stop`: the reader ends soon after it.)
    let ended_early = reader.is_finished();
    stop.store(true, Ordering::Relaxed);
    print_stream_line(
        peer_name(vec_items),
        a,
        window,
        errors.load(Ordering::Relaxed),
    );
    if errors.load(Ordering::Relaxed) > 0 || ended_early {
        return Err("the stream failed or ended early".into());
    }
    std::process::exit(0);
}

fn main() {
    match parse() {
        Ok((a, vec_items)) => stream_peer::run(
            "raw-stream",
            USAGE,
            &a,
            |addr| serve(addr, vec_items),
            |a| client(a, vec_items),
        ),
        Err(e) => stream_peer::fail_on("raw-stream", Err(e)),
    }
}
