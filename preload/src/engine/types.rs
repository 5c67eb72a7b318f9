//! The engine's value types: what callers ask for and what they are told about allocations.

use std::sync::Arc;

use crate::backup::{BackupKind, HostBuffer};
use crate::driver::DevPtr;

/// A host buffer and byte ranges of it.
pub(super) type BufferRanges = (Arc<HostBuffer>, Vec<(u64, u64)>);

/// CPU-backup policy of an allocation.
pub type Backup = Option<BackupKind>;

/// What to allocate.
#[derive(Clone, Debug, Default)]
pub struct AllocRequest {
    /// Bytes asked for (> 0).
    pub size: u64,
    /// Device ordinal.
    pub device: i32,
    /// Tag the allocation belongs to.
    pub tag: String,
    /// Keep contents across pause in host memory of this kind.
    pub backup: Backup,
    /// Chunk size of a chunked allocation (Note [Chunked allocations]); 0: not chunked.
    pub chunk: u64,
}

impl AllocRequest {
    /// `size` bytes of `tag` on device 0, not chunked.
    pub fn new(size: u64, tag: &str, backup: Backup) -> Self {
        AllocRequest {
            size,
            device: 0,
            tag: tag.into(),
            backup,
            chunk: 0,
        }
    }
}

/// Whether physical memory is behind an allocation, or a transaction is changing that.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Mapped and usable.
    Active,
    /// A pause is saving and releasing it (still mapped).
    Pausing,
    /// Unmapped; the address range stays reserved.
    Paused,
    /// Some segments mapped and the others paused: chunks of a chunked allocation, or what a
    /// failed pause released of another and could not restore (`pause.rs`).
    Partial,
    /// A resume is mapping and restoring it.
    Resuming,
}

/// A read-only view of one allocation, for tests and tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocInfo {
    /// Start address.
    pub addr: DevPtr,
    /// Bytes asked for.
    pub size: u64,
    /// Bytes mapped (size rounded up to the granularity).
    pub mapped: u64,
    /// Device ordinal.
    pub device: i32,
    /// Tag.
    pub tag: String,
    /// Backup policy.
    pub backup: Backup,
    /// Current state.
    pub state: State,
    /// Bytes of host memory held for this allocation's backup (for a chunked allocation, those
    /// of the chunks the backup holds).
    pub host_bytes: u64,
    /// Bytes of that host memory page-locked, in whole pages as the driver locks them (so up to
    /// a page more than `host_bytes`; the tag's statistics count only those of `host_bytes`).
    pub host_pinned_bytes: u64,
    /// Bytes of the disk backup's file.
    pub disk_bytes: u64,
    /// True when the host backup holds a complete snapshot: the contents while paused, the last
    /// pause's contents while active with the backup retained.
    pub host_valid: bool,
    /// Physical handles (segments) mapped: none while paused.
    pub handles: usize,
    /// Chunk size of a chunked allocation, else 0.
    pub chunk: u64,
    /// Bytes mapped now (less than `mapped` while some chunks are paused).
    pub active_bytes: u64,
    /// False for allocations that pause and resume leave alone (see [`Engine::alloc_unpauseable`]).
    pub pauseable: bool,
    /// Kept mapped by every pause and resume until freed (see [`Engine::keep_resident`]).
    pub resident: bool,
}

/// A host backup handed out by [`Engine::acquire_cpu_backup`]: the address of the bytes asked
/// for, valid and unchanged until [`Engine::release_cpu_backup`] of `lease`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackupLease {
    /// Start of the bytes asked for.
    pub ptr: *const u8,
    /// What to pass to [`Engine::release_cpu_backup`].
    pub lease: u64,
}

/// Where one allocation's chunks lie and which are active.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Start of the allocation.
    pub addr: DevPtr,
    /// Its tag.
    pub tag: String,
    /// Chunk size in bytes.
    pub chunk: u64,
    /// Per chunk: offset and size in bytes.
    pub layout: Vec<(u64, u64)>,
    /// Per chunk: mapped now (its contents on the device).
    pub active: Vec<bool>,
}
