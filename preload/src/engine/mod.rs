//! The engine: a registry of pauseable allocations and the pause/resume transactions over
//! [`Driver`](crate::driver::Driver).
//!
//! # Note [Pause and resume as transactions]
//!
//! Every allocation is one reserved address range with physical memory mapped over all of it in
//! segments of up to 1 GiB, one handle each: VMM calls cost per handle, so segments are large,
//! but a resume can copy into the first segments of a huge allocation while it maps the next.
//!
//! *Pause* synchronizes each device concerned, then for each active allocation of the tag:
//! copy to its host backup (when asked), unmap, release. The copies run in the pipeline
//! (Note [The copy pipeline] in `pipeline.rs`), and each allocation is unmapped and released
//! as soon as its own copy is complete. The first failure stops the work, and every allocation
//! is in a state the registry names truly: those finished are paused with their backups, the
//! failing one is still active and mapped (unless only its release failed: then it is unmapped
//! and counted paused, its handle reported), the rest are active (a backup copied for an
//! allocation that stays active is not claimed valid).
//!
//! *Resume* first creates, maps and enables access for every paused allocation of the tag. If
//! any of those fails, everything this call made is undone and the tag stays paused with its
//! backups intact; the error (out of memory, typically) goes to the caller, who may free memory
//! and call again. Only when all mappings exist are the backups copied back (in the pipeline); a
//! copy failure also undoes the whole call. Then each allocation becomes active and, unless
//! retention is on, its host backup and the staging slots are released, in parallel and after
//! the registry lock is let go.
//!
//! *Free* removes the allocation; if unmapping fails it is put back, still active. A failure
//! after the unmap (releasing the handle, or giving back the address range) is reported but the
//! allocation is gone: only that handle or range leaks. Likewise a host buffer whose release
//! fails is logged and leaks; nothing the caller still needs is ever dropped.
//!
//! The registry lock is held for a whole pause or resume (but for the release of host memory),
//! so allocations and frees from other threads wait for it (bounded by the copy time) instead of
//! seeing half-done state.

mod pinner;
mod pipeline;
mod stats;
mod transfer;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

pub use pipeline::{CopyConfig, PinMode, MAX_WORKERS};
pub use stats::{OpStats, Stats, TagStats};

use crate::driver::host::release_parallel;
use crate::driver::{DevPtr, DeviceScope, Driver, HostBackend, HostBuffer, PhysHandle};
use crate::error::{Error, Result, ResultExt};
use crate::units::human;
use pinner::Pinner;
use pipeline::{Dir, Item, Ring};

/// CPU-backup policy of an allocation.
pub type Backup = Option<HostBackend>;

/// What to allocate.
#[derive(Clone, Debug)]
pub struct AllocRequest {
    /// Bytes asked for (> 0).
    pub size: u64,
    /// Device ordinal.
    pub device: i32,
    /// Tag the allocation belongs to.
    pub tag: String,
    /// Keep contents across pause in host memory of this kind.
    pub backup: Backup,
}

/// Whether physical memory is behind an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Mapped and usable.
    Active,
    /// Unmapped; the address range stays reserved.
    Paused,
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
    /// Bytes of host memory held for this allocation's backup.
    pub host_bytes: u64,
    /// Bytes of that host memory page-locked.
    pub host_pinned_bytes: u64,
    /// True when the host backup holds the allocation's contents (paused with backup).
    pub host_valid: bool,
    /// Physical handles (segments) mapped: none while paused.
    pub handles: usize,
    /// False for allocations that pause and resume leave alone (see [`Engine::alloc_unpauseable`]).
    pub pauseable: bool,
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
}

struct Allocation {
    size: u64,
    mapped: u64,
    device: i32,
    tag: Arc<str>,
    backup: Backup,
    /// Bytes of each physical segment (the last may be shorter).
    segment: u64,
    /// One handle per segment while active; none while paused.
    handles: Vec<PhysHandle>,
    host: Option<Arc<HostBuffer>>,
    host_valid: bool,
    pauseable: bool,
}

