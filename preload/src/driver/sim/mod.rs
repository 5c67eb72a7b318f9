//! The simulated device: host memory standing in for GPU memory, with the same primitives and
//! failure modes as the CUDA driver's virtual-memory API.
//!
//! One file per concern, tied together here by [`SimDriver`] and its [`Driver`] implementation:
//! `memory.rs` (reservations, physical memory and mappings over `mmap` and `memfd`),
//! `streams.rs` (copies queued on streams, events), `host.rs` (page-locked host ranges),
//! `faults.rs` (the primitives by name; a fault injector fails the Nth call of one with a chosen
//! status, `2` = out of memory), `gates.rs` (holds, the synchronization delay, the link's
//! bandwidth) and `config.rs` (the machine's shape and the `TMS_SIM_*` variables).
//!
//! Copies are `memcpy` after checking the device range is mapped and accessible, so an engine bug
//! shows as a driver error, not as a stray write.

mod config;
mod faults;
mod gates;
mod host;
mod memory;
mod streams;

use std::cell::Cell;

use parking_lot::Mutex;

pub use config::{SimConfig, SimEnv};
pub use faults::{parse_faults, FaultPlan, Prim, PANIC};
pub use gates::HOLDABLE;

use super::gate::DeviceWide;
use super::{DevPtr, DeviceToken, Driver, Event, Gate, GateWaits, MemInfo, PhysHandle, Stream};
use crate::error::Result;
use faults::{driver_err, invalid, Faults};
use gates::Gates;
use host::Host;
use memory::Memory;
use streams::{device_stream, stream_device, Queued, Streams};

/// All simulated state, under one lock held for each primitive.
struct Inner {
    mem: Memory,
    streams: Streams,
    host: Host,
    faults: Faults,
}

impl Inner {
    /// Count a call of `prim` and fire the fault armed for it, if any.
    fn enter(&mut self, prim: Prim, context: impl FnOnce() -> String) -> Result<()> {
        self.faults.enter(prim, context)
    }
}

/// How long a device-wide call waits for streams waiting on the gate, and a stream wait for
/// device-wide calls, before failing: short, so that tests see such waits that would last.
const GATED_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The simulated driver.
pub struct SimDriver {
    cfg: SimConfig,
    inner: Mutex<Inner>,
    /// What calls wait for before they act; apart from `inner`, so that a waiting call blocks
    /// no other.
    gates: Gates,
    /// The resume gate, once made (a word leaked for the process's life, as on a GPU).
    gate: std::sync::OnceLock<Gate>,
    /// Streams made to wait for the gate, kept apart from device-wide calls.
    gate_waits: GateWaits,
    /// Per device, whether digesting is ready: as the kernel's loading on a GPU, making it
    /// ready is device-wide.
    digest_ready: Vec<std::sync::atomic::AtomicBool>,
}

thread_local! {
    static CURRENT: Cell<i32> = const { Cell::new(0) };
}

impl SimDriver {
    /// A simulated machine of the given shape.
    pub fn new(cfg: SimConfig) -> Result<Self> {
        cfg.validate()?;
        let inner = Inner {
            mem: Memory::new(cfg.devices),
            streams: Streams::default(),
            host: Host::default(),
            faults: Faults::default(),
        };
        Ok(SimDriver {
            inner: Mutex::new(inner),
            gates: Gates::new(),
            gate: std::sync::OnceLock::new(),
            gate_waits: GateWaits::new(GATED_WAIT),
            digest_ready: (0..cfg.devices).map(|_| Default::default()).collect(),
            cfg,
        })
    }

    /// Ready to digest on `device` (a valid one), made so on first use: a device-wide call, as
    /// the CUDA kernel's loading may wait for the device's queued work.
    fn ready_to_digest(&self, device: i32) -> Result<()> {
        let ready = &self.digest_ready[device as usize];
        if !ready.load(std::sync::atomic::Ordering::Acquire) {
            let _fence = self.device_wide(Prim::Digest)?;
            ready.store(true, std::sync::atomic::Ordering::Release);
        }
        Ok(())
    }

    fn check_device(&self, prim: Prim, device: i32) -> Result<()> {
        if device < 0 || device >= self.cfg.devices {
            return Err(driver_err(
                prim,
                101,
                format!("device {device} (the sim has {})", self.cfg.devices),
            ));
        }
        Ok(())
    }

