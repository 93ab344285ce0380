//! # rpc-governance
//!
//! The policy engine's decisions, free of sockets: how long a call may take ([`timeout`]),
//! when to stop calling a failing entry ([`breaker`]),
//! whether and when a failed attempt is tried again and where ([`retry`]), and which endpoints a
//! client should avoid for a while after they failed ([`health`]).
//!
//! The crate decides; it never performs I/O. Callers (the client executor, the server) run the
//! attempts and ask the policies what to do with each outcome. Every decision emits a `tracing`
//! event with target `rpc::governance`.
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

pub mod breaker;
pub mod budget;
pub mod bulkhead;
pub mod config;
pub mod events;
pub mod health;
pub mod pipeline;
pub mod retry;
pub mod timeout;
