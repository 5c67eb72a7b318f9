//! Chunked allocations (engine Note [Chunked allocations]): what the model test does not reach
//! (leased backups, out of memory part-way, clear errors for bad requests, inward rounding,
//! statistics of partial allocations).

mod common;

use common::{engine_test, pattern, Setup};
use tms::backup::BackupKind;
use tms::engine::{AllocRequest, Engine, Pick, State};

/// One device of `capacity` bytes, three copy workers, small host chunks and staging slots.
fn chunks(capacity: u64) -> Setup {
    Setup::default().capacity(capacity).small_pieces(3)
}

fn chunked(size: u64, chunk: u64, tag: &str, backup: Option<BackupKind>) -> AllocRequest {
    AllocRequest {
        size,
        device: 0,
        tag: tag.into(),
        backup,
        chunk,
    }
}

fn states(e: &Engine, p: u64) -> Vec<bool> {
    e.chunk_info(p).unwrap().active
}

engine_test! {
    /// A pause of chunk 0 while a reader holds the backup (a lease) must not write into the
    /// reader's buffer; the new buffer must still hold the other chunks' saved contents, which
    /// exist nowhere else while they are paused.
    fn a_leased_backup_is_carried_into_the_next_pause(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        e.set_retain_cpu_backup(true);
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Mmap)))
            .unwrap();
        let old = pattern((4 * g) as usize, 1);
        h.write(p, &old);
        e.pause(Some("kv")).unwrap();
        e.resume_pick(&Pick::chunks(p, &[0])).unwrap();
        assert_eq!(states(e, p), [true, false, false, false]);
        let lease = e
            .acquire_cpu_backup(p, 4 * g)
            .unwrap()
            .expect("a complete snapshot");
        let new0 = pattern(g as usize, 2);
        h.write(p, &new0);
        e.pause_pick(&Pick::chunks(p, &[0])).unwrap();
        // The lease still reads the old contents of chunk 0.
        // SAFETY: the lease keeps the buffer mapped and unchanged until it is released.
        let leased = unsafe { std::slice::from_raw_parts(lease.ptr, (4 * g) as usize) };
        assert!(leased == &old[..], "the leased snapshot changed");
        e.resume(Some("kv")).unwrap();
        assert!(h.read(p, g as usize) == new0, "chunk 0");
        assert!(
            h.read(p + g, (3 * g) as usize) == old[g as usize..],
            "chunks 1-3 carried over"
        );
        e.release_cpu_backup(lease.lease).unwrap();
    }
}

engine_test! {
    fn bad_chunk_requests_are_refused_with_the_numbers(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let msg = |r: tms::Result<u64>| r.unwrap_err().to_string();
        let m = msg(e.alloc(&chunked(3 * g, 2 * g, "kv", None)));
        assert!(
            m.contains(&format!("chunk size {}", 2 * g)) && m.contains(&(3 * g).to_string()),
            "{m}"
        );
        let m = msg(e.alloc(&chunked(3 * g, 4096, "kv", None)));
        assert!(m.contains("granularity") && m.contains("4096"), "{m}");
        let e1 = e.alloc(&chunked(4 * g, g, "kv", None)).unwrap();
        let m = e
            .pause_pick(&Pick::chunks(e1, &[1, 4]))
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("chunk 4") && m.contains("it has 4 chunks"),
            "{m}"
        );
        let m = e
            .pause_pick(&Pick::chunks(e1, &[2, 1]))
            .unwrap_err()
            .to_string();
        assert!(m.contains("sorted"), "{m}");
        let plain = e.alloc(&chunked(g, 0, "w", None)).unwrap();
        let m = e
            .pause_pick(&Pick::chunks(plain, &[0]))
            .unwrap_err()
            .to_string();
        assert!(m.contains("is not chunked"), "{m}");
        assert!(e
            .chunk_info(plain)
            .unwrap_err()
            .to_string()
            .contains("not chunked"));
        let m = e.chunked("w").unwrap_err().to_string();
        assert!(m.contains("no chunked allocation"), "{m}");
        let e2 = e.alloc(&chunked(2 * g, g, "kv", None)).unwrap();
        let m = e.chunked("kv").unwrap_err().to_string();
        assert!(
            m.contains("2 chunked allocations")
                && m.contains(&format!("{e1:#x}"))
                && m.contains(&format!("{e2:#x}")),
            "{m}"
        );
        // Nothing was paused by any of it.
        assert!(e.allocations().iter().all(|a| a.state == State::Active));
    }
}

