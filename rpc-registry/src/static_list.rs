//! A fixed list of endpoints: from code, the command line or a TOML file.

use std::path::Path;

use futures_util::future::{self, BoxFuture};
use rpc_core::ServiceId;
use serde::Deserialize;
use tokio::sync::watch;

use crate::instance::snapshot;
use crate::{Instance, Registry, RegistryError, ServiceWatch};

/// A registry whose endpoints never change: several processes on one machine, no registry
/// server. Registering and deregistering are accepted and ignored.
///
/// An endpoint listed without services serves every service. Each endpoint's instance id (its
/// `id`, or else its address) must be unique in the list.
///
/// The file form (TOML):
///
/// ```toml
/// [[endpoint]]
/// address = "127.0.0.1:9001"
///
/// [[endpoint]]
/// address = "127.0.0.1:9002"
/// services = ["echo.Echo"]
/// id = "echo-2"                 # optional: the instance id (default: the address)
/// metadata = { shard = "b" }    # optional
/// ```
///
/// `id` and `metadata` are what a client's hash ring can be keyed by (`RingKey` in
/// `rpc-client`), so a shard moved to another port in the file keeps its keys.
#[derive(Debug, Clone)]
pub struct StaticRegistry {
    endpoints: Vec<StaticEndpoint>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticEndpoint {
    address: String,
    #[serde(default)]
    services: Vec<ServiceId>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    metadata: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticFile {
    #[serde(default)]
    endpoint: Vec<StaticEndpoint>,
}

impl StaticRegistry {
    /// Every address serves every service. The addresses are taken as given, not checked:
    /// [`from_list`](Self::from_list) refuses one that is not `host:port` (or `unix:PATH`) and
    /// one listed twice, with an error saying which.
    pub fn new<S: Into<String>>(addresses: impl IntoIterator<Item = S>) -> Self {
        StaticRegistry {
            endpoints: addresses
                .into_iter()
                .map(|a| StaticEndpoint {
                    address: a.into(),
                    services: Vec::new(),
                    id: None,
                    metadata: Default::default(),
                })
                .collect(),
        }
    }

    /// Parses a comma-separated list such as `"127.0.0.1:9001,127.0.0.1:9002"`.
    pub fn from_list(list: &str) -> Result<Self, RegistryError> {
        let addrs: Vec<&str> = list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if addrs.is_empty() {
            return Err(RegistryError::Config(format!(
                "no endpoint in {list:?}: expected host:port[,host:port...]"
            )));
        }
        for a in &addrs {
            check_address(a)?;
        }
        let registry = Self::new(addrs);
        registry.check_unique_ids()?;
        Ok(registry)
    }

    /// Parses the TOML form (see the type's documentation).
    pub fn from_toml(text: &str) -> Result<Self, RegistryError> {
        let file: StaticFile = toml::from_str(text)
            .map_err(|e| RegistryError::Config(format!("static registry file: {e}")))?;
        if file.endpoint.is_empty() {
            return Err(RegistryError::Config(
                "the static registry file lists no endpoint: add one [[endpoint]] table per \
                 endpoint, with its address = \"host:port\""
                    .into(),
            ));
        }
        for e in &file.endpoint {
            check_address(&e.address)?;
        }
        let registry = StaticRegistry {
            endpoints: file.endpoint,
        };
        registry.check_unique_ids()?;
        Ok(registry)
    }

    /// Two entries with one instance id are one instance listed twice, and a snapshot keeps only
    /// one of them: most likely a copy-paste slip, so it is refused rather than half-used.
    /// An address is compared in one spelling: an IP address and port as the standard library
    /// writes them (`127.0.0.1:09001` is `127.0.0.1:9001`, `[0:0::1]:80` is `[::1]:80`), a
    /// host name without regard to case, a `unix:` path as written.
    ///
    /// The instance ids themselves (an entry's `id`, else its address as written) must differ
    /// too, exactly: `address = "DB.local:5"` beside `id = "DB.local:5"` is one id twice.
    fn check_unique_ids(&self) -> Result<(), RegistryError> {
        let mut seen = std::collections::HashSet::new();
        let mut ids = std::collections::HashSet::new();
        for e in &self.endpoints {
            let id = e.id.as_deref().unwrap_or(&e.address);
            let key = match (&e.id, e.address.parse::<std::net::SocketAddr>()) {
                (None, Ok(addr)) => addr.to_string(),
                // A socket path is a file name: case tells two apart.
                (None, Err(_)) if e.address.starts_with("unix:") => e.address.clone(),
                (None, Err(_)) => e.address.to_ascii_lowercase(),
                (Some(id), _) => id.clone(),
            };
            if !seen.insert(key) || !ids.insert(id) {
                return Err(RegistryError::Config(format!(
                    "endpoint {id:?} is listed twice: give each endpoint its own address, or its \
                     own id"
                )));
            }
        }
        Ok(())
    }

    /// Reads and parses a TOML file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, RegistryError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            RegistryError::Config(format!(
                "cannot read static registry file {}: {e}",
                path.display()
            ))
        })?;
        Self::from_toml(&text)
    }

    fn instances(&self, service: &ServiceId) -> Vec<std::sync::Arc<Instance>> {
        self.endpoints
            .iter()
            .map(|e| {
                let services = if e.services.is_empty() {
                    vec![service.clone()]
                } else {
                    e.services.clone()
                };
                let mut instance = Instance::new(e.address.clone(), services);
                if let Some(id) = &e.id {
                    instance.id = id.clone();
                }
                instance.metadata = e.metadata.clone();
                std::sync::Arc::new(instance)
            })
            .collect()
    }
}

