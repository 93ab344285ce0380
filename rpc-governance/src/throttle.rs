//! Client-side adaptive throttling: when a service keeps refusing calls, send it fewer.
//!
//! A server refusing calls for overload (Overflow, a rate limit) still pays for each refusal: it
//! reads the frame, looks the entry up and answers. Clients that keep calling at full rate,
//! retries included, keep an overloaded server overloaded. The rule from Google's SRE book lets
//! each client notice the refusals on its own and drop the excess locally, with no coordination:
//! over a trailing window it counts the calls it wanted to make (`requests`, those it dropped
//! included) and those the server accepted (`accepts`), and drops a new call with probability
//!
//! ```text
//! max(0, (requests − K · accepts) / (requests + 1))
//! ```
//!
//! While the server accepts everything, `requests ≈ accepts` and, with K above 1, nothing is
//! dropped; K (2 by default) lets a client send up to K times what gets accepted before it
//! starts dropping, so a recovering server sees traffic growing back. An attempt that ends with
//! no answer (a hedge's cancelled loser, a timeout) is a request and not an accept, so with K at
//! 1 even a healthy server's client drops about as many calls as it has such attempts. The window is kept in ten slices, so old
//! counts leave it a slice at a time. Time is tokio's clock, so the paused clock drives it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Slices the window is kept in.
const SLICES: usize = 10;

/// One entry's (or service's) counts over the trailing window, and the drop rule.
#[derive(Debug)]
pub struct Throttle {
    k: f64,
    slice: Duration,
    state: Mutex<Window>,
    /// State of the draws' generator (splitmix64 over a counter).
    draws: AtomicU64,
}

#[derive(Debug)]
struct Window {
    /// Per slice: (requests, accepts); `at` is the start of the newest slice.
    slices: [(u64, u64); SLICES],
    newest: usize,
    at: Instant,
}

impl Window {
    /// Moves the window to `now`, emptying the slices that fell out of it.
    fn advance(&mut self, now: Instant, slice: Duration) {
        let mut steps = 0;
        while now.saturating_duration_since(self.at) >= slice && steps < SLICES {
            self.at += slice;
            self.newest = (self.newest + 1) % SLICES;
            self.slices[self.newest] = (0, 0);
            steps += 1;
        }
        if now.saturating_duration_since(self.at) >= slice {
            // Idle for longer than the whole window: every slice is empty already.
            self.at = now;
        }
    }

    fn totals(&self) -> (u64, u64) {
        self.slices
            .iter()
            .fold((0, 0), |(r, a), (sr, sa)| (r + sr, a + sa))
    }
}

impl Throttle {
    /// The rule with multiplier `k` (at least 1) over a trailing `window` (at least 10 ms).
    pub fn new(k: f64, window: Duration) -> Self {
        let window = window.max(Duration::from_millis(10));
        Throttle {
            k: k.max(1.0),
            slice: window / SLICES as u32,
            state: Mutex::new(Window {
                slices: [(0, 0); SLICES],
                newest: 0,
                at: Instant::now(),
            }),
            draws: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
        }
    }

