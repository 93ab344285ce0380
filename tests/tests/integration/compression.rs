//! Payload compression over real TCP: what crosses the wire is counted by a proxy between the
//! client and the server (the oracle is the byte count: a 64 KiB repetitive payload crosses in
//! far fewer bytes when compressed), peers that do not negotiate get plain frames, and payloads
//! that do not decompress, or decompress beyond the frame limit, get a clear error while the
//! connection's other calls go on.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use common::{within, RawConn};
use rpc::crates::core::wire::{frame::Kind, Hello, HelloAck, RemoteInvokeMessage};
use rpc::crates::transport::compression::{compress, SUPPORTED};
use rpc::crates::transport::{Call, ConnectOptions, Connection};
use rpc::{
    Client, Codec, Compression, GovernanceOverrides, RpcError, Server, ServerHandle,
    StaticRegistry, StatusCode,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[rpc::service(name = "t.Zip")]
trait Zip {
    /// Declared with zstd: the client compresses the parameters, the server the result.
    #[governance(compression = "zstd")]
    async fn zstd_echo(&self, text: String) -> Result<String, RpcError>;
    /// Declared with lz4.
    #[governance(compression = "lz4")]
    async fn lz4_echo(&self, text: String) -> Result<String, RpcError>;
    /// Nothing declared: compression is off unless a layer above turns it on.
    async fn plain_echo(&self, text: String) -> Result<String, RpcError>;
    /// One call at a time, each held until the test lets it through ([`HOLD_RELEASE`]).
    #[governance(max_concurrent_handling_count = 1)]
    async fn held_echo(&self, text: String) -> Result<String, RpcError>;
}

/// Signalled by each `held_echo` call once it runs.
static HOLD_ENTERED: tokio::sync::Notify = tokio::sync::Notify::const_new();
/// A permit per `held_echo` call let through.
static HOLD_RELEASE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

struct Impl;

impl Zip for Impl {
    async fn zstd_echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
    async fn lz4_echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
    async fn plain_echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
    async fn held_echo(&self, text: String) -> Result<String, RpcError> {
        HOLD_ENTERED.notify_one();
        common::let_through(&HOLD_RELEASE).await?;
        Ok(text)
    }
}

/// JSON-like repetitive text of exactly `n` bytes: compresses well with either algorithm.
fn text(n: usize) -> String {
    let mut out = String::with_capacity(n + 64);
    let mut i = 0u64;
    while out.len() < n {
        out.push_str(&format!(
            "{{\"id\":{i},\"name\":\"item\",\"tags\":[\"a\",\"b\"]}},"
        ));
        i += 1;
    }
    out.truncate(n);
    out
}

/// Bytes that crossed a [`Proxy`] in each direction.
#[derive(Default)]
struct Counts {
    to_server: AtomicU64,
    to_client: AtomicU64,
}

impl Counts {
    fn take(&self) -> (u64, u64) {
        (
            self.to_server.swap(0, Ordering::SeqCst),
            self.to_client.swap(0, Ordering::SeqCst),
        )
    }
}

/// A TCP proxy on 127.0.0.1 that forwards every connection to `target` and counts the bytes
/// of each direction.
struct Proxy {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, c.clone(), true));
                tokio::spawn(pipe(sr, cw, c.clone(), false));
            }
        });
        Proxy { addr, counts, task }
    }
}

