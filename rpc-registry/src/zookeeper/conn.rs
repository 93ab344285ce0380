//! Talking to ZooKeeper: the one session a registry keeps (opened when first needed, resumed or
//! replaced once it ends), every request bounded in time, and errors that name ZooKeeper and
//! say what failed.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use rpc_core::ServiceId;
use zookeeper_client as zk;

use super::ZooKeeperOptions;
use crate::remote::{decode_at, escape_for_zookeeper, unescape};
use crate::{Instance, RegistryError};

/// The instances of one service, by node name.
pub(super) type Instances = BTreeMap<String, Arc<Instance>>;

/// What the background tasks share with the registry: the session and the settings.
#[derive(Clone)]
pub(super) struct Conn {
    /// The servers, comma-separated, as the client's connect string (and for messages).
    pub(super) servers: Arc<str>,
    pub(super) options: Arc<ZooKeeperOptions>,
    /// The client of the current session (`None` until first needed), and the last failure to
    /// open one. Locked while a session is being opened, so that the registry opens one at a
    /// time.
    session: Arc<tokio::sync::Mutex<Session>>,
}

/// The current session's client, and the failure of the last attempt to open one.
#[derive(Default)]
struct Session {
    client: Option<zk::Client>,
    failed: Option<(tokio::time::Instant, RegistryError)>,
}

/// How long a failure to open a session is the answer of every caller that asks for one, rather
/// than an attempt of its own. With ZooKeeper unreachable in a way that makes each attempt take
/// its whole `connect_timeout` (packets dropped), the callers waiting for the session (one per
/// watched service, the registration, a stopping server's deregistration) would otherwise each
/// wait for every attempt made before theirs: a server stopping with ten watches waited about a
/// minute to deregister, past most grace periods.
const FAILURE_ANSWERS_FOR: Duration = Duration::from_secs(1);

/// Whether a session in `state` is over for good: a new one is needed.
pub(super) fn ended(state: zk::SessionState) -> bool {
    matches!(
        state,
        zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
    )
}

/// Errors that say a write met a concurrent change: reading again and retrying may succeed.
fn raced(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::NoNode | zk::Error::NodeExists | zk::Error::BadVersion
    )
}

/// Errors that say the session under a request ended: a new session may succeed.
fn session_lost(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::SessionExpired | zk::Error::SessionMoved | zk::Error::ClientClosed
    )
}

impl Conn {
    pub(super) fn new(servers: String, options: ZooKeeperOptions) -> Self {
        Conn {
            servers: Arc::from(servers),
            options: Arc::new(options),
            session: Arc::new(tokio::sync::Mutex::new(Session::default())),
        }
    }

    /// `<prefix>/services`: one child per service.
    pub(super) fn services_root(&self) -> String {
        format!("{}/services", self.options.prefix.trim_end_matches('/'))
    }

    /// `<prefix>/services/<service id>`: one child per instance of the service.
    pub(super) fn service_dir(&self, service: &ServiceId) -> String {
        format!(
            "{}/{}",
            self.services_root(),
            escape_for_zookeeper(service.as_str())
        )
    }

    /// `<prefix>/services/<service id>/<instance id>`.
    pub(super) fn path(&self, service: &ServiceId, instance_id: &str) -> String {
        format!(
            "{}/{}",
            self.service_dir(service),
            escape_for_zookeeper(instance_id)
        )
    }

    /// The longest pause between two attempts of the background tasks: short enough that a
    /// server re-registers well within a session timeout after ZooKeeper is back.
    pub(super) fn retry_max(&self) -> Duration {
        (self.options.session_timeout / 4).min(Duration::from_secs(2))
    }

    fn connector(&self) -> zk::Connector {
        // Each server gets its share of the time to open a session, so that one that takes the
        // connection and never answers leaves the others time within `connect_timeout`: the
        // client's own default gives each 2/5 of the session timeout (4 s of the default 10 s,
        // more than the default `connect_timeout` of 3 s). The client also gives up on a
        // connection that stays silent this long (pinging it at 3/8 of it), so the share is
        // never under 2 s, lest a ZooKeeper pausing for a second drop every session.
        let servers = self.servers.split(',').count().max(1);
        let per_server =
            (self.options.connect_timeout / servers as u32).max(Duration::from_secs(2));
        zk::Client::connector()
            .with_session_timeout(self.options.session_timeout)
            .with_connection_timeout(per_server)
            // Dropping the registry ends nothing at once: its instances go when the session
            // expires, as after a crash (a graceful shutdown deregisters first).
            .with_detached()
            // One pass over the servers, then an error: the callers retry on their own terms.
            .with_fail_eagerly()
    }

