//! Reads the attribute arguments and the trait into a [`Service`] model, and rejects what the
//! generated code could not support, each error on the span of the offending tokens.

use proc_macro2::Span;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::{
    Attribute, FnArg, GenericArgument, Ident, ItemTrait, LitStr, Pat, PathArguments, ReturnType,
    Token, TraitItem, TraitItemFn, Type,
};

use crate::governance::{self, Governance};
use crate::http::{self, Route};

/// The arguments of `#[rpc::service(...)]`.
#[derive(Debug, Default)]
pub struct ServiceArgs {
    /// `name = "echo.Echo"`: the service id, instead of `"<module path>.<Trait>"`.
    pub name: Option<LitStr>,
}

impl Parse for ServiceArgs {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut args = ServiceArgs::default();
        while !input.is_empty() {
            let key: Ident = input.call(Ident::parse_any)?;
            if key != "name" {
                return Err(syn::Error::new(
                    key.span(),
                    format!(
                        "unknown #[rpc::service] argument `{key}`; the only one is \
                         `name = \"<service id>\"`"
                    ),
                ));
            }
            if args.name.is_some() {
                return Err(syn::Error::new(key.span(), "`name` is set twice"));
            }
            input.parse::<Token![=]>()?;
            let lit: LitStr = input.parse()?;
            let value = lit.value();
            // The name is a path segment of registry keys and of the gateway's default routes.
            if value.is_empty()
                || value
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control() || "/{}?#%".contains(c))
            {
                return Err(syn::Error::new(
                    lit.span(),
                    "the service name must be non-empty, without whitespace and without any of \
                     `/ { } ? # %` (it is a path segment of registry keys and HTTP routes), for \
                     example \"echo.Echo\"",
                ));
            }
            args.name = Some(lit);
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(args)
    }
}

/// A service trait, checked.
pub struct Service {
    /// The trait as written (still with `#[governance]`/`#[hash_key]`).
    pub item: ItemTrait,
    /// `name = "..."`, when given.
    pub name: Option<LitStr>,
    /// One per trait method, in declaration order.
    pub methods: Vec<Method>,
}

/// One method of the service.
pub struct Method {
    /// The method name.
    pub ident: Ident,
    /// The arguments after `&self`.
    pub args: Vec<Arg>,
    /// Index (among `args`) of the `#[hash_key]` argument.
    pub hash_key: Option<usize>,
    /// What `#[governance(...)]` sets.
    pub governance: Governance,
    /// The declared return type, `Result<T, E>`.
    pub output: Type,
    /// `T`.
    pub ok: Type,
    /// `E`.
    pub err: Type,
    /// `I` when `T` is `RpcStream<I>`: a server-streaming method.
    pub stream_item: Option<Type>,
    /// `I` when the last argument is an `RpcStream<I>`: a client-streaming method, or a
    /// bidirectional one when `stream_item` is set too (the argument is in `args`, and not
    /// among the encoded parameters).
    pub stream_arg: Option<Type>,
    /// The doc comment, lines trimmed and joined with `'\n'`.
    pub doc: Option<String>,
    /// The route of `#[http(...)]`.
    pub route: Option<Route>,
}

/// One argument of a method.
pub struct Arg {
    /// Its name.
    pub ident: Ident,
    /// Its type.
    pub ty: Type,
    /// `I` when the type is `RpcStream<I>`: the caller's request stream.
    pub stream_item: Option<Type>,
}

impl Method {
    /// The arguments encoded in the call's parameters: all but a request stream.
    pub fn params(&self) -> impl Iterator<Item = &Arg> {
        self.args.iter().filter(|a| a.stream_item.is_none())
    }
}

impl Method {
    /// The method name as it appears in the entry id (without `r#`).
    pub fn name(&self) -> String {
        self.ident.unraw().to_string()
    }

    /// How the method streams: `"server"`, `"client"` or `"bidi"`; `None` for a unary method.
    pub fn stream_shape(&self) -> Option<&'static str> {
        match (self.stream_item.is_some(), self.stream_arg.is_some()) {
            (false, false) => None,
            (true, false) => Some("server"),
            (false, true) => Some("client"),
            (true, true) => Some("bidi"),
        }
    }
}

