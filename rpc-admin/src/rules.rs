//! The rules routes: the governance and routing documents of the rule store, read, checked,
//! written, and rolled back through the admin endpoint.
//!
//! The rules steer every process that follows them, so an operator changing them wants to see
//! the text in force next to the version their own process applied, to check a draft before it
//! can reach anyone, to never overwrite a colleague's change unknowingly, and to undo a change.
//! `rpcctl rules` does that from a terminal; these routes do it for the web console (and for
//! scripts) over the process's own admin endpoint, with the same store and the same checks: a
//! write names the version it replaces (`?expected=V`), an invalid document writes nothing, and
//! a rollback writes an old text again as a new version.
//!
//! The store is attached with `AdminBuilder::rules` (feature `etcd`). Without one, the
//! versions this process applied are still shown and drafts can still be validated; the routes
//! that read or write the store answer 404 saying how to attach one.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{RawQuery, State as Shared};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::future::BoxFuture;
use rpc_registry::{RuleError, RuleKind, RuleVersion};
use serde_json::{json, Value};

use crate::api::PathArgs;
use crate::State;

type St = Shared<Arc<State>>;

/// A refusal: its status and its JSON body (`{"error": ...}`, and more for a conflict).
#[derive(Debug)]
struct Refusal(StatusCode, Value);

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Refusal(status, json!({ "error": message.into() }))
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

/// What a route answers: a JSON object, or a refusal.
type Answer = Result<Json<Value>, Refusal>;

/// What the routes need of a rule store (the etcd `RuleStore`, feature `etcd`), as an object
/// so that the routes are the same in every build.
pub(crate) trait Store: Send + Sync + 'static {
    /// The document of `kind` in force, if any.
    fn get(&self, kind: RuleKind) -> BoxFuture<'_, Result<Option<RuleVersion>, RuleError>>;
    /// Validates and writes `text` over version `expected`; the new version.
    fn set<'a>(
        &'a self,
        kind: RuleKind,
        text: &'a str,
        expected: i64,
    ) -> BoxFuture<'a, Result<i64, RuleError>>;
    /// The versions the history keeps, oldest first.
    fn history(&self, kind: RuleKind) -> BoxFuture<'_, Result<Vec<RuleVersion>, RuleError>>;
    /// Writes the text of `version` again, over version `expected` when given (else over the
    /// one in force); the new version.
    fn rollback(
        &self,
        kind: RuleKind,
        version: i64,
        expected: Option<i64>,
    ) -> BoxFuture<'_, Result<i64, RuleError>>;
}

#[cfg(feature = "etcd")]
impl Store for rpc_registry::RuleStore {
    fn get(&self, kind: RuleKind) -> BoxFuture<'_, Result<Option<RuleVersion>, RuleError>> {
        Box::pin(rpc_registry::RuleStore::get(self, kind))
    }

    fn set<'a>(
        &'a self,
        kind: RuleKind,
        text: &'a str,
        expected: i64,
    ) -> BoxFuture<'a, Result<i64, RuleError>> {
        Box::pin(rpc_registry::RuleStore::set(self, kind, text, expected))
    }

    fn history(&self, kind: RuleKind) -> BoxFuture<'_, Result<Vec<RuleVersion>, RuleError>> {
        Box::pin(rpc_registry::RuleStore::history(self, kind))
    }

    fn rollback(
        &self,
        kind: RuleKind,
        version: i64,
        expected: Option<i64>,
    ) -> BoxFuture<'_, Result<i64, RuleError>> {
        Box::pin(rpc_registry::RuleStore::rollback_over(
            self, kind, version, expected,
        ))
    }
}

/// The rules routes, to be guarded by the token like the rest of the API.
pub(crate) fn routes() -> Router<Arc<State>> {
    Router::new()
        .route("/api/rules", get(overview))
        .route("/api/rules/{kind}", get(document).put(write))
        .route("/api/rules/{kind}/validate", post(validate))
        .route("/api/rules/{kind}/history", get(history))
        .route("/api/rules/{kind}/rollback/{version}", post(rollback))
}

/// The kind a path names, or a 404 naming the kinds.
fn kind_of(name: &str) -> Result<RuleKind, Refusal> {
    name.parse::<RuleKind>()
        .map_err(|e| Refusal::new(StatusCode::NOT_FOUND, e.to_string()))
}

/// What to do when no store is attached.
const NO_STORE: &str = if cfg!(feature = "etcd") {
    "this process's admin endpoint has no rule store: rules live in etcd; start the process \
     with `--registry etcd://host:port` (the example programs) or attach the registry's store \
     with AdminBuilder::rules; POST /api/rules/{kind}/validate checks a document without one"
} else {
    "this process's admin endpoint has no rule store: rules live in etcd, and this build has no \
     etcd support; rebuild with the `etcd` feature of rpc (or rpc-admin) and start the process \
     with `--registry etcd://host:port`; POST /api/rules/{kind}/validate checks a document \
     without one"
};

