//! The pause transaction (Note [Pause and resume as transactions] in `mod.rs`; what it holds:
//! Note [Transactions] in `txn.rs`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::base::Engine;
use super::devices::{by_device, device_work, first_error, per_device};
use super::digests::Digested;
use super::pipeline::{CopyConfig, Dir, Item, Pipeline, Ring, Target};
use super::progress::{Backings, Counters, Phase, Tracked, Which};
use super::registry::{describe, Allocation, Pick};
use super::report::{OpReport, Tally};
use super::restoring::{reported_by, with_earlier};
use super::segment::{self, Span};
use super::txn::{Slots, Txn};
use super::types::{Backup, BufferRanges, State};
use crate::backup::{backing_of, disk, BackupKind, DiskFile, HostBuffer};
use crate::driver::{DevPtr, DeviceScope, PhysHandle};
use crate::error::{Changed, Error, Result, ResultExt};
use crate::units::human;

/// One allocation in a pause: what the work needs, copied out of the registry (which marks the
/// allocation Pausing meanwhile).
struct Job {
    ptr: DevPtr,
    size: u64,
    mapped: u64,
    tag: Arc<str>,
    backup: Backup,
    /// The segments to pause, in runs of consecutive ones, each with its handles.
    runs: Vec<(Span, Vec<PhysHandle>)>,
    /// The indices of those segments; the chunk indices of a chunked allocation.
    segs: Vec<usize>,
    chunked: bool,
    /// The buffer to copy into: a retained one nobody else holds, or one made for this pause.
    host: Option<Arc<HostBuffer>>,
    /// The file to write into (disk backups): the allocation's own, or one made for this pause.
    disk: Option<Arc<DiskFile>>,
    /// Chunk size of the file, if one is made.
    file_chunk: u64,
    /// The allocation's file holds the contents of segments that stay paused.
    file_needed: bool,
    /// Paused segments a failed resume left mapped (index and where): unmapped first.
    stuck: Vec<(usize, Span)>,
    device: i32,
    /// A buffer others hold that has the contents of the allocation's paused segments: copied
    /// (those byte ranges) into the new buffer before anything is paused.
    carry: Option<BufferRanges>,
}

