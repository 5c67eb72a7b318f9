//! The resume transaction (Note [Pause and resume as transactions] in `mod.rs`; what it holds:
//! Note [Transactions] in `txn.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::background::GiveBack;
use super::base::Engine;
use super::devices::{by_device, device_work, first_error, per_device};
use super::digests::Restored;
use super::pipeline::{CopyConfig, Dir, Item, Pipeline, Target};
use super::progress::{Backings, Phase, Which};
use super::registry::{Allocation, Pick};
use super::report::{OpReport, Tally};
use super::restoring::{holds, reported_by, with_earlier, Tracker};
use super::segment::{self, Mapping, Span};
use super::txn::{Slots, Txn};
use super::types::{BufferRanges, State};
use crate::backup::{backing_of, DiskFile, HostBuffer};
use crate::driver::{DevPtr, DeviceScope, Driver, PhysHandle};
use crate::error::{Changed, Error, Result, ResultExt};
use crate::units::human;

/// One allocation in a resume, copied out of the registry (which marks it Resuming meanwhile).
struct Job {
    ptr: DevPtr,
    size: u64,
    tag: Arc<str>,
    /// The segments to resume, in runs of consecutive ones that the backup holds (or not).
    runs: Vec<(Span, bool)>,
    /// The indices of those segments; the chunk indices of a chunked allocation.
    segs: Vec<usize>,
    chunked: bool,
    /// Segments left mapped by an earlier failed resume (index and where): unmapped first.
    stuck: Vec<(usize, Span)>,
    /// The snapshot to copy back, if the allocation has one and a run copies from it (these
    /// three are set only then).
    host: Option<Arc<HostBuffer>>,
    /// Or the file holding it.
    disk: Option<Arc<DiskFile>>,
    /// Its backup is a file (a host buffer is preferred where it has both, as by the copies).
    on_disk: bool,
    device: i32,
    /// Bytes copied back into each run.
    copied: Vec<u64>,
}

impl Job {
    /// What the resume of segments `segs` of the allocation at `ptr` needs, copied out of its
    /// entry, which the registry marks Resuming meanwhile.
    fn marked(ptr: DevPtr, a: &Allocation, segs: Vec<usize>) -> Job {
        let span = a.span(ptr);
        let mut runs: Vec<(Span, bool)> = Vec::new();
        for (first, n) in segment::runs(&segs) {
            // Split where the backup starts or stops holding the contents.
            let mut k = first;
            while k < first + n {
                let saved = a.saved[k];
                let mut e = k + 1;
                while e < first + n && a.saved[e] == saved {
                    e += 1;
                }
                runs.push((span.sub(k, e - k), saved));
                k = e;
            }
        }
        let any_saved = runs.iter().any(|r| r.1);
        let backed = a.host.is_some() || a.disk.is_some();
        let copied = runs
            .iter()
            .map(|(s, saved)| {
                if *saved && backed {
                    s.backed(ptr, a.size)
                } else {
                    0
                }
            })
            .collect();
        Job {
            ptr,
            size: a.size,
            tag: a.tag.clone(),
            runs,
            segs,
            chunked: a.chunk > 0,
            stuck: a.stuck.iter().map(|&s| (s, span.sub(s, 1))).collect(),
            host: a.host.clone().filter(|_| any_saved),
            disk: a.disk.clone().filter(|_| any_saved),
            device: span.device,
            on_disk: any_saved && a.host.is_none() && a.disk.is_some(),
            copied,
        }
    }

    fn target(&self, r: usize) -> Option<Target<'_>> {
        backing_of(&self.host, &self.disk).filter(|_| self.runs[r].1)
    }

    /// Bytes of the allocation this job resumes, within its asked size: its segments (chunks)
    /// paused, not the whole allocation where others are active.
    fn restored_bytes(&self) -> u64 {
        self.runs
            .iter()
            .map(|(s, _)| s.backed(self.ptr, self.size))
            .sum()
    }

    /// Bytes the copy pipeline moves for this job.
    fn pipeline_bytes(&self) -> u64 {
        (0..self.runs.len())
            .map(|r| Item::over(self.ptr, &self.runs[r].0, self.target(r)).copy_bytes())
            .sum()
    }
}

/// The mappings a resume made: (job, run, mapping).
type Made<'d> = Vec<(usize, usize, Mapping<'d>)>;

