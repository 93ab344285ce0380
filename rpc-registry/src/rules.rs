//! Rules from a config centre: governance and routing documents that every client and server
//! follows while it runs.
//!
//! Options written in code, a file or the environment reach one process when it starts; an
//! operator steering a fleet needs one document that every process picks up on its next call.
//! A [`RuleSource`] hands out the document of each [`RuleKind`] in force and every later
//! version (the etcd rule store, `RuleStore`, is one; feature `etcd`). [`follow`] is what a
//! client or a server runs on it: each new version is validated and applied, or refused with an
//! [`EventKind::RuleRejected`] event and a warning while the last good version stays in force.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use futures_util::future::BoxFuture;
use rpc_core::RpcError;
use rpc_governance::config::GovernanceConfig;
use rpc_governance::events::{EventBus, EventKind, GovernanceEvent};
use tokio::sync::watch;

use crate::RegistryError;

/// The kinds of rule document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RuleKind {
    /// Governance options: the config file's shape (`[defaults]`, `[services."id"]`,
    /// `[entries."id"]`), applied as the "centre" level, above `RPC_GOVERNANCE` and below
    /// runtime updates.
    Governance,
    /// Routing rules (tag routing, weighted splits, routing by attachment).
    Routing,
}

impl RuleKind {
    /// Every kind.
    pub const ALL: [RuleKind; 2] = [RuleKind::Governance, RuleKind::Routing];

    /// The kind's name: its key under the store's prefix and its name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            RuleKind::Governance => "governance",
            RuleKind::Routing => "routing",
        }
    }

    /// Checks a document of this kind: it must parse, and every value must be one its policy
    /// can carry out. The error names the line and the field (TOML's own position) or the
    /// section and the value.
    pub fn validate(self, text: &str) -> Result<(), RpcError> {
        match self {
            RuleKind::Governance => GovernanceConfig::from_toml(text).map(|_| ()),
            RuleKind::Routing => validate_routing(text),
        }
    }
}

/// The routing document's check: the routing rules' own parser and validation.
fn validate_routing(text: &str) -> Result<(), RpcError> {
    rpc_governance::routing::RoutingRules::from_toml(text).map(|_| ())
}

impl fmt::Display for RuleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RuleKind {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RuleKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| RuleError::UnknownKind(s.to_string()))
    }
}

/// One version of a rule document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleVersion {
    /// The version: increases with every write of any document of the store (the etcd revision
    /// of the write).
    pub version: i64,
    /// The document, as written.
    pub text: Arc<str>,
    /// Why the stored bytes are no document, when they are not UTF-8 (written past the
    /// store's checks): `text` then shows them with U+FFFD where they are not, and the
    /// version is refused wherever it is taken, as an invalid document is.
    pub unreadable: Option<Arc<str>>,
}

impl RuleVersion {
    /// Version `version` of the document `text`.
    pub fn new(version: i64, text: impl Into<Arc<str>>) -> Self {
        RuleVersion {
            version,
            text: text.into(),
            unreadable: None,
        }
    }

    /// Version `version` as stored: `bytes` must be UTF-8 (TOML is), else the version is
    /// [`unreadable`](Self::unreadable).
    pub fn from_bytes(version: i64, bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) => Self::new(version, text),
            Err(e) => RuleVersion {
                version,
                text: Arc::from(String::from_utf8_lossy(bytes)),
                unreadable: Some(Arc::from(format!(
                    "the stored document is not UTF-8 (byte {} of {}), as a TOML document must \
                     be; write it with `rpcctl rules set`, which checks it first",
                    e.valid_up_to() + 1,
                    bytes.len()
                ))),
            },
        }
    }

    /// Whether the version is a valid document of `kind`.
    pub fn validate(&self, kind: RuleKind) -> Result<(), RpcError> {
        match &self.unreadable {
            Some(why) => Err(RpcError::validation(why.to_string())),
            None => kind.validate(&self.text),
        }
    }
}

