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
//! - What a unit's backup is and how it moves is the backing's to say (`backup/backing.rs`): a
//!   page-locked host chunk is copied straight by DMA; anything else (mmap backups; pinned
//!   backups before they are page-locked; disk files, whose format, alignment and per-chunk
//!   checksums are `backup/disk_file.rs`'s) goes through the worker's slots, piece by piece
//!   through the backing's `UnitIo`: the DMA fills one slot while the worker moves the other
//!   out with the CPU (to host memory or a file), or the worker fills one slot while the DMA
//!   drains the other (to device). With many workers the CPU copies, the file I/O and the page
//!   faults of fresh memory run in parallel, and the link stays busy.
//! - Page-locking fresh memory runs at a few GiB/s and does not scale with threads (measured on
//!   an H200 host: 3 GiB/s in one call, 4 GiB/s from 16 threads), far below the link, while
//!   filling fresh memory through the slots runs at 25 GiB/s. So a first pause always goes
//!   through the slots, and pinned backups that are retained are page-locked afterwards by a
//!   background thread (`pinner.rs`, [`PinMode::Background`]); later cycles copy them straight.
//! - The coordinator prepares items in order while the workers copy what is prepared already: a
//!   resume maps allocation i+1 (or the next segment of a large allocation) while what is
//!   mapped is being copied. It publishes what is prepared, and the workers wait for it, through
//!   [`Ready`] (`ready.rs`, model-checked with loom). Each allocation whose units are all
//!   copied is reported to the coordinator at once, so a pause unmaps and releases it while the
//!   copies of later allocations run.
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

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use parking_lot::Mutex;

use super::progress::{Counters, Phase};
use super::ready::Ready;
use crate::backup::{BackupKind, Backing, DiskFile, HostBuffer, HostLayout, UnitIo};
use crate::driver::{DevPtr, DeviceScope, Driver, Event, Stream};
use crate::error::{Error, Result};

pub(super) use crate::backup::Dir;

/// When pinned backups are page-locked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinMode {
    /// After a pause or resume that retains them, on a background thread: the pause itself runs
    /// at the speed of fresh memory, through the staging slots; later cycles find the memory
    /// page-locked (chunks not yet done go through the slots meanwhile). Without retention
    /// nothing is page-locked: the buffer would be released at the next resume anyway.
    Background,
    /// By the copy worker, right before the first copy into a chunk, during the first pause
    /// (page-locking is then on that pause's critical path).
    Inline,
    /// Never: pinned backups behave as mmap ones and always go through the staging slots.
    Never,
}

impl PinMode {
    /// Parse `background`, `inline` or `never`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "background" => Ok(PinMode::Background),
            "inline" => Ok(PinMode::Inline),
            "never" => Ok(PinMode::Never),
            other => Err(Error::InvalidArgument(format!(
                "unknown pin mode {other:?}: expected background, inline or never"
            ))),
        }
    }
}

/// How backups are copied (Note [The copy pipeline]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyConfig {
    /// Copy workers per device (1 to [`MAX_WORKERS`]).
    pub threads: usize,
    /// Host buffer layout: the chunk is the unit of work and of page-locking.
    pub layout: HostLayout,
    /// Bytes of one staging slot (two per worker).
    pub slot: u64,
    /// When pinned backups are page-locked.
    pub pin: PinMode,
    /// Unit of work and of checksums of disk backups, in bytes (0: `layout.chunk`).
    pub disk_chunk: u64,
}

/// Most workers per device.
pub const MAX_WORKERS: usize = 64;

impl Default for CopyConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        CopyConfig {
            threads: cores.clamp(1, 16),
            layout: HostLayout::default(),
            slot: 4 << 20,
            pin: PinMode::Background,
            disk_chunk: 0,
        }
    }
}

