//! Timeout: the whole call's deadline.
//!
//! A call made while a server handles another call inherits that call's deadline, less a slack
//! (`deadline_slack_ms`): were both to expire at the same moment, the middle tier's own
//! answer (its fallback, its error) would always arrive after its caller had given up.

use std::future::Future;
use std::time::Duration;

use rpc_core::{GovernanceOptions, RpcError, StatusCode};
use tokio::time::Instant;

tokio::task_local! {
    /// The deadline of the call a server is handling, seen by the calls its handler makes.
    static INHERITED: Option<Instant>;
}

/// Runs a handler's future with `deadline` as the budget its own outgoing calls inherit.
pub async fn with_inherited<F: Future>(deadline: Option<Instant>, f: F) -> F::Output {
    INHERITED.scope(deadline, f).await
}

/// Runs `f` with `deadline` as the budget the outgoing calls it starts inherit: the synchronous
/// form of [`with_inherited`], for polling a handler once in place.
pub fn sync_with_inherited<R>(deadline: Option<Instant>, f: impl FnOnce() -> R) -> R {
    INHERITED.sync_scope(deadline, f)
}

/// The deadline inherited from the call being handled, if any.
pub fn inherited() -> Option<Instant> {
    INHERITED.try_with(|d| *d).ok().flatten()
}

/// The deadline of a call starting now: the entry's `timeout_ms` (0 = none), shortened to what
/// is left of the call being handled, less the slack, when this runs inside a server handler.
pub fn deadline(options: &GovernanceOptions) -> Option<Instant> {
    deadline_from(Instant::now(), options)
}

