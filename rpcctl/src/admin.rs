//! `rpcctl status` and `rpcctl events`: a process's admin endpoint (`--admin ADDR`, the
//! address its `admin on <addr>` line printed; `--token T`).
//!
//! `status` shows the breakers, the endpoint health and the options set above their defaults,
//! as tables, or everything as one JSON object with `--json`. `events` follows the governance
//! event stream (server-sent events), one line per event, or one JSON object per line with
//! `--json`, until the process stops, Ctrl-C, or `--count N` events.
//!
//! Exit codes: 2 when `--admin` is missing or the token is refused (the command line is
//! wrong), 1 when the endpoint cannot be reached or answers with an error.

use crate::out::{out, outln};
use std::io::Write;
use std::time::Duration;

use serde_json::Value;

use crate::exit::Failure;

/// Where the admin endpoint is, as the command line says.
pub struct Target<'a> {
    /// `host:port`, or an `http://` URL.
    pub addr: Option<&'a str>,
    /// The endpoint's token, if given.
    pub token: Option<&'a str>,
    /// How long to wait to connect, and for each answer.
    pub timeout: Duration,
}

/// An admin endpoint to talk to.
pub struct Endpoint {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
    timeout: Duration,
}

impl Endpoint {
    /// The endpoint `target` names.
    pub fn new(target: &Target<'_>) -> Result<Self, Failure> {
        let Some(addr) = target.addr.map(str::trim).filter(|a| !a.is_empty()) else {
            return Err(Failure::usage(
                "this command needs a process's admin endpoint: --admin host:port (or \
                 RPCCTL_ADMIN), the address its `admin on <addr>` line printed",
            ));
        };
        let not_an_address = |why: &str| {
            Failure::usage(format!(
                "--admin {addr}: not an address ({why}); give host:port, as the process's \
                 `admin on <addr>` line printed"
            ))
        };
        if addr
            .get(..8)
            .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
        {
            return Err(not_an_address(
                "the admin endpoint speaks plain HTTP: give http:// or no scheme",
            ));
        }
        // A trailing slash is the same address, with or without the scheme.
        let bare = addr.trim_end_matches('/');
        let base = if bare
            .get(..7)
            .is_some_and(|s| s.eq_ignore_ascii_case("http://"))
        {
            bare.to_string()
        } else {
            format!("http://{bare}")
        };
        let url = reqwest::Url::parse(&base).map_err(|e| not_an_address(&e.to_string()))?;
        // The routes are appended to the base: a path, query or fragment (the console's
        // `#token=...` link) would take them all somewhere else.
        if !names_a_port(addr) {
            return Err(not_an_address("no port"));
        }
        if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
            return Err(not_an_address(
                "the endpoint's address only, without a path, query or fragment",
            ));
        }
        if let Some(token) = target.token {
            if let Some(why) = rpc::crates::core::token::unsendable_in_header(token) {
                return Err(Failure::usage(format!(
                    "the admin token (--token or RPCCTL_TOKEN) cannot be sent in a header: \
                     {why} (a line break from the file it was read from?); give it without"
                )));
            }
        }
        let http = reqwest::Client::builder()
            .connect_timeout(target.timeout)
            // Straight to the endpoint, never through a proxy the environment names
            // (HTTP_PROXY, ALL_PROXY): the request carries the token, and the endpoint listens
            // on loopback, where a proxy would reach its own host, not this one.
            .no_proxy()
            .build()
            .map_err(|e| Failure::failed(format!("cannot set up an HTTP client: {e}")))?;
        Ok(Endpoint {
            base,
            token: target.token.map(str::to_string),
            http,
            timeout: target.timeout,
        })
    }

    /// `what` (a request, or reading its answer), given up after the timeout.
    async fn bounded<T>(
        &self,
        path: &str,
        what: impl std::future::Future<Output = Result<T, reqwest::Error>>,
    ) -> Result<T, Failure> {
        match tokio::time::timeout(self.timeout, what).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Failure::failed(format!(
                "cannot reach the admin endpoint at {}: {e}; is the process running with \
                 --admin, on this address?",
                self.base
            ))),
            Err(_) => Err(Failure::failed(format!(
                "the admin endpoint at {} did not answer {path} within {} ms; the process may \
                 be stopped or overloaded (--admin-timeout-ms sets the wait)",
                self.base,
                self.timeout.as_millis()
            ))),
        }
    }

    async fn send(&self, path: &str) -> Result<reqwest::Response, Failure> {
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let response = self.bounded(path, req.send()).await?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = self.bounded(path, response.text()).await?;
        let said = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or(body);
        let message = format!("{}{path} answered {status}: {said}", self.base);
        Err(if status == reqwest::StatusCode::UNAUTHORIZED {
            Failure::usage(message)
        } else {
            Failure::failed(message)
        })
    }

    async fn get_json(&self, path: &str) -> Result<Value, Failure> {
        let response = self.send(path).await?;
        let text = match tokio::time::timeout(self.timeout, response.text()).await {
            Ok(read) => read.map_err(|e| {
                Failure::failed(format!("{}{path}: reading the answer: {e}", self.base))
            })?,
            Err(_) => {
                return Err(Failure::failed(format!(
                    "{}{path}: the answer did not arrive whole within {} ms",
                    self.base,
                    self.timeout.as_millis()
                )))
            }
        };
        serde_json::from_str(&text)
            .map_err(|e| Failure::failed(format!("{}{path}: not JSON ({e}): {text}", self.base)))
    }

    /// Readiness: `ready`, or the endpoint's reason.
    async fn readiness(&self) -> Result<String, Failure> {
        let mut req = self.http.get(format!("{}/readyz", self.base));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let r = self.bounded("/readyz", req.send()).await?;
        let status = r.status();
        let text = self.bounded("/readyz", r.text()).await?;
        match status.as_u16() {
            200 | 503 => Ok(text),
            _ => {
                // The same refusal as every other route: let `send` word it.
                self.send("/readyz").await?;
                Ok(text)
            }
        }
    }
}

