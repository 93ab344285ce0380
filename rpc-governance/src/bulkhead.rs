//! Bulkhead: the server's concurrency cap. Full means Overflow at once, never a queue.
//!
//! An admission counter, not a semaphore: a call either takes one of `size` slots at once or is
//! refused with Overflow (515); nothing ever waits for a slot to come back, so a burst over the
//! cap costs the refused callers one round trip and the server no memory. Without a wait list,
//! taking and returning a slot are one atomic operation each on a single counter.
//!
//! A cap can also count calls that hold none of its slots ([`count_beside`](Bulkhead::count_beside)):
//! calls admitted under another cap that a rules change moved their entry away from. They hold
//! room until they end, so a new cap never admits its full size beside the calls still running.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rpc_core::{RpcError, StatusCode};
use tokio::time::Instant;

/// Caps calls handled at once by counting admissions: [`try_enter`](Self::try_enter) takes a
/// slot or refuses at once; it never waits.
#[derive(Debug, Clone)]
pub struct Bulkhead {
    in_use: Arc<AtomicUsize>,
    size: usize,
    beside: Arc<Beside>,
}

/// The counts of other caps' calls that hold room in a cap until they end.
#[derive(Debug, Default)]
struct Beside {
    /// Whether `counts` may be non-empty: the only thing an admission reads while it is not.
    any: AtomicBool,
    /// Each count, with when it was given.
    counts: Mutex<Vec<(Arc<AtomicUsize>, Instant)>>,
}

/// How long a count given beside a cap is kept even at zero: an admission that read the
/// entry's former policy just before the change may still take a slot of the cap it left.
/// Past it, the cap left admits no more of the entry's calls, and a count at zero is let go.
const BESIDE_GRACE: Duration = Duration::from_secs(1);

impl Beside {
    /// The calls counted beside the slots now, letting go of the counts at zero past their
    /// grace.
    fn total(&self) -> usize {
        if !self.any.load(Ordering::Acquire) {
            return 0;
        }
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.retain(|(c, given)| c.load(Ordering::Acquire) > 0 || given.elapsed() < BESIDE_GRACE);
        if counts.is_empty() {
            self.any.store(false, Ordering::Release);
        }
        counts.iter().map(|(c, _)| c.load(Ordering::Acquire)).sum()
    }
}

/// A slot of a [`Bulkhead`], returned when dropped.
#[derive(Debug)]
#[must_use = "the slot is returned as soon as the permit is dropped"]
pub struct Permit {
    in_use: Arc<AtomicUsize>,
    /// The tally that also counts the call (see [`Bulkhead::try_enter_tallied`]).
    tally: Option<Arc<AtomicUsize>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(tally) = &self.tally {
            tally.fetch_sub(1, Ordering::Release);
        }
        self.in_use.fetch_sub(1, Ordering::Release);
    }
}

impl Bulkhead {
    /// Room for `size` calls at once.
    pub fn new(size: usize) -> Self {
        Bulkhead {
            in_use: Arc::new(AtomicUsize::new(0)),
            size,
            beside: Arc::default(),
        }
    }

    /// The same count of calls under a cap of `size`: the calls holding slots of this one
    /// count against it, so a new size holds from the next call, whatever is running. (It
    /// counts nothing beside them until told to.)
    pub fn resized(&self, size: usize) -> Self {
        Bulkhead {
            in_use: self.in_use.clone(),
            size,
            beside: Arc::default(),
        }
    }

