//! # rpc-registry
//!
//! Where servers publish their instances and where clients learn a service's live endpoints.
//!
//! This crate owns the [`Registry`] trait and its embedded backends: [`InProcessRegistry`] (the
//! default: servers and clients in one process, or tests) and [`StaticRegistry`] (a fixed list
//! from code, the command line or a TOML file, for several processes with no registry server),
//! and, behind the `etcd` feature, `EtcdRegistry`: instances under etcd leases with keep-alive
//! (a killed server disappears within its TTL), clients watching a key prefix (changes arrive
//! within a second, and the last endpoints stay in use while etcd is unreachable); behind the
//! `zookeeper` feature, `ZooKeeperRegistry`: instances as ephemeral nodes of a ZooKeeper session
//! (a killed server disappears within the session timeout; a server whose session ended
//! registers again), clients following a persistent watch (and keeping the last endpoints while
//! ZooKeeper is unreachable).
//! [`<dyn Registry>::from_url`](trait.Registry.html#method.from_url) makes any of them from one
//! string (`embedded`, `static:FILE`, `host:port,...`, `etcd://host:port`, `zk://host:port`),
//! such as a `--registry` flag.
//!
//! Every watch hands out [`Endpoints`] snapshots, whose constructor alone fixes their order (by
//! address, then instance id, one instance per id), so whatever the backend, every client sees
//! a service's instances in the same order: the order its hash ring, round robin and failover
//! follow.
//!
//! The same etcd keeps the fleet's rules: [`rules`] defines the governance and routing
//! documents, the [`RuleSource`] clients and servers follow, and (feature `etcd`) `RuleStore`,
//! which validates, versions and keeps the history of every write.
//!
//! A registry stores only what servers say about themselves. It must not hold client-side state:
//! a client's local judgement of an endpoint's health (see `rpc-governance`) never reaches it.
//!
//! ```
//! use rpc_registry::{InProcessRegistry, Instance, Registry};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), rpc_registry::RegistryError> {
//! let registry = InProcessRegistry::new();
//! let mut watch = registry.watch(&"echo.Echo".into()).await?;
//! assert!(watch.current().is_empty());
//!
//! registry.register(Instance::new("127.0.0.1:9001", ["echo.Echo"])).await?;
//! watch.changed().await?;
//! assert_eq!(watch.current()[0].address, "127.0.0.1:9001");
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod endpoints;
#[cfg(feature = "etcd")]
mod etcd;
mod in_process;
mod instance;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
mod remote;
pub mod rules;
mod static_list;
mod url;
#[cfg(feature = "zookeeper")]
mod zookeeper;

use futures_util::future::BoxFuture;
use rpc_core::ServiceId;

pub use endpoints::Endpoints;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdOptions, EtcdRegistry, RuleStore};
pub use in_process::InProcessRegistry;
pub use instance::{Instance, ServiceWatch};
pub use rules::{RuleError, RuleKind, RuleSource, RuleVersion};
pub use static_list::StaticRegistry;
#[cfg(feature = "zookeeper")]
pub use zookeeper::{ZooKeeperOptions, ZooKeeperRegistry};

/// A registry operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RegistryError {
    /// The registry could not be reached or answered with an error.
    #[error("registry unavailable: {0}")]
    Unavailable(String),
    /// The registry's configuration (address, file) is unusable.
    #[error("registry configuration: {0}")]
    Config(String),
    /// The watch ended: the registry was dropped or shut down.
    #[error("registry watch closed")]
    Closed,
}

impl RegistryError {
    /// The same error, its message rewritten by `f` (its kind kept: a configuration error
    /// wrapped with more to say is still one, and says "registry configuration" once).
    pub(crate) fn map_message(self, f: impl FnOnce(String) -> String) -> Self {
        match self {
            RegistryError::Unavailable(m) => RegistryError::Unavailable(f(m)),
            RegistryError::Config(m) => RegistryError::Config(f(m)),
            RegistryError::Closed => RegistryError::Closed,
        }
    }
}

/// Publishes server instances and lets clients watch a service's live endpoints.
///
/// Implementations are shared (`Arc<dyn Registry>`) between a process's servers and clients.
pub trait Registry: Send + Sync + 'static {
    /// Publishes (or republishes, replacing the previous version) an instance.
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<(), RegistryError>>;

    /// Removes an instance; removing an unknown instance is not an error.
    fn deregister<'a>(&'a self, instance_id: &'a str) -> BoxFuture<'a, Result<(), RegistryError>>;

    /// The instances serving `service`: a snapshot now, then every change.
    fn watch<'a>(
        &'a self,
        service: &'a ServiceId,
    ) -> BoxFuture<'a, Result<ServiceWatch, RegistryError>>;

    /// What tells this registry from the others of the process: the same for every clone of
    /// it (handles on one shared state), different for any other. A server of the process
    /// holds an instance id per registry, so that a stopping server does not deregister the
    /// id a newer one publishes in the same registry.
    ///
    /// The default, 0, makes every registry of that type one: a server then never
    /// deregisters an id a newer server of the process publishes in any of them, at the cost of
    /// leaving an id published when two such registries hold it. A registry returns its shared
    /// state's address (the same for all its clones) to be told apart.
    fn state_id(&self) -> usize {
        0
    }

    /// The services the registry knows now: every service id at least one instance publishes,
    /// sorted, each once. What an operator lists before looking at one service's instances
    /// (`rpcctl services`); clients never need it to call.
    ///
    /// A static list names only the services its endpoints list explicitly: an endpoint listed
    /// without services serves any service, so it adds no name.
    fn services(&self) -> BoxFuture<'_, Result<Vec<ServiceId>, RegistryError>>;
}

/// The services of `instances`, sorted and each once: what [`Registry::services`] returns.
pub(crate) fn service_ids<'a>(instances: impl Iterator<Item = &'a Instance>) -> Vec<ServiceId> {
    let ids: std::collections::BTreeSet<&ServiceId> =
        instances.flat_map(|i| i.services.iter()).collect();
    ids.into_iter().cloned().collect()
}
