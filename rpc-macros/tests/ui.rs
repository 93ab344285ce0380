//! Compile-fail tests of `#[rpc::service]`: each case must fail to compile with an error on the
//! offending tokens. The expected output is in `tests/ui/*.stderr`; regenerate it with
//! `TRYBUILD=overwrite cargo test -p rpc-macros --test ui` and review the diff.

#[test]
fn service_macro_rejects_what_it_cannot_generate() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
