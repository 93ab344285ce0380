//! Shunt strategies over three real servers: polling, hash, random, appoint.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::within;
use rpc::crates::client::shunt::HashRing;
use rpc::crates::core::stable_hash;
use rpc::{
    answered_by, Client, Codec, GovernanceOverrides, InProcessRegistry, RpcError, Server,
    ServerHandle, ShuntStrategy,
};

#[rpc::service(name = "t.Shunt")]
trait Shunt {
    async fn whoami(&self) -> Result<String, RpcError>;
    #[governance(shunt_strategy = "hash")]
    async fn owner(&self, #[hash_key] key: String) -> Result<String, RpcError>;
    /// The key is the second argument; the first must not move the call.
    #[governance(shunt_strategy = "hash")]
    async fn owner_of_second(
        &self,
        noise: u64,
        #[hash_key] key: String,
    ) -> Result<String, RpcError>;
}

struct Named(String);

impl Shunt for Named {
    async fn whoami(&self) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
    async fn owner(&self, _key: String) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
    async fn owner_of_second(&self, _noise: u64, _key: String) -> Result<String, RpcError> {
        Ok(self.0.clone())
    }
}

/// Three servers named s0, s1, s2 on one registry, and the address of each name.
async fn three(reg: &InProcessRegistry) -> (Vec<ServerHandle>, BTreeMap<String, String>) {
    let mut servers = Vec::new();
    let mut addr_of = BTreeMap::new();
    for i in 0..3 {
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

#[tokio::test]
async fn hash_maps_a_key_to_the_same_server_from_separate_clients() {
    let reg = InProcessRegistry::new();
    let (servers, addr_of) = three(&reg).await;
    let one = ShuntClient::new(Client::builder().registry(reg.clone()).build());
    let two = ShuntClient::new(Client::builder().registry(reg.clone()).build());
    // The documented ring, computed independently: 160 virtual nodes per address, the key
    // hashed as XXH3 of its MessagePack encoding.
    let addrs: Vec<String> = addr_of.values().cloned().collect();
    let ring = HashRing::new(addrs.iter().map(String::as_str));

    let mut owners = BTreeSet::new();
    for k in 0..30 {
        let key = format!("key-{k}");
        let mut seen = Vec::new();
        for proxy in [&one, &two, &one, &two] {
            let (r, by) = answered_by(proxy.owner(key.clone())).await;
            let name = r.expect("owner");
            assert_eq!(by.as_deref(), Some(addr_of[&name].as_str()));
            seen.push(name);
        }
        assert!(
            seen.windows(2).all(|w| w[0] == w[1]),
            "{key} moved between servers: {seen:?}"
        );
        let hash = stable_hash(&Codec::MsgPack.encode(&key).expect("encode key"));
        let expected = &addrs[ring.walk(hash).next().expect("ring is not empty")];
        assert_eq!(
            &addr_of[&seen[0]], expected,
            "{key} is not on the owner the documented ring gives"
        );
        for noise in [0, 1, u64::MAX] {
            assert_eq!(
                one.owner_of_second(noise, key.clone())
                    .await
                    .expect("owner_of_second"),
                seen[0],
                "{key}: only the #[hash_key] argument picks the server"
            );
        }
        owners.insert(seen[0].clone());
    }
    assert!(
        owners.len() >= 2,
        "30 keys should not all land on one server: {owners:?}"
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