impl Job {
    /// What the pause of segments `segs` of the allocation at `ptr` needs, copied out of its entry,
    /// which the registry marks Pausing meanwhile. A retained backup is reused only where nothing
    /// else holds it (a zero-copy view, a reader): a snapshot someone still looks at is never
    /// overwritten.
    fn marked(ptr: DevPtr, a: &mut Allocation, segs: Vec<usize>, cfg: &CopyConfig) -> Job {
        let span = a.span(ptr);
        // Segments a failed resume left mapped: paused already, their contents in the
        // backup; the pause only gives their memory back (`Engine::release_stuck`).
        let (stuck, segs): (Vec<usize>, Vec<usize>) =
            segs.into_iter().partition(|s| a.stuck.contains(s));
        let stuck: Vec<(usize, Span)> = stuck.into_iter().map(|s| (s, span.sub(s, 1))).collect();
        // What it is with nothing to pause but stuck segments: no backup work.
        let job = Job {
            ptr,
            size: a.size,
            mapped: a.mapped,
            tag: a.tag.clone(),
            backup: a.backup,
            runs: Vec::new(),
            segs: Vec::new(),
            chunked: a.chunk > 0,
            host: None,
            disk: None,
            file_chunk: 0,
            file_needed: true,
            carry: None,
            stuck,
            device: a.device,
        };
        if segs.is_empty() {
            return job;
        }
        for &s in &segs {
            a.saved[s] = false;
        }
        let reuse = a.backup.is_some_and(|b| {
            a.host
                .as_ref()
                .is_some_and(|h| h.backend() == b && h.len() == a.size && Arc::strong_count(h) == 1)
        });
        let mut carry = None;
        if !reuse {
            let replaced = a.host.is_some();
            // The old buffer stays the allocation's until the new one takes its place
            // (`prepare_backups`): a pause that fails before then loses none of what it holds.
            if let Some(old) = a.host.clone() {
                // Paused segments have their contents only there: carried over.
                let ranges: Vec<(u64, u64)> = (0..a.handles.len())
                    .filter(|&s| a.handles[s].is_none() && a.saved[s])
                    .map(|s| {
                        let sub = span.sub(s, 1);
                        (sub.ptr - ptr, sub.backed(ptr, a.size))
                    })
                    .collect();
                carry = (!ranges.is_empty()).then_some((old, ranges));
            }
            // Active segments' retained contents are not carried (nor held, where no
            // buffer is left and no file): no longer saved.
            if replaced || a.disk.is_none() {
                for s in 0..a.saved.len() {
                    a.saved[s] &= a.handles[s].is_none();
                }
            }
        }
        if a.backup != Some(BackupKind::Disk) {
            a.disk = None;
        }
        let file_needed = (0..a.handles.len()).any(|s| a.handles[s].is_none() && a.saved[s]);
        // Each run is released as soon as its copy is complete, so a large allocation gives
        // its memory back during the pause, not all at its end (Note [Pause and resume as
        // transactions]): a run is one segment, or for a chunked allocation (whose chunks
        // are its segments) at most the largest segment's worth of chunks. Without a
        // backup there is nothing to copy (and a part released could not be restored): one
        // run.
        let most = match (a.chunk > 0, a.backup.is_some()) {
            (true, _) => (segment::SEGMENT_BYTES / a.segment.max(1)) as usize,
            (false, true) => 1,
            (false, false) => usize::MAX,
        };
        let runs: Vec<(Span, Vec<PhysHandle>)> = segment::runs_of_at_most(&segs, most)
            .into_iter()
            .map(|(first, n)| {
                let hs = a.handles[first..first + n]
                    .iter()
                    .map(|h| h.expect("picked mapped segments"))
                    .collect();
                (span.sub(first, n), hs)
            })
            .collect();
        // A file's chunks (its unit of checksums) never straddle two runs: they divide the
        // chunks of a chunked allocation, the segments of any other.
        let file_chunk = cfg.file_chunk(if a.chunk > 0 { a.chunk } else { a.segment });
        Job {
            runs,
            file_chunk,
            segs,
            host: a.host.clone().filter(|_| reuse),
            disk: a.disk.clone(),
            file_needed,
            carry,
            ..job
        }
    }

    fn target(&self) -> Option<Target<'_>> {
        backing_of(&self.host, &self.disk)
    }

    fn backed_up(&self) -> bool {
        self.host.is_some() || self.disk.is_some()
    }

    /// Its backup is a file (a host buffer is preferred where it has both, as by the copies).
    fn on_disk(&self) -> bool {
        self.host.is_none() && self.disk.is_some()
    }

    /// Device bytes of the segments this job pauses.
    fn mapped_bytes(&self) -> u64 {
        (0..self.runs.len()).map(|r| self.run_bytes(r).0).sum()
    }

    /// Bytes the copy pipeline moves for this job.
    fn pipeline_bytes(&self) -> u64 {
        self.runs
            .iter()
            .map(|(span, _)| Item::over(self.ptr, span, self.target()).copy_bytes())
            .sum()
    }

    /// Device bytes of run `r`, and the bytes of it the backup holds.
    fn run_bytes(&self, r: usize) -> (u64, u64) {
        let s = &self.runs[r].0;
        let copied = if self.backup.is_some() {
            s.backed(self.ptr, self.size)
        } else {
            0
        };
        (s.mapped, copied)
    }

    /// Bytes the backup receives.
    fn copy_bytes(&self) -> u64 {
        (0..self.runs.len()).map(|r| self.run_bytes(r).1).sum()
    }

    fn what(&self, r: usize) -> String {
        let hs = &self.runs[r].1;
        format!(
            "allocation {:#x} ({} bytes, tag {:?}){}, handle {:#x}{}",
            self.ptr,
            self.size,
            self.tag,
            if self.chunked {
                format!(", {}", crate::units::ranges(&self.segs))
            } else {
                String::new()
            },
            hs.first().map_or(0, |h| h.0),
            match hs.len() {
                0 | 1 => String::new(),
                n => format!(" and {} more", n - 1),
            }
        )
    }
}

