//! Calling any entry by id with JSON arguments, with no compiled descriptor: what a command line,
//! a console or a gateway does, knowing only what servers publish.
//!
//! Why it exists: an operator checking a service from a shell, or a console trying a call,
//! has no generated proxy for it. [`Client::invoke_json`] finds the entry in what the service's
//! instances publish to the registry (its id, its `#[hash_key]` argument and its governance
//! settings), transcodes the JSON arguments to the client's wire codec with serde
//! (`serde_json::Value` → MessagePack or JSON), makes the call through the same governance stack
//! as a proxy's (timeout, retry, breaker, failover, routing rules; the published settings apply
//! below the client's own levels, as for a proxy), and transcodes the answer back
//! (`serde_transcode`, so MessagePack binaries and integer map keys come out as JSON too).
//!
//! The arguments are a JSON array, one element per parameter in declaration order; a JSON
//! object is not taken as named arguments here and is refused (a method whose one parameter is
//! a struct is called with `[{...}]`). Binding names to positions from what servers publish is
//! the caller's (the HTTP gateway does).
//!
//! A call needs a `'static` descriptor (the client caches each entry's state by it): each entry
//! id called this way is interned once per process, and only after some instance published it,
//! so what is kept is bounded by the entries servers publish; a service id naming no instance
//! is not kept. Instances that publish nothing (a static list's) would leave every id a caller
//! names kept for good (a program passing its users' ids on would grow without end): a client
//! calls at most [`MAX_UNPUBLISHED_ENTRIES`] entries that no instance publishes, and refuses
//! others (513) before keeping anything of them.

use std::future::Future;
use std::sync::{OnceLock, PoisonError};
use std::task::Poll;

use bytes::Bytes;
use dashmap::DashMap;
use rpc_core::{Codec, GovernanceOverrides, MethodDescriptor, RpcError, StatusCode};
use serde_json::Value;

use crate::Client;

impl Client {
    /// Calls the entry `entry_id` (`"<service id>.<method>"`) with `args`, a JSON array holding
    /// one element per parameter, and returns the answer as JSON.
    ///
    /// The entry is looked up in what the service's instances publish: an id none of them
    /// publishes fails with [`StatusCode::NotFindServiceEntry`] (513) listing the entries they
    /// do publish, and a service with no instance with [`StatusCode::NotFindServiceRoute`]
    /// (404). Instances that publish no entries at all (a static list) cannot be checked: the
    /// call is sent, and the server answers 507 for an entry it does not have; a client calls
    /// at most [`MAX_UNPUBLISHED_ENTRIES`] such entries, and refuses others with 513. The entry's
    /// published governance applies (below the client's config file, environment and runtime
    /// levels, as for a proxy), as do the routing rules, and under `shunt_strategy = hash` the
    /// published `#[hash_key]` argument is hashed as a proxy hashes it (the MessagePack
    /// encoding of its value). A key that is an integer, a string, a bool or a list of those
    /// hashes as the typed value does, so a JSON call and a proxy call with the same key go to
    /// the same server; a struct (a JSON object's fields in another order, where the typed
    /// value is encoded as a map in declaration order) or an `f32` (read from JSON as a 64-bit
    /// float) may not.
    ///
    /// `args` other than an array is refused with [`StatusCode::ValidateError`] (1001) before
    /// anything is sent. A failed call returns the call's error; a typed error's value
    /// (`Result<T, MyError>` on the server) is carried as JSON: [`error_body`] reads it.
    ///
    /// ```no_run
    /// # async fn f(client: rpc_client::Client) -> Result<(), rpc_core::RpcError> {
    /// let answer = client
    ///     .invoke_json("echo.Echo.echo", serde_json::json!(["hello"]))
    ///     .await?;
    /// assert_eq!(answer, "hello");
    /// # Ok(()) }
    /// ```
    pub async fn invoke_json(&self, entry_id: &str, args: Value) -> Result<Value, RpcError> {
        self.invoke_json_encoded(entry_id, args)
            .await?
            .to_value()
            .map_err(|e| {
                RpcError::new(
                    StatusCode::FrameworkError,
                    format!("{entry_id}: the answer is not readable as JSON: {e}"),
                )
            })
    }

