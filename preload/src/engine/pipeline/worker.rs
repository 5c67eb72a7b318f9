//! The copy pipeline's workers (Note [The copy pipeline] in `pipeline.rs`): each takes units
//! from the queue, waits until they are prepared, and copies them between the device and their
//! backing with its two lanes on the device's stream, straight or through its staging slots.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc};

use parking_lot::Mutex;

use super::shared::{Shared, Timing, Unit};
use crate::backup::{Backing, BackupKind, Dir, HostBuffer, HostLayout, UnitIo};
use crate::driver::{DevPtr, DeviceScope, Driver, Event, Stream};
use crate::error::{Error, Result};

/// Page-locked staging slots of one device, two per worker, kept between operations.
#[derive(Default)]
pub(in crate::engine) struct Ring {
    slots: Vec<Option<HostBuffer>>,
}

impl Ring {
    /// Page-locked bytes held.
    pub(in crate::engine) fn bytes(&self) -> u64 {
        self.slots.iter().flatten().map(HostBuffer::len).sum()
    }

    /// The slots of `workers` workers, two each, made on first need. Each pair sits behind a
    /// lock, so that a worker whose thread could not be had leaves its pair for the
    /// coordinator (see [`super::Pipeline::run`]).
    pub(super) fn lanes(&mut self, workers: usize) -> Vec<Mutex<&mut [Option<HostBuffer>]>> {
        if self.slots.len() < 2 * workers {
            self.slots.resize_with(2 * workers, || None);
        }
        self.slots
            .chunks_mut(2)
            .take(workers)
            .map(Mutex::new)
            .collect()
    }
}

/// A worker's two lanes on the device's stream: an event each (to wait for the lane's own copy
/// only), a staging slot each (made on first need), and what each lane has queued and not yet
/// waited for.
struct Lanes<'s> {
    stream: Stream,
    events: [Event; 2],
    slots: &'s mut [Option<HostBuffer>],
    queued: [Option<(u64, u64)>; 2],
}

impl Lanes<'_> {
    /// Queue the copy `f` on the stream for lane `l`, and mark it with the lane's event.
    fn issue(&self, sh: &Shared<'_>, l: usize, f: impl FnOnce(Stream) -> Result<()>) -> Result<()> {
        Timing::add(&sh.timing.issue_ns, || {
            f(self.stream)?;
            sh.timing.issued();
            sh.d().event_record(self.events[l], self.stream)
        })
    }

    /// Lane `l`'s staging slot (made by [`staged`] before any use).
    fn slot(&mut self, l: usize) -> Result<&mut HostBuffer> {
        self.slots[l]
            .as_mut()
            .ok_or_else(|| Error::internal("a staging slot used before it was made"))
    }
}

/// A worker: copies units until there are none left or the work stops. A panic inside it (a
/// bug) fails the operation like an error: its unit is not counted as copied.
pub(super) fn worker(sh: &Shared<'_>, slots: &mut [Option<HostBuffer>], done: mpsc::Sender<usize>) {
    let res = catch_unwind(AssertUnwindSafe(|| worker_inner(sh, slots, done)));
    if let Err(p) = res {
        sh.fail(Error::internal(format!(
            "a copy worker panicked (a bug): {}",
            crate::error::panic_message(&*p)
        )));
    }
}

fn worker_inner(sh: &Shared<'_>, slots: &mut [Option<HostBuffer>], done: mpsc::Sender<usize>) {
    // The first unit before anything is set up: a worker that starts after the others took all
    // the work must not fail, by a failure of its own set-up, an operation whose copies all
    // completed (a non-blocking resume has told its caller by then that the data landed).
    if sh.ready.stopped() {
        return;
    }
    let Some(first) = sh.queue.take() else {
        return;
    };
    let res = (|| -> Result<()> {
        let _scope = DeviceScope::enter(sh.d(), sh.device)?;
        let stream = match sh.d().thread_stream() {
            Some(own) if sh.dir == Dir::Save && sh.cfg.save_streams => own,
            _ => sh.d().stream(sh.device)?,
        };
        let e0 = sh.d().event_create(sh.device)?;
        let e1 = match sh.d().event_create(sh.device) {
            Ok(e) => e,
            Err(e) => {
                sh.d().event_destroy(e0);
                return Err(e);
            }
        };
        let mut lanes = Lanes {
            stream,
            events: [e0, e1],
            slots,
            queued: [None, None],
        };
        let res = work(sh, &mut lanes, &done, first);
        if res.is_err() {
            // Let nothing queued outlive the call: a late DMA must not land in a buffer that
            // is about to be reused or freed. A failed wait leaves the work queued, so it is
            // tried again; if no wait succeeds, the staging slots are never used (nor freed)
            // again, since a copy into them may still run.
            if !crate::driver::settle(sh.d(), sh.device, stream) {
                for s in lanes.slots.iter_mut() {
                    std::mem::forget(s.take());
                }
            }
        }
        for e in lanes.events {
            sh.d().event_destroy(e);
        }
        res
    })();
    if let Err(e) = res {
        sh.fail(e);
    }
}

