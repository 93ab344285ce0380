//! One HTTP request made into one call: the token check, the route lookup, the arguments bound
//! by name, the headers made attachments, the call through the governed client, and its answer
//! or error made HTTP.
//!
//! Why in one module: each step's refusal is an HTTP answer the next steps never see, and the
//! order (token first, then route, then arguments) decides what an unauthenticated caller can
//! learn: nothing but 401.

use std::collections::BTreeMap;
use std::future::Future;
use std::task::Poll;

use axum::body::{Bytes, HttpBody};
use axum::extract::{OriginalUri, Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use rpc_core::{RpcContext, RpcError, ServiceEntry};
use serde_json::{json, Value};
use tracing::Instrument;

use crate::route::{carries_retry_after, error_body, http_status, params_in_query, request_path};
use crate::table::{Found, Served};
use crate::{docs, Gateway};

/// The most headers forwarded as attachments on one call (the server takes 64 by default).
pub const MAX_ATTACHMENTS: usize = 32;

/// The most bytes (names and values) of headers forwarded as attachments on one call (the
/// server takes 16 KiB by default).
pub const MAX_ATTACHMENT_BYTES: usize = 8 * 1024;

/// Headers that belong to one HTTP hop (RFC 9110 section 7.6.1) or to the gateway itself.
const NOT_FORWARDED: [&str; 13] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "authorization",
    "cookie",
    "expect",
];

/// Prefixes of headers that are not forwarded (see the crate's documentation).
const NOT_FORWARDED_PREFIXES: [&str; 4] = ["content-", "accept", "sec-", "rpc-"];

/// Where the OpenAPI document is served (with the gateway's token, when it has one).
const DOCUMENT_PATH: &str = "/openapi.json";

/// Where the gateway says it is up.
const HEALTH_PATH: &str = "/healthz";

/// Where the documentation page is served.
const DOCS_PATH: &str = "/docs";

/// The paths of the gateway's own routes: every other path is an entry's (or none).
pub(crate) const OWN_PATHS: [&str; 3] = [HEALTH_PATH, DOCS_PATH, DOCUMENT_PATH];

pub(crate) fn router(gateway: Gateway) -> Router {
    Router::new()
        .route(HEALTH_PATH, get(|| async { "ok" }))
        .route(DOCS_PATH, get(docs_page))
        .route(DOCUMENT_PATH, get(document))
        .method_not_allowed_fallback(get_only)
        .fallback(call)
        .with_state(gateway)
}

/// The answer to another method than GET (or HEAD) on one of the gateway's own routes; on the
/// document's route, the token is checked first, as for GET (an unauthenticated caller learns
/// nothing but 401 there).
async fn get_only(State(gateway): State<Gateway>, request: Request) -> Response {
    if request.uri().path() == DOCUMENT_PATH {
        if let Some(refused) = check_token(&gateway, request.headers()) {
            return refused;
        }
    }
    let mut answer = refuse(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} is served with GET only, not {}",
            request.uri().path(),
            request.method()
        ),
    );
    answer
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    answer
}

/// `{"error": message}` with `status`.
fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// `None` when the request may pass, else the 401 answer.
fn check_token(gateway: &Gateway, headers: &HeaderMap) -> Option<Response> {
    let expected = gateway.inner.token.as_deref()?;
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(rpc_core::token::bearer);
    let ok = given.is_some_and(|g| rpc_core::token::same(g, expected));
    if ok {
        return None;
    }
    let message = if given.is_some() {
        "the bearer token is not the gateway's: send Authorization: Bearer <the gateway's token>"
    } else {
        "this gateway needs a token: send Authorization: Bearer <token>"
    };
    let mut answer = refuse(StatusCode::UNAUTHORIZED, message);
    answer
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Some(answer)
}

