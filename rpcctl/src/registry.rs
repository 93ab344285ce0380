//! `services`, `instances SERVICE` and `entries SERVICE`: what a registry knows, read from any
//! registry URL (`embedded`, `static:FILE`, `host:port,...`, `etcd://host:port`,
//! `zk://host:port`).
//!
//! An operator's first question about a fleet is "what runs, where, and with which settings":
//! these answer it from the registry alone, without reaching any server. Human output is one
//! item per line (a small table for entries); `--json` gives scripts the same facts with their
//! details. The one-per-line forms of `services` and `instances` are a contract scripts rely
//! on: one service id, or one `host:port`, per line and nothing else.

use crate::out::outln;
use std::collections::BTreeMap;
use std::sync::Arc;

use rpc::crates::core::GovernanceOverrides;
use rpc::Registry;
use serde_json::{json, Value};

use crate::exit::Failure;

/// The registry `url` names; no URL, or one that names no registry, is a usage error (2).
pub async fn open(url: Option<&str>) -> Result<Arc<dyn Registry>, Failure> {
    let Some(url) = url else {
        return Err(Failure::usage(
            "this command reads a registry: give --registry URL (embedded, static:FILE, \
             host:port[,host:port...], etcd://host:port or zk://host:port), or set \
             RPCCTL_REGISTRY",
        ));
    };
    <dyn Registry>::from_url(url)
        .await
        .map_err(|e| Failure::usage(format!("--registry {url}: {e}")))
}

/// A registry that did not answer: the operation failed (1).
fn unavailable(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::failed(format!("{what}: {e}"))
}

/// `services`: one service id per line (`--json`: a JSON array of strings).
pub async fn services(registry: &dyn Registry, json: bool) -> Result<(), Failure> {
    let ids = registry
        .services()
        .await
        .map_err(|e| unavailable("listing the services", e))?;
    if json {
        let ids: Vec<&str> = ids.iter().map(|s| s.as_str()).collect();
        outln!("{}", Value::from(ids));
    } else {
        for id in &ids {
            outln!("{}", id.as_str());
        }
        if ids.is_empty() {
            eprintln!(
                "rpcctl: the registry lists no service (a list of addresses names none: \
                 `rpcctl instances SERVICE` and `rpcctl call ENTRY` name it themselves)"
            );
        }
    }
    Ok(())
}

/// `instances SERVICE`: one `host:port` per line, in the registry's snapshot order (`--json`: an
/// array of `{id, address, metadata}`).
pub async fn instances(registry: &dyn Registry, service: &str, json: bool) -> Result<(), Failure> {
    let snapshot = registry
        .watch(&service.into())
        .await
        .map_err(|e| unavailable(&format!("reading the instances of {service}"), e))?
        .current();
    if json {
        let list: Vec<Value> = snapshot
            .iter()
            .map(|i| json!({ "id": i.id, "address": i.address, "metadata": i.metadata }))
            .collect();
        outln!("{}", Value::from(list));
    } else {
        for i in snapshot.iter() {
            outln!("{}", i.address);
        }
        if snapshot.is_empty() {
            eprintln!("rpcctl: no instance of {service} is registered (`rpcctl services` lists the known services)");
        }
    }
    Ok(())
}

/// One entry as the instances of its service publish it.
struct Published {
    method: String,
    hash_key: Option<usize>,
    /// The settings of the first instance (by address) that publishes any: the ones clients
    /// apply (they pass over instances that publish none, such as older builds).
    governance: GovernanceOverrides,
    /// The instances publishing it.
    instances: Vec<String>,
    /// Whether instances that publish settings publish different ones.
    disagree: bool,
}

/// The settings an entry declares, as `key=value` pairs in the config file's names (only those
/// set).
fn settings(o: &GovernanceOverrides) -> BTreeMap<String, Value> {
    match serde_json::to_value(o) {
        Ok(Value::Object(map)) => map.into_iter().filter(|(_, v)| !v.is_null()).collect(),
        _ => BTreeMap::new(),
    }
}

/// `entries SERVICE`: each entry id the instances publish, with the governance settings they
/// declare for it (`--json`: an array of `{id, method, hash_key, governance, instances}`).
pub async fn entries(registry: &dyn Registry, service: &str, json: bool) -> Result<(), Failure> {
    let snapshot = registry
        .watch(&service.into())
        .await
        .map_err(|e| unavailable(&format!("reading the instances of {service}"), e))?
        .current();
    let mut entries: BTreeMap<String, Published> = BTreeMap::new();
    for instance in snapshot.iter() {
        for e in instance
            .entries
            .iter()
            .filter(|e| e.service_id.as_str() == service)
        {
            let p = entries
                .entry(e.id.as_str().to_string())
                .or_insert_with(|| Published {
                    method: e.method.clone(),
                    hash_key: e.hash_key,
                    governance: e.governance.clone(),
                    instances: Vec::new(),
                    disagree: false,
                });
            if e.governance != GovernanceOverrides::NONE {
                if p.governance == GovernanceOverrides::NONE {
                    p.governance = e.governance.clone();
                } else {
                    p.disagree |= p.governance != e.governance;
                }
            }
            p.instances.push(instance.address.clone());
        }
    }
    if json {
        let list: Vec<Value> = entries
            .iter()
            .map(|(id, p)| {
                json!({
                    "id": id,
                    "method": p.method,
                    "hash_key": p.hash_key,
                    "governance": settings(&p.governance),
                    "instances": p.instances,
                    "instances_disagree": p.disagree,
                })
            })
            .collect();
        outln!("{}", Value::from(list));
        return Ok(());
    }
    if entries.is_empty() {
        let why = if snapshot.is_empty() {
            format!("no instance of {service} is registered (`rpcctl services` lists the known services)")
        } else {
            format!(
                "the {} instance(s) of {service} publish no entry (a static list cannot publish \
                 any)",
                snapshot.len()
            )
        };
        eprintln!("rpcctl: {why}");
        return Ok(());
    }
    let width = entries.keys().map(String::len).max().unwrap_or(0).max(5);
    outln!("{:width$}  {:>9}  GOVERNANCE", "ENTRY", "INSTANCES");
    for (id, p) in &entries {
        let mut text: Vec<String> = settings(&p.governance)
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if let Some(k) = p.hash_key {
            text.insert(0, format!("hash_key=arg{k}"));
        }
        if text.is_empty() {
            text.push("(defaults)".into());
        }
        if p.disagree {
            text.push(
                "(instances publish different settings; the first by address that publishes any \
                 applies)"
                    .into(),
            );
        }
        outln!("{id:width$}  {:>9}  {}", p.instances.len(), text.join(" "));
    }
    Ok(())
}
