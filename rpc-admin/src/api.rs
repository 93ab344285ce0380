//! The routes: health, readiness, metrics and the JSON API, behind the token check.
//!
//! Every answer of the JSON API is an object (never a bare array), so fields can be added
//! without breaking a script; every refusal is `{"error": "..."}` saying what to do.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequestParts, Path, Query, Request, State as Shared};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use rpc_client::EndpointState;
use rpc_governance::breaker::BreakerState;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::events::Live;
use crate::metrics::CONTENT_TYPE;
use crate::State;

type St = Shared<Arc<State>>;

/// The router of one admin endpoint.
pub(crate) fn router(state: Arc<State>) -> Router {
    let guarded = Router::new()
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/services", get(services))
        .route("/api/entries", get(entries))
        .route("/api/breakers", get(breakers))
        .route("/api/breakers/{entry}/isolate", post(isolate))
        .route("/api/breakers/{entry}/reset", post(reset))
        .route("/api/endpoints", get(endpoints))
        .route("/api/endpoints/{addr}/readmit", post(readmit))
        .route("/api/stats", get(stats))
        .route("/api/events", get(events))
        .route("/api/events/stream", get(stream))
        .merge(crate::rules::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/", get(console))
        .merge(guarded)
        .fallback(not_found)
        .layer(middleware::map_response(not_stored))
        .with_state(state)
}

/// Every answer is kept by no cache: they carry the process's state and rules, read with the
/// token.
async fn not_stored(mut response: Response) -> Response {
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
}

/// The web console: one page built into the binary (nothing is fetched at build or run time)
/// that polls the JSON API with the token the operator gives it (the page's `#token=...`
/// fragment, which the browser never sends, or its form). The page itself holds no data, so it
/// is served without the token.
const CONSOLE: &str = include_str!("../assets/console.html");

/// The console in no other site's frame (where a decoy laid over its buttons would have the
/// operator isolate a breaker unawares: its requests come from this host, so the host and
/// origin checks let them through), and sending no referrer.
async fn console() -> impl IntoResponse {
    (
        [
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        axum::response::Html(CONSOLE),
    )
}

/// A JSON refusal.
fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// A route's path parameters; ones the endpoint cannot read (a percent-encoding that is not
/// UTF-8, say) are refused 400 in JSON, as every other refusal, where axum's own [`Path`]
/// answers in plain text.
pub(crate) struct PathArgs<T>(pub(crate) T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> FromRequestParts<S> for PathArgs<T> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(args)) => Ok(Self(args)),
            Err(e) => Err(refuse(
                StatusCode::BAD_REQUEST,
                format!("{}; percent-encode the path as UTF-8", e.body_text()),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_loopback_authority;

    #[test]
    fn only_loopback_names_are_this_host() {
        for this in [
            "127.0.0.1:9901",
            "127.0.0.1",
            "127.1.2.3:80",
            "localhost:9901",
            "LOCALHOST",
            "[::1]:9901",
            "[::1]",
        ] {
            assert!(is_loopback_authority(this), "{this}");
        }
        for other in [
            "evil.example:9901",
            "evil.example",
            "10.0.0.1:9901",
            "localhost.evil.example",
            "[::2]:9901",
            "",
        ] {
            assert!(!is_loopback_authority(other), "{other}");
        }
    }
}

async fn not_found(req: Request) -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        format!(
            "no route {} {}; the routes are /healthz, /readyz, /metrics and /api/... (see the \
             README's \"Admin endpoint\")",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn not_allowed(req: Request) -> Response {
    refuse(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} is not a method of {}; see the README's \"Admin endpoint\" for the methods of \
             each route",
            req.method(),
            req.uri().path()
        ),
    )
}

/// Lets a request through with the right bearer token ([`rpc_core::token::same`]); without a token, a
/// request from this host only ([`from_this_host`]).
async fn authorize(Shared(state): St, headers: HeaderMap, req: Request, next: Next) -> Response {
    let Some(token) = &state.token else {
        return match from_this_host(&headers) {
            Ok(()) => next.run(req).await,
            Err(why) => refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "{why}: this admin endpoint has no token, so it answers only requests \
                     addressed to 127.0.0.1, [::1] or localhost that no other site's page made; \
                     reach it at its loopback address, or give it a token (--admin-token)"
                ),
            ),
        };
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(rpc_core::token::bearer);
    let why = match given {
        Some(g) if rpc_core::token::same(g, token) => return next.run(req).await,
        Some(_) => "wrong token",
        None => "missing token",
    };
    let mut response = refuse(
        StatusCode::UNAUTHORIZED,
        format!(
            "{why}: send the header `Authorization: Bearer <token>` with this process's admin \
             token (rpcctl: --token or RPCCTL_TOKEN)"
        ),
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
}

/// Without a token, what keeps other sites' pages away from an endpoint on loopback: a page on
/// another site can make the browser send simple requests (a form's POST) to 127.0.0.1, or,
/// by re-pointing its own host name there (DNS rebinding), read the answers. So the request
/// must be addressed to a loopback name (`Host`), and one a browser made must come from a page
/// of this endpoint (`Origin`, when there is one, naming the same host).
fn from_this_host(headers: &HeaderMap) -> Result<(), String> {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !is_loopback_authority(host) {
        return Err(format!("the request is addressed to {host:?}"));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let same = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|authority| authority.eq_ignore_ascii_case(host));
        if !same {
            return Err(format!("the request comes from a page of {origin:?}"));
        }
    }
    Ok(())
}

/// Whether `authority` (`host[:port]`) names this host's loopback: `localhost`, `127.x.x.x` or
/// `[::1]`.
fn is_loopback_authority(authority: &str) -> bool {
    let host = match authority.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether the server is ready, and why not.
fn readiness(state: &State) -> Option<Result<(), String>> {
    let server = state.server.as_ref()?;
    Some(if server.is_draining() {
        Err("draining: the server is shutting down".into())
    } else if server.has_registry() && !server.is_registered() {
        Err("not registered: the instance is not published in the registry".into())
    } else {
        Ok(())
    })
}

async fn readyz(Shared(state): St) -> Response {
    match readiness(&state) {
        None | Some(Ok(())) => (StatusCode::OK, "ready").into_response(),
        Some(Err(why)) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")).into_response()
        }
    }
}

fn breaker_value(state: &BreakerState) -> i64 {
    match state {
        BreakerState::Closed { .. } => 0,
        BreakerState::HalfOpen { .. } => 1,
        BreakerState::Open { .. } => 2,
    }
}

fn health_value(state: &EndpointState) -> i64 {
    match state {
        EndpointState::Healthy => 0,
        EndpointState::Unhealthy { .. } => 1,
        EndpointState::Removed => 2,
    }
}

async fn metrics(Shared(state): St) -> Response {
    let (breakers, endpoints) = match &state.client {
        Some(c) => (
            c.breakers()
                .iter()
                .map(|(id, s)| (id.to_string(), breaker_value(s)))
                .collect(),
            c.endpoints()
                .iter()
                .map(|e| (e.address.clone(), health_value(&e.state)))
                .collect(),
        ),
        None => (Vec::new(), Vec::new()),
    };
    let ready = readiness(&state).map(|r| r.is_ok());
    let text = state.metrics.render(breakers, endpoints, ready);
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response()
}

fn no_client() -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        "this process's admin endpoint shows no client: breakers and endpoints belong to a client",
    )
}

