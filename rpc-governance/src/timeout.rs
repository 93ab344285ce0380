//! Timeout: the whole call's deadline.

use std::future::Future;
use std::time::Duration;

use rpc_core::{GovernanceOptions, RpcError, StatusCode};
use tokio::time::Instant;

/// The deadline of a call starting now, or `None` when `timeout_ms` is 0.
pub fn deadline(options: &GovernanceOptions) -> Option<Instant> {
    (options.timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(options.timeout_ms))
}

/// Milliseconds left before `deadline`, for `RemoteInvokeMessage.timeout_ms` (0 = none; at least
/// 1 while the deadline has not passed).
pub fn remaining_ms(deadline: Option<Instant>) -> u32 {
    match deadline {
        None => 0,
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now()).as_millis();
            left.clamp(1, u32::MAX as u128) as u32
        }
    }
}

/// Runs `call` until `deadline`. At the deadline the future is dropped, which cancels whatever
/// it was doing (an in-flight remote call sends `Cancel`), and a [`StatusCode::Timeout`] error
/// names the entry and the budget.
pub async fn run_until<F, T>(
    deadline: Option<Instant>,
    entry_id: &str,
    timeout_ms: u64,
    call: F,
) -> Result<T, RpcError>
where
    F: Future<Output = Result<T, RpcError>>,
{
    match deadline {
        None => call.await,
        Some(d) => match tokio::time::timeout_at(d, call).await {
            Ok(r) => r,
            Err(_) => {
                tracing::debug!(target: "rpc::governance", entry = entry_id, timeout_ms, "timeout");
                Err(RpcError::new(
                    StatusCode::Timeout,
                    format!(
                        "{entry_id} did not complete within {timeout_ms} ms; raise timeout_ms \
                         for the entry or look at the server's load"
                    ),
                ))
            }
        },
    }
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
        let r: Result<(), _> = run_until(deadline(&opts), "a.A.m", 100, async move {
            let _flag = flag;
            std::future::pending::<()>().await;
            Ok(())
        })
        .await;
        assert_eq!(r.unwrap_err().code(), StatusCode::Timeout);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn zero_disables() {
        let opts = GovernanceOptions {
            timeout_ms: 0,
            ..Default::default()
        };
        assert_eq!(deadline(&opts), None);
        assert_eq!(remaining_ms(None), 0);
        let r = run_until(None, "a.A.m", 0, async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok::<_, RpcError>(7)
        })
        .await;
        assert_eq!(r.unwrap(), 7);
    }
}
