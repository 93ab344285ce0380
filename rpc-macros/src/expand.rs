//! The whole expansion: the rewritten trait, the descriptor table, the client and the server.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ItemTrait, TraitItem};

use crate::names::Names;
use crate::parse::{self, Service, ServiceArgs};
use crate::{expand_client, expand_server};

/// Entry point: `#[service(attr)] item`.
pub fn expand(attr: TokenStream, item: TokenStream) -> TokenStream {
    let trait_item: ItemTrait = match syn::parse2(item.clone()) {
        Ok(t) => t,
        Err(e) => {
            let e = syn::Error::new(e.span(), format!("#[rpc::service] goes on a trait: {e}"))
                .to_compile_error();
            return quote!(#e #item);
        }
    };
    let args = syn::parse2::<ServiceArgs>(attr);
    let service = args.and_then(|args| Service::new(args, trait_item.clone()));
    match service {
        Ok(service) => expand_service(&service),
        Err(e) => {
            // Keep the trait so that the only errors the user sees are ours.
            let trait_item = parse::passthrough(trait_item);
            let e = e.to_compile_error();
            quote!(#e #trait_item)
        }
    }
}

fn expand_service(service: &Service) -> TokenStream {
    let names = Names::new(service.ident());
    let service_id_parts = service_id_parts(service);
    let rewritten = rewrite_trait(service);
    let table = descriptors(service, &names, &service_id_parts);
    let client = expand_client::client(service, &names);
    let server = expand_server::server(service, &names);
    quote! {
        #rewritten
        #table
        #client
        #server
    }
}

/// The arguments of a `concat!` producing the service id.
fn service_id_parts(service: &Service) -> TokenStream {
    match &service.name {
        Some(name) => quote!(#name),
        None => {
            let t = syn::ext::IdentExt::unraw(service.ident()).to_string();
            quote!(::core::module_path!(), ".", #t)
        }
    }
}

/// The trait as implementors see it: `async fn m(..) -> R` becomes
/// `fn m(..) -> impl Future<Output = R> + Send`, and `Send + Sync + 'static` are supertraits.
fn rewrite_trait(service: &Service) -> TokenStream {
    let mut item = service.item.clone();
    parse::strip_helper_attrs(&mut item);
    if item.colon_token.is_none() {
        item.colon_token = Some(Default::default());
    }
    if !item.supertraits.is_empty() && !item.supertraits.trailing_punct() {
        item.supertraits.push_punct(Default::default());
    }
    item.supertraits
        .push(syn::parse_quote!(::core::marker::Send));
    item.supertraits
        .push(syn::parse_quote!(::core::marker::Sync));
    item.supertraits.push(syn::parse_quote!('static));
    for it in &mut item.items {
        let TraitItem::Fn(f) = it else { continue };
        let Some(m) = service.methods.iter().find(|m| m.ident == f.sig.ident) else {
            continue;
        };
        let output = &m.output;
        f.sig.asyncness = None;
        f.sig.output = syn::parse2(quote_spanned! {output.span()=>
            -> impl ::core::future::Future<Output = #output> + ::core::marker::Send
        })
        .unwrap_or_else(|_| f.sig.output.clone());
    }
    quote!(#item)
}

/// The static descriptor table and the service id constant.
fn descriptors(service: &Service, names: &Names, service_id_parts: &TokenStream) -> TokenStream {
    let Names {
        methods: table,
        service_id,
        trait_ident,
        ..
    } = names;
    let n = service.methods.len();
    let entries = service.methods.iter().map(|m| {
        let name = m.name();
        let hash_key = match m.hash_key {
            Some(i) => quote!(::core::option::Option::Some(#i)),
            None => quote!(::core::option::Option::None),
        };
        let governance = m.governance.to_tokens();
        let api = api(m);
        quote! {
            ::rpc::__private::MethodDescriptor {
                service_id: #service_id,
                method: #name,
                entry_id: ::core::concat!(#service_id_parts, ".", #name),
                hash_key: #hash_key,
                governance: #governance,
                api: ::core::option::Option::Some(#api),
            }
        }
    });
    let doc_table = format!("The entry descriptors of [`{trait_ident}`], in declaration order.");
    let doc_id = format!("The service id of [`{trait_ident}`].");
    quote! {
        #[doc = #doc_id]
        #[doc(hidden)]
        #[allow(non_upper_case_globals)]
        const #service_id: &str = ::core::concat!(#service_id_parts);

        #[doc = #doc_table]
        #[doc(hidden)]
        // `..GovernanceOverrides::NONE` stays even when every field is set, so that fields added
        // to the type later need no change in the generator. A deprecated type in a method's
        // signature warns on the trait, where the user can allow it, not here as well.
        #[allow(clippy::needless_update, non_upper_case_globals, deprecated)]
        static #table: [::rpc::__private::MethodDescriptor; #n] = [#(#entries),*];
    }
}

/// The function a descriptor's `api` points to: it builds the entry's `EntryApi` when the
/// server publishes the entry, so nothing of it is computed or stored before then.
///
/// The JSON Schemas come from one generator per entry, through the probes of
/// `rpc::__private` (autoref specialization: a type that implements `JsonSchema` gets its
/// schema, any other `true`). That choice is made where the probe is called, on the type as
/// written there, so it needs concrete types; a service trait's types are (generic traits and
/// methods are rejected), and the function below names them as the trait writes them.
fn api(m: &parse::Method) -> TokenStream {
    let params = m
        .params()
        .map(|a| syn::ext::IdentExt::unraw(&a.ident).to_string());
    let option = |v: Option<TokenStream>| match v {
        Some(v) => quote!(::core::option::Option::Some(#v)),
        None => quote!(::core::option::Option::None),
    };
    let doc = option(m.doc.as_ref().map(|d| quote!(#d)));
    let http = option(m.route.as_ref().map(|r| {
        let (method, path) = (r.method, &r.path);
        quote!((#method, #path))
    }));
    let stream = option(m.stream_shape().map(|s| quote!(#s)));
    let param_schemas = m.params().map(|a| {
        let ty = &a.ty;
        quote!((&&::rpc::__private::Probe::<#ty>::new()).schema(&mut __rpc_gen))
    });
    // A server-streaming method answers a stream of items: its result is one item's schema.
    let result = m.stream_item.as_ref().unwrap_or(&m.ok);
    let err = &m.err;
    quote! {{
        #[allow(clippy::needless_borrow, deprecated)]
        fn __rpc_api() -> ::rpc::__private::EntryApi {
            #[allow(unused_imports)]
            use ::rpc::__private::{
                ErrorIsFramework as _, ErrorViaAnyValue as _, ErrorViaJsonSchema as _,
                SchemaViaAnyValue as _, SchemaViaJsonSchema as _,
            };
            // The parameters as the server reads them, the result and error as it writes
            // them.
            let mut __rpc_gen = ::rpc::__private::schema_generator();
            let mut __rpc_out = ::rpc::__private::output_schema_generator();
            let __rpc_params: ::std::vec::Vec<_> = ::std::vec![#(#param_schemas),*];
            let __rpc_result = (&&::rpc::__private::Probe::<#result>::new()).schema(&mut __rpc_out);
            let __rpc_error =
                (&&&::rpc::__private::ErrorProbe::<#err>::new()).error_schema(&mut __rpc_out);
            let __rpc_schemas = ::rpc::__private::entry_schemas(
                __rpc_gen,
                __rpc_out,
                __rpc_params,
                __rpc_result,
                __rpc_error,
            );
            ::rpc::__private::entry_api(&[#(#params),*], #doc, #http, #stream, __rpc_schemas)
        }
        __rpc_api
    }}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(attr: TokenStream, item: TokenStream) -> String {
        expand(attr, item).to_string()
    }

    fn sample() -> TokenStream {
        quote! {
            /// The echo service.
            pub trait Echo {
                /// Says it back.
                #[governance(timeout_ms = 800, retry_times = 2, idempotent)]
                async fn echo(&self, text: String) -> Result<String, RpcError>;
                #[http(get = "/profiles/{user_id}")]
                async fn profile(&self, #[hash_key] user_id: u64, verbose: bool)
                    -> Result<Profile, MyError>;
                async fn ping(&self) -> Result<(), RpcError>;
            }
        }
    }

    #[test]
    fn expands_the_sample() {
        let out = expand(quote!(name = "echo.Echo"), sample());
        // The output must be valid Rust items.
        let file: syn::File = syn::parse2(out.clone()).unwrap_or_else(|e| panic!("{e}\n{out}"));
        let s = out.to_string();
        assert!(!s.contains("compile_error"), "{s}");
        assert!(!s.contains("governance ("), "helper attribute left: {s}");
        assert!(!s.contains("# [hash_key]"), "helper attribute left: {s}");
        assert!(!s.contains("# [http"), "helper attribute left: {s}");
        assert!(s.contains("# [doc = r\" The echo service.\"]"), "{s}");
        // Each descriptor points to a function building its `EntryApi`.
        assert!(
            s.contains(
                ":: rpc :: __private :: entry_api (& [\"user_id\" , \"verbose\"] , :: core :: \
                 option :: Option :: None , :: core :: option :: Option :: Some ((\"GET\" , \
                 \"/profiles/{user_id}\")) , :: core :: option :: Option :: None , \
                 __rpc_schemas)"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                ":: rpc :: __private :: entry_api (& [\"text\"] , :: core :: option :: Option :: \
                 Some (\"Says it back.\") , :: core :: option :: Option :: None , :: core :: \
                 option :: Option :: None , __rpc_schemas)"
            ),
            "{s}"
        );
        assert!(
            s.contains("api : :: core :: option :: Option :: Some ({"),
            "{s}"
        );
        // Schemas: each parameter, the result and the error through the probes.
        for probe in [
            "(&& :: rpc :: __private :: Probe :: < u64 > :: new ()) . schema (& mut __rpc_gen)",
            "(&& :: rpc :: __private :: Probe :: < bool > :: new ()) . schema",
            "(&& :: rpc :: __private :: Probe :: < Profile > :: new ()) . schema",
            "(&& & :: rpc :: __private :: ErrorProbe :: < MyError > :: new ()) . error_schema",
            "(&& & :: rpc :: __private :: ErrorProbe :: < RpcError > :: new ()) . error_schema",
        ] {
            assert!(s.contains(probe), "{probe}\n{s}");
        }
        assert!(s.contains("# [doc = r\" Says it back.\"]"), "{s}");
        assert!(
            s.contains(
                "fn echo (& self , text : String) -> impl :: core :: future :: Future < Output = \
                 Result < String , RpcError > > + :: core :: marker :: Send ;"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "pub trait Echo : :: core :: marker :: Send + :: core :: marker :: Sync + 'static"
            ),
            "{s}"
        );
        assert!(
            s.contains("const __RPC_SERVICE_ID_Echo : & str = :: core :: concat ! (\"echo.Echo\")"),
            "{s}"
        );
        assert!(
            s.contains(
                "static __RPC_METHODS_Echo : [:: rpc :: __private :: MethodDescriptor ; 3usize]"
            ),
            "{s}"
        );
        assert!(
            s.contains("entry_id : :: core :: concat ! (\"echo.Echo\" , \".\" , \"profile\")"),
            "{s}"
        );
        assert!(
            s.contains("hash_key : :: core :: option :: Option :: Some (0usize)"),
            "{s}"
        );
        assert!(s.contains("pub struct EchoClient"), "{s}");
        assert!(s.contains("pub struct EchoServer"), "{s}");
        assert!(s.contains("impl Echo for EchoClient"), "{s}");
        assert!(s.contains(":: rpc :: Service for EchoServer"), "{s}");
        // Arguments travel as one tuple of references; no args as NoArgs.
        assert!(s.contains("& (& user_id , & verbose ,)"), "{s}");
        assert!(s.contains("& (& text ,)"), "{s}");
        assert!(s.contains("& :: rpc :: __private :: NoArgs"), "{s}");
        assert!(
            s.contains(":: rpc :: __private :: hash_key (& user_id)"),
            "{s}"
        );
        assert!(
            s.contains("< MyError as :: rpc :: __private :: RemoteError > :: from_rpc_error"),
            "{s}"
        );
        assert!(
            s.contains("< MyError as :: rpc :: __private :: RemoteError > :: into_rpc_error"),
            "{s}"
        );
        assert!(s.contains(":: rpc :: __private :: unknown_method"), "{s}");
        // Items: trait, const, static, client struct + 3 impls, server struct + 4 impls.
        assert!(file.items.len() >= 10, "{}", file.items.len());
    }

    #[test]
    fn a_streaming_method_gets_a_stream_proxy_and_a_stream_dispatcher() {
        let out = expand(
            quote!(name = "t.Feed"),
            quote! {
                pub trait Feed {
                    async fn ticks(&self, n: u32) -> Result<RpcStream<Tick>, RpcError>;
                    async fn echo(&self, s: String) -> Result<String, RpcError>;
                }
            },
        );
        syn::parse2::<syn::File>(out.clone()).unwrap_or_else(|e| panic!("{e}\n{out}"));
        let s = out.to_string();
        assert!(!s.contains("compile_error"), "{s}");
        // The proxy opens a stream and decodes its items.
        assert!(s.contains(":: rpc :: Client :: invoke_stream"), "{s}");
        assert!(
            s.contains(":: rpc :: __private :: decode_stream :: < Tick >"),
            "{s}"
        );
        // The dispatcher: the method's shape, its set-up and items, and a refusal of a unary
        // call of it.
        assert!(
            s.contains("0usize => :: rpc :: __private :: StreamMode :: Server"),
            "{s}"
        );
        assert!(s.contains("fn call_stream"), "{s}");
        assert!(s.contains(":: rpc :: __private :: encode_stream"), "{s}");
        assert!(s.contains(":: rpc :: __private :: wrong_shape"), "{s}");
        // The published shape.
        assert!(
            s.contains(
                ":: rpc :: __private :: entry_api (& [\"n\"] , :: core :: option :: Option :: \
                 None , :: core :: option :: Option :: None , :: core :: option :: Option :: \
                 Some (\"server\") , __rpc_schemas)"
            ),
            "{s}"
        );
        // A stream's result schema is one item's.
        assert!(
            s.contains(":: rpc :: __private :: Probe :: < Tick > :: new ()"),
            "{s}"
        );
        // A service without streaming methods keeps the trait's defaults.
        let unary = expand(quote!(name = "echo.Echo"), sample()).to_string();
        assert!(!unary.contains("call_stream"), "{unary}");
    }

    #[test]
    fn default_service_id_uses_the_module_path() {
        let s = expand_str(quote!(), sample());
        assert!(
            s.contains(
                "const __RPC_SERVICE_ID_Echo : & str = :: core :: concat ! (:: core :: \
                 module_path ! () , \".\" , \"Echo\")"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "entry_id : :: core :: concat ! (:: core :: module_path ! () , \".\" , \"Echo\" , \
                 \".\" , \"echo\")"
            ),
            "{s}"
        );
    }

    #[test]
    fn errors_keep_the_trait_without_helper_attributes() {
        let out = expand_str(
            quote!(),
            quote! {
                trait T {
                    #[governance(timeout_ms = 1)]
                    async fn m(&self, #[hash_key] a: u8, #[hash_key] b: u8) -> Result<(), E>;
                }
            },
        );
        assert!(out.contains("compile_error"), "{out}");
        assert!(out.contains("hash_key"), "{out}");
        assert!(out.contains("trait T"), "{out}");
        assert!(!out.contains("# [hash_key]"), "{out}");
        assert!(!out.contains("# [governance"), "{out}");
        assert!(!out.contains("TClient"), "{out}");

        // Patterns become `_` so that rustc does not add its own error about them.
        let out = expand_str(
            quote!(),
            quote!(
                trait T {
                    async fn m(&self, (a, b): (u8, u8), mut c: u8) -> Result<(), E>;
                }
            ),
        );
        assert!(out.contains("plain names"), "{out}");
        assert!(
            out.contains("async fn m (& self , _ : (u8 , u8) , _ : u8) -> Result < () , E > ;"),
            "{out}"
        );
    }

    #[test]
    fn rejects_non_traits() {
        let out = expand_str(
            quote!(),
            quote!(
                struct S;
            ),
        );
        assert!(out.contains("compile_error"), "{out}");
        assert!(out.contains("goes on a trait"), "{out}");
        let out = expand_str(
            quote!(bogus = 1),
            quote!(
                trait T {}
            ),
        );
        assert!(out.contains("unknown #[rpc::service] argument"), "{out}");
    }

    #[test]
    fn keeps_supertraits() {
        let s = expand_str(
            quote!(),
            quote!(
                pub(crate) trait T: Clone {
                    async fn m(&self) -> Result<(), E>;
                }
            ),
        );
        assert!(
            s.contains(
                "pub (crate) trait T : Clone + :: core :: marker :: Send + :: core :: marker :: \
                 Sync + 'static"
            ),
            "{s}"
        );
        assert!(s.contains("pub (crate) struct TClient"), "{s}");
    }

    #[test]
    fn empty_service() {
        let out = expand(
            quote!(name = "e.E"),
            quote!(
                pub trait E {}
            ),
        );
        let s = out.to_string();
        assert!(!s.contains("compile_error"), "{s}");
        assert!(s.contains("MethodDescriptor ; 0usize] = []"), "{s}");
        syn::parse2::<syn::File>(out).unwrap();
    }
}
