//! The etcd backend (feature `etcd`): servers publish their instances under leases, clients
//! watch a key prefix. [`EtcdRegistry`] documents the key layout and what happens while etcd is
//! unreachable.
//!
//! ```no_run
//! use rpc_registry::{EtcdRegistry, Registry};
//! # async fn run() -> Result<(), rpc_registry::RegistryError> {
//! let registry = EtcdRegistry::from_url("etcd://127.0.0.1:2379").await?;
//! let watch = registry.watch(&"echo.Echo".into()).await?;
//! println!("echo.Echo is served by {:?}", watch.current());
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use futures_util::future::BoxFuture;
use rpc_core::ServiceId;
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod conn;
mod rules;
mod tasks;

pub use rules::RuleStore;

use conn::Conn;
use tasks::{keep_registered, KeepRegistered, Start, WatchTask};

use crate::instance::snapshot;
use crate::remote::{encode, non_blank, pause, places, shared_watch, spawn_here, Backoff, Watches};
use crate::{Instance, Registry, RegistryError, ServiceWatch};

/// Settings of an [`EtcdRegistry`]. Start from `EtcdOptions::default()` and change what you
/// need.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Prefix of every key the registry reads and writes (`/rpc/` by default). Registries that
    /// should see each other use the same prefix. A prefix not ending with `/` gets one
    /// (`/team` is `/team/`), as a ZooKeeper prefix names a node, with a warning: builds
    /// before this rule wrote such a prefix's keys without the `/` (`/teamservices/...`), and
    /// processes of both kinds do not see each other's.
    pub prefix: String,
    /// Lease of every registered instance (10 s by default): a server that dies without
    /// deregistering disappears after this long. etcd counts in whole seconds (this is rounded
    /// up) and may raise very short leases to its own minimum (about 2 s).
    pub lease_ttl: Duration,
    /// Limit on opening a connection to an etcd endpoint (3 s by default).
    pub connect_timeout: Duration,
    /// Limit on each request to etcd (3 s by default), connecting included: past it the
    /// operation fails as unreachable (or, in the background tasks, is retried).
    pub request_timeout: Duration,
    /// Largest registration written, in bytes (1.5 MiB by default: etcd's own default
    /// `--max-request-bytes`). An instance is written once per service it serves, in one
    /// transaction, which etcd refuses when it is over its limit: a larger registration is
    /// refused here, as a configuration error naming its size, rather than as etcd being
    /// unavailable. Raise both together.
    pub max_request_bytes: usize,
    /// Most services one instance is registered for (128 by default: etcd's own default
    /// `--max-txn-ops`), for the same reason: one key per service, in one transaction, which
    /// etcd refuses beyond its limit of operations. Raise both together.
    pub max_txn_ops: usize,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            prefix: "/rpc/".to_string(),
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(3),
            max_request_bytes: 1536 * 1024,
            max_txn_ops: 128,
        }
    }
}

