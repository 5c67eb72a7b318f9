//! Settings: the process's, read once from the environment at first use, and each thread's
//! region settings (a stack, so regions nest and `disable()` can sit inside a region).
//!
//! Environment (all optional):
//! - `TMS_INIT_ENABLE=1`: every thread starts inside a region.
//! - `TMS_INIT_TAG=T`: the tag of that default region (default `default`).
//! - `TMS_INIT_ENABLE_CPU_BACKUP=1`: the default region keeps a CPU backup.
//! - `TMS_INIT_CPU_BACKUP_BACKEND=pinned|mmap`: default host memory for backups.
//! - `TMS_RETAIN_CPU_BACKUP=1`: keep host backups across resume.
//! - `TMS_MEMORY_MARGIN_BYTES=N`: refuse pauseable allocations leaving less than N bytes free.
//! - `TMS_BACKEND=auto|cuda|hip|sim`: which driver (auto = cuda where the CUDA driver library
//!   opens, else hip where the HIP runtime does).
//! - `TMS_HIP_LIBRARY=PATH`, `TMS_HIP_RESERVE_AGAIN=0|1`: the HIP driver's (`driver/hip/`).
//! - `TMS_COPY_THREADS=N`: copy workers per device (default: the cores, at most 16).
//! - `TMS_COPY_CHUNK=BYTES`: unit of copy work and of page-locking (default 64 MiB).
//! - `TMS_STAGING_SLOT=BYTES`: size of each staging slot, two per worker (default 4 MiB).
//! - `TMS_HOST_HUGEPAGES=0|1`: ask for transparent huge pages for host backups (default 1).
//! - `TMS_PIN=background|inline|never`: when pinned backups are page-locked (default background).
//! - `TMS_NCCL_IN_ALL=1`: pauses and resumes of every tag include NCCL's communicators.
//! - `TMS_SKIP_UNCHANGED=0|1`, `TMS_VERIFY_RESUME=0|1`: what pauses and resumes of every tag
//!   check with digests (default 0, 0; per tag: `tms_set_checks`).
//! - `TMS_NCCL_REGISTERED=keep|refuse`: what pauses do with allocations holding buffers NCCL
//!   registered (default keep).
//! - `TMS_LOG=filter`: logging to stderr (`info`, `tms=debug`, ...).
//! - `TMS_LOG_FORMAT=text|json`: the shape of those lines (default text); every line names the
//!   pid that wrote it and, where its pauseable memory is on one device, that device.

use std::cell::RefCell;
use std::sync::OnceLock;

use parking_lot::RwLock;

use crate::backup::BackupKind;
use crate::driver::hip::HipSettings;
use crate::driver::sim::SimDriver;
use crate::engine::{reserved_tag, CopyConfig, PinMode, Registered, NCCL_TAG};
use crate::error::{Error, Result};
use crate::units::{env_parsed, parse_bytes, parse_flag, var_parsed};

/// Which driver the runtime opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// The CUDA driver where its library opens, else the HIP runtime where it opens (the
    /// default).
    Auto,
    /// The CUDA driver, explicitly.
    Cuda,
    /// The HIP runtime (ROCm), explicitly.
    Hip,
    /// The simulated device.
    Sim,
}

impl BackendChoice {
    fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "" | "auto" => Ok(BackendChoice::Auto),
            "cuda" => Ok(BackendChoice::Cuda),
            "hip" => Ok(BackendChoice::Hip),
            "sim" => Ok(BackendChoice::Sim),
            other => Err(Error::invalid_argument(format!(
                "unknown backend {other:?}: expected auto, cuda, hip or sim"
            ))),
        }
    }
}

