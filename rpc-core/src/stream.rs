//! The framework's stream type: what a streaming method returns (and, later, takes).
//!
//! A stream crosses the wire item by item, and each item may fail on its own (it did not
//! decode, the server failed half way, the deadline passed), so the items are
//! `Result<T, RpcError>`: the items before a failure are delivered, then the error, then the
//! stream ends. One boxed type for every source (a channel, an iterator, any `Stream`) keeps
//! the trait a service declares independent of how a handler produces its items.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::stream::{self, BoxStream, Stream, StreamExt};

use crate::RpcError;

/// A stream of `T`s, each of which may be an error: what a streaming method of
/// `#[rpc::service]` returns (`async fn ticks(&self, n: u32) -> Result<RpcStream<Tick>,
/// RpcError>`). After an error item the stream ends.
///
/// ```
/// use rpc_core::RpcStream;
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let mut s = RpcStream::iter(1..=3u32);
/// let mut seen = Vec::new();
/// while let Some(item) = s.next().await {
///     seen.push(item.unwrap());
/// }
/// assert_eq!(seen, [1, 2, 3]);
/// # });
/// ```
pub struct RpcStream<T> {
    inner: BoxStream<'static, Result<T, RpcError>>,
    /// Set once an error item or the end was returned: nothing is polled after.
    done: bool,
}

impl<T: Send + 'static> RpcStream<T> {
    /// The items of any stream of `T`s.
    pub fn new(items: impl Stream<Item = T> + Send + 'static) -> Self {
        Self::try_new(items.map(Ok))
    }

    /// The items of a stream that may fail: an `Err` item ends the stream after it.
    pub fn try_new(items: impl Stream<Item = Result<T, RpcError>> + Send + 'static) -> Self {
        RpcStream {
            inner: items.boxed(),
            done: false,
        }
    }

    /// The items of an iterator (which runs when the stream is polled: keep it cheap per item).
    pub fn iter<I>(items: I) -> Self
    where
        I: IntoIterator<Item = T>,
        I::IntoIter: Send + 'static,
    {
        Self::new(stream::iter(items))
    }

    /// A stream of no items.
    pub fn empty() -> Self {
        Self::try_new(stream::empty())
    }

    /// A stream whose only item is `error`.
    pub fn failed(error: RpcError) -> Self {
        Self::try_new(stream::once(async move { Err(error) }))
    }

    /// The next item, `None` once the stream ended (after its last item or its error).
    pub async fn next(&mut self) -> Option<Result<T, RpcError>> {
        StreamExt::next(self).await
    }

    /// Every item until the end; the first error instead, if one comes.
    pub async fn collect_all(mut self) -> Result<Vec<T>, RpcError> {
        let mut items = Vec::new();
        while let Some(item) = self.next().await {
            items.push(item?);
        }
        Ok(items)
    }

    /// A stream of `f` applied to each item (errors pass unchanged).
    pub fn map_items<U: Send + 'static>(
        self,
        mut f: impl FnMut(T) -> Result<U, RpcError> + Send + 'static,
    ) -> RpcStream<U> {
        RpcStream::try_new(self.map(move |item| item.and_then(&mut f)))
    }
}

impl<T> Stream for RpcStream<T> {
    type Item = Result<T, RpcError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let next = self.inner.as_mut().poll_next(cx);
        match &next {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.done = true,
            _ => {}
        }
        next
    }
}

impl<T> fmt::Debug for RpcStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RpcStream")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

/// A stream of encoded items: what a streaming method's dispatcher produces (server) and what
/// a client's connection delivers, before the items are decoded.
pub type ByteStream = RpcStream<Bytes>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StatusCode;

    #[tokio::test]
    async fn an_error_item_ends_the_stream() {
        let s = RpcStream::try_new(stream::iter(vec![
            Ok(1u8),
            Err(RpcError::new(StatusCode::ServerError, "boom")),
            Ok(2),
        ]));
        let mut s = s.map_items(|n| Ok(n * 10));
        assert_eq!(s.next().await.map(Result::ok), Some(Some(10)));
        assert!(matches!(s.next().await, Some(Err(e)) if e.code() == StatusCode::ServerError));
        assert!(s.next().await.is_none(), "nothing after the error");
    }

    #[tokio::test]
    async fn collect_all_returns_the_items_or_the_first_error() {
        assert_eq!(
            RpcStream::iter([1, 2]).collect_all().await.ok(),
            Some(vec![1, 2])
        );
        let e = RpcStream::<u8>::failed(RpcError::new(StatusCode::Timeout, "late"))
            .collect_all()
            .await;
        assert!(matches!(e, Err(e) if e.code() == StatusCode::Timeout));
        assert!(RpcStream::<u8>::empty()
            .collect_all()
            .await
            .unwrap()
            .is_empty());
    }
}
