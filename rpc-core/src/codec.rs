//! Parameter and result codecs: MessagePack (default) and JSON.

use std::cell::RefCell;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::ser::SerializeTuple;
use serde::{Deserialize, Serialize};

use crate::wire;

/// How parameters and results are encoded (`RemoteInvokeMessage.codec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// MessagePack with structs as maps keyed by field name. The default.
    #[default]
    #[serde(alias = "msgpack")]
    MsgPack,
    /// JSON. A finite float reads back as the same value; a NaN or infinity is written as
    /// `null` (JSON has no other way to write it), which reads back as `None` in an `Option`
    /// and fails to decode as a float: use MessagePack where such values travel.
    Json,
}

/// A value could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
#[error("{codec:?} {op} failed: {reason}")]
pub struct CodecError {
    codec: Codec,
    op: &'static str,
    reason: String,
}

/// Size of the per-thread buffer encoded values are cut from (see [`Codec::encode`]).
const ARENA: usize = 16 * 1024;

thread_local! {
    static ARENA_BUF: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// How deeply arrays and maps may nest in decoded bytes, for both codecs: serde_json's fixed
/// limit, applied to MessagePack too so that both accept the same values. Decoding recurses once
/// per level; rmp-serde's own default (1024 levels) lets a peer overflow a 2 MiB thread stack
/// (a tokio worker's) in a debug build, which aborts the whole process.
const MAX_DEPTH: usize = 128;

/// A MessagePack decoder over bytes in memory (see [`read_msgpack`]).
pub type MsgPackReader<'de> = rmp_serde::Deserializer<rmp_serde::decode::ReadRefReader<'de, [u8]>>;

/// Reads the one MessagePack value of `bytes` with `read` (a value's `Deserialize`, a seed, a
/// transcoder), nested no deeper than both codecs allow; an error when bytes follow the value,
/// as the JSON codec refuses text after its value. Bytes after a value are not what a peer
/// encodes: a length that lies, or two values run together, which reading the first alone
/// would hide.
pub fn read_msgpack<'de, T, E: std::fmt::Display>(
    bytes: &'de [u8],
    read: impl FnOnce(&mut MsgPackReader<'de>) -> Result<T, E>,
) -> Result<T, String> {
    check_msgpack_depth(bytes)?;
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_DEPTH);
    let value = read(&mut de).map_err(|e| e.to_string())?;
    // Reading on finds the end (no marker to read) or bytes of another value. Only a marker's
    // read reports the end as `InvalidMarkerRead`: a cut-short length or payload is a data
    // read's error, and the visitor refuses an array, map or ext before its elements' markers
    // are read. So that error is the end of the bytes right after the value.
    match serde::Deserializer::deserialize_any(&mut de, NothingMore) {
        Err(rmp_serde::decode::Error::InvalidMarkerRead(e))
            if e.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Ok(value)
        }
        _ => Err(format!(
            "bytes follow the value ({} bytes in all): the payload must be one MessagePack value",
            bytes.len()
        )),
    }
}

/// Refuses a MessagePack value whose arrays, maps and ext values nest [`MAX_DEPTH`] deep,
/// before anything is decoded. rmp-serde's own limit counts only what it reads through
/// `deserialize_any`: an enum's variant (a map of one entry) read by `deserialize_enum` is no
/// level to it, so a recursive enum argument (`Not(Box<Expr>)`) would nest without bound and
/// overflow the stack. This walk counts every container by its marker, whatever type reads it.
/// Bytes that end early or hold no value are left to the decoder, which refuses them.
fn check_msgpack_depth(bytes: &[u8]) -> Result<(), String> {
    // Each level takes a byte at least: fewer bytes cannot nest that deep.
    if bytes.len() < MAX_DEPTH {
        return Ok(());
    }
    let deep = || {
        format!("depth limit exceeded: the value nests {MAX_DEPTH} arrays or maps deep, or deeper")
    };
    // Values still to read in each open container, innermost last.
    let mut open: Vec<u64> = Vec::new();
    let mut at = 0;
    loop {
        let Some((children, size)) = msgpack_header(&bytes[at.min(bytes.len())..]) else {
            return Ok(());
        };
        at = at.saturating_add(size);
        if let Some(children) = children {
            if open.len() + 1 >= MAX_DEPTH {
                return Err(deep());
            }
            if children > 0 {
                open.push(children);
                continue;
            }
        }
        // A value is complete: so is each container it was the last value of.
        loop {
            let Some(left) = open.last_mut() else {
                return Ok(());
            };
            *left -= 1;
            if *left > 0 {
                break;
            }
            open.pop();
        }
    }
}

