//! What a connection's handle and its tasks share.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use rpc_core::wire::{frame::Kind, Cancel};
use rpc_core::{RpcError, StatusCode};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::pending::PendingTable;
use crate::compression::Accepted;
use crate::writer::FrameSender;

/// Ids of connections, unique in the process (and of the pool's failed connect attempts, which
/// take theirs from the same sequence).
pub(crate) static NEXT_CONNECTION_ID: AtomicU64 = AtomicU64::new(1);

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
    /// Sweeps that expired calls, counted between a sweep's expiry and its Cancels: a call
    /// that sees it move while it was being queued may have had its Cancel queued first
    /// ([`cancel_again_if_swept`](Self::cancel_again_if_swept)).
    pub(super) sweeps: AtomicU64,
    pub(super) in_flight: Arc<AtomicUsize>,
    pub(super) going_away: AtomicBool,
    /// This client sends no new calls on the connection, to close it once none is in flight
    /// ([`Connection::close_if_idle`](super::Connection::close_if_idle)).
    pub(super) retired: AtomicBool,
    /// Mirrors `close` for the hot path: checking a token takes a lock, this does not.
    pub(super) closed: AtomicBool,
    pub(super) close: CancellationToken,
    /// Why this client closed the connection, when it says (its heartbeat): the calls it
    /// fails say so, where the others (`close`, the pool) read "connection closed".
    pub(super) close_reason: std::sync::OnceLock<String>,
    /// Heartbeats so far: a stream whose consumer took items since it last granted credit,
    /// and sees a heartbeat since, grants them at once (see `ClientStream`), so a slow
    /// consumer's progress reaches the server within about one heartbeat interval.
    pub(super) beats: AtomicU64,
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
    /// What the server said it takes of a call.
    pub(super) limits: ServerLimits,
}

/// What a server takes of a call, as its `HelloAck` said.
#[derive(Debug, Clone, Copy)]
pub(super) struct ServerLimits {
    /// The most attachments (`HelloAck.max_attachments`); `None`: not said.
    pub(super) attachments: Option<usize>,
    /// The most bytes of attachments (`HelloAck.max_attachment_bytes`); `None`: not said.
    pub(super) attachment_bytes: Option<usize>,
    /// The longest frame it reads (`HelloAck.max_frame_length`); `usize::MAX`: not said.
    pub(super) frame_length: usize,
}

impl Shared {
    /// The timeout of a call or stream whose deadline has passed before it was sent: it is
    /// not sent. (Sent, the sweeper would expire it at once and could queue its Cancel ahead
    /// of it.)
    pub(super) fn past_deadline(&self, deadline: Option<Instant>) -> Option<RpcError> {
        deadline.is_some_and(|d| d <= Instant::now()).then(|| {
            RpcError::new(
                StatusCode::Timeout,
                format!(
                    "{}: the call's deadline passed before it was sent; nothing was sent",
                    self.peer
                ),
            )
            .not_sent(true)
        })
    }

    /// After queuing call `id` with `deadline_ms`: when a sweep expired calls since `sweeps`
    /// was read (before the call took its slot) and the deadline has passed, the sweep may
    /// have queued the call's Cancel ahead of it, which the server, not knowing the id yet,
    /// drops before running the call. The Cancel goes again, behind it (a second one for a
    /// call the server knows is dropped). Costs one atomic load when no sweep ran.
    pub(super) fn cancel_again_if_swept(&self, id: u64, deadline_ms: u64, sweeps: u64) {
        if deadline_ms == 0 || self.sweeps.load(Ordering::SeqCst) == sweeps {
            return;
        }
        if self.epoch.elapsed().as_millis() >= u128::from(deadline_ms) {
            self.sender.send(Kind::Cancel(Cancel {
                message_id: id,
                ..Default::default()
            }));
        }
    }

    /// Whether a call that just took its slot (counted in `in_flight`) must not be sent: the
    /// connection closed, or the client retired it. (`in_flight` is counted before `retired`
    /// is read, and `close_if_idle` sets `retired` before it reads `in_flight`: one of the two
    /// sees the other, so a call is never sent on a connection closed as idle.)
    pub(super) fn takes_no_call(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.retired.load(Ordering::SeqCst)
    }

    /// Wakes the deadline sweeper when `deadline_ms` (0 for none) is a new earliest deadline:
    /// it may be asleep until a later one.
    pub(super) fn wake_sweeper_for(&self, deadline_ms: u64) {
        if deadline_ms != 0
            && self.next_sweep.fetch_min(deadline_ms, Ordering::AcqRel) > deadline_ms
        {
            self.sweep.notify_one();
        }
    }

