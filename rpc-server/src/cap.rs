//! An entry's concurrency cap across rules changes.
//!
//! An entry runs under its own cap (`max_concurrent_handling_count`) or under the server's
//! shared cap, and a rules change can move it from one to the other while its calls run. Those
//! calls must stay counted where the entry goes: a cap starting from zero beside them would
//! admit its full size more. So an entry keeps two counts for its whole life, its calls holding
//! slots of its own caps and those holding slots of the shared cap, and the cap in force counts
//! the other kind beside its own slots until they end. (An own cap replaced by another own cap
//! goes on counting the same slots.)

use rpc_core::RpcError;
use rpc_governance::bulkhead::{Bulkhead, Permit};

/// The cap an entry's calls are admitted under, with the entry's counts of running calls.
#[derive(Debug, Clone)]
pub(crate) struct EntryCap {
    /// The cap admissions check now: the entry's own (a view of `on_own`) or the shared one.
    cap: Bulkhead,
    /// Whether `cap` is the entry's own.
    own: bool,
    /// The entry's calls holding slots of its own caps, whatever their sizes.
    on_own: Bulkhead,
    /// The entry's calls holding slots of the shared cap (a tally: it refuses nobody).
    on_shared: Bulkhead,
}

impl EntryCap {
    /// A new entry's cap: its own of `own` calls if it sets one, else `shared`.
    pub(crate) fn new(own: Option<usize>, shared: &Bulkhead) -> Self {
        EntryCap {
            cap: shared.clone(),
            own: false,
            on_own: Bulkhead::new(0),
            on_shared: Bulkhead::new(usize::MAX),
        }
        .next(own, shared)
    }

    /// The entry's cap after a rules change, in force from its next call: its own of `own`
    /// calls if it sets one, else `shared`. The calls running under the cap it leaves count
    /// against the new one until they end.
    pub(crate) fn next(&self, own: Option<usize>, shared: &Bulkhead) -> Self {
        match own {
            Some(size) => {
                if !self.own {
                    // Its calls under its former own caps count here again.
                    shared.stop_counting(&self.on_own);
                }
                let cap = self.on_own.resized(size);
                cap.count_beside(&self.on_shared);
                EntryCap {
                    cap,
                    own: true,
                    ..self.clone()
                }
            }
            None => {
                if self.own {
                    shared.count_beside(&self.on_own);
                }
                EntryCap {
                    cap: shared.clone(),
                    own: false,
                    ..self.clone()
                }
            }
        }
    }

    /// Takes a slot, or answers Overflow (515) at once, saying which cap is full: the entry's
    /// own, or the server's, which the entries without one share.
    pub(crate) fn try_enter(&self, entry: &str) -> Result<Permit, RpcError> {
        if self.own {
            return self.cap.try_enter(entry);
        }
        self.cap
            .try_enter_tallied(entry, &self.on_shared)
            .map_err(|e| {
                e.with_message(format!(
                    "the server's cap of {} concurrent calls (ServerBuilder::max_concurrency), \
                     shared by the entries without a cap of their own, is full; {entry} was not \
                     run, retry on another endpoint",
                    self.cap.size()
                ))
            })
    }

    /// The size of the cap in force.
    pub(crate) fn size(&self) -> usize {
        self.cap.size()
    }

    /// The calls the cap in force counts now (all entries' for the shared cap).
    pub(crate) fn in_use(&self) -> usize {
        self.cap.in_use()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(cap: &EntryCap, n: usize) -> Vec<Permit> {
        (0..n).map(|_| cap.try_enter("t.T.m").unwrap()).collect()
    }

    /// Counts how many more calls `cap` admits now (and lets them go).
    fn room(cap: &EntryCap) -> usize {
        let mut taken = Vec::new();
        while let Ok(p) = cap.try_enter("t.T.m") {
            taken.push(p);
            assert!(taken.len() <= 1000, "a bounded cap");
        }
        taken.len()
    }

    #[test]
    fn calls_under_the_shared_cap_count_against_the_entrys_new_own_cap() {
        let shared = Bulkhead::new(10);
        let entry = EntryCap::new(None, &shared);
        let running = hold(&entry, 3);
        let own = entry.next(Some(5), &shared);
        assert_eq!(room(&own), 2, "5 beside the 3 still running");
        drop(running);
        assert_eq!(room(&own), 5);
        assert_eq!(shared.in_use(), 0);
    }

    #[test]
    fn calls_under_an_own_cap_count_against_the_shared_cap_the_entry_moves_to() {
        let shared = Bulkhead::new(10);
        let other = EntryCap::new(None, &shared);
        let entry = EntryCap::new(Some(8), &shared);
        let running = hold(&entry, 6);
        let moved = entry.next(None, &shared);
        assert_eq!(shared.in_use(), 6);
        let mine = hold(&moved, 1);
        assert_eq!(room(&other), 3, "10 less the 6 still running and 1 more");
        drop(running);
        assert_eq!(room(&other), 9);
        drop(mine);
        assert_eq!(shared.in_use(), 0);
    }

    #[test]
    fn an_entry_moved_there_and_back_counts_each_call_once() {
        let shared = Bulkhead::new(10);
        let entry = EntryCap::new(Some(4), &shared);
        let under_own = hold(&entry, 2);
        let moved = entry.next(None, &shared);
        let under_shared = hold(&moved, 3);
        assert_eq!(shared.in_use(), 5);
        let back = moved.next(Some(6), &shared);
        assert_eq!(
            shared.in_use(),
            3,
            "the shared cap counts only its own slots again"
        );
        assert_eq!(room(&back), 1, "6 less the 2 and the 3 still running");
        drop((under_own, under_shared));
        assert_eq!(room(&back), 6);
        assert_eq!(shared.in_use(), 0);
    }
}
