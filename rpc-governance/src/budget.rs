//! Retry budget: retries allowed as a share of an entry's recent calls, so that an overloaded
//! cluster is not hammered by every client retrying every call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use rpc_core::GovernanceOptions;
use tokio::time::Instant;

/// Length of the budget's window, in seconds.
pub const WINDOW_SECONDS: u64 = 10;

/// Counts calls and retries over the last [`WINDOW_SECONDS`] in one-second buckets.
///
/// A retry is allowed while the window's retries stay below
/// `max(retry_budget_percent % of its calls, retry_budget_min_per_second × window)`.
/// Recording a call is one atomic add (a lock is taken only when a bucket turns over and when a
/// retry is asked for); counts are approximate under races, which a budget tolerates.
#[derive(Debug)]
pub struct RetryBudget {
    start: Instant,
    buckets: [Bucket; WINDOW_SECONDS as usize],
    turnover: Mutex<()>,
}

#[derive(Debug, Default)]
struct Bucket {
    second: AtomicU64,
    calls: AtomicU64,
    retries: AtomicU64,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            start: Instant::now(),
            buckets: Default::default(),
            turnover: Mutex::new(()),
        }
    }
}

impl RetryBudget {
    /// An empty budget.
    pub fn new() -> Self {
        Self::default()
    }

    /// The bucket of second `sec`, emptied first if it still holds an older second. A bucket
    /// already on a newer second (a deposit of a call that started a window ago or more) is
    /// never taken back to an older one: that would forget the newer second's retries, and
    /// the deposit counts in it instead.
    fn bucket(&self, sec: u64) -> &Bucket {
        let b = &self.buckets[(sec % WINDOW_SECONDS) as usize];
        if b.second.load(Ordering::Acquire) < sec {
            let _turnover = self.turnover.lock().unwrap_or_else(PoisonError::into_inner);
            if b.second.load(Ordering::Acquire) < sec {
                b.calls.store(0, Ordering::Relaxed);
                b.retries.store(0, Ordering::Relaxed);
                b.second.store(sec, Ordering::Release);
            }
        }
        b
    }

    fn second(&self, at: Instant) -> u64 {
        // Seconds are counted from 1 so that a fresh bucket (second 0) is never current.
        at.saturating_duration_since(self.start).as_secs() + 1
    }

    /// Records a call (its first attempt).
    pub fn deposit(&self) {
        self.deposit_at(Instant::now());
    }

    /// Records a call made at `at` (the caller's clock reading, to save one).
    pub fn deposit_at(&self, at: Instant) {
        self.bucket(self.second(at))
            .calls
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Gives back a retry taken with [`try_withdraw`](Self::try_withdraw) and not sent after
    /// all (a hedge dropped before it left this client): it loads no server. It comes off the
    /// current second's retries (where the retry was taken, unless a second turned over
    /// meanwhile; then nothing comes off, as the window checks only its sum).
    pub fn give_back(&self) {
        let current = self.bucket(self.second(Instant::now()));
        let _ = current
            .retries
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1));
    }

    /// Takes one retry from the budget; false when it is spent.
    pub fn try_withdraw(&self, o: &GovernanceOptions) -> bool {
        let now = self.second(Instant::now());
        let current = self.bucket(now);
        let (mut calls, mut retries) = (0u64, 0u64);
        for b in &self.buckets {
            if now - b.second.load(Ordering::Acquire).min(now) < WINDOW_SECONDS {
                calls += b.calls.load(Ordering::Relaxed);
                retries += b.retries.load(Ordering::Relaxed);
            }
        }
        let by_ratio = calls * u64::from(o.retry_budget_percent) / 100;
        let floor = u64::from(o.retry_budget_min_per_second) * WINDOW_SECONDS;
        if retries < by_ratio.max(floor) {
            current.retries.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn floor_then_ratio_then_window_expiry() {
        let o = GovernanceOptions {
            retry_budget_percent: 20,
            retry_budget_min_per_second: 1,
            ..Default::default()
        };
        let b = RetryBudget::new();
        // The floor: 1/s over 10 s = 10 retries with no calls at all.
        assert_eq!((0..20).filter(|_| b.try_withdraw(&o)).count(), 10);
        // 100 calls allow 20 % = 20 retries in the window: 10 more.
        for _ in 0..100 {
            b.deposit();
        }
        assert_eq!((0..20).filter(|_| b.try_withdraw(&o)).count(), 10);
        // Once the window has moved on, the budget is back to its floor.
        tokio::time::advance(Duration::from_secs(WINDOW_SECONDS)).await;
        assert_eq!((0..20).filter(|_| b.try_withdraw(&o)).count(), 10);
    }

    /// A call that started a window ago or more (its service's lookup took that long) is
    /// deposited without taking its bucket back to its old second, which would forget the
    /// retries already drawn in the current one.
    #[tokio::test(start_paused = true)]
    async fn a_stale_deposit_does_not_refill_the_budget() {
        let o = GovernanceOptions {
            retry_budget_percent: 0,
            retry_budget_min_per_second: 1,
            ..Default::default()
        };
        let b = RetryBudget::new();
        let long_ago = Instant::now();
        tokio::time::advance(Duration::from_secs(WINDOW_SECONDS)).await;
        assert_eq!(
            (0..20).filter(|_| b.try_withdraw(&o)).count(),
            10,
            "the floor"
        );
        b.deposit_at(long_ago);
        assert!(!b.try_withdraw(&o), "the floor is spent still");
    }
}
