//! Human-readable rendering: sizes, status tables, one-line summaries; and escaping of the
//! text that comes from elsewhere (a server's replies, another process's command line) so that
//! it cannot act on the terminal.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde_json::Value;
use tms_proto::{OpDone, OpTiming, RegionInfo, Status};

pub use tms_proto::human_bytes as human;

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

pub use tms_proto::parse_bytes;

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

/// A region in words.
pub fn region(r: &RegionInfo) -> String {
    let backup = if r.cpu_backup {
        format!("CPU backup ({})", r.backend.as_str())
    } else {
        "no CPU backup".to_string()
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
    if s.tags.is_empty() {
        let _ = writeln!(o, "no pauseable allocations");
        return o;
    }
    let _ = writeln!(
        o,
        "{:<16} {:>6} {:>6} {:>12} {:>12} {:>12} {:>12} {:>20} {:>20}",
        "TAG",
        "ALLOCS",
        "PAUSED",
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
            "{:<16} {:>6} {:>6} {:>12} {:>12} {:>12} {:>12} {:>20} {:>20}",
            printable(&t.tag),
            t.allocations,
            t.paused_allocations,
            human(t.bytes_active),
            human(t.bytes_paused),
            human(t.host_backup_bytes),
            human(t.disk_backup_bytes),
            timing(&t.last_pause),
            timing(&t.last_resume)
        );
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

/// A pause or resume in one line.
pub fn done(pid: u32, d: &OpDone) -> String {
    let what = match &d.tag {
        Some(t) => format!("tag {}", quoted(t)),
        None => "every tag".to_string(),
    };
    let (verb, noun, copy) = match d.op {
        tms_proto::Op::Pause => ("paused", "released", "copied to host"),
        tms_proto::Op::Resume => ("resumed", "re-taken", "restored from host"),
    };
    if d.allocations == 0 {
        return format!("pid {pid}: {what}: nothing to do (no allocation to be {verb})");
    }
    let mut s = format!(
        "pid {pid}: {verb} {what}: {} allocation{}, {} of device memory {noun}",
        d.allocations,
        if d.allocations == 1 { "" } else { "s" },
        human(d.bytes)
    );
    if d.copied_bytes > 0 {
        let _ = write!(s, ", {} {copy}", human(d.copied_bytes));
    }
    let _ = write!(s, ", in {:.3} s", d.seconds);
    s
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
}