impl Allocation {
    /// How errors name the allocation at `ptr`.
    fn describe(&self, ptr: DevPtr) -> String {
        format!(
            "allocation {ptr:#x} ({} bytes, tag {:?})",
            self.size, self.tag
        )
    }

    fn state(&self) -> State {
        if !self.handles.is_empty() {
            State::Active
        } else {
            State::Paused
        }
    }
}

#[derive(Default)]
struct Registry {
    allocs: BTreeMap<DevPtr, Allocation>,
    history: HashMap<Arc<str>, stats::History>,
    granularity: HashMap<i32, u64>,
    rings: BTreeMap<i32, Ring>,
    /// Allocations with a backup policy: the staging slots go when the last one does.
    backed: usize,
}

impl Registry {
    fn selected(&self, tag: Option<&str>, state: State) -> Vec<DevPtr> {
        self.allocs
            .iter()
            .filter(|(_, a)| a.pauseable && a.state() == state && tag.is_none_or(|t| &*a.tag == t))
            .map(|(p, _)| *p)
            .collect()
    }

    /// Each device's share of `groups` with that device's staging ring (made if missing), next to
    /// the allocations: what a pause or resume hands to its per-device coordinators.
    #[allow(clippy::type_complexity)]
    fn device_jobs<'a>(
        &'a mut self,
        groups: &'a BTreeMap<i32, Vec<DevPtr>>,
    ) -> (
        &'a BTreeMap<DevPtr, Allocation>,
        Vec<(i32, &'a [DevPtr], &'a mut Ring)>,
    ) {
        for device in groups.keys() {
            self.rings.entry(*device).or_default();
        }
        let jobs = self
            .rings
            .iter_mut()
            .filter_map(|(device, ring)| Some((*device, groups.get(device)?.as_slice(), ring)))
            .collect();
        (&self.allocs, jobs)
    }

    fn by_device(&self, addrs: &[DevPtr]) -> BTreeMap<i32, Vec<DevPtr>> {
        let mut m: BTreeMap<i32, Vec<DevPtr>> = BTreeMap::new();
        for p in addrs {
            m.entry(self.allocs[p].device).or_default().push(*p);
        }
        m
    }

    /// The allocation holding `[addr, addr+len)` within its asked size.
    fn containing(&self, addr: DevPtr, len: u64) -> Result<(DevPtr, &Allocation)> {
        let not_found = || {
            Error::NotFound(format!(
                "range {addr:#x}+{len} does not lie inside one pauseable allocation"
            ))
        };
        let (start, a) = self
            .allocs
            .range(..=addr)
            .next_back()
            .ok_or_else(not_found)?;
        let end = addr.checked_add(len).ok_or_else(not_found)?;
        if end <= start + a.size {
            Ok((*start, a))
        } else {
            Err(not_found())
        }
    }
}

/// What a pause did to one allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Still active and mapped.
    Untouched,
    /// Unmapped (and released, unless the release reported an error).
    Released,
}

/// One allocation in a pause, as the device's coordinator sees it.
struct PauseItem<'a> {
    ptr: DevPtr,
    a: &'a Allocation,
    /// The backup to copy to, if the allocation has a backup policy.
    host: Option<&'a HostBuffer>,
}

impl<'a> PauseItem<'a> {
    fn new(ptr: DevPtr, a: &'a Allocation) -> Self {
        PauseItem {
            ptr,
            a,
            host: a.host.as_deref().filter(|_| a.backup.is_some()),
        }
    }

