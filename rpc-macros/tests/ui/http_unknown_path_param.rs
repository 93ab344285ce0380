use rpc::RpcError;

#[rpc::service]
trait Orders {
    #[http(get = "/orders/{order_id}")]
    async fn get(&self, id: u64, verbose: bool) -> Result<String, RpcError>;
}

fn main() {}
