//! The ZooKeeper backend (feature `zookeeper`): servers publish their instances as ephemeral
//! nodes of the registry's session, clients follow a persistent recursive watch on a service's
//! node. [`ZooKeeperRegistry`] documents the node layout and what happens when the session ends
//! or ZooKeeper is unreachable.
//!
//! ```no_run
//! use rpc_registry::{Registry, ZooKeeperRegistry};
//! # async fn run() -> Result<(), rpc_registry::RegistryError> {
//! let registry = ZooKeeperRegistry::from_url("zk://127.0.0.1:2181")?;
//! let watch = registry.watch(&"echo.Echo".into()).await?;
//! println!("echo.Echo is served by {:?}", watch.current());
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use rpc_core::address::is_host_port;
use rpc_core::ServiceId;
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod conn;
mod tasks;

use conn::Conn;
use tasks::{keep_registered, KeepRegistered, WatchTask};

use crate::instance::snapshot;
use crate::remote::{encode, non_blank, pause, places, shared_watch, spawn_here, Backoff, Watches};
use crate::{Instance, Registry, RegistryError, ServiceWatch};

/// Settings of a [`ZooKeeperRegistry`]. Start from `ZooKeeperOptions::default()` and change
/// what you need.
#[derive(Debug, Clone)]
pub struct ZooKeeperOptions {
    /// The node under which everything lives (`/rpc` by default). Registries that should see
    /// each other use the same prefix. A `zk://` URL may give it as its path
    /// (`zk://host:port/prefix`).
    pub prefix: String,
    /// Timeout of the registry's ZooKeeper session (10 s by default): a server that dies
    /// without deregistering disappears after this long. ZooKeeper keeps it within its
    /// `minSessionTimeout` and `maxSessionTimeout` (by default 2 and 20 times its `tickTime`,
    /// so 4 s to 40 s); one longer than the handshake carries (2³¹ − 1 ms, about 24.8 days)
    /// is asked as that.
    pub session_timeout: Duration,
    /// Limit on opening a session (3 s by default).
    pub connect_timeout: Duration,
    /// Limit on each request to ZooKeeper (3 s by default): past it the operation fails as
    /// unreachable (or, in the background tasks, is retried).
    pub request_timeout: Duration,
    /// Largest registration written, in bytes (1 MiB less one by default: ZooKeeper's own
    /// default `jute.maxbuffer`). An instance is written once per service it serves, in one
    /// request, which ZooKeeper answers by closing the connection (every watch of the process
    /// then reconnects) when it is over its limit: a larger registration is refused here, as a
    /// configuration error naming its size. Raise both together.
    pub max_request_bytes: usize,
}

impl Default for ZooKeeperOptions {
    fn default() -> Self {
        ZooKeeperOptions {
            prefix: "/rpc".to_string(),
            session_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(3),
            max_request_bytes: 0xfffff,
        }
    }
}

