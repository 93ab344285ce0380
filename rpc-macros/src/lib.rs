//! # rpc-macros
//!
//! The `#[service]` attribute of the framework, re-exported as `rpc::service`: it turns a trait
//! into a client proxy, a server dispatcher and the static descriptors of the service's entries.
//!
//! **This crate owns code generation only.** It holds no runtime logic: encoding, calling,
//! governance, dispatch and error conversion all live in the other crates, and the generated code
//! reaches them only through the facade, as `::rpc::Client`, `::rpc::Service` and the helpers of
//! `::rpc::__private`. A change of runtime behaviour belongs there, not here; what is here only
//! decides which of those helpers a method calls, with which types and in which order. The
//! generated code therefore needs the user crate to depend on `rpc` (under that name).
//!
//! The modules follow the expansion: `parse` reads and checks the trait,
//! `governance` reads `#[governance(...)]` with the keys of `keys` (the options' one
//! declaration, shared with rpc-core), `http` reads `#[http(...)]` routes and doc comments,
//! `expand` writes the rewritten trait and the descriptor
//! table and calls `expand_client` and `expand_server` for the two generated types; the names
//! all three use are in `names`, so that no module imports from one that imports it back.
//!
//! See [`service`] for what is generated and what is rejected.
//!
//! ```
//! use rpc::RpcError;
//!
//! #[rpc::service(name = "doc.Counter")]
//! pub trait Counter {
//!     /// Adds `n` and returns the new total.
//!     #[governance(timeout_ms = 800)]
//!     async fn add(&self, n: u64) -> Result<u64, RpcError>;
//! }
//!
//! // Generated next to the trait: the proxy, the dispatcher and the entry descriptors.
//! assert_eq!(CounterClient::SERVICE_ID, "doc.Counter");
//! let entry = &CounterClient::methods()[0];
//! assert_eq!(entry.entry_id, "doc.Counter.add");
//! assert_eq!(entry.governance.timeout_ms, Some(800));
//!
//! // A caller holds an `rpc::Client` and calls the trait's methods on the proxy.
//! fn proxy(client: rpc::Client) -> CounterClient {
//!     CounterClient::new(client)
//! }
//! # let _ = proxy;
//! ```
#![warn(missing_docs)]

use proc_macro::TokenStream;

// The `host:port` rule of every other level of options, from its one source in rpc-core
// (std only): this crate runs in the compiler and depends on no framework crate.
#[path = "../../rpc-core/src/address.rs"]
mod address;
mod expand;
mod expand_client;
mod expand_server;
mod governance;
mod http;
mod keys;
mod names;
mod parse;

