//! Log lines on stderr, as `TMS_LOG` (a filter) and `TMS_LOG_FORMAT` (`text` or `json`) ask.
//!
//! Every line names the process it comes from: its pid, read when the line is written (a fork
//! child's lines carry its own pid, not the parent's it was started from), and the device its
//! pauseable memory lives on when that is a single one ([`Engine::sole_device`]). Eight ranks
//! logging into one stream can then be told apart, even when each sees its GPU as device 0.
//!
//! [`Engine::sole_device`]: crate::engine::Engine::sole_device

use std::fmt;
use std::io::Write;

use serde_json::Value;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Write `line` to stderr, losing it where stderr cannot be written: `eprintln!` panics there
/// (a full disk, a closed pipe where SIGPIPE is ignored), and the library must not fail a call,
/// nor end the process, for a message it could not print.
pub fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The shape of the lines (`TMS_LOG_FORMAT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// `2026-01-02T03:04:05.678901Z  INFO pid=4242 device=0: message key=value` (the default).
    Text,
    /// One JSON object a line: `timestamp`, `level`, `pid`, `device` (null where not known),
    /// `target`, `message`, `fields` (the event's other fields) and, inside spans, `spans`.
    Json,
}

impl LogFormat {
    /// `text` or `json` (surrounding white space ignored; empty means `text`).
    pub fn parse(s: &str) -> Option<LogFormat> {
        match s.trim() {
            "" | "text" => Some(LogFormat::Text),
            "json" => Some(LogFormat::Json),
            _ => None,
        }
    }
}

/// `TMS_LOG_FORMAT`; a value that is not one says so in one line, and the lines stay text.
pub fn format_from_env() -> LogFormat {
    match std::env::var("TMS_LOG_FORMAT") {
        Err(std::env::VarError::NotPresent) => LogFormat::Text,
        Err(std::env::VarError::NotUnicode(_)) => {
            say(
                "torch-memory-saver: environment variable TMS_LOG_FORMAT is not valid UTF-8; \
                 logging stays text",
            );
            LogFormat::Text
        }
        Ok(v) => LogFormat::parse(&v).unwrap_or_else(|| {
            say(&format!(
                "torch-memory-saver: environment variable TMS_LOG_FORMAT: {v:?} is not a log \
                 format (expected text or json); logging stays text"
            ));
            LogFormat::Text
        }),
    }
}

/// The device each line names: given by the runtime (this module knows no runtime, which
/// starts logging); none until then.
static DEVICE_OF: std::sync::OnceLock<fn() -> Option<i32>> = std::sync::OnceLock::new();

/// Log to stderr as `TMS_LOG` asks, in the shape `TMS_LOG_FORMAT` asks; nothing when `TMS_LOG`
/// is unset (`TMS_LOG_FORMAT` is then not read either: it cannot matter). `device_of` tells
/// the device a line comes from, where the process has one (cheap and lock-free: a line may be
/// written with any lock of the engine held).
pub fn init(device_of: fn() -> Option<i32>) {
    let _ = DEVICE_OF.set(device_of);
    let filter = match std::env::var("TMS_LOG") {
        Ok(f) => f,
        Err(std::env::VarError::NotPresent) => return,
        Err(std::env::VarError::NotUnicode(_)) => {
            say("torch-memory-saver: environment variable TMS_LOG is not valid UTF-8; logging stays off");
            return;
        }
    };
    match tracing_subscriber::EnvFilter::builder().parse(&filter) {
        Ok(f) => {
            let builder = tracing_subscriber::fmt()
                .with_env_filter(f)
                .with_writer(std::io::stderr);
            // Another subscriber already set (a tool that set its own) is left in place.
            let _ = match format_from_env() {
                LogFormat::Text => builder.event_format(TextLine).try_init(),
                LogFormat::Json => builder
                    .fmt_fields(JsonFields::new())
                    .event_format(JsonLine)
                    .try_init(),
            };
        }
        // Said in one line naming the variable, as for every TMS_* setting.
        Err(e) => say(&format!(
            "torch-memory-saver: environment variable TMS_LOG: {filter:?} is not a log filter ({e}); logging stays off"
        )),
    }
}

/// The process a line comes from, as it is when the line is written.
struct Origin {
    pid: u32,
    device: Option<i32>,
}

fn origin() -> Origin {
    Origin {
        // Not cached: getpid after a fork is the child's.
        pid: std::process::id(),
        // None while the runtime is being created, and in a fork child (the library is off).
        device: DEVICE_OF.get().and_then(|f| f()),
    }
}

/// The text lines.
struct TextLine;

impl<S, N> FormatEvent<S, N> for TextLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let o = origin();
        SystemTime.format_time(&mut w)?;
        write!(w, " {:>5} pid={}", event.metadata().level(), o.pid)?;
        if let Some(d) = o.device {
            write!(w, " device={d}")?;
        }
        w.write_char(':')?;
        for span in ctx.event_scope().into_iter().flat_map(|s| s.from_root()) {
            write!(w, " {}", span.name())?;
            if let Some(f) = span.extensions().get::<FormattedFields<N>>() {
                if !f.is_empty() {
                    write!(w, "{{{f}}}")?;
                }
            }
            w.write_char(':')?;
        }
        w.write_char(' ')?;
        ctx.format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// The JSON lines (the fields, of events and spans, recorded by [`JsonFields`]).
struct JsonLine;

/// Fields [`JsonFields`] wrote, back as an object (an empty one should they not parse).
fn fields_object(json: &str) -> serde_json::Map<String, Value> {
    match serde_json::from_str(json) {
        Ok(Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    }
}

impl<S> FormatEvent<S, JsonFields> for JsonLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let o = origin();
        let meta = event.metadata();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let mut recorded = String::new();
        ctx.format_fields(Writer::new(&mut recorded), event)?;
        let mut fields = fields_object(&recorded);
        let message = match fields.remove("message") {
            Some(m) => m,
            None => Value::from(""),
        };
        // Written key by key so that every line has them in this order (a map would sort them).
        write!(
            w,
            "{{\"timestamp\":{},\"level\":{},\"pid\":{},\"device\":{},\"target\":{},\"message\":{},\"fields\":{}",
            Value::from(timestamp),
            Value::from(meta.level().as_str()),
            o.pid,
            o.device.map_or(Value::Null, Value::from),
            Value::from(meta.target()),
            message,
            Value::Object(fields),
        )?;
        let spans: Vec<Value> = ctx
            .event_scope()
            .into_iter()
            .flat_map(|s| s.from_root())
            .map(|span| {
                let mut m = span
                    .extensions()
                    .get::<FormattedFields<JsonFields>>()
                    .map(|f| fields_object(&f.fields))
                    .unwrap_or_default();
                m.insert("name".into(), Value::from(span.name()));
                Value::Object(m)
            })
            .collect();
        if !spans.is_empty() {
            write!(w, ",\"spans\":{}", Value::Array(spans))?;
        }
        writeln!(w, "}}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[test]
    fn formats_are_text_and_json() {
        assert_eq!(LogFormat::parse(""), Some(LogFormat::Text));
        assert_eq!(LogFormat::parse("text"), Some(LogFormat::Text));
        assert_eq!(LogFormat::parse(" json\n"), Some(LogFormat::Json));
        assert_eq!(LogFormat::parse("JSON!"), None);
        assert_eq!(LogFormat::parse("pretty"), None);
    }

    /// Lines written to memory.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    fn log_some(format: LogFormat) -> String {
        let out = Captured::default();
        let w = out.clone();
        let builder = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || w.clone());
        let emit = || {
            tracing::info!("plain {}", 1);
            let span = tracing::info_span!("pause", tag = "kv");
            let _in = span.enter();
            tracing::warn!(bytes = 42u64, "with \"fields\"");
        };
        match format {
            LogFormat::Text => {
                tracing::subscriber::with_default(builder.event_format(TextLine).finish(), emit)
            }
            LogFormat::Json => tracing::subscriber::with_default(
                builder
                    .fmt_fields(JsonFields::new())
                    .event_format(JsonLine)
                    .finish(),
                emit,
            ),
        }
        out.text()
    }

    #[test]
    fn text_lines_carry_the_pid() {
        let text = log_some(LogFormat::Text);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let pid = format!(" pid={}", std::process::id());
        assert!(
            lines[0].contains(&format!("  INFO{pid}: plain 1")),
            "{text}"
        );
        assert!(
            lines[1].contains(&format!(
                "  WARN{pid}: pause{{tag=\"kv\"}}: with \"fields\" bytes=42"
            )),
            "{text}"
        );
    }

    #[test]
    fn a_fork_child_logs_its_own_pid() {
        use nix::sys::wait::{waitpid, WaitStatus};
        use nix::unistd::{fork, ForkResult};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("open the log");
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_writer(Arc::new(file))
            .event_format(TextLine)
            .finish();
        let parent = std::process::id();
        let child = tracing::subscriber::with_default(subscriber, || {
            let line = |who: &str| tracing::info!("from the {who}");
            // Registers the call site before the fork, so the child takes no lock another
            // thread of the test could have held.
            line("parent");
            // SAFETY: the child writes one line through this thread's subscriber, then _exits.
            match unsafe { fork() }.expect("fork") {
                ForkResult::Child => {
                    line("child");
                    // SAFETY: ends the child at once, running nothing of the parent's.
                    unsafe { libc::_exit(0) }
                }
                ForkResult::Parent { child } => {
                    let st = waitpid(child, None).expect("waitpid");
                    assert_eq!(st, WaitStatus::Exited(child, 0));
                    child.as_raw() as u32
                }
            }
        });
        let text = std::fs::read_to_string(&path).expect("read the log");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].ends_with(&format!(" pid={parent}: from the parent")),
            "{text}"
        );
        assert!(
            lines[1].ends_with(&format!(" pid={child}: from the child")),
            "{text}"
        );
    }

    #[test]
    fn json_lines_are_objects_with_the_pid() {
        let text = log_some(LogFormat::Json);
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        let pid = Value::from(std::process::id());
        assert_eq!(lines[0]["pid"], pid);
        assert_eq!(lines[0]["level"], "INFO");
        assert_eq!(lines[0]["message"], "plain 1");
        assert_eq!(lines[0]["fields"], serde_json::json!({}));
        assert_eq!(lines[0]["device"], Value::Null);
        assert!(lines[0]["target"].as_str().unwrap().starts_with("tms::"));
        assert!(lines[0]["timestamp"].as_str().unwrap().ends_with('Z'));
        assert!(lines[0].get("spans").is_none(), "{text}");
        assert_eq!(lines[1]["level"], "WARN");
        assert_eq!(lines[1]["message"], "with \"fields\"");
        assert_eq!(lines[1]["fields"], serde_json::json!({"bytes": 42}));
        assert_eq!(
            lines[1]["spans"],
            serde_json::json!([{"name": "pause", "tag": "kv"}])
        );
        assert!(text.starts_with("{\"timestamp\":"), "{text}");
    }
}
