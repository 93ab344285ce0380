//! When a request's head starts: hyper starts its limit on reading a head as soon as it waits
//! for one, so on a keep-alive connection the limit also counts the time the connection sits
//! idle between requests, and a short limit closes idle connections under the load balancers
//! and client pools that keep them (an AWS load balancer keeps them 60 s, reqwest's pool 90 s),
//! which then meet a closed connection on their next request.
//!
//! So the gateway gives hyper, per connection, a timer whose head limit counts from the head's
//! first byte (the connection's first head: from when hyper waits for it, so that a connection
//! sending nothing goes at the head limit): the connection's stream counts the bytes read, and
//! the bytes read by the time of its last answer; while no byte has come since, the connection
//! is idle, and a watchdog of its own closes it once idle for the (longer) idle limit and with
//! no request being answered, or once an answer has waited for the client to take a byte of it
//! for the head limit. (A client that sends the start of its next head together with a
//! request, before the answer, has those bytes counted as the answer's: its head is under the
//! idle limit.) Until a later head's first byte, the head costs no timer: a request whose head
//! comes whole costs a boxed limit never registered with tokio, where hyper's own timer
//! registers one per request.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read on a connection, and how many of them had been read when it last answered.
#[derive(Default)]
pub(super) struct Progress {
    read: AtomicU64,
    answered: AtomicU64,
    written: AtomicU64,
    /// Requests the router is answering.
    calls: AtomicU64,
    /// The last write found the socket full: an answer waits for the client to take it.
    write_waits: AtomicBool,
}

impl Progress {
    /// Whether a byte of a next request has come since the last answer.
    fn begun(&self) -> bool {
        self.read.load(Ordering::Relaxed) > self.answered.load(Ordering::Relaxed)
    }

    /// Whether nothing was ever written: the connection's first request is still to come.
    fn first(&self) -> bool {
        self.written.load(Ordering::Relaxed) == 0
    }

    /// What changes whenever a byte moves either way.
    fn moved(&self) -> (u64, u64) {
        (
            self.read.load(Ordering::Relaxed),
            self.written.load(Ordering::Relaxed),
        )
    }
}

