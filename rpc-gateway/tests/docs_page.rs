//! The documentation page in a real headless chromium, driven through chromedriver (WebDriver).
//!
//! The page is what a developer reads to call the services, so it is tested the way they use it:
//! in a browser. Two setups:
//! - a small axum router serving [`rpc_gateway::docs::page`] and a hand-built document (a
//!   declared `GET /orders/{id}` with a query parameter, a typed error), with a handler at that
//!   route answering what it received: the page lists the operation under its service, and its
//!   "try it" form puts the path and query parameters where the route takes them;
//! - a real gateway over a real echo server (in-process registry, real TCP): `/docs` lists the
//!   echo entry and "try it" calls it through the gateway and shows `200` and the echoed text.
//!
//! Every wait is a bounded poll on a WebDriver condition, never a fixed delay. Expected values
//! come from what the test set up. Needs `chromium` and `chromedriver` on the PATH
//! (scripts/test.sh installs Debian's `chromium` and `chromium-driver` when they are missing).

use std::os::unix::fs::PermissionsExt;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, RawQuery};
use axum::routing::get;
use axum::Json;
use fantoccini::elements::Element;
use fantoccini::wd::Capabilities;
use fantoccini::{Client as Browser, ClientBuilder, Locator};
use futures_util::FutureExt;
use hyper_util::client::legacy::connect::HttpConnector;
use rpc_core::{EntryApi, EntrySchemas, HttpRoute, ServiceEntry};
use rpc_gateway::openapi::{document, DocumentInfo};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The longest any one wait may take: far above what it takes on a loaded two-core machine, so
/// a failure means the page never got there.
const WAIT: Duration = Duration::from_secs(30);
/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(50);

const MISSING: &str = "the docs page test drives a real headless chromium through chromedriver: \
    install Debian's `chromium` and `chromium-driver` (scripts/test.sh does when they are missing)";

/// The executable `name` on the PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The chromium chromedriver starts: the one on the PATH, else Debian's.
fn chromium() -> PathBuf {
    on_path("chromium")
        .or_else(|| Some(PathBuf::from("/usr/bin/chromium")).filter(|p| p.is_file()))
        .unwrap_or_else(|| panic!("no chromium on the PATH nor at /usr/bin/chromium: {MISSING}"))
}

/// A chromedriver child on a free loopback port, killed with its process group (the browsers)
/// when dropped.
struct Chromedriver {
    child: Child,
    port: u16,
    output: Arc<Mutex<Vec<String>>>,
}

impl Chromedriver {
    /// Starts chromedriver with `--port=0` (it prints the port it took) and waits, at most
    /// [`WAIT`], until it says it listens.
    async fn start() -> Self {
        let program = on_path("chromedriver")
            .unwrap_or_else(|| panic!("no chromedriver on the PATH: {MISSING}"));
        let mut child = Command::new(&program)
            .arg("--port=0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}; {MISSING}", program.display()));
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let output = Arc::new(Mutex::new(Vec::new()));
        let started = tokio::time::timeout(WAIT, async {
            while let Ok(Some(line)) = lines.next_line().await {
                let port = listening_port(&line);
                output.lock().unwrap().push(line);
                if port.is_some() {
                    return port;
                }
            }
            None
        })
        .await;
        let Ok(Some(port)) = started else {
            panic!(
                "chromedriver never said it listens within {WAIT:?}; it printed: {:?}",
                output.lock().unwrap()
            );
        };
        let sink = output.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        Chromedriver {
            child,
            port,
            output,
        }
    }

    /// Runs `check` in a new headless browser session and ends the session whether or not
    /// `check` panicked; a panic is then passed on.
    async fn with_browser<F, Fut>(&self, check: F)
    where
        F: FnOnce(Browser) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let mut caps = Capabilities::new();
        caps.insert("browserName".into(), json!("chrome"));
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium(),
                "args": ["--headless", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1400,1100"],
            }),
        );
        let browser = ClientBuilder::new(HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "chromedriver could not start {}: {e}; it printed: {:?}",
                    chromium().display(),
                    self.output.lock().unwrap()
                )
            });
        let outcome = AssertUnwindSafe(check(browser.clone()))
            .catch_unwind()
            .await;
        let closed = browser.close().await;
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
        closed.expect("ending the browser session");
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) with a negative pid signals the process group chromedriver leads
            // (started with `process_group(0)`); it touches no memory of this process.
            unsafe {
                libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
            }
        }
        let _ = self.child.start_kill();
    }
}

