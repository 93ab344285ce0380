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
    /// The descriptor table, `__RPC_METHODS_<Trait>`.
    pub methods: Ident,
    /// The service id constant, `__RPC_SERVICE_ID_<Trait>`.
    pub service_id: Ident,
}

impl Names {
    /// The names for the trait `trait_ident`.
    pub fn new(trait_ident: &Ident) -> Self {
        // The trait's own spelling, not a case conversion of it: two traits of one module
        // have different names, but `HttpApi` and `HTTPApi` share an upper snake case.
        let name = syn::ext::IdentExt::unraw(trait_ident).to_string();
        let span = trait_ident.span();
        Names {
            trait_ident: trait_ident.clone(),
            client: format_ident!("{}Client", trait_ident, span = span),
            server: format_ident!("{}Server", trait_ident, span = span),
            methods: format_ident!("__RPC_METHODS_{}", name),
            service_id: format_ident!("__RPC_SERVICE_ID_{}", name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use syn::parse_quote;

    #[test]
    fn traits_whose_upper_snake_case_agrees_get_different_hidden_names() {
        let a = Names::new(&parse_quote!(HttpApi));
        let b = Names::new(&parse_quote!(HTTPApi));
        assert_ne!(a.methods, b.methods);
        assert_ne!(a.service_id, b.service_id);
        assert_eq!(a.methods.to_string(), "__RPC_METHODS_HttpApi");
        assert_eq!(b.service_id.to_string(), "__RPC_SERVICE_ID_HTTPApi");
    }

    #[test]
    fn a_raw_identifier_trait_is_named_without_its_prefix() {
        let names = Names::new(&parse_quote!(r#Match));
        assert_eq!(names.methods.to_string(), "__RPC_METHODS_Match");
    }
}
