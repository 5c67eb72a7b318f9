//! What follows non-blocking resumes (Note [Non-blocking resume] in `inflight.rs`): each one
//! from its start to its end ([`Tracker`]: the gate's steps, the allocations restored so far,
//! the outcome), and what the engine keeps of them ([`Restores`]: those in flight, and the
//! failures after their callers returned, with the allocations they left unrestored).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::registry::Registry;
use super::report::OpReport;
use super::types::State;
use crate::driver::{DevPtr, Gate, Stream};
use crate::error::{Error, Result};

/// Whether the allocation of `size` bytes at `start` holds address `ptr`.
pub(super) fn holds(start: DevPtr, size: u64, ptr: DevPtr) -> bool {
    ptr >= start && ptr - start < size.max(1)
}

/// One non-blocking resume, from its start to its end (Note [Non-blocking resume]).
pub(super) struct Tracker {
    pub(super) gate: Gate,
    /// `"resume of tag 'kv'"`, for messages.
    what: String,
    st: Mutex<TrackState>,
    cv: Condvar,
}

#[derive(Default)]
struct TrackState {
    /// Whether the transaction marked its allocations (the fields below are set then).
    begun: bool,
    /// Each allocation, in the resume's order: address and size.
    jobs: Vec<(DevPtr, u64)>,
    /// Per allocation, the bytes of it this resume restores (those of the segments or chunks
    /// it resumes, within the asked size): what its report counts.
    bytes: Vec<u64>,
    /// Pipeline items (runs of segments) still to be copied, per allocation.
    left: Vec<usize>,
    /// How many leading allocations are restored.
    prefix: usize,
    /// The gate's value when this resume began.
    base: u32,
    /// Devices still mapping.
    mapping: usize,
    /// Everything is mapped: the caller may return, and a failure from now on is kept for later.
    mapped: bool,
    /// A panic unwound through a device's share before everything was mapped, and its mappings
    /// are undone: the caller must not return before the thread ends (with the panic).
    unwound: bool,
    /// The outcome, once the thread is done.
    done: Option<std::result::Result<(), Error>>,
    /// An earlier non-blocking resume's failure nothing reported, concerning allocations this
    /// one restores: the caller raises it once everything is mapped.
    earlier: Option<Error>,
    /// Its failure after the return is kept with the allocations it left unrestored
    /// (`Restores::keep_failure`), which say from then on whether a wait raises it: a pause
    /// may settle them before this thread records its outcome.
    kept: bool,
}

impl TrackState {
    fn end(&self) -> u32 {
        self.base.wrapping_add(self.jobs.len() as u32)
    }

    /// The index of the allocation holding `ptr`.
    fn job_of(&self, ptr: DevPtr) -> Option<usize> {
        self.jobs.iter().position(|&(p, size)| holds(p, size, ptr))
    }

    fn landed(&self, k: usize) -> bool {
        self.left[k] == 0
    }
}

impl Tracker {
    pub(super) fn new(gate: Gate, what: String) -> Self {
        Tracker {
            gate,
            what,
            st: Mutex::default(),
            cv: Condvar::new(),
        }
    }

    /// The resume marked `jobs` (address, size, bytes it restores, pipeline items), in its
    /// order, on `devices` devices; the gate's value now is its base. `earlier`: see
    /// [`Tracker::take_earlier`].
    pub(super) fn begin(
        &self,
        jobs: Vec<(DevPtr, u64, u64, usize)>,
        devices: usize,
        earlier: Option<Error>,
    ) {
        let mut s = self.st.lock();
        s.earlier = earlier;
        s.base = self.gate.value();
        s.left = jobs.iter().map(|j| j.3).collect();
        s.bytes = jobs.iter().map(|j| j.2).collect();
        s.jobs = jobs.into_iter().map(|j| (j.0, j.1)).collect();
        s.mapping = devices;
        s.begun = true;
        // Allocations with nothing to copy are restored as soon as they are mapped.
        self.advance(&mut s);
        if devices == 0 {
            s.mapped = true;
        }
        drop(s);
        self.cv.notify_all();
    }

