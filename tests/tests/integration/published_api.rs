//! What a server publishes of each entry for an HTTP gateway and an API document: the
//! parameters' names, the doc comment, the `#[http]` route, the stream shape and the JSON
//! Schemas of the parameters, the result and the typed error, read back from the registry a
//! real server registered in. A gateway knows only what travels there, so this is
//! the whole contract between `#[rpc::service]` and it.
//!
//! Every expected value below is written out from the trait in this file, not taken from the
//! macro's output.

use crate::common;

use common::within;
use rpc::schemars::JsonSchema;
use rpc::{
    EntryApi, EntrySchemas, HttpRoute, InProcessRegistry, Instance, Registry, RpcError, RpcStream,
    Server, ServiceEntry,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[rpc::service(name = "pa.Orders")]
trait Orders {
    /// Reads one order.
    ///
    ///   Unknown ids answer an error.
    #[http(get = "/orders/{id}")]
    async fn get(&self, id: u64, verbose: bool) -> Result<String, RpcError>;
    #[http(delete = "/orders/{order_id}/cancel")]
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

/// What a caller sends to place an order.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(crate = "rpc::schemars")]
struct NewOrder {
    item: String,
    qty: u32,
    note: Option<String>,
}

/// A placed order.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(crate = "rpc::schemars")]
struct Order {
    id: u64,
    item: String,
    qty: u32,
}

/// The shop's typed error.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(crate = "rpc::schemars")]
enum OrderError {
    OutOfStock { item: String },
    Call(String),
}

impl From<RpcError> for OrderError {
    fn from(e: RpcError) -> Self {
        OrderError::Call(e.to_string())
    }
}

/// A type that implements no `JsonSchema`: it is still served, with the schema `true`.
#[derive(Debug, Serialize, Deserialize)]
struct Blob(Vec<u8>);

#[rpc::service(name = "pa.Shop")]
trait Shop {
    /// Places an order.
    #[http(post = "/orders")]
    async fn place(&self, order: NewOrder) -> Result<Order, OrderError>;
    #[http(get = "/orders/{id}")]
    async fn get(&self, id: u64) -> Result<Order, OrderError>;
    async fn list(&self, from: u64, limit: u32) -> Result<Vec<Order>, RpcError>;
    #[http(delete = "/orders/{id}")]
    async fn cancel(&self, id: u64, reason: String) -> Result<(), OrderError>;
    async fn raw(&self, blob: Blob) -> Result<Blob, RpcError>;
}

struct Counter;

impl Shop for Counter {
    async fn place(&self, order: NewOrder) -> Result<Order, OrderError> {
        Ok(Order {
            id: 1,
            item: order.item,
            qty: order.qty,
        })
    }
    async fn get(&self, id: u64) -> Result<Order, OrderError> {
        Err(OrderError::OutOfStock {
            item: id.to_string(),
        })
    }
    async fn list(&self, _from: u64, _limit: u32) -> Result<Vec<Order>, RpcError> {
        Ok(Vec::new())
    }
    async fn cancel(&self, _id: u64, _reason: String) -> Result<(), OrderError> {
        Ok(())
    }
    async fn raw(&self, blob: Blob) -> Result<Blob, RpcError> {
        Ok(blob)
    }
}

/// Starts a server of `service` alone on a fresh in-process registry, and reads back the one
/// instance it registered under `service_id`, as a client would read it.
/// A receipt: the till writes its total, and reads none.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(crate = "rpc::schemars")]
struct Receipt {
    id: u64,
    #[serde(skip_deserializing)]
    total: u64,
    note: Option<String>,
}

#[rpc::service(name = "pa.Till")]
trait Till {
    async fn ring(&self, receipt: Receipt) -> Result<Receipt, RpcError>;
}

struct Register;

impl Till for Register {
    async fn ring(&self, receipt: Receipt) -> Result<Receipt, RpcError> {
        Ok(Receipt {
            total: 7,
            ..receipt
        })
    }
}

async fn publish(service: impl rpc::Service, service_id: &str) -> (rpc::ServerHandle, Instance) {
    let registry = InProcessRegistry::new();
    let server = within(
        "serve",
        Server::builder()
            .registry(registry.clone())
            .add_service(service)
            .serve("127.0.0.1:0"),
    )
    .await
    .expect("serve");
    let watch = within("watch", registry.watch(&service_id.into()))
        .await
        .expect("watch");
    let current = watch.current();
    assert_eq!(current.len(), 1, "one server registered");
    (server, (*current[0]).clone())
}

/// The instance as a remote registry (etcd, ZooKeeper) stores it, as JSON: checks that all of
/// it comes back, and returns it.
fn stored_as_json(instance: &Instance) -> Vec<u8> {
    let json = serde_json::to_vec(instance).expect("encode");
    let back: Instance = serde_json::from_slice(&json).expect("decode");
    assert_eq!(back.entries, instance.entries);
    json
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

fn schemas<'a>(instance: &'a Instance, method: &str) -> &'a EntrySchemas {
    api(instance, method)
        .schemas
        .as_ref()
        .unwrap_or_else(|| panic!("{method} publishes no schemas"))
}

/// The names of a definition's properties and its required list, each sorted.
fn fields(definition: &Value) -> (Vec<String>, Vec<String>) {
    let mut properties: Vec<String> = definition["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("no properties in {definition}"))
        .keys()
        .cloned()
        .collect();
    properties.sort();
    let mut required: Vec<String> = definition["required"]
        .as_array()
        .unwrap_or_else(|| panic!("no required list in {definition}"))
        .iter()
        .map(|v| v.as_str().expect("a name").to_string())
        .collect();
    required.sort();
    (properties, required)
}

/// Every `$ref` under `value`.
fn refs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("$ref", Value::String(r)) => out.push(r.clone()),
                    _ => refs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn a_server_publishes_names_docs_routes_and_stream_shapes() {
    let (server, instance) = publish(OrdersServer::new(Desk), "pa.Orders").await;
    assert_eq!(instance.entries.len(), 4);

    let get = api(&instance, "get");
    assert_eq!(get.params, ["id", "verbose"]);
    assert_eq!(
        get.doc.as_deref(),
        // As rustdoc reads it: the indentation the lines share is dropped, a line's own kept.
        Some("Reads one order.\n\n  Unknown ids answer an error.")
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
            path: "/orders/{order_id}/cancel".to_string()
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
    stored_as_json(&instance);

    server.shutdown().await;
}

#[tokio::test]
async fn schemas_of_types_with_json_schema_are_references_into_the_definitions() {
    let (server, instance) = publish(ShopServer::new(Counter), "pa.Shop").await;

    let place = schemas(&instance, "place");
    assert_eq!(
        place.params,
        [json!({"$ref": "#/components/schemas/NewOrder"})]
    );
    assert_eq!(place.result, json!({"$ref": "#/components/schemas/Order"}));
    assert_eq!(
        place.error,
        Some(json!({"$ref": "#/components/schemas/OrderError"}))
    );
    // The definitions hold the structs as written above: every field, and the fields a caller
    // must send (all but the `Option`).
    let mut names: Vec<&String> = place.definitions.keys().collect();
    names.sort();
    assert_eq!(names, ["NewOrder", "Order", "OrderError"]);
    let strings = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        fields(&place.definitions["NewOrder"]),
        (strings(&["item", "note", "qty"]), strings(&["item", "qty"]))
    );
    assert_eq!(
        fields(&place.definitions["Order"]),
        (
            strings(&["id", "item", "qty"]),
            strings(&["id", "item", "qty"])
        )
    );
    assert_eq!(place.definitions["NewOrder"]["type"], "object");
    // The error enum's schema names both variants.
    let error = place.definitions["OrderError"].to_string();
    assert!(
        error.contains("OutOfStock") && error.contains("Call"),
        "{error}"
    );

    // Plain types are inline; the framework's own error has no schema.
    let list = schemas(&instance, "list");
    assert_eq!(
        list.params,
        [
            json!({"type": "integer", "format": "uint64", "minimum": 0}),
            json!({"type": "integer", "format": "uint32", "minimum": 0})
        ]
    );
    assert_eq!(
        list.result,
        json!({"type": "array", "items": {"$ref": "#/components/schemas/Order"}})
    );
    assert_eq!(list.error, None);

    // Every reference of every entry resolves in that entry's own definitions (and there are
    // references to resolve: `list` answers a list of `Order`).
    let mut checked = 0;
    for entry in &instance.entries {
        let s = schemas(&instance, &entry.method);
        let mut found = Vec::new();
        s.params.iter().for_each(|p| refs(p, &mut found));
        refs(&s.result, &mut found);
        if let Some(e) = &s.error {
            refs(e, &mut found);
        }
        s.definitions.values().for_each(|d| refs(d, &mut found));
        for r in found {
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{r} is not a component reference"));
            assert!(
                s.definitions.contains_key(name),
                "{}: {r} is not among {:?}",
                entry.method,
                s.definitions.keys()
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "no reference was found to resolve");
    server.shutdown().await;
}

#[tokio::test]
async fn a_type_without_json_schema_publishes_any_value() {
    let (server, instance) = publish(ShopServer::new(Counter), "pa.Shop").await;
    let raw = schemas(&instance, "raw");
    assert_eq!(raw.params, [Value::Bool(true)]);
    assert_eq!(raw.result, Value::Bool(true));
    assert_eq!(raw.error, None);
    assert!(raw.definitions.is_empty(), "{:?}", raw.definitions);
    server.shutdown().await;
}

#[tokio::test]
async fn the_published_instance_stays_small_enough_for_a_registry_value() {
    let (server, instance) = publish(ShopServer::new(Counter), "pa.Shop").await;
    assert_eq!(instance.entries.len(), 5);
    let json = stored_as_json(&instance);
    // A sanity bound well under etcd's default request limit (1.5 MiB): the schemas are
    // published once per entry, so a service's size grows with its entries and their types.
    println!(
        "published instance of pa.Shop (5 entries): {} bytes of JSON",
        json.len()
    );
    assert!(json.len() < 64 * 1024, "{} bytes", json.len());
    server.shutdown().await;
}

/// A parameter is described as the server reads it and a result as it writes it: the
/// receipt's `total` is never read (not a parameter's property) and always written (a
/// required property of the result), and `note`, which a caller may leave out, is always
/// written too.
#[tokio::test]
async fn a_result_is_described_as_the_server_writes_it() {
    let (server, instance) = publish(TillServer::new(Register), "pa.Till").await;
    let ring = schemas(&instance, "ring");
    let path = "#/components/schemas/";
    assert_eq!(ring.params, [json!({"$ref": format!("{path}Receipt")})]);
    assert_eq!(ring.result, json!({"$ref": format!("{path}Receipt.out")}));
    let strings = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    assert_eq!(
        fields(&ring.definitions["Receipt"]),
        (strings(&["id", "note"]), strings(&["id"]))
    );
    assert_eq!(
        fields(&ring.definitions["Receipt.out"]),
        (
            strings(&["id", "note", "total"]),
            strings(&["id", "note", "total"])
        )
    );
    server.shutdown().await;
}