/// A rule store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    /// The document is not valid; nothing was written.
    #[error("the {kind} rules are not valid, nothing was written: {reason}")]
    Invalid {
        /// The document's kind.
        kind: RuleKind,
        /// What is wrong, with the line or the field.
        reason: String,
    },
    /// Someone else wrote the document since it was read; nothing was written.
    #[error(
        "the {kind} rules changed meanwhile (expected version {expected}, found {found}); \
         nothing was written: read them again and retry"
    )]
    Conflict {
        /// The document's kind.
        kind: RuleKind,
        /// The version the write expected to replace (0: none).
        expected: i64,
        /// The version in the store (0: none).
        found: i64,
    },
    /// A rollback to a version the history does not hold.
    #[error("the {kind} rules have no version {version} in their history (kept: {kept:?})")]
    UnknownVersion {
        /// The document's kind.
        kind: RuleKind,
        /// The version asked for.
        version: i64,
        /// The versions the history holds.
        kept: Vec<i64>,
    },
    /// The document is over what the store takes in one write; nothing was written.
    #[error(
        "the {kind} rules are {bytes} bytes, over the {limit} bytes the store takes in one \
         write; nothing was written: shorten the document, or raise the store's limit"
    )]
    TooLarge {
        /// The document's kind.
        kind: RuleKind,
        /// The document's size.
        bytes: usize,
        /// The largest document the store writes.
        limit: usize,
    },
    /// No such kind of document.
    #[error("no rule kind {0:?}: the kinds are governance and routing")]
    UnknownKind(String),
    /// The store could not be reached.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// The document of one kind in force, and every later version, as they are written; `None`
/// while the store holds none.
pub type RuleWatch = watch::Receiver<Option<RuleVersion>>;

/// Where rule documents come from (the etcd `RuleStore`, feature `etcd`).
pub trait RuleSource: Send + Sync + 'static {
    /// Follows the documents of `kind`: the receiver holds the version in force and sees each
    /// later one. It stays open while the store is unreachable (keeping the last version);
    /// the source follows the documents for as long as the receiver (or a clone of it) is
    /// held, whether the source itself is still held or not: drop the receiver to stop.
    fn watch_rules(&self, kind: RuleKind) -> BoxFuture<'_, Result<RuleWatch, RegistryError>>;
}

/// What a process does with rule documents: a client puts a governance document in its
/// "centre" level, a server rebuilds its entries' admission.
pub trait RuleTarget: Send + Sync + 'static {
    /// Applies a document of `kind` (checked with [`RuleKind::validate`] already), or refuses
    /// it, changing nothing, with the reason.
    fn apply(&self, kind: RuleKind, rules: &RuleVersion) -> Result<(), RpcError>;
    /// Where the rejections are reported.
    fn events(&self) -> &EventBus;
}

/// The versions in force in one process, by kind.
#[derive(Debug, Default)]
pub struct RulesInForce {
    versions: Mutex<HashMap<RuleKind, i64>>,
    /// How many kinds have had their first read: taken, refused, or found unreachable.
    first_reads: watch::Sender<usize>,
}

impl RulesInForce {
    /// The version of `kind` in force, if one was applied.
    pub fn version(&self, kind: RuleKind) -> Option<i64> {
        self.versions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&kind)
            .copied()
    }

    /// Waits until [`follow`] has read every kind once: each document in the store then is
    /// applied (or was refused), or the source could not be reached on the first try (the
    /// rules are then applied whenever it answers). What a server awaits before it serves, so
    /// that no call runs under the options the rules replace. The etcd source bounds it by its
    /// request timeout; a [`RuleSource`] need not, so callers bound it too
    /// ([`FIRST_READ_LIMIT`]).
    pub async fn first_read(&self) {
        let mut reads = self.first_reads.subscribe();
        let _ = reads.wait_for(|n| *n >= RuleKind::ALL.len()).await;
    }

    fn read_once(&self) {
        self.first_reads.send_modify(|n| *n += 1);
    }

    fn set(&self, kind: RuleKind, version: i64) {
        self.versions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(kind, version);
    }

    fn clear(&self, kind: RuleKind) {
        self.versions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&kind);
    }
}

/// The longest a process waits for its rules' first read ([`RulesInForce::first_read`]) before
/// it serves or calls without them: a [`RuleSource`] need not bound its reads.
pub const FIRST_READ_LIMIT: Duration = Duration::from_secs(10);

