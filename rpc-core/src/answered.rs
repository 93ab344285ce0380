//! Which endpoint answered a call: opt-in, per task.
//!
//! Why here: the client's transport records the address of each answer it gets, and the
//! governance layer that races two attempts of one call (the hedge) must say which of them gave
//! the answer it returns; neither knows the other, both know this crate.

use std::cell::RefCell;
use std::future::Future;

tokio::task_local! {
    static ANSWERED_BY: RefCell<Answered>;
}

/// What the attempts so far in an [`answered_by`] scope say.
enum Answered {
    /// No attempt yet.
    Unset,
    /// The last attempt got no answer (a connection that failed, a timeout).
    Nobody,
    /// The last attempt's answer came from this endpoint.
    By(String),
}

/// Runs `call` (any future that makes remote calls, such as a proxy method) and returns its
/// output with the address of the endpoint that gave the answer, if any did: the endpoint
/// whose answer (a success or an error it answered) the call returns, `"fallback"` for a
/// fallback's answer, `None` when the call's error came from no endpoint (a connection that
/// failed, a timeout with no answer). With several calls in `call`, the last one's.
///
/// ```no_run
/// # async fn f(greeter: impl std::future::Future<Output = ()>) {
/// let ((), endpoint) = rpc_core::answered::answered_by(greeter).await;
/// println!("answered by {endpoint:?}");
/// # }
/// ```
pub async fn answered_by<F: Future>(call: F) -> (F::Output, Option<String>) {
    ANSWERED_BY
        .scope(RefCell::new(Answered::Unset), async move {
            let out = call.await;
            let addr = ANSWERED_BY.with(|a| match a.replace(Answered::Unset) {
                Answered::By(addr) => Some(addr),
                Answered::Unset | Answered::Nobody => None,
            });
            (out, addr)
        })
        .await
}

/// Records `addr` as the endpoint that answered, when the current task is inside
/// [`answered_by`]; free otherwise.
pub fn record(addr: &str) {
    let _ = ANSWERED_BY.try_with(|a| *a.borrow_mut() = Answered::By(addr.to_string()));
}

/// Records that the last attempt got no answer (its connection failed, its time ran out):
/// an error the call returns from it was given by no endpoint.
pub fn record_nobody() {
    let _ = ANSWERED_BY.try_with(|a| *a.borrow_mut() = Answered::Nobody);
}

/// Records `addr` (`None`: no answer) only when no attempt was recorded before in the scope:
/// for an attempt that moves the call on without deciding it (an endpoint that does not serve
/// the call), which the call returns only when no attempt came before it (otherwise the call
/// decides on the attempt before, whose record stands).
pub fn record_if_first(addr: Option<&str>) {
    let _ = ANSWERED_BY.try_with(|a| {
        let mut a = a.borrow_mut();
        if matches!(*a, Answered::Unset) {
            *a = addr.map_or(Answered::Nobody, |addr| Answered::By(addr.to_string()));
        }
    });
}

/// Whether the current task is inside [`answered_by`]: a layer racing attempts needs to keep
/// each one's answer apart only then.
pub fn watched() -> bool {
    ANSWERED_BY.try_with(|_| ()).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_last_record_in_the_scope_is_the_answer_and_an_inner_scope_keeps_its_own() {
        assert!(!watched());
        record("nowhere"); // outside any scope: nothing to record into
        let ((inner, watched_inside), outer) = answered_by(async {
            record("a:1");
            let inner = answered_by(async { record("b:2") }).await;
            (inner, watched())
        })
        .await;
        assert_eq!(inner, ((), Some("b:2".to_string())));
        assert!(watched_inside);
        assert_eq!(
            outer.as_deref(),
            Some("a:1"),
            "the inner scope's record stays in it"
        );
    }

    #[tokio::test]
    async fn an_attempt_without_an_answer_clears_and_a_first_only_record_keeps_an_earlier_one() {
        let ((), by) = answered_by(async {
            record("a:1");
            record_nobody();
        })
        .await;
        assert_eq!(by, None, "the last attempt got no answer");
        let ((), by) = answered_by(async {
            record("a:1");
            record_if_first(Some("b:2"));
        })
        .await;
        assert_eq!(by.as_deref(), Some("a:1"));
        let ((), by) = answered_by(async {
            record_nobody();
            record_if_first(Some("b:2"));
        })
        .await;
        assert_eq!(by, None, "an attempt came first, with no answer");
        let ((), by) = answered_by(async { record_if_first(Some("b:2")) }).await;
        assert_eq!(by.as_deref(), Some("b:2"));
        let ((), by) = answered_by(async {
            record("a:1");
            record_if_first(None);
        })
        .await;
        assert_eq!(by.as_deref(), Some("a:1"));
    }
}
