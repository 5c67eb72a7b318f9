//! What tmsctl prints: sizes, the status table, one-line summaries of what was done, progress
//! in words, and the `--json` documents. Text from elsewhere goes through [`crate::text`] first.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::{json, Value};
use tms_proto::{Backing, ChunkRanges, ChunkStatus, Op, OpDone, Phase, Running};
use tms_units::{format_chunk_ranges, format_ranges};

use crate::failure::Code;
use crate::text::json_line;
pub use crate::text::quoted;
pub use tms_units::human_bytes as human;

/// The tag of NCCL's communicators.
const NCCL_TAG: &str = "nccl";

/// A signed change in bytes, `+1.00 GiB` / `-512.00 MiB` / `0 B`.
pub fn human_delta(from: u64, to: u64) -> String {
    if to >= from {
        if to == from {
            "0 B".into()
        } else {
            format!("+{}", human(to - from))
        }
    } else {
        format!("-{}", human(from - to))
    }
}

/// Version of the shape of what `--json` prints, in every object it prints as `"schema"`. Raised
/// only when a field changes meaning or goes away; new fields come without it.
pub const SCHEMA: u64 = 1;

static JSON_PRINTED: AtomicBool = AtomicBool::new(false);

/// `v` with [`SCHEMA`]: in it if it is an object, else in each object it holds if an array
/// (the arrays stay arrays: readers of the earlier output index them).
pub fn versioned(mut v: Value) -> Value {
    let stamp = |o: &mut Value| {
        if let Value::Object(m) = o {
            m.insert("schema".into(), SCHEMA.into());
        }
    };
    match &mut v {
        Value::Array(items) => items.iter_mut().for_each(stamp),
        o => stamp(o),
    }
    v
}

/// A line on stdout, as `println!` writes it, but a reader that went away (`tmsctl list | head
/// -1`) is no failure of the command, whose outcome its exit code tells: the error is dropped
/// where `println!` would panic. Through [`say!`].
pub fn say_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// A line on stderr, the same way. Through [`tell!`].
pub fn tell_line(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// `println!` that never panics: [`say_line`].
macro_rules! say {
    () => { $crate::output::say_line(format_args!("")) };
    ($($t:tt)*) => { $crate::output::say_line(format_args!($($t)*)) };
}

/// `eprintln!` that never panics: [`tell_line`].
macro_rules! tell {
    ($($t:tt)*) => { $crate::output::tell_line(format_args!($($t)*)) };
}

/// Print `v`, [versioned], as the one JSON line of the command on stdout.
pub fn print_json(v: Value) {
    JSON_PRINTED.store(true, Ordering::Relaxed);
    say!("{}", json_line(&versioned(v)));
}

/// Whether [`print_json`] printed already: a failure after that is told in the document printed
/// (or on stderr only), never as a second document.
pub fn json_printed() -> bool {
    JSON_PRINTED.load(Ordering::Relaxed)
}

/// What `--json` prints for a failure: the `error` member of [`json_error`].
pub fn error_json(code: Code, message: &str) -> Value {
    json!({"exit_code": code as u8, "name": code.name(), "message": message})
}

/// What `--json` prints for a failure, about process `pid` if given (its schema version is
/// added when it is printed, as to every document).
pub fn json_error(code: Code, message: &str, pid: Option<u32>) -> Value {
    let mut j = json!({"error": error_json(code, message)});
    if let Some(p) = pid {
        j["pid"] = json!(p);
    }
    j
}

/// `v` as JSON with the pid of its process (or inside an object with it, if `v` is no object).
pub fn with_pid<T: serde::Serialize>(pid: u32, v: &T) -> Value {
    let mut j = serde_json::to_value(v).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut j {
        m.insert("pid".into(), json!(pid));
        j
    } else {
        json!({"pid": pid, "value": j})
    }
}

/// `bytes` on stdout, as they are (a completion script, a manual page); a reader that went away
/// (`tmsctl man | head`) is no failure.
pub fn write_stdout(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::anyhow!("writing to stdout: {e}"))
        }
        _ => Ok(()),
    }
}

