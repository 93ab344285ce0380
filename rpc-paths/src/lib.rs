//! What the HTTP gateway (`rpc-gateway`) and the `#[http]` attribute (`rpc-macros`) must agree
//! on about the paths of declared routes: the gateway serves at run time what the attribute
//! checks at compile time, so a route the attribute accepts is one the gateway serves as
//! declared.
//!
//! Why a crate of its own: a procedural macro cannot share code with the crates it serves
//! through them (`rpc-macros` is built for the compiler, before them), and copies of these
//! rules drift apart. This crate has no dependencies, so it costs the macro's build nothing.
//!
//! It must not grow into more than these rules: it knows nothing of HTTP types, entries or
//! matching.
//!
//! ```
//! // A declared route may not sit where default routes (`/api/{service}/{method}`) do.
//! assert!(rpc_paths::overlaps_default_routes("/api/{service}/{method}"));
//! assert!(!rpc_paths::overlaps_default_routes("/orders/{id}"));
//! assert!(rpc_paths::is_default_route_path("/api/shop.Orders/cancel"));
//! ```

#![warn(missing_docs)]

/// Paths the gateway serves itself; a declared route cannot take them.
pub const RESERVED_PATHS: [&str; 3] = ["/openapi.json", "/docs", "/healthz"];

/// The gateway's own path that a route at `template` (written as the gateway matches it:
/// escapes of text decoded) can match, if any: `/docs` itself, or a template of one segment
/// holding a parameter whose text around it fits (`/{slug}`, `/do{x}`, `/{name}.json`), or a
/// catch-all after text that begins one (`/{*rest}`). The gateway's own routes are matched
/// first, so such a route is never reached at that path while documented for it (`GET /docs`
/// answering the documentation page to a caller of `/{slug}`): the gateway serves its entry at
/// its default route instead, and `#[http]` refuses it.
///
/// ```
/// assert_eq!(rpc_paths::reserved_match("/{slug}"), Some("/openapi.json"));
/// assert_eq!(rpc_paths::reserved_match("/healthz"), Some("/healthz"));
/// assert_eq!(rpc_paths::reserved_match("/pages/{slug}"), None);
/// assert_eq!(rpc_paths::reserved_match("/v{n}"), None);
/// ```
pub fn reserved_match(template: &str) -> Option<&'static str> {
    RESERVED_PATHS
        .into_iter()
        .find(|reserved| can_match(template, reserved))
}

/// Whether `template` can match `path`, a path of one segment. (A parameter is taken to match
/// any text of its segment, the empty one included: what is refused is what might match.)
fn can_match(template: &str, path: &str) -> bool {
    let (Some(t), Some(p)) = (template.strip_prefix('/'), path.strip_prefix('/')) else {
        return false;
    };
    // A catch-all takes the rest of the path, slashes included.
    if let Some(at) = t.find("{*") {
        return p.starts_with(&t[..at]);
    }
    if t.contains('/') {
        return false;
    }
    match (t.find('{'), t.rfind('}')) {
        (Some(open), Some(close)) if open < close => {
            let (before, after) = (&t[..open], &t[close + 1..]);
            p.len() >= before.len() + after.len() && p.starts_with(before) && p.ends_with(after)
        }
        _ => t == p,
    }
}

/// The most parameters one route template may hold: a template with more is not served as
/// declared (its entry is served at its default route), since the gateway's matcher takes at
/// most 25; `#[http]` refuses more at compile time.
pub const MAX_PATH_PARAMS: usize = 16;

/// Whether a POST route at `template` (written as the gateway matches it: escapes of text
/// decoded) holds a parameter where the gateway's default routes, `POST /api/<service
/// id>/<method>`, hold the service id: `/api/{kind}/{id}`, `/{a}/{b}/{c}`, `/api/{*rest}`,
/// `/api{v}/{a}/{b}` (a parameter within a segment may be empty), or a catch-all after text
/// that can begin a default route's path (`/ap{*rest}`, `/api/shop.{*rest}`: it takes the
/// slashes after it too). Served, such a route would
/// answer the default routes of entries not served at the moment (their service restarting, a
/// method misspelled), and which entry a path reaches would change with the services running:
/// the gateway serves its entry at its default route instead, and `#[http]` refuses it. A
/// route naming the service's segment (`/api/orders/{id}`), or that no default route's path
/// can reach (`/v{n}/{a}/{b}`, a trailing `/`), is not.
pub fn overlaps_default_routes(template: &str) -> bool {
    let segments: Vec<&str> = template.trim_start_matches('/').split('/').collect();
    let param = |s: &str| s.contains('{');
    // A catch-all (the last segment) takes the rest of the path, slashes included, after
    // whatever text comes before it in its segment.
    let catch_all = |s: &str| s.contains("{*");
    // A first segment that can be `api`: itself, or a parameter after at most `api`.
    let api = |s: &str| {
        s == "api"
            || s.find('{')
                .is_some_and(|at| at <= 3 && "api".starts_with(&s[..at]))
    };
    match segments.as_slice() {
        [first, ..] if catch_all(first) => api(first),
        [first, service, rest @ ..] if api(first) => {
            catch_all(service)
                || (param(service)
                    && match rest {
                        [method] => !method.is_empty(),
                        [method, ..] => catch_all(method),
                        [] => false,
                    })
        }
        _ => false,
    }
}

