//! What the tests of the example programs share: a program started as a real process, its
//! standard output read line by line, and a bounded wait for a line.
#![allow(dead_code)]

#[path = "../../../tests/tests/common/child.rs"]
mod child;
#[allow(unused_imports)]
pub use child::wait_within;

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Kills the child when the test ends, however it ends.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads a child's standard output line by line on a thread of its own.
pub fn lines(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The first line starting with `prefix`, within `within`.
pub fn wait_for(rx: &mpsc::Receiver<String>, prefix: &str, within: Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => return line,
            Ok(_) => continue,
            Err(e) => panic!("no line starting with {prefix:?} within {within:?}: {e}"),
        }
    }
}

/// Starts `program` with `args`, its standard output piped to the returned lines.
pub fn spawn(program: &str, args: &[&str]) -> (Running, mpsc::Receiver<String>) {
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    let out = lines(child.stdout.take().expect("stdout"));
    (Running(child), out)
}

/// Everything `from` gives until its end, read on a thread of its own.
pub fn read_all(mut from: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = from.read_to_string(&mut text);
        let _ = tx.send(text);
    });
    rx
}
