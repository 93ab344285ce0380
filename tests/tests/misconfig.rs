//! Configuration that would silently do something else is refused or merged as documented:
//! runtime updates merge per field and can be cleared, hash routing needs a `#[hash_key]`
//! argument, errors name what they are about, and a handler's panic text stays on the server.

mod common;

use common::within;
use rpc::crates::governance::config::GovernanceConfig;
use rpc::{Client, GovernanceOverrides, InProcessRegistry, RpcError, ShuntStrategy, StatusCode};

#[rpc::service(name = "m.Conf")]
trait Conf {
    #[governance(timeout_ms = 700, retry_times = 2)]
    async fn get(&self, #[hash_key] key: u64) -> Result<u64, RpcError>;
    async fn plain(&self, n: u32) -> Result<u32, RpcError>;
    async fn boom(&self, what: String) -> Result<u32, RpcError>;
}

fn entry(name: &str) -> &'static rpc::MethodDescriptor {
    ConfClient::methods()
        .iter()
        .find(|m| m.method == name)
        .expect("declared method")
}

/// Two runtime updates of one id combine field by field; `clear_option` unsets one field and
/// `clear_options` all of them, so the attribute's values (700 ms, 2 retries) decide again.
#[tokio::test]
async fn runtime_updates_merge_per_field_and_can_be_cleared() {
    let client = Client::builder().registry(InProcessRegistry::new()).build();
    let get = entry("get");
    let (attribute_timeout, attribute_retries) = (700, 2);
    client
        .update_options(
            "m.Conf.get",
            GovernanceOverrides {
                timeout_ms: Some(200),
                ..GovernanceOverrides::NONE
            },
        )
        .unwrap();
    client
        .update_options(
            "m.Conf.get",
            GovernanceOverrides {
                retry_times: Some(0),
                ..GovernanceOverrides::NONE
            },
        )
        .unwrap();
    let o = client.options(get);
    assert_eq!(
        (o.timeout_ms, o.retry_times),
        (200, 0),
        "the second update keeps the first one's timeout"
    );

    client.clear_option("m.Conf.get", "timeout_ms").unwrap();
    let o = client.options(get);
    assert_eq!((o.timeout_ms, o.retry_times), (attribute_timeout, 0));

    let e = client.clear_option("m.Conf.get", "retries").unwrap_err();
    assert!(
        e.message().contains("\"retries\"") && e.message().contains("retry_times"),
        "{e}"
    );
    assert_eq!(
        client.options(get).retry_times,
        0,
        "a bad name changes nothing"
    );

    client.clear_options("m.Conf.get").unwrap();
    let o = client.options(get);
    assert_eq!(
        (o.timeout_ms, o.retry_times),
        (attribute_timeout, attribute_retries)
    );
}

struct Answer;

impl Conf for Answer {
    async fn get(&self, key: u64) -> Result<u64, RpcError> {
        Ok(key)
    }
    async fn plain(&self, n: u32) -> Result<u32, RpcError> {
        Ok(n + 1)
    }
    async fn boom(&self, what: String) -> Result<u32, RpcError> {
        panic!("boom: {what}");
    }
}

