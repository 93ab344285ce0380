//! What a server publishes about itself, and what a client watches.

use std::collections::BTreeMap;
use std::sync::Arc;

use rpc_core::{ServiceEntry, ServiceId};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::{Endpoints, RegistryError};

/// One running server: where it listens and what it serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// Unique id of the instance; by default its address.
    pub id: String,
    /// Where clients connect, as `host:port`.
    pub address: String,
    /// The services it serves.
    pub services: Vec<ServiceId>,
    /// The entries it serves, with the governance settings the service declares.
    #[serde(default)]
    pub entries: Vec<ServiceEntry>,
    /// Free-form metadata, such as `version` or `weight` (a positive number, read by clients'
    /// `least_loaded` strategy: see `rpc_client::balance::WEIGHT_KEY`).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

impl Instance {
    /// An instance at `address` serving `services`, with its address as id.
    pub fn new<S: Into<ServiceId>>(
        address: impl Into<String>,
        services: impl IntoIterator<Item = S>,
    ) -> Self {
        let address = address.into();
        Instance {
            id: address.clone(),
            address,
            services: services.into_iter().map(Into::into).collect(),
            entries: Vec::new(),
            metadata: BTreeMap::new(),
        }
    }

    /// Whether the instance serves `service`.
    pub fn serves(&self, service: &ServiceId) -> bool {
        self.services.iter().any(|s| s == service)
    }
}

/// A live view of one service's instances: [`current`](Self::current) is always the latest
/// snapshot, and [`changed`](Self::changed) waits for the next one.
#[derive(Debug, Clone)]
pub struct ServiceWatch {
    rx: watch::Receiver<Endpoints>,
}

impl ServiceWatch {
    /// Wraps the receiving side of a snapshot channel (for registry implementations).
    pub fn new(rx: watch::Receiver<Endpoints>) -> Self {
        ServiceWatch { rx }
    }

    /// The latest snapshot. Cheap: clones one `Arc`.
    pub fn current(&self) -> Endpoints {
        self.rx.borrow().clone()
    }

    /// Waits until the snapshot changes after the last one seen through this watch.
    pub async fn changed(&mut self) -> Result<(), RegistryError> {
        self.rx.changed().await.map_err(|_| RegistryError::Closed)?;
        self.rx.borrow_and_update();
        Ok(())
    }
}

/// The snapshot of `service` from a set of instances (sorted by [`Endpoints::new`]).
pub(crate) fn snapshot<'a>(
    service: &ServiceId,
    instances: impl Iterator<Item = &'a Arc<Instance>>,
) -> Endpoints {
    Endpoints::new(instances.filter(|i| i.serves(service)).cloned())
}
