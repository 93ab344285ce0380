//! What a connection's handle and its tasks share.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;

use rpc_core::{RpcError, StatusCode};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::pending::PendingTable;
use crate::compression::Accepted;
use crate::writer::FrameSender;

/// Ids of connections, unique in the process.
pub(super) static NEXT_CONNECTION_ID: AtomicU64 = AtomicU64::new(1);

/// What a connection's handle and its tasks (reader, writer, sweeper, heartbeat) share.
pub(super) struct Shared {
    /// Unique in the process, never 0.
    pub(super) id: u64,
    pub(super) peer: String,
    pub(super) sender: FrameSender,
    /// `ConnectOptions::max_unsent_bytes`.
    pub(super) max_unsent_bytes: usize,
    /// `ConnectOptions::max_frame_length`: also the most a compressed answer may decompress to.
    pub(super) max_frame_length: usize,
    /// The compression algorithms the server's `HelloAck` listed.
    pub(super) accepts: Accepted,
    /// Calls waiting for their answers, by message id.
    pub(super) pending: PendingTable,
    /// Deadlines are enforced by one sweeper task per connection instead of one timer per
    /// call: `next_sweep` is the earliest deadline not yet checked (ms after `epoch`).
    pub(super) epoch: Instant,
    pub(super) next_sweep: AtomicU64,
    pub(super) sweep: Notify,
    pub(super) in_flight: Arc<AtomicUsize>,
    pub(super) going_away: AtomicBool,
    /// Mirrors `close` for the hot path: checking a token takes a lock, this does not.
    pub(super) closed: AtomicBool,
    pub(super) close: CancellationToken,
    /// Whether the server takes streams (`HelloAck.streams`, to a `Hello` offering them).
    pub(super) server_streams: bool,
    /// Whether this client offered streams (`ConnectOptions::streams`).
    pub(super) client_streams: bool,
    /// Items per stream this client buffers (`Hello.stream_window`).
    pub(super) stream_window: u32,
    /// Bytes per stream this client buffers (`Hello.stream_window_bytes`), 0 when the server
    /// does not keep byte windows (then items only are checked).
    pub(super) stream_window_bytes: u64,
    /// The server's byte window for the client's items (`HelloAck.stream_window_bytes`); 0:
    /// items only.
    pub(super) send_window_bytes: u64,
}

pub(super) fn comm_error(peer: &str, what: impl std::fmt::Display) -> RpcError {
    RpcError::new(StatusCode::CommunicationError, format!("{peer}: {what}"))
}
