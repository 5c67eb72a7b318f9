//! Fault injection at every simulated driver primitive ([`Prim::ALL`]) on the alloc, pause,
//! resume and free paths, at every call index within a multi-allocation operation.
//!
//! Each case builds a fresh engine over a fresh simulated machine, arms one fault (`prim`, `nth`,
//! `code`), runs the operation, and then checks, with faults cleared:
//! - the failure came back as an error (not a panic) naming the driver call and the operation;
//! - the registry tells the truth (Active = accessible in the sim, Paused = not; sim live
//!   bytes/handles/mappings/reservations/pinned bytes equal what the registry implies, plus only
//!   the leaks the engine documents);
//! - no byte that was backed up or still on the device is lost: a `resume(None)` succeeds and
//!   brings back exactly the original contents;
//! - freeing everything leaves nothing but the documented leaks.
//!
//! For each primitive, `nth` runs from 1 until the fault no longer fires (the operation does not
//! call the primitive that often). The set of primitives that fired on each path is asserted too,
//! so the harness cannot silently stop exercising a path.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use common::{assert_invariants, pattern, read_raw, write_raw, Expect, Leaks};
use tms::backup::BackupKind;
use tms::driver::sim::{Prim, SimDriver};
use tms::engine::{AllocInfo, AllocRequest, CopyConfig, Engine, PinMode, State};
use tms::{Backup, Error};

/// Sim granularity: small, so thousands of cases stay fast in debug builds, but a multiple of
/// the page size (64 KiB on some arm64 kernels), as the sim's granularity must be.
fn g() -> u64 {
    (16 << 10u64).max(tms::os::page_size())
}
const CAPACITY: u64 = 1 << 30;
/// Fault codes tried: CUDA_ERROR_UNKNOWN and CUDA_ERROR_OUT_OF_MEMORY.
const CODES: [i32; 2] = [999, 2];

const PINNED: Backup = Some(BackupKind::Pinned);
const MMAP: Backup = Some(BackupKind::Mmap);

/// The three allocations of the operation under test: odd sizes, two devices.
fn sizes() -> [u64; 3] {
    [g() + 1, 2 * g() - 7, 3 * g() + 4097]
}
const DEVICES: [i32; 3] = [0, 1, 0];
/// A bystander of another tag ("u"), with a pinned backup.
fn bystander() -> u64 {
    g() / 2 + 3
}

/// Compare without dumping megabytes on failure.
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: contents differ from byte {i} on ({:#04x} != {:#04x})",
            got[i], want[i]
        );
    }
}

struct Tracked {
    addr: u64,
    size: u64,
    mapped: u64,
    device: i32,
    tag: String,
    backup: Backup,
    data: Vec<u8>,
    /// `data` is what the allocation holds (false once it was paused without a backup).
    intact: bool,
    /// What the allocation held before `data` was written over a retained backup: the snapshot
    /// that backup may still hold.
    snapshot: Option<Vec<u8>>,
}

struct Fx {
    sim: Arc<SimDriver>,
    e: Arc<Engine>,
    t: Vec<Tracked>,
    /// What the engine is allowed to have leaked after the injected failure.
    leaks: Leaks,
    seed: u64,
}

impl Fx {
    fn new() -> Fx {
        // One copy worker per device: the order in which allocations finish is then fixed, and
        // the harness can check exactly which ones a failure leaves paused. Pinned backups are
        // page-locked inline, so no background thread calls the driver while a fault is armed.
        // The pipeline's parallel paths have their own fault tests (tests/pipeline.rs).
        let setup = common::Setup::default()
            .devices(2)
            .capacity(CAPACITY)
            .granularity(g())
            .copy(CopyConfig {
                threads: 1,
                pin: PinMode::Inline,
                ..CopyConfig::default()
            });
        let (sim, e) = common::sim_engine(&setup);
        Fx {
            sim,
            e,
            t: Vec::new(),
            leaks: Leaks::default(),
            seed: 1,
        }
    }

    fn next_seed(&mut self) -> u64 {
        self.seed += 1;
        self.seed
    }

    /// Register an allocation the engine handed out; contents not yet written.
    fn track(&mut self, addr: u64, size: u64, device: i32, tag: &str, backup: Backup) {
        self.t.push(Tracked {
            addr,
            size,
            mapped: size.next_multiple_of(g()),
            device,
            tag: tag.to_string(),
            backup,
            data: Vec::new(),
            intact: false,
            snapshot: None,
        });
    }

