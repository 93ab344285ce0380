use rpc::RpcError;

#[rpc::service]
trait Store {
    async fn put<V: serde::Serialize>(&self, value: V) -> Result<(), RpcError>;
}

fn main() {}
