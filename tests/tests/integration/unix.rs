//! Unix domain sockets as a second transport: a server started with `serve("unix:/path")`
//! publishes `unix:/path`, and clients reach it through the registry like any other endpoint,
//! with deadlines, `Cancel` and TLS working as over TCP. Every socket lives in a temporary
//! directory of its own.

#![cfg(unix)]

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{recv_one, until_entered, within, DropSignal};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rpc::tls::{ClientTls, ServerTls};
use rpc::{
    Client, GovernanceOverrides, InProcessRegistry, Registry, RpcError, Server, ServerHandle,
    StatusCode,
};
use tokio::sync::mpsc;

#[rpc::service(name = "t.Local")]
trait Local {
    async fn greet(&self, name: String) -> Result<String, RpcError>;
    /// Never answers; reports when it starts and when its future is dropped.
    async fn forever(&self) -> Result<(), RpcError>;
}

struct Greeter {
    entered: mpsc::UnboundedSender<String>,
    dropped: mpsc::UnboundedSender<String>,
}

impl Local for Greeter {
    async fn greet(&self, name: String) -> Result<String, RpcError> {
        Ok(format!("hello {name}"))
    }
    async fn forever(&self) -> Result<(), RpcError> {
        let _guard = DropSignal::new("forever", self.dropped.clone());
        let _ = self.entered.send("forever".into());
        std::future::pending::<()>().await;
        Ok(())
    }
}

struct Probe {
    entered: mpsc::UnboundedReceiver<String>,
    dropped: mpsc::UnboundedReceiver<String>,
}

fn unix_addr(dir: &Path, name: &str) -> String {
    format!("unix:{}", dir.join(name).display())
}

async fn serve_at(
    addr: &str,
    reg: &InProcessRegistry,
    tls: Option<ServerTls>,
) -> (ServerHandle, Probe) {
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let (dropped_tx, dropped) = mpsc::unbounded_channel();
    let mut builder = Server::builder()
        .registry(reg.clone())
        .add_service(LocalServer::new(Greeter {
            entered: entered_tx,
            dropped: dropped_tx,
        }));
    if let Some(tls) = tls {
        builder = builder.tls(tls);
    }
    let server = builder.serve(addr).await.expect("serve on a Unix socket");
    (server, Probe { entered, dropped })
}

fn options(timeout_ms: u64) -> GovernanceOverrides {
    GovernanceOverrides {
        timeout_ms: Some(timeout_ms),
        retry_times: Some(0),
        ..GovernanceOverrides::NONE
    }
}

#[tokio::test]
async fn a_proxy_calls_a_server_on_a_unix_socket_through_the_registry() {
    let dir = tempfile::tempdir().expect("temp dir");
    let addr = unix_addr(dir.path(), "local.sock");
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve_at(&addr, &reg, None).await;
    assert_eq!(server.address().to_string(), addr);
    assert!(dir.path().join("local.sock").exists(), "the socket file");

    // What the registry publishes is the address as written, scheme included.
    let watch = reg
        .watch(&LocalClient::SERVICE_ID.into())
        .await
        .expect("watch");
    let published: Vec<String> = watch.current().iter().map(|i| i.address.clone()).collect();
    assert_eq!(published, vec![addr.clone()]);

    let client = LocalClient::new(Client::builder().registry(reg.clone()).build());
    for name in ["ann", "bob", "cy"] {
        let answer = within("a call over the Unix socket", client.greet(name.into()))
            .await
            .expect("greet");
        assert_eq!(answer, format!("hello {name}"));
    }

    within("shutdown", server.shutdown()).await;
    assert!(
        !dir.path().join("local.sock").exists(),
        "the server removes its socket file when it stops"
    );
}

