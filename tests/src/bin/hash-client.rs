//! A client of `t.Shunt` in a process of its own, for the hash-routing test
//! (`tests/tests/integration/shunting.rs`): the test compares which server answered each key in separate
//! processes, so that stability does not rest on state shared inside one process.
//!
//! ```text
//! hash-client <host:port,host:port,...> <keys>
//! ```
//! Calls `owner("key-<k>")` for k in 0..keys through a static registry of the given addresses
//! and prints one line per key: `key-<k> <name of the server that answered>`.

use std::io::Write;

use rpc::{Client, StaticRegistry};
use tests::shunt::{Shunt, ShuntClient};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: hash-client <host:port,...> <keys>";
    let list = args.next().ok_or(usage)?;
    let keys: u32 = args.next().ok_or(usage)?.parse()?;
    let shunt = ShuntClient::new(
        Client::builder()
            .registry(StaticRegistry::from_list(&list)?)
            .build(),
    );
    let mut out = std::io::stdout().lock();
    for k in 0..keys {
        let key = format!("key-{k}");
        let name = shunt.owner(key.clone()).await?;
        writeln!(out, "{key} {name}")?;
    }
    out.flush()?;
    Ok(())
}
