use rpc::RpcError;

#[rpc::service]
trait Echo {
    fn echo(&self, text: String) -> Result<String, RpcError>;
}

fn main() {}