/// The pause before opening the watch again after the source failed to open it.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// How often a follower waiting for the next version checks that its target still lives: a
/// dropped target's follower ends then, with the watch it holds (and the source's watch behind
/// it), rather than at the next version, which may never come.
const TARGET_CHECK: Duration = Duration::from_secs(1);

/// Follows every kind of document of `source` for `target` until the target is dropped:
/// applies each valid new version and records it in `in_force`; reports each refused one
/// (invalid, or refused by the target) as an [`EventKind::RuleRejected`] event with its
/// version and reason, and a warning, leaving the last good version in force.
pub fn follow<T: RuleTarget>(
    source: Arc<dyn RuleSource>,
    target: Weak<T>,
    in_force: Arc<RulesInForce>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    // Each kind's first read is counted when it ends, or when its future is dropped: made
    // here, not when the future first runs, so a future dropped unpolled (its runtime shut
    // down first) counts too, and nobody waits on [`RulesInForce::first_read`] for ever.
    let tasks: Vec<_> = RuleKind::ALL
        .into_iter()
        .map(|kind| {
            let first = ReadOnce(Some(in_force.clone()));
            follow_kind(
                source.clone(),
                kind,
                target.clone(),
                in_force.clone(),
                first,
            )
        })
        .collect();
    async move {
        futures_util::future::join_all(tasks).await;
    }
}

async fn follow_kind<T: RuleTarget>(
    source: Arc<dyn RuleSource>,
    kind: RuleKind,
    target: Weak<T>,
    in_force: Arc<RulesInForce>,
    mut first: ReadOnce,
) {
    let mut watch = loop {
        match source.watch_rules(kind).await {
            Ok(w) => break w,
            Err(e) => {
                // Not reachable: nothing to wait for, the last good version is none.
                first.done();
                tracing::warn!(target: "rpc::rules", kind = kind.as_str(), "cannot follow the rules: {e}; trying again");
                if target.strong_count() == 0 {
                    return;
                }
                tokio::time::sleep(REOPEN_AFTER).await;
            }
        }
    };
    // The last version taken (applied or refused), text included: a watch opened again sends
    // the version in force again, which is not taken twice; but a number alone is not enough,
    // since etcd restored from a snapshot numbers its writes again from the snapshot's.
    let mut last: Option<RuleVersion> = None;
    // What the target refused for its own state (not an invalid document): its levels may
    // change (a runtime update, a configuration reloaded) so that it takes it, so it is offered
    // again at each check, quietly, until it is taken or a version or deletion taken after it
    // replaces it. An invalid document replaces nothing, so it leaves it pending.
    let mut pending: Option<Pending> = None;
    // Woken by the check (not by a change) to offer `pending` again.
    let mut offer_again = false;
    loop {
        let Some(t) = target.upgrade() else { return };
        if offer_again {
            let taken = match &pending {
                Some(Pending::Version(rules)) => {
                    take(&*t, kind, rules, &in_force, true) != Taken::RefusedByTarget
                }
                Some(Pending::Deletion(gone)) => {
                    let withdrawn = withdraw(&*t, kind, gone, &in_force, true);
                    if withdrawn && last.as_ref() == Some(gone) {
                        last = None;
                    }
                    withdrawn
                }
                None => false,
            };
            if taken {
                pending = None;
            }
        } else {
            match watch.borrow_and_update().clone() {
                Some(rules) => {
                    if last.as_ref() != Some(&rules) {
                        match take(&*t, kind, &rules, &in_force, false) {
                            Taken::Applied => pending = None,
                            Taken::Invalid => {}
                            Taken::RefusedByTarget => {
                                pending = Some(Pending::Version(rules.clone()));
                            }
                        }
                        last = Some(rules);
                    }
                }
                // The document was deleted: as an empty one, back to the lower levels, as a
                // process started now has them (before, running processes kept the deleted
                // rules and the fleet split). Refused, the last version stays in force (and
                // is not taken again if written again).
                None => {
                    if let Some(gone) = last.clone() {
                        if withdraw(&*t, kind, &gone, &in_force, false) {
                            last = None;
                            pending = None;
                        } else {
                            pending = Some(Pending::Deletion(gone));
                        }
                    }
                }
            }
        }
        first.done();
        drop(t);
        let mut check = tokio::time::interval(TARGET_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        check.reset();
        offer_again = loop {
            tokio::select! {
                changed = watch.changed() => match changed {
                    Ok(()) => break false,
                    Err(_) => return,
                },
                _ = check.tick() => {
                    if target.strong_count() == 0 {
                        return;
                    }
                    if pending.is_some() {
                        break true;
                    }
                }
            }
        };
    }
}

/// What a follower's target refused for its own state, offered to it again.
enum Pending {
    /// A version.
    Version(RuleVersion),
    /// The deletion of the document, of which this was the last version seen.
    Deletion(RuleVersion),
}

/// How [`take`] ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Taken {
    Applied,
    /// The document is not one (it never will be).
    Invalid,
    /// The target refused it for its own state, which may change.
    RefusedByTarget,
}

