//! What tmsctl prints: sizes, the status table, one-line summaries of what was done, progress
//! in words, and the `--json` documents. Text from elsewhere goes through [`crate::text`] first.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::{json, Value};
use tms_proto::{
    Backing, ChunkRanges, ChunkStatus, NcclStatus, Op, OpDone, OpTiming, Phase, RegionInfo,
    Running, Status,
};
use tms_units::{format_chunk_ranges, format_ranges};

use crate::failure::Code;
use crate::text::json_line;
// The demo names these here.
pub use crate::text::{printable, quoted};
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

/// Print `v`, [versioned], as the one JSON line of the command on stdout.
pub fn print_json(v: Value) {
    JSON_PRINTED.store(true, Ordering::Relaxed);
    println!("{}", json_line(&versioned(v)));
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

/// `bytes` on stdout, as they are (a completion script, a manual page).
pub fn write_stdout(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::anyhow!("writing to stdout: {e}"))
}

/// A region in words.
pub fn region(r: &RegionInfo) -> String {
    let backup = match (r.cpu_backup, r.disk_backup) {
        (true, false) => format!("CPU backup ({})", r.backend.as_str()),
        (false, true) => "disk backup".to_string(),
        // Only a server without the check on both (an older one) reports this.
        (true, true) => format!("CPU backup ({}) and disk backup", r.backend.as_str()),
        (false, false) => "no backup".to_string(),
    };
    if r.enabled {
        format!("pauseable, tag {}, {backup}", quoted(&r.tag))
    } else {
        format!(
            "not pauseable (tag {}, {backup} when enabled)",
            quoted(&r.tag)
        )
    }
}

fn timing(t: &Option<OpTiming>) -> String {
    match t {
        Some(t) => format!("{:.3} s {:.1} GiB/s", t.seconds, t.gib_per_s),
        None => "-".into(),
    }
}

/// `status` for people.
pub fn status(s: &Status, command: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "pid {} ({command}), backend {}, retain CPU backup {}, memory margin {}",
        s.pid,
        printable(&s.backend),
        if s.retain_cpu_backup { "on" } else { "off" },
        human(s.memory_margin_bytes)
    );
    for d in &s.devices {
        match &d.error {
            None => {
                let _ = writeln!(
                    o,
                    "device {}: {} free of {}",
                    d.device,
                    human(d.free_bytes),
                    human(d.total_bytes)
                );
            }
            Some(e) => {
                let _ = writeln!(o, "device {}: memory unknown: {}", d.device, printable(e));
            }
        }
    }
    if let Some(r) = &s.default_region {
        let _ = writeln!(o, "default region: {}", region(r));
    }
    for r in &s.operations {
        let what = what(r.tag.as_deref(), r.chunks.as_ref());
        let _ = write!(o, "in progress: {} of {what}", verb(r.op));
        if r.in_process {
            let _ = write!(o, " (started in the process), {:.1} s ago", r.seconds);
        } else {
            let _ = write!(o, ", asked {:.1} s ago", r.seconds);
        }
        if r.phase.is_some() {
            let rate = r.gib_per_s.map(|g| g * (1u64 << 30) as f64);
            let _ = write!(o, ": {}", state(r, rate));
        }
        o.push('\n');
    }
    if s.tags.is_empty() {
        let _ = writeln!(o, "no pauseable allocations");
        return o;
    }
    // A column of partial allocations (chunked ones with some chunks paused) only where some
    // tag has one: most processes have no chunked allocations.
    let partial = s.tags.iter().any(|t| t.partial_allocations > 0);
    let partial_cell = |v: &dyn std::fmt::Display| {
        if partial {
            format!(" {v:>7}")
        } else {
            String::new()
        }
    };
    let _ = writeln!(
        o,
        "{:<16} {:>6} {:>6}{} {:>12} {:>12} {:>12} {:>12} {:>20} {:>20}",
        "TAG",
        "ALLOCS",
        "PAUSED",
        partial_cell(&"PARTIAL"),
        "ACTIVE",
        "PAUSED",
        "HOST BACKUP",
        "DISK BACKUP",
        "LAST PAUSE",
        "LAST RESUME"
    );
    for t in &s.tags {
        let _ = writeln!(
            o,
            "{:<16} {:>6} {:>6}{} {:>12} {:>12} {:>12} {:>12} {:>20} {:>20}",
            printable(&t.tag),
            t.allocations,
            t.paused_allocations,
            partial_cell(&t.partial_allocations),
            human(t.bytes_active),
            human(t.bytes_paused),
            human(t.host_backup_bytes),
            human(t.disk_backup_bytes),
            timing(&t.last_pause),
            timing(&t.last_resume)
        );
    }
    // Memory neither active nor paused, and why: said under the table, where there is some.
    for t in &s.tags {
        if t.bytes_restoring > 0 {
            let _ =
                writeln!(
                o,
                "tag {}: {} being restored (mapped again, contents on their way: {} allocation{})",
                quoted(&t.tag),
                human(t.bytes_restoring),
                t.restoring_allocations,
                if t.restoring_allocations == 1 { "" } else { "s" }
            );
        }
        if t.bytes_unrestored > 0 || t.failed_restore.is_some() {
            let _ = writeln!(
                o,
                "tag {}: FAILED RESTORE: {} held but not restored (paused with its backups; pause \
                 the tag to give it back, or resume it to restore): {}",
                quoted(&t.tag),
                human(t.bytes_unrestored),
                printable(t.failed_restore.as_deref().unwrap_or("(no message)"))
            );
        }
    }
    for t in &s.tags {
        if let Some(n) = &t.nccl {
            let _ = writeln!(o, "{}", nccl(&t.tag, n));
        }
    }
    if s.tags_omitted > 0 {
        let _ = writeln!(
            o,
            "... and {} more tag{} not listed (the reply would not fit; --json shows the same)",
            s.tags_omitted,
            if s.tags_omitted == 1 { "" } else { "s" }
        );
    }
    o
}

