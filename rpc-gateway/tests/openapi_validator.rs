//! The gateway's OpenAPI document validates with the standard validator.
//!
//! Why a Python tool in a Rust test: "valid OpenAPI 3.1" means what the ecosystem's validators
//! accept, not what this crate believes; `openapi-spec-validator` (PyPI) is the reference one.
//! `scripts/test.sh` installs it when it is missing. The document is written to a temporary file
//! and the validator runs on it as a subprocess; a refusal fails the test with the validator's
//! own message. A broken document is checked to be refused, so a validator that accepts anything
//! (or a wrapper that reports nothing) cannot pass the test.

#[path = "support/entries.rs"]
mod entries;
#[path = "support/running.rs"]
mod running;

use std::path::Path;
use std::process::Command;

use entries::{api, entry, reference, schemas};
use rpc_core::{EntryApi, EntrySchemas, ServiceEntry};
use rpc_gateway::openapi::{document, DocumentInfo};
use running::running;
use serde_json::{json, Value};

/// Validates the file as OpenAPI 3.1 and prints the first error's message; exit status 3 when
/// the validator is not installed, 1 when the document is invalid.
const WRAPPER: &str = r#"
import json, sys
try:
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate
except ImportError as e:
    print(f"openapi-spec-validator is not installed ({e}); run `python3 -m pip install openapi-spec-validator` or scripts/test.sh")
    sys.exit(3)
with open(sys.argv[1]) as f:
    spec = json.load(f)
try:
    validate(spec, cls=OpenAPIV31SpecValidator)
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(1)
print("valid")
"#;

/// Runs the validator on `doc`: `Ok(())` when valid, `Err(its message)` otherwise. Panics with
/// what to do when python3 or the validator is missing.
fn validate(doc: &Value) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, serde_json::to_vec_pretty(doc).expect("JSON")).expect("write");
    run_validator(&file)
}

fn run_validator(file: &Path) -> Result<(), String> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(WRAPPER)
        .arg(file)
        .output()
        .unwrap_or_else(|e| {
            panic!("could not run python3 ({e}); install python3, then run scripts/test.sh")
        });
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match out.status.code() {
        Some(0) => Ok(()),
        Some(3) => panic!("{said}"),
        _ => Err(said),
    }
}

/// Fails the test, with the validator's message and the document, unless `doc` validates;
/// `what` names the document in the message.
fn assert_valid(doc: &Value, what: &str) {
    if let Err(message) = validate(doc) {
        panic!(
            "openapi-spec-validator refused {what}: {message}\n{}",
            serde_json::to_string_pretty(doc).unwrap_or_default()
        );
    }
}

/// Entries as servers publish them: schemars-style schemas with named types, a typed error, a
/// declared GET route with path and query parameters, a declared PUT, a stream entry, an entry
/// from a server that publishes no API, and two services naming different types alike.
fn entries() -> Vec<ServiceEntry> {
    let order = json!({
        "type": "object",
        "required": ["id", "items"],
        "properties": {
            "id": {"type": "integer", "format": "uint64", "minimum": 0},
            "items": {"type": "array", "items": reference("Item")},
            "note": {"type": ["string", "null"]},
        },
    });
    let item_shop = json!({"type": "object", "properties": {"sku": {"type": "string"}}});
    let item_stock = json!({"type": "object", "properties": {"count": {"type": "integer"}}});
    let order_error = json!({"oneOf": [
        {"type": "string", "enum": ["Empty"]},
        {"type": "object", "required": ["Closed"], "properties": {"Closed": {"type": "string"}}},
    ]});
    let shop_schemas = |params: Vec<Value>, result: Value| EntrySchemas {
        error: Some(reference("OrderError")),
        ..schemas(
            params,
            result,
            &[
                ("Order", order.clone()),
                ("Item", item_shop.clone()),
                ("OrderError", order_error.clone()),
            ],
        )
    };
    vec![
        entry(
            "shop.Orders",
            "get",
            Some(EntryApi {
                doc: Some("One order.\n\nWith `verbose`, its items too.".into()),
                ..api(
                    &["id", "verbose"],
                    Some(("GET", "/orders/{id}")),
                    Some(shop_schemas(
                        vec![json!({"type": "integer"}), json!({"type": "boolean"})],
                        reference("Order"),
                    )),
                )
            }),
        ),
        entry(
            "shop.Orders",
            "rename",
            Some(api(
                &["id", "note"],
                Some(("PUT", "/orders/{id}")),
                Some(shop_schemas(
                    vec![json!({"type": "integer"}), json!(true)],
                    json!(true),
                )),
            )),
        ),
        entry(
            "shop.Orders",
            "place",
            Some(EntryApi {
                doc: Some("Places an order.".into()),
                ..api(
                    &["order"],
                    None,
                    Some(shop_schemas(
                        vec![reference("Order")],
                        json!({"type": "integer"}),
                    )),
                )
            }),
        ),
        entry(
            "shop.Orders",
            "follow",
            Some(EntryApi {
                stream: Some("server".into()),
                ..api(&["id"], None, None)
            }),
        ),
        entry(
            "stock.Stock",
            "check",
            Some(api(
                &["item"],
                None,
                Some(schemas(
                    vec![reference("Item")],
                    json!(false),
                    &[("Item", item_stock.clone())],
                )),
            )),
        ),
        entry("legacy.Echo", "echo", None),
    ]
}

