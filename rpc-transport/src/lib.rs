//! # rpc-transport
//!
//! Frames on a byte stream, as `proto/rpc.proto` defines them: the length-delimited
//! [`FrameCodec`], the client [`Connection`] (handshake, many calls multiplexed by `message_id`
//! through a slab of pending calls, `Cancel` when a caller gives up, heartbeats), the
//! [`ConnectionPool`] that reconnects after a server restart, and the server accept loop
//! [`serve`] (handshake with constant-time token check, frame limits, idle timeout, `Cancel`,
//! graceful drain).
//!
//! The stream comes from a transport: dialing and listening go through the [`Dialer`],
//! [`Listener`] and [`Stream`] traits of the [`transport`] module, whose two implementations
//! are TCP (`host:port`) and Unix domain sockets (`unix:/path/to.sock`); the address chooses.
//!
//! Each connection has one writer task that drains every queued frame into one buffer and writes
//! it with one syscall, and one reader that decodes every complete frame in its buffer before
//! waiting again. `TCP_NODELAY` is on.
//!
//! With feature `tls`, connections run over TLS (rustls) when `ServerOptions::tls` and
//! `ConnectOptions::tls` say so, with mutual TLS as an option, over any transport: see the
//! `tls` module.
//!
//! This crate knows frames and streams, not services: it must not look inside parameters,
//! choose endpoints or apply governance policies. The server side hands each call to an
//! [`InvokeHandler`], with the [`Caller`] its connection's handshake established (client id,
//! token check, TLS certificate).
//!
//! ```no_run
//! use rpc_transport::{Call, ConnectOptions, Connection};
//! # async fn f() -> Result<(), rpc_core::RpcError> {
//! let conn = Connection::connect("127.0.0.1:9001", &ConnectOptions::default()).await?;
//! let answer = conn
//!     .call(
//!         Call {
//!             service_entry_id: "echo.Echo.echo".into(),
//!             parameters: rpc_core::Codec::MsgPack.encode(&("hi",)).unwrap(),
//!             timeout_ms: 800, // the server stops the work after this
//!             ..Default::default()
//!         },
//!         // ...and so does the client: it fails the call and sends Cancel.
//!         Some(tokio::time::Instant::now() + std::time::Duration::from_millis(800)),
//!     )
//!     .await?;
//! println!("status {}", answer.status_code);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod call;
mod caller;
mod client;
mod codec;
pub mod compression;
mod decode;
mod encode;
mod entries;
mod flow;
mod invoke;
mod peer;
mod pool;
mod reader;
mod server;
#[cfg(feature = "tls")]
pub mod tls;
pub mod transport;
mod writer;

pub use call::Call;
pub use caller::{Caller, UnpackRefusal};
pub use client::{ClientStream, ConnectOptions, Connection, EndToError, Opened, StreamSender};
pub use codec::{FrameCodec, FrameError};
pub use invoke::{Invoke, WireStr};
pub use peer::{PeerAddr, UNIX_SCHEME};
pub use pool::{ConnectFailed, ConnectionPool};
pub use server::{
    dropped_as_superseded, dropped_at_drain_deadline, dropped_at_server_abort, error_result, serve,
    Dispatch, InvokeHandler, ItemSink, Refusal, ServerOptions, StreamEvent, StreamEvents,
    ABUSE_LIMIT, DEFAULT_CLIENT_STREAM_WINDOW, DEFAULT_STREAM_WINDOW, DEFAULT_STREAM_WINDOW_BYTES,
    MAX_CLIENT_ID, MAX_HELLO_FRAME, MAX_STREAM_WINDOW, PAUSED_KEEPALIVE, REFUSALS_BEFORE_PAUSE,
};
pub use transport::{Abortive, Address, Dialer, Listener, Stream, TcpDialer};
#[cfg(unix)]
pub use transport::{UnixDialer, UnixListener};

/// Initial capacity of each connection's read buffer: 64 KiB, so a 4 KiB payload stream needs no
/// regrowth and many small frames arrive in one read.
const READ_BUFFER: usize = 64 * 1024;

/// Stream items (or frames of items) of at most this many bytes are copied out of the
/// connection's read buffer when they are queued for a consumer: a slice of it would keep the
/// whole buffer (64 KiB) alive for as long as it waits, so a window of small items, each in a
/// buffer of its own among other traffic, would hold far more than the window counts. Larger
/// ones keep sharing it: the usual buffer, or one a client grew for a frame of up to twice its
/// size (a larger frame, past the usual buffer on a server, has an allocation of its own,
/// whose items are copied out when they are less than half of it: [`own_sparse_items`]).
const COPY_QUEUED_BELOW: usize = READ_BUFFER / 8;

/// `payload` holding only its own bytes when it is small (see [`COPY_QUEUED_BELOW`]).
fn own_bytes(payload: bytes::Bytes) -> bytes::Bytes {
    if payload.len() <= COPY_QUEUED_BELOW {
        bytes::Bytes::copy_from_slice(&payload)
    } else {
        payload
    }
}

