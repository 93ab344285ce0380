//! Direct encoding of the two frames every call sends: `Frame { invoke }` and `Frame { result }`.
//!
//! prost encodes a nested message by asking for its length, then encoding it, which asks every
//! nested part for its length again; for a call frame that walk was most of the encoding cost.
//! Here each length is computed once and the fields are written in one pass. The output is
//! byte for byte what prost writes (fields in tag order, default scalars and empty strings
//! left out, map entries in key order with empty keys and values left out), but for a call's
//! retry depth, whose attachment entry is written after the others whatever its key (the same
//! message once decoded; a map's order carries nothing): the unit tests
//! compare both encoders on generated messages, and the `frame` fuzz target compares them on
//! every frame it decodes. Stream items, which a producer writes many of, are encoded here
//! too; other frame kinds are rare and go through prost.

use std::collections::BTreeMap;

use bytes::{BufMut, Bytes, BytesMut};
// prost's varint helpers, the ones its derived code calls.
use prost::encoding::{encode_varint, encoded_len_varint};
use rpc_core::wire::{frame::Kind, RemoteInvokeMessage, RemoteResultMessage, ValidateError};
use rpc_core::RETRY_DEPTH_KEY;

/// Bytes of a frame's length prefix (a big-endian `u32`).
pub(crate) const PREFIX: usize = 4;

/// Protobuf wire types used here.
const VARINT: u32 = 0;
const LEN: u32 = 2;

/// Field numbers of `Frame.kind`'s two call variants and its stream items.
const FRAME_INVOKE: u32 = 3;
const FRAME_RESULT: u32 = 4;
const FRAME_STREAM_ITEM: u32 = 9;
const FRAME_STREAM_ITEMS: u32 = 12;

/// Every field number here is below 16, so a key is one byte.
fn put_key(tag: u32, wire_type: u32, dst: &mut impl BufMut) {
    debug_assert!(tag < 16);
    dst.put_u8(((tag << 3) | wire_type) as u8);
}

/// Length of a varint field (left out when zero).
fn varint_len(value: u64) -> usize {
    if value == 0 {
        0
    } else {
        1 + encoded_len_varint(value)
    }
}

fn put_varint(tag: u32, value: u64, dst: &mut impl BufMut) {
    if value != 0 {
        put_key(tag, VARINT, dst);
        encode_varint(value, dst);
    }
}

/// Length of a `bytes` or `string` field holding `n` bytes (left out when empty).
fn bytes_len(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        nested_len(n)
    }
}

fn put_bytes(tag: u32, value: &[u8], dst: &mut impl BufMut) {
    if !value.is_empty() {
        put_key(tag, LEN, dst);
        encode_varint(value.len() as u64, dst);
        dst.put_slice(value);
    }
}

/// Length of an always-present length-delimited field whose body is `n` bytes: a oneof
/// variant, an element of a repeated message field, a map entry.
pub(crate) fn nested_len(n: usize) -> usize {
    1 + encoded_len_varint(n as u64) + n
}

fn pair_len(a: &str, b: &str) -> usize {
    bytes_len(a.len()) + bytes_len(b.len())
}

fn put_pair(tag: u32, a: &str, b: &str, dst: &mut impl BufMut) {
    put_key(tag, LEN, dst);
    encode_varint(pair_len(a, b) as u64, dst);
    put_bytes(1, a.as_bytes(), dst);
    put_bytes(2, b.as_bytes(), dst);
}

fn map_len(map: &BTreeMap<String, String>) -> usize {
    map.iter().map(|(k, v)| nested_len(pair_len(k, v))).sum()
}

/// `n` in decimal, written into `buf`: the value of a number sent as an attachment, with no
/// `String` of its own.
fn decimal(mut n: u32, buf: &mut [u8; 10]) -> &str {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    std::str::from_utf8(&buf[at..]).unwrap_or("0")
}

/// The attachments of a call: its map, and its retry depth (when not 0) as the
/// [`RETRY_DEPTH_KEY`] entry, which wins over one of that key in the map.
struct Attachments<'a> {
    map: &'a BTreeMap<String, String>,
    retry_depth: u32,
}

