//! The pipeline's work items: ranges of allocations, each with the backup to copy it to or
//! from, cut into units along the backup's chunks.

use crate::backup::Backing;
use crate::driver::DevPtr;
use crate::engine::segment::Span;

/// What an item copies to or from. Items hold their backing as a trait object: the workers
/// call it per unit and per staging-slot piece, never per byte (`backup/backing.rs` says why
/// that dispatch is dynamic).
pub(in crate::engine) type Target<'a> = &'a dyn Backing;

/// One range of an allocation in a pipelined operation: the allocation's address, the range
/// (bytes `off..off + len` of it), and the backup to copy that range of to or from it (none:
/// nothing to copy, only the coordinator's work). Offsets in the backup are offsets in the
/// allocation.
pub(in crate::engine) struct Item<'a> {
    pub dev: DevPtr,
    pub off: u64,
    pub len: u64,
    pub target: Option<Target<'a>>,
}

impl<'a> Item<'a> {
    /// The bytes of `span` of the allocation at `dev`, to or from `target`.
    pub(in crate::engine) fn over(dev: DevPtr, span: &Span, target: Option<Target<'a>>) -> Self {
        Item {
            dev,
            off: span.ptr - dev,
            len: span.mapped,
            target,
        }
    }

    /// Bytes the workers copy for this item.
    pub(in crate::engine) fn copy_bytes(&self) -> u64 {
        self.units().iter().map(|u| u.2).sum()
    }

    /// The parts of the target's chunks inside the range: `(chunk, offset, length)`.
    pub(super) fn units(&self) -> Vec<(usize, u64, u64)> {
        let Some(t) = self.target else {
            return Vec::new();
        };
        let end = self.off + self.len;
        // Chunks are of one size but the last.
        let first = match t.chunks() {
            0 => 0,
            _ => (self.off / t.chunk_span(0).1.max(1)) as usize,
        };
        (first..t.chunks())
            .map_while(|k| {
                let (o, n) = t.chunk_span(k);
                (o < end).then_some((k, o, n))
            })
            .filter_map(|(k, o, n)| {
                let (a, b) = (o.max(self.off), (o + n).min(end));
                (a < b).then_some((k, a, b - a))
            })
            .collect()
    }
}