fn check_address(a: &str) -> Result<(), RegistryError> {
    if rpc_core::address::is_endpoint_address(a) {
        return Ok(());
    }
    Err(RegistryError::Config(format!(
        "bad endpoint address {a:?}: expected host:port (an IPv6 address in brackets), or \
         unix:/path for a Unix socket; one address per entry"
    )))
}

impl Registry for StaticRegistry {
    fn register(&self, _instance: Instance) -> BoxFuture<'_, Result<(), RegistryError>> {
        Box::pin(future::ready(Ok(())))
    }

    fn deregister<'a>(&'a self, _id: &'a str) -> BoxFuture<'a, Result<(), RegistryError>> {
        Box::pin(future::ready(Ok(())))
    }

    fn watch<'a>(
        &'a self,
        service: &'a ServiceId,
    ) -> BoxFuture<'a, Result<ServiceWatch, RegistryError>> {
        let instances = self.instances(service);
        // The sender is dropped at once: the snapshot never changes, and `changed()` reports
        // `Closed`, which watchers treat as "nothing more will come".
        let (_tx, rx) = watch::channel(snapshot(service, instances.iter()));
        Box::pin(future::ready(Ok(ServiceWatch::new(rx))))
    }

    /// The services the endpoints list explicitly (an endpoint without `services` serves any
    /// service and adds no name).
    fn services(&self) -> BoxFuture<'_, Result<Vec<ServiceId>, RegistryError>> {
        let ids: std::collections::BTreeSet<&ServiceId> = self
            .endpoints
            .iter()
            .flat_map(|e| e.services.iter())
            .collect();
        Box::pin(future::ready(Ok(ids.into_iter().cloned().collect())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_socket_endpoints_are_accepted_and_an_empty_path_is_not() {
        let r = StaticRegistry::from_list("unix:/tmp/a.sock,127.0.0.1:9001").unwrap();
        assert_eq!(r.endpoints.len(), 2);
        // Two socket paths differing in case are two files, not one listed twice.
        let r = StaticRegistry::from_list("unix:/tmp/A.sock,unix:/tmp/a.sock").unwrap();
        assert_eq!(r.endpoints.len(), 2);
        let e = StaticRegistry::from_list("unix:").unwrap_err();
        assert!(e.to_string().contains("unix:/path"), "{e}");
    }

    #[tokio::test]
    async fn list_and_file() {
        let reg = StaticRegistry::from_list("127.0.0.1:2, 127.0.0.1:1").unwrap();
        let w = reg.watch(&"x.X".into()).await.unwrap();
        assert_eq!(w.current()[0].address, "127.0.0.1:1");

        let reg = StaticRegistry::from_toml(
            "[[endpoint]]\naddress = \"127.0.0.1:1\"\nservices = [\"a.A\"]\n\
             [[endpoint]]\naddress = \"127.0.0.1:2\"\n",
        )
        .unwrap();
        assert_eq!(reg.watch(&"a.A".into()).await.unwrap().current().len(), 2);
        assert_eq!(reg.watch(&"b.B".into()).await.unwrap().current().len(), 1);

        let reg = StaticRegistry::from_toml(
            "[[endpoint]]\naddress = \"127.0.0.1:1\"\nid = \"db-1\"\nmetadata = { shard = \"a\" }\n",
        )
        .unwrap();
        let w = reg.watch(&"a.A".into()).await.unwrap();
        assert_eq!(w.current()[0].id, "db-1");
        assert_eq!(w.current()[0].metadata["shard"], "a");
    }

    #[test]
    fn bad_config_is_a_clear_error() {
        let e = StaticRegistry::from_list("localhost").unwrap_err();
        assert!(e.to_string().contains("expected host:port"), "{e}");
        let e = StaticRegistry::from_toml("[[endpoint]]\nadress = \"x\"").unwrap_err();
        assert!(e.to_string().contains("adress"), "{e}");
        // A file listing nothing is refused as an empty list is.
        for empty in ["", "# endpoints to come\n"] {
            let e = StaticRegistry::from_toml(empty).unwrap_err();
            assert!(
                e.to_string().contains("lists no endpoint"),
                "{empty:?}: {e}"
            );
        }
        let e = StaticRegistry::from_list("127.0.0.1:0").unwrap_err();
        assert!(e.to_string().contains("expected host:port"), "{e}");
        let e = StaticRegistry::from_list("127.0.0.1:1,127.0.0.1:2,127.0.0.1:1").unwrap_err();
        assert!(
            e.to_string().contains("\"127.0.0.1:1\" is listed twice"),
            "{e}"
        );
        let e = StaticRegistry::from_toml(
            "[[endpoint]]\naddress = \"127.0.0.1:1\"\nid = \"db\"\n\
             [[endpoint]]\naddress = \"127.0.0.1:2\"\nid = \"db\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("\"db\" is listed twice"), "{e}");
        // One endpoint in two spellings is one endpoint listed twice.
        for (list, twice) in [
            ("127.0.0.1:9001,127.0.0.1:09001", "127.0.0.1:09001"),
            ("[::1]:80,[0:0::1]:80", "[0:0::1]:80"),
            ("db.local:5,DB.local:5", "DB.local:5"),
        ] {
            let e = StaticRegistry::from_list(list).unwrap_err();
            assert!(
                e.to_string()
                    .contains(&format!("{twice:?} is listed twice")),
                "{list}: {e}"
            );
        }
        // An id given as another endpoint's address is written, in another spelling than the
        // address's own: one instance id twice, which a snapshot would keep one of.
        for (address, id) in [
            ("DB.local:5", "DB.local:5"),
            ("127.0.0.1:09001", "127.0.0.1:09001"),
        ] {
            let e = StaticRegistry::from_toml(&format!(
                "[[endpoint]]\naddress = \"{address}\"\n\
                 [[endpoint]]\naddress = \"10.0.0.2:5\"\nid = \"{id}\"\n"
            ))
            .unwrap_err();
            assert!(
                e.to_string().contains(&format!("{id:?} is listed twice")),
                "{address} and id {id}: {e}"
            );
        }
    }
}
