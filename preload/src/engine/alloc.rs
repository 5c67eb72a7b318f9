//! Allocating and freeing pauseable memory (the hooks' side of the engine).

use std::sync::Arc;

use super::base::Engine;
use super::comms::{reserved_tag, NCCL_TAG};
use super::registry::Allocation;
use super::segment::{self, Mapping, Span};
use super::types::{AllocRequest, State};
use crate::driver::{DevPtr, DeviceScope};
use crate::error::{Error, Result, ResultExt};
use crate::units::human;

impl Engine {
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

    pub(super) fn alloc_impl(&self, req: &AllocRequest, pauseable: bool) -> Result<DevPtr> {
        self.ops.check_sound()?;
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
                Error::invalid_argument("a pauseable allocation of 0 bytes").context(what())
            );
        }
        if pauseable && req.tag == NCCL_TAG {
            return Err(Error::invalid_argument(reserved_tag()).context(what()));
        }
        self.check_device(req.device).ctx(what)?;
        self.note_device(req.device);
        let g = self.granularity(req.device).ctx(what)?;
        // More than the address space holds, as a size just below it is (the driver's reserve
        // says so): out of memory, the runtime's answer, on which PyTorch frees its cache.
        let mapped = req
            .size
            .checked_next_multiple_of(g)
            .ok_or_else(|| {
                Error::out_of_memory(format!(
                    "size overflows when rounded up to the granularity {g}"
                ))
            })
            .ctx(what)?;
        if req.chunk > 0 && (!req.chunk.is_multiple_of(g) || !req.size.is_multiple_of(req.chunk)) {
            return Err(Error::invalid_argument(format!(
                "chunk size {} bytes: the size ({} bytes) must be a multiple of it, and it a \
                 multiple of the device's granularity ({g} bytes)",
                req.chunk, req.size
            ))
            .context(what()));
        }
        let margin = self.settings.margin();
        if margin > 0 {
            let info = self.driver.mem_info(req.device).ctx(what)?;
            if info.free < mapped.saturating_add(margin) {
                return Err(Error::out_of_memory(format!(
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
            0 => self.settings.segment().max(g),
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
        let mut reg = self.registry.lock();
        reg.backed += usize::from(req.backup.is_some());
        reg.made += 1;
        let serial = reg.made;
        reg.allocs.insert(
            ptr,
            Allocation {
                serial,
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
                kept: [None, None],
                stuck: Vec::new(),
                arriving: None,
                pauseable,
                resident: false,
            },
        );
        // Under the registry lock, so no pause can see the allocation but not its tag.
        self.registry.remember_tag(&req.tag);
        drop(reg);
        tracing::debug!("alloc {ptr:#x} {} tag {:?}", req.size, req.tag);
        Ok(ptr)
    }

    /// True if some allocation of this engine (pauseable or not, alive or freed since) ever had
    /// `tag`. A pause or resume of a tag never seen changes nothing: a typo, perhaps.
    pub fn tag_known(&self, tag: &str) -> bool {
        self.registry.tag_known(tag) || (tag == NCCL_TAG && self.comms.seen())
    }

    /// True if `ptr` is the start of a pauseable allocation.
    pub fn owns(&self, ptr: DevPtr) -> bool {
        self.registry.lock().allocs.contains_key(&ptr)
    }

    /// Free an allocation (active or paused). `Ok(false)` if `ptr` is not one of ours. Waits
    /// while a pause or resume is changing this very allocation: a pause until it retired it,
    /// a resume until it ends (it commits its allocations together, landed early or not); never
    /// for work that does not concern it.
    pub fn free(&self, ptr: DevPtr) -> Result<bool> {
        let mut a = {
            let mut reg = self.registry.lock();
            loop {
                match reg.allocs.get(&ptr) {
                    None => return Ok(false),
                    Some(a) if a.in_transition() => self.registry.wait_settled(&mut reg),
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
        let mut lost = Vec::new();
        let unmapped = DeviceScope::enter(d, a.device).and_then(|scope| {
            if !segs.is_empty() || !stuck.is_empty() {
                // cudaFree synchronizes; so do we, since unmapping memory in use is undefined
                // (work queued behind a failed non-blocking resume may use its stuck segments).
                d.synchronize(a.device)?;
            }
            // Left mapped by a failed resume: the range cannot be freed while they are.
            while let Some(&s) = stuck.last() {
                let seg = a.span(ptr).sub(s, 1);
                d.unmap(seg.ptr, seg.mapped)?;
                stuck.pop();
            }
            segment::unmap_all(d, a.device, &segs).map_err(|f| {
                lost = f.lost;
                f.error
            })?;
            Ok(scope)
        });
        let _scope = match unmapped {
            Ok(s) => s,
            Err(e) => {
                let e = e.context(what());
                let mut a = a;
                a.stuck = stuck;
                // The free failed, so the caller may still use the allocation: what it could
                // not map again is recorded paused, its contents lost (no pause saved them).
                a.record_lost(ptr, &segs, &lost, false);
                a.state = a.settled();
                self.registry.lock().allocs.insert(ptr, a);
                return Err(e);
            }
        };
        // Gone for the caller from here on, and with it any failure a non-blocking resume kept
        // for it (what follows can leak the range or a handle, nothing else).
        self.restores.settle(std::iter::once(ptr));
        if a.backup.is_some() {
            let last = {
                let mut reg = self.registry.lock();
                reg.backed -= 1;
                reg.backed == 0
            };
            if last {
                self.ops.drop_unused_slots(&self.registry);
            }
        }
        // The range goes before the handles: released in a range still reserved, HIP's would
        // have their memory given back by freeing the range and reserving it again (Note
        // [ROCm's reserved ranges]), which fails this free where the address is taken meanwhile.
        let freed = d.free_range(ptr, a.mapped);
        if !segs.is_empty() {
            if let Err(e) = segment::release_all(d, &segs) {
                // Unmapped already: the allocation is gone for the caller; only the handle leaks.
                tracing::error!("{}: {e}", what());
                return Err(e.context(what()));
            }
        }
        freed.ctx(what)?;
        tracing::debug!("free {ptr:#x}");
        Ok(true)
    }

    /// The device's granularity, asked once and kept in the registry.
    pub(super) fn granularity(&self, device: i32) -> Result<u64> {
        if let Some(g) = self.registry.lock().granularity.get(&device) {
            return Ok(*g);
        }
        let g = self.driver.granularity(device)?;
        if g == 0 || !g.is_power_of_two() {
            return Err(Error::invalid_state(format!(
                "device {device} reports granularity {g}"
            )));
        }
        self.registry.lock().granularity.insert(device, g);
        Ok(g)
    }

    /// Refuse a chunk size that is not a multiple of the current device's granularity.
    pub fn check_chunk_size(&self, chunk: u64) -> Result<()> {
        let device = self.driver.current_device()?;
        let g = self.granularity(device)?;
        if chunk == 0 || !chunk.is_multiple_of(g) {
            return Err(Error::invalid_argument(format!(
                "chunk size {chunk} bytes: expected a positive multiple of device {device}'s \
                 granularity ({g} bytes)"
            )));
        }
        Ok(())
    }

    pub(super) fn check_device(&self, device: i32) -> Result<()> {
        let n = self.driver.device_count()?;
        if device < 0 || device >= n {
            return Err(Error::invalid_argument(format!(
                "device {device} does not exist ({} has {n})",
                self.driver.name()
            )));
        }
        Ok(())
    }
}
