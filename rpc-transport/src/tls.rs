//! TLS for the connections (feature `tls`): rustls with the `ring` provider, TLS 1.2 and 1.3.
//!
//! A server presents a certificate chain ([`ServerTls`]) and may require client certificates
//! signed by a CA it names (mutual TLS). A client ([`ClientTls`]) always verifies the server's
//! certificate against the roots it is given, and the name it checks defaults to the host part
//! of the address it connects to (`127.0.0.1`, `[::1]` or a DNS name); there is no switch that
//! turns verification off. The TLS handshake counts within the server's `handshake_timeout` and
//! the client's `connect_timeout`; after it, the same frames flow as on plain TCP.
//!
//! ```no_run
//! use rpc_transport::tls::{ClientTls, ServerTls};
//! use rpc_transport::{ConnectOptions, ServerOptions};
//! # fn f() -> Result<(), rpc_core::RpcError> {
//! // Server: its chain and key; with mutual TLS, the CA that signs client certificates.
//! let server_tls = ServerTls::from_pem_files("server.pem", "server.key")?
//!     .require_client_certs_file("clients-ca.pem")?;
//! let server = ServerOptions { tls: Some(server_tls), ..ServerOptions::default() };
//!
//! // Client: the CA that signed the server's certificate, and its own certificate for mTLS.
//! let client_tls = ClientTls::from_pem_file("server-ca.pem")?
//!     .identity_files("client.pem", "client.key")?
//!     .server_name("rpc.internal")?; // default: the host part of the address
//! let connect = ConnectOptions { tls: Some(client_tls), ..ConnectOptions::default() };
//! # Ok(()) }
//! ```

use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rpc_core::{RpcError, StatusCode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use crate::peer::PeerAddr;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::server::danger::ClientCertVerifier;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, AlertDescription, ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{client, server, TlsAcceptor, TlsConnector};

/// The server side's TLS: the certificate chain it presents and, for mutual TLS, the CA whose
/// signature a client certificate must carry.
#[derive(Clone)]
pub struct ServerTls {
    certs: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    client_cas: usize,
    acceptor: TlsAcceptor,
}

impl ServerTls {
    /// Presents `cert_chain` (PEM: the server's certificate first, then any intermediates) with
    /// its private key `key` (PEM: PKCS#8, PKCS#1 or SEC1). Clients need no certificate.
    ///
    /// Errors ([`StatusCode::FrameworkError`]): no certificate or no key in the PEM, or a key
    /// that does not match the certificate.
    pub fn from_pem(cert_chain: &[u8], key: &[u8]) -> Result<ServerTls, RpcError> {
        let certs = parse_certs(cert_chain, "the server's certificate chain")?;
        let key = parse_key(key, "the server's private key")?;
        let key = Arc::new(key);
        let acceptor = build_acceptor(&certs, &key, WebPkiClientVerifier::no_client_auth())?;
        Ok(ServerTls {
            certs,
            key,
            client_cas: 0,
            acceptor,
        })
    }

    /// Like [`from_pem`](Self::from_pem), reading the two PEM files.
    pub fn from_pem_files(
        cert_chain: impl AsRef<Path>,
        key: impl AsRef<Path>,
    ) -> Result<ServerTls, RpcError> {
        Self::from_pem(&read(cert_chain.as_ref())?, &read(key.as_ref())?)
    }

    /// Mutual TLS: requires every client to present a certificate signed by one of the CAs in
    /// `ca` (PEM). A client without one, or with one from another CA, is refused during the
    /// TLS handshake; the server logs it and serves the others.
    pub fn require_client_certs(mut self, ca: &[u8]) -> Result<ServerTls, RpcError> {
        let roots = root_store(ca, "the client CA")?;
        self.client_cas = roots.len();
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| config_error(format!("the client CA: {e}")))?;
        self.acceptor = build_acceptor(&self.certs, &self.key, verifier)?;
        Ok(self)
    }

    /// Like [`require_client_certs`](Self::require_client_certs), reading the PEM file.
    pub fn require_client_certs_file(self, ca: impl AsRef<Path>) -> Result<ServerTls, RpcError> {
        let ca = read(ca.as_ref())?;
        self.require_client_certs(&ca)
    }

    /// Whether clients must present a certificate (mutual TLS).
    pub fn requires_client_certs(&self) -> bool {
        self.client_cas > 0
    }

    /// Runs the server side of the TLS handshake on an accepted socket, until `deadline`
    /// (`timeout` after the accept). A refused client is logged, with why, and `None` returned.
    pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
        peer: &PeerAddr,
        deadline: Instant,
        timeout: Duration,
    ) -> Option<server::TlsStream<S>> {
        let handshake = self.acceptor.accept(stream).into_fallible();
        let (reason, socket) = match tokio::time::timeout_at(deadline, handshake).await {
            Ok(Ok(stream)) => return Some(stream),
            Ok(Err((e, socket))) => (refusal_reason(&e), Some(socket)),
            Err(_) => (
                format!("no TLS handshake within {} ms", timeout.as_millis()),
                None,
            ),
        };
        tracing::info!(%peer, %reason, "TLS handshake failed");
        if let Some(socket) = socket {
            linger(socket, deadline).await;
        }
        None
    }
}

