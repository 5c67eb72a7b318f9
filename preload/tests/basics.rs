//! The engine's basic promises, on the simulated device or a GPU (`common::harness`):
//! allocations rounded and mapped, pause giving memory back and resume keeping the address,
//! backups keeping contents, tags independent, frees, retention, backup lookups, clear errors,
//! page-locking modes, byte copies. Where only the sim can tell (its counters, capacity), the
//! check or the test is the sim's alone.

mod common;

use common::{engine_test, pattern, req, wait_until, Harness, Setup};
use tms::backup::{BackupKind, HostLayout};
use tms::driver::sim::Prim;
use tms::engine::{AllocRequest, CopyConfig, PinMode, State};
use tms::error::ErrorKind;
use tms::Backup;

/// Two devices of `capacity` bytes (on a GPU: as many of the two as there are).
fn two(capacity: u64) -> Setup {
    Setup::default().devices(2).capacity(capacity)
}

/// A device that does not exist: 7 on the sim's two, one past any GPU count on CUDA.
fn no_such_device(h: &Harness) -> i32 {
    h.pick(7, 4096)
}

engine_test! {
    fn alloc_rounds_to_granularity_and_maps(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e.alloc(&req(g + 1, "a", None)).unwrap();
        let info = &e.allocations()[0];
        assert_eq!(
            (info.addr, info.size, info.mapped, info.state),
            (p, g + 1, 2 * g, State::Active)
        );
        h.assert_live_bytes(0, 2 * g, "mapped");
        h.assert_accessible(p + 2 * g - 1, 1, true, "the last byte");
    }
}

engine_test! {
    fn pause_gives_memory_back_and_resume_keeps_the_address(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e.alloc(&req(3 * g, "a", None)).unwrap();
        let r = e.pause(None).unwrap();
        assert_eq!((r.allocations, r.bytes, r.copied), (1, 3 * g, 0));
        h.assert_live_bytes(0, 0, "paused");
        h.assert_accessible(p, 1, false, "paused");
        assert_eq!(e.allocations()[0].state, State::Paused);
        e.resume(None).unwrap();
        assert_eq!(e.allocations()[0].addr, p);
        h.assert_live_bytes(0, 3 * g, "resumed");
        h.assert_accessible(p, 1, true, "resumed");
    }
}

engine_test! {
    fn backup_keeps_contents_without_backup_they_are_lost(h) [two(64 << 20)] {
        for backend in [BackupKind::Pinned, BackupKind::Mmap] {
            let h = h.again();
            let e = &h.e;
            let size = h.g() + 12345;
            let kept = e.alloc(&req(size, "kept", Some(backend))).unwrap();
            let lost = e.alloc(&req(size, "lost", None)).unwrap();
            let data = pattern(size as usize, 7);
            h.write(kept, &data);
            h.write(lost, &data);
            let r = e.pause(None).unwrap();
            assert_eq!(r.copied, size);
            e.resume(None).unwrap();
            assert_eq!(h.read(kept, size as usize), data, "{backend:?}");
            if let Some(sim) = h.sim() {
                // Undefined contents: the sim's new memory is zeroes, while a GPU may hand back
                // the very pages it took.
                assert_ne!(h.read(lost, size as usize), data);
                e.wait_released();
                assert_eq!(
                    sim.pinned_bytes(),
                    0,
                    "host backup released after a non-retaining resume"
                );
            }
        }
    }
}

engine_test! {
    fn tags_are_independent(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let a = e.alloc(&req(g, "a", Some(BackupKind::Pinned))).unwrap();
        let b = e.alloc(&req(g, "b", Some(BackupKind::Pinned))).unwrap();
        h.write(a, &pattern(g as usize, 1));
        h.write(b, &pattern(g as usize, 2));
        e.pause(Some("a")).unwrap();
        h.assert_live_bytes(0, g, "b only");
        h.assert_accessible(b, 1, true, "b");
        h.assert_accessible(a, 1, false, "a");
        e.pause(Some("b")).unwrap();
        e.resume(Some("a")).unwrap();
        h.assert_accessible(a, 1, true, "a");
        h.assert_accessible(b, 1, false, "b");
        e.resume(Some("b")).unwrap();
        assert_eq!(h.read(a, g as usize), pattern(g as usize, 1));
        assert_eq!(h.read(b, g as usize), pattern(g as usize, 2));
    }
}