/// Counts a kind's first read in [`RulesInForce`], once: when it is [`done`](Self::done), or
/// when dropped before (its follower stopped or was dropped: nobody waits for it any more).
struct ReadOnce(Option<Arc<RulesInForce>>);

impl ReadOnce {
    fn done(&mut self) {
        if let Some(in_force) = self.0.take() {
            in_force.read_once();
        }
    }
}

impl Drop for ReadOnce {
    fn drop(&mut self) {
        self.done();
    }
}

/// Validates and applies one version, or reports it refused (`again`: offered again after the
/// target refused it, which was reported then, so a refusal is not reported twice).
fn take<T: RuleTarget>(
    target: &T,
    kind: RuleKind,
    rules: &RuleVersion,
    in_force: &RulesInForce,
    again: bool,
) -> Taken {
    if let Err(e) = rules.validate(kind) {
        report_refused(target, kind, rules, in_force, &e);
        return Taken::Invalid;
    }
    match target.apply(kind, rules) {
        Ok(()) => {
            in_force.set(kind, rules.version);
            tracing::info!(target: "rpc::rules", kind = kind.as_str(), version = rules.version, "rules applied");
            target.events().emit(GovernanceEvent {
                kind: EventKind::RuleApplied,
                entry: Arc::from(format!("rules/{kind}")),
                endpoint: None,
                attempt: 0,
                cause: None,
                observed: false,
                rule_version: Some(rules.version),
            });
            Taken::Applied
        }
        Err(e) => {
            if !again {
                report_refused(target, kind, rules, in_force, &e);
            }
            Taken::RefusedByTarget
        }
    }
}

/// Logs and tells the target's observers that `rules` was refused for `e`.
fn report_refused<T: RuleTarget>(
    target: &T,
    kind: RuleKind,
    rules: &RuleVersion,
    in_force: &RulesInForce,
    e: &RpcError,
) {
    let kept = match in_force.version(kind) {
        Some(v) => format!("version {v} stays in force"),
        None => "no version of these rules is in force".to_string(),
    };
    let reason = format!(
        "{kind} rules version {} refused: {}; {kept}",
        rules.version,
        e.message()
    );
    tracing::warn!(target: "rpc::rules", kind = kind.as_str(), version = rules.version, "{reason}");
    target.events().emit(GovernanceEvent {
        kind: EventKind::RuleRejected,
        entry: Arc::from(format!("rules/{kind}")),
        endpoint: None,
        attempt: 0,
        cause: Some(reason),
        observed: false,
        rule_version: Some(rules.version),
    });
}

