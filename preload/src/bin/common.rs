//! Shared by the demo and the smoke test: pick the driver, make patterns, read memory info.

use std::sync::Arc;

use tms::backup::BackupKind;
use tms::driver::sim::{SimConfig, SimDriver};
use tms::driver::Driver;
use tms::process::runtime::open_driver;
use tms::process::settings::BackendChoice;
use tms::process::settings::ProcessSettings;
use tms::AllocRequest;

/// The driver `TMS_BACKEND` asks for; with `auto`, CUDA or HIP where a driver and device exist,
/// else the simulated device (`sim_capacity` bytes), saying so.
pub fn choose_driver(sim_capacity: u64) -> Result<Arc<dyn Driver>, String> {
    let ps = ProcessSettings::from_env().map_err(|e| e.to_string())?;
    match ps.backend {
        BackendChoice::Auto => {
            match open_driver(BackendChoice::Auto) {
                Ok(d) => Ok(d),
                Err(e) => {
                    println!("No usable GPU here ({e}).");
                    println!("Running on the SIMULATED device (host memory standing in for GPU memory).\n");
                    sim(sim_capacity)
                }
            }
        }
        BackendChoice::Sim => {
            println!("TMS_BACKEND=sim: running on the SIMULATED device.\n");
            if std::env::var_os("TMS_SIM_CAPACITY").is_some() {
                open_driver(BackendChoice::Sim).map_err(|e| e.to_string())
            } else {
                sim(sim_capacity)
            }
        }
        c @ (BackendChoice::Cuda | BackendChoice::Hip) => open_driver(c).map_err(|e| e.to_string()),
    }
}

fn sim(capacity: u64) -> Result<Arc<dyn Driver>, String> {
    let cfg = SimConfig {
        capacity,
        ..SimConfig::from_env().map_err(|e| e.to_string())?
    };
    Ok(Arc::new(SimDriver::new(cfg).map_err(|e| e.to_string())?))
}

/// Deterministic pseudo-random bytes (xorshift64*), fast enough for gigabytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, seed);
    v
}

/// Fill `buf` with the pattern of `seed`.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        c.copy_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    for b in chunks.into_remainder() {
        x ^= x >> 12;
        *b = x as u8;
    }
}

/// Free bytes on `device`, or 0 with a note on failure.
pub fn free_bytes(d: &dyn Driver, device: i32) -> u64 {
    match d.mem_info(device) {
        Ok(m) => m.free,
        Err(e) => {
            eprintln!("mem_info: {e}");
            0
        }
    }
}

/// Signed difference in GiB.
pub fn delta_gib(after: u64, before: u64) -> String {
    let d = after as f64 - before as f64;
    format!("{:+.3} GiB", d / (1u64 << 30) as f64)
}

/// Bytes over seconds in GiB/s (0 for no time).
pub fn gib_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / (1u64 << 30) as f64
    } else {
        0.0
    }
}

/// An engine error as the tools' message.
pub fn s<T>(r: tms::Result<T>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

/// A request for device 0.
pub fn req(size: u64, tag: &str, backup: Option<BackupKind>) -> AllocRequest {
    AllocRequest::new(size, tag, backup)
}
