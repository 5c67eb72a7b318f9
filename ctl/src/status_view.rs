//! `tmsctl status` in words: a process's tags, allocations and bytes, the operations in
//! progress, what is being restored or failed to be, NCCL's communicators, the default region.

use std::fmt::Write as _;

use tms_proto::{NcclStatus, OpTiming, RegionInfo, Status};
use tms_units::human_bytes as human;

use crate::output::{quoted, state, verb, what};
use crate::text::printable;

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
        if let Some(e) = &t.failed_restore {
            let _ = writeln!(
                o,
                "tag {}: FAILED RESTORE: {} held but not restored (paused with its backups; pause \
                 the tag to give it back, or resume it to restore): {}",
                quoted(&t.tag),
                human(t.bytes_unrestored),
                printable(e)
            );
        } else if t.bytes_unrestored > 0 {
            // Left mapped by a failed call whose undo could not unmap it (its error went to
            // that call's caller): no failed restore to name.
            let _ = writeln!(
                o,
                "tag {}: {} held, left mapped by a failed call (paused with its backups; pause \
                 the tag to give it back, or resume it to restore)",
                quoted(&t.tag),
                human(t.bytes_unrestored)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{done, unknown_tag};
    use tms_proto::OpDone;

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
        // Held after a failed call's undo, with no failed restore: said so, not as one.
        let s = Status {
            tags: vec![tms_proto::TagStatus {
                tag: "u".into(),
                bytes_unrestored: 2 << 20,
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = status(&s, "x");
        assert!(
            text.contains("tag \"u\": 2.00 MiB held, left mapped by a failed call")
                && !text.contains("FAILED RESTORE"),
            "{text}"
        );
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
            unchanged_bytes: 0,
            verified_bytes: 0,
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
}
