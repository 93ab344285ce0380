//! Bulkhead: the server's concurrency cap. Full means Overflow at once, never a queue.
//!
//! An admission counter, not a semaphore: a call either takes one of `size` slots at once or is
//! refused with Overflow (515); nothing ever waits for a slot to come back, so a burst over the
//! cap costs the refused callers one round trip and the server no memory. Without a wait list,
//! taking and returning a slot are one atomic operation each on a single counter.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rpc_core::{RpcError, StatusCode};

/// Caps calls handled at once by counting admissions: [`try_enter`](Self::try_enter) takes a
/// slot or refuses at once; it never waits.
#[derive(Debug, Clone)]
pub struct Bulkhead {
    in_use: Arc<AtomicUsize>,
    size: usize,
}

/// A slot of a [`Bulkhead`], returned when dropped.
#[derive(Debug)]
#[must_use = "the slot is returned as soon as the permit is dropped"]
pub struct Permit {
    in_use: Arc<AtomicUsize>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.in_use.fetch_sub(1, Ordering::Release);
    }
}

impl Bulkhead {
    /// Room for `size` calls at once.
    pub fn new(size: usize) -> Self {
        Bulkhead {
            in_use: Arc::new(AtomicUsize::new(0)),
            size,
        }
    }

    /// The same count of calls under a cap of `size`: the calls holding slots of this one
    /// count against it, so a new size holds from the next call, whatever is running.
    pub fn resized(&self, size: usize) -> Self {
        Bulkhead {
            in_use: self.in_use.clone(),
            size,
        }
    }

    /// The cap.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Calls being handled now.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Acquire)
    }

    /// Takes a slot for as long as the permit lives, or answers Overflow (515) at once: a full
    /// bulkhead refuses, it does not queue the caller until a slot is free.
    pub fn try_enter(&self, entry: &str) -> Result<Permit, RpcError> {
        // Never counts past the cap, so `in_use` is exact even while callers are refused.
        let taken = self
            .in_use
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
                (n < self.size).then_some(n + 1)
            });
        match taken {
            Ok(_) => Ok(Permit {
                in_use: self.in_use.clone(),
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
