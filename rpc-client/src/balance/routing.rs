//! Routing rules applied per call, before the balancer: which instances of the service the
//! call may go to (see [`rpc_governance::routing`] for the document and its semantics).
//!
//! Why here: the rule decides the *group* (instances holding some metadata tags), the shunt
//! strategy still spreads calls *within* it, so the choice is made once when the call's picker
//! is made and then narrows every attempt's candidates. The group is drawn by weight per call,
//! and is judged live against this client's endpoint health at that moment; the fallback
//! (`any` or `fail`) applies when it has no live instance. The rule that chose is recorded on
//! the call's span (`rpc.route`, with `rpc.route.group` and, when the fallback applied,
//! `rpc.route.fallback`) and in a debug event (target `rpc::routing`).
//!
//! No rules cost a call one atomic load; rules naming other services, one scan of the rules.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use rpc_core::{RpcContext, RpcError};
use rpc_governance::health::EndpointHealth;
use rpc_governance::routing::{has_tags, tags_text, Fallback, Route, RouteDrawn, RoutingRules};
use rpc_governance::stack::CallCx;
use rpc_registry::Endpoints;

use super::ServiceState;

/// The routing rules in force in one client; replaced whole, read by each call.
pub(crate) struct Router {
    in_force: ArcSwap<GroupTurns>,
    /// The rules the client was built with: what an empty document from the config centre
    /// goes back to.
    built: Arc<RoutingRules>,
}

/// A routing document with the round-robin positions of its groups, one per group and entry.
/// A group takes turns of its own: with the entry's one position, calls of one entry
/// alternating between two groups (a tenant's and everyone else's) each drew every other
/// number, and a group of two took all its calls on one member. And each entry its own within
/// a group, as outside one: entries of a service called in turn would otherwise each keep
/// landing on the same members.
struct GroupTurns {
    rules: Arc<RoutingRules>,
    /// Where each rule's groups start in an entry's positions.
    starts: Vec<usize>,
    /// Every group's position, by entry id (made at the entry's first routed call).
    by_entry: DashMap<&'static str, Arc<[AtomicUsize]>>,
}

impl GroupTurns {
    fn new(rules: Arc<RoutingRules>) -> Arc<Self> {
        let mut starts = Vec::with_capacity(rules.routes.len());
        let mut count = 0;
        for route in &rules.routes {
            starts.push(count);
            count += route.to.len();
        }
        starts.push(count);
        Arc::new(GroupTurns {
            rules,
            starts,
            by_entry: DashMap::new(),
        })
    }

    /// The positions of `entry`'s groups, from random places, as the entries' own start.
    fn of(&self, entry: &'static str) -> Arc<[AtomicUsize]> {
        if let Some(turns) = self.by_entry.get(entry) {
            return turns.clone();
        }
        let count = self.starts.last().copied().unwrap_or(0);
        self.by_entry
            .entry(entry)
            .or_insert_with(|| {
                (0..count)
                    .map(|_| AtomicUsize::new(rand::random::<u32>() as usize))
                    .collect()
            })
            .clone()
    }
}

impl Router {
    /// A router applying `rules` (already validated).
    pub(crate) fn new(rules: RoutingRules) -> Self {
        let built = Arc::new(rules);
        Router {
            in_force: ArcSwap::new(GroupTurns::new(built.clone())),
            built,
        }
    }

    /// Puts the config centre's routing document (already validated) in force from the next
    /// call: it replaces the rules in force, as [`set`](Self::set) does, except that an empty
    /// document goes back to the rules the client was built with.
    pub(crate) fn set_from_centre(&self, rules: RoutingRules) {
        if rules.is_empty() {
            self.in_force.store(GroupTurns::new(self.built.clone()));
        } else {
            self.set(rules);
        }
    }

    /// The rules in force.
    pub(crate) fn rules(&self) -> Arc<RoutingRules> {
        self.in_force.load().rules.clone()
    }

    /// Puts `rules` (already validated) in force from the next call.
    pub(crate) fn set(&self, rules: RoutingRules) {
        self.in_force.store(GroupTurns::new(Arc::new(rules)));
    }

