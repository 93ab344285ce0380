//! What `#[rpc::service]` generates, exercised without a network: the server dispatcher is
//! called directly through `rpc::Service::call` with encoded arguments, and the descriptor table
//! is checked field by field.
#![warn(missing_docs)]

use rpc::{Codec, GovernanceOverrides, RemoteError, RpcError, Service, ShuntStrategy, StatusCode};
use serde::{Deserialize, Serialize};

/// A profile, as a user-defined result type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// The user.
    pub id: u64,
    /// Their name.
    pub name: String,
    /// Only filled when asked for.
    pub bio: Option<String>,
}

/// A service's own error type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MyError {
    /// The business answer.
    NoSuchUser(u64),
    /// The call itself failed.
    Rpc(u32, String),
}

impl From<RpcError> for MyError {
    fn from(e: RpcError) -> Self {
        MyError::Rpc(e.code().as_u32(), e.message().to_string())
    }
}

/// Methods of every arity and both kinds of error.
#[rpc::service(name = "test.Shapes")]
pub trait Shapes {
    /// No arguments.
    async fn ping(&self) -> Result<(), RpcError>;
    /// One argument.
    #[governance(timeout_ms = 800, retry_times = 2, idempotent)]
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    /// Three arguments.
    #[governance(shunt_strategy = "appoint", appoint_address = "127.0.0.1:9000")]
    async fn sum(&self, a: i64, b: i64, c: i64) -> Result<i64, RpcError>;
    /// A hash key and a typed error.
    #[governance(
        shunt_strategy = "hash",
        enable_circuit_breaker = false,
        idempotent = false
    )]
    async fn profile(&self, verbose: bool, #[hash_key] user_id: u64) -> Result<Profile, MyError>;
    /// A failure as `RpcError`.
    async fn fail(&self, code: u32) -> Result<u8, RpcError>;
}

/// The implementation under test.
pub struct Impl;

impl Shapes for Impl {
    async fn ping(&self) -> Result<(), RpcError> {
        Ok(())
    }

    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(format!("echo: {text}"))
    }

    async fn sum(&self, a: i64, b: i64, c: i64) -> Result<i64, RpcError> {
        Ok(a * 100 + b * 10 + c)
    }

    async fn profile(&self, verbose: bool, user_id: u64) -> Result<Profile, MyError> {
        if user_id == 0 {
            return Err(MyError::NoSuchUser(user_id));
        }
        Ok(Profile {
            id: user_id,
            name: format!("user{user_id}"),
            bio: verbose.then(|| "likes rust".to_string()),
        })
    }

    async fn fail(&self, code: u32) -> Result<u8, RpcError> {
        Err(RpcError::new(
            StatusCode::UnAuthentication,
            format!("no {code}"),
        ))
    }
}

/// A service whose id comes from the module path.
mod nested {
    use rpc::RpcError;

    /// Default service id.
    #[rpc::service]
    pub trait Defaults {
        /// One method.
        async fn get(&self) -> Result<u32, RpcError>;
    }
}

fn server() -> ShapesServer<Impl> {
    ShapesServer::new(Impl)
}

async fn call<T: serde::de::DeserializeOwned>(
    svc: &dyn Service,
    method: &str,
    params: impl Serialize,
    codec: Codec,
) -> Result<T, RpcError> {
    let index = svc
        .methods()
        .iter()
        .position(|m| m.method == method)
        .unwrap_or_else(|| panic!("no method {method}"));
    let bytes = svc
        .call(index, codec.encode(&params).unwrap(), codec)
        .await?;
    Ok(codec.decode(&bytes).unwrap())
}

#[tokio::test]
async fn every_arity_round_trips_in_both_codecs() {
    let svc = server();
    for codec in [Codec::MsgPack, Codec::Json] {
        let () = call(&svc, "ping", rpc::__private::NoArgs, codec)
            .await
            .unwrap();
        let s: String = call(&svc, "echo", ("hi",), codec).await.unwrap();
        assert_eq!(s, "echo: hi");
        let n: i64 = call(&svc, "sum", (1, 2, 3), codec).await.unwrap();
        assert_eq!(n, 123);
        let p: Profile = call(&svc, "profile", (true, 7u64), codec).await.unwrap();
        assert_eq!(p.id, 7);
        assert_eq!(p.bio.as_deref(), Some("likes rust"));
    }
}

#[tokio::test]
async fn typed_business_error_crosses_as_1000() {
    let svc = server();
    for codec in [Codec::MsgPack, Codec::Json] {
        let err = call::<Profile>(&svc, "profile", (false, 0u64), codec)
            .await
            .unwrap_err();
        assert_eq!(err.code(), StatusCode::BusinessError);
        assert_eq!(err.code().as_u32(), 1000);
        assert!(err.payload().is_some(), "{err:?}");
        assert_eq!(MyError::from_rpc_error(err), MyError::NoSuchUser(0));
    }
}

