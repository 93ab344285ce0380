//! The server-wide budget for what compressed calls (and the compressed items of clients'
//! request streams) expand to.
//!
//! What a call's arguments hold while it runs is what arrived on the wire, bounded by the read
//! budget as it is read and by the in-flight limit once it runs: a client has to send every
//! byte it makes the server hold. Compression breaks that: about 600 bytes of zstd expand to
//! 16 MiB, so one connection's 1024 calls in flight could make the server hold 16 GiB for
//! 600 KiB sent. So the bytes a call's arguments gain by decompression are taken from one
//! budget shared by the whole server, and held by the decompressed buffer itself: given back
//! when its last bytes are dropped, that is once the handler has decoded the arguments (or the
//! call ended before it did: its answer, `Cancel`, the connection's end), not when a long
//! stream ends. A compressed call that would need more than is left is answered
//! Overflow (515) without running, as a full server answers any call: the client's retry
//! takes it to another endpoint or later. Uncompressed calls take nothing from it.

use std::sync::Arc;

use bytes::Bytes;
use rpc_core::StatusCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::options::ServerOptions;
use crate::Invoke;

/// The budget counts in units of this many bytes, so that a semaphore's `u32` request covers
/// any expansion within a frame limit of up to 4 TiB.
const UNIT: usize = 1024;

/// The bytes that running calls' arguments hold beyond their size on the wire.
#[derive(Debug, Clone)]
pub(crate) struct ExpansionBudget {
    units: Arc<Semaphore>,
}

/// A call's share of the [`ExpansionBudget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Expanded {
    _share: OwnedSemaphorePermit,
}

impl Expanded {
    /// `plain` (the decompressed arguments), holding this share until its last bytes go.
    pub(crate) fn holding(self, plain: Bytes) -> Bytes {
        Bytes::from_owner(Held {
            plain,
            _share: self,
        })
    }
}

/// Decompressed arguments with their share of the budget.
struct Held {
    plain: Bytes,
    _share: Expanded,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.plain
    }
}

