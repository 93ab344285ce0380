//! Retry budget: retries allowed as a share of an entry's recent calls, so that an overloaded
//! cluster is not hammered by every client retrying every call.

use std::sync::{Mutex, PoisonError};

use rpc_core::GovernanceOptions;
use tokio::time::Instant;

/// Length of the budget's window, in seconds.
pub const WINDOW_SECONDS: u64 = 10;

/// Counts calls and retries over the last [`WINDOW_SECONDS`] in one-second buckets.
///
/// A retry is allowed while the window's retries stay below
/// `max(retry_budget_percent % of its calls, retry_budget_min_per_second × window)`.
#[derive(Debug)]
pub struct RetryBudget {
    start: Instant,
    window: Mutex<[Bucket; WINDOW_SECONDS as usize]>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Bucket {
    second: u64,
    calls: u64,
    retries: u64,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            start: Instant::now(),
            window: Mutex::new([Bucket::default(); WINDOW_SECONDS as usize]),
        }
    }
}

impl RetryBudget {
    /// An empty budget.
    pub fn new() -> Self {
        Self::default()
    }

    fn with_bucket<R>(
        &self,
        at: Instant,
        f: impl FnOnce(&mut [Bucket; WINDOW_SECONDS as usize], u64) -> R,
    ) -> R {
        let now = at.saturating_duration_since(self.start).as_secs();
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        let b = &mut w[(now % WINDOW_SECONDS) as usize];
        if b.second != now {
            *b = Bucket {
                second: now,
                calls: 0,
                retries: 0,
            };
        }
        f(&mut w, now)
    }

    /// Records a call (its first attempt).
    pub fn deposit(&self) {
        self.deposit_at(Instant::now());
    }

    /// Records a call made at `at` (the caller's clock reading, to save one).
    pub fn deposit_at(&self, at: Instant) {
        self.with_bucket(at, |w, now| w[(now % WINDOW_SECONDS) as usize].calls += 1);
    }

    /// Takes one retry from the budget; false when it is spent.
    pub fn try_withdraw(&self, o: &GovernanceOptions) -> bool {
        self.with_bucket(Instant::now(), |w, now| {
            let (mut calls, mut retries) = (0u64, 0u64);
            for b in w.iter().filter(|b| now - b.second < WINDOW_SECONDS) {
                calls += b.calls;
                retries += b.retries;
            }
            let by_ratio = calls * u64::from(o.retry_budget_percent) / 100;
            let floor = u64::from(o.retry_budget_min_per_second) * WINDOW_SECONDS;
            if retries < by_ratio.max(floor) {
                w[(now % WINDOW_SECONDS) as usize].retries += 1;
                true
            } else {
                false
            }
        })
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
}
