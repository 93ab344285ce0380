//! The route table: which entry answers a method and a path, built from the entries the registry
//! publishes and replaced whole when they change.
//!
//! Why a table of its own rather than an axum `Router` rebuilt per change: declared routes come
//! from servers the gateway does not control, so two of them may collide, and axum's router
//! panics on a conflicting route where `matchit` (the matcher axum itself is built on, with the
//! same `{name}` templates) returns an error the gateway can log and step around (the second
//! entry stays reachable at its default route). A table is also a plain value: requests read the
//! current one through an `ArcSwap` with no lock, and a change builds the next one beside it.

use std::collections::BTreeMap;

use axum::http::Method;
use rpc_core::ServiceEntry;
use serde_json::Value;

use rpc_paths::template_shape;

use crate::route::{default_path, route_of, Route};

/// One entry the gateway serves, with what binding its arguments needs.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    /// The published entry.
    pub entry: ServiceEntry,
    /// Where it is served (its declared route, or the default one after a conflict).
    pub route: Route,
    /// Parameter names in declaration order; `None` when the entry publishes none (then only a
    /// positional JSON array is accepted).
    pub params: Option<Vec<String>>,
    /// Per parameter: its schema says it is a string, or a string or null (query and path
    /// values are then taken as text, not read as JSON).
    pub is_string: Vec<bool>,
    /// Per parameter: its schema accepts `null` (a missing argument is then sent as `null`).
    pub nullable: Vec<bool>,
}

/// What a lookup found.
pub(crate) enum Found<'a> {
    /// The entry and the path parameters, still percent-encoded.
    Entry(&'a Served, Vec<(String, String)>),
    /// The path is served, but with other methods.
    OtherMethods(Vec<Method>),
    /// Nothing is served at this path.
    Nothing,
}

/// The most parameters one route template may hold (see the constant's documentation).
pub(crate) use rpc_paths::MAX_PATH_PARAMS;

/// The routes of one set of entries.
#[derive(Default)]
pub(crate) struct RouteTable {
    served: Vec<Served>,
    routers: BTreeMap<String, matchit::Router<usize>>,
    /// Each template's spelling by its shape (`/orders/{}`), whatever the method: one path is
    /// one template, with one name per parameter (as OpenAPI requires of its paths).
    spellings: BTreeMap<String, String>,
    /// How many of `served` come first as the entries' own routes; the rest are the default
    /// routes of entries served at a declared route.
    documented: usize,
}