impl CopyConfig {
    /// Refuse settings the pipeline cannot work with.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_WORKERS).contains(&self.threads) {
            return Err(Error::InvalidArgument(format!(
                "{} copy threads: expected 1 to {MAX_WORKERS}",
                self.threads
            )));
        }
        let page = crate::os::page_size();
        if self.layout.chunk == 0 || self.layout.chunk % page != 0 {
            return Err(Error::InvalidArgument(format!(
                "copy chunk of {} bytes: expected a positive multiple of the page size {page}",
                self.layout.chunk
            )));
        }
        // The file format's rule (its alignment), which the disk backing owns.
        DiskFile::check_chunk_setting(self.disk_chunk)?;
        if self.slot == 0 || self.slot % page != 0 {
            return Err(Error::InvalidArgument(format!(
                "staging slot of {} bytes: expected a positive multiple of the page size {page}",
                self.slot
            )));
        }
        Ok(())
    }
}

/// Page-locked staging slots of one device, two per worker, kept between operations.
#[derive(Default)]
pub(super) struct Ring {
    slots: Vec<Option<HostBuffer>>,
}

impl Ring {
    /// Page-locked bytes held.
    pub(super) fn bytes(&self) -> u64 {
        self.slots.iter().flatten().map(HostBuffer::len).sum()
    }

    /// The slots of `workers` workers, two each, made on first need. Each pair sits behind a
    /// lock, so that a worker whose thread could not be had leaves its pair for the
    /// coordinator (see [`Pipeline::run`]).
    fn lanes(&mut self, workers: usize) -> Vec<Mutex<&mut [Option<HostBuffer>]>> {
        if self.slots.len() < 2 * workers {
            self.slots.resize_with(2 * workers, || None);
        }
        self.slots.chunks_mut(2).take(workers).map(Mutex::new).collect()
    }
}

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
        mut prepare: impl FnMut(usize, &dyn Fn(u64)) -> Result<()>,
        on_done: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let queue = Queue::new(self.items);
        let workers = self.cfg.threads.clamp(1, MAX_WORKERS).min(queue.units.len());
        let lanes = self.ring.lanes(workers);
        let sh = Shared {
            driver: self.driver,
            device: self.device,
            dir: self.dir,
            cfg: self.cfg,
            queue,
            ready: Ready::new(),
            timing: Timing::new(self.progress),
            error: Mutex::new(None),
        };
        let mut prepared_s = 0.0;
        let (tx, rx) = mpsc::channel::<usize>();
        std::thread::scope(|s| {
            let started = lanes
                .iter()
                .map_while(|slots| {
                    let (sh, tx) = (&sh, tx.clone());
                    crate::threads::spawn_scoped(s, "tms-copy", move || {
                        worker(sh, &mut slots.lock(), tx)
                    })
                })
                .count();
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
                rx.try_iter().for_each(|j| done.report(j));
            }
            prepared_s = sh.timing.t0.elapsed().as_secs_f64();
            if let (Some(tx), Some(slots)) = (inline, lanes.first()) {
                worker(&sh, &mut slots.lock(), tx);
            }
            rx.iter().for_each(|j| done.report(j));
        });
        tracing::debug!(
            "copy pipeline ({:?}, device {}): {} items, {} chunks, {workers} workers; \
             prepared at {prepared_s:.4} s, first copy at {:.4} s, done at {:.4} s",
            sh.dir,
            sh.device,
            sh.queue.items.len(),
            sh.queue.units.len(),
            sh.timing.first_copy_s(),
            sh.timing.t0.elapsed().as_secs_f64()
        );
        match sh.error.into_inner() {
            Some(e) => Err(e),
            None => Ok(()),
        }
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

impl Shared<'_> {
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
            let _ = self
                .first_copy_ns
                .compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
        }
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

/// A worker's two lanes on the device's stream: an event each (to wait for the lane's own copy
/// only), a staging slot each (made on first need), and what each lane has queued and not yet
/// waited for.
struct Lanes<'s> {
    stream: Stream,
    events: [Event; 2],
    slots: &'s mut [Option<HostBuffer>],
    queued: [Option<(u64, u64)>; 2],
}

