//! The checks behind the fuzz targets, one module per target, and the seed inputs of each.
//!
//! The targets in `fuzz_targets/` only hand libFuzzer's bytes to `check`; the same file is
//! compiled into `tests/tests/integration/fuzz_regressions.rs`, which replays the committed corpus through
//! the same checks on every test run.

/// Frames every seed is built from: one of each kind, with maps, bytes and unicode filled in.
pub fn sample_kinds() -> Vec<rpc_core::wire::frame::Kind> {
    use rpc_core::wire::{
        frame::Kind, Cancel, GoAway, Hello, HelloAck, Ping, Pong, RemoteInvokeMessage,
        RemoteResultMessage, StreamCredit, StreamEnd, StreamItem, ValidateError,
    };
    let attachments = [
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
        ("user", "änn"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    vec![
        Kind::Hello(Hello {
            protocol_version: rpc_core::PROTOCOL_VERSION,
            token: "s3cret".into(),
            client_id: "client-1@host".into(),
            accept_compression: vec![1, 2],
            streams: true,
            stream_window: 32,
            stream_window_bytes: 256 * 1024,
            stream_batches: true,
        }),
        Kind::HelloAck(HelloAck {
            protocol_version: rpc_core::PROTOCOL_VERSION,
            server_id: "server-1".into(),
            max_frame_length: rpc_core::DEFAULT_MAX_FRAME_LENGTH as u32,
            accept_compression: vec![1, 2],
            streams: true,
            stream_window: 32,
            stream_window_bytes: 256 * 1024,
            stream_batches: true,
            max_attachments: Some(64),
            max_attachment_bytes: Some(16 * 1024),
        }),
        Kind::Invoke(RemoteInvokeMessage {
            message_id: 42,
            service_entry_id: "shop.Greeter.greet".into(),
            codec: rpc_core::wire::Codec::Msgpack as i32,
            // ["ann", 2]
            parameters: bytes::Bytes::from_static(&[0x92, 0xa3, b'a', b'n', b'n', 0x02]),
            attachments,
            timeout_ms: 800,
            compression: 0,
            ..Default::default()
        }),
        Kind::Result(RemoteResultMessage {
            message_id: 42,
            status_code: 1001,
            result: bytes::Bytes::from_static(b"\xa9hello ann"),
            exception_message: "name is too short".into(),
            validate_errors: vec![ValidateError {
                member_name: "name".into(),
                error_message: "at least 4 characters".into(),
            }],
            attachments: Default::default(),
            server_in_flight: 12,
            server_limit: 50,
            retry_after_ms: 0,
            compression: 0,
        }),
        Kind::Cancel(Cancel {
            message_id: u64::MAX,
            reason: 1,
        }),
        Kind::Ping(Ping { nonce: 7 }),
        Kind::Pong(Pong { nonce: 7 }),
        Kind::GoAway(GoAway {
            status_code: 200,
            reason: "draining".into(),
            last: true,
        }),
        // A call whose parameters are compressed (LZ4: the size, then one block), and its
        // compressed answer.
        Kind::Invoke(RemoteInvokeMessage {
            message_id: 43,
            service_entry_id: "shop.Greeter.greet".into(),
            parameters: bytes::Bytes::from_static(&[
                6, 0, 0, 0, 0x60, 0x92, 0xa3, b'a', b'n', b'n', 0x02,
            ]),
            compression: rpc_core::wire::Compression::Lz4 as i32,
            ..Default::default()
        }),
        Kind::Result(RemoteResultMessage {
            message_id: 43,
            status_code: 200,
            result: bytes::Bytes::from_static(&[2, 0, 0, 0, 0x20, 0xc3, 0xc3]),
            compression: rpc_core::wire::Compression::Lz4 as i32,
            ..Default::default()
        }),
        Kind::Invoke(RemoteInvokeMessage {
            message_id: 43,
            service_entry_id: "shop.Prices.ticks".into(),
            parameters: bytes::Bytes::from_static(&[0x91, 0x64]),
            timeout_ms: 60_000,
            stream_mode: rpc_core::StreamMode::Server as i32,
            ..Default::default()
        }),
        Kind::StreamCredit(StreamCredit {
            message_id: 43,
            items: 32,
        }),
        Kind::StreamItem(StreamItem {
            message_id: 43,
            payload: bytes::Bytes::from_static(b"\x82\xa3seq\x00\xa5label\xa3t-0"),
            compression: 0,
        }),
        Kind::StreamEnd(StreamEnd {
            message_id: 43,
            status_code: 200,
            exception_message: String::new(),
        }),
    ]
}

/// Target `frame_decoder`: the length-delimited stream decoder, [`rpc_transport::FrameCodec`].
pub mod frame_decoder {
    use bytes::BytesMut;
    use prost::Message;
    use rpc_core::wire::{frame::Kind, Frame};
    use rpc_transport::{FrameCodec, FrameError};
    use tokio_util::codec::Decoder;

    /// The maximum frame length of the decoder under test, unless the input asks for the small
    /// one.
    pub const MAX_FRAME_LENGTH: usize = 64 * 1024;
    // A frame this long cannot hold more than the codec's 65 536 entries of one field (its
    // keys and lengths take a few bytes), which the plain reading below does not refuse: a
    // longer maximum would need that refusal in it too.
    const _: () = assert!(MAX_FRAME_LENGTH <= 64 * 1024);
    /// The other maximum, small enough that frames above it fit in a fuzz input.
    pub const SMALL_MAX_FRAME_LENGTH: usize = 64;
    const PREFIX: usize = 4;

    /// How a stream ends.
    #[derive(Debug, PartialEq)]
    pub enum End {
        /// Every byte was consumed by whole frames.
        Drained,
        /// This many bytes wait for the rest of a frame.
        Pending(usize),
        /// A prefix announced too large a frame.
        TooLarge { len: usize, max: usize },
        /// A payload was not a protobuf `Frame` (the error's text).
        Malformed(String),
        /// A payload was a `Frame` without a message.
        Empty,
    }

    /// The frames a stream yields, and how it ends.
    #[derive(Debug, PartialEq)]
    pub struct Outcome {
        pub frames: Vec<Kind>,
        pub end: End,
    }

    /// A fuzz input: byte 0 is a header `h`; `h & 7` bytes of chunk sizes follow (each byte `b`
    /// a chunk of `b + 1` bytes, used in turn); the rest is the stream. Bit 3 of `h` selects
    /// [`SMALL_MAX_FRAME_LENGTH`].
    pub fn input(small_max: bool, chunks: &[u8], stream: &[u8]) -> Vec<u8> {
        assert!(chunks.len() <= 7);
        let mut out = vec![chunks.len() as u8 | if small_max { 8 } else { 0 }];
        out.extend_from_slice(chunks);
        out.extend_from_slice(stream);
        out
    }

    /// Decodes the stream of `data` (see [`input`]) in one chunk, a byte at a time and in the
    /// chunks the input names; each must give what a plain reading of the format gives. At every
    /// step: no panic, a too large prefix is refused as soon as its four bytes are there, and
    /// what stays buffered is less than one frame of the maximum.
    pub fn check(data: &[u8]) {
        let Some((&header, rest)) = data.split_first() else {
            return;
        };
        let (chunks, stream) = rest.split_at(usize::from(header & 7).min(rest.len()));
        let max = if header & 8 != 0 {
            SMALL_MAX_FRAME_LENGTH
        } else {
            MAX_FRAME_LENGTH
        };
        let expected = expected(stream, max);
        assert_eq!(feed(stream, max, &[]), expected, "stream in one chunk");
        assert_eq!(feed(stream, max, &[0]), expected, "stream a byte at a time");
        assert_eq!(
            feed(stream, max, chunks),
            expected,
            "stream in chunks {chunks:?}"
        );
    }

    /// The outcome the format defines, read without the codec.
    fn expected(mut rest: &[u8], max: usize) -> Outcome {
        let mut frames = Vec::new();
        let end = loop {
            if rest.len() < PREFIX {
                break if rest.is_empty() {
                    End::Drained
                } else {
                    End::Pending(rest.len())
                };
            }
            let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            if len > max {
                break End::TooLarge { len, max };
            }
            if rest.len() < PREFIX + len {
                break End::Pending(rest.len());
            }
            let payload = &rest[PREFIX..PREFIX + len];
            if let Some(field) = first_group(payload) {
                break End::Malformed(FrameError::Group { field }.to_string());
            }
            match Frame::decode(payload) {
                Err(e) => break End::Malformed(e.to_string()),
                Ok(Frame { kind: None }) => break End::Empty,
                Ok(Frame { kind: Some(kind) }) => frames.push(kind),
            }
            rest = &rest[PREFIX + len..];
        };
        Outcome { frames, end }
    }

    /// The field number of the first group (wire type 3 or 4) among a frame's fields and its
    /// message's, which the codec refuses (no message of the protocol has groups; prost would
    /// step over one): the fields are read in order, a frame's message (fields 1 to 12,
    /// length-delimited) before the frame's next field; bytes that stop being well-formed end
    /// the search there (in a message: that message's), and prost has the last word.
    fn first_group(payload: &[u8]) -> Option<u64> {
        use prost::encoding::decode_varint;
        /// `Err(Some(field))`: a group; `Err(None)`: not well-formed from here.
        fn scan(mut buf: &[u8], frame: bool) -> Result<(), Option<u64>> {
            while !buf.is_empty() {
                let key = decode_varint(&mut buf).map_err(|_| None)?;
                let fixed = |n: usize, buf: &mut &[u8]| {
                    if buf.len() < n {
                        return Err(None);
                    }
                    *buf = &buf[n..];
                    Ok(())
                };
                match key & 7 {
                    0 => drop(decode_varint(&mut buf).map_err(|_| None)?),
                    1 => fixed(8, &mut buf)?,
                    2 => {
                        let len = decode_varint(&mut buf).map_err(|_| None)?;
                        let len = usize::try_from(len).map_err(|_| None)?;
                        if len > buf.len() {
                            return Err(None);
                        }
                        let (body, rest) = buf.split_at(len);
                        if frame && (1..=12).contains(&(key >> 3)) {
                            if let Err(Some(field)) = scan(body, false) {
                                return Err(Some(field));
                            }
                        }
                        buf = rest;
                    }
                    3 | 4 => return Err(Some(key >> 3)),
                    5 => fixed(4, &mut buf)?,
                    _ => return Err(None),
                }
            }
            Ok(())
        }
        scan(payload, true).err().flatten()
    }

    /// Feeds `stream` to a [`FrameCodec`] as a framed reader does: append a chunk, decode until
    /// it needs more. `chunks` as in [`input`]; empty means all in one chunk.
    fn feed(stream: &[u8], max: usize, chunks: &[u8]) -> Outcome {
        let mut codec = FrameCodec::new(max);
        let mut buf = BytesMut::new();
        let mut frames = Vec::new();
        let mut sizes = chunks.iter().map(|&b| usize::from(b) + 1).cycle();
        let mut rest = stream;
        loop {
            loop {
                let announced = (buf.len() >= PREFIX)
                    .then(|| u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize);
                let (len_before, cap_before) = (buf.len(), buf.capacity());
                match codec.decode(&mut buf) {
                    Ok(Some(kind)) => {
                        let n = announced.expect("a frame decoded from fewer than 4 bytes");
                        assert!(
                            n <= max,
                            "decoded a frame of {n} bytes above the maximum {max}"
                        );
                        assert_eq!(buf.len(), len_before - PREFIX - n, "consumed one frame");
                        frames.push(kind);
                    }
                    Ok(None) => {
                        if let Some(n) = announced {
                            assert!(n <= max, "waits for a frame of {n} bytes, maximum {max}");
                            assert!(buf.len() < PREFIX + n, "waits though the frame is there");
                        }
                        assert_eq!(buf.len(), len_before, "consumed bytes without a frame");
                        assert!(
                            buf.capacity() <= cap_before.max(4 * (PREFIX + max)),
                            "buffer grew from {cap_before} to {} bytes, maximum frame {max}",
                            buf.capacity()
                        );
                        break;
                    }
                    Err(e) => {
                        let end = match e {
                            FrameError::TooLarge { len, max: m } => {
                                assert_eq!((Some(len), m), (announced, max), "TooLarge");
                                End::TooLarge { len, max: m }
                            }
                            FrameError::Malformed(e) => End::Malformed(e.to_string()),
                            FrameError::Io(e) => panic!("i/o error from a decoder: {e}"),
                            FrameError::Empty => End::Empty,
                            // (Too many entries, and any refusal added later.)
                            e => End::Malformed(e.to_string()),
                        };
                        return Outcome { frames, end };
                    }
                }
            }
            if rest.is_empty() {
                break;
            }
            let n = sizes.next().unwrap_or(rest.len()).min(rest.len());
            buf.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
        let end = if buf.is_empty() {
            End::Drained
        } else {
            End::Pending(buf.len())
        };
        Outcome { frames, end }
    }

    /// Seeds: real frame streams, one chunked, one cut short, one with a too large prefix, one
    /// with a payload that is not protobuf, one with an empty `Frame`.
    pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
        let mut all = BytesMut::new();
        for kind in super::sample_kinds() {
            FrameCodec::encode_kind(kind, &mut all);
        }
        let mut ping = BytesMut::new();
        FrameCodec::encode_kind(Kind::Ping(rpc_core::wire::Ping { nonce: 1 }), &mut ping);
        let cut = &all[..all.len() - 3];
        let mut oversized = ping.to_vec();
        oversized.extend_from_slice(&(MAX_FRAME_LENGTH as u32 + 1).to_be_bytes());
        oversized.extend_from_slice(b"never read");
        let mut small_oversized = ping.to_vec();
        small_oversized.extend_from_slice(&(SMALL_MAX_FRAME_LENGTH as u32 + 1).to_be_bytes());
        small_oversized.extend_from_slice(&[0x32; 70]);
        vec![
            ("seed-all-kinds", input(false, &[], &all)),
            ("seed-all-kinds-chunked", input(false, &[2, 0, 13], &all)),
            ("seed-cut-short", input(false, &[7], cut)),
            ("seed-too-large", input(false, &[1, 4], &oversized)),
            ("seed-small-max", input(true, &[5], &small_oversized)),
            (
                "seed-malformed",
                input(false, &[], &[0, 0, 0, 3, 0xff, 0xff, 0xff]),
            ),
            ("seed-empty-frame", input(false, &[0], &[0, 0, 0, 0])),
        ]
    }
}

/// Target `frame`: protobuf decoding of the wire `Frame` message.
pub mod frame {
    use bytes::{BufMut, BytesMut};
    use prost::Message;
    use rpc_core::wire::Frame;
    use rpc_transport::{FrameCodec, FrameError};
    use tokio_util::codec::Decoder;

    /// Decodes `data` as a `Frame`; a frame that decodes must re-encode to `encoded_len` bytes
    /// that decode to the same frame and encode to the same bytes again, and must come back
    /// unchanged through [`FrameCodec`] with a maximum of exactly its length.
    pub fn check(data: &[u8]) {
        let Ok(frame) = Frame::decode(data) else {
            return;
        };
        let bytes = frame.encode_to_vec();
        assert_eq!(bytes.len(), frame.encoded_len(), "encoded_len");
        let again = Frame::decode(bytes.as_slice()).expect("a re-encoded Frame decodes");
        assert_eq!(again, frame, "round trip");
        assert_eq!(again.encode_to_vec(), bytes, "encoding is stable");

        let mut framed = BytesMut::new();
        framed.put_u32(bytes.len() as u32);
        framed.put_slice(&bytes);
        if let Some(kind) = frame.kind.clone() {
            let mut encoded = BytesMut::new();
            FrameCodec::encode_kind(kind, &mut encoded);
            assert_eq!(encoded, framed, "FrameCodec::encode_kind");
        }
        let decoded = FrameCodec::new(bytes.len()).decode(&mut framed);
        match (decoded, frame.kind) {
            (Ok(Some(got)), Some(kind)) => assert_eq!(got, kind, "through FrameCodec"),
            (Err(FrameError::Empty), None) => {}
            (other, kind) => panic!("FrameCodec gave {other:?} for {kind:?}"),
        }
        assert!(framed.is_empty(), "FrameCodec left bytes behind");
    }

    /// Seeds: the protobuf payload of one frame of each kind.
    pub fn seeds() -> Vec<(String, Vec<u8>)> {
        super::sample_kinds()
            .into_iter()
            .enumerate()
            .map(|(i, kind)| {
                (
                    format!("seed-{i}"),
                    Frame { kind: Some(kind) }.encode_to_vec(),
                )
            })
            .collect()
    }
}

/// Target `params`: decoding an argument list as a server does, with both codecs.
pub mod params {
    use std::collections::HashMap;
    use std::fmt::Debug;

    use rpc_core::{Codec, NoArgs};
    use serde::de::DeserializeOwned;
    use serde::{Deserialize, Serialize};

    /// A struct argument with nested collections, an option and an enum.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct Order {
        pub id: u64,
        pub customer: String,
        pub lines: Vec<Line>,
        pub tags: HashMap<String, Vec<u32>>,
        pub note: Option<String>,
        pub status: Status,
    }

    /// One line of an [`Order`].
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct Line {
        pub sku: String,
        pub quantity: u32,
        pub attributes: HashMap<String, String>,
    }

    /// Unit, struct and newtype variants.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub enum Status {
        Open,
        Paid { amount: u64 },
        Cancelled(String),
    }

    /// Decodes `data` with both codecs into several argument tuples. Each decode returns `Ok`
    /// or `Err` (never panics; libFuzzer's memory limits catch unbounded allocation), and a value
    /// that decodes encodes and decodes back to itself.
    pub fn check(data: &[u8]) {
        for codec in [Codec::MsgPack, Codec::Json] {
            round_trip::<(String, u64)>(codec, data);
            round_trip::<(Vec<u8>, Option<String>)>(codec, data);
            round_trip::<(Order,)>(codec, data);
            round_trip::<(u64, Vec<Order>, HashMap<String, Status>)>(codec, data);
            round_trip::<(bool, i64, char, Vec<Option<u32>>)>(codec, data);
            round_trip::<NoArgs>(codec, data);
        }
    }

    fn round_trip<T>(codec: Codec, data: &[u8])
    where
        T: DeserializeOwned + Serialize + PartialEq + Debug,
    {
        let Ok(value) = codec.decode::<T>(data) else {
            return;
        };
        let bytes = codec.encode(&value).expect("a decoded value encodes");
        let back: T = codec.decode(&bytes).expect("a re-encoded value decodes");
        assert_eq!(back, value, "{codec:?} round trip");
    }

    /// A sample [`Order`].
    pub fn order() -> Order {
        Order {
            id: 7,
            customer: "ann".into(),
            lines: vec![Line {
                sku: "tea-01".into(),
                quantity: 3,
                attributes: HashMap::from([("colour".into(), "grün".into())]),
            }],
            tags: HashMap::from([("gift".into(), vec![1, 2]), ("rush".into(), vec![])]),
            note: Some("ring twice".into()),
            status: Status::Paid { amount: 1250 },
        }
    }

    /// Seeds: real argument lists of each shape, in both codecs.
    pub fn seeds() -> Vec<(String, Vec<u8>)> {
        let statuses = HashMap::from([
            ("a".to_string(), Status::Open),
            ("b".to_string(), Status::Cancelled("late".into())),
        ]);
        let mut out = Vec::new();
        for (name, codec) in [("msgpack", Codec::MsgPack), ("json", Codec::Json)] {
            let seed =
                |what: &str, bytes: bytes::Bytes| (format!("seed-{name}-{what}"), bytes.to_vec());
            let enc = |r: Result<bytes::Bytes, rpc_core::CodecError>| r.expect("seed encodes");
            out.extend([
                seed("string-u64", enc(codec.encode(&("ann", 2u64)))),
                seed(
                    "bytes-option",
                    enc(codec.encode(&(vec![0u8, 1, 255], Some("x")))),
                ),
                seed(
                    "bytes-none",
                    enc(codec.encode(&(Vec::<u8>::new(), None::<String>))),
                ),
                seed("order", enc(codec.encode(&(order(),)))),
                seed(
                    "orders",
                    enc(codec.encode(&(9u64, vec![order()], &statuses))),
                ),
                seed(
                    "scalars",
                    enc(codec.encode(&(true, -5i64, 'ß', vec![Some(1u32), None]))),
                ),
                seed("no-args", enc(codec.encode(&NoArgs))),
            ]);
        }
        out
    }
}
