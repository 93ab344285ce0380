//! What the server dispatches to: one [`Service`] per registered service (defined in
//! `rpc-core`, so that clients can hold fallbacks of the same form).

pub use rpc_core::{Service, ServiceFuture};
