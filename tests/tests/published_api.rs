//! What a server publishes of each entry for an HTTP gateway and an API document: the
//! parameters' names, the doc comment, the `#[http]` route and the stream shape, read back from
//! the registry a real server registered in. A gateway knows only what travels there, so this is
//! the whole contract between `#[rpc::service]` and it.
//!
//! Every expected value below is written out from the trait in this file, not taken from the
//! macro's output.

mod common;

use common::within;
use rpc::{
    EntryApi, HttpRoute, InProcessRegistry, Instance, Registry, RpcError, RpcStream, Server,
    ServiceEntry,
};

#[rpc::service(name = "pa.Orders")]
trait Orders {
    /// Reads one order.
    ///
    ///   Unknown ids answer an error.
    #[http(get = "/orders/{id}")]
    async fn get(&self, id: u64, verbose: bool) -> Result<String, RpcError>;
    #[http(delete = "/orders/{order_id}")]
    async fn cancel(&self, reason: String, order_id: u64) -> Result<(), RpcError>;
    async fn count(&self) -> Result<u64, RpcError>;
    /// Every order from `from` on.
    async fn watch(&self, from: u64) -> Result<RpcStream<u64>, RpcError>;
}

struct Desk;

impl Orders for Desk {
    async fn get(&self, id: u64, verbose: bool) -> Result<String, RpcError> {
        Ok(format!("{id} {verbose}"))
    }
    async fn cancel(&self, _reason: String, _order_id: u64) -> Result<(), RpcError> {
        Ok(())
    }
    async fn count(&self) -> Result<u64, RpcError> {
        Ok(0)
    }
    async fn watch(&self, from: u64) -> Result<RpcStream<u64>, RpcError> {
        Ok(RpcStream::iter(from..from + 3))
    }
}

/// The one instance registered for `service`, as a client would read it.
async fn published(registry: &InProcessRegistry, service: &str) -> Instance {
    let watch = within("watch", registry.watch(&service.into()))
        .await
        .expect("watch");
    let current = watch.current();
    assert_eq!(current.len(), 1, "one server registered");
    (*current[0]).clone()
}

/// The entry `method` of `instance`.
fn entry<'a>(instance: &'a Instance, method: &str) -> &'a ServiceEntry {
    instance
        .entries
        .iter()
        .find(|e| e.method == method)
        .unwrap_or_else(|| panic!("no entry {method} in {:?}", instance.entries))
}

fn api<'a>(instance: &'a Instance, method: &str) -> &'a EntryApi {
    entry(instance, method)
        .api
        .as_ref()
        .unwrap_or_else(|| panic!("{method} publishes no api"))
}

#[tokio::test]
async fn a_server_publishes_names_docs_routes_and_stream_shapes() {
    let registry = InProcessRegistry::new();
    let server = within(
        "serve",
        Server::builder()
            .registry(registry.clone())
            .add_service(OrdersServer::new(Desk))
            .serve("127.0.0.1:0"),
    )
    .await
    .expect("serve");
    let instance = published(&registry, "pa.Orders").await;
    assert_eq!(instance.entries.len(), 4);

    let get = api(&instance, "get");
    assert_eq!(get.params, ["id", "verbose"]);
    assert_eq!(
        get.doc.as_deref(),
        Some("Reads one order.\n\nUnknown ids answer an error.")
    );
    assert_eq!(
        get.http,
        Some(HttpRoute {
            method: "GET".to_string(),
            path: "/orders/{id}".to_string()
        })
    );
    assert_eq!(get.stream, None);

    // Parameters in declaration order, whatever order the path names them in.
    let cancel = api(&instance, "cancel");
    assert_eq!(cancel.params, ["reason", "order_id"]);
    assert_eq!(cancel.doc, None);
    assert_eq!(
        cancel.http,
        Some(HttpRoute {
            method: "DELETE".to_string(),
            path: "/orders/{order_id}".to_string()
        })
    );

    let count = api(&instance, "count");
    assert!(count.params.is_empty(), "{:?}", count.params);
    assert_eq!(
        (&count.doc, &count.http, &count.stream),
        (&None, &None, &None)
    );

    let watch = api(&instance, "watch");
    assert_eq!(watch.params, ["from"]);
    assert_eq!(watch.doc.as_deref(), Some("Every order from `from` on."));
    assert_eq!(watch.http, None);
    assert_eq!(watch.stream.as_deref(), Some("server"));

    // A remote registry (etcd, ZooKeeper) stores the instance as JSON: all of it comes back.
    let json = serde_json::to_vec(&instance).expect("encode");
    let back: Instance = serde_json::from_slice(&json).expect("decode");
    assert_eq!(back.entries, instance.entries);

    server.shutdown().await;
}
