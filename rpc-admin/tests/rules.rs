//! The admin endpoint's rules routes against a real etcd (started on free loopback ports by
//! the tests' harness): every route's answer, each checked against the rule store read
//! directly (`RuleStore::get` / `history`, the oracle); an invalid document and a stale
//! version refused with nothing written; a rollback bringing an old text back as a new
//! version; a client and a server following the store applying a document written through
//! the endpoint; and the token's refusals.

#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;

use std::future::Future;
use std::time::Duration;

use etcd_harness::Etcd;
use reqwest::StatusCode as Http;
use rpc::{Client, InProcessRegistry, RpcError, Server};
use rpc_admin::{Admin, AdminHandle};
use rpc_governance::events::{EventKind, GovernanceEvent};
use rpc_registry::{EtcdOptions, EtcdRegistry, RuleKind, RuleStore};
use serde_json::{json, Value};
use tokio::sync::broadcast;

#[rpc::service(name = "adm.Ruled")]
trait Ruled {
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

struct Plain;

impl Ruled for Plain {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
}

const TOKEN: &str = "t0ken";
const V1: &str = "[defaults]\ntimeout_ms = 1000\n";
const V2: &str = "[defaults]\ntimeout_ms = 2000\nbreaker_observe = true\n";
const INVALID: &str = "[defaults]\ntimeout_ms = 10\nretry_tims = 2\n";
const ROUTING: &str = "[[routes]]\nname = \"all-canary\"\nservice = \"adm.Ruled\"\n\
                       to = [ { tags = { version = \"canary\" } } ]\n";

/// Fails the test when `f` takes more than 10 s.
async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} took more than 10 s"))
}

async fn store(etcd: &Etcd) -> RuleStore {
    let options = EtcdOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..EtcdOptions::default()
    };
    EtcdRegistry::connect(&[etcd.endpoint()], options)
        .await
        .expect("etcd registry")
        .rules()
}

/// An HTTP client for one admin endpoint, sending the token.
struct Http1 {
    base: String,
    http: reqwest::Client,
}

impl Http1 {
    fn new(admin: &AdminHandle) -> Self {
        Http1 {
            base: format!("http://{}", admin.local_addr()),
            http: reqwest::Client::new(),
        }
    }

    /// Sends `method path` with `body` (if any) and the token; the status and the JSON answer.
    async fn send(&self, method: &str, path: &str, body: Option<&str>) -> (Http, Value) {
        self.send_as(Some(TOKEN), method, path, body).await
    }

    async fn send_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (Http, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        if let Some(body) = body {
            req = req.body(body.to_string());
        }
        let r = within(path, req.send()).await.expect("request");
        let status = r.status();
        let text = r.text().await.expect("body");
        let json = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
        (status, json)
    }

    /// `send`, expecting 200.
    async fn ok(&self, method: &str, path: &str, body: Option<&str>) -> Value {
        let (status, v) = self.send(method, path, body).await;
        assert_eq!(status, Http::OK, "{method} {path}: {v}");
        v
    }

    /// `send`, expecting `status` and a JSON `{"error": "..."}`; the error's message.
    async fn refused(&self, status: Http, method: &str, path: &str, body: Option<&str>) -> String {
        self.refused_as(Some(TOKEN), status, method, path, body)
            .await
    }

    /// `send_as`, expecting `status` and a JSON `{"error": "..."}`; the error's message.
    async fn refused_as(
        &self,
        token: Option<&str>,
        status: Http,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> String {
        let (got, e) = self.send_as(token, method, path, body).await;
        assert_eq!(got, status, "{method} {path}: {e}");
        e["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {path}: no error message: {e}"))
            .to_string()
    }
}

async fn admin_on(store: &RuleStore) -> AdminHandle {
    admin_with(Admin::builder(), store).await
}

/// An admin endpoint on `store`, with what `builder` already attaches.
async fn admin_with(builder: rpc_admin::AdminBuilder, store: &RuleStore) -> AdminHandle {
    builder
        .rules(store.clone())
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin")
}