    /// [`invoke_json`](Self::invoke_json), with the answer as the server encoded it: a
    /// [`JsonAnswer`] writes it as JSON text with no [`Value`] in between (what a gateway
    /// answering with JSON text does), and tells apart an answer that cannot be JSON from a
    /// failed call.
    pub async fn invoke_json_encoded(
        &self,
        entry_id: &str,
        args: Value,
    ) -> Result<JsonAnswer, RpcError> {
        let (service_id, method) = split_entry_id(entry_id)?;
        let Value::Array(list) = &args else {
            return Err(RpcError::validation(format!(
                "{entry_id}: the arguments must be a JSON array, one element per parameter in \
                 declaration order (got {}); write [{args}] for a single argument",
                json_kind(&args)
            ))
            .with_field_error("arguments", "must be a JSON array"));
        };
        // The service's lookup counts in the call's time, as a proxy's first call's does: a
        // registry that does not answer fails the call at its deadline, not never. The call
        // begins, and its deadline is worked out, when a lookup first waits (most calls find
        // their service known, and read no clock here).
        let began = OnceLock::new();
        let deadline = || {
            let began = *began.get_or_init(tokio::time::Instant::now);
            let options = self.inner.governance.options_by_ids(service_id, entry_id);
            let options = match &self.call_options {
                Some(o) => o.applied(&options),
                None => options,
            };
            rpc_governance::timeout::deadline_from(began, &options)
        };
        let no_instance = || {
            RpcError::new(
                StatusCode::NotFindServiceRoute,
                format!(
                    "{entry_id}: no instance of {service_id} is registered; start a server for \
                     it, or check the client's registry (`rpcctl services` lists the known \
                     services)"
                ),
            )
        };
        let unpublished = || {
            RpcError::new(
                StatusCode::NotFindServiceEntry,
                format!(
                    "{entry_id}: this client has called {MAX_UNPUBLISHED_ENTRIES} entries that no \
                     instance publishes (a static list's instances publish none), and calls no \
                     other: call the entries called before, or use a registry whose servers \
                     publish their entries"
                ),
            )
        };
        // A service id is kept (interned, watched for good) only once an instance of it was
        // seen, so ids that name nothing cost nothing lasting; and by this client only if its
        // instances publish it, or within the client's bound on what they do not.
        if !self.knows_service(service_id) {
            let instances = within(&deadline, entry_id, self.watch(service_id))
                .await??
                .current();
            if instances.is_empty() {
                return Err(no_instance());
            }
            let published = instances.iter().any(|instance| {
                let mut entries = instance.entries.iter();
                entries.any(|e| e.service_id.as_str() == service_id)
            });
            if !published && !self.admit_unpublished(entry_id) {
                return Err(unpublished());
            }
        }
        let service_id = lookup_str(service_id).unwrap_or_else(|| intern_str(service_id));
        // Watching the service first makes what its instances publish a configuration level
        // before the entry's options are resolved.
        let service = within(&deadline, entry_id, self.service(service_id)).await??;
        let instances = service.endpoints();
        if instances.is_empty() {
            return Err(no_instance());
        }
        // The service's entries as its instances publish them.
        let entries = || {
            instances.iter().flat_map(|instance| {
                instance
                    .entries
                    .iter()
                    .filter(|e| e.service_id.as_str() == service_id)
            })
        };
        let found = entries().find(|e| e.id.as_str() == entry_id);
        let hash_key = match (found, entries().next().is_none()) {
            (Some(e), _) => e.hash_key,
            // Nothing published (a static list): the server has the last word.
            (None, true) if self.admit_unpublished(entry_id) => None,
            (None, true) => return Err(unpublished()),
            (None, false) => {
                let mut published: Vec<&str> = entries().map(|e| e.id.as_str()).collect();
                published.sort_unstable();
                published.dedup();
                return Err(RpcError::new(
                    StatusCode::NotFindServiceEntry,
                    format!(
                        "{entry_id} is not an entry of {service_id}: its instances publish {}",
                        published.join(", ")
                    ),
                ));
            }
        };
        let descriptor = intern_descriptor(service_id, method, entry_id, hash_key);
        let codec = self.codec();
        let params = codec.encode(&args).map_err(|e| {
            RpcError::validation(format!("{entry_id}: the arguments cannot be encoded: {e}"))
        })?;
        let key = hash_key.and_then(|i| list.get(i)).map(|arg| {
            let arg = arg.clone();
            // As a proxy hashes its `#[hash_key]` argument: its MessagePack encoding.
            move || {
                Codec::MsgPack
                    .encode(&arg)
                    .map_or(0, |b| rpc_core::stable_hash(&b))
            }
        });
        // Encoded: the parsed arguments (a body's worth of JSON values, larger than its text)
        // are not held while the call is out.
        drop(args);
        // Counted from `began` when a lookup waited.
        let began = began.get().copied();
        match self.invoke_since(descriptor, params, key, began).await {
            Ok(bytes) => Ok(JsonAnswer { codec, bytes }),
            Err(e) => Err(json_payload(e)),
        }
    }
}

