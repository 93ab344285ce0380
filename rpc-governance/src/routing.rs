//! Routing rules: which instances of a service a call may go to, chosen by the instances' own
//! metadata tags (`version = "canary"`), before the balancer picks one of them.
//!
//! Why: releasing a new version to a slice of the traffic (a 95/5 canary split), pinning one
//! tenant to its own instances, or keeping calls off instances of the wrong version are
//! decisions about *which* instances, not *how* to spread calls over them; they sit above the
//! shunt strategy, which still balances within the chosen group. The document is data, not
//! code, so it can be stored centrally, validated before it applies, and changed at run time.
//!
//! The document (TOML):
//!
//! ```toml
//! [[routes]]
//! name = "acme-on-canary"                             # names the rule in spans and errors
//! service = "shop.Greeter"                            # or entry = "shop.Greeter.greet"
//! when = { attachment = "tenant", equals = "acme" }   # optional: absent = every call
//! to = [ { tags = { version = "canary" } } ]
//! fallback = "fail"                                   # no live canary: fail the call
//!
//! [[routes]]
//! name = "canary-split"
//! service = "shop.Greeter"
//! to = [
//!   { tags = { version = "canary" }, weight = 5 },
//!   { tags = { version = "stable" }, weight = 95 },
//! ]
//! fallback = "any"                                    # the default
//! ```
//!
//! - A call of entry `E` of service `S` takes the **first** rule, in document order, naming `S`
//!   (`service`) or `E` (`entry`) whose `when` holds (the call's attachment `attachment` equals
//!   `equals`); no such rule, no routing: every instance is a candidate.
//! - The rule's `to` lists tag groups: an instance belongs to a group when its metadata holds
//!   every tag of the group (`tags = {}` is every instance). One group is drawn per call, with
//!   probability `weight / sum of weights` (weight 1 when not given).
//! - The drawn group's instances that this client sees as live (registered and usable by its
//!   endpoint health) are the call's candidates, for every attempt of the call. When it has
//!   none, `fallback` decides: `any` lets the call go to any instance of the service, `fail`
//!   fails it with [`StatusCode::NotFindServiceRoute`] (404) naming the rule and the tags.
//!
//! Everything is checked by [`RoutingRules::from_toml`] / [`RoutingRules::validate`] before it
//! can apply, with an error naming the rule and the field.

use std::collections::BTreeMap;
use std::fmt;

use rpc_core::{RpcError, StatusCode};
use serde::{Deserialize, Serialize};

/// The largest sum of a rule's weights: enough for splits in millionths, small enough that no
/// sum overflows.
pub const MAX_TOTAL_WEIGHT: u32 = 1_000_000;

/// A routing document: its rules, in the order calls try them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingRules {
    /// The rules (`[[routes]]`), first match wins.
    #[serde(default)]
    pub routes: Vec<Route>,
}

/// One rule: for the calls of a service or an entry (when a condition holds), the tag groups
/// they go to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// The rule's name, unique in the document: the span field `rpc.route` and errors name it.
    pub name: String,
    /// The service whose calls the rule routes (`"shop.Greeter"`). Exactly one of `service` and
    /// `entry` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// The one entry whose calls the rule routes (`"shop.Greeter.greet"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<String>,
    /// When the rule applies; absent, to every call of its service or entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<When>,
    /// The tag groups, drawn by weight.
    pub to: Vec<Target>,
    /// What a call does when its group has no live instance.
    #[serde(default)]
    pub fallback: Fallback,
}

/// A rule's condition on the call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct When {
    /// The attachment read (`RpcContext` attachments and those client layers add), such as
    /// `"tenant"`.
    pub attachment: String,
    /// The value it must have; a call without the attachment does not match.
    pub equals: String,
}

/// A tag group and its share of the rule's calls.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// The metadata an instance must hold, every pair of it; empty: every instance.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// The group's weight, at least 1 (1 when not given).
    #[serde(default = "one")]
    pub weight: u32,
}

