//! Connections per endpoint, made on first use and remade after a failure.
//!
//! Callers that need a connection which is not there share one connect attempt per slot: N
//! callers to an endpoint that does not answer all get its error after one connect timeout,
//! instead of queueing one behind another for N of them. A caller whose turn's slot has no
//! connection while another slot has one starts the slot's connect and takes the other. Each
//! attempt has an id, which every caller it fails gets: their failures are one failure of the
//! endpoint, as the calls a broken connection fails are one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use dashmap::DashMap;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use rpc_core::{RpcError, StatusCode};

use crate::client::{ConnectOptions, Connection, NEXT_CONNECTION_ID};

/// A pool of multiplexed connections: `connections_per_endpoint` per address, used in turn (a
/// turn whose connection is not there yet goes to another that is, while it connects).
///
/// A connection that broke or that the server asked to leave (`GoAway`) is replaced on the next
/// call that needs it, so a restarted server is picked up without any action. Dropping the last
/// clone of the pool closes its connections (those a caller still holds stay open until they
/// are dropped too).
#[derive(Clone)]
pub struct ConnectionPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    options: ConnectOptions,
    per_endpoint: usize,
    slots: DashMap<String, Arc<Endpoint>, ahash::RandomState>,
}

struct Endpoint {
    conns: Vec<RwLock<Option<Connection>>>,
    next: AtomicUsize,
    /// Per slot, the connect attempt under way, which every caller needing that slot awaits.
    connecting: Vec<Mutex<Option<Connecting>>>,
}

/// A connect attempt under way, shared by its callers, and whether its task has ended (its
/// outcome is then for the callers already waiting on it, not for a later one).
type Connecting = (
    Shared<BoxFuture<'static, Result<Connection, ConnectFailed>>>,
    Arc<std::sync::atomic::AtomicBool>,
);

/// A connect attempt that failed: its error, and the attempt's id, the same for every caller
/// that awaited that attempt. Ids come from the sequence of [`Connection::id`]s: one names a
/// connection or a failed attempt, never both, so callers can count the failures of one
/// attempt once, as those of one connection.
#[derive(Debug, Clone)]
pub struct ConnectFailed {
    /// Why the connection could not be made.
    pub error: RpcError,
    /// The attempt's id.
    pub attempt: u64,
}

impl ConnectionPool {
    /// A pool that opens `connections_per_endpoint` (at least 1) connections per address.
    pub fn new(options: ConnectOptions, connections_per_endpoint: usize) -> Self {
        ConnectionPool {
            inner: Arc::new(PoolInner {
                options,
                per_endpoint: connections_per_endpoint.max(1),
                slots: DashMap::with_hasher(ahash::RandomState::new()),
            }),
        }
    }

    /// The options new connections are made with.
    pub fn options(&self) -> &ConnectOptions {
        &self.inner.options
    }

    /// A usable connection to `addr` if the pool holds one, without connecting: the fast path
    /// for callers that arm a timer only when a connect is needed.
    pub fn try_get(&self, addr: &str) -> Option<Connection> {
        let endpoint = self.inner.slots.get(addr)?;
        if endpoint.conns.len() == 1 {
            return usable(&endpoint.conns[0]);
        }
        // The turn is taken only when its connection is there: a miss leaves it to `get`, which
        // connects that very slot, so every slot gets its connection.
        let turn = endpoint.next.load(Ordering::Relaxed);
        let conn = usable(&endpoint.conns[turn % endpoint.conns.len()])?;
        endpoint.next.fetch_add(1, Ordering::Relaxed);
        Some(conn)
    }

    /// A usable connection to `addr`, connecting when there is none.
    pub async fn get(&self, addr: &str) -> Result<Connection, RpcError> {
        self.get_or_failed_attempt(addr).await.map_err(|f| f.error)
    }

