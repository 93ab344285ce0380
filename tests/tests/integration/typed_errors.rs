//! A typed error can carry an infrastructure failure: A → B → C with C down, B answers its
//! typed error holding C's failure, and A's governance sees an outage (breaker, fallback), while
//! a business variant still travels as 1000 and is not counted.

use crate::common;

use common::within;
use rpc::crates::governance::breaker::BreakerState;
use rpc::{
    Client, GovernanceOverrides, InProcessRegistry, RpcError, Server, StaticRegistry, StatusCode,
};
use serde::{Deserialize, Serialize};

#[rpc::service(name = "te.Stock")]
trait Stock {
    async fn reserve(&self, item: String) -> Result<u32, RpcError>;
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum OrderError {
    /// The service's business answer.
    OutOfStock { item: String },
    /// A failed call of the service's own: travels with that failure's status.
    Rpc(#[serde(with = "rpc::serde_rpc_error")] RpcError),
}

impl From<RpcError> for OrderError {
    fn from(e: RpcError) -> Self {
        OrderError::Rpc(e)
    }
}

#[rpc::service(name = "te.Orders")]
trait Orders {
    async fn place(&self, item: String, qty: u32) -> Result<u32, OrderError>;
}

/// B: refuses a zero quantity itself (business), otherwise reserves at C.
struct OrderDesk {
    stock: StockClient,
}

impl Orders for OrderDesk {
    async fn place(&self, item: String, qty: u32) -> Result<u32, OrderError> {
        if qty == 0 {
            return Err(OrderError::OutOfStock { item });
        }
        Ok(self.stock.reserve(item).await? * qty)
    }
}

/// A's fallback for B.
struct Cached;

impl Orders for Cached {
    async fn place(&self, _item: String, _qty: u32) -> Result<u32, OrderError> {
        Ok(4242)
    }
}

fn no_retry_breaker_at(n: u32) -> GovernanceOverrides {
    GovernanceOverrides {
        retry_times: Some(0),
        exceptions_allowed_before_breaking: Some(n),
        ..GovernanceOverrides::NONE
    }
}

#[tokio::test]
async fn a_typed_error_carrying_a_downstream_outage_is_an_outage_for_the_caller() {
    // C: an address nobody listens on.
    let c_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").to_string()
    };
    let b_client = Client::builder()
        .registry(StaticRegistry::new([c_addr.clone()]))
        .override_options(StockClient::SERVICE_ID, no_retry_breaker_at(100))
        .build();
    let reg = InProcessRegistry::new();
    let b = Server::builder()
        .registry(reg.clone())
        .add_service(OrdersServer::new(OrderDesk {
            stock: StockClient::new(b_client),
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve B");

    let a = Client::builder()
        .registry(reg.clone())
        .override_options(OrdersClient::SERVICE_ID, no_retry_breaker_at(3))
        .build();
    let orders = OrdersClient::new(a.clone());
    let place = OrdersClient::methods()
        .iter()
        .find(|m| m.method == "place")
        .expect("place");

    // Business answers: travel as 1000, the typed value intact, the breaker counts none.
    for _ in 0..5 {
        let e = within("business call", orders.place("nut".into(), 0))
            .await
            .expect_err("qty 0 is refused");
        assert_eq!(e, OrderError::OutOfStock { item: "nut".into() });
    }
    assert_eq!(a.breaker_state(place), BreakerState::Closed { failures: 0 });

    // C is down: A receives B's typed error holding C's failure as it was in B.
    let e = within("call while C is down", orders.place("nut".into(), 2))
        .await
        .expect_err("C is down");
    let OrderError::Rpc(inner) = e else {
        panic!("expected the carried failure, got {e:?}")
    };
    assert_eq!(inner.code(), StatusCode::CommunicationError, "{inner}");
    assert_eq!(inner.tried(), [c_addr.as_str()], "{inner}");
    // A's breaker counted it as a failure of B's entry.
    assert_eq!(a.breaker_state(place), BreakerState::Closed { failures: 1 });

    // The status on the wire, seen without the typed decoding: 504, not 1000.
    let raw = a
        .invoke(
            place,
            rpc::Codec::MsgPack.encode(&("nut", 2u32)).expect("encode"),
            None::<fn() -> u64>,
        )
        .await
        .expect_err("C is down");
    assert_eq!(raw.code().as_u32(), 504, "{raw}");
    assert_eq!(a.breaker_state(place), BreakerState::Closed { failures: 2 });

    // A client with a fallback for B: the fallback answers for the outage, not for business.
    let with_fallback = OrdersClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(OrdersClient::SERVICE_ID, no_retry_breaker_at(3))
            .fallback(OrdersServer::new(Cached))
            .build(),
    );
    assert_eq!(
        within("outage, fallback", with_fallback.place("nut".into(), 2)).await,
        Ok(4242)
    );
    assert_eq!(
        within(
            "business, no fallback",
            with_fallback.place("nut".into(), 0)
        )
        .await,
        Err(OrderError::OutOfStock { item: "nut".into() })
    );
    within("shutdown", b.shutdown()).await;
}

/// B′: the same order desk with the plain `RpcError` as its error type, counting its runs.
#[rpc::service(name = "te.PlainOrders")]
trait PlainOrders {
    async fn place(&self, item: String) -> Result<u32, RpcError>;
}

struct PlainDesk {
    stock: StockClient,
    runs: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl PlainOrders for PlainDesk {
    async fn place(&self, item: String) -> Result<u32, RpcError> {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // C is down: its 506 is passed on with `?`, after the order may have been written.
        self.stock.reserve(item).await
    }
}

/// Two instances of B′ whose handlers pass C's connection failure on with `?`, and A calling
/// them with two retries: the handler ran, so A must not run a non-idempotent `place` again
/// on the other instance (before, C's 506 read as "B was never reached" and was retried).
#[tokio::test]
async fn a_downstream_failure_passed_on_as_a_plain_rpc_error_is_not_replayed() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let c_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").to_string()
    };
    let runs = std::sync::Arc::new(AtomicU32::new(0));
    let reg = InProcessRegistry::new();
    let mut servers = Vec::new();
    for _ in 0..2 {
        let stock = StockClient::new(
            Client::builder()
                .registry(StaticRegistry::new([c_addr.clone()]))
                .override_options(StockClient::SERVICE_ID, no_retry_breaker_at(100))
                .build(),
        );
        servers.push(
            Server::builder()
                .registry(reg.clone())
                .add_service(PlainOrdersServer::new(PlainDesk {
                    stock,
                    runs: runs.clone(),
                }))
                .serve("127.0.0.1:0")
                .await
                .expect("serve B′"),
        );
    }
    let retrying = |idempotent: bool| {
        PlainOrdersClient::new(
            Client::builder()
                .registry(reg.clone())
                .override_options(
                    PlainOrdersClient::SERVICE_ID,
                    GovernanceOverrides {
                        retry_times: Some(2),
                        retry_interval_ms: Some(0),
                        exceptions_allowed_before_breaking: Some(100),
                        idempotent: Some(idempotent),
                        ..GovernanceOverrides::NONE
                    },
                )
                .build(),
        )
    };

    let e = within("non-idempotent", retrying(false).place("nut".into()))
        .await
        .expect_err("C is down");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "run once, not replayed: {e}"
    );
    assert_eq!(
        e.code().as_u32(),
        504,
        "B was reached; its dependency was not: {e}"
    );
    assert!(e.is_maybe_delivered(), "{e:?}");
    assert!(
        e.message().contains("connect failed"),
        "C's failure, told: {e}"
    );

    // An idempotent entry may run again: once per attempt, 1 + 2 retries.
    runs.store(0, Ordering::SeqCst);
    within("idempotent", retrying(true).place("nut".into()))
        .await
        .expect_err("C is down");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    for s in servers {
        within("shutdown", s.shutdown()).await;
    }
}