impl RouteTable {
    /// The table of `entries`. Every entry's default route is its own: they are taken first, so
    /// no declared route can take another entry's. Then each entry gets its declared route in
    /// the order given: the first of two entries declaring the same method and path (or paths
    /// that differ only in their parameters' names) wins, and the other is served at its
    /// default route. Stream entries are left out: HTTP answers one JSON value.
    pub(crate) fn build(entries: Vec<ServiceEntry>) -> RouteTable {
        let entries: Vec<ServiceEntry> = entries
            .into_iter()
            .filter(|entry| {
                let stream = entry.api.as_ref().is_some_and(|api| api.stream.is_some());
                if stream {
                    tracing::debug!(entry = %entry.id, "stream entries are not served over HTTP");
                }
                !stream
            })
            .collect();
        let mut taken = RouteTable::default();
        let defaults: Vec<Option<Route>> = entries
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                let route = default_route(entry);
                match taken.insert(&route, i) {
                    Ok(()) => Some(route),
                    Err(why) => {
                        tracing::warn!(entry = %entry.id, "the default route is not served: {why}");
                        None
                    }
                }
            })
            .collect();
        let mut routes = Vec::with_capacity(entries.len());
        for (i, (entry, default)) in entries.iter().zip(&defaults).enumerate() {
            let declared = route_of(entry);
            if Some(&declared) == default.as_ref() {
                routes.push(default.clone());
                continue;
            }
            let taken_by_it = if crate::route::overlaps_default_routes(&declared) {
                Err(format!(
                    "{} holds a parameter where default routes hold the service id, and would \
                     answer theirs",
                    declared.path
                ))
            } else if declared.method == Method::POST
                && rpc_paths::is_default_route_path(&crate::route::normalized_path(&declared.path))
            {
                Err(format!(
                    "{} is the path of another entry's default route, and would answer its \
                     calls whenever its service has no instance",
                    declared.path
                ))
            } else if let Some(name) = named_twice(&declared) {
                // Every request would be refused, the argument given twice.
                Err(format!("{} names {{{name}}} twice", declared.path))
            } else if let Some(name) = not_a_param(entry, &declared) {
                // Every request would be refused for an argument the caller did not choose
                // (a server built otherwise than by the macro, which refuses such a route).
                Err(format!(
                    "{} names {{{name}}}, which is not a parameter of the method",
                    declared.path
                ))
            } else {
                taken.insert(&declared, i)
            };
            match taken_by_it {
                Ok(()) => routes.push(Some(declared)),
                Err(why) => {
                    match &default {
                        Some(route) => tracing::warn!(
                            entry = %entry.id,
                            method = %declared.method,
                            path = %declared.path,
                            "the declared route is not served ({why}); the entry is served at \
                             POST {} instead",
                            route.path
                        ),
                        None => tracing::warn!(
                            entry = %entry.id,
                            method = %declared.method,
                            path = %declared.path,
                            "the entry is not served: its declared route is not ({why})"
                        ),
                    }
                    routes.push(default.clone());
                }
            }
        }
        // The table itself: each entry at the route it got (a subset of the routes taken, so
        // none of them conflicts), then at its default route as well when it got a declared
        // one: which entry wins a declared route changes as services come and go, and the
        // default route stays the entry's whatever happens to the others.
        let mut table = RouteTable::default();
        let mut aliases = Vec::new();
        for ((entry, route), default) in entries.into_iter().zip(routes).zip(defaults) {
            let Some(route) = route else { continue };
            match table.insert(&route, table.served.len()) {
                Ok(()) => {
                    if let Some(default) = default.filter(|d| *d != route) {
                        aliases.push(served(entry.clone(), default));
                    }
                    table.served.push(served(entry, route));
                }
                Err(why) => tracing::warn!(entry = %entry.id, "the entry is not served: {why}"),
            }
        }
        table.documented = table.served.len();
        for alias in aliases {
            match table.insert(&alias.route, table.served.len()) {
                Ok(()) => table.served.push(alias),
                Err(why) => tracing::warn!(
                    entry = %alias.entry.id,
                    "the entry is not served at its default route: {why}"
                ),
            }
        }
        table
    }

    fn insert(&mut self, route: &Route, index: usize) -> Result<(), String> {
        // Matched in the form requests are (`normalized_path`): a template written with
        // escapes (`/caf%C3%A9`) is the same route as one written with its text.
        let path = crate::route::normalized_path(&route.path).into_owned();
        if let Some(reserved) = rpc_paths::reserved_match(&path) {
            return Err(format!(
                "{} can match the gateway's own route {reserved}, which is answered first",
                route.path
            ));
        }
        if !route.path.starts_with('/') {
            return Err(format!("{:?} does not start with /", route.path));
        }
        // Counted as the matcher reads the template (an escaped brace is text).
        let params = path.matches('{').count();
        if params > MAX_PATH_PARAMS {
            return Err(format!(
                "{} has {params} parameters, more than the {MAX_PATH_PARAMS} a route may have",
                route.path
            ));
        }
        let shape = template_shape(&path);
        if let Some(spelled) = self.spellings.get(&shape) {
            if *spelled != path {
                return Err(format!(
                    "{} is the path {spelled} with other parameter names",
                    route.path
                ));
            }
        }
        let router = self.routers.entry(route.method.to_string()).or_default();
        router
            .insert(path.clone(), index)
            .map_err(|e| format!("{e}"))?;
        self.spellings.insert(shape, path);
        Ok(())
    }

    /// The entries served, in table order, each once: at its declared route when it got it,
    /// else at its default route (an entry served at a declared route answers at its default
    /// route too, which is not listed here).
    pub(crate) fn served(&self) -> &[Served] {
        &self.served[..self.documented]
    }

    /// The entry serving `method` at `path` (HEAD falls back to GET).
    pub(crate) fn find(&self, method: &Method, path: &str) -> Found<'_> {
        let get = (method == Method::HEAD).then_some(Method::GET.as_str());
        for m in std::iter::once(method.as_str()).chain(get) {
            if let Some(Ok(matched)) = self.routers.get(m).map(|r| r.at(path)) {
                let params = matched
                    .params
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                return Found::Entry(&self.served[*matched.value], params);
            }
        }
        // A POST to a default route's path (`/api/<service>/<method>`) is a call of that entry,
        // which is not served now: not a request for the route of another method that matches
        // it only through a parameter where the service id goes (`GET /api/{kind}/{id}`), to
        // be redirected there with a 405. A route naming that segment (`GET /api/v1/orders`)
        // is the path's own, and its methods are named.
        // (Every method serving the path is named in `Allow` when any of them owns it.)
        let default_call = method == Method::POST && default_route_shaped(path);
        let mut owned = !default_call;
        let others: Vec<Method> = self
            .routers
            .iter()
            .filter(|(_, r)| {
                r.at(path).is_ok_and(|m| {
                    let template = crate::route::normalized_path(&self.served[*m.value].route.path);
                    owned |= !rpc_paths::overlaps_default_routes(&template);
                    true
                })
            })
            .filter_map(|(m, _)| Method::from_bytes(m.as_bytes()).ok())
            .collect();
        if !owned {
            return Found::Nothing;
        }
        if others.is_empty() {
            Found::Nothing
        } else {
            Found::OtherMethods(others)
        }
    }
}

