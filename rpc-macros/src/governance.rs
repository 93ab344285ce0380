//! `#[governance(...)]` on a method: parsed into the overrides of its entry descriptor.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::punctuated::Punctuated;
use syn::{Attribute, Expr, ExprLit, Lit, Meta, Token};

/// The integer keys `#[governance(...)]` accepts — each a field of `GovernanceOverrides` — with
/// the largest value the field holds. A new option needs a line here and nothing else.
const INTEGERS: &[(&str, u64)] = &[
    ("timeout_ms", u64::MAX),
    ("attempt_timeout_ms", u64::MAX),
    ("retry_times", u32::MAX as u64),
    ("retry_interval_ms", u64::MAX),
    ("exceptions_allowed_before_breaking", u32::MAX as u64),
    ("breaker_seconds", u64::MAX),
    ("half_open_probes", u32::MAX as u64),
    ("failure_ratio_percent", 100),
    ("sampling_window_seconds", u64::MAX),
    ("minimum_throughput", u32::MAX as u64),
    ("retry_budget_percent", u32::MAX as u64),
    ("retry_budget_min_per_second", u32::MAX as u64),
    ("max_concurrent_handling_count", u32::MAX as u64),
    ("unhealthy_times_allowed_before_removing", u32::MAX as u64),
    ("deadline_slack_ms", u64::MAX),
];

/// The flag keys, and whether the bare form (`idempotent`) means `true`.
const FLAGS: &[(&str, bool)] = &[("enable_circuit_breaker", false), ("idempotent", true)];

/// Every key, for error messages.
fn known_keys() -> String {
    let mut keys: Vec<&str> = INTEGERS.iter().map(|(k, _)| *k).collect();
    keys.extend(FLAGS.iter().map(|(k, _)| *k));
    keys.extend(["shunt_strategy", "appoint_address"]);
    keys.join(", ")
}

/// The value of an integer or flag key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    Int(u64),
    Flag(bool),
}

/// A shunt strategy named in the attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shunt {
    RoundRobin,
    Random,
    Hash,
    Appoint,
}

impl Shunt {
    fn parse(s: &str) -> Option<Self> {
        // The same spellings as `ShuntStrategy::from_str` in rpc-core.
        match s {
            "polling" | "round_robin" | "round-robin" => Some(Shunt::RoundRobin),
            "random" => Some(Shunt::Random),
            "hash" | "hash_algorithm" => Some(Shunt::Hash),
            "appoint" => Some(Shunt::Appoint),
            _ => None,
        }
    }

    fn variant(self) -> TokenStream {
        match self {
            Shunt::RoundRobin => quote!(RoundRobin),
            Shunt::Random => quote!(Random),
            Shunt::Hash => quote!(Hash),
            Shunt::Appoint => quote!(Appoint),
        }
    }
}

/// What the `#[governance(...)]` attributes of one method set; `None` leaves the value to the
/// other configuration layers.
#[derive(Debug, Clone, Default)]
pub struct Governance {
    /// The integer and flag keys set, in the order written.
    values: Vec<(&'static str, Value)>,
    pub shunt_strategy: Option<(Shunt, Span)>,
    pub appoint_address: Option<String>,
}

/// True for `#[governance(...)]`.
pub fn is_governance(attr: &Attribute) -> bool {
    attr.path().is_ident("governance")
}

impl Governance {
    /// The value set for an integer or flag key.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.values.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
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
        let Some(key) = path.get_ident() else {
            return Err(syn::Error::new_spanned(
                path,
                format!("unknown governance key; expected one of: {}", known_keys()),
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
        if let Some(&(field, max)) = INTEGERS.iter().find(|(k, _)| *k == name) {
            if self.get(field).is_some() {
                return Err(dup());
            }
            let v: u64 = int_value(key, value)?;
            if v > max {
                return Err(syn::Error::new_spanned(
                    value,
                    format!("`{name}` is out of range: at most {max}"),
                ));
            }
            self.values.push((field, Value::Int(v)));
            return Ok(());
        }
        if let Some(&(field, bare)) = FLAGS.iter().find(|(k, _)| *k == name) {
            if self.get(field).is_some() {
                return Err(dup());
            }
            self.values
                .push((field, Value::Flag(bool_value(key, value, bare)?)));
            return Ok(());
        }
        match name.as_str() {
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
                    format!(
                        "unknown governance key `{name}`; expected one of: {}",
                        known_keys()
                    ),
                ))
            }
        }
        Ok(())
    }

    /// The `::rpc::__private::GovernanceOverrides { .. }` expression, usable in a `static`: the
    /// fields that are set, then `..GovernanceOverrides::NONE`, so that fields added to the type
    /// later need no change here.
    pub fn to_tokens(&self) -> TokenStream {
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
        for (name, value) in &self.values {
            let field = syn::Ident::new(name, Span::call_site());
            // Integers unsuffixed, so that each literal takes the type of its field.
            let v = match value {
                Value::Int(n) => {
                    let lit = proc_macro2::Literal::u64_unsuffixed(*n);
                    quote!(#lit)
                }
                Value::Flag(b) => quote!(#b),
            };
            fields.push(quote!(#field: ::core::option::Option::Some(#v),));
        }
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
                unhealthy_times_allowed_before_removing = 5, idempotent,
                failure_ratio_percent = 50)]
            #[governance(shunt_strategy = "hash", appoint_address = "127.0.0.1:9")]
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
        assert_eq!(g.shunt_strategy.map(|s| s.0), Some(Shunt::Hash));
        assert_eq!(g.appoint_address.as_deref(), Some("127.0.0.1:9"));
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