/// The port in chromedriver's `ChromeDriver was started successfully on port N.` line.
fn listening_port(line: &str) -> Option<u16> {
    let (_, rest) = line.split_once("started successfully on port ")?;
    rest.trim_end().trim_end_matches('.').parse().ok()
}

/// Waits, at most [`WAIT`], until the page has an element `locator` finds.
async fn shows(browser: &Browser, what: &str, locator: Locator<'_>) -> Element {
    match browser
        .wait()
        .at_most(WAIT)
        .every(POLL)
        .for_element(locator)
        .await
    {
        Ok(element) => element,
        Err(e) => {
            let status = match browser.find(Locator::Id("status")).await {
                Ok(s) => s.text().await.unwrap_or_default(),
                Err(e) => format!("(no status line: {e})"),
            };
            panic!("the page never showed {what} within {WAIT:?}: {e}; its status line: {status:?}")
        }
    }
}

/// Opens the operation `id`, fills its form (`inputs`: parameter name → value; `body`: the
/// body's text, when given), sends it and waits for the answer's status line; returns the
/// status line and the answer's body as the page shows them.
async fn try_it(
    browser: &Browser,
    id: &str,
    inputs: &[(&str, &str)],
    body: Option<&str>,
) -> (String, String) {
    let op = shows(
        browser,
        &format!("the operation {id}"),
        Locator::Css(&format!("details.op[id='op-{id}']")),
    )
    .await;
    op.find(Locator::Css("summary"))
        .await
        .expect("summary")
        .click()
        .await
        .expect("open the operation");
    for (name, value) in inputs {
        let input = op
            .find(Locator::Css(&format!("form.try input[name='{name}']")))
            .await
            .unwrap_or_else(|e| panic!("no input for {name}: {e}"));
        input.send_keys(value).await.expect("type");
    }
    if let Some(body) = body {
        let area = op
            .find(Locator::Css("form.try textarea"))
            .await
            .expect("the body's text area");
        area.clear().await.expect("clear the body");
        area.send_keys(body).await.expect("type the body");
    }
    op.find(Locator::Css("form.try button[type='submit']"))
        .await
        .expect("the send button")
        .click()
        .await
        .expect("send");
    let status = shows(
        browser,
        "the answer's status",
        Locator::Css(&format!("details.op[id='op-{id}'] .answer .status")),
    )
    .await;
    let body = op
        .find(Locator::Css(".answer pre.body"))
        .await
        .expect("the answer's body");
    (
        status.text().await.expect("status text"),
        body.text().await.expect("body text"),
    )
}

fn orders_entry() -> ServiceEntry {
    ServiceEntry {
        id: "shop.Orders.get".into(),
        service_id: "shop.Orders".into(),
        method: "get".into(),
        hash_key: None,
        governance: Default::default(),
        api: Some(EntryApi {
            params: vec!["id".into(), "verbose".into()],
            doc: Some("One order by id.".into()),
            http: Some(HttpRoute {
                method: "GET".into(),
                path: "/orders/{id}".into(),
            }),
            stream: None,
            schemas: Some(EntrySchemas {
                params: vec![json!({"type": "integer"}), json!({"type": "boolean"})],
                result: json!({"$ref": "#/components/schemas/Order"}),
                error: Some(json!({"type": "string", "enum": ["Missing"]})),
                definitions: [(
                    "Order".to_string(),
                    json!({"type": "object", "properties": {"id": {"type": "integer"}}}),
                )]
                .into_iter()
                .collect(),
            }),
        }),
    }
}

