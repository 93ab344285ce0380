//! Rate limits: how many calls an entry takes per second, in all and per caller.
//!
//! A concurrency cap protects a server from work piling up; it does not stop one caller from
//! taking every slot, nor a burst of cheap calls from starving a shared resource behind them. A
//! rate limit answers "how often", not "how many at once": each entry may have a token bucket
//! for all its callers and one per caller (keyed by the client id of the handshake), refilled at
//! the configured rate, holding at most a burst. A call that finds no token is refused at once,
//! with the time until the next token as its `retry_after`, so a well-behaved client waits that
//! long instead of hammering, and the refusal costs the server one lookup.
//!
//! Buckets take their time from tokio's clock, so the paused clock drives them in tests.
//! Per-caller buckets are bounded: past [`MAX_CALLERS`] distinct callers, the new ones share one
//! bucket, so a peer inventing client ids cannot grow the table without limit. A full bucket
//! is what a new one would be, so when the table is full the buckets that refilled (callers
//! gone quiet, or gone: a client's default id changes with every process) are dropped, at most
//! once per [`SWEEP_EVERY`], to make room before a newcomer is put in the shared bucket.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

/// Distinct callers given a bucket of their own, per entry; later ones share one.
pub const MAX_CALLERS: usize = 10_000;

/// How often, at most, a full table of callers drops the buckets that refilled.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Tokens at a rate, holding at most a burst: the classic token bucket.
#[derive(Debug)]
pub struct TokenBucket {
    per_second: f64,
    burst: f64,
    state: Mutex<BucketState>,
}

#[derive(Debug)]
struct BucketState {
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// `per_second` tokens a second (at least one every thousand seconds), holding at most
    /// `burst` (at least one); starts full.
    pub fn new(per_second: f64, burst: u32) -> Self {
        let per_second = per_second.max(0.001);
        let burst = f64::from(burst.max(1));
        TokenBucket {
            per_second,
            burst,
            state: Mutex::new(BucketState {
                tokens: burst,
                at: Instant::now(),
            }),
        }
    }

    /// Takes a token, or says how long until one is there.
    pub fn try_take(&self) -> Result<(), Duration> {
        self.try_take_at(Instant::now())
    }

    /// [`try_take`](Self::try_take) at `now`.
    pub fn try_take_at(&self, now: Instant) -> Result<(), Duration> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        // A caller that read the clock before another took the lock comes with an earlier
        // `now`: the time up to the later one is paid out already, and moving `at` back would
        // pay it out again.
        if now > s.at {
            let refill = (now - s.at).as_secs_f64() * self.per_second;
            s.tokens = (s.tokens + refill).min(self.burst);
            s.at = now;
        }
        if s.tokens >= 1.0 {
            s.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - s.tokens) / self.per_second))
        }
    }

    /// Whether the bucket holds its whole burst at `now` (as a new one does).
    fn is_full_at(&self, now: Instant) -> bool {
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let refill = now.saturating_duration_since(s.at).as_secs_f64() * self.per_second;
        s.tokens + refill >= self.burst
    }

    /// Returns a token taken for a call that was then refused elsewhere (never above the
    /// burst).
    pub fn give_back(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.tokens = (s.tokens + 1.0).min(self.burst);
    }
}

/// What an entry's limits are: calls per second for all callers and for each caller, each with
/// its burst (`None`: no such limit).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimits {
    /// Calls per second for all callers together, and the burst.
    pub entry: Option<(f64, u32)>,
    /// Calls per second for each caller (by client id), and the burst.
    pub per_caller: Option<(f64, u32)>,
}

/// Which limit refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The entry's limit for all callers.
    Entry,
    /// The caller's own quota.
    Caller,
}

/// One entry's rate limits and their buckets.
#[derive(Debug)]
pub struct RateLimiter {
    limits: RateLimits,
    entry: Option<Arc<TokenBucket>>,
    callers: Option<Arc<Callers>>,
}