/// A [`Registry`] backed by an etcd cluster (v3 API): instances live under leases kept alive in
/// the background, and every watched service is followed by one etcd watch, shared by all its
/// watchers.
///
/// Cheap to clone: clones share the connection, the registrations and the watches.
///
/// # Layout
///
/// Every instance is stored once per service it serves, under
/// `<prefix>services/<service id>/<instance id>` (prefix `/rpc/` by default), as the JSON of
/// [`Instance`]. All keys of one instance share one lease of [`EtcdOptions::lease_ttl`] (10 s by
/// default) that a background task keeps alive, so a server that dies disappears by itself
/// within the TTL. A `/` or `%` inside a service or instance id is written `%2F` or `%25`.
///
/// # Behaviour when etcd is away
///
/// - Constructing the registry never contacts etcd: it cannot fail because etcd is down.
/// - [`register`](Registry::register) and the first [`watch`](Registry::watch) of a service need
///   etcd and fail with a clear [`RegistryError::Unavailable`] ("etcd at 127.0.0.1:2379
///   unreachable: ...") when it does not answer within [`EtcdOptions::request_timeout`].
/// - Once registered, an instance stays registered: if the keep-alive fails, it is retried with
///   a bounded backoff (100 ms doubling up to 2 s), and when the lease turns out to be gone
///   (etcd lost it, or it expired during a partition), a new lease is granted and the keys are
///   written again.
/// - Once watched, a service keeps its last known endpoints while etcd is away; the watch is
///   reopened with the same backoff, from a fresh read of the prefix.
///
/// Dropping the last clone of the registry stops its background tasks without revoking
/// anything: instances it registered then disappear when their lease expires, as after a crash.
/// (The watches of its [`rules`](EtcdRegistry::rules) store are the exception: each follows its
/// document until its receiver is dropped, with a connection of its own to etcd.)
/// [`deregister`](Registry::deregister) removes an instance at once.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use rpc_registry::{EtcdOptions, EtcdRegistry, Instance, Registry};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), rpc_registry::RegistryError> {
/// let options = EtcdOptions {
///     lease_ttl: Duration::from_secs(5),
///     ..EtcdOptions::default()
/// };
/// let registry = EtcdRegistry::connect(&["127.0.0.1:2379"], options).await?;
/// // Or: EtcdRegistry::from_url("etcd://127.0.0.1:2379").await?
///
/// registry.register(Instance::new("127.0.0.1:9001", ["echo.Echo"])).await?;
/// let mut watch = registry.watch(&"echo.Echo".into()).await?;
/// println!("echo.Echo is served by {:?}", watch.current());
/// watch.changed().await?; // the next addition or removal
/// registry.deregister("127.0.0.1:9001").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdRegistry {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry")
            .field("endpoints", &self.inner.conn.target)
            .field("options", &*self.inner.conn.options)
            .finish()
    }
}

struct Inner {
    conn: Conn,
    /// Instance id → its keep-alive task. Held across the etcd calls of register/deregister,
    /// which are rare, so that they apply in order.
    registrations: tokio::sync::Mutex<HashMap<String, Registration>>,
    watches: Watches,
    /// Never sent on: background tasks see its receivers close when the registry is dropped.
    _alive: watch::Sender<()>,
    alive: watch::Receiver<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, registration) in self.registrations.get_mut().drain() {
            registration.task.abort();
        }
    }
}

struct Registration {
    /// The lease the instance's keys are under now; the keep-alive task updates it when it
    /// registers again under a new lease.
    lease: Arc<AtomicI64>,
    task: JoinHandle<()>,
    /// What the task writes, to put this version back when its replacement fails.
    keys: Vec<String>,
    value: Vec<u8>,
    ttl: i64,
}

/// Puts a replaced registration back when dropped holding it: its replacement was not kept
/// (the write failed, or the registration was given up, its future dropped). The previous
/// version is written again under a lease of its own, since a write that failed late may have
/// moved its keys to the new lease; then that lease is revoked.
struct PutBack<'a> {
    registry: &'a EtcdRegistry,
    registrations: tokio::sync::MutexGuard<'a, HashMap<String, Registration>>,
    instance_id: &'a str,
    old: Option<Registration>,
    /// The replacement's lease.
    new_lease: i64,
}

impl Drop for PutBack<'_> {
    fn drop(&mut self) {
        let Some(old) = self.old.take() else { return };
        // (Dropped as its runtime shuts down: nothing can run any more, and the keys go when
        // their lease expires, as after a crash.)
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let restored = self.registry.keep(
            self.instance_id,
            old.keys,
            old.value,
            old.lease,
            old.ttl,
            Start::PutBack {
                discard: self.new_lease,
            },
        );
        self.registrations
            .insert(self.instance_id.to_string(), restored);
    }
}

/// The longest lease etcd grants (its `MaxLeaseTTL`): a longer TTL is refused at
/// construction rather than by etcd at every registration.
const MAX_LEASE_TTL: Duration = Duration::from_secs(9_000_000_000);

