//! Streaming calls from the client: the stream's set-up passes the entry's governance as a
//! unary call does (user layers, fallback, breaker, timeout, retry and failover act on it), and
//! its items then come straight from the connection.
//!
//! The set-up is the call, as far as governance sees: it succeeds when the server accepts the
//! stream, and only then do items flow, so a retry (or a failover) can only ever happen before
//! the first item: no item already delivered is delivered again. A set-up that fails counts
//! in the entry's circuit breaker as a failed unary call does, and an open breaker refuses the
//! set-up ([`StatusCode::CircuitOpen`]). A failure after acceptance (the server dying, its
//! error item, the deadline) ends that stream only: it is not held against the breaker, which
//! judges whether the entry can be called, not how long-lived streams end.
//!
//! A fallback registered for the service ([`ClientBuilder::fallback`]) answers a stream whose
//! set-up failed for the same failures as a unary call's fallback (transport, timeout,
//! overflow, open breaker, server error; never a business, validation or authentication
//! answer) with a stream of its own: the caller's items, none of which was sent yet, go to
//! it. Once the server accepted a stream no fallback runs. Hedging does not apply to streams:
//! a hedge would open the stream twice.
//!
//! The call's span (`rpc.client`) and its metrics cover the whole stream, from the set-up to
//! the end: its end status, the items each way and its duration. Client layers see the set-up
//! as the call and its end through [`CallCx::on_stream_end`].
//!
//! The entry's compression applies to the set-up's arguments and to each of the caller's
//! items (of at least the entry's threshold, with an algorithm the connection's server accepts).
//!
//! [`ClientBuilder::fallback`]: crate::ClientBuilder::fallback

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::future::Either;
use futures_util::FutureExt as _;
use futures_util::Stream;
use rpc_core::{
    ByteStream, Compression, GovernanceOptions, ItemSource, LentItem, MethodDescriptor, RpcError,
    RpcStream, StatusCode, StreamMode,
};
use rpc_governance::events::EventKind;
use rpc_governance::fallback::{self, Side};
use rpc_governance::stack::{self, CallCx, Layered, Service as _};
use rpc_transport::{compression, Call, ClientStream, Opened, StreamSender};
use tracing::Instrument;

use crate::client::{into_result, Client, ClientBalance};
use crate::telemetry::{self, StreamWatch};

