//! Skipping unchanged memory and verified resumes (Note [Skipping unchanged memory]): a pause
//! with a retained host backup copies only the pieces that changed since the backup took them,
//! and never misses one (many cycles of random changes, several copy workers); a resume that
//! checks what came back fails on a difference and keeps the backup; a pause that fails
//! part-way leaves nothing wrongly known. Runs on the sim, the HIP double (which cannot digest:
//! everything is copied) and, in the GPU suite, on CUDA (the digest kernel).

mod common;

use common::{engine_test, pattern, req, Harness, Setup};
use tms::backup::BackupKind;
use tms::driver::sim::Prim;
use tms::engine::{Checks, Pick, State};

const BOTH: Checks = Checks {
    skip_unchanged: true,
    verify: true,
};

/// Pieces of 64 KiB on the sim (a GPU's are 2 MiB), copied by 4 workers in small pieces.
fn setup() -> Setup {
    Setup::default()
        .capacity(1 << 30)
        .granularity(64 << 10)
        .small_pieces(4)
}

/// The device's piece (its granularity).
fn piece(h: &Harness) -> u64 {
    h.pick(64 << 10, 2 << 20)
}

/// Allocations of `sizes` under `tag` with pinned backups, filled with `pattern`s.
fn filled(h: &Harness, tag: &str, sizes: &[u64]) -> (Vec<u64>, Vec<Vec<u8>>) {
    let mut ptrs = Vec::new();
    let mut model = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        let p = h.e.alloc(&req(s, tag, Some(BackupKind::Pinned))).unwrap();
        let m = pattern(s as usize, 40 + i as u64);
        h.e.write_bytes(p, &m).unwrap();
        ptrs.push(p);
        model.push(m);
    }
    (ptrs, model)
}

fn check(h: &Harness, ptrs: &[u64], model: &[Vec<u8>], what: &str) {
    for (i, (p, m)) in ptrs.iter().zip(model).enumerate() {
        let mut got = vec![0u8; m.len()];
        h.e.read_bytes(*p, &mut got).unwrap();
        if let Some(at) = got.iter().zip(m).position(|(a, b)| a != b) {
            panic!("{what}: allocation {i} differs at byte {at} of {}", m.len());
        }
    }
}

engine_test! {
    fn a_pause_copies_only_what_changed_since_its_retained_backup(h) [setup()] {
        let e = &h.e;
        let g = piece(&h);
        e.set_retain_cpu_backup(true);
        e.set_checks(Some("frozen"), BOTH);
        // The middle one ends in 3 bytes no digest covers: its last piece is always copied.
        let sizes = [8 * g, 5 * g + 3, g];
        let total: u64 = sizes.iter().sum();
        let (ptrs, mut model) = filled(&h, "frozen", &sizes);
        let digests = !h.is_hip();

        let r = e.pause(Some("frozen")).unwrap();
        assert_eq!((r.copied, r.unchanged), (total, 0), "a new backup takes everything");
        let r = e.resume(Some("frozen")).unwrap();
        assert_eq!(r.verified, if digests { total - 3 } else { 0 });
        check(&h, &ptrs, &model, "after the first cycle");

        let r = e.pause(Some("frozen")).unwrap();
        if digests {
            assert_eq!((r.copied, r.unchanged), (3, total - 3), "only the tail again");
        } else {
            assert_eq!((r.copied, r.unchanged), (total, 0), "no digests: all copied");
        }
        e.resume(Some("frozen")).unwrap();
        check(&h, &ptrs, &model, "after an unchanged cycle");

        // One byte of one piece, and a range across two pieces of another allocation.
        let at = 3 * g + 17;
        model[0][at as usize] ^= 0x5a;
        e.write_bytes(ptrs[0] + at, &model[0][at as usize..at as usize + 1]).unwrap();
        let (a, n) = (g - 5, 10);
        for b in &mut model[1][a as usize..(a + n) as usize] {
            *b = b.wrapping_add(1);
        }
        e.write_bytes(ptrs[1] + a, &model[1][a as usize..(a + n) as usize]).unwrap();
        let r = e.pause(Some("frozen")).unwrap();
        if digests {
            assert_eq!(r.copied, 3 * g + 3, "the three pieces changed, and the tail");
        }
        assert_eq!(r.copied + r.unchanged, total);
        e.resume(Some("frozen")).unwrap();
        check(&h, &ptrs, &model, "after changes");

        // Another tag keeps the default: no digests, everything copied.
        let (optr, omodel) = filled(&h, "other", &[2 * g]);
        e.pause(Some("other")).unwrap();
        e.resume(Some("other")).unwrap();
        let r = e.pause(Some("other")).unwrap();
        assert_eq!((r.copied, r.unchanged, r.verified), (2 * g, 0, 0));
        e.resume(Some("other")).unwrap();
        check(&h, &optr, &omodel, "the other tag");
    }
}

