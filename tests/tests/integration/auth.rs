//! Connection authentication: the token in `Hello`, checked by the server at the handshake.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{within, RawConn};
use rpc::crates::core::wire::{frame::Kind, Hello};
use rpc::{Client, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode};

#[rpc::service(name = "t.Auth")]
trait Guarded {
    async fn secret(&self) -> Result<String, RpcError>;
}

struct Vault {
    calls: AtomicUsize,
}

impl Guarded for Vault {
    async fn secret(&self) -> Result<String, RpcError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok("gold".into())
    }
}

const TOKEN: &str = "s3cret-token";

async fn serve(reg: &InProcessRegistry, token: Option<&str>) -> (ServerHandle, Arc<Vault>) {
    let vault = Arc::new(Vault {
        calls: AtomicUsize::new(0),
    });
    let mut builder = Server::builder()
        .registry(reg.clone())
        .add_service(GuardedServer::from_arc(vault.clone()));
    if let Some(t) = token {
        builder = builder.token(t);
    }
    (builder.serve("127.0.0.1:0").await.expect("serve"), vault)
}

fn client(reg: &InProcessRegistry, token: Option<&str>) -> GuardedClient {
    let mut builder = Client::builder().registry(reg.clone());
    if let Some(t) = token {
        builder = builder.token(t);
    }
    GuardedClient::new(builder.build())
}

#[tokio::test]
async fn the_right_token_is_served() {
    let reg = InProcessRegistry::new();
    let (server, vault) = serve(&reg, Some(TOKEN)).await;
    let c = client(&reg, Some(TOKEN));
    for _ in 0..3 {
        assert_eq!(c.secret().await.expect("right token"), "gold");
    }
    assert_eq!(vault.calls.load(Ordering::SeqCst), 3);
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_wrong_or_missing_token_fails_with_517_and_runs_nothing() {
    let reg = InProcessRegistry::new();
    let (server, vault) = serve(&reg, Some(TOKEN)).await;
    let near_misses = [
        Some("wrong"),
        Some("s3cret-toke"),   // a prefix
        Some("s3cret-token!"), // longer
        Some("S3CRET-TOKEN"),
        Some(""),
        None,
    ];
    for token in near_misses {
        let err = within("refused call", client(&reg, token).secret())
            .await
            .expect_err("a call with the wrong token must fail");
        assert_eq!(
            err.code(),
            StatusCode::RpcUnAuthentication,
            "{token:?}: {err}"
        );
        assert_eq!(err.code().as_u32(), 517);
        assert!(err.message().contains("authentication"), "{err}");
    }
    assert_eq!(vault.calls.load(Ordering::SeqCst), 0, "no handler ran");
    // The server is unharmed.
    assert_eq!(
        client(&reg, Some(TOKEN))
            .secret()
            .await
            .expect("right token"),
        "gold"
    );
    within("shutdown", server.shutdown()).await;
}

/// An empty token (an unset variable passed on, say) would admit every client without a token
/// as verified: the server refuses to start with it.
#[tokio::test]
async fn an_empty_server_token_is_refused_at_start() {
    let e = Server::builder()
        .add_service(GuardedServer::new(Vault {
            calls: AtomicUsize::new(0),
        }))
        .token("")
        .serve("127.0.0.1:0")
        .await
        .err()
        .expect("an empty token is refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("token is empty"), "{e}");
}

#[tokio::test]
async fn a_server_without_a_token_accepts_any() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg, None).await;
    for token in [None, Some("anything")] {
        assert_eq!(
            client(&reg, token).secret().await.expect("open server"),
            "gold"
        );
    }
    within("shutdown", server.shutdown()).await;
}

/// A Hello over the handshake's frame limit (a 9 KiB token, say) is told that the token must
/// fit, not to "send Hello first", which it did.
#[tokio::test]
async fn a_hello_too_large_for_the_handshake_is_told_to_shorten_its_token() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg, Some(TOKEN)).await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    let large = "t".repeat(rpc::crates::transport::MAX_HELLO_FRAME + 1);
    match raw.hello(&large).await {
        Some(Kind::GoAway(g)) => {
            assert!(g.reason.contains("a token and client id that fit"), "{g:?}");
        }
        other => panic!("expected GoAway, got {other:?}"),
    }
    within("shutdown", server.shutdown()).await;
}

/// Sends `hello` on a new raw connection to `addr`: it must be `accepted` (a `HelloAck`), or
/// refused with a `GoAway` whose reason holds `said`.
async fn handshake_answers(addr: std::net::SocketAddr, hello: Hello, accepted: bool, said: &str) {
    let mut raw = RawConn::connect(addr).await;
    raw.send(Kind::Hello(hello.clone()))
        .await
        .expect("send Hello");
    match (raw.recv().await, accepted) {
        (Some(Kind::HelloAck(_)), true) => {}
        (Some(Kind::GoAway(g)), false) => assert!(g.reason.contains(said), "{g:?}"),
        (other, _) => panic!("{hello:?}: accepted {accepted} expected, got {other:?}"),
    }
}

