use rpc::{RpcError, RpcStream};

#[rpc::service]
trait Orders {
    #[http(get = "/orders")]
    async fn watch(&self) -> Result<RpcStream<String>, RpcError>;
}

fn main() {}
