//! The admin endpoint over real TCP, with a real HTTP client: every route, the token's
//! refusals, breakers isolated through the API as the client reports them, readiness while
//! draining, the Prometheus text counting the calls the test made, and the event stream
//! delivering an event a call caused.
//!
//! Expected values come from what the test did (calls made, failures asked for, options set),
//! never from the endpoint's own figures.

use std::time::Duration;

use reqwest::StatusCode as Http;
use rpc::{
    Client, GovernanceOverrides, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode,
};
use rpc_admin::{Admin, AdminError, AdminHandle};
use serde_json::Value;

#[rpc::service(name = "adm.Echo")]
trait Echo {
    #[governance(timeout_ms = 800)]
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    /// Fails as asked: "business" with a business error, "overflow" with Overflow (which the
    /// client retries, the entry being idempotent: the handler ran), anything else succeeds.
    #[governance(idempotent = true)]
    async fn fail(&self, how: String) -> Result<String, RpcError>;
}

struct Plain;

impl Echo for Plain {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
    async fn fail(&self, how: String) -> Result<String, RpcError> {
        match how.as_str() {
            "business" => Err(RpcError::business("refused, as asked")),
            "overflow" => Err(RpcError::new(
                StatusCode::OverflowMaxServerHandle,
                "full, as asked",
            )),
            _ => Ok(how),
        }
    }
}

const TOKEN: &str = "t0ken";

struct Setup {
    server: ServerHandle,
    client: Client,
    echo: EchoClient,
    admin: AdminHandle,
    http: reqwest::Client,
}

impl Setup {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin.local_addr())
    }

    /// Sends `method path` with the token; the status and the body's text.
    async fn send(&self, method: reqwest::Method, path: &str) -> (Http, String) {
        let r = self
            .http
            .request(method.clone(), self.url(path))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = r.status();
        (status, r.text().await.expect("body"))
    }

    async fn get(&self, path: &str) -> (Http, String) {
        self.send(reqwest::Method::GET, path).await
    }

    async fn get_json(&self, path: &str) -> Value {
        let (status, body) = self.get(path).await;
        assert_eq!(status, Http::OK, "{path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
    }

    async fn post(&self, path: &str) -> (Http, Value) {
        let (status, body) = self.send(reqwest::Method::POST, path).await;
        (
            status,
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}")),
        )
    }
}

async fn setup() -> Setup {
    let registry = InProcessRegistry::new();
    let server = Server::builder()
        .registry(registry.clone())
        .metadata("version", "canary")
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(registry)
        .override_options(
            "adm.Echo.fail",
            GovernanceOverrides {
                retry_times: Some(1),
                retry_interval_ms: Some(1),
                ..GovernanceOverrides::NONE
            },
        )
        .build();
    let admin = Admin::builder()
        .client(&client)
        .server(&server)
        .token(TOKEN)
        .shutdown_grace(SHORT_GRACE)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    Setup {
        server,
        echo: EchoClient::new(client.clone()),
        client,
        admin,
        http: reqwest::Client::new(),
    }
}

/// Waits, at most 10 s, until `path`'s JSON satisfies `done`; the events reach the endpoint
/// through a subscription, a moment after the call that caused them.
async fn until(s: &Setup, path: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = s.get_json(path).await;
        if done(&v) {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{path} never showed what was expected: {v}"
        );
        tokio::task::yield_now().await;
    }
}

const GUARDED: [&str; 9] = [
    "/readyz",
    "/metrics",
    "/api/services",
    "/api/entries",
    "/api/breakers",
    "/api/endpoints",
    "/api/stats",
    "/api/events?limit=5",
    "/api/events/stream",
];

