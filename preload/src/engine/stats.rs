//! Per-tag statistics, as a serialisable value and a readable table.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use super::comms::CommStats;
use super::report::OpReport;
use crate::units::human;

#[derive(Default)]
pub(super) struct History {
    pub last_pause: Option<OpReport>,
    pub last_resume: Option<OpReport>,
}

pub(super) struct Row<'a> {
    pub tag: &'a str,
    pub serial: u64,
    pub size: u64,
    pub mapped: u64,
    /// Of `mapped`, the bytes mapped now (or restored by a non-blocking resume).
    pub active: u64,
    /// Of `mapped`, bytes a non-blocking resume mapped whose contents are on their way.
    pub arriving: u64,
    /// Of `mapped`, bytes a failed non-blocking resume left mapped, not restored.
    pub unrestored: u64,
    /// Kept resident (`keep_resident`): no pause takes it.
    pub resident: bool,
    pub host: u64,
    pub host_pinned: u64,
    pub disk: u64,
}

/// Duration and throughput of the last pause or resume that touched a tag.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct OpStats {
    /// Allocations that changed state.
    pub allocations: usize,
    /// Device bytes released or re-taken.
    pub bytes: u64,
    /// Bytes copied to or from host backups.
    pub copied_bytes: u64,
    /// Wall time of the whole call.
    pub seconds: f64,
    /// Part of `seconds` spent giving host backups back (a resume without retention).
    pub release_seconds: f64,
    /// `copied_bytes` (or `bytes` when nothing was copied) over `seconds`, in GiB/s.
    pub gib_per_s: f64,
    /// A pause: bytes found unchanged since the retained backup took them, not copied.
    pub unchanged_bytes: u64,
    /// A resume: bytes checked against the backup after the restore.
    pub verified_bytes: u64,
}

impl From<OpReport> for OpStats {
    fn from(r: OpReport) -> Self {
        let moved = if r.copied > 0 { r.copied } else { r.bytes };
        OpStats {
            allocations: r.allocations,
            bytes: r.bytes,
            copied_bytes: r.copied,
            seconds: r.seconds,
            release_seconds: r.release_seconds,
            unchanged_bytes: r.unchanged,
            verified_bytes: r.verified,
            gib_per_s: if r.seconds > 0.0 {
                moved as f64 / r.seconds / (1u64 << 30) as f64
            } else {
                0.0
            },
        }
    }
}

/// One tag's numbers.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TagStats {
    /// The tag.
    pub tag: String,
    /// Allocations of the tag.
    pub allocations: usize,
    /// Of those, active.
    pub active_allocations: usize,
    /// Of those, paused.
    pub paused_allocations: usize,
    /// Of those, allocations with some parts active and others paused: chunked ones, or one a
    /// failed pause could not make whole again.
    pub partial_allocations: usize,
    /// Of those, allocations a non-blocking resume is restoring (mapped, contents on their
    /// way): neither active nor paused.
    pub restoring_allocations: usize,
    /// Of the active ones, allocations kept resident (`keep_resident`): a pause leaves them
    /// mapped.
    pub resident_allocations: usize,
    /// Bytes asked for, all allocations.
    pub bytes_requested: u64,
    /// The serial of the tag's newest allocation (each allocation of the process gets the next
    /// one; 0 while it has none). With `allocations`, tells two reads apart between which the
    /// program made an allocation in the tag, even one in place of a freed one of its size.
    pub newest_allocation: u64,
    /// Mapped bytes of active allocations and active chunks (device memory held).
    pub bytes_active: u64,
    /// Mapped bytes of paused allocations and paused chunks (device memory given back).
    pub bytes_paused: u64,
    /// Mapped bytes a non-blocking resume mapped again whose contents are still on their way
    /// (device memory held; `wait()` tells when they landed). Neither active nor paused.
    pub bytes_restoring: u64,
    /// Mapped bytes a non-blocking resume left mapped when it failed after returning, or that
    /// the undo of another failed call could not unmap: device memory held, contents not
    /// restored (the allocations are paused with their backups; a pause gives the memory back,
    /// a resume restores them). Neither active nor paused.
    pub bytes_unrestored: u64,
    /// The error of a non-blocking resume that failed after returning, while allocations of
    /// the tag it left unrestored are so.
    pub failed_restore: Option<String>,
    /// Host memory held by backups.
    pub host_backup_bytes: u64,
    /// Of that, page-locked (pinned backups, once the background pinner has done them).
    pub host_pinned_bytes: u64,
    /// Bytes of the disk backups' files.
    pub disk_backup_bytes: u64,
    /// Last pause that touched the tag.
    pub last_pause: Option<OpStats>,
    /// Last resume that touched the tag.
    pub last_resume: Option<OpStats>,
    /// The reserved tag's own numbers: NCCL's communicators (`comms.rs`). Absent from every
    /// other tag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nccl: Option<CommStats>,
}