    fn what(&self) -> String {
        let hs = &self.a.handles;
        format!(
            "{}, handle {:#x}{}",
            self.a.describe(self.ptr),
            hs.first().map_or(0, |h| h.0),
            match hs.len() {
                0 | 1 => String::new(),
                n => format!(" and {} more", n - 1),
            }
        )
    }
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

/// The registry of pauseable allocations over one driver. Thread-safe.
pub struct Engine {
    driver: Arc<dyn Driver>,
    reg: Mutex<Registry>,
    retain: AtomicBool,
    margin: AtomicU64,
    segment: AtomicU64,
    copy: Mutex<CopyConfig>,
    pinner: Arc<Pinner>,
    /// Every tag an allocation ever had (never cleared), for [`Engine::tag_known`]. A lock of
    /// its own, and a leaf (nothing is taken while it is held), so asking never waits for a
    /// pause.
    tags_seen: Mutex<HashSet<Box<str>>>,
    /// Set when a panic (a bug) unwound through a pause or resume: the registry may then no
    /// longer describe the device truly, so pause, resume and new pauseable allocations refuse
    /// with this message instead of acting on it.
    broken: Mutex<Option<String>>,
}

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

/// What a resume mapped: device, address, mapped bytes, segment size, handles.
type Made = (i32, DevPtr, u64, u64, Vec<PhysHandle>);

/// Largest physical segment of an allocation (see the Note above).
pub const SEGMENT_BYTES: u64 = 1 << 30;

/// Offsets and lengths of the segments of `mapped` bytes.
pub fn segments(mapped: u64, segment: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..mapped.div_ceil(segment)).map(move |k| (k * segment, segment.min(mapped - k * segment)))
}

impl Engine {
    /// An empty engine over `driver`.
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        Engine {
            driver,
            reg: Mutex::new(Registry::default()),
            retain: AtomicBool::new(false),
            margin: AtomicU64::new(0),
            segment: AtomicU64::new(SEGMENT_BYTES),
            copy: Mutex::new(CopyConfig::default()),
            pinner: Arc::default(),
            tags_seen: Mutex::default(),
            broken: Mutex::new(None),
        }
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

