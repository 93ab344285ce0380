//! One string names a registry: what a program's `--registry` flag or a config value holds, so a
//! service's `main` does not match on backends itself.
//!
//! The forms: `embedded` (an in-process registry), `static:FILE` (a TOML list of endpoints),
//! `host:port,...` (a static list given inline), `etcd://host:port[,host:port...]` (an etcd
//! cluster; feature `etcd`) and `zk://host:port[,host:port...][/prefix]` (a ZooKeeper ensemble;
//! feature `zookeeper`). Anything else is a [`RegistryError::Config`] naming the forms.
//! Schemes are compared without regard to case, as RFC 3986 has it: `ETCD://` is `etcd://`.

use std::sync::Arc;
use std::time::Duration;

use crate::{InProcessRegistry, Registry, RegistryError, StaticRegistry};

const FORMS: &str = "expected embedded, static:FILE, host:port[,host:port...], \
                     etcd://host:port[,host:port...] or zk://host:port[,host:port...][/prefix]";

impl dyn Registry {
    /// The registry `url` names, with the default settings of its backend:
    ///
    /// | `url` | registry |
    /// |---|---|
    /// | `embedded` | a new [`InProcessRegistry`]: servers and clients of this process only |
    /// | `static:FILE` | [`StaticRegistry::from_file`] (the TOML form) |
    /// | `host:port,host:port` | [`StaticRegistry::from_list`] |
    /// | `etcd://host:port[,host:port...]` | `EtcdRegistry::from_url` (feature `etcd`) |
    /// | `zk://host:port[,host:port...][/prefix]` | `ZooKeeperRegistry::from_url` (feature `zookeeper`) |
    ///
    /// An unknown scheme, an address that is not `host:port`, an unreadable file, or an
    /// `etcd://` or `zk://` URL in a build without its feature is a [`RegistryError::Config`]
    /// saying what to write instead. Connecting to etcd or ZooKeeper contacts nothing yet (see
    /// `EtcdRegistry`, `ZooKeeperRegistry`), so this does not fail because either is down.
    ///
    /// ```
    /// use rpc_registry::Registry;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), rpc_registry::RegistryError> {
    /// let registry = <dyn Registry>::from_url("127.0.0.1:9001,127.0.0.1:9002").await?;
    /// let watch = registry.watch(&"echo.Echo".into()).await?;
    /// assert_eq!(watch.current().len(), 2);
    ///
    /// let err = <dyn Registry>::from_url("consul://127.0.0.1:8500").await.err().unwrap();
    /// assert!(err.to_string().contains("unknown registry scheme \"consul\""), "{err}");
    /// # Ok(()) }
    /// ```
    pub async fn from_url(url: &str) -> Result<Arc<dyn Registry>, RegistryError> {
        Self::from_url_with_lease(url, None).await
    }

    /// Like [`from_url`](trait.Registry.html#method.from_url), with the lease of the instances this
    /// process registers: a killed server disappears after this long (etcd: the lease's TTL;
    /// ZooKeeper: the session timeout; 10 s by default for both). The embedded backends have no
    /// lease and ignore it.
    pub async fn from_url_with_lease(
        url: &str,
        lease_ttl: Option<Duration>,
    ) -> Result<Arc<dyn Registry>, RegistryError> {
        let url = url.trim();
        if url.eq_ignore_ascii_case("embedded") {
            return Ok(Arc::new(InProcessRegistry::new()));
        }
        if let Some(file) = strip_prefix_ignoring_case(url, "static:") {
            if file.is_empty() {
                return Err(RegistryError::Config(format!(
                    "registry {url:?} names no file: write static:PATH (a TOML list of endpoints)"
                )));
            }
            // Read off the runtime's threads: a file on a slow or hung network file system
            // would otherwise stall every task of the worker (all of them on a
            // current-thread runtime).
            let path = file.to_string();
            let read = tokio::task::spawn_blocking(move || StaticRegistry::from_file(path))
                .await
                .map_err(|e| RegistryError::Config(format!("reading {file}: {e}")))?;
            return Ok(Arc::new(read?));
        }
        if let Some((scheme, _)) = url.split_once("://") {
            return match scheme.to_ascii_lowercase().as_str() {
                "etcd" => etcd(url, lease_ttl).await,
                "zk" => zookeeper(url, lease_ttl),
                _ => Err(RegistryError::Config(format!(
                    "unknown registry scheme {scheme:?} in {url:?}: {FORMS}"
                ))),
            };
        }
        StaticRegistry::from_list(url)
            .map(|r| Arc::new(r) as Arc<dyn Registry>)
            .map_err(|e| {
                let e = match e {
                    // A list that is no list is the URL's fault whatever the list said.
                    RegistryError::Unavailable(m) => RegistryError::Config(m),
                    e => e,
                };
                e.map_message(|m| format!("registry {url:?}: {m}; {FORMS}"))
            })
    }
}