/// The attached store, or a 404 saying how to attach one.
fn store(state: &State) -> Result<&dyn Store, Refusal> {
    state
        .rules
        .as_deref()
        .ok_or_else(|| Refusal::new(StatusCode::NOT_FOUND, NO_STORE))
}

/// A store's refusal as an answer: an invalid document is 400, a version changed meanwhile
/// 409 (with both versions, so a tool can reload), a version the history does not keep 404,
/// a document over the store's limit 413, an unreachable store 503.
fn failed(e: RuleError) -> Refusal {
    match e {
        RuleError::Invalid { .. } => Refusal::new(StatusCode::BAD_REQUEST, e.to_string()),
        RuleError::TooLarge { .. } => Refusal::new(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
        RuleError::Conflict {
            kind,
            expected,
            found,
        } => Refusal(
            StatusCode::CONFLICT,
            json!({
                "error": format!(
                    "the {kind} rules changed meanwhile (expected version {expected}, found \
                     {found}); nothing was written: reload them (GET /api/rules/{kind}) and \
                     apply your change again"
                ),
                "expected": expected,
                "found": found,
            }),
        ),
        RuleError::UnknownVersion { .. } | RuleError::UnknownKind(_) => {
            Refusal::new(StatusCode::NOT_FOUND, e.to_string())
        }
        RuleError::Registry(_) => Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{e}; the rules were not changed: try again once etcd answers"),
        ),
    }
}

/// The versions of `kind` the attached client and server applied (`null`: none, or nothing
/// attached).
fn applied(state: &State, kind: RuleKind) -> Value {
    json!({
        "client": state.client.as_ref().and_then(|c| c.rules_version(kind)),
        "server": state.server.as_ref().and_then(|s| s.rules_version(kind)),
    })
}

/// `GET /api/rules`: per kind, the version in force in the store (`null` without a store, 0
/// when it holds none) and the versions this process applied.
async fn overview(Shared(state): St) -> Json<Value> {
    let store = state.rules.as_deref();
    let mut kinds = Vec::new();
    let mut store_error = None;
    for kind in RuleKind::ALL {
        let version = match store {
            None => Value::Null,
            Some(store) => match store.get(kind).await {
                Ok(v) => json!(v.map_or(0, |v| v.version)),
                Err(e) => {
                    store_error = Some(e.to_string());
                    Value::Null
                }
            },
        };
        kinds.push(json!({
            "kind": kind.as_str(),
            "version": version,
            "applied": applied(&state, kind),
        }));
    }
    Json(json!({
        "store": store.is_some(),
        "store_error": store_error,
        "kinds": kinds,
    }))
}

/// `GET /api/rules/{kind}`: the document in force (version 0 and no text when there is none).
async fn document(Shared(state): St, PathArgs(kind): PathArgs<String>) -> Answer {
    let kind = kind_of(&kind)?;
    let v = store(&state)?.get(kind).await.map_err(failed)?;
    let (version, text, unreadable) = v.map_or((0, Arc::from(""), None), |v| {
        (v.version, v.text, v.unreadable)
    });
    Ok(Json(json!({
        "kind": kind.as_str(),
        "version": version,
        "text": &*text,
        "unreadable": unreadable.as_deref(),
        "applied": applied(&state, kind),
    })))
}

/// The body as the document's text, or a refusal saying what to send (over axum's body limit
/// of 2 MiB: 413).
fn text_of(body: &Result<Bytes, BytesRejection>) -> Result<&str, Refusal> {
    let body = body.as_ref().map_err(|e| {
        Refusal::new(
            e.status(),
            format!("the body could not be read ({e}): send the rules document, at most 2 MiB"),
        )
    })?;
    std::str::from_utf8(body).map_err(|e| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("the body must be the rules document, TOML text in UTF-8: {e}"),
        )
    })
}

/// Why `text` is no document of `kind` to write: it does not validate (a store would take it,
/// and every client would keep its last good version and log a `rule_rejected`), or the
/// attached client's check refuses it (governance options an entry it already called cannot
/// carry out, such as consistent hashing for a method without a `#[hash_key]`, which clients
/// would apply with that strategy left out for the entry).
fn refused(state: &State, kind: RuleKind, text: &str) -> Option<String> {
    if let Err(e) = kind.validate(text) {
        return Some(e.message().to_string());
    }
    let client = state.client.as_ref()?;
    client.check_rules(kind, text).err().map(|e| {
        format!(
            "this process's client refuses the document: {}",
            e.message()
        )
    })
}

/// `POST /api/rules/{kind}/validate`: whether the body is a valid document of `kind` (one the
/// attached client would take, if one is attached), and why not. Needs no store; writes
/// nothing.
async fn validate(
    Shared(state): St,
    PathArgs(kind): PathArgs<String>,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let kind = kind_of(&kind)?;
    let text = text_of(&body)?;
    Ok(Json(match refused(&state, kind, text) {
        None => json!({ "valid": true }),
        Some(why) => json!({ "valid": false, "error": why }),
    }))
}

