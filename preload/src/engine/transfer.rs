//! Single synchronous copies for tools and tests (`write_bytes`/`read_bytes`); backups move in
//! the pipeline (`pipeline.rs`). Upholds the driver's copy contracts (range mapped; host memory
//! alive until the stream is synchronized), which the callers guarantee by holding the registry
//! lock throughout.

use crate::driver::{DevPtr, Driver, Stream};
use crate::error::Result;

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
