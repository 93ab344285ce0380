//! # rpc-governance
//!
//! The policy engine. Each policy is a small module of one shape — options (fields of
//! `GovernanceOptions`) → state → decision → event:
//!
//! | module | decides |
//! |---|---|
//! | [`timeout`] | the call's deadline (nested calls inherit what is left) |
//! | [`retry`] | whether a failed attempt is tried again and after what pause |
//! | [`budget`] | whether retries are still affordable (share of recent calls) |
//! | [`failover`] | when to stop moving to the next endpoint, and what the final error names |
//! | [`health`] | which endpoints this client avoids for a while, or drops |
//! | [`breaker`] | when to stop calling an entry, and when to probe it again |
//! | [`fallback`] | when another implementation answers, and what a failed fallback says |
//! | [`bulkhead`] | the server's concurrency cap (Overflow at once, never a queue) |
//! | [`adaptive`] | a server cap that follows measured latency, deadline- and criticality-aware |
//! | [`ratelimit`] | calls per second per entry and per caller (token buckets) |
//! | [`throttle`] | when a client drops calls itself because the server keeps refusing them |
//! | [`latency`] | an entry's recent latency by percentile (the hedge delay under `hedge_percentile`) |
//! | [`load`] | load-aware endpoint choice: peak-EWMA latency × √(outstanding calls per unit of weight), two choices |
//! | [`outlier`] | which endpoints fail markedly more often than their peers |
//! | [`routing`] | which instances (by metadata tags) a call may go to: tag routing, weighted splits, by attachment |
//!
//! [`stack`] puts the client side together as layers over one per-call context, in one
//! order written once ([`stack::client_stack`]): user layers → fallback → circuit breaker →
//! timeout → hedge → retry/failover (over the caller's [`stack::Balance`] picker) → adaptive
//! throttling → per-attempt user layers → the attempt. [`engine::Governance`] holds what outlives a call: per-entry options
//! (resolved from the [`config`] layers) and state, cached by entry id, endpoint health and the
//! [`events`] bus (a `tracing` event on the current span, target `rpc::governance`, and
//! subscribers).
//!
//! The crate never performs I/O: the caller supplies endpoint choice and the attempt itself
//! (the bottom [`stack::Service`]).
//!
//! ```
//! use rpc_core::{GovernanceOptions, RpcError, StatusCode};
//! use rpc_governance::retry::{decide, Decision};
//!
//! let opts = GovernanceOptions::default();
//! let overflow = RpcError::new(StatusCode::OverflowMaxServerHandle, "full");
//! assert!(matches!(decide(&overflow, 0, &opts, None), Decision::Retry { .. }));
//! let business = RpcError::business("no such user");
//! assert!(matches!(decide(&business, 0, &opts, None), Decision::GiveUp));
//! ```
#![warn(missing_docs)]

pub mod adaptive;
pub mod breaker;
pub mod budget;
pub mod bulkhead;
pub mod calls;
pub mod config;
pub mod engine;
pub mod events;
pub mod failover;
pub mod fallback;
pub mod health;
pub mod latency;
pub mod load;
pub mod outlier;
pub mod ratelimit;
pub mod retry;
pub mod routing;
pub mod stack;
pub mod throttle;
pub mod timeout;