    /// One device mapped all of its share.
    pub(super) fn device_mapped(&self) {
        let mut s = self.st.lock();
        s.mapping = s.mapping.saturating_sub(1);
        if s.mapping == 0 && !s.unwound {
            s.mapped = true;
            drop(s);
            self.cv.notify_all();
        }
    }

    /// Allocations, the bytes it restores, those not restored yet, and the gate value of the
    /// end.
    pub(super) fn summary(&self) -> (usize, u64, u64, u32) {
        let s = self.st.lock();
        let pending: u64 = (0..s.jobs.len())
            .filter(|&k| !s.landed(k))
            .map(|k| s.bytes[k])
            .sum();
        (s.jobs.len(), s.bytes.iter().sum(), pending, s.end())
    }

    /// An earlier non-blocking resume's failure that nothing reported, concerning allocations
    /// this resume restores (it does restore them): for the caller to raise.
    pub(super) fn take_earlier(&self) -> Option<Error> {
        self.st.lock().earlier.take()
    }

    /// `"resume of tag 'kv'"`.
    pub(super) fn what(&self) -> &str {
        &self.what
    }

    /// Per allocation, in the resume's order, whether it landed (its waits return).
    pub(super) fn landed_jobs(&self) -> Vec<bool> {
        let s = self.st.lock();
        (0..s.jobs.len()).map(|k| s.landed(k)).collect()
    }

    /// The allocations (address, size) that have not landed.
    pub(super) fn unlanded(&self) -> Vec<(DevPtr, u64)> {
        let s = self.st.lock();
        (0..s.jobs.len())
            .filter(|&k| !s.landed(k))
            .map(|k| s.jobs[k])
            .collect()
    }

    /// Whether the caller may have returned: a failure now is kept for later.
    pub(super) fn returned(&self) -> bool {
        self.st.lock().mapped
    }

    /// A panic unwinds through the restore: whether the caller may have returned (what was
    /// mapped must stay so). If not, it no longer returns before the thread ends, whatever the
    /// other devices map meanwhile: what was mapped is undone.
    pub(super) fn returned_else_hold(&self) -> bool {
        let mut s = self.st.lock();
        s.unwound |= !s.mapped;
        s.mapped
    }

    /// Its failure is kept with the allocations it left unrestored (called in the same
    /// transaction): waits ask those, not this tracker's outcome.
    pub(super) fn failure_kept(&self) {
        self.st.lock().kept = true;
    }

    /// An item of allocation `k` is copied (its copies' completion waited for); `landed` runs
    /// when that was its last, before anyone waiting for it is told (under this tracker's
    /// lock: it may take the registry's).
    pub(super) fn item_done(&self, k: usize, landed: impl FnOnce()) {
        let mut s = self.st.lock();
        s.left[k] = s.left[k].saturating_sub(1);
        if s.left[k] == 0 {
            landed();
            self.advance(&mut s);
            drop(s);
            self.cv.notify_all();
        }
    }

    fn advance(&self, s: &mut TrackState) {
        while s.prefix < s.jobs.len() && s.landed(s.prefix) {
            s.prefix += 1;
        }
        self.gate.raise(s.base.wrapping_add(s.prefix as u32));
    }

    /// Raise the gate to this resume's end: every stream waiting for it may go on. Called
    /// before the resume lets go of the operations lock, on every path.
    pub(super) fn open(&self) {
        let s = self.st.lock();
        if s.begun {
            self.gate.raise(s.end());
        }
    }

    /// The thread is done, with `r`.
    pub(super) fn finish(&self, r: Result<()>) {
        self.open();
        let mut s = self.st.lock();
        if s.done.is_none() {
            s.done = Some(r);
        }
        drop(s);
        self.cv.notify_all();
    }

    pub(super) fn finished(&self) -> bool {
        self.st.lock().done.is_some()
    }

