use rpc::RpcError;

#[rpc::service]
trait Files {
    #[http(get = "/files/a%2fb")]
    async fn one(&self) -> Result<String, RpcError>;
    #[http(get = "/files/a%2Fb")]
    async fn two(&self) -> Result<String, RpcError>;
    #[http(put = "/files/c%2Fd")]
    async fn three(&self) -> Result<(), RpcError>;
    #[http(delete = "/files/c%2fd")]
    async fn four(&self) -> Result<(), RpcError>;
}

fn main() {}