/// A fresh etcd (kept alive by the first item), its rule store, an admin endpoint on that
/// store, and a client for the endpoint.
async fn started() -> (Etcd, RuleStore, AdminHandle, Http1) {
    let etcd = Etcd::start().await;
    let store = store(&etcd).await;
    let admin = admin_on(&store).await;
    let api = Http1::new(&admin);
    (etcd, store, admin, api)
}

/// The store's history as the routes answer it.
async fn history_of(store: &RuleStore, kind: RuleKind) -> Vec<Value> {
    store
        .history(kind)
        .await
        .expect("history")
        .iter()
        .map(|v| json!({ "version": v.version, "text": &*v.text, "unreadable": null }))
        .collect()
}

/// The store's document as `GET /api/rules/{kind}` answers it: version 0 and "" for none.
async fn in_store(store: &RuleStore, kind: RuleKind) -> (i64, String) {
    store
        .get(kind)
        .await
        .expect("get")
        .map_or((0, String::new()), |v| (v.version, v.text.to_string()))
}

/// Checks that the store's governance document is still V1 at `v1` after `what` was refused.
async fn assert_still_v1(store: &RuleStore, v1: i64, what: &str) {
    assert_eq!(
        in_store(store, RuleKind::Governance).await,
        (v1, V1.into()),
        "after {what}"
    );
}

/// Writes `text` through `PUT path` (expecting 200); checks the store holds it under the
/// version answered, which it returns.
async fn written(api: &Http1, store: &RuleStore, kind: RuleKind, path: &str, text: &str) -> i64 {
    let version = api.ok("PUT", path, Some(text)).await["version"]
        .as_i64()
        .expect("version");
    assert_eq!(
        in_store(store, kind).await,
        (version, text.into()),
        "after PUT {path}"
    );
    version
}

#[tokio::test]
async fn the_routes_show_write_list_and_roll_back_what_the_store_holds() {
    let (_etcd, store, _admin, api) = started().await;

    // Nothing yet: version 0 and no text, for both kinds.
    let all = api.ok("GET", "/api/rules", None).await;
    assert_eq!(all["store"], true, "{all}");
    let kinds: Vec<&str> = all["kinds"]
        .as_array()
        .expect("kinds")
        .iter()
        .map(|k| k["kind"].as_str().expect("kind"))
        .collect();
    assert_eq!(kinds, ["governance", "routing"]);
    assert!(
        all["kinds"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k["version"] == 0),
        "{all}"
    );
    let doc = api.ok("GET", "/api/rules/governance", None).await;
    assert_eq!(
        (doc["version"].clone(), doc["text"].clone()),
        (json!(0), json!(""))
    );

    // A write over "none" (expected=0): the store holds it, under the version answered.
    let governance = RuleKind::Governance;
    let path = "/api/rules/governance?expected=0";
    let v1 = written(&api, &store, governance, path, V1).await;
    let doc = api.ok("GET", "/api/rules/governance", None).await;
    assert_eq!(doc["kind"], "governance");
    assert_eq!(doc["version"], v1);
    assert_eq!(doc["text"], V1);

    // A write over v1.
    let path = format!("/api/rules/governance?expected={v1}");
    let v2 = written(&api, &store, governance, &path, V2).await;
    assert!(v2 > v1, "{v2} after {v1}");

    // The overview shows the store's versions, per kind.
    let all = api.ok("GET", "/api/rules", None).await;
    assert_eq!(all["kinds"][0]["version"], v2, "{all}");
    assert_eq!(all["kinds"][1]["version"], 0, "{all}");

    // The history is the store's, oldest first.
    let h = api.ok("GET", "/api/rules/governance/history", None).await;
    assert_eq!(h["kind"], "governance");
    let versions = h["versions"].as_array().expect("versions").clone();
    assert_eq!(versions, history_of(&store, RuleKind::Governance).await);
    assert_eq!(
        versions,
        [
            json!({ "version": v1, "text": V1, "unreadable": null }),
            json!({ "version": v2, "text": V2, "unreadable": null })
        ]
    );

    // Rolling back to v1 writes V1 again, as a new version, and the history keeps all three.
    let r = api
        .ok(
            "POST",
            &format!("/api/rules/governance/rollback/{v1}"),
            None,
        )
        .await;
    let v3 = r["version"].as_i64().expect("version");
    assert!(v3 > v2, "{v3} after {v2}");
    assert_eq!(
        in_store(&store, RuleKind::Governance).await,
        (v3, V1.into())
    );
    let h = api.ok("GET", "/api/rules/governance/history", None).await;
    assert_eq!(h["versions"].as_array().unwrap().len(), 3, "{h}");
    assert_eq!(
        h["versions"][2],
        json!({ "version": v3, "text": V1, "unreadable": null })
    );

    // Routing documents go through the same routes, to their own key.
    let path = "/api/rules/routing?expected=0";
    let r1 = written(&api, &store, RuleKind::Routing, path, ROUTING).await;
    assert_eq!(
        in_store(&store, RuleKind::Governance).await,
        (v3, V1.into())
    );
    let all = api.ok("GET", "/api/rules", None).await;
    assert_eq!(all["kinds"][1]["version"], r1, "{all}");
}