#[test]
fn the_document_of_published_entries_validates_as_openapi_3_1() {
    let doc = document(&entries(), &DocumentInfo::new("shop", "1.0.0"));
    // What is validated is the document under test, not an empty one.
    assert!(doc["paths"]["/orders/{id}"]["get"].is_object(), "{doc}");
    assert!(
        doc["components"]["schemas"]["Item_stock.Stock"].is_object(),
        "{doc}"
    );
    assert_valid(&doc, "the document");
}

#[test]
fn the_document_with_a_bearer_token_validates_as_openapi_3_1() {
    let info = DocumentInfo {
        description: Some("Every service of the shop.".into()),
        bearer_token: true,
        ..DocumentInfo::new("shop", "1.0.0")
    };
    let doc = document(&entries(), &info);
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    assert_valid(&doc, "the document");
}

#[test]
fn the_document_of_no_entries_validates_as_openapi_3_1() {
    let doc = document(&[], &DocumentInfo::new("empty", "0"));
    assert_valid(&doc, "the document");
}

#[test]
fn the_validator_refuses_a_broken_document_and_says_why() {
    let mut doc = document(&entries(), &DocumentInfo::new("shop", "1.0.0"));
    // A path template whose parameter is not declared is invalid OpenAPI.
    doc["paths"]["/orders/{id}"]["get"]
        .as_object_mut()
        .expect("the GET operation")
        .remove("parameters");
    doc["paths"]["/orders/{id}"]
        .as_object_mut()
        .expect("the path item")
        .remove("put");
    let message = validate(&doc).expect_err("a path parameter left undeclared must be refused");
    assert!(
        message.contains("'id'"),
        "the message names the parameter: {message}"
    );
}

/// Services as `#[rpc::service]` publishes them: the schemas schemars writes, through the same
/// descriptors a server registers.
mod published {
    use rpc::schemars::JsonSchema;
    use rpc::{RpcError, RpcStream};
    use serde::{Deserialize, Serialize};

    /// What a caller sends to place an order.
    #[derive(Debug, Serialize, Deserialize, JsonSchema)]
    #[schemars(crate = "rpc::schemars")]
    pub struct NewOrder {
        pub item: String,
        pub qty: u32,
        pub note: Option<String>,
    }

    /// A placed order.
    #[derive(Debug, Serialize, Deserialize, JsonSchema)]
    #[schemars(crate = "rpc::schemars")]
    pub struct Order {
        pub id: u64,
        pub lines: Vec<Line>,
    }

    /// One line of an order.
    #[derive(Debug, Serialize, Deserialize, JsonSchema)]
    #[schemars(crate = "rpc::schemars")]
    pub struct Line {
        pub item: String,
        pub qty: u32,
    }

    /// The shop's typed error.
    #[derive(Debug, Serialize, Deserialize, JsonSchema)]
    #[schemars(crate = "rpc::schemars")]
    pub enum OrderError {
        OutOfStock { item: String },
        Call(String),
    }

    impl From<RpcError> for OrderError {
        fn from(e: RpcError) -> Self {
            OrderError::Call(e.to_string())
        }
    }

