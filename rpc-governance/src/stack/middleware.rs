//! User layers: code of the application's own around every call, or around every attempt.
//!
//! Authorization headers, argument checks, metrics of one's own, tenant tags: what tower's
//! layers, Volo's and Kitex's middleware and Dubbo's filters do. A [`Middleware`] sees the
//! call's context ([`CallCx`]: entry, options in force, deadline, attempt, endpoint once chosen,
//! attachments) and the encoded arguments, and either answers itself or passes the call on with
//! [`Next::run`].
//!
//! A client runs its per-call layers outside the whole governance stack (they see one call,
//! whatever its retries, and the fallback's answer) and its per-attempt layers below the retry
//! layer (they see every attempt, with its endpoint). An installed layer costs one boxed future
//! per call (or attempt); with none installed, a call pays nothing for the feature.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::{BoxFuture, Either};
use rpc_core::RpcError;

use super::{CallCx, Service};

/// A user layer. Implement [`call`](Self::call): do what the layer does, then
/// `next.run(cx, req).await` (or answer without calling on).
///
/// ```
/// use bytes::Bytes;
/// use futures_util::future::{BoxFuture, Either};
/// use rpc_core::RpcError;
/// use rpc_governance::stack::{CallCx, Middleware, Next};
///
/// /// Tags every call with the tenant it is made for.
/// struct Tenant(&'static str);
///
/// impl Middleware for Tenant {
///     fn call<'a>(
///         &'a self,
///         cx: &'a mut CallCx<'_>,
///         req: Bytes,
///         next: Next<'a>,
///     ) -> BoxFuture<'a, Result<Bytes, RpcError>> {
///         cx.insert_attachment("tenant", self.0);
///         next.run(cx, req)
///     }
/// }
/// ```
pub trait Middleware: Send + Sync + 'static {
    /// Handles one call (or attempt).
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: Next<'a>,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>>;
}

/// A [`Middleware`] made of a closure, as tower's `service_fn` makes a service: for a layer
/// without state of its own to name, or with state the closure owns (cloned into each call's
/// future when the future needs it past the closure's borrow).
///
/// ```
/// use rpc_governance::stack::middleware_fn;
///
/// // Tags every call with the tenant it is made for.
/// let tenant = middleware_fn(|cx, req, next| {
///     cx.insert_attachment("tenant", "acme");
///     next.run(cx, req)
/// });
/// # let _ = tenant;
/// ```
pub fn middleware_fn<F>(f: F) -> MiddlewareFn
where
    F: for<'a, 'c> Fn(
            &'a mut CallCx<'c>,
            Bytes,
            Next<'a>,
        ) -> BoxFuture<'a, Result<Bytes, RpcError>>
        + Send
        + Sync
        + 'static,
{
    MiddlewareFn(Box::new(f))
}

/// What [`middleware_fn`] keeps: the closure.
type LayerFn = dyn for<'a, 'c> Fn(&'a mut CallCx<'c>, Bytes, Next<'a>) -> BoxFuture<'a, Result<Bytes, RpcError>>
    + Send
    + Sync;

/// The [`Middleware`] [`middleware_fn`] makes.
pub struct MiddlewareFn(Box<LayerFn>);

impl std::fmt::Debug for MiddlewareFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MiddlewareFn").finish_non_exhaustive()
    }
}

impl Middleware for MiddlewareFn {
    fn call<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
        next: Next<'a>,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>> {
        (self.0)(cx, req, next)
    }
}

/// The rest of the stack below a [`Middleware`].
pub struct Next<'a> {
    rest: &'a [Arc<dyn Middleware>],
    end: &'a (dyn Erased + 'a),
}

impl std::fmt::Debug for Next<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Next")
            .field("layers_left", &self.rest.len())
            .finish_non_exhaustive()
    }
}

impl<'a> Next<'a> {
    /// Passes the call on to the next layer (or, after the last one, the stack below).
    pub fn run(self, cx: &'a mut CallCx<'_>, req: Bytes) -> BoxFuture<'a, Result<Bytes, RpcError>> {
        match self.rest.split_first() {
            Some((first, rest)) => first.call(
                cx,
                req,
                Next {
                    rest,
                    end: self.end,
                },
            ),
            None => self.end.call_boxed(cx, req),
        }
    }
}

/// A [`Service`] behind a pointer: the end of a chain of user layers.
trait Erased: Send + Sync {
    fn call_boxed<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>>;
}

impl<S: Service> Erased for S {
    fn call_boxed<'a>(
        &'a self,
        cx: &'a mut CallCx<'_>,
        req: Bytes,
    ) -> BoxFuture<'a, Result<Bytes, RpcError>> {
        Box::pin(Service::call(self, cx, req))
    }
}

/// The stage below a list of user layers: reaching it, the call is no longer the layers'
/// own answer ([`CallCx::answered_by_layer`]).
struct Reached<'s, S>(&'s S);

impl<S: Service> Service for Reached<'_, S> {
    fn call(
        &self,
        cx: &mut CallCx<'_>,
        req: Bytes,
    ) -> impl std::future::Future<Output = Result<Bytes, RpcError>> + Send {
        cx.answered_by_layer = false;
        cx.leaves_client();
        self.0.call(cx, req)
    }
}

/// `S` behind a list of user layers, the first outermost.
pub struct Layered<'l, S> {
    layers: &'l [Arc<dyn Middleware>],
    inner: S,
}

impl<'l, S> Layered<'l, S> {
    /// `inner` behind `layers`.
    pub fn new(layers: &'l [Arc<dyn Middleware>], inner: S) -> Self {
        Layered { layers, inner }
    }
}

impl<S: Service> Service for Layered<'_, S> {
    /// Not an `async fn`: with no layer installed the inner stage's future is returned as it
    /// is, so an empty list adds no state machine of its own to every call.
    fn call(
        &self,
        cx: &mut CallCx<'_>,
        req: Bytes,
    ) -> impl std::future::Future<Output = Result<Bytes, RpcError>> + Send {
        if self.layers.is_empty() {
            cx.leaves_client();
            return Either::Left(self.inner.call(cx, req));
        }
        // The layers' own until the call reaches the stage below them.
        cx.answered_by_layer = true;
        Either::Right(async move {
            Next {
                rest: self.layers,
                end: &Reached(&self.inner),
            }
            .run(cx, req)
            .await
        })
    }

    /// A user layer may do anything with the deadline: only an empty list passes the inner
    /// stage's promise on.
    fn enforces_attempt_deadline(&self) -> bool {
        self.layers.is_empty() && self.inner.enforces_attempt_deadline()
    }
}
