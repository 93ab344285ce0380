//! `#[http(get = "/orders/{id}")]` on a method, and the method's doc comment: what an HTTP
//! gateway and an API document publish of the entry besides its signature.
//!
//! A gateway serves whatever services are registered, so a route it cannot serve (a path without
//! its leading `/`, a `{name}` that fills no parameter, two methods on one route) would only show
//! up as a failed call long after the service was built. Checking the route here turns each of
//! those mistakes into a compile error on the tokens that made it.

use proc_macro2::{Span, TokenStream};
use syn::punctuated::Punctuated;
use syn::{Attribute, Expr, ExprLit, Lit, LitStr, Meta, Token};

/// The HTTP methods a route can declare: the attribute's key and the method's name on the wire.
const METHODS: [(&str, &str); 5] = [
    ("get", "GET"),
    ("post", "POST"),
    ("put", "PUT"),
    ("patch", "PATCH"),
    ("delete", "DELETE"),
];

/// A route declared with `#[http(...)]`, checked.
#[derive(Debug, Clone)]
pub struct Route {
    /// The HTTP method, upper case (`"GET"`).
    pub method: &'static str,
    /// The path template as written (`"/orders/{id}"`).
    pub path: String,
    /// The whole attribute, for errors about the route as a whole (an error spanned by these
    /// tokens covers all of them, not only the `#`).
    pub attr: TokenStream,
    /// The path literal, for errors about the path.
    pub path_span: Span,
}

impl Route {
    /// The path with every `{name}` written `{}` and the hex digits of its escapes in upper
    /// case: two routes with the same method and the same key match the same requests, whatever
    /// their parameters are called and however their escapes are spelled (the gateway reads
    /// `%2f` as `%2F`): [`rpc_paths::template_shape`], as the gateway's table reads them.
    pub fn key(&self) -> (&'static str, String) {
        (self.method, rpc_paths::template_shape(&self.path))
    }
}

/// True for `#[http(...)]`.
pub fn is_http(attr: &Attribute) -> bool {
    attr.path().is_ident("http")
}

/// Reads the `#[http(...)]` attribute among `attrs`, checking its path against `params` (the
/// names of the method's encoded parameters, in order). `None` when there is none.
pub fn route(attrs: &[Attribute], params: &[String]) -> syn::Result<Option<Route>> {
    let mut found: Option<Route> = None;
    let mut errors: Option<syn::Error> = None;
    for attr in attrs.iter().filter(|a| is_http(a)) {
        if found.is_some() {
            push(
                &mut errors,
                syn::Error::new_spanned(
                    attr,
                    "a method has at most one `#[http]` route; remove this one (without any, \
                     a gateway serves the entry at `POST /api/<service id>/<method>`)",
                ),
            );
            continue;
        }
        match one(attr, params) {
            Ok(route) => found = Some(route),
            Err(e) => push(&mut errors, e),
        }
    }
    match errors {
        Some(e) => Err(e),
        None => Ok(found),
    }
}

fn push(errors: &mut Option<syn::Error>, e: syn::Error) {
    match errors {
        Some(all) => all.combine(e),
        None => *errors = Some(e),
    }
}

/// The keys, for error messages: "get, post, put, patch or delete".
fn keys() -> String {
    let names: Vec<&str> = METHODS.iter().map(|(k, _)| *k).collect();
    let (last, rest) = names.split_last().unwrap_or((&"", &[]));
    format!("{} or {last}", rest.join(", "))
}

