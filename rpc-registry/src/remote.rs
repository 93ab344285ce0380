//! What the backends that keep instances in a shared store (etcd, ZooKeeper) have in common: the
//! JSON an instance is stored as, the escaping of ids into key or path segments, the retry pauses
//! of their background tasks, and the bookkeeping of the watch tasks that follow one service.
//!
//! It exists so that an instance published through one backend reads the same through another
//! (the same JSON, the same segment names, but for the characters ZooKeeper alone refuses in a
//! path, which it escapes further), and so that a change to how watchers come and go is made
//! once.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rpc_core::ServiceId;
use tokio::sync::watch;

use crate::{Endpoints, Instance, RegistryError, ServiceWatch};

/// The stored form of `instance`: its JSON, as every distributed backend writes it.
pub(crate) fn encode(instance: &Instance) -> Result<Vec<u8>, RegistryError> {
    serde_json::to_vec(instance).map_err(|e| {
        RegistryError::Config(format!("instance {} cannot be encoded: {e}", instance.id))
    })
}

/// The instance stored at `key`; a value that is not one is skipped with a warning.
pub(crate) fn decode(key: &[u8], value: &[u8]) -> Option<Arc<Instance>> {
    match serde_json::from_slice::<Instance>(value) {
        Ok(instance) => Some(Arc::new(instance)),
        Err(e) => {
            tracing::warn!(
                key = %String::from_utf8_lossy(key),
                error = %e,
                "skipping a registry value that is not an instance"
            );
            None
        }
    }
}

/// The instance stored at `key` (`value` decoded as [`decode`] does), when `key` is one of its
/// places (`at(service, instance id)` for a service it serves); else `None`, with a warning. A
/// stray value naming another instance's id (a copy left under another key, an edit by hand)
/// would otherwise stand for that instance, and, listed beside it, could be the one clients
/// call.
pub(crate) fn decode_at(
    key: &str,
    value: &[u8],
    at: impl Fn(&ServiceId, &str) -> String,
) -> Option<Arc<Instance>> {
    let instance = decode(key.as_bytes(), value)?;
    if instance.services.iter().any(|s| at(s, &instance.id) == key) {
        return Some(instance);
    }
    tracing::warn!(
        key,
        instance = %instance.id,
        services = ?instance.services,
        "a registry value whose instance is not the one its key names (another id, or a \
         service it does not serve) is skipped"
    );
    None
}

/// Where `instance` is stored, one place per service it serves (`at(service, instance id)`),
/// sorted and without repeats.
pub(crate) fn places(instance: &Instance, at: impl Fn(&ServiceId, &str) -> String) -> Vec<String> {
    let mut places: Vec<String> = instance
        .services
        .iter()
        .map(|s| at(s, &instance.id))
        .collect();
    places.sort();
    places.dedup();
    places
}

/// The configured servers (or endpoints), trimmed, blank ones left out.
pub(crate) fn non_blank(list: &[impl AsRef<str>]) -> Vec<String> {
    list.iter()
        .map(|e| e.as_ref().trim().to_string())
        .filter(|e| !e.is_empty())
        .collect()
}

/// Makes an id usable as one key or path segment: `%` → `%25`, `/` → `%2F`, and a segment that
/// is all dots (`.`, `..`, which paths give a meaning) has each written `%2E`.
pub(crate) fn escape(segment: &str) -> std::borrow::Cow<'_, str> {
    if !segment.is_empty() && segment.bytes().all(|b| b == b'.') {
        return segment.replace('.', "%2E").into();
    }
    if segment.contains(['/', '%']) {
        segment.replace('%', "%25").replace('/', "%2F").into()
    } else {
        segment.into()
    }
}

