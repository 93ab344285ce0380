//! Streams over real TCP. Server streaming: items in order then the end, flow control that
//! stops a producer whose consumer stops reading, cancellation by dropping the stream, errors
//! and the deadline mid-stream, many streams beside unary calls on one connection, a server
//! that dies mid-stream, failover before acceptance and no replay after, draining, the cap and
//! the adaptive limit counting open streams, and peers that do not stream. Client streaming: every item sent and
//! the answer back, flow control that stops the caller's producer when the handler stops
//! taking items, and an error in the caller's stream. Both ways: each item answered as it
//! comes, and dropping the answer stopping both directions.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{no_retry, raw_listener, recv_one, streaming_ack, within, DropSignal, RawConn};
use futures_util::future::join_all;
use rpc::crates::core::wire::{frame::Kind, Hello, RemoteInvokeMessage, StreamMode};
use rpc::crates::transport::DEFAULT_CLIENT_STREAM_WINDOW;
use rpc::{
    Client, Codec, GovernanceOverrides, InProcessRegistry, RpcError, RpcStream, Server,
    ServerBuilder, ServerHandle, StaticRegistry, StatusCode,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    pub seq: u32,
    pub label: String,
}

#[rpc::service(name = "t.Feed")]
pub trait Feed {
    /// `n` ticks, numbered from 0.
    async fn ticks(&self, n: u32) -> Result<RpcStream<Tick>, RpcError>;
    /// Numbers from 0 without end; counts how often its producer is asked for an item and
    /// reports when it is dropped.
    async fn endless(&self) -> Result<RpcStream<u64>, RpcError>;
    /// `n` numbers, then a business error.
    async fn fail_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError>;
    /// `n` numbers, then waits for ever (reports that it got there).
    async fn stall_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError>;
    /// Refuses at its set-up with a business error: nothing is streamed.
    async fn refuse(&self) -> Result<RpcStream<u32>, RpcError>;
    /// `n` numbers, then its producer panics.
    async fn panic_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError>;
    /// Panics in its set-up: no stream is made.
    async fn panic_at_set_up(&self) -> Result<RpcStream<u32>, RpcError>;
    /// A unary method beside the streams.
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    /// Client streaming: the sum of the caller's numbers, labelled.
    async fn sum(&self, label: String, numbers: RpcStream<u64>) -> Result<String, RpcError>;
    /// Client streaming: takes `n` numbers, reports it, then waits for ever.
    async fn take_then_wait(&self, n: u32, numbers: RpcStream<u64>) -> Result<u64, RpcError>;
    /// Client streaming: the keys of the caller's maps, counted (JSON cannot encode these
    /// keys: they are no strings).
    async fn count_keys(
        &self,
        maps: RpcStream<std::collections::BTreeMap<Vec<u8>, u8>>,
    ) -> Result<u64, RpcError>;
    /// Both ways: each line back with `prefix`, as it comes; reports when it is dropped.
    async fn chat(
        &self,
        prefix: String,
        lines: RpcStream<String>,
    ) -> Result<RpcStream<String>, RpcError>;
    /// Both ways, the caller's lines read by a task of the handler's own (as a tonic handler
    /// is often written) and forwarded to the answer; reports when that task ends.
    async fn relay(&self, lines: RpcStream<String>) -> Result<RpcStream<String>, RpcError>;
    /// Both ways: numbers from 0 without end, after reading the caller's lines to their end
    /// and holding them (`read`), or with the caller's lines dropped unread.
    async fn unheeding(
        &self,
        read: bool,
        lines: RpcStream<String>,
    ) -> Result<RpcStream<u64>, RpcError>;
    /// `n` items, each the caller's `tenant` attachment as the handler sees it while producing
    /// that item (`none` when it sees none).
    async fn tenants(&self, n: u32) -> Result<RpcStream<String>, RpcError>;
}

#[derive(Clone)]
struct Feeds {
    /// Items the `endless` producer was asked for.
    polls: Arc<AtomicU64>,
    /// Streams of `stall_after` set up.
    setups: Arc<AtomicU64>,
    dropped: mpsc::UnboundedSender<String>,
    stalled: mpsc::UnboundedSender<String>,
}

impl Feed for Feeds {
    async fn tenants(&self, n: u32) -> Result<RpcStream<String>, RpcError> {
        Ok(RpcStream::new(futures_util::StreamExt::map(
            futures_util::stream::iter(0..n),
            |_| rpc::RpcContext::get("tenant").unwrap_or_else(|| "none".into()),
        )))
    }

    async fn ticks(&self, n: u32) -> Result<RpcStream<Tick>, RpcError> {
        Ok(RpcStream::iter((0..n).map(|seq| Tick {
            seq,
            label: format!("tick-{seq}"),
        })))
    }

    async fn endless(&self) -> Result<RpcStream<u64>, RpcError> {
        let polls = self.polls.clone();
        let guard = DropSignal::new("endless", self.dropped.clone());
        Ok(RpcStream::new(futures_util::stream::unfold(
            (0u64, guard),
            move |(n, guard)| {
                polls.fetch_add(1, Ordering::SeqCst);
                std::future::ready(Some((n, (n + 1, guard))))
            },
        )))
    }

    async fn fail_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError> {
        let items = (0..n)
            .map(Ok)
            .chain(std::iter::once(Err(RpcError::business(format!(
                "ran out after {n}"
            )))));
        Ok(RpcStream::try_new(futures_util::stream::iter(items)))
    }

    async fn stall_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError> {
        self.setups.fetch_add(1, Ordering::SeqCst);
        let stalled = self.stalled.clone();
        let guard = DropSignal::new("stall_after", self.dropped.clone());
        let rest = futures_util::stream::once(async move {
            let _guard = guard;
            let _ = stalled.send("stalled".into());
            std::future::pending::<u32>().await
        });
        Ok(RpcStream::new(futures_util::StreamExt::chain(
            futures_util::stream::iter(0..n),
            rest,
        )))
    }

    async fn refuse(&self) -> Result<RpcStream<u32>, RpcError> {
        Err(RpcError::business("no stream for you"))
    }

    async fn panic_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError> {
        Ok(RpcStream::iter((0..=n).inspect(move |&i| {
            assert!(i < n, "the feed broke after {n} items");
        })))
    }

    async fn panic_at_set_up(&self) -> Result<RpcStream<u32>, RpcError> {
        panic!("the feed could not be set up")
    }

    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }

    async fn sum(&self, label: String, mut numbers: RpcStream<u64>) -> Result<String, RpcError> {
        let (mut total, mut count) = (0u64, 0u64);
        while let Some(n) = numbers.next().await {
            total += n?;
            count += 1;
        }
        Ok(format!("{label}={total} from {count} items"))
    }

    async fn chat(
        &self,
        prefix: String,
        lines: RpcStream<String>,
    ) -> Result<RpcStream<String>, RpcError> {
        let guard = DropSignal::new("chat", self.dropped.clone());
        Ok(lines.map_items(move |line| {
            let _ = &guard;
            Ok(format!("{prefix}{line}"))
        }))
    }

    async fn relay(&self, mut lines: RpcStream<String>) -> Result<RpcStream<String>, RpcError> {
        let (tx, rx) = mpsc::channel::<String>(1);
        let guard = DropSignal::new("relay reader", self.dropped.clone());
        tokio::spawn(async move {
            let _guard = guard;
            while let Some(Ok(line)) = lines.next().await {
                if tx.send(line).await.is_err() {
                    return;
                }
            }
        });
        Ok(RpcStream::new(futures_util::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|line| (line, rx)) },
        )))
    }

    async fn unheeding(
        &self,
        read: bool,
        lines: RpcStream<String>,
    ) -> Result<RpcStream<u64>, RpcError> {
        // (Unread lines are dropped here, with the set-up.)
        let lines = read.then_some(lines);
        Ok(RpcStream::new(futures_util::stream::unfold(
            (lines, false, 0u64),
            |(mut lines, mut read, n)| async move {
                if let (Some(lines), false) = (&mut lines, read) {
                    while let Some(Ok(_)) = lines.next().await {}
                    read = true;
                }
                Some((n, (lines, read, n + 1)))
            },
        )))
    }

    async fn count_keys(
        &self,
        mut maps: RpcStream<std::collections::BTreeMap<Vec<u8>, u8>>,
    ) -> Result<u64, RpcError> {
        let mut keys = 0;
        while let Some(map) = maps.next().await {
            keys += map?.len() as u64;
        }
        Ok(keys)
    }

    async fn take_then_wait(&self, n: u32, mut numbers: RpcStream<u64>) -> Result<u64, RpcError> {
        let _guard = DropSignal::new("take_then_wait", self.dropped.clone());
        for _ in 0..n {
            numbers.next().await.expect("an item")?;
        }
        let _ = self.stalled.send(format!("took {n}"));
        std::future::pending::<()>().await;
        Ok(0)
    }
}

