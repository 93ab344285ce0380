//! Hedging over TCP: an idempotent call whose first endpoint does not answer gets a second
//! attempt on the other endpoint after `hedge_delay_ms`; that answer wins, and the first
//! server is told to stop (Cancel frame): its handler's future is dropped while the client is
//! still connected.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{recv_one, within, DropSignal};
use rpc::{Client, GovernanceOverrides, RpcError, Server, StaticRegistry};
use tokio::sync::mpsc;

#[rpc::service(name = "t.Hedge")]
trait Hedged {
    /// Answers the server's name, or (the stuck server) never answers.
    async fn who(&self) -> Result<String, RpcError>;
}

struct Node {
    name: &'static str,
    stuck: bool,
    calls: Arc<AtomicU64>,
    dropped: mpsc::UnboundedSender<String>,
}

impl Hedged for Node {
    async fn who(&self) -> Result<String, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.stuck {
            let _signal = DropSignal::new(self.name, self.dropped.clone());
            std::future::pending::<()>().await;
        }
        Ok(self.name.to_string())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_answers_for_a_stuck_server_and_the_stuck_server_is_cancelled() {
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel();
    let mut servers = Vec::new();
    let mut calls = Vec::new();
    for (name, stuck) in [("stuck", true), ("quick", false)] {
        let n = Arc::new(AtomicU64::new(0));
        calls.push(n.clone());
        servers.push(
            Server::builder()
                .add_service(HedgedServer::new(Node {
                    name,
                    stuck,
                    calls: n,
                    dropped: dropped_tx.clone(),
                }))
                .serve("127.0.0.1:0")
                .await
                .expect("serve"),
        );
    }
    let client = HedgedClient::new(
        Client::builder()
            .registry(StaticRegistry::new(
                servers.iter().map(|s| s.local_addr().to_string()),
            ))
            .override_options(
                HedgedClient::SERVICE_ID,
                GovernanceOverrides {
                    hedge_delay_ms: Some(50),
                    idempotent: Some(true),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    // Every call answers from the quick server: directly, or by the hedge of a first attempt
    // on the stuck one (which never answers).
    for _ in 0..4 {
        let who = within("a hedged call", client.who())
            .await
            .expect("answered");
        assert_eq!(who, "quick");
    }
    let stuck = calls[0].load(Ordering::SeqCst);
    assert!(
        stuck >= 1,
        "the balancer started some call on the stuck server"
    );
    assert_eq!(
        calls[1].load(Ordering::SeqCst),
        4,
        "each call answered once by the quick one"
    );
    // Each losing attempt was cancelled: the stuck server dropped its handler, with the
    // client still alive and connected.
    for _ in 0..stuck {
        assert_eq!(
            recv_one("a stuck handler dropped", &mut dropped).await,
            "stuck"
        );
    }
    drop(client);
}
