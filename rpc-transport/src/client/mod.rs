//! The client side of a connection: handshake, multiplexed calls, heartbeats.
//!
//! One module per role, each depending only on those listed before it: [`options`] says how to
//! connect, [`pending`] is the table of calls waiting for their answers, [`shared`] is what a
//! connection's handle and its tasks share, [`answer`] decodes what the server sends, [`reader`] hands answers to the waiting calls,
//! [`heartbeat`] pings the server and expires calls past their deadline, [`stream`] holds the
//! items of a stream until its consumer takes them, [`connection`] connects, shakes hands,
//! sends calls and opens streams.

mod answer;
mod connection;
mod heartbeat;
mod options;
mod pending;
mod reader;
mod shared;
mod stream;

pub use connection::Connection;
pub use options::ConnectOptions;
pub(crate) use shared::NEXT_CONNECTION_ID;
pub use stream::{ClientStream, EndToError, Opened, StreamSender};