/// `url` past `prefix` (a scheme and what follows it, `etcd://`), the prefix compared without
/// regard to ASCII case; `None` when `url` does not start with it.
pub(crate) fn strip_prefix_ignoring_case<'a>(url: &'a str, prefix: &str) -> Option<&'a str> {
    let head = url.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &url[prefix.len()..])
}

#[cfg(feature = "etcd")]
async fn etcd(url: &str, lease_ttl: Option<Duration>) -> Result<Arc<dyn Registry>, RegistryError> {
    let mut options = crate::EtcdOptions::default();
    if let Some(ttl) = lease_ttl {
        options.lease_ttl = ttl;
    }
    let registry = crate::EtcdRegistry::from_url_with_options(url, options).await?;
    Ok(Arc::new(registry))
}

#[cfg(not(feature = "etcd"))]
async fn etcd(url: &str, _: Option<Duration>) -> Result<Arc<dyn Registry>, RegistryError> {
    Err(RegistryError::Config(format!(
        "{url}: this build has no etcd support; enable the `etcd` feature of rpc (or \
         rpc-registry), which needs protoc to build"
    )))
}

#[cfg(feature = "zookeeper")]
fn zookeeper(url: &str, lease_ttl: Option<Duration>) -> Result<Arc<dyn Registry>, RegistryError> {
    let mut options = crate::ZooKeeperOptions::default();
    if let Some(ttl) = lease_ttl {
        options.session_timeout = ttl;
    }
    let registry = crate::ZooKeeperRegistry::from_url_with_options(url, options)?;
    Ok(Arc::new(registry))
}

