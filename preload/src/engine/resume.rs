//! The resume transaction (Note [Pause and resume as transactions] in `mod.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::pipeline::{self, Dir, Item, Target};
use super::segment::{Mapping, Span};
use super::{
    by_device, check_tag, describe, device_work, first_error, per_device, Engine, OpReport, Settle,
    State, Tally,
};
use crate::backup::{release_parallel, DiskFile, HostBuffer};
use crate::driver::{DevPtr, DeviceScope};
use crate::error::{Result, ResultExt};
use crate::units::human;

/// One allocation in a resume, copied out of the registry (which marks it Resuming meanwhile).
struct Job {
    ptr: DevPtr,
    span: Span,
    size: u64,
    tag: Arc<str>,
    /// The snapshot to copy back, if the allocation has one.
    host: Option<Arc<HostBuffer>>,
    /// Or the file holding it.
    disk: Option<Arc<DiskFile>>,
}

impl Job {
    fn target(&self) -> Option<Target<'_>> {
        Target::of(&self.host, &self.disk)
    }
}

impl Engine {
    /// Resume every paused allocation of `tag` (all tags if `None`) at the same addresses.
    pub fn resume(&self, tag: Option<&str>) -> Result<OpReport> {
        check_tag(tag)?;
        self.check_sound()?;
        let _unwind = self.guard("resume", tag);
        self.note_unknown_tag("resume", tag);
        let _quiet = self.pinner.quiet();
        let t0 = Instant::now();
        let cfg = self.copy_config();
        let mut ops = self.ops.lock();
        let jobs = self.begin_resume(tag);
        let settle = Settle::new(self, jobs.iter().map(|j| j.ptr), State::Resuming);
        // A file that is gone or cut short fails the resume before anything is mapped.
        let present = jobs
            .iter()
            .filter_map(|j| j.disk.as_ref())
            .try_for_each(|f| f.check_present());
        if let Err(e) = present {
            drop(settle);
            return Err(e.context(format!(
                "resume of {} (it stays paused with its backups)",
                describe(tag)
            )));
        }
        let groups = by_device(jobs.iter().map(|j| j.span.device));
        // Per device, in parallel: map each allocation, and copy its backup back while the next
        // one is mapped. All or nothing: on any failure the mappings made are dropped, which
        // undoes them, and the allocations stay paused with their backups.
        let d = &*self.driver;
        let mut made: Vec<(usize, Mapping<'_>)> = Vec::with_capacity(jobs.len());
        let result = {
            let work = device_work(&groups, &mut ops.rings);
            let results = per_device(work, |(device, list, ring)| {
                let items: Vec<Item<'_>> = list
                    .iter()
                    .map(|&i| Item {
                        dev: jobs[i].ptr,
                        target: jobs[i].target(),
                    })
                    .collect();
                let mut made = Vec::with_capacity(list.len());
                let r = DeviceScope::enter(d, device).and_then(|_scope| {
                    pipeline::run(
                        &self.driver,
                        device,
                        Dir::Restore,
                        &cfg,
                        ring,
                        &items,
                        |k, progress| {
                            let j = &jobs[list[k]];
                            let mut m = Mapping::new(d, j.span);
                            let r = m.map_all(progress);
                            // Kept even when incomplete: workers may be copying into the
                            // segments made, so they are undone only after the pipeline stops.
                            made.push((list[k], m));
                            r.ctx(|| {
                                format!(
                                    "allocation {:#x} ({} bytes, tag {:?})",
                                    j.ptr, j.size, j.tag
                                )
                            })
                        },
                        |_| Ok(()),
                    )
                });
                (made, r)
            });
            first_error(results.into_iter().map(|(m, r)| {
                made.extend(m);
                r
            }))
        };
        if let Err(e) = result {
            drop(made);
            drop(settle);
            return Err(e.context(format!(
                "resume of {} (undone: it stays paused with its backups)",
                describe(tag)
            )));
        }
        // Commit.
        let retain = self.retain_cpu_backup();
        let mut tally = Tally::default();
        let mut released = Vec::new();
        {
            let mut reg = self.reg.lock();
            for (i, m) in made {
                let j = &jobs[i];
                let a = reg.marked(j.ptr);
                a.handles = m.commit();
                a.state = State::Active;
                // A retained backup stays a complete snapshot (of the last pause).
                if !retain {
                    a.host_valid = false;
                    released.extend(a.host.take());
                }
                let copied = match (&j.host, &j.disk) {
                    (Some(h), _) => h.len(),
                    (None, Some(_)) => j.size,
                    (None, None) => 0,
                };
                tally.add(&j.tag, j.span.mapped, copied);
            }
        }
        let Tally {
            mut report,
            per_tag,
        } = tally;
        drop(settle);
        if retain {
            self.pin_later(&cfg, jobs.iter().filter_map(|j| j.host.as_ref()));
        }
        // The copies' references go first, so that the release below sees which buffers only
        // it holds.
        drop(jobs);
        let rings = if retain {
            BTreeMap::new()
        } else {
            std::mem::take(&mut ops.rings)
        };
        drop(ops);
        // Giving host memory back takes as long as filling it did: in parallel, and without
        // holding up anyone else.
        let t1 = Instant::now();
        release_parallel(released, cfg.threads);
        drop(rings);
        report.release_seconds = t1.elapsed().as_secs_f64();
        report.seconds = t0.elapsed().as_secs_f64();
        self.record_history(per_tag, report, |h| &mut h.last_resume);
        tracing::info!(
            "resumed {} ({} allocations) in {:.3}s ({:.3}s releasing host memory)",
            human(report.bytes),
            report.allocations,
            report.seconds,
            report.release_seconds
        );
        Ok(report)
    }

    /// Mark the paused allocations of `tag` Resuming and copy out what the resume needs.
    fn begin_resume(&self, tag: Option<&str>) -> Vec<Job> {
        self.reg
            .lock()
            .begin(tag, State::Paused, State::Resuming, |ptr, a| Job {
                ptr,
                span: a.span(ptr),
                size: a.size,
                tag: a.tag.clone(),
                host: a.snapshot().cloned(),
                disk: a.disk.clone().filter(|_| a.host_valid),
            })
    }
}
