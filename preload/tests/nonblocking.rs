//! The non-blocking resume (engine Note [Non-blocking resume]): the call returns once the memory
//! is mapped, streams wait for the restore through the gate, waits block until data landed,
//! and a failure after the return loses nothing and belongs to the allocations it left
//! unrestored.

mod common;

use std::time::Duration;

use common::harness::Harness;
use common::nonblocking::{check_contents, paused, resume_failing_after_return};
use common::{engine_test, pattern, req, wait_until, Setup};
use tms::backup::BackupKind;
use tms::driver::sim::Prim;
use tms::driver::{DevPtr, Stream};
use tms::engine::{Engine, State, StreamOf};

/// The caller's stream: any handle on the sim, the legacy default stream through a driver
/// library (CUDA, or HIP over its double), which checks its handles.
fn user_stream(h: &Harness) -> StreamOf {
    StreamOf {
        device: h.device(0),
        stream: Stream(if h.sim().is_some() { 0x5151 } else { 0 }),
    }
}

fn state(e: &Engine, p: DevPtr) -> State {
    e.allocations()
        .into_iter()
        .find(|a| a.addr == p)
        .expect("allocation")
        .state
}

/// One allocation of `2 * g` bytes with a pinned backup on each of devices 0 and 1, tag `tag`,
/// each with its own contents, paused.
fn paused_one_per_device(h: &Harness, tag: &str) -> Vec<(DevPtr, Vec<u8>)> {
    let g = h.g();
    let made: Vec<(DevPtr, Vec<u8>)> = [0, 1]
        .into_iter()
        .map(|device| {
            let mut r = req(2 * g, tag, Some(BackupKind::Pinned));
            r.device = device;
            let p = h.e.alloc(&r).unwrap();
            let data = pattern((2 * g) as usize, device as u64 + 3);
            h.write(p, &data);
            (p, data)
        })
        .collect();
    h.e.pause(Some(tag)).unwrap();
    made
}

/// A non-blocking resume of `tag` on a thread of its own, device 1 held before it maps
/// (`Create`), seen as far as `first` (on device 0) landed: the call has not returned, nothing
/// is settled. Unhold device 1's `Create` and join the thread to end it.
fn landing_on_device_0(
    h: &Harness,
    tag: &'static str,
    first: DevPtr,
) -> std::thread::JoinHandle<tms::Result<tms::engine::OpReport>> {
    h.simulated().hold(Prim::Create, Some(1));
    let e = h.e.clone();
    let resumer = std::thread::spawn(move || Engine::resume_nonblocking(e, Some(tag), &[], None));
    wait_until("device 0's share landed", Duration::from_secs(30), || {
        state(&h.e, first) == State::Active
    });
    resumer
}

engine_test! {
    fn a_nonblocking_resume_restores_everything_once_waited_for(h) [Setup::default().small_pieces(4)] {
        let g = h.g();
        let allocs = paused(&h, "kv", 4, 3 * g + 4096);
        let r = Engine::resume_nonblocking(h.e.clone(), Some("kv"), &[], Some(user_stream(&h)))
            .unwrap();
        assert_eq!((r.allocations, r.bytes), (4, 4 * (3 * g + 4096)));
        assert!(r.pending <= r.bytes);
        // Mapped at return: nothing the caller queues can fault.
        for (p, _) in &allocs {
            h.assert_accessible(*p, 1, true, "mapped when the call returns");
        }
        assert!(h.e.wait_restored(None, Some(Duration::from_secs(30))).unwrap());
        check_contents(&h, &allocs);
        assert!(!h.e.restoring());
        for (p, _) in &allocs {
            assert_eq!(state(&h.e, *p), State::Active);
        }
        if let Some(sim) = h.sim() {
            assert!(sim.gated_streams().is_empty(), "the gate reached every wait");
            assert_eq!(sim.gate_value(), 4, "one step per allocation");
        }
        // The next pause and resume see an ordinary engine.
        h.e.pause(Some("kv")).unwrap();
        h.e.resume(Some("kv")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    sim_only fn the_call_returns_before_the_data_lands_and_the_stream_waits(h) [Setup::default().small_pieces(4)] {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "w", 3, 2 * g);
        // No copy completes while the workers' waits are held.
        sim.hold(Prim::EventSync, None);
        let us = user_stream(&h);
        let r = Engine::resume_nonblocking(h.e.clone(), Some("w"), &[], Some(us)).unwrap();
        assert_eq!(r.pending, 3 * 2 * g, "nothing landed yet");
        assert!(h.e.restoring());
        assert_eq!(sim.gated_streams(), vec![(0, us.stream, 3)], "the caller's stream waits for all");
        assert!(!h.e.wait_restored(Some(allocs[0].0), Some(Duration::from_millis(50))).unwrap());
        // One allocation: a stream of its own waits for that one only (with no order given,
        // allocations are restored by address).
        let other = StreamOf { device: 0, stream: Stream(0x6262) };
        h.e.stream_wait_restored(Some(allocs[1].0 + 100), other).unwrap();
        let rank = allocs.iter().filter(|a| a.0 <= allocs[1].0).count() as u32;
        assert!(sim.gated_streams().contains(&(0, other.stream, rank)));
        // A pause of the same tag waits for the restore, and then pauses it.
        let e2 = h.e.clone();
        let pauser = std::thread::spawn(move || e2.pause(Some("w")).map(|r| r.allocations));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!pauser.is_finished(), "a pause waits for the running resume");
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(None, None).unwrap());
        assert!(sim.gated_streams().is_empty());
        assert_eq!(pauser.join().unwrap().unwrap(), 3);
        h.e.resume(Some("w")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    sim_only fn the_order_given_is_the_order_restored(h) [Setup::default().small_pieces(2)] {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "o", 4, g);
        sim.hold(Prim::EventSync, None);
        // Addresses inside allocations name them; those not named come after, by address.
        let order = [allocs[3].0 + 17, allocs[1].0];
        let (lo, hi) = if allocs[0].0 < allocs[2].0 { (0, 2) } else { (2, 0) };
        let us = user_stream(&h);
        Engine::resume_nonblocking(h.e.clone(), Some("o"), &order, None).unwrap();
        assert!(sim.gated_streams().is_empty(), "no stream given, none waits");
        let want = [(3, 1), (1, 2), (lo, 3), (hi, 4)];
        for (k, (i, v)) in want.into_iter().enumerate() {
            let s = StreamOf { device: 0, stream: Stream(0x100 + k as u64) };
            h.e.stream_wait_restored(Some(allocs[i].0), s).unwrap();
            assert!(sim.gated_streams().contains(&(0, s.stream, v)), "allocation {i} is number {v}: {:?}", sim.gated_streams());
        }
        h.e.stream_wait_restored(None, us).unwrap();
        assert!(sim.gated_streams().contains(&(0, us.stream, 4)));
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(Some(allocs[2].0), None).unwrap());
        assert!(h.read(allocs[2].0, allocs[2].1.len()) == allocs[2].1);
        assert!(h.e.wait_restored(None, None).unwrap());
        check_contents(&h, &allocs);
        // Nothing in flight: nothing to wait for, nothing queued.
        h.e.stream_wait_restored(None, StreamOf { device: 0, stream: Stream(0x999) }).unwrap();
        assert!(sim.gated_streams().is_empty());
    }
}

