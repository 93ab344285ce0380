//! A real ZooKeeper for the registry tests: one standalone ZooKeeper (Debian's `zookeeper`
//! package: the `QuorumPeerMain` class of /usr/share/java/zookeeper.jar on a JVM) per
//! [`ZooKeeper`], on a free loopback port, with a generated `zoo.cfg` and its data in a
//! temporary directory. It is killed on drop; it can be killed (SIGKILL) and started again on
//! the same port, with or without its data.
//!
//! The JVM runs under a small shell that kills it (SIGKILL) as soon as its standard input
//! closes: when the harness stops it, and also when the test process dies however it dies, so
//! no ZooKeeper outlives its test. That is what lets one [`shared`](ZooKeeper::shared) server
//! (never dropped) serve the checks of the registry suite, each under a prefix of its own.
//!
//! The integration binary declares it once, as `crate::zookeeper_harness` (see
//! `integration/main.rs`).
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long ZooKeeper may take to serve after it was started (a JVM, on a busy machine).
const READY_WITHIN: Duration = Duration::from_secs(30);
/// ZooKeeper's tick: sessions expire within a tick of their timeout, and timeouts as short as
/// two ticks are allowed.
pub const TICK: Duration = Duration::from_millis(100);
/// The ZooKeeper jar Debian's `zookeeper` package installs (its manifest names the rest of the
/// classpath).
const JAR: &str = "/usr/share/java/zookeeper.jar";
/// A logger for ZooKeeper's slf4j (Debian's `libslf4j-java`, a dependency of `zookeeper`);
/// without it ZooKeeper logs nothing, not even why it failed to start.
const LOGGER_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// Kills the JVM (SIGKILL) when standard input closes; exits with the JVM's status. `$1` is a
/// directory to remove afterwards (empty: none), the rest is the command.
const WRAPPER: &str = r#"cleanup=$1; shift
exec 3<&0
"$@" </dev/null & pid=$!
{ read -r _ <&3; kill -9 "$pid" 2>/dev/null; } &
wait "$pid"; status=$?
[ -n "$cleanup" ] && rm -rf "$cleanup"
exit "$status""#;

/// A running (or stopped) ZooKeeper.
pub struct ZooKeeper {
    port: u16,
    dir: PathBuf,
    /// Removes `dir` on drop (`None` for the shared server, whose wrapper removes it).
    _temp: Option<tempfile::TempDir>,
    cleanup_by_wrapper: bool,
    child: Option<(Child, ChildStdin)>,
}

/// A free port on 127.0.0.1 (the listener is closed before returning).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

static SHARED: tokio::sync::OnceCell<ZooKeeper> = tokio::sync::OnceCell::const_new();
static PREFIXES: AtomicU64 = AtomicU64::new(0);

impl ZooKeeper {
    /// Starts a fresh ZooKeeper and waits until it serves.
    pub async fn start() -> ZooKeeper {
        Self::start_with(false).await
    }

