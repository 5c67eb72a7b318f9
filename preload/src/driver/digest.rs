//! The device digest (Note [Skipping unchanged memory] in `engine/digests.rs`): a 128-bit
//! digest of each piece of a device range, computed where the memory is: on CUDA by a small
//! kernel the library carries as PTX (`cuda/digest_kernel.rs`), on the simulated device by
//! [`pieces`] below. This file is the function's definition; the kernel computes the same
//! partial sums bit for bit (the GPU suite checks it against [`pieces`] on random data).
//!
//! A piece is cut into blocks of [`BLOCK_BYTES`]; thread `t` of a block's [`THREADS`] folds
//! the block's 8-byte words `t`, `t + THREADS`, `t + 2·THREADS`, ... (a warp reads contiguous
//! memory) into two 64-bit lanes, each step `h = (h ^ w) · P` with `P` odd: a bijection of
//! `h` for a fixed `w` and of `w` for a fixed `h`. So a change confined to one thread's words
//! (one 8-byte word, say) always changes that thread's lanes; each thread's lanes pass through
//! a bijective finalizer keyed by its index and are summed per block (the order of a GPU
//! reduction does not matter), and the blocks' sums the same way per piece. Two different
//! pieces then collide only where the changed threads' terms cancel in both 64-bit sums at
//! once: for contents that are not built to collide, a chance of about 2⁻¹²⁸ per comparison.
//! The `seed` (random per process) keys every lane, so contents cannot be built to collide
//! without knowing it.

/// A piece's digest.
pub type Digest = [u64; 2];

/// Threads of a block of the kernel, each folding every `THREADS`-th word of the block.
pub const THREADS: u64 = 256;

/// Bytes one block of the kernel digests (the last block of a piece may have fewer).
pub const BLOCK_BYTES: u64 = 256 << 10;

const P1: u64 = 0x9E37_79B9_7F4A_7C15;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// MurmurHash3's 64-bit finalizer: a bijection that spreads every input bit over the output.
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    k ^= k >> 33;
    k = k.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    k ^ (k >> 33)
}

/// The lanes a thread starts from.
pub fn lanes_init(seed: u64) -> Digest {
    [seed ^ P1, !seed]
}

/// One word folded into a thread's lanes (the second lane sees the word's halves swapped).
#[inline]
pub fn fold(h: &mut Digest, w: u64) {
    h[0] = (h[0] ^ w).wrapping_mul(P1);
    h[1] = (h[1] ^ w.rotate_left(32)).wrapping_mul(P2);
}

/// Thread `t`'s share of its block's partial sums.
pub fn thread_term(h: Digest, t: u64) -> Digest {
    [
        fmix64(h[0].wrapping_add(t.wrapping_mul(P2))),
        fmix64(h[1] ^ t.wrapping_mul(P1)),
    ]
}

/// A block's partial sums: what the kernel writes for it. `block` holds at most
/// [`BLOCK_BYTES`] bytes, a multiple of 8.
pub fn block_partial(block: &[u8], seed: u64) -> Digest {
    debug_assert!(block.len() as u64 <= BLOCK_BYTES && block.len().is_multiple_of(8));
    let words = block.len() / 8;
    let word = |i: usize| u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().unwrap());
    let mut sum = [0u64; 2];
    for t in 0..THREADS as usize {
        let mut h = lanes_init(seed);
        let mut i = t;
        while i < words {
            fold(&mut h, word(i));
            i += THREADS as usize;
        }
        let term = thread_term(h, t as u64);
        sum[0] = sum[0].wrapping_add(term[0]);
        sum[1] = sum[1].wrapping_add(term[1]);
    }
    sum
}

/// A piece's digest from its blocks' partial sums, in order, and its length in bytes.
pub fn combine(partials: &[Digest], len: u64) -> Digest {
    let mut d = [0u64; 2];
    for (q, p) in partials.iter().enumerate() {
        let q = q as u64;
        d[0] = d[0].wrapping_add(fmix64(p[0].wrapping_add(q.wrapping_mul(P1))));
        d[1] = d[1].wrapping_add(fmix64(p[1] ^ q.wrapping_mul(P2)));
    }
    [fmix64(d[0] ^ len), fmix64(d[1].wrapping_add(len))]
}

/// Blocks of a piece of `len` bytes.
pub fn blocks(len: u64) -> u64 {
    len.div_ceil(BLOCK_BYTES)
}

/// The digest of one piece (a multiple of 8 bytes).
pub fn piece(data: &[u8], seed: u64) -> Digest {
    let partials: Vec<Digest> = data
        .chunks(BLOCK_BYTES as usize)
        .map(|b| block_partial(b, seed))
        .collect();
    combine(&partials, data.len() as u64)
}

/// The digests of `data` cut into pieces of `piece_len` bytes (the last may be shorter), as
/// [`crate::driver::Driver::digest`] returns them.
pub fn pieces(data: &[u8], piece_len: u64, seed: u64) -> Vec<Digest> {
    data.chunks(piece_len.max(1) as usize)
        .map(|p| piece(p, seed))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::pattern as data;

    #[test]
    fn every_single_word_change_is_seen() {
        // Two blocks and a short third: every word of each thread's stream, every bit position
        // class, in both lanes' sense (the digest as a whole must differ).
        let base = data(2 * BLOCK_BYTES as usize + 4096, 7);
        let d0 = piece(&base, 42);
        for i in (0..base.len() / 8).step_by(97) {
            for bit in [0, 31, 32, 63] {
                let mut b = base.clone();
                b[i * 8 + bit / 8] ^= 1 << (bit % 8);
                assert_ne!(piece(&b, 42), d0, "word {i} bit {bit}");
            }
        }
    }

    #[test]
    fn swapped_words_zeros_and_lengths_are_told_apart() {
        let base = data(BLOCK_BYTES as usize, 3);
        let d0 = piece(&base, 1);
        let mut swapped = base.clone();
        swapped.copy_within(0..8, 8 * 300);
        swapped[..8].copy_from_slice(&base[8 * 300..8 * 301]);
        assert_ne!(piece(&swapped, 1), d0);
        // Zeros of different lengths, and the same zeros under different seeds.
        let z1 = vec![0u8; 4096];
        let z2 = vec![0u8; 8192];
        assert_ne!(piece(&z1, 1), piece(&z2, 1));
        assert_ne!(piece(&z1, 1), piece(&z1, 2));
        // Moving a block's contents to another block changes the piece.
        let mut moved = vec![0u8; 2 * BLOCK_BYTES as usize];
        moved[..64].copy_from_slice(&base[..64]);
        let mut moved2 = vec![0u8; 2 * BLOCK_BYTES as usize];
        moved2[BLOCK_BYTES as usize..BLOCK_BYTES as usize + 64].copy_from_slice(&base[..64]);
        assert_ne!(piece(&moved, 1), piece(&moved2, 1));
    }

    #[test]
    fn pieces_are_cut_as_asked() {
        let d = data(5 * 4096, 9);
        let p = pieces(&d, 8192, 5);
        assert_eq!(p.len(), 3);
        assert_eq!(p[0], piece(&d[..8192], 5));
        assert_eq!(p[2], piece(&d[16384..], 5));
        assert_eq!(blocks(BLOCK_BYTES + 8), 2);
    }
}
