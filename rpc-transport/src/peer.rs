//! The address at the other end of a connection, whatever the transport.
//!
//! Logs, refusals and the layers above need to say who a peer is; a TCP peer has a socket
//! address, a Unix domain socket peer a path or, usually for the accepted end, none.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

/// The prefix of a Unix domain socket address: `unix:/run/app.sock`.
pub const UNIX_SCHEME: &str = "unix:";

/// The address at the other end of a connection.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerAddr {
    /// A TCP peer.
    Tcp(SocketAddr),
    /// A Unix domain socket peer: its path, or `None` for an unnamed socket (what a client's
    /// end usually is).
    Unix(Option<PathBuf>),
}

impl PeerAddr {
    /// The socket address of a TCP peer.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            PeerAddr::Tcp(a) => Some(*a),
            PeerAddr::Unix(_) => None,
        }
    }
}

impl From<SocketAddr> for PeerAddr {
    fn from(a: SocketAddr) -> Self {
        PeerAddr::Tcp(a)
    }
}

impl fmt::Display for PeerAddr {
    /// `127.0.0.1:9001`, `unix:/run/app.sock`, or `unix:(unnamed)`: the first two as they are
    /// dialed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddr::Tcp(a) => a.fmt(f),
            PeerAddr::Unix(Some(p)) => write!(f, "{}{}", UNIX_SCHEME, p.display()),
            PeerAddr::Unix(None) => write!(f, "{}(unnamed)", UNIX_SCHEME),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_display_as_they_are_dialed() {
        let tcp = PeerAddr::from(SocketAddr::from(([127, 0, 0, 1], 9001)));
        assert_eq!(tcp.to_string(), "127.0.0.1:9001");
        assert_eq!(
            PeerAddr::Unix(Some("/run/app.sock".into())).to_string(),
            "unix:/run/app.sock"
        );
        assert_eq!(PeerAddr::Unix(None).to_string(), "unix:(unnamed)");
    }
}