/// What a pause's work on its jobs did (`Engine::pause_jobs`).
struct Paused {
    /// Its outcome: the first failure stopped it.
    result: Result<()>,
    tally: Tally,
    /// Allocations (not chunked) it released only some segments of before it failed.
    part_paused: Vec<DevPtr>,
    /// Every allocation it marked, those with nothing left to pause included.
    touched: Vec<DevPtr>,
    /// When it began preparing backups, and how long after that it had prepared them and
    /// was done with the devices, for the log.
    t0: Instant,
    prepared_s: f64,
    devices_s: f64,
}

/// Of the host memory that is available, this share is left free (page cache, other
/// processes' growth): a pause may fill the rest.
const HOST_HEADROOM_DIVISOR: u64 = 16;

impl Engine {
    /// Pause every active allocation of `tag` (all tags if `None`).
    pub fn pause(&self, tag: Option<&str>) -> Result<OpReport> {
        self.pause_pick(&Pick::tag(tag))
    }

    /// Pause what `pick` names: the mapped segments (chunks) of the allocations it selects,
    /// and NCCL's communicators where it names their tag (`comms.rs`).
    pub fn pause_pick(&self, pick: &Pick<'_>) -> Result<OpReport> {
        self.with_comms_of(Which::Pause, pick, || self.pause_memory(pick))
    }

    /// The pause transaction of the allocations `pick` selects.
    fn pause_memory(&self, pick: &Pick<'_>) -> Result<OpReport> {
        let mut tx = Txn::begin(&self.ops, &self.registry, Which::Pause, pick, None)
            .map_err(Error::unchanged)?;
        let cfg = self.settings.copy();
        // Before anything is marked: a refusal changes nothing.
        let kept = self.registered_kept(pick).map_err(Error::unchanged)?;
        let jobs = tx
            .mark(pick, |reg| {
                pick.record_chunk_state(reg);
                // The allocations in `kept` (holding buffers NCCL registered) stay as they are.
                reg.begin(
                    State::Pausing,
                    |ptr, a| {
                        (!kept.contains(&ptr))
                            .then(|| pick.segments_to_pause(ptr, a))
                            .flatten()
                    },
                    |ptr, a, segs| Job::marked(ptr, a, segs, &cfg),
                )
            })
            .map_err(Error::unchanged)?;
        // A non-blocking resume's failure that nothing reported, on allocations this pause
        // acts on: raised once it has (Note [Non-blocking resume] in `inflight.rs`).
        let earlier = self.restores.unreported(jobs.iter().map(|j| j.ptr));
        let run = match self.pause_jobs(&mut tx, &cfg, pick.tag, jobs) {
            Ok(run) => run,
            Err(e) => {
                // Giving back what failed resumes left mapped stopped part-way: those it gave
                // back whole are paused with nothing mapped, and no later pause selects them.
                let changed = tx.changed();
                let marked = tx.abort();
                self.restores
                    .settle_given_back(&self.registry, marked, true);
                let e = e.context(format!("pause of {}", pick.describe()));
                return Err(with_earlier(e, earlier).with_changed(changed));
            }
        };
        // Still within this transaction: nothing comes between the failure and the restore.
        let failed = run.result.err().map(|e| {
            let e = e.context(format!("pause of {}", pick.describe()));
            self.restore_part_paused(&mut tx, &cfg, &run.part_paused, e)
        });
        // What it leaves changed, once what it released part-way is restored: a failure (its
        // own, or an earlier one it reports) says so; a pause that succeeds does not count it.
        let changed = if failed.is_some() || earlier.is_some() {
            tx.changed()
        } else {
            Changed::NOTHING
        };
        let report = tx.end(Slots::KeepIfUsed, run.tally, |_, _| {
            tracing::debug!(
                "pause: backups prepared at {:.4} s, devices done at {:.4} s, closed at {:.4} s",
                run.prepared_s,
                run.devices_s,
                run.t0.elapsed().as_secs_f64()
            );
            0.0
        });
        self.restores
            .settle_given_back(&self.registry, run.touched, failed.is_some());
        if let Some(e) = failed {
            return Err(with_earlier(e, earlier).with_changed(changed));
        }
        tracing::info!(
            "paused {} ({} allocations){} in {:.3}s",
            human(report.bytes),
            report.allocations,
            report.copies(true),
            report.seconds
        );
        reported_by(report, earlier, || {
            format!(
                "this pause of {}, which has paused them (their memory given back)",
                pick.describe()
            )
        })
        .map_err(|e| e.with_changed(changed))
    }

