//! Streams under the client's governance, over real TCP: a fallback answers a stream whose
//! set-up failed (with its own items, taking the caller's), never a business refusal and never
//! once the server accepted the stream; failed set-ups count in the entry's circuit breaker and
//! an open breaker refuses the next set-up without reaching the server, while a failure after
//! acceptance does not count; the client's span, metrics, call observers and layers cover the
//! whole stream (its end status, the items each way, its duration); a stream's set-up arguments
//! and its items both ways are compressed with the entry's option, and a corrupt item ends that
//! stream with 500. On the server: layers pass client and bidirectional streams and hear of
//! every stream's end, and a server fallback answers a server stream's failed set-up.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use common::otel::{attr, counter, Traces};
use common::{raw_listener, recv_one, stream_opening, streaming_ack, within};
use opentelemetry::Value;
use rpc::{
    BreakerState, Client, GovernanceOverrides, InProcessRegistry, MethodDescriptor, RpcError,
    RpcStream, Server, ServerHandle, StatusCode,
};
use tokio::sync::mpsc;

#[rpc::service(name = "g.Stocks")]
pub trait Stocks {
    /// Prices `0..n`, then the end.
    async fn prices(&self, n: u32) -> Result<RpcStream<u32>, RpcError>;
    /// Prices `0..n`, then a server error item: a failure after the stream was accepted.
    async fn break_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError>;
    /// Refuses its set-up with a business error.
    async fn closed(&self) -> Result<RpcStream<u32>, RpcError>;
    /// Client streaming: the sum of the caller's numbers.
    async fn total(&self, numbers: RpcStream<u64>) -> Result<u64, RpcError>;
    /// Both ways: each of the caller's numbers, doubled.
    async fn double(&self, numbers: RpcStream<u64>) -> Result<RpcStream<u64>, RpcError>;
    /// Where `word` starts in `text`, one position per item (a set-up with a large argument).
    async fn find(&self, text: String, word: String) -> Result<RpcStream<u32>, RpcError>;
    /// Client streaming: the length of `text` plus the caller's numbers.
    async fn tally(&self, text: String, numbers: RpcStream<u64>) -> Result<u64, RpcError>;
    /// Client streaming: the sum of the caller's numbers up to their end or their failure,
    /// answered either way (a handler that takes a failed request stream as complete).
    async fn lenient_total(&self, numbers: RpcStream<u64>) -> Result<u64, RpcError>;
    /// Both ways, compressed: each line back upper-cased after `prefix`.
    #[governance(compression = "zstd")]
    async fn shout(
        &self,
        prefix: String,
        lines: RpcStream<String>,
    ) -> Result<RpcStream<String>, RpcError>;
    /// Client streaming, compressed: the caller's parts joined.
    #[governance(compression = "zstd")]
    async fn join(&self, parts: RpcStream<String>) -> Result<String, RpcError>;
}

/// The caller's parts, joined (the first error among them ends it).
async fn joined(mut parts: RpcStream<String>) -> Result<String, RpcError> {
    let mut out = String::new();
    while let Some(part) = parts.next().await {
        out.push_str(&part?);
    }
    Ok(out)
}

fn shouted(prefix: &str, line: &str) -> String {
    format!("{prefix}{}", line.to_uppercase())
}

/// The positions of `word` in `text`: the oracle of `find`.
fn positions(text: &str, word: &str) -> Vec<u32> {
    text.match_indices(word).map(|(i, _)| i as u32).collect()
}

/// `start` plus every number of `numbers`, or the first error among them.
async fn sum_from(start: u64, mut numbers: RpcStream<u64>) -> Result<u64, RpcError> {
    let mut total = start;
    while let Some(n) = numbers.next().await {
        total += n?;
    }
    Ok(total)
}

async fn tally_of(text: String, numbers: RpcStream<u64>) -> Result<u64, RpcError> {
    sum_from(text.len() as u64, numbers).await
}

/// The live service: while `down`, every set-up fails with a server error (520, a failure a
/// fallback answers for and the breaker counts); while `panics`, every set-up panics; while
/// `late`, every set-up first holds its thread until the caller's deadline has passed (a
/// set-up blocked in synchronous work). Counts the set-ups that reached it.
#[derive(Clone, Default)]
struct Market {
    down: Arc<AtomicBool>,
    panics: Arc<AtomicBool>,
    late: Arc<AtomicBool>,
    /// While set, `prices`' set-up never finishes (it waits, as on a dependency that hangs).
    hangs: Arc<AtomicBool>,
    setups: Arc<AtomicU64>,
}

impl Market {
    fn setup(&self) -> Result<(), RpcError> {
        self.setups.fetch_add(1, Ordering::SeqCst);
        if self.late.load(Ordering::SeqCst) {
            let bound = std::time::Instant::now() + common::LIMIT;
            while !rpc::crates::governance::timeout::inherited_passed()
                && std::time::Instant::now() < bound
            {
                std::thread::yield_now();
            }
        }
        if self.panics.load(Ordering::SeqCst) {
            panic!("the market's feed handler panicked");
        }
        if self.down.load(Ordering::SeqCst) {
            return Err(RpcError::new(StatusCode::ServerError, "the market is down"));
        }
        Ok(())
    }
}

impl Stocks for Market {
    async fn prices(&self, n: u32) -> Result<RpcStream<u32>, RpcError> {
        self.setup()?;
        if self.hangs.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(RpcStream::iter(0..n))
    }

    async fn break_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError> {
        self.setup()?;
        let items = (0..n).map(Ok).chain(std::iter::once(Err(RpcError::new(
            StatusCode::ServerError,
            "the feed broke",
        ))));
        Ok(RpcStream::try_new(futures_util::stream::iter(items)))
    }

    async fn closed(&self) -> Result<RpcStream<u32>, RpcError> {
        self.setup()?;
        Err(RpcError::business("the market is closed today"))
    }

    async fn total(&self, numbers: RpcStream<u64>) -> Result<u64, RpcError> {
        self.setup()?;
        sum_from(0, numbers).await
    }

    async fn double(&self, numbers: RpcStream<u64>) -> Result<RpcStream<u64>, RpcError> {
        self.setup()?;
        Ok(numbers.map_items(|n| Ok(n * 2)))
    }

    async fn find(&self, text: String, word: String) -> Result<RpcStream<u32>, RpcError> {
        self.setup()?;
        Ok(RpcStream::iter(positions(&text, &word)))
    }

    async fn tally(&self, text: String, numbers: RpcStream<u64>) -> Result<u64, RpcError> {
        self.setup()?;
        tally_of(text, numbers).await
    }

    async fn lenient_total(&self, mut numbers: RpcStream<u64>) -> Result<u64, RpcError> {
        self.setup()?;
        let mut total = 0;
        while let Some(Ok(n)) = numbers.next().await {
            total += n;
        }
        Ok(total)
    }

    async fn shout(
        &self,
        prefix: String,
        lines: RpcStream<String>,
    ) -> Result<RpcStream<String>, RpcError> {
        self.setup()?;
        Ok(lines.map_items(move |line| Ok(shouted(&prefix, &line))))
    }

    async fn join(&self, parts: RpcStream<String>) -> Result<String, RpcError> {
        self.setup()?;
        joined(parts).await
    }
}

/// The fallback: answers that cannot be mistaken for the market's (prices from 1000, totals
/// plus a million, numbers times ten); counts the set-ups it answered. With `empty` set, its
/// `prices` fails (a fallback that fails in turn); with `broken`, it panics.
#[derive(Clone, Default)]
struct Cache {
    used: Arc<AtomicU64>,
    empty: Arc<AtomicBool>,
    broken: Arc<AtomicBool>,
}

impl Stocks for Cache {
    async fn prices(&self, n: u32) -> Result<RpcStream<u32>, RpcError> {
        self.used.fetch_add(1, Ordering::SeqCst);
        if self.empty.load(Ordering::SeqCst) {
            return Err(RpcError::business("the cache is empty"));
        }
        if self.broken.load(Ordering::SeqCst) {
            panic!("the cache broke");
        }
        Ok(RpcStream::iter(1000..1000 + n))
    }

    async fn break_after(&self, n: u32) -> Result<RpcStream<u32>, RpcError> {
        self.prices(n).await
    }

    async fn closed(&self) -> Result<RpcStream<u32>, RpcError> {
        self.prices(1).await
    }

    async fn total(&self, numbers: RpcStream<u64>) -> Result<u64, RpcError> {
        self.used.fetch_add(1, Ordering::SeqCst);
        sum_from(1_000_000, numbers).await
    }

    async fn lenient_total(&self, numbers: RpcStream<u64>) -> Result<u64, RpcError> {
        self.total(numbers).await
    }

    async fn double(&self, numbers: RpcStream<u64>) -> Result<RpcStream<u64>, RpcError> {
        self.used.fetch_add(1, Ordering::SeqCst);
        Ok(numbers.map_items(|n| Ok(n * 10)))
    }

    async fn find(&self, _: String, _: String) -> Result<RpcStream<u32>, RpcError> {
        self.prices(1).await
    }

    async fn tally(&self, text: String, numbers: RpcStream<u64>) -> Result<u64, RpcError> {
        self.used.fetch_add(1, Ordering::SeqCst);
        tally_of(text, numbers).await
    }

    async fn shout(&self, _: String, _: RpcStream<String>) -> Result<RpcStream<String>, RpcError> {
        self.used.fetch_add(1, Ordering::SeqCst);
        Ok(RpcStream::empty())
    }

    async fn join(&self, parts: RpcStream<String>) -> Result<String, RpcError> {
        self.used.fetch_add(1, Ordering::SeqCst);
        joined(parts).await
    }
}

/// A client of the server at `addr` alone (a static list), with the tests' options.
fn client_of(addr: std::net::SocketAddr) -> Client {
    Client::builder()
        .registry(rpc::StaticRegistry::from_list(&addr.to_string()).expect("registry"))
        .override_options(StocksClient::SERVICE_ID, options(100))
        .build()
}

/// The text a frame's payload carries, which must be zstd-compressed (`compression`, its wire
/// number): the decompressed bytes and the MessagePack string they hold.
fn zstd_text(compression: i32, payload: &bytes::Bytes) -> (bytes::Bytes, String) {
    use rpc::crates::core::Compression;
    assert_eq!(compression, Compression::Zstd.to_wire(), "sent compressed");
    let plain = rpc::crates::transport::compression::decompress(compression, payload, 1 << 20)
        .expect("decompresses");
    let text = rpc::Codec::MsgPack.decode(&plain).expect("decode");
    (plain, text)
}

fn traced() -> (Traces, tracing::subscriber::DefaultGuard) {
    Traces::install()
}

/// What a stream the server must accept ends with: `call` sets it up (a refused set-up fails
/// the test as not accepted), then all its items are collected, within the time limit of
/// `what`.
async fn accepted_items<T: Send + 'static>(
    what: &str,
    call: impl std::future::Future<Output = Result<RpcStream<T>, RpcError>>,
) -> Result<Vec<T>, RpcError> {
    within(what, async {
        call.await.expect("accepted").collect_all().await
    })
    .await
}

