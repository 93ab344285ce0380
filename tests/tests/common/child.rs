//! Waiting for a child process with a bound, shared by the tests of the programs (rpcctl's,
//! the examples'). Include it with `#[path = ".../tests/tests/common/child.rs"] mod child;`.
#![allow(dead_code)]

use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::time::Duration;

/// `child`'s exit status once it ends within `bound`; `None` if it has not (it is killed).
pub fn wait_within(mut child: Child, bound: Duration) -> Option<ExitStatus> {
    let id = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait().expect("wait"));
    });
    let status = rx.recv_timeout(bound).ok();
    if status.is_none() {
        let _ = Command::new("kill").arg(id.to_string()).status();
    }
    status
}
