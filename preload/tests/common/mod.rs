//! Helpers shared by the engine's integration tests: reproducible data, and reads and writes
//! of simulated device memory that call no driver primitive (so armed faults are not consumed
//! by the test itself).

#![allow(dead_code)]

use std::sync::Arc;

use tms::driver::sim::{SimConfig, SimDriver};
use tms::engine::{CopyConfig, Engine};

/// An engine on a simulated device (`devices` of 256 MiB, 2 MiB granularity) with `threads`
/// copy workers, small staging slots (256 KiB) and disk chunks (1 MiB), so that little data
/// spans many pieces, and a disk backup folder of its own (kept while the folder lives).
pub fn disk_engine(devices: i32, threads: usize) -> (Arc<SimDriver>, Engine, tempfile::TempDir) {
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            devices,
            capacity: 256 << 20,
            granularity: 2 << 20,
        })
        .unwrap(),
    );
    let e = Engine::new(sim.clone());
    let mut cfg = CopyConfig {
        threads,
        ..CopyConfig::default()
    };
    cfg.slot = 256 << 10;
    cfg.disk_chunk = 1 << 20;
    e.set_copy_config(cfg).unwrap();
    let dir = tempfile::tempdir().unwrap();
    e.set_disk_backup_dir(Some(dir.path().to_path_buf()))
        .unwrap();
    (sim, e, dir)
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
    let last = addr + data.len() as u64 - 1;
    assert!(
        sim.is_accessible(addr) && sim.is_accessible(last),
        "writing {addr:#x}+{}: not accessible",
        data.len()
    );
    // SAFETY: the sim says the whole range is mapped read/write.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) }
}

/// Read straight from simulated device memory.
pub fn read_raw(sim: &SimDriver, addr: u64, len: usize) -> Vec<u8> {
    let last = addr + len as u64 - 1;
    assert!(
        sim.is_accessible(addr) && sim.is_accessible(last),
        "reading {addr:#x}+{len}: not accessible"
    );
    let mut v = vec![0u8; len];
    // SAFETY: the sim says the whole range is mapped read/write.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), len) }
    v
}
