//! Direct decoding of the frame every call brings the client: `Frame { result }`.
//!
//! prost decodes a frame through its generic merge machinery: the oneof, then the message
//! field by field, each varint read through `Buf`; for a 40-byte answer that was the largest
//! single cost of the client's reader. Here the plain shape every encoder writes (one `result`
//! field in the frame; `message_id`, `status_code`, `result`, `exception_message`, the load
//! report and `compression`, each with its own wire type) is read in one pass, the result a slice of the frame's buffer.
//! Anything else (validation errors, attachments, unknown fields, repeated oneof fields,
//! another frame kind, malformed input) goes to prost, so the outcome is always what prost
//! would decode: the unit tests compare both decoders on generated and on mangled frames.

use bytes::{Bytes, BytesMut};
use prost::encoding::decode_varint;
use prost::Message;
use rpc_core::wire::{frame::Kind, Frame, RemoteResultMessage};
use tokio_util::codec::Decoder;

use crate::codec::{FrameCodec, FrameError};

/// `Frame.result`: field 4, length-delimited.
const FRAME_RESULT_KEY: u64 = (4 << 3) | 2;

/// The client's frame decoder: [`FrameCodec`]'s framing, answers decoded by hand.
#[derive(Debug, Clone)]
pub(super) struct AnswerCodec {
    codec: FrameCodec,
    /// Bumped whenever bytes arrive (a frame whole or in part): the heartbeat's sign of life,
    /// so a large answer still arriving on a slow link is not taken for silence.
    progress: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The buffer's length after the last decode.
    seen: usize,
}

impl AnswerCodec {
    /// A decoder accepting frames up to `max_frame_length` bytes (the N of the prefix),
    /// counting arrivals in `progress`.
    pub(super) fn new(
        max_frame_length: usize,
        progress: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        AnswerCodec {
            codec: FrameCodec::new(max_frame_length),
            progress,
            seen: 0,
        }
    }
}

