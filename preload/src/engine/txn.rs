//! The transaction: what every pause and resume holds from start to end and lets go of in one
//! documented order ([`Txn`]), and what they share ([`Ops`]).
//!
//! # Note [Transactions]
//!
//! A pause or resume is one [`Txn`], made by [`Txn::begin`] and ended by [`Txn::end`], which
//! consumes it and returns the operation's report; an error or an unwind drops it instead.
//! Either way nothing it holds is let go of by hand elsewhere, and it lets go in this order (its
//! fields' order: Rust drops a struct's fields in declaration order; `end` follows it):
//!
//! 0. `unwind`: if a panic is unwinding through the operation, the engine is marked broken
//!    first, before the operations lock is let go, so that a transaction waiting for the lock
//!    is refused (it looks again once it has the lock) instead of acting on a record a bug may
//!    have left wrong.
//! 1. `settle`: the allocations it marked (Pausing, Resuming) that are still in transition go
//!    back to the state their handles describe, and a `free` waiting for one is woken. First,
//!    while the operations lock is still held, so that no later transaction ever finds an
//!    earlier one's allocations in transition. With it, `gate`: a non-blocking resume's gate
//!    opens (Note [Non-blocking resume] in `inflight.rs`), so that the next resume's base is
//!    right and no stream waits for it forever.
//! 2. `slots`: the operations lock, and with it the staging slots. What `end` takes of them (a
//!    resume's, without retention or `keep_staging`) goes to its caller's closure after the lock is
//!    let go, with the host memory a resume gives back: that takes long and needs no lock (it is
//!    counted pending first, so the transaction that takes the lock next waits for it). With the
//!    lock let go, `recheck`: the slots go if no allocation with a backup is left. A `free` of the
//!    last one only tries the lock, so while a transaction holds it that free cannot drop them; the
//!    transaction looks once it let go (`Ops::drop_unused_slots`), which a look while still holding
//!    it would miss for a free that came after the look.
//! 3. `end` ([`Ending`]): the progress record (watchers see the operation to its very end, its
//!    release phase included), then the pinner's quiet state, then, last, a second unwind guard,
//!    for a panic raised by one of the drops above.
//!
//! Its prologue, [`Txn::begin`], refuses what cannot start (an empty tag, a broken engine),
//! holds the background pinner quiet (`background.rs`), takes the operations lock (waiting for
//! the transaction running, then refusing if that one broke the engine), waits for the host
//! memory earlier resumes are giving back (`background.rs`: with the lock held, so that the
//! release of a resume it waited for is among them) and starts the progress record
//! (`progress.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::background::{Pinner, Quiet, Releases};
use super::pipeline::{CopyConfig, PinMode, Ring};
use super::progress::{self, Counters, Progress, Start, Tracked, Which};
use super::registry::{describe, Allocation, Index, Pick, Registry};
use super::report::{OpReport, Tally};
use super::restoring::{OpenOnDrop, Tracker};
use crate::backup::{BackupKind, HostBuffer};
use crate::driver::DevPtr;
use crate::error::{Changed, Error, Result};

/// Refuse `Some("")`: no tag (`None`) is how every tag is named.
pub(super) fn check_tag(tag: Option<&str>) -> Result<()> {
    if tag == Some("") {
        return Err(Error::invalid_argument(
            "tag must not be empty (no tag means every tag)",
        ));
    }
    Ok(())
}

/// Each device's staging slots.
pub(super) type Rings = BTreeMap<i32, Ring>;

/// What pauses and resumes share, and take one at a time: the operations lock (which holds each
/// device's staging slots), the running one's progress, the background work they wait for or
/// hold back, and whether a panic unwound through one (Note [Locks] in `mod.rs`).
#[derive(Default)]
pub(super) struct Ops {
    /// The operations lock, and each device's staging slots.
    slots: Mutex<Rings>,
    /// The running pause or resume, for those who watch it (`Engine::progress`).
    progress: progress::Tracker,
    /// Page-locks retained pinned backups between transactions.
    pinner: Arc<Pinner>,
    /// Host memory being given back after resumes returned.
    pub(super) releases: Arc<Releases>,
    /// Set when a panic (a bug) unwound through a pause or resume: the registry may then no
    /// longer describe the device truly, so pause, resume and new pauseable allocations refuse
    /// with this message instead of acting on it.
    broken: Mutex<Option<String>>,
}

impl Ops {
    /// Refuse to act after a panic unwound through a pause or resume.
    pub fn check_sound(&self) -> Result<()> {
        match &*self.broken.lock() {
            Some(m) => Err(Error::invalid_state(m.clone())),
            None => Ok(()),
        }
    }

