//! What the engine does with NCCL's communicators (`comms.rs`): pauses and resumes of their
//! tag, of every tag with them, and pauses of memory that hold buffers NCCL registered.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::base::Engine;
use super::comms::{CommStats, Comms, Registered, Registration, NCCL_TAG};
use super::progress::Which;
use super::registry::{Index, Pick};
use super::report::{OpReport, Tally};
use super::txn::{Slots, Txn};
use crate::driver::DevPtr;
use crate::error::{Changed, Error, Result};
use crate::units::human;

/// How a pause or resume involves the communicators.
enum Part {
    /// Not at all.
    No,
    /// Only them: the reserved tag.
    Only,
    /// Them and the memory: every tag, with the setting on.
    Also,
}

static SKIPPED_IN_ALL: std::sync::Once = std::sync::Once::new();

impl Engine {
    /// This engine's communicators (an engine starts with none: [`NoComms`]).
    pub fn with_comms(mut self, comms: Arc<dyn Comms>) -> Self {
        self.comms = comms;
        self
    }

    /// Include the communicators in pauses and resumes of every tag (off by default: the
    /// program must not use a suspended communicator, so it asks for this itself).
    pub fn set_nccl_in_all(&self, on: bool) {
        self.settings.set_nccl_in_all(on);
    }

    /// Whether pauses and resumes of every tag include the communicators.
    pub fn nccl_in_all(&self) -> bool {
        self.settings.nccl_in_all()
    }

    /// What pauses do with allocations holding buffers NCCL registered.
    pub fn set_registered_policy(&self, p: Registered) {
        self.settings.set_registered(p);
    }

    /// What pauses do with allocations holding buffers NCCL registered.
    pub fn registered_policy(&self) -> Registered {
        self.settings.registered()
    }

    /// The communicators' entry of `stats`, the engine's settings filled in.
    pub(super) fn comm_stats(&self) -> Option<CommStats> {
        let mut c = self.comms.stats(&*self.driver)?;
        c.in_all_tags = self.nccl_in_all();
        c.registered_policy = self.registered_policy().as_str();
        Some(c)
    }

    /// Run `memory`, the pause or resume of allocations `pick` names, with what it asks of
    /// the communicators: nothing, only them (the reserved tag), or them too (every tag, with
    /// the setting on). A pause suspends them after the memory, a resume resumes them first,
    /// so that they are back before anything else is; each step is all or nothing on its own
    /// and the error says what the other did.
    pub(super) fn with_comms_of(
        &self,
        which: Which,
        pick: &Pick<'_>,
        memory: impl FnOnce() -> Result<OpReport>,
    ) -> Result<OpReport> {
        match self.comms_part(pick) {
            Part::No => memory(),
            Part::Only => self.comms_step(which),
            Part::Also if which == Which::Pause => {
                let m = memory()?;
                let c = self.comms_step(which).map_err(|e| {
                    // The memory's part as its report counts it (memory a failed resume had
                    // left mapped, which the pause gave back, included).
                    let paused = Changed {
                        allocations: m.allocations,
                        bytes: m.bytes,
                        communicators: 0,
                    };
                    let changed = e.changed().map(|c| c.plus(paused));
                    let e = e.note(format!(
                        "the allocations were paused ({} given back); NCCL's communicators were not",
                        human(m.bytes)
                    ));
                    with_changed(e, changed)
                })?;
                Ok(joined(m, c))
            }
            Part::Also => {
                let c = self.comms_step(which)?;
                let m = memory().map_err(|e| {
                    let resumed = Changed {
                        allocations: 0,
                        bytes: c.bytes,
                        communicators: c.communicators,
                    };
                    let changed = e.changed().map(|m| m.plus(resumed));
                    let e = e.note(format!(
                        "NCCL's communicators were resumed ({})",
                        c.communicators
                    ));
                    with_changed(e, changed)
                })?;
                Ok(joined(m, c))
            }
        }
    }

    fn comms_part(&self, pick: &Pick<'_>) -> Part {
        if pick.alloc.is_some() {
            return Part::No;
        }
        match pick.tag {
            Some(t) if t == NCCL_TAG => Part::Only,
            Some(_) => Part::No,
            None if self.nccl_in_all() && self.comms.seen() => match self.comms.unsupported() {
                Some(why) => {
                    SKIPPED_IN_ALL.call_once(|| {
                        tracing::warn!("pauses of every tag leave NCCL's communicators: {why}")
                    });
                    Part::No
                }
                None => Part::Also,
            },
            None => Part::No,
        }
    }