impl Decoder for AnswerCodec {
    type Item = Answer;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Answer>, FrameError> {
        if src.len() > self.seen {
            self.progress
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let answer = match self.codec.split_frame(src)? {
            Some(payload) if payload.len() > LARGE_FRAME => {
                leave_large_allocation(src);
                let frame = payload.len();
                decode_answer(payload).map(|mut answer| {
                    match &mut answer {
                        Answer::Frame(kind) => crate::own_sparse_items(kind, frame),
                        Answer::Items(run) => run.own_if_sparse(frame),
                    }
                    Some(answer)
                })
            }
            Some(payload) => decode_answer(payload).map(Some),
            None => Ok(None),
        };
        self.seen = src.len();
        answer
    }
}

/// Frames above this size grew the read buffer to hold them (it starts at 64 KiB).
const LARGE_FRAME: usize = 2 * crate::READ_BUFFER;

/// After a large frame was cut from the read buffer, what is left of the buffer still lies in
/// the allocation made for that frame, and the frames read next would be cut from it too,
/// each keeping all of it alive for as long as it is held (a stream's items while their
/// consumer waits: a 9 KiB run, too large to be copied out, could keep a megabyte). What is
/// left moves to a buffer of the usual size, so the large allocation lives only as long as the
/// large frame. (Frames of up to twice the usual buffer are left alone: runs of stream items
/// reach just above it, and moving the rest after each would cost a copy per run.)
fn leave_large_allocation(src: &mut BytesMut) {
    let mut fresh = BytesMut::with_capacity(crate::READ_BUFFER.max(src.len()));
    fresh.extend_from_slice(src);
    *src = fresh;
}

/// One decoded frame from the server.
#[derive(Debug)]
pub(super) enum Answer {
    /// A `StreamItems` frame of the plain shape, its items left in the frame's buffer.
    Items(ItemRun),
    /// Any other frame (a `StreamItems` of another shape too, decoded by prost).
    Frame(Kind),
}

/// Decodes a frame's payload (without its length prefix).
pub(super) fn decode_answer(payload: Bytes) -> Result<Answer, FrameError> {
    if let Some(result) = result_frame(&payload) {
        return Ok(Answer::Frame(Kind::Result(result)));
    }
    if let Some(items) = items_frame(&payload) {
        return Ok(Answer::Items(items));
    }
    crate::entries::check(&payload)?;
    Ok(Answer::Frame(
        Frame::decode(payload)?.kind.ok_or(FrameError::Empty)?,
    ))
}

/// `Frame.stream_items`: field 12, length-delimited.
const FRAME_STREAM_ITEMS_KEY: u64 = (12 << 3) | 2;

/// The items of one `StreamItems` frame, still in the frame: `body` is the message's
/// encoding, checked to be the plain shape, and `places` where each item lies in it (so the
/// consumer decodes each straight from the frame, with no handle per item).
#[derive(Debug)]
pub(super) struct ItemRun {
    pub(super) message_id: u64,
    pub(super) compression: i32,
    /// The `StreamItems` message's fields (or, from a large frame mostly of other fields, the
    /// items alone, one after the other: [`own_if_sparse`](Self::own_if_sparse)).
    pub(super) body: Bytes,
    /// Each item's start and end in `body`, in order.
    pub(super) places: Vec<(u32, u32)>,
}

impl ItemRun {
    /// Copies the items out of their frame of `frame` bytes when they are less than half of
    /// it, as [`own_sparse_items`](crate::own_sparse_items) does for the frames prost decodes:
    /// the plain shape still allows `message_id` or `compression` given again and again, which
    /// could pad a 9 KiB item into a 16 MiB frame.
    pub(super) fn own_if_sparse(&mut self, frame: usize) {
        let carried: usize = self
            .places
            .iter()
            .map(|&(from, to)| (to - from) as usize)
            .sum();
        if carried >= frame / 2 {
            return;
        }
        let mut items = BytesMut::with_capacity(carried);
        for place in &mut self.places {
            let (from, to) = *place;
            let start = items.len() as u32;
            items.extend_from_slice(&self.body[from as usize..to as usize]);
            *place = (start, items.len() as u32);
        }
        self.body = items.freeze();
    }
}

/// The items in `payload` if it is a plain `StreamItems` frame (one `stream_items` field;
/// `message_id`, each payload, `compression`, each with its own wire type), left in the frame;
/// `None` for anything else (prost decodes it then).
fn items_frame(payload: &Bytes) -> Option<ItemRun> {
    let mut buf = &payload[..];
    if decode_varint(&mut buf).ok()? != FRAME_STREAM_ITEMS_KEY {
        return None;
    }
    let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
    // (A frame is far below 4 GiB: its places fit in u32.)
    if len != buf.len() || u32::try_from(len).is_err() {
        return None;
    }
    let mut run = ItemRun {
        message_id: 0,
        compression: 0,
        body: Bytes::new(),
        places: Vec::new(),
    };
    while let Some((&key, rest)) = buf.split_first() {
        buf = rest;
        match key {
            // message_id: uint64
            0x08 => run.message_id = varint(&mut buf)?,
            // payloads: repeated bytes, left in the frame
            0x12 => {
                let (from, to) = field(&mut buf, len)?;
                // (More is refused on the general path: `entries`.)
                if run.places.len() == crate::entries::MAX_ENTRIES {
                    return None;
                }
                run.places.push((from as u32, to as u32));
            }
            // compression: enum (int32), truncated as prost does
            0x18 => run.compression = varint(&mut buf)? as i32,
            _ => return None,
        }
    }
    run.body = payload.slice(payload.len() - len..);
    Some(run)
}

/// The answer in `payload` if it is a plain result frame; `None` for anything else.
fn result_frame(payload: &Bytes) -> Option<RemoteResultMessage> {
    let mut buf = &payload[..];
    if decode_varint(&mut buf).ok()? != FRAME_RESULT_KEY {
        return None;
    }
    let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
    if len != buf.len() {
        // More fields after the result (prost would merge or replace): not the plain shape.
        return None;
    }
    let mut m = RemoteResultMessage::default();
    while let Some((&key, rest)) = buf.split_first() {
        // Every key of the plain shape is one byte; a longer one is not the plain shape.
        buf = rest;
        match key {
            // message_id: uint64
            0x08 => m.message_id = varint(&mut buf)?,
            // status_code: uint32, truncated as prost does
            0x10 => m.status_code = varint(&mut buf)? as u32,
            // result: bytes, a slice of the frame
            0x1a => {
                let (from, to) = field(&mut buf, payload.len())?;
                m.result = payload.slice(from..to);
            }
            // exception_message: string
            0x22 => {
                let (from, to) = field(&mut buf, payload.len())?;
                m.exception_message = std::str::from_utf8(&payload[from..to]).ok()?.to_owned();
            }
            // server_in_flight, server_limit, retry_after_ms: uint32
            0x38 => m.server_in_flight = varint(&mut buf)? as u32,
            0x40 => m.server_limit = varint(&mut buf)? as u32,
            0x48 => m.retry_after_ms = varint(&mut buf)? as u32,
            // compression: enum (int32), truncated as prost does
            0x50 => m.compression = varint(&mut buf)? as i32,
            _ => return None,
        }
    }
    Some(m)
}

/// A varint, the one-byte case inline (status codes, lengths of small results).
#[inline(always)]
fn varint(buf: &mut &[u8]) -> Option<u64> {
    match buf.first() {
        Some(&b) if b < 0x80 => {
            *buf = &buf[1..];
            Some(u64::from(b))
        }
        _ => decode_varint(buf).ok(),
    }
}

/// The next length-delimited field of `buf` (a suffix of a payload of `whole` bytes), as a
/// range of the payload; `buf` moves past it.
fn field(buf: &mut &[u8], whole: usize) -> Option<(usize, usize)> {
    let len = usize::try_from(varint(buf)?).ok()?;
    if len > buf.len() {
        return None;
    }
    let from = whole - buf.len();
    *buf = &buf[len..];
    Some((from, from + len))
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use rpc_core::wire::{Ping, RemoteInvokeMessage, StreamItems, ValidateError};

    use super::*;
    use crate::mutations::payload;

    /// Once a large frame is read, the read buffer goes back to its usual size: the large
    /// frame's allocation is not taken back as the buffer once the frame is dropped (else every
    /// frame read later would be cut from it and keep all of it alive).
    #[tokio::test]
    async fn the_read_buffer_does_not_keep_a_large_frames_allocation() {
        use futures_util::StreamExt;
        let mut wire = BytesMut::new();
        for (id, len) in [(1, 1 << 20), (2, 9 * 1024), (3, 9 * 1024)] {
            let answer = RemoteResultMessage {
                message_id: id,
                status_code: 200,
                result: Bytes::from(vec![7u8; len]),
                ..Default::default()
            };
            FrameCodec::encode_kind(Kind::Result(answer), &mut wire);
        }
        let progress = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut frames = tokio_util::codec::FramedRead::with_capacity(
            &wire[..],
            AnswerCodec::new(4 << 20, progress),
            crate::READ_BUFFER,
        );
        let mut lens = Vec::new();
        while let Some(answer) = frames.next().await {
            match answer {
                // Each answer is dropped at once, as a caller that is done with it does.
                Ok(Answer::Frame(Kind::Result(r))) => lens.push(r.result.len()),
                other => panic!("expected an answer, got {other:?}"),
            }
            assert!(
                frames.read_buffer().capacity() <= 2 * crate::READ_BUFFER,
                "after {} answers the read buffer holds {} bytes",
                lens.len(),
                frames.read_buffer().capacity()
            );
        }
        assert_eq!(lens, [1 << 20, 9 * 1024, 9 * 1024]);
    }

    /// Decodes the one frame in `wire` (length prefix included); also where its bytes lay.
    fn decode_one(wire: &[u8]) -> (Answer, std::ops::Range<usize>) {
        let mut buf = BytesMut::from(wire);
        let lay = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        let progress = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut codec = AnswerCodec::new(4 << 20, progress);
        let answer = codec.decode(&mut buf).expect("a frame").expect("whole");
        (answer, lay)
    }

    /// The item of a large frame that is mostly something else is copied out of the frame;
    /// the item of a large frame that it fills shares the frame's allocation.
    #[test]
    fn an_item_in_a_mostly_padded_large_frame_does_not_keep_the_frame() {
        let item_of = |padding: usize| {
            let (answer, frame) = decode_one(&crate::padded_item_frame(padding));
            let Answer::Frame(Kind::StreamItem(item)) = answer else {
                panic!("expected a stream item")
            };
            (item.payload, frame)
        };
        let (padded, frame) = item_of(1 << 20);
        assert_eq!(padded.len(), 9 * 1024);
        assert!(padded.iter().all(|b| *b == 7));
        assert!(!frame.contains(&(padded.as_ptr() as usize)), "a copy");
        let (whole, frame) = item_of(0);
        assert_eq!(whole.len(), 9 * 1024 + (1 << 20));
        assert!(
            frame.contains(&(whole.as_ptr() as usize)),
            "a slice of the frame"
        );
    }

    /// The plain shape padded with `message_id` given again and again: a large frame decoded
    /// by hand, whose lone item is copied out of it all the same.
    #[test]
    fn the_items_of_a_padded_plain_frame_do_not_keep_the_frame() {
        use prost::encoding::encode_varint;
        let item = vec![7u8; 9 * 1024];
        let mut items = Vec::new();
        for _ in 0..300_000 {
            items.extend_from_slice(&[0x08, 0x01]);
        }
        items.push(0x12);
        encode_varint(item.len() as u64, &mut items);
        items.extend_from_slice(&item);
        let mut body = Vec::new();
        encode_varint(FRAME_STREAM_ITEMS_KEY, &mut body);
        encode_varint(items.len() as u64, &mut body);
        body.extend_from_slice(&items);
        let mut wire = (body.len() as u32).to_be_bytes().to_vec();
        wire.extend_from_slice(&body);
        let (Answer::Items(run), frame) = decode_one(&wire) else {
            panic!("expected a run of items in the plain shape")
        };
        assert_eq!(run.message_id, 1);
        let message = as_message(&run);
        assert_eq!(message.payloads, [Bytes::from(item)]);
        assert!(!frame.contains(&(run.body.as_ptr() as usize)), "a copy");
    }

    /// A run's items as prost gives them.
    fn as_message(run: &ItemRun) -> StreamItems {
        StreamItems {
            message_id: run.message_id,
            payloads: run
                .places
                .iter()
                .map(|&(from, to)| run.body.slice(from as usize..to as usize))
                .collect(),
            compression: run.compression,
        }
    }

    /// Both decoders on one payload: the same frame, or both an error.
    fn same_as_prost(payload: &[u8]) {
        let ours = decode_answer(Bytes::copy_from_slice(payload)).map(|a| match a {
            Answer::Items(run) => Kind::StreamItems(as_message(&run)),
            Answer::Frame(kind) => kind,
        });
        let prost = Frame::decode(payload)
            .map_err(FrameError::from)
            .and_then(|f| f.kind.ok_or(FrameError::Empty));
        crate::mutations::agree(payload, ours, prost);
    }

    fn random_result(rng: &mut StdRng) -> RemoteResultMessage {
        let word = |rng: &mut StdRng, n: usize| -> String {
            (0..rng.random_range(0..n))
                .map(|_| rng.random_range('a'..='z'))
                .collect()
        };
        let zero_or = |rng: &mut StdRng, v: u64| if rng.random_bool(0.2) { 0 } else { v };
        RemoteResultMessage {
            message_id: {
                let id = rng.random();
                zero_or(rng, id)
            },
            status_code: {
                let code = [200, 515, 1000, u64::from(u32::MAX)][rng.random_range(0..4)];
                zero_or(rng, code) as u32
            },
            result: (0..rng.random_range(0..300))
                .map(|_| rng.random())
                .collect(),
            exception_message: if rng.random_bool(0.7) {
                String::new()
            } else {
                format!("{} é", word(rng, 30))
            },
            validate_errors: Vec::new(),
            attachments: Default::default(),
            server_in_flight: {
                let n = rng.random_range(1..2000);
                zero_or(rng, n) as u32
            },
            server_limit: {
                let n = rng.random_range(1..2000);
                zero_or(rng, n) as u32
            },
            retry_after_ms: zero_or(rng, u64::from(u32::MAX)) as u32,
            compression: [0, 1, 2, -1][rng.random_range(0..4)],
        }
    }

    #[test]
    fn result_frames_decode_as_prost_decodes_them() {
        let mut rng = StdRng::seed_from_u64(12);
        for _ in 0..2_000 {
            let m = random_result(&mut rng);
            let p = payload(Kind::Result(m.clone()));
            assert_eq!(
                result_frame(&Bytes::from(p.clone())).as_ref(),
                Some(&m),
                "the plain shape is read by hand"
            );
            same_as_prost(&p);
        }
    }

    #[test]
    fn unusual_and_broken_frames_decode_as_prost_decodes_them() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut with_extras = random_result(&mut rng);
        with_extras.validate_errors.push(ValidateError {
            member_name: "name".into(),
            error_message: "too long".into(),
        });
        with_extras.attachments.insert("k".into(), "v".into());
        let mut cases = crate::mutations::cases(
            0x22,
            |rng| payload(Kind::Result(random_result(rng))),
            payload(Kind::Ping(Ping { nonce: 3 })),
            &mut rng,
        );
        cases.extend([
            payload(Kind::Invoke(RemoteInvokeMessage {
                message_id: 4,
                ..Default::default()
            })),
            payload(Kind::Result(with_extras)),
            // A field given twice: the last wins.
            vec![0x22, 0x04, 0x08, 0x01, 0x08, 0x02],
            // A message that is not UTF-8, and a truncated body.
            vec![0x22, 0x04, 0x22, 0x02, 0xff, 0xfe],
            vec![0x22, 0x05, 0x1a, 0x09, b'a'],
        ]);
        for c in &cases {
            same_as_prost(c);
        }
    }

