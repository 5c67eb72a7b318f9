//! The one process-wide engine and driver, created on first use from whichever entry point
//! comes first (a hook inside a region, or the C ABI). Nothing happens at load time.

use std::sync::{Arc, OnceLock};

use super::settings::{self, BackendChoice, StickyError};
use crate::driver::cuda::CudaDriver;
use crate::driver::hip::{HipDriver, HipSettings};
use crate::driver::sim::SimDriver;
use crate::driver::Driver;
use crate::engine::{Comms, Engine};
use crate::error::{Error, Result};

/// The process-wide state.
pub struct Runtime {
    /// The engine, over the chosen driver.
    pub engine: Engine,
}

static RUNTIME: OnceLock<std::result::Result<Runtime, StickyError>> = OnceLock::new();

/// True in a child created by `fork` after the library's first use began: it shares none of the
/// parent's device mappings, so the library stays out of its way for good (hooks pass through,
/// the API reports the state). See `fork.rs`.
pub fn forked() -> bool {
    super::fork::forked()
}

/// Log to stderr as `TMS_LOG` (a tracing filter) and `TMS_LOG_FORMAT` ask; nothing when
/// `TMS_LOG` is unset. The tools built on the engine call it too.
pub fn init_logging() {
    super::logging::init(|| get_if_started().and_then(|r| r.engine.sole_device()));
}

/// Open the driver `choice` names. Auto: CUDA where its driver library opens (whether or not
/// it then starts), else HIP where its runtime opens.
pub fn open_driver(choice: BackendChoice) -> Result<Arc<dyn Driver>> {
    Ok(match choice {
        BackendChoice::Sim => Arc::new(SimDriver::from_env()?),
        BackendChoice::Cuda => Arc::new(CudaDriver::load()?),
        BackendChoice::Hip => Arc::new(HipDriver::load()?),
        BackendChoice::Auto if CudaDriver::present() => Arc::new(CudaDriver::load()?),
        BackendChoice::Auto => match HipDriver::find(&HipSettings::from_env()?)? {
            Some(d) => Arc::new(d),
            None => {
                return Err(Error::unsupported(
                    "neither the CUDA driver library (libcuda.so.1) nor the HIP runtime \
                     (libamdhip64.so) could be opened; set TMS_BACKEND=sim to use the simulated \
                     device",
                ))
            }
        },
    })
}

fn init() -> Result<Runtime> {
    init_logging();
    let ps = settings::process()?;
    let driver = open_driver(ps.backend)?;
    driver.set_memory_flags(ps.memory);
    let comms: Arc<dyn Comms> = crate::nccl::communicators().clone();
    let engine = Engine::new(driver).with_comms(comms);
    engine.set_nccl_in_all(ps.nccl_in_all);
    engine.set_checks(None, ps.checks);
    engine.set_registered_policy(ps.nccl_registered);
    engine.set_retain_cpu_backup(ps.retain_cpu_backup);
    engine.set_memory_margin(ps.memory_margin);
    engine.set_copy_config(ps.copy)?;
    engine
        .set_default_disk_backup_dir(ps.disk_dir.clone())
        .map_err(|e| e.context("environment variable TMS_DISK_BACKUP_DIR"))?;
    for (op, nth, errno) in &ps.disk_faults {
        crate::backup::disk::arm_fault(None, *op, *nth, *errno);
    }
    // Only now, in a process that uses the library: its files in shared folders must not
    // outlive a SIGTERM (Note [Removal at exit and on a termination signal] in os.rs).
    crate::os::remove_files_on_termination_signals();
    tracing::info!(
        "torch-memory-saver active on the {} driver",
        engine.driver().name()
    );
    Ok(Runtime { engine })
}

/// The runtime, created on the first call; a failure is kept and returned to every caller.
/// Entry points call the control layer's `runtime()` instead, which also starts the server.
pub fn get() -> Result<&'static Runtime> {
    if forked() {
        return Err(Error::invalid_state(
            "torch-memory-saver is disabled in this process: it was forked from one that used it",
        ));
    }
    super::fork::note_first_use();
    RUNTIME
        .get_or_init(|| {
            init().map_err(|e| {
                let e = e.context("starting torch-memory-saver");
                tracing::error!("{e}");
                StickyError::from(&e)
            })
        })
        .as_ref()
        .map_err(StickyError::to_error)
}

/// The runtime if it was already created successfully (never creates it).
pub fn get_if_started() -> Option<&'static Runtime> {
    if forked() {
        return None;
    }
    RUNTIME.get().and_then(|r| r.as_ref().ok())
}
