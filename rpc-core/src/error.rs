//! The one error type of the framework, and how a service's own error type crosses the wire.

use std::cell::RefCell;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
    unsupported_by_endpoint: bool,
    not_sent: bool,
    tried: Vec<String>,
    retry_after: Option<Duration>,
    fields: Vec<FieldError>,
}

/// One argument that failed validation, as a validation error (1001) carries it to the caller
/// (`ValidateError` of `proto/rpc.proto`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The argument or field, e.g. `quantity` or `address.zip`.
    pub member: String,
    /// What is wrong with it and what is accepted.
    pub message: String,
}

impl RpcError {
    /// An error with a status code and a message that says what failed and what to do.
    ///
    /// An error is never a success: made with status 200 ([`StatusCode::Success`]), it is a
    /// business error (1000), and is sent, counted and reported as one everywhere.
    ///
    /// ```
    /// use rpc_core::{RpcError, StatusCode};
    /// assert_eq!(RpcError::new(StatusCode::Success, "odd").code(), StatusCode::BusinessError);
    /// ```
    pub fn new(code: StatusCode, message: impl Into<String>) -> Self {
        // `Other(n)` for a number a variant names is that variant: `Other(200)` must not pass
        // for anything but `Success` (nor `Other(1001)` for less than a validation error)
        // wherever the code is matched.
        let code = match StatusCode::from_u32(code.as_u32()) {
            StatusCode::Success => StatusCode::BusinessError,
            code => code,
        };
        RpcError {
            inner: Box::new(Inner {
                code,
                message: message.into(),
                payload: None,
                maybe_delivered: false,
                unsupported_by_endpoint: false,
                not_sent: false,
                tried: Vec::new(),
                retry_after: None,
                fields: Vec::new(),
            }),
        }
    }

    /// A business error (1000): the service's own answer, returned to the caller unchanged.
    pub fn business(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BusinessError, message)
    }

    /// The same error told with another message (the status, payload, details and field
    /// errors kept): a layer that explains why it gives up says so without losing what the
    /// caller needs, such as [`retry_after`](Self::retry_after) or a typed error's value.
    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        self.inner.message = message.into();
        self
    }

    /// A validation error (1001): the service rejected the arguments.
    pub fn validation(message: impl Into<String>) -> Self {
        Self::new(StatusCode::ValidateError, message)
    }

    /// The dependency the callee needed could not be used (504, "no usable endpoint"): the
    /// 503-like status a service returns, inside its typed error, when what it calls is down.
    /// A caller's breaker counts it and its fallback answers for it.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NotFindServiceRouteAddress, message)
    }

    /// A typed error value encoded by `codec`, carried by this error.
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

    /// Marks the failure as the chosen endpoint's lack of what the call needs (its server does
    /// not stream, or takes fewer attachments than the call carries: nothing was sent; or it
    /// answered 507, having no such entry: nothing ran; or it left the registry, its
    /// connection taking no new call: nothing was sent): that endpoint will never serve the
    /// call, and another may; nothing is held against its health. Failover then moves to an untried endpoint at once. Local only:
    /// not carried on the wire nor in the serialised form.
    pub fn unsupported_by_endpoint(mut self, yes: bool) -> Self {
        self.inner.unsupported_by_endpoint = yes;
        self
    }

    /// Marks the failure as one of a call that was never sent (its deadline passed while it
    /// waited to be written, say): the server cannot have run it, whatever its status. Local
    /// only: not carried across the wire.
    pub fn not_sent(mut self, yes: bool) -> Self {
        self.inner.not_sent = yes;
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

    /// Adds a field that failed validation: sent in the answer's `validate_errors`, with the
    /// status (1001 for [`validation`](Self::validation) errors).
    ///
    /// ```
    /// use rpc_core::RpcError;
    /// let e = RpcError::validation("the order was refused")
    ///     .with_field_error("quantity", "must be between 1 and 100");
    /// assert_eq!(e.field_errors()[0].member, "quantity");
    /// ```
    pub fn with_field_error(
        mut self,
        member: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        self.inner.fields.push(FieldError {
            member: member.into(),
            message: message.into(),
        });
        self
    }

    /// The fields that failed validation (empty for other errors).
    pub fn field_errors(&self) -> &[FieldError] {
        &self.inner.fields
    }

    /// The status code.
    pub fn code(&self) -> StatusCode {
        self.inner.code
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.inner.message
    }

    /// The encoded typed error value the error carries (a business error, or a typed error
    /// carrying an infrastructure status), with the codec that encoded it.
    pub fn payload(&self) -> Option<&(Codec, Bytes)> {
        self.inner.payload.as_ref()
    }

    /// True when the request may have reached the server before the failure.
    pub fn is_maybe_delivered(&self) -> bool {
        self.inner.maybe_delivered
    }

    /// True when the call was never sent (see [`not_sent`](Self::not_sent)).
    pub fn is_not_sent(&self) -> bool {
        self.inner.not_sent
    }

    /// True when the chosen endpoint cannot serve the call and nothing ran there (see
    /// [`unsupported_by_endpoint`](Self::unsupported_by_endpoint)).
    pub fn is_unsupported_by_endpoint(&self) -> bool {
        self.inner.unsupported_by_endpoint
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
        for (i, field) in self.inner.fields.iter().enumerate() {
            let sep = if i == 0 { " (" } else { "; " };
            write!(f, "{sep}{}: {}", field.member, field.message)?;
        }
        if !self.inner.fields.is_empty() {
            f.write_str(")")?;
        }
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
            .field(
                "unsupported_by_endpoint",
                &self.inner.unsupported_by_endpoint,
            )
            .field("tried", &self.inner.tried)
            .field("retry_after", &self.inner.retry_after)
            .field("field_errors", &self.inner.fields)
            .finish()
    }
}

