//! Connections per endpoint, made on first use and remade after a failure.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use dashmap::DashMap;
use rpc_core::RpcError;

use crate::client::{ConnectOptions, Connection};

/// A pool of multiplexed connections: `connections_per_endpoint` per address, used in turn.
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
    connecting: tokio::sync::Mutex<()>,
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
                        connecting: tokio::sync::Mutex::new(()),
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
        // One connect at a time per endpoint: concurrent callers wait for it instead of opening
        // a connection each.
        let _connecting = endpoint.connecting.lock().await;
        if let Some(c) = usable(&endpoint.conns[i]) {
            return Ok(c);
        }
        let conn = Connection::connect(addr, &self.inner.options).await?;
        *endpoint.conns[i].write().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
        Ok(conn)
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

fn usable(slot: &RwLock<Option<Connection>>) -> Option<Connection> {
    let guard = slot.read().unwrap_or_else(|p| p.into_inner());
    guard.as_ref().filter(|c| c.is_usable()).cloned()
}