/// `rpcctl status`.
pub async fn status(target: &Target<'_>, json: bool) -> Result<(), Failure> {
    let admin = Endpoint::new(target)?;
    let ready = admin.readiness().await?;
    let breakers = admin.get_json("/api/breakers").await?;
    let endpoints = admin.get_json("/api/endpoints").await?;
    let entries = admin.get_json("/api/entries").await?;
    if json {
        let all = serde_json::json!({
            "ready": ready,
            "breakers": breakers["breakers"],
            "endpoints": endpoints["endpoints"],
            "entries": entries["entries"],
        });
        outln!("{all}");
        return Ok(());
    }
    let mut out = String::new();
    out.push_str(&format!("readiness: {ready}\n\nBREAKERS\n"));
    let rows: Vec<Vec<String>> = list(&breakers["breakers"])
        .map(|b| {
            let detail = match b["state"].as_str().unwrap_or("") {
                "closed" => format!("{} failures in a row", b["failures"]),
                "open" => format!("probe in {} ms", b["retry_after_ms"]),
                "half_open" => format!("{} probes in flight", b["probes"]),
                "isolated" => "until reset".to_string(),
                _ => String::new(),
            };
            vec![text(&b["entry"]), text(&b["state"]), detail]
        })
        .collect();
    out.push_str(&table(&["ENTRY", "STATE", "DETAIL"], &rows));
    out.push_str("\nENDPOINTS\n");
    let rows: Vec<Vec<String>> = list(&endpoints["endpoints"])
        .map(|e| {
            let mut state = text(&e["state"]);
            if let Some(ms) = e["retry_in_ms"].as_u64() {
                state = format!("{state} ({ms} ms left)");
            }
            vec![
                text(&e["address"]),
                state,
                text(&e["failures"]),
                text(&e["reason"]),
            ]
        })
        .collect();
    out.push_str(&table(&["ADDRESS", "STATE", "FAILURES", "REASON"], &rows));
    out.push_str("\nOPTIONS (those not at their default)\n");
    let mut rows: Vec<Vec<String>> = Vec::new();
    for e in list(&entries["entries"]) {
        if let Some(options) = e["options"].as_object() {
            for (name, o) in options {
                if o["level"] != "default" {
                    rows.push(vec![
                        text(&e["entry"]),
                        name.clone(),
                        text(&o["value"]),
                        text(&o["level"]),
                    ]);
                }
            }
        }
    }
    out.push_str(&table(&["ENTRY", "OPTION", "VALUE", "LEVEL"], &rows));
    out!("{out}");
    Ok(())
}

