//! The in-process registry: servers and clients of one process, no server needed.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::future::{self, BoxFuture};
use rpc_core::ServiceId;
use tokio::sync::watch;

use crate::instance::snapshot;
use crate::{Instance, Registry, RegistryError, ServiceWatch};

/// A registry that lives in the process: the default, used by the demo and the tests.
///
/// Clone it to share it; every clone sees the same instances.
#[derive(Clone, Default)]
pub struct InProcessRegistry {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    instances: BTreeMap<String, Arc<Instance>>,
    watchers: HashMap<ServiceId, watch::Sender<crate::Endpoints>>,
}

impl State {
    /// Sends each service's endpoints to its watchers; a service nobody watches any more loses
    /// its entry (a later watch starts from the instances then), so the map holds only the
    /// services watched now, not every one ever watched.
    fn publish(&mut self, services: &[ServiceId]) {
        for service in services {
            if let Some(tx) = self.watchers.get(service) {
                if tx.receiver_count() == 0 {
                    self.watchers.remove(service);
                } else {
                    tx.send_replace(snapshot(service, self.instances.values()));
                }
            }
        }
    }
}

impl InProcessRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        // A panic while holding the lock cannot leave `State` half-updated in a way that matters
        // (every update is one insert/remove followed by republishing), so poisoning is ignored.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut state)
    }
}

impl Registry for InProcessRegistry {
    fn state_id(&self) -> usize {
        Arc::as_ptr(&self.state).cast::<()>() as usize
    }

    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<(), RegistryError>> {
        self.with_state(|state| {
            let mut touched = instance.services.clone();
            let old = state
                .instances
                .insert(instance.id.clone(), Arc::new(instance));
            if let Some(old) = old {
                touched.extend(old.services.iter().cloned());
            }
            state.publish(&touched);
        });
        Box::pin(future::ready(Ok(())))
    }

    fn deregister<'a>(&'a self, instance_id: &'a str) -> BoxFuture<'a, Result<(), RegistryError>> {
        self.with_state(|state| {
            if let Some(old) = state.instances.remove(instance_id) {
                state.publish(&old.services);
            }
        });
        Box::pin(future::ready(Ok(())))
    }

    fn watch<'a>(
        &'a self,
        service: &'a ServiceId,
    ) -> BoxFuture<'a, Result<ServiceWatch, RegistryError>> {
        let rx = self.with_state(|state| {
            let State {
                instances,
                watchers,
            } = state;
            watchers.retain(|_, tx| tx.receiver_count() > 0);
            watchers
                .entry(service.clone())
                .or_insert_with(|| watch::Sender::new(snapshot(service, instances.values())))
                .subscribe()
        });
        Box::pin(future::ready(Ok(ServiceWatch::new(rx))))
    }

    fn services(&self) -> BoxFuture<'_, Result<Vec<ServiceId>, RegistryError>> {
        let ids =
            self.with_state(|state| crate::service_ids(state.instances.values().map(|i| &**i)));
        Box::pin(future::ready(Ok(ids)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_are_one_registry_and_new_ones_another() {
        let a = InProcessRegistry::new();
        assert_eq!(a.state_id(), a.clone().state_id());
        assert_ne!(a.state_id(), InProcessRegistry::new().state_id());
    }

    fn instance(i: usize, service: &ServiceId) -> Instance {
        Instance::new(format!("127.0.0.1:{}", 9000 + i), [service.clone()])
    }

    #[tokio::test]
    async fn a_service_nobody_watches_any_more_keeps_no_watcher() {
        let registry = InProcessRegistry::new();
        let services: Vec<ServiceId> = (0..3).map(|i| ServiceId::from(format!("s{i}"))).collect();
        let kept = registry.watch(&services[0]).await.unwrap();
        for service in &services[1..] {
            drop(registry.watch(service).await.unwrap());
        }
        for (i, service) in services.iter().enumerate() {
            registry.register(instance(i, service)).await.unwrap();
        }
        let watched: Vec<ServiceId> = registry.with_state(|s| s.watchers.keys().cloned().collect());
        assert_eq!(watched, vec![services[0].clone()]);
        // The watch still kept sees its instance, and a new watch of a dropped one sees its own.
        assert_eq!(kept.current().len(), 1);
        let again = registry.watch(&services[2]).await.unwrap();
        assert_eq!(again.current().len(), 1);
    }
}