fn work(
    sh: &Shared<'_>,
    lanes: &mut Lanes<'_>,
    done: &mpsc::Sender<usize>,
    first: Unit,
) -> Result<()> {
    let mut next = Some(first);
    while !sh.ready.stopped() {
        let Some(u) = next.take().or_else(|| sh.queue.take()) else {
            break;
        };
        let it = &sh.queue.items[u.item];
        let Some(target) = it.target else {
            break; // units are made for items with a target only
        };
        if !sh.ready.wait(u.item, u.off + u.len) {
            break;
        }
        sh.timing.copying(sh.dir, target.kind());
        copy_unit(sh, it.dev, target, u, lanes).map_err(|e| {
            e.context(format!(
                "{} chunk {} of {} bytes at {:#x} (device {})",
                match sh.dir {
                    Dir::Save => "saving",
                    Dir::Restore => "restoring",
                },
                u.chunk,
                target.len(),
                it.dev,
                sh.device
            ))
        })?;
        if sh.queue.copied(u.item) {
            // The coordinator may have stopped listening after a failure; nothing to do then.
            let _ = done.send(u.item);
        }
    }
    Ok(())
}

/// Copy unit `u` between the allocation at `dev` and its backing: straight if the backing
/// offers the unit's host memory page-locked, else through the worker's staging slots.
fn copy_unit(
    sh: &Shared<'_>,
    dev: DevPtr,
    target: &dyn Backing,
    u: Unit,
    lanes: &mut Lanes<'_>,
) -> Result<()> {
    let d = sh.d();
    let dev = dev + u.off;
    let pin_now = sh.pin_inline;
    if let Some(host) = target.direct(u.chunk, u.off, pin_now)? {
        // SAFETY: dev..dev+len lies in the allocation being copied, mapped and accessible for
        // the whole operation; host..host+len is this worker's unit of a live, page-locked
        // buffer that nothing else touches until the operation ends (a page-locked chunk stays
        // so until the buffer is released, which the engine's transactions exclude). The stream
        // is waited for below (or, on error, by the worker before it returns).
        lanes.issue(sh, 0, |s| unsafe {
            match sh.dir {
                Dir::Save => d.copy_d2h(host, dev, u.len, s),
                Dir::Restore => d.copy_h2d(dev, host, u.len, s),
            }
        })?;
        Timing::add(&sh.timing.wait_ns, || d.event_sync(lanes.events[0]))?;
        sh.timing.moved(u.len);
        return Ok(());
    }
    let piece = match sh.dir {
        Dir::Save if target.fresh(u.chunk) => sh.cfg.save_slot,
        _ => sh.cfg.slot,
    };
    // SAFETY: the queue hands each unit out once, to this worker, and units do not overlap; the
    // engine's transaction keeps every other user off the backup until the pipeline ends.
    unsafe {
        target.staged(sh.dir, u.chunk, u.off, u.len, &mut |io| {
            staged(sh, io, dev, u.len, piece, lanes)
        })
    }
}

/// Make a worker's staging slots (page-locked, of the configured size) where they are missing.
pub(super) fn make_slots(sh: &Shared<'_>, slots: &mut [Option<HostBuffer>]) -> Result<()> {
    let slot_len = sh.cfg.slot;
    for slot in slots.iter_mut() {
        if slot.as_ref().is_none_or(|s| s.len() != slot_len) {
            *slot = None;
            *slot = Some(new_slot(sh.driver, sh.device, slot_len, sh.cfg.layout)?);
        }
    }
    Ok(())
}

/// One staging slot of `len` bytes for `device`: host memory in `layout`'s pages, one chunk,
/// populated and then page-locked.
pub(in crate::engine) fn new_slot(
    driver: &Arc<dyn Driver>,
    device: i32,
    len: u64,
    layout: HostLayout,
) -> Result<HostBuffer> {
    let s = HostBuffer::new(
        driver.clone(),
        device,
        BackupKind::Pinned,
        len,
        HostLayout {
            chunk: len,
            ..layout
        },
    )?;
    s.pin_all_populated()?;
    Ok(s)
}