/// Copies out the items of a stream-item frame of `frame` bytes that came in an allocation of
/// its own (larger than the read buffer) when they are less than half of it. Each item would
/// otherwise be a slice of the frame and keep all of it alive while it waits for its consumer,
/// who counts only the item's size against the stream's window (and a server's read budget
/// lets the frame's share go once it is decoded): a peer could pad each 9 KiB item, with an
/// unknown field or a payload given twice (prost keeps the last), into a 16 MiB frame. A frame
/// its items fill keeps sharing its allocation.
fn own_sparse_items(kind: &mut rpc_core::wire::frame::Kind, frame: usize) {
    use rpc_core::wire::frame::Kind;
    let payloads: &mut [bytes::Bytes] = match kind {
        Kind::StreamItem(item) => std::slice::from_mut(&mut item.payload),
        Kind::StreamItems(items) => &mut items.payloads,
        _ => return,
    };
    let carried: usize = payloads.iter().map(bytes::Bytes::len).sum();
    if carried < frame / 2 {
        for payload in payloads {
            *payload = bytes::Bytes::copy_from_slice(payload);
        }
    }
}

/// A `StreamItem` frame, length prefix included, of `9 KiB + 1 MiB - padding` bytes of item
/// and `padding` bytes of an unknown field (number 1000) that prost skips: a large frame its
/// item fills, or one mostly of something else (for the tests of [`own_sparse_items`]'s
/// callers).
#[cfg(test)]
pub(crate) fn padded_item_frame(padding: usize) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    use prost::Message;
    use rpc_core::wire::{frame::Kind, Frame, StreamItem};
    let item = Kind::StreamItem(StreamItem {
        message_id: 1,
        payload: bytes::Bytes::from(vec![7u8; 9 * 1024 + (1 << 20) - padding]),
        compression: 0,
    });
    let mut body = Frame { kind: Some(item) }.encode_to_vec();
    if padding > 0 {
        encode_key(1000, WireType::LengthDelimited, &mut body);
        encode_varint(padding as u64, &mut body);
        body.resize(body.len() + padding, 0);
    }
    let mut wire = (body.len() as u32).to_be_bytes().to_vec();
    wire.extend_from_slice(&body);
    wire
}

/// Whether `part` starts inside `buf`'s bytes: a slice of it (for the tests of
/// [`own_bytes`]'s callers), not a copy.
#[cfg(test)]
pub(crate) fn lies_in(buf: &bytes::Bytes, part: &bytes::Bytes) -> bool {
    let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    range.contains(&(part.as_ptr() as usize))
}

/// Capacity of a server connection's read buffer until the handshake is done.
const HELLO_BUFFER: usize = 1024;

/// Shows a secret as set or not, never its value (`Debug` of the options that hold a token).
struct Redacted<'a>(&'a Option<String>);

impl std::fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Some(_) => "Some(<redacted>)",
            None => "None",
        })
    }
}

/// Broken and unusual payloads, for the tests that hold a hand-written decoder to prost's.
#[cfg(test)]
pub(crate) mod mutations {
    use bytes::BytesMut;
    use rand::rngs::StdRng;
    use rand::Rng;
    use rpc_core::wire::frame::Kind;

    use crate::codec::FrameCodec;

    /// The payload of the frame of `kind`, without its length prefix.
    pub(crate) fn payload(kind: Kind) -> Vec<u8> {
        let mut buf = BytesMut::new();
        FrameCodec::encode_kind(kind, &mut buf);
        buf[crate::encode::PREFIX..].to_vec()
    }

    /// Fails unless a hand-written decoder (`ours`) and prost agree on `payload`: the same
    /// value, or both an error.
    pub(crate) fn agree<T, A, B>(payload: &[u8], ours: Result<T, A>, prost: Result<T, B>)
    where
        T: PartialEq + std::fmt::Debug,
        A: std::fmt::Debug,
        B: std::fmt::Debug,
    {
        match (ours, prost) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "payload {payload:02x?}"),
            (Err(_), Err(_)) => {}
            (a, b) => panic!("decoders disagree on {payload:02x?}: {a:?} against {b:?}"),
        }
    }

    /// The cases every decoder of one frame kind is held to, for the kind whose oneof key
    /// byte is `key`, `frame` making real payloads of that kind and `other` a payload of
    /// another kind: nothing, the other kind, the kind followed by the other (prost keeps the
    /// last oneof field), the kind twice (prost merges), an unknown field (15, varint) inside,
    /// a varint of eleven bytes, and every prefix and one-byte change of 30 real frames.
    pub(crate) fn cases(
        key: u8,
        mut frame: impl FnMut(&mut StdRng) -> Vec<u8>,
        other: Vec<u8>,
        rng: &mut StdRng,
    ) -> Vec<Vec<u8>> {
        let mut cases = vec![
            vec![],
            other.clone(),
            [frame(rng), other].concat(),
            [frame(rng), frame(rng)].concat(),
            vec![key, 0x04, 0x08, 0x01, 0x78, 0x05],
            [&[key, 0x0c, 0x08][..], &[0xff; 10][..], &[0x01][..]].concat(),
        ];
        let frames: Vec<_> = (0..30).map(|_| frame(rng)).collect();
        for p in frames {
            for cut in 0..p.len() {
                cases.push(p[..cut].to_vec());
            }
            for _ in 0..30 {
                let mut q = p.clone();
                let i = rng.random_range(0..q.len());
                q[i] = rng.random();
                cases.push(q);
            }
        }
        cases
    }
}

/// Allocations counted per thread, for the tests that check a path allocates nothing.
#[cfg(test)]
pub(crate) mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static COUNT: Cell<u64> = const { Cell::new(0) };
    }

    struct Counting;

    // SAFETY: every method forwards to `System` with the same arguments.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
            // SAFETY: forwarded as received.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded as received.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
            // SAFETY: forwarded as received.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    /// Allocations made by this thread so far.
    pub(crate) fn this_thread() -> u64 {
        COUNT.with(Cell::get)
    }
}