    /// The route of the call in `cx` to `service`: `None` when no rule routes it. Draws the
    /// group, judges whether it has a live instance, applies the fallback, and records the
    /// choice on the current span (the call's `rpc.client` span).
    pub(crate) fn choose(
        &self,
        cx: &CallCx<'_>,
        service: &ServiceState,
    ) -> Result<Option<Choice>, RpcError> {
        // One copy for the whole choice: the indexes the choice keeps point into it, whatever
        // document a concurrent update puts in force meanwhile.
        let method = cx.method();
        // A hedge goes to the group its call's first attempt drew (or the other way round):
        // drawing again would let one call be served by two groups of a weighted split.
        let in_force = self.in_force.load();
        let (rules, index, target) = match cx.route_drawn() {
            Some(d) => (d.rules.clone(), d.route, d.target),
            None => {
                if in_force.rules.is_empty() {
                    return Ok(None);
                }
                let rules = in_force.rules.clone();
                // The call's attachments: those layers added, over those of the current
                // context.
                let attachment_is = |key: &str, value: &str| match cx.attachments().get(key) {
                    Some(a) => a == value,
                    None => RpcContext::with_current(|m| m.get(key).is_some_and(|a| a == value)),
                };
                let Some((index, route)) =
                    rules.route_matching(method.service_id, method.entry_id, attachment_is)
                else {
                    return Ok(None);
                };
                let target = match route.total_weight() {
                    0 | 1 => 0,
                    total => route.target_for(rand::random_range(0..total)),
                };
                cx.keep_route_drawn(RouteDrawn {
                    rules: rules.clone(),
                    route: index,
                    target,
                });
                (rules, index, target)
            }
        };
        let route = &rules.routes[index];
        let eps = service.endpoints();
        let health = cx.health();
        let live = live_members(&eps, route, target, health);
        let fell_back = if live == 0 {
            match route.fallback {
                Fallback::Fail => {
                    let why = no_live_why(&eps, route, target, method.service_id);
                    record(route, target, Some("fail"), cx.is_hedge());
                    return Err(route.no_live_instance(target, method.entry_id, &why));
                }
                Fallback::Any => true,
            }
        } else {
            false
        };
        record(route, target, fell_back.then_some("any"), cx.is_hedge());
        // A hedge drawn under a document replaced since takes the entry's turns.
        let turns = Arc::ptr_eq(&in_force.rules, &rules).then(|| {
            (
                in_force.of(method.entry_id),
                in_force.starts[index] + target,
            )
        });
        Ok(Some(Choice {
            rules: rules.clone(),
            route: index,
            target,
            fell_back,
            turns,
        }))
    }
}

/// The instances of the group `target` of `route` that `health` lets calls go to.
fn live_members(eps: &Endpoints, route: &Route, target: usize, health: &EndpointHealth) -> usize {
    let tags = &route.to[target].tags;
    eps.iter()
        .filter(|i| has_tags(&i.metadata, tags) && health.is_usable(&i.address))
        .count()
}

/// Why the group has no live instance, for the error.
fn no_live_why(eps: &Endpoints, route: &Route, target: usize, service_id: &str) -> String {
    let tags = &route.to[target].tags;
    let members = eps.iter().filter(|i| has_tags(&i.metadata, tags)).count();
    if members == 0 {
        format!(
            "{} instance(s) of {service_id} registered, none tagged so",
            eps.len()
        )
    } else {
        format!("its {members} instance(s) are marked unhealthy or removed by this client")
    }
}

/// Records the rule's choice on the current span (the call's, unless for a `hedge`: the call's
/// first attempt records its own) and as a debug event.
fn record(route: &Route, target: usize, fallback: Option<&str>, hedge: bool) {
    let group = tags_text(&route.to[target].tags);
    if !hedge {
        let span = tracing::Span::current();
        span.record("rpc.route", route.name.as_str());
        span.record("rpc.route.group", group.as_str());
        if let Some(f) = fallback {
            span.record("rpc.route.fallback", f);
        }
    }
    tracing::debug!(
        target: "rpc::routing",
        rule = route.name.as_str(),
        group = group.as_str(),
        fallback = fallback.unwrap_or(""),
        hedge,
        "routing rule chose the call's instances"
    );
}

/// What a routing rule decided for one call: the group drawn for it, and whether the fallback
/// `any` let it go anywhere because the group had no live instance.
pub(crate) struct Choice {
    rules: Arc<RoutingRules>,
    route: usize,
    target: usize,
    fell_back: bool,
    /// The entry's positions of the document's groups, and this group's index among them.
    turns: Option<(Arc<[AtomicUsize]>, usize)>,
}

impl Choice {
    /// The group `target` of the rule `routes[route]` of `rules`, drawn as a call draws it.
    #[cfg(test)]
    pub(crate) fn drawn(rules: Arc<RoutingRules>, route: usize, target: usize) -> Choice {
        Choice {
            rules,
            route,
            target,
            fell_back: false,
            turns: None,
        }
    }

    /// The group's round-robin position: `None` when the fallback `any` let the call go to
    /// every instance (the entry's position then), or the document changed since the draw.
    pub(crate) fn turns(&self) -> Option<&AtomicUsize> {
        if self.fell_back {
            return None;
        }
        let (turns, at) = self.turns.as_ref()?;
        turns.get(*at)
    }

    fn route(&self) -> &Route {
        &self.rules.routes[self.route]
    }

    /// The indexes in `eps` of the call's candidates: the group's instances (healthy or not:
    /// the balancer ranks them), or `None` (every instance) when the fallback `any` applied.
    /// A group left with no instance at all in a newer snapshot applies the fallback again.
    pub(crate) fn candidates(
        &self,
        eps: &Endpoints,
        entry_id: &str,
    ) -> Result<Option<Vec<usize>>, RpcError> {
        if self.fell_back {
            return Ok(None);
        }
        let route = self.route();
        let tags = &route.to[self.target].tags;
        let members: Vec<usize> = eps
            .iter()
            .enumerate()
            .filter(|(_, i)| has_tags(&i.metadata, tags))
            .map(|(idx, _)| idx)
            .collect();
        if !members.is_empty() {
            return Ok(Some(members));
        }
        match route.fallback {
            Fallback::Any => Ok(None),
            Fallback::Fail => {
                let service = route.service_of().unwrap_or_default();
                let why = no_live_why(eps, route, self.target, service);
                Err(route.no_live_instance(self.target, entry_id, &why))
            }
        }
    }
}
