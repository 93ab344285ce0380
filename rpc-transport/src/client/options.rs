//! How a client connects.

use std::time::Duration;

/// How a client connects. Its `Debug` form shows whether a token is set, never the token.
#[derive(Clone)]
pub struct ConnectOptions {
    /// Sent in `Hello.token`; `None` sends an empty token.
    pub token: Option<String>,
    /// Sent in `Hello.client_id`.
    pub client_id: String,
    /// Largest frame accepted from the server.
    pub max_frame_length: usize,
    /// Limit on TCP connect plus handshake.
    pub connect_timeout: Duration,
    /// A `Ping` is sent every interval; the connection is closed when nothing at all (not a
    /// byte of a frame) arrived for three intervals in a row, unless the server was taking
    /// frames queued in the client meanwhile (a slow link carrying a long queue: the answers
    /// and the `Pong` come after it; a dead server stops taking once the socket buffers are
    /// full, and is then closed three intervals later). Only the client's own queue counts:
    /// once all of it sits in the system's send buffer, a server reading that slower than
    /// three intervals is still taken for dead. Zero: no heartbeat (a dead
    /// connection is then found only when a call on it fails or times out; a slow stream
    /// consumer still reports what it took every 10 s, which a server's idle timeout under
    /// 10 s would not wait for).
    pub heartbeat_interval: Duration,
    /// Bytes of calls queued on one connection and not yet written (about: parameters and
    /// entry id of each call plus 64), 4 MiB by default. Above it, as when the server stalls
    /// and stops reading, a new call waits for room, within its deadline, instead of growing
    /// the client's memory without limit; a call is always let in while the queue is below
    /// the limit, however large it is. A request stream's next item likewise waits for room
    /// (`StreamSender::ready`), whatever credit the server granted.
    pub max_unsent_bytes: usize,
    /// Whether the client offers streams in its `Hello` (true by default). A client that does
    /// not is sent no stream frame and cannot open streams.
    pub streams: bool,
    /// Items per stream the client buffers for the server before it grants more
    /// (`Hello.stream_window`): a stream whose consumer stops reading holds at most this many
    /// items, and the server's producer stops. At least 1, at most
    /// [`MAX_STREAM_WINDOW`](crate::MAX_STREAM_WINDOW), the largest a server takes (a larger
    /// one counts as that); 8192 by default
    /// ([`DEFAULT_CLIENT_STREAM_WINDOW`](crate::DEFAULT_CLIENT_STREAM_WINDOW)).
    pub stream_window: u32,
    /// Payload bytes per stream the client buffers for the server besides `stream_window`
    /// items (`Hello.stream_window_bytes`; 0: items only): a stream of large items holds at
    /// most this many bytes plus one item. Kept by servers that announce a byte window of
    /// their own; an older server is held to the items only.
    pub stream_window_bytes: u32,
    /// TLS to the server (feature `tls`); `None` connects over plain TCP. The TLS handshake
    /// counts within `connect_timeout`.
    #[cfg(feature = "tls")]
    pub tls: Option<crate::tls::ClientTls>,
}

/// This process's default client id, `rpc-client/<pid>-<8 random hex digits>`: the pid alone
/// repeats across hosts and containers (every containerised replica may be pid 1), and a
/// server's per-caller quotas are keyed by it. Drawn once, so every client of the process
/// shares it.
fn default_client_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        // std's hasher keys are drawn from the operating system's randomness.
        use std::hash::BuildHasher;
        let random = std::collections::hash_map::RandomState::new().hash_one(0u8) as u32;
        format!("rpc-client/{}-{random:08x}", std::process::id())
    })
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            token: None,
            client_id: default_client_id().to_string(),
            max_frame_length: rpc_core::DEFAULT_MAX_FRAME_LENGTH,
            connect_timeout: Duration::from_secs(3),
            heartbeat_interval: Duration::from_secs(10),
            max_unsent_bytes: 4 * 1024 * 1024,
            streams: true,
            stream_window: crate::DEFAULT_CLIENT_STREAM_WINDOW,
            stream_window_bytes: crate::DEFAULT_STREAM_WINDOW_BYTES,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ConnectOptions");
        d.field("token", &crate::Redacted(&self.token))
            .field("client_id", &self.client_id)
            .field("max_frame_length", &self.max_frame_length)
            .field("connect_timeout", &self.connect_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("max_unsent_bytes", &self.max_unsent_bytes)
            .field("streams", &self.streams)
            .field("stream_window", &self.stream_window)
            .field("stream_window_bytes", &self.stream_window_bytes);
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls);
        d.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_client_id_is_the_process_s_and_not_its_pid_alone() {
        let id = ConnectOptions::default().client_id;
        assert_eq!(id, ConnectOptions::default().client_id, "one per process");
        let rest = id
            .strip_prefix(&format!("rpc-client/{}-", std::process::id()))
            .unwrap_or_else(|| panic!("{id}"));
        assert_eq!(rest.len(), 8, "{id}");
        assert!(rest.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    }
}