/// The per-caller buckets of an entry.
#[derive(Debug)]
struct Callers {
    rate: f64,
    burst: u32,
    table: DashMap<Arc<str>, Arc<TokenBucket>, ahash::RandomState>,
    /// Shared by the callers beyond [`MAX_CALLERS`].
    crowd: Arc<TokenBucket>,
    /// When the table was last swept of full buckets.
    swept: Mutex<Option<Instant>>,
}

impl Callers {
    fn bucket(&self, caller: &str, now: Instant) -> Arc<TokenBucket> {
        if let Some(b) = self.table.get(caller) {
            return b.clone();
        }
        if self.table.len() >= MAX_CALLERS && !self.sweep(now) {
            return self.crowd.clone();
        }
        self.table
            .entry(Arc::from(caller))
            .or_insert_with(|| Arc::new(TokenBucket::new(self.rate, self.burst)))
            .clone()
    }

    /// Drops the buckets that are full at `now` (unless one was swept less than
    /// [`SWEEP_EVERY`] ago); whether there is room now.
    fn sweep(&self, now: Instant) -> bool {
        {
            let mut swept = self.swept.lock().unwrap_or_else(PoisonError::into_inner);
            if swept.is_some_and(|at| now.saturating_duration_since(at) < SWEEP_EVERY) {
                return false;
            }
            *swept = Some(now);
        }
        self.table.retain(|_, bucket| !bucket.is_full_at(now));
        self.table.len() < MAX_CALLERS
    }
}

impl RateLimiter {
    /// Buckets for `limits`, full.
    pub fn new(limits: RateLimits) -> Self {
        RateLimiter {
            limits,
            entry: limits.entry.map(|(r, b)| Arc::new(TokenBucket::new(r, b))),
            callers: limits.per_caller.map(|(rate, burst)| {
                Arc::new(Callers {
                    rate,
                    burst,
                    table: DashMap::with_hasher(ahash::RandomState::new()),
                    crowd: Arc::new(TokenBucket::new(rate, burst)),
                    swept: Mutex::new(None),
                })
            }),
        }
    }

    /// Buckets for `limits`, sharing with `before` (the limiter they replace) the buckets of
    /// a limit that did not change: a change of the per-caller limit leaves the entry's bucket
    /// as drained as it was, and the reverse, rather than refilling both.
    pub fn carried_over(limits: RateLimits, before: &RateLimiter) -> Self {
        let mut fresh = RateLimiter::new(limits);
        if limits.entry.is_some() && limits.entry == before.limits.entry {
            fresh.entry = before.entry.clone();
        }
        if limits.per_caller.is_some() && limits.per_caller == before.limits.per_caller {
            fresh.callers = before.callers.clone();
        }
        fresh
    }

    /// The limits this limiter enforces.
    pub fn limits(&self) -> RateLimits {
        self.limits
    }

    /// Admits one call of `caller` at `now`, or says which limit refused it and when a token
    /// will be there. The caller's quota is checked first, so a caller over its own quota does
    /// not spend the entry's tokens that other callers need; a call the entry's limit refuses
    /// then gets the caller's token back, so the entry's refusals do not spend the caller's
    /// quota either.
    pub fn try_admit_at(&self, caller: &str, now: Instant) -> Result<(), (Refused, Duration)> {
        let own = match &self.callers {
            Some(callers) => {
                let bucket = callers.bucket(caller, now);
                bucket
                    .try_take_at(now)
                    .map_err(|after| (Refused::Caller, after))?;
                Some(bucket)
            }
            None => None,
        };
        if let Some(entry) = &self.entry {
            if let Err(after) = entry.try_take_at(now) {
                if let Some(own) = own {
                    own.give_back();
                }
                return Err((Refused::Entry, after));
            }
        }
        Ok(())
    }

    /// [`try_admit_at`](Self::try_admit_at) now.
    pub fn try_admit(&self, caller: &str) -> Result<(), (Refused, Duration)> {
        self.try_admit_at(caller, Instant::now())
    }