    /// Whether data it promised is still on its way.
    pub(super) fn restoring(&self) -> bool {
        let s = self.st.lock();
        s.mapped && s.done.is_none() && !s.kept && s.prefix < s.jobs.len()
    }

    /// Wait until everything is mapped (`Ok`) or the resume ended before that (its result).
    pub(super) fn wait_mapped(&self) -> Result<()> {
        let mut s = self.st.lock();
        loop {
            if s.mapped {
                return Ok(());
            }
            if let Some(r) = &s.done {
                return match r {
                    Ok(()) => Ok(()),
                    Err(e) => Err(e.duplicate()),
                };
            }
            self.cv.wait(&mut s);
        }
    }

    /// Wait until allocation holding `ptr` (every one, if `None`) is restored or the resume
    /// ended, for at most `timeout`. `Ok(true)`: landed (or not part of this resume);
    /// `Ok(false)`: timed out; the resume's error if it failed before that allocation landed.
    pub(super) fn wait(&self, ptr: Option<DevPtr>, until: Option<Instant>) -> Result<bool> {
        self.wait_for(ptr, until, false)
    }

    /// Wait until every allocation is restored or the resume ended: its own caller, which must
    /// not return success for data that did not land, whatever became of a kept failure.
    pub(super) fn wait_all_own(&self) -> Result<()> {
        self.wait_for(None, None, true).map(|_| ())
    }

    /// The allocations it is restoring now (addresses): those not landed, while it runs and
    /// has not failed after returning (a failure kept is the allocations' from then on).
    pub(super) fn restoring_ptrs(&self) -> Vec<DevPtr> {
        let s = self.st.lock();
        if !s.begun || s.done.is_some() || s.kept {
            return Vec::new();
        }
        (0..s.jobs.len())
            .filter(|&k| !s.landed(k))
            .map(|k| s.jobs[k].0)
            .collect()
    }

    /// The allocations it restores (addresses).
    pub(super) fn ptrs(&self) -> Vec<DevPtr> {
        self.st.lock().jobs.iter().map(|j| j.0).collect()
    }

    fn wait_for(&self, ptr: Option<DevPtr>, until: Option<Instant>, own: bool) -> Result<bool> {
        let mut s = self.st.lock();
        loop {
            let landed = match ptr {
                // Not begun: its call has not returned, so nothing of it was promised yet.
                _ if !s.begun => true,
                None => s.prefix == s.jobs.len(),
                Some(p) => s.job_of(p).is_none_or(|k| s.landed(k)),
            };
            if landed {
                return Ok(true);
            }
            if let Some(r) = &s.done {
                return match r {
                    // Failed after it returned, its failure not kept with the allocations
                    // (`failure_kept` not called: no path skips it today, so a guard).
                    Err(e) if s.mapped && (own || !s.kept) => Err(e.duplicate()),
                    // Failed before it returned: the call reported it, nothing was promised.
                    // Or its failure is kept: the caller asks `Restores::failure_at`.
                    _ => Ok(true),
                };
            }
            match until {
                None => self.cv.wait(&mut s),
                Some(t) => {
                    if self.cv.wait_until(&mut s, t).timed_out() {
                        return Ok(false);
                    }
                }
            }
        }
    }

    /// The gate value that stands for the allocation holding `ptr` (all, if `None`) restored;
    /// `None` where there is nothing to wait for.
    pub(super) fn target(&self, ptr: Option<DevPtr>) -> Option<u32> {
        let s = self.st.lock();
        if !s.mapped || s.done.is_some() {
            return None;
        }
        match ptr {
            None => Some(s.end()),
            Some(p) => s
                .job_of(p)
                .filter(|&k| !s.landed(k))
                .map(|k| s.base.wrapping_add(k as u32 + 1)),
        }
    }
}

/// Opens the gate when a resume transaction ends in any way: a field of the transaction
/// (`txn.rs`), dropped before the operations lock is let go.
pub(super) struct OpenOnDrop<'t>(pub &'t Tracker);

