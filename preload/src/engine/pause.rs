//! The pause transaction (Note [Pause and resume as transactions] in `mod.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::pipeline::{self, Dir, Item, Ring, Target};
use super::segment::{self, Span};
use super::{
    by_device, check_tag, describe, device_work, first_error, per_device, Backup, CopyConfig,
    Engine, OpReport, Settle, State, Tally,
};
use crate::backup::{disk, BackupKind, DiskFile, HostBuffer};
use crate::driver::{DevPtr, DeviceScope, PhysHandle};
use crate::error::{Error, Result, ResultExt};
use crate::units::human;

/// One allocation in a pause: what the work needs, copied out of the registry (which marks the
/// allocation Pausing meanwhile).
struct Job {
    ptr: DevPtr,
    span: Span,
    size: u64,
    tag: Arc<str>,
    backup: Backup,
    handles: Vec<PhysHandle>,
    /// The buffer to copy into: a retained one nobody else holds, or one made for this pause.
    host: Option<Arc<HostBuffer>>,
    /// The file to write into (disk backups): the allocation's own, or one made for this pause.
    disk: Option<Arc<DiskFile>>,
}

impl Job {
    fn target(&self) -> Option<Target<'_>> {
        Target::of(&self.host, &self.disk)
    }

    fn backed_up(&self) -> bool {
        self.host.is_some() || self.disk.is_some()
    }
}

impl Job {
    fn what(&self) -> String {
        format!(
            "allocation {:#x} ({} bytes, tag {:?}), handle {:#x}{}",
            self.ptr,
            self.size,
            self.tag,
            self.handles.first().map_or(0, |h| h.0),
            match self.handles.len() {
                0 | 1 => String::new(),
                n => format!(" and {} more", n - 1),
            }
        )
    }
}

/// Of the host memory that is available, this share is left free (page cache, other
/// processes' growth): a pause may fill the rest.
const HOST_HEADROOM_DIVISOR: u64 = 16;

impl Engine {
    /// Pause every active allocation of `tag` (all tags if `None`).
    pub fn pause(&self, tag: Option<&str>) -> Result<OpReport> {
        check_tag(tag)?;
        self.check_sound()?;
        let _unwind = self.guard("pause", tag);
        self.note_unknown_tag("pause", tag);
        let _quiet = self.pinner.quiet();
        let t0 = Instant::now();
        let cfg = self.copy_config();
        let mut ops = self.ops.lock();
        let mut jobs = self.begin_pause(tag);
        // Whatever happens from here (an error, a panic), no allocation stays Pausing.
        let _settle = Settle::new(self, jobs.iter().map(|j| j.ptr), State::Pausing);
        let mut retired = vec![false; jobs.len()];
        let result = self
            .prepare_backups(&mut jobs, &cfg, &ops.rings, tag)
            .and_then(|()| self.pause_devices(&jobs, &mut ops.rings, &cfg, &mut retired));
        let mut tally = Tally::default();
        for (j, _) in jobs.iter().zip(&retired).filter(|(_, r)| **r) {
            let copied = if j.backed_up() { j.size } else { 0 };
            tally.add(&j.tag, j.span.mapped, copied);
        }
        let Tally {
            mut report,
            per_tag,
        } = tally;
        report.seconds = t0.elapsed().as_secs_f64();
        self.pin_later(
            &cfg,
            jobs.iter()
                .zip(&retired)
                .filter(|(_, r)| **r)
                .filter_map(|(j, _)| j.host.as_ref()),
        );
        drop(jobs);
        self.drop_unused_rings(&mut ops.rings);
        drop(ops);
        self.record_history(per_tag, report, |h| &mut h.last_pause);
        result.ctx(|| format!("pause of {}", describe(tag)))?;
        tracing::info!(
            "paused {} ({} allocations) in {:.3}s",
            human(report.bytes),
            report.allocations,
            report.seconds
        );
        Ok(report)
    }