    /// The cap.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Calls being handled now: those holding slots, and those counted beside them.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Acquire) + self.beside.total()
    }

    /// Counts the calls holding slots of `other` as holding room here too, until they end.
    /// For calls whose entry moved from `other` to this cap: `other` is to admit no more of
    /// them (a count at zero is let go a second after it was given, time for an admission
    /// that read the former policy to finish). Shared with this cap's clones.
    pub fn count_beside(&self, other: &Bulkhead) {
        if Arc::ptr_eq(&self.in_use, &other.in_use) {
            return;
        }
        let mut counts = self
            .beside
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match counts
            .iter_mut()
            .find(|(c, _)| Arc::ptr_eq(c, &other.in_use))
        {
            Some((_, given)) => *given = Instant::now(),
            None => counts.push((other.in_use.clone(), Instant::now())),
        }
        self.beside.any.store(true, Ordering::Release);
    }

    /// Stops counting `other`'s calls here ([`count_beside`](Self::count_beside)): their
    /// entry went back to `other`, which counts them itself.
    pub fn stop_counting(&self, other: &Bulkhead) {
        let mut counts = self
            .beside
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        counts.retain(|(c, _)| !Arc::ptr_eq(c, &other.in_use));
        if counts.is_empty() {
            self.beside.any.store(false, Ordering::Release);
        }
    }

    /// Takes a slot for as long as the permit lives, or answers Overflow (515) at once: a full
    /// bulkhead refuses, it does not queue the caller until a slot is free.
    pub fn try_enter(&self, entry: &str) -> Result<Permit, RpcError> {
        self.enter(entry, None)
    }

    /// [`try_enter`](Self::try_enter), counting the call in `tally` too while it holds the
    /// slot (`tally` refuses nobody: it counts one entry's calls in a cap several share).
    pub fn try_enter_tallied(&self, entry: &str, tally: &Bulkhead) -> Result<Permit, RpcError> {
        self.enter(entry, Some(&tally.in_use))
    }

    fn enter(&self, entry: &str, tally: Option<&Arc<AtomicUsize>>) -> Result<Permit, RpcError> {
        let room = self.size.saturating_sub(self.beside.total());
        // Never counts past the cap, so `in_use` is exact even while callers are refused.
        let taken = self
            .in_use
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
                (n < room).then_some(n + 1)
            });
        match taken {
            Ok(_) => Ok(Permit {
                in_use: self.in_use.clone(),
                tally: tally.map(|t| {
                    t.fetch_add(1, Ordering::AcqRel);
                    t.clone()
                }),
            }),
            Err(_) => Err(RpcError::new(
                StatusCode::OverflowMaxServerHandle,
                format!(
                    "{entry} is at its cap of {} concurrent calls; the call was not run, retry \
                     on another endpoint",
                    self.size
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_means_overflow_at_once() {
        let b = Bulkhead::new(2);
        let p1 = b.try_enter("e").unwrap();
        let _p2 = b.try_enter("e").unwrap();
        let err = b.try_enter("e").unwrap_err();
        assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle);
        assert!(err.message().contains("cap of 2"));
        drop(p1);
        assert_eq!(b.in_use(), 1);
        assert!(b.try_enter("e").is_ok());
    }

    /// An entry moved by a rules change from cap `a` to cap `b` while two of its calls run:
    /// `b` counts them until they end, and a second after it was given the count, lets it go.
    /// (On the paused clock.)
    #[tokio::test(start_paused = true)]
    async fn calls_counted_beside_hold_room_until_they_end() {
        let a = Bulkhead::new(2);
        let running = [a.try_enter("e").unwrap(), a.try_enter("e").unwrap()];
        let b = Bulkhead::new(3);
        b.count_beside(&a);
        assert_eq!(b.in_use(), 2);
        let one = b.try_enter("e").unwrap();
        let err = b.try_enter("e").unwrap_err();
        assert_eq!(err.code(), StatusCode::OverflowMaxServerHandle);
        assert!(err.message().contains("cap of 3"), "{err}");
        let [first, second] = running;
        drop(first);
        let two = b.try_enter("e").expect("an ended call's room is free");
        drop(second);
        assert_eq!(b.in_use(), 2, "only b's own slots are left");
        let three = b.try_enter("e").unwrap();
        assert!(b.try_enter("e").is_err());
        drop((one, two, three));
        assert_eq!(b.in_use(), 0);
        // Within the second, a call admitted by `a` (one that read the former policy) still
        // counts in `b`.
        let straggler = a.try_enter("e").unwrap();
        assert_eq!(b.in_use(), 1);
        drop(straggler);
        // Past it, the count at zero is let go: calls of `a` no longer count in `b`.
        tokio::time::advance(BESIDE_GRACE).await;
        assert_eq!(b.in_use(), 0);
        let _later = a.try_enter("e").unwrap();
        assert_eq!(b.in_use(), 0);
    }

    /// A count given at zero (the entry's former cap had no call running, or a call had taken
    /// the slot but not yet its tally) is kept for its grace: a call admitted then counts.
    #[tokio::test(start_paused = true)]
    async fn a_count_given_at_zero_still_counts_a_call_admitted_just_after() {
        let a = Bulkhead::new(2);
        let b = Bulkhead::new(1);
        b.count_beside(&a);
        let straggler = a.try_enter("e").unwrap();
        assert!(b.try_enter("e").is_err(), "the straggler holds b's room");
        drop(straggler);
        assert!(b.try_enter("e").is_ok());
    }

    #[test]
    fn a_count_no_longer_beside_holds_no_room() {
        let a = Bulkhead::new(1);
        let _running = a.try_enter("e").unwrap();
        let b = Bulkhead::new(1);
        b.count_beside(&a);
        b.count_beside(&a);
        assert_eq!(b.in_use(), 1, "counted once");
        assert!(b.try_enter("e").is_err());
        b.stop_counting(&a);
        assert_eq!(b.in_use(), 0);
        assert!(b.try_enter("e").is_ok());
    }

    #[test]
    fn a_tallied_call_counts_in_its_tally_until_it_ends() {
        let shared = Bulkhead::new(2);
        let tally = Bulkhead::new(usize::MAX);
        let p = shared.try_enter_tallied("e", &tally).unwrap();
        let _other = shared.try_enter("f").unwrap();
        assert_eq!((shared.in_use(), tally.in_use()), (2, 1));
        assert!(shared.try_enter_tallied("e", &tally).is_err());
        assert_eq!(tally.in_use(), 1, "a refused call is not tallied");
        drop(p);
        assert_eq!((shared.in_use(), tally.in_use()), (1, 0));
    }

    #[test]
    fn slots_come_back_under_contention() {
        let b = Bulkhead::new(3);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        if let Ok(p) = b.try_enter("e") {
                            assert!(b.in_use() <= 3);
                            drop(p);
                        }
                    }
                });
            }
        });
        assert_eq!(b.in_use(), 0);
    }
}