engine_test! {
    fn random_changes_over_many_cycles_are_never_missed(h) [setup()] {
        let e = &h.e;
        let g = piece(&h);
        e.set_retain_cpu_backup(true);
        e.set_checks(None, BOTH);
        let sizes = [16 * g, 7 * g + 8, 3 * g + 5];
        let (ptrs, mut model) = filled(&h, "t", &sizes);
        let total: u64 = sizes.iter().sum();
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n.max(1)
        };
        for cycle in 0..h.pick(40, 12) {
            // Some cycles change nothing; others a few ranges of any length and place.
            let changes = next(4);
            for _ in 0..changes {
                let i = next(3) as usize;
                let len = model[i].len() as u64;
                let at = next(len);
                let most = if next(2) == 0 { 8 } else { 3 * g };
                let n = 1 + next((len - at).min(most));
                for b in &mut model[i][at as usize..(at + n) as usize] {
                    *b = b.wrapping_mul(31).wrapping_add(cycle as u8 + 1);
                }
                e.write_bytes(ptrs[i] + at, &model[i][at as usize..(at + n) as usize])
                    .unwrap();
            }
            let r = e.pause(None).unwrap();
            assert_eq!(r.copied + r.unchanged, total, "cycle {cycle}");
            if changes == 0 && !h.is_hip() {
                // Only the tail piece of the last allocation (5 bytes no digest covers).
                assert_eq!(r.copied, 5, "cycle {cycle}: nothing changed");
            }
            e.resume(None).unwrap();
            check(&h, &ptrs, &model, &format!("cycle {cycle}"));
        }
    }
}

engine_test! {
    sim_only fn a_restore_that_brings_back_other_bytes_fails_and_keeps_the_backup(h) [setup()] {
        let (sim, e) = (h.simulated(), &h.e);
        let g = piece(&h);
        e.set_checks(Some("kv"), Checks { skip_unchanged: false, verify: true });
        let (ptrs, model) = filled(&h, "kv", &[4 * g]);
        e.pause(Some("kv")).unwrap();
        sim.corrupt_next_h2d(1);
        let err = e.resume(Some("kv")).unwrap_err().to_string();
        assert!(
            err.contains("differ from its backup after the restore") && err.contains("tag \"kv\""),
            "{err}"
        );
        assert!(err.contains("stays paused") || err.contains("undone"), "{err}");
        let a = &e.allocations()[0];
        assert_eq!((a.state, a.host_bytes), (State::Paused, 4 * g), "paused, backup kept");
        let r = e.resume(Some("kv")).unwrap();
        assert_eq!(r.verified, 4 * g);
        check(&h, &ptrs, &model, "after the retry");

        // Asked for by the caller, on a tag that does not check: the same, and the digests of
        // the backup, unknown without the setting, are taken on the host.
        let (optr, omodel) = filled(&h, "plain", &[3 * g + 8]);
        e.pause(Some("plain")).unwrap();
        sim.corrupt_next_h2d(1);
        let pick = Pick { tag: Some("plain"), verify: true, ..Pick::default() };
        let err = e.resume_pick(&pick).unwrap_err().to_string();
        assert!(err.contains("bytes 0..") && err.contains("piece 0"), "{err}");
        let r = e.resume_pick(&pick).unwrap();
        assert_eq!(r.verified, 3 * g + 8);
        check(&h, &optr, &omodel, "plain, after the retry");
        // Unasked, a corrupted restore of that tag goes unseen: the check is what finds it.
        e.pause(Some("plain")).unwrap();
        sim.corrupt_next_h2d(1);
        assert_eq!(e.resume(Some("plain")).unwrap().verified, 0);
    }
}