async fn services(Shared(state): St) -> Response {
    let client: Vec<Value> = state.client.as_ref().map_or_else(Vec::new, |c| {
        c.services()
            .into_iter()
            .map(|(service, instances)| {
                let instances: Vec<Value> = instances
                    .iter()
                    .map(|i| serde_json::to_value(&**i).unwrap_or(Value::Null))
                    .collect();
                json!({ "service": service, "instances": instances })
            })
            .collect()
    });
    let server = state.server.as_ref().map(|s| {
        json!({
            "instance": serde_json::to_value(s.instance()).unwrap_or(Value::Null),
            "registered": s.is_registered(),
            "draining": s.is_draining(),
        })
    });
    Json(json!({ "client": client, "server": server })).into_response()
}

async fn entries(Shared(state): St) -> Response {
    let Some(client) = &state.client else {
        return Json(json!({ "entries": [] })).into_response();
    };
    let entries: Vec<Value> = client
        .entry_options()
        .into_iter()
        .map(|e| {
            let values = serde_json::to_value(&*e.options).unwrap_or(Value::Null);
            let options: BTreeMap<&str, Value> = e
                .levels
                .iter()
                .map(|(name, level)| {
                    let value = values.get(*name).cloned().unwrap_or(Value::Null);
                    (*name, json!({ "value": value, "level": level }))
                })
                .collect();
            json!({ "entry": e.entry.as_str(), "options": options })
        })
        .collect();
    Json(json!({ "entries": entries })).into_response()
}

/// One breaker as JSON.
fn breaker_json(entry: &str, s: &BreakerState) -> Value {
    match s {
        BreakerState::Closed { failures } => {
            json!({ "entry": entry, "state": "closed", "failures": failures })
        }
        BreakerState::HalfOpen { probes } => {
            json!({ "entry": entry, "state": "half_open", "probes": probes })
        }
        BreakerState::Open { retry_after } if *retry_after == Duration::MAX => {
            json!({ "entry": entry, "state": "isolated" })
        }
        BreakerState::Open { retry_after } => json!({
            "entry": entry,
            "state": "open",
            "retry_after_ms": u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
        }),
    }
}

