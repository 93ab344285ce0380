//! Streaming calls from the client: the stream's set-up passes the entry's governance as a
//! unary call does (breaker, timeout, retry and failover act on it), and its items then come
//! straight from the connection.
//!
//! The set-up is the call, as far as governance sees: it succeeds when the server accepts the
//! stream, and only then do items flow, so a retry (or a failover) can only ever happen before
//! the first item: no item already delivered is delivered again. Fallbacks and hedging do not
//! apply to streams: a fallback answers with one value, and a hedge would open the stream
//! twice. The call's deadline covers the whole stream: the server is told it, and the
//! connection ends the stream with a timeout item when it passes.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytes::Bytes;
use futures_util::future::Either;
use rpc_core::{
    ByteStream, GovernanceOptions, MethodDescriptor, RpcError, RpcStream, ShuntStrategy,
    StatusCode, StreamMode,
};
use rpc_governance::stack::{self, CallCx, ClientParts, Fallbacks, Service as _};
use rpc_transport::{Call, ClientStream, Opened, StreamSender};
use tracing::Instrument;

use crate::client::{into_result, Client, ClientBalance};
use crate::telemetry;

/// No fallback for streams (see the module documentation).
fn no_fallbacks() -> &'static Fallbacks {
    static NONE: OnceLock<Fallbacks> = OnceLock::new();
    NONE.get_or_init(Fallbacks::default)
}

impl Client {
    /// Opens a server stream of `method` with its other arguments already encoded by
    /// [`codec`](Self::codec), and returns its encoded items once the server accepted it.
    ///
    /// The set-up passes the entry's governance as [`invoke`](Self::invoke) does (user layers,
    /// circuit breaker, timeout, retry and failover, per-attempt layers), without fallback or
    /// hedging; a set-up that fails is retried or fails over only before the server accepted
    /// the stream, so no item is ever delivered twice. The entry's timeout covers the whole
    /// stream: when it passes, the stream ends with a [`StatusCode::Timeout`] item after the
    /// items that arrived, and the server is told to stop. A failure mid-stream ends it with
    /// an error item (the server's own error, typed as for a unary call, or a connection
    /// failure saying how many items arrived). Dropping the stream tells the server to stop.
    ///
    /// A server that does not stream (an older one) refuses at once with
    /// [`StatusCode::NotImplemented`], having been sent nothing.
    pub async fn invoke_stream<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        hash_key: Option<H>,
    ) -> Result<ByteStream, RpcError> {
        let stream = self
            .open_stream(method, params, hash_key, StreamMode::Server)
            .await?;
        Ok(RpcStream::try_new(stream))
    }

    /// Calls a client-streaming `method`: opens the stream with its other arguments already
    /// encoded by [`codec`](Self::codec), sends the encoded `items` and returns the encoded
    /// answer.
    ///
    /// The set-up passes the entry's governance as for
    /// [`invoke_stream`](Self::invoke_stream): it may be retried or fail over, and since no
    /// item is sent before the server accepted the stream, `items` is never asked for an item
    /// twice. Items are taken from `items` only while the server has granted credit for them,
    /// so a server that takes them slowly slows the producer down instead of filling memory.
    /// An error item of `items` ends the call, the server told so; a server that ends the
    /// stream early (its error, the deadline, a failure) ends it with that error.
    pub async fn invoke_client_stream<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        mut items: ByteStream,
        hash_key: Option<H>,
    ) -> Result<Bytes, RpcError> {
        use futures_util::StreamExt;
        let mut stream = self
            .open_stream(method, params, hash_key, StreamMode::Client)
            .await?;
        // An error of the caller's stream ends the call (dropping the stream tells the server).
        send_all(&stream.sender(), &mut items).await?;
        match stream.next().await {
            Some(Ok(answer)) => Ok(answer),
            Some(Err(e)) => Err(e),
            None => Err(RpcError::new(
                StatusCode::FrameworkError,
                format!(
                    "{}: the server completed the stream without an answer; is the method \
                     client-streaming on the server too?",
                    method.entry_id
                ),
            )),
        }
    }

    /// Calls a bidirectional streaming `method`: opens the stream with its other arguments
    /// already encoded by [`codec`](Self::codec), sends the encoded `items` from a task of
    /// their own while the answer's items are read, and returns those.
    ///
    /// The set-up passes the entry's governance as for
    /// [`invoke_stream`](Self::invoke_stream). Each side's items flow within the other
    /// side's credit: `items` is asked for an item only when the server can take it, and the
    /// server's producer stops when the answer is not read. An error item of `items` ends the
    /// stream with that error; dropping the answer stream stops both directions.
    pub async fn invoke_bidi<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        mut items: ByteStream,
        hash_key: Option<H>,
    ) -> Result<ByteStream, RpcError> {
        let stream = self
            .open_stream(method, params, hash_key, StreamMode::Bidi)
            .await?;
        let sender = stream.sender();
        tokio::spawn(async move {
            // (An error of `items` was sent as the stream's end: the reader gets it back.)
            let _ = send_all(&sender, &mut items).await;
        });
        Ok(RpcStream::try_new(stream))
    }

    /// Opens a stream of `mode` through the entry's governance; see
    /// [`invoke_stream`](Self::invoke_stream).
    async fn open_stream<H: FnOnce() -> u64>(
        &self,
        method: &'static MethodDescriptor,
        params: Bytes,
        hash_key: Option<H>,
        mode: StreamMode,
    ) -> Result<ClientStream, RpcError> {
        let governance = &self.inner.governance;
        let policy = governance.policy(method);
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
        let hash_key = match options.shunt_strategy {
            ShuntStrategy::Hash if method.hash_key.is_none() => {
                return Err(governance.check(method).err().unwrap_or_else(|| {
                    RpcError::new(
                        StatusCode::FrameworkError,
                        format!(
                            "{}: shunt_strategy = hash needs a #[hash_key] argument",
                            method.entry_id
                        ),
                    )
                }));
            }
            ShuntStrategy::Hash => hash_key.map(|h| h()),
            _ => None,
        };
        let span = telemetry::call_span(method);
        let call_id = telemetry::call_id(&span);
        let call_span = span.clone();
        let opened = Mutex::new(None);
        let call = async {
            let deadline = || rpc_governance::timeout::deadline(&options);
            let watch = telemetry::CallWatch::new(
                call_span,
                self.inner.metrics.start(method),
                deadline,
                &self.inner.calls,
                method.entry_id,
            );
            let mut cx = CallCx::new(governance, policy, options.clone())
                .with_hash_key(hash_key)
                .with_call_id(call_id);
            let stack = stack::client_stack(ClientParts {
                outer: &self.inner.layers,
                fallbacks: no_fallbacks(),
                codec: self.inner.codec,
                balance: ClientBalance { client: self },
                per_attempt: &self.inner.attempt_layers,
                attempt: OpenAttempt {
                    client: self,
                    opened: &opened,
                    mode,
                },
            });
            let result = stack.call(&mut cx, params).await;
            watch.finish(&result, None);
            result
        };
        let result = if span.is_disabled() {
            Either::Left(call)
        } else {
            Either::Right(call.instrument(span))
        }
        .await;
        result?;
        opened
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .ok_or_else(|| {
                RpcError::new(
                    StatusCode::FrameworkError,
                    format!(
                        "{}: the stream's set-up succeeded without a stream (a client layer \
                         answered it?); streams must reach the server",
                        method.entry_id
                    ),
                )
            })
    }
}

