use rpc::RpcError;

#[rpc::service]
trait Orders {
    #[http(get = "/orders/{id}")]
    async fn get(&self, id: u64) -> Result<String, RpcError>;
    #[http(put = "/orders/{id}")]
    async fn put(&self, id: u64, note: String) -> Result<(), RpcError>;
    #[http(delete = "/orders/{order_id}")]
    async fn cancel(&self, order_id: u64) -> Result<(), RpcError>;
}

fn main() {}
