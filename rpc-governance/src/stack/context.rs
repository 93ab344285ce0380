//! The per-call context: what every layer of one call may read, and what layers report to the
//! layers above them.
//!
//! One context lives for the whole call, on the caller's stack: the retry layer updates it for
//! each attempt (attempt number, chosen endpoint, its deadline) and leaves in it what the layers
//! above need to judge the result (whether the failure was held against one endpoint, whether it
//! was an attempt's own timeout). Nothing in it is allocated until it is used: the list of
//! endpoints tried grows only on a failure, the outgoing attachments only when a layer adds one.

use std::collections::BTreeMap;
use std::sync::Arc;

use rpc_core::{GovernanceOptions, MethodDescriptor, RpcError};
use tokio::time::Instant;

use crate::engine::{EntryPolicy, Governance};
use crate::events::{EventBus, EventKind};
use crate::health::EndpointHealth;
use crate::routing::RouteDrawn;

use super::unsent::{HedgeSent, UnsentRequest};

/// The endpoints a hedged call's attempts were aimed at, in order (see
/// [`CallCx::attempted`]).
pub(crate) type Attempted = Arc<std::sync::Mutex<Vec<Arc<str>>>>;

/// What the retry layer asks of a hedge before it is sent (see [`CallCx::hedge_gate`]).
pub(crate) struct HedgeGate {
    /// The endpoints the call's own attempts were aimed at: the hedge goes elsewhere, and
    /// with none yet (the first attempt still finding its endpoint) it is not sent either.
    pub(crate) attempted: Attempted,
    /// The hedge layer's last word (the budget): `None` sends nothing; else the hedge goes on,
    /// holding its drawn retry and its `hedge` event until it leaves the client.
    pub(crate) send: HedgeSend,
}

