//! What a service's `main` no longer writes: a registry from one string, waiting for the first
//! endpoint, stopping on a signal, governance types from the facade, and a hash ring that keeps
//! a shard's keys when it restarts on another port.

use crate::common;
use crate::etcd_harness;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{within, LIMIT};
use rpc::{Client, GovernanceOverrides, InProcessRegistry, Registry, RpcError, Server, StatusCode};
use tests::signals::{Hold, HoldClient};

#[rpc::service(name = "ergo.Echo")]
pub trait Echo {
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

struct Plain;

impl Echo for Plain {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
}

/// A registry whose registration lands, then never answers (the write was taken, the answer
/// lost).
fn stalled() -> common::registry::TestRegistry {
    common::registry::TestRegistry::new(
        common::registry::Register::LandsThenHangs,
        common::registry::Watch::Unavailable,
    )
}

/// A server shutting down whose registry takes its time to remove it (it answers over the
/// network) does not unpublish a server of this process that publishes the same id meanwhile
/// (a shard restarted under its stable id): the removal and the publication take turns. Before,
/// the removal decided first landed after the new registration, and unpublished it for good.
#[tokio::test]
async fn a_slow_deregistration_does_not_unpublish_a_newer_server_with_its_id() {
    let registry = common::registry::TestRegistry::new(
        common::registry::Register::Answers,
        common::registry::Watch::Unavailable,
    );
    let gate = Arc::new(tokio::sync::Notify::new());
    *registry.deregister_gate.lock().unwrap() = Some(gate.clone());
    let serve = || shard_1(&registry);
    let old = within("the old server", serve()).await.expect("serve");
    let stopping = tokio::spawn(old.shutdown());
    within("the removal begins", registry.deregistered.notified()).await;
    let new = tokio::spawn(serve());
    // The new server goes as far as it can while the removal waits on its registry.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    gate.notify_one();
    let new = within("the new server", new)
        .await
        .expect("join")
        .expect("serve");
    within("the old server stops", stopping)
        .await
        .expect("join");
    let published = registry.published.lock().unwrap().clone();
    assert_eq!(published, ["shard-1"], "the new server is published");
    *registry.deregister_gate.lock().unwrap() = None;
    within("shutdown", new.shutdown()).await;
    assert!(registry.published.lock().unwrap().is_empty());
}

/// A `serve` given up while it registered removes its id later, in a task of its own; a
/// `serve` under the same id that registered meanwhile (the caller trying again at once) keeps
/// it. Before, the given-up `serve` let go of the id as it was dropped, and its late removal
/// unpublished the retry for good, which went on reporting itself registered.
#[tokio::test]
async fn a_serve_given_up_while_it_registers_leaves_its_retry_published() {
    let (began, registering) = tokio::sync::oneshot::channel();
    let registry = common::registry::TestRegistry::new(
        common::registry::Register::LandsThenHangsOnce,
        common::registry::Watch::Unavailable,
    )
    .telling(began);
    let serve = || shard_1(&registry);
    tokio::select! {
        r = serve() => panic!("served without registering: {:?}", r.map(|_| ())),
        _ = registering => {}
    }
    // Given up (dropped); tried again at once.
    let retry = within("the retry", serve()).await.expect("serve again");
    // The given-up serve's removal has had its turns on this one-thread runtime.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let published = registry.published.lock().unwrap().clone();
    assert!(published.iter().any(|id| id == "shard-1"), "{published:?}");
    within("shutdown", retry.shutdown()).await;
    assert!(registry.published.lock().unwrap().is_empty());
}

/// A `serve` given up while it registers (a timeout around a slow registry) stops serving:
/// before, its listener went on accepting calls with no handle left to stop it.
#[tokio::test]
async fn a_serve_given_up_while_it_registers_stops_serving() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (began, registering) = tokio::sync::oneshot::channel();
    let serving = Server::builder()
        .registry(stalled().telling(began))
        .add_service(EchoServer::new(Plain))
        .serve_on(listener);
    tokio::select! {
        r = serving => panic!("served without registering: {:?}", r.map(|_| ())),
        _ = registering => {}
    }
    // The serve future is dropped: its listener closes.
    within("the listener closes", async {
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

/// An echo server registered in `registry`.
async fn serve_echo(registry: &InProcessRegistry) -> rpc::ServerHandle {
    Server::builder()
        .registry(registry.clone())
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

#[tokio::test]
async fn a_registry_from_a_url_reaches_a_real_server() {
    let server = Server::builder()
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let url = server.local_addr().to_string();
    let registry = <dyn Registry>::from_url(&url).await.unwrap();
    let echo = EchoClient::new(Client::builder().shared_registry(registry).build());
    assert_eq!(
        within("a call", echo.echo("hi".into())).await.unwrap(),
        "hi"
    );

    let err = <dyn Registry>::from_url("consul://127.0.0.1:8500")
        .await
        .err()
        .expect("an unknown scheme is refused");
    assert!(
        err.to_string()
            .contains("unknown registry scheme \"consul\""),
        "{err}"
    );
}

/// (With no limit on the wait, `Duration::MAX`, which once overflowed the clock.)
#[tokio::test]
async fn waiting_for_endpoints_ends_when_a_server_registers() {
    let registry = InProcessRegistry::new();
    let client = Client::builder().registry(registry.clone()).build();
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .wait_for_endpoints(EchoClient::SERVICE_ID, Duration::MAX)
                .await
        })
    };
    // The wait is on the watch: it has not ended with nothing registered.
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished());
    let server = serve_echo(&registry).await;
    let endpoints = within("the wait", waiting).await.unwrap().unwrap();
    let addresses: Vec<String> = endpoints.iter().map(|i| i.address.clone()).collect();
    assert_eq!(addresses, [server.local_addr().to_string()]);
    let echo = EchoClient::new(client);
    assert_eq!(echo.echo("up".into()).await.unwrap(), "up");
}

