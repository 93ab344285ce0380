//! Calls as they end, told to whatever in the process counts them besides OpenTelemetry: an
//! admin endpoint's Prometheus metrics and its live statistics per entry.
//!
//! Such an observer is attached to a running client or server (an admin endpoint is opt-in and
//! may start after them), so the client and the server each hold a [`CallObservers`] list
//! from the start. While it is empty a call pays one relaxed atomic load for it and reads no
//! clock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rpc_core::StatusCode;
use tokio::time::Instant;

/// Which side of a call a record describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// A call this process made.
    Client,
    /// A call this process handled.
    Server,
}

impl Side {
    /// `"client"` or `"server"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Server => "server",
        }
    }
}

/// One call as it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRecord {
    /// Made or handled.
    pub side: Side,
    /// The service entry (its descriptor's id: an observer can keep it without copying).
    pub entry: &'static str,
    /// The final status (200 for success; for a fallback's answer, the status of the failure
    /// it answered for); `None` for a call its caller gave up on.
    pub status: Option<StatusCode>,
    /// `success`, `error`, `fallback`, `timeout`, `cancelled` or (a handler stopped because
    /// another attempt of the same call answered first) `superseded`, as the OpenTelemetry
    /// metrics' `rpc.outcome`.
    pub outcome: &'static str,
    /// From the call's start to its end, retries and fallback included.
    pub elapsed: Duration,
}

/// Told of every call of the client or server it is attached to, synchronously, as the call
/// ends: keep it short (count, record into a histogram).
pub trait CallObserver: Send + Sync + 'static {
    /// A call ended.
    fn call_ended(&self, call: &CallRecord);
}

/// The observers of one client or one server. Cheap to clone; clones share the list.
#[derive(Clone, Default)]
pub struct CallObservers(Arc<Shared>);

#[derive(Default)]
struct Shared {
    /// Whether the list has anything: what a call checks first.
    any: AtomicBool,
    /// Replaced whole by `add` and `remove`: a call's end tells the list as it was, with no
    /// lock held while the observers run (one may add or remove observers, itself included).
    list: RwLock<Arc<[Arc<dyn CallObserver>]>>,
}

impl std::fmt::Debug for CallObservers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallObservers")
            .field("active", &self.is_active())
            .finish()
    }
}

impl CallObservers {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an observer; it is told of every call that starts from now on.
    pub fn add(&self, observer: Arc<dyn CallObserver>) {
        let mut list = self.0.list.write().unwrap_or_else(|p| p.into_inner());
        *list = list.iter().cloned().chain([observer]).collect();
        self.0.any.store(true, Ordering::Release);
    }

    /// Removes `observer` (the same `Arc` that was added); calls no longer tell it anything,
    /// and with no observer left they read no clock again.
    pub fn remove(&self, observer: &Arc<dyn CallObserver>) {
        let mut list = self.0.list.write().unwrap_or_else(|p| p.into_inner());
        *list = list
            .iter()
            .filter(|o| !Arc::ptr_eq(o, observer))
            .cloned()
            .collect();
        self.0.any.store(!list.is_empty(), Ordering::Release);
    }

    /// Whether any observer is attached.
    pub fn is_active(&self) -> bool {
        self.0.any.load(Ordering::Relaxed)
    }

    /// The start of a call, when something observes calls (`None` otherwise: no clock read).
    pub fn start(&self) -> Option<Instant> {
        self.is_active().then(Instant::now)
    }