#[tokio::test]
async fn an_invalid_document_is_refused_with_400_naming_the_field_and_nothing_is_written() {
    let (_etcd, store, admin, api) = started().await;
    let v1 = store.set(RuleKind::Governance, V1, 0).await.expect("set");
    let before = history_of(&store, RuleKind::Governance).await;

    // Validation names the line and the field, and writes nothing.
    let v = api
        .ok("POST", "/api/rules/governance/validate", Some(INVALID))
        .await;
    assert_eq!(v["valid"], false, "{v}");
    let why = v["error"].as_str().expect("an error message");
    assert!(why.contains("line 3") && why.contains("retry_tims"), "{v}");
    assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{v}");
    let v = api
        .ok("POST", "/api/rules/governance/validate", Some(V2))
        .await;
    assert_eq!(v, json!({ "valid": true }));
    // A routing document is not a governance document, and the other way round.
    let v = api
        .ok("POST", "/api/rules/routing/validate", Some(ROUTING))
        .await;
    assert_eq!(v["valid"], true, "{v}");
    let v = api
        .ok("POST", "/api/rules/governance/validate", Some(ROUTING))
        .await;
    assert_eq!(v["valid"], false, "{v}");

    // A write of it: 400 with the line and the field, and the store is as it was.
    let path = format!("/api/rules/governance?expected={v1}");
    let message = api
        .refused(Http::BAD_REQUEST, "PUT", &path, Some(INVALID))
        .await;
    assert!(
        message.contains("line 3") && message.contains("retry_tims"),
        "{message}"
    );
    assert!(message.contains("nothing was written"), "{message}");
    assert_still_v1(&store, v1, "an invalid write").await;
    assert_eq!(history_of(&store, RuleKind::Governance).await, before);

    // Text that is not UTF-8 is refused before it is read.
    let r = reqwest::Client::new()
        .put(format!(
            "http://{}/api/rules/governance?expected={v1}",
            admin.local_addr()
        ))
        .bearer_auth(TOKEN)
        .body(vec![0xff, 0xfe, b'a'])
        .send()
        .await
        .expect("PUT");
    assert_eq!(r.status(), Http::BAD_REQUEST);
    let e: Value = serde_json::from_str(&r.text().await.expect("body")).expect("JSON");
    assert!(e["error"].as_str().unwrap().contains("UTF-8"), "{e}");
    assert_still_v1(&store, v1, "a write that is not UTF-8").await;
}

#[tokio::test]
async fn a_stale_or_missing_expected_version_is_refused_and_nothing_is_written() {
    let (_etcd, store, _admin, api) = started().await;

    // The console read "none" (0); meanwhile someone else wrote v1 (straight to the store).
    let v1 = store.set(RuleKind::Governance, V1, 0).await.expect("set");
    let (status, e) = api
        .send("PUT", "/api/rules/governance?expected=0", Some(V2))
        .await;
    assert_eq!(status, Http::CONFLICT, "{e}");
    assert_eq!(
        (e["expected"].clone(), e["found"].clone()),
        (json!(0), json!(v1))
    );
    let message = e["error"].as_str().expect("error");
    assert!(message.contains("reload"), "{message}");
    assert_still_v1(&store, v1, "a stale write").await;

    // No expected version, or one that is not a number: 400 saying what to send.
    for path in [
        "/api/rules/governance",
        "/api/rules/governance?expected=latest",
        "/api/rules/governance?expected=-1",
    ] {
        let message = api.refused(Http::BAD_REQUEST, "PUT", path, Some(V2)).await;
        assert!(
            message.contains("GET /api/rules/governance"),
            "{path}: {message}"
        );
    }
    assert_still_v1(&store, v1, "writes without a usable expected version").await;
    assert_eq!(store.history(RuleKind::Governance).await.unwrap().len(), 1);
}

