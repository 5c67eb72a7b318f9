//! Skipping unchanged memory at pause, and checking what a resume brought back.
//!
//! # Note [Skipping unchanged memory]
//!
//! In RL the frozen parts of a model (a reference model, a LoRA base, a draft model, weights
//! between two updates) are paused and resumed every step while their bytes never change. With
//! a retained host backup the backup still holds those bytes after the resume, so a pause
//! that knew which pieces changed could copy only those. The device tells us: a pause digests
//! each piece of what it pauses on the GPU (`Driver::digest`, a kernel reading at the device's
//! memory bandwidth, far above the link's), compares with the digest the backup recorded when
//! it took that piece, and copies only the pieces that differ. Pieces are of the device's
//! allocation granularity, so a run of segments is always whole pieces.
//!
//! A backup's digest of a piece is valid only while the backup holds exactly the bytes
//! digested (`backup/digests.rs`): a pause forgets the digests of the pieces it is about to
//! copy before it copies them and records the new ones once the run is copied, so a pause
//! that fails part-way leaves those pieces unknown (copied next time), never wrongly known.
//! Anything else of ours that writes a backup, or gives its pages back, forgets them too. A
//! caller handed a view may write through it: a pause skips nothing of a lease's range (of the
//! whole buffer once it is released) until it copied it again, nor anything of a buffer whose
//! address was given out unguarded (`tms_get_cpu_backup`), ever. Those writes are the caller's
//! to make, but a verified resume still compares with what the pause copied out where that
//! pause recorded digests: a backup changed after such a pause fails it.
//!
//! A resume may check its work the same way: after its copies it digests what it restored and
//! compares with the backup's digests (those recorded at the pause; for pieces whose digest is
//! not known, the backup's bytes digested on the host with the same function). A mismatch
//! fails the resume, which undoes itself as for any failure: the allocation stays paused with
//! its backup, and nothing is lost.
//!
//! Both are settings per tag (`Checks`), off by default until measured; a driver that cannot
//! digest (HIP) copies everything and checks nothing, saying so once in the log.

use super::base::Engine;
use super::pipeline::Changed;
use super::segment::Span;
use crate::backup::HostBuffer;
use crate::driver::digest::{self, Digest};
use crate::driver::DevPtr;
use crate::error::{Error, Result};

/// What a pause learned of one allocation by digesting the runs it pauses.
pub(super) struct Digested {
    /// The pieces to copy (`None`: all of them).
    pub(super) changed: Option<Changed>,
    /// Per run, where it starts in the allocation and its new digests, for the backup to
    /// record once the run is copied (`None`: nothing digested).
    runs: Vec<Option<(u64, Vec<Digest>)>>,
}

impl Digested {
    /// Nothing digested: everything is copied.
    pub(super) fn none(runs: usize) -> Self {
        Digested {
            changed: None,
            runs: (0..runs).map(|_| None).collect(),
        }
    }

    /// Run `r` is copied into `host`: it now holds what was digested.
    pub(super) fn record(&self, host: Option<&HostBuffer>, r: usize, piece: u64) {
        if let (Some(h), Some(Some((off, ds)))) = (host, self.runs.get(r)) {
            h.digests().set(*off, piece, ds);
        }
    }
}

/// Where a run's digests reach: bytes `off .. off + len` of the allocation, whole 8-byte words
/// of what the backup holds. A piece holding a tail of fewer than 8 bytes (an allocation of a
/// size not a multiple of 8) is always copied, since its digest does not cover it all.
pub(super) fn digest_range(span: &Span, base: DevPtr, size: u64) -> (u64, u64, bool) {
    let off = span.ptr - base;
    let backed = span.backed(base, size);
    (off, backed / 8 * 8, !backed.is_multiple_of(8))
}

impl Engine {
    /// Digest the runs a pause of the allocation at `ptr` (`size` bytes, tag `tag`) is about
    /// to copy into `host`, on `device` (current, synchronized), in pieces of `piece` bytes;
    /// forget, in the backup, the digests of what the copy will change. Failures of the digest
    /// itself only cost the skipping: everything is then copied (Note [Skipping unchanged
    /// memory]).
    pub(super) fn digest_for_pause(
        &self,
        device: i32,
        host: Option<&HostBuffer>,
        tag: &str,
        (ptr, size): (DevPtr, u64),
        spans: &[Span],
        piece: u64,
    ) -> Digested {
        let mut out = Digested::none(spans.len());
        let Some(h) = host else {
            return out;
        };
        let checks = self.settings.checks.of(tag);
        let forget_all = |h: &HostBuffer| {
            for s in spans {
                h.digests().forget(s.ptr - ptr, s.mapped);
            }
        };
        if !(checks.skip_unchanged || checks.verify) {
            forget_all(h);
            return out;
        }
        let pieces = size.div_ceil(piece) as usize;
        let mut mask = vec![true; pieces];
        for (r, s) in spans.iter().enumerate() {
            let (off, len, tail) = digest_range(s, ptr, size);
            if len == 0 {
                continue;
            }
            let now = match self.digest(device, ptr + off, len, piece) {
                Ok(Some(now)) => now,
                Ok(None) => {
                    forget_all(h);
                    return Digested::none(spans.len());
                }
                Err(e) => {
                    self.settings.checks.digest_failed(|| {
                        format!(
                            "digesting allocation {ptr:#x} (tag {tag:?}) for a pause: {e}; it \
                             is copied whole"
                        )
                    });
                    forget_all(h);
                    return Digested::none(spans.len());
                }
            };
            let first = (off / piece) as usize;
            if checks.skip_unchanged {
                let known = h.digests().trusted(off, len, piece);
                for (k, c) in changed(&known, &now).into_iter().enumerate() {
                    mask[first + k] = c;
                }
                if tail {
                    // The piece holding the last bytes, which no digest covers whole.
                    if let Some(last) = mask.get_mut(((off + len) / piece) as usize) {
                        *last = true;
                    }
                }
            }
            for (k, _) in now.iter().enumerate().filter(|(k, _)| mask[first + k]) {
                h.digests().forget((first + k) as u64 * piece, piece);
            }
            out.runs[r] = Some((off, now));
        }
        if checks.skip_unchanged {
            out.changed = Some(Changed {
                piece,
                changed: mask,
            });
        }
        out
    }

