//! The example programs as scripts run them, on what goes wrong around them: a server that is
//! not there, a reader that goes away, a flag out of range. Each ends with the exit code and
//! the message its documentation gives, never a panic.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

mod support;

const BENCH: &str = env!("CARGO_BIN_EXE_bench");

/// The `bench` program's client against an address where nothing listens: the run fails with
/// the cause, governed or not, and prints no RESULT line. Before, the governed client's
/// fallback answered every call locally and the run printed figures of those local answers,
/// with no error, as the `rpc` peer's.
#[test]
fn a_run_against_nothing_listening_fails_with_the_cause_and_prints_no_figures() {
    // A free port, closed again: nothing listens there.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .to_string();
    for governance in ["on", "off"] {
        let out = Command::new(BENCH)
            .args([
                "--mode",
                "client",
                "--addr",
                &addr,
                "--duration",
                "1",
                "--warmup",
                "0",
                "--governance",
                governance,
            ])
            .output()
            .expect("run bench");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(
            out.status.code(),
            Some(1),
            "governance {governance}: {stdout}{stderr}"
        );
        assert!(
            !stdout.contains("RESULT"),
            "governance {governance}: figures printed: {stdout}"
        );
        assert!(
            stderr.contains("Connection refused") || stderr.contains("connect failed"),
            "governance {governance}: the cause: {stderr}"
        );
    }
}

/// `echo-client ... | head -1`: the reader goes away after the first line, and the client ends
/// quietly with 0, as its documentation says it exits whatever the calls' outcomes. Before,
/// every caller task and then the summary panicked on the closed pipe (exit 101).
#[test]
fn echo_client_ends_quietly_with_0_when_its_reader_goes_away() {
    let (_server, lines) = support::spawn(env!("CARGO_BIN_EXE_echo-server"), &["--port", "0"]);
    let listening = support::wait_for(&lines, "listening on ", Duration::from_secs(20));
    let addr = listening
        .trim_start_matches("listening on ")
        .split_whitespace()
        .next()
        .expect("an address")
        .to_string();
    let mut client = Command::new(env!("CARGO_BIN_EXE_echo-client"))
        .args(["--endpoints", &addr, "--calls", "500", "--interval-ms", "5"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start echo-client");
    let err = support::read_all(client.stderr.take().expect("stderr"));
    let mut out = BufReader::new(client.stdout.take().expect("stdout"));
    let mut first = String::new();
    out.read_line(&mut first).expect("a first line");
    assert!(first.starts_with("call "), "{first}");
    drop(out);
    let status = support::wait_within(client, Duration::from_secs(20))
        .expect("echo-client ends once its reader is gone");
    let err = err
        .recv_timeout(Duration::from_secs(20))
        .expect("its standard error");
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `scenarios --seconds -1` (or `nan`, or a number of seconds no duration holds): an error
/// naming the flag and exit 1, before any server starts. Before, three servers started and the
/// client panicked (exit 101).
#[test]
fn scenarios_refuses_a_number_of_seconds_out_of_range() {
    for seconds in ["-1", "nan", "1e30"] {
        let mut run = Command::new(env!("CARGO_BIN_EXE_scenarios"))
            .args(["--only", "a", &format!("--seconds={seconds}")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run scenarios");
        let err = support::read_all(run.stderr.take().expect("stderr"));
        // Bounded: a check that let the value through would start a load without end.
        let status = support::wait_within(run, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("--seconds {seconds}: still running after 20 s"));
        let err = err
            .recv_timeout(Duration::from_secs(20))
            .expect("its standard error");
        assert_eq!(status.code(), Some(1), "--seconds {seconds}: {err}");
        assert!(err.contains("--seconds"), "--seconds {seconds}: {err}");
        assert!(!err.contains("panicked"), "--seconds {seconds}: {err}");
    }
}