    /// Mark the active allocations of `tag` Pausing and copy out what the pause needs. A
    /// retained backup is reused only where nothing else holds it (a zero-copy view, a reader):
    /// a snapshot someone still looks at is never overwritten.
    fn begin_pause(&self, tag: Option<&str>) -> Vec<Job> {
        self.reg
            .lock()
            .begin(tag, State::Active, State::Pausing, |ptr, a| {
                a.host_valid = false;
                let reuse = a.backup.is_some_and(|b| {
                    a.host.as_ref().is_some_and(|h| {
                        h.backend() == b && h.len() == a.size && Arc::strong_count(h) == 1
                    })
                });
                if !reuse {
                    a.host = None;
                }
                if a.backup != Some(BackupKind::Disk) {
                    a.disk = None;
                }
                Job {
                    ptr,
                    span: a.span(ptr),
                    size: a.size,
                    tag: a.tag.clone(),
                    backup: a.backup,
                    handles: a.handles.clone(),
                    host: a.host.clone(),
                    disk: a.disk.clone(),
                }
            })
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
        let fresh: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].backup.is_some() && !jobs[i].backed_up())
            .collect();
        let is_disk = |i: &usize| jobs[*i].backup == Some(BackupKind::Disk);
        let backups: u64 = fresh
            .iter()
            .filter(|i| !is_disk(i))
            .map(|&i| jobs[i].size)
            .sum();
        let files: u64 = fresh
            .iter()
            .filter(|i| is_disk(i))
            .map(|&i| jobs[i].span.mapped)
            .sum();
        if backups > 0 || files > 0 {
            let mut devices: Vec<i32> = fresh.iter().map(|&i| jobs[i].span.device).collect();
            devices.sort_unstable();
            devices.dedup();
            let slots = 2 * cfg.threads as u64 * cfg.slot;
            let staging: u64 = devices
                .iter()
                .map(|d| slots.saturating_sub(rings.get(d).map_or(0, Ring::bytes)))
                .sum();
            self.check_host_memory(backups, staging, fresh.len(), tag)?;
        }
        let dir = self.disk_backup_dir();
        if files > 0 {
            check_disk_space(&dir, files, tag)?;
        }
        let disk_chunk = if cfg.disk_chunk > 0 {
            cfg.disk_chunk
        } else {
            cfg.layout.chunk
        };
        for i in fresh {
            let j = &mut jobs[i];
            let kind = j.backup.expect("filtered on a backup policy");
            let what = || format!("allocation {:#x} ({} bytes)", j.ptr, j.size);
            if kind == BackupKind::Disk {
                let f = Arc::new(DiskFile::create(&dir, j.span.mapped, disk_chunk).ctx(what)?);
                // Kept by the allocation from now on, and reused by every later pause.
                self.reg.lock().marked(j.ptr).disk = Some(f.clone());
                j.disk = Some(f);
                continue;
            }
            let h = HostBuffer::new(self.driver.clone(), j.span.device, kind, j.size, cfg.layout)
                .ctx(what)?;
            let h = Arc::new(h);
            // Kept by the allocation even if this pause fails, for the next one to reuse.
            self.reg.lock().marked(j.ptr).host = Some(h.clone());
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
        Err(Error::OutOfMemory(format!(
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

    /// Per device, in parallel: wait for the device's work, then retire each allocation as soon
    /// as its contents are safe.
    fn pause_devices(
        &self,
        jobs: &[Job],
        rings: &mut BTreeMap<i32, Ring>,
        cfg: &CopyConfig,
        retired: &mut [bool],
    ) -> Result<()> {
        let mut groups = by_device(jobs.iter().map(|j| j.span.device));
        for list in groups.values_mut() {
            // Those with nothing to copy are retired first.
            list.sort_by_key(|&i| (jobs[i].backed_up(), jobs[i].ptr));
        }
        let work = device_work(&groups, rings);
        let results = per_device(work, |(device, list, ring)| {
            let mut done = vec![false; list.len()];
            let r = self.pause_device(device, jobs, list, ring, cfg, &mut done);
            (list.clone(), done, r)
        });
        first_error(results.into_iter().map(|(list, done, r)| {
            for (i, d) in list.into_iter().zip(done) {
                retired[i] = d;
            }
            r
        }))
    }

    fn pause_device(
        &self,
        device: i32,
        jobs: &[Job],
        list: &[usize],
        ring: &mut Ring,
        cfg: &CopyConfig,
        done: &mut [bool],
    ) -> Result<()> {
        let d = &*self.driver;
        let _scope = DeviceScope::enter(d, device)?;
        d.synchronize(device)
            .ctx(|| format!("synchronizing device {device}"))?;
        let items: Vec<Item<'_>> = list
            .iter()
            .map(|&i| Item {
                dev: jobs[i].ptr,
                target: jobs[i].target(),
            })
            .collect();
        pipeline::run(
            &self.driver,
            device,
            Dir::Save,
            cfg,
            ring,
            &items,
            |_, _| Ok(()),
            |k| self.retire(&jobs[list[k]], &mut done[k]),
        )
    }

    /// Unmap and release one allocation whose contents are safe (copied, or not wanted), and
    /// record it paused. If only the release fails, it is paused all the same (unmapped, its
    /// contents in the backup) and the handle is reported.
    fn retire(&self, j: &Job, done: &mut bool) -> Result<()> {
        let d = &*self.driver;
        if let Some(f) = &j.disk {
            // The device memory goes only once its contents are really on disk.
            f.sync().ctx(|| j.what())?;
        }
        segment::unmap_all(d, j.span, &j.handles).ctx(|| j.what())?;
        let released = segment::release_all(d, &j.handles);
        {
            let mut reg = self.reg.lock();
            let a = reg.marked(j.ptr);
            a.state = State::Paused;
            a.handles.clear();
            a.host_valid = j.backed_up();
        }
        self.settled.notify_all();
        *done = true;
        released.ctx(|| j.what())
    }
}

/// Refuse a pause whose new disk backup files the directory cannot hold.
fn check_disk_space(dir: &std::path::Path, need: u64, tag: Option<&str>) -> Result<()> {
    let free = disk::free_space(dir)?;
    if need <= free {
        return Ok(());
    }
    Err(Error::OutOfMemory(format!(
        "a pause of {} needs {} for new disk backup files in {}, which has {} free; nothing was \
         paused: free space there or choose another directory (set_disk_backup_dir, \
         TMS_DISK_BACKUP_DIR)",
        describe(tag),
        human(need),
        dir.display(),
        human(free),
    )))
}