    /// The work of a pause on the jobs it marked, which go when it returns (and with them
    /// their references to backups: a resume that follows sees which buffers only the
    /// registry holds). An error here is one of giving back what a failed resume left mapped,
    /// before anything else is done; the outcome of the rest is `Paused::result`.
    fn pause_jobs(
        &self,
        tx: &mut Txn<'_>,
        cfg: &CopyConfig,
        tag: Option<&str>,
        mut jobs: Vec<Job>,
    ) -> Result<Paused> {
        let mut tally = Tally::default();
        // Counted by release_stuck: their runs below add bytes, not another allocation.
        let unstuck: Vec<DevPtr> = jobs
            .iter()
            .filter(|j| !j.stuck.is_empty())
            .map(|j| j.ptr)
            .collect();
        self.release_stuck(&mut jobs, &mut tally)?;
        let touched: Vec<DevPtr> = jobs.iter().map(|j| j.ptr).collect();
        jobs.retain(|j| !j.runs.is_empty());
        let mut retired = vec![(0, 0, 0); jobs.len()];
        let (rings, tracked) = tx.work();
        let t0 = Instant::now();
        let mut prepared_s = 0.0;
        let result = self
            .prepare_backups(&mut jobs, cfg, rings, tag)
            .and_then(|()| {
                prepared_s = t0.elapsed().as_secs_f64();
                self.pause_devices(&jobs, rings, cfg, &mut retired, tracked)
            });
        for (j, (bytes, copied, unchanged)) in jobs.iter().zip(&retired).filter(|(_, r)| r.0 > 0) {
            // Pieces found unchanged are in the backup already: not copied.
            if unstuck.contains(&j.ptr) {
                tally.bytes(&j.tag, *bytes, *copied - *unchanged, j.on_disk());
            } else {
                tally.add(&j.tag, *bytes, *copied - *unchanged, j.on_disk());
            }
            tally.unchanged(&j.tag, *unchanged);
        }
        // Allocations (not chunked) this pause released only some segments of before it failed.
        let part_paused: Vec<DevPtr> = if result.is_err() {
            jobs.iter()
                .zip(&retired)
                .filter(|(j, r)| !j.chunked && r.0 > 0 && r.0 < j.mapped_bytes())
                .map(|(j, _)| j.ptr)
                .collect()
        } else {
            Vec::new()
        };
        tx.pin_later(
            cfg,
            self.settings.retain(),
            jobs.iter()
                .zip(&retired)
                .filter(|(_, r)| r.0 > 0)
                .filter_map(|(j, _)| Some((j.ptr, j.host.as_ref()?))),
        );
        Ok(Paused {
            result,
            tally,
            part_paused,
            touched,
            t0,
            prepared_s,
            devices_s: t0.elapsed().as_secs_f64(),
        })
    }

    /// Give back the memory of the segments a failed non-blocking resume left mapped (paused
    /// already, their contents in the backup), before the jobs' own work; counted in `tally`.
    /// What is unmapped stops being stuck at once, so a failure part-way loses nothing.
    fn release_stuck(&self, jobs: &mut [Job], tally: &mut Tally) -> Result<()> {
        let d = &*self.driver;
        for j in jobs.iter_mut().filter(|j| !j.stuck.is_empty()) {
            let stuck = std::mem::take(&mut j.stuck);
            let device = stuck[0].1.device;
            let _scope = DeviceScope::enter(d, device)?;
            // Work queued behind the failed restore may still use the memory.
            d.synchronize(device)?;
            let mut bytes = 0;
            for (s, seg) in stuck {
                d.unmap(seg.ptr, seg.mapped).ctx(|| {
                    format!(
                        "unmapping {:#x} ({} bytes, tag {:?}), left mapped by a failed resume",
                        seg.ptr, seg.mapped, j.tag
                    )
                })?;
                self.registry.marked(j.ptr, |a| a.stuck.retain(|x| *x != s));
                bytes += seg.mapped;
            }
            tally.add(&j.tag, bytes, 0, false);
        }
        Ok(())
    }

