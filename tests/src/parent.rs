//! How a test's child program knows its test ended: the test holds the child's standard input,
//! which closes when the test ends, however it ends (a pass, a failed assertion, a panic).

use std::io::Read;

/// Resolves once standard input closes (or fails); what it carries is read and dropped.
pub async fn stdin_closed() {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        let _ = tx.send(());
    });
    let _ = rx.await;
}
