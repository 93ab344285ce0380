//! Fuzz target `params`: arbitrary bytes decoded as a server decodes an argument list, with
//! `rpc_core::Codec::MsgPack` and `Codec::Json`, into several argument tuples (strings and
//! integers, bytes and options, a struct with nested `Vec`/`HashMap` and an enum, no arguments).
//!
//! Checks that every decode returns `Ok` or `Err` and never panics or allocates without bound
//! (libFuzzer's `-rss_limit_mb`/`-malloc_limit_mb`, left at their defaults), and that a value
//! which decodes encodes and decodes back to itself. Checks: `rpc_fuzz::params`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rpc_fuzz::params::check(data));
