//! Protobuf wire types generated from `proto/rpc.proto` (package `rpc.v1`).
//!
//! See that file for the meaning of every field; the framing (4-byte big-endian length prefix) is
//! applied by `rpc-transport`.
#![allow(missing_docs)]

include!(concat!(env!("OUT_DIR"), "/rpc.v1.rs"));
