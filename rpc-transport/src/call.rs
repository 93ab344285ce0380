//! A call as the client hands it to its connection: what the writer encodes, shared by the
//! client side and the writer so that neither depends on the other.

use std::borrow::Cow;
use std::collections::BTreeMap;

use bytes::Bytes;
use rpc_core::wire::RemoteInvokeMessage;

use crate::encode::InvokeFields;

/// One call for [`Connection::call`](crate::Connection::call): a `RemoteInvokeMessage` without its `message_id`, which the
/// connection assigns. The entry id is usually a method descriptor's `&'static str`, borrowed
/// rather than copied into every call; any `RemoteInvokeMessage` converts into a `Call`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    /// Which method to run: `"<service id>.<method>"`, for example `"echo.Echo.echo"`.
    pub service_entry_id: Cow<'static, str>,
    /// How `parameters` is encoded, and how the result will be (`Codec::to_wire`).
    pub codec: i32,
    /// The encoded argument list.
    pub parameters: Bytes,
    /// Context carried with the call.
    pub attachments: BTreeMap<String, String>,
    /// The call's retry depth ([`RETRY_DEPTH_KEY`](rpc_core::RETRY_DEPTH_KEY)), sent as that
    /// attachment when not 0, over any entry of that key in `attachments`: a field of its own,
    /// so that a client marking every call it may retry allocates nothing for it.
    pub retry_depth: u32,
    /// The caller's remaining budget in milliseconds; 0 means no deadline.
    pub timeout_ms: u32,
    /// The algorithm `parameters` is already compressed with, as a wire number
    /// (`Compression::to_wire`; 0: plain). Only one the server accepts
    /// ([`Connection::accepts`](crate::Connection::accepts)); see
    /// [`compression::pack`](crate::compression::pack).
    pub compression: i32,
    /// `StreamMode` of the call (`StreamMode::Unary as i32`, 0, for a plain call); set by
    /// [`Connection::open_stream`](crate::Connection::open_stream).
    pub stream_mode: i32,
}

impl Call {
    pub(crate) fn fields(&self, message_id: u64) -> InvokeFields<'_> {
        InvokeFields {
            message_id,
            service_entry_id: &self.service_entry_id,
            codec: self.codec,
            parameters: &self.parameters,
            attachments: &self.attachments,
            retry_depth: self.retry_depth,
            timeout_ms: self.timeout_ms,
            compression: self.compression,
            stream_mode: self.stream_mode,
        }
    }
}

impl From<RemoteInvokeMessage> for Call {
    /// Takes everything but `message_id`.
    fn from(m: RemoteInvokeMessage) -> Self {
        Call {
            service_entry_id: m.service_entry_id.into(),
            codec: m.codec,
            parameters: m.parameters,
            attachments: m.attachments,
            retry_depth: 0,
            timeout_ms: m.timeout_ms,
            compression: m.compression,
            stream_mode: m.stream_mode,
        }
    }
}
