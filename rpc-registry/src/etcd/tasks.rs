//! The background tasks: one keeps an instance registered, one follows a watched service.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use etcd_client::WatchOptions;
use rpc_core::ServiceId;
use tokio::sync::watch;

use super::conn::{Conn, Instances, KeepAliveEnd};
use crate::instance::snapshot;
use crate::remote::{pause, Backoff, Signals};
use crate::RegistryError;

/// What the keep-alive task of one instance needs.
pub(super) struct KeepRegistered {
    pub(super) conn: Conn,
    pub(super) instance_id: String,
    pub(super) keys: Vec<String>,
    pub(super) value: Vec<u8>,
    pub(super) lease: Arc<AtomicI64>,
    pub(super) ttl: i64,
    pub(super) alive: watch::Receiver<()>,
    pub(super) start: Start,
}

/// How a keep-alive task starts.
pub(super) enum Start {
    /// The keys are written under the lease: keep it alive.
    Written,
    /// Write the keys under a new lease first, then revoke `discard`: for a version put back
    /// after its replacement failed or was given up. The replacement's write may have taken
    /// the keys, and its lease (`discard`, kept alive by nobody) may hold keys of services only
    /// it serves, which would list an instance that is not there until the lease expired. It
    /// is revoked only once the keys are written again, so that the put-back version never
    /// goes missing from the services both serve.
    PutBack { discard: i64 },
}

/// Keeps an instance registered until aborted (deregistration) or the registry is dropped.
pub(super) async fn keep_registered(mut r: KeepRegistered) {
    let mut backoff = Backoff::default();
    // Whether the last attempt failed: the first failure of a streak is a warning, the rest
    // are debug messages, and the recovery is logged.
    let mut failing = false;
    if let Start::PutBack { discard } = r.start {
        if !register_again(&mut r, &mut backoff, &mut failing).await {
            return;
        }
        if let Err(e) = r.conn.revoke(discard).await {
            tracing::warn!(
                instance = %r.instance_id, error = %e,
                "could not revoke the lease of a replacement that was not kept; \
                 its keys expire with it"
            );
        }
    }
    loop {
        let lease = r.lease.load(Ordering::SeqCst);
        let end = tokio::select! {
            end = r.conn.keep_alive(lease, r.ttl, || {
                backoff.reset();
                if std::mem::take(&mut failing) {
                    tracing::info!(instance = %r.instance_id, "etcd reachable again; lease kept");
                }
            }) => end,
            _ = r.alive.changed() => return,
        };
        match end {
            KeepAliveEnd::Failed(e) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(
                        instance = %r.instance_id, error = %e,
                        "lease keep-alive failed; retrying"
                    );
                } else {
                    tracing::debug!(instance = %r.instance_id, error = %e, "keep-alive retry failed");
                }
                if !pause(backoff.next(), &mut r.alive).await {
                    return;
                }
            }
            KeepAliveEnd::Lost => {
                tracing::warn!(
                    instance = %r.instance_id,
                    "etcd lost the instance's lease; registering it again"
                );
                if !register_again(&mut r, &mut backoff, &mut failing).await {
                    return;
                }
            }
        }
    }
}

/// Writes the keys under a new lease until it works; false when the registry was dropped
/// meanwhile.
async fn register_again(r: &mut KeepRegistered, backoff: &mut Backoff, failing: &mut bool) -> bool {
    let mut warned = false;
    loop {
        match reregister(r).await {
            Ok(ttl) => {
                r.ttl = ttl;
                backoff.reset();
                *failing = false;
                tracing::info!(instance = %r.instance_id, "registered again");
                return true;
            }
            Err(e) => {
                // The instance is out of the registry until this works: the first failure of a
                // streak is a warning (a lasting refusal, such as etcd's NOSPACE alarm or an
                // expired token, would otherwise leave no trace above debug level).
                // (Its own streak: the keep-alive's may have started while etcd was away.)
                if !std::mem::replace(&mut warned, true) {
                    *failing = true;
                    tracing::warn!(
                        instance = %r.instance_id, error = %e,
                        "registering the instance again failed; it is not in the registry \
                         until this works; retrying"
                    );
                } else {
                    tracing::debug!(
                        instance = %r.instance_id, error = %e,
                        "registering again failed; retrying"
                    );
                }
                if !pause(backoff.next(), &mut r.alive).await {
                    return false;
                }
            }
        }
    }
}

