//! A server registered in etcd, run as a separate process by the etcd test
//! (`tests/tests/integration/etcd.rs`) so that the test can kill it with SIGKILL and watch its entry expire
//! with its lease.
//!
//! ```text
//! etcd-server etcd://127.0.0.1:<port> <lease seconds>
//! ```
//! Serves `t.Who` (answering `child`) on 127.0.0.1 on a free port, registered in that etcd under
//! a lease of the given length, prints `listening on <addr>`, and exits when its standard input
//! closes, so that it never outlives the test that started it.

use std::sync::Arc;
use std::time::Duration;

use rpc::{EtcdOptions, EtcdRegistry};

mod child;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: etcd-server etcd://host:port <lease seconds>";
    let url = args.next().ok_or(usage)?;
    let lease: u64 = args.next().ok_or(usage)?.parse()?;
    let registry = EtcdRegistry::from_url_with_options(
        &url,
        EtcdOptions {
            lease_ttl: Duration::from_secs(lease),
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            ..EtcdOptions::default()
        },
    )
    .await?;
    child::serve_until_stdin_closes(Arc::new(registry)).await
}
