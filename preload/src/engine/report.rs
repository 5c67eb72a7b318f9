//! What a pause or resume did: its report, and the tally that builds it.

use std::collections::HashMap;
use std::sync::Arc;

use crate::units::human;

/// Outcome of one pause or resume call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpReport {
    /// Allocations that changed state.
    pub allocations: usize,
    /// Device bytes released or re-taken.
    pub bytes: u64,
    /// Bytes copied between device and host.
    pub copied: u64,
    /// Wall time of the call.
    pub seconds: f64,
    /// Part of `seconds` spent giving host backups back (a resume without retention).
    pub release_seconds: f64,
    /// Of `copied`, the bytes written to or read from disk backup files (the rest went to or
    /// came from host memory).
    pub disk_copied: u64,
    /// Of `bytes`, those a non-blocking resume was still restoring when it returned.
    pub pending: u64,
    /// NCCL communicators suspended or resumed (their bytes are in `bytes`).
    pub communicators: usize,
    /// Bytes a pause found unchanged since its retained backup took them, and did not copy
    /// (not in `copied`).
    pub unchanged: u64,
    /// Bytes a resume restored and found identical to the backup (Note [Skipping unchanged
    /// memory]).
    pub verified: u64,
}

impl OpReport {
    /// Where the copied bytes went or came from, in words for log messages: `" (2.00 GiB
    /// written to disk)"` for a pause, `""` when nothing was copied.
    pub(super) fn copies(&self, pause: bool) -> String {
        let host = self.copied - self.disk_copied.min(self.copied);
        let mut parts = Vec::new();
        if host > 0 {
            parts.push(format!(
                "{} copied {} host memory",
                human(host),
                if pause { "to" } else { "from" }
            ));
        }
        if self.disk_copied > 0 {
            parts.push(format!(
                "{} {} disk",
                human(self.disk_copied),
                if pause { "written to" } else { "read from" }
            ));
        }
        if self.unchanged > 0 {
            parts.push(format!("{} unchanged, not copied", human(self.unchanged)));
        }
        if self.verified > 0 {
            parts.push(format!("{} verified", human(self.verified)));
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!(" ({})", parts.join(", "))
        }
    }
}

/// A pause's or resume's numbers, in all and per tag.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) report: OpReport,
    pub(super) per_tag: HashMap<Arc<str>, OpReport>,
}

impl Tally {
    pub(super) fn add(&mut self, tag: &Arc<str>, bytes: u64, copied: u64, on_disk: bool) {
        self.allocation(tag);
        self.bytes(tag, bytes, copied, on_disk);
    }

    pub(super) fn allocation(&mut self, tag: &Arc<str>) {
        let t = self.per_tag.entry(tag.clone()).or_default();
        for r in [t, &mut self.report] {
            r.allocations += 1;
        }
    }

    /// `n` communicators of `tag` changed state, `bytes` of device memory with them.
    pub(super) fn communicators(&mut self, tag: &Arc<str>, n: usize, bytes: u64) {
        let t = self.per_tag.entry(tag.clone()).or_default();
        for r in [t, &mut self.report] {
            r.communicators += n;
            r.bytes += bytes;
        }
    }

    /// `bytes` of `tag` were found unchanged and not copied.
    pub(super) fn unchanged(&mut self, tag: &Arc<str>, bytes: u64) {
        let t = self.per_tag.entry(tag.clone()).or_default();
        for r in [t, &mut self.report] {
            r.unchanged += bytes;
        }
    }

    /// `bytes` of `tag` were restored and verified.
    pub(super) fn verified(&mut self, tag: &Arc<str>, bytes: u64) {
        let t = self.per_tag.entry(tag.clone()).or_default();
        for r in [t, &mut self.report] {
            r.verified += bytes;
        }
    }

    /// `copied` of `bytes` went to or came from a backup, a file if `on_disk`.
    pub(super) fn bytes(&mut self, tag: &Arc<str>, bytes: u64, copied: u64, on_disk: bool) {
        let t = self.per_tag.entry(tag.clone()).or_default();
        for r in [t, &mut self.report] {
            r.bytes += bytes;
            r.copied += copied;
            if on_disk {
                r.disk_copied += copied;
            }
        }
    }
}