/// The document of `kind` was deleted (its last version seen was `gone`): the target applies
/// an empty one, and no version is in force; or it refuses, and `false` (`again`: offered
/// again after a refusal reported then, not reported twice).
fn withdraw<T: RuleTarget>(
    target: &T,
    kind: RuleKind,
    gone: &RuleVersion,
    in_force: &RulesInForce,
    again: bool,
) -> bool {
    let empty = RuleVersion::new(gone.version, "");
    let (event, cause, withdrawn) = match target.apply(kind, &empty) {
        Ok(()) => {
            in_force.clear(kind);
            tracing::info!(target: "rpc::rules", kind = kind.as_str(), "rules deleted: back to the lower levels");
            (
                EventKind::RuleApplied,
                format!("the {kind} rules were deleted: back to the lower levels"),
                true,
            )
        }
        // Reported once: offered again, the refusal says nothing new.
        Err(_) if again => return false,
        Err(e) => {
            let reason = format!(
                "the {kind} rules were deleted, but going back to the lower levels was refused: {}",
                e.message()
            );
            tracing::warn!(target: "rpc::rules", kind = kind.as_str(), "{reason}");
            (EventKind::RuleRejected, reason, false)
        }
    };
    target.events().emit(GovernanceEvent {
        kind: event,
        entry: Arc::from(format!("rules/{kind}")),
        endpoint: None,
        attempt: 0,
        cause: Some(cause),
        observed: false,
        rule_version: None,
    });
    withdrawn
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source whose documents the test writes, one watch per kind.
    struct Written(HashMap<RuleKind, watch::Sender<Option<RuleVersion>>>);

    impl RuleSource for Written {
        fn watch_rules(&self, kind: RuleKind) -> BoxFuture<'_, Result<RuleWatch, RegistryError>> {
            let rx = self.0[&kind].subscribe();
            Box::pin(async move { Ok(rx) })
        }
    }

    /// Records the governance texts it applies; while `refusing`, refuses every one (as a
    /// client whose own levels an entry could not carry out with it would).
    struct Applied {
        texts: Mutex<Vec<String>>,
        events: EventBus,
        refusing: std::sync::atomic::AtomicBool,
    }

    impl Applied {
        fn new() -> Arc<Self> {
            Arc::new(Applied {
                texts: Mutex::new(Vec::new()),
                events: EventBus::new(),
                refusing: std::sync::atomic::AtomicBool::new(false),
            })
        }

        fn refuse(&self, yes: bool) {
            self.refusing
                .store(yes, std::sync::atomic::Ordering::SeqCst);
        }

        /// Writes `doc` (a version, or `None`: the document deleted) into `source` while
        /// this target refuses every change, and lets two checks of the follower pass.
        async fn refusing_write(
            &self,
            source: &watch::Sender<Option<RuleVersion>>,
            doc: Option<RuleVersion>,
        ) {
            self.refuse(true);
            source.send_replace(doc);
            tokio::time::sleep(TARGET_CHECK * 2).await;
        }

        /// Takes changes again from now on, and lets two checks of the follower pass.
        async fn allow(&self) {
            self.refuse(false);
            tokio::time::sleep(TARGET_CHECK * 2).await;
        }
    }

    impl RuleTarget for Applied {
        fn apply(&self, _: RuleKind, rules: &RuleVersion) -> Result<(), RpcError> {
            if self.refusing.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(RpcError::new(
                    rpc_core::StatusCode::FrameworkError,
                    "an entry cannot carry it out",
                ));
            }
            self.texts.lock().unwrap().push(rules.text.to_string());
            Ok(())
        }
        fn events(&self) -> &EventBus {
            &self.events
        }
    }

    /// A target following a source the test writes, whose governance document is `stored`
    /// when the following starts: the governance document's sender, the target, the versions
    /// in force and the following task.
    fn following_from(
        stored: Option<RuleVersion>,
    ) -> (
        watch::Sender<Option<RuleVersion>>,
        Arc<Applied>,
        Arc<RulesInForce>,
        tokio::task::JoinHandle<()>,
    ) {
        let mut senders: HashMap<_, _> = RuleKind::ALL
            .into_iter()
            .map(|k| (k, watch::channel(None).0))
            .collect();
        senders.insert(RuleKind::Governance, watch::channel(stored).0);
        let governance = senders[&RuleKind::Governance].clone();
        let source: Arc<dyn RuleSource> = Arc::new(Written(senders));
        let target = Applied::new();
        let in_force = Arc::new(RulesInForce::default());
        let task = tokio::spawn(follow(source, Arc::downgrade(&target), in_force.clone()));
        (governance, target, in_force, task)
    }

    /// A target following a source that holds no document yet.
    fn following() -> (
        watch::Sender<Option<RuleVersion>>,
        Arc<Applied>,
        Arc<RulesInForce>,
        tokio::task::JoinHandle<()>,
    ) {
        following_from(None)
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_read_ends_with_the_stored_document_applied() {
        let stored = RuleVersion::new(4, "[defaults]\ntimeout_ms = 100\n");
        let (_governance, target, in_force, following) = following_from(Some(stored.clone()));
        in_force.first_read().await;
        assert_eq!(*target.texts.lock().unwrap(), [&*stored.text]);
        assert_eq!(in_force.version(RuleKind::Governance), Some(4));
        following.abort();
    }

    /// A source whose watches never open.
    struct Unreachable;

    impl RuleSource for Unreachable {
        fn watch_rules(&self, _: RuleKind) -> BoxFuture<'_, Result<RuleWatch, RegistryError>> {
            Box::pin(async { Err(RegistryError::Unavailable("refused".into())) })
        }
    }

    /// A following dropped before it ever ran (its runtime shut down first) ends the wait
    /// for the first read too: nothing will read the rules.
    #[tokio::test(start_paused = true)]
    async fn the_first_read_ends_when_the_following_is_dropped_before_it_ran() {
        let target = Applied::new();
        let in_force = Arc::new(RulesInForce::default());
        drop(follow(
            Arc::new(Unreachable),
            Arc::downgrade(&target),
            in_force.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(1), in_force.first_read())
            .await
            .expect("no reader left to wait for");
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_read_ends_when_the_source_cannot_be_reached() {
        let target = Applied::new();
        let in_force = Arc::new(RulesInForce::default());
        let following = tokio::spawn(follow(
            Arc::new(Unreachable),
            Arc::downgrade(&target),
            in_force.clone(),
        ));
        // Ended by the first failure, not after the pause before the next try.
        tokio::time::timeout(REOPEN_AFTER, in_force.first_read())
            .await
            .expect("the first read ends with the first failure");
        assert_eq!(in_force.version(RuleKind::Governance), None);
        following.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_document_under_a_version_number_seen_before_is_applied() {
        let (governance, target, in_force, following) = following();
        let write = |version, text: &str| {
            governance.send_replace(Some(RuleVersion::new(version, text)));
        };
        let a = "[defaults]\ntimeout_ms = 100\n";
        let b = "[defaults]\ntimeout_ms = 200\n";
        write(7, a);
        tokio::time::sleep(Duration::from_millis(1)).await;
        // The same version again (a watch opened again): not applied twice.
        write(7, a);
        tokio::time::sleep(Duration::from_millis(1)).await;
        // etcd restored from an older snapshot: another document lands on number 7 again.
        write(7, b);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(*target.texts.lock().unwrap(), [a, b]);
        assert_eq!(in_force.version(RuleKind::Governance), Some(7));
        following.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_deleted_document_is_withdrawn_as_an_empty_one() {
        let (governance, target, in_force, following) = following();
        let mut events = target.events.subscribe();
        let a = "[defaults]\ntimeout_ms = 100\n";
        governance.send_replace(Some(RuleVersion::new(3, a)));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(in_force.version(RuleKind::Governance), Some(3));
        governance.send_replace(None);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(*target.texts.lock().unwrap(), [a, ""]);
        assert_eq!(in_force.version(RuleKind::Governance), None);
        let kinds: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
            .map(|e| (e.kind, e.rule_version))
            .collect();
        assert_eq!(
            kinds,
            [
                (EventKind::RuleApplied, Some(3)),
                (EventKind::RuleApplied, None)
            ]
        );
        following.abort();
    }

    /// A version the target refused for its own state is offered again at each check, and
    /// taken once the target's state allows it (a local level fixed), with no new version to
    /// wake the follower; so is a deletion it refused. Each refusal is reported once.
    #[tokio::test(start_paused = true)]
    async fn a_version_or_deletion_refused_by_the_target_is_taken_once_it_can_be() {
        let (governance, target, in_force, following) = following();
        in_force.first_read().await;
        let mut events = target.events.subscribe();
        let a = "[defaults]\ntimeout_ms = 100\n";
        target
            .refusing_write(&governance, Some(RuleVersion::new(3, a)))
            .await;
        assert_eq!(in_force.version(RuleKind::Governance), None);
        target.allow().await;
        assert_eq!(in_force.version(RuleKind::Governance), Some(3));
        assert_eq!(*target.texts.lock().unwrap(), [a]);
        // Deleted while the target refuses to go back: version 3 stays, until it can.
        target.refusing_write(&governance, None).await;
        assert_eq!(in_force.version(RuleKind::Governance), Some(3));
        target.allow().await;
        assert_eq!(in_force.version(RuleKind::Governance), None);
        assert_eq!(*target.texts.lock().unwrap(), [a, ""]);
        let kinds: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
            .map(|e| (e.kind, e.rule_version))
            .collect();
        assert_eq!(
            kinds,
            [
                (EventKind::RuleRejected, Some(3)),
                (EventKind::RuleApplied, Some(3)),
                (EventKind::RuleRejected, None),
                (EventKind::RuleApplied, None),
            ]
        );
        following.abort();
    }

    /// An invalid document written after a version or deletion the target refused replaces
    /// nothing: what was refused is still offered, and taken once the target allows it.
    /// (Before, the invalid version cleared the refusal: the refused version was never taken,
    /// and a deleted rule stayed in force for good.)
    #[tokio::test(start_paused = true)]
    async fn an_invalid_version_after_a_refused_one_leaves_it_pending() {
        let (governance, target, in_force, following) = following();
        in_force.first_read().await;
        let a = "[defaults]\ntimeout_ms = 100\n";
        let invalid = "[defaults]\nretry_tims = 1\n";
        // A version refused, then an invalid one.
        target
            .refusing_write(&governance, Some(RuleVersion::new(3, a)))
            .await;
        target
            .refusing_write(&governance, Some(RuleVersion::new(4, invalid)))
            .await;
        target.allow().await;
        assert_eq!(in_force.version(RuleKind::Governance), Some(3));
        assert_eq!(*target.texts.lock().unwrap(), [a]);
        // A deletion refused, then an invalid version.
        target.refusing_write(&governance, None).await;
        target
            .refusing_write(&governance, Some(RuleVersion::new(5, invalid)))
            .await;
        target.allow().await;
        assert_eq!(in_force.version(RuleKind::Governance), None);
        assert_eq!(*target.texts.lock().unwrap(), [a, ""]);
        following.abort();
    }

    /// A follower ends once its target is dropped, with no new version to wake it, and lets
    /// the source's watches go (before, it held them until the next version, which may never
    /// come).
    #[tokio::test(start_paused = true)]
    async fn a_follower_ends_and_lets_the_watches_go_once_its_target_is_dropped() {
        let (governance, target, in_force, following) = following();
        in_force.first_read().await;
        assert!(governance.receiver_count() > 0, "watched");
        drop(target);
        tokio::time::timeout(TARGET_CHECK * 2, following)
            .await
            .expect("the follower ended")
            .expect("join");
        assert_eq!(governance.receiver_count(), 0, "its watch is let go");
    }

    #[test]
    fn kinds_parse_by_name_and_unknown_ones_are_named() {
        assert_eq!(
            "governance".parse::<RuleKind>().unwrap(),
            RuleKind::Governance
        );
        assert_eq!("routing".parse::<RuleKind>().unwrap(), RuleKind::Routing);
        let e = "routes".parse::<RuleKind>().unwrap_err();
        assert!(e.to_string().contains("\"routes\""), "{e}");
    }

    #[test]
    fn an_invalid_governance_document_is_refused_naming_the_line_and_field() {
        let e = RuleKind::Governance
            .validate("[defaults]\ntimeout_ms = 10\nretry_tims = 2\n")
            .unwrap_err();
        assert!(
            e.message().contains("line 3") && e.message().contains("retry_tims"),
            "{e}"
        );
        let e = RuleKind::Governance
            .validate("[entries.\"a.B.c\"]\nfailure_ratio_percent = 150\n")
            .unwrap_err();
        assert!(
            e.message().contains("a.B.c") && e.message().contains("failure_ratio_percent"),
            "{e}"
        );
        assert!(RuleKind::Governance
            .validate("[defaults]\ntimeout_ms = 10\n")
            .is_ok());
    }
}
