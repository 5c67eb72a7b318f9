//! The registry: a small index of allocations, their owners' questions answered at once.
//!
//! It holds what the hooks ask (is this address ours?) and each allocation's state; the work of
//! a pause or resume runs outside it, on copies of what it needs (Note [Pause and resume as
//! transactions] in `mod.rs`). Its lock is held only to read or change entries, never across a
//! driver call, a copy or a wait (Note [Locks]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::segment::{clipped, segments, Seg, Span};
use super::stats;
use super::types::{Backup, State};
use crate::backup::{DiskFile, HostBuffer};
use crate::driver::{DevPtr, PhysHandle};
use crate::error::{Error, Result};

pub(super) struct Allocation {
    pub size: u64,
    pub mapped: u64,
    pub device: i32,
    pub tag: Arc<str>,
    pub backup: Backup,
    /// Bytes of each physical segment (the last may be shorter).
    pub segment: u64,
    /// Chunked allocations (Note [Chunked allocations]): their chunk size, which is also their
    /// segment size; 0 for the others, which pause and resume whole.
    pub chunk: u64,
    /// Active, Partial or Paused when settled (as its handles say), or in a transition.
    pub state: State,
    /// One entry per segment: its handle while mapped.
    pub handles: Vec<Option<PhysHandle>>,
    pub host: Option<Arc<HostBuffer>>,
    /// The disk backup's file, kept from the first disk-backed pause until the allocation goes.
    pub disk: Option<Arc<DiskFile>>,
    /// Per segment: the backup (host buffer or file) holds its complete contents, those of
    /// the last pause (the contents while paused; with retention also while active). False
    /// while a pause writes it.
    pub saved: Vec<bool>,
    /// Chunk states recorded by a pause asked to save them (true = was active), for a resume
    /// asked to restore them; one record per [`super::pick::Record`].
    pub kept: [Option<Vec<bool>>; 2],
    /// Paused segments a failed resume could not unmap while undoing (their handles are
    /// released): unmapped before they are mapped again, or before the range is freed.
    pub stuck: Vec<usize>,
    /// A non-blocking resume whose caller may have returned (Note [Non-blocking resume]): the
    /// segments it resumes are mapped, and their contents landed (`true`) or on their way.
    /// What `stats` and `allocations` show, before the resume settles the allocation (which
    /// clears it).
    pub arriving: Option<(Vec<usize>, bool)>,
    pub pauseable: bool,
    /// Kept mapped at the same physical backing by every pause and resume until freed
    /// (`keep_resident`: memory NCCL has registered must never move).
    pub resident: bool,
}

impl Allocation {
    /// Where its segments lie, `ptr` being its address.
    pub fn span(&self, ptr: DevPtr) -> Span {
        Span {
            device: self.device,
            ptr,
            mapped: self.mapped,
            segment: self.segment,
        }
    }

    /// In the middle of a pause or resume: its owner waits before freeing it.
    pub fn in_transition(&self) -> bool {
        matches!(self.state, State::Pausing | State::Resuming)
    }

    /// The state a caller is shown: the settled one, or for an allocation a non-blocking
    /// resume is restoring, Active (or Partial) once its contents landed.
    pub fn shown_state(&self) -> State {
        match &self.arriving {
            Some((segs, true)) if self.state == State::Resuming => {
                let mapped = self.handles.iter().filter(|h| h.is_some()).count() + segs.len();
                if mapped >= self.handles.len() {
                    State::Active
                } else {
                    State::Partial
                }
            }
            _ => self.state,
        }
    }

