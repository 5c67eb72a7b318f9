//! The application's allocator calls (the hooks' `alloc` and `free`) on other threads while a
//! pause, a resume or a non-blocking resume's restore runs: a free of an allocation in
//! transition waits for that allocation only (bounded by the operation), never frees what the
//! operation still copies into, and a wait afterwards neither hangs nor raises a failure of an
//! allocation that is gone; an allocation made in a tag during its pause stays active, counted
//! true.

mod common;

use std::thread;
use std::time::Duration;

use common::harness::Harness;
use common::{bounded, engine_test, pattern, req, wait_until, Setup};
use tms::backup::BackupKind;
use tms::driver::sim::Prim;
use tms::driver::DevPtr;
use tms::engine::{Engine, State};

/// Long enough for any of these calls on a loaded machine; one that waits for a held
/// primitive takes forever.
const PATIENCE: Duration = Duration::from_secs(20);

fn state(e: &Engine, p: DevPtr) -> Option<State> {
    e.allocations()
        .into_iter()
        .find(|a| a.addr == p)
        .map(|a| a.state)
}

/// Two allocations of tag `kv` with a pinned backup, each with its own contents, paused.
fn two_paused(h: &Harness) -> [(DevPtr, Vec<u8>); 2] {
    let g = h.g();
    let mk = |seed| {
        let p =
            h.e.alloc(&req(3 * g, "kv", Some(BackupKind::Pinned)))
                .unwrap();
        let data = pattern((3 * g) as usize, seed);
        h.write(p, &data);
        (p, data)
    };
    let v = [mk(1), mk(2)];
    h.e.pause(Some("kv")).unwrap();
    v
}

/// [`two_paused`], then a non-blocking resume of `kv` whose copies are held (`EventSync`),
/// and a free of the first allocation on a thread of its own, seen still waiting: the second
/// allocation with its contents, and the free's thread. Unhold `EventSync` to let both go on.
fn free_during_held_restore(
    h: &Harness,
) -> (
    DevPtr,
    (DevPtr, Vec<u8>),
    thread::JoinHandle<tms::Result<bool>>,
) {
    let e = h.e.clone();
    let [(p, _), q] = two_paused(h);
    h.simulated().hold(Prim::EventSync, None);
    Engine::resume_nonblocking(e.clone(), Some("kv"), &[], None).unwrap();
    assert!(e.restoring());
    let freer = thread::spawn(move || e.free(p));
    thread::sleep(Duration::from_millis(50));
    assert!(
        !freer.is_finished(),
        "freed while its restore was still copying into it"
    );
    (p, q, freer)
}

engine_test! {
    /// A free of an allocation a non-blocking resume is still restoring (before any wait) waits
    /// for the restore, then frees it; the restore wrote nothing after that, the other allocation
    /// has its contents, and waits neither hang nor fail.
    sim_only fn a_free_during_a_nonblocking_restore_waits_for_it(h)
        [Setup::default().small_pieces(3)]
    {
        let sim = h.simulated().clone();
        let e = h.e.clone();
        let (p, (q, q_data), freer) = free_during_held_restore(&h);
        // Other memory comes and goes meanwhile.
        let e2 = e.clone();
        bounded("an alloc and free of other memory", PATIENCE, move || {
            let o = e2.alloc(&req(1 << 20, "other", None)).unwrap();
            assert!(e2.free(o).unwrap());
        });
        sim.unhold(Prim::EventSync, None);
        let freed = bounded("the free", PATIENCE, move || freer.join().unwrap());
        assert!(freed.unwrap(), "freed once the restore let it go");
        assert!(!e.owns(p));
        let e2 = e.clone();
        bounded("the waits", PATIENCE, move || {
            assert!(e2.wait_restored(Some(p), None).unwrap());
            assert!(e2.wait_restored(None, None).unwrap());
        });
        assert_eq!(state(&e, q), Some(State::Active));
        assert!(h.read(q, q_data.len()) == q_data, "the other allocation's contents");
        assert!(e.free(q).unwrap());
        assert_eq!(sim.live_mappings(), 0);
        assert_eq!(sim.live_handles(), 0);
    }
}

