//! Prometheus for real: Debian's `prometheus` scrapes a running server's `/metrics` (through
//! its admin endpoint, with the bearer token in the scrape config) and the call counter read
//! back through Prometheus's query API equals the number of calls the test made.
//!
//! Prometheus needs a listen address of its own: the test binds 127.0.0.1:0, reads the port
//! the system gave, releases it and hands it to Prometheus; should another process take it in
//! between, Prometheus fails to start and the test tries again with another port (three
//! times). Waiting for the scrape is a bounded loop over Prometheus's API (30 s at most), not
//! a fixed pause. `scripts/test.sh` installs `prometheus` when it is missing.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rpc::{Client, InProcessRegistry, RpcError, Server};
use rpc_admin::Admin;
use serde_json::Value;

#[rpc::service(name = "prom.Echo")]
trait Echo {
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

struct Plain;

impl Echo for Plain {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
}

const TOKEN: &str = "scrape-token";

/// Calls the test makes: the counter Prometheus reports must say exactly this.
const CALLS: u32 = 17;

/// A Prometheus process, killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

fn config(target: &str) -> String {
    format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
         scrape_configs:\n  - job_name: rpc\n    scrape_interval: 1s\n    scrape_timeout: 1s\n\
         \x20   authorization:\n      type: Bearer\n      credentials: {TOKEN}\n\
         \x20   static_configs:\n      - targets: ['{target}']\n"
    )
}

async fn ready(http: &reqwest::Client, port: u16) -> bool {
    matches!(
        http.get(format!("http://127.0.0.1:{port}/-/ready")).send().await,
        Ok(r) if r.status().is_success()
    )
}

/// Starts Prometheus scraping `target` and waits (at most 30 s) until it is ready.
async fn start_prometheus(target: &str, http: &reqwest::Client) -> Prometheus {
    if Command::new("prometheus")
        .arg("--version")
        .output()
        .is_err()
    {
        panic!(
            "the `prometheus` program is not installed: `apt-get install prometheus` (as root), \
             or run scripts/test.sh, which installs it"
        );
    }
    let mut last_log = String::new();
    for _ in 0..3 {
        let dir = tempfile::Builder::new()
            .prefix("rpc-prometheus-test-")
            .tempdir()
            .expect("a temporary directory");
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config(target)).expect("write the scrape config");
        let port = free_port();
        let log_path = dir.path().join("prometheus.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let mut p = Prometheus {
            child,
            port,
            _dir: dir,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::time::Instant::now() < deadline {
            if ready(http, port).await {
                return p;
            }
            if p.child.try_wait().ok().flatten().is_some() {
                break; // it exited: the port was taken, or the config refused
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last_log = read(&log_path);
    }
    panic!("prometheus did not start (3 attempts); its last log:\n{last_log}");
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `q` as a URL query value: everything but unreserved characters percent-encoded.
fn percent_encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The value of an instant query with exactly one series, if it has one yet.
async fn query(http: &reqwest::Client, port: u16, q: &str) -> Option<f64> {
    let r = http
        .get(format!(
            "http://127.0.0.1:{port}/api/v1/query?query={}",
            percent_encode(q)
        ))
        .send()
        .await
        .ok()?;
    let v: Value = serde_json::from_str(&r.text().await.ok()?).ok()?;
    let result = v["data"]["result"].as_array()?;
    if result.len() != 1 {
        return None;
    }
    result[0]["value"][1].as_str()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_server_and_reads_back_the_number_of_calls_made() {
    let registry = InProcessRegistry::new();
    let server = Server::builder()
        .registry(registry.clone())
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let admin = Admin::builder()
        .server(&server)
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    let echo = EchoClient::new(Client::builder().registry(registry).build());
    for i in 0..CALLS {
        assert_eq!(echo.echo(i.to_string()).await.unwrap(), i.to_string());
    }

    let http = reqwest::Client::new();
    let prometheus = start_prometheus(&admin.local_addr().to_string(), &http).await;
    let q = r#"sum(rpc_calls_total{job="rpc",side="server",entry="prom.Echo.echo",status="200"})"#;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let value = loop {
        if let Some(v) = query(&http, prometheus.port, q).await {
            break v;
        }
        if tokio::time::Instant::now() >= deadline {
            let targets = match http
                .get(format!(
                    "http://127.0.0.1:{}/api/v1/targets",
                    prometheus.port
                ))
                .send()
                .await
            {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(e) => e.to_string(),
            };
            panic!("prometheus scraped no call counter in 30 s; its targets: {targets}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(value, f64::from(CALLS));
    // The scrape itself succeeded with the token (a refused scrape would leave `up` at 0).
    assert_eq!(
        query(&http, prometheus.port, r#"up{job="rpc"}"#).await,
        Some(1.0)
    );
    admin.shutdown().await;
    server.shutdown().await;
}
