//! The resume gate (a word devices wait on), [`GateCell`] (a driver's gate, made once), and
//! [`GateWaits`], which keeps the streams waiting on it apart from the calls that wait for a
//! whole device.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{DevPtr, Stream};
use crate::error::{Error, Result};

/// A 32-bit word of page-locked host memory that devices can read: the host raises it, and work
/// a stream was made to queue behind it ([`Driver::stream_wait_gate`]) runs once it reaches the
/// value waited for. Each driver makes one on first use ([`Driver::gate`]) and never frees it: a
/// device may be about to read it at any time.
///
/// [`Driver::stream_wait_gate`]: super::Driver::stream_wait_gate
/// [`Driver::gate`]: super::Driver::gate
#[derive(Clone, Copy, Debug)]
pub struct Gate {
    host: &'static std::sync::atomic::AtomicU32,
    /// The word's device address.
    pub dev: DevPtr,
}

impl Gate {
    /// A gate over `host`, which devices read at `dev`.
    pub fn new(host: &'static std::sync::atomic::AtomicU32, dev: DevPtr) -> Gate {
        Gate { host, dev }
    }

    /// Raise the word to `v`, unless it is there or beyond already (cyclically): it never goes
    /// back, so a late raise by a finished resume cannot hold back streams waiting for a later
    /// one. Release order: whatever this thread saw complete before (the copies a wait covered)
    /// is done before a device can see the new value.
    pub fn raise(&self, v: u32) {
        use std::sync::atomic::Ordering;
        let _ = self
            .host
            .fetch_update(Ordering::Release, Ordering::Acquire, |cur| {
                ((v.wrapping_sub(cur) as i32) > 0).then_some(v)
            });
    }

    /// The word's value.
    pub fn value(&self) -> u32 {
        self.host.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the word has reached `v`, compared as the driver does: cyclically, so that a
    /// counter may wrap (`value - v`, as a signed number, is not negative).
    pub fn reached(&self, v: u32) -> bool {
        (self.value().wrapping_sub(v) as i32) >= 0
    }
}

/// A driver's gate, made on its first use and kept for the process's life, or why it could not
/// be made (asked once: a device without stream waits stays without them).
#[derive(Default)]
pub struct GateCell(OnceLock<std::result::Result<Gate, String>>);

impl GateCell {
    /// The gate, made by `make` on the first call.
    pub fn get_or_make(&self, make: impl FnOnce() -> Result<Gate>) -> Result<Gate> {
        match self.0.get_or_init(|| make().map_err(|e| e.to_string())) {
            Ok(g) => Ok(*g),
            Err(e) => Err(Error::unsupported(format!("no resume gate: {e}"))),
        }
    }

    /// The gate, if it was made.
    pub fn made(&self) -> Option<Gate> {
        self.0.get().and_then(|g| g.as_ref().ok().copied())
    }
}

/// How long a driver of a real device lets a page-lock, unlock or synchronization wait for the
/// streams waiting on the gate, and a stream wait for those calls ([`GateWaits`]).
pub const GATED_WAIT: Duration = Duration::from_secs(120);

/// A stream made to wait for the gate: its device, the stream, the value waited for.
pub type GateWait = (i32, Stream, u32);

#[derive(Default)]
struct WaitState {
    /// Streams made to wait, until the gate reaches their value.
    waits: Vec<GateWait>,
    /// Device-wide calls running now.
    device_wide: usize,
    /// Stream waits being queued now.
    queuing: usize,
}

/// Keeps the streams that wait for the gate apart from the calls that wait for a whole device.
///
/// Page-locking and unlocking host memory and synchronizing a device wait until the device's
/// queued work is done, and meanwhile they hold up other threads' driver calls (seen on an
/// H200: `cuMemHostUnregister` held a lock that the copies queued by another thread waited for).
/// If a stream waits for the gate then, and the gate is raised only once those copies are done,
/// nothing moves again. So a device-wide call starts only once every stream wait has been
/// passed and none is being queued ([`GateWaits::device_wide`]), and a stream wait is queued
/// only while no device-wide call runs ([`GateWaits::stream_wait`]): a check at the start of
/// the call alone would let a resume that returns during a long unlock queue its wait behind it.
/// Both sides wait at most `limit`. A leaf lock, never held across a driver call.
pub struct GateWaits {
    state: Mutex<WaitState>,
    changed: Condvar,
    limit: Duration,
}

/// While alive, no stream is made to wait for the gate ([`GateWaits::device_wide`]).
pub struct DeviceWide<'a>(&'a GateWaits);

impl Drop for DeviceWide<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.device_wide -= 1;
        if s.device_wide == 0 {
            self.0.changed.notify_all();
        }
    }
}

impl GateWaits {
    /// Sides wait for each other at most `limit`.
    pub fn new(limit: Duration) -> Self {
        GateWaits {
            state: Mutex::default(),
            changed: Condvar::new(),
            limit,
        }
    }

    /// The streams still waiting for `gate` (a wait it has reached is forgotten, as a device
    /// moves past it).
    pub fn pending(&self, gate: Option<Gate>) -> Vec<GateWait> {
        let mut s = self.state.lock();
        forget_reached(&mut s, gate);
        s.waits.clone()
    }