#[tokio::test]
async fn every_route_but_healthz_refuses_a_missing_or_wrong_token_saying_what_to_send() {
    let s = setup().await;
    let healthz = s.http.get(s.url("/healthz")).send().await.unwrap();
    assert_eq!(healthz.status(), Http::OK);
    assert_eq!(healthz.text().await.unwrap(), "ok");
    for path in GUARDED {
        for (token, why) in [(None, "missing token"), (Some("nope"), "wrong token")] {
            let mut req = s.http.get(s.url(path));
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), Http::UNAUTHORIZED, "{path} {why}");
            let body: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
            let error = body["error"].as_str().unwrap_or_default();
            assert!(
                error.contains(why) && error.contains("Authorization: Bearer"),
                "{path}: {body}"
            );
        }
        for path in [
            "/api/breakers/adm.Echo.echo/isolate",
            "/api/endpoints/x:1/readmit",
        ] {
            let r = s.http.post(s.url(path)).send().await.unwrap();
            assert_eq!(r.status(), Http::UNAUTHORIZED, "{path}");
        }
    }
    // With the token, each answers (the stream's body never ends: only its head is read).
    for path in GUARDED {
        let r = s
            .http
            .get(s.url(path))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), Http::OK, "{path}");
    }
    // The scheme's name is case-insensitive, and more than one space may follow it.
    for authorization in [format!("bearer {TOKEN}"), format!("BEARER  {TOKEN}")] {
        let r = s
            .http
            .get(s.url("/api/services"))
            .header("authorization", &authorization)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), Http::OK, "{authorization}");
    }
    let (status, body) = s.get("/no/such/route").await;
    assert_eq!(status, Http::NOT_FOUND);
    assert!(body.contains("\"error\""), "{body}");
    s.admin.shutdown().await;
}

#[tokio::test]
async fn isolating_through_the_api_opens_the_breaker_the_client_reports_and_reset_closes_it() {
    let s = setup().await;
    assert_eq!(s.echo.echo("a".into()).await.unwrap(), "a");
    let (status, body) = s.post("/api/breakers/adm.Echo.echo/isolate").await;
    assert_eq!(status, Http::OK, "{body}");
    assert_eq!(body["state"], "isolated");
    // The client agrees, and so do its calls.
    let state = s
        .client
        .breakers()
        .into_iter()
        .find(|(id, _)| id.as_str() == "adm.Echo.echo")
        .map(|(_, state)| state);
    assert!(
        matches!(state, Some(rpc::BreakerState::Open { retry_after }) if retry_after == Duration::MAX),
        "{state:?}"
    );
    let e = s.echo.echo("b".into()).await.unwrap_err();
    assert_eq!(e.code(), StatusCode::CircuitOpen, "{e}");
    let listed = s.get_json("/api/breakers").await;
    assert_eq!(
        listed["breakers"][0],
        serde_json::json!({"entry": "adm.Echo.echo", "state": "isolated"})
    );
    let (status, body) = s.post("/api/breakers/adm.Echo.echo/reset").await;
    assert_eq!(status, Http::OK, "{body}");
    assert_eq!(body["state"], "closed");
    assert_eq!(s.echo.echo("c".into()).await.unwrap(), "c");
    // An entry the client never called, and an address it does not know: 404 with a reason.
    let (status, body) = s.post("/api/breakers/adm.Echo.nothing/isolate").await;
    assert_eq!(status, Http::NOT_FOUND);
    assert!(
        body["error"].as_str().unwrap().contains("adm.Echo.nothing"),
        "{body}"
    );
    let (status, body) = s.post("/api/endpoints/127.0.0.1:1/readmit").await;
    assert_eq!(status, Http::NOT_FOUND);
    assert!(
        body["error"].as_str().unwrap().contains("127.0.0.1:1"),
        "{body}"
    );
    s.admin.shutdown().await;
}

#[tokio::test]
async fn readyz_answers_503_with_the_reason_once_the_server_drains() {
    let s = setup().await;
    let (status, body) = s.get("/readyz").await;
    assert_eq!((status, body.as_str()), (Http::OK, "ready"));
    let Setup {
        server,
        admin,
        http,
        ..
    } = s;
    server.shutdown().await;
    let r = http
        .get(format!("http://{}/readyz", admin.local_addr()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), Http::SERVICE_UNAVAILABLE);
    assert!(r.text().await.unwrap().contains("draining"));
}