engine_test! {
    fn ranges_round_inward_to_whole_chunks(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e.alloc(&chunked(8 * g, g, "kv", None)).unwrap();
        let (start, idx) = e.chunks_in(p + 1, 3 * g).unwrap();
        assert_eq!((start, idx), (p, vec![1, 2]));
        assert_eq!(e.chunks_in(p + g, 2 * g).unwrap().1, vec![1, 2]);
        assert_eq!(e.chunks_in(p + 1, g).unwrap().1, Vec::<usize>::new());
        assert_eq!(e.chunks_in(p, 8 * g).unwrap().1, (0..8).collect::<Vec<_>>());
        assert!(e.chunks_in(p, 8 * g + 1).is_err(), "beyond the allocation");
        assert_eq!(e.chunks_in(p + 1, 0).unwrap().1, Vec::<usize>::new());
        // The error names the range the caller gave, an empty one too.
        let m = e.chunks_in(p + 8 * g, 0).unwrap_err().to_string();
        assert!(m.contains(&format!("{:#x}+0 ", p + 8 * g)), "{m}");
    }
}

engine_test! {
    /// Out of memory part-way through a resume of chunks: every one of them stays paused with its
    /// backup, the error says which, and a retry once memory is free restores them all.
    sim_only fn a_failed_resume_of_chunks_names_them_and_a_retry_restores(h)
        [chunks(8 * (2 << 20))]
    {
        let (sim, e, g) = (h.simulated(), &h.e, h.g());
        let p = e
            .alloc(&chunked(6 * g, g, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        let data = pattern((6 * g) as usize, 3);
        h.write(p, &data);
        e.pause_pick(&Pick::chunks(p, &[1, 2, 3, 5])).unwrap();
        assert_eq!(states(e, p), [true, false, false, false, true, false]);
        let hog = e.alloc(&chunked(4 * g, 0, "hog", None)).unwrap();
        let err = e.resume_pick(&Pick::chunks(p, &[1, 2, 3, 5])).unwrap_err();
        let m = err.to_string();
        assert!(err.is_oom(), "{m}");
        assert!(
            m.contains(&format!("chunks 1-3,5 of allocation {p:#x}")),
            "{m}"
        );
        assert_eq!(states(e, p), [true, false, false, false, true, false]);
        assert_eq!(
            sim.live_bytes(0),
            6 * g,
            "nothing of the failed resume stays mapped"
        );
        e.free(hog).unwrap();
        e.resume_pick(&Pick::chunks(p, &[1, 2, 3, 5])).unwrap();
        assert!(h.read(p, (6 * g) as usize) == data);
    }
}

engine_test! {
    fn statistics_count_partial_allocations_by_their_chunks(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e.alloc(&chunked(4 * g, g, "kv", None)).unwrap();
        e.alloc(&chunked(g, 0, "kv", None)).unwrap();
        e.pause_pick(&Pick::chunks(p, &[0, 3])).unwrap();
        let t = &e.stats().tags[0];
        assert_eq!(
            (
                t.allocations,
                t.active_allocations,
                t.partial_allocations,
                t.paused_allocations
            ),
            (2, 1, 1, 0)
        );
        assert_eq!((t.bytes_active, t.bytes_paused), (3 * g, 2 * g));
        h.assert_live_bytes(0, 3 * g, "three chunks mapped");
        let info = e.allocations().into_iter().find(|a| a.addr == p).unwrap();
        assert_eq!(
            (info.state, info.active_bytes, info.handles),
            (State::Partial, 2 * g, 2)
        );
        // A whole-tag pause takes the rest; chunk calls on paused chunks are skipped.
        let r = e.pause(Some("kv")).unwrap();
        assert_eq!((r.allocations, r.bytes), (2, 3 * g));
        let r = e.pause_pick(&Pick::chunks(p, &[0, 1])).unwrap();
        assert_eq!(r.allocations, 0);
        h.assert_live_bytes(0, 0, "all paused");
        // Freeing a partial allocation releases its mapped chunks and its range.
        e.resume_pick(&Pick::chunks(p, &[2])).unwrap();
        assert!(e.free(p).unwrap());
        h.assert_live_bytes(0, 0, "freed");
        if let Some(sim) = h.sim() {
            assert_eq!((sim.live_bytes(0), sim.live_handles()), (0, 0));
        }
    }
}

engine_test! {
    /// Save and restore chunk state: the chunks active at the pause come back, the others stay
    /// paused (and a plain resume afterwards brings back the rest).
    fn resume_restores_the_saved_chunk_state(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Disk)))
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        e.set_disk_backup_dir(Some(dir.path().to_path_buf()))
            .unwrap();
        let data = pattern((4 * g) as usize, 4);
        h.write(p, &data);
        e.pause_pick(&Pick::chunks(p, &[1])).unwrap();
        let save = Pick {
            chunk_state: true,
            ..Pick::tag(Some("kv"))
        };
        e.pause_pick(&save).unwrap();
        assert_eq!(states(e, p), [false; 4]);
        e.resume_pick(&save).unwrap();
        assert_eq!(states(e, p), [true, false, true, true]);
        for c in [0u64, 2, 3] {
            let r = (c * g) as usize..((c + 1) * g) as usize;
            assert!(
                h.read(p + c * g, g as usize) == data[r],
                "chunk {c}"
            );
        }
        e.resume(Some("kv")).unwrap();
        assert!(h.read(p, (4 * g) as usize) == data);
    }
}

