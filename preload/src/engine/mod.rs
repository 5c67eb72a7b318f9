//! The engine: a registry of pauseable allocations and the pause/resume transactions over
//! [`Driver`].
//!
//! # Note [Pause and resume as transactions]
//!
//! Every allocation is one reserved address range with physical memory mapped over all of it in
//! segments of up to 1 GiB, one handle each (`segment.rs`): VMM calls cost per handle, so
//! segments are large, but a resume can copy into the first segments of a huge allocation while
//! it maps the next.
//!
//! The registry (`registry.rs`) is a small index: for each allocation its place, tag, backup and
//! state, *Active*, *Pausing*, *Paused* or *Resuming*. Its lock is held only to read or change
//! entries, never across a driver call, a copy or a wait, so the hooks' questions (is this
//! pointer ours? a new allocation, a free of someone else's memory) never wait for a pause: a
//! thread the GPU's work depends on (a host callback, a proxy thread) keeps running while a pause
//! synchronizes the device. Pauses and resumes run one at a time (the `ops` lock, which also
//! holds the staging slots); the hooks never take it.
//!
//! *Pause* marks the tag's active allocations Pausing and works on a copy of what it needs:
//! backups are prepared (after checking the host can hold them: backups are touched only while
//! copying, so a pause larger than the host's memory would be killed mid-copy instead of
//! failing), each device is synchronized, and the copies run in the pipeline (Note [The copy
//! pipeline] in `pipeline.rs`). Each allocation is unmapped, released and recorded Paused as soon
//! as its own copy is complete. The first failure stops the work; those not retired go back to
//! Active, still mapped (a backup partly written for them is not claimed valid). If only a
//! release fails, the allocation is Paused all the same (unmapped, its contents in the backup)
//! and the handle is reported.
//!
//! *Resume* marks the tag's paused allocations Resuming, then creates, maps and enables access
//! for each (as `segment::Mapping`s) while the pipeline copies the backups back. All or
//! nothing: on any failure the mappings are dropped, which undoes them, and the tag stays paused
//! with its backups; the error (out of memory, typically) goes to the caller, who may free memory
//! and call again. A segment that undoing cannot unmap (twice) stays paused in the registry with
//! its backup and is recorded as stuck: the next resume of its allocation, or its free, unmaps it
//! first (and fails, changing nothing, if that still fails). Otherwise every allocation is
//! committed Active at once and, unless retention is on, its backup and the staging slots are
//! released, in parallel, after both locks are let go.
//!
//! A guard (`Settle`) returns every allocation still in transition to where it came from when a
//! transaction ends, by error or by unwind; and after an unwind the engine refuses further
//! pauses, resumes and allocations (it cannot know what the panic left undone).
//!
//! *Free* of an allocation in transition waits for that allocation to settle (a pause retires
//! each one as soon as its copy is done), then removes it; if unmapping fails it is put back,
//! still active. A failure after the unmap (releasing the handle, or giving back the address
//! range) is reported but the allocation is gone: only that handle or range leaks.
//!
//! *Backups* are shared, never overwritten under a reader: [`Engine::acquire_cpu_backup`] hands
//! out a reference that keeps a snapshot alive and unchanged (a pause then writes a new buffer;
//! a resume without retention leaves it to its last holder), and only complete snapshots are
//! ever handed out.

//! # Note [Chunked allocations]
//!
//! An allocation made with a chunk size (`AllocRequest::chunk`, a multiple of the device's
//! granularity that divides its size) is mapped in segments of exactly that size, and each
//! segment is a *chunk* that pauses and resumes on its own (`Pick::chunks`): the registry keeps,
//! per segment, its handle while mapped and whether the backup holds its contents (`saved`). A
//! transaction works on runs of consecutive segments, one pipeline item each, so pausing or
//! resuming k chunks costs k chunks' VMM calls plus their copies. Whole-allocation pauses and
//! resumes are the same transactions over every mapped (paused) segment, so the two compose in
//! any order; an allocation with some chunks of each is *Partial*. A disk backup's file is cut
//! in chunks that divide the allocation's, so a chunk's checksum never spans two of them; a
//! host buffer may be copied in parts of its chunks. A pause can record which chunks were active
//! (`Pick::chunk_state`) for a resume to bring back only those.

//! # Note [Locks]
//!
//! Every lock of the library (all `parking_lot` unless said), what it guards, who takes it,
//! what may be taken while it is held, and what is never done under it. Lock order: `ops` before
//! `reg`; every other lock is a leaf (nothing else is taken while it is held), except where said.
//!
//! - `Engine::ops` (the operations lock): serializes pauses, resumes (`pause.rs`, `resume.rs`)
//!   and the tools' copies (`with_active`), and owns the staging slots (`Ops::rings`;
//!   `staging_bytes` reads them). Held for a whole transaction, across driver calls, copies,
//!   file I/O and device synchronizations. Under it: `reg` (briefly), `progress`'s lock,
//!   `disk_dir`/`disk_default`, a `BackupDir`'s `files`, the pipeline's locks. The hooks
//!   (`alloc`, `free`, `owns`) and `stats` never take it. Never taken while holding `reg`. A
//!   pause or resume enters the pinner's quiet state before taking it.
//! - `Engine::reg` (the registry lock, with the `settled` condvar): the index of allocations
//!   (`registry.rs`). Taken briefly by everyone: the hooks, transactions to mark and settle
//!   allocations, `Settle`, `stats`, `free` (which waits on `settled` for an allocation in
//!   transition). Under it: `tags_seen` only. Never held across a driver call, a copy, file I/O
//!   or a wait other than `settled`'s, and never while taking `ops`: a thread the device's work
//!   waits for may be in `cudaFree` while a pause synchronizes the device.
//! - `Engine::tags_seen`, `copy`, `leases`, `broken`, `disk_dir`, `disk_default`: leaves, each
//!   guarding its field. `disk_default` is held while the system's temporary directory is opened
//!   (a non-blocking open). A buffer leaving `leases` is dropped after the lock is let go.
//! - `Tracker::current` (`progress.rs`): the running operation; set and cleared by the
//!   transaction (under `ops`), read by `progress` watchers. A leaf; never taken with `reg`.
//! - `Pinner::queue` (`pinner.rs`, with the `idle` and `ops_done` condvars): the background
//!   pinner's queue and its handshake with transactions (`quiet`, `busy`). Held only to change
//!   those fields or wait on them; page-locking runs outside it. A leaf.
//! - The copy pipeline's `gate` (with `wake`), `error`, and each worker's lane of staging slots
//!   (`pipeline.rs`), and the job slots of `per_device`: each lives for one pipeline or one
//!   call, under `ops`. `gate` and `error` are leaves held for a store or a wait; a lane is held
//!   by its one worker for the whole run, and a job slot by the thread that runs its job, driver
//!   calls and copies included (nobody else ever wants them).
//! - `BackupDir::files` (`backup/disk.rs`): the prepared folder of disk backups; held while it
//!   is made and checked on first use (file system calls that cannot block: Note [The disk backup
//!   folder]), not while sweeping. `FAULTS`: armed file faults (testing aid), a leaf.
//! - `flock` on each disk backup file: exclusive, taken without waiting when the file is made
//!   and held until the file is removed; the sweep takes others' files' locks without waiting
//!   to learn that their process died (Note [Disk backup files]). Never waited for.
//! - `control`: `conns::Table::inner` (the connections served) and `dispatch::IN_FLIGHT` (the
//!   socket's operations not ended) are leaves held for a few field changes, never across I/O
//!   or an engine call.
//! - `settings::DEFAULT_REGION` (an `RwLock`): the process-wide default region; read by the
//!   hooks, written by `set_default_region`. A leaf.
//! - The simulated driver (`driver/sim/`): `inner` (`mod.rs`: all simulated state, that of
//!   `memory.rs`, `streams.rs`, `host.rs` and `faults.rs`; held for each primitive, so the
//!   engine's locks are always taken before it), and in `gates.rs` `holds` with `holds_changed`
//!   (held primitives wait on it, before taking `inner`), `sync_delay` and `link` (leaves; the
//!   simulated time is slept with no lock held).
//! - `OnceLock`s (the runtime, the process settings, the control socket's state, the CUDA
//!   driver's contexts and streams, the interposed symbols) are set once and never waited on
//!   after that.