/// `rpcctl events`.
pub async fn events(target: &Target<'_>, json: bool, count: Option<usize>) -> Result<(), Failure> {
    let admin = Endpoint::new(target)?;
    let mut stream = admin.send("/api/events/stream").await?;
    // The endpoint subscribed before answering: from here on no event is missed, unless this
    // reader falls more than 1024 events behind; the endpoint then says how many went by.
    eprintln!(
        "rpcctl: following the governance events of {} (Ctrl-C to stop)",
        admin.base
    );
    let mut seen = 0usize;
    if count == Some(0) {
        return Ok(());
    }
    // Bytes, not text, until a whole message is in: a chunk may end inside a character.
    let mut buffer: Vec<u8> = Vec::new();
    let stdout = std::io::stdout();
    let mut reader_gone = reader_gone();
    loop {
        while let Some(message) = next_message(&mut buffer) {
            let data: String = message
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|l| l.strip_prefix(' ').unwrap_or(l))
                .collect::<Vec<_>>()
                .join("\n");
            if data.is_empty() {
                continue; // a keep-alive comment
            }
            if message.lines().any(|l| l.trim_end() == "event: lagged") {
                let missed = serde_json::from_str::<Value>(&data)
                    .ok()
                    .and_then(|v| v["missed"].as_u64())
                    .map_or_else(|| "some".to_string(), |n| n.to_string());
                eprintln!(
                    "rpcctl: {missed} events went by while this reader was behind (the endpoint \
                     keeps the last ones: GET /api/events)"
                );
                continue;
            }
            let line = if json {
                data
            } else {
                match serde_json::from_str::<Value>(&data) {
                    Ok(e) => human(&e),
                    Err(_) => data,
                }
            };
            let mut out = stdout.lock();
            match writeln!(out, "{line}").and_then(|()| out.flush()) {
                Ok(()) => {}
                // A closed pipe (`| head`) ends the command quietly.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                Err(e) => {
                    return Err(Failure::failed(format!(
                        "cannot write to standard output: {e}"
                    )))
                }
            }
            seen += 1;
            if count.is_some_and(|n| seen >= n) {
                return Ok(());
            }
        }
        // The endpoint sends a keep-alive comment every 15 s: a stream silent for longer is
        // a process stopped or a network cut, not a quiet one.
        let next = tokio::time::timeout(SILENCE.max(admin.timeout), stream.chunk());
        let next = tokio::select! {
            next = next => next,
            // Nobody reads the output any more (`| head -1` has its line): done, quietly, as
            // when a write finds the pipe closed; on a quiet process no write may ever come.
            Ok(()) = &mut reader_gone => return Ok(()),
        };
        let chunk = match next {
            Ok(chunk) => chunk,
            Err(_) => {
                return Err(Failure::failed(format!(
                    "the event stream of {} has been silent for {} s, though the endpoint sends \
                     a keep-alive every 15 s: the process may be stopped, or the network cut",
                    admin.base,
                    SILENCE.max(admin.timeout).as_secs()
                )))
            }
        };
        match chunk {
            Ok(Some(chunk)) => buffer.extend_from_slice(&chunk),
            // Followed until the process stopped, as asked: done. With a count not reached,
            // what was asked for did not come.
            Ok(None) if count.is_none() => {
                eprintln!(
                    "rpcctl: {} closed the event stream (the process stopped, or its admin \
                     endpoint did)",
                    admin.base
                );
                return Ok(());
            }
            Ok(None) => {
                return Err(Failure::failed(format!(
                    "{} closed the event stream after {seen} of the {} events asked for (the \
                     process stopped, or its admin endpoint did)",
                    admin.base,
                    count.unwrap_or(0)
                )))
            }
            Err(e) => {
                return Err(Failure::failed(format!(
                    "reading the event stream of {}: {e}",
                    admin.base
                )))
            }
        }
    }
}