impl EtcdRegistry {
    /// A registry on the etcd cluster at `endpoints` (`host:port` or `http://host:port`).
    ///
    /// Nothing is sent to etcd yet, so this succeeds while etcd is down; it fails only on an
    /// unusable configuration (no endpoint, a malformed one, a zero TTL or timeout, a TTL
    /// over etcd's longest, 9 000 000 000 s).
    pub async fn connect(
        endpoints: &[impl AsRef<str>],
        mut options: EtcdOptions,
    ) -> Result<Self, RegistryError> {
        if !options.prefix.is_empty() && !options.prefix.ends_with('/') {
            // Said once: keys written under the prefix as given by an older build (`/team`
            // wrote `/teamservices/...`) are not read here.
            tracing::warn!(
                prefix = %options.prefix,
                "the etcd prefix does not end with '/': one is added ({}/services/..., \
                 {}/rules/...); keys written under the prefix without it are not read",
                options.prefix,
                options.prefix
            );
            options.prefix.push('/');
        }
        let endpoints = non_blank(endpoints);
        if endpoints.is_empty() {
            return Err(RegistryError::Config(
                "no etcd endpoint given: expected host:port[,host:port...]".into(),
            ));
        }
        for e in &endpoints {
            check_endpoint(e)?;
        }
        if options.lease_ttl.is_zero() {
            return Err(RegistryError::Config(
                "etcd lease TTL must be at least 1 s".into(),
            ));
        }
        if options.lease_ttl > MAX_LEASE_TTL {
            return Err(RegistryError::Config(format!(
                "etcd lease TTL of {:?} is over etcd's longest, {} s",
                options.lease_ttl,
                MAX_LEASE_TTL.as_secs()
            )));
        }
        // A zero timeout would fail every request as etcd being unreachable, retried for good.
        for (name, timeout) in [
            ("connect", options.connect_timeout),
            ("request", options.request_timeout),
        ] {
            if timeout.is_zero() {
                return Err(RegistryError::Config(format!(
                    "etcd {name} timeout must not be zero"
                )));
            }
        }
        let target = endpoints.join(",");
        let connect = ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            // HTTP/2 pings detect a silently dead connection under a long-lived watch or
            // keep-alive stream. etcd answers pings more frequent than every 5 s, or pings with
            // no stream open, by closing the connection: hence 10 s, and only under streams.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            .with_keep_alive_while_idle(false)
            // A member cut off from its cluster's majority still answers pings, and without
            // this keeps a watch open and silent for the whole partition: endpoints and rules
            // written on the majority side never arrive, and nothing warns. With it, such a
            // member cancels the watch ("no leader"), and the watch's resync path reads again
            // and warns, as for any interrupted watch.
            .with_require_leader(true);
        let client = Client::connect(&endpoints, Some(connect))
            .await
            .map_err(|e| RegistryError::Config(format!("etcd at {target}: {e}")))?;
        let (alive_tx, alive) = watch::channel(());
        Ok(EtcdRegistry {
            inner: Arc::new(Inner {
                conn: Conn {
                    client,
                    options: Arc::new(options),
                    target: Arc::from(target),
                },
                registrations: tokio::sync::Mutex::new(HashMap::new()),
                watches: Arc::new(Mutex::new(HashMap::new())),
                _alive: alive_tx,
                alive,
            }),
        })
    }

    /// Whether `url` names an etcd (`etcd://...`, the scheme in any case): what a program
    /// taking any registry URL asks before it looks for etcd's rule store beside it.
    pub fn is_etcd_url(url: &str) -> bool {
        crate::url::strip_prefix_ignoring_case(url.trim(), "etcd://").is_some()
    }

    /// A registry from a URL such as `etcd://127.0.0.1:2379` or `etcd://h1:2379,h2:2379`, with
    /// the default options.
    pub async fn from_url(url: &str) -> Result<Self, RegistryError> {
        Self::from_url_with_options(url, EtcdOptions::default()).await
    }

    /// Like [`from_url`](Self::from_url), with `options`.
    pub async fn from_url_with_options(
        url: &str,
        options: EtcdOptions,
    ) -> Result<Self, RegistryError> {
        let endpoints = parse_url(url)?;
        Self::connect(&endpoints, options).await
    }

    /// The options in force.
    pub fn options(&self) -> &EtcdOptions {
        &self.inner.conn.options
    }

    /// The etcd endpoints, comma-separated, as given.
    pub fn endpoints(&self) -> &str {
        &self.inner.conn.target
    }