    /// The digests of `len` bytes at `ptr` on `device`, in pieces of `piece` bytes, on the
    /// engine's stream; `None` where the driver cannot digest.
    pub(super) fn digest(
        &self,
        device: i32,
        ptr: DevPtr,
        len: u64,
        piece: u64,
    ) -> Result<Option<Vec<Digest>>> {
        let d = &*self.driver;
        let stream = d.stream(device)?;
        match d.digest(device, ptr, len, piece, self.settings.checks.seed(), stream) {
            Ok(ds) => Ok(Some(ds)),
            Err(e) => self.settings.checks.unsupported_or(e),
        }
    }
}

/// One run a resume restored from a host backup, to verify.
pub(super) struct Restored<'a> {
    pub(super) device: i32,
    pub(super) ptr: DevPtr,
    pub(super) size: u64,
    pub(super) tag: &'a str,
    pub(super) span: Span,
    pub(super) host: &'a HostBuffer,
}

impl Engine {
    /// Check a run a resume restored against its backup (Note [Skipping unchanged memory]):
    /// the bytes verified (0 where not asked), or an error naming the allocation and the first
    /// piece that differs. `asked`: the caller asked for it (else the tag's checks do), so a
    /// driver that cannot digest is an error rather than a skipped check.
    pub(super) fn verify_run(&self, r: &Restored<'_>, asked: bool) -> Result<u64> {
        if !(asked || self.settings.checks.of(r.tag).verify) {
            return Ok(0);
        }
        let piece = self.granularity(r.device)?;
        let (off, len, _) = digest_range(&r.span, r.ptr, r.size);
        if len == 0 {
            return Ok(0);
        }
        let Some(now) = self.digest(r.device, r.ptr + off, len, piece)? else {
            if asked {
                return Err(Error::unsupported(format!(
                    "verifying the resume of allocation {:#x} (tag {:?}): the {} driver cannot \
                     digest device memory; resume without verifying",
                    r.ptr,
                    r.tag,
                    self.driver.name()
                )));
            }
            return Ok(0);
        };
        let want = self.known_or_host_digests(r.host, off, len, piece);
        for (k, (d, want)) in now.iter().zip(want).enumerate() {
            let a = off + k as u64 * piece;
            let b = (a + piece).min(off + len);
            if want != *d {
                return Err(Error::driver(
                    "tms_digest",
                    0,
                    "DIGEST_MISMATCH",
                    format!(
                        "verifying the resume of allocation {:#x} ({} bytes, tag {:?}): bytes \
                         {a}..{b} of it (piece {}) differ from its backup after the restore",
                        r.ptr,
                        r.size,
                        r.tag,
                        a / piece
                    ),
                ));
            }
        }
        Ok(len)
    }
}

impl Engine {
    /// The digests of the pieces of bytes `off..off + len` the backup holds: those recorded,
    /// the others computed here from its bytes (the same function as on the device; about
    /// 6 GB/s per core, so on the copy workers' number of threads).
    fn known_or_host_digests(
        &self,
        host: &HostBuffer,
        off: u64,
        len: u64,
        piece: u64,
    ) -> Vec<Digest> {
        let known = host.digests().get(off, len, piece);
        let bytes = host.as_slice();
        let seed = self.settings.checks.seed();
        let of = |k: usize| {
            known[k].unwrap_or_else(|| {
                let a = (off + k as u64 * piece) as usize;
                let b = (a as u64 + piece).min(off + len) as usize;
                digest::piece(&bytes[a..b], seed)
            })
        };
        let n = known.len();
        let threads = self.settings.copy().threads.clamp(1, n.max(1));
        if threads == 1 || known.iter().all(Option::is_some) {
            return (0..n).map(of).collect();
        }
        let mut out = vec![[0u64; 2]; n];
        let per = n.div_ceil(threads);
        let fill = |i: usize, part: &mut [Digest]| {
            for (j, d) in part.iter_mut().enumerate() {
                *d = of(i * per + j);
            }
        };
        // Parts no thread could be had for (`threads::spawn_scoped` says so instead of
        // panicking): done here once the others are.
        let mut left = Vec::new();
        std::thread::scope(|sc| {
            for (i, part) in out.chunks_mut(per).enumerate() {
                let fill = &fill;
                if crate::threads::spawn_scoped(sc, "tms-digest", move || fill(i, part)).is_none() {
                    left.push(i);
                }
            }
        });
        for i in left {
            fill(i, &mut out[i * per..((i + 1) * per).min(n)]);
        }
        out
    }
}

/// The pieces whose new digest differs from the known one (all where none is known).
pub(super) fn changed(known: &[Option<Digest>], now: &[Digest]) -> Vec<bool> {
    now.iter()
        .enumerate()
        .map(|(k, d)| known.get(k).copied().flatten() != Some(*d))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_different_digests_are_changed() {
        let known = [Some([1, 1]), None, Some([3, 3])];
        assert_eq!(
            changed(&known, &[[1, 1], [2, 2], [4, 3], [5, 5]]),
            vec![false, true, true, true]
        );
    }
}
