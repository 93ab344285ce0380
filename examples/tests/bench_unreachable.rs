//! The `bench` program's client against an address where nothing listens: the run fails with
//! the cause, governed or not, and prints no RESULT line. Before, the governed client's
//! fallback answered every call locally and the run printed figures of those local answers,
//! with no error, as the `rpc` peer's.

use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_bench");

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