    /// The key under which `instance_id` is published for `service`:
    /// `<prefix>services/<service id>/<instance id>`.
    pub fn key(&self, service: &ServiceId, instance_id: &str) -> String {
        self.inner.conn.key(service, instance_id)
    }

    async fn register_instance(&self, instance: Instance) -> Result<(), RegistryError> {
        let conn = &self.inner.conn;
        let value = encode(&instance)?;
        let keys = places(&instance, |s, id| conn.key(s, id));
        if keys.len() > conn.options.max_txn_ops {
            return Err(RegistryError::Config(format!(
                "instance {}: it serves {} services, written in one etcd transaction of one \
                 operation each, over the limit of {} (etcd's --max-txn-ops, 128 by default): \
                 serve fewer services per instance, or raise --max-txn-ops and \
                 EtcdOptions::max_txn_ops together",
                instance.id,
                keys.len(),
                conn.options.max_txn_ops
            )));
        }
        // (Each operation of the transaction carries a few dozen bytes besides.)
        let size: usize = keys.iter().map(|k| k.len() + value.len() + 64).sum();
        if size > conn.options.max_request_bytes {
            return Err(RegistryError::Config(format!(
                "instance {}: its registration is {size} bytes in one etcd request ({} \
                 services, {} bytes each), over the limit of {} (etcd's --max-request-bytes, \
                 1.5 MiB by default): publish less metadata or fewer services per instance, or \
                 raise --max-request-bytes and EtcdOptions::max_request_bytes together",
                instance.id,
                keys.len(),
                value.len(),
                conn.options.max_request_bytes
            )));
        }

        let mut registrations = self.inner.registrations.lock().await;
        if keys.is_empty() {
            // Nothing to publish; a previous version of the instance goes away.
            if let Some(old) = registrations.remove(&instance.id) {
                self.stop(&instance.id, old).await?;
            }
            return Ok(());
        }
        let (lease, ttl) = conn.grant().await?;
        // The previous version's task must not write its keys again once the new ones are in.
        // Until the new version is kept, the guard puts the previous one back should this end
        // early: a failed write, or this future dropped (a caller's timeout).
        let mut old = PutBack {
            registry: self,
            registrations,
            instance_id: &instance.id,
            old: None,
            new_lease: lease,
        };
        old.old = old.registrations.remove(&instance.id);
        if let Some(replaced) = old.old.as_mut() {
            replaced.task.abort();
            let _ = (&mut replaced.task).await;
        }
        if let Err(e) = conn.put(&keys, &value, lease).await {
            // With a previous version, the guard puts it back and only then revokes the new
            // lease: a write that failed late may have moved the previous version's keys to
            // it, and revoking it first would take them away until they are written again.
            if old.old.is_none() {
                let _ = conn.revoke(lease).await;
            }
            return Err(e);
        }
        if let Some(replaced) = old.old.as_ref() {
            // Removes at once the keys of services the new version no longer serves, before
            // `register` returns. This is the last wait, and it comes before the new version
            // is kept, so a registration given up here has its previous version put back by
            // the guard. Were the new version kept first, a server given up at this point
            // while another server of its process serves the same id would leave its own
            // address listed (it removes nothing: the id is the other server's) with nothing
            // behind it, and the server still serving would not be listed.
            if let Err(e) = conn.revoke(replaced.lease.load(Ordering::SeqCst)).await {
                tracing::warn!(
                    instance = %instance.id, error = %e,
                    "could not revoke the lease of the replaced registration; \
                     its leftover keys expire with it"
                );
            }
        }
        let lease = Arc::new(AtomicI64::new(lease));
        let registration = self.keep(&instance.id, keys, value, lease, ttl, Start::Written);
        // Replaced for good: its keep-alive has ended, its lease revoked (or left to expire).
        old.old = None;
        old.registrations.insert(instance.id.clone(), registration);
        Ok(())
    }

