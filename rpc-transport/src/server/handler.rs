//! The seam to the layer above: what a handler is asked, what it answers, and the error
//! answers the transport builds itself.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::caller::Caller;

use futures_util::future::BoxFuture;
use futures_util::stream::{BoxStream, Stream};
use rpc_core::wire::{frame::Kind, GoAway, RemoteResultMessage};
use rpc_core::StatusCode;

use super::streams::ItemSink;
use crate::invoke::Invoke;

/// What the server does with one call.
#[non_exhaustive]
pub enum Dispatch {
    /// Answer at once (overflow, unknown entry, ...), without spawning.
    Ready(RemoteResultMessage),
    /// Run this future in a task of its own; `Cancel` drops it. Keep it small (a few hundred
    /// bytes): it is allocated per call, and glibc's allocator serves blocks above about
    /// 1 KiB through its slow paths.
    Spawn(BoxFuture<'static, RemoteResultMessage>),
    /// As [`Spawn`](Self::Spawn), for a future the handler already polled once in place (under
    /// `inline_first_poll`, finding it had to wait): the transport runs it in a task without
    /// polling it on the connection's reader a second time.
    Polled(BoxFuture<'static, RemoteResultMessage>),
    /// Answer a call that opened a stream (`Invoke::stream_mode` other than unary) with these
    /// events, run in a task of their own as `Spawn` is: first [`StreamEvent::Accepted`] (the
    /// set-up succeeded; the client is told by a `StreamCredit`) or an
    /// [`StreamEvent::End`] refusing the stream, then items, then `End`. The transport polls
    /// the stream only while the client has credit for more items, so a client that stops
    /// reading stops the producer; `Cancel` drops it. A stream ending without `End` ends with
    /// status 200.
    Stream(BoxStream<'static, StreamEvent>),
    /// As [`Stream`](Self::Stream), from events that can also append items straight to the
    /// frame the transport is assembling ([`StreamEvents::poll_items_into`]): no buffer of its
    /// own per item.
    Events(Pin<Box<dyn StreamEvents>>),
}

/// The events of a stream answering a call ([`Dispatch::Events`]), which can put items
/// straight where the transport assembles its frames: a producer of many small items then
/// costs no allocation, reference count or copy of its own per item, and no call through this
/// trait per item either.
pub trait StreamEvents: Stream<Item = StreamEvent> + Send {
    /// The next event, as `poll_next` would return it, except that plain items (those
    /// `poll_next` returns as [`StreamEvent::Item`]) are instead appended through `sink`, as
    /// many as it has room for: then [`StreamEvent::Appended`] with their number once the
    /// sink is full, or `Pending` when the producer is (the items appended before stay
    /// appended). An end after appended items comes as it would from `poll_next`.
    fn poll_items_into(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        sink: &mut ItemSink<'_>,
    ) -> Poll<Option<StreamEvent>>;

    /// While the stream waits for the client's credit, or for room in the connection's send
    /// queue (and so is not polled for items): its end if it ended meanwhile without producing
    /// anything, such as its deadline passing (the answer [`StreamEvent::End`] would carry);
    /// `Pending` while it goes on, `cx` woken when that may change. The default never ends a
    /// waiting stream.
    fn poll_ended(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<RemoteResultMessage> {
        Poll::Pending
    }

    /// The stream's end as the connection sends it, told once, when the stream's task ends
    /// with it: the end these events produced, or one the connection put in its place (the
    /// caller's request stream failed while the producer answered as if it were complete, or
    /// the caller broke the protocol and the stream was ended with 500). What the producer
    /// records of its end (span, metrics, hooks) is to follow this one. Not told when the end
    /// cannot be written (the connection's writer stopped: the stream was stopped with its
    /// connection). The default: nothing.
    fn settled(self: Pin<&mut Self>, end: &RemoteResultMessage) {
        let _ = end;
    }
}

/// What a stream answering a call produces (see [`Dispatch::Stream`]).
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// The stream is set up: items may follow.
    Accepted,
    /// One encoded item (accepts the stream first if it was not yet).
    Item(bytes::Bytes),
    /// One encoded item compressed with the algorithm of wire number `.1` (one the client
    /// accepts), sent as it is.
    Packed(bytes::Bytes, i32),
    /// The end of the stream, with its status: a refusal when it comes before `Accepted`.
    /// (Boxed: an event passes by value through every layer of a stream's poll, once per
    /// item, and the answer would make each of them a copy of some 200 bytes.)
    End(Box<RemoteResultMessage>),
    /// This many plain items were appended through the [`ItemSink`] given to
    /// [`StreamEvents::poll_items_into`] (only ever returned by that method), which is full.
    Appended(usize),
}

impl StreamEvent {
    /// An item's payload and its compression's wire number (0: plain); `None` for another
    /// event.
    pub fn into_item(self) -> Option<(bytes::Bytes, i32)> {
        match self {
            StreamEvent::Item(payload) => Some((payload, 0)),
            StreamEvent::Packed(payload, compression) => Some((payload, compression)),
            _ => None,
        }
    }
}

/// The layer above the transport: turns a call into its answer. `message_id` of the answer is
/// filled in by the transport.
pub trait InvokeHandler: Send + Sync + 'static {
    /// Decides how to answer `invoke` from `caller` (the same `Arc` for every call of a
    /// connection, built at its handshake); must not block.
    fn handle(&self, invoke: Invoke, caller: &Arc<Caller>) -> Dispatch;

    /// Decides how to answer `invoke`, a stream taking the client's items (client or
    /// bidirectional streaming), whose items come in `inbound` (the client is granted credit
    /// as they are taken). Only an answer with [`Dispatch::Stream`] or [`Dispatch::Events`]
    /// receives them: the stream's task grants the credit; after any other answer `inbound`
    /// ends with an error at once. The default: [`handle`](Self::handle), dropping the items.
    fn handle_stream(
        &self,
        invoke: Invoke,
        caller: &Arc<Caller>,
        inbound: rpc_core::ByteStream,
    ) -> Dispatch {
        drop(inbound);
        self.handle(invoke, caller)
    }

    /// Whether this handler serves the entry `entry_id`. The connection decompresses a call's
    /// arguments only for an entry served, and passes any other call to
    /// [`handle`](Self::handle) as it came, to be answered without its arguments being read:
    /// a compressed payload for an entry that does not exist costs no decompression. The
    /// default: every entry.
    fn serves(&self, entry_id: &str) -> bool {
        let _ = entry_id;
        true
    }

    /// Whether this handler decompresses a call's arguments itself, with
    /// [`Caller::unpack`](crate::Caller::unpack), once it has admitted the call: the
    /// connection then hands compressed calls on as they came, and a call the handler refuses
    /// (over its cap, its rate limit) costs no decompression. The default: `false`, the
    /// connection decompresses the arguments of every entry served before handing it on.
    fn decompresses_itself(&self) -> bool {
        false
    }

    /// Told of each call the connection answered with `code` without passing it on (see
    /// [`Refusal`]), so that the layer above can count what never reaches it. The default:
    /// nothing.
    fn refused(&self, why: Refusal, code: StatusCode) {
        let _ = (why, code);
    }
}

/// Why a connection answered a call itself, before any handler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The server is draining: the call was not run (the caller may call another endpoint).
    Draining,
    /// A stream opened on a connection that did not negotiate streams.
    StreamsNotNegotiated,
    /// Over `max_in_flight_per_connection`.
    ConnectionInFlight,
    /// Over `max_attachments` or `max_attachment_bytes`.
    Attachments,
    /// A `message_id` already in flight on the connection.
    DuplicateId,
    /// Arguments that do not decompress, or whose expansion is over what is left of
    /// `max_decompressed_bytes`.
    Decompression,
}

impl Refusal {
    /// A short name for metrics and logs (`draining`, `streams_not_negotiated`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Draining => "draining",
            Refusal::StreamsNotNegotiated => "streams_not_negotiated",
            Refusal::ConnectionInFlight => "connection_in_flight",
            Refusal::Attachments => "attachments",
            Refusal::DuplicateId => "duplicate_id",
            Refusal::Decompression => "decompression",
        }
    }
}

/// A result carrying an error status.
pub fn error_result(code: StatusCode, message: impl Into<String>) -> RemoteResultMessage {
    RemoteResultMessage {
        status_code: code.as_u32(),
        exception_message: message.into(),
        ..Default::default()
    }
}

/// A `GoAway` that ends the connection: with status 200 it is the server's last word (`last`:
/// it reads nothing more, and every call it read is answered), except for a drain's first
/// (see [`draining`]).
pub(crate) fn go_away(code: StatusCode, reason: impl Into<String>) -> Kind {
    Kind::GoAway(GoAway {
        status_code: code.as_u32(),
        reason: reason.into(),
        last: code == StatusCode::Success,
    })
}

/// The `GoAway` 200 that begins a drain: no new calls, and those in flight are still to be
/// answered (the drain ends with a [`go_away`] 200, its last).
pub(crate) fn draining(reason: impl Into<String>) -> Kind {
    Kind::GoAway(GoAway {
        status_code: StatusCode::Success.as_u32(),
        reason: reason.into(),
        last: false,
    })
}
