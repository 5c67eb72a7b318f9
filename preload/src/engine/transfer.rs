//! Single synchronous copies for tools and tests (`write_bytes`/`read_bytes`); backups move in
//! the pipeline (`pipeline.rs`). Upholds the driver's copy contracts (range mapped; host memory
//! alive until the stream is synchronized), which the callers guarantee by holding the registry
//! lock throughout.

use crate::driver::{DevPtr, Driver, Stream};
use crate::error::Result;

/// Copy `data` to `dst` in copies of at most `piece` bytes queued back to back, and wait. The
/// caller checked that the range is active and holds the lock.
pub(super) fn write(
    d: &dyn Driver,
    dst: DevPtr,
    data: &[u8],
    piece: usize,
    stream: Stream,
) -> Result<()> {
    for (k, part) in data.chunks(piece.max(1)).enumerate() {
        let at = dst + (k * piece) as u64;
        // SAFETY: at..at+len lies in an active allocation (checked by the caller under the
        // registry lock); data is borrowed until the stream is synchronized below.
        let r = unsafe { d.copy_h2d(at, part.as_ptr(), part.len() as u64, stream) };
        if let Err(e) = r {
            // Nothing queued may outlive the borrow.
            let _ = d.stream_sync(stream);
            return Err(e);
        }
    }
    d.stream_sync(stream)
}

/// Copy from `src` into `out` in pieces, and wait. Same contract as [`write`].
pub(super) fn read(
    d: &dyn Driver,
    out: &mut [u8],
    src: DevPtr,
    piece: usize,
    stream: Stream,
) -> Result<()> {
    for (k, part) in out.chunks_mut(piece.max(1)).enumerate() {
        let at = src + (k * piece) as u64;
        // SAFETY: as in write, with out exclusively borrowed until the synchronization.
        let r = unsafe { d.copy_d2h(part.as_mut_ptr(), at, part.len() as u64, stream) };
        if let Err(e) = r {
            let _ = d.stream_sync(stream);
            return Err(e);
        }
    }
    d.stream_sync(stream)
}
