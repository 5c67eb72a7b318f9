//! Model-based property test with several threads at once: each thread owns its tags and the
//! allocations it makes in them, keeps an exact model of those (state per unit, contents or
//! "undefined", whether the backup holds them), and runs random operations on them (allocate,
//! write, free, pause, resume blocking or non-blocking and wait, chunk pauses and resumes,
//! digest checks) while the other threads do the same on the same engine, with several copy
//! workers. After each of its steps a thread checks its own allocations: addresses, states,
//! contents wherever the model knows them, backups, its tags' stats. Device memory is shared,
//! so any allocation or resume may run out of memory (it must then change nothing). At the end
//! each thread's data is verified once more, the device holds exactly what the registry
//! implies, the engine still works, and dropping it gives everything back.
//!
//! The second test arms transient driver and disk faults from the threads (a fault fires in
//! whichever thread's call reaches it): any pause, resume, allocation or free may then fail,
//! and the model follows what the engine says changed; what was backed up or still mapped must
//! never be lost.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, RwLock};
use std::time::Duration;

use common::model::{poke, Fault, Units, FAULT_PRIMS};
use common::{engine_test, pattern, read_raw, run_proptest, write_raw, Expect, Harness, Setup};
use proptest::prelude::*;
use tms::backup::disk::{self, DiskOp};
use tms::backup::BackupKind;
use tms::driver::sim::SimDriver;
use tms::engine::{AllocRequest, Checks, CopyConfig, Engine, Pick, PinMode, State};
use tms::Backup;

/// The sim's granularity: the unit of size.
const G: u64 = 64 << 10;
/// Per device, shared by every thread: enough for a few allocations each, so that allocations
/// and resumes run out of memory now and then.
const CAPACITY: u64 = 24 * G;
/// Tags per thread (named after the thread).
const TAGS: usize = 2;
/// How long a wait for a non-blocking resume may take before the test calls it a hang.
const PATIENCE: Duration = Duration::from_secs(60);

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        tag: usize,
        backup: Backup,
        device: i32,
        /// Chunked in chunks of this many granules (0: not chunked).
        chunk: u64,
    },
    /// Fill the active units of the `pick`-th own allocation with fresh data.
    Write {
        pick: usize,
        seed: u64,
    },
    /// Change a few bytes of a defined active unit (what skipping unchanged memory must see).
    Poke {
        pick: usize,
        at: u64,
        seed: u64,
    },
    Free {
        pick: usize,
    },
    Pause {
        tag: usize,
    },
    /// Resume a tag: blocking (`nb` None), or non-blocking and then wait for each allocation
    /// (`Some(false)`) or for everything (`Some(true)`, fault-free runs only).
    Resume {
        tag: usize,
        nb: Option<bool>,
    },
    /// Pause (true) or resume the chunks in `mask` of the `pick`-th own chunked allocation.
    Chunks {
        pick: usize,
        mask: u64,
        pause: bool,
    },
    /// The tag's digest checks: skip unchanged, verify.
    SetChecks {
        tag: usize,
        skip: bool,
        verify: bool,
    },
    /// Arm a transient fault (fault runs only).
    Arm(Fault),
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        1..=4 * G,
        (1..=4u64).prop_map(|k| k * G),
        (1..=3u64, any::<bool>()).prop_map(|(k, up)| if up { k * G + 1 } else { k * G - 1 }),
    ]
}