    /// Allocate (faults must be clear) and fill with random data.
    fn add(&mut self, size: u64, device: i32, tag: &str, backup: Backup) -> u64 {
        let addr = self
            .e
            .alloc(&AllocRequest {
                size,
                device,
                tag: tag.into(),
                backup,
                chunk: 0,
            })
            .unwrap();
        self.track(addr, size, device, tag, backup);
        self.fill_unwritten();
        addr
    }

    /// Give every active allocation without known contents fresh random data.
    fn fill_unwritten(&mut self) {
        self.refill(false);
    }

    /// Give every active allocation fresh random data.
    fn rewrite_all(&mut self) {
        self.refill(true);
    }

    fn refill(&mut self, all: bool) {
        let infos = self.infos();
        for i in 0..self.t.len() {
            let (addr, size) = (self.t[i].addr, self.t[i].size);
            if infos[&addr].state == State::Active && (all || !self.t[i].intact) {
                let data = pattern(size as usize, self.next_seed());
                write_raw(&self.sim, addr, &data);
                let old = std::mem::replace(&mut self.t[i].data, data);
                self.t[i].snapshot = (infos[&addr].host_valid && self.t[i].intact).then_some(old);
                self.t[i].intact = true;
            }
        }
    }

    fn infos(&self) -> BTreeMap<u64, AllocInfo> {
        self.e
            .allocations()
            .into_iter()
            .map(|i| (i.addr, i))
            .collect()
    }

    fn index_of(&self, addr: u64) -> usize {
        self.t
            .iter()
            .position(|t| t.addr == addr)
            .unwrap_or_else(|| panic!("{addr:#x} is not tracked"))
    }

    fn forget(&mut self, addr: u64) {
        let i = self.index_of(addr);
        self.t.remove(i);
    }

    /// Allocations now paused without a backup have lost their contents.
    fn mark_lost(&mut self) {
        let infos = self.infos();
        for t in &mut self.t {
            if t.backup.is_none() && infos[&t.addr].state == State::Paused {
                t.intact = false;
            }
        }
    }

    /// The single tracked allocation whose address the message names.
    fn named(&self, msg: &str) -> Option<u64> {
        let hits: Vec<u64> = self
            .t
            .iter()
            .map(|t| t.addr)
            .filter(|a| msg.contains(&format!("{a:#x} (")))
            .collect();
        assert!(hits.len() <= 1, "{msg}: names several allocations");
        hits.first().copied()
    }

    /// Page-locked bytes the engine accounts for: backups and staging slots.
    fn pinned_in_registry(&self) -> u64 {
        self.e
            .allocations()
            .iter()
            .map(|i| i.host_pinned_bytes)
            .sum::<u64>()
            + self.e.staging_bytes()
    }

    /// The registry tells the truth about every tracked allocation (contents, backups), and the
    /// sim holds exactly what it implies (the shared invariant check).
    fn check(&self, ctx: &str) {
        let infos = self.e.allocations();
        let got: Vec<u64> = infos.iter().map(|i| i.addr).collect();
        let mut want: Vec<u64> = self.t.iter().map(|t| t.addr).collect();
        want.sort_unstable();
        assert_eq!(
            got, want,
            "{ctx}: the registry holds exactly the live allocations"
        );
        for i in &infos {
            let t = &self.t[self.index_of(i.addr)];
            let a = i.addr;
            assert_eq!(
                (i.size, i.mapped, i.device, i.tag.as_str(), i.backup),
                (t.size, t.mapped, t.device, t.tag.as_str(), t.backup),
                "{ctx}: {a:#x} registry fields"
            );
            match i.state {
                State::Active => {
                    // Active with a valid backup: only a retained, complete snapshot of the
                    // last pause (never one a failed pause left half written).
                    let mut b = vec![0u8; t.size as usize];
                    let has = self.e.copy_cpu_backup(a, &mut b).unwrap();
                    assert_eq!(has, i.host_valid, "{ctx}: {a:#x} backup offered");
                    if has {
                        assert!(
                            self.e.retain_cpu_backup(),
                            "{ctx}: {a:#x} is active with a backup that was not retained"
                        );
                        assert!(
                            b == t.data || t.snapshot.as_ref().is_some_and(|s| *s == b),
                            "{ctx}: active {a:#x} offers a backup that is no snapshot of it"
                        );
                    }
                    if t.intact {
                        assert_same(
                            &read_raw(&self.sim, a, t.size as usize),
                            &t.data,
                            &format!("{ctx}: active {a:#x} on device"),
                        );
                    }
                }
                State::Paused => {
                    if t.backup.is_some() {
                        assert!(
                            i.host_valid && i.host_bytes == i.size,
                            "{ctx}: paused {a:#x} with backup: host_valid {} host_bytes {}",
                            i.host_valid,
                            i.host_bytes
                        );
                        let mut b = vec![0u8; t.size as usize];
                        assert!(
                            self.e.copy_cpu_backup(a, &mut b).unwrap(),
                            "{ctx}: {a:#x} no backup"
                        );
                        assert!(t.intact, "{ctx}: {a:#x} backed up allocation lost track");
                        assert_same(&b, &t.data, &format!("{ctx}: backup of paused {a:#x}"));
                    } else {
                        assert!(!i.host_valid && i.host_bytes == 0, "{ctx}: {a:#x} host");
                    }
                }
                s => panic!("{ctx}: {a:#x} left {s:?} after the call returned"),
            }
            if i.backup != PINNED {
                assert_eq!(
                    i.host_pinned_bytes, 0,
                    "{ctx}: {a:#x}: only pinned backups are page-locked"
                );
            }
        }
        let expect = Expect {
            leaks: self.leaks.clone(),
            copies_done: false,
        };
        assert_invariants(&self.e, &self.sim, &expect, ctx);
    }

