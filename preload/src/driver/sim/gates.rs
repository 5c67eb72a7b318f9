//! What a simulated call waits for before it acts: holds (a test stalls a primitive until it lets
//! go), a delay added to every device synchronization, and the host-device link's bandwidth.
//! Each has a lock of its own, apart from the driver's state, so that a waiting call blocks no
//! other; the simulated time is slept with no lock held.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::faults::Prim;
use super::SimDriver;

#[derive(Default)]
struct Holds {
    held: HashSet<(Prim, Option<i32>)>,
    waiting: usize,
}

/// The gates of one simulated driver.
pub(super) struct Gates {
    /// Primitives whose calls wait (see [`SimDriver::hold`]).
    holds: Mutex<Holds>,
    holds_changed: Condvar,
    /// Added to every device synchronization: a device that takes its time (a long pause seen
    /// from another process, such as tmsctl's).
    sync_delay: Mutex<Option<Duration>>,
    /// The link's bytes per second (`None`: as fast as the host copies), and when it is free
    /// again: copies share it, so several workers do not add up to more (see
    /// [`SimDriver::set_bandwidth`]).
    link: Mutex<(Option<u64>, Instant)>,
}

/// The calls that wait while held, before they take the driver's lock.
pub const HOLDABLE: [Prim; 7] = [
    Prim::Create,
    Prim::Synchronize,
    Prim::EventSync,
    Prim::CopyD2H,
    Prim::CopyH2D,
    Prim::HostRegister,
    Prim::HostUnregister,
];

impl Gates {
    pub(super) fn new() -> Self {
        Gates {
            holds: Mutex::default(),
            holds_changed: Condvar::new(),
            sync_delay: Mutex::new(None),
            link: Mutex::new((None, Instant::now())),
        }
    }

    /// Wait while calls of `prim` (on `device`, or on every device) are held.
    pub(super) fn wait_if_held(&self, prim: Prim, device: Option<i32>) {
        let mut h = self.holds.lock();
        let held = |h: &Holds| {
            h.held.contains(&(prim, None))
                || device.is_some_and(|d| h.held.contains(&(prim, Some(d))))
        };
        if !held(&h) {
            return;
        }
        h.waiting += 1;
        while held(&h) {
            self.holds_changed.wait(&mut h);
        }
        h.waiting -= 1;
    }

    /// Sleep the synchronization delay, if one is set.
    pub(super) fn sync_delay(&self) {
        let delay = *self.sync_delay.lock();
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
    }

    /// Wait for `len` bytes' turn on the link, if it has a bandwidth.
    pub(super) fn use_link(&self, len: u64) {
        let until = {
            let mut link = self.link.lock();
            let Some(bw) = link.0 else {
                return;
            };
            let start = link.1.max(Instant::now());
            let until = start + Duration::from_secs_f64(len as f64 / bw as f64);
            link.1 = until;
            until
        };
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
}

impl SimDriver {
    /// Make every call of `prim` (on `device`, or on any device if `None`) wait, before it
    /// does anything, until [`SimDriver::unhold`] of it: a device stalled at a chosen point (say,
    /// on work that waits for a host thread).
    ///
    /// # Panics
    /// For a `prim` whose calls do not look at holds ([`HOLDABLE`] lists those that do): a
    /// test holding one would otherwise race where it means to stall the device.
    pub fn hold(&self, prim: Prim, device: Option<i32>) {
        assert!(
            HOLDABLE.contains(&prim),
            "the sim does not hold {prim:?}: it holds {HOLDABLE:?}"
        );
        self.gates.holds.lock().held.insert((prim, device));
    }

    /// Let the calls held by [`SimDriver::hold`] of the same arguments go on.
    pub fn unhold(&self, prim: Prim, device: Option<i32>) {
        self.gates.holds.lock().held.remove(&(prim, device));
        self.gates.holds_changed.notify_all();
    }

    /// Calls waiting in [`SimDriver::hold`] now.
    pub fn held_calls(&self) -> usize {
        self.gates.holds.lock().waiting
    }

    /// Make every device synchronization take at least `delay` longer (`None`: no delay).
    pub fn set_sync_delay(&self, delay: Option<Duration>) {
        *self.gates.sync_delay.lock() = delay;
    }

    /// Make copies between host and device take time, as over a link of `bytes_per_s` (`None`:
    /// as fast as the host copies): a pause or resume long enough to be watched. Copies share
    /// the link, each one queued after those already on it; the time is spent when the copy is
    /// issued, outside every lock of the driver, so other calls go on meanwhile.
    pub fn set_bandwidth(&self, bytes_per_s: Option<u64>) {
        *self.gates.link.lock() = (bytes_per_s.filter(|b| *b > 0), Instant::now());
    }
}
