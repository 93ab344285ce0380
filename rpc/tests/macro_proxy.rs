//! The generated client proxy against the generated server dispatcher, over real TCP on
//! 127.0.0.1 (port 0), through the in-process registry.

use rpc::{Client, Codec, InProcessRegistry, RpcError, Server, StatusCode};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Profile {
    id: u64,
    bio: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum MyError {
    NoSuchUser(u64),
    Rpc(u32, String),
}

impl From<RpcError> for MyError {
    fn from(e: RpcError) -> Self {
        MyError::Rpc(e.code().as_u32(), e.message().to_string())
    }
}

#[rpc::service(name = "proxy.Shapes")]
trait Shapes {
    async fn ping(&self) -> Result<(), RpcError>;
    #[governance(idempotent)]
    async fn echo(&self, text: String) -> Result<String, RpcError>;
    async fn sum(&self, a: i64, b: Vec<i64>, c: Option<String>) -> Result<String, RpcError>;
    #[governance(shunt_strategy = "hash")]
    async fn profile(&self, verbose: bool, #[hash_key] user_id: u64) -> Result<Profile, MyError>;
    async fn refuse(&self) -> Result<u8, RpcError>;
}

struct Impl;

impl Shapes for Impl {
    async fn ping(&self) -> Result<(), RpcError> {
        Ok(())
    }

    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(format!("echo: {text}"))
    }

    async fn sum(&self, a: i64, b: Vec<i64>, c: Option<String>) -> Result<String, RpcError> {
        Ok(format!(
            "{} {}",
            a + b.iter().sum::<i64>(),
            c.unwrap_or_default()
        ))
    }

    async fn profile(&self, verbose: bool, user_id: u64) -> Result<Profile, MyError> {
        if user_id == 0 {
            return Err(MyError::NoSuchUser(0));
        }
        Ok(Profile {
            id: user_id,
            bio: verbose.then(|| "hi".to_string()),
        })
    }

    async fn refuse(&self) -> Result<u8, RpcError> {
        Err(RpcError::validation("not today"))
    }
}

#[tokio::test]
async fn proxy_calls_the_server_in_both_codecs() {
    let registry = InProcessRegistry::new();
    let server = Server::builder()
        .registry(registry.clone())
        .add_service(ShapesServer::new(Impl))
        .serve("127.0.0.1:0")
        .await
        .unwrap();
    for codec in [Codec::MsgPack, Codec::Json] {
        let client = Client::builder()
            .registry(registry.clone())
            .codec(codec)
            .build();
        let shapes = ShapesClient::new(client);
        assert_eq!(shapes.client().codec(), codec);
        shapes.ping().await.unwrap();
        assert_eq!(shapes.echo("a".into()).await.unwrap(), "echo: a");
        assert_eq!(
            shapes.sum(1, vec![2, 3], Some("x".into())).await.unwrap(),
            "6 x"
        );
        assert_eq!(
            shapes.profile(true, 9).await.unwrap(),
            Profile {
                id: 9,
                bio: Some("hi".into())
            }
        );
        // The service's own error value comes back typed.
        assert_eq!(
            shapes.profile(false, 0).await.unwrap_err(),
            MyError::NoSuchUser(0)
        );
        let err = shapes.refuse().await.unwrap_err();
        assert_eq!(err.code(), StatusCode::ValidateError);
        assert!(err.message().contains("not today"), "{err}");
    }
    server.shutdown().await;
}

#[tokio::test]
async fn call_failures_reach_a_typed_error_through_from() {
    // No server at all: the failure becomes the user's `Rpc` variant, not a decoding error.
    let client = Client::builder().registry(InProcessRegistry::new()).build();
    let shapes = ShapesClient::new(client);
    match shapes.profile(true, 1).await {
        Err(MyError::Rpc(code, message)) => {
            assert_eq!(code, StatusCode::NotFindServiceRoute.as_u32(), "{message}");
            assert!(message.contains("proxy.Shapes"), "{message}");
        }
        other => panic!("expected a call failure, got {other:?}"),
    }
}