/// Whether `path` has the shape of a default route, `/api/<service id>/<method>`.
fn default_route_shaped(path: &str) -> bool {
    let parts: Option<Vec<&str>> = path
        .strip_prefix("/api/")
        .map(|rest| rest.split('/').collect());
    matches!(parts.as_deref(), Some([service, method]) if !service.is_empty() && !method.is_empty())
}

/// The first parameter `route`'s path names that `entry` does not publish as one of its
/// parameters, if any.
fn not_a_param(entry: &ServiceEntry, route: &Route) -> Option<String> {
    let params = entry.api.as_ref().map_or(&[][..], |api| &api.params[..]);
    crate::openapi::path_params(&route.path)
        .into_iter()
        .find(|name| !params.contains(name))
}

/// The first parameter `route`'s path names more than once, if any.
fn named_twice(route: &Route) -> Option<&str> {
    let mut seen: Vec<&str> = Vec::new();
    crate::openapi::path_param_names(&route.path).find(|name| {
        let twice = seen.contains(name);
        seen.push(name);
        twice
    })
}

/// `POST /api/{service id}/{method}`: where `entry` is served when it declares no route, or
/// when its declared route is taken.
fn default_route(entry: &ServiceEntry) -> Route {
    Route {
        method: Method::POST,
        path: default_path(entry.service_id.as_str(), &entry.method),
    }
}

fn served(entry: ServiceEntry, route: Route) -> Served {
    let api = entry.api.as_ref();
    let params = api.map(|api| api.params.clone());
    let count = params.as_ref().map_or(0, Vec::len);
    let schemas = api.and_then(|a| a.schemas.as_ref());
    let shape = |i: usize, of: fn(&Value, &Definitions) -> bool| {
        schemas.is_some_and(|s| s.params.get(i).is_some_and(|p| of(p, &s.definitions)))
    };
    let is_string = (0..count).map(|i| shape(i, is_text)).collect();
    let nullable = (0..count).map(|i| shape(i, accepts_null)).collect();
    Served {
        entry,
        route,
        params,
        is_string,
        nullable,
    }
}

/// The named schemas an entry's schemas refer to (`#/components/schemas/<name>`).
pub(crate) type Definitions = serde_json::Map<String, Value>;

/// The schema a `{"$ref": "#/components/schemas/<name>"}` names among `definitions` (following
/// a few references at most), or `schema` itself.
fn resolve<'a>(mut schema: &'a Value, definitions: &'a Definitions) -> &'a Value {
    for _ in 0..8 {
        let Some(name) = schema
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.rsplit('/').next())
        else {
            break;
        };
        match definitions.get(name) {
            Some(next) => schema = next,
            None => break,
        }
    }
    schema
}

/// The `type` names a schema lists (`"string"` or `["string", "null"]`).
fn types(schema: &Value) -> Vec<String> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

/// The branches of a schema's `anyOf` or `oneOf` (how schemars writes `Option<T>` of a named
/// type: the type's reference, and `null`).
fn branches(schema: &Value) -> impl Iterator<Item = &Value> {
    ["anyOf", "oneOf"]
        .into_iter()
        .filter_map(|k| schema.get(k).and_then(Value::as_array))
        .flatten()
}

/// Schema nodes one question about a schema ([`accepts_null`], [`is_text`], [`is_structured`])
/// works out, at most (each once: a node met again is answered from memory).
const SCHEMA_STEPS: usize = 4096;

/// One question's walk through a schema's branches. A published schema may refer to itself
/// (a recursive type, as schemars writes `enum Expr { Lit(i64), Neg(Box<Expr>) }`) or fan out
/// through references to references: a schema already on the walk's path answers no, and
/// each schema is worked out once (past [`SCHEMA_STEPS`], no), instead of the walk recursing
/// until the stack overflows, or for ever.
struct Walk<'a> {
    definitions: &'a Definitions,
    steps: usize,
    path: Vec<*const Value>,
    answers: std::collections::HashMap<*const Value, bool>,
}

impl<'a> Walk<'a> {
    fn new(definitions: &'a Definitions) -> Self {
        Walk {
            definitions,
            steps: SCHEMA_STEPS,
            path: Vec::new(),
            answers: std::collections::HashMap::new(),
        }
    }