    /// Device bytes mapped now, as a caller is shown them: `(active, arriving, unrestored)`.
    /// Active: mapped segments, and those a non-blocking resume restored; arriving: mapped by
    /// one still restoring them; unrestored: left mapped by one that failed after its caller
    /// returned (`stuck`), their contents not restored.
    pub fn shown_bytes(&self) -> (u64, u64, u64) {
        let lens: Vec<u64> = segments(self.mapped, self.segment)
            .map(|(_, l)| l)
            .collect();
        let of = |segs: &[usize]| segs.iter().map(|&s| lens[s]).sum::<u64>();
        let (arriving, landed) = match &self.arriving {
            Some((segs, true)) => (0, of(segs)),
            Some((segs, false)) => (of(segs), 0),
            None => (0, 0),
        };
        (self.active_bytes() + landed, arriving, of(&self.stuck))
    }

    /// The settled state its handles describe.
    pub fn settled(&self) -> State {
        let mapped = self.handles.iter().filter(|h| h.is_some()).count();
        if mapped == self.handles.len() {
            State::Active
        } else if mapped == 0 {
            State::Paused
        } else {
            State::Partial
        }
    }

    /// The mapped segments with their handles.
    pub fn mapped_segs(&self, ptr: DevPtr) -> Vec<Seg> {
        segments(self.mapped, self.segment)
            .zip(&self.handles)
            .filter_map(|((off, len), h)| {
                h.map(|handle| Seg {
                    ptr: ptr + off,
                    len,
                    handle,
                })
            })
            .collect()
    }

    /// Device bytes mapped now.
    pub fn active_bytes(&self) -> u64 {
        segments(self.mapped, self.segment)
            .zip(&self.handles)
            .filter(|(_, h)| h.is_some())
            .map(|((_, len), _)| len)
            .sum()
    }

    /// The segments `[off, off+len)` touches.
    pub fn segs_of(&self, off: u64, len: u64) -> std::ops::Range<usize> {
        let first = (off / self.segment) as usize;
        let end = (off + len.max(1)).div_ceil(self.segment) as usize;
        first..end.min(self.handles.len())
    }

    /// The host backup as a complete snapshot of bytes `[off, off+len)`, if it is one.
    pub fn snapshot(&self, off: u64, len: u64) -> Option<&Arc<HostBuffer>> {
        let r = self.segs_of(off, len);
        self.host
            .as_ref()
            .filter(|_| self.saved[r].iter().all(|s| *s))
    }

    /// Host memory held for the backup: the buffer's length, or for a chunked allocation the
    /// bytes of the chunks it holds (the rest of the buffer is never touched, or given back).
    pub fn host_bytes(&self) -> u64 {
        let Some(h) = &self.host else {
            return 0;
        };
        if self.chunk == 0 {
            return h.len();
        }
        self.saved_ranges().iter().map(|r| r.1).sum()
    }

    /// Byte ranges `(offset, length)` of the allocation whose contents the backup holds,
    /// consecutive saved segments merged, clipped to the asked size.
    pub fn saved_ranges(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for ((off, len), _) in segments(self.mapped, self.segment)
            .zip(&self.saved)
            .filter(|(_, s)| **s)
        {
            let len = clipped(off, len, self.size);
            match out.last_mut() {
                Some(last) if last.0 + last.1 == off => last.1 += len,
                _ => out.push((off, len)),
            }
        }
        out
    }

    /// The backup holds the whole allocation's contents.
    pub fn fully_saved(&self) -> bool {
        self.saved.iter().all(|s| *s)
    }
}

/// The registry of one engine: the index behind its lock, the condvar on which a free waits for
/// an allocation in transition, and every tag ever seen.
#[derive(Default)]
pub(super) struct Registry {
    index: Mutex<Index>,
    /// Notified whenever an allocation leaves a transition (see `Engine::free`).
    settled: Condvar,
    /// Every tag an allocation ever had (never cleared). A lock of its own, and a leaf, so
    /// asking never waits for a pause.
    tags: Mutex<HashSet<Box<str>>>,
}

