//! The non-blocking resume: the call maps the memory, queues the restores and returns; the
//! copies finish on a thread of their own.
//!
//! # Note [Non-blocking resume]
//!
//! [`Engine::resume_nonblocking`] runs an ordinary resume transaction (`resume.rs`) on a
//! background thread and waits only until every allocation is mapped (the pipeline maps item
//! i+1 while item i is copied, so the first copies are already running by then). The caller
//! then returns, and the program's host work overlaps the copies. Three things make that safe:
//!
//! - **Stream order.** A *gate* (`driver::Gate`, a word of device-mapped host memory) counts
//!   the restored allocations: a resume of N allocations that starts with the gate at `base`
//!   raises it to `base + k` once its first k allocations (in its order) are all restored, the
//!   copies' completion having been waited for first. The caller's stream is made to wait for
//!   `base + N` (`cuStreamWaitValue32`, a cyclic comparison, so the counter may wrap), so work
//!   it then queues runs after the restore; [`Engine::stream_wait_restored`] makes a stream wait
//!   for one allocation (`base + k + 1`), and [`Engine::wait_restored`] blocks the host until
//!   one (or all) landed. The caller may give an order (tensors first needed first): the
//!   allocations are mapped and copied in it. Resumes run one at a time (the operations lock),
//!   and each raises the gate to its `base + N` before it lets go of that lock (its transaction
//!   does: the gate given to `Txn::begin`), even when it fails, so the next one's `base` is
//!   right and no stream ever waits forever.
//! - **Nothing faults.** Memory is mapped before the call returns. A failure before then is the
//!   call's error, exactly as for a blocking resume (everything stays paused with its backups).
//!   A copy that fails after the call returned cannot be undone by unmapping: the caller's
//!   kernels may be queued behind the gate. So the mappings stay (their handles released, the
//!   segments recorded *stuck*), the allocations not yet restored stay Paused with their
//!   backups intact (those that landed, which a wait has said so of, are committed), the
//!   gate opens, and the error is kept with the allocations it left unrestored (`Restores`):
//!   a wait for any of them raises it, every time, until each is paused (which unmaps and gives
//!   back its memory), resumed (which restores it) or freed; the first of those to act on them
//!   raises it too if no wait did. One that fails after every allocation landed (a panic while
//!   giving back host memory, say) left nothing unrestored: the next wait for everything raises
//!   it, once, and nothing else. Other allocations and tags are not concerned: their pauses,
//!   resumes and waits run as ever. `stats` shows the unrestored bytes and the error per tag.
//!   Nothing backed up is lost. A panic after the return (a bug) leaves what it mapped mapped
//!   and stuck too (`KeepIfReturned` in `resume.rs`), for the free to unmap after the device's
//!   work (the engine refuses pauses and resumes after a panic); one before it undoes the
//!   mappings and is the call's error, though other devices finish mapping their shares.
//! - **True at every instant.** From the moment the caller may return, the registry shows what
//!   is true (`Allocation::arriving`): each allocation's segments mapped with contents on their
//!   way, then landed (Active) as soon as its last copy completed, before a wait for it returns;
//!   the transaction settles it later.
//! - **Nothing waits for itself.** Page-locking and unlocking host memory and synchronizing
//!   the device wait for the device's work, which now includes the caller's stream waiting for
//!   the gate, and while they wait they hold up other threads' driver calls, the restore's
//!   copies among them: a deadlock (seen on an H200 with two threads resuming: one resume's
//!   backups unlocked while the other restored and its caller's stream waited). So the drivers
//!   do those three only once no stream waits for the gate, waiting first without any call in
//!   progress, and queue no stream wait while one of them runs (`driver::GateWaits`); and a
//!   restore whose caller may have returned calls none of them itself: its
//!   pipeline makes every staging slot before the first item is mapped and pins nothing
//!   inline (`Pipeline::lock_pages_first`), and releases come after the gate is open. The gate
//!   only goes forward (`Gate::raise`), so a resume finishing late never lowers it under
//!   streams that wait for a later one. The simulated device fails such a wait that lasts
//!   (its caller would be the one to raise the gate), so tests see that kind of bug.
//! - **No hang.** The thread opens the gate and records the outcome when it ends in any way (a
//!   guard, and a caught panic); a caller waiting for the mapping wakes then too. Where the
//!   driver has no gate (no stream memory operations) or no thread can be started, the resume
//!   simply blocks, and the call returns once the data has landed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::base::Engine;
use super::progress::Which;
use super::registry::{describe, Pick};
use super::report::OpReport;
use super::restoring::{with_earlier, StreamOf, Tracker};
use super::txn::check_tag;
use crate::driver::DevPtr;
use crate::error::{Changed, Error, Result};

