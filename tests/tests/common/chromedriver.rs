//! A real headless chromium for the tests of the web pages (the admin console, the gateway's
//! documentation page), driven through chromedriver (WebDriver over plain HTTP on loopback).
//!
//! Why one harness: a page is tested the way its reader uses it, in a browser, and starting
//! chromedriver on a free port, opening a session that is always closed, killing every browser
//! it started and waiting for an element without a fixed delay are the same for every page.
//! Every wait is a bounded poll (at most [`WAIT`], every [`POLL`]).
//!
//! Needs `chromium` and `chromedriver` on the PATH (scripts/test.sh installs Debian's
//! `chromium` and `chromium-driver` when they are missing). The including test package needs
//! `fantoccini`, `hyper-util`, `futures-util`, `libc`, `reqwest`, `serde_json`, `tempfile` and
//! tokio's `process` feature. Include it with
//! `#[path = "../../tests/tests/common/chromedriver.rs"] mod chromedriver;`.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fantoccini::elements::Element;
use fantoccini::wd::Capabilities;
use fantoccini::{Client as Browser, ClientBuilder, Locator};
use futures_util::FutureExt;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The longest any one wait (chromedriver starting, the page showing something) may take: far
/// above what it takes on a loaded two-core machine (about a second), so a failure means the page
/// never got there.
pub const WAIT: Duration = Duration::from_secs(30);
/// How often a wait looks again.
pub const POLL: Duration = Duration::from_millis(50);

const MISSING: &str = "this test drives a real headless chromium through chromedriver: \
    install Debian's `chromium` and `chromium-driver` (scripts/test.sh does when they are missing)";

/// The executable `name` on the PATH, as `which` finds it.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The chromium chromedriver starts: the one on the PATH, else Debian's.
pub fn chromium() -> PathBuf {
    on_path("chromium")
        .or_else(|| Some(PathBuf::from("/usr/bin/chromium")).filter(|p| p.is_file()))
        .unwrap_or_else(|| panic!("no chromium on the PATH nor at /usr/bin/chromium: {MISSING}"))
}

/// A chromedriver child on a free loopback port, killed with everything it started (its process
/// group: the browsers) when dropped, so a failing test leaves no browser behind.
pub struct Chromedriver {
    child: Child,
    port: u16,
    /// What chromedriver printed, for failure messages.
    output: Arc<Mutex<Vec<String>>>,
    /// The `TMPDIR` of chromedriver and its browsers, removed after they are killed: chromium
    /// leaves a directory of its own there (`org.chromium.Chromium.*`, its process-singleton
    /// socket) when it does not quit in order, as a browser killed with its driver does not.
    _tmp: tempfile::TempDir,
}

impl Chromedriver {
    /// Starts chromedriver with `--port=0` (it picks a free port and prints it) and waits, at
    /// most [`WAIT`], until it says it listens, then checks that it answers. Chromedriver picks
    /// the port for IPv6 and then binds the same number on IPv4, which another process may hold
    /// meanwhile ("IPv4 port not available"): it is started again then, up to three times.
    pub async fn start() -> Self {
        let program = on_path("chromedriver")
            .unwrap_or_else(|| panic!("no chromedriver on the PATH: {MISSING}"));
        let tmp = tempfile::tempdir().expect("a temporary directory for chromedriver");
        let mut tries = 0;
        let (child, port, mut lines, output) = loop {
            tries += 1;
            let mut child = Command::new(&program)
                .arg("--port=0")
                .env("TMPDIR", tmp.path())
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
            match started {
                Ok(Some(port)) => break (child, port, lines, output),
                Ok(None)
                    if tries < 3
                        && output
                            .lock()
                            .unwrap()
                            .iter()
                            .any(|l| l.contains("port not available")) => {}
                _ => panic!(
                    "chromedriver never said it listens within {WAIT:?} ({}); it printed: {:?}",
                    if started.is_err() {
                        "timed out"
                    } else {
                        "it exited"
                    },
                    output.lock().unwrap()
                ),
            }
        };
        // Keep reading, so its output never fills the pipe and stays at hand for messages.
        let sink = output.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        let driver = Chromedriver {
            child,
            port,
            output,
            _tmp: tmp,
        };
        let status = reqwest::get(format!("{}/status", driver.url()))
            .await
            .unwrap_or_else(|e| panic!("chromedriver does not answer on port {port}: {e}"))
            .text()
            .await
            .expect("chromedriver's /status");
        let status: Value = serde_json::from_str(&status)
            .unwrap_or_else(|e| panic!("chromedriver's /status is not JSON: {e}: {status}"));
        assert_eq!(
            status["value"]["ready"], true,
            "chromedriver is not ready: {status}"
        );
        driver
    }

    /// Where chromedriver answers WebDriver requests.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A new browser session: headless chromium, its own fresh profile (so nothing a page
    /// keeps, such as the console's token, carries over from another session).
    pub async fn browser(&self) -> Browser {
        let mut caps = Capabilities::new();
        caps.insert("browserName".into(), json!("chrome"));
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium(),
                "args": [
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--window-size=1400,1100",
                ],
            }),
        );
        ClientBuilder::new(HttpConnector::new())
            .capabilities(caps)
            .connect(&self.url())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "chromedriver could not start {}: {e}; it printed: {:?}",
                    chromium().display(),
                    self.output.lock().unwrap()
                )
            })
    }

    /// Runs `check` in a new browser session and ends the session whether or not `check`
    /// panicked, so chromium quits in order; a panic is then passed on.
    pub async fn with_browser<F, Fut>(&self, check: F)
    where
        F: FnOnce(Browser) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let browser = self.browser().await;
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
            // (it was started with `process_group(0)`); it touches no memory of this process.
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

/// Waits, at most [`WAIT`], until the page has an element `locator` finds; `what` names it in
/// the failure message, with the text of the page's element `#status` (both pages keep a
/// status line there).
pub async fn shows(browser: &Browser, what: &str, locator: Locator<'_>) -> Element {
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