engine_test! {
    fn pause_and_resume_are_idempotent(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        e.alloc(&req(g, "a", None)).unwrap();
        assert_eq!(e.pause(Some("a")).unwrap().allocations, 1);
        assert_eq!(e.pause(Some("a")).unwrap().allocations, 0);
        assert_eq!(e.resume(Some("a")).unwrap().allocations, 1);
        assert_eq!(e.resume(Some("a")).unwrap().allocations, 0);
        assert_eq!(e.pause(Some("nope")).unwrap().allocations, 0);
        h.assert_live_bytes(0, g, "active once");
    }
}

engine_test! {
    fn allocation_inside_a_paused_tag_is_active(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        e.alloc(&req(g, "a", None)).unwrap();
        e.pause(Some("a")).unwrap();
        let p2 = e.alloc(&req(g, "a", None)).unwrap();
        let st: Vec<_> = e
            .allocations()
            .iter()
            .map(|a| (a.addr == p2, a.state))
            .collect();
        assert!(st.contains(&(true, State::Active)) && st.contains(&(false, State::Paused)));
        e.resume(Some("a")).unwrap();
        assert!(e.allocations().iter().all(|a| a.state == State::Active));
    }
}

engine_test! {
    fn free_active_and_paused_leaves_nothing(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let a = e.alloc(&req(g, "a", Some(BackupKind::Pinned))).unwrap();
        let b = e.alloc(&req(g, "b", None)).unwrap();
        e.pause(Some("a")).unwrap();
        if let Some(sim) = h.sim() {
            assert!(sim.pinned_bytes() > 0);
        }
        assert!(e.free(a).unwrap());
        assert!(e.free(b).unwrap());
        assert!(!e.free(b).unwrap(), "second free: not ours any more");
        assert!(!e.owns(a));
        h.assert_nothing_held("everything freed");
    }
}

engine_test! {
    fn retention_reuses_the_same_host_buffer(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        e.set_retain_cpu_backup(true);
        let p = e.alloc(&req(g, "a", Some(BackupKind::Pinned))).unwrap();
        e.pause(None).unwrap();
        let first = e.cpu_backup_ptr(p, 1).unwrap().unwrap();
        e.resume(None).unwrap();
        assert_eq!(
            e.cpu_backup_ptr(p, 1).unwrap(),
            Some(first),
            "kept while active"
        );
        h.write(p, &pattern(g as usize, 9));
        e.pause(None).unwrap();
        assert_eq!(
            e.cpu_backup_ptr(p, 1).unwrap(),
            Some(first),
            "the same buffer, not a new one"
        );
        assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
        if let Some(sim) = h.sim() {
            assert_eq!(
                sim.calls(Prim::HostRegister),
                2 + 1,
                "two staging slots for the first pause, then the backup, page-locked once"
            );
        }
        let mut back = vec![0u8; g as usize];
        assert!(e.copy_cpu_backup(p, &mut back).unwrap());
        assert_eq!(
            back,
            pattern(g as usize, 9),
            "the retained buffer holds the new contents"
        );
        e.set_retain_cpu_backup(false);
        e.resume(None).unwrap();
        assert_eq!(e.cpu_backup_ptr(p, 1).unwrap(), None);
        e.wait_released();
        if let Some(sim) = h.sim() {
            assert_eq!(sim.pinned_bytes(), 0);
        }
    }
}

