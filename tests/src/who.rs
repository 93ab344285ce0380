//! The service of the registry tests (`tests/tests/integration/etcd.rs`, `zookeeper.rs`,
//! `registry_suite.rs`) and of the `registry-server` program (`src/bin/registry-server.rs`): it
//! answers with the name of the server, so that a test sees which instance a call reached.

use rpc::RpcError;

/// Answers with the server's name.
#[rpc::service(name = "t.Who")]
pub trait Who {
    /// The name of the server that ran the call.
    async fn whoami(&self) -> Result<String, RpcError>;
}

/// A server with a name.
pub struct Node(pub String);

impl Who for Node {
    async fn whoami(&self) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
}