/// The hedge layer's last word on a hedge (see [`HedgeGate::send`]).
pub(crate) type HedgeSend = Box<dyn FnOnce(&CallCx<'_>) -> Option<HedgeSent> + Send + Sync>;

/// Where a hedged call's hedge runs: the endpoint of its attempt while it is out, so that the
/// call's first attempt sends no retry there meanwhile (two copies of one call on one server).
#[derive(Debug, Default)]
pub(crate) struct HedgeRun {
    on: std::sync::Mutex<Option<Arc<str>>>,
    ended: tokio::sync::Notify,
}

impl HedgeRun {
    fn on(&self) -> std::sync::MutexGuard<'_, Option<Arc<str>>> {
        self.on
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The hedge's attempt goes to `addr` (a hedge moving on from an endpoint that cannot serve
    /// the call is on that one no more: a first attempt waiting on it goes on).
    pub(crate) fn start(&self, addr: Arc<str>) {
        let moved = self.on().replace(addr).is_some();
        if moved {
            self.ended.notify_waiters();
        }
    }

    /// The hedge ended (with the call's answer the call is over, and nothing waits).
    pub(crate) fn end(&self) {
        *self.on() = None;
        self.ended.notify_waiters();
    }

    /// Waits until the hedge runs on `addr` no more; whether it had to.
    pub(crate) async fn wait_off(&self, addr: &str) -> bool {
        let mut waited = false;
        loop {
            let ended = self.ended.notified();
            let mut ended = std::pin::pin!(ended);
            ended.as_mut().enable();
            if self.on().as_deref() != Some(addr) {
                return waited;
            }
            ended.await;
            waited = true;
        }
    }
}

/// The context of one call, passed down through every layer of the stack.
pub struct CallCx<'g> {
    pub(crate) engine: &'g Governance,
    pub(crate) policy: Arc<EntryPolicy>,
    pub(crate) options: Arc<GovernanceOptions>,
    pub(crate) hash_key: Option<u64>,
    /// Set by the timeout layer (one clock reading serves the deadline, the budget and the
    /// first attempt).
    pub(crate) started: Option<Instant>,
    /// Set by [`with_started`](Self::with_started): work before the stack took time since
    /// `started`, so the first attempt reads the clock again.
    pub(crate) started_early: bool,
    pub(crate) deadline: Option<Instant>,
    pub(crate) attempt: u32,
    pub(crate) attempt_deadline: Option<Instant>,
    pub(crate) budget_ms: u32,
    pub(crate) endpoint: Option<Arc<str>>,
    pub(crate) tried: Vec<Arc<str>>,
    pub(crate) connection: Option<u64>,
    /// The final failure was held against its endpoint while others remain usable.
    pub(crate) endpoint_held: bool,
    /// The final failure was an attempt running out of `attempt_timeout_ms`.
    pub(crate) attempt_timed_out: bool,
    /// The call's deadline is the caller's: what was left of the deadline inherited from the
    /// call being handled, shorter than the entry's own `timeout_ms`.
    pub(crate) deadline_is_callers: bool,
    /// The final failure was the caller's deadline passing ([`deadline_is_callers`]): it says
    /// nothing of the endpoint, and the breaker does not count it.
    ///
    /// [`deadline_is_callers`]: Self::deadline_is_callers
    pub(crate) out_of_callers_time: bool,
    /// The last attempt was dropped locally by adaptive throttling (never sent).
    pub(crate) throttled: bool,
    /// The last attempt was answered by a per-attempt user layer without reaching the stage
    /// below it (the transport): the layer refused it, answered it itself, or ran out of time
    /// before passing it on. Nothing was sent, so its outcome says nothing of the endpoint.
    pub(crate) answered_by_layer: bool,
    /// Filled by the retry layer with each attempt's endpoint, when the hedge layer asks (it
    /// needs them to send its hedge elsewhere while the call's attempts still run).
    pub(crate) attempted: Option<Attempted>,
    /// This context is a hedge's: one attempt, not a call of its own (no budget deposit).
    pub(crate) hedge: bool,
    /// Set on a hedge's context by the hedge layer: the retry layer sends the hedge only to an
    /// endpoint other than the first attempt's, and only if the gate agrees.
    pub(crate) hedge_gate: Option<HedgeGate>,
    /// A hedge's drawn retry and event, until the hedge leaves the client (see
    /// [`unsent`](super::unsent)).
    pub(crate) hedge_sent: Option<HedgeSent>,
    /// The request adaptive throttling counted for the attempt, until it leaves the client.
    pub(crate) unsent_request: Option<UnsentRequest>,
    /// Shared by both attempts of a hedged call, set once one of them answered.
    pub(crate) superseded: Option<Superseded>,
    /// Shared by both attempts of a hedged call: where the hedge runs.
    pub(crate) hedge_run: Option<Arc<HedgeRun>>,
    /// Shared by both attempts of a hedged call: the routing group the first of them to pick
    /// an endpoint drew, which the other follows.
    pub(crate) route_drawn: Option<Arc<std::sync::OnceLock<RouteDrawn>>>,
    /// The endpoint of the last failed attempt.
    pub(crate) last_failed: Option<Arc<str>>,
    /// Whether the last failed attempt's answer said when to come back (`retry_after`): the
    /// pause before the next attempt is then its, and that endpoint is as good as any.
    pub(crate) last_said_when: bool,
    /// The number of the attempt the call's failure came from, when the call ends before
    /// another attempt is sent: after a detour that cannot serve the call (the failure before
    /// it), or when no endpoint is left to pick or the deadline passes during the pause before
    /// a retry. `None` while an attempt runs (its own number is the call's).
    pub(crate) failed_attempt: Option<u32>,
    /// Endpoints this call found unable to serve it (their servers do not stream): never
    /// candidates again for it. Empty for most calls (no allocation).
    pub(crate) unable: Vec<Arc<str>>,
    /// Endpoints that refused an attempt of this call saying when to come back (a 429's
    /// `retry_after`): not sent it again before then. Empty for most calls (no allocation).
    pub(crate) paused: Vec<Paused>,
    /// The last failure of an endpoint that could serve the call, kept for the case where a
    /// detour to one that cannot leaves nothing untried (see the retry layer).
    pub(crate) served_failure: Option<Box<ServedFailure>>,
    /// An endpoint this call tried was reached: it answered, if only to refuse the call
    /// (overloaded, rate-limited, a timeout once sent). An unreachable endpoint with nothing
    /// untried left then ends the call only when none was.
    pub(crate) reached: bool,
    pub(crate) fallback_cause: Option<RpcError>,
    /// Only when a layer adds one: most calls carry none, and an empty map still costs its drop.
    attachments: Option<BTreeMap<String, String>>,
    /// The retry depth the call is sent with (0: none); see [`CallCx::retry_depth`].
    pub(crate) retry_depth: u32,
    call_id: Option<String>,
    /// What layers asked to be told when the stream this call opens ends (empty for most
    /// calls: an empty list allocates nothing).
    stream_end: Vec<StreamEndHook>,
}

