//! A bound on the entries of repeated fields in a frame, checked before prost decodes it.
//!
//! The frame length limit bounds what a peer makes this side buffer, but not what decoding
//! allocates: prost gives each entry of a repeated field a value of its own, and an empty
//! entry costs two bytes on the wire. A result frame of empty `validate_errors` entries
//! allocates 48 bytes per two bytes read (a 16 MiB frame, 384 MiB), a `StreamItems` frame of
//! empty payloads 32 bytes per two. No frame of the protocol needs more entries of one field
//! than a stream's largest window of items, so a frame holding more is refused as malformed
//! before anything is allocated for it; the scan reads only keys and lengths.

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

/// Checks that no field of the message inside `payload` (a `Frame`, whose one field is the
/// message) appears more than [`MAX_ENTRIES`] times. A payload that is not well-formed passes:
/// prost reports it.
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
                    check_message(body, &mut counts)?;
                }
            }
            _ => {
                if skip(key, &mut buf).is_none() {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// [`check`] for one occurrence of a frame's message, counting into `counts`.
fn check_message(mut buf: &[u8], counts: &mut [usize; COUNTED]) -> Result<(), FrameError> {
    while buf.has_remaining() {
        let Ok(key) = decode_varint(&mut buf) else {
            return Ok(());
        };
        let field = usize::try_from(key >> 3).unwrap_or(usize::MAX);
        if let Some(n) = counts.get_mut(field) {
            *n += 1;
            if *n > MAX_ENTRIES {
                return Err(FrameError::TooManyEntries {
                    field: key >> 3,
                    max: MAX_ENTRIES,
                });
            }
        }
        if skip(key, &mut buf).is_none() {
            return Ok(());
        }
    }
    Ok(())
}

/// Skips the value of a field of `key`; `None` when it runs past the end or its wire type is
/// not one a message of this protocol uses.
fn skip(key: u64, buf: &mut &[u8]) -> Option<()> {
    match key & 7 {
        0 => decode_varint(buf).ok().map(drop),
        1 => (buf.len() >= 8).then(|| buf.advance(8)),
        2 => delimited(buf).map(drop),
        5 => (buf.len() >= 4).then(|| buf.advance(4)),
        _ => None,
    }
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
        for bad in [&[0x1a, 0x05, 0x08][..], &[0xff][..], &[0x1b][..]] {
            check(bad).expect("left to prost");
        }
    }
}
