//! A real etcd for the registry tests: one `etcd` process per [`Etcd`], on free loopback ports,
//! with its data in a temporary directory. It is killed (and the directory removed) on drop; it
//! can be stopped and started again on the same ports, with or without its data.
//!
//! The integration binary declares it once, as `crate::etcd_harness` (see `integration/main.rs`);
//! other crates' tests include it with `#[path = ".../tests/tests/common/etcd.rs"] mod ...;`.
#![allow(dead_code)]

use std::fs::File;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long etcd may take to answer `/health` after it was started.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// A running (or stopped) etcd.
pub struct Etcd {
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

/// Two distinct free ports on 127.0.0.1 (the listeners are closed before returning).
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let b = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let ports = (
        a.local_addr().expect("local addr").port(),
        b.local_addr().expect("local addr").port(),
    );
    drop((a, b));
    ports
}

impl Etcd {
    /// Starts a fresh etcd and waits until it answers.
    pub async fn start() -> Etcd {
        // A port picked here may be taken by someone else before etcd binds it: try again with
        // other ports (a bounded number of times).
        let mut last_log = String::new();
        for _ in 0..3 {
            let (client_port, peer_port) = free_ports();
            let mut etcd = Etcd {
                client_port,
                peer_port,
                dir: tempfile::Builder::new()
                    .prefix("rpc-etcd-test-")
                    .tempdir()
                    .expect("create a temporary directory for etcd"),
                child: None,
            };
            match etcd.launch().await {
                Ok(()) => return etcd,
                Err(log) => last_log = log,
            }
        }
        panic!("etcd did not start (3 attempts); its last log:\n{last_log}");
    }

    /// `127.0.0.1:<client port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// `etcd://127.0.0.1:<client port>`, for `EtcdRegistry::from_url`.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoint())
    }

    /// A plain etcd client, for looking at or tampering with the keys.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], None)
            .await
            .expect("connect an etcd client")
    }

    /// The number of watchers etcd serves now (its `etcd_debugging_mvcc_watcher_total` gauge).
    pub async fn watchers(&self) -> Option<u64> {
        let text = http_get(self.client_port, "/metrics").await?;
        text.lines()
            .find_map(|l| l.strip_prefix("etcd_debugging_mvcc_watcher_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
    }

    /// Waits (at most 5 s) until etcd serves exactly `n` watchers.
    pub async fn wait_for_watchers(&self, n: u64) {
        let started = Instant::now();
        let mut last = None;
        while started.elapsed() < Duration::from_secs(5) {
            last = self.watchers().await;
            if last == Some(n) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("etcd serves {last:?} watchers, not {n}, after 5 s");
    }

    /// Kills etcd at once (SIGKILL), as a crash would; the data stays.
    pub fn stop(&mut self) {
        self.kill();
    }

    /// Starts etcd again on the same ports with the same data, and waits until it answers.
    pub async fn restart(&mut self) {
        self.kill();
        if let Err(log) = self.launch().await {
            panic!("etcd did not restart; its log:\n{log}");
        }
    }

    /// Starts etcd again on the same ports with no data (a new cluster: every lease and key is
    /// gone, revisions start over), and waits until it answers.
    pub async fn restart_empty(&mut self) {
        self.kill();
        std::fs::remove_dir_all(self.data_dir()).expect("remove etcd's data");
        if let Err(log) = self.launch().await {
            panic!("etcd did not restart; its log:\n{log}");
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn log(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Spawns etcd and waits for `/health`; on failure returns the tail of its log.
    async fn launch(&mut self) -> Result<(), String> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open etcd's log file");
        let log_err = log.try_clone().expect("clone etcd's log file");
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let spawned = Command::new("etcd")
            .args(["--name", "default"])
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .arg("--data-dir")
            .arg(self.data_dir())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn();
        let child = match spawned {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                panic!("etcd not found: run scripts/test.sh, which installs etcd-server")
            }
            Err(e) => panic!("could not start etcd: {e}"),
        };
        self.child = Some(child);
        let started = Instant::now();
        while started.elapsed() < READY_WITHIN {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!("etcd exited with {status}\n{}", self.log()));
                }
            }
            if healthy(self.client_port).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "etcd did not answer /health within {READY_WITHIN:?}\n{}",
            self.log()
        ))
    }
}

/// Whether etcd on `port` says it is healthy (it has a leader).
async fn healthy(port: u16) -> bool {
    http_get(port, "/health")
        .await
        .is_some_and(|answer| answer.contains("\"health\":\"true\""))
}

/// The body (and headers) of `GET path` on etcd's client port; `None` on any failure or after
/// 500 ms.
async fn http_get(port: u16, path: &str) -> Option<String> {
    let ask = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    match tokio::time::timeout(Duration::from_millis(500), ask).await {
        Ok(Ok(answer)) => Some(answer),
        _ => None,
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        // `dir` (a TempDir) removes itself.
    }
}