impl Attachments<'_> {
    /// The map's entries that are sent.
    fn sent(&self) -> impl Iterator<Item = (&String, &String)> {
        let depth = self.retry_depth;
        self.map
            .iter()
            .filter(move |(k, _)| depth == 0 || k.as_str() != RETRY_DEPTH_KEY)
    }

    fn len(&self) -> usize {
        let mut buf = [0; 10];
        let depth = (self.retry_depth > 0).then(|| {
            nested_len(pair_len(
                RETRY_DEPTH_KEY,
                decimal(self.retry_depth, &mut buf),
            ))
        });
        self.sent()
            .map(|(k, v)| nested_len(pair_len(k, v)))
            .sum::<usize>()
            + depth.unwrap_or(0)
    }

    fn put(&self, tag: u32, dst: &mut impl BufMut) {
        for (k, v) in self.sent() {
            put_pair(tag, k, v, dst);
        }
        if self.retry_depth > 0 {
            let mut buf = [0; 10];
            put_pair(
                tag,
                RETRY_DEPTH_KEY,
                decimal(self.retry_depth, &mut buf),
                dst,
            );
        }
    }
}

fn put_map(tag: u32, map: &BTreeMap<String, String>, dst: &mut impl BufMut) {
    for (k, v) in map {
        put_pair(tag, k, v, dst);
    }
}

/// protobuf writes an `int32` (here: an enum) as the varint of its sign-extended 64 bits.
fn int32(value: i32) -> u64 {
    value as i64 as u64
}

/// The fields of a `RemoteInvokeMessage`, borrowed from the message or from a [`Call`](crate::Call).
pub(crate) struct InvokeFields<'a> {
    pub(crate) message_id: u64,
    pub(crate) service_entry_id: &'a str,
    pub(crate) codec: i32,
    pub(crate) parameters: &'a [u8],
    pub(crate) attachments: &'a BTreeMap<String, String>,
    /// Sent as the [`RETRY_DEPTH_KEY`] attachment when not 0 (see [`Call::retry_depth`](crate::Call::retry_depth)).
    pub(crate) retry_depth: u32,
    pub(crate) timeout_ms: u32,
    pub(crate) compression: i32,
    pub(crate) stream_mode: i32,
}

impl<'a> From<&'a RemoteInvokeMessage> for InvokeFields<'a> {
    fn from(m: &'a RemoteInvokeMessage) -> Self {
        InvokeFields {
            message_id: m.message_id,
            service_entry_id: &m.service_entry_id,
            codec: m.codec,
            parameters: &m.parameters,
            attachments: &m.attachments,
            retry_depth: 0,
            timeout_ms: m.timeout_ms,
            compression: m.compression,
            stream_mode: m.stream_mode,
        }
    }
}

impl InvokeFields<'_> {
    fn attachments(&self) -> Attachments<'_> {
        Attachments {
            map: self.attachments,
            retry_depth: self.retry_depth,
        }
    }
}

/// Length of the body of a `RemoteInvokeMessage`.
fn invoke_len(m: &InvokeFields<'_>) -> usize {
    varint_len(m.message_id)
        + bytes_len(m.service_entry_id.len())
        + varint_len(int32(m.codec))
        + bytes_len(m.parameters.len())
        + m.attachments().len()
        + varint_len(u64::from(m.timeout_ms))
        + varint_len(int32(m.compression))
        + varint_len(int32(m.stream_mode))
}

/// Length of the body of a `RemoteResultMessage`.
fn result_len(m: &RemoteResultMessage) -> usize {
    varint_len(m.message_id)
        + varint_len(u64::from(m.status_code))
        + bytes_len(m.result.len())
        + bytes_len(m.exception_message.len())
        + m.validate_errors
            .iter()
            .map(|e| nested_len(pair_len(&e.member_name, &e.error_message)))
            .sum::<usize>()
        + map_len(&m.attachments)
        + varint_len(u64::from(m.server_in_flight))
        + varint_len(u64::from(m.server_limit))
        + varint_len(u64::from(m.retry_after_ms))
        + varint_len(int32(m.compression))
}

