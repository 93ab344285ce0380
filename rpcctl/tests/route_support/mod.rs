//! Running the built `rpcctl` program from a test: arguments in, exit code and output back,
//! bounded in time.
#![allow(dead_code)]

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long one run of the program may take before the test fails.
pub const LIMIT: Duration = Duration::from_secs(20);

/// What one run printed and how it ended.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `rpcctl args...` (without the `RPCCTL_*` variables of the environment) off the runtime's
/// threads, killing it if it outlives [`LIMIT`].
pub async fn rpcctl(args: &[&str]) -> Run {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rpcctl"))
            .args(&args)
            .env_remove("RPCCTL_REGISTRY")
            .env_remove("RPCCTL_ADMIN")
            .env_remove("RPCCTL_TOKEN")
            .env_remove("RPCCTL_SERVER_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start rpcctl");
        let started = Instant::now();
        loop {
            match child.try_wait().expect("wait for rpcctl") {
                Some(_) => break,
                None if started.elapsed() > LIMIT => {
                    let _ = child.kill();
                    let out = child.wait_with_output().expect("rpcctl output");
                    panic!(
                        "rpcctl {args:?} still running after {LIMIT:?}; stderr: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        let Output {
            status,
            stdout,
            stderr,
        } = child.wait_with_output().expect("rpcctl output");
        Run {
            code: status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        }
    })
    .await
    .expect("the rpcctl runner")
}
