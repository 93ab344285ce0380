//! Endpoint addresses as configuration gives them: `host:port`.
//!
//! (std only: `rpc-macros` compiles this file too, for the `#[governance]` attribute's
//! `appoint_address`.)

/// Whether `address` is `host:port`: a port of decimal digits (at most 65535), and a host that
/// is a name or an IPv4 address (letters, digits, `.`, `-`, `_`) or an IPv6 address in
/// brackets (`[::1]:9000`, `[fe80::1%2]:9000` with an interface number). Anything else is
/// refused where it is configured rather than failing every call later: two addresses run together (`a:1;b:2`, `a:1 b:2`), an IPv6
/// address without brackets (`fe80::1` would read as host `fe80:`, port 1), a space, a
/// scheme (`etcd://h:1`).
pub fn is_host_port(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else {
        return false;
    };
    let port_ok =
        !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && port.parse::<u16>().is_ok();
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
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        }
    };
    port_ok && host_ok
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
        ] {
            assert!(!is_host_port(bad), "{bad:?}");
        }
    }
}
