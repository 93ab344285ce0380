//! TLS (feature `tls`) over real TCP: calls through a generated proxy, server certificate
//! verification, mutual TLS, plain clients meeting TLS servers and the token handshake on top.
//! Every certificate is generated here, at test time, with rcgen.

use crate::common;

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::certs::{Ca, Identity};
use common::{no_retry, within, LIMIT};
use rpc::crates::transport::{ConnectOptions, Connection};
use rpc::tls::{ClientTls, ServerTls};
use rpc::{Client, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode};
use tokio::sync::mpsc;

#[rpc::service(name = "t.Tls")]
trait Vault {
    async fn secret(&self, who: String) -> Result<String, RpcError>;
}

struct Safe {
    calls: AtomicUsize,
}

impl Vault for Safe {
    async fn secret(&self, who: String) -> Result<String, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(format!("gold for {who}"))
    }
}

fn server_tls(ca: &Ca) -> ServerTls {
    let id = ca.server();
    ServerTls::from_pem(id.cert.as_bytes(), id.key.as_bytes()).expect("server TLS config")
}

fn trusting(ca: &Ca) -> ClientTls {
    ClientTls::from_pem(ca.pem.as_bytes()).expect("client TLS config")
}

/// Trusting `ca`, and presenting `id` as the client's certificate.
fn presenting(ca: &Ca, id: &Identity) -> ClientTls {
    trusting(ca)
        .identity(id.cert.as_bytes(), id.key.as_bytes())
        .expect("client identity")
}

struct Served {
    server: ServerHandle,
    reg: InProcessRegistry,
    safe: Arc<Safe>,
}

impl Served {
    fn addr(&self) -> String {
        self.server.local_addr().to_string()
    }

    fn calls(&self) -> usize {
        self.safe.calls.load(Ordering::SeqCst)
    }

    /// A proxy connecting with `tls` (plain TCP when `None`), without retries, so that each
    /// failure is one connection attempt.
    fn client(&self, tls: Option<ClientTls>, token: Option<&str>) -> VaultClient {
        let mut builder = Client::builder()
            .registry(self.reg.clone())
            .connect_timeout(Duration::from_secs(2))
            .override_options(VaultClient::SERVICE_ID, no_retry());
        if let Some(tls) = tls {
            builder = builder.tls(tls);
        }
        if let Some(t) = token {
            builder = builder.token(t);
        }
        VaultClient::new(builder.build())
    }
}

/// A call with `tls` (plain when `None`) fails as a communication error naming the peer and
/// saying `why`, not by the connect or handshake timeout.
async fn fails_at_once(s: &Served, tls: Option<ClientTls>, why: &str) {
    let err = within(why, s.client(tls, None).secret("ann".into()))
        .await
        .expect_err("a mismatched client must not get through");
    assert!(
        !err.message().contains("timed out"),
        "not by a timeout: {err}"
    );
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(err.message().contains(&s.addr()), "names the peer: {err}");
    assert!(err.message().contains(why), "says why: {err}");
}

/// A client trusting `ca` is served by `s`.
async fn assert_served(s: &Served, ca: &Ca, what: &str) {
    let answer = within(
        what,
        s.client(Some(trusting(ca)), None).secret("ann".into()),
    )
    .await
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(answer, "gold for ann");
}

async fn serve(tls: Option<ServerTls>, token: Option<&str>) -> Served {
    let reg = InProcessRegistry::new();
    let safe = Arc::new(Safe {
        calls: AtomicUsize::new(0),
    });
    let mut builder = Server::builder()
        .registry(reg.clone())
        .handshake_timeout(Duration::from_secs(2))
        .add_service(VaultServer::from_arc(safe.clone()));
    if let Some(tls) = tls {
        builder = builder.tls(tls);
    }
    if let Some(t) = token {
        builder = builder.token(t);
    }
    Served {
        server: builder.serve("127.0.0.1:0").await.expect("serve"),
        reg,
        safe,
    }
}

/// The log lines written while it is installed (on this test's current-thread runtime, which
/// runs the server's tasks too), one message per line.
struct Logs {
    rx: mpsc::UnboundedReceiver<String>,
    _guard: tracing::subscriber::DefaultGuard,
}

#[derive(Clone)]
struct LineSender(mpsc::UnboundedSender<String>);

impl Write for LineSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.0.send(String::from_utf8_lossy(buf).into_owned());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn capture() -> Logs {
        let (tx, rx) = mpsc::unbounded_channel();
        let writer = Mutex::new(LineSender(tx));
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.lock().unwrap().clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        Logs {
            rx,
            _guard: common::trace_this_thread(subscriber),
        }
    }

    /// Waits (within the suite's limit) for a line containing every one of `parts`.
    async fn expect(&mut self, parts: &[&str]) -> String {
        let deadline = tokio::time::Instant::now() + LIMIT;
        let mut seen = Vec::new();
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(line)) if parts.iter().all(|p| line.contains(p)) => return line,
                Ok(Some(line)) => seen.push(line),
                Ok(None) | Err(_) => {
                    panic!("no log line with {parts:?} within {LIMIT:?}; saw {seen:#?}")
                }
            }
        }
    }
}

