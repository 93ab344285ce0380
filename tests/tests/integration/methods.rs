//! Methods end to end: argument lists of every size, typed and business errors, two services on
//! one server, the JSON codec, panics, unknown entries and bad arguments on the wire, server
//! fallback.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::within;
use rpc::crates::core::wire::RemoteInvokeMessage;
use rpc::crates::core::NoArgs;
use rpc::crates::transport::{ConnectOptions, Connection};
use rpc::{Client, Codec, InProcessRegistry, RpcError, Server, ServerHandle, StatusCode};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Point {
    x: i32,
    y: i32,
}

/// A typed error: travels as a business error (1000) with its value, comes back as itself.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum CalcError {
    DivideByZero { dividend: i64 },
    Negative(i64),
    Unlucky,
    Rpc { code: u32, message: String },
}

impl From<RpcError> for CalcError {
    fn from(e: RpcError) -> Self {
        CalcError::Rpc {
            code: e.code().as_u32(),
            message: e.to_string(),
        }
    }
}

#[rpc::service(name = "t.Calc")]
trait Calc {
    async fn answer(&self) -> Result<u64, RpcError>;
    async fn describe(&self, name: String, times: u32, at: Point) -> Result<String, RpcError>;
    async fn nothing(&self) -> Result<(), RpcError>;
    async fn index(
        &self,
        points: Vec<Point>,
        label: Option<String>,
    ) -> Result<BTreeMap<String, Point>, RpcError>;
    async fn divide(&self, a: i64, b: i64) -> Result<i64, CalcError>;
    async fn refuse(&self, why: String) -> Result<u32, RpcError>;
    async fn boom(&self, what: String) -> Result<u32, RpcError>;
}

#[rpc::service(name = "t.Names")]
trait Names {
    async fn name(&self) -> Result<String, RpcError>;
}

