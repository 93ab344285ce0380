//! The rule store on etcd: validated, versioned rule documents with their history.
//!
//! An operator's rule must never reach the fleet unchecked, must never silently overwrite a
//! colleague's change, and must be undoable. So every write is validated first, is a
//! transaction on the version it replaces, and keeps the text it wrote in a bounded history
//! that a rollback writes again.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, SortOrder, SortTarget, Txn, TxnOp, WatchOptions,
};
use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::conn::Conn;
use super::EtcdRegistry;
use crate::rules::{RuleError, RuleKind, RuleSource, RuleVersion, RuleWatch};
use crate::RegistryError;

/// Versions of each kind the history keeps by default.
pub const DEFAULT_HISTORY: usize = 50;

/// Governance and routing rules in etcd, validated before every write, versioned, with history
/// and rollback; a [`RuleSource`] that clients and servers follow.
///
/// Cheap to clone; clones share the registry's connection.
///
/// # Layout
///
/// Under the prefix (`<registry prefix>rules/`, so `/rpc/rules/` by default):
///
/// - `<prefix><kind>` (`governance` or `routing`): the document in force, as TOML text. Its
///   version is the etcd revision that wrote it (its `mod_revision`): versions increase with
///   every write.
/// - `<prefix>history/<kind>/<20 digits>`: each document written through the store, written in
///   the same transaction as the document itself (so its revision is the version); the oldest
///   are deleted beyond the history limit (50 by default). The digits are a revision between
///   the write before and this one, so keys sort as the writes were made: the version the write
///   replaced or, when it replaced none (the first write, or one after the document was deleted
///   by other means), the store's revision read just before.
///
/// A value written at `<prefix><kind>` by other means (`etcdctl put`) has a version too, is
/// not in the history, and is validated by every process that follows the rules, which refuses
/// it if it is invalid and keeps its last good version.
#[derive(Clone)]
pub struct RuleStore {
    conn: Conn,
    prefix: Arc<str>,
    history_limit: usize,
}

impl std::fmt::Debug for RuleStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleStore")
            .field("endpoints", &self.conn.target)
            .field("prefix", &self.prefix)
            .field("history_limit", &self.history_limit)
            .finish()
    }
}

impl EtcdRegistry {
    /// The rule store on this registry's etcd, under `<prefix>rules/` (`/rpc/rules/` with the
    /// default prefix).
    pub fn rules(&self) -> RuleStore {
        RuleStore {
            conn: self.inner.conn.clone(),
            prefix: Arc::from(format!("{}rules/", self.inner.conn.options.prefix)),
            history_limit: DEFAULT_HISTORY,
        }
    }
}

/// Where a watch task starts again after etcd failed it.
const RETRY: Duration = Duration::from_millis(500);