/// Release the handles of what `made` mapped, leaving it mapped (its memory goes once it is
/// unmapped): the segments (allocation, index) to record stuck.
fn release_mapped(d: &dyn Driver, jobs: &[Job], made: Made<'_>) -> Vec<(DevPtr, usize)> {
    let mut stuck = Vec::new();
    for (i, r, m) in made {
        let (j, span) = (&jobs[i], jobs[i].runs[r].0);
        let first = span.first_segment(j.ptr);
        for (k, h) in m.commit().into_iter().enumerate() {
            if let Err(e) = d.release(h) {
                tracing::error!("releasing handle {:#x} of {:#x}: {e}", h.0, j.ptr);
            }
            stuck.push((j.ptr, first + k));
        }
    }
    stuck
}

/// One device's mappings while a resume makes them. Dropped still holding some, which happens
/// only on an unwind (a panic, a bug: they are taken out otherwise), they are undone (and a
/// non-blocking resume's caller then does not return), unless the resume is a non-blocking one
/// whose caller may have returned: work it queued behind the gate may use this memory, and
/// unmapping it would fault that work (on a GPU, the process).
/// So it stays mapped, as after a failure (`Engine::keep_mapped`), recorded stuck for the free
/// (or pause, or resume) that synchronizes before it unmaps. Not `std::thread::panicking`: a
/// device's share that ended well is dropped by whichever thread ends the unwind.
struct KeepIfReturned<'e, 'j> {
    engine: &'e Engine,
    jobs: &'j [Job],
    track: Option<&'j Tracker>,
    made: Made<'e>,
}

impl<'e> KeepIfReturned<'e, '_> {
    /// The mappings, now the caller's.
    fn take(mut self) -> Made<'e> {
        std::mem::take(&mut self.made)
    }
}

impl Drop for KeepIfReturned<'_, '_> {
    fn drop(&mut self) {
        if self.made.is_empty() || !self.track.is_some_and(Tracker::returned_else_hold) {
            return; // dropped, `made` undoes its mappings
        }
        // The gate stays closed: other devices may still be restoring (the transaction opens
        // it once they stopped). Releasing a handle waits for no device work.
        let made = std::mem::take(&mut self.made);
        let stuck = release_mapped(&*self.engine.driver, self.jobs, made);
        let mut reg = self.engine.registry.lock();
        for (p, s) in stuck {
            // Not `Index::marked`: a panic while unwinding aborts the process.
            match reg.allocs.get_mut(&p) {
                Some(a) => a.stuck.push(s),
                None => tracing::error!("{p:#x} left mapped, but no longer in the registry"),
            }
        }
    }
}

/// What a resume's commit did: its numbers, and what it leaves to give back once the locks are
/// let go.
#[derive(Default)]
struct Committed {
    tally: Tally,
    /// Retention was on when the commit read it: backups (and staging slots) are kept.
    retain: bool,
    /// Host backups no longer needed (no retention).
    released: Vec<Arc<HostBuffer>>,
    /// Host memory of chunks resumed without retention, in buffers their paused neighbours
    /// still need: given back once nothing else holds the buffer.
    drop_pages: Vec<BufferRanges>,
}

/// What stays paused after a failed resume, for its message.
fn stays(jobs: &[Job]) -> String {
    let chunked: Vec<String> = jobs
        .iter()
        .filter(|j| j.chunked)
        .map(|j| {
            format!(
                "{} of allocation {:#x}",
                crate::units::ranges(&j.segs),
                j.ptr
            )
        })
        .collect();
    if chunked.is_empty() {
        "it stays paused with its backups".into()
    } else {
        format!(
            "what it was to resume stays paused with its backups: {}",
            chunked.join("; ")
        )
    }
}

impl Engine {
    /// Resume every paused allocation of `tag` (all tags if `None`) at the same addresses.
    pub fn resume(&self, tag: Option<&str>) -> Result<OpReport> {
        self.resume_pick(&Pick::tag(tag))
    }

    /// Resume what `pick` names: the paused segments (chunks) of the allocations it selects, at
    /// the same addresses, and NCCL's communicators where it names their tag (`comms.rs`).
    pub fn resume_pick(&self, pick: &Pick<'_>) -> Result<OpReport> {
        self.with_comms_of(Which::Resume, pick, || self.resume_ordered(pick, &[], None))
    }

