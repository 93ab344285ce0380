//! Code generation without protoc: protox parses the .proto into a FileDescriptorSet in pure
//! Rust, tonic-prost-build generates the client, server and messages from it.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/items.proto");
    let fds = protox::compile(["proto/items.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