impl std::error::Error for RpcError {}

/// The serialised form of an [`RpcError`]; see [`serde_rpc_error`].
#[derive(Serialize, Deserialize)]
#[serde(rename = "RpcError")]
struct SerialForm {
    code: u32,
    message: String,
    #[serde(default)]
    maybe_delivered: bool,
    #[serde(default)]
    tried: Vec<String>,
    #[serde(default)]
    retry_after_ms: Option<u64>,
    /// The validation errors' fields, as `[member, message]` pairs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    fields: Vec<(String, String)>,
}

thread_local! {
    /// While [`RemoteError::into_rpc_error`] encodes a typed error value: the first `RpcError`
    /// the value holds, which gives the value its status.
    static CARRIED: RefCell<Option<Option<RpcError>>> = const { RefCell::new(None) };
}

/// Serialises an [`RpcError`] held in a typed error value, with its status and details:
/// `#[serde(with = "rpc::serde_rpc_error")]` on the field.
///
/// ```
/// use rpc_core::{serde_rpc_error, RpcError};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, Serialize, Deserialize)]
/// enum OrderError {
///     OutOfStock { item: String },
///     /// A failed downstream call: travels with its status (see `RemoteError`).
///     Rpc(#[serde(with = "serde_rpc_error")] RpcError),
/// }
///
/// impl From<RpcError> for OrderError {
///     fn from(e: RpcError) -> Self {
///         OrderError::Rpc(e)
///     }
/// }
/// ```
///
/// The serialised form is a map with `code` (the status number), `message`,
/// `maybe_delivered`, `tried` (endpoints, in order), `retry_after_ms` (null when unknown) and,
/// for a validation error, `fields` (`[member, message]` pairs, absent when none); a typed
/// error payload the error itself carries is left out.
pub mod serde_rpc_error {
    use super::*;

