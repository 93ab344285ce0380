//! Which endpoint answered: opt-in, per task.

use std::cell::RefCell;
use std::future::Future;

tokio::task_local! {
    static ANSWERED_BY: RefCell<Option<String>>;
}

/// Runs `call` (any future that makes remote calls, such as a proxy method) and returns its
/// output with the address of the endpoint that gave the last answer, if any did.
///
/// ```no_run
/// # async fn f(greeter: impl std::future::Future<Output = ()>) {
/// let ((), endpoint) = rpc_client::answered_by(greeter).await;
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

/// Records `addr` when the current task is inside [`answered_by`]; free otherwise.
pub(crate) fn record(addr: &str) {
    let _ = ANSWERED_BY.try_with(|a| *a.borrow_mut() = Some(addr.to_string()));
}