struct Probe {
    polls: Arc<AtomicU64>,
    setups: Arc<AtomicU64>,
    dropped: mpsc::UnboundedReceiver<String>,
    stalled: mpsc::UnboundedReceiver<String>,
}

impl Probe {
    /// Waits until the server dropped the handler's stream of `method` (its caller went, or
    /// its deadline passed).
    async fn dropped(&mut self, method: &str) {
        let dropped = recv_one("the server dropped the handler's stream", &mut self.dropped);
        assert_eq!(dropped.await, method);
    }
}

async fn serve(reg: &InProcessRegistry, cap: usize) -> (ServerHandle, Probe) {
    serve_with(reg, cap, false).await
}

/// [`serve`], with every entry's cap an adaptive limit when `adaptive`.
async fn serve_with(reg: &InProcessRegistry, cap: usize, adaptive: bool) -> (ServerHandle, Probe) {
    serve_configured(reg, |b| {
        b.max_concurrency(cap).adaptive_concurrency(adaptive)
    })
    .await
}

/// The feed server on `reg`, its builder's options set by `configure`, and its probe.
async fn serve_configured(
    reg: &InProcessRegistry,
    configure: impl FnOnce(ServerBuilder) -> ServerBuilder,
) -> (ServerHandle, Probe) {
    let (dropped_tx, dropped) = mpsc::unbounded_channel();
    let (stalled_tx, stalled) = mpsc::unbounded_channel();
    let polls = Arc::new(AtomicU64::new(0));
    let setups = Arc::new(AtomicU64::new(0));
    let server = configure(Server::builder().registry(reg.clone()))
        .add_service(FeedServer::new(Feeds {
            polls: polls.clone(),
            setups: setups.clone(),
            dropped: dropped_tx,
            stalled: stalled_tx,
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (
        server,
        Probe {
            polls,
            setups,
            dropped,
            stalled,
        },
    )
}

fn timeout_of(ms: u64) -> GovernanceOverrides {
    GovernanceOverrides {
        timeout_ms: Some(ms),
        retry_times: Some(0),
        ..GovernanceOverrides::NONE
    }
}

/// What the feed echoes of `text`: a unary call, to show the connection and the server still
/// answer (a failed call fails the test).
async fn echoed(f: &FeedClient, text: impl Into<String>) -> String {
    within("echo", f.echo(text.into())).await.expect("echo")
}

/// The stream's next item, which must come within the time limit of `what` and be no error.
async fn next_item<T: Send + 'static>(what: &str, s: &mut RpcStream<T>) -> T {
    within(what, s.next())
        .await
        .unwrap_or_else(|| panic!("{what}: the stream ended instead"))
        .unwrap_or_else(|e| panic!("{what}: an error item instead: {e}"))
}

/// The stream's next item, which must come within the time limit of `what` and be an error:
/// how the stream ended.
async fn next_error<T: Send + 'static + std::fmt::Debug>(
    what: &str,
    s: &mut RpcStream<T>,
) -> RpcError {
    match within(what, s.next()).await {
        Some(Err(e)) => e,
        other => panic!("{what}: expected an error item, got {other:?}"),
    }
}

/// A connection to `server` made by hand, its handshake done offering streams with a window
/// of 64 items.
async fn raw_feed(server: &ServerHandle) -> RawConn {
    let mut raw = RawConn::connect(server.local_addr()).await;
    raw.send(Kind::Hello(Hello {
        protocol_version: 1,
        client_id: "raw-feed".into(),
        streams: true,
        stream_window: 64,
        ..Default::default()
    }))
    .await
    .expect("hello");
    assert!(matches!(raw.recv().await, Some(Kind::HelloAck(a)) if a.streams));
    raw
}

fn feed(reg: &InProcessRegistry) -> FeedClient {
    FeedClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(FeedClient::SERVICE_ID, no_retry())
            .build(),
    )
}

