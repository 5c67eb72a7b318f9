//! Physical memory over a reserved address range, in segments of one handle each, as objects
//! that undo themselves: a `Mapping` being built unmaps and releases what it made when it is
//! dropped, unless it was committed (like PyTorch's `ExpandableSegment`), so an error or an
//! unwind between making and committing leaves no memory behind.

use crate::driver::{DevPtr, DeviceScope, Driver, PhysHandle};
use crate::error::{Error, Result};

/// Largest physical segment of an allocation (engine Note [Pause and resume as transactions]).
pub const SEGMENT_BYTES: u64 = 1 << 30;

/// Offsets and lengths of the segments of `mapped` bytes.
pub fn segments(mapped: u64, segment: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..mapped.div_ceil(segment)).map(move |k| (k * segment, segment.min(mapped - k * segment)))
}

/// Of bytes `off..off + len`, how many lie below `size`.
pub(super) fn clipped(off: u64, len: u64, size: u64) -> u64 {
    (off + len).min(size).saturating_sub(off)
}

/// Where a range's segments lie: device, start, length and segment size.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub device: i32,
    pub ptr: DevPtr,
    pub mapped: u64,
    pub segment: u64,
}

/// Segments being mapped over a [`Span`]. Dropped uncommitted, it unmaps and releases every
/// segment it made (failures are logged: that memory leaks, nothing else is touched).
pub(super) struct Mapping<'d> {
    driver: &'d dyn Driver,
    span: Span,
    handles: Vec<PhysHandle>,
}

impl<'d> Mapping<'d> {
    pub fn new(driver: &'d dyn Driver, span: Span) -> Self {
        Mapping {
            driver,
            span,
            handles: Vec::with_capacity(span.mapped.div_ceil(span.segment) as usize),
        }
    }

    /// create + map + set access for every segment, calling `progress(bytes)` as each one is
    /// usable. On failure the segments made so far stay in the mapping (for its drop to undo,
    /// once nothing copies into them), and so does the failed one if it could not be unmapped.
    pub fn map_all(&mut self, progress: &dyn Fn(u64)) -> Result<()> {
        let Span {
            device,
            ptr,
            mapped,
            segment,
        } = self.span;
        for (off, len) in segments(mapped, segment).skip(self.handles.len()) {
            let h = map_segment(self.driver, device, ptr + off, len).map_err(|(e, still)| {
                self.handles.extend(still);
                e
            })?;
            self.handles.push(h);
            progress(off + len);
        }
        Ok(())
    }

    /// The handles, now owned by the caller; nothing is undone.
    pub fn commit(mut self) -> Vec<PhysHandle> {
        std::mem::take(&mut self.handles)
    }

    /// Unmap and release what was made. Returns the offsets (in the span) of segments that
    /// could not be unmapped even on a second try: their handles are released (the driver frees
    /// the memory once it is unmapped), but the range stays mapped until someone unmaps it.
    pub fn undo(mut self) -> Vec<u64> {
        self.undo_made()
    }

    fn undo_made(&mut self) -> Vec<u64> {
        let handles = std::mem::take(&mut self.handles);
        if handles.is_empty() {
            return Vec::new();
        }
        let d = self.driver;
        let _scope = DeviceScope::enter(d, self.span.device);
        let Span {
            ptr,
            mapped,
            segment,
            ..
        } = self.span;
        let mut stuck = Vec::new();
        for ((off, len), h) in segments(mapped, segment).zip(&handles) {
            if let Err(e) = d.unmap(ptr + off, len).or_else(|_| d.unmap(ptr + off, len)) {
                tracing::error!("undoing: unmapping {:#x} ({len} bytes): {e}", ptr + off);
                stuck.push(off);
            }
            release_logged(d, *h);
        }
        stuck
    }
}

impl Drop for Mapping<'_> {
    fn drop(&mut self) {
        // Only on an unwind or an early return: what stays mapped is logged by undo_made.
        self.undo_made();
    }
}

/// Make one segment. On failure nothing is left made, except a segment mapped whose access
/// could not be set and which could not be unmapped either: its handle comes back with the
/// error, still mapped.
fn map_segment(
    d: &dyn Driver,
    device: i32,
    ptr: DevPtr,
    len: u64,
) -> std::result::Result<PhysHandle, (Error, Option<PhysHandle>)> {
    let h = d.create(device, len).map_err(|e| (e, None))?;
    if let Err(e) = d.map(ptr, len, h) {
        release_logged(d, h);
        return Err((e, None));
    }
    if let Err(e) = d.set_access(device, ptr, len) {
        if let Err(e2) = d.unmap(ptr, len) {
            // Released here, it would stay mapped with nothing recording it: no later map of
            // the segment, nor freeing of the range, could succeed. The mapping's undo unmaps
            // it again, or reports it stuck.
            tracing::error!("undoing a failed mapping at {ptr:#x}: {e2}");
            return Err((e, Some(h)));
        }
        release_logged(d, h);
        return Err((e, None));
    }
    Ok(h)
}

fn release_logged(d: &dyn Driver, h: PhysHandle) {
    if let Err(e) = d.release(h) {
        tracing::error!("undoing: releasing handle {:#x}: {e}", h.0);
    }
}