impl Client {
    /// Opens a server stream of `method` with its other arguments already encoded by
    /// [`codec`](Self::codec), and returns its encoded items once the server accepted it.
    ///
    /// The set-up passes the entry's governance as [`invoke`](Self::invoke) does (user layers,
    /// fallback, circuit breaker, timeout, retry and failover, per-attempt layers), without
    /// hedging; a set-up that fails is retried or fails over only before the server accepted
    /// the stream, so no item is ever delivered twice, and a registered fallback answers a
    /// set-up that failed with its own stream. The entry's timeout covers the whole
    /// stream: when it passes, the stream ends with a [`StatusCode::Timeout`] item after the
    /// items that arrived, and the server is told to stop. A failure mid-stream ends it with
    /// an error item (the server's own error, typed as for a unary call, or a connection
    /// failure saying how many items arrived). Dropping the stream tells the server to stop.
    ///
    /// An instance whose server does not stream (an older one) is sent nothing: the set-up
    /// moves on to an untried instance at once (within `retry_times`), and fails with
    /// [`StatusCode::NotImplemented`] when none is left, naming the instances tried. A client
    /// whose `ConnectOptions::streams` is off fails so at once.
    pub async fn invoke_stream<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        hash_key: Option<H>,
    ) -> Result<ByteStream, RpcError> {
        let open = self
            .open_stream(method, params, hash_key, StreamMode::Server, None)
            .await?;
        Ok(open.into_items())
    }

    /// Calls a client-streaming `method`: opens the stream with its other arguments already
    /// encoded by [`codec`](Self::codec), sends the encoded `items` and returns the encoded
    /// answer.
    ///
    /// The set-up passes the entry's governance as for
    /// [`invoke_stream`](Self::invoke_stream): it may be retried or fail over, and since no
    /// item is sent before the server accepted the stream, `items` is never asked for an item
    /// twice (a fallback answering a failed set-up takes `items` whole). Items are taken from
    /// `items` only while the server has granted credit for them, so a server that takes them
    /// slowly slows the producer down instead of filling memory. An error item of `items` ends
    /// the call, the server told so; a server that ends the stream early (its error, the
    /// deadline, a failure) ends it with that error.
    pub async fn invoke_client_stream<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        items: ByteStream,
        hash_key: Option<H>,
    ) -> Result<Bytes, RpcError> {
        use futures_util::StreamExt;
        let mut open = self
            .open_stream(method, params, hash_key, StreamMode::Client, Some(items))
            .await?;
        if let (Some((sender, pack)), Some(mut items)) = (open.sender(), open.inbound.take()) {
            // An error of the caller's stream ends the call (dropping the stream tells the
            // server).
            if let Err(e) = send_all(&sender, &mut items, &open.sent, pack).await {
                open.watch.finish(Err(&e));
                return Err(e);
            }
        }
        let mut answer = open.into_watched();
        answer.needs_answer = Some(method.entry_id);
        let result = match answer.next().await {
            Some(Ok(answer)) => Ok(answer),
            Some(Err(e)) => Err(e),
            None => unreachable!("a stream that needs an answer ends with one or an error"),
        };
        // The answer is the stream's last item: its arrival ends the call.
        if result.is_ok() {
            answer.watch.finish(Ok(()));
        }
        result
    }

    /// Calls a bidirectional streaming `method`: opens the stream with its other arguments
    /// already encoded by [`codec`](Self::codec), sends the encoded `items` from a task of
    /// their own while the answer's items are read, and returns those.
    ///
    /// The set-up passes the entry's governance as for
    /// [`invoke_stream`](Self::invoke_stream). Each side's items flow within the other
    /// side's credit: `items` is asked for an item only when the server can take it, and the
    /// server's producer stops when the answer is not read. An error item of `items` ends the
    /// stream with that error once the handler has read it (or dropped its request stream)
    /// and has no more answers ready; a handler that holds its request stream unread never
    /// sees it. Dropping the answer stream stops both directions.
    pub async fn invoke_bidi<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        items: ByteStream,
        hash_key: Option<H>,
    ) -> Result<ByteStream, RpcError> {
        let mut open = self
            .open_stream(method, params, hash_key, StreamMode::Bidi, Some(items))
            .await?;
        if let (Some((sender, pack)), Some(mut items)) = (open.sender(), open.inbound.take()) {
            let sent = open.sent.clone();
            let sending = async move {
                // (An error of `items` was sent as the stream's end: the reader gets it back.)
                let sending = AssertUnwindSafe(send_all(&sender, &mut items, &sent, pack));
                if sending.catch_unwind().await.is_err() {
                    // The caller's items (or their encoding) panicked: the request stream ends
                    // with an error rather than never, and the server's handler with it.
                    sender.finish(Err(RpcError::new(
                        StatusCode::FrameworkError,
                        "the caller's request stream panicked while it was read; the stream was \
                         ended",
                    )));
                }
            };
            // The items are taken in the caller's context, as a client stream's are in the
            // caller's own task: its attachments and retry depth, the deadline it inherited
            // from a call it serves, its span (calls made to produce the items carry them).
            let sending = rpc_governance::timeout::with_inherited(
                rpc_governance::timeout::inherited(),
                sending,
            );
            let sending = rpc_core::RpcContext::scope_served(
                rpc_core::RpcContext::current_attachments(),
                rpc_core::RpcContext::retry_depth(),
                sending,
            );
            // And its OpenTelemetry context: a server's handler runs in the trace of the call it
            // serves (its own span maybe kept from OpenTelemetry by a filter).
            #[cfg(feature = "otel")]
            let sending = opentelemetry::trace::FutureExt::with_context(
                sending,
                opentelemetry::Context::current(),
            );
            tokio::spawn(sending.instrument(tracing::Span::current()));
        }
        Ok(open.into_items())
    }

    /// Opens a stream of `mode` through the entry's governance; see
    /// [`invoke_stream`](Self::invoke_stream). `inbound` (the caller's items, for a stream
    /// taking them) goes to a fallback if one answers the set-up, and back to the caller
    /// otherwise.
    async fn open_stream<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        hash_key: Option<H>,
        mode: StreamMode,
        inbound: Option<ByteStream>,
    ) -> Result<OpenStream, RpcError> {
        let governance = &self.inner.governance;
        let policy = governance.policy(method);
        // As for a unary call: what the service's instances publish is a level of the first
        // stream's options too, and finding them counts against its deadline (and is seen in
        // its span).
        let span = telemetry::stream_span(method);
        let call_id = telemetry::call_id(&span);
        let started = match policy.service_known() {
            true => {
                // As a unary call of an appointed entry whose lookup failed: ask again.
                if policy.wants_lookup_again() {
                    self.look_up_in_background(method, &policy);
                }
                None
            }
            false => Some(self.learn_service(method, &policy, &span).await),
        };
        let mut options = match &self.call_options {
            None => policy.options(),
            Some(o) => Arc::new(o.applied(&policy.options())),
        };
        if options.hedge_delay_ms != 0 || options.hedge_percentile != 0 {
            // A hedge would open the stream twice.
            options = Arc::new(GovernanceOptions {
                hedge_delay_ms: 0,
                hedge_percentile: 0,
                ..(*options).clone()
            });
        }
        let (hash_key, misconfigured) = self.hash_or_refusal(method, &options, hash_key);
        let call_span = span.clone();
        let opened = Mutex::new(None);
        let inbound = Mutex::new(inbound);
        let cause = Mutex::new(None);
        let sent = Arc::new(AtomicU64::new(0));
        let set_up_at = tokio::time::Instant::now();
        let call = async {
            let deadline = || match started {
                Some(at) => rpc_governance::timeout::deadline_from(at, &options),
                None => rpc_governance::timeout::deadline(&options),
            };
            let watch = telemetry::CallWatch::new(
                call_span,
                self.inner.metrics.start_at(method, started),
                deadline,
                &self.inner.calls,
                (method.entry_id, started),
            );
            // Refused before any attempt, and counted as a call all the same.
            if let Some(e) = misconfigured {
                watch.finish(&Err(e.clone()), None);
                return Err(e);
            }
            let mut cx = CallCx::new(governance, policy, options.clone())
                .with_hash_key(hash_key)
                .with_call_id(call_id);
            if let Some(at) = started {
                cx = cx.with_started(at);
            }
            let governed = stack::governed(
                ClientBalance { client: self },
                &self.inner.attempt_layers,
                OpenAttempt {
                    client: self,
                    opened: &opened,
                    mode,
                },
            );
            let stack = Layered::new(
                &self.inner.layers,
                StreamFallback {
                    client: self,
                    inner: governed,
                    opened: &opened,
                    inbound: &inbound,
                    cause: &cause,
                    sent: &sent,
                },
            );
            let result = stack.call(&mut cx, params).await;
            match result {
                Ok(_) => {
                    let cause = take(&cause);
                    // Set up (a fallback's cause set): the fallback answers it.
                    if cause.is_some() {
                        crate::answered_by::record("fallback");
                    }
                    Ok(watch.into_stream(
                        sent.clone(),
                        cause,
                        (cx.take_stream_end_hooks(), cx.deadline()),
                        set_up_at,
                    ))
                }
                Err(e) => {
                    // (A fallback that ran and failed: its cause stays on the span.)
                    watch.finish(&Err(e.clone()), take(&cause).as_ref());
                    Err(e)
                }
            }
        };
        let watch = if span.is_disabled() {
            Either::Left(call)
        } else {
            Either::Right(call.instrument(span))
        }
        .await?;
        let Some(stream) = take(&opened) else {
            let e = RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "{}: the stream's set-up succeeded without a stream (a client layer \
                     answered it?); streams must reach the server",
                    method.entry_id
                ),
            );
            // Recorded as the error the caller gets, not as a stream its caller dropped.
            let mut watch = watch;
            watch.finish(Err(&e));
            return Err(e);
        };
        Ok(OpenStream {
            stream,
            inbound: take(&inbound),
            sent,
            watch,
        })
    }
}

