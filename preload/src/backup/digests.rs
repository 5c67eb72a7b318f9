//! What a host backup knows of its own contents: the digest of each piece (bytes `k·piece ..
//! (k+1)·piece` of the allocation it backs up), taken on the device when those bytes were
//! copied in (Note [Skipping unchanged memory] in `engine/digests.rs`): what went out, which a
//! verified resume compares with. Whatever of ours writes the buffer otherwise forgets it
//! first. A pause may skip a piece only while the buffer is known to still hold those bytes
//! (the digest is *trusted*): a caller handed a view it may write through makes its range
//! untrusted until a pause copies it again, and an unguarded pointer makes the whole buffer so
//! for good.

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
    /// Per piece, whether the buffer is known to still hold what `of` digests (missing: no).
    trusted: Vec<bool>,
    /// A caller holds a pointer it may write through at any time: nothing is trusted again.
    exposed: bool,
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
    /// (`off` a multiple of `piece`), `None` where unknown: what the pauses copied out.
    pub fn get(&self, off: u64, len: u64, piece: u64) -> Vec<Option<Digest>> {
        self.known(off, len, piece, false)
    }

    /// As [`Digests::get`], but only where the buffer is known to still hold those bytes: what
    /// a pause may skip.
    pub fn trusted(&self, off: u64, len: u64, piece: u64) -> Vec<Option<Digest>> {
        self.known(off, len, piece, true)
    }

    fn known(&self, off: u64, len: u64, piece: u64, trusted: bool) -> Vec<Option<Digest>> {
        let m = self.map.lock();
        let trust = |k: usize| !trusted || (!m.exposed && m.trusted.get(k) == Some(&true));
        touched(off, len, piece)
            .map(|k| {
                if m.piece == piece && trust(k) {
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
                exposed: m.exposed,
                ..Map::default()
            };
        }
        let first = (off / piece) as usize;
        if m.of.len() < first + ds.len() {
            m.of.resize(first + ds.len(), None);
            m.trusted.resize(first + ds.len(), false);
        }
        for (slot, d) in m.of[first..].iter_mut().zip(ds) {
            *slot = Some(*d);
        }
        m.trusted[first..first + ds.len()].fill(true);
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
            m.trusted[k] = false;
        }
    }

    /// A caller may write bytes `off..off + len` (a view handed out): a pause skips none of the
    /// pieces they touch until it copies them again. What went out stays known.
    pub fn distrust(&self, off: u64, len: u64) {
        let mut m = self.map.lock();
        let (piece, end) = (m.piece, m.trusted.len());
        for k in touched(off, len, piece).take_while(|&k| k < end) {
            m.trusted[k] = false;
        }
    }

    /// [`Digests::distrust`] of the whole buffer.
    pub fn distrust_all(&self) {
        self.map.lock().trusted.fill(false);
    }

    /// A caller holds an unguarded pointer into the buffer and may write through it whenever
    /// it likes while the buffer lives: no pause skips any of it again.
    pub fn expose(&self) {
        self.map.lock().exposed = true;
    }

    /// Forget every digest, through exclusive access (no lock taken). An exposed buffer stays
    /// so: the caller's pointer outlives this writer.
    pub fn clear(&mut self) {
        let m = self.map.get_mut();
        m.of.clear();
        m.trusted.clear();
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

    #[test]
    fn what_callers_may_write_is_not_trusted_until_copied_again() {
        let d = Digests::default();
        d.set(0, 4096, &[[1, 1], [2, 2], [3, 3]]);
        assert_eq!(d.trusted(0, 12288, 4096), d.get(0, 12288, 4096));
        // A view of bytes 5000..5010: its piece is not trusted, what went out is still known.
        d.distrust(5000, 10);
        assert_eq!(
            d.trusted(0, 12288, 4096),
            vec![Some([1, 1]), None, Some([3, 3])]
        );
        assert_eq!(d.get(4096, 4096, 4096), vec![Some([2, 2])]);
        // Copied again: trusted again.
        d.set(4096, 4096, &[[4, 4]]);
        assert_eq!(d.trusted(4096, 4096, 4096), vec![Some([4, 4])]);
        d.distrust_all();
        assert_eq!(d.trusted(0, 12288, 4096), vec![None, None, None]);
        assert_eq!(d.get(0, 4096, 4096), vec![Some([1, 1])]);
        // Exposed: never trusted again, even once copied, with a new piece size or cleared.
        d.set(0, 4096, &[[5, 5]]);
        d.expose();
        assert_eq!(d.trusted(0, 4096, 4096), vec![None]);
        d.set(0, 4096, &[[6, 6]]);
        d.set(0, 8192, &[[7, 7]]);
        let mut d = d;
        d.clear();
        d.set(0, 8192, &[[7, 7]]);
        assert_eq!(d.get(0, 8192, 8192), vec![Some([7, 7])]);
        assert_eq!(d.trusted(0, 8192, 8192), vec![None]);
    }
}
