//! The engine's settings: segment size, copy configuration, retention, disk backup folder,
//! memory margin; and the device facts they are checked against.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::base::Engine;
use super::pipeline::{CopyConfig, Ring};
use crate::error::{Error, Result};

impl Engine {
    /// Map allocations made from now on in physical segments of at most `bytes` (a power of
    /// two; the granularity where it is larger). [`SEGMENT_BYTES`] by default; tests use small
    /// segments to exercise the multi-segment paths.
    pub fn set_segment_bytes(&self, bytes: u64) -> Result<()> {
        if !bytes.is_power_of_two() {
            return Err(Error::invalid_argument(format!(
                "segment size {bytes}: expected a power of two"
            )));
        }
        self.segment.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// The segment size set by [`Engine::set_segment_bytes`].
    pub fn segment_bytes(&self) -> u64 {
        self.segment.load(Ordering::Relaxed)
    }

    /// Set how backups are copied (used from the next pause or resume on).
    pub fn set_copy_config(&self, c: CopyConfig) -> Result<()> {
        c.validate()?;
        *self.copy.lock() = c;
        Ok(())
    }

    /// How backups are copied.
    pub fn copy_config(&self) -> CopyConfig {
        *self.copy.lock()
    }

    /// Page-locked bytes held in staging slots.
    pub fn staging_bytes(&self) -> u64 {
        self.ops.lock().rings.values().map(Ring::bytes).sum()
    }

    /// Keep host backups across resume so the next pause reuses them (consulted at resume).
    pub fn set_retain_cpu_backup(&self, on: bool) {
        self.retain.store(on, Ordering::Relaxed);
    }

    /// Whether host backups are kept across resume.
    pub fn retain_cpu_backup(&self) -> bool {
        self.retain.load(Ordering::Relaxed)
    }

    /// Put the files of disk backups made from now on in `dir` (`None`: back to the default, see
    /// [`Engine::set_default_disk_backup_dir`]). A relative path is made absolute now, against
    /// the current folder, so a later `chdir` does not move the files; the folder is created now
    /// if it is missing (mode 0700), and found again by its path at each new file, so one
    /// replaced later is used (Note [The disk backup folder]). Files made before stay where
    /// they are.
    pub fn set_disk_backup_dir(&self, dir: Option<std::path::PathBuf>) -> Result<()> {
        let dir = dir
            .map(|d| crate::backup::disk::BackupDir::create(&d))
            .transpose()?;
        *self.disk_dir.lock() = dir;
        Ok(())
    }

    /// Make `dir` the default directory of disk backup files (`TMS_DISK_BACKUP_DIR`; `None`: the
    /// system's temporary directory), and the current one. Made absolute now like
    /// [`Engine::set_disk_backup_dir`]'s, but created only when first needed: a job may make
    /// (or wipe and make again) the folder after the library started.
    pub fn set_default_disk_backup_dir(&self, dir: Option<std::path::PathBuf>) -> Result<()> {
        let dir = dir
            .map(|d| crate::backup::disk::BackupDir::new(&d))
            .transpose()?;
        *self.disk_default.lock() = dir;
        *self.disk_dir.lock() = None;
        Ok(())
    }

    /// Where new disk backup files go.
    pub fn disk_backup_dir(&self) -> Result<Arc<crate::backup::disk::BackupDir>> {
        if let Some(d) = self.disk_dir.lock().clone() {
            return Ok(d);
        }
        let mut default = self.disk_default.lock();
        if let Some(d) = default.clone() {
            return Ok(d);
        }
        let d = crate::backup::disk::BackupDir::new(&std::env::temp_dir())
            .map_err(|e| e.context("the system's temporary directory"))?;
        *default = Some(d.clone());
        Ok(d)
    }

    /// Refuse (with out-of-memory) allocations that would leave fewer than `bytes` free.
    pub fn set_memory_margin(&self, bytes: u64) {
        self.margin.store(bytes, Ordering::Relaxed);
    }

    /// The memory margin in bytes.
    pub fn memory_margin(&self) -> u64 {
        self.margin.load(Ordering::Relaxed)
    }

    pub(super) fn granularity(&self, device: i32) -> Result<u64> {
        if let Some(g) = self.reg.lock().granularity.get(&device) {
            return Ok(*g);
        }
        let g = self.driver.granularity(device)?;
        if g == 0 || !g.is_power_of_two() {
            return Err(Error::invalid_state(format!(
                "device {device} reports granularity {g}"
            )));
        }
        self.reg.lock().granularity.insert(device, g);
        Ok(g)
    }

    /// Refuse a chunk size that is not a multiple of the current device's granularity.
    pub fn check_chunk_size(&self, chunk: u64) -> Result<()> {
        let device = self.driver.current_device()?;
        let g = self.granularity(device)?;
        if chunk == 0 || chunk % g != 0 {
            return Err(Error::invalid_argument(format!(
                "chunk size {chunk} bytes: expected a positive multiple of device {device}'s \
                 granularity ({g} bytes)"
            )));
        }
        Ok(())
    }

    pub(super) fn check_device(&self, device: i32) -> Result<()> {
        let n = self.driver.device_count()?;
        if device < 0 || device >= n {
            return Err(Error::invalid_argument(format!(
                "device {device} does not exist ({} has {n})",
                self.driver.name()
            )));
        }
        Ok(())
    }
}