    /// Serialises `e` (and, while a typed error value is being encoded for the wire, makes it
    /// the value's status).
    pub fn serialize<S: Serializer>(e: &RpcError, serializer: S) -> Result<S::Ok, S::Error> {
        CARRIED.with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                if let Some(slot @ None) = c.as_mut() {
                    *slot = Some(e.clone());
                }
            }
        });
        SerialForm {
            code: e.inner.code.as_u32(),
            message: e.inner.message.clone(),
            maybe_delivered: e.inner.maybe_delivered,
            tried: e.inner.tried.clone(),
            retry_after_ms: e
                .inner
                .retry_after
                .map(|d| d.as_millis().min(u64::MAX as u128) as u64),
            fields: e
                .inner
                .fields
                .iter()
                .map(|f| (f.member.clone(), f.message.clone()))
                .collect(),
        }
        .serialize(serializer)
    }

    /// Deserialises what [`serialize`] wrote.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<RpcError, D::Error> {
        let f = SerialForm::deserialize(deserializer)?;
        let mut e = RpcError::new(StatusCode::from_u32(f.code), f.message)
            .maybe_delivered(f.maybe_delivered)
            .with_tried(f.tried);
        if let Some(ms) = f.retry_after_ms {
            e = e.with_retry_after(Duration::from_millis(ms));
        }
        for (member, message) in f.fields {
            e = e.with_field_error(member, message);
        }
        Ok(e)
    }
}

impl StatusCode {
    /// The status a typed error value travels with when it holds an error with this status:
    /// the callee's own answers (and a nonsensical success) stay a business error (1000); a
    /// failure to reach the callee's own dependency becomes 504, "no usable endpoint": 506
    /// connection, 522 open breaker, and what only the dependency's side says of the callee's
    /// call (517 its connection refused, 404/507/513 its service or entry not found), which a
    /// handler never answers of its own. The callee itself was reached: kept, these would tell
    /// its caller that the callee refused it or has no such entry (a gateway would answer 401
    /// or 404), and spare the callee's breaker. Every other status is kept, 501 among them (a
    /// handler may say it does not implement something).
    pub const fn carried(self) -> StatusCode {
        match self {
            StatusCode::CommunicationError
            | StatusCode::CircuitOpen
            | StatusCode::RpcUnAuthentication
            | StatusCode::NotFindServiceRoute
            | StatusCode::NotFindLocalServiceEntry
            | StatusCode::NotFindServiceEntry => StatusCode::NotFindServiceRouteAddress,
            StatusCode::Success => StatusCode::BusinessError,
            code if code.is_callee_answer() => StatusCode::BusinessError,
            code => code,
        }
    }
}

impl RpcError {
    /// What travels for this error when a value holding it (`payload`, encoded by `codec`) is
    /// a handler's answer: its status mapped by [`StatusCode::carried`], its message and
    /// details, and the payload.
    fn carried_by(&self, codec: Codec, payload: Bytes) -> RpcError {
        let mut e = RpcError::new(self.code().carried(), self.message().to_string())
            .with_payload(codec, payload)
            .maybe_delivered(self.is_maybe_delivered())
            .with_tried(self.tried().to_vec());
        if let Some(after) = self.retry_after() {
            e = e.with_retry_after(after);
        }
        e.inner.fields = self.inner.fields.clone();
        e
    }
}

/// Encodes `value`, returning the first [`RpcError`] it holds, if any.
fn encode_capturing<E: Serialize>(
    value: &E,
    codec: Codec,
) -> (Result<Bytes, crate::CodecError>, Option<RpcError>) {
    let outer = CARRIED.with(|c| c.replace(Some(None)));
    let encoded = codec.encode(value);
    let carried = CARRIED.with(|c| c.replace(outer)).flatten();
    (encoded, carried)
}

