//! Talking to etcd: every request bounded in time, errors that name etcd and say what failed.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions, Txn, TxnOp};
use rpc_core::ServiceId;

use super::EtcdOptions;
use crate::remote::{decode_at, escape, unescape};
use crate::{Instance, RegistryError};

/// What the background tasks share with the registry: the client and the settings.
#[derive(Clone)]
pub(super) struct Conn {
    pub(super) client: Client,
    pub(super) options: Arc<EtcdOptions>,
    /// The endpoints, comma-separated, for messages.
    pub(super) target: Arc<str>,
}

/// The instances of one service, by key.
pub(super) type Instances = BTreeMap<Vec<u8>, Arc<Instance>>;

/// The largest answer a read or a watch of the registry takes: a service's instances are read
/// in one range, and the gRPC client's own default of 4 MiB is reached by a few dozen
/// instances that publish their API schemas; past it the read fails ("decoded message length
/// too large"), and a watch that must read again to resynchronise never recovers. etcd's own
/// limit is on requests (1.5 MiB by default), not on answers.
pub(super) const MAX_READ_BYTES: usize = 256 * 1024 * 1024;

impl Conn {
    pub(super) fn service_prefix(&self, service: &ServiceId) -> String {
        format!(
            "{}services/{}/",
            self.options.prefix,
            escape(service.as_str())
        )
    }

    pub(super) fn key(&self, service: &ServiceId, instance_id: &str) -> String {
        format!("{}{}", self.service_prefix(service), escape(instance_id))
    }

    /// The instance the value at `key` holds, if it is one published there: its JSON decodes,
    /// and the key is the one the instance's id and one of its services name (else it is
    /// skipped with a warning, see [`decode_at`]).
    pub(super) fn instance_at(&self, key: &[u8], value: &[u8]) -> Option<Arc<Instance>> {
        let Ok(key) = std::str::from_utf8(key) else {
            tracing::warn!(key = %String::from_utf8_lossy(key), "a registry key that is not UTF-8 (no instance is published at one) is skipped");
            return None;
        };
        decode_at(key, value, |s, id| self.key(s, id))
    }

    fn ttl_secs(&self) -> i64 {
        let ttl = self.options.lease_ttl;
        let secs = ttl
            .as_secs()
            .saturating_add(u64::from(ttl.subsec_nanos() > 0));
        i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
    }