/// What is in a mutex, taken out.
fn take<T>(cell: &Mutex<Option<T>>) -> Option<T> {
    cell.lock().unwrap_or_else(PoisonError::into_inner).take()
}

/// Where a stream's items come from once its set-up succeeded.
enum Source {
    /// The server accepted it; the caller's items are compressed with the algorithm and
    /// of at least the threshold given, when there are (the server accepts the algorithm).
    Remote(ClientStream, Option<ItemPack>),
    /// A fallback answered its failed set-up.
    Fallback(ByteStream),
}

/// A stream whose set-up succeeded, with what its caller still holds.
struct OpenStream {
    stream: Source,
    /// The caller's items, when the server (not a fallback) took the stream.
    inbound: Option<ByteStream>,
    /// The caller's items sent so far.
    sent: Arc<AtomicU64>,
    watch: StreamWatch,
}

impl OpenStream {
    /// What sends the caller's items to the server; `None` for a fallback's stream.
    fn sender(&self) -> Option<(StreamSender, Option<ItemPack>)> {
        match &self.stream {
            Source::Remote(s, pack) => Some((s.sender(), *pack)),
            Source::Fallback(_) => None,
        }
    }

    /// The stream's items, watched until it ends; lent from the frames they came in, so the
    /// caller's stream decodes them in place.
    fn into_items(self) -> ByteStream {
        RpcStream::lending(self.into_watched())
    }

