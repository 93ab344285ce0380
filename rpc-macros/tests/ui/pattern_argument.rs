use rpc::RpcError;

#[rpc::service]
trait Geometry {
    async fn area(&self, (w, h): (u32, u32)) -> Result<u64, RpcError>;
}

fn main() {}
