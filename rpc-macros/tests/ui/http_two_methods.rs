use rpc::RpcError;

#[rpc::service]
trait Orders {
    #[http(get = "/orders/{id}", post = "/orders/{id}")]
    async fn get(&self, id: u64) -> Result<String, RpcError>;
}

fn main() {}
