//! The service of the shunting tests (`tests/tests/integration/shunting.rs`) and of the `hash-client`
//! program (`src/bin/hash-client.rs`), which calls it from a process of its own so that the test
//! can compare where separate processes send the same key.

use rpc::RpcError;

/// Every method answers with the name of the server that ran it.
#[rpc::service(name = "t.Shunt")]
pub trait Shunt {
    /// The server's name.
    async fn whoami(&self) -> Result<String, RpcError>;

    /// The server's name too: a second entry, spread by turns of its own.
    async fn whoami_too(&self) -> Result<String, RpcError>;

    /// The server's name; the call goes to the owner of `key` on the hash ring.
    #[governance(shunt_strategy = "hash")]
    async fn owner(&self, #[hash_key] key: String) -> Result<String, RpcError>;

    /// The key is the second argument; the first must not move the call.
    #[governance(shunt_strategy = "hash")]
    async fn owner_of_second(
        &self,
        noise: u64,
        #[hash_key] key: String,
    ) -> Result<String, RpcError>;
}

/// A server that answers with its name.
pub struct Named(pub String);

impl Shunt for Named {
    async fn whoami(&self) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
    async fn whoami_too(&self) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
    async fn owner(&self, _key: String) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
    async fn owner_of_second(&self, _noise: u64, _key: String) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
}