/// Appends an invoke or result frame, length prefix included, and returns true; returns false
/// and writes nothing for any other kind.
pub(crate) fn put_call_frame(kind: &Kind, dst: &mut BytesMut) -> bool {
    match kind {
        Kind::Invoke(m) => put_invoke_frame(&m.into(), dst),
        Kind::Result(m) => put_frame(FRAME_RESULT, result_len(m), dst, |dst| put_result(m, dst)),
        _ => return false,
    }
    true
}

/// The length of an invoke's frame as its prefix gives it (what a peer's frame limit bounds).
pub(crate) fn invoke_frame_len(m: &InvokeFields<'_>) -> usize {
    nested_len(invoke_len(m))
}

/// Appends the frame of an invoke, length prefix included.
pub(crate) fn put_invoke_frame(m: &InvokeFields<'_>, dst: &mut BytesMut) {
    put_frame(FRAME_INVOKE, invoke_len(m), dst, |dst| put_invoke(m, dst));
}

/// Appends a frame whose `kind` is field `tag`, a message of `body` bytes that `put_body`
/// writes.
fn put_frame(tag: u32, body: usize, dst: &mut BytesMut, put_body: impl FnOnce(&mut BytesMut)) {
    let len = nested_len(body);
    dst.reserve(PREFIX + len);
    // See `FrameCodec::encode_kind` on why the length fits the prefix.
    dst.put_u32(len as u32);
    put_key(tag, LEN, dst);
    encode_varint(body as u64, dst);
    put_body(dst);
}

/// Length of the body of a `StreamItem` of `payload` bytes.
fn item_len(id: u64, payload: usize, compression: i32) -> usize {
    varint_len(id) + bytes_len(payload) + varint_len(int32(compression))
}

/// The length of a `StreamItem` frame of `payload` bytes as its prefix gives it.
pub(crate) fn item_frame_len(id: u64, payload: usize, compression: i32) -> usize {
    nested_len(item_len(id, payload, compression))
}

/// Appends a `StreamItem` frame (one item of stream `id`), length prefix included.
pub(crate) fn put_item_frame(id: u64, payload: &[u8], compression: i32, dst: &mut BytesMut) {
    let body = item_len(id, payload.len(), compression);
    put_frame(FRAME_STREAM_ITEM, body, dst, |dst| {
        put_varint(1, id, dst);
        put_bytes(2, payload, dst);
        put_varint(3, int32(compression), dst);
    });
}

/// Appends a `StreamItems` frame (the items `payloads` of stream `id`, in order), length
/// prefix included.
pub(crate) fn put_items_frame(id: u64, payloads: &[Bytes], compression: i32, dst: &mut BytesMut) {
    let body = varint_len(id)
        + payloads.iter().map(|p| nested_len(p.len())).sum::<usize>()
        + varint_len(int32(compression));
    put_frame(FRAME_STREAM_ITEMS, body, dst, |dst| {
        put_varint(1, id, dst);
        for p in payloads {
            // (Every element of a repeated field is written, an empty one too.)
            put_key(2, LEN, dst);
            encode_varint(p.len() as u64, dst);
            dst.put_slice(p);
        }
        put_varint(3, int32(compression), dst);
    });
}

/// Starts an item of a run in `run` (the items of a `StreamItems` frame as its field 2
/// writes them): its key and `width` bytes (1 to 10) held for its length, which
/// [`finish_run_item`] writes once the item's bytes follow. Returns where the item starts.
/// With `width` the size of the length's varint (as for items of the size of the last one),
/// the item's bytes stay where they were written.
pub(crate) fn start_run_item(run: &mut BytesMut, width: usize) -> usize {
    let mark = run.len();
    put_key(2, LEN, run);
    match width {
        // (The common case, items under 128 bytes, without a call to memset.)
        0 | 1 => run.put_u8(0),
        _ => run.put_bytes(0, width.min(10)),
    }
    mark
}

