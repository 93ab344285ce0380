//! # rpc-admin
//!
//! The admin endpoint of one process: what an operator (or `rpcctl`, or a console) reads and
//! steers while it runs. Governance state lives in each process (breakers, endpoint health,
//! options resolved from several levels), so each process that wants to be seen serves it,
//! opt-in, over HTTP on loopback by default:
//!
//! | route | what |
//! |---|---|
//! | `GET /healthz` | `ok` while the process serves HTTP (no token needed) |
//! | `GET /readyz` | 200 when the server is registered and not draining, 503 with the reason |
//! | `GET /metrics` | Prometheus text format: calls, latency, governance events, breakers, endpoint health |
//! | `GET /api/services` | services, instances (with metadata) and entries, as this process sees them |
//! | `GET /api/entries` | per entry, every option in force with the level that set it |
//! | `GET /api/breakers` | each entry's breaker |
//! | `POST /api/breakers/{entry}/isolate`, `.../reset` | opens an entry's breaker until reset, closes it |
//! | `GET /api/endpoints` | endpoint health with reason and failures in a row |
//! | `POST /api/endpoints/{addr}/readmit` | takes an endpoint back |
//! | `GET /api/stats` | per entry over the last window: calls/s, error rate, p50/p99 ms |
//! | `GET /api/events?limit=N` | recent governance events (a bounded ring) |
//! | `GET /api/events/stream` | governance events as they happen (server-sent events, one JSON event per message) |
//! | `GET /api/rules` | per rule kind: the version in force in the rule store, the versions this process applied |
//! | `GET /api/rules/{kind}` | the `governance` or `routing` document in force: `{kind, version, text}` |
//! | `POST /api/rules/{kind}/validate` | checks the body (TOML) as a document of that kind; writes nothing |
//! | `PUT /api/rules/{kind}?expected=V` | validates the body and writes it over version `V`: `{version}`; 400 invalid, 409 changed meanwhile |
//! | `GET /api/rules/{kind}/history` | the versions the store keeps, oldest first |
//! | `POST /api/rules/{kind}/rollback/{version}` | writes that version's text again, as a new version |
//!
//! The rule routes read and write the etcd rule store attached with `AdminBuilder::rules`
//! (feature `etcd`); without one they answer 404 saying how to attach it, while
//! `GET /api/rules` still shows the versions applied and `validate` still checks a draft.
//!
//! Every route but `/healthz` and the console page `/` needs `Authorization: Bearer <token>`
//! when a token is set (the page asks for the token and sends it with its own requests); a
//! missing or wrong token gets 401 with a JSON `{"error": ...}` saying what to send. An unknown
//! entry or endpoint is 404 with a JSON error. Without a token the endpoint serves loopback
//! only, and its guarded routes answer only requests addressed to a loopback name that no other
//! site's page made (403 otherwise), so a web page cannot steer it; a non-loopback address
//! needs both a token and [`AdminBuilder::allow_remote`].
//!
//! ```no_run
//! # async fn f(client: rpc_client::Client, server: rpc_server::ServerHandle) -> Result<(), rpc_admin::AdminError> {
//! let admin = rpc_admin::Admin::builder()
//!     .client(&client)
//!     .server(&server)
//!     .token("s3cret")
//!     .serve("127.0.0.1:0")
//!     .await?;
//! println!("admin on {}", admin.local_addr());
//! admin.shutdown().await;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod api;
mod events;
mod metrics;
mod rules;
mod serve;
mod stats;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rpc_client::Client;
use rpc_governance::calls::CallObserver;
use rpc_server::{ServerHandle, ServerStatus};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::events::EventLog;
use crate::metrics::Metrics;
use crate::stats::Stats;