/// Whether `addr` (`host:port`, or a URL) names its port (`url::Url::port` leaves out a scheme's
/// default one, as `http://host:80`).
fn names_a_port(addr: &str) -> bool {
    let rest = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    host_port
        .rsplit_once(':')
        .is_some_and(|(_, port)| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
}

/// How long the event stream may stay silent (at least; `--admin-timeout-ms` when longer):
/// twice the endpoint's keep-alive interval.
const SILENCE: Duration = Duration::from_secs(30);

/// The first whole server-sent-events message in `buffer` (up to its blank line), taken out of
/// it as text; `None` while the message is still coming.
fn next_message(buffer: &mut Vec<u8>) -> Option<String> {
    let end = buffer.windows(2).position(|w| w == b"\n\n")?;
    let message: Vec<u8> = buffer.drain(..end + 2).collect();
    Some(String::from_utf8_lossy(&message).into_owned())
}

/// Completes when the read end of standard output's pipe closes (the reader went away),
/// learned while waiting rather than at the next write, as `tail -f` does: a thread polls
/// standard output for nothing but its error and hang-up conditions, which a pipe whose reader
/// left reports at once. On a file, a terminal in use or `/dev/null` the poll never returns (the
/// thread ends with the process); if it fails, the sender is dropped and nothing completes.
fn reader_gone() -> tokio::sync::oneshot::Receiver<()> {
    let (gone, receiver) = tokio::sync::oneshot::channel();
    #[cfg(unix)]
    std::thread::spawn(move || {
        let mut fd = libc::pollfd {
            fd: libc::STDOUT_FILENO,
            events: 0,
            revents: 0,
        };
        loop {
            // SAFETY: `fd` is one valid `pollfd` for the whole call, and the count says one.
            let n = unsafe { libc::poll(&mut fd, 1, -1) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if n > 0 && fd.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                let _ = gone.send(());
            }
            return;
        }
    });
    #[cfg(not(unix))]
    drop(gone);
    receiver
}

/// `text` on one line: its lines (a TOML parser's message spans several) trimmed and joined
/// with ` / `, so one event or one cell is one line of the output, as scripts read it.
fn one_line(text: &str) -> String {
    if !text.contains(['\n', '\r']) {
        return text.to_string();
    }
    text.split(['\n', '\r'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" / ")
}

/// One event as a line for people: `seq side kind entry [endpoint] [attempt N]: cause`.
fn human(e: &Value) -> String {
    let mut line = format!(
        "{} {} {} {}",
        text(&e["seq"]),
        text(&e["side"]),
        text(&e["kind"]),
        text(&e["entry"])
    );
    if let Some(endpoint) = e["endpoint"].as_str() {
        line.push_str(&format!(" {endpoint}"));
    }
    if let Some(attempt) = e["attempt"].as_u64().filter(|a| *a > 0) {
        line.push_str(&format!(" attempt {attempt}"));
    }
    if let Some(version) = e["rule_version"].as_i64() {
        line.push_str(&format!(" version {version}"));
    }
    // A policy in observe mode: what it would have done, not done (read as enforced, a
    // `break` or an `ejection` line would send an operator after a refusal that never was).
    if e["observed"].as_bool() == Some(true) {
        line.push_str(" (observed: not enforced)");
    }
    if let Some(cause) = e["cause"].as_str() {
        line.push_str(&format!(": {}", one_line(cause)));
    }
    line
}

fn list(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

/// A value as a cell: strings without quotes (on one line), null as `-`.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => one_line(s),
        other => other.to_string(),
    }
}

/// Left-aligned columns, two spaces apart; `(none)` under the header when empty.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    if rows.is_empty() {
        out.push_str("(none)\n");
    }
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_port_is_named_in_an_address_or_a_url_even_the_schemes_default() {
        use super::names_a_port;
        for named in [
            "127.0.0.1:9901",
            "127.0.0.1:80",
            "http://h:80",
            "https://admin.example:443/",
            "[::1]:9901",
            "http://u@h:1",
        ] {
            assert!(names_a_port(named), "{named}");
        }
        for unnamed in [
            "127.0.0.1",
            "http://h",
            "https://h/x:1",
            "[::1]",
            "h:",
            "h:x",
        ] {
            assert!(!names_a_port(unnamed), "{unnamed}");
        }
    }

    use super::*;

    #[test]
    fn a_message_whose_chunks_split_a_character_comes_out_whole() {
        let event = "data: {\"cause\": \"délai dépassé\"}\n\n".as_bytes();
        // Cut inside the two bytes of 'é'.
        let cut = event
            .iter()
            .position(|&b| b >= 0x80)
            .expect("a multibyte character")
            + 1;
        let mut buffer = event[..cut].to_vec();
        assert_eq!(next_message(&mut buffer), None, "not whole yet");
        buffer.extend_from_slice(&event[cut..]);
        let message = next_message(&mut buffer).expect("whole now");
        assert_eq!(message.as_bytes(), event);
        assert!(buffer.is_empty());
    }

    #[test]
    fn tables_align_columns_and_say_when_empty() {
        let t = table(
            &["A", "BB"],
            &[
                vec!["long cell".into(), "x".into()],
                vec!["s".into(), "y".into()],
            ],
        );
        assert_eq!(t, "A          BB\nlong cell  x\ns          y\n");
        assert_eq!(table(&["A"], &[]), "A\n(none)\n");
    }

    #[test]
    fn an_event_line_names_side_kind_entry_endpoint_and_cause() {
        let e = serde_json::json!({"seq": 3, "side": "client", "kind": "retry",
            "entry": "a.A.m", "endpoint": "127.0.0.1:1", "attempt": 1, "cause": "full"});
        assert_eq!(
            human(&e),
            "3 client retry a.A.m 127.0.0.1:1 attempt 1: full"
        );
    }

    /// A cause of several lines (a TOML parser's message, in a rule refused) is one line of
    /// the output, and so is a table's cell: scripts read a line as an event or a row.
    #[test]
    fn an_event_or_cell_whose_text_spans_lines_is_one_line() {
        let cause = "governance config: TOML parse error at line 2, column 14\n  |\n2 | \
                     timeout_ms = \"x\"\n  |              ^^^\r\ninvalid type: string \"x\"\n";
        let e = serde_json::json!({"seq": 6, "side": "server", "kind": "rule_rejected",
            "entry": "rules/governance", "cause": cause});
        assert_eq!(
            human(&e),
            "6 server rule_rejected rules/governance: governance config: TOML parse error at \
             line 2, column 14 / | / 2 | timeout_ms = \"x\" / |              ^^^ / invalid \
             type: string \"x\""
        );
        assert_eq!(
            text(&Value::from("not ready:\nstopping")),
            "not ready: / stopping"
        );
    }

    /// An event of a policy in observe mode says it was not enforced, as the console does;
    /// a rules event names its version.
    #[test]
    fn an_event_line_marks_an_observed_event_and_names_a_rules_version() {
        let e = serde_json::json!({"seq": 4, "side": "client", "kind": "break",
            "entry": "a.A.m", "observed": true, "cause": "3 failures"});
        assert_eq!(
            human(&e),
            "4 client break a.A.m (observed: not enforced): 3 failures"
        );
        let e = serde_json::json!({"seq": 5, "side": "server", "kind": "rule_applied",
            "entry": "", "rule_version": 7, "observed": false});
        assert_eq!(human(&e), "5 server rule_applied  version 7");
    }
}
