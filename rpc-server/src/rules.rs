//! A running server follows the governance rules of a config centre: its entries' server
//! options (cap, rate limits, adaptive limit, observe modes, answer compression) change with the rules, without a
//! restart.
//!
//! The governance document is a level above the methods' `#[governance]` attributes (and the
//! builder's server-wide settings, which apply to entries that set nothing). Only the server's
//! options count (a change of a client option such as `timeout_ms` or `throttle_observe`
//! leaves every admission as it is), and an entry whose server options change keeps what they
//! did not touch: its rate limiter and buckets when only the gate's options change, its gate
//! (with the slots of open calls and streams, and the adaptive limit's measurements) when only
//! the limits, observe modes or compression change.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rpc_core::{GovernanceOverrides, MethodDescriptor, RpcError};
use rpc_governance::bulkhead::Bulkhead;
use rpc_governance::config::GovernanceConfig;
use rpc_governance::events::{EventBus, EventKind};
use rpc_governance::ratelimit::RateLimiter;
use rpc_registry::rules::{RuleKind, RuleSource, RuleTarget, RuleVersion, RulesInForce};

use crate::admission::Admission;
use crate::dispatch::Dispatcher;
use crate::server::{
    admission, compression, gate_inputs, limiter_inputs, server_options_differ, ServerDefaults,
};

/// The server's side of the rules: each entry's admission and the overrides it was built from.
struct Target {
    entries: Vec<(&'static MethodDescriptor, Arc<Admission>)>,
    applied: Mutex<HashMap<&'static str, GovernanceOverrides>>,
    shared: Bulkhead,
    defaults: ServerDefaults,
    events: EventBus,
}

/// The rules a server follows: the versions in force, and the task following them (stopped
/// when this is dropped, with the server's handle).
pub(crate) struct Following {
    pub(crate) in_force: Arc<RulesInForce>,
    task: tokio::task::AbortHandle,
    _target: Arc<dyn Send + Sync>,
}

impl Drop for Following {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts following `source` for the entries of `dispatcher`.
pub(crate) fn follow(
    source: Arc<dyn RuleSource>,
    dispatcher: &Dispatcher,
    shared: Bulkhead,
    defaults: ServerDefaults,
    events: EventBus,
) -> Following {
    let entries: Vec<_> = dispatcher
        .routes
        .values()
        .map(|r| (r.method, r.admission.clone()))
        .collect();
    let applied = entries
        .iter()
        .map(|(m, _)| (m.entry_id, m.governance.clone()))
        .collect();
    let target = Arc::new(Target {
        entries,
        applied: Mutex::new(applied),
        shared,
        defaults,
        events,
    });
    let in_force = Arc::new(RulesInForce::default());
    let task = tokio::spawn(rpc_registry::rules::follow(
        source,
        Arc::downgrade(&target),
        in_force.clone(),
    ))
    .abort_handle();
    Following {
        in_force,
        task,
        _target: target,
    }
}

/// The overrides of `m` under the governance document `centre`: its attribute, then the
/// document's defaults, service and entry sections.
fn overrides(m: &MethodDescriptor, centre: &GovernanceConfig) -> GovernanceOverrides {
    let mut o = m.governance.clone();
    o.merge(&centre.defaults);
    if let Some(s) = centre.services.get(m.service_id) {
        o.merge(s);
    }
    if let Some(e) = centre.entries.get(m.entry_id) {
        o.merge(e);
    }
    o
}

impl RuleTarget for Target {
    fn apply(&self, kind: RuleKind, rules: &RuleVersion) -> Result<(), RpcError> {
        if kind != RuleKind::Governance {
            // Routing is the clients' business.
            return Ok(());
        }
        let centre = GovernanceConfig::from_toml(&rules.text)?;
        let mut applied = self.applied.lock().unwrap_or_else(PoisonError::into_inner);
        for (m, admission_of_entry) in &self.entries {
            let o = overrides(m, &centre);
            let before = applied.get(m.entry_id);
            if before.is_some_and(|before| !server_options_differ(before, &o)) {
                applied.insert(m.entry_id, o);
                continue;
            }
            let now = admission_of_entry.policy();
            // The entry's gate so far, whose calls its new cap (own or shared) and a new
            // adaptive limit go on counting.
            let mut policy = admission(&o, &self.shared, &self.defaults, Some(&now.gate));
            if let Some(before) = before {
                if limiter_inputs(before) == limiter_inputs(&o) {
                    policy.limiter = now.limiter.clone();
                } else if let (Some(new), Some(old)) = (&policy.limiter, &now.limiter) {
                    // One limit changed: the other's buckets stay as drained as they were.
                    policy.limiter = Some(Arc::new(RateLimiter::carried_over(new.limits(), old)));
                }
                if gate_inputs(before) == gate_inputs(&o) {
                    policy.gate = now.gate.clone();
                }
            }
            admission_of_entry.replace(policy);
            let (algorithm, threshold) = compression(&o);
            admission_of_entry.set_compression(algorithm, threshold);
            self.events.emit_parts(
                EventKind::Reload,
                &Arc::from(m.entry_id),
                None,
                0,
                Some(format!("governance rules version {}", rules.version)),
            );
            applied.insert(m.entry_id, o);
        }
        Ok(())
    }