impl RuleStore {
    /// The same store under another prefix (it should end with `/`).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Arc::from(prefix.into());
        self
    }

    /// Keeps `n` versions of each kind in the history (at least 1).
    pub fn with_history_limit(mut self, n: usize) -> Self {
        self.history_limit = n.max(1);
        self
    }

    /// The prefix of the store's keys.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key of the document of `kind` in force.
    pub fn key(&self, kind: RuleKind) -> String {
        format!("{}{}", self.prefix, kind.as_str())
    }

    fn history_prefix(&self, kind: RuleKind) -> String {
        format!("{}history/{}/", self.prefix, kind.as_str())
    }

    /// The document of `kind` in force, if any.
    pub async fn get(&self, kind: RuleKind) -> Result<Option<RuleVersion>, RuleError> {
        let key = self.key(kind);
        let mut kv = self.conn.kv();
        let resp = self
            .conn
            .call(&format!("reading {key}"), kv.get(key.as_bytes(), None))
            .await?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| RuleVersion::from_bytes(kv.mod_revision(), kv.value())))
    }

    /// Validates `text` as a document of `kind` and writes it, if the version in force is
    /// still `expected` (0: no document yet); returns the new version. An invalid document is
    /// [`RuleError::Invalid`], a changed one [`RuleError::Conflict`]: nothing is written.
    pub async fn set(&self, kind: RuleKind, text: &str, expected: i64) -> Result<i64, RuleError> {
        kind.validate(text).map_err(|e| RuleError::Invalid {
            kind,
            reason: e.message().to_string(),
        })?;
        let key = self.key(kind);
        // The text goes twice in one request (in force and in the history), with the two
        // keys and a few dozen bytes each besides: over etcd's request limit it would be
        // refused as an opaque failure, which trying again never mends.
        // The document's key twice (the compare and the put), the history's once.
        let keys = 2 * key.len() + self.history_prefix(kind).len() + 20;
        let limit = self
            .conn
            .options
            .max_request_bytes
            .saturating_sub(keys + 2 * 64)
            / 2;
        if text.len() > limit {
            return Err(RuleError::TooLarge {
                kind,
                bytes: text.len(),
                limit,
            });
        }
        let mut kv = self.conn.kv();
        // Every successful write replaces a distinct version, except that 0 (no document)
        // comes back after a deletion: then the revision now orders it after every earlier one.
        let after = if expected == 0 {
            let resp = self
                .conn
                .call(&format!("reading {key}"), kv.get(key.as_bytes(), None))
                .await?;
            resp.header().map_or(0, |h| h.revision())
        } else {
            expected
        };
        let history = format!("{}{after:020}", self.history_prefix(kind));
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.as_bytes(),
                CompareOp::Equal,
                expected,
            )])
            .and_then([
                TxnOp::put(key.as_bytes(), text, None),
                TxnOp::put(history.as_bytes(), text, None),
            ]);
        let resp = self
            .conn
            .call(&format!("writing {key}"), kv.txn(txn))
            .await?;
        if !resp.succeeded() {
            let found = self.get(kind).await?.map_or(0, |v| v.version);
            return Err(RuleError::Conflict {
                kind,
                expected,
                found,
            });
        }
        let version = resp.header().map(|h| h.revision()).unwrap_or(0);
        // The write is done and in force: history kept too long is housekeeping, which the
        // next write does again, never a reason to report the write failed.
        if let Err(e) = self.trim(kind).await {
            tracing::warn!(
                kind = kind.as_str(), version, error = %e,
                "rules written; trimming their history failed, the next write tries again"
            );
        }
        Ok(version)
    }

    /// Writes `text` over whatever version is in force now (read just before): for a single
    /// operator. Two at once should use [`set`](Self::set) with the version they read.
    pub async fn put(&self, kind: RuleKind, text: &str) -> Result<i64, RuleError> {
        let expected = self.get(kind).await?.map_or(0, |v| v.version);
        self.set(kind, text, expected).await
    }

    /// The versions of `kind` the history keeps, oldest first.
    pub async fn history(&self, kind: RuleKind) -> Result<Vec<RuleVersion>, RuleError> {
        let resp = self.read_history(kind, false).await?;
        Ok(resp
            .kvs()
            .iter()
            .map(|kv| RuleVersion::from_bytes(kv.mod_revision(), kv.value()))
            .collect())
    }

    /// Writes the text of `version` again, as a new version (validated again, over the
    /// version in force now); returns the new version.
    pub async fn rollback(&self, kind: RuleKind, version: i64) -> Result<i64, RuleError> {
        self.rollback_over(kind, version, None).await
    }

    /// Like [`rollback`](Self::rollback), over version `expected` when given: a
    /// [`RuleError::Conflict`] when another version is in force by then (someone wrote
    /// meanwhile), as [`set`](Self::set) answers.
    pub async fn rollback_over(
        &self,
        kind: RuleKind,
        version: i64,
        expected: Option<i64>,
    ) -> Result<i64, RuleError> {
        let history = self.history(kind).await?;
        let Some(old) = history.iter().find(|v| v.version == version) else {
            return Err(RuleError::UnknownVersion {
                kind,
                version,
                kept: history.iter().map(|v| v.version).collect(),
            });
        };
        // Bytes that are not UTF-8 are shown with U+FFFD in their place: written back, they
        // would be another document than the one stored.
        if let Some(why) = &old.unreadable {
            return Err(RuleError::Invalid {
                kind,
                reason: format!("version {version} cannot be brought back: {why}"),
            });
        }
        let expected = match expected {
            Some(expected) => expected,
            None => self.get(kind).await?.map_or(0, |v| v.version),
        };
        self.set(kind, &old.text, expected).await
    }

    /// The history entries of `kind`, oldest first (their keys only when `keys_only`).
    async fn read_history(
        &self,
        kind: RuleKind,
        keys_only: bool,
    ) -> Result<etcd_client::GetResponse, RuleError> {
        let prefix = self.history_prefix(kind);
        let mut kv = self.conn.kv();
        let mut options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        if keys_only {
            options = options.with_keys_only();
        }
        Ok(self
            .conn
            .call(
                &format!("reading {prefix}"),
                kv.get(prefix.as_bytes(), Some(options)),
            )
            .await?)
    }

    /// Deletes the oldest history entries of `kind` beyond the limit.
    async fn trim(&self, kind: RuleKind) -> Result<(), RuleError> {
        let prefix = self.history_prefix(kind);
        let mut kv = self.conn.kv();
        let resp = self.read_history(kind, true).await?;
        let keys = resp.kvs();
        if keys.len() <= self.history_limit {
            return Ok(());
        }
        // Everything before the first key kept.
        let first_kept = keys[keys.len() - self.history_limit].key().to_vec();
        let options = DeleteOptions::new().with_range(first_kept);
        self.conn
            .call(
                &format!("trimming {prefix}"),
                kv.delete(prefix.as_bytes(), Some(options)),
            )
            .await?;
        Ok(())
    }

    /// Follows the document of `kind`: the current one, then every change. Fails only when
    /// the first read fails; later, while etcd is away, the last version stays and the watch
    /// is opened again.
    pub async fn watch(&self, kind: RuleKind) -> Result<RuleWatch, RegistryError> {
        let (current, revision) = self.read_at(kind).await?;
        let (tx, rx) = watch::channel(current);
        tokio::spawn(follow(self.clone(), kind, tx, revision));
        Ok(rx)
    }

    /// The document of `kind` and the revision the store was read at.
    async fn read_at(&self, kind: RuleKind) -> Result<(Option<RuleVersion>, i64), RegistryError> {
        let key = self.key(kind);
        let mut kv = self.conn.kv();
        let resp = self
            .conn
            .call(&format!("reading {key}"), kv.get(key.as_bytes(), None))
            .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        let current = resp
            .kvs()
            .first()
            .map(|kv| RuleVersion::from_bytes(kv.mod_revision(), kv.value()));
        Ok((current, revision))
    }
}

