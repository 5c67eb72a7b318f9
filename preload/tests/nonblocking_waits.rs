//! Waits for non-blocking resumes (engine Note [Non-blocking resume]) at their edges: several
//! failures after the return, addresses inside or outside allocations, timeouts, `order`.

mod common;

use std::time::Duration;

use common::harness::Harness;
use common::nonblocking::{check_contents, paused, resume_failing_after_return};
use common::{bounded, engine_test, wait_until, Setup};
use tms::driver::sim::Prim;
use tms::driver::Stream;
use tms::engine::{Engine, StreamOf};

/// A non-blocking resume of `tag` that returns, then fails at its first event sync; returns
/// once the failure is kept (stats show it), without any wait having raised it.
fn failed_after_return(h: &Harness, tag: &str) {
    resume_failing_after_return(h, tag, 999);
    let failed = || {
        let t = h.e.stats().tags.into_iter().find(|t| t.tag == tag);
        t.is_some_and(|t| t.failed_restore.is_some()) && !h.e.restoring()
    };
    wait_until("the failure is kept", Duration::from_secs(60), failed);
}

engine_test! {
    /// Two tags' resumes fail after returning: a wait for everything concerns both, so it
    /// raises both (docs/semantics.md: every wait for any of them raises it), and then neither
    /// pause has anything left to report.
    sim_only fn a_wait_for_everything_raises_every_failure_kept(h) [Setup::default().small_pieces(2)] {
        let g = h.g();
        let a = paused(&h, "a", 1, 2 * g);
        let b = paused(&h, "b", 1, 2 * g);
        failed_after_return(&h, "a");
        failed_after_return(&h, "b");
        for _ in 0..2 {
            let err = h.e.wait_restored(None, None).unwrap_err().to_string();
            assert!(err.contains("tag \"a\"") && err.contains("tag \"b\""), "{err}");
        }
        h.e.pause(Some("a")).unwrap();
        h.e.pause(Some("b")).unwrap();
        assert!(h.e.wait_restored(None, None).unwrap());
        h.e.resume(None).unwrap();
        check_contents(&h, &a);
        check_contents(&h, &b);
    }
}

engine_test! {
    /// A wait that times out while another tag's resume restores still raises a failure kept
    /// for allocations no resume is restoring: they do not land however long it waits. Before,
    /// it said "not yet" (false) until that other resume ended. Where a resume in flight is
    /// restoring them again, the failure may yet end (as they land): it times out.
    sim_only fn a_timed_out_wait_raises_a_failure_no_resume_can_end(h) [Setup::default().small_pieces(2)] {
        let g = h.g();
        let sim = h.simulated();
        let a = paused(&h, "a", 1, 2 * g);
        let b = paused(&h, "b", 1, 2 * g);
        failed_after_return(&h, "a");
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("b"), &[], None).unwrap();
        for _ in 0..2 {
            let err = h.e.wait_restored(None, Some(Duration::ZERO)).unwrap_err().to_string();
            assert!(err.contains("tag \"a\"") && err.contains("failed after it returned"), "{err}");
            assert!(h.e.wait_restored(Some(a[0].0), Some(Duration::ZERO)).is_err());
            assert!(!h.e.wait_restored(Some(b[0].0), Some(Duration::ZERO)).unwrap());
        }
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(Some(b[0].0), None).unwrap());
        // A resume of "a" restores it again (the waits reported its failure: none to raise).
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("a"), &[], None).unwrap();
        assert!(!h.e.wait_restored(None, Some(Duration::ZERO)).unwrap());
        assert!(!h.e.wait_restored(Some(a[0].0), Some(Duration::ZERO)).unwrap());
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(None, None).unwrap());
        check_contents(&h, &a);
        check_contents(&h, &b);
    }
}

engine_test! {
    /// Addresses inside an allocation stand for it; one in none is nothing to wait for; a freed
    /// allocation's failure is over.
    sim_only fn waits_by_address_inside_outside_and_after_a_free(h) [Setup::default().small_pieces(2)] {
        let g = h.g();
        let a = paused(&h, "a", 1, 2 * g);
        failed_after_return(&h, "a");
        let inside = a[0].0 + g + 8;
        for _ in 0..2 {
            assert!(h.e.wait_restored(Some(inside), Some(Duration::ZERO)).is_err());
        }
        assert!(h.e.wait_restored(Some(a[0].0 + 4 * g), Some(Duration::ZERO)).unwrap());
        assert!(h.e.free(a[0].0).unwrap());
        assert!(h.e.wait_restored(Some(inside), None).unwrap());
        assert!(h.e.wait_restored(None, None).unwrap());
    }
}

