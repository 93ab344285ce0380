//! The framework's stream type: what a streaming method returns (and, later, takes).
//!
//! A stream crosses the wire item by item, and each item may fail on its own (it did not
//! decode, the server failed half way, the deadline passed), so the items are
//! `Result<T, RpcError>`: the items before a failure are delivered, then the error, then the
//! stream ends. One boxed type for every source (a channel, an iterator, any `Stream`) keeps
//! the trait a service declares independent of how a handler produces its items.

use std::fmt;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
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
    inner: Inner<T>,
    /// Set once an error item or the end was returned: nothing is polled after.
    done: bool,
}

/// Where a stream's items come from.
enum Inner<T> {
    /// Any stream of items.
    Items(BoxStream<'static, Result<T, RpcError>>),
    /// Typed items encoded as they are taken (only ever a [`ByteStream`]): into the caller's
    /// buffer by [`RpcStream::poll_next_into`], or into `scratch`, cut off as one item, by
    /// `poll_next`. `wrap` makes the cut-off bytes a `T` (the identity: `T` is `Bytes`).
    Encoding {
        source: Box<dyn EncodeItems>,
        scratch: BytesMut,
        wrap: fn(Bytes) -> T,
    },
    /// Encoded items lent one at a time from buffers the source keeps (only ever from a
    /// [`ByteStream::lending`]): decoded straight from there, or cut off as one item.
    Lending {
        source: Box<dyn ItemSource>,
        decode: Decode<T>,
    },
}

/// How a lending stream turns the item lent into a `T`.
enum Decode<T> {
    /// The item's bytes, as a handle on the source's buffer (the identity: `T` is `Bytes`).
    Wrap(fn(Bytes) -> T),
    /// Decoded from the lent bytes ([`ByteStream::decode_items`]).
    With(DecodeFn<T>),
}

/// Decodes one item from its bytes.
type DecodeFn<T> = Box<dyn FnMut(&[u8]) -> Result<T, RpcError> + Send>;

/// One encoded item lent by an [`ItemSource`]: its bytes within a buffer that may hold other
/// items too (the frame it arrived in).
#[derive(Debug)]
pub struct LentItem<'a> {
    buf: &'a Bytes,
    range: Range<usize>,
}

impl<'a> LentItem<'a> {
    /// The item at `range` of `buf`.
    ///
    /// # Panics
    /// When `range` is not within `buf`.
    pub fn new(buf: &'a Bytes, range: Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= buf.len(),
            "a lent item lies within its buffer"
        );
        LentItem { buf, range }
    }

    /// The whole of `buf` as one item.
    pub fn whole(buf: &'a Bytes) -> Self {
        LentItem {
            buf,
            range: 0..buf.len(),
        }
    }

    /// The item's bytes.
    pub fn bytes(&self) -> &'a [u8] {
        &self.buf[self.range.clone()]
    }

    /// The item's bytes as a handle of their own (sharing the buffer, not copying it).
    pub fn to_bytes(&self) -> Bytes {
        self.buf.slice(self.range.clone())
    }

    /// A lender's poll with the item as a handle of its own: how an [`ItemSource`] is also a
    /// `Stream` of `Bytes` (`LentItem::owned(self.poll_lend(cx))`).
    pub fn owned(
        poll: Poll<Option<Result<LentItem<'_>, RpcError>>>,
    ) -> Poll<Option<Result<Bytes, RpcError>>> {
        poll.map(|next| next.map(|item| item.map(|i| i.to_bytes())))
    }
}