fn one() -> u32 {
    1
}

/// What a call does when the group drawn for it has no live instance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fallback {
    /// Any instance of the service takes the call. The default.
    #[default]
    Any,
    /// The call fails (404) with an error naming the rule and the tags.
    Fail,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fallback::Any => "any",
            Fallback::Fail => "fail",
        })
    }
}

fn invalid(what: impl fmt::Display) -> RpcError {
    RpcError::new(StatusCode::FrameworkError, format!("routing rules: {what}"))
}

/// A TOML error with where it is: the line, and the rule (`routes[i]`) it falls in.
fn where_in(text: &str, e: &toml::de::Error) -> String {
    let Some(at) = e.span().map(|s| s.start.min(text.len())) else {
        return e.message().to_string();
    };
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let rule = before
        .lines()
        .filter(|l| l.trim_start().starts_with("[[routes]]"))
        .count();
    match rule {
        0 => format!("line {line}: {}", e.message()),
        n => format!("line {line} (routes[{}]): {}", n - 1, e.message()),
    }
}

impl RoutingRules {
    /// No rules: every call may go to every instance.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses and validates the TOML document (see the module's documentation). A syntax
    /// error, an unknown field or a wrong value is an error naming the rule and the field; the
    /// document is then not used at all.
    pub fn from_toml(text: &str) -> Result<Self, RpcError> {
        let rules: RoutingRules = toml::from_str(text).map_err(|e| invalid(where_in(text, &e)))?;
        rules.validate()?;
        Ok(rules)
    }

    /// The TOML form of the rules ([`from_toml`](Self::from_toml) reads it back).
    pub fn to_toml(&self) -> Result<String, RpcError> {
        toml::to_string(self).map_err(|e| invalid(format!("cannot be written as TOML: {e}")))
    }

    /// Whether there is no rule.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// Checks every rule: a unique non-empty name; exactly one of `service` and `entry` (an
    /// entry id being `<service id>.<method>`); a non-empty attachment name in `when`; at least
    /// one target, each of weight 1 or more, with non-empty tag names, their sum at most
    /// [`MAX_TOTAL_WEIGHT`]; and no rule that could never apply because an earlier rule with
    /// no `when` takes all of its calls.
    pub fn validate(&self) -> Result<(), RpcError> {
        for (i, r) in self.routes.iter().enumerate() {
            let at = if r.name.trim().is_empty() {
                return Err(invalid(format!(
                    "routes[{i}]: name is empty; give every rule a unique name (spans and \
                     errors name it)"
                )));
            } else {
                format!("rule {:?} (routes[{i}])", r.name)
            };
            if let Some(j) = self.routes[..i].iter().position(|o| o.name == r.name) {
                return Err(invalid(format!(
                    "{at}: the name is already used by routes[{j}]; names must be unique"
                )));
            }
            match (&r.service, &r.entry) {
                (Some(_), Some(_)) | (None, None) => {
                    return Err(invalid(format!(
                        "{at}: give exactly one of service = \"<service id>\" and entry = \
                         \"<service id>.<method>\""
                    )))
                }
                (Some(s), None) if s.trim().is_empty() => {
                    return Err(invalid(format!("{at}: service is empty")))
                }
                (None, Some(e))
                    if !e
                        .rsplit_once('.')
                        .is_some_and(|(s, m)| !s.is_empty() && !m.is_empty()) =>
                {
                    return Err(invalid(format!(
                        "{at}: entry {e:?} is not an entry id; expected <service id>.<method>"
                    )))
                }
                _ => {}
            }
            if let Some(w) = &r.when {
                if w.attachment.trim().is_empty() {
                    return Err(invalid(format!(
                        "{at}: when.attachment is empty; name the attachment to compare, such \
                         as \"tenant\""
                    )));
                }
            }
            if r.to.is_empty() {
                return Err(invalid(format!(
                    "{at}: to is empty; list at least one group, such as to = [ {{ tags = {{ \
                     version = \"stable\" }} }} ]"
                )));
            }
            let mut total: u64 = 0;
            for (k, t) in r.to.iter().enumerate() {
                if t.weight == 0 {
                    return Err(invalid(format!(
                        "{at}: to[{k}].weight is 0; a weight is at least 1 (remove the group to \
                         send it nothing)"
                    )));
                }
                if let Some(name) = t.tags.keys().find(|k| k.trim().is_empty()) {
                    return Err(invalid(format!(
                        "{at}: to[{k}].tags has an empty tag name ({name:?})"
                    )));
                }
                total += u64::from(t.weight);
            }
            if total > u64::from(MAX_TOTAL_WEIGHT) {
                return Err(invalid(format!(
                    "{at}: the weights add up to {total}, more than {MAX_TOTAL_WEIGHT}"
                )));
            }
            if let Some(j) = self.routes[..i].iter().position(|o| o.shadows(r)) {
                return Err(invalid(format!(
                    "{at} can never apply: rule {:?} (routes[{j}]) comes first, has no `when` \
                     and takes every call it could match; move it after, or give it a `when`",
                    self.routes[j].name
                )));
            }
        }
        Ok(())
    }

