//! Faults in the middle of pipelined pauses and resumes: several workers per device, allocations
//! cut into many chunks and staging pieces, two devices at once. The order in which workers
//! finish is not fixed, so the checks are the promises that hold for every order:
//!
//! - pause: each allocation is either paused (with a backup holding exactly its contents, when
//!   it has a backup policy) or active with its contents untouched on the device; the error
//!   names the driver call;
//! - resume: nothing changes (every allocation stays paused with its backup intact, the device
//!   holds no more memory than before);
//! - the simulated device holds exactly what the registry implies (mappings, handles,
//!   page-locked bytes), nothing is left queued, and every copy used page-locked memory;
//! - after clearing the fault, a resume of everything brings back every byte that was backed up
//!   or still on the device.
//!
//! Also: contents survive pause/resume cycles across random sizes and settings (on the sim or a
//! GPU, `common::harness`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    assert_invariants, engine_test, pattern, read_raw, run_proptest, write_raw, Expect, Leaks,
    Setup,
};
use proptest::prelude::*;
use tms::backup::disk::{self, DiskOp};
use tms::backup::{BackupKind, HostLayout};
use tms::driver::sim::{Prim, SimDriver};
use tms::engine::{AllocRequest, CopyConfig, Engine, PinMode, State};
use tms::Backup;

/// The sim's granularity: small, but a multiple of the page size (the sim's must be).
fn g() -> u64 {
    (16 << 10u64).max(page())
}

/// The system's page size: the unit of host chunks and staging slots.
fn page() -> u64 {
    tms::os::page_size()
}

struct Alloc {
    addr: u64,
    size: u64,
    backup: Backup,
    data: Vec<u8>,
    /// `data` is what the allocation holds (false once paused without a backup).
    intact: bool,
}

struct Fx {
    sim: Arc<SimDriver>,
    e: Arc<Engine>,
    allocs: Vec<Alloc>,
    /// The disk backups' directory; dropped after the engine, whose frees remove the files.
    dir: tempfile::TempDir,
}

fn sizes() -> [u64; 8] {
    let g = g();
    [
        1,
        g - 1,
        3 * g + 5,
        9 * g,
        17 * g + 4097,
        5 * g,
        40 * g + 3,
        13 * g + 1,
    ]
}

const BACKUPS: [Backup; 4] = [
    Some(BackupKind::Pinned),
    Some(BackupKind::Mmap),
    None,
    Some(BackupKind::Disk),
];

/// Two devices of 64 MiB in granules of [`g`].
fn two() -> Setup {
    Setup::default()
        .devices(2)
        .capacity(64 << 20)
        .granularity(g())
}