/// Why an admin endpoint did not start.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The address is not `host:port`, or names no address.
    #[error("admin address {addr:?} is not host:port (for example 127.0.0.1:9901): {reason}")]
    BadAddress {
        /// The address given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A non-loopback address was given without [`AdminBuilder::allow_remote`].
    #[error(
        "admin address {addr} is not a loopback address: the admin endpoint steers breakers; \
         serve it on 127.0.0.1, or call allow_remote(true) and set a token to expose it"
    )]
    NotLoopback {
        /// The address given.
        addr: String,
    },
    /// A non-loopback address was allowed, but no token was set.
    #[error(
        "admin address {addr} is reachable from other hosts, and no token is set: set one with \
         token(..) (clients then send `Authorization: Bearer <token>`)"
    )]
    TokenRequired {
        /// The address given.
        addr: String,
    },
    /// The token set is empty: a secret that did not resolve (an unset variable) must not turn
    /// the check off.
    #[error(
        "the admin token is empty: set a non-empty token, or none at all to serve without one \
         (loopback only)"
    )]
    EmptyToken,
    /// The token set could never arrive: no `Authorization` header carries it as it is, so
    /// every request would be refused.
    #[error(
        "the admin token cannot be sent in an HTTP header: {0}; choose a token of visible ASCII \
         characters"
    )]
    UnsendableToken(String),
    /// Binding failed.
    #[error("cannot listen on admin address {addr}: {source}")]
    Bind {
        /// The address given.
        addr: String,
        /// The system's reason.
        source: std::io::Error,
    },
}

/// Starts an admin endpoint: [`Admin::builder`].
pub struct Admin;

impl Admin {
    /// A builder with nothing attached, no token, loopback only, the last 1000 events kept and
    /// statistics over 10 s.
    pub fn builder() -> AdminBuilder {
        AdminBuilder {
            client: None,
            server: None,
            token: None,
            allow_remote: false,
            events_kept: 1000,
            stats_window: Duration::from_secs(10),
            rules: None,
            shutdown_grace: SHUTDOWN_GRACE,
            head_timeout: HEAD_TIMEOUT,
        }
    }
}

/// What an admin endpoint shows and how it is reached.
pub struct AdminBuilder {
    client: Option<Client>,
    server: Option<ServerStatus>,
    token: Option<String>,
    allow_remote: bool,
    events_kept: usize,
    stats_window: Duration,
    rules: Option<Arc<dyn rules::Store>>,
    shutdown_grace: Duration,
    head_timeout: Duration,
}

impl AdminBuilder {
    /// Shows and steers this client: its breakers, endpoints, options, services, calls and
    /// events.
    pub fn client(mut self, client: &Client) -> Self {
        self.client = Some(client.clone());
        self
    }

    /// Shows this server: readiness, its published instance, its calls and events.
    pub fn server(self, server: &ServerHandle) -> Self {
        self.server_status(server.status())
    }

    /// Like [`server`](Self::server), from a [`ServerStatus`] already taken.
    pub fn server_status(mut self, status: ServerStatus) -> Self {
        self.server = Some(status);
        self
    }

    /// Shows and edits the rules of `store` (`/api/rules/...` and the console's rules editor):
    /// the documents in force, validated writes over the version read, history and rollback.
    /// Usually the store of the registry the process uses
    /// ([`EtcdRegistry::rules`](rpc_registry::EtcdRegistry::rules)).
    #[cfg(feature = "etcd")]
    pub fn rules(mut self, store: rpc_registry::RuleStore) -> Self {
        self.rules = Some(Arc::new(store));
        self
    }

    /// Requires `Authorization: Bearer <token>` on every route but `/healthz` and the console
    /// page `/`. An empty token
    /// is refused by [`serve`](Self::serve) ([`AdminError::EmptyToken`]), and so is one that
    /// no header can carry as it is ([`AdminError::UnsendableToken`]).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Allows an address other hosts can reach (needs a token). Off by default.
    pub fn allow_remote(mut self, yes: bool) -> Self {
        self.allow_remote = yes;
        self
    }

