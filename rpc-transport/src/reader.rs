//! A server connection's frame reader, under the server-wide read budget.
//!
//! Each connection reads into a buffer of its own of [`READ_BUFFER`](crate::READ_BUFFER) bytes,
//! which holds every frame that fits. A frame announced larger than that needs a buffer of its
//! size, and many peers announcing large frames (16 MiB by default) and sending them slowly
//! would hold that much memory each. So the bytes of such buffers come from one budget shared
//! by the whole server: a frame larger than what is left waits, with its connection no longer
//! read (TCP pushes back on the peer), until other frames are complete and give their share
//! back. Nothing of it is buffered while it waits.
//!
//! The budget never holds less than one frame of the maximum size, and a connection holds a
//! share only for the one frame it is reading, asking for it all at once (the semaphore is
//! fair, first come first served): a frame never waits for a share held by a connection that
//! itself waits, so every frame within the limit is read in turn. A peer that takes a share
//! and then stops sending keeps it until the idle timeout closes its connection (only complete
//! frames count as traffic), calls of its connection in flight or not.

use std::sync::Arc;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::codec::{FrameCodec, FrameError, PREFIX};
use crate::invoke::Incoming;
use crate::peer::PeerAddr;
use crate::READ_BUFFER;

/// The budget counts in units of this many bytes, so that a semaphore's `u32` request covers
/// any frame a 4-byte prefix can announce.
const UNIT: usize = 1024;

/// The bytes of large frames' read buffers that a server may hold at once.
#[derive(Debug, Clone)]
pub(crate) struct ReadBudget {
    units: Arc<Semaphore>,
}

impl ReadBudget {
    /// A budget of `bytes`, raised to one frame of `max_frame_length` if it is less.
    pub(crate) fn new(bytes: usize, max_frame_length: usize) -> Self {
        let bytes = bytes.max(max_frame_length.saturating_add(PREFIX));
        ReadBudget {
            units: Arc::new(Semaphore::new(units(bytes) as usize)),
        }
    }
}

/// Units needed for `bytes`.
fn units(bytes: usize) -> u32 {
    bytes.div_ceil(UNIT).min(u32::MAX as usize) as u32
}

/// A wait for a share of the read budget.
type ShareWait = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<OwnedSemaphorePermit, tokio::sync::AcquireError>>
            + Send,
    >,
>;

/// Reads frames from one connection; see the module documentation.
pub(crate) struct FrameReader<R> {
    rd: R,
    buf: BytesMut,
    codec: FrameCodec,
    max_frame_length: usize,
    budget: ReadBudget,
    /// The share of the budget held for the large frame being read.
    share: Option<OwnedSemaphorePermit>,
    /// The wait for that share while the budget is short: kept across calls of
    /// [`next`](Self::next), so that a caller dropping its future (to handle a timer, say)
    /// does not lose the frame's place in the queue, nor the units already set aside for it.
    waiting: Option<ShareWait>,
    peer: PeerAddr,
    eof: bool,
    /// Where the buffer of the last large frame lies (for the tests).
    #[cfg(test)]
    large: std::ops::Range<usize>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader of `rd` whose buffer starts with `early` (what was read after `Hello`).
    pub(crate) fn new(
        rd: R,
        early: &[u8],
        max_frame_length: usize,
        budget: ReadBudget,
        peer: PeerAddr,
    ) -> Self {
        let mut buf = BytesMut::with_capacity(READ_BUFFER.max(early.len()));
        buf.extend_from_slice(early);
        FrameReader {
            rd,
            buf,
            codec: FrameCodec::new(max_frame_length),
            max_frame_length,
            budget,
            share: None,
            waiting: None,
            peer,
            eof: false,
            #[cfg(test)]
            large: 0..0,
        }
    }

    /// Whether a share of the budget is held for a large frame not read whole yet.
    pub(crate) fn holds_share(&self) -> bool {
        self.share.is_some()
    }

    /// Gives up the wait for a share of the budget, if one is kept: for a connection that is
    /// not read for a while (paused). Tokio's semaphore sets units aside for a queued wait
    /// whether or not it is polled, so a kept wait nobody polls would hold them from the
    /// frames behind it; the next read queues again.
    pub(crate) fn stop_waiting(&mut self) {
        self.waiting = None;
    }