/// The value of the one sample line of `name` carrying every label of `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn metrics_count_the_calls_made_per_entry_status_and_side_with_latency_and_events() {
    let s = setup().await;
    for i in 0..5 {
        s.echo.echo(format!("{i}")).await.unwrap();
    }
    for _ in 0..2 {
        let e = s.echo.fail("business".into()).await.unwrap_err();
        assert_eq!(e.code(), StatusCode::BusinessError);
    }
    s.post("/api/breakers/adm.Echo.echo/isolate").await;
    // The isolate event reaches the counter before the ring: once the ring has it, so has
    // the counter.
    until(&s, "/api/events", |v| {
        v["events"]
            .as_array()
            .is_some_and(|e| e.iter().any(|e| e["kind"] == "isolate"))
    })
    .await;
    let r = s
        .http
        .get(s.url("/metrics"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let content_type = r.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    let text = r.text().await.unwrap();
    for side in ["client", "server"] {
        let calls = |entry, status, outcome| {
            sample(
                &text,
                "rpc_calls_total",
                &[
                    ("side", side),
                    ("entry", entry),
                    ("status", status),
                    ("outcome", outcome),
                ],
            )
        };
        assert_eq!(
            calls("adm.Echo.echo", "200", "success"),
            Some(5.0),
            "{side}\n{text}"
        );
        assert_eq!(
            calls("adm.Echo.fail", "1000", "error"),
            Some(2.0),
            "{side}\n{text}"
        );
        let count = |entry: (&str, &str)| {
            sample(
                &text,
                "rpc_call_duration_seconds_count",
                &[("side", side), ("entry", entry.0), ("outcome", entry.1)],
            )
        };
        assert_eq!(count(("adm.Echo.echo", "success")), Some(5.0), "{text}");
        assert_eq!(count(("adm.Echo.fail", "error")), Some(2.0), "{text}");
    }
    assert_eq!(
        sample(
            &text,
            "rpc_governance_events_total",
            &[
                ("side", "client"),
                ("kind", "isolate"),
                ("observed", "false")
            ]
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "rpc_breaker_state", &[("entry", "adm.Echo.echo")]),
        Some(2.0)
    );
    let address = s.server.address().to_string();
    assert_eq!(
        sample(&text, "rpc_endpoint_health", &[("address", &address)]),
        Some(0.0)
    );
    assert!(text.contains("\nrpc_server_ready 1\n"), "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");
    s.admin.shutdown().await;
}

#[tokio::test]
async fn the_json_api_shows_services_options_with_their_level_endpoints_stats_and_events() {
    let s = setup().await;
    s.client
        .update_options(
            "adm.Echo.echo",
            GovernanceOverrides {
                retry_times: Some(0),
                ..GovernanceOverrides::NONE
            },
        )
        .unwrap();
    for _ in 0..3 {
        s.echo.echo("x".into()).await.unwrap();
    }
    s.echo.fail("business".into()).await.unwrap_err();
    // Changing an entry already called reloads its options: a `reload` event.
    s.client
        .update_options(
            "adm.Echo.echo",
            GovernanceOverrides {
                deadline_slack_ms: Some(40),
                ..GovernanceOverrides::NONE
            },
        )
        .unwrap();
    let address = s.server.address().to_string();

    let services = s.get_json("/api/services").await;
    let client = &services["client"][0];
    assert_eq!(client["service"], "adm.Echo");
    assert_eq!(client["instances"][0]["address"], address.as_str());
    assert_eq!(client["instances"][0]["metadata"]["version"], "canary");
    let entries: Vec<&str> = client["instances"][0]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(entries, ["adm.Echo.echo", "adm.Echo.fail"]);
    assert_eq!(services["server"]["instance"]["address"], address.as_str());
    assert_eq!(services["server"]["registered"], true);

    // Levels: the attribute says timeout_ms = 800, and the server publishes it with its
    // instance (the higher level of the two: published); a runtime update set retry_times = 0;
    // the rest are defaults.
    let entries = s.get_json("/api/entries").await;
    let echo = entries["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["entry"] == "adm.Echo.echo")
        .expect("echo listed");
    let o = &echo["options"];
    assert_eq!(
        o["timeout_ms"],
        serde_json::json!({"value": 800, "level": "published"})
    );
    assert_eq!(
        o["retry_times"],
        serde_json::json!({"value": 0, "level": "runtime"})
    );
    assert_eq!(
        o["deadline_slack_ms"],
        serde_json::json!({"value": 40, "level": "runtime"})
    );
    assert_eq!(
        o["breaker_seconds"],
        serde_json::json!({"value": 60, "level": "default"})
    );
    assert_eq!(
        o.as_object().unwrap().len(),
        rpc::crates::core::OPTIONS.len()
    );

    let endpoints = s.get_json("/api/endpoints").await;
    assert_eq!(endpoints["endpoints"][0]["address"], address.as_str());
    assert_eq!(endpoints["endpoints"][0]["state"], "healthy");
    assert_eq!(endpoints["endpoints"][0]["failures"], 0);
    let (status, body) = s.post(&format!("/api/endpoints/{address}/readmit")).await;
    assert_eq!(status, Http::OK, "{body}");
    assert_eq!(body["had_mark"], false);

    // Within the window: 3 successes of `echo`, 1 failure of `fail`, on each side.
    let stats = s.get_json("/api/stats").await;
    assert_eq!(stats["window_seconds"], 10);
    let of = |side: &str, entry: &str| {
        stats["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["side"] == side && e["entry"] == entry)
            .cloned()
            .unwrap_or_else(|| panic!("{side} {entry}: {stats}"))
    };
    for side in ["client", "server"] {
        let echo = of(side, "adm.Echo.echo");
        assert_eq!(
            (echo["calls"].as_u64(), echo["errors"].as_u64()),
            (Some(3), Some(0))
        );
        assert_eq!(echo["error_rate"], 0.0);
        // 3 calls over the time the window covers so far: between 1 s (its floor) and 10 s.
        let rate = echo["calls_per_second"].as_f64().unwrap();
        assert!((0.3 - 1e-9..=3.0 + 1e-9).contains(&rate), "{echo}");
        let p50 = echo["p50_ms"].as_f64().unwrap();
        let p99 = echo["p99_ms"].as_f64().unwrap();
        assert!(p50 > 0.0 && p50 <= p99, "{echo}");
        let fail = of(side, "adm.Echo.fail");
        assert_eq!(
            (fail["calls"].as_u64(), fail["error_rate"].as_f64()),
            (Some(1), Some(1.0))
        );
    }

    // The second update emitted a reload event for `echo`; `limit` bounds the answer.
    let events = until(&s, "/api/events?limit=1", |v| {
        v["events"].as_array().is_some_and(|e| !e.is_empty())
    })
    .await;
    let events = events["events"].as_array().unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(
        (&events[0]["kind"], &events[0]["entry"]),
        (&"reload".into(), &"adm.Echo.echo".into())
    );
    s.admin.shutdown().await;
}

#[tokio::test]
async fn the_event_stream_delivers_an_event_a_call_caused() {
    let s = setup().await;
    let mut stream = s
        .http
        .get(s.url("/api/events/stream"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), Http::OK);
    // The server answers Overflow: the client retries (retry_times = 1), a `retry` event.
    let e = s.echo.fail("overflow".into()).await.unwrap_err();
    assert!(e.code().is_overflow(), "{e}");
    let mut buffer = String::new();
    let event = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            while let Some(end) = buffer.find("\n\n") {
                let message: String = buffer.drain(..end + 2).collect();
                let data: String = message
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                let event: Value = serde_json::from_str(&data).expect("one JSON event");
                if event["kind"] == "retry" {
                    return event;
                }
            }
            let chunk = stream.chunk().await.expect("read").expect("stream open");
            buffer.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    })
    .await
    .expect("a retry event within 10 s");
    assert_eq!(event["side"], "client");
    assert_eq!(event["entry"], "adm.Echo.fail");
    assert_eq!(event["attempt"], 0);
    assert!(
        event["cause"].as_str().unwrap().contains("full, as asked"),
        "{event}"
    );
    s.admin.shutdown().await;
}

/// A reader reconnecting with `Last-Event-ID` (as a browser's `EventSource` does) gets the
/// kept events after that one first, in order, with their ids: none lost in the gap. One
/// holding an id another process gave (before a restart) gets every event kept first.
#[tokio::test]
async fn the_event_stream_resumes_after_the_last_event_id() {
    let s = setup().await;
    let open = |last: Option<String>| {
        let mut request = s.http.get(s.url("/api/events/stream")).bearer_auth(TOKEN);
        if let Some(last) = last {
            request = request.header("Last-Event-ID", last);
        }
        request.send()
    };
    let mut first = open(None).await.unwrap();
    assert_eq!(first.status(), Http::OK);
    for _ in 0..2 {
        let e = s.echo.fail("overflow".into()).await.unwrap_err();
        assert!(e.code().is_overflow(), "{e}");
    }
    // The ids the first reader got (the oracle): at least two events.
    let ids = sse_ids(&mut first, 2).await;
    let resumed = sse_ids(&mut open(Some(ids[0].clone())).await.unwrap(), 1).await;
    assert_eq!(resumed, ids[1..2], "resumed right after the last id read");
    // An id of another process (its number within ours): everything kept, from the first.
    let elsewhere = sse_ids(&mut open(Some("ffff-1".into())).await.unwrap(), 1).await;
    let seq = |id: &str| -> u64 {
        id.split_once('-')
            .expect("a marked id")
            .1
            .parse()
            .expect("a number")
    };
    assert_eq!(seq(&elsewhere[0]), 1, "{elsewhere:?}");
    s.admin.shutdown().await;
}

/// A reader of the event stream that stops reading (suspended, or piped into a pager nobody
/// scrolls) does not hold the endpoint's shutdown past its grace. Before, `shutdown` waited
/// for as long as that reader read nothing, and the process it ended did not exit.
#[tokio::test]
async fn a_reader_of_the_event_stream_that_reads_nothing_does_not_hold_the_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = setup().await;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("a small window");
    let mut reader = socket.connect(s.admin.local_addr()).await.expect("connect");
    let request = format!(
        "GET /api/events/stream HTTP/1.1\r\nHost: admin\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    );
    reader.write_all(request.as_bytes()).await.expect("request");
    let mut head = [0u8; 256];
    let n = reader.read(&mut head).await.expect("the response");
    let head = String::from_utf8_lossy(&head[..n]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // Then it reads nothing: 200 events of 64 KiB (13 MB) are more than both sockets hold.
    let entry: std::sync::Arc<str> = std::sync::Arc::from("adm.Echo.echo");
    let cause = "x".repeat(64 * 1024);
    for n in 1..=200u64 {
        s.client
            .events()
            .emit_parts(rpc::EventKind::Retry, &entry, None, 0, Some(cause.clone()));
        // Relayed (and so offered to the stream) before the next.
        until(&s, "/api/events?limit=1", |v| {
            v["events"][0]["seq"].as_u64() >= Some(n)
        })
        .await;
    }
    let admin = s.admin;
    tokio::time::timeout(Duration::from_secs(10), admin.shutdown())
        .await
        .expect("the shutdown returns within 10 s (its grace: 200 ms)");
    drop(reader);
}

/// An endpoint showing a new client with no server (a client process's), built as `configure`
/// says, on a free loopback port; and its client.
async fn client_only(
    configure: impl FnOnce(rpc_admin::AdminBuilder) -> rpc_admin::AdminBuilder,
) -> (Client, AdminHandle) {
    let client = Client::builder().build();
    let admin = configure(Admin::builder().client(&client))
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    (client, admin)
}

/// How long the stalled-request tests give the endpoint's stop (short: the real clock runs).
const SHORT_GRACE: Duration = Duration::from_millis(200);

/// An endpoint with [`SHORT_GRACE`], and a connection to it whose request is stalled in its
/// body: 100 bytes announced, 1 sent, and the handler reading it (hyper says `100 Continue`,
/// asked for with `Expect`, when the handler begins reading the body).
async fn stalled_request() -> (AdminHandle, tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_, admin) = client_only(|b| b.shutdown_grace(SHORT_GRACE)).await;
    let mut stalled = tokio::net::TcpStream::connect(admin.local_addr())
        .await
        .expect("connect");
    stalled
        .write_all(
            b"POST /api/rules/routing/validate HTTP/1.1\r\nHost: 127.0.0.1\r\n\
              Content-Type: text/plain\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n",
        )
        .await
        .expect("the head");
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("100 Continue\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut buf))
            .await
            .expect("100 Continue within 10 s")
            .expect("read");
        assert!(
            n > 0,
            "closed before the handler read: {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    stalled.write_all(b"x").await.expect("a byte of the body");
    (admin, stalled)
}

/// `stalled` is closed by the endpoint, with no answer (at most 10 s).
async fn closed_unanswered(mut stalled: tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stalled.read_to_end(&mut rest))
        .await
        .expect("the connection is closed once the grace has passed");
    // The end of the stream, or a reset.
    assert!(
        read.is_err() || rest.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&rest)
    );
}

/// A request whose body never comes (its client stalled, or gone without a word) is dropped
/// with its connection once the shutdown's grace has passed, not before: the connection is
/// closed, not left serving the endpoint's state for as long as the peer keeps it open.
/// Before, each connection was a task of axum's own, which outlived the endpoint's serving
/// task.
#[tokio::test]
async fn a_request_stalled_in_its_body_is_closed_when_the_shutdown_s_grace_ends() {
    let (admin, stalled) = stalled_request().await;
    let asked = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), admin.shutdown())
        .await
        .expect("the shutdown returns");
    assert!(asked.elapsed() >= SHORT_GRACE, "{:?}", asked.elapsed());
    closed_unanswered(stalled).await;
}