fn fx(pin: PinMode, retain: bool) -> Fx {
    let (sim, e) = common::sim_engine(&two().copy(CopyConfig {
        threads: 3,
        layout: HostLayout {
            chunk: 2 * page(),
            hugepages: false,
            streaming: false,
        },
        slot: page(),
        save_slot: page(),
        pin,
        disk_chunk: 2 * page(),
        keep_staging: false,
        save_streams: false,
    }));
    e.set_retain_cpu_backup(retain);
    // Small physical segments: the larger allocations have several.
    e.set_segment_bytes(4 * g()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    e.set_disk_backup_dir(Some(dir.path().to_path_buf()))
        .unwrap();
    let mut allocs = Vec::new();
    for (k, size) in sizes().iter().enumerate() {
        let backup = BACKUPS[k % 4];
        let addr = e
            .alloc(&AllocRequest {
                size: *size,
                device: (k % 2) as i32,
                tag: "t".into(),
                backup,
                chunk: 0,
            })
            .unwrap();
        let data = pattern(*size as usize, k as u64 + 1);
        write_raw(&sim, addr, &data);
        allocs.push(Alloc {
            addr,
            size: *size,
            backup,
            data,
            intact: true,
        });
    }
    allocs.sort_by_key(|a| a.addr);
    Fx {
        sim,
        e,
        allocs,
        dir,
    }
}

impl Fx {
    fn check(&self, ctx: &str, leaked_handles: usize) {
        let infos = self.e.allocations();
        let (mut active, mut handles) = (0, 0);
        for (a, i) in self.allocs.iter().zip(&infos) {
            assert_eq!(i.addr, a.addr, "{ctx}");
            match i.state {
                State::Active => {
                    active += 1;
                    handles += i.handles;
                    assert_eq!(
                        i.handles as u64,
                        i.mapped.div_ceil(4 * g()),
                        "{ctx}: {:#x}: one handle per segment",
                        a.addr
                    );
                    // An active allocation's backup counts only as a complete snapshot (a
                    // retained one, of the last pause); never a partly written one.
                    if a.backup == Some(BackupKind::Disk) {
                        // Files are not offered as CPU backups; they are checked at recovery.
                    } else if i.host_valid {
                        let mut b = vec![0u8; a.size as usize];
                        assert!(self.e.copy_cpu_backup(a.addr, &mut b).unwrap());
                        assert!(
                            b == a.data,
                            "{ctx}: active {:#x} offers an incomplete backup",
                            a.addr
                        );
                    } else {
                        let mut b = vec![0u8; a.size as usize];
                        assert!(
                            !self.e.copy_cpu_backup(a.addr, &mut b).unwrap(),
                            "{ctx}: {:#x} offers a backup it does not claim",
                            a.addr
                        );
                    }
                    assert!(
                        !a.intact || read_raw(&self.sim, a.addr, a.size as usize) == a.data,
                        "{ctx}: active {:#x} ({} bytes, {:?}) lost contents",
                        a.addr,
                        a.size,
                        a.backup,
                    );
                }
                State::Paused => {
                    if a.backup == Some(BackupKind::Disk) {
                        assert!(
                            i.host_valid && i.disk_bytes == i.mapped,
                            "{ctx}: {:#x}",
                            a.addr
                        );
                    } else if a.backup.is_some() {
                        let mut b = vec![0u8; a.size as usize];
                        assert!(i.host_valid && self.e.copy_cpu_backup(a.addr, &mut b).unwrap());
                        assert!(b == a.data, "{ctx}: backup of {:#x} differs", a.addr);
                    }
                }
                s => panic!("{ctx}: {:#x} left {s:?} after the call returned", a.addr),
            }
        }
        assert!(active <= handles);
        // A handle leaked by a failed release is one segment of some allocation: its bytes are
        // not known here.
        let leaks = Leaks {
            handles: leaked_handles,
            bytes: (leaked_handles == 0).then(Default::default),
            ..Leaks::default()
        };
        let expect = Expect {
            leaks,
            copies_done: true,
        };
        assert_invariants(&self.e, &self.sim, &expect, ctx);
    }

    /// Clear faults, resume everything and check every byte that must have survived.
    fn recover(&self, ctx: &str) {
        self.sim.clear_faults();
        let lost: Vec<bool> = self
            .e
            .allocations()
            .iter()
            .zip(&self.allocs)
            .map(|(i, a)| !a.intact || (i.state == State::Paused && a.backup.is_none()))
            .collect();
        self.e
            .resume(None)
            .unwrap_or_else(|e| panic!("{ctx}: recovery resume: {e}"));
        for (a, lost) in self.allocs.iter().zip(lost) {
            if !lost {
                assert!(
                    read_raw(&self.sim, a.addr, a.size as usize) == a.data,
                    "{ctx}: {:#x} differs after recovery",
                    a.addr
                );
            }
        }
    }
}

/// Faults a pause or resume can meet from the driver.
const PRIMS: [Prim; 14] = [
    Prim::Synchronize,
    Prim::EventCreate,
    Prim::EventRecord,
    Prim::EventSync,
    Prim::CopyD2H,
    Prim::CopyH2D,
    Prim::StreamSync,
    Prim::HostRegister,
    Prim::Unmap,
    Prim::Release,
    Prim::Create,
    Prim::Map,
    Prim::SetAccess,
    Prim::HostUnregister,
];

/// A fixture ready for a faulted operation: for a resume, paused first (contents kept only
/// where backed up); background page-locking done.
fn fx_before(pin: PinMode, retain: bool, resume: bool) -> Fx {
    let mut f = fx(pin, retain);
    if resume {
        f.e.pause(None).unwrap();
        for a in &mut f.allocs {
            a.intact = a.backup.is_some();
        }
    }
    assert!(f.e.wait_for_background_pinning(Duration::from_secs(10)));
    f
}

impl Fx {
    /// Live device bytes of both devices.
    fn live(&self) -> (u64, u64) {
        (self.sim.live_bytes(0), self.sim.live_bytes(1))
    }

    /// The operation under test on tag "t", then background page-locking done.
    fn operate(&self, resume: bool) -> tms::Result<tms::engine::OpReport> {
        let r = if resume {
            self.e.resume(Some("t"))
        } else {
            self.e.pause(Some("t"))
        };
        assert!(self.e.wait_for_background_pinning(Duration::from_secs(10)));
        r
    }

    /// A failed resume was undone: it says so, everything is paused, no device memory kept.
    fn check_resume_undone(&self, ctx: &str, msg: &str, live: (u64, u64)) {
        assert!(msg.contains("stays paused"), "{ctx}: {msg}");
        assert!(self
            .e
            .allocations()
            .iter()
            .all(|i| i.state == State::Paused));
        assert_eq!(self.live(), live, "{ctx}: undone");
    }
}

fn sweep(pin: PinMode, retain: bool, resume: bool) -> usize {
    let mut fired_cases = 0;
    for prim in PRIMS {
        for code in [999, 2] {
            // Every early call, then ever sparser ones up to the end of the operation.
            for nth in (1..=8).chain([11, 15, 21, 30, 42, 60, 85, 120, 170, 240, 340]) {
                let ctx =
                    format!("{pin:?} retain {retain} resume {resume}: {prim} #{nth} code {code}");
                let f = fx_before(pin, retain, resume);
                let live = f.live();
                f.sim.arm_fault(prim, nth, code);
                let r = f.operate(resume);
                let fired = f.sim.pending_faults() == 0;
                f.sim.clear_faults();
                let mut leaked = 0;
                match (&r, fired) {
                    (Ok(_), false) => {
                        f.check(&ctx, 0);
                        break;
                    }
                    (Err(e), false) => panic!("{ctx}: failed without a fault: {e}"),
                    (Ok(_), true) => {
                        // Only page-locking and unregistering are allowed to fail quietly
                        // (the background pinner's work, or host memory on its way out).
                        assert!(
                            matches!(prim, Prim::HostRegister | Prim::HostUnregister),
                            "{ctx}: the fault was swallowed"
                        );
                        if prim == Prim::HostUnregister {
                            // What stays registered is leaked on purpose; account for it.
                            f.check_leak_tolerant(&ctx);
                            fired_cases += 1;
                            continue;
                        }
                    }
                    (Err(e), true) => {
                        let msg = e.to_string();
                        assert!(msg.contains(prim.call()), "{ctx}: {msg}");
                        assert_eq!(e.is_oom(), code == 2, "{ctx}: {msg}");
                        if resume {
                            f.check_resume_undone(&ctx, &msg, live);
                        } else if prim == Prim::Release {
                            leaked = 1;
                        }
                    }
                }
                fired_cases += 1;
                f.check(&ctx, leaked);
                f.recover(&ctx);
            }
        }
    }
    fired_cases
}

/// File operations of disk backups that fail: every early call of each, with an I/O error and
/// with a full disk. A pause that cannot create, reserve, write or sync a file fails naming it,
/// and every allocation not yet paused is active with its contents; a resume that cannot read
/// stays paused with its files, and the retry restores every byte.
fn sweep_disk(pin: PinMode, retain: bool, resume: bool) -> usize {
    let mut fired_cases = 0;
    for op in [
        DiskOp::Create,
        DiskOp::Allocate,
        DiskOp::Write,
        DiskOp::Sync,
        DiskOp::Read,
    ] {
        for errno in [libc::EIO, libc::ENOSPC] {
            for nth in 1..=12 {
                let ctx = format!("{pin:?} retain {retain} resume {resume}: {op:?} #{nth} {errno}");
                let f = fx_before(pin, retain, resume);
                let dir = f.dir.path().to_path_buf();
                let live = f.live();
                disk::arm_fault(Some(&dir), op, nth, errno);
                let r = f.operate(resume);
                let fired = disk::pending_faults(Some(&dir)) == 0;
                disk::clear_faults(Some(&dir));
                match (&r, fired) {
                    (Ok(_), false) => {
                        f.check(&ctx, 0);
                        break;
                    }
                    (Err(e), false) => panic!("{ctx}: failed without a fault: {e}"),
                    (Ok(_), true) => panic!("{ctx}: the fault was swallowed"),
                    (Err(e), true) => {
                        let msg = e.to_string();
                        assert!(
                            msg.contains(&*dir.to_string_lossy()),
                            "{ctx}: names the file: {msg}"
                        );
                        assert_eq!(e.is_oom(), errno == libc::ENOSPC, "{ctx}: {msg}");
                        if resume {
                            f.check_resume_undone(&ctx, &msg, live);
                        } else {
                            let infos = f.e.allocations();
                            if matches!(op, DiskOp::Create | DiskOp::Allocate) {
                                assert!(
                                    infos.iter().all(|i| i.state == State::Active),
                                    "{ctx}: files are made before anything is paused"
                                );
                            } else {
                                assert!(
                                    infos.iter().any(|i| i.backup == Some(BackupKind::Disk)
                                        && i.state == State::Active),
                                    "{ctx}: the allocation whose file failed stays active"
                                );
                            }
                        }
                    }
                }
                fired_cases += 1;
                f.check(&ctx, 0);
                f.recover(&ctx);
                let files = std::fs::read_dir(&dir).unwrap().count();
                let disk_allocs = f
                    .allocs
                    .iter()
                    .filter(|a| a.backup == Some(BackupKind::Disk))
                    .count();
                assert!(
                    files <= disk_allocs,
                    "{ctx}: {files} files for {disk_allocs} allocations"
                );
                drop(f.e);
                assert_eq!(
                    std::fs::read_dir(&dir).unwrap().count(),
                    0,
                    "{ctx}: files removed on free"
                );
            }
        }
    }
    fired_cases
}

engine_test! {
    sim_only fn file_faults_in_disk_backed_pauses_and_resumes(_h) {
        for (pin, retain) in [(PinMode::Inline, false), (PinMode::Background, true)] {
            assert!(
                sweep_disk(pin, retain, false) > 20,
                "{pin:?}: pauses exercised little"
            );
            assert!(
                sweep_disk(pin, retain, true) > 10,
                "{pin:?}: resumes exercised little"
            );
        }
    }
}

impl Fx {
    /// After a swallowed unregistration failure: the registry's accounting holds up to what the
    /// failure left registered, and contents are intact.
    fn check_leak_tolerant(&self, ctx: &str) {
        let infos = self.e.allocations();
        let accounted: u64 =
            infos.iter().map(|i| i.host_pinned_bytes).sum::<u64>() + self.e.staging_bytes();
        assert!(self.sim.pinned_bytes() >= accounted, "{ctx}");
        for (a, i) in self.allocs.iter().zip(&infos) {
            assert_eq!(i.state, State::Active, "{ctx}");
            if a.intact {
                assert!(
                    read_raw(&self.sim, a.addr, a.size as usize) == a.data,
                    "{ctx}"
                );
            }
        }
    }
}

engine_test! {
    sim_only fn faults_in_pipelined_pauses(_h) {
        for (pin, retain) in [
            (PinMode::Inline, false),
            (PinMode::Never, true),
            (PinMode::Background, true),
        ] {
            assert!(
                sweep(pin, retain, false) > 30,
                "{pin:?}: the sweep exercised little"
            );
        }
    }
}

engine_test! {
    sim_only fn faults_in_pipelined_resumes(_h) {
        for (pin, retain) in [
            (PinMode::Inline, false),
            (PinMode::Never, true),
            (PinMode::Background, false),
        ] {
            assert!(
                sweep(pin, retain, true) > 30,
                "{pin:?}: the sweep exercised little"
            );
        }
    }
}

engine_test! {
    /// Contents survive pause/resume cycles for random sizes, backends and copy settings.
    fn contents_survive_random_sizes_and_settings(h) [two()] {
        let strategy = (
            prop::collection::vec(1u64..=300 * 1024, 1..8),
            1usize..=5,
            1u64..=8,
            1u64..=4,
            prop_oneof![Just(PinMode::Background), Just(PinMode::Inline), Just(PinMode::Never)],
            any::<bool>(),
            any::<bool>(),
            prop_oneof![Just(1u64), Just(3), Just(1 << 20)],
        );
        let cases = h.pick(48, 16);
        run_proptest(cases, strategy, |(sizes, threads, chunk_pages, slot_pages, pin, mmap, retain, segments)| {
            let h = h.again();
            let e = &h.e;
            e.set_copy_config(CopyConfig {
                threads,
                // Streaming stores on half the cases (odd slots), plain copies on the other.
                layout: HostLayout { chunk: chunk_pages * page(), hugepages: false, streaming: slot_pages % 2 == 1 },
                slot: slot_pages * page(),
                // Saves in smaller pieces than the slot on some cases.
                save_slot: slot_pages.div_ceil(2) * page(),
                pin,
                disk_chunk: chunk_pages * page(),
                // Slots kept after resumes without retention on some cases.
                keep_staging: threads % 2 == 0,
                // Pauses on the workers' own streams (on a GPU) on some cases.
                save_streams: threads % 3 == 0,
            }).unwrap();
            e.set_retain_cpu_backup(retain);
            e.set_segment_bytes((segments * h.g()).next_power_of_two()).unwrap();
            let backend = if mmap { BackupKind::Mmap } else { BackupKind::Pinned };
            let mut v = Vec::new();
            for (k, size) in sizes.iter().enumerate() {
                let device = h.device((k % 2) as i32);
                let tag = "t".into();
                let addr = e
                    .alloc(&AllocRequest { size: *size, device, tag, backup: Some(backend), chunk: 0 })
                    .unwrap();
                v.push((addr, *size));
            }
            for cycle in 0..3u64 {
                for (k, (addr, size)) in v.iter().enumerate() {
                    h.write(*addr, &pattern(*size as usize, cycle * 100 + k as u64));
                }
                e.pause(None).unwrap();
                e.resume(None).unwrap();
                for (k, (addr, size)) in v.iter().enumerate() {
                    let want = pattern(*size as usize, cycle * 100 + k as u64);
                    prop_assert!(h.read(*addr, *size as usize) == want);
                }
            }
            if let Some(sim) = h.sim() {
                prop_assert_eq!(sim.pageable_copies(), 0);
            }
            prop_assert!(e.wait_for_background_pinning(Duration::from_secs(10)));
            // Page-locked bytes (and the rest) as the registry implies.
            h.check_invariants(&Expect::clean()).map_err(TestCaseError::fail)?;
            Ok(())
        });
    }
}

engine_test! {
    /// A failed event wait of one worker must not let another worker take its own (dropped) copy
    /// for done: with two workers sharing the device's stream, a pause that fails on an event wait
    /// and is retried, then a resume, must give back every byte (the shape of a reported loss:
    /// allocations of 3, 8 and 5 MiB in 64 MiB chunks through 4 MiB slots; several rounds, since
    /// which worker's copy was dropped depends on timing).
    sim_only fn a_failed_event_wait_never_passes_off_another_workers_dropped_copy_as_done(_h) {
        for nth in [1, 2, 4] {
            for round in 0..25 {
                let (sim, e) = common::sim_engine(&Setup::default().capacity(64 << 20).copy(
                    CopyConfig {
                        threads: 2,
                        ..CopyConfig::default()
                    },
                ));
                let mut allocs = Vec::new();
                for (k, mib) in [3u64, 8, 5].into_iter().enumerate() {
                    let size = mib << 20;
                    let addr = e
                        .alloc(&AllocRequest {
                            size,
                            device: 0,
                            tag: "default".into(),
                            backup: Some(BackupKind::Pinned),
                            chunk: 0,
                        })
                        .unwrap();
                    let data = pattern(size as usize, 1000 * round + k as u64);
                    write_raw(&sim, addr, &data);
                    allocs.push((addr, data));
                }
                sim.arm_fault(Prim::EventSync, nth, 999);
                assert!(e.pause(None).is_err(), "event_sync:{nth} round {round}");
                e.pause(None).unwrap();
                e.resume(None).unwrap();
                for (k, (addr, data)) in allocs.iter().enumerate() {
                    let got = read_raw(&sim, *addr, data.len());
                    let first = got.iter().zip(data).position(|(a, b)| a != b);
                    assert_eq!(
                        first, None,
                        "event_sync:{nth} round {round}: allocation {k} differs from byte {first:?} on"
                    );
                }
            }
        }
    }
}

engine_test! {
    /// A pause whose copy wait fails, and whose worker's wait for its stream then fails too,
    /// must leave nothing queued into the staging slots: the next operation's copies go through
    /// the same slots, and a stale device-to-host copy that runs ahead of them overwrites what
    /// they put there (here: a resume of another tag, which must still bring back its bytes).
    sim_only fn a_failed_pause_leaves_no_copy_queued_into_the_staging_slots(_h) {
        let (sim, e) = common::sim_engine(&Setup::default().capacity(64 << 20).granularity(g()).copy(
            CopyConfig {
                threads: 1,
                layout: HostLayout { chunk: 4 * g(), hugepages: false, streaming: false },
                slot: page(),
                save_slot: page(),
                pin: PinMode::Never,
                disk_chunk: 0,
                keep_staging: true,
                save_streams: false,
            },
        ));
        let mut allocs = Vec::new();
        for (k, tag) in ["x", "y"].into_iter().enumerate() {
            let size = 2 * g();
            let addr = e
                .alloc(&AllocRequest {
                    size,
                    device: 0,
                    tag: tag.into(),
                    backup: Some(BackupKind::Mmap),
                    chunk: 0,
                })
                .unwrap();
            let data = pattern(size as usize, 70 + k as u64);
            write_raw(&sim, addr, &data);
            allocs.push((addr, data));
        }
        e.pause(Some("x")).unwrap();
        // y's pause: its first copy wait fails, then the worker's wait for its stream too.
        sim.arm_fault(Prim::EventSync, 1, 999);
        sim.arm_fault(Prim::StreamSync, 1, 999);
        assert!(e.pause(Some("y")).is_err());
        sim.clear_faults();
        e.resume(Some("x")).unwrap();
        let (x, want) = &allocs[0];
        let got = read_raw(&sim, *x, want.len());
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        assert_eq!(first, None, "x differs after its resume reported success, from byte {first:?} on");
        let (y, want) = &allocs[1];
        assert!(read_raw(&sim, *y, want.len()) == *want, "y lost contents");
    }
}
