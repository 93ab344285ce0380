use rpc::RpcError;

#[rpc::service]
#[governance(timeout_ms = 500)]
trait Store {
    #[hash_key]
    async fn get(&self, key: String) -> Result<String, RpcError>;
    async fn put(&self, #[governance(timeout_ms = 1)] key: String) -> Result<(), RpcError>;
}

fn main() {}
