//! A stream's flow control in numbers, the same for both directions: what a producer may still
//! send ([`Credit`]) and what a receiver holds for its consumer ([`Held`]).
//!
//! A stream is held to a window of items and, when the receiver announced one (and the server
//! said in its `HelloAck` that it keeps byte windows), a window of payload bytes. Credit on the
//! wire counts items only: a grant of `k` items always frees the oldest `k` items not yet
//! granted, since a consumer takes items in order, so both sides learn the bytes freed from the
//! sizes they remember. Bytes are counted as they travel (compressed, when an item is). Keeping the arithmetic here, apart from the four places that use it
//! (the server's producer and inbound queue, the client's stream and its sender), keeps the two
//! sides of each direction agreeing on what a violation is.

use std::collections::VecDeque;

/// What a producer may still send on one stream.
#[derive(Debug, Default)]
pub(crate) struct Credit {
    /// Items it may send before more are granted.
    items: u64,
    /// The receiver's byte window; 0: items only.
    window_bytes: u64,
    /// Payload bytes sent and not yet granted back.
    bytes: u64,
    /// The size of each item sent and not yet granted back, oldest first (kept only with a
    /// byte window).
    sizes: Sizes,
}

impl Credit {
    /// A producer whose receiver buffers `items` items and `window_bytes` bytes (0: no byte
    /// limit).
    pub(crate) fn new(items: u64, window_bytes: u64) -> Self {
        Credit {
            items,
            window_bytes,
            ..Default::default()
        }
    }

    /// Whether one more item may be sent now: an item of credit is left, and the bytes in
    /// flight are below the byte window (the item may take them above it).
    pub(crate) fn ready(&self) -> bool {
        self.items > 0 && (self.window_bytes == 0 || self.bytes < self.window_bytes)
    }

    /// Items of credit left, whatever the bytes.
    pub(crate) fn items(&self) -> u64 {
        self.items
    }

    /// Counts an item of `len` bytes sent.
    pub(crate) fn sent(&mut self, len: usize) {
        self.items = self.items.saturating_sub(1);
        if self.window_bytes > 0 {
            let len = u32::try_from(len).unwrap_or(u32::MAX);
            self.bytes += u64::from(len);
            self.sizes.push(len);
        }
    }

    /// The receiver granted `items` more: as many of the oldest items in flight are freed.
    pub(crate) fn grant(&mut self, items: u64) {
        self.items = self.items.saturating_add(items);
        if self.window_bytes > 0 {
            free_oldest(&mut self.sizes, &mut self.bytes, items);
        }
    }
}

/// What a receiver holds of one stream: items received and not yet granted back.
#[derive(Debug)]
pub(crate) struct Held {
    window: u64,
    /// 0: the producer is held to items only.
    window_bytes: u64,
    items: u64,
    bytes: u64,
    /// The size on the wire of each item held, oldest first (kept only with a byte window).
    sizes: Sizes,
}

impl Held {
    /// A receiver with a window of `window` items and `window_bytes` bytes (0: not checked).
    pub(crate) fn new(window: u32, window_bytes: u64) -> Self {
        Held {
            window: u64::from(window.max(1)),
            window_bytes,
            items: 0,
            bytes: 0,
            sizes: Sizes::default(),
        }
    }

    /// Takes in an item of `len` bytes on the wire; false when the producer had no credit for it (the
    /// window of items was full, or the bytes held already reached the byte window).
    pub(crate) fn admit(&mut self, len: usize) -> bool {
        if self.items >= self.window || (self.window_bytes > 0 && self.bytes >= self.window_bytes) {
            return false;
        }
        self.items += 1;
        if self.window_bytes > 0 {
            let len = u32::try_from(len).unwrap_or(u32::MAX);
            self.bytes += u64::from(len);
            self.sizes.push(len);
        }
        true
    }

    /// `items` items, the oldest held, were granted back to the producer.
    pub(crate) fn release(&mut self, items: u64) {
        self.items = self.items.saturating_sub(items);
        free_oldest(&mut self.sizes, &mut self.bytes, items);
    }
}

/// What a consumer took since it last granted credit, and when it grants again: half the items
/// of the window, or half its bytes.
#[derive(Debug)]
pub(crate) struct Taken {
    grant_at: u64,
    grant_at_bytes: u64,
    items: u64,
    bytes: u64,
}

impl Taken {
    /// For a receiver with a window of `window` items and `window_bytes` bytes (0: items only).
    pub(crate) fn new(window: u32, window_bytes: u64) -> Self {
        Taken {
            grant_at: (u64::from(window) / 2).max(1),
            grant_at_bytes: if window_bytes == 0 {
                u64::MAX
            } else {
                (window_bytes / 2).max(1)
            },
            items: 0,
            bytes: 0,
        }
    }

    /// The items taken and not granted back yet, if any, now (the count starts again): for a
    /// consumer too slow to reach half its window within the peer's stall limit, which would
    /// otherwise see no credit and take the stream for stalled.
    pub(crate) fn flush(&mut self) -> Option<u64> {
        if self.items == 0 {
            return None;
        }
        self.bytes = 0;
        Some(std::mem::take(&mut self.items))
    }

    /// Counts an item of `len` bytes taken (its size on the wire, as the window counts it:
    /// compressed, when it travelled so); the items to grant back when it is time.
    pub(crate) fn take(&mut self, len: usize) -> Option<u64> {
        self.items += 1;
        self.bytes += len as u64;
        if self.items >= self.grant_at || self.bytes >= self.grant_at_bytes {
            self.bytes = 0;
            Some(std::mem::take(&mut self.items))
        } else {
            None
        }
    }
}