/// A failed attempt of an endpoint that could serve the call, as the retry layer decided on it.
#[derive(Debug)]
pub(crate) struct ServedFailure {
    pub(crate) error: RpcError,
    pub(crate) endpoint: Arc<str>,
    /// The attempt's number.
    pub(crate) attempt: u32,
    pub(crate) attempt_timed_out: bool,
}

/// An endpoint's refusal of an attempt that said when to come back ([`CallCx::paused`]).
#[derive(Debug)]
pub(crate) struct Paused {
    pub(crate) endpoint: Arc<str>,
    /// Not sent the call again before this.
    pub(crate) until: Instant,
    /// The refused attempt's number.
    pub(crate) attempt: u32,
    /// The refusal: the call's failure, should it end for want of time to wait it out.
    pub(crate) refusal: RpcError,
}

/// How a stream ended, as a hook a layer registered with [`CallCx::on_stream_end`] sees it.
#[derive(Debug, Clone)]
pub struct StreamEnd {
    /// The stream's end status: 200 when it completed, the error's status when it ended with
    /// one (the server's error, the deadline, a failed connection), `None` when its caller
    /// dropped it before its end.
    pub status: Option<rpc_core::StatusCode>,
    /// The error it ended with, if it did.
    pub error: Option<RpcError>,
    /// Items the caller sent (client and bidirectional streams).
    pub items_sent: u64,
    /// Items the caller received (for a client stream, its one answer).
    pub items_received: u64,
    /// From the start of the set-up to the end.
    pub elapsed: std::time::Duration,
}

/// Whether the other attempt of a hedged call answered first ([`CallCx::superseded`]): an
/// attempt dropped after that lost the race; it was not cancelled by its caller, and its span
/// and logs say so rather than reporting an error.
#[derive(Debug, Clone, Default)]
pub struct Superseded(Arc<std::sync::atomic::AtomicBool>);

impl Superseded {
    /// Whether the other attempt answered first.
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    pub(crate) fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// A hook registered with [`CallCx::on_stream_end`].
pub type StreamEndHook = Box<dyn FnOnce(&StreamEnd) + Send + Sync>;

/// What [`CallCx::attachments`] shows when no layer added any.
static NO_ATTACHMENTS: BTreeMap<String, String> = BTreeMap::new();

impl std::fmt::Debug for CallCx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallCx")
            .field("entry", &self.entry_id())
            .field("attempt", &self.attempt)
            .field("endpoint", &self.endpoint)
            .field("tried", &self.tried)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

impl<'g> CallCx<'g> {
    /// The context of a call of `policy`'s entry under `options` (the entry's options, or the
    /// caller's per-call options applied over them).
    pub fn new(
        engine: &'g Governance,
        policy: Arc<EntryPolicy>,
        options: Arc<GovernanceOptions>,
    ) -> Self {
        CallCx {
            engine,
            policy,
            options,
            hash_key: None,
            started: None,
            started_early: false,
            deadline: None,
            attempt: 0,
            attempt_deadline: None,
            budget_ms: 0,
            endpoint: None,
            tried: Vec::new(),
            connection: None,
            endpoint_held: false,
            attempt_timed_out: false,
            deadline_is_callers: false,
            out_of_callers_time: false,
            throttled: false,
            answered_by_layer: false,
            attempted: None,
            hedge: false,
            hedge_gate: None,
            hedge_sent: None,
            unsent_request: None,
            route_drawn: None,
            superseded: None,
            hedge_run: None,
            last_failed: None,
            last_said_when: false,
            failed_attempt: None,
            unable: Vec::new(),
            paused: Vec::new(),
            served_failure: None,
            reached: false,
            fallback_cause: None,
            attachments: None,
            retry_depth: 0,
            call_id: None,
            stream_end: Vec::new(),
        }
    }