engine_test! {
    /// A zero timeout polls: false while the data is held back, true once it landed.
    sim_only fn a_zero_timeout_polls(h) [Setup::default().small_pieces(2)] {
        let g = h.g();
        let sim = h.simulated();
        let a = paused(&h, "a", 1, 2 * g);
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("a"), &[], None).unwrap();
        assert!(!h.e.wait_restored(Some(a[0].0 + 1), Some(Duration::ZERO)).unwrap());
        assert!(!h.e.wait_restored(None, Some(Duration::ZERO)).unwrap());
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(None, Some(Duration::from_secs(60))).unwrap());
        check_contents(&h, &a);
    }
}

engine_test! {
    /// `order` names what comes first: duplicates, another tag's address and an address in no
    /// allocation change nothing else.
    sim_only fn order_with_duplicates_and_strangers_restores_the_tag(h) [Setup::default().small_pieces(2)] {
        let g = h.g();
        let other = paused(&h, "o", 1, 2 * g);
        let a = paused(&h, "a", 3, 2 * g);
        let order = [a[2].0 + 5, a[2].0, other[0].0, 0x10, a[0].0];
        let r = Engine::resume_nonblocking(h.e.clone(), Some("a"), &order, None).unwrap();
        assert_eq!(r.allocations, 3);
        assert!(h.e.wait_restored(None, None).unwrap());
        check_contents(&h, &a);
        let o = h.e.stats().tags.into_iter().find(|t| t.tag == "o").unwrap();
        assert_eq!(o.paused_allocations, 1, "another tag's address resumes nothing of it");
    }
}

engine_test! {
    /// The gate is one word of host memory every device reads: a stream of device 1 may wait
    /// for what is restored on device 0 (work there reading it). A device that does not exist
    /// is refused at once, as a non-blocking resume refuses it. Before, the driver's refusal
    /// read as "this stream cannot wait": the host blocked until the data landed, then Ok.
    sim_only fn any_existing_devices_stream_may_wait(h) [Setup::default().devices(2).small_pieces(2)] {
        let g = h.g();
        let sim = h.simulated();
        let a = paused(&h, "a", 1, 2 * g);
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("a"), &[], None).unwrap();
        let on_1 = StreamOf { device: 1, stream: Stream(0x7171) };
        h.e.stream_wait_restored(Some(a[0].0), on_1).unwrap();
        assert_eq!(sim.gated_streams(), vec![(1, on_1.stream, 1)]);
        let e = h.e.clone();
        let nowhere = StreamOf { device: 2, stream: Stream(0x7272) };
        let r = bounded("a stream wait on device 2", Duration::from_secs(10), move || {
            e.stream_wait_restored(None, nowhere)
        });
        let err = r.unwrap_err().to_string();
        assert!(err.contains("device 2 does not exist"), "{err}");
        assert_eq!(sim.gated_streams().len(), 1, "nothing more queued");
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(None, None).unwrap());
        assert!(sim.gated_streams().is_empty());
        // Nothing in flight: refused all the same.
        assert!(h.e.stream_wait_restored(None, nowhere).is_err());
        check_contents(&h, &a);
    }
}

engine_test! {
    /// A non-blocking resume whose data all landed, then panicked (giving back the host memory
    /// of the backups it no longer keeps), left nothing unrestored: the next wait for
    /// everything raises the panic, once. Before, every later wait for everything raised it
    /// again, until a free, though every wait for its allocation said it landed (and a broken
    /// engine pauses nothing, so no pause ever ended it).
    sim_only fn a_failure_after_everything_landed_is_raised_once(h) [Setup::default().small_pieces(2)] {
        let sim = h.simulated();
        let g = h.g();
        let a = paused(&h, "a", 1, 2 * g);
        sim.hold(Prim::EventSync, None);
        Engine::resume_nonblocking(h.e.clone(), Some("a"), &[], None).unwrap();
        sim.arm_fault(Prim::HostUnregister, 1, tms::driver::sim::PANIC);
        sim.unhold(Prim::EventSync, None);
        assert!(h.e.wait_restored(Some(a[0].0), None).unwrap());
        let raised = std::cell::RefCell::new(None);
        wait_until("a wait raises the panic", Duration::from_secs(60), || {
            *raised.borrow_mut() = h.e.wait_restored(None, Some(Duration::ZERO)).err();
            raised.borrow().is_some()
        });
        let err = raised.take().unwrap().to_string();
        assert!(err.contains("panic") && err.contains("tag \"a\""), "{err}");
        assert_eq!(sim.pending_faults(), 0);
        for _ in 0..2 {
            assert!(h.e.wait_restored(None, None).unwrap(), "raised once already");
            assert!(h.e.wait_restored(None, Some(Duration::ZERO)).unwrap());
            assert!(h.e.wait_restored(Some(a[0].0), None).unwrap());
        }
        check_contents(&h, &a);
    }
}
