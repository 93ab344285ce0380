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

#[path = "../../tests/tests/common/chromedriver.rs"]
mod chromedriver;
#[path = "support/entries.rs"]
mod entries;
#[path = "support/running.rs"]
mod running;

use std::net::SocketAddr;

use axum::extract::{Path, RawQuery};
use axum::routing::get;
use axum::Json;
use chromedriver::{shows, Chromedriver};
use entries::{api, entry, reference, schemas};
use fantoccini::{Client as Browser, Locator};
use rpc_core::{EntryApi, ServiceEntry};
use rpc_gateway::openapi::{document, DocumentInfo};
use running::running;
use serde_json::{json, Value};

/// Opens the page at `addr` and waits until it lists the operation `id` under its service;
/// returns the text of the operation's line (method, path, summary).
async fn operation_line(browser: &Browser, addr: SocketAddr, service: &str, id: &str) -> String {
    browser
        .goto(&format!("http://{addr}/docs"))
        .await
        .expect("goto");
    listed(browser, service, id).await
}

/// Waits until the page lists the operation `id` under its service; returns the text of the
/// operation's line.
async fn listed(browser: &Browser, service: &str, id: &str) -> String {
    let locator = format!(
        "#service-{} details.op[id='op-{id}'] summary",
        service.replace('.', "\\.")
    );
    let line = shows(
        browser,
        &format!("the line of {id} under {service}"),
        Locator::Css(&locator),
    )
    .await;
    line.text().await.expect("text")
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
    let mut schemas = schemas(
        vec![json!({"type": "integer"}), json!({"type": "boolean"})],
        reference("Order"),
        &[(
            "Order",
            json!({"type": "object", "properties": {"id": {"type": "integer"}}}),
        )],
    );
    schemas.error = Some(json!({"type": "string", "enum": ["Missing"]}));
    entry(
        "shop.Orders",
        "get",
        Some(EntryApi {
            doc: Some("One order by id.".into()),
            ..api(
                &["id", "verbose"],
                Some(("GET", "/orders/{id}")),
                Some(schemas),
            )
        }),
    )
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
            // Listed under its service, with its method, path and summary.
            let text = operation_line(&browser, addr, "shop.Orders", "shop.Orders.get").await;
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

/// With a token, the gateway serves `/docs` without it but not the document: the page asks for
/// the token, loads the document with it, and its "try it" calls carry it.
#[tokio::test]
async fn with_a_token_the_page_asks_for_it_then_lists_and_calls_through_it() {
    let entry = "echo.Echo.echo";
    let running = running(
        rpc::Server::builder()
            .add_service(examples::EchoServer::new(examples::EchoService::default())),
        Some("s3cret"),
        &[entry],
    )
    .await;
    let addr = running.addr;
    let driver = Chromedriver::start().await;
    driver
        .with_browser(|browser| async move {
            browser
                .goto(&format!("http://{addr}/docs"))
                .await
                .expect("goto");
            let asks = shows(
                &browser,
                "the page asking for the token",
                Locator::XPath("//p[@id='status' and contains(., 'needs a token')]"),
            )
            .await;
            assert!(asks.text().await.expect("text").contains("Enter"));
            let token = shows(
                &browser,
                "the token box",
                Locator::Css("#token-box:not(.hidden) input#token"),
            )
            .await;
            // `\u{E007}` is WebDriver's Enter key.
            token.send_keys("s3cret\u{E007}").await.expect("type");
            let text = listed(&browser, "echo.Echo", entry).await;
            assert!(text.contains("/api/echo.Echo/echo"), "{text:?}");
            let (status, answer) =
                try_it(&browser, entry, &[], Some(r#"{"text": "with a token"}"#)).await;
            assert!(status.starts_with("200"), "{status:?}: {answer}");
            assert_eq!(
                serde_json::from_str::<Value>(&answer).expect("JSON"),
                json!("with a token")
            );
        })
        .await;
}

#[tokio::test]
async fn through_a_real_gateway_the_page_lists_the_echo_entry_and_calls_it() {
    let entry = "echo.Echo.echo";
    let running = running(
        rpc::Server::builder()
            .add_service(examples::EchoServer::new(examples::EchoService::default())),
        None,
        &[entry],
    )
    .await;
    let addr = running.addr;
    // The body the gateway takes: by name when the server publishes names, else positional.
    let named =
        running.gateway.entries().iter().any(|e| {
            e.id.as_str() == entry && e.api.as_ref().is_some_and(|a| !a.params.is_empty())
        });
    let body = if named {
        r#"{"text": "from the page"}"#
    } else {
        r#"["from the page"]"#
    };

    let driver = Chromedriver::start().await;
    driver
        .with_browser(|browser| async move {
            let text = operation_line(&browser, addr, "echo.Echo", entry).await;
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