engine_test! {
    /// As above, the restore failing after its caller returned while the free waits: the free
    /// then gives back what the failed restore left mapped; a wait for the freed allocation
    /// raises nothing, one for the other raises the failure, and a resume restores that one.
    sim_only fn a_free_waiting_on_a_restore_that_fails_after_return(h)
        [Setup::default().small_pieces(3)]
    {
        let sim = h.simulated().clone();
        let e = h.e.clone();
        let (p, (q, q_data), freer) = free_during_held_restore(&h);
        sim.arm_fault(Prim::EventSync, 1, 999);
        sim.unhold(Prim::EventSync, None);
        let freed = bounded("the free", PATIENCE, move || freer.join().unwrap());
        assert!(freed.unwrap());
        assert!(!e.owns(p));
        let e2 = e.clone();
        let (at_p, at_q) = bounded("the waits", PATIENCE, move || {
            (e2.wait_restored(Some(p), None), e2.wait_restored(Some(q), None))
        });
        assert!(at_p.unwrap(), "a freed allocation has nothing to wait for");
        let err = at_q.unwrap_err().to_string();
        assert!(err.contains("failed after it returned"), "{err}");
        e.resume(Some("kv")).unwrap();
        assert_eq!(state(&e, q), Some(State::Active));
        assert!(h.read(q, q_data.len()) == q_data, "nothing backed up is lost");
        assert!(e.wait_restored(None, None).unwrap());
        assert!(e.free(q).unwrap());
        assert_eq!(sim.live_mappings(), 0);
        assert_eq!(sim.live_handles(), 0);
    }
}

engine_test! {
    /// An allocation made in tag `kv` while a pause of `kv` runs (held at its device
    /// synchronization) is not the pause's: it stays active, the report and the statistics
    /// say so, and the next pause pauses it.
    sim_only fn an_allocation_made_during_a_pause_of_its_tag_stays_active(h)
        [Setup::default().small_pieces(2)]
    {
        let sim = h.simulated().clone();
        let (e, g) = (h.e.clone(), h.g());
        let old = e.alloc(&req(2 * g, "kv", Some(BackupKind::Pinned))).unwrap();
        sim.hold(Prim::Synchronize, None);
        let pauser = {
            let e = e.clone();
            thread::spawn(move || e.pause(Some("kv")))
        };
        wait_until("the pause reaches the device", PATIENCE, || sim.held_calls() == 1);
        let e2 = e.clone();
        let new = bounded("an alloc in the tag being paused", PATIENCE, move || {
            e2.alloc(&req(2 * g, "kv", Some(BackupKind::Pinned))).unwrap()
        });
        assert_eq!(state(&e, new), Some(State::Active));
        sim.unhold(Prim::Synchronize, None);
        let r = bounded("the pause", PATIENCE, move || pauser.join().unwrap()).unwrap();
        assert_eq!(r.allocations, 1, "the pause is of what it marked");
        assert_eq!(state(&e, old), Some(State::Paused));
        assert_eq!(state(&e, new), Some(State::Active));
        h.assert_accessible(new, 2 * g, true, "the new allocation");
        let s = e.stats();
        let kv = s.tags.iter().find(|t| t.tag == "kv").unwrap();
        assert_eq!(
            (kv.allocations, kv.active_allocations, kv.paused_allocations),
            (2, 1, 1)
        );
        assert_eq!((kv.bytes_active, kv.bytes_paused), (2 * g, 2 * g));
        assert_eq!(e.pause(Some("kv")).unwrap().allocations, 1, "the next pause takes it");
        assert_eq!(e.resume(Some("kv")).unwrap().allocations, 2);
        assert!(e.free(old).unwrap());
        assert!(e.free(new).unwrap());
    }
}

engine_test! {
    /// A free of an allocation a running pause has already retired (no backup: retired before
    /// the copies) goes on while the pause still copies another one; the pause ends well and the
    /// other allocation's backup is whole.
    sim_only fn a_free_of_what_a_running_pause_retired_goes_on(h)
        [Setup::default().small_pieces(3)]
    {
        let sim = h.simulated().clone();
        let (e, g) = (h.e.clone(), h.g());
        let a = e.alloc(&req(2 * g, "kv", None)).unwrap();
        let b = e.alloc(&req(3 * g, "kv", Some(BackupKind::Pinned))).unwrap();
        let b_data = pattern((3 * g) as usize, 9);
        h.write(b, &b_data);
        sim.hold(Prim::CopyD2H, None);
        let pauser = {
            let e = e.clone();
            thread::spawn(move || e.pause(Some("kv")))
        };
        wait_until("the pause retires the one without a backup", PATIENCE, || {
            state(&e, a) == Some(State::Paused)
        });
        assert_eq!(state(&e, b), Some(State::Pausing));
        let e2 = e.clone();
        assert!(bounded("the free of the retired one", PATIENCE, move || e2.free(a)).unwrap());
        sim.unhold(Prim::CopyD2H, None);
        let r = bounded("the pause", PATIENCE, move || pauser.join().unwrap()).unwrap();
        assert_eq!(r.allocations, 2);
        assert_eq!(state(&e, b), Some(State::Paused));
        e.resume(Some("kv")).unwrap();
        assert!(h.read(b, b_data.len()) == b_data);
        assert!(e.free(b).unwrap());
        assert_eq!(sim.live_mappings(), 0);
        assert_eq!(sim.live_handles(), 0);
    }
}