    /// Clear faults, resume everything, check every surviving byte, free everything, and check
    /// that only the documented leaks are left.
    fn recover(mut self, ctx: &str) {
        self.sim.clear_faults();
        if let Err(e) = self.e.resume(None) {
            panic!("{ctx}: resume after clearing faults failed: {e}");
        }
        assert!(
            self.e
                .allocations()
                .iter()
                .all(|i| i.state == State::Active),
            "{ctx}: all active after the recovery resume"
        );
        self.check(&format!("{ctx} (after recovery resume)"));
        for t in std::mem::take(&mut self.t) {
            match self.e.free(t.addr) {
                Ok(true) => {}
                other => panic!("{ctx}: freeing {:#x} after recovery: {other:?}", t.addr),
            }
        }
        assert!(self.e.allocations().is_empty());
        let l = &self.leaks;
        assert_eq!(
            (
                self.sim.live_bytes(0),
                self.sim.live_bytes(1),
                self.sim.live_handles(),
                self.sim.live_mappings(),
                self.sim.live_reservations(),
                self.sim.pinned_bytes()
            ),
            (
                l.bytes_on(0).unwrap_or(0),
                l.bytes_on(1).unwrap_or(0),
                l.handles,
                0,
                l.reservations,
                l.pinned
            ),
            "{ctx}: after freeing everything only the documented leaks remain"
        );
    }
}

#[derive(Clone, Copy, Debug)]
enum Case {
    /// Allocate three (two allocations exist already, one of them paused).
    Alloc { margin: bool },
    /// Pause tag "t" (or all) holding three allocations with these backups.
    Pause {
        backups: [Backup; 3],
        all: bool,
        /// Host buffers retained from an earlier pause/resume (so the pause reuses them).
        retained: bool,
    },
    /// Resume tag "t" (or all) after pausing it.
    Resume {
        backups: [Backup; 3],
        all: bool,
        retain: bool,
    },
    /// Free three allocations (tags f0, f1, f2), those flagged paused first.
    Free {
        backups: [Backup; 3],
        paused: [bool; 3],
    },
}

impl Case {
    fn op_word(&self) -> &'static str {
        match self {
            Case::Alloc { .. } => "allocating",
            Case::Pause { .. } => "pause of",
            Case::Resume { .. } => "resume of",
            Case::Free { .. } => "freeing",
        }
    }

    fn selector(all: bool) -> Option<&'static str> {
        if all {
            None
        } else {
            Some("t")
        }
    }
}

/// The state before the operation.
struct Setup {
    fx: Fx,
    /// Addresses the operation works on, in the engine's order (device, then address).
    order: Vec<u64>,
}