/// Copy `len` bytes between `dev` and the backing's side of a unit (`io`) through the worker's
/// two staging slots, `piece` bytes (at most a slot) at a time, alternating lanes so that a DMA
/// and a CPU copy overlap.
fn staged(
    sh: &Shared<'_>,
    io: &mut dyn UnitIo,
    dev: DevPtr,
    len: u64,
    piece: u64,
    lanes: &mut Lanes<'_>,
) -> Result<()> {
    let d = sh.d();
    let slot_len = piece.min(sh.cfg.slot);
    Timing::add(&sh.timing.slots_ns, || make_slots(sh, lanes.slots))?;
    let mut off = 0;
    let mut l = 0;
    while off < len {
        let n = slot_len.min(len - off);
        drain_lane(sh, lanes, l, io)?;
        // Idle: drain_lane waited for its lane.
        let slot = lanes.slot(l)?;
        if sh.dir == Dir::Restore {
            Timing::add(&sh.timing.host_ns, || {
                io.load(off, &mut slot.as_mut_slice()[..n as usize])
            })?;
        }
        let slot = slot.base();
        // SAFETY: the slot is this worker's page-locked buffer of slot_len >= n bytes, idle; the
        // device range is mapped for the whole operation. The lane is waited for before the
        // slot is touched again.
        lanes.issue(sh, l, |s| unsafe {
            match sh.dir {
                Dir::Save => d.copy_d2h(slot, dev + off, n, s),
                Dir::Restore => d.copy_h2d(dev + off, slot, n, s),
            }
        })?;
        lanes.queued[l] = Some((off, n));
        off += n;
        l ^= 1;
    }
    // The older lane first, then the newer.
    drain_lane(sh, lanes, l, io)?;
    drain_lane(sh, lanes, l ^ 1, io)
}

/// Wait for lane `l`'s queued copy, and when saving, hand it from the slot to the backing.
fn drain_lane(sh: &Shared<'_>, lanes: &mut Lanes<'_>, l: usize, io: &mut dyn UnitIo) -> Result<()> {
    let Some((off, n)) = lanes.queued[l].take() else {
        return Ok(());
    };
    Timing::add(&sh.timing.wait_ns, || sh.d().event_sync(lanes.events[l]))?;
    if sh.dir == Dir::Save {
        // The DMA into the slot is complete: the lane was just synchronized.
        let slot = lanes.slot(l)?;
        Timing::add(&sh.timing.host_ns, || {
            io.store(off, &slot.as_slice()[..n as usize])
        })?;
    }
    sh.timing.moved(n);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::config::CopyConfig;
    use super::super::ready::Ready;
    use super::super::shared::{Queue, Shared, Timing};
    use super::*;
    use crate::driver::sim::{Prim, SimConfig, SimDriver};
    use crate::driver::Driver;
    use crate::engine::progress::Counters;

    /// A worker that finds no unit left sets nothing up: one that started after the others had
    /// taken all the work must not fail, by a failure of its own set-up (here: its first
    /// event), an operation whose copies all completed. (Seen in the non-blocking resume's
    /// fault sweep: the wait said the data had landed, then the resume failed and left the
    /// allocations paused.)
    #[test]
    fn a_worker_that_finds_no_work_sets_nothing_up() {
        let sim = Arc::new(
            SimDriver::new(SimConfig {
                devices: 1,
                capacity: 64 << 20,
                granularity: 2 << 20,
            })
            .unwrap(),
        );
        let driver: Arc<dyn Driver> = sim.clone();
        let cfg = CopyConfig::default();
        let counters = Counters::new();
        for dir in [Dir::Save, Dir::Restore] {
            let sh = Shared {
                driver: &driver,
                device: 0,
                dir,
                cfg: &cfg,
                queue: Queue::new(&[]),
                ready: Ready::new(),
                timing: Timing::new(&counters),
                error: Mutex::new(None),
                pin_inline: false,
            };
            let (tx, rx) = mpsc::channel();
            let mut slots = [None, None];
            sim.arm_fault(Prim::EventCreate, 1, 999);
            worker(&sh, &mut slots, tx);
            assert!(sh.error.lock().is_none(), "{dir:?}: {:?}", sh.error.lock());
            assert_eq!(sim.calls(Prim::EventCreate), 0, "{dir:?}");
            assert_eq!(sim.pending_faults(), 1, "{dir:?}: the fault stays armed");
            assert!(
                slots.iter().all(Option::is_none),
                "{dir:?}: no staging slot made"
            );
            assert!(rx.try_recv().is_err(), "{dir:?}: nothing reported done");
            sim.clear_faults();
        }
    }
}
