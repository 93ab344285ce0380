//! Direct decoding of the frame every call brings the server: `Frame { invoke }`.
//!
//! prost decodes `RemoteInvokeMessage.service_entry_id` into a `String` of its own, an
//! allocation per call for an id that is only looked up. Here the invoke frame is read in one
//! pass, and the id and the parameters are slices of the frame's buffer. Only the shape every
//! encoder writes is read here (one `invoke` field in the frame, the message's known fields
//! with their wire types, map entries of a key and a value); anything else (unknown fields,
//! repeated oneof fields, malformed input) goes to prost, so the result is always what prost
//! would decode: the unit tests compare both decoders on generated and on mangled frames.

use std::collections::BTreeMap;

use bytes::{Buf, Bytes};
use prost::encoding::decode_varint;
use prost::Message;
use rpc_core::wire::Frame;

use crate::codec::FrameError;
use crate::invoke::{retry_depth_of, Incoming, Invoke, WireStr};
use rpc_core::RETRY_DEPTH_KEY;

/// `Frame.invoke`: field 3, length-delimited.
const FRAME_INVOKE_KEY: u64 = (3 << 3) | 2;

/// Decodes a frame's payload (without its length prefix); `None` for a `Frame` holding no
/// message.
pub(crate) fn decode_incoming(payload: Bytes) -> Result<Option<Incoming>, FrameError> {
    if let Some(invoke) = invoke_frame(&payload) {
        return Ok(Some(Incoming::Invoke(invoke)));
    }
    crate::entries::check(&payload)?;
    Ok(Frame::decode(payload)?.kind.map(Incoming::from))
}

/// The call in `payload` if it is a plain invoke frame; `None` for anything else.
fn invoke_frame(payload: &Bytes) -> Option<Invoke> {
    let mut buf = &payload[..];
    if decode_varint(&mut buf).ok()? != FRAME_INVOKE_KEY {
        return None;
    }
    let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
    if len != buf.remaining() {
        // More fields after the invoke (prost would merge or replace): not the plain shape.
        return None;
    }
    invoke_body(payload, buf)
}

/// Reads a `RemoteInvokeMessage` body: `buf`, the end of `whole`. The entry id and the
/// parameters are located first and sliced out of `whole` once, at the end (a field sent twice
/// replaces the first, as prost does; each occurrence of the id is checked to be UTF-8).
fn invoke_body(whole: &Bytes, mut buf: &[u8]) -> Option<Invoke> {
    let (mut message_id, mut codec, mut timeout_ms, mut compression, mut stream_mode) =
        (0, 0, 0, 0, 0);
    let (mut entry, mut parameters) = (0..0, 0..0);
    let mut attachments = BTreeMap::new();
    let (mut retry_depth, mut entries) = (0, 0);
    while buf.has_remaining() {
        let key = decode_varint(&mut buf).ok()?;
        match key {
            // message_id: uint64
            0x08 => message_id = decode_varint(&mut buf).ok()?,
            // service_entry_id: string
            0x12 => {
                entry = field(whole, &mut buf)?;
                let id = &whole[entry.clone()];
                // Entry ids are ASCII in practice: checked a word at a time first.
                if !id.is_ascii() {
                    std::str::from_utf8(id).ok()?;
                }
            }
            // codec: enum (int32), truncated as prost does
            0x18 => codec = decode_varint(&mut buf).ok()? as i32,
            // parameters: bytes
            0x22 => parameters = field(whole, &mut buf)?,
            // attachments: map<string, string>
            0x2a => {
                // (More is refused on the general path: `entries`.)
                entries += 1;
                if entries > crate::entries::MAX_ENTRIES {
                    return None;
                }
                let entry = field(whole, &mut buf)?;
                let (k, v) = map_entry(&whole[entry])?;
                // The retry depth is kept apart, as `Invoke::from` keeps it from what prost
                // decodes: the last entry of the key decides (as in prost's map).
                if k == RETRY_DEPTH_KEY {
                    attachments.remove(RETRY_DEPTH_KEY);
                    retry_depth = retry_depth_of(v).unwrap_or(0);
                    if retry_depth > 0 {
                        continue;
                    }
                }
                attachments.insert(k.to_string(), v.to_string());
            }
            // timeout_ms: uint32, truncated as prost does
            0x30 => timeout_ms = decode_varint(&mut buf).ok()? as u32,
            // compression: enum (int32), truncated as prost does
            0x50 => compression = decode_varint(&mut buf).ok()? as i32,
            // stream_mode: enum (int32), truncated as prost does
            0x58 => stream_mode = decode_varint(&mut buf).ok()? as i32,
            _ => return None,
        }
    }
    Some(Invoke {
        message_id,
        service_entry_id: WireStr::checked(slice_of(whole, entry)),
        codec,
        parameters: slice_of(whole, parameters),
        attachments,
        retry_depth,
        timeout_ms,
        compression,
        stream_mode,
    })
}

