use rpc::RpcError;

#[rpc::service]
trait Orders {
    #[http(head = "/orders/{id}")]
    async fn get(&self, id: u64) -> Result<String, RpcError>;
}

fn main() {}
