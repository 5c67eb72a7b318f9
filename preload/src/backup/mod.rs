//! Where paused contents wait: host memory (page-locked or pageable) or a file on disk. The
//! device driver only page-locks host memory for it; the engine chooses and moves the data,
//! through what each kind of backup says of itself ([`Backing`]).

pub mod backing;
pub mod digests;
pub mod disk;
mod disk_faults;
mod disk_file;
pub mod host;

pub use backing::{backing_of, Backing, Dir, UnitIo};
pub use digests::Digests;
pub use disk::DiskFile;
pub use host::{release_parallel, HostBuffer, HostLayout};

use crate::error::{Error, Result};

/// Where an allocation's contents are kept while it is paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackupKind {
    /// Host memory page-locked through the driver, chunk by chunk (when, the engine's
    /// `PinMode` says: by default once the backup is retained).
    Pinned,
    /// Pageable anonymous host memory (`mmap`).
    Mmap,
    /// A file of its own in the disk backup directory (see [`disk`]).
    Disk,
}

impl BackupKind {
    /// Parse a CPU backup backend: `"pinned"` or `"mmap"` (the disk is asked for with its own
    /// flag, `enable_disk_backup`).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "pinned" => Ok(BackupKind::Pinned),
            "mmap" => Ok(BackupKind::Mmap),
            "disk" => Err(Error::invalid_argument(
                "\"disk\" is not a CPU backup backend: ask for a disk backup with \
                 enable_disk_backup=True (TMS_INIT_ENABLE_DISK_BACKUP=1) instead",
            )),
            other => Err(Error::invalid_argument(format!(
                "unknown CPU backup backend {other:?}: expected \"pinned\" or \"mmap\""
            ))),
        }
    }

    /// The name of the kind (`parse` accepts the host ones).
    pub fn as_str(self) -> &'static str {
        match self {
            BackupKind::Pinned => "pinned",
            BackupKind::Mmap => "mmap",
            BackupKind::Disk => "disk",
        }
    }

    /// Kept in host memory.
    pub fn is_host(self) -> bool {
        self != BackupKind::Disk
    }
}