/// A [`Registry`] backed by ZooKeeper (3.6 or later: it uses persistent recursive watches):
/// every instance is a set of ephemeral nodes of the registry's one session, and every watched
/// service is followed by one watch shared by all its watchers.
///
/// Cheap to clone: clones share the session, the registrations and the watches.
///
/// # Layout
///
/// Every instance is stored once per service it serves, as the ephemeral node
/// `<prefix>/services/<service id>/<instance id>` (prefix `/rpc` by default) holding the JSON
/// of [`Instance`] (the same value an etcd registry stores). Service nodes are containers,
/// which ZooKeeper removes once their last instance is gone. A `/` or `%` inside a service or
/// instance id is written `%2F` or `%25`, and an id made of dots only has them written `%2E`
/// (as in etcd's keys); so is, as `%XX` per byte of its UTF-8, each character ZooKeeper refuses
/// in a path (controls, private use, U+FFF0 and up, anything past U+FFFF), which etcd keys
/// hold as they are.
///
/// # Sessions, and ZooKeeper away
///
/// - Constructing the registry never contacts ZooKeeper: it cannot fail because ZooKeeper is
///   down. The session is opened by the first operation that needs it.
/// - [`register`](Registry::register) and the first [`watch`](Registry::watch) of a service
///   need ZooKeeper and fail with a clear [`RegistryError::Unavailable`] ("ZooKeeper at
///   127.0.0.1:2181 unreachable: ...") when it does not answer in time.
/// - A server that dies (or whose registry is dropped without deregistering) leaves its
///   session to expire: its nodes go after [`ZooKeeperOptions::session_timeout`].
/// - Once registered, an instance stays registered: while the connection is lost the session
///   (and so the nodes) lives on for its timeout and the client reconnects; if the session ends
///   (it expired, or ZooKeeper came back without it), the nodes are written again on a new
///   session, retried with a backoff of at most a quarter of the session timeout (and 2 s).
///   A session this side gave up on while ZooKeeper was unreachable is resumed if ZooKeeper
///   still has it, so its nodes stay as they were.
/// - Once watched, a service keeps its last known endpoints while ZooKeeper is away; after a
///   reconnection, or on a new session, it reads the service again.
///
/// [`deregister`](Registry::deregister) removes an instance's nodes at once.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use rpc_registry::{Instance, Registry, ZooKeeperOptions, ZooKeeperRegistry};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), rpc_registry::RegistryError> {
/// let options = ZooKeeperOptions {
///     session_timeout: Duration::from_secs(6),
///     ..ZooKeeperOptions::default()
/// };
/// let registry = ZooKeeperRegistry::new(&["127.0.0.1:2181"], options)?;
/// // Or: ZooKeeperRegistry::from_url("zk://127.0.0.1:2181")?
///
/// registry.register(Instance::new("127.0.0.1:9001", ["echo.Echo"])).await?;
/// let mut watch = registry.watch(&"echo.Echo".into()).await?;
/// println!("echo.Echo is served by {:?}", watch.current());
/// watch.changed().await?; // the next addition or removal
/// registry.deregister("127.0.0.1:9001").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ZooKeeperRegistry {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ZooKeeperRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperRegistry")
            .field("servers", &self.inner.conn.servers)
            .field("options", &*self.inner.conn.options)
            .finish()
    }
}

struct Inner {
    conn: Conn,
    registrations: Registrations,
    watches: Watches,
    /// Numbers the registrations, so that a task can tell whether it still owns its id.
    tokens: AtomicU64,
    /// Never sent on: background tasks see its receivers close when the registry is dropped.
    _alive: watch::Sender<()>,
    alive: watch::Receiver<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The tasks also end on their own when they see `alive` close.
        if let Ok(mut registrations) = self.registrations.try_lock() {
            for (_, registration) in registrations.drain() {
                registration.task.abort();
            }
        }
    }
}

/// Instance id → its registration. Held across the ZooKeeper calls of register, deregister and
/// re-registration, which are rare, so that they apply in order.
type Registrations = Arc<tokio::sync::Mutex<HashMap<String, Registration>>>;

struct Registration {
    token: u64,
    paths: Vec<String>,
    /// What the nodes hold: written back should a replacement fail after it may have landed.
    value: Vec<u8>,
    task: JoinHandle<()>,
}

/// The longest session timeout a ZooKeeper handshake carries: 32-bit milliseconds.
const MAX_SESSION_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

impl ZooKeeperRegistry {
    /// A registry on the ZooKeeper ensemble at `servers` (`host:port` each).
    ///
    /// Nothing is sent to ZooKeeper yet, so this succeeds while ZooKeeper is down; it fails
    /// only on an unusable configuration (no server, a malformed one, a bad prefix, a zero
    /// timeout).
    pub fn new(
        servers: &[impl AsRef<str>],
        mut options: ZooKeeperOptions,
    ) -> Result<Self, RegistryError> {
        let servers = non_blank(servers);
        if servers.is_empty() {
            return Err(RegistryError::Config(
                "no ZooKeeper server given: expected host:port[,host:port...]".into(),
            ));
        }
        for s in &servers {
            if !is_host_port(s) {
                return Err(RegistryError::Config(format!(
                    "bad ZooKeeper server {s:?}: expected host:port"
                )));
            }
        }
        check_prefix(&options.prefix)?;
        for (name, timeout) in [
            ("session", options.session_timeout),
            ("connect", options.connect_timeout),
            ("request", options.request_timeout),
        ] {
            if timeout.is_zero() {
                return Err(RegistryError::Config(format!(
                    "ZooKeeper {name} timeout must not be zero"
                )));
            }
        }
        // The handshake carries the session timeout as 32-bit milliseconds: a longer one would
        // wrap (to a negative number, which ZooKeeper takes as its minimum) or, at
        // `Duration::MAX`, overflow in the client. The longest it carries gets ZooKeeper's
        // maximum, as a long timeout is documented to.
        options.session_timeout = options.session_timeout.min(MAX_SESSION_TIMEOUT);
        let (alive_tx, alive) = watch::channel(());
        Ok(ZooKeeperRegistry {
            inner: Arc::new(Inner {
                conn: Conn::new(servers.join(","), options),
                registrations: Arc::new(tokio::sync::Mutex::new(HashMap::new())),
                watches: Arc::new(Mutex::new(HashMap::new())),
                tokens: AtomicU64::new(0),
                _alive: alive_tx,
                alive,
            }),
        })
    }

