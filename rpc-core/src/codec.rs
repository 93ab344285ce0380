//! Parameter and result codecs: MessagePack (default) and JSON.

use bytes::Bytes;
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
    /// JSON.
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

/// How deeply arrays and maps may nest in decoded bytes, for both codecs: serde_json's fixed
/// limit, applied to MessagePack too so that both accept the same values. Decoding recurses once
/// per level; rmp-serde's own default (1024 levels) lets a peer overflow a 2 MiB thread stack
/// (a tokio worker's) in a debug build, which aborts the whole process.
const MAX_DEPTH: usize = 128;

impl Codec {
    /// Encodes a value. The argument list of a call is encoded as one tuple, which both codecs
    /// write as an array.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Result<Bytes, CodecError> {
        // Most argument lists and results are small: one allocation instead of several
        // doublings from an empty vector.
        let mut out = Vec::with_capacity(128);
        let result = match self {
            Codec::MsgPack => rmp_serde::encode::write_named(&mut out, value)
                .map(|()| out)
                .map_err(|e| e.to_string()),
            Codec::Json => serde_json::to_writer(&mut out, value)
                .map(|()| out)
                .map_err(|e| e.to_string()),
        };
        result.map(Bytes::from).map_err(|reason| CodecError {
            codec: self,
            op: "encoding",
            reason,
        })
    }

    /// Decodes a value.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, CodecError> {
        let result = match self {
            Codec::MsgPack => {
                let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
                de.set_max_depth(MAX_DEPTH);
                T::deserialize(&mut de).map_err(|e| e.to_string())
            }
            Codec::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
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
        deserializer.deserialize_seq(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
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

    #[test]
    fn no_args_is_an_empty_array() {
        for codec in [Codec::MsgPack, Codec::Json] {
            let bytes = codec.encode(&NoArgs).unwrap();
            let _: NoArgs = codec.decode(&bytes).unwrap();
        }
        assert_eq!(&Codec::MsgPack.encode(&NoArgs).unwrap()[..], &[0x90]);
        assert_eq!(&Codec::Json.encode(&NoArgs).unwrap()[..], b"[]");
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

    #[test]
    fn garbage_is_a_typed_error() {
        let err = Codec::MsgPack
            .decode::<(String,)>(&[0xc1, 0xff])
            .unwrap_err();
        assert!(err.to_string().contains("decoding failed"), "{err}");
    }
}