/// A pause or resume in one line; `chunk_state`: it saved (pause) or restored (resume) chunk
/// states.
pub fn done(pid: u32, d: &OpDone, chunk_state: bool) -> String {
    let tag = match &d.tag {
        Some(t) => format!("tag {}", quoted(t)),
        None => "every tag".to_string(),
    };
    let (verb, noun, state) = match d.op {
        Op::Pause => ("paused", "released", " (chunk states saved)"),
        Op::Resume => ("resumed", "re-taken", " (the chunks saved active)"),
    };
    let what = match &d.chunks {
        Some(c) => format!("chunks {} of {tag}", format_chunk_ranges(c)),
        None if chunk_state => format!("{tag}{state}"),
        None => tag,
    };
    if d.allocations == 0 && d.communicators == 0 {
        if d.chunks.is_some() {
            return format!("pid {pid}: {what}: nothing to do (all {verb} already)");
        }
        if d.tag.as_deref() == Some(NCCL_TAG) {
            return format!("pid {pid}: {what}: nothing to do (no communicator to be {verb})");
        }
        return format!("pid {pid}: {what}: nothing to do (no allocation to be {verb})");
    }
    let mut s = if d.chunks.is_some() {
        format!(
            "pid {pid}: {verb} {what}: {} of device memory {noun}",
            human(d.bytes)
        )
    } else {
        let count = |n: u64, one: &str| format!("{n} {one}{}", if n == 1 { "" } else { "s" });
        let units = match (d.allocations, d.communicators) {
            (a, 0) => count(a, "allocation"),
            (0, c) => count(c, "NCCL communicator"),
            (a, c) => format!(
                "{} and {}",
                count(a, "allocation"),
                count(c, "NCCL communicator")
            ),
        };
        format!(
            "pid {pid}: {verb} {what}: {units}, {} of device memory {noun}",
            human(d.bytes)
        )
    };
    s.push_str(&copies(d));
    if d.unchanged_bytes > 0 {
        let _ = write!(s, ", {} unchanged (not copied)", human(d.unchanged_bytes));
    }
    if d.verified_bytes > 0 {
        let _ = write!(s, ", {} verified", human(d.verified_bytes));
    }
    let _ = write!(s, ", in {:.3} s", d.seconds);
    if d.pending_bytes > 0 {
        let _ = write!(
            s,
            "; {} still being restored in the process",
            human(d.pending_bytes)
        );
    }
    s
}

/// Where a pause's or resume's copies went or came from, as words after a comma (`, 2.00 GiB
/// written to disk`); nothing when nothing was copied.
pub fn copies(d: &OpDone) -> String {
    if d.copied_bytes == 0 {
        return String::new();
    }
    let Some(disk) = d.disk_copied_bytes else {
        // An older server does not say where to.
        return format!(
            ", {} {}",
            human(d.copied_bytes),
            moved_words(d.op, None, None)
        );
    };
    let disk = disk.min(d.copied_bytes);
    let host = d.copied_bytes - disk;
    let mut o = String::new();
    for (bytes, kind) in [(host, Backing::Host), (disk, Backing::Disk)] {
        if bytes > 0 {
            let _ = write!(
                o,
                ", {} {}",
                human(bytes),
                moved_words(d.op, Some(kind), None)
            );
        }
    }
    o
}

/// The chunks of a chunked allocation, for people.
pub fn chunks(pid: u32, s: &ChunkStatus) -> String {
    let mut o = format!(
        "pid {pid}: tag {}: allocation {:#x}, {} chunks of {} ({})\n",
        quoted(&s.tag),
        s.addr,
        s.count,
        human(s.chunk_size),
        human(s.count.saturating_mul(s.chunk_size))
    );
    for (name, idx) in [("active", s.active()), ("paused", s.paused())] {
        let _ = write!(
            o,
            "{name}: {} chunk{}, {}",
            idx.len(),
            if idx.len() == 1 { "" } else { "s" },
            human((idx.len() as u64).saturating_mul(s.chunk_size))
        );
        if !idx.is_empty() {
            let _ = write!(o, ": {}", format_ranges(&idx));
        }
        o.push('\n');
    }
    o
}

/// Why a pause or resume of `tag` that process `pid` answered with `unknown_tag` changed
/// nothing, in one line.
pub fn unknown_tag(pid: u32, d: &OpDone, tag: Option<&str>) -> String {
    let verb = match d.op {
        Op::Pause => "paused",
        Op::Resume => "resumed",
    };
    let tag = tag.or(d.tag.as_deref()).unwrap_or("");
    if tag == NCCL_TAG {
        return format!(
            "process {pid}: torch-memory-saver knows no NCCL communicator of it, so nothing was \
             {verb} (preloaded, it sees those the process makes; in torch mode, those the \
             program handed over)"
        );
    }
    format!(
        "process {pid}: no allocation of it ever had tag {}, so nothing was {verb} (a typo? \
         `tmsctl status --pid {pid}` lists its tags)",
        quoted(tag)
    )
}

