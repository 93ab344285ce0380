//! A registry whose answers a test scripts: what etcd or ZooKeeper do when slow or down, which
//! the real ones cannot be made to do on cue.

use std::sync::{Arc, Mutex};

use rpc::crates::registry::{Endpoints, ServiceWatch};
use rpc::{BoxFuture, Instance, Registry, RegistryError, ServiceId};
use tokio::sync::{oneshot, watch};

/// What `register` does.
pub enum Register {
    /// Answers at once.
    Answers,
    /// Takes the instance (it lands), then never answers.
    LandsThenHangs,
    /// The first registration as `LandsThenHangs`, the others answer at once.
    LandsThenHangsOnce,
    /// Takes the instance (it lands), then lets other tasks run once before it answers, as a
    /// registry answering over the network does.
    LandsThenYields,
}

/// What `watch` does.
pub enum Watch {
    /// Fails: the registry is unreachable.
    Unavailable,
    /// Never answers.
    Hangs,
    /// Answers with a receiver of this channel.
    Channel(watch::Sender<Endpoints>),
}

/// A scripted registry. `published` holds the ids registered and not deregistered; `began`,
/// when set, is told when the first registration begins.
#[derive(Clone)]
pub struct TestRegistry {
    register: Arc<Register>,
    watch: Arc<Watch>,
    pub published: Arc<Mutex<Vec<String>>>,
    began: Arc<Mutex<Option<oneshot::Sender<()>>>>,
    /// While set, `deregister` fails (the registry unreachable) and removes nothing.
    pub deregister_fails: Arc<std::sync::atomic::AtomicBool>,
    /// Told each time `deregister` is called (its answer is ready at once).
    pub deregistered: Arc<tokio::sync::Notify>,
    /// Registrations begun so far.
    registrations: Arc<std::sync::atomic::AtomicUsize>,
    /// When set, `deregister` waits to be told before it removes the id (a registry answering
    /// over the network).
    pub deregister_gate: Arc<Mutex<Option<Arc<tokio::sync::Notify>>>>,
}

impl TestRegistry {
    pub fn new(register: Register, watch: Watch) -> Self {
        TestRegistry {
            register: Arc::new(register),
            watch: Arc::new(watch),
            published: Arc::default(),
            began: Arc::default(),
            deregister_fails: Arc::default(),
            deregistered: Arc::default(),
            registrations: Arc::default(),
            deregister_gate: Arc::default(),
        }
    }

    /// Tells `began` when the first registration begins.
    pub fn telling(self, began: oneshot::Sender<()>) -> Self {
        *self.began.lock().unwrap() = Some(began);
        self
    }
}

impl Registry for TestRegistry {
    fn state_id(&self) -> usize {
        Arc::as_ptr(&self.published).cast::<()>() as usize
    }
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<(), RegistryError>> {
        self.published.lock().unwrap().push(instance.id);
        if let Some(began) = self.began.lock().unwrap().take() {
            let _ = began.send(());
        }
        let first = (self.registrations).fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        match *self.register {
            Register::Answers => Box::pin(async { Ok(()) }),
            Register::LandsThenHangs => Box::pin(std::future::pending()),
            Register::LandsThenHangsOnce if first => Box::pin(std::future::pending()),
            Register::LandsThenHangsOnce => Box::pin(async { Ok(()) }),
            Register::LandsThenYields => Box::pin(async {
                tokio::task::yield_now().await;
                Ok(())
            }),
        }
    }
    fn deregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RegistryError>> {
        self.deregistered.notify_one();
        if self
            .deregister_fails
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Box::pin(async {
                Err(RegistryError::Unavailable("scripted: unreachable".into()))
            });
        }
        if let Some(gate) = self.deregister_gate.lock().unwrap().clone() {
            let published = self.published.clone();
            return Box::pin(async move {
                gate.notified().await;
                published.lock().unwrap().retain(|i| i != id);
                Ok(())
            });
        }
        self.published.lock().unwrap().retain(|i| i != id);
        Box::pin(async { Ok(()) })
    }
    fn watch<'a>(&'a self, _: &'a ServiceId) -> BoxFuture<'a, Result<ServiceWatch, RegistryError>> {
        match &*self.watch {
            Watch::Unavailable => {
                Box::pin(async { Err(RegistryError::Unavailable("scripted: unreachable".into())) })
            }
            Watch::Hangs => Box::pin(std::future::pending()),
            Watch::Channel(tx) => {
                let rx = tx.subscribe();
                Box::pin(async move { Ok(ServiceWatch::new(rx)) })
            }
        }
    }
    fn services(&self) -> BoxFuture<'_, Result<Vec<ServiceId>, RegistryError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// What a [`Watching`] registry does before its watch number `n` (from 0) goes on to the
/// in-process registry it wraps: wait, fail (the error is the watch's answer), or nothing.
pub type BeforeWatch =
    Arc<dyn Fn(u32) -> BoxFuture<'static, Result<(), RegistryError>> + Send + Sync>;

/// An in-process registry whose watches first do what `before` says (etcd slow to answer, or
/// unreachable at first); everything else it does at once.
#[derive(Clone)]
pub struct Watching {
    inner: rpc::InProcessRegistry,
    before: BeforeWatch,
    watches: Arc<std::sync::atomic::AtomicU32>,
}

impl Watching {
    pub fn new(
        inner: rpc::InProcessRegistry,
        before: impl Fn(u32) -> BoxFuture<'static, Result<(), RegistryError>> + Send + Sync + 'static,
    ) -> Self {
        Watching {
            inner,
            before: Arc::new(before),
            watches: Arc::default(),
        }
    }
}

impl Registry for Watching {
    fn state_id(&self) -> usize {
        self.inner.state_id()
    }
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<(), RegistryError>> {
        self.inner.register(instance)
    }
    fn deregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RegistryError>> {
        self.inner.deregister(id)
    }
    fn watch<'a>(
        &'a self,
        service: &'a ServiceId,
    ) -> BoxFuture<'a, Result<ServiceWatch, RegistryError>> {
        let n = self
            .watches
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let before = (self.before)(n);
        Box::pin(async move {
            before.await?;
            self.inner.watch(service).await
        })
    }
    fn services(&self) -> BoxFuture<'_, Result<Vec<ServiceId>, RegistryError>> {
        self.inner.services()
    }
}