    fn check_multiple(&self, prim: Prim, what: &str, v: u64) -> Result<()> {
        if v == 0 || !v.is_multiple_of(self.cfg.granularity) {
            return Err(invalid(
                prim,
                format!(
                    "{what} {v} is not a positive multiple of the granularity {}",
                    self.cfg.granularity
                ),
            ));
        }
        Ok(())
    }

    /// The streams that wait for the gate and would not run yet, with the value each waits for
    /// (a wait the gate has reached is forgotten, as a GPU moves past it).
    pub fn gated_streams(&self) -> Vec<(i32, Stream, u32)> {
        self.gate_waits.pending(self.gate.get().copied())
    }

    /// As on a GPU, where page-locking memory and synchronizing the device wait for the
    /// device's streams: wait while a stream waits for the gate, and keep streams from being
    /// made to wait while the call runs (the guard). A wait that lasts (the caller itself is
    /// to raise the gate: a deadlock on a GPU) fails instead.
    fn device_wide(&self, prim: Prim) -> Result<DeviceWide<'_>> {
        self.gate_waits
            .device_wide(self.gate.get().copied())
            .map_err(|w| {
                driver_err(
                    prim,
                    999,
                    format!(
                        "waited {} s for {} streams that wait for the resume gate (on a GPU this \
                     call waits for them, and they for the gate: a deadlock if its caller is to \
                     raise the gate)",
                        GATED_WAIT.as_secs(),
                        w.len()
                    ),
                )
            })
    }

    /// The gate's value (0 before it is made).
    pub fn gate_value(&self) -> u32 {
        self.gate.get().map_or(0, Gate::value)
    }

    /// Queue a copy on `stream` (entered already).
    fn queue(&self, g: &mut Inner, stream: Stream, q: Queued) -> Result<()> {
        self.check_device(
            if q.to_host {
                Prim::CopyD2H
            } else {
                Prim::CopyH2D
            },
            stream_device(stream),
        )?;
        g.streams.queue(&g.mem, &g.host, stream, q)
    }
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> Result<i32> {
        Ok(self.cfg.devices)
    }

    fn current_device(&self) -> Result<i32> {
        Ok(CURRENT.with(|c| c.get()))
    }

    fn push_device(&self, device: i32) -> Result<DeviceToken> {
        self.check_device(Prim::Synchronize, device)?;
        let prev = CURRENT.with(|c| c.replace(device));
        Ok(DeviceToken(prev as u64, 0))
    }

    fn pop_device(&self, token: DeviceToken) {
        CURRENT.with(|c| c.set(token.0 as i32));
    }

    fn granularity(&self, device: i32) -> Result<u64> {
        self.check_device(Prim::Create, device)?;
        Ok(self.cfg.granularity)
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo> {
        let mut g = self.inner.lock();
        g.enter(Prim::MemInfo, || format!("device {device}"))?;
        self.check_device(Prim::MemInfo, device)?;
        let live = g.mem.live(device);
        Ok(MemInfo {
            free: self.cfg.capacity.saturating_sub(live),
            total: self.cfg.capacity,
        })
    }

    fn reserve(&self, device: i32, size: u64) -> Result<DevPtr> {
        let mut g = self.inner.lock();
        g.enter(Prim::Reserve, || format!("device {device}, {size} bytes"))?;
        self.check_device(Prim::Reserve, device)?;
        self.check_multiple(Prim::Reserve, "size", size)?;
        g.mem.reserve(self.cfg.granularity, size)
    }

    fn free_range(&self, ptr: DevPtr, size: u64) -> Result<()> {
        let mut g = self.inner.lock();
        g.enter(Prim::FreeRange, || format!("ptr {ptr:#x}, {size} bytes"))?;
        g.mem.free_range(ptr, size)
    }

    fn create(&self, device: i32, size: u64) -> Result<PhysHandle> {
        self.gates.wait_if_held(Prim::Create, Some(device));
        // The sim's device memory is host memory: more than the host has would be killed by the
        // kernel once written, so it is refused like device memory beyond the capacity.
        let live = self.inner.lock().mem.live_total();
        if let Some(h) = self
            .host_memory()
            .filter(|h| live.saturating_add(size) > h.available)
        {
            return Err(driver_err(
                Prim::Create,
                2,
                format!(
                    "device {device}, {size} bytes: the simulated device keeps its memory in host \
                     RAM, which has {} bytes available ({}) for its {live} bytes and these",
                    h.available, h.bound
                ),
            ));
        }
        let mut g = self.inner.lock();
        g.enter(Prim::Create, || format!("device {device}, {size} bytes"))?;
        self.check_device(Prim::Create, device)?;
        self.check_multiple(Prim::Create, "size", size)?;
        g.mem.create(self.cfg.capacity, device, size)
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        let mut g = self.inner.lock();
        g.enter(Prim::Release, || format!("handle {}", handle.0))?;
        g.mem.release(handle)
    }

    fn set_memory_flags(&self, flags: super::MemoryFlags) {
        self.inner.lock().mem.flags = flags;
    }

    fn handle_props(&self, handle: PhysHandle) -> Result<super::MemoryFlags> {
        let mut g = self.inner.lock();
        g.enter(Prim::Export, || format!("handle {}", handle.0))?;
        g.mem.props(handle)
    }

    fn export(&self, handle: PhysHandle) -> Result<std::os::fd::OwnedFd> {
        let mut g = self.inner.lock();
        g.enter(Prim::Export, || format!("handle {}", handle.0))?;
        g.mem.export(handle)
    }

    fn map(&self, ptr: DevPtr, size: u64, handle: PhysHandle) -> Result<()> {
        let mut g = self.inner.lock();
        g.enter(Prim::Map, || {
            format!("ptr {ptr:#x}, {size} bytes, handle {}", handle.0)
        })?;
        self.check_multiple(Prim::Map, "size", size)?;
        g.mem.map(self.cfg.granularity, ptr, size, handle)
    }

    fn unmap(&self, ptr: DevPtr, size: u64) -> Result<()> {
        let mut g = self.inner.lock();
        g.enter(Prim::Unmap, || format!("ptr {ptr:#x}, {size} bytes"))?;
        g.mem.unmap(ptr, size)
    }

    fn set_access(&self, device: i32, ptr: DevPtr, size: u64) -> Result<()> {
        let mut g = self.inner.lock();
        g.enter(Prim::SetAccess, || {
            format!("device {device}, ptr {ptr:#x}, {size} bytes")
        })?;
        self.check_device(Prim::SetAccess, device)?;
        g.mem.set_access(ptr, size)
    }

    fn synchronize(&self, device: i32) -> Result<()> {
        let _fence = self.device_wide(Prim::Synchronize)?;
        self.gates.wait_if_held(Prim::Synchronize, Some(device));
        self.gates.sync_delay();
        let mut g = self.inner.lock();
        g.enter(Prim::Synchronize, || format!("device {device}"))?;
        self.check_device(Prim::Synchronize, device)?;
        let g = &mut *g;
        g.streams.run_device(&g.mem, device)
    }

    fn stream(&self, device: i32) -> Result<Stream> {
        self.check_device(Prim::StreamSync, device)?;
        Ok(device_stream(device))
    }

    fn gate(&self) -> Result<Gate> {
        self.inner
            .lock()
            .enter(Prim::Gate, || "the resume gate".into())?;
        Ok(*self.gate.get_or_init(|| {
            let word: &'static std::sync::atomic::AtomicU32 = Box::leak(Box::default());
            Gate::new(word, word as *const _ as DevPtr)
        }))
    }

    fn stream_wait_gate(&self, device: i32, stream: Stream, gate: Gate, value: u32) -> Result<()> {
        self.inner.lock().enter(Prim::StreamWait, || {
            format!(
                "stream {:#x} waiting for the gate to reach {value}",
                stream.0
            )
        })?;
        self.check_device(Prim::StreamWait, device)?;
        if self.gate.get().map(|g| g.dev) != Some(gate.dev) {
            return Err(invalid(
                Prim::StreamWait,
                format!("{:#x} is not this device's gate", gate.dev),
            ));
        }
        self.gate_waits
            .stream_wait((device, stream, value), || Ok(()))
    }

    fn digest(
        &self,
        device: i32,
        ptr: DevPtr,
        len: u64,
        piece: u64,
        seed: u64,
        stream: Stream,
    ) -> Result<Vec<super::digest::Digest>> {
        self.check_device(Prim::Digest, device)?;
        self.ready_to_digest(device)?;
        let mut g = self.inner.lock();
        g.enter(Prim::Digest, || format!("{len} bytes at {ptr:#x}"))?;
        let g = &mut *g;
        g.streams.run_stream(&g.mem, stream)?;
        if !g.mem.covered(ptr, len) {
            return Err(driver_err(
                Prim::Digest,
                700,
                format!("digesting {ptr:#x}+{len}, which is not mapped and accessible"),
            ));
        }
        // SAFETY: an accessible mapping of `len` bytes (checked just now), which stays mapped
        // while the lock is held (mapping calls take it).
        let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) };
        Ok(super::digest::pieces(data, piece, seed))
    }

    fn prepare_digest(&self, device: i32) -> Result<()> {
        self.check_device(Prim::Digest, device)?;
        self.ready_to_digest(device)
    }

    fn stream_sync(&self, stream: Stream) -> Result<()> {
        let mut g = self.inner.lock();
        // A failed wait leaves the queued work alone, as on a GPU, where the work runs on
        // whatever the host's wait did; it runs at a later synchronization.
        g.enter(Prim::StreamSync, || format!("stream {}", stream.0))?;
        let g = &mut *g;
        g.streams.run_stream(&g.mem, stream)
    }

    fn event_create(&self, device: i32) -> Result<Event> {
        let mut g = self.inner.lock();
        g.enter(Prim::EventCreate, || format!("device {device}"))?;
        self.check_device(Prim::EventCreate, device)?;
        Ok(g.streams.event_create())
    }

    fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        let mut g = self.inner.lock();
        g.enter(Prim::EventRecord, || {
            format!("event {} on stream {}", event.0, stream.0)
        })?;
        g.streams.event_record(event, stream)
    }

    fn event_sync(&self, event: Event) -> Result<()> {
        self.gates.wait_if_held(Prim::EventSync, None);
        let mut g = self.inner.lock();
        let stream = g.streams.event_stream(event)?;
        // A failed wait leaves the queued work alone (see stream_sync).
        g.enter(Prim::EventSync, || format!("event {}", event.0))?;
        let g = &mut *g;
        g.streams.event_sync(&g.mem, event, stream)
    }

    fn event_destroy(&self, event: Event) {
        self.inner.lock().streams.event_destroy(event);
    }

    unsafe fn copy_d2h(&self, dst: *mut u8, src: DevPtr, len: u64, stream: Stream) -> Result<()> {
        self.gates
            .wait_if_held(Prim::CopyD2H, Some(stream_device(stream)));
        self.gates.use_link(len);
        let mut g = self.inner.lock();
        g.enter(Prim::CopyD2H, || format!("{len} bytes from {src:#x}"))?;
        let q = Queued {
            to_host: true,
            host: dst as usize,
            dev: src,
            len,
        };
        self.queue(&mut g, stream, q)
    }

    unsafe fn copy_h2d(&self, dst: DevPtr, src: *const u8, len: u64, stream: Stream) -> Result<()> {
        self.gates
            .wait_if_held(Prim::CopyH2D, Some(stream_device(stream)));
        self.gates.use_link(len);
        let mut g = self.inner.lock();
        g.enter(Prim::CopyH2D, || format!("{len} bytes to {dst:#x}"))?;
        let q = Queued {
            to_host: false,
            host: src as usize,
            dev: dst,
            len,
        };
        self.queue(&mut g, stream, q)
    }

    fn host_memory(&self) -> Option<crate::os::HostMemory> {
        match self.inner.lock().host.available {
            Some(available) => Some(crate::os::HostMemory {
                available,
                bound: "TMS_SIM_HOST_MEMORY of the simulated device".into(),
            }),
            None => crate::os::host_memory(),
        }
    }

    unsafe fn host_register(&self, device: i32, ptr: *mut u8, len: u64) -> Result<()> {
        self.check_device(Prim::HostRegister, device)?;
        let _fence = self.device_wide(Prim::HostRegister)?;
        self.gates.wait_if_held(Prim::HostRegister, Some(device));
        let mut g = self.inner.lock();
        g.enter(Prim::HostRegister, || {
            format!("{len} bytes of host memory at {ptr:p}")
        })?;
        g.host.register(device, ptr, len)
    }

    unsafe fn host_unregister(&self, device: i32, ptr: *mut u8) -> Result<()> {
        self.check_device(Prim::HostUnregister, device)?;
        let _fence = self.device_wide(Prim::HostUnregister)?;
        self.gates.wait_if_held(Prim::HostUnregister, Some(device));
        let mut g = self.inner.lock();
        g.enter(Prim::HostUnregister, || format!("host memory at {ptr:p}"))?;
        g.host.unregister(device, ptr)
    }
}

#[cfg(test)]
mod tests;