engine_test! {
    /// A pause that saves chunk states records them for every chunked allocation of the tag, those
    /// whose chunks are all paused already too: the next restoring resume brings back none of
    /// theirs, neither all of them (no record) nor what an older pause recorded.
    fn saving_chunk_states_records_allocations_with_nothing_left_to_pause(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let backup = Some(BackupKind::Pinned);
        let a = e.alloc(&chunked(4 * g, g, "kv", backup)).unwrap();
        let b = e.alloc(&chunked(4 * g, g, "kv", backup)).unwrap();
        let data = pattern((4 * g) as usize, 9);
        h.write(b, &data);
        let save = Pick {
            chunk_state: true,
            ..Pick::tag(Some("kv"))
        };
        // An older record of a: chunk 1 paused, the others active.
        e.pause_pick(&Pick::chunks(a, &[1])).unwrap();
        e.pause_pick(&save).unwrap();
        e.resume_pick(&Pick::chunks(a, &[0])).unwrap();
        e.pause_pick(&Pick::chunks(a, &[0])).unwrap();
        assert_eq!(states(e, a), [false; 4]);
        e.resume(Some("kv")).unwrap();
        e.pause_pick(&Pick::chunks(a, &[0, 1, 2, 3])).unwrap();
        e.pause_pick(&Pick::chunks(b, &[2])).unwrap();
        // a has nothing left to pause; b has three chunks active.
        e.pause_pick(&save).unwrap();
        assert_eq!(states(e, a), [false; 4]);
        assert_eq!(states(e, b), [false; 4]);
        e.resume_pick(&save).unwrap();
        assert_eq!(
            states(e, a),
            [false; 4],
            "a's chunks were all paused at the save"
        );
        assert_eq!(states(e, b), [true, true, false, true]);
        for c in [0u64, 1, 3] {
            let r = (c * g) as usize..((c + 1) * g) as usize;
            assert!(
                h.read(b + c * g, g as usize) == data[r],
                "chunk {c} of b"
            );
        }
        // The record was used: a restoring resume without a newer save resumes everything.
        e.resume_pick(&save).unwrap();
        assert_eq!(states(e, a), [true; 4]);
        assert_eq!(states(e, b), [true; 4]);
    }
}