engine_test! {
    sim_only fn a_failure_after_the_return_loses_nothing_and_is_reported_once(h) [Setup::default().small_pieces(4)] {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "f", 3, 2 * g);
        sim.hold(Prim::EventSync, None);
        let us = user_stream(&h);
        Engine::resume_nonblocking(h.e.clone(), Some("f"), &[], Some(us)).unwrap();
        sim.arm_fault(Prim::EventSync, 1, 999);
        sim.unhold(Prim::EventSync, None);
        let err = h.e.wait_restored(None, None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("failed after it returned"), "{msg}");
        assert!(msg.contains("cuEventSynchronize"), "{msg}");
        assert!(sim.gated_streams().is_empty(), "the gate opened: no stream waits forever");
        let mut left = 0;
        for (p, data) in &allocs {
            // Still mapped either way: work the caller queued behind the gate finds memory.
            h.assert_accessible(*p, 1, true, "mapped after the failure");
            match state(&h.e, *p) {
                // Not restored: stays paused with its backup.
                State::Paused => left += 1,
                // Landed before the failure stopped the restore (other workers' copies).
                State::Active => assert!(h.read(*p, data.len()) == *data, "landed {p:#x}"),
                s => panic!("{p:#x}: {s:?}"),
            }
        }
        assert!(left >= 1, "the failed allocation stays paused");
        // Reported by the wait: the resume restores them without raising it again.
        h.e.resume(Some("f")).unwrap();
        check_contents(&h, &allocs);
        h.assert_live_bytes(0, 3 * 2 * g, "the kept mappings were unmapped and replaced");
        h.e.pause(Some("f")).unwrap();
        h.assert_live_bytes(0, 0, "paused");
    }
}

/// A tag's numbers.
fn tag_stats(e: &Engine, tag: &str) -> tms::engine::TagStats {
    e.stats()
        .tags
        .into_iter()
        .find(|t| t.tag == tag)
        .expect("the tag")
}

engine_test! {
    /// Issue 36, item 1: a failure after the return belongs to its resume and the allocations
    /// it left unrestored. Other tags' operations run; a wait for them raises it every time
    /// until they are paused (which gives their memory back) or resumed; stats and wait never
    /// say "landed" or "paused" for memory that is neither. One copy worker, so the failing
    /// sync comes before either allocation lands (with several, one could land first, and stay
    /// restored: `what_landed_before_a_failure_after_the_return_stays_restored`).
    sim_only fn a_failure_after_the_return_belongs_to_its_allocations_until_they_are_paused(h)
        [Setup::default().small_pieces(1)]
    {
        let g = h.g();
        let allocs = paused(&h, "n", 2, 2 * g);
        let other = paused(&h, "other", 1, g);
        resume_failing_after_return(&h, "n", 999);
        // Unrelated: runs (it waits for the failed resume to end, as transactions do).
        h.e.resume(Some("other")).unwrap();
        check_contents(&h, &other);
        assert!(h.e.wait_restored(Some(other[0].0), None).unwrap());
        for round in 0..3 {
            let err = h.e.wait_restored(None, None).unwrap_err().to_string();
            assert!(err.contains("failed after it returned"), "round {round}: {err}");
            let err = h.e.wait_restored(Some(allocs[1].0 + 5), None).unwrap_err();
            assert!(err.to_string().contains("tag \"n\""), "{err}");
        }
        let t = tag_stats(&h.e, "n");
        assert_eq!(
            (t.bytes_unrestored, t.bytes_paused, t.bytes_active, t.paused_allocations),
            (4 * g, 0, 0, 2),
            "held memory is not shown paused"
        );
        assert!(t.failed_restore.as_deref().is_some_and(|m| m.contains("failed after it returned")));
        assert!(tag_stats(&h.e, "other").failed_restore.is_none());
        h.assert_live_bytes(0, 5 * g, "n's memory is still held");
        // Reported by the waits: the pause acts, and gives the memory back.
        let r = h.e.pause(Some("n")).unwrap();
        assert_eq!((r.allocations, r.bytes), (2, 4 * g));
        h.assert_live_bytes(0, g, "given back");
        let t = tag_stats(&h.e, "n");
        assert_eq!((t.bytes_unrestored, t.bytes_paused, t.failed_restore), (0, 4 * g, None));
        assert!(h.e.wait_restored(None, None).unwrap(), "acknowledged by the pause");
        h.e.resume(Some("n")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    /// Issue 36, item 1: nobody waited, so the pause that acts on the unrestored allocations
    /// raises the failure after it gave their memory back; a second pause has nothing to do.
    sim_only fn an_unreported_failure_is_raised_by_the_pause_that_gives_the_memory_back(h)
        [Setup::default().small_pieces(3)]
    {
        let g = h.g();
        let allocs = paused(&h, "n", 2, 2 * g);
        resume_failing_after_return(&h, "n", 999);
        let err = h.e.pause(Some("n")).unwrap_err().to_string();
        assert!(
            err.contains("reported by this pause") && err.contains("failed after it returned"),
            "{err}"
        );
        h.assert_live_bytes(0, 0, "the pause gave the memory back before raising");
        for (p, _) in &allocs {
            assert_eq!(state(&h.e, *p), State::Paused);
        }
        let r = h.e.pause(Some("n")).unwrap();
        assert_eq!(r.allocations, 0, "nothing left to do");
        assert!(h.e.wait_restored(None, None).unwrap());
        h.e.resume(Some("n")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    /// Issue 36, item 1: while a non-blocking resume restores, its memory is shown restoring
    /// (held, neither active nor paused); once a wait for an allocation returned, that
    /// allocation is shown active at once, before the resume settles it.
    sim_only fn states_are_true_while_a_nonblocking_resume_restores(h) [Setup::default().small_pieces(3)] {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "s", 3, 2 * g);
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("s"), &[], None).unwrap();
        let t = tag_stats(&h.e, "s");
        assert_eq!(
            (t.restoring_allocations, t.bytes_restoring, t.bytes_paused, t.bytes_active),
            (3, 6 * g, 0, 0)
        );
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(Some(allocs[0].0), None).unwrap());
        assert_eq!(state(&h.e, allocs[0].0), State::Active, "landed is shown at once");
        assert!(h.e.wait_restored(None, None).unwrap());
        for (p, _) in &allocs {
            assert_eq!(state(&h.e, *p), State::Active);
        }
        let t = tag_stats(&h.e, "s");
        assert_eq!((t.active_allocations, t.bytes_active, t.bytes_restoring), (3, 6 * g, 0));
        check_contents(&h, &allocs);
    }
}

engine_test! {
    sim_only fn a_failure_before_the_return_is_the_calls_error(h) [Setup::default().small_pieces(2)] {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "m", 3, g);
        sim.arm_fault(Prim::Map, 3, 2);
        let err = Engine::resume_nonblocking(h.e.clone(), Some("m"), &[], Some(user_stream(&h)))
            .unwrap_err();
        assert!(err.is_oom(), "{err}");
        assert!(sim.gated_streams().is_empty());
        for (p, _) in &allocs {
            assert_eq!(state(&h.e, *p), State::Paused);
            h.assert_accessible(*p, 1, false, "undone");
        }
        assert!(h.e.wait_restored(None, None).unwrap(), "nothing deferred: the call reported it");
        Engine::resume_nonblocking(h.e.clone(), Some("m"), &[], Some(user_stream(&h))).unwrap();
        assert!(h.e.wait_restored(None, None).unwrap());
        check_contents(&h, &allocs);
    }
}