fn setup(case: &Case) -> Setup {
    let mut fx = Fx::new();
    let by_device_order = |fx: &Fx, pick: &dyn Fn(&AllocInfo) -> bool| {
        let mut v: Vec<(i32, u64)> =
            fx.e.allocations()
                .iter()
                .filter(|i| pick(i))
                .map(|i| (i.device, i.addr))
                .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, a)| a).collect::<Vec<u64>>()
    };
    match *case {
        Case::Alloc { margin } => {
            fx.add(g() + 5, 0, "t", PINNED);
            fx.add(2 * g(), 1, "u", PINNED);
            fx.e.pause(Some("u")).unwrap();
            if margin {
                fx.e.set_memory_margin(1);
            }
            Setup {
                fx,
                order: Vec::new(),
            }
        }
        Case::Pause {
            backups,
            all,
            retained,
        } => {
            for k in 0..3 {
                fx.add(sizes()[k], DEVICES[k], "t", backups[k]);
            }
            fx.add(bystander(), 1, "u", PINNED);
            if retained {
                fx.e.set_retain_cpu_backup(true);
                fx.e.pause(None).unwrap();
                fx.e.resume(None).unwrap();
                fx.rewrite_all();
            }
            let order = by_device_order(&fx, &|i| all || i.tag == "t");
            Setup { fx, order }
        }
        Case::Resume {
            backups,
            all,
            retain,
        } => {
            for k in 0..3 {
                fx.add(sizes()[k], DEVICES[k], "t", backups[k]);
            }
            fx.add(bystander(), 1, "u", PINNED);
            fx.e.pause(Case::selector(all)).unwrap();
            fx.mark_lost();
            fx.e.set_retain_cpu_backup(retain);
            let order = by_device_order(&fx, &|i| all || i.tag == "t");
            Setup { fx, order }
        }
        Case::Free { backups, paused } => {
            let mut order = Vec::new();
            for k in 0..3 {
                order.push(fx.add(sizes()[k], DEVICES[k], &format!("f{k}"), backups[k]));
            }
            fx.add(bystander(), 1, "u", PINNED);
            for (k, _) in paused.iter().enumerate().filter(|(_, p)| **p) {
                fx.e.pause(Some(&format!("f{k}"))).unwrap();
            }
            fx.mark_lost();
            Setup { fx, order }
        }
    }
}

/// Run the operation, keeping `fx.t` in step with what it allocated or freed.
fn op(case: &Case, fx: &mut Fx, order: &[u64]) -> Result<(), Error> {
    match *case {
        Case::Alloc { .. } => {
            let reqs = [
                (g() / 2 + 1, 1, PINNED),
                (2 * g() + 3, 0, None),
                (1, 1, MMAP),
            ];
            for (size, device, backup) in reqs {
                let addr = fx.e.alloc(&AllocRequest {
                    size,
                    device,
                    tag: "n".into(),
                    backup,
                    chunk: 0,
                })?;
                fx.track(addr, size, device, "n", backup);
            }
            Ok(())
        }
        Case::Pause { all, .. } => fx.e.pause(Case::selector(all)).map(|_| ()),
        Case::Resume { all, .. } => fx.e.resume(Case::selector(all)).map(|_| ()),
        Case::Free { .. } => {
            for &addr in order {
                match fx.e.free(addr)? {
                    true => fx.forget(addr),
                    false => panic!("free({addr:#x}): not ours"),
                }
            }
            Ok(())
        }
    }
}

/// One case with one fault. Returns whether the fault fired.
fn run(case: &Case, prim: Prim, nth: u64, code: i32) -> bool {
    let ctx = format!("{case:?} with fault {prim} #{nth} code {code}");
    let Setup { mut fx, order } = setup(case);
    let before = fx.infos();
    // What one failed unregistration may leave page-locked: one backup (a chunk: these are
    // smaller than a chunk) or one staging slot.
    let slot = fx.e.copy_config().slot;
    let pinned_candidates: BTreeSet<u64> = before
        .values()
        .filter(|i| i.backup.is_some())
        .map(|i| i.size.next_multiple_of(tms::os::page_size()))
        .chain([slot])
        .collect();
    let pinned_before = fx.sim.pinned_bytes();
    fx.sim.arm_fault(prim, nth, code);
    let result = catch_unwind(AssertUnwindSafe(|| op(case, &mut fx, &order)))
        .unwrap_or_else(|_| panic!("{ctx}: the engine panicked instead of returning an error"));
    // A resume's host memory goes back after it returned: that is part of the operation too.
    fx.e.wait_released();
    let fired = fx.sim.pending_faults() == 0;
    fx.sim.clear_faults();

    match (&result, fired) {
        (Ok(()), false) => {}
        (Err(e), false) => panic!("{ctx}: failed although the fault did not fire: {e}"),
        (Ok(()), true) => {
            // The one failure the engine swallows: unregistering host memory on its way out
            // (logged; a retry in the buffer's drop may still succeed, else it leaks). Nothing
            // else may be swallowed.
            assert_eq!(
                prim,
                Prim::HostUnregister,
                "{ctx}: the injected fault was swallowed"
            );
            let leak = fx.sim.pinned_bytes() - fx.pinned_in_registry();
            assert!(
                leak == 0 || pinned_candidates.contains(&leak),
                "{ctx}: a failed unregistration leaks at most one buffer or slot, leaked {leak} \
                 (before: {pinned_before}, candidates {pinned_candidates:?})"
            );
            fx.leaks.pinned += leak;
        }
        (Err(e), true) => {
            let msg = e.to_string();
            assert!(
                msg.contains(prim.call()) && msg.contains("injected fault"),
                "{ctx}: the error names the call: {msg}"
            );
            assert!(
                msg.contains(case.op_word()),
                "{ctx}: the error names the operation: {msg}"
            );
            assert_eq!(e.is_oom(), code == 2, "{ctx}: error kind: {msg}");
            if matches!(case, Case::Pause { .. } | Case::Resume { .. }) {
                assert_eq!(
                    e.changed(),
                    Some(changed_between(&before, &fx.infos())),
                    "{ctx}: what the failed operation says it changed: {msg}"
                );
            }
            after_error(case, &mut fx, &before, &order, prim, &msg, &ctx);
        }
    }
    fx.fill_unwritten();
    fx.mark_lost();
    fx.check(&ctx);
    fx.recover(&ctx);
    fired
}

