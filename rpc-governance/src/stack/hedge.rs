//! Hedging as a layer: one slow answer in a hundred sets a call's p99, and waiting for it is
//! a choice. For an idempotent entry with `hedge_delay_ms` set, when the call has not answered
//! after that delay a second attempt (the hedge) goes to another endpoint, the balancer's next
//! candidate after those the call's attempts went to, in the routing group the call drew (one
//! call, one group); the first answer (a success, or an error the callee answered) wins and
//! the other attempt is dropped, which makes the transport send Cancel so its server stops
//! too. A failure to get an answer waits for the other attempt. With no other
//! endpoint (a service of one instance) no hedge is sent.
//!
//! The delay is fixed (`hedge_delay_ms`) or follows the entry's recent latency
//! (`hedge_percentile`, [`crate::latency`]): hedging after the p95 sends about 5 % of calls a
//! hedge whatever the usual latency is, and keeps doing so when it changes. `hedge_delay_ms` is
//! then the floor (on loopback the p95 may be a fraction of a millisecond) and the delay until
//! the window holds enough calls. The window learns the time each call's first attempt took to
//! answer; when a hedge answers first, the first attempt's time so far (a lower bound of its
//! latency, at least the delay), so the slow answers hedging hides still count.
//!
//! A hedge is extra load, so it draws on the entry's retry budget
//! ([`RetryBudget::try_withdraw`](crate::budget::RetryBudget::try_withdraw)) and is not sent
//! once the budget is spent: under overload, when every call is slow, hedges stop by
//! themselves. A hedge that then never leaves this client (dropped by adaptive throttling,
//! refused by a per-attempt layer) gives its retry back; its `hedge` event is sent as it passes
//! those layers, so such a hedge has none. The hedge is one attempt (its failure is not
//! retried); the first attempt keeps
//! its retries, but one that would go to the endpoint the hedge is on waits until the hedge
//! ends (a second copy of the call there would race nothing), then picks again. A hedge aimed at an endpoint that cannot serve the call (nothing is sent: its
//! server does not stream, or takes fewer attachments) moves on to the next untried endpoint.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use rpc_core::{GovernanceOptions, RpcError};

use tokio::time::Instant;

use super::context::{Attempted, HedgeGate, HedgeRun};
use super::retry::retry_depth_mark;
use super::unsent::HedgeSent;
use super::{CallCx, Service, Superseded};
use crate::events::EventKind;
use crate::latency::LatencyWindow;

/// Sends a hedge of `S`'s call after `hedge_delay_ms` (or the entry's `hedge_percentile`
/// latency) without an answer.
#[derive(Debug, Clone)]
pub struct HedgeLayer<S> {
    inner: S,
}

impl<S> HedgeLayer<S> {
    /// The layer over `inner`, which must be the retry layer: it sends the hedge, to an
    /// endpoint the call has not tried, through the gate this layer gives it.
    pub fn new(inner: S) -> Self {
        HedgeLayer { inner }
    }
}

/// The hedge delay under `options`, with the entry's latency `window` (when
/// `hedge_percentile` is set), and why, for the event; `None`: no hedge for this call.
fn hedge_delay(
    options: &GovernanceOptions,
    window: Option<&LatencyWindow>,
    now: Instant,
) -> Option<(Duration, String)> {
    let floor = Duration::from_millis(options.hedge_delay_ms);
    let percentile = options.hedge_percentile;
    match window.and_then(|w| w.percentile_at(percentile, now)) {
        Some(latency) if latency > floor => Some((
            latency,
            format!(
                "no answer after {:.1} ms, the entry's p{percentile} latency over the last {} s \
                 (hedge_percentile)",
                latency.as_secs_f64() * 1000.0,
                crate::latency::WINDOW.as_secs()
            ),
        )),
        _ if floor.is_zero() => None,
        Some(_) => Some((
            floor,
            format!(
                "no answer after {} ms (hedge_delay_ms, above the entry's p{percentile} \
                 latency)",
                options.hedge_delay_ms
            ),
        )),
        None => Some((
            floor,
            format!(
                "no answer after {} ms (hedge_delay_ms)",
                options.hedge_delay_ms
            ),
        )),
    }
}

