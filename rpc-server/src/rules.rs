//! A running server follows the governance rules of a config centre: its entries' server
//! options (cap, rate limits, adaptive limit, observe modes, answer compression) change with the rules, without a
//! restart.
//!
//! The governance document is a level above the methods' `#[governance]` attributes (and the
//! builder's server-wide settings, which apply to entries that set nothing). An entry whose
//! options the new document changes gets a new admission from its next call; the others keep
//! theirs, with their buckets and measured latency.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rpc_core::{GovernanceOverrides, MethodDescriptor, RpcError};
use rpc_governance::bulkhead::Bulkhead;
use rpc_governance::config::GovernanceConfig;
use rpc_governance::events::{EventBus, EventKind};
use rpc_registry::rules::{RuleKind, RuleSource, RuleTarget, RuleVersion, RulesInForce};

use crate::admission::Admission;
use crate::dispatch::Dispatcher;
use crate::server::{admission, compression, ServerDefaults};

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
            if applied.get(m.entry_id) == Some(&o) {
                continue;
            }
            admission_of_entry.replace(admission(&o, &self.shared, &self.defaults));
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