/// A rollback made over the version the operator saw (`?expected=V`) is refused with 409 when
/// someone wrote meanwhile, and nothing is written; over the version in force it goes through.
#[tokio::test]
async fn a_rollback_over_a_stale_version_is_refused_and_nothing_is_written() {
    let (_etcd, store, _admin, api) = started().await;
    let v1 = store.set(RuleKind::Governance, V1, 0).await.expect("set");
    // The operator sees v1 in force; someone writes v2; the operator's rollback to v1, made
    // over the v1 they saw, would silently replace v2.
    let v2 = store.set(RuleKind::Governance, V2, v1).await.expect("set");
    // An `expected` without its value guards nothing: refused, not taken as no guard.
    for query in ["expected", "expected=", "expected=-1"] {
        let path = format!("/api/rules/governance/rollback/{v1}?{query}");
        let message = api.refused(Http::BAD_REQUEST, "POST", &path, None).await;
        assert!(message.contains("expected"), "{query}: {message}");
        // What to send, for a rollback (not a write's wording).
        assert!(!message.contains("PUT"), "{query}: {message}");
    }
    assert_eq!(
        in_store(&store, RuleKind::Governance).await,
        (v2, V2.into()),
        "after rollbacks with a malformed expected version"
    );
    let path = format!("/api/rules/governance/rollback/{v1}?expected={v1}");
    let (status, e) = api.send("POST", &path, None).await;
    assert_eq!(status, Http::CONFLICT, "{e}");
    assert_eq!(
        (e["expected"].clone(), e["found"].clone()),
        (json!(v1), json!(v2))
    );
    assert_eq!(
        in_store(&store, RuleKind::Governance).await,
        (v2, V2.into()),
        "after a stale rollback"
    );
    // Over the version in force: v1's text comes back as a new version.
    let path = format!("/api/rules/governance/rollback/{v1}?expected={v2}");
    let now = api.ok("POST", &path, None).await["version"]
        .as_i64()
        .expect("version");
    assert!(now > v2);
    assert_eq!(
        in_store(&store, RuleKind::Governance).await,
        (now, V1.into())
    );
}

/// A document over what etcd takes in one request is refused with 413 naming the limit (the
/// text goes twice: in force and in the history), not as etcd being unavailable (503, which
/// says to try again), and nothing is written.
#[tokio::test]
async fn a_document_over_the_stores_limit_is_refused_with_413_and_nothing_is_written() {
    let (_etcd, store, _admin, api) = started().await;
    let v1 = store.set(RuleKind::Governance, V1, 0).await.expect("set");
    let before = history_of(&store, RuleKind::Governance).await;
    // Valid TOML, under the endpoint's 2 MiB body limit, over half etcd's default 1.5 MiB.
    let large = format!("{V2}# {}\n", "x".repeat(1024 * 1024));
    let path = format!("/api/rules/governance?expected={v1}");
    let message = api
        .refused(Http::PAYLOAD_TOO_LARGE, "PUT", &path, Some(&large))
        .await;
    assert!(
        message.contains(&large.len().to_string()) && message.contains("nothing was written"),
        "{message}"
    );
    assert_still_v1(&store, v1, "a document over the limit").await;
    assert_eq!(history_of(&store, RuleKind::Governance).await, before);
    // Just under the limit the message names, it is written.
    let limit: usize = message
        .split(" bytes the store takes")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the limit in the message");
    let fits = format!("{V2}# {}\n", "x".repeat(limit - V2.len() - 3));
    assert_eq!(fits.len(), limit);
    written(&api, &store, RuleKind::Governance, &path, &fits).await;
}