    fn events(&self) -> &EventBus {
        &self.events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `t.T.m`, with no overrides.
    static METHOD: &MethodDescriptor = &crate::dispatch::tests::METHODS[0];

    /// A server's rules target for the one entry `t.T.m`, and the entry's admission.
    fn target() -> (Target, Arc<Admission>) {
        let shared = Bulkhead::new(50);
        let defaults = ServerDefaults {
            adaptive: false,
            rate_limit: None,
            caller_rate_limit: None,
        };
        let events = EventBus::new();
        let policy = admission(&METHOD.governance, &shared, &defaults, None);
        let entry = Arc::new(Admission::new(policy, events.clone()));
        let target = Target {
            entries: vec![(METHOD, entry.clone())],
            applied: Mutex::new(HashMap::from([("t.T.m", METHOD.governance.clone())])),
            shared,
            defaults,
            events,
        };
        (target, entry)
    }

    fn apply(target: &Target, version: i64, text: &str) {
        let rules = RuleVersion::new(version, text);
        target
            .apply(RuleKind::Governance, &rules)
            .expect("valid rules");
    }

    fn admit(a: &Admission) -> Result<crate::admission::Slot, RpcError> {
        a.admit("t.T.m", "caller", None, None)
    }

    /// Asserts that a call is refused with Overflow (515), for the reason `why`.
    fn refused_overflow(a: &Admission, why: &str) {
        let e = admit(a).expect_err(why);
        assert_eq!(
            e.code(),
            rpc_core::StatusCode::OverflowMaxServerHandle,
            "{why}: {e}"
        );
    }

    /// A rules change keeps what it does not touch: a client option changes nothing, a rate
    /// limit change keeps the cap's slots, a compression change keeps the buckets; a new cap
    /// starts a new gate.
    #[tokio::test(start_paused = true)]
    async fn a_rules_change_keeps_the_slots_and_buckets_it_does_not_touch() {
        let (target, entry) = target();
        apply(
            &target,
            1,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 2\n",
        );
        let held = admit(&entry).expect("a slot");
        assert_eq!(entry.load(), (1, 2));
        // A client option: the same policy, the call still in its slot.
        let before = entry.policy();
        apply(
            &target,
            2,
            "[defaults]\ntimeout_ms = 700\nthrottle_observe = true\n\
             [entries.\"t.T.m\"]\nmax_concurrent_handling_count = 2\n",
        );
        assert!(Arc::ptr_eq(&before, &entry.policy()), "nothing rebuilt");
        // A rate limit (1 a second, no burst): the cap keeps its slot.
        let limited = "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 2\n\
                       rate_limit_per_second = 1\nrate_limit_burst = 1\n";
        apply(&target, 3, limited);
        assert_eq!(entry.load(), (1, 2), "the gate and its slot are kept");
        let second = admit(&entry).expect("the bucket's one token");
        drop(second);
        // Compression: the bucket, now empty, is kept (a new one would admit at once).
        apply(&target, 4, &format!("{limited}compression = \"zstd\"\n"));
        let e = admit(&entry).expect_err("the bucket is still empty");
        assert_eq!(e.code(), rpc_core::StatusCode::RateLimited, "{e}");
        assert_eq!(entry.load(), (1, 2));
        // A new cap: a new gate, which goes on counting the call admitted before.
        apply(
            &target,
            5,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 3\n",
        );
        assert_eq!(entry.load(), (1, 3));
        drop(held);
        assert_eq!(entry.load(), (0, 3));
    }

    /// A rules change of one rate limit leaves the other's bucket as drained as it was: adding
    /// a per-caller limit does not refill the entry's bucket, and changing the entry's limit
    /// does not refill the callers'.
    #[tokio::test(start_paused = true)]
    async fn a_change_of_one_rate_limit_keeps_the_other_limits_bucket() {
        let (target, entry) = target();
        let drained = |why: &str| {
            let e = admit(&entry)
                .err()
                .unwrap_or_else(|| panic!("{why}: admitted"));
            assert_eq!(e.code(), rpc_core::StatusCode::RateLimited, "{why}: {e}");
        };
        let entry_limit = "[entries.\"t.T.m\"]\nrate_limit_per_second = 1\nrate_limit_burst = 1\n";
        apply(&target, 1, entry_limit);
        drop(admit(&entry).expect("the entry's one token"));
        drained("the entry's bucket is empty");
        let both =
            format!("{entry_limit}caller_rate_limit_per_second = 1\ncaller_rate_limit_burst = 1\n");
        apply(&target, 2, &both);
        drained("a per-caller limit added, the entry's bucket still empty");
        // A second later both have a token: the caller's is spent, then the entry's limit
        // changes and the caller's bucket stays empty.
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        drop(admit(&entry).expect("a token in each"));
        let raised = "[entries.\"t.T.m\"]\nrate_limit_per_second = 100\nrate_limit_burst = 100\n\
                      caller_rate_limit_per_second = 1\ncaller_rate_limit_burst = 1\n";
        apply(&target, 3, raised);
        drained("the entry's limit raised, the caller's bucket still empty");
    }

    /// An adaptive limit rebuilt by a rules change (a new cap, a new minimum) goes on
    /// counting the calls holding the old one's slots, until they end. Before, it started at
    /// 0 and admitted a whole limit more beside them.
    #[tokio::test(start_paused = true)]
    async fn a_rebuilt_adaptive_limit_counts_the_calls_admitted_before_it() {
        let (target, entry) = target();
        let in_flight = |entry: &Admission| {
            let policy = entry.policy();
            let limit = policy.gate.adaptive_limit().expect("adaptive");
            (limit.in_flight(), limit.limit())
        };
        apply(
            &target,
            1,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 4\nadaptive_concurrency = true\n",
        );
        let held: Vec<_> = (0..4).map(|_| admit(&entry).expect("a slot")).collect();
        assert_eq!(in_flight(&entry), (4, 4));
        // A higher cap: the four calls still hold slots of the limit, which starts where the
        // old one was (4, its cap) and may grow from there as calls are measured.
        apply(
            &target,
            2,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 30\nadaptive_concurrency = true\n",
        );
        assert_eq!(in_flight(&entry), (4, 4));
        refused_overflow(&entry, "the limit of 4 is taken");
        // A new minimum, over what runs: the limit rises to it, the count stays.
        apply(
            &target,
            3,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 30\nadaptive_concurrency = true\n\
             adaptive_min_limit = 6\n",
        );
        assert_eq!(in_flight(&entry), (4, 6));
        let more = [admit(&entry).expect("five"), admit(&entry).expect("six")];
        assert!(admit(&entry).is_err(), "six running, limit 6");
        drop(held);
        drop(more);
        assert_eq!(in_flight(&entry), (0, 6));
    }

    /// A rule that changes how an entry's own cap is enforced (adaptive on, a lower cap) keeps
    /// the calls holding it counted: the cap is never exceeded by a rules change.
    #[tokio::test(start_paused = true)]
    async fn a_gate_rebuilt_by_a_rules_change_still_counts_the_calls_holding_the_cap() {
        let (target, entry) = target();
        apply(
            &target,
            1,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 2\n",
        );
        let held = [admit(&entry).expect("one"), admit(&entry).expect("two")];
        apply(
            &target,
            2,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 2\n\
             adaptive_concurrency = true\n",
        );
        refused_overflow(&entry, "two calls hold the cap of 2");
        // Lowered below what runs: nothing more until the calls end.
        apply(
            &target,
            3,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 1\n",
        );
        assert!(admit(&entry).is_err(), "two running, cap 1");
        drop(held);
        let _one = admit(&entry).expect("room once both ended");
        assert!(admit(&entry).is_err(), "cap 1");
    }

    /// An entry moved between the server's shared cap (50) and its own cap by rules changes:
    /// the calls running under the cap it left count against the one it goes to until they
    /// end. Before, the new cap started from zero beside them.
    #[tokio::test(start_paused = true)]
    async fn calls_count_against_the_cap_their_entry_moves_to_until_they_end() {
        let (target, entry) = target();
        let under_shared: Vec<_> = (0..3).map(|_| admit(&entry).expect("room")).collect();
        apply(
            &target,
            1,
            "[entries.\"t.T.m\"]\nmax_concurrent_handling_count = 4\n",
        );
        assert_eq!(entry.load(), (3, 4));
        let under_own = admit(&entry).expect("the fourth");
        refused_overflow(
            &entry,
            "three calls from the shared cap and one under its own of 4",
        );
        // Back under the shared cap: the call of its own cap holds room there too.
        apply(&target, 2, "");
        assert_eq!(entry.load(), (4, 50));
        let more: Vec<_> = (0..46).map(|_| admit(&entry).expect("room")).collect();
        refused_overflow(&entry, "50 running");
        drop((under_shared, under_own, more));
        assert_eq!(entry.load(), (0, 50));
        let _ = admit(&entry).expect("room once they ended");
    }
}
