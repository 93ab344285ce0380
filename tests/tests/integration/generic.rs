//! Calls by entry id with JSON arguments (`Client::invoke_json`), over TCP against a real
//! `#[rpc::service]` server, with no compiled proxy on the calling side: structs, maps and
//! typed errors cross as JSON, an unknown entry is refused with the list of what the service
//! publishes, arguments that are not an array are refused before anything is sent, and the
//! governance the server publishes applies to the call.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::within;
use rpc::crates::client::error_body;
use rpc::crates::governance::breaker::BreakerState;
use rpc::{Client, InProcessRegistry, RpcError, Server, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Order {
    item: String,
    notes: Vec<String>,
    gift: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    item: String,
    quantity: u32,
    total_cents: i64,
    /// Integer keys: MessagePack keeps them as integers, JSON writes them as strings.
    lines: BTreeMap<u32, String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum ShopError {
    OutOfStock { item: String, left: u32 },
    Rpc(#[serde(with = "rpc::serde_rpc_error")] RpcError),
}

impl From<RpcError> for ShopError {
    fn from(e: RpcError) -> Self {
        ShopError::Rpc(e)
    }
}

#[rpc::service(name = "gen.Shop")]
pub trait Shop {
    async fn place(&self, order: Order, quantity: u32) -> Result<Receipt, ShopError>;
    /// Fails on the server every time; the service publishes a breaker that opens at once.
    #[governance(exceptions_allowed_before_breaking = 1, retry_times = 0)]
    async fn fragile(&self) -> Result<(), RpcError>;
    async fn ping(&self) -> Result<String, RpcError>;
}

#[derive(Default)]
struct Till {
    calls: AtomicU32,
}

impl Shop for Arc<Till> {
    async fn place(&self, order: Order, quantity: u32) -> Result<Receipt, ShopError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if quantity > 10 {
            return Err(ShopError::OutOfStock {
                item: order.item,
                left: 10,
            });
        }
        let lines = order
            .notes
            .iter()
            .enumerate()
            .map(|(i, n)| (i as u32 + 1, n.to_uppercase()))
            .collect();
        Ok(Receipt {
            total_cents: 250 * i64::from(quantity),
            item: order.item,
            quantity,
            lines,
        })
    }

    async fn fragile(&self) -> Result<(), RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Err(RpcError::new(StatusCode::ServerError, "always broken"))
    }

    async fn ping(&self) -> Result<String, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok("pong".into())
    }
}

