//! The names of the items generated for one service, shared by the modules that generate them
//! (`expand` for the trait and the descriptor table, `expand_client`, `expand_server`), so that
//! none of them imports from another: `expand` only calls the other two.

use quote::format_ident;
use syn::Ident;

/// Names shared by the generated items of one service.
pub struct Names {
    /// The trait.
    pub trait_ident: Ident,
    /// `<Trait>Client`.
    pub client: Ident,
    /// `<Trait>Server`.
    pub server: Ident,
    /// The descriptor table, `__RPC_METHODS_<TRAIT>`.
    pub methods: Ident,
    /// The service id constant, `__RPC_SERVICE_ID_<TRAIT>`.
    pub service_id: Ident,
}

impl Names {
    /// The names for the trait `trait_ident`.
    pub fn new(trait_ident: &Ident) -> Self {
        let upper = upper_snake(&syn::ext::IdentExt::unraw(trait_ident).to_string());
        let span = trait_ident.span();
        Names {
            trait_ident: trait_ident.clone(),
            client: format_ident!("{}Client", trait_ident, span = span),
            server: format_ident!("{}Server", trait_ident, span = span),
            methods: format_ident!("__RPC_METHODS_{}", upper),
            service_id: format_ident!("__RPC_SERVICE_ID_{}", upper),
        }
    }
}

/// `EchoService` → `ECHO_SERVICE`, `HTTPApi` → `HTTP_API`.
pub fn upper_snake(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::with_capacity(name.len() + 4);
    for (i, &c) in chars.iter().enumerate() {
        if c.is_uppercase() && i > 0 {
            let prev = chars[i - 1];
            let next_lower = chars.get(i + 1).is_some_and(|n| n.is_lowercase());
            if prev.is_lowercase() || prev.is_ascii_digit() || (prev.is_uppercase() && next_lower) {
                out.push('_');
            }
        }
        out.extend(c.to_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_snake_names() {
        assert_eq!(upper_snake("Echo"), "ECHO");
        assert_eq!(upper_snake("EchoService"), "ECHO_SERVICE");
        assert_eq!(upper_snake("HTTPApi"), "HTTP_API");
        assert_eq!(upper_snake("V2Thing"), "V2_THING");
        assert_eq!(upper_snake("snake_case"), "SNAKE_CASE");
    }
}
