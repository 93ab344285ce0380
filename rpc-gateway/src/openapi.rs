//! The OpenAPI 3.1 document of the entries a gateway serves.
//!
//! Why it is generated rather than written: the gateway serves whatever servers publish, so the
//! only true description of its routes is the one built from the same published entries, with
//! the same routes ([`crate::route::route_of`]) and the same error answers
//! ([`crate::route::http_status`], [`crate::route::error_body_schema`]) the router uses. The JSON
//! Schemas come from the servers too ([`rpc_core::EntrySchemas`]); their named types are merged
//! into `components.schemas`, and a name two services use for different types is kept twice
//! (the second renamed `<name>_<service>`), so neither service's schema is lost.
//!
//! The output is deterministic: entries, services and schema names are taken in sorted order, so
//! the same entries give the same document byte for byte whatever order the registry lists them.

use std::collections::{BTreeMap, BTreeSet};

use axum::http::{Method, StatusCode as HttpStatus};
use rpc_core::ServiceEntry;
use serde_json::{json, Map, Value};

use crate::route::{carried_error_schema, carries_retry_after, error_body_schema, params_in_query};
use crate::table::{accepts_null, is_structured, is_text, Definitions, RouteTable};

/// Where the named schemas live, as the servers' `$ref`s write it.
const SCHEMA_REF_PREFIX: &str = "#/components/schemas/";

/// The name of the bearer security scheme, when the gateway checks a token.
pub const BEARER_SCHEME: &str = "bearer";

/// What the document says of itself and of the gateway serving it.
#[derive(Debug, Clone, Default)]
pub struct DocumentInfo {
    /// `info.title`.
    pub title: String,
    /// `info.version`.
    pub version: String,
    /// `info.description`, when given.
    pub description: Option<String>,
    /// Whether the gateway asks for a token (`Authorization: Bearer <token>`): the document then
    /// declares a bearer security scheme and requires it on every operation.
    pub bearer_token: bool,
}

impl DocumentInfo {
    /// A document titled `title` at `version`, with no description and no token.
    pub fn new(title: impl Into<String>, version: impl Into<String>) -> Self {
        DocumentInfo {
            title: title.into(),
            version: version.into(),
            ..Default::default()
        }
    }
}

/// The error answers every operation documents: the HTTP status, what it means, and the call
/// statuses that lead to it (a test checks each against [`crate::route::http_status`], so the
/// two cannot drift apart).
pub const ERROR_RESPONSES: &[(u16, &str, &[u32])] = &[
    (
        400,
        "Bad request: the arguments could not be read (not JSON, a parameter missing or of the \
         wrong type) or the method's validation refused them (call status 1001). Fix the request \
         as `message` says.",
        &[1001],
    ),
    (
        401,
        "Not authenticated (call status 401): the service asks for credentials the caller sends \
         in a header the gateway forwards.",
        &[401],
    ),
    (
        404,
        "No such entry (call status 507 or 513): the service or method is not published by any \
         server; check the path against this document.",
        &[507, 513],
    ),
    (
        422,
        "The method answered its business error (call status 1000); `error` holds the error's \
         value when it carried one (the typed error, when the method declares one).",
        &[1000],
    ),
    (
        429,
        "Rate limited (call status 429): retry after the number of seconds in `Retry-After`.",
        &[429],
    ),
    (
        502,
        "The service failed (call status 506 communication error, 509 fallback failed or 520 \
         server error), or answered with a result that cannot be JSON (call status 500); \
         `message` says what failed.",
        &[506, 509, 520],
    ),
    (
        503,
        "The service cannot take the call now: overloaded (514, 515), its circuit breaker is open \
         (522) or no instance is up (404, 504). Retry after the number of seconds in \
         `Retry-After`.",
        &[514, 515, 522, 404, 504],
    ),
    (
        504,
        "The call timed out (call status 519): the service did not answer within the entry's \
         timeout.",
        &[519],
    ),
    (
        403,
        "Not authorized (call status 403), or the service refused the credentials the call \
         carried (517: the gateway's own server token, or a forwarded header a server layer \
         checks); sending the gateway another token does not change it.",
        &[403, 517],
    ),
    (
        501,
        "Not implemented (call status 501): the server has no handler for this method.",
        &[501],
    ),
    (
        500,
        "Another failure of the call (any other call status); `message` says what failed.",
        &[],
    ),
];

/// The answers the gateway gives itself, before any call, with `{"error": "..."}` saying what
/// to send instead ([`refusal_schema`]): the HTTP status and when.
pub const GATEWAY_REFUSALS: &[(u16, &str)] = &[
    (400, "Bad request: the arguments could not be read (a body that is not JSON, an unknown, missing or repeated argument)."),
    (401, "Not authenticated: the gateway's bearer token is missing or wrong (`WWW-Authenticate: Bearer`)."),
    (403, "The request comes from a page of another origin (`Origin`): the gateway answers no cross-origin requests."),
    (404, "No entry is served at this method and path."),
    (405, "The path is served with other methods, named in `Allow`."),
    (408, "The body was not sent whole within the gateway's read timeout."),
    (413, "The body is over the gateway's limit."),
    (431, "Too many headers to forward as attachments."),
    (503, "The gateway is handling as many calls as it takes at once: retry after the number of seconds in `Retry-After`."),
];

/// The JSON Schema of the gateway's own refusals: `{"error": "..."}`.
pub fn refusal_schema() -> Value {
    json!({
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string", "description": "What to send instead."}},
    })
}

