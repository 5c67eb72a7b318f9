//! What the tests of non-blocking resumes share: paused allocations with known contents, and a
//! resume that fails after it returned.

use tms::backup::BackupKind;
use tms::driver::sim::Prim;
use tms::driver::DevPtr;
use tms::engine::Engine;

use super::harness::Harness;
use super::{pattern, req};

/// `n` allocations of `size` bytes with a pinned backup, each filled with its own pattern,
/// then paused.
pub fn paused(h: &Harness, tag: &str, n: usize, size: u64) -> Vec<(DevPtr, Vec<u8>)> {
    let v: Vec<(DevPtr, Vec<u8>)> = (0..n)
        .map(|i| {
            let p =
                h.e.alloc(&req(size, tag, Some(BackupKind::Pinned)))
                    .unwrap();
            let data = pattern(size as usize, i as u64 + 1);
            h.write(p, &data);
            (p, data)
        })
        .collect();
    h.e.pause(Some(tag)).unwrap();
    v
}

pub fn check_contents(h: &Harness, allocs: &[(DevPtr, Vec<u8>)]) {
    for (p, data) in allocs {
        assert!(h.read(*p, data.len()) == *data, "contents of {p:#x}");
    }
}

/// A non-blocking resume of `tag` that returns, then fails after its return at its first event
/// sync (driver error `code`); nobody waits for it here.
pub fn resume_failing_after_return(h: &Harness, tag: &str, code: i32) {
    let sim = h.simulated();
    sim.hold(Prim::EventSync, None);
    Engine::resume_nonblocking(h.e.clone(), Some(tag), &[], None).unwrap();
    sim.arm_fault(Prim::EventSync, 1, code);
    sim.unhold(Prim::EventSync, None);
}
