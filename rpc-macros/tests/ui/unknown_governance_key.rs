use rpc::RpcError;

#[rpc::service]
trait Echo {
    #[governance(timeout_ms = 800, retries = 2)]
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

fn main() {}
