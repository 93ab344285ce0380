use rpc::RpcError;

#[rpc::service]
trait Files {
    #[http(get = "/files/{*path}")]
    async fn get(&self, path: String) -> Result<String, RpcError>;
    #[http(get = "/kinds/{r#type}")]
    async fn kind(&self, r#type: String) -> Result<String, RpcError>;
}

#[rpc::service]
#[http(get = "/all")]
trait Misplaced {
    async fn all(&self) -> Result<(), RpcError>;
}

fn main() {}
