//! Unit tests of the simulated driver.

use super::*;
use crate::os::page_size;

fn sim() -> SimDriver {
    SimDriver::new(SimConfig {
        devices: 2,
        capacity: 16 << 20,
        granularity: 2 << 20,
    })
    .unwrap()
}

#[test]
fn map_write_unmap_release_accounts() {
    let d = sim();
    let g = d.granularity(0).unwrap();
    let va = d.reserve(0, 2 * g).unwrap();
    let h = d.create(0, 2 * g).unwrap();
    assert_eq!(d.live_bytes(0), 2 * g);
    d.map(va, 2 * g, h).unwrap();
    assert!(!d.is_accessible(va));
    d.set_access(0, va, 2 * g).unwrap();
    assert!(d.is_accessible(va + g));
    let data = vec![7u8; 4096];
    let s = d.stream(0).unwrap();
    // SAFETY: va is mapped and accessible; data outlives the copy (synchronized below).
    unsafe { d.copy_h2d(va + 100, data.as_ptr(), 4096, s).unwrap() };
    d.stream_sync(s).unwrap();
    let mut back = vec![0u8; 4096];
    // SAFETY: as above.
    unsafe { d.copy_d2h(back.as_mut_ptr(), va + 100, 4096, s).unwrap() };
    assert_eq!(
        back,
        vec![0u8; 4096],
        "nothing lands before the stream is synchronized"
    );
    d.stream_sync(s).unwrap();
    assert_eq!(back, data);
    d.release(h).unwrap();
    assert_eq!(d.live_bytes(0), 2 * g, "still mapped: pages held");
    d.unmap(va, 2 * g).unwrap();
    assert_eq!(d.live_bytes(0), 0);
    assert!(!d.is_accessible(va));
    d.free_range(va, 2 * g).unwrap();
    assert_eq!(
        (d.live_handles(), d.live_mappings(), d.live_reservations()),
        (0, 0, 0)
    );
}

#[test]
fn capacity_gives_oom() {
    let d = sim();
    let h = d.create(1, 16 << 20).unwrap();
    let e = d.create(1, 2 << 20).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(d.create(0, 2 << 20).is_ok(), "devices are independent");
    d.release(h).unwrap();
    assert!(d.create(1, 2 << 20).is_ok());
}

#[test]
fn a_reservation_past_the_address_space_is_out_of_memory() {
    let d = sim();
    let g = d.granularity(0).unwrap();
    // The largest multiple of the granularity: with the alignment added it passes 2^64.
    let e = d.reserve(0, u64::MAX - g + 1).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert_eq!(d.live_reservations(), 0);
}

#[test]
fn misuse_is_a_driver_error() {
    let d = sim();
    assert!(
        d.create(0, 4096).is_err(),
        "not a multiple of the granularity"
    );
    assert!(d.create(5, 2 << 20).is_err(), "no such device");
    let va = d.reserve(0, 2 << 20).unwrap();
    let mut b = [0u8; 8];
    // SAFETY: the sim checks the range and refuses; nothing is touched.
    let e = unsafe { d.copy_d2h(b.as_mut_ptr(), va, 8, d.stream(0).unwrap()) }.unwrap_err();
    assert!(e.to_string().contains("not mapped"), "{e}");
    assert!(d.unmap(va, 2 << 20).is_err());
    assert!(d.release(PhysHandle(77)).is_err());
}

#[test]
fn faults_fire_on_the_nth_call_once() {
    let d = sim();
    d.arm_fault(Prim::Create, 2, 2);
    let a = d.create(0, 2 << 20).unwrap();
    let e = d.create(0, 2 << 20).unwrap_err();
    assert!(e.is_oom() && e.to_string().contains("injected"), "{e}");
    let b = d.create(0, 2 << 20).unwrap();
    assert_eq!(d.pending_faults(), 0);
    d.release(a).unwrap();
    d.release(b).unwrap();
}

#[test]
fn fault_plan_parses_and_rejects() {
    let f = parse_faults("map:2:oom, create:1 ,copy_d2h:3:700").unwrap();
    assert_eq!(
        f,
        vec![
            (Prim::Map, 2, 2),
            (Prim::Create, 1, 999),
            (Prim::CopyD2H, 3, 700)
        ]
    );
    assert!(parse_faults("mop:1")
        .unwrap_err()
        .to_string()
        .contains("unknown primitive"));
    assert!(parse_faults("map:0").is_err());
    assert!(parse_faults("map:1:x").is_err());
    assert!(parse_faults("map:1:2:3").is_err());
}