/// An error type that a service method may return: [`RpcError`] itself, or any user type that is
/// `Serialize + DeserializeOwned + From<RpcError>`.
///
/// A user error value returned by a handler travels encoded, and the client proxy decodes it
/// back into the same type. Its status says what kind of failure it is:
///
/// - a value that holds no [`RpcError`] is the service's business answer (1000): never counted
///   by a breaker, never retried, never replaced by a fallback;
/// - a value that holds an [`RpcError`] through [`serde_rpc_error`] (typically a variant
///   `Rpc(#[serde(with = "rpc::serde_rpc_error")] RpcError)` filled by `From<RpcError>`, so
///   `?` on a failed downstream call produces it) travels with that
///   error's status, mapped by [`StatusCode::carried`], and with its details (maybe-delivered,
///   endpoints tried, retry-after) inside the value. The caller's governance treats it as the
///   infrastructure failure it is: its breaker counts it and its fallback answers for it. To
///   say "unavailable" without a downstream error, hold [`RpcError::unavailable`].
///
/// Failures of the call itself (timeout, no endpoint, ...) reach the caller through
/// `From<RpcError>`.
pub trait RemoteError: Sized + Send + 'static {
    /// Builds the caller-side error from what the call produced.
    fn from_rpc_error(err: RpcError) -> Self;
    /// Turns a handler's error into what is sent back.
    fn into_rpc_error(self, codec: Codec) -> RpcError;
}

/// A handler's own [`RpcError`] travels as a typed value holding it would: a callee answer
/// (business, validation, application auth) unchanged; any other status (typically a failed
/// downstream call passed on with `?`: 506, 515, 519, ...) mapped by [`StatusCode::carried`] and
/// with the error in its serialised form ([`serde_rpc_error`]) as the payload. The payload is
/// what tells the caller that the handler ran, so the call is not repeated elsewhere unless its
/// entry is idempotent: a downstream's 506 must not read as "this server was never reached".
impl RemoteError for RpcError {
    fn from_rpc_error(err: RpcError) -> Self {
        err
    }
    fn into_rpc_error(self, codec: Codec) -> RpcError {
        if let Some((from, payload)) = self.payload() {
            // A downstream's typed error passed on with `?`: its payload in this call's codec,
            // which the caller decodes it by (a JSON caller of a handler that called on with
            // MessagePack).
            // One that cannot be written in this codec is not sent in the other under its
            // name: the caller would read it by the wrong codec.
            if *from != codec {
                return match from.transcode(payload, codec) {
                    Ok(recoded) => self.with_payload(codec, recoded),
                    Err(e) => RpcError::new(
                        StatusCode::ServerError,
                        format!(
                            "could not pass on the error value of a call made with {from:?} to \
                             this call's {codec:?}: {e}"
                        ),
                    ),
                };
            }
            return self;
        }
        if self.code().is_callee_answer() {
            return self;
        }
        /// The error in the form `serde_rpc_error` writes.
        struct Serialised<'a>(&'a RpcError);
        impl Serialize for Serialised<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                serde_rpc_error::serialize(self.0, s)
            }
        }
        match codec.encode(&Serialised(&self)) {
            Ok(payload) => self.carried_by(codec, payload),
            Err(e) => RpcError::new(
                StatusCode::ServerError,
                format!("could not encode the service's error: {e}"),
            ),
        }
    }
}