/// A client id over the limit is refused at the handshake: ids key per-caller state, and a
/// client reconnecting with ever new ids of kilobytes each would make it cost that much. One
/// at the limit is served.
#[tokio::test]
async fn a_client_id_over_the_limit_gets_go_away() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg, None).await;
    let limit = rpc::crates::transport::MAX_CLIENT_ID;
    for (len, accepted) in [(limit, true), (limit + 1, false), (4000, false)] {
        let hello = Hello {
            protocol_version: 1,
            client_id: "c".repeat(len),
            ..Default::default()
        };
        let said = format!("client id of {len} bytes");
        handshake_answers(server.local_addr(), hello, accepted, &said).await;
    }
    within("shutdown", server.shutdown()).await;
}

/// A stream window over the limit is refused at the handshake: the server keeps a record of
/// each item sent until the client grants it back, and a client announcing an endless window
/// and never granting would make one stream cost memory per item sent. One at the limit is
/// served; a client that does not stream announces no window to check.
#[tokio::test]
async fn a_stream_window_over_the_limit_gets_go_away() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg, None).await;
    let limit = rpc::crates::transport::MAX_STREAM_WINDOW;
    for (window, streams, accepted) in [
        (limit, true, true),
        (limit + 1, true, false),
        (u32::MAX, true, false),
        (u32::MAX, false, true),
    ] {
        let hello = Hello {
            protocol_version: 1,
            streams,
            stream_window: window,
            ..Default::default()
        };
        let said = format!("stream window of {window} items");
        handshake_answers(server.local_addr(), hello, accepted, &said).await;
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_bad_token_on_the_wire_gets_go_away_517_and_the_connection_closes() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg, Some(TOKEN)).await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    match raw.hello("guess").await {
        Some(Kind::GoAway(g)) => {
            assert_eq!(g.status_code, 517, "{g:?}");
            assert!(g.reason.contains("token"), "{g:?}");
        }
        other => panic!("expected GoAway, got {other:?}"),
    }
    raw.expect_closed().await;

    let mut raw = RawConn::connect(server.local_addr()).await;
    match raw.hello(TOKEN).await {
        Some(Kind::HelloAck(ack)) => assert_eq!(ack.protocol_version, 1),
        other => panic!("expected HelloAck, got {other:?}"),
    }
    within("shutdown", server.shutdown()).await;
}

/// Everything written through `tracing` while the test runs, at every level.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// The token is a secret: neither the server's nor the client's logs (at trace level), nor the
/// errors callers see, nor the `Debug` form of the settings that hold it, contain it.
#[tokio::test]
async fn the_token_never_appears_in_logs_errors_or_debug_output() {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(logs.clone())
        .with_ansi(false)
        .finish();
    let _guard = common::trace_this_thread(subscriber);

    let wrong = "wrong-s3cret-guess";
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg, Some(TOKEN)).await;
    let good = client(&reg, Some(TOKEN));
    assert_eq!(
        within("good call", good.secret()).await.expect("served"),
        "gold"
    );
    let err = within("bad call", client(&reg, Some(wrong)).secret())
        .await
        .expect_err("refused");
    let mut raw = RawConn::connect(server.local_addr()).await;
    let go_away = format!("{:?}", raw.hello(wrong).await);
    within("shutdown", server.shutdown()).await;

    let server_settings = format!(
        "{:?}",
        rpc::crates::transport::ServerOptions {
            token: Some(TOKEN.into()),
            ..Default::default()
        }
    );
    let client_settings = format!(
        "{:?}",
        rpc::crates::transport::ConnectOptions {
            token: Some(TOKEN.into()),
            ..Default::default()
        }
    );
    assert!(server_settings.contains("token"), "{server_settings}");
    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).expect("utf-8 logs");
    assert!(
        logs.contains("handshake refused"),
        "the refusal is logged: {logs}"
    );
    for (what, text) in [
        ("logs", logs.as_str()),
        ("the caller's error", &err.to_string()),
        ("the GoAway", &go_away),
        ("ServerOptions' Debug", &server_settings),
        ("ConnectOptions' Debug", &client_settings),
    ] {
        for secret in [TOKEN, wrong] {
            assert!(
                !text.contains(secret),
                "{what} contain the token {secret:?}: {text}"
            );
        }
    }
}

/// A token no client's `Hello` can carry (the handshake's frames are at most 8 KiB, or the
/// server's `max_frame_length`) is refused when the server starts, naming its length: before,
/// the server started, and every client holding the right token was refused. A token with room
/// to spare is served.
#[tokio::test]
async fn a_token_too_long_for_the_handshake_is_refused_at_start() {
    let vault = || {
        GuardedServer::from_arc(Arc::new(Vault {
            calls: AtomicUsize::new(0),
        }))
    };
    for (token, frame_limit) in [("t".repeat(8 * 1024), None), ("t".repeat(1000), Some(1024))] {
        let mut builder = Server::builder().token(token.clone()).add_service(vault());
        if let Some(limit) = frame_limit {
            builder = builder.max_frame_length(limit);
        }
        let e = builder.serve("127.0.0.1:0").await.err().expect("refused");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(
            e.to_string()
                .contains(&format!("token of {} bytes", token.len())),
            "{e}"
        );
    }
    let reg = InProcessRegistry::new();
    let token = "t".repeat(500);
    let server = Server::builder()
        .registry(reg.clone())
        .token(token.clone())
        .max_frame_length(1024)
        .add_service(vault())
        .serve("127.0.0.1:0")
        .await
        .expect("a token with room to spare");
    let c = client(&reg, Some(&token));
    assert_eq!(
        within("a call", c.secret()).await.expect("admitted"),
        "gold"
    );
    within("shutdown", server.shutdown()).await;
}
