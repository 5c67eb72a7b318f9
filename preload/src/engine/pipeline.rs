//! The copy pipeline: moves backups between device allocations and their backings (host
//! buffers, disk files) with several workers per device.
//!
//! # Note [The copy pipeline]
//!
//! One host↔device link moves about 50 GiB/s, but only from page-locked memory; a single CPU
//! thread copies pageable memory at a fraction of that, and page-locking fresh memory costs
//! more than filling it. So:
//!
//! - The work is cut into *units*: the parts of each item's backing chunks inside the item (the
//!   host buffer's chunk, 64 MiB by default; a disk file's chunk), handed out to `threads`
//!   workers in allocation order ([`Queue`]). Each worker has two *lanes*: an event of its own
//!   on the device's one engine stream, and a small page-locked *staging slot* per lane (the
//!   device's [`Ring`]). One stream keeps the link busy; more would each cost device memory.
//! - How a unit moves is for its backing to say (`backup/backing.rs`): a page-locked host
//!   chunk is copied straight by DMA; anything else (mmap backups; pinned backups before they
//!   are page-locked; disk files, whose format, alignment and per-chunk checksums are
//!   `backup/disk_file.rs`'s) goes through the worker's slots, piece by piece through the
//!   backing's `UnitIo`: the DMA fills one slot while the worker moves the other out with the
//!   CPU (to host memory or a file), or the worker fills one slot while the DMA drains the
//!   other (to device). With many workers the CPU copies, the file I/O and the page
//!   faults of fresh memory run in parallel, and the link stays busy.
//! - Page-locking fresh memory runs at a few GiB/s and does not scale with threads (measured on
//!   an H200 host: 3 GiB/s in one call, 4 GiB/s from 16 threads), far below the link, while
//!   filling fresh memory through the slots runs at 25 GiB/s. So a first pause always goes
//!   through the slots, and pinned backups that are retained are page-locked afterwards by a
//!   background thread (`pinner.rs`, [`PinMode::Background`]); later cycles copy them straight.
//! - The coordinator prepares items in order while the workers copy what is prepared already: a
//!   resume maps allocation i+1 (or the next segment of a large allocation) while what is
//!   mapped is being copied. It publishes what is prepared, and the workers wait for it,
//!   through [`Ready`] (`pipeline/ready.rs`, model-checked with loom). Each allocation whose
//!   units are all copied is reported to the coordinator at once, so a pause unmaps and
//!   releases it while the copies of later allocations run.
//! - A failure stops the hand-out; every worker waits for what its lanes still have queued
//!   before it returns, so no DMA touches a buffer after the call. The caller learns which
//!   allocations completed, and the engine keeps the registry true (engine Note [Pause and
//!   resume as transactions]).
//! - A unit counts as copied only once the wait for its own lane's event succeeded: the driver
//!   contract is that such a wait covers every copy queued before the event (the simulated
//!   device keeps it even when another worker's wait failed).
//! - Threads may not be had (a pids limit): a worker that cannot be started is not started,
//!   and with none at all the coordinator copies itself once everything is prepared. A panic in
//!   a worker (a bug) fails the operation like an error; a panic of the coordinator stops the
//!   workers before it unwinds, so nothing waits for work that will never come (and the engine
//!   then refuses further pauses and resumes: its registry may be wrong).
//!
//! Devices run in parallel, each with its own coordinator thread and workers.
//!
//! Here: the items, the coordinator ([`Pipeline::run`]) and what its threads share (the work
//! [`Queue`], [`Ready`], [`Timing`]). In `pipeline/`: the settings (`config.rs`), the workers
//! with their lanes and staging slots (`worker.rs`), the publish/wait primitive (`ready.rs`).

mod config;
mod ready;
mod worker;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use parking_lot::Mutex;

use super::progress::{Counters, Phase};
use crate::backup::{Backing, BackupKind, HostBuffer};
use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};
use ready::Ready;
use worker::worker;

pub(super) use crate::backup::Dir;
pub use config::{CopyConfig, PinMode, MAX_WORKERS};
pub(super) use worker::Ring;

/// What an item copies to or from. Items hold their backing as a trait object: the workers
/// call it per unit and per staging-slot piece, never per byte (`backup/backing.rs` says why
/// that dispatch is dynamic).
pub(super) type Target<'a> = &'a dyn Backing;

/// One range of an allocation in a pipelined operation: the allocation's address, the range
/// (bytes `off..off + len` of it), and the backup to copy that range of to or from it (none:
/// nothing to copy, only the coordinator's work). Offsets in the backup are offsets in the
/// allocation.
pub(super) struct Item<'a> {
    pub dev: DevPtr,
    pub off: u64,
    pub len: u64,
    pub target: Option<Target<'a>>,
}

impl<'a> Item<'a> {
    /// The bytes of `span` of the allocation at `dev`, to or from `target`.
    pub(super) fn over(
        dev: DevPtr,
        span: &super::segment::Span,
        target: Option<Target<'a>>,
    ) -> Self {
        Item {
            dev,
            off: span.ptr - dev,
            len: span.mapped,
            target,
        }
    }