engine_test! {
    /// The saved state covers allocations that are not chunked too: one paused before the saving
    /// pause stays paused through the restoring resume, one active then comes back with its
    /// contents. (A job-wide pause undoes itself this way, leaving what was paused before alone.)
    fn saved_state_covers_whole_allocations(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let whole = |size| chunked(size, 0, "w", Some(BackupKind::Pinned));
        let before = e.alloc(&whole(g)).unwrap();
        let active = e.alloc(&whole(2 * g)).unwrap();
        let data = pattern((2 * g) as usize, 5);
        h.write(active, &data);
        e.pause_pick(&Pick {
            alloc: Some(before),
            ..Pick::tag(Some("w"))
        })
        .unwrap();
        let save = Pick {
            chunk_state: true,
            ..Pick::tag(Some("w"))
        };
        let r = e.pause_pick(&save).unwrap();
        assert_eq!((r.allocations, r.bytes), (1, 2 * g));
        let r = e.resume_pick(&save).unwrap();
        assert_eq!(
            (r.allocations, r.bytes),
            (1, 2 * g),
            "only what was active at the save"
        );
        h.assert_live_bytes(0, 2 * g, "the active one");
        assert!(h.read(active, (2 * g) as usize) == data);
        // The record was used: a plain resume brings back the other one.
        let r = e.resume(Some("w")).unwrap();
        assert_eq!((r.allocations, r.bytes), (1, g));
    }
}

engine_test! {
    /// Page-locking in the background touches every page of a buffer: a chunked allocation's backup
    /// is page-locked only where it holds saved chunks (whole host chunks of them), never for
    /// chunks that were not saved; and chunks resumed without retention are unregistered before
    /// their pages are given back.
    fn background_page_locking_covers_only_saved_chunks(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        e.set_retain_cpu_backup(true);
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        let data = pattern((4 * g) as usize, 5);
        h.write(p, &data);
        let pinned = |e: &Engine| {
            assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(20)));
            e.allocations()[0].host_pinned_bytes
        };
        // Chunks 1 and 3: host chunks (1 MiB) 2-3 and 6-7.
        e.pause_pick(&Pick::chunks(p, &[1, 3])).unwrap();
        e.resume_pick(&Pick::chunks(p, &[1, 3])).unwrap();
        assert_eq!(pinned(e), 2 * g, "the saved half is page-locked");
        let base = e
            .cpu_backup_ptr(p + g, g)
            .unwrap()
            .expect("chunk 1 is saved") as usize;
        let base = base - g as usize;
        if let Some(sim) = h.sim() {
            // The sim can tell which host ranges are page-locked.
            let registered = sim.host_registrations();
            for c in [1, 3] {
                let at = base + c * g as usize;
                assert!(
                    registered
                        .iter()
                        .any(|&(s, l)| s <= at && at < s + l as usize),
                    "chunk {c} registered"
                );
            }
            for c in [0, 2] {
                let (lo, hi) = (base + c * g as usize, base + (c + 1) * g as usize);
                assert!(
                    !registered
                        .iter()
                        .any(|&(s, l)| s < hi && lo < s + l as usize),
                    "chunk {c} was never saved, so it is not registered"
                );
            }
        }
        e.pause(Some("kv")).unwrap();
        assert_eq!(pinned(e), 4 * g, "a whole backup is page-locked whole");
        // Without retention, resumed chunks are unregistered and given back; the others stay.
        e.set_retain_cpu_backup(false);
        e.resume_pick(&Pick::chunks(p, &[0, 1])).unwrap();
        assert_eq!(e.allocations()[0].host_pinned_bytes, 2 * g);
        assert_eq!(
            resident(base as *const u8, (2 * g) as usize),
            Some(false),
            "chunks 0-1 given back"
        );
        if let Some(sim) = h.sim() {
            assert!(sim
                .host_registrations()
                .iter()
                .all(|&(s, _)| s >= base + 2 * g as usize));
        }
        e.resume(Some("kv")).unwrap();
        assert!(h.read(p, (4 * g) as usize) == data);
        e.wait_released();
        if let Some(sim) = h.sim() {
            assert!(
                sim.host_registrations().is_empty(),
                "all unregistered with the buffer"
            );
        }
    }
}

