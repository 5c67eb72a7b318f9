//! The registry: a small index of allocations, their owners' questions answered at once, and
//! what a pause or resume picks from it ([`Pick`]).
//!
//! It holds what the hooks ask (is this address ours?) and each allocation's state; the work of
//! a pause or resume runs outside it, on copies of what it needs (Note [Pause and resume as
//! transactions] in `mod.rs`). Its lock is held only to read or change entries, never across a
//! driver call, a copy or a wait (Note [Locks]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::segment::{clipped, segments, Lost, Seg, Span};
use super::stats;
use super::types::{Backup, State};
use crate::backup::{DiskFile, HostBuffer};
use crate::driver::{DevPtr, PhysHandle};
use crate::error::{Error, Result};

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
    /// Allocations made so far: the newest one's serial.
    pub made: u64,
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
        // `addr` itself lies inside (an empty range just past the end is not in it).
        if addr < start + a.size && end <= start + a.size {
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
    /// segments (a non-empty list, sorted), mark it `during` and return its address with what
    /// `f` copies out of it, in address order.
    pub fn begin<J>(
        &mut self,
        during: State,
        mut pick: impl FnMut(DevPtr, &Allocation) -> Option<Vec<usize>>,
        mut f: impl FnMut(DevPtr, &mut Allocation, Vec<usize>) -> J,
    ) -> Vec<(DevPtr, J)> {
        let mut out = Vec::new();
        for (ptr, a) in self.allocs.iter_mut() {
            if !a.pauseable || a.resident || a.in_transition() {
                continue;
            }
            let Some(segs) = pick(*ptr, a).filter(|s| !s.is_empty()) else {
                continue;
            };
            a.state = during;
            out.push((*ptr, f(*ptr, a, segs)));
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

/// One allocation: where it lies, its tag and backup, and the state of each segment.
pub(super) struct Allocation {
    /// 1 for the process's first allocation, then one more for each: one made in place of a
    /// freed one, at its address and of its size, is told from it (`stats`).
    pub serial: u64,
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
    /// asked to restore them; one record per [`Record`].
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

    /// Per segment, whether a caller is shown it active: mapped, or restored by a non-blocking
    /// resume that has not settled yet.
    pub fn shown_active(&self) -> Vec<bool> {
        let mut v: Vec<bool> = self.handles.iter().map(Option::is_some).collect();
        if let Some((segs, true)) = &self.arriving {
            for &s in segs {
                v[s] = true;
            }
        }
        v
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

    /// Record paused the segments of `segs` (mapped segments of this allocation at `ptr`) that a
    /// failed unmap could not map again; `saved`: their backup holds their contents.
    pub fn record_lost(&mut self, ptr: DevPtr, segs: &[Seg], lost: &[Lost], saved: bool) {
        for l in lost {
            let s = ((segs[l.index].ptr - ptr) / self.segment) as usize;
            self.handles[s] = None;
            self.saved[s] = saved;
            if l.mapped && !self.stuck.contains(&s) {
                self.stuck.push(s);
            }
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

    /// Which segments are mapped now, one flag each.
    pub fn mapped_flags(&self) -> Vec<bool> {
        self.handles.iter().map(Option::is_some).collect()
    }

    /// Device bytes of the segments mapped otherwise than `was` says (its [`mapped_flags`]
    /// at some earlier time).
    ///
    /// [`mapped_flags`]: Allocation::mapped_flags
    pub fn bytes_mapped_otherwise(&self, was: &[bool]) -> u64 {
        segments(self.mapped, self.segment)
            .zip(&self.handles)
            .zip(was)
            .filter(|((_, h), w)| h.is_some() != **w)
            .map(|(((_, len), _), _)| len)
            .sum()
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

/// What a pause or resume acts on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pick<'a> {
    /// Allocations of this tag (every tag if `None`).
    pub tag: Option<&'a str>,
    /// Only the allocation starting here.
    pub alloc: Option<DevPtr>,
    /// Only these chunks of it (a chunked allocation; sorted, each once).
    pub chunks: Option<&'a [usize]>,
    /// Pause: record which chunks of each allocation were active (a whole allocation: whether
    /// it was). Resume: bring back only what was so recorded (all, where nothing was recorded).
    pub chunk_state: bool,
    /// Which record `chunk_state` saves or restores.
    pub record: Record,
    /// Resume: check what came back against the backup (as the tag's `Checks::verify` does),
    /// failing where the driver cannot digest.
    pub verify: bool,
    /// A number the caller gives the operation, reported with its progress
    /// ([`super::Engine::progress`]) so that the caller can tell its own operation from another's
    /// (the control server's request number).
    pub label: Option<u64>,
}

/// Where a pause saving chunk states records them: the program's record
/// (`pause(save_chunk_state=True)`), or the one a job-wide operation keeps for its own undo
/// (`tmsctl pause --atomic`, `distributed.pause`), so that neither overwrites the other's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Record {
    /// The program's own.
    #[default]
    Program,
    /// A job-wide operation's, for its undo.
    Job,
}

impl Record {
    /// Its index in an allocation's records.
    pub(super) fn index(self) -> usize {
        match self {
            Record::Program => 0,
            Record::Job => 1,
        }
    }
}

impl<'a> Pick<'a> {
    /// Every allocation of `tag` (every tag if `None`), whole.
    pub fn tag(tag: Option<&'a str>) -> Self {
        Pick {
            tag,
            ..Default::default()
        }
    }

    /// These chunks of the chunked allocation at `alloc`.
    pub fn chunks(alloc: DevPtr, chunks: &'a [usize]) -> Self {
        Pick {
            alloc: Some(alloc),
            chunks: Some(chunks),
            ..Default::default()
        }
    }

    pub(super) fn selects(&self, ptr: DevPtr, a: &Allocation) -> bool {
        self.tag.is_none_or(|t| &*a.tag == t) && self.alloc.is_none_or(|p| p == ptr)
    }

    pub(super) fn wants(&self, seg: usize) -> bool {
        self.chunks.is_none_or(|c| c.binary_search(&seg).is_ok())
    }

    /// What a pause of this pick gives back of the allocation at `ptr`, if it selects it: the
    /// mapped segments it names, and those of them a failed resume left mapped (paused already).
    pub(super) fn segments_to_pause(&self, ptr: DevPtr, a: &Allocation) -> Option<Vec<usize>> {
        self.selects(ptr, a).then(|| {
            (0..a.handles.len())
                .filter(|&s| (a.handles[s].is_some() || a.stuck.contains(&s)) && self.wants(s))
                .collect()
        })
    }

    /// What a resume of this pick restores of the allocation at `ptr`, if it selects it: the
    /// paused segments it names (with `chunk_state`, of those only what its record says were
    /// active, where there is a record).
    pub(super) fn segments_to_resume(&self, ptr: DevPtr, a: &Allocation) -> Option<Vec<usize>> {
        self.selects(ptr, a).then(|| {
            let kept = a.kept[self.record.index()]
                .as_ref()
                .filter(|_| self.chunk_state);
            (0..a.handles.len())
                .filter(|&s| a.handles[s].is_none() && self.wants(s) && kept.is_none_or(|k| k[s]))
                .collect()
        })
    }

    /// A pause with `chunk_state`: record in every allocation this pick selects, those with
    /// nothing left to pause included (chunked or not: a whole allocation is one record of its
    /// segments), which segments are active, so that a resume restores the state at this pause,
    /// never an older one's (nor everything, which it takes a missing record for). No other
    /// transaction runs (the operations lock), so none of them is in transition.
    pub(super) fn record_chunk_state(&self, reg: &mut Index) {
        if !self.chunk_state {
            return;
        }
        for (ptr, a) in reg.allocs.iter_mut() {
            if self.selects(*ptr, a) {
                a.kept[self.record.index()] = Some(a.handles.iter().map(Option::is_some).collect());
            }
        }
    }

    /// Refuse chunks of an allocation that is not chunked, or that it does not have.
    pub(super) fn check(&self, reg: &Index) -> Result<()> {
        let Some(ptr) = self.alloc else {
            return Ok(());
        };
        let a = reg.allocs.get(&ptr).ok_or_else(|| {
            Error::not_found(format!(
                "{ptr:#x} is not the start of a pauseable allocation"
            ))
        })?;
        if a.resident {
            return Err(Error::invalid_state(format!(
                "allocation {ptr:#x} (tag {:?}) is kept resident (keep_resident): pause and \
                 resume leave it mapped until it is freed",
                a.tag
            )));
        }
        let Some(chunks) = self.chunks else {
            return Ok(());
        };
        if a.chunk == 0 {
            return Err(Error::invalid_argument(format!(
                "allocation {ptr:#x} (tag {:?}) is not chunked: it pauses and resumes whole \
                 (allocate it in a region with a chunk size)",
                a.tag
            )));
        }
        if !chunks.windows(2).all(|w| w[0] < w[1]) {
            return Err(Error::invalid_argument(
                "chunk indices must be sorted and each given once",
            ));
        }
        let n = a.handles.len();
        if let Some(bad) = chunks.iter().find(|&&c| c >= n) {
            return Err(Error::invalid_argument(format!(
                "chunk {bad} of allocation {ptr:#x} (tag {:?}): it has {n} chunks (0 to {})",
                a.tag,
                n - 1
            )));
        }
        Ok(())
    }

    pub(super) fn describe(&self) -> String {
        let mut d = describe(self.tag);
        if let Some(p) = self.alloc {
            d = format!("allocation {p:#x}");
        }
        if let Some(c) = self.chunks {
            d = format!("{} of {d}", crate::units::ranges(c));
        }
        d
    }
}

/// `tag "kv"`, or `all tags`.
pub(super) fn describe(tag: Option<&str>) -> String {
    match tag {
        Some(t) => format!("tag {t:?}"),
        None => "all tags".to_string(),
    }
}