/// Frees the oldest `items` of `sizes` (in flight or held) from `bytes`: a grant of k items frees
/// the k oldest, the same on both sides, so neither needs to send the byte count.
fn free_oldest(sizes: &mut Sizes, bytes: &mut u64, items: u64) {
    *bytes -= sizes.pop_oldest(items);
}

/// The sizes of items in order, each run of equal sizes kept as one entry: a stream of
/// equal items (the common case) costs a count per item, not a slot in a queue. Items of
/// varying sizes take an entry each, 8 bytes, up to the window (8192 items by default on a
/// client: 64 KiB for a stream whose consumer stops reading; a server takes no client window
/// over [`MAX_STREAM_WINDOW`](crate::MAX_STREAM_WINDOW)).
#[derive(Debug, Default)]
struct Sizes {
    /// (size, items of that size), oldest first. A run never holds more than a window of
    /// items, itself a `u32`; a longer one continues in the next entry.
    runs: VecDeque<(u32, u32)>,
}

impl Sizes {
    fn push(&mut self, len: u32) {
        match self.runs.back_mut() {
            Some((size, n)) if *size == len && *n < u32::MAX => *n += 1,
            _ => self.runs.push_back((len, 1)),
        }
    }

    /// Removes the oldest `items` (all, when there are fewer); their bytes.
    fn pop_oldest(&mut self, mut items: u64) -> u64 {
        let mut freed = 0;
        while items > 0 {
            let Some((size, n)) = self.runs.front_mut() else {
                break;
            };
            let k = items.min(u64::from(*n));
            freed += k * u64::from(*size);
            // (k is at most *n, a u32.)
            *n -= k as u32;
            items -= k;
            if *n == 0 {
                self.runs.pop_front();
            }
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The next value of a linear congruential generator (Knuth's MMIX constants): the tests'
    /// reproducible sequence of sizes and steps.
    fn next(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *state
    }

    /// Against a queue of every size: the same bytes freed, whatever the runs.
    #[test]
    fn sizes_kept_as_runs_free_what_a_queue_of_every_size_frees() {
        let mut runs = Sizes::default();
        let mut every = VecDeque::new();
        let mut state = 11u64;
        for _ in 0..20_000 {
            let seed = next(&mut state);
            if (seed >> 60) < 10 {
                // Few distinct sizes, so runs form and break.
                let len = ((seed >> 40) % 3) as u32 * 100;
                runs.push(len);
                every.push_back(len);
            } else {
                let items = (seed >> 35) % 7;
                let n = usize::try_from(items).unwrap().min(every.len());
                let expected: u64 = every.drain(..n).map(u64::from).sum();
                assert_eq!(runs.pop_oldest(items), expected);
            }
        }
        let all = every.iter().map(|&l| u64::from(l)).sum::<u64>();
        assert_eq!(runs.pop_oldest(u64::MAX), all);
        assert!(runs.runs.is_empty());
    }

    #[test]
    fn a_producer_stops_at_the_item_window_and_a_grant_reopens_it() {
        let mut c = Credit::new(3, 0);
        for _ in 0..3 {
            assert!(c.ready());
            c.sent(1_000_000);
        }
        assert!(!c.ready(), "three items of credit, three sent");
        c.grant(2);
        assert!(c.ready());
        assert_eq!(c.items(), 2);
    }

    #[test]
    fn a_byte_window_stops_the_producer_after_the_item_that_reaches_it() {
        let mut c = Credit::new(100, 10);
        c.sent(4);
        c.sent(4);
        assert!(c.ready(), "8 of 10 bytes in flight");
        c.sent(7);
        assert!(
            !c.ready(),
            "15 bytes in flight: the last item went past the window"
        );
        // The oldest item freed: 11 bytes in flight, still at the window.
        c.grant(1);
        assert!(!c.ready());
        c.grant(1);
        assert!(c.ready(), "7 bytes in flight");
        // A grant beyond what is in flight frees everything and adds items.
        c.grant(5);
        assert!(c.ready());
        assert_eq!(c.items(), 100 - 3 + 7);
    }

    #[test]
    fn a_receiver_refuses_what_the_producer_had_no_credit_for() {
        let mut h = Held::new(2, 0);
        assert!(h.admit(1 << 20) && h.admit(1 << 20));
        assert!(!h.admit(1), "a third item in a window of two");
        h.release(1);
        assert!(h.admit(1));
        let mut h = Held::new(100, 10);
        assert!(h.admit(6));
        assert!(
            h.admit(6),
            "6 bytes held: below the window, so this one may go past it"
        );
        assert!(!h.admit(1), "12 bytes held reach the window of 10");
        h.release(1);
        assert!(h.admit(1));
    }

    /// Producer and receiver agree: whatever sizes, a producer that sends while it may never
    /// sends what the receiver refuses, and the receiver never holds more than its windows
    /// allow (items; bytes plus the one item that may go past).
    #[test]
    fn a_producer_within_its_credit_is_never_refused() {
        let (window, window_bytes) = (8u32, 1_000u64);
        let mut c = Credit::new(u64::from(window), window_bytes);
        let mut h = Held::new(window, window_bytes);
        let mut t = Taken::new(window, window_bytes);
        let mut queue = VecDeque::new();
        let mut state = 7u64;
        for round in 0..10_000 {
            let seed = next(&mut state);
            let len = ((seed >> 33) % 600) as usize;
            if c.ready() && round % 3 != 0 {
                c.sent(len);
                assert!(
                    h.admit(len),
                    "round {round}: an item within the credit refused"
                );
                queue.push_back(len);
                let held: usize = queue.iter().sum();
                assert!(queue.len() <= window as usize);
                assert!(held as u64 <= window_bytes + 600, "{held} bytes held");
            } else if let Some(len) = queue.pop_front() {
                if let Some(items) = t.take(len) {
                    h.release(items);
                    c.grant(items);
                }
            }
        }
    }
}