/// Whether `path` (written as the gateway matches it: escapes of text decoded) is the path of
/// a default route, `/api/<service id>/<method>`, written out with no parameter. A POST route
/// declared there would answer that entry's calls whenever its service has no instance (a
/// restart, a deploy), and which entry ran would change with the services running: the gateway
/// serves an entry declaring such a route at its own default route only, and `#[http]`
/// refuses it.
pub fn is_default_route_path(path: &str) -> bool {
    if path.contains('{') {
        return false;
    }
    let mut segments = match path.strip_prefix("/api/") {
        Some(rest) => rest.split('/'),
        None => return false,
    };
    matches!(
        (segments.next(), segments.next(), segments.next()),
        (Some(service), Some(method), None) if !service.is_empty() && !method.is_empty()
    )
}

/// A template with its parameters' names left out (`/orders/{}`, `/files/{}` for a catch-all)
/// and the hex digits of its escapes in upper case (`%2f` is `%2F` to the gateway): two
/// templates of one shape match the same paths, so one path has one spelling of its
/// parameters (as OpenAPI requires), whatever the methods.
pub fn template_shape(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut in_name = false;
    // Hex digits of an escape still to come.
    let mut escape = 0;
    for c in template.chars() {
        if escape > 0 {
            escape -= 1;
            out.push(c.to_ascii_uppercase());
            continue;
        }
        match c {
            '%' if !in_name => {
                escape = 2;
                out.push('%');
            }
            '{' => {
                in_name = true;
                out.push('{');
            }
            '}' => {
                in_name = false;
                out.push('}');
            }
            _ if in_name => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{is_default_route_path, overlaps_default_routes, template_shape};

    /// Paths against `/api/<service>/<method>` with both written out, by hand.
    #[test]
    fn a_path_written_as_a_default_route_is_one() {
        for (path, default) in [
            ("/api/shop.Orders/cancel", true),
            ("/api/orders/get", true),
            ("/api/orders/{id}", false),
            ("/api/orders", false),
            ("/api/orders/get/", false),
            ("/api//get", false),
            ("/api/orders/", false),
            ("/v1/orders/get", false),
            ("/api/a/b/c", false),
        ] {
            assert_eq!(is_default_route_path(path), default, "{path}");
        }
    }

    /// Each template against `/api/<service>/<method>`, worked out by hand from the matcher's
    /// rules (static segments, `{name}` parameters that may be empty within a segment,
    /// `{*rest}` catch-alls).
    #[test]
    fn templates_that_can_match_a_default_route_s_path() {
        for (template, overlaps) in [
            ("/api/{kind}/{id}", true),
            ("/api/{kind}/list", true),
            ("/{a}/{b}/{c}", true),
            ("/api/{*rest}", true),
            ("/{*rest}", true),
            ("/api/{kind}/{*rest}", true),
            ("/api{*rest}", true),
            ("/ap{*rest}", true),
            ("/a{*rest}", true),
            ("/api/s{*rest}", true),
            ("/api/shop.{*rest}", true),
            ("/api/{kind}/get{*rest}", true),
            ("/b{*rest}", false),
            ("/apis{*rest}", false),
            ("/api/orders/{*rest}", false),
            ("/api{v}/{a}/{b}", true),
            ("/a{p}/{a}/{b}", true),
            ("/api/orders/{id}", false),
            ("/api/{id}", false),
            ("/api/{a}/{b}/", false),
            ("/api/{a}/{b}/c", false),
            ("/v{n}/{a}/{b}", false),
            ("/orders/{kind}/{id}", false),
        ] {
            assert_eq!(overlaps_default_routes(template), overlaps, "{template}");
        }
    }

    #[test]
    fn shapes_leave_out_names_and_spell_escapes_one_way() {
        assert_eq!(
            template_shape("/orders/{id}/items/{n}"),
            "/orders/{}/items/{}"
        );
        assert_eq!(template_shape("/files/{*rest}"), "/files/{}");
        assert_eq!(template_shape("/a%2fb/{x}"), "/a%2Fb/{}");
        assert_eq!(template_shape("/plain"), "/plain");
    }
}