/// A server handle dropped without `shutdown` deregisters its instance, as a graceful
/// shutdown does (clients stop choosing it); one aborted leaves it, as a crash would.
#[tokio::test]
async fn a_dropped_server_deregisters_and_an_aborted_one_does_not() {
    use crate::registry_watch::{has, lacks, wait_until, watch};
    let registry = InProcessRegistry::new();
    let (dropped, aborted) = (serve_echo(&registry).await, serve_echo(&registry).await);
    let (gone, kept) = (dropped.local_addr(), aborted.local_addr());
    let mut w = watch(&registry, EchoClient::SERVICE_ID).await;
    wait_until(&mut w, LIMIT, "both registered", |list| {
        has(gone)(list) && has(kept)(list)
    })
    .await;
    aborted.abort();
    drop(dropped);
    wait_until(&mut w, LIMIT, "the dropped one deregistered", lacks(gone)).await;
    assert!(
        has(kept)(&crate::registry_watch::addresses(&w)),
        "the aborted one stays"
    );
}

#[tokio::test(start_paused = true)]
async fn waiting_for_endpoints_gives_up_at_its_timeout() {
    let client = Client::builder().registry(InProcessRegistry::new()).build();
    let started = tokio::time::Instant::now();
    let err = client
        .wait_for_endpoints(EchoClient::SERVICE_ID, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert_eq!(err.code(), StatusCode::NotFindServiceRoute);
    assert!(err.message().contains("after waiting 2000 ms"), "{err}");
    assert_eq!(started.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn waiting_on_a_static_list_without_the_service_fails_at_once() {
    let registry = rpc::StaticRegistry::from_toml(
        "[[endpoint]]\naddress = \"127.0.0.1:1\"\nservices = [\"other.Service\"]\n",
    )
    .unwrap();
    let client = Client::builder().registry(registry).build();
    let started = tokio::time::Instant::now();
    let err = client
        .wait_for_endpoints(EchoClient::SERVICE_ID, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(err.message().contains("will announce none"), "{err}");
    assert_eq!(started.elapsed(), Duration::ZERO);
}

/// The governance types are reachable from the facade, by the names its docs link to.
#[tokio::test]
async fn governance_events_and_breaker_states_come_from_the_facade() {
    let client = Client::builder().registry(InProcessRegistry::new()).build();
    let bus: &rpc::EventBus = client.events();
    let mut events = bus.subscribe();
    let echo = EchoClient::new(client.clone());
    // No endpoint: the call fails, and no policy decides anything about it...
    assert!(echo.echo("x".into()).await.is_err());
    // ...but isolating the entry is a state the facade's types describe.
    client.isolate(&EchoClient::methods()[0]);
    let states: Vec<(rpc::ServiceEntryId, rpc::BreakerState)> = client.breakers();
    assert!(
        matches!(states[0].1, rpc::BreakerState::Open { .. }),
        "{states:?}"
    );
    while let Ok(event) = events.try_recv() {
        let event: rpc::GovernanceEvent = event;
        assert_ne!(event.kind, rpc::EventKind::Fallback);
    }
}

/// A `signal-server` process; killed and reaped on drop if the test did not end it.
struct SignalServer {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl SignalServer {
    fn start(registry_url: &str) -> (SignalServer, String) {
        Self::start_on(registry_url, "127.0.0.1:0")
    }

    /// A server listening on `listen` (`unix:/path` for a Unix domain socket).
    fn start_on(registry_url: &str, listen: &str) -> (SignalServer, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_signal-server"))
            .args([registry_url, listen])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start signal-server");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut server = SignalServer { child, lines };
        let first = server.line();
        let addr = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line of signal-server: {first:?}"))
            .to_string();
        (server, addr)
    }

    /// The next line the server prints, within [`LIMIT`].
    fn line(&mut self) -> String {
        self.lines
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("signal-server printed nothing within {LIMIT:?}"))
    }
}

/// A client whose calls have no deadline: a held call then ends only as the test means it to
/// (released, or dropped by the server's stop), however slow the machine. Under the default
/// 5 s `timeout_ms` a loaded machine timed the held call out before the signals it waits for.
fn untimed(client: &Client) -> Client {
    client.with_options(GovernanceOverrides {
        timeout_ms: Some(0),
        ..GovernanceOverrides::NONE
    })
}

impl Drop for SignalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_deregisters_lets_the_call_in_flight_finish_and_exits_cleanly() {
    let etcd = etcd_harness::Etcd::start().await;
    let (mut server, addr) = SignalServer::start(&etcd.url());
    let registry: Arc<dyn Registry> = <dyn Registry>::from_url(&etcd.url()).await.unwrap();
    let client = Client::builder().shared_registry(registry).build();
    let endpoints = client
        .wait_for_endpoints(HoldClient::SERVICE_ID, LIMIT)
        .await
        .unwrap();
    assert_eq!(endpoints[0].address, addr);
    let mut watch = client.watch(HoldClient::SERVICE_ID).await.unwrap();

    let hold = HoldClient::new(untimed(&client));
    let call = tokio::spawn(async move { hold.hold(7).await });
    assert_eq!(server.line(), "held");

    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());

    // Deregistered first: the registry no longer announces it, while the call still runs.
    within("deregistration", async {
        while !watch.current().is_empty() {
            watch.changed().await.unwrap();
        }
    })
    .await;
    assert!(
        !call.is_finished(),
        "the held call ended before it was released"
    );

    // Released, the call in flight finishes with its answer, and the process exits cleanly.
    let stdin = server.child.stdin.as_mut().expect("piped stdin");
    stdin.write_all(b"release\n").unwrap();
    stdin.flush().unwrap();
    assert_eq!(within("the held call", call).await.unwrap().unwrap(), 7);
    assert_eq!(server.line(), "stopped");
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "signal-server exited with {exit}");
}

#[rpc::service(name = "ergo.Shard")]
pub trait Shard {
    /// The name of the shard that owns `key`.
    async fn owner(&self, #[hash_key] key: u64) -> Result<String, RpcError>;
}

struct Named(&'static str);

impl Shard for Named {
    async fn owner(&self, _key: u64) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

async fn shard(registry: &InProcessRegistry, name: &'static str) -> rpc::ServerHandle {
    Server::builder()
        .registry(registry.clone())
        .instance_id(name)
        .metadata("shard", name)
        .add_service(ShardServer::new(Named(name)))
        .serve("127.0.0.1:0")
        .await
        .unwrap()
}

/// A call refused before any attempt (its options ask for hashing and its method has no
/// `#[hash_key]`) is still a call that failed: observers hear of it with its error.
#[tokio::test]
async fn a_call_refused_for_its_options_is_counted_with_its_error() {
    let registry = InProcessRegistry::new();
    let server = serve_echo(&registry).await;
    let client = Client::builder()
        .registry(registry)
        .shunt_strategy(rpc::ShuntStrategy::Hash)
        .build();
    let mut records = common::observe_calls(&client);
    let e = within("echo", EchoClient::new(client).echo("x".into()))
        .await
        .expect_err("hashing without a #[hash_key] is refused");
    assert!(e.message().contains("hash_key"), "{e}");
    assert_eq!(
        records.try_recv().ok(),
        Some((
            EchoClient::methods()[0].entry_id.to_string(),
            Some(e.code()),
            "error".to_string()
        ))
    );
    server.shutdown().await;
}

fn hash_client(registry: &InProcessRegistry, key: rpc::RingKey) -> ShardClient {
    ShardClient::new(
        Client::builder()
            .registry(registry.clone())
            .shunt_strategy(rpc::ShuntStrategy::Hash)
            .service_ring_key(ShardClient::SERVICE_ID, key)
            .build(),
    )
}

/// Who owns each of 200 keys, as the servers themselves answer.
async fn owners(client: &ShardClient) -> Vec<String> {
    let mut out = Vec::new();
    for key in 0..200u64 {
        out.push(
            within("a hash-routed call", client.owner(key))
                .await
                .unwrap(),
        );
    }
    out
}

#[tokio::test]
async fn a_shard_restarting_on_a_new_port_keeps_its_keys_when_the_ring_is_keyed_by_id() {
    let registry = InProcessRegistry::new();
    let a = shard(&registry, "shard-a").await;
    let b = shard(&registry, "shard-b").await;
    let by_id = hash_client(&registry, rpc::RingKey::InstanceId);
    let by_meta = hash_client(&registry, rpc::RingKey::Metadata("shard".into()));
    let by_address = hash_client(&registry, rpc::RingKey::Address);
    let mut watch = by_id.client().watch(ShardClient::SERVICE_ID).await.unwrap();
    let before = (
        owners(&by_id).await,
        owners(&by_meta).await,
        owners(&by_address).await,
    );
    for owners in [&before.0, &before.1] {
        assert!(owners.iter().any(|o| o == "shard-a") && owners.iter().any(|o| o == "shard-b"));
    }

    // shard-b stops and comes back on another port, under the same id and shard name.
    let old_port = b.local_addr().port();
    b.shutdown().await;
    let b = shard(&registry, "shard-b").await;
    assert_ne!(b.local_addr().port(), old_port);
    let new_addr = b.local_addr().to_string();
    within("the new shard-b announced", async {
        while !watch.current().iter().any(|i| i.address == new_addr) {
            watch.changed().await.unwrap();
        }
    })
    .await;

    assert_eq!(owners(&by_id).await, before.0, "keyed by instance id");
    assert_eq!(owners(&by_meta).await, before.1, "keyed by metadata");
    // Keyed by address, the new port is another place on the ring: some keys moved.
    let after = owners(&by_address).await;
    assert!(
        after.iter().zip(&before.2).any(|(x, y)| x != y),
        "no key moved although shard-b's address changed"
    );
    drop(a);
}

#[rpc::service(name = "ergo.Logged")]
pub trait Logged {
    #[governance(retry_times = 0)]
    async fn work(&self, n: u32) -> Result<u32, RpcError>;
}

struct Worker;

impl Logged for Worker {
    async fn work(&self, n: u32) -> Result<u32, RpcError> {
        tracing::info!(n, "in the handler");
        Err(RpcError::new(StatusCode::ServerError, "broken on purpose"))
    }
}

/// The fallback: its answer makes the client log a `fallback` event on the call's span.
struct Spare;

impl Logged for Spare {
    async fn work(&self, n: u32) -> Result<u32, RpcError> {
        Ok(n)
    }
}

/// Log output, shared with the test.
#[derive(Clone, Default)]
struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The word that follows `span{` on `line`: the call id.
fn id_after<'a>(line: &'a str, span: &str) -> &'a str {
    let rest = line
        .split_once(&format!("{span}{{"))
        .unwrap_or_else(|| panic!("no {span} span on {line:?}"))
        .1;
    rest.split([' ', '}']).next().unwrap_or_default()
}

async fn logged_call(terminal: bool) -> String {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::registry().with(
        rpc::logging::layer_with_writer(move || writer.clone(), terminal)
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
    );
    let _guard = common::trace_this_thread(subscriber);
    let server = Server::builder()
        .add_service(LoggedServer::new(Worker))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    let client = Client::builder()
        .registry(rpc::StaticRegistry::from_list(&server.local_addr().to_string()).unwrap())
        .fallback(LoggedServer::new(Spare))
        .build();
    let logged = LoggedClient::new(client);
    for n in [1, 2] {
        assert_eq!(within("a call", logged.work(n)).await.unwrap(), n);
    }
    server.shutdown().await;
    lines.text()
}

#[tokio::test]
async fn one_call_shows_the_same_short_id_on_client_and_server_lines() {
    let text = logged_call(false).await;
    let server_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("in the handler"))
        .collect();
    let client_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("event=fallback"))
        .collect();
    assert_eq!((server_lines.len(), client_lines.len()), (2, 2), "{text}");
    let mut ids = Vec::new();
    for (server, client) in server_lines.iter().zip(&client_lines) {
        let id = id_after(server, "rpc.server");
        assert_eq!(id.len(), 8, "{server}");
        assert!(id.chars().all(|c| c.is_ascii_hexdigit()), "{server}");
        assert_eq!(id_after(client, "rpc.client"), id, "{client}\n{server}");
        ids.push(id);
    }
    assert_ne!(ids[0], ids[1], "each call has its own id");
    for line in text.lines() {
        // Short: no attribute that only repeats the entry id, no escape codes off a terminal.
        for noise in [
            "rpc.system",
            "otel.kind",
            "rpc.service",
            "client.port",
            "\u{1b}[",
        ] {
            assert!(!line.contains(noise), "{noise:?} in {line:?}");
        }
    }
    assert!(
        server_lines[0].contains("ergo.Logged.work"),
        "{}",
        server_lines[0]
    );
}

#[tokio::test]
async fn on_a_terminal_the_lines_are_coloured() {
    let text = logged_call(true).await;
    let line = text
        .lines()
        .find(|l| l.contains("in the handler"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("\u{1b}["), "{line:?}");
}

/// A server listening on 0.0.0.0 with a registry and no advertised address is refused with a
/// message naming the fix: published as is, clients elsewhere would dial their own host, and
/// every such instance on the port would share one id. With `advertise`, it serves.
#[tokio::test]
async fn a_server_on_an_unspecified_address_with_a_registry_must_advertise_one() {
    let registry = InProcessRegistry::new();
    let err = Server::builder()
        .registry(registry.clone())
        .add_service(EchoServer::new(Plain))
        .serve("0.0.0.0:0")
        .await
        .err()
        .expect("refused");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("advertise"), "{err}");
    // An advertised address no client can dial either is refused as well.
    for undialable in ["10.0.0.5", "0.0.0.0:7000", "[::]:7000", "a:1,b:2", "unix:"] {
        let err = Server::builder()
            .registry(registry.clone())
            .add_service(EchoServer::new(Plain))
            .advertise(undialable)
            .serve("0.0.0.0:0")
            .await
            .err()
            .unwrap_or_else(|| panic!("{undialable} was advertised"));
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{undialable}");
        assert!(
            err.to_string().starts_with("advertise:"),
            "{undialable}: {err}"
        );
    }
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0")
        .await
        .expect("bind");
    let advertised = format!("127.0.0.1:{}", listener.local_addr().expect("addr").port());
    let server = Server::builder()
        .registry(registry.clone())
        .add_service(EchoServer::new(Plain))
        .advertise(advertised.clone())
        .serve_on(listener)
        .await
        .expect("serve with an advertised address");
    let client = Client::builder().registry(registry).build();
    let endpoints = within(
        "the endpoint",
        client.wait_for_endpoints(EchoClient::SERVICE_ID, Duration::from_secs(5)),
    )
    .await
    .expect("endpoints");
    let addresses: Vec<String> = endpoints.iter().map(|i| i.address.clone()).collect();
    assert_eq!(addresses, [advertised]);
    let echo = EchoClient::new(client);
    assert_eq!(
        within("a call", echo.echo("hi".into())).await.unwrap(),
        "hi"
    );
    within("shutdown", server.shutdown()).await;
}

/// A signal-server process with a call held in its handler, draining after SIGTERM (a new
/// connection refused, the held call still running): the server, the held call, and a sender
/// of signals to the process.
async fn draining_with_a_held_call() -> (
    SignalServer,
    tokio::task::JoinHandle<Result<u64, RpcError>>,
    impl Fn(&str),
) {
    let (mut server, addr) = SignalServer::start("embedded");
    let client = Client::builder()
        .shared_registry(Arc::new(rpc::StaticRegistry::new([addr.clone()])))
        .build();
    let hold = HoldClient::new(untimed(&client));
    let call = tokio::spawn(async move { hold.hold(7).await });
    assert_eq!(server.line(), "held");
    let kill = signaller(&server);
    kill("-TERM");
    // Draining: a new connection is refused, the held call still runs.
    within("the drain starts", async {
        while tokio::net::TcpStream::connect(&addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        !call.is_finished(),
        "the held call ended before the second signal"
    );
    (server, call, kill)
}

/// What sends a signal (`-TERM`, `-KILL`, ...) to `server`'s process.
fn signaller(server: &SignalServer) -> impl Fn(&str) {
    let pid = server.child.id().to_string();
    move |signal: &str| {
        let status = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("run kill");
        assert!(status.success());
    }
}

/// Kills `server` (SIGKILL) with `call` held in it: the call's error.
async fn killed_holding<T: std::fmt::Debug>(
    server: &mut SignalServer,
    kill: impl Fn(&str),
    call: tokio::task::JoinHandle<Result<T, RpcError>>,
) -> RpcError {
    kill("-KILL");
    // Held open until the call's end (see `a_second_signal_during_the_drain_stops_at_once`).
    let stdin = server.child.stdin.take();
    let _ = server.child.wait();
    let e = within("the held call", call)
        .await
        .unwrap()
        .expect_err("dropped with the process");
    drop(stdin);
    e
}

/// A server killed during its drain (SIGKILL: no destructor runs, the system closes its
/// sockets) ends its connections with a reset: the held call fails as maybe delivered, and is
/// not sent again. Before, the system closed the socket in order after the drain's GoAway 200,
/// which told the client that every call still unanswered was never read: a call that had run
/// was reported not sent, and sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_during_its_drain_leaves_its_calls_maybe_delivered() {
    let (mut server, call, kill) = draining_with_a_held_call().await;
    let e = killed_holding(&mut server, kill, call).await;
    assert!(e.is_maybe_delivered(), "{e}");
    // Ended by the reset, not by an end of stream (which, when the kill came before the
    // drain's GoAway was written, reads as maybe delivered too, and would hide the fault).
    assert!(
        !e.to_string().contains("connection closed by the server"),
        "{e}"
    );
}

/// Over a `unix:` socket, which has no reset, a server killed during its drain (SIGKILL) ends
/// its connections in order; the held call still fails as maybe delivered, since the drain's
/// last word (a `GoAway` 200 with `last`: every call read was answered) never came. Before,
/// the orderly end after the drain's first GoAway 200 read as "every call read was
/// answered", and a call that had run was taken for never read, to be sent again.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_during_its_drain_over_a_unix_socket_leaves_its_calls_maybe_delivered() {
    use rpc::crates::core::Codec;
    use rpc::crates::transport::{Call, ConnectOptions, Connection};
    let dir = tempfile::tempdir().expect("a directory for the socket");
    let listen = format!("unix:{}", dir.path().join("signals.sock").display());
    let (mut server, addr) = SignalServer::start_on("embedded", &listen);
    assert_eq!(addr, listen);
    // The transport's connection, which tells when it has read the drain's GoAway.
    let conn = Connection::connect(&addr, &ConnectOptions::default())
        .await
        .expect("connect");
    let call = {
        let conn = conn.clone();
        tokio::spawn(async move {
            let hold = Call {
                service_entry_id: "signals.Hold.hold".into(),
                codec: Codec::MsgPack.to_wire(),
                parameters: Codec::MsgPack.encode(&(7u64,)).expect("encode"),
                ..Default::default()
            };
            conn.call(hold, None).await
        })
    };
    assert_eq!(server.line(), "held");
    let kill = signaller(&server);
    kill("-TERM");
    within("the drain's GoAway", async {
        while !conn.is_draining() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let e = killed_holding(&mut server, kill, call).await;
    assert!(e.is_maybe_delivered(), "{e}");
}

/// A second signal during the drain stops the process at once: the drain would otherwise wait
/// for the call still held (up to the 10 s drain timeout), and the second Ctrl-C did nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_the_drain_stops_at_once() {
    let (mut server, call, kill) = draining_with_a_held_call().await;
    kill("-INT");
    assert_eq!(server.line(), "stopped");
    // Held open until the call's end: `Child::wait` closes the stdin it holds, and a closed
    // stdin answers the held call ("standard input closed") if the process has not ended yet.
    let stdin = server.child.stdin.take();
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "signal-server exited with {exit}");
    let e = within("the held call", call)
        .await
        .unwrap()
        .expect_err("dropped by the stop");
    drop(stdin);
    // The connection dropped with the process (506), not the call answered 520 as the drain
    // deadline answers the calls it ends: the drain did not run its course.
    assert_eq!(e.code(), StatusCode::CommunicationError, "{e}");
    // The call ran: however the connection ended after the drain's GoAway 200 (a reset, or
    // the stop's own GoAway), the client knows it may have, and did not send it again.
    assert!(e.is_maybe_delivered(), "{e}");
}

/// Serves echo as instance `shard-1` of `registry`.
fn shard_1(
    registry: &(impl rpc::Registry + Clone),
) -> impl std::future::Future<Output = std::io::Result<rpc::ServerHandle>> {
    Server::builder()
        .registry(registry.clone())
        .instance_id("shard-1")
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
}

/// A shard restarted under its stable id in `registry`: a server serving as `shard-1`, its
/// handle dropped, and a new one serving under the id; the old handle's deregistration task
/// has had its turns on this one-thread runtime when this returns the new one.
async fn restarted(registry: impl rpc::Registry + Clone) -> rpc::ServerHandle {
    let serve = || shard_1(&registry);
    let old = serve().await.expect("serve the old one");
    drop(old);
    let new = serve().await.expect("serve the new one");
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    new
}

/// A handle dropped without `shutdown` deregisters in a task of its own, later: a server of
/// this process publishing the same instance id meanwhile (a shard restarted under its stable
/// id) stays published. Before, the late deregistration removed it for good.
#[tokio::test]
async fn a_dropped_handle_does_not_unpublish_a_newer_server_with_its_id() {
    let registry = InProcessRegistry::new();
    let new = restarted(registry.clone()).await;
    let client = Client::builder().registry(registry).build();
    let watch = client.watch(EchoClient::SERVICE_ID).await.expect("watch");
    let published: Vec<String> = watch.current().iter().map(|i| i.address.clone()).collect();
    assert_eq!(published, [new.local_addr().to_string()]);
    assert!(new.status().is_registered());
    within("shutdown", new.shutdown()).await;
    let watch = client.watch(EchoClient::SERVICE_ID).await.expect("watch");
    assert!(
        watch.current().is_empty(),
        "its own shutdown unpublishes it"
    );
}

/// A server whose deregistration failed at shutdown or at its handle's drop (the registry
/// unreachable) still reads as registered: its instance stays published until its lease or
/// session ends. One whose deregistration went through reads as not registered.
#[tokio::test]
async fn a_failed_deregistration_leaves_the_server_reading_as_registered() {
    for (fails, dropped) in [(false, false), (true, false), (false, true), (true, true)] {
        let registry = common::registry::TestRegistry::new(
            common::registry::Register::Answers,
            common::registry::Watch::Unavailable,
        );
        let server = Server::builder()
            .registry(registry.clone())
            .add_service(EchoServer::new(Plain))
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        let status = server.status();
        assert!(status.is_registered());
        registry
            .deregister_fails
            .store(fails, std::sync::atomic::Ordering::SeqCst);
        if dropped {
            // The drop deregisters in a task of its own, on this (one-thread) runtime: once
            // the registry is asked, the task ends before this one runs again.
            let asked = registry.deregistered.notified();
            drop(server);
            within("the drop's deregistration", asked).await;
        } else {
            within("shutdown", server.shutdown()).await;
        }
        let published = !registry.published.lock().unwrap().is_empty();
        assert_eq!(published, fails, "the registry's own view");
        assert_eq!(
            status.is_registered(),
            published,
            "deregistration fails: {fails}, dropped: {dropped}"
        );
    }
}

/// A server of this process starting under the id of one being dropped keeps it even when
/// its registration answers after the old one's late deregistration runs: before, the new
/// server took the id only once registered, and the old one removed it in between.
#[tokio::test]
async fn a_dropped_handle_does_not_unpublish_a_newer_server_registering_meanwhile() {
    let registry = common::registry::TestRegistry::new(
        common::registry::Register::LandsThenYields,
        common::registry::Watch::Unavailable,
    );
    let new = restarted(registry.clone()).await;
    assert!(
        registry
            .published
            .lock()
            .unwrap()
            .contains(&"shard-1".to_string()),
        "the new server's registration stays"
    );
    assert!(new.status().is_registered());
    within("shutdown", new.shutdown()).await;
    assert!(registry.published.lock().unwrap().is_empty());
}

/// Servers of one process under one instance id in two registries are two publications: the
/// shutdown of one deregisters it from its registry. Before, the later one's publication kept
/// the earlier from deregistering, and the earlier stayed published with no server.
#[tokio::test]
async fn one_instance_id_in_two_registries_is_deregistered_from_each() {
    let (r1, r2) = (InProcessRegistry::new(), InProcessRegistry::new());
    let serve = |registry: &InProcessRegistry| {
        Server::builder()
            .registry(registry.clone())
            .instance_id("node-1")
            .add_service(EchoServer::new(Plain))
            .serve("127.0.0.1:0")
    };
    let a = serve(&r1).await.expect("serve a");
    let b = serve(&r2).await.expect("serve b");
    within("shutdown a", a.shutdown()).await;
    let client = Client::builder().registry(r1).build();
    let watch = client.watch(EchoClient::SERVICE_ID).await.expect("watch");
    assert!(watch.current().is_empty(), "a is gone from its registry");
    let client = Client::builder().registry(r2).build();
    let watch = client.watch(EchoClient::SERVICE_ID).await.expect("watch");
    assert_eq!(watch.current().len(), 1, "b stays in its own");
    within("shutdown b", b.shutdown()).await;
}

/// A handle dropped on a thread outside any runtime deregisters its instance on the runtime
/// it serves on, as a drop inside one does. Before, it stopped the server and left the
/// instance published.
#[test]
fn a_handle_dropped_outside_its_runtime_deregisters() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let registry = InProcessRegistry::new();
    let handle = runtime.block_on(serve_echo(&registry));
    drop(handle);
    runtime.block_on(async {
        let client = Client::builder().registry(registry).build();
        let mut watch = client.watch(EchoClient::SERVICE_ID).await.expect("watch");
        within("deregistered", async {
            while !watch.current().is_empty() {
                watch.changed().await.expect("the watch goes on");
            }
        })
        .await;
    });
}

/// A `serve` given up while it registers removes what the registry may have taken: before, the
/// instance stayed published (until its lease or session ended) with no server behind it.
#[tokio::test]
async fn a_serve_given_up_while_it_registers_unpublishes_what_landed() {
    let (began, registering) = tokio::sync::oneshot::channel();
    let registry = stalled().telling(began);
    let serving = Server::builder()
        .registry(registry.clone())
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0");
    // Given up once the registration landed (and never answers).
    tokio::select! {
        r = serving => panic!("served without registering: {:?}", r.map(|_| ())),
        _ = registering => {}
    }
    assert_eq!(
        registry.published.lock().unwrap().len(),
        1,
        "the instance landed"
    );
    within("the instance is removed", async {
        while !registry.published.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await;
}
