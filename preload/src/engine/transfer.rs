//! Copies between device allocations and host backups. The only unsafe code of the engine: it
//! upholds the driver's copy contracts (ranges mapped; host memory alive until the stream is
//! synchronized), which the callers guarantee by holding the registry lock throughout.

use crate::driver::{DevPtr, Driver, HostBuffer, Stream};
use crate::error::Result;

/// Copy `host.len()` bytes from `src` into `host` and wait for the copy.
pub(super) fn device_to_host(
    d: &dyn Driver,
    host: &mut HostBuffer,
    src: DevPtr,
    stream: Stream,
) -> Result<()> {
    let len = host.len();
    // SAFETY: src..src+len lies in an active (mapped, accessible) allocation of at least len bytes;
    // the buffer is exclusively borrowed until the stream is synchronized right below.
    unsafe { d.copy_d2h(host.as_mut_ptr(), src, len, stream)? };
    d.stream_sync(stream)
}

/// Queue a copy of all of `host` to `dst`. The caller synchronizes `stream` before `host` can be
/// dropped or changed (it holds the registry lock until then).
pub(super) fn host_to_device_async(
    d: &dyn Driver,
    host: &HostBuffer,
    dst: DevPtr,
    stream: Stream,
) -> Result<()> {
    // SAFETY: dst..dst+len was just mapped with access for at least len bytes; host lives in the
    // registry, which the caller keeps locked until the stream is synchronized.
    unsafe { d.copy_h2d(dst, host.as_ptr(), host.len(), stream) }
}

/// Copy `data` to `dst` and wait. The caller checked that the range is active and holds the lock.
pub(super) fn write(d: &dyn Driver, dst: DevPtr, data: &[u8], stream: Stream) -> Result<()> {
    // SAFETY: dst..dst+len lies in an active allocation (checked by the caller under the registry
    // lock); data is borrowed until the stream is synchronized right below.
    unsafe { d.copy_h2d(dst, data.as_ptr(), data.len() as u64, stream)? };
    d.stream_sync(stream)
}

/// Copy from `src` into `out` and wait. Same contract as [`write`].
pub(super) fn read(d: &dyn Driver, out: &mut [u8], src: DevPtr, stream: Stream) -> Result<()> {
    // SAFETY: as in write, with out exclusively borrowed until the synchronization.
    unsafe { d.copy_d2h(out.as_mut_ptr(), src, out.len() as u64, stream)? };
    d.stream_sync(stream)
}
