use rpc::RpcError;

#[rpc::service]
trait Store {
    async fn into(&self) -> Result<String, RpcError>;
}

fn main() {}
