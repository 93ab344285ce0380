//! # rpc
//!
//! An RPC framework with a built-in governance engine. Define a service as a trait, implement it
//! in one process, call it from another through the generated proxy; between the two, timeouts,
//! retries on overload, failover across endpoints and a server-side concurrency cap keep calls
//! healthy.
//!
//! This crate is the facade users depend on: it re-exports the pieces and the `#[service]`
//! attribute. It holds no logic of its own beyond the small helpers generated code calls and,
//! with feature `otel`, [`telemetry`]: installing the OpenTelemetry export.
//!
//! Observability: calls run in `rpc.client` / `rpc.client.attempt` and `rpc.server` `tracing`
//! spans carrying the OpenTelemetry RPC attributes, with governance events on them; user
//! attachments ([`RpcContext`]) follow a request from service to service. Feature `otel` adds
//! the W3C trace context across services (one trace from the first caller to the last callee)
//! and OpenTelemetry metrics (`rpc.client.duration`, `rpc.server.duration`, call counters,
//! in-flight counts and governance events by kind).
//!
//! With feature `logging` (on by default), [`logging::init`] prints those spans as short lines
//! for people, with a call id the client's and the server's lines of one call share.
//!
//! Governance decisions (retry, break, half-open, reset, timeout, overflow, fallback, reload,
//! ejection) reach [`Client::events`] and [`ServerHandle::events`] subscribers as
//! [`GovernanceEvent`]s of an [`EventKind`] on an [`EventBus`]; [`Client::breakers`] and
//! [`Client::breaker_state`] report each entry's [`BreakerState`].
//!
//! ```
//! use rpc::prelude::*;
//!
//! #[rpc::service(name = "doc.Greeter")]
//! pub trait Greeter {
//!     #[governance(timeout_ms = 800, retry_times = 2, idempotent)]
//!     async fn greet(&self, name: String) -> Result<String, RpcError>;
//! }
//!
//! struct Polite;
//! impl Greeter for Polite {
//!     async fn greet(&self, name: String) -> Result<String, RpcError> {
//!         Ok(format!("hello, {name}"))
//!     }
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let registry = InProcessRegistry::new();
//! let server = Server::builder()
//!     .registry(registry.clone())
//!     .add_service(GreeterServer::new(Polite))
//!     .serve("127.0.0.1:0")
//!     .await?;
//!
//! let client = Client::builder().registry(registry).build();
//! let greeter = GreeterClient::new(client);
//! assert_eq!(greeter.greet("ann".into()).await?, "hello, ann");
//! server.shutdown().await;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

/// A process's admin endpoint (feature `admin`): `rpc::admin::Admin::builder()`.
#[cfg(feature = "admin")]
pub use rpc_admin as admin;
pub use rpc_client::{answered_by, Client, ClientBuilder, RingKey};
/// Endpoint health as [`Client::endpoints`] reports it.
pub use rpc_client::{EndpointState, EndpointStatus};
pub use rpc_core::{
    serde_rpc_error, Codec, Compression, EntryApi, EntrySchemas, FieldError, GovernanceOptions,
    GovernanceOverrides, HttpRoute, MethodDescriptor, RemoteError, RpcContext, RpcError, RpcStream,
    ServiceEntry, ServiceEntryId, ServiceId, ShuntStrategy, StatusCode,
};
pub use rpc_governance::breaker::BreakerState;
pub use rpc_governance::events::{EventBus, EventKind, GovernanceEvent};
pub use rpc_governance::fallback::cause as fallback_cause;
pub use rpc_governance::routing::RoutingRules;
/// Client middleware: a layer around every call (`ClientBuilder::layer`) or every attempt
/// (`ClientBuilder::attempt_layer`), and the per-call context it sees.
pub use rpc_governance::stack::{middleware_fn, CallCx, Middleware, MiddlewareFn, Next};
pub use rpc_macros::service;
#[cfg(feature = "etcd")]
pub use rpc_registry::{EtcdOptions, EtcdRegistry, RuleStore};
pub use rpc_registry::{InProcessRegistry, Instance, Registry, RegistryError, StaticRegistry};
pub use rpc_registry::{RuleError, RuleKind, RuleSource, RuleVersion};
#[cfg(feature = "zookeeper")]
pub use rpc_registry::{ZooKeeperOptions, ZooKeeperRegistry};
/// `tower` layers as server layers (feature `tower`).
#[cfg(feature = "tower")]
pub use rpc_server::tower;
/// Server middleware (README, "Server middleware"): layers around dispatch and who calls.
pub use rpc_server::{
    layer_fn as server_layer_fn, Caller, LayerFn as ServerLayerFn, LayerFuture, Next as ServerNext,
    ServerLayer, ServerRequest,
};
pub use rpc_server::{Server, ServerBuilder, ServerHandle, ServerStatus, Service, ServiceFuture};
/// What a middleware receives and returns: encoded arguments and results, boxed futures.
pub use {bytes::Bytes, futures_util::future::BoxFuture};