/// [`escape`], then every character a ZooKeeper path may not hold written `%XX` per byte of
/// its UTF-8: controls (U+0000–U+001F, U+007F–U+009F), private use (U+E000–U+F8FF), U+FFF0–
/// U+FFFF, and everything past U+FFFF (ZooKeeper checks UTF-16 units, and refuses surrogates).
/// etcd and the in-process registry take such ids as they are, so ZooKeeper must too.
#[cfg(feature = "zookeeper")]
pub(crate) fn escape_for_zookeeper(segment: &str) -> std::borrow::Cow<'_, str> {
    fn refused(c: char) -> bool {
        matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}')
            || c >= '\u{fff0}'
    }
    let escaped = escape(segment);
    if !escaped.contains(refused) {
        return escaped;
    }
    let mut out = String::with_capacity(escaped.len() * 3);
    for c in escaped.chars() {
        if refused(c) {
            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out.into()
}

/// The inverse of [`escape`] and [`escape_for_zookeeper`]: each `%XX` (two hex digits) is the
/// byte it names (`%2F` `/`, `%25` `%`, `%2E` `.`, `%0A` a line feed); any other `%` stays as
/// it is. (Every `%` of an id is escaped, so each `%XX` of an escaped segment is an escape.)
pub(crate) fn unescape(segment: &str) -> String {
    if !segment.contains('%') {
        return segment.to_string();
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |at: usize| bytes.get(at).and_then(|b| (*b as char).to_digit(16));
        match (bytes[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Retry pauses: 100 ms doubling up to a maximum (2 s unless said otherwise).
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(2);

    /// Pauses that stop growing at `max` (at least the first pause, 100 ms).
    pub(crate) fn up_to(max: Duration) -> Self {
        Backoff {
            next: Self::FIRST,
            max: max.max(Self::FIRST),
        }
    }

    pub(crate) fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.max);
        d
    }

    pub(crate) fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::up_to(Self::MAX)
    }
}

/// Service → the channel its watch task publishes on. An entry is removed, under this lock, by
/// its task once no receiver is left, so `watch()` either subscribes to a live task or starts a
/// new one.
pub(crate) type Watches = Arc<Mutex<HashMap<ServiceId, Arc<watch::Sender<Endpoints>>>>>;

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section is a lookup, an insert or a remove: nothing to leave half-done.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The watch of `service`, shared by all its watchers: a subscription to its running watch task
/// if there is one; else `open` reads the service from the store (`first` is its first
/// snapshot) and `start` spawns the task that follows it from there, ended by the given
/// [`Signals`]. Fails if `open` fails (the store does not answer); then nothing is started.
pub(crate) async fn shared_watch<T>(
    watches: &Watches,
    alive: &watch::Receiver<()>,
    service: &ServiceId,
    open: impl Future<Output = Result<T, RegistryError>>,
    first: impl FnOnce(&T) -> Endpoints,
    start: impl FnOnce(T, Signals),
) -> Result<ServiceWatch, RegistryError> {
    if let Some(tx) = lock(watches).get(service) {
        return Ok(ServiceWatch::new(tx.subscribe()));
    }
    let opened = open.await?;
    let mut map = lock(watches);
    if let Some(tx) = map.get(service) {
        // Another watcher started the task meanwhile.
        return Ok(ServiceWatch::new(tx.subscribe()));
    }
    let tx = Arc::new(watch::Sender::new(first(&opened)));
    let rx = tx.subscribe();
    map.insert(service.clone(), tx.clone());
    start(
        opened,
        Signals {
            service: service.clone(),
            tx,
            watches: watches.clone(),
            alive: alive.clone(),
        },
    );
    Ok(ServiceWatch::new(rx))
}

/// What ends a watch task: the registry dropped, or nobody watching anymore.
pub(crate) struct Signals {
    pub(crate) service: ServiceId,
    pub(crate) tx: Arc<watch::Sender<Endpoints>>,
    pub(crate) watches: Watches,
    pub(crate) alive: watch::Receiver<()>,
}

impl Signals {
    /// Resolves with `true` when the task must end: the registry was dropped, or the last
    /// receiver went away (the task then retires from the map). Resolves with `false` when the
    /// last receiver went away but a new watcher subscribed meanwhile: the task goes on.
    async fn stop(&mut self) -> bool {
        tokio::select! {
            _ = self.alive.changed() => true,
            _ = self.tx.closed() => {
                let mut watches = lock(&self.watches);
                if self.tx.receiver_count() > 0 {
                    return false;
                }
                if watches.get(&self.service).is_some_and(|tx| Arc::ptr_eq(tx, &self.tx)) {
                    watches.remove(&self.service);
                }
                true
            }
        }
    }

    /// Resolves only when the task must end.
    pub(crate) async fn stopped(&mut self) {
        while !self.stop().await {}
    }

    /// Sleeps `d`; false if the task must end meanwhile.
    pub(crate) async fn pause(&mut self, d: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = self.stopped() => false,
        }
    }

    /// Publishes `next` if it differs from the last snapshot.
    pub(crate) fn publish(&self, next: Endpoints) {
        self.tx.send_if_modified(|current| {
            if **current == *next {
                false
            } else {
                *current = next;
                true
            }
        });
    }
}

