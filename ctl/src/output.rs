//! Human-readable rendering: sizes, status tables, one-line summaries.

use std::fmt::Write as _;

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

/// A region in words.
pub fn region(r: &RegionInfo) -> String {
    let backup = if r.cpu_backup {
        format!("CPU backup ({})", r.backend.as_str())
    } else {
        "no CPU backup".to_string()
    };
    if r.enabled {
        format!("pauseable, tag {:?}, {backup}", r.tag)
    } else {
        format!("not pauseable (tag {:?}, {backup} when enabled)", r.tag)
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
        s.backend,
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
                let _ = writeln!(o, "device {}: memory unknown: {e}", d.device);
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
        "{:<16} {:>6} {:>6} {:>12} {:>12} {:>12} {:>20} {:>20}",
        "TAG", "ALLOCS", "PAUSED", "ACTIVE", "PAUSED", "HOST BACKUP", "LAST PAUSE", "LAST RESUME"
    );
    for t in &s.tags {
        let _ = writeln!(
            o,
            "{:<16} {:>6} {:>6} {:>12} {:>12} {:>12} {:>20} {:>20}",
            t.tag,
            t.allocations,
            t.paused_allocations,
            human(t.bytes_active),
            human(t.bytes_paused),
            human(t.host_backup_bytes),
            timing(&t.last_pause),
            timing(&t.last_resume)
        );
    }
    o
}

/// A pause or resume in one line.
pub fn done(pid: u32, d: &OpDone) -> String {
    let what = match &d.tag {
        Some(t) => format!("tag {t:?}"),
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
}