fn op_strategy(faults: bool) -> impl Strategy<Value = Op> {
    let backup = prop_oneof![
        1 => Just(None),
        2 => Just(Some(BackupKind::Pinned)),
        1 => Just(Some(BackupKind::Mmap)),
        1 => Just(Some(BackupKind::Disk))
    ];
    let fault = prop_oneof![
        3 => (0..FAULT_PRIMS.len(), 1..=8u64).prop_map(|(p, n)| Fault::Prim(FAULT_PRIMS[p], n)),
        1 => (prop_oneof![Just(DiskOp::Write), Just(DiskOp::Read), Just(DiskOp::Sync)], 1..=4u64)
            .prop_map(|(o, n)| Fault::Disk(o, n)),
    ];
    prop_oneof![
        5 => (size_strategy(), 0..TAGS, backup, 0..2i32, prop_oneof![2 => Just(0u64), 1 => Just(1u64), 1 => Just(2u64)])
            .prop_map(|(size, tag, backup, device, chunk)| Op::Alloc { size, tag, backup, device, chunk }),
        3 => (any::<usize>(), any::<u64>()).prop_map(|(pick, seed)| Op::Write { pick, seed }),
        2 => (any::<usize>(), any::<u64>(), any::<u64>()).prop_map(|(pick, at, seed)| Op::Poke { pick, at, seed }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        4 => (0..TAGS).prop_map(|tag| Op::Pause { tag }),
        4 => (0..TAGS, prop_oneof![Just(None), Just(Some(false)), Just(Some(true))])
            .prop_map(|(tag, nb)| Op::Resume { tag, nb }),
        3 => (any::<usize>(), any::<u64>(), any::<bool>())
            .prop_map(|(pick, mask, pause)| Op::Chunks { pick, mask, pause }),
        1 => (0..TAGS, any::<bool>(), any::<bool>()).prop_map(|(tag, skip, verify)| Op::SetChecks { tag, skip, verify }),
        (if faults { 3 } else { 0 }) => fault.prop_map(Op::Arm),
    ]
}

/// Several copy workers, small host chunks and staging slots or large ones.
fn copy_config_strategy() -> impl Strategy<Value = CopyConfig> {
    let page = tms::os::page_size();
    (
        2..=4usize,
        prop_oneof![Just(page), Just(4 * page), Just(64 << 20)],
        prop_oneof![Just(page), Just(2 * page), Just(1 << 20)],
        prop_oneof![
            Just(PinMode::Background),
            Just(PinMode::Inline),
            Just(PinMode::Never)
        ],
        prop_oneof![Just(0u64), Just(disk::DIRECT_ALIGN)],
    )
        .prop_map(|(threads, chunk, slot, pin, disk_chunk)| {
            let mut c = CopyConfig {
                threads,
                slot,
                pin,
                disk_chunk,
                keep_staging: threads % 2 == 0,
                ..CopyConfig::default()
            };
            c.layout.chunk = chunk;
            c
        })
}

/// An allocation as a thread's model sees it: its units (`common::model::Units`), and what
/// this test follows besides.
#[derive(Clone, Debug)]
struct MAlloc {
    u: Units,
    tag: usize,
    device: i32,
    /// Not chunked, and a failed pause or free left it partly paused.
    partial: bool,
    /// Per unit: paused, but a failed resume (or unmap) may have left its memory mapped
    /// (recorded stuck by the engine, which shows it paused). Given back only by a pause that
    /// names the unit, a resume that restores some unit of the allocation, or a free.
    stuck: Vec<bool>,
}

units_deref!(MAlloc);

impl MAlloc {
    fn state(&self) -> State {
        if self.partial {
            State::Partial
        } else {
            self.u.state()
        }
    }

    /// Resume units `us`; returns (device bytes, copied bytes).
    fn resume(&mut self, us: &[usize], retain: bool) -> (u64, u64) {
        let r = self.u.resume(us, retain);
        if self.active.iter().all(|a| *a) {
            self.partial = false;
            if !retain {
                self.saved.fill(false);
            }
        }
        r
    }
}

/// One thread's view: its tags and allocations.
struct Thread<'a> {
    id: usize,
    e: &'a Engine,
    /// The same engine, for the non-blocking resume's thread.
    shared: Arc<Engine>,
    sim: &'a SimDriver,
    dir: &'a std::path::Path,
    allocs: BTreeMap<u64, MAlloc>,
    retain: bool,
    faults: bool,
}

fn tag_name(thread: usize, tag: usize) -> String {
    format!("t{thread}-{tag}")
}

