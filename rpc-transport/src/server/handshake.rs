//! The handshake: `Hello` within the handshake timeout, the protocol version, the token
//! compared by digest in constant time.

use futures_util::StreamExt;
use rpc_core::wire::{frame::Kind, HelloAck};
use rpc_core::{StatusCode, PROTOCOL_VERSION};
use tokio::io::AsyncRead;
use tokio::time::Instant;
use tokio_util::codec::FramedRead;

use super::options::{ServerOptions, MAX_CLIENT_ID, MAX_STREAM_WINDOW};
use crate::codec::kind_name;
use crate::codec::FrameCodec;
use crate::compression::Accepted;
use crate::writer::FrameSender;

/// Whether `given` is the `expected` token ([`rpc_core::token::same`]: digests compared in
/// constant time).
pub(super) fn token_matches(expected: &str, given: &str) -> bool {
    rpc_core::token::same(given, expected)
}

/// What the handshake established about the client.
pub(super) struct Hello {
    pub(super) client_id: String,
    /// The client's `stream_window` (at least 1) when it can stream; `None` when it cannot:
    /// it is sent no stream frame.
    pub(super) stream_window: Option<u32>,
    /// The client's `stream_window_bytes` when the server keeps byte windows (its own
    /// `stream_window_bytes` is above 0); 0: items only.
    pub(super) stream_window_bytes: u64,
    /// The client takes `StreamItems` frames.
    pub(super) stream_batches: bool,
    /// The compression algorithms the client decodes (its `accept_compression`).
    pub(super) accept_compression: Accepted,
}

/// Reads `Hello` (by `hello_by`: `handshake_timeout` after the accept, TLS included) and answers
/// `HelloAck` (listing the compression algorithms the server decodes), or says why the client
/// is refused. Returns what the client's `Hello` said.
pub(super) async fn handshake<R: AsyncRead + Unpin>(
    frames: &mut FramedRead<R, FrameCodec>,
    sender: &FrameSender,
    options: &ServerOptions,
    hello_by: Instant,
) -> Result<Hello, (StatusCode, String)> {
    let first = tokio::time::timeout_at(hello_by, frames.next())
        .await
        .map_err(|_| {
            (
                StatusCode::Timeout,
                format!(
                    "no Hello within {} ms",
                    options.handshake_timeout.as_millis()
                ),
            )
        })?;
    let hello = match first {
        Some(Ok(Kind::Hello(h))) => h,
        Some(Ok(other)) => {
            return Err((
                StatusCode::FrameworkError,
                format!("the first frame must be Hello, got {}", kind_name(&other)),
            ))
        }
        Some(Err(crate::FrameError::TooLarge { len, max })) => {
            return Err((
                StatusCode::FrameworkError,
                format!(
                    "a frame of {len} bytes before the handshake exceeds the limit of {max} bytes \
                     for the first frame, which must be Hello: send Hello first, with a token and \
                     client id that fit"
                ),
            ))
        }
        Some(Err(e)) => return Err((StatusCode::FrameworkError, e.to_string())),
        None => return Err((StatusCode::FrameworkError, "closed before Hello".into())),
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err((
            StatusCode::FrameworkError,
            format!(
                "protocol version {} is not supported; this server speaks {PROTOCOL_VERSION}",
                hello.protocol_version
            ),
        ));
    }
    if hello.client_id.len() > MAX_CLIENT_ID {
        return Err((
            StatusCode::FrameworkError,
            format!(
                "a client id of {} bytes is over the limit of {MAX_CLIENT_ID}: give the client a \
                 shorter one (a name, a pod or process id)",
                hello.client_id.len()
            ),
        ));
    }
    if hello.streams && hello.stream_window > MAX_STREAM_WINDOW {
        return Err((
            StatusCode::FrameworkError,
            format!(
                "a stream window of {} items is over the limit of {MAX_STREAM_WINDOW}: announce \
                 a smaller one",
                hello.stream_window
            ),
        ));
    }
    if let Some(expected) = &options.token {
        if !token_matches(expected, &hello.token) {
            return Err((
                StatusCode::RpcUnAuthentication,
                "authentication failed: the token does not match the server's".into(),
            ));
        }
    }
    sender.send(Kind::HelloAck(HelloAck {
        protocol_version: PROTOCOL_VERSION,
        server_id: options.server_id.clone(),
        max_frame_length: saturate(options.max_frame_length),
        accept_compression: crate::compression::supported_wire(),
        streams: hello.streams,
        stream_window: if hello.streams {
            options.stream_window.max(1)
        } else {
            0
        },
        stream_window_bytes: if hello.streams {
            options.stream_window_bytes
        } else {
            0
        },
        stream_batches: hello.streams && hello.stream_batches,
        max_attachments: Some(saturate(options.max_attachments)),
        max_attachment_bytes: Some(saturate(options.max_attachment_bytes)),
    }));
    Ok(Hello {
        stream_window: hello.streams.then_some(hello.stream_window.max(1)),
        stream_window_bytes: if hello.streams && options.stream_window_bytes > 0 {
            u64::from(hello.stream_window_bytes)
        } else {
            0
        },
        stream_batches: hello.streams && hello.stream_batches,
        accept_compression: Accepted::from_wire(&hello.accept_compression),
        client_id: hello.client_id,
    })
}

/// `n` on the wire: at most `u32::MAX`.
fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}