mod pause;
mod pinner;
mod pipeline;
mod progress;
mod registry;
mod resident;
mod resume;
pub mod segment;
mod stats;
mod transfer;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

pub use pipeline::{CopyConfig, PinMode, MAX_WORKERS};
pub use progress::{Backing, Phase, Progress, Which};
pub use segment::{segments, SEGMENT_BYTES};
pub use stats::{OpStats, Stats, TagStats};

use crate::backup::{BackupKind, DiskFile, HostBuffer};
use crate::driver::{DevPtr, DeviceScope, Driver};
use crate::error::{Error, Result, ResultExt};
use crate::units::human;
use pinner::Pinner;
use pipeline::Ring;
use registry::{Allocation, Registry};
use segment::{Mapping, Span};

/// A host buffer and byte ranges of it.
type BufferRanges = (Arc<HostBuffer>, Vec<(u64, u64)>);

/// How long handing out a retained pinned backup waits for its background page-locking.
const PIN_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// CPU-backup policy of an allocation.
pub type Backup = Option<BackupKind>;

/// What to allocate.
#[derive(Clone, Debug, Default)]
pub struct AllocRequest {
    /// Bytes asked for (> 0).
    pub size: u64,
    /// Device ordinal.
    pub device: i32,
    /// Tag the allocation belongs to.
    pub tag: String,
    /// Keep contents across pause in host memory of this kind.
    pub backup: Backup,
    /// Chunk size of a chunked allocation (Note [Chunked allocations]); 0: not chunked.
    pub chunk: u64,
}

/// Whether physical memory is behind an allocation, or a transaction is changing that.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Mapped and usable.
    Active,
    /// A pause is saving and releasing it (still mapped).
    Pausing,
    /// Unmapped; the address range stays reserved.
    Paused,
    /// Some chunks mapped and the others paused (chunked allocations).
    Partial,
    /// A resume is mapping and restoring it.
    Resuming,
}

/// A read-only view of one allocation, for tests and tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocInfo {
    /// Start address.
    pub addr: DevPtr,
    /// Bytes asked for.
    pub size: u64,
    /// Bytes mapped (size rounded up to the granularity).
    pub mapped: u64,
    /// Device ordinal.
    pub device: i32,
    /// Tag.
    pub tag: String,
    /// Backup policy.
    pub backup: Backup,
    /// Current state.
    pub state: State,
    /// Bytes of host memory held for this allocation's backup (for a chunked allocation, those
    /// of the chunks the backup holds).
    pub host_bytes: u64,
    /// Bytes of that host memory page-locked.
    pub host_pinned_bytes: u64,
    /// Bytes of the disk backup's file.
    pub disk_bytes: u64,
    /// True when the host backup holds a complete snapshot: the contents while paused, the last
    /// pause's contents while active with the backup retained.
    pub host_valid: bool,
    /// Physical handles (segments) mapped: none while paused.
    pub handles: usize,
    /// Chunk size of a chunked allocation, else 0.
    pub chunk: u64,
    /// Bytes mapped now (less than `mapped` while some chunks are paused).
    pub active_bytes: u64,
    /// False for allocations that pause and resume leave alone (see [`Engine::alloc_unpauseable`]).
    pub pauseable: bool,
    /// Kept mapped by every pause and resume until freed (see [`Engine::keep_resident`]).
    pub resident: bool,
}

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
}

impl OpReport {
    /// Where the copied bytes went or came from, in words for log messages: `" (2.00 GiB
    /// written to disk)"` for a pause, `""` when nothing was copied.
    fn copies(&self, pause: bool) -> String {
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
        if parts.is_empty() {
            String::new()
        } else {
            format!(" ({})", parts.join(", "))
        }
    }
}

/// A host backup handed out by [`Engine::acquire_cpu_backup`]: the address of the bytes asked
/// for, valid and unchanged until [`Engine::release_cpu_backup`] of `lease`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackupLease {
    /// Start of the bytes asked for.
    pub ptr: *const u8,
    /// What to pass to [`Engine::release_cpu_backup`].
    pub lease: u64,
}

