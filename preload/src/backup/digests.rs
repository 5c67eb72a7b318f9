//! What a host backup knows of its own contents: the digest of each piece (bytes `k·piece ..
//! (k+1)·piece` of the allocation it backs up), taken on the device when those bytes were
//! copied in (Note [Skipping unchanged memory] in `engine/digests.rs`). A piece's digest is
//! known only while the buffer holds exactly the bytes digested: whatever writes the buffer
//! otherwise forgets it first.

use parking_lot::Mutex;

use crate::driver::digest::Digest;

/// The digests of one buffer's pieces (all of one size; a new size forgets the old ones).
#[derive(Default)]
pub struct Digests {
    map: Mutex<Map>,
}

#[derive(Default)]
struct Map {
    piece: u64,
    of: Vec<Option<Digest>>,
}

/// Indices of the pieces of size `piece` that bytes `off..off + len` touch.
fn touched(off: u64, len: u64, piece: u64) -> std::ops::Range<usize> {
    if len == 0 || piece == 0 {
        return 0..0;
    }
    (off / piece) as usize..(off + len).div_ceil(piece) as usize
}

impl Digests {
    /// The known digests of the pieces of size `piece` that make up bytes `off..off + len`
    /// (`off` a multiple of `piece`), `None` where unknown.
    pub fn get(&self, off: u64, len: u64, piece: u64) -> Vec<Option<Digest>> {
        let m = self.map.lock();
        touched(off, len, piece)
            .map(|k| {
                if m.piece == piece {
                    m.of.get(k).copied().flatten()
                } else {
                    None
                }
            })
            .collect()
    }

    /// Record the digests of consecutive pieces of size `piece`, the first at byte `off` (a
    /// multiple of `piece`), which the buffer now holds.
    pub fn set(&self, off: u64, piece: u64, ds: &[Digest]) {
        if piece == 0 {
            return;
        }
        let mut m = self.map.lock();
        if m.piece != piece {
            *m = Map {
                piece,
                of: Vec::new(),
            };
        }
        let first = (off / piece) as usize;
        if m.of.len() < first + ds.len() {
            m.of.resize(first + ds.len(), None);
        }
        for (slot, d) in m.of[first..].iter_mut().zip(ds) {
            *slot = Some(*d);
        }
    }

    /// Forget the digests of every piece that bytes `off..off + len` touch: the buffer's bytes
    /// there are about to change, or changed.
    pub fn forget(&self, off: u64, len: u64) {
        let mut m = self.map.lock();
        let piece = m.piece;
        let end = m.of.len();
        for k in touched(off, len, piece) {
            if k >= end {
                break;
            }
            m.of[k] = None;
        }
    }

    /// Forget every digest, through exclusive access (no lock taken).
    pub fn clear(&mut self) {
        self.map.get_mut().of.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_forget_and_a_new_piece_size() {
        let d = Digests::default();
        assert_eq!(d.get(0, 8192, 4096), vec![None, None]);
        d.set(4096, 4096, &[[1, 2], [3, 4]]);
        assert_eq!(
            d.get(0, 12288, 4096),
            vec![None, Some([1, 2]), Some([3, 4])]
        );
        // A byte range forgets every piece it touches.
        d.forget(8191, 2);
        assert_eq!(d.get(4096, 8192, 4096), vec![None, None]);
        d.set(4096, 4096, &[[5, 6]]);
        assert_eq!(d.get(0, 12288, 4096), vec![None, Some([5, 6]), None]);
        // Another piece size knows nothing of the old one's digests.
        assert_eq!(d.get(0, 8192, 8192), vec![None]);
        d.set(0, 8192, &[[7, 8]]);
        assert_eq!(d.get(4096, 4096, 4096), vec![None]);
        assert_eq!(d.get(0, 8192, 8192), vec![Some([7, 8])]);
        d.forget(0, 0);
        assert_eq!(d.get(0, 8192, 8192), vec![Some([7, 8])]);
        let mut d = d;
        d.clear();
        assert_eq!(d.get(0, 8192, 8192), vec![None]);
    }
}
