//! `#[governance(...)]` on a method: parsed into the overrides of its entry descriptor.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::punctuated::Punctuated;
use syn::{Attribute, Expr, ExprLit, Lit, Meta, Token};

/// The keys `#[governance(...)]` accepts, for error messages.
const KNOWN_KEYS: &str = "timeout_ms, retry_times, retry_interval_ms, enable_circuit_breaker, \
    exceptions_allowed_before_breaking, breaker_seconds, max_concurrent_handling_count, \
    unhealthy_times_allowed_before_removing, idempotent, shunt_strategy, appoint_address";

/// A shunt strategy named in the attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shunt {
    Polling,
    Random,
    HashAlgorithm,
    Appoint,
}

impl Shunt {
    fn parse(s: &str) -> Option<Self> {
        // The same spellings as `ShuntStrategy::from_str` in rpc-core.
        match s {
            "polling" | "round_robin" | "round-robin" => Some(Shunt::Polling),
            "random" => Some(Shunt::Random),
            "hash" | "hash_algorithm" => Some(Shunt::HashAlgorithm),
            "appoint" => Some(Shunt::Appoint),
            _ => None,
        }
    }

    fn variant(self) -> TokenStream {
        match self {
            Shunt::Polling => quote!(Polling),
            Shunt::Random => quote!(Random),
            Shunt::HashAlgorithm => quote!(HashAlgorithm),
            Shunt::Appoint => quote!(Appoint),
        }
    }
}

/// What the `#[governance(...)]` attributes of one method set; `None` leaves the value to the
/// other configuration layers.
#[derive(Debug, Clone, Default)]
pub struct Governance {
    pub timeout_ms: Option<u64>,
    pub retry_times: Option<u32>,
    pub retry_interval_ms: Option<u64>,
    pub enable_circuit_breaker: Option<bool>,
    pub exceptions_allowed_before_breaking: Option<u32>,
    pub breaker_seconds: Option<u64>,
    pub max_concurrent_handling_count: Option<u32>,
    pub unhealthy_times_allowed_before_removing: Option<u32>,
    pub idempotent: Option<bool>,
    pub shunt_strategy: Option<(Shunt, Span)>,
    pub appoint_address: Option<String>,
}

/// True for `#[governance(...)]`.
pub fn is_governance(attr: &Attribute) -> bool {
    attr.path().is_ident("governance")
}