/// The MessagePack value starting `b`: the values it contains when it is an array or a map
/// (`Some`, a map's entries counting two; an ext value as an empty container), and the bytes
/// of its marker, lengths and own payload; `None` when `b` is empty, cut short or not a
/// value.
fn msgpack_header(b: &[u8]) -> Option<(Option<u64>, usize)> {
    let marker = *b.first()?;
    let be = |n: usize| -> Option<u64> {
        let bytes = b.get(1..1 + n)?;
        Some(bytes.iter().fold(0u64, |acc, &x| acc << 8 | u64::from(x)))
    };
    let sized = |len: u64, head: usize| Some((None, head.checked_add(usize::try_from(len).ok()?)?));
    match marker {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Some((None, 1)),
        0x80..=0x8f => Some((Some(2 * u64::from(marker & 0x0f)), 1)),
        0x90..=0x9f => Some((Some(u64::from(marker & 0x0f)), 1)),
        0xa0..=0xbf => sized(u64::from(marker & 0x1f), 1),
        0xcc | 0xd0 => Some((None, 2)),
        0xcd | 0xd1 => Some((None, 3)),
        0xca | 0xce | 0xd2 => Some((None, 5)),
        0xcb | 0xcf | 0xd3 => Some((None, 9)),
        0xc4 | 0xd9 => sized(be(1)?, 2),
        0xc5 | 0xda => sized(be(2)?, 3),
        0xc6 | 0xdb => sized(be(4)?, 5),
        // Ext values: a type byte and opaque data, a level to rmp-serde.
        0xd4 => Some((Some(0), 3)),
        0xd5 => Some((Some(0), 4)),
        0xd6 => Some((Some(0), 6)),
        0xd7 => Some((Some(0), 10)),
        0xd8 => Some((Some(0), 18)),
        0xc7 => Some((Some(0), 3usize.checked_add(usize::try_from(be(1)?).ok()?)?)),
        0xc8 => Some((Some(0), 4usize.checked_add(usize::try_from(be(2)?).ok()?)?)),
        0xc9 => Some((Some(0), 6usize.checked_add(usize::try_from(be(4)?).ok()?)?)),
        0xdc => Some((Some(be(2)?), 3)),
        0xdd => Some((Some(be(4)?), 5)),
        0xde => Some((Some(2 * be(2)?), 3)),
        0xdf => Some((Some(2 * be(4)?), 5)),
        0xc1 => None,
    }
}

/// A visitor that takes no value at all (see [`read_msgpack`]).
struct NothingMore;

impl serde::de::Visitor<'_> for NothingMore {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the end of the bytes")
    }
}

