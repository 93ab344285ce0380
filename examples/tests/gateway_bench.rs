//! The `gateway-bench` program with tiny counts: its lines are what scripts read for the
//! gateway's speed figures (`GATEWAY case=... rps=... p50_us=... p99_us=...` and the summary),
//! so a broken line, a missing case or a failed call must show here rather than as a hole in a
//! table.

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BENCH: &str = env!("CARGO_BIN_EXE_gateway-bench");

/// The value of `key=` in a line of `key=value` pairs.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// Runs the program with `args`, killed if it has not ended within a minute; its stdout.
fn run(args: &[&str]) -> String {
    let child = Command::new(BENCH)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gateway-bench");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(out) => out.expect("wait for gateway-bench"),
        Err(_) => {
            // SAFETY: a plain syscall on the pid of a child this test started and still owns.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
            panic!("gateway-bench {args:?} did not end within 60 s");
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gateway-bench {args:?} failed ({}): {}\n{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A small run: two callers, one worker per runtime, no warm-up, `requests` calls per case
/// (20 s is far off), with `more` flags.
fn run_small(requests: u32, more: &[&str]) -> String {
    let requests = requests.to_string();
    let mut args = vec![
        "--connections",
        "2",
        "--requests",
        &requests,
        "--seconds",
        "20",
        "--warmup-seconds",
        "0",
        "--threads",
        "1",
    ];
    args.extend_from_slice(more);
    run(&args)
}

#[test]
fn one_run_prints_a_line_per_case_with_positive_figures_and_the_ratio() {
    let out = run_small(200, &[]);
    assert!(
        !out.lines().any(|l| l.starts_with("rounds:")),
        "one round has no spread: {out}"
    );
    // By default the echo server answers inline, as the axum handler does.
    assert!(out.lines().any(|l| l == "echo: inline_first_poll"), "{out}");
    // `--threads 1` (run_small) is what the runtimes got.
    assert!(
        out.lines()
            .any(|l| l == "runtimes: 1 worker thread(s) each (echo, http, callers)"),
        "{out}"
    );
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("GATEWAY ")).collect();
    let cases: Vec<&str> = lines.iter().filter_map(|l| field(l, "case")).collect();
    assert_eq!(cases, ["axum", "gateway", "client"], "{out}");
    assert!(
        !out.lines().any(|l| l.starts_with("reference:")),
        "the references run only when asked for: {out}"
    );
    let mut rps = Vec::new();
    for line in &lines {
        for key in ["rps", "p50_us", "p99_us"] {
            let value: f64 = field(line, key)
                .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
                .parse()
                .unwrap_or_else(|e| panic!("{key}= in {line:?}: {e}"));
            assert!(
                value > 0.0 && value.is_finite(),
                "{key}={value} in {line:?}"
            );
        }
        let p50: u64 = field(line, "p50_us")
            .and_then(|v| v.parse().ok())
            .expect("p50");
        let p99: u64 = field(line, "p99_us")
            .and_then(|v| v.parse().ok())
            .expect("p99");
        assert!(p50 <= p99, "p50 above p99 in {line:?}");
        // The run is bounded by --requests (20 s is far off): exactly 200 calls per case.
        assert_eq!(field(line, "requests"), Some("200"), "{line:?}");
        rps.push(
            field(line, "rps")
                .and_then(|v| v.parse::<f64>().ok())
                .expect("rps"),
        );
    }
    let summary = out
        .lines()
        .find_map(|l| l.strip_prefix("summary: gateway/axum="))
        .unwrap_or_else(|| panic!("no summary line in {out}"));
    let ratio: f64 = summary
        .parse()
        .unwrap_or_else(|e| panic!("ratio {summary:?}: {e}"));
    // The printed ratio is the gateway's rps over axum's (rounded to 3 decimals; rps to units).
    let expected = rps[1] / rps[0];
    assert!(
        (ratio - expected).abs() <= 0.0005 + expected * 0.01,
        "ratio {ratio}, rps lines give {expected}"
    );
}

/// The references with no framework answer every call (each answer is checked by the
/// program) and print their ratios to plain axum, from their lines' requests per second.
#[test]
fn the_references_answer_each_call_and_print_their_ratio_to_axum() {
    let out = run_small(200, &["--cases", "axum,hop,mux"]);
    let rps_of = |case: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.starts_with("GATEWAY ") && field(l, "case") == Some(case))
            .unwrap_or_else(|| panic!("no line for {case} in {out}"));
        assert_eq!(field(line, "requests"), Some("200"), "{line:?}");
        field(line, "rps")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("rps of {line:?}"))
    };
    let axum = rps_of("axum");
    for case in ["hop", "mux"] {
        let prefix = format!("reference: {case}/axum=");
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("no {prefix} line in {out}"));
        let ratio: f64 = line
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("ratio in {line:?}"));
        let expected = rps_of(case) / axum;
        assert!(
            (ratio - expected).abs() <= 0.0005 + expected * 0.01,
            "{case}: ratio {ratio}, rps lines give {expected}"
        );
        // One round: its spread is the ratio itself.
        let median: f64 = field(line, "median")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("median in {line:?}"));
        assert_eq!(format!("{median:.3}"), format!("{ratio:.3}"), "{line:?}");
    }
    assert!(
        out.lines()
            .any(|l| l.starts_with("summary: gateway/axum=n/a")),
        "no gateway case, no gateway ratio: {out}"
    );
}