/// What a pause or resume changed, from the allocations before and after it: those whose
/// mapped bytes differ, and by how many (nothing else acts on them meanwhile).
fn changed_between(
    before: &BTreeMap<u64, AllocInfo>,
    now: &BTreeMap<u64, AllocInfo>,
) -> tms::error::Changed {
    let mut c = tms::error::Changed::NOTHING;
    for (a, b) in before {
        let d = now
            .get(a)
            .map_or(0, |i| i.active_bytes.abs_diff(b.active_bytes));
        if d > 0 {
            c.allocations += 1;
            c.bytes += d;
        }
    }
    c
}

/// What each path promises about the state after a failure.
fn after_error(
    case: &Case,
    fx: &mut Fx,
    before: &BTreeMap<u64, AllocInfo>,
    order: &[u64],
    prim: Prim,
    msg: &str,
    ctx: &str,
) {
    let now = fx.infos();
    let unchanged_outside = |fx: &Fx, sel: &[u64]| {
        for (a, i) in &fx.infos() {
            if !sel.contains(a) {
                if let Some(b) = before.get(a) {
                    assert_eq!(b.state, i.state, "{ctx}: {a:#x} outside the operation");
                }
            }
        }
    };
    match case {
        Case::Alloc { .. } => {
            // Only the successful allocations appeared (check() compares the registry with the
            // tracked set); the earlier ones are unchanged.
            for (a, b) in before {
                assert_eq!(now[a].state, b.state, "{ctx}: {a:#x}");
            }
        }
        Case::Pause { .. } => {
            // Per device (devices run in parallel), one worker retires allocations in a fixed
            // order: those without backup first, then the others as their copies complete.
            // Those before the failing one are paused, the failing one is active (unless only its
            // release failed: then it is paused and its handle leaks), the rest are active.
            let named = fx.named(msg);
            let mut named_seen = false;
            for device in [0, 1] {
                let mut seq: Vec<(bool, u64)> = order
                    .iter()
                    .filter(|a| before[*a].device == device)
                    .map(|a| (before[a].backup.is_some(), *a))
                    .collect();
                seq.sort_unstable();
                let seq: Vec<u64> = seq.into_iter().map(|(_, a)| a).collect();
                let states: Vec<State> = seq.iter().map(|a| now[a].state).collect();
                let k = states.iter().take_while(|s| **s == State::Paused).count();
                assert!(
                    states[k..].iter().all(|s| *s == State::Active),
                    "{ctx}: device {device}: pause stops at the first failure: {states:?}"
                );
                let Some(a) = named.filter(|a| seq.contains(a)) else {
                    continue;
                };
                named_seen = true;
                if prim == Prim::Release {
                    assert!(k > 0 && seq[k - 1] == a, "{ctx}: {states:?} {msg}");
                } else {
                    assert_eq!(
                        seq.get(k),
                        Some(&a),
                        "{ctx}: the failing allocation stays active"
                    );
                }
            }
            if prim == Prim::Release {
                let a = named.unwrap_or_else(|| panic!("{ctx}: which allocation? {msg}"));
                assert!(named_seen, "{ctx}: {msg}");
                assert!(
                    msg.contains("handle"),
                    "{ctx}: the handle is reported: {msg}"
                );
                let t = &fx.t[fx.index_of(a)];
                fx.leaks.handle(t.device, t.mapped);
            } else {
                assert!(
                    order.iter().any(|a| now[a].state == State::Active),
                    "{ctx}: something failed"
                );
            }
            unchanged_outside(fx, order);
        }
        Case::Resume { .. } => {
            assert!(
                msg.contains("stays paused with its backups"),
                "{ctx}: resume says it was undone: {msg}"
            );
            for (a, b) in before {
                assert_eq!(
                    now[a].state, b.state,
                    "{ctx}: a failed resume changes nothing"
                );
                assert_eq!(now[a].host_valid, b.host_valid, "{ctx}: {a:#x} host_valid");
                assert_eq!(now[a].host_bytes, b.host_bytes, "{ctx}: {a:#x} host_bytes");
            }
        }
        Case::Free { .. } => {
            let a = fx
                .named(msg)
                .unwrap_or_else(|| panic!("{ctx}: which allocation? {msg}"));
            match prim {
                // Unmapped already: the allocation is gone for the caller; only the handle leaks
                // (engine/mod.rs, Engine::free).
                Prim::Release => {
                    assert!(
                        !fx.e.owns(a),
                        "{ctx}: {a:#x} is gone after a failed release"
                    );
                    assert_eq!(before[&a].state, State::Active);
                    let t = &fx.t[fx.index_of(a)];
                    fx.leaks.handle(t.device, t.mapped);
                    fx.forget(a);
                }
                // The address range could not be given back: the allocation is gone and its
                // reservation leaks (physical memory was released already).
                Prim::FreeRange => {
                    assert!(
                        !fx.e.owns(a),
                        "{ctx}: {a:#x} is gone after a failed free_range"
                    );
                    fx.leaks.reservations += 1;
                    fx.forget(a);
                }
                _ => {
                    assert!(fx.e.owns(a), "{ctx}: a failed free keeps {a:#x}");
                    assert_eq!(now[&a].state, before[&a].state, "{ctx}: {a:#x} state");
                }
            }
            unchanged_outside(fx, order);
        }
    }
}

