//! The copy pipeline: moves backups between device allocations and host buffers with several
//! workers per device.
//!
//! # Note [The copy pipeline]
//!
//! One host↔device link moves about 50 GiB/s, but only from page-locked memory; a single CPU
//! thread copies pageable memory at a fraction of that, and page-locking fresh memory costs
//! more than filling it. So:
//!
//! - The work is cut into *chunks* (the host buffer's unit, 64 MiB by default), handed out to
//!   `threads` workers in allocation order. Each worker has two *lanes*: an event of its own on
//!   the device's one engine stream, and a small page-locked *staging slot* per lane (the
//!   device's [`Ring`]). One stream keeps the link busy; more would each cost device memory.
//! - A chunk whose host memory is page-locked is copied straight by DMA. One that is not (mmap
//!   backups; pinned backups before they are page-locked) goes through the worker's slots: the
//!   DMA fills one slot while the worker copies the other out with the CPU (to host), or the
//!   worker fills one slot while the DMA drains the other (to device). With many workers the CPU
//!   copies and the page faults of fresh memory run in parallel, and the link stays busy.
//! - Page-locking fresh memory runs at a few GiB/s and does not scale with threads (measured on
//!   an H200 host: 3 GiB/s in one call, 4 GiB/s from 16 threads), far below the link, while
//!   filling fresh memory through the slots runs at 25 GiB/s. So a first pause always goes
//!   through the slots, and pinned backups that are retained are page-locked afterwards by a
//!   background thread (`pinner.rs`, [`PinMode::Background`]); later cycles copy them straight.
//! - The coordinator prepares items in order while the workers copy what is prepared already: a
//!   resume maps allocation i+1 (or the next segment of a large allocation) while what is
//!   mapped is being copied. Each allocation whose chunks
//!   are all copied is reported to the coordinator at once, so a pause unmaps and releases it
//!   while the copies of later allocations run.
//! - A failure stops the hand-out; every worker waits for what its lanes still have queued
//!   before it returns, so no DMA touches a buffer after the call. The caller learns which
//!   allocations completed, and the engine keeps the registry true (engine Note [Pause and
//!   resume as transactions]).
//! - A chunk counts as copied only once the wait for its own lane's event succeeded: the driver
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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::progress::{Counters, Phase};
use crate::backup::{BackupKind, DiskFile, HostBuffer, HostLayout};
use crate::driver::{DevPtr, DeviceScope, Driver, Event, Stream};
use crate::error::{Error, Result};
use xxhash_rust::xxh3::Xxh3;

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
            other => Err(Error::invalid_argument(format!(
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
            return Err(Error::invalid_argument(format!(
                "{} copy threads: expected 1 to {MAX_WORKERS}",
                self.threads
            )));
        }
        let page = crate::os::page_size();
        if self.layout.chunk == 0 || self.layout.chunk % page != 0 {
            return Err(Error::invalid_argument(format!(
                "copy chunk of {} bytes: expected a positive multiple of the page size {page}",
                self.layout.chunk
            )));
        }
        if self.disk_chunk % crate::backup::disk::DIRECT_ALIGN != 0 {
            return Err(Error::invalid_argument(format!(
                "disk backup chunk of {} bytes: expected a multiple of {}",
                self.disk_chunk,
                crate::backup::disk::DIRECT_ALIGN
            )));
        }
        if self.slot == 0 || self.slot % page != 0 {
            return Err(Error::invalid_argument(format!(
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
}

/// Which way a pipeline copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dir {
    /// Device to host (pause).
    Save,
    /// Host to device (resume).
    Restore,
}

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

/// Where an item's contents go or come from.
#[derive(Clone, Copy)]
pub(super) enum Target<'a> {
    /// Host memory: copied straight where page-locked, else through the staging slots.
    Host(&'a HostBuffer),
    /// A file: always through the staging slots, checksummed per chunk.
    Disk(&'a DiskFile),
}

impl<'a> Target<'a> {
    /// The backup an allocation has, if any: its host buffer, else its file.
    pub(super) fn of(
        host: &'a Option<Arc<HostBuffer>>,
        disk: &'a Option<Arc<DiskFile>>,
    ) -> Option<Self> {
        match (host, disk) {
            (Some(h), _) => Some(Target::Host(h)),
            (None, Some(f)) => Some(Target::Disk(f)),
            (None, None) => None,
        }
    }

    fn chunks(&self) -> usize {
        match self {
            Target::Host(h) => h.chunks(),
            Target::Disk(f) => f.chunks(),
        }
    }

    fn chunk_span(&self, k: usize) -> (u64, u64) {
        match self {
            Target::Host(h) => h.chunk_span(k),
            Target::Disk(f) => f.chunk_span(k),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Target::Host(h) => h.len(),
            Target::Disk(f) => f.len(),
        }
    }
}

struct Shared<'a> {
    driver: &'a Arc<dyn Driver>,
    device: i32,
    dir: Dir,
    cfg: &'a CopyConfig,
    items: &'a [Item<'a>],
    /// Work: (item, target chunk, offset, length).
    units: Vec<(usize, usize, u64, u64)>,
    next: AtomicUsize,
    remaining: Vec<AtomicUsize>,
    /// Items prepared by the coordinator so far: workers copy only those, and the first
    /// `partial` bytes of the one being prepared.
    ready: AtomicUsize,
    partial: AtomicU64,
    gate: Mutex<()>,
    wake: Condvar,
    abort: AtomicBool,
    error: Mutex<Option<Error>>,
    /// When the pipeline started, and (ns after that, 0 = not yet) when the first copy was
    /// issued: logged with the phases at debug level, to see where an operation's time goes.
    t0: Instant,
    first_copy_ns: AtomicU64,
    /// The operation's progress: bytes copied, and what kind of copy runs.
    progress: &'a Counters,
}

impl Shared<'_> {
    fn d(&self) -> &dyn Driver {
        &**self.driver
    }

    fn fail(&self, e: Error) {
        {
            let mut first = self.error.lock();
            match &*first {
                None => *first = Some(e),
                Some(_) => tracing::error!("copy pipeline, after an earlier failure: {e}"),
            }
        }
        self.abort.store(true, Ordering::Release);
        let _g = self.gate.lock();
        self.wake.notify_all();
    }

    /// Item `ready - 1` is prepared in full.
    fn publish(&self, ready: usize) {
        self.partial.store(0, Ordering::Release);
        self.ready.store(ready, Ordering::Release);
        let _g = self.gate.lock();
        self.wake.notify_all();
    }

    /// The first `bytes` of item `ready` are prepared.
    fn publish_partial(&self, bytes: u64) {
        self.partial.store(bytes, Ordering::Release);
        let _g = self.gate.lock();
        self.wake.notify_all();
    }

    /// Wait until bytes `..end` of item `i` are prepared; false if the work was stopped first.
    fn wait_ready(&self, i: usize, end: u64) -> bool {
        let go = || {
            if self.abort.load(Ordering::Acquire) {
                return Some(false);
            }
            let ready = self.ready.load(Ordering::Acquire);
            if ready > i || (ready == i && self.partial.load(Ordering::Acquire) >= end) {
                Some(true)
            } else {
                None
            }
        };
        if let Some(v) = go() {
            return v;
        }
        let mut g = self.gate.lock();
        loop {
            if let Some(v) = go() {
                return v;
            }
            self.wake.wait(&mut g);
        }
    }
}

/// Run the pipeline over `items` on `device`, in direction `dir`. On this thread (the
/// coordinator), in item order: `prepare(i, progress)` (the resume maps the item's range here,
/// calling `progress(end)` as the allocation's bytes up to offset `end` become usable), after
/// which the workers may copy
/// item `i`; `on_done(i)` as soon as item `i` is fully copied (at once for
/// items with nothing to copy; the pause unmaps here). The first error, of a copy or of either
/// callback, stops the preparing and the hand-out of work; copies complete by then are still
/// reported, unless `on_done` itself failed. Returns the first error, once every worker is idle.
/// The workers count the bytes they copy in `progress`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    driver: &Arc<dyn Driver>,
    device: i32,
    dir: Dir,
    cfg: &CopyConfig,
    ring: &mut Ring,
    items: &[Item<'_>],
    progress: &Counters,
    mut prepare: impl FnMut(usize, &dyn Fn(u64)) -> Result<()>,
    mut on_done: impl FnMut(usize) -> Result<()>,
) -> Result<()> {
    let per_item: Vec<Vec<(usize, u64, u64)>> = items.iter().map(Item::units).collect();
    let remaining = per_item.iter().map(|u| AtomicUsize::new(u.len())).collect();
    // Items with nothing to copy are done once prepared.
    let empty: Vec<bool> = per_item.iter().map(Vec::is_empty).collect();
    let units: Vec<(usize, usize, u64, u64)> = per_item
        .into_iter()
        .enumerate()
        .flat_map(|(i, u)| u.into_iter().map(move |(k, o, n)| (i, k, o, n)))
        .collect();
    let workers = cfg.threads.clamp(1, MAX_WORKERS).min(units.len());
    if ring.slots.len() < 2 * workers {
        ring.slots.resize_with(2 * workers, || None);
    }
    let sh = Shared {
        driver,
        device,
        dir,
        cfg,
        items,
        remaining,
        units,
        next: AtomicUsize::new(0),
        ready: AtomicUsize::new(0),
        partial: AtomicU64::new(0),
        gate: Mutex::new(()),
        wake: Condvar::new(),
        abort: AtomicBool::new(false),
        error: Mutex::new(None),
        t0: Instant::now(),
        first_copy_ns: AtomicU64::new(0),
        progress,
    };
    let mut prepared_s = 0.0;
    let (tx, rx) = mpsc::channel::<usize>();
    // A worker's slots sit behind a lock, so that a worker whose thread could not be had leaves
    // them for this thread (see below).
    let lanes: Vec<Mutex<&mut [Option<HostBuffer>]>> = ring
        .slots
        .chunks_mut(2)
        .take(workers)
        .map(Mutex::new)
        .collect();
    std::thread::scope(|s| {
        let mut started = 0;
        for slots in &lanes {
            let tx = tx.clone();
            let sh = &sh;
            if crate::threads::spawn_scoped(s, "tms-copy", move || {
                worker(sh, &mut slots.lock(), tx)
            })
            .is_none()
            {
                break;
            }
            started += 1;
        }
        // No worker at all: this thread copies, once everything is prepared.
        let inline = (started == 0 && !lanes.is_empty()).then(|| tx.clone());
        drop(tx);
        // A panic on this thread (in `prepare` or `on_done`) must not leave the workers
        // waiting for items that will never be prepared: they stop, and the scope can end.
        let _stop = StopOnUnwind(&sh);
        // Completed copies are acted on also after a worker failed (what is complete is
        // complete), but not after `on_done` itself failed.
        let mut stopped = false;
        let mut done = |j: usize, stopped: &mut bool| {
            if !*stopped {
                if let Err(e) = on_done(j) {
                    *stopped = true;
                    sh.fail(e);
                }
            }
        };
        for (i, &nothing) in empty.iter().enumerate() {
            if sh.abort.load(Ordering::Acquire) {
                break;
            }
            if let Err(e) = prepare(i, &|bytes| sh.publish_partial(bytes)) {
                sh.fail(e);
                break;
            }
            sh.publish(i + 1);
            if nothing {
                done(i, &mut stopped);
            }
            while let Ok(j) = rx.try_recv() {
                done(j, &mut stopped);
            }
        }
        prepared_s = sh.t0.elapsed().as_secs_f64();
        if let (Some(tx), Some(slots)) = (inline, lanes.first()) {
            worker(&sh, &mut slots.lock(), tx);
        }
        for j in rx {
            done(j, &mut stopped);
        }
    });
    tracing::debug!(
        "copy pipeline ({:?}, device {device}): {} items, {} chunks, {workers} workers; \
         prepared at {prepared_s:.4} s, first copy at {:.4} s, done at {:.4} s",
        dir,
        items.len(),
        sh.units.len(),
        sh.first_copy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        sh.t0.elapsed().as_secs_f64()
    );
    match sh.error.into_inner() {
        Some(e) => Err(e),
        None => Ok(()),
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
        let d = sh.d();
        f(self.stream)?;
        if sh.first_copy_ns.load(Ordering::Relaxed) == 0 {
            let ns = (sh.t0.elapsed().as_nanos() as u64).max(1);
            let _ = sh
                .first_copy_ns
                .compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
        }
        d.event_record(self.events[l], self.stream)
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

/// A worker: copies chunks until there are none left or the work stops. A panic inside it (a
/// bug) fails the operation like an error: its chunk is not counted as copied.
fn worker(sh: &Shared<'_>, slots: &mut [Option<HostBuffer>], done: mpsc::Sender<usize>) {
    let res = catch_unwind(AssertUnwindSafe(|| worker_inner(sh, slots, done)));
    if let Err(p) = res {
        sh.fail(Error::internal(format!(
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
    while !sh.abort.load(Ordering::Relaxed) {
        let Some(&(i, k, off, len)) = sh.units.get(sh.next.fetch_add(1, Ordering::Relaxed)) else {
            break;
        };
        let it = &sh.items[i];
        let Some(target) = it.target else {
            break; // units are made for items with a target only
        };
        if !sh.wait_ready(i, off + len) {
            break;
        }
        sh.progress.phase(match (sh.dir, target) {
            (Dir::Save, Target::Host(_)) => Phase::CopyingToHost,
            (Dir::Save, Target::Disk(_)) => Phase::WritingToDisk,
            (Dir::Restore, Target::Host(_)) => Phase::CopyingToDevice,
            (Dir::Restore, Target::Disk(_)) => Phase::ReadingFromDisk,
        });
        let r = match target {
            Target::Host(host) => chunk(sh, it.dev, host, k, (off, len), lanes),
            Target::Disk(file) => disk_chunk(sh, it.dev, file, k, (off, len), lanes),
        };
        r.map_err(|e| {
            e.context(format!(
                "{} chunk {k} of {} bytes at {:#x} (device {})",
                match sh.dir {
                    Dir::Save => "saving",
                    Dir::Restore => "restoring",
                },
                target.len(),
                it.dev,
                sh.device
            ))
        })?;
        if sh.remaining[i].fetch_sub(1, Ordering::AcqRel) == 1 {
            // The coordinator may have stopped listening after a failure; nothing to do then.
            let _ = done.send(i);
        }
    }
    Ok(())
}

/// Copy bytes `off..off + len` (inside chunk `k`) of `host` to or from `dev`: straight if the
/// chunk is page-locked (or is made so now, in [`PinMode::Inline`]), else through the worker's
/// staging slots.
fn chunk(
    sh: &Shared<'_>,
    dev: DevPtr,
    buf: &HostBuffer,
    k: usize,
    (off, len): (u64, u64),
    lanes: &mut Lanes<'_>,
) -> Result<()> {
    let d = sh.d();
    // SAFETY: off < buf.len(), inside the buffer's mapping.
    let host = unsafe { buf.base().add(off as usize) };
    let dev = dev + off;
    if !buf.is_pinned(k) && buf.backend() == BackupKind::Pinned && sh.cfg.pin == PinMode::Inline {
        buf.pin(k)?;
    }
    if buf.is_pinned(k) {
        // SAFETY: dev..dev+len lies in the allocation being copied, mapped and accessible for the
        // whole operation; host..host+len is this worker's chunk of a live, page-locked buffer
        // that nothing else touches until the operation ends (a page-locked chunk stays so until
        // the buffer is released, which the engine's transactions exclude). The stream is waited for
        // below (or, on error, by the worker before it returns).
        lanes.issue(sh, 0, |s| unsafe {
            match sh.dir {
                Dir::Save => d.copy_d2h(host, dev, len, s),
                Dir::Restore => d.copy_h2d(dev, host, len, s),
            }
        })?;
        d.event_sync(lanes.events[0])?;
        sh.progress.moved(len);
        return Ok(());
    }
    staged(sh, &mut Side::Mem(host), dev, len, lanes)
}

/// Copy chunk `k` of a disk backup through the worker's staging slots, checksumming it: the sum
/// is recorded when saving and checked when restoring (Note [Disk backup files]). Always a whole
/// chunk: the file's chunks divide the allocation's (engine Note [Chunked allocations]).
fn disk_chunk(
    sh: &Shared<'_>,
    dev: DevPtr,
    file: &DiskFile,
    k: usize,
    part: (u64, u64),
    lanes: &mut Lanes<'_>,
) -> Result<()> {
    let (off, len) = file.chunk_span(k);
    if part != (off, len) {
        return Err(Error::internal(format!(
            "a copy of bytes {}+{} cuts disk backup chunk {k} ({off}+{len})",
            part.0, part.1
        )));
    }
    let mut side = Side::File {
        file,
        base: off,
        hash: Box::new(Xxh3::new()),
    };
    staged(sh, &mut side, dev + off, len, lanes)?;
    let Side::File { hash, .. } = side else {
        return Ok(());
    };
    match sh.dir {
        Dir::Save => {
            file.set_sum(k, hash.digest());
            Ok(())
        }
        Dir::Restore => file.check_sum(k, hash.digest()),
    }
}

/// The far side of a staged copy of one chunk: host memory, or a file with the chunk's running
/// checksum. Pieces pass in order, so the checksum streams.
enum Side<'a> {
    /// The chunk's first byte in host memory.
    Mem(*mut u8),
    File {
        file: &'a DiskFile,
        /// The chunk's offset in the file.
        base: u64,
        hash: Box<Xxh3>,
    },
}

impl Side<'_> {
    /// Restoring: put bytes `off..off+n` of the chunk into the slot.
    ///
    /// # Safety
    /// `slot` is this worker's idle slot of at least `n` bytes; for `Mem`, the range is inside
    /// this worker's chunk.
    unsafe fn load(&mut self, slot: *mut u8, off: u64, n: u64) -> Result<()> {
        match self {
            // SAFETY: this fn's contract: host+off..+n lies inside this worker's chunk of the
            // backup and the slot is this worker's idle slot of at least n bytes, so both ranges
            // are valid, nobody else touches them meanwhile, and they do not overlap.
            Side::Mem(host) => unsafe {
                std::ptr::copy_nonoverlapping(host.add(off as usize), slot, n as usize);
                Ok(())
            },
            Side::File { file, base, hash } => {
                // SAFETY: the slot is this worker's alone and idle, n bytes long at least.
                let buf = unsafe { std::slice::from_raw_parts_mut(slot, n as usize) };
                file.read_at(buf, *base + off)?;
                hash.update(buf);
                Ok(())
            }
        }
    }

    /// Saving: take bytes `off..off+n` of the chunk from the slot, whose DMA is complete.
    ///
    /// # Safety
    /// As for [`Side::load`].
    unsafe fn store(&mut self, slot: *const u8, off: u64, n: u64) -> Result<()> {
        match self {
            // SAFETY: as in load: both ranges are this worker's alone (its idle slot, its chunk
            // of the backup), at least n bytes, and do not overlap.
            Side::Mem(host) => unsafe {
                std::ptr::copy_nonoverlapping(slot, host.add(off as usize), n as usize);
                Ok(())
            },
            Side::File { file, base, hash } => {
                // SAFETY: the slot is this worker's alone, its DMA complete, n bytes long at
                // least; nothing writes it while the slice lives.
                let buf = unsafe { std::slice::from_raw_parts(slot, n as usize) };
                hash.update(buf);
                file.write_at(buf, *base + off)
            }
        }
    }
}

fn staged(
    sh: &Shared<'_>,
    side: &mut Side<'_>,
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
    let slot_ptr =
        |lanes: &Lanes<'_>, l: usize| lanes.slots[l].as_ref().expect("made above").base();
    let mut off = 0;
    let mut l = 0;
    while off < len {
        let n = slot_len.min(len - off);
        drain_lane(sh, lanes, l, side)?;
        let slot = slot_ptr(lanes, l);
        if sh.dir == Dir::Restore {
            // SAFETY: the slot is this worker's page-locked buffer of slot_len >= n bytes, idle
            // (drain_lane waited for its lane); the range is inside this worker's chunk.
            unsafe { side.load(slot, off, n) }?;
        }
        // SAFETY: as above; the device range is mapped for the whole operation. The lane is
        // waited for before the slot is touched again.
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
    drain_lane(sh, lanes, l, side)?;
    drain_lane(sh, lanes, l ^ 1, side)
}

/// Wait for lane `l`'s queued copy, and when saving, move it from the slot to the far side.
fn drain_lane(sh: &Shared<'_>, lanes: &mut Lanes<'_>, l: usize, side: &mut Side<'_>) -> Result<()> {
    let Some((off, n)) = lanes.queued[l].take() else {
        return Ok(());
    };
    sh.d().event_sync(lanes.events[l])?;
    if sh.dir == Dir::Save {
        let slot = lanes.slots[l].as_ref().expect("queued lanes have a slot");
        // SAFETY: the DMA into the slot is complete (the lane was just synchronized); the range
        // is inside this worker's chunk.
        unsafe { side.store(slot.as_ptr(), off, n) }?;
    }
    sh.progress.moved(n);
    Ok(())
}