/// Streams of items, as [`RpcStream::new`] takes them and a stream's consumer reads them: a
/// handler's items from a channel, say, with nothing but `rpc` and `tokio` in its crate.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use rpc::stream::StreamExt as _;
/// let (tx, rx) = tokio::sync::mpsc::channel::<Result<u64, rpc::RpcError>>(4);
/// let items = rpc::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|i| (i, rx)) });
/// let stream = rpc::RpcStream::try_new(items);
/// tx.send(Ok(7)).await.unwrap();
/// drop(tx);
/// assert_eq!(stream.collect_all().await.unwrap(), vec![7]);
/// # }
/// ```
pub use futures_util::stream;

/// JSON values, as [`Client::invoke_json`] takes and answers them and
/// [`error_body`](crates::client::error_body) reads a typed error's:
/// `rpc::serde_json::json!(["ann"])`, with nothing but `rpc` in the caller's crate.
///
/// ```
/// let args: rpc::serde_json::Value = rpc::serde_json::json!(["ann"]);
/// assert!(args.is_array());
/// ```
pub use serde_json;

/// The JSON Schema library behind the schemas entries publish: derive
/// `rpc::schemars::JsonSchema` on a service's types (with `#[schemars(crate = "rpc::schemars")]`
/// when the crate does not depend on `schemars` itself), and gateways and API documents know
/// their shape. See [`service`], "JSON Schemas".
pub use schemars;

#[cfg(feature = "logging")]
pub mod logging;
mod schema;
#[cfg(feature = "otel")]
pub mod telemetry;

/// TLS on the connections (feature `tls`): pass a [`ServerTls`](tls::ServerTls) to
/// [`ServerBuilder::tls`] and a [`ClientTls`](tls::ClientTls) to [`ClientBuilder::tls`].
#[cfg(feature = "tls")]
pub mod tls {
    pub use rpc_transport::tls::{ClientTls, ServerTls};
}

/// The README's quick start, compiled and run as a test.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The crates behind the facade, for what it does not re-export.
pub mod crates {
    pub use rpc_client as client;
    pub use rpc_core as core;
    pub use rpc_governance as governance;
    pub use rpc_registry as registry;
    pub use rpc_server as server;
    pub use rpc_transport as transport;
}

/// `use rpc::prelude::*;` brings what a service definition and its callers need.
pub mod prelude {
    pub use crate::{
        Client, Codec, InProcessRegistry, RpcError, RpcStream, Server, Service, StaticRegistry,
        StatusCode,
    };
}