/// The methods an OpenAPI path item can hold.
fn path_item_key(method: &Method) -> Option<&'static str> {
    Some(match *method {
        Method::GET => "get",
        Method::PUT => "put",
        Method::POST => "post",
        Method::DELETE => "delete",
        Method::OPTIONS => "options",
        Method::HEAD => "head",
        Method::PATCH => "patch",
        Method::TRACE => "trace",
        _ => return None,
    })
}

/// The OpenAPI 3.1 document of `entries` (routes from [`crate::route::route_of`], errors from
/// [`crate::route::http_status`] and [`crate::route::error_body_schema`]).
///
/// One operation per unary entry (stream entries are skipped: the gateway serves unary calls
/// only); an entry listed twice (by two instances) is documented once. Each entry is documented
/// where the gateway's router serves it: no declared route takes another entry's default
/// route, and of two entries that declare one path (the same method and path, or paths that
/// differ only in their parameters' names, with any methods) the first by entry id keeps it
/// and the other is documented at its default route. An entry whose server publishes no
/// [`rpc_core::EntryApi`] is documented at its default route with a body of positional
/// arguments (a JSON array).
pub fn document(entries: &[ServiceEntry], info: &DocumentInfo) -> Value {
    // Sorted and deduplicated by entry id.
    let mut by_id: BTreeMap<&str, &ServiceEntry> = BTreeMap::new();
    for entry in entries {
        if entry.api.as_ref().is_some_and(|api| api.stream.is_some()) {
            continue;
        }
        by_id.entry(entry.id.as_str()).or_insert(entry);
    }
    let served: Vec<&ServiceEntry> = by_id.into_values().collect();

    let (schemas, renames) = merge_definitions(&served);

    // Each entry at the route the gateway serves it at: the router's own decisions.
    let table = RouteTable::build(served.iter().map(|entry| (*entry).clone()).collect());
    let mut paths: BTreeMap<String, BTreeMap<&'static str, Value>> = BTreeMap::new();
    let mut tags = BTreeSet::new();
    for served in table.served() {
        let (entry, route) = (&served.entry, &served.route);
        let Some(key) = path_item_key(&route.method) else {
            continue;
        };
        let path = openapi_path(&route.path);
        let mut op = operation(entry, &route.method, &path);
        if let Some(rename) = renames.get(entry.id.as_str()) {
            rewrite_refs(&mut op, rename);
        }
        paths.entry(path).or_default().insert(key, op);
        tags.insert(entry.service_id.as_str().to_string());
    }

    let mut components = Map::new();
    let mut schemas = schemas;
    add_missing_targets(&paths, &mut schemas);
    if !schemas.is_empty() {
        components.insert("schemas".into(), Value::Object(sorted(schemas)));
    }
    let mut doc = Map::new();
    doc.insert("openapi".into(), json!("3.1.0"));
    let mut info_obj = Map::new();
    info_obj.insert("title".into(), json!(info.title));
    info_obj.insert("version".into(), json!(info.version));
    if let Some(description) = &info.description {
        info_obj.insert("description".into(), json!(description));
    }
    doc.insert("info".into(), Value::Object(info_obj));
    if info.bearer_token {
        components.insert(
            "securitySchemes".into(),
            json!({BEARER_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "The gateway's token, sent as `Authorization: Bearer <token>`.",
            }}),
        );
        doc.insert("security".into(), json!([{BEARER_SCHEME: []}]));
    }
    doc.insert(
        "tags".into(),
        Value::Array(tags.into_iter().map(|t| json!({"name": t})).collect()),
    );
    let mut paths_obj = Map::new();
    for (path, item) in paths {
        let mut item_obj = Map::new();
        for (key, op) in item {
            item_obj.insert(key.into(), op);
        }
        paths_obj.insert(path, Value::Object(item_obj));
    }
    doc.insert("paths".into(), Value::Object(paths_obj));
    if !components.is_empty() {
        doc.insert("components".into(), Value::Object(components));
    }
    Value::Object(doc)
}

