//! What a client leaves behind when it is dropped: nothing. Dropping the last clone of a
//! `Client` (or of a `ConnectionPool`) closes its connections, so the server sees them end at
//! once instead of keeping them open for as long as the client's heartbeats arrive, and the
//! connections' tasks end.
//!
//! The server here is a raw TCP listener speaking the wire by hand, so the test sees each
//! connection's end of stream itself (an event, not a count polled against the clock).

use crate::common;

use std::net::SocketAddr;

use common::{recv_one, within};
use rpc::crates::core::wire::{frame::Kind, Pong, RemoteResultMessage};
use rpc::crates::transport::{ConnectOptions, ConnectionPool};
use rpc::{Client, Codec, RpcError, StaticRegistry};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

#[rpc::service(name = "t.Dropped")]
trait Dropped {
    async fn hi(&self) -> Result<String, RpcError>;
}

/// What the raw server saw.
#[derive(Debug, PartialEq)]
enum Seen {
    /// A client completed its handshake.
    Connected,
    /// A connection reached its end of stream: the client closed it.
    Closed,
}

/// A raw server on 127.0.0.1:0: answers the handshake, every call with `"raw"`, every `Ping`
/// with a `Pong`, and reports each handshake and each end of stream.
async fn raw_server() -> (SocketAddr, mpsc::UnboundedReceiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut raw = common::accept_hello(stream, "raw", 1 << 20).await;
                let _ = tx.send(Seen::Connected);
                // `recv` waits at most `common::LIMIT` for each frame: a connection the client
                // forgot stays silent for longer than that only if heartbeats stopped too.
                loop {
                    match raw.recv().await {
                        Some(Kind::Invoke(call)) => {
                            let answer = RemoteResultMessage {
                                message_id: call.message_id,
                                status_code: 200,
                                result: Codec::MsgPack.encode(&"raw").expect("encode"),
                                ..Default::default()
                            };
                            let _ = raw.send(Kind::Result(answer)).await;
                        }
                        Some(Kind::Ping(p)) => {
                            let _ = raw.send(Kind::Pong(Pong { nonce: p.nonce })).await;
                        }
                        Some(_) => {}
                        None => {
                            let _ = tx.send(Seen::Closed);
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// Waits until the runtime runs no more than `tasks` tasks; bounded in turns and in time.
async fn tasks_back_to(tasks: usize) {
    let metrics = tokio::runtime::Handle::current().metrics();
    within("the connections' tasks end", async {
        for _ in 0..10_000 {
            if metrics.num_alive_tasks() <= tasks {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!(
            "{} tasks still alive, expected {tasks}",
            metrics.num_alive_tasks()
        );
    })
    .await;
}

#[tokio::test]
async fn dropping_the_last_client_clone_closes_its_connections_and_ends_their_tasks() {
    let (addr, mut seen) = raw_server().await;
    let baseline = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let client = Client::builder()
        .registry(StaticRegistry::new([addr.to_string()]))
        .connections_per_endpoint(2)
        .build();
    let proxy = DroppedClient::new(client.clone());
    // Two calls: the second turn's slot connects (in the background, the first call's
    // connection taking that call), so the pool holds two connections.
    for _ in 0..2 {
        assert_eq!(within("a call", proxy.hi()).await.expect("answered"), "raw");
    }
    for _ in 0..2 {
        assert_eq!(recv_one("a handshake", &mut seen).await, Seen::Connected);
    }

    // One clone gone: the connections stay (two calls go one on each, in turn: one the drop
    // had closed would be replaced by a new connection, which the server would see).
    drop(client);
    for _ in 0..2 {
        assert_eq!(within("a call", proxy.hi()).await.expect("answered"), "raw");
    }
    assert!(seen.try_recv().is_err(), "a connection closed or opened");

    // The last clone gone: both connections end at once.
    drop(proxy);
    for _ in 0..2 {
        assert_eq!(
            recv_one("the server sees the connection end", &mut seen).await,
            Seen::Closed
        );
    }
    // The raw server's own connection tasks ended with them: only the accept loop is left
    // besides what ran before the client existed.
    tasks_back_to(baseline).await;
}

#[tokio::test]
async fn dropping_the_last_pool_clone_closes_its_connections() {
    let (addr, mut seen) = raw_server().await;
    let baseline = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let pool = ConnectionPool::new(ConnectOptions::default(), 2);
    let addr = addr.to_string();
    let first = within("connect", pool.get(&addr)).await.expect("connect");
    let second = within("connect", pool.get(&addr)).await.expect("connect");
    for _ in 0..2 {
        assert_eq!(recv_one("a handshake", &mut seen).await, Seen::Connected);
    }
    drop((first, second));
    let other = pool.clone();
    drop(pool);
    // Both connections still answer through the clone left, taken in turn (one the drop had
    // closed would fail its call, or be replaced by a new connection, which the server would
    // see as a handshake).
    for _ in 0..2 {
        let conn = within("a pooled connection", other.get(&addr))
            .await
            .expect("still pooled");
        let call = rpc::crates::transport::Call {
            service_entry_id: "t.Dropped.hi".into(),
            ..Default::default()
        };
        let r = within("a call", conn.call(call, None))
            .await
            .expect("answered");
        assert_eq!(r.status_code, 200, "{r:?}");
    }
    assert!(seen.try_recv().is_err(), "a connection closed or opened");
    drop(other);
    for _ in 0..2 {
        assert_eq!(
            recv_one("the server sees the connection end", &mut seen).await,
            Seen::Closed
        );
    }
    tasks_back_to(baseline).await;
}

/// A dropped client leaves no watch of the registry behind: the task that followed a
/// service's changes ends with it (before, it held its watch until the service next changed,
/// which for an etcd or ZooKeeper registry kept a watch open on the server for good).
#[tokio::test]
async fn a_dropped_client_releases_its_registry_watches() {
    let (tx, _) = tokio::sync::watch::channel(rpc::crates::registry::Endpoints::default());
    let client = Client::builder()
        // Its sender sees when every watch of it is dropped.
        .registry(common::registry::TestRegistry::new(
            common::registry::Register::Answers,
            common::registry::Watch::Channel(tx.clone()),
        ))
        .build();
    // A call looks the service up (and fails: no instance).
    let _ = DroppedClient::new(client.clone()).hi().await;
    assert!(tx.receiver_count() > 0, "the client watches the service");
    drop(client);
    within("every watch dropped", tx.closed()).await;
}

/// An instance that leaves the registry while its process lives on: once its connection
/// carries no call, the client closes it (before, it stayed open, pinging, for the client's
/// whole life).
#[tokio::test]
async fn the_idle_connection_to_an_instance_gone_from_the_registry_is_closed() {
    let (addr, mut seen) = raw_server().await;
    let reg = rpc::InProcessRegistry::new();
    rpc::Registry::register(&reg, rpc::Instance::new(addr.to_string(), ["t.Dropped"]))
        .await
        .expect("register");
    let client = Client::builder().registry(reg.clone()).build();
    let dropped = DroppedClient::new(client.clone());
    assert_eq!(within("hi", dropped.hi()).await.expect("hi"), "raw");
    assert_eq!(recv_one("the handshake", &mut seen).await, Seen::Connected);
    rpc::Registry::deregister(&reg, &addr.to_string())
        .await
        .expect("deregister");
    assert_eq!(
        recv_one("the client closes the connection", &mut seen).await,
        Seen::Closed
    );
}
