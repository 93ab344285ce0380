//! `rpcctl rules get|set|diff|history|rollback`: the governance and routing documents in etcd.
//!
//! Nothing is written that the store has not validated: `set` and `rollback` go through the
//! rule store, which checks the document (the same parser every process applies it with) and
//! writes it only over the version it read.

use crate::out::{out, outln};
use clap::Subcommand;
use rpc::{EtcdRegistry, RuleError, RuleKind, RuleStore};

use crate::exit::Failure;

/// The `rules` subcommands.
#[derive(Subcommand, Debug)]
pub enum RulesCommand {
    /// Prints the document in force and its version.
    Get {
        /// governance or routing.
        kind: String,
    },
    /// Validates FILE and writes it as the new version (exit 1, nothing written, if invalid).
    Set {
        /// governance or routing.
        kind: String,
        /// The TOML document.
        file: String,
        /// Write only over this version (0: only when none is in force), as `get` printed
        /// it: exit 1 and nothing written when another is in force by then. Without it, over
        /// the version in force when the command runs.
        #[arg(long, value_name = "VERSION", value_parser = clap::value_parser!(i64).range(0..))]
        expected: Option<i64>,
    },
    /// Shows the line diff between the document in force and FILE.
    Diff {
        /// governance or routing.
        kind: String,
        /// The TOML document.
        file: String,
    },
    /// Lists the versions the history keeps.
    History {
        /// governance or routing.
        kind: String,
    },
    /// Writes an earlier version's text again, as a new version.
    Rollback {
        /// governance or routing.
        kind: String,
        /// The version to bring back (see `history`).
        version: i64,
        /// Write only over this version, as for `set`.
        #[arg(long, value_name = "VERSION", value_parser = clap::value_parser!(i64).range(0..))]
        expected: Option<i64>,
    },
}

/// Runs a `rules` subcommand against the etcd of `registry` (`etcd://host:port`).
pub async fn run(registry: Option<&str>, json: bool, command: RulesCommand) -> Result<(), Failure> {
    let url = registry
        .ok_or_else(|| Failure::usage("rules live in etcd: give --registry etcd://host:port"))?;
    if !EtcdRegistry::is_etcd_url(url) {
        return Err(Failure::usage(format!(
            "rules live in etcd: --registry must be etcd://host:port, not {url:?}"
        )));
    }
    let store = EtcdRegistry::from_url(url)
        .await
        .map_err(|e| Failure::usage(e.to_string()))?
        .rules();
    match command {
        RulesCommand::Get { kind } => get(&store, kind_of(&kind)?, json).await,
        RulesCommand::Set {
            kind,
            file,
            expected,
        } => {
            let kind = kind_of(&kind)?;
            let text = read(&file)?;
            let version = match expected {
                Some(expected) => store.set(kind, &text, expected).await,
                None => store.put(kind, &text).await,
            }
            .map_err(failure)?;
            print_version(json, kind, version, "written");
            Ok(())
        }
        RulesCommand::Diff { kind, file } => {
            let kind = kind_of(&kind)?;
            let text = read(&file)?;
            let now = store.get(kind).await.map_err(failure)?;
            let old = now.as_ref().map_or("", |v| &*v.text);
            let lines = diff(old, &text);
            if json {
                let out = serde_json::json!({
                    "kind": kind.as_str(),
                    "version": now.as_ref().map_or(0, |v| v.version),
                    "diff": lines,
                });
                outln!("{out}");
            } else {
                match &now {
                    Some(v) => outln!("--- {kind} version {}\n+++ {file}", v.version),
                    None => outln!("--- {kind} (none in force)\n+++ {file}"),
                }
                for l in &lines {
                    outln!("{l}");
                }
            }
            Ok(())
        }
        RulesCommand::History { kind } => {
            let kind = kind_of(&kind)?;
            let history = store.history(kind).await.map_err(failure)?;
            if json {
                let out: Vec<_> = history
                    .iter()
                    .map(|v| {
                        serde_json::json!({
                            "version": v.version,
                            "text": &*v.text,
                            "unreadable": v.unreadable.as_deref(),
                        })
                    })
                    .collect();
                outln!("{}", serde_json::Value::Array(out));
            } else {
                outln!("{:>10}  first line", "version");
                for v in &history {
                    let first = match &v.unreadable {
                        Some(_) => "(unreadable: not UTF-8)",
                        None => v.text.lines().next().unwrap_or(""),
                    };
                    outln!("{:>10}  {first}", v.version);
                }
            }
            Ok(())
        }
        RulesCommand::Rollback {
            kind,
            version,
            expected,
        } => {
            let kind = kind_of(&kind)?;
            let new = store
                .rollback_over(kind, version, expected)
                .await
                .map_err(failure)?;
            print_version(
                json,
                kind,
                new,
                &format!("rolled back to version {version}'s text"),
            );
            Ok(())
        }
    }
}