/// Every primitive, every call index; returns the primitives that fired and their largest nth.
fn sweep(case: Case) -> BTreeMap<&'static str, u64> {
    let mut fired = BTreeMap::new();
    for prim in Prim::ALL {
        for code in CODES {
            let mut nth = 1;
            while run(&case, prim, nth, code) {
                fired.insert(prim.name(), nth);
                nth += 1;
                assert!(nth < 50, "{case:?}: {prim} keeps firing");
            }
        }
    }
    fired
}

fn names(prims: &[Prim]) -> BTreeSet<&'static str> {
    prims.iter().map(|p| p.name()).collect()
}

const BACKUP_SETS: [[Backup; 3]; 4] = [
    [None, None, None],
    [PINNED, PINNED, PINNED],
    [MMAP, MMAP, MMAP],
    [PINNED, None, MMAP],
];

#[test]
fn faults_on_alloc() {
    for margin in [false, true] {
        let case = Case::Alloc { margin };
        let fired = sweep(case);
        let mut want = vec![Prim::Reserve, Prim::Create, Prim::Map, Prim::SetAccess];
        if margin {
            want.push(Prim::MemInfo);
        }
        assert_eq!(
            fired.keys().copied().collect::<BTreeSet<_>>(),
            names(&want),
            "{case:?}"
        );
        assert_eq!(fired["reserve"], 3, "{case:?}: one reserve per allocation");
    }
}

#[test]
fn faults_on_pause() {
    let mut cases = Vec::new();
    for backups in BACKUP_SETS {
        for all in [false, true] {
            cases.push(Case::Pause {
                backups,
                all,
                retained: false,
            });
        }
    }
    for backups in &BACKUP_SETS[1..] {
        cases.push(Case::Pause {
            backups: *backups,
            all: false,
            retained: true,
        });
    }
    for case in cases {
        let Case::Pause {
            backups,
            all,
            retained,
        } = case
        else {
            unreachable!()
        };
        let fired = sweep(case);
        // The bystander (pinned) is part of a pause of all tags.
        let selected: Vec<Backup> = backups
            .iter()
            .copied()
            .chain(all.then_some(PINNED))
            .collect();
        let mut want = vec![Prim::Synchronize, Prim::Unmap, Prim::Release];
        if selected.iter().any(Option::is_some) {
            want.extend([
                Prim::CopyD2H,
                Prim::EventCreate,
                Prim::EventRecord,
                Prim::EventSync,
            ]);
        }
        if selected.iter().any(Option::is_some) && !retained {
            // Pinned backups are page-locked chunk by chunk; mmap ones need staging slots.
            want.push(Prim::HostRegister);
        }
        assert_eq!(
            fired.keys().copied().collect::<BTreeSet<_>>(),
            names(&want),
            "{case:?}"
        );
        assert_eq!(
            fired["unmap"],
            selected.len() as u64,
            "{case:?}: one unmap per allocation"
        );
        assert_eq!(fired["synchronize"], 2, "{case:?}: one per device");
    }
}