/// The request's `Origin`, when it names another origin than the gateway's: its `Host` (the
/// authority of an HTTP/2 request), or behind a proxy the host the proxy was asked for (the
/// first of `X-Forwarded-Host`, or the `host` of the first element of `Forwarded`). A browser
/// sends `Origin` with every request that is not a GET or HEAD, so a page of another site
/// that posts to a gateway (one listening on loopback, say, with no token) is refused before
/// anything runs. (A cross-site page cannot set those headers or `Authorization` without a
/// preflight, which the gateway does not answer.) Requests without `Origin` (curl, servers)
/// pass.
fn cross_origin<'a>(
    headers: &'a HeaderMap,
    authority: Option<&axum::http::uri::Authority>,
) -> Option<&'a str> {
    let origin = headers.get(header::ORIGIN)?;
    let Ok(origin) = origin.to_str() else {
        return Some("an origin that is not text");
    };
    let from = origin.split_once("://").map(|(_, from)| from);
    let text = |name: &str| headers.get(name).and_then(|h| h.to_str().ok());
    let forwarded = text("forwarded").and_then(|f| {
        let first = f.split(',').next()?;
        first.split(';').find_map(|pair| {
            let (key, value) = pair.trim().split_once('=')?;
            key.eq_ignore_ascii_case("host")
                .then(|| value.trim_matches('"'))
        })
    });
    let hosts = [
        text(header::HOST.as_str()),
        authority.map(axum::http::uri::Authority::as_str),
        text("x-forwarded-host").and_then(|h| h.split(',').next()),
        forwarded,
    ];
    let same = |host: &str| from.is_some_and(|f| f.eq_ignore_ascii_case(host.trim()));
    if hosts.into_iter().flatten().any(same) {
        None
    } else {
        Some(origin)
    }
}

/// The documentation page, in no other site's frame (a decoy laid over its "Send" buttons
/// would have a visitor call entries unawares) and sending no referrer.
async fn docs_page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        docs::page(),
    )
        .into_response()
}

async fn document(
    State(gateway): State<Gateway>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = check_token(&gateway, &headers) {
        return refused;
    }
    let document = gateway.document();
    // Nested in a larger router (`Router::nest("/gw", gateway.router())`), the routes are
    // under its prefix: without a `servers` entry, OpenAPI tools would call them at `/`.
    if let Some(prefix) = uri
        .path()
        .strip_suffix(DOCUMENT_PATH)
        .filter(|p| !p.is_empty())
    {
        let mut document = (*document).clone();
        document["servers"] = json!([{"url": prefix}]);
        return Json(document).into_response();
    }
    Json(&*document).into_response()
}

/// The entry as the OpenAPI document shows it: at the route it is served at.
pub(crate) fn documented(served: &Served) -> ServiceEntry {
    let mut entry = served.entry.clone();
    if crate::route::route_of(&entry) != served.route {
        if let Some(api) = entry.api.as_mut() {
            api.http = None;
        }
    }
    entry
}

async fn call(State(gateway): State<Gateway>, request: Request) -> Response {
    entry_call(gateway, request).await
}

