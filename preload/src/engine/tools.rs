//! Tools' copies into and out of active allocations (demos, tests, the C ABI's byte access):
//! serialized with pauses and resumes, never with the hooks.

use super::base::Engine;
use super::transfer;
use crate::driver::{DevPtr, DeviceScope, Driver};
use crate::error::{Error, Result, ResultExt};

impl Engine {
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

    /// Time the device side of a staged pause over the active range `addr..addr + len`:
    /// `threads` threads copying it to the host in `piece`-byte copies, as the copy workers do,
    /// without the host copies (`tms-bench` states the pause against this); `own_streams`: each
    /// thread on its own stream instead of the engine's one.
    pub fn probe_d2h_lanes(
        &self,
        addr: DevPtr,
        len: u64,
        piece: u64,
        threads: usize,
        own_streams: bool,
    ) -> Result<transfer::LaneProbe> {
        let layout = self.settings.copy().layout;
        let mut out = transfer::LaneProbe::default();
        self.with_active(addr, len, |_, device, stream| {
            out = transfer::probe_d2h_lanes(
                &self.driver,
                device,
                stream,
                addr,
                len,
                piece,
                threads,
                own_streams,
                layout,
            )?;
            Ok(())
        })?;
        Ok(out)
    }

    pub(super) fn with_active(
        &self,
        addr: DevPtr,
        len: u64,
        f: impl FnOnce(&dyn Driver, i32, crate::driver::Stream) -> Result<()>,
    ) -> Result<()> {
        // Tools' copies keep pauses and resumes out while they run (not the hooks).
        let _ops = self.ops.exclusive(&self.registry);
        let what = || format!("range {addr:#x}+{len}");
        let device = {
            let reg = self.registry.lock();
            let (start, a) = reg.containing(addr, len)?;
            let r = a.segs_of(addr - start, len);
            if a.in_transition() || a.handles[r].iter().any(Option::is_none) {
                return Err(Error::invalid_state(format!(
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
}
