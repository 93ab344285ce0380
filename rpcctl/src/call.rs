//! `call ENTRY JSON`: calls any entry by id with JSON arguments and prints the JSON answer.
//!
//! What an operator reaches for to check a service by hand, with no client program for it: the
//! entry is found in what the service's instances publish, under their governance (timeout,
//! retries, failover), through `Client::invoke_json`. Standard output holds the answer alone,
//! as one line of JSON, so scripts can read it; a failed call exits 1 with its status and
//! message (and a typed error's value as JSON) on standard error.

use crate::out::outln;
use std::sync::Arc;

use rpc::{Client, Registry};
use serde_json::Value;

use crate::exit::Failure;

/// Calls `entry` with the JSON array `args` through `registry`; `token` is the servers'
/// handshake token, if they require one.
pub async fn run(
    registry: Arc<dyn Registry>,
    entry: &str,
    args: &str,
    token: Option<&str>,
    limit: Option<std::time::Duration>,
) -> Result<(), Failure> {
    let args: Value = serde_json::from_str(args).map_err(|e| {
        Failure::usage(format!(
            "the arguments are not JSON ({e}): give a JSON array, one element per parameter, \
             such as '[\"hello\"]'"
        ))
    })?;
    if !args.is_array() {
        return Err(Failure::usage(format!(
            "the arguments must be a JSON array, one element per parameter: write '[{args}]' \
             for a single argument"
        )));
    }
    let mut builder = Client::builder()
        .shared_registry(registry)
        .client_id("rpcctl");
    if let Some(token) = token {
        builder = builder.token(token);
    }
    let client = builder.build();
    let call = client.invoke_json(entry, args);
    let result = match limit {
        None => call.await,
        // Dropping the call at the limit cancels it at the server too.
        Some(limit) => match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => {
                client.close();
                return Err(Failure::failed(format!(
                    "{entry}: no answer within {} ms; the call was cancelled (--timeout-ms sets \
                     the wait, 0 for the entry's own)",
                    limit.as_millis()
                )));
            }
        },
    };
    client.close();
    match result {
        Ok(answer) => {
            outln!("{answer}");
            Ok(())
        }
        Err(e) => {
            let mut message = format!("{entry} failed: {} {}", e.code().as_u32(), e.message());
            if let Some(body) = rpc::crates::client::error_body(&e) {
                message.push_str(&format!("\nerror value: {body}"));
            }
            Err(Failure::failed(message))
        }
    }
}
