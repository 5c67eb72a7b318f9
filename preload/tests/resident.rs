//! Allocations kept resident (`Engine::keep_resident`), the devices a tag touches, and handing
//! out a retained pinned backup only once it is page-locked.

mod common;

use std::time::Duration;

use common::{engine_test, pattern, Setup};
use tms::backup::BackupKind;
use tms::driver::sim::Prim;
use tms::engine::{AllocRequest, Engine, Pick, State};
use tms::error::ErrorKind;

fn req(size: u64, device: i32, tag: &str, backup: Option<BackupKind>, chunk: u64) -> AllocRequest {
    AllocRequest {
        size,
        device,
        tag: tag.into(),
        backup,
        chunk,
    }
}

fn state(e: &Engine, p: u64) -> State {
    e.allocations()
        .into_iter()
        .find(|a| a.addr == p)
        .expect("allocation")
        .state
}

engine_test! {
    fn a_resident_allocation_stays_mapped_through_every_pause_and_resume(h) {
        let (e, g) = (&h.e, h.g());
        let size = 3 * g + 4096;
        let kept = e
            .alloc(&req(size, 0, "mixed", Some(BackupKind::Pinned), 0))
            .unwrap();
        let other = e
            .alloc(&req(g, 0, "mixed", Some(BackupKind::Pinned), 0))
            .unwrap();
        let (a, b) = (pattern(size as usize, 1), pattern(g as usize, 2));
        h.write(kept, &a);
        h.write(other, &b);
        // Any address inside names the whole allocation; asking again changes nothing.
        assert_eq!(e.keep_resident(kept + 12345).unwrap(), size);
        assert_eq!(e.keep_resident(kept).unwrap(), size);
        assert_eq!(e.keep_resident(kept + size + (64 << 20)).unwrap(), 0);
        let used = h.live_bytes(0);
        for tag in [Some("mixed"), None, Some("mixed")] {
            e.pause(tag).unwrap();
            assert_eq!(state(e, kept), State::Active);
            assert_eq!(state(e, other), State::Paused);
            h.assert_live_bytes(0, used - g, "only the other allocation gave memory back");
            assert_eq!(
                h.read(kept, size as usize),
                a,
                "readable while the tag is paused"
            );
            e.resume(tag).unwrap();
            assert_eq!(
                h.read(other, g as usize),
                b,
                "the other one restored"
            );
        }
        assert!(e.allocations().iter().any(|i| i.addr == kept && i.resident));
        // Nor do chunk calls move it.
        let err = e.pause_pick(&Pick::chunks(kept, &[0])).unwrap_err();
        assert_eq!(*err.kind(), ErrorKind::InvalidState, "{err}");
        assert!(err.to_string().contains("kept resident"), "{err}");
        // It ends with the allocation: a new one at the same address is an ordinary one.
        assert!(e.free(kept).unwrap());
        assert_eq!(e.keep_resident(kept).unwrap(), 0);
        let again = e.alloc(&req(size, 0, "mixed", None, 0)).unwrap();
        e.pause(Some("mixed")).unwrap();
        assert_eq!(state(e, again), State::Paused);
        e.resume(None).unwrap();
    }
}

engine_test! {
    fn keep_resident_refuses_paused_and_partly_paused_allocations(h) {
        let (e, g) = (&h.e, h.g());
        let p = e.alloc(&req(g, 0, "t", None, 0)).unwrap();
        let c = e.alloc(&req(4 * g, 0, "c", None, g)).unwrap();
        e.pause(Some("t")).unwrap();
        let err = e.keep_resident(p + 10).unwrap_err();
        assert_eq!(*err.kind(), ErrorKind::InvalidState, "{err}");
        assert!(
            err.to_string()
                .contains("keep_resident requires an active allocation"),
            "{err}"
        );
        e.pause_pick(&Pick::chunks(c, &[2])).unwrap();
        let err = e.keep_resident(c).unwrap_err();
        assert!(
            err.to_string().contains("paused, in whole or in part"),
            "{err}"
        );
        // Refusals change nothing: resumed, both can be kept.
        e.resume(None).unwrap();
        assert_eq!(e.keep_resident(p).unwrap(), g);
        assert_eq!(e.keep_resident(c + 3 * g).unwrap(), 4 * g);
    }
}

engine_test! {
    sim_only fn affected_devices_are_those_a_pause_would_touch(h) [Setup::default().devices(3)] {
        let (e, g) = (&h.e, h.g());
        e.alloc(&req(g, 2, "w", None, 0)).unwrap();
        e.alloc(&req(g, 0, "w", None, 0)).unwrap();
        e.alloc(&req(g, 0, "w", None, 0)).unwrap();
        let r = e.alloc(&req(g, 1, "r", None, 0)).unwrap();
        e.alloc_unpauseable(&req(g, 1, "w", None, 0)).unwrap();
        assert_eq!(e.affected_devices(Some("w")).unwrap(), vec![0, 2]);
        assert_eq!(e.affected_devices(None).unwrap(), vec![0, 1, 2]);
        assert_eq!(e.affected_devices(Some("none")).unwrap(), Vec::<i32>::new());
        e.keep_resident(r).unwrap();
        assert_eq!(e.affected_devices(Some("r")).unwrap(), Vec::<i32>::new());
        assert!(e.affected_devices(Some("")).is_err());
    }
}

engine_test! {
    sim_only fn a_retained_pinned_backup_is_handed_out_page_locked(h) {
        let (sim, e, g) = (h.simulated(), &h.e, h.g());
        let size = 4 * g;
        let p = e
            .alloc(&req(size, 0, "kv", Some(BackupKind::Pinned), 0))
            .unwrap();
        // A first cycle without retention makes the staging slots (page-locked at once).
        e.pause(Some("kv")).unwrap();
        e.resume(Some("kv")).unwrap();
        e.set_retain_cpu_backup(true);
        let data = pattern(size as usize, 9);
        h.write(p, &data);
        // Page-locking stalls until another thread releases it, 300 ms after the first call waits.
        sim.hold(Prim::HostRegister, Some(0));
        let release = {
            let sim = sim.clone();
            std::thread::spawn(move || {
                while sim.held_calls() == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
                std::thread::sleep(Duration::from_millis(300));
                sim.unhold(Prim::HostRegister, Some(0));
            })
        };
        e.pause(Some("kv")).unwrap();
        let lease = e.acquire_cpu_backup(p, size).unwrap().expect("a snapshot");
        release.join().unwrap();
        let info = e.allocations().into_iter().find(|a| a.addr == p).unwrap();
        assert_eq!(
            info.host_pinned_bytes, info.host_bytes,
            "page-locked when handed out"
        );
        // SAFETY: the lease keeps the buffer mapped and unchanged until released.
        let got = unsafe { std::slice::from_raw_parts(lease.ptr, size as usize) };
        assert_eq!(got, &data[..]);
        e.release_cpu_backup(lease.lease).unwrap();
        e.resume(Some("kv")).unwrap();
    }
}