/// The names in a path template, in order: `/orders/{id}/items/{item}` → `id`, `item` (a
/// catch-all `{*rest}` is named `rest`).
pub fn path_params(template: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for name in path_param_names(template) {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    names
}

/// Every parameter name `template` holds, in order, each as often as it is written.
pub(crate) fn path_param_names(template: &str) -> impl Iterator<Item = &str> {
    let mut rest = template;
    std::iter::from_fn(move || loop {
        let open = rest.find('{')?;
        let close = rest[open..].find('}')?;
        let name = rest[open + 1..open + close].trim_start_matches('*');
        rest = &rest[open + close + 1..];
        if !name.is_empty() {
            return Some(name);
        }
    })
}

/// The template as OpenAPI writes it: starting with `/`, catch-alls `{*rest}` as `{rest}`.
fn openapi_path(template: &str) -> String {
    let path = template.replace("{*", "{");
    if path.starts_with('/') {
        path
    } else {
        format!("/{path}")
    }
}

/// A schema as the document holds it: `true` (any value) becomes `{}` and `false` becomes
/// `{"not": {}}`, which every OpenAPI tool reads.
fn schema_object(schema: Option<&Value>) -> Value {
    match schema {
        None | Some(Value::Bool(true)) | Some(Value::Null) => json!({}),
        Some(Value::Bool(false)) => json!({"not": {}}),
        Some(other) => other.clone(),
    }
}

/// The operation documenting `entry` at `method` `path`.
fn operation(entry: &ServiceEntry, method: &Method, path: &str) -> Value {
    let mut op = Map::new();
    op.insert("operationId".into(), json!(entry.id.as_str()));
    op.insert("tags".into(), json!([entry.service_id.as_str()]));
    let api = entry.api.as_ref();
    if let Some(doc) = api.and_then(|api| api.doc.as_deref()) {
        let doc = doc.trim();
        if let Some(first) = doc.lines().map(str::trim).find(|l| !l.is_empty()) {
            op.insert("summary".into(), json!(first));
            if doc != first {
                op.insert("description".into(), json!(doc));
            }
        }
    }
    let schemas = api.and_then(|api| api.schemas.as_ref());
    let published = |name: &str| -> Option<&Value> {
        let index = api.and_then(|api| api.params.iter().position(|p| p == name))?;
        schemas.and_then(|s| s.params.get(index))
    };
    let param_schema = |name: &str| -> Value { schema_object(published(name)) };
    // What the router does with an argument, read from its published schema as the router
    // reads it (`table.rs`).
    let says = |name: &str, of: fn(&Value, &Definitions) -> bool| -> bool {
        let definitions = schemas.map(|s| &s.definitions);
        published(name)
            .zip(definitions)
            .is_some_and(|(schema, definitions)| of(schema, definitions))
    };

    let in_path = path_params(path);
    let mut parameters: Vec<Value> = in_path
        .iter()
        .map(|name| {
            let mut parameter = json!({"name": name, "in": "path", "required": true});
            // Read as JSON when structured (`/orders/[1,2]`, escaped), as in the query: not
            // OpenAPI's `style: simple` (`/orders/1,2`), which the router does not read.
            if says(name, is_structured) {
                parameter["content"] = json!({"application/json": {"schema": param_schema(name)}});
            } else {
                parameter["schema"] = param_schema(name);
            }
            parameter
        })
        .collect();
    match api {
        Some(api) => {
            let others: Vec<&String> = api.params.iter().filter(|p| !in_path.contains(p)).collect();
            if params_in_query(method) {
                parameters.extend(others.iter().map(|name| {
                    let how = if says(name, is_text) {
                        "taken as it is"
                    } else {
                        "read as JSON"
                    };
                    let mut parameter = json!({
                        "name": name,
                        "in": "query",
                        // The router sends `null` for a missing argument that accepts it.
                        "required": !says(name, accepts_null),
                        "description": format!("The argument `{name}`, {how}."),
                    });
                    // An array or object is one JSON text (`?ids=[1,2]`), not a form's
                    // repeated or exploded fields, which OpenAPI says with `content`.
                    if says(name, is_structured) {
                        parameter["content"] =
                            json!({"application/json": {"schema": param_schema(name)}});
                    } else {
                        parameter["schema"] = param_schema(name);
                    }
                    parameter
                }));
            } else {
                let mut properties = Map::new();
                for name in &others {
                    properties.insert((*name).clone(), param_schema(name));
                }
                let required: Vec<&&String> = others
                    .iter()
                    .filter(|name| !says(name, accepts_null))
                    .collect();
                // The router refuses a member that names no argument. (The positional array
                // it also takes without path parameters is said in the description: a schema
                // of either shape would hide the object's properties from most tools.)
                let body = json!({
                    "type": "object",
                    "required": required,
                    "properties": properties,
                    "additionalProperties": false,
                });
                op.insert(
                    "requestBody".into(),
                    json!({
                        // (A body whose every argument accepts `null` may be left out.)
                        "required": !required.is_empty(),
                        "description": if in_path.is_empty() {
                            "The arguments by name, as a JSON object (a JSON array is taken as \
                             the positional arguments)."
                        } else {
                            "The arguments not in the path, by name, as a JSON object."
                        },
                        "content": {"application/json": {"schema": body}},
                    }),
                );
            }
        }
        None => {
            op.insert(
                "requestBody".into(),
                json!({
                    "required": false,
                    "description": "The arguments in declaration order, as a JSON array (the \
                                    server publishes no parameter names); no body is no \
                                    arguments.",
                    "content": {"application/json": {"schema": {"type": "array"}}},
                }),
            );
        }
    }
    if !parameters.is_empty() {
        op.insert("parameters".into(), Value::Array(parameters));
    }

    let mut responses = Map::new();
    responses.insert(
        "200".into(),
        json!({
            "description": "The method's result.",
            "content": {"application/json": {"schema": schema_object(schemas.map(|s| &s.result))}},
        }),
    );
    let typed = schemas
        .and_then(|s| s.error.as_ref())
        .map(|e| schema_object(Some(e)));
    let refusal = |status: u16| GATEWAY_REFUSALS.iter().find(|(s, _)| *s == status);
    let carried = carried_error_schema();
    // A method that declares no typed error may still pass one on (as its business error).
    let business = json!({"description": "The value the method's business error carried, if any."});
    for (status, description, _) in ERROR_RESPONSES {
        // The typed error is the business error's; a method that declares none may pass one
        // on all the same, and another status may carry a value too.
        let typed = match *status {
            422 => typed.as_ref().or(Some(&business)),
            _ => Some(&carried),
        };
        // A status the gateway answers itself as well: either body.
        let (schema, description) = match refusal(*status) {
            Some((_, own)) => (
                json!({"anyOf": [error_body_schema(typed), refusal_schema()]}),
                format!("{description} Or, from the gateway itself: {own}"),
            ),
            None => (error_body_schema(typed), description.to_string()),
        };
        let mut response = json!({
            "description": description,
            "content": {"application/json": {"schema": schema}},
        });
        let http = HttpStatus::from_u16(*status).unwrap_or(HttpStatus::INTERNAL_SERVER_ERROR);
        if carries_retry_after(http) {
            response["headers"] = json!({"Retry-After": {
                "description": "Seconds to wait before calling again.",
                "schema": {"type": "integer", "minimum": 0},
            }});
        }
        responses.insert(status.to_string(), response);
    }
    for (status, description) in GATEWAY_REFUSALS {
        responses.entry(status.to_string()).or_insert_with(|| {
            json!({
                "description": description,
                "content": {"application/json": {"schema": refusal_schema()}},
            })
        });
    }
    op.insert("responses".into(), Value::Object(responses));
    Value::Object(op)
}

/// `components.schemas`: the union of every entry's definitions, and per entry id the renames
/// its schemas' `$ref`s need.
///
/// A service's entries (taken by id) share their definitions, save an entry that defines a
/// name differently from one before it in its service: it forms another group of the service
/// (the first whose definitions agree with its own). Groups are taken in order (services
/// sorted, then the service's groups); the first group to define a name gives its schema. A
/// group's definition is renamed `<name>_<service>` (with a number when that is taken) when an
/// earlier group holds a different schema under the name, or when it refers to a definition
/// of its own that is renamed (its meaning differs from the one already held).
fn merge_definitions(
    entries: &[&ServiceEntry],
) -> (
    Map<String, Value>,
    BTreeMap<String, BTreeMap<String, String>>,
) {
    type Group = (String, BTreeMap<String, Value>, Vec<String>);
    let mut per_service: BTreeMap<&str, Vec<Group>> = BTreeMap::new();
    for entry in entries {
        let groups = per_service.entry(entry.service_id.as_str()).or_default();
        let empty = Map::new();
        let defs = entry
            .api
            .as_ref()
            .and_then(|api| api.schemas.as_ref())
            .map_or(&empty, |s| &s.definitions);
        let agrees = |held: &BTreeMap<String, Value>| {
            defs.iter()
                .all(|(name, schema)| held.get(name).is_none_or(|h| h == schema))
        };
        let group = match groups.iter().position(|(_, held, _)| agrees(held)) {
            Some(i) => &mut groups[i],
            None => {
                groups.push((
                    entry.service_id.as_str().to_string(),
                    BTreeMap::new(),
                    Vec::new(),
                ));
                groups.last_mut().expect("just pushed")
            }
        };
        for (name, schema) in defs {
            group
                .1
                .entry(name.clone())
                .or_insert_with(|| schema.clone());
        }
        group.2.push(entry.id.as_str().to_string());
    }
    let mut global: Map<String, Value> = Map::new();
    let mut renames_by_entry = BTreeMap::new();
    for (service, defs, entry_ids) in per_service.into_values().flatten() {
        // Which names must be renamed: a different schema already held, or (to a fixpoint,
        // bounded by the number of names) a reference to a renamed one.
        let mut renamed: BTreeSet<&String> = defs
            .iter()
            .filter(|(name, schema)| {
                global
                    .get(name.as_str())
                    .is_some_and(|held| held != *schema)
            })
            .map(|(name, _)| name)
            .collect();
        for _ in 0..=defs.len() {
            let more: Vec<&String> = defs
                .iter()
                .filter(|(name, schema)| {
                    !renamed.contains(name)
                        && global.contains_key(name.as_str())
                        && refs_of(schema)
                            .iter()
                            .any(|r| renamed.iter().any(|n| *n == r))
                })
                .map(|(name, _)| name)
                .collect();
            if more.is_empty() {
                break;
            }
            renamed.extend(more);
        }
        let mut rename = BTreeMap::new();
        for name in renamed {
            let base = format!("{name}_{}", component_safe(&service));
            let mut candidate = base.clone();
            let mut n = 2;
            while global.contains_key(&candidate)
                || defs.contains_key(&candidate)
                || rename.values().any(|v| v == &candidate)
            {
                candidate = format!("{base}_{n}");
                n += 1;
            }
            rename.insert(name.clone(), candidate);
        }
        for (name, mut schema) in defs {
            rewrite_refs(&mut schema, &rename);
            let target = rename.get(&name).cloned().unwrap_or(name);
            global.entry(target).or_insert(schema);
        }
        if !rename.is_empty() {
            for id in entry_ids {
                renames_by_entry.insert(id, rename.clone());
            }
        }
    }
    (global, renames_by_entry)
}

/// `name` with every character a component name may not hold (`[A-Za-z0-9._-]`) made `_`.
fn component_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The component names `value` refers to with `$ref`.
fn refs_of(value: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    collect_refs(value, &mut out);
    out
}

fn collect_refs(value: &Value, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                if key == "$ref" {
                    if let Some(name) = v.as_str().and_then(|r| r.strip_prefix(SCHEMA_REF_PREFIX)) {
                        out.insert(name.to_string());
                    }
                } else {
                    collect_refs(v, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

/// Rewrites every `$ref` to `#/components/schemas/<old>` in `value` to the name `rename` gives.
fn rewrite_refs(value: &mut Value, rename: &BTreeMap<String, String>) {
    if rename.is_empty() {
        return;
    }
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                if key == "$ref" {
                    let new = v
                        .as_str()
                        .and_then(|r| r.strip_prefix(SCHEMA_REF_PREFIX))
                        .and_then(|name| rename.get(name));
                    if let Some(new) = new {
                        *v = json!(format!("{SCHEMA_REF_PREFIX}{new}"));
                    }
                } else {
                    rewrite_refs(v, rename);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rewrite_refs(v, rename)),
        _ => {}
    }
}

/// A schema referred to but published by no server would leave the document invalid: it gets a
/// placeholder (any value) that says so.
fn add_missing_targets(
    paths: &BTreeMap<String, BTreeMap<&'static str, Value>>,
    schemas: &mut Map<String, Value>,
) {
    let mut wanted = BTreeSet::new();
    for item in paths.values() {
        for op in item.values() {
            collect_refs(op, &mut wanted);
        }
    }
    for schema in schemas.values() {
        collect_refs(schema, &mut wanted);
    }
    for name in wanted {
        schemas.entry(name).or_insert_with(|| {
            json!({"description": "Referred to by a published schema, but published by no server."})
        });
    }
}

/// `map` with its keys in sorted order (whatever order `serde_json`'s map keeps).
fn sorted(map: Map<String, Value>) -> Map<String, Value> {
    let ordered: BTreeMap<String, Value> = map.into_iter().collect();
    ordered.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::http_status;
    use crate::route::test_entries::{api, entry, reference as refs, routed, schemas};
    use rpc_core::{EntryApi, StatusCode};

    fn info() -> DocumentInfo {
        DocumentInfo::new("test", "1")
    }

    /// An entry declaring a method OpenAPI has no operation for (published by a server built
    /// without `#[rpc::service]`) is served and documented at its default route: before, it
    /// was served at its declared route and the document had no operation for it anywhere.
    #[test]
    fn an_entry_declaring_a_method_the_document_cannot_hold_is_documented_at_its_default_route() {
        for method in ["QUERY", "PROPFIND", "CONNECT", "TRACE"] {
            let e = routed("x.S", "find", &["q"], Some((method, "/search")));
            assert_eq!(crate::route::route_of(&e).path, "/api/x.S/find", "{method}");
            let doc = document(&[e], &info());
            assert_eq!(
                doc["paths"]["/api/x.S/find"]["post"]["operationId"], "x.S.find",
                "{method}: {doc}"
            );
        }
    }

    #[test]
    fn a_declared_get_route_has_path_and_query_parameters() {
        let e = entry(
            "shop.Orders",
            "list_items",
            Some(EntryApi {
                doc: Some("Items of an order.\n\nPaged by `limit`.".into()),
                ..api(
                    &["id", "limit", "tag"],
                    Some(("get", "/orders/{id}/items")),
                    Some(schemas(
                        vec![
                            json!({"type": "integer"}),
                            json!({"type": "integer", "minimum": 1}),
                            json!({"type": "string"}),
                        ],
                        json!({"type": "array"}),
                        &[],
                    )),
                )
            }),
        );
        let doc = document(&[e], &info());
        let op = &doc["paths"]["/orders/{id}/items"]["get"];
        assert_eq!(op["operationId"], "shop.Orders.list_items");
        assert_eq!(op["tags"], json!(["shop.Orders"]));
        assert_eq!(op["summary"], "Items of an order.");
        assert_eq!(op["description"], "Items of an order.\n\nPaged by `limit`.");
        let params = op["parameters"].as_array().unwrap();
        let got: Vec<(&str, &str, bool, &Value)> = params
            .iter()
            .map(|p| {
                (
                    p["name"].as_str().unwrap(),
                    p["in"].as_str().unwrap(),
                    p["required"].as_bool().unwrap(),
                    &p["schema"],
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("id", "path", true, &json!({"type": "integer"})),
                (
                    "limit",
                    "query",
                    true,
                    &json!({"type": "integer", "minimum": 1})
                ),
                ("tag", "query", true, &json!({"type": "string"})),
            ]
        );
        assert!(op.get("requestBody").is_none(), "a GET has no body: {op}");
        assert_eq!(
            op["responses"]["200"]["content"]["application/json"]["schema"],
            json!({"type": "array"})
        );
        assert_eq!(doc["tags"], json!([{"name": "shop.Orders"}]));
    }

    /// As schemars 1 writes `u64`, `Option<String>`, `Option<bool>`, `Vec<u64>` and
    /// `Option<Filter>` (a struct).
    fn optional_and_structured() -> rpc_core::EntrySchemas {
        schemas(
            vec![
                json!({"type": "integer"}),
                json!({"type": ["string", "null"]}),
                json!({"anyOf": [{"type": "boolean"}, {"type": "null"}]}),
                json!({"type": "array", "items": {"type": "integer"}}),
                json!({"anyOf": [refs("Filter"), {"type": "null"}]}),
            ],
            json!({"type": "string"}),
            &[(
                "Filter",
                json!({"type": "object", "properties": {"min": {"type": "integer"}}}),
            )],
        )
    }

    const OPTIONAL_AND_STRUCTURED: &[&str] = &["id", "note", "verbose", "ids", "filter"];

    /// The parameters the document gives an entry taking [`OPTIONAL_AND_STRUCTURED`] served
    /// with GET at `path`, by name.
    fn find_parameters(path: &str) -> impl Fn(&str) -> Value {
        let e = entry(
            "shop.Orders",
            "find",
            Some(api(
                OPTIONAL_AND_STRUCTURED,
                Some(("GET", path)),
                Some(optional_and_structured()),
            )),
        );
        let doc = document(&[e], &info());
        let params = doc["paths"][path]["get"]["parameters"]
            .as_array()
            .unwrap()
            .clone();
        move |name: &str| params.iter().find(|p| p["name"] == name).unwrap().clone()
    }

    #[test]
    fn optional_query_arguments_are_not_required_and_arrays_or_objects_are_json_text() {
        let by_name = find_parameters("/orders/{id}/find");
        // (required, described as taken as text, a JSON `content` rather than a `schema`)
        let shape = |name: &str| {
            let p = by_name(name);
            (
                p["required"].as_bool().unwrap(),
                p["description"]
                    .as_str()
                    .is_some_and(|d| d.contains("taken as it is")),
                p.get("content").is_some() && p.get("schema").is_none(),
            )
        };
        assert_eq!(shape("id"), (true, false, false));
        assert_eq!(shape("note"), (false, true, false));
        assert_eq!(shape("verbose"), (false, false, false));
        assert_eq!(shape("ids"), (true, false, true));
        assert_eq!(shape("filter"), (false, false, true));
        assert_eq!(
            by_name("ids")["content"]["application/json"]["schema"],
            json!({"type": "array", "items": {"type": "integer"}})
        );
    }

    /// A structured argument in the path is one JSON text there too (`/orders/[1,2]`,
    /// escaped), as the router reads it: a JSON `content`, not a `schema` (whose default
    /// `style: simple` would say `/orders/1,2`, which the router does not read).
    #[test]
    fn a_structured_path_argument_is_json_text() {
        let by_name = find_parameters("/orders/{ids}/{id}");
        let ids = by_name("ids");
        assert_eq!(ids["in"], "path");
        assert!(ids.get("schema").is_none(), "{ids}");
        assert_eq!(
            ids["content"]["application/json"]["schema"],
            json!({"type": "array", "items": {"type": "integer"}})
        );
        let id = by_name("id");
        assert_eq!(id["schema"], json!({"type": "integer"}));
        assert!(id.get("content").is_none(), "{id}");
    }

    #[test]
    fn optional_body_arguments_are_not_required() {
        let e = entry(
            "shop.Orders",
            "find",
            Some(api(
                OPTIONAL_AND_STRUCTURED,
                None,
                Some(optional_and_structured()),
            )),
        );
        let doc = document(&[e], &info());
        let body = &doc["paths"]["/api/shop.Orders/find"]["post"]["requestBody"];
        assert_eq!(
            body["content"]["application/json"]["schema"]["required"],
            json!(["id", "ids"])
        );
        assert_eq!(body["required"], true, "id and ids must be sent");
        // Every argument optional: the body may be left out (the gateway then passes nulls).
        let e = entry(
            "shop.Orders",
            "list",
            Some(api(
                &["note", "verbose"],
                None,
                Some(schemas(
                    vec![
                        json!({"type": ["string", "null"]}),
                        json!({"anyOf": [{"type": "boolean"}, {"type": "null"}]}),
                    ],
                    json!({"type": "string"}),
                    &[],
                )),
            )),
        );
        let doc = document(&[e], &info());
        let body = &doc["paths"]["/api/shop.Orders/list"]["post"]["requestBody"];
        assert_eq!(body["required"], false, "{body}");
    }

    #[test]
    fn an_entry_without_a_route_is_a_post_with_a_body_of_named_arguments() {
        let e = entry(
            "shop.Orders",
            "create",
            Some(api(
                &["customer", "count"],
                None,
                Some(schemas(
                    vec![json!({"type": "string"}), json!(true)],
                    json!({"type": "integer"}),
                    &[],
                )),
            )),
        );
        let doc = document(&[e], &info());
        let op = &doc["paths"]["/api/shop.Orders/create"]["post"];
        assert!(op.get("parameters").is_none(), "{op}");
        assert_eq!(op["requestBody"]["required"], true);
        // With no path parameter, the router takes a positional array too.
        let said = op["requestBody"]["description"]
            .as_str()
            .expect("description");
        assert!(said.contains("JSON array"), "{said}");
        assert_eq!(
            op["requestBody"]["content"]["application/json"]["schema"],
            json!({
                "type": "object",
                "required": ["customer", "count"],
                "properties": {"customer": {"type": "string"}, "count": {}},
                // The router refuses a member that names no argument.
                "additionalProperties": false,
            })
        );
    }

    #[test]
    fn a_declared_put_route_takes_the_path_parameter_from_the_path_and_the_rest_from_the_body() {
        let e = routed(
            "shop.Orders",
            "rename",
            &["id", "name"],
            Some(("PUT", "/orders/{id}")),
        );
        let doc = document(&[e], &info());
        let op = &doc["paths"]["/orders/{id}"]["put"];
        assert_eq!(
            op["parameters"],
            json!([{"name": "id", "in": "path", "required": true, "schema": {}}])
        );
        assert_eq!(
            op["requestBody"]["content"]["application/json"]["schema"]["required"],
            json!(["name"])
        );
        // Beside a path parameter the router takes no positional array (see `call::bind`).
        let said = op["requestBody"]["description"]
            .as_str()
            .expect("description");
        assert!(!said.contains("array"), "{said}");
    }

    #[test]
    fn the_typed_error_schema_is_the_error_field_of_the_422_answer_and_others_carry_any_value() {
        let mut s = schemas(vec![], json!({"type": "string"}), &[]);
        s.error = Some(refs("OrderError"));
        s.definitions.insert(
            "OrderError".into(),
            json!({"type": "string", "enum": ["Empty", "Closed"]}),
        );
        let doc = document(
            &[entry("shop.Orders", "close", Some(api(&[], None, Some(s))))],
            &info(),
        );
        let responses = &doc["paths"]["/api/shop.Orders/close"]["post"]["responses"];
        let schema_of = |status: &str| &responses[status]["content"]["application/json"]["schema"];
        // The typed error is the `error` field of the 422 body; another status's `error` is any
        // value the error carried (the gateway sends one whatever the status).
        assert_eq!(
            schema_of("422")["properties"]["error"],
            json!({"$ref": "#/components/schemas/OrderError"})
        );
        assert_eq!(schema_of("422")["required"], json!(["code", "message"]));
        for status in [
            "400", "401", "403", "404", "429", "500", "501", "502", "503", "504",
        ] {
            let text = schema_of(status).to_string();
            assert!(!text.contains("OrderError"), "{status}: {text}");
        }
        assert_eq!(
            schema_of("422"),
            &error_body_schema(Some(&refs("OrderError")))
        );
        // Statuses the gateway also answers itself take either body; its own refusals only one.
        let carried = error_body_schema(Some(&carried_error_schema()));
        for status in ["400", "401", "403", "404", "503"] {
            let either = json!({"anyOf": [carried.clone(), refusal_schema()]});
            assert_eq!(schema_of(status), &either, "{status}");
        }
        for status in ["429", "500", "501", "502", "504"] {
            assert_eq!(schema_of(status), &carried, "{status}");
            assert!(
                schema_of(status)["properties"]["error"].is_object(),
                "{status}"
            );
        }
        for status in ["405", "408", "413", "431"] {
            assert_eq!(schema_of(status), &refusal_schema(), "{status}");
        }
        // A method that declares no typed error may pass one on: its 422 carries any value.
        let untyped = schemas(vec![], json!({"type": "string"}), &[]);
        let untyped_doc = document(
            &[entry(
                "shop.Orders",
                "close",
                Some(api(&[], None, Some(untyped))),
            )],
            &info(),
        );
        let untyped_422 =
            &untyped_doc["paths"]["/api/shop.Orders/close"]["post"]["responses"]["422"];
        let error = &untyped_422["content"]["application/json"]["schema"]["properties"]["error"];
        assert!(error["description"].is_string(), "{untyped_422}");
        assert!(responses["503"]["headers"]["Retry-After"].is_object());
        assert!(responses["429"]["headers"]["Retry-After"].is_object());
        assert!(responses["504"].get("headers").is_none());
        assert_eq!(
            doc["components"]["schemas"]["OrderError"],
            json!({"type": "string", "enum": ["Empty", "Closed"]})
        );
    }

    #[test]
    fn each_error_response_is_the_status_its_call_statuses_map_to() {
        for (status, _, codes) in ERROR_RESPONSES {
            for code in *codes {
                let mapped = http_status(StatusCode::from_u32(*code)).as_u16();
                assert_eq!(mapped, *status, "call status {code}");
            }
        }
    }

    #[test]
    fn definitions_are_merged_and_a_colliding_name_is_renamed_with_its_refs() {
        let item_a = json!({"type": "object", "properties": {"sku": {"type": "string"}}});
        let item_b = json!({"type": "object", "properties": {"id": {"type": "integer"}}});
        let money = json!({"type": "integer"});
        // `Cart` refers to `Item`: in b.Stock, its `Item` differs, so its `Cart` is renamed too
        // although it is written the same.
        let cart = json!({"type": "array", "items": refs("Item")});
        // Both take an `Item` and answer a `Cart`, each with its own definition of `Item`.
        let buyer = |service: &str, method: &str, item: &Value| {
            entry(
                service,
                method,
                Some(api(
                    &["item"],
                    None,
                    Some(schemas(
                        vec![refs("Item")],
                        refs("Cart"),
                        &[
                            ("Item", item.clone()),
                            ("Money", money.clone()),
                            ("Cart", cart.clone()),
                        ],
                    )),
                )),
            )
        };
        let a = buyer("a.Shop", "buy", &item_a);
        let b = buyer("b.Stock", "count", &item_b);
        // Listed in the opposite order: the result does not depend on it.
        let doc = document(&[b.clone(), a.clone()], &info());
        assert_eq!(doc, document(&[a, b], &info()));
        let components = doc["components"]["schemas"].as_object().unwrap();
        let names: Vec<&str> = components.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            vec!["Cart", "Cart_b.Stock", "Item", "Item_b.Stock", "Money"]
        );
        assert_eq!(components["Item"], item_a);
        assert_eq!(components["Item_b.Stock"], item_b);
        assert_eq!(components["Cart"], cart);
        assert_eq!(components["Cart_b.Stock"]["items"], refs("Item_b.Stock"));
        let body = |path: &str| {
            doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
                ["properties"]["item"]
                .clone()
        };
        let result = |path: &str| {
            doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
                .clone()
        };
        assert_eq!(body("/api/a.Shop/buy"), refs("Item"));
        assert_eq!(body("/api/b.Stock/count"), refs("Item_b.Stock"));
        assert_eq!(result("/api/a.Shop/buy"), refs("Cart"));
        assert_eq!(result("/api/b.Stock/count"), refs("Cart_b.Stock"));
    }

    /// Two entries of one service whose `Filter`s are different types (`orders::Filter`,
    /// `stock::Filter`): each operation refers to its own; entries that agree share theirs.
    #[test]
    fn one_services_entries_defining_a_name_differently_each_refer_to_their_own() {
        let orders = json!({"type": "object", "properties": {"customer": {"type": "string"}}});
        let stock = json!({"type": "object", "properties": {"sku": {"type": "string"}}});
        let taking = |method: &str, filter: &Value| {
            entry(
                "shop.Shop",
                method,
                Some(api(
                    &["filter"],
                    None,
                    Some(schemas(
                        vec![refs("Filter")],
                        json!({"type": "integer"}),
                        &[("Filter", filter.clone())],
                    )),
                )),
            )
        };
        let doc = document(
            &[
                taking("count", &stock),
                taking("list", &orders),
                taking("total", &stock),
            ],
            &info(),
        );
        let components = doc["components"]["schemas"].as_object().unwrap();
        let filter_of = |method: &str| {
            let path = format!("/api/shop.Shop/{method}");
            let r = doc["paths"][path.as_str()]["post"]["requestBody"]["content"]
                ["application/json"]["schema"]["properties"]["filter"]["$ref"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_string();
            components[r.as_str()].clone()
        };
        assert_eq!(filter_of("count"), stock);
        assert_eq!(filter_of("total"), stock);
        assert_eq!(filter_of("list"), orders);
        assert_eq!(
            components.len(),
            2,
            "one definition per type: {components:?}"
        );
    }

    #[test]
    fn stream_entries_are_skipped() {
        let stream = entry(
            "feed.Feed",
            "follow",
            Some(EntryApi {
                stream: Some("server".into()),
                ..api(&["topic"], None, None)
            }),
        );
        let unary = entry("feed.Feed", "last", Some(api(&["topic"], None, None)));
        let doc = document(&[stream, unary], &info());
        let paths: Vec<&String> = doc["paths"].as_object().unwrap().keys().collect();
        assert_eq!(paths, vec!["/api/feed.Feed/last"]);
    }

    #[test]
    fn an_entry_without_api_takes_a_body_of_positional_arguments() {
        let doc = document(&[entry("old.Svc", "ping", None)], &info());
        let op = &doc["paths"]["/api/old.Svc/ping"]["post"];
        assert_eq!(
            op["requestBody"]["content"]["application/json"]["schema"],
            json!({"type": "array"})
        );
        assert_eq!(
            op["responses"]["200"]["content"]["application/json"]["schema"],
            json!({})
        );
    }

    #[test]
    fn a_token_adds_the_bearer_scheme_and_requires_it() {
        let entries = [entry("old.Svc", "ping", None)];
        let open = document(&entries, &info());
        assert!(open.get("security").is_none());
        let doc = document(
            &entries,
            &DocumentInfo {
                bearer_token: true,
                ..info()
            },
        );
        assert_eq!(doc["security"], json!([{"bearer": []}]));
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
    }

    #[test]
    fn an_entry_listed_twice_is_documented_once() {
        let e = entry("old.Svc", "ping", None);
        let doc = document(&[e.clone(), e], &info());
        assert_eq!(doc["paths"].as_object().unwrap().len(), 1);
    }

    #[test]
    fn a_declared_route_taken_first_leaves_the_other_entry_at_its_default_route() {
        let a = routed("a.Orders", "get", &["id"], Some(("GET", "/orders/{id}")));
        let b = routed("b.Orders", "get", &["oid"], Some(("GET", "/orders/{oid}")));
        let doc = document(&[b, a], &info());
        assert_eq!(
            doc["paths"]["/orders/{id}"]["get"]["operationId"],
            "a.Orders.get"
        );
        assert!(doc["paths"].get("/orders/{oid}").is_none(), "{doc}");
        let moved = &doc["paths"]["/api/b.Orders/get"]["post"];
        assert_eq!(moved["operationId"], "b.Orders.get");
        assert_eq!(
            moved["requestBody"]["content"]["application/json"]["schema"]["required"],
            json!(["oid"])
        );
    }

    #[test]
    fn one_path_spelled_two_ways_under_two_methods_is_documented_under_one_spelling() {
        let get = routed("shop.Orders", "get", &["id"], Some(("GET", "/orders/{id}")));
        let cancel = routed(
            "shop.Orders",
            "cancel",
            &["order_id"],
            Some(("DELETE", "/orders/{order_id}")),
        );
        let doc = document(&[get, cancel], &info());
        let paths = doc["paths"].as_object().unwrap();
        // OpenAPI: templated paths of one hierarchy with different names must not both exist.
        assert!(
            !paths.contains_key("/orders/{id}") || !paths.contains_key("/orders/{order_id}"),
            "{doc}"
        );
        // `cancel` sorts first, so its spelling is the path's; `get` goes to its default route.
        assert_eq!(
            paths["/orders/{order_id}"]["delete"]["operationId"],
            "shop.Orders.cancel"
        );
        assert_eq!(
            paths["/api/shop.Orders/get"]["post"]["operationId"],
            "shop.Orders.get"
        );
    }

    #[test]
    fn a_reference_nobody_defines_gets_a_placeholder() {
        let e = entry(
            "x.Y",
            "z",
            Some(api(&[], None, Some(schemas(vec![], refs("Gone"), &[])))),
        );
        let doc = document(&[e], &info());
        assert!(doc["components"]["schemas"]["Gone"].is_object());
    }

    #[test]
    fn path_parameters_are_read_from_the_template() {
        assert_eq!(path_params("/a/{id}/b/{*rest}"), vec!["id", "rest"]);
        assert_eq!(path_params("/a/{unclosed"), Vec::<String>::new());
    }
}
