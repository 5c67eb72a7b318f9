//! Human-readable rendering: sizes, status tables, one-line summaries; and escaping of the
//! text that comes from elsewhere (a server's replies, another process's command line) so that
//! it cannot act on the terminal.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::Value;
use tms_proto::{ChunkStatus, OpDone, OpTiming, RegionInfo, Status};
use tms_units::{format_chunk_ranges, format_ranges};

pub use tms_units::human_bytes as human;

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

pub use tms_units::parse_bytes;

/// Characters that must not reach a terminal raw: control characters (C0, DEL, C1: escape
/// sequences, bells, backspaces, line breaks) and the invisible ones that reorder or hide text
/// (bidirectional formatting marks).
fn hazardous(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// `s` safe to print: [hazardous] characters become `\u{1b}`-style escapes (`\n`,
/// `\t`, `\r` as such). Text that came from a server or another process goes through this
/// before it is printed. Applying it twice changes nothing more.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(hazardous) {
        return Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '\n' => o.push_str("\\n"),
            '\t' => o.push_str("\\t"),
            '\r' => o.push_str("\\r"),
            c if hazardous(c) => {
                let _ = write!(o, "\\u{{{:x}}}", c as u32);
            }
            c => o.push(c),
        }
    }
    Cow::Owned(o)
}

/// Text of several lines made [`printable`] line by line (its line breaks kept).
pub fn printable_lines(s: &str) -> String {
    s.split('\n').map(printable).collect::<Vec<_>>().join("\n")
}

/// `s` quoted and escaped: `"kv"`, `"\u{1b}[2J"`.
pub fn quoted(s: &str) -> String {
    printable(&format!("{s:?}")).into_owned()
}

/// `v` as one line of JSON with the characters serde_json leaves raw (DEL, C1 controls,
/// bidirectional marks) escaped as well (`\u009b`), so the line is safe on a terminal too.
pub fn json_line(v: &Value) -> String {
    let s = v.to_string();
    if !s.chars().any(hazardous) {
        return s;
    }
    let mut o = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if hazardous(c) {
            let _ = write!(o, "\\u{:04x}", c as u32);
        } else {
            o.push(c);
        }
    }
    o
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
        let what = crate::progress::what(r.tag.as_deref(), r.chunks.as_ref());
        let verb = match r.op {
            tms_proto::Op::Pause => "pause",
            tms_proto::Op::Resume => "resume",
        };
        let _ = write!(o, "in progress: {verb} of {what}");
        if r.in_process {
            let _ = write!(o, " (started in the process), {:.1} s ago", r.seconds);
        } else {
            let _ = write!(o, ", asked {:.1} s ago", r.seconds);
        }
        if r.phase.is_some() {
            let rate = r.gib_per_s.map(|g| g * (1u64 << 30) as f64);
            let _ = write!(o, ": {}", crate::progress::state(r, rate));
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

/// A pause or resume in one line; `chunk_state`: it saved (pause) or restored (resume) chunk
/// states.
pub fn done(pid: u32, d: &OpDone, chunk_state: bool) -> String {
    let tag = match &d.tag {
        Some(t) => format!("tag {}", quoted(t)),
        None => "every tag".to_string(),
    };
    let (verb, noun, state) = match d.op {
        tms_proto::Op::Pause => ("paused", "released", " (chunk states saved)"),
        tms_proto::Op::Resume => ("resumed", "re-taken", " (the chunks saved active)"),
    };
    let what = match &d.chunks {
        Some(c) => format!("chunks {} of {tag}", format_chunk_ranges(c)),
        None if chunk_state => format!("{tag}{state}"),
        None => tag,
    };
    if d.allocations == 0 {
        if d.chunks.is_some() {
            return format!("pid {pid}: {what}: nothing to do (all {verb} already)");
        }
        return format!("pid {pid}: {what}: nothing to do (no allocation to be {verb})");
    }
    let mut s = if d.chunks.is_some() {
        format!(
            "pid {pid}: {verb} {what}: {} of device memory {noun}",
            human(d.bytes)
        )
    } else {
        format!(
            "pid {pid}: {verb} {what}: {} allocation{}, {} of device memory {noun}",
            d.allocations,
            if d.allocations == 1 { "" } else { "s" },
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
    use crate::progress::moved_words;
    use tms_proto::Backing;
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
        tms_proto::Op::Pause => "paused",
        tms_proto::Op::Resume => "resumed",
    };
    let tag = tag.or(d.tag.as_deref()).unwrap_or("");
    format!(
        "process {pid}: no allocation of it ever had tag {}, so nothing was {verb} (a typo? \
         `tmsctl status --pid {pid}` lists its tags)",
        quoted(tag)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn text_from_elsewhere_cannot_act_on_the_terminal() {
        assert_eq!(printable("kv-cache 1"), "kv-cache 1");
        assert!(matches!(printable("plain"), Cow::Borrowed(_)));
        let evil = "\x1b]0;owned\x07\x1b[2J\u{9b}31m\u{7f}\u{202e}txt.exe\nnext\r\t";
        let p = printable(evil);
        assert_eq!(
            p,
            "\\u{1b}]0;owned\\u{7}\\u{1b}[2J\\u{9b}31m\\u{7f}\\u{202e}txt.exe\\nnext\\r\\t"
        );
        assert!(!p.chars().any(hazardous));
        assert_eq!(printable(&p), p, "idempotent");
        assert_eq!(printable_lines("a\x1b\nb"), "a\\u{1b}\nb");
        assert_eq!(quoted("\x1b[1m"), "\"\\u{1b}[1m\"");
        let j = json_line(&serde_json::json!({"tag": evil}));
        assert!(!j.chars().any(hazardous), "{j}");
        let back: Value = serde_json::from_str(&j).unwrap();
        assert_eq!(back["tag"], evil, "still the same JSON");
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
}
