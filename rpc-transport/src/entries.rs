//! A bound on the entries of repeated fields in a frame, checked before prost decodes it.
//!
//! The frame length limit bounds what a peer makes this side buffer, but not what decoding
//! allocates: prost gives each entry of a repeated field a value of its own, and an empty
//! entry costs two bytes on the wire. A result frame of empty `validate_errors` entries
//! allocates 48 bytes per two bytes read (a 16 MiB frame, 384 MiB), a `StreamItems` frame of
//! empty payloads 32 bytes per two. No frame of the protocol needs more entries of one field
//! than a stream's largest window of items, so a frame holding more is refused as malformed
//! before anything is allocated for it; the scan reads only keys and lengths. The packed
//! repeated scalars (the handshakes' `accept_compression`: 4 bytes a value per byte read) count
//! a value per byte of their body, which holds at least that many. A field of the frame or of
//! its message that is a group (wire types 3 and 4), which no message of the protocol has, is
//! refused: prost would step over it and decode what follows, which this scan would not have
//! counted. (Deeper, in an entry of a repeated field, a group is one entry counted, and prost
//! skips it allocating nothing.)

use bytes::Buf;
use prost::encoding::decode_varint;

use crate::codec::FrameError;

/// The most entries one repeated field of a frame's message may hold: the largest stream
/// window (`MAX_STREAM_WINDOW` items, the most a `StreamItems` frame may carry).
pub(crate) const MAX_ENTRIES: usize = 1 << 16;

/// Field numbers counted; a higher one is unknown to this protocol's messages, and prost
/// skips it without allocating.
const COUNTED: usize = 64;

/// The numbers of `Frame`'s `kind` fields (`proto/rpc.proto`): the messages a frame holds.
/// Any other field of a frame is unknown to this protocol, and prost skips it unread.
const KINDS: std::ops::RangeInclusive<u64> = 1..=12;

/// The packed repeated scalar fields, as (frame kind, field): `Hello.accept_compression` and
/// `HelloAck.accept_compression` (`proto/rpc.proto`).
const PACKED: [(u64, u64); 2] = [(1, 4), (2, 4)];