#[tokio::test]
async fn server_streaming_delivers_n_items_in_order_then_ends() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    for codec in [Codec::MsgPack, Codec::Json] {
        let f = FeedClient::new(Client::builder().registry(reg.clone()).codec(codec).build());
        let n = 3 * DEFAULT_CLIENT_STREAM_WINDOW + 7;
        let mut s = within("open", f.ticks(n)).await.expect("ticks");
        let mut seen = Vec::new();
        while let Some(item) = within("next tick", s.next()).await {
            seen.push(item.expect("a tick"));
        }
        let expected: Vec<Tick> = (0..n)
            .map(|seq| Tick {
                seq,
                label: format!("tick-{seq}"),
            })
            .collect();
        assert_eq!(seen, expected, "{codec:?}");
        assert!(s.next().await.is_none(), "nothing after the end");
        // An empty stream ends at once.
        let empty = within("open", f.ticks(0)).await.expect("ticks(0)");
        assert!(within("collect", empty.collect_all())
            .await
            .expect("ok")
            .is_empty());
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_consumer_that_stops_reading_stops_the_producer_at_the_window() {
    const WINDOW: u32 = 8;
    let reg = InProcessRegistry::new();
    let (server, probe) = serve(&reg, 50).await;
    let client = Client::builder()
        .registry(reg.clone())
        .stream_window(WINDOW)
        .build();
    let f = FeedClient::new(client);
    let mut s = within("open", f.endless()).await.expect("endless");
    // Fewer than half the window taken: no credit goes back to the server.
    for want in 0..3u64 {
        assert_eq!(next_item("item", &mut s).await, want);
    }
    // The producer fills the window the client announced, and is not asked for more: wait
    // until it got there, then let the connection carry other traffic (round trips through
    // both sides' tasks) before looking again.
    within("the producer reaches the window", async {
        while probe.polls.load(Ordering::SeqCst) < u64::from(WINDOW) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    for i in 0..20 {
        assert_eq!(echoed(&f, format!("ping {i}")).await, format!("ping {i}"));
    }
    assert_eq!(
        probe.polls.load(Ordering::SeqCst),
        u64::from(WINDOW),
        "a stopped consumer holds the producer at the window"
    );
    // Reading on, the stream continues in order, and the producer stays within the window of
    // what was taken.
    for want in 3..200u64 {
        assert_eq!(next_item("item", &mut s).await, want);
        let polls = probe.polls.load(Ordering::SeqCst);
        assert!(
            polls <= want + 1 + u64::from(WINDOW),
            "{polls} items produced when {} were taken",
            want + 1
        );
    }
    drop(s);
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn dropping_the_stream_drops_the_handlers_stream_and_frees_its_slot() {
    let reg = InProcessRegistry::new();
    // A cap of 1: the open stream holds it until it ends.
    let (server, mut probe) = serve(&reg, 1).await;
    let f = feed(&reg);
    let mut s = within("open", f.endless()).await.expect("endless");
    assert_eq!(next_item("item", &mut s).await, 0);
    let over = within("echo at the cap", f.echo("x".into())).await;
    assert_eq!(
        over.expect_err("the open stream counts against the cap")
            .code(),
        StatusCode::OverflowMaxServerHandle
    );
    drop(s);
    probe.dropped("endless").await;
    // The cap's slot is free again.
    assert_eq!(echoed(&f, "after").await, "after");
    within("shutdown", server.shutdown()).await;
}

/// With adaptive concurrency (every entry's cap an adaptive limit), an open stream holds a
/// slot of its entry's limit until it ends, as it holds the cap's without. The cap (40) is
/// above the limit (20 before anything is measured; streams are not): the refusal is the
/// limit's.
#[tokio::test]
async fn an_open_stream_holds_a_slot_of_its_entrys_adaptive_limit() {
    const LIMIT: usize = 20;
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve_with(&reg, 2 * LIMIT, true).await;
    let f = feed(&reg);
    let mut open = Vec::new();
    for _ in 0..LIMIT {
        let mut s = within("open", f.endless()).await.expect("endless");
        assert_eq!(next_item("item", &mut s).await, 0);
        open.push(s);
    }
    let over = within("a stream over the limit", f.endless()).await;
    let e = over.expect_err("the open streams hold every slot of the entry's limit");
    assert_eq!(e.code(), StatusCode::OverflowMaxServerHandle, "{e}");
    assert!(
        e.message().contains(&format!(
            "its adaptive limit of {LIMIT} for Default calls now (the limit is {LIMIT}"
        )),
        "{e}"
    );
    drop(open.pop());
    probe.dropped("endless").await;
    // The slot is free again: another stream opens.
    let mut again = within("open again", f.endless()).await.expect("endless");
    assert_eq!(next_item("item", &mut again).await, 0);
    drop((again, open));
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_server_error_mid_stream_ends_it_with_that_error_after_the_items_before_it() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let mut s = within("open", f.fail_after(5)).await.expect("fail_after");
    for want in 0..5 {
        assert_eq!(next_item("item", &mut s).await, want);
    }
    let e = next_error("the error", &mut s).await;
    assert_eq!(e.code(), StatusCode::BusinessError);
    assert!(e.message().contains("ran out after 5"), "{e}");
    assert!(
        within("end", s.next()).await.is_none(),
        "nothing after the error"
    );

    // A set-up that fails is a refusal: the call's error, no stream.
    let e = within("refuse", f.refuse())
        .await
        .expect_err("refused at its set-up");
    assert_eq!(e.code(), StatusCode::BusinessError);
    assert!(e.message().contains("no stream for you"), "{e}");
    within("shutdown", server.shutdown()).await;
}

/// The panic comes in the middle of a run of items the server assembles into one frame (2500
/// items: more than one poll's turn, at most 1024), after the panicking item's key was
/// written.
#[tokio::test]
async fn a_producer_panicking_mid_stream_ends_it_with_520_after_every_item_before_it() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let mut s = within("open", f.panic_after(2500))
        .await
        .expect("panic_after");
    for want in 0..2500 {
        assert_eq!(next_item("item", &mut s).await, want);
    }
    let e = next_error("the panic", &mut s).await;
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    assert!(
        within("end", s.next()).await.is_none(),
        "nothing after the error"
    );
    // The connection and the server carry on.
    assert_eq!(echoed(&f, "still here").await, "still here");
    let items = within("again", f.ticks(3))
        .await
        .expect("ticks")
        .collect_all();
    assert_eq!(within("ticks", items).await.expect("items").len(), 3);
    within("shutdown", server.shutdown()).await;
}

#[tokio::test(start_paused = true)]
async fn the_deadline_ends_the_stream_with_a_timeout_after_the_items_that_arrived() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 50).await;
    let f = FeedClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(FeedClient::SERVICE_ID, timeout_of(60_000))
            .build(),
    );
    let mut s = within("open", f.stall_after(3)).await.expect("stall_after");
    for want in 0..3 {
        assert_eq!(next_item("item", &mut s).await, want);
    }
    // The handler waits for ever now; the deadline (on the paused clock) ends the stream.
    assert_eq!(recv_one("stalled", &mut probe.stalled).await, "stalled");
    tokio::time::advance(Duration::from_secs(60)).await;
    let e = next_error("the timeout", &mut s).await;
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    assert!(s.next().await.is_none(), "nothing after the timeout");
    probe.dropped("stall_after").await;
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn many_streams_share_one_connection_with_unary_calls_and_a_stalled_one() {
    let reg = InProcessRegistry::new();
    let (server, probe) = serve(&reg, 200).await;
    // One connection per endpoint (the default): every stream and call below shares it.
    let client = Client::builder()
        .registry(reg.clone())
        .connections_per_endpoint(1)
        .stream_window(4)
        .override_options(FeedClient::SERVICE_ID, no_retry())
        .build();
    let f = FeedClient::new(client);
    // A stream nobody reads: it stalls at its window and must stall nothing else.
    let stalled = within("open", f.endless()).await.expect("endless");
    let streams = (0..64u32).map(|k| {
        let f = f.clone();
        async move {
            let n = 50 + k;
            let items = within("collect", f.ticks(n).await.expect("ticks").collect_all())
                .await
                .expect("complete");
            let seqs: Vec<u32> = items.iter().map(|t| t.seq).collect();
            assert_eq!(seqs, (0..n).collect::<Vec<_>>(), "stream {k} in order");
        }
    });
    let unary = (0..64u32).map(|k| {
        let f = f.clone();
        async move {
            assert_eq!(
                f.echo(format!("u{k}")).await.expect("echo"),
                format!("u{k}")
            );
        }
    });
    within("everything", async {
        tokio::join!(join_all(streams), join_all(unary));
    })
    .await;
    assert!(
        probe.polls.load(Ordering::SeqCst) <= 4,
        "the unread stream stayed within its window"
    );
    drop(stalled);
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_server_that_dies_mid_stream_ends_it_with_an_error_saying_how_many_items_arrived() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let mut s = within("open", f.stall_after(3)).await.expect("stall_after");
    for want in 0..3 {
        assert_eq!(next_item("item", &mut s).await, want);
    }
    assert_eq!(recv_one("stalled", &mut probe.stalled).await, "stalled");
    server.abort();
    let e = next_error("the failure", &mut s).await;
    assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
    assert!(e.message().contains("after 3 items arrived"), "{e}");
    assert!(e.is_maybe_delivered(), "{e}");
    assert!(s.next().await.is_none());
}

/// The set-up passes the entry's governance: a refusal (515 at a full cap) fails over to the
/// other endpoint; once a stream was accepted it is never opened again, not even when its
/// server dies mid-stream.
#[tokio::test]
async fn a_refused_set_up_fails_over_and_an_accepted_stream_is_never_replayed() {
    let reg = InProcessRegistry::new();
    let (full, full_probe) = serve(&reg, 1).await;
    let (free, mut free_probe) = serve(&reg, 50).await;
    // Another client holds the only slot of `full` with a stream.
    let holder = FeedClient::new(
        Client::builder()
            .registry(StaticRegistry::new([full.local_addr().to_string()]))
            .build(),
    );
    let held = within("hold", holder.endless()).await.expect("endless");
    let f = FeedClient::new(Client::builder().registry(reg.clone()).build());
    let mut refusals = full.events().subscribe();
    let mut open = Vec::new();
    for _ in 0..4 {
        // Round robin: at least every other set-up tries `full` first, is refused, and goes
        // to `free`.
        let mut s = within("open", f.stall_after(2)).await.expect("fails over");
        for want in 0..2 {
            assert_eq!(next_item("item", &mut s).await, want);
        }
        assert_eq!(
            recv_one("stalled", &mut free_probe.stalled).await,
            "stalled"
        );
        open.push(s);
    }
    assert_eq!(free_probe.setups.load(Ordering::SeqCst), 4);
    assert_eq!(
        full_probe.setups.load(Ordering::SeqCst),
        0,
        "refused before its handler"
    );
    // `full` was tried, and refused at its cap: the set-ups that reached `free` through it
    // failed over.
    let mut overflows = 0;
    while let Ok(e) = refusals.try_recv() {
        overflows += usize::from(e.kind == rpc::crates::governance::events::EventKind::Overflow);
    }
    assert!(overflows >= 1, "no set-up tried `full` first");
    // `full` has room now; `free` dies: the streams end with the failure, none is repeated.
    drop(held);
    free.abort();
    for mut s in open {
        let e = next_error("the failure", &mut s).await;
        assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
        assert!(e.message().contains("after 2 items arrived"), "{e}");
    }
    assert_eq!(
        full_probe.setups.load(Ordering::SeqCst),
        0,
        "no stream was opened again"
    );
    within("shutdown", full.shutdown()).await;
}

/// A graceful shutdown lets open streams run on until the drain deadline, then ends those
/// still open with a status saying so.
#[tokio::test(start_paused = true)]
async fn draining_lets_open_streams_finish_until_the_drain_deadline() {
    let reg = InProcessRegistry::new();
    let (server, probe) = serve_configured(&reg, |b| b.drain_timeout(Duration::from_secs(2))).await;
    let (mut dropped, mut stalled) = (probe.dropped, probe.stalled);
    let f = FeedClient::new(
        Client::builder()
            .registry(reg.clone())
            .stream_window(4)
            .override_options(FeedClient::SERVICE_ID, timeout_of(0))
            .build(),
    );
    let mut long = within("open", f.ticks(100)).await.expect("ticks");
    assert_eq!(next_item("tick", &mut long).await.seq, 0);
    let mut stuck = within("open", f.stall_after(1)).await.expect("stall_after");
    assert_eq!(next_item("item", &mut stuck).await, 0);
    assert_eq!(recv_one("stalled", &mut stalled).await, "stalled");
    let stopping = tokio::spawn(server.shutdown());
    // The long stream runs to its end while the server drains (its window of 4 means most of
    // it is produced after the shutdown began).
    for want in 1..100 {
        assert_eq!(next_item("tick", &mut long).await.seq, want);
    }
    assert!(within("end", long.next()).await.is_none(), "complete");
    // The stuck one is ended at the drain deadline.
    let e = next_error("the drain deadline", &mut stuck).await;
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    assert!(e.message().contains("drain deadline"), "{e}");
    assert_eq!(recv_one("dropped", &mut dropped).await, "stall_after");
    within("shutdown", stopping).await.expect("shutdown");
}

#[tokio::test]
async fn client_streaming_sends_every_item_and_gets_the_answer() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    for codec in [Codec::MsgPack, Codec::Json] {
        let f = FeedClient::new(Client::builder().registry(reg.clone()).codec(codec).build());
        let answer = within("sum", f.sum("total".into(), RpcStream::iter(1..=1000u64)))
            .await
            .expect("sum");
        assert_eq!(answer, "total=500500 from 1000 items", "{codec:?}");
        let none = within("sum", f.sum("none".into(), RpcStream::empty()))
            .await
            .expect("sum of nothing");
        assert_eq!(none, "none=0 from 0 items");
    }
    within("shutdown", server.shutdown()).await;
}

