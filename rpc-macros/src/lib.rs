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
//! The modules follow the expansion: [`parse`](crate::parse) reads and checks the trait,
//! `governance` reads `#[governance(...)]`, `expand` writes the rewritten trait and the
//! descriptor table, `expand_client` and `expand_server` the two generated types.
//!
//! See [`service`] for what is generated and what is rejected.
#![warn(missing_docs)]

use proc_macro::TokenStream;

mod expand;
mod expand_client;
mod expand_server;
mod governance;
mod parse;

/// Turns a trait into an RPC service: a client proxy, a server dispatcher and entry descriptors.
///
/// ```ignore
/// use rpc::RpcError;
///
/// #[rpc::service(name = "echo.Echo")]
/// pub trait Echo {
///     /// Says it back.
///     #[governance(timeout_ms = 800, retry_times = 2, idempotent)]
///     async fn echo(&self, text: String) -> Result<String, RpcError>;
///     async fn profile(&self, #[hash_key] user_id: u64, verbose: bool) -> Result<Profile, MyError>;
///     async fn ping(&self) -> Result<(), RpcError>;
/// }
/// ```
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
/// - **The descriptor table**: a hidden `static __RPC_METHODS_<TRAIT>` (upper snake case) of
///   `rpc::MethodDescriptor`, one per method in declaration order, with the service id, method
///   name, entry id, the index of the `#[hash_key]` argument (`&self` not counted) and the
///   governance overrides of `#[governance(...)]`; and a hidden
///   `const __RPC_SERVICE_ID_<TRAIT>: &str`.
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
/// runtime updates still override them). Keys: `timeout_ms`, `retry_times`,
/// `retry_interval_ms`, `enable_circuit_breaker`, `exceptions_allowed_before_breaking`,
/// `breaker_seconds`, `max_concurrent_handling_count`,
/// `unhealthy_times_allowed_before_removing` (integer or `true`/`false` literals), `idempotent`
/// (a bare flag, or `= true`/`= false`), `shunt_strategy = "polling" | "random" | "hash" |
/// "appoint"` and `appoint_address = "host:port"`. Several `#[governance]` attributes add up; a
/// key given twice is an error.
///
/// `#[hash_key]` on one argument makes it the key of the hash shunt strategy (which
/// `shunt_strategy = "hash"` requires).
///
/// # What is rejected, with an error on the offending tokens
///
/// A method that is not `async`, that does not take `&self`, that is generic, that has a default
/// body (the client implements every method remotely, so a default would never run there), that
/// does not return `Result<T, E>`, whose arguments are patterns rather than names, or borrowed
/// (`&str`: the server decodes owned values); two `#[hash_key]` arguments; an unknown
/// `#[governance]` key or a value of the wrong kind; a generic or `unsafe` trait, and trait items
/// other than methods.
///
/// `E` is `rpc::RpcError` or a user type with `Serialize + DeserializeOwned + From<RpcError>`
/// (it then implements `rpc::RemoteError`). Argument types need `Serialize + DeserializeOwned +
/// Send + 'static`, and `T` needs `Serialize + DeserializeOwned`.
#[proc_macro_attribute]
pub fn service(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(attr.into(), item.into()).into()
}
