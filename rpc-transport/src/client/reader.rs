//! The read loop: hands each answer to the call waiting for it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::StreamExt;
use rpc_core::wire::{frame::Kind, Cancel, Ping, Pong};
use rpc_core::{RpcError, StatusCode};
use tokio::io::AsyncRead;
use tokio_util::codec::{Decoder, FramedRead};

use super::answer::AnswerCodec;
use super::shared::{comm_error, Shared};
use crate::codec::{kind_name, FrameError};

pub(super) async fn read_loop<R: AsyncRead + Unpin>(
    mut frames: FramedRead<R, AnswerCodec>,
    shared: Arc<Shared>,
    received: Arc<AtomicU64>,
) {
    let mut clean_drain = true;
    let closing = shared.close.cancelled();
    tokio::pin!(closing);
    let reason = loop {
        // Answers already read are handed out before the close signal is polled again.
        let next = match buffered(&mut frames) {
            Some(frame) => Some(frame),
            None => tokio::select! {
                biased;
                _ = &mut closing => break "connection closed".to_string(),
                f = frames.next() => f,
            },
        };
        received.fetch_add(1, Ordering::Relaxed);
        match next {
            Some(Ok(Kind::Result(result))) => {
                // An answer to a cancelled call matches no waiting call: ignored, as the
                // protocol says.
                shared.pending.complete(result.message_id, result);
            }
            Some(Ok(Kind::StreamItem(item))) => {
                // Items of a stream that ended or was given up are dropped.
                if let Some(stream) = shared.pending.stream(item.message_id) {
                    let payload =
                        match crate::compression::unpack_item(&item, shared.max_frame_length) {
                            Ok(payload) => payload,
                            Err(e) => {
                                // A corrupt item ends its stream (only), the server told to stop.
                                let e = RpcError::new(
                                    StatusCode::FrameworkError,
                                    format!("{}: {e}; the stream was ended", shared.peer),
                                );
                                if let Some(w) = stream.end(Err(e)) {
                                    w.wake();
                                }
                                if shared.pending.remove(item.message_id) {
                                    shared.sender.send(Kind::Cancel(Cancel {
                                        message_id: item.message_id,
                                    }));
                                }
                                continue;
                            }
                        };
                    if !stream.push(payload) {
                        // Beyond the credit given: this stream (only) ends.
                        let violation = RpcError::new(
                            StatusCode::FrameworkError,
                            format!(
                                "{}: protocol violation: the server sent more stream items than \
                                 it was granted; the stream was ended",
                                shared.peer
                            ),
                        );
                        if let Some(w) = stream.end(Err(violation)) {
                            w.wake();
                        }
                        if shared.pending.remove(item.message_id) {
                            shared.sender.send(Kind::Cancel(Cancel {
                                message_id: item.message_id,
                            }));
                        }
                    }
                }
            }
            Some(Ok(Kind::StreamCredit(credit))) => {
                if let Some(stream) = shared.pending.stream(credit.message_id) {
                    stream.credit(credit.items);
                }
            }
            Some(Ok(Kind::Ping(Ping { nonce }))) => {
                shared.sender.send(Kind::Pong(Pong { nonce }));
            }
            Some(Ok(Kind::Pong(_))) => {}
            Some(Ok(Kind::GoAway(g))) => {
                if g.status_code != StatusCode::Success.as_u32() {
                    clean_drain = false;
                    break format!("server closed the connection: {}", g.reason);
                }
                shared.going_away.store(true, Ordering::Relaxed);
                tracing::debug!(peer = %shared.peer, reason = %g.reason, "server is draining");
                if shared.pending.waiting() == 0 {
                    break "server is draining".to_string();
                }
            }
            Some(Ok(other)) => {
                clean_drain = false;
                break format!(
                    "protocol violation: unexpected {} from the server",
                    kind_name(&other)
                );
            }
            Some(Err(e)) => {
                clean_drain = false;
                break format!("bad frame from the server: {e}");
            }
            None => break "connection closed by the server".to_string(),
        }
        if shared.going_away.load(Ordering::Relaxed) && shared.pending.waiting() == 0 {
            break "server is draining".to_string();
        }
    };
    shared.closed.store(true, Ordering::Release);
    shared.close.cancel();
    // A draining server (GoAway 200) answers every call it read, even those it drops at its
    // drain deadline: calls still pending now never reached it and may safely go elsewhere.
    let maybe_delivered = !(clean_drain && shared.going_away.load(Ordering::Relaxed));
    fail_pending(&shared, &reason, maybe_delivered);
}

pub(super) fn fail_pending(shared: &Shared, reason: &str, maybe_delivered: bool) {
    shared
        .pending
        .fail_all(|| comm_error(&shared.peer, reason).maybe_delivered(maybe_delivered));
}

/// The next complete frame already in `frames`' read buffer, decoded without reading from the
/// socket; `None` when the buffer holds no complete frame.
fn buffered<R>(frames: &mut FramedRead<R, AnswerCodec>) -> Option<Result<Kind, FrameError>> {
    // The codec is stateless (its limit only), so a copy decodes as well as the original.
    let mut codec = frames.decoder().clone();
    codec.decode(frames.read_buffer_mut()).transpose()
}
