//! The stream cases of the `bench` program, run as the stream benchmark runs them: a server
//! process and a client process on loopback, the client's STREAM line and the server's SERVER
//! line read back. They are what `scripts/stream-bench.sh` compares with tonic, so a broken
//! line or a stream that fails must show here rather than as a missing row in a table.

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

mod support;

const BENCH: &str = env!("CARGO_BIN_EXE_bench");

/// The value of `key=` in a line of `key=value` pairs.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn num(line: &str, key: &str) -> f64 {
    field(line, key)
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key}= in {line:?}: {e}"))
}

/// How long a process of the test may take to print a line or to end.
const LIMIT: Duration = Duration::from_secs(60);

/// A `bench --mode server` process (killed when dropped) and its standard output's lines.
struct ServerProcess {
    process: support::Running,
    lines: mpsc::Receiver<String>,
}

impl ServerProcess {
    fn start() -> (ServerProcess, String) {
        let (process, lines) = support::spawn(
            BENCH,
            &[
                "--mode",
                "server",
                "--addr",
                "127.0.0.1:0",
                "--threads",
                "2",
            ],
        );
        let line = support::wait_for(&lines, "LISTENING ", LIMIT);
        let addr = field(&line, "addr")
            .expect("addr= in LISTENING")
            .to_string();
        (ServerProcess { process, lines }, addr)
    }

    /// SIGTERM, then its SERVER line.
    fn stop(self) -> String {
        // SAFETY: a plain syscall on the pid of a child this test started and still owns.
        unsafe {
            libc::kill(self.process.0.id() as libc::pid_t, libc::SIGTERM);
        }
        support::wait_for(&self.lines, "SERVER ", LIMIT)
    }
}

/// A run of the bench client with `extra` flags: its exit status, standard output and
/// standard error, within [`LIMIT`] (killed, and the test failed, past it).
fn stream_client(addr: &str, extra: &[&str]) -> (std::process::ExitStatus, String, String) {
    let mut client = Command::new(BENCH)
        .args(["--mode", "client", "--addr", addr, "--threads", "2"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the bench client");
    let out = support::read_all(client.stdout.take().expect("stdout"));
    let err = support::read_all(client.stderr.take().expect("stderr"));
    let status = support::wait_within(client, LIMIT)
        .unwrap_or_else(|| panic!("the bench client {extra:?} still ran after {LIMIT:?}"));
    let text = |rx: mpsc::Receiver<String>| rx.recv_timeout(LIMIT).expect("its output");
    (status, text(out), text(err))
}

#[test]
fn stream_cases_print_a_stream_line_counted_by_the_server_too() {
    let (server, addr) = ServerProcess::start();
    let mut received = 0.0;
    for (streams, size) in [("1", "32"), ("8", "4096")] {
        let (status, stdout, stderr) = stream_client(
            &addr,
            &[
                "--streams",
                streams,
                "--size",
                size,
                "--duration",
                "0.3",
                "--warmup",
                "0.1",
            ],
        );
        assert!(status.success(), "client failed: {stdout} {stderr}");
        let line = stdout
            .lines()
            .find(|l| l.starts_with("STREAM "))
            .unwrap_or_else(|| panic!("no STREAM line in {stdout:?}"));
        assert_eq!(field(line, "peer"), Some("rpc"));
        assert_eq!(field(line, "streams"), Some(streams));
        assert_eq!(field(line, "size"), Some(size));
        assert_eq!(num(line, "errors"), 0.0);
        let items = num(line, "items");
        let secs = num(line, "secs");
        assert!(items > 0.0, "no items in the window: {line}");
        assert!(secs >= 0.3, "the window is --duration: {line}");
        // `secs` is printed to the millisecond, the rate from the exact window: the rate lies
        // between items over the longest and the shortest window that rounds to `secs`.
        let rate = num(line, "items_per_s");
        let (shortest, longest) = (secs - 0.0005, secs + 0.0005);
        assert!(
            items / longest - 1.0 <= rate && rate <= items / shortest + 1.0,
            "items_per_s is items / secs: {line}"
        );
        received += items;
    }
    let end = server.stop();
    // The server counts every item it produced, the warm-ups' and those in flight included.
    assert!(
        num(&end, "items") >= received,
        "server produced fewer items than the clients counted: {end}"
    );
    assert!(num(&end, "cpu_us_per_item") > 0.0, "{end}");
}

#[test]
fn unary_runs_keep_their_server_line_and_stream_flags_are_refused_with_unary_ones() {
    let (server, addr) = ServerProcess::start();
    let (status, _, err) = stream_client(
        &addr,
        &["--streams", "1", "--concurrency", "4", "--duration", "0.1"],
    );
    assert!(!status.success(), "--streams with --concurrency is refused");
    assert!(
        err.contains("--concurrency"),
        "the error names the flag: {err}"
    );
    let (status, stdout, _) = stream_client(
        &addr,
        &["--concurrency", "2", "--duration", "0.2", "--warmup", "0"],
    );
    assert!(status.success());
    assert!(stdout.starts_with("RESULT peer=rpc "), "{stdout}");
    let end = server.stop();
    assert!(
        field(&end, "items").is_none(),
        "no stream fields after a unary run: {end}"
    );
    assert!(num(&end, "served") > 0.0, "{end}");
}
