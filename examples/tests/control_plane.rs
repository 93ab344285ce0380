//! The demo's control-plane section, run as a real process: over a real etcd it prints the share
//! of calls the canary answered under a 95/5 routing rule, within a binomial band around 5 %,
//! and a governance rule written from the command line (`rpcctl`, or the `RuleStore` call it
//! makes when it is not built beside the demo) turns the next calls into timeouts on the running
//! client; on the embedded registry the section is one line saying what it needs.
//!
//! The expected values come from elsewhere than the demo: the band from the binomial law, the
//! version written from the rule store's own history in etcd, which path wrote it from whether
//! `rpcctl` sits beside the demo's executable.

#[cfg(feature = "etcd")]
#[path = "../../tests/tests/common/etcd.rs"]
mod etcd_harness;

mod support;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::spawn;

/// How long the whole demo may take (it needs about 3 s; a debug build on a busy machine more).
const DEMO_WITHIN: Duration = Duration::from_secs(120);

/// Runs the demo with `args` to its end; its standard output, line by line. Panics with what it
/// printed if it does not end within [`DEMO_WITHIN`] or ends with a failure.
fn run_demo(args: &[&str]) -> Vec<String> {
    let (mut child, rx) = spawn(env!("CARGO_BIN_EXE_demo"), args);
    let deadline = Instant::now() + DEMO_WITHIN;
    let mut lines = Vec::new();
    // Until standard output closes (the demo ended), bounded in time.
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => lines.push(line),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!(
                    "the demo did not end within {DEMO_WITHIN:?}; it printed:\n{}",
                    lines.join("\n")
                );
            }
        }
    }
    let status = child.0.wait().expect("wait for the demo");
    assert!(status.success(), "demo: {status}:\n{}", lines.join("\n"));
    lines
}

/// The one line containing `needle`.
fn line<'a>(lines: &'a [String], needle: &str) -> &'a str {
    let found: Vec<&String> = lines.iter().filter(|l| l.contains(needle)).collect();
    assert_eq!(
        found.len(),
        1,
        "one line with {needle:?} expected:\n{}",
        lines.join("\n")
    );
    found[0]
}

/// The number right after `after` in `line`.
#[cfg(feature = "etcd")]
fn number_after(line: &str, after: &str) -> i64 {
    let rest = &line[line
        .find(after)
        .unwrap_or_else(|| panic!("{after:?} in {line:?}"))
        + after.len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|e| panic!("a number after {after:?} in {line:?}: {e}"))
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_etcd_the_canary_gets_its_share_and_a_rule_set_from_the_cli_times_out_the_next_calls()
{
    use rpc::{EtcdRegistry, RuleKind};

    let etcd = etcd_harness::Etcd::start().await;
    let url = etcd.url();
    let lines = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || run_demo(&["--registry", &url]))
            .await
            .expect("the demo's run")
    };
    let all = lines.join("\n");
    line(
        &lines,
        "== control plane: rules in etcd steer a running client ==",
    );

    // (a) The split, from the servers' own answers: Binomial(n, 0.05), within 4 standard
    // deviations (a false alarm about once in 16 000 runs).
    let share = line(&lines, "canary share: ");
    let n = number_after(share, "% of ");
    assert!(
        share.contains(&format!("% of {n} calls (rule 95/5, version ")),
        "{share}"
    );
    let answered = line(&lines, "answered by {");
    let canary = number_after(answered, "\"canary\": ");
    let stable =
        number_after(answered, "\"stable-1\": ") + number_after(answered, "\"stable-2\": ");
    assert!(answered.ends_with(", 0 failed"), "{answered}");
    assert_eq!(canary + stable, n, "every call answered once: {answered}");
    let (mean, sd) = (n as f64 * 0.05, (n as f64 * 0.05 * 0.95).sqrt());
    assert!(
        (canary as f64 - mean).abs() <= 4.0 * sd,
        "canary answered {canary} of {n} calls; expected {mean} ± {:.1}:\n{all}",
        4.0 * sd
    );
    // The printed share is that count.
    let percent = format!("{:.1} %", 100.0 * canary as f64 / n as f64);
    assert!(
        share.contains(&format!("canary share: {percent} of {n}")),
        "{share}"
    );

    // (b) The governance rule written from the command line, by the path the demo had.
    let rpcctl = std::path::Path::new(env!("CARGO_BIN_EXE_demo"))
        .with_file_name(format!("rpcctl{}", std::env::consts::EXE_SUFFIX));
    let written = line(&lines, "  written by ");
    if rpcctl.is_file() {
        assert!(
            written.starts_with("  written by rpcctl (")
                && written.contains(" rules set governance "),
            "rpcctl is beside the demo, at {}: {written}",
            rpcctl.display()
        );
    } else {
        assert!(
            written.starts_with("  written by RuleStore::put, ")
                && written.contains("rpcctl is not built beside the demo"),
            "no rpcctl at {}: {written}",
            rpcctl.display()
        );
    }
    let cut = number_after(written, "governance version ");
    // etcd's own history holds that version, with the 30 ms deadline.
    let store = EtcdRegistry::from_url(&url)
        .await
        .expect("registry")
        .rules();
    let history = store.history(RuleKind::Governance).await.expect("history");
    let kept = history
        .iter()
        .find(|v| v.version == cut)
        .unwrap_or_else(|| panic!("version {cut} not in the history: {history:?}"));
    assert!(
        kept.text.lines().any(|l| l.trim() == "timeout_ms = 30"),
        "{}",
        kept.text
    );

    let before = line(&lines, "lookup x5 before, governance version ");
    let after = line(&lines, "lookup x5 after,  governance version ");
    // The deadline the client had in force, and what it did to 5 calls its server holds 100 ms.
    assert!(
        before.contains("(timeout_ms = 1000, the server takes 100 ms): 5 ok, 0 timed out"),
        "{before}"
    );
    assert!(
        after.contains("(timeout_ms = 30, the server takes 100 ms): 0 ok, 5 timed out"),
        "{after}"
    );
    let applied_before = number_after(before, "governance version ");
    assert!(applied_before < cut, "{before} / {written}");
    assert_eq!(number_after(after, "governance version "), cut, "{after}");
    line(
        &lines,
        &format!("the running client applied governance version {cut} (rule_applied)"),
    );

    // The section put back what was in force before it: nothing of its own stays.
    for kind in RuleKind::ALL {
        let now = store.get(kind).await.expect("get").expect("a document");
        assert!(!now.text.contains("demo.Catalog"), "{kind}: {}", now.text);
    }
}

#[test]
fn on_the_embedded_registry_the_control_plane_section_says_it_needs_etcd() {
    let lines = run_demo(&[]);
    let said = line(&lines, "== control plane: ");
    assert!(
        said.contains("needs --registry etcd://HOST:PORT") && said.contains("etcd --data-dir"),
        "{said}"
    );
    // Nothing of the section ran.
    assert!(!lines.iter().any(|l| l.contains("canary share")));
}