impl Codec {
    /// Encodes a value. The argument list of a call is encoded as one tuple, which both codecs
    /// write as an array.
    ///
    /// The bytes are cut from a per-thread buffer of 16 KiB that many encoded values
    /// share, so encoding a small value allocates nothing most of the time; the buffer is freed
    /// once the last value cut from it is dropped.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Result<Bytes, CodecError> {
        ARENA_BUF
            .with(|arena| match arena.try_borrow_mut() {
                Ok(mut buf) => self.encode_into(&mut buf, value),
                // Only reachable if a value's `Serialize` encodes another value with a codec.
                Err(_) => self.encode_into(&mut BytesMut::new(), value),
            })
            .map_err(|reason| CodecError {
                codec: self,
                op: "encoding",
                reason,
            })
    }

    /// Encodes a value onto the end of `dst` and returns how many bytes it took: the same
    /// bytes [`encode`](Self::encode) returns, written where the caller wants them (a frame
    /// being assembled, say), with no buffer of their own to allocate, share or free. When
    /// encoding fails, `dst` is left as it was.
    pub fn encode_to<T: Serialize + ?Sized>(
        self,
        dst: &mut BytesMut,
        value: &T,
    ) -> Result<usize, CodecError> {
        let start = dst.len();
        let written = self.write(&mut dst.writer(), value);
        match written {
            Ok(()) => Ok(dst.len() - start),
            Err(reason) => {
                dst.truncate(start);
                Err(CodecError {
                    codec: self,
                    op: "encoding",
                    reason,
                })
            }
        }
    }

    /// Writes `value` in this codec to `out`.
    fn write<T: Serialize + ?Sized>(
        self,
        out: &mut impl std::io::Write,
        value: &T,
    ) -> Result<(), String> {
        match self {
            Codec::MsgPack => rmp_serde::encode::write_named(out, value).map_err(|e| e.to_string()),
            Codec::Json => serde_json::to_writer(out, value).map_err(|e| e.to_string()),
        }
    }

    fn encode_into<T: Serialize + ?Sized>(
        self,
        buf: &mut BytesMut,
        value: &T,
    ) -> Result<Bytes, String> {
        // Empty after every value cut from it, unless a value's `Serialize` panicked halfway
        // (the thread goes on, a tokio worker say): its bytes must not lead the next value.
        buf.clear();
        if buf.capacity() < ARENA / 8 {
            // Reuses the buffer when every value cut from it is gone, else starts a new one.
            buf.reserve(ARENA);
        }
        let written = self.write(&mut buf.writer(), value);
        match written {
            Ok(()) => Ok(buf.split().freeze()),
            Err(e) => {
                buf.clear();
                Err(e)
            }
        }
    }

    /// Decodes a value.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, CodecError> {
        let result = match self {
            Codec::MsgPack => read_msgpack(bytes, |de| T::deserialize(de)),
            Codec::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
        };
        result.map_err(|reason| CodecError {
            codec: self,
            op: "decoding",
            reason,
        })
    }

    /// `bytes`, one value encoded by this codec, encoded by `to` instead, value by value (a
    /// MessagePack binary becomes a JSON array of numbers, an integer map key a string; what
    /// JSON cannot say, such as those keys read back as integers, does not come back).
    pub fn transcode(self, bytes: &[u8], to: Codec) -> Result<Bytes, CodecError> {
        if self == to {
            return Ok(Bytes::copy_from_slice(bytes));
        }
        let fail = |reason: String| CodecError {
            codec: self,
            op: "transcoding",
            reason,
        };
        let mut out = Vec::new();
        match (self, to) {
            (Codec::MsgPack, _) => read_msgpack(bytes, |de| {
                serde_transcode::transcode(de, &mut serde_json::Serializer::new(&mut out))
            })
            .map_err(fail)?,
            (Codec::Json, _) => {
                let mut de = serde_json::Deserializer::from_slice(bytes);
                serde_transcode::transcode(&mut de, &mut rmp_serde::Serializer::new(&mut out))
                    .map_err(|e| fail(e.to_string()))?;
                de.end().map_err(|e| fail(e.to_string()))?;
            }
        }
        Ok(Bytes::from(out))
    }

    /// Decodes a value through a [`DeserializeSeed`](serde::de::DeserializeSeed): a decoder
    /// that carries state, such as the names of a method's arguments for its errors. Same
    /// limits as [`decode`](Self::decode).
    pub fn decode_seed<'de, T: serde::de::DeserializeSeed<'de>>(
        self,
        seed: T,
        bytes: &'de [u8],
    ) -> Result<T::Value, CodecError> {
        let result = match self {
            Codec::MsgPack => read_msgpack(bytes, |de| seed.deserialize(de)),
            Codec::Json => {
                let mut de = serde_json::Deserializer::from_slice(bytes);
                seed.deserialize(&mut de)
                    .and_then(|v| de.end().map(|()| v))
                    .map_err(|e| e.to_string())
            }
        };
        result.map_err(|reason| CodecError {
            codec: self,
            op: "decoding",
            reason,
        })
    }

    /// The codec's number on the wire.
    pub fn to_wire(self) -> i32 {
        match self {
            Codec::MsgPack => wire::Codec::Msgpack as i32,
            Codec::Json => wire::Codec::Json as i32,
        }
    }

    /// The codec for a number received from the wire, if known.
    pub fn from_wire(n: i32) -> Option<Self> {
        match wire::Codec::try_from(n).ok()? {
            wire::Codec::Msgpack => Some(Codec::MsgPack),
            wire::Codec::Json => Some(Codec::Json),
        }
    }
}

/// The argument list of a method without arguments: an empty array on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoArgs;

impl Serialize for NoArgs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_tuple(0)?.end()
    }
}