/// Where new allocations of a thread go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionSettings {
    /// Allocations are pauseable.
    pub enabled: bool,
    /// Their tag.
    pub tag: String,
    /// They keep a CPU backup across pause.
    pub cpu_backup: bool,
    /// In this kind of host memory (`Pinned` or `Mmap`).
    pub backend: BackupKind,
    /// They keep a disk backup across pause (never together with `cpu_backup`).
    pub disk_backup: bool,
    /// They are chunked allocations of chunks of this many bytes (0: not chunked).
    pub chunk: u64,
}

impl RegionSettings {
    /// The engine's backup policy for these settings.
    pub fn backup(&self) -> Option<BackupKind> {
        if self.disk_backup {
            return Some(BackupKind::Disk);
        }
        self.cpu_backup.then_some(self.backend)
    }

    /// Refuse a CPU and a disk backup at once, and a pauseable region with the tag reserved
    /// for NCCL's communicators.
    pub fn check(&self) -> Result<()> {
        if self.enabled && self.tag == NCCL_TAG {
            return Err(Error::invalid_argument(reserved_tag()));
        }
        if self.cpu_backup && self.disk_backup {
            return Err(Error::invalid_argument(format!(
                "region {:?}: enable_cpu_backup and enable_disk_backup are mutually exclusive \
                 (a paused allocation keeps its contents in one place)",
                self.tag
            )));
        }
        Ok(())
    }
}

/// Settings of the process, from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessSettings {
    /// Initial default region of every thread.
    pub region: RegionSettings,
    /// `TMS_RETAIN_CPU_BACKUP`.
    pub retain_cpu_backup: bool,
    /// `TMS_MEMORY_MARGIN_BYTES`.
    pub memory_margin: u64,
    /// `TMS_BACKEND`.
    pub backend: BackendChoice,
    /// `TMS_COPY_THREADS`, `TMS_COPY_CHUNK`, `TMS_STAGING_SLOT`, `TMS_HOST_HUGEPAGES`, `TMS_PIN`,
    /// `TMS_DISK_BACKUP_CHUNK_MB`.
    pub copy: CopyConfig,
    /// `TMS_DISK_BACKUP_DIR`.
    pub disk_dir: Option<std::path::PathBuf>,
    /// `TMS_DISK_FAULTS` (a testing aid: fail chosen file operations of disk backups).
    pub disk_faults: Vec<(crate::backup::disk::DiskOp, u64, i32)>,
    /// `TMS_RDMA` (default on) and `TMS_SHAREABLE` (default off): how pauseable memory is made.
    pub memory: crate::driver::MemoryFlags,
    /// `TMS_NCCL_IN_ALL`: pauses and resumes of every tag include NCCL's communicators.
    pub nccl_in_all: bool,
    /// `TMS_SKIP_UNCHANGED` and `TMS_VERIFY_RESUME`: the default checks of every tag.
    pub checks: crate::engine::Checks,
    /// `TMS_NCCL_REGISTERED`: what pauses do with allocations holding buffers NCCL registered.
    pub nccl_registered: Registered,
}

/// The copy settings from the environment, over the defaults.
pub fn copy_config_from_env() -> Result<CopyConfig> {
    // A value that is not UTF-8 is malformed, as for every other variable (not absent).
    copy_config_from(&|name| env_parsed(name, |v| Ok(v.to_string())))
}