impl Thread<'_> {
    fn tag(&self, t: usize) -> String {
        tag_name(self.id, t)
    }

    fn with_tag(&self, t: usize) -> Vec<u64> {
        self.allocs
            .iter()
            .filter(|(_, a)| a.tag == t)
            .map(|(p, _)| *p)
            .collect()
    }

    fn nth(&self, pick: usize, pred: impl Fn(&MAlloc) -> bool) -> Option<u64> {
        let v: Vec<u64> = self
            .allocs
            .iter()
            .filter(|(_, a)| pred(a))
            .map(|(p, _)| *p)
            .collect();
        (!v.is_empty()).then(|| v[pick % v.len()])
    }

    /// Per unit, whether the engine has it mapped (for a non-chunked allocation: active).
    fn engine_units(&self, p: u64) -> Result<(Vec<bool>, State), String> {
        let i = self
            .e
            .allocations()
            .into_iter()
            .find(|i| i.addr == p)
            .ok_or_else(|| format!("{p:#x} is gone"))?;
        let active = if i.chunk > 0 {
            self.e
                .chunk_info(p)
                .map_err(|e| format!("chunk info: {e}"))?
                .active
        } else {
            vec![i.state == State::Active]
        };
        Ok((active, i.state))
    }

    /// After a call on `ptrs` that failed (a fault, or out of memory): follow what the engine
    /// says changed. A unit paused by it keeps its contents in its backup (lost without one,
    /// or if `freeing`: a failed free saved nothing); a unit resumed by it must hold what its
    /// backup held. A non-chunked allocation may be left partly paused.
    fn resync(&mut self, ptrs: &[u64], freeing: bool) -> Result<(), String> {
        for &p in ptrs {
            let (now, state) = self.engine_units(p)?;
            let retain = self.retain;
            let a = self.allocs.get_mut(&p).unwrap();
            if a.chunk == 0 && state == State::Partial {
                // Its paused part in its backup (a failed free saved nothing).
                a.partial = true;
                a.active[0] = false;
                a.saved[0] = a.backup.is_some() && !freeing;
                if !a.saved[0] {
                    a.defined[0] = false;
                }
                continue;
            }
            if a.chunk == 0 && state == State::Active {
                a.partial = false;
            }
            // A failed resume may leave paused segments mapped that it could not unmap while
            // undoing (an unmap fault), or a non-blocking one memory it did not restore. A
            // unit the engine has mapped is not stuck (stuck segments are paused).
            for (u, &on) in now.iter().enumerate() {
                a.stuck[u] = !on && (a.stuck[u] || (self.faults && !freeing));
            }
            for (u, &on) in now.iter().enumerate() {
                match (a.active[u], on) {
                    (true, false) if freeing => {
                        a.active[u] = false;
                        a.defined[u] = false;
                        a.saved[u] = false;
                    }
                    (true, false) => {
                        a.pause(&[u]);
                    }
                    (false, true) => {
                        a.resume(&[u], retain);
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// A failure where one is allowed: out of memory always (the device is shared), anything
    /// with faults armed.
    fn allowed(&self, err: &tms::Error) -> Result<(), String> {
        if self.faults || err.is_oom() {
            Ok(())
        } else {
            Err(format!("unexpected error: {err}"))
        }
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        let e = self.e;
        match op {
            Op::Alloc {
                size,
                tag,
                backup,
                device,
                chunk,
            } => {
                let chunk = chunk * G;
                let size = if chunk > 0 {
                    size.next_multiple_of(chunk)
                } else {
                    *size
                };
                let mapped = size.next_multiple_of(G);
                let res = e.alloc(&AllocRequest {
                    size,
                    device: *device,
                    tag: self.tag(*tag),
                    backup: *backup,
                    chunk,
                });
                match res {
                    Err(err) => self.allowed(&err)?,
                    Ok(p) => {
                        let units = mapped.checked_div(chunk).map_or(1, |n| n as usize);
                        let prev = self.allocs.insert(
                            p,
                            MAlloc {
                                u: Units::new(size, mapped, *backup, chunk, units),
                                tag: *tag,
                                device: *device,
                                partial: false,
                                stuck: vec![false; units],
                            },
                        );
                        if prev.is_some() {
                            return Err(format!("{p:#x} handed out twice"));
                        }
                    }
                }
            }
            Op::Write { pick, seed } => {
                let Some(p) = self.nth(*pick, |a| a.active.iter().any(|x| *x)) else {
                    return Ok(());
                };
                let a = self.allocs.get_mut(&p).unwrap();
                let data = pattern(a.size as usize, *seed);
                for u in 0..a.active.len() {
                    if a.active[u] {
                        let (off, len) = a.span(u);
                        let part = &data[off as usize..(off + len) as usize];
                        write_raw(self.sim, p + off, part);
                        a.contents[off as usize..(off + len) as usize].copy_from_slice(part);
                        a.defined[u] = true;
                    }
                }
            }
            Op::Poke { pick, at, seed } => {
                if let Some((p, o, data)) = poke(&mut self.allocs, *pick, *at, *seed) {
                    write_raw(self.sim, p + o, &data);
                }
            }
            Op::Free { pick } => {
                let Some(p) = self.nth(*pick, |_| true) else {
                    return Ok(());
                };
                match e.free(p) {
                    Ok(true) => {
                        self.allocs.remove(&p);
                    }
                    Ok(false) => return Err(format!("free of {p:#x}: not ours")),
                    Err(err) => {
                        self.allowed(&err)?;
                        if self.engine_units(p).is_err() {
                            // Gone for the caller (only a handle leaked).
                            self.allocs.remove(&p);
                        } else {
                            self.resync(&[p], true)?;
                        }
                    }
                }
            }
            Op::Pause { tag } => {
                let ptrs = self.with_tag(*tag);
                let res = e.pause(Some(&self.tag(*tag)));
                match res {
                    Err(err) => {
                        self.allowed(&err)?;
                        self.resync(&ptrs, false)?;
                    }
                    Ok(r) => {
                        let (mut n, mut bytes, mut copied) = (0, 0, 0);
                        for p in &ptrs {
                            let a = self.allocs.get_mut(p).unwrap();
                            a.stuck.fill(false);
                            let us: Vec<usize> = if std::mem::take(&mut a.partial) {
                                vec![0]
                            } else {
                                (0..a.active.len()).filter(|&u| a.active[u]).collect()
                            };
                            if us.is_empty() {
                                continue;
                            }
                            let (b, c) = a.pause(&us);
                            n += 1;
                            bytes += b;
                            copied += c;
                        }
                        if !self.faults {
                            check_eq(
                                (r.allocations, r.bytes, r.copied + r.unchanged),
                                (n, bytes, copied),
                                "pause report",
                            )?;
                        }
                    }
                }
            }
            Op::Resume { tag, nb } => {
                let ptrs = self.with_tag(*tag);
                let name = self.tag(*tag);
                let before: Vec<Vec<bool>> =
                    ptrs.iter().map(|p| self.allocs[p].active.clone()).collect();
                let res = match nb {
                    None => e.resume(Some(&name)),
                    Some(_) => {
                        // Restore the tag's allocations in reverse order of address.
                        let order: Vec<u64> = ptrs.iter().rev().copied().collect();
                        Engine::resume_nonblocking(self.shared.clone(), Some(&name), &order, None)
                    }
                };
                let res = res.and_then(|r| {
                    // Wait for what it restores; the data is there once a wait returned.
                    match nb {
                        Some(true) if !self.faults => {
                            wait(e, None)?;
                        }
                        Some(_) => {
                            for p in &ptrs {
                                wait(e, Some(*p))?;
                            }
                        }
                        None => {}
                    }
                    Ok(r)
                });
                match res {
                    Err(err) => {
                        self.allowed(&err)?;
                        self.resync(&ptrs, false)?;
                        if !self.faults {
                            // Out of memory: nothing changed.
                            let after: Vec<Vec<bool>> =
                                ptrs.iter().map(|p| self.allocs[p].active.clone()).collect();
                            check_eq(after, before, "states after an out-of-memory resume")?;
                        }
                    }
                    Ok(r) => {
                        let (mut n, mut bytes, mut copied) = (0, 0, 0);
                        let retain = self.retain;
                        for p in &ptrs {
                            let a = self.allocs.get_mut(p).unwrap();
                            a.stuck.fill(false);
                            let us: Vec<usize> =
                                (0..a.active.len()).filter(|&u| !a.active[u]).collect();
                            if us.is_empty() {
                                continue;
                            }
                            let (b, c) = a.resume(&us, retain);
                            n += 1;
                            bytes += b;
                            copied += c;
                        }
                        if !self.faults {
                            check_eq(r.allocations, n, "resume report's allocations")?;
                            // (A non-blocking resume's bytes are those it restores.)
                            if nb.is_none() {
                                check_eq((r.bytes, r.copied), (bytes, copied), "resume report")?;
                            }
                        }
                    }
                }
            }
            Op::Chunks { pick, mask, pause } => {
                let Some(p) = self.nth(*pick, |a| a.chunk > 0) else {
                    return Ok(());
                };
                let n = self.allocs[&p].active.len();
                let idx: Vec<usize> = (0..n).filter(|u| mask >> (u % 64) & 1 == 1).collect();
                let call = Pick::chunks(p, &idx);
                let before = self.allocs[&p].active.clone();
                let res = if *pause {
                    e.pause_pick(&call)
                } else {
                    e.resume_pick(&call)
                };
                match res {
                    Err(err) => {
                        self.allowed(&err)?;
                        self.resync(&[p], false)?;
                        if !self.faults {
                            check_eq(&self.allocs[&p].active, &before, "chunks after OOM")?;
                        }
                    }
                    Ok(r) => {
                        let retain = self.retain;
                        let a = self.allocs.get_mut(&p).unwrap();
                        let us: Vec<usize> = idx
                            .iter()
                            .copied()
                            .filter(|&u| a.active[u] == *pause)
                            .collect();
                        // What a failed resume left mapped is given back by a pause only for
                        // the chunks it names; by a resume, all of it, but only where the
                        // resume restores some chunk of the allocation (one that names no
                        // paused chunk does nothing).
                        if *pause {
                            for &u in &idx {
                                a.stuck[u] = false;
                            }
                        } else if !us.is_empty() {
                            a.stuck.fill(false);
                        }
                        let (b, c) = if us.is_empty() {
                            (0, 0)
                        } else if *pause {
                            a.pause(&us)
                        } else {
                            a.resume(&us, retain)
                        };
                        let want = (usize::from(!us.is_empty()), b);
                        if !self.faults {
                            check_eq((r.allocations, r.bytes), want, "chunks report")?;
                            let got = if *pause {
                                r.copied + r.unchanged
                            } else {
                                r.copied
                            };
                            check_eq(got, c, "chunks report's copied bytes")?;
                        }
                    }
                }
            }
            Op::SetChecks { tag, skip, verify } => e.set_checks(
                Some(&self.tag(*tag)),
                Checks {
                    skip_unchanged: *skip,
                    verify: *verify,
                },
            ),
            Op::Arm(f) => {
                // One fault armed at a time: a second one could fail every try of the undo of
                // the first failure, which leaks by design. Armed while no other thread is in a
                // step (see `run_case`): armed during another thread's call, it could meet that
                // call's undo of a fault that just fired there (seen, before `map_segment`'s undo
                // was retried: a SetAccess fault in an allocation, then an Unmap fault armed by
                // another thread failing its one unmap, leaving a chunk mapped).
                self.sim.clear_faults();
                disk::clear_faults(Some(self.dir));
                match *f {
                    Fault::Prim(p, nth) => self.sim.arm_fault(p, nth, 999),
                    Fault::Disk(o, nth) => disk::arm_fault(Some(self.dir), o, nth, libc::EIO),
                }
            }
        }
        Ok(())
    }

    /// The engine agrees with this thread's model about its allocations and tags.
    fn check(&self) -> Result<(), String> {
        let e = self.e;
        let mine = |t: &str| (0..TAGS).any(|k| self.tag(k) == t);
        let infos: Vec<_> = e
            .allocations()
            .into_iter()
            .filter(|i| mine(&i.tag))
            .collect();
        check_eq(
            infos.iter().map(|i| i.addr).collect::<Vec<_>>(),
            self.allocs.keys().copied().collect::<Vec<_>>(),
            "addresses",
        )?;
        for i in &infos {
            let a = &self.allocs[&i.addr];
            let p = i.addr;
            check_eq(
                (i.size, i.mapped, i.device, i.tag.clone(), i.backup, i.chunk),
                (
                    a.size,
                    a.mapped,
                    a.device,
                    self.tag(a.tag),
                    a.backup,
                    a.chunk,
                ),
                &format!("allocation {p:#x}"),
            )?;
            if a.stuck.iter().any(|s| *s) {
                // Unrestored memory left mapped: shown paused (or partly so), not active.
                if i.state == State::Active {
                    return Err(format!("{p:#x} left unrestored is shown active"));
                }
            } else if a.partial {
                // Which segments a failed pause or free left mapped, the model does not know.
                check_eq(i.state, State::Partial, &format!("state of {p:#x}"))?;
            } else {
                check_eq(
                    (i.state, i.active_bytes),
                    (a.state(), a.live()),
                    &format!("state of {p:#x}"),
                )?;
            }
            if a.chunk > 0 {
                let c = e.chunk_info(p).map_err(|e| format!("chunk info: {e}"))?;
                check_eq(&c.active, &a.active, &format!("chunk states of {p:#x}"))?;
            }
            if a.partial {
                continue;
            }
            for u in 0..a.active.len() {
                let (off, len) = a.span(u);
                let (first, last) = (p + off, p + off + a.unit() - 1);
                let want = &a.contents[off as usize..(off + len) as usize];
                if a.active[u] {
                    if !(self.sim.is_accessible(first) && self.sim.is_accessible(last)) {
                        return Err(format!("active {p:#x} unit {u} is not accessible"));
                    }
                    if a.defined[u] && read_raw(self.sim, first, len as usize) != want {
                        return Err(format!("contents of active {p:#x} unit {u} differ"));
                    }
                } else {
                    if !a.stuck[u]
                        && (self.sim.is_accessible(first) || self.sim.is_accessible(last))
                    {
                        return Err(format!("paused {p:#x} unit {u} is accessible"));
                    }
                    let mut b = vec![0u8; len as usize];
                    let has = e
                        .copy_cpu_backup(first, &mut b)
                        .map_err(|e| format!("copy of the backup of {first:#x}: {e}"))?;
                    let offered = a.backup.is_some() && a.backup != Some(BackupKind::Disk);
                    if !self.faults && has != offered {
                        return Err(format!("backup of paused {p:#x} unit {u}: offered {has}"));
                    }
                    if has && a.defined[u] && b != want {
                        return Err(format!("backup of paused {p:#x} unit {u} differs"));
                    }
                }
            }
        }
        if !self.faults {
            let stats = e.stats();
            for t in 0..TAGS {
                let name = self.tag(t);
                let of: Vec<&MAlloc> = self.allocs.values().filter(|a| a.tag == t).collect();
                let want = (
                    of.len(),
                    of.iter().map(|a| a.live()).sum::<u64>(),
                    of.iter().map(|a| a.mapped - a.live()).sum::<u64>(),
                    0,
                    0,
                    None,
                );
                let got =
                    stats
                        .tags
                        .iter()
                        .find(|s| s.tag == name)
                        .map_or((0, 0, 0, 0, 0, None), |s| {
                            (
                                s.allocations,
                                s.bytes_active,
                                s.bytes_paused,
                                s.bytes_restoring,
                                s.bytes_unrestored,
                                s.failed_restore.clone(),
                            )
                        });
                check_eq(
                    got,
                    want,
                    &format!(
                        "stats of {name} (allocations, active, paused, restoring, unrestored, \
                         failed_restore)"
                    ),
                )?;
            }
        }
        Ok(())
    }

    /// At the end, alone: resume every tag (out of memory only where the device cannot hold
    /// it) and check.
    fn resume_all(&mut self) -> Result<(), String> {
        for t in 0..TAGS {
            let ptrs = self.with_tag(t);
            let need = |d: i32| {
                ptrs.iter()
                    .map(|p| &self.allocs[p])
                    .filter(|a| a.device == d)
                    .map(|a| a.mapped - a.live())
                    .sum::<u64>()
            };
            // (Memory left unrestored counts as used and as needed: out of memory is then
            // allowed where it need not be.)
            let room = (0..2).all(|d| self.sim.live_bytes(d) + need(d) <= CAPACITY);
            match self.e.resume(Some(&self.tag(t))) {
                Ok(_) => {
                    let retain = self.retain;
                    for p in &ptrs {
                        let a = self.allocs.get_mut(p).unwrap();
                        let us: Vec<usize> =
                            (0..a.active.len()).filter(|&u| !a.active[u]).collect();
                        a.stuck.fill(false);
                        a.resume(&us, retain);
                    }
                }
                Err(err) if err.is_oom() && !room => self.resync(&ptrs, false)?,
                Err(err) => return Err(format!("final resume of {}: {err}", self.tag(t))),
            }
            self.check()?;
        }
        Ok(())
    }

    /// Free everything.
    fn free_all(&mut self) -> Result<(), String> {
        for p in self.allocs.keys().copied().collect::<Vec<_>>() {
            match self.e.free(p) {
                Ok(true) => {}
                other => return Err(format!("final free of {p:#x}: {other:?}")),
            }
            self.allocs.remove(&p);
        }
        self.check()
    }
}

fn wait(e: &Engine, p: Option<u64>) -> tms::Result<()> {
    if !e.wait_restored(p, Some(PATIENCE))? {
        panic!("a wait for {p:x?} did not return within {PATIENCE:?}: a hang");
    }
    Ok(())
}

fn check_eq<T: PartialEq + std::fmt::Debug>(got: T, want: T, what: &str) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, expected {want:?}"))
    }
}

/// One case: `threads` op lists run at once on `h`'s engine.
fn run_case(
    h: &Harness,
    threads: &[Vec<Op>],
    retain: bool,
    segment: u64,
    faults: bool,
) -> Result<(), TestCaseError> {
    let (e, sim, dir) = (&*h.e, h.simulated(), h.dir());
    e.set_retain_cpu_backup(retain);
    e.set_segment_bytes(segment).unwrap();
    let barrier = Barrier::new(threads.len());
    // Steps share it, arming a fault takes it alone (see `Op::Arm`).
    let arming = RwLock::new(());
    let mut models: Vec<Thread> = (0..threads.len())
        .map(|id| Thread {
            id,
            e,
            shared: h.e.clone(),
            sim,
            dir,
            allocs: BTreeMap::new(),
            retain,
            faults,
        })
        .collect();
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = models
            .iter_mut()
            .zip(threads)
            .map(|(m, ops)| {
                let (barrier, arming) = (&barrier, &arming);
                s.spawn(move || {
                    barrier.wait();
                    for (n, op) in ops.iter().enumerate() {
                        let stepped = if matches!(op, Op::Arm(_)) {
                            let _alone = arming.write().unwrap();
                            m.step(op)
                        } else {
                            let _shared = arming.read().unwrap();
                            m.step(op)
                        };
                        stepped.map_err(|err| format!("thread {} step {n} {op:?}: {err}", m.id))?;
                        m.check().map_err(|err| {
                            format!("thread {} after step {n} {op:?}: {err}", m.id)
                        })?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for r in results {
        r.map_err(TestCaseError::fail)?;
    }
    sim.clear_faults();
    disk::clear_faults(Some(dir));
    // Alone now: every thread's data once more, then everything freed.
    for m in &mut models {
        m.check()
            .and_then(|_| m.resume_all())
            .map_err(|err| TestCaseError::fail(format!("thread {} at the end: {err}", m.id)))?;
    }
    // The device holds exactly what the registry implies (once the background pinner is idle).
    prop_assert!(e.wait_for_background_pinning(PATIENCE));
    h.check_invariants(&Expect::clean())
        .map_err(|err| TestCaseError::fail(format!("at the end: {err}; {:#?}", e.allocations())))?;
    for m in &mut models {
        m.free_all()
            .map_err(|err| TestCaseError::fail(format!("thread {} freeing: {err}", m.id)))?;
    }
    drop(models);
    // Nothing left on the device, nor page-locked on the host.
    prop_assert!(e.allocations().is_empty());
    all_unpinned(e, sim)?;
    prop_assert_eq!(
        (
            sim.live_bytes(0),
            sim.live_bytes(1),
            sim.live_handles(),
            sim.live_mappings(),
            sim.live_reservations()
        ),
        (0, 0, 0, 0, 0),
        "device memory held after every thread freed its allocations"
    );
    // Not marked broken: a pauseable allocation, a pause and a resume still work.
    let p = e
        .alloc(&AllocRequest::new(G, "probe", Some(BackupKind::Pinned)))
        .map_err(|err| TestCaseError::fail(format!("allocation after the run: {err}")))?;
    e.pause(Some("probe"))
        .and_then(|_| e.resume(Some("probe")))
        .map_err(|err| TestCaseError::fail(format!("pause and resume after the run: {err}")))?;
    prop_assert!(e.free(p).unwrap());
    all_unpinned(e, sim)
}

/// With every allocation freed, no page-locked host memory is left once the engine's work
/// beside the transactions is done: what the last resumes give back on a thread of their own
/// (`wait_released`, Note [Releases] in `background.rs`) and a backup the background pinner
/// still held while its allocation was freed (its memory goes with the pinner's reference:
/// Note [The background pinner]). The staging slots went with the last allocation with a
/// backup.
fn all_unpinned(e: &Engine, sim: &SimDriver) -> Result<(), TestCaseError> {
    e.wait_released();
    prop_assert!(e.wait_for_background_pinning(PATIENCE));
    prop_assert_eq!(
        (sim.pinned_bytes(), e.staging_bytes()),
        (0, 0),
        "page-locked host bytes (and those in staging slots) after every allocation was \
         freed; registered {:?}",
        sim.host_registrations()
    );
    Ok(())
}

/// Drop the engine once the non-blocking resumes' threads let go of it, and check that it gave
/// everything back: at once, page-locked host memory too (`run_case` left the background
/// pinner idle and nothing being given back: `all_unpinned`).
fn end(h: Harness) -> Result<common::harness::Ended, TestCaseError> {
    common::wait_until("the engine is no longer shared", PATIENCE, || {
        Arc::strong_count(&h.e) == 1
    });
    let ended = h.end();
    ended.released().map_err(TestCaseError::fail)?;
    Ok(ended)
}

fn setup() -> Setup {
    Setup::default()
        .devices(2)
        .capacity(CAPACITY)
        .granularity(G)
        .disk()
}

/// Cases run by each test: `TMS_CONCURRENT_CASES` (a longer hunt), or `default` (64: a few
/// seconds in a debug build).
fn cases(default: u32) -> u32 {
    std::env::var("TMS_CONCURRENT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn strategy(faults: bool) -> impl Strategy<Value = (Vec<Vec<Op>>, CopyConfig, bool, u64)> {
    (
        prop::collection::vec(prop::collection::vec(op_strategy(faults), 1..=25), 2..=4),
        copy_config_strategy(),
        any::<bool>(),
        prop_oneof![Just(G), Just(2 * G), Just(1u64 << 30)],
    )
}

/// Cases of threads on their own tags at once, transient faults armed or not: each ends with
/// its files removed.
fn threads_against_their_models(h: &Harness, faults: bool) {
    run_proptest(
        cases(64),
        strategy(faults),
        |(threads, cfg, retain, segment)| {
            let h = h.again();
            h.e.set_copy_config(cfg).unwrap();
            run_case(&h, &threads, retain, segment, faults)?;
            let ended = end(h)?;
            prop_assert_eq!(ended.files(), 0, "files removed");
            Ok(())
        },
    );
}

engine_test! {
    /// Threads on their own tags at once, no faults: each thread's model stays exact.
    sim_only fn threads_match_their_models(h) [setup()] {
        threads_against_their_models(&h, false);
    }
}

engine_test! {
    /// Threads on their own tags at once, arming transient faults that fire in any thread's
    /// call: whatever fails, nothing backed up or mapped is lost, and the end is clean.
    sim_only fn threads_survive_faults(h) [setup()] {
        threads_against_their_models(&h, true);
    }
}
