//! Engine unit tests on the simulated device.

use std::sync::Arc;

use super::*;
use crate::backup::BackupKind;
use crate::driver::sim::{Prim, SimConfig, SimDriver};
use crate::driver::{DevPtr, Driver};
use crate::error::ErrorKind;

const G: u64 = 2 << 20;

fn setup(capacity: u64) -> (Arc<SimDriver>, Engine) {
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            devices: 2,
            capacity,
            granularity: G,
        })
        .unwrap(),
    );
    let engine = Engine::new(sim.clone());
    (sim, engine)
}

fn req(size: u64, tag: &str, backup: Backup) -> AllocRequest {
    AllocRequest {
        size,
        device: 0,
        tag: tag.into(),
        backup,
        chunk: 0,
    }
}

fn fill(sim: &SimDriver, ptr: DevPtr, data: &[u8]) {
    let s = sim.stream(0).unwrap();
    // SAFETY: tests pass active allocations at least data.len() long; data outlives the sync.
    unsafe {
        sim.copy_h2d(ptr, data.as_ptr(), data.len() as u64, s)
            .unwrap()
    }
    sim.stream_sync(s).unwrap();
}

fn read(sim: &SimDriver, ptr: DevPtr, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let s = sim.stream(0).unwrap();
    // SAFETY: as in fill.
    unsafe { sim.copy_d2h(v.as_mut_ptr(), ptr, len as u64, s).unwrap() }
    sim.stream_sync(s).unwrap();
    v
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn alloc_rounds_to_granularity_and_maps() {
    let (sim, e) = setup(64 << 20);
    let p = e.alloc(&req(G + 1, "a", None)).unwrap();
    let info = &e.allocations()[0];
    assert_eq!(
        (info.addr, info.size, info.mapped, info.state),
        (p, G + 1, 2 * G, State::Active)
    );
    assert_eq!(sim.live_bytes(0), 2 * G);
    assert!(sim.is_accessible(p + 2 * G - 1));
}

#[test]
fn pause_gives_memory_back_and_resume_keeps_the_address() {
    let (sim, e) = setup(64 << 20);
    let p = e.alloc(&req(3 * G, "a", None)).unwrap();
    let r = e.pause(None).unwrap();
    assert_eq!((r.allocations, r.bytes, r.copied), (1, 3 * G, 0));
    assert_eq!(sim.live_bytes(0), 0);
    assert!(!sim.is_accessible(p));
    assert_eq!(e.allocations()[0].state, State::Paused);
    e.resume(None).unwrap();
    assert_eq!(e.allocations()[0].addr, p);
    assert_eq!(sim.live_bytes(0), 3 * G);
    assert!(sim.is_accessible(p));
}

#[test]
fn backup_keeps_contents_without_backup_they_are_lost() {
    for backend in [BackupKind::Pinned, BackupKind::Mmap] {
        let (sim, e) = setup(64 << 20);
        let size = G + 12345;
        let kept = e.alloc(&req(size, "kept", Some(backend))).unwrap();
        let lost = e.alloc(&req(size, "lost", None)).unwrap();
        let data = pattern(size as usize, 7);
        fill(&sim, kept, &data);
        fill(&sim, lost, &data);
        let r = e.pause(None).unwrap();
        assert_eq!(r.copied, size);
        e.resume(None).unwrap();
        assert_eq!(read(&sim, kept, size as usize), data, "{backend:?}");
        assert_ne!(read(&sim, lost, size as usize), data);
        assert_eq!(
            sim.pinned_bytes(),
            0,
            "host backup released after a non-retaining resume"
        );
    }
}

#[test]
fn tags_are_independent() {
    let (sim, e) = setup(64 << 20);
    let a = e.alloc(&req(G, "a", Some(BackupKind::Pinned))).unwrap();
    let b = e.alloc(&req(G, "b", Some(BackupKind::Pinned))).unwrap();
    fill(&sim, a, &pattern(G as usize, 1));
    fill(&sim, b, &pattern(G as usize, 2));
    e.pause(Some("a")).unwrap();
    assert_eq!(sim.live_bytes(0), G);
    assert!(sim.is_accessible(b) && !sim.is_accessible(a));
    e.pause(Some("b")).unwrap();
    e.resume(Some("a")).unwrap();
    assert!(sim.is_accessible(a) && !sim.is_accessible(b));
    e.resume(Some("b")).unwrap();
    assert_eq!(read(&sim, a, G as usize), pattern(G as usize, 1));
    assert_eq!(read(&sim, b, G as usize), pattern(G as usize, 2));
}

#[test]
fn pause_and_resume_are_idempotent() {
    let (sim, e) = setup(64 << 20);
    e.alloc(&req(G, "a", None)).unwrap();
    assert_eq!(e.pause(Some("a")).unwrap().allocations, 1);
    assert_eq!(e.pause(Some("a")).unwrap().allocations, 0);
    assert_eq!(e.resume(Some("a")).unwrap().allocations, 1);
    assert_eq!(e.resume(Some("a")).unwrap().allocations, 0);
    assert_eq!(e.pause(Some("nope")).unwrap().allocations, 0);
    assert_eq!(sim.live_bytes(0), G);
}

#[test]
fn allocation_inside_a_paused_tag_is_active() {
    let (_sim, e) = setup(64 << 20);
    e.alloc(&req(G, "a", None)).unwrap();
    e.pause(Some("a")).unwrap();
    let p2 = e.alloc(&req(G, "a", None)).unwrap();
    let st: Vec<_> = e
        .allocations()
        .iter()
        .map(|a| (a.addr == p2, a.state))
        .collect();
    assert!(st.contains(&(true, State::Active)) && st.contains(&(false, State::Paused)));
    e.resume(Some("a")).unwrap();
    assert!(e.allocations().iter().all(|a| a.state == State::Active));
}

#[test]
fn free_active_and_paused_leaves_nothing() {
    let (sim, e) = setup(64 << 20);
    let a = e.alloc(&req(G, "a", Some(BackupKind::Pinned))).unwrap();
    let b = e.alloc(&req(G, "b", None)).unwrap();
    e.pause(Some("a")).unwrap();
    assert!(sim.pinned_bytes() > 0);
    assert!(e.free(a).unwrap());
    assert!(e.free(b).unwrap());
    assert!(!e.free(b).unwrap(), "second free: not ours any more");
    assert!(!e.owns(a));
    assert_eq!(
        (
            sim.live_bytes(0),
            sim.live_handles(),
            sim.live_mappings(),
            sim.live_reservations()
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(sim.pinned_bytes(), 0);
}

#[test]
fn retention_reuses_the_same_host_buffer() {
    let (sim, e) = setup(64 << 20);
    e.set_retain_cpu_backup(true);
    let p = e.alloc(&req(G, "a", Some(BackupKind::Pinned))).unwrap();
    e.pause(None).unwrap();
    let first = e.cpu_backup_ptr(p, 1).unwrap().unwrap();
    e.resume(None).unwrap();
    assert_eq!(
        e.cpu_backup_ptr(p, 1).unwrap(),
        Some(first),
        "kept while active"
    );
    fill(&sim, p, &pattern(G as usize, 9));
    e.pause(None).unwrap();
    assert_eq!(
        e.cpu_backup_ptr(p, 1).unwrap(),
        Some(first),
        "the same buffer, not a new one"
    );
    assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
    assert_eq!(
        sim.calls(Prim::HostRegister),
        2 + 1,
        "two staging slots for the first pause, then the backup, page-locked once"
    );
    let mut back = vec![0u8; G as usize];
    assert!(e.copy_cpu_backup(p, &mut back).unwrap());
    assert_eq!(
        back,
        pattern(G as usize, 9),
        "the retained buffer holds the new contents"
    );
    e.set_retain_cpu_backup(false);
    e.resume(None).unwrap();
    assert_eq!(e.cpu_backup_ptr(p, 1).unwrap(), None);
    assert_eq!(sim.pinned_bytes(), 0);
}

#[test]
fn backup_lookup_checks_the_range() {
    let (sim, e) = setup(64 << 20);
    let p = e.alloc(&req(1000, "a", Some(BackupKind::Mmap))).unwrap();
    let q = e.alloc(&req(1000, "b", None)).unwrap();
    fill(&sim, p, &pattern(1000, 3));
    assert_eq!(
        e.cpu_backup_ptr(p, 10).unwrap(),
        None,
        "active, never paused"
    );
    e.pause(None).unwrap();
    let mut part = vec![0u8; 100];
    assert!(e.copy_cpu_backup(p + 900, &mut part).unwrap());
    assert_eq!(part, pattern(1000, 3)[900..]);
    assert!(
        matches!(e.cpu_backup_ptr(p + 900, 101), Err(x) if *x.kind() == ErrorKind::NotFound),
        "past the asked size"
    );
    assert!(matches!(e.cpu_backup_ptr(0x10, 1), Err(x) if *x.kind() == ErrorKind::NotFound));
    assert_eq!(e.cpu_backup_ptr(q, 8).unwrap(), None, "no backup asked");
}

#[test]
fn bad_requests_are_clear_errors() {
    let (_sim, e) = setup(64 << 20);
    for err in [
        e.pause(Some("")).unwrap_err(),
        e.resume(Some("")).unwrap_err(),
    ] {
        assert!(
            *err.kind() == ErrorKind::InvalidArgument && err.to_string().contains("empty"),
            "{err}"
        );
    }
    let err = e.alloc(&req(0, "a", None)).unwrap_err();
    assert!(
        *err.kind() == ErrorKind::InvalidArgument && err.to_string().contains("0 bytes"),
        "{err}"
    );
    let err = e.alloc(&req(u64::MAX - 5, "a", None)).unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
    let err = e
        .alloc(&AllocRequest {
            device: 7,
            ..req(G, "a", None)
        })
        .unwrap_err();
    assert!(err.to_string().contains("device 7"), "{err}");
}

#[test]
fn memory_margin_refuses_with_oom() {
    let (sim, e) = setup(16 << 20);
    e.set_memory_margin(10 << 20);
    e.alloc(&req(G, "a", None)).unwrap();
    e.alloc(&req(2 * G, "a", None)).unwrap();
    let err = e.alloc(&req(G, "a", None)).unwrap_err();
    assert!(err.is_oom() && err.to_string().contains("margin"), "{err}");
    assert_eq!(sim.live_bytes(0), 3 * G);
}

#[test]
fn oom_on_resume_is_undone_and_retry_works() {
    let (sim, e) = setup(8 * G);
    let a = e.alloc(&req(2 * G, "a", Some(BackupKind::Pinned))).unwrap();
    let a2 = e.alloc(&req(2 * G, "a", Some(BackupKind::Pinned))).unwrap();
    fill(&sim, a, &pattern(2 * G as usize, 1));
    fill(&sim, a2, &pattern(2 * G as usize, 2));
    e.pause(Some("a")).unwrap();
    let hog = e.alloc(&req(6 * G, "hog", None)).unwrap();
    let err = e.resume(Some("a")).unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert!(err.to_string().contains("stays paused"), "{err}");
    assert!(e
        .allocations()
        .iter()
        .filter(|x| &*x.tag == "a")
        .all(|x| x.state == State::Paused && x.host_valid));
    assert_eq!(sim.live_bytes(0), 6 * G, "the partial resume was undone");
    e.free(hog).unwrap();
    e.resume(Some("a")).unwrap();
    assert_eq!(read(&sim, a, 2 * G as usize), pattern(2 * G as usize, 1));
    assert_eq!(read(&sim, a2, 2 * G as usize), pattern(2 * G as usize, 2));
}

#[test]
fn devices_are_routed_separately() {
    let (sim, e) = setup(64 << 20);
    let a = e.alloc(&req(G, "t", Some(BackupKind::Pinned))).unwrap();
    let b = e
        .alloc(&AllocRequest {
            device: 1,
            ..req(2 * G, "t", Some(BackupKind::Pinned))
        })
        .unwrap();
    fill(&sim, a, &pattern(G as usize, 4));
    fill(&sim, b, &pattern(2 * G as usize, 5));
    assert_eq!((sim.live_bytes(0), sim.live_bytes(1)), (G, 2 * G));
    e.pause(Some("t")).unwrap();
    assert_eq!((sim.live_bytes(0), sim.live_bytes(1)), (0, 0));
    e.resume(Some("t")).unwrap();
    assert_eq!(read(&sim, a, G as usize), pattern(G as usize, 4));
    assert_eq!(read(&sim, b, 2 * G as usize), pattern(2 * G as usize, 5));
}

#[test]
fn stats_per_tag() {
    let (_sim, e) = setup(64 << 20);
    e.alloc(&req(G, "a", Some(BackupKind::Pinned))).unwrap();
    e.alloc(&req(10, "b", None)).unwrap();
    e.pause(Some("a")).unwrap();
    let s = e.stats();
    assert_eq!(s.backend, "sim");
    let a = s.tags.iter().find(|t| t.tag == "a").unwrap();
    let b = s.tags.iter().find(|t| t.tag == "b").unwrap();
    assert_eq!(
        (
            a.paused_allocations,
            a.bytes_paused,
            a.bytes_active,
            a.host_backup_bytes
        ),
        (1, G, 0, G)
    );
    assert_eq!(a.last_pause.unwrap().copied_bytes, G);
    assert!(a.last_resume.is_none());
    assert_eq!(
        (b.active_allocations, b.bytes_active, b.bytes_requested),
        (1, G, 10)
    );
    let text = s.to_string();
    assert!(text.contains("tag") && text.contains("2.00 MiB"), "{text}");
}

#[test]
fn unpauseable_allocations_are_left_alone() {
    let (sim, e) = setup(64 << 20);
    let keep = e
        .alloc_unpauseable(&req(G, "a", Some(BackupKind::Pinned)))
        .unwrap();
    let p = e.alloc(&req(G, "a", None)).unwrap();
    fill(&sim, keep, &pattern(G as usize, 11));
    assert_eq!(e.pause(Some("a")).unwrap().allocations, 1);
    assert!(sim.is_accessible(keep) && !sim.is_accessible(p));
    assert_eq!(read(&sim, keep, G as usize), pattern(G as usize, 11));
    let infos = e.allocations();
    assert!(infos
        .iter()
        .any(|a| a.addr == keep && !a.pauseable && a.backup.is_none()));
    e.resume(None).unwrap();
    assert!(e.free(keep).unwrap() && e.free(p).unwrap());
}

/// Settings under which a staged copy takes several copies per chunk, so the number of device
/// copies tells a staged chunk (4 copies) from a straight one (1).
fn small_pieces(e: &Engine, pin: PinMode) {
    e.set_copy_config(CopyConfig {
        threads: 2,
        layout: crate::backup::HostLayout {
            chunk: G,
            hugepages: false,
        },
        slot: G / 4,
        pin,
        disk_chunk: 0,
    })
    .unwrap();
}

#[test]
fn first_pause_stages_then_the_retained_backup_is_page_locked_in_the_background() {
    let (sim, e) = setup(64 << 20);
    small_pieces(&e, PinMode::Background);
    e.set_retain_cpu_backup(true);
    let p = e.alloc(&req(4 * G, "a", Some(BackupKind::Pinned))).unwrap();
    fill(&sim, p, &pattern(4 * G as usize, 5));
    let d2h = sim.calls(Prim::CopyD2H);
    let pageable = sim.pageable_copies();
    e.pause(None).unwrap();
    assert_eq!(
        sim.calls(Prim::CopyD2H) - d2h,
        16,
        "4 chunks through the slots"
    );
    assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
    assert_eq!(e.allocations()[0].host_pinned_bytes, 4 * G);
    let h2d = sim.calls(Prim::CopyH2D);
    e.resume(None).unwrap();
    assert_eq!(
        sim.calls(Prim::CopyH2D) - h2d,
        4,
        "4 chunks copied straight"
    );
    assert_eq!(
        sim.pageable_copies(),
        pageable,
        "pause and resume copy only page-locked memory"
    );
    assert_eq!(read(&sim, p, 4 * G as usize), pattern(4 * G as usize, 5));
    e.set_retain_cpu_backup(false);
    e.pause(None).unwrap();
    e.resume(None).unwrap();
    assert_eq!(
        (sim.pinned_bytes(), e.staging_bytes()),
        (0, 0),
        "a resume without retention gives back the page-locked backup and the slots"
    );
}

#[test]
fn without_retention_nothing_is_page_locked_but_the_slots() {
    let (sim, e) = setup(64 << 20);
    small_pieces(&e, PinMode::Background);
    let p = e.alloc(&req(4 * G, "a", Some(BackupKind::Pinned))).unwrap();
    fill(&sim, p, &pattern(4 * G as usize, 6));
    e.pause(None).unwrap();
    assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
    assert_eq!(e.allocations()[0].host_pinned_bytes, 0);
    assert_eq!(sim.pinned_bytes(), e.staging_bytes());
    e.resume(None).unwrap();
    assert_eq!(read(&sim, p, 4 * G as usize), pattern(4 * G as usize, 6));
    assert_eq!(sim.pinned_bytes(), 0);
}

#[test]
fn inline_mode_page_locks_during_the_first_pause() {
    let (sim, e) = setup(64 << 20);
    small_pieces(&e, PinMode::Inline);
    let p = e.alloc(&req(3 * G, "a", Some(BackupKind::Pinned))).unwrap();
    fill(&sim, p, &pattern(3 * G as usize, 7));
    let d2h = sim.calls(Prim::CopyD2H);
    e.pause(None).unwrap();
    assert_eq!(sim.calls(Prim::CopyD2H) - d2h, 3, "straight copies");
    assert_eq!(e.allocations()[0].host_pinned_bytes, 3 * G);
    assert_eq!(e.staging_bytes(), 0, "no slots needed");
    e.resume(None).unwrap();
    assert_eq!(read(&sim, p, 3 * G as usize), pattern(3 * G as usize, 7));
}

#[test]
fn releasing_while_the_pinner_works_gives_everything_back() {
    for round in 0..8u64 {
        let (sim, e) = setup(256 << 20);
        small_pieces(&e, PinMode::Background);
        e.set_retain_cpu_backup(true);
        let p = e
            .alloc(&req(16 * G, "a", Some(BackupKind::Pinned)))
            .unwrap();
        fill(&sim, p, &pattern(16 * G as usize, round));
        e.pause(None).unwrap();
        // The pinner is busy with 16 chunks; release while it works.
        e.set_retain_cpu_backup(false);
        e.resume(None).unwrap();
        assert_eq!(
            (sim.pinned_bytes(), sim.registered_ranges()),
            (0, 0),
            "round {round}"
        );
        assert_eq!(
            read(&sim, p, 16 * G as usize),
            pattern(16 * G as usize, round)
        );
        assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
        assert_eq!(
            sim.pinned_bytes(),
            0,
            "round {round}: nothing pinned afterwards"
        );
    }
}

#[test]
fn byte_copies_in_pieces_land_in_place_and_refuse_paused_ranges() {
    let (sim, e) = setup(64 * G);
    let size = 3 * G + 12345;
    let p = e.alloc(&req(size, "t", Backup::None)).unwrap();
    let data = pattern(size as usize, 7);
    // Pieces that do not divide the length, and a last piece shorter than the others.
    e.write_bytes_in(p, &data, (G / 3) as usize).unwrap();
    assert_eq!(read(&sim, p, data.len()), data);
    let mut out = vec![0u8; data.len()];
    e.read_bytes_in(p, &mut out, 4096 + 1).unwrap();
    assert_eq!(out, data);
    assert_eq!(sim.queued_copies(), 0);
    // A piece of 0 bytes is taken as 1, not as "everything at the start".
    e.write_bytes_in(p, &data[..3], 0).unwrap();
    assert_eq!(read(&sim, p, 3), data[..3]);
    e.pause(Some("t")).unwrap();
    let err = e.write_bytes_in(p, &data[..10], 4).unwrap_err();
    assert!(err.to_string().contains("paused"), "{err}");
}

/// A byte copy that fails (its wait, or a later piece) returns only once nothing it queued is
/// left: the caller's memory is its own again, and no later synchronization writes into it or
/// reads from it.
#[test]
fn failed_byte_copies_leave_nothing_queued_on_the_callers_memory() {
    let (sim, e) = setup(64 * G);
    let p = e.alloc(&req(2 * G, "t", Backup::None)).unwrap();
    let data = pattern(2 * G as usize, 3);
    fill(&sim, p, &data);
    // The wait fails once.
    sim.arm_fault(Prim::StreamSync, 1, 999);
    let mut out = vec![0u8; data.len()];
    let err = e.read_bytes(p, &mut out).unwrap_err();
    assert!(err.to_string().contains("cuStreamSynchronize"), "{err}");
    assert_eq!(sim.queued_copies(), 0, "a read left its copy queued");
    // A later piece fails to queue, and the first wait after it fails too.
    sim.arm_fault(Prim::CopyH2D, 2, 999);
    sim.arm_fault(Prim::StreamSync, 1, 999);
    let err = e.write_bytes_in(p, &data, G as usize).unwrap_err();
    assert!(err.to_string().contains("cuMemcpyHtoDAsync"), "{err}");
    assert_eq!(
        sim.queued_copies(),
        0,
        "a write left its first piece queued"
    );
    assert_eq!(sim.pending_faults(), 0);
    e.read_bytes(p, &mut out).unwrap();
    assert!(out == data);
}

/// The staged copies (the C ABI's): even when every wait fails, what stays queued uses the
/// engine's own buffer, never the caller's memory.
#[test]
fn staged_byte_copies_never_leave_the_callers_memory_queued() {
    let (sim, e) = setup(64 * G);
    let p = e.alloc(&req(2 * G, "t", Backup::None)).unwrap();
    let data = pattern(2 * G as usize, 5);
    fill(&sim, p, &data);
    let fail_every_wait = || {
        for prim in [Prim::StreamSync, Prim::Synchronize] {
            for _ in 0..8 {
                sim.arm_fault(prim, 1, 999);
            }
        }
    };
    fail_every_wait();
    let mut out = vec![0u8; data.len()];
    let err = e.read_bytes_staged(p, &mut out).unwrap_err();
    assert!(err.to_string().contains("may still be queued"), "{err}");
    sim.clear_faults();
    // The caller reuses its memory; the queued copy runs at the next synchronization.
    out.fill(0xAA);
    sim.synchronize(0).unwrap();
    assert!(
        out.iter().all(|b| *b == 0xAA),
        "a late copy wrote into the caller's memory"
    );
    // And a write: the device gets what was asked for, never what the caller wrote later.
    let mut src = pattern(2 * G as usize, 6);
    fail_every_wait();
    let err = e.write_bytes_staged(p, &src).unwrap_err();
    assert!(err.to_string().contains("may still be queued"), "{err}");
    sim.clear_faults();
    let asked = src.clone();
    src.fill(0x55);
    sim.synchronize(0).unwrap();
    assert!(read(&sim, p, src.len()) == asked);
    // Working waits: both copy whole.
    e.write_bytes_staged(p, &data).unwrap();
    e.read_bytes_staged(p, &mut out).unwrap();
    assert!(out == data);
}

#[test]
fn the_sole_device_is_known_until_a_second_one_is_used() {
    let (_sim, e) = setup(64 << 20);
    assert_eq!(e.sole_device(), None, "nothing allocated yet");
    let bad = AllocRequest {
        device: 7,
        ..req(G, "x", None)
    };
    assert!(e.alloc(&bad).is_err());
    assert_eq!(
        e.sole_device(),
        None,
        "a device that does not exist is not noted"
    );
    let a = e.alloc(&req(G, "a", None)).unwrap();
    assert_eq!(e.sole_device(), Some(0));
    e.free(a).unwrap();
    assert_eq!(e.sole_device(), Some(0), "it stays the process's device");
    let on_1 = AllocRequest {
        device: 1,
        ..req(G, "b", None)
    };
    e.alloc(&on_1).unwrap();
    assert_eq!(e.sole_device(), None, "two devices: none names the process");
    e.alloc(&req(G, "c", None)).unwrap();
    assert_eq!(e.sole_device(), None, "for good");
}
