//! The background tasks: one keeps an instance registered across sessions, one follows a
//! watched service.

use futures_util::FutureExt;
use rpc_core::ServiceId;
use tokio::sync::watch;
use zookeeper_client as zk;

use super::conn::{ended, Conn, Instances};
use super::Registrations;
use crate::instance::snapshot;
use crate::remote::{pause, Backoff, Signals};
use crate::RegistryError;

/// What the task keeping one instance registered needs.
pub(super) struct KeepRegistered {
    pub(super) conn: Conn,
    pub(super) registrations: Registrations,
    pub(super) instance_id: String,
    /// Tells this registration from a later one of the same id.
    pub(super) token: u64,
    pub(super) paths: Vec<String>,
    pub(super) value: Vec<u8>,
    /// The client of the session the nodes were written on.
    pub(super) client: zk::Client,
    pub(super) alive: watch::Receiver<()>,
}

/// Keeps an instance registered until aborted (deregistration, a new version) or the registry
/// is dropped: whenever the session its nodes belong to ends, it writes them again on the next
/// one.
pub(super) async fn keep_registered(mut r: KeepRegistered) {
    let mut backoff = Backoff::up_to(r.conn.retry_max());
    loop {
        // Waits for the end of the session. (Disconnections within it keep the nodes.)
        let mut states = r.client.state_watcher();
        if !ended(r.client.state()) {
            loop {
                let state = tokio::select! {
                    state = states.changed() => state,
                    _ = r.alive.changed() => return,
                };
                if ended(state) {
                    break;
                }
            }
        }
        let lost = r.client.session_id();
        tracing::warn!(
            instance = %r.instance_id, session = %lost,
            "ZooKeeper session ended; registering the instance again"
        );
        let mut failures = 0u64;
        loop {
            let attempt = {
                let registrations = r.registrations.lock().await;
                // Deregistered or replaced meanwhile: the new owner of the id takes over.
                if registrations
                    .get(&r.instance_id)
                    .is_none_or(|current| current.token != r.token)
                {
                    return;
                }
                r.conn.write(&r.paths, &r.value, &[]).await
            };
            match attempt {
                Ok(client) => {
                    if client.session_id() == lost {
                        tracing::info!(instance = %r.instance_id, "ZooKeeper session resumed");
                    } else {
                        tracing::info!(
                            instance = %r.instance_id, session = %client.session_id(),
                            "registered again on a new ZooKeeper session"
                        );
                    }
                    r.client = client;
                    backoff.reset();
                    break;
                }
                Err(e) => {
                    // Loud once in a while: the instance is not in the registry meanwhile.
                    failures += 1;
                    if failures.is_power_of_two() {
                        tracing::warn!(
                            instance = %r.instance_id, error = %e, failures,
                            "registering again failed; the instance is not in the registry \
                             until it works; retrying"
                        );
                    } else {
                        tracing::debug!(
                            instance = %r.instance_id, error = %e,
                            "registering again failed; retrying"
                        );
                    }
                    if !pause(backoff.next(), &mut r.alive).await {
                        return;
                    }
                }
            }
        }
    }
}

/// Follows one service's nodes and publishes every change of its snapshot.
pub(super) struct WatchTask {
    pub(super) conn: Conn,
    pub(super) service: ServiceId,
    /// `<prefix>/services/<service id>`.
    pub(super) dir: String,
    pub(super) signals: Signals,
    pub(super) instances: Instances,
    pub(super) backoff: Backoff,
}

/// How following a session ended.
enum End {
    /// Nobody watches anymore, or the registry was dropped.
    Stop,
    /// The session ended: watch again on a new one.
    SessionEnded(zk::SessionState),
}

/// A session's client, its watch on the service node, and what it read.
type Opened = (zk::Client, zk::PersistentWatcher, Instances);

/// Opens (or reuses) the registry's session, watches `dir` and reads the service: watching
/// first, so that no change falls between the read and the watch.
pub(super) async fn open(
    conn: &Conn,
    service: &ServiceId,
    dir: &str,
) -> Result<Opened, RegistryError> {
    let client = conn.client().await?;
    let watcher = conn.watch(&client, dir).await?;
    let instances = conn.read(&client, service).await?;
    Ok((client, watcher, instances))
}

impl WatchTask {
    /// Logs a failure: a warning when the trouble starts, then quietly at debug level until it
    /// is over.
    fn trouble(&self, failing: &mut bool, what: &str, e: &dyn std::fmt::Display) {
        if !std::mem::replace(failing, true) {
            tracing::warn!(
                service = %self.service, error = %e,
                "{what}; keeping the last known endpoints and retrying"
            );
        } else {
            tracing::debug!(service = %self.service, error = %e, "{what}, again");
        }
    }

    pub(super) async fn run(mut self, client: zk::Client, watcher: zk::PersistentWatcher) {
        let mut session = Some((client, watcher));
        let mut failing = false;
        loop {
            let (client, mut watcher) = match session.take() {
                Some(session) => session,
                None => loop {
                    if !self.signals.pause(self.backoff.next()).await {
                        return;
                    }
                    let opened = tokio::select! {
                        opened = open(&self.conn, &self.service, &self.dir) => opened,
                        _ = self.signals.stopped() => return,
                    };
                    match opened {
                        Ok((client, watcher, instances)) => {
                            if std::mem::take(&mut failing) {
                                tracing::info!(service = %self.service, "ZooKeeper watch resumed");
                            }
                            self.instances = instances;
                            self.publish();
                            self.backoff.reset();
                            break (client, watcher);
                        }
                        Err(e) => self.trouble(&mut failing, "ZooKeeper unreachable", &e),
                    }
                },
            };
            match self.follow(&client, &mut watcher, &mut failing).await {
                End::Stop => return,
                End::SessionEnded(state) => {
                    self.trouble(&mut failing, "ZooKeeper session ended", &state);
                }
            }
        }
    }