impl<E> RemoteError for E
where
    E: Serialize + DeserializeOwned + From<RpcError> + Send + 'static,
{
    fn from_rpc_error(err: RpcError) -> Self {
        // Whatever its status: a typed value carrying an infrastructure status has a payload too.
        if let Some((codec, payload)) = err.payload() {
            if let Ok(value) = codec.decode::<E>(payload) {
                return value;
            }
        }
        E::from(err)
    }

    fn into_rpc_error(self, codec: Codec) -> RpcError {
        match encode_capturing(&self, codec) {
            (Ok(payload), None) => RpcError::business(std::any::type_name::<E>().to_string())
                .with_payload(codec, payload),
            (Ok(payload), Some(held)) => held.carried_by(codec, payload),
            (Err(e), _) => RpcError::new(
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
    fn a_known_number_given_as_other_is_its_variant_and_an_error_is_never_200() {
        assert_eq!(
            RpcError::new(StatusCode::Other(1001), "x").code(),
            StatusCode::ValidateError
        );
        for success in [StatusCode::Other(200), StatusCode::Success] {
            let e = RpcError::new(success, "not a success");
            assert_eq!(e.code(), StatusCode::BusinessError);
        }
        let e = RpcError::new(StatusCode::Other(200), "not a success");
        let wire = e.into_rpc_error(Codec::MsgPack);
        assert_ne!(wire.code().as_u32(), 200, "{wire:?}");
    }

    #[test]
    fn a_validation_error_held_in_a_typed_error_keeps_its_fields() {
        let inner = RpcError::validation("bad order").with_field_error("qty", "must be above 0");
        for codec in [Codec::MsgPack, Codec::Json] {
            let wire = OrderError::Rpc(inner.clone()).into_rpc_error(codec);
            assert_eq!(wire.field_errors(), inner.field_errors(), "sent, {codec:?}");
            assert_eq!(
                OrderError::from_rpc_error(wire),
                OrderError::Rpc(inner.clone()),
                "decoded, {codec:?}"
            );
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

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    enum OrderError {
        OutOfStock { item: String },
        Rpc(#[serde(with = "serde_rpc_error")] RpcError),
    }

    impl From<RpcError> for OrderError {
        fn from(e: RpcError) -> Self {
            OrderError::Rpc(e)
        }
    }

    #[test]
    fn a_typed_error_holding_an_rpc_error_carries_its_status_and_details() {
        for codec in [Codec::MsgPack, Codec::Json] {
            let down = RpcError::new(StatusCode::CommunicationError, "connection refused")
                .with_tried(vec!["127.0.0.1:1".into()])
                .maybe_delivered(true)
                .with_retry_after(Duration::from_millis(1500));
            let wire = OrderError::Rpc(down.clone()).into_rpc_error(codec);
            assert_eq!(wire.code().as_u32(), 504, "{wire}");
            assert_eq!(wire.tried(), ["127.0.0.1:1"]);
            assert!(wire.is_maybe_delivered());
            assert_eq!(wire.retry_after(), Some(Duration::from_millis(1500)));
            // The caller decodes the value with the inner error's own status and details.
            assert_eq!(OrderError::from_rpc_error(wire), OrderError::Rpc(down));

            let late = RpcError::new(StatusCode::Timeout, "late");
            let wire = OrderError::Rpc(late).into_rpc_error(codec);
            assert_eq!(wire.code().as_u32(), 519);

            let business = OrderError::OutOfStock { item: "nut".into() }.into_rpc_error(codec);
            assert_eq!(business.code().as_u32(), 1000);
            let wrapped = OrderError::Rpc(RpcError::validation("bad qty")).into_rpc_error(codec);
            assert_eq!(wrapped.code().as_u32(), 1000, "a callee answer stays one");
        }
    }

    #[test]
    fn a_handlers_own_infrastructure_error_travels_carried_with_a_payload() {
        for codec in [Codec::MsgPack, Codec::Json] {
            let down = RpcError::new(StatusCode::CommunicationError, "stock: connection refused")
                .with_tried(vec!["127.0.0.1:1".into()])
                .with_retry_after(Duration::from_millis(1500));
            let wire = down.into_rpc_error(codec);
            // As a typed value holding it would travel: 506 becomes 504, with a payload.
            assert_eq!(wire.code().as_u32(), 504, "{wire}");
            assert!(wire.payload().is_some(), "the payload says the handler ran");
            assert_eq!(wire.message(), "stock: connection refused");
            assert_eq!(wire.tried(), ["127.0.0.1:1"]);
            assert_eq!(wire.retry_after(), Some(Duration::from_millis(1500)));
            let overflow = RpcError::new(StatusCode::OverflowMaxServerHandle, "full");
            let wire = overflow.into_rpc_error(codec);
            assert_eq!(wire.code().as_u32(), 515);
            assert!(wire.payload().is_some());
            // What only the dependency's side said of the handler's call: not the handler's
            // own refusal of its caller, nor an entry its caller asked for that is missing.
            for code in [517, 404, 507, 513] {
                let wire =
                    RpcError::new(StatusCode::from_u32(code), "downstream").into_rpc_error(codec);
                assert_eq!(wire.code().as_u32(), 504, "{code}: {wire}");
            }
            // A handler's own "not implemented" stays its own.
            let own = RpcError::new(StatusCode::NotImplemented, "not yet").into_rpc_error(codec);
            assert_eq!(own.code().as_u32(), 501);
        }
    }

    /// A downstream's typed error passed on by a handler goes back in the handler's caller's
    /// codec, whatever codec the handler called on with: the caller decodes it by its own,
    /// binaries included.
    #[test]
    fn a_passed_on_payload_travels_in_the_callers_codec() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Blob {
            #[serde(with = "serde_bytes_like")]
            data: Vec<u8>,
        }
        /// A field written as bytes (a MessagePack bin), read from bytes or a sequence.
        mod serde_bytes_like {
            pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(v)
            }
            pub fn deserialize<'de, D: serde::Deserializer<'de>>(
                d: D,
            ) -> Result<Vec<u8>, D::Error> {
                <Vec<u8> as serde::Deserialize>::deserialize(d)
            }
        }
        let blob = Blob {
            data: vec![1, 2, 255],
        };
        let payload = Codec::MsgPack.encode(&blob).unwrap();
        let passed_on = RpcError::business("blob")
            .with_payload(Codec::MsgPack, payload)
            .into_rpc_error(Codec::Json);
        let (codec, bytes) = passed_on.payload().expect("the payload stays");
        assert_eq!(*codec, Codec::Json);
        assert_eq!(Codec::Json.decode::<Blob>(bytes).unwrap(), blob);
        let typed = MyError::NoSuchUser(7);
        for (down, up) in [(Codec::MsgPack, Codec::Json), (Codec::Json, Codec::MsgPack)] {
            let payload = down.encode(&typed).unwrap();
            let passed_on = RpcError::business("no such user")
                .with_payload(down, payload)
                .into_rpc_error(up);
            let (codec, bytes) = passed_on.payload().expect("the payload stays");
            assert_eq!(*codec, up);
            assert_eq!(
                up.decode::<MyError>(bytes).unwrap(),
                typed,
                "{down:?} → {up:?}"
            );
        }
    }

    /// A downstream's typed error that JSON cannot write (a map keyed by tuples, which
    /// MessagePack writes with array keys) is not sent to a JSON caller in MessagePack under
    /// JSON's name: the call answers 520, as a value the handler could not encode does.
    #[test]
    fn a_passed_on_payload_that_cannot_be_recoded_is_not_sent_in_the_other_codec() {
        let keyed = std::collections::BTreeMap::from([((1u32, 2u32), "x".to_string())]);
        let passed_on = RpcError::business("conflict")
            .with_payload(Codec::MsgPack, Codec::MsgPack.encode(&keyed).unwrap())
            .into_rpc_error(Codec::Json);
        assert!(passed_on.payload().is_none(), "{passed_on:?}");
        assert_eq!(passed_on.code(), StatusCode::ServerError);
        assert!(
            passed_on
                .message()
                .contains("could not pass on the error value"),
            "{passed_on}"
        );
    }

    #[test]
    fn a_handlers_own_callee_answer_travels_unchanged() {
        for e in [
            RpcError::validation("bad qty").with_field_error("qty", "must be positive"),
            RpcError::business("no such order"),
        ] {
            let wire = e.clone().into_rpc_error(Codec::MsgPack);
            assert_eq!(wire.code(), e.code());
            assert!(wire.payload().is_none());
            assert_eq!(wire.field_errors(), e.field_errors());
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
