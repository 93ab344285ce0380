//! Admission of frames and calls on one connection: the in-flight limit, the attachment
//! limits, the call rate, and the answer to each frame.

use crate::caller::Caller;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rpc_core::wire::{frame::Kind, CancelReason, Pong};
use rpc_core::StatusCode;
use rpc_core::StreamMode;
use tokio::time::Instant;

use super::calls::{dispatch, Conn};
use super::expansion::{ExpansionBudget, Unpacker};
use super::handler::{error_result, InvokeHandler, Refusal};
use super::options::{ServerOptions, ABUSE_LIMIT};
use super::streams::{Inbound, Queued, StreamSlot};
use crate::codec::kind_name;
use crate::invoke::{Incoming, Invoke};

/// One connection's call rate: a token bucket holding a tenth of a second's calls.
pub(super) struct CallRate {
    pub(super) per_second: f64,
    pub(super) burst: f64,
    pub(super) tokens: f64,
    pub(super) at: Instant,
}

impl CallRate {
    pub(super) fn new(per_second: u32, now: Instant) -> Self {
        let per_second = f64::from(per_second.max(1));
        let burst = (per_second / 10.0).max(1.0);
        CallRate {
            per_second,
            burst,
            tokens: burst,
            at: now,
        }
    }

    /// Counts a call that started at `now`; when the next one would be over the rate, the
    /// instant it may start.
    pub(super) fn take(&mut self, now: Instant) -> Option<Instant> {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * self.per_second;
        self.tokens = (self.tokens + refill).min(self.burst) - 1.0;
        self.at = now;
        (self.tokens < 1.0)
            .then(|| now + Duration::from_secs_f64((1.0 - self.tokens) / self.per_second))
    }
}

/// After a call: arms `throttle` and returns true when the connection's rate says to wait.
pub(super) fn throttle_at(
    rate: &mut Option<CallRate>,
    throttle: std::pin::Pin<&mut tokio::time::Sleep>,
) -> bool {
    match rate.as_mut().and_then(|r| r.take(Instant::now())) {
        Some(until) => {
            throttle.reset(until);
            true
        }
        None => false,
    }
}

/// What handling one frame needs.
pub(super) struct FrameCtx<'a> {
    pub(super) conn: &'a Arc<Conn>,
    pub(super) options: &'a ServerOptions,
    pub(super) handler: &'a dyn InvokeHandler,
    pub(super) caller: Arc<Caller>,
    pub(super) expansion: &'a ExpansionBudget,
    pub(super) unpacker: Unpacker,
}