/// A history version whose bytes are not UTF-8 (written past the store's checks) is shown as
/// such, and a rollback to it is refused: its text, with U+FFFD where the bytes were, is not
/// the document stored.
#[tokio::test]
async fn a_history_version_that_is_not_utf8_is_marked_and_not_rolled_back_to() {
    let (etcd, store, _admin, api) = started().await;
    let v1 = store.set(RuleKind::Governance, V1, 0).await.expect("set");
    let mut bytes = V2.as_bytes().to_vec();
    bytes.extend_from_slice(b"# \xff\n");
    let mut raw = etcd.client().await;
    let put = raw
        .put(
            format!("/rpc/rules/history/governance/{:020}", v1 + 1),
            bytes,
            None,
        )
        .await
        .expect("put");
    let bad = put.header().expect("header").revision();
    let history = api.ok("GET", "/api/rules/governance/history", None).await;
    let listed = history["versions"]
        .as_array()
        .and_then(|all| all.iter().find(|v| v["version"] == bad))
        .unwrap_or_else(|| panic!("version {bad} listed: {history}"));
    assert!(
        listed["unreadable"]
            .as_str()
            .is_some_and(|why| why.contains("not UTF-8")),
        "{listed}"
    );
    let path = format!("/api/rules/governance/rollback/{bad}?expected={v1}");
    let message = api.refused(Http::BAD_REQUEST, "POST", &path, None).await;
    assert!(message.contains("not UTF-8"), "{message}");
    assert_still_v1(&store, v1, "a rollback to an unreadable version").await;
}

#[tokio::test]
async fn unknown_kinds_versions_and_methods_get_json_errors_naming_what_exists() {
    let (_etcd, store, _admin, api) = started().await;
    let v1 = store.set(RuleKind::Governance, V1, 0).await.expect("set");

    for (method, path) in [
        ("GET", "/api/rules/routes"),
        ("PUT", "/api/rules/routes?expected=0"),
        ("POST", "/api/rules/routes/validate"),
        ("GET", "/api/rules/routes/history"),
        ("POST", "/api/rules/routes/rollback/1"),
    ] {
        let message = api.refused(Http::NOT_FOUND, method, path, Some(V1)).await;
        assert!(
            message.contains("\"routes\"")
                && message.contains("governance")
                && message.contains("routing"),
            "{method} {path}: {message}"
        );
    }

    // A version the history does not hold: 404 listing the ones it does.
    let path = format!("/api/rules/governance/rollback/{}", v1 + 100);
    let message = api.refused(Http::NOT_FOUND, "POST", &path, None).await;
    assert!(message.contains(&format!("[{v1}]")), "{message}");
    let path = "/api/rules/governance/rollback/first";
    let message = api.refused(Http::BAD_REQUEST, "POST", path, None).await;
    assert!(message.contains("history"), "{message}");
    assert_still_v1(&store, v1, "rollbacks to versions not held").await;

    // A method a route does not have: a JSON 405.
    let path = "/api/rules/governance";
    let message = api
        .refused(Http::METHOD_NOT_ALLOWED, "DELETE", path, None)
        .await;
    assert!(message.contains("DELETE"), "{message}");
    assert_still_v1(&store, v1, "a DELETE").await;
}

#[tokio::test]
async fn without_a_store_the_routes_say_how_to_attach_one_and_validation_still_works() {
    let admin = Admin::builder()
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    let api = Http1::new(&admin);
    let all = api.ok("GET", "/api/rules", None).await;
    assert_eq!(all["store"], false, "{all}");
    assert!(
        all["kinds"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k["version"].is_null()),
        "{all}"
    );
    // Whatever else is wrong with the request (no expected version, a malformed one, a
    // version that is no number): without a store, the answer says how to attach one.
    for (method, path) in [
        ("GET", "/api/rules/governance"),
        ("PUT", "/api/rules/governance?expected=0"),
        ("PUT", "/api/rules/governance"),
        ("GET", "/api/rules/governance/history"),
        ("POST", "/api/rules/governance/rollback/1"),
        ("POST", "/api/rules/governance/rollback/1?expected"),
        ("POST", "/api/rules/governance/rollback/first"),
    ] {
        let message = api.refused(Http::NOT_FOUND, method, path, Some(V1)).await;
        assert!(
            message.contains("--registry etcd://"),
            "{method} {path}: {message}"
        );
    }
    let v = api
        .ok("POST", "/api/rules/governance/validate", Some(V1))
        .await;
    assert_eq!(v, json!({ "valid": true }));
}

