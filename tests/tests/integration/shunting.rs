//! Shunt strategies over three real servers: polling, hash, random, appoint.

use crate::common;

use std::collections::BTreeMap;
use std::process::Command;

use common::within;
use rpc::{
    answered_by, Client, GovernanceOverrides, InProcessRegistry, Server, ServerHandle,
    ShuntStrategy, StatusCode,
};
use tests::shunt::{Named, Shunt, ShuntClient, ShuntServer};

/// Three servers named s0, s1, s2 on one registry, and the address of each name.
async fn three(reg: &InProcessRegistry) -> (Vec<ServerHandle>, BTreeMap<String, String>) {
    named(reg, 3).await
}

async fn stop(servers: Vec<ServerHandle>) {
    for s in servers {
        within("shutdown", s.shutdown()).await;
    }
}

#[tokio::test]
async fn polling_spreads_calls_exactly_evenly_in_order() {
    let reg = InProcessRegistry::new();
    let (servers, addr_of) = three(&reg).await;
    let shunt = ShuntClient::new(Client::builder().registry(reg.clone()).build());

    let mut seq = Vec::new();
    for _ in 0..30 {
        let (r, by) = answered_by(shunt.whoami()).await;
        let name = r.expect("whoami");
        assert_eq!(
            by.as_deref(),
            Some(addr_of[&name].as_str()),
            "answered_by names the server that answered"
        );
        seq.push(name);
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &seq {
        *counts.entry(n).or_default() += 1;
    }
    assert_eq!(
        counts,
        BTreeMap::from([("s0", 10), ("s1", 10), ("s2", 10)]),
        "{seq:?}"
    );
    for i in 3..seq.len() {
        assert_eq!(seq[i], seq[i - 3], "round robin is a strict cycle: {seq:?}");
    }
    stop(servers).await;
}

/// Two entries of one service called in turn each spread over every server: a position
/// shared by the service's entries made each keep landing on the same servers (with two
/// servers, every call of one entry on one server and every call of the other on the other).
#[tokio::test]
async fn entries_called_in_turn_each_spread_over_every_server() {
    let reg = InProcessRegistry::new();
    let (servers, _) = named(&reg, 2).await;
    let shunt = ShuntClient::new(Client::builder().registry(reg.clone()).build());
    let mut first: BTreeMap<String, usize> = BTreeMap::new();
    let mut second: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..20 {
        *first
            .entry(within("whoami", shunt.whoami()).await.expect("whoami"))
            .or_default() += 1;
        *second
            .entry(within("whoami_too", shunt.whoami_too()).await.expect("too"))
            .or_default() += 1;
    }
    let even = BTreeMap::from([("s0".to_string(), 10), ("s1".to_string(), 10)]);
    assert_eq!(first, even, "whoami");
    assert_eq!(second, even, "whoami_too");
    stop(servers).await;
}

/// Fresh clients do not all start with the same server: each begins its turns at a random
/// place. (Twelve clients all starting on one of three servers by chance: 3 × 3⁻¹², about
/// one run in 180 000.)
#[tokio::test]
async fn fresh_clients_do_not_all_start_with_the_same_server() {
    let reg = InProcessRegistry::new();
    let (servers, _) = three(&reg).await;
    let mut firsts: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..12 {
        let shunt = ShuntClient::new(Client::builder().registry(reg.clone()).build());
        let name = within("whoami", shunt.whoami()).await.expect("whoami");
        *firsts.entry(name).or_default() += 1;
    }
    assert!(firsts.len() > 1, "every fresh client began with {firsts:?}");
    stop(servers).await;
}

/// Servers named s0.. s{n-1} on one registry, and the address of each name.
async fn named(reg: &InProcessRegistry, n: usize) -> (Vec<ServerHandle>, BTreeMap<String, String>) {
    let mut servers = Vec::new();
    let mut addr_of = BTreeMap::new();
    for i in 0..n {
        let name = format!("s{i}");
        let s = Server::builder()
            .registry(reg.clone())
            .add_service(ShuntServer::new(Named(name.clone())))
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        addr_of.insert(name, s.local_addr().to_string());
        servers.push(s);
    }
    (servers, addr_of)
}

/// Which server answered each key, as seen by a `hash-client` process
/// (`tests/src/bin/hash-client.rs`) given `addresses` in that order.
async fn owners_seen_by_a_process(addresses: &[String], keys: u32) -> BTreeMap<String, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hash-client"));
    cmd.args([addresses.join(","), keys.to_string()]);
    let out = within(
        "hash-client",
        tokio::task::spawn_blocking(move || cmd.output()),
    )
    .await
    .expect("join")
    .expect("run hash-client");
    assert!(
        out.status.success(),
        "hash-client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| {
            let (key, name) = l.split_once(' ').expect("`key name` lines");
            (key.to_string(), name.to_string())
        })
        .collect()
}