/// Collects several errors so a user sees all of them at once.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    pub fn add(&mut self, span: Span, message: impl std::fmt::Display) {
        self.push(syn::Error::new(span, message));
    }

    /// An error covering all of `tokens` (not only their first token).
    pub fn spanned(&mut self, tokens: &dyn quote::ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    pub fn finish(self) -> syn::Result<()> {
        match self.0 {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The tokens of `<...>` and of the `where` clause, for an error covering both.
fn generics_tokens(g: &syn::Generics) -> proc_macro2::TokenStream {
    let mut tokens = quote::ToTokens::to_token_stream(g);
    quote::ToTokens::to_tokens(&g.where_clause, &mut tokens);
    tokens
}

/// The most arguments a method's call carries (besides a stream): they travel as one tuple,
/// and serde encodes tuples of up to 16 elements.
pub const MAX_PARAMS: usize = 16;

/// `HashMap` or `HashSet` when `ty` is one (by its last path segment): a collection whose
/// encoding follows its iteration order.
/// (Read through the groups a `macro_rules!` fragment such as `$k:ty` arrives in.)
fn unordered_collection(ty: &Type) -> Option<&'static str> {
    let Type::Path(p) = ungrouped(ty) else {
        return None;
    };
    let last = p.path.segments.last()?;
    ["HashMap", "HashSet"]
        .into_iter()
        .find(|kind| last.ident == kind)
}

fn is_hash_key(attr: &Attribute) -> bool {
    attr.path().is_ident("hash_key")
}

/// The trait as emitted next to our errors: without the attributes only this macro understands
/// and with argument patterns replaced by `_`, so that the compiler adds no follow-up errors
/// ("cannot find attribute", "patterns aren't allowed in functions without bodies", or, had the
/// trait been dropped, "cannot find trait").
pub fn passthrough(mut item: ItemTrait) -> ItemTrait {
    strip_helper_attrs(&mut item);
    for it in &mut item.items {
        if let TraitItem::Fn(f) = it {
            for input in &mut f.sig.inputs {
                if let FnArg::Typed(t) = input {
                    if !matches!(&*t.pat, Pat::Ident(p) if p.by_ref.is_none()
                        && p.mutability.is_none() && p.subpat.is_none())
                    {
                        *t.pat = Pat::Wild(syn::PatWild {
                            attrs: Vec::new(),
                            underscore_token: Default::default(),
                        });
                    }
                }
            }
        }
    }
    item
}

/// Whether `attr` is one of the attributes only this macro understands.
fn is_helper_attr(attr: &Attribute) -> bool {
    governance::is_governance(attr) || http::is_http(attr) || is_hash_key(attr)
}

/// Removes the attributes only this macro understands (wherever they were put: one in the
/// wrong place is reported, and must not be left for the compiler to call unknown).
pub fn strip_helper_attrs(item: &mut ItemTrait) {
    item.attrs.retain(|a| !is_helper_attr(a));
    for it in &mut item.items {
        if let TraitItem::Fn(f) = it {
            f.attrs.retain(|a| !is_helper_attr(a));
            for input in &mut f.sig.inputs {
                if let FnArg::Typed(t) = input {
                    t.attrs.retain(|a| !is_helper_attr(a));
                }
            }
        }
    }
}

impl Service {
    /// Checks the trait and builds the model; every problem found is reported.
    pub fn new(args: ServiceArgs, item: ItemTrait) -> syn::Result<Self> {
        let mut errors = Errors::default();
        if let Some(u) = &item.unsafety {
            errors.add(u.span, "a service trait cannot be `unsafe`");
        }
        if let Some(a) = &item.auto_token {
            errors.add(a.span, "a service trait cannot be an auto trait");
        }
        if !item.generics.params.is_empty() || item.generics.where_clause.is_some() {
            errors.spanned(
                &generics_tokens(&item.generics),
                "a service trait cannot be generic: every method's argument and result types \
                 must be concrete so both sides agree on the wire format",
            );
        }
        for attr in item.attrs.iter().filter(|a| is_helper_attr(a)) {
            errors.spanned(
                attr,
                if is_hash_key(attr) {
                    "`#[hash_key]` goes on one argument of a method"
                } else if http::is_http(attr) {
                    "`#[http(...)]` goes on a method of the service, not on the trait: it declares \
                     that method's route (each method without one is served at `POST \
                     /api/<service id>/<method>`)"
                } else {
                    "this attribute goes on a method of the service, not on the trait; settings \
                     for the whole service belong in the config file's `[services.\"<id>\"]` \
                     section"
                },
            );
        }
        for bound in &item.supertraits {
            let syn::TypeParamBound::Trait(t) = bound else {
                continue;
            };
            let last = t.path.segments.last().map(|s| s.ident.to_string());
            // (What the generated client is, or derives.)
            let marker = matches!(
                last.as_deref(),
                Some("Send" | "Sync" | "Sized" | "Unpin" | "Clone" | "Debug")
            );
            if !marker {
                errors.spanned(
                    t,
                    "a service trait cannot extend another trait: the generated client \
                     implements only this trait's methods, and the server dispatches only them; \
                     to serve two services, add both to the server (`add_service`)",
                );
            }
        }
        let mut methods = Vec::new();
        for it in &item.items {
            match it {
                TraitItem::Fn(f) => match method(f) {
                    Ok(m) => methods.push(m),
                    Err(e) => errors.push(e),
                },
                other => errors.spanned(
                    &other,
                    "a service trait holds only `async fn` methods; move associated types, \
                     consts and macros elsewhere",
                ),
            }
        }
        // Two methods on one route: the second could never be reached.
        let mut routes: Vec<(&Method, &Route)> = Vec::new();
        for m in &methods {
            let Some(route) = &m.route else { continue };
            if let Some((first, taken)) = routes.iter().find(|(_, r)| r.key() == route.key()) {
                errors.add(
                    route.path_span,
                    format!(
                        "this route matches the same requests as `{} {}`, the route of `{}`: \
                         two methods of one service cannot share a route; give this one another \
                         path or method",
                        taken.method,
                        taken.path,
                        first.name()
                    ),
                );
            } else if let Some((first, taken)) = routes
                .iter()
                .find(|(_, r)| r.key().1 == route.key().1 && r.path != route.path)
            {
                // One path has one spelling, whatever the methods: the gateway serves it (and
                // OpenAPI documents it) once, so it would serve this one at its default route.
                errors.add(
                    route.path_span,
                    format!(
                        "this path is `{}`, the path of `{}`, with other parameter names or \
                         escapes in another case: one path has one spelling whatever the \
                         method; write it as `{}` does, or give this one another path",
                        taken.path,
                        first.name(),
                        taken.path
                    ),
                );
            } else {
                routes.push((m, route));
            }
        }
        // The gateway serves every method at its default route (`POST
        // /api/<service id>/<method>`), so a route declaring another method's default route
        // is not served (`rpc_paths::is_default_route_path`). The service id is known here only
        // when `name = ...` gives it: then the method's own default route is allowed, and
        // another method's of this service is named.
        let name = args.name.as_ref().map(syn::LitStr::value);
        for (m, route) in &routes {
            if route.method != "POST" || !rpc_paths::is_default_route_path(&route.path) {
                continue;
            }
            let default_of = |o: &Method| {
                name.as_ref()
                    .is_some_and(|name| route.path == format!("/api/{name}/{}", o.name()))
            };
            if default_of(m) {
                continue;
            }
            let message = match methods.iter().find(|o| o.ident != m.ident && default_of(o)) {
                Some(o) => format!(
                    "this is the default route of `{}` (`POST {}`), which the gateway serves \
                     it at: give this method another path or method",
                    o.name(),
                    route.path
                ),
                None => format!(
                    "`POST {}` has the shape of a default route (`POST /api/<service id>/<method>`), \
                     the route of another service's method: served, it would answer that \
                     method's calls whenever its service is not running, so the gateway does not \
                     serve it; give this method another path or method (every method is served at \
                     its own default route without one)",
                    route.path
                ),
            };
            errors.add(route.path_span, message);
        }
        errors.finish()?;
        Ok(Service {
            item,
            name: args.name,
            methods,
        })
    }

    /// The trait's name.
    pub fn ident(&self) -> &Ident {
        &self.item.ident
    }
}

/// The generated client's own items (and the methods of `Clone`, which it derives, of
/// `ToOwned`, which every `Clone` type has, and of the prelude's `Into` and `TryInto`, which
/// every type has and which take the client by value, found before a method on `&self`): a
/// method of the same name would be hidden by them, or ambiguous with them, at the caller's
/// call.
const PROXY_ITEMS: [&str; 11] = [
    "new",
    "client",
    "with_options",
    "with_timeout",
    "methods",
    "clone",
    "clone_from",
    "to_owned",
    "clone_into",
    "into",
    "try_into",
];

/// Whether a receiver is `&self`: written so, as `&'_ self`, or as `self: &Self`.
fn is_shared_self(r: &syn::Receiver) -> bool {
    let elided = |lt: &Option<syn::Lifetime>| lt.as_ref().is_none_or(|lt| lt.ident == "_");
    if r.mutability.is_some() {
        return false;
    }
    match (&r.reference, &r.colon_token) {
        (Some((_, lt)), None) => elided(lt),
        (None, Some(_)) => match &*r.ty {
            Type::Reference(t) => {
                t.mutability.is_none()
                    && elided(&t.lifetime)
                    && matches!(&*t.elem, Type::Path(p) if p.qself.is_none() && p.path.is_ident("Self"))
            }
            _ => false,
        },
        _ => false,
    }
}

fn method(f: &TraitItemFn) -> syn::Result<Method> {
    let sig = &f.sig;
    let mut errors = Errors::default();
    if let Some(block) = &f.default {
        errors.spanned(
            &block,
            "a service method cannot have a default body: the generated client implements \
             every method by a remote call; put the body in your `impl` of the trait",
        );
    }
    if let Some(c) = &sig.constness {
        errors.add(c.span, "a service method cannot be `const`");
    }
    if let Some(u) = &sig.unsafety {
        errors.add(u.span, "a service method cannot be `unsafe`");
    }
    if let Some(abi) = &sig.abi {
        errors.spanned(&abi, "a service method cannot have an `extern` ABI");
    }
    if let Some(v) = &sig.variadic {
        errors.spanned(&v, "a service method cannot be variadic");
    }
    for attr in &f.attrs {
        if is_hash_key(attr) {
            errors.spanned(
                attr,
                "`#[hash_key]` goes on one argument of the method, not on the method",
            );
        }
        if attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr") {
            errors.spanned(
                attr,
                "a service method cannot be conditional (`#[cfg]`, `#[cfg_attr]`): the trait's \
                 client, dispatcher and published entries are generated from every method as \
                 written; put the condition on the whole trait, or the method in a service of \
                 its own",
            );
        }
    }
    let name = sig.ident.to_string();
    let name = name.strip_prefix("r#").unwrap_or(&name);
    if PROXY_ITEMS.contains(&name) {
        errors.spanned(
            &sig.ident,
            format!(
                "a service method cannot be named `{name}`: the generated client has a `{name}` \
                 of its own ({}), which a call on the client would reach instead; rename the \
                 method",
                PROXY_ITEMS.join(", ")
            ),
        );
    }
    if sig.asyncness.is_none() {
        errors.add(
            sig.fn_token.span,
            format!(
                "service methods must be `async fn`: write `async fn {}(&self, ...) -> \
                 Result<T, E>;`",
                sig.ident
            ),
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.spanned(
            &generics_tokens(&sig.generics),
            "a service method cannot be generic (nor name lifetimes): the server must know \
             the concrete argument and result types to decode and encode them",
        );
    }

    // The receiver: `&self`, however it is spelled (`&'_ self`, `self: &Self`).
    let mut inputs = sig.inputs.iter();
    match inputs.next() {
        Some(FnArg::Receiver(r)) if is_shared_self(r) => {}
        Some(FnArg::Receiver(r)) => errors.spanned(
            &r,
            "a service method takes `&self` (not `self`, `&mut self` or a receiver of another \
             type such as `self: Arc<Self>`): calls run concurrently on a shared instance",
        ),
        Some(other) => errors.spanned(
            &other,
            "a service method takes `&self` as its first parameter",
        ),
        None => errors.add(
            sig.paren_token.span.join(),
            "a service method takes `&self` as its first parameter",
        ),
    }

    let mut args = Vec::new();
    let mut hash_key: Option<usize> = None;
    let mut hash_key_attr: Option<&Attribute> = None;
    let mut encoded = 0;
    for (index, input) in inputs.enumerate() {
        let FnArg::Typed(pt) = input else {
            // A second receiver is rejected by the parser already.
            continue;
        };
        for attr in &pt.attrs {
            if is_hash_key(attr) {
                if !matches!(attr.meta, syn::Meta::Path(_)) {
                    errors.spanned(&attr.meta, "write `#[hash_key]` without arguments");
                } else if hash_key.is_some() {
                    errors.spanned(
                        &attr,
                        "only one argument can be the `#[hash_key]`: the hash shunt strategy \
                         hashes a single value",
                    );
                } else {
                    hash_key = Some(index);
                    hash_key_attr = Some(attr);
                }
            } else {
                errors.spanned(
                    &attr,
                    "only `#[hash_key]` is supported on a service method argument",
                );
            }
        }
        let ident = match &*pt.pat {
            Pat::Ident(p) if p.by_ref.is_none() && p.mutability.is_none() && p.subpat.is_none() => {
                p.ident.clone()
            }
            other => {
                errors.spanned(
                    &other,
                    "service method arguments must be plain names (`name: Type`), not patterns",
                );
                continue;
            }
        };
        // `r#__rpc_x` is the same name as the generated `__rpc_x`.
        if ident.unraw().to_string().starts_with("__rpc") {
            errors.spanned(
                &ident,
                format!(
                    "a service method argument cannot be named `{ident}`: names beginning with \
                     `__rpc` are the generated code's own, which this argument would shadow or \
                     be shadowed by; rename it"
                ),
            );
            continue;
        }
        let arg_stream = stream_item(&pt.ty);
        if arg_stream.is_none() {
            encoded += 1;
            if encoded == MAX_PARAMS + 1 {
                errors.spanned(
                    &pt,
                    format!(
                        "a service method takes at most {MAX_PARAMS} arguments (besides a \
                         stream): they travel as one tuple, which serde encodes up to \
                         {MAX_PARAMS} elements; group some of them in a struct"
                    ),
                );
            }
        }
        if arg_stream.is_some() && index + 2 != sig.inputs.len() {
            errors.spanned(
                &pt.ty,
                "a stream argument (client streaming) must be the method's last argument, and \
                 there can be only one",
            );
        }
        match not_owned(&pt.ty) {
            Some(Type::Reference(r)) => errors.spanned(
                &r,
                "service method arguments are decoded into owned values on the server: take \
                 an owned type (`String` rather than `&str`, `Vec<T>` rather than `&[T]`)",
            ),
            Some(t) => errors.spanned(
                &t,
                "service method arguments need a concrete type, not `impl Trait`",
            ),
            None => {}
        }
        check_stream_place(&pt.ty, "an argument", &mut errors);
        if hash_key == Some(index) {
            if let Some(kind) = unordered_collection(&pt.ty) {
                errors.spanned(
                    &pt.ty,
                    format!(
                        "a `#[hash_key]` cannot be a `{kind}`: the key is hashed from its encoding, \
                         which lists a `{kind}`'s entries in an order that changes from value to \
                         value and from process to process, so equal keys would reach different \
                         endpoints; use a `BTree{}` or a sorted `Vec`",
                        &kind[4..]
                    ),
                );
            }
        }
        args.push(Arg {
            ident,
            ty: (*pt.ty).clone(),
            stream_item: arg_stream,
        });
    }

    let governance = match Governance::from_attrs(&f.attrs) {
        Ok(g) => g,
        Err(e) => {
            errors.push(e);
            Governance::default()
        }
    };
    if let Some((shunt, span)) = governance.shunt_strategy() {
        let client_streaming = args.iter().any(|a| a.stream_item.is_some());
        if shunt.is_hash() && client_streaming {
            errors.add(
                span,
                "shunt_strategy = \"hash\" cannot be used by a client-streaming method yet: \
                 its key would have to be known before its items",
            );
        } else if shunt.is_hash() && hash_key.is_none() {
            errors.add(
                span,
                "shunt_strategy = \"hash\" needs an argument marked `#[hash_key]`",
            );
        }
    }

    let result = match &sig.output {
        ReturnType::Type(_, ty) => match result_types(ty) {
            Some((ok, err)) => {
                for t in [&ok, &err] {
                    match not_owned(t) {
                        Some(Type::Reference(r)) => errors.spanned(
                            &r,
                            "a service method's result is decoded into an owned value on the \
                             client: return an owned type (`String` rather than `&str`)",
                        ),
                        Some(t) => errors.spanned(
                            &t,
                            "a service method's result needs a concrete type, not `impl Trait`: \
                             the client decodes it",
                        ),
                        None => {}
                    }
                }
                check_stream_place(&ok, "the result", &mut errors);
                check_stream_place(&err, "the error", &mut errors);
                if stream_item(&err).is_some() {
                    errors.spanned(&err, "the error type cannot be a stream");
                }
                Some(((**ty).clone(), ok, err))
            }
            None => {
                errors.spanned(
                    &ty,
                    "a service method returns `Result<T, E>`, where `E` is `rpc::RpcError` or \
                     your own error type (Serialize + Deserialize + From<RpcError>)",
                );
                None
            }
        },
        ReturnType::Default => {
            errors.add(
                sig.paren_token.span.close(),
                "a service method returns `Result<T, E>`; add `-> Result<(), RpcError>` if \
                 there is nothing to return",
            );
            None
        }
    };

    let params: Vec<String> = args
        .iter()
        .filter(|a| a.stream_item.is_none())
        .map(|a| a.ident.unraw().to_string())
        .collect();
    let route = match http::route(&f.attrs, &params) {
        Ok(route) => route,
        Err(e) => {
            errors.push(e);
            None
        }
    };

    let streams_in = args.iter().any(|a| a.stream_item.is_some());
    let streams_out = result
        .as_ref()
        .is_some_and(|(_, ok, _)| stream_item(ok).is_some());
    if streams_in {
        if let Some(attr) = hash_key_attr {
            errors.spanned(
                attr,
                "a client-streaming method cannot have a `#[hash_key]` argument yet: the \
                 hash shunt strategy is for unary and server-streaming methods",
            );
        }
    }
    if streams_in || streams_out {
        for key in ["hedge_delay_ms", "hedge_percentile"] {
            if let Some(span) = governance.span_of(key) {
                errors.add(
                    span,
                    format!(
                        "`{key}` cannot be set on a streaming method: a hedge would open the \
                         stream twice, so streams are never hedged"
                    ),
                );
            }
        }
    }

    errors.finish()?;
    let (output, ok, err) =
        result.ok_or_else(|| syn::Error::new_spanned(sig, "expected `-> Result<T, E>`"))?;
    let stream_item = stream_item(&ok);
    let stream_arg = args.iter().find_map(|a| a.stream_item.clone());
    if let Some(route) = &route {
        if stream_item.is_some() || stream_arg.is_some() {
            return Err(syn::Error::new_spanned(
                &route.attr,
                "`#[http]` cannot go on a streaming method: the HTTP gateway serves unary \
                 methods only; remove the attribute and call the stream through the generated \
                 client",
            ));
        }
    }
    Ok(Method {
        ident: sig.ident.clone(),
        args,
        hash_key,
        governance,
        output,
        ok,
        err,
        stream_item,
        stream_arg,
        doc: http::doc(&f.attrs),
        route,
    })
}

/// `I` of an `RpcStream<I>` (any path ending in `RpcStream` with one type argument).
fn stream_item(ty: &Type) -> Option<Type> {
    let Type::Path(tp) = ungrouped(ty) else {
        return None;
    };
    if tp.qself.is_some() {
        return None;
    }
    let last = tp.path.segments.last()?;
    if last.ident != "RpcStream" {
        return None;
    }
    let PathArguments::AngleBracketed(ab) = &last.arguments else {
        return None;
    };
    match ab.args.iter().collect::<Vec<_>>()[..] {
        [GenericArgument::Type(t)] => Some(t.clone()),
        _ => None,
    }
}

/// `T` and `E` of a `Result<T, E>` (any path ending in `Result` with two type arguments).
fn result_types(ty: &Type) -> Option<(Type, Type)> {
    let Type::Path(tp) = ungrouped(ty) else {
        return None;
    };
    if tp.qself.is_some() {
        return None;
    }
    let last = tp.path.segments.last()?;
    if last.ident != "Result" {
        return None;
    }
    let PathArguments::AngleBracketed(ab) = &last.arguments else {
        return None;
    };
    let mut types = ab.args.iter().map(|a| match a {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    });
    let ok = types.next()??;
    let err = types.next()??;
    if types.next().is_some() {
        return None;
    }
    Some((ok, err))
}

/// `ty` without the invisible group a `macro_rules!` `$t:ty` puts around it, or parentheses.
fn ungrouped(ty: &Type) -> &Type {
    match ty {
        Type::Group(g) => ungrouped(&g.elem),
        Type::Paren(p) => ungrouped(&p.elem),
        other => other,
    }
}

/// The types `ty` is built from, one level down: type arguments, tuple, array and slice
/// elements.
fn inner_types(ty: &Type) -> Vec<&Type> {
    match ungrouped(ty) {
        Type::Path(tp) => tp
            .path
            .segments
            .iter()
            .flat_map(|s| match &s.arguments {
                PathArguments::AngleBracketed(ab) => ab
                    .args
                    .iter()
                    .filter_map(|a| match a {
                        GenericArgument::Type(t) => Some(t),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            })
            .collect(),
        Type::Tuple(t) => t.elems.iter().collect(),
        Type::Array(a) => vec![&*a.elem],
        Type::Slice(s) => vec![&*s.elem],
        _ => Vec::new(),
    }
}

/// The first reference or `impl Trait` in `ty`, at any depth (`Option<&str>` too): a value
/// decoded on the other side must own its data and have a concrete type.
fn not_owned(ty: &Type) -> Option<&Type> {
    match ungrouped(ty) {
        t @ (Type::Reference(_) | Type::ImplTrait(_)) => Some(t),
        t => inner_types(t).into_iter().find_map(not_owned),
    }
}

/// Reports an `RpcStream` inside `ty` other than as the whole of it (`Option<RpcStream<T>>`,
/// `RpcStream<RpcStream<T>>`): a stream is an argument or a result of its own, so the macro
/// would otherwise take the method as unary and fail in generated code.
fn check_stream_place(ty: &Type, what: &str, errors: &mut Errors) {
    fn nested(ty: &Type) -> Option<&Type> {
        inner_types(ty).into_iter().find_map(|t| {
            if stream_item(t).is_some() {
                Some(t)
            } else {
                nested(t)
            }
        })
    }
    if let Some(inner) = nested(ty) {
        errors.spanned(
            inner,
            format!(
                "`RpcStream` can only be {what}'s whole type (`RpcStream<T>`), not part of \
                 another type"
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn service(tokens: proc_macro2::TokenStream) -> syn::Result<Service> {
        Service::new(ServiceArgs::default(), syn::parse2(tokens).unwrap())
    }

    fn error(tokens: proc_macro2::TokenStream) -> String {
        match service(tokens) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e
                .into_iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    /// A type a `macro_rules!` passes as `$t:ty` arrives in an invisible group: it is read
    /// through, as a result and as a stream.
    #[test]
    fn a_grouped_type_is_read_through() {
        let grouped = |ty: Type| {
            Type::Group(syn::TypeGroup {
                group_token: Default::default(),
                elem: Box::new(ty),
            })
        };
        let result = grouped(syn::parse_quote!(Result<RpcStream<u8>, RpcError>));
        let (ok, _) = result_types(&result).expect("a Result");
        assert!(stream_item(&grouped(ok)).is_some());
        // A `#[hash_key]` type passed in by a `macro_rules!` (`shards!(HashMap<K, V>)`).
        let map = grouped(syn::parse_quote!(HashMap<String, String>));
        assert_eq!(unordered_collection(&map), Some("HashMap"));
    }

    #[test]
    fn reads_methods_in_order() {
        let s = service(quote! {
            pub trait Echo {
                #[governance(timeout_ms = 800, retry_times = 2, idempotent)]
                async fn echo(&self, text: String) -> Result<String, RpcError>;
                async fn profile(&self, #[hash_key] user_id: u64, verbose: bool)
                    -> std::result::Result<Profile, MyError>;
                async fn ping(&self) -> Result<(), RpcError>;
                async fn r#type(&self) -> Result<(), RpcError>;
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<_> = s.methods.iter().map(Method::name).collect();
        assert_eq!(names, ["echo", "profile", "ping", "type"]);
        assert_eq!(
            s.methods[0].governance.get("timeout_ms"),
            Some(crate::governance::Value::Int(800))
        );
        assert_eq!(s.methods[0].hash_key, None);
        assert_eq!(s.methods[1].hash_key, Some(0));
        assert_eq!(s.methods[1].args.len(), 2);
        let err = &s.methods[1].err;
        assert_eq!(quote!(#err).to_string(), "MyError");
        assert!(s.methods[2].args.is_empty());
    }

    #[test]
    fn a_method_returning_an_rpc_stream_streams_its_items() {
        let s = service(quote! {
            trait Feed {
                async fn ticks(&self, n: u32) -> Result<RpcStream<Tick>, RpcError>;
                async fn qualified(&self) -> Result<rpc::RpcStream<Vec<u8>>, MyError>;
                async fn plain(&self) -> Result<Vec<Tick>, RpcError>;
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let items: Vec<_> = s
            .methods
            .iter()
            .map(|m| m.stream_item.as_ref().map(|t| quote!(#t).to_string()))
            .collect();
        assert_eq!(
            items,
            [
                Some("Tick".to_string()),
                Some("Vec < u8 >".to_string()),
                None
            ]
        );
        let s = service(quote! {
            trait Up { async fn put(&self, name: String, chunks: RpcStream<Chunk>) -> Result<u64, E>; }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let m = &s.methods[0];
        let item = m.stream_arg.as_ref().expect("a client stream");
        assert_eq!(quote!(#item).to_string(), "Chunk");
        let params: Vec<_> = m.params().map(|a| a.ident.to_string()).collect();
        assert_eq!(params, ["name"]);
        let e = error(quote! {
            trait Up { async fn put(&self, chunks: RpcStream<Chunk>, n: u8) -> Result<(), E>; }
        });
        assert!(e.contains("must be the method's last argument"), "{e}");
        let s = service(quote! {
            trait Chat { async fn chat(&self, c: RpcStream<String>) -> Result<RpcStream<u8>, E>; }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let m = &s.methods[0];
        assert!(
            m.stream_arg.is_some() && m.stream_item.is_some(),
            "bidirectional"
        );
        assert_eq!(m.stream_shape(), Some("bidi"));
        let s = service(quote! {
            trait Shapes {
                async fn a(&self) -> Result<RpcStream<u8>, E>;
                async fn b(&self, c: RpcStream<u8>) -> Result<u8, E>;
                async fn c(&self) -> Result<u8, E>;
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let shapes: Vec<_> = s.methods.iter().map(Method::stream_shape).collect();
        assert_eq!(shapes, [Some("server"), Some("client"), None]);
    }

    #[test]
    fn reads_routes_and_docs() {
        // One service, its third route written as `by_type` says.
        let orders = |by_type: &str| {
            service(quote! {
                trait Orders {
                    /// Reads one order.
                    ///
                    ///   Unknown ids are an error.
                    #[http(get = "/orders/{id}")]
                    async fn get(&self, id: u64, r#type: String) -> Result<(), E>;
                    #[http(put = "/orders/{id}")]
                    async fn put(&self, id: u64) -> Result<(), E>;
                    #[http(get = #by_type)]
                    async fn by_type(&self, r#type: String) -> Result<(), E>;
                    async fn plain(&self) -> Result<(), E>;
                }
            })
        };
        // The raw prefix is not part of a parameter's name: a path names `{type}`.
        let e = orders("/orders/{r#type}")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("write `{r#type}` as `{type}`"), "{e}");
        let s = orders("/orders/by-type/{type}").unwrap_or_else(|e| panic!("{e}"));
        let routes: Vec<_> = s
            .methods
            .iter()
            .map(|m| m.route.as_ref().map(|r| (r.method, r.path.clone())))
            .collect();
        assert_eq!(
            routes,
            [
                Some(("GET", "/orders/{id}".to_string())),
                Some(("PUT", "/orders/{id}".to_string())),
                Some(("GET", "/orders/by-type/{type}".to_string())),
                None
            ]
        );
        assert_eq!(
            s.methods[0].doc.as_deref(),
            Some("Reads one order.\n\n  Unknown ids are an error.")
        );
        assert_eq!(s.methods[3].doc, None);
    }

    #[test]
    fn hash_key_index_skips_self() {
        let s = service(quote! {
            trait T { async fn m(&self, a: u8, b: u8, #[hash_key] c: String) -> Result<(), E>; }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.methods[0].hash_key, Some(2));
    }

    #[test]
    fn rejects_two_hash_keys() {
        let e = error(quote! {
            trait T { async fn m(&self, #[hash_key] a: u8, #[hash_key] b: u8) -> Result<(), E>; }
        });
        assert!(e.contains("hash_key"), "{e}");
    }

    #[test]
    fn rejects_unsupported_methods() {
        let cases = [
            (
                "trait T { fn m(&self) -> Result<(), E>; }",
                "must be `async fn`",
            ),
            (
                "trait T { async fn m(self) -> Result<(), E>; }",
                "takes `&self`",
            ),
            (
                "trait T { async fn m(&mut self) -> Result<(), E>; }",
                "takes `&self`",
            ),
            (
                "trait T { async fn m(self: Arc<Self>) -> Result<(), E>; }",
                "takes `&self`",
            ),
            (
                "trait T { async fn m(self: &mut Self) -> Result<(), E>; }",
                "takes `&self`",
            ),
            (
                "trait T { async fn m(&'a self) -> Result<(), E>; }",
                "takes `&self`",
            ),
            (
                "trait T { async fn m() -> Result<(), E>; }",
                "takes `&self`",
            ),
            (
                "trait T { async fn m(&self, (a, b): (u8, u8)) -> Result<(), E>; }",
                "plain names",
            ),
            (
                "trait T { async fn m(&self, mut a: u8) -> Result<(), E>; }",
                "plain names",
            ),
            (
                "trait T { async fn m<X>(&self, a: X) -> Result<(), E>; }",
                "cannot be generic",
            ),
            (
                "trait T { async fn m<'a>(&'a self) -> Result<(), E>; }",
                "cannot be generic",
            ),
            (
                "trait T { async fn m(&self) -> Result<(), E> where Self: Sized; }",
                "cannot be generic",
            ),
            (
                "trait T { async fn m(&self) -> String; }",
                "returns `Result<T, E>`",
            ),
            (
                "trait T { async fn m(&self) -> Result<String>; }",
                "returns `Result<T, E>`",
            ),
            (
                "trait T { async fn m(&self) -> Result<'a, E>; }",
                "returns `Result<T, E>`",
            ),
            ("trait T { async fn m(&self); }", "returns `Result<T, E>`"),
            (
                "trait T { async fn m(&self) -> Result<(), E> { Ok(()) } }",
                "default body",
            ),
            (
                "trait T { async fn m(&self, s: &str) -> Result<(), E>; }",
                "owned",
            ),
            (
                "trait T { async fn m(&self, s: impl X) -> Result<(), E>; }",
                "concrete type",
            ),
            (
                "trait T { async fn m(&self, #[hash_key(x)] s: u8) -> Result<(), E>; }",
                "without",
            ),
            (
                "trait T { async fn m(&self, #[serde] s: u8) -> Result<(), E>; }",
                "only `#[hash_key]`",
            ),
            ("trait T { const fn m(&self) -> Result<(), E>; }", "`const`"),
            (
                "trait T { unsafe fn m(&self) -> Result<(), E>; }",
                "`unsafe`",
            ),
            (
                "trait T { #[governance(nope = 1)] async fn m(&self) -> Result<(), E>; }",
                "unknown governance key `nope`",
            ),
            (
                "trait T { #[governance(shunt_strategy = \"hash\")] \
                 async fn m(&self) -> Result<(), E>; }",
                "needs an argument marked `#[hash_key]`",
            ),
            (
                "trait T { #[http(get = \"/t/{n}\")] \
                 async fn m(&self, n: u8) -> Result<RpcStream<u8>, E>; }",
                "`#[http]` cannot go on a streaming method",
            ),
            (
                "trait T { #[http(post = \"/t\")] \
                 async fn m(&self, c: RpcStream<u8>) -> Result<u8, E>; }",
                "`#[http]` cannot go on a streaming method",
            ),
            (
                "trait T { #[http(get = \"/t/{c}\")] \
                 async fn m(&self, n: u8, c: RpcStream<u8>) -> Result<u8, E>; }",
                "`{c}` in the route's path names no parameter of the method: its parameters \
                 are `n`",
            ),
            (
                "trait T { #[http(get = \"/t/{a}\")] async fn m(&self, a: u8) -> Result<(), E>; \
                 #[http(get = \"/t/{b}\")] async fn n(&self, b: u8) -> Result<(), E>; }",
                "the same requests as `GET /t/{a}`, the route of `m`",
            ),
            ("trait T<X> {}", "cannot be generic"),
            ("trait T where Self: Sized {}", "cannot be generic"),
            ("trait T { type X; }", "only `async fn`"),
            ("trait T { const X: u8; }", "only `async fn`"),
            ("unsafe trait T {}", "`unsafe`"),
        ];
        for (source, want) in cases {
            let tokens: proc_macro2::TokenStream = syn::parse_str(source).unwrap();
            let e = error(tokens);
            assert!(e.contains(want), "{source}\n=> {e}");
        }
    }

    /// `&self` however it is spelled is taken: `&'_ self`, `self: &Self`.
    #[test]
    fn the_spellings_of_a_shared_self_are_taken() {
        for source in [
            "trait T { async fn m(&'_ self) -> Result<(), E>; }",
            "trait T { async fn m(self: &Self) -> Result<(), E>; }",
            "trait T { async fn m(self: &'_ Self) -> Result<(), E>; }",
        ] {
            let tokens: proc_macro2::TokenStream = syn::parse_str(source).unwrap();
            assert!(service(tokens).is_ok(), "{source}");
        }
    }

    /// A route that is another method's default route (`POST /api/<name>/<method>`), which
    /// the gateway serves first, is refused when the service's name is given; the method's
    /// own default route is its to declare.
    #[test]
    fn a_route_cannot_take_another_methods_default_route() {
        let named = |tokens: proc_macro2::TokenStream| {
            let args: ServiceArgs = syn::parse_quote!(name = "shop.Orders");
            Service::new(args, syn::parse2(tokens).unwrap())
        };
        let e = match named(quote! {
            trait Orders {
                #[http(post = "/api/shop.Orders/list")]
                async fn create(&self, n: u8) -> Result<(), E>;
                async fn list(&self) -> Result<(), E>;
            }
        }) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("the default route of `list` (`POST /api/shop.Orders/list`)"),
            "{e}"
        );
        assert!(named(quote! {
            trait Orders {
                #[http(post = "/api/shop.Orders/create")]
                async fn create(&self, n: u8) -> Result<(), E>;
                #[http(get = "/api/shop.Orders/create")]
                async fn list(&self) -> Result<(), E>;
            }
        })
        .is_ok());
    }

    /// A POST route written as a default route (`/api/<service>/<method>`) that is not the
    /// method's own would answer another service's method whenever that service is not
    /// running: refused, with or without the service's name.
    #[test]
    fn a_route_written_as_another_services_default_route_is_refused() {
        let trait_tokens = quote! {
            trait Admin {
                #[http(post = "/api/shop.Orders/cancel")]
                async fn purge(&self, id: u64) -> Result<(), E>;
            }
        };
        let unnamed = match service(trait_tokens.clone()) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        };
        let args: ServiceArgs = syn::parse_quote!(name = "a.Admin");
        let named = match Service::new(args, syn::parse2(trait_tokens).unwrap()) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        };
        for e in [unnamed, named] {
            assert!(
                e.contains("`POST /api/shop.Orders/cancel` has the shape of a default route"),
                "{e}"
            );
        }
        // Another method, or a template, is the route's own.
        assert!(service(quote! {
            trait Admin {
                #[http(put = "/api/shop.Orders/cancel")]
                async fn purge(&self, id: u64) -> Result<(), E>;
                #[http(post = "/api/orders/{id}")]
                async fn get(&self, id: u64) -> Result<(), E>;
            }
        })
        .is_ok());
    }

    #[test]
    fn reports_every_error() {
        let e = service(quote! {
            trait T {
                fn a(&self) -> Result<(), E>;
                async fn b(&self) -> u8;
            }
        })
        .err()
        .unwrap();
        assert_eq!(e.into_iter().count(), 2);
    }

    #[test]
    fn service_args() {
        let a: ServiceArgs = syn::parse2(quote!(name = "echo.Echo")).unwrap();
        assert_eq!(a.name.unwrap().value(), "echo.Echo");
        let a: ServiceArgs = syn::parse2(quote!()).unwrap();
        assert!(a.name.is_none());
        for (tokens, want) in [
            (quote!(nme = "x"), "unknown #[rpc::service] argument `nme`"),
            (quote!(name = ""), "non-empty"),
            (quote!(name = "a b"), "whitespace"),
            (quote!(name = 3), "expected string literal"),
            (quote!(name = "a", name = "b"), "set twice"),
        ] {
            let e = syn::parse2::<ServiceArgs>(tokens)
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