/// One `#[http(method = "path")]`.
fn one(attr: &Attribute, params: &[String]) -> syn::Result<Route> {
    let usage = format!(
        "write `#[http(<method> = \"/path\")]` with one of {}, for example \
         `#[http(get = \"/orders/{{id}}\")]`",
        keys()
    );
    let list = match &attr.meta {
        Meta::List(list) => list,
        other => return Err(syn::Error::new_spanned(other, usage)),
    };
    let metas = list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)?;
    if metas.is_empty() {
        return Err(syn::Error::new_spanned(attr, usage));
    }
    let mut route: Option<(&'static str, LitStr)> = None;
    for meta in &metas {
        let path = meta.path();
        let method = path.get_ident().and_then(|ident| {
            METHODS
                .iter()
                .find(|(key, _)| ident == key)
                .map(|(_, method)| *method)
        });
        let Some(method) = method else {
            let name = quote::ToTokens::to_token_stream(path).to_string();
            return Err(syn::Error::new_spanned(
                path,
                format!("unknown `#[http]` key `{name}`: expected {}", keys()),
            ));
        };
        if let Some((first, _)) = &route {
            return Err(syn::Error::new_spanned(
                path,
                format!(
                    "one `#[http]` attribute declares one route, and this one already says \
                     {first}: keep one method"
                ),
            ));
        }
        let lit = match meta {
            Meta::NameValue(nv) => match &nv.value {
                Expr::Lit(ExprLit {
                    lit: Lit::Str(s), ..
                }) => s.clone(),
                other => {
                    return Err(syn::Error::new_spanned(
                        other,
                        "the route's path is a string literal, for example \"/orders/{id}\"",
                    ))
                }
            },
            other => return Err(syn::Error::new_spanned(other, usage)),
        };
        route = Some((method, lit));
    }
    let (method, lit) = route.ok_or_else(|| syn::Error::new_spanned(attr, &usage))?;
    check_path(&lit, params)?;
    if method == "POST" && overlaps_default_routes(&lit.value()) {
        return Err(syn::Error::new(
            lit.span(),
            format!(
                "`{}` holds a parameter where a gateway's default routes \
                 (`POST /api/{{service id}}/{{method}}`) hold the service id: it would answer the \
                 default routes of other services' methods whenever those are not served; give \
                 that segment a fixed name (`/api/orders/{{id}}`), use another prefix, or \
                 another method",
                lit.value()
            ),
        ));
    }
    Ok(Route {
        method,
        path: lit.value(),
        attr: quote::ToTokens::to_token_stream(attr),
        path_span: lit.span(),
    })
}

use rpc_paths::{overlaps_default_routes, MAX_PATH_PARAMS, RESERVED_PATHS as RESERVED};

