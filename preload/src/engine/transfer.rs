//! Single synchronous copies for tools and tests (`write_bytes`/`read_bytes`); backups move in
//! the pipeline (`pipeline.rs`). Upholds the driver's copy contracts (range mapped; host memory
//! alive until the stream is synchronized), which the callers guarantee by holding the registry
//! lock throughout.

use crate::driver::{DevPtr, Driver, Stream};
use crate::error::Result;

/// Queue `copy(offset, n)` over `len` bytes in pieces of at most `piece` bytes, then wait for the
/// stream, also when a piece fails to queue: nothing queued may outlive the caller's borrow.
fn in_pieces(
    d: &dyn Driver,
    stream: Stream,
    len: usize,
    piece: usize,
    mut copy: impl FnMut(usize, usize) -> Result<()>,
) -> Result<()> {
    let piece = piece.max(1);
    let mut off = 0;
    while off < len {
        let n = piece.min(len - off);
        if let Err(e) = copy(off, n) {
            let _ = d.stream_sync(stream);
            return Err(e);
        }
        off += n;
    }
    d.stream_sync(stream)
}

/// Copy `data` to `dst` in copies of at most `piece` bytes queued back to back, and wait. The
/// caller checked that the range is active and holds the lock.
pub(super) fn write(
    d: &dyn Driver,
    dst: DevPtr,
    data: &[u8],
    piece: usize,
    stream: Stream,
) -> Result<()> {
    in_pieces(d, stream, data.len(), piece, |off, n| {
        // SAFETY: dst..dst+data.len() lies in an active allocation (checked by the caller under
        // the registry lock) and off+n <= data.len(); data is borrowed until in_pieces has
        // synchronized the stream.
        unsafe { d.copy_h2d(dst + off as u64, data.as_ptr().add(off), n as u64, stream) }
    })
}

/// Copy from `src` into `out` in pieces, and wait. Same contract as [`write`].
pub(super) fn read(
    d: &dyn Driver,
    out: &mut [u8],
    src: DevPtr,
    piece: usize,
    stream: Stream,
) -> Result<()> {
    let (base, len) = (out.as_mut_ptr(), out.len());
    in_pieces(d, stream, len, piece, |off, n| {
        // SAFETY: as in write, with out exclusively borrowed until the synchronization.
        unsafe { d.copy_d2h(base.add(off), src + off as u64, n as u64, stream) }
    })
}