/// Completes the item started at `mark` by [`start_run_item`] with `width` bytes held for its
/// length, whose `len` bytes now follow: writes the length there, moving the bytes when it
/// takes another number of bytes. Returns the length's size, the width to hold for the next
/// item.
pub(crate) fn finish_run_item(run: &mut BytesMut, mark: usize, width: usize, len: usize) -> usize {
    let width = width.clamp(1, 10);
    let at = mark + 1;
    let need = encoded_len_varint(len as u64);
    if need != width {
        let from = at + width;
        if need > width {
            run.resize(run.len() + need - width, 0);
        }
        run.copy_within(from..from + len, at + need);
        run.truncate(at + need + len);
    }
    if need == 1 {
        // (Items under 128 bytes: one byte, without a call to memcpy.)
        run[at] = len as u8;
        return need;
    }
    let mut prefix = [0u8; 10];
    let mut out = &mut prefix[..];
    encode_varint(len as u64, &mut out);
    run[at..at + need].copy_from_slice(&prefix[..need]);
    need
}

/// Appends an item of `payload` to a run, as [`start_run_item`] and [`finish_run_item`] do.
pub(crate) fn put_run_item(run: &mut BytesMut, payload: &[u8]) {
    put_key(2, LEN, run);
    encode_varint(payload.len() as u64, run);
    run.put_slice(payload);
}

/// Appends the frame of a run of `count` items of stream `id`, compressed with
/// `compression`, whose field-2 entries `run` holds ([`put_run_item`]): a `StreamItem` for
/// one item, a `StreamItems` for more; byte for byte what [`put_item_frame`] and
/// [`put_items_frame`] write for the same items.
pub(crate) fn put_run_frame(
    id: u64,
    count: usize,
    run: &[u8],
    compression: i32,
    dst: &mut BytesMut,
) {
    // One empty item is left out of a `StreamItem`, as prost leaves out empty bytes.
    let run = if count == 1 && run.len() == 2 {
        &[][..]
    } else {
        run
    };
    let body = varint_len(id) + run.len() + varint_len(int32(compression));
    let tag = if count == 1 {
        FRAME_STREAM_ITEM
    } else {
        FRAME_STREAM_ITEMS
    };
    put_frame(tag, body, dst, |dst| {
        put_varint(1, id, dst);
        dst.put_slice(run);
        put_varint(3, int32(compression), dst);
    });
}

/// Writes the body of a `RemoteInvokeMessage`.
fn put_invoke(m: &InvokeFields<'_>, dst: &mut impl BufMut) {
    put_varint(1, m.message_id, dst);
    put_bytes(2, m.service_entry_id.as_bytes(), dst);
    put_varint(3, int32(m.codec), dst);
    put_bytes(4, m.parameters, dst);
    m.attachments().put(5, dst);
    put_varint(6, u64::from(m.timeout_ms), dst);
    put_varint(10, int32(m.compression), dst);
    put_varint(11, int32(m.stream_mode), dst);
}