engine_test! {
    /// Chunks resumed without retention give their host memory back before the resume returns
    /// (docs/semantics.md), while their paused neighbours keep theirs. A caller holding a lease
    /// on a paused neighbour's backup reads only that chunk's bytes: the lease must not keep the
    /// resumed chunks' pages (before, any lease on the buffer kept all of them, resident but no
    /// longer counted in `host_backup_bytes`, until the buffer went).
    fn a_lease_on_a_paused_chunk_keeps_only_its_own_pages(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Mmap)))
            .unwrap();
        let data = pattern((4 * g) as usize, 5);
        h.write(p, &data);
        e.pause(Some("kv")).unwrap();
        let lease = e
            .acquire_cpu_backup(p + 3 * g, g)
            .unwrap()
            .expect("chunk 3 is paused with its backup");
        let base = lease.ptr as usize - 3 * g as usize;
        assert_eq!(resident(base as *const u8, (2 * g) as usize), Some(true));
        e.resume_pick(&Pick::chunks(p, &[0, 1])).unwrap();
        assert_eq!(e.allocations()[0].host_bytes, 2 * g, "chunks 2-3 are backed up");
        assert_eq!(
            resident(base as *const u8, (2 * g) as usize),
            Some(false),
            "chunks 0-1, resumed without retention, given back though chunk 3 is leased"
        );
        // SAFETY: the lease keeps chunk 3's g bytes mapped and unchanged until it is released.
        let leased = unsafe { std::slice::from_raw_parts(lease.ptr, g as usize) };
        assert!(leased == &data[(3 * g) as usize..], "the leased chunk is intact");
        e.release_cpu_backup(lease.lease).unwrap();
        e.resume(Some("kv")).unwrap();
        assert!(h.read(p, (4 * g) as usize) == data);
    }
}

/// Whether every page of `[p, p+len)` is resident in host memory (`Some(true)`), none is
/// (`Some(false)`), or some are (`None`).
fn resident(p: *const u8, len: usize) -> Option<bool> {
    // mincore reports a byte per page of the kernel, whose size sysconf may not tell (qemu-user
    // emulating a larger page than its host's): room for 4 KiB pages, and only the bytes the
    // kernel wrote count (it sets bit 0 and clears the others; UNSEEN has bit 0 clear).
    const UNSEEN: u8 = 0xFE;
    let mut v = vec![UNSEEN; len.div_ceil(4096)];
    // SAFETY: p..p+len is inside a live mapping (the backup buffer, held by the engine), and
    // `v` has a byte per page of the smallest page size.
    let r = unsafe { libc::mincore(p as *mut libc::c_void, len, v.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore");
    let seen: Vec<bool> = v
        .iter()
        .filter(|b| **b != UNSEEN)
        .map(|b| b & 1 == 1)
        .collect();
    assert!(!seen.is_empty(), "mincore wrote nothing");
    match (seen.iter().all(|b| *b), seen.iter().any(|b| *b)) {
        (true, _) => Some(true),
        (false, false) => Some(false),
        _ => None,
    }
}

engine_test! {
    /// Chunks resumed without retention give their part of the backup's host memory back, although
    /// the buffer stays for the chunks still paused.
    fn resumed_chunks_give_their_host_memory_back(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Mmap)))
            .unwrap();
        let data = pattern((4 * g) as usize, 6);
        h.write(p, &data);
        e.pause(Some("kv")).unwrap();
        let base = e.cpu_backup_ptr(p, 4 * g).unwrap().expect("a snapshot");
        assert_eq!(resident(base, (4 * g) as usize), Some(true));
        e.resume_pick(&Pick::chunks(p, &[0, 1])).unwrap();
        assert_eq!(resident(base, (2 * g) as usize), Some(false), "chunks 0-1 given back");
        assert_eq!(
            resident(base.wrapping_add((2 * g) as usize), (2 * g) as usize),
            Some(true),
            "chunks 2-3 kept"
        );
        assert_eq!(e.allocations()[0].host_bytes, 2 * g);
        assert_eq!(
            e.cpu_backup_ptr(p, g).unwrap(),
            None,
            "no snapshot of chunk 0 any more"
        );
        e.resume(Some("kv")).unwrap();
        assert!(h.read(p, (4 * g) as usize) == data);
    }
}