/// A request for an entry (any path but the gateway's own routes) answered: the router's
/// fallback, and what the gateway's own serving calls directly (see `serve`).
/// (Generic in its body: served by the gateway, hyper's own, with no box around it.)
pub(crate) async fn entry_call<B>(gateway: Gateway, request: axum::http::Request<B>) -> Response
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<axum::BoxError>,
{
    let (parts, body) = request.into_parts();
    if let Some(refused) = check_token(&gateway, &parts.headers) {
        return refused;
    }
    if let Some(origin) = cross_origin(&parts.headers, parts.uri.authority()) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "a request from a page of another origin ({origin}) is refused: the gateway \
                 answers no cross-origin requests (CORS); call it from its own origin or \
                 without an Origin header (curl, a server)"
            ),
        );
    }
    // Matched with its text decoded: templates hold it as it is (see `normalized_path`).
    let path = request_path(parts.uri.path());
    // An `Arc` of the table rather than a guard: it is held across the body's await.
    let table = gateway.inner.shared.table.load_full();
    let (served, path_params) = match table.find(&parts.method, &path) {
        Found::Entry(served, params) => (served, params),
        Found::OtherMethods(methods) => {
            let mut allow: Vec<&str> = methods.iter().map(Method::as_str).collect();
            // A route served with GET answers HEAD as well.
            if methods.contains(&Method::GET) && !methods.contains(&Method::HEAD) {
                allow.push(Method::HEAD.as_str());
            }
            let mut answer = refuse(
                StatusCode::METHOD_NOT_ALLOWED,
                format!(
                    "{path} is not served with {}: use {}",
                    parts.method,
                    allow.join(" or ")
                ),
            );
            if let Ok(v) = HeaderValue::from_str(&allow.join(", ")) {
                answer.headers_mut().insert(header::ALLOW, v);
            }
            return answer;
        }
        Found::Nothing => {
            return refuse(
                StatusCode::NOT_FOUND,
                format!(
                    "no entry is served at {} {path}: entries are served at POST \
                     /api/{{service id}}/{{method}} or at the routes their services declare; \
                     GET /openapi.json lists them",
                    parts.method
                ),
            )
        }
    };
    // Held until the answer is made: the body read, the call and its answer count.
    let Ok(_in_flight) = gateway.inner.in_flight.try_acquire() else {
        let mut answer = refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the gateway is handling as many calls as it takes at once ({}): send it \
                 again in a second",
                gateway.inner.max_in_flight
            ),
        );
        answer
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(1));
        return answer;
    };
    // A small body has usually come with the head: read at once, with no timer armed.
    let mut read = std::pin::pin!(read_body(body, gateway.inner.max_body_bytes));
    let first = std::future::poll_fn(|c| Poll::Ready(read.as_mut().poll(c))).await;
    let read = match first {
        Poll::Ready(read) => Ok(read),
        Poll::Pending => tokio::time::timeout(gateway.inner.limits.read, read).await,
    };
    let Ok(read) = read else {
        return refuse(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the body was not sent within the gateway's {:?}: send it whole, at once",
                gateway.inner.limits.read
            ),
        );
    };
    let body = match read {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the body is over the gateway's limit of {} bytes: send smaller arguments",
                    gateway.inner.max_body_bytes
                ),
            )
        }
        Err(BodyError::Broken(e)) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("the body could not be read ({e}): send it whole"),
            )
        }
    };
    let args = match bind(
        served,
        &parts.method,
        &path_params,
        parts.uri.query(),
        &body,
    ) {
        Ok(args) => args,
        Err(message) => return refuse(StatusCode::BAD_REQUEST, message),
    };
    let attachments = match attachments(&parts.headers) {
        Ok(attachments) => attachments,
        Err(message) => return refuse(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, message),
    };
    let entry_id = served.entry.id.as_str().to_string();
    let span = tracing::info_span!(
        "rpc.gateway",
        otel.kind = "server",
        http.request.method = %parts.method,
        http.route = %served.route.path,
        rpc.entry_id = %entry_id,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    #[cfg(feature = "otel")]
    let carried = otel::carried(&parts.headers);
    drop(table);
    // The request's head and body are slices of the connection's read buffer: held while the
    // call is out, they would make hyper take a new buffer for its next read.
    drop((parts, body));
    let client = gateway.inner.client.clone();
    // Boxed: the governed call's future is some kilobytes, and each wrapper it passes
    // through (the span, the trace context) would move it whole; so would any mover of this
    // handler's own future, which would hold it.
    let call = Box::pin(async {
        let call = client.invoke_json_encoded(&entry_id, args);
        // With no header to forward, no context to set (the handler's task has none): the
        // call sees none either way.
        if attachments.is_empty() {
            call.await
        } else {
            RpcContext::scope(attachments, call).await
        }
    })
    .instrument(span.clone());
    #[cfg(feature = "otel")]
    let result = otel::traced(&span, carried, call).await;
    #[cfg(not(feature = "otel"))]
    let result = call.await;
    let answer = match result {
        Ok(answer) => answered(&entry_id, &answer),
        Err(e) => failed(&e),
    };
    // A number, as OpenTelemetry's HTTP conventions have it (an unsigned one would reach it as
    // text); a server's span is an error for a 5xx answer only (a 4xx is the caller's).
    let status = answer.status();
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    answer
}

/// Why a request's body could not be read whole.
enum BodyError {
    /// Over the gateway's limit (said by its length, or found reading it).
    TooLarge,
    /// Cut off or malformed.
    Broken(axum::Error),
}

/// The body whole, at most `limit` bytes. A body of one data frame (a small one, as it usually
/// comes) is that frame's bytes as they are, with no copy and no list of frames; frames past
/// the first are joined.
async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, BodyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<axum::BoxError>,
{
    use http_body_util::BodyExt;
    let mut body = std::pin::pin!(body);
    if body.size_hint().lower() > limit as u64 {
        return Err(BodyError::TooLarge);
    }
    let mut first: Option<Bytes> = None;
    let mut joined: Option<Vec<u8>> = None;
    while let Some(frame) = body.frame().await {
        // (Trailers, which no caller of an entry sends, are not arguments.)
        let frame = frame.map_err(|e| BodyError::Broken(axum::Error::new(e)))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let read = joined.as_ref().map_or(0, Vec::len) + first.as_ref().map_or(0, Bytes::len);
        if read + data.len() > limit {
            return Err(BodyError::TooLarge);
        }
        match (&mut first, &mut joined) {
            (None, None) => first = Some(data),
            (Some(one), None) => {
                let mut all = Vec::with_capacity(one.len() + data.len());
                all.extend_from_slice(one);
                all.extend_from_slice(&data);
                first = None;
                joined = Some(all);
            }
            (_, Some(all)) => all.extend_from_slice(&data),
        }
    }
    Ok(match joined {
        Some(all) => Bytes::from(all),
        None => first.unwrap_or_default(),
    })
}

