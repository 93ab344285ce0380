//! Protobuf wire types generated from `proto/rpc.proto` (package `rpc.v1`).
//!
//! Every item's documentation is that file's comment on it (the file's opening comment is the
//! protocol as a whole); the framing (4-byte big-endian length prefix) is applied by
//! `rpc-transport`.

include!(concat!(env!("OUT_DIR"), "/rpc.v1.rs"));