    /// The client of the live session, opening one if there is none or the last one ended. A
    /// session that ended only on this side (ZooKeeper was unreachable for longer than its
    /// timeout) is resumed if ZooKeeper still has it, so that its nodes stay as they are. Within
    /// [`FAILURE_ANSWERS_FOR`] of a failed attempt, that failure is the answer.
    pub(super) async fn client(&self) -> Result<zk::Client, RegistryError> {
        let mut slot = self.session.lock().await;
        let previous = match slot.client.as_ref() {
            Some(client) if !ended(client.state()) => return Ok(client.clone()),
            Some(client) => Some(client.session().clone()),
            None => None,
        };
        if let Some((at, failure)) = &slot.failed {
            let ago = at.elapsed();
            if ago < FAILURE_ANSWERS_FOR {
                // Said as what it is: an attempt made moments ago, not one of this caller's.
                return Err(match failure {
                    RegistryError::Unavailable(why) => RegistryError::Unavailable(format!(
                        "{why} (an attempt {} ms ago; the next one in {} ms)",
                        ago.as_millis(),
                        (FAILURE_ANSWERS_FOR - ago).as_millis()
                    )),
                    other => other.clone(),
                });
            }
        }
        let open = async {
            if let Some(session) = previous {
                match self
                    .connector()
                    .with_session(session)
                    .connect(&self.servers)
                    .await
                {
                    Ok(client) => return Ok(client),
                    Err(e) if session_lost(&e) => {}
                    Err(e) => return Err(e),
                }
            }
            self.connector().connect(&self.servers).await
        };
        let what = "opening a session";
        let failure = match tokio::time::timeout(self.options.connect_timeout, open).await {
            Ok(Ok(client)) => {
                *slot = Session {
                    client: Some(client.clone()),
                    failed: None,
                };
                return Ok(client);
            }
            Ok(Err(e)) => self.error(what, &e),
            Err(_) => self.unreachable(
                what,
                &format!("no session within {:?}", self.options.connect_timeout),
            ),
        };
        slot.failed = Some((tokio::time::Instant::now(), failure.clone()));
        Err(failure)
    }

    /// A registry error for `e`, met while doing `what`.
    pub(super) fn error(&self, what: &str, e: &zk::Error) -> RegistryError {
        match e {
            zk::Error::NoHosts | zk::Error::Timeout | zk::Error::ConnectionLoss => {
                self.unreachable(what, &e.to_string())
            }
            zk::Error::BadArguments(why) => RegistryError::Config(format!(
                "ZooKeeper at {}: {what}: {why} (an id ZooKeeper cannot take as a node name?)",
                self.servers
            )),
            _ => RegistryError::Unavailable(format!(
                "ZooKeeper at {}: {what} failed: {e}",
                self.servers
            )),
        }
    }

    fn unreachable(&self, what: &str, cause: &str) -> RegistryError {
        RegistryError::Unavailable(format!(
            "ZooKeeper at {} unreachable: {what}: {cause}; check that ZooKeeper runs and \
             listens there",
            self.servers
        ))
    }

    /// Runs one request under the request timeout (past it: [`zk::Error::Timeout`]).
    pub(super) async fn timed<T>(
        &self,
        fut: impl Future<Output = Result<T, zk::Error>>,
    ) -> Result<T, zk::Error> {
        tokio::time::timeout(self.options.request_timeout, fut)
            .await
            .unwrap_or(Err(zk::Error::Timeout))
    }

    /// A persistent recursive watch on `dir`, which need not exist yet.
    pub(super) async fn watch(
        &self,
        client: &zk::Client,
        dir: &str,
    ) -> Result<zk::PersistentWatcher, RegistryError> {
        self.timed(client.watch(dir, zk::AddWatchMode::PersistentRecursive))
            .await
            .map_err(|e| self.error(&format!("watching {dir}"), &e))
    }