impl Lanes<'_> {
    /// Queue the copy `f` on the stream for lane `l`, and mark it with the lane's event.
    fn issue(&self, sh: &Shared<'_>, l: usize, f: impl FnOnce(Stream) -> Result<()>) -> Result<()> {
        f(self.stream)?;
        sh.timing.issued();
        sh.d().event_record(self.events[l], self.stream)
    }

    /// Lane `l`'s staging slot (made by [`staged`] before any use).
    fn slot(&mut self, l: usize) -> Result<&mut HostBuffer> {
        self.slots[l]
            .as_mut()
            .ok_or_else(|| Error::Internal("a staging slot used before it was made".into()))
    }
}

/// A worker: copies units until there are none left or the work stops. A panic inside it (a
/// bug) fails the operation like an error: its unit is not counted as copied.
fn worker(sh: &Shared<'_>, slots: &mut [Option<HostBuffer>], done: mpsc::Sender<usize>) {
    let res = catch_unwind(AssertUnwindSafe(|| worker_inner(sh, slots, done)));
    if let Err(p) = res {
        sh.fail(Error::Internal(format!(
            "a copy worker panicked (a bug): {}",
            crate::error::panic_message(&*p)
        )));
    }
}

fn worker_inner(sh: &Shared<'_>, slots: &mut [Option<HostBuffer>], done: mpsc::Sender<usize>) {
    let res = (|| -> Result<()> {
        let _scope = DeviceScope::enter(sh.d(), sh.device)?;
        let stream = sh.d().stream(sh.device)?;
        let e0 = sh.d().event_create(sh.device)?;
        let e1 = match sh.d().event_create(sh.device) {
            Ok(e) => e,
            Err(e) => {
                sh.d().event_destroy(e0);
                return Err(e);
            }
        };
        let mut lanes = Lanes {
            stream,
            events: [e0, e1],
            slots,
            queued: [None, None],
        };
        let res = work(sh, &mut lanes, &done);
        if res.is_err() {
            // Let nothing queued outlive the call: a late DMA must not land in a buffer that
            // is about to be reused or freed.
            let _ = sh.d().stream_sync(stream);
        }
        for e in lanes.events {
            sh.d().event_destroy(e);
        }
        res
    })();
    if let Err(e) = res {
        sh.fail(e);
    }
}

fn work(sh: &Shared<'_>, lanes: &mut Lanes<'_>, done: &mpsc::Sender<usize>) -> Result<()> {
    while !sh.ready.stopped() {
        let Some(u) = sh.queue.take() else {
            break;
        };
        let it = &sh.queue.items[u.item];
        let Some(target) = it.target else {
            break; // units are made for items with a target only
        };
        if !sh.ready.wait(u.item, u.off + u.len) {
            break;
        }
        sh.timing.copying(sh.dir, target.kind());
        copy_unit(sh, it.dev, target, u, lanes).map_err(|e| {
            e.context(format!(
                "{} chunk {} of {} bytes at {:#x} (device {})",
                match sh.dir {
                    Dir::Save => "saving",
                    Dir::Restore => "restoring",
                },
                u.chunk,
                target.len(),
                it.dev,
                sh.device
            ))
        })?;
        if sh.queue.copied(u.item) {
            // The coordinator may have stopped listening after a failure; nothing to do then.
            let _ = done.send(u.item);
        }
    }
    Ok(())
}