engine_test! {
    sim_only fn a_pause_that_fails_part_way_leaves_nothing_wrongly_known(h) [setup()] {
        let (sim, e) = (h.simulated(), &h.e);
        let g = piece(&h);
        e.set_retain_cpu_backup(true);
        e.set_checks(None, BOTH);
        // Several backup chunks (1 MiB here), so that the pause fails with some copied.
        let (ptrs, mut model) = filled(&h, "t", &[64 * g]);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        // Change every piece, then fail the pause at its third copy: some pieces of the backup
        // are new, some old, none may be taken for known.
        let before = model[0].clone();
        for (k, b) in model[0].iter_mut().enumerate().step_by(g as usize / 2) {
            *b ^= 0xff;
            e.write_bytes(ptrs[0] + k as u64, &[*b]).unwrap();
        }
        sim.arm_fault(Prim::CopyD2H, 3, 999);
        assert!(e.pause(None).is_err());
        assert_eq!(e.allocations()[0].state, State::Active);
        // The device goes back to what the backup's old digests describe: the pieces the failed
        // pause wrote must not be taken for unchanged.
        e.write_bytes(ptrs[0], &before).unwrap();
        model[0] = before;
        let r = e.pause(None).unwrap();
        assert!(r.copied > 0, "what the failed pause wrote is copied again");
        e.resume(None).unwrap();
        check(&h, &ptrs, &model, "after the failed pause and a good one");
    }
}

engine_test! {
    /// A pause of unchanged chunks whose last run cannot be unmapped: what it counts as found
    /// unchanged is only of the runs it paused, never more than it counts saved.
    sim_only fn a_run_that_fails_to_unmap_counts_none_of_its_bytes_unchanged(h) [setup()] {
        let (sim, e) = (h.simulated(), &h.e);
        let g = piece(&h);
        e.set_retain_cpu_backup(true);
        e.set_checks(None, BOTH);
        let req = tms::engine::AllocRequest {
            chunk: g,
            ..req(4 * g, "t", Some(BackupKind::Pinned))
        };
        let p = e.alloc(&req).unwrap();
        let model = vec![pattern((4 * g) as usize, 5)];
        e.write_bytes(p, &model[0]).unwrap();
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        // Chunks 0 and 2: two runs, both unchanged; the second one's unmap fails.
        sim.arm_fault(Prim::Unmap, 2, 999);
        let err = e.pause_pick(&Pick::chunks(p, &[0, 2])).unwrap_err().to_string();
        assert!(err.contains("cuMemUnmap"), "{err}");
        let t = e.stats().tags.into_iter().find(|t| &*t.tag == "t").unwrap();
        let last = t.last_pause.expect("the failed pause's numbers");
        assert_eq!((last.copied_bytes, last.unchanged_bytes), (0, g), "chunk 0, unchanged");
        e.resume(None).unwrap();
        check(&h, &[p], &model, "after the failed pause");
        let r = e.pause(None).unwrap();
        assert_eq!(r.copied + r.unchanged, 4 * g);
        e.resume(None).unwrap();
        check(&h, &[p], &model, "after the next cycle");
    }
}

engine_test! {
    fn a_driver_that_cannot_digest_refuses_an_asked_check_and_loses_nothing(h) [setup()] {
        let e = &h.e;
        let g = piece(&h);
        let (ptrs, model) = filled(&h, "t", &[2 * g]);
        e.pause(None).unwrap();
        let pick = Pick { verify: true, ..Pick::default() };
        if h.is_hip() {
            let err = e.resume_pick(&pick).unwrap_err().to_string();
            assert!(err.contains("cannot digest device memory"), "{err}");
            assert_eq!(e.allocations()[0].state, State::Paused);
            e.resume(None).unwrap();
        } else {
            assert_eq!(e.resume_pick(&pick).unwrap().verified, 2 * g);
        }
        check(&h, &ptrs, &model, "resumed");
    }
}