/// Copies `from` to `to` until either end closes, counting what passed.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    counts: Arc<Counts>,
    to_server: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Counted before it is written: once the answer reaches the client, every byte of the
        // exchange is counted.
        let counter = if to_server {
            &counts.to_server
        } else {
            &counts.to_client
        };
        counter.fetch_add(n as u64, Ordering::SeqCst);
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn server() -> ServerHandle {
    Server::builder()
        .add_service(ZipServer::new(Impl))
        .max_frame_length(256 * 1024)
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

/// A client whose only endpoint is `addr`, on one connection.
fn client_to(addr: SocketAddr) -> ZipClient {
    ZipClient::new(
        Client::builder()
            .registry(StaticRegistry::new([addr.to_string()]))
            .connections_per_endpoint(1)
            .build(),
    )
}

/// Makes the connection (handshake) and resets the counts, so that what is counted next is
/// one call's frames.
async fn warm_up(client: &ZipClient, proxy: &Proxy) {
    within("warm-up", client.plain_echo("hi".into()))
        .await
        .expect("warm-up call");
    proxy.counts.take();
}

/// What the tests of compression on the wire share: a span subscriber, the server, the
/// counting proxy in front of it, and a client through the proxy, warmed up.
async fn measured() -> (
    (common::otel::Traces, tracing::subscriber::DefaultGuard),
    ServerHandle,
    Proxy,
    ZipClient,
) {
    let traced = traced();
    let server = server().await;
    let proxy = Proxy::start(server.local_addr()).await;
    let client = client_to(proxy.addr);
    warm_up(&client, &proxy).await;
    (traced, server, proxy, client)
}

/// Awaits the echo `call` (named `what`), checks it answered `expected`, and returns the bytes
/// the proxy counted up and down for it.
async fn counted(
    proxy: &Proxy,
    what: &str,
    call: impl std::future::Future<Output = Result<String, RpcError>>,
    expected: &str,
) -> (u64, u64) {
    let back = within(what, call).await.expect(what);
    assert_eq!(back, expected, "{what}");
    proxy.counts.take()
}

/// A span subscriber on this test's thread until dropped. Every test installs one: `tracing`
/// caches each callsite's interest process-wide, and a thread without a subscriber could
/// register the attempt span's callsite as never wanted while the span test runs.
fn traced() -> (common::otel::Traces, tracing::subscriber::DefaultGuard) {
    common::otel::Traces::install()
}

#[tokio::test]
async fn zstd_and_lz4_payloads_cross_the_wire_compressed_and_come_back_whole() {
    let (_traced, server, proxy, client) = measured().await;
    let payload = text(64 * 1024);

    // The reference: the same payload with compression off crosses whole both ways.
    let back = within("plain", client.plain_echo(payload.clone()))
        .await
        .expect("plain");
    assert_eq!(back, payload);
    let (up, down) = proxy.counts.take();
    assert!(
        up > 64 * 1024 && down > 64 * 1024,
        "plain: {up} up, {down} down"
    );

    for (name, back) in [
        (
            "zstd",
            within("zstd", client.zstd_echo(payload.clone())).await,
        ),
        ("lz4", within("lz4", client.lz4_echo(payload.clone())).await),
    ] {
        assert_eq!(back.expect(name), payload, "{name}");
        let (up, down) = proxy.counts.take();
        // Both the parameters (client) and the result (server) crossed compressed, each at
        // least four times smaller than the payload.
        assert!(
            up < 16 * 1024 && down < 16 * 1024,
            "{name}: {up} bytes up, {down} bytes down for a {} byte payload",
            payload.len()
        );
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn payloads_below_the_threshold_go_plain_and_from_the_threshold_on_compressed() {
    let (_traced, server, proxy, client) = measured().await;
    // The parameters are a MessagePack array holding the string (1 + 3 header bytes), the
    // result the string alone (3 header bytes): 1019 bytes of text are 1023 bytes of
    // parameters and 1022 of result, below the default threshold of 1024; 1021 bytes of text
    // are 1025 and 1024, at or above it.
    let below = text(1019);
    let (up, down) = counted(&proxy, "below", client.zstd_echo(below.clone()), &below).await;
    assert!(up > 1023 && down > 1022, "below: {up} up, {down} down");

    let at = text(1021);
    let (up, down) = counted(&proxy, "at", client.zstd_echo(at.clone()), &at).await;
    assert!(
        up < 800 && down < 800,
        "at the threshold: {up} up, {down} down"
    );

    // The threshold is an option like any other: raised at runtime for this handle, the
    // parameters go plain (the server's own threshold still compresses the answer).
    let high = client.with_options(GovernanceOverrides {
        compression_threshold: Some(4096),
        ..GovernanceOverrides::NONE
    });
    let (up, down) = counted(&proxy, "raised", high.zstd_echo(at.clone()), &at).await;
    assert!(
        up > 1025 && down < 800,
        "raised threshold: {up} up, {down} down"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn compression_turned_on_by_the_client_is_followed_by_the_server() {
    let (_traced, server, proxy, client) = measured().await;
    let payload = text(64 * 1024);
    // The entry declares nothing; this handle turns lz4 on. The server's option for the entry
    // is off, so it answers with the algorithm the call came with.
    let lz4 = client.with_options(GovernanceOverrides {
        compression: Some(Compression::Lz4),
        ..GovernanceOverrides::NONE
    });
    let (up, down) = counted(&proxy, "lz4", lz4.plain_echo(payload.clone()), &payload).await;
    assert!(up < 16 * 1024 && down < 16 * 1024, "{up} up, {down} down");
    within("shutdown", server.shutdown()).await;
}

/// A raw call of `t.Zip.<method>` with `text` as its MessagePack argument list.
fn raw_call(id: u64, method: &str, text: &str) -> RemoteInvokeMessage {
    RemoteInvokeMessage {
        message_id: id,
        service_entry_id: format!("t.Zip.{method}"),
        codec: Codec::MsgPack.to_wire(),
        parameters: Codec::MsgPack.encode(&(text,)).expect("encode"),
        ..Default::default()
    }
}

/// Calls `t.Zip.<method>` with `parameters` marked compressed with `alg`; its answer.
async fn packed_call(
    raw: &mut RawConn,
    id: u64,
    method: &str,
    parameters: Bytes,
    alg: rpc::crates::core::Compression,
) -> rpc::crates::core::wire::RemoteResultMessage {
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        parameters,
        compression: alg.to_wire(),
        ..raw_call(id, method, "")
    }))
    .await
    .expect("send");
    raw_result(raw).await
}

/// `payload` compressed with `alg` and cut in half: it does not decompress.
fn cut_in_half(alg: Compression, payload: &[u8]) -> Bytes {
    let mut cut = compress(alg, payload).to_vec();
    cut.truncate(cut.len() / 2);
    Bytes::from(cut)
}

/// Arguments of 300 KiB: over the test server's frame limit once decompressed.
fn bomb() -> Bytes {
    Codec::MsgPack
        .encode(&(String::from_utf8(vec![b'x'; 300 * 1024]).expect("ascii"),))
        .expect("encode")
}

/// `r` must be call `id`'s 500 for arguments that do not decompress.
fn assert_not_decompressed(r: &rpc::crates::core::wire::RemoteResultMessage, id: u64) {
    assert_eq!((r.message_id, r.status_code), (id, 500), "{r:?}");
    assert!(
        r.exception_message.contains("does not decompress"),
        "{}",
        r.exception_message
    );
}

/// The next frame must be a result; returns it.
async fn raw_result(raw: &mut RawConn) -> rpc::crates::core::wire::RemoteResultMessage {
    match raw.recv().await {
        Some(Kind::Result(r)) => r,
        other => panic!("expected a result, got {other:?}"),
    }
}

#[tokio::test]
async fn a_peer_that_does_not_negotiate_gets_plain_answers_even_from_a_compressing_entry() {
    let _traced = traced();
    let server = server().await;
    let payload = text(64 * 1024);

    // A client that predates compression: its Hello lists nothing.
    let mut old = RawConn::connect(server.local_addr()).await;
    let ack = old.handshake().await;
    assert_eq!(
        ack.accept_compression,
        [1, 2],
        "the server lists zstd and lz4"
    );
    old.send(Kind::Invoke(raw_call(1, "zstd_echo", &payload)))
        .await
        .expect("send");
    let r = raw_result(&mut old).await;
    assert_eq!(
        (r.status_code, r.compression),
        (200, 0),
        "{}",
        r.exception_message
    );
    let back: String = Codec::MsgPack.decode(&r.result).expect("plain MessagePack");
    assert_eq!(back, payload);

    // The same call from a client that lists zstd: the answer comes compressed.
    let mut new = RawConn::connect(server.local_addr()).await;
    new.send(Kind::Hello(Hello {
        protocol_version: 1,
        accept_compression: vec![Compression::Zstd.to_wire()],
        ..Default::default()
    }))
    .await
    .expect("hello");
    assert!(matches!(new.recv().await, Some(Kind::HelloAck(_))));
    new.send(Kind::Invoke(raw_call(1, "zstd_echo", &payload)))
        .await
        .expect("send");
    let r = raw_result(&mut new).await;
    assert_eq!((r.status_code, r.compression), (200, 1));
    assert!(r.result.len() < 16 * 1024, "{} bytes", r.result.len());
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn corrupt_or_oversized_compressed_parameters_get_a_clear_500_and_the_connection_goes_on() {
    let _traced = traced();
    let server = server().await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    let good = Codec::MsgPack.encode(&("fine",)).expect("encode");
    // 300 KiB of one byte, compressed to a few hundred bytes: beyond the 256 KiB frame limit
    // once decompressed.
    let bomb = bomb();
    let mut id = 0;
    for alg in SUPPORTED {
        let cut = cut_in_half(alg, &good);
        let packed_bomb = compress(alg, &bomb);
        assert!(
            packed_bomb.len() < 4096,
            "{alg}: {} bytes",
            packed_bomb.len()
        );
        for (what, parameters, want) in [
            ("corrupt", cut, format!("does not decompress as {alg}")),
            (
                "oversized",
                packed_bomb,
                "above the limit of 262144 bytes".to_string(),
            ),
        ] {
            id += 1;
            let r = packed_call(&mut raw, id, "plain_echo", parameters, alg).await;
            assert_eq!(r.message_id, id);
            assert_eq!(r.status_code, 500, "{alg} {what}: {r:?}");
            assert!(
                r.exception_message.contains(&want) && r.exception_message.contains("t.Zip"),
                "{alg} {what}: {}",
                r.exception_message
            );
            // The connection goes on: the next call on it, compressed properly, is answered.
            id += 1;
            let r = packed_call(&mut raw, id, "plain_echo", compress(alg, &good), alg).await;
            assert_eq!((r.message_id, r.status_code), (id, 200), "{r:?}");
            let back: String = Codec::MsgPack.decode(&r.result).expect("decode");
            assert_eq!(back, "fine");
        }
    }
    // An algorithm the server does not know is refused the same way.
    id += 1;
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        compression: 7,
        ..raw_call(id, "plain_echo", "x")
    }))
    .await
    .expect("send");
    let r = raw_result(&mut raw).await;
    assert_eq!(r.status_code, 500);
    assert!(
        r.exception_message.contains("algorithm 7"),
        "{}",
        r.exception_message
    );
    within("shutdown", server.shutdown()).await;
}