/// The HTTP answer of a call that succeeded: its result as JSON text, written from the
/// server's encoding with no JSON value in between; or, when the result cannot be JSON (a
/// service's answer the gateway cannot pass on), 502 with the error body of call status 500.
fn answered(entry_id: &str, answer: &rpc_client::JsonAnswer) -> Response {
    // As axum's `Json` starts its buffer.
    let mut text = Vec::with_capacity(128);
    match answer.write_json(&mut text) {
        Ok(()) => {
            // Made as it is sent: through `IntoResponse`, the bytes would be given a content
            // type of their own first, then this one.
            let mut answer = Response::new(axum::body::Body::from(text));
            answer.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            answer
        }
        Err(e) => {
            let error = RpcError::new(
                rpc_core::StatusCode::FrameworkError,
                format!(
                    "{entry_id}: the service's answer is not readable as JSON ({e}); the \
                     service answered, and the gateway cannot pass its answer on"
                ),
            );
            (StatusCode::BAD_GATEWAY, Json(error_body(&error))).into_response()
        }
    }
}

/// The HTTP answer of a failed call.
fn failed(error: &RpcError) -> Response {
    let status = http_status(error.code());
    let mut answer = (status, Json(error_body(error))).into_response();
    if status == StatusCode::UNAUTHORIZED {
        // Every 401 names the scheme to authenticate with (RFC 9110 section 15.5.2).
        answer
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if carries_retry_after(status) {
        let secs = error
            .retry_after()
            .map_or(1, |d| d.as_secs() + u64::from(d.subsec_nanos() > 0))
            .max(1);
        answer
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    answer
}

/// The query's pairs, decoded as HTML forms encode them (`+` a space, `%XX` a byte), or what
/// is wrong: a name or value that is not UTF-8 once decoded is refused, as in the path, rather
/// than passed on with its bytes replaced.
fn query_pairs(query: &str) -> Result<Vec<(String, String)>, String> {
    let decode = |text: &str| {
        let spaced = text.replace('+', " ");
        percent_encoding::percent_decode_str(&spaced)
            .decode_utf8()
            .map(std::borrow::Cow::into_owned)
    };
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let name = decode(name)
                .map_err(|_| format!("query parameter {name:?} is not UTF-8 once decoded"))?;
            let value = decode(value)
                .map_err(|_| format!("query parameter {name:?} is not UTF-8 once decoded"))?;
            Ok((name, value))
        })
        .collect()
}

/// The call's arguments as the positional JSON array the entry takes (see the crate's
/// documentation), or what is wrong with the request.
fn bind(
    served: &Served,
    method: &Method,
    path_params: &[(String, String)],
    query: Option<&str>,
    body: &Bytes,
) -> Result<Value, String> {
    let entry = served.entry.id.as_str();
    // Arguments where this method does not read them would be dropped without a word.
    let no_body = body.iter().all(u8::is_ascii_whitespace);
    if params_in_query(method) && !no_body {
        return Err(format!(
            "a {method} request takes its arguments in the query, and this one has a body: \
             send them as ?name=value"
        ));
    }
    if !params_in_query(method) && query.is_some_and(|q| !q.is_empty()) {
        return Err(format!(
            "a {method} request takes its arguments in the body, and this one has a query: \
             send them as a JSON object in the body"
        ));
    }
    let body_value = if no_body {
        None
    } else {
        Some(serde_json::from_slice::<JsonBody>(body).map_err(|e| {
            format!(
                "the body is not JSON ({e}): send a JSON object of named arguments, such as \
                 {{\"text\": \"hi\"}}"
            )
        })?)
    };
    let Some(params) = &served.params else {
        // No names published: only positional arguments can be bound.
        return match body_value {
            None => Ok(Value::Array(Vec::new())),
            Some(JsonBody::Value(Value::Array(list))) => Ok(Value::Array(list)),
            Some(_) => Err(format!(
                "{entry} publishes no parameter names: send its arguments as a JSON array in \
                 declaration order"
            )),
        };
    };
    let expected = || {
        if params.is_empty() {
            "it takes no arguments".to_string()
        } else {
            format!("it takes {}", params.join(", "))
        }
    };
    // Each parameter's value, in declaration order, as the arguments go.
    let mut named: Vec<Option<Value>> = vec![None; params.len()];
    let mut take = |name: String, value: Value, from: &str| -> Result<(), String> {
        let Some(i) = params.iter().position(|p| *p == name) else {
            return Err(format!(
                "{entry} has no argument {name:?} (from the {from}): {}",
                expected()
            ));
        };
        if named[i].replace(value).is_some() {
            return Err(format!(
                "argument {name:?} of {entry} is given twice: give it once, in the path, the \
                 query or the body"
            ));
        }
        Ok(())
    };
    for (name, raw) in path_params {
        let text = percent_encoding::percent_decode_str(raw)
            .decode_utf8()
            .map_err(|_| format!("path parameter {name:?} is not UTF-8 once decoded"))?;
        let value = text_value(served, params, name, &text);
        take(name.clone(), value, "path")?;
    }
    if params_in_query(method) {
        for (name, text) in query_pairs(query.unwrap_or(""))? {
            let value = text_value(served, params, &name, &text);
            take(name, value, "query")?;
        }
    }
    match body_value {
        None => {}
        Some(JsonBody::Object(pairs)) => {
            for (name, value) in pairs {
                take(name, value, "body")?;
            }
        }
        Some(JsonBody::Value(Value::Array(list))) if path_params.is_empty() => {
            if list.len() != params.len() {
                return Err(format!(
                    "{entry} takes {} arguments ({}), the body's array has {}",
                    params.len(),
                    params.join(", "),
                    list.len()
                ));
            }
            return Ok(Value::Array(list));
        }
        Some(JsonBody::Value(other)) => {
            return Err(format!(
                "the body must be a JSON object of named arguments ({}), not {}",
                expected(),
                rpc_client::json_kind(&other)
            ))
        }
    }
    let mut args = Vec::with_capacity(params.len());
    for (i, (name, value)) in params.iter().zip(named).enumerate() {
        match value {
            Some(value) => args.push(value),
            None if served.nullable.get(i).copied().unwrap_or(false) => args.push(Value::Null),
            None => {
                return Err(format!(
                    "argument {name:?} of {entry} is missing: {}",
                    expected()
                ))
            }
        }
    }
    Ok(Value::Array(args))
}

