//! A client follows the rules of a config centre: the governance document in force becomes the
//! "centre" level of every entry's options, through the same layers as the config file and
//! runtime updates, so a change applies on the next call and keeps breakers, budgets and
//! endpoint health.

use std::sync::Arc;

use rpc_core::RpcError;
use rpc_governance::config::GovernanceConfig;
use rpc_governance::engine::Governance;
use rpc_governance::routing::RoutingRules;
use rpc_registry::rules::{RuleKind, RuleSource, RuleTarget, RuleVersion};

use crate::balance::routing::Router;

/// Aborts a task when dropped (with the client).
pub(crate) struct AbortOnDrop(tokio::task::AbortHandle);

impl AbortOnDrop {
    /// Aborts the task of `handle` when dropped.
    pub(crate) fn new(handle: tokio::task::AbortHandle) -> Self {
        AbortOnDrop(handle)
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts following `source` for the client `inner`, if a Tokio runtime runs; without one the
/// rules are not followed, and a warning says so.
pub(crate) fn start<T>(source: Arc<dyn RuleSource>, inner: &Arc<T>)
where
    T: RuleTarget + HasRules,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(
            target: "rpc::rules",
            "the client was built outside a Tokio runtime: it does not follow the rules; \
             build it inside the runtime"
        );
        return;
    };
    let task = runtime.spawn(rpc_registry::rules::follow(
        source,
        Arc::downgrade(inner),
        inner.in_force(),
    ));
    inner.hold(AbortOnDrop(task.abort_handle()));
}

/// What the client keeps of the rules: their versions in force and the task following them.
pub(crate) trait HasRules {
    fn in_force(&self) -> Arc<rpc_registry::rules::RulesInForce>;
    fn hold(&self, task: AbortOnDrop);
}

/// Puts a governance document in the centre level, or a routing document in the router, from
/// the next call. A strategy the governance document asks of an entry that cannot carry it
/// out (hashing without a `#[hash_key]`, appoint without an address) is left out for that
/// entry, with a warning: every client applies a document alike, whichever entries it has
/// called ([`Governance::set_centre`]). (Refused, changing nothing, only when the levels below
/// would then give an entry already called options it cannot carry out.)
pub(crate) fn apply(
    governance: &Governance,
    router: &Router,
    kind: RuleKind,
    rules: &RuleVersion,
) -> Result<(), RpcError> {
    match kind {
        RuleKind::Governance => {
            let centre = GovernanceConfig::from_toml(&rules.text)?;
            for e in governance.set_centre(centre)? {
                tracing::warn!(
                    target: "rpc::rules",
                    version = rules.version,
                    "left out of the governance rules for this entry: {}",
                    e.message()
                );
            }
            Ok(())
        }
        RuleKind::Routing => {
            router.set_from_centre(RoutingRules::from_toml(&rules.text)?);
            Ok(())
        }
    }
}

/// Whether `text` is a document of `kind` to write, as an editor asks: its error (a document
/// that does not parse, or governance options an entry already called cannot carry out, a
/// strategy [`apply`] would leave out included), and nothing changes either way.
pub(crate) fn check(governance: &Governance, kind: RuleKind, text: &str) -> Result<(), RpcError> {
    match kind {
        RuleKind::Governance => {
            let centre = GovernanceConfig::from_toml(text)?;
            governance.check_layers(|l| l.centre = centre)
        }
        RuleKind::Routing => RoutingRules::from_toml(text).map(drop),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two documents, each one rule written as an inline table.
    const STABLE_ONLY: &str =
        r#"routes = [{ name = "stable", service = "s.S", to = [{ tags = { v = "1" } }] }]"#;
    const SPLIT: &str = r#"routes = [{ name = "split", service = "s.S", to = [{ tags = { v = "1" }, weight = 9 }, { tags = { v = "2" }, weight = 1 }] }]"#;

    fn version(version: i64, text: &str) -> RuleVersion {
        RuleVersion::new(version, text)
    }

    #[test]
    fn an_empty_routing_document_brings_back_the_rules_the_client_was_built_with() {
        let governance = Governance::new(Default::default());
        let built = RoutingRules::from_toml(STABLE_ONLY).unwrap();
        let router = Router::new(built.clone());
        apply(&governance, &router, RuleKind::Routing, &version(1, SPLIT)).unwrap();
        assert_eq!(*router.rules(), RoutingRules::from_toml(SPLIT).unwrap());
        apply(&governance, &router, RuleKind::Routing, &version(2, "")).unwrap();
        assert_eq!(*router.rules(), built, "back to the builder's rules");
    }
}
