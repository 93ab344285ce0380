//! Who is calling: what the server learned about a client when it accepted the connection.
//!
//! Authorization is decided per call (this method, for this client), but everything it can go
//! by is known once per connection: the peer address, the client id of its `Hello`, whether it
//! passed the token check, and, with mutual TLS, the certificate it presented. So a [`Caller`]
//! is built once, when the handshake succeeds, and every call of the connection sees the same
//! one through an `Arc`: knowing who calls costs a call nothing.

use std::fmt;
use std::net::SocketAddr;

use rpc_core::{RpcError, StatusCode};

use crate::compression::Accepted;
use crate::peer::PeerAddr;

/// The identity of the client behind one connection, as established at its handshake.
///
/// Every call of a connection is handed the same `Arc<Caller>`
/// ([`InvokeHandler::handle`](crate::InvokeHandler::handle)). The client id and the peer
/// address are what the client says and where it connects from: alone they authenticate
/// nothing. What the server checked is [`token_verified`](Self::token_verified) (the shared
/// token of `ServerOptions::token`) and, with mutual TLS, the
/// [`peer_certificate`](Self::peer_certificate), which chains to the server's client CA.
///
/// ```
/// use rpc_transport::Caller;
/// let caller = Caller::new("127.0.0.1:40000".parse::<std::net::SocketAddr>().unwrap(), "billing-7")
///     .with_token_verified(true);
/// assert_eq!(caller.client_id(), "billing-7");
/// assert!(caller.token_verified());
/// assert!(caller.peer_certificate().is_none());
/// ```
#[derive(Clone)]
pub struct Caller {
    address: PeerAddr,
    peer: SocketAddr,
    client_id: String,
    token_verified: bool,
    peer_certificate: Option<Vec<u8>>,
    accept_compression: Accepted,
    /// The server's decompression, for a handler that decompresses after its own admission.
    unpacker: Option<crate::server::Unpacker>,
}

impl Caller {
    /// A caller at `peer` that said `client_id` in its `Hello`, with no token checked, no
    /// certificate presented and no compression accepted (add them with the `with_` methods).
    pub fn new(peer: impl Into<PeerAddr>, client_id: impl Into<String>) -> Self {
        let address = peer.into();
        Caller {
            peer: crate::transport::socket_addr_or_unspecified(&address),
            address,
            client_id: client_id.into(),
            token_verified: false,
            peer_certificate: None,
            accept_compression: Accepted::NONE,
            unpacker: None,
        }
    }

    /// Decompresses with the server's limits and budget (see [`Caller::unpack`]).
    pub(crate) fn with_unpacker(mut self, unpacker: crate::server::Unpacker) -> Self {
        self.unpacker = Some(unpacker);
        self
    }

    /// Decompresses the arguments of `invoke`, a call of this caller that the connection
    /// handed on compressed because its handler decompresses after its own admission
    /// ([`InvokeHandler::decompresses_itself`](crate::InvokeHandler::decompresses_itself)):
    /// at most the server's frame limit of them, taking what they gain from the server's
    /// budget for decompressed arguments until their last bytes are dropped. Uncompressed
    /// arguments stay as they are, and so does the call's `compression` (its answer follows
    /// it). Fails, and the call is not to run, with 500 when they do not decompress, 515 when
    /// the budget has not enough left, and 500 for a caller the server did not make (built
    /// with [`new`](Self::new)), which has no budget.
    pub fn unpack(&self, invoke: &mut crate::Invoke) -> Result<(), RpcError> {
        self.unpack_telling(invoke).map_err(|refused| refused.error)
    }

    /// [`unpack`](Self::unpack), telling of a refusal whether the arguments were decompressed
    /// first: arguments found corrupt, or found over the budget only once decompressed (a
    /// payload that says no size), cost the work a rate limit's token stands for; a refusal
    /// by the size a payload says cost none.
    pub fn unpack_telling(&self, invoke: &mut crate::Invoke) -> Result<(), UnpackRefusal> {
        if invoke.compression == 0 {
            return Ok(());
        }
        let Some(unpacker) = &self.unpacker else {
            return Err(UnpackRefusal {
                error: RpcError::new(
                    StatusCode::FrameworkError,
                    "this caller has no server's decompression budget: only a server's \
                     connection can decompress its calls",
                ),
                decompressed: false,
            });
        };
        unpacker.unpack(invoke).map_err(|refused| UnpackRefusal {
            error: RpcError::new(refused.code, refused.message),
            decompressed: refused.decompressed,
        })
    }