    /// Wait, before a call that waits for every device's queued work, until no stream waits
    /// for `gate` and none is being queued; no stream is made to wait while the guard lives.
    /// After `limit`: the streams that still wait.
    pub fn device_wide(
        &self,
        gate: Option<Gate>,
    ) -> std::result::Result<DeviceWide<'_>, Vec<GateWait>> {
        let until = Instant::now() + self.limit;
        let mut s = self.state.lock();
        loop {
            forget_reached(&mut s, gate);
            if s.waits.is_empty() && s.queuing == 0 {
                s.device_wide += 1;
                return Ok(DeviceWide(self));
            }
            if Instant::now() >= until {
                return Err(s.waits.clone());
            }
            // The gate is raised by a plain store, which wakes nobody: look again soon.
            self.changed.wait_for(&mut s, Duration::from_micros(200));
        }
    }

    /// [`GateWaits::device_wide`] for the driver call `call`: after the limit, the call goes
    /// ahead unguarded and says so in the log.
    pub fn device_wide_or_warn(&self, gate: Option<Gate>, call: &str) -> Option<DeviceWide<'_>> {
        match self.device_wide(gate) {
            Ok(g) => Some(g),
            Err(waits) => {
                tracing::warn!(
                    "{call}: {} streams still wait for a resume after {} s; going ahead",
                    waits.len(),
                    self.limit.as_secs()
                );
                None
            }
        }
    }

    /// Make a stream wait for the gate to reach `wait.2` by `queue` (the driver's call), once
    /// no device-wide call runs; recorded until the gate reaches it. Fails (nothing queued)
    /// if device-wide calls keep running for `limit`.
    pub fn stream_wait(&self, wait: GateWait, queue: impl FnOnce() -> Result<()>) -> Result<()> {
        let until = Instant::now() + self.limit;
        {
            let mut s = self.state.lock();
            while s.device_wide > 0 {
                if self.changed.wait_until(&mut s, until).timed_out() && s.device_wide > 0 {
                    return Err(Error::invalid_state(format!(
                        "a stream cannot wait for the resume gate: page-locking, unlocking or \
                         synchronizing has kept the device busy for {} s",
                        self.limit.as_secs_f64()
                    )));
                }
            }
            s.queuing += 1;
        }
        let r = queue();
        let mut s = self.state.lock();
        s.queuing -= 1;
        if r.is_ok() {
            s.waits.push(wait);
        }
        self.changed.notify_all();
        r
    }
}

fn forget_reached(s: &mut WaitState, gate: Option<Gate>) {
    match gate {
        Some(g) => s.waits.retain(|&(_, _, v)| !g.reached(v)),
        None => s.waits.clear(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn a_gate_only_goes_forward_and_compares_cyclically() {
        let word: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
        let g = Gate::new(word, 0);
        g.raise(5);
        g.raise(3); // a late raise of an earlier resume
        assert_eq!(g.value(), 5);
        assert!(g.reached(5) && g.reached(4) && !g.reached(6));
        // Across the wrap: u32::MAX - 1 then 2 (four steps on).
        let word: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(u32::MAX - 1)));
        let g = Gate::new(word, 0);
        g.raise(2);
        assert_eq!(g.value(), 2);
        assert!(g.reached(u32::MAX) && g.reached(2) && !g.reached(3));
        g.raise(u32::MAX);
        assert_eq!(g.value(), 2, "behind it, cyclically");
    }

    fn gate_at(v: u32) -> Gate {
        Gate::new(Box::leak(Box::new(AtomicU32::new(v))), 0)
    }

    #[test]
    fn a_device_wide_call_waits_for_the_streams_waiting_on_the_gate() {
        let w = GateWaits::new(Duration::from_secs(5));
        let g = gate_at(0);
        w.stream_wait((0, Stream(1), 2), || Ok(())).unwrap();
        w.stream_wait((0, Stream(2), 9), || Err(Error::internal("refused")))
            .unwrap_err();
        assert_eq!(
            w.pending(Some(g)),
            vec![(0, Stream(1), 2)],
            "a failed queue is not recorded"
        );
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                let t0 = Instant::now();
                let _d = w.device_wide(Some(g)).unwrap();
                t0.elapsed()
            });
            std::thread::sleep(Duration::from_millis(50));
            g.raise(2);
            assert!(t.join().unwrap() >= Duration::from_millis(40));
        });
        assert!(w.pending(Some(g)).is_empty());
    }

    #[test]
    fn no_stream_is_made_to_wait_while_a_device_wide_call_runs() {
        let w = GateWaits::new(Duration::from_secs(5));
        let g = gate_at(0);
        let queued_at = Mutex::new(None);
        std::thread::scope(|s| {
            let d = w.device_wide(Some(g)).unwrap();
            let t = s.spawn(|| {
                w.stream_wait((0, Stream(1), 1), || {
                    *queued_at.lock() = Some(Instant::now());
                    Ok(())
                })
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                queued_at.lock().is_none(),
                "queued during a device-wide call"
            );
            let released = Instant::now();
            drop(d);
            t.join().unwrap().unwrap();
            assert!(queued_at.lock().unwrap() >= released);
        });
    }

    #[test]
    fn each_side_gives_up_after_the_limit() {
        let w = GateWaits::new(Duration::from_millis(30));
        let g = gate_at(0);
        w.stream_wait((3, Stream(7), 1), || Ok(())).unwrap();
        assert_eq!(w.device_wide(Some(g)).err(), Some(vec![(3, Stream(7), 1)]));
        g.raise(1);
        let d = w.device_wide(Some(g)).unwrap();
        let e = w
            .stream_wait((0, Stream(1), 2), || panic!("queued"))
            .unwrap_err();
        assert!(e.to_string().contains("kept the device busy"), "{e}");
        drop(d);
        w.stream_wait((0, Stream(1), 2), || Ok(())).unwrap();
    }
}