async fn breakers(Shared(state): St) -> Response {
    let Some(client) = &state.client else {
        return Json(json!({ "breakers": [] })).into_response();
    };
    let mut list = client.breakers();
    list.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    let breakers: Vec<Value> = list
        .iter()
        .map(|(id, s)| breaker_json(id.as_str(), s))
        .collect();
    Json(json!({ "breakers": breakers })).into_response()
}

/// Isolates or resets `entry`'s breaker and answers its new state.
fn steer(state: &State, entry: &str, isolate: bool) -> Response {
    let Some(client) = &state.client else {
        return no_client();
    };
    let done = if isolate {
        client.isolate_entry(entry)
    } else {
        client.reset_breaker_entry(entry)
    };
    if let Err(e) = done {
        return refuse(StatusCode::NOT_FOUND, e.message());
    }
    let now = client
        .breakers()
        .into_iter()
        .find(|(id, _)| id.as_str() == entry)
        .map_or(Value::Null, |(_, s)| breaker_json(entry, &s));
    Json(now).into_response()
}

async fn isolate(Shared(state): St, PathArgs(entry): PathArgs<String>) -> Response {
    steer(&state, &entry, true)
}

async fn reset(Shared(state): St, PathArgs(entry): PathArgs<String>) -> Response {
    steer(&state, &entry, false)
}

async fn endpoints(Shared(state): St) -> Response {
    let Some(client) = &state.client else {
        return Json(json!({ "endpoints": [] })).into_response();
    };
    let endpoints: Vec<Value> = client
        .endpoints()
        .into_iter()
        .map(|e| {
            let (name, retry_in_ms) = match e.state {
                EndpointState::Healthy => ("healthy", None),
                EndpointState::Unhealthy { retry_in } => (
                    "unhealthy",
                    Some(u64::try_from(retry_in.as_millis()).unwrap_or(u64::MAX)),
                ),
                EndpointState::Removed => ("removed", None),
            };
            json!({
                "address": e.address,
                "services": e.services,
                "state": name,
                "retry_in_ms": retry_in_ms,
                "failures": e.consecutive_failures,
                "reason": e.last_failure,
            })
        })
        .collect();
    Json(json!({ "endpoints": endpoints })).into_response()
}

async fn readmit(Shared(state): St, PathArgs(addr): PathArgs<String>) -> Response {
    let Some(client) = &state.client else {
        return no_client();
    };
    if !client.endpoints().iter().any(|e| e.address == addr) {
        return refuse(
            StatusCode::NOT_FOUND,
            format!(
                "{addr:?} is not an endpoint of a service this client has called; GET \
                 /api/endpoints lists them"
            ),
        );
    }
    let had_mark = client.readmit(&addr);
    Json(json!({ "address": addr, "had_mark": had_mark })).into_response()
}

async fn stats(Shared(state): St) -> Response {
    let entries = state.stats.snapshot(tokio::time::Instant::now());
    Json(json!({
        "window_seconds": state.stats.window_seconds(),
        "entries": entries,
    }))
    .into_response()
}

#[derive(Deserialize)]
struct Limit {
    limit: Option<usize>,
}

async fn events(Shared(state): St, q: Result<Query<Limit>, QueryRejection>) -> Response {
    let Ok(Query(q)) = q else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "limit must be a whole number of events, e.g. /api/events?limit=50",
        );
    };
    let limit = q.limit.unwrap_or(100).min(state.events.capacity());
    let events = state.events.recent(limit);
    Json(json!({ "events": events })).into_response()
}

/// `GET /api/events/stream`: the live events, each with its number as its SSE id; a reader
/// reconnecting with `Last-Event-ID` (as a browser's `EventSource` does) gets the kept events
/// after it first; one holding an id of another process (before a restart) gets every event
/// kept first.
async fn stream(
    Shared(state): St,
    headers: axum::http::HeaderMap,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    use futures_util::StreamExt;
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| state.events.after(v));
    let prefix = state.events.id_prefix();
    let events = state
        .events
        .follow(after, state.stop.clone())
        .map(move |live| {
            Ok(match live {
                Live::Event(e) => Event::default()
                    .id(format!("{prefix}{}", e.seq))
                    .data(serde_json::to_string(&*e).unwrap_or_default()),
                // A reader too slow for the feed is told what it missed (the ring keeps the
                // newest: GET /api/events).
                Live::Missed(missed) => Event::default()
                    .event("lagged")
                    .data(json!({ "missed": missed }).to_string()),
            })
        });
    Sse::new(events).keep_alive(KeepAlive::default())
}