impl Drop for OpenOnDrop<'_> {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Where a caller's work is queued: a device and one of its streams.
#[derive(Clone, Copy, Debug)]
pub struct StreamOf {
    pub device: i32,
    pub stream: Stream,
}

/// The non-blocking resumes of one engine: those not known finished, and those that failed
/// after they returned. Two leaf locks (Note [Locks]); `failed` is taken under the registry's
/// lock where it changes with it, so that the two are seen together.
#[derive(Default)]
pub(super) struct Restores {
    inflight: Mutex<Vec<Arc<Tracker>>>,
    failed: Mutex<Vec<FailedRestore>>,
}

impl Restores {
    /// Follow `t` until it is finished.
    pub fn track(&self, t: Arc<Tracker>) {
        self.inflight.lock().push(t);
    }

    /// Stop following `t` (its thread never started).
    pub fn untrack(&self, t: &Arc<Tracker>) {
        self.inflight.lock().retain(|x| !Arc::ptr_eq(x, t));
    }

    /// Stop following those finished.
    pub fn forget_finished(&self) {
        self.inflight.lock().retain(|x| !x.finished());
    }

    /// Those not known finished, to wait on with no lock held.
    pub fn trackers(&self) -> Vec<Arc<Tracker>> {
        self.inflight.lock().clone()
    }

    /// Whether one that returned is still restoring data.
    pub fn restoring(&self) -> bool {
        self.inflight.lock().iter().any(|t| t.restoring())
    }

    /// Keep the failure of a non-blocking resume after its caller returned with the
    /// allocations (address, size) it left unrestored. With none (everything landed first),
    /// it is kept until the next wait for everything raises it, once (`FailedRestore::landed`).
    pub fn keep_failure(&self, e: &Error, allocs: impl Iterator<Item = (DevPtr, u64)>) {
        let allocs: BTreeMap<DevPtr, u64> = allocs.collect();
        self.failed.lock().push(FailedRestore {
            error: e.duplicate(),
            landed: allocs.is_empty(),
            allocs,
            reported: false,
        });
    }

    /// The kept failures concerning the allocation holding `ptr` (every one, if `None`), now
    /// reported: a wait for everything concerns each, and raises each, not only the first.
    pub fn failure_at(&self, ptr: Option<DevPtr>) -> Option<Error> {
        self.raise(ptr, |_| true)
    }

    /// [`Restores::failure_at`] for a wait that timed out: only the failures no resume in
    /// flight can end, those concerning an allocation (the one holding `ptr`, or any if
    /// `None`) that none of them is restoring. They are known, and their data does not land
    /// however long one waits; the others end as a resume restores their allocations.
    pub fn failure_at_after_timeout(&self, ptr: Option<DevPtr>) -> Option<Error> {
        // Asked before `failed` is taken: a tracker's lock may lead to it, never the reverse.
        let busy: BTreeSet<DevPtr> = self
            .trackers()
            .iter()
            .flat_map(|t| t.restoring_ptrs())
            .collect();
        self.raise(ptr, |f| match ptr {
            None => f.landed || f.allocs.keys().any(|a| !busy.contains(a)),
            Some(p) => f.start_of(p).is_some_and(|a| !busy.contains(&a)),
        })
    }

    /// The kept failures concerning `ptr` that `raised` picks, now reported, joined in one.
    fn raise(&self, ptr: Option<DevPtr>, raised: impl Fn(&FailedRestore) -> bool) -> Option<Error> {
        let mut failed = self.failed.lock();
        let mut out: Option<Error> = None;
        for f in failed.iter_mut().filter(|f| f.holds(ptr) && raised(f)) {
            f.reported = true;
            out = Some(match out {
                None => f.error.duplicate(),
                Some(e) => e.note(format!("and: {}", f.error)),
            });
        }
        // Nothing of theirs is unrestored: raised once, there is nothing left to wait for.
        failed.retain(|f| !(f.landed && f.reported));
        out
    }