    /// Suspend or resume every communicator: a transaction of its own (the operations lock,
    /// the progress record), recorded in the tag's history when it changed any.
    fn comms_step(&self, which: Which) -> Result<OpReport> {
        let verb = if which == Which::Pause {
            "pause"
        } else {
            "resume"
        };
        if !self.comms.seen() {
            return Ok(OpReport::default());
        }
        let pick = Pick::tag(Some(NCCL_TAG));
        let tx =
            Txn::begin(&self.ops, &self.registry, which, &pick, None).map_err(Error::unchanged)?;
        let done = match which {
            Which::Pause => self.comms.suspend(&*self.driver),
            Which::Resume => self.comms.resume(&*self.driver),
        }
        .map_err(|e| e.context(format!("{verb} of tag {NCCL_TAG:?}")))?;
        let mut tally = Tally::default();
        if done.communicators > 0 {
            tally.communicators(&Arc::from(NCCL_TAG), done.communicators, done.bytes);
        }
        let report = tx.end(Slots::KeepIfUsed, tally, |_, _| 0.0);
        tracing::info!(
            "{verb} of tag {NCCL_TAG:?}: {} communicators, {} in {:.3}s",
            report.communicators,
            human(report.bytes),
            report.seconds
        );
        Ok(report)
    }

    /// The allocations a pause of `pick` leaves mapped because NCCL registered a buffer in
    /// them (under [`Registered::Keep`]); an error naming one, and changing nothing, under
    /// [`Registered::Refuse`] or when `pick` names the allocation itself.
    pub(super) fn registered_kept(&self, pick: &Pick<'_>) -> Result<BTreeSet<DevPtr>> {
        let regs = self.comms.registrations();
        if regs.is_empty() {
            return Ok(BTreeSet::new());
        }
        let reg = self.registry.lock();
        let hits = registered_in(&reg, pick, &regs);
        drop(reg);
        let refuse = self.registered_policy() == Registered::Refuse || pick.alloc.is_some();
        if let (true, Some(h)) = (refuse, hits.first()) {
            return Err(Error::invalid_state(format!(
                "pause of {}: {}: pausing it would leave NCCL's registration on memory given \
                 back. Deregister the buffer first (ncclCommDeregister, \
                 ncclCommWindowDeregister), or keep such allocations resident \
                 (TMS_NCCL_REGISTERED=keep, tms.nccl_registered_buffers = \"keep\"; \
                 keep_resident() keeps one for good){}",
                pick.describe(),
                h.1,
                match hits.len() {
                    1 => String::new(),
                    n => format!(" ({} more allocations hold registered buffers)", n - 1),
                }
            )));
        }
        for (p, why) in &hits {
            tracing::info!("pause leaves allocation {p:#x} mapped: {why}");
        }
        Ok(hits.into_iter().map(|(p, _)| p).collect())
    }
}

/// The allocations `pick` would pause some of that hold a registered buffer, each once, with
/// words naming it and its first buffer.
fn registered_in(reg: &Index, pick: &Pick<'_>, regs: &[Registration]) -> Vec<(DevPtr, String)> {
    reg.allocs
        .iter()
        .filter(|(p, a)| {
            a.pauseable
                && !a.resident
                && pick.selects(**p, a)
                && (0..a.handles.len()).any(|s| a.handles[s].is_some() && pick.wants(s))
        })
        .filter_map(|(p, a)| {
            let r = regs
                .iter()
                .find(|r| r.addr < p + a.size && *p < r.addr.saturating_add(r.len.max(1)))?;
            Some((
                *p,
                format!(
                    "allocation {p:#x} ({} bytes, tag {:?}) holds a buffer NCCL registered \
                     ({:#x}, {} bytes, {})",
                    a.size, a.tag, r.addr, r.len, r.how
                ),
            ))
        })
        .collect()
}

/// `e`, saying it changed `c` where that is known (else as it was: not said).
fn with_changed(e: Error, c: Option<Changed>) -> Error {
    match c {
        Some(c) => e.with_changed(c),
        None => e,
    }
}

/// Two reports of one call: its memory's and its communicators'.
fn joined(mut a: OpReport, b: OpReport) -> OpReport {
    a.communicators += b.communicators;
    a.bytes += b.bytes;
    a.seconds += b.seconds;
    a
}