fn kind_of(kind: &str) -> Result<RuleKind, Failure> {
    kind.parse()
        .map_err(|e: RuleError| Failure::usage(e.to_string()))
}

/// The document in `file`: one that cannot be read is the command line's fault (exit 2), one
/// that is not UTF-8 an invalid document (exit 1), as the admin endpoint and the store take it.
fn read(file: &str) -> Result<String, Failure> {
    let bytes =
        std::fs::read(file).map_err(|e| Failure::usage(format!("cannot read {file}: {e}")))?;
    String::from_utf8(bytes).map_err(|e| {
        Failure::failed(format!(
            "{file} is no rules document: it is not UTF-8 (byte {}), as a TOML document must \
             be; nothing was written",
            e.utf8_error().valid_up_to() + 1
        ))
    })
}

fn failure(e: RuleError) -> Failure {
    match e {
        RuleError::UnknownKind(_) => Failure::usage(e.to_string()),
        _ => Failure::failed(e.to_string()),
    }
}

fn print_version(json: bool, kind: RuleKind, version: i64, what: &str) {
    if json {
        outln!(
            "{}",
            serde_json::json!({ "kind": kind.as_str(), "version": version })
        );
    } else {
        outln!("{kind} rules {what}: version {version}");
    }
}

async fn get(store: &RuleStore, kind: RuleKind, json: bool) -> Result<(), Failure> {
    let now = store.get(kind).await.map_err(failure)?;
    match (now, json) {
        (Some(v), true) => outln!(
            "{}",
            serde_json::json!({
                "kind": kind.as_str(),
                "version": v.version,
                "text": &*v.text,
                "unreadable": v.unreadable.as_deref(),
            })
        ),
        // Version 0 for none, as the admin endpoint answers and `--expected` takes it.
        (None, true) => outln!(
            "{}",
            serde_json::json!({ "kind": kind.as_str(), "version": 0, "text": "", "unreadable": null })
        ),
        (Some(v), false) => {
            if let Some(why) = &v.unreadable {
                eprintln!("rpcctl: version {} is no document: {why}", v.version);
            }
            outln!("# {kind} rules, version {}", v.version);
            out!("{}", v.text);
            if !v.text.ends_with('\n') {
                outln!();
            }
        }
        (None, false) => outln!("# no {kind} rules in force"),
    }
    Ok(())
}

/// The line diff from `old` to `new` (Myers' algorithm, in memory linear in the documents):
/// unchanged lines start with a space, removed ones with `-`, added ones with `+`, removals
/// before additions as `diff -u` shows them.
fn diff(old: &str, new: &str) -> Vec<String> {
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    similar::capture_diff_slices(similar::Algorithm::Myers, &a, &b)
        .into_iter()
        .flat_map(|op| {
            op.iter_changes(&a, &b).map(|change| {
                let mark = match change.tag() {
                    similar::ChangeTag::Equal => ' ',
                    similar::ChangeTag::Delete => '-',
                    similar::ChangeTag::Insert => '+',
                };
                format!("{mark}{}", change.value())
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::diff;

    #[test]
    fn the_diff_keeps_common_lines_and_marks_the_others() {
        assert_eq!(
            diff("a\nb\nc\n", "a\nx\nc\nd\n"),
            vec![" a", "-b", "+x", " c", "+d"]
        );
        assert_eq!(diff("", "a\n"), vec!["+a"]);
    }

    #[test]
    fn documents_of_tens_of_thousands_of_lines_diff_in_little_memory() {
        // A table of every line pair would be 20 001² words: 3.2 GB.
        let old: String = (0..20_000).map(|i| format!("k{i} = {i}\n")).collect();
        let new = old.replace("k7 = 7\n", "k7 = 8\n") + "added = 1\n";
        let lines = diff(&old, &new);
        assert_eq!(lines.len(), 20_002);
        let changed: Vec<&String> = lines.iter().filter(|l| !l.starts_with(' ')).collect();
        assert_eq!(changed, ["-k7 = 7", "+k7 = 8", "+added = 1"]);
    }
}