// The oracle is the servers' own answers, not the library's ring: two client processes (given
// the servers in opposite orders) and a client in this process must send each key to the same
// server, and the keys must spread over the servers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_maps_a_key_to_the_same_server_from_separate_processes_and_spreads_keys() {
    const SERVERS: usize = 4;
    const KEYS: u32 = 400;
    let reg = InProcessRegistry::new();
    let (servers, addr_of) = named(&reg, SERVERS).await;
    let addresses: Vec<String> = addr_of.values().cloned().collect();
    let mut reversed = addresses.clone();
    reversed.reverse();

    let first = owners_seen_by_a_process(&addresses, KEYS).await;
    let second = owners_seen_by_a_process(&reversed, KEYS).await;
    assert_eq!(first.len(), KEYS as usize, "one answer per key");
    assert_eq!(
        first, second,
        "two client processes sent some key to different servers"
    );

    // A client in this process agrees, and answered_by names the server that answered.
    let here = ShuntClient::new(Client::builder().registry(reg.clone()).build());
    for k in (0..KEYS).step_by(10) {
        let key = format!("key-{k}");
        let (r, by) = answered_by(here.owner(key.clone())).await;
        let name = r.expect("owner");
        assert_eq!(name, first[&key], "{key}");
        assert_eq!(by.as_deref(), Some(addr_of[&name].as_str()));
        for noise in [0, 1, u64::MAX] {
            assert_eq!(
                here.owner_of_second(noise, key.clone())
                    .await
                    .expect("owner_of_second"),
                name,
                "{key}: only the #[hash_key] argument picks the server"
            );
        }
    }

    // Spread: a fair share is 100 keys per server. With the ring's virtual nodes and 400 keys
    // a server's count varies by about 12 % of that; outside 50..=150 the ring is broken, not
    // unlucky (a ring without virtual nodes gives one server over half the keys most times).
    let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
    for name in first.values() {
        *counts.entry(name).or_default() += 1;
    }
    let fair = KEYS / SERVERS as u32;
    assert_eq!(counts.len(), SERVERS, "every server owns keys: {counts:?}");
    assert!(
        counts.values().all(|&c| c >= fair / 2 && c <= fair * 3 / 2),
        "keys are spread unevenly: {counts:?}"
    );
    stop(servers).await;
}

