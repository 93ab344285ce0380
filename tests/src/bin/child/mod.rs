//! What the registered child servers (`registry-server`, `etcd-server`) have in common: serving
//! `t.Who` on a free port of 127.0.0.1 through a registry, announcing the address, and living
//! exactly as long as the test that started them. Kept in one place so that the tests read the
//! same announcement, and see the same lifetime, from every child.

use std::io::Write;
use std::sync::Arc;

use rpc::{Registry, Server};
use tests::who::{Node, WhoServer};

/// Serves `t.Who` (answering `child`) on 127.0.0.1 on a free port, registered in `registry`,
/// prints `listening on <addr>`, and returns once standard input closes (the server aborted).
pub async fn serve_until_stdin_closes(
    registry: Arc<dyn Registry>,
) -> Result<(), Box<dyn std::error::Error>> {
    let server = Server::builder()
        .shared_registry(registry)
        .add_service(WhoServer::new(Node("child".into())))
        .serve("127.0.0.1:0")
        .await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.local_addr())?;
        out.flush()?;
    }
    tests::parent::stdin_closed().await;
    server.abort();
    Ok(())
}
