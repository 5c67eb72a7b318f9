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
//!   faults of fresh memory run in parallel, and the link stays busy. Into fresh host memory
//!   a pause moves smaller pieces than the slot (`CopyConfig::save_slot`, `Backing::fresh`),
//!   so that every worker's slots stay in the CPU's cache while the kernel hands out pages.
//! - Page-locking fresh memory runs at a few GiB/s and does not scale with threads (measured on
//!   an H200 host: 3 GiB/s in one call, 4 GiB/s from 16 threads), far below the link, while
//!   filling fresh memory through the slots runs at 25 GiB/s. So a first pause always goes
//!   through the slots, and pinned backups that are retained are page-locked afterwards by a
//!   background thread (`background.rs`, [`PinMode::Background`]); later cycles copy them straight.
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
mod item;
mod ready;
mod shared;
mod worker;

use std::sync::{mpsc, Arc};

use parking_lot::Mutex;

use super::progress::Counters;
use crate::backup::HostBuffer;
use crate::driver::Driver;
use crate::error::{Error, Result};
use ready::Ready;
use shared::{Queue, Shared};
use worker::worker;

pub(super) use crate::backup::Dir;
pub use config::{CopyConfig, PinMode, MAX_WORKERS};
pub(super) use item::{Changed, Item, Target};
pub(super) use shared::Timing;
pub(super) use worker::new_slot;
pub(super) use worker::Ring;

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
    /// Page-lock everything before the first item is prepared (every worker's staging slots,
    /// made now instead of on first need) and nothing after (no inline pinning): a non-blocking
    /// resume lets its caller queue work behind the restore once everything is mapped, and
    /// page-locking memory from then on can wait for that work, which waits for the restore
    /// (engine Note [Non-blocking resume]).
    pub lock_pages_first: bool,
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
        let ready = Ready::new();
        let sh = Shared {
            driver: self.driver,
            device: self.device,
            dir: self.dir,
            cfg: self.cfg,
            queue: Queue::new(self.items),
            ready,
            timing: Timing::new(self.progress),
            error: Mutex::new(None),
            pin_inline: self.cfg.pin == PinMode::Inline && !self.lock_pages_first,
        };
        let workers = self
            .cfg
            .threads
            .clamp(1, MAX_WORKERS)
            .min(sh.queue.units.len());
        let lanes = self.ring.lanes(workers);
        if self.lock_pages_first && !sh.queue.units.is_empty() {
            if let Err(e) = lanes
                .iter()
                .try_for_each(|l| worker::make_slots(&sh, &mut l.lock()))
            {
                return Err(e.context("making the staging slots"));
            }
        }
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
            self.0
                .fail(Error::internal("the copy pipeline's coordinator panicked"));
        }
    }
}
