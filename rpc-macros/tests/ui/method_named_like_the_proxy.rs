use rpc::RpcError;

#[rpc::service]
trait Store {
    async fn client(&self) -> Result<String, RpcError>;
}

fn main() {}