#[cfg(not(feature = "zookeeper"))]
fn zookeeper(url: &str, _: Option<Duration>) -> Result<Arc<dyn Registry>, RegistryError> {
    Err(RegistryError::Config(format!(
        "{url}: this build has no ZooKeeper support; enable the `zookeeper` feature of rpc (or \
         rpc-registry)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn addresses(url: &str) -> Vec<String> {
        let registry = <dyn Registry>::from_url(url).await.unwrap();
        let watch = registry.watch(&"a.A".into()).await.unwrap();
        let list = watch.current();
        list.iter().map(|i| i.address.clone()).collect()
    }

    #[tokio::test]
    async fn every_form_names_its_backend() {
        // A list: the addresses given, sorted as every snapshot is.
        assert_eq!(
            addresses(" 127.0.0.1:2,127.0.0.1:1 ").await,
            ["127.0.0.1:1", "127.0.0.1:2"]
        );
        // A file.
        let path = std::env::temp_dir().join(format!("rpc-url-test-{}.toml", std::process::id()));
        std::fs::write(&path, "[[endpoint]]\naddress = \"10.0.0.1:7\"\n").unwrap();
        let url = format!("static:{}", path.display());
        assert_eq!(addresses(&url).await, ["10.0.0.1:7"]);
        std::fs::remove_file(&path).unwrap();
        // Embedded: an in-process registry, which takes registrations and announces them.
        let registry = <dyn Registry>::from_url("embedded").await.unwrap();
        registry
            .register(crate::Instance::new("127.0.0.1:5", ["a.A"]))
            .await
            .unwrap();
        let watch = registry.watch(&"a.A".into()).await.unwrap();
        assert_eq!(watch.current()[0].address, "127.0.0.1:5");
    }

    #[tokio::test]
    async fn bad_urls_are_config_errors_naming_the_forms() {
        for (url, says) in [
            ("consul://h:1", "unknown registry scheme \"consul\""),
            ("localhost", "expected embedded, static:FILE"),
            ("static:", "names no file"),
            (
                "static:/nonexistent/rpc.toml",
                "cannot read static registry file",
            ),
            #[cfg(feature = "etcd")]
            ("etcd://", "bad etcd URL \"etcd://\": no endpoint"),
            #[cfg(not(feature = "etcd"))]
            ("etcd://", "enable the `etcd` feature"),
        ] {
            // Said once: the kind of error is not repeated in its message.
            let configuration = "registry configuration";
            match <dyn Registry>::from_url(url).await {
                Err(e @ RegistryError::Config(_)) => {
                    let m = e.to_string();
                    assert!(m.contains(says), "{url}: {m}");
                    assert_eq!(m.matches(configuration).count(), 1, "{url}: {m}");
                }
                Err(e) => panic!("{url}: not a config error: {e}"),
                Ok(_) => panic!("{url} was accepted"),
            }
        }
    }

    #[tokio::test]
    async fn forms_and_schemes_are_read_in_any_case() {
        let path = std::env::temp_dir().join(format!("rpc-url-case-{}.toml", std::process::id()));
        std::fs::write(&path, "[[endpoint]]\naddress = \"10.0.0.2:7\"\n").unwrap();
        let url = format!("Static:{}", path.display());
        assert_eq!(addresses(&url).await, ["10.0.0.2:7"]);
        std::fs::remove_file(&path).unwrap();
        let registry = <dyn Registry>::from_url("EMBEDDED").await.unwrap();
        registry
            .register(crate::Instance::new("127.0.0.1:5", ["a.A"]))
            .await
            .unwrap();
        // Constructing contacts nothing; a build without the backend's feature refuses the URL
        // for that reason only, not as an unknown scheme or a bad URL.
        for url in ["ETCD://127.0.0.1:1", "Zk://127.0.0.1:1"] {
            match <dyn Registry>::from_url_with_lease(url, Some(Duration::from_secs(3))).await {
                Ok(_) => {}
                Err(RegistryError::Config(m)) => assert!(m.contains("enable the"), "{url}: {m}"),
                Err(e) => panic!("{url}: {e}"),
            }
        }
        #[cfg(feature = "etcd")]
        {
            assert!(crate::EtcdRegistry::is_etcd_url(" Etcd://h:1"));
            assert!(!crate::EtcdRegistry::is_etcd_url("zk://h:1"));
        }
    }

    #[cfg(not(feature = "etcd"))]
    #[tokio::test]
    async fn an_etcd_url_without_the_feature_says_how_to_get_it() {
        let Err(RegistryError::Config(m)) = <dyn Registry>::from_url("etcd://127.0.0.1:2379").await
        else {
            panic!("an etcd URL was accepted without the etcd feature");
        };
        assert!(m.contains("enable the `etcd` feature"), "{m}");
    }

    #[cfg(not(feature = "zookeeper"))]
    #[tokio::test]
    async fn a_zk_url_without_the_feature_says_how_to_get_it() {
        let Err(RegistryError::Config(m)) = <dyn Registry>::from_url("zk://127.0.0.1:2181").await
        else {
            panic!("a zk URL was accepted without the zookeeper feature");
        };
        assert!(m.contains("enable the `zookeeper` feature"), "{m}");
    }

    #[cfg(feature = "zookeeper")]
    #[tokio::test]
    async fn a_zk_url_makes_a_zookeeper_registry() {
        names_its_backend("zk", "ZooKeeper").await;
        let err = <dyn Registry>::from_url("zk://127.0.0.1")
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("zk://host:port"), "{err}");
    }

    #[cfg(feature = "etcd")]
    #[tokio::test]
    async fn an_etcd_url_makes_an_etcd_registry() {
        names_its_backend("etcd", "etcd").await;
    }

    /// A `scheme://` URL of a loopback port nothing listens on (bound, then let go) makes a
    /// registry (constructing contacts nothing, so no server is needed), and what it says of
    /// that port names `backend`.
    #[cfg(any(feature = "etcd", feature = "zookeeper"))]
    async fn names_its_backend(scheme: &str, backend: &str) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let registry = <dyn Registry>::from_url_with_lease(
            &format!("{scheme}://127.0.0.1:{port}"),
            Some(Duration::from_secs(3)),
        )
        .await
        .unwrap();
        let e = registry.services().await.unwrap_err().to_string();
        assert!(
            e.contains(&format!("{backend} at 127.0.0.1:{port} unreachable")),
            "{e}"
        );
    }
}