#[tokio::test]
async fn random_reaches_every_server_and_is_not_round_robin() {
    let reg = InProcessRegistry::new();
    let (servers, _) = three(&reg).await;
    let shunt = ShuntClient::new(
        Client::builder()
            .registry(reg.clone())
            .shunt_strategy(ShuntStrategy::Random)
            .build(),
    );
    let mut seq = Vec::new();
    for _ in 0..300 {
        seq.push(shunt.whoami().await.expect("whoami"));
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &seq {
        *counts.entry(n).or_default() += 1;
    }
    assert_eq!(counts.len(), 3, "every server gets calls: {counts:?}");
    // Mean 100, standard deviation about 8: below 50 is a broken generator, not bad luck.
    assert!(counts.values().all(|&c| c >= 50), "uneven: {counts:?}");
    let cyclic = (3..seq.len()).all(|i| seq[i] == seq[i - 3]);
    let repeats = seq.windows(2).any(|w| w[0] == w[1]);
    assert!(
        !cyclic && repeats,
        "random picks look like round robin: {:?}",
        &seq[..12]
    );
    stop(servers).await;
}

/// An appointed address is a call's only candidate: when it is dead the call fails after one
/// attempt (no failover to the registry's other servers, and no repeating it), and the
/// entry's breaker counts the failures and opens.
#[tokio::test]
async fn a_dead_appointed_address_fails_at_once_and_opens_the_breaker() {
    let reg = InProcessRegistry::new();
    let (servers, _addr_of) = three(&reg).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").to_string()
    };
    let shunt = ShuntClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(
                ShuntClient::SERVICE_ID,
                GovernanceOverrides {
                    shunt_strategy: Some(ShuntStrategy::Appoint),
                    appoint_address: Some(dead.clone().into()),
                    retry_times: Some(3),
                    retry_interval_ms: Some(0),
                    exceptions_allowed_before_breaking: Some(2),
                    breaker_seconds: Some(3600),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    for i in 0..2 {
        let e = within("a call", shunt.whoami())
            .await
            .expect_err("the appointed address is dead");
        assert_eq!(e.code(), StatusCode::CommunicationError, "call {i}: {e}");
        assert_eq!(
            e.message().matches(dead.as_str()).count(),
            1,
            "call {i}: one attempt, on the appointed address: {e}"
        );
    }
    let e = within("a call", shunt.whoami())
        .await
        .expect_err("the breaker is open");
    assert_eq!(e.code(), StatusCode::CircuitOpen, "{e}");
    stop(servers).await;
}

#[tokio::test]
async fn appoint_sends_every_call_to_the_appointed_address() {
    let reg = InProcessRegistry::new();
    let (servers, addr_of) = three(&reg).await;
    let appoint = |name: &str| GovernanceOverrides {
        shunt_strategy: Some(ShuntStrategy::Appoint),
        appoint_address: Some(addr_of[name].clone().into()),
        ..GovernanceOverrides::NONE
    };
    // A service-wide override, and an entry override on top of it for `whoami`.
    let shunt = ShuntClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(ShuntClient::SERVICE_ID, appoint("s1"))
            .build(),
    );
    let layered = ShuntClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(ShuntClient::SERVICE_ID, appoint("s1"))
            .override_options("t.Shunt.whoami", appoint("s2"))
            .build(),
    );
    for i in 0..30 {
        let (r, by) = answered_by(shunt.whoami()).await;
        assert_eq!(r.expect("whoami"), "s1", "call {i}");
        assert_eq!(by.as_deref(), Some(addr_of["s1"].as_str()));
        // The client override outranks the method's `shunt_strategy = "hash"`.
        assert_eq!(
            shunt.owner(format!("k{i}")).await.expect("owner"),
            "s1",
            "call {i}"
        );
        assert_eq!(layered.whoami().await.expect("whoami"), "s2", "call {i}");
        assert_eq!(
            layered.owner(format!("k{i}")).await.expect("owner"),
            "s1",
            "call {i}"
        );
    }
    stop(servers).await;
}

/// `shunt_strategy = appoint` with no address anywhere is the entry's misconfiguration, and
/// its calls are refused with it (naming the entry and the level that asked) before the
/// governance stack: no fallback answers them as if a server could not be reached, which
/// hid the mistake behind answers that succeed (before, the fallback answered every call).
#[tokio::test]
async fn appoint_with_no_address_is_refused_before_any_fallback_answers() {
    let reg = InProcessRegistry::new();
    let (servers, _) = three(&reg).await;
    let file = rpc::crates::governance::config::GovernanceConfig::from_toml(
        "[entries.\"t.Shunt.whoami\"]\nshunt_strategy = \"appoint\"\n",
    )
    .expect("the file parses");
    let client = Client::builder()
        .registry(reg.clone())
        .config_layers(
            file,
            rpc::crates::governance::config::GovernanceConfig::default(),
        )
        .fallback(ShuntServer::new(Named("fallback".into())))
        .build();
    let mut events = client.events().subscribe();
    let e = within("a call", ShuntClient::new(client.clone()).whoami())
        .await
        .expect_err("refused");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message().contains("t.Shunt.whoami")
            && e.message().contains("appoint_address")
            && e.message().contains("config file"),
        "{e}"
    );
    // Asked by a handle's own options: the handle is named.
    let handle = client.with_options(GovernanceOverrides {
        shunt_strategy: Some(ShuntStrategy::Appoint),
        ..GovernanceOverrides::NONE
    });
    let e = within("a call", ShuntClient::new(handle).whoami_too())
        .await
        .expect_err("refused");
    assert!(
        e.message().contains("appoint_address") && e.message().contains("Client::with_options"),
        "{e}"
    );
    let kinds: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    assert!(!kinds.contains(&rpc::EventKind::Fallback), "{kinds:?}");
    stop(servers).await;
}