    /// A pause or resume is to act on the allocations at `ptrs`: the first kept failure
    /// concerning them that nothing reported yet, now reported (the operation acts, then
    /// raises it: the program ran work on contents that never landed, and must learn it).
    pub fn unreported(&self, ptrs: impl Iterator<Item = DevPtr>) -> Option<Error> {
        let mut failed = self.failed.lock();
        if failed.is_empty() {
            return None;
        }
        let mut out: Option<Error> = None;
        for p in ptrs {
            for f in failed.iter_mut().filter(|f| !f.reported) {
                if f.allocs.contains_key(&p) {
                    f.reported = true;
                    out.get_or_insert_with(|| f.error.duplicate());
                }
            }
        }
        out
    }

    /// A failure kept for an allocation is over once a pause has it paused with nothing left
    /// mapped (a `failed` pause too, for what it gave back whole): settled for those of `ptrs`
    /// (allocations the pause acted on), once its transaction settled them.
    pub fn settle_given_back(&self, registry: &Registry, ptrs: Vec<DevPtr>, failed: bool) {
        // Under the registry's lock, as `stats` reads them together.
        let reg = registry.lock();
        let clean = ptrs.into_iter().filter(|p| {
            reg.allocs
                .get(p)
                .is_some_and(|a| a.stuck.is_empty() && (!failed || a.state == State::Paused))
        });
        self.settle(clean);
    }

    /// The allocations at `ptrs` were paused, resumed or freed: no longer unrestored.
    pub fn settle(&self, ptrs: impl Iterator<Item = DevPtr>) {
        let mut failed = self.failed.lock();
        if failed.is_empty() {
            return;
        }
        for p in ptrs {
            for f in failed.iter_mut() {
                f.allocs.remove(&p);
            }
        }
        // One whose data all landed concerns no allocation: a wait for everything ends it.
        failed.retain(|f| !f.allocs.is_empty() || f.landed);
    }

    /// Each kept failure's message, with the addresses of the allocations it concerns.
    pub fn failures(&self) -> Vec<(String, Vec<DevPtr>)> {
        self.failed
            .lock()
            .iter()
            .map(|f| (f.error.to_string(), f.allocs.keys().copied().collect()))
            .collect()
    }
}

/// A pause's or resume's own failure, with an earlier non-blocking resume's failure it was to
/// report (`Restores::unreported`).
pub(super) fn with_earlier(e: Error, earlier: Option<Error>) -> Error {
    match earlier {
        Some(first) => e.context(format!("{first}; then")),
        None => e,
    }
}

/// A pause or resume that succeeded: its report, or the earlier non-blocking resume's failure it
/// was to report, now `reported by` what `by` says.
pub(super) fn reported_by(
    report: OpReport,
    earlier: Option<Error>,
    by: impl FnOnce() -> String,
) -> Result<OpReport> {
    match earlier {
        Some(e) => Err(e.context(format!("reported by {}", by()))),
        None => Ok(report),
    }
}

/// A non-blocking resume that failed after its caller returned (Note [Non-blocking resume]).
struct FailedRestore {
    error: Error,
    /// The allocations (address, size) it left unrestored that are still so.
    allocs: BTreeMap<DevPtr, u64>,
    /// A wait, pause or resume raised it.
    reported: bool,
    /// Everything it restored landed before it failed (a panic while giving back host
    /// memory, say): it left nothing unrestored, so only a wait for everything raises it, and
    /// only once, as nothing is left for a later wait to be about.
    landed: bool,
}

impl FailedRestore {
    fn holds(&self, ptr: Option<DevPtr>) -> bool {
        match ptr {
            None => true,
            Some(p) => self.start_of(p).is_some(),
        }
    }

    /// The address of the allocation it left unrestored that holds `p`.
    fn start_of(&self, p: DevPtr) -> Option<DevPtr> {
        self.allocs
            .range(..=p)
            .next_back()
            .filter(|(&start, &size)| holds(start, size, p))
            .map(|(&start, _)| start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn tracker() -> Tracker {
        let word: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(7)));
        let t = Tracker::new(Gate::new(word, 0x1000), "resume of tag 'kv'".into());
        t.begin(
            vec![(0x10_0000, 4096, 4096, 2), (0x20_0000, 4096, 4096, 1)],
            1,
            None,
        );
        t
    }

