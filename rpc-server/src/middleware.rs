//! Server middleware: user layers around dispatch.
//!
//! Authorization per method, argument validation, a service's own metrics and audit logs all
//! need the same place: after the connection was admitted and the caller authenticated, before
//! the call takes one of its entry's slots and reaches the handler. A [`ServerLayer`] sits
//! there. It sees the entry, the [`Caller`], the attachments, the deadline and the encoded
//! arguments, and either answers at once (any status, or a value) or hands the call on with
//! [`Next::run`]. Layers run in the order they were installed
//! ([`ServerBuilder::layer`](crate::ServerBuilder::layer)), the first outermost:
//!
//! ```text
//! accept → handshake (token, TLS) → connection admission (frames, in-flight, rate)
//!   → layer 1 → layer 2 → … → entry admission (cap) → server fallback → handler
//! ```
//!
//! A call a layer answers never takes a cap slot, never runs the handler and never reaches the
//! server fallback: an early answer is the server's answer, not a handler failure. Client and
//! bidirectional streams are the exception to the order: they are admitted at their entry (rate
//! limits, cap) before their layers run, so that a refusal (429, 515) comes before the stream's
//! acceptance, while the caller may still go elsewhere; a stream a layer then refuses has taken
//! a rate-limit token and held a slot until the refusal. The call's
//! `rpc.server` span and metrics record it with its status like any other.
//!
//! Cost: a server without layers dispatches exactly as before (no box, no extra future). With
//! layers, each installed layer boxes its future once per call.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use rpc_core::{Codec, MethodDescriptor, RpcError, StatusCode};
use rpc_transport::Caller;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::dispatch::Layered;

/// What a layer returns: the future of the call's answer, encoded (`Ok`) or an error.
pub type LayerFuture<'a> = Pin<Box<dyn Future<Output = Result<Bytes, RpcError>> + Send + 'a>>;

/// A user middleware around the server's dispatch (see the [module](self) for where it runs).
///
/// ```
/// use rpc_server::{LayerFuture, Next, ServerLayer, ServerRequest};
/// use rpc_core::{RpcError, StatusCode};
///
/// /// Refuses `orders.Orders.cancel` to every client but `admin`.
/// struct OnlyAdminCancels;
///
/// impl ServerLayer for OnlyAdminCancels {
///     fn call<'a>(&'a self, req: &'a mut ServerRequest, next: Next<'a>) -> LayerFuture<'a> {
///         Box::pin(async move {
///             if req.entry_id() == "orders.Orders.cancel" && req.caller().client_id() != "admin" {
///                 return Err(RpcError::new(
///                     StatusCode::RpcUnAuthentication,
///                     "only admin may cancel orders; call with the admin client id",
///                 ));
///             }
///             next.run(req).await
///         })
///     }
/// }
/// ```
pub trait ServerLayer: Send + Sync + 'static {
    /// Handles one call: answer it (return without calling `next`) or hand it on with
    /// `next.run(req)`, looking at or changing its result on the way back.
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: Next<'a>) -> LayerFuture<'a>;
}

/// A [`ServerLayer`] from a function or closure taking the call and the rest of the chain, as
/// [`ServerLayer::call`] does: for a layer with no state of its own, or with state it clones
/// into each call's future (the future may not borrow the closure).
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use rpc_server::{layer_fn, Server};
///
/// let calls = Arc::new(AtomicU64::new(0));
/// let counted = calls.clone();
/// let builder = Server::builder().layer(layer_fn(move |req, next| {
///     let counted = counted.clone();
///     Box::pin(async move {
///         counted.fetch_add(1, Ordering::Relaxed);
///         next.run(req).await
///     })
/// }));
/// # let _ = builder;
/// ```
pub fn layer_fn<F>(f: F) -> LayerFn<F>
where
    F: for<'a> Fn(&'a mut ServerRequest, Next<'a>) -> LayerFuture<'a> + Send + Sync + 'static,
{
    LayerFn(f)
}

/// A [`ServerLayer`] made by [`layer_fn`].
#[derive(Clone, Copy)]
pub struct LayerFn<F>(F);

impl<F> std::fmt::Debug for LayerFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LayerFn")
    }
}

impl<F> ServerLayer for LayerFn<F>
where
    F: for<'a> Fn(&'a mut ServerRequest, Next<'a>) -> LayerFuture<'a> + Send + Sync + 'static,
{
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: Next<'a>) -> LayerFuture<'a> {
        (self.0)(req, next)
    }
}