/// The same when the handle is dropped instead of shut down: the grace runs in the
/// background, then the connection is closed. Before, the serving task waited for the stalled
/// request for as long as its peer kept the connection open.
#[tokio::test]
async fn a_request_stalled_in_its_body_is_closed_after_the_grace_when_the_handle_is_dropped() {
    let (admin, stalled) = stalled_request().await;
    drop(admin);
    closed_unanswered(stalled).await;
}

/// A peer sending a request's head and never finishing it is disconnected at the head
/// timeout, unanswered, as is one sitting idle for as long; an event stream, its head read,
/// runs past it. Before, the endpoint gave hyper no timer, and such a peer kept its
/// connection for as long as it liked (with `allow_remote`, before any token was checked).
#[tokio::test]
async fn a_head_never_finished_is_disconnected_at_the_head_timeout_and_a_stream_is_not() {
    use tokio::io::AsyncWriteExt;
    let (client, admin) = client_only(|b| b.head_timeout(SHORT_GRACE)).await;
    let mut stream = reqwest::Client::new()
        .get(format!("http://{}/api/events/stream", admin.local_addr()))
        .send()
        .await
        .expect("the event stream");
    assert_eq!(stream.status(), Http::OK);
    let mut slow = tokio::net::TcpStream::connect(admin.local_addr())
        .await
        .expect("connect");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHo")
        .await
        .expect("half a head");
    let idle = tokio::net::TcpStream::connect(admin.local_addr())
        .await
        .expect("connect");
    closed_unanswered(slow).await;
    closed_unanswered(idle).await;
    // The stream, opened before both, is still open: an event sent now reaches it.
    client.events().emit_parts(
        rpc::EventKind::Retry,
        &std::sync::Arc::from("adm.Echo.echo"),
        None,
        0,
        None,
    );
    let chunk = tokio::time::timeout(Duration::from_secs(10), stream.chunk())
        .await
        .expect("an event within 10 s")
        .expect("read");
    let chunk = chunk.expect("the stream still open");
    assert!(
        String::from_utf8_lossy(&chunk).contains("\"kind\":\"retry\""),
        "{chunk:?}"
    );
    admin.shutdown().await;
}