/// Encoded items handed out one at a time as loans from buffers the source keeps: how a
/// client connection's stream gives the items of a frame without making each its own
/// [`Bytes`] (a reference count taken and dropped per item, on a count the connection's
/// reader touches too). [`ByteStream::lending`] makes one a stream; typed items are then
/// decoded straight from the loan ([`ByteStream::decode_items`]).
pub trait ItemSource: Send {
    /// The next item (valid until the next call), an error item, or the end (`None`); as
    /// `Stream::poll_next` otherwise, and like it not polled again after an error or the end.
    fn poll_lend(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<LentItem<'_>, RpcError>>>;

    /// The consumer could not decode the last item lent and ends the stream with `error`
    /// (it polls no more): a source that can tells its producer to stop, and records the
    /// stream's end as this error rather than as a consumer that went away. Nothing by
    /// default.
    fn fail(&mut self, error: &RpcError) {
        let _ = error;
    }
}

/// Items that encode themselves onto the end of a buffer: what
/// [`RpcStream::encoding`] builds from a stream of typed items and an encoder.
trait EncodeItems: Send {
    /// The next item appended to `dst` (its length), an error, or the end. On an error
    /// `dst` is as it was.
    fn poll_encode(
        &mut self,
        cx: &mut Context<'_>,
        dst: &mut BytesMut,
    ) -> Poll<Option<Result<usize, RpcError>>>;
}

/// An encoding source polled in a call context (see [`RpcStream::in_context`]).
struct EncodingInContext {
    source: Box<dyn EncodeItems>,
    context: crate::HeldContext,
}

impl EncodeItems for EncodingInContext {
    fn poll_encode(
        &mut self,
        cx: &mut Context<'_>,
        dst: &mut BytesMut,
    ) -> Poll<Option<Result<usize, RpcError>>> {
        let source = &mut self.source;
        self.context.enter(|| source.poll_encode(cx, dst))
    }
}

/// A stream of `T`s and what encodes one onto a buffer.
struct Encoder<T, F> {
    items: RpcStream<T>,
    encode: F,
}

impl<T, F> EncodeItems for Encoder<T, F>
where
    T: Send + 'static,
    F: FnMut(&T, &mut BytesMut) -> Result<usize, RpcError> + Send,
{
    fn poll_encode(
        &mut self,
        cx: &mut Context<'_>,
        dst: &mut BytesMut,
    ) -> Poll<Option<Result<usize, RpcError>>> {
        match self.items.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(item))) => {
                let start = dst.len();
                let encoded = (self.encode)(&item, dst);
                if encoded.is_err() {
                    dst.truncate(start);
                }
                Poll::Ready(Some(encoded))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Size of the buffer an encoding stream's items are cut from when they are taken one by one
/// (see [`RpcStream::encoding`]).
const SCRATCH: usize = 16 * 1024;

impl<T: Send + 'static> RpcStream<T> {
    /// This stream with each poll of its source run in the call context of `attachments` and
    /// `retry_depth` ([`HeldContext::enter`](crate::HeldContext::enter)):
    /// what a server does with a handler's items, so that the calls made while producing them
    /// carry the caller's context as the handler's set-up did. A stream encoding its items as
    /// they are taken stays one (taken into a frame with no buffer of its own); any other is
    /// polled through a stream of its own.
    pub fn in_context(
        self,
        attachments: std::sync::Arc<std::collections::BTreeMap<String, String>>,
        retry_depth: u32,
    ) -> Self {
        let RpcStream { inner, done } = self;
        let mut context = crate::HeldContext::new(attachments, retry_depth);
        let inner = match inner {
            Inner::Encoding {
                source,
                scratch,
                wrap,
            } => Inner::Encoding {
                source: Box::new(EncodingInContext { source, context }),
                scratch,
                wrap,
            },
            other => {
                let mut items = RpcStream { inner: other, done };
                Inner::Items(Box::pin(stream::poll_fn(move |cx| {
                    context.enter(|| items.poll_next_unpin(cx))
                })))
            }
        };
        RpcStream { inner, done }
    }

    /// The items of any stream of `T`s.
    pub fn new(items: impl Stream<Item = T> + Send + 'static) -> Self {
        Self::try_new(items.map(Ok))
    }

    /// The items of a stream that may fail: an `Err` item ends the stream after it.
    pub fn try_new(items: impl Stream<Item = Result<T, RpcError>> + Send + 'static) -> Self {
        RpcStream {
            inner: Inner::Items(items.boxed()),
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
        let next = match &mut self.inner {
            Inner::Items(items) => items.as_mut().poll_next(cx),
            Inner::Lending { source, decode } => match source.poll_lend(cx) {
                Poll::Ready(Some(Ok(item))) => {
                    let decoded = match decode {
                        Decode::Wrap(wrap) => Ok(wrap(item.to_bytes())),
                        Decode::With(decode) => decode(item.bytes()),
                    };
                    if let Err(e) = &decoded {
                        source.fail(e);
                    }
                    Poll::Ready(Some(decoded))
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            Inner::Encoding {
                source,
                scratch,
                wrap,
            } => {
                if scratch.capacity() - scratch.len() < SCRATCH / 8 {
                    // Reuses the buffer once every item cut from it is gone.
                    scratch.reserve(SCRATCH);
                }
                match source.poll_encode(cx, scratch) {
                    Poll::Ready(Some(Ok(_))) => {
                        Poll::Ready(Some(Ok(wrap(scratch.split().freeze()))))
                    }
                    Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            }
        };
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

impl RpcStream<Bytes> {
    /// The items of `items`, each encoded by `encode` (which appends one item's bytes to the
    /// buffer it is given and returns their number) when it is taken: an item that does not
    /// encode ends the stream with `encode`'s error.
    ///
    /// Taken with [`poll_next_into`](Self::poll_next_into), an item is encoded straight into
    /// the taker's buffer (a frame being assembled), with no buffer of its own; taken as a
    /// `Stream`, each item's bytes are cut from a buffer the stream keeps.
    pub fn encoding<T, F>(items: RpcStream<T>, encode: F) -> ByteStream
    where
        T: Send + 'static,
        F: FnMut(&T, &mut BytesMut) -> Result<usize, RpcError> + Send + 'static,
    {
        RpcStream {
            inner: Inner::Encoding {
                source: Box::new(Encoder { items, encode }),
                scratch: BytesMut::new(),
                wrap: std::convert::identity,
            },
            done: false,
        }
    }

    /// The items `source` lends, each taken as it is polled: as a `Stream`, each item a
    /// handle on the source's buffer; through [`decode_items`](Self::decode_items), decoded
    /// straight from the loan.
    pub fn lending(source: impl ItemSource + 'static) -> ByteStream {
        RpcStream {
            inner: Inner::Lending {
                source: Box::new(source),
                decode: Decode::Wrap(std::convert::identity),
            },
            done: false,
        }
    }

    /// A stream of each item decoded by `decode` (an item that does not decode ends the
    /// stream with `decode`'s error): from the bytes lent by the source of a stream built by
    /// [`lending`](Self::lending), with no handle per item; from each item's `Bytes`
    /// otherwise.
    pub fn decode_items<U: Send + 'static>(
        self,
        mut decode: impl FnMut(&[u8]) -> Result<U, RpcError> + Send + 'static,
    ) -> RpcStream<U> {
        match self.inner {
            Inner::Lending {
                source,
                decode: Decode::Wrap(_),
            } => RpcStream {
                inner: Inner::Lending {
                    source,
                    decode: Decode::With(Box::new(decode)),
                },
                done: self.done,
            },
            inner => RpcStream {
                inner,
                done: self.done,
            }
            .map_items(move |bytes| decode(&bytes)),
        }
    }

    /// The next item appended to `dst`, with its length; an error item (after which `dst` is
    /// as it was) or `None` at the end, as [`next`](Self::next) would return them. An item of
    /// a stream built by [`encoding`](Self::encoding) is encoded right there; any other is
    /// copied.
    pub fn poll_next_into(
        &mut self,
        cx: &mut Context<'_>,
        dst: &mut BytesMut,
    ) -> Poll<Option<Result<usize, RpcError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let next = match &mut self.inner {
            Inner::Items(items) => match items.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(item))) => {
                    dst.extend_from_slice(&item);
                    Poll::Ready(Some(Ok(item.len())))
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            Inner::Encoding { source, .. } => source.poll_encode(cx, dst),
            Inner::Lending { .. } => match Pin::new(&mut *self).poll_next(cx) {
                Poll::Ready(Some(Ok(item))) => {
                    dst.extend_from_slice(&item);
                    Poll::Ready(Some(Ok(item.len())))
                }
                other => return other.map(|o| o.map(|r| r.map(|_| 0))),
            },
        };
        match &next {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.done = true,
            _ => {}
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream put in a call context polls its source in it, and an encoding stream stays
    /// one: its items are encoded straight into the taker's buffer, in the context.
    #[test]
    fn a_stream_in_context_polls_its_source_there_and_keeps_encoding() {
        let context = std::sync::Arc::new(std::collections::BTreeMap::from([(
            "tenant".to_string(),
            "acme".to_string(),
        )]));
        let seen = || crate::RpcContext::get("tenant").unwrap_or_else(|| "none".into());
        let encoding = RpcStream::encoding(
            RpcStream::new(stream::iter([(); 2]).map(move |()| seen())),
            |item: &String, dst: &mut BytesMut| {
                dst.extend_from_slice(item.as_bytes());
                Ok(item.len())
            },
        );
        let mut encoding = encoding.in_context(context.clone(), 0);
        assert!(matches!(encoding.inner, Inner::Encoding { .. }));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut dst = BytesMut::new();
        assert!(matches!(
            encoding.poll_next_into(&mut cx, &mut dst),
            Poll::Ready(Some(Ok(4)))
        ));
        assert_eq!(&dst[..], b"acme");
        let mut items =
            RpcStream::new(stream::iter([(); 1]).map(move |()| seen())).in_context(context, 1);
        assert!(matches!(
            items.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Ok(ref t))) if t == "acme"
        ));
    }
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

    /// Encodes a `u16` as its two big-endian bytes, refusing 0.
    fn be(n: &u16, dst: &mut BytesMut) -> Result<usize, RpcError> {
        if *n == 0 {
            dst.extend_from_slice(b"partial");
            return Err(RpcError::new(StatusCode::ServerError, "zero"));
        }
        dst.extend_from_slice(&n.to_be_bytes());
        Ok(2)
    }

    #[tokio::test]
    async fn an_encoding_stream_gives_the_same_items_taken_either_way() {
        let items = || RpcStream::iter([1u16, 0x0203, 0, 9]);
        // As a stream: each item its own bytes, then the encoder's error, then the end.
        let mut s = ByteStream::encoding(items(), be);
        assert_eq!(
            s.next().await.unwrap().unwrap(),
            Bytes::from_static(&[0, 1])
        );
        assert_eq!(
            s.next().await.unwrap().unwrap(),
            Bytes::from_static(&[2, 3])
        );
        assert!(matches!(s.next().await, Some(Err(e)) if e.message() == "zero"));
        assert!(s.next().await.is_none());
        // Into a buffer: appended one after the other, the failed item leaving nothing.
        let mut s = ByteStream::encoding(items(), be);
        let mut dst = BytesMut::from(&b">"[..]);
        let mut lens = Vec::new();
        let end = std::future::poll_fn(|cx| loop {
            match s.poll_next_into(cx, &mut dst) {
                Poll::Ready(Some(Ok(n))) => lens.push(n),
                other => return other.map(|o| o.map(|r| r.map_err(|e| e.message().to_string()))),
            }
        })
        .await;
        assert_eq!(end, Some(Err("zero".to_string())));
        assert_eq!(lens, [2, 2]);
        assert_eq!(&dst[..], b">\x00\x01\x02\x03");
        assert!(std::future::poll_fn(|cx| s.poll_next_into(cx, &mut dst))
            .await
            .is_none());
    }

    #[tokio::test]
    async fn any_byte_stream_can_be_taken_into_a_buffer() {
        let mut s = ByteStream::iter([Bytes::from_static(b"ab"), Bytes::from_static(b"c")]);
        let mut dst = BytesMut::new();
        for expected in [2, 1] {
            let n = std::future::poll_fn(|cx| s.poll_next_into(cx, &mut dst)).await;
            assert_eq!(n.unwrap().unwrap(), expected);
        }
        assert!(std::future::poll_fn(|cx| s.poll_next_into(cx, &mut dst))
            .await
            .is_none());
        assert_eq!(&dst[..], b"abc");
    }

    /// Lends the items of one buffer, split at `cuts`, then ends with `end`.
    struct Frame {
        buf: Bytes,
        cuts: Vec<Range<usize>>,
        next: usize,
        end: Option<RpcError>,
    }

    impl ItemSource for Frame {
        fn poll_lend(
            &mut self,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<LentItem<'_>, RpcError>>> {
            let next = self.cuts.get(self.next).cloned();
            self.next += 1;
            Poll::Ready(match next {
                Some(range) => Some(Ok(LentItem::new(&self.buf, range))),
                None => self.end.take().map(Err),
            })
        }
    }

    fn frame(end: Option<RpcError>) -> Frame {
        Frame {
            buf: Bytes::from_static(b"<ab|cd|!!>"),
            cuts: vec![1..3, 4..6, 7..9],
            next: 0,
            end,
        }
    }

    #[tokio::test]
    async fn a_lending_stream_decodes_from_the_loan_or_hands_out_shared_bytes() {
        // As bytes: each item a handle on the lender's buffer, not a copy.
        let source = frame(None);
        let whole = source.buf.as_ptr_range();
        let mut s = ByteStream::lending(source);
        let first = s.next().await.unwrap().unwrap();
        assert_eq!(&first[..], b"ab");
        assert!(whole.contains(&first.as_ptr()), "shares the buffer");
        assert_eq!(&s.next().await.unwrap().unwrap()[..], b"cd");
        // Decoded: each item from the loan; an item that does not decode ends the stream.
        let mut s = ByteStream::lending(frame(None)).decode_items(|b| {
            if b == b"!!" {
                return Err(RpcError::new(StatusCode::ServerError, "bang"));
            }
            Ok(String::from_utf8(b.to_vec()).unwrap())
        });
        assert_eq!(s.next().await.unwrap().unwrap(), "ab");
        assert_eq!(s.next().await.unwrap().unwrap(), "cd");
        assert!(matches!(s.next().await, Some(Err(e)) if e.message() == "bang"));
        assert!(s.next().await.is_none(), "nothing after the error");
        // The source's error item passes through and ends the stream.
        let late = RpcError::new(StatusCode::Timeout, "late");
        let items = ByteStream::lending(frame(Some(late)))
            .decode_items(|b| Ok(b.len()))
            .collect_all()
            .await;
        assert!(matches!(items, Err(e) if e.code() == StatusCode::Timeout));
        // Any other byte stream is decoded from its items.
        let n = ByteStream::iter([Bytes::from_static(b"xyz")])
            .decode_items(|b| Ok(b.len()))
            .collect_all()
            .await;
        assert_eq!(n.unwrap(), [3]);
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