    fn into_watched(self) -> Watched {
        let items = match self.stream {
            Source::Remote(s, _) => Items::Remote(s),
            Source::Fallback(s) => Items::Fallback(s),
        };
        Watched {
            items,
            watch: self.watch,
            fallback_item: Bytes::new(),
            needs_answer: None,
            answered: false,
        }
    }
}

/// A stream's items, counted as they arrive; its end (or its drop) ends the call's watch.
struct Watched {
    items: Items,
    watch: StreamWatch,
    /// A fallback's stream's item, lent.
    fallback_item: Bytes,
    /// A client stream's entry: its stream must end with an answer (an item); completed
    /// without one, it ends with an error instead, recorded as such.
    needs_answer: Option<&'static str>,
    /// An item arrived.
    answered: bool,
}

/// Where a watched stream's items come from: the connection's stream polled directly (no
/// boxed layer between it and the caller's stream, per item), or a fallback's stream.
enum Items {
    Remote(ClientStream),
    Fallback(ByteStream),
}

impl ItemSource for Watched {
    /// An item its consumer could not decode ends the stream: the server is told to stop
    /// (for a remote stream), and the stream is recorded as ended with that error.
    fn fail(&mut self, error: &RpcError) {
        if let Items::Remote(s) = &mut self.items {
            s.fail(error);
        }
        self.watch.finish(Err(error));
    }

    fn poll_lend(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<LentItem<'_>, RpcError>>> {
        let next = match &mut self.items {
            Items::Remote(s) => s.poll_lend(cx),
            Items::Fallback(s) => match Pin::new(s).poll_next(cx) {
                Poll::Ready(Some(Ok(item))) => {
                    self.fallback_item = item;
                    Poll::Ready(Some(Ok(LentItem::whole(&self.fallback_item))))
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        };
        let next = match next {
            Poll::Ready(None) if !self.answered => match self.needs_answer.take() {
                Some(entry) => Poll::Ready(Some(Err(RpcError::new(
                    StatusCode::FrameworkError,
                    format!(
                        "{entry}: the server completed the stream without an answer; is the \
                         method client-streaming on the server too?"
                    ),
                )))),
                None => Poll::Ready(None),
            },
            other => other,
        };
        match &next {
            Poll::Ready(Some(Ok(_))) => {
                self.answered = true;
                self.watch.received();
            }
            Poll::Ready(Some(Err(e))) => self.watch.finish(Err(e)),
            Poll::Ready(None) => self.watch.finish(Ok(())),
            Poll::Pending => {}
        }
        next
    }
}

impl Stream for Watched {
    type Item = Result<Bytes, RpcError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        LentItem::owned(self.get_mut().poll_lend(cx))
    }
}

/// The fallback of a stream's set-up: when the governed set-up fails with a failure a
/// fallback answers for, the fallback registered for the service opens a stream of its own
/// (taking the caller's items); never once the server accepted the stream, since the set-up
/// then succeeded.
struct StreamFallback<'c, S> {
    client: &'c Client,
    inner: S,
    opened: &'c Mutex<Option<Source>>,
    inbound: &'c Mutex<Option<ByteStream>>,
    /// The failure the fallback answered for, once it did.
    cause: &'c Mutex<Option<RpcError>>,
    /// The caller's items taken so far, the fallback's among them.
    sent: &'c Arc<AtomicU64>,
}

