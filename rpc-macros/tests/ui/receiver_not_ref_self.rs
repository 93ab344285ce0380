use rpc::RpcError;

#[rpc::service]
trait Counter {
    async fn bump(&mut self) -> Result<u64, RpcError>;
}

fn main() {}
