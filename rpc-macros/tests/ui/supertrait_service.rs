use rpc::RpcError;

#[rpc::service]
trait Base {
    async fn ping(&self) -> Result<(), RpcError>;
}

#[rpc::service]
trait Admin: Base + Send {
    async fn reset(&self) -> Result<(), RpcError>;
}

fn main() {}