    /// The instances of `service` (one listing, then every node read in one pipelined batch).
    /// Malformed values, and nodes this client may not read, are skipped with a warning.
    pub(super) async fn read(
        &self,
        client: &zk::Client,
        service: &ServiceId,
    ) -> Result<Instances, RegistryError> {
        let dir = self.service_dir(service);
        let what = format!("reading {dir}");
        let names = match self.timed(client.list_children(&dir)).await {
            Ok(names) => names,
            Err(zk::Error::NoNode) => return Ok(Instances::new()),
            Err(e) => return Err(self.error(&what, &e)),
        };
        let paths: Vec<String> = names.iter().map(|n| format!("{dir}/{n}")).collect();
        let reads: Vec<_> = paths.iter().map(|p| client.get_data(p)).collect();
        let results = tokio::time::timeout(self.options.request_timeout, join_all(reads))
            .await
            .map_err(|_| self.error(&what, &zk::Error::Timeout))?;
        let mut instances = Instances::new();
        for ((name, path), result) in names.into_iter().zip(&paths).zip(results) {
            match result {
                Ok((data, _)) => {
                    if let Some(instance) = self.instance_at(path, &data) {
                        instances.insert(name, instance);
                    }
                }
                // Gone between the listing and the read.
                Err(zk::Error::NoNode) => {}
                Err(zk::Error::NoAuth) => unreadable(path),
                Err(e) => return Err(self.error(&what, &e)),
            }
        }
        Ok(instances)
    }

    /// The instance at `path` now: `None` if the node is gone or holds no instance.
    pub(super) async fn read_one(
        &self,
        client: &zk::Client,
        path: &str,
    ) -> Result<Option<Arc<Instance>>, RegistryError> {
        match self.timed(client.get_data(path)).await {
            Ok((data, _)) => Ok(self.instance_at(path, &data)),
            Err(zk::Error::NoNode) => Ok(None),
            Err(zk::Error::NoAuth) => {
                unreadable(path);
                Ok(None)
            }
            Err(e) => Err(self.error(&format!("reading {path}"), &e)),
        }
    }

    /// Every service with at least one instance node, sorted, each once: one listing, then the
    /// children counts of every service node in one pipelined batch.
    pub(super) async fn services(&self) -> Result<Vec<ServiceId>, RegistryError> {
        let client = self.client().await?;
        let root = self.services_root();
        let what = format!("listing {root}");
        let names = match self.timed(client.list_children(&root)).await {
            Ok(names) => names,
            Err(zk::Error::NoNode) => return Ok(Vec::new()),
            Err(e) => return Err(self.error(&what, &e)),
        };
        let paths: Vec<String> = names.iter().map(|n| format!("{root}/{n}")).collect();
        let stats: Vec<_> = paths.iter().map(|p| client.check_stat(p)).collect();
        let stats = tokio::time::timeout(self.options.request_timeout, join_all(stats))
            .await
            .map_err(|_| self.error(&what, &zk::Error::Timeout))?;
        let mut ids = BTreeSet::new();
        for (name, stat) in names.iter().zip(stats) {
            match stat {
                Ok(Some(stat)) if stat.num_children > 0 => {
                    ids.insert(unescape(name));
                }
                Ok(_) => {}
                Err(e) => return Err(self.error(&what, &e)),
            }
        }
        Ok(ids.into_iter().map(ServiceId::from).collect())
    }

    /// Publishes `value` at every one of `paths` as ephemeral nodes of the session, and removes
    /// the nodes of `obsolete` the session owns, in one transaction: either all of it is done
    /// or none. A node of another session at one of `paths` (this instance registered by a
    /// process that since crashed, or by this registry on a session that ended) is replaced.
    /// Returns the client of the session the nodes now belong to.
    pub(super) async fn write(
        &self,
        paths: &[String],
        value: &[u8],
        obsolete: &[String],
    ) -> Result<zk::Client, RegistryError> {
        let what = format!("writing {}", paths.join(", "));
        let mut last = zk::Error::Timeout;
        // A write that meets a concurrent change (or the end of the session) reads again and
        // retries, a few times.
        for _ in 0..3 {
            let client = self.client().await?;
            match self.write_on(&client, paths, value, obsolete).await {
                Ok(()) => return Ok(client),
                Err(e) if raced(&e) || session_lost(&e) => last = e,
                Err(e) => return Err(self.error(&what, &e)),
            }
        }
        Err(self.error(&what, &last))
    }

