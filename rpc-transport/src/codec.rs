//! The frame codec: a 4-byte big-endian length, then one protobuf `Frame`.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use rpc_core::wire::{frame::Kind, Frame};
use tokio_util::codec::{Decoder, Encoder};

use crate::decode::decode_incoming;
use crate::encode::put_call_frame;
pub(crate) use crate::encode::PREFIX;
use crate::invoke::Incoming;

/// Why a frame could not be read or written. (Non-exhaustive: a new way a frame can be
/// refused is not a breaking change.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The socket failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The length prefix announced more than the configured maximum; nothing was buffered.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// The announced length.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The payload was not a valid protobuf `Frame`.
    #[error("malformed frame: {0}")]
    Malformed(#[from] prost::DecodeError),
    /// The frame was valid protobuf but held no message.
    #[error("malformed frame: empty `Frame`")]
    Empty,
    /// One repeated field of the frame's message held more entries than any frame of the
    /// protocol needs; refused before decoding, which would allocate many times the frame's
    /// length for them.
    #[error("malformed frame: field {field} holds more than {max} entries")]
    TooManyEntries {
        /// The field's number in the message.
        field: u64,
        /// The most entries a field may hold.
        max: usize,
    },
    /// A field of the frame, or of its message, was a group (protobuf wire type 3 or 4), which
    /// no message of the protocol has: prost would step over it and decode the rest, past the
    /// bound on entries.
    #[error("malformed frame: field {field} is a group, which no message of the protocol has")]
    Group {
        /// The field's number.
        field: u64,
    },
}

/// Encodes and decodes frames; [`Decoder::decode`] returns the frame's `kind`.
///
/// The length prefix is checked against the maximum before any of the payload is buffered, so a
/// peer announcing a huge frame costs four bytes of memory.
#[derive(Debug, Clone)]
pub struct FrameCodec {
    max_frame_length: usize,
}

impl FrameCodec {
    /// A codec accepting frames up to `max_frame_length` bytes (the N of the prefix).
    pub fn new(max_frame_length: usize) -> Self {
        FrameCodec { max_frame_length }
    }

    /// Appends one frame holding `kind` to `dst`.
    pub fn encode_kind(kind: Kind, dst: &mut BytesMut) {
        if put_call_frame(&kind, dst) {
            return;
        }
        let frame = Frame { kind: Some(kind) };
        let len = frame.encoded_len();
        dst.reserve(PREFIX + len);
        // `len` never exceeds u32::MAX for messages this process builds: parameters are bounded
        // by memory far below 4 GiB in practice, and the peer rejects frames above its maximum.
        dst.put_u32(len as u32);
        // Cannot fail: capacity was reserved above.
        let _ = frame.encode(dst);
    }
}

impl Decoder for FrameCodec {
    type Item = Kind;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Kind>, FrameError> {
        let Some(payload) = self.split_frame(src)? else {
            return Ok(None);
        };
        crate::entries::check(&payload)?;
        let frame = Frame::decode(payload)?;
        frame.kind.map(Some).ok_or(FrameError::Empty)
    }
}

impl FrameCodec {
    /// The payload of the next complete frame in `src`, taken out of it; `None` while the
    /// frame is incomplete (room for it is reserved). A length above the maximum is refused
    /// before anything is buffered.
    pub(crate) fn split_frame(&self, src: &mut BytesMut) -> Result<Option<Bytes>, FrameError> {
        if src.len() < PREFIX {
            return Ok(None);
        }
        let len = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if len > self.max_frame_length {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame_length,
            });
        }
        if src.len() < PREFIX + len {
            src.reserve(PREFIX + len - src.len());
            return Ok(None);
        }
        src.advance(PREFIX);
        Ok(Some(src.split_to(len).freeze()))
    }

    /// Like [`Decoder::decode`], for the server: a call comes as an [`Invoke`] whose entry id
    /// shares the frame's buffer.
    pub(crate) fn decode_incoming(
        &self,
        src: &mut BytesMut,
    ) -> Result<Option<Incoming>, FrameError> {
        match self.split_frame(src)? {
            Some(payload) => decode_incoming(payload)?.map(Some).ok_or(FrameError::Empty),
            None => Ok(None),
        }
    }
}

impl Encoder<Kind> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, kind: Kind, dst: &mut BytesMut) -> Result<(), FrameError> {
        Self::encode_kind(kind, dst);
        Ok(())
    }
}

/// The name of a frame kind, for errors and logs.
pub(crate) fn kind_name(kind: &Kind) -> &'static str {
    match kind {
        Kind::Hello(_) => "Hello",
        Kind::HelloAck(_) => "HelloAck",
        Kind::Invoke(_) => "RemoteInvokeMessage",
        Kind::Result(_) => "RemoteResultMessage",
        Kind::Cancel(_) => "Cancel",
        Kind::Ping(_) => "Ping",
        Kind::Pong(_) => "Pong",
        Kind::GoAway(_) => "GoAway",
        Kind::StreamItem(_) => "StreamItem",
        Kind::StreamEnd(_) => "StreamEnd",
        Kind::StreamCredit(_) => "StreamCredit",
        Kind::StreamItems(_) => "StreamItems",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpc_core::wire::{Ping, RemoteInvokeMessage};

    #[test]
    fn round_trip_and_partial_input() {
        let mut buf = BytesMut::new();
        FrameCodec::encode_kind(Kind::Ping(Ping { nonce: 7 }), &mut buf);
        FrameCodec::encode_kind(
            Kind::Invoke(RemoteInvokeMessage {
                message_id: 9,
                service_entry_id: "a.A.m".into(),
                parameters: bytes::Bytes::from_static(&[0x90]),
                ..Default::default()
            }),
            &mut buf,
        );
        assert_eq!(
            u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize,
            4,
            "a Frame holding Ping(7) is 4 bytes"
        );
        let mut codec = FrameCodec::new(1024);
        let mut partial = buf.split_to(3);
        assert!(codec.decode(&mut partial).unwrap().is_none());
        partial.unsplit(buf);
        assert_eq!(
            codec.decode(&mut partial).unwrap(),
            Some(Kind::Ping(Ping { nonce: 7 }))
        );
        match codec.decode(&mut partial).unwrap() {
            Some(Kind::Invoke(m)) => {
                assert_eq!((m.message_id, &m.parameters[..]), (9, &[0x90][..]))
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(partial.is_empty());
    }

    #[test]
    fn oversized_prefix_is_refused_before_buffering() {
        let mut codec = FrameCodec::new(16);
        let mut buf = BytesMut::from(&[0u8, 0, 0, 17][..]);
        match codec.decode(&mut buf) {
            Err(FrameError::TooLarge { len: 17, max: 16 }) => {}
            other => panic!("unexpected {other:?}"),
        }
        assert!(buf.capacity() < 1024);
    }

    #[test]
    fn garbage_is_malformed() {
        let mut codec = FrameCodec::new(1024);
        let mut buf = BytesMut::from(&[0u8, 0, 0, 3, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::Malformed(_))
        ));
        let mut empty = BytesMut::from(&[0u8, 0, 0, 0][..]);
        assert!(matches!(codec.decode(&mut empty), Err(FrameError::Empty)));
    }
}