/// Turns a trait into an RPC service: a client proxy, a server dispatcher and entry descriptors.
///
/// ```
/// use rpc::{Codec, RemoteError, RpcError, Service, StatusCode};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, PartialEq, Serialize, Deserialize)]
/// pub struct Profile {
///     pub id: u64,
///     pub verbose: bool,
/// }
///
/// /// The service's own error type: it comes back to callers typed.
/// #[derive(Debug, PartialEq, Serialize, Deserialize)]
/// pub enum MyError {
///     NoSuchUser(u64),
///     Call(String),
/// }
///
/// impl From<RpcError> for MyError {
///     fn from(e: RpcError) -> Self {
///         MyError::Call(e.to_string())
///     }
/// }
///
/// #[rpc::service(name = "echo.Echo")]
/// pub trait Echo {
///     /// Says it back.
///     #[governance(timeout_ms = 800, retry_times = 2, idempotent)]
///     async fn echo(&self, text: String) -> Result<String, RpcError>;
///     /// Looks a user up; calls for one user go to the same server under the hash strategy.
///     async fn profile(&self, #[hash_key] user_id: u64, verbose: bool)
///         -> Result<Profile, MyError>;
///     /// Answers.
///     async fn ping(&self) -> Result<(), RpcError>;
/// }
///
/// struct Impl;
///
/// impl Echo for Impl {
///     async fn echo(&self, text: String) -> Result<String, RpcError> {
///         Ok(text)
///     }
///     async fn profile(&self, user_id: u64, verbose: bool) -> Result<Profile, MyError> {
///         match user_id {
///             0 => Err(MyError::NoSuchUser(0)),
///             id => Ok(Profile { id, verbose }),
///         }
///     }
///     async fn ping(&self) -> Result<(), RpcError> {
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // The descriptors, in declaration order.
/// let methods = EchoServer::<Impl>::methods();
/// assert_eq!(methods[1].entry_id, "echo.Echo.profile");
/// assert_eq!(methods[1].hash_key, Some(0));
/// assert_eq!(methods[0].governance.retry_times, Some(2));
///
/// // The dispatcher, called as the server calls it: method index, encoded argument tuple.
/// let server = EchoServer::new(Impl);
/// let codec = Codec::MsgPack;
/// let out = server.call(0, codec.encode(&("hi",)).unwrap(), codec).await.unwrap();
/// assert_eq!(codec.decode::<String>(&out).unwrap(), "hi");
///
/// // A typed error travels as a business error (1000) and decodes back.
/// let err = server.call(1, codec.encode(&(0u64, true)).unwrap(), codec).await.unwrap_err();
/// assert_eq!(err.code(), StatusCode::BusinessError);
/// assert_eq!(MyError::from_rpc_error(err), MyError::NoSuchUser(0));
/// # }
/// ```
///
/// A client calls the same methods on `EchoClient::new(client)`, where `client` is an
/// `rpc::Client`.
///
/// # The service
///
/// - The service id is `name = "..."`, or `"<module path>.<Trait>"` by default (from
///   `module_path!()`, for example `"my_crate::api.Echo"`).
/// - Every method is an entry with the id `"<service id>.<method>"`.
///
/// # What is generated
///
/// - **The trait**, with `Send + Sync + 'static` added to its supertraits and each
///   `async fn m(&self, a: A) -> R;` declared as
///   `fn m(&self, a: A) -> impl Future<Output = R> + Send;`. Implementations still write
///   `async fn m(&self, a: A) -> R { ... }`; the compiler then checks that their futures are
///   `Send`. Doc comments, other attributes and the visibility are kept.
/// - **The descriptor table**: a hidden `static __RPC_METHODS_<Trait>` (the trait's name as written) of
///   `rpc::MethodDescriptor`, one per method in declaration order, with the service id, method
///   name, entry id, the index of the `#[hash_key]` argument (`&self` not counted) and the
///   governance overrides of `#[governance(...)]`, and the function that builds the entry's
///   `rpc::EntryApi` when a server publishes it (the encoded parameters' names in order, the
///   doc comment, the `#[http]` route, the stream shape `"server"`, `"client"` or `"bidi"`);
///   and a hidden
///   `const __RPC_SERVICE_ID_<Trait>: &str`.
/// - **`<Trait>Client`** (same visibility as the trait; `Clone`, `Debug`): `new(rpc::Client)`,
///   `client()`, `SERVICE_ID`, `methods()`, and an implementation of the trait where each method
///   encodes its arguments as one tuple (`NoArgs` when there are none), hashes the
///   `#[hash_key]` argument, calls `rpc::Client::invoke` with the method's descriptor and decodes
///   the result. Errors reach the caller through `rpc::RemoteError::from_rpc_error`, so a typed
///   business error comes back as the user's error value.
/// - **`<Trait>Server<T>`** (same visibility; `Clone`, `Debug`): `new(T)`, `from_arc(Arc<T>)`,
///   `inner()`, `SERVICE_ID`, `methods()`, and `impl<T: Trait> rpc::Service`, whose `call`
///   decodes the argument tuple (a decoding failure is a validation error), runs the method and
///   encodes its `Ok` value, or turns its `Err` into an `RpcError` with
///   `rpc::RemoteError::into_rpc_error`. An unknown method index answers "not found".
///
/// # Method attributes
///
/// `#[governance(...)]` on a method sets the defaults of its entry (configuration files and
/// runtime updates still override them). Every governance option is a key, under the name of its
/// field in `GovernanceOverrides` and of its TOML key (the README's options tables and
/// `rpc_core::OPTIONS` list them by policy): integers as unsuffixed literals (`timeout_ms = 800`),
/// flags as `= true` or `= false` (`idempotent` and `adaptive_concurrency` also bare),
/// `shunt_strategy = "polling" | "random" | "hash" | "appoint" | "least_loaded"` (and the other
/// spellings the configuration file takes, which an unknown name's error lists),
/// `compression = "off" | "zstd" | "lz4"` and `appoint_address = "host:port"`. Several
/// `#[governance]` attributes add up; a key given twice is an error.
///
/// `#[hash_key]` on one argument makes it the key of the hash shunt strategy (which
/// `shunt_strategy = "hash"` requires).
///
/// `#[http(get = "/orders/{id}")]` (or `post`, `put`, `patch`, `delete`: one of them) declares
/// the route an HTTP gateway serves the method at; each `{name}` in the path is one of the
/// method's parameters, named once. Without it a gateway serves the method at
/// `POST /api/<service id>/<method>`. Streaming methods take no route: the gateway serves unary
/// methods only. The method's doc comment is published with the route, as its description.
///
/// ```
/// use rpc::RpcError;
///
/// #[rpc::service(name = "doc.Orders")]
/// pub trait Orders {
///     /// Reads one order.
///     #[http(get = "/orders/{id}")]
///     async fn get(&self, id: u64, verbose: bool) -> Result<String, RpcError>;
/// }
///
/// let api = (OrdersClient::methods()[0].api.expect("generated"))();
/// assert_eq!(api.params, ["id", "verbose"]);
/// assert_eq!(api.doc.as_deref(), Some("Reads one order."));
/// let route = api.http.expect("declared");
/// assert_eq!((route.method.as_str(), route.path.as_str()), ("GET", "/orders/{id}"));
/// ```
///
/// # JSON Schemas
///
/// Each entry's `rpc::EntryApi` carries JSON Schemas (draft 2020-12, as OpenAPI 3.1 uses) of
/// the parameters, of the result (`T` of `Result<T, E>`; one item for a server-streaming
/// method) and of a typed error `E` (none for `RpcError`), with the named types they refer to as
/// `#/components/schemas/<name>` in `definitions`. A type has a schema when it implements
/// `schemars::JsonSchema` (schemars 1.x): derive it through the facade's re-export,
/// `#[derive(rpc::schemars::JsonSchema)]` with `#[schemars(crate = "rpc::schemars")]`, or
/// depend on `schemars` directly. A type that does not implement it still compiles and is
/// published as `true` (any value).
///
/// ```
/// use rpc::RpcError;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, rpc::schemars::JsonSchema)]
/// #[schemars(crate = "rpc::schemars")]
/// pub struct Order {
///     pub id: u64,
///     pub item: String,
/// }
///
/// /// No schema: published as `true`.
/// #[derive(Serialize, Deserialize)]
/// pub struct Blob(Vec<u8>);
///
/// #[rpc::service(name = "doc.Shop")]
/// pub trait Shop {
///     async fn place(&self, blob: Blob) -> Result<Order, RpcError>;
/// }
///
/// let api = (ShopClient::methods()[0].api.expect("generated"))();
/// let schemas = api.schemas.expect("schemas");
/// assert_eq!(schemas.params[0], true);
/// assert_eq!(schemas.result["$ref"], "#/components/schemas/Order");
/// assert_eq!(schemas.definitions["Order"]["type"], "object");
/// assert!(schemas.error.is_none(), "RpcError is not a typed error");
/// ```
///
/// # What is rejected, with an error on the offending tokens
///
/// A method that is not `async`, that does not take `&self`, that is generic, that has a default
/// body (the client implements every method remotely, so a default would never run there), that
/// does not return `Result<T, E>`, whose arguments are patterns rather than names, or borrowed
/// (`&str`, also inside a type such as `Option<&str>`: the server decodes owned values), or more
/// than 16 besides a stream (they travel as one tuple, which serde encodes up to 16 elements);
/// a borrowed or `impl Trait` result or error type; a stream argument that is not the last, or
/// an `RpcStream` inside another type (`Option<RpcStream<T>>`); an argument named `__rpc…`
/// (the generated code's own names); two `#[hash_key]` arguments, one (or
/// `shunt_strategy = "hash"`) on a client-streaming method, or one whose type is written
/// `HashMap<..>` or `HashSet<..>` (a key is hashed from its encoding, which lists their entries
/// in an order that changes from value to value; such a collection inside another type, or
/// under another name, is not seen); `hedge_delay_ms` or
/// `hedge_percentile` on a streaming method (streams are never hedged); a service name with
/// whitespace or any of `/ { } ? # %`; an unknown `#[governance]`
/// key or a value of the wrong kind; an `#[http]` attribute with an unknown key, two methods, a
/// path not starting with `/`, one the gateway serves itself (`/openapi.json`, `/docs`,
/// `/healthz`), a `{name}` that names no parameter, names one twice or does not end its path
/// segment (`/orders/{id}.json`), on a streaming method, or a route (method and path, whatever
/// its `{names}`, and whatever the case of its escapes' hex digits) another method of the trait
/// already has; a generic or `unsafe` trait, and
/// trait items other than methods.
///
/// A stream is recognised by its name: an argument or `T` written `RpcStream<X>` (through any
/// path ending in `RpcStream`). A type alias of it, or an import of it under another name, is
/// not seen as a stream, and the method is then taken as unary (and fails to compile, as
/// `RpcStream` is not `Serialize`).
///
/// `E` is `rpc::RpcError` or a user type with `Serialize + DeserializeOwned + From<RpcError>`
/// (it then implements `rpc::RemoteError`). Argument types need `Serialize + DeserializeOwned +
/// Send + 'static`, and `T` needs `Serialize + DeserializeOwned`.
#[proc_macro_attribute]
pub fn service(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(attr.into(), item.into()).into()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    /// The modules of this crate that each module's code (its tests left out) names through
    /// `crate::`, read from the sources.
    fn imports() -> BTreeMap<String, Vec<String>> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
        let mut modules = BTreeMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if path.extension().is_some_and(|e| e == "rs") && name != "lib" {
                let text = std::fs::read_to_string(&path).unwrap();
                let code = text.split("#[cfg(test)]").next().unwrap_or("").to_string();
                modules.insert(name, code);
            }
        }
        let names: Vec<String> = modules.keys().cloned().collect();
        modules
            .into_iter()
            .map(|(module, code)| {
                let mut used: Vec<String> = Vec::new();
                for (i, _) in code.match_indices("crate::") {
                    let rest = &code[i + "crate::".len()..];
                    // `crate::a::..` or `crate::{a, b::..}`.
                    let list = match rest.strip_prefix('{') {
                        Some(inner) => &inner[..inner.find('}').unwrap_or(inner.len())],
                        None => rest
                            .split(|c: char| !c.is_alphanumeric() && c != '_')
                            .next()
                            .unwrap_or(""),
                    };
                    for part in list.split(',') {
                        let first = part.trim().split("::").next().unwrap_or("").trim();
                        if names.iter().any(|n| n == first)
                            && first != module
                            && !used.iter().any(|u| u == first)
                        {
                            used.push(first.to_string());
                        }
                    }
                }
                (module, used)
            })
            .collect()
    }

    #[test]
    fn module_imports_form_no_circle() {
        let graph = imports();
        assert!(
            graph["expand"].contains(&"expand_client".to_string()),
            "{graph:?}"
        );
        // Depth-first search from every module; a module met again on the current path closes
        // a circle.
        fn visit<'a>(
            graph: &'a BTreeMap<String, Vec<String>>,
            module: &'a str,
            path: &mut Vec<&'a str>,
        ) {
            if let Some(at) = path.iter().position(|m| *m == module) {
                panic!("import circle: {} -> {module}", path[at..].join(" -> "));
            }
            path.push(module);
            for next in &graph[module] {
                visit(graph, next, path);
            }
            path.pop();
        }
        for module in graph.keys() {
            visit(&graph, module, &mut Vec::new());
        }
    }
}