engine_test! {
    /// A page-locking queued for later is dropped when the chunk's pages are given back meanwhile
    /// (it would bring them back as zeroes and pin them); one still wanted goes ahead.
    fn given_back_chunks_are_not_page_locked_later(h) [chunks(64 << 20)] {
        use tms::backup::{HostBuffer, HostLayout};
        let layout = HostLayout {
            chunk: 1 << 20,
            hugepages: false,
            streaming: false,
        };
        let b = HostBuffer::new(h.driver().clone(), 0, BackupKind::Pinned, 4 << 20, layout)
            .unwrap();
        assert_eq!(b.chunks_within(&[(1 << 20, 2 << 20)]), vec![1, 2]);
        assert_eq!(
            b.chunks_within(&[(1 << 19, 2 << 20)]),
            vec![1],
            "whole chunks only"
        );
        b.want(&[0, 1, 2]);
        b.drop_pages(0, 2 << 20);
        for i in 0..4 {
            b.pin_wanted(i).unwrap();
        }
        assert!(
            !b.is_pinned(0) && !b.is_pinned(1),
            "given back: no longer wanted"
        );
        assert!(b.is_pinned(2), "still wanted");
        assert!(!b.is_pinned(3), "never wanted");
        assert_eq!(b.pinned_bytes(), 1 << 20);
        // A page-locked chunk the range only touches is unregistered too; its other pages stay.
        b.drop_pages(5 << 19, 1 << 19);
        assert!(!b.is_pinned(2), "touched: unregistered");
        if let Some(sim) = h.sim() {
            assert_eq!(sim.host_registrations(), vec![]);
        }
    }
}

engine_test! {
    /// A buffer page-locked with its pages faulted in first (the staging slots) is page-locked
    /// whole, zero-filled, and as usable for copies as one page-locked straight away.
    fn a_buffer_populated_then_page_locked_is_whole_and_usable(h) [chunks(64 << 20)] {
        use tms::backup::{HostBuffer, HostLayout};
        let layout = HostLayout {
            chunk: 1 << 20,
            hugepages: true,
            streaming: false,
        };
        let b = HostBuffer::new(h.driver().clone(), 0, BackupKind::Pinned, 3 << 20, layout)
            .unwrap();
        b.pin_all_populated().unwrap();
        assert!((0..3).all(|i| b.is_pinned(i)));
        assert_eq!(b.pinned_bytes(), 3 << 20);
        assert!(b.as_slice().iter().all(|&x| x == 0), "fresh memory reads as zeroes");
    }
}

engine_test! {
    /// Releasing buffers gives back before it returns the memory of a buffer that someone held
    /// only for a moment (the background pinner, page-locking one chunk), and leaves one still
    /// held past that moment (a caller's lease) to its holder.
    sim_only fn a_buffer_held_for_a_moment_is_released_before_the_call_returns(h) [chunks(64 << 20)] {
        use tms::backup::{release_parallel, HostBuffer, HostLayout};
        let sim = h.simulated();
        let layout = HostLayout {
            chunk: 1 << 20,
            hugepages: false,
            streaming: false,
        };
        let make = || {
            let b = HostBuffer::new(h.driver().clone(), 0, BackupKind::Pinned, 2 << 20, layout)
                .unwrap();
            b.pin_all().unwrap();
            std::sync::Arc::new(b)
        };
        for hold_ms in [20u64, 600] {
            let b = make();
            assert_eq!(sim.registered_ranges(), 2);
            let held = b.clone();
            let holder = std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(hold_ms));
                drop(held);
            });
            release_parallel(vec![b], 2);
            if hold_ms < 100 {
                assert_eq!(sim.registered_ranges(), 0, "held {hold_ms} ms: released in the call");
            } else {
                assert_eq!(sim.registered_ranges(), 2, "held {hold_ms} ms: left to its holder");
            }
            holder.join().unwrap();
            assert_eq!(sim.registered_ranges(), 0, "held {hold_ms} ms: gone with the last holder");
        }
    }
}