/// Publishes every change of one document until nobody watches it.
async fn follow(
    store: RuleStore,
    kind: RuleKind,
    tx: watch::Sender<Option<RuleVersion>>,
    mut revision: i64,
) {
    loop {
        let end = tokio::select! {
            r = follow_from(&store, kind, &tx, revision) => r,
            () = tx.closed() => return,
        };
        if let Err(e) = end {
            tracing::debug!(target: "rpc::rules", kind = kind.as_str(), "rule watch interrupted: {e}");
        }
        // Read the document again before watching again.
        loop {
            tokio::select! {
                () = tokio::time::sleep(RETRY) => {}
                () = tx.closed() => return,
            }
            if let Ok((current, at)) = store.read_at(kind).await {
                revision = at;
                tx.send_if_modified(|v| {
                    let changed = *v != current;
                    *v = current;
                    changed
                });
                break;
            }
        }
    }
}

/// Watches the document from `revision + 1`, publishing each put (and a deletion as `None`).
async fn follow_from(
    store: &RuleStore,
    kind: RuleKind,
    tx: &watch::Sender<Option<RuleVersion>>,
    revision: i64,
) -> Result<(), RegistryError> {
    let key = store.key(kind);
    let mut client = store.conn.watcher();
    let options = WatchOptions::new().with_start_revision(revision + 1);
    let what = format!("watching {key}");
    let mut stream = store
        .conn
        .call(&what, client.watch(key.as_bytes(), Some(options)))
        .await?;
    loop {
        let resp = match stream.message().await {
            Ok(Some(resp)) => resp,
            Ok(None) => {
                return Err(RegistryError::Unavailable(format!(
                    "etcd at {} ended the watch of {key}",
                    store.conn.target
                )))
            }
            Err(e) => return Err(store.conn.error(&what, e)),
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            return Err(RegistryError::Unavailable(format!(
                "etcd cancelled the watch of {key}"
            )));
        }
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            // A deleted key has version 0 (see the registry's watch task).
            let next =
                (kv.version() != 0).then(|| RuleVersion::from_bytes(kv.mod_revision(), kv.value()));
            tx.send_replace(next);
        }
    }
}

impl RuleSource for RuleStore {
    fn watch_rules(&self, kind: RuleKind) -> BoxFuture<'_, Result<RuleWatch, RegistryError>> {
        Box::pin(self.watch(kind))
    }
}