/// An answer of [`Client::invoke_json_encoded`]: the result as its server encoded it, to be
/// read as JSON.
#[derive(Debug, Clone)]
pub struct JsonAnswer {
    codec: Codec,
    bytes: Bytes,
}

impl JsonAnswer {
    /// The answer as a JSON value, or why it cannot be one.
    pub fn to_value(&self) -> Result<Value, String> {
        to_json(self.codec, &self.bytes)
    }

    /// Appends the answer to `out` as JSON text, or says why it cannot be JSON (then `out`
    /// may hold part of it).
    pub fn write_json(&self, out: &mut Vec<u8>) -> Result<(), String> {
        match self.codec {
            Codec::MsgPack => rpc_core::read_msgpack(&self.bytes, |de| {
                serde_transcode::transcode(de, &mut serde_json::Serializer::new(&mut *out))
            }),
            // Read through, then copied as they are: the server's bytes are not trusted to be
            // JSON (UTF-8, no lone surrogate, nested no deeper than serde_json reads), which
            // merely skipping over them would not check; and written again they would not
            // be its numbers (an integer past 64 bits reads as a float, and a float's text
            // as its shortest form: `1.50` would answer `1.5`).
            Codec::Json => {
                let mut de = serde_json::Deserializer::from_slice(&self.bytes);
                let mut nowhere = serde_json::Serializer::new(std::io::sink());
                serde_transcode::transcode(&mut de, &mut nowhere).map_err(|e| e.to_string())?;
                de.end().map_err(|e| e.to_string())?;
                out.extend_from_slice(&self.bytes);
                Ok(())
            }
        }
    }
}

/// The value of a typed error (`Result<T, MyError>` on the server) carried by `error`, as
/// JSON; `None` when the error carries none (a plain status and message).
pub fn error_body(error: &RpcError) -> Option<Value> {
    let (codec, bytes) = error.payload()?;
    to_json(*codec, bytes).ok()
}

/// `error` with its typed value, if any, carried as JSON.
/// `lookup`, failing with 519 once the call's deadline passes, when it has to wait: then
/// `deadline` is asked for the call's.
async fn within<T>(
    deadline: &(impl Fn() -> Option<tokio::time::Instant> + Sync),
    entry_id: &str,
    lookup: impl Future<Output = T>,
) -> Result<T, RpcError> {
    let mut lookup = std::pin::pin!(lookup);
    let first = std::future::poll_fn(|c| Poll::Ready(lookup.as_mut().poll(c))).await;
    if let Poll::Ready(found) = first {
        return Ok(found);
    }
    let Some(deadline) = deadline() else {
        return Ok(lookup.await);
    };
    tokio::time::timeout_at(deadline, lookup)
        .await
        .map_err(|_| {
            RpcError::new(
                StatusCode::Timeout,
                format!(
                    "{entry_id}: no endpoint was known before the deadline (the registry did not \
                 answer in time); check that the registry is reachable"
                ),
            )
        })
}