    /// Starts keeping `instance_id` registered with `keys` holding `value` under `lease` (of
    /// `ttl` seconds), after writing them under a new lease for a [`Start::PutBack`].
    fn keep(
        &self,
        instance_id: &str,
        keys: Vec<String>,
        value: Vec<u8>,
        lease: Arc<AtomicI64>,
        ttl: i64,
        start: Start,
    ) -> Registration {
        let task = tokio::spawn(keep_registered(KeepRegistered {
            conn: self.inner.conn.clone(),
            instance_id: instance_id.to_string(),
            keys: keys.clone(),
            value: value.clone(),
            lease: lease.clone(),
            ttl,
            alive: self.inner.alive.clone(),
            start,
        }));
        Registration {
            lease,
            task,
            keys,
            value,
            ttl,
        }
    }

    async fn deregister_instance(&self, instance_id: &str) -> Result<(), RegistryError> {
        let mut registrations = self.inner.registrations.lock().await;
        match registrations.remove(instance_id) {
            Some(registration) => self.stop(instance_id, registration).await,
            None => Ok(()),
        }
    }

    /// Stops a registration's keep-alive and revokes its lease: its keys disappear at once.
    /// The registration is already taken out, so should this be given up midway (its future
    /// dropped: a timeout around a server's shutdown), a later deregistration finds nothing
    /// and the keys would stay until their lease expires: the revocation then goes on in the
    /// background.
    async fn stop(
        &self,
        instance_id: &str,
        registration: Registration,
    ) -> Result<(), RegistryError> {
        registration.task.abort();
        let conn = &self.inner.conn;
        RevokeIfGivenUp(Some(Forgotten {
            conn: conn.clone(),
            instance_id: instance_id.to_string(),
            task: Some(registration.task),
            lease: registration.lease,
            alive: self.inner.alive.clone(),
        }))
        .revoke()
        .await
        .map_err(|e| {
            e.map_message(|m| {
                format!(
                    "{m}; the instance disappears when its lease expires (TTL {:?})",
                    conn.options.lease_ttl
                )
            })
        })
    }

    async fn watch_service(&self, service: &ServiceId) -> Result<ServiceWatch, RegistryError> {
        let conn = &self.inner.conn;
        shared_watch(
            &self.inner.watches,
            &self.inner.alive,
            service,
            conn.read(service),
            |(instances, _)| snapshot(service, instances.values()),
            |(instances, revision), signals| {
                tokio::spawn(
                    WatchTask {
                        conn: conn.clone(),
                        service: service.clone(),
                        prefix: conn.service_prefix(service),
                        signals,
                        instances,
                        backoff: Backoff::default(),
                    }
                    .run(revision),
                );
            },
        )
        .await
    }
}

/// Revokes a deregistered instance's lease in the background ([`revoke_later`]) when dropped
/// armed: its deregistration was given up midway.
struct RevokeIfGivenUp(Option<Forgotten>);

/// A registration taken out of the registry, whose lease is still to be revoked.
struct Forgotten {
    conn: Conn,
    instance_id: String,
    /// Its keep-alive task, aborted, until it is known to have ended: only then is the lease
    /// final (a task registering again records the new lease before it writes).
    task: Option<JoinHandle<()>>,
    lease: Arc<AtomicI64>,
    alive: watch::Receiver<()>,
}

impl RevokeIfGivenUp {
    /// Waits for the keep-alive task to end, then revokes its lease, once; disarmed when etcd
    /// has answered.
    async fn revoke(mut self) -> Result<(), RegistryError> {
        let Some(forgotten) = self.0.as_mut() else {
            return Ok(());
        };
        if let Some(task) = forgotten.task.as_mut() {
            let _ = task.await;
        }
        // (A finished task must not be awaited again in the background.)
        forgotten.task = None;
        let revoked = forgotten
            .conn
            .revoke(forgotten.lease.load(Ordering::SeqCst))
            .await;
        self.0 = None;
        revoked
    }
}

impl Drop for RevokeIfGivenUp {
    fn drop(&mut self) {
        let Some(forgotten) = self.0.take() else {
            return;
        };
        let instance = forgotten.instance_id.clone();
        if !spawn_here(revoke_later(forgotten)) {
            tracing::warn!(
                %instance,
                "a deregistration was given up outside a Tokio runtime: the instance's keys \
                 stay until their lease expires"
            );
        }
    }
}

