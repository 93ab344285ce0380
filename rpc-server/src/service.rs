//! What the server dispatches to: one [`Service`] per registered service.

use bytes::Bytes;
use futures_util::future::BoxFuture;
use rpc_core::{Codec, MethodDescriptor, RpcError};

/// A service as the server sees it: encoded arguments in, encoded result out.
///
/// `#[rpc::service]` implements it for `<Trait>Server<T>`, a wrapper around any implementation
/// of the trait. The same type-erased form serves as a fallback on either side.
pub trait Service: Send + Sync + 'static {
    /// The service id, for example `"echo.Echo"`.
    fn service_id(&self) -> &'static str;

    /// One descriptor per method; the position is the method index passed to [`call`](Self::call).
    fn methods(&self) -> &'static [MethodDescriptor];

    /// Runs method number `method` with its argument list encoded by `codec`, and returns the
    /// encoded result or the error to send back (a business error carries its encoded value).
    fn call(
        &self,
        method: usize,
        params: Bytes,
        codec: Codec,
    ) -> BoxFuture<'static, Result<Bytes, RpcError>>;
}