    #[rpc::service(name = "pv.Shop")]
    pub trait Shop {
        /// Places an order.
        #[http(post = "/orders")]
        async fn place(&self, order: NewOrder) -> Result<Order, OrderError>;
        /// One order.
        #[http(get = "/orders/{id}")]
        async fn get(&self, id: u64, verbose: bool) -> Result<Order, OrderError>;
        async fn list(&self, from: u64, limit: u32) -> Result<Vec<Order>, RpcError>;
        async fn follow(&self, from: u64) -> Result<RpcStream<Order>, RpcError>;
    }

    pub mod stock {
        use super::*;

        /// Another service's `Order`: a different type under the same name.
        #[derive(Debug, Serialize, Deserialize, JsonSchema)]
        #[schemars(crate = "rpc::schemars")]
        pub struct Order {
            pub supplier: String,
        }

        #[rpc::service(name = "pv.Stock")]
        pub trait Stock {
            async fn reorder(&self, order: Order) -> Result<u32, RpcError>;
        }
    }

    pub struct Counter;

    impl Shop for Counter {
        async fn place(&self, _order: NewOrder) -> Result<Order, OrderError> {
            Err(OrderError::Call("unused".into()))
        }
        async fn get(&self, _id: u64, _verbose: bool) -> Result<Order, OrderError> {
            Err(OrderError::Call("unused".into()))
        }
        async fn list(&self, _from: u64, _limit: u32) -> Result<Vec<Order>, RpcError> {
            Ok(Vec::new())
        }
        async fn follow(&self, _from: u64) -> Result<RpcStream<Order>, RpcError> {
            Ok(RpcStream::iter(Vec::new()))
        }
    }

    pub struct Store;

    impl stock::Stock for Store {
        async fn reorder(&self, _order: stock::Order) -> Result<u32, RpcError> {
            Ok(0)
        }
    }
}

#[test]
fn the_document_of_entries_the_macro_publishes_validates_as_openapi_3_1() {
    use rpc::Service;
    let mut entries: Vec<ServiceEntry> = Vec::new();
    for methods in [
        published::ShopServer::new(published::Counter).methods(),
        published::stock::StockServer::new(published::Store).methods(),
    ] {
        entries.extend(methods.iter().map(ServiceEntry::from));
    }
    // The macro published schemas, and both services name a type `Order`.
    let defs = |id: &str| {
        entries
            .iter()
            .find(|e| e.id.as_str() == id)
            .and_then(|e| e.api.as_ref()?.schemas.as_ref())
            .map(|s| s.definitions.clone())
            .unwrap_or_default()
    };
    assert!(defs("pv.Shop.get").contains_key("Order"), "{entries:?}");
    assert!(
        defs("pv.Stock.reorder").contains_key("Order"),
        "{entries:?}"
    );
    let doc = document(&entries, &DocumentInfo::new("shop", "1.0.0"));
    assert!(doc["paths"]["/orders/{id}"]["get"].is_object(), "{doc}");
    assert!(doc["paths"].get("/api/pv.Shop/follow").is_none(), "{doc}");
    assert!(
        doc["components"]["schemas"]["Order_pv.Stock"].is_object(),
        "{doc}"
    );
    assert_valid(&doc, "the document");
}

#[tokio::test]
async fn the_document_a_running_gateway_serves_validates_as_openapi_3_1() {
    let wanted = ["pv.Shop.get", "pv.Stock.reorder", "echo.Echo.echo"];
    let running = running(
        rpc::Server::builder()
            .add_service(published::ShopServer::new(published::Counter))
            .add_service(published::stock::StockServer::new(published::Store))
            .add_service(examples::EchoServer::new(examples::EchoService::default())),
        Some("s3cret"),
        &wanted,
    )
    .await;
    let addr = running.addr;
    // The document as a caller reads it, over HTTP.
    let answer = reqwest::Client::new()
        .get(format!("http://{addr}/openapi.json"))
        .bearer_auth("s3cret")
        .send()
        .await
        .expect("GET /openapi.json");
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    let doc: Value = serde_json::from_str(&answer.text().await.expect("body")).expect("JSON");
    for id in wanted {
        assert!(
            doc.to_string().contains(&format!("\"{id}\"")),
            "{id}: {doc}"
        );
    }
    assert_eq!(doc["security"], json!([{"bearer": []}]));
    assert_valid(&doc, "the served document");
}