    /// The rule routing a call of `entry_id` (of `service_id`) with `attachments`: the first
    /// that names its service or entry and whose condition holds.
    pub fn route_for(
        &self,
        service_id: &str,
        entry_id: &str,
        attachments: &BTreeMap<String, String>,
    ) -> Option<(usize, &Route)> {
        self.route_matching(service_id, entry_id, |k, v| {
            attachments.get(k).is_some_and(|a| a == v)
        })
    }

    /// [`route_for`](Self::route_for), with the attachments read through `attachment_is(key,
    /// value)`: whether the call's attachment `key` equals `value` (for a caller whose
    /// attachments live in several places).
    pub fn route_matching(
        &self,
        service_id: &str,
        entry_id: &str,
        attachment_is: impl Fn(&str, &str) -> bool,
    ) -> Option<(usize, &Route)> {
        self.routes.iter().enumerate().find(|(_, r)| {
            r.applies_to(service_id, entry_id)
                && r.when
                    .as_ref()
                    .is_none_or(|w| attachment_is(&w.attachment, &w.equals))
        })
    }

    /// Whether some rule names `service_id` or one of its entries: a service no rule names
    /// skips routing at no cost.
    pub fn names_service(&self, service_id: &str) -> bool {
        self.routes
            .iter()
            .any(|r| r.service_of() == Some(service_id))
    }
}

impl Route {
    /// The service the rule is about: `service`, or the service part of `entry`.
    pub fn service_of(&self) -> Option<&str> {
        match (&self.service, &self.entry) {
            (Some(s), _) => Some(s),
            (None, Some(e)) => e.rsplit_once('.').map(|(s, _)| s),
            (None, None) => None,
        }
    }

    fn applies_to(&self, service_id: &str, entry_id: &str) -> bool {
        match (&self.service, &self.entry) {
            (Some(s), _) => s == service_id,
            (None, Some(e)) => e == entry_id,
            (None, None) => false,
        }
    }

    /// Whether this rule, placed earlier, takes every call `later` could match.
    fn shadows(&self, later: &Route) -> bool {
        if self.when.is_some() {
            return false;
        }
        match (&self.service, &self.entry) {
            (Some(s), _) => later.service_of() == Some(s.as_str()),
            (None, Some(e)) => later.entry.as_deref() == Some(e.as_str()),
            (None, None) => false,
        }
    }

    /// The sum of the targets' weights.
    pub fn total_weight(&self) -> u32 {
        self.to.iter().map(|t| t.weight).sum()
    }

