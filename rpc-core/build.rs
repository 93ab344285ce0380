//! Generates the wire types from `proto/rpc.proto` with `protox` (a protobuf compiler written in
//! Rust), so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = "../proto";
    let proto = "../proto/rpc.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], [proto_dir])?;
    prost_build::Config::new()
        // `bytes` fields become `bytes::Bytes`: decoding slices the frame instead of copying.
        .bytes(["."])
        // Ordered maps: no hasher state per message, and a stable encoding order.
        .btree_map(["."])
        .compile_fds(descriptors)?;
    Ok(())
}