/// One call as the server's layers see it.
///
/// [`Next::run`] hands the arguments and the attachments to the handler: after it returns,
/// [`parameters`](Self::parameters) and [`attachments`](Self::attachments) are empty when the
/// handler ran; a call refused before it (over the entry's rate limit or cap, 429 or 515)
/// keeps them.
pub struct ServerRequest {
    pub(crate) method: &'static MethodDescriptor,
    pub(crate) caller: Arc<Caller>,
    pub(crate) attachments: BTreeMap<String, String>,
    /// The caller's retry depth, kept apart from `attachments` by the transport.
    pub(crate) retry_depth: u32,
    pub(crate) deadline: Option<(Instant, u32)>,
    pub(crate) parameters: Bytes,
    pub(crate) codec: Codec,
    /// The handler's failure a server fallback answered for, if one did (for the span).
    pub(crate) fallback_cause: Option<StatusCode>,
    /// The entry's load (in flight, this call included; limit) as the handler finished.
    pub(crate) load: Option<(u32, u32)>,
    /// For a server stream: where the end of the chain leaves the handler's items (holding
    /// the entry's slot) once set up; the layers see the set-up's outcome as the call's.
    /// (Shared with a request split off for an adapter that owns it.)
    pub(crate) stream: Option<StreamSlot>,
    /// For a client or bidirectional stream: the caller's items, which the end of the chain
    /// hands the handler (shared with a split-off request, as `stream`).
    pub(crate) inbound: Option<StreamSlot>,
    /// For a stream's set-up: what layers asked to be told as the stream ends
    /// ([`on_stream_end`](Self::on_stream_end)).
    pub(crate) stream_end: Option<StreamEndHooks>,
    /// The entry's slot, when the call was admitted before its layers ran (a client or
    /// bidirectional stream, accepted before them): the end of the chain takes it rather than
    /// admitting the call again.
    pub(crate) admitted: Option<crate::admission::Slot>,
    /// Shared with the requests split off from this one for adapters ([`split_off`]): where
    /// the end of the chain reports `fallback_cause` and `load`, which the split-off copy it
    /// ran on takes with it.
    ///
    /// [`split_off`]: Self::split_off
    pub(crate) reported: Option<Reported>,
}

/// What the end of a layer chain reports of a call for the request it was split off from:
/// the fallback's cause and the entry's load.
pub(crate) type Reported = Arc<std::sync::Mutex<(Option<StatusCode>, Option<(u32, u32)>)>>;

/// The hooks layers registered on a stream's set-up, run as the stream ends.
pub(crate) type StreamEndHooks = Arc<std::sync::Mutex<Vec<rpc_governance::stack::StreamEndHook>>>;

/// Where the end of a server layer chain leaves a server stream's items.
pub(crate) type StreamSlot = Arc<std::sync::Mutex<Option<rpc_core::ByteStream>>>;

impl ServerRequest {
    /// Asks to be told how the stream this request sets up ends: for a stream whose set-up
    /// succeeds, `hook` runs once as the stream ends (completed, with an error or at the
    /// deadline, or stopped by the caller's `Cancel`, its connection's end or the drain:
    /// `status` `None`), with the items the server sent (`items_sent`; a client stream's
    /// answer is one) and the caller's items its handler took (`items_received`). A layer sees the set-up as the call (its result
    /// is the set-up's) and the stream's end through this hook. For a unary call, or a set-up
    /// that fails, the hook never runs.
    pub fn on_stream_end(
        &mut self,
        hook: impl FnOnce(&rpc_governance::stack::StreamEnd) + Send + Sync + 'static,
    ) {
        if let Some(hooks) = &self.stream_end {
            hooks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(Box::new(hook));
        }
    }