/// Statistics of the whole engine.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    /// `"cuda"` or `"sim"`.
    pub backend: String,
    /// Whether host backups are kept across resume.
    pub retain_cpu_backup: bool,
    /// The memory margin in bytes.
    pub memory_margin_bytes: u64,
    /// Per tag, sorted by tag.
    pub tags: Vec<TagStats>,
}

pub(super) fn collect<'a>(
    rows: impl Iterator<Item = Row<'a>>,
    history: &HashMap<Arc<str>, History>,
) -> Stats {
    let mut tags: BTreeMap<&str, TagStats> = BTreeMap::new();
    for r in rows {
        let t = tags.entry(r.tag).or_insert_with(|| TagStats {
            tag: r.tag.to_string(),
            ..Default::default()
        });
        t.allocations += 1;
        t.bytes_requested += r.size;
        t.newest_allocation = t.newest_allocation.max(r.serial);
        t.host_backup_bytes += r.host;
        t.host_pinned_bytes += r.host_pinned;
        t.disk_backup_bytes += r.disk;
        match r.active {
            a if a == r.mapped => t.active_allocations += 1,
            0 if r.arriving > 0 => t.restoring_allocations += 1,
            0 => t.paused_allocations += 1,
            _ => t.partial_allocations += 1,
        }
        if r.resident {
            t.resident_allocations += 1;
        }
        t.bytes_active += r.active;
        t.bytes_restoring += r.arriving;
        t.bytes_unrestored += r.unrestored;
        t.bytes_paused += r
            .mapped
            .saturating_sub(r.active + r.arriving + r.unrestored);
    }
    for (tag, h) in history {
        let t = tags.entry(tag).or_insert_with(|| TagStats {
            tag: tag.to_string(),
            ..Default::default()
        });
        t.last_pause = h.last_pause.map(Into::into);
        t.last_resume = h.last_resume.map(Into::into);
    }
    Stats {
        tags: tags.into_values().collect(),
        ..Default::default()
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "backend {}, retain CPU backup {}, memory margin {}",
            self.backend,
            self.retain_cpu_backup,
            human(self.memory_margin_bytes)
        )?;
        writeln!(
            f,
            "{:<16} {:>6} {:>6} {:>12} {:>12} {:>12} {:>12} {:>18} {:>18}",
            "tag",
            "allocs",
            "paused",
            "active",
            "paused",
            "host backup",
            "disk backup",
            "last pause",
            "last resume"
        )?;
        let op = |o: &Option<OpStats>| match o {
            Some(o) => format!("{:.3}s {:.1}GiB/s", o.seconds, o.gib_per_s),
            None => "-".to_string(),
        };
        for t in &self.tags {
            writeln!(
                f,
                "{:<16} {:>6} {:>6} {:>12} {:>12} {:>12} {:>12} {:>18} {:>18}",
                t.tag,
                t.allocations,
                t.paused_allocations,
                human(t.bytes_active),
                human(t.bytes_paused),
                human(t.host_backup_bytes),
                human(t.disk_backup_bytes),
                op(&t.last_pause),
                op(&t.last_resume)
            )?;
        }
        Ok(())
    }
}