/// Revokes a forgotten registration's lease once its keep-alive task has ended, retrying with
/// the backoff until etcd answers or the registry is dropped. (Once the lease has expired,
/// etcd answers that it does not know it, which counts as revoked.)
async fn revoke_later(mut forgotten: Forgotten) {
    if let Some(task) = forgotten.task.take() {
        let _ = task.await;
    }
    let lease = forgotten.lease.load(Ordering::SeqCst);
    let mut backoff = Backoff::default();
    let mut warned = false;
    loop {
        match forgotten.conn.revoke(lease).await {
            Ok(()) => return,
            // The first failure is a warning: the instance stays listed until this works or
            // the lease expires.
            Err(e) if !std::mem::replace(&mut warned, true) => tracing::warn!(
                instance = %forgotten.instance_id, error = %e,
                "could not revoke the lease of a deregistration that was given up; retrying \
                 until the lease expires"
            ),
            Err(e) => tracing::debug!(
                instance = %forgotten.instance_id, error = %e,
                "revoking the lease again failed; retrying"
            ),
        }
        if !pause(backoff.next(), &mut forgotten.alive).await {
            return;
        }
    }
}

impl Registry for EtcdRegistry {
    fn state_id(&self) -> usize {
        Arc::as_ptr(&self.inner).cast::<()>() as usize
    }

    /// Grants a lease, writes one key per service under it and keeps the lease alive in the
    /// background (re-registering if the lease is lost). Registering an id again replaces the
    /// previous version, whose keys of services the new one does not serve are gone when this
    /// returns; when the new one cannot be written, or this is given up before it returns (its
    /// future dropped), the previous one stays registered. Fails if etcd does not answer
    /// within the request timeout, or refuses the write (one transaction holds every key of
    /// the instance: etcd takes 128 by default).
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<(), RegistryError>> {
        Box::pin(self.register_instance(instance))
    }

    /// Stops the keep-alive and revokes the lease: the keys disappear at once. An unknown id is
    /// not an error. If etcd is unreachable, the keys expire with the lease. Given up midway
    /// (its future dropped), the lease is still revoked, in the background.
    fn deregister<'a>(&'a self, instance_id: &'a str) -> BoxFuture<'a, Result<(), RegistryError>> {
        Box::pin(self.deregister_instance(instance_id))
    }

    /// Reads the service's keys (the first snapshot), then follows them with an etcd watch shared
    /// by every watcher of the service. The first watch of a service fails if etcd does not
    /// answer; later ones share the running watch and keep the last known endpoints while etcd
    /// is away.
    fn watch<'a>(
        &'a self,
        service: &'a ServiceId,
    ) -> BoxFuture<'a, Result<ServiceWatch, RegistryError>> {
        Box::pin(self.watch_service(service))
    }

    /// Reads the keys under `<prefix>services/` (keys only, one request): the services with at
    /// least one live instance. Fails if etcd does not answer within the request timeout.
    fn services(&self) -> BoxFuture<'_, Result<Vec<ServiceId>, RegistryError>> {
        Box::pin(self.inner.conn.services())
    }
}

fn check_endpoint(e: &str) -> Result<(), RegistryError> {
    let hostport = e
        .strip_prefix("http://")
        .or_else(|| e.strip_prefix("https://"))
        .unwrap_or(e)
        .trim_end_matches('/');
    if rpc_core::address::is_host_port(hostport) {
        return Ok(());
    }
    Err(RegistryError::Config(format!(
        "bad etcd endpoint {e:?}: expected host:port (an IPv6 address in brackets), \
         comma-separated for several"
    )))
}