    /// The operations lock, for the tools' copies: no pause or resume runs while it is held.
    /// Once let go, the staging slots go if no allocation with a backup is left (a `free` of
    /// the last one meanwhile only tried the lock: Note [Transactions]).
    pub fn exclusive<'a>(&'a self, registry: &'a Registry) -> Exclusive<'a> {
        Exclusive {
            _slots: self.slots.lock(),
            _recheck: DropUnusedSlots {
                ops: self,
                registry,
            },
        }
    }

    /// Page-locked bytes held in staging slots.
    pub fn staging_bytes(&self) -> u64 {
        self.slots.lock().values().map(Ring::bytes).sum()
    }

    /// No allocation with a backup is left: the staging slots go, unless a transaction holds
    /// them (it calls this once it let them go: Note [Transactions]). The registry is read
    /// before the lock is tried: a free that makes it 0 after that read finds the lock free,
    /// or held by a transaction that will call this again.
    pub fn drop_unused_slots(&self, registry: &Registry) {
        let backed = registry.lock().backed;
        if backed != 0 {
            return;
        }
        if let Some(mut slots) = self.slots.try_lock() {
            clear_if_unused(&mut slots, registry);
        }
    }

    /// The running pause or resume, if any.
    pub fn progress(&self) -> Option<Progress> {
        self.progress.snapshot()
    }

    /// Wait until the background pinner has page-locked what it was given (false on timeout).
    pub fn wait_pinned(&self, timeout: Duration) -> bool {
        self.pinner.wait_idle(timeout)
    }

    /// Wait until the host memory resumes are giving back is gone; how long that took.
    pub fn wait_released(&self) -> Duration {
        self.releases.wait()
    }
}

/// The staging slots go with the last allocation that could need them.
fn clear_if_unused(slots: &mut Rings, registry: &Registry) {
    if registry.lock().backed == 0 {
        slots.clear();
    }
}

/// What the staging slots become when a transaction ends.
pub(super) enum Slots {
    /// Kept for the next transaction, unless no allocation with a backup is left (`recheck`).
    KeepIfUsed,
    /// Handed to the caller, to be dropped after the operations lock is let go.
    Take,
}

/// A running pause or resume (Note [Transactions]).
pub(super) struct Txn<'e> {
    unwind: BreakOnUnwind<'e>,
    settle: Settle<'e>,
    gate: Option<OpenOnDrop<'e>>,
    slots: MutexGuard<'e, Rings>,
    recheck: DropUnusedSlots<'e>,
    end: Ending<'e>,
    /// Which segments of each allocation it marked were mapped when it marked them: what it
    /// changed is told from them ([`Txn::changed`]).
    before: Vec<(DevPtr, Vec<bool>)>,
}

/// The operations lock held by a tool's copy (`Ops::exclusive`); its fields drop in order: the
/// lock, then the look at the staging slots.
pub(super) struct Exclusive<'e> {
    _slots: MutexGuard<'e, Rings>,
    _recheck: DropUnusedSlots<'e>,
}

/// Once the operations lock is let go: the staging slots go if no allocation with a backup is
/// left (Note [Transactions]).
struct DropUnusedSlots<'e> {
    ops: &'e Ops,
    registry: &'e Registry,
}

impl Drop for DropUnusedSlots<'_> {
    fn drop(&mut self) {
        self.ops.drop_unused_slots(self.registry);
    }
}

/// What a transaction holds until its very end: its progress record, the pinner's quiet state
/// and the second unwind guard, in that drop order.
struct Ending<'e> {
    tracked: Tracked<'e>,
    _quiet: Quiet<'e>,
    _unwind: BreakOnUnwind<'e>,
    which: Which,
    ops: &'e Ops,
    registry: &'e Registry,
    t0: Instant,
}