/// A compressed call that its entry's admission refuses (its cap is full) is answered with
/// the refusal, 515, without being decompressed: corrupt arguments are not found corrupt.
/// Before, the connection decompressed every call first, so an overloaded or rate-limited
/// entry spent its CPU expanding calls it then refused. An admitted call is still
/// decompressed (corrupt: 500), and its slot is given back.
#[tokio::test]
async fn a_compressed_call_refused_by_its_entrys_admission_is_not_decompressed() {
    let server = server().await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    let good = Codec::MsgPack.encode(&("fine",)).expect("encode");
    let corrupt = cut_in_half(Compression::Zstd, &good);
    // One call holds the entry's only slot.
    raw.send(Kind::Invoke(raw_call(1, "held_echo", "held")))
        .await
        .expect("send");
    within("the held call runs", HOLD_ENTERED.notified()).await;
    let r = packed_call(&mut raw, 2, "held_echo", corrupt.clone(), Compression::Zstd).await;
    assert_eq!(
        (r.message_id, r.status_code),
        (2, StatusCode::OverflowMaxServerHandle.as_u32()),
        "{}",
        r.exception_message
    );
    HOLD_RELEASE.add_permits(1);
    let r = raw_result(&mut raw).await;
    assert_eq!((r.message_id, r.status_code), (1, 200), "{r:?}");
    // Admitted now: decompressed, found corrupt, and its slot given back.
    let r = packed_call(&mut raw, 3, "held_echo", corrupt, Compression::Zstd).await;
    assert_not_decompressed(&r, 3);
    HOLD_RELEASE.add_permits(1);
    let r = packed_call(
        &mut raw,
        4,
        "held_echo",
        compress(Compression::Zstd, &good),
        Compression::Zstd,
    )
    .await;
    assert_eq!((r.message_id, r.status_code), (4, 200), "{r:?}");
    within("shutdown", server.shutdown()).await;
}