    /// The compression algorithms the caller's `Hello` listed as ones it decodes: a server
    /// compresses its answers only with one of these.
    pub fn with_accept_compression(mut self, accepted: Accepted) -> Self {
        self.accept_compression = accepted;
        self
    }

    /// The compression algorithms the caller decodes (none for a client that predates
    /// compression).
    pub fn accept_compression(&self) -> Accepted {
        self.accept_compression
    }

    /// Says whether the server required a token and this caller's matched.
    pub fn with_token_verified(mut self, verified: bool) -> Self {
        self.token_verified = verified;
        self
    }

    /// The end-entity certificate (DER) the caller presented in a mutual TLS handshake.
    pub fn with_peer_certificate(mut self, der: Option<Vec<u8>>) -> Self {
        self.peer_certificate = der;
        self
    }

    /// The address the connection comes from, as a socket address (`0.0.0.0:0` for a Unix
    /// socket peer: see [`address`](Self::address)).
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The address the connection comes from, on whichever transport.
    pub fn address(&self) -> &PeerAddr {
        &self.address
    }

    /// The client id of the caller's `Hello` (`ConnectOptions::client_id`, by default
    /// `rpc-client/<pid>-<random>`, one per process): a name the client chose, verified by nothing; trust it only on
    /// connections that passed the token check or mutual TLS.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// Whether the server required a token and the caller's `Hello` carried it. `false` when the
    /// server requires none (a connection with a wrong token never gets as far as a call).
    pub fn token_verified(&self) -> bool {
        self.token_verified
    }

    /// The end-entity certificate (DER) the caller presented in the TLS handshake, verified
    /// against the server's client CA: present only on servers that require client
    /// certificates (`ServerTls::require_client_certs`, feature `tls`). Parse it with an X.509
    /// library to read its subject or its subject alternative names.
    pub fn peer_certificate(&self) -> Option<&[u8]> {
        self.peer_certificate.as_deref()
    }
}

/// Callers are equal when they say the same of who calls (the server's decompression they
/// carry is not part of that).
impl PartialEq for Caller {
    fn eq(&self, other: &Self) -> bool {
        self.address == other.address
            && self.peer == other.peer
            && self.client_id == other.client_id
            && self.token_verified == other.token_verified
            && self.peer_certificate == other.peer_certificate
            && self.accept_compression == other.accept_compression
    }
}

impl Eq for Caller {}

impl fmt::Debug for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Caller")
            .field("peer", &self.peer)
            .field("client_id", &self.client_id)
            .field("token_verified", &self.token_verified)
            .field("accept_compression", &self.accept_compression)
            .field(
                "peer_certificate",
                &self
                    .peer_certificate
                    .as_ref()
                    .map(|c| format!("{} bytes", c.len())),
            )
            .finish()
    }
}

/// Why [`Caller::unpack_telling`] refused a call's arguments.
#[derive(Debug)]
pub struct UnpackRefusal {
    /// The call's answer: 500 (not decompressed), 515 (over the decompression budget).
    pub error: RpcError,
    /// Whether the arguments were decompressed before the refusal.
    pub decompressed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_caller_has_checked_nothing_until_told() {
        let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let bare = Caller::new(peer, "c");
        assert_eq!(
            (bare.peer(), bare.token_verified(), bare.peer_certificate()),
            (peer, false, None)
        );
        let full = bare
            .with_token_verified(true)
            .with_peer_certificate(Some(vec![0x30, 0x03]));
        assert!(full.token_verified());
        assert_eq!(full.peer_certificate(), Some(&[0x30, 0x03][..]));
        assert!(format!("{full:?}").contains("2 bytes"));
    }
}