impl<S: stack::Service> stack::Service for StreamFallback<'_, S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let method = cx.method();
        let Some(fallback) = self.client.inner.fallbacks.get(method.service_id) else {
            return self.inner.call(cx, req).await;
        };
        let e = match self.inner.call(cx, req.clone()).await {
            Err(e) if fallback::applies(&e, Side::Client) => e,
            other => return other,
        };
        // A fallback without this entry (one older than the entry) does not run, and no
        // `fallback` is said of the stream, as for a unary call.
        let Some(index) = fallback
            .methods()
            .iter()
            .position(|m| m.entry_id == method.entry_id)
        else {
            return Err(e);
        };
        // (As the unary fallback names them: see `CallCx::failure`.)
        let (endpoint, attempt) = cx.failure(&e);
        let endpoint = endpoint.as_deref();
        // Inside a handler whose caller's deadline has passed, nobody would read the
        // fallback's stream: it does not start.
        if rpc_governance::timeout::inherited_passed() {
            cx.emit(
                EventKind::FallbackSkipped,
                endpoint,
                attempt,
                Some(e.to_string()),
            );
            return Err(rpc_governance::timeout::fallback_skipped(
                method.entry_id,
                &e,
            ));
        }
        cx.emit(EventKind::Fallback, endpoint, attempt, Some(e.to_string()));
        // The cause goes on the stream's span whether the fallback answers or fails.
        *self.cause.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.clone());
        // Counted as they go to the fallback, as they would have been sent to a server.
        let items = take(self.inbound).map(|items| {
            let sent = self.sent.clone();
            RpcStream::try_new(futures_util::StreamExt::inspect(items, move |item| {
                if item.is_ok() {
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            }))
        });
        let setup = fallback.call_stream(index, req, items, self.client.inner.codec);
        let answer = fallback::with_cause(e.clone(), setup).await;
        let stream = fallback::outcome(method.entry_id, e, answer)?;
        *self.opened.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Source::Fallback(stream));
        Ok(Bytes::new())
    }
}