/// A call admitted at its entry whose arguments then do not decompress keeps the rate-limit
/// token it took: decompressing them cost the server the work a token stands for, so a flood
/// of corrupt arguments (or bombs) is held to the entry's rate as any other calls are. With
/// one call a second and a burst of 1, a second corrupt call within the second is refused 429
/// and not decompressed.
#[tokio::test]
async fn compressed_calls_that_do_not_decompress_are_held_to_the_rate_limit() {
    let server = Server::builder()
        .add_service(ZipServer::new(Impl))
        .rate_limit(1, 1)
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    let good = Codec::MsgPack.encode(&("fine",)).expect("encode");
    let corrupt = cut_in_half(Compression::Zstd, &good);
    let r = packed_call(
        &mut raw,
        1,
        "plain_echo",
        corrupt.clone(),
        Compression::Zstd,
    )
    .await;
    assert_not_decompressed(&r, 1);
    let r = packed_call(&mut raw, 2, "plain_echo", corrupt, Compression::Zstd).await;
    assert_eq!(
        (r.message_id, r.status_code),
        (2, StatusCode::RateLimited.as_u32()),
        "{r:?}"
    );
    assert!(
        r.exception_message.contains("over its limit"),
        "{}",
        r.exception_message
    );
    within("shutdown", server.shutdown()).await;
}