#[tokio::test]
async fn the_page_lists_a_declared_route_and_its_form_fills_path_and_query() {
    let doc = document(&[orders_entry()], &DocumentInfo::new("shop", "1.2.3"));
    let app = axum::Router::new()
        .route(
            "/docs",
            get(|| async { axum::response::Html(rpc_gateway::docs::page()) }),
        )
        .route("/openapi.json", get(move || async move { Json(doc) }))
        .route(
            "/orders/{id}",
            get(
                |Path(id): Path<String>, RawQuery(query): RawQuery| async move {
                    Json(json!({"id": id, "query": query}))
                },
            ),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });

    let driver = Chromedriver::start().await;
    driver
        .with_browser(|browser| async move {
            browser
                .goto(&format!("http://{addr}/docs"))
                .await
                .expect("goto");
            // Listed under its service, with its method, path and summary.
            let summary = shows(
                &browser,
                "the operation's line",
                Locator::Css("#service-shop\\.Orders details.op[id='op-shop.Orders.get'] summary"),
            )
            .await;
            let text = summary.text().await.expect("text");
            assert!(
                text.contains("GET")
                    && text.contains("/orders/{id}")
                    && text.contains("One order by id."),
                "{text:?}"
            );
            let title = browser.find(Locator::Id("title")).await.expect("title");
            assert!(title.text().await.expect("title").contains("shop"));
            // The error table and the named schema are shown.
            shows(
                &browser,
                "the 503 row of the error table",
                Locator::XPath("//section[@id='errors']//td[normalize-space(.)='503']"),
            )
            .await;
            shows(&browser, "the Order schema", Locator::Id("schema-Order")).await;
            let (status, body) = try_it(
                &browser,
                "shop.Orders.get",
                &[("id", "42"), ("verbose", "true")],
                None,
            )
            .await;
            assert!(status.starts_with("200"), "{status:?}");
            let answer: Value = serde_json::from_str(&body).expect("the page shows JSON");
            assert_eq!(answer, json!({"id": "42", "query": "verbose=true"}));
        })
        .await;
}

#[tokio::test]
async fn through_a_real_gateway_the_page_lists_the_echo_entry_and_calls_it() {
    use rpc::{Client, InProcessRegistry, Registry, Server};
    let registry: Arc<dyn Registry> = Arc::new(InProcessRegistry::new());
    let _server = Server::builder()
        .shared_registry(registry.clone())
        .add_service(examples::EchoServer::new(examples::EchoService::default()))
        .serve("127.0.0.1:0")
        .await
        .expect("the echo server");
    let gateway = rpc_gateway::Gateway::builder()
        .client(Client::builder().shared_registry(registry.clone()).build())
        .registry(registry)
        .build()
        .await
        .expect("the gateway");
    let entry = "echo.Echo.echo";
    assert!(
        gateway
            .wait_until(WAIT, |entries| entries
                .iter()
                .any(|e| e.id.as_str() == entry))
            .await,
        "the gateway never served {entry}"
    );
    // The body the gateway takes: by name when the server publishes names, else positional.
    let named = gateway
        .entries()
        .iter()
        .any(|e| e.id.as_str() == entry && e.api.as_ref().is_some_and(|a| !a.params.is_empty()));
    let body = if named {
        r#"{"text": "from the page"}"#
    } else {
        r#"["from the page"]"#
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(gateway.serve(listener));

    let driver = Chromedriver::start().await;
    driver
        .with_browser(|browser| async move {
            browser
                .goto(&format!("http://{addr}/docs"))
                .await
                .expect("goto");
            let summary = shows(
                &browser,
                "the echo entry",
                Locator::Css("#service-echo\\.Echo details.op[id='op-echo.Echo.echo'] summary"),
            )
            .await;
            let text = summary.text().await.expect("text");
            assert!(
                text.contains("POST") && text.contains("/api/echo.Echo/echo"),
                "{text:?}"
            );
            let (status, answer) = try_it(&browser, entry, &[], Some(body)).await;
            assert!(status.starts_with("200"), "{status:?}: {answer}");
            assert_eq!(
                serde_json::from_str::<Value>(&answer).expect("JSON"),
                json!("from the page")
            );
        })
        .await;
}
