//! Connection-level settings of a server and the fixed limits beside them.

use std::time::Duration;

/// Connection-level settings of a server. Its `Debug` form shows whether a token is set, never
/// the token.
#[derive(Clone)]
pub struct ServerOptions {
    /// Required `Hello.token`; `None` accepts any.
    pub token: Option<String>,
    /// Sent in `HelloAck.server_id`.
    pub server_id: String,
    /// Largest frame accepted from a client.
    pub max_frame_length: usize,
    /// A connection that sends no `Hello` within this time is closed.
    pub handshake_timeout: Duration,
    /// A connection on which nothing arrived for this long is closed (0: never); a server
    /// stream without a deadline that waited this long on its client with no progress ends.
    pub idle_timeout: Duration,
    /// On shutdown, how long calls in flight may take to finish.
    pub drain_timeout: Duration,
    /// Connections held at once; one more is refused with `GoAway`.
    pub max_connections: usize,
    /// Calls one connection may have running at once; one more is answered Overflow (515)
    /// without running, so a single client cannot hold the server's memory.
    pub max_in_flight_per_connection: usize,
    /// Attachments one call may carry.
    pub max_attachments: usize,
    /// Total bytes of one call's attachment keys and values. A connection whose calls break
    /// the attachment limits more than [`ABUSE_LIMIT`] times in a row is closed.
    pub max_attachment_bytes: usize,
    /// Answers queued on one connection and not yet written, in bytes (about: payload and
    /// message of each answer plus 64). Above this, as when a client sends calls but does not
    /// read the answers, the server stops reading that connection's calls until the answers are
    /// written, so memory stays bounded and TCP pushes back on the client; and its streams
    /// produce no more items until there is room, whatever windows the client announced.
    pub max_unsent_bytes: usize,
    /// Calls one connection may start per second, with bursts of a tenth of a second's worth
    /// (at least one call). Above it the server stops reading that connection until the rate
    /// allows the next call, so TCP pushes back on the client and a client that pipelines calls
    /// as fast as it can gets no more than its share. `None` (the default): no limit.
    pub max_calls_per_second_per_connection: Option<u32>,
    /// Bytes the read buffers of frames larger than a connection's own 64 KiB buffer may hold
    /// at once, summed over every connection of the server (never less than one frame of
    /// `max_frame_length`). A frame that would need more than is left waits, and its
    /// connection is not read meanwhile, so TCP pushes back on its peer; it is read once other
    /// frames are complete. Frames before the handshake are limited to [`MAX_HELLO_FRAME`]
    /// bytes instead.
    pub max_read_buffer_bytes: usize,
    /// Bytes that running calls' compressed arguments may hold beyond their size on the wire
    /// (what decompression adds), summed over every connection of the server (never less than
    /// one frame of `max_frame_length`). A compressed call that would need more than is left
    /// is answered Overflow (515) without running. Uncompressed arguments take nothing from it:
    /// the read budget and the in-flight limit bound them.
    pub max_decompressed_bytes: usize,
    /// Whether a call's handler is first polled on the connection's reader, before a task is
    /// spawned for it: a handler that answers in that poll then costs no task. Only for
    /// servers whose handlers never block nor compute for long before their first `.await`:
    /// while one does, the reader is stalled, and with it every other call, `Cancel` and `Ping`
    /// on that connection. `false` (the default): every call runs in its own task.
    pub inline_first_poll: bool,
    /// Items per stream the server buffers for a client's request stream before it grants
    /// more (`HelloAck.stream_window`): what a client may send ahead on one stream. At least 1.
    pub stream_window: u32,
    /// Payload bytes per stream the server buffers for a client's request stream besides
    /// `stream_window` items (`HelloAck.stream_window_bytes`; 0: items only, both ways: a
    /// server announcing no byte window does not hold its own items to the client's either).
    pub stream_window_bytes: u32,
    /// TLS on every connection (feature `tls`); `None` serves plain TCP. The TLS handshake
    /// counts within `handshake_timeout`.
    #[cfg(feature = "tls")]
    pub tls: Option<crate::tls::ServerTls>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            token: None,
            server_id: format!("rpc-server/{}", std::process::id()),
            max_frame_length: rpc_core::DEFAULT_MAX_FRAME_LENGTH,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(10),
            max_connections: 10_000,
            max_in_flight_per_connection: 1024,
            max_attachments: 64,
            max_attachment_bytes: 16 * 1024,
            max_unsent_bytes: 1024 * 1024,
            max_calls_per_second_per_connection: None,
            max_read_buffer_bytes: 64 * 1024 * 1024,
            max_decompressed_bytes: 256 * 1024 * 1024,
            inline_first_poll: false,
            stream_window: DEFAULT_STREAM_WINDOW,
            stream_window_bytes: DEFAULT_STREAM_WINDOW_BYTES,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl std::fmt::Debug for ServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ServerOptions");
        d.field("token", &crate::Redacted(&self.token))
            .field("server_id", &self.server_id)
            .field("max_frame_length", &self.max_frame_length)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("drain_timeout", &self.drain_timeout)
            .field("max_connections", &self.max_connections)
            .field(
                "max_in_flight_per_connection",
                &self.max_in_flight_per_connection,
            )
            .field("max_attachments", &self.max_attachments)
            .field("max_attachment_bytes", &self.max_attachment_bytes)
            .field("max_unsent_bytes", &self.max_unsent_bytes)
            .field(
                "max_calls_per_second_per_connection",
                &self.max_calls_per_second_per_connection,
            )
            .field("max_read_buffer_bytes", &self.max_read_buffer_bytes)
            .field("max_decompressed_bytes", &self.max_decompressed_bytes)
            .field("inline_first_poll", &self.inline_first_poll)
            .field("stream_window", &self.stream_window)
            .field("stream_window_bytes", &self.stream_window_bytes);
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls);
        d.finish()
    }
}

