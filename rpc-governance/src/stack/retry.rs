//! Retry and failover as a layer: a failed attempt that another endpoint (or a moment) may cure
//! is tried again, on the balancer's next candidate, within the retry budget and before the
//! call's deadline.
//!
//! The decisions are [`crate::retry`], [`crate::failover`] and [`crate::budget`]; failures that
//! belong to one endpoint are held against it in [`crate::health`] first. This layer also
//! enforces each attempt's deadline (`attempt_timeout_ms`, or the call's): an attempt still
//! running then is dropped, whatever it does with the deadline it was given.
//!
//! Retries across hops multiply: three levels that each try four times hit a failing leaf 64
//! times per call. So a call this layer may retry says so to the server (attachment
//! [`RETRY_DEPTH_KEY`](rpc_core::RETRY_DEPTH_KEY), the number of retrying callers up the chain), the server hands it to
//! its handler's context, and a call made there is not retried again (`retry_chain_stop`,
//! on by default): the outermost caller that retries owns the retries of the whole chain.

use std::future::Future;
use std::sync::Arc;
use std::sync::PoisonError;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use rpc_core::{GovernanceOptions, RpcContext, RpcError, StatusCode};
use tokio::time::Instant;

use super::context::{Paused, ServedFailure};
use super::{Balance, CallCx, Pick, Service};
use crate::events::EventKind;
use crate::failover;
use crate::health::Fault;
use crate::retry::{self, Decision};
use crate::timeout;

/// Runs attempts of `S` on the candidates of `B`.
#[derive(Debug, Clone)]
pub struct RetryLayer<B, S> {
    balance: B,
    inner: S,
}

impl<B, S> RetryLayer<B, S> {
    /// Attempts of `inner` on the endpoints `balance` yields.
    pub fn new(balance: B, inner: S) -> Self {
        RetryLayer { balance, inner }
    }
}

