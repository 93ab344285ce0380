use rpc::{RpcError, RpcStream};

#[rpc::service]
trait Feed {
    #[governance(hedge_delay_ms = 50)]
    async fn ticks(&self) -> Result<RpcStream<u8>, RpcError>;
    async fn upload(&self, #[hash_key] user: u64, rows: RpcStream<u8>) -> Result<u64, RpcError>;
}

fn main() {}
