//! Where each entry is served, and what each status code becomes in HTTP.
//!
//! Why one module: the gateway's router, its error answers and the OpenAPI document must agree
//! on both, so both are written once here.

use axum::http::{Method, StatusCode as HttpStatus};
use rpc_core::{RpcError, ServiceEntry, StatusCode};
use serde_json::{json, Value};

/// The HTTP method and path template an entry is served at: the route declared with
/// `#[http(...)]`, or `POST /api/{service id}/{method}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The HTTP method.
    pub method: Method,
    /// The path template; each `{name}` is a parameter of the entry.
    pub path: String,
}

/// The route `entry` is served at (see [`Route`]). A declared method other than those
/// `#[http]` takes (GET, POST, PUT, PATCH, DELETE), published by a server built some other way,
/// falls back to the default route: an OpenAPI document has no operation for `QUERY` or
/// `PROPFIND`, and `CONNECT` answers carry no body, so such a route could be neither documented
/// nor answered.
pub fn route_of(entry: &ServiceEntry) -> Route {
    if let Some(http) = entry.api.as_ref().and_then(|api| api.http.as_ref()) {
        let method = Method::from_bytes(http.method.to_ascii_uppercase().as_bytes());
        if let Ok(
            method @ (Method::GET | Method::POST | Method::PUT | Method::PATCH | Method::DELETE),
        ) = method
        {
            return Route {
                method,
                path: http.path.clone(),
            };
        }
    }
    Route {
        method: Method::POST,
        path: default_path(entry.service_id.as_str(), &entry.method),
    }
}

/// `/api/{service id}/{method}`, a brace in either escaped (`%7B`, `%7D`): in a path template
/// braces name parameters, and the default route has none.
pub fn default_path(service_id: &str, method: &str) -> String {
    let literal = |text: &str| text.replace('{', "%7B").replace('}', "%7D");
    format!("/api/{}/{}", literal(service_id), literal(method))
}

/// Whether a declared `route` could answer the default routes of entries it does not name:
/// [`rpc_paths::overlaps_default_routes`] for a POST route (default routes are POST), on its
/// path as routes are matched. Such a route is not served as declared.
pub(crate) fn overlaps_default_routes(route: &Route) -> bool {
    route.method == Method::POST
        && rpc_paths::overlaps_default_routes(&normalized_path(&route.path))
}

/// Whether the parameters not in the path come from the query string (`GET`, `DELETE`,
/// `HEAD`) rather than from a JSON object in the body.
pub fn params_in_query(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::DELETE | Method::HEAD)
}

/// The HTTP status answering a failed call with `code`.
///
/// | call status | HTTP |
/// |---|---|
/// | 1000 business error (a typed error) | 422 |
/// | 1001 validation error, or arguments the gateway could not read | 400 |
/// | 401 not authenticated | 401, with `WWW-Authenticate: Bearer` |
/// | 403 not authorized, 517 the credentials the call carried refused | 403 |
/// | 507 / 513 no such entry | 404 |
/// | 429 rate limited | 429, with `Retry-After` |
/// | 515 server overflow, 514 client overflow, 522 breaker open | 503, with `Retry-After` |
/// | 404 / 504 no instance of the service | 503, with `Retry-After` |
/// | 519 timeout | 504 |
/// | 506 communication error, 509 fallback failed, 520 server error | 502 |
/// | 501 not implemented | 501 |
/// | anything else | 500 |
pub fn http_status(code: StatusCode) -> HttpStatus {
    match code.as_u32() {
        1000 => HttpStatus::UNPROCESSABLE_ENTITY,
        1001 => HttpStatus::BAD_REQUEST,
        401 => HttpStatus::UNAUTHORIZED,
        // The server (or a layer of its) refused the credentials the call carried: the
        // gateway's own (`--server-token`) or a forwarded header. No token sent to the gateway
        // changes that, so it is no 401, whose challenge would ask for one.
        403 | 517 => HttpStatus::FORBIDDEN,
        507 | 513 => HttpStatus::NOT_FOUND,
        429 => HttpStatus::TOO_MANY_REQUESTS,
        404 | 504 | 514 | 515 | 522 => HttpStatus::SERVICE_UNAVAILABLE,
        519 => HttpStatus::GATEWAY_TIMEOUT,
        506 | 509 | 520 => HttpStatus::BAD_GATEWAY,
        501 => HttpStatus::NOT_IMPLEMENTED,
        _ => HttpStatus::INTERNAL_SERVER_ERROR,
    }
}