    /// Bytes the workers copy for this item.
    pub(super) fn copy_bytes(&self) -> u64 {
        self.units().iter().map(|u| u.2).sum()
    }

    /// The parts of the target's chunks inside the range: `(chunk, offset, length)`.
    fn units(&self) -> Vec<(usize, u64, u64)> {
        let Some(t) = self.target else {
            return Vec::new();
        };
        let end = self.off + self.len;
        // Chunks are of one size but the last.
        let first = match t.chunks() {
            0 => 0,
            _ => (self.off / t.chunk_span(0).1.max(1)) as usize,
        };
        (first..t.chunks())
            .map_while(|k| {
                let (o, n) = t.chunk_span(k);
                (o < end).then_some((k, o, n))
            })
            .filter_map(|(k, o, n)| {
                let (a, b) = (o.max(self.off), (o + n).min(end));
                (a < b).then_some((k, a, b - a))
            })
            .collect()
    }
}

/// One pipelined operation on one device: [`Pipeline::run`] copies `items` in direction `dir`
/// with the device's staging `ring`, counting the bytes it copies in `progress`.
pub(super) struct Pipeline<'a, 'i> {
    pub driver: &'a Arc<dyn Driver>,
    pub device: i32,
    pub dir: Dir,
    pub cfg: &'a CopyConfig,
    pub ring: &'a mut Ring,
    pub items: &'a [Item<'i>],
    pub progress: &'a Counters,
}

impl Pipeline<'_, '_> {
    /// Run the pipeline. On this thread (the coordinator), in item order: `prepare(i,
    /// progress)` (the resume maps the item's range here, calling `progress(end)` as the
    /// allocation's bytes up to offset `end` become usable), after which the workers may copy
    /// item `i`; `on_done(i)` as soon as item `i` is fully copied (at once for items with
    /// nothing to copy; the pause unmaps here). The first error, of a copy or of either
    /// callback, stops the preparing and the hand-out of work; copies complete by then are
    /// still reported, unless `on_done` itself failed. Returns the first error, once every
    /// worker is idle.
    pub(super) fn run(
        self,
        prepare: impl FnMut(usize, &dyn Fn(u64)) -> Result<()>,
        on_done: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let sh = Shared::new(&self);
        let workers = self
            .cfg
            .threads
            .clamp(1, MAX_WORKERS)
            .min(sh.queue.units.len());
        let lanes = self.ring.lanes(workers);
        let (tx, rx) = mpsc::channel::<usize>();
        let mut prepared_s = 0.0;
        std::thread::scope(|s| {
            let started = start_workers(s, &sh, &lanes, &tx);
            // No worker at all: this thread copies, once everything is prepared.
            let inline = (started == 0 && !lanes.is_empty()).then(|| tx.clone());
            drop(tx);
            // A panic on this thread (in `prepare` or `on_done`) must not leave the workers
            // waiting for items that will never be prepared: they stop, and the scope can end.
            let _stop = StopOnUnwind(&sh);
            let mut done = Completions {
                sh: &sh,
                on_done,
                stopped: false,
            };
            prepare_all(&sh, prepare, &rx, &mut done);
            prepared_s = sh.timing.t0.elapsed().as_secs_f64();
            if let (Some(tx), Some(slots)) = (inline, lanes.first()) {
                worker(&sh, &mut slots.lock(), tx);
            }
            rx.iter().for_each(|j| done.report(j));
        });
        sh.log(workers, prepared_s);
        match sh.error.into_inner() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Start a worker per lane, until one cannot be had; how many started.
fn start_workers<'s, 'e>(
    s: &'s std::thread::Scope<'s, 'e>,
    sh: &'s Shared<'_>,
    lanes: &'s [Mutex<&mut [Option<HostBuffer>]>],
    tx: &mpsc::Sender<usize>,
) -> usize {
    lanes
        .iter()
        .map_while(|slots| {
            let tx = tx.clone();
            crate::threads::spawn_scoped(s, "tms-copy", move || worker(sh, &mut slots.lock(), tx))
        })
        .count()
}

/// The coordinator's part: prepare each item in turn and publish it to the workers, reporting
/// the items completed meanwhile; stops at the first failure.
fn prepare_all<F: FnMut(usize) -> Result<()>>(
    sh: &Shared<'_>,
    mut prepare: impl FnMut(usize, &dyn Fn(u64)) -> Result<()>,
    completed: &mpsc::Receiver<usize>,
    done: &mut Completions<'_, '_, F>,
) {
    for i in 0..sh.queue.items.len() {
        if sh.ready.stopped() {
            break;
        }
        if let Err(e) = prepare(i, &|bytes| sh.ready.publish_partial(bytes)) {
            sh.fail(e);
            break;
        }
        sh.ready.publish(i + 1);
        if sh.queue.nothing_to_copy(i) {
            done.report(i);
        }
        completed.try_iter().for_each(|j| done.report(j));
    }
}

/// What a pipeline's threads share: the operation, its work, how far it is prepared, its timing
/// and its first error.
struct Shared<'a> {
    driver: &'a Arc<dyn Driver>,
    device: i32,
    dir: Dir,
    cfg: &'a CopyConfig,
    queue: Queue<'a>,
    ready: Ready,
    timing: Timing<'a>,
    error: Mutex<Option<Error>>,
}

impl<'a> Shared<'a> {
    fn new(p: &Pipeline<'a, '_>) -> Self {
        Shared {
            driver: p.driver,
            device: p.device,
            dir: p.dir,
            cfg: p.cfg,
            queue: Queue::new(p.items),
            ready: Ready::new(),
            timing: Timing::new(p.progress),
            error: Mutex::new(None),
        }
    }

