use rpc::RpcError;

#[rpc::service]
trait Store {
    async fn to_owned(&self) -> Result<String, RpcError>;
}

fn main() {}