/// The path starts with `/`, holds no query or fragment, is not one of the gateway's own, and
/// each `{name}` is a distinct parameter of the method that ends its path segment (what the
/// gateway's matcher accepts).
fn check_path(lit: &LitStr, params: &[String]) -> syn::Result<()> {
    let path = lit.value();
    let err = |message: String| syn::Error::new(lit.span(), message);
    if !path.starts_with('/') {
        return Err(err(format!(
            "the route's path must start with `/`: write \"/{}\"",
            path.trim_start_matches('/')
        )));
    }
    if let Some(reserved) = rpc_paths::reserved_match(&path) {
        return Err(err(format!(
            "`{path}` can match `{reserved}`, a route the gateway serves itself and answers \
             first ({}): choose another path",
            RESERVED.join(", ")
        )));
    }
    if let Some(at) = path.find("{r#") {
        let name = path[at + 3..].split('}').next().unwrap_or_default();
        return Err(err(format!(
            "write `{{r#{name}}}` as `{{{name}}}`: a route names a parameter as it is published, \
             without `r#`"
        )));
    }
    if let Some(c) = path
        .chars()
        .find(|c| matches!(c, '?' | '#') || c.is_whitespace())
    {
        return Err(err(format!(
            "the route's path cannot hold {c:?}: write the path alone, without a query string, \
             a fragment or spaces"
        )));
    }
    // The gateway matches paths with their escapes decoded but for `%2F`, `%25`, `%7B` and
    // `%7D` (`rpc-gateway`'s `normalized_path`): any other escape here would be a second
    // spelling of a path (`/%64ocs` is `/docs`) that no check of this crate compares. The
    // escapes it keeps (`%2F`, a `/` inside a segment; `%25`, a `%`; `%7B` and `%7D`, braces
    // as text) stay allowed.
    let bytes = path.as_bytes();
    for (at, _) in path.match_indices('%') {
        let hex = |i: usize| bytes.get(i).and_then(|&b| (b as char).to_digit(16));
        let Some(b) = hex(at + 1)
            .zip(hex(at + 2))
            .map(|(h, l)| (h << 4 | l) as u8)
        else {
            return Err(err(
                "a `%` in the route's path starts no escape: write a `%` as `%25`".to_string(),
            ));
        };
        if !matches!(b, b'/' | b'%' | b'{' | b'}') {
            return Err(err(format!(
                "`{}` in the route's path is a character the gateway reads as itself: write it \
                 as is (`/café`, not `/caf%C3%A9`; `/a:b`, not `/a%3Ab`); only `%2F`, `%25`, \
                 `%7B` and `%7D` stay escaped",
                &path[at..at + 3]
            )));
        }
    }
    let mut named: Vec<&str> = Vec::new();
    let mut rest = path.as_str();
    while let Some(open) = rest.find(['{', '}']) {
        if rest[open..].starts_with('}') {
            return Err(err(
                "a `}` without its `{` in the route's path: write each parameter as `{name}`"
                    .to_string(),
            ));
        }
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err(err(
                "a `{` without its `}` in the route's path: write each parameter as `{name}`"
                    .to_string(),
            ));
        };
        let name = &after[..close];
        if name.contains('{') {
            return Err(err(
                "a `{` inside `{...}` in the route's path: write each parameter as `{name}`"
                    .to_string(),
            ));
        }
        if let Some(rest) = name.strip_prefix('*') {
            return Err(err(format!(
                "`{{{name}}}`: `#[http]` takes no catch-all parameter; each `{{name}}` fills one \
                 segment of the path: write `{{{rest}}}`, or pass what may hold `/` in the query \
                 or the body"
            )));
        }
        if !params.iter().any(|p| p == name) {
            let known = if params.is_empty() {
                "the method has no parameters".to_string()
            } else {
                let list: Vec<String> = params.iter().map(|p| format!("`{p}`")).collect();
                format!("its parameters are {}", list.join(", "))
            };
            return Err(err(format!(
                "`{{{name}}}` in the route's path names no parameter of the method: {known}"
            )));
        }
        if named.contains(&name) {
            return Err(err(format!(
                "`{{{name}}}` appears twice in the route's path: a parameter fills one place"
            )));
        }
        named.push(name);
        if named.len() > MAX_PATH_PARAMS {
            return Err(err(format!(
                "the route's path has more than {MAX_PATH_PARAMS} parameters, the most the \
                 gateway serves at a declared route: take the others from the query or the body"
            )));
        }
        rest = &after[close + 1..];
        if !rest.is_empty() && !rest.starts_with('/') {
            return Err(err(format!(
                "`{{{name}}}` in the route's path must end its segment (be followed by `/` or \
                 the end of the path): a parameter takes everything up to the next `/`; write \
                 it as a segment of its own, e.g. \"/orders/{{id}}\" rather than \
                 \"/orders/{{id}}.json\""
            )));
        }
    }
    Ok(())
}