#[tokio::test]
async fn rpc_error_is_passed_through() {
    let err = call::<u8>(&server(), "fail", (5u32,), Codec::MsgPack)
        .await
        .unwrap_err();
    assert_eq!(err.code(), StatusCode::UnAuthentication);
    assert_eq!(err.message(), "no 5");
}

#[tokio::test]
async fn unknown_method_index_is_not_found() {
    let svc = server();
    let n = svc.methods().len();
    let err = svc
        .call(n, Codec::MsgPack.encode(&()).unwrap(), Codec::MsgPack)
        .await
        .unwrap_err();
    assert_eq!(err.code(), StatusCode::NotFindLocalServiceEntry);
    assert!(err.message().contains("test.Shapes"), "{err}");
}

#[tokio::test]
async fn bad_arguments_are_a_validation_error() {
    let svc = server();
    let index = |name: &str| svc.methods().iter().position(|m| m.method == name).unwrap();
    let (echo, sum) = (index("echo"), index("sum"));
    let cases: Vec<(usize, bytes::Bytes, Codec)> = vec![
        // Not MessagePack at all.
        (
            echo,
            bytes::Bytes::from_static(&[0xc1, 0xff]),
            Codec::MsgPack,
        ),
        // Wrong type.
        (
            echo,
            Codec::MsgPack.encode(&(5u8,)).unwrap(),
            Codec::MsgPack,
        ),
        // Too few arguments.
        (
            sum,
            Codec::MsgPack.encode(&(1i64, 2i64)).unwrap(),
            Codec::MsgPack,
        ),
        // Not an array.
        (sum, Codec::Json.encode(&"x").unwrap(), Codec::Json),
        (echo, bytes::Bytes::new(), Codec::Json),
    ];
    for (index, params, codec) in cases {
        let err = svc.call(index, params.clone(), codec).await.unwrap_err();
        assert_eq!(err.code(), StatusCode::ValidateError, "{params:?}: {err}");
        let entry = svc.methods()[index].entry_id;
        assert!(err.message().contains(entry), "{err}");
    }
}

#[test]
fn descriptors_follow_the_declaration() {
    let methods = ShapesServer::<Impl>::methods();
    assert_eq!(ShapesClient::methods().as_ptr(), methods.as_ptr());
    let svc = server();
    assert_eq!(svc.service_id(), "test.Shapes");
    assert_eq!(ShapesClient::SERVICE_ID, "test.Shapes");
    assert_eq!(ShapesServer::<Impl>::SERVICE_ID, "test.Shapes");
    let names: Vec<_> = methods.iter().map(|m| m.method).collect();
    assert_eq!(names, ["ping", "echo", "sum", "profile", "fail"]);
    for m in methods {
        assert_eq!(m.service_id, "test.Shapes");
        assert_eq!(m.entry_id, format!("test.Shapes.{}", m.method));
    }
    let by = |name: &str| methods.iter().find(|m| m.method == name).unwrap();
    assert_eq!(by("profile").hash_key, Some(1));
    assert_eq!(by("echo").hash_key, None);
    assert_eq!(by("ping").governance, GovernanceOverrides::NONE);
    assert_eq!(
        by("echo").governance,
        GovernanceOverrides {
            timeout_ms: Some(800),
            retry_times: Some(2),
            idempotent: Some(true),
            ..GovernanceOverrides::NONE
        }
    );
    assert_eq!(
        by("sum").governance,
        GovernanceOverrides {
            shunt_strategy: Some(ShuntStrategy::Appoint),
            appoint_address: Some("127.0.0.1:9000".into()),
            ..GovernanceOverrides::NONE
        }
    );
    assert_eq!(
        by("profile").governance,
        GovernanceOverrides {
            shunt_strategy: Some(ShuntStrategy::Hash),
            enable_circuit_breaker: Some(false),
            idempotent: Some(false),
            ..GovernanceOverrides::NONE
        }
    );
}

#[test]
fn default_service_id_is_module_path_and_trait() {
    let id = nested::DefaultsClient::SERVICE_ID;
    assert_eq!(id, concat!(module_path!(), "::nested.Defaults"));
    assert_eq!(
        nested::DefaultsClient::methods()[0].entry_id,
        format!("{id}.get")
    );
}

#[test]
fn generated_types_are_send_sync_clone_debug() {
    fn check<T: Send + Sync + Clone + std::fmt::Debug + 'static>() {}
    check::<ShapesServer<Impl>>();
    check::<ShapesClient>();
    let s = format!("{:?}", server());
    assert!(s.contains("test.Shapes"), "{s}");
}

#[tokio::test]
async fn server_shares_an_arc() {
    let inner = std::sync::Arc::new(Impl);
    let svc = ShapesServer::from_arc(inner.clone());
    assert!(std::sync::Arc::ptr_eq(svc.inner(), &inner));
    let s: String = call(&svc.clone(), "echo", ("x",), Codec::Json)
        .await
        .unwrap();
    assert_eq!(s, "echo: x");
}