impl<B: Balance, S: Service> Service for RetryLayer<B, S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let started = cx.started();
        let deadline = cx.deadline;
        // The candidates, under the call's deadline too: finding them may wait (a registry's
        // first answer). The clock is read again, and a timer armed, only when it does.
        let (mut picker, waited) = {
            let mut picking = std::pin::pin!(self.balance.picker(cx));
            match std::future::poll_fn(|c| Poll::Ready(picking.as_mut().poll(c))).await {
                Poll::Ready(picked) => (picked?, false),
                Poll::Pending => {
                    let picked = match deadline {
                        Some(d) => tokio::time::timeout_at(d, picking).await.map_err(|_| {
                            RpcError::new(
                                StatusCode::Timeout,
                                "no endpoint was known before the deadline",
                            )
                        })?,
                        None => picking.await,
                    };
                    (picked?, true)
                }
            }
        };
        if let Some(gate) = cx.hedge_gate.take() {
            // The call's deadline passed as the hedge's delay did: no hedge, and nothing
            // drawn from the budget nor said of one.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(RpcError::new(
                    StatusCode::Timeout,
                    "no hedge sent: the call's deadline passed",
                ));
            }
            // A hedge goes to an endpoint its call has not tried, or nowhere: decided on this
            // picker (its routing group drawn), the one the hedge goes by, with the endpoints
            // of the call's attempts as they are now (the first may have been picked while
            // this picker was, or failed over since).
            let first_sent = !gate
                .attempted
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty();
            cx.attempted = Some(gate.attempted.clone());
            cx.pass_the_calls_other_attempts();
            let sent = (first_sent && picker.untried_left(cx))
                .then(|| (gate.send)(cx))
                .flatten();
            cx.hedge_sent = sent;
            if cx.hedge_sent.is_none() {
                return Err(RpcError::new(
                    StatusCode::CommunicationError,
                    "no hedge sent: no other endpoint, the first attempt not sent yet, or the retry \
                     budget spent",
                ));
            }
        }
        if !cx.hedge {
            cx.policy.budget.deposit_at(started);
        }
        let enforced = self.inner.enforces_attempt_deadline();
        let chain_stopped = mark_retry_depth(cx);
        loop {
            // A hedged call's two attempts run side by side: each fails over past the
            // endpoints the other went to.
            cx.pass_the_calls_other_attempts();
            let addr = match picker.next(cx) {
                Ok(addr) => addr,
                Err(e) => {
                    // No endpoint for this attempt: what fails the call is local, not an
                    // answer of the endpoint an earlier attempt went to.
                    cx.endpoint = None;
                    return Err(e);
                }
            };
            if let Some(run) = cx.hedge_run.clone() {
                if cx.hedge {
                    run.start(addr.clone());
                } else if run.wait_off(&addr).await {
                    // A retry of the first attempt picked the endpoint the hedge is on: sent
                    // now it would run the call there twice. It waited for the hedge to end
                    // (had the hedge answered, the call would be over), and picks again.
                    continue;
                }
            }
            // An endpoint that refused an earlier attempt saying when to come back is not sent
            // the call before then: the pause is waited out when it ends before the deadline,
            // else the call ends with that refusal (which carries its `retry_after`).
            if let Some(i) = cx.paused.iter().position(|p| p.endpoint == addr) {
                let until = cx.paused[i].until;
                if until > Instant::now() {
                    if deadline.is_some_and(|d| until >= d) {
                        let p = cx.paused.swap_remove(i);
                        cx.failed_attempt = Some(p.attempt);
                        cx.last_failed = Some(p.endpoint.clone());
                        cx.endpoint = Some(p.endpoint);
                        return Err(failover::final_error(p.refusal, tried(cx)));
                    }
                    tokio::time::sleep_until(until).await;
                }
            }
            if let Some(attempted) = &cx.attempted {
                attempted
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(addr.clone());
            }
            // The first attempt starts when the call did, unless finding the endpoints or
            // work before the stack (`CallCx::with_started`) took time: its own deadline and
            // the budget sent count from when it really starts.
            let now = if cx.attempt == 0 && !waited && !cx.started_early {
                // A deadline inherited from a caller may have passed before this call began:
                // then nothing is sent (no clock read needed to know).
                if deadline.is_some_and(|d| started >= d) {
                    return Err(RpcError::new(
                        StatusCode::Timeout,
                        "the caller's deadline passed before this call began",
                    ));
                }
                started
            } else {
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    return Err(RpcError::new(StatusCode::Timeout, "deadline passed"));
                }
                now
            };
            // The attempt's own deadline, when `attempt_timeout_ms` ends it before the call's.
            let attempt_timeout_ms = cx.options.attempt_timeout_ms;
            let own = (attempt_timeout_ms > 0)
                .then(|| now + Duration::from_millis(attempt_timeout_ms))
                .filter(|a| deadline.is_none_or(|d| *a < d));
            let attempt_deadline = own.or(deadline);
            cx.attempt_deadline = attempt_deadline;
            cx.budget_ms = timeout::remaining_ms_at(now, attempt_deadline);
            cx.endpoint = Some(addr.clone());
            cx.connection = None;
            cx.answered_by_layer = false;
            let hooks = cx.stream_end_hooks();
            // From here a failure is this attempt's: the number kept by the last decision
            // stands only for a call that ends before another attempt is sent.
            cx.failed_attempt = None;
            let call = self.inner.call(cx, req.clone());
            // Enforced here too, so no attempt outlives its deadline whatever it does with it,
            // unless the attempt itself promises to end at the deadline (a connection's
            // deadline sweeper does, for all its calls with one timer): a second timer per
            // attempt would only cost.
            let outcome = match attempt_deadline {
                Some(d) if !enforced => match tokio::time::timeout_at(d, call).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        // Dropped still in a per-attempt layer: adaptive throttling counted a
                        // request that never went, and forgets it now (see `unsent`).
                        cx.unsent_request = None;
                        Err(RpcError::new(
                            StatusCode::Timeout,
                            format!("{addr}: no answer before the deadline"),
                        ))
                    }
                },
                _ => call.await,
            };
            let err = match outcome {
                Ok(bytes) => {
                    // (A layer's own answer says nothing of the endpoint.)
                    if !cx.answered_by_layer {
                        cx.health().success(&addr);
                    }
                    return Ok(bytes);
                }
                // A per-attempt layer's failure, the timer's above included (its time ran out
                // before it passed the call on): nothing was sent.
                Err(e) if cx.answered_by_layer => e.not_sent(true).maybe_delivered(false),
                Err(e) => e,
            };
            // This attempt opened no stream: what its layers asked to be told of its end goes.
            cx.drop_stream_end_hooks_from(hooks);
            match self.after_failure(cx, &picker, addr, err, own, chain_stopped) {
                Ok(after) => {
                    cx.attempt += 1;
                    if !after.is_zero() {
                        tokio::time::sleep(after).await;
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl<B: Balance, S> RetryLayer<B, S> {
    /// Judges a failed attempt on `addr`: holds it against the endpoint when it belongs there,
    /// then either returns the pause before the next attempt or the call's final error.
    fn after_failure(
        &self,
        cx: &mut CallCx<'_>,
        picker: &B::Picker,
        addr: Arc<str>,
        mut err: RpcError,
        own_deadline: Option<Instant>,
        chain_stopped: bool,
    ) -> Result<Duration, RpcError> {
        let attempt = cx.attempt;
        // What is left untried is judged with the endpoints the call's other attempt (a hedge,
        // or the first attempt of a hedge) went to meanwhile; this attempt's own endpoint is
        // recorded below, once, as the last one tried.
        cx.pass_the_calls_other_attempts_but(Some(&addr));
        if cx.throttled {
            // Dropped locally: nothing was sent, nothing to hold against the endpoint, and an
            // attempt right away would be dropped again. The drop is the call's failure: the
            // dropped attempt's, with the endpoint it was for (as the `throttled` event says).
            cx.failed_attempt = Some(attempt);
            cx.last_failed = Some(addr.clone());
            cx.tried.push(addr);
            return Err(err);
        }
        // The attempt's own deadline passed: a timeout then is that deadline's. A 519 the
        // server answered before it (its own deadline down the chain, a typed error carrying
        // a timeout) is the server's answer, judged as any other.
        let own_passed = own_deadline.is_some_and(|own| Instant::now() >= own);
        // The attempt's deadline (not the call's) passed before the call was even sent (the
        // connection's send queue stayed full): nothing reached the server, so the call may go
        // elsewhere, or to the same endpoint again, as after any failure that sent nothing,
        // idempotent or not. The endpoint is connected (reached), only slow to read: held
        // against it as a slow one, not as one that cannot be reached.
        let unsent_timeout = own_passed
            && err.code() == StatusCode::Timeout
            && err.is_not_sent()
            && cx.deadline.is_none_or(|d| Instant::now() < d);
        if unsent_timeout {
            err = RpcError::new(
                StatusCode::CommunicationError,
                format!(
                    "{addr}: not sent within the attempt timeout of {} ms ({})",
                    cx.options.attempt_timeout_ms,
                    err.message()
                ),
            );
        }
        let mut attempt_timed_out =
            err.code() == StatusCode::Timeout && err.payload().is_none() && own_passed;
        if attempt_timed_out {
            err = RpcError::new(
                StatusCode::Timeout,
                format!(
                    "{addr}: no answer within the attempt timeout of {} ms \
                     (attempt_timeout_ms); the server was told to stop",
                    cx.options.attempt_timeout_ms
                ),
            )
            .maybe_delivered(true);
            cx.emit(
                EventKind::Timeout,
                Some(&addr),
                attempt,
                Some(err.to_string()),
            );
        }
        // The caller's deadline passed (what was left of the deadline it inherited, shorter
        // than the entry's own timeout): the caller had too little time left, which says
        // nothing of the endpoint, nor of the entry for the breaker.
        cx.out_of_callers_time = !attempt_timed_out && cx.is_callers_deadline(&err);
        // An endpoint that cannot serve the call says nothing of its health either way.
        let mut unsupported = err.is_unsupported_by_endpoint();
        // A per-attempt layer's own answer: the endpoint was not asked.
        let layers_own = cx.answered_by_layer;
        let mut fault = if layers_own {
            None
        } else if unsent_timeout {
            Some(Fault::Sick)
        } else {
            Fault::of(&err)
        }
        .filter(|_| !cx.out_of_callers_time && !unsupported);
        if let Some(fault) = fault {
            self.hold_against(cx, &addr, fault, &err);
        } else if !layers_own
            && err.code().is_breaker_exempt()
            && !unsupported
            && err.code() != StatusCode::RateLimited
        {
            // The callee's own logic answered: the endpoint is up. (A rate limit comes before
            // any handler, and says nothing of its health.)
            cx.health().success(&addr);
        }
        cx.last_failed = Some(addr.clone());
        cx.last_said_when = err.retry_after().is_some();
        if let Some(wait) = err.retry_after() {
            cx.paused.retain(|p| p.endpoint != addr);
            cx.paused.push(Paused {
                endpoint: addr.clone(),
                until: Instant::now() + wait,
                attempt,
                refusal: err.clone(),
            });
        }
        if unsupported {
            cx.unable.push(addr.clone());
        } else if !layers_own
            && (err.code() != StatusCode::CommunicationError
                || err.is_maybe_delivered()
                || unsent_timeout)
        {
            cx.reached = true;
        }
        let mut last = addr.clone();
        cx.tried.push(addr);
        let untried_left = picker.untried_left(cx);
        let mut decision = decide(cx, &err, attempt_timed_out, attempt, untried_left);
        // No endpoint left at all (the service's, or the call's routing group, emptied while
        // the attempt was out): a retry could not be sent. The call ends with this failure,
        // not after the retry's wait with "no endpoint", and draws nothing from the budget.
        if !untried_left && !picker.any_candidate(cx) {
            decision = Decision::GiveUp;
        }
        // A hedge is one attempt sent, and one aimed at an endpoint that cannot serve the call
        // was not sent: it moves on to the next untried endpoint, so that the hedge its gate
        // paid for (budget, event) goes where it can be served, or nowhere when none is left.
        if unsupported && cx.hedge && untried_left {
            decision = Decision::Retry {
                after: Duration::ZERO,
            };
        }
        // A detour to an endpoint that cannot serve the call (nothing was sent) after which the
        // call would give up (nothing untried left, or no attempt left): the call decides on
        // the failure before it, on an endpoint that can serve it, as it would have with no
        // detour, and ends with that failure if it ends. The balancer leaves the unable
        // endpoint out of its candidates from now on. The detour counts as an attempt; the
        // retry budget was drawn once for the retry that became the detour, and covers this
        // one.
        let mut detoured = None;
        // The number of the attempt whose failure is decided on: this one, or the one before
        // a detour.
        let mut failed_at = attempt;
        if unsupported && decision == Decision::GiveUp {
            if let Some(before) = cx.served_failure.take() {
                let before = *before;
                detoured = Some(last.clone());
                err = before.error;
                attempt_timed_out = before.attempt_timed_out;
                fault = Fault::of(&err);
                unsupported = false;
                last = before.endpoint;
                cx.last_failed = Some(last.clone());
                failed_at = before.attempt;
                decision = decide(cx, &err, attempt_timed_out, attempt, untried_left);
            }
        }
        // A detour that is retried: should the call end before another attempt is sent (no
        // endpoint found, its deadline passed), its failure is the one before the detour, on
        // an endpoint that could serve it.
        if unsupported {
            if let Some(before) = &cx.served_failure {
                cx.last_failed = Some(before.endpoint.clone());
                failed_at = before.attempt;
            }
        }
        // The attempt the call's failure is, should it end before another attempt is sent.
        cx.failed_attempt = Some(failed_at);
        // The stop is for failures a server saw (refusals, errors, calls that may have been
        // delivered): retrying those multiplies load down the chain. Moving on from an endpoint
        // the call never reached (connection refused, nothing sent) costs no server anything,
        // so a middle tier still fails over from a dead instance.
        let never_reached = (err.code() == StatusCode::CommunicationError
            && !err.is_maybe_delivered())
            || unsupported;
        if chain_stopped && !never_reached && matches!(decision, Decision::Retry { .. }) {
            let msg = format!(
                "{}; not retried: this call was made while serving a call that a caller up the \
                 chain retries (retry_chain_stop), so that retries do not multiply across hops",
                err.message()
            );
            let stopped = err.with_message(msg);
            cx.endpoint_held = fault.is_some() && picker.any_other_usable(&last, cx);
            cx.attempt_timed_out = attempt_timed_out;
            return Err(failover::final_error(stopped, tried(cx)));
        }
        let after = match decision {
            Decision::Retry { after } => after,
            Decision::GiveUp => {
                // Held against the endpoint (not the entry's breaker) while another endpoint
                // is usable, a maybe-delivered failure of a call that may not be repeated
                // included: when every endpoint is marked, the entry as a whole is failing.
                cx.endpoint_held = fault.is_some() && picker.any_other_usable(&last, cx);
                cx.attempt_timed_out = attempt_timed_out;
                return Err(failover::final_error(err, tried(cx)));
            }
        };
        // Moving on from an endpoint that cannot serve the call loads no server: no budget.
        if !unsupported && detoured.is_none() && !cx.policy.budget.try_withdraw(&cx.options) {
            cx.emit(
                EventKind::BudgetExhausted,
                Some(&last),
                attempt,
                Some(err.to_string()),
            );
            let msg = format!(
                "{}; not retried: the retry budget of {} is spent (retries are capped at {} % \
                 of calls, at least {}/s)",
                err.message(),
                cx.entry_id(),
                cx.options.retry_budget_percent,
                cx.options.retry_budget_min_per_second
            );
            let spent = err.with_message(msg);
            cx.endpoint_held = fault.is_some() && picker.any_other_usable(&last, cx);
            cx.attempt_timed_out = attempt_timed_out;
            return Err(failover::final_error(spent, tried(cx)));
        }
        let why = match &detoured {
            None => err.to_string(),
            Some(detour) => format!("{err} (retried after {detour}, which cannot serve the call)"),
        };
        // The failure retried, with its endpoint's attempt: after a detour that would have
        // ended the call, the failure before it (not the detour's number); an endpoint that
        // cannot serve the call is named with its own.
        let retried_at = if detoured.is_some() {
            failed_at
        } else {
            attempt
        };
        cx.emit(EventKind::Retry, Some(&last), retried_at, Some(why));
        // Kept for a detour that may follow (see above): moved, not copied, and only for a
        // failure that is retried.
        if !unsupported {
            cx.served_failure = Some(Box::new(ServedFailure {
                error: err,
                endpoint: last,
                attempt: failed_at,
                attempt_timed_out,
            }));
        }
        Ok(after)
    }

    /// Holds a failure against `addr` in endpoint health; an ejection (or removal) is an event.
    fn hold_against(&self, cx: &CallCx<'_>, addr: &str, fault: Fault, err: &RpcError) {
        if !self.balance.listed(addr, cx) {
            // It left while the attempt was out: a mark now would outlive it.
            return;
        }
        let connection = match fault {
            Fault::Transport => cx.connection,
            Fault::Sick => None,
        };
        let cause = err.to_string();
        let r = cx
            .health()
            .record_failure(addr, fault, connection, &cause, &cx.options);
        let Some(for_) = r.ejected_for else { return };
        let what = if r.removed {
            "removed; probed in the background until it answers".to_string()
        } else {
            format!("avoided for {} ms", for_.as_millis())
        };
        cx.emit(
            EventKind::Ejection,
            Some(addr),
            cx.attempt,
            Some(format!("{cause} ({} in a row; {what})", r.consecutive)),
        );
        if r.removed {
            self.balance.removed(addr);
        }
    }
}

/// Sets the retry depth the call carries ([`RETRY_DEPTH_KEY`](rpc_core::RETRY_DEPTH_KEY)):
/// one more than the depth of the call being served when its client may retry it, else the
/// depth already set (a hedge's, marked by the hedge layer for the call it belongs to), else
/// the served call's depth as it came; returns whether the chain stop forbids this call's
/// retries.
pub(crate) fn mark_retry_depth(cx: &mut CallCx<'_>) -> bool {
    let (chain_stopped, mark) = retry_depth_mark(&cx.options);
    if let Some(depth) = mark {
        cx.retry_depth = depth;
    } else if cx.retry_depth == 0 {
        cx.retry_depth = RpcContext::retry_depth();
    }
    chain_stopped
}

/// Under `options`, in the call being served: whether the chain stop forbids retries, and the
/// retry depth to send when the call may be retried.
pub(crate) fn retry_depth_mark(options: &GovernanceOptions) -> (bool, Option<u32>) {
    let depth = RpcContext::retry_depth();
    let chain_stopped = depth > 0 && options.retry_chain_stop;
    let mark = (!chain_stopped && options.retry_times > 0).then(|| depth.saturating_add(1));
    (chain_stopped, mark)
}

/// The endpoints tried, for the final error.
fn tried(cx: &CallCx<'_>) -> Vec<String> {
    cx.tried.iter().map(|a| a.to_string()).collect()
}

/// What follows a failed attempt (`err`, numbered `attempt`): after the attempt's own
/// timeout, [`retry::decide_after_attempt_timeout`]; else [`failover::decide`].
fn decide(
    cx: &CallCx,
    err: &RpcError,
    attempt_timed_out: bool,
    attempt: u32,
    untried_left: bool,
) -> Decision {
    if attempt_timed_out {
        retry::decide_after_attempt_timeout(attempt, &cx.options, cx.deadline)
    } else {
        failover::decide(
            err,
            attempt,
            &cx.options,
            cx.deadline,
            untried_left,
            cx.reached,
        )
    }
}