    /// The resume transaction, restoring first the allocations holding the addresses in
    /// `order` (in that order), the others after them; `track` follows a non-blocking resume
    /// (Note [Non-blocking resume] in `inflight.rs`).
    pub(super) fn resume_ordered(
        &self,
        pick: &Pick<'_>,
        order: &[DevPtr],
        track: Option<&Tracker>,
    ) -> Result<OpReport> {
        let mut tx = Txn::begin(&self.ops, &self.registry, Which::Resume, pick, track)
            .map_err(Error::unchanged)?;
        let cfg = self.settings.copy();
        let mut jobs = tx
            .mark(pick, |reg| {
                reg.begin(
                    State::Resuming,
                    |ptr, a| pick.segments_to_resume(ptr, a),
                    |ptr, a, segs| Job::marked(ptr, a, segs),
                )
            })
            .map_err(Error::unchanged)?;
        if !order.is_empty() {
            let rank = |j: &Job| {
                order
                    .iter()
                    .position(|&p| holds(j.ptr, j.size, p))
                    .unwrap_or(order.len())
            };
            jobs.sort_by_key(rank);
        }
        // A non-blocking resume's failure that nothing reported, on allocations this one
        // restores: raised once they are (by the caller of a non-blocking one once mapped).
        let mut earlier = self.restores.unreported(jobs.iter().map(|j| j.ptr));
        if let Some(t) = track {
            let devices = by_device(jobs.iter().map(|j| j.device)).len();
            t.begin(
                jobs.iter()
                    .map(|j| (j.ptr, j.size, j.restored_bytes(), j.runs.len()))
                    .collect(),
                devices,
                earlier.take(),
            );
        }
        let done = match self.restore_jobs(&mut tx, &cfg, pick, track, jobs) {
            Ok(done) => done,
            // Undone (nothing changed), unless a non-blocking one failed after it returned:
            // what landed is resumed.
            Err(e) => return Err(with_earlier(e, earlier).with_changed(tx.changed())),
        };
        // Said only where it returns an error (reporting an earlier failure), so counted only then.
        let changed = if earlier.is_some() {
            tx.changed()
        } else {
            Changed::NOTHING
        };
        let slots = if done.retain || cfg.keep_staging {
            Slots::KeepIfUsed
        } else {
            Slots::Take
        };
        let report = tx.end(slots, done.tally, |rings, progress| {
            // A leased buffer is its holder's to free (its memory goes with the lease): only
            // our reference goes, and the release waits for no one but holders of a moment.
            let released = self.leases.unleased(done.released);
            if track.is_some() && !released.is_empty() {
                progress.phase(Phase::Releasing);
            }
            let g = GiveBack {
                released,
                drop_pages: self.leases.unread(done.drop_pages),
                with: (!rings.is_empty()).then_some(rings),
                threads: cfg.threads,
            };
            // A blocking resume's caller does not wait for it (Note [Releases]); a non-blocking
            // one's thread does it, after the gate opened.
            self.ops.releases.give_back(g, track.is_some())
        });
        tracing::info!(
            "resumed {} ({} allocations){} in {:.3}s ({:.3}s releasing host memory)",
            human(report.bytes),
            report.allocations,
            report.copies(false),
            report.seconds,
            report.release_seconds
        );
        reported_by(report, earlier, || {
            format!(
                "this resume of {}, which has restored them",
                pick.describe()
            )
        })
        .map_err(|e| e.with_changed(changed))
    }

    /// Resume what `pick` names within `tx`, a pause that failed part-way through it and holds
    /// it still (`Txn::remark`): no other transaction, nor a free, comes between that pause and
    /// this restore. What it gives back goes as a blocking resume's does (Note [Releases]).
    pub(super) fn resume_within(
        &self,
        tx: &mut Txn<'_>,
        cfg: &CopyConfig,
        pick: &Pick<'_>,
    ) -> Result<()> {
        let jobs = tx.remark(|reg| {
            reg.begin(
                State::Resuming,
                |ptr, a| pick.segments_to_resume(ptr, a),
                |ptr, a, segs| Job::marked(ptr, a, segs),
            )
        });
        let done = self.restore_jobs(tx, cfg, pick, None, jobs)?;
        self.give_back_committed(done.released, done.drop_pages, cfg.threads);
        Ok(())
    }