    async fn write_on(
        &self,
        client: &zk::Client,
        paths: &[String],
        value: &[u8],
        obsolete: &[String],
    ) -> Result<(), zk::Error> {
        // Service nodes are containers: ZooKeeper removes them once their last instance goes.
        let container = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
        let ephemeral = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
        let dirs: BTreeSet<&str> = paths
            .iter()
            .filter_map(|p| p.rsplit_once('/').map(|(dir, _)| dir))
            .collect();
        for dir in dirs {
            self.timed(client.mkdir(dir, &container)).await?;
        }
        let me = client.session_id().0;
        let stats = self.stats(client, paths).await?;
        let old = self.stats(client, obsolete).await?;
        let mut multi = client.new_multi_writer();
        for (path, stat) in paths.iter().zip(stats) {
            match stat {
                None => multi.add_create(path, value, &ephemeral)?,
                Some(stat) if stat.ephemeral_owner == me => {
                    multi.add_set_data(path, value, Some(stat.version))?
                }
                Some(stat) => {
                    multi.add_delete(path, Some(stat.version))?;
                    multi.add_create(path, value, &ephemeral)?;
                }
            }
        }
        for (path, stat) in obsolete.iter().zip(old) {
            if let Some(stat) = stat.filter(|s| s.ephemeral_owner == me) {
                multi.add_delete(path, Some(stat.version))?;
            }
        }
        self.timed(async { multi.commit().await.map_err(zk::Error::from) })
            .await?;
        Ok(())
    }

    /// The instance the node at `path` holds, if it is one published there: its JSON decodes
    /// (else it is skipped with a warning, see [`decode_at`]), and the node is the one the
    /// instance's id and one of its services name. A node written by hand or by another tool
    /// that names another id would stand for an instance that is not there (and could hide the
    /// real one, the endpoints keeping one instance per id); one under a service it does not
    /// serve would be dropped without a word.
    fn instance_at(&self, path: &str, data: &[u8]) -> Option<Arc<Instance>> {
        decode_at(path, data, |s, id| self.path(s, id))
    }

    /// Removes the nodes of `paths` that the current session owns (nodes of other sessions go
    /// with them), in one transaction.
    pub(super) async fn remove(&self, paths: &[String]) -> Result<(), RegistryError> {
        let what = format!("removing {}", paths.join(", "));
        let mut last = zk::Error::Timeout;
        for _ in 0..3 {
            let client = self.client().await?;
            let attempt = async {
                let me = client.session_id().0;
                let stats = self.stats(&client, paths).await?;
                let mut multi = client.new_multi_writer();
                for (path, stat) in paths.iter().zip(stats) {
                    if let Some(stat) = stat.filter(|s| s.ephemeral_owner == me) {
                        multi.add_delete(path, Some(stat.version))?;
                    }
                }
                self.timed(async { multi.commit().await.map_err(zk::Error::from) })
                    .await
                    .map(|_| ())
            };
            match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) if raced(&e) || session_lost(&e) => last = e,
                Err(e) => return Err(self.error(&what, &e)),
            }
        }
        Err(self.error(&what, &last))
    }

    /// The stat of every one of `paths` (`None`: no such node), in one pipelined batch.
    async fn stats(
        &self,
        client: &zk::Client,
        paths: &[String],
    ) -> Result<Vec<Option<zk::Stat>>, zk::Error> {
        let stats: Vec<_> = paths.iter().map(|p| client.check_stat(p)).collect();
        self.timed(async { join_all(stats).await.into_iter().collect() })
            .await
    }
}

/// Says that the node at `path` is skipped: its ACL lets this client list it but not read it
/// (made by another tool; no server of this crate makes one). Its service's other instances are
/// read as usual: one such node must not keep every client from the service.
fn unreadable(path: &str) {
    tracing::warn!(
        node = path,
        "a node this client may not read (its ACL) is skipped"
    );
}