/// A mapped, accessible range of `2 * g` bytes on device 0 and its handle.
fn mapped(d: &SimDriver) -> (DevPtr, PhysHandle, u64) {
    let size = 2 * d.granularity(0).unwrap();
    let va = d.reserve(0, size).unwrap();
    let h = d.create(0, size).unwrap();
    d.map(va, size, h).unwrap();
    d.set_access(0, va, size).unwrap();
    (va, h, size)
}

#[test]
fn queued_copies_run_at_sync_and_fail_on_unmapped_ranges() {
    let d = sim();
    let (va, h, size) = mapped(&d);
    let mut back = vec![1u8; 64];
    let s = d.stream(0).unwrap();
    assert_ne!(s, d.stream(1).unwrap(), "one stream per device");
    // SAFETY: mapped range; back outlives the copies (synchronized or dropped below).
    unsafe { d.copy_d2h(back.as_mut_ptr(), va, 64, s).unwrap() };
    assert_eq!(d.queued_copies(), 1);
    d.synchronize(0).unwrap();
    assert_eq!(
        (d.queued_copies(), back[0]),
        (0, 0),
        "device sync runs the stream"
    );
    // SAFETY: as above.
    unsafe { d.copy_d2h(back.as_mut_ptr(), va, 64, s).unwrap() };
    d.unmap(va, size).unwrap();
    let e = d.stream_sync(s).unwrap_err();
    assert!(e.to_string().contains("no longer mapped"), "{e}");
    d.release(h).unwrap();
    d.free_range(va, size).unwrap();
}

#[test]
fn an_event_waits_for_what_was_queued_before_it_only() {
    let d = sim();
    let (va, _, _) = mapped(&d);
    let (a, b) = ([1u8; 16], [2u8; 16]);
    let s = d.stream(0).unwrap();
    let (e1, e2) = (d.event_create(0).unwrap(), d.event_create(0).unwrap());
    // Never recorded: nothing to wait for.
    d.event_sync(e1).unwrap();
    // SAFETY: mapped() made va..va+32 mapped and accessible; a and b live until the end of
    // the test, after the event waits below have run both copies.
    unsafe {
        d.copy_h2d(va, a.as_ptr(), 16, s).unwrap();
        d.event_record(e1, s).unwrap();
        d.copy_h2d(va + 16, b.as_ptr(), 16, s).unwrap();
        d.event_record(e2, s).unwrap();
    }
    d.event_sync(e1).unwrap();
    assert_eq!(d.queued_copies(), 1, "the copy after the first mark waits");
    // SAFETY: the simulated device's addresses are host mappings, and mapped() made this
    // range readable and writable; no copy is running while the test thread reads.
    assert_eq!(unsafe { *(va as *const u8) }, 1);
    d.arm_fault(Prim::EventSync, 1, 999);
    assert!(d.event_sync(e2).is_err());
    assert_eq!(d.queued_copies(), 1, "a failed wait leaves the work queued");
    // SAFETY: as above.
    assert_eq!(unsafe { *((va + 16) as *const u8) }, 0, "not run yet");
    d.event_sync(e2).unwrap();
    assert_eq!(
        // SAFETY: as above.
        unsafe { *((va + 16) as *const u8) },
        2,
        "run by the next wait"
    );
    d.event_destroy(e1);
    d.event_destroy(e2);
    assert!(d.event_sync(e1).is_err(), "destroyed");
}

#[test]
fn a_failed_stream_sync_leaves_the_work_for_the_next() {
    let d = sim();
    let (va, _, _) = mapped(&d);
    let data = [9u8; 32];
    let s = d.stream(0).unwrap();
    // SAFETY: mapped range; data outlives the copy.
    unsafe { d.copy_h2d(va, data.as_ptr(), 32, s).unwrap() };
    d.arm_fault(Prim::StreamSync, 1, 999);
    assert!(d.stream_sync(s).is_err());
    assert_eq!(d.queued_copies(), 1);
    d.stream_sync(s).unwrap();
    // SAFETY: the range is mapped read/write.
    let first = unsafe { *(va as *const u8) };
    assert_eq!(first, 9, "the copy ran at the next synchronization");
}