    /// The entry called: `"<service id>.<method>"`, e.g. `"orders.Orders.cancel"`.
    pub fn entry_id(&self) -> &'static str {
        self.method.entry_id
    }

    /// The descriptor of the method called (service id, method name, governance overrides).
    pub fn method(&self) -> &'static MethodDescriptor {
        self.method
    }

    /// Who calls: the identity the connection's handshake established.
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// The caller's attachments (the trace context and the call id left out): what the
    /// handler will find in its `RpcContext`.
    pub fn attachments(&self) -> &BTreeMap<String, String> {
        &self.attachments
    }

    /// The caller's retry depth (attachment
    /// [`RETRY_DEPTH_KEY`](rpc_core::RETRY_DEPTH_KEY), not among
    /// [`attachments`](Self::attachments)): how many callers up the chain retry this call; 0
    /// when none does. The handler's `RpcContext` answers for it as for an attachment.
    pub fn retry_depth(&self) -> u32 {
        self.retry_depth
    }

    /// The attachments, to change what the layers after this one and the handler see.
    pub fn attachments_mut(&mut self) -> &mut BTreeMap<String, String> {
        &mut self.attachments
    }

    /// When the caller stops waiting (`None`: the caller set no timeout). The handler is
    /// stopped then, and so is a layer still running.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline.map(|(d, _)| d)
    }

    /// The encoded argument list (one array, as [`codec`](Self::codec) encodes it).
    pub fn parameters(&self) -> &Bytes {
        &self.parameters
    }

    /// The codec of the arguments and of the answer.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Decodes the argument list as the tuple of the method's parameters, e.g. `(String, u32)`
    /// for `fn order(&self, item: String, quantity: u32)`. Arguments that do not decode as
    /// `T` give a validation error (1001) naming the entry.
    pub fn decode_parameters<T: DeserializeOwned>(&self) -> Result<T, RpcError> {
        self.codec.decode(&self.parameters).map_err(|e| {
            RpcError::validation(format!(
                "the arguments of {} do not decode as the layer expects: {e}; check the \
                 layer's parameter types against the method",
                self.method.entry_id
            ))
        })
    }

    /// Encodes `value` as the answer of a layer that answers by itself (status 200).
    pub fn encode_answer<T: serde::Serialize>(&self, value: &T) -> Result<Bytes, RpcError> {
        self.codec.encode(value).map_err(|e| {
            RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "a layer's answer to {} could not be encoded: {e}",
                    self.method.entry_id
                ),
            )
        })
    }
}

impl ServerRequest {
    /// Moves the call out of `self`, leaving the same call without its arguments and
    /// attachments (for an adapter that must own the request).
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    pub(crate) fn split_off(&mut self) -> ServerRequest {
        // (One report for every request split off in a row, so that adapters nested in one
        // another report to the first.)
        let reported = self.reported.get_or_insert_with(Reported::default).clone();
        ServerRequest {
            method: self.method,
            caller: self.caller.clone(),
            attachments: std::mem::take(&mut self.attachments),
            retry_depth: self.retry_depth,
            deadline: self.deadline,
            parameters: std::mem::take(&mut self.parameters),
            codec: self.codec,
            fallback_cause: None,
            load: None,
            stream: self.stream.clone(),
            inbound: self.inbound.clone(),
            stream_end: self.stream_end.clone(),
            admitted: self.admitted.take(),
            reported: Some(reported),
        }
    }

    /// Records `fallback_cause` and `load` as the end of the chain set them, for the request
    /// this one was split off from.
    pub(crate) fn report_back(&self) {
        if let Some(reported) = &self.reported {
            *reported
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                (self.fallback_cause, self.load);
        }
    }

    /// Takes what the end of the chain reported on a request split off from this one, where
    /// this one has nothing of its own.
    pub(crate) fn take_reported(&mut self) {
        if let Some(reported) = self.reported.take() {
            let (cause, load) = *reported
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.fallback_cause = self.fallback_cause.or(cause);
            self.load = self.load.or(load);
        }
    }
}

impl std::fmt::Debug for ServerRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerRequest")
            .field("entry_id", &self.method.entry_id)
            .field("caller", &self.caller)
            .field("attachments", &self.attachments.keys().collect::<Vec<_>>())
            .field("deadline", &self.deadline())
            .field("parameters", &self.parameters.len())
            .field("codec", &self.codec)
            .finish()
    }
}

/// The rest of the chain after a layer: the next layer, or, after the last, entry admission
/// (the cap), the handler and the server fallback.
pub struct Next<'a> {
    pub(crate) chain: &'a Arc<Layered>,
    /// The index of the next layer in `chain.layers`.
    pub(crate) at: usize,
}

impl<'a> Next<'a> {
    /// Runs the rest of the chain on `req` and returns its answer.
    pub async fn run(self, req: &'a mut ServerRequest) -> Result<Bytes, RpcError> {
        match self.chain.layers.get(self.at) {
            Some(layer) => {
                layer
                    .call(
                        req,
                        Next {
                            chain: self.chain,
                            at: self.at + 1,
                        },
                    )
                    .await
            }
            None => self.chain.end.run(req).await,
        }
    }
}

impl std::fmt::Debug for Next<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Next")
            .field(
                "layers_left",
                &self.chain.layers.len().saturating_sub(self.at),
            )
            .finish()
    }
}