/// The SSE ids of the next `n` events `stream` delivers (at most 10 s).
async fn sse_ids(stream: &mut reqwest::Response, n: usize) -> Vec<String> {
    let mut buffer = String::new();
    let mut ids = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            while let Some(end) = buffer.find("\n\n") {
                let message: String = buffer.drain(..end + 2).collect();
                if let Some(id) = message.lines().find_map(|l| l.strip_prefix("id:")) {
                    ids.push(id.trim().to_string());
                    if ids.len() == n {
                        return;
                    }
                }
            }
            let chunk = stream.chunk().await.expect("read").expect("stream open");
            buffer.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    })
    .await
    .expect("the events within 10 s");
    ids
}

#[tokio::test]
async fn a_non_loopback_address_needs_allow_remote_and_a_token() {
    let e = Admin::builder().serve("0.0.0.0:0").await.err();
    assert!(matches!(e, Some(AdminError::NotLoopback { .. })), "{e:?}");
    let e = Admin::builder()
        .allow_remote(true)
        .serve("0.0.0.0:0")
        .await
        .err();
    assert!(matches!(e, Some(AdminError::TokenRequired { .. })), "{e:?}");
    let e = Admin::builder().serve("no-port").await.err();
    assert!(matches!(e, Some(AdminError::BadAddress { .. })), "{e:?}");
}