engine_test! {
    sim_only fn without_a_gate_or_a_stream_wait_the_call_blocks_instead(h) [Setup::default().small_pieces(2)] {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "b", 2, g);
        sim.arm_fault(Prim::Gate, 1, 801);
        let r = Engine::resume_nonblocking(h.e.clone(), Some("b"), &[], Some(user_stream(&h)))
            .unwrap();
        assert_eq!(r.pending, 0, "a blocking resume");
        assert!(!h.e.restoring());
        check_contents(&h, &allocs);
        h.e.pause(Some("b")).unwrap();
        sim.arm_fault(Prim::StreamWait, 1, 801);
        let r = Engine::resume_nonblocking(h.e.clone(), Some("b"), &[], Some(user_stream(&h)))
            .unwrap();
        assert_eq!(r.pending, 0, "the host waited for what the stream could not");
        assert!(!h.e.restoring());
        check_contents(&h, &allocs);
    }
}

engine_test! {
    fn bad_arguments_are_refused_and_nothing_paused_is_fine(h) {
        let err = Engine::resume_nonblocking(h.e.clone(), Some(""), &[], None).unwrap_err();
        assert!(err.to_string().contains("tag"), "{err}");
        let r = Engine::resume_nonblocking(h.e.clone(), Some("none"), &[], Some(user_stream(&h)))
            .unwrap();
        assert_eq!((r.allocations, r.pending), (0, 0));
        assert!(h.e.wait_restored(Some(0x1234), Some(Duration::ZERO)).unwrap());
        // A stream of a device that does not exist: refused, the tag left paused (it used to
        // be taken for a driver whose streams cannot wait, and the resume blocked instead).
        let allocs = paused(&h, "kv", 1, h.g());
        let bad = StreamOf { device: 99, stream: Stream(0) };
        let err = Engine::resume_nonblocking(h.e.clone(), Some("kv"), &[], Some(bad)).unwrap_err();
        assert!(err.to_string().contains("device 99 does not exist"), "{err}");
        assert_eq!(h.e.allocations()[0].state, State::Paused);
        h.e.resume(Some("kv")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    fn threads_resuming_and_waiting_on_their_own_tags(h) [Setup::default().small_pieces(4).capacity(512 << 20)] {
        if let Some(sim) = h.sim() {
            // A slow link: restores overlap the other threads' pauses and waits.
            sim.set_bandwidth(Some(2 << 30));
        }
        let g = h.g();
        let tags = ["t0", "t1", "t2"];
        let sets: Vec<Vec<(DevPtr, Vec<u8>)>> = tags.iter().map(|t| paused(&h, t, 2, 2 * g + 8192)).collect();
        std::thread::scope(|s| {
            for (t, set) in tags.iter().zip(&sets) {
                let h = &h;
                s.spawn(move || {
                    for round in 0..4 {
                        let order = [set[1].0];
                        Engine::resume_nonblocking(h.e.clone(), Some(t), &order, Some(user_stream(h)))
                            .unwrap();
                        assert!(h.e.wait_restored(Some(set[1].0), None).unwrap(), "{t} round {round}");
                        assert!(h.read(set[1].0, set[1].1.len()) == set[1].1, "{t} round {round}");
                        assert!(h.e.wait_restored(Some(set[0].0), None).unwrap());
                        check_contents(h, set);
                        h.e.pause(Some(t)).unwrap();
                    }
                });
            }
        });
        h.e.resume(None).unwrap();
        for set in &sets {
            check_contents(&h, set);
        }
        if let Some(sim) = h.sim() {
            assert!(sim.gated_streams().is_empty());
        }
    }
}

/// One fault sweep case: three allocations with backups paused, a fault armed, a non-blocking
/// resume and a wait; then, faults cleared: no stream waits, a resume succeeds and every byte is
/// back. Whether the fault fired.
fn fault_case(h: &Harness, prim: Prim, nth: u64, code: i32) -> bool {
    let sim = h.simulated();
    let g = h.g();
    let backups = [BackupKind::Pinned, BackupKind::Mmap, BackupKind::Pinned];
    let allocs: Vec<(DevPtr, Vec<u8>)> = backups
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let size = (i as u64 + 1) * g + 4097;
            let p = h.e.alloc(&req(size, "s", Some(*b))).unwrap();
            let data = pattern(size as usize, i as u64 + 9);
            h.write(p, &data);
            (p, data)
        })
        .collect();
    h.e.pause(Some("s")).unwrap();
    sim.arm_fault(prim, nth, code);
    let what = format!("{prim}:{nth}:{code}");
    let returned =
        Engine::resume_nonblocking(h.e.clone(), Some("s"), &[allocs[2].0], Some(user_stream(h)));
    let waited = h.e.wait_restored(None, Some(Duration::from_secs(20)));
    let fired = sim.pending_faults() == 0;
    sim.clear_faults();
    assert!(
        !matches!(waited, Ok(false)),
        "{what}: the wait ran out (a hang)"
    );
    if let Err(e) = returned.as_ref().and(waited.as_ref()) {
        assert!(fired, "{what}: failed with no fault: {e}");
    }
    assert!(
        sim.gated_streams().is_empty(),
        "{what}: a stream still waits"
    );
    // Reported already (by the call or the wait): the next resume goes ahead.
    h.e.resume(Some("s"))
        .unwrap_or_else(|e| panic!("{what}: resume after the fault: {e}"));
    for (p, data) in &allocs {
        assert_eq!(state(&h.e, *p), State::Active, "{what}");
        assert!(
            h.read(*p, data.len()) == *data,
            "{what}: contents of {p:#x}"
        );
    }
    for (p, _) in &allocs {
        h.e.free(*p).unwrap();
    }
    fired
}

