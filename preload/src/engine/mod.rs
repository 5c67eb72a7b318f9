//! The engine: a registry of pauseable allocations and the pause/resume transactions over
//! [`Driver`](crate::driver::Driver).
//!
//! # Note [Pause and resume as transactions]
//!
//! Every allocation is one reserved address range with one physical handle mapped over all of
//! it (one handle per allocation keeps the VMM calls few: they cost per handle, not per byte).
//!
//! *Pause* synchronizes each device concerned, then for each active allocation of the tag:
//! copy to its host backup (when asked) and wait, unmap, release. It stops at the first failure,
//! so every allocation is in a state the registry names truly: those before it are paused with
//! their backups, the failing one is still active and mapped (unless only the release failed:
//! then it is unmapped and counted paused, its handle reported), the rest are active.
//!
//! *Resume* first creates, maps and enables access for every paused allocation of the tag. If
//! any of those fails, everything this call made is undone and the tag stays paused with its
//! backups intact; the error (out of memory, typically) goes to the caller, who may free memory
//! and call again. Only when all mappings exist are the backups copied back; a copy failure also
//! undoes the whole call. Then each allocation becomes active and, unless retention is on, its
//! host backup is released.
//!
//! *Free* removes the allocation; if unmapping fails it is put back, still active. A failure
//! after the unmap (releasing the handle, or giving back the address range) is reported but the
//! allocation is gone: only that handle or range leaks. Likewise a host buffer whose release
//! fails is logged and leaks; nothing the caller still needs is ever dropped.
//!
//! The registry lock is held for a whole pause or resume, so allocations and frees from other
//! threads wait for it (bounded by the copy time) instead of seeing half-done state.

mod stats;
mod transfer;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

pub use stats::{OpStats, Stats, TagStats};

use crate::driver::{DevPtr, DeviceScope, Driver, HostBackend, HostBuffer, PhysHandle};
use crate::error::{Error, Result, ResultExt};
use crate::units::human;

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
    /// True when the host backup holds the allocation's contents (paused with backup).
    pub host_valid: bool,
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
}

struct Allocation {
    size: u64,
    mapped: u64,
    device: i32,
    tag: Arc<str>,
    backup: Backup,
    handle: Option<PhysHandle>,
    host: Option<HostBuffer>,
    host_valid: bool,
    pauseable: bool,
}