/// A caller's stream item longer than the server reads (its frame limit, said in the
/// handshake) fails the stream at the client, unsent, and the connection goes on serving the
/// client's other calls: sent, the item would have made the server close the connection.
#[tokio::test]
async fn an_item_over_the_servers_frame_limit_fails_at_the_client_unsent() {
    const LIMIT: usize = 64 * 1024;
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve_configured(&reg, |b| b.max_frame_length(LIMIT)).await;
    let f = feed(&reg);
    let lines = RpcStream::iter(["small".to_string(), "x".repeat(100_000)]);
    let mut answers = within("chat", f.chat("> ".into(), lines))
        .await
        .expect("opened");
    let e = loop {
        match within("an answer", answers.next()).await {
            Some(Ok(_)) => continue,
            Some(Err(e)) => break e,
            None => panic!("the stream ended without the item's failure"),
        }
    };
    assert!(
        e.message()
            .contains(&format!("over the server's limit of {LIMIT}"))
            && e.message().contains("not sent"),
        "{e}"
    );
    let ticks = within("ticks", f.ticks(2)).await.expect("ticks");
    assert_eq!(
        within("the ticks", ticks.collect_all())
            .await
            .expect("ticks")
            .len(),
        2
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_handler_that_stops_taking_items_stops_the_callers_producer_at_the_window() {
    const WINDOW: u32 = 8;
    let reg = InProcessRegistry::new();
    let (server, probe) = serve_configured(&reg, |b| b.stream_window(WINDOW)).await;
    let (mut dropped, mut stalled) = (probe.dropped, probe.stalled);
    let f = feed(&reg);
    // The caller's producer: endless, counting the items it is asked for.
    let produced = Arc::new(AtomicU64::new(0));
    let counter = produced.clone();
    let numbers = RpcStream::new(futures_util::stream::unfold(0u64, move |n| {
        counter.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Some((n, n + 1)))
    }));
    let call = tokio::spawn({
        let f = f.clone();
        async move { f.take_then_wait(3, numbers).await }
    });
    // The handler took 3 (fewer than half the server's window: no credit went back).
    assert_eq!(recv_one("took", &mut stalled).await, "took 3");
    within("the producer reaches the window", async {
        while produced.load(Ordering::SeqCst) < u64::from(WINDOW) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    for i in 0..20 {
        assert_eq!(echoed(&f, format!("e{i}")).await, format!("e{i}"));
    }
    assert_eq!(
        produced.load(Ordering::SeqCst),
        u64::from(WINDOW),
        "a handler that stops taking items holds the caller's producer at the window"
    );
    // Giving up on the call drops the handler.
    call.abort();
    assert_eq!(recv_one("dropped", &mut dropped).await, "take_then_wait");
    within("shutdown", server.shutdown()).await;
}

/// An item of the caller's stream its codec cannot encode is the caller's own error (500, as
/// arguments that do not encode), said of the request stream: nothing failed at the server.
#[tokio::test]
async fn a_request_stream_item_that_does_not_encode_is_the_callers_error() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let json = Client::builder()
        .registry(reg.clone())
        .codec(Codec::Json)
        .override_options(FeedClient::SERVICE_ID, no_retry())
        .build();
    let f = FeedClient::new(json);
    let maps = (0..2u8).map(|k| std::collections::BTreeMap::from([(vec![k], k)]));
    // MessagePack takes the keys: the method counts them.
    let msgpack = FeedClient::new(Client::builder().registry(reg.clone()).build());
    let counted = within("count", msgpack.count_keys(RpcStream::iter(maps.clone())));
    assert_eq!(counted.await.expect("counted"), 2);
    let e = within("count", f.count_keys(RpcStream::iter(maps)))
        .await
        .expect_err("JSON cannot encode the keys");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message()
            .contains("could not encode an item of the request stream of t.Feed.count_keys"),
        "{e}"
    );
    assert_eq!(echoed(&f, "ok").await, "ok");
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn an_error_in_the_callers_stream_ends_the_call_with_it() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let numbers = RpcStream::try_new(futures_util::stream::iter(vec![
        Ok(1u64),
        Ok(2),
        Err(RpcError::business("the source broke")),
        Ok(3),
    ]));
    let e = within("sum", f.sum("broken".into(), numbers))
        .await
        .expect_err("the caller's error");
    assert_eq!(e.code(), StatusCode::BusinessError);
    assert!(e.message().contains("the source broke"), "{e}");
    // The connection and the server are fine.
    assert_eq!(echoed(&f, "ok").await, "ok");
    within("shutdown", server.shutdown()).await;
}

/// Both ways at once: each line is answered before the next is sent (the caller's stream
/// waits for the answer), so neither side batches; the caller's end ends the answer.
#[tokio::test]
async fn bidirectional_streaming_answers_each_item_as_it_comes() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let (lines_tx, lines_rx) = mpsc::unbounded_channel::<String>();
    let lines = RpcStream::new(futures_util::stream::unfold(
        lines_rx,
        |mut rx| async move { rx.recv().await.map(|line| (line, rx)) },
    ));
    let mut replies = within("open", f.chat("> ".into(), lines))
        .await
        .expect("chat");
    for i in 0..50 {
        lines_tx.send(format!("line {i}")).expect("send");
        let reply = next_item("reply", &mut replies).await;
        assert_eq!(reply, format!("> line {i}"));
    }
    drop(lines_tx);
    assert!(
        within("the end", replies.next()).await.is_none(),
        "the caller's end ends the answer"
    );
    probe.dropped("chat").await;

    // Dropping the answer stops both directions: the handler's stream is dropped.
    let endless = RpcStream::iter((0u64..).map(|n| n.to_string()));
    let mut replies = within("open", f.chat("".into(), endless))
        .await
        .expect("chat");
    assert_eq!(next_item("reply", &mut replies).await, "0");
    drop(replies);
    probe.dropped("chat").await;
    assert_eq!(echoed(&f, "ok").await, "ok");
    within("shutdown", server.shutdown()).await;
}

