//! `RPC_GOVERNANCE` read from a real process environment: the `governance-env` program
//! (`tests/src/bin/governance-env.rs`) builds a client with `config_env()` and prints what it
//! resolved for each entry of `chaos.Chaos`; the test starts it with the variable set (or
//! unset, or broken) and compares with values worked out from the README's layering rules.

use std::process::{Command, Output};

/// Runs `governance-env` with `RPC_GOVERNANCE` set to `value` (removed when `None`).
fn run(value: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_governance-env"));
    match value {
        Some(v) => cmd.env("RPC_GOVERNANCE", v),
        None => cmd.env_remove("RPC_GOVERNANCE"),
    };
    cmd.output().expect("run governance-env")
}

fn lines(out: &Output) -> Vec<String> {
    assert!(
        out.status.success(),
        "governance-env failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .expect("utf-8")
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn without_the_variable_the_attributes_and_defaults_apply() {
    // Code defaults: 5000 ms, 3 retries, round robin; `read` is idempotent by its attribute,
    // `park` has `timeout_ms = 0`.
    assert_eq!(
        lines(&run(None)),
        [
            "chaos.Chaos.read timeout_ms=5000 retry_times=3 idempotent=true shunt_strategy=RoundRobin",
            "chaos.Chaos.write timeout_ms=5000 retry_times=3 idempotent=false shunt_strategy=RoundRobin",
            "chaos.Chaos.park timeout_ms=0 retry_times=3 idempotent=false shunt_strategy=RoundRobin",
        ]
    );
}

#[test]
fn the_variable_overrides_defaults_services_and_entries_with_semicolons_as_line_breaks() {
    let out = run(Some(
        "defaults.retry_times = 1; services.\"chaos.Chaos\".timeout_ms = 700; \
         entries.\"chaos.Chaos.write\".idempotent = true; \
         entries.\"chaos.Chaos.read\".shunt_strategy = \"hash\"; \
         entries.\"chaos.Chaos.read\".retry_times = 2",
    ));
    // The environment is above the method's attribute: `park`'s 0 becomes the service's 700;
    // an entry's section is above its service's and the defaults.
    assert_eq!(
        lines(&out),
        [
            "chaos.Chaos.read timeout_ms=700 retry_times=2 idempotent=true shunt_strategy=Hash",
            "chaos.Chaos.write timeout_ms=700 retry_times=1 idempotent=true shunt_strategy=RoundRobin",
            "chaos.Chaos.park timeout_ms=700 retry_times=1 idempotent=false shunt_strategy=RoundRobin",
        ]
    );
}

#[test]
fn a_broken_variable_is_a_clear_error_naming_the_variable_and_the_field() {
    for (value, field) in [
        ("defaults.timeout_ms = \"soon\"", "timeout_ms"),
        ("defaults.timeout_msec = 800", "timeout_msec"),
        ("entries.\"chaos.Chaos.read\" = [", ""),
    ] {
        let out = run(Some(value));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{value}: {err}");
        assert!(out.stdout.is_empty(), "{value}: printed options anyway");
        assert!(
            err.contains("RPC_GOVERNANCE") && err.contains(field),
            "{value}: the error does not say what is wrong: {err}"
        );
    }
}

/// A variable that is not UTF-8 is an error too, not an empty layer.
#[cfg(unix)]
#[test]
fn a_variable_that_is_not_utf8_is_a_clear_error() {
    use std::os::unix::ffi::OsStrExt;
    let out = Command::new(env!("CARGO_BIN_EXE_governance-env"))
        .env(
            "RPC_GOVERNANCE",
            std::ffi::OsStr::from_bytes(b"defaults.timeout_ms = 8\xff00"),
        )
        .output()
        .expect("run governance-env");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(out.stdout.is_empty(), "printed options anyway");
    assert!(err.contains("RPC_GOVERNANCE is not UTF-8"), "{err}");
}