    /// The target a draw `d` in `0..total_weight()` falls on: target `k` takes the draws from
    /// the sum of the weights before it, for its weight. (A draw past the end takes the last.)
    pub fn target_for(&self, d: u32) -> usize {
        let mut end = 0u32;
        for (k, t) in self.to.iter().enumerate() {
            end = end.saturating_add(t.weight);
            if d < end {
                return k;
            }
        }
        self.to.len().saturating_sub(1)
    }

    /// The error of a call whose group `target` has no live instance under `fallback = "fail"`.
    pub fn no_live_instance(&self, target: usize, entry_id: &str, why: &str) -> RpcError {
        let tags = self
            .to
            .get(target)
            .map(|t| tags_text(&t.tags))
            .unwrap_or_default();
        RpcError::new(
            StatusCode::NotFindServiceRoute,
            format!(
                "{entry_id}: routing rule {:?} sends this call to instances tagged {tags}, and \
                 none is live ({why}); the rule's fallback is \"fail\": start an instance with \
                 those tags, or set fallback = \"any\"",
                self.name
            ),
        )
    }
}

/// The group a routing rule drew for one call: a hedge of the call goes to the same group as
/// its first attempt, rather than drawing again (see [`CallCx::route_drawn`]).
///
/// [`CallCx::route_drawn`]: crate::stack::CallCx::route_drawn
#[derive(Debug, Clone)]
pub struct RouteDrawn {
    /// The rules in force when the group was drawn (the indexes point into them).
    pub rules: std::sync::Arc<RoutingRules>,
    /// The index of the rule that matched, in `rules.routes`.
    pub route: usize,
    /// The index of the group drawn, in the rule's `to`.
    pub target: usize,
}