/// The end-entity certificate (DER) a client presented in the handshake of `stream`, if any:
/// what `Caller::peer_certificate` gives. Read once per connection.
pub(crate) fn peer_certificate<S>(stream: &server::TlsStream<S>) -> Option<Vec<u8>> {
    let (_, session) = stream.get_ref();
    session
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|leaf| leaf.as_ref().to_vec())
}

/// After a refused handshake, rustls has queued an alert saying why. Closing a socket with
/// unread bytes (the client's next flight, its first frame) resets the connection, which can
/// destroy the alert before the client reads it: read and drop what the client still sends
/// until it closes, for a short while.
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(mut socket: S, deadline: Instant) {
    let until = deadline.min(Instant::now() + LINGER);
    let _ = tokio::time::timeout_at(until, async {
        let _ = socket.shutdown().await;
        let mut buf = [0u8; 1024];
        while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// The longest a refused TLS client is given to close its side.
const LINGER: Duration = Duration::from_millis(500);

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("certificates", &self.certs.len())
            .field("client_cas", &self.client_cas)
            .finish_non_exhaustive()
    }
}

/// The client side's TLS: the roots that the server's certificate must chain to, optionally a
/// client certificate (mutual TLS), and the name the server's certificate must carry.
#[derive(Clone)]
pub struct ClientTls {
    roots: Arc<RootCertStore>,
    identity: Option<(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
    server_name: Option<ServerName<'static>>,
    connector: TlsConnector,
}

impl ClientTls {
    /// Trusts the CA certificates in `roots` (PEM) and no others: a server must present a
    /// certificate that chains to one of them and names the host connected to.
    pub fn from_pem(roots: &[u8]) -> Result<ClientTls, RpcError> {
        let roots = Arc::new(root_store(roots, "the trusted roots")?);
        let connector = build_connector(&roots, None)?;
        Ok(ClientTls {
            roots,
            identity: None,
            server_name: None,
            connector,
        })
    }

    /// Like [`from_pem`](Self::from_pem), reading the PEM file.
    pub fn from_pem_file(roots: impl AsRef<Path>) -> Result<ClientTls, RpcError> {
        Self::from_pem(&read(roots.as_ref())?)
    }

    /// Mutual TLS: presents `cert_chain` (PEM, the client's certificate first) with its
    /// private key `key` (PEM) to servers that ask for a client certificate.
    pub fn identity(mut self, cert_chain: &[u8], key: &[u8]) -> Result<ClientTls, RpcError> {
        let certs = parse_certs(cert_chain, "the client's certificate chain")?;
        let key = parse_key(key, "the client's private key")?;
        let identity = (certs, Arc::new(key));
        self.connector = build_connector(&self.roots, Some(&identity))?;
        self.identity = Some(identity);
        Ok(self)
    }

    /// Like [`identity`](Self::identity), reading the two PEM files.
    pub fn identity_files(
        self,
        cert_chain: impl AsRef<Path>,
        key: impl AsRef<Path>,
    ) -> Result<ClientTls, RpcError> {
        let (cert_chain, key) = (read(cert_chain.as_ref())?, read(key.as_ref())?);
        self.identity(&cert_chain, &key)
    }

    /// The name the server's certificate must carry (a DNS name or an IP address), for every
    /// server this client connects to. By default it is the host part of each address.
    pub fn server_name(mut self, name: impl Into<String>) -> Result<ClientTls, RpcError> {
        let name = name.into();
        self.server_name = Some(
            ServerName::try_from(name.clone())
                .map_err(|e| config_error(format!("TLS server name '{name}': {e}")))?,
        );
        Ok(self)
    }

    /// Runs the client side of the TLS handshake with the server at `addr`.
    pub(crate) async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        addr: &str,
        stream: S,
    ) -> Result<client::TlsStream<S>, RpcError> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None if addr.starts_with(crate::peer::UNIX_SCHEME) => {
                return Err(RpcError::new(
                    StatusCode::FrameworkError,
                    format!(
                        "{addr}: a Unix socket address names no host for the server's \
                         certificate; set the name it carries with ClientTls::server_name"
                    ),
                ))
            }
            None => {
                let host = host_of(addr);
                ServerName::try_from(host.to_string()).map_err(|e| {
                    RpcError::new(
                        StatusCode::FrameworkError,
                        format!(
                            "{addr}: '{host}' is not a valid TLS server name ({e}); set one \
                             with ClientTls::server_name"
                        ),
                    )
                })?
            }
        };
        self.connector
            .connect(name, stream)
            .await
            .map_err(|e| handshake_error(addr, &e).unwrap_or_else(|| tls_failed(addr, &e)))
    }
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("roots", &self.roots.len())
            .field("client_certificate", &self.identity.is_some())
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