/// The caller's items panic (its stream, or an item's encoding) after the first: the request
/// stream ends with an error, and so does the answer, instead of both waiting for ever.
#[tokio::test]
async fn a_callers_request_stream_that_panics_ends_the_stream_with_an_error() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let lines = RpcStream::new(futures_util::StreamExt::chain(
        futures_util::stream::iter(["a".to_string()]),
        futures_util::stream::once(async { panic!("the caller's lines fail") }),
    ));
    let mut replies = within("open", f.chat("> ".into(), lines))
        .await
        .expect("chat");
    assert_eq!(next_item("reply", &mut replies).await, "> a");
    let e = next_error("the end", &mut replies).await;
    assert!(e.message().contains("panicked"), "{e}");
    assert_eq!(echoed(&f, "ok").await, "ok");
    within("shutdown", server.shutdown()).await;
}

/// A handler reading the caller's stream in a task of its own: when the call ends (here the
/// caller drops its answer, and its request stream never ends), that task's read ends too,
/// with an error, instead of waiting for ever for items that will not come.
#[tokio::test]
async fn a_request_stream_read_by_a_task_of_its_own_ends_when_the_call_ends() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let lines = RpcStream::new(futures_util::StreamExt::chain(
        futures_util::stream::iter(["a".to_string()]),
        futures_util::stream::pending(),
    ));
    let mut replies = within("open", f.relay(lines)).await.expect("relay");
    assert_eq!(next_item("reply", &mut replies).await, "a");
    drop(replies);
    probe.dropped("relay reader").await;
    assert_eq!(echoed(&f, "ok").await, "ok");
    within("shutdown", server.shutdown()).await;
}

/// A bidirectional caller's error item ends the stream with that error though the handler
/// would produce for ever: once the handler read it (its lines read to their end and held),
/// or at once when the handler dropped its lines unread. Before, the error waited for the
/// handler to end on its own, and the stream went on, holding its slot under the cap.
#[tokio::test]
async fn a_callers_error_item_ends_a_stream_whose_handler_goes_on_producing() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    // A window of 4 too: each poll of the producer then runs out of credit before its turn
    // is over, and the end must come at a wait for credit.
    let narrow = FeedClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(FeedClient::SERVICE_ID, no_retry())
            .stream_window(4)
            .build(),
    );
    let f = feed(&reg);
    for (read, f) in [(true, &f), (false, &f), (true, &narrow), (false, &narrow)] {
        let lines = RpcStream::try_new(futures_util::stream::iter([
            Ok("a".to_string()),
            Err(RpcError::business("stop")),
        ]));
        let mut numbers = within("open", f.unheeding(read, lines))
            .await
            .expect("open");
        let mut expected = 0u64;
        let end = within("the caller's error", async {
            // (Bounded: the numbers come until the server reads the caller's end.)
            while expected < 10_000_000 {
                match numbers.next().await {
                    Some(Ok(n)) => {
                        assert_eq!(n, expected, "read {read}: the numbers in order");
                        expected += 1;
                    }
                    Some(Err(e)) => return e,
                    None => panic!("read {read}: the stream completed without the caller's error"),
                }
            }
            panic!("read {read}: no end after {expected} numbers")
        })
        .await;
        assert_eq!(end.code(), StatusCode::BusinessError, "read {read}: {end}");
        assert!(end.message().contains("stop"), "read {read}: {end}");
    }
    assert_eq!(echoed(&f, "ok").await, "ok");
    within("shutdown", server.shutdown()).await;
}

/// `t.Feed` as a client built from another definition sees it: `endless` streams text.
mod feed_as_text {
    use rpc::{RpcError, RpcStream};

    #[rpc::service(name = "t.Feed")]
    pub trait Feed {
        async fn endless(&self) -> Result<RpcStream<String>, RpcError>;
    }
}

/// An item the client cannot decode (its definition of the method differs from the
/// server's) ends the stream on both sides: the server is told to stop, and its slot under
/// the cap is free while the caller still holds the stream; the call is recorded as ended
/// with that error. Before, the server went on producing up to the client's window, holding
/// the slot, and the call was recorded as cancelled once dropped.
#[tokio::test]
async fn an_item_the_client_cannot_decode_ends_the_stream_on_both_sides() {
    use feed_as_text::Feed as _;
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 1).await;
    let client = Client::builder()
        .registry(reg.clone())
        .override_options(FeedClient::SERVICE_ID, no_retry())
        .build();
    let mut records = common::observe_calls(&client);
    let as_text = feed_as_text::FeedClient::new(client);
    let mut texts = within("open", as_text.endless()).await.expect("open");
    let e = match within("the first item", texts.next()).await {
        Some(Err(e)) => e,
        other => panic!("expected a decoding error, got {other:?}"),
    };
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(e.message().contains("could not decode"), "{e}");
    // The server let the stream go though the caller holds it: its slot (the cap is 1) serves
    // another call.
    probe.dropped("endless").await;
    assert_eq!(echoed(&feed(&reg), "ok").await, "ok");
    let (entry, status, outcome) = within("the call's record", records.recv())
        .await
        .expect("a record");
    assert_eq!(entry, "t.Feed.endless");
    assert_eq!(
        (status, outcome.as_str()),
        (Some(StatusCode::FrameworkError), "error")
    );
    drop(texts);
    within("shutdown", server.shutdown()).await;
}

/// A caller's item that does not decode as the method's item type is the caller's fault, as
/// arguments that do not decode are: the handler reads a validation error (1001) naming the
/// request stream, and the call ends with it. Before, it read 500 "could not decode the
/// result", the words for a client whose service definition differs from its server's.
#[tokio::test]
async fn a_callers_item_that_does_not_decode_is_a_validation_error() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let mut raw = raw_feed(&server).await;
    raw.open_stream(1, "t.Feed.sum", &("n",), StreamMode::Client)
        .await;
    raw.recv_acceptance(1).await;
    // A string where the method takes numbers.
    let item = rpc::Codec::MsgPack.encode(&"seven").expect("encode");
    raw.send_item(1, item, 0).await;
    raw.end_stream(1, 200, "").await;
    let end = raw.recv_end().await;
    assert_eq!((end.message_id, end.status_code), (1, 1001), "{end:?}");
    assert!(
        end.exception_message
            .contains("request stream of t.Feed.sum"),
        "{}",
        end.exception_message
    );
    within("shutdown", server.shutdown()).await;
}

/// An item sent to a server stream (which takes none) ends it with 500 at once, even while
/// its producer is waiting (here: after its last item), not when the producer next yields.
#[tokio::test]
async fn an_item_sent_to_a_waiting_server_stream_ends_it_at_once() {
    let reg = InProcessRegistry::new();
    let (server, mut probe) = serve(&reg, 50).await;
    let mut raw = raw_feed(&server).await;
    raw.open_stream(1, "t.Feed.stall_after", &(2u32,), StreamMode::Server)
        .await;
    let mut items = 0;
    while items < 2 {
        match within("the stream's items", raw.recv()).await {
            Some(Kind::StreamCredit(_)) => {}
            Some(Kind::StreamItem(_)) => items += 1,
            other => panic!("expected the stream's items, got {other:?}"),
        }
    }
    // The producer now waits for ever: only the violation can end the stream.
    raw.send_item(1, bytes::Bytes::from_static(b"\x01"), 0)
        .await;
    let end = match within("the stream's end", raw.recv()).await {
        Some(Kind::Result(end)) => end,
        other => panic!("expected the stream's end, got {other:?}"),
    };
    assert_eq!((end.message_id, end.status_code), (1, 500), "{end:?}");
    assert!(
        end.exception_message.contains(
            "protocol violation: the client sent stream items to a stream that takes none"
        ),
        "{end:?}"
    );
    probe.dropped("stall_after").await;
    within("shutdown", server.shutdown()).await;
}