async fn serve_conf(reg: &InProcessRegistry) -> rpc::ServerHandle {
    rpc::Server::builder()
        .registry(reg.clone())
        .add_service(ConfServer::new(Answer))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

fn hash() -> GovernanceOverrides {
    GovernanceOverrides {
        shunt_strategy: Some(ShuntStrategy::Hash),
        ..GovernanceOverrides::NONE
    }
}

/// `shunt_strategy = hash` on a method without `#[hash_key]`: a runtime update or a reload is
/// refused for an entry already called, and an entry not called yet fails its first call with
/// the same error instead of quietly going round robin.
#[tokio::test]
async fn hashing_a_method_without_a_hash_key_is_refused() {
    let reg = InProcessRegistry::new();
    let server = serve_conf(&reg).await;

    // Loaded from configuration before any call: the entry's first call is refused.
    let file =
        GovernanceConfig::from_toml("[entries.\"m.Conf.plain\"]\nshunt_strategy = \"hash\"\n")
            .expect("toml");
    let configured = ConfClient::new(
        Client::builder()
            .registry(reg.clone())
            .config_layers(file, GovernanceConfig::default())
            .build(),
    );
    let e = within("misconfigured call", configured.plain(1))
        .await
        .expect_err("hash without a hash key");
    assert_eq!(e.code(), StatusCode::FrameworkError, "{e}");
    assert!(
        e.message().contains("m.Conf.plain")
            && e.message().contains("#[hash_key]")
            && e.message().contains("config file"),
        "{e}"
    );
    assert_eq!(within("keyed entry", configured.get(5)).await, Ok(5));

    // At run time, for entries already called.
    let client = Client::builder().registry(reg.clone()).build();
    let conf = ConfClient::new(client.clone());
    assert_eq!(within("plain", conf.plain(1)).await, Ok(2));
    assert_eq!(within("get", conf.get(3)).await, Ok(3));
    for id in ["m.Conf.plain", "m.Conf"] {
        let e = client.update_options(id, hash()).expect_err(id);
        assert!(
            e.message().contains("m.Conf.plain") && e.message().contains("runtime update"),
            "{e}"
        );
    }
    assert_eq!(
        client.options(entry("plain")).shunt_strategy,
        ShuntStrategy::RoundRobin,
        "a refused update changes nothing"
    );
    client
        .update_options("m.Conf.get", hash())
        .expect("get has a hash key");
    assert_eq!(
        client.options(entry("get")).shunt_strategy,
        ShuntStrategy::Hash
    );

    // A reloaded file is checked the same way, and the old configuration stays.
    let dir = std::env::temp_dir().join(format!("misconfig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("governance.toml");
    std::fs::write(&path, "[services.\"m.Conf\"]\nshunt_strategy = \"hash\"\n").expect("write");
    let e = client
        .reload_config(&path)
        .expect_err("plain has no hash key");
    assert!(
        e.message().contains("governance.toml") && e.message().contains("m.Conf.plain"),
        "{e}"
    );
    assert_eq!(
        client.options(entry("plain")).shunt_strategy,
        ShuntStrategy::RoundRobin
    );
    let _ = std::fs::remove_dir_all(&dir);
    within("shutdown", server.shutdown()).await;
}

/// A server that cannot bind says which address, and why.
#[tokio::test]
async fn a_bind_error_names_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let Err(e) = rpc::Server::builder()
        .add_service(ConfServer::new(Answer))
        .serve(addr.as_str())
        .await
    else {
        panic!("served on a taken port")
    };
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
    assert!(e.to_string().contains(&addr), "{e}");
}

/// Everything written through `tracing` while a test runs.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// The log of this test binary: a global subscriber (a scoped one can miss events whose
/// callsites other tests' threads register at the same moment). Tests find their own lines by
/// a value only they produce.
fn captured() -> &'static Captured {
    static LOGS: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        logs
    })
}

/// A panic is answered 520 with a short id; its text stays in the server's log, on the line
/// that carries the same id and the entry, unless the server opts into sending it.
#[tokio::test]
async fn a_panic_text_stays_in_the_servers_log() {
    let logs = captured();
    let reg = InProcessRegistry::new();
    let server = serve_conf(&reg).await;
    let c = ConfClient::new(Client::builder().registry(reg.clone()).build());
    let err = within("panicking call", c.boom("kaput".into()))
        .await
        .expect_err("panicked");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    assert_eq!(err.code().as_u32(), 520);
    assert!(err.message().contains("m.Conf.boom"), "{err}");
    assert!(
        !err.message().contains("kaput"),
        "the panic text left the server: {err}"
    );
    let id = err
        .message()
        .split("panic id ")
        .nth(1)
        .map(|rest| {
            rest.chars()
                .take_while(char::is_ascii_hexdigit)
                .collect::<String>()
        })
        .unwrap_or_default();
    assert_eq!(id.len(), 8, "a short panic id in {err}");
    let log = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(
        log.lines()
            .any(|l| l.contains(&id) && l.contains("m.Conf.boom") && l.contains("boom: kaput")),
        "no log line with the id {id}, the entry and the text ({err}):\n{log}"
    );
    within("shutdown", server.shutdown()).await;

    // For development, the text can be sent along.
    let reg = InProcessRegistry::new();
    let verbose = rpc::Server::builder()
        .registry(reg.clone())
        .send_panic_text(true)
        .add_service(ConfServer::new(Answer))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let err = within(
        "panicking call",
        ConfClient::new(Client::builder().registry(reg.clone()).build()).boom("kaput".into()),
    )
    .await
    .expect_err("panicked");
    assert!(err.message().contains("boom: kaput"), "{err}");
    within("shutdown", verbose.shutdown()).await;
}

