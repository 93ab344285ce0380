//! The server side: accept loop, handshake, per-connection dispatch, cancellation, draining.
//!
//! One module per role, each depending only on those listed before it: [`options`] (settings
//! and fixed limits), [`handler`] (the seam to the layer above: [`InvokeHandler`], the answers
//! the transport builds itself), [`handshake`] (`Hello` and its token), [`runner`] (call
//! tasks, reused), [`calls`] (the calls running on a connection, matched by `message_id` for
//! `Cancel`), [`admission`] (which frames and calls a connection may send: in-flight,
//! attachment and rate limits), [`streams`] (the streams a connection serves: credit, items,
//! end), [`expansion`] (the budget for what compressed calls expand to), [`drain`] (graceful end), [`connection`] (one connection's read loop), [`accept`]
//! (the accept loop and `max_connections`).

mod accept;
mod admission;
mod calls;
mod connection;
mod drain;
mod expansion;
mod handler;
mod handshake;
mod options;
mod runner;
mod streams;

pub use accept::serve;
pub(crate) use expansion::Unpacker;

pub use handler::{error_result, Dispatch, InvokeHandler, Refusal, StreamEvent, StreamEvents};
pub use options::{
    ServerOptions, ABUSE_LIMIT, DEFAULT_CLIENT_STREAM_WINDOW, DEFAULT_STREAM_WINDOW,
    DEFAULT_STREAM_WINDOW_BYTES, MAX_CLIENT_ID, MAX_HELLO_FRAME, MAX_STREAM_WINDOW,
    PAUSED_KEEPALIVE, REFUSALS_BEFORE_PAUSE,
};
pub use runner::{dropped_as_superseded, dropped_at_drain_deadline, dropped_at_server_abort};
pub use streams::ItemSink;
