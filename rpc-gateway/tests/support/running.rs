//! A real gateway in front of a real server, for the integration tests that call it over HTTP.
//!
//! Why shared: the documentation page test and the OpenAPI validator test both need the same
//! setup (a server on an in-process registry, a gateway following that registry, served on a
//! free loopback port once it serves the entries the test will use), and a wait written once is
//! bounded the same way everywhere. Include it with `#[path = "support/running.rs"] mod running;`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rpc::{Client, InProcessRegistry, Registry, ServerBuilder, ServerHandle};
use rpc_gateway::Gateway;

/// How long the gateway may take to serve the wanted entries: far above what it takes on a
/// loaded two-core machine, so a failure means it never got there.
pub const SERVED_WITHIN: Duration = Duration::from_secs(30);

/// A running gateway, its server, and where it answers.
pub struct Running {
    /// The gateway's address (HTTP on 127.0.0.1).
    pub addr: SocketAddr,
    /// The gateway being served (a handle onto the same routes).
    pub gateway: Gateway,
    /// The server behind it, stopped when this is dropped.
    pub server: ServerHandle,
}

/// Serves `server` (its services added, not yet serving) on a fresh in-process registry, and a
/// gateway over that registry (checking `token` when given) on a free loopback port, once it
/// serves every entry of `wanted` (at most [`SERVED_WITHIN`]).
pub async fn running(server: ServerBuilder, token: Option<&str>, wanted: &[&str]) -> Running {
    let registry: Arc<dyn Registry> = Arc::new(InProcessRegistry::new());
    let server = server
        .shared_registry(registry.clone())
        .serve("127.0.0.1:0")
        .await
        .expect("the server");
    let mut gateway = Gateway::builder()
        .client(Client::builder().shared_registry(registry.clone()).build())
        .registry(registry);
    if let Some(token) = token {
        gateway = gateway.token(token);
    }
    let gateway = gateway.build().await.expect("the gateway");
    assert!(
        gateway
            .wait_until(SERVED_WITHIN, |entries| wanted
                .iter()
                .all(|id| entries.iter().any(|e| e.id.as_str() == *id)))
            .await,
        "the gateway never served {wanted:?}"
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(gateway.clone().serve(listener));
    Running {
        addr,
        gateway,
        server,
    }
}
