//! The one error type of the framework, and how a service's own error type crosses the wire.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Codec, StatusCode};

/// Everything that can go wrong with a call, with the [`StatusCode`] that classifies it.
///
/// The error is one pointer wide so that `Result<T, RpcError>` stays small on the hot path.
#[derive(Clone, PartialEq)]
pub struct RpcError {
    inner: Box<Inner>,
}

#[derive(Clone, PartialEq)]
struct Inner {
    code: StatusCode,
    message: String,
    payload: Option<(Codec, Bytes)>,
    maybe_delivered: bool,
    tried: Vec<String>,
    retry_after: Option<Duration>,
}

impl RpcError {
    /// An error with a status code and a message that says what failed and what to do.
    pub fn new(code: StatusCode, message: impl Into<String>) -> Self {
        RpcError {
            inner: Box::new(Inner {
                code,
                message: message.into(),
                payload: None,
                maybe_delivered: false,
                tried: Vec::new(),
                retry_after: None,
            }),
        }
    }

    /// A business error (1000): the service's own answer, returned to the caller unchanged.
    pub fn business(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BusinessError, message)
    }

    /// A validation error (1001): the service rejected the arguments.
    pub fn validation(message: impl Into<String>) -> Self {
        Self::new(StatusCode::ValidateError, message)
    }

    /// A business error carrying a service's typed error value, encoded by `codec`.
    pub fn with_payload(mut self, codec: Codec, payload: Bytes) -> Self {
        self.inner.payload = Some((codec, payload));
        self
    }

    /// Marks the call as possibly delivered: the request left this process before the failure,
    /// so the server may have run it.
    pub fn maybe_delivered(mut self, yes: bool) -> Self {
        self.inner.maybe_delivered = yes;
        self
    }

    /// Records the endpoints the call was tried on, in order.
    pub fn with_tried(mut self, tried: Vec<String>) -> Self {
        self.inner.tried = tried;
        self
    }

    /// How long until the failing component may accept calls again (open circuit breaker).
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.inner.retry_after = Some(after);
        self
    }

    /// The status code.
    pub fn code(&self) -> StatusCode {
        self.inner.code
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.inner.message
    }

    /// The encoded typed error value of a business error, with the codec that encoded it.
    pub fn payload(&self) -> Option<&(Codec, Bytes)> {
        self.inner.payload.as_ref()
    }

    /// True when the request may have reached the server before the failure.
    pub fn is_maybe_delivered(&self) -> bool {
        self.inner.maybe_delivered
    }

    /// The endpoints the call was tried on, in order (empty when none was reached).
    pub fn tried(&self) -> &[String] {
        &self.inner.tried
    }

    /// When the failing component expects to accept calls again.
    pub fn retry_after(&self) -> Option<Duration> {
        self.inner.retry_after
    }
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.inner.code, self.inner.message)?;
        if self.inner.maybe_delivered {
            f.write_str(" (the request may have been delivered and run)")?;
        }
        if !self.inner.tried.is_empty() {
            write!(f, " [tried: {}]", self.inner.tried.join(", "))?;
        }
        if let Some(after) = self.inner.retry_after {
            write!(f, " [retry after {} ms]", after.as_millis())?;
        }
        Ok(())
    }
}

impl fmt::Debug for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RpcError")
            .field("code", &self.inner.code)
            .field("message", &self.inner.message)
            .field("has_payload", &self.inner.payload.is_some())
            .field("maybe_delivered", &self.inner.maybe_delivered)
            .field("tried", &self.inner.tried)
            .field("retry_after", &self.inner.retry_after)
            .finish()
    }
}

impl std::error::Error for RpcError {}

/// An error type that a service method may return: [`RpcError`] itself, or any user type that is
/// `Serialize + DeserializeOwned + From<RpcError>`.
///
/// A user error value returned by a handler travels as a business error (1000) carrying the
/// encoded value, and the client proxy decodes it back into the same type. Failures of the call
/// itself (timeout, no endpoint, ...) reach the caller through `From<RpcError>`.
pub trait RemoteError: Sized + Send + 'static {
    /// Builds the caller-side error from what the call produced.
    fn from_rpc_error(err: RpcError) -> Self;
    /// Turns a handler's error into what is sent back.
    fn into_rpc_error(self, codec: Codec) -> RpcError;
}

impl RemoteError for RpcError {
    fn from_rpc_error(err: RpcError) -> Self {
        err
    }
    fn into_rpc_error(self, _codec: Codec) -> RpcError {
        self
    }
}

impl<E> RemoteError for E
where
    E: Serialize + DeserializeOwned + From<RpcError> + Send + 'static,
{
    fn from_rpc_error(err: RpcError) -> Self {
        if err.code() == StatusCode::BusinessError {
            if let Some((codec, payload)) = err.payload() {
                if let Ok(value) = codec.decode::<E>(payload) {
                    return value;
                }
            }
        }
        E::from(err)
    }

    fn into_rpc_error(self, codec: Codec) -> RpcError {
        match codec.encode(&self) {
            Ok(payload) => RpcError::business(std::any::type_name::<E>().to_string())
                .with_payload(codec, payload),
            Err(e) => RpcError::new(
                StatusCode::ServerError,
                format!("could not encode the service's error value: {e}"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    enum MyError {
        NoSuchUser(u64),
        Rpc(String),
    }

    impl From<RpcError> for MyError {
        fn from(e: RpcError) -> Self {
            MyError::Rpc(e.to_string())
        }
    }

    #[test]
    fn typed_error_round_trips() {
        for codec in [Codec::MsgPack, Codec::Json] {
            let wire = MyError::NoSuchUser(7).into_rpc_error(codec);
            assert_eq!(wire.code(), StatusCode::BusinessError);
            assert_eq!(MyError::from_rpc_error(wire), MyError::NoSuchUser(7));
        }
    }

    #[test]
    fn failures_become_the_users_variant() {
        let e = MyError::from_rpc_error(RpcError::new(StatusCode::Timeout, "late"));
        assert!(
            matches!(e, MyError::Rpc(ref m) if m.contains("timeout (519)")),
            "{e:?}"
        );
    }

    #[test]
    fn display_names_what_was_tried() {
        let e = RpcError::new(StatusCode::CommunicationError, "connection refused")
            .with_tried(vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()])
            .maybe_delivered(true);
        let s = e.to_string();
        assert!(s.contains("127.0.0.1:1, 127.0.0.1:2"), "{s}");
        assert!(s.contains("may have been delivered"), "{s}");
        assert_eq!(
            std::mem::size_of::<RpcError>(),
            std::mem::size_of::<usize>()
        );
    }
}
