//! Log lines for people (feature `logging`, on by default).
//!
//! The framework's spans carry the OpenTelemetry RPC attributes, which make a trace complete but
//! a log line three terminal rows long. [`init`] installs a `tracing` subscriber that prints
//! lines a person reads: the span fields cut to the call's short id, its entry, the attempt and
//! the endpoint, colour and a compact layout on a terminal, plain text otherwise (a file, a
//! pipe, a log collector).
//!
//! Every logged call gets a short id (8 hex digits) that the client sends to the server with
//! the call, so one call's lines carry the same id on both sides:
//!
//! ```text
//! 12:00:01.123 DEBUG rpc.client{3fa9c1d2 shop.Greeter.greet}:rpc.client.attempt{attempt=0 to=127.0.0.1:7001}: ...
//! 12:00:01.124  INFO rpc.server{3fa9c1d2 shop.Greeter.greet}: app: charging the card
//! ```
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! rpc::logging::init()?; // RUST_LOG filters (default: info)
//! # Ok(()) }
//! ```
//!
//! [`layer`] and [`layer_with_writer`] give the same formatting as a layer, to combine with
//! others (the OpenTelemetry layer, for instance), on the registry of the
//! [`tracing_subscriber`] this module re-exports:
//!
//! ```no_run
//! use rpc::logging::tracing_subscriber::layer::SubscriberExt as _;
//! use rpc::logging::tracing_subscriber::util::SubscriberInitExt as _;
//! rpc::logging::tracing_subscriber::registry()
//!     .with(rpc::logging::layer())
//!     .init();
//! ```

use std::fmt::{self, Write as _};
use std::io::IsTerminal;

use tracing::field::Field;
use tracing::Subscriber;
use tracing_subscriber::field::{RecordFields, Visit};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, FormattedFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The subscriber library [`layer`] builds on: its registry, to combine the layer with others.
pub use tracing_subscriber;

/// Why logging could not be installed.
#[derive(Debug)]
pub struct LoggingError(String);

impl fmt::Display for LoggingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LoggingError {}

/// Installs, as the global default, a subscriber printing to standard error with the
/// [`layer`] formatting, filtered by `RUST_LOG` (default `info`; a `RUST_LOG` that does not
/// parse is `info` too, with a warning saying why). Fails when a global subscriber is already
/// set.
pub fn init() -> Result<(), LoggingError> {
    let (filter, problem) = env_filter();
    install(tracing_subscriber::registry().with(filter).with(layer())).map_err(LoggingError)?;
    warn_about(problem);
    Ok(())
}

/// The filter `RUST_LOG` says (default `info`), and what was wrong with `RUST_LOG` when it
/// does not parse (then `info`).
pub(crate) fn env_filter() -> (EnvFilter, Option<String>) {
    match std::env::var(EnvFilter::DEFAULT_ENV) {
        Err(std::env::VarError::NotPresent) => (EnvFilter::new("info"), None),
        Err(e) => (
            EnvFilter::new("info"),
            Some(format!("RUST_LOG is not read ({e}); logging at info")),
        ),
        Ok(directives) => match EnvFilter::try_new(&directives) {
            Ok(filter) => (filter, None),
            Err(e) => (
                EnvFilter::new("info"),
                Some(format!(
                    "RUST_LOG={directives:?} does not parse ({e}); logging at info"
                )),
            ),
        },
    }
}

/// Logs what [`env_filter`] found wrong, once the subscriber that prints it is installed.
pub(crate) fn warn_about(problem: Option<String>) {
    if let Some(problem) = problem {
        tracing::warn!("{problem}");
    }
}

/// Makes `subscriber` the global default, and forwards the `log` crate's records to it when
/// no `log` logger is set yet. Fails, having installed nothing, when a global subscriber is
/// set already; a `log` logger set already only leaves `log` records out (with a warning).
pub(crate) fn install(subscriber: impl Subscriber + Send + Sync) -> Result<(), String> {
    let before = tracing::dispatcher::has_been_set();
    match subscriber.try_init() {
        Ok(()) => Ok(()),
        // `try_init` installs the subscriber, then the `log` bridge: only the bridge failed.
        Err(e) if !before && tracing::dispatcher::has_been_set() => {
            tracing::warn!(error = %e, "log records are not forwarded: a log logger is set already");
            Ok(())
        }
        Err(e) => Err(format!("could not install the tracing subscriber: {e}")),
    }
}

/// The formatting layer of [`init`], printing to standard error: colour and a compact layout
/// when standard error is a terminal, plain lines otherwise.
pub fn layer<S>() -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    layer_with_writer(std::io::stderr, std::io::stderr().is_terminal())
}

/// The formatting layer of [`init`], printing to `writer`; `terminal` chooses colour and the
/// compact layout, otherwise lines are plain.
pub fn layer_with_writer<S, W>(writer: W, terminal: bool) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let layer = tracing_subscriber::fmt::layer()
        .fmt_fields(ShortFields)
        .with_writer(writer)
        .with_ansi(terminal);
    if terminal {
        Box::new(layer.compact())
    } else {
        Box::new(layer)
    }
}