/// Asserts that the client's breaker of `method` is open (`open`) or closed, `why`; a failure
/// shows the state it is in.
fn assert_breaker(client: &Client, method: &'static MethodDescriptor, open: bool, why: &str) {
    let state = client.breaker_state(method);
    let is = if open {
        matches!(state, BreakerState::Open { .. })
    } else {
        matches!(state, BreakerState::Closed { .. })
    };
    assert!(is, "{why}: {state:?}");
}

/// A client of the market whose breaker opens after `failures` failures in a row, and its
/// proxy.
fn breaker_client(reg: &InProcessRegistry, failures: u32) -> (Client, StocksClient) {
    let client = Client::builder()
        .registry(reg.clone())
        .override_options(StocksClient::SERVICE_ID, options(failures))
        .build();
    (client.clone(), StocksClient::new(client))
}

async fn serve(reg: &InProcessRegistry) -> (ServerHandle, Market) {
    let market = Market::default();
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(StocksServer::new(market.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (server, market)
}

/// No retry (each set-up is one attempt), no deadline, and a breaker that opens after
/// `breaks_after` counted failures and stays open for an hour.
fn options(breaks_after: u32) -> GovernanceOverrides {
    GovernanceOverrides {
        retry_times: Some(0),
        timeout_ms: Some(0),
        exceptions_allowed_before_breaking: Some(breaks_after),
        breaker_seconds: Some(3600),
        ..GovernanceOverrides::NONE
    }
}

/// A client of `reg`'s Stocks whose entries have the options `o` (over the defaults).
fn stocks_with(reg: &InProcessRegistry, o: GovernanceOverrides) -> StocksClient {
    StocksClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(StocksClient::SERVICE_ID, o)
            .build(),
    )
}

fn client(reg: &InProcessRegistry, fallback: Option<&Cache>) -> Client {
    let builder = Client::builder()
        .registry(reg.clone())
        .override_options(StocksClient::SERVICE_ID, options(100));
    match fallback {
        Some(cache) => builder.fallback(StocksServer::new(cache.clone())),
        None => builder,
    }
    .build()
}

/// The live service on a fresh registry, and a client of it whose fallback is a [`Cache`].
/// The market served on a new registry with the cache as the server's fallback (not the
/// client's).
async fn with_server_fallback() -> (InProcessRegistry, ServerHandle, Market, Cache) {
    with_server_fallback_and(|b| b).await
}

/// [`with_server_fallback`], the server's builder given to `configure` first.
async fn with_server_fallback_and(
    configure: impl FnOnce(rpc::ServerBuilder) -> rpc::ServerBuilder,
) -> (InProcessRegistry, ServerHandle, Market, Cache) {
    let reg = InProcessRegistry::new();
    let (market, cache) = (Market::default(), Cache::default());
    let server = configure(Server::builder())
        .registry(reg.clone())
        .add_service(StocksServer::new(market.clone()))
        .fallback(StocksServer::new(cache.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (reg, server, market, cache)
}

async fn with_fallback() -> (ServerHandle, Market, Cache, StocksClient) {
    let reg = InProcessRegistry::new();
    let (server, market) = serve(&reg).await;
    let cache = Cache::default();
    let stocks = StocksClient::new(client(&reg, Some(&cache)));
    (server, market, cache, stocks)
}

#[tokio::test]
async fn a_fallback_answers_a_server_stream_whose_set_up_failed_with_its_own_items() {
    let _traced = traced();
    let (server, market, cache, stocks) = with_fallback().await;

    market.down.store(true, Ordering::SeqCst);
    let prices = accepted_items("prices", stocks.prices(3))
        .await
        .expect("every item");
    assert_eq!(prices, [1000, 1001, 1002], "the fallback's items");
    assert_eq!(
        market.setups.load(Ordering::SeqCst),
        1,
        "the set-up was tried"
    );
    assert_eq!(cache.used.load(Ordering::SeqCst), 1);

    // The market is back: its own stream, the fallback not asked.
    market.down.store(false, Ordering::SeqCst);
    let prices = accepted_items("prices", stocks.prices(3))
        .await
        .expect("every item");
    assert_eq!(prices, [0, 1, 2]);
    assert_eq!(
        cache.used.load(Ordering::SeqCst),
        1,
        "no fallback this time"
    );
    within("shutdown", server.shutdown()).await;
}

/// The fallback of a refused client or bidirectional stream takes all the caller's items, and
/// the call's span counts them as sent (before, 0); the items metric, which counts items to
/// and from servers, does not (before, it did), and `answered_by` names the fallback (before,
/// the server that refused).
#[tokio::test]
async fn a_fallback_of_a_refused_client_or_bidi_stream_takes_all_the_callers_items() {
    let (traces, _guard) = traced();
    let meters = common::otel::Meters::new();
    // A server whose every call overflows (the cap is 0): the set-up is refused before the
    // server accepts the stream, with nothing of the caller's taken.
    let reg = InProcessRegistry::new();
    let market = Market::default();
    let full = Server::builder()
        .registry(reg.clone())
        .max_concurrency(0)
        .add_service(StocksServer::new(market.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let cache = Cache::default();
    let stocks = StocksClient::new(
        Client::builder()
            .registry(reg.clone())
            .meter(meters.meter.clone())
            .override_options(StocksClient::SERVICE_ID, options(100))
            .fallback(StocksServer::new(cache.clone()))
            .build(),
    );

    let (total, by) = within(
        "total",
        rpc::answered_by(stocks.total(RpcStream::iter(1..=4u64))),
    )
    .await;
    let total = total.expect("the fallback's answer");
    assert_eq!(by.as_deref(), Some("fallback"));
    assert_eq!(total, 1_000_000 + 10, "the fallback summed every item");
    let doubled = accepted_items("double", stocks.double(RpcStream::iter([1u64, 2, 3])))
        .await
        .expect("every item");
    assert_eq!(
        doubled,
        [10, 20, 30],
        "the fallback's items, from every item"
    );
    assert_eq!(market.setups.load(Ordering::SeqCst), 0, "no handler ran");
    assert_eq!(cache.used.load(Ordering::SeqCst), 2);
    within("shutdown", full.shutdown()).await;
    let spans = traces.spans();
    let metrics = meters.read();
    for (entry, items) in [("g.Stocks.total", 4), ("g.Stocks.double", 3)] {
        let span = client_span(&spans, entry);
        assert_eq!(
            attr(&span, "rpc.stream.items_sent"),
            Some(Value::I64(items)),
            "{entry}"
        );
        let to_servers = common::otel::counter(
            &metrics,
            "rpc.client.stream.items",
            &[
                ("rpc.entry_id", Value::from(entry)),
                ("rpc.stream.direction", Value::from("sent")),
            ],
        );
        assert_eq!(to_servers, 0, "{entry}: no item reached a server");
    }
}

#[tokio::test]
async fn a_client_stream_the_server_accepted_is_never_answered_by_the_fallback() {
    let _traced = traced();
    // A client stream is accepted as soon as it is admitted, before its handler runs: the
    // handler's failure ends the accepted stream, and the caller's items already went to it.
    let (server, market, cache, stocks) = with_fallback().await;
    market.down.store(true, Ordering::SeqCst);
    let err = within("total", stocks.total(RpcStream::iter(1..=4u64)))
        .await
        .expect_err("the handler's failure");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    assert_eq!(market.setups.load(Ordering::SeqCst), 1);
    assert_eq!(
        cache.used.load(Ordering::SeqCst),
        0,
        "no fallback after acceptance"
    );

    market.down.store(false, Ordering::SeqCst);
    let total = within("total", stocks.total(RpcStream::iter(1..=4u64)))
        .await
        .expect("the market's answer");
    assert_eq!(total, 10);
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_business_refusal_of_a_stream_reaches_the_caller_and_not_the_fallback() {
    let _traced = traced();
    let (server, market, cache, stocks) = with_fallback().await;
    let err = within("closed", stocks.closed())
        .await
        .expect_err("the market refuses");
    assert_eq!(err.code(), StatusCode::BusinessError, "{err}");
    assert_eq!(market.setups.load(Ordering::SeqCst), 1);
    assert_eq!(cache.used.load(Ordering::SeqCst), 0, "no fallback");
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn no_fallback_runs_once_the_server_accepted_the_stream() {
    let _traced = traced();
    let (server, _market, cache, stocks) = with_fallback().await;
    let mut items = within("break_after", stocks.break_after(2))
        .await
        .expect("accepted");
    let mut seen = Vec::new();
    let end = within("the stream's end", async {
        loop {
            match items.next().await {
                Some(Ok(n)) => seen.push(n),
                Some(Err(e)) => break Some(e),
                None => break None,
            }
        }
    })
    .await;
    assert_eq!(seen, [0, 1], "the market's items, not the fallback's");
    let end = end.expect("the stream ends with the market's error");
    assert_eq!(end.code(), StatusCode::ServerError, "{end}");
    assert!(items.next().await.is_none(), "nothing after the error");
    assert_eq!(
        cache.used.load(Ordering::SeqCst),
        0,
        "no fallback after acceptance"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn failed_stream_set_ups_open_the_breaker_which_refuses_the_next_without_the_server() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let (server, market) = serve(&reg).await;
    let (client, stocks) = breaker_client(&reg, 2);
    let prices = &StocksClient::methods()[0];
    market.down.store(true, Ordering::SeqCst);
    for n in 0..2 {
        assert_breaker(
            &client,
            prices,
            false,
            &format!("closed before failure {n}"),
        );
        let err = within("prices", stocks.prices(3))
            .await
            .expect_err("the set-up fails");
        assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    }
    assert_breaker(&client, prices, true, "two failed set-ups open it");
    market.down.store(false, Ordering::SeqCst);
    let err = within("prices", stocks.prices(3))
        .await
        .expect_err("the open breaker refuses");
    assert_eq!(err.code(), StatusCode::CircuitOpen, "{err}");
    assert_eq!(err.code().as_u32(), 522);
    assert_eq!(
        market.setups.load(Ordering::SeqCst),
        2,
        "the refused set-up never reached the server"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_failure_after_acceptance_is_not_held_against_the_breaker() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let (server, market) = serve(&reg).await;
    let (client, stocks) = breaker_client(&reg, 1);
    let break_after = &StocksClient::methods()[1];
    for _ in 0..3 {
        let end = accepted_items("break_after", stocks.break_after(1))
            .await
            .expect_err("each stream ends with the server's error");
        assert_eq!(end.code(), StatusCode::ServerError, "{end}");
    }
    assert_breaker(
        &client,
        break_after,
        false,
        "three failures after acceptance leave it closed",
    );
    // With the same settings, one failed set-up opens it.
    market.down.store(true, Ordering::SeqCst);
    let err = within("break_after", stocks.break_after(1))
        .await
        .expect_err("the set-up fails");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    assert_breaker(&client, break_after, true, "one failed set-up opens it");
    within("shutdown", server.shutdown()).await;
}

/// A bidirectional stream's items are taken in the caller's context, as a client stream's
/// are: an item made while it is taken (here from an attachment; in practice by other calls,
/// which carry the context on) sees the caller's attachments. Before, the task sending them
/// had none.
#[tokio::test]
async fn a_bidi_streams_items_are_taken_in_the_callers_context() {
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let stocks = StocksClient::new(client(&reg, None));
    use futures_util::StreamExt as _;
    let tenant_of_each_item = RpcStream::new(
        futures_util::stream::iter(0..3)
            .map(|_| rpc::RpcContext::get("tenant").unwrap_or_else(|| "none".into())),
    );
    let attachments = BTreeMap::from([("tenant".to_string(), "acme".to_string())]);
    let lines = rpc::RpcContext::scope(attachments, async {
        let answers = within("shout", stocks.shout("t:".into(), tenant_of_each_item))
            .await
            .expect("accepted");
        within("the answers", answers.collect_all()).await
    })
    .await
    .expect("every answer");
    assert_eq!(lines, vec![shouted("t:", "acme"); 3]);
    within("shutdown", server.shutdown()).await;
}

/// A client fallback that fails in turn still leaves on the stream's span the status of the
/// failure it ran for (`rpc.fallback.cause`), beside its own error, as a unary call's span
/// does. Before, the span named no cause: the fallback left no mark that it ran.
#[tokio::test]
async fn a_stream_fallback_that_fails_still_leaves_its_cause_on_the_span() {
    let (traces, _guard) = Traces::install();
    let (server, market, cache, stocks) = with_fallback().await;
    market.down.store(true, Ordering::SeqCst);
    cache.empty.store(true, Ordering::SeqCst);
    let err = within("prices", stocks.prices(3))
        .await
        .map(|_| ())
        .expect_err("the fallback fails");
    assert_eq!(cache.used.load(Ordering::SeqCst), 1, "the fallback ran");
    within("shutdown", server.shutdown()).await;
    let span = client_span(&traces.spans(), "g.Stocks.prices");
    assert_eq!(
        attr(&span, "rpc.fallback.cause"),
        Some(Value::I64(i64::from(StatusCode::ServerError.as_u32()))),
        "{err}"
    );
    // The cache's own business error passes through as the fallback's answer.
    assert_eq!(err.code(), StatusCode::BusinessError, "{err}");
    assert_eq!(attr(&span, "rpc.status_code"), Some(Value::I64(1000)));
}

/// The `rpc.server` spans of `g.Stocks.prices`, once at least `n` have ended (`what` names
/// the wait).
async fn server_spans_of_prices(
    traces: &Traces,
    what: &str,
    n: usize,
) -> Vec<opentelemetry_sdk::trace::SpanData> {
    let of_prices = |s: &&opentelemetry_sdk::trace::SpanData| {
        s.name == "rpc.server"
            && attr(s, "rpc.entry_id") == Some(Value::from("g.Stocks.prices".to_string()))
    };
    let spans = traces
        .spans_once(what, |spans| spans.iter().filter(of_prices).count() >= n)
        .await;
    spans.iter().filter(of_prices).cloned().collect()
}

/// A tower layer that passes every call on unchanged.
struct PassThrough;

impl<S> rpc::tower::Layer<S> for PassThrough {
    type Service = S;
    fn layer(&self, inner: S) -> S {
        inner
    }
}

/// A server-stream fallback that ran and failed leaves on the `rpc.server` span the status of
/// the failure it ran for, behind a tower layer as without one (the layer runs the end of the
/// chain on a copy of the request, which reported back only when the set-up succeeded: the
/// span named no cause).
#[tokio::test]
async fn a_failed_server_stream_fallback_leaves_its_cause_on_the_span_behind_a_tower_layer() {
    let (traces, _guard) = Traces::install();
    for towered in [false, true] {
        let (reg, server, market, cache) = with_server_fallback_and(|b| {
            if towered {
                b.layer(rpc::tower::TowerLayer::new(PassThrough))
            } else {
                b
            }
        })
        .await;
        market.down.store(true, Ordering::SeqCst);
        cache.empty.store(true, Ordering::SeqCst);
        let stocks = StocksClient::new(client(&reg, None));
        let failed = within("prices", stocks.prices(3)).await.map(|_| ());
        assert!(failed.is_err(), "towered {towered}: the fallback fails");
        assert_eq!(cache.used.load(Ordering::SeqCst), 1, "the fallback ran");
        within("shutdown", server.shutdown()).await;
    }
    for span in &server_spans_of_prices(&traces, "both server spans end", 2).await {
        assert_eq!(
            attr(span, "rpc.fallback.cause"),
            Some(Value::I64(i64::from(StatusCode::ServerError.as_u32()))),
            "{:?}",
            span.attributes
        );
    }
}

/// The client's `rpc.client` span of `entry` (the only one).
fn client_span(
    spans: &[opentelemetry_sdk::trace::SpanData],
    entry: &str,
) -> opentelemetry_sdk::trace::SpanData {
    let mut found = spans.iter().filter(|s| {
        s.name == "rpc.client" && attr(s, "rpc.entry_id") == Some(Value::from(entry.to_string()))
    });
    let span = found
        .next()
        .unwrap_or_else(|| panic!("no client span for {entry}"))
        .clone();
    assert!(found.next().is_none(), "one client span for {entry}");
    span
}

#[tokio::test]
async fn the_clients_span_covers_the_whole_stream_with_its_items_each_way_and_end_status() {
    let (traces, _guard) = Traces::install();
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let stocks = StocksClient::new(client(&reg, None));

    let mut prices = within("prices", stocks.prices(5)).await.expect("accepted");
    let first = within("first", prices.next()).await;
    assert_eq!(first.map(Result::ok), Some(Some(0)));
    // After the set-up and the first item: the span must still be open.
    let mid_stream = SystemTime::now();
    let rest = within("the rest", prices.collect_all())
        .await
        .expect("the rest");
    assert_eq!(rest, [1, 2, 3, 4]);

    let total = within("total", stocks.total(RpcStream::iter(1..=4u64)))
        .await
        .expect("total");
    assert_eq!(total, 10);
    let end = accepted_items("break_after", stocks.break_after(2))
        .await
        .expect_err("the server's error");
    assert_eq!(end.code(), StatusCode::ServerError);
    within("shutdown", server.shutdown()).await;

    let spans = traces.spans();
    let span = client_span(&spans, "g.Stocks.prices");
    assert!(
        span.end_time >= mid_stream,
        "the span ends with the stream, not at its set-up"
    );
    assert_eq!(
        attr(&span, "rpc.stream.items_received"),
        Some(Value::I64(5))
    );
    assert_eq!(attr(&span, "rpc.stream.items_sent"), Some(Value::I64(0)));
    assert_eq!(attr(&span, "rpc.status_code"), Some(Value::I64(200)));
    let span = client_span(&spans, "g.Stocks.total");
    assert_eq!(attr(&span, "rpc.stream.items_sent"), Some(Value::I64(4)));
    assert_eq!(
        attr(&span, "rpc.stream.items_received"),
        Some(Value::I64(1)),
        "the answer"
    );
    assert_eq!(attr(&span, "rpc.status_code"), Some(Value::I64(200)));
    let span = client_span(&spans, "g.Stocks.break_after");
    assert_eq!(
        attr(&span, "rpc.stream.items_received"),
        Some(Value::I64(2))
    );
    assert_eq!(
        attr(&span, "rpc.status_code"),
        Some(Value::I64(i64::from(StatusCode::ServerError.as_u32())))
    );
    assert!(
        matches!(span.status, opentelemetry::trace::Status::Error { .. }),
        "{:?}",
        span.status
    );
}

/// A stream refused before any attempt (its options ask for hashing and it has no
/// `#[hash_key]`) is still a call that failed: observers hear of it with its error.
#[tokio::test]
async fn a_stream_refused_for_its_options_is_counted_with_its_error() {
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let client = Client::builder()
        .registry(reg.clone())
        .shunt_strategy(rpc::ShuntStrategy::Hash)
        .build();
    let mut records = common::observe_calls(&client);
    let stocks = StocksClient::new(client);
    let e = match within("prices", stocks.prices(3)).await {
        Ok(_) => panic!("hashing without a #[hash_key] is refused"),
        Err(e) => e,
    };
    assert!(e.message().contains("hash_key"), "{e}");
    assert_eq!(
        records.try_recv().ok(),
        Some((
            "g.Stocks.prices".to_string(),
            Some(e.code()),
            "error".to_string()
        ))
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn call_observers_hear_of_a_stream_at_its_end_with_its_end_status() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let client = client(&reg, None);
    let mut records = common::observe_calls(&client);
    let stocks = StocksClient::new(client);

    let mut items = within("break_after", stocks.break_after(2))
        .await
        .expect("accepted");
    assert_eq!(
        within("an item", items.next()).await.map(Result::ok),
        Some(Some(0))
    );
    assert!(records.try_recv().is_err(), "nothing told before the end");
    let end = within("the end", async {
        while let Some(Ok(_)) = items.next().await {}
    });
    end.await;
    assert_eq!(
        records.try_recv().ok(),
        Some((
            "g.Stocks.break_after".to_string(),
            Some(StatusCode::ServerError),
            "error".to_string()
        ))
    );

    // A stream its caller drops is a cancelled call, told as it is dropped.
    let mut prices = within("prices", stocks.prices(100))
        .await
        .expect("accepted");
    assert!(within("an item", prices.next()).await.is_some());
    assert!(records.try_recv().is_err(), "still open");
    drop(prices);
    assert_eq!(
        records.try_recv().ok(),
        Some(("g.Stocks.prices".to_string(), None, "cancelled".to_string()))
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn stream_items_are_counted_by_entry_and_direction_on_both_sides() {
    let _traced = traced();
    let meters = common::otel::Meters::new();
    let reg = InProcessRegistry::new();
    let market = Market::default();
    let server = Server::builder()
        .registry(reg.clone())
        .meter(meters.meter.clone())
        .add_service(StocksServer::new(market.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let stocks = StocksClient::new(
        Client::builder()
            .registry(reg.clone())
            .meter(meters.meter.clone())
            .override_options(StocksClient::SERVICE_ID, options(100))
            .fallback(StocksServer::new(Cache::default()))
            .build(),
    );
    let prices = accepted_items("prices", stocks.prices(5))
        .await
        .expect("items");
    assert_eq!(prices.len(), 5);
    // A fallback's stream: its items did not come from the server, and are not counted.
    market.down.store(true, Ordering::SeqCst);
    let cached = accepted_items("prices", stocks.prices(3))
        .await
        .expect("the fallback's items");
    assert_eq!(cached, [1000, 1001, 1002]);
    market.down.store(false, Ordering::SeqCst);
    let total = within("total", stocks.total(RpcStream::iter(1..=4u64)))
        .await
        .expect("total");
    assert_eq!(total, 10);
    let doubled = accepted_items("double", stocks.double(RpcStream::iter([1u64, 2, 3])))
        .await
        .expect("items");
    assert_eq!(doubled, [2, 4, 6]);
    within("shutdown", server.shutdown()).await;

    let metrics = meters.read();
    let items = |entry: &str, direction: &str| {
        counter(
            &metrics,
            "rpc.client.stream.items",
            &[
                ("rpc.entry_id", Value::from(entry.to_string())),
                ("rpc.stream.direction", Value::from(direction.to_string())),
            ],
        )
    };
    assert_eq!(
        items("g.Stocks.prices", "received"),
        5,
        "the server's, not the fallback's"
    );
    assert_eq!(items("g.Stocks.prices", "sent"), 0);
    assert_eq!(items("g.Stocks.total", "sent"), 4);
    assert_eq!(items("g.Stocks.total", "received"), 1);
    assert_eq!(items("g.Stocks.double", "sent"), 3);
    assert_eq!(items("g.Stocks.double", "received"), 3);
    // The server's side: what it sent, and the caller's items its handler took.
    let served = |entry: &str, direction: &str| {
        counter(
            &metrics,
            "rpc.server.stream.items",
            &[
                ("rpc.entry_id", Value::from(entry.to_string())),
                ("rpc.stream.direction", Value::from(direction.to_string())),
            ],
        )
    };
    assert_eq!(served("g.Stocks.prices", "sent"), 5);
    assert_eq!(served("g.Stocks.total", "received"), 4);
    assert_eq!(served("g.Stocks.double", "sent"), 3);
    assert_eq!(served("g.Stocks.double", "received"), 3);
    // One call each, counted at the stream's end with its status.
    let calls = |method: &str| {
        counter(
            &metrics,
            "rpc.client.calls",
            &[
                ("rpc.method", Value::from(method.to_string())),
                ("rpc.status_code", Value::I64(200)),
            ],
        )
    };
    assert_eq!(
        (calls("prices"), calls("total"), calls("double")),
        (1, 1, 1)
    );
}

/// A compressible text of about `n` bytes, with "needle" in it now and then.
fn haystack(n: usize) -> String {
    let mut out = String::with_capacity(n + 64);
    let mut i = 0;
    while out.len() < n {
        if i % 97 == 0 {
            out.push_str("needle ");
        }
        out.push_str(&format!("hay {i} "));
        i += 1;
    }
    out
}

#[tokio::test]
async fn a_streams_set_up_arguments_are_compressed_with_the_entrys_option() {
    use rpc::crates::core::Compression;
    use rpc::Codec;
    let (traces, _guard) = Traces::install();
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let stocks = stocks_with(
        &reg,
        GovernanceOverrides {
            compression: Some(Compression::Zstd),
            compression_threshold: Some(1024),
            ..options(100)
        },
    );
    let text = haystack(64 * 1024);
    let found = accepted_items("find", stocks.find(text.clone(), "needle".into()))
        .await
        .expect("items");
    let expected = positions(&text, "needle");
    assert!(expected.len() > 10);
    assert_eq!(
        found, expected,
        "the server decoded the compressed arguments"
    );
    let tally = within(
        "tally",
        stocks.tally(text.clone(), RpcStream::iter([1u64, 2])),
    )
    .await
    .expect("the answer");
    assert_eq!(tally, text.len() as u64 + 3, "a client stream's too");
    within("shutdown", server.shutdown()).await;

    // The oracle: the arguments as the codec encodes them, and what the zstd crate makes of
    // them at level 1 (the level the framework documents).
    let encoded = Codec::MsgPack
        .encode(&(text.as_str(), "needle"))
        .expect("encode");
    let packed = zstd::bulk::compress(&encoded, 1).expect("zstd");
    let spans = traces.spans();
    let attempt = spans
        .iter()
        .find(|s| {
            s.name == "rpc.client.attempt"
                && attr(s, "rpc.method") == Some(Value::from("find".to_string()))
        })
        .expect("the set-up's attempt span");
    assert_eq!(
        attr(attempt, "rpc.compression"),
        Some(Value::from("zstd".to_string()))
    );
    assert_eq!(
        attr(attempt, "rpc.request.size"),
        Some(Value::I64(encoded.len() as i64))
    );
    assert_eq!(
        attr(attempt, "rpc.request.compressed_size"),
        Some(Value::I64(packed.len() as i64))
    );
}

/// What a user's layer saw of one call: its entry, the set-up's status, and how the stream
/// ended (status, items sent, items received), once it did.
type Seen = (String, &'static str, Option<StatusCode>, u64, u64);

/// A user's client layer: records each call's set-up and asks to be told of its stream's end.
fn watcher(seen: mpsc::UnboundedSender<Seen>) -> impl rpc::Middleware {
    rpc::middleware_fn(move |cx, req, next| {
        let seen = seen.clone();
        Box::pin(async move {
            let entry = cx.entry_id().to_string();
            let (tx, at_end) = (seen.clone(), entry.clone());
            cx.on_stream_end(move |end| {
                let _ = tx.send((
                    at_end,
                    "end",
                    end.status,
                    end.items_sent,
                    end.items_received,
                ));
            });
            let result = next.run(cx, req).await;
            let status = match &result {
                Ok(_) => StatusCode::Success,
                Err(e) => e.code(),
            };
            let _ = seen.send((entry, "set-up", Some(status), 0, 0));
            result
        })
    })
}

#[rpc::service(name = "g.Spans")]
trait Spans {
    /// The name of the span current at the set-up, then `n` items each naming the span
    /// current as it was produced.
    async fn current(&self, n: u32) -> Result<RpcStream<String>, RpcError>;
}

struct SpanNames;

fn current_span_name() -> String {
    tracing::Span::current()
        .metadata()
        .map_or("(none)", |m| m.name())
        .to_string()
}

impl Spans for SpanNames {
    async fn current(&self, n: u32) -> Result<RpcStream<String>, RpcError> {
        let at_set_up = current_span_name();
        let items = std::iter::once(at_set_up).chain((0..n).map(|_| current_span_name()));
        Ok(RpcStream::iter(items))
    }
}

/// A stream's set-up and its producer run in the call's `rpc.server` span, as a unary
/// handler does (their events are the call's, and the calls they make continue its trace).
#[tokio::test]
async fn a_streams_set_up_and_producer_run_in_the_server_span() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(SpansServer::new(SpanNames))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let spans = SpansClient::new(Client::builder().registry(reg).build());
    let names = accepted_items("current", spans.current(2))
        .await
        .expect("items");
    assert_eq!(names, ["rpc.server", "rpc.server", "rpc.server"]);
    within("shutdown", server.shutdown()).await;
}

/// A server layer's stream-end hook runs in the call's `rpc.server` span, as the layer itself
/// and the handler do: what it logs or measures is the call's. Before, it ran in no span when
/// the stream's end came from its connection.
#[tokio::test]
async fn a_layers_stream_end_hook_runs_in_the_server_span() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(SpansServer::new(SpanNames))
        .layer(rpc::server_layer_fn(move |req, next| {
            let seen = seen_tx.clone();
            req.on_stream_end(move |_| {
                let _ = seen.send(current_span_name());
            });
            Box::pin(async move { next.run(req).await })
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let spans = SpansClient::new(Client::builder().registry(reg).build());
    let names = accepted_items("current", spans.current(1))
        .await
        .expect("items");
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!(recv_one("the hook", &mut seen).await, "rpc.server");
    within("shutdown", server.shutdown()).await;
}

/// A client layer that answers every call itself, never reaching the server.
struct AnswersItself;

impl rpc::Middleware for AnswersItself {
    fn call<'a>(
        &'a self,
        _cx: &'a mut rpc::CallCx<'_>,
        _req: rpc::Bytes,
        _next: rpc::Next<'a>,
    ) -> rpc::BoxFuture<'a, Result<rpc::Bytes, RpcError>> {
        Box::pin(async { Ok(rpc::Bytes::new()) })
    }
}

/// A stream's set-up that a client layer answered itself opened no stream: the caller gets a
/// 500 saying so, and the call is recorded with it (not as a stream its caller dropped).
#[tokio::test]
async fn a_stream_set_up_a_layer_answered_is_recorded_as_the_error_it_returns() {
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let client = Client::builder()
        .registry(reg.clone())
        .override_options(StocksClient::SERVICE_ID, options(100))
        .layer(AnswersItself)
        .build();
    let mut records = common::observe_calls(&client);
    let stocks = StocksClient::new(client);
    let e = match within("prices", stocks.prices(3)).await {
        Ok(_) => panic!("no stream was opened"),
        Err(e) => e,
    };
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(e.message().contains("without a stream"), "{e}");
    assert_eq!(
        records.try_recv().ok(),
        Some((
            "g.Stocks.prices".to_string(),
            Some(StatusCode::FrameworkError),
            "error".to_string()
        ))
    );
    within("shutdown", server.shutdown()).await;
}

/// A stream its caller drops past its deadline timed out, and a client layer's end hook says
/// so whether or not anything traces the call (no subscriber here): the deadline is the
/// stream's own, not read only for its span.
#[tokio::test(start_paused = true)]
async fn a_stream_dropped_past_its_deadline_ends_as_timed_out_for_a_client_layer() {
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let (tx, mut seen) = mpsc::unbounded_channel();
    let stocks = StocksClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(
                StocksClient::SERVICE_ID,
                GovernanceOverrides {
                    timeout_ms: Some(100),
                    ..options(100)
                },
            )
            .layer(watcher(tx))
            .build(),
    );
    let mut prices = within("prices", stocks.prices(1_000_000))
        .await
        .expect("accepted");
    assert!(within("an item", prices.next()).await.is_some());
    tokio::time::advance(std::time::Duration::from_millis(200)).await;
    drop(prices);
    let ends: Vec<_> = std::iter::from_fn(|| seen.try_recv().ok())
        .filter(|s| s.1 == "end")
        .map(|s| s.2)
        .collect();
    assert_eq!(ends, [Some(StatusCode::Timeout)]);
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_client_layer_sees_a_streams_set_up_and_its_end() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let (server, market) = serve(&reg).await;
    let (tx, mut seen) = mpsc::unbounded_channel();
    let stocks = StocksClient::new(
        Client::builder()
            .registry(reg.clone())
            .override_options(StocksClient::SERVICE_ID, options(100))
            .layer(watcher(tx))
            .build(),
    );
    let next = |seen: &mut mpsc::UnboundedReceiver<Seen>| seen.try_recv().ok();

    // A server stream: the set-up when it is accepted, the end once read to its end.
    let mut prices = within("prices", stocks.prices(3)).await.expect("accepted");
    assert_eq!(
        next(&mut seen),
        Some((
            "g.Stocks.prices".into(),
            "set-up",
            Some(StatusCode::Success),
            0,
            0
        ))
    );
    assert!(within("an item", prices.next()).await.is_some());
    assert_eq!(next(&mut seen), None, "not ended yet");
    while let Some(item) = within("an item", prices.next()).await {
        item.expect("an item");
    }
    assert_eq!(
        next(&mut seen),
        Some((
            "g.Stocks.prices".into(),
            "end",
            Some(StatusCode::Success),
            0,
            3
        ))
    );

    // A client stream: the items sent and the answer.
    let total = within("total", stocks.total(RpcStream::iter(1..=4u64)))
        .await
        .expect("total");
    assert_eq!(total, 10);
    assert_eq!(
        next(&mut seen),
        Some((
            "g.Stocks.total".into(),
            "set-up",
            Some(StatusCode::Success),
            0,
            0
        ))
    );
    assert_eq!(
        next(&mut seen),
        Some((
            "g.Stocks.total".into(),
            "end",
            Some(StatusCode::Success),
            4,
            1
        ))
    );

    // An error after acceptance: its status at the end.
    let end = accepted_items("break_after", stocks.break_after(2))
        .await
        .expect_err("the server's error");
    assert_eq!(end.code(), StatusCode::ServerError);
    assert_eq!(next(&mut seen).map(|s| s.1), Some("set-up"));
    assert_eq!(
        next(&mut seen),
        Some((
            "g.Stocks.break_after".into(),
            "end",
            Some(StatusCode::ServerError),
            0,
            2
        ))
    );

    // A stream its caller drops: ended without a status.
    let mut prices = within("prices", stocks.prices(100))
        .await
        .expect("accepted");
    assert!(within("an item", prices.next()).await.is_some());
    assert_eq!(next(&mut seen).map(|s| s.1), Some("set-up"));
    drop(prices);
    assert_eq!(
        next(&mut seen),
        Some(("g.Stocks.prices".into(), "end", None, 0, 1))
    );

    // A set-up that fails: the layer sees the failure, and no end.
    market.down.store(true, Ordering::SeqCst);
    let err = within("prices", stocks.prices(3))
        .await
        .expect_err("the set-up fails");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    assert_eq!(
        next(&mut seen),
        Some((
            "g.Stocks.prices".into(),
            "set-up",
            Some(StatusCode::ServerError),
            0,
            0
        ))
    );
    assert_eq!(next(&mut seen), None, "no end for a stream never opened");
    within("shutdown", server.shutdown()).await;
}

/// Items of a zstd entry, large enough to be compressed, arrive whole both ways between the
/// framework's client and server. (That they travel compressed is checked on the wire, with a
/// raw peer on each side: `on_the_wire_the_server_takes_and_sends_compressed_items_...` and
/// `on_the_wire_the_client_sends_compressed_items_...`.)
#[tokio::test]
async fn stream_items_of_a_compressed_entry_arrive_whole_both_ways_between_client_and_server() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let stocks = StocksClient::new(client(&reg, None));
    let lines: Vec<String> = (0..5).map(|i| haystack(8 * 1024 + i)).collect();
    let back = accepted_items(
        "shout",
        stocks.shout("> ".into(), RpcStream::iter(lines.clone())),
    )
    .await
    .expect("every item");
    let expected: Vec<String> = lines.iter().map(|l| shouted("> ", l)).collect();
    assert_eq!(back, expected);
    within("shutdown", server.shutdown()).await;
}

/// A client stream's answer follows its entry's compression as a unary answer does: the
/// joined parts of a zstd entry come back compressed (and whole) to a client that accepts zstd.
#[tokio::test]
async fn a_client_streams_answer_is_compressed_as_its_entry_says() {
    use rpc::Codec;
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let mut raw = raw_zstd_client(&server, false).await;
    raw.open_client_stream(1, "g.Stocks.join").await;
    let parts: Vec<String> = (0..4).map(|_| haystack(16 * 1024)).collect();
    for part in &parts {
        raw.send_item(1, Codec::MsgPack.encode(part).expect("encode"), 0)
            .await;
    }
    raw.end_stream(1, 200, "").await;
    let end = raw.recv_end().await;
    assert_eq!((end.message_id, end.status_code), (1, 200), "{end:?}");
    let (plain, answer) = zstd_text(end.compression, &end.result);
    assert_eq!(answer, parts.concat());
    assert!(
        end.result.len() < plain.len() / 2,
        "{} bytes",
        end.result.len()
    );
    drop(raw);
    // The framework's own client reads it back whole.
    let stocks = StocksClient::new(client(&reg, None));
    let got = within("join", stocks.join(RpcStream::iter(parts.clone())))
        .await
        .expect("joined");
    assert_eq!(got, parts.concat());
    within("shutdown", server.shutdown()).await;
}

/// A raw client that accepts zstd and streams, against the real server: the server
/// decompresses a compressed item, compresses its own items of the entry (declared zstd), and
/// ends a stream whose item does not decompress with 500, the connection going on.
#[tokio::test]
async fn on_the_wire_the_server_takes_and_sends_compressed_items_and_ends_a_stream_on_a_corrupt_one(
) {
    let _traced = traced();
    use rpc::crates::core::wire::{frame::Kind, StreamMode};
    use rpc::crates::core::Compression;
    use rpc::crates::transport::compression::compress;
    use rpc::Codec;
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let mut raw = raw_zstd_client(&server, false).await;
    let open = |id: u64| {
        Kind::Invoke(stream_opening(
            id,
            "g.Stocks.shout",
            &(">",),
            StreamMode::Bidi,
        ))
    };
    let line = haystack(16 * 1024);
    let encoded = Codec::MsgPack.encode(&line).expect("encode");
    let packed = compress(Compression::Zstd, &encoded);
    assert!(packed.len() < encoded.len() / 4);

    raw.send(open(1)).await.expect("open");
    raw.recv_acceptance(1).await;
    raw.send_item(1, packed, Compression::Zstd.to_wire()).await;
    let item = loop {
        match within("the answer's item", raw.recv()).await {
            Some(Kind::StreamItem(item)) => break item,
            Some(Kind::StreamCredit(_)) => continue,
            other => panic!("expected an item, got {other:?}"),
        }
    };
    let (_, answer) = zstd_text(item.compression, &item.payload);
    assert_eq!(
        answer,
        shouted(">", &line),
        "the server read the compressed item"
    );
    raw.end_stream(1, 200, "").await;
    let end = raw.recv_end().await;
    assert_eq!((end.message_id, end.status_code), (1, 200));

    // A corrupt item: that stream ends with 500, saying why.
    raw.send(open(2)).await.expect("open");
    raw.recv_acceptance(2).await;
    raw.send_item(
        2,
        rpc::Bytes::from_static(b"not zstd at all"),
        Compression::Zstd.to_wire(),
    )
    .await;
    let end = raw.recv_end().await;
    assert_eq!((end.message_id, end.status_code), (2, 500), "{end:?}");
    assert!(end.exception_message.contains("stream item"), "{end:?}");

    // The connection goes on: a third stream works.
    raw.send(open(3)).await.expect("open");
    raw.recv_acceptance(3).await;
    // (Closing the connection ends that open stream, which would otherwise hold the drain.)
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A client speaking frames by hand to `server`: it streams, with a window of 8 items, in
/// batches when `batches`, and accepts zstd.
async fn raw_zstd_client(server: &rpc::ServerHandle, batches: bool) -> common::RawConn {
    use rpc::crates::core::wire::{frame::Kind, Hello};
    use rpc::crates::core::Compression;
    let mut raw = common::RawConn::connect(server.local_addr()).await;
    raw.send(Kind::Hello(Hello {
        protocol_version: 1,
        client_id: "raw-zstd".into(),
        streams: true,
        stream_window: 8,
        stream_batches: batches,
        accept_compression: vec![Compression::Zstd.to_wire()],
        ..Default::default()
    }))
    .await
    .expect("hello");
    assert!(matches!(raw.recv().await, Some(Kind::HelloAck(a)) if a.streams));
    raw
}

/// Held by a test measuring the process's peak memory, for the whole measure.
static MEASURING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Starts a measure of this process's peak memory: the peak (`VmHWM`) is reset to what the
/// process holds now (`/proc/self/clear_refs`), so a peak an earlier test reached cannot hide
/// this one's growth; returns it, in bytes.
///
/// One measure at a time ([`MEASURING`], held by the caller): another's reset would cut its
/// peak short.
fn peak_reset() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak resident memory");
    peak_resident_bytes()
}

/// The peak resident memory of this process since the last reset (`VmHWM`), in bytes.
fn peak_resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb * 1024
}

/// A zstd item under 4 KiB that expands to 8 MiB (of zeros).
fn expanding_item() -> rpc::Bytes {
    use rpc::crates::core::Compression;
    let item =
        rpc::crates::transport::compression::compress(Compression::Zstd, &vec![0u8; 8 << 20]);
    assert!(item.len() < 4096, "{} bytes", item.len());
    item
}

/// Checks that the peak memory of this process grew by less than 128 MiB since `before` while
/// `who` was sent 64 items of 8 MiB.
fn assert_expanded_one_at_a_time(before: u64, who: &str) {
    let grew = peak_resident_bytes().saturating_sub(before);
    assert!(
        grew < 128 << 20,
        "the {who}'s peak memory grew by {} MiB for 64 items of 8 MiB",
        grew >> 20
    );
}

/// Compressed items wait compressed until the handler takes them: a frame of small zstd items
/// that each expand to 8 MiB (512 MiB in all) costs the server one item's expansion at a time,
/// not the frame's. Here the handler cannot read the first (zeros are not its text): that
/// stream ends with an error, the rest never expanded.
#[tokio::test]
async fn compressed_items_are_expanded_one_at_a_time_as_the_handler_takes_them() {
    use rpc::crates::core::wire::{frame::Kind, StreamItems, StreamMode};
    use rpc::crates::core::Compression;
    let reg = InProcessRegistry::new();
    let (server, _market) = serve(&reg).await;
    let mut raw = raw_zstd_client(&server, true).await;
    raw.open_stream(1, "g.Stocks.shout", &(">",), StreamMode::Bidi)
        .await;
    raw.recv_acceptance(1).await;
    let expands = expanding_item();
    let _measuring = MEASURING.lock().await;
    let before = peak_reset();
    raw.send(Kind::StreamItems(StreamItems {
        message_id: 1,
        payloads: vec![expands; 64],
        compression: Compression::Zstd.to_wire(),
    }))
    .await
    .expect("items");
    let end = raw.recv_end().await;
    assert_eq!(end.message_id, 1);
    assert_ne!(end.status_code, 200, "{end:?}");
    assert_expanded_one_at_a_time(before, "server");
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A raw server that accepts zstd and streams, against the real client: the client compresses
/// its items of the entry (declared zstd), decompresses the server's, and ends the stream (only)
/// with 500 on an item that does not decompress, telling the server to stop.
#[tokio::test]
async fn on_the_wire_the_client_sends_compressed_items_and_ends_a_stream_on_a_corrupt_one() {
    let _traced = traced();
    use common::RawConn;
    use rpc::crates::core::wire::{frame::Kind, HelloAck};
    use rpc::crates::core::Compression;
    use rpc::crates::transport::compression::compress;
    use rpc::Codec;
    let (listener, addr) = raw_listener().await;
    let line = haystack(16 * 1024);
    let expected_line = line.clone();
    let raw_server = tokio::spawn(async move {
        let ack = HelloAck {
            accept_compression: vec![Compression::Zstd.to_wire()],
            ..streaming_ack(8)
        };
        let (mut peer, hello) = RawConn::accept_with(&listener, ack).await;
        assert!(hello.accept_compression.contains(&1), "{hello:?}");
        let id = peer.recv_invoke("the stream's opening").await.message_id;
        peer.grant(id, 8).await;
        let item = match within("the caller's item", peer.recv()).await {
            Some(Kind::StreamItem(item)) => item,
            other => panic!("expected an item, got {other:?}"),
        };
        let (_, got) = zstd_text(item.compression, &item.payload);
        assert_eq!(got, expected_line);
        // One good compressed item back, then a corrupt one.
        let answer = Codec::MsgPack.encode(&shouted(">", &got)).expect("encode");
        for (payload, compression) in [
            (
                compress(Compression::Zstd, &answer),
                Compression::Zstd.to_wire(),
            ),
            (
                rpc::Bytes::from_static(b"not zstd at all"),
                Compression::Zstd.to_wire(),
            ),
        ] {
            peer.send_item(id, payload, compression).await;
        }
        // The client tells this server to stop the stream.
        loop {
            match within("the Cancel", peer.recv()).await {
                Some(Kind::Cancel(c)) => break assert_eq!(c.message_id, id),
                Some(Kind::StreamItem(_) | Kind::StreamEnd(_)) => continue,
                other => panic!("expected Cancel, got {other:?}"),
            }
        }
    });
    let stocks = StocksClient::new(client_of(addr));
    // The caller's items: one line, then none yet, the stream left open.
    let (more, rx) = mpsc::channel::<String>(1);
    more.send(line.clone()).await.expect("the first line");
    let items = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut back = within("shout", stocks.shout(">".into(), RpcStream::new(items)))
        .await
        .expect("accepted");
    let first = within("first", back.next()).await.expect("an item");
    assert_eq!(first.expect("decompressed"), shouted(">", &line));
    let end = within("the end", back.next())
        .await
        .expect("an error item")
        .expect_err("the corrupt item ends the stream");
    assert_eq!(end.code(), StatusCode::FrameworkError, "{end}");
    assert_eq!(end.code().as_u32(), 500);
    assert!(end.message().contains("stream item"), "{end}");
    assert!(back.next().await.is_none(), "nothing after the error");
    // The ended stream stops asking for the caller's items and lets them go, while the
    // answer stream is still held.
    within("the caller's items let go", more.closed()).await;
    drop(back);
    within("the raw server", raw_server)
        .await
        .expect("raw server");
}

/// A server may compress the answer that ends a client stream, or a refusal's typed error
/// (`proto/rpc.proto` allows any result to be): the client reads both decompressed, as it
/// reads a unary answer.
#[tokio::test]
async fn a_client_streams_compressed_answer_and_a_compressed_refusal_are_read_decompressed() {
    use common::RawConn;
    use rpc::crates::core::wire::{frame::Kind, RemoteResultMessage};
    use rpc::crates::core::Compression;
    use rpc::crates::transport::compression::compress;
    use rpc::Codec;
    let (listener, addr) = raw_listener().await;
    let raw_server = tokio::spawn(async move {
        let (mut peer, hello) = RawConn::accept_with(&listener, streaming_ack(8)).await;
        assert!(hello.accept_compression.contains(&1), "{hello:?}");
        let id = peer.recv_invoke("the stream's opening").await.message_id;
        peer.grant(id, 8).await;
        // The caller's numbers, summed here, up to their end.
        let mut sum = 0u64;
        loop {
            match within("the caller's items", peer.recv()).await {
                Some(Kind::StreamItem(item)) => {
                    sum += Codec::MsgPack
                        .decode::<u64>(&item.payload)
                        .expect("a number")
                }
                Some(Kind::StreamEnd(end)) => break assert_eq!(end.status_code, 200),
                other => panic!("expected an item or the end, got {other:?}"),
            }
        }
        let answer = Codec::MsgPack.encode(&sum).expect("encode");
        peer.send(Kind::Result(RemoteResultMessage {
            message_id: id,
            status_code: 200,
            result: compress(Compression::Zstd, &answer),
            compression: Compression::Zstd.to_wire(),
            ..Default::default()
        }))
        .await
        .expect("answer");
        // The next stream is refused with a business error carrying a typed value.
        let id = peer
            .recv_invoke("the second stream's opening")
            .await
            .message_id;
        let detail = Codec::MsgPack.encode(&"market closed").expect("encode");
        peer.send(Kind::Result(RemoteResultMessage {
            message_id: id,
            status_code: 1000,
            exception_message: "closed".into(),
            result: compress(Compression::Zstd, &detail),
            compression: Compression::Zstd.to_wire(),
            ..Default::default()
        }))
        .await
        .expect("refusal");
        sum
    });
    let stocks = StocksClient::new(client_of(addr));
    let numbers = [1u64 << 40, 7, 1 << 20];
    let total = within("total", stocks.total(RpcStream::iter(numbers)))
        .await
        .expect("the answer, decompressed");
    let refused = match within("prices", stocks.prices(3)).await {
        Ok(_) => panic!("the raw server refuses the second stream"),
        Err(e) => e,
    };
    let summed = within("the raw server", raw_server)
        .await
        .expect("raw server");
    assert_eq!(summed, numbers.iter().sum::<u64>());
    assert_eq!(total, summed);
    assert_eq!(refused.code(), StatusCode::BusinessError, "{refused}");
    let (codec, payload) = refused.payload().expect("the typed error's value");
    let detail: String = codec.decode(payload).expect("decompressed");
    assert_eq!(detail, "market closed");
}

/// A server that completes a client stream (status 200) without its answer: the caller gets a
/// 500 saying so, and the call is recorded with that error, not as a success.
#[tokio::test]
async fn a_client_stream_completed_without_an_answer_is_recorded_as_the_error_it_returns() {
    use common::RawConn;
    use rpc::crates::core::wire::frame::Kind;
    let (listener, addr) = raw_listener().await;
    let raw_server = tokio::spawn(async move {
        let (mut peer, _) = RawConn::accept_with(&listener, streaming_ack(8)).await;
        let id = peer.recv_invoke("the stream's opening").await.message_id;
        peer.grant(id, 8).await;
        loop {
            match within("the caller's items", peer.recv()).await {
                Some(Kind::StreamItem(_)) => continue,
                Some(Kind::StreamEnd(_)) => break,
                other => panic!("expected an item or the end, got {other:?}"),
            }
        }
        peer.answer(id, 200, "").await;
    });
    let client = client_of(addr);
    let mut records = common::observe_calls(&client);
    let stocks = StocksClient::new(client);
    let e = within("total", stocks.total(RpcStream::iter([1u64, 2])))
        .await
        .expect_err("no answer");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(e.message().contains("without an answer"), "{e}");
    within("the raw server", raw_server)
        .await
        .expect("raw server");
    assert_eq!(
        records.try_recv().ok(),
        Some((
            "g.Stocks.total".to_string(),
            Some(StatusCode::FrameworkError),
            "error".to_string()
        ))
    );
}

/// The client holds a server's compressed items as they came and expands each when the consumer
/// takes it: a frame of small zstd items that each expand to 8 MiB (512 MiB in all) never
/// costs it the frame's expansion.
#[tokio::test]
async fn a_clients_compressed_items_are_expanded_one_at_a_time_as_they_are_taken() {
    use common::RawConn;
    use rpc::crates::core::wire::{frame::Kind, HelloAck, StreamItems};
    use rpc::crates::core::Compression;
    let (listener, addr) = raw_listener().await;
    let expands = expanding_item();
    let _measuring = MEASURING.lock().await;
    let before = peak_reset();
    let raw_server = tokio::spawn(async move {
        let ack = HelloAck {
            stream_batches: true,
            accept_compression: vec![Compression::Zstd.to_wire()],
            ..streaming_ack(8)
        };
        let (mut peer, _) = RawConn::accept_with(&listener, ack).await;
        let id = peer.recv_invoke("the stream's opening").await.message_id;
        peer.grant(id, 8).await;
        peer.send(Kind::StreamItems(StreamItems {
            message_id: id,
            payloads: vec![expands; 64],
            compression: Compression::Zstd.to_wire(),
        }))
        .await
        .expect("items");
        // Until the client gives the stream up (or goes).
        loop {
            match within("the Cancel", peer.recv()).await {
                Some(Kind::Cancel(_)) | None => break,
                Some(_) => continue,
            }
        }
    });
    let stocks = StocksClient::new(client_of(addr));
    let mut back = within(
        "shout",
        stocks.shout(">".into(), RpcStream::iter(Vec::<String>::new())),
    )
    .await
    .expect("accepted");
    // Zeros are not the method's text: the first item taken ends the stream.
    let first = within("first", back.next()).await.expect("an item");
    assert!(first.is_err(), "{first:?}");
    drop(back);
    within("the raw server", raw_server)
        .await
        .expect("raw server");
    assert_expanded_one_at_a_time(before, "client");
}

/// A server layer that records in `seen` each set-up it sees and each stream's end, and
/// refuses the caller `intruder`.
fn server_gate(seen: mpsc::UnboundedSender<String>) -> impl rpc::ServerLayer {
    rpc::server_layer_fn(move |req, next| {
        let seen = seen.clone();
        Box::pin(async move {
            let entry = req.entry_id();
            let _ = seen.send(entry.to_string());
            req.on_stream_end(move |end| {
                let _ = seen.send(format!(
                    "end {entry} {:?} sent {} received {}",
                    end.status.map(StatusCode::as_u32),
                    end.items_sent,
                    end.items_received
                ));
            });
            if req.caller().client_id() == "intruder" {
                return Err(RpcError::new(
                    StatusCode::UnAuthorization,
                    "intruders stream nothing",
                ));
            }
            next.run(req).await
        })
    })
}

/// A server layer that passes every call on.
fn pass_through() -> impl rpc::ServerLayer {
    rpc::server_layer_fn(|req, next| Box::pin(next.run(req)))
}

/// With a layer on the server, a client stream over its entry's cap is refused (515) before
/// it is accepted, as without layers: the caller may still go elsewhere. (Before, the stream
/// was accepted first and refused after its layers ran, a failure no caller retries.)
#[tokio::test]
async fn a_client_stream_over_the_cap_behind_a_layer_is_refused_before_acceptance() {
    use rpc::crates::core::wire::{frame::Kind, StreamMode};
    let server = Server::builder()
        .max_concurrency(1)
        .layer(pass_through())
        .add_service(StocksServer::new(Market::default()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let mut raw = raw_zstd_client(&server, false).await;
    let total = |id: u64| {
        Kind::Invoke(stream_opening(
            id,
            "g.Stocks.total",
            &(),
            StreamMode::Client,
        ))
    };
    // The first stream takes the entry's only slot (it sends no items, and never ends).
    raw.send(total(1)).await.expect("send");
    match within("the first stream's acceptance", raw.recv()).await {
        Some(Kind::StreamCredit(c)) if c.message_id == 1 => {}
        other => panic!("expected the first stream's acceptance, got {other:?}"),
    }
    raw.send(total(3)).await.expect("send");
    match within("the second stream's answer", raw.recv()).await {
        Some(Kind::Result(r)) => {
            assert_eq!((r.message_id, r.status_code), (3, 515), "{r:?}");
        }
        other => panic!("expected the second stream refused before acceptance, got {other:?}"),
    }
    drop(raw);
    within("shutdown", server.shutdown()).await;
}

/// A stream taking the caller's items whose end the connection decides, not its handler, is recorded with the
/// end the caller gets: the span's status and the layers' end hooks (with a layer, and
/// without one for the span). Two such ends:
/// - the caller's request stream fails (its `StreamEnd` says 1000) and the handler answers as
///   if it were complete: the caller gets 1000, and so the stream is recorded; before, it
///   was recorded as a success (200);
/// - the caller of a bidirectional stream sends more items than it was granted: the stream is
///   ended with 500 (protocol violation), and so recorded; before, it was recorded as
///   cancelled, with no status, and the hooks were told it was stopped (`None`).
#[tokio::test]
async fn a_stream_ended_by_its_connection_is_recorded_with_the_end_the_caller_gets() {
    use rpc::crates::core::wire::{frame::Kind, StreamEnd, StreamItem, StreamMode};
    let (traces, _guard) = traced();
    for layered in [false, true] {
        let reg = InProcessRegistry::new();
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let mut builder = Server::builder().registry(reg.clone()).stream_window(4);
        if layered {
            builder = builder.layer(server_gate(seen_tx));
        }
        let server = builder
            .add_service(StocksServer::new(Market::default()))
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        let mut raw = raw_zstd_client(&server, false).await;
        let item = |id: u64, n: u64| {
            Kind::StreamItem(StreamItem {
                message_id: id,
                payload: rpc::Codec::MsgPack.encode(&n).expect("encode"),
                ..Default::default()
            })
        };
        let mut ends = BTreeMap::new();
        for (id, entry, mode) in [
            (1, "g.Stocks.lenient_total", StreamMode::Client),
            (3, "g.Stocks.double", StreamMode::Bidi),
        ] {
            let opening = stream_opening(id, entry, &(), mode);
            raw.send(Kind::Invoke(opening)).await.expect("send");
            let window = match within("the acceptance", raw.recv()).await {
                Some(Kind::StreamCredit(c)) if c.message_id == id => c.items,
                other => panic!("expected stream {id} accepted, got {other:?}"),
            };
            assert_eq!(window, 4, "the server's window");
            if id == 1 {
                raw.send(item(id, 5)).await.expect("send");
                raw.send(Kind::StreamEnd(StreamEnd {
                    message_id: id,
                    status_code: 1000,
                    exception_message: "the caller gave up".into(),
                }))
                .await
                .expect("send");
            } else {
                for n in 0..=u64::from(window) {
                    raw.send(item(id, n)).await.expect("send");
                }
            }
            // (Credit for the items taken, and doubled items, may come first.)
            loop {
                match within("the stream's end", raw.recv()).await {
                    Some(Kind::Result(r)) if r.message_id == id => {
                        ends.insert(id, r.status_code);
                        break;
                    }
                    Some(Kind::StreamCredit(c)) if c.message_id == id => {}
                    Some(Kind::StreamItem(i)) if i.message_id == id => {}
                    other => panic!("expected stream {id}'s end, got {other:?}"),
                }
            }
        }
        assert_eq!(
            ends,
            BTreeMap::from([(1, 1000), (3, 500)]),
            "what the caller got"
        );
        fn recorded(entry: &str) -> impl Fn(&&opentelemetry_sdk::trace::SpanData) -> bool {
            let entry = Value::from(entry.to_string());
            move |s| s.name == "rpc.server" && attr(s, "rpc.entry_id") == Some(entry.clone())
        }
        let spans = traces
            .spans_once("the streams' server spans end", |spans| {
                let n = |entry| spans.iter().filter(recorded(entry)).count();
                n("g.Stocks.lenient_total") > usize::from(layered)
                    && n("g.Stocks.double") > usize::from(layered)
            })
            .await;
        for (entry, status) in [("g.Stocks.lenient_total", 1000), ("g.Stocks.double", 500)] {
            let span = spans
                .iter()
                .filter(recorded(entry))
                .nth(usize::from(layered))
                .expect("the span");
            assert_eq!(
                attr(span, "rpc.status_code"),
                Some(Value::I64(status)),
                "layered {layered}: {entry}"
            );
        }
        if layered {
            let mut hooks = Vec::new();
            while hooks.len() < 2 {
                let line = within("the end hooks", seen.recv()).await.expect("a line");
                if let Some(end) = line.strip_prefix("end ") {
                    // Up to the items, which depend on how far the stream went.
                    let cut = end.find(" sent").filter(|_| end.contains("double"));
                    hooks.push(format!("end {}", &end[..cut.unwrap_or(end.len())]));
                }
            }
            hooks.sort();
            assert_eq!(
                hooks[0], "end g.Stocks.double Some(500)",
                "(items each way as far as they went)"
            );
            assert_eq!(
                hooks[1], "end g.Stocks.lenient_total Some(1000) sent 1 received 1",
                "the answer is one item sent"
            );
        }
        drop(raw);
        within("shutdown", server.shutdown()).await;
    }
}

/// A stream whose set-up is refused (515) by one instance while the other cannot stream at all
/// (its handshake offers none: a detour, nothing sent there) ends with the refusal, which the
/// client's fallback answers: the fallback event names the instance that refused and the
/// number of that attempt, as for a unary call. Before, a stream's fallback named the last
/// endpoint tried and the last attempt's number: the detour, when the refusing instance was
/// drawn first. Round robin starts at a random instance in each client, so the calls are made
/// by fresh clients until one drew the refusing instance first (each call checks either way).
#[tokio::test]
async fn a_stream_fallback_after_a_detour_names_the_instance_that_refused() {
    use rpc::crates::core::wire::{frame::Kind, HelloAck};
    use rpc::crates::governance::events::EventKind;
    let (full, full_addr) = raw_listener().await;
    let (old, old_addr) = raw_listener().await;
    // One refuses every stream's set-up; the other is an older server, which does not stream.
    let refusing = tokio::spawn(async move {
        loop {
            let (mut peer, _) = common::RawConn::accept_with(&full, streaming_ack(8)).await;
            tokio::spawn(async move {
                while let Some(Kind::Invoke(open)) = peer.recv().await {
                    peer.answer(open.message_id, 515, "full").await;
                }
            });
        }
    });
    let not_streaming = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let ack = HelloAck {
                protocol_version: 1,
                ..Default::default()
            };
            held.push(common::RawConn::accept_with(&old, ack).await.0);
        }
    });
    let full_addr = full_addr.to_string();
    let mut refused_first = false;
    for _ in 0..12 {
        let client = Client::builder()
            .registry(
                rpc::StaticRegistry::from_list(&format!("{full_addr},{old_addr}"))
                    .expect("registry"),
            )
            .override_options(
                StocksClient::SERVICE_ID,
                GovernanceOverrides {
                    retry_times: Some(1),
                    ..options(100)
                },
            )
            .fallback(StocksServer::new(Cache::default()))
            .build();
        let mut events = client.events().subscribe();
        let stocks = StocksClient::new(client);
        let prices = accepted_items("prices", stocks.prices(2))
            .await
            .expect("the fallback's items");
        assert_eq!(prices, [1000, 1001]);
        let events: Vec<_> = std::iter::from_fn(|| events.try_recv().ok()).collect();
        let retry = events
            .iter()
            .find(|e| e.kind == EventKind::Retry)
            .expect("a retry after the first attempt");
        // The refusal is the first attempt when its instance was drawn first.
        let first = retry.endpoint.as_deref() == Some(full_addr.as_str());
        let fallback = events
            .iter()
            .find(|e| e.kind == EventKind::Fallback)
            .expect("a fallback event");
        assert_eq!(
            (fallback.endpoint.as_deref(), fallback.attempt),
            (Some(full_addr.as_str()), if first { 0 } else { 1 }),
            "{events:?}"
        );
        if first {
            refused_first = true;
            break;
        }
    }
    refusing.abort();
    not_streaming.abort();
    assert!(
        refused_first,
        "no client of 12 drew the refusing instance first"
    );
}

/// A server layer whose stream end hook panics.
struct PanicAtTheEnd;

impl rpc::ServerLayer for PanicAtTheEnd {
    fn call<'a>(
        &'a self,
        req: &'a mut rpc::ServerRequest,
        next: rpc::ServerNext<'a>,
    ) -> rpc::LayerFuture<'a> {
        Box::pin(async move {
            req.on_stream_end(|_| panic!("the end hook fails"));
            next.run(req).await
        })
    }
}

/// Code run as a stream ends, outside the handler (a layer's end hook), panics: the stream
/// still ends, with 520, and its call's slot on the connection is freed (the connection takes
/// one call at a time here, and the next stream is served). Before, the stream's task died
/// with it: no end was sent, the caller waited for ever and the slot was never given back.
#[tokio::test]
async fn a_panic_in_a_stream_end_hook_ends_the_stream_with_520_and_frees_its_slot() {
    let (traces, _guard) = traced();
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .max_in_flight_per_connection(1)
        .layer(PanicAtTheEnd)
        .add_service(StocksServer::new(Market::default()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let stocks = StocksClient::new(client(&reg, None));
    for round in 0..2 {
        // (The stream's items and end may be made in the poll that accepts it: the failure
        // then answers the set-up itself.)
        let end = within("the stream's end", async {
            let mut prices = match stocks.prices(3).await {
                Ok(prices) => prices,
                Err(e) => return e,
            };
            loop {
                match prices.next().await {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return e,
                    None => panic!("round {round}: the stream ended cleanly"),
                }
            }
        })
        .await;
        assert_eq!(end.code(), StatusCode::ServerError, "round {round}: {end}");
        assert!(end.message().contains("panic"), "round {round}: {end}");
    }
    within("shutdown", server.shutdown()).await;
    // The server recorded each stream's end as its caller got it, 520, not the handler's 200.
    for span in &server_spans_of_prices(&traces, "the streams' server spans end", 2).await {
        assert_eq!(
            attr(span, "rpc.status_code"),
            Some(Value::I64(i64::from(StatusCode::ServerError.as_u32())))
        );
    }
}

#[tokio::test]
async fn server_layers_pass_client_and_bidi_streams_hear_of_their_end_and_may_refuse_them() {
    let _traced = traced();
    let reg = InProcessRegistry::new();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let market = Market::default();
    let server = Server::builder()
        .registry(reg.clone())
        .layer(server_gate(seen_tx))
        .add_service(StocksServer::new(market.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let stocks = StocksClient::new(client(&reg, None));
    let total = within("total", stocks.total(RpcStream::iter(1..=100u64)))
        .await
        .expect("total through the layer");
    assert_eq!(total, 5050);
    assert_eq!(seen.try_recv().ok().as_deref(), Some("g.Stocks.total"));
    assert_eq!(
        seen.try_recv().ok().as_deref(),
        Some("end g.Stocks.total Some(200) sent 1 received 100"),
        "the layer heard of the end before the caller had its answer"
    );
    let doubled = accepted_items("double", stocks.double(RpcStream::iter(1..=50u64)))
        .await
        .expect("items");
    assert_eq!(doubled, (1..=50u64).map(|n| n * 2).collect::<Vec<_>>());
    assert_eq!(seen.try_recv().ok().as_deref(), Some("g.Stocks.double"));
    assert_eq!(
        seen.try_recv().ok().as_deref(),
        Some("end g.Stocks.double Some(200) sent 50 received 50")
    );

    let intruder = StocksClient::new(
        Client::builder()
            .registry(reg.clone())
            .client_id("intruder")
            .override_options(StocksClient::SERVICE_ID, options(100))
            .build(),
    );
    let e = within("total", intruder.total(RpcStream::iter(1..=4u64)))
        .await
        .expect_err("the layer refuses");
    assert_eq!(e.code(), StatusCode::UnAuthorization, "{e}");
    let e = within("double", async {
        intruder
            .double(RpcStream::iter([1u64]))
            .await?
            .collect_all()
            .await
    })
    .await
    .expect_err("the layer refuses");
    assert_eq!(e.code(), StatusCode::UnAuthorization, "{e}");
    assert_eq!(
        market.setups.load(Ordering::SeqCst),
        2,
        "the refused streams' handlers never ran"
    );
    let told: Vec<String> = std::iter::from_fn(|| seen.try_recv().ok()).collect();
    assert_eq!(
        told,
        ["g.Stocks.total", "g.Stocks.double"],
        "the refused set-ups seen, and no end for them"
    );
    within("shutdown", server.shutdown()).await;
}

/// A server stream's fallback whose set-up panics fails the stream as a unary call's would:
/// 509, naming the set-up's failure and the fallback's. Before, the panic passed the fallback's
/// outcome by and the caller read 520, a handler that panicked.
#[tokio::test]
async fn a_server_stream_fallback_that_panics_is_answered_509() {
    let (reg, server, market, cache) = with_server_fallback().await;
    market.down.store(true, Ordering::SeqCst);
    cache.broken.store(true, Ordering::SeqCst);
    let stocks = StocksClient::new(client(&reg, None));
    let e = match within("prices", stocks.prices(3)).await {
        Ok(items) => within("items", items.collect_all())
            .await
            .expect_err("the fallback's failure"),
        Err(e) => e,
    };
    assert_eq!(e.code(), StatusCode::FallbackExecFail, "{e}");
    assert_eq!(cache.used.load(Ordering::SeqCst), 1, "the fallback ran");
    within("shutdown", server.shutdown()).await;
}

/// A stream's set-up that fails once the caller's deadline has passed is answered as the
/// timeout (519), naming its error, as a unary handler's failure past the deadline is: the
/// caller's breaker then counts both alike. Before, the set-up's own error (520) went back.
/// A raw caller, whose own timer cannot answer first.
#[tokio::test]
async fn a_stream_set_up_failing_past_the_deadline_is_answered_as_the_timeout() {
    use rpc::crates::core::wire::frame::Kind;
    use rpc::crates::core::StreamMode;
    let reg = InProcessRegistry::new();
    let (server, market) = serve(&reg).await;
    market.down.store(true, Ordering::SeqCst);
    market.late.store(true, Ordering::SeqCst);
    let mut raw = raw_zstd_client(&server, false).await;
    raw.send(Kind::Invoke(rpc::crates::core::wire::RemoteInvokeMessage {
        timeout_ms: 20,
        ..common::stream_opening(1, "g.Stocks.prices", &(3u32,), StreamMode::Server)
    }))
    .await
    .expect("open");
    let end = within("the end", raw.recv_end()).await;
    assert_eq!(end.status_code, 519, "{end:?}");
    assert!(
        end.exception_message.contains("the market is down"),
        "{end:?}"
    );
    assert_eq!(market.setups.load(Ordering::SeqCst), 1);
    within("shutdown", server.shutdown()).await;
}

/// A server stream's set-up still running at the caller's deadline is stopped there (519),
/// and the server's fallback that would answer for that timeout does not start: event
/// `fallback_skipped`, as for a unary call stopped at its deadline. Before, the stream ended
/// with no event. (On the paused clock.)
#[tokio::test(start_paused = true)]
async fn a_stream_set_up_stopped_at_the_deadline_is_fallback_skipped() {
    let (reg, server, market, cache) = with_server_fallback().await;
    market.hangs.store(true, Ordering::SeqCst);
    times_out_with_the_fallback_skipped(&reg, server, &cache).await;
}

/// A server stream's set-up that fails once the caller's deadline has passed is not answered
/// by the server's fallback, which nobody would read: event `fallback_skipped`, as for a
/// unary call. Before, the fallback's set-up ran and the event said `fallback`.
#[tokio::test]
async fn a_server_fallback_does_not_answer_a_set_up_failing_past_the_deadline() {
    let (reg, server, market, cache) = with_server_fallback().await;
    market.down.store(true, Ordering::SeqCst);
    market.late.store(true, Ordering::SeqCst);
    times_out_with_the_fallback_skipped(&reg, server, &cache).await;
}

/// `prices` called with a budget of 100 ms on `reg`'s `server` (whose market misses the
/// deadline): the call times out (519), and the server's fallback (`cache`) does not run,
/// saying so (`fallback_skipped`, not `fallback`).
async fn times_out_with_the_fallback_skipped(
    reg: &InProcessRegistry,
    server: ServerHandle,
    cache: &Cache,
) {
    use rpc::crates::governance::events::EventKind;
    let mut events = server.events().subscribe();
    let stocks = stocks_with(
        reg,
        GovernanceOverrides {
            timeout_ms: Some(100),
            ..options(100)
        },
    );
    let e = within("prices", stocks.prices(3))
        .await
        .map(|_| ())
        .expect_err("answered after the deadline");
    assert_eq!(e.code(), StatusCode::Timeout, "{e}");
    let kind = within("the server's event", async {
        loop {
            match events.recv().await.expect("events").kind {
                k @ (EventKind::Fallback | EventKind::FallbackSkipped) => break k,
                _ => continue,
            }
        }
    })
    .await;
    assert_eq!(kind, EventKind::FallbackSkipped);
    assert_eq!(
        cache.used.load(Ordering::SeqCst),
        0,
        "the fallback must not run"
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_server_fallback_answers_a_server_streams_failed_set_up_only() {
    let (traces, _guard) = traced();
    for (round, layered) in [false, true].into_iter().enumerate() {
        let reg = InProcessRegistry::new();
        let market = Market::default();
        let cache = Cache::default();
        let (seen_tx, _seen) = mpsc::unbounded_channel();
        let builder = Server::builder()
            .registry(reg.clone())
            .add_service(StocksServer::new(market.clone()))
            .fallback(StocksServer::new(cache.clone()));
        let builder = if layered {
            builder.layer(server_gate(seen_tx))
        } else {
            builder
        };
        let server = builder.serve("127.0.0.1:0").await.expect("serve");
        let stocks = StocksClient::new(client(&reg, None));
        market.down.store(true, Ordering::SeqCst);

        let prices = accepted_items("prices", stocks.prices(3))
            .await
            .expect("items");
        assert_eq!(
            prices,
            [1000, 1001, 1002],
            "layered {layered}: the fallback's"
        );
        assert_eq!(cache.used.load(Ordering::SeqCst), 1, "layered {layered}");

        // A business refusal is the handler's answer.
        market.down.store(false, Ordering::SeqCst);
        let e = within("closed", stocks.closed())
            .await
            .expect_err("refused");
        assert_eq!(
            e.code(),
            StatusCode::BusinessError,
            "layered {layered}: {e}"
        );
        market.down.store(true, Ordering::SeqCst);
        // A client stream was accepted before its handler failed: not answered for.
        let e = within("total", stocks.total(RpcStream::iter([1u64, 2])))
            .await
            .expect_err("the handler's failure");
        assert_eq!(e.code(), StatusCode::ServerError, "layered {layered}: {e}");
        assert_eq!(
            cache.used.load(Ordering::SeqCst),
            1,
            "layered {layered}: the fallback answered the server stream only"
        );
        assert_eq!(market.setups.load(Ordering::SeqCst), 3, "layered {layered}");

        // A set-up that panics is answered for as one that failed.
        market.down.store(false, Ordering::SeqCst);
        market.panics.store(true, Ordering::SeqCst);
        let prices = accepted_items("prices", stocks.prices(2))
            .await
            .expect("items");
        assert_eq!(prices, [1000, 1001], "layered {layered}: the fallback's");
        assert_eq!(
            market.setups.load(Ordering::SeqCst),
            4,
            "layered {layered}: the set-up ran and panicked"
        );
        within("shutdown", server.shutdown()).await;

        // The server's spans of the two streams the fallback answered (the drain ended every
        // stream; each span ends as its task drops it): outcome `fallback`, and the failure's
        // status, 520 for the failed set-up and for the panic alike. The test's market answers
        // 520.
        let answered_by_fallback = |s: &&opentelemetry_sdk::trace::SpanData| {
            s.name == "rpc.server"
                && attr(s, "rpc.entry_id") == Some(Value::from("g.Stocks.prices".to_string()))
                && attr(s, "outcome") == Some(Value::from("fallback".to_string()))
        };
        let expected = 2 * (round + 1);
        let spans = traces
            .spans_once("the fallback's server spans end", |spans| {
                spans.iter().filter(answered_by_fallback).count() >= expected
            })
            .await;
        let answered: Vec<_> = spans.iter().filter(answered_by_fallback).collect();
        assert_eq!(answered.len(), expected, "layered {layered}");
        for span in answered {
            assert_eq!(
                attr(span, "rpc.fallback.cause"),
                Some(Value::I64(i64::from(StatusCode::ServerError.as_u32()))),
                "layered {layered}"
            );
            // The fallback answered: the call did not fail (the panic's error-level log line
            // inside the span does not make it one).
            assert!(
                !matches!(span.status, opentelemetry::trace::Status::Error { .. }),
                "layered {layered}: {:?}",
                span.status
            );
        }
    }
}

/// A raw server on `listener` that accepts one stream, sends `items` (MessagePack-encoded
/// `u64`s) on it and ends it 200 with `answer` as its result: a server that does not keep to
/// the stream's shape.
fn nonconforming(
    listener: tokio::net::TcpListener,
    items: &'static [u64],
    answer: Option<u64>,
) -> tokio::task::JoinHandle<()> {
    use common::RawConn;
    use rpc::crates::core::wire::{frame::Kind, RemoteResultMessage};
    use rpc::Codec;
    tokio::spawn(async move {
        let (mut peer, _) = RawConn::accept_with(&listener, streaming_ack(8)).await;
        let id = peer.recv_invoke("the stream's opening").await.message_id;
        peer.grant(id, 8).await;
        for n in items {
            let item = Codec::MsgPack.encode(n).expect("encode");
            peer.send_item(id, item, 0).await;
        }
        let result = answer.map_or_else(Default::default, |a| {
            Codec::MsgPack.encode(&a).expect("encode")
        });
        peer.send(Kind::Result(RemoteResultMessage {
            message_id: id,
            status_code: 200,
            result,
            ..Default::default()
        }))
        .await
        .expect("the end");
        while peer.recv().await.is_some() {}
    })
}

/// A client-streaming call whose server sends items (a server whose method streams its
/// answer) fails with an error saying so. Before, its first item was taken as the answer.
#[tokio::test]
async fn items_from_the_server_on_a_client_streaming_call_fail_it() {
    let (listener, addr) = raw_listener().await;
    let server = nonconforming(listener, &[5], Some(7));
    let stocks = StocksClient::new(client_of(addr));
    let e = within("total", stocks.total(RpcStream::iter([1u64])))
        .await
        .expect_err("items are no answer");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message()
            .contains("sent items on a client-streaming call"),
        "{e}"
    );
    server.abort();
}

/// A server stream ended with an answer (a server whose method is client-streaming) fails
/// after its items, with an error saying so. Before, the answer was yielded as one more item.
#[tokio::test]
async fn an_answer_ending_a_server_stream_fails_it() {
    let (listener, addr) = raw_listener().await;
    let server = nonconforming(listener, &[1, 2], Some(99));
    let stocks = StocksClient::new(client_of(addr));
    let mut prices = within("prices", stocks.prices(3)).await.expect("accepted");
    let mut got = Vec::new();
    let e = loop {
        match within("an item", prices.next()).await {
            Some(Ok(p)) => got.push(p),
            Some(Err(e)) => break e,
            None => panic!("the stream ended after {got:?}"),
        }
    };
    assert_eq!(got, [1, 2]);
    assert!(
        e.message()
            .contains("ended a stream of its items with an answer"),
        "{e}"
    );
    server.abort();
}