engine_test! {
    sim_only fn a_non_blocking_resume_that_brings_back_other_bytes_fails_its_waits(h) [setup()] {
        let (sim, e) = (h.simulated(), &h.e);
        let g = piece(&h);
        e.set_checks(Some("kv"), Checks { skip_unchanged: false, verify: true });
        let (ptrs, model) = filled(&h, "kv", &[6 * g]);
        e.pause(Some("kv")).unwrap();
        sim.corrupt_next_h2d(1);
        // Checked after it returned: the waits raise it, the memory stays paused with its
        // backup, and a resume then restores it.
        tms::Engine::resume_nonblocking(e.clone(), Some("kv"), &[], None).unwrap();
        let err = e
            .wait_restored(None, Some(std::time::Duration::from_secs(30)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("differ from its backup after the restore"), "{err}");
        assert!(e.wait_restored(Some(ptrs[0]), None).is_err(), "every wait, until resumed");
        assert_eq!(e.allocations()[0].host_bytes, 6 * g, "the backup is kept");
        let r = e.resume(Some("kv")).unwrap();
        assert_eq!(r.verified, 6 * g);
        assert!(e.wait_restored(None, None).unwrap());
        check(&h, &ptrs, &model, "after the resume");
    }
}

engine_test! {
    sim_only fn a_digest_that_fails_costs_the_skipping_or_the_resume_never_data(h) [setup()] {
        let (sim, e) = (h.simulated(), &h.e);
        let g = piece(&h);
        e.set_retain_cpu_backup(true);
        e.set_checks(None, BOTH);
        let (ptrs, model) = filled(&h, "t", &[4 * g]);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        // At a pause: everything is copied, and the pause succeeds.
        sim.arm_fault(Prim::Digest, 1, 999);
        let r = e.pause(None).unwrap();
        assert_eq!((r.copied, r.unchanged), (4 * g, 0));
        // At a verified resume: the resume fails and stays paused with its backup; the next
        // one succeeds.
        sim.arm_fault(Prim::Digest, 1, 999);
        let err = e.resume(None).unwrap_err().to_string();
        assert!(err.contains("cuLaunchKernel"), "{err}");
        assert_eq!(e.allocations()[0].state, State::Paused);
        assert_eq!(e.resume(None).unwrap().verified, 4 * g);
        check(&h, &ptrs, &model, "after the failures");
    }
}

/// A caller writes `n` bytes of `v` at `ptr`, a backup it was handed.
fn scribble(ptr: *const u8, n: usize, v: u8) {
    // SAFETY: `ptr` is a view of a live host backup at least `n` bytes long, which the test
    // holds (a lease) or which nothing else touches meanwhile (an unguarded pointer).
    unsafe { std::ptr::write_bytes(ptr.cast_mut(), v, n) };
}

engine_test! {
    fn a_backup_handed_out_for_writing_is_copied_whole_at_the_next_pause(h) [setup()] {
        let e = &h.e;
        let g = piece(&h);
        e.set_retain_cpu_backup(true);
        e.set_checks(Some("w"), BOTH);
        let (ptrs, model) = filled(&h, "w", &[4 * g, 4 * g]);
        e.pause(Some("w")).unwrap();
        e.resume(Some("w")).unwrap();
        // While active, a lease's holder writes into the last pause's snapshot and lets it go;
        // a caller of the unguarded pointer writes too. Unchanged device memory must not be
        // taken for what the backup holds now.
        let l = e.acquire_cpu_backup(ptrs[0] + 64, 64).unwrap().expect("a retained snapshot");
        scribble(l.ptr, 16, 0xee);
        e.release_cpu_backup(l.lease).unwrap();
        let p = e.cpu_backup_ptr(ptrs[1], 4 * g).unwrap().expect("a retained snapshot");
        scribble(p.wrapping_add(g as usize + 5), 3, 0xee);
        let r = e.pause(Some("w")).unwrap();
        assert_eq!((r.copied, r.unchanged), (8 * g, 0), "both backups were written by callers");
        e.resume(Some("w")).unwrap();
        check(&h, &ptrs, &model, "after a pause that followed the callers' writes");
        // The unguarded pointer still reaches the reused buffer: that one is always copied
        // whole; the leased one is known again.
        scribble(p, 8, 0x11);
        let r = e.pause(Some("w")).unwrap();
        let digests = !h.is_hip();
        let skipped = if digests { 4 * g } else { 0 };
        assert_eq!((r.copied, r.unchanged), (8 * g - skipped, skipped));
        e.resume(Some("w")).unwrap();
        check(&h, &ptrs, &model, "after a write through the pointer kept");
    }
}

engine_test! {
    fn a_verified_resume_from_a_disk_backup_is_refused_and_stays_paused(h) [setup().disk()] {
        let e = &h.e;
        let g = piece(&h);
        let p = e.alloc(&req(4 * g, "opt", Some(BackupKind::Disk))).unwrap();
        let m = pattern((4 * g) as usize, 9);
        e.write_bytes(p, &m).unwrap();
        e.pause(Some("opt")).unwrap();
        let asked = Pick { tag: Some("opt"), verify: true, ..Pick::default() };
        let err = e.resume_pick(&asked).unwrap_err().to_string();
        assert!(err.contains("restored from its disk backup"), "{err}");
        assert_eq!(e.allocations()[0].state, State::Paused, "refused before anything was mapped");
        // The tag's own setting leaves disk backups to their checksums: the resume goes on.
        e.set_checks(Some("opt"), BOTH);
        let r = e.resume(Some("opt")).unwrap();
        assert_eq!(r.verified, 0);
        check(&h, &[p], &[m], "after the resume without the check");
    }
}

engine_test! {
    /// A non-blocking resume of a tag that verifies digests what it restored after its caller
    /// returned, while the caller's stream waits for it: what digesting needs first (on CUDA
    /// the kernel's loading, which may wait for the device's queued work; device-wide on the
    /// sim) is made ready before the caller returns, or the restore would wait for itself.
    fn a_non_blocking_resume_that_verifies_is_ready_to_digest_before_it_returns(h) [setup()] {
        let e = &h.e;
        let g = piece(&h);
        let (ptrs, model) = filled(&h, "kv", &[6 * g, 2 * g]);
        // Checking is turned on once paused: the restore's digests are the first.
        e.pause(Some("kv")).unwrap();
        e.set_checks(Some("kv"), Checks { skip_unchanged: false, verify: true });
        let stream = tms::engine::StreamOf {
            device: h.device(0),
            stream: tms::driver::Stream(if h.sim().is_some() { 0x5151 } else { 0 }),
        };
        // On the sim no copy completes (so nothing is digested) until the caller has returned
        // and its stream waits.
        let sim = h.sim();
        if let Some(sim) = sim {
            sim.hold(Prim::EventSync, None);
        }
        let r = tms::Engine::resume_nonblocking(e.clone(), Some("kv"), &[], Some(stream));
        if let Some(sim) = sim {
            assert_eq!(sim.gated_streams().len(), 1, "the caller's stream waits");
            sim.unhold(Prim::EventSync, None);
        }
        r.unwrap();
        assert!(e.wait_restored(None, Some(std::time::Duration::from_secs(30))).unwrap());
        check(&h, &ptrs, &model, "after the resume");
        // A pause waits for the resume's end, which records what it verified.
        e.pause(Some("kv")).unwrap();
        let t = e.stats().tags.into_iter().find(|t| &*t.tag == "kv").unwrap();
        let verified = t.last_resume.map(|r| r.verified_bytes);
        assert_eq!(verified, Some(if h.is_hip() { 0 } else { 8 * g }));
        e.resume(Some("kv")).unwrap();
        check(&h, &ptrs, &model, "after the next cycle");
    }
}