/// The copy settings from the variables `lookup` finds, over the defaults.
fn copy_config_from(lookup: &dyn Fn(&str) -> Result<Option<String>>) -> Result<CopyConfig> {
    // The variable `name` through `parse` (absent: `None`), naming it in any error.
    fn var<T>(
        lookup: &dyn Fn(&str) -> Result<Option<String>>,
        name: &str,
        parse: impl FnOnce(&str) -> Result<T>,
    ) -> Result<Option<T>> {
        var_parsed(name, lookup(name)?.as_deref(), parse)
    }
    let mut c = CopyConfig::default();
    if let Some(n) = var(lookup, "TMS_COPY_THREADS", |s| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| Error::invalid_argument(format!("{s:?} is not a number of threads")))
    })? {
        c.threads = n;
    }
    if let Some(b) = var(lookup, "TMS_COPY_CHUNK", parse_bytes)? {
        c.layout.chunk = b;
    }
    if let Some(b) = var(lookup, "TMS_STAGING_SLOT", parse_bytes)? {
        c.slot = b;
    }
    match var(lookup, "TMS_STAGING_SLOT_SAVE", parse_bytes)? {
        Some(b) if b > c.slot => {
            return Err(Error::invalid_argument(format!(
                "TMS_STAGING_SLOT_SAVE: {b} bytes, more than the staging slot of {} bytes \
                 (TMS_STAGING_SLOT): expected at most the slot",
                c.slot
            )))
        }
        Some(b) => c.save_slot = b,
        // The default, where the slot is set smaller: all of it.
        None => c.save_slot = c.save_slot.min(c.slot),
    }
    if let Some(f) = var(lookup, "TMS_HOST_HUGEPAGES", parse_flag)? {
        c.layout.hugepages = f;
    }
    if let Some(f) = var(lookup, "TMS_STREAMING_STORES", parse_flag)? {
        c.layout.streaming = f;
    }
    if let Some(p) = var(lookup, "TMS_PIN", PinMode::parse)? {
        c.pin = p;
    }
    if let Some(f) = var(lookup, "TMS_KEEP_STAGING", parse_flag)? {
        c.keep_staging = f;
    }
    if let Some(f) = var(lookup, "TMS_SAVE_STREAMS", parse_flag)? {
        c.save_streams = f;
    }
    if let Some(mb) = var(lookup, "TMS_DISK_BACKUP_CHUNK_MB", |s| {
        s.trim()
            .parse::<u64>()
            .ok()
            .and_then(|mb| mb.checked_mul(1 << 20))
            .ok_or_else(|| Error::invalid_argument(format!("{s:?} is not a number of MiB")))
    })? {
        c.disk_chunk = mb;
    }
    c.validate().map_err(|e| {
        e.context("TMS_COPY_THREADS / TMS_COPY_CHUNK / TMS_STAGING_SLOT / TMS_STAGING_SLOT_SAVE")
    })?;
    Ok(c)
}

