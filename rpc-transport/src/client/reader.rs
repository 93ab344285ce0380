//! The read loop: hands each answer to the call waiting for it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use rpc_core::wire::{frame::Kind, Cancel, Ping, Pong};
use rpc_core::{RpcError, StatusCode};
use tokio::io::AsyncRead;
use tokio_util::codec::{Decoder, FramedRead};

use super::answer::{Answer, AnswerCodec, ItemRun};
use super::shared::{comm_error, Shared};
use super::stream::{Broken, Chunk, StreamShared};
use crate::codec::{kind_name, FrameError};

/// Ends the connection as the read loop's end does, should the loop's task be dropped before
/// it got there (its runtime shut down, with the connection still shared with another
/// runtime): the calls in flight fail rather than wait for ever, and the pool no longer hands
/// the connection out.
/// (Made before the loop's task is spawned, and handed to it: a task dropped before its
/// first poll drops it too.)
pub(super) struct EndOnDrop {
    shared: Arc<Shared>,
    armed: bool,
}

impl EndOnDrop {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        EndOnDrop {
            shared,
            armed: true,
        }
    }
}

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        if self.armed {
            end(
                &self.shared,
                "the connection's reader stopped (its runtime shut down)",
                true,
            );
        }
    }
}

pub(super) async fn read_loop<R: AsyncRead + Unpin>(
    mut frames: FramedRead<R, AnswerCodec>,
    shared: Arc<Shared>,
    received: Arc<AtomicU64>,
    mut on_drop: EndOnDrop,
) {
    // The server said it reads no more, every call it read answered (a `GoAway` 200 with
    // `last`): calls unanswered at the end never reached it.
    let mut read_all = false;
    let closing = shared.close.cancelled();
    tokio::pin!(closing);
    let reason = loop {
        // Answers already read are handed out before the close signal is polled again.
        let next = match buffered(&mut frames) {
            Some(frame) => Some(frame),
            None => tokio::select! {
                biased;
                _ = &mut closing => {
                    // Closed by this client (its heartbeat, the pool, `close`): a pending call
                    // may have been read and be running, unless the server's last word came.
                    break shared
                        .close_reason
                        .get()
                        .cloned()
                        .unwrap_or_else(|| "connection closed".to_string());
                }
                f = frames.next() => f,
            },
        };
        received.fetch_add(1, Ordering::Relaxed);
        let next = match next {
            Some(Ok(Answer::Items(run))) => {
                deliver_run(&shared, run);
                continue;
            }
            Some(Ok(Answer::Frame(kind))) => Some(Ok(kind)),
            Some(Err(e)) => Some(Err(e)),
            None => None,
        };
        match next {
            Some(Ok(Kind::Result(result))) => {
                // An answer to a cancelled call matches no waiting call: ignored, as the
                // protocol says.
                shared.pending.complete(result.message_id, result);
            }
            Some(Ok(Kind::StreamItem(item))) => {
                let payloads = std::iter::once(item.payload);
                deliver(&shared, item.message_id, item.compression, payloads);
            }
            Some(Ok(Kind::StreamItems(items))) => {
                deliver(
                    &shared,
                    items.message_id,
                    items.compression,
                    items.payloads.into_iter(),
                );
            }
            Some(Ok(Kind::StreamCredit(credit))) => {
                if let Some(stream) = shared.pending.stream(credit.message_id) {
                    stream.credit(credit.items);
                }
            }
            Some(Ok(Kind::Ping(Ping { nonce }))) => {
                // Answered only while the send queue is within its limit: a pong would wait
                // behind that much the server has not read, and a server that pings and never
                // reads would grow the queue with pongs without end (new calls already wait
                // for room; pongs are read by this loop, which nothing holds back).
                if shared.sender.backlog().bytes() <= shared.max_unsent_bytes {
                    shared.sender.send(Kind::Pong(Pong { nonce }));
                }
            }
            Some(Ok(Kind::Pong(_))) => {}
            Some(Ok(Kind::GoAway(g))) => {
                if g.status_code != StatusCode::Success.as_u32() {
                    // A later word says calls were dropped: it stands over the last one.
                    read_all = false;
                    break format!("server closed the connection: {}", g.reason);
                }
                shared.going_away.store(true, Ordering::Relaxed);
                read_all |= g.last;
                // Calls waiting for room in the send queue are not to be sent now.
                shared.sender.backlog().wake_room_waiters();
                tracing::debug!(peer = %shared.peer, reason = %g.reason, "server is draining");
                if shared.pending.waiting() == 0 {
                    break "server is draining".to_string();
                }
            }
            Some(Ok(other)) => {
                break format!(
                    "protocol violation: unexpected {} from the server",
                    kind_name(&other)
                );
            }
            // The limit is this client's own (the server is not told it): named, with where
            // to raise it.
            Some(Err(FrameError::TooLarge { len, max })) => {
                break format!(
                    "an answer frame of {len} bytes is over this client's max_frame_length of \
                     {max} bytes (ClientBuilder::max_frame_length, \
                     ConnectOptions::max_frame_length): raise it, or ask for smaller answers"
                );
            }
            Some(Err(e)) => {
                break format!("bad frame from the server: {e}");
            }
            None => break "connection closed by the server".to_string(),
        }
        if shared.going_away.load(Ordering::Relaxed) && shared.pending.waiting() == 0 {
            break "server is draining".to_string();
        }
    };
    on_drop.armed = false;
    // A draining server answers every call it read, even those it drops at its drain
    // deadline, and then says so (its last GoAway 200): calls still pending now never reached
    // it and may safely go elsewhere, however the connection ended after that word (this
    // client closing it, a reset). Without that last word (the server was killed mid-drain,
    // even over a socket that closes in order), they may have run.
    let maybe_delivered = !read_all;
    end(&shared, &reason, maybe_delivered);
}