#[test]
fn work_dropped_by_an_illegal_address_fails_every_wait_that_covers_it() {
    let d = sim();
    let (va, h, size) = mapped(&d);
    let mut back = [0u8; 16];
    let s = d.stream(0).unwrap();
    let (e1, e2) = (d.event_create(0).unwrap(), d.event_create(0).unwrap());
    // SAFETY: mapped range; back outlives the copies (dropped below, never run).
    unsafe {
        d.copy_d2h(back.as_mut_ptr(), va, 16, s).unwrap();
        d.event_record(e1, s).unwrap();
        d.copy_d2h(back.as_mut_ptr(), va + 16, 16, s).unwrap();
        d.event_record(e2, s).unwrap();
    }
    d.unmap(va, size).unwrap();
    let e = d.event_sync(e1).unwrap_err();
    assert!(e.to_string().contains("no longer mapped"), "{e}");
    // e2's mark was still queued when work ahead of it was dropped: it never completes.
    let e = d.event_sync(e2).unwrap_err();
    assert!(e.to_string().contains("lost to an earlier failure"), "{e}");
    assert!(d.stream_sync(s).is_err(), "the copy after it is as illegal");
    assert_eq!(d.queued_copies(), 0);
    d.event_record(e2, s).unwrap();
    d.event_sync(e2).unwrap();
    d.event_destroy(e1);
    d.event_destroy(e2);
    d.release(h).unwrap();
    d.free_range(va, size).unwrap();
}

#[test]
fn host_registration_is_tracked_and_checked() {
    let d = sim();
    let page = page_size();
    let buf = crate::os::mmap_anonymous(4 * page).unwrap();
    // SAFETY: buf is our 4-page mapping, unregistered before it is unmapped.
    unsafe {
        d.host_register(0, buf, 2 * page).unwrap();
        let e = d
            .host_register(0, buf.add(page as usize), page)
            .unwrap_err();
        assert!(e.to_string().contains("ALREADY_REGISTERED"), "{e}");
        assert!(d.host_register(0, buf.add(1), page).is_err(), "unaligned");
        d.host_register(0, buf.add(2 * page as usize), 2 * page)
            .unwrap();
    }
    assert_eq!((d.pinned_bytes(), d.registered_ranges()), (4 * page, 2));
    let (va, _, _) = mapped(&d);
    let s = d.stream(0).unwrap();
    // SAFETY: both host ranges are inside our mapping; copies are synchronized below.
    unsafe {
        d.copy_h2d(va, buf, 2 * page, s).unwrap();
        d.copy_h2d(va, buf.add(page as usize), 2 * page, s).unwrap();
    }
    d.stream_sync(s).unwrap();
    assert_eq!(
        d.pageable_copies(),
        1,
        "a copy across two registrations is pageable"
    );
    // SAFETY: no copy is queued; the ranges were registered above.
    unsafe {
        assert!(d.host_unregister(0, buf.add(page as usize)).is_err());
        d.host_unregister(0, buf).unwrap();
        d.host_unregister(0, buf.add(2 * page as usize)).unwrap();
    }
    assert_eq!(d.pinned_bytes(), 0);
    crate::os::munmap(buf, 4 * page).unwrap();
}

/// Every call [`HOLDABLE`] names waits while held, on its device or on all of them; a hold of
/// any other call is refused, since it would not stall anything.
#[test]
fn holds_stall_the_calls_they_name_and_no_others() {
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let d = Arc::new(sim());
    let (va, h, size) = mapped(&d);
    for (prim, device) in [(Prim::CopyD2H, None), (Prim::CopyH2D, Some(0))] {
        d.hold(prim, device);
        let t = {
            let d = d.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64];
                let s = d.stream(0).unwrap();
                // SAFETY: mapped range; buf outlives the copy (synchronized below).
                unsafe {
                    if prim == Prim::CopyD2H {
                        d.copy_d2h(buf.as_mut_ptr(), va, 64, s).unwrap();
                    } else {
                        d.copy_h2d(va, buf.as_ptr(), 64, s).unwrap();
                    }
                }
                d.stream_sync(s).unwrap();
            })
        };
        let until = Instant::now() + Duration::from_secs(10);
        while d.held_calls() != 1 {
            assert!(Instant::now() < until, "{prim:?} did not wait for its hold");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(d.queued_copies(), 0, "{prim:?} queued nothing while held");
        d.unhold(prim, device);
        t.join().unwrap();
    }
    d.hold(Prim::CopyD2H, Some(1));
    let mut buf = vec![0u8; 64];
    let s = d.stream(0).unwrap();
    // SAFETY: as above.
    unsafe { d.copy_d2h(buf.as_mut_ptr(), va, 64, s).unwrap() };
    d.stream_sync(s).unwrap();
    assert_eq!(
        d.held_calls(),
        0,
        "a hold on device 1 leaves device 0 alone"
    );
    d.unhold(Prim::CopyD2H, Some(1));
    let refused =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.hold(Prim::Map, None)))
            .unwrap_err();
    let msg = refused.downcast_ref::<String>().unwrap();
    assert!(msg.contains("does not hold Map"), "{msg}");
    d.unmap(va, size).unwrap();
    d.release(h).unwrap();
    d.free_range(va, size).unwrap();
}
