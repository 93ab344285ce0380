use std::collections::HashMap;

use rpc::RpcError;

#[rpc::service]
trait Shards {
    async fn shard(&self, #[hash_key] labels: HashMap<String, String>) -> Result<u32, RpcError>;
}

fn main() {}