/// `version=canary,zone=a` (or `(any)` for no tags): how spans and errors show a group.
pub fn tags_text(tags: &BTreeMap<String, String>) -> String {
    if tags.is_empty() {
        return "(any)".into();
    }
    tags.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether an instance whose metadata is `metadata` belongs to the group `tags`.
pub fn has_tags(metadata: &BTreeMap<String, String>, tags: &BTreeMap<String, String>) -> bool {
    tags.iter().all(|(k, v)| metadata.get(k) == Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CANARY: &str = r#"
[[routes]]
name = "acme-on-canary"
service = "shop.Greeter"
when = { attachment = "tenant", equals = "acme" }
to = [ { tags = { version = "canary" } } ]
fallback = "fail"

[[routes]]
name = "canary-split"
service = "shop.Greeter"
to = [
  { tags = { version = "canary" }, weight = 5 },
  { tags = { version = "stable" }, weight = 95 },
]
"#;

    fn tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_document_parses_into_its_rules() {
        let rules = RoutingRules::from_toml(CANARY).unwrap();
        assert_eq!(rules.routes.len(), 2);
        let acme = &rules.routes[0];
        assert_eq!(acme.name, "acme-on-canary");
        assert_eq!(acme.service.as_deref(), Some("shop.Greeter"));
        assert_eq!(
            acme.when,
            Some(When {
                attachment: "tenant".into(),
                equals: "acme".into()
            })
        );
        assert_eq!(
            acme.to,
            [Target {
                tags: tags(&[("version", "canary")]),
                weight: 1
            }]
        );
        assert_eq!(acme.fallback, Fallback::Fail);
        let split = &rules.routes[1];
        assert_eq!(split.fallback, Fallback::Any, "the default");
        assert_eq!(
            split.to.iter().map(|t| t.weight).collect::<Vec<_>>(),
            [5, 95]
        );
        // Written out and read back, the same rules.
        let again = RoutingRules::from_toml(&rules.to_toml().unwrap()).unwrap();
        assert_eq!(again, rules);
        assert!(RoutingRules::from_toml("").unwrap().is_empty());
    }

    #[test]
    fn the_first_matching_rule_routes_a_call() {
        let rules = RoutingRules::from_toml(CANARY).unwrap();
        let none = BTreeMap::new();
        let acme = tags(&[("tenant", "acme")]);
        let other = tags(&[("tenant", "globex")]);
        let name = |a| {
            rules
                .route_for("shop.Greeter", "shop.Greeter.greet", a)
                .map(|(_, r)| r.name.as_str())
        };
        assert_eq!(name(&acme), Some("acme-on-canary"));
        assert_eq!(name(&other), Some("canary-split"));
        assert_eq!(name(&none), Some("canary-split"));
        assert!(rules
            .route_for("shop.Other", "shop.Other.x", &acme)
            .is_none());
        assert!(rules.names_service("shop.Greeter"));
        assert!(!rules.names_service("shop.Other"));
        // An entry rule matches its entry only.
        let rules = RoutingRules::from_toml(
            "[[routes]]\nname = \"e\"\nentry = \"a.B.c\"\nto = [ { tags = { v = \"1\" } } ]\n",
        )
        .unwrap();
        assert!(rules.route_for("a.B", "a.B.c", &none).is_some());
        assert!(rules.route_for("a.B", "a.B.d", &none).is_none());
        assert!(rules.names_service("a.B"));
    }

    /// Every draw in `0..100` counted once: the oracle is the weights themselves, exactly.
    #[test]
    fn a_95_5_split_gives_each_group_its_weight_of_the_draws() {
        let rules = RoutingRules::from_toml(CANARY).unwrap();
        let split = &rules.routes[1];
        assert_eq!(split.total_weight(), 100);
        let mut counts = [0u32; 2];
        for d in 0..split.total_weight() {
            counts[split.target_for(d)] += 1;
        }
        assert_eq!(counts, [5, 95]);
        // The groups take contiguous runs of draws, in the order written.
        assert_eq!(split.target_for(0), 0);
        assert_eq!(split.target_for(4), 0);
        assert_eq!(split.target_for(5), 1);
        assert_eq!(split.target_for(99), 1);
    }

    /// Seeded draws, as the client makes them (uniform in `0..total`): over 20 000 calls the
    /// canary's count stays within 5 standard deviations of the binomial mean (1 000 ± 154).
    #[test]
    fn seeded_draws_split_95_5_within_a_binomial_bound() {
        use rand::{Rng, SeedableRng};
        let rules = RoutingRules::from_toml(CANARY).unwrap();
        let split = &rules.routes[1];
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        let n = 20_000u32;
        let canary = (0..n)
            .filter(|_| split.target_for(rng.random_range(0..split.total_weight())) == 0)
            .count() as f64;
        let (mean, sd) = (f64::from(n) * 0.05, (f64::from(n) * 0.05 * 0.95).sqrt());
        assert!(
            (canary - mean).abs() <= 5.0 * sd,
            "{canary} canary calls of {n}; expected {mean} ± {}",
            5.0 * sd
        );
    }

    #[test]
    fn tags_select_instances_holding_every_pair() {
        let canary = tags(&[("version", "canary")]);
        assert!(has_tags(
            &tags(&[("version", "canary"), ("zone", "a")]),
            &canary
        ));
        assert!(!has_tags(&tags(&[("version", "stable")]), &canary));
        assert!(!has_tags(&BTreeMap::new(), &canary));
        assert!(has_tags(&tags(&[("zone", "a")]), &BTreeMap::new()));
        assert_eq!(
            tags_text(&tags(&[("zone", "a"), ("version", "canary")])),
            "version=canary,zone=a"
        );
    }

    #[test]
    fn bad_rules_are_refused_naming_the_rule_and_the_field() {
        let rule = |body: &str| format!("[[routes]]\nname = \"r\"\n{body}\n");
        let cases = [
            (rule("service = \"s.S\"\nto = []"), "rule \"r\" (routes[0]): to is empty"),
            (
                rule("service = \"s.S\"\nto = [ { tags = { v = \"1\" }, weight = 0 } ]"),
                "to[0].weight is 0",
            ),
            (
                rule("to = [ { tags = { v = \"1\" } } ]"),
                "give exactly one of service",
            ),
            (
                rule("service = \"s.S\"\nentry = \"s.S.m\"\nto = [ { tags = { v = \"1\" } } ]"),
                "give exactly one of service",
            ),
            (
                rule("entry = \"nodot\"\nto = [ { tags = { v = \"1\" } } ]"),
                "entry \"nodot\" is not an entry id",
            ),
            (
                rule("service = \"s.S\"\nwhen = { attachment = \"\", equals = \"x\" }\nto = [ { tags = { v = \"1\" } } ]"),
                "when.attachment is empty",
            ),
            (
                rule("service = \"s.S\"\nto = [ { tags = { v = \"1\" }, weight = 600000 }, { weight = 500000 } ]"),
                "the weights add up to 1100000",
            ),
            (
                rule("service = \"s.S\"\nto = [ { tags = { v = \"1\" } } ]\nfallback = \"maybe\""),
                "unknown variant `maybe`",
            ),
            (
                rule("service = \"s.S\"\nto = [ { tag = { v = \"1\" } } ]"),
                "unknown field `tag`",
            ),
            (
                rule("service = \"s.S\"\nto = [ { tags = { v = \"1\" } } ]\nweight = 3"),
                "unknown field `weight`",
            ),
            (
                "[[routes]]\nname = \"\"\nservice = \"s.S\"\nto = [ {} ]".to_string(),
                "routes[0]: name is empty",
            ),
            (
                format!(
                    "{}{}",
                    rule("service = \"s.S\"\nto = [ {} ]"),
                    rule("service = \"s.T\"\nto = [ {} ]")
                ),
                "rule \"r\" (routes[1]): the name is already used by routes[0]",
            ),
            (
                "[[routes]]\nname = \"all\"\nservice = \"s.S\"\nto = [ {} ]\n\
                 [[routes]]\nname = \"late\"\nentry = \"s.S.m\"\n\
                 when = { attachment = \"t\", equals = \"a\" }\nto = [ {} ]\n"
                    .to_string(),
                "rule \"late\" (routes[1]) can never apply: rule \"all\" (routes[0]) comes first",
            ),
        ];
        for (text, expected) in cases {
            let e = RoutingRules::from_toml(&text).expect_err(&text);
            assert!(e.message().contains(expected), "{text}\n→ {e}");
            assert!(e.message().starts_with("routing rules: "), "{e}");
        }
        // A syntax or field error names its line and its rule.
        let e = RoutingRules::from_toml(
            "[[routes]]\nname = \"a\"\nservice = \"s.S\"\nto = [ {} ]\n\
             [[routes]]\nname = \"b\"\nservice = \"s.T\"\nto = [ { wieght = 5 } ]\n",
        )
        .unwrap_err();
        assert!(
            e.message()
                .contains("line 8 (routes[1]): unknown field `wieght`"),
            "{e}"
        );
        let e = RoutingRules::from_toml("[[routes]]\nname = \"a\nservice = 1\n").unwrap_err();
        assert!(e.message().contains("line 2 (routes[0])"), "{e}");
        // A conditional rule first does not shadow the rule after it.
        RoutingRules::from_toml(
            "[[routes]]\nname = \"a\"\nservice = \"s.S\"\n\
             when = { attachment = \"t\", equals = \"a\" }\nto = [ {} ]\n\
             [[routes]]\nname = \"b\"\nservice = \"s.S\"\nto = [ {} ]\n",
        )
        .unwrap();
    }

    #[test]
    fn the_fail_error_names_the_rule_and_the_tags() {
        let rules = RoutingRules::from_toml(CANARY).unwrap();
        let e = rules.routes[0].no_live_instance(
            0,
            "shop.Greeter.greet",
            "2 instances, none tagged so",
        );
        assert_eq!(e.code(), StatusCode::NotFindServiceRoute);
        assert!(
            e.message().contains(
                "routing rule \"acme-on-canary\" sends this call to instances tagged \
                 version=canary, and none is live (2 instances, none tagged so)"
            ),
            "{e}"
        );
    }
}