/// The words for bytes moved by `op` to or from `backing` (else as its phase says).
pub fn moved_words(op: Op, backing: Option<Backing>, phase: Option<Phase>) -> &'static str {
    match (op, backing, phase) {
        (Op::Pause, Some(Backing::Host), _) | (Op::Pause, _, Some(Phase::CopyingToHost)) => {
            "copied to host memory"
        }
        (Op::Pause, Some(Backing::Disk), _) | (Op::Pause, _, Some(Phase::WritingToDisk)) => {
            "written to disk"
        }
        (Op::Pause, Some(Backing::HostAndDisk), _) => "saved to host memory and disk",
        (Op::Pause, _, _) => "saved",
        (Op::Resume, Some(Backing::Host), _) | (Op::Resume, _, Some(Phase::CopyingToDevice)) => {
            "copied from host memory"
        }
        (Op::Resume, Some(Backing::Disk), _) | (Op::Resume, _, Some(Phase::ReadingFromDisk)) => {
            "read from disk"
        }
        (Op::Resume, Some(Backing::HostAndDisk), _) => "restored from host memory and disk",
        (Op::Resume, _, _) => "restored",
    }
}

/// Bytes with one decimal, and their unit: `("12.0", "GiB")`; short, for a line that must fit
/// a terminal's width.
fn short(bytes: u64) -> (String, &'static str) {
    match tms_units::scaled_bytes(bytes) {
        (_, "B") => (bytes.to_string(), "B"),
        (v, unit) => (format!("{v:.1}"), unit),
    }
}

/// `12.0 of 64.0 GiB` (one unit where both have it), else `512.0 MiB of 64.0 GiB`.
fn amounts(done: u64, total: u64) -> String {
    let ((d, du), (t, tu)) = (short(done), short(total));
    if du == tu {
        format!("{d} of {t} {tu}")
    } else {
        format!("{d} {du} of {t} {tu}")
    }
}

/// A duration for people: `33 s`, `12 min`, `1.5 h`.
fn span(s: f64) -> String {
    if s < 90.0 {
        format!("{:.0} s", s.max(0.0))
    } else if s < 90.0 * 60.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// What the operation asked for is, for people: `tag "kv"`, `chunks 8-15 of tag "kv"`.
pub fn what(tag: Option<&str>, chunks: Option<&ChunkRanges>) -> String {
    match (tag, chunks) {
        (Some(t), Some(c)) => format!("chunks {} of tag {}", format_chunk_ranges(c), quoted(t)),
        (Some(t), None) => format!("tag {}", quoted(t)),
        (None, _) => "every tag".to_string(),
    }
}

/// How far `r` has got, in words (`12.0 of 64.0 GiB written to disk, 1.6 GiB/s, about 33 s
/// left`); `rate` in bytes per second, where known.
pub fn state(r: &Running, rate: Option<f64>) -> String {
    let secs = r.seconds;
    let (done, total) = (r.bytes_done.unwrap_or(0), r.bytes_total.unwrap_or(0));
    let words = moved_words(r.op, r.backing, r.phase);
    let copied = || {
        let mut s = format!("{} {words}", amounts(done, total));
        if let Some(v) = rate.filter(|v| *v > 0.0 && v.is_finite()) {
            let (n, unit) = short(v as u64);
            s.push_str(&format!(", {n} {unit}/s"));
            if total > done {
                // Rounded up: "about 0 s left" would read as done.
                let left = ((total - done) as f64 / v).ceil();
                s.push_str(&format!(", about {} left", span(left)));
            }
        }
        s
    };
    match r.phase {
        None => format!("running ({})", span(secs)),
        Some(Phase::Waiting) => {
            format!(
                "waiting for another pause or resume to end ({})",
                span(secs)
            )
        }
        Some(Phase::Preparing) => format!("preparing ({})", span(secs)),
        Some(Phase::Synchronizing) => {
            format!("waiting for the work queued on the device ({})", span(secs))
        }
        Some(Phase::Mapping) if done == 0 => format!("mapping device memory ({})", span(secs)),
        Some(Phase::Releasing) if total > 0 => {
            let (n, unit) = short(total);
            format!("{n} {unit} {words}; giving memory back")
        }
        Some(Phase::Releasing) => format!("giving memory back ({})", span(secs)),
        Some(Phase::Unknown) => format!("{} ({})", copied(), span(secs)),
        Some(_) if total == 0 => format!("running ({})", span(secs)),
        Some(_) => copied(),
    }
}

/// `"pause"` or `"resume"`.
pub fn verb(op: Op) -> &'static str {
    match op {
        Op::Pause => "pause",
        Op::Resume => "resume",
    }
}

