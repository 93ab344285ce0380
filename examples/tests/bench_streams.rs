//! The stream cases of the `bench` program, run as the stream benchmark runs them: a server
//! process and a client process on loopback, the client's STREAM line and the server's SERVER
//! line read back. They are what `scripts/stream-bench.sh` compares with tonic, so a broken
//! line or a stream that fails must show here rather than as a missing row in a table.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

/// A `bench --mode server` process, killed when dropped.
struct ServerProcess {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl ServerProcess {
    fn start() -> (ServerProcess, String) {
        let mut child = Command::new(BENCH)
            .args([
                "--mode",
                "server",
                "--addr",
                "127.0.0.1:0",
                "--threads",
                "2",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the bench server");
        let out = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut server = ServerProcess { child, out };
        let line = server.line("LISTENING ");
        let addr = field(&line, "addr")
            .expect("addr= in LISTENING")
            .to_string();
        (server, addr)
    }

    /// The next line starting with `prefix` (bounded: the process prints a few lines only).
    fn line(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        for _ in 0..20 {
            line.clear();
            if self
                .out
                .read_line(&mut line)
                .expect("read the server's output")
                == 0
            {
                break;
            }
            if line.starts_with(prefix) {
                return line.trim().to_string();
            }
        }
        panic!("the server printed no {prefix:?} line");
    }

    /// SIGTERM, then its SERVER line.
    fn stop(mut self) -> String {
        // SAFETY: a plain syscall on the pid of a child this test started and still owns.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        self.line("SERVER ")
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stream_client(addr: &str, extra: &[&str]) -> std::process::Output {
    Command::new(BENCH)
        .args(["--mode", "client", "--addr", addr, "--threads", "2"])
        .args(extra)
        .output()
        .expect("run the bench client")
}

#[test]
fn stream_cases_print_a_stream_line_counted_by_the_server_too() {
    let (server, addr) = ServerProcess::start();
    let started = Instant::now();
    let mut received = 0.0;
    for (streams, size) in [("1", "32"), ("8", "4096")] {
        let out = stream_client(
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
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "client failed: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
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
        assert!(
            (0.3..5.0).contains(&secs),
            "the window is --duration: {line}"
        );
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
    assert!(started.elapsed() < Duration::from_secs(60));
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
    let out = stream_client(
        &addr,
        &["--streams", "1", "--concurrency", "4", "--duration", "0.1"],
    );
    assert!(
        !out.status.success(),
        "--streams with --concurrency is refused"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--concurrency"),
        "the error names the flag: {err}"
    );
    let out = stream_client(
        &addr,
        &["--concurrency", "2", "--duration", "0.2", "--warmup", "0"],
    );
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("RESULT peer=rpc "));
    let end = server.stop();
    assert!(
        field(&end, "items").is_none(),
        "no stream fields after a unary run: {end}"
    );
    assert!(num(&end, "served") > 0.0, "{end}");
}