impl FrameCtx<'_> {
    /// Answers call `id` with `code` and `message` in its place, and tells the handler why.
    fn refuse(&self, id: u64, why: Refusal, code: StatusCode, message: impl Into<String>) {
        let mut r = error_result(code, message);
        r.message_id = id;
        self.conn.sender.send(Kind::Result(r));
        self.handler.refused(why, code);
    }

    /// Why a call is refused before it runs, if it is: over the connection's in-flight limit,
    /// or carrying too many or too large attachments.
    pub(super) fn refusal(&self, invoke: &Invoke) -> Option<(Refusal, StatusCode, String)> {
        let o = self.options;
        let running = self.conn.in_flight.load(Ordering::Acquire);
        if running >= o.max_in_flight_per_connection {
            self.conn.refused_in_a_row.fetch_add(1, Ordering::Relaxed);
            return Some((
                Refusal::ConnectionInFlight,
                StatusCode::OverflowMaxServerHandle,
                format!(
                    "this connection already has {running} calls running (the limit per \
                     connection); the call was not run"
                ),
            ));
        }
        self.conn.refused_in_a_row.store(0, Ordering::Relaxed);
        let a = &invoke.attachments;
        if a.len() > o.max_attachments {
            self.conn.abuses.fetch_add(1, Ordering::Relaxed);
            return Some((
                Refusal::Attachments,
                StatusCode::FrameworkError,
                format!(
                    "{} attachments exceed the limit of {}; the call was not run",
                    a.len(),
                    o.max_attachments
                ),
            ));
        }
        if !a.is_empty() {
            let bytes: usize = a.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > o.max_attachment_bytes {
                self.conn.abuses.fetch_add(1, Ordering::Relaxed);
                return Some((
                    Refusal::Attachments,
                    StatusCode::FrameworkError,
                    format!(
                        "attachments of {bytes} bytes exceed the limit of {} bytes; the call was \
                         not run",
                        o.max_attachment_bytes
                    ),
                ));
            }
        }
        if self.conn.abuses.load(Ordering::Relaxed) != 0 {
            self.conn.abuses.store(0, Ordering::Relaxed);
        }
        None
    }

    /// Handles one frame; `Err` ends the connection (with a reason to send, or quietly).
    pub(super) fn on_frame(
        &self,
        next: Option<Result<Incoming, crate::FrameError>>,
        draining: bool,
    ) -> Result<(), Option<String>> {
        let conn = self.conn;
        match next {
            Some(Ok(Incoming::Invoke(invoke))) => {
                let id = invoke.message_id;
                if draining {
                    self.refuse(
                        id,
                        Refusal::Draining,
                        StatusCode::CommunicationError,
                        "the server is shutting down and did not run the call; call another \
                         endpoint",
                    );
                } else if invoke.stream_mode != 0 && conn.client_window.is_none() {
                    self.refuse(
                        id,
                        Refusal::StreamsNotNegotiated,
                        StatusCode::FrameworkError,
                        "this connection did not negotiate streams: set Hello.streams to open \
                         a stream; the call was not run",
                    );
                } else if let Some((refusal, code, why)) = self.refusal(&invoke) {
                    self.refuse(id, refusal, code, why);
                    let abuses = conn.abuses.load(Ordering::Relaxed);
                    if abuses > ABUSE_LIMIT {
                        return Err(Some(format!(
                            "{abuses} calls broke the attachment limits: closing the connection"
                        )));
                    }
                } else if conn.in_flight.load(Ordering::Acquire) > 0
                    && conn.tasks().contains_key(&id)
                {
                    // (With no call running, the map of running calls is empty.)
                    self.refuse(
                        id,
                        Refusal::DuplicateId,
                        StatusCode::FrameworkError,
                        format!(
                            "message_id {id} is already in flight on this connection; use a new \
                             id per call"
                        ),
                    );
                } else if matches!(invoke.mode(), Some(StreamMode::Client | StreamMode::Bidi)) {
                    // Compressed set-up arguments are unpacked as a unary call's are.
                    let mut invoke = invoke;
                    if self.unpack(&mut invoke, id).is_err() {
                        return Ok(());
                    }
                    // The client's items may come before the handler is set up: they wait in
                    // the stream's queue, which exists from now on.
                    let slot = StreamSlot::new(
                        self.options.stream_window.max(1),
                        u64::from(self.options.stream_window_bytes),
                        self.options.max_frame_length,
                    );
                    let slot = Arc::new(if invoke.mode() == Some(StreamMode::Bidi) {
                        slot.answering_items()
                    } else {
                        slot
                    });
                    conn.streams.open(id, slot.clone());
                    let inbound = Inbound::new(
                        id,
                        slot.clone(),
                        conn.sender.clone(),
                        self.expansion.clone(),
                    );
                    let inbound = rpc_core::RpcStream::try_new(inbound);
                    let no_deadline = invoke.timeout_ms == 0;
                    let outcome = self.handler.handle_stream(invoke, &self.caller, inbound);
                    dispatch(conn, outcome, id, false, (Some(slot), no_deadline));
                } else {
                    let mut invoke = invoke;
                    if self.unpack(&mut invoke, id).is_err() {
                        return Ok(());
                    }
                    let no_deadline = invoke.timeout_ms == 0;
                    let outcome = self.handler.handle(invoke, &self.caller);
                    dispatch(
                        conn,
                        outcome,
                        id,
                        self.options.inline_first_poll,
                        (None, no_deadline),
                    );
                }
                Ok(())
            }
            Some(Ok(Incoming::Other(Kind::Cancel(c)))) => {
                if let Some(h) = conn.tasks().remove(&c.message_id) {
                    // A stream's task, perhaps in a poll on another thread, queues no more of
                    // it: the client may reuse the id once it has cancelled.
                    if let Some(slot) = conn.streams.get(c.message_id) {
                        slot.stop();
                    }
                    if c.reason == CancelReason::Superseded as i32 {
                        h.abort_superseded();
                    } else {
                        h.abort();
                    }
                    if conn.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
                        conn.idle.notify_one();
                    }
                    conn.finished.notify_one();
                }
                Ok(())
            }
            Some(Ok(Incoming::Other(Kind::StreamCredit(c)))) => {
                // Credit for a stream that ended meanwhile is dropped.
                if let Some(slot) = conn.streams.get(c.message_id) {
                    slot.grant(c.items);
                }
                Ok(())
            }
            Some(Ok(Incoming::Other(Kind::StreamItem(item)))) => {
                // (Items of a stream that ended are dropped; a stream that takes none, or is
                // sent more than its credit, ends with an error. Compressed items stay so until
                // the handler takes them.)
                if let Some(slot) = conn.streams.get(item.message_id) {
                    slot.push([Queued {
                        payload: item.payload,
                        compression: item.compression,
                    }]);
                }
                Ok(())
            }
            Some(Ok(Incoming::Other(Kind::StreamItems(items)))) => {
                if let Some(slot) = conn.streams.get(items.message_id) {
                    let compression = items.compression;
                    slot.push(items.payloads.into_iter().map(|payload| Queued {
                        payload,
                        compression,
                    }));
                }
                Ok(())
            }
            Some(Ok(Incoming::Other(Kind::StreamEnd(end)))) => {
                if let Some(slot) = conn.streams.get(end.message_id) {
                    slot.finish(end);
                }
                Ok(())
            }
            Some(Ok(Incoming::Other(Kind::Ping(p)))) => {
                conn.sender.send(Kind::Pong(Pong { nonce: p.nonce }));
                Ok(())
            }
            Some(Ok(Incoming::Other(Kind::Pong(_)))) => Ok(()),
            Some(Ok(Incoming::Other(Kind::GoAway(_)))) => Err(None),
            Some(Ok(Incoming::Other(other))) => Err(Some(format!(
                "protocol violation: unexpected {} after the handshake",
                kind_name(&other)
            ))),
            Some(Err(e)) => Err(Some(e.to_string())),
            None => Err(None),
        }
    }
}

impl FrameCtx<'_> {
    /// Decompresses call `id`'s parameters (of an entry the handler serves, unless the handler
    /// decompresses them itself after its admission) into a buffer that holds their share of
    /// the server's expansion budget until the last of its bytes is dropped (the handler has
    /// decoded them). A call whose parameters do not decompress is answered 500, one beyond
    /// what is left of the budget 515, and neither runs (`Err`). The connection and its other
    /// calls go on: one bad payload says nothing about the next.
    fn unpack(&self, invoke: &mut Invoke, id: u64) -> Result<(), ()> {
        // A call to an entry not served goes as it came: its answer reads no argument.
        if invoke.compression == 0
            || self.handler.decompresses_itself()
            || !self.handler.serves(&invoke.service_entry_id)
        {
            return Ok(());
        }
        self.unpacker.unpack(invoke).map_err(|refused| {
            self.refuse(id, Refusal::Decompression, refused.code, refused.message);
        })
    }
}
