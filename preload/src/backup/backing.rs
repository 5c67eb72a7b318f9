//! What the copy pipeline needs of a backup (engine Note [The copy pipeline]): its length and
//! chunks, and how one *unit* (the part of a chunk inside one pipeline item) moves between a
//! device range and the backup, straight by DMA or through the worker's staging slots. Host
//! buffers (`host.rs`, page-locked or pageable) and disk files (`disk_file.rs`, with their
//! per-chunk checksums) implement it; the pipeline knows slots, queues and a backing, nothing
//! of files.
//!
//! The pipeline holds `&dyn Backing` per item, and calls it once or twice per unit plus once per
//! staging-slot piece (4 MiB by default) through `&mut dyn UnitIo`, never per byte. Dynamic
//! dispatch costs a few nanoseconds per call against milliseconds of copying; static dispatch
//! would buy nothing, since one operation mixes host and disk items, and it would compile the
//! workers once per backing.

use std::sync::Arc;

use super::{BackupKind, DiskFile, HostBuffer};
use crate::error::Result;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Device to backup (pause).
    Save,
    /// Backup to device (resume).
    Restore,
}

/// A backup as the copy pipeline sees it. Offsets in it are offsets in the allocation.
pub trait Backing: Sync {
    /// Where the contents are kept (for the operation's progress phase).
    fn kind(&self) -> BackupKind;

    /// Bytes it holds.
    fn len(&self) -> u64;

    /// Never true: backups hold at least one byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of chunks: the unit of work of the pipeline (and of page-locking or checksums).
    fn chunks(&self) -> usize;

    /// Offset and length of chunk `k`; chunks are of one size but the last.
    fn chunk_span(&self, k: usize) -> (u64, u64);

    /// The host address of byte `off` (inside chunk `k`) for a copy straight by DMA, if chunk
    /// `k` is page-locked; with `pin_now` (the engine's inline page-locking), a chunk that may
    /// be page-locked is made so first. `None`: the unit goes through the staging slots.
    fn direct(&self, k: usize, off: u64, pin_now: bool) -> Result<Option<*mut u8>>;

    /// Whether a save into chunk `k` is the first to write its memory since it was mapped or
    /// given back (the kernel still has to hand out its pages): the pipeline saves such chunks
    /// in smaller pieces. A hint for speed only.
    fn fresh(&self, _k: usize) -> bool {
        false
    }

    /// Copy bytes `off..off + len` (inside chunk `k`) in direction `dir` through the staging
    /// slots: `pieces` moves the unit in slot-sized pieces, in order, each through the
    /// [`UnitIo`] it is given, whose offsets are relative to `off`. Whatever the backing keeps
    /// per chunk (a disk file's checksum) is recorded or checked around it.
    ///
    /// # Safety
    /// Until it returns, nobody else reads or writes bytes `off..off + len` of the backup: the
    /// pipeline hands each unit to one worker, and its transaction excludes other users.
    unsafe fn staged(
        &self,
        dir: Dir,
        k: usize,
        off: u64,
        len: u64,
        pieces: &mut dyn FnMut(&mut dyn UnitIo) -> Result<()>,
    ) -> Result<()>;
}

/// The backup's side of one staged unit. Pieces pass in order, so a checksum streams.
pub trait UnitIo {
    /// Restoring: fill `slot` with the unit's bytes `at..at + slot.len()`.
    fn load(&mut self, at: u64, slot: &mut [u8]) -> Result<()>;

    /// Saving: keep `slot` as the unit's bytes `at..at + slot.len()`.
    fn store(&mut self, at: u64, slot: &[u8]) -> Result<()>;
}

