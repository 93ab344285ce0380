//! The web console in a real headless chromium, driven through chromedriver (WebDriver), against a
//! real server, client and admin endpoint over TCP: the page takes the token from its fragment
//! and shows the running service, its isolate button isolates the breaker (as the JSON API and
//! the client's next call confirm), a wrong token shows the refusal and no data, and (with
//! feature `etcd`, against a real etcd) choosing "enforce" for a policy in the rules editor
//! enforces it in the client even where a lower level of configuration observes it.
//!
//! The page is what an operator uses, so it is tested the way an operator uses it: in a browser,
//! clicking. Every wait is a bounded poll on a WebDriver condition (an element, or a script's
//! answer), never a fixed delay. Expected values come from what the test set up (the server's
//! address, its metadata, the entry it called) and from the JSON API read with a plain HTTP
//! client, never from the page alone.
//!
//! Needs `chromium` and `chromedriver` on the PATH; scripts/test.sh installs Debian's `chromium`
//! and `chromium-driver` when they are missing.

#[path = "../../tests/tests/common/chromedriver.rs"]
mod chromedriver;
#[cfg(feature = "etcd")]
#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;

use std::time::Duration;

use chromedriver::{shows, Chromedriver, POLL, WAIT};
use fantoccini::{Client as Browser, Locator};
use rpc::{Client, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode};
use rpc_admin::{Admin, AdminHandle};
use serde_json::{json, Value};

#[rpc::service(name = "con.Echo")]
trait Echo {
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

struct Plain;

impl Echo for Plain {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
}

/// A token as operators make them: with a `+` and a `&` (read as a space and as the end of it
/// were the page's fragment read as form data).
const TOKEN: &str = "console+t0ken&x";
const SERVICE: &str = "con.Echo";
const ENTRY: &str = "con.Echo.echo";

struct Setup {
    server: ServerHandle,
    client: Client,
    echo: EchoClient,
    admin: AdminHandle,
    http: reqwest::Client,
}

impl Setup {
    /// The console's address with `token` in its fragment.
    fn console(&self, token: &str) -> String {
        format!("http://{}/#token={token}", self.admin.local_addr())
    }