/// A call admitted at its entry and then refused for want of the decompression budget (515,
/// nothing decompressed, nothing ran) gets its rate-limit token back, as a call refused at the
/// cap does: with a burst of 3 (one a second), two held calls and the refused one leave one
/// token for the next call. Before, the refused call kept its token and the next was 429.
#[tokio::test]
async fn a_call_refused_for_the_decompression_budget_keeps_no_rate_limit_token() {
    let mut held = Holder::two_held_of_a_burst_of_3().await;
    held.send(3, true).await;
    let r = raw_result(&mut held.raw).await;
    assert_eq!((r.message_id, r.status_code), (3, 515), "{r:?}");
    // The third's token is back: a plain call runs.
    held.send(4, false).await;
    within("the next call starts", held.started.recv())
        .await
        .expect("started, not refused 429");
    held.gate.add_permits(3);
    within("shutdown", held.server.shutdown()).await;
}

/// Arguments that say no size (a streaming Zstandard encoder's) are decompressed to learn it;
/// refused then for want of the budget, the call keeps its rate-limit token, as corrupt
/// arguments do: the work a token stands for was done. Before, every such call got its token
/// back, so a flood of them was decompressed at any rate while the budget was short, the
/// entry's rate limit never refusing one.
#[tokio::test]
async fn arguments_decompressed_then_refused_for_the_budget_keep_their_rate_limit_token() {
    use std::io::Write as _;
    let mut held = Holder::two_held_of_a_burst_of_3().await;
    let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 1).expect("encoder");
    encoder.write_all(&held.plain).expect("encode");
    let sizeless = Bytes::from(encoder.finish().expect("encoded"));
    assert_eq!(
        zstd::bulk::Decompressor::upper_bound(&sizeless),
        None,
        "the frame says no size"
    );
    for id in 3..=7 {
        held.raw
            .send(Kind::Invoke(RemoteInvokeMessage {
                message_id: id,
                service_entry_id: "t.Held.hold".into(),
                codec: Codec::MsgPack.to_wire(),
                parameters: sizeless.clone(),
                compression: Compression::Zstd.to_wire(),
                ..Default::default()
            }))
            .await
            .expect("send");
    }
    let mut statuses = Vec::new();
    for _ in 3..=7 {
        statuses.push(raw_result(&mut held.raw).await.status_code);
    }
    // The third token goes to call 3 (decompressed, then refused 515, and kept); the calls
    // after it are over the entry's rate (a token a second): 429, none decompressed.
    assert_eq!(statuses[0], 515, "{statuses:?}");
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert!(limited >= 3, "{statuses:?}");
    assert!(held.started.try_recv().is_err(), "no handler started");
    held.gate.add_permits(2);
    within("shutdown", held.server.shutdown()).await;
}