    fn failure() -> Error {
        Error::internal("restoring chunk 0: injected".to_string())
    }

    #[test]
    fn a_kept_failure_is_for_the_registry_to_raise_not_the_tracker() {
        // The race CI once met: a pause settled the allocations between the transaction's end
        // and the thread recording its outcome; a wait then must not raise the failure again.
        let t = tracker();
        t.device_mapped();
        assert!(t.restoring());
        t.failure_kept();
        assert!(!t.restoring(), "its data is not on its way any more");
        t.finish(Err(failure()));
        assert!(t.wait(None, None).unwrap());
        assert!(t.wait(Some(0x10_0000), None).unwrap());
        let own = t.wait_all_own().unwrap_err().to_string();
        assert!(own.contains("injected"), "{own}");
        assert_eq!(t.ptrs(), vec![0x10_0000, 0x20_0000]);
    }

    #[test]
    fn a_failure_after_the_return_not_kept_is_raised_by_every_wait() {
        let t = tracker();
        t.device_mapped();
        t.finish(Err(failure()));
        for _ in 0..2 {
            assert!(t
                .wait(None, None)
                .unwrap_err()
                .to_string()
                .contains("injected"));
            assert!(t.wait(Some(0x20_0000), None).is_err());
        }
        assert!(
            t.wait(Some(0x30_0000), None).unwrap(),
            "not one of its allocations"
        );
    }

    #[test]
    fn a_failure_that_left_nothing_unrestored_is_raised_once_by_a_wait_for_everything() {
        let r = Restores::default();
        r.keep_failure(&failure(), std::iter::empty());
        r.settle([0x10_0000].into_iter());
        assert!(
            r.unreported([0x10_0000].into_iter()).is_none(),
            "no allocation's"
        );
        assert!(r.failure_at(Some(0x10_0000)).is_none());
        assert_eq!(
            r.failures().len(),
            1,
            "kept, though it concerns no allocation"
        );
        let e = r
            .failure_at_after_timeout(None)
            .expect("a settle does not end it unsaid");
        assert!(e.to_string().contains("injected"), "{e}");
        assert!(r.failure_at(None).is_none(), "raised once");
        assert!(r.failures().is_empty());
        // One kept for an allocation is raised every time, beside it.
        r.keep_failure(&failure(), std::iter::empty());
        r.keep_failure(&failure(), [(0x10_0000, 4096)].into_iter());
        assert!(r.failure_at(None).unwrap().to_string().contains("and:"));
        let again = r.failure_at(None).unwrap().to_string();
        assert_eq!(again.matches("injected").count(), 1, "{again}");
    }

    #[test]
    fn a_failure_before_the_return_promised_nothing() {
        let t = tracker();
        t.finish(Err(failure()));
        assert!(t.wait(None, None).unwrap());
        assert!(t.wait_all_own().is_ok());
        assert!(t
            .wait_mapped()
            .unwrap_err()
            .to_string()
            .contains("injected"));
    }

    #[test]
    fn the_gate_follows_the_restored_prefix_and_opens_at_the_end() {
        let t = tracker();
        assert_eq!(t.gate.value(), 7);
        t.device_mapped();
        t.item_done(1, || {});
        assert_eq!(t.gate.value(), 7, "the second landed, the first not");
        t.item_done(0, || {});
        assert_eq!(t.gate.value(), 7, "one of the first's two items left");
        let landed = std::cell::Cell::new(false);
        t.item_done(0, || landed.set(true));
        assert!(landed.get());
        assert_eq!(t.gate.value(), 9);
        assert!(t.wait(None, Some(Instant::now())).unwrap());
        t.finish(Ok(()));
        assert!(t.finished());
    }
}