    /// [`get`](Self::get), a failure saying which connect attempt failed: callers that
    /// awaited one attempt get one id.
    pub async fn get_or_failed_attempt(&self, addr: &str) -> Result<Connection, ConnectFailed> {
        let endpoint = match self.inner.slots.get(addr) {
            Some(e) => e.clone(),
            None => self
                .inner
                .slots
                .entry(addr.to_string())
                .or_insert_with(|| {
                    Arc::new(Endpoint {
                        conns: (0..self.inner.per_endpoint)
                            .map(|_| RwLock::new(None))
                            .collect(),
                        next: AtomicUsize::new(0),
                        connecting: (0..self.inner.per_endpoint)
                            .map(|_| Mutex::new(None))
                            .collect(),
                    })
                })
                .clone(),
        };
        let i = if endpoint.conns.len() == 1 {
            0
        } else {
            endpoint.next.fetch_add(1, Ordering::Relaxed) % endpoint.conns.len()
        };
        if let Some(c) = usable(&endpoint.conns[i]) {
            return Ok(c);
        }
        // One connect at a time per slot: concurrent callers await the same attempt (and its
        // error) instead of opening a connection each or waiting for one another's.
        let attempt = {
            let mut connecting = endpoint.connecting[i]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some(c) = usable(&endpoint.conns[i]) {
                return Ok(c);
            }
            match connecting.as_ref() {
                Some((attempt, ended))
                    if attempt.peek().is_none() && !ended.load(Ordering::Acquire) =>
                {
                    attempt.clone()
                }
                _ => {
                    let attempt = connect(
                        addr.to_string(),
                        self.inner.options.clone(),
                        Arc::downgrade(&endpoint),
                        i,
                    );
                    let shared = attempt.0.clone();
                    *connecting = Some(attempt);
                    shared
                }
            }
        };
        // The slot connects in a task of its own; meanwhile another slot's connection, if one
        // is usable, takes the call. A slot whose connect fails (the server at its connection
        // limit, a connection broken and not remade yet) then costs its turn's calls nothing.
        let n = endpoint.conns.len();
        if let Some(c) = (1..n).find_map(|k| usable(&endpoint.conns[(i + k) % n])) {
            return Ok(c);
        }
        attempt.await
    }

    /// Whether no connection to `addr` carries a call or a stream (true for an address the
    /// pool does not know).
    pub fn is_idle(&self, addr: &str) -> bool {
        let Some(endpoint) = self.inner.slots.get(addr) else {
            return true;
        };
        endpoint.conns.iter().all(|slot| {
            slot.read()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .is_none_or(|c| c.in_flight() == 0)
        })
    }

    /// Forgets `addr`: its idle connections close now; one carrying a call or a stream takes
    /// no new call (a call about to be sent on it fails as not sent, to go elsewhere) and
    /// closes once its calls have ended and their holders let go of it. Unlike
    /// [`is_idle`](Self::is_idle) then [`evict`](Self::evict), no call is cut off by the close,
    /// whatever it raced with: a connection made meanwhile for a caller already waiting on
    /// this address is that caller's, and closes when it lets go of it.
    pub fn retire(&self, addr: &str) {
        let Some((_, endpoint)) = self.inner.slots.remove(addr) else {
            return;
        };
        for slot in &endpoint.conns {
            if let Some(c) = slot.write().unwrap_or_else(|p| p.into_inner()).take() {
                c.close_if_idle();
            }
        }
    }

    /// Closes and forgets every connection to `addr`.
    pub fn evict(&self, addr: &str) {
        if let Some((_, endpoint)) = self.inner.slots.remove(addr) {
            for slot in &endpoint.conns {
                if let Some(c) = slot.write().unwrap_or_else(|p| p.into_inner()).take() {
                    c.close();
                }
            }
        }
    }

    /// Closes every connection.
    pub fn close_all(&self) {
        let addrs: Vec<String> = self.inner.slots.iter().map(|e| e.key().clone()).collect();
        for a in addrs {
            self.evict(&a);
        }
    }
}

/// A connect attempt that puts its connection in slot `i` of `endpoint`. (Weak: the attempt is
/// stored in the endpoint, and an attempt every caller gave up on must not keep it alive.)
/// A connect attempt to `addr` for slot `i`, running in a task of its own: it goes on (and
/// its connect timeout with it) when every caller waiting for it has gone, so a later caller
/// finds it finished (its connection in the slot, or its error) instead of resuming a stale
/// one whose timeout already passed.
fn connect(
    addr: String,
    options: ConnectOptions,
    endpoint: Weak<Endpoint>,
    i: usize,
) -> Connecting {
    let peer = addr.clone();
    let attempt = NEXT_CONNECTION_ID.fetch_add(1, Ordering::Relaxed);
    let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let marks = ended.clone();
    let task = tokio::spawn(async move {
        let conn = Connection::connect(&addr, &options).await;
        if let Err(e) = &conn {
            // Its callers may have been served by another slot's connection: said here, so
            // that a slot that keeps failing is seen.
            tracing::debug!(peer = %addr, slot = i, "a pool connection could not be made: {e}");
        }
        if let (Ok(conn), Some(endpoint)) = (&conn, endpoint.upgrade()) {
            *endpoint.conns[i].write().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
        }
        marks.store(true, Ordering::Release);
        conn
    });
    let shared = async move {
        let made = task.await.unwrap_or_else(|e| {
            Err(RpcError::new(
                StatusCode::CommunicationError,
                format!("{peer}: the connect attempt failed: {e}"),
            ))
        });
        made.map_err(|error| ConnectFailed { error, attempt })
    }
    .boxed()
    .shared();
    (shared, ended)
}

fn usable(slot: &RwLock<Option<Connection>>) -> Option<Connection> {
    let guard = slot.read().unwrap_or_else(|p| p.into_inner());
    guard.as_ref().filter(|c| c.is_usable()).cloned()
}