/// A compressed call to an entry the server does not have is answered 507, as a plain one
/// is: its arguments are not decompressed (corrupt ones are not found corrupt, a bomb is not
/// expanded).
#[tokio::test]
async fn a_compressed_call_to_an_unknown_entry_is_answered_507_without_being_decompressed() {
    let server = server().await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.handshake().await;
    let bomb = bomb();
    for (id, alg) in (1..).zip(SUPPORTED) {
        for parameters in [compress(alg, &bomb), cut_in_half(alg, &bomb)] {
            let r = packed_call(&mut raw, id, "nothing", parameters, alg).await;
            assert_eq!(
                r.status_code,
                StatusCode::NotFindLocalServiceEntry.as_u32(),
                "{alg}: {r:?}"
            );
            assert!(
                r.exception_message.contains("t.Zip.nothing"),
                "{}",
                r.exception_message
            );
        }
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_client_refuses_a_corrupt_or_oversized_answer_and_its_other_calls_go_on() {
    let _traced = traced();
    // A server played by hand: it answers the first calls with bad compressed results, then
    // properly.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let fake = tokio::spawn(async move {
        let ack = HelloAck {
            protocol_version: 1,
            max_frame_length: 1 << 20,
            ..Default::default()
        };
        let (mut raw, hello) = RawConn::accept_with(&listener, ack).await;
        assert_eq!(hello.accept_compression, [1, 2]);
        let fine = Codec::MsgPack.encode("fine").expect("encode");
        let bomb = vec![0u8; 200 * 1024];
        for (result, compression) in [
            (cut_in_half(Compression::Zstd, &fine), 1),
            (compress(Compression::Lz4, &bomb), 2),
            (compress(Compression::Lz4, &fine), 2),
        ] {
            let Some(Kind::Invoke(call)) = raw.recv().await else {
                panic!("expected a call")
            };
            raw.send(Kind::Result(rpc::crates::core::wire::RemoteResultMessage {
                message_id: call.message_id,
                status_code: 200,
                result,
                compression,
                ..Default::default()
            }))
            .await
            .expect("answer");
        }
    });
    let conn = Connection::connect(
        &addr.to_string(),
        &ConnectOptions {
            max_frame_length: 100 * 1024,
            ..Default::default()
        },
    )
    .await
    .expect("connect");
    let call = || Call {
        service_entry_id: "t.Zip.plain_echo".into(),
        ..Default::default()
    };
    let e = within("corrupt", conn.call(call(), None))
        .await
        .expect_err("a corrupt answer");
    assert_eq!(e.code(), StatusCode::FrameworkError);
    assert!(e.message().contains("does not decompress as zstd"), "{e}");
    let e = within("oversized", conn.call(call(), None))
        .await
        .expect_err("an oversized answer");
    assert!(
        e.message()
            .contains("204800 bytes or more, above the limit of 102400 bytes"),
        "{e}"
    );
    let answer = within("good", conn.call(call(), None)).await.expect("good");
    assert_eq!(answer.compression, 0, "handed over decompressed");
    let back: String = Codec::MsgPack.decode(&answer.result).expect("decode");
    assert_eq!(back, "fine");
    within("fake server", fake).await.expect("fake server");
}

