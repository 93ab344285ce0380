//! The type-erased form of a service: what servers dispatch to and what fallbacks are.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

use crate::{Codec, MethodDescriptor, RpcError};

/// The future a [`Service`] call returns.
pub type ServiceFuture = Pin<Box<dyn Future<Output = Result<Bytes, RpcError>> + Send + 'static>>;

/// A service with encoded arguments in and an encoded result out.
///
/// `#[rpc::service]` implements it for `<Trait>Server<T>`, a wrapper around any implementation
/// of the trait. Servers dispatch calls to it, and the same form registered on a client or a
/// server is a fallback: it receives the original (encoded) arguments.
pub trait Service: Send + Sync + 'static {
    /// The service id, for example `"echo.Echo"`.
    fn service_id(&self) -> &'static str;

    /// One descriptor per method; the position is the method index passed to [`call`](Self::call).
    fn methods(&self) -> &'static [MethodDescriptor];

    /// Runs method number `method` with its argument list encoded by `codec`, and returns the
    /// encoded result or the error to send back (a business error carries its encoded value).
    fn call(&self, method: usize, params: Bytes, codec: Codec) -> ServiceFuture;
}