/// `etcd://h1:2379,h2:2379` → `["h1:2379", "h2:2379"]`.
fn parse_url(url: &str) -> Result<Vec<String>, RegistryError> {
    let Some(rest) = crate::url::strip_prefix_ignoring_case(url.trim(), "etcd://") else {
        return Err(RegistryError::Config(format!(
            "bad etcd URL {url:?}: expected etcd://host:port[,host:port...]"
        )));
    };
    let endpoints: Vec<String> = rest
        .trim_end_matches('/')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if endpoints.is_empty() {
        return Err(RegistryError::Config(format!(
            "bad etcd URL {url:?}: no endpoint; expected etcd://host:port[,host:port...]"
        )));
    }
    for e in &endpoints {
        check_endpoint(e).map_err(|_| {
            RegistryError::Config(format!(
                "bad etcd URL {url:?}: {e:?} is not host:port; expected \
                 etcd://host:port[,host:port...]"
            ))
        })?;
    }
    Ok(endpoints)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("etcd://127.0.0.1:2379").unwrap(),
            ["127.0.0.1:2379"]
        );
        assert_eq!(parse_url("etcd://a:1, b:2/").unwrap(), ["a:1", "b:2"]);
        for bad in [
            "127.0.0.1:2379",
            "etcd://",
            "etcd://host",
            "etcd://h:port",
            "http://h:1",
        ] {
            let e = parse_url(bad).unwrap_err().to_string();
            assert!(e.contains("etcd://host:port"), "{bad}: {e}");
        }
    }

    /// A zero connect or request timeout is a configuration error at construction, not an
    /// etcd that never answers (every request failing as unreachable, retried for good); so is
    /// a lease TTL longer than etcd grants (`Duration::MAX` overflowed the lease's seconds: a
    /// panic in debug builds, a lease of 1 s in release ones).
    #[tokio::test]
    async fn a_zero_timeout_or_a_ttl_past_etcds_is_refused_as_configuration() {
        for (name, options) in [
            (
                "lease TTL of",
                EtcdOptions {
                    lease_ttl: Duration::MAX,
                    ..EtcdOptions::default()
                },
            ),
            (
                "connect timeout",
                EtcdOptions {
                    connect_timeout: Duration::ZERO,
                    ..EtcdOptions::default()
                },
            ),
            (
                "request timeout",
                EtcdOptions {
                    request_timeout: Duration::ZERO,
                    ..EtcdOptions::default()
                },
            ),
        ] {
            match EtcdRegistry::connect(&["127.0.0.1:1"], options).await {
                Err(RegistryError::Config(m)) => assert!(m.contains(name), "{m}"),
                other => panic!("{name}: {:?}", other.err()),
            }
        }
    }

    #[tokio::test]
    async fn construction_does_not_need_etcd() {
        // A port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let reg = EtcdRegistry::from_url_with_options(
            &format!("etcd://127.0.0.1:{port}"),
            EtcdOptions {
                request_timeout: Duration::from_millis(300),
                connect_timeout: Duration::from_millis(300),
                ..EtcdOptions::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(reg.key(&"a/b".into(), "x"), "/rpc/services/a%2Fb/x");
        let unreachable = format!("etcd at 127.0.0.1:{port} unreachable");
        let e = reg.watch(&"a.A".into()).await.unwrap_err().to_string();
        assert!(e.contains(&unreachable), "{e}");
        let e = reg
            .register(Instance::new("127.0.0.1:2", ["a.A"]))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(&unreachable), "{e}");
        reg.deregister("127.0.0.1:2").await.unwrap();
    }

    /// An instance of more services than one etcd transaction takes is refused as
    /// configuration before anything is sent (etcd, unreachable here, would read as
    /// unavailable); a prefix without its final `/` gets one.
    #[tokio::test]
    async fn too_many_services_are_refused_before_etcd_and_a_prefix_ends_with_a_slash() {
        let options = EtcdOptions {
            prefix: "/team".into(),
            request_timeout: Duration::from_millis(300),
            connect_timeout: Duration::from_millis(300),
            ..EtcdOptions::default()
        };
        let reg = EtcdRegistry::connect(&["127.0.0.1:1"], options)
            .await
            .unwrap();
        assert_eq!(reg.key(&"a.A".into(), "x"), "/team/services/a.A/x");
        let services: Vec<String> = (0..129).map(|i| format!("t.S{i}")).collect();
        let e = reg
            .register(Instance::new("127.0.0.1:2", services))
            .await
            .unwrap_err();
        match e {
            RegistryError::Config(m) => assert!(m.contains("129 services"), "{m}"),
            e => panic!("not a configuration error: {e}"),
        }
    }
}