    /// Takes the verdict of `hedge`'s attempt, whose answer the call returns: the endpoint
    /// that answered and what the layers above read of how (by a per-attempt layer, held
    /// against the endpoint, dropped by throttling, out of the caller's time or of the
    /// attempt's).
    pub(crate) fn take_verdict_of(&mut self, hedge: &CallCx<'_>) {
        self.endpoint = hedge.endpoint.clone();
        self.connection = hedge.connection;
        self.answered_by_layer = hedge.answered_by_layer;
        self.endpoint_held = hedge.endpoint_held;
        self.throttled = hedge.throttled;
        self.out_of_callers_time = hedge.out_of_callers_time;
        self.attempt_timed_out = hedge.attempt_timed_out;
    }

    /// The call started at `at`, before its stack ran: what was done for it before (finding
    /// its service on an entry's first call) counts against its deadline, which
    /// [`TimeoutLayer`](super::TimeoutLayer) then counts from `at` instead of from when it
    /// runs.
    pub fn with_started(mut self, at: Instant) -> Self {
        self.started = Some(at);
        self.started_early = true;
        self
    }

    /// Sets the hash of the call's `#[hash_key]` argument, for consistent hashing.
    pub fn with_hash_key(mut self, key: Option<u64>) -> Self {
        self.hash_key = key;
        self
    }

    /// Sets the call's short id, sent as an attachment when the call is logged.
    pub fn with_call_id(mut self, id: Option<String>) -> Self {
        self.call_id = id;
        self
    }

    /// The context of a hedge of this call: same entry, deadline, attachments and call id,
    /// `options` in force (the hedge's own: one attempt), avoiding `avoid` (the endpoint the
    /// first attempt runs on).
    pub(crate) fn fork_hedge(
        &self,
        options: Arc<GovernanceOptions>,
        avoid: Option<Arc<str>>,
    ) -> CallCx<'g> {
        let mut cx = CallCx::new(self.engine, self.policy.clone(), options);
        cx.hash_key = self.hash_key;
        cx.started = self.started;
        cx.started_early = self.started_early;
        cx.deadline = self.deadline;
        cx.deadline_is_callers = self.deadline_is_callers;
        cx.attachments = self.attachments.clone();
        cx.retry_depth = self.retry_depth;
        cx.call_id = self.call_id.clone();
        cx.hedge = true;
        cx.attempt = 1;
        cx.tried.extend(avoid);
        cx
    }

    /// Counts as tried the endpoints the call's other attempts went to (a hedged call's
    /// [`attempted`](Self::attempted), shared by its first attempt and its hedge), so that
    /// neither picks an endpoint the other is on.
    pub(crate) fn pass_the_calls_other_attempts(&mut self) {
        self.pass_the_calls_other_attempts_but(None);
    }

    /// [`pass_the_calls_other_attempts`](Self::pass_the_calls_other_attempts), leaving `own`
    /// out: the endpoint of the attempt that just failed, which its caller records as the
    /// last one tried (the picker steers a retry away from the last one), and only once.
    pub(crate) fn pass_the_calls_other_attempts_but(&mut self, own: Option<&Arc<str>>) {
        let Some(attempted) = &self.attempted else {
            return;
        };
        let on = attempted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for addr in on {
            if Some(&addr) != own && !self.tried.contains(&addr) {
                self.tried.push(addr);
            }
        }
    }

    /// Whether this context is a hedge's: a second attempt of a call, sent while its first
    /// still runs. What it decides is not the call's (its picker records no routing choice
    /// on the call's span).
    pub fn is_hedge(&self) -> bool {
        self.hedge
    }

    /// The routing group drawn for this call by its other attempt, when the call is hedged
    /// and that attempt drew first: the picker then takes the same group, so that a call is
    /// served by one group whichever attempt answers.
    pub fn route_drawn(&self) -> Option<&RouteDrawn> {
        self.route_drawn.as_ref().and_then(|d| d.get())
    }

    /// Keeps `drawn` for the call's other attempt, when the call is hedged (otherwise nothing
    /// is kept: a call's attempts share one picker). The first group kept stays.
    pub fn keep_route_drawn(&self, drawn: RouteDrawn) {
        if let Some(d) = &self.route_drawn {
            let _ = d.set(drawn);
        }
    }

