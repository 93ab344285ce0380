//! Fuzz target `frame_decoder`: arbitrary bytes, cut into chunks the input chooses, through
//! `rpc_transport::FrameCodec` (maximum frame 64 KiB, or 64 bytes when the input asks).
//!
//! Checks that decoding never panics; that a length prefix above the maximum is refused as soon
//! as its four bytes are buffered, before any of the payload; that what stays buffered is less
//! than one frame of the maximum; and that one chunk, a byte at a time and the chosen chunks all
//! give the same frames and the same end (error or leftover bytes) as a plain reading of the
//! format. Input layout and checks: `rpc_fuzz::frame_decoder`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rpc_fuzz::frame_decoder::check(data));