async fn shop() -> (rpc::ServerHandle, Arc<Till>, Client) {
    let registry = InProcessRegistry::new();
    let till = Arc::new(Till::default());
    let server = Server::builder()
        .registry(registry.clone())
        .add_service(ShopServer::new(till.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder().registry(registry).build();
    (server, till, client)
}

#[tokio::test]
async fn structs_and_maps_cross_as_json_both_ways() {
    let (server, till, client) = shop().await;
    let answer = within(
        "place",
        client.invoke_json(
            "gen.Shop.place",
            json!([{ "item": "tea", "notes": ["green", "loose"], "gift": null }, 3]),
        ),
    )
    .await
    .expect("the call succeeds");
    // The oracle: the receipt the handler builds, written out as JSON by hand.
    assert_eq!(
        answer,
        json!({
            "item": "tea", "quantity": 3, "total_cents": 750,
            "lines": { "1": "GREEN", "2": "LOOSE" }
        })
    );
    assert_eq!(till.calls.load(Ordering::SeqCst), 1);
    let pong = within("ping", client.invoke_json("gen.Shop.ping", json!([])))
        .await
        .expect("ping");
    assert_eq!(pong, json!("pong"));
    server.shutdown().await;
}

#[tokio::test]
async fn a_typed_error_comes_back_with_its_status_and_its_value_as_json() {
    let (server, _till, client) = shop().await;
    let e = within(
        "place",
        client.invoke_json(
            "gen.Shop.place",
            json!([{ "item": "tea", "notes": [], "gift": true }, 11]),
        ),
    )
    .await
    .expect_err("11 is more than the shop has");
    assert_eq!(e.code(), StatusCode::BusinessError, "{e}");
    assert_eq!(
        error_body(&e),
        Some(json!({ "OutOfStock": { "item": "tea", "left": 10 } })),
        "{e}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn an_unknown_entry_is_refused_with_what_the_service_publishes() {
    let (server, till, client) = shop().await;
    let e = within("typo", client.invoke_json("gen.Shop.plaec", json!([])))
        .await
        .expect_err("no such entry");
    assert_eq!(e.code(), StatusCode::NotFindServiceEntry, "{e}");
    assert_eq!(
        e.message(),
        "gen.Shop.plaec is not an entry of gen.Shop: its instances publish gen.Shop.fragile, \
         gen.Shop.ping, gen.Shop.place"
    );
    let e = within("no service", client.invoke_json("gen.Nowhere.x", json!([])))
        .await
        .expect_err("no such service");
    assert_eq!(e.code(), StatusCode::NotFindServiceRoute, "{e}");
    assert!(e.message().contains("no instance of gen.Nowhere"), "{e}");
    assert_eq!(till.calls.load(Ordering::SeqCst), 0, "nothing was sent");
    server.shutdown().await;
}

#[tokio::test]
async fn arguments_that_are_not_an_array_are_refused_before_anything_is_sent() {
    let (server, till, client) = shop().await;
    for args in [
        json!({ "order": {}, "quantity": 1 }),
        json!("tea"),
        json!(null),
    ] {
        let e = within("call", client.invoke_json("gen.Shop.ping", args.clone()))
            .await
            .expect_err("not an array");
        assert_eq!(e.code(), StatusCode::ValidateError, "{args}: {e}");
        assert!(e.message().contains("must be a JSON array"), "{e}");
    }
    assert_eq!(till.calls.load(Ordering::SeqCst), 0, "nothing was sent");
    server.shutdown().await;
}

#[tokio::test]
async fn the_governance_the_server_publishes_applies_to_calls_by_id() {
    let (server, till, client) = shop().await;
    // The server publishes `exceptions_allowed_before_breaking = 1` for `fragile` (the default
    // is 3): its first failure opens the breaker, so the second call fails fast without
    // reaching the server.
    let first = within("first", client.invoke_json("gen.Shop.fragile", json!([])))
        .await
        .expect_err("broken");
    assert_eq!(first.code(), StatusCode::ServerError, "{first}");
    let second = within("second", client.invoke_json("gen.Shop.fragile", json!([])))
        .await
        .expect_err("breaker open");
    assert_eq!(second.code(), StatusCode::CircuitOpen, "{second}");
    assert_eq!(
        till.calls.load(Ordering::SeqCst),
        1,
        "the second never left"
    );
    let breakers = client.breakers();
    let state = breakers
        .iter()
        .find(|(id, _)| id.as_str() == "gen.Shop.fragile")
        .map(|(_, s)| *s);
    assert!(
        matches!(state, Some(BreakerState::Open { .. })),
        "{breakers:?}"
    );
    server.shutdown().await;
}

#[rpc::service(name = "gen.Shard")]
pub trait Shard {
    async fn owner(&self, #[hash_key] user: u64, note: String) -> Result<String, RpcError>;
}

struct Owner(&'static str);

impl Shard for Owner {
    async fn owner(&self, _user: u64, _note: String) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

#[tokio::test]
async fn under_hashing_a_call_by_id_goes_where_the_proxy_sends_the_same_key() {
    let registry = InProcessRegistry::new();
    let mut servers = Vec::new();
    for name in ["a", "b", "c"] {
        servers.push(
            Server::builder()
                .registry(registry.clone())
                .add_service(ShardServer::new(Owner(name)))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    let client = Client::builder()
        .registry(registry)
        .shunt_strategy(rpc::ShuntStrategy::Hash)
        .build();
    let proxy = ShardClient::new(client.clone());
    let mut owners = std::collections::BTreeSet::new();
    for user in 0..40u64 {
        // The oracle: where the compiled proxy sends the key.
        let expected = within("proxy", proxy.owner(user, "x".into()))
            .await
            .expect("proxy call");
        let by_id = within(
            "by id",
            client.invoke_json("gen.Shard.owner", json!([user, "y"])),
        )
        .await
        .expect("call by id");
        assert_eq!(by_id, json!(expected), "user {user}");
        owners.insert(expected);
    }
    assert_eq!(owners.len(), 3, "the keys spread over every server");
    for s in servers {
        s.shutdown().await;
    }
}

/// Instances that publish nothing (a static list's) serve whatever id a caller names: a
/// client calls at most 1024 such entries by id and refuses the others before keeping
/// anything of them, so a program passing its users' ids on does not grow without end
/// (before, each id left its service's state, its entry's governance and an interned
/// descriptor for good). The entries called before stay callable.
#[tokio::test]
async fn a_client_calls_at_most_1024_unpublished_entries_by_id() {
    const BOUND: usize = 1024;
    let (server, _, _) = shop().await;
    let client = Client::builder()
        .registry(rpc::StaticRegistry::new([server.local_addr().to_string()]))
        .build();
    let call = |id: String| {
        let client = client.clone();
        async move { within("call", client.invoke_json(&id, json!([]))).await }
    };
    for i in 0..BOUND {
        let e = call(format!("gen.Unknown{i}.m")).await.unwrap_err();
        assert_eq!(e.code(), StatusCode::NotFindLocalServiceEntry, "{i}: {e}");
    }
    let e = call("gen.OneMore.m".into()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::NotFindServiceEntry, "{e}");
    assert!(e.message().contains("no instance publishes"), "{e}");
    let e = call("gen.Unknown0.other".into()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::NotFindServiceEntry, "{e}");
    let e = call("gen.Unknown7.m".into()).await.unwrap_err();
    assert_eq!(
        e.code(),
        StatusCode::NotFindLocalServiceEntry,
        "called before: {e}"
    );
    assert_eq!(client.services().len(), BOUND);
    server.shutdown().await;
}