/// An empty token (an unset variable passed on, say) would serve with no check at all: the
/// endpoint refuses to start with it.
#[tokio::test]
async fn an_empty_token_is_refused_at_start() {
    let e = Admin::builder().token("").serve("127.0.0.1:0").await.err();
    assert!(matches!(e, Some(AdminError::EmptyToken)), "{e:?}");
}

/// A token no `Authorization` header carries as it is (not ASCII, or padded with spaces)
/// would start an endpoint that refuses every request: it refuses to start, saying why.
#[tokio::test]
async fn a_token_no_header_can_carry_is_refused_at_start() {
    for token in ["pässwort", " padded", "padded "] {
        let e = Admin::builder()
            .token(token)
            .serve("127.0.0.1:0")
            .await
            .err();
        assert!(
            matches!(&e, Some(AdminError::UnsendableToken(_))),
            "{token:?}: {e:?}"
        );
    }
    // Spaces inside are carried: such a token starts, and lets its requests through.
    let admin = Admin::builder()
        .token("two words")
        .serve("127.0.0.1:0")
        .await
        .expect("a token with an inner space");
    let r = reqwest::Client::new()
        .get(format!("http://{}/api/services", admin.local_addr()))
        .bearer_auth("two words")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), Http::OK);
}

/// A query, a path or a body the endpoint cannot read is refused in JSON saying what to send,
/// as every other refusal: a limit that is not a number (400), a path parameter that is not
/// UTF-8 (400), a rules document over 2 MiB (413).
#[tokio::test]
async fn unreadable_queries_and_bodies_are_refused_in_json() {
    let s = setup().await;
    let (status, body) = s.get("/api/events?limit=abc").await;
    assert_eq!(status, Http::BAD_REQUEST, "{body}");
    let body: Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        body["error"].as_str().expect("error").contains("limit"),
        "{body}"
    );

    // A path parameter that is not UTF-8 once decoded.
    let (status, body) = s.post("/api/endpoints/%FF/readmit").await;
    assert_eq!(status, Http::BAD_REQUEST, "{body}");
    assert!(
        body["error"].as_str().expect("error").contains("UTF-8"),
        "{body}"
    );

    let r = s
        .http
        .post(s.url("/api/rules/governance/validate"))
        .bearer_auth(TOKEN)
        .body(vec![b'#'; 3 << 20])
        .send()
        .await
        .expect("POST");
    assert_eq!(r.status(), Http::PAYLOAD_TOO_LARGE);
    let body: Value = serde_json::from_str(&r.text().await.expect("body")).expect("JSON");
    assert!(
        body["error"].as_str().expect("error").contains("2 MiB"),
        "{body}"
    );
    s.admin.shutdown().await;
}