/// Sends `items` on a stream that takes the client's items, each only once the server has
/// granted credit for it, then the end of the request stream; stops when the stream ended.
/// An error item of `items` is sent as the request stream's end and returned.
async fn send_all(sender: &StreamSender, items: &mut ByteStream) -> Result<(), RpcError> {
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
                if sender.send(item).is_err() {
                    return Ok(());
                }
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

/// The bottom of a stream's stack: one attempt at opening it on the chosen endpoint. The
/// accepted stream is put aside for the caller; the stack sees an empty answer.
struct OpenAttempt<'c> {
    client: &'c Client,
    opened: &'c Mutex<Option<ClientStream>>,
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
        let watch = telemetry::AttemptWatch::new(span.clone(), cx.attempt_deadline());
        let attempt = async {
            // The set-up within the attempt's deadline (the retry layer's timer), the stream
            // within the call's.
            let deadline = cx.deadline();
            let conn = self.client.connection(&addr, cx.attempt_deadline()).await?;
            cx.set_connection(conn.id());
            let call = Call {
                service_entry_id: method.entry_id.into(),
                codec: codec.to_wire(),
                parameters: params,
                attachments: telemetry::outgoing_attachments(cx.call_id(), cx.attachments()),
                timeout_ms: rpc_governance::timeout::remaining_ms_at(
                    tokio::time::Instant::now(),
                    deadline,
                ),
                stream_mode: 0,
                // A stream's set-up arguments and items go plain: stream payloads are not
                // compressed yet.
                compression: 0,
            };
            match conn.open_stream(call, self.mode, deadline).await? {
                Opened::Accepted(stream) => {
                    let at: Arc<str> = addr.clone();
                    let stream = stream.with_end_error(Box::new(move |answer| {
                        into_result(answer, codec, &at)
                            .err()
                            .unwrap_or_else(|| RpcError::new(StatusCode::FrameworkError, "?"))
                    }));
                    *self.opened.lock().unwrap_or_else(PoisonError::into_inner) = Some(stream);
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
        if result
            .as_ref()
            .map_or_else(|e| !e.code().is_retryable(), |_| true)
        {
            crate::answered_by::record(&addr);
        }
        result
    }
}