/// Waits (at most 10 s) for the `rule_applied` event of `version`.
async fn applied(events: &mut broadcast::Receiver<GovernanceEvent>, version: i64) {
    within("the rule_applied event", async {
        loop {
            let e = events.recv().await.expect("events");
            if e.kind == EventKind::RuleApplied && e.rule_version == Some(version) {
                return;
            }
        }
    })
    .await
}

#[tokio::test]
async fn a_client_and_a_server_following_the_store_apply_a_document_written_through_the_endpoint() {
    let etcd = Etcd::start().await;
    let store = store(&etcd).await;
    let registry = InProcessRegistry::new();
    let server = Server::builder()
        .registry(registry.clone())
        .rules(store.clone())
        .add_service(RuledServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(registry)
        .rules(store.clone())
        .build();
    let mut client_events = client.events().subscribe();
    let mut server_events = server.events().subscribe();
    let admin = Admin::builder()
        .client(&client)
        .server(&server)
        .rules(store.clone())
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    let api = Http1::new(&admin);

    let all = api.ok("GET", "/api/rules", None).await;
    assert_eq!(
        all["kinds"][0]["applied"],
        json!({ "client": null, "server": null }),
        "nothing applied yet: {all}"
    );

    let v = api
        .ok("PUT", "/api/rules/governance?expected=0", Some(V2))
        .await["version"]
        .as_i64()
        .expect("version");
    applied(&mut client_events, v).await;
    applied(&mut server_events, v).await;
    // The processes' own word (the oracle), then the endpoint's.
    assert_eq!(client.rules_version(RuleKind::Governance), Some(v));
    assert_eq!(server.rules_version(RuleKind::Governance), Some(v));
    assert!(client.options(&RuledClient::methods()[0]).breaker_observe);
    let all = api.ok("GET", "/api/rules", None).await;
    assert_eq!(all["kinds"][0]["version"], v, "{all}");
    assert_eq!(
        all["kinds"][0]["applied"],
        json!({ "client": v, "server": v }),
        "{all}"
    );
    let doc = api.ok("GET", "/api/rules/governance", None).await;
    assert_eq!(doc["applied"], json!({ "client": v, "server": v }), "{doc}");
    // The call still works under the rules.
    let echo = RuledClient::new(client.clone());
    assert_eq!(within("call", echo.echo("hi".into())).await.unwrap(), "hi");
}

/// A document that parses but that the attached client would refuse (consistent hashing for a
/// method it has called, which has no `#[hash_key]`) is refused with 400 and nothing is
/// written, by a write and by a rollback to it alike: a store would take it, and the client
/// would keep its last version with only a `rule_rejected` event to say so.
#[tokio::test]
async fn a_document_the_attached_client_would_refuse_is_not_written() {
    const HASH: &str = "[defaults]\nshunt_strategy = \"hash\"\n";
    let etcd = Etcd::start().await;
    let store = store(&etcd).await;
    let registry = InProcessRegistry::new();
    let _server = Server::builder()
        .registry(registry.clone())
        .add_service(RuledServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder()
        .registry(registry.clone())
        .rules(store.clone())
        .build();
    let echo = RuledClient::new(client.clone());
    assert_eq!(within("call", echo.echo("hi".into())).await.unwrap(), "hi");
    let admin = admin_with(Admin::builder().client(&client), &store).await;
    let api = Http1::new(&admin);
    // The oracle: the rule kind's own check takes the document, the client's does not.
    RuleKind::Governance.validate(HASH).expect("valid alone");
    let why = client
        .check_rules(RuleKind::Governance, HASH)
        .expect_err("the client refuses it")
        .message()
        .to_string();
    assert!(why.contains("adm.Ruled.echo"), "{why}");

    let v = api
        .ok("POST", "/api/rules/governance/validate", Some(HASH))
        .await;
    assert_eq!(v["valid"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains(&why), "{v}");
    let message = api
        .refused(
            Http::BAD_REQUEST,
            "PUT",
            "/api/rules/governance?expected=0",
            Some(HASH),
        )
        .await;
    assert!(
        message.contains(&why) && message.contains("nothing was written"),
        "{message}"
    );
    assert_eq!(in_store(&store, RuleKind::Governance).await, (0, "".into()));

    // The same text in the history (written past the endpoint), then a good version over it:
    // rolling back to it is refused the same way.
    let bad = store.set(RuleKind::Governance, HASH, 0).await.expect("set");
    let good = written(
        &api,
        &store,
        RuleKind::Governance,
        &format!("/api/rules/governance?expected={bad}"),
        V1,
    )
    .await;
    let message = api
        .refused(
            Http::BAD_REQUEST,
            "POST",
            &format!("/api/rules/governance/rollback/{bad}"),
            None,
        )
        .await;
    assert!(message.contains(&why), "{message}");
    assert_still_v1(&store, good, "a rollback the client would refuse").await;

    // A client that follows no rules applies none, and refuses none: attached, it blocks no
    // edit made for the processes that do follow them.
    let loose = Client::builder().registry(registry).build();
    let echo = RuledClient::new(loose.clone());
    assert_eq!(within("call", echo.echo("hi".into())).await.unwrap(), "hi");
    loose
        .check_rules(RuleKind::Governance, HASH)
        .expect("no rules followed, none refused");
    let admin = admin_with(Admin::builder().client(&loose), &store).await;
    let v = Http1::new(&admin)
        .ok("POST", "/api/rules/governance/validate", Some(HASH))
        .await;
    assert_eq!(v, json!({ "valid": true }));
}

#[tokio::test]
async fn every_rules_route_refuses_a_missing_or_wrong_token_and_writes_nothing() {
    let (_etcd, store, _admin, api) = started().await;
    let v1 = store.set(RuleKind::Governance, V1, 0).await.expect("set");
    let routes = [
        ("GET", "/api/rules".to_string()),
        ("GET", "/api/rules/governance".to_string()),
        ("POST", "/api/rules/governance/validate".to_string()),
        ("PUT", format!("/api/rules/governance?expected={v1}")),
        ("GET", "/api/rules/governance/history".to_string()),
        ("POST", format!("/api/rules/governance/rollback/{v1}")),
    ];
    for (method, path) in &routes {
        for (token, why) in [(None, "missing token"), (Some("wrong"), "wrong token")] {
            let message = api
                .refused_as(token, Http::UNAUTHORIZED, method, path, Some(V2))
                .await;
            assert!(
                message.contains(why) && message.contains("Authorization: Bearer"),
                "{method} {path}: {message}"
            );
        }
    }
    assert_still_v1(&store, v1, "requests without the token").await;
    assert_eq!(store.history(RuleKind::Governance).await.unwrap().len(), 1);
}

#[tokio::test]
async fn the_console_page_carries_the_rules_editor_with_its_stable_ids() {
    let admin = Admin::builder()
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    let r = reqwest::Client::new()
        .get(format!("http://{}/", admin.local_addr()))
        .send()
        .await
        .expect("GET /");
    assert_eq!(r.status(), Http::OK);
    let page = r.text().await.expect("page");
    for id in [
        "rules",
        "rules-kind",
        "rules-text",
        "rules-validate",
        "rules-save",
        "rules-message",
        "rules-history",
    ] {
        assert!(page.contains(&format!("id=\"{id}\"")), "#{id}");
    }
    // The routes it reads and writes, and the policies its observe controls edit.
    for used in [
        "\"/api/rules\"",
        "/validate\"",
        "/history\"",
        "/rollback/\"",
        "?expected=\"",
    ] {
        assert!(page.contains(used), "{used}");
    }
    for policy in ["breaker", "throttle", "outlier", "rate_limit", "admission"] {
        assert!(page.contains(&format!("\"{policy}\"")), "{policy}");
        // Each is a field the governance document takes in [defaults].
        let doc = format!("[defaults]\n{policy}_observe = true\n");
        assert!(RuleKind::Governance.validate(&doc).is_ok(), "{doc}");
    }
}