    /// A uniform number in [0, 1) for [`admit_at`](Self::admit_at): splitmix64 over a
    /// counter, so a run is reproducible and no random-number crate is needed for a coin
    /// whose bias matters, not its secrecy.
    pub fn draw(&self) -> f64 {
        let mut z = self
            .draws
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The probability with which a call made at `now` is dropped.
    pub fn drop_probability_at(&self, now: Instant) -> f64 {
        self.drop_probability_with_k_at(now, self.k)
    }

    /// [`drop_probability_at`](Self::drop_probability_at) with multiplier `k` (at least 1), as
    /// [`admit_with_k_at`](Self::admit_with_k_at) decides with it.
    pub fn drop_probability_with_k_at(&self, now: Instant, k: f64) -> f64 {
        let mut w = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        w.advance(now, self.slice);
        let (requests, accepts) = w.totals();
        probability(requests, accepts, k.max(1.0))
    }

    /// Counts a call the application wants to make at `now` and decides whether to drop it:
    /// `draw` is a uniform random number in [0, 1) (the caller's, so that tests choose it).
    /// A dropped call counts as a request too, as the rule says.
    pub fn admit_at(&self, now: Instant, draw: f64) -> bool {
        self.admit_with_k_at(now, draw, self.k)
    }

    /// [`admit_at`](Self::admit_at) with multiplier `k` (at least 1) instead of the one given
    /// at construction, for callers whose K may change at run time.
    pub fn admit_with_k_at(&self, now: Instant, draw: f64, k: f64) -> bool {
        let k = k.max(1.0);
        let mut w = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        w.advance(now, self.slice);
        let (requests, accepts) = w.totals();
        let newest = w.newest;
        w.slices[newest].0 += 1;
        draw >= probability(requests, accepts, k)
    }

    /// Takes back a request counted (by [`admit_at`](Self::admit_at)) at `counted_at`: the
    /// attempt went nowhere (its endpoint cannot serve the call, so nothing was sent), and
    /// the rule counts what servers were asked. Nothing changes once that time's slice has
    /// left the window.
    pub fn withdraw_request_at(&self, counted_at: Instant, now: Instant) {
        let mut w = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        w.advance(now, self.slice);
        // The newest slice starts at `w.at`; slice `age` before it covers
        // [at - age·slice, at - (age - 1)·slice).
        let before = w.at.saturating_duration_since(counted_at);
        let age = before.as_nanos().div_ceil(self.slice.as_nanos().max(1));
        if age < SLICES as u128 {
            let i = (w.newest + SLICES - age as usize) % SLICES;
            w.slices[i].0 = w.slices[i].0.saturating_sub(1);
        }
    }

    /// Counts a call the server accepted (answered, whatever the answer, other than a refusal
    /// for overload or rate).
    pub fn accepted_at(&self, now: Instant) {
        let mut w = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        w.advance(now, self.slice);
        let newest = w.newest;
        w.slices[newest].1 += 1;
    }
}

fn probability(requests: u64, accepts: u64, k: f64) -> f64 {
    ((requests as f64 - k * accepts as f64) / (requests as f64 + 1.0)).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn while_the_server_accepts_everything_nothing_is_dropped() {
        let t = Throttle::new(2.0, WINDOW);
        for _ in 0..1000 {
            let now = Instant::now();
            // The lowest draw is dropped by any positive probability.
            assert!(t.admit_at(now, 0.0));
            t.accepted_at(now);
        }
        assert_eq!(t.drop_probability_at(Instant::now()), 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_drop_probability_follows_the_sre_formula() {
        let t = Throttle::new(2.0, WINDOW);
        let now = Instant::now();
        // 100 requests, 10 accepted: (100 - 2 * 10) / (100 + 1).
        for i in 0..100 {
            t.admit_at(now, 1.0);
            if i < 10 {
                t.accepted_at(now);
            }
        }
        let p = t.drop_probability_at(now);
        assert!((p - 80.0 / 101.0).abs() < 1e-12, "{p}");
        // A draw below p is dropped, one above is not.
        assert!(!t.admit_at(now, p - 0.01));
        assert!(t.admit_at(now, 0.99));
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_accepts_nothing_is_sent_almost_nothing() {
        // Simulated: the server accepts nothing; draws are spread evenly over [0, 1).
        let t = Throttle::new(2.0, WINDOW);
        let now = Instant::now();
        let sent = (0..1000)
            .filter(|i| t.admit_at(now, ((i * 7919) % 1000) as f64 / 1000.0))
            .count();
        // With no accepts the probability is r / (r + 1): call r goes out when its draw is at
        // least r / (r + 1), about 1 / (r + 1) of the time, so about ln(1000) + 0.58 ≈ 7.5
        // calls of the 1000 go out.
        assert!(sent < 20, "{sent} of 1000 calls still sent");
    }

    #[test]
    fn draws_are_spread_evenly_over_the_unit_interval() {
        let t = Throttle::new(2.0, WINDOW);
        let mut tenths = [0u32; 10];
        for _ in 0..10_000 {
            let d = t.draw();
            assert!((0.0..1.0).contains(&d), "{d}");
            tenths[(d * 10.0) as usize] += 1;
        }
        // 1 000 expected per tenth; a fair coin stays within ±15 % at this count.
        assert!(
            tenths.iter().all(|&n| (850..=1150).contains(&n)),
            "{tenths:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn old_counts_leave_the_window() {
        let t = Throttle::new(2.0, WINDOW);
        let now = Instant::now();
        for _ in 0..100 {
            t.admit_at(now, 1.0);
        }
        assert!(t.drop_probability_at(now) > 0.9);
        // Half the window later the refusals still count...
        tokio::time::advance(WINDOW / 2).await;
        assert!(t.drop_probability_at(Instant::now()) > 0.9);
        // ... a whole window later they are gone.
        tokio::time::advance(WINDOW / 2 + WINDOW / 10).await;
        assert_eq!(t.drop_probability_at(Instant::now()), 0.0);
        // So is everything after an idle period far longer than the window.
        for _ in 0..100 {
            t.admit_at(Instant::now(), 1.0);
        }
        tokio::time::advance(WINDOW * 100).await;
        assert_eq!(t.drop_probability_at(Instant::now()), 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_withdrawn_request_leaves_the_slice_it_was_counted_in() {
        let t = Throttle::new(2.0, WINDOW);
        let t0 = Instant::now();
        for _ in 0..5 {
            t.admit_at(t0, 1.0);
        }
        // Three slices later, one of the five is taken back: r = 4, a = 0, 4 / 5.
        tokio::time::advance(WINDOW * 3 / 10).await;
        t.withdraw_request_at(t0, Instant::now());
        let p = t.drop_probability_at(Instant::now());
        assert!((p - 4.0 / 5.0).abs() < 1e-12, "{p}");
        // One request now; once t0's slice has left the window, withdrawing a request of t0
        // takes nothing from the newer one: r = 1, 1 / 2.
        let t1 = Instant::now();
        t.admit_at(t1, 1.0);
        tokio::time::advance(WINDOW * 7 / 10 + WINDOW / 20).await;
        let now = Instant::now();
        t.withdraw_request_at(t0, now);
        let p = t.drop_probability_at(now);
        assert!((p - 1.0 / 2.0).abs() < 1e-12, "{p}");
        // The newer one is withdrawn from its own slice: nothing is left.
        t.withdraw_request_at(t1, now);
        assert_eq!(t.drop_probability_at(now), 0.0);
    }
}