engine_test! {
    /// Chunks resumed with retention, then the rest without (the buffer goes): a later pause of
    /// one chunk makes a new buffer, which holds that chunk only. The others were never copied
    /// into it: no backup of theirs is handed out (not the new buffer's zeros), none counted.
    fn chunks_retained_in_a_released_buffer_are_not_offered_from_the_next_one(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        e.set_retain_cpu_backup(true);
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        let data = pattern((4 * g) as usize, 5);
        h.write(p, &data);
        e.pause(Some("kv")).unwrap();
        e.resume_pick(&Pick::chunks(p, &[0, 1])).unwrap();
        e.set_retain_cpu_backup(false);
        e.resume_pick(&Pick::chunks(p, &[2, 3])).unwrap();
        let mut got = vec![0u8; g as usize];
        assert!(!e.copy_cpu_backup(p, &mut got).unwrap(), "the buffer went with the resume");
        e.pause_pick(&Pick::chunks(p, &[2])).unwrap();
        assert!(
            !e.copy_cpu_backup(p, &mut got).unwrap(),
            "chunk 0 offered from a buffer it was never copied into"
        );
        assert!(e.copy_cpu_backup(p + 2 * g, &mut got).unwrap());
        assert!(got[..] == data[(2 * g) as usize..(3 * g) as usize], "chunk 2's backup");
        let t = e.stats().tags.into_iter().find(|t| &*t.tag == "kv").unwrap();
        assert_eq!(t.host_backup_bytes, g, "host memory of the one chunk held");
        e.resume(Some("kv")).unwrap();
        assert!(h.read(p, (4 * g) as usize) == data);
    }
}

engine_test! {
    /// Chunk 0 is paused (its contents only in the host backup) and a reader holds a lease on
    /// that backup, so a pause of chunk 1 cannot reuse the buffer: it makes a new one and carries
    /// chunk 0 into it. That pause fails before the new buffer is made (the host cannot hold
    /// it): the old buffer is still the allocation's, and the resume restores chunk 0 from it.
    sim_only fn a_failed_pause_keeps_the_backup_of_paused_chunks_while_it_is_leased(h) [chunks(64 << 20)] {
        let (sim, e, g) = (h.simulated(), &h.e, h.g());
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Mmap)))
            .unwrap();
        let data = pattern((4 * g) as usize, 1);
        h.write(p, &data);
        e.pause_pick(&Pick::chunks(p, &[0])).unwrap();
        let lease = e
            .acquire_cpu_backup(p, g)
            .unwrap()
            .expect("chunk 0 is paused with a complete snapshot");
        // The new buffer (chunk 1's copy plus chunk 0 carried) does not fit.
        sim.set_host_memory(Some(1 << 20));
        let err = e.pause_pick(&Pick::chunks(p, &[1])).unwrap_err();
        assert!(err.is_oom(), "{err}");
        sim.set_host_memory(None);
        let a = &e.allocations()[0];
        assert_eq!(a.state, State::Partial);
        e.release_cpu_backup(lease.lease).unwrap();
        e.resume(Some("kv")).unwrap();
        assert!(
            h.read(p, g as usize) == data[..g as usize],
            "chunk 0's contents were lost by the failed pause of chunk 1"
        );
        assert!(h.read(p + g, (3 * g) as usize) == data[g as usize..]);
    }
}

engine_test! {
    /// A zero-length request at the address just past a chunked allocation is not inside it:
    /// it must not report a complete snapshot (found) where the chunk it borders has none, nor
    /// hand out (and expose) the backup buffer for it.
    fn an_empty_range_past_the_end_is_not_a_snapshot(h) [chunks(64 << 20)] {
        let (e, g) = (&h.e, h.g());
        let p = e
            .alloc(&chunked(4 * g, g, "kv", Some(BackupKind::Pinned)))
            .unwrap();
        e.pause_pick(&Pick::chunks(p, &[1])).unwrap();
        // Chunk 3 is active without a retained backup: no snapshot of it, at any address in it.
        assert!(!e.copy_cpu_backup(p + 3 * g, &mut []).unwrap());
        let past = e.copy_cpu_backup(p + 4 * g, &mut []);
        assert!(
            !matches!(past, Ok(true)),
            "one past the end reported a complete snapshot: {past:?}"
        );
        let ptr = e.cpu_backup_ptr(p + 4 * g, 0);
        assert!(
            !matches!(ptr, Ok(Some(_))),
            "one past the end handed out the backup: {ptr:?}"
        );
    }
}