    /// Hand retained pinned backups that are not page-locked yet to the background pinner.
    fn pin_later<'a>(&self, cfg: &CopyConfig, hosts: impl Iterator<Item = &'a Arc<HostBuffer>>) {
        if cfg.pin != PinMode::Background || !self.retain_cpu_backup() {
            return;
        }
        let todo = hosts
            .filter(|h| h.backend() == HostBackend::Pinned && !h.fully_pinned())
            .map(Arc::downgrade)
            .collect();
        self.pinner.enqueue(todo);
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
        self.reg.lock().rings.values().map(Ring::bytes).sum()
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

    /// Refuse (with out-of-memory) allocations that would leave fewer than `bytes` free.
    pub fn set_memory_margin(&self, bytes: u64) {
        self.margin.store(bytes, Ordering::Relaxed);
    }

    /// The memory margin in bytes.
    pub fn memory_margin(&self) -> u64 {
        self.margin.load(Ordering::Relaxed)
    }

    fn granularity(&self, reg: &mut Registry, device: i32) -> Result<u64> {
        if let Some(g) = reg.granularity.get(&device) {
            return Ok(*g);
        }
        let g = self.driver.granularity(device)?;
        if g == 0 || !g.is_power_of_two() {
            return Err(Error::InvalidState(format!(
                "device {device} reports granularity {g}"
            )));
        }
        reg.granularity.insert(device, g);
        Ok(g)
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
        let mut reg = self.reg.lock();
        let g = self.granularity(&mut reg, req.device).ctx(what)?;
        let mapped = req
            .size
            .checked_next_multiple_of(g)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "size overflows when rounded up to the granularity {g}"
                ))
            })
            .ctx(what)?;
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
        let d = &*self.driver;
        let _scope = DeviceScope::enter(d, req.device).ctx(what)?;
        let ptr = d.reserve(req.device, mapped).ctx(what)?;
        let segment = self.segment.load(Ordering::Relaxed).max(g);
        let mut handles = Vec::with_capacity(mapped.div_ceil(segment) as usize);
        if let Err(e) = self.map_new(req.device, ptr, mapped, segment, &mut handles, &|_| {}) {
            self.undo_mapping(ptr, mapped, segment, &handles);
            if let Err(e2) = d.free_range(ptr, mapped) {
                tracing::error!("undoing a failed allocation: {e2}");
            }
            return Err(e.context(what()));
        }
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
                handles,
                host: None,
                host_valid: false,
                pauseable,
            },
        );
        // Under the registry lock, so no pause can see the allocation but not its tag.
        self.remember_tag(&req.tag);
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

    /// create + map + set access over a reserved range, segment by segment, pushing each
    /// handle to `hs` and calling `progress(bytes)` as each segment is ready. On failure `hs`
    /// holds the segments made before it, for the caller to undo ([`Engine::undo_mapping`]) once
    /// nothing uses them.
    fn map_new(
        &self,
        device: i32,
        ptr: DevPtr,
        mapped: u64,
        segment: u64,
        hs: &mut Vec<PhysHandle>,
        progress: &dyn Fn(u64),
    ) -> Result<()> {
        for (off, len) in segments(mapped, segment) {
            hs.push(self.map_segment(device, ptr + off, len)?);
            progress(off + len);
        }
        Ok(())
    }

    fn map_segment(&self, device: i32, ptr: DevPtr, len: u64) -> Result<PhysHandle> {
        let d = &*self.driver;
        let h = d.create(device, len)?;
        if let Err(e) = d.map(ptr, len, h) {
            self.undo_release(h);
            return Err(e);
        }
        if let Err(e) = d.set_access(device, ptr, len) {
            if let Err(e2) = d.unmap(ptr, len) {
                tracing::error!("undoing a failed mapping at {ptr:#x}: {e2}");
            }
            self.undo_release(h);
            return Err(e);
        }
        Ok(h)
    }

    /// Unmap and release the first `hs.len()` segments of `mapped` bytes at `ptr`, logging what
    /// fails (undoing work of a failed call).
    fn undo_mapping(&self, ptr: DevPtr, mapped: u64, segment: u64, hs: &[PhysHandle]) {
        for ((off, len), h) in segments(mapped, segment).zip(hs) {
            if let Err(e) = self.driver.unmap(ptr + off, len) {
                tracing::error!("undoing: unmapping {:#x}: {e}", ptr + off);
            }
            self.undo_release(*h);
        }
    }

    /// Unmap every segment of an active allocation. If one fails, those unmapped before it are
    /// mapped again (their handles still hold the contents), so the allocation stays whole.
    fn unmap_all(
        &self,
        device: i32,
        ptr: DevPtr,
        mapped: u64,
        segment: u64,
        hs: &[PhysHandle],
    ) -> Result<()> {
        let d = &*self.driver;
        for (k, (off, len)) in segments(mapped, segment).enumerate() {
            if let Err(e) = d.unmap(ptr + off, len) {
                for ((off, len), h) in segments(mapped, segment).zip(hs).take(k) {
                    let back = d
                        .map(ptr + off, len, *h)
                        .and_then(|()| d.set_access(device, ptr + off, len));
                    if let Err(e2) = back {
                        tracing::error!(
                            "mapping {:#x} again after a failed unmap: {e2}",
                            ptr + off
                        );
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Release every handle; the first error is returned, each is logged.
    fn release_all(&self, hs: &[PhysHandle]) -> Result<()> {
        let mut first = Ok(());
        for h in hs {
            if let Err(e) = self.driver.release(*h) {
                tracing::error!("releasing handle {:#x}: {e}", h.0);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    fn undo_release(&self, h: PhysHandle) {
        if let Err(e) = self.driver.release(h) {
            tracing::error!("undoing: releasing handle {:#x}: {e}", h.0);
        }
    }

    /// True if `ptr` is the start of a pauseable allocation.
    pub fn owns(&self, ptr: DevPtr) -> bool {
        self.reg.lock().allocs.contains_key(&ptr)
    }

    /// Free an allocation (active or paused). `Ok(false)` if `ptr` is not one of ours.
    pub fn free(&self, ptr: DevPtr) -> Result<bool> {
        let mut reg = self.reg.lock();
        let Some(mut a) = reg.allocs.remove(&ptr) else {
            return Ok(false);
        };
        let what = || {
            format!(
                "freeing {ptr:#x} ({} bytes, device {}, tag {:?})",
                a.size, a.device, a.tag
            )
        };
        let d = &*self.driver;
        let scope = match DeviceScope::enter(d, a.device) {
            Ok(s) => s,
            Err(e) => {
                let e = e.context(what());
                reg.allocs.insert(ptr, a);
                return Err(e);
            }
        };
        if !a.handles.is_empty() {
            // cudaFree synchronizes; so do we, since unmapping memory in use is undefined.
            let r = d
                .synchronize(a.device)
                .and_then(|_| self.unmap_all(a.device, ptr, a.mapped, a.segment, &a.handles));
            if let Err(e) = r {
                let e = e.context(what());
                drop(scope);
                reg.allocs.insert(ptr, a);
                return Err(e);
            }
        }
        // Gone for the caller from here on.
        if a.backup.is_some() {
            reg.backed -= 1;
            if reg.backed == 0 {
                // The last allocation that could need them: the staging slots go too.
                reg.rings.clear();
            }
        }
        let handles = std::mem::take(&mut a.handles);
        if !handles.is_empty() {
            if let Err(e) = self.release_all(&handles) {
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

    /// Pause every active allocation of `tag` (all tags if `None`).
    pub fn pause(&self, tag: Option<&str>) -> Result<OpReport> {
        check_tag(tag)?;
        self.check_sound()?;
        let _unwind = self.guard("pause", tag);
        self.note_unknown_tag("pause", tag);
        let _quiet = self.pinner.quiet();
        let t0 = Instant::now();
        let cfg = self.copy_config();
        let mut guard = self.reg.lock();
        let reg = &mut *guard;
        let addrs = reg.selected(tag, State::Active);
        let groups = reg.by_device(&addrs);
        let mut steps: BTreeMap<DevPtr, Step> = BTreeMap::new();
        let result = self.prepare_backups(reg, &addrs, &cfg).and_then(|()| {
            let (allocs, jobs) = reg.device_jobs(&groups);
            let results = per_device(jobs, |(device, list, ring)| {
                let mut items: Vec<PauseItem<'_>> = list
                    .iter()
                    .map(|p| PauseItem::new(*p, &allocs[p]))
                    .collect();
                // Those with nothing to copy are retired first.
                items.sort_by_key(|it| (it.host.is_some(), it.ptr));
                let (done, r) = self.pause_device(device, &items, ring, &cfg);
                (
                    items.iter().map(|it| it.ptr).zip(done).collect::<Vec<_>>(),
                    r,
                )
            });
            first_error(results.into_iter().map(|(done, r)| {
                steps.extend(done);
                r
            }))
        });
        let mut report = OpReport::default();
        let mut per_tag: HashMap<Arc<str>, OpReport> = HashMap::new();
        for (ptr, step) in steps {
            let a = reg
                .allocs
                .get_mut(&ptr)
                .expect("selected under the same lock");
            if step == Step::Untouched {
                a.host_valid = false;
                continue;
            }
            a.handles.clear();
            a.host_valid = a.host.is_some();
            let copied = if a.host_valid { a.size } else { 0 };
            let r = per_tag.entry(a.tag.clone()).or_default();
            for r in [r, &mut report] {
                r.allocations += 1;
                r.bytes += a.mapped;
                r.copied += copied;
            }
        }
        report.seconds = t0.elapsed().as_secs_f64();
        for (t, mut r) in per_tag {
            r.seconds = report.seconds;
            reg.history.entry(t).or_default().last_pause = Some(r);
        }
        self.pin_later(
            &cfg,
            addrs.iter().filter_map(|p| {
                reg.allocs[p]
                    .host
                    .as_ref()
                    .filter(|_| reg.allocs[p].host_valid)
            }),
        );
        result.ctx(|| format!("pause of {}", describe(tag)))?;
        tracing::info!(
            "paused {} ({} allocations) in {:.3}s",
            human(report.bytes),
            report.allocations,
            report.seconds
        );
        Ok(report)
    }

    /// Give every allocation with a backup policy a host buffer (reusing a retained one of the
    /// right kind and size). Cheap: buffers are touched only by the copies.
    fn prepare_backups(
        &self,
        reg: &mut Registry,
        addrs: &[DevPtr],
        cfg: &CopyConfig,
    ) -> Result<()> {
        for ptr in addrs {
            let a = reg
                .allocs
                .get_mut(ptr)
                .expect("selected under the same lock");
            let Some(backend) = a.backup else { continue };
            a.host_valid = false;
            let reuse = a
                .host
                .as_ref()
                .is_some_and(|h| h.backend() == backend && h.len() == a.size);
            if !reuse {
                a.host = None;
                let h = HostBuffer::new(self.driver.clone(), backend, a.size, cfg.layout)
                    .ctx(|| a.describe(*ptr))?;
                a.host = Some(Arc::new(h));
            }
        }
        Ok(())
    }

    /// Pause one device's share: wait for its work, then retire each allocation (unmap and
    /// release) as soon as its contents are safe: at once without backup, else when its copy is
    /// complete. Returns each item's step.
    fn pause_device(
        &self,
        device: i32,
        items: &[PauseItem<'_>],
        ring: &mut Ring,
        cfg: &CopyConfig,
    ) -> (Vec<Step>, Result<()>) {
        let d = &*self.driver;
        let mut steps = vec![Step::Untouched; items.len()];
        let result = (|| -> Result<()> {
            let _scope = DeviceScope::enter(d, device)?;
            d.synchronize(device)
                .ctx(|| format!("synchronizing device {device}"))?;
            let work: Vec<Item<'_>> = items
                .iter()
                .map(|it| Item {
                    dev: it.ptr,
                    host: it.host,
                })
                .collect();
            pipeline::run(
                &self.driver,
                device,
                Dir::Save,
                cfg,
                ring,
                &work,
                |_, _| Ok(()),
                |i| self.retire(&items[i], &mut steps[i]),
            )
        })();
        (steps, result)
    }

    /// Unmap and release one allocation whose contents are safe (copied, or not wanted).
    fn retire(&self, it: &PauseItem<'_>, step: &mut Step) -> Result<()> {
        let a = it.a;
        self.unmap_all(a.device, it.ptr, a.mapped, a.segment, &a.handles)
            .ctx(|| it.what())?;
        *step = Step::Released;
        self.release_all(&a.handles).ctx(|| it.what())
    }

    /// Resume every paused allocation of `tag` (all tags if `None`) at the same addresses.
    pub fn resume(&self, tag: Option<&str>) -> Result<OpReport> {
        check_tag(tag)?;
        self.check_sound()?;
        let _unwind = self.guard("resume", tag);
        self.note_unknown_tag("resume", tag);
        let _quiet = self.pinner.quiet();
        let t0 = Instant::now();
        let cfg = self.copy_config();
        let mut guard = self.reg.lock();
        let reg = &mut *guard;
        let addrs = reg.selected(tag, State::Paused);
        let groups = reg.by_device(&addrs);
        // Per device, in parallel: map each allocation, and copy its backup back while the next
        // one is mapped. All or nothing: on any failure everything made here is undone.
        let mut made: Vec<Made> = Vec::with_capacity(addrs.len());
        let mut copied = 0;
        let phase2 = {
            let (allocs, jobs) = reg.device_jobs(&groups);
            let results = per_device(jobs, |(device, list, ring)| {
                let items: Vec<Item<'_>> = list
                    .iter()
                    .map(|p| {
                        let a = &allocs[p];
                        Item {
                            dev: *p,
                            host: a.host.as_deref().filter(|_| a.host_valid),
                        }
                    })
                    .collect();
                let mut made = Vec::new();
                let r = DeviceScope::enter(&*self.driver, device).and_then(|_scope| {
                    pipeline::run(
                        &self.driver,
                        device,
                        Dir::Restore,
                        &cfg,
                        ring,
                        &items,
                        |i, progress| {
                            let (p, a) = (list[i], &allocs[&list[i]]);
                            let mut hs = Vec::new();
                            let r = self.map_new(device, p, a.mapped, a.segment, &mut hs, progress);
                            // Recorded even when incomplete: workers may be copying into the
                            // segments made, so they are undone only after the pipeline stops.
                            made.push((device, p, a.mapped, a.segment, hs));
                            r.ctx(|| a.describe(p))
                        },
                        |_| Ok(()),
                    )
                });
                let bytes: u64 = items
                    .iter()
                    .filter_map(|it| it.host)
                    .map(HostBuffer::len)
                    .sum();
                (made, bytes, r)
            });
            first_error(results.into_iter().map(|(m, bytes, r)| {
                made.extend(m);
                copied += bytes;
                r
            }))
        };
        if let Err(e) = phase2 {
            self.undo_resume(&made);
            return Err(e.context(format!(
                "resume of {} (undone: it stays paused with its backups)",
                describe(tag)
            )));
        }
        // Phase 3: commit.
        let retain = self.retain_cpu_backup();
        let mut report = OpReport {
            copied,
            ..Default::default()
        };
        let mut per_tag: HashMap<Arc<str>, OpReport> = HashMap::new();
        let mut released = Vec::new();
        for (_, ptr, _, _, hs) in made {
            let a = reg
                .allocs
                .get_mut(&ptr)
                .expect("selected under the same lock");
            a.handles = hs;
            let mapped = a.mapped;
            let r = per_tag.entry(a.tag.clone()).or_default();
            r.allocations += 1;
            r.bytes += mapped;
            if a.host_valid {
                r.copied += a.size;
            }
            a.host_valid = false;
            if !retain {
                released.extend(a.host.take());
            }
            report.allocations += 1;
            report.bytes += mapped;
        }
        let rings = if retain {
            self.pin_later(
                &cfg,
                addrs.iter().filter_map(|p| reg.allocs[p].host.as_ref()),
            );
            BTreeMap::new()
        } else {
            std::mem::take(&mut reg.rings)
        };
        drop(guard);
        // Giving host memory back takes as long as filling it did: in parallel, and without
        // holding up other threads' allocations.
        let t1 = Instant::now();
        release_parallel(released, cfg.threads);
        drop(rings);
        report.release_seconds = t1.elapsed().as_secs_f64();
        report.seconds = t0.elapsed().as_secs_f64();
        let mut reg = self.reg.lock();
        for (t, mut r) in per_tag {
            r.seconds = report.seconds;
            r.release_seconds = report.release_seconds;
            reg.history.entry(t).or_default().last_resume = Some(r);
        }
        drop(reg);
        tracing::info!(
            "resumed {} ({} allocations) in {:.3}s ({:.3}s releasing host memory)",
            human(report.bytes),
            report.allocations,
            report.seconds,
            report.release_seconds
        );
        Ok(report)
    }

    fn undo_resume(&self, made: &[Made]) {
        for (device, ptr, mapped, segment, hs) in made.iter().rev() {
            let _scope = DeviceScope::enter(&*self.driver, *device);
            self.undo_mapping(*ptr, *mapped, *segment, hs);
        }
    }

    /// Copy the host backup covering `[addr, addr+dst.len())` into `dst`.
    /// `Ok(false)` when there is none (no backup asked, or active with the backup released).
    pub fn copy_cpu_backup(&self, addr: DevPtr, dst: &mut [u8]) -> Result<bool> {
        let reg = self.reg.lock();
        let (start, a) = reg.containing(addr, dst.len() as u64)?;
        match Self::backup_of(a) {
            Some(host) => {
                let off = (addr - start) as usize;
                dst.copy_from_slice(&host.as_slice()[off..off + dst.len()]);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Address of the host backup covering `[addr, addr+len)`, or `None` (see
    /// [`Engine::copy_cpu_backup`]). The pointer stays valid until the allocation is freed, or
    /// resumed without retention.
    pub fn cpu_backup_ptr(&self, addr: DevPtr, len: u64) -> Result<Option<*const u8>> {
        let reg = self.reg.lock();
        let (start, a) = reg.containing(addr, len)?;
        // SAFETY of the arithmetic: containing() proved addr-start+len <= size == host.len().
        Ok(Self::backup_of(a).map(|h| h.as_ptr().wrapping_add((addr - start) as usize)))
    }

    fn backup_of(a: &Allocation) -> Option<&HostBuffer> {
        let h = a.host.as_deref()?;
        match a.state() {
            State::Paused if !a.host_valid => None,
            _ => Some(h),
        }
    }

    /// Copy `data` into an active allocation at `addr` (for tools, demos and tests: the device
    /// side of real workloads writes with kernels). The range must lie inside one allocation.
    pub fn write_bytes(&self, addr: DevPtr, data: &[u8]) -> Result<()> {
        self.write_bytes_in(addr, data, usize::MAX)
    }

    /// [`Engine::write_bytes`] as copies of at most `piece` bytes queued back to back (the
    /// benchmark measures what cutting copies costs).
    pub fn write_bytes_in(&self, addr: DevPtr, data: &[u8], piece: usize) -> Result<()> {
        self.with_active(addr, data.len() as u64, |d, stream| {
            transfer::write(d, addr, data, piece, stream)
        })
    }

    /// Copy from an active allocation at `addr` into `out`.
    pub fn read_bytes(&self, addr: DevPtr, out: &mut [u8]) -> Result<()> {
        self.read_bytes_in(addr, out, usize::MAX)
    }

    /// [`Engine::read_bytes`] as copies of at most `piece` bytes queued back to back.
    pub fn read_bytes_in(&self, addr: DevPtr, out: &mut [u8], piece: usize) -> Result<()> {
        let len = out.len() as u64;
        self.with_active(addr, len, |d, stream| {
            transfer::read(d, out, addr, piece, stream)
        })
    }

    fn with_active(
        &self,
        addr: DevPtr,
        len: u64,
        f: impl FnOnce(&dyn Driver, crate::driver::Stream) -> Result<()>,
    ) -> Result<()> {
        let reg = self.reg.lock();
        let what = || format!("range {addr:#x}+{len}");
        let (_, a) = reg.containing(addr, len)?;
        if a.state() != State::Active {
            return Err(Error::InvalidState(format!(
                "{} is paused (tag {:?})",
                what(),
                a.tag
            )));
        }
        let d = &*self.driver;
        let _scope = DeviceScope::enter(d, a.device).ctx(what)?;
        let stream = d.stream(a.device).ctx(what)?;
        f(d, stream).ctx(what)
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
                state: a.state(),
                host_bytes: a.host.as_deref().map_or(0, HostBuffer::len),
                host_pinned_bytes: a.host.as_deref().map_or(0, HostBuffer::pinned_bytes),
                host_valid: a.host_valid,
                handles: a.handles.len(),
                pauseable: a.pauseable,
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
                active: !a.handles.is_empty(),
                host: a.host.as_deref().map_or(0, HostBuffer::len),
                host_pinned: a.host.as_deref().map_or(0, HostBuffer::pinned_bytes),
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