/// The next length-delimited field's place in `whole` (which `buf` is a suffix of).
fn field(whole: &[u8], buf: &mut &[u8]) -> Option<std::ops::Range<usize>> {
    let len = usize::try_from(decode_varint(buf).ok()?).ok()?;
    if len > buf.len() {
        return None;
    }
    let start = whole.len() - buf.len();
    buf.advance(len);
    Some(start..start + len)
}

/// `range` of `whole`, sharing its buffer; an empty range shares nothing.
fn slice_of(whole: &Bytes, range: std::ops::Range<usize>) -> Bytes {
    if range.is_empty() {
        Bytes::new()
    } else {
        whole.slice(range)
    }
}

/// One `map<string, string>` entry: key (field 1) and value (field 2), each at most once.
fn map_entry(entry: &[u8]) -> Option<(&str, &str)> {
    let mut buf = entry;
    let (mut k, mut v) = (None, None);
    while buf.has_remaining() {
        let field = match decode_varint(&mut buf).ok()? {
            0x0a if k.is_none() => &mut k,
            0x12 if v.is_none() => &mut v,
            _ => return None,
        };
        let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
        if len > buf.len() {
            return None;
        }
        *field = Some(std::str::from_utf8(&buf[..len]).ok()?);
        buf.advance(len);
    }
    Some((k.unwrap_or_default(), v.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use rpc_core::wire::{frame::Kind, Ping, RemoteInvokeMessage};

    use super::*;
    use crate::codec::{FrameCodec, FrameError};
    use crate::mutations::payload;

    /// Both decoders on one payload: the same frame, or both an error.
    fn same_as_prost(payload: &[u8]) {
        let ours = decode_incoming(Bytes::copy_from_slice(payload))
            .and_then(|f| f.ok_or(FrameError::Empty));
        let prost = Frame::decode(payload)
            .map_err(FrameError::from)
            .and_then(|f| f.kind.ok_or(FrameError::Empty))
            .map(Incoming::from);
        crate::mutations::agree(payload, ours, prost);
    }

    fn random_invoke(rng: &mut StdRng) -> RemoteInvokeMessage {
        let word = |rng: &mut StdRng, n: usize| -> String {
            (0..rng.random_range(0..n))
                .map(|_| rng.random_range('a'..='z'))
                .collect()
        };
        RemoteInvokeMessage {
            message_id: if rng.random_bool(0.2) {
                0
            } else {
                rng.random()
            },
            service_entry_id: word(rng, 40),
            codec: [0, 1, -1, i32::MAX][rng.random_range(0..4)],
            parameters: (0..rng.random_range(0..300))
                .map(|_| rng.random())
                .collect(),
            attachments: (0..rng.random_range(0..4))
                .map(|_| (word(rng, 8), word(rng, 8)))
                .collect(),
            timeout_ms: if rng.random_bool(0.3) {
                0
            } else {
                rng.random()
            },
            compression: [0, 1, 2, -1][rng.random_range(0..4)],
            stream_mode: [0, 0, 1, 2, 3, 7, -1][rng.random_range(0..7)],
        }
    }

    #[test]
    fn invoke_frames_decode_as_prost_decodes_them() {
        let mut rng = StdRng::seed_from_u64(12);
        for _ in 0..2_000 {
            let m = random_invoke(&mut rng);
            let p = payload(Kind::Invoke(m.clone()));
            assert!(invoke_frame(&Bytes::from(p.clone())).is_some(), "{m:?}");
            same_as_prost(&p);
            match decode_incoming(Bytes::from(p)).expect("decodes") {
                Some(Incoming::Invoke(i)) => assert_eq!(RemoteInvokeMessage::from(i), m),
                other => panic!("expected an invoke, got {other:?}"),
            }
        }
    }

    #[test]
    fn unusual_and_broken_frames_decode_as_prost_decodes_them() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut cases = crate::mutations::cases(
            0x1a,
            |rng| payload(Kind::Invoke(random_invoke(rng))),
            payload(Kind::Ping(Ping { nonce: 3 })),
            &mut rng,
        );
        cases.extend([
            // A map entry with its key twice, and one with an unknown field.
            vec![0x1a, 0x08, 0x2a, 0x06, 0x0a, 0x01, b'a', 0x0a, 0x01, b'b'],
            vec![0x1a, 0x07, 0x2a, 0x05, 0x0a, 0x01, b'a', 0x18, 0x01],
            // An entry id that is not UTF-8, and a truncated body.
            vec![0x1a, 0x04, 0x12, 0x02, 0xff, 0xfe],
            vec![0x1a, 0x05, 0x12, 0x09, b'a'],
        ]);
        for c in &cases {
            same_as_prost(c);
        }
    }

    /// An invoke frame's payload with the attachment entries `entries`, in this order (which
    /// a map would not keep, nor a key twice).
    fn with_entries(entries: &[(&str, &str)]) -> Vec<u8> {
        let pair = |tag: u8, s: &str| {
            let mut out = vec![tag, s.len() as u8];
            out.extend_from_slice(s.as_bytes());
            out
        };
        let mut body = Vec::new();
        for (k, v) in entries {
            let entry = [pair(0x0a, k), pair(0x12, v)].concat();
            body.extend([0x2a, entry.len() as u8]);
            body.extend(entry);
        }
        [vec![0x1a, body.len() as u8], body].concat()
    }

    /// Attachment entries in frame order, the retry depth they give, and what stays in the map
    /// under its key.
    type Case<'a> = (&'a [(&'a str, &'a str)], u32, Option<&'a str>);

    #[test]
    fn the_retry_depth_is_read_apart_from_the_attachments_as_prost_would_read_it() {
        let key = RETRY_DEPTH_KEY;
        let cases: [Case; 9] = [
            (&[(key, "1")], 1, None),
            (&[(key, "4294967295"), ("a", "b")], u32::MAX, None),
            (&[(key, "0")], 0, Some("0")),
            (&[(key, "x")], 0, Some("x")),
            (&[(key, "4294967296")], 0, Some("4294967296")),
            (&[(key, "")], 0, Some("")),
            // A key twice: the last one decides, as in prost's map.
            (&[(key, "3"), (key, "x")], 0, Some("x")),
            (&[(key, "x"), (key, "3")], 3, None),
            (&[(key, "3"), (key, "5")], 5, None),
        ];
        for (entries, depth, left) in cases {
            let p = with_entries(entries);
            same_as_prost(&p);
            let Ok(Some(Incoming::Invoke(i))) = decode_incoming(Bytes::from(p)) else {
                panic!("{entries:?}: expected an invoke")
            };
            assert_eq!(i.retry_depth, depth, "{entries:?}");
            assert_eq!(
                i.attachments.get(key).map(String::as_str),
                left,
                "{entries:?}"
            );
            assert_eq!(
                i.attachments.get("a").map(String::as_str),
                entries.iter().find(|(k, _)| *k == "a").map(|(_, v)| *v),
                "{entries:?}"
            );
        }
    }

    #[test]
    fn a_call_carrying_only_its_retry_depth_decodes_with_no_allocation() {
        let p = Bytes::from(with_entries(&[(RETRY_DEPTH_KEY, "2")]));
        let before = crate::alloc_count::this_thread();
        let decoded = decode_incoming(p);
        assert_eq!(crate::alloc_count::this_thread() - before, 0);
        let Ok(Some(Incoming::Invoke(i))) = decoded else {
            panic!("expected an invoke")
        };
        assert_eq!((i.retry_depth, i.attachments.len()), (2, 0));
    }

    #[test]
    fn the_entry_id_shares_the_frame_buffer() {
        let m = RemoteInvokeMessage {
            message_id: 1,
            service_entry_id: "echo.Echo.echo".into(),
            ..Default::default()
        };
        // As the server's reader hands it over: split off its read buffer.
        let mut buf = BytesMut::new();
        FrameCodec::encode_kind(Kind::Invoke(m), &mut buf);
        let p = FrameCodec::new(1024)
            .split_frame(&mut buf)
            .expect("a frame")
            .expect("complete");
        let before = crate::alloc_count::this_thread();
        let decoded = decode_incoming(p.clone());
        assert_eq!(
            crate::alloc_count::this_thread() - before,
            0,
            "no allocation for a call without attachments"
        );
        let Ok(Some(Incoming::Invoke(i))) = decoded else {
            panic!("expected an invoke")
        };
        assert_eq!(&*i.service_entry_id, "echo.Echo.echo");
        let id = i.service_entry_id.as_str().as_ptr() as usize;
        let range = p.as_ptr() as usize..p.as_ptr() as usize + p.len();
        assert!(range.contains(&id), "the id points into the frame");
    }
}
