//! Server rate limits over TCP: over the entry's token bucket a call is answered 429 at once
//! with a retry-after the configured rate explains; a caller over its own quota does not take
//! another caller's calls; the client's breaker does not count 429; a client whose only
//! endpoint answered 429 waits the retry-after before trying it again.
//!
//! Over real TCP on tokio's paused clock, which the buckets read: time passes only as the
//! tests let it (a retry-after waited), not as a busy machine stretches it. Each oracle still
//! allows for the time the test took, measured on that clock.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use common::{no_retry, within};
use rpc::{
    BreakerState, Client, EventKind, GovernanceOverrides, InProcessRegistry, LayerFuture, RpcError,
    Server, ServerLayer, ServerNext, ServerRequest, StaticRegistry, StatusCode,
};

/// Configured rates: one call a second, so a test's own few milliseconds hardly refill.
const RATE: u32 = 1;
const ENTRY_BURST: u32 = 10;
const CALLER_BURST: u32 = 4;

#[rpc::service(name = "t.Rate")]
trait Rate {
    /// Limited for all callers together.
    #[governance(rate_limit_per_second = 1, rate_limit_burst = 3)]
    async fn entry(&self) -> Result<u32, RpcError>;
    /// Limited per caller (by client id) and, more loosely, for all callers.
    #[governance(
        rate_limit_per_second = 1,
        rate_limit_burst = 10,
        caller_rate_limit_per_second = 1,
        caller_rate_limit_burst = 4
    )]
    async fn quota(&self) -> Result<u32, RpcError>;
    /// Limited only by what the server sets for every entry.
    async fn free(&self) -> Result<u32, RpcError>;
}

struct Impl;

impl Rate for Impl {
    async fn entry(&self) -> Result<u32, RpcError> {
        Ok(1)
    }
    async fn quota(&self) -> Result<u32, RpcError> {
        Ok(2)
    }
    async fn free(&self) -> Result<u32, RpcError> {
        Ok(3)
    }
}