fn json_payload(error: RpcError) -> RpcError {
    let Some((codec, bytes)) = error.payload() else {
        return error;
    };
    if *codec == Codec::Json {
        return error;
    }
    match to_json(*codec, bytes).and_then(|v| serde_json::to_vec(&v).map_err(|e| e.to_string())) {
        Ok(json) => error.with_payload(Codec::Json, Bytes::from(json)),
        Err(_) => error,
    }
}

/// Transcodes an encoded value to JSON.
fn to_json(codec: Codec, bytes: &[u8]) -> Result<Value, String> {
    match codec {
        Codec::MsgPack => rpc_core::read_msgpack(bytes, |de| {
            serde_transcode::transcode(de, serde_json::value::Serializer)
        }),
        Codec::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
    }
}

/// `"shop.Greeter.greet"` → `("shop.Greeter", "greet")`.
fn split_entry_id(entry_id: &str) -> Result<(&str, &str), RpcError> {
    match entry_id.rsplit_once('.') {
        Some((service, method)) if !service.is_empty() && !method.is_empty() => {
            Ok((service, method))
        }
        _ => Err(RpcError::new(
            StatusCode::NotFindServiceEntry,
            format!(
                "{entry_id:?} is not an entry id: expected <service id>.<method>, such as \
                 echo.Echo.echo (`rpcctl entries SERVICE` lists a service's entries)"
            ),
        )),
    }
}

/// How a refusal names the kind of JSON value a caller sent where another was expected: `null`,
/// `a boolean`, `a number`, `a string`, `an array` or `an object`. Public so that every refusal
/// of JSON arguments ([`Client::invoke_json`]'s, a gateway's) words it the same way.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// How many entries that no instance publishes one client calls by id (see the module's
/// documentation).
pub const MAX_UNPUBLISHED_ENTRIES: usize = 1024;

impl Client {
    /// Whether `entry_id`, which no instance publishes, may be called: called before, or
    /// within [`MAX_UNPUBLISHED_ENTRIES`].
    fn admit_unpublished(&self, entry_id: &str) -> bool {
        let mut admitted = self
            .inner
            .unpublished
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if admitted.contains(entry_id) {
            return true;
        }
        if admitted.len() >= MAX_UNPUBLISHED_ENTRIES {
            return false;
        }
        admitted.insert(entry_id.to_string());
        true
    }
}

/// The interned strings and descriptors of entries called by id: read by every call by id, on
/// every thread, and written once per new id. Sharded maps, read under one shard's read lock,
/// rather than one mutex every call would take twice (a gateway's calls on all its threads
/// waited on each other there).
struct Interned {
    strings: DashMap<Box<str>, &'static str, ahash::RandomState>,
    /// By entry id (looked up without allocating), then hash-key position.
    descriptors: DashMap<Box<str>, Made, ahash::RandomState>,
}

/// The descriptors made for one entry id, each with its hash-key position.
type Made = Vec<(Option<usize>, &'static MethodDescriptor)>;

fn interned() -> &'static Interned {
    static INTERNED: OnceLock<Interned> = OnceLock::new();
    INTERNED.get_or_init(|| Interned {
        strings: DashMap::with_hasher(ahash::RandomState::new()),
        descriptors: DashMap::with_hasher(ahash::RandomState::new()),
    })
}

/// `s` as a `'static` string if it was interned already.
fn lookup_str(s: &str) -> Option<&'static str> {
    interned().strings.get(s).map(|found| *found)
}

/// `s` as a `'static` string, the same one every time.
fn intern_str(s: &str) -> &'static str {
    if let Some(found) = lookup_str(s) {
        return found;
    }
    // Under the shard's write lock: two threads interning `s` at once leak it once.
    *interned()
        .strings
        .entry(s.into())
        .or_insert_with(|| Box::leak(s.into()))
}

