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
    /// Only these pieces are copied (a pause that skips unchanged memory); all where `None`.
    pub changed: Option<&'a Changed>,
}

/// Which pieces of an allocation (bytes `k·piece .. (k+1)·piece` of it) a pause copies: the
/// others hold what its backup holds already (Note [Skipping unchanged memory]).
pub(in crate::engine) struct Changed {
    pub piece: u64,
    pub changed: Vec<bool>,
}

impl Changed {
    /// The parts of bytes `a..a + n` of the allocation in changed pieces, merged where they
    /// touch: `(offset, length)`.
    fn within(&self, a: u64, n: u64) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let end = a + n;
        let mut k = a / self.piece;
        while k * self.piece < end {
            let (s, e) = ((k * self.piece).max(a), ((k + 1) * self.piece).min(end));
            // A piece beyond what was digested is copied.
            if self.changed.get(k as usize).copied().unwrap_or(true) {
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == s => last.1 += e - s,
                    _ => out.push((s, e - s)),
                }
            }
            k += 1;
        }
        out
    }
}

impl<'a> Item<'a> {
    /// The bytes of `span` of the allocation at `dev`, to or from `target`.
    pub(in crate::engine) fn over(dev: DevPtr, span: &Span, target: Option<Target<'a>>) -> Self {
        Item {
            dev,
            off: span.ptr - dev,
            len: span.mapped,
            target,
            changed: None,
        }
    }

    /// Of this item, only the pieces `changed` names are copied.
    pub(in crate::engine) fn only(mut self, changed: Option<&'a Changed>) -> Self {
        self.changed = changed;
        self
    }

    /// Bytes the workers copy for this item.
    pub(in crate::engine) fn copy_bytes(&self) -> u64 {
        self.units().iter().map(|u| u.2).sum()
    }

    /// Bytes of the item its `changed` pieces leave out (a pause skipping unchanged memory).
    pub(in crate::engine) fn unchanged_bytes(&self) -> u64 {
        match self.changed {
            None => 0,
            Some(_) => {
                Item {
                    changed: None,
                    ..*self
                }
                .copy_bytes()
                    - self.copy_bytes()
            }
        }
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
        let parts = (first..t.chunks())
            .map_while(|k| {
                let (o, n) = t.chunk_span(k);
                (o < end).then_some((k, o, n))
            })
            .filter_map(|(k, o, n)| {
                let (a, b) = (o.max(self.off), (o + n).min(end));
                (a < b).then_some((k, a, b - a))
            });
        match self.changed {
            None => parts.collect(),
            Some(c) => parts
                .flat_map(|(k, a, n)| c.within(a, n).into_iter().map(move |(a, n)| (k, a, n)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Changed;

    #[test]
    fn only_changed_pieces_are_kept_and_neighbours_merged() {
        let c = Changed {
            piece: 4,
            changed: vec![true, true, false, true, false],
        };
        assert_eq!(c.within(0, 20), vec![(0, 8), (12, 4)]);
        assert_eq!(c.within(2, 4), vec![(2, 4)]);
        assert_eq!(c.within(8, 4), vec![]);
        // Beyond the digested pieces everything is copied.
        assert_eq!(c.within(16, 12), vec![(20, 8)]);
    }
}