/// Items per stream a server buffers of a caller's request stream before granting more,
/// unless configured otherwise (`ServerOptions::stream_window`). A server holds the request
/// streams of every caller at once, so its window stays small; the byte window below bounds
/// the memory of large items.
pub const DEFAULT_STREAM_WINDOW: u32 = 512;

/// Items per stream a client buffers of the server's items before granting more, unless
/// configured otherwise (`ConnectOptions::stream_window`): the default byte window in items
/// of 32 bytes, so the byte window, not the count, bounds a stream of small items.
///
/// Credit is granted back at half the window, and the producer waits while none is left: with
/// 512 items a single stream of 32-byte items was held up by the round trip of its credit
/// (4.6 M items/s in `scripts/stream-bench.sh`, against 9–11 M with 8192). A client holds only
/// its own consumers' streams, so the larger window costs little.
pub const DEFAULT_CLIENT_STREAM_WINDOW: u32 = DEFAULT_STREAM_WINDOW_BYTES / 32;

/// Payload bytes per stream a side buffers for its peer besides the window of items, unless
/// configured otherwise (`ServerOptions::stream_window_bytes`,
/// `ConnectOptions::stream_window_bytes`): 256 KiB, 64 items of 4 KiB.
pub const DEFAULT_STREAM_WINDOW_BYTES: u32 = 256 * 1024;

/// Largest frame a server reads before it has accepted the client's `Hello` (8 KiB): a `Hello`
/// is a version, a token and a client id, and a peer that has not authenticated gets no more
/// of the server's memory than that. A longer frame gets `GoAway` at its length prefix.
pub const MAX_HELLO_FRAME: usize = 8 * 1024;

/// Longest `Hello.client_id` a server accepts, in bytes: the id keys per-caller state (a
/// caller's rate-limit bucket per entry), so a client reconnecting with ever new ids of
/// kilobytes each would otherwise make that state cost far more than its count. A longer one
/// gets `GoAway`.
pub const MAX_CLIENT_ID: usize = 256;

/// Largest stream window (`Hello.stream_window`, items) a server takes from a client: the
/// server keeps a record of the items it sent on each stream until the client grants them
/// back, 8 bytes per item at worst (items of varying sizes), so a client announcing an
/// endless window and never granting would make one stream cost that much per item sent. A
/// larger window gets `GoAway` (capping it instead would stall a client waiting to have taken
/// half its window before it grants); `ClientBuilder::stream_window` keeps within it.
pub const MAX_STREAM_WINDOW: u32 = 1 << 16;

/// Calls breaking the attachment limits that one connection may send in a row (with no call
/// within them in between) before it is closed: a client that keeps doing it is broken or
/// hostile, and each such call costs the server a full decode. Counted in a row, so that a
/// long-lived connection multiplexing many callers is not closed, taking their calls with it,
/// for a few oversized calls over its life.
pub const ABUSE_LIMIT: u32 = 8;

/// Calls refused in a row at a connection's in-flight limit after which the server stops
/// reading that connection until one of its calls finishes: the first are answered Overflow at
/// once, the rest wait in TCP instead of costing the server a refusal each. While it does not
/// read, the server sends a `Ping` of its own every [`PAUSED_KEEPALIVE`], and reads again with
/// each (up to this many refusals more), so the client's `Cancel`s and `Ping`s are read.
pub const REFUSALS_BEFORE_PAUSE: u32 = 16;

/// How often a server that stopped reading a connection at its in-flight limit sends that
/// client a `Ping` (1 s), and reads it again. The client's `Ping`s wait unread in between, and a client closes a
/// connection on which nothing arrived for three of its heartbeat intervals (10 s each by
/// default): without these, calls that run longer than that (long polls) would fill the
/// limit, and the client would close the connection under them. Clients whose heartbeat
/// interval is above a third of this are kept.
pub const PAUSED_KEEPALIVE: Duration = Duration::from_secs(1);

/// How often a server that holds a connection's large frame (waiting for a share of the read
/// budget, or begun and not finished) checks whether to send that client a `Ping` (one each
/// time it still holds one): the server answers nothing meanwhile, the client's `Ping`s wait
/// behind the frame, and a client would take the connection for dead after three of its
/// heartbeat intervals. Clients whose heartbeat interval is above a third of this are kept.
pub(crate) const HELD_FRAME_KEEPALIVE: Duration = Duration::from_secs(3);