/// A connection's stream, counting into its [`Progress`].
pub(super) struct Counted<S> {
    pub(super) stream: S,
    pub(super) progress: Arc<Progress>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        let read = (buf.filled().len() - before) as u64;
        if read > 0 {
            self.progress.read.fetch_add(read, Ordering::Relaxed);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> Counted<S> {
    fn answered(&self, polled: &Poll<std::io::Result<usize>>) {
        self.progress
            .write_waits
            .store(polled.is_pending(), Ordering::Relaxed);
        if let Poll::Ready(Ok(n @ 1..)) = polled {
            let read = self.progress.read.load(Ordering::Relaxed);
            self.progress.answered.store(read, Ordering::Relaxed);
            self.progress
                .written
                .fetch_add(*n as u64, Ordering::Relaxed);
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.answered(&polled);
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.answered(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// hyper's timer for one connection: its head limit (`read`) counts from the head's first
/// byte, the connection's first head's from when hyper waits for it. Until a later head's first
/// byte, it costs no timer at all: an idle connection is the watchdog's ([`idle`]), and hyper
/// polls the limit again as the first bytes come (whenever the head it waits for is still
/// incomplete).
#[derive(Clone)]
pub(super) struct HeadTimer {
    pub(super) progress: Arc<Progress>,
    pub(super) read: Duration,
}

impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(self.now() + duration)
    }

    /// The head limit (hyper asks for nothing else of a server connection's timer): `deadline`
    /// is hyper's, `read` from now, and holds if the head has begun or is the connection's
    /// first (a connection that never sends a byte goes at the head limit, not the idle one);
    /// else `read` from its first byte.
    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        let begun = self.progress.begun() || self.progress.first();
        Box::pin(HeadSleep {
            sleep: begun.then(|| Box::pin(tokio::time::sleep_until(deadline.into()))),
            progress: self.progress.clone(),
            read: self.read,
        })
    }

    fn now(&self) -> Instant {
        tokio::time::Instant::now().into()
    }
}

/// A head's limit: none until `progress` says the head has begun, then `read` from then (or,
/// made with one, the deadline hyper gave).
struct HeadSleep {
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    progress: Arc<Progress>,
    read: Duration,
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.sleep.is_none() {
            if !self.progress.begun() {
                // Idle: the connection's readiness wakes hyper, which polls this again.
                return Poll::Pending;
            }
            let until = tokio::time::Instant::now() + self.read;
            self.sleep = Some(Box::pin(tokio::time::sleep_until(until)));
        }
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }
}

impl hyper::rt::Sleep for HeadSleep {}

/// Resolves once the connection of `progress` has been idle (no request begun or being
/// answered, no byte either way) for `idle`, or once an answer has waited for the client to
/// take a byte of it for `stall` (a client that stopped reading would otherwise hold the
/// connection, the answer's buffers and a stopping gateway until the idle limit). Checked
/// every `min(idle, stall)`, so each goes after between one and two of those checks past its
/// limit: one timer per check and connection, whatever its requests. (A request being answered
/// counts whatever the bytes say: a `100 Continue`, or the answer to the request before a
/// pipelined one, is a write made while its bytes were all read.)
pub(super) async fn idle(progress: Arc<Progress>, idle: Duration, stall: Duration) {
    let tick = idle.min(stall);
    let mut last = progress.moved();
    // How long nothing moved either way, as the checks saw it.
    let mut still = Duration::ZERO;
    loop {
        tokio::time::sleep(tick).await;
        let now = progress.moved();
        if now != last {
            last = now;
            still = Duration::ZERO;
            continue;
        }
        still = still.saturating_add(tick);
        if progress.write_waits.load(Ordering::Relaxed) && still >= stall {
            return;
        }
        let answering = progress.calls.load(Ordering::Relaxed) > 0;
        if still >= idle && !progress.begun() && !answering {
            return;
        }
    }
}

/// A connection's service, counting the requests it is answering into its [`Progress`].
pub(super) struct Calls<S> {
    pub(super) inner: S,
    pub(super) progress: Arc<Progress>,
}

impl<S: hyper::service::Service<R>, R> hyper::service::Service<R> for Calls<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = InCall<S::Future>;

    fn call(&self, request: R) -> Self::Future {
        self.progress.calls.fetch_add(1, Ordering::Relaxed);
        InCall {
            inner: self.inner.call(request),
            progress: self.progress.clone(),
        }
    }
}

pin_project_lite::pin_project! {
    /// A request being answered: counted until dropped, which hyper does as soon as its answer
    /// is ready (or with the connection).
    pub(super) struct InCall<F> {
        #[pin]
        inner: F,
        progress: Arc<Progress>,
    }

    impl<F> PinnedDrop for InCall<F> {
        fn drop(this: Pin<&mut Self>) {
            this.project().progress.calls.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<F: Future> Future for InCall<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service whose answers never come.
    struct Never;

    impl hyper::service::Service<()> for Never {
        type Response = ();
        type Error = std::convert::Infallible;
        type Future = std::future::Pending<Result<(), std::convert::Infallible>>;

        fn call(&self, (): ()) -> Self::Future {
            std::future::pending()
        }
    }

    /// A request being answered keeps its connection however long it takes, even when every
    /// byte it sent was counted as answered (a `100 Continue` was written after them); the
    /// connection is idle once the answer is no longer awaited.
    #[tokio::test(start_paused = true)]
    async fn a_request_being_answered_keeps_its_connection() {
        let period = Duration::from_secs(60);
        let progress = Arc::new(Progress::default());
        progress.read.store(100, Ordering::Relaxed);
        progress.answered.store(100, Ordering::Relaxed);
        progress.written.store(25, Ordering::Relaxed);
        let calls = Calls {
            inner: Never,
            progress: progress.clone(),
        };
        let call = hyper::service::Service::call(&calls, ());
        let idle = tokio::spawn(idle(progress, period, period));
        tokio::time::sleep(period * 10).await;
        assert!(!idle.is_finished(), "the connection was let go mid-answer");
        drop(call);
        tokio::time::timeout(period * 3, idle)
            .await
            .expect("idle once nothing is answered")
            .expect("the watchdog");
    }
}