/// "the pause of tag \"kv\"", "the resume of chunks 0-3 of tag \"kv\"", ...
pub fn op_words(which: Op, asked: Option<&str>, chunks: Option<&ChunkRanges>) -> String {
    let of = match chunks {
        Some(c) => format!(
            "chunks {} of tag {}",
            format_chunk_ranges(c),
            quoted(asked.unwrap_or_default())
        ),
        None => what(asked, None),
    };
    format!("the {} of {of}", verb(which))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tms_units::parse_bytes;

    #[test]
    fn sizes() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(3 << 30), "3.00 GiB");
        assert_eq!(human_delta(1 << 20, 3 << 20), "+2.00 MiB");
        assert_eq!(human_delta(3 << 20, 1 << 20), "-2.00 MiB");
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert!(parse_bytes("1.5G").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }

    #[test]
    fn chunk_operations_and_states_in_words() {
        let mut d = OpDone {
            op: tms_proto::Op::Pause,
            tag: Some("kv".into()),
            chunks: Some(vec![[8, 15], [20, 20]]),
            allocations: 1,
            bytes: 18 << 20,
            copied_bytes: 18 << 20,
            disk_copied_bytes: Some(0),
            seconds: 0.5,
            unknown_tag: false,
            pending_bytes: 0,
            communicators: 0,
            unchanged_bytes: 0,
            verified_bytes: 0,
        };
        assert_eq!(
            done(7, &d, false),
            "pid 7: paused chunks 8-15,20 of tag \"kv\": 18.00 MiB of device memory released, \
             18.00 MiB copied to host memory, in 0.500 s"
        );
        // Words that match where the bytes went: a file, both, or (an older server) unknown.
        let to_disk = OpDone {
            disk_copied_bytes: Some(18 << 20),
            ..d.clone()
        };
        assert!(done(7, &to_disk, false).ends_with(", 18.00 MiB written to disk, in 0.500 s"));
        let both = OpDone {
            disk_copied_bytes: Some(16 << 20),
            op: tms_proto::Op::Resume,
            ..d.clone()
        };
        assert_eq!(
            copies(&both),
            ", 2.00 MiB copied from host memory, 16.00 MiB read from disk"
        );
        let older = OpDone {
            disk_copied_bytes: None,
            ..d.clone()
        };
        assert!(done(7, &older, false).ends_with(", 18.00 MiB saved, in 0.500 s"));
        d.allocations = 0;
        assert_eq!(
            done(7, &d, false),
            "pid 7: chunks 8-15,20 of tag \"kv\": nothing to do (all paused already)"
        );
        d.chunks = None;
        d.allocations = 2;
        d.op = tms_proto::Op::Resume;
        assert!(done(7, &d, true)
            .starts_with("pid 7: resumed tag \"kv\" (the chunks saved active): 2 allocations"));
        let s = ChunkStatus {
            tag: "kv".into(),
            addr: 0x1000,
            chunk_size: 2 << 20,
            count: 4,
            states: "1001".into(),
        };
        assert_eq!(
            chunks(7, &s),
            "pid 7: tag \"kv\": allocation 0x1000, 4 chunks of 2.00 MiB (8.00 MiB)\n\
             active: 2 chunks, 4.00 MiB: 0,3\n\
             paused: 2 chunks, 4.00 MiB: 1-2\n"
        );
        let all = ChunkStatus {
            states: "1111".into(),
            ..s
        };
        assert!(chunks(7, &all).ends_with("paused: 0 chunks, 0 B\n"));
    }

    #[test]
    fn json_output_carries_the_schema_version() {
        use serde_json::json;
        assert_eq!(
            versioned(json!({"pid": 7})),
            json!({"pid": 7, "schema": SCHEMA})
        );
        assert_eq!(
            versioned(json!([{"pid": 7}, {"pid": 8, "error": {}}])),
            json!([{"pid": 7, "schema": SCHEMA}, {"pid": 8, "error": {}, "schema": SCHEMA}]),
            "an array stays an array"
        );
        assert_eq!(versioned(json!([])), json!([]));
    }

    #[test]
    fn durations_in_words() {
        assert_eq!(span(3000.0), "50 min");
        assert_eq!(span(3.0 * 3600.0), "3.0 h");
    }
}