/// The doc comment among `attrs` as rustdoc reads it: a block comment's leading `*` on each
/// line dropped, then the indentation all its lines share (a nested list's or a code block's
/// own stays), trailing spaces, and leading and trailing blank lines; `None` when there is
/// none (or it is blank).
pub fn doc(attrs: &[Attribute]) -> Option<String> {
    let mut lines: Vec<String> = Vec::new();
    for attr in attrs.iter().filter(|a| a.path().is_ident("doc")) {
        if let Meta::NameValue(nv) = &attr.meta {
            if let Expr::Lit(ExprLit {
                lit: Lit::Str(s), ..
            }) = &nv.value
            {
                let value = s.value();
                let these: Vec<&str> = value.split('\n').collect();
                // `/** ... */` over several lines, each written ` * ...`.
                let starred = these.len() > 1
                    && these
                        .iter()
                        .filter(|l| !l.trim().is_empty())
                        .all(|l| l.trim_start().starts_with('*'));
                lines.extend(these.iter().map(|l| {
                    let l = if starred {
                        l.trim_start().strip_prefix('*').unwrap_or_default()
                    } else {
                        l
                    };
                    l.trim_end().to_string()
                }));
            }
        }
    }
    let indent = |l: &str| l.bytes().take_while(|b| matches!(b, b' ' | b'\t')).count();
    let shared = lines
        .iter()
        .filter(|l| !l.is_empty())
        .map(|l| indent(l))
        .min()?;
    let first = lines.iter().position(|l| !l.is_empty())?;
    let last = lines.iter().rposition(|l| !l.is_empty())?;
    let lines: Vec<&str> = lines[first..=last]
        .iter()
        .map(|l| l.get(shared..).unwrap_or_default())
        .collect();
    Some(lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use syn::parse_quote;

    fn params() -> Vec<String> {
        vec!["id".to_string(), "verbose".to_string()]
    }

    /// A path that can match one of the gateway's own (`/{id}` takes `/docs`) is refused:
    /// the gateway answers its own routes first, so the route would not be reached there.
    #[test]
    fn a_path_that_can_match_the_gateways_own_is_refused() {
        let e = error(parse_quote!(#[http(get = "/{id}")]));
        assert!(e.contains("can match `/openapi.json`"), "{e}");
        assert!(route(&[parse_quote!(#[http(get = "/orders/{id}")])], &params()).is_ok());
    }

    #[test]
    fn a_path_of_more_parameters_than_the_gateway_serves_is_refused() {
        let names: Vec<String> = (0..=MAX_PATH_PARAMS).map(|i| format!("p{i}")).collect();
        let path =
            |n: usize| -> String { names[..n].iter().map(|p| format!("/{{{p}}}")).collect() };
        let at = |n: usize| {
            let lit = path(n);
            let attr: Attribute = parse_quote!(#[http(get = #lit)]);
            route(&[attr], &names)
        };
        assert!(at(MAX_PATH_PARAMS).is_ok());
        let e = at(MAX_PATH_PARAMS + 1).unwrap_err().to_string();
        assert!(e.contains("more than 16 parameters"), "{e}");
    }

    fn error(attr: Attribute) -> String {
        match route(&[attr], &params()) {
            Ok(r) => panic!("expected an error, got {r:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn reads_each_method() {
        for (attr, method) in [
            (parse_quote!(#[http(get = "/orders/{id}")]), "GET"),
            (parse_quote!(#[http(post = "/orders/{id}")]), "POST"),
            (parse_quote!(#[http(put = "/orders/{id}")]), "PUT"),
            (parse_quote!(#[http(patch = "/orders/{id}")]), "PATCH"),
            (parse_quote!(#[http(delete = "/orders/{id}")]), "DELETE"),
        ] {
            let attr: Attribute = attr;
            let r = route(&[attr], &params()).unwrap().unwrap();
            assert_eq!((r.method, r.path.as_str()), (method, "/orders/{id}"));
        }
        assert!(route(&[], &params()).unwrap().is_none());
    }

    /// Only a POST route can answer a default route: routes of other methods, and POST routes
    /// no default route's path can reach, may hold parameters there.
    #[test]
    fn routes_no_default_route_reaches_may_hold_parameters_there() {
        let attrs: [Attribute; 3] = [
            parse_quote!(#[http(get = "/api/{id}/verbose")]),
            parse_quote!(#[http(post = "/v{id}/{verbose}/x")]),
            parse_quote!(#[http(post = "/api/{id}/{verbose}/")]),
        ];
        for attr in attrs {
            let r = route(std::slice::from_ref(&attr), &params());
            assert!(matches!(r, Ok(Some(_))), "{}", quote::quote!(#attr));
        }
    }

    /// Escapes the gateway keeps escaped (a `/` inside a segment, a `%`, braces as text) are
    /// a route's to hold; those it decodes are refused (see `rejects_bad_routes`).
    #[test]
    fn escapes_the_gateway_keeps_are_taken() {
        for path in [
            "/rates/100%25",
            "/files/a%2Fb",
            "/files/a%2fb",
            "/sets/%7Bempty%7d",
        ] {
            let attr: Attribute = parse_quote!(#[http(get = #path)]);
            let r = route(&[attr], &params()).unwrap().unwrap();
            assert_eq!(r.path, path);
        }
    }

    #[test]
    fn rejects_bad_routes() {
        let cases: Vec<(Attribute, &str)> = vec![
            (
                parse_quote!(#[http(head = "/x")]),
                "unknown `#[http]` key `head`",
            ),
            (
                parse_quote!(#[http(get = "/a", post = "/b")]),
                "already says GET",
            ),
            (
                parse_quote!(#[http(get = "x")]),
                "must start with `/`: write \"/x\"",
            ),
            (
                parse_quote!(#[http(get = "/o/{idd}")]),
                "`{idd}` in the route's path names no",
            ),
            (
                parse_quote!(#[http(get = "/o/{id}/{id}")]),
                "`{id}` appears twice",
            ),
            (
                parse_quote!(#[http(get = "/o/{id")]),
                "a `{` without its `}`",
            ),
            (
                parse_quote!(#[http(get = "/o/id}")]),
                "a `}` without its `{`",
            ),
            (parse_quote!(#[http(get = "/o?x=1")]), "cannot hold '?'"),
            (
                parse_quote!(#[http(get = "/%64ocs")]),
                "`%64` in the route's path is a character the gateway reads as itself",
            ),
            (
                parse_quote!(#[http(get = "/caf%C3%A9")]),
                "`%C3` in the route's path",
            ),
            (
                parse_quote!(#[http(get = "/q/%3a")]),
                "`%3a` in the route's path is a character the gateway reads as itself",
            ),
            (
                parse_quote!(#[http(get = "/100%")]),
                "starts no escape: write a `%` as `%25`",
            ),
            (
                parse_quote!(#[http(post = "/api/{id}/verbose")]),
                "holds a parameter where a gateway's default routes",
            ),
            (
                parse_quote!(#[http(post = "/{id}/{verbose}/x")]),
                "holds a parameter where a gateway's default routes",
            ),
            (
                parse_quote!(#[http(post = "/api{id}/{verbose}/x")]),
                "holds a parameter where a gateway's default routes",
            ),
            (parse_quote!(#[http(get = 3)]), "string literal"),
            (
                parse_quote!(#[http(get)]),
                "write `#[http(<method> = \"/path\")]`",
            ),
            (
                parse_quote!(#[http]),
                "write `#[http(<method> = \"/path\")]`",
            ),
            (
                parse_quote!(#[http()]),
                "write `#[http(<method> = \"/path\")]`",
            ),
        ];
        for (attr, want) in cases {
            let e = error(attr);
            assert!(e.contains(want), "want {want:?} in {e}");
        }
        let two: [Attribute; 2] = [
            parse_quote!(#[http(get = "/a")]),
            parse_quote!(#[http(get = "/b")]),
        ];
        let e = route(&two, &params()).unwrap_err().to_string();
        assert!(e.contains("at most one `#[http]` route"), "{e}");
        let e = route(&[parse_quote!(#[http(get = "/o/{x}")])], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("the method has no parameters"), "{e}");
    }

    #[test]
    fn route_keys_ignore_parameter_names() {
        let r = |path: &str| Route {
            method: "GET",
            path: path.to_string(),
            attr: TokenStream::new(),
            path_span: Span::call_site(),
        };
        assert_eq!(r("/o/{id}").key(), r("/o/{order}").key());
        assert_eq!(r("/o/{id}").key(), ("GET", "/o/{}".to_string()));
        assert_ne!(r("/o/{id}").key(), r("/o/{id}/x").key());
    }

    #[test]
    fn doc_lines_are_trimmed_and_joined() {
        let attrs: Vec<Attribute> = vec![
            parse_quote!(#[doc = " Reads one order."]),
            parse_quote!(#[doc = ""]),
            parse_quote!(#[doc = "   Unknown ids answer 404.  "]),
            parse_quote!(#[governance(timeout_ms = 1)]),
        ];
        assert_eq!(
            doc(&attrs).as_deref(),
            Some("Reads one order.\n\n  Unknown ids answer 404.")
        );
        let block: Vec<Attribute> = vec![parse_quote!(#[doc = "\n   First.\n   Second.\n "])];
        assert_eq!(doc(&block).as_deref(), Some("First.\nSecond."));
        assert_eq!(doc(&[]), None);
        assert_eq!(doc(&[parse_quote!(#[doc = "  "])]), None);
    }

    /// As rustdoc reads them: a block comment's stars are not text, and a nested list's or a
    /// code block's indentation is kept.
    #[test]
    fn doc_comments_keep_their_shape() {
        let starred: Vec<Attribute> =
            vec![parse_quote!(#[doc = "\n * Reads one order.\n *\n * Or none.\n "])];
        assert_eq!(
            doc(&starred).as_deref(),
            Some("Reads one order.\n\nOr none.")
        );
        let nested: Vec<Attribute> = vec![
            parse_quote!(#[doc = " - a"]),
            parse_quote!(#[doc = "   - nested"]),
            parse_quote!(#[doc = ""]),
            parse_quote!(#[doc = "     let code = 1;"]),
        ];
        assert_eq!(
            doc(&nested).as_deref(),
            Some("- a\n  - nested\n\n    let code = 1;")
        );
    }
}