/// Whether an answer with this HTTP status carries `Retry-After` (429 and 503).
pub fn carries_retry_after(status: HttpStatus) -> bool {
    status == HttpStatus::TOO_MANY_REQUESTS || status == HttpStatus::SERVICE_UNAVAILABLE
}

/// The JSON body answering a failed call: `{"code": <call status>, "message": "...",
/// "error": <the value the error carried, when it carried one: the typed error's>, "fields": [{"member":
/// "...", "message": "..."}, ...] (the arguments that failed validation, when the server named
/// any)}`.
pub fn error_body(error: &RpcError) -> Value {
    let mut body = json!({
        "code": error.code().as_u32(),
        "message": error.message(),
    });
    if let Some(typed) = rpc_client::error_body(error) {
        body["error"] = typed;
    }
    if !error.field_errors().is_empty() {
        body["fields"] = error
            .field_errors()
            .iter()
            .map(|f| json!({"member": f.member, "message": f.message}))
            .collect();
    }
    body
}

/// The `error` field of a failed call's body other than a business error's: any JSON value
/// (the gateway sends one when the error carried a value: a typed error passing on a status of
/// its own, such as a downstream timeout, or the error as the server sent it).
pub fn carried_error_schema() -> Value {
    json!({
        "description": "The value the error carried, when it carried one: the method's typed \
                        error passing on this status (a downstream timeout, say), or the error as \
                        the server sent it."
    })
}

/// The JSON Schema of [`error_body`]'s answers, with `typed` as the schema of `error`.
pub fn error_body_schema(typed: Option<&Value>) -> Value {
    let mut properties = json!({
        "code": {"type": "integer", "description": "The call's status code (1000 a typed error, 519 a timeout, ...)."},
        "message": {"type": "string", "description": "What went wrong, and what to do next."},
        "fields": {
            "type": "array",
            "description": "The arguments that failed validation (status 1001), when the server named any.",
            "items": {
                "type": "object",
                "required": ["member", "message"],
                "properties": {
                    "member": {"type": "string", "description": "The argument or field."},
                    "message": {"type": "string", "description": "What is wrong with it."},
                },
            },
        },
    });
    if let Some(typed) = typed {
        properties["error"] = typed.clone();
    }
    json!({"type": "object", "required": ["code", "message"], "properties": properties})
}

