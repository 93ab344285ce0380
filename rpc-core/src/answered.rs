//! Which endpoint answered a call: opt-in, per task.
//!
//! Why here: the client's transport records the address of each answer it gets, and the
//! governance layer that races two attempts of one call (the hedge) must say which of them gave
//! the answer it returns; neither knows the other, both know this crate.

use std::cell::RefCell;
use std::future::Future;

tokio::task_local! {
    static ANSWERED_BY: RefCell<Option<String>>;
}

/// Runs `call` (any future that makes remote calls, such as a proxy method) and returns its
/// output with the address of the endpoint that gave the answer, if any did.
///
/// ```no_run
/// # async fn f(greeter: impl std::future::Future<Output = ()>) {
/// let ((), endpoint) = rpc_core::answered::answered_by(greeter).await;
/// println!("answered by {endpoint:?}");
/// # }
/// ```
pub async fn answered_by<F: Future>(call: F) -> (F::Output, Option<String>) {
    ANSWERED_BY
        .scope(RefCell::new(None), async move {
            let out = call.await;
            let addr = ANSWERED_BY.with(|a| a.borrow_mut().take());
            (out, addr)
        })
        .await
}

/// Records `addr` as the endpoint that answered, when the current task is inside
/// [`answered_by`]; free otherwise.
pub fn record(addr: &str) {
    let _ = ANSWERED_BY.try_with(|a| *a.borrow_mut() = Some(addr.to_string()));
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
}