    /// Why `call` is not to be sent: it carries more attachments (count or bytes, its retry
    /// depth's not: the server takes it apart before counting) than the server said it takes. The server would answer it 500 and
    /// hold it against the connection, which it closes after a few in a row (a gateway
    /// forwarding a caller's headers would lose every other call on it); the call fails here
    /// instead, with a validation error (1001) marked as this endpoint's inability to serve it
    /// ([`RpcError::is_unsupported_by_endpoint`]).
    pub(super) fn over_attachment_limits(&self, call: &crate::Call) -> Option<RpcError> {
        let why = self.attachments_over(call)?;
        Some(self.refusal(
            call,
            &why,
            "send fewer (a gateway forwards its caller's headers as attachments)",
        ))
    }

    /// Why `call`, sent with message id `id`, is not to be sent: its frame is longer than the
    /// server reads. The server would close the connection at the frame, failing every call
    /// on it; the call fails here instead, as for [`over_attachment_limits`](Self::over_attachment_limits).
    pub(super) fn over_frame_limit(&self, call: &crate::Call, id: u64) -> Option<RpcError> {
        let len = crate::encode::invoke_frame_len(&call.fields(id));
        let max = self.limits.frame_length;
        (len > max).then(|| {
            self.refusal(
                call,
                &format!(
                    "a frame of {len} bytes, over the server's limit of {max} (max_frame_length)"
                ),
                "send smaller arguments, or call a server with a larger max_frame_length",
            )
        })
    }

    /// Why a stream item of `len` bytes on stream `id` is not to be sent: its frame is longer
    /// than the server reads (as for a call, the server would close the connection).
    pub(super) fn item_over_frame_limit(
        &self,
        id: u64,
        len: usize,
        compression: i32,
    ) -> Option<RpcError> {
        let frame = crate::encode::item_frame_len(id, len, compression);
        let max = self.limits.frame_length;
        (frame > max).then(|| {
            RpcError::new(
                StatusCode::ValidateError,
                format!(
                    "{}: a stream item of {len} bytes makes a frame of {frame} bytes, over the \
                     server's limit of {max} (max_frame_length); it was not sent: send smaller \
                     items",
                    self.peer
                ),
            )
        })
    }

    /// A validation error: the call's own fault. Nothing was sent, and this endpoint will
    /// never take the call as it is: like an endpoint that cannot stream, it says nothing of
    /// the endpoint's health (no breaker, health or outlier count) and the call may go on to
    /// another endpoint, whose server may take more.
    fn refusal(&self, call: &crate::Call, why: &str, what_to_do: &str) -> RpcError {
        RpcError::new(
            StatusCode::ValidateError,
            format!(
                "{}: the call to {} carries {why}; it was not sent: {what_to_do}",
                self.peer, call.service_entry_id
            ),
        )
        .unsupported_by_endpoint(true)
    }

    /// What of `call`'s attachments is over the server's limits, if anything.
    fn attachments_over(&self, call: &crate::Call) -> Option<String> {
        let ServerLimits {
            attachments: count,
            attachment_bytes: bytes,
            ..
        } = self.limits;
        if count.is_none() && bytes.is_none() {
            return None;
        }
        // The retry depth goes as an attachment of its own key, over any entry of that key,
        // which the server takes apart before it counts the attachments against its limits:
        // neither its entry nor one it replaces counts.
        let depth = call.retry_depth != 0;
        let replaced = depth && call.attachments.contains_key(rpc_core::RETRY_DEPTH_KEY);
        let n = call.attachments.len() - usize::from(replaced);
        match count {
            Some(count) if n > count => Some(format!(
                "{n} attachments, over the server's limit of {count}"
            )),
            _ => {
                let bytes = bytes?;
                let size: usize = call
                    .attachments
                    .iter()
                    .filter(|(k, _)| !depth || k.as_str() != rpc_core::RETRY_DEPTH_KEY)
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>();
                (size > bytes).then(|| {
                    format!("attachments of {size} bytes, over the server's limit of {bytes}")
                })
            }
        }
    }
}

impl Shared {
    /// Why the connection took no new call: retired by this client (its endpoint left the
    /// registry), which says nothing of the endpoint's health and lets the call go elsewhere
    /// (as not sent, by an endpoint that cannot serve it); else closed.
    pub(super) fn takes_no_call_error(&self) -> RpcError {
        if self.retired.load(Ordering::SeqCst) {
            return comm_error(
                &self.peer,
                "the call was not sent: the endpoint left the registry, and its connection \
                 takes no new calls",
            )
            .unsupported_by_endpoint(true);
        }
        comm_error(&self.peer, "connection closed")
    }
}

pub(super) fn comm_error(peer: &str, what: impl std::fmt::Display) -> RpcError {
    RpcError::new(StatusCode::CommunicationError, format!("{peer}: {what}"))
}