/// No `name = "..."`: the service id is `"<module path>.<Trait>"`.
#[rpc::service]
trait Unnamed {
    async fn hello(&self, who: String) -> Result<String, RpcError>;
    /// An argument named with a raw identifier: it is `type` on the wire and in errors.
    async fn kind(&self, r#type: u32) -> Result<u32, RpcError>;
}

struct Hi;

/// A server of `Unnamed` on `reg`.
async fn serve_unnamed(reg: &InProcessRegistry) -> ServerHandle {
    Server::builder()
        .registry(reg.clone())
        .add_service(UnnamedServer::new(Hi))
        .serve("127.0.0.1:0")
        .await
        .expect("serve")
}

impl Unnamed for Hi {
    async fn hello(&self, who: String) -> Result<String, RpcError> {
        Ok(format!("hi {who}"))
    }
    async fn kind(&self, r#type: u32) -> Result<u32, RpcError> {
        Ok(r#type)
    }
}

#[derive(Default)]
struct Counts {
    divide: AtomicUsize,
    refuse: AtomicUsize,
    boom: AtomicUsize,
}

struct Calculator {
    counts: Arc<Counts>,
}

impl Calc for Calculator {
    async fn answer(&self) -> Result<u64, RpcError> {
        Ok(42)
    }
    async fn describe(&self, name: String, times: u32, at: Point) -> Result<String, RpcError> {
        Ok(format!("{name}x{times}@({},{})", at.x, at.y))
    }
    async fn nothing(&self) -> Result<(), RpcError> {
        Ok(())
    }
    async fn index(
        &self,
        points: Vec<Point>,
        label: Option<String>,
    ) -> Result<BTreeMap<String, Point>, RpcError> {
        let label = label.unwrap_or_else(|| "p".into());
        Ok(points
            .into_iter()
            .enumerate()
            .map(|(i, p)| (format!("{label}{i}"), p))
            .collect())
    }
    async fn divide(&self, a: i64, b: i64) -> Result<i64, CalcError> {
        self.counts.divide.fetch_add(1, Ordering::SeqCst);
        match (a, b) {
            (_, 0) => Err(CalcError::DivideByZero { dividend: a }),
            (a, _) if a < 0 => Err(CalcError::Negative(a)),
            (13, _) => Err(CalcError::Unlucky),
            (a, b) => Ok(a / b),
        }
    }
    async fn refuse(&self, why: String) -> Result<u32, RpcError> {
        self.counts.refuse.fetch_add(1, Ordering::SeqCst);
        Err(RpcError::business(why))
    }
    async fn boom(&self, what: String) -> Result<u32, RpcError> {
        self.counts.boom.fetch_add(1, Ordering::SeqCst);
        panic!("boom: {what}");
    }
}

struct Named(&'static str);

impl Names for Named {
    async fn name(&self) -> Result<String, RpcError> {
        Ok(self.0.to_string())
    }
}

async fn serve(reg: &InProcessRegistry) -> (ServerHandle, Arc<Counts>) {
    let counts = Arc::new(Counts::default());
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(CalcServer::new(Calculator {
            counts: counts.clone(),
        }))
        .add_service(NamesServer::new(Named("names-on-calc")))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    (server, counts)
}

fn calc(reg: &InProcessRegistry, codec: Codec) -> CalcClient {
    CalcClient::new(Client::builder().registry(reg.clone()).codec(codec).build())
}

#[tokio::test]
async fn methods_with_zero_to_three_arguments_and_rich_types_in_both_codecs() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg).await;
    for codec in [Codec::MsgPack, Codec::Json] {
        let c = calc(&reg, codec);
        assert_eq!(c.client().codec(), codec);
        assert_eq!(c.answer().await.expect("0 args"), 42, "{codec:?}");
        assert_eq!(
            c.describe("ann".into(), 3, Point { x: -1, y: 2 })
                .await
                .expect("3 args"),
            "annx3@(-1,2)",
            "{codec:?}"
        );
        c.nothing().await.expect("unit result");
        let points = vec![Point { x: 1, y: 1 }, Point { x: 2, y: 3 }];
        let by_label = c
            .index(points.clone(), Some("q".into()))
            .await
            .expect("vec and option");
        assert_eq!(
            by_label,
            BTreeMap::from([
                ("q0".to_string(), points[0].clone()),
                ("q1".into(), points[1].clone())
            ]),
            "{codec:?}"
        );
        let default_label = c.index(points, None).await.expect("None argument");
        assert!(
            default_label.contains_key("p1"),
            "{codec:?}: {default_label:?}"
        );
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn typed_errors_come_back_as_the_same_variant_and_are_not_retried() {
    let reg = InProcessRegistry::new();
    let (server, counts) = serve(&reg).await;
    for codec in [Codec::MsgPack, Codec::Json] {
        let c = calc(&reg, codec);
        assert_eq!(c.divide(9, 3).await, Ok(3));
        assert_eq!(
            c.divide(7, 0).await,
            Err(CalcError::DivideByZero { dividend: 7 }),
            "{codec:?}"
        );
        assert_eq!(
            c.divide(-4, 2).await,
            Err(CalcError::Negative(-4)),
            "{codec:?}"
        );
        assert_eq!(c.divide(13, 1).await, Err(CalcError::Unlucky), "{codec:?}");
    }
    assert_eq!(
        counts.divide.load(Ordering::SeqCst),
        8,
        "one run per call: typed errors are answers, not retried"
    );
    within("shutdown", server.shutdown()).await;

    // A failure of the call itself reaches the typed error through From<RpcError>.
    let err = calc(&reg, Codec::MsgPack)
        .divide(1, 1)
        .await
        .expect_err("no server");
    assert!(
        matches!(err, CalcError::Rpc { code: 404, .. }),
        "unserved service: {err:?}"
    );
}

#[tokio::test]
async fn a_business_error_reaches_the_caller_unchanged_and_runs_once() {
    let reg = InProcessRegistry::new();
    // Two servers: a retry or failover would show as a second run on either.
    let (a, counts_a) = serve(&reg).await;
    let (b, counts_b) = serve(&reg).await;
    let c = calc(&reg, Codec::MsgPack);
    let why = "no: the account is frozen (ticket #12)";
    let err = c.refuse(why.into()).await.expect_err("refused");
    assert_eq!(err.code(), StatusCode::BusinessError, "{err}");
    assert_eq!(err.code().as_u32(), 1000);
    assert_eq!(err.message(), why, "the server's message, unchanged");
    assert!(err.tried().is_empty(), "not a failover error: {err:?}");
    let runs = counts_a.refuse.load(Ordering::SeqCst) + counts_b.refuse.load(Ordering::SeqCst);
    assert_eq!(runs, 1, "a business error is never retried");
    within("shutdown", a.shutdown()).await;
    within("shutdown", b.shutdown()).await;
}

#[tokio::test]
async fn two_services_share_one_server() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg).await;
    let client = Client::builder().registry(reg.clone()).build();
    let names = NamesClient::new(client.clone());
    let c = CalcClient::new(client);
    assert_eq!(names.name().await.expect("names"), "names-on-calc");
    assert_eq!(c.answer().await.expect("calc"), 42);
    assert_eq!(names.name().await.expect("names"), "names-on-calc");
    within("shutdown", server.shutdown()).await;
}

/// One service added twice (two implementations, or one twice) is refused when serving: the
/// later would silently take every entry of the earlier, and the instance would publish the
/// service twice.
#[tokio::test]
async fn a_service_added_twice_is_refused() {
    let twice = Server::builder()
        .add_service(NamesServer::new(Named("first")))
        .add_service(CalcServer::new(Spare))
        .add_service(NamesServer::new(Named("second")))
        .serve("127.0.0.1:0")
        .await;
    let Err(e) = twice else {
        panic!("a service added twice was served");
    };
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("t.Names is added twice"), "{e}");
}

