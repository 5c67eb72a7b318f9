//! What a pipeline's coordinator and workers share: the operation, the queue of units, how
//! far the items are prepared ([`Ready`]), the timing and progress, and the first error.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::config::CopyConfig;
use super::item::Item;
use super::ready::Ready;
use crate::backup::{BackupKind, Dir};
use crate::driver::Driver;
use crate::engine::progress::{Counters, Phase};
use crate::error::Error;

/// What a pipeline's threads share: the operation, its work, how far it is prepared, its timing
/// and its first error.
pub(super) struct Shared<'a> {
    pub(super) driver: &'a Arc<dyn Driver>,
    pub(super) device: i32,
    pub(super) dir: Dir,
    pub(super) cfg: &'a CopyConfig,
    pub(super) queue: Queue<'a>,
    pub(super) ready: Ready,
    pub(super) timing: Timing<'a>,
    pub(super) error: Mutex<Option<Error>>,
    /// Workers page-lock a chunk of a pinned backup before its first copy ([`PinMode::Inline`](super::PinMode::Inline)).
    pub(super) pin_inline: bool,
}

impl Shared<'_> {
    pub(super) fn d(&self) -> &dyn Driver {
        &**self.driver
    }

    /// Record the first error and stop the work (later ones are only logged).
    pub(super) fn fail(&self, e: Error) {
        {
            let mut first = self.error.lock();
            match &*first {
                None => *first = Some(e),
                Some(_) => tracing::error!("copy pipeline, after an earlier failure: {e}"),
            }
        }
        self.ready.stop();
    }

    /// Where the operation's time went, at debug level.
    pub(super) fn log(&self, workers: usize, prepared_s: f64) {
        tracing::debug!(
            "copy pipeline ({:?}, device {}): {} items, {} chunks, {workers} workers; \
             prepared at {prepared_s:.4} s, first copy at {:.4} s, done at {:.4} s; summed over \
             the workers: {:.4} s making staging slots, {:.4} s issuing copies, {:.4} s waiting \
             for the device's copies, {:.4} s in host copies",
            self.dir,
            self.device,
            self.queue.items.len(),
            self.queue.units.len(),
            self.timing.first_copy_s(),
            self.timing.t0.elapsed().as_secs_f64(),
            Timing::secs(&self.timing.slots_ns),
            Timing::secs(&self.timing.issue_ns),
            Timing::secs(&self.timing.wait_ns),
            Timing::secs(&self.timing.host_ns),
        );
    }
}

/// One unit of work: bytes `off..off + len` (inside chunk `chunk` of the backing) of item
/// `item`.
#[derive(Clone, Copy)]
pub(super) struct Unit {
    pub(super) item: usize,
    pub(super) chunk: usize,
    pub(super) off: u64,
    pub(super) len: u64,
}

/// The work: every item's units in item order, each handed out once.
pub(super) struct Queue<'a> {
    pub(super) items: &'a [Item<'a>],
    pub(super) units: Vec<Unit>,
    pub(super) next: AtomicUsize,
    /// Per item, its units not yet copied.
    pub(super) remaining: Vec<AtomicUsize>,
    /// Per item, whether it has no units at all (done once prepared).
    pub(super) empty: Vec<bool>,
}

impl<'a> Queue<'a> {
    pub(super) fn new(items: &'a [Item<'a>]) -> Self {
        let per_item: Vec<Vec<(usize, u64, u64)>> = items.iter().map(Item::units).collect();
        let remaining = per_item.iter().map(|u| AtomicUsize::new(u.len())).collect();
        let empty = per_item.iter().map(Vec::is_empty).collect();
        let units = per_item
            .into_iter()
            .enumerate()
            .flat_map(|(item, u)| {
                u.into_iter().map(move |(chunk, off, len)| Unit {
                    item,
                    chunk,
                    off,
                    len,
                })
            })
            .collect();
        Queue {
            items,
            units,
            next: AtomicUsize::new(0),
            remaining,
            empty,
        }
    }

    /// The next unit, if any is left.
    pub(super) fn take(&self) -> Option<Unit> {
        // Relaxed: only the index is shared; the units were made before the workers started.
        self.units
            .get(self.next.fetch_add(1, Ordering::Relaxed))
            .copied()
    }

    /// Item `i` has nothing to copy: it is done once prepared.
    pub(super) fn nothing_to_copy(&self, i: usize) -> bool {
        self.empty[i]
    }

    /// A unit of item `i` is copied; true if it was the item's last.
    pub(super) fn copied(&self, i: usize) -> bool {
        // AcqRel: the worker that copies an item's last unit has seen every other unit of it
        // complete (each worker's decrement releases its copy), so what it reports is whole.
        self.remaining[i].fetch_sub(1, Ordering::AcqRel) == 1
    }
}

/// When the pipeline started and when its first copy was issued (logged with the phases at
/// debug level, to see where an operation's time goes), and the operation's progress: bytes
/// copied, and what kind of copy runs.
pub(in crate::engine) struct Timing<'a> {
    pub(super) t0: Instant,
    /// Nanoseconds after `t0` (0: not yet).
    pub(super) first_copy_ns: AtomicU64,
    /// Nanoseconds, summed over the workers, spent making staging slots, queueing copies (and
    /// their events) on the device's stream, waiting for the device's copies, and copying
    /// between slots and backings (where a pause's time goes).
    pub(super) slots_ns: AtomicU64,
    pub(super) issue_ns: AtomicU64,
    pub(super) wait_ns: AtomicU64,
    pub(super) host_ns: AtomicU64,
    pub(super) progress: &'a Counters,
}

impl<'a> Timing<'a> {
    pub(super) fn new(progress: &'a Counters) -> Self {
        Timing {
            t0: Instant::now(),
            first_copy_ns: AtomicU64::new(0),
            slots_ns: AtomicU64::new(0),
            issue_ns: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            host_ns: AtomicU64::new(0),
            progress,
        }
    }

    /// A copy was just issued.
    pub(super) fn issued(&self) {
        // Relaxed: a statistic only; the first writer wins.
        if self.first_copy_ns.load(Ordering::Relaxed) == 0 {
            let ns = (self.t0.elapsed().as_nanos() as u64).max(1);
            let _ =
                self.first_copy_ns
                    .compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// `bytes` more were copied.
    pub(super) fn moved(&self, bytes: u64) {
        self.progress.moved(bytes);
    }

    /// Run `f`, adding its duration to `sum` (one of the sums above; `tms-bench`'s probe of the
    /// workers' copies keeps sums of its own).
    pub(in crate::engine) fn add<T>(sum: &AtomicU64, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        // Relaxed: a statistic only.
        sum.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// A sum above, in seconds.
    pub(in crate::engine) fn secs(sum: &AtomicU64) -> f64 {
        sum.load(Ordering::Relaxed) as f64 * 1e-9
    }

    pub(super) fn first_copy_s(&self) -> f64 {
        self.first_copy_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// A unit to or from a backup of `kind` is being copied.
    pub(super) fn copying(&self, dir: Dir, kind: BackupKind) {
        self.progress.phase(match (dir, kind.is_host()) {
            (Dir::Save, true) => Phase::CopyingToHost,
            (Dir::Save, false) => Phase::WritingToDisk,
            (Dir::Restore, true) => Phase::CopyingToDevice,
            (Dir::Restore, false) => Phase::ReadingFromDisk,
        });
    }
}