    /// How many recent events `GET /api/events` can return (1000 by default).
    pub fn events_kept(mut self, n: usize) -> Self {
        self.events_kept = n.max(1);
        self
    }

    /// The window of `GET /api/stats`, in whole seconds (10 s by default; at least 1 s and at
    /// most 5 minutes: each second of it keeps a latency histogram of about 12 KB for every
    /// entry called in it).
    pub fn stats_window(mut self, window: Duration) -> Self {
        self.stats_window = window;
        self
    }

    /// How long a stop gives the requests in progress before their connections are dropped
    /// ([`SHUTDOWN_GRACE`] by default): see [`AdminHandle::shutdown`].
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// How long a connection has to send a request's head once it waits for one, the time it
    /// may sit idle between requests included ([`HEAD_TIMEOUT`] by default): a peer slower than
    /// that is disconnected.
    pub fn head_timeout(mut self, timeout: Duration) -> Self {
        self.head_timeout = timeout;
        self
    }

    /// Binds `addr` (`host:port`; port 0 picks a free port) and serves until
    /// [`AdminHandle::shutdown`] or the handle is dropped. From now on the attached client's
    /// and server's calls are counted and their events kept.
    pub async fn serve(self, addr: &str) -> Result<AdminHandle, AdminError> {
        if let Some(token) = &self.token {
            if token.is_empty() {
                return Err(AdminError::EmptyToken);
            }
            if let Some(why) = rpc_core::token::unsendable_in_header(token) {
                return Err(AdminError::UnsendableToken(why));
            }
        }
        let resolved: Vec<SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| AdminError::BadAddress {
                addr: addr.to_string(),
                reason: e.to_string(),
            })?
            .collect();
        let Some(first) = resolved.first().copied() else {
            return Err(AdminError::BadAddress {
                addr: addr.to_string(),
                reason: "it resolves to no address".into(),
            });
        };
        let remote = resolved.iter().any(|a| !a.ip().is_loopback());
        if remote && !self.allow_remote {
            return Err(AdminError::NotLoopback {
                addr: addr.to_string(),
            });
        }
        if remote && self.token.is_none() {
            return Err(AdminError::TokenRequired {
                addr: addr.to_string(),
            });
        }
        let listener = tokio::net::TcpListener::bind(first)
            .await
            .map_err(|source| AdminError::Bind {
                addr: addr.to_string(),
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| AdminError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        if self.token.is_none() {
            tracing::warn!(
                address = %local_addr,
                "admin endpoint without a token: any process on this host can isolate breakers"
            );
        }
        let stop = CancellationToken::new();
        let state = Arc::new(State {
            metrics: Arc::new(Metrics::new()),
            stats: Arc::new(Stats::new(self.stats_window)),
            events: EventLog::new(self.events_kept),
            token: self.token,
            client: self.client,
            server: self.server,
            rules: self.rules,
            stop: stop.clone(),
        });
        state.attach();
        let router = api::router(state.clone());
        let shutdown = stop.clone();
        let task = tokio::spawn(serve::serve(
            listener,
            router,
            self.head_timeout,
            shutdown.cancelled_owned(),
        ));
        tracing::info!(address = %local_addr, "admin endpoint serving");
        Ok(AdminHandle {
            local_addr,
            stop,
            task: Some(task),
            state,
            grace: self.shutdown_grace,
        })
    }
}

/// How long a connection has to send a request's head, unless
/// [`AdminBuilder::head_timeout`] says otherwise (hyper's own default).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`AdminHandle::shutdown`] waits for the requests in progress, unless
/// [`AdminBuilder::shutdown_grace`] says otherwise.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A running admin endpoint. Dropping it stops it as [`shutdown`](Self::shutdown) does, without
/// waiting (the requests in progress get the same grace, in the background). Once stopped, the
/// client and the server it showed no longer count their calls for it.
pub struct AdminHandle {
    local_addr: SocketAddr,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
    state: Arc<State>,
    grace: Duration,
}

impl AdminHandle {
    /// The bound address (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops serving: event streams end, requests in progress finish, then it returns; after
    /// the grace ([`SHUTDOWN_GRACE`] unless set) it returns all the same, the requests still in
    /// progress dropped with their connections (a reader of the event stream that stopped
    /// reading, its window shut, holds its connection's write, and would hold this for as long;
    /// so would a request whose body never comes).
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        self.state.detach();
        if let Some(task) = self.task.take() {
            within_grace(task, self.grace, self.local_addr).await;
        }
    }
}