/// An endpoint with a client and no server (a client process's) is ready, and its metrics say
/// so as `/readyz` does: an alert on `rpc_server_ready == 0` must not fire for it.
#[tokio::test]
async fn a_client_only_endpoint_is_ready_in_readyz_and_in_its_metrics() {
    let (_client, admin) = client_only(|b| b.token(TOKEN)).await;
    let http = reqwest::Client::new();
    let get = |path: &str| {
        http.get(format!("http://{}{path}", admin.local_addr()))
            .bearer_auth(TOKEN)
            .send()
    };
    let readyz = get("/readyz").await.expect("GET /readyz");
    assert_eq!(readyz.status(), Http::OK);
    let metrics = get("/metrics").await.expect("GET /metrics");
    let text = metrics.text().await.expect("body");
    assert!(text.contains("\nrpc_server_ready 1\n"), "{text}");
    admin.shutdown().await;
}

/// Without a token, other sites' pages cannot steer the endpoint: a request addressed to
/// another host name (DNS rebinding) or made by a page of another site (`Origin`) is refused
/// with 403 saying why; the same requests addressed to the loopback address, or from the
/// endpoint's own page, pass.
#[tokio::test]
async fn without_a_token_only_requests_to_the_loopback_address_from_no_other_site_pass() {
    let server = Server::builder()
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let admin = Admin::builder()
        .server(&server)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    let addr = admin.local_addr();
    let http = reqwest::Client::new();
    let send = |path: &str, headers: &[(&str, String)]| {
        let mut request = http.post(format!("http://{addr}{path}"));
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        request.send()
    };
    let isolate = "/api/breakers/adm.Echo.echo/isolate";
    for (headers, why) in [
        (vec![("host", "evil.example".to_string())], "addressed to"),
        (
            vec![("host", format!("evil.example:{}", addr.port()))],
            "addressed to",
        ),
        (
            vec![("origin", "http://evil.example".to_string())],
            "comes from a page",
        ),
    ] {
        let r = send(isolate, &headers).await.expect("POST");
        assert_eq!(r.status(), Http::FORBIDDEN, "{headers:?}");
        let body: Value = serde_json::from_str(&r.text().await.expect("body")).expect("JSON");
        let message = body["error"].as_str().expect("error");
        assert!(
            message.contains(why) && message.contains("token"),
            "{message}"
        );
    }
    // Addressed to the loopback address (reqwest's own Host), or from the endpoint's own page.
    for headers in [vec![], vec![("origin", format!("http://{addr}"))]] {
        let r = send("/api/events", &headers).await.expect("POST");
        assert_eq!(
            r.status(),
            Http::METHOD_NOT_ALLOWED,
            "{headers:?}: past the guard"
        );
        let r = http
            .get(format!("http://{addr}/api/services"))
            .send()
            .await
            .expect("GET");
        assert_eq!(r.status(), Http::OK);
    }
    admin.shutdown().await;
    server.shutdown().await;
}

