//! `#[governance(...)]` on a method: parsed into the overrides of its entry descriptor. The
//! keys, their kinds and the strategies' spellings are those of the options' one declaration
//! ([`crate::keys`]); what is here only reads a value of each kind.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::punctuated::Punctuated;
use syn::{Attribute, Expr, ExprLit, Lit, Meta, Token};

use crate::address::is_endpoint_address;
use crate::keys::{self, Kind};

/// The value of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// An integer key.
    Int(u64),
    /// A flag.
    Flag(bool),
    /// A shunt strategy: the `ShuntStrategy` variant's name.
    Strategy(&'static str),
    /// A compression algorithm: the `Compression` variant's name.
    Compression(&'static str),
    /// A string (an address).
    Str(String),
}

/// A shunt strategy named in the attribute, as the `ShuntStrategy` variant's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shunt(pub &'static str);

impl Shunt {
    /// Consistent hashing, which needs a `#[hash_key]` argument.
    pub fn is_hash(self) -> bool {
        self.0 == "Hash"
    }
}

/// What the `#[governance(...)]` attributes of one method set; a key not set leaves the value
/// to the other configuration layers.
#[derive(Debug, Clone, Default)]
pub struct Governance {
    /// The keys set, in the order written, with the span of each key.
    values: Vec<(&'static str, Value, Span)>,
}

/// True for `#[governance(...)]`.
pub fn is_governance(attr: &Attribute) -> bool {
    attr.path().is_ident("governance")
}

impl Governance {
    /// The value set for a key.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.values
            .iter()
            .find(|(k, _, _)| *k == key)
            .map(|(_, v, _)| v.clone())
    }

    /// The span of `key`'s name where it is set.
    pub fn span_of(&self, key: &str) -> Option<Span> {
        self.values
            .iter()
            .find(|(k, _, _)| *k == key)
            .map(|(_, _, span)| *span)
    }

    /// The shunt strategy set, with the span of its key.
    pub fn shunt_strategy(&self) -> Option<(Shunt, Span)> {
        self.values.iter().find_map(|(_, v, span)| match v {
            Value::Strategy(s) => Some((Shunt(s), *span)),
            _ => None,
        })
    }

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
        let Some(ident) = path.get_ident() else {
            return Err(syn::Error::new_spanned(
                path,
                format!(
                    "unknown governance key; expected one of: {}",
                    keys::known_keys()
                ),
            ));
        };
        let name = ident.to_string();
        let Some(key) = keys::key(&name) else {
            return Err(syn::Error::new(
                ident.span(),
                format!(
                    "unknown governance key `{name}`; expected one of: {}",
                    keys::known_keys()
                ),
            ));
        };
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
        if self.get(key.name).is_some() {
            return Err(syn::Error::new(
                ident.span(),
                format!("`{name}` is set twice"),
            ));
        }
        let v = match key.kind {
            Kind::Int { max } => {
                let v: u64 = int_value(ident, value)?;
                if v > max {
                    return Err(syn::Error::new_spanned(
                        value,
                        format!("`{name}` is out of range: at most {max}"),
                    ));
                }
                Value::Int(v)
            }
            Kind::Flag { bare } => Value::Flag(bool_value(ident, value, bare)?),
            Kind::Strategy => {
                let lit = str_value(ident, value)?;
                let variant = keys::strategy(&lit.value()).ok_or_else(|| {
                    syn::Error::new(
                        lit.span(),
                        format!(
                            "unknown shunt strategy {:?}: expected {}",
                            lit.value(),
                            keys::strategy_names()
                        ),
                    )
                })?;
                Value::Strategy(variant)
            }
            Kind::Compression => {
                let lit = str_value(ident, value)?;
                let variant = keys::compression(&lit.value()).ok_or_else(|| {
                    syn::Error::new(
                        lit.span(),
                        format!(
                            "unknown compression {:?}: expected {}",
                            lit.value(),
                            keys::compression_names()
                        ),
                    )
                })?;
                Value::Compression(variant)
            }
            Kind::Address => {
                let lit = str_value(ident, value)?;
                let address = lit.value();
                if !is_endpoint_address(&address) {
                    return Err(syn::Error::new(
                        lit.span(),
                        format!(
                            "{name} must be `host:port` (or `unix:/path`), for example \
                             \"127.0.0.1:9000\""
                        ),
                    ));
                }
                Value::Str(address)
            }
        };
        self.values.push((key.name, v, ident.span()));
        Ok(())
    }

    /// The `::rpc::__private::GovernanceOverrides { .. }` expression, usable in a `static`: the
    /// fields that are set, then `..GovernanceOverrides::NONE`, so that fields added to the type
    /// later need no change here.
    pub fn to_tokens(&self) -> TokenStream {
        let fields = self.values.iter().map(|(name, value, _)| {
            let field = syn::Ident::new(name, Span::call_site());
            let v = match value {
                // Integers unsuffixed, so that each literal takes the type of its field.
                Value::Int(n) => {
                    let lit = proc_macro2::Literal::u64_unsuffixed(*n);
                    quote!(#lit)
                }
                Value::Flag(b) => quote!(#b),
                Value::Strategy(variant) => {
                    let variant = syn::Ident::new(variant, Span::call_site());
                    quote!(::rpc::__private::ShuntStrategy::#variant)
                }
                Value::Compression(variant) => {
                    let variant = syn::Ident::new(variant, Span::call_site());
                    quote!(::rpc::__private::Compression::#variant)
                }
                Value::Str(s) => quote!(::std::borrow::Cow::Borrowed(#s)),
            };
            quote!(#field: ::core::option::Option::Some(#v),)
        });
        if self.values.is_empty() {
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
                unhealthy_times_allowed_before_removing = 5, idempotent,
                failure_ratio_percent = 50)]
            #[governance(shunt_strategy = "appoint", appoint_address = "127.0.0.1:9")]
        })
        .unwrap();
        for (key, v) in [
            ("timeout_ms", 800),
            ("retry_times", 2),
            ("retry_interval_ms", 10),
            ("exceptions_allowed_before_breaking", 4),
            ("breaker_seconds", 9),
            ("max_concurrent_handling_count", 7),
            ("unhealthy_times_allowed_before_removing", 5),
            ("failure_ratio_percent", 50),
        ] {
            assert_eq!(g.get(key), Some(Value::Int(v)), "{key}");
        }
        assert_eq!(g.get("enable_circuit_breaker"), Some(Value::Flag(false)));
        assert_eq!(g.get("idempotent"), Some(Value::Flag(true)));
        assert_eq!(g.shunt_strategy().map(|s| s.0), Some(Shunt("Appoint")));
        assert_eq!(
            g.get("appoint_address"),
            Some(Value::Str("127.0.0.1:9".into()))
        );
    }

    #[test]
    fn idempotent_can_be_false() {
        let g = parse(quote!(#[governance(idempotent = false)])).unwrap();
        assert_eq!(g.get("idempotent"), Some(Value::Flag(false)));
        assert_eq!(g.get("timeout_ms"), None);
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
            (
                quote!(#[governance(failure_ratio_percent = 101)]),
                "at most 100",
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
                quote!(#[governance(compression = "gzip")]),
                "unknown compression \"gzip\": expected \"off\", \"zstd\" or \"lz4\"",
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
    fn every_option_of_rpc_core_is_a_key_of_its_kind() {
        use rpc::crates::core::{OptionKind, OPTIONS};
        let names: Vec<&str> = keys::KEYS.iter().map(|k| k.name).collect();
        let declared: Vec<&str> = OPTIONS.iter().map(|o| o.name).collect();
        assert_eq!(names, declared);
        for o in OPTIONS {
            let key = syn::Ident::new(o.name, Span::call_site());
            let (ok, want, too_much) = match o.kind {
                OptionKind::Int { max } => {
                    let lit = proc_macro2::Literal::u64_unsuffixed(max);
                    let over = (max < u64::MAX).then(|| {
                        let over = proc_macro2::Literal::u64_unsuffixed(max + 1);
                        quote!(#key = #over)
                    });
                    (quote!(#key = #lit), Value::Int(max), over)
                }
                OptionKind::Bool => (quote!(#key = false), Value::Flag(false), None),
                OptionKind::Str => (
                    quote!(#key = "127.0.0.1:9"),
                    Value::Str("127.0.0.1:9".into()),
                    None,
                ),
                OptionKind::Enum { values } => {
                    for v in values {
                        let g = parse(quote!(#[governance(#key = #v)])).unwrap();
                        let want = match v.parse::<rpc::crates::core::ShuntStrategy>() {
                            Ok(variant) => Value::Strategy(format!("{variant:?}").leak()),
                            Err(_) => {
                                let variant = v.parse::<rpc::crates::core::Compression>().unwrap();
                                Value::Compression(format!("{variant:?}").leak())
                            }
                        };
                        assert_eq!(g.get(o.name), Some(want), "{} = {v}", o.name);
                    }
                    continue;
                }
            };
            let g = parse(quote!(#[governance(#ok)])).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert_eq!(g.get(o.name), Some(want), "{ok}");
            if let Some(too_much) = too_much {
                let e = parse(quote!(#[governance(#too_much)])).unwrap_err();
                assert!(e.to_string().contains("out of range"), "{too_much}: {e}");
            }
        }
    }

    #[test]
    fn an_address_needs_a_host_and_a_port_number() {
        for bad in ["nowhere", ":9000", "host:", "host:port", "host:70000"] {
            let e = parse(quote!(#[governance(appoint_address = #bad)])).unwrap_err();
            assert!(e.to_string().contains("host:port"), "{bad}: {e}");
        }
        for good in ["127.0.0.1:9000", "localhost:1", "[::1]:9000"] {
            assert!(
                parse(quote!(#[governance(appoint_address = #good)])).is_ok(),
                "{good}"
            );
        }
    }

    #[test]
    fn all_errors_are_reported() {
        let err = parse(quote!(#[governance(nope = 1, also_nope = 2)])).unwrap_err();
        assert_eq!(err.into_iter().count(), 2);
    }
}