/// Grants a new lease and writes the keys under it; returns the granted TTL.
async fn reregister(r: &KeepRegistered) -> Result<i64, RegistryError> {
    let (lease, ttl) = r.conn.grant().await?;
    // Recorded before the keys are written, so that a deregistration that aborts this task
    // right after the write still revokes the right lease.
    r.lease.store(lease, Ordering::SeqCst);
    r.conn.put(&r.keys, &r.value, lease).await?;
    Ok(ttl)
}

/// Follows one service's keys and publishes every change of its snapshot.
pub(super) struct WatchTask {
    pub(super) conn: Conn,
    pub(super) service: ServiceId,
    pub(super) prefix: String,
    pub(super) signals: Signals,
    pub(super) instances: Instances,
    pub(super) backoff: Backoff,
}

/// Why a watch task stops following etcd for a while or for good.
enum Interrupt {
    /// Nobody watches anymore, or the registry was dropped.
    Stop,
    /// The etcd watch ended; read the keys again and watch anew.
    Resync,
}

impl WatchTask {
    /// Logs a failed watch or read: a warning when the trouble starts, then quietly at debug
    /// level until it is over.
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

    pub(super) async fn run(mut self, mut revision: i64) {
        let mut failing = false;
        loop {
            match self.follow(revision).await {
                Ok(Interrupt::Stop) => return,
                Ok(Interrupt::Resync) => {}
                Err(e) => self.trouble(&mut failing, "etcd watch interrupted", &e),
            }
            // Read the keys again (a fresh snapshot) before watching again.
            loop {
                if !self.signals.pause(self.backoff.next()).await {
                    return;
                }
                let read = tokio::select! {
                    read = self.conn.read(&self.service) => read,
                    _ = self.signals.stopped() => return,
                };
                match read {
                    Ok((instances, rev)) => {
                        if std::mem::take(&mut failing) {
                            tracing::info!(service = %self.service, "etcd watch resumed");
                        }
                        self.instances = instances;
                        self.publish();
                        revision = rev;
                        break;
                    }
                    Err(e) => self.trouble(&mut failing, "etcd unreachable", &e),
                }
            }
        }
    }

    /// Watches the prefix from `revision + 1`, applying events, until the watch ends
    /// (`Ok(Resync)` or an error) or the task must end (`Ok(Stop)`).
    async fn follow(&mut self, revision: i64) -> Result<Interrupt, RegistryError> {
        let mut client = self.conn.watcher();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let what = format!("watching {}", self.prefix);
        let open = self
            .conn
            .call(&what, client.watch(self.prefix.as_bytes(), Some(options)));
        let mut stream = tokio::select! {
            s = open => s?,
            _ = self.signals.stopped() => return Ok(Interrupt::Stop),
        };
        loop {
            let message = tokio::select! {
                m = stream.message() => m,
                _ = self.signals.stopped() => return Ok(Interrupt::Stop),
            };
            let resp = match message {
                Ok(Some(resp)) => resp,
                Ok(None) => {
                    return Err(RegistryError::Unavailable(format!(
                        "etcd at {} ended the watch of {}",
                        self.conn.target, self.prefix
                    )))
                }
                Err(e) => return Err(self.conn.error(&what, e)),
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                tracing::debug!(
                    service = %self.service,
                    reason = resp.cancel_reason(),
                    compact_revision = resp.compact_revision(),
                    "etcd cancelled the watch; reading the keys again"
                );
                self.backoff.reset();
                return Ok(Interrupt::Resync);
            }
            self.backoff.reset();
            if resp.events().is_empty() {
                continue;
            }
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                // A deleted key (removed, or expired with its lease) has version 0; any put
                // gives it version 1 or more. (This avoids `Event::event_type`, which panics on
                // an event type it does not know.)
                if kv.version() == 0 {
                    self.instances.remove(kv.key());
                } else {
                    match self.conn.instance_at(kv.key(), kv.value()) {
                        Some(instance) => {
                            self.instances.insert(kv.key().to_vec(), instance);
                        }
                        None => {
                            self.instances.remove(kv.key());
                        }
                    }
                }
            }
            self.publish();
        }
    }

    /// Publishes the current snapshot if it differs from the last one.
    fn publish(&self) {
        self.signals
            .publish(snapshot(&self.service, self.instances.values()));
    }
}
