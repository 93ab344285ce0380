use rpc::RpcError;

#[rpc::service]
trait Lookup {
    async fn find(&self, key: Option<&str>) -> Result<u64, RpcError>;
    async fn name(&self) -> Result<&'static str, RpcError>;
    async fn names(&self) -> Result<Vec<impl serde::Serialize>, RpcError>;
}

fn main() {}
