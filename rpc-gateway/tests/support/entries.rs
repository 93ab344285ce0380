//! Service entries written in a line, for the crate's unit tests and its integration tests.
//!
//! Why shared: the route table, the routes, the OpenAPI document and the documentation page are
//! all tested on hand-built [`ServiceEntry`]s, whose fields would otherwise be spelt out again in
//! every test module. `src/route.rs` includes this file for the unit tests (`#[cfg(test)]`); an
//! integration test includes it with `#[path = "support/entries.rs"] mod entries;`.
#![allow(dead_code)]

use rpc_core::{EntryApi, EntrySchemas, HttpRoute, ServiceEntry};
use serde_json::{json, Value};

/// The entry `method` of `service` (id `<service>.<method>`), with no hash key, no governance
/// of its own, and `api` as what its server publishes for a gateway.
pub fn entry(service: &str, method: &str, api: Option<EntryApi>) -> ServiceEntry {
    ServiceEntry {
        id: format!("{service}.{method}").as_str().into(),
        service_id: service.into(),
        method: method.into(),
        hash_key: None,
        governance: Default::default(),
        api,
    }
}

/// The entry `method` of `service` taking `params`, served at the route `http` declares
/// (method, path) when given, with no schemas.
pub fn routed(
    service: &str,
    method: &str,
    params: &[&str],
    http: Option<(&str, &str)>,
) -> ServiceEntry {
    entry(service, method, Some(api(params, http, None)))
}

/// An entry's API: its parameters' names, the route `http` declares (method, path) when given,
/// and `schemas`; no doc comment, not a stream.
pub fn api(params: &[&str], http: Option<(&str, &str)>, schemas: Option<EntrySchemas>) -> EntryApi {
    EntryApi {
        params: params.iter().map(|p| p.to_string()).collect(),
        doc: None,
        http: http.map(|(method, path)| HttpRoute {
            method: method.into(),
            path: path.into(),
        }),
        stream: None,
        schemas,
    }
}

/// The schemas of an entry's parameters and result, with the named `definitions` their `$ref`s
/// point into; no typed error.
pub fn schemas(params: Vec<Value>, result: Value, definitions: &[(&str, Value)]) -> EntrySchemas {
    EntrySchemas {
        params,
        result,
        error: None,
        definitions: definitions
            .iter()
            .map(|(name, schema)| (name.to_string(), schema.clone()))
            .collect(),
    }
}

/// `{"$ref": "#/components/schemas/<name>"}`, a reference as servers publish it.
pub fn reference(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

/// An instance at `address` publishing `echo.Echo.echo` (taking `text`, at its default route),
/// as an echo server would publish it.
pub fn echo_instance(address: &str) -> rpc_registry::Instance {
    let mut instance = rpc_registry::Instance::new(address, ["echo.Echo"]);
    instance.entries = vec![routed("echo.Echo", "echo", &["text"], None)];
    instance
}