/// The backup the pipeline copies for an allocation, if it has one: its host buffer, else its
/// file (an allocation with both is copied to and from host memory).
pub fn backing_of<'a>(
    host: &'a Option<Arc<HostBuffer>>,
    disk: &'a Option<Arc<DiskFile>>,
) -> Option<&'a dyn Backing> {
    match (host, disk) {
        (Some(h), _) => Some(&**h),
        (None, Some(f)) => Some(&**f),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    //! Each backing through the trait, as the pipeline's workers use it.

    use std::path::PathBuf;

    use super::*;
    use crate::backup::disk::BackupDir;
    use crate::backup::HostLayout;
    use crate::driver::sim::{SimConfig, SimDriver};
    use crate::driver::Driver;
    use crate::os::page_size;

    /// Disk files' unit of alignment ([`DIRECT_ALIGN`](crate::backup::disk::DIRECT_ALIGN));
    /// host buffers are sized in the system's pages instead.
    const BLOCK: usize = crate::backup::disk::DIRECT_ALIGN as usize;

    /// Bytes aligned as `O_DIRECT` needs (the pipeline's staging slots are: page-aligned).
    #[repr(align(4096))]
    struct Blocks([u8; 2 * BLOCK]);

    fn driver() -> Arc<dyn Driver> {
        Arc::new(SimDriver::new(SimConfig::default()).unwrap())
    }

    fn host(kind: BackupKind, len: u64, chunk: u64) -> HostBuffer {
        let layout = HostLayout {
            chunk,
            hugepages: false,
            streaming: false,
        };
        HostBuffer::new(driver(), 0, kind, len, layout).unwrap()
    }

    fn folder(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tms-backing-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Save `data` as unit `k` (`off`, `data.len()`) in pieces of `piece` bytes, as the
    /// pipeline's staging does.
    fn save(b: &dyn Backing, k: usize, off: u64, data: &[u8], piece: usize) -> Result<()> {
        // SAFETY: the test holds the backing alone.
        unsafe {
            b.staged(Dir::Save, k, off, data.len() as u64, &mut |io| {
                data.chunks(piece)
                    .enumerate()
                    .try_for_each(|(i, p)| io.store((i * piece) as u64, p))
            })
        }
    }

    /// Restore unit `k` into `out` in pieces of `piece` bytes.
    fn restore(b: &dyn Backing, k: usize, off: u64, out: &mut [u8], piece: usize) -> Result<()> {
        let len = out.len() as u64;
        // SAFETY: as in save.
        unsafe {
            b.staged(Dir::Restore, k, off, len, &mut |io| {
                out.chunks_mut(piece)
                    .enumerate()
                    .try_for_each(|(i, p)| io.load((i * piece) as u64, p))
            })
        }
    }

    #[test]
    fn a_pageable_host_buffer_is_copied_through_the_slots_in_any_part_of_a_chunk() {
        let page = page_size();
        let h = host(BackupKind::Mmap, 3 * page, 2 * page);
        let b: &dyn Backing = &h;
        assert_eq!(
            (b.kind(), b.len(), b.chunks()),
            (BackupKind::Mmap, 3 * page, 2)
        );
        assert_eq!(b.chunk_span(1), (2 * page, page));
        assert!(
            b.direct(0, 0, true).unwrap().is_none(),
            "pageable: never straight"
        );
        let data: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        save(b, 0, 100, &data, 1024).unwrap();
        assert_eq!(&h.as_slice()[100..3100], &data[..]);
        let mut back = vec![0u8; 3000];
        restore(b, 0, 100, &mut back, 700).unwrap();
        assert_eq!(back, data);
        let e = save(b, 1, 3 * page - 10, &data[..20], 20).unwrap_err();
        assert!(e.to_string().contains("host buffer"), "{e}");
    }

    #[test]
    fn a_pinned_host_buffer_is_copied_straight_once_page_locked() {
        let page = page_size();
        let h = host(BackupKind::Pinned, 4 * page, 2 * page);
        let b: &dyn Backing = &h;
        assert!(
            b.direct(1, 2 * page, false).unwrap().is_none(),
            "not page-locked yet"
        );
        let p = b
            .direct(1, 2 * page + 16, true)
            .unwrap()
            .expect("page-locked now");
        assert_eq!(
            p.cast_const(),
            h.as_ptr().wrapping_add(2 * page as usize + 16)
        );
        assert!(h.is_pinned(1) && !h.is_pinned(0));
        assert!(b.direct(1, 2 * page, false).unwrap().is_some());
        assert!(b.direct(0, 4 * page, false).is_err(), "past the end");
    }

    #[test]
    fn a_disk_file_is_copied_in_whole_chunks_and_checksummed() {
        let d = folder("disk");
        let dir = BackupDir::new(&d).unwrap();
        let f = DiskFile::create(&dir, 3 * BLOCK as u64, 2 * BLOCK as u64).unwrap();
        let b: &dyn Backing = &f;
        assert_eq!(
            (b.kind(), b.len(), b.chunks()),
            (BackupKind::Disk, 3 * BLOCK as u64, 2)
        );
        assert!(
            b.direct(0, 0, true).unwrap().is_none(),
            "files: always staged"
        );
        let mut data = Box::new(Blocks([0; 2 * BLOCK]));
        data.0
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as u8);
        save(b, 0, 0, &data.0, BLOCK).unwrap();
        save(b, 1, 2 * BLOCK as u64, &data.0[..BLOCK], BLOCK).unwrap();
        let mut back = Box::new(Blocks([0; 2 * BLOCK]));
        restore(b, 0, 0, &mut back.0, BLOCK).unwrap();
        assert_eq!(back.0, data.0);
        let e = save(b, 0, 0, &data.0[..BLOCK], BLOCK).unwrap_err();
        assert!(e.to_string().contains("cuts disk backup chunk 0"), "{e}");
        // Chunk 1 changes on disk while paused: its checksum no longer holds.
        {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(f.path())
                .unwrap();
            file.write_all_at(b"changed", 2 * BLOCK as u64 + 5).unwrap();
        }
        let e = restore(b, 1, 2 * BLOCK as u64, &mut back.0[..BLOCK], BLOCK).unwrap_err();
        assert!(
            e.to_string().contains("changed on disk while paused"),
            "{e}"
        );
        restore(b, 0, 0, &mut back.0, BLOCK).unwrap();
        drop(f);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_allocation_with_both_backups_is_copied_to_host_memory() {
        let d = folder("both");
        let dir = BackupDir::new(&d).unwrap();
        let page = page_size();
        let h = Some(Arc::new(host(BackupKind::Mmap, page, page)));
        let f = Some(Arc::new(
            DiskFile::create(&dir, BLOCK as u64, BLOCK as u64).unwrap(),
        ));
        let kind = |h, f| backing_of(h, f).map(|b| b.kind());
        assert_eq!(kind(&h, &f), Some(BackupKind::Mmap));
        assert_eq!(kind(&None, &f), Some(BackupKind::Disk));
        assert_eq!(kind(&h, &None), Some(BackupKind::Mmap));
        assert_eq!(kind(&None, &None), None);
        drop(f);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
