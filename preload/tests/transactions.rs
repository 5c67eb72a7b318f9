//! Pause and resume as per-allocation transactions: the hooks never wait for a pause, a pause
//! the host cannot hold fails before it starts, helper threads page-lock in the backup's own
//! device's context, and CPU backups are handed out only as complete, living snapshots.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::{bounded, engine_test, pattern, wait_until, Setup};
use tms::backup::BackupKind;
use tms::driver::sim::Prim;
use tms::engine::{AllocRequest, CopyConfig, PinMode, State};

const MIB: u64 = 1 << 20;
const G: u64 = 2 << 20;
/// Long enough for any of these calls on a loaded machine; a call that waits for the stalled
/// pause takes forever.
const PATIENCE: Duration = Duration::from_secs(20);

/// `devices` devices of 256 MiB, `threads` copy workers, small host chunks and staging slots.
fn tx(devices: i32, threads: usize) -> Setup {
    Setup::default().devices(devices).small_pieces(threads)
}

fn req(size: u64, device: i32, tag: &str, backup: Option<BackupKind>) -> AllocRequest {
    AllocRequest {
        size,
        device,
        tag: tag.into(),
        backup,
        chunk: 0,
    }
}

engine_test! {
    /// A pause held at its device synchronization (as when the GPU's work waits for a host thread)
    /// keeps no hook waiting: ownership questions, frees of memory that is not the engine's,
    /// allocations, frees of allocations the pause does not touch, statistics. A free of an
    /// allocation the pause is changing waits for that allocation only, and then frees it.
    sim_only fn hooks_never_wait_for_a_stalled_pause(h) [tx(2, 2)] {
        let (sim, e) = (h.simulated(), &h.e);
        let kv = e
            .alloc(&req(8 * MIB, 0, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        let kv_data = pattern(8 << 20, 1);
        h.write(kv, &kv_data);
        let kv2 = e.alloc(&req(4 * MIB, 0, "kv", None)).unwrap();
        let other = e.alloc(&req(4 * MIB, 1, "w", None)).unwrap();

        sim.hold(Prim::Synchronize, Some(0));
        let pauser = {
            let e = e.clone();
            thread::spawn(move || e.pause(Some("kv")))
        };
        wait_until("the pause reaches the device", PATIENCE, || sim.held_calls() == 1);
        let states: BTreeMap<u64, State> =
            e.allocations().iter().map(|a| (a.addr, a.state)).collect();
        assert_eq!(states[&kv], State::Pausing);
        assert_eq!(states[&other], State::Active);

        let e2 = e.clone();
        let fresh = bounded("the hooks during the stalled pause", PATIENCE, move || {
            assert!(!e2.owns(0x1234_5000), "not ours");
            assert!(!e2.free(0x1234_5000).unwrap(), "a free of foreign memory");
            assert!(e2.owns(kv));
            let p = e2.alloc(&req(2 * MIB, 1, "new", None)).unwrap();
            assert!(
                e2.free(other).unwrap(),
                "a free of an allocation not being paused"
            );
            let s = e2.stats();
            assert!(s.tags.iter().any(|t| t.tag == "kv"));
            p
        });

        // A free of the allocation being paused waits for it, and only for it.
        let freer = {
            let e = e.clone();
            thread::spawn(move || e.free(kv2))
        };
        thread::sleep(Duration::from_millis(50));
        assert!(!freer.is_finished(), "kv2 was freed while being paused");
        sim.unhold(Prim::Synchronize, Some(0));
        let r = pauser.join().unwrap().unwrap();
        assert!(
            freer.join().unwrap().unwrap(),
            "freed once the pause let it go"
        );
        assert_eq!(r.allocations, 2);
        assert!(!e.owns(kv2));
        let mut b = vec![0u8; kv_data.len()];
        assert!(e.copy_cpu_backup(kv, &mut b).unwrap());
        assert!(b == kv_data, "the backup is whole");
        e.resume(None).unwrap();
        assert!(h.read(kv, kv_data.len()) == kv_data);
        assert!(e.free(fresh).unwrap());
        assert!(e.allocations().iter().all(|a| a.state == State::Active));
    }
}

engine_test! {
    /// Frees and allocations from several threads while pauses and resumes run, with several copy
    /// workers and every kind of backup: every allocation that survives has its contents, and
    /// nothing is left in transition.
    fn hooks_and_transactions_interleave_without_loss(h) [tx(2, 3)] {
        let (e, devices) = (&h.e, h.devices());
        let dir = tempfile::tempdir().unwrap();
        e.set_disk_backup_dir(Some(dir.path().to_path_buf()))
            .unwrap();
        let mut keep = Vec::new();
        for k in 0..6u64 {
            let size = (1 + k % 3) * 3 * MIB + 4096 * k;
            let kind = [BackupKind::Mmap, BackupKind::Disk, BackupKind::Pinned][k as usize % 3];
            let p = e
                .alloc(&req(size, h.device((k % 2) as i32), "kv", Some(kind)))
                .unwrap();
            let data = pattern(size as usize, 100 + k);
            h.write(p, &data);
            keep.push((p, data));
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churners: Vec<_> = (0..3)
            .map(|t| {
                let (e, stop) = (e.clone(), stop.clone());
                thread::spawn(move || {
                    let mut n = 0u32;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let p = e
                            .alloc(&req(G, t % 2 % devices, &format!("churn{t}"), None))
                            .unwrap();
                        assert!(!e.free(p + 1).unwrap(), "not the start of an allocation");
                        assert!(e.free(p).unwrap());
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        for _ in 0..15 {
            e.pause(Some("kv")).unwrap();
            e.resume(Some("kv")).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let churned: u32 = churners.into_iter().map(|c| c.join().unwrap()).sum();
        assert!(churned > 0);
        for (p, data) in &keep {
            assert!(
                h.read(*p, data.len()) == *data,
                "{p:#x} lost contents"
            );
        }
        assert_eq!(
            e.allocations().len(),
            keep.len(),
            "churn allocations all freed"
        );
    }
}

engine_test! {
    /// A pause whose new backups the host cannot hold fails before touching anything, with the
    /// numbers, and the allocations stay active with their contents; once memory is there it works.
    sim_only fn a_pause_the_host_cannot_hold_fails_with_the_numbers(h) [tx(1, 2)] {
        let (sim, e) = (h.simulated(), &h.e);
        let p = e
            .alloc(&req(96 * MIB, 0, "big", Some(BackupKind::Pinned)))
            .unwrap();
        let data = pattern(96 << 20, 9);
        h.write(p, &data);
        sim.set_host_memory(Some(100 * MIB));
        let err = e.pause(Some("big")).unwrap_err();
        let msg = err.to_string();
        assert!(err.is_oom(), "{msg}");
        for want in [
            "host memory",
            "MiB",
            "TMS_SIM_HOST_MEMORY",
            "nothing was paused",
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
        let a = &e.allocations()[0];
        assert_eq!(
            (a.state, a.host_valid, a.host_bytes),
            (State::Active, false, 0)
        );
        assert!(h.read(p, data.len()) == data);
        assert_eq!(sim.live_bytes(0), 96 * MIB, "nothing released");

        sim.set_host_memory(Some(1 << 30));
        e.pause(Some("big")).unwrap();
        e.resume(Some("big")).unwrap();
        assert!(h.read(p, data.len()) == data);
    }
}

engine_test! {
    /// A staging slot no host can hold (`TMS_STAGING_SLOT=4194304T` is a page multiple, which
    /// is all the setting asks) fails the pause as too little host memory does, with the
    /// numbers and nothing paused, rather than overflowing the sum of the devices' slots.
    sim_only fn a_staging_slot_no_host_can_hold_fails_with_the_numbers(h) [tx(2, 2)] {
        let (sim, e) = (h.simulated(), &h.e);
        e.set_copy_config(CopyConfig {
            slot: 1 << 62,
            ..e.copy_config()
        })
        .unwrap();
        let p: Vec<u64> = (0..2)
            .map(|d| {
                e.alloc(&req(4 * MIB, d, "big", Some(BackupKind::Pinned)))
                    .unwrap()
            })
            .collect();
        let err = e.pause(Some("big")).unwrap_err();
        let msg = err.to_string();
        assert!(err.is_oom(), "{msg}");
        for want in ["host memory", "staging", "nothing was paused"] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
        assert!(e.allocations().iter().all(|a| a.state == State::Active));
        assert_eq!(sim.live_bytes(0) + sim.live_bytes(1), 8 * MIB, "nothing released");
        for p in p {
            assert!(e.free(p).unwrap());
        }
    }
}

engine_test! {
    /// The simulated device keeps its memory in host RAM: more than the host has is refused at
    /// allocation, as device memory beyond the capacity is, instead of being killed once written.
    sim_only fn the_sim_refuses_device_memory_the_host_cannot_hold(h)
        [Setup::default().capacity(4 << 40)]
    {
        let (sim, e) = (h.simulated(), &h.e);
        sim.set_host_memory(Some(64 << 30));
        let err = e.alloc(&req(1 << 40, 0, "huge", None)).unwrap_err();
        assert!(err.is_oom(), "{err}");
        assert!(err.to_string().contains("host RAM"), "{err}");
        assert_eq!(sim.live_bytes(0), 0);
        assert_eq!(sim.live_reservations(), 0, "the reservation is given back");
    }
}

engine_test! {
    /// Page-locking and its undoing happen in the context of the device backed up, whichever
    /// thread does them: the background pinner, the parallel release, a resume from a thread with
    /// no device of its own. A process on device 3 never gets a context on device 0.
    sim_only fn helper_threads_page_lock_in_the_backups_own_device(h) [tx(4, 3)] {
        let (sim, e) = (h.simulated(), &h.e);
        e.set_copy_config(CopyConfig {
            pin: PinMode::Background,
            ..e.copy_config()
        })
        .unwrap();
        let p = e
            .alloc(&req(6 * MIB, 3, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        let data = pattern(6 << 20, 4);
        h.write(p, &data);
        e.set_retain_cpu_backup(true);
        for _ in 0..2 {
            let e2 = e.clone();
            thread::spawn(move || e2.pause(None).map(|_| ()))
                .join()
                .unwrap()
                .unwrap();
            assert!(e.wait_for_background_pinning(PATIENCE));
            let e2 = e.clone();
            thread::spawn(move || e2.resume(None).map(|_| ()))
                .join()
                .unwrap()
                .unwrap();
            assert!(e.wait_for_background_pinning(PATIENCE));
        }
        assert!(
            e.allocations()[0].host_pinned_bytes > 0,
            "pinned in the background"
        );
        e.set_retain_cpu_backup(false);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        assert!(h.read(p, data.len()) == data);
        assert!(e.free(p).unwrap());
        e.wait_released();
        assert_eq!(sim.pinned_bytes(), 0, "everything unregistered");
        let by_device = sim.host_calls_by_device();
        assert_eq!(
            by_device.keys().copied().collect::<Vec<_>>(),
            vec![3],
            "host registrations per device: {by_device:?}"
        );
    }
}

engine_test! {
    /// A pause that failed part-way leaves no backup to read: the lookup offers only complete
    /// snapshots.
    sim_only fn a_failed_pause_offers_no_partial_backup(h) [tx(1, 3)] {
        let (sim, e) = (h.simulated(), &h.e);
        let p = e
            .alloc(&req(8 * MIB, 0, "kv", Some(BackupKind::Mmap)))
            .unwrap();
        let data = pattern(8 << 20, 5);
        h.write(p, &data);
        // Fail the copy of the fifth chunk: some of the backup is written, not all.
        sim.arm_fault(Prim::CopyD2H, 5, 999);
        assert!(e.pause(None).is_err());
        let a = &e.allocations()[0];
        assert_eq!((a.state, a.host_valid), (State::Active, false));
        let mut b = vec![0u8; data.len()];
        assert!(!e.copy_cpu_backup(p, &mut b).unwrap());
        assert!(e
            .acquire_cpu_backup(p, data.len() as u64)
            .unwrap()
            .is_none());
        assert!(e.cpu_backup_ptr(p, 1).unwrap().is_none());
        sim.clear_faults();
        e.pause(None).unwrap();
        assert!(e.copy_cpu_backup(p, &mut b).unwrap() && b == data);
    }
}

engine_test! {
    /// A leased backup (a zero-copy view) stays mapped and unchanged through a resume that
    /// releases backups, and through later pauses that write new contents; it goes with its lease.
    fn a_leased_backup_outlives_release_and_is_never_overwritten(h) [tx(1, 2)] {
        let e = &h.e;
        let len = 6 * MIB;
        let p = e
            .alloc(&req(len, 0, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        let first = pattern(len as usize, 6);
        h.write(p, &first);
        e.pause(None).unwrap();
        let lease = e
            .acquire_cpu_backup(p, len)
            .unwrap()
            .expect("paused with backup");
        // SAFETY: the lease keeps len bytes at lease.ptr mapped and unchanged until released.
        let view = |l: &tms::engine::BackupLease| unsafe {
            std::slice::from_raw_parts(l.ptr, len as usize).to_vec()
        };
        e.resume(None).unwrap(); // no retention: the engine lets go of the backup
        assert_eq!(e.allocations()[0].host_bytes, 0);
        assert!(
            view(&lease) == first,
            "the leased view survives the release"
        );
        let second = pattern(len as usize, 7);
        h.write(p, &second);
        e.set_retain_cpu_backup(true);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        let lease2 = e
            .acquire_cpu_backup(p, len)
            .unwrap()
            .expect("retained snapshot");
        assert!(view(&lease2) == second);
        h.write(p, &first);
        e.pause(None).unwrap(); // would reuse the retained buffer, but it is leased
        assert!(
            view(&lease) == first && view(&lease2) == second,
            "leased snapshots unchanged"
        );
        let mut b = vec![0u8; len as usize];
        assert!(e.copy_cpu_backup(p, &mut b).unwrap() && b == first);
        assert_eq!(e.cpu_backup_leases(), 2);
        e.release_cpu_backup(lease.lease).unwrap();
        e.release_cpu_backup(lease2.lease).unwrap();
        let err = e.release_cpu_backup(lease2.lease).unwrap_err();
        assert!(err.to_string().contains("not held"), "{err}");
        e.resume(None).unwrap();
        assert!(h.read(p, len as usize) == first);
        assert!(e.free(p).unwrap());
        let ended = h.end();
        if let Some(sim) = ended.sim() {
            assert_eq!(
                sim.pinned_bytes(),
                0,
                "every buffer is freed with its last holder"
            );
        }
    }
}

engine_test! {
    /// A resume that fails (out of memory) undoes the mappings it made; when undoing cannot unmap
    /// one (a failing cuMemUnmap, twice), the registry still says paused with its backup, the error
    /// says what stays mapped, and the next resume unmaps it first and restores every byte; a free
    /// of an allocation left so also unmaps it, leaving no mapping behind.
    sim_only fn a_mapping_a_failed_resume_cannot_undo_is_unmapped_by_the_next_call(h)
        [tx(1, 2).capacity(5 * G)]
    {
        for free_it in [false, true] {
            let h = h.again();
            let (sim, e) = (h.simulated(), &h.e);
            let a = e
                .alloc(&req(2 * G, 0, "kv", Some(BackupKind::Mmap)))
                .unwrap();
            let b = e
                .alloc(&req(2 * G, 0, "kv", Some(BackupKind::Mmap)))
                .unwrap();
            let (da, db) = (pattern(2 * G as usize, 1), pattern(2 * G as usize, 2));
            h.write(a, &da);
            h.write(b, &db);
            e.pause(Some("kv")).unwrap();
            // Room for one of the two only: the second mapping runs out of memory.
            let c = e.alloc(&req(2 * G, 0, "other", None)).unwrap();
            sim.arm_fault(Prim::Unmap, 1, 999);
            sim.arm_fault(Prim::Unmap, 1, 999);
            let err = e.resume(Some("kv")).unwrap_err();
            assert!(err.is_oom(), "{err}");
            assert!(
                err.to_string()
                    .contains("could not be unmapped while undoing"),
                "{err}"
            );
            assert_eq!(sim.pending_faults(), 0, "both unmap faults fired");
            let states: Vec<State> = e.allocations().iter().map(|i| i.state).collect();
            assert_eq!(states.iter().filter(|s| **s == State::Paused).count(), 2);
            let stuck = [a, b].into_iter().filter(|p| sim.is_accessible(*p)).count();
            assert_eq!(stuck, 1, "one mapping was left in place");
            e.free(c).unwrap();
            if free_it {
                e.free(a).unwrap();
                e.free(b).unwrap();
                assert_eq!((sim.live_mappings(), sim.live_handles()), (0, 0));
                assert_eq!(sim.live_reservations(), 0);
                continue;
            }
            e.resume(Some("kv")).unwrap();
            assert!(h.read(a, 2 * G as usize) == da);
            assert!(h.read(b, 2 * G as usize) == db);
            e.free(a).unwrap();
            e.free(b).unwrap();
            assert_eq!((sim.live_mappings(), sim.live_handles()), (0, 0));
        }
    }
}

/// One allocation of 4 segments with a CPU backup, its contents written, and the number of
/// device-to-host copies a whole pause of it makes (measured by a pause and resume); one copy
/// worker, so the segments are copied, and released, in order.
fn four_segments(h: &common::Harness) -> (u64, Vec<u8>, u64) {
    let (sim, e) = (h.simulated(), &h.e);
    e.set_segment_bytes(2 * G).unwrap();
    let len = 8 * G;
    let p = e
        .alloc(&req(len, 0, "kv", Some(BackupKind::Pinned)))
        .unwrap();
    assert_eq!(e.allocations()[0].handles, 4);
    let data = pattern(len as usize, 9);
    h.write(p, &data);
    let before = sim.calls(Prim::CopyD2H);
    e.pause(None).unwrap();
    let copies = sim.calls(Prim::CopyD2H) - before;
    e.resume(None).unwrap();
    e.wait_released();
    assert!(copies >= 4, "{copies} copies for 4 segments");
    (p, data, copies)
}

engine_test! {
    /// A pause that fails after it released some segments of a large allocation (each segment
    /// goes as soon as its copy is complete) restores them from the backup: the allocation is
    /// whole and active again with its contents, the error says so, and nothing leaks.
    sim_only fn a_pause_failing_part_way_through_an_allocation_restores_what_it_released(h) [tx(1, 1)] {
        let (sim, e) = (h.simulated(), &h.e);
        let (p, data, copies) = four_segments(&h);
        let released = sim.calls(Prim::Release);
        // The last copy fails: the first three segments are saved and released by then.
        sim.arm_fault(Prim::CopyD2H, copies, 999);
        let err = e.pause(None).unwrap_err();
        // Released and restored: the failed pause left nothing changed, and says so.
        assert_eq!(err.changed(), Some(tms::error::Changed::NOTHING), "{err}");
        let err = err.to_string();
        assert!(sim.calls(Prim::Release) - released >= 3, "segments released during the pause");
        assert!(
            err.contains(&format!("allocation {p:#x}, released part-way, was restored and is active")),
            "{err}"
        );
        let a = &e.allocations()[0];
        assert_eq!((a.state, a.handles, a.host_valid), (State::Active, 4, false));
        assert!(h.read(p, data.len()) == data, "contents after the undone pause");
        h.assert_invariants(&common::Expect::clean(), "after the undone pause");
        sim.clear_faults();
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        assert!(h.read(p, data.len()) == data);
    }
}

engine_test! {
    /// A pause queued behind one that fails part-way through an allocation runs only once that
    /// one has restored it: it then pauses the whole allocation, and it stays paused. (The
    /// restore ran as a transaction of its own, and the operations lock, handed on fairly to a
    /// pause that had waited long, let the queued pause in first: it paused the rest, reported
    /// success, and the restore then resumed the allocation behind its back.)
    sim_only fn a_pause_queued_behind_one_failing_part_way_runs_after_its_restore(h) [tx(1, 1)] {
        let (sim, e) = (h.simulated(), &h.e);
        let (p, data, copies) = four_segments(&h);
        sim.arm_fault(Prim::CopyD2H, copies, 999);
        sim.hold(Prim::Synchronize, Some(0));
        let first = {
            let e = e.clone();
            thread::spawn(move || e.pause(None).map(|_| ()).map_err(|e| e.to_string()))
        };
        wait_until("the pause reaches the device", PATIENCE, || sim.held_calls() == 1);
        let second = {
            let e = e.clone();
            thread::spawn(move || e.pause(None).map(|r| r.bytes).map_err(|e| e.to_string()))
        };
        // Long enough for the second to queue for the operations lock.
        thread::sleep(Duration::from_millis(50));
        sim.unhold(Prim::Synchronize, Some(0));
        let err = bounded("the first pause", PATIENCE, move || first.join().unwrap()).unwrap_err();
        let second = bounded("the second pause", PATIENCE, move || second.join().unwrap());
        assert!(
            err.contains(&format!("allocation {p:#x}, released part-way, was restored and is active")),
            "{err}"
        );
        assert_eq!(second, Ok(data.len() as u64), "the second pause paused all of it");
        assert_eq!(e.allocations()[0].state, State::Paused, "it stays paused");
        e.resume(None).unwrap();
        assert!(h.read(p, data.len()) == data, "contents after both pauses");
        h.assert_invariants(&common::Expect::clean(), "resumed");
    }
}

engine_test! {
    /// When restoring what a failed pause released fails too, the allocation stays partly
    /// paused, its released segments with their backup; the error says so, and a later resume
    /// brings back every byte.
    sim_only fn a_part_paused_allocation_that_cannot_be_restored_stays_partial_and_loses_nothing(h) [tx(1, 1)] {
        let (sim, e) = (h.simulated(), &h.e);
        let (p, data, copies) = four_segments(&h);
        sim.arm_fault(Prim::CopyD2H, copies, 999);
        // The pause makes no physical memory: the first one made is the restoring resume's.
        sim.arm_fault(Prim::Create, 1, 2);
        let err = e.pause(None).unwrap_err();
        let changed = err.changed();
        let err = err.to_string();
        assert!(err.contains("restoring it failed too") && err.contains("stay paused"), "{err}");
        let a = &e.allocations()[0];
        assert_eq!(a.state, State::Partial, "{err}");
        assert!(a.handles >= 1 && a.handles < 4, "{} segments mapped", a.handles);
        // What stays paused is what the error says the failed pause changed.
        let paused = tms::error::Changed {
            allocations: 1,
            bytes: data.len() as u64 / 4 * (4 - a.handles as u64),
            communicators: 0,
        };
        assert_eq!(changed, Some(paused), "{err}");
        h.assert_invariants(&common::Expect::clean(), "partly paused");
        sim.clear_faults();
        e.resume(None).unwrap();
        let a = &e.allocations()[0];
        assert_eq!((a.state, a.handles), (State::Active, 4));
        assert!(h.read(p, data.len()) == data, "every byte back");
        h.assert_invariants(&common::Expect::clean(), "resumed");
    }
}

engine_test! {
    /// A resume without retention gives the staging slots back with the backups; with
    /// `keep_staging` it keeps them (page-locked, counted), and the next pause uses them.
    fn staging_slots_go_after_a_resume_unless_kept(h) [tx(1, 2)] {
        let e = &h.e;
        let p = e
            .alloc(&req(4 * MIB, 0, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        let data = pattern(4 << 20, 3);
        h.write(p, &data);
        e.pause(None).unwrap();
        assert!(e.staging_bytes() > 0, "a pause makes the slots");
        e.resume(None).unwrap();
        e.wait_released();
        assert_eq!(e.staging_bytes(), 0, "given back by default");
        let mut c = e.copy_config();
        c.keep_staging = true;
        e.set_copy_config(c).unwrap();
        // Each worker makes its slots when it first needs them: how many exist depends on
        // how the work was shared, so only what is kept is compared.
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        e.wait_released();
        let kept = e.staging_bytes();
        assert!(kept > 0, "kept");
        h.assert_invariants(&common::Expect::clean(), "slots kept");
        e.pause(None).unwrap();
        assert!(e.staging_bytes() >= kept, "the next pause has them");
        e.resume(None).unwrap();
        assert!(h.read(p, data.len()) == data);
        e.free(p).unwrap();
        e.wait_released();
        assert_eq!(e.staging_bytes(), 0, "no backed allocation left: nothing kept");
    }
}

engine_test! {
    /// Note [Releases]: the next pause or resume waits for the host memory a resume gives back
    /// on its own thread, so host memory never holds two generations of backups at once. Also a
    /// pause that queued for the operations lock behind that resume (before its release began):
    /// it runs only once the release is done.
    sim_only fn a_transaction_queued_behind_a_resume_waits_for_its_release(h)
        [Setup::default().small_pieces(2)]
    {
        let sim = h.simulated().clone();
        let (e, g) = (h.e.clone(), h.g());
        let pa = e
            .alloc(&common::req(2 * g, "a", Some(BackupKind::Pinned)))
            .unwrap();
        h.write(pa, &pattern((2 * g) as usize, 1));
        e.pause(Some("a")).unwrap();
        e.wait_released();
        let _pb = e
            .alloc(&common::req(2 * g, "b", Some(BackupKind::Mmap)))
            .unwrap();
        let patience = Duration::from_secs(20);
        // The resume of "a" holds the operations lock, stopped at its first mapping.
        sim.hold(Prim::Create, Some(0));
        let ea = e.clone();
        let ta = thread::spawn(move || ea.resume(Some("a")).map(|_| ()));
        wait_until("the resume maps", patience, || sim.held_calls() == 1);
        // Its release (page-locked backup, staging slots) will be stopped at its first unlock.
        sim.hold(Prim::HostUnregister, None);
        let eb = e.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || tx.send(eb.pause(Some("b")).map(|_| ())).unwrap());
        thread::sleep(Duration::from_millis(300)); // "b" waits for the lock
        sim.unhold(Prim::Create, Some(0));
        ta.join().unwrap().unwrap();
        wait_until("the release unlocks", patience, || sim.held_calls() == 1);
        let early = rx.recv_timeout(Duration::from_secs(2));
        let release_pending = sim.held_calls() == 1;
        sim.unhold(Prim::HostUnregister, None);
        e.wait_released();
        assert!(
            early.is_err() || !release_pending,
            "the pause of \"b\" ran and returned while the resume's release was still pending"
        );
    }
}

engine_test! {
    /// A free whose unmap fails part-way maps again what it had unmapped; where mapping again
    /// fails too, that segment's handle is released and it is recorded paused: the registry never
    /// claims a mapping that is not there (a pause would copy from it: on a GPU, a fault). The
    /// allocation is still the caller's, and a later free gives everything back.
    sim_only fn a_free_that_cannot_map_again_what_it_unmapped_keeps_the_registry_true(h) [tx(1, 1)] {
        let (sim, e) = (h.simulated(), &h.e);
        e.set_segment_bytes(2 * G).unwrap();
        let p = e.alloc(&req(8 * G, 0, "kv", None)).unwrap();
        assert_eq!(e.allocations()[0].handles, 4);
        // The third segment's unmap fails, and so does mapping the first again.
        sim.arm_fault(Prim::Unmap, 3, 999);
        sim.arm_fault(Prim::Map, 1, 999);
        let err = e.free(p).unwrap_err().to_string();
        assert_eq!(sim.pending_faults(), 0, "both faults fired");
        assert!(err.contains("could not be mapped again"), "{err}");
        assert!(e.owns(p), "a failed free keeps the allocation");
        let a = &e.allocations()[0];
        assert_eq!((a.state, a.handles), (State::Partial, 3));
        assert!(!sim.is_accessible(p) && sim.is_accessible(p + 2 * G));
        h.assert_invariants(&common::Expect::clean(), "after the failed free");
        assert!(e.free(p).unwrap());
        assert_eq!((sim.live_mappings(), sim.live_handles(), sim.live_reservations()), (0, 0, 0));
    }
}

engine_test! {
    /// The same in a pause that unmaps several segments at once (an allocation without a
    /// backup, or a chunked one): segments it unmapped and could not map again are recorded
    /// paused, not active, with their backup where the copy was complete; a resume brings back
    /// every byte that had a backup.
    sim_only fn a_pause_that_cannot_map_again_what_it_unmapped_keeps_the_registry_true(h) [tx(1, 1)] {
        for backup in [None, Some(BackupKind::Pinned)] {
            let h = h.again();
            let (sim, e) = (h.simulated(), &h.e);
            let g = h.g();
            let mut r = req(8 * g, 0, "kv", backup);
            if backup.is_some() {
                r.chunk = 2 * g;
            } else {
                e.set_segment_bytes(2 * g).unwrap();
            }
            let p = e.alloc(&r).unwrap();
            assert_eq!(e.allocations()[0].handles, 4);
            let data = pattern(8 * g as usize, 3);
            h.write(p, &data);
            sim.arm_fault(Prim::Unmap, 3, 999);
            sim.arm_fault(Prim::Map, 1, 999);
            let err = e.pause(None).unwrap_err().to_string();
            assert_eq!(sim.pending_faults(), 0, "{backup:?}: both faults fired: {err}");
            assert!(err.contains("could not be mapped again"), "{backup:?}: {err}");
            assert!(!sim.is_accessible(p) && sim.is_accessible(p + 2 * g), "{backup:?}");
            h.assert_invariants(&common::Expect::clean(), "after the failed pause");
            e.resume(None).unwrap();
            if backup.is_some() {
                assert!(h.read(p, data.len()) == data, "contents after the resume");
            }
            e.free(p).unwrap();
            assert_eq!((sim.live_mappings(), sim.live_handles()), (0, 0), "{backup:?}");
        }
    }
}

engine_test! {
    /// The staging slots go with the last allocation that has a backup. A free of it
    /// only tries the operations lock; a pause or resume holding it looks again once it let go,
    /// but a tool's copy (`with_active`, here the lane probe; `write_bytes` and the exports too),
    /// which holds the lock as well, did not: the page-locked slots stayed with no allocation
    /// left to use them.
    sim_only fn the_slots_go_with_the_last_backed_allocation_freed_during_a_tools_copy(h) [tx(1, 2)] {
        let sim = h.simulated().clone();
        let e = h.e.clone();
        let a = e.alloc(&req(4 * G, 0, "a", Some(BackupKind::Pinned))).unwrap();
        let b = e.alloc(&req(G, 0, "b", None)).unwrap();
        e.pause(Some("a")).unwrap();
        assert!(e.staging_bytes() > 0, "a pause keeps its slots");
        sim.hold(Prim::EventSync, None);
        let e2 = e.clone();
        let tool = thread::spawn(move || e2.probe_d2h_lanes(b, G, 64 << 10, 1, false).map(|_| ()));
        wait_until("the tool's copy runs", PATIENCE, || sim.held_calls() > 0);
        assert!(e.free(a).unwrap());
        sim.unhold(Prim::EventSync, None);
        tool.join().unwrap().unwrap();
        assert_eq!(e.staging_bytes(), 0, "slots kept with no allocation that has a backup");
    }
}

engine_test! {
    /// A segment whose cuMemSetAccess fails, and whose unmap then fails too, is still mapped: it
    /// stays with the mapping being undone (which unmaps it again, or records it stuck), never
    /// mapped behind the registry's back, where a later resume could not map it again and a
    /// free could not free the range.
    sim_only fn a_segment_whose_access_and_unmap_fail_is_undone_with_the_rest(h) [tx(1, 1)] {
        let (sim, e) = (h.simulated(), &h.e);
        let p = e
            .alloc(&req(2 * G, 0, "kv", Some(BackupKind::Mmap)))
            .unwrap();
        let data = pattern(2 * G as usize, 4);
        h.write(p, &data);
        e.pause(Some("kv")).unwrap();
        // Its unmap right after, and both of the undo's.
        sim.arm_fault(Prim::SetAccess, 1, 999);
        for _ in 0..3 {
            sim.arm_fault(Prim::Unmap, 1, 999);
        }
        e.resume(Some("kv")).unwrap_err();
        sim.clear_faults();
        e.resume(Some("kv")).unwrap();
        assert!(h.read(p, data.len()) == data, "contents after the resume");

        // An allocation's too: the undo unmaps it, so its range can be freed.
        sim.arm_fault(Prim::SetAccess, 1, 999);
        sim.arm_fault(Prim::Unmap, 1, 999);
        e.alloc(&req(2 * G, 0, "w", None)).unwrap_err();
        assert_eq!(sim.pending_faults(), 0, "both faults fired");
        e.free(p).unwrap();
        assert_eq!(
            (sim.live_mappings(), sim.live_handles(), sim.live_reservations()),
            (0, 0, 0)
        );
        assert_eq!(sim.live_bytes(0), 0);
    }
}