impl Allocation {
    fn state(&self) -> State {
        if self.handle.is_some() {
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
}

impl Registry {
    fn selected(&self, tag: Option<&str>, state: State) -> Vec<DevPtr> {
        self.allocs
            .iter()
            .filter(|(_, a)| a.pauseable && a.state() == state && tag.is_none_or(|t| &*a.tag == t))
            .map(|(p, _)| *p)
            .collect()
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
}

impl Engine {
    /// An empty engine over `driver`.
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        Engine {
            driver,
            reg: Mutex::new(Registry::default()),
            retain: AtomicBool::new(false),
            margin: AtomicU64::new(0),
        }
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
        let handle = match self.map_new(req.device, ptr, mapped) {
            Ok(h) => h,
            Err(e) => {
                if let Err(e2) = d.free_range(ptr, mapped) {
                    tracing::error!("undoing a failed allocation: {e2}");
                }
                return Err(e.context(what()));
            }
        };
        reg.allocs.insert(
            ptr,
            Allocation {
                size: req.size,
                mapped,
                device: req.device,
                tag: Arc::from(req.tag.as_str()),
                backup: req.backup,
                handle: Some(handle),
                host: None,
                host_valid: false,
                pauseable,
            },
        );
        tracing::debug!("alloc {ptr:#x} {} tag {:?}", req.size, req.tag);
        Ok(ptr)
    }

    /// create + map + set access over a reserved range, undoing on failure.
    fn map_new(&self, device: i32, ptr: DevPtr, mapped: u64) -> Result<PhysHandle> {
        let d = &*self.driver;
        let h = d.create(device, mapped)?;
        if let Err(e) = d.map(ptr, mapped, h) {
            self.undo_release(h);
            return Err(e);
        }
        if let Err(e) = d.set_access(device, ptr, mapped) {
            if let Err(e2) = d.unmap(ptr, mapped) {
                tracing::error!("undoing a failed mapping at {ptr:#x}: {e2}");
            }
            self.undo_release(h);
            return Err(e);
        }
        Ok(h)
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
        if let Some(h) = a.handle {
            // cudaFree synchronizes; so do we, since unmapping memory in use is undefined.
            if let Err(e) = d.synchronize(a.device).and_then(|_| d.unmap(ptr, a.mapped)) {
                let e = e.context(what());
                drop(scope);
                reg.allocs.insert(ptr, a);
                return Err(e);
            }
            a.handle = None;
            if let Err(e) = d.release(h) {
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
        let t0 = Instant::now();
        let mut reg = self.reg.lock();
        let addrs = reg.selected(tag, State::Active);
        let mut report = OpReport::default();
        let mut per_tag: HashMap<Arc<str>, OpReport> = HashMap::new();
        let result = (|| -> Result<()> {
            for (device, list) in reg.by_device(&addrs) {
                let d = &*self.driver;
                let _scope = DeviceScope::enter(d, device)?;
                d.synchronize(device)
                    .ctx(|| format!("synchronizing device {device}"))?;
                for ptr in list {
                    let a = reg
                        .allocs
                        .get_mut(&ptr)
                        .expect("selected under the same lock");
                    let copied = self.pause_one(ptr, a)?;
                    let r = per_tag.entry(a.tag.clone()).or_default();
                    for r in [r, &mut report] {
                        r.allocations += 1;
                        r.bytes += a.mapped;
                        r.copied += copied;
                    }
                }
            }
            Ok(())
        })();
        report.seconds = t0.elapsed().as_secs_f64();
        for (t, mut r) in per_tag {
            r.seconds = report.seconds;
            reg.history.entry(t).or_default().last_pause = Some(r);
        }
        result.ctx(|| format!("pause of {}", describe(tag)))?;
        tracing::info!(
            "paused {} ({} allocations) in {:.3}s",
            human(report.bytes),
            report.allocations,
            report.seconds
        );
        Ok(report)
    }

    /// Back up (if asked), unmap and release one active allocation.
    fn pause_one(&self, ptr: DevPtr, a: &mut Allocation) -> Result<u64> {
        let d = &*self.driver;
        let what = || format!("allocation {ptr:#x} ({} bytes, tag {:?})", a.size, a.tag);
        let mut copied = 0;
        if let Some(backend) = a.backup {
            let reuse = a
                .host
                .as_ref()
                .is_some_and(|h| h.backend() == backend && h.len() == a.size);
            if !reuse {
                a.host = None;
                a.host = Some(HostBuffer::new(self.driver.clone(), backend, a.size).ctx(what)?);
            }
            let host = a.host.as_mut().expect("set above");
            a.host_valid = false;
            let stream = d.stream(a.device).ctx(what)?;
            transfer::device_to_host(d, host, ptr, stream).ctx(what)?;
            a.host_valid = true;
            copied = a.size;
        }
        let h = a.handle.expect("active allocations have a handle");
        if let Err(e) = d.unmap(ptr, a.mapped) {
            // Still active and writable: the copy just made is no longer "the contents".
            a.host_valid = false;
            return Err(e.context(what()));
        }
        a.handle = None;
        d.release(h).ctx(what)?;
        Ok(copied)
    }

    /// Resume every paused allocation of `tag` (all tags if `None`) at the same addresses.
    pub fn resume(&self, tag: Option<&str>) -> Result<OpReport> {
        check_tag(tag)?;
        let t0 = Instant::now();
        let mut reg = self.reg.lock();
        let addrs = reg.selected(tag, State::Paused);
        let groups = reg.by_device(&addrs);
        let d = &*self.driver;
        // Phase 1: physical memory and mappings for everything; all or nothing.
        let mut made: Vec<(i32, DevPtr, u64, PhysHandle)> = Vec::with_capacity(addrs.len());
        let phase1 = (|| -> Result<()> {
            for (device, list) in &groups {
                let _scope = DeviceScope::enter(d, *device)?;
                for ptr in list {
                    let a = &reg.allocs[ptr];
                    let h = self.map_new(*device, *ptr, a.mapped).ctx(|| {
                        format!("allocation {ptr:#x} ({} bytes, tag {:?})", a.mapped, a.tag)
                    })?;
                    made.push((*device, *ptr, a.mapped, h));
                }
            }
            Ok(())
        })();
        // Phase 2: copy the backups back, then wait for every device's stream.
        let phase2 = phase1.and_then(|_| {
            let mut copied = 0;
            for (device, list) in &groups {
                let _scope = DeviceScope::enter(d, *device)?;
                let stream = d.stream(*device)?;
                let mut queued = false;
                for ptr in list {
                    let a = &reg.allocs[ptr];
                    if let (Some(host), true) = (&a.host, a.host_valid) {
                        // SAFETY-relevant contract lives in transfer: host stays alive (we hold
                        // the lock) until the stream is synchronized below.
                        transfer::host_to_device_async(d, host, *ptr, stream).ctx(|| {
                            format!(
                                "restoring allocation {ptr:#x} ({} bytes, tag {:?})",
                                a.size, a.tag
                            )
                        })?;
                        copied += a.size;
                        queued = true;
                    }
                }
                if queued {
                    d.stream_sync(stream)
                        .ctx(|| format!("waiting for restores on device {device}"))?;
                }
            }
            Ok(copied)
        });
        let copied = match phase2 {
            Ok(c) => c,
            Err(e) => {
                self.undo_resume(&made);
                return Err(e.context(format!(
                    "resume of {} (undone: it stays paused with its backups)",
                    describe(tag)
                )));
            }
        };
        // Phase 3: commit.
        let retain = self.retain_cpu_backup();
        let mut report = OpReport {
            copied,
            ..Default::default()
        };
        let mut per_tag: HashMap<Arc<str>, OpReport> = HashMap::new();
        for (_, ptr, mapped, h) in made {
            let a = reg
                .allocs
                .get_mut(&ptr)
                .expect("selected under the same lock");
            a.handle = Some(h);
            let r = per_tag.entry(a.tag.clone()).or_default();
            r.allocations += 1;
            r.bytes += mapped;
            if a.host_valid {
                r.copied += a.size;
            }
            a.host_valid = false;
            if !retain {
                a.host = None;
            }
            report.allocations += 1;
            report.bytes += mapped;
        }
        report.seconds = t0.elapsed().as_secs_f64();
        for (t, mut r) in per_tag {
            r.seconds = report.seconds;
            reg.history.entry(t).or_default().last_resume = Some(r);
        }
        tracing::info!(
            "resumed {} ({} allocations) in {:.3}s",
            human(report.bytes),
            report.allocations,
            report.seconds
        );
        Ok(report)
    }

    fn undo_resume(&self, made: &[(i32, DevPtr, u64, PhysHandle)]) {
        let d = &*self.driver;
        for (device, ptr, mapped, h) in made.iter().rev() {
            let _scope = DeviceScope::enter(d, *device);
            if let Err(e) = d.unmap(*ptr, *mapped) {
                tracing::error!("undoing resume: unmapping {ptr:#x}: {e}");
            }
            self.undo_release(*h);
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
        let h = a.host.as_ref()?;
        match a.state() {
            State::Paused if !a.host_valid => None,
            _ => Some(h),
        }
    }

    /// Copy `data` into an active allocation at `addr` (for tools, demos and tests: the device
    /// side of real workloads writes with kernels). The range must lie inside one allocation.
    pub fn write_bytes(&self, addr: DevPtr, data: &[u8]) -> Result<()> {
        self.with_active(addr, data.len() as u64, |d, stream| {
            transfer::write(d, addr, data, stream)
        })
    }

    /// Copy from an active allocation at `addr` into `out`.
    pub fn read_bytes(&self, addr: DevPtr, out: &mut [u8]) -> Result<()> {
        let len = out.len() as u64;
        self.with_active(addr, len, |d, stream| transfer::read(d, out, addr, stream))
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
                host_bytes: a.host.as_ref().map_or(0, |h| h.len()),
                host_valid: a.host_valid,
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
                active: a.handle.is_some(),
                host: a.host.as_ref().map_or(0, |h| h.len()),
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
