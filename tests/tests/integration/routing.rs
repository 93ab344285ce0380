//! Routing rules over TCP: servers carrying `version` metadata (canary, stable) behind one
//! registry, and a client whose rules choose among them per call: tag routing, a 95/5 split
//! within a binomial bound, a tenant attachment routed to its group, the fallback (`any`,
//! `fail`) when a group has no live instance, and the span field naming the rule that chose.
//! Each handler answers with its own name, so the answer says who served the call.

use crate::common;

use std::collections::BTreeMap;

use common::otel::{attr, Traces};
use common::within;
use rpc::{
    Client, InProcessRegistry, RoutingRules, RpcContext, RpcError, Server, ServerHandle, StatusCode,
};

#[rpc::service(name = "rt.Who")]
pub trait Who {
    async fn who(&self) -> Result<String, RpcError>;
}

/// A service no rule names.
#[rpc::service(name = "rt.Other")]
pub trait Other {
    async fn who(&self) -> Result<String, RpcError>;
}

/// A service of two entries, for entries called in turn.
#[rpc::service(name = "rt.Pair")]
pub trait Pair {
    async fn first(&self) -> Result<String, RpcError>;
    async fn second(&self) -> Result<String, RpcError>;
}

struct Named(&'static str);

impl Who for Named {
    async fn who(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

impl Pair for Named {
    async fn first(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
    async fn second(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

impl Other for Named {
    async fn who(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

/// A fresh registry with one canary (`canary-1`) and two stable instances (`stable-1`,
/// `stable-2`) of `rt.Who` (and `rt.Other`, `rt.Pair`), by their `version` metadata.
async fn fleet() -> (InProcessRegistry, Vec<ServerHandle>) {
    let registry = InProcessRegistry::new();
    let mut servers = Vec::new();
    for (name, version) in [
        ("canary-1", "canary"),
        ("stable-1", "stable"),
        ("stable-2", "stable"),
    ] {
        servers.push(
            Server::builder()
                .registry(registry.clone())
                .metadata("version", version)
                .add_service(WhoServer::new(Named(name)))
                .add_service(OtherServer::new(Named(name)))
                .add_service(PairServer::new(Named(name)))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    (registry, servers)
}

/// A fresh [`fleet`] and a client of it routing by `rules`.
async fn routed(rules: &str) -> (Client, Vec<ServerHandle>) {
    let (registry, servers) = fleet().await;
    (client(&registry, rules), servers)
}

/// Stops every server of `servers`.
async fn stop(servers: Vec<ServerHandle>) {
    for s in servers {
        s.shutdown().await;
    }
}

fn client(registry: &InProcessRegistry, rules: &str) -> Client {
    let rules = RoutingRules::from_toml(rules).expect("valid rules");
    Client::builder()
        .registry(registry.clone())
        .routing_rules(rules)
        .expect("valid rules")
        .build()
}

/// A span subscriber on this test's thread until dropped. Every test installs one: `tracing`
/// caches each callsite's interest process-wide, and a thread without a subscriber could
/// register the client's span callsites as never wanted while the span test runs.
fn traced() -> (Traces, tracing::subscriber::DefaultGuard) {
    Traces::install()
}

/// Who served each of `n` calls, counted by name.
async fn served(who: &WhoClient, n: usize) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for _ in 0..n {
        let name = within("call", who.who()).await.expect("the call succeeds");
        *counts.entry(name).or_default() += 1;
    }
    counts
}

/// Who served each of `n` calls of `a` and of `b`, called in turn, counted by name.
async fn served_in_turn<A, B>(
    n: usize,
    a: impl Fn() -> A,
    b: impl Fn() -> B,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>)
where
    A: std::future::Future<Output = Result<String, RpcError>>,
    B: std::future::Future<Output = Result<String, RpcError>>,
{
    let (mut by_a, mut by_b) = (BTreeMap::new(), BTreeMap::new());
    for _ in 0..n {
        let name = within("a call", a()).await.expect("the call succeeds");
        *by_a.entry(name).or_default() += 1;
        let name = within("b call", b()).await.expect("the call succeeds");
        *by_b.entry(name).or_default() += 1;
    }
    (by_a, by_b)
}

/// `pairs` as counts by name.
fn counts(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(n, c)| (n.to_string(), *c)).collect()
}

const CANARY_ONLY: &str = r#"
[[routes]]
name = "canary-only"
service = "rt.Who"
to = [ { tags = { version = "canary" } } ]
"#;

#[tokio::test]
async fn tag_routing_sends_every_call_to_the_tagged_instances() {
    let _traced = traced();
    let (client, servers) = routed(CANARY_ONLY).await;
    let who = WhoClient::new(client.clone());
    assert_eq!(
        served(&who, 30).await,
        BTreeMap::from([("canary-1".to_string(), 30)])
    );
    assert_eq!(client.routing_rules().routes[0].name, "canary-only");

    // Replaced at run time: stable instances only, round robin within them.
    client
        .set_routing_rules(
            RoutingRules::from_toml(
                "[[routes]]\nname = \"stable-only\"\nentry = \"rt.Who.who\"\n\
                 to = [ { tags = { version = \"stable\" } } ]\n",
            )
            .expect("valid"),
        )
        .expect("applied");
    assert_eq!(
        served(&who, 30).await,
        BTreeMap::from([("stable-1".to_string(), 15), ("stable-2".to_string(), 15)])
    );
    // No rules: every instance again.
    client
        .set_routing_rules(RoutingRules::new())
        .expect("applied");
    assert_eq!(served(&who, 30).await.len(), 3);
    // A service no rule names is not routed.
    let other = OtherClient::new(client.clone());
    client
        .set_routing_rules(RoutingRules::from_toml(CANARY_ONLY).expect("valid"))
        .expect("applied");
    let mut names = std::collections::BTreeSet::new();
    for _ in 0..30 {
        names.insert(within("other", other.who()).await.expect("call"));
    }
    assert_eq!(names.len(), 3, "{names:?}");
    stop(servers).await;
}

#[tokio::test]
async fn invalid_rules_are_refused_and_the_rules_in_force_stay() {
    let _traced = traced();
    let registry = InProcessRegistry::new();
    let client = client(&registry, CANARY_ONLY);
    let mut bad = RoutingRules::from_toml(CANARY_ONLY).expect("valid");
    bad.routes[0].to[0].weight = 0;
    let e = client.set_routing_rules(bad.clone()).expect_err("weight 0");
    assert!(
        e.message()
            .contains("rule \"canary-only\" (routes[0]): to[0].weight is 0"),
        "{e}"
    );
    assert_eq!(
        *client.routing_rules(),
        RoutingRules::from_toml(CANARY_ONLY).unwrap()
    );
    let refused = Client::builder().routing_rules(bad).err().expect("refused");
    assert!(refused.message().contains("weight is 0"), "{refused}");
}

#[tokio::test]
async fn a_95_5_split_sends_the_canary_its_share_within_a_binomial_bound() {
    let _traced = traced();
    let (client, servers) = routed(
        r#"
[[routes]]
name = "canary-split"
service = "rt.Who"
to = [
  { tags = { version = "canary" }, weight = 5 },
  { tags = { version = "stable" }, weight = 95 },
]
"#,
    )
    .await;
    let who = WhoClient::new(client);
    let n = 2000;
    let counts = served(&who, n).await;
    let canary = counts.get("canary-1").copied().unwrap_or(0) as f64;
    // Binomial(2000, 0.05): mean 100, standard deviation 9.75; 5 of them either side.
    let (mean, sd) = (n as f64 * 0.05, (n as f64 * 0.05 * 0.95).sqrt());
    assert!(
        (canary - mean).abs() <= 5.0 * sd,
        "canary served {canary} of {n}; expected {mean} ± {:.0}: {counts:?}",
        5.0 * sd
    );
    // The stable share is spread over both stable instances.
    assert_eq!(counts.values().sum::<usize>(), n);
    assert!(counts.get("stable-1").is_some_and(|c| *c > 0), "{counts:?}");
    assert!(counts.get("stable-2").is_some_and(|c| *c > 0), "{counts:?}");
    eprintln!("95/5 split over {n} calls: {counts:?}");
    stop(servers).await;
}

#[tokio::test]
async fn a_tenant_attachment_routes_its_calls_to_its_group() {
    let _traced = traced();
    let (client, servers) = routed(
        r#"
[[routes]]
name = "acme-on-canary"
service = "rt.Who"
when = { attachment = "tenant", equals = "acme" }
to = [ { tags = { version = "canary" } } ]

[[routes]]
name = "everyone-else-stable"
service = "rt.Who"
to = [ { tags = { version = "stable" } } ]
"#,
    )
    .await;
    let who = WhoClient::new(client);
    for _ in 0..10 {
        let acme = RpcContext::with_attachment("tenant", "acme", who.who());
        assert_eq!(within("acme", acme).await.expect("call"), "canary-1");
        let globex = RpcContext::with_attachment("tenant", "globex", who.who());
        assert!(within("globex", globex)
            .await
            .expect("call")
            .starts_with("stable-"));
        assert!(within("none", who.who())
            .await
            .expect("call")
            .starts_with("stable-"));
    }
    stop(servers).await;
}

/// A routing group takes turns of its own under round robin: calls of one entry alternating
/// between a tenant's group of two and the whole service (no rule) spread evenly in both.
/// Before, both drew from the entry's one position, each every other number, and the group of
/// two took all its calls on one member.
#[tokio::test]
async fn calls_alternating_between_a_group_and_the_whole_service_spread_in_each() {
    let _traced = traced();
    let (client, servers) = routed(
        r#"
[[routes]]
name = "acme-on-stable"
service = "rt.Who"
when = { attachment = "tenant", equals = "acme" }
to = [ { tags = { version = "stable" } } ]
"#,
    )
    .await;
    let who = WhoClient::new(client);
    let (acme, others) = served_in_turn(
        12,
        || RpcContext::with_attachment("tenant", "acme", who.who()),
        || who.who(),
    )
    .await;
    assert_eq!(acme, counts(&[("stable-1", 6), ("stable-2", 6)]));
    assert_eq!(
        others,
        counts(&[("canary-1", 4), ("stable-1", 4), ("stable-2", 4)])
    );
    stop(servers).await;
}

/// Within a routing group, each entry takes turns of its own, as outside one: two entries of
/// a service a rule sends to a group of two, called in turn, each spread over both members
/// (sharing the group's one position, each would take every other number and keep landing
/// on one member).
#[tokio::test]
async fn entries_called_in_turn_within_one_group_each_spread_over_it() {
    let _traced = traced();
    let (client, servers) = routed(
        r#"
[[routes]]
name = "pair-on-stable"
service = "rt.Pair"
to = [ { tags = { version = "stable" } } ]
"#,
    )
    .await;
    let pair = PairClient::new(client);
    let (first, second) = served_in_turn(8, || pair.first(), || pair.second()).await;
    let even = counts(&[("stable-1", 4), ("stable-2", 4)]);
    assert_eq!((first, second), (even.clone(), even));
    stop(servers).await;
}

#[tokio::test]
async fn a_group_with_no_live_instance_falls_back_to_any_or_fails_naming_the_rule() {
    let _traced = traced();
    let (registry, mut servers) = fleet().await;
    let rules = |fallback: &str| {
        format!(
            "[[routes]]\nname = \"canary-or-{fallback}\"\nservice = \"rt.Who\"\n\
             to = [ {{ tags = {{ version = \"canary\" }} }} ]\nfallback = \"{fallback}\"\n"
        )
    };
    let any = WhoClient::new(client(&registry, &rules("any")));
    let fail = WhoClient::new(client(&registry, &rules("fail")));
    assert_eq!(within("any", any.who()).await.expect("call"), "canary-1");
    assert_eq!(within("fail", fail.who()).await.expect("call"), "canary-1");

    // The canary goes away (deregistered): its group has no instance left.
    servers.remove(0).shutdown().await;
    let answered = served(&any, 20).await;
    assert_eq!(
        answered,
        BTreeMap::from([("stable-1".to_string(), 10), ("stable-2".to_string(), 10)]),
        "fallback any: every other instance"
    );
    let e = within("fail", fail.who()).await.expect_err("fallback fail");
    assert_eq!(e.code(), StatusCode::NotFindServiceRoute, "{e}");
    assert_eq!(
        e.message(),
        "rt.Who.who: routing rule \"canary-or-fail\" sends this call to instances tagged \
         version=canary, and none is live (2 instance(s) of rt.Who registered, none tagged \
         so); the rule's fallback is \"fail\": start an instance with those tags, or set \
         fallback = \"any\""
    );
    stop(servers).await;
}

#[tokio::test]
async fn the_call_span_names_the_rule_that_chose_and_the_fallback() {
    let (traces, _guard) = Traces::install();
    let (client, servers) = routed(
        r#"
[[routes]]
name = "beta-or-any"
service = "rt.Who"
when = { attachment = "tenant", equals = "beta" }
to = [ { tags = { version = "beta" } } ]

[[routes]]
name = "canary-only"
service = "rt.Who"
to = [ { tags = { version = "canary" } } ]
"#,
    )
    .await;
    let who = WhoClient::new(client.clone());
    assert_eq!(within("routed", who.who()).await.expect("call"), "canary-1");
    let beta = RpcContext::with_attachment("tenant", "beta", who.who());
    within("fallback", beta).await.expect("call");
    within("unrouted", OtherClient::new(client).who())
        .await
        .expect("call");

    let spans = traces.spans();
    let calls: Vec<_> = spans.iter().filter(|s| s.name == "rpc.client").collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    let field = |i: usize, key: &str| attr(calls[i], key).map(|v| v.as_str().into_owned());
    assert_eq!(field(0, "rpc.route").as_deref(), Some("canary-only"));
    assert_eq!(
        field(0, "rpc.route.group").as_deref(),
        Some("version=canary")
    );
    assert_eq!(field(0, "rpc.route.fallback"), None);
    assert_eq!(field(1, "rpc.route").as_deref(), Some("beta-or-any"));
    assert_eq!(field(1, "rpc.route.group").as_deref(), Some("version=beta"));
    assert_eq!(field(1, "rpc.route.fallback").as_deref(), Some("any"));
    assert_eq!(field(2, "rpc.entry_id").as_deref(), Some("rt.Other.who"));
    assert_eq!(field(2, "rpc.route"), None, "no rule routes rt.Other");
    stop(servers).await;
}

#[tokio::test]
async fn a_group_whose_instances_this_client_marked_unhealthy_has_no_live_instance() {
    let _traced = traced();
    let (registry, servers) = fleet().await;
    // A canary instance is registered, but nobody listens at its address.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .to_string();
    let mut ghost = rpc::Instance::new(dead.clone(), ["rt.Who"]);
    ghost.metadata.insert("version".into(), "beta".into());
    rpc::Registry::register(&registry, ghost)
        .await
        .expect("register");
    let rules = |fallback: &str| {
        format!(
            "[[routes]]\nname = \"beta-or-{fallback}\"\nservice = \"rt.Who\"\n\
             to = [ {{ tags = {{ version = \"beta\" }} }} ]\nfallback = \"{fallback}\"\n"
        )
    };
    for fallback in ["any", "fail"] {
        let who = WhoClient::new(client(&registry, &rules(fallback)));
        // The group's one instance is live until this client fails to reach it: the first
        // call goes there (and only there) and fails.
        let first = within("first", who.who())
            .await
            .expect_err("nobody listens");
        assert_eq!(first.code(), StatusCode::CommunicationError, "{first}");
        assert!(first.message().contains(&dead), "{first}");
        // Marked unhealthy now: the group has no live instance.
        let second = within("second", who.who()).await;
        match fallback {
            // Any instance of the service: a live one, since the balancer ranks the marked
            // one last.
            "any" => {
                let name = second.expect("any instance");
                assert!(
                    ["canary-1", "stable-1", "stable-2"].contains(&name.as_str()),
                    "{name}"
                );
            }
            _ => {
                let e = second.expect_err("fallback fail");
                assert_eq!(e.code(), StatusCode::NotFindServiceRoute, "{e}");
                assert!(
                    e.message().contains(
                        "routing rule \"beta-or-fail\" sends this call to instances tagged \
                         version=beta, and none is live (its 1 instance(s) are marked \
                         unhealthy or removed by this client)"
                    ),
                    "{e}"
                );
            }
        }
    }
    stop(servers).await;
}
