//! The transport seam: how bytes get between a client and a server.
//!
//! Frames, handshakes, calls and limits do not care what carries their bytes, so dialing and
//! listening go through three small traits: a [`Dialer`] connects to an address and a
//! [`Listener`] accepts connections, each yielding a [`Stream`] and the [`PeerAddr`] at its
//! other end; a stream splits into the reader and the writer the connection's tasks own. TLS
//! wraps any stream. Everything above is generic over the stream type, so each transport is
//! compiled in and costs nothing per call (the split and the peer address are per connection).
//!
//! Two transports: TCP (`host:port`) and Unix domain sockets (`unix:/path/to.sock`), chosen
//! by the address, so that every address a registry publishes or a user writes works wherever
//! an address is taken. A new transport implements the three traits and adds its scheme to
//! [`Address`].

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use crate::peer::{PeerAddr, UNIX_SCHEME};

/// An address parsed by its scheme.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address<'a> {
    /// `host:port`, resolved when dialed or bound.
    Tcp(&'a str),
    /// `unix:<path>`: a Unix domain socket at `path`.
    Unix(&'a Path),
}

impl<'a> Address<'a> {
    /// Reads `addr`: `unix:<path>` names a Unix domain socket, anything else is TCP.
    pub fn parse(addr: &'a str) -> Address<'a> {
        match addr.strip_prefix(UNIX_SCHEME) {
            Some(path) => Address::Unix(Path::new(path)),
            None => Address::Tcp(addr),
        }
    }
}

/// A connected byte stream that splits into a reader and a writer.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + Sync + 'static {
    /// The reading half.
    type Reader: AsyncRead + Unpin + Send + Sync + 'static;
    /// The writing half.
    type Writer: AsyncWrite + Abortive + Unpin + Send + Sync + 'static;

    /// Splits the stream; a socket splits in place, without a lock between the halves.
    fn into_split(self) -> (Self::Reader, Self::Writer);
}

/// How a writing half ends its connection when frames are left unwritten. An orderly close
/// after whole frames reads to the peer as "that was everything": a client then takes the
/// calls still unanswered after a drain's `GoAway` for calls the server never read, and sends
/// them elsewhere. A reset leaves no such doubt: the connection broke.
pub trait Abortive {
    /// Makes the socket's close a reset (TCP: `SO_LINGER` 0). Not enough by itself where
    /// dropping the half shuts its side down in order first (TCP's: the peer reads that end of
    /// stream before the reset): [`reset`](Self::reset) lets go of it without that. The
    /// default does nothing: a transport that cannot (a Unix socket, an in-memory pipe, TLS
    /// over a split stream, whose missing `close_notify` the peer reads as an error anyway)
    /// closes as it would.
    fn reset_on_close(&self) {}

    /// Makes the socket's close orderly again, undoing
    /// [`reset_on_close`](Self::reset_on_close) (TCP: `SO_LINGER` off): before the orderly
    /// close of a connection whose every frame was written. The default does nothing.
    fn close_in_order(&self) {}

    /// Lets go of the writing half so that the connection ends with a reset: what
    /// [`reset_on_close`](Self::reset_on_close) sets up, then the half dropped. A transport
    /// whose half shuts its side down in order when dropped (TCP's, whose end of stream would
    /// reach the peer before the reset and read as the end) lets go without that.
    fn reset(self)
    where
        Self: Sized,
    {
        self.reset_on_close();
    }
}

impl Abortive for tokio::net::tcp::OwnedWriteHalf {
    fn reset_on_close(&self) {
        // Best effort: a socket that refuses closes in order.
        let _ = self.as_ref().set_zero_linger();
    }

    fn close_in_order(&self) {
        // Deprecated for the thread a non-zero linger blocks on drop; turning it off blocks
        // nothing. Best effort: a socket that refuses closes with a reset, as a crash would.
        #[allow(deprecated)]
        let _ = self.as_ref().set_linger(None);
    }

    fn reset(self) {
        self.reset_on_close();
        // The socket closes with its read half, then: by a reset.
        self.forget();
    }
}

impl<T> Abortive for tokio::io::WriteHalf<T> {}

impl Abortive for tokio::io::DuplexStream {}

/// Connects to addresses of one transport.
pub trait Dialer: Send + Sync + 'static {
    /// The connected stream.
    type Stream: Stream;

    /// Connects to `addr` (as written, scheme included).
    fn dial(&self, addr: &str)
        -> impl Future<Output = io::Result<(Self::Stream, PeerAddr)>> + Send;
}

/// Accepts connections of one transport.
pub trait Listener: Send + 'static {
    /// The accepted stream.
    type Stream: Stream;

    /// The next connection and its peer's address.
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, PeerAddr)>> + Send;

    /// The address this listener is bound to.
    fn local_addr(&self) -> io::Result<PeerAddr>;
}

impl Stream for TcpStream {
    type Reader = tokio::net::tcp::OwnedReadHalf;
    type Writer = tokio::net::tcp::OwnedWriteHalf;

    fn into_split(self) -> (Self::Reader, Self::Writer) {
        TcpStream::into_split(self)
    }
}

/// Dials TCP, with `TCP_NODELAY` on (frames are written in batches already).
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpDialer;

impl Dialer for TcpDialer {
    type Stream = TcpStream;

    async fn dial(&self, addr: &str) -> io::Result<(TcpStream, PeerAddr)> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let peer = stream.peer_addr()?;
        Ok((stream, PeerAddr::Tcp(peer)))
    }
}