    /// Applies the watch's events until the session ends or the task must end. After a
    /// reconnection the watch is added again and everything is read again; after a read that
    /// failed, everything is read again.
    ///
    /// Why both: ZooKeeper does not replay the events a persistent watch missed while the
    /// client was disconnected, and zookeeper-client 0.11 re-sends a session's watches after a
    /// reconnection in a request that carries only the one-shot kinds, so the persistent watch
    /// itself is gone. Adding it again is harmless where it is not (ZooKeeper keeps one watch
    /// per path and mode), and dropping the previous watcher then removes nothing on the server,
    /// since the new one has the same path and mode.
    async fn follow(
        &mut self,
        client: &zk::Client,
        watcher: &mut zk::PersistentWatcher,
        failing: &mut bool,
    ) -> End {
        // Whether the instances may miss changes, whether the watch must be added again, and
        // whether the session is disconnected.
        let (mut stale, mut rewatch, mut disconnected) = (false, false, false);
        // When to read the whole service again while it is stale. A deadline, set once per
        // attempt: events of other nodes coming faster than the backoff must not put it off.
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            if stale && !disconnected {
                retry_at.get_or_insert_with(|| tokio::time::Instant::now() + self.backoff.next());
            } else {
                retry_at = None;
            }
            let retry = async {
                match retry_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let first = tokio::select! {
                event = watcher.changed() => Some(event),
                _ = retry => None,
                _ = self.signals.stopped() => return End::Stop,
            };
            let Some(first) = first else {
                retry_at = None;
                stale = !self.refresh(client, watcher, &mut rewatch, failing).await;
                // What the read again found (the changes a failed read missed) is the news.
                self.publish();
                continue;
            };
            // The events already there are applied before publishing: a replaced node (deleted
            // and created in one transaction) never shows as a gap.
            let mut next = Some(first);
            while let Some(event) = next.take() {
                match event.event_type {
                    zk::EventType::Session => match event.session_state {
                        zk::SessionState::Disconnected => {
                            disconnected = true;
                            stale = true;
                            rewatch = true;
                            self.trouble(failing, "ZooKeeper disconnected", &"connection lost");
                        }
                        zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                            disconnected = false;
                            stale = !self.refresh(client, watcher, &mut rewatch, failing).await;
                        }
                        state => {
                            self.publish();
                            return End::SessionEnded(state);
                        }
                    },
                    zk::EventType::NodeCreated | zk::EventType::NodeDataChanged => {
                        if let Some(name) = self.child(&event.path) {
                            match self.conn.read_one(client, &event.path).await {
                                Ok(Some(instance)) => {
                                    self.instances.insert(name, instance);
                                }
                                Ok(None) => {
                                    self.instances.remove(&name);
                                }
                                Err(e) => {
                                    self.trouble(failing, "reading a changed node failed", &e);
                                    stale = true;
                                }
                            }
                        }
                    }
                    zk::EventType::NodeDeleted => {
                        if event.path == self.dir {
                            self.instances.clear();
                        } else if let Some(name) = self.child(&event.path) {
                            self.instances.remove(&name);
                        }
                    }
                    zk::EventType::NodeChildrenChanged => {}
                }
                next = watcher.changed().now_or_never();
            }
            self.publish();
        }
    }

    /// Adds the watch again if `rewatch` says so, then reads the whole service again; false if
    /// either failed.
    async fn refresh(
        &mut self,
        client: &zk::Client,
        watcher: &mut zk::PersistentWatcher,
        rewatch: &mut bool,
        failing: &mut bool,
    ) -> bool {
        if *rewatch {
            match self.conn.watch(client, &self.dir).await {
                Ok(fresh) => {
                    *watcher = fresh;
                    *rewatch = false;
                }
                Err(e) => {
                    self.trouble(failing, "watching the service again failed", &e);
                    return false;
                }
            }
        }
        self.resync(client, failing).await
    }

    /// Reads the whole service again; false if that failed.
    async fn resync(&mut self, client: &zk::Client, failing: &mut bool) -> bool {
        match self.conn.read(client, &self.service).await {
            Ok(instances) => {
                if std::mem::take(failing) {
                    tracing::info!(service = %self.service, "ZooKeeper watch resumed");
                }
                self.instances = instances;
                self.backoff.reset();
                true
            }
            Err(e) => {
                self.trouble(failing, "reading the service again failed", &e);
                false
            }
        }
    }

    /// The node name of `path` if it is an instance node of the service (a direct child).
    fn child(&self, path: &str) -> Option<String> {
        let name = path.strip_prefix(&self.dir)?.strip_prefix('/')?;
        (!name.is_empty() && !name.contains('/')).then(|| name.to_string())
    }

    /// Publishes the current snapshot if it differs from the last one.
    fn publish(&self) {
        self.signals
            .publish(snapshot(&self.service, self.instances.values()));
    }
}
