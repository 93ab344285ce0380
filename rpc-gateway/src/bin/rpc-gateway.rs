//! `rpc-gateway --registry URL --listen ADDR`: see the crate's documentation.

fn main() {}
