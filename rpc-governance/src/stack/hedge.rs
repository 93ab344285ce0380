//! Hedging as a layer: one slow answer in a hundred sets a call's p99, and waiting for it is
//! a choice. For an idempotent entry with `hedge_delay_ms` set, when the call has not answered
//! after that delay a second attempt (the hedge) goes to another endpoint, the balancer's next
//! candidate after the first attempt's; the first success wins and the other attempt is
//! dropped, which makes the transport send Cancel so its server stops too.
//!
//! A hedge is extra load, so it draws on the entry's retry budget
//! ([`RetryBudget::try_withdraw`](crate::budget::RetryBudget::try_withdraw)) and is not sent
//! once the budget is spent: under overload, when every call is slow, hedges stop by
//! themselves. The hedge is one attempt (its failure is not retried); the first attempt keeps
//! its retries.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use rpc_core::{GovernanceOptions, RpcError, RETRY_DEPTH_KEY};

use super::retry::retry_depth_mark;
use super::{CallCx, Service};
use crate::events::EventKind;

/// Sends a hedge of `S`'s call after `hedge_delay_ms` without an answer.
#[derive(Debug, Clone)]
pub struct HedgeLayer<S> {
    inner: S,
}

impl<S> HedgeLayer<S> {
    /// The layer over `inner` (the retry layer).
    pub fn new(inner: S) -> Self {
        HedgeLayer { inner }
    }
}

impl<S: Service> Service for HedgeLayer<S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let delay_ms = cx.options.hedge_delay_ms;
        if delay_ms == 0 || !cx.options.idempotent {
            return self.inner.call(cx, req).await;
        }
        let first = Arc::new(OnceLock::new());
        cx.first_endpoint = Some(first.clone());
        let options = Arc::new(GovernanceOptions {
            retry_times: 0,
            ..(*cx.options).clone()
        });
        let mut hedge_cx = cx.fork_hedge(options, None);
        // The hedge is an attempt of the same call: it carries the call's retry depth (its own
        // options, one attempt, would not).
        if let (_, Some(depth)) = retry_depth_mark(&cx.options) {
            hedge_cx.insert_attachment(RETRY_DEPTH_KEY, depth.to_string());
        }
        let primary_options = cx.options.clone();
        let started = cx.started();
        let sent = AtomicBool::new(false);
        let primary = self.inner.call(cx, req.clone());
        let hedge = async {
            tokio::time::sleep_until(started + Duration::from_millis(delay_ms)).await;
            if !hedge_cx.policy.budget.try_withdraw(&primary_options) {
                hedge_cx.emit(
                    EventKind::BudgetExhausted,
                    first.get().map(|a| &**a),
                    1,
                    Some("hedge not sent: the retry budget is spent".into()),
                );
                return None;
            }
            // Elsewhere than the first attempt: its endpoint counts as tried.
            hedge_cx.tried.extend(first.get().cloned());
            sent.store(true, Ordering::Relaxed);
            hedge_cx.emit(
                EventKind::Hedge,
                first.get().map(|a| &**a),
                1,
                Some(format!("no answer after {delay_ms} ms (hedge_delay_ms)")),
            );
            Some(self.inner.call(&mut hedge_cx, req).await)
        };
        tokio::pin!(primary, hedge);
        tokio::select! {
            biased;
            r = &mut primary => match r {
                Ok(bytes) => Ok(bytes),
                // The first attempt failed for good before any hedge: none is sent now.
                Err(e) if !sent.load(Ordering::Relaxed) => Err(e),
                // A hedge already sent may still answer.
                Err(e) => match hedge.await {
                    Some(Ok(bytes)) => Ok(bytes),
                    _ => Err(e),
                },
            },
            h = &mut hedge => match h {
                Some(Ok(bytes)) => Ok(bytes),
                // No hedge (budget spent), or it failed: the first attempt decides.
                _ => primary.await,
            },
        }
    }

    fn enforces_attempt_deadline(&self) -> bool {
        self.inner.enforces_attempt_deadline()
    }
}