/// Runs `task` in a task of its own on the current Tokio runtime: the work a guard dropped
/// midway (a registration or deregistration given up) hands on. False outside a runtime, where
/// nothing can run it: the caller says what is left undone.
pub(crate) fn spawn_here(task: impl Future<Output = ()> + Send + 'static) -> bool {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(task);
            true
        }
        Err(_) => false,
    }
}

/// Sleeps `d`; false when the registry was dropped meanwhile.
pub(crate) async fn pause(d: Duration, alive: &mut watch::Receiver<()>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = alive.changed() => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_escape_separators_and_dots() {
        assert_eq!(escape("echo.Echo"), "echo.Echo");
        assert_eq!(escape("a/b%c"), "a%2Fb%25c");
        assert_eq!(escape(".."), "%2E%2E");
        for id in [
            "echo.Echo",
            "a/b%c",
            "%2F",
            "x%252Fy/",
            ".",
            "..",
            "...",
            "%2E",
            "50%",
            "%zz",
        ] {
            assert_eq!(unescape(&escape(id)), id, "{id}");
            #[cfg(feature = "zookeeper")]
            assert_eq!(escape_for_zookeeper(id), escape(id), "{id}");
        }
    }

    /// What ZooKeeper refuses in a path (`PathUtils.validatePath`: controls, private use,
    /// U+FFF0 and up, surrogates) is escaped, and comes back as it was; the rest is as
    /// [`escape`] writes it.
    #[cfg(feature = "zookeeper")]
    #[test]
    fn zookeeper_segments_escape_what_zookeeper_refuses() {
        assert_eq!(escape_for_zookeeper("a\nb"), "a%0Ab");
        assert_eq!(escape_for_zookeeper("\u{7f}\u{9f}"), "%7F%C2%9F");
        assert_eq!(escape_for_zookeeper("\u{e000}"), "%EE%80%80");
        assert_eq!(escape_for_zookeeper("x\u{1f600}"), "x%F0%9F%98%80");
        assert_eq!(escape_for_zookeeper("ключ ✓ \u{a0}"), "ключ ✓ \u{a0}");
        for id in [
            "\u{0}",
            "tab\there",
            "a/b%0Ac\n",
            "\u{1}\u{1f}\u{7f}\u{80}\u{9f}",
            "\u{e000}\u{f8ff}\u{fff0}\u{ffff}",
            "emoji \u{1f600}",
            "ключ ✓",
        ] {
            let escaped = escape_for_zookeeper(id);
            // ZooKeeper's own rule, written out apart from the code under test.
            assert!(
                escaped.encode_utf16().all(|u| !(u <= 0x1f
                    || (0x7f..=0x9f).contains(&u)
                    || (0xd800..=0xf8ff).contains(&u)
                    || u >= 0xfff0)),
                "{id:?} -> {escaped:?}"
            );
            assert_eq!(unescape(&escaped), id, "{id:?}");
        }
    }

    #[test]
    fn malformed_values_are_skipped() {
        assert!(decode(b"k", b"not json").is_none());
        assert!(decode(b"k", b"{\"id\":1}").is_none());
        let good = encode(&Instance::new("127.0.0.1:1", ["a.A"])).unwrap();
        assert_eq!(decode(b"k", &good).unwrap().address, "127.0.0.1:1");
    }

    #[test]
    fn backoff_is_bounded() {
        let mut b = Backoff::default();
        let steps: Vec<u128> = (0..7).map(|_| b.next().as_millis()).collect();
        assert_eq!(steps, [100, 200, 400, 800, 1600, 2000, 2000]);
        b.reset();
        assert_eq!(b.next(), Duration::from_millis(100));
        let mut short = Backoff::up_to(Duration::from_millis(500));
        let steps: Vec<u128> = (0..4).map(|_| short.next().as_millis()).collect();
        assert_eq!(steps, [100, 200, 400, 500]);
    }
}
