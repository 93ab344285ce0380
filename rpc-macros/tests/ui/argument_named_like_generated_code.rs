use rpc::RpcError;

#[rpc::service]
trait Store {
    async fn put(&self, __rpc_codec: String) -> Result<(), RpcError>;
    async fn take(&self, r#__rpc_codec: String) -> Result<(), RpcError>;
}

fn main() {}