    fn random_items(rng: &mut StdRng) -> StreamItems {
        StreamItems {
            message_id: if rng.random_bool(0.1) {
                0
            } else {
                rng.random()
            },
            payloads: (0..rng.random_range(0..5))
                .map(|_| {
                    let n = rng.random_range(0..200);
                    (0..n)
                        .map(|_| rng.random::<u8>())
                        .collect::<Vec<u8>>()
                        .into()
                })
                .collect(),
            compression: [0, 1, 2, -1][rng.random_range(0..4)],
        }
    }

    #[test]
    fn stream_items_frames_decode_as_prost_decodes_them() {
        let mut rng = StdRng::seed_from_u64(0x1735);
        for _ in 0..2_000 {
            let m = random_items(&mut rng);
            let p = payload(Kind::StreamItems(m.clone()));
            assert_eq!(
                items_frame(&Bytes::from(p.clone())).map(|r| as_message(&r)),
                Some(m.clone()),
                "the plain shape is read by hand"
            );
            same_as_prost(&p);
        }
        let cases = crate::mutations::cases(
            0x62,
            |rng| payload(Kind::StreamItems(random_items(rng))),
            payload(Kind::Ping(Ping { nonce: 3 })),
            &mut rng,
        );
        for c in &cases {
            same_as_prost(c);
        }
    }

    #[test]
    fn the_result_shares_the_frame_buffer_and_nothing_is_allocated() {
        let m = RemoteResultMessage {
            message_id: 1,
            status_code: 200,
            result: Bytes::from_static(b"\xa5hello"),
            ..Default::default()
        };
        let mut buf = BytesMut::new();
        FrameCodec::encode_kind(Kind::Result(m.clone()), &mut buf);
        // As the reader hands it over: split off its read buffer.
        let p = FrameCodec::new(1024)
            .split_frame(&mut buf)
            .expect("a frame")
            .expect("complete");
        let before = crate::alloc_count::this_thread();
        let decoded = decode_answer(p.clone());
        assert_eq!(crate::alloc_count::this_thread() - before, 0);
        let Ok(Answer::Frame(Kind::Result(r))) = decoded else {
            panic!("expected a result, got {decoded:?}")
        };
        assert_eq!(r, m);
        let at = r.result.as_ptr() as usize;
        let range = p.as_ptr() as usize..p.as_ptr() as usize + p.len();
        assert!(range.contains(&at), "the result points into the frame");
    }
}