#[tokio::test]
async fn the_attempt_and_server_spans_record_the_algorithm_and_the_sizes() {
    let (traces, _guard) = traced();
    let server = server().await;
    let client = client_to(server.local_addr());
    let payload = text(64 * 1024);
    within("zstd", client.zstd_echo(payload.clone()))
        .await
        .expect("zstd");
    within("plain", client.plain_echo(payload.clone()))
        .await
        .expect("plain");
    // (A server's span ends as its task drops it, which may come after the answer.)
    let spans = traces
        .spans_once("the server spans", |spans| {
            spans.iter().filter(|s| s.name == "rpc.server").count() >= 2
        })
        .await;
    let attempts: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "rpc.client.attempt")
        .collect();
    let of = |method: &str| {
        attempts
            .iter()
            .find(|s| {
                common::otel::attr(s, "rpc.method").map(|v| v.to_string()) == Some(method.into())
            })
            .unwrap_or_else(|| panic!("no attempt span of {method}"))
    };
    // The oracle: the parameters as the codec encodes them, and what the zstd crate makes of
    // them at level 1 (the level the framework documents).
    let encoded = Codec::MsgPack.encode(&(payload.as_str(),)).expect("encode");
    let packed = zstd::bulk::compress(&encoded, 1).expect("zstd");
    let zstd = of("zstd_echo");
    let attr = |key| common::otel::attr(zstd, key).map(|v| v.to_string());
    assert_eq!(attr("rpc.compression"), Some("zstd".into()));
    assert_eq!(attr("rpc.request.size"), Some(encoded.len().to_string()));
    assert_eq!(
        attr("rpc.request.compressed_size"),
        Some(packed.len().to_string())
    );
    assert_eq!(
        common::otel::attr(of("plain_echo"), "rpc.compression"),
        None,
        "nothing recorded for an uncompressed call"
    );
    // The server's span says how the parameters came, and their size once decompressed.
    let served = |method: &str| {
        spans
            .iter()
            .find(|s| {
                s.name == "rpc.server"
                    && common::otel::attr(s, "rpc.method").map(|v| v.to_string())
                        == Some(method.into())
            })
            .unwrap_or_else(|| panic!("no server span of {method}"))
    };
    let attr = |key| common::otel::attr(served("zstd_echo"), key).map(|v| v.to_string());
    assert_eq!(attr("rpc.compression"), Some("zstd".into()));
    assert_eq!(attr("rpc.request.size"), Some(encoded.len().to_string()));
    assert_eq!(
        common::otel::attr(served("plain_echo"), "rpc.compression"),
        None
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn the_server_compresses_answers_with_its_own_option_even_for_plain_calls() {
    let (_traced, server, proxy, client) = measured().await;
    let payload = text(64 * 1024);
    // This handle turns compression off for its calls: the parameters go plain, but the
    // server's option for the entry (the attribute: zstd) still compresses the answer for a
    // client that decodes zstd.
    let off = client.with_options(GovernanceOverrides {
        compression: Some(Compression::Off),
        ..GovernanceOverrides::NONE
    });
    let (up, down) = counted(&proxy, "off", off.zstd_echo(payload.clone()), &payload).await;
    assert!(up > 64 * 1024 && down < 16 * 1024, "{up} up, {down} down");
    within("shutdown", server.shutdown()).await;
}

#[rpc::service(name = "t.Held")]
trait Held {
    /// Says it started, then waits for the test's gate before answering the text's length.
    async fn hold(&self, text: String) -> Result<u64, RpcError>;
}

struct Holding {
    started: tokio::sync::mpsc::UnboundedSender<u64>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Held for Holding {
    async fn hold(&self, text: String) -> Result<u64, RpcError> {
        let len = text.len() as u64;
        let _ = self.started.send(len);
        let _pass = self.gate.acquire().await.expect("gate open");
        Ok(len)
    }
}

const KIB: usize = 1024;

/// The text each `t.Held.hold` call carries: 200 KiB.
const HELD_TEXT: usize = 200 * KIB;

/// A `Holding` server with room for two calls of [`HELD_TEXT`] decompressed, not three
/// (`configure` sets the rest of its builder), a raw connection to it after its handshake, the
/// lengths its handlers report as they start, the gate that lets them end, and the encoded
/// arguments of a call.
struct Holder {
    server: rpc::ServerHandle,
    raw: RawConn,
    started: tokio::sync::mpsc::UnboundedReceiver<u64>,
    gate: Arc<tokio::sync::Semaphore>,
    plain: Bytes,
}

impl Holder {
    async fn serve(configure: impl FnOnce(rpc::ServerBuilder) -> rpc::ServerBuilder) -> Holder {
        let (started_tx, started) = tokio::sync::mpsc::unbounded_channel();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let server = configure(Server::builder())
            .add_service(HeldServer::new(Holding {
                started: started_tx,
                gate: gate.clone(),
            }))
            .max_frame_length(256 * KIB)
            .max_decompressed_bytes(512 * KIB)
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        let mut raw = RawConn::connect(server.local_addr()).await;
        raw.handshake().await;
        let plain = Codec::MsgPack
            .encode(&(text(HELD_TEXT).as_str(),))
            .expect("encode");
        Holder {
            server,
            raw,
            started,
            gate,
            plain,
        }
    }

    /// Sends call `id` of `t.Held.hold`, its arguments compressed with zstd or not.
    /// A holder with a rate limit of one call a second and a burst of 3, and calls 1 and 2
    /// held (compressed): what is left of the decompression budget takes no third.
    async fn two_held_of_a_burst_of_3() -> Holder {
        let mut held = Holder::serve(|b| b.rate_limit(1, 3)).await;
        for id in [1, 2] {
            held.send(id, true).await;
            within("a call within the budget starts", held.started.recv())
                .await
                .expect("started");
        }
        held
    }

    async fn send(&mut self, id: u64, compressed: bool) {
        let call = held_call(id, &self.plain, compressed);
        self.raw.send(call).await.expect("send");
    }
}

/// Call `id` of `t.Held.hold` with the encoded arguments `plain`, compressed with zstd or not.
fn held_call(id: u64, plain: &Bytes, compressed: bool) -> Kind {
    let (parameters, compression) = match compressed {
        true => (
            compress(Compression::Zstd, plain),
            Compression::Zstd.to_wire(),
        ),
        false => (plain.clone(), 0),
    };
    Kind::Invoke(RemoteInvokeMessage {
        message_id: id,
        service_entry_id: "t.Held.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters,
        compression,
        ..Default::default()
    })
}

#[tokio::test]
async fn compressed_calls_beyond_the_servers_decompression_budget_are_refused_515_until_others_end()
{
    let Holder {
        server,
        mut raw,
        mut started,
        gate,
        plain,
    } = Holder::serve(|b| b).await;
    let call = |id: u64, compressed: bool| held_call(id, &plain, compressed);
    let started_len = |n: Option<u64>| n.expect("a handler started");
    for id in [1, 2] {
        raw.send(call(id, true)).await.expect("send");
        let len = started_len(within("a call within the budget starts", started.recv()).await);
        assert_eq!(len, HELD_TEXT as u64);
    }
    // The third would hold 600 KiB in all: refused at once, without running.
    raw.send(call(3, true)).await.expect("send");
    let r = raw_result(&mut raw).await;
    assert_eq!((r.message_id, r.status_code), (3, 515), "{r:?}");
    assert!(
        r.exception_message
            .contains("budget for decompressed arguments")
            && r.exception_message.contains("t.Held.hold"),
        "{}",
        r.exception_message
    );
    assert!(started.try_recv().is_err(), "the refused call ran");
    // Refused by the size its header says, before any decompression: an LZ4 block saying
    // 200 KiB whose bytes are no LZ4 at all is refused 515 like the third (decompressed, it
    // would be answered 500 as unreadable).
    let mut says_200_kib = u32::try_from(200 * KIB).unwrap().to_le_bytes().to_vec();
    says_200_kib.extend_from_slice(&[0xff; 1000]);
    raw.send(Kind::Invoke(RemoteInvokeMessage {
        message_id: 6,
        service_entry_id: "t.Held.hold".into(),
        codec: Codec::MsgPack.to_wire(),
        parameters: says_200_kib.into(),
        compression: Compression::Lz4.to_wire(),
        ..Default::default()
    }))
    .await
    .expect("send");
    let r = raw_result(&mut raw).await;
    assert_eq!((r.message_id, r.status_code), (6, 515), "{r:?}");
    // Plain arguments take nothing from the budget: the same call uncompressed runs.
    raw.send(call(4, false)).await.expect("send");
    started_len(within("a plain call starts", started.recv()).await);
    // Once one compressed call ends, its share is back and another fits.
    gate.add_permits(1);
    let r = raw_result(&mut raw).await;
    assert_eq!((r.message_id, r.status_code), (1, 200), "{r:?}");
    raw.send(call(5, true)).await.expect("send");
    started_len(within("a compressed call starts again", started.recv()).await);
    gate.add_permits(3);
    let mut ids: Vec<u64> = Vec::new();
    for _ in 0..3 {
        let r = raw_result(&mut raw).await;
        assert_eq!(r.status_code, 200, "{r:?}");
        ids.push(r.message_id);
    }
    ids.sort_unstable();
    assert_eq!(ids, [2, 4, 5]);
    within("shutdown", server.shutdown()).await;
}