/// A client that did not offer streams in its Hello (an older client) keeps working for unary
/// calls, and a stream it opens anyway is refused without running.
#[tokio::test]
async fn a_client_without_streams_keeps_working_for_unary_calls() {
    let reg = InProcessRegistry::new();
    let (server, probe) = serve(&reg, 50).await;
    let mut raw = RawConn::connect(server.local_addr()).await;
    let ack = raw.handshake().await;
    assert!(!ack.streams, "no streams offered, none accepted");
    let invoke = |id: u64, entry: &str, params: bytes::Bytes, mode: StreamMode| {
        Kind::Invoke(RemoteInvokeMessage {
            message_id: id,
            service_entry_id: entry.into(),
            parameters: params,
            stream_mode: mode as i32,
            ..Default::default()
        })
    };
    let hi = Codec::MsgPack.encode(&("hi",)).expect("encode");
    raw.send(invoke(1, "t.Feed.echo", hi, StreamMode::Unary))
        .await
        .expect("send");
    match raw.recv().await {
        Some(Kind::Result(r)) => {
            assert_eq!((r.message_id, r.status_code), (1, 200));
            let text: String = Codec::MsgPack.decode(&r.result).expect("decode");
            assert_eq!(text, "hi");
        }
        other => panic!("expected the answer, got {other:?}"),
    }
    let none = Codec::MsgPack.encode(&()).expect("encode");
    raw.send(invoke(2, "t.Feed.endless", none, StreamMode::Server))
        .await
        .expect("send");
    match raw.recv().await {
        Some(Kind::Result(r)) => {
            assert_eq!((r.message_id, r.status_code), (2, 500));
            assert!(r.exception_message.contains("Hello.streams"), "{r:?}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(probe.polls.load(Ordering::SeqCst), 0, "nothing ran");
    within("shutdown", server.shutdown()).await;
}

/// A server that does not stream (an older one: its HelloAck does not set `streams`): a stream
/// fails at once with a typed error and nothing is sent; unary calls go on.
#[tokio::test]
async fn a_stream_to_a_server_that_does_not_stream_fails_at_once() {
    let (listener, addr) = raw_listener().await;
    let f = FeedClient::new(
        Client::builder()
            .registry(StaticRegistry::new([addr.to_string()]))
            .override_options(FeedClient::SERVICE_ID, no_retry())
            .build(),
    );
    let old_server = tokio::spawn(async move {
        let (mut peer, h) = RawConn::accept_with(&listener, Default::default()).await;
        assert!(h.streams, "the client offers streams");
        assert_eq!(h.stream_window, DEFAULT_CLIENT_STREAM_WINDOW);
        // The next frame is the unary call: the stream was never sent.
        let call = peer.recv_invoke("the unary call").await;
        assert_eq!(call.service_entry_id, "t.Feed.echo");
        assert_eq!(call.stream_mode, 0);
        peer.send(Kind::Result(rpc::crates::core::wire::RemoteResultMessage {
            message_id: call.message_id,
            status_code: 200,
            result: Codec::MsgPack.encode(&"old").expect("encode"),
            ..Default::default()
        }))
        .await
        .expect("answer");
    });
    // (The handshake completes on the first call.)
    let e = within("ticks", f.ticks(3))
        .await
        .expect_err("the server does not stream");
    assert_eq!(e.code(), StatusCode::NotImplemented, "{e}");
    assert!(e.message().contains("does not stream"), "{e}");
    assert_eq!(echoed(&f, "x").await, "old");
    within("the fake server", old_server)
        .await
        .expect("fake server");
}

/// Of two instances, one an older server that does not stream: a stream set-up that picks it
/// moves on to the other at once (nothing was sent to the older one), so every stream opens
/// while some instances stream and some do not yet.
#[tokio::test]
async fn a_stream_set_up_fails_over_from_a_server_that_does_not_stream() {
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let (old, handshook, old_server) = older_server().await;
    // Round robin over both: of four set-ups in a row, two pick the older server first.
    let f = FeedClient::new(
        Client::builder()
            .registry(StaticRegistry::new([
                old.to_string(),
                server.local_addr().to_string(),
            ]))
            .build(),
    );
    for round in 0..4u32 {
        let items = within("ticks", f.ticks(round + 1))
            .await
            .unwrap_or_else(|e| panic!("set-up {round}: {e}"));
        let items = within("the items", items.collect_all())
            .await
            .unwrap_or_else(|e| panic!("stream {round}: {e}"));
        assert_eq!(items.len() as u32, round + 1, "stream {round}");
    }
    within("the older server's handshake", handshook)
        .await
        .expect("the older server was tried");
    drop(f);
    within("the older server sees the connection end", old_server)
        .await
        .expect("older server");
    within("shutdown", server.shutdown()).await;
}

/// Of two instances, one an older server that does not stream: a set-up the newer one refused
/// (515) is retried on the newer one, never on the older one (which cannot serve it, and would
/// end the call with 501 while retries were left). Round robin starts the set-ups on each in
/// turn: from the newer one, the refusal's retry detours to the untried older one and then
/// returns to the newer; from the older one, the retry after the refusal has only the newer one
/// to go to.
#[tokio::test]
async fn a_retried_set_up_does_not_return_to_a_server_that_does_not_stream() {
    const ROUNDS: u64 = 16;
    let (listener, newer) = raw_listener().await;
    let newer_server = tokio::spawn(async move {
        let (mut peer, _) = RawConn::accept_with(&listener, streaming_ack(8)).await;
        for round in 0..ROUNDS {
            let first = recv_opening(&mut peer).await;
            peer.answer(
                first.message_id,
                StatusCode::OverflowMaxServerHandle.as_u32(),
                "over the cap",
            )
            .await;
            let id = recv_opening(&mut peer).await.message_id;
            peer.grant(id, 0).await;
            peer.send_item(id, Codec::MsgPack.encode(&round).expect("encode"), 0)
                .await;
            peer.answer(id, 200, "").await;
        }
    });
    let (older, _, older_server) = older_server().await;
    // Two retries: the refusal's, and the one after a detour.
    let f = FeedClient::new(
        Client::builder()
            .registry(StaticRegistry::new([newer.to_string(), older.to_string()]))
            .override_options(
                FeedClient::SERVICE_ID,
                GovernanceOverrides {
                    retry_times: Some(2),
                    retry_interval_ms: Some(1),
                    ..GovernanceOverrides::NONE
                },
            )
            .build(),
    );
    for round in 0..ROUNDS {
        let items = within("endless", f.endless())
            .await
            .unwrap_or_else(|e| panic!("set-up {round} was not retried on the newer one: {e}"));
        let items = within("the items", items.collect_all())
            .await
            .expect("the stream");
        assert_eq!(items, [round], "set-up {round}");
    }
    within("the newer server", newer_server)
        .await
        .expect("newer server");
    drop(f);
    within("the older server", older_server)
        .await
        .expect("older server");
}

/// An older server that does not stream (its `HelloAck` does not offer streams), on a free
/// port: its address, a signal once it completed a handshake, and its task, which ends when
/// the client closes the connection and fails if it is sent anything but heartbeats (a stream
/// is never sent to it).
async fn older_server() -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Receiver<()>,
    tokio::task::JoinHandle<()>,
) {
    let (listener, addr) = raw_listener().await;
    let (handshook_tx, handshook) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let (mut peer, _) = RawConn::accept_with(&listener, Default::default()).await;
        let _ = handshook_tx.send(());
        loop {
            match peer.recv().await {
                Some(Kind::Ping(_)) => {}
                None => return,
                Some(other) => panic!("the older server was sent {other:?}"),
            }
        }
    });
    (addr, handshook, task)
}