    /// Give back, with the operations lock still held, the host memory a commit within a
    /// transaction no longer needs: the backups no lease holds, the pages nobody reads (the
    /// page-locked ones on a thread, as after a blocking resume: Note [Releases]). How long
    /// the part done here took.
    fn give_back_committed(
        &self,
        released: Vec<Arc<HostBuffer>>,
        drop_pages: Vec<BufferRanges>,
        threads: usize,
    ) -> f64 {
        let g = GiveBack {
            released: self.leases.unleased(released),
            drop_pages: self.leases.unread(drop_pages),
            with: None::<()>,
            threads,
        };
        self.ops.releases.give_back(g, false)
    }

    /// The work of a resume on the jobs it marked, which go when it returns (and with them the
    /// copies' references to backups, so that the release that follows sees which buffers only
    /// it holds): check the files, unmap what failed resumes left mapped, map and restore each
    /// device's share, commit. Its error is the resume's, saying what stays paused.
    fn restore_jobs(
        &self,
        tx: &mut Txn<'_>,
        cfg: &CopyConfig,
        pick: &Pick<'_>,
        track: Option<&Tracker>,
        jobs: Vec<Job>,
    ) -> Result<Committed> {
        // A check that cannot be made, or a file that is gone or cut short, fails the resume
        // before anything is mapped.
        let present = verifiable(pick, &jobs)
            .and_then(|()| self.ready_to_verify(pick, track, &jobs))
            .and_then(|()| {
                jobs.iter()
                    .filter_map(|j| j.disk.as_ref())
                    .try_for_each(|f| f.check_present())
            });
        if let Err(e) = present.and_then(|()| self.unmap_stuck(&jobs)) {
            self.settle_unstuck(&jobs);
            return Err(e.context(format!("resume of {} ({})", pick.describe(), stays(&jobs))));
        }
        let verified: Vec<AtomicU64> = jobs.iter().map(|_| AtomicU64::new(0)).collect();
        let checks = (pick.verify, verified.as_slice());
        let (made, result) = self.restore_devices(&jobs, tx, cfg, track, checks);
        if let (Err(e), Some(t)) = (&result, track.filter(|t| t.returned())) {
            // The caller returned and may have work queued on this memory: it stays mapped. The
            // gate opens first: releasing handles is a driver call, and none may wait for work
            // that waits for this restore.
            t.open();
            let e = e.duplicate().context(format!(
                "the non-blocking {} failed after it returned: its data did not land, and work \
                 queued after it ran on other contents. Its allocations stay paused with their \
                 backups, their memory mapped until a pause gives it back or a resume restores \
                 them",
                t.what()
            ));
            // What landed is restored: its waits said so, and the program may have written it
            // since. Those allocations are committed; the failure belongs to the others.
            let landed = t.landed_jobs();
            let (done_made, kept_made): (Made<'_>, Made<'_>) =
                made.into_iter().partition(|m| landed[m.0]);
            self.keep_mapped(&jobs, kept_made, &e, &|i| !landed[i]);
            t.failure_kept();
            let done = self.commit(&jobs, done_made, pick, &|i| landed[i]);
            drop(jobs);
            let release_seconds =
                self.give_back_committed(done.released, done.drop_pages, cfg.threads);
            // What landed changed state: the tags' last resume says so.
            tx.record_failed(done.tally, release_seconds);
            return Err(e);
        }
        if let Err(e) = result {
            let stuck = self.undo(&jobs, made);
            self.settle_unstuck(&jobs);
            return Err(e.context(format!(
                "resume of {} (undone: {}{stuck})",
                pick.describe(),
                stays(&jobs)
            )));
        }
        let mut done = self.commit(&jobs, made, pick, &|_| true);
        for (j, bytes) in jobs.iter().zip(&verified) {
            match bytes.load(Ordering::Relaxed) {
                0 => {}
                b => done.tally.verified(&j.tag, b),
            }
        }
        tx.pin_later(
            cfg,
            done.retain,
            jobs.iter().filter_map(|j| Some((j.ptr, j.host.as_ref()?))),
        );
        Ok(done)
    }