/// The connection's end: no new call is taken, its tasks stop, and the calls pending fail
/// for `reason` (as maybe delivered when `maybe_delivered`, except those never written).
fn end(shared: &Shared, reason: &str, maybe_delivered: bool) {
    shared.closed.store(true, Ordering::Release);
    shared.close.cancel();
    // Calls still queued, never written, did not reach the server however it went.
    let mut unsent = shared.sender.close_unsent();
    unsent.sort_unstable();
    fail_pending(shared, reason, maybe_delivered, &unsent);
}

/// Hands the items of a plain `StreamItems` frame to their stream: left in the frame when
/// plain, else as [`deliver`] does.
fn deliver_run(shared: &Shared, run: ItemRun) {
    if run.compression != 0 {
        let payloads: Vec<Bytes> = (run.places.iter())
            .map(|&(from, to)| run.body.slice(from as usize..to as usize))
            .collect();
        deliver(
            shared,
            run.message_id,
            run.compression,
            payloads.into_iter(),
        );
        return;
    }
    let Some(stream) = shared.pending.stream(run.message_id) else {
        return;
    };
    let id = run.message_id;
    if let Err(broken) = stream.push([Chunk::run(run)]) {
        end_broken(shared, id, &stream, broken);
    }
}

/// Hands one frame's items of stream `id` (compressed with `compression`) to the stream, all
/// at once, as they came: a compressed item is decompressed when it is lent. Items of a stream
/// that ended or was given up are dropped; items beyond the credit given end their stream
/// (only), the server told to stop.
fn deliver(
    shared: &Shared,
    id: u64,
    compression: i32,
    payloads: impl ExactSizeIterator<Item = Bytes>,
) {
    let Some(stream) = shared.pending.stream(id) else {
        return;
    };
    if let Err(broken) = stream.push(payloads.map(|p| Chunk::compressed(p, compression))) {
        end_broken(shared, id, &stream, broken);
    }
}

/// Ends stream `id`, whose items broke the protocol as `broken` says, and tells the server to
/// stop it.
fn end_broken(shared: &Shared, id: u64, stream: &StreamShared, broken: Broken) {
    let end = format!(
        "{}: protocol violation: the server sent {broken}; the stream was ended",
        shared.peer
    );
    if let Some(w) = stream.end(Err(RpcError::new(StatusCode::FrameworkError, end))) {
        w.wake();
    }
    if shared.pending.remove(id) {
        shared.sender.send(Kind::Cancel(Cancel {
            message_id: id,
            ..Default::default()
        }));
    }
}

/// Fails every pending call for `reason`: as maybe delivered when `maybe_delivered`, except
/// the calls in `unsent` (never written; sorted).
pub(super) fn fail_pending(shared: &Shared, reason: &str, maybe_delivered: bool, unsent: &[u64]) {
    shared.pending.fail_all(|id| {
        comm_error(&shared.peer, reason)
            .maybe_delivered(maybe_delivered && unsent.binary_search(&id).is_err())
    });
}

/// The next complete frame already in `frames`' read buffer, decoded without reading from the
/// socket; `None` when the buffer holds no complete frame.
fn buffered<R>(frames: &mut FramedRead<R, AnswerCodec>) -> Option<Result<Answer, FrameError>> {
    // A copy decodes as well as the original (the framing limit is all it needs). The length
    // it records for the heartbeat's progress stays with the copy, which costs nothing: bytes
    // arrive only through the original, which records the length before each read.
    let mut codec = frames.decoder().clone();
    codec.decode(frames.read_buffer_mut()).transpose()
}