    /// A registry from a URL such as `zk://127.0.0.1:2181`, `zk://h1:2181,h2:2181` or
    /// `zk://127.0.0.1:2181/prefix` (the path, when given, is the prefix), with the default
    /// options.
    pub fn from_url(url: &str) -> Result<Self, RegistryError> {
        Self::from_url_with_options(url, ZooKeeperOptions::default())
    }

    /// Like [`from_url`](Self::from_url), with `options` (a path in the URL replaces
    /// `options.prefix`).
    pub fn from_url_with_options(
        url: &str,
        mut options: ZooKeeperOptions,
    ) -> Result<Self, RegistryError> {
        let (servers, prefix) = parse_url(url)?;
        if let Some(prefix) = prefix {
            options.prefix = prefix;
        }
        Self::new(&servers, options)
    }

    /// The options in force.
    pub fn options(&self) -> &ZooKeeperOptions {
        &self.inner.conn.options
    }

    /// The ZooKeeper servers, comma-separated, as given.
    pub fn servers(&self) -> &str {
        &self.inner.conn.servers
    }

    /// The node under which `instance_id` is published for `service`:
    /// `<prefix>/services/<service id>/<instance id>`.
    pub fn path(&self, service: &ServiceId, instance_id: &str) -> String {
        self.inner.conn.path(service, instance_id)
    }