/// Copy unit `u` between the allocation at `dev` and its backing: straight if the backing
/// offers the unit's host memory page-locked, else through the worker's staging slots.
fn copy_unit(
    sh: &Shared<'_>,
    dev: DevPtr,
    target: &dyn Backing,
    u: Unit,
    lanes: &mut Lanes<'_>,
) -> Result<()> {
    let d = sh.d();
    let dev = dev + u.off;
    let pin_now = sh.cfg.pin == PinMode::Inline;
    if let Some(host) = target.direct(u.chunk, u.off, pin_now)? {
        // SAFETY: dev..dev+len lies in the allocation being copied, mapped and accessible for the
        // whole operation; host..host+len is this worker's unit of a live, page-locked buffer
        // that nothing else touches until the operation ends (a page-locked chunk stays so until
        // the buffer is released, which the engine's transactions exclude). The stream is waited for
        // below (or, on error, by the worker before it returns).
        lanes.issue(sh, 0, |s| unsafe {
            match sh.dir {
                Dir::Save => d.copy_d2h(host, dev, u.len, s),
                Dir::Restore => d.copy_h2d(dev, host, u.len, s),
            }
        })?;
        d.event_sync(lanes.events[0])?;
        sh.timing.progress.moved(u.len);
        return Ok(());
    }
    // SAFETY: the queue hands each unit out once, to this worker, and units do not overlap; the
    // engine's transaction keeps every other user off the backup until the pipeline ends.
    unsafe {
        target.staged(sh.dir, u.chunk, u.off, u.len, &mut |io| {
            staged(sh, io, dev, u.len, lanes)
        })
    }
}

/// Copy `len` bytes between `dev` and the backing's side of a unit (`io`) through the worker's
/// two staging slots, alternating lanes so that a DMA and a CPU copy overlap.
fn staged(
    sh: &Shared<'_>,
    io: &mut dyn UnitIo,
    dev: DevPtr,
    len: u64,
    lanes: &mut Lanes<'_>,
) -> Result<()> {
    let d = sh.d();
    let slot_len = sh.cfg.slot;
    for slot in lanes.slots.iter_mut() {
        if slot.as_ref().is_none_or(|s| s.len() != slot_len) {
            *slot = None;
            let layout = HostLayout {
                chunk: slot_len,
                ..sh.cfg.layout
            };
            let s = HostBuffer::new(
                sh.driver.clone(),
                sh.device,
                BackupKind::Pinned,
                slot_len,
                layout,
            )?;
            s.pin_all()?;
            *slot = Some(s);
        }
    }
    let mut off = 0;
    let mut l = 0;
    while off < len {
        let n = slot_len.min(len - off);
        drain_lane(sh, lanes, l, io)?;
        // Idle: drain_lane waited for its lane.
        let slot = lanes.slot(l)?;
        if sh.dir == Dir::Restore {
            io.load(off, &mut slot.as_mut_slice()[..n as usize])?;
        }
        let slot = slot.base();
        // SAFETY: the slot is this worker's page-locked buffer of slot_len >= n bytes, idle; the
        // device range is mapped for the whole operation. The lane is waited for before the
        // slot is touched again.
        lanes.issue(sh, l, |s| unsafe {
            match sh.dir {
                Dir::Save => d.copy_d2h(slot, dev + off, n, s),
                Dir::Restore => d.copy_h2d(dev + off, slot, n, s),
            }
        })?;
        lanes.queued[l] = Some((off, n));
        off += n;
        l ^= 1;
    }
    // The older lane first, then the newer.
    drain_lane(sh, lanes, l, io)?;
    drain_lane(sh, lanes, l ^ 1, io)
}

/// Wait for lane `l`'s queued copy, and when saving, hand it from the slot to the backing.
fn drain_lane(
    sh: &Shared<'_>,
    lanes: &mut Lanes<'_>,
    l: usize,
    io: &mut dyn UnitIo,
) -> Result<()> {
    let Some((off, n)) = lanes.queued[l].take() else {
        return Ok(());
    };
    sh.d().event_sync(lanes.events[l])?;
    if sh.dir == Dir::Save {
        // The DMA into the slot is complete: the lane was just synchronized.
        let slot = lanes.slot(l)?;
        io.store(off, &slot.as_slice()[..n as usize])?;
    }
    sh.timing.progress.moved(n);
    Ok(())
}