impl Registry {
    /// The index, under the registry lock (held briefly: Note [Locks]).
    pub fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock()
    }

    /// Change the entry a transaction marked.
    pub fn marked<T>(&self, ptr: DevPtr, f: impl FnOnce(&mut Allocation) -> T) -> T {
        f(self.lock().marked(ptr))
    }

    /// Wait, under `index`'s lock, until an allocation leaves a transition.
    pub fn wait_settled(&self, index: &mut MutexGuard<'_, Index>) {
        self.settled.wait(index);
    }

    /// Wake those waiting for an allocation to leave a transition.
    pub fn notify_settled(&self) {
        self.settled.notify_all();
    }

    /// Remember that an allocation had `tag`.
    pub fn remember_tag(&self, tag: &str) {
        let mut seen = self.tags.lock();
        if !seen.contains(tag) {
            seen.insert(tag.into());
        }
    }

    /// Whether an allocation (alive or freed since) ever had `tag`.
    pub fn tag_known(&self, tag: &str) -> bool {
        self.tags.lock().contains(tag)
    }

    /// Log at debug level a pause or resume of a tag no allocation ever had (it is a quiet
    /// success, like one of a tag whose allocations are all freed).
    pub fn note_unknown_tag(&self, what: &str, tag: Option<&str>) {
        if let Some(t) = tag.filter(|t| !self.tag_known(t)) {
            tracing::debug!("{what} of tag {t:?}: no allocation ever had this tag; nothing to do");
        }
    }
}

/// What the registry lock guards: the allocations, and what is kept per tag and per device.
#[derive(Default)]
pub(super) struct Index {
    pub allocs: BTreeMap<DevPtr, Allocation>,
    pub history: HashMap<Arc<str>, stats::History>,
    pub granularity: HashMap<i32, u64>,
    /// Allocations with a backup policy: the staging slots go when the last one does.
    pub backed: usize,
}

impl Index {
    /// The allocation holding `[addr, addr+len)` within its asked size.
    pub fn containing(&self, addr: DevPtr, len: u64) -> Result<(DevPtr, &Allocation)> {
        let not_found = || {
            Error::not_found(format!(
                "range {addr:#x}+{len} does not lie inside one pauseable allocation"
            ))
        };
        let (start, a) = self
            .allocs
            .range(..=addr)
            .next_back()
            .ok_or_else(not_found)?;
        let end = addr.checked_add(len).ok_or_else(not_found)?;
        if end <= start + a.size {
            Ok((*start, a))
        } else {
            Err(not_found())
        }
    }

    /// [`Index::containing`], for a chunked allocation only.
    pub fn chunked_containing(&self, addr: DevPtr, len: u64) -> Result<(DevPtr, &Allocation)> {
        let (start, a) = self.containing(addr, len)?;
        if a.chunk == 0 {
            return Err(Error::invalid_argument(format!(
                "allocation {start:#x} (tag {:?}) holding {addr:#x} is not chunked",
                a.tag
            )));
        }
        Ok((start, a))
    }

    /// Start a transaction: on each settled pauseable allocation for which `pick` names
    /// segments (a non-empty list, sorted), mark it `during` and return what `f` copies out of
    /// it, in address order.
    pub fn begin<J>(
        &mut self,
        during: State,
        mut pick: impl FnMut(DevPtr, &Allocation) -> Option<Vec<usize>>,
        mut f: impl FnMut(DevPtr, &mut Allocation, Vec<usize>) -> J,
    ) -> Vec<J> {
        let mut out = Vec::new();
        for (ptr, a) in self.allocs.iter_mut() {
            if !a.pauseable || a.resident || a.in_transition() {
                continue;
            }
            let Some(segs) = pick(*ptr, a).filter(|s| !s.is_empty()) else {
                continue;
            };
            a.state = during;
            out.push(f(*ptr, a, segs));
        }
        out
    }

    /// The entry a transaction marked; it cannot be gone (frees wait for the transition).
    pub fn marked(&mut self, ptr: DevPtr) -> &mut Allocation {
        self.allocs
            .get_mut(&ptr)
            .expect("an allocation in transition is not freed")
    }
}