    fn d(&self) -> &dyn Driver {
        &**self.driver
    }

    /// Record the first error and stop the work (later ones are only logged).
    fn fail(&self, e: Error) {
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
    fn log(&self, workers: usize, prepared_s: f64) {
        tracing::debug!(
            "copy pipeline ({:?}, device {}): {} items, {} chunks, {workers} workers; \
             prepared at {prepared_s:.4} s, first copy at {:.4} s, done at {:.4} s",
            self.dir,
            self.device,
            self.queue.items.len(),
            self.queue.units.len(),
            self.timing.first_copy_s(),
            self.timing.t0.elapsed().as_secs_f64()
        );
    }
}

/// One unit of work: bytes `off..off + len` (inside chunk `chunk` of the backing) of item
/// `item`.
#[derive(Clone, Copy)]
struct Unit {
    item: usize,
    chunk: usize,
    off: u64,
    len: u64,
}

/// The work: every item's units in item order, each handed out once.
struct Queue<'a> {
    items: &'a [Item<'a>],
    units: Vec<Unit>,
    next: AtomicUsize,
    /// Per item, its units not yet copied.
    remaining: Vec<AtomicUsize>,
    /// Per item, whether it has no units at all (done once prepared).
    empty: Vec<bool>,
}

impl<'a> Queue<'a> {
    fn new(items: &'a [Item<'a>]) -> Self {
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
    fn take(&self) -> Option<Unit> {
        // Relaxed: only the index is shared; the units were made before the workers started.
        self.units
            .get(self.next.fetch_add(1, Ordering::Relaxed))
            .copied()
    }

    /// Item `i` has nothing to copy: it is done once prepared.
    fn nothing_to_copy(&self, i: usize) -> bool {
        self.empty[i]
    }

    /// A unit of item `i` is copied; true if it was the item's last.
    fn copied(&self, i: usize) -> bool {
        // AcqRel: the worker that copies an item's last unit has seen every other unit of it
        // complete (each worker's decrement releases its copy), so what it reports is whole.
        self.remaining[i].fetch_sub(1, Ordering::AcqRel) == 1
    }
}

/// When the pipeline started and when its first copy was issued (logged with the phases at
/// debug level, to see where an operation's time goes), and the operation's progress: bytes
/// copied, and what kind of copy runs.
struct Timing<'a> {
    t0: Instant,
    /// Nanoseconds after `t0` (0: not yet).
    first_copy_ns: AtomicU64,
    progress: &'a Counters,
}

impl<'a> Timing<'a> {
    fn new(progress: &'a Counters) -> Self {
        Timing {
            t0: Instant::now(),
            first_copy_ns: AtomicU64::new(0),
            progress,
        }
    }

    /// A copy was just issued.
    fn issued(&self) {
        // Relaxed: a statistic only; the first writer wins.
        if self.first_copy_ns.load(Ordering::Relaxed) == 0 {
            let ns = (self.t0.elapsed().as_nanos() as u64).max(1);
            let _ =
                self.first_copy_ns
                    .compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// `bytes` more were copied.
    fn moved(&self, bytes: u64) {
        self.progress.moved(bytes);
    }

    fn first_copy_s(&self) -> f64 {
        self.first_copy_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// A unit to or from a backup of `kind` is being copied.
    fn copying(&self, dir: Dir, kind: BackupKind) {
        self.progress.phase(match (dir, kind.is_host()) {
            (Dir::Save, true) => Phase::CopyingToHost,
            (Dir::Save, false) => Phase::WritingToDisk,
            (Dir::Restore, true) => Phase::CopyingToDevice,
            (Dir::Restore, false) => Phase::ReadingFromDisk,
        });
    }
}

/// The coordinator's reports of completed items: acted on also after a worker failed (what is
/// complete is complete), but not after `on_done` itself failed.
struct Completions<'s, 'a, F> {
    sh: &'s Shared<'a>,
    on_done: F,
    stopped: bool,
}

impl<F: FnMut(usize) -> Result<()>> Completions<'_, '_, F> {
    fn report(&mut self, j: usize) {
        if self.stopped {
            return;
        }
        if let Err(e) = (self.on_done)(j) {
            self.stopped = true;
            self.sh.fail(e);
        }
    }
}

/// Stops the work of a pipeline whose coordinator unwinds.
struct StopOnUnwind<'a, 'b>(&'a Shared<'b>);

impl Drop for StopOnUnwind<'_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.fail(Error::Internal(
                "the copy pipeline's coordinator panicked".into(),
            ));
        }
    }
}
