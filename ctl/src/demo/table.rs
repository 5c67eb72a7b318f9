//! The demo's table: a row for each step, with the device's free memory and the tag's bytes.

use tms_proto::{OpDone, Status};

use crate::output::human_delta;
use tms_units::human_bytes as human;

/// A step of the demo: the process's status after it, and the pause or resume it was.
pub(super) struct Row {
    pub(super) step: &'static str,
    pub(super) status: Status,
    pub(super) done: Option<OpDone>,
}

/// The demo's table, a row at a time: fixed widths, so that each row can be printed as soon
/// as its step is done and the columns still line up.
pub(super) struct Table<'a> {
    tag: &'a str,
    /// Device memory free at the previous row.
    prev: Option<u64>,
}

impl<'a> Table<'a> {
    pub(super) fn header() -> String {
        format!(
            "{:<10} {:>13} {:>13} {:>12} {:>12} {:>12}  time",
            "step", "device free", "change", "active", "paused", "host backup"
        )
    }

    pub(super) fn new(tag: &'a str) -> Self {
        Table { tag, prev: None }
    }

    pub(super) fn row(&mut self, r: &Row) -> String {
        let t = tag_of(&r.status, self.tag);
        let free = free_of(&r.status);
        let change = match (self.prev, free) {
            (Some(p), Some(f)) => human_delta(p, f),
            _ => "-".into(),
        };
        self.prev = free;
        let time = match &r.done {
            Some(d) => {
                let moved = if d.copied_bytes > 0 {
                    d.copied_bytes
                } else {
                    d.bytes
                };
                let rate = if d.seconds > 0.0 {
                    moved as f64 / d.seconds / (1u64 << 30) as f64
                } else {
                    0.0
                };
                format!("{:.3} s, {rate:.1} GiB/s", d.seconds)
            }
            None => "-".into(),
        };
        format!(
            "{:<10} {:>13} {:>13} {:>12} {:>12} {:>12}  {time}",
            r.step,
            free.map_or("?".into(), human),
            change,
            human(t.map_or(0, |t| t.bytes_active)),
            human(t.map_or(0, |t| t.bytes_paused)),
            human(t.map_or(0, |t| t.host_backup_bytes)),
        )
    }
}

/// Device 0's free memory in `s`.
pub(super) fn free_of(s: &Status) -> Option<u64> {
    s.devices
        .iter()
        .find(|d| d.device == 0 && d.error.is_none())
        .map(|d| d.free_bytes)
}

/// `tag`'s line in `s`.
pub(super) fn tag_of<'a>(s: &'a Status, tag: &str) -> Option<&'a tms_proto::TagStatus> {
    s.tags.iter().find(|t| t.tag == tag)
}