#[tokio::test]
async fn a_call_over_tls_works_end_to_end() {
    let ca = Ca::new("test CA");
    let s = serve(Some(server_tls(&ca)), None).await;
    let vault = s.client(Some(trusting(&ca)), None);
    for i in 0..3 {
        let answer = within("call over TLS", vault.secret(format!("ann{i}")))
            .await
            .expect("a call over TLS");
        assert_eq!(answer, format!("gold for ann{i}"));
    }
    assert_eq!(s.calls(), 3);

    // The bytes on the wire really are TLS: the connection speaks only after a TLS handshake,
    // so the transport's own connection gets the same answer...
    let options = ConnectOptions {
        tls: Some(trusting(&ca)),
        ..ConnectOptions::default()
    };
    let conn = within("TLS connect", Connection::connect(&s.addr(), &options))
        .await
        .expect("TLS connection");
    assert!(conn.is_usable());
    conn.close();
    // ...and a server name other than the certificate's is refused by the client.
    let wrong_name = ConnectOptions {
        tls: Some(
            trusting(&ca)
                .server_name("elsewhere.example")
                .expect("name"),
        ),
        ..ConnectOptions::default()
    };
    let err = within("wrong name", Connection::connect(&s.addr(), &wrong_name))
        .await
        .expect_err("a certificate for another name must be refused");
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(err.message().contains("not trusted"), "{err}");
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_client_trusting_another_ca_fails_clearly_and_the_server_serves_others() {
    let mut logs = Logs::capture();
    let ca = Ca::new("the server's CA");
    let other = Ca::new("some other CA");
    let s = serve(Some(server_tls(&ca)), None).await;

    let err = within(
        "call with the wrong roots",
        s.client(Some(trusting(&other)), None).secret("eve".into()),
    )
    .await
    .expect_err("a server certificate from an untrusted CA must be refused");
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(err.message().contains(&s.addr()), "names the peer: {err}");
    assert!(
        err.message().contains("certificate is not trusted"),
        "says why: {err}"
    );
    // The server logged the failed handshake (why depends on whether the client's alert
    // arrives before its socket closes)...
    logs.expect(&["TLS handshake failed"]).await;
    assert_eq!(s.calls(), 0, "no handler ran");
    // ...and serves a client that trusts its CA.
    assert_served(&s, &ca, "good client").await;
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn mutual_tls_refuses_clients_without_a_good_certificate() {
    let mut logs = Logs::capture();
    let server_ca = Ca::new("server CA");
    let client_ca = Ca::new("client CA");
    let rogue_ca = Ca::new("rogue CA");
    let tls = server_tls(&server_ca)
        .require_client_certs(client_ca.pem.as_bytes())
        .expect("mTLS config");
    assert!(tls.requires_client_certs());
    let s = serve(Some(tls), None).await;

    // No client certificate.
    let err = within(
        "call without a client certificate",
        s.client(Some(trusting(&server_ca)), None)
            .secret("anon".into()),
    )
    .await
    .expect_err("a client without a certificate must be refused");
    assert_eq!(err.code(), StatusCode::RpcUnAuthentication, "{err}");
    assert!(err.message().contains(&s.addr()), "names the peer: {err}");
    assert!(err.message().contains("client certificate"), "{err}");
    logs.expect(&["TLS handshake failed", "presented no certificate"])
        .await;

    // A certificate from a CA the server does not trust.
    let rogue = rogue_ca.client("rogue");
    let with_rogue = presenting(&server_ca, &rogue);
    let err = within(
        "call with a rogue certificate",
        s.client(Some(with_rogue), None).secret("rogue".into()),
    )
    .await
    .expect_err("a client certificate from an unknown CA must be refused");
    assert_eq!(err.code(), StatusCode::RpcUnAuthentication, "{err}");
    assert!(err.message().contains(&s.addr()), "names the peer: {err}");
    logs.expect(&["TLS handshake failed", "certificate is not trusted"])
        .await;
    assert_eq!(s.calls(), 0, "no handler ran for a refused client");

    // A certificate from the client CA, but for servers only (no clientAuth usage).
    let server_only = client_ca.issue(&["ann"], rcgen::ExtendedKeyUsagePurpose::ServerAuth);
    let err = within(
        "call with a server's certificate",
        s.client(Some(presenting(&server_ca, &server_only)), None)
            .secret("ann".into()),
    )
    .await
    .expect_err("a certificate without clientAuth must be refused");
    assert_eq!(err.code(), StatusCode::RpcUnAuthentication, "{err}");
    assert!(
        err.message().contains("clientAuth"),
        "says what is wrong: {err}"
    );
    logs.expect(&["TLS handshake failed"]).await;

    // A certificate signed by the client CA.
    let good = client_ca.client("ann");
    let with_good = presenting(&server_ca, &good);
    let answer = within(
        "call with a good certificate",
        s.client(Some(with_good), None).secret("ann".into()),
    )
    .await
    .expect("a client with a certificate from the client CA");
    assert_eq!(answer, "gold for ann");
    assert_eq!(s.calls(), 1);
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_plain_client_to_a_tls_server_fails_cleanly_and_the_server_serves_others() {
    let mut logs = Logs::capture();
    let ca = Ca::new("test CA");
    let s = serve(Some(server_tls(&ca)), None).await;

    // A plain client's Hello is no TLS ClientHello: the server refuses it at once, before any
    // timeout (the client's connect timeout and the server's handshake timeout are 2 s).
    fails_at_once(&s, None, "answered with TLS").await;
    logs.expect(&["TLS handshake failed", "without TLS"]).await;
    assert_eq!(s.calls(), 0);

    // The same through a raw socket that sends nothing at all: the server closes it after its
    // handshake timeout instead of holding it.
    let server = Server::builder()
        .handshake_timeout(Duration::from_millis(200))
        .tls(server_tls(&ca))
        .add_service(VaultServer::new(Safe {
            calls: AtomicUsize::new(0),
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut silent = common::RawConn::connect(server.local_addr()).await;
    silent.expect_closed().await;
    logs.expect(&["TLS handshake failed", "no TLS handshake within 200 ms"])
        .await;
    within("shutdown", server.shutdown()).await;

    // The first server still serves TLS clients.
    assert_served(&s, &ca, "TLS client").await;
    within("shutdown", s.server.shutdown()).await;
}

#[tokio::test]
async fn a_tls_client_to_a_plain_server_fails_cleanly() {
    let ca = Ca::new("test CA");
    let s = serve(None, None).await;
    fails_at_once(&s, Some(trusting(&ca)), "did not answer with TLS").await;
    // The plain server serves plain clients.
    let answer = within("plain client", s.client(None, None).secret("ann".into()))
        .await
        .expect("a plain client");
    assert_eq!(answer, "gold for ann");
    within("shutdown", s.server.shutdown()).await;

    // A peer that accepts the TCP connection but never answers the TLS handshake: the connect
    // timeout covers the handshake.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr").to_string();
    let options = ConnectOptions {
        tls: Some(trusting(&ca)),
        connect_timeout: Duration::from_millis(300),
        ..ConnectOptions::default()
    };
    let err = within("TLS to a silent peer", Connection::connect(&addr, &options))
        .await
        .expect_err("a handshake with no answer must time out");
    assert_eq!(err.code(), StatusCode::CommunicationError, "{err}");
    assert!(
        err.message().contains("no connection within 300 ms"),
        "{err}"
    );
}

#[tokio::test]
async fn the_token_handshake_runs_over_tls() {
    const TOKEN: &str = "s3cret-token";
    let ca = Ca::new("test CA");
    let s = serve(Some(server_tls(&ca)), Some(TOKEN)).await;
    for token in [Some("wrong"), None] {
        let err = within(
            "wrong token over TLS",
            s.client(Some(trusting(&ca)), token).secret("eve".into()),
        )
        .await
        .expect_err("a wrong token must be refused over TLS too");
        assert_eq!(
            err.code(),
            StatusCode::RpcUnAuthentication,
            "{token:?}: {err}"
        );
        assert!(err.message().contains("token"), "{err}");
    }
    assert_eq!(s.calls(), 0, "no handler ran");
    let answer = within(
        "right token over TLS",
        s.client(Some(trusting(&ca)), Some(TOKEN))
            .secret("ann".into()),
    )
    .await
    .expect("the right token over TLS");
    assert_eq!(answer, "gold for ann");
    within("shutdown", s.server.shutdown()).await;
}

#[test]
fn bad_pem_is_a_clear_configuration_error() {
    let ca = Ca::new("test CA");
    let id = ca.server();
    let cases: Vec<(&str, Result<(), RpcError>)> = vec![
        (
            "no certificate",
            ServerTls::from_pem(b"not a pem", id.key.as_bytes()).map(drop),
        ),
        (
            "private key",
            ServerTls::from_pem(id.cert.as_bytes(), b"").map(drop),
        ),
        (
            "does not match",
            ServerTls::from_pem(id.cert.as_bytes(), ca.server().key.as_bytes()).map(drop),
        ),
        ("no certificate", ClientTls::from_pem(b"").map(drop)),
        (
            "no certificate",
            server_tls(&ca).require_client_certs(b"garbage").map(drop),
        ),
        (
            "cannot read",
            ClientTls::from_pem_file("/nonexistent/ca.pem").map(drop),
        ),
        (
            "server name",
            trusting(&ca).server_name("not a name!").map(drop),
        ),
    ];
    for (expected, result) in cases {
        let err = result.expect_err(expected);
        assert_eq!(err.code(), StatusCode::FrameworkError, "{err}");
        assert!(err.message().contains("TLS configuration"), "{err}");
        assert!(err.message().contains(expected), "{expected:?}: {err}");
    }
}