    /// Whether the next frame waits for a share of the budget (a large frame, within the
    /// limit, whose share is not held yet): the server holds it back, not the peer.
    pub(crate) fn waits_for_share(&self) -> bool {
        self.share.is_none() && self.buf.len() >= PREFIX && {
            let len = announced(&self.buf);
            PREFIX + len > READ_BUFFER && len <= self.max_frame_length
        }
    }

    /// The next complete frame already in the buffer, without reading from the socket.
    pub(crate) fn buffered(&mut self) -> Option<Result<Incoming, FrameError>> {
        if self.buf.len() < PREFIX {
            return None;
        }
        let len = announced(&self.buf);
        // Above the maximum the codec refuses it at once; below, it is decoded only once all
        // of it is here (the codec would grow the buffer for it otherwise).
        if len <= self.max_frame_length && self.buf.len() < PREFIX + len {
            return None;
        }
        let mut frame = self.codec.decode_incoming(&mut self.buf).transpose()?;
        if self.share.take().is_some() {
            // The large frame is out (its payload, shared with the buffer, now belongs to the
            // call): back to a buffer of the usual size.
            let rest = std::mem::replace(&mut self.buf, BytesMut::with_capacity(READ_BUFFER));
            self.buf.extend_from_slice(&rest);
            if let Ok(Incoming::Other(kind)) = &mut frame {
                crate::own_sparse_items(kind, len);
            }
        }
        Some(frame)
    }

    /// The next frame; `None` at the end of the stream. Cancel-safe: dropping the future loses
    /// no byte, and a wait for the budget keeps its place in the queue.
    pub(crate) async fn next(&mut self) -> Option<Result<Incoming, FrameError>> {
        loop {
            if let Some(frame) = self.buffered() {
                return Some(frame);
            }
            if self.eof {
                return None;
            }
            if self.buf.len() >= PREFIX {
                let total = PREFIX + announced(&self.buf);
                if total > READ_BUFFER && self.share.is_none() {
                    self.share = Some(self.take_share(total).await?);
                    // Exactly the frame's size, so the budget counts what is held.
                    let mut big = BytesMut::with_capacity(total);
                    big.extend_from_slice(&self.buf);
                    #[cfg(test)]
                    {
                        self.large = big.as_ptr() as usize..big.as_ptr() as usize + total;
                    }
                    self.buf = big;
                } else if self.buf.capacity() < total {
                    self.buf.reserve(total - self.buf.len());
                }
            }
            if self.buf.len() == self.buf.capacity() {
                self.buf.reserve(READ_BUFFER);
            }
            match self.rd.read_buf(&mut self.buf).await {
                Ok(0) => {
                    self.eof = true;
                    if !self.buf.is_empty() {
                        return Some(Err(FrameError::Io(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the peer closed the connection in the middle of a frame",
                        ))));
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    self.eof = true;
                    return Some(Err(e.into()));
                }
            }
        }
    }

    /// The budget's share for a frame of `total` bytes, waiting for it if need be (in
    /// `waiting`, which outlives a dropped call: the frame at the front of the buffer is the
    /// same when this is called again).
    async fn take_share(&mut self, total: usize) -> Option<OwnedSemaphorePermit> {
        if self.waiting.is_none() {
            let n = units(total);
            let units = self.budget.units.clone();
            if let Ok(share) = units.clone().try_acquire_many_owned(n) {
                tracing::trace!(peer = %self.peer, bytes = total, "read budget: frame granted");
                return Some(share);
            }
            tracing::debug!(
                peer = %self.peer,
                bytes = total,
                "read budget exhausted: the frame waits, and the connection is not read meanwhile"
            );
            self.waiting = Some(Box::pin(units.acquire_many_owned(n)));
        }
        let waiting = self.waiting.as_mut()?;
        // Fails only if the semaphore is closed, which this crate never does.
        let share = waiting.await.ok();
        self.waiting = None;
        tracing::trace!(peer = %self.peer, bytes = total, "read budget: frame granted");
        share
    }
}

/// The length a buffer's first four bytes announce.
fn announced(buf: &BytesMut) -> usize {
    (&buf[..PREFIX]).get_u32() as usize
}

#[cfg(test)]
mod tests {
    use rpc_core::wire::frame::Kind;

    use super::*;

