use rpc::RpcError;

#[rpc::service]
trait Orders {
    #[http(get = "/orders/{id}.json")]
    async fn get(&self, id: u64) -> Result<String, RpcError>;
}

fn main() {}