async fn serve(reg: &InProcessRegistry) -> rpc::ServerHandle {
    Server::builder()
        .registry(reg.clone())
        .add_service(RateServer::new(Impl))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

fn client(reg: &InProcessRegistry, id: &str) -> (Client, RateClient) {
    let client = Client::builder()
        .registry(reg.clone())
        .client_id(id)
        .override_options(
            RateClient::SERVICE_ID,
            rpc::GovernanceOverrides {
                exceptions_allowed_before_breaking: Some(1),
                ..no_retry()
            },
        )
        .build();
    (client.clone(), RateClient::new(client))
}

/// Tokens a bucket of `rate` per second gains in `elapsed`, rounded up.
fn refilled(elapsed: Duration, rate: u32) -> usize {
    (elapsed.as_secs_f64() * f64::from(rate)).ceil() as usize
}

#[tokio::test(start_paused = true)]
async fn over_the_entry_limit_the_call_is_answered_429_with_the_time_to_the_next_token() {
    let reg = InProcessRegistry::new();
    let server = serve(&reg).await;
    let mut events = server.events().subscribe();
    let (_c, rate) = client(&reg, "one");
    let start = Instant::now();
    let mut admitted = 0;
    let refused = loop {
        // Bounded: the burst (3) plus what the bucket can refill meanwhile.
        assert!(admitted < 3 + 20, "never refused");
        match within("a call", rate.entry()).await {
            Ok(v) => {
                assert_eq!(v, 1);
                admitted += 1;
            }
            Err(e) => break e,
        }
    };
    let elapsed = start.elapsed();
    assert!(
        (3..=3 + refilled(elapsed, RATE)).contains(&admitted),
        "burst 3 at {RATE}/s over {elapsed:?}: admitted {admitted}"
    );
    assert_eq!(refused.code(), StatusCode::RateLimited, "{refused}");
    assert_eq!(refused.code().as_u32(), 429);
    assert!(
        refused
            .message()
            .contains("limit for all callers (1 calls/s)"),
        "{refused}"
    );
    assert!(refused.message().contains("retry after"), "{refused}");
    // At 1 call/s the next token is at most 1 s away, and at least 1 s less what has passed
    // since the bucket was last full.
    let after = refused.retry_after().expect("a 429 carries a retry-after");
    let period = Duration::from_secs(1) / RATE;
    assert!(after <= period, "{after:?} > one period {period:?}");
    assert!(
        after + elapsed + Duration::from_millis(1) >= period,
        "{after:?} + {elapsed:?} is short of one period"
    );
    let event = within("the rate_limited event", async {
        loop {
            let e = events.recv().await.expect("events");
            if e.kind != EventKind::Overflow {
                break e;
            }
        }
    })
    .await;
    assert_eq!(event.kind, EventKind::RateLimited);
    assert_eq!(&*event.entry, "t.Rate.entry");
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_greedy_caller_over_its_quota_does_not_take_a_polite_callers_calls() {
    let reg = InProcessRegistry::new();
    let server = serve(&reg).await;
    let (_g, greedy) = client(&reg, "greedy");
    let (_p, polite) = client(&reg, "polite");
    let start = Instant::now();
    // The greedy caller asks for the whole entry burst and more.
    let mut greedy_ok = 0;
    let mut greedy_refused = None;
    for _ in 0..3 * ENTRY_BURST {
        match within("a greedy call", greedy.quota()).await {
            Ok(_) => greedy_ok += 1,
            Err(e) => greedy_refused = Some(e),
        }
    }
    let elapsed = start.elapsed();
    let max_greedy = CALLER_BURST as usize + refilled(elapsed, RATE);
    assert!(
        (CALLER_BURST as usize..=max_greedy).contains(&greedy_ok),
        "greedy admitted {greedy_ok}, its quota allows {CALLER_BURST}..={max_greedy}"
    );
    let e = greedy_refused.expect("the greedy caller is refused");
    assert_eq!(e.code(), StatusCode::RateLimited, "{e}");
    assert!(e.message().contains("quota of caller \"greedy\""), "{e}");
    // What the greedy caller left of the entry's burst is still there for the polite one: all
    // of its calls within that share pass.
    let share = ENTRY_BURST - CALLER_BURST;
    for i in 0..share.min(CALLER_BURST) {
        let v = within("a polite call", polite.quota())
            .await
            .unwrap_or_else(|e| panic!("polite call {i} refused: {e}"));
        assert_eq!(v, 2);
    }
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn many_429s_leave_the_breaker_closed() {
    let reg = InProcessRegistry::new();
    let server = serve(&reg).await;
    let (client, rate) = client(&reg, "one");
    let mut limited = 0;
    for _ in 0..20 {
        if let Err(e) = within("a call", rate.entry()).await {
            assert_eq!(e.code(), StatusCode::RateLimited, "{e}");
            limited += 1;
        }
    }
    assert!(limited >= 10, "only {limited} of 20 calls were limited");
    // The breaker opens after one counted failure: none of the 429s counted.
    assert_eq!(
        client.breaker_state(&RateClient::methods()[0]),
        BreakerState::Closed { failures: 0 }
    );
    server.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_server_wide_caller_quota_limits_entries_that_set_none() {
    const BURST: u32 = 2;
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .caller_rate_limit(RATE, BURST)
        .add_service(RateServer::new(Impl))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let (_c, rate) = client(&reg, "one");
    let start = Instant::now();
    let mut admitted = 0;
    let refused = loop {
        assert!(admitted < BURST as usize + 20, "never refused");
        match within("a call", rate.free()).await {
            Ok(_) => admitted += 1,
            Err(e) => break e,
        }
    };
    let most = BURST as usize + refilled(start.elapsed(), RATE);
    assert!(
        (BURST as usize..=most).contains(&admitted),
        "admitted {admitted}"
    );
    assert_eq!(refused.code(), StatusCode::RateLimited, "{refused}");
    assert!(
        refused.message().contains("quota of caller \"one\""),
        "{refused}"
    );
    // Another caller has a quota of its own.
    let (_o, other) = client(&reg, "other");
    assert_eq!(within("another caller", other.free()).await.expect("ok"), 3);
    server.shutdown().await;
}

/// The server's arrival record: every call that reaches the server, before its entry's rate
/// limits judge it, with when it arrived (the server's clock) and, when it was refused 429,
/// the retry-after the server answered.
#[derive(Clone, Default)]
struct Arrivals(Arc<Mutex<Vec<Arrival>>>);

/// When a call arrived, and the retry-after of its 429 when it was refused.
type Arrival = (tokio::time::Instant, Option<Duration>);

impl Arrivals {
    fn get(&self) -> Vec<Arrival> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl ServerLayer for Arrivals {
    fn call<'a>(&'a self, req: &'a mut ServerRequest, next: ServerNext<'a>) -> LayerFuture<'a> {
        Box::pin(async move {
            let at = tokio::time::Instant::now();
            let result = next.run(req).await;
            let refused = match &result {
                Err(e) if e.code() == StatusCode::RateLimited => {
                    Some(e.retry_after().expect("a 429 carries a retry-after"))
                }
                _ => None,
            };
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((at, refused));
            result
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_refused_429_by_its_only_endpoint_waits_the_retry_after_before_trying_it_again() {
    // 5 calls a second, burst 1: a second call right after the first finds no token and is
    // refused with a retry-after of up to 200 ms. The client retries after 1 ms
    // (`retry_interval_ms`), so a retry that did not wait for the retry-after would arrive
    // with no token yet and be refused again, three retries in a few milliseconds.
    let arrivals = Arrivals::default();
    let server = Server::builder()
        .rate_limit(5, 1)
        .layer(arrivals.clone())
        .add_service(RateServer::new(Impl))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(StaticRegistry::new([server.local_addr().to_string()]))
        .override_options(
            RateClient::SERVICE_ID,
            GovernanceOverrides {
                retry_times: Some(3),
                retry_interval_ms: Some(1),
                timeout_ms: Some(5_000),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let mut events = client.events().subscribe();
    let rate = RateClient::new(client.clone());
    assert_eq!(within("the first call", rate.free()).await.expect("ok"), 3);
    assert_eq!(
        within("the second call", rate.free())
            .await
            .expect("answered after waiting for the next token"),
        3
    );
    let record = arrivals.get();
    // First call admitted; the second call's first attempt refused; its retry admitted.
    let refused: Vec<usize> = (0..record.len())
        .filter(|&i| record[i].1.is_some())
        .collect();
    assert_eq!(
        refused,
        [1],
        "exactly the second call's first attempt is refused: {record:?}"
    );
    assert_eq!(record.len(), 3, "{record:?}");
    let (refused_at, after) = (record[1].0, record[1].1.unwrap_or_default());
    let retried_at = record[2].0;
    assert!(
        retried_at.duration_since(refused_at) >= after,
        "the retry arrived {:?} after the refusal, before its retry-after of {after:?}",
        retried_at.duration_since(refused_at)
    );
    // The client said why it tried again: one retry event, citing the 429.
    let retry = within("the retry event", async {
        loop {
            let e = events.recv().await.expect("events");
            if e.kind == EventKind::Retry {
                break e;
            }
        }
    })
    .await;
    assert!(
        retry.cause.as_deref().unwrap_or("").contains("retry after"),
        "{retry:?}"
    );
    server.shutdown().await;
}
