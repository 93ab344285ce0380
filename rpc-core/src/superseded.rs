//! The losing attempt of a hedged call, as it is dropped.
//!
//! Why: a hedged call sends a second attempt when the first is slow, and drops whichever
//! loses. The loser's transport tells its server to stop with `Cancel`; without a reason the
//! server can only count the attempt as cancelled (a failure on its dashboards) although the
//! call succeeded. The governance layer that drops the loser does so inside [`superseding`],
//! and the transport, which drops the attempt's pending call in that same scope, reads
//! [`is_superseding`] and says why in its `Cancel`. Neither knows the other: a thread-local
//! mark is the one thing both see, since a future's drop runs on the thread that drops it.

use std::cell::Cell;

thread_local! {
    static SUPERSEDING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, which drops the attempts of a hedged call that lost to the one that answered,
/// with [`is_superseding`] true on this thread (also if `f` panics, the mark is cleared).
pub fn superseding<R>(f: impl FnOnce() -> R) -> R {
    /// Restores the mark however `f` ends.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SUPERSEDING.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(SUPERSEDING.with(|c| c.replace(true)));
    f()
}

/// Whether code on this thread runs while a hedged call's losing attempt is dropped (inside
/// [`superseding`]): a transport then tells its server that the attempt was superseded, not
/// given up.
pub fn is_superseding() -> bool {
    SUPERSEDING.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_holds_inside_the_scope_only() {
        assert!(!is_superseding());
        assert!(superseding(is_superseding));
        assert!(!is_superseding());
        let nested = superseding(|| {
            superseding(|| ());
            is_superseding()
        });
        assert!(nested, "an inner scope keeps the outer one's mark");
        let panicked = std::panic::catch_unwind(|| superseding(|| panic!("in the scope")));
        assert!(panicked.is_err());
        assert!(!is_superseding(), "cleared after a panic");
    }
}