/// The next stream opening `peer` is sent, heartbeats and credit skipped.
async fn recv_opening(peer: &mut RawConn) -> RemoteInvokeMessage {
    loop {
        match peer.recv().await {
            Some(Kind::Invoke(i)) => return i,
            Some(Kind::Ping(_) | Kind::StreamCredit(_)) => {}
            other => panic!("expected a stream opening, got {other:?}"),
        }
    }
}

/// A server that sends more items than the client granted breaks the protocol: that stream
/// (only) ends with an error after the items within the window, the server is told to stop it,
/// and the connection carries on. The client's reader never waits for the stream's consumer.
#[tokio::test]
async fn items_beyond_the_window_end_only_that_stream() {
    use rpc::crates::transport::{ConnectOptions, Connection, Opened};
    const WINDOW: u32 = 4;
    let (listener, addr) = raw_listener().await;
    let (cancelled_tx, cancelled) = tokio::sync::oneshot::channel();
    let rogue = tokio::spawn(async move {
        let ack = streaming_ack(8);
        let (mut peer, hello) = RawConn::accept_with(&listener, ack).await;
        let window = hello.stream_window;
        let open = peer.recv_invoke("the stream's opening").await;
        assert_eq!(open.stream_mode, StreamMode::Server as i32);
        let id = open.message_id;
        peer.grant(id, 0).await;
        // One item more than the window, nothing granted back.
        for n in 0..=window {
            peer.send_item(id, Codec::MsgPack.encode(&n).expect("encode"), 0)
                .await;
        }
        match peer.recv().await {
            Some(Kind::Cancel(c)) => assert_eq!(c.message_id, id),
            other => panic!("expected Cancel for the broken stream, got {other:?}"),
        }
        let _ = cancelled_tx.send(());
        // The connection carries on: a unary call is answered.
        let call = match peer.recv().await {
            Some(Kind::Invoke(i)) => i,
            other => panic!("expected a call, got {other:?}"),
        };
        peer.answer(call.message_id, 200, "").await;
        window
    });
    let conn = Connection::connect(
        &addr.to_string(),
        &ConnectOptions {
            stream_window: WINDOW,
            ..Default::default()
        },
    )
    .await
    .expect("connect");
    assert!(conn.supports_streams());
    let call = || rpc::crates::transport::Call {
        service_entry_id: "t.Feed.endless".into(),
        ..Default::default()
    };
    let mut s = match within("open", conn.open_stream(call(), StreamMode::Server, None))
        .await
        .expect("open")
    {
        Opened::Accepted(s) => s,
        Opened::Refused(r) => panic!("refused: {r:?}"),
    };
    // Nothing is read before the client told the server to stop: its reader buffered the
    // window and ended the stream at the item beyond it without waiting for this consumer.
    within("the Cancel", cancelled)
        .await
        .expect("the rogue got its Cancel");
    let mut items = Vec::new();
    let end = loop {
        match within("next", futures_util::StreamExt::next(&mut s)).await {
            Some(Ok(item)) => items.push(Codec::MsgPack.decode::<u32>(&item).expect("decode")),
            Some(Err(e)) => break e,
            None => panic!("the stream ended without its error"),
        }
    };
    assert_eq!(
        items,
        (0..WINDOW).collect::<Vec<_>>(),
        "the items within the window"
    );
    assert_eq!(end.code(), StatusCode::FrameworkError);
    assert!(end.message().contains("protocol violation"), "{end}");
    let answer = within("unary call", conn.call(call(), None))
        .await
        .expect("the connection carries on");
    assert_eq!(answer.status_code, 200);
    assert_eq!(within("rogue", rogue).await.expect("rogue server"), WINDOW);
}

/// A stream dropped as the losing attempt of a call another attempt answered (the stream a
/// middle tier's handler held when that handler was superseded) tells its server so, as a
/// unary call does: `Cancel` with reason `Superseded`, so the tier below counts no failure for
/// a call that succeeded. Dropped otherwise, it was given up (reason unspecified).
#[tokio::test]
async fn a_stream_dropped_as_superseded_says_so_in_its_cancel() {
    use rpc::crates::core::superseded::superseding;
    use rpc::crates::core::wire::CancelReason;
    use rpc::crates::transport::{Call, ConnectOptions, Connection, Opened};
    let (listener, addr) = raw_listener().await;
    let server = tokio::spawn(async move {
        let (mut peer, _) = RawConn::accept_with(&listener, streaming_ack(8)).await;
        let mut reasons = Vec::new();
        for _ in 0..2 {
            let id = recv_opening(&mut peer).await.message_id;
            peer.grant(id, 0).await;
            let cancel = peer
                .skip_to("the stream's Cancel", |k| match k {
                    Kind::Cancel(c) => Some(c),
                    _ => None,
                })
                .await;
            assert_eq!(cancel.message_id, id);
            reasons.push(cancel.reason);
        }
        reasons
    });
    let conn = Connection::connect(&addr.to_string(), &ConnectOptions::default())
        .await
        .expect("connect");
    let open = || async {
        let call = Call {
            service_entry_id: "t.Feed.endless".into(),
            ..Default::default()
        };
        match within("open", conn.open_stream(call, StreamMode::Server, None))
            .await
            .expect("open")
        {
            Opened::Accepted(s) => s,
            Opened::Refused(r) => panic!("refused: {r:?}"),
        }
    };
    let superseded = open().await;
    superseding(|| drop(superseded));
    drop(open().await);
    assert_eq!(
        within("the server's Cancels", server)
            .await
            .expect("server"),
        [
            CancelReason::Superseded as i32,
            CancelReason::Unspecified as i32
        ]
    );
}

/// A server draining for a restart that closes without reading a stream's set-up (its last
/// GoAway says it read nothing more) never ran it: the set-up goes once more on a fresh
/// connection, as a unary call does, rather than failing with 506 "connection closed by the
/// server" (the retry layer may not send it elsewhere: no other endpoint, and the server
/// reached).
#[tokio::test]
async fn a_stream_set_up_a_draining_server_never_read_goes_again_on_a_fresh_connection() {
    use rpc::crates::core::wire::GoAway;
    let (listener, addr) = raw_listener().await;
    let server = tokio::spawn(async move {
        // The first connection: the set-up arrives as the server drains, and is not run.
        let (mut old, _) = RawConn::accept_with(&listener, streaming_ack(8)).await;
        recv_opening(&mut old).await;
        for last in [false, true] {
            old.send(Kind::GoAway(GoAway {
                status_code: 200,
                reason: "restarting".into(),
                last,
            }))
            .await
            .expect("GoAway");
        }
        old.half_close().await;
        // The restarted server: the set-up again, accepted, and ended with no item.
        let (mut new, _) = RawConn::accept_with(&listener, streaming_ack(8)).await;
        let id = recv_opening(&mut new).await.message_id;
        new.grant(id, 0).await;
        new.answer(id, 200, "").await;
        // Both held open until the test ends.
        (old, new)
    });
    let client = Client::builder()
        .registry(StaticRegistry::new([addr.to_string()]))
        .build();
    let ticks = within("the stream", async {
        FeedClient::new(client).ticks(0).await?.collect_all().await
    })
    .await
    .expect("the set-up went again, and the restarted server answered it");
    assert!(ticks.is_empty(), "{ticks:?}");
    let _connections = within("the server", server).await.expect("server");
}

/// Refuses the client `intruder`; counts the calls it sees in `seen`.
fn gate(seen: Arc<AtomicU64>) -> impl rpc::ServerLayer {
    rpc::server_layer_fn(move |req, next| {
        let seen = seen.clone();
        Box::pin(async move {
            seen.fetch_add(1, Ordering::SeqCst);
            if req.caller().client_id() == "intruder" {
                return Err(RpcError::new(
                    StatusCode::UnAuthorization,
                    "intruders may not stream",
                ));
            }
            next.run(req).await
        })
    })
}