    /// One ZooKeeper for the whole test process, started by the first caller; give each test
    /// its own [`prefix`](Self::prefix). It is killed when the process ends.
    pub async fn shared() -> &'static ZooKeeper {
        SHARED.get_or_init(|| Self::start_with(true)).await
    }

    /// A node path no other test of this process uses: `/test-<n>`.
    pub fn prefix() -> String {
        format!("/test-{}", PREFIXES.fetch_add(1, Ordering::Relaxed))
    }

    async fn start_with(shared: bool) -> ZooKeeper {
        assert!(
            Path::new(JAR).exists(),
            "ZooKeeper not found ({JAR}): run scripts/test.sh, which installs Debian's zookeeper"
        );
        // A port picked here may be taken by someone else before ZooKeeper binds it: try again
        // with another (a bounded number of times).
        let mut last_log = String::new();
        for _ in 0..3 {
            let temp = tempfile::Builder::new()
                .prefix("rpc-zookeeper-test-")
                .tempdir()
                .expect("create a temporary directory for ZooKeeper");
            let dir = temp.path().to_path_buf();
            let (temp, cleanup_by_wrapper) = if shared {
                // Never dropped: the wrapper removes the directory when the process ends.
                let _ = temp.keep();
                (None, true)
            } else {
                (Some(temp), false)
            };
            let mut zk = ZooKeeper {
                port: free_port(),
                dir,
                _temp: temp,
                cleanup_by_wrapper,
                child: None,
            };
            zk.write_config();
            match zk.launch().await {
                Ok(()) => return zk,
                Err(log) => last_log = log,
            }
        }
        panic!("ZooKeeper did not start (3 attempts); its last log:\n{last_log}");
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `zk://127.0.0.1:<port>`, for `ZooKeeperRegistry::from_url` (prefix `/rpc`).
    pub fn url(&self) -> String {
        format!("zk://{}", self.endpoint())
    }

    /// `zk://127.0.0.1:<port><prefix>`: a registry whose nodes live under `prefix`.
    pub fn url_with_prefix(&self, prefix: &str) -> String {
        format!("{}{prefix}", self.url())
    }

    /// A plain ZooKeeper client, for looking at or tampering with the nodes.
    pub async fn client(&self) -> zookeeper_client::Client {
        tokio::time::timeout(
            Duration::from_secs(10),
            zookeeper_client::Client::connect(&self.endpoint()),
        )
        .await
        .expect("a ZooKeeper session within 10 s")
        .expect("connect a ZooKeeper client")
    }

    /// Kills ZooKeeper at once (SIGKILL), as a crash would; the data stays.
    pub fn stop(&mut self) {
        self.kill();
    }

    /// Starts ZooKeeper again on the same port with the same data (its sessions come back with
    /// it), and waits until it serves.
    pub async fn restart(&mut self) {
        self.kill();
        if let Err(log) = self.launch().await {
            panic!("ZooKeeper did not restart; its log:\n{log}");
        }
    }

    /// Starts ZooKeeper again on the same port with no data (every node and session is gone),
    /// and waits until it serves.
    pub async fn restart_empty(&mut self) {
        self.kill();
        std::fs::remove_dir_all(self.data_dir()).expect("remove ZooKeeper's data");
        if let Err(log) = self.launch().await {
            panic!("ZooKeeper did not restart; its log:\n{log}");
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn config_path(&self) -> PathBuf {
        self.dir.join("zoo.cfg")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("zookeeper.log")
    }

    fn log(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn write_config(&self) {
        let config = format!(
            "tickTime={tick}\n\
             dataDir={data}\n\
             clientPort={port}\n\
             clientPortAddress=127.0.0.1\n\
             maxClientCnxns=0\n\
             minSessionTimeout={min}\n\
             maxSessionTimeout=60000\n\
             admin.enableServer=false\n\
             4lw.commands.whitelist=srvr,ruok\n",
            tick = TICK.as_millis(),
            data = self.data_dir().display(),
            port = self.port,
            min = (TICK * 2).as_millis(),
        );
        std::fs::write(self.config_path(), config).expect("write zoo.cfg");
    }

    /// Closes the wrapper's standard input, which kills the JVM, and waits for both.
    fn kill(&mut self) {
        if let Some((mut child, stdin)) = self.child.take() {
            drop(stdin);
            let _ = child.wait();
        }
    }

    /// Spawns ZooKeeper and waits until it answers `srvr` as a serving standalone server; on
    /// failure returns the tail of its log.
    async fn launch(&mut self) -> Result<(), String> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open ZooKeeper's log file");
        let log_err = log.try_clone().expect("clone ZooKeeper's log file");
        let mut classpath = JAR.to_string();
        if Path::new(LOGGER_JAR).exists() {
            classpath = format!("{classpath}:{LOGGER_JAR}");
        }
        let cleanup = if self.cleanup_by_wrapper {
            self.dir.display().to_string()
        } else {
            String::new()
        };
        let spawned = Command::new("sh")
            .args(["-c", WRAPPER, "zookeeper-wrapper", &cleanup])
            .arg("java")
            // A short-lived JVM: quick to start, small.
            .args([
                "-Xshare:auto",
                "-XX:TieredStopAtLevel=1",
                "-XX:+UseSerialGC",
            ])
            .args(["-Xmx128m", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn"])
            .args(["-cp", &classpath])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(self.config_path())
            .stdin(Stdio::piped())
            .stdout(log)
            .stderr(log_err)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => panic!("could not start ZooKeeper's wrapper shell: {e}"),
        };
        let stdin = child.stdin.take().expect("the wrapper's stdin");
        self.child = Some((child, stdin));
        let started = Instant::now();
        while started.elapsed() < READY_WITHIN {
            if let Some((child, _)) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!("ZooKeeper exited with {status}\n{}", self.log()));
                }
            }
            if serving(self.port).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let log = self.log();
        self.kill();
        Err(format!(
            "ZooKeeper did not serve within {READY_WITHIN:?}\n{log}"
        ))
    }
}

/// Whether the ZooKeeper on `port` serves requests: its `srvr` command names its mode (it
/// answers "not currently serving requests" until it does).
async fn serving(port: u16) -> bool {
    let ask = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"srvr").await?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), ask).await,
        Ok(Ok(answer)) if answer.contains("Mode: standalone")
    )
}

impl Drop for ZooKeeper {
    fn drop(&mut self) {
        self.kill();
        // `_temp` (a TempDir) removes the directory.
    }
}
