//! Configuration that would silently do something else is refused or merged as documented:
//! runtime updates merge per field and can be cleared, hash routing needs a `#[hash_key]`
//! argument, errors name what they are about, and a handler's panic text stays on the server.

mod common;

use rpc::{Client, GovernanceOverrides, InProcessRegistry, RpcError};

#[rpc::service(name = "m.Conf")]
trait Conf {
    #[governance(timeout_ms = 700, retry_times = 2)]
    async fn get(&self, #[hash_key] key: u64) -> Result<u64, RpcError>;
    async fn plain(&self, n: u32) -> Result<u32, RpcError>;
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
    client.update_options(
        "m.Conf.get",
        GovernanceOverrides {
            timeout_ms: Some(200),
            ..GovernanceOverrides::NONE
        },
    );
    client.update_options(
        "m.Conf.get",
        GovernanceOverrides {
            retry_times: Some(0),
            ..GovernanceOverrides::NONE
        },
    );
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

    client.clear_options("m.Conf.get");
    let o = client.options(get);
    assert_eq!(
        (o.timeout_ms, o.retry_times),
        (attribute_timeout, attribute_retries)
    );
}