/// The descriptor of a published entry, made once per entry id and hash-key position. Its own
/// governance is empty: the published settings reach the entry through the client's published
/// level, which follows the registry.
fn intern_descriptor(
    service_id: &'static str,
    method: &str,
    entry_id: &str,
    hash_key: Option<usize>,
) -> &'static MethodDescriptor {
    let find = |made: &Made| {
        made.iter()
            .find(|(key, _)| *key == hash_key)
            .map(|(_, d)| *d)
    };
    let descriptors = &interned().descriptors;
    if let Some(d) = descriptors.get(entry_id).and_then(|made| find(&made)) {
        return d;
    }
    // Looked for again under the shard's write lock: made once however many threads ask.
    let mut made = descriptors.entry(entry_id.into()).or_default();
    if let Some(d) = find(&made) {
        return d;
    }
    let descriptor: &'static MethodDescriptor = Box::leak(Box::new(MethodDescriptor {
        service_id,
        method: intern_str(method),
        entry_id: intern_str(entry_id),
        hash_key,
        governance: GovernanceOverrides::NONE,
        api: None,
    }));
    made.push((hash_key, descriptor));
    descriptor
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_kind_names_each_kind_of_value_with_its_article() {
        use serde_json::json;
        for (value, named) in [
            (json!(null), "null"),
            (json!(false), "a boolean"),
            (json!(1.5), "a number"),
            (json!("x"), "a string"),
            (json!([1]), "an array"),
            (json!({"a": 1}), "an object"),
        ] {
            assert_eq!(json_kind(&value), named, "{value}");
        }
    }

    /// The JSON text an answer writes is what serde_json makes of the typed value the server
    /// encoded, whichever codec carried it; a value JSON cannot hold (a map keyed by lists) is
    /// refused, as by `to_value`, and so are bytes that are not JSON under the JSON codec.
    #[test]
    fn an_answer_writes_the_json_of_the_value_its_server_encoded() {
        use std::collections::BTreeMap;
        #[derive(serde::Serialize)]
        struct Order {
            id: u64,
            tags: Vec<String>,
            by_day: BTreeMap<u32, f64>,
            note: Option<String>,
        }
        let order = Order {
            id: 7,
            tags: vec!["a\"b".into(), "ü".into()],
            by_day: BTreeMap::from([(1, 0.5), (2, -3.0)]),
            note: None,
        };
        let expected = serde_json::to_value(&order).expect("oracle");
        for codec in [Codec::MsgPack, Codec::Json] {
            let answer = JsonAnswer {
                codec,
                bytes: codec.encode(&order).expect("encode"),
            };
            let mut text = b"[".to_vec();
            answer.write_json(&mut text).expect("written");
            let written: Value = serde_json::from_slice(&text[1..]).expect("JSON text");
            assert_eq!(written, expected, "{codec:?}");
            assert_eq!(answer.to_value().expect("a value"), expected, "{codec:?}");
        }
        let keyed_by_lists = BTreeMap::from([(vec![1u32], 1u32)]);
        let answer = JsonAnswer {
            codec: Codec::MsgPack,
            bytes: Codec::MsgPack.encode(&keyed_by_lists).expect("encode"),
        };
        assert!(answer.write_json(&mut Vec::new()).is_err());
        assert!(answer.to_value().is_err());
        // A JSON answer's numbers are passed on as the server wrote them, not as a double
        // read and written again would be.
        for number in [&b"945.2706955539223"[..], b"18446744073709551616"] {
            let answer = JsonAnswer {
                codec: Codec::Json,
                bytes: Bytes::copy_from_slice(number),
            };
            let mut text = Vec::new();
            answer.write_json(&mut text).expect("JSON");
            assert_eq!(text, number, "{}", String::from_utf8_lossy(number));
        }
        // Bytes a server sent as JSON that are not: refused as `to_value` refuses them.
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for bytes in [
            &b"{\"a\": 1} trailing"[..],
            b"\"\xff\"",
            br#""\ud800""#,
            deep.as_bytes(),
        ] {
            let not_json = JsonAnswer {
                codec: Codec::Json,
                bytes: Bytes::copy_from_slice(bytes),
            };
            let shown = String::from_utf8_lossy(bytes);
            assert!(not_json.to_value().is_err(), "{shown}");
            assert!(not_json.write_json(&mut Vec::new()).is_err(), "{shown}");
        }
    }

    #[test]
    fn entry_ids_split_at_the_last_dot() {
        assert_eq!(
            split_entry_id("shop.Greeter.greet").unwrap(),
            ("shop.Greeter", "greet")
        );
        for bad in ["greet", ".greet", "shop.Greeter.", ""] {
            let e = split_entry_id(bad).unwrap_err();
            assert_eq!(e.code(), StatusCode::NotFindServiceEntry, "{bad}");
            assert!(e.message().contains("<service id>.<method>"), "{e}");
        }
    }

    #[test]
    fn messagepack_answers_transcode_to_json() {
        use std::collections::BTreeMap;
        #[derive(serde::Serialize)]
        struct Answer {
            name: String,
            #[serde(with = "serde_bytes_like")]
            raw: Vec<u8>,
            by_id: BTreeMap<u32, bool>,
            missing: Option<u8>,
        }
        /// Serializes as a byte string (MessagePack bin), as `serde_bytes` would.
        mod serde_bytes_like {
            pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(v)
            }
        }
        let bytes = Codec::MsgPack
            .encode(&Answer {
                name: "ann".into(),
                raw: vec![1, 2],
                by_id: BTreeMap::from([(7, true)]),
                missing: None,
            })
            .unwrap();
        // The oracle: the JSON a reader expects, written out.
        let expected = serde_json::json!({
            "name": "ann", "raw": [1, 2], "by_id": { "7": true }, "missing": null
        });
        assert_eq!(to_json(Codec::MsgPack, &bytes).unwrap(), expected);
        // A plain decode into `Value` refuses the binary and the integer key.
        assert!(Codec::MsgPack.decode::<Value>(&bytes).is_err());
    }

    #[tokio::test]
    async fn a_service_id_naming_no_instance_is_not_kept() {
        let client = Client::builder()
            .registry(rpc_registry::InProcessRegistry::new())
            .build();
        let e = client
            .invoke_json("t.NobodyServes.m", serde_json::json!([]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), StatusCode::NotFindServiceRoute, "{e}");
        assert!(lookup_str("t.NobodyServes").is_none());
        assert!(lookup_str("t.NobodyServes.m").is_none());
    }

    #[test]
    fn descriptors_are_interned_once() {
        let s = intern_str("t.Generic");
        let a = intern_descriptor(s, "m", "t.Generic.m", None);
        let b = intern_descriptor(intern_str("t.Generic"), "m", "t.Generic.m", None);
        assert!(std::ptr::eq(a, b));
        assert_eq!(
            (a.service_id, a.method, a.entry_id),
            ("t.Generic", "m", "t.Generic.m")
        );
        let c = intern_descriptor(s, "m", "t.Generic.m", Some(0));
        assert!(!std::ptr::eq(a, c));
    }

    /// The gateway's JSON key and a proxy's typed key hash alike for integers (both signs),
    /// strings, bools and lists of them: a JSON call lands where a typed call with the same key
    /// does.
    #[test]
    fn json_keys_hash_as_typed_keys_do() {
        fn hash<T: serde::Serialize>(v: &T) -> u64 {
            rpc_core::stable_hash(&Codec::MsgPack.encode(v).expect("encode"))
        }
        let json = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
        assert_eq!(hash(&json("42")), hash(&42u64));
        assert_eq!(hash(&json("42")), hash(&42u8));
        assert_eq!(hash(&json("-7")), hash(&-7i32));
        assert_eq!(hash(&json("4000000000")), hash(&4_000_000_000u32));
        assert_eq!(hash(&json("\"ann\"")), hash(&"ann".to_string()));
        assert_eq!(hash(&json("true")), hash(&true));
        assert_eq!(hash(&json("[1, 2]")), hash(&vec![1u16, 2]));
        assert_eq!(hash(&json("[\"a\", 3]")), hash(&("a", 3u64)));
    }
}