/// One mapped segment: where it lies and its handle.
#[derive(Clone, Copy, Debug)]
pub(super) struct Seg {
    pub ptr: DevPtr,
    pub len: u64,
    pub handle: PhysHandle,
}

impl Span {
    /// The segments of this span with their handles (one per segment, in order).
    pub fn with_handles(&self, hs: &[PhysHandle]) -> Vec<Seg> {
        segments(self.mapped, self.segment)
            .zip(hs)
            .map(|((off, len), h)| Seg {
                ptr: self.ptr + off,
                len,
                handle: *h,
            })
            .collect()
    }

    /// Index of its first segment in the allocation at `base`.
    pub fn first_segment(&self, base: DevPtr) -> usize {
        ((self.ptr - base) / self.segment) as usize
    }

    /// Of its bytes, those within the first `size` of the allocation at `base`: what a backup
    /// of the allocation's asked size holds of this span.
    pub fn backed(&self, base: DevPtr, size: u64) -> u64 {
        clipped(self.ptr - base, self.mapped, size)
    }

    /// The sub-span of segments `first..first + n`.
    pub fn sub(&self, first: usize, n: usize) -> Span {
        let off = first as u64 * self.segment;
        let end = ((first + n) as u64 * self.segment).min(self.mapped);
        Span {
            ptr: self.ptr + off,
            mapped: end - off,
            ..*self
        }
    }
}

/// A segment a failed [`unmap_all`] had unmapped and could not map again: its handle is released
/// (a failed release leaks only the handle); `mapped`: mapping it again got as far as the
/// mapping, which could not be undone either.
#[derive(Clone, Copy, Debug)]
pub(super) struct Lost {
    /// Index into the `segs` given to [`unmap_all`].
    pub index: usize,
    pub mapped: bool,
}

/// A failed [`unmap_all`]: the error, and the segments it could not map again.
pub(super) struct UnmapFailed {
    pub error: Error,
    pub lost: Vec<Lost>,
}

/// Unmap mapped segments. If one fails, those unmapped before it are mapped again (their
/// handles still hold the contents), so the allocation stays whole; those that cannot be come
/// back as [`Lost`], for the caller to record paused: the registry must never claim a mapping
/// that is not there (a copy from it would fault).
pub(super) fn unmap_all(
    d: &dyn Driver,
    device: i32,
    segs: &[Seg],
) -> std::result::Result<(), UnmapFailed> {
    for (k, s) in segs.iter().enumerate() {
        let Err(error) = d.unmap(s.ptr, s.len) else {
            continue;
        };
        let mut lost = Vec::new();
        for (index, b) in segs[..k].iter().enumerate() {
            let back = d.map(b.ptr, b.len, b.handle);
            let mapped = back.is_ok();
            let Err(e2) = back.and_then(|()| d.set_access(device, b.ptr, b.len)) else {
                continue;
            };
            tracing::error!("mapping {:#x} again after a failed unmap: {e2}", b.ptr);
            let mapped = mapped && d.unmap(b.ptr, b.len).is_err();
            // Logged there; a failed release leaks only the handle.
            let _ = release_all(d, std::slice::from_ref(b));
            lost.push(Lost { index, mapped });
        }
        let error = match lost.len() {
            0 => error,
            n => error.context(format!(
                "{n} segment(s) unmapped before this failure could not be mapped again, and are paused now"
            )),
        };
        return Err(UnmapFailed { error, lost });
    }
    Ok(())
}

/// Release every handle; the first error is returned, each is logged.
pub(super) fn release_all(d: &dyn Driver, segs: &[Seg]) -> Result<()> {
    let mut first = Ok(());
    for s in segs {
        if let Err(e) = d.release(s.handle) {
            tracing::error!("releasing handle {:#x}: {e}", s.handle.0);
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// Maximal runs of consecutive indices in `idx` (sorted): `(first, count)` each.
pub(super) fn runs(idx: &[usize]) -> Vec<(usize, usize)> {
    runs_of_at_most(idx, usize::MAX)
}

/// Runs of consecutive indices in `idx` (sorted), each of at most `most` (at least 1) indices:
/// `(first, count)` each.
pub(super) fn runs_of_at_most(idx: &[usize], most: usize) -> Vec<(usize, usize)> {
    let most = most.max(1);
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &i in idx {
        match out.last_mut() {
            Some((f, n)) if *f + *n == i && *n < most => *n += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_consecutive_indices_cut_at_the_limit() {
        let idx = [0, 1, 2, 3, 4, 7, 8, 10];
        assert_eq!(runs(&idx), vec![(0, 5), (7, 2), (10, 1)]);
        assert_eq!(
            runs_of_at_most(&idx, 2),
            vec![(0, 2), (2, 2), (4, 1), (7, 2), (10, 1)]
        );
        assert_eq!(runs_of_at_most(&idx, 0), runs_of_at_most(&idx, 1));
        assert_eq!(runs_of_at_most(&idx, 1).len(), idx.len());
        assert!(runs(&[]).is_empty());
    }
}