fn tls_failed(addr: &str, e: &std::io::Error) -> RpcError {
    RpcError::new(
        StatusCode::CommunicationError,
        format!("{addr}: TLS handshake failed: {e}"),
    )
}

/// The error for a TLS failure a client saw, during the TLS handshake or right after it (with
/// TLS 1.3 the server judges the client's certificate after the client's side of the handshake
/// is done, so its refusal arrives as the first read). `None` when `e` is no TLS error.
pub(crate) fn handshake_error(addr: &str, e: &std::io::Error) -> Option<RpcError> {
    let tls = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    Some(match tls {
        rustls::Error::InvalidCertificate(why) => RpcError::new(
            StatusCode::CommunicationError,
            format!(
                "{addr}: TLS handshake failed: the server's certificate is not trusted ({why}); \
                 the client must trust the CA that signed it, for the name connected to"
            ),
        ),
        rustls::Error::AlertReceived(
            alert @ (AlertDescription::CertificateRequired
            | AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::AccessDenied),
        ) => {
            let what_to_do = match alert {
                AlertDescription::CertificateRequired => {
                    "it requires a client certificate signed by a CA it trusts \
                     (ClientTls::identity)"
                }
                AlertDescription::UnsupportedCertificate => {
                    "it does not take this certificate for client authentication: a client \
                     certificate needs the clientAuth extended key usage (a server's \
                     certificate will not do)"
                }
                AlertDescription::CertificateExpired => {
                    "the client certificate has expired or is not valid yet: renew it"
                }
                AlertDescription::CertificateRevoked => {
                    "the client certificate was revoked: present another"
                }
                _ => {
                    "it does not accept the client certificate: present one signed by a CA \
                     it trusts (ClientTls::identity)"
                }
            };
            RpcError::new(
                StatusCode::RpcUnAuthentication,
                format!("{addr} refused the TLS connection ({alert:?}): {what_to_do}"),
            )
        }
        rustls::Error::InvalidMessage(_) => RpcError::new(
            StatusCode::CommunicationError,
            format!("{addr}: TLS handshake failed: the server did not answer with TLS ({tls}); is it serving plain TCP?"),
        ),
        other => RpcError::new(
            StatusCode::CommunicationError,
            format!("{addr}: TLS failed: {other}"),
        ),
    })
}