/// `--plain-echo-work-ns` makes the plain echo behind the references spend that long on the
/// messages it answers: the median call through `mux` then takes at least that long, and each
/// is still answered (the program checks every answer).
#[test]
fn calls_through_a_plain_echo_given_work_take_at_least_that_long() {
    let work_us = 2_000;
    let work_ns = (work_us * 1_000).to_string();
    let out = run_small(20, &["--cases", "mux", "--plain-echo-work-ns", &work_ns]);
    let line = out
        .lines()
        .find(|l| l.starts_with("GATEWAY ") && field(l, "case") == Some("mux"))
        .unwrap_or_else(|| panic!("no mux line in {out}"));
    assert_eq!(field(line, "requests"), Some("20"), "{line:?}");
    let p50: u64 = field(line, "p50_us")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("p50 of {line:?}"));
    assert!(
        p50 >= work_us,
        "a call waited on {work_us} µs of work: {line:?}"
    );
}

/// Runs the program with `args` and checks it fails, saying `expected` on standard error.
fn refused(args: &[&str], expected: &str) {
    let out = Command::new(BENCH)
        .args(args)
        .output()
        .expect("run gateway-bench");
    assert!(!out.status.success(), "{args:?} was taken");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(expected), "{args:?}: {err}");
}

#[test]
fn bad_flags_are_refused_with_what_to_give() {
    refused(&["--connections", "0"], "--connections must be at least 1");
    // The two echo modes exclude each other.
    refused(
        &["--echo-inline-first-poll", "--echo-task-per-call"],
        "cannot be used with",
    );
}

#[test]
fn rounds_sum_into_one_line_per_case_and_each_round_prints_its_ratio() {
    let out = run_small(
        100,
        &[
            "--cases",
            "axum,gateway",
            "--rounds",
            "3",
            "--echo-task-per-call",
        ],
    );
    assert!(
        out.lines()
            .any(|l| l == "echo: server defaults (a task per call)"),
        "{out}"
    );
    let rounds: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("round "))
        .collect();
    assert_eq!(rounds.len(), 3, "{out}");
    let mut ratios = Vec::new();
    for (k, line) in rounds.iter().enumerate() {
        let (number, ratio) = line.split_once(": gateway/axum=").expect(line);
        assert_eq!(number, (k + 1).to_string(), "{out}");
        let ratio: f64 = ratio.parse().expect(line);
        assert!(ratio > 0.0 && ratio.is_finite(), "{line}");
        ratios.push(ratio);
    }
    // The spread line: with three rounds the median is the middle one of the round lines.
    ratios.sort_by(f64::total_cmp);
    let spread = out
        .lines()
        .find_map(|l| l.strip_prefix("rounds: gateway/axum "))
        .unwrap_or_else(|| panic!("no rounds: line in {out}"));
    for (key, expected) in [
        ("median", ratios[1]),
        ("min", ratios[0]),
        ("max", ratios[2]),
    ] {
        let got: f64 = field(spread, key)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key}= in {spread:?}"));
        assert!(
            (got - expected).abs() < 1e-9,
            "{key}={got}, the round lines give {expected}: {out}"
        );
    }
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("GATEWAY ")).collect();
    let cases: Vec<&str> = lines.iter().filter_map(|l| field(l, "case")).collect();
    assert_eq!(cases, ["axum", "gateway"], "one line per case: {out}");
    for line in &lines {
        // Three rounds of exactly 100 calls each.
        assert_eq!(field(line, "requests"), Some("300"), "{line:?}");
    }
    refused(&["--rounds", "0"], "--rounds must be at least 1");
}