/// Writes the body of a `RemoteResultMessage`.
fn put_result(m: &RemoteResultMessage, dst: &mut impl BufMut) {
    put_varint(1, m.message_id, dst);
    put_varint(2, u64::from(m.status_code), dst);
    put_bytes(3, &m.result, dst);
    put_bytes(4, m.exception_message.as_bytes(), dst);
    for ValidateError {
        member_name,
        error_message,
    } in &m.validate_errors
    {
        put_pair(5, member_name, error_message, dst);
    }
    put_map(6, &m.attachments, dst);
    put_varint(7, u64::from(m.server_in_flight), dst);
    put_varint(8, u64::from(m.server_limit), dst);
    put_varint(9, u64::from(m.retry_after_ms), dst);
    put_varint(10, int32(m.compression), dst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use rpc_core::wire::{Frame, Ping};

    /// A value that is often the default (left out on the wire), sometimes at a varint size
    /// boundary, sometimes anything.
    fn uint(rng: &mut StdRng) -> u64 {
        match rng.random_range(0..4) {
            0 => 0,
            1 => 1 << (7 * rng.random_range(1..10)),
            2 => (1 << (7 * rng.random_range(1..10))) - 1,
            _ => rng.random(),
        }
    }

    fn text(rng: &mut StdRng) -> String {
        let n = [0, 1, 5, 127, 128, 300][rng.random_range(0..6)];
        (0..n)
            .map(|_| ['a', 'é', '中', '0'][rng.random_range(0..4)])
            .collect()
    }

    fn map(rng: &mut StdRng) -> BTreeMap<String, String> {
        (0..rng.random_range(0..4))
            .map(|_| (text(rng), text(rng)))
            .collect()
    }

    fn invoke(rng: &mut StdRng) -> RemoteInvokeMessage {
        RemoteInvokeMessage {
            message_id: uint(rng),
            service_entry_id: text(rng),
            // Includes negative values, which protobuf writes in ten bytes.
            codec: [0, 1, 7, -1, i32::MIN][rng.random_range(0..5)],
            parameters: text(rng).into_bytes().into(),
            attachments: map(rng),
            timeout_ms: uint(rng) as u32,
            compression: [0, 1, 2, 9, -1][rng.random_range(0..5)],
            // Includes values no enum names: they are kept as numbers.
            stream_mode: [0, 0, 1, 2, 3, 9, -2][rng.random_range(0..7)],
        }
    }

    fn result(rng: &mut StdRng) -> RemoteResultMessage {
        RemoteResultMessage {
            message_id: uint(rng),
            status_code: uint(rng) as u32,
            result: text(rng).into_bytes().into(),
            exception_message: text(rng),
            validate_errors: (0..rng.random_range(0..3))
                .map(|_| ValidateError {
                    member_name: text(rng),
                    error_message: text(rng),
                })
                .collect(),
            attachments: map(rng),
            server_in_flight: uint(rng) as u32,
            server_limit: uint(rng) as u32,
            retry_after_ms: uint(rng) as u32,
            compression: [0, 1, 2, 9, -1][rng.random_range(0..5)],
        }
    }

    /// What prost writes for `kind`, length prefix included.
    fn by_prost(kind: &Kind) -> Vec<u8> {
        let body = Frame {
            kind: Some(kind.clone()),
        }
        .encode_to_vec();
        let mut out = (body.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn call_frames_are_byte_for_byte_what_prost_writes() {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        let mut kinds = vec![
            Kind::Invoke(RemoteInvokeMessage::default()),
            Kind::Result(RemoteResultMessage::default()),
        ];
        for _ in 0..2_000 {
            kinds.push(Kind::Invoke(invoke(&mut rng)));
            kinds.push(Kind::Result(result(&mut rng)));
        }
        for kind in &kinds {
            let mut ours = BytesMut::new();
            assert!(put_call_frame(kind, &mut ours));
            assert_eq!(&ours[..], &by_prost(kind)[..], "{kind:?}");
            // A client's call, which the writer encodes from its own fields.
            if let Kind::Invoke(m) = kind {
                let mut from_call = BytesMut::new();
                let call = crate::Call::from(m.clone());
                put_invoke_frame(&call.fields(m.message_id), &mut from_call);
                assert_eq!(from_call, ours, "{m:?}");
            }
        }
    }

    #[test]
    fn a_calls_retry_depth_is_sent_as_its_attachment_over_one_of_that_key() {
        let mut rng = StdRng::seed_from_u64(0xdee9);
        for depth in [0, 1, 9, 10, 99, 12_345, u32::MAX] {
            for _ in 0..200 {
                let mut m = invoke(&mut rng);
                if rng.random_bool(0.5) {
                    m.attachments.insert(RETRY_DEPTH_KEY.into(), text(&mut rng));
                }
                let mut call = crate::Call::from(m.clone());
                call.retry_depth = depth;
                let mut ours = BytesMut::new();
                put_invoke_frame(&call.fields(m.message_id), &mut ours);
                // The oracle: prost reads the frame (its length prefix included) as the
                // message whose map holds the depth in decimal.
                let len = u32::from_be_bytes([ours[0], ours[1], ours[2], ours[3]]) as usize;
                assert_eq!(len, ours.len() - 4, "{m:?}");
                let read = Frame::decode(&ours[4..]).expect("prost reads the frame");
                let mut expected = m.clone();
                if depth > 0 {
                    expected
                        .attachments
                        .insert(RETRY_DEPTH_KEY.into(), format!("{depth}"));
                }
                assert_eq!(read.kind, Some(Kind::Invoke(expected)), "depth {depth}");
            }
        }
    }

    #[test]
    fn stream_item_frames_are_byte_for_byte_what_prost_writes() {
        use rpc_core::wire::{StreamItem, StreamItems};
        let mut rng = StdRng::seed_from_u64(0x17e5);
        for _ in 0..2_000 {
            let id = if rng.random_bool(0.1) {
                0
            } else {
                rng.random()
            };
            let compression = rng.random_range(0..3);
            let payloads: Vec<Bytes> = (0..rng.random_range(0..6))
                .map(|_| {
                    let n = rng.random_range(0..300);
                    (0..n)
                        .map(|_| rng.random::<u8>())
                        .collect::<Vec<u8>>()
                        .into()
                })
                .collect();
            let mut ours = BytesMut::new();
            put_items_frame(id, &payloads, compression, &mut ours);
            let items = Kind::StreamItems(StreamItems {
                message_id: id,
                payloads: payloads.clone(),
                compression,
            });
            assert_eq!(&ours[..], &by_prost(&items)[..], "{items:?}");
            let payload = payloads.first().cloned().unwrap_or_default();
            let mut ours = BytesMut::new();
            put_item_frame(id, &payload, compression, &mut ours);
            let item = Kind::StreamItem(StreamItem {
                message_id: id,
                payload,
                compression,
            });
            assert_eq!(&ours[..], &by_prost(&item)[..], "{item:?}");
        }
    }

    #[test]
    fn run_frames_are_byte_for_byte_what_prost_writes() {
        let mut rng = StdRng::seed_from_u64(0x7e57);
        // Lengths around the varint steps (1, 2 and 3 bytes) and empty items.
        let lens = [0usize, 1, 31, 127, 128, 300, 16_383, 16_384, 20_000];
        for round in 0..200 {
            let id = uint(&mut rng);
            let compression = [0, 1, 2][round % 3];
            let count = 1 + round % 5;
            let payloads: Vec<Bytes> = (0..count)
                .map(|_| {
                    let n = lens[rng.random_range(0..lens.len())];
                    Bytes::from((0..n).map(|_| rng.random::<u8>()).collect::<Vec<u8>>())
                })
                .collect();
            // The oracle: prost's encoding of the frame.
            let expected = by_prost(&if count == 1 {
                Kind::StreamItem(rpc_core::wire::StreamItem {
                    message_id: id,
                    payload: payloads[0].clone(),
                    compression,
                })
            } else {
                Kind::StreamItems(rpc_core::wire::StreamItems {
                    message_id: id,
                    payloads: payloads.clone(),
                    compression,
                })
            });
            // Each item appended whole, or written after its placeholder and then fixed.
            for written_in_place in [false, true] {
                let mut run = BytesMut::new();
                for p in &payloads {
                    if written_in_place {
                        // Any width held for the length: too small, right or too large.
                        let width = rng.random_range(1..4);
                        let mark = start_run_item(&mut run, width);
                        run.extend_from_slice(p);
                        let used = finish_run_item(&mut run, mark, width, p.len());
                        assert_eq!(used, encoded_len_varint(p.len() as u64));
                    } else {
                        put_run_item(&mut run, p);
                    }
                }
                let mut ours = BytesMut::new();
                put_run_frame(id, count, &run, compression, &mut ours);
                assert_eq!(
                    &ours[..],
                    &expected[..],
                    "round {round}, in place: {written_in_place}"
                );
            }
        }
    }

    #[test]
    fn other_kinds_are_left_to_prost() {
        let mut buf = BytesMut::new();
        assert!(!put_call_frame(&Kind::Ping(Ping { nonce: 1 }), &mut buf));
        assert!(buf.is_empty());
    }
}