/// Sends `items` on a stream that takes the client's items, each only once the server has
/// granted credit for it, then the end of the request stream; stops when the stream ended.
/// An error item of `items` is sent as the request stream's end and returned.
async fn send_all(
    sender: &StreamSender,
    items: &mut ByteStream,
    sent: &AtomicU64,
    pack: Option<ItemPack>,
) -> Result<(), RpcError> {
    loop {
        // No credit, no item taken: the producer waits for the server.
        if !sender.ready().await {
            return Ok(());
        }
        let next = tokio::select! {
            next = items.next() => next,
            // The stream ended first (the server's end, or its reader gave up).
            () = sender.ended() => return Ok(()),
        };
        match next {
            Some(Ok(item)) => {
                let (item, compression) = match pack {
                    None => (item, 0),
                    Some(pack) => pack.apply(item),
                };
                match sender.send_packed(item, compression) {
                    Ok(()) => {}
                    // An item the server would not read (over its frame limit), refused
                    // unsent: the request stream ends with that error.
                    Err(e) if e.code() == StatusCode::ValidateError => {
                        sender.finish(Err(e.clone()));
                        return Err(e);
                    }
                    // The stream or its connection ended: nothing more goes out.
                    Err(_) => return Ok(()),
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
            Some(Err(e)) => {
                sender.finish(Err(e.clone()));
                return Err(e);
            }
            None => {
                sender.finish(Ok(()));
                return Ok(());
            }
        }
    }
}

/// How the caller's items of a stream are compressed: with the entry's algorithm (one the
/// connection's server accepts), each item of at least the entry's threshold that shrinks.
#[derive(Debug, Clone, Copy)]
struct ItemPack {
    algorithm: Compression,
    threshold: usize,
}

impl ItemPack {
    /// The packing of the entry's `options` towards a server accepting `accepts`; `None`
    /// when compression is off or the server does not decode the algorithm.
    fn of(options: &GovernanceOptions, accepts: compression::Accepted) -> Option<ItemPack> {
        let algorithm = options.compression;
        accepts.contains(algorithm).then_some(ItemPack {
            algorithm,
            threshold: options.compression_threshold as usize,
        })
    }

    /// `item` compressed, with its algorithm's wire number, or as it is with 0.
    fn apply(self, item: Bytes) -> (Bytes, i32) {
        match compression::pack(
            self.algorithm,
            self.threshold,
            compression::Accepted::SUPPORTED,
            &item,
        ) {
            Some(packed) => (packed, self.algorithm.to_wire()),
            None => (item, 0),
        }
    }
}

/// The bottom of a stream's stack: one attempt at opening it on the chosen endpoint. The
/// accepted stream is put aside for the caller; the stack sees an empty answer.
struct OpenAttempt<'c> {
    client: &'c Client,
    opened: &'c Mutex<Option<Source>>,
    mode: StreamMode,
}

impl stack::Service for OpenAttempt<'_> {
    async fn call(&self, cx: &mut CallCx<'_>, params: Bytes) -> Result<Bytes, RpcError> {
        let Some(addr) = cx.endpoint_shared().cloned() else {
            return Err(RpcError::new(
                StatusCode::FrameworkError,
                "an attempt ran before an endpoint was chosen",
            ));
        };
        let method = cx.method();
        let codec = self.client.inner.codec;
        let span = telemetry::attempt_span(method, cx.attempt(), &addr);
        let watch =
            telemetry::AttemptWatch::new(span.clone(), cx.attempt_deadline(), cx.superseded());
        // Whether the server answered the set-up (accepted or refused it).
        let answered = std::sync::atomic::AtomicBool::new(false);
        let attempt = async {
            // The set-up within the attempt's deadline, the stream within the call's.
            let deadline = cx.deadline();
            let mut conn = self.client.connection(&addr, cx).await?;
            let mut sent_again = false;
            let (opened, item_pack) = loop {
                cx.set_connection(conn.id());
                // The set-up's arguments are compressed as a unary call's are: with the entry's
                // algorithm, at or above its threshold, when this connection's server accepts it.
                let options = cx.options();
                let item_pack = ItemPack::of(options, conn.accept_compression());
                let (parameters, compression) = match options.compression {
                    Compression::Off => (params.clone(), 0),
                    algorithm => match compression::pack(
                        algorithm,
                        options.compression_threshold as usize,
                        conn.accept_compression(),
                        &params,
                    ) {
                        Some(packed) => {
                            telemetry::record_compression(algorithm, params.len(), packed.len());
                            (packed, algorithm.to_wire())
                        }
                        None => (params.clone(), 0),
                    },
                };
                let call = Call {
                    service_entry_id: method.entry_id.into(),
                    codec: codec.to_wire(),
                    parameters,
                    attachments: telemetry::outgoing_attachments(cx.call_id(), cx.attachments()),
                    retry_depth: cx.retry_depth(),
                    timeout_ms: rpc_governance::timeout::remaining_ms_at(
                        tokio::time::Instant::now(),
                        deadline,
                    ),
                    stream_mode: 0,
                    compression,
                };
                match conn
                    .open_stream_within(call, self.mode, deadline, cx.attempt_deadline())
                    .await
                {
                    // Never read by a draining server: once more on a fresh connection, as a
                    // unary call goes.
                    Err(e) if !sent_again && crate::client::unread_by_draining(&conn, &e) => {
                        sent_again = true;
                        conn = self.client.connection(&addr, cx).await?;
                    }
                    opened => break (opened?, item_pack),
                }
            };
            // Accepted or refused, the server answered the set-up.
            answered.store(true, std::sync::atomic::Ordering::Relaxed);
            match opened {
                Opened::Accepted(stream) => {
                    let at: Arc<str> = addr.clone();
                    let stream = stream.with_end_error(Box::new(move |answer| {
                        into_result(answer, codec, &at)
                            .err()
                            .unwrap_or_else(|| RpcError::new(StatusCode::FrameworkError, "?"))
                    }));
                    *self.opened.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some(Source::Remote(stream, item_pack));
                    Ok(Bytes::new())
                }
                Opened::Refused(answer) => into_result(answer, codec, &addr),
            }
        };
        let result = if span.is_disabled() {
            attempt.await
        } else {
            attempt.instrument(span).await
        };
        watch.finish(&result);
        crate::answered_by::attempt(
            &addr,
            answered.load(std::sync::atomic::Ordering::Relaxed),
            &result,
        );
        result
    }

    /// The set-up's waits end at the attempt's deadline by themselves: connecting
    /// ([`Client::connection`]), waiting for room in the send queue (then not sent, which
    /// the retry layer can tell from a set-up the server may have run) and waiting for the
    /// server's set-up (then `Cancel` goes).
    fn enforces_attempt_deadline(&self) -> bool {
        true
    }
}
