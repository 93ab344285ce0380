use rpc::RpcError;

#[rpc::service]
trait Store {
    async fn get(&self) -> Result<u32, RpcError>;
    #[cfg(feature = "writes")]
    async fn put(&self, value: u32) -> Result<(), RpcError>;
}

fn main() {}
