use rpc::RpcError;

#[rpc::service(name = "shop/{v}")]
trait Shop {
    async fn buy(&self) -> Result<u64, RpcError>;
}

fn main() {}
