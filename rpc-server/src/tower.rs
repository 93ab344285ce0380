//! A `tower` layer as a server layer (feature `tower`).
//!
//! Teams that already wrote their policies as `tower::Layer`s (an audit service, a policy of
//! their own) can install them in front of dispatch without rewriting them. A layer's error
//! that is an [`RpcError`] is the call's answer as it is; any other error is answered 520, a
//! failure of the server: a layer that refuses calls it did not run (a load shedder, a
//! concurrency limit) should fail with `RpcError::new(StatusCode::OverflowMaxServerHandle, ..)`
//! (515, which callers take for "nothing ran, go elsewhere"), not with tower's own error
//! types (`Overloaded`, `Elapsed`), which this adapter cannot tell from a failure.
//! A tower service owns its request and answers with a future that borrows nothing, where a
//! [`ServerLayer`] borrows the call; the adapter bridges the two, at a price paid only by the
//! calls going through it: one clone of the wrapped service (tower's way of sharing one) and
//! one more boxed future per call, for the rest of the chain. A server that installs none pays
//! nothing.
//!
//! ```
//! use rpc_server::tower::{Layer, NextService, TowerLayer};
//! use rpc_server::Server;
//!
//! /// A tower layer of the team's own: refuses nothing, counts nothing, hands every call on.
//! struct Passing;
//! impl Layer<NextService> for Passing {
//!     type Service = NextService;
//!     fn layer(&self, inner: NextService) -> NextService {
//!         inner
//!     }
//! }
//!
//! let builder = Server::builder().layer(TowerLayer::new(Passing));
//! ```

use std::error::Error;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use rpc_core::{RpcError, StatusCode};
pub use tower_layer::Layer;
pub use tower_service::Service;

use crate::dispatch::Layered;
use crate::middleware::{LayerFuture, Next, ServerLayer, ServerRequest};

/// One call as a tower service sees it: the [`ServerRequest`], owned, and the rest of the chain
/// that [`NextService`] runs it through.
pub struct TowerRequest {
    request: ServerRequest,
    chain: Arc<Layered>,
    at: usize,
}

impl TowerRequest {
    /// The call: entry, caller, attachments, deadline, arguments.
    pub fn request(&self) -> &ServerRequest {
        &self.request
    }

    /// The call, to change what the rest of the chain sees.
    pub fn request_mut(&mut self) -> &mut ServerRequest {
        &mut self.request
    }
}

impl std::fmt::Debug for TowerRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TowerRequest")
            .field("request", &self.request)
            .field("at", &self.at)
            .finish()
    }
}

/// The rest of the server's chain (the next layers, the cap, the handler, the fallback) as the
/// tower service that a wrapped tower layer wraps. Always ready.
#[derive(Clone, Debug, Default)]
pub struct NextService {
    _private: (),
}

impl Service<TowerRequest> for NextService {
    type Response = Bytes;
    type Error = RpcError;
    type Future = LayerFuture<'static>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), RpcError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: TowerRequest) -> Self::Future {
        Box::pin(async move {
            let TowerRequest {
                mut request,
                chain,
                at,
            } = req;
            Next { chain: &chain, at }.run(&mut request).await
        })
    }
}

/// A tower layer installed as a [`ServerLayer`]: `Server::builder().layer(TowerLayer::new(l))`.
///
/// The service `l` builds around [`NextService`] is built once, when the adapter is made, and
/// cloned for each call; it is asked `poll_ready` before each call. Its errors become the
/// call's answer: an [`RpcError`] as it is, any other error a server error (520) naming it.
/// What the end of the chain reports of a call behind it (a server fallback that answered,
/// the entry's load in the answer) reaches the server's span, metrics and answer as without
/// the layer.
pub struct TowerLayer<S> {
    service: S,
}

impl<S> TowerLayer<S> {
    /// Builds `layer`'s service around the rest of the server's chain.
    pub fn new<L: Layer<NextService, Service = S>>(layer: L) -> Self {
        TowerLayer {
            service: layer.layer(NextService::default()),
        }
    }
}

impl<S> std::fmt::Debug for TowerLayer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TowerLayer")
            .field("service", &std::any::type_name::<S>())
            .finish()
    }
}

impl<S> ServerLayer for TowerLayer<S>
where
    S: Service<TowerRequest, Response = Bytes> + Clone + Send + Sync + 'static,
    S::Error: Into<Box<dyn Error + Send + Sync>>,
    S::Future: Send,
{
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: Next<'a>) -> LayerFuture<'a> {
        let mut service = self.service.clone();
        let entry = req.entry_id();
        let owned = TowerRequest {
            request: req.split_off(),
            chain: next.chain.clone(),
            at: next.at,
        };
        Box::pin(async move {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .map_err(|e| to_rpc_error(e.into(), entry))?;
            service
                .call(owned)
                .await
                .map_err(|e| to_rpc_error(e.into(), entry))
        })
    }
}

/// A tower layer's error as the call's answer.
fn to_rpc_error(e: Box<dyn Error + Send + Sync>, entry: &str) -> RpcError {
    match e.downcast::<RpcError>() {
        Ok(e) => *e,
        Err(other) => RpcError::new(
            StatusCode::ServerError,
            format!("a tower layer of the server failed {entry}: {other}"),
        ),
    }
}