    /// For an attempt of a hedged call: set once the call's other attempt answered, before
    /// this one is dropped. `None` for a call that does not hedge.
    pub fn superseded(&self) -> Option<Superseded> {
        self.superseded.clone()
    }

    /// The entry id, `"<service id>.<method>"`.
    pub fn entry_id(&self) -> &str {
        self.policy.method().entry_id
    }

    /// The entry's method descriptor.
    pub fn method(&self) -> &'static MethodDescriptor {
        self.policy.method()
    }

    /// The options in force for this call.
    pub fn options(&self) -> &GovernanceOptions {
        &self.options
    }

    /// The hash of the `#[hash_key]` argument, when the entry routes by consistent hash.
    pub fn hash_key(&self) -> Option<u64> {
        self.hash_key
    }

    /// When the call's timeout layer started it (now, before that layer ran).
    pub fn started(&self) -> Instant {
        self.started.unwrap_or_else(Instant::now)
    }

    /// The call's deadline (retries included), once the timeout layer has set it.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether `err` is only the caller's deadline passing: a timeout with no answer once the
    /// deadline this call inherited from the call being handled (shorter than the entry's own
    /// timeout) has passed. The caller had too little time left, which says nothing of the
    /// endpoint: endpoint health, outlier detection and the breaker leave it out.
    pub fn is_callers_deadline(&self, err: &RpcError) -> bool {
        self.deadline_is_callers
            && err.code() == rpc_core::StatusCode::Timeout
            && err.payload().is_none()
            && self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The current attempt: 0 for the first.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The current attempt's deadline: the call's, or earlier under `attempt_timeout_ms`. An
    /// attempt must stop there (dropping what it waits for, so the server is told to stop).
    pub fn attempt_deadline(&self) -> Option<Instant> {
        self.attempt_deadline
    }

    /// Milliseconds left for the current attempt, to tell the server (0 = none).
    pub fn budget_ms(&self) -> u32 {
        self.budget_ms
    }

    /// The endpoint of the current attempt, once the balancer has chosen it.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// [`endpoint`](Self::endpoint) as the shared string the balancer handed out (cloning it
    /// copies no text).
    pub fn endpoint_shared(&self) -> Option<&Arc<str>> {
        self.endpoint.as_ref()
    }

    /// Endpoints tried (and failed) so far, in order.
    pub fn tried(&self) -> &[Arc<str>] {
        &self.tried
    }

    /// Endpoints this call found unable to serve it (their servers do not stream, or take fewer
    /// attachments than it carries; nothing was sent to them), in order: a balancer leaves them
    /// out of the call's candidates.
    pub fn unable(&self) -> &[Arc<str>] {
        &self.unable
    }

    /// The endpoint of the last failed attempt, if one failed.
    pub fn last_failed(&self) -> Option<&str> {
        self.last_failed.as_deref()
    }

    /// Whether the last failed attempt's answer said when to come back (`retry_after`): a
    /// balancer then need not steer the next attempt away from that endpoint, whose pause the
    /// call waits.
    pub fn last_failure_said_when(&self) -> bool {
        self.last_said_when
    }

    /// Where the call's failure `e` happened, for the event of a fallback answering it: the
    /// endpoint and the number of the attempt the failure is. When the retry layer decided on
    /// a failure (the call may have ended before another attempt was sent), its endpoint and
    /// attempt: which is not always the last endpoint tried (a call ended by an endpoint's
    /// pause past the deadline ends with that endpoint's refusal). Otherwise the last endpoint
    /// the error names, leaving out those that could not serve the call (sent nothing, and
    /// not where the call ended).
    pub fn failure(&self, e: &RpcError) -> (Option<Arc<str>>, u32) {
        let unable = |a: &str| self.unable.iter().any(|u| &**u == a);
        let endpoint = self
            .failed_attempt
            .and(self.last_failed.clone())
            .or_else(|| {
                e.tried()
                    .iter()
                    .rev()
                    .find(|a| !unable(a))
                    .map(|a| Arc::from(a.as_str()))
            });
        (endpoint, self.failed_attempt.unwrap_or(self.attempt))
    }

    /// The error a fallback answered for, once the fallback layer ran one.
    pub fn fallback_cause(&self) -> Option<&RpcError> {
        self.fallback_cause.as_ref()
    }

    /// Records the connection the current attempt was sent on: calls that fail together because
    /// one connection broke count once against its endpoint.
    pub fn set_connection(&mut self, id: u64) {
        self.connection = Some(id);
    }

    /// Attachments layers added to this call, sent with every attempt beside those of the
    /// current [`RpcContext`](rpc_core::RpcContext).
    pub fn attachments(&self) -> &BTreeMap<String, String> {
        self.attachments.as_ref().unwrap_or(&NO_ATTACHMENTS)
    }

    /// The retry depth this call is sent with, as attachment
    /// [`RETRY_DEPTH_KEY`](rpc_core::RETRY_DEPTH_KEY), set by the retry layer: one more than
    /// the depth of the call being served on a call its client may retry, else the served
    /// call's depth as it came (0 outside a handler). Kept beside [`attachments`](Self::attachments) rather than in them, so that
    /// marking a call allocates nothing; the transport sends it over any attachment of that key.
    pub fn retry_depth(&self) -> u32 {
        self.retry_depth
    }

    /// Adds an attachment to this call (it wins over an attachment of the same key in the
    /// current [`RpcContext`](rpc_core::RpcContext)).
    pub fn insert_attachment(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.attachments
            .get_or_insert_with(Default::default)
            .insert(key.into(), value.into());
    }

    /// Asks to be told how the stream this call sets up ends: for the set-up of a stream
    /// whose set-up succeeds, `hook` runs once as the stream ends (completed, with an error,
    /// or dropped by its caller), with its status and the items each way. A layer sees the
    /// set-up as a call (its result is the set-up's), and the stream's end through this hook.
    /// For a unary call, or a set-up that fails (the layer sees that error itself), the hook
    /// never runs. A hook registered by a per-attempt layer runs at the end of the stream the
    /// call opened if its attempt opened it; a failed attempt's hooks are dropped.
    pub fn on_stream_end(&mut self, hook: impl FnOnce(&StreamEnd) + Send + Sync + 'static) {
        self.stream_end.push(Box::new(hook));
    }

    /// How many stream-end hooks are registered: where an attempt's own begin.
    pub(crate) fn stream_end_hooks(&self) -> usize {
        self.stream_end.len()
    }

    /// Drops the hooks registered since there were `n`: those of an attempt that failed,
    /// whose set-up opened no stream.
    pub(crate) fn drop_stream_end_hooks_from(&mut self, n: usize) {
        self.stream_end.truncate(n);
    }

    /// The hooks registered with [`on_stream_end`](Self::on_stream_end), taken out: the
    /// client runs them as the stream ends.
    pub fn take_stream_end_hooks(&mut self) -> Vec<StreamEndHook> {
        std::mem::take(&mut self.stream_end)
    }

    /// The call's short id, when the call is logged.
    pub fn call_id(&self) -> Option<&str> {
        self.call_id.as_deref()
    }

    /// The event sink: every decision is sent there.
    pub fn events(&self) -> &EventBus {
        self.engine.events()
    }

    /// The entry's round-robin position ([`EntryPolicy::round_robin`]).
    pub fn round_robin(&self) -> &std::sync::atomic::AtomicUsize {
        self.policy.round_robin()
    }

    /// This client's view of endpoint health.
    pub fn health(&self) -> &EndpointHealth {
        self.engine.health()
    }

    /// Emits an event about this call's entry.
    pub fn emit(
        &self,
        kind: EventKind,
        endpoint: Option<&str>,
        attempt: u32,
        cause: Option<String>,
    ) {
        self.engine
            .events()
            .emit_parts(kind, &self.policy.entry, endpoint, attempt, cause);
    }

    /// Emits what a policy in observe mode would have done to this call (`observed: true`).
    pub fn emit_observed(
        &self,
        kind: EventKind,
        endpoint: Option<&str>,
        attempt: u32,
        cause: Option<String>,
    ) {
        self.engine
            .events()
            .emit_observed(kind, &self.policy.entry, endpoint, attempt, cause);
    }
}
