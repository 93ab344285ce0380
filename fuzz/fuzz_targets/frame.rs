//! Fuzz target `frame`: arbitrary bytes decoded as the protobuf wire `Frame`
//! (`rpc_core::wire::Frame`).
//!
//! Checks that decoding never panics, and that a frame which decodes re-encodes to
//! `encoded_len` bytes that decode to the same frame and encode to the same bytes again, and
//! passes unchanged through `rpc_transport::FrameCodec` (an empty `Frame` gives the typed
//! `FrameError::Empty`). Checks: `rpc_fuzz::frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rpc_fuzz::frame::check(data));
