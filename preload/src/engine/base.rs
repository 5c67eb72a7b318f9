//! The engine object: the owners of its state (each lock is in Note [Locks] in `mod.rs`),
//! construction, teardown, and the public face of its settings. Its operations live in the
//! files named after them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use super::checks::Checks;
use super::comms::{Comms, NoComms};
use super::leases::Leases;
use super::pipeline::CopyConfig;
use super::registry::Registry;
use super::restoring::Restores;
use super::settings::Settings;
use super::txn::Ops;
use crate::backup::disk::BackupDir;
use crate::driver::{DevPtr, Driver};
use crate::error::Result;

/// The registry of pauseable allocations over one driver. Thread-safe.
pub struct Engine {
    pub(super) driver: Arc<dyn Driver>,
    /// The allocations (`registry.rs`).
    pub(super) registry: Registry,
    /// What pauses and resumes share: the operations lock and the staging slots, progress,
    /// the background pinner and releases, soundness (`txn.rs`).
    pub(super) ops: Ops,
    /// Segment size, copy configuration, retention, margin, disk folders (`settings.rs`).
    pub(super) settings: Settings,
    /// Backups handed out to callers (`leases.rs`).
    pub(super) leases: Leases,
    /// Non-blocking resumes in flight, and those that failed after returning
    /// (`restoring.rs`).
    pub(super) restores: Restores,
    /// NCCL's communicators, the reserved tag (`comms.rs`).
    pub(super) comms: Arc<dyn Comms>,
    /// The one device allocations were asked on so far ([`NO_DEVICE`] before the first,
    /// [`SEVERAL_DEVICES`] once a second shows up): what log lines name, read without a lock
    /// since a line may be written with any of the engine's held.
    device: AtomicI32,
}

/// `Engine::device` before any allocation.
const NO_DEVICE: i32 = -1;
/// `Engine::device` once allocations were asked on two devices.
const SEVERAL_DEVICES: i32 = -2;

impl Engine {
    /// An empty engine over `driver`.
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        Engine {
            driver,
            registry: Registry::default(),
            ops: Ops::default(),
            settings: Settings::default(),
            leases: Leases::default(),
            restores: Restores::default(),
            comms: Arc::new(NoComms),
            device: AtomicI32::new(NO_DEVICE),
        }
    }

    /// The device of every allocation asked for so far, when that is one device.
    pub fn sole_device(&self) -> Option<i32> {
        let d = self.device.load(Ordering::Relaxed);
        (d >= 0).then_some(d)
    }

    pub(super) fn note_device(&self, device: i32) {
        let seen = self.device.load(Ordering::Relaxed);
        if seen == device || seen == SEVERAL_DEVICES {
            return;
        }
        if let Err(other) =
            self.device
                .compare_exchange(NO_DEVICE, device, Ordering::Relaxed, Ordering::Relaxed)
        {
            if other != device {
                self.device.store(SEVERAL_DEVICES, Ordering::Relaxed);
            }
        }
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }
}

/// The settings' public face (`settings.rs` keeps them).
impl Engine {
    /// Map allocations made from now on in physical segments of at most `bytes` (a power of
    /// two; the granularity where it is larger). [`super::SEGMENT_BYTES`] by default; tests use small
    /// segments to exercise the multi-segment paths.
    pub fn set_segment_bytes(&self, bytes: u64) -> Result<()> {
        self.settings.set_segment(bytes)
    }

    /// The segment size set by [`Engine::set_segment_bytes`].
    pub fn segment_bytes(&self) -> u64 {
        self.settings.segment()
    }

    /// Set how backups are copied (used from the next pause or resume on).
    pub fn set_copy_config(&self, c: CopyConfig) -> Result<()> {
        self.settings.set_copy(c)
    }

    /// How backups are copied.
    pub fn copy_config(&self) -> CopyConfig {
        self.settings.copy()
    }

    /// Page-locked bytes held in staging slots.
    pub fn staging_bytes(&self) -> u64 {
        self.ops.staging_bytes()
    }

    /// Keep host backups across resume so the next pause reuses them (consulted at resume).
    pub fn set_retain_cpu_backup(&self, on: bool) {
        self.settings.set_retain(on);
    }

    /// Whether host backups are kept across resume.
    pub fn retain_cpu_backup(&self) -> bool {
        self.settings.retain()
    }

    /// What pauses and resumes of `tag` (`None`: of every tag without checks of its own) check
    /// with digests (Note [Skipping unchanged memory] in `digests.rs`), from the next on.
    pub fn set_checks(&self, tag: Option<&str>, checks: Checks) {
        self.settings.checks.set(tag, checks);
    }

    /// What pauses and resumes of `tag` check with digests.
    pub fn checks(&self, tag: &str) -> Checks {
        self.settings.checks.of(tag)
    }

    /// Put the files of disk backups made from now on in `dir` (`None`: back to the default, see
    /// [`Engine::set_default_disk_backup_dir`]). A relative path is made absolute now, against
    /// the current folder, so a later `chdir` does not move the files; the folder is created now
    /// if it is missing (mode 0700), and found again by its path at each new file, so one
    /// replaced later is used (Note [The disk backup folder]). Files made before stay where
    /// they are.
    pub fn set_disk_backup_dir(&self, dir: Option<PathBuf>) -> Result<()> {
        self.settings.set_disk_dir(dir)
    }

    /// Make `dir` the default directory of disk backup files (`TMS_DISK_BACKUP_DIR`; `None`: the
    /// system's temporary directory), and the current one. Made absolute now like
    /// [`Engine::set_disk_backup_dir`]'s, but created only when first needed: a job may make
    /// (or wipe and make again) the folder after the library started.
    pub fn set_default_disk_backup_dir(&self, dir: Option<PathBuf>) -> Result<()> {
        self.settings.set_default_disk_dir(dir)
    }

    /// Where new disk backup files go.
    pub fn disk_backup_dir(&self) -> Result<Arc<BackupDir>> {
        self.settings.disk_dir()
    }

    /// Refuse (with out-of-memory) allocations that would leave fewer than `bytes` free.
    pub fn set_memory_margin(&self, bytes: u64) {
        self.settings.set_margin(bytes);
    }

    /// The memory margin in bytes.
    pub fn memory_margin(&self) -> u64 {
        self.settings.margin()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // What resumes are still giving back goes with the engine too (Note [Releases] in `background.rs`).
        self.ops.wait_released();
        let addrs: Vec<DevPtr> = self.registry.lock().allocs.keys().copied().collect();
        for p in addrs {
            if let Err(e) = self.free(p) {
                tracing::error!("engine teardown: {e}");
            }
        }
    }
}
