use rpc::RpcError;

#[rpc::service]
trait Echo {
    #[governance(timeout_ms = "800", shunt_strategy = "nearest")]
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

fn main() {}