impl<S: Service> Service for HedgeLayer<S> {
    async fn call(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let o = &cx.options;
        if !o.idempotent || (o.hedge_delay_ms == 0 && o.hedge_percentile == 0) {
            return self.inner.call(cx, req).await;
        }
        // Boxed: a hedged call holds two attempts at once (and its state around them), and
        // in line that would triple the size of every call's future, hedged or not, which
        // every call then allocates or moves. Only calls that may hedge pay the allocation.
        Box::pin(self.hedged(cx, req)).await
    }

    fn enforces_attempt_deadline(&self) -> bool {
        self.inner.enforces_attempt_deadline()
    }
}

impl<S: Service> HedgeLayer<S> {
    /// A call of an entry that hedges: the first attempt, and the hedge after the delay.
    async fn hedged(&self, cx: &mut CallCx<'_>, req: Bytes) -> Result<Bytes, RpcError> {
        let o = &cx.options;
        let policy = cx.policy.clone();
        let window =
            (o.hedge_percentile > 0).then(|| policy.latency.get_or_init(LatencyWindow::new));
        let started = cx.started();
        let learn = |latency: Duration| {
            if let Some(w) = window {
                w.record_at(latency, Instant::now());
            }
        };
        let Some((delay, why)) = hedge_delay(o, window, started) else {
            // Too few calls seen for a percentile, and no floor: this call only teaches the
            // window.
            let result = self.inner.call(cx, req).await;
            if result.is_ok() {
                learn(started.elapsed());
            }
            return result;
        };
        let attempted = Attempted::default();
        cx.attempted = Some(attempted.clone());
        let options = Arc::new(GovernanceOptions {
            retry_times: 0,
            ..(*cx.options).clone()
        });
        // Set once one attempt answered: the other, dropped with this function's futures,
        // lost the race (its span says so instead of reporting it cancelled).
        let superseded = Superseded::default();
        cx.superseded = Some(superseded.clone());
        let mut hedge_cx = cx.fork_hedge(options, None);
        hedge_cx.superseded = Some(superseded.clone());
        // One routing group for the call, whichever attempt draws it first.
        let route_drawn = Arc::new(std::sync::OnceLock::new());
        cx.route_drawn = Some(route_drawn.clone());
        hedge_cx.route_drawn = Some(route_drawn);
        // The hedge is an attempt of the same call: it carries the call's retry depth (its own
        // options, one attempt, would not).
        if let (_, Some(depth)) = retry_depth_mark(&cx.options) {
            hedge_cx.retry_depth = depth;
        }
        let primary_options = cx.options.clone();
        let sent = Arc::new(AtomicBool::new(false));
        // While the hedge runs, the first attempt sends no retry to its endpoint (see the retry
        // layer).
        let run = Arc::new(HedgeRun::default());
        cx.hedge_run = Some(run.clone());
        hedge_cx.hedge_run = Some(run.clone());
        // Run by the retry layer once its picker has an endpoint the call's attempts were not
        // aimed at (with none, no hedge: a second call to the slow endpoint would race nothing
        // and add load where it hurts), so that the budget and the event count only hedges
        // sent. The events name the call's latest endpoint.
        hedge_cx.hedge_gate = Some(HedgeGate {
            attempted: attempted.clone(),
            send: Box::new({
                let (attempted, sent) = (attempted.clone(), sent.clone());
                move |hcx: &CallCx<'_>| {
                    let latest = attempted
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .last()
                        .cloned();
                    if !hcx.policy.budget.try_withdraw(&primary_options) {
                        hcx.emit(
                            EventKind::BudgetExhausted,
                            latest.as_deref(),
                            1,
                            Some("hedge not sent: the retry budget is spent".into()),
                        );
                        return None;
                    }
                    sent.store(true, Ordering::Relaxed);
                    Some(HedgeSent::new(hcx.policy.clone(), latest, why))
                }
            }),
        });
        // In a block of their own: both attempts' futures, which borrow `cx` and `hedge_cx`,
        // are gone by its end, so the winner's context can be read.
        let (result, from) = {
            // Each attempt records the endpoint that answered it apart (when the caller asks, see
            // `rpc_core::answered`): the call names the one whose answer it returns, not the last.
            let answered: [std::sync::Mutex<Option<String>>; 2] = Default::default();
            let first = self.inner.call(cx, req.clone());
            let primary = async {
                let (result, by) = rpc_core::answered::answered_by(first).await;
                *lock(&answered[0]) = by;
                result
            };
            let hedge = async {
                tokio::time::sleep_until(started + delay).await;
                // An error before any attempt when no hedge is sent: the first attempt decides.
                let (result, by) =
                    rpc_core::answered::answered_by(self.inner.call(&mut hedge_cx, req)).await;
                run.end();
                *lock(&answered[1]) = by;
                Some(result)
            };
            // Each in an `Option`, so that the loser can be dropped here, inside `superseding`
            // (its transport then tells its server why it stops), rather than when this function
            // returns.
            let mut primary = std::pin::pin!(Some(primary));
            let mut hedge = std::pin::pin!(Some(hedge));
            // The result, and which attempt gave it (0: the first, 1: the hedge).
            // The first answer wins: a success, or the callee's own answer (a business or
            // validation error, a refused caller), which the other attempt must neither delay
            // nor replace. A failure to get one (unreachable, overloaded, timed out) waits for the
            // other attempt.
            // (A refusal by the client's own transport, the call being over that server's limits,
            // is no answer: nothing was sent, whatever its status says.)
            // (Nor is an attempt a per-attempt layer refused itself: not sent.)
            let callee = |e: &RpcError| {
                e.code().is_callee_answer() && !e.is_unsupported_by_endpoint() && !e.is_not_sent()
            };
            let answer = |r: &Result<Bytes, RpcError>| r.as_ref().map_or_else(callee, |_| true);
            let (result, from) = tokio::select! {
                biased;
                r = live(primary.as_mut()) => match r {
                    // The first attempt failed for good before any hedge: none is sent now.
                    Err(e) if !callee(&e) && !sent.load(Ordering::Relaxed) => (Err(e), 0),
                    // A hedge already sent may still answer.
                    Err(e) if !callee(&e) => match live(hedge.as_mut()).await {
                        Some(h) if answer(&h) => (h, 1),
                        _ => (Err(e), 0),
                    },
                    r => {
                        superseded.set();
                        if r.is_ok() {
                            learn(started.elapsed());
                        }
                        (r, 0)
                    }
                },
                h = live(hedge.as_mut()) => match h {
                    Some(h) if answer(&h) => {
                        superseded.set();
                        // The first attempt, still running, has taken at least this long.
                        if h.is_ok() {
                            learn(started.elapsed());
                        }
                        (h, 1)
                    }
                    // No hedge (no other endpoint, the first attempt still finding its own, or the
                    // budget spent), or it failed: the first attempt decides, and its time is
                    // learnt as any first attempt's.
                    _ => {
                        let result = live(primary.as_mut()).await;
                        if result.is_ok() {
                            learn(started.elapsed());
                        }
                        (result, 0)
                    }
                },
            };
            match lock(&answered[from]).as_deref() {
                Some(by) => rpc_core::answered::record(by),
                None => rpc_core::answered::record_nobody(),
            }
            if superseded.is_set() {
                rpc_core::superseded::superseding(|| {
                    primary.set(None);
                    hedge.set(None);
                });
            }
            (result, from)
        };
        // The layers above judge the call by its context (the breaker: whether an endpoint
        // answered; the timeout: whose deadline passed): when the hedge's answer is the
        // call's, so is its attempt's verdict, not the first attempt's, dropped meanwhile.
        if from == 1 {
            cx.take_verdict_of(&hedge_cx);
        }
        // A hedge its gate let through that never left this client (dropped by adaptive
        // throttling, refused by a per-attempt layer, dropped in one when the first attempt
        // answered, or dropped with the call) gives its retry back as `hedge_cx` goes (see
        // `unsent`).
        result
    }
}

/// An attempt's answering endpoint (a poisoned lock still holds it).
fn lock(slot: &std::sync::Mutex<Option<String>>) -> std::sync::MutexGuard<'_, Option<String>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The attempt in `slot`, which is there until the call drops it after its end.
async fn live<F: Future>(slot: Pin<&mut Option<F>>) -> F::Output {
    slot.as_pin_mut()
        .expect("an attempt is dropped only once the call has its answer")
        .await
}