impl ExpansionBudget {
    /// A budget of `bytes`, raised to one frame of `max_frame_length` if it is less, so that
    /// any one call within the frame limit can run on an otherwise idle server.
    pub(crate) fn new(bytes: usize, max_frame_length: usize) -> Self {
        let units = bytes.max(max_frame_length).div_ceil(UNIT);
        ExpansionBudget {
            units: Arc::new(Semaphore::new(units.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// The share for arguments of `plain` bytes that arrived as `wire` bytes; `None` when
    /// what is left is not enough (the caller refuses the call). Nothing is taken for
    /// arguments no larger than they arrived.
    pub(crate) fn take(&self, wire: usize, plain: usize) -> Option<Option<Expanded>> {
        let grown = plain.saturating_sub(wire);
        if grown == 0 {
            return Some(None);
        }
        let units = u32::try_from(grown.div_ceil(UNIT)).ok()?;
        self.units
            .clone()
            .try_acquire_many_owned(units)
            .ok()
            .map(|share| Some(Expanded { _share: share }))
    }

    /// `payload` (compressed with `compression`, not 0) decompressed within `limit` bytes,
    /// holding what it gained from the budget. The share its header says it needs (an LZ4
    /// block's size prefix, the content sizes zstd frames record) is taken first: one beyond
    /// what is left is refused before any decompression, as a few hundred bytes of zstd can
    /// make 16 MiB of work to refuse. A payload that says no size, or a short one, takes its
    /// share as it came out.
    pub(crate) fn expand(
        &self,
        compression: i32,
        payload: &Bytes,
        limit: usize,
    ) -> Result<Bytes, Unexpanded> {
        // (A size over the limit is refused by the decompression, as not readable.)
        let said =
            crate::compression::declared_size(compression, payload).filter(|&size| size <= limit);
        let mut share = match said {
            Some(size) => Some(
                self.take(payload.len(), size)
                    .ok_or(Unexpanded::OverBudget {
                        size,
                        decompressed: false,
                    })?,
            ),
            None => None,
        };
        let plain = crate::compression::decompress(compression, payload, limit)
            .map_err(Unexpanded::Corrupt)?;
        if said.is_none_or(|size| plain.len() > size) {
            // (The share taken for the size said goes back first.)
            drop(share.take());
            share = Some(
                self.take(payload.len(), plain.len())
                    .ok_or(Unexpanded::OverBudget {
                        size: plain.len(),
                        decompressed: true,
                    })?,
            );
        }
        Ok(match share.flatten() {
            Some(share) => share.holding(plain),
            None => plain,
        })
    }

    /// Bytes left, to the unit.
    #[cfg(test)]
    fn left(&self) -> usize {
        self.units.available_permits() * UNIT
    }
}

/// Why [`ExpansionBudget::expand`] gave nothing.
#[derive(Debug)]
pub(crate) enum Unexpanded {
    /// The payload does not decompress (within the limit).
    Corrupt(crate::compression::CompressionError),
    /// It decompresses to `size` bytes, more than is left of the budget: said by its header
    /// (nothing was decompressed), or found by decompressing it (a payload that says no size).
    OverBudget { size: usize, decompressed: bool },
}

/// Why [`Unpacker::unpack`] refused a call's arguments: the status and message to answer
/// with, and whether the arguments were decompressed first (the work a rate-limit token stands
/// for was done: the call keeps its tokens).
#[derive(Debug)]
pub(crate) struct Unpacked {
    pub(crate) code: StatusCode,
    pub(crate) message: String,
    pub(crate) decompressed: bool,
}

/// Decompresses calls' arguments, at most the frame limit of them, into buffers holding what
/// they gain from the server's [`ExpansionBudget`]: the connection's, before it hands a call
/// on, or the handler's after its own admission ([`Caller::unpack`](crate::Caller::unpack)).
#[derive(Debug, Clone)]
pub(crate) struct Unpacker {
    budget: ExpansionBudget,
    max_frame_length: usize,
    max_decompressed_bytes: usize,
}

impl Unpacker {
    /// Decompression within `options`' limits, from `budget`.
    pub(crate) fn new(budget: ExpansionBudget, options: &ServerOptions) -> Self {
        Unpacker {
            budget,
            max_frame_length: options.max_frame_length,
            max_decompressed_bytes: options.max_decompressed_bytes,
        }
    }

    /// Decompresses `invoke`'s arguments in place (uncompressed ones stay as they are; the
    /// call's `compression` is left as it came, since its answer follows it). A call
    /// whose arguments do not decompress is to be answered 500, one beyond what is left of the
    /// budget 515: the status and message, and the call does not run.
    pub(crate) fn unpack(&self, invoke: &mut Invoke) -> Result<(), Unpacked> {
        if invoke.compression == 0 {
            return Ok(());
        }
        match self.budget.expand(
            invoke.compression,
            &invoke.parameters,
            self.max_frame_length,
        ) {
            Ok(plain) => {
                invoke.parameters = plain;
                Ok(())
            }
            Err(Unexpanded::Corrupt(e)) => Err(Unpacked {
                code: StatusCode::FrameworkError,
                message: format!(
                    "the call to {} was not run: {e}",
                    rpc_core::quoted(&invoke.service_entry_id)
                ),
                decompressed: true,
            }),
            Err(Unexpanded::OverBudget { size, decompressed }) => Err(Unpacked {
                decompressed,
                ..self.over_budget(invoke, size)
            }),
        }
    }

    /// The refusal of a call whose arguments decompress to `size` bytes, more than is left.
    fn over_budget(&self, invoke: &Invoke, size: usize) -> Unpacked {
        Unpacked {
            code: StatusCode::OverflowMaxServerHandle,
            decompressed: false,
            message: format!(
                "the call to {} was not run: its arguments decompress to {size} bytes, more \
                 than is left of the server's budget for decompressed arguments of running \
                 calls ({} bytes); retry later or elsewhere, or send it uncompressed",
                rpc_core::quoted(&invoke.service_entry_id),
                self.max_decompressed_bytes,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_held_until_dropped_and_a_call_beyond_what_is_left_is_refused() {
        let budget = ExpansionBudget::new(10 * UNIT, 4 * UNIT);
        let a = budget.take(100, 100 + 6 * UNIT).expect("within the budget");
        assert!(a.is_some());
        assert_eq!(budget.left(), 4 * UNIT);
        assert!(
            budget.take(0, 5 * UNIT).is_none(),
            "5 units asked, 4 left: refused"
        );
        drop(a);
        assert_eq!(budget.left(), 10 * UNIT);
        assert!(budget.take(0, 5 * UNIT).is_some());
    }

    #[test]
    fn the_share_goes_with_the_last_bytes_of_the_buffer_holding_it() {
        let budget = ExpansionBudget::new(10 * UNIT, UNIT);
        let share = budget.take(0, 4 * UNIT).unwrap().unwrap();
        let held = share.holding(Bytes::from(vec![7u8; 4 * UNIT]));
        let part = held.slice(..10);
        drop(held);
        assert_eq!(budget.left(), 6 * UNIT, "a slice still holds it");
        assert_eq!(part[..], [7u8; 10]);
        drop(part);
        assert_eq!(budget.left(), 10 * UNIT);
    }

    #[test]
    fn arguments_no_larger_than_they_arrived_take_nothing() {
        let budget = ExpansionBudget::new(UNIT, UNIT);
        assert!(matches!(budget.take(500, 500), Some(None)));
        assert!(matches!(budget.take(500, 20), Some(None)));
        assert_eq!(budget.left(), UNIT);
    }

    #[test]
    fn the_budget_holds_at_least_one_frame() {
        let budget = ExpansionBudget::new(0, 3 * UNIT);
        assert_eq!(budget.left(), 3 * UNIT);
    }
}
