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
    /// The most attachments, and bytes of them, the server takes on a call
    /// (`HelloAck.max_attachments`, `max_attachment_bytes`); `None`: not said.
    pub(super) max_attachments: (Option<usize>, Option<usize>),
}

impl Shared {
    /// Why `call` is not to be sent: it carries more attachments (count or bytes, its retry
    /// depth's included) than the server said it takes. The server would answer it 500 and
    /// hold it against the connection, which it closes after a few in a row (a gateway
    /// forwarding a caller's headers would lose every other call on it); the call fails here
    /// instead, with a validation error (1001) marked as this endpoint's inability to serve it
    /// ([`RpcError::is_unsupported_by_endpoint`]).
    pub(super) fn over_attachment_limits(&self, call: &crate::Call) -> Option<RpcError> {
        let (count, bytes) = self.max_attachments;
        if count.is_none() && bytes.is_none() {
            return None;
        }
        // The retry depth goes as an attachment of its own key, over any entry of that key.
        let depth = (call.retry_depth != 0).then(|| call.retry_depth.to_string());
        let replaced = depth.is_some() && call.attachments.contains_key(rpc_core::RETRY_DEPTH_KEY);
        let n = call.attachments.len() + usize::from(depth.is_some() && !replaced);
        let why = match count {
            Some(count) if n > count => {
                format!("{n} attachments, over the server's limit of {count}")
            }
            _ => {
                let bytes = bytes?;
                let size: usize = call
                    .attachments
                    .iter()
                    .filter(|(k, _)| depth.is_none() || k.as_str() != rpc_core::RETRY_DEPTH_KEY)
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>()
                    + depth.map_or(0, |d| rpc_core::RETRY_DEPTH_KEY.len() + d.len());
                if size <= bytes {
                    return None;
                }
                format!("attachments of {size} bytes, over the server's limit of {bytes}")
            }
        };
        // A validation error: the call's own fault. Nothing was sent, and this endpoint will
        // never take the call as it is: like an endpoint that cannot stream, it says nothing of
        // the endpoint's health (no breaker, health or outlier count) and the call may go on to
        // another endpoint, whose server may take more.
        Some(
            RpcError::new(
                StatusCode::ValidateError,
                format!(
                    "{}: the call to {} carries {why}; it was not sent: send fewer (a gateway \
                     forwards its caller's headers as attachments)",
                    self.peer, call.service_entry_id
                ),
            )
            .unsupported_by_endpoint(true),
        )
    }
}

pub(super) fn comm_error(peer: &str, what: impl std::fmt::Display) -> RpcError {
    RpcError::new(StatusCode::CommunicationError, format!("{peer}: {what}"))
}
