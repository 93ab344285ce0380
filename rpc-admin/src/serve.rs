//! Serving the endpoint's router: an accept loop whose connections are tasks it owns.
//!
//! Why not `axum::serve`: it spawns each connection as a task of its own, which nothing
//! holds. [`AdminHandle::shutdown`](crate::AdminHandle::shutdown) gives requests in progress
//! [`SHUTDOWN_GRACE`](crate::SHUTDOWN_GRACE), then drops the serving task; a connection that
//! task did not own would outlive it: one whose peer stalls (a request whose body never comes,
//! an event stream nobody reads) kept serving, and kept the endpoint's state (its client and
//! server handles), for as long as the peer kept it open. Here every connection is in the
//! loop's [`JoinSet`], and dropping the loop ends them all. Nor does `axum::serve` give hyper
//! a timer, so hyper's limit on reading a request's head never applied: a peer sending heads a
//! byte at a time (or never finishing one) held its connection for as long as it liked, as
//! many connections as it opened; with the endpoint open to other hosts (`allow_remote`), the
//! token is checked only once a head is read.

use std::future::Future;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// Serves `router` on `listener` until `signal` completes, each request's head read within
/// `head_timeout` of the connection waiting for it; then stops accepting, lets each
/// connection finish the request it is serving (an idle one closes at once), and returns once
/// they have. Dropped before that (by the handle, once the grace has passed), it drops every
/// connection with it.
pub(crate) async fn serve(
    listener: TcpListener,
    router: axum::Router,
    head_timeout: Duration,
    signal: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(head_timeout);
    let graceful = GracefulShutdown::new();
    let service = TowerToHyperService::new(router);
    let mut connections = JoinSet::new();
    let mut signal = std::pin::pin!(signal);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            () = &mut signal => break,
        };
        match accepted {
            Ok((stream, _)) => {
                let connection =
                    graceful.watch(http.serve_connection(TokioIo::new(stream), service.clone()));
                connections.spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(error = %e, "an admin connection ended with an error");
                    }
                });
            }
            // A connection gone before it was taken: nothing to say. Anything else (the
            // process's open files at their limit) is said once, and followed by a second's
            // pause, in which connections may close, rather than a loop failing as fast as it
            // can.
            Err(e) if is_connection_error(&e) => {}
            Err(e) => {
                tracing::error!(error = %e, "the admin endpoint cannot accept a connection; it tries again in a second");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = &mut signal => break,
                }
            }
        }
    }
    drop(listener);
    graceful.shutdown().await;
    while connections.join_next().await.is_some() {}
}

/// An error of one connection, gone before `accept` took it.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}
