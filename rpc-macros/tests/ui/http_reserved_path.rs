use rpc::RpcError;

#[rpc::service]
trait Health {
    #[http(get = "/healthz")]
    async fn check(&self) -> Result<String, RpcError>;
}

fn main() {}