impl<'e> Txn<'e> {
    /// The prologue (Note [Transactions]): refuse what cannot start, then take what every
    /// transaction holds, in order: the unwind guards, the pinner's quiet state, the operations
    /// lock (a transaction waits here for the one running, and is refused if that one broke the
    /// engine) and the progress record. `gate`: a
    /// non-blocking resume's, opened when the transaction ends, however it ends.
    pub(super) fn begin(
        ops: &'e Ops,
        registry: &'e Registry,
        which: Which,
        pick: &Pick<'_>,
        gate: Option<&'e Tracker>,
    ) -> Result<Txn<'e>> {
        let tag = pick.tag;
        check_tag(tag)?;
        ops.check_sound()?;
        let unwind = BreakOnUnwind {
            ops,
            which,
            tag: tag.map(str::to_owned),
        };
        let quiet = ops.pinner.quiet();
        let t0 = Instant::now();
        let slots = ops.slots.lock();
        // Looked at again: the transaction this one waited for may have panicked meanwhile.
        ops.check_sound()?;
        // The memory an earlier resume is giving back goes first (Note [Releases]); waited for
        // with the lock held: the transaction this one waited for counted its release pending
        // before it let go of the lock.
        ops.releases.wait();
        let tracked = ops.progress.begin(Start {
            which,
            tag,
            chunks: pick.chunks,
            label: pick.label,
        });
        Ok(Txn {
            unwind: unwind.clone(),
            settle: Settle {
                registry,
                ptrs: Vec::new(),
            },
            gate: gate.map(OpenOnDrop),
            slots,
            recheck: DropUnusedSlots { ops, registry },
            end: Ending {
                tracked,
                _quiet: quiet,
                _unwind: unwind,
                which,
                ops,
                registry,
                t0,
            },
            before: Vec::new(),
        })
    }

    /// Mark what `pick` selects: `f` marks the allocations in the registry (under its lock,
    /// after `pick` is checked against it: `Index::begin`) and copies out what the work needs.
    /// From here until the transaction settles them, they are this transaction's.
    pub(super) fn mark<J>(
        &mut self,
        pick: &Pick<'_>,
        f: impl FnOnce(&mut Index) -> Vec<(DevPtr, J)>,
    ) -> Result<Vec<J>> {
        let registry = self.settle.registry;
        registry.note_unknown_tag(verb(self.end.which), pick.tag);
        let mut reg = registry.lock();
        pick.check(&reg)?;
        let (ptrs, jobs): (Vec<DevPtr>, Vec<J>) = f(&mut reg).into_iter().unzip();
        // Marking changes no mapping: what is mapped now is what was before this transaction.
        self.before.extend(
            ptrs.iter()
                .filter_map(|p| Some((*p, reg.allocs.get(p)?.mapped_flags()))),
        );
        // Chunks of an allocation named by its address: the progress shows its tag.
        let shown = match (pick.tag, ptrs.first().filter(|_| pick.alloc.is_some())) {
            (None, Some(p)) => Some(reg.marked(*p).tag.clone()),
            _ => None,
        };
        self.settle.ptrs.extend(ptrs);
        drop(reg);
        if let Some(tag) = shown {
            self.end.tracked.set_tag(&tag);
        }
        Ok(jobs)
    }

    /// Mark again, for more work within this transaction, allocations it marked (a pause that
    /// failed part-way through one resumes it: `pause.rs`): what it holds in transition is
    /// settled, then `f` marks, under one hold of the registry's lock, so that a free waiting for
    /// one of them never finds it settled in between, and, the operations lock held throughout,
    /// no other transaction finds it either.
    pub(super) fn remark<J>(&mut self, f: impl FnOnce(&mut Index) -> Vec<(DevPtr, J)>) -> Vec<J> {
        let registry = self.settle.registry;
        let (ptrs, jobs): (Vec<DevPtr>, Vec<J>) = {
            let mut reg = registry.lock();
            self.settle.settle_in(&mut reg);
            f(&mut reg).into_iter().unzip()
        };
        registry.notify_settled();
        self.settle.ptrs.extend(ptrs);
        jobs
    }

    /// What it has changed so far: the allocations it marked whose segments are mapped
    /// otherwise than when it marked them, and those segments' bytes. No other transaction
    /// changes them meanwhile (the operations lock); one freed since is gone, nothing to undo.
    pub(super) fn changed(&self) -> Changed {
        let reg = self.settle.registry.lock();
        let mut c = Changed::NOTHING;
        for (p, was) in &self.before {
            let bytes = reg
                .allocs
                .get(p)
                .map_or(0, |a| a.bytes_mapped_otherwise(was));
            if bytes > 0 {
                c.allocations += 1;
                c.bytes += bytes;
            }
        }
        c
    }

    /// What the work uses: each device's staging slots, and the progress record.
    pub(super) fn work(&mut self) -> (&mut Rings, &Tracked<'e>) {
        (&mut self.slots, &self.end.tracked)
    }

    /// Hand retained pinned backups that are not page-locked yet to the background pinner
    /// (with `retain` on and pinning in the background): the chunks of them that lie wholly in
    /// what the backup holds (page-locking touches every page, so a chunked allocation with
    /// only some chunks saved would otherwise pin host memory for chunks never saved).
    pub(super) fn pin_later<'a>(
        &self,
        cfg: &CopyConfig,
        retain: bool,
        hosts: impl Iterator<Item = (DevPtr, &'a Arc<HostBuffer>)>,
    ) {
        if cfg.pin != PinMode::Background || !retain {
            return;
        }
        let todo = {
            let reg = self.settle.registry.lock();
            hosts
                .filter(|(_, h)| h.backend() == BackupKind::Pinned)
                .filter_map(|(p, h)| {
                    let a: &Allocation = reg.allocs.get(&p)?;
                    let chunks: Vec<usize> = h
                        .chunks_within(&a.saved_ranges())
                        .into_iter()
                        .filter(|&i| !h.is_pinned(i))
                        .collect();
                    h.want(&chunks);
                    (!chunks.is_empty()).then(|| (Arc::downgrade(h), chunks))
                })
                .collect()
        };
        self.end.ops.pinner.enqueue(todo);
    }

    /// Record in the history what an operation that fails did all the same (a non-blocking
    /// resume that failed after it returned commits what had landed): the tags it changed
    /// show it as their last pause or resume. The transaction then ends as a failed one does.
    pub(super) fn record_failed(&self, tally: Tally, release_seconds: f64) {
        self.end.record(tally, release_seconds);
    }

    /// End a transaction that failed before its end, as an error returned through it would:
    /// what it marked and left in transition goes back to the state it came from, then the
    /// operations lock goes. Returns the allocations it marked, for a caller with more to do
    /// once they have settled.
    pub(super) fn abort(self) -> Vec<DevPtr> {
        // Consumed: its guards settle and let go, in their order, once the list is taken.
        self.settle.ptrs.clone()
    }

    /// End the transaction (Note [Transactions]): settle what is still in transition, let go of
    /// the operations lock (the staging slots going as `slots` says), hand what was taken to
    /// `after` with the progress counters, then record the report, its time taken now and the
    /// seconds `after` returns spent releasing, per tag in the history that `stats` shows, and
    /// let go of the rest.
    pub(super) fn end(
        self,
        slots: Slots,
        tally: Tally,
        after: impl FnOnce(Rings, &Counters) -> f64,
    ) -> OpReport {
        // The first guard lives to the end of this function (its binding is not `_`).
        let Txn {
            unwind: _unwind,
            settle,
            gate,
            slots: mut held,
            recheck,
            end,
            before: _,
        } = self;
        drop(settle);
        drop(gate);
        let taken = match slots {
            Slots::KeepIfUsed => Rings::new(),
            Slots::Take => std::mem::take(&mut *held),
        };
        // What `after` gives back is pending before the lock goes: the transaction that takes
        // it next waits for that too (Note [Releases]).
        let coming = end.ops.releases.coming();
        drop(held);
        drop(recheck);
        let release_seconds = after(taken, end.tracked.counters());
        drop(coming);
        end.report(tally, release_seconds)
    }
}