/// A runtime update is checked like a config file: a value out of range is refused with an
/// error naming it, and nothing changes.
#[tokio::test]
async fn a_runtime_update_out_of_range_is_refused_and_changes_nothing() {
    let client = Client::builder().registry(InProcessRegistry::new()).build();
    let get = entry("get");
    let before = client.options(get);
    let err = client
        .update_options(
            "m.Conf.get",
            GovernanceOverrides {
                failure_ratio_percent: Some(150),
                timeout_ms: Some(10),
                ..GovernanceOverrides::NONE
            },
        )
        .unwrap_err();
    assert!(err.message().contains("failure_ratio_percent"), "{err}");
    assert_eq!(client.options(get), before);
}

/// A config section naming a method the service does not have (a misspelt name, which
/// applies to nothing) is logged as a warning naming the section, the service's entries and
/// the layer, once the client follows the service; a section of a method it has is not.
#[tokio::test]
async fn a_config_section_naming_no_method_of_its_service_is_logged() {
    let logs = captured();
    let reg = InProcessRegistry::new();
    let server = serve_conf(&reg).await;
    let file = GovernanceConfig::from_toml(
        "[entries.\"m.Conf.plian\"]\ntimeout_ms = 900\n[entries.\"m.Conf.plain\"]\ntimeout_ms = 900\n",
    )
    .expect("toml");
    let client = Client::builder()
        .registry(reg.clone())
        .config_layers(file, GovernanceConfig::default())
        .build();
    let c = ConfClient::new(client);
    // The service answers `n + 1`.
    assert_eq!(within("a call", c.plain(4)).await.expect("answered"), 5);
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    let warned: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("applies to nothing") && l.contains("m.Conf."))
        .collect();
    assert_eq!(warned.len(), 1, "{text}");
    assert!(warned[0].contains("WARN"), "{}", warned[0]);
    assert!(warned[0].contains("config file"), "{}", warned[0]);
    assert!(warned[0].contains("m.Conf.plian"), "{}", warned[0]);
    assert!(
        warned[0].contains("m.Conf.boom, m.Conf.get, m.Conf.plain"),
        "{}",
        warned[0]
    );
    // A section a reloaded file brings is checked then, not at the next change of the
    // service's instances (which may never come).
    let dir = std::env::temp_dir().join(format!("misconfig-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("governance.toml");
    std::fs::write(&path, "[entries.\"m.Conf.gte\"]\ntimeout_ms = 900\n").expect("write");
    c.client().reload_config(&path).expect("reload");
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(
        text.lines()
            .any(|l| l.contains("applies to nothing") && l.contains("m.Conf.gte")),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    within("shutdown", server.shutdown()).await;
}

/// Beside an instance that publishes no entry of the service (an older build), a section
/// naming a method the others do not publish may be the older build's: no warning.
#[tokio::test]
async fn a_section_is_not_warned_of_while_an_instance_publishes_nothing() {
    let logs = captured();
    let reg = InProcessRegistry::new();
    let server = serve_conf(&reg).await;
    let mut older = rpc::Instance::new(server.local_addr().to_string(), ["m.Conf"]);
    older.id = "an-older-build".into();
    rpc::Registry::register(&reg, older)
        .await
        .expect("register");
    let file =
        GovernanceConfig::from_toml("[entries.\"m.Conf.olny\"]\ntimeout_ms = 900\n").expect("toml");
    let c = ConfClient::new(
        Client::builder()
            .registry(reg.clone())
            .config_layers(file, GovernanceConfig::default())
            .build(),
    );
    assert_eq!(within("a call", c.plain(1)).await.expect("answered"), 2);
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(!text.contains("m.Conf.olny"), "{text}");
    within("shutdown", server.shutdown()).await;
}
