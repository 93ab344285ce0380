//! The type-erased form of a service: what servers dispatch to and what fallbacks are.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

use crate::stream::ByteStream;
use crate::wire::StreamMode;
use crate::{Codec, MethodDescriptor, RpcError, StatusCode};

/// The future a [`Service`] call returns.
pub type ServiceFuture = Pin<Box<dyn Future<Output = Result<Bytes, RpcError>> + Send + 'static>>;

/// The future a [`Service`] streaming call returns: the set-up's outcome, then the stream of
/// encoded items (an error item ends the stream with that error).
pub type StreamFuture =
    Pin<Box<dyn Future<Output = Result<ByteStream, RpcError>> + Send + 'static>>;

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
    ///
    /// The server sends an error (and a [`call_stream`](Self::call_stream) set-up's) as a
    /// generated service's handler error goes
    /// ([`RemoteError::into_rpc_error`](crate::RemoteError::into_rpc_error)): a callee answer
    /// (business, validation, authentication) as it is; one holding a payload already as it is
    /// (its payload in the call's codec); any other with its status mapped by
    /// [`StatusCode::carried`](crate::StatusCode::carried) (a not-found or communication
    /// failure becomes 504) and the error as its payload. A failure passed on from a downstream
    /// call (a 507, a 515) then does not read to the caller as this server's "nothing ran
    /// here", which would have the call run again elsewhere. A unary call's failure at or
    /// after the caller's deadline is sent as the timeout (519).
    fn call(&self, method: usize, params: Bytes, codec: Codec) -> ServiceFuture;

    /// The shape of method number `method`: [`StreamMode::Unary`] (the default) for a method
    /// run by [`call`](Self::call), another mode for one run by
    /// [`call_stream`](Self::call_stream).
    fn stream_mode(&self, method: usize) -> StreamMode {
        let _ = method;
        StreamMode::Unary
    }

    /// Runs streaming method number `method` with its other arguments encoded by `codec` in
    /// `params` and, for a method taking a stream, the caller's encoded items in `inbound`;
    /// returns the set-up's outcome (an error is the call's refusal: nothing was streamed),
    /// then the encoded items of the answer. The default: the service has no streaming method.
    fn call_stream(
        &self,
        method: usize,
        params: Bytes,
        inbound: Option<ByteStream>,
        codec: Codec,
    ) -> StreamFuture {
        let _ = (params, inbound, codec);
        let entry = self
            .methods()
            .get(method)
            .map_or("this method", |m| m.entry_id);
        let e = RpcError::new(
            StatusCode::NotImplemented,
            format!("{entry} is not a streaming method of this service; call it as a unary call"),
        );
        Box::pin(std::future::ready(Err(e)))
    }
}