/// A request body as JSON: an object kept as its members in order, each one as given (so that
/// a name given twice is seen, where a JSON object would keep the last silently), or any other
/// value.
enum JsonBody {
    Object(Vec<(String, Value)>),
    Value(Value),
}

impl<'de> serde::Deserialize<'de> for JsonBody {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = JsonBody;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<JsonBody, A::Error> {
                let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
                while let Some(pair) = map.next_entry::<String, Value>()? {
                    pairs.push(pair);
                }
                Ok(JsonBody::Object(pairs))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<JsonBody, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(item) = seq.next_element::<Value>()? {
                    items.push(item);
                }
                Ok(JsonBody::Value(Value::Array(items)))
            }

            fn visit_bool<E>(self, v: bool) -> Result<JsonBody, E> {
                Ok(JsonBody::Value(Value::Bool(v)))
            }

            fn visit_i64<E>(self, v: i64) -> Result<JsonBody, E> {
                Ok(JsonBody::Value(Value::from(v)))
            }

            fn visit_u64<E>(self, v: u64) -> Result<JsonBody, E> {
                Ok(JsonBody::Value(Value::from(v)))
            }

            fn visit_f64<E>(self, v: f64) -> Result<JsonBody, E> {
                Ok(JsonBody::Value(Value::from(v)))
            }

            fn visit_str<E>(self, v: &str) -> Result<JsonBody, E> {
                Ok(JsonBody::Value(Value::String(v.to_string())))
            }

            fn visit_string<E>(self, v: String) -> Result<JsonBody, E> {
                Ok(JsonBody::Value(Value::String(v)))
            }

