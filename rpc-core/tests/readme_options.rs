//! The README's options tables are rendered from `rpc_core::OPTIONS`, the descriptors generated
//! from the options' one declaration: a new or changed option that the README does not show
//! fails here, with the table to paste.

use rpc_core::{OptionDescriptor, OptionKind, OptionSide, OPTIONS};

const README: &str = include_str!("../../README.md");

/// One table: the options `side` applies (`Both` ones in each), grouped by policy in
/// declaration order, the policy named on its first row.
fn render(side: OptionSide) -> String {
    let mut out = String::from("| policy | option | default | meaning |\n|---|---|---|---|\n");
    let mut last_group = None;
    for o in OPTIONS
        .iter()
        .filter(|o| o.side == side || o.side == OptionSide::Both)
    {
        let policy = if last_group == Some(o.group) {
            ""
        } else {
            o.group.title()
        };
        last_group = Some(o.group);
        out.push_str(&format!(
            "| {policy} | `{}` | {} | {} |\n",
            o.name,
            default_cell(o),
            o.meaning
        ));
    }
    out
}

fn default_cell(o: &OptionDescriptor) -> String {
    match o.kind {
        OptionKind::Enum { .. } => format!("`{}`", o.default),
        _ => o.default.to_string(),
    }
}

/// The lines between `<!-- options: {name} -->` and `<!-- end options: {name} -->`.
fn readme_table(name: &str) -> Option<&'static str> {
    let begin = format!("<!-- options: {name} -->\n");
    let end = format!("<!-- end options: {name} -->");
    let start = README.find(&begin)? + begin.len();
    let len = README[start..].find(&end)?;
    Some(&README[start..start + len])
}

fn check(name: &str, side: OptionSide) {
    let want = render(side);
    let got = readme_table(name);
    assert!(
        got == Some(want.as_str()),
        "README.md's {name} options table is not the one the declaration gives; replace the \
         lines between `<!-- options: {name} -->` and `<!-- end options: {name} -->` with:\n\n{want}"
    );
}

#[test]
fn readme_client_options_table_is_the_declared_one() {
    check("client", OptionSide::Client);
}

#[test]
fn readme_server_options_table_is_the_declared_one() {
    check("server", OptionSide::Server);
}

#[test]
fn every_option_is_in_one_of_the_tables_once() {
    let (client, server) = (render(OptionSide::Client), render(OptionSide::Server));
    for o in OPTIONS {
        let cell = format!("| `{}` |", o.name);
        let n = client.matches(&cell).count() + server.matches(&cell).count();
        let want = if o.side == OptionSide::Both { 2 } else { 1 };
        assert_eq!(n, want, "{}", o.name);
    }
}