    async fn register_instance(&self, instance: Instance) -> Result<(), RegistryError> {
        let conn = &self.inner.conn;
        let value = encode(&instance)?;
        let paths = places(&instance, |s, id| conn.path(s, id));
        // (Each operation of the transaction carries a few dozen bytes besides.)
        let size: usize = paths.iter().map(|p| p.len() + value.len() + 64).sum();
        if size > conn.options.max_request_bytes {
            return Err(RegistryError::Config(format!(
                "instance {}: its registration is {size} bytes in one ZooKeeper request ({} \
                 services, {} bytes each), over the limit of {} (ZooKeeper's jute.maxbuffer, \
                 1 MiB by default): publish less metadata or fewer services per instance, or \
                 raise jute.maxbuffer and ZooKeeperOptions::max_request_bytes together",
                instance.id,
                paths.len(),
                value.len(),
                conn.options.max_request_bytes
            )));
        }

        let mut registrations = self.inner.registrations.lock().await;
        let obsolete: Vec<String> = registrations
            .get(&instance.id)
            .map(|old| {
                old.paths
                    .iter()
                    .filter(|p| !paths.contains(p))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if paths.is_empty() {
            // Nothing to publish; a previous version of the instance goes away, as when it is
            // deregistered.
            return self.remove_registered(registrations, &instance.id).await;
        }
        // One transaction: on failure the previous version stays as it was, still kept. Given
        // up mid-way, it may have been committed: the nodes no registration keeps go again.
        let kept: &[String] = registrations
            .get(&instance.id)
            .map_or(&[], |old| old.paths.as_slice());
        // A replacement that failed after it may have landed (deleted the previous version's
        // nodes of services it drops, rewritten the others) puts the previous version back,
        // which stays registered: as etcd's registry does.
        let put_back = registrations.get(&instance.id).map(|old| PutBack {
            token: old.token,
            paths: old.paths.clone(),
            value: old.value.clone(),
        });
        let mut given_up = RemoveIfGivenUp(Some(PendingRemoval {
            conn: conn.clone(),
            registrations: self.inner.registrations.clone(),
            instance_id: instance.id.clone(),
            paths: paths
                .iter()
                .filter(|p| !kept.contains(p))
                .cloned()
                .collect(),
            alive: self.inner.alive.clone(),
            put_back,
        }));
        let written = conn.write(&paths, &value, &obsolete).await;
        // A failure may still have been committed (a request that timed out, a connection
        // lost after sending): only a write known to be in is disarmed, or one refused before
        // anything was sent (a path ZooKeeper cannot take: its removal would be refused as
        // well, for ever).
        if matches!(written, Ok(_) | Err(RegistryError::Config(_))) {
            given_up.0 = None;
        }
        let client = written?;
        if let Some(old) = registrations.remove(&instance.id) {
            // It cannot be writing: that takes the lock held here.
            old.task.abort();
        }
        let token = self.inner.tokens.fetch_add(1, Ordering::Relaxed);
        let task = tokio::spawn(keep_registered(KeepRegistered {
            conn: conn.clone(),
            registrations: self.inner.registrations.clone(),
            instance_id: instance.id.clone(),
            token,
            paths: paths.clone(),
            value: value.clone(),
            client,
            alive: self.inner.alive.clone(),
        }));
        registrations.insert(
            instance.id,
            Registration {
                token,
                paths,
                value,
                task,
            },
        );
        Ok(())
    }

    async fn deregister_instance(&self, instance_id: &str) -> Result<(), RegistryError> {
        let registrations = self.inner.registrations.lock().await;
        self.remove_registered(registrations, instance_id).await
    }

    /// Stops keeping `instance_id` registered and removes its nodes, under the lock of the
    /// registrations (`registrations`); when ZooKeeper does not answer, the nodes are removed
    /// in the background as soon as it does.
    async fn remove_registered(
        &self,
        mut registrations: tokio::sync::MutexGuard<'_, HashMap<String, Registration>>,
        instance_id: &str,
    ) -> Result<(), RegistryError> {
        let Some(registration) = registrations.remove(instance_id) else {
            return Ok(());
        };
        registration.task.abort();
        // Still under the lock: a registration of the same id waits for the removal, so that
        // the removal cannot take the new version's nodes.
        let conn = &self.inner.conn;
        let mut given_up = RemoveIfGivenUp(Some(PendingRemoval {
            conn: conn.clone(),
            registrations: self.inner.registrations.clone(),
            instance_id: instance_id.to_string(),
            paths: registration.paths.clone(),
            alive: self.inner.alive.clone(),
            put_back: None,
        }));
        let removed = conn.remove(&registration.paths).await;
        given_up.0 = None;
        match removed {
            Ok(()) => Ok(()),
            Err(e) => {
                // The session may well live on (a reconnection keeps it): the nodes are
                // removed in the background once ZooKeeper answers (unless the id is registered
                // again first).
                drop(registrations);
                tokio::spawn(remove_later(PendingRemoval {
                    conn: conn.clone(),
                    registrations: self.inner.registrations.clone(),
                    instance_id: instance_id.to_string(),
                    paths: registration.paths,
                    alive: self.inner.alive.clone(),
                    put_back: None,
                }));
                Err(e.map_message(|m| {
                    format!(
                        "{m}; the instance's nodes are removed as soon as ZooKeeper answers, or \
                         go when the session ends"
                    )
                }))
            }
        }
    }

    async fn watch_service(&self, service: &ServiceId) -> Result<ServiceWatch, RegistryError> {
        let conn = &self.inner.conn;
        let open = async {
            let dir = conn.service_dir(service);
            let (client, watcher, instances) = tasks::open(conn, service, &dir).await?;
            Ok((dir, client, watcher, instances))
        };
        shared_watch(
            &self.inner.watches,
            &self.inner.alive,
            service,
            open,
            |(_, _, _, instances)| snapshot(service, instances.values()),
            |(dir, client, watcher, instances), signals| {
                tokio::spawn(
                    WatchTask {
                        conn: conn.clone(),
                        service: service.clone(),
                        dir,
                        signals,
                        instances,
                        backoff: Backoff::up_to(conn.retry_max()),
                    }
                    .run(client, watcher),
                );
            },
        )
        .await
    }
}

/// Removes an instance's nodes in the background ([`remove_later`]) when dropped armed: a
/// removal given up mid-way (a timeout around a deregistration, a server's shutdown) has
/// already forgotten the registration that a later deregistration would find, and a write
/// given up mid-way may have been committed before its registration was kept; either way the
/// nodes belong to the registry's session, which lives on.
struct RemoveIfGivenUp(Option<PendingRemoval>);

/// What [`remove_later`] takes.
struct PendingRemoval {
    conn: Conn,
    registrations: Registrations,
    instance_id: String,
    paths: Vec<String>,
    alive: watch::Receiver<()>,
    /// The previous version of a replaced registration, to write back.
    put_back: Option<PutBack>,
}

/// A registration's previous version, written back after its replacement failed while that
/// version is still the one registered (its `token`).
struct PutBack {
    token: u64,
    paths: Vec<String>,
    value: Vec<u8>,
}

impl Drop for RemoveIfGivenUp {
    fn drop(&mut self) {
        let Some(p) = self.0.take() else {
            return;
        };
        let instance = p.instance_id.clone();
        if !spawn_here(remove_later(p)) {
            tracing::warn!(
                %instance,
                "a registration or deregistration was given up outside a Tokio runtime: the \
                 instance's nodes stay until the registry's session ends"
            );
        }
    }
}

/// Removes a deregistered instance's nodes, at once and then again until it works, the id is
/// registered again with them all, or the registry is dropped; for a replacement that failed
/// while the previous version is still registered, writes that version back instead (removing
/// the nodes only the replacement had). The first attempt does not wait: the registry is often
/// dropped right after giving the removal up (a server's shutdown given up), and it is the one
/// attempt made then (requests on a session are applied in order, so a given-up write still in
/// flight lands before it).
async fn remove_later(p: PendingRemoval) {
    let PendingRemoval {
        conn,
        registrations,
        instance_id,
        paths,
        mut alive,
        put_back,
    } = p;
    let mut backoff = Backoff::up_to(conn.retry_max());
    loop {
        let registrations = registrations.lock().await;
        let again = registrations.get(&instance_id);
        // Registered again meanwhile: its own nodes stay, but those of services it no longer
        // serves still go (its registration replaced nothing, this one being gone).
        let left: Vec<String> = match again {
            Some(again) => paths
                .iter()
                .filter(|p| !again.paths.contains(p))
                .cloned()
                .collect(),
            None => paths.clone(),
        };
        let done = match (&put_back, again) {
            (Some(old), Some(again)) if again.token == old.token => {
                conn.write(&old.paths, &old.value, &left).await.map(drop)
            }
            _ if left.is_empty() => return,
            _ => conn.remove(&left).await,
        };
        match done {
            // Done, or paths ZooKeeper cannot take (refused before sending): none can exist.
            Ok(()) | Err(RegistryError::Config(_)) => return,
            Err(e) => {
                tracing::debug!(instance = %instance_id, error = %e, "removal failed; retrying")
            }
        }
        drop(registrations);
        if !pause(backoff.next(), &mut alive).await {
            return;
        }
    }
}

impl Registry for ZooKeeperRegistry {
    fn state_id(&self) -> usize {
        Arc::as_ptr(&self.inner).cast::<()>() as usize
    }

    /// Writes one ephemeral node per service, in one transaction, and keeps them registered
    /// across sessions in the background. Registering an id again replaces the previous
    /// version (and removes the nodes of services it no longer serves) in one transaction.
    /// Fails if ZooKeeper does not answer in time; the previous version then stays.
    fn register(&self, instance: Instance) -> BoxFuture<'_, Result<(), RegistryError>> {
        Box::pin(self.register_instance(instance))
    }

    /// Removes the instance's nodes at once. An unknown id is not an error. If ZooKeeper does
    /// not answer, the removal is retried in the background (and the nodes go anyway when the
    /// session ends).
    fn deregister<'a>(&'a self, instance_id: &'a str) -> BoxFuture<'a, Result<(), RegistryError>> {
        Box::pin(self.deregister_instance(instance_id))
    }

    /// Watches the service's node (a persistent recursive watch), then reads its instances (the
    /// first snapshot); one watch serves every watcher of the service. The first watch of a
    /// service fails if ZooKeeper does not answer; later ones share the running watch and keep
    /// the last known endpoints while ZooKeeper is away.
    fn watch<'a>(
        &'a self,
        service: &'a ServiceId,
    ) -> BoxFuture<'a, Result<ServiceWatch, RegistryError>> {
        Box::pin(self.watch_service(service))
    }

    /// Lists `<prefix>/services` and counts each service's instances (one pipelined batch):
    /// the services with at least one live instance. Fails if ZooKeeper does not answer.
    fn services(&self) -> BoxFuture<'_, Result<Vec<ServiceId>, RegistryError>> {
        Box::pin(self.inner.conn.services())
    }
}

