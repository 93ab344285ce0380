//! The client's governance as a stack of layers over one per-call context.
//!
//! Each policy is one layer: it receives the call's [`CallCx`] and the encoded arguments,
//! decides, calls the layer below (or not), and looks at the result on its way back up. State
//! that one layer learns and another needs (the endpoint of the last failed attempt, whether a
//! failure was held against one endpoint) travels in the context, never through side channels.
//! A new policy (rate limit, hedging, an adaptive limit) is one more layer here, in
//! [`client_stack`], the only place the order is written:
//!
//! ```text
//! [user layers, per call]            Middleware installed with ClientBuilder::layer
//! Fallback                           another implementation answers a failed call
//!  └ CircuitBreaker                  per entry: fail fast while the entry is failing
//!    └ Timeout                       the whole call's deadline, retries included
//!     └ Hedge                        idempotent: a second attempt elsewhere after a delay
//!      └ Retry / Failover            next candidate from the Balance picker, within the budget
//!        └ Throttle                  per entry: drop attempts while the server refuses most
//!          └ [user layers, per attempt] Middleware installed with ClientBuilder::attempt_layer
//!          └ attempt                 the caller's: connection and frame
//! ```
//!
//! Layers are plain structs borrowing what they need, put together for each call by
//! [`client_stack`]: building the stack allocates nothing, and a user layer list that is empty
//! costs one branch.
//!
//! The crate performs no I/O: the caller supplies endpoint choice ([`Balance`]) and the attempt
//! itself (a [`Service`] at the bottom of the stack).

mod balance;
mod breaker;
mod context;
mod fallback;
mod hedge;
mod middleware;
mod retry;
#[cfg(test)]
mod tests;
mod throttle;
mod timeout;
mod unsent;

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use rpc_core::{Codec, RpcError};

pub use balance::{Balance, Pick};
pub use breaker::CircuitBreakerLayer;
pub use context::{CallCx, StreamEnd, StreamEndHook, Superseded};
pub use fallback::{FallbackLayer, Fallbacks};
pub use hedge::HedgeLayer;
pub use middleware::{middleware_fn, Layered, Middleware, MiddlewareFn, Next};
pub use retry::RetryLayer;
pub use throttle::ThrottleLayer;
pub use timeout::TimeoutLayer;

/// One stage of a call: takes the call's context and its encoded arguments, returns the encoded
/// result. Layers implement it by wrapping the stage below them.
pub trait Service: Send + Sync {
    /// Runs the call (or, below the retry layer, one attempt) through this stage.
    fn call(
        &self,
        cx: &mut CallCx<'_>,
        req: Bytes,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + Send;

    /// Whether this stage ends an attempt by itself once [`CallCx::attempt_deadline`] passes:
    /// it fails with [`StatusCode::Timeout`](rpc_core::StatusCode::Timeout), having stopped
    /// what it waited for (the server told to stop), at that deadline and not later. The retry
    /// layer then arms no timer of its own for the attempt; otherwise (the default, `false`)
    /// it wraps each attempt in one, so that no attempt outlives its deadline whatever the
    /// stage does with it.
    fn enforces_attempt_deadline(&self) -> bool {
        false
    }
}

impl<S: Service> Service for &S {
    fn call(
        &self,
        cx: &mut CallCx<'_>,
        req: Bytes,
    ) -> impl Future<Output = Result<Bytes, RpcError>> + Send {
        (**self).call(cx, req)
    }

    fn enforces_attempt_deadline(&self) -> bool {
        (**self).enforces_attempt_deadline()
    }
}

/// What a client hands [`client_stack`].
pub struct ClientParts<'a, B, A> {
    /// User layers around the whole call (outside the fallback).
    pub outer: &'a [std::sync::Arc<dyn Middleware>],
    /// Fallbacks registered on the client, by service id.
    pub fallbacks: &'a Fallbacks,
    /// The codec the fallbacks decode the arguments with.
    pub codec: Codec,
    /// Endpoint choice: an ordered list of candidates per call.
    pub balance: B,
    /// User layers around each attempt, once its endpoint is known.
    pub per_attempt: &'a [std::sync::Arc<dyn Middleware>],
    /// One attempt on the endpoint in [`CallCx::endpoint`].
    pub attempt: A,
}

/// The client's stack, in its one built-in order (see the [module](self) documentation).
pub fn client_stack<'a, B, A>(parts: ClientParts<'a, B, A>) -> impl Service + 'a
where
    B: Balance + 'a,
    A: Service + 'a,
{
    let ClientParts {
        outer,
        fallbacks,
        codec,
        balance,
        per_attempt,
        attempt,
    } = parts;
    Layered::new(
        outer,
        FallbackLayer::new(fallbacks, codec, governed(balance, per_attempt, attempt)),
    )
}

/// The governed core, without fallback and the outer user layers: circuit breaker → timeout →
/// hedge → retry/failover over `balance` → adaptive throttling → the `per_attempt` user layers
/// → `attempt`. (An attempt that passes the per-attempt layers leaves the client: a hedge's
/// `hedge` event is sent there.)
pub fn governed<'a, B, A>(
    balance: B,
    per_attempt: &'a [Arc<dyn Middleware>],
    attempt: A,
) -> impl Service + 'a
where
    B: Balance + 'a,
    A: Service + 'a,
{
    CircuitBreakerLayer::new(TimeoutLayer::new(HedgeLayer::new(RetryLayer::new(
        balance,
        ThrottleLayer::new(Layered::new(per_attempt, attempt)),
    ))))
}