/// `path` as routes are matched on it: percent-escapes of text decoded, but for `%2F` (a `/`
/// inside a segment, not a boundary), `%25` (a `%`, which must not start an escape when the
/// path parameters are decoded) and `%7B` / `%7D` (braces, which in a template name a
/// parameter: an escaped one is text), kept with uppercase hex digits, as is a byte that is
/// not UTF-8; a `%` that starts no escape is escaped as `%25`. Templates are matched in the
/// same form (a request's path also has its own braces escaped: [`request_path`]). A template holds its text as it is (a service id such as `my_crate::api.Echo`, a
/// method name in another script), while a client may send it percent-encoded (JavaScript's
/// `encodeURIComponent` escapes `:`, browsers escape `"`, `<`, `>`, `` ` ``): without this, it
/// would never match. Path parameters keep the escapes left and are decoded once, when bound,
/// which gives each the bytes the client encoded.
pub(crate) fn normalized_path(path: &str) -> std::borrow::Cow<'_, str> {
    if !path.contains('%') {
        return std::borrow::Cow::Borrowed(path);
    }
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            // Up to the next escape, as it is.
            let next = path[i..].find('%').map_or(path.len(), |n| i + n);
            out.push_str(&path[i..next]);
            i = next;
            continue;
        }
        // A run of escapes: their bytes, and where each one starts.
        let mut run = Vec::new();
        let mut starts = Vec::new();
        while i + 2 < bytes.len() && bytes[i] == b'%' {
            let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) else {
                break;
            };
            run.push(h << 4 | l);
            starts.push(i);
            i += 3;
        }
        if run.is_empty() {
            // A lone `%` (not an escape): escaped itself, so that escapes decoded after it do
            // not make a new one with it (decoded again when bound, it is `%` again).
            out.push_str("%25");
            i += 1;
            continue;
        }
        let mut k = 0;
        while k < run.len() {
            let b = run[k];
            let width = match b {
                0x00..=0x7f => 1,
                0xc2..=0xdf => 2,
                0xe0..=0xef => 3,
                0xf0..=0xf4 => 4,
                _ => 0,
            };
            let text = (width > 0)
                .then(|| run.get(k..k + width))
                .flatten()
                .and_then(|w| std::str::from_utf8(w).ok());
            match text {
                Some(t) if !matches!(b, b'/' | b'%' | b'{' | b'}') => {
                    out.push_str(t);
                    k += width;
                }
                _ => {
                    // Kept escaped, in one spelling (uppercase hex, RFC 3986 section 6.2.2.1).
                    out.push_str(&format!("%{b:02X}"));
                    k += 1;
                }
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A request's path as routes are matched on it: [`normalized_path`], with its braces escaped
/// too. In a request they are text; left as they are, they could not match a template that
/// holds them as text (escaped), and could spell a parameter's name to the matcher.
pub(crate) fn request_path(path: &str) -> std::borrow::Cow<'_, str> {
    let path = normalized_path(path);
    if !path.contains(['{', '}']) {
        return path;
    }
    std::borrow::Cow::Owned(path.replace('{', "%7B").replace('}', "%7D"))
}

/// Entries written in a line for this crate's tests; the same file serves the integration tests.
#[cfg(test)]
#[path = "../tests/support/entries.rs"]
pub(crate) mod test_entries;

#[cfg(test)]
mod tests {
    use super::test_entries::routed;
    use super::*;

    fn entry(http: Option<(&str, &str)>) -> ServiceEntry {
        routed("shop.Orders", "get", &["id"], http)
    }

    #[test]
    fn an_entry_without_a_declared_route_is_posted_under_api() {
        assert_eq!(
            route_of(&entry(None)),
            Route {
                method: Method::POST,
                path: "/api/shop.Orders/get".into()
            }
        );
    }

    #[test]
    fn a_declared_route_is_served_as_declared() {
        assert_eq!(
            route_of(&entry(Some(("get", "/orders/{id}")))),
            Route {
                method: Method::GET,
                path: "/orders/{id}".into()
            }
        );
    }

    #[test]
    fn a_path_is_matched_with_its_text_decoded_and_its_delimiters_kept_escaped() {
        for (given, matched) in [
            ("/api/shop.Orders/get", "/api/shop.Orders/get"),
            ("/api/%E5%95%86%E5%BA%97.Orders/m", "/api/商店.Orders/m"),
            ("/b%c3%bccher/7", "/bücher/7"),
            ("/api/%41%7e/x", "/api/A~/x"),
            ("/orders/a%2Fb%25c%20d", "/orders/a%2Fb%25c d"),
            ("/orders/a%2fb%3f", "/orders/a%2Fb?"),
            // A service id with `::`, as a client escaping it sends it.
            (
                "/api/my_crate%3A%3Aapi.Echo/echo",
                "/api/my_crate::api.Echo/echo",
            ),
            ("/q/%22%3C%3E%60", "/q/\"<>`"),
            // Not UTF-8, cut short: as they came; a lone `%` is escaped, so that what follows
            // it cannot make an escape with it.
            ("/x/%C3%28/%E5%95/%zz/50%", "/x/%C3(/%E5%95/%25zz/50%25"),
            ("/orders/%%34%31", "/orders/%2541"),
            ("/x/%2%35", "/x/%2525"),
            // Braces stay escaped: in a template they would name a parameter.
            ("/x/%7bid%7D", "/x/%7Bid%7D"),
        ] {
            assert_eq!(normalized_path(given), matched, "{given}");
            // Decoded once (as a bound parameter is), it says what the path said.
            let once = |p: &str| percent_encoding::percent_decode_str(p).collect::<Vec<u8>>();
            assert_eq!(once(&normalized_path(given)), once(given), "{given}");
        }
    }

    #[test]
    fn the_issue_s_status_table_holds() {
        for (code, http) in [
            (1000, 422),
            (515, 503),
            (522, 503),
            (519, 504),
            (517, 403),
            (401, 401),
            (403, 403),
            (507, 404),
        ] {
            assert_eq!(
                http_status(StatusCode::from_u32(code)).as_u16(),
                http,
                "{code}"
            );
        }
    }
}