/// Why the server refused a client's TLS handshake, for the log.
fn refusal_reason(e: &std::io::Error) -> String {
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::NoCertificatesPresented) => {
            "the client presented no certificate; this server requires one (mutual TLS)".into()
        }
        Some(rustls::Error::InvalidCertificate(why)) => {
            format!("the client's certificate is not trusted: {why}")
        }
        Some(rustls::Error::AlertReceived(alert)) => format!(
            "the client ended the TLS handshake ({alert:?}); if it does not trust the server's \
             certificate, give it the CA that signed it, and check that the name it connects to \
             is one the certificate names (ClientTls::server_name)"
        ),
        Some(rustls::Error::InvalidMessage(why)) => {
            format!("not a TLS client hello ({why:?}); is the client connecting without TLS?")
        }
        Some(other) => other.to_string(),
        None => format!("i/o error: {e}"),
    }
}

/// The host part of `host:port`, `[v6]:port` or a bare host.
fn host_of(addr: &str) -> &str {
    let host = match addr.rsplit_once(':') {
        Some((h, port)) if !h.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => addr,
    };
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

fn build_connector(
    roots: &Arc<RootCertStore>,
    identity: Option<&(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
) -> Result<TlsConnector, RpcError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error(format!("TLS versions: {e}")))?
        .with_root_certificates(roots.clone());
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((certs, key)) => builder
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(|e| identity_error("client", e))?,
    };
    Ok(TlsConnector::from(Arc::new(config)))
}

fn build_acceptor(
    certs: &[CertificateDer<'static>],
    key: &PrivateKeyDer<'static>,
    verifier: Arc<dyn ClientCertVerifier>,
) -> Result<TlsAcceptor, RpcError> {
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error(format!("TLS versions: {e}")))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs.to_vec(), key.clone_key())
        .map_err(|e| identity_error("server", e))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The ring provider, explicitly: it does not depend on which rustls providers other crates in
/// the build enable (with two, rustls cannot choose a process default).
fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

fn parse_certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, RpcError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| config_error(format!("{what}: {e}")))?;
    if certs.is_empty() {
        return Err(config_error(format!(
            "{what}: no certificate found (expected PEM \"-----BEGIN CERTIFICATE-----\")"
        )));
    }
    Ok(certs)
}

fn parse_key(pem: &[u8], what: &str) -> Result<PrivateKeyDer<'static>, RpcError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        pem::Error::NoItemsFound => config_error(format!(
            "{what}: no private key found (expected PEM \"-----BEGIN PRIVATE KEY-----\", \
             \"-----BEGIN RSA PRIVATE KEY-----\" or \"-----BEGIN EC PRIVATE KEY-----\")"
        )),
        other => config_error(format!("{what}: {other}")),
    })
}

fn root_store(pem: &[u8], what: &str) -> Result<RootCertStore, RpcError> {
    let mut roots = RootCertStore::empty();
    for cert in parse_certs(pem, what)? {
        roots
            .add(cert)
            .map_err(|e| config_error(format!("{what}: {e}")))?;
    }
    Ok(roots)
}

fn identity_error(side: &str, e: rustls::Error) -> RpcError {
    match e {
        rustls::Error::InconsistentKeys(_) => config_error(format!(
            "the {side}'s private key does not match its certificate (the first in the chain)"
        )),
        other => config_error(format!("the {side}'s certificate chain and key: {other}")),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, RpcError> {
    std::fs::read(path).map_err(|e| config_error(format!("cannot read {}: {e}", path.display())))
}

fn config_error(what: String) -> RpcError {
    RpcError::new(
        StatusCode::FrameworkError,
        format!("TLS configuration: {what}"),
    )
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn the_default_server_name_is_the_host_part_of_the_address() {
        assert_eq!(host_of("127.0.0.1:9001"), "127.0.0.1");
        assert_eq!(host_of("[::1]:9001"), "::1");
        assert_eq!(host_of("rpc.internal:443"), "rpc.internal");
        assert_eq!(host_of("rpc.internal"), "rpc.internal");
    }
}
