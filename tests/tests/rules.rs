//! Rules from etcd: the rule store (validation before writing, versions, history, rollback,
//! two writers at once) and clients and servers that follow it, against a real etcd started on
//! free loopback ports (`common/etcd.rs`).

mod common;
#[path = "common/etcd.rs"]
mod etcd_harness;

use std::time::Duration;

use common::within;
use etcd_harness::Etcd;
use rpc::{EtcdOptions, EtcdRegistry, RuleError, RuleKind, RuleStore};

async fn store(etcd: &Etcd) -> RuleStore {
    let options = EtcdOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..EtcdOptions::default()
    };
    EtcdRegistry::connect(&[etcd.endpoint()], options)
        .await
        .expect("etcd registry")
        .rules()
}

const V1: &str = "[defaults]\ntimeout_ms = 1000\n";
const V2: &str = "[defaults]\ntimeout_ms = 2000\n";

#[tokio::test]
async fn writes_are_validated_versioned_kept_in_history_and_rolled_back() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await;
    assert_eq!(rules.key(RuleKind::Governance), "/rpc/rules/governance");
    // Invalid: refused naming the line and the field, and nothing is written.
    let e = rules
        .set(RuleKind::Governance, "[defaults]\ntimeout_ms = 1\nretry_tims = 2\n", 0)
        .await
        .unwrap_err();
    assert!(matches!(e, RuleError::Invalid { .. }), "{e}");
    assert!(
        e.to_string().contains("line 3") && e.to_string().contains("retry_tims"),
        "{e}"
    );
    let mut raw = etcd.client().await;
    let all = raw
        .get("/rpc/rules/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert!(all.kvs().is_empty(), "nothing written");
    assert_eq!(rules.get(RuleKind::Governance).await.unwrap(), None);

    let v1 = rules.set(RuleKind::Governance, V1, 0).await.unwrap();
    let v2 = rules.set(RuleKind::Governance, V2, v1).await.unwrap();
    assert!(v2 > v1, "{v1} then {v2}");
    let now = rules.get(RuleKind::Governance).await.unwrap().unwrap();
    assert_eq!((now.version, &*now.text), (v2, V2));
    // The version is the etcd revision of the key.
    let kv = raw.get("/rpc/rules/governance", None).await.unwrap();
    assert_eq!(kv.kvs()[0].mod_revision(), v2);

    let history = rules.history(RuleKind::Governance).await.unwrap();
    let seen: Vec<(i64, &str)> = history.iter().map(|v| (v.version, &*v.text)).collect();
    assert_eq!(seen, vec![(v1, V1), (v2, V2)]);

    // Rollback writes v1's text again, as a new version.
    let v3 = rules.rollback(RuleKind::Governance, v1).await.unwrap();
    assert!(v3 > v2);
    let now = rules.get(RuleKind::Governance).await.unwrap().unwrap();
    assert_eq!((now.version, &*now.text), (v3, V1));
    assert_eq!(rules.history(RuleKind::Governance).await.unwrap().len(), 3);
    let e = rules.rollback(RuleKind::Governance, 1).await.unwrap_err();
    assert!(matches!(e, RuleError::UnknownVersion { .. }), "{e}");
    // The kinds are apart.
    assert_eq!(rules.get(RuleKind::Routing).await.unwrap(), None);
}

#[tokio::test]
async fn of_two_writers_on_the_same_version_one_wins_and_the_other_is_told() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await;
    let v1 = rules.set(RuleKind::Governance, V1, 0).await.unwrap();
    let (a, b) = tokio::join!(
        rules.set(RuleKind::Governance, V2, v1),
        rules.set(RuleKind::Governance, "[defaults]\nretry_times = 0\n", v1),
    );
    let (won, lost) = match (a, b) {
        (Ok(v), Err(e)) | (Err(e), Ok(v)) => (v, e),
        other => panic!("exactly one write must win: {other:?}"),
    };
    match lost {
        RuleError::Conflict {
            expected, found, ..
        } => assert_eq!((expected, found), (v1, won)),
        e => panic!("{e}"),
    }
    assert_eq!(rules.history(RuleKind::Governance).await.unwrap().len(), 2);
}

#[tokio::test]
async fn the_history_keeps_the_last_versions_only() {
    let etcd = Etcd::start().await;
    let rules = store(&etcd).await.with_history_limit(3);
    let mut versions = Vec::new();
    for i in 0..5 {
        let text = format!("[defaults]\ntimeout_ms = {}\n", 100 + i);
        versions.push(within("put", rules.put(RuleKind::Governance, &text)).await.unwrap());
    }
    let kept: Vec<i64> = rules
        .history(RuleKind::Governance)
        .await
        .unwrap()
        .iter()
        .map(|v| v.version)
        .collect();
    assert_eq!(kept, versions[2..].to_vec());
}