    /// Give every job with a backup policy a host buffer or a file, after checking that the
    /// host and the disk can hold the new ones: a host backup is touched only while copying, so
    /// a pause larger than what the host has would be killed by the kernel mid-copy instead of
    /// failing; a file's space is reserved when it is made, so a full disk fails here too.
    fn prepare_backups(
        &self,
        jobs: &mut [Job],
        cfg: &CopyConfig,
        rings: &BTreeMap<i32, Ring>,
        tag: Option<&str>,
    ) -> Result<()> {
        // A file that lost its name (its folder wiped, or the file removed) and holds nothing
        // still paused is replaced by one where the folder's path leads now (Note [The disk
        // backup folder]); the old one goes once nobody holds it.
        for j in jobs.iter_mut() {
            let unnamed = j.disk.as_ref().is_some_and(|f| !f.linked());
            if j.backup == Some(BackupKind::Disk) && unnamed && !j.file_needed {
                let old = self.registry.marked(j.ptr, |a| a.disk.take());
                tracing::info!(
                    "the disk backup file {} was removed; allocation {:#x} gets a new one",
                    old.as_deref()
                        .map_or(Path::new("?"), DiskFile::path)
                        .display(),
                    j.ptr
                );
                j.disk = None;
            }
        }
        let fresh: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].backup.is_some() && !jobs[i].backed_up())
            .collect();
        let is_disk = |i: &usize| jobs[*i].backup == Some(BackupKind::Disk);
        // What a new buffer will hold: this pause's copies and what is carried over.
        let backups: u64 = fresh
            .iter()
            .filter(|i| !is_disk(i))
            .map(|&i| {
                let j = &jobs[i];
                let carried = j
                    .carry
                    .as_ref()
                    .map_or(0, |(_, r)| r.iter().map(|x| x.1).sum());
                j.copy_bytes() + carried
            })
            .sum();
        let files: u64 = fresh
            .iter()
            .filter(|i| is_disk(i))
            .map(|&i| jobs[i].mapped)
            .sum();
        if backups > 0 || files > 0 {
            let mut devices: Vec<i32> = fresh.iter().map(|&i| jobs[i].device).collect();
            devices.sort_unstable();
            devices.dedup();
            // Saturating: a slot size is only checked to be a page multiple, so one no host can
            // hold (TMS_STAGING_SLOT=4194304T) must fail the check below, not overflow.
            let slots = (2 * cfg.threads as u64).saturating_mul(cfg.slot);
            let staging: u64 = devices
                .iter()
                .map(|d| slots.saturating_sub(rings.get(d).map_or(0, Ring::bytes)))
                .fold(0, u64::saturating_add);
            self.check_host_memory(backups, staging, fresh.len(), tag)?;
        }
        let dir = if fresh.iter().any(is_disk) {
            let dir = self.settings.disk_dir()?;
            check_disk_space(&dir, files, tag)?;
            Some(dir)
        } else {
            None
        };
        for i in fresh {
            let j = &mut jobs[i];
            let kind = j.backup.expect("filtered on a backup policy");
            let what = || format!("allocation {:#x} ({} bytes)", j.ptr, j.size);
            if kind == BackupKind::Disk {
                let Some(dir) = dir.as_deref() else {
                    return Err(Error::internal("a disk backup without its directory"));
                };
                let f = Arc::new(DiskFile::create(dir, j.mapped, j.file_chunk).ctx(what)?);
                // Kept by the allocation from now on, and reused by every later pause.
                self.registry.marked(j.ptr, |a| a.disk = Some(f.clone()));
                j.disk = Some(f);
                continue;
            }
            let h = HostBuffer::new(self.driver.clone(), j.device, kind, j.size, cfg.layout)
                .ctx(what)?;
            if let Some((old, ranges)) = j.carry.take() {
                for (off, len) in ranges {
                    h.copy_from(&old, off, len);
                }
            }
            let h = Arc::new(h);
            // Kept by the allocation even if this pause fails, for the next one to reuse.
            self.registry.marked(j.ptr, |a| a.host = Some(h.clone()));
            j.host = Some(h);
        }
        Ok(())
    }

    fn check_host_memory(
        &self,
        backups: u64,
        staging: u64,
        count: usize,
        tag: Option<&str>,
    ) -> Result<()> {
        let Some(host) = self.driver.host_memory() else {
            tracing::debug!("cannot tell how much host memory is available; not checked");
            return Ok(());
        };
        let usable = host.available - host.available / HOST_HEADROOM_DIVISOR;
        let need = backups.saturating_add(staging);
        if need <= usable {
            return Ok(());
        }
        Err(Error::out_of_memory(format!(
            "a pause of {} needs {} of host memory for {count} new CPU backups ({} bytes) and \
             staging ({} bytes), but only {} is available ({}; a 1/{HOST_HEADROOM_DIVISOR} share \
             of it is kept free, leaving {}); nothing was paused: free host memory, pause fewer \
             tags at once, or use fewer backups",
            describe(tag),
            human(need),
            backups,
            staging,
            human(host.available),
            host.bound,
            human(usable),
        )))
    }

    /// Record in the progress what the copies move; then per device, in parallel: wait for the
    /// device's work, then retire each run of segments as soon as its contents are safe.
    /// `retired[j]`: the device bytes of job `j` released, the bytes of them saved, and of
    /// those the bytes found unchanged (not copied).
    fn pause_devices(
        &self,
        jobs: &[Job],
        rings: &mut BTreeMap<i32, Ring>,
        cfg: &CopyConfig,
        retired: &mut [(u64, u64, u64)],
        tracked: &Tracked<'_>,
    ) -> Result<()> {
        let backings = Backings {
            host: jobs.iter().any(|j| j.host.is_some()),
            disk: jobs.iter().any(Job::on_disk),
        };
        tracked.prepared(jobs.iter().map(Job::pipeline_bytes).sum(), backings);
        let progress = tracked.counters();
        let mut groups = by_device(jobs.iter().map(|j| j.device));
        for list in groups.values_mut() {
            // Those with nothing to copy are retired first.
            list.sort_by_key(|&i| (jobs[i].backed_up(), jobs[i].ptr));
        }
        let work = device_work(&groups, rings);
        let results = per_device(work, |(device, list, ring)| {
            let mut done = vec![(0, 0, 0); list.len()];
            let r = self.pause_device(device, jobs, list, ring, cfg, &mut done, progress);
            (list.clone(), done, r)
        });
        first_error(results.into_iter().map(|(list, done, r)| {
            for (i, d) in list.into_iter().zip(done) {
                retired[i] = d;
            }
            r
        }))
    }

    #[allow(clippy::too_many_arguments)]
    fn pause_device(
        &self,
        device: i32,
        jobs: &[Job],
        list: &[usize],
        ring: &mut Ring,
        cfg: &CopyConfig,
        done: &mut [(u64, u64, u64)],
        progress: &Counters,
    ) -> Result<()> {
        let d = &*self.driver;
        let _scope = DeviceScope::enter(d, device)?;
        progress.phase(Phase::Synchronizing);
        d.synchronize(device)
            .ctx(|| format!("synchronizing device {device}"))?;
        // What changed since each backup took it (Note [Skipping unchanged memory]).
        let piece = self.granularity(device)?;
        let digested: Vec<Digested> = list
            .iter()
            .map(|&i| {
                let j = &jobs[i];
                let spans: Vec<Span> = j.runs.iter().map(|r| r.0).collect();
                let host = j.host.as_deref();
                self.digest_for_pause(device, host, &j.tag, (j.ptr, j.size), &spans, piece)
            })
            .collect();
        // One item per run: (index in `list`, run).
        let parts: Vec<(usize, usize)> = list
            .iter()
            .enumerate()
            .flat_map(|(k, &i)| (0..jobs[i].runs.len()).map(move |r| (k, r)))
            .collect();
        let items: Vec<Item<'_>> = parts
            .iter()
            .map(|&(k, r)| {
                let j = &jobs[list[k]];
                Item::over(j.ptr, &j.runs[r].0, j.target()).only(digested[k].changed.as_ref())
            })
            .collect();
        // The total counted every byte: what is unchanged comes off it, so that the progress
        // shown reaches its end.
        progress.skipped(items.iter().map(Item::unchanged_bytes).sum());
        let mut left: Vec<usize> = list.iter().map(|&i| jobs[i].runs.len()).collect();
        Pipeline {
            driver: &self.driver,
            device,
            dir: Dir::Save,
            cfg,
            ring,
            items: &items,
            progress,
            lock_pages_first: false,
        }
        .run(
            |_, _| Ok(()),
            |p| {
                let (k, r) = parts[p];
                left[k] -= 1;
                let j = &jobs[list[k]];
                digested[k].record(j.host.as_deref(), r, piece);
                let skipped = j.run_bytes(r).1.saturating_sub(items[p].copy_bytes());
                if progress.copied_all() {
                    // What is left is unmapping and releasing (of runs without a backup, or
                    // saved already); until then the copies are what takes the time.
                    progress.phase(Phase::Releasing);
                }
                self.retire(j, r, left[k] == 0, skipped, &mut done[k])
            },
        )
    }

    /// After a pause failed: resume the allocations it had released only some segments of
    /// (their backups hold those), so that what the failed pause leaves is as its contract says,
    /// each allocation whole, active or paused (Note [Pause and resume as transactions]). What
    /// cannot be resumed stays partly paused, its paused segments with their backup; the
    /// error `e` says so.
    fn restore_part_paused(
        &self,
        tx: &mut Txn<'_>,
        cfg: &CopyConfig,
        ptrs: &[DevPtr],
        mut e: Error,
    ) -> Error {
        for &p in ptrs {
            let pick = Pick {
                alloc: Some(p),
                ..Pick::default()
            };
            e = match self.resume_within(tx, cfg, &pick) {
                Ok(()) => e.note(format!(
                    "allocation {p:#x}, released part-way, was restored and is active"
                )),
                Err(e2) => e.note(format!(
                    "allocation {p:#x} was released part-way and restoring it failed too ({e2}): \
                     its released segments stay paused with their backup; a resume restores them"
                )),
            };
        }
        e
    }

    /// Unmap and release run `r` of a job, whose contents are safe (copied, or not wanted), and
    /// record its segments paused (the allocation settled, after its `last` run). If only the
    /// release fails, the run is paused all the same (unmapped, its contents in the backup) and
    /// the handle is reported. `skipped`: the bytes of the run found unchanged, counted with
    /// the run (a run that stays mapped counts none of its bytes, or its copied ones would fall
    /// short of them).
    fn retire(
        &self,
        j: &Job,
        r: usize,
        last: bool,
        skipped: u64,
        done: &mut (u64, u64, u64),
    ) -> Result<()> {
        let d = &*self.driver;
        if let Some(f) = &j.disk {
            // The device memory goes only once its contents are really on disk.
            f.sync().ctx(|| j.what(r))?;
        }
        let (span, hs) = &j.runs[r];
        let segs = span.with_handles(hs);
        if let Err(f) = segment::unmap_all(d, span.device, &segs) {
            let saved = j.backed_up();
            self.registry
                .marked(j.ptr, |a| a.record_lost(j.ptr, &segs, &f.lost, saved));
            return Err(f.error).ctx(|| j.what(r));
        }
        let released = segment::release_all(d, &segs);
        let first = span.first_segment(j.ptr);
        self.registry.marked(j.ptr, |a| {
            for s in first..first + hs.len() {
                a.handles[s] = None;
                a.saved[s] = j.backed_up();
            }
            if last {
                a.state = a.settled();
            }
        });
        if last {
            self.registry.notify_settled();
        }
        let (bytes, copied) = j.run_bytes(r);
        done.0 += bytes;
        done.1 += copied;
        done.2 += skipped;
        released.ctx(|| j.what(r))
    }
}

/// Refuse a pause whose new disk backup files the directory cannot hold.
fn check_disk_space(dir: &disk::BackupDir, need: u64, tag: Option<&str>) -> Result<()> {
    let Some(free) = disk::free_space(dir)? else {
        tracing::debug!(
            "{} tells no size (ramfs, or tmpfs without a limit); free space not checked",
            dir.path().display()
        );
        return Ok(());
    };
    if need <= free {
        return Ok(());
    }
    Err(Error::out_of_memory(format!(
        "a pause of {} needs {} for new disk backup files in {}, which has {} free; nothing was \
         paused: free space there or choose another directory (set_disk_backup_dir, \
         TMS_DISK_BACKUP_DIR)",
        describe(tag),
        human(need),
        dir.path().display(),
        human(free),
    )))
}