/// Formats fields for people: the OpenTelemetry attributes that only repeat what the entry id
/// says (`rpc.system`, `rpc.service`, `rpc.method`, `otel.*`, the caller's address) are left
/// out, the call id and the entry id are printed bare, and the endpoint as `to=host:port`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ShortFields;

impl<'w> FormatFields<'w> for ShortFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut visitor = ShortVisitor::default();
        fields.record(&mut visitor);
        writer.write_str(&visitor.finish())
    }

    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let mut visitor = ShortVisitor::default();
        fields.record(&mut visitor);
        if let Some(id) = visitor.call_id.take() {
            // Recorded once the span exists, the call id still comes first.
            let rest = std::mem::take(&mut current.fields);
            current.fields = if rest.is_empty() {
                id
            } else {
                format!("{id} {rest}")
            };
        }
        if visitor.out.is_empty() {
            return Ok(());
        }
        // A field glued to the previous one (`server.port` recorded after `server.address`)
        // takes no space.
        if !current.fields.is_empty() && !visitor.glued_start {
            current.fields.push(' ');
        }
        current.fields.push_str(&visitor.out);
        Ok(())
    }
}

#[derive(Default)]
struct ShortVisitor {
    out: String,
    /// The call id, printed first.
    call_id: Option<String>,
    /// The first field written was glued to the previous one ([`Shown::Suffix`]).
    glued_start: bool,
}

/// How a field is printed.
enum Shown {
    Hidden,
    Bare,
    /// Glued to the previous field (`server.port` after `server.address`).
    Suffix(&'static str),
    Named(&'static str),
}

fn shown(name: &str) -> Shown {
    match name {
        "otel.kind"
        | "rpc.system"
        | "rpc.service"
        | "rpc.method"
        | "otel.status_code"
        | "otel.status_description"
        | "client.address"
        | "client.port" => Shown::Hidden,
        "message" | "call_id" | "rpc.entry_id" => Shown::Bare,
        "server.address" => Shown::Named("to"),
        "server.port" => Shown::Suffix(":"),
        "rpc.attempt" => Shown::Named("attempt"),
        "rpc.status_code" => Shown::Named("status"),
        _ => Shown::Named(""),
    }
}

impl ShortVisitor {
    fn finish(self) -> String {
        match self.call_id {
            Some(id) if self.out.is_empty() => id,
            Some(id) => format!("{id} {}", self.out),
            None => self.out,
        }
    }

    fn write(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        if field.name() == "call_id" {
            self.call_id = Some(value.to_string());
            return;
        }
        let sep = |out: &mut String| {
            if !out.is_empty() {
                out.push(' ');
            }
        };
        // Values may come from a peer (an answer's message, a handler's error): control
        // characters are escaped, so that none forges a line or reaches a terminal.
        let _ = match shown(field.name()) {
            Shown::Hidden => Ok(()),
            Shown::Bare => {
                sep(&mut self.out);
                Escaping(&mut self.out).write_fmt(value)
            }
            Shown::Suffix(glue) => {
                if self.out.is_empty() {
                    self.glued_start = true;
                }
                self.out.push_str(glue);
                Escaping(&mut self.out).write_fmt(value)
            }
            Shown::Named(label) => {
                sep(&mut self.out);
                let label = if label.is_empty() {
                    field.name()
                } else {
                    label
                };
                write!(self.out, "{label}=").and_then(|()| Escaping(&mut self.out).write_fmt(value))
            }
        };
    }
}

/// Writes into a line with its control characters escaped (`\n`, `\u{1b}`), the rest as is.
struct Escaping<'a>(&'a mut String);

impl fmt::Write for Escaping<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if !s.chars().any(char::is_control) {
            self.0.push_str(s);
            return Ok(());
        }
        for c in s.chars() {
            if c.is_control() {
                self.0.extend(c.escape_default());
            } else {
                self.0.push(c);
            }
        }
        Ok(())
    }
}

impl Visit for ShortVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.write(field, format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.write(field, format_args!("{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;

    /// The lines a test's subscriber wrote.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// An attempt span records the address and the port one after the other, as the client
    /// does once it knows the endpoint: the line still reads `to=host:port`.
    #[test]
    fn an_endpoint_recorded_in_two_steps_reads_host_colon_port() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::registry()
            .with(super::layer_with_writer(move || writer.clone(), false));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "rpc.client.attempt",
                rpc.attempt = 0,
                server.address = tracing::field::Empty,
                server.port = tracing::field::Empty,
            );
            span.record("server.address", "127.0.0.1");
            span.record("server.port", 7001);
            span.in_scope(|| tracing::info!("sent"));
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("attempt=0 to=127.0.0.1:7001"), "{text}");
    }

    /// A value carrying a line break or a terminal escape (a peer's error message) is written
    /// escaped on the event's one line, in a field and in the message alike.
    #[test]
    fn control_characters_from_values_are_escaped_on_one_line() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::registry()
            .with(super::layer_with_writer(move || writer.clone(), false));
        let forged = "x\n12:00:00 INFO forged\u{1b}[2J";
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(cause = forged, "governance {}", forged);
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.contains('\u{1b}'), "{text}");
        assert_eq!(
            text.matches("x\\n12:00:00 INFO forged\\u{1b}[2J").count(),
            2,
            "{text}"
        );
    }
}