/// `text` as a document to write, or a 400 saying why not ([`refused`]).
fn writable(state: &State, kind: RuleKind, text: &str) -> Result<(), Refusal> {
    match refused(state, kind, text) {
        None => Ok(()),
        Some(why) => Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("{why}; nothing was written"),
        )),
    }
}

/// The `expected` version of a write's query (`?expected=V`), or a 400 saying what to send.
fn expected_of(query: Option<&str>, kind: RuleKind) -> Result<i64, Refusal> {
    let missing = || {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!(
                "say which version this document replaces: PUT /api/rules/{kind}?expected=V, \
                 with V the version GET /api/rules/{kind} answered (0 when there is none)"
            ),
        )
    };
    let value = query
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix("expected="))
        .ok_or_else(missing)?;
    value
        .parse::<i64>()
        .ok()
        .filter(|v| *v >= 0)
        .ok_or_else(|| {
            Refusal::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "expected={value:?} is not a version: give the version GET /api/rules/{kind} \
                 answered, a whole number (0 when there is none)"
                ),
            )
        })
}

/// `PUT /api/rules/{kind}?expected=V`: validates and writes the body over version `V`.
async fn write(
    Shared(state): St,
    PathArgs(kind): PathArgs<String>,
    RawQuery(query): RawQuery,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let kind = kind_of(&kind)?;
    let store = store(&state)?;
    let expected = expected_of(query.as_deref(), kind)?;
    let text = text_of(&body)?;
    writable(&state, kind, text)?;
    let version = store.set(kind, text, expected).await.map_err(failed)?;
    tracing::info!(
        target: "rpc::rules",
        kind = kind.as_str(),
        expected,
        version,
        "rules written through the admin endpoint"
    );
    Ok(Json(json!({ "kind": kind.as_str(), "version": version })))
}

/// `GET /api/rules/{kind}/history`: the versions the store keeps, oldest first.
async fn history(Shared(state): St, PathArgs(kind): PathArgs<String>) -> Answer {
    let kind = kind_of(&kind)?;
    let list = store(&state)?.history(kind).await.map_err(failed)?;
    let versions: Vec<Value> = list
        .iter()
        .map(|v| {
            json!({
                "version": v.version,
                "text": &*v.text,
                "unreadable": v.unreadable.as_deref(),
            })
        })
        .collect();
    Ok(Json(json!({ "kind": kind.as_str(), "versions": versions })))
}

/// `POST /api/rules/{kind}/rollback/{version}[?expected=V]`: writes the text of `version`
/// again, as a new version; over version `V` only, when given (409 when another is in force).
async fn rollback(
    Shared(state): St,
    PathArgs((kind, version)): PathArgs<(String, String)>,
    RawQuery(query): RawQuery,
) -> Answer {
    let kind = kind_of(&kind)?;
    let store = store(&state)?;
    // Any `expected` pair makes the rollback a guarded one: one without its value is refused
    // (by `expected_of`), never taken as no guard.
    let expected = match query.as_deref() {
        Some(q)
            if q.split('&')
                .any(|pair| pair.split('=').next() == Some("expected")) =>
        {
            if q.split('&')
                .any(|pair| pair == "expected" || pair == "expected=")
            {
                return Err(Refusal::new(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "expected needs a version: POST /api/rules/{kind}/rollback/{version}\
                         ?expected=V, with V the version GET /api/rules/{kind} answered (or no \
                         expected, to roll back over whatever is in force)"
                    ),
                ));
            }
            Some(expected_of(Some(q), kind)?)
        }
        _ => None,
    };
    let Ok(version) = version.parse::<i64>() else {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!(
                "{version:?} is not a version: GET /api/rules/{kind}/history lists the versions \
                 to roll back to"
            ),
        ));
    };
    // The old text is checked as a new one would be: the entries called since may not carry
    // it out.
    if let Some(old) = store
        .history(kind)
        .await
        .map_err(failed)?
        .iter()
        .find(|v| v.version == version)
    {
        writable(&state, kind, &old.text)?;
    }
    let now = store
        .rollback(kind, version, expected)
        .await
        .map_err(failed)?;
    tracing::info!(
        target: "rpc::rules",
        kind = kind.as_str(),
        from = version,
        version = now,
        "rules rolled back through the admin endpoint"
    );
    Ok(Json(
        json!({ "kind": kind.as_str(), "version": now, "rolled_back_to": version }),
    ))
}

#[cfg(test)]
mod tests {
    use super::expected_of;
    use rpc_registry::RuleKind;

    #[test]
    fn the_expected_version_is_read_from_the_query_or_refused_saying_what_to_send() {
        let g = RuleKind::Governance;
        assert_eq!(expected_of(Some("expected=12"), g).ok(), Some(12));
        assert_eq!(expected_of(Some("x=1&expected=0"), g).ok(), Some(0));
        for bad in [
            None,
            Some(""),
            Some("expected=-1"),
            Some("expected=v3"),
            Some("e=1"),
        ] {
            assert!(expected_of(bad, g).is_err(), "{bad:?}");
        }
    }
}
