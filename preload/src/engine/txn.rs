//! The transaction: what every pause and resume holds from start to end, and lets go of in one
//! documented order.
//!
//! # Note [Transactions]
//!
//! A pause or resume is one [`Txn`], made by [`Txn::begin`] and let go of by dropping it, on
//! success, error or unwind alike; nothing it holds is dropped by hand elsewhere. It holds, and
//! lets go of in this order (its fields' order: Rust drops a struct's fields in declaration
//! order):
//!
//! 1. `settle`: the allocations it marked (Pausing, Resuming) that are still in transition go
//!    back to the state their handles describe, and a `free` waiting for one is woken. First,
//!    while the operations lock is still held, so that no later transaction ever finds an
//!    earlier one's allocations in transition.
//! 2. `ops`: the operations lock, and with it the staging slots. [`Txn::close`] lets it go
//!    before a resume gives host memory back, which takes long and needs no lock.
//! 3. `end` ([`Ending`]): the progress record (watchers see the operation to its very end, its
//!    release phase included), then the pinner's quiet state, then, last, the guard that marks
//!    the engine broken when a panic unwinds through any of the above.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::MutexGuard;

use super::base::{Engine, Ops};
use super::pick::{check_tag, describe, Pick};
use super::pinner::Quiet;
use super::pipeline::{CopyConfig, PinMode, Ring};
use super::progress::{Start, Tracked, Which};
use super::registry::Registry;
use super::report::{OpReport, Tally};
use super::stats::History;
use super::types::State;
use crate::backup::{BackupKind, HostBuffer};
use crate::driver::DevPtr;
use crate::error::Result;

/// One allocation's share of a transaction, as the transaction copied it out of the registry.
pub(super) trait Marked {
    /// The allocation's address.
    fn ptr(&self) -> DevPtr;
    /// Its tag.
    fn tag(&self) -> &Arc<str>;
}

/// What the staging slots become when a transaction closes.
pub(super) enum Slots {
    /// Kept for the next transaction, unless no allocation with a backup is left.
    KeepIfUsed,
    /// Handed to the caller, to be dropped after the operations lock is let go.
    Take,
}

/// A running pause or resume (Note [Transactions]).
pub(super) struct Txn<'e> {
    settle: Settle<'e>,
    ops: MutexGuard<'e, Ops>,
    end: Ending<'e>,
    /// The copy configuration, read once when the transaction began.
    pub cfg: CopyConfig,
}

/// What a transaction holds after [`Txn::close`]: its progress record, the pinner's quiet
/// state and the unwind guard, in that drop order.
pub(super) struct Ending<'e> {
    tracked: Tracked<'e>,
    _quiet: Quiet<'e>,
    _unwind: BreakOnUnwind<'e>,
    engine: &'e Engine,
    t0: Instant,
}

impl<'e> Txn<'e> {
    /// Refuse what cannot start (an empty tag, a broken engine), then take what every
    /// transaction holds: the unwind guard, the pinner's quiet state, the operations lock (a
    /// transaction waits here for the one running) and the progress record.
    pub(super) fn begin(engine: &'e Engine, which: Which, pick: &Pick<'_>) -> Result<Txn<'e>> {
        let tag = pick.tag;
        check_tag(tag)?;
        engine.check_sound()?;
        let (what, during) = match which {
            Which::Pause => ("pause", State::Pausing),
            Which::Resume => ("resume", State::Resuming),
        };
        let unwind = BreakOnUnwind {
            engine,
            what: format!("a {what} of {}", describe(tag)),
        };
        engine.note_unknown_tag(what, tag);
        // The memory an earlier resume is giving back goes first (`releases.rs`).
        engine.releases.wait();
        let quiet = engine.pinner.quiet();
        let t0 = Instant::now();
        let cfg = engine.copy_config();
        let ops = engine.ops.lock();
        let tracked = engine.progress.begin(Start {
            which,
            tag,
            chunks: pick.chunks,
            label: pick.label,
        });
        Ok(Txn {
            settle: Settle {
                engine,
                ptrs: Vec::new(),
                during,
            },
            ops,
            end: Ending {
                tracked,
                _quiet: quiet,
                _unwind: unwind,
                engine,
                t0,
            },
            cfg,
        })
    }

    /// Mark what `pick` selects: `f` marks the allocations in the registry (under its lock,
    /// after `pick` is checked against it) and copies out what the work needs. From here until
    /// the transaction settles them, they are this transaction's.
    pub(super) fn mark<J: Marked>(
        &mut self,
        pick: &Pick<'_>,
        f: impl FnOnce(&mut Registry) -> Vec<J>,
    ) -> Result<Vec<J>> {
        let jobs = {
            let mut reg = self.end.engine.reg.lock();
            pick.check(&reg)?;
            let jobs = f(&mut reg);
            self.settle.ptrs = jobs.iter().map(Marked::ptr).collect();
            jobs
        };
        if let (None, Some(j)) = (pick.tag, jobs.first().filter(|_| pick.alloc.is_some())) {
            // Chunks of an allocation named by its address: the progress shows its tag.
            self.end.tracked.set_tag(j.tag());
        }
        Ok(jobs)
    }

    /// The progress record.
    pub(super) fn tracked(&self) -> &Tracked<'e> {
        &self.end.tracked
    }

    /// Each device's staging slots.
    pub(super) fn rings(&mut self) -> &mut BTreeMap<i32, Ring> {
        &mut self.ops.rings
    }

    /// The same, and the progress record, for the copies.
    pub(super) fn work(&mut self) -> (&mut BTreeMap<i32, Ring>, &Tracked<'e>) {
        (&mut self.ops.rings, &self.end.tracked)
    }

    /// Settle what is still in transition and let go of the operations lock (Note
    /// [Transactions]); the staging slots go as `slots` says.
    pub(super) fn close(self, slots: Slots) -> (Ending<'e>, BTreeMap<i32, Ring>) {
        let Txn {
            settle,
            mut ops,
            end,
            cfg: _,
        } = self;
        drop(settle);
        let rings = match slots {
            Slots::KeepIfUsed => {
                end.engine.drop_unused_rings(&mut ops.rings);
                BTreeMap::new()
            }
            Slots::Take => std::mem::take(&mut ops.rings),
        };
        drop(ops);
        (end, rings)
    }
}