/// The tag of NCCL's communicators (`NcclStatus`) under the status table: how many, what NCCL
/// can give back and has, its registered buffers and the settings.
pub fn nccl(tag: &str, n: &NcclStatus) -> String {
    let plural = |k: u64| if k == 1 { "" } else { "s" };
    let mut o = format!(
        "tag {}: {} NCCL communicator{}",
        quoted(tag),
        n.communicators,
        plural(n.communicators)
    );
    if n.suspended > 0 {
        let _ = write!(o, " ({} suspended)", n.suspended);
    }
    if let Some(why) = &n.unsupported {
        let _ = write!(o, ": {}", printable(why));
    } else {
        if let Some(v) = &n.version {
            let _ = write!(o, ", NCCL {}", printable(v));
        }
        let _ = write!(
            o,
            ": {} suspendable ({} given back), {} persistent, {} in all",
            human(n.suspendable_bytes),
            human(n.suspended_bytes),
            human(n.persistent_bytes),
            human(n.total_bytes)
        );
    }
    if let Some(e) = &n.error {
        let _ = write!(o, "; numbers not read: {}", printable(e));
    }
    if n.registered_buffers > 0 {
        let _ = write!(
            o,
            "; {} registered buffer{} ({}), {} by pauses",
            n.registered_buffers,
            plural(n.registered_buffers),
            human(n.registered_bytes),
            if n.registered_policy == "refuse" {
                "refused"
            } else {
                "kept resident"
            }
        );
    }
    let _ = write!(
        o,
        "; pauses of every tag {} it",
        if n.in_all_tags { "include" } else { "leave" }
    );
    o
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
    fn status_says_when_tags_were_left_out() {
        let mut s = Status {
            tags: vec![tms_proto::TagStatus {
                tag: "kv".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert!(!status(&s, "x").contains("not listed"));
        s.tags_omitted = 3;
        assert!(status(&s, "x").contains("... and 3 more tags not listed"));
    }

    #[test]
    fn operations_in_progress_show_how_far_they_have_got() {
        const G: u64 = 1 << 30;
        let mut s = Status::default();
        let mut r = tms_proto::Running::new(tms_proto::Op::Pause, Some("kv".into()), None, 7.0);
        s.operations.push(r.clone());
        // An older server: no progress.
        assert!(
            status(&s, "x").contains("in progress: pause of tag \"kv\", asked 7.0 s ago\n"),
            "{}",
            status(&s, "x")
        );
        r.phase = Some(tms_proto::Phase::WritingToDisk);
        r.bytes_done = Some(12 * G);
        r.bytes_total = Some(64 * G);
        r.backing = Some(tms_proto::Backing::Disk);
        r.gib_per_s = Some(1.0);
        let api = tms_proto::Running {
            in_process: true,
            phase: Some(tms_proto::Phase::Synchronizing),
            ..tms_proto::Running::new(tms_proto::Op::Resume, None, None, 2.0)
        };
        s.operations = vec![r, api];
        let text = status(&s, "x");
        assert!(
            text.contains(
                "in progress: pause of tag \"kv\", asked 7.0 s ago: 12.0 of 64.0 GiB written \
                 to disk, 1.0 GiB/s, about 52 s left\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "in progress: resume of every tag (started in the process), 2.0 s ago: waiting \
                 for the work queued on the device (2 s)\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn partial_allocations_get_a_column_where_there_are_some() {
        let kv = tms_proto::TagStatus {
            tag: "kv".into(),
            allocations: 3,
            paused_allocations: 1,
            ..Default::default()
        };
        let mut s = Status {
            tags: vec![kv.clone()],
            ..Default::default()
        };
        assert!(!status(&s, "x").contains("PARTIAL"));
        s.tags[0].partial_allocations = 1;
        s.tags.push(tms_proto::TagStatus {
            tag: "w".into(),
            ..kv
        });
        let text = status(&s, "x");
        let lines: Vec<&str> = text.lines().collect();
        let head = lines.iter().position(|l| l.starts_with("TAG")).unwrap();
        let cols = |l: &str| l.split_whitespace().take(4).collect::<Vec<_>>().join(" ");
        assert_eq!(cols(lines[head]), "TAG ALLOCS PAUSED PARTIAL");
        assert_eq!(cols(lines[head + 1]), "kv 3 1 1");
        assert_eq!(cols(lines[head + 2]), "w 3 1 0");
        // The columns line up.
        assert_eq!(lines[head].len(), lines[head + 1].len(), "{text}");
    }

    /// Issue 36, item 1: memory being restored, and a failed restore, are said under the table.
    #[test]
    fn restoring_and_failed_restores_are_said_under_the_table() {
        let s = Status {
            tags: vec![
                tms_proto::TagStatus {
                    tag: "kv".into(),
                    restoring_allocations: 2,
                    bytes_restoring: 4 << 20,
                    ..Default::default()
                },
                tms_proto::TagStatus {
                    tag: "w".into(),
                    bytes_unrestored: 2 << 20,
                    failed_restore: Some("the non-blocking resume failed after it returned".into()),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let text = status(&s, "x");
        assert!(
            text.contains("tag \"kv\": 4.00 MiB being restored") && text.contains("2 allocations"),
            "{text}"
        );
        assert!(
            text.contains("tag \"w\": FAILED RESTORE: 2.00 MiB held but not restored")
                && text.contains("failed after it returned"),
            "{text}"
        );
        assert!(!status(&Status::default(), "x").contains("FAILED"));
    }

    #[test]
    fn nccl_communicators_in_words() {
        let mut d = OpDone {
            op: tms_proto::Op::Pause,
            tag: Some("nccl".into()),
            chunks: None,
            allocations: 0,
            bytes: 3 << 29,
            copied_bytes: 0,
            disk_copied_bytes: Some(0),
            seconds: 0.25,
            unknown_tag: false,
            pending_bytes: 0,
            communicators: 2,
        };
        assert_eq!(
            done(7, &d, false),
            "pid 7: paused tag \"nccl\": 2 NCCL communicators, 1.50 GiB of device memory \
             released, in 0.250 s"
        );
        d.tag = None;
        d.allocations = 1;
        assert!(done(7, &d, false)
            .starts_with("pid 7: paused every tag: 1 allocation and 2 NCCL communicators, "));
        d.tag = Some("nccl".into());
        d.allocations = 0;
        d.communicators = 0;
        assert_eq!(
            done(7, &d, false),
            "pid 7: tag \"nccl\": nothing to do (no communicator to be paused)"
        );
        assert!(unknown_tag(7, &d, None).contains("knows no NCCL communicator"));
        let mut n = NcclStatus {
            version: Some("2.29.7".into()),
            communicators: 2,
            suspended: 1,
            suspendable_bytes: 1 << 30,
            suspended_bytes: 1 << 29,
            persistent_bytes: 64 << 20,
            total_bytes: (1 << 30) + (64 << 20),
            registered_buffers: 1,
            registered_bytes: 16 << 20,
            registered_policy: "keep".into(),
            ..Default::default()
        };
        assert_eq!(
            nccl("nccl", &n),
            "tag \"nccl\": 2 NCCL communicators (1 suspended), NCCL 2.29.7: 1.00 GiB \
             suspendable (512.00 MiB given back), 64.00 MiB persistent, 1.06 GiB in all; 1 \
             registered buffer (16.00 MiB), kept resident by pauses; pauses of every tag leave it"
        );
        n.unsupported = Some("NCCL 2.21.5 has no ncclCommSuspend (needs \u{2265} 2.29.7)".into());
        n.registered_buffers = 0;
        n.suspended = 0;
        n.in_all_tags = true;
        assert_eq!(
            nccl("nccl", &n),
            "tag \"nccl\": 2 NCCL communicators: NCCL 2.21.5 has no ncclCommSuspend (needs \
             \u{2265} 2.29.7); pauses of every tag include it"
        );
        let s = Status {
            tags: vec![tms_proto::TagStatus {
                tag: "nccl".into(),
                nccl: Some(n),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert!(status(&s, "x").contains("\ntag \"nccl\": 2 NCCL communicators: NCCL 2.21.5"));
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
