use rpc::{RpcError, RpcStream};

#[rpc::service]
trait Feed {
    async fn maybe(&self, items: Option<RpcStream<u8>>) -> Result<u64, RpcError>;
    async fn nested(&self) -> Result<RpcStream<RpcStream<u8>>, RpcError>;
}

fn main() {}
