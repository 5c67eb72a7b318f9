//! The engine's settings: segment size, copy configuration, retention, disk backup folder,
//! memory margin. Each is read where it is used, so a change applies from the next allocation,
//! pause or resume on (`Engine::set_copy_config` and its neighbours in `base.rs` are their
//! public face).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::comms::Registered;
use super::pipeline::CopyConfig;
use super::segment::SEGMENT_BYTES;
use crate::backup::disk::BackupDir;
use crate::error::{Error, Result};

/// The settings of one engine; each field a leaf (Note [Locks]).
pub(super) struct Settings {
    segment: AtomicU64,
    copy: Mutex<CopyConfig>,
    retain: AtomicBool,
    margin: AtomicU64,
    /// Folder of new disk backup files (`None`: `disk_default`).
    disk_dir: Mutex<Option<Arc<BackupDir>>>,
    /// The default one (`TMS_DISK_BACKUP_DIR`; `None`: the system's temporary folder, resolved
    /// and kept here on first use).
    disk_default: Mutex<Option<Arc<BackupDir>>>,
    /// Pauses and resumes of every tag include NCCL's communicators.
    nccl_in_all: AtomicBool,
    /// Pauses leave allocations holding a buffer NCCL registered mapped (else they refuse).
    keep_registered: AtomicBool,
    /// What pauses and resumes check with digests, per tag (`digests.rs`).
    pub(super) checks: super::checks::Policy,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            segment: AtomicU64::new(SEGMENT_BYTES),
            copy: Mutex::new(CopyConfig::default()),
            retain: AtomicBool::new(false),
            margin: AtomicU64::new(0),
            disk_dir: Mutex::default(),
            disk_default: Mutex::default(),
            nccl_in_all: AtomicBool::new(false),
            keep_registered: AtomicBool::new(true),
            checks: super::checks::Policy::default(),
        }
    }
}

impl Settings {
    /// Segments of at most `bytes` (a power of two) for allocations made from now on.
    pub fn set_segment(&self, bytes: u64) -> Result<()> {
        if !bytes.is_power_of_two() {
            return Err(Error::invalid_argument(format!(
                "segment size {bytes}: expected a power of two"
            )));
        }
        self.segment.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Copy backups so from the next pause or resume on.
    pub fn set_copy(&self, c: CopyConfig) -> Result<()> {
        c.validate()?;
        *self.copy.lock() = c;
        Ok(())
    }

    /// Keep host backups across resume (consulted at resume).
    pub fn set_retain(&self, on: bool) {
        self.retain.store(on, Ordering::Relaxed);
    }

    /// Include NCCL's communicators in pauses and resumes of every tag.
    pub fn set_nccl_in_all(&self, on: bool) {
        self.nccl_in_all.store(on, Ordering::Relaxed);
    }

    /// What pauses do with allocations holding a buffer NCCL registered.
    pub fn set_registered(&self, p: Registered) {
        self.keep_registered
            .store(p == Registered::Keep, Ordering::Relaxed);
    }

    /// Refuse allocations that would leave fewer than `bytes` free.
    pub fn set_margin(&self, bytes: u64) {
        self.margin.store(bytes, Ordering::Relaxed);
    }

    /// Put new disk backup files in `dir` (`None`: the default one), created now if missing.
    pub fn set_disk_dir(&self, dir: Option<PathBuf>) -> Result<()> {
        let dir = dir.map(|d| BackupDir::create(&d)).transpose()?;
        *self.disk_dir.lock() = dir;
        Ok(())
    }

    /// Make `dir` the default folder (`None`: the system's temporary one), and the current
    /// one; created only when first needed.
    pub fn set_default_disk_dir(&self, dir: Option<PathBuf>) -> Result<()> {
        let dir = dir.map(|d| BackupDir::new(&d)).transpose()?;
        *self.disk_default.lock() = dir;
        *self.disk_dir.lock() = None;
        Ok(())
    }

    /// The segment size of allocations made from now on.
    pub fn segment(&self) -> u64 {
        self.segment.load(Ordering::Relaxed)
    }

    /// How backups are copied.
    pub fn copy(&self) -> CopyConfig {
        *self.copy.lock()
    }

    /// Whether host backups are kept across resume.
    pub fn retain(&self) -> bool {
        self.retain.load(Ordering::Relaxed)
    }

    /// Whether pauses and resumes of every tag include NCCL's communicators.
    pub fn nccl_in_all(&self) -> bool {
        self.nccl_in_all.load(Ordering::Relaxed)
    }

    /// What pauses do with allocations holding a buffer NCCL registered.
    pub fn registered(&self) -> Registered {
        if self.keep_registered.load(Ordering::Relaxed) {
            Registered::Keep
        } else {
            Registered::Refuse
        }
    }

    /// The memory margin in bytes.
    pub fn margin(&self) -> u64 {
        self.margin.load(Ordering::Relaxed)
    }

    /// Where new disk backup files go: the folder set, else the default one (the system's
    /// temporary folder unless one was given, resolved once).
    pub fn disk_dir(&self) -> Result<Arc<BackupDir>> {
        if let Some(d) = self.disk_dir.lock().clone() {
            return Ok(d);
        }
        let mut default = self.disk_default.lock();
        if let Some(d) = default.clone() {
            return Ok(d);
        }
        let d = BackupDir::new(&std::env::temp_dir())
            .map_err(|e| e.context("the system's temporary directory"))?;
        *default = Some(d.clone());
        Ok(d)
    }
}