    /// Gives back the tokens a call of `caller` took when it was admitted, because it was
    /// refused further on (at the entry's cap) and never ran: the limits count calls that
    /// run, so a refused call must not spend a quota.
    pub fn give_back(&self, caller: &str) {
        if let Some(callers) = &self.callers {
            callers.bucket(caller, Instant::now()).give_back();
        }
        if let Some(entry) = &self.entry {
            entry.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two callers read the clock, and the later one takes the lock first: the earlier
    /// `now` refills nothing and does not move the bucket's time back (which paid the time
    /// between the two out twice).
    #[test]
    fn an_earlier_now_after_a_later_one_refills_nothing_twice() {
        let b = TokenBucket::new(1.0, 1);
        let t0 = Instant::now();
        assert_eq!(b.try_take_at(t0 + Duration::from_secs(1)), Ok(()));
        assert!(b.try_take_at(t0 + Duration::from_millis(500)).is_err());
        // 0.6 s after the token was taken: 0.6 of a token, not 1.1.
        let wait = b
            .try_take_at(t0 + Duration::from_millis(1600))
            .expect_err("0.6 of a token");
        assert_eq!(wait.as_millis(), 400);
        assert_eq!(b.try_take_at(t0 + Duration::from_secs(2)), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_bucket_gives_its_burst_then_one_token_per_period() {
        let b = TokenBucket::new(10.0, 3);
        for _ in 0..3 {
            assert_eq!(b.try_take(), Ok(()));
        }
        // Empty: the next token comes after 1/10 s.
        assert_eq!(b.try_take(), Err(Duration::from_millis(100)));
        tokio::time::advance(Duration::from_millis(60)).await;
        let wait = b.try_take().unwrap_err();
        assert!(
            (wait.as_secs_f64() - 0.04).abs() < 1e-9,
            "40 ms left, got {wait:?}"
        );
        tokio::time::advance(Duration::from_millis(40)).await;
        assert_eq!(b.try_take(), Ok(()));
        // A long pause refills only up to the burst.
        tokio::time::advance(Duration::from_secs(60)).await;
        let taken = (0..10).filter(|_| b.try_take().is_ok()).count();
        assert_eq!(taken, 3);
    }

    /// While the entry's bucket is empty, a caller's refused calls leave its own quota whole:
    /// when the entry has tokens again the caller gets its full burst.
    #[tokio::test(start_paused = true)]
    async fn a_call_the_entry_refuses_does_not_spend_the_callers_quota() {
        // The caller's quota: a burst of 3, refilled too slowly to matter here.
        let limiter = RateLimiter::new(RateLimits {
            entry: Some((1.0, 1)),
            per_caller: Some((0.001, 3)),
        });
        assert_eq!(limiter.try_admit("a"), Ok(()));
        for _ in 0..5 {
            let (which, _) = limiter.try_admit("a").unwrap_err();
            assert_eq!(which, Refused::Entry, "the caller has 2 tokens left");
        }
        // The entry's next token: the caller spends its second, and has its third.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(limiter.try_admit("a"), Ok(()));
        let caller = limiter
            .callers
            .as_ref()
            .unwrap()
            .bucket("a", Instant::now());
        assert_eq!(caller.try_take(), Ok(()), "the third of the caller's burst");
        assert!(caller.try_take().is_err(), "no fourth");
    }

    #[tokio::test(start_paused = true)]
    async fn over_one_second_a_bucket_admits_its_rate_plus_its_burst() {
        let b = TokenBucket::new(50.0, 5);
        let start = Instant::now();
        let mut admitted = 0;
        // Calls every millisecond for one second: 5 at once, then 50 more over the second.
        for ms in 0..1000u64 {
            if b.try_take_at(start + Duration::from_millis(ms)).is_ok() {
                admitted += 1;
            }
        }
        // (The token of t = 1000 ms is not reached by the loop, which stops at 999 ms.)
        assert_eq!(admitted, 5 + 49);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_over_its_quota_does_not_take_the_entrys_tokens() {
        let limiter = RateLimiter::new(RateLimits {
            entry: Some((100.0, 10)),
            per_caller: Some((1.0, 2)),
        });
        let now = Instant::now();
        assert!(limiter.try_admit_at("greedy", now).is_ok());
        assert!(limiter.try_admit_at("greedy", now).is_ok());
        for _ in 0..20 {
            let (which, after) = limiter.try_admit_at("greedy", now).unwrap_err();
            assert_eq!(which, Refused::Caller);
            assert_eq!(after, Duration::from_secs(1));
        }
        // The entry spent 2 of its 10 tokens: 8 remain for the others, then the entry refuses.
        let others: Vec<_> = (0..9)
            .map(|i| limiter.try_admit_at(&format!("polite-{i}"), now))
            .collect();
        assert!(others[..8].iter().all(Result::is_ok), "{others:?}");
        assert_eq!(others[8].unwrap_err().0, Refused::Entry);
    }

    #[tokio::test(start_paused = true)]
    async fn callers_beyond_the_table_share_one_bucket() {
        let limiter = RateLimiter::new(RateLimits {
            entry: None,
            per_caller: Some((1.0, 1)),
        });
        let now = Instant::now();
        for i in 0..MAX_CALLERS {
            assert!(limiter.try_admit_at(&format!("c{i}"), now).is_ok());
        }
        // Two newcomers: the first takes the shared bucket's token, the second finds it empty.
        assert!(limiter.try_admit_at("late-1", now).is_ok());
        assert_eq!(
            limiter.try_admit_at("late-2", now).unwrap_err().0,
            Refused::Caller
        );
        assert_eq!(limiter.callers.as_ref().unwrap().table.len(), MAX_CALLERS);
    }

    /// Callers whose buckets refilled make room: a server whose clients come and go (each
    /// process a new default client id) keeps giving newcomers a quota of their own.
    #[tokio::test(start_paused = true)]
    async fn callers_whose_buckets_refilled_make_room_for_new_ones() {
        let limiter = RateLimiter::new(RateLimits {
            entry: None,
            per_caller: Some((1.0, 2)),
        });
        let table = || limiter.callers.as_ref().unwrap().table.len();
        let start = Instant::now();
        for i in 0..MAX_CALLERS {
            assert!(limiter.try_admit_at(&format!("c{i}"), start).is_ok());
        }
        // Half a second on, the first half calls again: they hold half a token of two; the
        // others hold one and a half, and are not full either.
        let half = start + Duration::from_millis(500);
        for i in 0..MAX_CALLERS / 2 {
            assert!(limiter.try_admit_at(&format!("c{i}"), half).is_ok());
        }
        assert!(limiter.try_admit_at("early", half).is_ok());
        assert_eq!(
            table(),
            MAX_CALLERS,
            "nothing full: the newcomer shares the crowd's"
        );
        // At 1.5 s the second half is full again (1 + 1.5 tokens, burst 2); the first half
        // holds 0.5 + 1. The table was swept 1 s ago: a newcomer gets its own bucket.
        let later = start + Duration::from_millis(1500);
        assert!(limiter.try_admit_at("late", later).is_ok());
        assert_eq!(table(), MAX_CALLERS / 2 + 1);
        // Its own bucket: a burst of 2, not the crowd's (which "early" spent one of).
        assert!(limiter.try_admit_at("late", later).is_ok());
        assert_eq!(
            limiter.try_admit_at("late", later).unwrap_err().0,
            Refused::Caller
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_limits_every_call_is_admitted() {
        let limiter = RateLimiter::new(RateLimits {
            entry: None,
            per_caller: None,
        });
        assert!((0..10_000).all(|_| limiter.try_admit("anyone").is_ok()));
    }
}