    pub(super) fn error(&self, what: &str, e: etcd_client::Error) -> RegistryError {
        let unreachable = match &e {
            etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
            etcd_client::Error::GRpcStatus(s) => matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
            ),
            _ => false,
        };
        if unreachable {
            self.unreachable(what, &cause(&e))
        } else {
            RegistryError::Unavailable(format!(
                "etcd at {}: {what} failed: {}",
                self.target,
                cause(&e)
            ))
        }
    }

    fn unreachable(&self, what: &str, cause: &str) -> RegistryError {
        RegistryError::Unavailable(format!(
            "etcd at {} unreachable: {what}: {cause}; check that etcd runs and listens there",
            self.target
        ))
    }

    fn no_answer(&self, what: &str) -> RegistryError {
        self.unreachable(
            what,
            &format!("no answer within {:?}", self.options.request_timeout),
        )
    }

    /// Runs one request under the request timeout.
    pub(super) async fn call<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RegistryError> {
        match tokio::time::timeout(self.options.request_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.error(what, e)),
            Err(_) => Err(self.no_answer(what)),
        }
    }

    /// A key-value client taking answers of up to [`MAX_READ_BYTES`].
    pub(super) fn kv(&self) -> etcd_client::KvClient {
        self.client
            .kv_client()
            .max_decoding_message_size(MAX_READ_BYTES)
    }

    /// A watch client taking answers of up to [`MAX_READ_BYTES`].
    pub(super) fn watcher(&self) -> etcd_client::WatchClient {
        self.client
            .watch_client()
            .max_decoding_message_size(MAX_READ_BYTES)
    }

    /// The service's instances and the revision they were read at. Malformed values are
    /// skipped with a warning.
    pub(super) async fn read(
        &self,
        service: &ServiceId,
    ) -> Result<(Instances, i64), RegistryError> {
        let prefix = self.service_prefix(service);
        let mut kv = self.kv();
        let what = format!("reading {prefix}");
        let resp = self
            .call(
                &what,
                kv.get(prefix.as_bytes(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        let mut instances = Instances::new();
        for kv in resp.kvs() {
            if let Some(instance) = self.instance_at(kv.key(), kv.value()) {
                instances.insert(kv.key().to_vec(), instance);
            }
        }
        Ok((instances, revision))
    }

    /// Every service id with at least one key under `<prefix>services/`, sorted, each once. Reads
    /// the keys only (no instance is decoded): a listing costs etcd one range request.
    pub(super) async fn services(&self) -> Result<Vec<ServiceId>, RegistryError> {
        let prefix = format!("{}services/", self.options.prefix);
        let mut kv = self.kv();
        let what = format!("listing {prefix}");
        let resp = self
            .call(
                &what,
                kv.get(
                    prefix.as_bytes(),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                ),
            )
            .await?;
        let mut ids = std::collections::BTreeSet::new();
        for kv in resp.kvs() {
            let Some(rest) = kv.key().strip_prefix(prefix.as_bytes()) else {
                continue;
            };
            // `<service id>/<instance id>`: the service is the segment before the first `/`
            // (a `/` inside an id is written `%2F`).
            let Some(end) = rest.iter().position(|b| *b == b'/') else {
                continue;
            };
            match std::str::from_utf8(&rest[..end]) {
                Ok(segment) if !segment.is_empty() => {
                    ids.insert(unescape(segment));
                }
                _ => tracing::warn!(
                    key = %String::from_utf8_lossy(kv.key()),
                    "skipping a registry key that names no service"
                ),
            }
        }
        Ok(ids.into_iter().map(ServiceId::from).collect())
    }

    /// A new lease: its id and the TTL etcd granted (seconds).
    pub(super) async fn grant(&self) -> Result<(i64, i64), RegistryError> {
        let mut lease = self.client.lease_client();
        let resp = self
            .call("granting a lease", lease.grant(self.ttl_secs(), None))
            .await?;
        if !resp.error().is_empty() {
            return Err(RegistryError::Unavailable(format!(
                "etcd at {}: granting a lease failed: {}",
                self.target,
                resp.error()
            )));
        }
        Ok((resp.id(), resp.ttl().max(1)))
    }

    /// Writes every key under `lease`, in one transaction.
    pub(super) async fn put(
        &self,
        keys: &[String],
        value: &[u8],
        lease: i64,
    ) -> Result<(), RegistryError> {
        let ops: Vec<TxnOp> = keys
            .iter()
            .map(|k| {
                TxnOp::put(
                    k.as_bytes(),
                    value.to_vec(),
                    Some(PutOptions::new().with_lease(lease)),
                )
            })
            .collect();
        let mut kv = self.kv();
        let what = format!("writing {}", keys.join(", "));
        self.call(&what, kv.txn(Txn::new().and_then(ops))).await?;
        Ok(())
    }

    /// Revokes `lease`; a lease etcd no longer knows counts as revoked.
    pub(super) async fn revoke(&self, lease: i64) -> Result<(), RegistryError> {
        let mut client = self.client.lease_client();
        let what = "revoking a lease";
        match tokio::time::timeout(self.options.request_timeout, client.revoke(lease)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) if lease_not_found(&e) => Ok(()),
            Ok(Err(e)) => Err(self.error(what, e)),
            Err(_) => Err(self.no_answer(what)),
        }
    }

    /// Keeps `lease` alive until it is lost or the keep-alive fails. `on_alive` runs once the
    /// lease is known to be alive.
    pub(super) async fn keep_alive(
        &self,
        lease: i64,
        ttl: i64,
        on_alive: impl FnOnce(),
    ) -> KeepAliveEnd {
        let mut client = self.client.lease_client();
        let (mut keeper, mut stream) = match tokio::time::timeout(
            self.options.request_timeout,
            client.keep_alive(lease),
        )
        .await
        {
            Ok(Ok(v)) => v,
            Ok(Err(e)) if lease_not_found(&e) => return KeepAliveEnd::Lost,
            Ok(Err(e)) => return KeepAliveEnd::Failed(self.error("keeping a lease alive", e)),
            Err(_) => return KeepAliveEnd::Failed(self.no_answer("keeping a lease alive")),
        };
        on_alive();
        let ttl = Duration::from_secs(u64::try_from(ttl).unwrap_or(1).max(1));
        let period = (ttl / 3).max(Duration::from_millis(100));
        let answer_within = self.options.request_timeout.min(ttl);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = keeper.keep_alive().await {
                return KeepAliveEnd::Failed(self.error("keeping a lease alive", e));
            }
            match tokio::time::timeout(answer_within, stream.message()).await {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => {}
                Ok(Ok(Some(_))) => return KeepAliveEnd::Lost,
                Ok(Ok(None)) => {
                    return KeepAliveEnd::Failed(RegistryError::Unavailable(format!(
                        "etcd at {} closed the lease keep-alive stream",
                        self.target
                    )))
                }
                Ok(Err(e)) if lease_not_found(&e) => return KeepAliveEnd::Lost,
                Ok(Err(e)) => return KeepAliveEnd::Failed(self.error("keeping a lease alive", e)),
                Err(_) => return KeepAliveEnd::Failed(self.no_answer("keeping a lease alive")),
            }
        }
    }
}

/// How a keep-alive ended.
pub(super) enum KeepAliveEnd {
    /// etcd no longer knows the lease: the keys are gone.
    Lost,
    /// etcd could not be reached; the lease may still be alive.
    Failed(RegistryError),
}

/// A short account of an etcd-client error: for gRPC statuses, the status message and the
/// innermost cause (such as "Connection refused") rather than the whole debug chain.
fn cause(e: &etcd_client::Error) -> String {
    let etcd_client::Error::GRpcStatus(status) = e else {
        return e.to_string();
    };
    let mut text = status.message().to_string();
    let mut source = std::error::Error::source(status);
    let mut innermost = None;
    while let Some(s) = source {
        innermost = Some(s.to_string());
        source = s.source();
    }
    match innermost {
        Some(inner) if !text.contains(&inner) => {
            if text.is_empty() {
                text = inner;
            } else {
                text = format!("{text}: {inner}");
            }
        }
        _ => {}
    }
    if text.is_empty() {
        format!("{:?}", status.code())
    } else {
        text
    }
}

fn lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        // etcd-client's answer when the first keep-alive response has TTL 0.
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("not found"),
        etcd_client::Error::GRpcStatus(s) => s.message().contains("lease not found"),
        _ => false,
    }
}
