//! The engine object: its fields (each lock is in Note [Locks] in `mod.rs`), construction and
//! teardown. Its operations live in the files named after them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::pinner::Pinner;
use super::pipeline::{CopyConfig, Ring};
use super::progress;
use super::registry::Registry;
use super::segment::SEGMENT_BYTES;
use crate::backup::HostBuffer;
use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};

/// Pauses and resumes, one at a time; and what they keep between calls.
#[derive(Default)]
pub(super) struct Ops {
    /// Each device's staging slots.
    pub(super) rings: BTreeMap<i32, Ring>,
}

/// The registry of pauseable allocations over one driver. Thread-safe.
pub struct Engine {
    pub(super) driver: Arc<dyn Driver>,
    pub(super) reg: Mutex<Registry>,
    /// Notified whenever an allocation leaves a transition (see [`Engine::free`]).
    pub(super) settled: Condvar,
    pub(super) ops: Mutex<Ops>,
    pub(super) retain: AtomicBool,
    pub(super) margin: AtomicU64,
    pub(super) segment: AtomicU64,
    pub(super) copy: Mutex<CopyConfig>,
    pub(super) pinner: Arc<Pinner>,
    /// Every tag an allocation ever had (never cleared), for [`Engine::tag_known`]. A lock of
    /// its own, and a leaf (nothing is taken while it is held), so asking never waits for a
    /// pause.
    pub(super) tags_seen: Mutex<HashSet<Box<str>>>,
    /// Directory of new disk backup files (`None`: `disk_default`).
    pub(super) disk_dir: Mutex<Option<Arc<crate::backup::disk::BackupDir>>>,
    /// The default one (`TMS_DISK_BACKUP_DIR`; `None`: the system's temporary directory, resolved
    /// and kept here on first use).
    pub(super) disk_default: Mutex<Option<Arc<crate::backup::disk::BackupDir>>>,
    /// Backups handed out by [`Engine::acquire_cpu_backup`], by lease number.
    pub(super) leases: Mutex<HashMap<u64, Arc<HostBuffer>>>,
    pub(super) next_lease: AtomicU64,
    /// The running pause or resume, for those who watch it ([`Engine::progress`]).
    pub(super) progress: progress::Tracker,
    /// Set when a panic (a bug) unwound through a pause or resume: the registry may then no
    /// longer describe the device truly, so pause, resume and new pauseable allocations refuse
    /// with this message instead of acting on it.
    pub(super) broken: Mutex<Option<String>>,
    /// The one device allocations were asked on so far ([`NO_DEVICE`] before the first,
    /// [`SEVERAL_DEVICES`] once a second shows up): what log lines name, read without a lock
    /// since a line may be written with any of the engine's held.
    pub(super) device: AtomicI32,
    /// Non-blocking resumes not known to be finished (Note [Non-blocking resume]); a leaf lock.
    pub(super) inflight: Mutex<Vec<Arc<super::restoring::Tracker>>>,
    /// Non-blocking resumes that failed after they returned, with the allocations they left
    /// unrestored (Note [Non-blocking resume]); a leaf lock.
    pub(super) failed: Mutex<Vec<super::restoring::FailedRestore>>,
    /// Host memory being given back after resumes returned (`releases.rs`).
    pub(super) releases: Arc<super::releases::Releases>,
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
            reg: Mutex::new(Registry::default()),
            settled: Condvar::new(),
            ops: Mutex::default(),
            retain: AtomicBool::new(false),
            margin: AtomicU64::new(0),
            segment: AtomicU64::new(SEGMENT_BYTES),
            copy: Mutex::new(CopyConfig::default()),
            pinner: Arc::default(),
            tags_seen: Mutex::default(),
            disk_dir: Mutex::default(),
            disk_default: Mutex::default(),
            leases: Mutex::default(),
            next_lease: AtomicU64::new(1),
            progress: progress::Tracker::default(),
            broken: Mutex::new(None),
            device: AtomicI32::new(NO_DEVICE),
            inflight: Mutex::default(),
            failed: Mutex::default(),
            releases: Arc::default(),
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

    /// Refuse to act after a panic unwound through a pause or resume.
    pub(super) fn check_sound(&self) -> Result<()> {
        match &*self.broken.lock() {
            Some(m) => Err(Error::invalid_state(m.clone())),
            None => Ok(()),
        }
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The staging slots go with the last allocation that could need them.
    pub(super) fn drop_unused_rings(&self, rings: &mut BTreeMap<i32, Ring>) {
        if self.reg.lock().backed == 0 {
            rings.clear();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // What resumes are still giving back goes with the engine too (`releases.rs`).
        self.releases.wait();
        let addrs: Vec<DevPtr> = self.reg.lock().allocs.keys().copied().collect();
        for p in addrs {
            if let Err(e) = self.free(p) {
                tracing::error!("engine teardown: {e}");
            }
        }
    }
}