impl ProcessSettings {
    /// Read every `TMS_*` variable; the first malformed one is the error.
    pub fn from_env() -> Result<Self> {
        // Read as the Python package reads it: white space around it ignored, empty the default.
        let backend = env_parsed("TMS_INIT_CPU_BACKUP_BACKEND", |s| match s.trim() {
            "" => Ok(BackupKind::Pinned),
            s => BackupKind::parse(s),
        })?
        .unwrap_or(BackupKind::Pinned);
        let tag = match env_parsed("TMS_INIT_TAG", |t| Ok(t.to_string()))? {
            Some(t) if t.is_empty() => {
                return Err(Error::invalid_argument(
                    "environment variable TMS_INIT_TAG is empty",
                ))
            }
            Some(t) if t == NCCL_TAG => {
                return Err(Error::invalid_argument(reserved_tag())
                    .context("environment variable TMS_INIT_TAG"))
            }
            Some(t) => t,
            None => "default".to_string(),
        };
        let backend_choice =
            env_parsed("TMS_BACKEND", BackendChoice::parse)?.unwrap_or(BackendChoice::Auto);
        // Checked here, with the other settings, so that a malformed one leaves the process
        // alone (allocations pass through) as any malformed TMS_* variable does.
        match backend_choice {
            BackendChoice::Sim => {
                SimDriver::settings_from_env()?;
            }
            BackendChoice::Hip => {
                HipSettings::from_env()?;
            }
            BackendChoice::Auto | BackendChoice::Cuda => {}
        }
        let region = RegionSettings {
            enabled: env_parsed("TMS_INIT_ENABLE", parse_flag)?.unwrap_or(false),
            tag,
            cpu_backup: env_parsed("TMS_INIT_ENABLE_CPU_BACKUP", parse_flag)?.unwrap_or(false),
            backend,
            disk_backup: env_parsed("TMS_INIT_ENABLE_DISK_BACKUP", parse_flag)?.unwrap_or(false),
            chunk: 0,
        };
        region.check().map_err(|e| {
            e.context(
                "environment variables TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP",
            )
        })?;
        let disk_dir = match std::env::var_os("TMS_DISK_BACKUP_DIR") {
            Some(d) if !d.is_empty() => Some(std::path::PathBuf::from(d)),
            _ => None,
        };
        Ok(ProcessSettings {
            region,
            disk_dir,
            disk_faults: env_parsed("TMS_DISK_FAULTS", crate::backup::disk::parse_faults)?
                .unwrap_or_default(),
            retain_cpu_backup: env_parsed("TMS_RETAIN_CPU_BACKUP", parse_flag)?.unwrap_or(false),
            memory_margin: env_parsed("TMS_MEMORY_MARGIN_BYTES", parse_bytes)?.unwrap_or(0),
            backend: backend_choice,
            copy: copy_config_from_env()?,
            memory: crate::driver::MemoryFlags {
                rdma: env_parsed("TMS_RDMA", parse_flag)?.unwrap_or(true),
                shareable: env_parsed("TMS_SHAREABLE", parse_flag)?.unwrap_or(false),
            },
            nccl_in_all: env_parsed("TMS_NCCL_IN_ALL", parse_flag)?.unwrap_or(false),
            checks: crate::engine::Checks {
                skip_unchanged: env_parsed("TMS_SKIP_UNCHANGED", parse_flag)?.unwrap_or(false),
                verify: env_parsed("TMS_VERIFY_RESUME", parse_flag)?.unwrap_or(false),
            },
            nccl_registered: env_parsed("TMS_NCCL_REGISTERED", Registered::parse)?
                .unwrap_or_default(),
        })
    }
}

/// A failure kept for every later caller: status code and message.
#[derive(Clone, Debug)]
pub struct StickyError {
    /// Status code (see [`crate::error::status`]).
    pub status: i32,
    /// Message.
    pub message: String,
}

impl From<&Error> for StickyError {
    fn from(e: &Error) -> Self {
        StickyError {
            status: e.status(),
            message: e.to_string(),
        }
    }
}

impl StickyError {
    /// Back into an error of the same status.
    pub fn to_error(&self) -> Error {
        Error::sticky(self.status, self.message.clone())
    }
}

static PROCESS: OnceLock<std::result::Result<ProcessSettings, StickyError>> = OnceLock::new();
static DEFAULT_REGION: RwLock<Option<RegionSettings>> = RwLock::new(None);

/// The process settings, read from the environment on first call.
pub fn process() -> Result<&'static ProcessSettings> {
    if super::fork::forked() {
        // A child of fork never waits on the first read: a fork may have cut it in half.
        return match PROCESS.get() {
            Some(r) => r.as_ref().map_err(StickyError::to_error),
            None => Err(Error::invalid_state(
                "torch-memory-saver is disabled in this process: it was forked from one that used it",
            )),
        };
    }
    super::fork::note_first_use();
    PROCESS
        .get_or_init(|| {
            let names: Vec<String> = std::env::vars_os()
                .filter_map(|(k, _)| k.into_string().ok())
                .collect();
            for line in super::env_names::warnings(names.iter().map(String::as_str)) {
                super::logging::say(&line);
            }
            ProcessSettings::from_env().map_err(|e| StickyError::from(&e))
        })
        .as_ref()
        .map_err(StickyError::to_error)
}

/// The region settings of threads that have not set their own.
pub fn default_region() -> Result<RegionSettings> {
    if let Some(r) = DEFAULT_REGION.read().as_ref() {
        return Ok(r.clone());
    }
    Ok(process()?.region.clone())
}