/// [`deadline`] for a call that started at `now`.
pub fn deadline_from(now: Instant, options: &GovernanceOptions) -> Option<Instant> {
    let own = (options.timeout_ms > 0).then(|| now + Duration::from_millis(options.timeout_ms));
    let inherited = inherited().map(|b| b - slack(now, b, options));
    match (own, inherited) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The slack kept from an inherited deadline `b` at `now`: `deadline_slack_ms`, at most a
/// quarter of what is left.
fn slack(now: Instant, b: Instant, options: &GovernanceOptions) -> Duration {
    let left = b.saturating_duration_since(now);
    Duration::from_millis(options.deadline_slack_ms).min(left / 4)
}

/// True when the deadline inherited from the call being handled has passed: a fallback does
/// not start then, since its caller already has its timeout.
pub fn inherited_passed() -> bool {
    inherited().is_some_and(|d| Instant::now() >= d)
}

/// The error of a fallback not started because the caller's deadline had passed.
pub fn fallback_skipped(entry_id: &str, cause: &RpcError) -> RpcError {
    RpcError::new(
        StatusCode::Timeout,
        format!(
            "{entry_id} failed ({cause}) after its caller's deadline had passed; its fallback was \
             not started, since the caller has already timed out: give the caller a larger \
             timeout_ms, or this entry a smaller one"
        ),
    )
}

/// Milliseconds left before `deadline`, for `RemoteInvokeMessage.timeout_ms` (0 = none; at least
/// 1 while the deadline has not passed).
pub fn remaining_ms(deadline: Option<Instant>) -> u32 {
    remaining_ms_at(Instant::now(), deadline)
}

/// [`remaining_ms`] as seen at `now`.
pub fn remaining_ms_at(now: Instant, deadline: Option<Instant>) -> u32 {
    match deadline {
        None => 0,
        Some(d) => {
            // Rounded up: the server's deadline then falls at or after the caller's, so the
            // caller's own timer decides first (an attempt timeout is the caller's, retried
            // as such), never a 519 the server sends a fraction of a millisecond before it.
            let left = d.saturating_duration_since(now).as_micros().div_ceil(1000);
            left.clamp(1, u32::MAX as u128) as u32
        }
    }
}

/// Runs `call` until `deadline`. At the deadline the future is dropped, which cancels whatever
/// it was doing (an in-flight remote call sends `Cancel`), and a [`StatusCode::Timeout`] error
/// names the entry and the budget it had.
pub async fn run_until<F, T>(
    deadline: Option<Instant>,
    entry_id: &str,
    call: F,
) -> Result<T, RpcError>
where
    F: Future<Output = Result<T, RpcError>>,
{
    let Some(d) = deadline else {
        return call.await;
    };
    let started = Instant::now();
    run_until_from(started, d, entry_id, call).await
}

/// [`run_until`] for a call that started at `started` with deadline `d`.
pub async fn run_until_from<F, T>(
    started: Instant,
    d: Instant,
    entry_id: &str,
    call: F,
) -> Result<T, RpcError>
where
    F: Future<Output = Result<T, RpcError>>,
{
    match tokio::time::timeout_at(d, call).await {
        Ok(r) => r,
        Err(_) => Err(timeout_error(entry_id, started, d)),
    }
}

/// [`timeout_error`] that says when the budget was the caller's: `d` came from the deadline
/// inherited from the call being handled rather than the entry's own `timeout_ms`.
pub fn timeout_error_for(
    entry_id: &str,
    started: Instant,
    d: Instant,
    options: &GovernanceOptions,
) -> RpcError {
    if !is_callers(started, d, options) {
        return timeout_error(entry_id, started, d);
    }
    RpcError::new(
        StatusCode::Timeout,
        format!(
            "{entry_id} did not complete within its {} ms budget, inherited from the caller's \
             deadline (what was left of it, less up to {} ms kept to answer the caller); raise \
             the timeout_ms where the chain of calls starts, or look at the server's load",
            d.saturating_duration_since(started).as_millis(),
            options.deadline_slack_ms
        ),
    )
}

/// Whether the deadline `d` of a call that started at `started` is the caller's: it came from
/// the deadline inherited from the call being handled, not the entry's own `timeout_ms`.
pub fn is_callers(started: Instant, d: Instant, options: &GovernanceOptions) -> bool {
    let own = (options.timeout_ms > 0).then(|| started + Duration::from_millis(options.timeout_ms));
    inherited().is_some() && own.is_none_or(|own| d < own)
}

/// The error of a call that started at `started` and ran out of its deadline `d`. (Its
/// `timeout_ms` may be the entry's, at any level of its options, or the calling handle's own:
/// the remedy names both.)
pub fn timeout_error(entry_id: &str, started: Instant, d: Instant) -> RpcError {
    RpcError::new(
        StatusCode::Timeout,
        format!(
            "{entry_id} did not complete within its {} ms budget; raise its timeout_ms where it \
             is set (the entry's options, or this handle's: Client::with_timeout or \
             with_options) or look at the server's load",
            d.saturating_duration_since(started).as_millis()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn deadline_cancels_the_inner_future() {
        let opts = GovernanceOptions {
            timeout_ms: 100,
            ..Default::default()
        };
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Flag(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let flag = Flag(dropped.clone());
        let r: Result<(), _> = run_until(deadline(&opts), "a.A.m", async move {
            let _flag = flag;
            std::future::pending::<()>().await;
            Ok(())
        })
        .await;
        assert_eq!(r.unwrap_err().code(), StatusCode::Timeout);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn nested_calls_inherit_what_is_left() {
        let opts = GovernanceOptions {
            timeout_ms: 5000,
            ..Default::default()
        };
        let outer = Instant::now() + Duration::from_millis(300);
        // The default slack: 50 ms, under a quarter of the 300 ms left.
        let slack = Duration::from_millis(50);
        with_inherited(Some(outer), async {
            assert_eq!(
                deadline(&opts),
                Some(outer - slack),
                "the shorter inherited budget wins, less the slack"
            );
            let none = GovernanceOptions {
                timeout_ms: 0,
                ..Default::default()
            };
            assert_eq!(
                deadline(&none),
                Some(outer - slack),
                "even with no timeout of its own"
            );
        })
        .await;
        assert_eq!(inherited(), None);
        let generous = Instant::now() + Duration::from_secs(60);
        with_inherited(Some(generous), async {
            assert_eq!(
                deadline(&opts),
                Some(Instant::now() + Duration::from_millis(5000))
            );
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn the_slack_is_capped_at_a_quarter_of_what_is_left_and_configurable() {
        let opts = GovernanceOptions {
            timeout_ms: 0,
            ..Default::default()
        };
        let outer = Instant::now() + Duration::from_millis(40);
        with_inherited(Some(outer), async {
            assert_eq!(deadline(&opts), Some(outer - Duration::from_millis(10)));
        })
        .await;
        let outer = Instant::now() + Duration::from_millis(1000);
        let custom = GovernanceOptions {
            deadline_slack_ms: 120,
            ..opts.clone()
        };
        with_inherited(Some(outer), async {
            assert_eq!(deadline(&custom), Some(outer - Duration::from_millis(120)));
            let none = GovernanceOptions {
                deadline_slack_ms: 0,
                ..opts.clone()
            };
            assert_eq!(deadline(&none), Some(outer));
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeout_message_says_when_the_budget_was_the_callers() {
        let opts = GovernanceOptions {
            timeout_ms: 5000,
            ..Default::default()
        };
        let started = Instant::now();
        let outer = started + Duration::from_millis(300);
        let inherited_msg = with_inherited(Some(outer), async {
            let d = deadline_from(started, &opts).unwrap();
            timeout_error_for("a.A.m", started, d, &opts).to_string()
        })
        .await;
        assert!(
            inherited_msg.contains("250 ms budget, inherited from the caller's deadline"),
            "{inherited_msg}"
        );
        let own = GovernanceOptions {
            timeout_ms: 100,
            ..opts
        };
        let own_msg = with_inherited(Some(outer), async {
            let d = deadline_from(started, &own).unwrap();
            timeout_error_for("a.A.m", started, d, &own).to_string()
        })
        .await;
        assert!(
            own_msg.contains("100 ms budget") && !own_msg.contains("inherited"),
            "{own_msg}"
        );
    }

    #[test]
    fn the_budget_sent_is_rounded_up_so_the_server_never_ends_first() {
        let now = Instant::now();
        let at = |micros| Some(now + Duration::from_micros(micros));
        assert_eq!(remaining_ms_at(now, at(99_600)), 100);
        assert_eq!(remaining_ms_at(now, at(100_000)), 100);
        assert_eq!(remaining_ms_at(now, at(100_001)), 101);
        assert_eq!(remaining_ms_at(now, at(10)), 1);
        assert_eq!(
            remaining_ms_at(now + Duration::from_secs(1), at(10)),
            1,
            "passed: 1"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn zero_disables() {
        let opts = GovernanceOptions {
            timeout_ms: 0,
            ..Default::default()
        };
        assert_eq!(deadline(&opts), None);
        assert_eq!(remaining_ms(None), 0);
        let r = run_until(None, "a.A.m", async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok::<_, RpcError>(7)
        })
        .await;
        assert_eq!(r.unwrap(), 7);
    }
}
