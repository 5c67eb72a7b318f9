//! Helpers shared by the engine's integration tests: the setup of a test's machine and engine
//! (`setup.rs`), the harness that runs a test body on the sim, on CUDA, or on the HIP driver
//! over its test double (`harness.rs`, `hip.rs`), the check that the device holds what the
//! registry implies (`invariants.rs`), reproducible data, and reads and writes of device memory
//! that is host memory, calling no driver primitive (so armed faults are not consumed by the
//! test itself).

#![allow(dead_code)]

pub mod harness;
pub mod hip;
pub mod invariants;
pub mod model;
pub mod nonblocking;
pub mod setup;

#[allow(unused_imports)]
pub(crate) use harness::engine_test;
#[allow(unused_imports)]
pub use harness::{run_proptest, Harness};
#[allow(unused_imports)]
pub use invariants::{assert_invariants, check_invariants, Books, Expect, Leaks};
#[allow(unused_imports)]
pub use setup::{sim_engine, Setup};

use std::time::{Duration, Instant};

use tms::backup::BackupKind;
use tms::driver::sim::SimDriver;
use tms::engine::AllocRequest;

/// Wait until `cond` holds (a test's other thread reached a held call, say); the test fails,
/// naming `what`, if it does not within `patience`.
pub fn wait_until(what: &str, patience: Duration, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < patience, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Run `f` on another thread and return what it returns (or raise its panic); the test fails,
/// naming `what`, if `f` is not back within `patience` (a hang).
pub fn bounded<T: Send + 'static>(
    what: &str,
    patience: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(patience) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("{what} did not return within {patience:?}"),
    }
}

/// A request for `size` bytes on device 0, unchunked.
pub fn req(size: u64, tag: &str, backup: Option<BackupKind>) -> AllocRequest {
    AllocRequest::new(size, tag, backup)
}

/// `len` pseudo-random bytes (xorshift64) from `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = vec![0u8; len];
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

/// Write straight into simulated device memory (it is host memory).
pub fn write_raw(sim: &SimDriver, addr: u64, data: &[u8]) {
    write_books(sim, addr, data)
}

/// Read straight from simulated device memory.
pub fn read_raw(sim: &SimDriver, addr: u64, len: usize) -> Vec<u8> {
    read_books(sim, addr, len)
}

/// Write straight into device memory that is host memory (the sim's or the HIP double's).
pub fn write_books(dev: &dyn Books, addr: u64, data: &[u8]) {
    let last = addr + data.len() as u64 - 1;
    assert!(
        dev.accessible(addr) && dev.accessible(last),
        "writing {addr:#x}+{}: not accessible",
        data.len()
    );
    // SAFETY: the device's books say the whole range is mapped read/write host memory.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) }
}

/// Read straight from device memory that is host memory (the sim's or the HIP double's).
pub fn read_books(dev: &dyn Books, addr: u64, len: usize) -> Vec<u8> {
    let last = addr + len as u64 - 1;
    assert!(
        dev.accessible(addr) && dev.accessible(last),
        "reading {addr:#x}+{len}: not accessible"
    );
    let mut v = vec![0u8; len];
    // SAFETY: the device's books say the whole range is mapped read/write host memory.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), len) }
    v
}