/// Checks that no field of the message inside `payload` (a `Frame`, whose one field is the
/// message) holds more than [`MAX_ENTRIES`] entries, and that no field is a group. A payload
/// otherwise not well-formed passes: prost reports it.
pub(crate) fn check(payload: &[u8]) -> Result<(), FrameError> {
    let mut buf = payload;
    // One count for the whole frame: prost merges a message given more than once, its
    // repeated fields appended, so each occurrence's entries add up.
    let mut counts = [0usize; COUNTED];
    while buf.has_remaining() {
        let Ok(key) = decode_varint(&mut buf) else {
            return Ok(());
        };
        match key & 7 {
            2 => {
                let Some(body) = delimited(&mut buf) else {
                    return Ok(());
                };
                if KINDS.contains(&(key >> 3)) {
                    check_message(key >> 3, body, &mut counts)?;
                }
            }
            _ => {
                if skip(key, &mut buf)?.is_none() {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// [`check`] for one occurrence of a frame's message (of `kind`), counting into `counts`.
fn check_message(
    kind: u64,
    mut buf: &[u8],
    counts: &mut [usize; COUNTED],
) -> Result<(), FrameError> {
    while buf.has_remaining() {
        let Ok(key) = decode_varint(&mut buf) else {
            return Ok(());
        };
        let before = buf.len();
        if skip(key, &mut buf)?.is_none() {
            return Ok(());
        }
        // A packed field holds at most a value per byte of its body (its length's bytes
        // counted too: a bound, not a count).
        let entries = match PACKED.contains(&(kind, key >> 3)) && key & 7 == 2 {
            true => before - buf.len(),
            false => 1,
        };
        let field = usize::try_from(key >> 3).unwrap_or(usize::MAX);
        if let Some(n) = counts.get_mut(field) {
            *n += entries;
            if *n > MAX_ENTRIES {
                return Err(FrameError::TooManyEntries {
                    field: key >> 3,
                    max: MAX_ENTRIES,
                });
            }
        }
    }
    Ok(())
}

/// Skips the value of a field of `key`; `Ok(None)` when it runs past the end or its wire
/// type is none protobuf defines, an error for a group.
fn skip(key: u64, buf: &mut &[u8]) -> Result<Option<()>, FrameError> {
    Ok(match key & 7 {
        0 => decode_varint(buf).ok().map(drop),
        1 => (buf.len() >= 8).then(|| buf.advance(8)),
        2 => delimited(buf).map(drop),
        3 | 4 => return Err(FrameError::Group { field: key >> 3 }),
        5 => (buf.len() >= 4).then(|| buf.advance(4)),
        _ => None,
    })
}

/// A length-delimited value, taken off `buf`.
fn delimited<'a>(buf: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = usize::try_from(decode_varint(buf).ok()?).ok()?;
    if len > buf.len() {
        return None;
    }
    let (value, rest) = buf.split_at(len);
    *buf = rest;
    Some(value)
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use rpc_core::wire::{frame::Kind, Frame, RemoteResultMessage, StreamItems, ValidateError};

    use super::*;

    fn encoded(kind: Kind) -> Vec<u8> {
        Frame { kind: Some(kind) }.encode_to_vec()
    }

    /// A result of `n` empty validation errors, and a stream frame of `n` empty items.
    fn frames(n: usize) -> [Vec<u8>; 2] {
        [
            encoded(Kind::Result(RemoteResultMessage {
                validate_errors: vec![ValidateError::default(); n],
                ..Default::default()
            })),
            encoded(Kind::StreamItems(StreamItems {
                message_id: 1,
                payloads: vec![bytes::Bytes::new(); n],
                ..Default::default()
            })),
        ]
    }

    /// Up to the bound, frames pass; one entry more is refused, naming the field and the
    /// bound, the count taken from the frames as prost encodes them.
    #[test]
    fn a_repeated_field_past_the_bound_is_refused() {
        for frame in frames(MAX_ENTRIES) {
            check(&frame).expect("at the bound");
        }
        let [result, items] = frames(MAX_ENTRIES + 1);
        for (frame, field) in [(result, 5), (items, 2)] {
            match check(&frame) {
                Err(FrameError::TooManyEntries { field: f, max }) => {
                    assert_eq!((f, max), (field, MAX_ENTRIES));
                }
                other => panic!("field {field}: {other:?}"),
            }
        }
    }

    /// A message given twice in one frame, each within the bound, is refused when together
    /// they pass it: prost merges them, appending the repeated fields.
    #[test]
    fn a_message_given_twice_counts_its_entries_together() {
        let [half, _] = frames(MAX_ENTRIES / 2 + 1);
        check(&half).expect("within the bound");
        let twice = [half.clone(), half].concat();
        assert!(matches!(
            check(&twice),
            Err(FrameError::TooManyEntries { field: 5, .. })
        ));
        let merged = Frame::decode(&twice[..]).expect("prost merges them");
        let Some(Kind::Result(r)) = merged.kind else {
            panic!("a result")
        };
        assert_eq!(
            r.validate_errors.len(),
            MAX_ENTRIES + 2,
            "what prost would build"
        );
    }

    /// A field of a frame that is not one of its messages is not read: prost skips it.
    #[test]
    fn an_unknown_field_of_a_frame_is_not_read() {
        let mut frame = vec![0x82, 0x01]; // field 16, length-delimited
        let body = [0x08, 0x00].repeat(MAX_ENTRIES + 1);
        prost::encoding::encode_varint(body.len() as u64, &mut frame);
        frame.extend_from_slice(&body);
        check(&frame).expect("not read");
        assert!(Frame::decode(&frame[..]).is_ok(), "prost skips it too");
    }

    /// A frame that is not well-formed is left to prost, which reports it.
    #[test]
    fn a_malformed_frame_passes_to_prost() {
        for bad in [&[0x1a, 0x05, 0x08][..], &[0xff][..], &[0x1f][..]] {
            check(bad).expect("left to prost");
        }
    }

    /// A group before the entries, in the frame or in its message, is refused: prost steps
    /// over an empty group and decodes every entry after it (a frame of empty items behind
    /// one would pass the bound, and allocate 16 times its length).
    #[test]
    fn a_group_is_refused_where_prost_would_step_over_it() {
        let [_, items] = frames(MAX_ENTRIES + 1);
        // Field 13 of the frame, an empty group, then the stream items.
        let behind_a_group = [&[0x6b, 0x6c][..], &items].concat();
        let decoded = Frame::decode(&behind_a_group[..]).expect("prost takes it");
        let Some(Kind::StreamItems(decoded)) = decoded.kind else {
            panic!("stream items")
        };
        assert_eq!(decoded.payloads.len(), MAX_ENTRIES + 1, "what prost builds");
        assert!(matches!(
            check(&behind_a_group),
            Err(FrameError::Group { field: 13 })
        ));
        // Field 7 of the message, an empty group, first in a `StreamItems` (frame field 12).
        let mut frame = vec![0x62];
        let body = [&[0x3b, 0x3c][..], &[0x08, 0x01]].concat();
        prost::encoding::encode_varint(body.len() as u64, &mut frame);
        frame.extend_from_slice(&body);
        assert!(matches!(check(&frame), Err(FrameError::Group { field: 7 })));
    }

    /// The handshakes' packed `accept_compression` counts a value per byte: one longer than
    /// the bound is refused (prost would give each of its 4 bytes a value read).
    #[test]
    fn a_packed_field_counts_its_values() {
        use rpc_core::wire::Hello;
        let hello = |n: usize| {
            encoded(Kind::Hello(Hello {
                accept_compression: vec![1; n],
                ..Default::default()
            }))
        };
        check(&hello(8)).expect("a few");
        assert!(matches!(
            check(&hello(MAX_ENTRIES + 1)),
            Err(FrameError::TooManyEntries { field: 4, .. })
        ));
    }
}