#[test]
fn faults_on_resume() {
    for backups in BACKUP_SETS {
        for all in [false, true] {
            for retain in [false, true] {
                let case = Case::Resume {
                    backups,
                    all,
                    retain,
                };
                let fired = sweep(case);
                let selected: Vec<Backup> = backups
                    .iter()
                    .copied()
                    .chain(all.then_some(PINNED))
                    .collect();
                let mut want = vec![Prim::Create, Prim::Map, Prim::SetAccess];
                if selected.iter().any(Option::is_some) {
                    want.extend([
                        Prim::CopyH2D,
                        Prim::EventCreate,
                        Prim::EventRecord,
                        Prim::EventSync,
                    ]);
                }
                if selected.iter().any(Option::is_some) && !retain {
                    // Page-locked backups and staging slots go back.
                    want.push(Prim::HostUnregister);
                }
                assert_eq!(
                    fired.keys().copied().collect::<BTreeSet<_>>(),
                    names(&want),
                    "{case:?}"
                );
                assert_eq!(fired["create"], selected.len() as u64, "{case:?}");
                let backed = selected.iter().filter(|b| b.is_some()).count() as u64;
                if backed > 0 {
                    assert_eq!(fired["copy_h2d"], backed, "{case:?}");
                }
            }
        }
    }
}

#[test]
fn faults_on_free() {
    let sets = [
        [PINNED, None, MMAP],
        [PINNED, PINNED, PINNED],
        [None, None, None],
    ];
    for backups in sets {
        for paused in [[false; 3], [true; 3], [true, false, true]] {
            let case = Case::Free { backups, paused };
            let fired = sweep(case);
            let mut want = vec![Prim::FreeRange];
            if paused.contains(&false) {
                want.extend([Prim::Synchronize, Prim::Unmap, Prim::Release]);
            }
            let pinned_held = (0..3).any(|k| paused[k] && backups[k] == PINNED);
            if pinned_held {
                want.push(Prim::HostUnregister);
            }
            assert_eq!(
                fired.keys().copied().collect::<BTreeSet<_>>(),
                names(&want),
                "{case:?}"
            );
            assert_eq!(fired["free_range"], 3, "{case:?}");
        }
    }
}

/// The documented promise, spelled out once: a failed resume leaves the tag paused with its
/// backups intact, and a later resume restores every byte.
#[test]
fn failed_resume_keeps_backups_and_a_retry_restores() {
    for prim in [Prim::Create, Prim::Map, Prim::SetAccess, Prim::CopyH2D] {
        let mut fx = Fx::new();
        let a = fx.add(sizes()[0], 0, "t", PINNED);
        let b = fx.add(sizes()[1], 1, "t", MMAP);
        let c = fx.add(sizes()[2], 0, "t", PINNED);
        fx.e.pause(Some("t")).unwrap();
        let live = (fx.sim.live_bytes(0), fx.sim.live_bytes(1));
        fx.sim.arm_fault(prim, 2, 999);
        let err = fx.e.resume(Some("t")).unwrap_err();
        assert_eq!(fx.sim.pending_faults(), 0);
        assert!(err.to_string().contains(prim.call()), "{err}");
        assert_eq!(
            (fx.sim.live_bytes(0), fx.sim.live_bytes(1)),
            live,
            "{prim}: undone"
        );
        for i in fx.e.allocations() {
            assert!(
                i.state == State::Paused && i.host_valid,
                "{prim}: {:#x}",
                i.addr
            );
        }
        fx.check(&format!("{prim}"));
        fx.e.resume(Some("t")).unwrap();
        for addr in [a, b, c] {
            let t = &fx.t[fx.index_of(addr)];
            assert_same(
                &read_raw(&fx.sim, addr, t.size as usize),
                &t.data,
                &format!("{prim}: {addr:#x}"),
            );
        }
        fx.recover(&format!("{prim}"));
    }
}

/// `AllocInfo::host_valid` is "true when the host backup holds the allocation's contents (paused
/// with backup)". When a pause copies the backup but then fails to unmap, the allocation stays
/// active (and may be written again), so its backup must not be reported valid.
#[test]
fn failed_unmap_in_pause_claims_no_valid_backup() {
    let mut fx = Fx::new();
    let a = fx.add(sizes()[0], 0, "t", PINNED);
    fx.sim.arm_fault(Prim::Unmap, 1, 999);
    let err = fx.e.pause(Some("t")).unwrap_err();
    assert!(err.to_string().contains("cuMemUnmap"), "{err}");
    let info = fx.e.allocations().remove(0);
    assert_eq!((info.addr, info.state), (a, State::Active));
    assert!(
        !info.host_valid,
        "active allocation {a:#x} after a failed unmap is reported with host_valid = true"
    );
}

