use rpc::RpcError;

#[rpc::service]
trait Orders {
    #[http(get = "/orders/{id}")]
    async fn get(&self, id: u64) -> Result<String, RpcError>;
    #[http(get = "/orders/{order}")]
    async fn fetch(&self, order: u64) -> Result<String, RpcError>;
    #[http(delete = "/orders/{id}")]
    async fn delete(&self, id: u64) -> Result<(), RpcError>;
}

fn main() {}