engine_test! {
    fn backup_lookup_checks_the_range(h) [two(64 << 20)] {
        let e = &h.e;
        let p = e.alloc(&req(1000, "a", Some(BackupKind::Mmap))).unwrap();
        let q = e.alloc(&req(1000, "b", None)).unwrap();
        h.write(p, &pattern(1000, 3));
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
}

engine_test! {
    fn bad_requests_are_clear_errors(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        for err in [
            e.pause(Some("")).unwrap_err(),
            e.resume(Some("")).unwrap_err(),
        ] {
            assert!(
                (*err.kind() == ErrorKind::InvalidArgument) && err.to_string().contains("empty"),
                "{err}"
            );
        }
        let err = e.alloc(&req(0, "a", None)).unwrap_err();
        assert!(
            (*err.kind() == ErrorKind::InvalidArgument) && err.to_string().contains("0 bytes"),
            "{err}"
        );
        let err = e.alloc(&req(u64::MAX - 5, "a", None)).unwrap_err();
        assert!(err.is_oom() && err.to_string().contains("overflows"), "{err}");
        let bad = no_such_device(&h);
        let err = e
            .alloc(&AllocRequest {
                device: bad,
                ..req(g, "a", None)
            })
            .unwrap_err();
        assert!(err.to_string().contains(&format!("device {bad}")), "{err}");
    }
}

engine_test! {
    sim_only fn memory_margin_refuses_with_oom(h) [two(16 << 20)] {
        let (sim, e, g) = (h.simulated(), &h.e, h.g());
        e.set_memory_margin(10 << 20);
        e.alloc(&req(g, "a", None)).unwrap();
        e.alloc(&req(2 * g, "a", None)).unwrap();
        let err = e.alloc(&req(g, "a", None)).unwrap_err();
        assert!(err.is_oom() && err.to_string().contains("margin"), "{err}");
        assert_eq!(sim.live_bytes(0), 3 * g);
    }
}

engine_test! {
    sim_only fn oom_on_resume_is_undone_and_retry_works(h) [two(8 * (2 << 20))] {
        let (sim, e, g) = (h.simulated(), &h.e, h.g());
        let a = e.alloc(&req(2 * g, "a", Some(BackupKind::Pinned))).unwrap();
        let a2 = e.alloc(&req(2 * g, "a", Some(BackupKind::Pinned))).unwrap();
        h.write(a, &pattern(2 * g as usize, 1));
        h.write(a2, &pattern(2 * g as usize, 2));
        e.pause(Some("a")).unwrap();
        let hog = e.alloc(&req(6 * g, "hog", None)).unwrap();
        let err = e.resume(Some("a")).unwrap_err();
        assert!(err.is_oom(), "{err}");
        assert!(err.to_string().contains("stays paused"), "{err}");
        assert!(e
            .allocations()
            .iter()
            .filter(|x| &*x.tag == "a")
            .all(|x| x.state == State::Paused && x.host_valid));
        assert_eq!(sim.live_bytes(0), 6 * g, "the partial resume was undone");
        e.free(hog).unwrap();
        e.resume(Some("a")).unwrap();
        assert_eq!(h.read(a, 2 * g as usize), pattern(2 * g as usize, 1));
        assert_eq!(h.read(a2, 2 * g as usize), pattern(2 * g as usize, 2));
    }
}

engine_test! {
    fn devices_are_routed_separately(h) [two(64 << 20)] {
        if h.devices() < 2 {
            return eprintln!("skipped: one device");
        }
        let (e, g) = (&h.e, h.g());
        let a = e.alloc(&req(g, "t", Some(BackupKind::Pinned))).unwrap();
        let b = e
            .alloc(&AllocRequest {
                device: 1,
                ..req(2 * g, "t", Some(BackupKind::Pinned))
            })
            .unwrap();
        h.write(a, &pattern(g as usize, 4));
        h.write(b, &pattern(2 * g as usize, 5));
        h.assert_live_bytes(0, g, "device 0");
        h.assert_live_bytes(1, 2 * g, "device 1");
        e.pause(Some("t")).unwrap();
        h.assert_live_bytes(0, 0, "device 0 paused");
        h.assert_live_bytes(1, 0, "device 1 paused");
        e.resume(Some("t")).unwrap();
        assert_eq!(h.read(a, g as usize), pattern(g as usize, 4));
        assert_eq!(h.read(b, 2 * g as usize), pattern(2 * g as usize, 5));
    }
}

engine_test! {
    fn stats_per_tag(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        e.alloc(&req(g, "a", Some(BackupKind::Pinned))).unwrap();
        let gone = e.alloc(&req(10, "b", None)).unwrap();
        // One made in place of a freed one, of its size: the tag's newest serial tells them apart.
        let newest = |t: &str| e.stats().tags.iter().find(|s| s.tag == t).unwrap().newest_allocation;
        assert_eq!((newest("a"), newest("b")), (1, 2));
        assert!(e.free(gone).unwrap());
        e.alloc(&req(10, "b", None)).unwrap();
        assert_eq!((newest("a"), newest("b")), (1, 3));
        e.pause(Some("a")).unwrap();
        let s = e.stats();
        assert_eq!(s.backend, h.driver().name());
        assert_eq!(s.backend, if h.is_hip() { "hip" } else { h.pick("sim", "cuda") });
        let a = s.tags.iter().find(|t| t.tag == "a").unwrap();
        let b = s.tags.iter().find(|t| t.tag == "b").unwrap();
        assert_eq!(
            (
                a.paused_allocations,
                a.bytes_paused,
                a.bytes_active,
                a.host_backup_bytes
            ),
            (1, g, 0, g)
        );
        assert_eq!(a.last_pause.unwrap().copied_bytes, g);
        assert!(a.last_resume.is_none());
        assert_eq!(
            (b.active_allocations, b.bytes_active, b.bytes_requested),
            (1, g, 10)
        );
        let text = s.to_string();
        assert!(
            text.contains("tag") && text.contains(&tms::units::human(g)),
            "{text}"
        );
    }
}

engine_test! {
    fn unpauseable_allocations_are_left_alone(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let keep = e
            .alloc_unpauseable(&req(g, "a", Some(BackupKind::Pinned)))
            .unwrap();
        let p = e.alloc(&req(g, "a", None)).unwrap();
        h.write(keep, &pattern(g as usize, 11));
        assert_eq!(e.pause(Some("a")).unwrap().allocations, 1);
        h.assert_accessible(keep, 1, true, "kept");
        h.assert_accessible(p, 1, false, "paused");
        assert_eq!(h.read(keep, g as usize), pattern(g as usize, 11));
        let infos = e.allocations();
        assert!(infos
            .iter()
            .any(|a| a.addr == keep && !a.pauseable && a.backup.is_none()));
        e.resume(None).unwrap();
        assert!(e.free(keep).unwrap() && e.free(p).unwrap());
    }
}

/// Settings under which a staged copy takes several copies per chunk, so the number of device
/// copies tells a staged chunk (4 copies) from a straight one (1).
fn small_pieces(h: &Harness, pin: PinMode) {
    h.e.set_copy_config(CopyConfig {
        threads: 2,
        layout: HostLayout {
            chunk: h.g(),
            hugepages: false,
            // The staged copies here go through the streaming-store path.
            streaming: true,
        },
        slot: h.g() / 4,
        save_slot: h.g() / 4,
        pin,
        disk_chunk: 0,
        keep_staging: false,
        save_streams: false,
    })
    .unwrap();
}

engine_test! {
    fn first_pause_stages_then_the_retained_backup_is_page_locked_in_the_background(h)
        [two(64 << 20)]
    {
        let (e, g) = (&h.e, h.g());
        small_pieces(&h, PinMode::Background);
        e.set_retain_cpu_backup(true);
        let p = e.alloc(&req(4 * g, "a", Some(BackupKind::Pinned))).unwrap();
        h.write(p, &pattern(4 * g as usize, 5));
        let calls = |prim| h.sim().map(|s| s.calls(prim));
        let d2h = calls(Prim::CopyD2H);
        let pageable = h.sim().map(|s| s.pageable_copies());
        e.pause(None).unwrap();
        if let (Some(sim), Some(d2h)) = (h.sim(), d2h) {
            assert_eq!(
                sim.calls(Prim::CopyD2H) - d2h,
                16,
                "4 chunks through the slots"
            );
        }
        assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
        assert_eq!(e.allocations()[0].host_pinned_bytes, 4 * g);
        let h2d = calls(Prim::CopyH2D);
        e.resume(None).unwrap();
        if let (Some(sim), Some(h2d)) = (h.sim(), h2d) {
            assert_eq!(
                sim.calls(Prim::CopyH2D) - h2d,
                4,
                "4 chunks copied straight"
            );
            assert_eq!(
                Some(sim.pageable_copies()),
                pageable,
                "pause and resume copy only page-locked memory"
            );
        }
        assert_eq!(h.read(p, 4 * g as usize), pattern(4 * g as usize, 5));
        e.set_retain_cpu_backup(false);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        e.wait_released();
        let slots = e.staging_bytes();
        let pinned = h.sim().map_or(0, |s| s.pinned_bytes());
        assert_eq!(
            (pinned, slots),
            (0, 0),
            "a resume without retention gives back the page-locked backup and the slots"
        );
    }
}

engine_test! {
    fn without_retention_nothing_is_page_locked_but_the_slots(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        small_pieces(&h, PinMode::Background);
        let p = e.alloc(&req(4 * g, "a", Some(BackupKind::Pinned))).unwrap();
        h.write(p, &pattern(4 * g as usize, 6));
        e.pause(None).unwrap();
        assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
        assert_eq!(e.allocations()[0].host_pinned_bytes, 0);
        if let Some(sim) = h.sim() {
            assert_eq!(sim.pinned_bytes(), e.staging_bytes());
        }
        e.resume(None).unwrap();
        assert_eq!(h.read(p, 4 * g as usize), pattern(4 * g as usize, 6));
        e.wait_released();
        if let Some(sim) = h.sim() {
            assert_eq!(sim.pinned_bytes(), 0);
        }
    }
}

engine_test! {
    /// A backup whose size is not a whole number of pages is page-locked in whole pages; the
    /// tag's statistics count, of its host backup bytes, those page-locked: never more.
    fn page_locked_bytes_of_a_tag_are_of_its_backup_bytes(h) [two(64 << 20)] {
        let e = &h.e;
        small_pieces(&h, PinMode::Inline);
        let page = tms::os::page_size();
        let size = 3 * page + 100;
        let p = e.alloc(&req(size, "a", Some(BackupKind::Pinned))).unwrap();
        h.write(p, &pattern(size as usize, 8));
        e.pause(None).unwrap();
        assert_eq!(e.allocations()[0].host_pinned_bytes, 4 * page, "whole pages");
        let s = e.stats();
        let a = s.tags.iter().find(|t| t.tag == "a").unwrap();
        assert_eq!((a.host_backup_bytes, a.host_pinned_bytes), (size, size));
        e.resume(None).unwrap();
        assert_eq!(h.read(p, size as usize), pattern(size as usize, 8));
    }
}

engine_test! {
    fn inline_mode_page_locks_during_the_first_pause(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        small_pieces(&h, PinMode::Inline);
        let p = e.alloc(&req(3 * g, "a", Some(BackupKind::Pinned))).unwrap();
        h.write(p, &pattern(3 * g as usize, 7));
        let d2h = h.sim().map(|s| s.calls(Prim::CopyD2H));
        e.pause(None).unwrap();
        if let (Some(sim), Some(d2h)) = (h.sim(), d2h) {
            assert_eq!(sim.calls(Prim::CopyD2H) - d2h, 3, "straight copies");
        }
        assert_eq!(e.allocations()[0].host_pinned_bytes, 3 * g);
        assert_eq!(e.staging_bytes(), 0, "no slots needed");
        e.resume(None).unwrap();
        assert_eq!(h.read(p, 3 * g as usize), pattern(3 * g as usize, 7));
    }
}

engine_test! {
    fn releasing_while_the_pinner_works_gives_everything_back(h) [two(256 << 20)] {
        for round in 0..8u64 {
            let h = h.again();
            let (e, g) = (&h.e, h.g());
            small_pieces(&h, PinMode::Background);
            e.set_retain_cpu_backup(true);
            let p = e
                .alloc(&req(16 * g, "a", Some(BackupKind::Pinned)))
                .unwrap();
            h.write(p, &pattern(16 * g as usize, round));
            e.pause(None).unwrap();
            // The pinner is busy with 16 chunks; release while it works.
            e.set_retain_cpu_backup(false);
            e.resume(None).unwrap();
            e.wait_released();
            if let Some(sim) = h.sim() {
                assert_eq!(
                    (sim.pinned_bytes(), sim.registered_ranges()),
                    (0, 0),
                    "round {round}"
                );
            }
            assert_eq!(
                h.read(p, 16 * g as usize),
                pattern(16 * g as usize, round)
            );
            assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
            if let Some(sim) = h.sim() {
                assert_eq!(
                    sim.pinned_bytes(),
                    0,
                    "round {round}: nothing pinned afterwards"
                );
            }
        }
    }
}

engine_test! {
    fn byte_copies_in_pieces_land_in_place_and_refuse_paused_ranges(h) [two(64 * (2 << 20))] {
        let (e, g) = (&h.e, h.g());
        let size = 3 * g + 12345;
        let p = e.alloc(&req(size, "t", Backup::None)).unwrap();
        let data = pattern(size as usize, 7);
        // Pieces that do not divide the length, and a last piece shorter than the others.
        e.write_bytes_in(p, &data, (g / 3) as usize).unwrap();
        assert_eq!(h.read(p, data.len()), data);
        let mut out = vec![0u8; data.len()];
        e.read_bytes_in(p, &mut out, 4096 + 1).unwrap();
        assert_eq!(out, data);
        if let Some(sim) = h.sim() {
            assert_eq!(sim.queued_copies(), 0);
        }
        // A piece of 0 bytes is taken as 1, not as "everything at the start".
        e.write_bytes_in(p, &data[..3], 0).unwrap();
        assert_eq!(h.read(p, 3), data[..3]);
        e.pause(Some("t")).unwrap();
        let err = e.write_bytes_in(p, &data[..10], 4).unwrap_err();
        assert!(err.to_string().contains("paused"), "{err}");
    }
}

engine_test! {
    fn the_sole_device_is_known_until_a_second_one_is_used(h) [two(64 << 20)] {
        if h.devices() < 2 {
            return eprintln!("skipped: one device");
        }
        let (e, g) = (&h.e, h.g());
        assert_eq!(e.sole_device(), None, "nothing allocated yet");
        let bad = AllocRequest {
            device: no_such_device(&h),
            ..req(g, "x", None)
        };
        assert!(e.alloc(&bad).is_err());
        assert_eq!(
            e.sole_device(),
            None,
            "a device that does not exist is not noted"
        );
        let a = e.alloc(&req(g, "a", None)).unwrap();
        assert_eq!(e.sole_device(), Some(0));
        e.free(a).unwrap();
        assert_eq!(e.sole_device(), Some(0), "it stays the process's device");
        let on_1 = AllocRequest {
            device: 1,
            ..req(g, "b", None)
        };
        e.alloc(&on_1).unwrap();
        assert_eq!(e.sole_device(), None, "two devices: none names the process");
        e.alloc(&req(g, "c", None)).unwrap();
        assert_eq!(e.sole_device(), None, "for good");
    }
}

engine_test! {
    fn pauses_into_fresh_host_memory_stage_in_the_smaller_save_pieces(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        small_pieces(&h, PinMode::Never);
        let mut c = e.copy_config();
        c.save_slot = c.slot / 2;
        e.set_copy_config(c).unwrap();
        let p = e.alloc(&req(2 * g, "a", Some(BackupKind::Mmap))).unwrap();
        let data = pattern(2 * g as usize, 8);
        h.write(p, &data);
        let calls = |prim| h.sim().map(|s| s.calls(prim));
        // (copies to the host, copies to the device) of one pause and resume
        let cycle = || {
            let (d2h, h2d) = (calls(Prim::CopyD2H), calls(Prim::CopyH2D));
            e.pause(None).unwrap();
            e.resume(None).unwrap();
            assert_eq!(h.read(p, 2 * g as usize), data);
            h.sim().map(|s| {
                (
                    s.calls(Prim::CopyD2H) - d2h.unwrap(),
                    s.calls(Prim::CopyH2D) - h2d.unwrap(),
                )
            })
        };
        if let Some(n) = cycle() {
            assert_eq!(n, (16, 8), "fresh memory in pieces of 1/8 of a chunk, restores in 1/4");
        }
        // Retained, the backup's memory is written already: whole slots.
        e.set_retain_cpu_backup(true);
        if let Some(n) = cycle() {
            assert_eq!(n, (16, 8), "the first pause that retains is into fresh memory");
        }
        if let Some(n) = cycle() {
            assert_eq!(n, (8, 8), "into the retained backup");
        }
        // Retention off: the resume gives the backup back, the next pause is into fresh
        // memory, where a save piece above the slot is cut to the slot.
        e.set_retain_cpu_backup(false);
        if let Some(n) = cycle() {
            assert_eq!(n, (8, 8), "into the retained backup, for the last time");
        }
        c.save_slot = 4 * c.slot;
        e.set_copy_config(c).unwrap();
        if let Some(n) = cycle() {
            assert_eq!(n, (8, 8), "fresh memory in whole slots");
        }
    }
}

engine_test! {
    sim_only fn a_resume_returns_before_its_host_memory_is_given_back(h) [two(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let sim = h.simulated();
        small_pieces(&h, PinMode::Never);
        let p = e.alloc(&req(2 * g, "a", Some(BackupKind::Mmap))).unwrap();
        let data = pattern(2 * g as usize, 3);
        h.write(p, &data);
        e.pause(None).unwrap();
        assert!(sim.pinned_bytes() > 0, "the staging slots");
        // Unregistering the slots stalls: the resume returns all the same, data in place.
        sim.hold(Prim::HostUnregister, None);
        e.resume(None).unwrap();
        assert_eq!(h.read(p, 2 * g as usize), data);
        wait_until("a release begins", std::time::Duration::from_secs(10), || {
            sim.held_calls() > 0
        });
        // The next pause waits for it.
        let e2 = h.e.clone();
        let pauser = std::thread::spawn(move || e2.pause(None).map(|r| r.allocations));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!pauser.is_finished(), "a pause waits for the memory to go");
        sim.unhold(Prim::HostUnregister, None);
        assert_eq!(pauser.join().unwrap().unwrap(), 1);
        e.resume(None).unwrap();
        e.wait_released();
        assert_eq!(sim.pinned_bytes(), 0);
        assert_eq!(h.read(p, 2 * g as usize), data);
    }
}