    /// `schema` resolved, with `ask` of it, or no where the walk stops.
    fn ask(&mut self, schema: &'a Value, ask: impl FnOnce(&mut Self, &'a Value) -> bool) -> bool {
        let schema = resolve(schema, self.definitions);
        let at = std::ptr::from_ref(schema);
        if let Some(&answer) = self.answers.get(&at) {
            return answer;
        }
        if self.steps == 0 || self.path.contains(&at) {
            return false;
        }
        self.steps -= 1;
        self.path.push(at);
        let answer = ask(self, schema);
        self.path.pop();
        self.answers.insert(at, answer);
        answer
    }
}

/// Whether a schema accepts `null`: its type lists `null`, or one branch of its `anyOf` /
/// `oneOf` does.
pub(crate) fn accepts_null(schema: &Value, definitions: &Definitions) -> bool {
    fn ask<'a>(walk: &mut Walk<'a>, schema: &'a Value) -> bool {
        types(schema).iter().any(|t| t == "null") || branches(schema).any(|b| walk.ask(b, ask))
    }
    Walk::new(definitions).ask(schema, ask)
}

/// Whether a schema takes only text, or text or `null` (`String`, `Option<String>`, a string
/// enum, or a reference to one): a query or path value is then the text itself.
pub(crate) fn is_text(schema: &Value, definitions: &Definitions) -> bool {
    fn ask<'a>(walk: &mut Walk<'a>, schema: &'a Value) -> bool {
        let types = types(schema);
        let mut others = types.iter().filter(|t| *t != "null").peekable();
        if others.peek().is_some() {
            return others.all(|t| t == "string");
        }
        // No type of its own: text when every branch that is not `null` is text.
        let definitions = walk.definitions;
        let mut branches = branches(schema)
            .filter(|b| types_of(b, definitions) != ["null"])
            .peekable();
        branches.peek().is_some() && branches.all(|b| walk.ask(b, ask))
    }
    Walk::new(definitions).ask(schema, ask)
}

/// Whether a schema takes arrays or objects (or a branch of it does): such a query value is
/// JSON text, which an OpenAPI parameter says with `content`, not with a form `style`.
pub(crate) fn is_structured(schema: &Value, definitions: &Definitions) -> bool {
    fn ask<'a>(walk: &mut Walk<'a>, schema: &'a Value) -> bool {
        types(schema).iter().any(|t| t == "array" || t == "object")
            || schema.get("properties").is_some()
            || schema.get("items").is_some()
            || branches(schema).any(|b| walk.ask(b, ask))
    }
    Walk::new(definitions).ask(schema, ask)
}