#[tokio::test]
async fn the_console_page_is_served_without_the_token_and_polls_only_guarded_routes() {
    let s = setup().await;
    let r = s.http.get(s.url("/")).send().await.unwrap();
    assert_eq!(r.status(), Http::OK);
    let kind = r.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_string();
    assert!(kind.starts_with("text/html"), "{kind}");
    // In no other site's frame: a decoy laid over its buttons would have the operator isolate
    // a breaker unawares (its requests come from this host, so the host check passes).
    let header = |name: &str| {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    assert_eq!(header("x-frame-options").as_deref(), Some("DENY"));
    assert_eq!(
        header("content-security-policy").as_deref(),
        Some("frame-ancestors 'none'")
    );
    assert_eq!(header("referrer-policy").as_deref(), Some("no-referrer"));
    assert_eq!(header("cache-control").as_deref(), Some("no-store"));
    let page = r.text().await.unwrap();
    assert!(page.contains("<title>rpc console</title>"), "the page");
    // No answer of the API is kept by a cache: they carry the process's state, read with the
    // token.
    let r = s
        .http
        .get(s.url("/api/breakers"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), Http::OK);
    assert_eq!(r.headers()["cache-control"], "no-store");
    // Every API path the page names is one the token guards (the page itself holds no
    // data): each `/api/<name>` in its text, asked for without the token, is refused.
    let mut named: Vec<&str> = page
        .match_indices("\"/api/")
        .map(|(at, _)| {
            let rest = &page[at + 1..];
            let end = rest[5..]
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .map_or(rest.len(), |n| n + 5);
            &rest[..end]
        })
        .collect();
    named.sort_unstable();
    named.dedup();
    for path in ["/api/services", "/api/stats", "/api/breakers", "/api/rules"] {
        assert!(named.contains(&path), "the page reads {path}: {named:?}");
    }
    for path in &named {
        let r = s.http.get(s.url(path)).send().await.unwrap();
        assert_eq!(r.status(), Http::UNAUTHORIZED, "{path} without the token");
    }
    assert!(
        page.contains("Authorization") && page.contains("Bearer "),
        "sends the token"
    );
    // Nothing is fetched from elsewhere (the only URL is the SVG namespace, a name).
    let urls = page.replace("\"http://www.w3.org/2000/svg\"", "");
    assert!(
        !urls.contains("http://") && !urls.contains("https://"),
        "self-contained"
    );
}