impl<'de> Deserialize<'de> for NoArgs {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Accept any (normally empty) array: extra trailing arguments from a newer client are
        // ignored, as they would be by a positional decoder.
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = NoArgs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an empty argument array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<NoArgs, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(NoArgs)
            }
            fn visit_unit<E>(self) -> Result<NoArgs, E> {
                Ok(NoArgs)
            }
        }
        // (Any, not a sequence: serde_json refuses `null` before a sequence's visitor sees it,
        // where rmp-serde hands nil on. Both codecs take nil/null alike.)
        deserializer.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
    struct Profile {
        id: u64,
        name: String,
    }

    #[test]
    fn argument_list_is_one_array() {
        let p = Profile {
            id: 1,
            name: "x".into(),
        };
        let bytes = Codec::MsgPack.encode(&("ann", 2u32, &p)).unwrap();
        // fixarray of 3
        assert_eq!(bytes[0], 0x93);
        let back: (String, u32, Profile) = Codec::MsgPack.decode(&bytes).unwrap();
        assert_eq!(back, ("ann".into(), 2, p));
        let json = Codec::Json.encode(&("ann", 2u32)).unwrap();
        assert_eq!(&json[..], br#"["ann",2]"#);
    }

    /// Doubles whose shortest text a reader that rounds twice reads one step off (serde_json's
    /// own cases of its `float_roundtrip` feature), and their neighbours: each reads back bit
    /// for bit, with either codec and through a transcoding from one to the other.
    #[test]
    fn every_finite_float_reads_back_as_written() {
        let mut floats = vec![f64::MIN_POSITIVE, f64::MAX, -0.0, 1e-300, 0.1];
        for x in [
            51.248178375505404_f64,
            -93.31137037688033,
            97.45365320034685,
        ] {
            floats.extend([
                x,
                f64::from_bits(x.to_bits() + 1),
                f64::from_bits(x.to_bits() - 1),
            ]);
        }
        for codec in [Codec::MsgPack, Codec::Json] {
            for x in &floats {
                let bytes = codec.encode(&(x,)).unwrap();
                let (back,): (f64,) = codec.decode(&bytes).unwrap();
                assert_eq!(back.to_bits(), x.to_bits(), "{codec:?} {x}");
                let other = match codec {
                    Codec::MsgPack => Codec::Json,
                    Codec::Json => Codec::MsgPack,
                };
                let recoded = codec.transcode(&bytes, other).unwrap();
                let (back,): (f64,) = other.decode(&recoded).unwrap();
                assert_eq!(back.to_bits(), x.to_bits(), "{codec:?} to {other:?} {x}");
            }
        }
    }

    #[test]
    fn no_args_is_an_empty_array() {
        for codec in [Codec::MsgPack, Codec::Json] {
            let bytes = codec.encode(&NoArgs).unwrap();
            let _: NoArgs = codec.decode(&bytes).unwrap();
        }
        assert_eq!(&Codec::MsgPack.encode(&NoArgs).unwrap()[..], &[0x90]);
        assert_eq!(&Codec::Json.encode(&NoArgs).unwrap()[..], b"[]");
        // No arguments sent as nil or null: taken by both codecs alike; anything else refused.
        assert!(Codec::MsgPack.decode::<NoArgs>(&[0xc0]).is_ok());
        assert!(Codec::Json.decode::<NoArgs>(b"null").is_ok());
        assert!(Codec::MsgPack.decode::<NoArgs>(&[0x07]).is_err());
        assert!(Codec::Json.decode::<NoArgs>(b"7").is_err());
    }

    #[test]
    fn both_codecs_refuse_the_same_nesting() {
        // `depth` nested arrays: [[[...]]], decoded into a type that follows the nesting.
        let msgpack = |depth: usize| -> Vec<u8> {
            let mut bytes = vec![0x91; depth - 1];
            bytes.push(0x90);
            bytes
        };
        let json = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        for (depth, ok) in [(MAX_DEPTH - 1, true), (MAX_DEPTH, false)] {
            let decoded = Codec::MsgPack.decode::<serde_json::Value>(&msgpack(depth));
            assert_eq!(
                decoded.is_ok(),
                ok,
                "MessagePack, depth {depth}: {decoded:?}"
            );
            let decoded = Codec::Json.decode::<serde_json::Value>(json(depth).as_bytes());
            assert_eq!(decoded.is_ok(), ok, "JSON, depth {depth}: {decoded:?}");
        }
    }

    /// A recursive enum argument nests as deep as arrays do in both codecs: in MessagePack
    /// each variant is a map of one entry, which rmp-serde's own depth limit does not count,
    /// so a peer could nest it until the stack overflowed.
    #[test]
    fn a_recursive_enum_nests_no_deeper_than_arrays_in_either_codec() {
        #[derive(Debug, serde::Serialize, serde::Deserialize)]
        enum Expr {
            Not(Box<Expr>),
            Lit(bool),
        }
        let nested = |depth: usize| {
            let mut e = Expr::Lit(true);
            for _ in 1..depth {
                e = Expr::Not(Box::new(e));
            }
            e
        };
        for (depth, ok) in [
            (MAX_DEPTH - 1, true),
            (MAX_DEPTH, false),
            (10 * MAX_DEPTH, false),
        ] {
            // Encoded by the serializers themselves (which have no limit), not by hand.
            let msgpack = rmp_serde::to_vec(&nested(depth)).unwrap();
            let decoded = Codec::MsgPack.decode::<Expr>(&msgpack);
            assert_eq!(
                decoded.is_ok(),
                ok,
                "MessagePack, depth {depth}: {decoded:?}"
            );
            let json = serde_json::to_vec(&nested(depth)).unwrap();
            let decoded = Codec::Json.decode::<Expr>(&json);
            assert_eq!(decoded.is_ok(), ok, "JSON, depth {depth}: {decoded:?}");
        }
    }

    /// The depth walk reads every kind of value, so what lies beside deep values is skipped
    /// whole: a long string or bin is no nesting, a wide shallow array no depth.
    #[test]
    fn the_depth_walk_skips_payloads_and_counts_only_nesting() {
        type Row = (String, Vec<u8>, f64, i64, Option<u8>);
        let wide: Vec<Row> = (0..200)
            .map(|i| ("x".repeat(300), vec![0x91; 500], 0.5, -i, None))
            .collect();
        let bytes = Codec::MsgPack.encode(&wide).unwrap();
        assert!(check_msgpack_depth(&bytes).is_ok());
        let back: Vec<Row> = Codec::MsgPack.decode(&bytes).unwrap();
        assert_eq!(back, wide);
    }

    /// Whatever follows a whole value is refused: a value, a value cut short, a byte no value
    /// starts with; the value alone is read.
    #[test]
    fn bytes_after_a_messagepack_value_are_a_typed_error() {
        let value = rmp_serde::to_vec(&("hi", 7u32)).unwrap();
        let read = |bytes: &[u8]| Codec::MsgPack.decode::<(String, u32)>(bytes);
        assert_eq!(read(&value).unwrap(), ("hi".to_string(), 7));
        // One more value (a 1), an array of two with none, a str of 3 bytes with one, a bin
        // whose length is missing, the byte no value starts with.
        let tails: [&[u8]; 5] = [&[0x01], &[0x92], &[0xa3, b'a'], &[0xc4], &[0xc1]];
        for tail in tails {
            let bytes = [value.as_slice(), tail].concat();
            let err = read(&bytes).unwrap_err().to_string();
            assert!(err.contains("bytes follow the value"), "{tail:x?}: {err}");
        }
    }

    #[test]
    fn garbage_is_a_typed_error() {
        let err = Codec::MsgPack
            .decode::<(String,)>(&[0xc1, 0xff])
            .unwrap_err();
        assert!(err.to_string().contains("decoding failed"), "{err}");
    }

    /// A value whose encoding fails halfway, after some bytes are written.
    struct FailsHalfway;

    impl Serialize for FailsHalfway {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut t = serializer.serialize_tuple(2)?;
            t.serialize_element("written before the failure")?;
            t.serialize_element(&Unencodable)?;
            t.end()
        }
    }

    struct Unencodable;

    impl Serialize for Unencodable {
        fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom("cannot encode this"))
        }
    }

    #[test]
    fn values_cut_from_the_shared_buffer_stay_apart() {
        for codec in [Codec::MsgPack, Codec::Json] {
            // Enough values, small and large, kept alive together to fill several buffers.
            let values: Vec<(u32, String)> = (0..2_000u32)
                .map(|i| (i, "x".repeat((i as usize * 37) % (3 * ARENA / 2))))
                .collect();
            let encoded: Vec<Bytes> = values.iter().map(|v| codec.encode(v).unwrap()).collect();
            // A failed encoding leaves nothing behind for the next value.
            assert!(codec.encode(&FailsHalfway).is_err());
            let after = codec.encode(&(7u32, "after")).unwrap();
            for (value, bytes) in values.iter().zip(&encoded) {
                assert_eq!(&codec.decode::<(u32, String)>(bytes).unwrap(), value);
            }
            assert_eq!(
                codec.decode::<(u32, String)>(&after).unwrap(),
                (7, "after".to_string())
            );
        }
    }

    /// Writes part of a tuple, then panics (an `unwrap` in a `serialize_with`, say).
    struct PanicsHalfway;

    impl Serialize for PanicsHalfway {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut t = serializer.serialize_tuple(2)?;
            t.serialize_element("written before the panic")?;
            panic!("a value's Serialize panicked");
        }
    }

    /// A value whose `Serialize` panics halfway leaves nothing in the thread's buffer for the
    /// next value encoded on the thread: before, its bytes led that value's encoding.
    #[test]
    fn a_panic_while_encoding_leaves_nothing_for_the_next_value() {
        for codec in [Codec::MsgPack, Codec::Json] {
            let fresh = codec.encode(&(7u32, "after")).unwrap();
            let panicked = std::panic::catch_unwind(|| codec.encode(&PanicsHalfway));
            assert!(panicked.is_err());
            let after = codec.encode(&(7u32, "after")).unwrap();
            assert_eq!(after, fresh, "{codec:?}");
        }
    }

    #[test]
    fn encode_to_appends_what_each_codec_writes_itself() {
        let p = Profile {
            id: 7,
            name: "ünïcode".into(),
        };
        let values = [
            (
                1u32,
                "a".to_string(),
                Profile {
                    id: 0,
                    name: String::new(),
                },
            ),
            (u32::MAX, "x".repeat(300), p),
        ];
        for codec in [Codec::MsgPack, Codec::Json] {
            let mut dst = BytesMut::from(&b"head"[..]);
            let mut expected = b"head".to_vec();
            for value in &values {
                // The oracle: the libraries' own encodings (structs as maps for MessagePack).
                let own = match codec {
                    Codec::MsgPack => rmp_serde::to_vec_named(value).unwrap(),
                    Codec::Json => serde_json::to_vec(value).unwrap(),
                };
                let n = codec.encode_to(&mut dst, value).unwrap();
                assert_eq!(n, own.len(), "{codec:?}");
                expected.extend_from_slice(&own);
                // And what `encode` gives: the same bytes.
                assert_eq!(&codec.encode(value).unwrap()[..], &own[..], "{codec:?}");
            }
            assert_eq!(&dst[..], &expected[..], "{codec:?}");
            // Decoded back from the buffer by slice, after the leading bytes.
            let first = values[0].clone();
            let n0 = match codec {
                Codec::MsgPack => rmp_serde::to_vec_named(&first).unwrap().len(),
                Codec::Json => serde_json::to_vec(&first).unwrap().len(),
            };
            let back: (u32, String, Profile) = codec.decode(&dst[4..4 + n0]).unwrap();
            assert_eq!(back, first);
        }
    }

    #[test]
    fn encode_to_leaves_the_buffer_as_it_was_when_encoding_fails() {
        for codec in [Codec::MsgPack, Codec::Json] {
            let mut dst = BytesMut::from(&b"kept"[..]);
            let err = codec.encode_to(&mut dst, &FailsHalfway).unwrap_err();
            assert!(err.to_string().contains("cannot encode this"), "{err}");
            assert_eq!(&dst[..], b"kept", "{codec:?}");
        }
    }

    #[test]
    fn a_value_encoding_another_value_still_encodes() {
        /// Encodes a value with a codec while being encoded itself, and is written as that
        /// value's length.
        struct Nested;
        impl Serialize for Nested {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let inner = Codec::MsgPack
                    .encode(&("inner", 1u8))
                    .map_err(serde::ser::Error::custom)?;
                serializer.serialize_u64(inner.len() as u64)
            }
        }
        // ["inner", 1] in MessagePack: a fixarray of 2 (1 byte), a fixstr of 5 (1 + 5 bytes)
        // and a positive fixint (1 byte).
        let expected = 8;
        let outer = Codec::MsgPack.encode(&("before", Nested, "after")).unwrap();
        let decoded: (String, u64, String) = Codec::MsgPack.decode(&outer).unwrap();
        assert_eq!(decoded, ("before".into(), expected, "after".into()));
    }
}