impl Engine {
    /// Resume `tag` (every tag if `None`) without waiting for the data (Note [Non-blocking
    /// resume]): returns once every allocation is mapped, with the restores running. Work then
    /// queued on `stream` (if given) runs after them; `order` (addresses inside allocations of
    /// the tag) names what to restore first. The report's `pending` is what was still to be
    /// copied at return. Where no gate or no thread can be had, this is a blocking resume.
    pub fn resume_nonblocking<E>(
        engine: E,
        tag: Option<&str>,
        order: &[DevPtr],
        stream: Option<StreamOf>,
    ) -> Result<OpReport>
    where
        E: std::ops::Deref<Target = Engine> + Clone + Send + 'static,
    {
        Self::resume_nonblocking_labeled(engine, tag, order, stream, None)
    }

    /// [`Engine::resume_nonblocking`], its progress labelled `label` (an operation asked for
    /// over the control socket: Note [Progress] in `progress.rs`).
    pub fn resume_nonblocking_labeled<E>(
        engine: E,
        tag: Option<&str>,
        order: &[DevPtr],
        stream: Option<StreamOf>,
        label: Option<u64>,
    ) -> Result<OpReport>
    where
        E: std::ops::Deref<Target = Engine> + Clone + Send + 'static,
    {
        check_tag(tag).map_err(Error::unchanged)?;
        let e: &Engine = &engine;
        if let Some(s) = &stream {
            // Not left to the driver, whose refusal reads as "streams cannot wait" (blocking).
            e.check_device(s.device).map_err(Error::unchanged)?;
        }
        // NCCL's communicators (their tag, or every tag with the setting on) are resumed
        // before this returns: the program may use them as soon as it does.
        let pick = labeled(tag, label);
        e.with_comms_of(Which::Resume, &pick, || {
            let t0 = Instant::now();
            let pick = |tag| labeled(tag, label);
            let what = format!("resume of {}", describe(tag));
            let gate = match e.driver.gate() {
                Ok(g) => g,
                Err(err) => {
                    tracing::warn!("{what}: blocking instead of non-blocking: {err}");
                    return e.resume_ordered(&pick(tag), order, None);
                }
            };
            let tracker = Arc::new(Tracker::new(gate, what.clone()));
            e.restores.track(tracker.clone());
            let (t, owned_tag, owned_order) =
                (tracker.clone(), tag.map(str::to_owned), order.to_vec());
            let eng = engine.clone();
            let run = move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    eng.resume_ordered(
                        &labeled(owned_tag.as_deref(), label),
                        &owned_order,
                        Some(&t),
                    )
                }));
                let r = match r {
                    Ok(r) => r.map(|_| ()),
                    Err(p) => {
                        let err = Error::internal(format!(
                            "{}: a panic (a bug): {}",
                            t.what(),
                            crate::error::panic_message(&*p)
                        ));
                        if t.returned() {
                            // Its data did not land: kept with what it left unrestored, as a
                            // failure after the return is, for every wait to raise (the tracker
                            // is forgotten once finished).
                            // (The tracker's lock before the registry's: Note [Locks].)
                            let left = t.unlanded();
                            {
                                let _reg = eng.registry.lock();
                                eng.restores.keep_failure(&err, left.into_iter());
                            }
                            t.failure_kept();
                        }
                        Err(err)
                    }
                };
                if let Err(err) = &r {
                    // A failure after the return was kept for the next call (resume.rs).
                    tracing::error!("{}: {err}", t.what());
                }
                t.finish(r);
                eng.restores.forget_finished();
            };
            if !crate::threads::spawn("tms-resume", run) {
                e.restores.untrack(&tracker);
                tracing::warn!("{what}: no thread for it; resuming before returning");
                return e.resume_ordered(&pick(tag), order, None);
            }
            if let Err(err) = tracker.wait_mapped() {
                // Failed before returning: an earlier failure it took to report goes with it.
                return Err(with_earlier(err, tracker.take_earlier()));
            }
            let earlier = tracker.take_earlier();
            let (n, bytes, mut pending, end) = tracker.summary();
            if let Some(st) = stream.filter(|_| n > 0) {
                if let Err(err) = e.driver.stream_wait_gate(st.device, st.stream, gate, end) {
                    // The program's work must not overtake the restore: wait for it here instead.
                    tracing::warn!("{what}: the stream cannot wait for it ({err}); waiting here");
                    if let Err(err) = tracker.wait_all_own() {
                        // Raised here: reported, as a wait would have.
                        let _ = e.restores.unreported(tracker.ptrs().into_iter());
                        return Err(with_earlier(err, earlier));
                    }
                    pending = 0;
                }
            }
            tracing::info!(
                "{what}: mapped {n} allocations in {:.3}s, {} still being restored",
                t0.elapsed().as_secs_f64(),
                crate::units::human(pending)
            );
            let report = OpReport {
                allocations: n,
                bytes,
                pending,
                seconds: t0.elapsed().as_secs_f64(),
                ..OpReport::default()
            };
            match earlier {
                // The restore goes on: the call raises what an earlier one left unreported, and
                // says what this one changed (everything it maps).
                Some(err) => Err(err
                    .context(format!(
                        "reported by this {what}, which is restoring them (wait() tells when they \
                         landed)"
                    ))
                    .with_changed(Changed {
                        allocations: n,
                        bytes,
                        communicators: 0,
                    })),
                None => Ok(report),
            }
        })
    }

    /// Block until what non-blocking resumes are restoring into the allocation holding `ptr`
    /// (every allocation, if `None`) has landed, for at most `timeout`. `Ok(false)` if it timed
    /// out. A resume that failed after it returned leaves its allocations unrestored: a wait
    /// for any of them is its error, every time, until they are paused, resumed or freed; one
    /// that times out too, unless a resume in flight is restoring them again. One that failed
    /// after everything it restored landed left nothing unrestored: the next wait for every
    /// allocation raises its error, once.
    pub fn wait_restored(&self, ptr: Option<DevPtr>, timeout: Option<Duration>) -> Result<bool> {
        let until = timeout.map(|t| Instant::now() + t);
        for t in self.restores.trackers() {
            match t.wait(ptr, until) {
                Ok(true) => {}
                // A failure no wait can end is the answer, not "not yet": a caller polling
                // with a timeout would otherwise learn it only once every resume had ended.
                Ok(false) => {
                    return match self.restores.failure_at_after_timeout(ptr) {
                        Some(e) => Err(e),
                        None => Ok(false),
                    }
                }
                Err(e) => {
                    // Those kept are raised with it, as a wait raises each (one whose data all
                    // landed is raised only once: it must not go unsaid).
                    return Err(match self.restores.failure_at(ptr) {
                        Some(kept) => e.note(format!("and: {kept}")),
                        None => e,
                    });
                }
            }
        }
        match self.restores.failure_at(ptr) {
            Some(e) => Err(e),
            None => Ok(true),
        }
    }

    /// Make `on`'s stream wait, without blocking the host, until the allocation holding `ptr`
    /// (every allocation, if `None`) is restored by the non-blocking resumes in flight. Nothing
    /// to wait for: nothing is queued. Where the stream cannot wait, the host waits instead.
    /// The gate is host memory every device reads: `on` may be of any device, whatever device
    /// the allocations are on (work there may read them); one that does not exist is an error.
    pub fn stream_wait_restored(&self, ptr: Option<DevPtr>, on: StreamOf) -> Result<()> {
        // Not left to the driver, whose refusal reads as "cannot wait" (the host would block).
        self.check_device(on.device)?;
        for t in self.restores.trackers() {
            if let Some(v) = t.target(ptr) {
                if let Err(err) = self
                    .driver
                    .stream_wait_gate(on.device, on.stream, t.gate, v)
                {
                    tracing::warn!("{}: the stream cannot wait ({err}); waiting here", t.what());
                    t.wait(ptr, None)?;
                }
            }
        }
        match self.restores.failure_at(ptr) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Wait until the host memory that resumes are giving back after they returned is gone
    /// (Note [Releases] in `background.rs`); how long that took (zero if nothing was being given back).
    pub fn wait_released(&self) -> Duration {
        self.ops.wait_released()
    }

    /// Whether a non-blocking resume that returned is still restoring data.
    pub fn restoring(&self) -> bool {
        self.restores.restoring()
    }
}

/// Every allocation of `tag` (all if `None`), the progress labelled `label`.
fn labeled(tag: Option<&str>, label: Option<u64>) -> Pick<'_> {
    Pick {
        label,
        ..Pick::tag(tag)
    }
}