fn types_of(schema: &Value, definitions: &Definitions) -> Vec<String> {
    types(resolve(schema, definitions))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::test_entries::routed;
    use serde_json::json;

    /// An entry taking `id` and every parameter its route's path names, served at `http` when
    /// given.
    fn entry(service: &str, method: &str, http: Option<(&str, &str)>) -> ServiceEntry {
        let mut params = vec!["id".to_string()];
        for name in http.map_or(vec![], |(_, path)| crate::openapi::path_params(path)) {
            if !params.contains(&name) {
                params.push(name);
            }
        }
        let params: Vec<&str> = params.iter().map(String::as_str).collect();
        routed(service, method, &params, http)
    }

    fn found(table: &RouteTable, method: Method, path: &str) -> Option<String> {
        match table.find(&method, path) {
            Found::Entry(s, _) => Some(s.entry.id.to_string()),
            _ => None,
        }
    }

    /// Asserts that `table` serves `method path` with the entry `id` (`None`: with none).
    #[track_caller]
    fn serves(table: &RouteTable, method: Method, path: &str, id: Option<&str>) {
        assert_eq!(
            found(table, method.clone(), path).as_deref(),
            id,
            "{method} {path}"
        );
    }

    #[test]
    fn the_first_of_two_entries_declaring_one_route_wins_and_the_second_keeps_its_default() {
        let table = RouteTable::build(vec![
            entry("a.A", "get", Some(("GET", "/orders/{id}"))),
            entry("b.B", "get", Some(("GET", "/orders/{id}"))),
        ]);
        serves(&table, Method::GET, "/orders/7", Some("a.A.get"));
        serves(&table, Method::POST, "/api/b.B/get", Some("b.B.get"));
        // The winner answers at its default route too.
        serves(&table, Method::POST, "/api/a.A/get", Some("a.A.get"));
        // Each is documented once, at the route it got.
        let routes: Vec<(String, String)> = table
            .served()
            .iter()
            .map(|s| (s.entry.id.as_str().to_string(), s.route.path.clone()))
            .collect();
        assert_eq!(
            routes,
            [
                ("a.A.get".to_string(), "/orders/{id}".to_string()),
                ("b.B.get".to_string(), "/api/b.B/get".to_string()),
            ]
        );
    }

    /// Which of two entries declaring one route wins changes as their services come and go;
    /// the loser's default route, where callers were sent while both ran, stays its own when
    /// the winner's service is gone and it takes the declared route.
    #[test]
    fn an_entry_keeps_its_default_route_when_it_takes_a_declared_one() {
        let table = RouteTable::build(vec![entry("b.B", "get", Some(("GET", "/orders/{id}")))]);
        serves(&table, Method::GET, "/orders/7", Some("b.B.get"));
        serves(&table, Method::POST, "/api/b.B/get", Some("b.B.get"));
        assert_eq!(table.served().len(), 1);
    }

    /// A POST route written as another entry's default route would answer that entry's calls
    /// whenever its service has no instance: the entry is served at its own default route only.
    #[test]
    fn a_route_written_as_an_absent_entrys_default_route_is_not_served() {
        let table = RouteTable::build(vec![entry(
            "a.Admin",
            "purge",
            Some(("POST", "/api/shop.Orders/cancel")),
        )]);
        serves(&table, Method::POST, "/api/shop.Orders/cancel", None);
        serves(
            &table,
            Method::POST,
            "/api/a.Admin/purge",
            Some("a.Admin.purge"),
        );
        assert_eq!(table.served()[0].route.path, "/api/a.Admin/purge");
    }

    #[test]
    fn a_path_spelled_with_other_parameter_names_is_not_served_under_another_method() {
        let table = RouteTable::build(vec![
            entry("a.A", "get", Some(("GET", "/orders/{id}"))),
            entry("a.A", "cancel", Some(("DELETE", "/orders/{order_id}"))),
            entry("a.A", "put", Some(("PUT", "/orders/{id}"))),
        ]);
        serves(&table, Method::GET, "/orders/7", Some("a.A.get"));
        // The same spelling is one path.
        serves(&table, Method::PUT, "/orders/7", Some("a.A.put"));
        serves(&table, Method::DELETE, "/orders/7", None);
        serves(&table, Method::POST, "/api/a.A/cancel", Some("a.A.cancel"));
    }

    #[test]
    fn a_declared_route_cannot_take_another_entrys_default_route() {
        // `a.Admin` comes first and declares the route `shop.Orders.cancel` is served at.
        let table = RouteTable::build(vec![
            entry(
                "a.Admin",
                "purge",
                Some(("POST", "/api/shop.Orders/cancel")),
            ),
            entry("shop.Orders", "cancel", None),
        ]);
        serves(
            &table,
            Method::POST,
            "/api/shop.Orders/cancel",
            Some("shop.Orders.cancel"),
        );
        serves(
            &table,
            Method::POST,
            "/api/a.Admin/purge",
            Some("a.Admin.purge"),
        );
        assert_eq!(table.served().len(), 2);
    }

    /// A declared path naming what is not a parameter of the method (published by a server the
    /// macro did not build) would refuse every request for an argument the caller did not
    /// choose: the entry is served at its default route instead.
    #[test]
    fn a_template_naming_no_parameter_of_the_method_is_served_at_the_default_route() {
        let table = RouteTable::build(vec![
            routed("a.A", "get", &["id"], Some(("GET", "/orders/{order}"))),
            routed("b.B", "get", &[], Some(("GET", "/items/{id}"))),
            routed("c.C", "get", &["id"], Some(("GET", "/carts/{id}"))),
        ]);
        serves(&table, Method::GET, "/orders/7", None);
        serves(&table, Method::POST, "/api/a.A/get", Some("a.A.get"));
        serves(&table, Method::GET, "/items/7", None);
        serves(&table, Method::POST, "/api/b.B/get", Some("b.B.get"));
        serves(&table, Method::GET, "/carts/7", Some("c.C.get"));
    }

    /// A declared path naming one parameter twice (published by a server the macro did not
    /// build: the macro refuses it) would refuse every request, the argument given twice: the
    /// entry is served at its default route instead.
    /// A declared route that can match one of the gateway's own paths (`/{slug}` takes
    /// `/docs`) is not served as declared: the gateway's routes are answered first, so a call
    /// of the route at that path got the documentation page (200) while the document promised
    /// the entry there. Its entry is served at its default route.
    #[test]
    fn a_template_that_can_match_the_gateways_own_paths_is_served_at_the_default_route() {
        for template in ["/{slug}", "/do{x}", "/{*rest}", "/healthz"] {
            let table = RouteTable::build(vec![entry("a.A", "show", Some(("GET", template)))]);
            serves(&table, Method::GET, "/anything", None);
            serves(&table, Method::POST, "/api/a.A/show", Some("a.A.show"));
            assert_eq!(table.served()[0].route.path, "/api/a.A/show", "{template}");
        }
        let table = RouteTable::build(vec![entry("a.A", "show", Some(("GET", "/pages/{slug}")))]);
        serves(&table, Method::GET, "/pages/docs", Some("a.A.show"));
    }

    #[test]
    fn a_template_naming_a_parameter_twice_is_served_at_the_default_route() {
        let table = RouteTable::build(vec![entry("a.A", "get", Some(("GET", "/a/{id}/b/{id}")))]);
        serves(&table, Method::GET, "/a/1/b/1", None);
        serves(&table, Method::POST, "/api/a.A/get", Some("a.A.get"));
        assert_eq!(table.served()[0].route.path, "/api/a.A/get");
    }

    #[test]
    fn a_template_with_more_parameters_than_a_route_may_have_is_served_at_the_default_route() {
        // The matcher panics from its 26th parameter on.
        let path: String = (0..26).map(|i| format!("/{{p{i}}}")).collect();
        let table = RouteTable::build(vec![entry("a.A", "many", Some(("GET", &path)))]);
        serves(&table, Method::POST, "/api/a.A/many", Some("a.A.many"));
    }

    #[test]
    fn entries_named_in_other_scripts_are_found_at_their_percent_encoded_paths() {
        let table = RouteTable::build(vec![
            entry("商店.Orders", "größe", None),
            entry("a.A", "get", Some(("GET", "/bücher/{id}"))),
        ]);
        // As a client sends them: percent-encoded (uppercase or lowercase hex).
        let sent = "/api/%E5%95%86%E5%BA%97.Orders/gr%c3%b6%C3%9Fe";
        let at = |method, path: &str| found(&table, method, &crate::route::normalized_path(path));
        assert_eq!(at(Method::POST, sent).as_deref(), Some("商店.Orders.größe"));
        assert_eq!(
            at(Method::GET, "/b%C3%BCcher/7").as_deref(),
            Some("a.A.get")
        );
        match table.find(
            &Method::GET,
            &crate::route::normalized_path("/b%C3%BCcher/caf%C3%A9"),
        ) {
            Found::Entry(_, params) => assert_eq!(params, [("id".into(), "café".into())]),
            _ => panic!("not found"),
        }
        // Matched as it came, the path names nothing.
        serves(&table, Method::POST, sent, None);
        // A template written with escapes is matched as requests are.
        let table = RouteTable::build(vec![entry("a.A", "get", Some(("GET", "/caf%C3%A9/{id}")))]);
        let at = |path: &str| found(&table, Method::GET, &crate::route::normalized_path(path));
        assert_eq!(at("/caf%C3%A9/1").as_deref(), Some("a.A.get"));
        assert_eq!(at("/café/1").as_deref(), Some("a.A.get"));
    }

    #[test]
    fn stream_entries_and_reserved_paths_are_not_served_as_declared() {
        let mut stream = entry("s.S", "watch", None);
        stream.api.as_mut().unwrap().stream = Some("server".into());
        let table = RouteTable::build(vec![stream, entry("d.D", "docs", Some(("GET", "/docs")))]);
        serves(&table, Method::POST, "/api/s.S/watch", None);
        serves(&table, Method::GET, "/docs", None);
        serves(&table, Method::POST, "/api/d.D/docs", Some("d.D.docs"));
        // Nor spelled with escapes.
        let table = RouteTable::build(vec![entry("d.D", "doc", Some(("GET", "/%6Fpenapi.json")))]);
        let at = |path: &str| found(&table, Method::GET, &crate::route::normalized_path(path));
        assert_eq!(at("/%6Fpenapi.json"), None);
        serves(&table, Method::POST, "/api/d.D/doc", Some("d.D.doc"));
    }

    /// Braces a template holds escaped (`%7B`, `%7D`) are text, not parameters: such a path
    /// is served as the literal path it spells, and any number of them builds a table. Before,
    /// they were decoded into parameters (uncounted), and 26 of them made the matcher panic.
    #[test]
    fn escaped_braces_in_a_template_are_text() {
        let many = "/x".to_string() + &"/%7Bp%7D".repeat(26);
        let table = RouteTable::build(vec![
            entry("a.A", "get", Some(("GET", "/x/%7Bid%7D"))),
            entry("b.B", "get", Some(("GET", &many))),
        ]);
        let at = |path: &str| match table.find(&Method::GET, &crate::route::request_path(path)) {
            Found::Entry(s, params) => Some((s.entry.id.to_string(), params)),
            _ => None,
        };
        assert_eq!(at("/x/%7Bid%7D"), Some(("a.A.get".into(), Vec::new())));
        assert_eq!(at("/x/{id}"), Some(("a.A.get".into(), Vec::new())));
        assert_eq!(at("/x/42"), None);
        assert_eq!(at(&many), Some(("b.B.get".into(), Vec::new())));
    }

    /// A service id or method holding braces is served at its default route as text: the
    /// route takes no parameter, so it answers its own path only.
    #[test]
    fn braces_in_a_service_id_are_text_in_its_default_route() {
        let table = RouteTable::build(vec![entry("a{b}.S", "m{n}", None)]);
        let at = |path: &str| found(&table, Method::POST, &crate::route::request_path(path));
        assert_eq!(
            at("/api/a%7Bb%7D.S/m%7bn%7d").as_deref(),
            Some("a{b}.S.m{n}")
        );
        assert_eq!(at("/api/a{b}.S/m{n}").as_deref(), Some("a{b}.S.m{n}"));
        assert_eq!(at("/api/axyz.S/mq"), None);
    }

    /// A declared POST template with a parameter where default routes hold the service id
    /// would answer the default route of any entry not served at the moment: it is served at
    /// its own default route instead, however its path is spelled. One naming the service
    /// (`/api/orders/{id}`), or that no default route can reach, is served as declared.
    #[test]
    fn a_template_taking_the_service_id_s_place_is_not_served_as_declared() {
        let table = RouteTable::build(vec![
            entry("a.A", "get", Some(("POST", "/api/{id}/x"))),
            entry("b.B", "get", Some(("POST", "/{id}/{x}/{y}"))),
            entry("c.C", "get", Some(("POST", "/api/{*id}"))),
            entry("f.F", "get", Some(("POST", "/%61pi/{id}/{x}"))),
            entry("g.G", "get", Some(("POST", "/a{p}/{id}/{x}"))),
            entry("k.K", "get", Some(("POST", "/api{p}/{id}/{x}"))),
            entry("d.D", "get", Some(("POST", "/api/orders/{id}"))),
            entry("e.E", "get", Some(("POST", "/api/{id}"))),
            entry("h.H", "get", Some(("GET", "/api/{id}/{x}"))),
            entry("i.I", "get", Some(("POST", "/v{id}/{x}/{y}"))),
            entry("j.J", "get", Some(("POST", "/api/{id}/{x}/"))),
            entry("l.L", "get", Some(("POST", "/api{*id}"))),
            entry("m.M", "get", Some(("POST", "/api/s{*id}"))),
        ]);
        for (id, default) in [
            ("a.A.get", "/api/a.A/get"),
            ("b.B.get", "/api/b.B/get"),
            ("c.C.get", "/api/c.C/get"),
            ("f.F.get", "/api/f.F/get"),
            ("g.G.get", "/api/g.G/get"),
            ("k.K.get", "/api/k.K/get"),
            ("l.L.get", "/api/l.L/get"),
            ("m.M.get", "/api/m.M/get"),
        ] {
            serves(&table, Method::POST, default, Some(id));
        }
        // Not there, the default route of an entry is nobody's, and no route is served as
        // declared that would have answered it.
        serves(&table, Method::POST, "/api/shop.Orders/cancel", None);
        serves(&table, Method::POST, "/apiv1/7/8", None);
        // Served as declared: a fixed service segment, two segments, another method, a first
        // segment that cannot be `api`, a trailing slash.
        serves(&table, Method::POST, "/api/orders/7", Some("d.D.get"));
        serves(&table, Method::POST, "/api/7", Some("e.E.get"));
        serves(&table, Method::GET, "/api/7/8", Some("h.H.get"));
        serves(&table, Method::POST, "/v1/2/3", Some("i.I.get"));
        serves(&table, Method::POST, "/api/7/8/", Some("j.J.get"));
        // A POST to a default route's path that only another method's route matches, through
        // a parameter where the service id goes, is a call of an entry not served (404), not a
        // request to be sent to that route (405).
        assert!(matches!(
            table.find(&Method::POST, "/api/shop.Orders/cancel"),
            Found::Nothing
        ));
        assert!(matches!(
            table.find(&Method::DELETE, "/api/shop.Orders/cancel"),
            Found::OtherMethods(_)
        ));
    }

    #[test]
    fn a_path_served_with_another_method_names_the_methods() {
        let table = RouteTable::build(vec![
            entry("a.A", "get", Some(("GET", "/orders/{id}"))),
            entry("b.B", "list", Some(("GET", "/api/v1/orders"))),
            entry("c.C", "drop", Some(("DELETE", "/api/carts/{id}"))),
            entry("d.D", "any", Some(("PUT", "/api/{kind}/{id}"))),
        ]);
        match table.find(&Method::DELETE, "/orders/1") {
            Found::OtherMethods(m) => assert_eq!(m, vec![Method::GET]),
            _ => panic!("expected the other methods"),
        }
        // Under `/api/`, a route naming the service's segment is its path's own: a POST there
        // is a wrong method (405), not a call of an entry `v1.orders` (404).
        // Every method serving the path is named then, one matching only through a parameter
        // where the service id goes included (PUT /api/{kind}/{id} serves /api/carts/7 too).
        for (path, methods) in [
            ("/api/v1/orders", vec![Method::GET, Method::PUT]),
            ("/api/carts/7", vec![Method::DELETE, Method::PUT]),
        ] {
            match table.find(&Method::POST, path) {
                Found::OtherMethods(mut m) => {
                    m.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                    assert_eq!(m, methods, "{path}");
                }
                _ => panic!("{path}: expected the other methods"),
            }
        }
        // Only such a route matching: a call of an entry not served.
        assert!(matches!(
            table.find(&Method::POST, "/api/shop.Orders/cancel"),
            Found::Nothing
        ));
        assert!(matches!(
            table.find(&Method::GET, "/nothing"),
            Found::Nothing
        ));
    }

    /// A schema that refers to itself through its branches (a recursive type, as schemars
    /// writes one) or fans out through references is answered, not walked until the stack
    /// overflows or for ever; a `null` branch after the reference back is still found.
    #[test]
    fn a_recursive_or_fanning_schema_is_answered_without_walking_for_ever() {
        let to = |name: &str| json!({ "$ref": format!("#/components/schemas/{name}") });
        let Value::Object(definitions) = json!({
            "Expr": { "anyOf": [{ "type": "integer" }, to("Expr")] },
            "MaybeExpr": { "anyOf": [to("MaybeExpr"), { "type": "null" }] },
            "Words": { "oneOf": [to("Words"), to("Words"), { "type": "string" }] },
            "Wide": { "anyOf": (0..16).map(|_| to("Wider")).collect::<Vec<_>>() },
            "Wider": { "anyOf": (0..16).map(|_| to("Widest")).collect::<Vec<_>>() },
            "Widest": { "anyOf": (0..16).map(|_| to("Wide")).collect::<Vec<_>>() },
        }) else {
            unreachable!()
        };
        assert!(!accepts_null(&to("Expr"), &definitions));
        assert!(!is_text(&to("Expr"), &definitions));
        assert!(!is_structured(&to("Expr"), &definitions));
        assert!(accepts_null(&to("MaybeExpr"), &definitions));
        assert!(!is_text(&to("Words"), &definitions), "not text alone");
        for ask in [accepts_null, is_text, is_structured] {
            assert!(!ask(&to("Wide"), &definitions));
        }
        // A large enum made optional (more variants than a walk once took steps) is still
        // found to take null.
        let Value::Object(large) = json!({
            "Big": { "oneOf": (0..300).map(|i| json!({ "type": "object", "title": format!("V{i}") })).collect::<Vec<_>>() },
            "MaybeBig": { "anyOf": [to("Big"), { "type": "null" }] },
        }) else {
            unreachable!()
        };
        assert!(accepts_null(&to("MaybeBig"), &large));
        assert!(is_structured(&to("MaybeBig"), &large));
    }

    #[test]
    fn string_and_nullable_parameters_are_read_from_the_schemas() {
        let mut e = entry("a.A", "find", None);
        let api = e.api.as_mut().unwrap();
        api.params = [
            "name",
            "limit",
            "n",
            "sku",
            "note",
            "maybe_sku",
            "ids",
            "either",
        ]
        .map(String::from)
        .to_vec();
        // As schemars 1 writes `String`, `Option<u32>` (two ways), a string newtype,
        // `Option<String>`, `Option<Sku>`, `Vec<u64>`, and an untagged text-or-number.
        api.schemas = Some(rpc_core::EntrySchemas {
            params: vec![
                json!({"type": "string"}),
                json!({"anyOf": [{"type": "integer"}, {"type": "null"}]}),
                json!({"type": ["integer", "null"]}),
                json!({"$ref": "#/components/schemas/Sku"}),
                json!({"type": ["string", "null"]}),
                json!({"anyOf": [{"$ref": "#/components/schemas/Sku"}, {"type": "null"}]}),
                json!({"type": "array", "items": {"type": "integer"}}),
                json!({"anyOf": [{"type": "string"}, {"type": "integer"}]}),
            ],
            definitions: [("Sku".to_string(), json!({"type": "string"}))]
                .into_iter()
                .collect(),
            ..Default::default()
        });
        let table = RouteTable::build(vec![e]);
        let s = &table.served()[0];
        assert_eq!(
            s.is_string,
            vec![true, false, false, true, true, true, false, false]
        );
        assert_eq!(
            s.nullable,
            vec![false, true, true, false, true, true, false, false]
        );
    }
}