/// What a pause or resume acts on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pick<'a> {
    /// Allocations of this tag (every tag if `None`).
    pub tag: Option<&'a str>,
    /// Only the allocation starting here.
    pub alloc: Option<DevPtr>,
    /// Only these chunks of it (a chunked allocation; sorted, each once).
    pub chunks: Option<&'a [usize]>,
    /// Pause: record which chunks of each allocation were active (a whole allocation: whether
    /// it was). Resume: bring back only what was so recorded (all, where nothing was recorded).
    pub chunk_state: bool,
    /// A number the caller gives the operation, reported with its progress
    /// ([`Engine::progress`]) so that the caller can tell its own operation from another's
    /// (the control server's request number).
    pub label: Option<u64>,
}

impl<'a> Pick<'a> {
    /// Every allocation of `tag` (every tag if `None`), whole.
    pub fn tag(tag: Option<&'a str>) -> Self {
        Pick {
            tag,
            ..Default::default()
        }
    }

    /// These chunks of the chunked allocation at `alloc`.
    pub fn chunks(alloc: DevPtr, chunks: &'a [usize]) -> Self {
        Pick {
            alloc: Some(alloc),
            chunks: Some(chunks),
            ..Default::default()
        }
    }

    fn selects(&self, ptr: DevPtr, a: &Allocation) -> bool {
        self.tag.is_none_or(|t| &*a.tag == t) && self.alloc.is_none_or(|p| p == ptr)
    }

    fn wants(&self, seg: usize) -> bool {
        self.chunks.is_none_or(|c| c.binary_search(&seg).is_ok())
    }

    /// Refuse chunks of an allocation that is not chunked, or that it does not have.
    fn check(&self, reg: &Registry) -> Result<()> {
        let Some(ptr) = self.alloc else {
            return Ok(());
        };
        let a = reg.allocs.get(&ptr).ok_or_else(|| {
            Error::NotFound(format!(
                "{ptr:#x} is not the start of a pauseable allocation"
            ))
        })?;
        if a.resident {
            return Err(Error::InvalidState(format!(
                "allocation {ptr:#x} (tag {:?}) is kept resident (keep_resident): pause and \
                 resume leave it mapped until it is freed",
                a.tag
            )));
        }
        let Some(chunks) = self.chunks else {
            return Ok(());
        };
        if a.chunk == 0 {
            return Err(Error::InvalidArgument(format!(
                "allocation {ptr:#x} (tag {:?}) is not chunked: it pauses and resumes whole \
                 (allocate it in a region with a chunk size)",
                a.tag
            )));
        }
        if !chunks.windows(2).all(|w| w[0] < w[1]) {
            return Err(Error::InvalidArgument(
                "chunk indices must be sorted and each given once".into(),
            ));
        }
        let n = a.handles.len();
        if let Some(bad) = chunks.iter().find(|&&c| c >= n) {
            return Err(Error::InvalidArgument(format!(
                "chunk {bad} of allocation {ptr:#x} (tag {:?}): it has {n} chunks (0 to {})",
                a.tag,
                n - 1
            )));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let mut d = describe(self.tag);
        if let Some(p) = self.alloc {
            d = format!("allocation {p:#x}");
        }
        if let Some(c) = self.chunks {
            d = format!("{} of {d}", crate::units::ranges(c));
        }
        d
    }
}

/// Where one allocation's chunks lie and which are active.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Start of the allocation.
    pub addr: DevPtr,
    /// Its tag.
    pub tag: String,
    /// Chunk size in bytes.
    pub chunk: u64,
    /// Per chunk: offset and size in bytes.
    pub layout: Vec<(u64, u64)>,
    /// Per chunk: mapped now (its contents on the device).
    pub active: Vec<bool>,
}

/// Run `f` on each device's job: on this thread for one device, else on a thread per device.
fn per_device<J: Send, T: Send>(jobs: Vec<J>, f: impl Fn(J) -> T + Sync) -> Vec<T> {
    if jobs.len() <= 1 {
        return jobs.into_iter().map(f).collect();
    }
    // Each job waits in a slot until a thread takes it; a job whose thread could not be had
    // runs here, after the others were started.
    let slots: Vec<Mutex<Option<J>>> = jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    let run = |i: usize| slots[i].lock().take().map(&f);
    let run = &run;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..slots.len())
            .map(|i| crate::threads::spawn_scoped(s, "tms-device", move || run(i)))
            .collect();
        handles
            .into_iter()
            .enumerate()
            .filter_map(|(i, h)| match h {
                Some(h) => match h.join() {
                    Ok(t) => t,
                    Err(p) => std::panic::resume_unwind(p),
                },
                None => run(i),
            })
            .collect()
    })
}

/// The indices of `devices` (one per job) grouped by device.
fn by_device(devices: impl Iterator<Item = i32>) -> BTreeMap<i32, Vec<usize>> {
    let mut groups: BTreeMap<i32, Vec<usize>> = BTreeMap::new();
    for (i, d) in devices.enumerate() {
        groups.entry(d).or_default().push(i);
    }
    groups
}

/// Each device's jobs next to its staging ring (made if missing): what a pause or resume hands
/// to its per-device coordinators.
fn device_work<'a>(
    groups: &'a BTreeMap<i32, Vec<usize>>,
    rings: &'a mut BTreeMap<i32, Ring>,
) -> Vec<(i32, &'a Vec<usize>, &'a mut Ring)> {
    for device in groups.keys() {
        rings.entry(*device).or_default();
    }
    rings
        .iter_mut()
        .filter_map(|(device, ring)| Some((*device, groups.get(device)?, ring)))
        .collect()
}

/// A pause's or resume's numbers, in all and per tag.
#[derive(Default)]
struct Tally {
    report: OpReport,
    per_tag: HashMap<Arc<str>, OpReport>,
}

impl Tally {
    fn add(&mut self, tag: &Arc<str>, bytes: u64, copied: u64, on_disk: bool) {
        self.allocation(tag);
        self.bytes(tag, bytes, copied, on_disk);
    }

    fn allocation(&mut self, tag: &Arc<str>) {
        let t = self.per_tag.entry(tag.clone()).or_default();
        for r in [t, &mut self.report] {
            r.allocations += 1;
        }
    }