/// TCP keepalive of an accepted socket: probes after 30 s without traffic, every 10 s, and
/// the connection fails after 3 unanswered. A client that vanished (power lost, its NAT
/// mapping gone) while a call or a stream was open sends nothing and reads nothing, so
/// without it the connection, its task and the calls' slots would be held for ever (the idle
/// timer runs only while nothing is in flight); with it they go within about a minute.
pub const SERVER_KEEPALIVE: (Duration, Duration, u32) =
    (Duration::from_secs(30), Duration::from_secs(10), 3);

impl Listener for TcpListener {
    type Stream = TcpStream;

    async fn accept(&self) -> io::Result<(TcpStream, PeerAddr)> {
        let (stream, peer) = TcpListener::accept(self).await?;
        // Best effort: a socket that refuses either still works, with more latency or
        // without the dead-peer detection.
        let _ = stream.set_nodelay(true);
        let (time, interval, retries) = SERVER_KEEPALIVE;
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(time)
            .with_interval(interval)
            .with_retries(retries);
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        Ok((stream, PeerAddr::Tcp(peer)))
    }

    fn local_addr(&self) -> io::Result<PeerAddr> {
        TcpListener::local_addr(self).map(PeerAddr::Tcp)
    }
}

#[cfg(unix)]
pub use unix::{UnixDialer, UnixListener};

#[cfg(unix)]
mod unix {
    use super::*;

    impl Abortive for tokio::net::unix::OwnedWriteHalf {}

    impl Stream for tokio::net::UnixStream {
        type Reader = tokio::net::unix::OwnedReadHalf;
        type Writer = tokio::net::unix::OwnedWriteHalf;

        fn into_split(self) -> (Self::Reader, Self::Writer) {
            tokio::net::UnixStream::into_split(self)
        }
    }

    /// Dials Unix domain sockets: `unix:/path/to.sock`.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct UnixDialer;

    impl Dialer for UnixDialer {
        type Stream = tokio::net::UnixStream;

        async fn dial(&self, addr: &str) -> io::Result<(Self::Stream, PeerAddr)> {
            let path = match Address::parse(addr) {
                Address::Unix(path) => path,
                Address::Tcp(_) => Path::new(addr),
            };
            let stream = tokio::net::UnixStream::connect(path).await?;
            Ok((stream, PeerAddr::Unix(Some(path.to_path_buf()))))
        }
    }

    /// A listening Unix domain socket. The socket file is removed when the listener is
    /// dropped (when the server stops), so the path can be bound again.
    #[derive(Debug)]
    pub struct UnixListener {
        inner: tokio::net::UnixListener,
        path: PathBuf,
    }

    impl UnixListener {
        /// Binds `path`. Fails if a file exists there: a running server may own it, so it is
        /// never removed here.
        pub fn bind(path: impl AsRef<Path>) -> io::Result<UnixListener> {
            let path = path.as_ref();
            let inner = tokio::net::UnixListener::bind(path)?;
            Ok(UnixListener {
                inner,
                path: path.to_path_buf(),
            })
        }

        /// The path bound.
        pub fn path(&self) -> &Path {
            &self.path
        }
    }

    impl Drop for UnixListener {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    impl Listener for UnixListener {
        type Stream = tokio::net::UnixStream;

        async fn accept(&self) -> io::Result<(Self::Stream, PeerAddr)> {
            let (stream, peer) = self.inner.accept().await?;
            Ok((
                stream,
                PeerAddr::Unix(peer.as_pathname().map(Path::to_path_buf)),
            ))
        }

        fn local_addr(&self) -> io::Result<PeerAddr> {
            Ok(PeerAddr::Unix(Some(self.path.clone())))
        }
    }
}

/// What dialing an address of an unknown kind says; also for `unix:` where the platform has
/// no Unix domain sockets.
#[cfg(not(unix))]
pub(crate) fn no_unix_sockets(addr: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("{addr}: Unix domain sockets are not available on this platform; use host:port"),
    )
}

/// The socket address of a TCP peer; for other transports the unspecified address, which is
/// what layers that still take a `SocketAddr` are given for them.
pub(crate) fn socket_addr_or_unspecified(peer: &PeerAddr) -> SocketAddr {
    match peer {
        PeerAddr::Tcp(a) => *a,
        PeerAddr::Unix(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_chooses_the_transport() {
        assert_eq!(Address::parse("127.0.0.1:80"), Address::Tcp("127.0.0.1:80"));
        assert_eq!(Address::parse("[::1]:80"), Address::Tcp("[::1]:80"));
        assert_eq!(
            Address::parse("unix:/run/a.sock"),
            Address::Unix(Path::new("/run/a.sock"))
        );
        assert_eq!(
            Address::parse("unix:rel.sock"),
            Address::Unix(Path::new("rel.sock"))
        );
    }

    /// An accepted TCP socket probes a silent peer: keepalive on, with the server's timings.
    #[tokio::test]
    async fn an_accepted_socket_has_keepalive_on() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = TcpListener::local_addr(&listener).expect("address");
        let _client = TcpStream::connect(addr).await.expect("connect");
        let (accepted, _) = Listener::accept(&listener).await.expect("accept");
        let socket = socket2::SockRef::from(&accepted);
        assert!(socket.keepalive().expect("SO_KEEPALIVE"));
        let (time, interval, retries) = SERVER_KEEPALIVE;
        assert_eq!(socket.tcp_keepalive_time().expect("TCP_KEEPIDLE"), time);
        assert_eq!(
            socket.tcp_keepalive_interval().expect("TCP_KEEPINTVL"),
            interval
        );
        assert_eq!(
            socket.tcp_keepalive_retries().expect("TCP_KEEPCNT"),
            retries
        );
    }
}