impl Governance {
    /// Reads every `#[governance(...)]` among `attrs` (several attributes add up; a key set twice
    /// is an error).
    pub fn from_attrs(attrs: &[Attribute]) -> syn::Result<Self> {
        let mut out = Governance::default();
        let mut errors: Option<syn::Error> = None;
        for attr in attrs.iter().filter(|a| is_governance(a)) {
            let list = match &attr.meta {
                Meta::List(list) => list,
                other => {
                    push(
                        &mut errors,
                        syn::Error::new_spanned(
                            other,
                            "expected `#[governance(key = value, ...)]`, for example \
                             `#[governance(timeout_ms = 800, retry_times = 2, idempotent)]`",
                        ),
                    );
                    continue;
                }
            };
            let metas = match list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
            {
                Ok(metas) => metas,
                Err(e) => {
                    push(&mut errors, e);
                    continue;
                }
            };
            for meta in metas {
                if let Err(e) = out.set(&meta) {
                    push(&mut errors, e);
                }
            }
        }
        match errors {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn set(&mut self, meta: &Meta) -> syn::Result<()> {
        let path = meta.path();
        let Some(key) = path.get_ident() else {
            return Err(syn::Error::new_spanned(
                path,
                format!("unknown governance key; expected one of: {KNOWN_KEYS}"),
            ));
        };
        let name = key.to_string();
        let value = match meta {
            Meta::NameValue(nv) => Some(&nv.value),
            Meta::Path(_) => None,
            Meta::List(list) => {
                return Err(syn::Error::new(
                    list.delimiter.span().open(),
                    format!("expected `{name} = value`"),
                ))
            }
        };
        let dup = || syn::Error::new(key.span(), format!("`{name}` is set twice"));
        macro_rules! int {
            ($field:ident, $ty:ty) => {{
                if self.$field.is_some() {
                    return Err(dup());
                }
                self.$field = Some(int_value::<$ty>(key, value)?);
            }};
        }
        macro_rules! boolean {
            ($field:ident, $flag:expr) => {{
                if self.$field.is_some() {
                    return Err(dup());
                }
                self.$field = Some(bool_value(key, value, $flag)?);
            }};
        }
        match name.as_str() {
            "timeout_ms" => int!(timeout_ms, u64),
            "retry_times" => int!(retry_times, u32),
            "retry_interval_ms" => int!(retry_interval_ms, u64),
            "breaker_seconds" => int!(breaker_seconds, u64),
            "exceptions_allowed_before_breaking" => int!(exceptions_allowed_before_breaking, u32),
            "max_concurrent_handling_count" => int!(max_concurrent_handling_count, u32),
            "unhealthy_times_allowed_before_removing" => {
                int!(unhealthy_times_allowed_before_removing, u32)
            }
            "enable_circuit_breaker" => boolean!(enable_circuit_breaker, false),
            "idempotent" => boolean!(idempotent, true),
            "shunt_strategy" => {
                if self.shunt_strategy.is_some() {
                    return Err(dup());
                }
                let lit = str_value(key, value)?;
                let shunt = Shunt::parse(&lit.value()).ok_or_else(|| {
                    syn::Error::new(
                        lit.span(),
                        format!(
                            "unknown shunt strategy {:?}: expected \"polling\", \"random\", \
                             \"hash\" or \"appoint\"",
                            lit.value()
                        ),
                    )
                })?;
                self.shunt_strategy = Some((shunt, key.span()));
            }
            "appoint_address" => {
                if self.appoint_address.is_some() {
                    return Err(dup());
                }
                let lit = str_value(key, value)?;
                let address = lit.value();
                if address.trim().is_empty() || !address.contains(':') {
                    return Err(syn::Error::new(
                        lit.span(),
                        "appoint_address must be `host:port`, for example \"127.0.0.1:9000\"",
                    ));
                }
                self.appoint_address = Some(address);
            }
            _ => {
                return Err(syn::Error::new(
                    key.span(),
                    format!("unknown governance key `{name}`; expected one of: {KNOWN_KEYS}"),
                ))
            }
        }
        Ok(())
    }

    /// The `::rpc::__private::GovernanceOverrides { .. }` expression, usable in a `static`: the
    /// fields that are set, then `..GovernanceOverrides::NONE`, so that fields added to the type
    /// later need no change here.
    pub fn to_tokens(&self) -> TokenStream {
        fn some<T: quote::ToTokens>(name: &str, v: Option<T>) -> Option<TokenStream> {
            let field = syn::Ident::new(name, Span::call_site());
            v.map(|v| quote!(#field: ::core::option::Option::Some(#v),))
        }
        // Unsuffixed, so that each literal takes the type of its field.
        fn int(v: Option<impl Into<u64>>) -> Option<proc_macro2::Literal> {
            v.map(|v| proc_macro2::Literal::u64_unsuffixed(v.into()))
        }
        let mut fields: Vec<TokenStream> = Vec::new();
        if let Some((s, _)) = &self.shunt_strategy {
            let v = s.variant();
            fields.push(quote! {
                shunt_strategy: ::core::option::Option::Some(
                    ::rpc::__private::ShuntStrategy::#v
                ),
            });
        }
        if let Some(a) = &self.appoint_address {
            fields.push(quote! {
                appoint_address: ::core::option::Option::Some(::std::borrow::Cow::Borrowed(#a)),
            });
        }
        fields.extend(
            [
                some("timeout_ms", int(self.timeout_ms)),
                some("retry_times", int(self.retry_times)),
                some("retry_interval_ms", int(self.retry_interval_ms)),
                some("enable_circuit_breaker", self.enable_circuit_breaker),
                some(
                    "exceptions_allowed_before_breaking",
                    int(self.exceptions_allowed_before_breaking),
                ),
                some("breaker_seconds", int(self.breaker_seconds)),
                some(
                    "max_concurrent_handling_count",
                    int(self.max_concurrent_handling_count),
                ),
                some(
                    "unhealthy_times_allowed_before_removing",
                    int(self.unhealthy_times_allowed_before_removing),
                ),
                some("idempotent", self.idempotent),
            ]
            .into_iter()
            .flatten(),
        );
        if fields.is_empty() {
            return quote!(::rpc::__private::GovernanceOverrides::NONE);
        }
        quote! {
            ::rpc::__private::GovernanceOverrides {
                #(#fields)*
                ..::rpc::__private::GovernanceOverrides::NONE
            }
        }
    }
}

fn push(errors: &mut Option<syn::Error>, e: syn::Error) {
    match errors {
        Some(all) => all.combine(e),
        None => *errors = Some(e),
    }
}

fn literal<'a>(key: &syn::Ident, value: Option<&'a Expr>, what: &str) -> syn::Result<&'a Lit> {
    match value {
        Some(Expr::Lit(ExprLit { lit, .. })) => Ok(lit),
        Some(other) => Err(syn::Error::new_spanned(
            other,
            format!("`{key}` takes {what} literal"),
        )),
        None => Err(syn::Error::new(
            key.span(),
            format!("`{key}` needs a value: `{key} = ...` ({what})"),
        )),
    }
}

fn int_value<T>(key: &syn::Ident, value: Option<&Expr>) -> syn::Result<T>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    if let Some(Expr::Unary(u)) = value {
        if matches!(u.op, syn::UnOp::Neg(_)) {
            return Err(syn::Error::new_spanned(
                u,
                format!("`{key}` takes a non-negative integer"),
            ));
        }
    }
    match literal(key, value, "an integer")? {
        Lit::Int(i) if i.base10_digits().starts_with('-') => Err(syn::Error::new(
            i.span(),
            format!("`{key}` takes a non-negative integer"),
        )),
        Lit::Int(i) => {
            if !i.suffix().is_empty() {
                return Err(syn::Error::new(
                    i.span(),
                    format!("write `{key}` without a type suffix"),
                ));
            }
            i.base10_parse::<T>()
                .map_err(|e| syn::Error::new(i.span(), format!("`{key}` is out of range: {e}")))
        }
        other => Err(syn::Error::new(
            other.span(),
            format!("`{key}` takes an integer literal"),
        )),
    }
}

fn bool_value(
    key: &syn::Ident,
    value: Option<&Expr>,
    bare_flag_allowed: bool,
) -> syn::Result<bool> {
    if value.is_none() && bare_flag_allowed {
        return Ok(true);
    }
    match literal(key, value, "a `true` or `false`")? {
        Lit::Bool(b) => Ok(b.value),
        other => Err(syn::Error::new(
            other.span(),
            format!("`{key}` takes `true` or `false`"),
        )),
    }
}

fn str_value<'a>(key: &syn::Ident, value: Option<&'a Expr>) -> syn::Result<&'a syn::LitStr> {
    match literal(key, value, "a string")? {
        Lit::Str(s) => Ok(s),
        other => Err(syn::Error::new(
            other.span(),
            format!("`{key}` takes a string literal"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(attr: TokenStream) -> syn::Result<Governance> {
        let f: syn::ItemFn = syn::parse_quote!(#attr fn f() {});
        Governance::from_attrs(&f.attrs)
    }

    #[test]
    fn reads_every_key() {
        let g = parse(quote! {
            #[governance(timeout_ms = 800, retry_times = 2, retry_interval_ms = 10,
                enable_circuit_breaker = false, exceptions_allowed_before_breaking = 4,
                breaker_seconds = 9, max_concurrent_handling_count = 7,
                unhealthy_times_allowed_before_removing = 5, idempotent)]
            #[governance(shunt_strategy = "hash", appoint_address = "127.0.0.1:9")]
        })
        .unwrap();
        assert_eq!(g.timeout_ms, Some(800));
        assert_eq!(g.retry_times, Some(2));
        assert_eq!(g.retry_interval_ms, Some(10));
        assert_eq!(g.enable_circuit_breaker, Some(false));
        assert_eq!(g.exceptions_allowed_before_breaking, Some(4));
        assert_eq!(g.breaker_seconds, Some(9));
        assert_eq!(g.max_concurrent_handling_count, Some(7));
        assert_eq!(g.unhealthy_times_allowed_before_removing, Some(5));
        assert_eq!(g.idempotent, Some(true));
        assert_eq!(g.shunt_strategy.map(|s| s.0), Some(Shunt::HashAlgorithm));
        assert_eq!(g.appoint_address.as_deref(), Some("127.0.0.1:9"));
    }

    #[test]
    fn idempotent_can_be_false() {
        let g = parse(quote!(#[governance(idempotent = false)])).unwrap();
        assert_eq!(g.idempotent, Some(false));
        assert_eq!(g.timeout_ms, None);
    }

    #[test]
    fn tokens_name_only_the_set_fields() {
        let g = parse(quote!(#[governance(timeout_ms = 800, retry_times = 2,
            shunt_strategy = "random", idempotent)]))
        .unwrap();
        let s = g.to_tokens().to_string();
        assert!(
            s.contains("timeout_ms : :: core :: option :: Option :: Some (800) ,"),
            "{s}"
        );
        assert!(
            s.contains("retry_times : :: core :: option :: Option :: Some (2) ,"),
            "{s}"
        );
        assert!(
            s.contains("idempotent : :: core :: option :: Option :: Some (true) ,"),
            "{s}"
        );
        assert!(s.contains("ShuntStrategy :: Random"), "{s}");
        assert!(!s.contains("breaker_seconds"), "{s}");
        assert!(
            s.ends_with(".. :: rpc :: __private :: GovernanceOverrides :: NONE }"),
            "{s}"
        );
        let none = Governance::default().to_tokens().to_string();
        assert_eq!(none, ":: rpc :: __private :: GovernanceOverrides :: NONE");
    }

    #[test]
    fn rejects_bad_input() {
        let cases = [
            (
                quote!(#[governance(timeout = 1)]),
                "unknown governance key `timeout`",
            ),
            (quote!(#[governance(timeout_ms = "1")]), "integer"),
            (quote!(#[governance(timeout_ms = -1)]), "non-negative"),
            (
                syn::parse_str::<TokenStream>("#[governance(timeout_ms = -1)]").unwrap(),
                "non-negative",
            ),
            (
                quote!(#[governance(timeout_ms = 1u8)]),
                "without a type suffix",
            ),
            (
                quote!(#[governance(retry_times = 5000000000)]),
                "out of range",
            ),
            (quote!(#[governance(timeout_ms)]), "needs a value"),
            (
                quote!(#[governance(enable_circuit_breaker)]),
                "needs a value",
            ),
            (quote!(#[governance(idempotent = 1)]), "true"),
            (
                quote!(#[governance(shunt_strategy = "nearest")]),
                "unknown shunt strategy",
            ),
            (
                quote!(#[governance(appoint_address = "nowhere")]),
                "host:port",
            ),
            (
                quote!(#[governance(timeout_ms = 1, timeout_ms = 2)]),
                "set twice",
            ),
            (quote!(#[governance]), "expected `#[governance("),
            (quote!(#[governance(a::b = 1)]), "unknown governance key"),
        ];
        for (attr, want) in cases {
            let err = parse(attr.clone()).unwrap_err().to_string();
            assert!(err.contains(want), "{attr}: {err}");
        }
    }

    #[test]
    fn all_errors_are_reported() {
        let err = parse(quote!(#[governance(nope = 1, also_nope = 2)])).unwrap_err();
        assert_eq!(err.into_iter().count(), 2);
    }
}