/// Reports to `statuses` the status each call's set-up returned to it.
fn set_up_status(statuses: mpsc::UnboundedSender<StatusCode>) -> impl rpc::ServerLayer {
    rpc::server_layer_fn(move |req, next| {
        let statuses = statuses.clone();
        Box::pin(async move {
            let result = next.run(req).await;
            let _ = statuses.send(
                result
                    .as_ref()
                    .map_or_else(RpcError::code, |_| StatusCode::Success),
            );
            result
        })
    })
}

/// A stream whose set-up panics is answered 520, and the server's layers see that answer as
/// they see a unary handler's panic (before, the panic unwound through them: a layer acting
/// after `next.run` never ran that part).
#[tokio::test]
async fn a_stream_whose_set_up_panics_is_a_520_its_server_layers_see() {
    let reg = InProcessRegistry::new();
    let (tx, mut statuses) = mpsc::unbounded_channel();
    let (server, _probe) = serve_configured(&reg, |b| b.layer(set_up_status(tx))).await;
    let f = FeedClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(FeedClient::SERVICE_ID, no_retry())
            .build(),
    );
    let e = within("set-up", f.panic_at_set_up())
        .await
        .expect_err("no stream");
    assert_eq!(e.code(), StatusCode::ServerError, "{e}");
    assert!(e.message().contains("panic id"), "{e}");
    assert_eq!(
        recv_one("the layer's view", &mut statuses).await,
        StatusCode::ServerError
    );
    assert_eq!(
        within("echo", f.echo("on".into())).await.expect("echo"),
        "on"
    );
    within("shutdown", server.shutdown()).await;
}

/// A stream's items are produced in the caller's context, as its set-up is: the calls the
/// handler makes while producing them carry the caller's attachments (and retry depth) on,
/// with or without server layers. Before, only the set-up had them.
#[tokio::test]
async fn a_streams_items_are_produced_in_the_callers_context() {
    for layered in [false, true] {
        let reg = InProcessRegistry::new();
        let seen = Arc::new(AtomicU64::new(0));
        let (server, _probe) = serve_configured(&reg, |b| {
            if layered {
                b.layer(gate(seen.clone()))
            } else {
                b
            }
        })
        .await;
        let f = feed(&reg);
        let context =
            std::collections::BTreeMap::from([("tenant".to_string(), "acme".to_string())]);
        let items = within("tenants", rpc::RpcContext::scope(context, f.tenants(3)))
            .await
            .expect("accepted");
        let tenants = within("the items", items.collect_all())
            .await
            .expect("items");
        assert_eq!(tenants, ["acme", "acme", "acme"], "layered {layered}");
        within("shutdown", server.shutdown()).await;
    }
}

/// Server layers see a server stream's set-up as a call: they may refuse it before the
/// handler runs; a stream they hand on streams as without layers. (Client and bidirectional
/// streams pass them too: tests/streams_governance.rs.)
#[tokio::test]
async fn server_layers_see_a_streams_set_up_and_may_refuse_it() {
    let reg = InProcessRegistry::new();
    let seen = Arc::new(AtomicU64::new(0));
    let (server, probe) =
        serve_configured(&reg, |b| b.max_concurrency(1).layer(gate(seen.clone()))).await;
    let setups = probe.setups;
    let f = feed(&reg);
    let ticks = within("ticks", f.ticks(40).await.expect("ticks").collect_all())
        .await
        .expect("complete");
    assert_eq!(ticks.len(), 40);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "the layer saw the set-up once"
    );
    // The stream held the cap's only slot while open, and gave it back at its end.
    let mut open = within("open", f.stall_after(1)).await.expect("stall_after");
    assert_eq!(next_item("item", &mut open).await, 0);
    let over = within("echo at the cap", f.echo("x".into())).await;
    assert_eq!(
        over.expect_err("the open stream holds the slot").code(),
        StatusCode::OverflowMaxServerHandle
    );
    drop(open);

    let intruder = FeedClient::new(
        Client::builder()
            .registry(reg.clone())
            .client_id("intruder")
            .override_options(FeedClient::SERVICE_ID, no_retry())
            .build(),
    );
    let e = within("refused", intruder.stall_after(1))
        .await
        .expect_err("the layer refuses the stream");
    assert_eq!(e.code(), StatusCode::UnAuthorization, "{e}");
    assert_eq!(
        setups.load(Ordering::SeqCst),
        1,
        "the refused set-up never ran"
    );
    let e = within("sum", intruder.sum("x".into(), RpcStream::iter([1u64])))
        .await
        .expect_err("the layer refuses client streams too");
    assert_eq!(e.code(), StatusCode::UnAuthorization, "{e}");
    within("shutdown", server.shutdown()).await;
}

/// The server's span of a stream covers it to its end and says how many items went each way.
#[tokio::test]
async fn the_servers_span_of_a_stream_counts_its_items_each_way() {
    use common::otel::{attr, Traces};
    use opentelemetry::Value;
    let (traces, _guard) = Traces::install();
    let reg = InProcessRegistry::new();
    let (server, _probe) = serve(&reg, 50).await;
    let f = feed(&reg);
    let ticks = within("ticks", f.ticks(7).await.expect("ticks").collect_all())
        .await
        .expect("complete");
    assert_eq!(ticks.len(), 7);
    let sum = within("sum", f.sum("s".into(), RpcStream::iter(1..=5u64)))
        .await
        .expect("sum");
    assert_eq!(sum, "s=15 from 5 items");
    within("shutdown", server.shutdown()).await;
    let is_server_span_of = |s: &opentelemetry_sdk::trace::SpanData, entry: &str| {
        s.name == "rpc.server" && attr(s, "rpc.entry_id") == Some(Value::from(entry.to_string()))
    };
    let spans = traces
        .spans_once("both server spans end", |spans| {
            ["t.Feed.ticks", "t.Feed.sum"]
                .iter()
                .all(|entry| spans.iter().any(|s| is_server_span_of(s, entry)))
        })
        .await;
    let server_span = |entry: &str| {
        spans
            .iter()
            .find(|s| is_server_span_of(s, entry))
            .unwrap_or_else(|| panic!("no server span for {entry}"))
    };
    let ticks = server_span("t.Feed.ticks");
    assert_eq!(attr(ticks, "rpc.stream.items_sent"), Some(Value::I64(7)));
    assert_eq!(
        attr(ticks, "rpc.stream.items_received"),
        Some(Value::I64(0))
    );
    assert_eq!(attr(ticks, "rpc.status_code"), Some(Value::I64(200)));
    let sum = server_span("t.Feed.sum");
    // The answer is an item sent, as the caller's span counts it received.
    assert_eq!(attr(sum, "rpc.stream.items_sent"), Some(Value::I64(1)));
    assert_eq!(attr(sum, "rpc.stream.items_received"), Some(Value::I64(5)));
}

/// A 507 that a hand-written service's stream set-up passes on from a downstream call is its
/// answer, not "this server has no such entry": the set-up, which ran, is not repeated on
/// another instance, with or without server layers. Before, the caller read it as "nothing
/// ran" and set the stream up again.
#[tokio::test]
async fn a_507_a_hand_written_stream_set_up_passes_on_does_not_send_it_elsewhere() {
    for layered in [false, true] {
        let reg = InProcessRegistry::new();
        let (servers, runs) = common::PassesOnA507::serve_two(&reg, ("ticks", layered), || {
            FeedServer::new(Feeds {
                polls: Arc::default(),
                setups: Arc::default(),
                dropped: mpsc::unbounded_channel().0,
                stalled: mpsc::unbounded_channel().0,
            })
        })
        .await;
        let f = FeedClient::new(Client::builder().registry(reg.clone()).build());
        let e = match within("ticks", f.ticks(3)).await {
            Ok(_) => panic!("the set-up failed downstream"),
            Err(e) => e,
        };
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "set up once (layered {layered}): {e}"
        );
        assert!(e.message().contains("t.Downstream.gone"), "{e}");
        assert_eq!(e.code(), StatusCode::NotFindServiceRouteAddress, "{e}");
        assert!(e.is_maybe_delivered(), "{e}");
        for server in servers {
            within("shutdown", server.shutdown()).await;
        }
    }
}