    /// A large frame's reader whose wait for the budget began and whose `next` future was
    /// then dropped (as the connection loop drops it for a timer's branch), with another
    /// frame's wait queued after it; the budget all taken, in `first` (a share's worth and one
    /// unit) and `rest`.
    struct Queued {
        reader: FrameReader<&'static [u8]>,
        first: OwnedSemaphorePermit,
        _rest: OwnedSemaphorePermit,
        later: tokio::task::JoinHandle<Result<OwnedSemaphorePermit, tokio::sync::AcquireError>>,
    }

    async fn queued_before_another() -> Queued {
        let wire: &'static [u8] = Box::leak(crate::padded_item_frame(0).into_boxed_slice());
        let budget = ReadBudget::new(0, 2 << 20);
        let units_all = budget.units.available_permits() as u32;
        let needed = units(wire.len());
        let first = budget
            .units
            .clone()
            .try_acquire_many_owned(needed + 1)
            .unwrap();
        let rest = budget
            .units
            .clone()
            .try_acquire_many_owned(units_all - needed - 1)
            .unwrap();
        let peer = PeerAddr::Tcp("127.0.0.1:1".parse().unwrap());
        let mut reader = FrameReader::new(wire, &[], 2 << 20, budget.clone(), peer);
        tokio::select! {
            biased;
            _ = reader.next() => panic!("no budget yet"),
            _ = std::future::ready(()) => {}
        }
        let later = tokio::spawn(budget.units.clone().acquire_many_owned(needed));
        tokio::task::yield_now().await;
        Queued {
            reader,
            first,
            _rest: rest,
            later,
        }
    }

    /// A large frame waiting for the budget keeps its place in the queue when the caller of
    /// `next` drops its future: the share freed next is its own, not that of a frame that
    /// came later. Before, it joined the back of the queue again each time, and under steady
    /// traffic it could wait for ever.
    #[tokio::test(start_paused = true)]
    async fn a_frame_waiting_for_the_budget_keeps_its_place_when_its_wait_is_dropped() {
        let mut q = queued_before_another().await;
        // A share's worth comes back: the first in the queue gets it.
        drop(q.first);
        tokio::task::yield_now().await;
        assert!(!q.later.is_finished(), "the later frame waits its turn");
        let frame = tokio::time::timeout(std::time::Duration::from_secs(1), q.reader.next())
            .await
            .expect("its place was kept: the freed share is the frame's");
        assert!(matches!(
            frame,
            Some(Ok(Incoming::Other(Kind::StreamItem(_))))
        ));
        q.later.abort();
    }

    /// A kept wait given up (its connection paused, not read) holds no units: the share freed
    /// next goes to the frame behind it, which tokio's semaphore would otherwise set aside
    /// for the wait nobody polls.
    #[tokio::test(start_paused = true)]
    async fn a_wait_given_up_while_its_connection_is_paused_holds_no_units() {
        let mut q = queued_before_another().await;
        q.reader.stop_waiting();
        drop(q.first);
        let _share = tokio::time::timeout(std::time::Duration::from_secs(1), q.later)
            .await
            .expect("the freed share went to the frame behind")
            .expect("join")
            .expect("acquired");
    }

    /// The item of a large frame that is mostly something else (an unknown field here) is
    /// copied out of the frame's buffer, which the read budget no longer counts once the frame
    /// is decoded; the item of a large frame that it fills shares the buffer.
    #[tokio::test]
    async fn an_item_in_a_mostly_padded_large_frame_does_not_keep_the_frame() {
        let item_of = |padding: usize| async move {
            let wire = crate::padded_item_frame(padding);
            let budget = ReadBudget::new(4 << 20, 4 << 20);
            let peer = PeerAddr::Tcp("127.0.0.1:1".parse().unwrap());
            let mut reader = FrameReader::new(&wire[..], &[], 4 << 20, budget, peer);
            let Some(Ok(Incoming::Other(Kind::StreamItem(item)))) = reader.next().await else {
                panic!("expected a stream item")
            };
            (item.payload, reader.large.clone())
        };
        let (padded, large) = item_of(1 << 20).await;
        assert!(!large.is_empty(), "read as a large frame");
        assert_eq!(padded.len(), 9 * 1024);
        assert!(padded.iter().all(|b| *b == 7));
        assert!(!large.contains(&(padded.as_ptr() as usize)), "a copy");
        let (whole, large) = item_of(0).await;
        assert_eq!(whole.len(), 9 * 1024 + (1 << 20));
        assert!(
            large.contains(&(whole.as_ptr() as usize)),
            "a slice of the frame"
        );
    }
}