            fn visit_unit<E>(self) -> Result<JsonBody, E> {
                Ok(JsonBody::Value(Value::Null))
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

/// A path or query value: text when the parameter's schema says string (or string or null);
/// `null` when it is empty and the schema accepts null; else read as JSON (`42`, `true`,
/// `[1,2]`), and text when it is not JSON.
fn text_value(served: &Served, params: &[String], name: &str, text: &str) -> Value {
    let index = params.iter().position(|p| p == name);
    let says = |per_param: &[bool]| index.and_then(|i| per_param.get(i).copied()) == Some(true);
    if says(&served.is_string) {
        return Value::String(text.to_string());
    }
    if text.is_empty() && says(&served.nullable) {
        return Value::Null;
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

/// The request's headers that travel as attachments (see the crate's documentation).
fn attachments(headers: &HeaderMap) -> Result<BTreeMap<String, String>, String> {
    let named_by_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect();
    // A trace context with more than one parent is none (W3C Trace Context): joined into one
    // value it would not parse at the server either, so the server starts a trace of its own,
    // as the gateway's span does (`otel::carried`).
    let no_trace = !one_traceparent(headers);
    let mut out = BTreeMap::new();
    let mut bytes = 0;
    for (name, value) in headers {
        let name = name.as_str();
        if NOT_FORWARDED.contains(&name)
            || NOT_FORWARDED_PREFIXES.iter().any(|p| name.starts_with(p))
            || named_by_connection.iter().any(|n| n == name)
            || (no_trace && (name == "traceparent" || name == "tracestate"))
        {
            continue;
        }
        // UTF-8 values travel as they are (`to_str` takes visible ASCII only); others, which
        // an attachment (a string) cannot hold, stay behind.
        let Ok(value) = std::str::from_utf8(value.as_bytes()) else {
            continue;
        };
        bytes += name.len() + value.len();
        let merged = match out.remove(name) {
            Some(before) => format!("{before}, {value}"),
            None => value.to_string(),
        };
        out.insert(name.to_string(), merged);
        if out.len() > MAX_ATTACHMENTS || bytes > MAX_ATTACHMENT_BYTES {
            return Err(format!(
                "too many headers to forward: at most {MAX_ATTACHMENTS} headers of \
                 {MAX_ATTACHMENT_BYTES} bytes in all travel to the service; send fewer"
            ));
        }
    }
    Ok(out)
}

/// Whether the request carries exactly one `traceparent` header: a trace context to continue.
fn one_traceparent(headers: &HeaderMap) -> bool {
    headers.get_all("traceparent").iter().count() == 1
}

#[cfg(feature = "otel")]
mod otel {
    use axum::http::HeaderMap;
    use opentelemetry::propagation::{Extractor, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct Headers<'a>(&'a HeaderMap);

    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }

    /// The request's trace context (from `traceparent`/`tracestate`), when it carries a valid
    /// one.
    pub(super) fn carried(headers: &HeaderMap) -> Option<opentelemetry::Context> {
        if !super::one_traceparent(headers) {
            return None;
        }
        let cx = TraceContextPropagator::new().extract(&Headers(headers));
        cx.span().span_context().is_valid().then_some(cx)
    }

    /// Runs `call` under the request's trace context `carried`, the parent of `span`: the
    /// gateway's span is its child and the client's is the gateway span's, or, when a filter
    /// keeps the gateway's span from OpenTelemetry (at any level, or the OpenTelemetry layer's
    /// own filter), the client's span is the request's child directly, rather than the root of
    /// a trace of its own.
    pub(super) async fn traced<F: std::future::Future>(
        span: &tracing::Span,
        carried: Option<opentelemetry::Context>,
        call: F,
    ) -> F::Output {
        use opentelemetry::trace::FutureExt as _;
        match carried {
            Some(cx) => {
                if !span.is_disabled() {
                    let _ = span.set_parent(cx.clone());
                }
                call.with_context(cx).await
            }
            None => call.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;

    use super::*;
    use crate::table::RouteTable;
    use rpc_core::{EntryApi, HttpRoute};

    /// A body of `frames`, sent one after another with no length given (as a chunked body).
    fn frames(frames: Vec<Result<&'static str, &'static str>>) -> Body {
        Body::from_stream(futures_util::stream::iter(
            frames
                .into_iter()
                .map(|f| f.map(|text| Bytes::from_static(text.as_bytes()))),
        ))
    }

    #[tokio::test]
    async fn a_body_of_one_frame_is_taken_as_it_is() {
        let sent = Bytes::from_static(b"{\"text\":\"hi\"}");
        let read = read_body(Body::from(sent.clone()), 64).await;
        let Ok(read) = read else { panic!("not read") };
        assert_eq!(read, sent);
        assert_eq!(read.as_ptr(), sent.as_ptr(), "copied");
    }

    #[tokio::test]
    async fn a_body_of_several_frames_is_joined() {
        let read = read_body(frames(vec![Ok("{\"te"), Ok("xt\":"), Ok("\"hi\"}")]), 64).await;
        let Ok(read) = read else { panic!("not read") };
        assert_eq!(&read[..], b"{\"text\":\"hi\"}");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_too_large_by_its_length_or_as_it_is_read() {
        // Its length said: refused before a byte is read.
        let said = read_body(Body::from(vec![b'x'; 65]), 64).await;
        assert!(matches!(said, Err(BodyError::TooLarge)));
        // No length said: refused at the frame that goes past the limit.
        let found = read_body(frames(vec![Ok("0123456789"), Ok("0123456789")]), 15).await;
        assert!(matches!(found, Err(BodyError::TooLarge)));
        // At the limit exactly: read.
        let at = read_body(frames(vec![Ok("0123456789"), Ok("01234")]), 15).await;
        assert!(matches!(at, Ok(b) if b.len() == 15));
    }

    #[tokio::test]
    async fn a_body_cut_off_is_broken() {
        let read = read_body(frames(vec![Ok("{\"te"), Err("reset")]), 64).await;
        assert!(matches!(read, Err(BodyError::Broken(e)) if e.to_string().contains("reset")));
    }

    fn table(params: &[&str], http: Option<(&str, &str)>) -> RouteTable {
        RouteTable::build(vec![ServiceEntry {
            id: "shop.Orders.find".into(),
            service_id: "shop.Orders".into(),
            method: "find".into(),
            hash_key: None,
            governance: Default::default(),
            api: Some(EntryApi {
                params: params.iter().map(|p| p.to_string()).collect(),
                http: http.map(|(m, p)| HttpRoute {
                    method: m.into(),
                    path: p.into(),
                }),
                schemas: Some(rpc_core::EntrySchemas {
                    params: params
                        .iter()
                        .map(|p| {
                            if *p == "name" {
                                json!({"type": "string"})
                            } else {
                                json!(true)
                            }
                        })
                        .collect(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }])
    }

    fn bind_at(
        t: &RouteTable,
        method: Method,
        path: &str,
        query: Option<&str>,
        body: &str,
    ) -> Result<Value, String> {
        let Found::Entry(served, params) = t.find(&method, path) else {
            panic!("no route");
        };
        bind(
            served,
            &method,
            &params,
            query,
            &Bytes::from(body.to_string()),
        )
    }

    #[test]
    fn path_and_query_values_bind_by_name_in_declaration_order() {
        let t = table(&["id", "name", "full"], Some(("GET", "/orders/{id}")));
        assert_eq!(
            bind_at(
                &t,
                Method::GET,
                "/orders/42",
                Some("full=true&name=007"),
                ""
            ),
            Ok(json!([42, "007", true]))
        );
        assert_eq!(
            bind_at(
                &t,
                Method::GET,
                "/orders/a%20b",
                Some("full=1&name=x+y"),
                ""
            ),
            Ok(json!(["a b", "x y", 1]))
        );
    }

    #[test]
    fn a_path_or_query_value_that_is_not_utf8_once_decoded_is_refused() {
        let t = table(&["id", "name"], Some(("GET", "/orders/{id}")));
        for (path, query, named) in [
            ("/orders/%FF", Some("name=x"), "path parameter \"id\""),
            ("/orders/1", Some("name=%FF"), "query parameter \"name\""),
            (
                "/orders/1",
                Some("na%FFme=x"),
                "query parameter \"na%FFme\"",
            ),
        ] {
            let e = bind_at(&t, Method::GET, path, query, "").unwrap_err();
            assert!(
                e.contains(named) && e.contains("not UTF-8"),
                "{path} {query:?}: {e}"
            );
        }
        // Decoded as forms are: `+` a space, `%2B` a plus, empty pairs skipped.
        let t = table(&["id", "name", "full"], Some(("GET", "/orders/{id}")));
        assert_eq!(
            bind_at(
                &t,
                Method::GET,
                "/orders/1",
                Some("name=a+b%2Bc&&full=1&"),
                ""
            ),
            Ok(json!([1, "a b+c", 1]))
        );
    }

    #[test]
    fn a_missing_or_unknown_argument_is_named_with_the_expected_ones() {
        let t = table(&["id", "name"], None);
        let missing = bind_at(
            &t,
            Method::POST,
            "/api/shop.Orders/find",
            None,
            r#"{"id": 1}"#,
        )
        .unwrap_err();
        assert!(
            missing.contains("\"name\" of shop.Orders.find is missing"),
            "{missing}"
        );
        assert!(missing.contains("it takes id, name"), "{missing}");
        let unknown = bind_at(
            &t,
            Method::POST,
            "/api/shop.Orders/find",
            None,
            r#"{"id": 1, "nme": "x", "name": "y"}"#,
        )
        .unwrap_err();
        assert!(unknown.contains("no argument \"nme\""), "{unknown}");
    }

    #[test]
    fn an_array_body_is_positional_and_bad_json_is_refused() {
        let t = table(&["id", "name"], None);
        assert_eq!(
            bind_at(
                &t,
                Method::POST,
                "/api/shop.Orders/find",
                None,
                r#"[1, "x"]"#
            ),
            Ok(json!([1, "x"]))
        );
        let bad = bind_at(&t, Method::POST, "/api/shop.Orders/find", None, "{id: 1").unwrap_err();
        assert!(bad.starts_with("the body is not JSON"), "{bad}");
    }

    #[test]
    fn arguments_where_the_method_does_not_read_them_are_refused() {
        let post = table(&["order", "dry_run"], Some(("POST", "/orders")));
        let e = bind_at(
            &post,
            Method::POST,
            "/orders",
            Some("dry_run=true"),
            r#"{"order": 1}"#,
        )
        .unwrap_err();
        assert!(e.contains("has a query"), "{e}");
        // An empty query is none.
        assert_eq!(
            bind_at(
                &post,
                Method::POST,
                "/orders",
                Some(""),
                r#"{"order": 1, "dry_run": false}"#
            ),
            Ok(json!([1, false]))
        );
        let get = table(&["id", "full"], Some(("GET", "/orders/{id}")));
        let e = bind_at(&get, Method::GET, "/orders/1", None, r#"{"full": true}"#).unwrap_err();
        assert!(e.contains("has a body"), "{e}");
        assert_eq!(
            bind_at(&get, Method::GET, "/orders/1", Some("full=true"), " \n"),
            Ok(json!([1, true]))
        );
    }

    #[test]
    fn an_argument_named_twice_in_the_body_is_refused() {
        let t = table(&["id", "name"], None);
        let path = "/api/shop.Orders/find";
        let twice = bind_at(
            &t,
            Method::POST,
            path,
            None,
            r#"{"id": 1, "name": "a", "id": 2}"#,
        )
        .unwrap_err();
        assert!(
            twice.contains(r#"argument "id""#) && twice.contains("given twice"),
            "{twice}"
        );
        // Nested objects are the argument's own value: JSON's rules, not the gateway's.
        assert_eq!(
            bind_at(
                &t,
                Method::POST,
                path,
                None,
                r#"{"id": {"a": 1}, "name": null}"#
            ),
            Ok(json!([{"a": 1}, null]))
        );
        for (body, kind) in [("7", "a number"), (r#""x""#, "a string"), ("null", "null")] {
            let e = bind_at(&t, Method::POST, path, None, body).unwrap_err();
            assert!(e.ends_with(&format!("not {kind}")), "{body}: {e}");
        }
    }

    #[test]
    fn hop_by_hop_and_private_headers_stay_behind() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("x-tenant", "acme"),
            ("authorization", "Bearer t"),
            ("cookie", "a=b"),
            ("content-type", "application/json"),
            ("accept", "*/*"),
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("rpc-retry-depth", "9"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        let a = attachments(&h).unwrap();
        assert_eq!(
            a.keys().map(String::as_str).collect::<Vec<_>>(),
            ["traceparent", "x-tenant"]
        );
    }

    /// Two `traceparent` headers are no trace context (W3C Trace Context): neither they nor
    /// the `tracestate` that goes with them travel, where joined they would reach the server as
    /// one value it cannot read; one travels with its `tracestate`.
    #[test]
    fn a_repeated_traceparent_travels_not_at_all() {
        let parents = [
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01",
        ];
        for count in [1, 2] {
            let mut h = HeaderMap::new();
            for parent in &parents[..count] {
                h.append("traceparent", HeaderValue::from_static(parent));
            }
            h.append("tracestate", HeaderValue::from_static("a=1"));
            h.append("x-tenant", HeaderValue::from_static("acme"));
            let a = attachments(&h).unwrap();
            let kept: Vec<&str> = a.keys().map(String::as_str).collect();
            if count == 1 {
                assert_eq!(kept, ["traceparent", "tracestate", "x-tenant"]);
                assert_eq!(a["traceparent"], parents[0]);
            } else {
                assert_eq!(kept, ["x-tenant"], "{count} traceparent headers");
            }
            #[cfg(feature = "otel")]
            assert_eq!(otel::carried(&h).is_some(), count == 1, "{count}");
        }
    }

    #[test]
    fn utf8_header_values_travel_and_other_bytes_stay_behind() {
        let mut h = HeaderMap::new();
        h.append(
            "x-user",
            HeaderValue::from_bytes("José".as_bytes()).expect("obs-text"),
        );
        h.append(
            "x-latin1",
            HeaderValue::from_bytes(b"Jos\xe9").expect("obs-text"),
        );
        let a = attachments(&h).unwrap();
        assert_eq!(a.get("x-user").map(String::as_str), Some("José"));
        assert!(!a.contains_key("x-latin1"), "{a:?}");
    }

    #[test]
    fn more_headers_than_the_bound_are_refused() {
        let mut h = HeaderMap::new();
        for i in 0..=MAX_ATTACHMENTS {
            h.insert(
                axum::http::HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("v"),
            );
        }
        assert!(attachments(&h).unwrap_err().contains("at most 32 headers"));
    }
}