    /// `copied` of `bytes` went to or came from a backup, a file if `on_disk`.
    fn bytes(&mut self, tag: &Arc<str>, bytes: u64, copied: u64, on_disk: bool) {
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

/// The first error (in device order); the others are logged.
fn first_error(results: impl IntoIterator<Item = Result<()>>) -> Result<()> {
    let mut first = Ok(());
    for r in results {
        if let Err(e) = r {
            if first.is_ok() {
                first = Err(e);
            } else {
                tracing::error!("another device failed too: {e}");
            }
        }
    }
    first
}

/// Refuse `Some("")`: no tag (`None`) is how every tag is named.
fn check_tag(tag: Option<&str>) -> Result<()> {
    if tag == Some("") {
        return Err(Error::InvalidArgument(
            "tag must not be empty (no tag means every tag)".into(),
        ));
    }
    Ok(())
}

fn describe(tag: Option<&str>) -> String {
    match tag {
        Some(t) => format!("tag {t:?}"),
        None => "all tags".to_string(),
    }
}

/// Pauses and resumes, one at a time; and what they keep between calls.
#[derive(Default)]
struct Ops {
    /// Each device's staging slots.
    rings: BTreeMap<i32, Ring>,
}

/// The registry of pauseable allocations over one driver. Thread-safe.
pub struct Engine {
    driver: Arc<dyn Driver>,
    reg: Mutex<Registry>,
    /// Notified whenever an allocation leaves a transition (see [`Engine::free`]).
    settled: Condvar,
    ops: Mutex<Ops>,
    retain: AtomicBool,
    margin: AtomicU64,
    segment: AtomicU64,
    copy: Mutex<CopyConfig>,
    pinner: Arc<Pinner>,
    /// Every tag an allocation ever had (never cleared), for [`Engine::tag_known`]. A lock of
    /// its own, and a leaf (nothing is taken while it is held), so asking never waits for a
    /// pause.
    tags_seen: Mutex<HashSet<Box<str>>>,
    /// Directory of new disk backup files (`None`: `disk_default`).
    disk_dir: Mutex<Option<Arc<crate::backup::disk::BackupDir>>>,
    /// The default one (`TMS_DISK_BACKUP_DIR`; `None`: the system's temporary directory, resolved
    /// and kept here on first use).
    disk_default: Mutex<Option<Arc<crate::backup::disk::BackupDir>>>,
    /// Backups handed out by [`Engine::acquire_cpu_backup`], by lease number.
    leases: Mutex<HashMap<u64, Arc<HostBuffer>>>,
    next_lease: AtomicU64,
    /// The running pause or resume, for those who watch it ([`Engine::progress`]).
    progress: progress::Tracker,
    /// Set when a panic (a bug) unwound through a pause or resume: the registry may then no
    /// longer describe the device truly, so pause, resume and new pauseable allocations refuse
    /// with this message instead of acting on it.
    broken: Mutex<Option<String>>,
    /// The one device allocations were asked on so far ([`NO_DEVICE`] before the first,
    /// [`SEVERAL_DEVICES`] once a second shows up): what log lines name, read without a lock
    /// since a line may be written with any of the engine's held.
    device: AtomicI32,
}

/// `Engine::device` before any allocation.
const NO_DEVICE: i32 = -1;
/// `Engine::device` once allocations were asked on two devices.
const SEVERAL_DEVICES: i32 = -2;

/// Marks the engine broken if a panic unwinds through the operation it guards.
struct BreakOnUnwind<'a> {
    engine: &'a Engine,
    what: String,
}

impl Drop for BreakOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("a panic (a bug) unwound through {}", self.what);
            *self.engine.broken.lock() = Some(format!(
                "torch-memory-saver stopped after an internal error (a bug) during {}: its record \
                 of the device may be wrong, so it no longer pauses, resumes or allocates; \
                 restart the process",
                self.what
            ));
        }
    }
}

/// Returns the allocations a transaction marked, and that are still in transition when it ends
/// (by error or unwind), to the state they came from, and wakes those waiting for them.
struct Settle<'a> {
    engine: &'a Engine,
    ptrs: Vec<DevPtr>,
    during: State,
}

impl<'a> Settle<'a> {
    fn new(engine: &'a Engine, ptrs: impl Iterator<Item = DevPtr>, during: State) -> Self {
        Settle {
            engine,
            ptrs: ptrs.collect(),
            during,
        }
    }
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        {
            // What a pause wrote for segments it did not retire is not marked saved (the pause
            // cleared that when it began), so the handles tell all.
            let mut reg = self.engine.reg.lock();
            for p in &self.ptrs {
                if let Some(a) = reg.allocs.get_mut(p).filter(|a| a.state == self.during) {
                    a.state = a.settled();
                }
            }
        }
        self.engine.settled.notify_all();
    }
}