/// Change the region settings of threads that have not set their own.
pub fn set_default_region(r: RegionSettings) {
    *DEFAULT_REGION.write() = Some(r);
}

thread_local! {
    static STACK: RefCell<Vec<RegionSettings>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's effective region settings. A thread whose locals are gone (it is
/// exiting) is treated as outside any region.
pub fn current_region() -> Result<RegionSettings> {
    match STACK.try_with(|s| s.borrow().last().cloned()) {
        Ok(Some(r)) => Ok(r),
        Ok(None) => default_region(),
        Err(_) => Ok(RegionSettings {
            enabled: false,
            ..default_region()?
        }),
    }
}

/// True when the calling thread's allocations are pauseable now. Fast path for the hooks.
pub fn in_region() -> Result<bool> {
    match STACK.try_with(|s| s.borrow().last().map(|r| r.enabled)) {
        Ok(Some(e)) => Ok(e),
        Ok(None) => Ok(DEFAULT_REGION
            .read()
            .as_ref()
            .map_or_else(|| process().map(|p| p.region.enabled), |r| Ok(r.enabled))?),
        Err(_) => Ok(false),
    }
}

/// Enter a region (or, with `enabled = false`, a non-pauseable scope) on this thread.
pub fn push_region(r: RegionSettings) -> Result<()> {
    if r.tag.is_empty() {
        return Err(Error::invalid_argument("a region's tag must not be empty"));
    }
    r.check()?;
    STACK
        .try_with(|s| s.borrow_mut().push(r))
        .map_err(|_| Error::invalid_state("thread is exiting"))
}

/// Leave the innermost region of this thread.
pub fn pop_region() -> Result<RegionSettings> {
    STACK
        .try_with(|s| s.borrow_mut().pop())
        .map_err(|_| Error::invalid_state("thread is exiting"))?
        .ok_or_else(|| {
            Error::invalid_state("region exit without a matching region enter on this thread")
        })
}

/// Change the calling thread's innermost region with `f`; with no region open, open one from
/// the thread's effective settings first (the upstream setters, `tms_set_current_tag` and
/// friends, act on "the thread's region", which has no enter/exit of its own).
pub fn update_region(f: impl FnOnce(&mut RegionSettings)) -> Result<()> {
    let mut new = current_region()?;
    f(&mut new);
    // Nothing changes when the result is refused (a CPU and a disk backup at once).
    new.check()?;
    STACK
        .try_with(|s| {
            let mut s = s.borrow_mut();
            match s.last_mut() {
                Some(top) => *top = new,
                None => s.push(new),
            }
        })
        .map_err(|_| Error::invalid_state("thread is exiting"))
}

/// Depth of this thread's region stack.
pub fn region_depth() -> usize {
    STACK.try_with(|s| s.borrow().len()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(enabled: bool, tag: &str) -> RegionSettings {
        RegionSettings {
            enabled,
            tag: tag.into(),
            cpu_backup: false,
            backend: BackupKind::Pinned,
            disk_backup: false,
            chunk: 0,
        }
    }

    #[test]
    fn region_stack_nests_and_refuses_bad_pops() {
        std::thread::spawn(move || {
            push_region(r(true, "kv")).unwrap();
            assert!(in_region().unwrap());
            push_region(r(false, "kv")).unwrap();
            assert!(!in_region().unwrap());
            assert_eq!(region_depth(), 2);
            pop_region().unwrap();
            assert_eq!(current_region().unwrap().tag, "kv");
            pop_region().unwrap();
            assert!(pop_region().is_err());
            assert!(push_region(r(true, "")).is_err());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn update_region_changes_the_innermost_or_opens_one() {
        std::thread::spawn(move || {
            let base = current_region().unwrap();
            update_region(|s| s.tag = "opened".into()).unwrap();
            assert_eq!(region_depth(), 1);
            assert_eq!(current_region().unwrap().tag, "opened");
            assert_eq!(current_region().unwrap().enabled, base.enabled);
            push_region(r(true, "inner")).unwrap();
            update_region(|s| s.enabled = false).unwrap();
            assert_eq!(region_depth(), 2);
            assert!(!in_region().unwrap());
            assert_eq!(current_region().unwrap().tag, "inner");
            pop_region().unwrap();
            assert_eq!(current_region().unwrap().tag, "opened");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn copy_settings_parse_and_bad_ones_are_refused() {
        let with = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            copy_config_from(&move |name| {
                Ok(vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
            })
        };
        let c = with(&[
            ("TMS_COPY_THREADS", "3"),
            ("TMS_COPY_CHUNK", "8MiB"),
            ("TMS_STAGING_SLOT", "1MiB"),
            ("TMS_HOST_HUGEPAGES", "0"),
            ("TMS_STREAMING_STORES", "1"),
            ("TMS_STAGING_SLOT_SAVE", "512KiB"),
            ("TMS_PIN", "never"),
            ("TMS_KEEP_STAGING", "1"),
            ("TMS_SAVE_STREAMS", "1"),
        ])
        .unwrap();
        assert_eq!(c.save_slot, 512 << 10);
        assert!(c.keep_staging && c.save_streams);
        assert_eq!(
            (c.threads, c.layout.chunk, c.slot, c.layout.hugepages, c.pin),
            (3, 8 << 20, 1 << 20, false, PinMode::Never)
        );
        assert!(c.layout.streaming);
        assert_eq!(with(&[]).unwrap(), CopyConfig::default());
        let e = with(&[("TMS_COPY_THREADS", "0")]).unwrap_err().to_string();
        assert!(
            e.contains("copy threads") && e.contains("TMS_COPY_THREADS"),
            "{e}"
        );
        let e = with(&[("TMS_COPY_THREADS", "many")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"many\" is not a number"), "{e}");
        let e = with(&[("TMS_STAGING_SLOT", "1000")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("staging slot of 1000 bytes"), "{e}");
        let e = with(&[("TMS_STAGING_SLOT_SAVE", "100")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("staging slot for saving of 100 bytes"), "{e}");
        let e = with(&[
            ("TMS_STAGING_SLOT", "1MiB"),
            ("TMS_STAGING_SLOT_SAVE", "64MiB"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("TMS_STAGING_SLOT_SAVE") && e.contains("at most the slot"),
            "{e}"
        );
        let c = with(&[("TMS_STAGING_SLOT", "512KiB")]).unwrap();
        assert_eq!(
            (c.slot, c.save_slot),
            (512 << 10, 512 << 10),
            "the default, capped"
        );
        let e = with(&[("TMS_COPY_CHUNK", "0")]).unwrap_err().to_string();
        assert!(e.contains("copy chunk of 0 bytes"), "{e}");
        let e = with(&[("TMS_PIN", "sometimes")]).unwrap_err().to_string();
        assert!(
            e.contains("TMS_PIN") && e.contains("inline or never"),
            "{e}"
        );
        let e = with(&[("TMS_KEEP_STAGING", "sometimes")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("TMS_KEEP_STAGING"), "{e}");
        let e = with(&[("TMS_SAVE_STREAMS", "2")]).unwrap_err().to_string();
        assert!(e.contains("TMS_SAVE_STREAMS"), "{e}");
    }

    #[test]
    fn backend_choice_parses() {
        assert_eq!(BackendChoice::parse("sim").unwrap(), BackendChoice::Sim);
        assert_eq!(BackendChoice::parse("hip").unwrap(), BackendChoice::Hip);
        assert_eq!(BackendChoice::parse("").unwrap(), BackendChoice::Auto);
        let e = BackendChoice::parse("gpu").unwrap_err().to_string();
        assert!(e.contains("auto, cuda, hip or sim"), "{e}");
    }
}