    /// Record in the progress what the copies move; then per device, in parallel: map
    /// each run of segments, and copy its backup back while the next one is mapped. All or
    /// nothing: on any failure the caller undoes the mappings made (returned even then), and
    /// the allocations stay paused with their backups.
    fn restore_devices<'d>(
        &'d self,
        jobs: &[Job],
        tx: &mut Txn<'_>,
        cfg: &CopyConfig,
        track: Option<&Tracker>,
        (asked, verified): (bool, &[AtomicU64]),
    ) -> (Made<'d>, Result<()>) {
        let backings = Backings {
            host: jobs.iter().any(|j| j.host.is_some()),
            disk: jobs.iter().any(|j| j.on_disk),
        };
        let (rings, tracked) = tx.work();
        tracked.prepared(jobs.iter().map(Job::pipeline_bytes).sum(), backings);
        let progress = tracked.counters();
        progress.phase(Phase::Mapping);
        let groups = by_device(jobs.iter().map(|j| j.device));
        let d = &*self.driver;
        let work = device_work(&groups, rings);
        let results = per_device(work, |(device, list, ring)| {
            let parts: Vec<(usize, usize)> = list
                .iter()
                .flat_map(|&i| (0..jobs[i].runs.len()).map(move |r| (i, r)))
                .collect();
            let items: Vec<Item<'_>> = parts
                .iter()
                .map(|&(i, r)| Item::over(jobs[i].ptr, &jobs[i].runs[r].0, jobs[i].target(r)))
                .collect();
            let mut made = KeepIfReturned {
                engine: self,
                jobs,
                track,
                made: Vec::with_capacity(parts.len()),
            };
            let r = DeviceScope::enter(d, device).and_then(|_scope| {
                Pipeline {
                    driver: &self.driver,
                    device,
                    dir: Dir::Restore,
                    cfg,
                    ring,
                    items: &items,
                    progress,
                    lock_pages_first: track.is_some(),
                }
                .run(
                    |p, mapped| {
                        let (i, r) = parts[p];
                        let j = &jobs[i];
                        let span = j.runs[r].0;
                        let off = span.ptr - j.ptr;
                        let mut m = Mapping::new(d, span);
                        let res = m.map_all(&|b| mapped(off + b));
                        // Kept even when incomplete: workers may be copying into the
                        // segments made, so they are undone only after the pipeline stops.
                        made.made.push((i, r, m));
                        res.ctx(|| {
                            format!(
                                "allocation {:#x} ({} bytes, tag {:?})",
                                j.ptr, j.size, j.tag
                            )
                        })?;
                        if let Some(t) = track.filter(|_| p + 1 == parts.len()) {
                            // This device's share is mapped, its contents on their way: shown
                            // so before the caller may return (landed ones stay landed).
                            let mut reg = self.registry.lock();
                            for &i in list {
                                let j = &jobs[i];
                                let a = reg.marked(j.ptr);
                                a.arriving.get_or_insert_with(|| (j.segs.clone(), false));
                            }
                            drop(reg);
                            t.device_mapped();
                        }
                        Ok(())
                    },
                    |p| {
                        // What came back is checked before anyone is told it landed (Note
                        // [Skipping unchanged memory]): a difference fails the resume.
                        let (i, r) = parts[p];
                        let j = &jobs[i];
                        if let (Some(host), true) = (j.host.as_deref(), j.runs[r].1) {
                            let run = Restored {
                                device,
                                ptr: j.ptr,
                                size: j.size,
                                tag: &j.tag,
                                span: j.runs[r].0,
                                host,
                            };
                            let bytes = self.verify_run(&run, asked)?;
                            verified[i].fetch_add(bytes, Ordering::Relaxed);
                        }
                        if let Some(t) = track {
                            t.item_done(i, || {
                                self.registry.marked(j.ptr, |a| {
                                    a.arriving = Some((j.segs.clone(), true));
                                    // Restored: an earlier failure kept for it is over now,
                                    // before any wait is told it landed (under the registry
                                    // lock, as `stats` reads them together).
                                    self.restores.settle(std::iter::once(j.ptr));
                                });
                            });
                        }
                        Ok(())
                    },
                )
            });
            (made, r)
        });
        let mut made = Vec::new();
        let result = first_error(results.into_iter().map(|(m, r)| {
            made.extend(m.take());
            r
        }));
        (made, result)
    }

    /// Record every allocation resumed Active (or Partial) with its new handles, in one step
    /// under the registry lock; without retention (read now) its backup is no longer a
    /// snapshot, and what is to be given back is returned. Only the jobs `only` names (`made`
    /// holds theirs alone).
    fn commit(
        &self,
        all: &[Job],
        made: Made<'_>,
        pick: &Pick<'_>,
        only: &dyn Fn(usize) -> bool,
    ) -> Committed {
        let retain = self.settings.retain();
        let mut tally = Tally::default();
        for &(i, r, _) in &made {
            let j = &all[i];
            tally.bytes(&j.tag, j.runs[r].0.mapped, j.copied[r], j.on_disk);
        }
        let jobs: Vec<&Job> = (0..all.len())
            .filter(|&i| only(i))
            .map(|i| &all[i])
            .collect();
        for j in &jobs {
            tally.allocation(&j.tag);
        }
        // The new handles, each run's with the index of its first segment.
        let handles: Vec<(usize, usize, Vec<PhysHandle>)> = made
            .into_iter()
            .map(|(i, r, m)| (i, all[i].runs[r].0.first_segment(all[i].ptr), m.commit()))
            .collect();
        let mut left = Committed {
            tally,
            retain,
            ..Committed::default()
        };
        let mut reg = self.registry.lock();
        // Restored: no longer unrestored (under this lock, as `stats` reads them together).
        self.restores.settle(jobs.iter().map(|j| j.ptr));
        for (i, first, hs) in handles {
            let a = reg.marked(all[i].ptr);
            for (k, h) in hs.into_iter().enumerate() {
                a.handles[first + k] = Some(h);
            }
        }
        if pick.chunk_state {
            // A record is used once, by the allocations that had nothing to resume too (all
            // their recorded chunks active already, or none recorded active): a later restore
            // never falls back on it instead of a newer pause's.
            for (ptr, a) in reg.allocs.iter_mut() {
                if pick.selects(*ptr, a) {
                    a.kept[pick.record.index()] = None;
                }
            }
        }
        for j in &jobs {
            let a = reg.marked(j.ptr);
            a.state = a.settled();
            a.arriving = None;
            // A retained backup stays a complete snapshot (of the last pause).
            if !retain {
                for &s in &j.segs {
                    a.saved[s] = false;
                }
                // Paused chunks still need it.
                if a.state == State::Active {
                    if let Some(h) = a.host.take() {
                        left.released.push(h);
                        // Chunks resumed earlier with retention were a snapshot in it: gone
                        // with it (a file, where there is one, still holds theirs).
                        if a.disk.is_none() {
                            a.saved.fill(false);
                        }
                    }
                } else if let Some(h) = &a.host {
                    let ranges = j.runs.iter().map(|(s, _)| (s.ptr - j.ptr, s.mapped));
                    left.drop_pages.push((h.clone(), ranges.collect()));
                }
            }
        }
        drop(reg);
        self.registry.notify_settled();
        left
    }

    /// Unmap and release what a failed resume made. A segment that cannot be unmapped stays
    /// paused in the registry (its contents are in the backup, if any) and is recorded as stuck,
    /// for the next resume or the free to unmap; returns a note on them for the error.
    fn undo(&self, jobs: &[Job], made: Vec<(usize, usize, Mapping<'_>)>) -> String {
        {
            // Nothing it mapped is shown arriving or landed any more.
            let mut reg = self.registry.lock();
            for j in jobs {
                reg.marked(j.ptr).arriving = None;
            }
        }
        let mut stuck: Vec<(DevPtr, usize)> = Vec::new();
        for (i, r, m) in made {
            let (j, span) = (&jobs[i], jobs[i].runs[r].0);
            let first = span.first_segment(j.ptr);
            for off in m.undo() {
                stuck.push((j.ptr, first + (off / span.segment) as usize));
            }
        }
        if stuck.is_empty() {
            return String::new();
        }
        let mut reg = self.registry.lock();
        for &(p, s) in &stuck {
            reg.marked(p).stuck.push(s);
        }
        format!(
            "; {} segment(s) could not be unmapped while undoing and stay mapped, though paused, \
             until the next resume or free of their allocation",
            stuck.len()
        )
    }

    /// What a non-blocking resume that failed after returning made for the jobs `only` names
    /// (`made` holds theirs alone: those that had not landed) stays mapped, for the caller's
    /// queued work to find mapped memory: the handles are released (the memory goes
    /// once unmapped) and every segment is recorded stuck, for the next pause, resume or free
    /// to unmap. The allocations stay paused with their backups, and `e` is kept for them (in
    /// the same step, so that nobody sees one without the other).
    fn keep_mapped(
        &self,
        jobs: &[Job],
        made: Made<'_>,
        e: &crate::error::Error,
        only: &dyn Fn(usize) -> bool,
    ) {
        let stuck = release_mapped(&*self.driver, jobs, made);
        let kept: Vec<&Job> = (0..jobs.len())
            .filter(|&i| only(i))
            .map(|i| &jobs[i])
            .collect();
        let mut reg = self.registry.lock();
        for (p, s) in stuck {
            reg.marked(p).stuck.push(s);
        }
        for j in &kept {
            reg.marked(j.ptr).arriving = None;
        }
        // This resume gave back what an earlier failure left mapped and restored them anew: a
        // failure kept for them before (reported: by a wait, or by this resume's caller) is
        // over, this one is theirs now.
        self.restores.settle(kept.iter().map(|j| j.ptr));
        self.restores
            .keep_failure(e, kept.iter().map(|j| (j.ptr, j.size)));
    }

    /// A non-blocking resume digests what it restores after its caller returned, while the
    /// caller's stream waits for it: the driver makes ready to digest (on CUDA, loading the
    /// kernel, which may wait for the device's queued work) before then, on each device where
    /// a run will be verified.
    fn ready_to_verify(
        &self,
        pick: &Pick<'_>,
        track: Option<&Tracker>,
        jobs: &[Job],
    ) -> Result<()> {
        if track.is_none() {
            return Ok(());
        }
        let checked =
            |j: &&Job| j.host.is_some() && (pick.verify || self.settings.checks.of(&j.tag).verify);
        let devices: std::collections::BTreeSet<i32> =
            jobs.iter().filter(checked).map(|j| j.device).collect();
        devices.into_iter().try_for_each(|d| {
            self.driver
                .prepare_digest(d)
                .ctx(|| format!("making ready to verify the restore on device {d}"))
        })
    }

    /// After a failed resume: allocations it leaves with nothing mapped (no stuck segment) are
    /// as a pause leaves them, so an earlier non-blocking resume's failure kept for them is
    /// settled (that failure was reported, by a wait or by this resume's error).
    fn settle_unstuck(&self, jobs: &[Job]) {
        let reg = self.registry.lock();
        let clear = jobs
            .iter()
            .filter(|j| reg.allocs.get(&j.ptr).is_some_and(|a| a.stuck.is_empty()));
        // Under the registry lock, as `stats` reads them together.
        self.restores.settle(clear.map(|j| j.ptr));
    }

    /// Unmap the segments an earlier failed resume left mapped, before mapping them again.
    fn unmap_stuck(&self, jobs: &[Job]) -> Result<()> {
        let d = &*self.driver;
        for j in jobs.iter().filter(|j| !j.stuck.is_empty()) {
            let _scope = DeviceScope::enter(d, j.device)?;
            // Work queued behind the failed restore may still use the memory.
            d.synchronize(j.device)
                .ctx(|| format!("synchronizing device {}", j.device))?;
            for &(s, seg) in &j.stuck {
                d.unmap(seg.ptr, seg.mapped).ctx(|| {
                    format!(
                        "unmapping {:#x} ({} bytes), left mapped by an earlier failed resume",
                        seg.ptr, seg.mapped
                    )
                })?;
                self.registry.marked(j.ptr, |a| a.stuck.retain(|x| *x != s));
            }
        }
        Ok(())
    }
}

/// A check the caller asked for (`Pick::verify`) compares with CPU backups: a resume from a
/// disk file is refused rather than left unchecked (the file's chunks are checked against their
/// checksums as they are read; a tag's own `verify` setting leaves them to that).
fn verifiable(pick: &Pick<'_>, jobs: &[Job]) -> Result<()> {
    match jobs.iter().find(|j| j.on_disk).filter(|_| pick.verify) {
        None => Ok(()),
        Some(j) => Err(crate::error::Error::unsupported(format!(
            "verifying the resume of allocation {:#x} (tag {:?}): it is restored from its disk \
             backup, whose chunks are checked against their checksums as they are read; a \
             verified resume compares with CPU backups. Resume without verifying",
            j.ptr, j.tag
        ))),
    }
}