engine_test! {
    sim_only fn a_fault_at_any_call_of_a_nonblocking_resume_loses_nothing_and_never_hangs(h) [Setup::default().small_pieces(3)] {
        let mut fired = std::collections::BTreeSet::new();
        for prim in Prim::ALL {
            for code in [999, 2] {
                let mut nth = 1;
                while fault_case(&h.again(), prim, nth, code) {
                    fired.insert(prim.name());
                    nth += 1;
                    assert!(nth < 200, "{prim} keeps firing");
                }
            }
        }
        for p in [Prim::Gate, Prim::StreamWait, Prim::Create, Prim::Map, Prim::SetAccess, Prim::CopyH2D, Prim::EventSync, Prim::EventRecord] {
            assert!(fired.contains(p.name()), "{p} never fired: {fired:?}");
        }
    }
}

engine_test! {
    sim_only fn no_stream_waits_for_the_gate_while_host_memory_is_unlocked(h) [Setup::default().small_pieces(4)] {
        // The shape of a hang seen on an H200: one resume gives its backups back (unlocking
        // host memory waits for the whole device, holding up other threads' copies) while a
        // second one returns to its caller, whose stream then waits for copies that cannot run.
        let sim = h.simulated();
        let g = h.g();
        let a = paused(&h, "a", 2, 2 * g);
        let b = paused(&h, "b", 2, 2 * g);
        sim.hold(Prim::HostUnregister, None);
        let e = h.e.clone();
        let giving_back = std::thread::spawn(move || e.resume(Some("a")).map(|r| r.allocations));
        wait_until("an unlock begins", Duration::from_secs(10), || sim.held_calls() > 0);
        let (e, us) = (h.e.clone(), user_stream(&h));
        let returning = std::thread::spawn(move || {
            Engine::resume_nonblocking(e, Some("b"), &[], Some(us)).map(|r| r.allocations)
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(sim.gated_streams().is_empty(), "a stream was made to wait during the unlock");
        assert!(!returning.is_finished(), "the stream wait is queued after the unlock");
        sim.unhold(Prim::HostUnregister, None);
        assert_eq!(giving_back.join().unwrap().unwrap(), 2);
        assert_eq!(returning.join().unwrap().unwrap(), 2);
        assert!(h.e.wait_restored(None, Some(Duration::from_secs(30))).unwrap());
        check_contents(&h, &a);
        check_contents(&h, &b);
        assert!(sim.gated_streams().is_empty());
    }
}

/// Two paused allocations of tag "n"; a non-blocking resume restores the second first, which
/// lands, and fails after its return at the first's first copy.
fn second_lands_then_the_first_fails(h: &Harness) -> Vec<(DevPtr, Vec<u8>)> {
    let sim = h.simulated();
    let g = h.g();
    let allocs = paused(h, "n", 2, 2 * g);
    // How many copies to the device one allocation's restore takes.
    let probe = paused(h, "probe", 1, 2 * g);
    let before = sim.calls(Prim::CopyH2D);
    h.e.resume(Some("probe")).unwrap();
    let per_alloc = sim.calls(Prim::CopyH2D) - before;
    check_contents(h, &probe);
    sim.arm_fault(Prim::CopyH2D, per_alloc + 1, 999);
    Engine::resume_nonblocking(h.e.clone(), Some("n"), &[allocs[1].0], None).unwrap();
    assert!(
        h.e.wait_restored(Some(allocs[1].0), None).unwrap(),
        "the second landed"
    );
    allocs
}

engine_test! {
    /// An allocation a failed non-blocking resume restored before it failed landed: its wait
    /// said so and the program may write it. It is committed restored; the failure belongs to
    /// the others. A pause then saves what the program wrote (before, every allocation of the
    /// resume was left unrestored, so the pause gave that memory back unsaved and the next
    /// resume brought back the old backup over the program's writes).
    sim_only fn what_landed_before_a_failure_after_the_return_stays_restored(h) [Setup::default().small_pieces(1)] {
        let g = h.g();
        let mut allocs = second_lands_then_the_first_fails(&h);
        let (first, second) = (allocs[0].0, allocs[1].0);
        let written = pattern(64, 77);
        h.write(second + 100, &written);
        allocs[1].1[100..164].copy_from_slice(&written);
        let err = h.e.wait_restored(Some(first), None).unwrap_err().to_string();
        assert!(err.contains("failed after it returned"), "{err}");
        assert!(h.e.wait_restored(Some(second), None).unwrap(), "the failure is not the second's");
        assert_eq!(state(&h.e, second), State::Active);
        assert_eq!(state(&h.e, first), State::Paused);
        let t = tag_stats(&h.e, "n");
        assert_eq!((t.active_allocations, t.paused_allocations), (1, 1));
        assert_eq!(t.bytes_unrestored, 2 * g);
        h.e.pause(Some("n")).unwrap();
        h.e.resume(Some("n")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    /// After a non-blocking resume failed after its return, a blocking resume of the tag fails
    /// too, having unmapped what the first left mapped: everything is as a pause leaves it, and
    /// the first failure was reported (by a wait here; else that resume's error says it).
    /// Waits no longer raise it, and stats no longer show it (before, nothing cleared it but a
    /// successful resume).
    sim_only fn a_failed_resume_that_unmapped_what_a_failure_left_settles_it(h) [Setup::default().small_pieces(1)] {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "n", 1, 2 * g);
        resume_failing_after_return(&h, "n", 999);
        assert!(h.e.wait_restored(None, None).is_err());
        assert!(tag_stats(&h.e, "n").failed_restore.is_some());
        // The blocking resume unmaps what was left mapped, then fails (its first copy).
        sim.arm_fault(Prim::CopyH2D, 1, 999);
        let err = h.e.resume(Some("n")).unwrap_err().to_string();
        assert!(err.contains("injected fault"), "{err}");
        let t = tag_stats(&h.e, "n");
        assert_eq!((t.paused_allocations, t.bytes_unrestored), (1, 0));
        assert!(t.failed_restore.is_none(), "{:?}", t.failed_restore);
        assert!(h.e.wait_restored(None, None).unwrap());
        assert!(h.e.wait_restored(Some(allocs[0].0), None).unwrap());
        h.e.resume(Some("n")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    /// A non-blocking resume without retention gives the backups back when it ends: once an
    /// allocation landed (shown active), its backup is no longer offered, even while another
    /// device's share is still being restored and nothing is settled yet.
    sim_only fn a_landed_allocation_offers_no_backup_without_retention(h) [Setup::default().devices(2).small_pieces(1)] {
        let sim = h.simulated();
        let made = paused_one_per_device(&h, "d");
        let mut buf = vec![0u8; 64];
        assert!(h.e.copy_cpu_backup(made[0].0, &mut buf).unwrap(), "paused: offered");
        // Device 1 cannot map yet: the call has not returned, device 0's share lands. (A wait
        // before the resume began would promise nothing: the state says when it landed.)
        let resumer = landing_on_device_0(&h, "d", made[0].0);
        assert!(h.e.wait_restored(Some(made[0].0), None).unwrap());
        assert!(!h.e.copy_cpu_backup(made[0].0, &mut buf).unwrap(), "landed: not offered");
        assert!(h.e.acquire_cpu_backup(made[0].0, 64).unwrap().is_none());
        sim.unhold(Prim::Create, Some(1));
        resumer.join().unwrap().unwrap();
        assert!(h.e.wait_restored(None, None).unwrap());
        check_contents(&h, &made);
    }
}

engine_test! {
    /// An allocation a non-blocking resume restored is shown active at once by `allocations()`
    /// with its bytes mapped, as `stats()` shows it, before the resume settles it (it waits
    /// here for another device's share). Before, `active_bytes` (and so a tool's sum of mapped
    /// bytes) was 0 for it until the settling. Found by `concurrent_model`.
    sim_only fn a_landed_allocation_shows_its_bytes_active(h) [Setup::default().devices(2).small_pieces(1)] {
        let sim = h.simulated();
        let g = h.g();
        let made = paused_one_per_device(&h, "d");
        let resumer = landing_on_device_0(&h, "d", made[0].0);
        let info = h.e.allocations().into_iter().find(|a| a.addr == made[0].0).unwrap();
        assert_eq!((info.state, info.active_bytes), (State::Active, 2 * g));
        assert_eq!(tag_stats(&h.e, "d").bytes_active, 2 * g);
        sim.unhold(Prim::Create, Some(1));
        resumer.join().unwrap().unwrap();
        assert!(h.e.wait_restored(None, None).unwrap());
    }
}

engine_test! {
    /// A later non-blocking resume restores an allocation an earlier one left unrestored: the
    /// earlier failure is over for it the moment it lands, before its wait returns and before
    /// that resume settles (it waits here for another device's share). Before, the failure
    /// stayed kept until the settling, so a wait told "landed" could raise it; and the
    /// allocation's chunks are shown active as its stats are.
    sim_only fn a_wait_for_what_a_later_resume_restored_does_not_raise_an_earlier_failure(h) [Setup::default().devices(2).small_pieces(1)] {
        let sim = h.simulated();
        let g = h.g();
        let mut made = Vec::new();
        for device in [0, 1] {
            let mut r = chunked_req(4 * g, g, "t");
            r.device = device;
            let p = h.e.alloc(&r).unwrap();
            let data = pattern((4 * g) as usize, device as u64 + 11);
            h.write(p, &data);
            made.push((p, data));
        }
        h.e.pause(Some("t")).unwrap();
        // Each device's first wait for its copies fails, after the call returned.
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("t"), &[], None).unwrap();
        sim.arm_fault(Prim::EventSync, 1, 999);
        sim.arm_fault(Prim::EventSync, 2, 999);
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(Some(made[0].0), None).is_err());
        assert!(tag_stats(&h.e, "t").failed_restore.is_some());
        // Again, device 1 unable to map yet: device 0's allocation lands, nothing settles.
        let resumer = landing_on_device_0(&h, "t", made[0].0);
        assert!(h.e.wait_restored(Some(made[0].0), None).unwrap(), "landed: nothing to raise");
        assert_eq!(h.e.chunk_info(made[0].0).unwrap().active, vec![true; 4]);
        assert!(h.read(made[0].0, made[0].1.len()) == made[0].1);
        sim.unhold(Prim::Create, Some(1));
        resumer.join().unwrap().unwrap();
        assert!(h.e.wait_restored(None, None).unwrap());
        assert!(tag_stats(&h.e, "t").failed_restore.is_none());
        check_contents(&h, &made);
    }
}

/// A chunked request of `size` bytes in chunks of `chunk`, with a pinned backup.
fn chunked_req(size: u64, chunk: u64, tag: &str) -> tms::engine::AllocRequest {
    tms::engine::AllocRequest {
        chunk,
        ..req(size, tag, Some(BackupKind::Pinned))
    }
}

fn fail_after_return(h: &Harness, tag: &str, us: Option<StreamOf>) {
    let sim = h.simulated();
    h.e.pause(Some(tag)).unwrap();
    sim.hold(Prim::EventSync, None);
    Engine::resume_nonblocking(h.e.clone(), Some(tag), &[], us).unwrap();
    sim.arm_fault(Prim::EventSync, 1, 999);
    sim.unhold(Prim::EventSync, None);
    let err = h.e.wait_restored(None, None).unwrap_err();
    assert!(
        err.to_string().contains("failed after it returned"),
        "{err}"
    );
}

engine_test! {
    /// A non-blocking resume fails after its caller returned: the allocation stays paused, its
    /// segments left mapped (stuck) so that work the caller queued behind the gate finds memory.
    /// The program queues work on that memory and frees it: the free synchronizes the device
    /// before it unmaps the stuck segments (as for mapped ones, and as cudaFree does), so the
    /// queued work never meets an unmapped range. An active allocation first, as the control.
    sim_only fn a_free_waits_for_queued_work_before_unmapping_what_a_failed_resume_left_mapped(h)
        [Setup::default().small_pieces(4)]
    {
        let (e, g) = (&h.e, h.g());
        let d = h.driver().clone();
        let stream = d.stream(0).unwrap();
        let src = pattern(4096, 7);

        // Control: an active allocation with work queued on it is freed after that work ran.
        let q = e.alloc(&req(2 * g, "ctl", None)).unwrap();
        // SAFETY: q is mapped and accessible; src lives until the stream is synchronized below.
        unsafe { d.copy_h2d(q, src.as_ptr(), 4096, stream).unwrap() };
        assert!(e.free(q).unwrap());
        d.stream_sync(stream).expect("control: free waited for the queued work");

        let p = e
            .alloc(&req(2 * g, "n", Some(BackupKind::Pinned)))
            .unwrap();
        h.write(p, &pattern((2 * g) as usize, 1));
        fail_after_return(&h, "n", Some(user_stream(&h)));
        h.assert_accessible(p, 1, true, "left mapped for the caller's queued work");
        // The program's work, queued after the resume returned, on that memory.
        // SAFETY: p is mapped and accessible (stuck); src lives until the stream is synchronized.
        unsafe { d.copy_h2d(p, src.as_ptr(), 4096, stream).unwrap() };
        assert!(e.free(p).unwrap());
        d.stream_sync(stream)
            .expect("free unmapped memory that queued work was still to use");
    }
}

engine_test! {
    /// As above, for the resume that follows the failure: it unmaps what the failed resume left
    /// mapped only after the device's work is done (as a pause gives it back), so the program's
    /// work queued on that memory (here: synchronized while the resume is held) finds it mapped.
    sim_only fn a_resume_waits_for_queued_work_before_unmapping_what_a_failed_resume_left_mapped(h)
        [Setup::default().small_pieces(4)]
    {
        let sim = h.simulated().clone();
        let (e, g) = (h.e.clone(), h.g());
        let d = h.driver().clone();
        let stream = d.stream(0).unwrap();
        let src = pattern(4096, 7);
        let p = e
            .alloc(&req(2 * g, "n", Some(BackupKind::Pinned)))
            .unwrap();
        h.write(p, &pattern((2 * g) as usize, 1));
        fail_after_return(&h, "n", Some(user_stream(&h)));
        // SAFETY: p is mapped and accessible (stuck); src lives until the stream is synchronized.
        unsafe { d.copy_h2d(p, src.as_ptr(), 4096, stream).unwrap() };
        sim.hold(Prim::Create, Some(0));
        let e2 = e.clone();
        let t = std::thread::spawn(move || e2.resume(Some("n")));
        wait_until("the resume maps", Duration::from_secs(20), || {
            sim.held_calls() > 0
        });
        // On a GPU the queued work runs on its own meanwhile.
        let r = d.stream_sync(stream);
        sim.unhold(Prim::Create, Some(0));
        let _ = t.join().unwrap();
        r.expect("the resume unmapped memory that queued work was still to use");
    }
}

engine_test! {
    /// A free whose last step fails (giving back the address range) is reported, the
    /// allocation gone for the caller (only the range leaks): a failure a non-blocking resume
    /// kept for it goes with it, so no later wait raises a failure of an allocation that no
    /// longer exists (nothing could clear it any more).
    sim_only fn a_free_whose_last_step_fails_clears_the_failure_kept_for_it(h)
        [Setup::default().small_pieces(4)]
    {
        let sim = h.simulated();
        let (e, g) = (&h.e, h.g());
        let p = e
            .alloc(&req(2 * g, "n", Some(BackupKind::Pinned)))
            .unwrap();
        fail_after_return(&h, "n", None);
        sim.arm_fault(Prim::FreeRange, 1, 1);
        assert!(e.free(p).is_err(), "the range could not be given back");
        assert!(!e.owns(p), "the allocation is gone for the caller");
        assert!(e.allocations().is_empty());
        // Nothing left to restore, nothing in flight: a wait for everything has nothing to say.
        let r = e.wait_restored(None, None);
        assert!(
            matches!(r, Ok(true)),
            "a wait raises a failure of an allocation that no longer exists: {r:?}"
        );
    }
}

engine_test! {
    /// A failure kept for allocation `a` (a non-blocking resume failed after it returned) lasts
    /// until `a` is paused, resumed or freed. A pause of the tag gives `a`'s memory back and then
    /// fails on another allocation: `a` is paused with nothing mapped, so its failure is over
    /// (no later pause would ever touch `a` again to clear it).
    sim_only fn a_failed_pause_clears_the_failure_kept_for_what_it_paused(h)
        [Setup::default().small_pieces(4)]
    {
        let sim = h.simulated();
        let (e, g) = (&h.e, h.g());
        let a = e
            .alloc(&req(2 * g, "n", Some(BackupKind::Pinned)))
            .unwrap();
        fail_after_return(&h, "n", None);
        let b = e
            .alloc(&req(2 * g, "n", Some(BackupKind::Pinned)))
            .unwrap();
        // b's copy fails; a's stuck memory was given back first.
        sim.arm_fault(Prim::CopyD2H, 1, 999);
        assert!(e.pause(Some("n")).is_err());
        let st = |p| e.allocations().into_iter().find(|x| x.addr == p).unwrap().state;
        assert_eq!(st(a), State::Paused);
        assert!(!h.accessible(a).unwrap(), "a's memory was given back");
        // Now a pause that succeeds.
        e.pause(Some("n")).unwrap();
        assert_eq!(st(b), State::Paused);
        let r = e.wait_restored(Some(a), None);
        assert!(
            matches!(r, Ok(true)),
            "a paused allocation (memory given back by a pause) still raises: {r:?}"
        );
    }
}

engine_test! {
    /// A failure kept for two allocations (a non-blocking resume failed after it returned, both
    /// left mapped). A pause of the tag gives the first one's memory back, then fails to give
    /// back the second's (its synchronization fails): the first is paused with nothing mapped,
    /// so its failure is over, as after a pause that fails later on. No later pause touches it
    /// again, so nothing else would clear it.
    sim_only fn a_pause_failing_to_give_back_stuck_memory_clears_the_failure_of_what_it_gave_back(h)
        [Setup::default().small_pieces(1)]
    {
        let sim = h.simulated();
        let (e, g) = (&h.e, h.g());
        let allocs = paused(&h, "n", 2, 2 * g);
        // A pause takes its allocations in address order.
        let (a, b) = (allocs[0].0.min(allocs[1].0), allocs[0].0.max(allocs[1].0));
        resume_failing_after_return(&h, "n", 999);
        assert!(e.wait_restored(None, None).is_err());
        assert_eq!(tag_stats(e, "n").bytes_unrestored, 4 * g, "both left mapped");
        // Each stuck allocation is synchronized before its memory goes: a's first, then b's.
        sim.arm_fault(Prim::Synchronize, 2, 999);
        let err = e.pause(Some("n")).unwrap_err().to_string();
        assert!(err.contains("injected fault"), "{err}");
        assert!(!h.accessible(a).unwrap(), "a's memory was given back");
        assert!(h.accessible(b).unwrap(), "b's is still held");
        assert!(e.wait_restored(Some(b), None).is_err(), "b is still unrestored");
        e.pause(Some("n")).unwrap();
        let r = e.wait_restored(Some(a), None);
        assert!(
            matches!(r, Ok(true)),
            "a paused allocation (its memory given back by a pause) still raises: {r:?}"
        );
        let r = e.wait_restored(None, None);
        assert!(matches!(r, Ok(true)), "everything is paused: {r:?}");
        assert!(tag_stats(e, "n").failed_restore.is_none());
        e.resume(Some("n")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    /// A non-blocking resume fails after its return and nobody waits, so the failure is
    /// unreported. The next resume of the tag acts on those allocations (it unmaps what was left
    /// mapped) and then fails before its own call returns: its error must carry the earlier
    /// failure, as a blocking resume's does; nothing else will raise it afterwards (the failure
    /// is settled with the stuck segments unmapped).
    sim_only fn a_nonblocking_resume_failing_before_its_return_raises_the_earlier_unreported_failure(h)
        [Setup::default().small_pieces(1)]
    {
        let sim = h.simulated();
        let g = h.g();
        let allocs = paused(&h, "n", 1, 2 * g);
        resume_failing_after_return(&h, "n", 999);
        wait_until("the failure is kept", Duration::from_secs(20), || {
            tag_stats(&h.e, "n").failed_restore.is_some()
        });
        // The second resume's first mapping runs out of memory: before its call returns.
        sim.arm_fault(Prim::Map, 1, 2);
        let err = Engine::resume_nonblocking(h.e.clone(), Some("n"), &[], None)
            .unwrap_err()
            .to_string();
        // Nothing can raise the first failure any more: it was settled with the unmapping.
        let later = h.e.wait_restored(None, None);
        assert!(
            err.contains("failed after it returned"),
            "the earlier failure was reported by nobody: call: {err}; later wait: {later:?}"
        );
        h.e.resume(Some("n")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    /// A second non-blocking resume of what a first left unrestored gives back what the
    /// first left mapped, maps again, and fails after its return too. The allocation is now
    /// unrestored by the second: a wait raises the second's failure (and so reports it), and the
    /// pause that follows acts without raising anything more, as after any reported failure.
    sim_only fn a_second_failure_after_the_return_is_the_one_its_waits_raise(h)
        [Setup::default().small_pieces(1)]
    {
        let g = h.g();
        let allocs = paused(&h, "n", 1, 2 * g);
        let p = allocs[0].0;
        let fail_after_return = |code: i32| {
            resume_failing_after_return(&h, "n", code);
            h.e.wait_restored(Some(p), None).unwrap_err().to_string()
        };
        let first = fail_after_return(999);
        assert!(first.contains("CUDA_ERROR_UNKNOWN"), "{first}");
        let second = fail_after_return(719);
        let shown = tag_stats(&h.e, "n").failed_restore.unwrap_or_default();
        let paused = h.e.pause(Some("n"));
        assert!(
            !second.contains("CUDA_ERROR_UNKNOWN") && !shown.contains("CUDA_ERROR_UNKNOWN"),
            "the wait raised (and stats show) the first resume's failure, settled by the \
             second: wait: {second}; stats: {shown}"
        );
        assert!(paused.is_ok(), "reported by the wait already, raised again: {paused:?}");
        h.e.resume(Some("n")).unwrap();
        check_contents(&h, &allocs);
    }
}

engine_test! {
    /// A panic (a bug) in the restore after the call returned: the data did not land,
    /// and the thread records the panic as the resume's failure, "raised by every wait"
    /// (`Tracker::wait_for`). But the tracker is forgotten right after it finished, and from
    /// then on a wait for the allocation says it landed.
    sim_only fn a_panic_after_the_return_is_raised_by_every_wait(h) [Setup::default().small_pieces(1)] {
        let sim = h.simulated();
        let g = h.g();
        h.e.set_checks(Some("v"), tms::engine::Checks { skip_unchanged: false, verify: true });
        let allocs = paused(&h, "v", 1, 2 * g);
        let p = allocs[0].0;
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("v"), &[], None).unwrap();
        // The check of what came back panics (on the pipeline's coordinator).
        sim.arm_fault(Prim::Digest, 1, tms::driver::sim::PANIC);
        sim.unhold(Prim::EventSync, None);
        let first = h.e.wait_restored(Some(p), None);
        assert!(!h.e.restoring());
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            let r = h.e.wait_restored(Some(p), Some(Duration::ZERO));
            assert!(
                r.is_err(),
                "a wait says the allocation landed after the restore panicked: {r:?} (first wait: {first:?})"
            );
        }
    }
}

engine_test! {
    /// A panic (a bug) in the restore after the call returned, as in the test above, with the
    /// program's work queued on the memory (behind the gate, on a GPU): the memory the resume
    /// mapped stays mapped for that work, as after a failure (the free that follows
    /// synchronizes before it unmaps it). Unmapped at once, the queued work meets an illegal
    /// address, which on a GPU takes the process down.
    sim_only fn a_panic_after_the_return_leaves_mapped_what_queued_work_may_use(h)
        [Setup::default().small_pieces(1)]
    {
        let sim = h.simulated();
        let e = &h.e;
        let d = h.driver().clone();
        let stream = d.stream(0).unwrap();
        let src = pattern(4096, 7);
        e.set_checks(Some("v"), tms::engine::Checks { skip_unchanged: false, verify: true });
        // One staged copy: nothing the restore queues comes after the program's work below
        // (the sim has one stream per device, and a wait of the restore's would run it).
        let allocs = paused(&h, "v", 1, 4096);
        let p = allocs[0].0;
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(e.clone(), Some("v"), &[], Some(user_stream(&h))).unwrap();
        wait_until("the restore waits for its copy", Duration::from_secs(20), || {
            sim.held_calls() > 0
        });
        // The program's work, queued after the resume returned, on that memory.
        // SAFETY: p is mapped and accessible (mapped before the call returned); src lives until
        // the stream is synchronized below.
        unsafe { d.copy_h2d(p, src.as_ptr(), 4096, stream).unwrap() };
        // The check of what came back panics (on the pipeline's coordinator).
        sim.arm_fault(Prim::Digest, 1, tms::driver::sim::PANIC);
        sim.unhold(Prim::EventSync, None);
        let err = e.wait_restored(Some(p), None).unwrap_err();
        assert!(err.to_string().contains("panic"), "{err}");
        assert!(!e.restoring());
        assert_eq!(sim.queued_copies(), 1, "the program's work has not run yet");
        d.stream_sync(stream)
            .expect("the panicking restore unmapped memory that queued work was still to use");
        assert!(e.free(p).unwrap());
        assert!(!h.accessible(p).unwrap(), "the free gave the memory back");
    }
}

engine_test! {
    /// A panic on one device after its share was mapped, before another device's was (the call
    /// has not returned): the panicking device's mappings are undone, so the call must not
    /// return success once the other device has mapped its share, or the program would queue
    /// work on memory no longer mapped.
    sim_only fn a_panic_before_the_return_is_the_calls_error_on_every_device(h)
        [Setup::default().devices(2).small_pieces(1)]
    {
        let sim = h.simulated();
        let g = h.g();
        h.e.set_checks(Some("v"), tms::engine::Checks { skip_unchanged: false, verify: true });
        let mut made = Vec::new();
        for device in [0, 1] {
            let mut r = req(2 * g, "v", Some(BackupKind::Pinned));
            r.device = device;
            let p = h.e.alloc(&r).unwrap();
            let data = pattern((2 * g) as usize, device as u64 + 5);
            h.write(p, &data);
            made.push((p, data));
        }
        h.e.pause(Some("v")).unwrap();
        let p = made[0].0;
        // Device 1 cannot map yet; device 0 maps its share, and the check of what came back
        // panics there.
        sim.hold(Prim::Create, Some(1));
        sim.hold(Prim::EventSync, None);
        sim.arm_fault(Prim::Digest, 1, tms::driver::sim::PANIC);
        let e = h.e.clone();
        let resumer = std::thread::spawn(move || Engine::resume_nonblocking(e, Some("v"), &[], None));
        wait_until("device 0 maps its share and copies", Duration::from_secs(20), || {
            h.accessible(p) == Some(true) && sim.held_calls() == 2
        });
        sim.unhold(Prim::EventSync, None);
        wait_until("device 0's mappings are undone", Duration::from_secs(20), || {
            h.accessible(p) == Some(false)
        });
        sim.unhold(Prim::Create, Some(1));
        let r = resumer.join().unwrap();
        assert!(
            r.is_err() || h.accessible(p) == Some(true),
            "the call returned with {p:#x} unmapped: {r:?}"
        );
        let err = r.unwrap_err().to_string();
        assert!(err.contains("panic"), "{err}");
    }
}

engine_test! {
    /// A chunked allocation with some chunks active and the others left mapped by a failed
    /// non-blocking resume (stuck): the pause that gives the stuck chunks back and pauses the
    /// active ones changes the state of one allocation, and its report (and the tag's
    /// `last_pause`) says one, its bytes all four chunks.
    sim_only fn a_pause_of_stuck_and_active_chunks_counts_their_allocation_once(h)
        [Setup::default().small_pieces(1)]
    {
        let g = h.g();
        let p = h.e.alloc(&chunked_req(4 * g, g, "c")).unwrap();
        let data = pattern((4 * g) as usize, 5);
        h.write(p, &data);
        h.e.pause_pick(&tms::engine::Pick::chunks(p, &[0, 1])).unwrap();
        resume_failing_after_return(&h, "c", 999);
        assert!(h.e.wait_restored(None, None).is_err());
        let t = tag_stats(&h.e, "c");
        assert_eq!(
            (t.bytes_active, t.bytes_unrestored, t.partial_allocations),
            (2 * g, 2 * g, 1)
        );
        let r = h.e.pause(Some("c")).unwrap();
        assert_eq!((r.allocations, r.bytes), (1, 4 * g), "{r:?}");
        let last = tag_stats(&h.e, "c").last_pause.expect("a pause of the tag");
        assert_eq!((last.allocations, last.bytes), (1, 4 * g), "{last:?}");
        h.e.resume(Some("c")).unwrap();
        assert!(h.read(p, data.len()) == data, "contents after the resume");
    }
}

engine_test! {
    /// A non-blocking resume of a tag whose chunked allocation has one of its four chunks paused
    /// re-takes that chunk only: its report (`bytes`, and `pending`, the bytes still being
    /// restored at its return, which `tms_resume_nonblocking` hands the caller) counts that
    /// chunk, as a blocking resume's report and the tag's `bytes_restoring` do, not the whole
    /// allocation, three quarters of which was active all along.
    sim_only fn a_nonblocking_resume_of_one_chunk_reports_that_chunks_bytes(h)
        [Setup::default().small_pieces(1)]
    {
        let sim = h.simulated();
        let g = h.g();
        let p = h.e.alloc(&chunked_req(4 * g, g, "c")).unwrap();
        let data = pattern((4 * g) as usize, 5);
        h.write(p, &data);
        h.e.pause_pick(&tms::engine::Pick::chunks(p, &[0])).unwrap();
        let blocking = h.e.resume(Some("c")).unwrap();
        assert_eq!((blocking.allocations, blocking.bytes), (1, g), "{blocking:?}");
        h.e.pause_pick(&tms::engine::Pick::chunks(p, &[0])).unwrap();
        // Nothing lands while the copies' waits are held.
        sim.hold(Prim::EventSync, None);
        let r = Engine::resume_nonblocking(h.e.clone(), Some("c"), &[], None).unwrap();
        let t = tag_stats(&h.e, "c");
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(None, Some(Duration::from_secs(30))).unwrap());
        check_contents(&h, &[(p, data)]);
        assert_eq!(t.bytes_restoring, g, "the stats: one chunk on its way");
        assert_eq!(
            (r.allocations, r.bytes, r.pending),
            (1, g, g),
            "the report of a non-blocking resume of one chunk: {r:?}"
        );
    }
}

engine_test! {
    /// A non-blocking resume restores one of its two allocations, then fails after its return:
    /// the one that landed is committed restored (active), so this resume changed the tag. Its
    /// stats show it as the tag's last resume (one allocation, its bytes), as they show a pause
    /// that failed part-way; before, they showed no resume of the tag at all.
    sim_only fn a_resume_failing_after_its_return_is_the_last_resume_of_what_it_restored(h)
        [Setup::default().small_pieces(1)]
    {
        let g = h.g();
        let allocs = second_lands_then_the_first_fails(&h);
        let (first, second) = (allocs[0].0, allocs[1].0);
        assert!(h.e.wait_restored(Some(first), None).is_err());
        assert_eq!(state(&h.e, second), State::Active);
        let last = tag_stats(&h.e, "n").last_resume;
        let last = last.expect("the tag's last resume: the one that restored the second");
        assert_eq!(
            (last.allocations, last.bytes, last.copied_bytes),
            (1, 2 * g, 2 * g),
            "{last:?}"
        );
        check_contents(&h, &allocs[1..]);
    }
}