/// How [`changed_case`] acts on tag "t".
#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    Pause,
    Resume,
    /// A non-blocking resume (an error is one before it returned).
    ResumeNonblocking,
}

/// One pause or resume (`act`) of tag "t" over allocations of several segments (one chunked,
/// one without backup, two devices) copied by several workers per device in small pieces,
/// with one fault armed: what its error says it changed is what it left changed, and a resume
/// then brings back every byte that had a backup. Returns whether the fault fired.
fn changed_case(act: Act, prim: Prim, nth: u64) -> bool {
    let ctx = format!("{act:?} with fault {prim} #{nth}");
    let piece = 64 << 10;
    let setup = common::Setup::default()
        .devices(2)
        .capacity(CAPACITY)
        .granularity(piece)
        .copy(CopyConfig {
            threads: 3,
            slot: piece,
            save_slot: piece,
            pin: PinMode::Inline,
            ..CopyConfig::default()
        });
    let (sim, e) = common::sim_engine(&setup);
    e.set_segment_bytes(2 * piece).unwrap();
    let allocs = [
        (8 * piece + 5, 0, PINNED, 0),
        (6 * piece, 1, MMAP, 0),
        (8 * piece, 0, PINNED, 2 * piece),
        (4 * piece, 1, None, 0),
    ];
    let mut held = Vec::new();
    for (k, &(size, device, backup, chunk)) in allocs.iter().enumerate() {
        let addr = e
            .alloc(&AllocRequest {
                size,
                device,
                tag: "t".into(),
                backup,
                chunk,
            })
            .unwrap();
        let data = pattern(size as usize, 40 + k as u64);
        write_raw(&sim, addr, &data);
        held.push((addr, data, backup.is_some()));
    }
    if act != Act::Pause {
        e.pause(Some("t")).unwrap();
        e.wait_released();
    }
    let infos = |e: &Engine| -> BTreeMap<u64, AllocInfo> {
        e.allocations().into_iter().map(|i| (i.addr, i)).collect()
    };
    let before = infos(&e);
    sim.arm_fault(prim, nth, 999);
    let result = catch_unwind(AssertUnwindSafe(|| match act {
        Act::Pause => e.pause(Some("t")).map(|_| ()),
        Act::Resume => e.resume(Some("t")).map(|_| ()),
        Act::ResumeNonblocking => {
            Engine::resume_nonblocking(e.clone(), Some("t"), &[], None).map(|_| ())
        }
    }))
    .unwrap_or_else(|_| panic!("{ctx}: the engine panicked instead of returning an error"));
    // A failure after a non-blocking resume returned is its waits' to raise, not its own.
    let waited = e.wait_restored(None, None);
    e.wait_released();
    let fired = sim.pending_faults() == 0;
    sim.clear_faults();
    if let Err(err) = &result {
        assert_eq!(
            err.changed(),
            Some(changed_between(&before, &infos(&e))),
            "{ctx}: what the failed operation says it changed: {err}"
        );
    }
    // The first resume after a failure a wait raised may report it again (having restored).
    match e.resume(None) {
        Ok(_) => {}
        Err(_) if waited.is_err() => {
            e.resume(None)
                .unwrap_or_else(|err| panic!("{ctx}: the resume after it: {err}"));
        }
        Err(err) => panic!("{ctx}: the resume after it: {err}"),
    }
    for (addr, data, backed) in &held {
        if *backed {
            assert_same(&read_raw(&sim, *addr, data.len()), data, &ctx);
        }
    }
    fired
}

/// Several copy workers per device, allocations of several segments and a chunked one, on two
/// devices: whichever driver call fails, at whichever call, a failed pause or resume says what
/// it left changed (the allocations whose mapped bytes differ after it, and those bytes), so
/// that an undo that trusts it skips nothing, and nothing backed up is lost.
#[test]
fn failed_operations_say_what_they_changed_with_several_workers() {
    for act in [Act::Pause, Act::Resume, Act::ResumeNonblocking] {
        for prim in Prim::ALL {
            let mut nth = 1;
            while changed_case(act, prim, nth) {
                nth += 1;
                assert!(nth < 400, "{prim} keeps firing");
            }
        }
    }
}