/// Waits for the serving `task` to end, at most `grace`; then drops it, and with it every
/// connection still open.
async fn within_grace(mut task: JoinHandle<()>, grace: Duration, address: SocketAddr) {
    if tokio::time::timeout(grace, &mut task).await.is_err() {
        tracing::warn!(
            %address,
            grace_ms = grace.as_millis() as u64,
            "admin endpoint: requests still in progress after the shutdown's grace (a reader \
             of the event stream that reads nothing, a body that never comes?); dropped"
        );
        task.abort();
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        self.stop.cancel();
        self.state.detach();
        // Given its grace in the background, on the runtime dropping the handle (one that is
        // gone has dropped the serving task already).
        if let (Some(task), Ok(runtime)) = (self.task.take(), tokio::runtime::Handle::try_current())
        {
            runtime.spawn(within_grace(task, self.grace, self.local_addr));
        }
    }
}

/// What the routes share.
pub(crate) struct State {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) events: EventLog,
    pub(crate) token: Option<String>,
    pub(crate) client: Option<Client>,
    pub(crate) server: Option<ServerStatus>,
    /// The rule store the rules routes read and write, if one is attached.
    pub(crate) rules: Option<Arc<dyn rules::Store>>,
    /// Cancelled when the endpoint stops: ends the event subscriptions and streams.
    pub(crate) stop: CancellationToken,
}

impl State {
    /// Starts counting the attached client's and server's calls and reading their events.
    fn attach(self: &Arc<Self>) {
        if let Some(client) = &self.client {
            client.observe_calls(self.metrics.clone());
            client.observe_calls(self.stats.clone());
            self.follow("client", client.events().subscribe());
        }
        if let Some(server) = &self.server {
            server.observe_calls(self.metrics.clone());
            server.observe_calls(self.stats.clone());
            self.follow("server", server.events().subscribe());
        }
    }

    /// Stops counting the attached client's and server's calls (the event readers end with
    /// `stop`).
    fn detach(&self) {
        let (metrics, stats): (Arc<dyn CallObserver>, Arc<dyn CallObserver>) =
            (self.metrics.clone(), self.stats.clone());
        if let Some(client) = &self.client {
            client.unobserve_calls(&metrics);
            client.unobserve_calls(&stats);
        }
        if let Some(server) = &self.server {
            server.unobserve_calls(&metrics);
            server.unobserve_calls(&stats);
        }
    }

    /// Reads one bus's events into the log and the event counter until the endpoint stops.
    fn follow(
        self: &Arc<Self>,
        side: &'static str,
        mut rx: tokio::sync::broadcast::Receiver<rpc_governance::events::GovernanceEvent>,
    ) {
        use tokio::sync::broadcast::error::RecvError;
        let state = Arc::downgrade(self);
        let stop = self.stop.clone();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = stop.cancelled() => return,
                    next = rx.recv() => next,
                };
                let Some(state) = state.upgrade() else { return };
                match next {
                    Ok(e) => {
                        state.metrics.event(side, e.kind.as_str(), e.observed);
                        state.events.push(side, &e);
                    }
                    Err(RecvError::Lagged(n)) => {
                        state.metrics.lost(n);
                        // Numbered as if relayed: readers are told of the gap.
                        state.events.skip(n);
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
    }
}