    /// Tells every observer that a call started at `started` ended now.
    pub fn ended(
        &self,
        side: Side,
        entry: &'static str,
        started: Instant,
        status: Option<StatusCode>,
        outcome: &'static str,
    ) {
        let record = CallRecord {
            side,
            entry,
            status,
            outcome,
            elapsed: started.elapsed(),
        };
        let list = self
            .0
            .list
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for observer in list.iter() {
            // An observer is told from inside the call's machinery (a server's call task, a
            // stream's end, a drop): its panic is contained here, and the others are told.
            let told = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                observer.call_ended(&record)
            }));
            if told.is_err() {
                tracing::warn!(
                    target: "rpc::governance",
                    entry = record.entry,
                    "a call observer panicked; the call went on"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Seen(Mutex<Vec<(String, Option<StatusCode>, &'static str)>>);

    impl CallObserver for Seen {
        fn call_ended(&self, c: &CallRecord) {
            self.0
                .lock()
                .unwrap()
                .push((c.entry.to_string(), c.status, c.outcome));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_timed_until_an_observer_is_added_then_every_call_is_told() {
        let observers = CallObservers::new();
        assert!(observers.start().is_none());
        let seen = Arc::new(Seen::default());
        observers.clone().add(seen.clone());
        let started = observers.start().expect("observed now");
        tokio::time::advance(Duration::from_millis(7)).await;
        observers.ended(
            Side::Client,
            "a.A.m",
            started,
            Some(StatusCode::Success),
            "success",
        );
        assert_eq!(
            *seen.0.lock().unwrap(),
            [("a.A.m".to_string(), Some(StatusCode::Success), "success")]
        );
    }

    /// Removes itself from its list at the first call it is told of, counting the calls.
    struct Once {
        list: CallObservers,
        me: std::sync::OnceLock<Arc<dyn CallObserver>>,
        told: std::sync::atomic::AtomicU32,
    }

    impl CallObserver for Once {
        fn call_ended(&self, _: &CallRecord) {
            self.told.fetch_add(1, Ordering::SeqCst);
            if let Some(me) = self.me.get() {
                self.list.remove(me);
            }
        }
    }

    /// An observer may remove itself (or add others) from its callback: the list is told as it
    /// was, with no lock held (before, `remove` waited for the read lock its own caller held:
    /// the call's thread hung for good).
    #[test]
    fn an_observer_may_remove_itself_while_it_is_told() {
        let observers = CallObservers::new();
        let once = Arc::new(Once {
            list: observers.clone(),
            me: std::sync::OnceLock::new(),
            told: std::sync::atomic::AtomicU32::new(0),
        });
        let me: Arc<dyn CallObserver> = once.clone();
        let _ = once.me.set(me.clone());
        observers.add(me);
        let (done_tx, done) = std::sync::mpsc::channel();
        let ending = observers.clone();
        std::thread::spawn(move || {
            for _ in 0..2 {
                ending.ended(Side::Client, "a.A.m", Instant::now(), None, "cancelled");
            }
            let _ = done_tx.send(());
        });
        done.recv_timeout(Duration::from_secs(10))
            .expect("the calls ended");
        assert_eq!(
            once.told.load(Ordering::SeqCst),
            1,
            "removed after the first"
        );
        assert!(!observers.is_active());
    }

    struct Panics;

    impl CallObserver for Panics {
        fn call_ended(&self, _: &CallRecord) {
            panic!("an observer's bug");
        }
    }

    /// An observer that panics does not unwind into the call that tells it, and the observers
    /// after it are still told.
    #[tokio::test(start_paused = true)]
    async fn a_panicking_observer_is_contained_and_the_others_are_told() {
        let observers = CallObservers::new();
        let seen = Arc::new(Seen::default());
        observers.add(Arc::new(Panics));
        observers.add(seen.clone());
        let started = observers.start().expect("observed");
        observers.ended(Side::Server, "a.A.m", started, None, "cancelled");
        assert_eq!(seen.0.lock().unwrap().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_removed_observer_is_told_nothing_and_with_none_left_nothing_is_timed() {
        let observers = CallObservers::new();
        let (kept, removed) = (Arc::new(Seen::default()), Arc::new(Seen::default()));
        let removed_dyn: Arc<dyn CallObserver> = removed.clone();
        observers.add(kept.clone());
        observers.add(removed_dyn.clone());
        observers.remove(&removed_dyn);
        let started = observers.start().expect("one observer is left");
        observers.ended(Side::Server, "a.A.m", started, None, "refused");
        assert_eq!(kept.0.lock().unwrap().len(), 1);
        assert!(removed.0.lock().unwrap().is_empty());
        let kept_dyn: Arc<dyn CallObserver> = kept.clone();
        observers.remove(&kept_dyn);
        assert!(
            observers.start().is_none(),
            "no observer left: no clock read"
        );
    }
}