/// A prefix is an absolute ZooKeeper path: `/`, or `/a/b` with no empty, `.` or `..` segment.
fn check_prefix(prefix: &str) -> Result<(), RegistryError> {
    prefix_problem(prefix).map_or(Ok(()), |why| {
        Err(RegistryError::Config(format!(
            "bad ZooKeeper prefix {prefix:?}: {why}; expected an absolute path such as /rpc"
        )))
    })
}

/// What is wrong with `prefix`, if anything.
fn prefix_problem(prefix: &str) -> Option<&'static str> {
    let Some(rest) = prefix.strip_prefix('/') else {
        return Some("it does not start with /");
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let bad_segment = |s: &str| s.is_empty() || s == "." || s == "..";
    if !rest.is_empty() && rest.split('/').any(bad_segment) {
        return Some("it has an empty, . or .. segment");
    }
    None
}

/// `zk://h1:2181,h2:2181/prefix` → `(["h1:2181", "h2:2181"], Some("/prefix"))`.
fn parse_url(url: &str) -> Result<(Vec<String>, Option<String>), RegistryError> {
    const FORM: &str = "expected zk://host:port[,host:port...][/prefix]";
    let Some(rest) = crate::url::strip_prefix_ignoring_case(url.trim(), "zk://") else {
        return Err(RegistryError::Config(format!(
            "bad ZooKeeper URL {url:?}: {FORM}"
        )));
    };
    let (hosts, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], Some(&rest[i..])),
        None => (rest, None),
    };
    let servers: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if servers.is_empty() {
        return Err(RegistryError::Config(format!(
            "bad ZooKeeper URL {url:?}: no server; {FORM}"
        )));
    }
    for s in &servers {
        if !is_host_port(s) {
            return Err(RegistryError::Config(format!(
                "bad ZooKeeper URL {url:?}: {s:?} is not host:port; {FORM}"
            )));
        }
    }
    let prefix = prefix
        .filter(|p| !p.trim_end_matches('/').is_empty())
        .map(|p| p.trim_end_matches('/').to_string());
    if let Some(why) = prefix.as_deref().and_then(prefix_problem) {
        return Err(RegistryError::Config(format!(
            "bad ZooKeeper URL {url:?}: the prefix {why}; {FORM}"
        )));
    }
    Ok((servers, prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("zk://127.0.0.1:2181").unwrap(),
            (vec!["127.0.0.1:2181".to_string()], None)
        );
        assert_eq!(
            parse_url("zk://a:1, b:2/").unwrap(),
            (vec!["a:1".to_string(), "b:2".to_string()], None)
        );
        assert_eq!(
            parse_url("zk://a:1/team/rpc/").unwrap(),
            (vec!["a:1".to_string()], Some("/team/rpc".to_string()))
        );
        for bad in [
            "127.0.0.1:2181",
            "zk://",
            "zk://host",
            "zk://h:port",
            "etcd://h:1",
            "zk://h:1/a//b",
            "zk://h:1/a/../b",
        ] {
            let e = parse_url(bad).unwrap_err().to_string();
            assert!(e.contains("zk://host:port"), "{bad}: {e}");
        }
    }

    #[test]
    fn prefixes() {
        for good in ["/", "/rpc", "/a/b", "/rpc/"] {
            assert!(check_prefix(good).is_ok(), "{good}");
        }
        for bad in ["", "rpc", "/a//b", "/./b", "/a/.."] {
            let e = check_prefix(bad).unwrap_err().to_string();
            assert!(e.contains("expected an absolute path"), "{bad}: {e}");
        }
        let reg = ZooKeeperRegistry::from_url("zk://127.0.0.1:1/").unwrap();
        assert_eq!(reg.path(&"a.A".into(), "x"), "/rpc/services/a.A/x");
        let options = ZooKeeperOptions {
            prefix: "/".into(),
            ..ZooKeeperOptions::default()
        };
        let reg = ZooKeeperRegistry::from_url_with_options("zk://127.0.0.1:1", options).unwrap();
        assert_eq!(reg.path(&"a/b".into(), ".."), "/services/a%2Fb/%2E%2E");
    }

    /// A session timeout longer than the handshake's 32-bit milliseconds is asked as the
    /// longest it carries (ZooKeeper then gives its maximum): before, `Duration::MAX` panicked
    /// in the first request's connect, and 30 days wrapped to a negative number, which
    /// ZooKeeper took as its minimum.
    #[tokio::test]
    async fn a_session_timeout_past_the_handshakes_is_its_longest() {
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("zk://{}", free.local_addr().expect("addr"));
        drop(free);
        for long in [Duration::MAX, Duration::from_secs(30 * 24 * 3600)] {
            let options = ZooKeeperOptions {
                session_timeout: long,
                connect_timeout: Duration::from_millis(300),
                request_timeout: Duration::from_millis(300),
                ..ZooKeeperOptions::default()
            };
            let reg = ZooKeeperRegistry::from_url_with_options(&url, options).expect("built");
            assert_eq!(reg.options().session_timeout, MAX_SESSION_TIMEOUT);
            let watched = tokio::spawn(async move { reg.watch(&"a.A".into()).await.err() });
            let refused = watched.await.expect("no panic");
            assert!(
                matches!(refused, Some(RegistryError::Unavailable(_))),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn a_zero_timeout_is_refused_as_configuration() {
        let zero = Duration::ZERO;
        for (name, options) in [
            (
                "session",
                ZooKeeperOptions {
                    session_timeout: zero,
                    ..Default::default()
                },
            ),
            (
                "connect",
                ZooKeeperOptions {
                    connect_timeout: zero,
                    ..Default::default()
                },
            ),
            (
                "request",
                ZooKeeperOptions {
                    request_timeout: zero,
                    ..Default::default()
                },
            ),
        ] {
            let e = ZooKeeperRegistry::from_url_with_options("zk://127.0.0.1:1", options)
                .err()
                .unwrap_or_else(|| panic!("a zero {name} timeout was taken"));
            assert!(matches!(e, RegistryError::Config(_)), "{name}: {e}");
            assert!(e.to_string().contains(&format!("{name} timeout")), "{e}");
        }
    }

    #[tokio::test]
    async fn construction_does_not_need_zookeeper() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let reg = ZooKeeperRegistry::from_url_with_options(
            &format!("zk://127.0.0.1:{port}/t"),
            ZooKeeperOptions {
                request_timeout: Duration::from_millis(300),
                connect_timeout: Duration::from_millis(300),
                ..ZooKeeperOptions::default()
            },
        )
        .unwrap();
        assert_eq!(reg.path(&"a.A".into(), "x"), "/t/services/a.A/x");
        let unreachable = format!("ZooKeeper at 127.0.0.1:{port} unreachable");
        let e = reg.watch(&"a.A".into()).await.unwrap_err().to_string();
        assert!(e.contains(&unreachable), "{e}");
        let e = reg
            .register(Instance::new("127.0.0.1:2", ["a.A"]))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(&unreachable), "{e}");
        let e = reg.services().await.unwrap_err().to_string();
        assert!(e.contains(&unreachable), "{e}");
        // Nothing was registered: nothing to remove.
        reg.deregister("127.0.0.1:2").await.unwrap();
    }
}
