use rpc::RpcError;

#[rpc::service]
trait Users {
    async fn get(&self, #[hash_key] tenant: u32, #[hash_key] user: u64) -> Result<String, RpcError>;
}

fn main() {}