#[tokio::test]
async fn a_json_client_and_a_msgpack_client_share_a_server() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg).await;
    let json = calc(&reg, Codec::Json);
    let msgpack = calc(&reg, Codec::MsgPack);
    for i in 0..5 {
        let at = Point { x: i, y: -i };
        assert_eq!(
            json.describe("j".into(), i as u32, at.clone())
                .await
                .expect("json"),
            format!("jx{i}@({i},{})", -i)
        );
        assert_eq!(
            msgpack
                .describe("m".into(), i as u32, at)
                .await
                .expect("msgpack"),
            format!("mx{i}@({i},{})", -i)
        );
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_handler_panic_is_a_server_error_and_the_server_keeps_answering() {
    let reg = InProcessRegistry::new();
    let (server, counts) = serve(&reg).await;
    let c = calc(&reg, Codec::MsgPack);
    let err = c.boom("kaput".into()).await.expect_err("panicked");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    assert_eq!(err.code().as_u32(), 520);
    // The text stays on the server (see misconfig::a_panic_text_stays_in_the_servers_log).
    assert!(
        err.message().contains("t.Calc.boom") && err.message().contains("panic id"),
        "{err}"
    );
    assert_eq!(
        counts.boom.load(Ordering::SeqCst),
        1,
        "a server error is not retried"
    );
    for _ in 0..3 {
        assert_eq!(c.answer().await.expect("after the panic"), 42);
    }
    within("shutdown", server.shutdown()).await;
}

/// A handler that panics in its first poll, run on its connection's reader
/// (`inline_first_poll`), is logged in its call's `rpc.server` span, as one run in a task of
/// its own is: the line is found by the call's id.
#[tokio::test]
async fn a_panic_in_an_inline_first_poll_is_logged_in_the_calls_span() {
    let (mut lines, _guard) = common::log_lines(tracing::Level::INFO);
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .inline_first_poll(true)
        .add_service(CalcServer::new(Calculator {
            counts: Arc::new(Counts::default()),
        }))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let err = calc(&reg, Codec::MsgPack)
        .boom("kaput".into())
        .await
        .expect_err("panicked");
    assert_eq!(err.code(), StatusCode::ServerError, "{err}");
    let line = loop {
        let line = common::recv_one("a log line", &mut lines).await;
        if line.contains("handler panicked") {
            break line;
        }
    };
    assert!(line.contains("rpc.server"), "{line}");
    within("shutdown", server.shutdown()).await;
}

async fn raw_call(server: &ServerHandle, invoke: RemoteInvokeMessage) -> (u32, String) {
    let conn = Connection::connect(&server.local_addr().to_string(), &ConnectOptions::default())
        .await
        .expect("connect");
    let r = within("raw call", conn.call(invoke, None))
        .await
        .expect("answer");
    (r.status_code, r.exception_message)
}

#[tokio::test]
async fn an_unknown_entry_is_507_naming_it() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg).await;
    for entry in ["nope.Nope.x", "t.Calc.nope", "t.Calc"] {
        let (code, message) = raw_call(
            &server,
            RemoteInvokeMessage {
                service_entry_id: entry.into(),
                codec: Codec::MsgPack.to_wire(),
                parameters: Codec::MsgPack.encode(&NoArgs).expect("encode"),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(
            code,
            StatusCode::NotFindLocalServiceEntry.as_u32(),
            "{entry}"
        );
        assert_eq!(code, 507);
        assert!(message.contains(entry), "{entry}: {message}");
    }
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn bad_arguments_and_an_unknown_codec_are_refused_clearly() {
    let reg = InProcessRegistry::new();
    let (server, counts) = serve(&reg).await;
    let divide = |codec: i32, parameters: bytes::Bytes| RemoteInvokeMessage {
        service_entry_id: "t.Calc.divide".into(),
        codec,
        parameters,
        ..Default::default()
    };
    // Strings where integers belong.
    let wrong_types = Codec::MsgPack.encode(&("a", "b")).expect("encode");
    let (code, message) = raw_call(&server, divide(Codec::MsgPack.to_wire(), wrong_types)).await;
    assert_eq!(code, StatusCode::ValidateError.as_u32(), "{message}");
    assert!(message.contains("t.Calc.divide"), "{message}");
    // Not MessagePack at all.
    let (code, message) = raw_call(
        &server,
        divide(Codec::MsgPack.to_wire(), bytes::Bytes::from_static(&[0xc1])),
    )
    .await;
    assert_eq!(code, StatusCode::ValidateError.as_u32(), "{message}");
    // A whole argument list with a byte after it.
    let mut trailing = Codec::MsgPack.encode(&(10, 5)).expect("encode").to_vec();
    trailing.push(0x01);
    let (code, message) =
        raw_call(&server, divide(Codec::MsgPack.to_wire(), trailing.into())).await;
    assert_eq!(code, StatusCode::ValidateError.as_u32(), "{message}");
    assert!(message.contains("bytes follow the value"), "{message}");
    // JSON bytes announced as JSON are fine.
    let json = Codec::Json.encode(&(10, 5)).expect("encode");
    let (code, message) = raw_call(&server, divide(Codec::Json.to_wire(), json.clone())).await;
    assert_eq!(code, 200, "{message}");
    // A codec number nobody knows.
    let (code, message) = raw_call(&server, divide(7, json)).await;
    assert_eq!(code, StatusCode::FrameworkError.as_u32(), "{message}");
    assert!(message.contains('7'), "{message}");
    assert_eq!(
        counts.divide.load(Ordering::SeqCst),
        1,
        "only the good call ran"
    );
    within("shutdown", server.shutdown()).await;
}

/// Answers in place of the real implementation when its handler fails.
struct Spare;

impl Calc for Spare {
    async fn answer(&self) -> Result<u64, RpcError> {
        Ok(0)
    }
    async fn describe(&self, name: String, _: u32, _: Point) -> Result<String, RpcError> {
        Ok(format!("spare for {name}"))
    }
    async fn nothing(&self) -> Result<(), RpcError> {
        Ok(())
    }
    async fn index(
        &self,
        _: Vec<Point>,
        _: Option<String>,
    ) -> Result<BTreeMap<String, Point>, RpcError> {
        Ok(BTreeMap::new())
    }
    async fn divide(&self, _: i64, _: i64) -> Result<i64, CalcError> {
        Ok(-1)
    }
    async fn refuse(&self, _: String) -> Result<u32, RpcError> {
        Ok(0)
    }
    async fn boom(&self, what: String) -> Result<u32, RpcError> {
        Ok(what.len() as u32)
    }
}

#[tokio::test]
async fn a_server_fallback_answers_for_a_panic_but_not_for_the_callees_answers() {
    let reg = InProcessRegistry::new();
    let counts = Arc::new(Counts::default());
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(CalcServer::new(Calculator {
            counts: counts.clone(),
        }))
        .fallback(CalcServer::new(Spare))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let c = calc(&reg, Codec::MsgPack);
    assert_eq!(c.boom("four".into()).await.expect("fallback answered"), 4);
    assert_eq!(
        counts.boom.load(Ordering::SeqCst),
        1,
        "the handler ran first"
    );
    // Business and typed errors are the callee's answer: the fallback stays out.
    let err = c.refuse("because".into()).await.expect_err("business");
    assert_eq!(err.code(), StatusCode::BusinessError, "{err}");
    assert_eq!(
        c.divide(1, 0).await,
        Err(CalcError::DivideByZero { dividend: 1 })
    );
    within("shutdown", server.shutdown()).await;
}

#[tokio::test]
async fn a_service_without_a_name_is_served_under_its_module_path() {
    assert_eq!(
        UnnamedClient::SERVICE_ID,
        concat!(module_path!(), ".Unnamed")
    );
    assert_eq!(
        UnnamedClient::methods()[0].entry_id,
        concat!(module_path!(), ".Unnamed.hello")
    );
    let reg = InProcessRegistry::new();
    let server = serve_unnamed(&reg).await;
    let c = UnnamedClient::new(Client::builder().registry(reg.clone()).build());
    assert_eq!(c.hello("bo".into()).await.expect("hello"), "hi bo");
    within("shutdown", server.shutdown()).await;
}

/// An argument that does not decode is named: position, name and expected type, in both
/// codecs, and the caller's error names the endpoint that answered.
#[tokio::test]
async fn an_argument_decode_error_names_the_argument_and_the_endpoint() {
    let reg = InProcessRegistry::new();
    let (server, _) = serve(&reg).await;
    let endpoint = server.local_addr().to_string();
    let describe = CalcClient::methods()
        .iter()
        .find(|m| m.method == "describe")
        .expect("describe");
    for codec in [Codec::MsgPack, Codec::Json] {
        let client = Client::builder().registry(reg.clone()).codec(codec).build();
        // describe(name: String, times: u32, at: Point): a string where `times` belongs.
        let wrong = codec
            .encode(&("ann", "three", Point { x: 1, y: 2 }))
            .expect("encode");
        let e = within(
            "wrong type",
            client.invoke(describe, wrong, None::<fn() -> u64>),
        )
        .await
        .expect_err("times is not a u32");
        assert_eq!(e.code(), StatusCode::ValidateError, "{e}");
        let m = e.message();
        assert!(
            m.contains("t.Calc.describe")
                && m.contains("argument 2 `times`: expected u32")
                && m.contains(&endpoint),
            "{codec:?}: {m}"
        );
        // A list one argument short.
        let short = codec.encode(&("ann", 3u32)).expect("encode");
        let e = within(
            "missing",
            client.invoke(describe, short, None::<fn() -> u64>),
        )
        .await
        .expect_err("at is missing");
        assert!(
            e.message().contains("argument 3 `at` (Point) is missing"),
            "{codec:?}: {e}"
        );
        // A nested field of the wrong type names the argument that holds it.
        let nested = codec.encode(&("ann", 3u32, ("x", "y"))).expect("encode");
        let e = within(
            "nested",
            client.invoke(describe, nested, None::<fn() -> u64>),
        )
        .await
        .expect_err("at is not a Point");
        assert!(
            e.message().contains("argument 3 `at`: expected Point"),
            "{codec:?}: {e}"
        );
    }
    within("shutdown", server.shutdown()).await;
}

/// An argument with a raw identifier (`r#type`) is named as the entry publishes it (`type`)
/// when it does not decode.
#[tokio::test]
async fn a_raw_identifier_argument_is_named_without_its_prefix() {
    let reg = InProcessRegistry::new();
    let server = serve_unnamed(&reg).await;
    let kind = UnnamedClient::methods()
        .iter()
        .find(|m| m.method == "kind")
        .expect("kind");
    let api = kind.api.expect("the published API")();
    assert_eq!(api.params, ["type"]);
    let client = Client::builder().registry(reg).build();
    let wrong = Codec::MsgPack.encode(&("three",)).expect("encode");
    let e = within(
        "wrong type",
        client.invoke(kind, wrong, None::<fn() -> u64>),
    )
    .await
    .expect_err("type is not a u32");
    assert!(
        e.message().contains("argument 1 `type`: expected u32"),
        "{e}"
    );
    within("shutdown", server.shutdown()).await;
}

/// Two services whose trait names differ only in case (`HttpApi`, `HTTPApi`) live in one
/// module: each trait's hidden items are named after it as written.
mod names_that_differ_in_case {
    use super::within;
    use rpc::{Client, InProcessRegistry, RpcError, Server};

    #[rpc::service(name = "t.HttpApi")]
    pub trait HttpApi {
        async fn which(&self) -> Result<String, RpcError>;
    }

    #[rpc::service(name = "t.HTTPApi")]
    pub trait HTTPApi {
        async fn which(&self) -> Result<String, RpcError>;
    }

    struct Both;

    impl HttpApi for Both {
        async fn which(&self) -> Result<String, RpcError> {
            Ok("HttpApi".into())
        }
    }

    impl HTTPApi for Both {
        async fn which(&self) -> Result<String, RpcError> {
            Ok("HTTPApi".into())
        }
    }

    #[tokio::test]
    async fn both_are_served_and_called_each_under_its_own_id() {
        let reg = InProcessRegistry::new();
        let server = Server::builder()
            .registry(reg.clone())
            .add_service(HttpApiServer::new(Both))
            .add_service(HTTPApiServer::new(Both))
            .serve("127.0.0.1:0")
            .await
            .expect("serve");
        let client = Client::builder().registry(reg).build();
        let a = HttpApiClient::new(client.clone());
        let b = HTTPApiClient::new(client);
        assert_eq!(HttpApiClient::SERVICE_ID, "t.HttpApi");
        assert_eq!(HTTPApiClient::SERVICE_ID, "t.HTTPApi");
        assert_eq!(within("HttpApi", a.which()).await.expect("a"), "HttpApi");
        assert_eq!(within("HTTPApi", b.which()).await.expect("b"), "HTTPApi");
        within("shutdown", server.shutdown()).await;
    }
}

/// Supertraits the generated client satisfies (markers it is, traits it derives) are taken;
/// others are refused (see the macro's compile-fail cases).
#[rpc::service(name = "t.Marked")]
#[allow(dead_code)]
trait Marked: Send + Sync + Sized + Unpin + Clone + std::fmt::Debug + 'static {
    async fn mark(&self) -> Result<u8, RpcError>;
}

/// A deprecated service and method: the code `#[rpc::service]` generates uses them without
/// warnings, so a crate denying deprecation (or all warnings) still builds; only the user's
/// own uses warn.
#[deny(deprecated)]
mod deprecated_items {
    use rpc::RpcError;

    #[rpc::service(name = "t.Old")]
    #[deprecated(note = "use t.New")]
    pub trait Old {
        #[deprecated(note = "use double")]
        async fn twice(&self, n: u64) -> Result<u64, RpcError>;
        async fn double(&self, n: u64) -> Result<u64, RpcError>;
    }

    /// A deprecated argument and result type: the service allowing them builds too.
    #[deprecated(note = "use u64")]
    #[derive(serde::Serialize, serde::Deserialize)]
    pub struct OldCount(pub u64);

    #[rpc::service(name = "t.Counts")]
    #[allow(deprecated)]
    pub trait Counts {
        async fn next(&self, n: OldCount) -> Result<OldCount, RpcError>;
    }

    pub struct Doubler;

    #[allow(deprecated)]
    impl Old for Doubler {
        async fn twice(&self, n: u64) -> Result<u64, RpcError> {
            Ok(2 * n)
        }
        async fn double(&self, n: u64) -> Result<u64, RpcError> {
            Ok(2 * n)
        }
    }
}

#[tokio::test]
#[allow(deprecated)]
async fn a_deprecated_service_and_method_are_served_and_called() {
    use deprecated_items::{Doubler, Old, OldClient, OldServer};
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(OldServer::new(Doubler))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let old = OldClient::new(Client::builder().registry(reg).build());
    assert_eq!(within("twice", old.twice(21)).await.expect("twice"), 42);
    assert_eq!(within("double", old.double(4)).await.expect("double"), 8);
    within("shutdown", server.shutdown()).await;
}

/// Arguments that are `Send` but not `Sync` (a `Cell`, a `RefCell`), the hash key among
/// them: the proxy's future is `Send` as the trait promises, since no reference to an
/// argument is held across its awaits.
mod send_but_not_sync_arguments {
    use std::cell::{Cell, RefCell};

    use rpc::RpcError;

    #[rpc::service(name = "t.Cells")]
    pub trait Cells {
        async fn sum(
            &self,
            #[hash_key] k: Cell<u64>,
            r: RefCell<Vec<u64>>,
        ) -> Result<u64, RpcError>;
        /// `n` items from `k` on: a server stream whose hash key is not `Sync`.
        async fn ticks(
            &self,
            #[hash_key] k: Cell<u64>,
            n: u64,
        ) -> Result<rpc::RpcStream<u64>, RpcError>;
    }

    pub struct Summer;

    impl Cells for Summer {
        async fn sum(&self, k: Cell<u64>, r: RefCell<Vec<u64>>) -> Result<u64, RpcError> {
            Ok(k.get() + r.borrow().iter().sum::<u64>())
        }
        async fn ticks(&self, k: Cell<u64>, n: u64) -> Result<rpc::RpcStream<u64>, RpcError> {
            let from = k.get();
            Ok(rpc::RpcStream::iter(from..from + n))
        }
    }
}

#[tokio::test]
async fn arguments_that_are_send_but_not_sync_are_sent() {
    use send_but_not_sync_arguments::{Cells, CellsClient, CellsServer, Summer};
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(CellsServer::new(Summer))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let cells = CellsClient::new(Client::builder().registry(reg).build());
    // Spawned: the future must be `Send`.
    let summing = cells.clone();
    let sum = tokio::spawn(async move {
        summing
            .sum(std::cell::Cell::new(1), std::cell::RefCell::new(vec![2, 3]))
            .await
    });
    assert_eq!(within("sum", sum).await.expect("joined").expect("sum"), 6);
    // A server stream's hash key too (before, the generated client did not compile: the
    // stream's set-up held a reference to the `Cell` across an await).
    let ticks = tokio::spawn(async move {
        cells
            .ticks(std::cell::Cell::new(7), 3)
            .await?
            .collect_all()
            .await
    });
    assert_eq!(
        within("ticks", ticks)
            .await
            .expect("joined")
            .expect("ticks"),
        [7, 8, 9]
    );
    within("shutdown", server.shutdown()).await;
}

/// `&self` spelled `&'_ self` or `self: &Self`: the same shared receiver, served and called.
#[allow(clippy::needless_arbitrary_self_type)]
mod spelled_receivers {
    use rpc::RpcError;

    #[rpc::service(name = "t.Spelled")]
    pub trait Spelled {
        async fn elided(&'_ self, n: u64) -> Result<u64, RpcError>;
        async fn typed(self: &Self, n: u64) -> Result<u64, RpcError>;
    }

    pub struct Add;

    impl Spelled for Add {
        async fn elided(&'_ self, n: u64) -> Result<u64, RpcError> {
            Ok(n + 1)
        }
        async fn typed(self: &Self, n: u64) -> Result<u64, RpcError> {
            Ok(n + 2)
        }
    }
}

#[tokio::test]
async fn receivers_spelled_otherwise_are_served_and_called() {
    use spelled_receivers::{Add, Spelled, SpelledClient, SpelledServer};
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .add_service(SpelledServer::new(Add))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let spelled = SpelledClient::new(Client::builder().registry(reg).build());
    assert_eq!(
        within("elided", spelled.elided(1)).await.expect("elided"),
        2
    );
    assert_eq!(within("typed", spelled.typed(1)).await.expect("typed"), 3);
    within("shutdown", server.shutdown()).await;
}
