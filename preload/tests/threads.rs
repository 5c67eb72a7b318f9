//! Threads that cannot be had and panics inside a pause or resume: the operation fails (or, for
//! a panic of the operation's own thread, unwinds to the caller) and never hangs, nothing
//! backed up is lost, and after a panic the engine refuses to act on a registry it can no longer
//! trust. Its own test binary: the spawn-failure switch is process-wide.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use common::{bounded, pattern, read_raw, wait_until, write_raw};
use tms::backup::BackupKind;
use tms::driver::sim::{Prim, SimDriver, PANIC};
use tms::engine::{AllocRequest, Engine, Pick, State};
use tms::threads::fail_next_spawns;

const MIB: u64 = 1 << 20;

struct Fx {
    sim: Arc<SimDriver>,
    e: Arc<Engine>,
    allocs: Vec<(u64, Vec<u8>)>,
}

/// Two devices, three workers each, small chunks and slots so every allocation is many pieces.
fn fx() -> Fx {
    let (sim, e) = common::sim_engine(
        &common::Setup::default()
            .devices(2)
            .capacity(64 << 20)
            .small_pieces(3),
    );
    let mut allocs = Vec::new();
    for (k, mib) in [3u64, 8, 5, 2].into_iter().enumerate() {
        let size = mib * MIB;
        let addr = e
            .alloc(&AllocRequest {
                size,
                device: (k % 2) as i32,
                tag: "t".into(),
                backup: Some(if k % 2 == 0 {
                    BackupKind::Pinned
                } else {
                    BackupKind::Mmap
                }),
                chunk: 0,
            })
            .unwrap();
        let data = pattern(size as usize, 77 + k as u64);
        write_raw(&sim, addr, &data);
        allocs.push((addr, data));
    }
    Fx { sim, e, allocs }
}

impl Fx {
    fn check_contents(&self) {
        for (k, (addr, data)) in self.allocs.iter().enumerate() {
            assert!(
                read_raw(&self.sim, *addr, data.len()) == *data,
                "allocation {k} differs"
            );
        }
    }
}

/// How long a call may take before the test calls it a hang.
const HANG: Duration = Duration::from_secs(60);

#[test]
fn threads_that_cannot_be_had_and_panics_never_hang_or_lose_data() {
    // 1. No helper thread can be had: pause and resume run with fewer threads, or inline.
    for refused in [usize::MAX, 1, 2, 5] {
        let f = fx();
        fail_next_spawns(refused);
        let e = f.e.clone();
        bounded("a pause without threads", HANG, move || e.pause(None)).unwrap();
        let e = f.e.clone();
        bounded("a resume without threads", HANG, move || e.resume(None)).unwrap();
        fail_next_spawns(0);
        f.check_contents();
        // A verified resume digests on the host what the backups recorded no digest of, on
        // the copy workers' number of threads: the parts no thread was had for, here.
        f.e.pause(None).unwrap();
        fail_next_spawns(refused);
        let e = f.e.clone();
        let r = bounded("a verified resume without threads", HANG, move || {
            e.resume_pick(&Pick {
                verify: true,
                ..Pick::default()
            })
        })
        .unwrap();
        fail_next_spawns(0);
        assert_eq!(r.verified, 18 * MIB, "every byte checked");
        f.check_contents();
    }

    // 2. A copy worker panics: the pause fails like an error, nothing is lost, the engine goes on.
    for prim in [Prim::CopyD2H, Prim::EventSync] {
        let f = fx();
        f.sim.arm_fault(prim, 3, PANIC);
        let e = f.e.clone();
        let err = bounded("a pause with a panicking worker", HANG, move || {
            e.pause(None)
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("a copy worker panicked") && err.status() == 8,
            "{err}"
        );
        for (addr, data) in &f.allocs {
            let a =
                f.e.allocations()
                    .into_iter()
                    .find(|a| a.addr == *addr)
                    .unwrap();
            if a.state == State::Active {
                assert!(read_raw(&f.sim, *addr, data.len()) == *data);
            }
        }
        f.e.pause(None).unwrap();
        f.e.resume(None).unwrap();
        f.check_contents();
    }

    // 3. The operation's own thread panics (mapping during a resume, one device and two):
    //    the panic reaches the caller without a hang, and the engine then refuses to act.
    for nth in [1, 3] {
        let f = fx();
        f.e.pause(None).unwrap();
        f.sim.arm_fault(Prim::Map, nth, PANIC);
        let e = f.e.clone();
        let r = bounded("a resume whose mapping panics", HANG, move || {
            catch_unwind(AssertUnwindSafe(|| e.resume(None)))
        });
        assert!(r.is_err(), "the panic reaches the caller");
        for err in [
            f.e.pause(None).unwrap_err(),
            f.e.resume(None).unwrap_err(),
            f.e.alloc(&AllocRequest {
                size: MIB,
                device: 0,
                tag: "t".into(),
                backup: None,
                chunk: 0,
            })
            .unwrap_err(),
        ] {
            assert!(
                err.to_string()
                    .contains("stopped after an internal error (a bug) during a resume")
                    && err.status() == 4,
                "{err}"
            );
        }
    }
}

/// A transaction that waited for the operations lock while the one holding it panicked is
/// refused once it has the lock, like every later one: it never acts on a record the panic may
/// have left wrong.
#[test]
fn a_transaction_waiting_behind_a_panic_is_refused() {
    for waiting in ["resume", "pause"] {
        let f = fx();
        f.e.pause(None).unwrap();
        // The first resume stalls at its first physical allocation, holding the lock.
        f.sim.hold(Prim::Create, None);
        let e = f.e.clone();
        let first = std::thread::spawn(move || catch_unwind(AssertUnwindSafe(|| e.resume(None))));
        wait_until(
            "the resume reaches its mapping",
            Duration::from_secs(30),
            || f.sim.held_calls() > 0,
        );
        let e = f.e.clone();
        let second = std::thread::spawn(move || match waiting {
            "resume" => e.resume(None),
            _ => e.pause(None),
        });
        // Time for the second to reach the lock and wait there.
        std::thread::sleep(Duration::from_millis(300));
        assert!(!second.is_finished(), "the {waiting} waits for the resume");
        f.sim.arm_fault(Prim::Create, 1, PANIC);
        f.sim.unhold(Prim::Create, None);
        let err = bounded("the first resume", HANG, move || first.join().unwrap());
        assert!(err.is_err(), "the panic reaches the first caller");
        let err = bounded("the operation that waited", HANG, move || {
            second.join().unwrap()
        })
        .expect_err(waiting);
        assert!(
            err.to_string()
                .contains("stopped after an internal error (a bug) during a resume")
                && err.status() == 4,
            "{waiting}: {err}"
        );
    }
}
