//! Serving the gateway's router on a listener: HTTP/1.1 connections, each given a limited time
//! to send a request's head, and to sit idle between requests.
//!
//! Why not `axum::serve`: it gives hyper no timer, so hyper's limit on reading a request's head
//! never applies, and a client that opens connections and sends their heads a byte at a time
//! (or never) holds them, their sockets and their buffers for as long as it likes; a gateway
//! facing browsers and the open network must not. (The body's limit is the handler's: see
//! `call`; when a head's limit starts, `head`.)
//!
//! A request for an entry goes straight to its handler ([`Dispatch`]), not through the
//! router, whose matching, boxed per-route service and extensions cost each call as much again
//! as its own lookup in the route table; the router answers the gateway's own routes.

mod head;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::call::{entry_call, OWN_PATHS};
use crate::Gateway;

/// How long a connection has to send a request's head once it has begun (and the handler its
/// body), and how long it may sit idle between requests.
#[derive(Clone, Copy)]
pub(crate) struct Limits {
    pub read: Duration,
    pub idle: Duration,
}

/// Serves `gateway` on `listener` until `signal` completes, then stops accepting and waits for
/// the connections' requests in flight (an idle connection closes at once; one still sending
/// a head or a body has at most `limits.read` more).
pub(crate) async fn serve(
    listener: TcpListener,
    gateway: Gateway,
    limits: Limits,
    signal: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.header_read_timeout(limits.read);
    let graceful = GracefulShutdown::new();
    let dispatch = Dispatch {
        router: TowerToHyperService::new(gateway.router()),
        gateway,
    };
    let signal = std::pin::pin!(signal);
    let mut signal = signal;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut signal => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tokio::select! {
                    () = accept_failed(e) => continue,
                    () = &mut signal => break,
                }
            }
        };
        let progress = Arc::new(head::Progress::default());
        let service = head::Calls {
            inner: dispatch.clone(),
            progress: progress.clone(),
        };
        let timer = head::HeadTimer {
            progress: progress.clone(),
            read: limits.read,
        };
        let idle = head::idle(progress.clone(), limits.idle, limits.read);
        let stream = TokioIo::new(head::Counted { stream, progress });
        let connection =
            graceful.watch(http.clone().timer(timer).serve_connection(stream, service));
        tokio::spawn(async move {
            tokio::select! {
                served = connection => {
                    if let Err(e) = served {
                        tracing::debug!(error = %e, "an HTTP connection ended with an error");
                    }
                }
                // Idle for its limit (with nothing in flight), or its answer not taken for the
                // read limit: closed (dropped).
                () = idle => {}
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// The gateway's requests: one for an entry to its handler, one for the gateway's own routes
/// to its router (as the router would send them: its fallback is the same handler).
#[derive(Clone)]
struct Dispatch {
    gateway: Gateway,
    router: TowerToHyperService<axum::Router>,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Dispatch {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, request: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        if OWN_PATHS.contains(&request.uri().path()) {
            Box::pin(self.router.call(request))
        } else {
            let gateway = self.gateway.clone();
            Box::pin(async move { Ok(entry_call(gateway, request).await) })
        }
    }
}

/// After a failed `accept`: nothing for an error of that one connection (it went before it
/// was taken); for any other (the process's open files at their limit: `EMFILE`), a second's
/// pause, in which connections may close, rather than a loop failing as fast as it can.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "the gateway cannot accept a connection; it tries again in a second");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use rpc_registry::{InProcessRegistry, Registry};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use crate::Gateway;

    const READ_TIMEOUT: Duration = Duration::from_secs(2);
    const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// Far past `IDLE_TIMEOUT`, on the paused clock: what a test waits at most.
    const LIMIT: Duration = Duration::from_secs(600);

    /// A gateway serving `echo.Echo.echo` (published with no server behind it: the requests
    /// below never get as far as a call) until `stop` fires; its address and serving task.
    async fn gateway(
        stop: tokio::sync::oneshot::Receiver<()>,
    ) -> (String, tokio::task::JoinHandle<std::io::Result<()>>) {
        let registry = InProcessRegistry::new();
        let instance = crate::route::test_entries::echo_instance("127.0.0.1:9");
        registry.register(instance).await.expect("register");
        let registry: Arc<dyn Registry> = Arc::new(registry);
        let gateway = Gateway::builder()
            .client(
                rpc_client::Client::builder()
                    .shared_registry(registry.clone())
                    .build(),
            )
            .registry(registry)
            .read_timeout(READ_TIMEOUT)
            .idle_timeout(IDLE_TIMEOUT)
            .build()
            .await
            .expect("build");
        assert_eq!(gateway.entries().len(), 1, "echo.Echo.echo served");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let serving = tokio::spawn(gateway.serve_with_shutdown(listener, async {
            let _ = stop.await;
        }));
        (addr, serving)
    }

    /// Waits for `serving` to end, well.
    async fn stopped(serving: tokio::task::JoinHandle<std::io::Result<()>>) {
        tokio::time::timeout(LIMIT, serving)
            .await
            .expect("serving ends")
            .expect("the task")
            .expect("served");
    }

    /// What the gateway sends on `stream` until it closes it.
    async fn all_of(stream: &mut TcpStream) -> String {
        let mut answer = Vec::new();
        tokio::time::timeout(LIMIT, stream.read_to_end(&mut answer))
            .await
            .expect("the gateway closes the connection")
            .expect("read");
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// A client that never finishes its request's head is cut off once the read timeout has
    /// passed, with nothing sent: it cannot hold the connection. Before, it held it for ever.
    #[tokio::test(start_paused = true)]
    async fn a_head_not_sent_in_time_closes_the_connection() {
        let (_stop, stop) = tokio::sync::oneshot::channel();
        let (addr, _serving) = gateway(stop).await;
        let mut stream = TcpStream::connect(&addr).await.expect("connect");
        let started = tokio::time::Instant::now();
        stream
            .write_all(b"POST /api/echo.Echo/echo HTTP/1.1\r\nHost: gw\r\n")
            .await
            .expect("write");
        let answer = all_of(&mut stream).await;
        assert!(!answer.contains("200"), "{answer}");
        // At the read timeout (hyper's head timer), well before the idle one.
        let took = started.elapsed();
        assert!(took >= READ_TIMEOUT && took <= 2 * READ_TIMEOUT, "{took:?}");
        assert!(took < IDLE_TIMEOUT);
    }

    /// A keep-alive connection sitting idle between requests is not held to the head's limit,
    /// which counts from a head's first byte: it serves its next request after longer than
    /// that, and is closed once idle for the idle limit. Before, hyper counted the idle time
    /// against the head's limit and closed it.
    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_outlives_the_read_timeout_until_the_idle_timeout() {
        let (_stop, stop) = tokio::sync::oneshot::channel();
        let (addr, _serving) = gateway(stop).await;
        let mut stream = TcpStream::connect(&addr).await.expect("connect");
        let ask = async |stream: &mut TcpStream| {
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
                .await
                .expect("write");
            let mut answer = Vec::new();
            while !answer.ends_with(b"ok") {
                let mut chunk = [0u8; 512];
                let n = tokio::time::timeout(LIMIT, stream.read(&mut chunk))
                    .await
                    .expect("an answer")
                    .expect("read");
                assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
                answer.extend_from_slice(&chunk[..n]);
            }
            assert!(answer.starts_with(b"HTTP/1.1 200"));
        };
        ask(&mut stream).await;
        tokio::time::sleep(READ_TIMEOUT * 5).await;
        ask(&mut stream).await;
        let idle = tokio::time::Instant::now();
        let rest = all_of(&mut stream).await;
        assert!(rest.is_empty(), "{rest}");
        assert!(idle.elapsed() >= IDLE_TIMEOUT, "{:?}", idle.elapsed());
    }

    /// A connection that never sends a byte goes at the head's limit, not the idle one.
    #[tokio::test(start_paused = true)]
    async fn a_connection_sending_nothing_goes_at_the_read_timeout() {
        let (_stop, stop) = tokio::sync::oneshot::channel();
        let (addr, _serving) = gateway(stop).await;
        let mut stream = TcpStream::connect(&addr).await.expect("connect");
        let started = tokio::time::Instant::now();
        let answer = all_of(&mut stream).await;
        assert!(answer.is_empty(), "{answer}");
        let waited = started.elapsed();
        assert!(
            waited >= READ_TIMEOUT && waited < IDLE_TIMEOUT,
            "closed after {waited:?}"
        );
    }

    /// A body not sent in time is answered 408, saying so.
    #[tokio::test(start_paused = true)]
    async fn a_body_not_sent_in_time_is_answered_408() {
        let (_stop, stop) = tokio::sync::oneshot::channel();
        let (addr, _serving) = gateway(stop).await;
        let mut stream = TcpStream::connect(&addr).await.expect("connect");
        stream
            .write_all(
                b"POST /api/echo.Echo/echo HTTP/1.1\r\nHost: gw\r\nContent-Length: 40\r\n\r\n{\"te",
            )
            .await
            .expect("write");
        let answer = all_of(&mut stream).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("not sent within"), "{answer}");
    }

    /// A client that stops taking its answers (here pipelined requests for the docs page, read
    /// through a small receive buffer, then never read) does not hold its connection, nor a
    /// stopping gateway, until the idle timeout: the answer waiting on a full socket is given
    /// up after the read timeout. Before, serving ended only with the idle limit.
    #[tokio::test(start_paused = true)]
    async fn a_client_not_taking_its_answers_is_let_go_after_the_read_timeout() {
        const REQUESTS: usize = 2000;
        let (stop_tx, stop) = tokio::sync::oneshot::channel();
        let (addr, serving) = gateway(stop).await;
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        let stream = socket
            .connect(addr.parse().expect("address"))
            .await
            .expect("connect");
        let (mut read, mut write) = stream.into_split();
        let requests = b"GET /docs HTTP/1.1\r\nHost: gw\r\n\r\n".repeat(REQUESTS);
        // Written beside: once the gateway's answers fill the socket it reads no more requests.
        let writing = tokio::spawn(async move {
            let _ = write.write_all(&requests).await;
            write
        });
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        let _ = stop_tx.send(());
        stopped(serving).await;
        assert!(
            started.elapsed() < IDLE_TIMEOUT,
            "serving ended after {:?}",
            started.elapsed()
        );
        // The connection was given up with answers left unwritten.
        let mut taken = Vec::new();
        let _ = read.read_to_end(&mut taken).await;
        let answers = String::from_utf8_lossy(&taken)
            .matches("HTTP/1.1 200")
            .count();
        assert!(answers < REQUESTS, "{answers} answers: all were taken");
        writing.abort();
    }

    /// A stopping gateway does not wait for ever for a client that never finishes its request:
    /// serving ends once its read timeout has passed.
    #[tokio::test(start_paused = true)]
    async fn stopping_waits_for_a_slow_client_no_longer_than_the_read_timeout() {
        let (stop_tx, stop) = tokio::sync::oneshot::channel();
        let (addr, serving) = gateway(stop).await;
        let mut stream = TcpStream::connect(&addr).await.expect("connect");
        stream
            .write_all(b"POST /api/echo.Echo/echo HTTP/1.1\r\nHost: gw\r\n")
            .await
            .expect("write");
        // The head is being read when the gateway is told to stop.
        tokio::task::yield_now().await;
        let asked = tokio::time::Instant::now();
        let _ = stop_tx.send(());
        stopped(serving).await;
        // By the read timeout (hyper's head timer), not the idle one.
        let took = asked.elapsed();
        assert!(took <= 2 * READ_TIMEOUT, "{took:?}");
    }
}
