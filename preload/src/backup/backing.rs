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
