//! Endpoint addresses as configuration gives them: `host:port`, or `unix:/path`.
//!
//! (std only: `rpc-macros` compiles this file too, for the `#[governance]` attribute's
//! `appoint_address`.)

/// Whether `address` is an endpoint a client dials: `host:port` ([`is_host_port`]), or
/// `unix:` and the path of a Unix socket (not empty), as a server on one publishes it.
pub fn is_endpoint_address(address: &str) -> bool {
    match address.strip_prefix("unix:") {
        Some(path) => !path.is_empty(),
        None => is_host_port(address),
    }
}

/// Whether `address` is `host:port`, an address to connect to: a port of decimal digits from
/// 1 to 65535, and a host that is an IPv4 address, a name (dot-separated labels of letters,
/// digits, `-` and `_`, none empty or starting or ending with `-`; one final dot allowed), or
/// an IPv6 address in brackets (`[::1]:9000`, `[fe80::1%2]:9000` with an interface number).
/// Anything else is refused where it is configured rather than failing every call later:
/// two addresses run together (`a:1;b:2`, `a:1 b:2`), an IPv6 address without brackets
/// (`fe80::1` would read as host `fe80:`, port 1), a space, a scheme (`etcd://h:1`), port 0
/// (nothing listens there), a host of digits and dots that is not an IPv4 address (`10.0.1`,
/// which the resolver would read as `10.0.0.1`), and a host of one to four numbers, hexadecimal
/// ones among them (`0x7f.0.0.1`, `0x7f000001`), which the resolver reads as an IPv4 address
/// too.
pub fn is_host_port(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else {
        return false;
    };
    let port_ok = !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p != 0);
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        // A link-local address may name its interface by number (`[fe80::1%2]`), as the
        // socket-address parser takes it.
        Some(v6) => match v6.split_once('%') {
            Some((addr, scope)) => {
                addr.parse::<std::net::Ipv6Addr>().is_ok()
                    && !scope.is_empty()
                    && scope.parse::<u32>().is_ok()
                    && scope.bytes().all(|b| b.is_ascii_digit())
            }
            None => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        },
        None => is_host_name_or_ipv4(host),
    };
    port_ok && host_ok
}

/// A host written without brackets: an IPv4 address, or a name of labels (see
/// [`is_host_port`]).
fn is_host_name_or_ipv4(host: &str) -> bool {
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return host.parse::<std::net::Ipv4Addr>().is_ok();
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    // A name whose every label is a number in hexadecimal (`0x7f.0.0.1`, `0x7f000001`) is an
    // IPv4 address to the resolver (inet_aton), not a name: another spelling of an address,
    // refused as `10.0.1` is.
    let numbers = name.split('.').count() <= 4
        && name.split('.').all(|label| {
            label
                .strip_prefix("0x")
                .or_else(|| label.strip_prefix("0X"))
                .map_or(label.bytes().all(|b| b.is_ascii_digit()), |hex| {
                    !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit())
                })
        });
    if numbers {
        return false;
    }
    !name.is_empty()
        && name.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
        })
}

#[cfg(test)]
mod tests {
    use super::is_host_port;

    #[test]
    fn host_port_takes_names_ipv4_and_bracketed_ipv6_only() {
        for good in [
            "127.0.0.1:9000",
            "localhost:1",
            "etcd-0.etcd_svc.local:2379",
            "[::1]:9000",
            "[fe80::1]:65535",
            "[fe80::1%2]:9000",
            "example.com.:443",
            "1.example:80",
            "0x:80",
            "0x1.0x2.0x3.0x4.0x5:80",
        ] {
            assert!(is_host_port(good), "{good:?}");
        }
        for bad in [
            "",
            "127.0.0.1",
            ":9000",
            "127.0.0.1:",
            "127.0.0.1:65536",
            "127.0.0.1:+80",
            "127.0.0.1:9001;127.0.0.1:9002",
            "127.0.0.1:9001 127.0.0.1:9002",
            " host:1",
            "host :1",
            "fe80::1",
            "[fe80::zz]:1",
            "[fe80::1%]:1",
            "[fe80::1%eth0]:1",
            "etcd://h:2379",
            "127.0.0.1:0",
            "[::1]:0",
            "10.0.1:9000",
            "0x7f.0.0.1:9000",
            "0x7f000001:9000",
            "0X0a.0.0.1:80",
            "256.0.0.1:80",
            "-:80",
            "a..b:1",
            ".a:1",
            "host-.local:1",
        ] {
            assert!(!is_host_port(bad), "{bad:?}");
        }
    }
}