impl Ending<'_> {
    /// The operation's report, recorded per tag; then everything left is let go of.
    fn report(self, tally: Tally, release_seconds: f64) -> OpReport {
        self.record(tally, release_seconds)
    }

    /// The operation's report, its time taken now, recorded per tag in the history.
    fn record(&self, tally: Tally, release_seconds: f64) -> OpReport {
        let Tally {
            mut report,
            per_tag,
        } = tally;
        report.release_seconds = release_seconds;
        report.seconds = self.t0.elapsed().as_secs_f64();
        let mut reg = self.registry.lock();
        for (t, mut r) in per_tag {
            r.seconds = report.seconds;
            r.release_seconds = report.release_seconds;
            let h = reg.history.entry(t).or_default();
            *match self.which {
                Which::Pause => &mut h.last_pause,
                Which::Resume => &mut h.last_resume,
            } = Some(r);
        }
        report
    }
}

/// `"pause"` or `"resume"`.
fn verb(which: Which) -> &'static str {
    match which {
        Which::Pause => "pause",
        Which::Resume => "resume",
    }
}

/// Marks the engine broken if a panic unwinds through the operation it guards.
#[derive(Clone)]
struct BreakOnUnwind<'a> {
    ops: &'a Ops,
    which: Which,
    tag: Option<String>,
}

impl Drop for BreakOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let what = format!(
                "a {} of {}",
                verb(self.which),
                describe(self.tag.as_deref())
            );
            tracing::error!("a panic (a bug) unwound through {what}");
            *self.ops.broken.lock() = Some(format!(
                "torch-memory-saver stopped after an internal error (a bug) during {what}: its \
                 record of the device may be wrong, so it no longer pauses, resumes or \
                 allocates; restart the process"
            ));
        }
    }
}

/// Returns the allocations a transaction marked, and that are still in transition when it ends
/// (by error or unwind), to the state they came from, and wakes those waiting for them. Only
/// the transaction holding the operations lock has allocations in transition.
struct Settle<'a> {
    registry: &'a Registry,
    ptrs: Vec<DevPtr>,
}

impl Settle<'_> {
    fn settle_in(&self, reg: &mut Index) {
        // What a pause wrote for segments it did not retire is not marked saved (the pause
        // cleared that when it began), so the handles tell all.
        for p in &self.ptrs {
            if let Some(a) = reg.allocs.get_mut(p).filter(|a| a.in_transition()) {
                a.state = a.settled();
                a.arriving = None;
            }
        }
    }
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        self.settle_in(&mut self.registry.lock());
        self.registry.notify_settled();
    }
}