impl Ending<'_> {
    /// The progress record.
    pub(super) fn tracked(&self) -> &Tracked<'_> {
        &self.tracked
    }

    /// The operation's report, its time taken now, recorded per tag in `slot` of the history
    /// that `stats` shows.
    pub(super) fn report(
        &self,
        tally: Tally,
        release_seconds: f64,
        slot: impl Fn(&mut History) -> &mut Option<OpReport>,
    ) -> OpReport {
        let Tally {
            mut report,
            per_tag,
        } = tally;
        report.release_seconds = release_seconds;
        report.seconds = self.t0.elapsed().as_secs_f64();
        let mut reg = self.engine.reg.lock();
        for (t, mut r) in per_tag {
            r.seconds = report.seconds;
            r.release_seconds = report.release_seconds;
            *slot(reg.history.entry(t).or_default()) = Some(r);
        }
        report
    }
}

/// Marks the engine broken if a panic unwinds through the operation it guards.
struct BreakOnUnwind<'a> {
    engine: &'a Engine,
    what: String,
}

impl Drop for BreakOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("a panic (a bug) unwound through {}", self.what);
            *self.engine.broken.lock() = Some(format!(
                "torch-memory-saver stopped after an internal error (a bug) during {}: its record \
                 of the device may be wrong, so it no longer pauses, resumes or allocates; \
                 restart the process",
                self.what
            ));
        }
    }
}

/// Returns the allocations a transaction marked, and that are still in transition when it ends
/// (by error or unwind), to the state they came from, and wakes those waiting for them.
struct Settle<'a> {
    engine: &'a Engine,
    ptrs: Vec<DevPtr>,
    during: State,
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        {
            // What a pause wrote for segments it did not retire is not marked saved (the pause
            // cleared that when it began), so the handles tell all.
            let mut reg = self.engine.reg.lock();
            for p in &self.ptrs {
                if let Some(a) = reg.allocs.get_mut(p).filter(|a| a.state == self.during) {
                    a.state = a.settled();
                    a.arriving = None;
                }
            }
        }
        self.engine.settled.notify_all();
    }
}

impl Engine {
    /// Hand retained pinned backups that are not page-locked yet to the background pinner: the
    /// chunks of them that lie wholly in what the backup holds (page-locking touches every page,
    /// so a chunked allocation with only some chunks saved would otherwise pin host memory for
    /// chunks never saved).
    pub(super) fn pin_later<'a>(
        &self,
        cfg: &CopyConfig,
        hosts: impl Iterator<Item = (DevPtr, &'a Arc<HostBuffer>)>,
    ) {
        if cfg.pin != PinMode::Background || !self.retain_cpu_backup() {
            return;
        }
        let todo = {
            let reg = self.reg.lock();
            hosts
                .filter(|(_, h)| h.backend() == BackupKind::Pinned)
                .filter_map(|(p, h)| {
                    let a = reg.allocs.get(&p)?;
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
        self.pinner.enqueue(todo);
    }
}
