//! A call as the server reads it: the fields of a `RemoteInvokeMessage`, with the entry id
//! sharing the frame's buffer instead of being copied into a `String` of its own.
//!
//! The entry id is read on every call only to look the method up; copying it out of the
//! frame cost an allocation per call. [`WireStr`] holds it as a slice of the frame's bytes,
//! checked to be UTF-8 once, when the frame is decoded; the server looks it up by its bytes
//! ([`WireStr::as_bytes`]), so no call checks them again.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;

use bytes::Bytes;
use rpc_core::wire::{frame::Kind, RemoteInvokeMessage};
use rpc_core::RETRY_DEPTH_KEY;

/// A UTF-8 string sharing the buffer of the frame it was read from. Cheap to clone.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct WireStr(Bytes);

impl WireStr {
    /// `bytes` as a string, if they are UTF-8.
    pub fn from_utf8(bytes: Bytes) -> Result<WireStr, std::str::Utf8Error> {
        // Entry ids are ASCII in practice: checked a word at a time, where the general check
        // goes byte by byte on short strings.
        if !bytes.is_ascii() {
            std::str::from_utf8(&bytes)?;
        }
        Ok(WireStr(bytes))
    }

    /// `bytes` the caller has checked to be UTF-8 (the frame decoder).
    pub(crate) fn checked(bytes: Bytes) -> WireStr {
        debug_assert!(std::str::from_utf8(&bytes).is_ok());
        WireStr(bytes)
    }

    /// The string's bytes (UTF-8), without checking them again: for lookups by bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The string (its bytes are checked again: on the hot path, prefer
    /// [`as_bytes`](Self::as_bytes)).
    pub fn as_str(&self) -> &str {
        // Checked when built (`from_utf8`, `From<String>`, `From<&'static str>`); the empty
        // fallback is never taken.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl Deref for WireStr {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl From<String> for WireStr {
    fn from(s: String) -> Self {
        WireStr(Bytes::from(s.into_bytes()))
    }
}

impl From<&'static str> for WireStr {
    fn from(s: &'static str) -> Self {
        WireStr(Bytes::from_static(s.as_bytes()))
    }
}

impl fmt::Debug for WireStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for WireStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One call, as an [`InvokeHandler`](crate::InvokeHandler) receives it: the fields of
/// `RemoteInvokeMessage` (see `proto/rpc.proto`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Invoke {
    /// The id the client matches the answer with.
    pub message_id: u64,
    /// Which method to run: `"<service id>.<method>"`.
    pub service_entry_id: WireStr,
    /// How `parameters` is encoded (`Codec::to_wire`).
    pub codec: i32,
    /// The encoded argument list.
    pub parameters: Bytes,
    /// Context carried with the call, but for the retry depth.
    pub attachments: BTreeMap<String, String>,
    /// The call's retry depth, the attachment
    /// [`RETRY_DEPTH_KEY`](rpc_core::RETRY_DEPTH_KEY) as a number when it is one above 0 (it
    /// is then not in `attachments`): nearly every call carries it, and a map entry would cost
    /// each of them three allocations. 0: none.
    pub retry_depth: u32,
    /// The caller's remaining budget in milliseconds; 0 means no deadline.
    pub timeout_ms: u32,
    /// The algorithm `parameters` crossed the wire compressed with, as a wire number (0:
    /// plain). As the frame is decoded, `parameters` holds the bytes as sent; the server
    /// decompresses them before a handler sees the call, so a handler gets plain parameters
    /// and learns here how they came (a server answers with the same algorithm by default).
    pub compression: i32,
    /// The call's shape (`StreamMode` as a number; 0, unary, for a plain call).
    pub stream_mode: i32,
}

impl Invoke {
    /// The call's shape, `None` for a number no `StreamMode` names.
    pub fn mode(&self) -> Option<rpc_core::StreamMode> {
        rpc_core::StreamMode::try_from(self.stream_mode).ok()
    }
}

/// The retry depth an attachment value gives: a number above 0, or `None` (the entry then
/// stays an attachment as it came).
pub(crate) fn retry_depth_of(value: &str) -> Option<u32> {
    value.parse().ok().filter(|depth| *depth > 0)
}

impl From<RemoteInvokeMessage> for Invoke {
    /// Keeps the id's bytes (no copy).
    fn from(mut m: RemoteInvokeMessage) -> Self {
        let retry_depth = m
            .attachments
            .get(RETRY_DEPTH_KEY)
            .and_then(|v| retry_depth_of(v))
            .unwrap_or(0);
        if retry_depth > 0 {
            m.attachments.remove(RETRY_DEPTH_KEY);
        }
        Invoke {
            message_id: m.message_id,
            service_entry_id: m.service_entry_id.into(),
            codec: m.codec,
            parameters: m.parameters,
            attachments: m.attachments,
            retry_depth,
            timeout_ms: m.timeout_ms,
            compression: m.compression,
            stream_mode: m.stream_mode,
        }
    }
}

impl From<Invoke> for RemoteInvokeMessage {
    fn from(mut i: Invoke) -> Self {
        if i.retry_depth > 0 {
            i.attachments
                .insert(RETRY_DEPTH_KEY.to_string(), i.retry_depth.to_string());
        }
        RemoteInvokeMessage {
            message_id: i.message_id,
            service_entry_id: i.service_entry_id.as_str().to_string(),
            codec: i.codec,
            parameters: i.parameters,
            attachments: i.attachments,
            timeout_ms: i.timeout_ms,
            compression: i.compression,
            stream_mode: i.stream_mode,
        }
    }
}

/// A frame as the server reads it: a call, or any other frame.
#[derive(Debug, PartialEq)]
pub(crate) enum Incoming {
    /// A `RemoteInvokeMessage`.
    Invoke(Invoke),
    /// Any other kind (never `Kind::Invoke`).
    Other(Kind),
}

impl From<Kind> for Incoming {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Invoke(m) => Incoming::Invoke(m.into()),
            other => Incoming::Other(other),
        }
    }
}