/// Support for code generated by `#[rpc::service]`. Not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use crate::schema::{
        entry_schemas, output_schema_generator, schema_generator, ErrorIsFramework, ErrorProbe,
        ErrorViaAnyValue, ErrorViaJsonSchema, Probe, SchemaViaAnyValue, SchemaViaJsonSchema,
    };
    pub use bytes::Bytes;
    pub use futures_util::future::BoxFuture;
    pub use rpc_core::{
        ByteStream, Codec, Compression, EntryApi, EntrySchemas, GovernanceOverrides, HttpRoute,
        MethodDescriptor, NoArgs, RemoteError, RpcError, RpcStream, ShuntStrategy, StatusCode,
        StreamFuture, StreamMode,
    };
    use serde::de::DeserializeOwned;
    use serde::Serialize;

    /// The `EntryApi` of one method, from what the macro read of it: the encoded parameters'
    /// names in order, the doc comment, the `#[http]` route (method, path), the stream shape and
    /// the schemas.
    pub fn entry_api(
        params: &[&str],
        doc: Option<&str>,
        http: Option<(&str, &str)>,
        stream: Option<&str>,
        schemas: EntrySchemas,
    ) -> EntryApi {
        EntryApi {
            params: params.iter().map(|p| p.to_string()).collect(),
            doc: doc.map(str::to_string),
            http: http.map(|(method, path)| HttpRoute {
                method: method.to_string(),
                path: path.to_string(),
            }),
            stream: stream.map(str::to_string),
            schemas: Some(schemas),
        }
    }

    /// Client side: encodes the argument list.
    pub fn encode_args<T: Serialize>(
        codec: Codec,
        args: &T,
        method: &MethodDescriptor,
    ) -> Result<Bytes, RpcError> {
        codec.encode(args).map_err(|e| {
            RpcError::new(
                StatusCode::FrameworkError,
                format!("could not encode the arguments of {}: {e}", method.entry_id),
            )
        })
    }

    /// Client side: decodes the result value.
    pub fn decode_result<T: DeserializeOwned>(
        codec: Codec,
        bytes: &[u8],
        method: &MethodDescriptor,
    ) -> Result<T, RpcError> {
        codec.decode(bytes).map_err(|e| {
            RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "could not decode the result of {}: {e}; do client and server share the \
                     same service definition?",
                    method.entry_id
                ),
            )
        })
    }

    /// Server side: decodes the argument list.
    pub fn decode_args<T: DeserializeOwned>(
        codec: Codec,
        bytes: &[u8],
        method: &MethodDescriptor,
    ) -> Result<T, RpcError> {
        codec.decode(bytes).map_err(|e| {
            RpcError::validation(format!(
                "could not decode the arguments of {}: {e}; send them as one array in the \
                 order the method declares them",
                method.entry_id
            ))
        })
    }

    /// Server side: decodes the argument list of a method whose arguments are named in
    /// `args` (name and type, in order), so that an error names the argument that failed: its
    /// position (from 1), name and expected type.
    pub fn decode_named_args<T: ArgList>(
        codec: Codec,
        bytes: &[u8],
        method: &MethodDescriptor,
        args: &'static [(&'static str, &'static str)],
    ) -> Result<T, RpcError> {
        let seed = ArgsSeed::<T> {
            args,
            entry: method.entry_id,
            list: std::marker::PhantomData,
        };
        codec.decode_seed(seed, bytes).map_err(|e| {
            RpcError::validation(format!(
                "could not decode the arguments of {}: {e}; send them as one array in the \
                 order the method declares them",
                method.entry_id
            ))
        })
    }

    /// An argument list decoded element by element ([`decode_named_args`]): tuples of 1 to
    /// 16 arguments.
    pub trait ArgList: Sized {
        /// Reads the arguments from `seq`, naming the one that fails from `args`.
        fn from_seq<'de, S: serde::de::SeqAccess<'de>>(
            seq: S,
            args: &[(&str, &str)],
        ) -> Result<Self, S::Error>;
    }

    struct ArgsSeed<T> {
        args: &'static [(&'static str, &'static str)],
        entry: &'static str,
        list: std::marker::PhantomData<T>,
    }

    impl<'de, T: ArgList> serde::de::DeserializeSeed<'de> for ArgsSeed<T> {
        type Value = T;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
            d.deserialize_seq(self)
        }
    }

    impl<'de, T: ArgList> serde::de::Visitor<'de> for ArgsSeed<T> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            let list: Vec<String> = self
                .args
                .iter()
                .map(|(name, ty)| format!("{name}: {ty}"))
                .collect();
            write!(
                f,
                "the argument list of {}, an array ({})",
                self.entry,
                list.join(", ")
            )
        }
        fn visit_seq<S: serde::de::SeqAccess<'de>>(self, seq: S) -> Result<T, S::Error> {
            T::from_seq(seq, self.args)
        }
    }

    /// The argument at `index` (from 0) of the list.
    fn next_arg<'de, T: serde::Deserialize<'de>, S: serde::de::SeqAccess<'de>>(
        seq: &mut S,
        index: usize,
        args: &[(&str, &str)],
    ) -> Result<T, S::Error> {
        use serde::de::Error;
        let (name, ty) = args.get(index).copied().unwrap_or(("?", "?"));
        let position = index + 1;
        match seq.next_element::<T>() {
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err(S::Error::custom(format!(
                "argument {position} `{name}` ({ty}) is missing: the call sent {index} of {}",
                args.len()
            ))),
            Err(e) => Err(S::Error::custom(format!(
                "argument {position} `{name}`: expected {ty}: {e}"
            ))),
        }
    }

    macro_rules! arg_list {
        ($($t:ident $i:tt),+) => {
            impl<$($t: DeserializeOwned),+> ArgList for ($($t,)+) {
                fn from_seq<'de, S: serde::de::SeqAccess<'de>>(
                    mut seq: S,
                    args: &[(&str, &str)],
                ) -> Result<Self, S::Error> {
                    let list = ($(next_arg::<$t, S>(&mut seq, $i, args)?,)+);
                    // Extra trailing arguments (from a newer caller) are ignored, as a
                    // positional decoder would.
                    while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                    Ok(list)
                }
            }
        };
    }
    arg_list!(A0 0);
    arg_list!(A0 0, A1 1);
    arg_list!(A0 0, A1 1, A2 2);
    arg_list!(A0 0, A1 1, A2 2, A3 3);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8, A9 9);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8, A9 9, A10 10);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8, A9 9, A10 10, A11 11);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8, A9 9, A10 10, A11 11, A12 12);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8, A9 9, A10 10, A11 11, A12 12, A13 13);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8, A9 9, A10 10, A11 11, A12 12, A13 13, A14 14);
    arg_list!(A0 0, A1 1, A2 2, A3 3, A4 4, A5 5, A6 6, A7 7, A8 8, A9 9, A10 10, A11 11, A12 12, A13 13, A14 14, A15 15);

    /// Server side: encodes the result value.
    pub fn encode_result<T: Serialize>(
        codec: Codec,
        value: &T,
        method: &MethodDescriptor,
    ) -> Result<Bytes, RpcError> {
        codec.encode(value).map_err(|e| {
            RpcError::new(
                StatusCode::ServerError,
                format!("could not encode the result of {}: {e}", method.entry_id),
            )
        })
    }

    /// Server side: answers a method index the service does not have.
    pub fn unknown_method(service_id: &str, method: usize) -> RpcError {
        RpcError::new(
            StatusCode::NotFindLocalServiceEntry,
            format!("service {service_id} has no method number {method}"),
        )
    }

    /// The stable hash of a `#[hash_key]` argument: XXH3 of its MessagePack encoding, whatever
    /// the call's codec, so every client maps a key to the same server.
    pub fn hash_key<T: Serialize + ?Sized>(key: &T) -> u64 {
        match rmp_serde_encode(key) {
            Some(bytes) => rpc_core::stable_hash(&bytes),
            None => 0,
        }
    }

    fn rmp_serde_encode<T: Serialize + ?Sized>(key: &T) -> Option<Bytes> {
        Codec::MsgPack.encode(key).ok()
    }

    /// Server side: the items of a streaming method, each encoded by `codec` as the
    /// transport takes it, straight into the frame being assembled (an item that does not
    /// encode ends the stream with that error, the server's: 520, as a result that does not
    /// encode).
    pub fn encode_stream<T: Serialize + Send + 'static>(
        codec: Codec,
        items: RpcStream<T>,
        method: &'static MethodDescriptor,
    ) -> ByteStream {
        encode_items(codec, items, StatusCode::ServerError, "the result", method)
    }

    /// Client side: the items of the caller's request stream (client streaming, both ways),
    /// each encoded by `codec` as [`encode_stream`] does; an item that does not encode ends
    /// the stream with the caller's own error, 500, as arguments that do not encode.
    pub fn encode_request_stream<T: Serialize + Send + 'static>(
        codec: Codec,
        items: RpcStream<T>,
        method: &'static MethodDescriptor,
    ) -> ByteStream {
        encode_items(
            codec,
            items,
            StatusCode::FrameworkError,
            "an item of the request stream",
            method,
        )
    }

    /// Items encoded by `codec`; one that does not encode ends the stream with `status`,
    /// saying it could not encode `what` of `method`.
    fn encode_items<T: Serialize + Send + 'static>(
        codec: Codec,
        items: RpcStream<T>,
        status: StatusCode,
        what: &'static str,
        method: &'static MethodDescriptor,
    ) -> ByteStream {
        ByteStream::encoding(items, move |item, dst| {
            codec.encode_to(dst, item).map_err(|e| {
                RpcError::new(
                    status,
                    format!("could not encode {what} of {}: {e}", method.entry_id),
                )
            })
        })
    }

    /// Client side: the items of a streaming method, each decoded by `codec` (an item that
    /// does not decode ends the stream with that error).
    pub fn decode_stream<T: DeserializeOwned + Send + 'static>(
        codec: Codec,
        items: ByteStream,
        method: &'static MethodDescriptor,
    ) -> RpcStream<T> {
        items.decode_items(move |bytes| decode_result(codec, bytes, method))
    }

    /// Server side: the caller's request stream of a client-streaming method, decoded (an
    /// item that does not decode is the caller's fault, as arguments that do not decode are:
    /// a validation error, 1001).
    pub fn inbound_stream<T: DeserializeOwned + Send + 'static>(
        codec: Codec,
        inbound: Option<ByteStream>,
        method: &'static MethodDescriptor,
    ) -> RpcStream<T> {
        match inbound {
            Some(items) => items.decode_items(move |bytes| {
                codec.decode(bytes).map_err(|e| {
                    RpcError::validation(format!(
                        "could not decode an item of the caller's request stream of {}: {e}; \
                         send items of the type the method declares",
                        method.entry_id
                    ))
                })
            }),
            None => RpcStream::failed(RpcError::new(
                StatusCode::FrameworkError,
                format!("{} was called without its request stream", method.entry_id),
            )),
        }
    }

    /// Server side: a client-streaming method's encoded answer, as the one item its
    /// dispatcher produces.
    pub fn answer_stream(answer: Bytes) -> ByteStream {
        RpcStream::iter(std::iter::once(answer))
    }

    /// The error of a unary call of a streaming method (or the reverse) in a dispatcher.
    pub fn wrong_shape(method: &MethodDescriptor, streaming: bool) -> RpcError {
        RpcError::new(
            StatusCode::FrameworkError,
            if streaming {
                format!(
                    "{} is a streaming method: it is called as a stream",
                    method.entry_id
                )
            } else {
                format!(
                    "{} is a unary method: it cannot be opened as a stream",
                    method.entry_id
                )
            },
        )
    }

    /// Boxes a stream's set-up as the dispatcher returns it.
    pub fn boxed_stream<F>(f: F) -> StreamFuture
    where
        F: std::future::Future<Output = Result<ByteStream, RpcError>> + Send + 'static,
    {
        Box::pin(f)
    }

    /// Boxes a future as the dispatcher returns it.
    pub fn boxed<F>(f: F) -> BoxFuture<'static, Result<Bytes, RpcError>>
    where
        F: std::future::Future<Output = Result<Bytes, RpcError>> + Send + 'static,
    {
        Box::pin(f)
    }
}