impl Engine {
    /// An empty engine over `driver`.
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        Engine {
            driver,
            reg: Mutex::new(Registry::default()),
            settled: Condvar::new(),
            ops: Mutex::default(),
            retain: AtomicBool::new(false),
            margin: AtomicU64::new(0),
            segment: AtomicU64::new(SEGMENT_BYTES),
            copy: Mutex::new(CopyConfig::default()),
            pinner: Arc::default(),
            tags_seen: Mutex::default(),
            disk_dir: Mutex::default(),
            disk_default: Mutex::default(),
            leases: Mutex::default(),
            next_lease: AtomicU64::new(1),
            progress: progress::Tracker::default(),
            broken: Mutex::new(None),
            device: AtomicI32::new(NO_DEVICE),
        }
    }

    /// The device of every allocation asked for so far, when that is one device.
    pub fn sole_device(&self) -> Option<i32> {
        let d = self.device.load(Ordering::Relaxed);
        (d >= 0).then_some(d)
    }

    fn note_device(&self, device: i32) {
        let seen = self.device.load(Ordering::Relaxed);
        if seen == device || seen == SEVERAL_DEVICES {
            return;
        }
        if let Err(other) =
            self.device
                .compare_exchange(NO_DEVICE, device, Ordering::Relaxed, Ordering::Relaxed)
        {
            if other != device {
                self.device.store(SEVERAL_DEVICES, Ordering::Relaxed);
            }
        }
    }

    /// The pause or resume running now, whoever started it, and how far it has got; `None`
    /// when none runs. Cheap, and never waits for the operation: a status or a progress
    /// display may ask as often as it likes.
    pub fn progress(&self) -> Option<Progress> {
        self.progress.snapshot()
    }

    /// Refuse to act after a panic unwound through a pause or resume.
    fn check_sound(&self) -> Result<()> {
        match &*self.broken.lock() {
            Some(m) => Err(Error::InvalidState(m.clone())),
            None => Ok(()),
        }
    }

    fn guard(&self, what: &str, tag: Option<&str>) -> BreakOnUnwind<'_> {
        BreakOnUnwind {
            engine: self,
            what: format!("a {what} of {}", describe(tag)),
        }
    }

    /// Wait until the background pinner has page-locked what it was given (false on timeout).
    /// Only benchmarks and tests need this: copies never wait for it.
    pub fn wait_for_background_pinning(&self, timeout: std::time::Duration) -> bool {
        self.pinner.wait_idle(timeout)
    }

    /// Hand retained pinned backups that are not page-locked yet to the background pinner: the
    /// chunks of them that lie wholly in what the backup holds (page-locking touches every page,
    /// so a chunked allocation with only some chunks saved would otherwise pin host memory for
    /// chunks never saved).
    fn pin_later<'a>(
        &self,
        cfg: &CopyConfig,
        hosts: impl Iterator<Item = (DevPtr, &'a Arc<HostBuffer>)>,
    ) {
        if cfg.pin != PinMode::Background || !self.retain_cpu_backup() {
            return;
        }
        let todo = {
            let reg = self.reg.lock();
            hosts
                .filter(|(_, h)| h.backend() == BackupKind::Pinned)
                .filter_map(|(p, h)| {
                    let a = reg.allocs.get(&p)?;
                    let chunks: Vec<usize> = h
                        .chunks_within(&a.saved_ranges())
                        .into_iter()
                        .filter(|&i| !h.is_pinned(i))
                        .collect();
                    h.want(&chunks);
                    (!chunks.is_empty()).then(|| (Arc::downgrade(h), chunks))
                })
                .collect()
        };
        self.pinner.enqueue(todo);
    }

    /// Record a pause's or resume's numbers per tag.
    fn record_history(
        &self,
        per_tag: HashMap<Arc<str>, OpReport>,
        report: OpReport,
        slot: impl Fn(&mut stats::History) -> &mut Option<OpReport>,
    ) {
        let mut reg = self.reg.lock();
        for (t, mut r) in per_tag {
            r.seconds = report.seconds;
            r.release_seconds = report.release_seconds;
            *slot(reg.history.entry(t).or_default()) = Some(r);
        }
    }

    /// The staging slots go with the last allocation that could need them.
    fn drop_unused_rings(&self, rings: &mut BTreeMap<i32, Ring>) {
        if self.reg.lock().backed == 0 {
            rings.clear();
        }
    }

    /// Map allocations made from now on in physical segments of at most `bytes` (a power of
    /// two; the granularity where it is larger). [`SEGMENT_BYTES`] by default; tests use small
    /// segments to exercise the multi-segment paths.
    pub fn set_segment_bytes(&self, bytes: u64) -> Result<()> {
        if !bytes.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "segment size {bytes}: expected a power of two"
            )));
        }
        self.segment.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// The segment size set by [`Engine::set_segment_bytes`].
    pub fn segment_bytes(&self) -> u64 {
        self.segment.load(Ordering::Relaxed)
    }

    /// Set how backups are copied (used from the next pause or resume on).
    pub fn set_copy_config(&self, c: CopyConfig) -> Result<()> {
        c.validate()?;
        *self.copy.lock() = c;
        Ok(())
    }

    /// How backups are copied.
    pub fn copy_config(&self) -> CopyConfig {
        *self.copy.lock()
    }

    /// Page-locked bytes held in staging slots.
    pub fn staging_bytes(&self) -> u64 {
        self.ops.lock().rings.values().map(Ring::bytes).sum()
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// Keep host backups across resume so the next pause reuses them (consulted at resume).
    pub fn set_retain_cpu_backup(&self, on: bool) {
        self.retain.store(on, Ordering::Relaxed);
    }

    /// Whether host backups are kept across resume.
    pub fn retain_cpu_backup(&self) -> bool {
        self.retain.load(Ordering::Relaxed)
    }

    /// Put the files of disk backups made from now on in `dir` (`None`: back to the default, see
    /// [`Engine::set_default_disk_backup_dir`]). It must be an existing directory; it is
    /// resolved now (a relative path against the current folder) and held open, so a later
    /// `chdir` or rename does not move the files (Note [The disk backup folder]). Files made
    /// before stay where they are.
    pub fn set_disk_backup_dir(&self, dir: Option<std::path::PathBuf>) -> Result<()> {
        let dir = dir
            .map(|d| crate::backup::disk::BackupDir::open(&d))
            .transpose()?;
        *self.disk_dir.lock() = dir;
        Ok(())
    }

    /// Make `dir` the default directory of disk backup files (`TMS_DISK_BACKUP_DIR`; `None`: the
    /// system's temporary directory), resolved now like [`Engine::set_disk_backup_dir`]'s, and
    /// the current one.
    pub fn set_default_disk_backup_dir(&self, dir: Option<std::path::PathBuf>) -> Result<()> {
        let dir = dir
            .map(|d| crate::backup::disk::BackupDir::open(&d))
            .transpose()?;
        *self.disk_default.lock() = dir;
        *self.disk_dir.lock() = None;
        Ok(())
    }

    /// Where new disk backup files go.
    pub fn disk_backup_dir(&self) -> Result<Arc<crate::backup::disk::BackupDir>> {
        if let Some(d) = self.disk_dir.lock().clone() {
            return Ok(d);
        }
        let mut default = self.disk_default.lock();
        if let Some(d) = default.clone() {
            return Ok(d);
        }
        let d = crate::backup::disk::BackupDir::open(&std::env::temp_dir())
            .map_err(|e| e.context("the system's temporary directory"))?;
        *default = Some(d.clone());
        Ok(d)
    }

    /// Refuse (with out-of-memory) allocations that would leave fewer than `bytes` free.
    pub fn set_memory_margin(&self, bytes: u64) {
        self.margin.store(bytes, Ordering::Relaxed);
    }

    /// The memory margin in bytes.
    pub fn memory_margin(&self) -> u64 {
        self.margin.load(Ordering::Relaxed)
    }

    fn granularity(&self, device: i32) -> Result<u64> {
        if let Some(g) = self.reg.lock().granularity.get(&device) {
            return Ok(*g);
        }
        let g = self.driver.granularity(device)?;
        if g == 0 || !g.is_power_of_two() {
            return Err(Error::InvalidState(format!(
                "device {device} reports granularity {g}"
            )));
        }
        self.reg.lock().granularity.insert(device, g);
        Ok(g)
    }

    /// Refuse a chunk size that is not a multiple of the current device's granularity.
    pub fn check_chunk_size(&self, chunk: u64) -> Result<()> {
        let device = self.driver.current_device()?;
        let g = self.granularity(device)?;
        if chunk == 0 || chunk % g != 0 {
            return Err(Error::InvalidArgument(format!(
                "chunk size {chunk} bytes: expected a positive multiple of device {device}'s \
                 granularity ({g} bytes)"
            )));
        }
        Ok(())
    }

    fn check_device(&self, device: i32) -> Result<()> {
        let n = self.driver.device_count()?;
        if device < 0 || device >= n {
            return Err(Error::InvalidArgument(format!(
                "device {device} does not exist ({} has {n})",
                self.driver.name()
            )));
        }
        Ok(())
    }

    /// Allocate pauseable device memory; returns its address.
    pub fn alloc(&self, req: &AllocRequest) -> Result<DevPtr> {
        self.alloc_impl(req, true)
    }

    /// Allocate device memory that pause and resume leave alone: for allocations made inside
    /// `disable()` when the allocator itself is this library (PyTorch's pluggable-allocator pools).
    pub fn alloc_unpauseable(&self, req: &AllocRequest) -> Result<DevPtr> {
        self.alloc_impl(
            &AllocRequest {
                backup: None,
                chunk: 0,
                ..req.clone()
            },
            false,
        )
    }

    fn alloc_impl(&self, req: &AllocRequest, pauseable: bool) -> Result<DevPtr> {
        self.check_sound()?;
        let what = || {
            format!(
                "allocating {} ({} bytes) on device {} for tag {:?}",
                human(req.size),
                req.size,
                req.device,
                req.tag
            )
        };
        if req.size == 0 {
            return Err(
                Error::InvalidArgument("a pauseable allocation of 0 bytes".into()).context(what()),
            );
        }
        self.check_device(req.device).ctx(what)?;
        self.note_device(req.device);
        let g = self.granularity(req.device).ctx(what)?;
        let mapped = req
            .size
            .checked_next_multiple_of(g)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "size overflows when rounded up to the granularity {g}"
                ))
            })
            .ctx(what)?;
        if req.chunk > 0 && (req.chunk % g != 0 || req.size % req.chunk != 0) {
            return Err(Error::InvalidArgument(format!(
                "chunk size {} bytes: the size ({} bytes) must be a multiple of it, and it a \
                 multiple of the device's granularity ({g} bytes)",
                req.chunk, req.size
            ))
            .context(what()));
        }
        let margin = self.memory_margin();
        if margin > 0 {
            let info = self.driver.mem_info(req.device).ctx(what)?;
            if info.free < mapped.saturating_add(margin) {
                return Err(Error::OutOfMemory(format!(
                    "{} would leave {} free, below the memory margin of {}",
                    what(),
                    human(info.free.saturating_sub(mapped)),
                    human(margin)
                )));
            }
        }
        // The driver's work runs without the registry lock: other threads' hooks go on.
        let d = &*self.driver;
        let _scope = DeviceScope::enter(d, req.device).ctx(what)?;
        let ptr = d.reserve(req.device, mapped).ctx(what)?;
        let segment = match req.chunk {
            0 => self.segment.load(Ordering::Relaxed).max(g),
            c => c,
        };
        let mut m = Mapping::new(
            d,
            Span {
                device: req.device,
                ptr,
                mapped,
                segment,
            },
        );
        if let Err(e) = m.map_all(&|_| {}) {
            drop(m);
            if let Err(e2) = d.free_range(ptr, mapped) {
                tracing::error!("undoing a failed allocation: {e2}");
            }
            return Err(e.context(what()));
        }
        let mut reg = self.reg.lock();
        reg.backed += usize::from(req.backup.is_some());
        reg.allocs.insert(
            ptr,
            Allocation {
                size: req.size,
                mapped,
                device: req.device,
                tag: Arc::from(req.tag.as_str()),
                backup: req.backup,
                segment,
                chunk: req.chunk,
                state: State::Active,
                handles: m.commit().into_iter().map(Some).collect(),
                host: None,
                disk: None,
                saved: vec![false; mapped.div_ceil(segment) as usize],
                kept: None,
                stuck: Vec::new(),
                pauseable,
                resident: false,
            },
        );
        // Under the registry lock, so no pause can see the allocation but not its tag.
        self.remember_tag(&req.tag);
        drop(reg);
        tracing::debug!("alloc {ptr:#x} {} tag {:?}", req.size, req.tag);
        Ok(ptr)
    }

    fn remember_tag(&self, tag: &str) {
        let mut seen = self.tags_seen.lock();
        if !seen.contains(tag) {
            seen.insert(tag.into());
        }
    }

    /// True if some allocation of this engine (pauseable or not, alive or freed since) ever had
    /// `tag`. A pause or resume of a tag never seen changes nothing: a typo, perhaps.
    pub fn tag_known(&self, tag: &str) -> bool {
        self.tags_seen.lock().contains(tag)
    }

    /// Log at debug level a pause or resume of a tag no allocation ever had (it is a quiet
    /// success, like one of a tag whose allocations are all freed).
    fn note_unknown_tag(&self, what: &str, tag: Option<&str>) {
        if let Some(t) = tag.filter(|t| !self.tag_known(t)) {
            tracing::debug!("{what} of tag {t:?}: no allocation ever had this tag; nothing to do");
        }
    }

    /// True if `ptr` is the start of a pauseable allocation.
    pub fn owns(&self, ptr: DevPtr) -> bool {
        self.reg.lock().allocs.contains_key(&ptr)
    }

    /// Free an allocation (active or paused). `Ok(false)` if `ptr` is not one of ours. Waits
    /// while a pause or resume is changing this very allocation, never for other work.
    pub fn free(&self, ptr: DevPtr) -> Result<bool> {
        let mut a = {
            let mut reg = self.reg.lock();
            loop {
                match reg.allocs.get(&ptr) {
                    None => return Ok(false),
                    Some(a) if a.in_transition() => self.settled.wait(&mut reg),
                    Some(_) => break,
                }
            }
            reg.allocs.remove(&ptr).expect("found above")
        };
        // From here the allocation is out of the registry (no pause can select it) while its
        // address range stays reserved (nothing else can be placed there).
        let what = || {
            format!(
                "freeing {ptr:#x} ({} bytes, device {}, tag {:?})",
                a.size, a.device, a.tag
            )
        };
        let d = &*self.driver;
        let segs = a.mapped_segs(ptr);
        let mut stuck = std::mem::take(&mut a.stuck);
        let unmapped = DeviceScope::enter(d, a.device).and_then(|scope| {
            // Left mapped by a failed resume: the range cannot be freed while they are.
            while let Some(&s) = stuck.last() {
                let seg = a.span(ptr).sub(s, 1);
                d.unmap(seg.ptr, seg.mapped)?;
                stuck.pop();
            }
            if !segs.is_empty() {
                // cudaFree synchronizes; so do we, since unmapping memory in use is undefined.
                d.synchronize(a.device)?;
                segment::unmap_all(d, a.device, &segs)?;
            }
            Ok(scope)
        });
        let _scope = match unmapped {
            Ok(s) => s,
            Err(e) => {
                let e = e.context(what());
                let mut a = a;
                a.stuck = stuck;
                self.reg.lock().allocs.insert(ptr, a);
                return Err(e);
            }
        };
        // Gone for the caller from here on.
        if a.backup.is_some() {
            let last = {
                let mut reg = self.reg.lock();
                reg.backed -= 1;
                reg.backed == 0
            };
            // A pause or resume running now drops them itself when it ends.
            if let Some(mut ops) = self.ops.try_lock().filter(|_| last) {
                self.drop_unused_rings(&mut ops.rings);
            }
        }
        if !segs.is_empty() {
            if let Err(e) = segment::release_all(d, &segs) {
                // Unmapped already: the allocation is gone for the caller; only the handle leaks.
                tracing::error!("{}: {e}", what());
                let _ = d.free_range(ptr, a.mapped);
                return Err(e.context(what()));
            }
        }
        d.free_range(ptr, a.mapped).ctx(what)?;
        tracing::debug!("free {ptr:#x}");
        Ok(true)
    }

    /// Copy the host backup covering `[addr, addr+dst.len())` into `dst`. `Ok(false)` when there
    /// is no complete snapshot (no backup asked; active with the backup released; a pause
    /// writing it, or one that failed).
    pub fn copy_cpu_backup(&self, addr: DevPtr, dst: &mut [u8]) -> Result<bool> {
        // Holding a reference keeps a pause from writing into this buffer meanwhile.
        let Some((off, host)) = self.snapshot_at(addr, dst.len() as u64)? else {
            return Ok(false);
        };
        dst.copy_from_slice(&host.as_slice()[off..off + dst.len()]);
        Ok(true)
    }

    /// Address of the host backup covering `[addr, addr+len)`, or `None` (see
    /// [`Engine::copy_cpu_backup`]). Unguarded: the bytes change with the next pause and go with
    /// a resume without retention or a free. [`Engine::acquire_cpu_backup`] is the safe form.
    pub fn cpu_backup_ptr(&self, addr: DevPtr, len: u64) -> Result<Option<*const u8>> {
        Ok(self
            .snapshot_at(addr, len)?
            .map(|(off, h)| h.as_ptr().wrapping_add(off)))
    }

    /// The complete snapshot covering `[addr, addr+len)` and the offset into it, or `None`.
    fn snapshot_at(&self, addr: DevPtr, len: u64) -> Result<Option<(usize, Arc<HostBuffer>)>> {
        let reg = self.reg.lock();
        let (start, a) = reg.containing(addr, len)?;
        // containing() proved addr-start+len <= size == host.len().
        Ok(a.snapshot(addr - start, len)
            .map(|h| ((addr - start) as usize, h.clone())))
    }

    /// Hand out the host backup covering `[addr, addr+len)` (a complete snapshot, see
    /// [`Engine::copy_cpu_backup`]), or `None`. Until [`Engine::release_cpu_backup`] the bytes
    /// stay mapped and unchanged: a pause writes a new buffer instead, and a resume without
    /// retention or a free leaves this one to the lease. A retained pinned backup is handed out
    /// once its background page-locking has finished (bounded by `PIN_WAIT`).
    pub fn acquire_cpu_backup(&self, addr: DevPtr, len: u64) -> Result<Option<BackupLease>> {
        let Some((off, host)) = self.snapshot_at(addr, len)? else {
            return Ok(None);
        };
        if host.backend() == BackupKind::Pinned
            && self.retain_cpu_backup()
            && host.pinned_bytes() < host.len()
        {
            // A view of a retained pinned backup is page-locked memory, as the existing
            // library's is (callers copy from it asynchronously, or ask the driver about it):
            // let the page-locking queued for it finish first. Bounded: the pinner is ours.
            if !self.pinner.wait_idle(PIN_WAIT) {
                tracing::warn!(
                    "page-locking the backup of {addr:#x} did not finish within {PIN_WAIT:?}; \
                     handing it out pageable"
                );
            }
        }
        let ptr = host.as_ptr().wrapping_add(off);
        let lease = self.next_lease.fetch_add(1, Ordering::Relaxed);
        self.leases.lock().insert(lease, host);
        Ok(Some(BackupLease { ptr, lease }))
    }

    /// End a lease from [`Engine::acquire_cpu_backup`]; the buffer goes if nothing else holds it.
    pub fn release_cpu_backup(&self, lease: u64) -> Result<()> {
        let host = self.leases.lock().remove(&lease);
        match host {
            Some(h) => {
                drop(h);
                Ok(())
            }
            None => Err(Error::NotFound(format!(
                "CPU backup lease {lease} is not held (released already?)"
            ))),
        }
    }

    /// CPU backup leases not yet released.
    pub fn cpu_backup_leases(&self) -> usize {
        self.leases.lock().len()
    }

    /// Copy `data` into an active allocation at `addr` (for tools, demos and tests: the device
    /// side of real workloads writes with kernels). The range must lie inside one allocation.
    pub fn write_bytes(&self, addr: DevPtr, data: &[u8]) -> Result<()> {
        self.write_bytes_in(addr, data, usize::MAX)
    }

    /// [`Engine::write_bytes`] as copies of at most `piece` bytes queued back to back (the
    /// benchmark measures what cutting copies costs).
    pub fn write_bytes_in(&self, addr: DevPtr, data: &[u8], piece: usize) -> Result<()> {
        self.with_active(addr, data.len() as u64, |d, device, stream| {
            transfer::write(d, device, addr, data, piece, stream).into_result()
        })
    }

    /// [`Engine::write_bytes`] through buffers of the engine's own (64 MiB at most at a time),
    /// for callers that free their memory as soon as the call returns (the C ABI): should the
    /// device's waits keep failing, a copy still queued uses only those (kept for good then).
    pub fn write_bytes_staged(&self, addr: DevPtr, data: &[u8]) -> Result<()> {
        self.with_active(addr, data.len() as u64, |d, device, stream| {
            transfer::write_staged(d, device, addr, data, stream)
        })
    }

    /// Copy from an active allocation at `addr` into `out`.
    pub fn read_bytes(&self, addr: DevPtr, out: &mut [u8]) -> Result<()> {
        self.read_bytes_in(addr, out, usize::MAX)
    }

    /// [`Engine::read_bytes`] as copies of at most `piece` bytes queued back to back.
    pub fn read_bytes_in(&self, addr: DevPtr, out: &mut [u8], piece: usize) -> Result<()> {
        let len = out.len() as u64;
        self.with_active(addr, len, |d, device, stream| {
            transfer::read(d, device, out, addr, piece, stream).into_result()
        })
    }

    /// [`Engine::read_bytes`] through buffers of the engine's own, as
    /// [`Engine::write_bytes_staged`]: `out` is written only by the CPU, with complete copies.
    pub fn read_bytes_staged(&self, addr: DevPtr, out: &mut [u8]) -> Result<()> {
        let len = out.len() as u64;
        self.with_active(addr, len, |d, device, stream| {
            transfer::read_staged(d, device, out, addr, stream)
        })
    }

    fn with_active(
        &self,
        addr: DevPtr,
        len: u64,
        f: impl FnOnce(&dyn Driver, i32, crate::driver::Stream) -> Result<()>,
    ) -> Result<()> {
        // Tools' copies keep pauses and resumes out while they run (not the hooks).
        let _ops = self.ops.lock();
        let what = || format!("range {addr:#x}+{len}");
        let device = {
            let reg = self.reg.lock();
            let (start, a) = reg.containing(addr, len)?;
            let r = a.segs_of(addr - start, len);
            if a.in_transition() || a.handles[r].iter().any(Option::is_none) {
                return Err(Error::InvalidState(format!(
                    "{} is paused (tag {:?})",
                    what(),
                    a.tag
                )));
            }
            a.device
        };
        let d = &*self.driver;
        let _scope = DeviceScope::enter(d, device).ctx(what)?;
        let stream = d.stream(device).ctx(what)?;
        f(d, device, stream).ctx(what)
    }

    /// The one chunked allocation of `tag`; an error if it has none, or several (named).
    pub fn chunked(&self, tag: &str) -> Result<DevPtr> {
        check_tag(Some(tag))?;
        let reg = self.reg.lock();
        let found: Vec<(DevPtr, u64)> = reg
            .allocs
            .iter()
            .filter(|(_, a)| a.pauseable && a.chunk > 0 && &*a.tag == tag)
            .map(|(p, a)| (*p, a.size))
            .collect();
        match found[..] {
            [(p, _)] => Ok(p),
            [] => Err(Error::NotFound(format!(
                "tag {tag:?} has no chunked allocation (allocate in a region with a chunk size)"
            ))),
            _ => Err(Error::InvalidArgument(format!(
                "tag {tag:?} has {} chunked allocations ({}); name one by its address (or, from Python, its tensor)",
                found.len(),
                found
                    .iter()
                    .map(|(p, n)| format!("{p:#x}, {n} bytes"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ))),
        }
    }

    /// The chunked allocation holding `[addr, addr+len)`, and the chunks wholly inside that
    /// range (rounded inward: a chunk only partly inside is left out).
    pub fn chunks_in(&self, addr: DevPtr, len: u64) -> Result<(DevPtr, Vec<usize>)> {
        let reg = self.reg.lock();
        let (start, a) = reg.chunked_containing(addr, len.max(1))?;
        let off = addr - start;
        let first = off.div_ceil(a.chunk);
        let end = (off + len) / a.chunk;
        Ok((start, (first..end.max(first)).map(|c| c as usize).collect()))
    }

    /// Layout and states of the chunked allocation at `addr` (its start or any address in it).
    pub fn chunk_info(&self, addr: DevPtr) -> Result<ChunkInfo> {
        let reg = self.reg.lock();
        let (start, a) = reg.chunked_containing(addr, 1)?;
        Ok(ChunkInfo {
            addr: start,
            tag: a.tag.to_string(),
            chunk: a.chunk,
            layout: segments(a.mapped, a.segment).collect(),
            active: a.handles.iter().map(Option::is_some).collect(),
        })
    }

    /// Every allocation, in address order.
    pub fn allocations(&self) -> Vec<AllocInfo> {
        let reg = self.reg.lock();
        reg.allocs
            .iter()
            .map(|(p, a)| AllocInfo {
                addr: *p,
                size: a.size,
                mapped: a.mapped,
                device: a.device,
                tag: a.tag.to_string(),
                backup: a.backup,
                state: a.state,
                host_bytes: a.host_bytes(),
                host_pinned_bytes: a.host.as_deref().map_or(0, HostBuffer::pinned_bytes),
                disk_bytes: a.disk.as_deref().map_or(0, DiskFile::len),
                host_valid: a.fully_saved(),
                handles: a.handles.iter().flatten().count(),
                chunk: a.chunk,
                active_bytes: a.active_bytes(),
                pauseable: a.pauseable,
                resident: a.resident,
            })
            .collect()
    }

    /// Per-tag statistics.
    pub fn stats(&self) -> Stats {
        let reg = self.reg.lock();
        let mut s = stats::collect(
            reg.allocs.values().map(|a| stats::Row {
                tag: &a.tag,
                size: a.size,
                mapped: a.mapped,
                active: a.active_bytes(),
                host: a.host_bytes(),
                host_pinned: a.host.as_deref().map_or(0, HostBuffer::pinned_bytes),
                disk: a.disk.as_deref().map_or(0, DiskFile::len),
            }),
            &reg.history,
        );
        s.backend = self.driver.name().to_string();
        s.retain_cpu_backup = self.retain_cpu_backup();
        s.memory_margin_bytes = self.memory_margin();
        s
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let addrs: Vec<DevPtr> = self.reg.lock().allocs.keys().copied().collect();
        for p in addrs {
            if let Err(e) = self.free(p) {
                tracing::error!("engine teardown: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests;