/// A server's Unix socket can be appointed, as clients dial it everywhere else they take an
/// address (before, `appoint_address = "unix:..."` was refused as not `host:port`, and every
/// appointed call failed).
#[tokio::test]
async fn a_unix_socket_can_be_the_appointed_address() {
    let dir = tempfile::tempdir().expect("temp dir");
    let addr = unix_addr(dir.path(), "appointed.sock");
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve_at(&addr, &reg, None).await;
    let client = Client::builder().registry(reg.clone()).build();
    let appointed = LocalClient::new(client.with_options(GovernanceOverrides {
        shunt_strategy: Some(rpc::ShuntStrategy::Appoint),
        appoint_address: Some(addr.clone().into()),
        ..GovernanceOverrides::NONE
    }));
    let answer = within("an appointed call", appointed.greet("ann".into()))
        .await
        .expect("greet");
    assert_eq!(answer, "hello ann");
    within("shutdown", server.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn dropping_a_call_over_a_unix_socket_cancels_its_handler() {
    let dir = tempfile::tempdir().expect("temp dir");
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve_at(&unix_addr(dir.path(), "cancel.sock"), &reg, None).await;
    // No deadline: only the Cancel can stop the handler.
    let client = LocalClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(LocalClient::SERVICE_ID, options(0))
            .build(),
    );
    let call = until_entered(Box::pin(client.forever()), "forever", &mut probe.entered).await;
    drop(call);
    assert_eq!(
        recv_one("the Cancel dropped the handler", &mut probe.dropped).await,
        "forever"
    );
    assert_eq!(
        client
            .greet("after".into())
            .await
            .expect("the connection is still good"),
        "hello after"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn a_deadline_over_a_unix_socket_times_out_and_stops_the_handler() {
    let dir = tempfile::tempdir().expect("temp dir");
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve_at(&unix_addr(dir.path(), "deadline.sock"), &reg, None).await;
    let client = LocalClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(LocalClient::SERVICE_ID, options(100))
            .build(),
    );
    let err = client
        .forever()
        .await
        .expect_err("the handler never answers");
    assert_eq!(err.code(), StatusCode::Timeout, "{err}");
    assert_eq!(
        recv_one("handler entered", &mut probe.entered).await,
        "forever"
    );
    assert_eq!(
        recv_one("the deadline dropped the handler", &mut probe.dropped).await,
        "forever"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn binding_a_bad_unix_path_says_what_to_do() {
    let dir = tempfile::tempdir().expect("temp dir");
    let reg = InProcessRegistry::new();
    let missing = format!("unix:{}/no/such/dir/x.sock", dir.path().display());
    let err = match Server::builder().serve(missing.as_str()).await {
        Ok(_) => panic!("bound a socket in a directory that does not exist"),
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(text.contains(&missing), "{text}");
    assert!(text.contains("create it"), "{text}");

    // A path already bound by a running server is not taken over.
    let addr = unix_addr(dir.path(), "taken.sock");
    let (server, _probe) = serve_at(&addr, &reg, None).await;
    let err = match Server::builder().serve(addr.as_str()).await {
        Ok(_) => panic!("bound a path a running server holds"),
        Err(e) => e,
    };
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
    assert!(err.to_string().contains("remove it"), "{err}");
    let client = LocalClient::new(Client::builder().registry(reg.clone()).build());
    assert_eq!(
        within("the first server still serves", client.greet("x".into()))
            .await
            .expect("greet"),
        "hello x"
    );
    within("shutdown", server.shutdown()).await;
}

/// A certificate authority and a server certificate for `localhost`, made for the test.
fn tls_pair() -> (ServerTls, String) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "unix test CA");
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().expect("CA key");
    let ca_pem = params.self_signed(&ca_key).expect("CA").pem();
    let issuer = Issuer::new(params, ca_key);
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, &issuer).expect("signed");
    let server = ServerTls::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes())
        .expect("server TLS");
    (server, ca_pem)
}

#[tokio::test]
async fn tls_runs_over_a_unix_socket() {
    let dir = tempfile::tempdir().expect("temp dir");
    let reg = InProcessRegistry::new();
    let (server_tls, ca_pem) = tls_pair();
    let (server, _probe) =
        serve_at(&unix_addr(dir.path(), "tls.sock"), &reg, Some(server_tls)).await;

    let named = ClientTls::from_pem(ca_pem.as_bytes())
        .expect("roots")
        .server_name("localhost")
        .expect("name");
    let client = LocalClient::new(Client::builder().registry(reg.clone()).tls(named).build());
    assert_eq!(
        within(
            "a call over TLS over a Unix socket",
            client.greet("tls".into())
        )
        .await
        .expect("greet"),
        "hello tls"
    );

    // A Unix address names no host to check the certificate against: the client must say it.
    let unnamed = ClientTls::from_pem(ca_pem.as_bytes()).expect("roots");
    let client = LocalClient::new(
        Client::builder()
            .registry(reg.clone())
            .tls(unnamed)
            .override_options(LocalClient::SERVICE_ID, options(5_000))
            .build(),
    );
    let err = within("a TLS call without a server name", client.greet("x".into()))
        .await
        .expect_err("no name to check the certificate against");
    assert!(err.to_string().contains("ClientTls::server_name"), "{err}");
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_plain_connection_reaches_a_unix_socket_directly() {
    use rpc::crates::transport::{ConnectOptions, Connection, PeerAddr, UnixListener};

    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("raw.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    assert_eq!(
        rpc::crates::transport::Listener::local_addr(&listener).expect("local addr"),
        PeerAddr::Unix(Some(path.clone()))
    );
    let reg = InProcessRegistry::new();
    let (entered_tx, _entered) = mpsc::unbounded_channel();
    let (dropped_tx, _dropped) = mpsc::unbounded_channel();
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(LocalServer::new(Greeter {
            entered: entered_tx,
            dropped: dropped_tx,
        }))
        .serve_on(listener)
        .await
        .expect("serve on a bound listener");
    let addr = format!("unix:{}", path.display());
    let conn = within(
        "connect",
        Connection::connect(&addr, &ConnectOptions::default()),
    )
    .await
    .expect("a connection over the Unix socket");
    assert_eq!(conn.peer(), addr);
    let answer = within(
        "a raw call",
        conn.call(
            rpc::crates::transport::Call {
                service_entry_id: "t.Local.greet".into(),
                parameters: rpc::Codec::MsgPack.encode(&("raw",)).expect("encode"),
                ..Default::default()
            },
            Some(tokio::time::Instant::now() + Duration::from_secs(5)),
        ),
    )
    .await
    .expect("answer");
    assert_eq!(answer.status_code, 200, "{}", answer.exception_message);
    let text: String = rpc::Codec::MsgPack.decode(&answer.result).expect("decode");
    assert_eq!(text, "hello raw");
    within("shutdown", server.shutdown()).await;
}
