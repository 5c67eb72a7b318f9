//! What a test's engine runs on: the shape of the simulated machine and the engine's settings,
//! one description for every test (on the sim directly, or through the harness on either
//! driver).

use std::sync::Arc;

use tms::driver::sim::{SimConfig, SimDriver};
use tms::engine::{CopyConfig, Engine};

/// A test's machine and engine settings. On the CUDA driver only `devices` (at most that many
/// of the GPUs), `copy` and `disk` apply: the GPU has its own capacity and granularity.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Devices of the simulated machine.
    pub devices: i32,
    /// Capacity of each simulated device in bytes.
    pub capacity: u64,
    /// Allocation granularity of the simulated devices.
    pub granularity: u64,
    /// How the engine copies backups (`None`: its defaults).
    pub copy: Option<CopyConfig>,
    /// Give the engine a disk backup folder of its own (removed with the test's harness).
    pub disk: bool,
}

impl Default for Setup {
    /// One device of 256 MiB, 2 MiB granularity (a GPU's), the engine's default copy settings.
    fn default() -> Self {
        Setup {
            devices: 1,
            capacity: 256 << 20,
            granularity: 2 << 20,
            copy: None,
            disk: false,
        }
    }
}

impl Setup {
    pub fn devices(self, devices: i32) -> Self {
        Setup { devices, ..self }
    }

    pub fn capacity(self, capacity: u64) -> Self {
        Setup { capacity, ..self }
    }

    pub fn granularity(self, granularity: u64) -> Self {
        Setup {
            granularity,
            ..self
        }
    }

    pub fn copy(self, copy: CopyConfig) -> Self {
        Setup {
            copy: Some(copy),
            ..self
        }
    }

    /// `threads` copy workers, and staging slots of 256 KiB and host chunks of 1 MiB: little
    /// data spans many pieces.
    pub fn small_pieces(self, threads: usize) -> Self {
        let mut cfg = CopyConfig {
            threads,
            ..CopyConfig::default()
        };
        cfg.layout.chunk = 1 << 20;
        cfg.slot = 256 << 10;
        self.copy(cfg)
    }

    /// A disk backup folder of the test's own.
    pub fn disk(self) -> Self {
        Setup { disk: true, ..self }
    }

    /// `devices` simulated devices of 256 MiB, `threads` copy workers, small staging slots
    /// (256 KiB) and disk chunks (1 MiB), so that little data spans many pieces, and a disk
    /// backup folder.
    pub fn disk_engine(devices: i32, threads: usize) -> Self {
        let mut cfg = CopyConfig {
            threads,
            ..CopyConfig::default()
        };
        cfg.slot = 256 << 10;
        cfg.disk_chunk = 1 << 20;
        Setup::default().devices(devices).copy(cfg).disk()
    }

    /// The simulated machine of this setup.
    pub fn sim(&self) -> Arc<SimDriver> {
        Arc::new(
            SimDriver::new(SimConfig {
                devices: self.devices,
                capacity: self.capacity,
                granularity: self.granularity,
            })
            .unwrap(),
        )
    }

    /// An engine on `driver` with this setup's copy settings (the disk folder is the caller's).
    pub fn engine(&self, driver: Arc<dyn tms::driver::Driver>) -> Arc<Engine> {
        let e = Arc::new(Engine::new(driver));
        if let Some(c) = self.copy {
            e.set_copy_config(c).unwrap();
        }
        e
    }
}

/// An engine on a fresh simulated machine of `setup` (which must not ask for a disk folder:
/// [`crate::common::harness::Harness::on_sim`] keeps one).
pub fn sim_engine(setup: &Setup) -> (Arc<SimDriver>, Arc<Engine>) {
    assert!(!setup.disk, "a disk folder needs a harness to keep it");
    let sim = setup.sim();
    let e = setup.engine(sim.clone());
    (sim, e)
}