    /// The JSON API, read with a plain HTTP client and the right token: the oracle.
    async fn api(&self, path: &str) -> Value {
        let r = self
            .http
            .get(format!("http://{}{path}", self.admin.local_addr()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("GET");
        assert_eq!(r.status(), reqwest::StatusCode::OK, "{path}");
        let body = r.text().await.expect("body");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
    }
}

/// The echo service served by `builder` on a free port.
async fn serve_echo(builder: rpc::ServerBuilder) -> ServerHandle {
    builder
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

/// A server and a client on one registry, one call made (so the client knows the service and
/// the entry's breaker exists), and the admin endpoint of both behind [`TOKEN`].
async fn setup() -> Setup {
    let registry = InProcessRegistry::new();
    let server = serve_echo(
        Server::builder()
            .registry(registry.clone())
            .metadata("version", "canary"),
    )
    .await;
    let client = Client::builder().registry(registry).build();
    let admin = Admin::builder()
        .client(&client)
        .server(&server)
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    let echo = EchoClient::new(client.clone());
    assert_eq!(echo.echo("a".into()).await.expect("first call"), "a");
    Setup {
        server,
        client,
        echo,
        admin,
        http: reqwest::Client::new(),
    }
}

/// Waits, at most [`WAIT`], until `script` (a function body) returns true in the page.
async fn until_script(browser: &Browser, what: &str, script: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let answer = browser.execute(script, vec![]).await.expect("script");
        if answer == Value::Bool(true) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the page never got to {what} within {WAIT:?} (last answer: {answer})"
        );
        tokio::time::sleep(POLL).await;
    }
}

async fn rows(browser: &Browser, table: &str) -> usize {
    browser
        .find_all(Locator::Css(&format!("#{table} tbody tr")))
        .await
        .expect("find rows")
        .len()
}

#[tokio::test]
async fn the_page_takes_the_token_from_its_fragment_and_shows_the_running_service() {
    let s = setup().await;
    let driver = Chromedriver::start().await;
    let address = s.server.local_addr().to_string();
    driver
        .with_browser(|browser| async move {
            browser.goto(&s.console(TOKEN)).await.expect("goto");
            // The service's row names the server's address and the metadata it registered with.
            let row = format!(
                "//table[@id='services']//tr[@data-service='{SERVICE}']\
                 [td[normalize-space(.)='{address}']][td[contains(., 'version=canary')]]"
            );
            shows(
                &browser,
                "the service's row with its address and metadata",
                Locator::XPath(&row),
            )
            .await;
            let status = shows(
                &browser,
                "the live status line",
                Locator::XPath("//*[@id='status'][starts-with(normalize-space(.), 'live')]"),
            )
            .await;
            assert!(status.text().await.unwrap().starts_with("live"));
            // The entry the client calls has its charts (the live figures cover the last few
            // seconds: a call now is in them), and its breaker is listed closed.
            assert_eq!(s.echo.echo("b".into()).await.expect("call"), "b");
            shows(
                &browser,
                "the entry's charts",
                Locator::Css(&format!(
                    "#stats .entry-stats[data-entry='{ENTRY}'][data-side='client'] svg polyline"
                )),
            )
            .await;
            shows(
                &browser,
                "the entry's closed breaker",
                Locator::Css(&format!(
                    "#breakers tr[data-entry='{ENTRY}'] td.state.closed"
                )),
            )
            .await;
            // The token leaves the address bar (a screenshot or a shared link does not carry it).
            let url = browser.current_url().await.expect("url");
            assert_eq!(url.fragment(), None, "{url}");
            assert!(!url.as_str().contains(TOKEN), "{url}");
        })
        .await;
}

#[tokio::test]
async fn clicking_isolate_isolates_the_breaker_as_the_api_and_the_clients_next_call_show() {
    let s = setup().await;
    let driver = Chromedriver::start().await;
    driver
        .with_browser(|browser| async move {
            browser.goto(&s.console(TOKEN)).await.expect("goto");
            let closed = format!("#breakers tr[data-entry='{ENTRY}'] td.state.closed");
            shows(&browser, "the entry's closed breaker", Locator::Css(&closed)).await;
            let before = s.api("/api/breakers").await;
            assert_eq!(
                (&before["breakers"][0]["entry"], &before["breakers"][0]["state"]),
                (&json!(ENTRY), &json!("closed")),
                "before the click: {before}"
            );
            // The page redraws its tables every second: a button found just before a redraw
            // is gone by the click, so find it again (a bounded number of times).
            let button = format!("#breakers tr[data-entry='{ENTRY}'] button.isolate");
            let mut attempts = 0;
            loop {
                attempts += 1;
                let b = shows(&browser, "the isolate button", Locator::Css(&button)).await;
                match b.click().await {
                    Ok(()) => break,
                    Err(e) if e.is_stale_element_reference() && attempts < 10 => continue,
                    Err(e) => panic!("clicking isolate (attempt {attempts}): {e}"),
                }
            }
            shows(
                &browser,
                "the breaker isolated",
                Locator::Css(&format!(
                    "#breakers tr[data-entry='{ENTRY}'] td.state.isolated"
                )),
            )
            .await;
            // The API and the client agree with the page.
            assert_eq!(
                s.api("/api/breakers").await["breakers"],
                json!([{"entry": ENTRY, "state": "isolated"}])
            );
            let state = s
                .client
                .breakers()
                .into_iter()
                .find(|(id, _)| id.as_str() == ENTRY)
                .map(|(_, state)| state);
            assert!(
                matches!(state, Some(rpc::BreakerState::Open { retry_after }) if retry_after == Duration::MAX),
                "{state:?}"
            );
            let e = s.echo.echo("b".into()).await.unwrap_err();
            assert_eq!(e.code(), StatusCode::CircuitOpen, "{e}");
            assert_eq!(e.code().as_u32(), 522, "{e}");
        })
        .await;
}

#[tokio::test]
async fn a_wrong_token_shows_the_refusal_and_no_data() {
    let s = setup().await;
    // There is data to show: the right token reads the service and its breaker.
    let services = s.api("/api/services").await;
    assert!(services.to_string().contains(SERVICE), "{services}");
    assert_eq!(
        s.api("/api/breakers").await["breakers"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    let driver = Chromedriver::start().await;
    driver
        .with_browser(|browser| async move {
            browser
                .goto(&s.console("not-the-token"))
                .await
                .expect("goto");
            let status = shows(
                &browser,
                "the refusal in its status line",
                Locator::XPath("//*[@id='status'][starts-with(normalize-space(.), '401')]"),
            )
            .await;
            let text = status.text().await.unwrap();
            assert!(
                text.contains("wrong token") && text.contains("Authorization: Bearer"),
                "the status line says what went wrong and what to send: {text:?}"
            );
            assert!(text.contains("polling stopped"), "{text:?}");
            // The page stops polling at the refusal (rather than sending the refused token
            // every second): it has asked once, and asks no more.
            until_script(&browser, "polling to stop", "return polling === false;").await;
            let asked: i64 = browser
                .execute(
                    "return performance.getEntriesByType('resource')\
                       .filter((e) => e.name.endsWith('/api/services')).length;",
                    vec![],
                )
                .await
                .expect("script")
                .as_i64()
                .expect("a count");
            assert_eq!(asked, 1);
            for table in ["services", "breakers", "endpoints"] {
                assert_eq!(rows(&browser, table).await, 0, "#{table} has rows");
            }
            let events = browser.find(Locator::Id("events")).await.unwrap();
            assert_eq!(events.text().await.unwrap(), "");
            let stats = browser.find(Locator::Id("stats")).await.unwrap();
            assert_eq!(stats.text().await.unwrap(), "no calls yet");
            assert_eq!(
                browser
                    .find(Locator::Id("server-line"))
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap(),
                ""
            );
        })
        .await;
}

/// The console's observe/enforce control for the breaker, over a client whose config file
/// observes the breaker and which follows the etcd rule store: choosing "enforce" and saving
/// must leave the client enforcing it. The config file sits below the rule store, so the
/// document has to say `breaker_observe = false`; without the line the file's `true` would
/// stand while the page said "enforce".
#[cfg(feature = "etcd")]
#[tokio::test]
async fn choosing_enforce_in_the_rules_editor_enforces_a_policy_a_lower_level_observes() {
    use rpc_governance::config::GovernanceConfig;
    use rpc_registry::RuleKind;

    let etcd = etcd_harness::Etcd::start().await;
    let store = rule_store(&etcd).await;
    let first = "[defaults]\ntimeout_ms = 1000\nbreaker_observe = true\n";
    let v1 = store
        .set(RuleKind::Governance, first, 0)
        .await
        .expect("set");

    let registry = InProcessRegistry::new();
    let server = serve_echo(Server::builder().registry(registry.clone())).await;
    let file = GovernanceConfig::from_toml("[defaults]\nbreaker_observe = true\n").unwrap();
    let client = Client::builder()
        .registry(registry)
        .config_layers(file, GovernanceConfig::default())
        .rules(store.clone())
        .build();
    let admin = Admin::builder()
        .client(&client)
        .rules(store.clone())
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    let echo = EchoClient::new(client.clone());
    assert_eq!(echo.echo("a".into()).await.expect("call"), "a");
    // The client observes the breaker before: the document and the file both say so.
    let breaker_observe = |client: &Client| {
        let entries = client.entry_options();
        let e = entries
            .iter()
            .find(|e| e.entry.as_str() == ENTRY)
            .expect("the entry's options");
        e.options.breaker_observe
    };
    until(|| client.rules_version(RuleKind::Governance) == Some(v1)).await;
    assert!(breaker_observe(&client));

    in_console(&admin, |browser| async move {
        // The editor has the document, and the control reads it as observing.
        until_script(
            &browser,
            "the document in the editor, the breaker observed",
            "return document.getElementById('rules-text').value.includes('timeout_ms = 1000') \
                   && document.getElementById('rules-observe-breaker').value === 'observe';",
        )
        .await;
        // A document that does not set the flag says neither observe nor enforce, and
        // "not set" takes the line out.
        let read = browser
            .execute(
                "return [observed('[defaults]\\ntimeout_ms = 1\\n', 'breaker'), \
                       observed('[defaults]\\nbreaker_observe = false\\n', 'breaker'), \
                       setObserved('[defaults]\\nbreaker_observe = true\\nx = 1\\n', \
                                   'breaker', 'unset')];",
                vec![],
            )
            .await
            .expect("the control's reading");
        assert_eq!(
            read,
            serde_json::json!(["unset", "enforce", "[defaults]\nx = 1\n"])
        );
        let select = shows(
            &browser,
            "the breaker's control",
            Locator::Id("rules-observe-breaker"),
        )
        .await;
        select
            .select_by_value("enforce")
            .await
            .expect("choose enforce");
        browser
            .find(Locator::Id("rules-save"))
            .await
            .expect("save button")
            .click()
            .await
            .expect("click save");
        shows(
            &browser,
            "the saved message",
            Locator::XPath("//*[@id='rules-message'][starts-with(., 'saved as version')]"),
        )
        .await;
    })
    .await;
    let now = store
        .get(RuleKind::Governance)
        .await
        .expect("get")
        .expect("a document");
    assert!(now.version > v1, "saved as a new version");
    until(|| client.rules_version(RuleKind::Governance) == Some(now.version)).await;
    assert!(
        !breaker_observe(&client),
        "the page said enforce, the client still observes; the document saved: {:?}",
        now.text
    );
    assert!(now.text.contains("timeout_ms = 1000"), "{:?}", now.text);
    drop(server);
}

/// A document stored with CRLF line endings (a file written so, stored byte for byte by
/// `rpcctl rules set`) loads as unedited, and a newer version written over it is loaded by the
/// page's poll. (Before, a browser's editor, which holds its text with LF line endings, differed
/// from the stored text at once: the page said "edited" and loaded no newer version by itself.)
#[cfg(feature = "etcd")]
#[tokio::test]
async fn a_crlf_document_loads_unedited_and_a_newer_version_loads_by_itself() {
    use rpc_registry::RuleKind;

    let etcd = etcd_harness::Etcd::start().await;
    let store = rule_store(&etcd).await;
    let v1 = store
        .set(
            RuleKind::Governance,
            "[defaults]\r\ntimeout_ms = 100\r\n",
            0,
        )
        .await
        .expect("set");
    let admin = Admin::builder()
        .rules(store.clone())
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    in_console(&admin, |browser| async move {
        until_script(
            &browser,
            "the CRLF document loaded, not edited",
            &format!(
                "const s = document.getElementById('rules-version').textContent; \
                     return s.includes('editing version {v1}') && !s.includes('edited');"
            ),
        )
        .await;
        store
            .set(RuleKind::Governance, "[defaults]\ntimeout_ms = 200\n", v1)
            .await
            .expect("a newer version");
        until_script(
            &browser,
            "the newer version loaded by the poll",
            "return document.getElementById('rules-text').value.includes('timeout_ms = 200');",
        )
        .await;
    })
    .await;
}

/// Runs `check` in the console of `admin` (with the test's token), opened in a new browser
/// session of a new chromedriver.
#[cfg(feature = "etcd")]
async fn in_console<F, Fut>(admin: &AdminHandle, check: F)
where
    F: FnOnce(Browser) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let driver = Chromedriver::start().await;
    let page = format!("http://{}/#token={TOKEN}", admin.local_addr());
    driver
        .with_browser(|browser| async move {
            browser.goto(&page).await.expect("goto");
            check(browser).await;
        })
        .await;
}

/// The rule store of the etcd `etcd` runs.
#[cfg(feature = "etcd")]
async fn rule_store(etcd: &etcd_harness::Etcd) -> rpc_registry::RuleStore {
    use rpc_registry::{EtcdOptions, EtcdRegistry};
    EtcdRegistry::connect(
        &[etcd.endpoint()],
        EtcdOptions {
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            ..EtcdOptions::default()
        },
    )
    .await
    .expect("etcd registry")
    .rules()
}

/// Waits, at most [`WAIT`], until `done` holds.
#[cfg(feature = "etcd")]
async fn until(done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done within {WAIT:?}"
        );
        tokio::time::sleep(POLL).await;
    }
}
