//! One test body, three drivers: [`engine_test!`] makes a `#[test]` that runs its body on the
//! simulated device, or on the CUDA driver when `TMS_TEST_DRIVER=cuda` (a GPU machine, with
//! binaries built by `scripts/engine-test-bins`), and a second one, `name::on_hip`, that runs it
//! on the HIP driver over the HIP test double (`hip.rs`: no AMD GPU; skipped on GPU runs). The
//! body reaches the device only through the [`Harness`], which on the sim and the double is
//! exact (raw access to device memory, their books) and on CUDA uses what the driver can tell:
//! copies through the engine, and device memory as `cuMemGetInfo` reports it, within
//! [`cuda_slack`] bytes. Under CUDA the tests of a binary run one at a time (one GPU; memory
//! measured by difference). The HIP driver frees and reserves again the address range of what
//! it pauses (its way around a ROCm 7.2 bug, on by default), so every body runs through that
//! too; `tests/hip.rs` has the double behave as ROCm 7.2 does.
//!
//! A test that needs the sim's hooks (faults, holds, bandwidth, capacity) is `sim_only`: under
//! CUDA it is skipped and says so, and it has no HIP twin.
//!
//! `TMS_TEST_DRIVER` other than `sim` or `cuda`, or `cuda` where no CUDA driver can be used,
//! ends the test binary at its first harness test with one message and exit status 2 (not a
//! failure per test).

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use tms::driver::cuda::CudaDriver;
use tms::driver::sim::SimDriver;
use tms::driver::{DeviceScope, Driver};
use tms::engine::Engine;

use super::hip::HipDouble;
use super::invariants::{check_books, check_registry, Books, Expect};
use super::setup::Setup;
use super::{read_books, write_books};

/// The environment variable that picks the driver: `sim` (the default) or `cuda`.
pub const DRIVER_VAR: &str = "TMS_TEST_DRIVER";
/// Bytes by which device memory measured on CUDA may differ from what the registry implies
/// (driver bookkeeping such as page tables); default [`DEFAULT_CUDA_SLACK`].
pub const SLACK_VAR: &str = "TMS_TEST_CUDA_SLACK";
pub const DEFAULT_CUDA_SLACK: u64 = 2 << 20;
/// Exit status of a test binary whose `TMS_TEST_DRIVER` cannot be served.
pub const UNSERVED: i32 = 2;

/// Which driver the engine tests run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sim,
    Cuda,
}

impl Kind {
    /// From `TMS_TEST_DRIVER`, read once.
    pub fn current() -> Kind {
        static KIND: OnceLock<Kind> = OnceLock::new();
        *KIND.get_or_init(|| match std::env::var(DRIVER_VAR).as_deref() {
            Err(std::env::VarError::NotPresent) | Ok("") | Ok("sim") => Kind::Sim,
            Ok("cuda") => Kind::Cuda,
            Ok(other) => stop(&format!(
                "{DRIVER_VAR}={other:?}: expected \"sim\" (the default) or \"cuda\""
            )),
            Err(e) => stop(&format!("{DRIVER_VAR}: {e}")),
        })
    }
}

/// End the test binary with one message (written past the test harness's output capture).
fn stop(msg: &str) -> ! {
    let _ = writeln!(std::io::stderr(), "error: {msg}");
    std::process::exit(UNSERVED);
}

/// The process's CUDA driver, loaded once; the binary ends if there is none.
fn cuda() -> Arc<CudaDriver> {
    static CUDA: OnceLock<Arc<CudaDriver>> = OnceLock::new();
    CUDA.get_or_init(|| match CudaDriver::load() {
        Ok(d) => Arc::new(d),
        Err(e) => stop(&format!(
            "{DRIVER_VAR}=cuda, but the CUDA driver cannot be used: {e} (these tests run on the \
             simulated device with {DRIVER_VAR} unset)"
        )),
    })
    .clone()
}

/// See [`SLACK_VAR`].
pub fn cuda_slack() -> u64 {
    match std::env::var(SLACK_VAR) {
        Ok(v) => {
            tms::units::parse_bytes(&v).unwrap_or_else(|e| stop(&format!("{SLACK_VAR}={v:?}: {e}")))
        }
        Err(_) => DEFAULT_CUDA_SLACK,
    }
}

/// Serializes the harness tests of a binary under CUDA.
static CUDA_SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Run `body` on the driver `TMS_TEST_DRIVER` picks (see [`engine_test!`]).
pub fn run(setup: Setup, body: impl FnOnce(Harness)) {
    let _serial = (Kind::current() == Kind::Cuda).then(|| CUDA_SERIAL.lock());
    body(Harness::new(&setup));
}

/// Whether the test `name` is skipped, for `why`: on a CUDA run, saying so.
fn skipped_on_cuda(name: &str, why: &str) -> bool {
    let skip = Kind::current() == Kind::Cuda;
    if skip {
        // Past the output capture: the GPU run's log tells what did not run there.
        let _ = writeln!(std::io::stderr(), "{name}: skipped on CUDA ({why})");
    }
    skip
}

/// Run `body` on the HIP driver over a fresh copy of the double; skipped under CUDA (a GPU run
/// is about the GPU; the CPU runs cover this).
pub fn run_hip(name: &str, setup: Setup, body: impl FnOnce(Harness)) {
    if !skipped_on_cuda(name, "it runs on the HIP test double on CPU runs") {
        body(Harness::on_hip(&setup));
    }
}

/// Run `body` on the sim; skipped under CUDA (see [`engine_test!`]).
pub fn run_sim_only(name: &str, setup: Setup, body: impl FnOnce(Harness)) {
    if !skipped_on_cuda(name, "it needs the simulated device's hooks") {
        body(Harness::on_sim(&setup));
    }
}

/// `engine_test! { fn name(h) [setup] { body } }`: a `#[test]` running `body` with `h`, a
/// [`Harness`] of `setup` (an expression; [`Setup::default`] if left out) on the driver
/// `TMS_TEST_DRIVER` picks, and `name::on_hip`, the same on the HIP driver over its test double
/// (the body is a function in a module `name`, which sees the file's names). `sim_only fn`
/// instead: on the sim only.
#[allow(unused_macros)]
macro_rules! engine_test {
    ($(#[$attr:meta])* fn $name:ident($h:ident) $([$setup:expr])? $body:block) => {
        $(#[$attr])*
        #[test]
        fn $name() {
            #[allow(unused_variables)]
            let setup = $crate::common::setup::Setup::default();
            $(let setup = $setup;)?
            $crate::common::harness::run(setup, $name::body)
        }

        mod $name {
            #[allow(unused_imports)]
            use super::*;

            pub(super) fn body($h: $crate::common::harness::Harness) $body

            $(#[$attr])*
            #[test]
            fn on_hip() {
                #[allow(unused_variables)]
                let setup = $crate::common::setup::Setup::default();
                $(let setup = $setup;)?
                $crate::common::harness::run_hip(concat!(stringify!($name), "::on_hip"), setup, body)
            }
        }
    };
    ($(#[$attr:meta])* sim_only fn $name:ident($h:ident) $([$setup:expr])? $body:block) => {
        $(#[$attr])*
        #[test]
        fn $name() {
            #[allow(unused_variables)]
            let setup = $crate::common::setup::Setup::default();
            $(let setup = $setup;)?
            $crate::common::harness::run_sim_only(
                stringify!($name),
                setup,
                |$h: $crate::common::harness::Harness| $body,
            )
        }
    };
}
#[allow(unused_imports)]
pub(crate) use engine_test;

/// Run `cases` cases of `strategy` through `test` (a property test inside a harness test, which
/// makes a fresh [`Harness::again`] per case), failing with the minimal failing input.
pub fn run_proptest<S: proptest::strategy::Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> proptest::test_runner::TestCaseResult,
) {
    let config = proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    if let Err(e) = runner.run(&strategy, test) {
        panic!("{e}");
    }
}

/// CUDA: the driver, and each device's free memory when the harness was made.
struct Gpu {
    driver: Arc<dyn Driver>,
    baseline: Vec<u64>,
}

impl Gpu {
    /// Device memory taken since the baseline (negative: given back).
    fn used(&self, device: i32) -> i64 {
        let free = self
            .driver
            .mem_info(device)
            .unwrap_or_else(|e| panic!("device {device}: {e}"))
            .free;
        self.baseline[device as usize] as i64 - free as i64
    }

    fn check_used(&self, device: i32, want: u64) -> Result<(), String> {
        let used = self.used(device);
        let slack = cuda_slack();
        if used.abs_diff(want as i64) > slack {
            return Err(format!(
                "device {device}: {used} bytes taken since the test began (cuMemGetInfo), \
                 expected {want} (within {slack} bytes, {SLACK_VAR})"
            ));
        }
        Ok(())
    }
}

/// One test's engine on the driver of the run, and how the test sees the device.
pub struct Harness {
    /// The engine under test.
    pub e: Arc<Engine>,
    setup: Setup,
    driver: Arc<dyn Driver>,
    sim: Option<Arc<SimDriver>>,
    gpu: Option<Gpu>,
    hip: Option<Arc<HipDouble>>,
    devices: i32,
    granularity: u64,
    dir: Option<tempfile::TempDir>,
}

impl Harness {
    /// An engine of `setup` on the driver `TMS_TEST_DRIVER` picks.
    pub fn new(setup: &Setup) -> Harness {
        match Kind::current() {
            Kind::Sim => Harness::on_sim(setup),
            Kind::Cuda => Harness::on_cuda(setup),
        }
    }

    /// An engine of `setup` on a fresh simulated machine.
    pub fn on_sim(setup: &Setup) -> Harness {
        let sim = setup.sim();
        let mut h = Harness::build(setup, sim.clone(), setup.devices);
        h.sim = Some(sim);
        h
    }

    /// An engine of `setup` on the HIP driver over a fresh copy of the test double, which
    /// behaves as HIP documents (`tests/hip.rs` has it behave as ROCm 7.2 does). The driver
    /// frees and reserves again the range of what it pauses, as it does by default.
    pub fn on_hip(setup: &Setup) -> Harness {
        let mut double = HipDouble::new(setup, 0);
        let driver = double
            .driver(true)
            .unwrap_or_else(|e| panic!("the HIP driver over the test double: {e}"));
        let mut h = Harness::build(setup, driver, setup.devices);
        h.hip = Some(Arc::new(double));
        h
    }

    fn on_cuda(setup: &Setup) -> Harness {
        let driver = cuda();
        let devices = setup
            .devices
            .min(driver.device_count().unwrap_or_else(|e| panic!("{e}")));
        let baseline = (0..devices)
            .map(|d| warm_up(&*driver, d).unwrap_or_else(|e| panic!("device {d}: {e}")))
            .collect();
        let gpu = Gpu {
            driver: driver.clone(),
            baseline,
        };
        let mut h = Harness::build(setup, driver, devices);
        h.gpu = Some(gpu);
        h
    }

    fn build(setup: &Setup, driver: Arc<dyn Driver>, devices: i32) -> Harness {
        let granularity = driver.granularity(0).unwrap();
        let e = setup.engine(driver.clone());
        let dir = setup.disk.then(|| tempfile::tempdir().unwrap());
        if let Some(d) = &dir {
            e.set_disk_backup_dir(Some(d.path().to_path_buf())).unwrap();
        }
        Harness {
            e,
            setup: setup.clone(),
            driver,
            sim: None,
            gpu: None,
            hip: None,
            devices,
            granularity,
            dir,
        }
    }

    /// A fresh engine (and on the sim or the double a fresh machine) of the same setup.
    pub fn again(&self) -> Harness {
        if self.sim.is_some() {
            Harness::on_sim(&self.setup)
        } else if self.hip.is_some() {
            Harness::on_hip(&self.setup)
        } else {
            Harness::on_cuda(&self.setup)
        }
    }

    pub fn is_cuda(&self) -> bool {
        self.gpu.is_some()
    }

    /// On the HIP driver over its test double.
    pub fn is_hip(&self) -> bool {
        self.hip.is_some()
    }

    /// `sim` on the simulated device and the HIP double (small machines), `cuda` on a GPU
    /// (sizes, timeouts, case counts).
    pub fn pick<T>(&self, sim: T, cuda: T) -> T {
        if self.is_cuda() {
            cuda
        } else {
            sim
        }
    }

    /// The HIP test double, on the HIP driver (`None` elsewhere).
    pub fn hip(&self) -> Option<&Arc<HipDouble>> {
        self.hip.as_ref()
    }

    /// The device's books where a test can read them exactly (the sim, the HIP double).
    fn books(&self) -> Option<&dyn Books> {
        match (&self.sim, &self.hip) {
            (Some(sim), _) => Some(&**sim),
            (None, Some(hip)) => Some(&**hip),
            (None, None) => None,
        }
    }

    /// The simulated device, for checks only it can answer (`None` on CUDA).
    pub fn sim(&self) -> Option<&Arc<SimDriver>> {
        self.sim.as_ref()
    }

    /// The simulated device of a `sim_only` test.
    pub fn simulated(&self) -> &Arc<SimDriver> {
        self.sim
            .as_ref()
            .expect("this test needs the simulated device: make it sim_only")
    }

    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The driver's granularity: the sim's of the setup, the GPU's on CUDA (2 MiB on an H200).
    pub fn g(&self) -> u64 {
        self.granularity
    }

    /// Devices the test may use: those of the setup, at most the GPUs there are.
    pub fn devices(&self) -> i32 {
        self.devices
    }

    /// Device `k` of the setup, folded onto the devices there are.
    pub fn device(&self, k: i32) -> i32 {
        k % self.devices
    }

    /// The disk backup folder of a setup that asked for one.
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .expect("the setup has no disk folder")
            .path()
    }

    /// Write `data` to active device memory at `addr` (on the sim and the HIP double straight
    /// into its memory, calling no driver primitive; on CUDA through the engine, which refuses
    /// paused ranges).
    pub fn write(&self, addr: u64, data: &[u8]) {
        match self.books() {
            Some(dev) => write_books(dev, addr, data),
            None => self
                .e
                .write_bytes(addr, data)
                .unwrap_or_else(|e| panic!("writing {addr:#x}+{}: {e}", data.len())),
        }
    }

    /// Read `len` bytes of active device memory at `addr` (as [`Harness::write`]).
    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        match self.books() {
            Some(dev) => read_books(dev, addr, len),
            None => {
                let mut v = vec![0u8; len];
                self.e
                    .read_bytes(addr, &mut v)
                    .unwrap_or_else(|e| panic!("reading {addr:#x}+{len}: {e}"));
                v
            }
        }
    }

    /// Whether `addr` is mapped and accessible, where the device can tell (the sim, the double).
    pub fn accessible(&self, addr: u64) -> Option<bool> {
        self.books().map(|d| d.accessible(addr))
    }

    /// On the sim and the double: the first and last byte of `[addr, addr+len)` are accessible,
    /// or neither (`want` false). Nothing on CUDA, which cannot tell without touching the range.
    pub fn assert_accessible(&self, addr: u64, len: u64, want: bool, ctx: &str) {
        if let Some(dev) = self.books() {
            let got = (dev.accessible(addr), dev.accessible(addr + len - 1));
            assert_eq!(
                got,
                (want, want),
                "{ctx}: {addr:#x}+{len} accessible (first and last byte)"
            );
        }
    }

    /// Device bytes in use on `device`: the sim's or the double's live bytes, or on CUDA what
    /// `cuMemGetInfo` says was taken since the harness was made.
    pub fn live_bytes(&self, device: i32) -> u64 {
        match (self.books(), &self.gpu) {
            (Some(dev), _) => dev.live_bytes(device),
            (None, Some(gpu)) => gpu.used(device).max(0) as u64,
            (None, None) => unreachable!(),
        }
    }

    /// `device` holds `want` bytes: exactly on the sim and the double, within [`cuda_slack`]
    /// on CUDA.
    pub fn check_live_bytes(&self, device: i32, want: u64) -> Result<(), String> {
        match (self.books(), &self.gpu) {
            (Some(dev), _) => match dev.live_bytes(device) {
                got if got == want => Ok(()),
                got => Err(format!(
                    "device {device} holds {got} bytes, expected {want}"
                )),
            },
            (None, Some(gpu)) => gpu.check_used(device, want),
            (None, None) => unreachable!(),
        }
    }

    /// [`Harness::check_live_bytes`]; on the sim and the double an `assert_eq!` of the live
    /// bytes.
    pub fn assert_live_bytes(&self, device: i32, want: u64, ctx: &str) {
        match self.books() {
            Some(dev) => assert_eq!(dev.live_bytes(device), want, "{ctx}"),
            None => {
                if let Err(m) = self.check_live_bytes(device, want) {
                    panic!("{ctx}: {m}");
                }
            }
        }
    }

    /// The registry tells the truth: on the sim and the double, [`check_books`] with `expect`;
    /// on CUDA, every allocation settled and each device holding the registry's active bytes.
    pub fn check_invariants(&self, expect: &Expect) -> Result<(), String> {
        match (self.books(), &self.gpu) {
            (Some(dev), _) => check_books(&self.e, dev, expect),
            (None, Some(gpu)) => {
                let infos = check_registry(&self.e)?;
                for d in 0..self.devices {
                    let active = infos
                        .iter()
                        .filter(|i| i.device == d)
                        .map(|i| i.active_bytes)
                        .sum();
                    gpu.check_used(d, active)?;
                }
                Ok(())
            }
            (None, None) => unreachable!(),
        }
    }

    /// [`Harness::check_invariants`], failing the test with `ctx`.
    pub fn assert_invariants(&self, expect: &Expect, ctx: &str) {
        if let Err(m) = self.check_invariants(expect) {
            panic!("{ctx}: {m}");
        }
    }

    /// The engine holds nothing on the device (see [`Ended::released`]), and no allocation,
    /// once at rest: host memory a resume gives back after it returned goes first, as in
    /// `check_books`.
    pub fn assert_nothing_held(&self, ctx: &str) {
        assert!(self.e.allocations().is_empty(), "{ctx}: allocations left");
        self.e.wait_released();
        if let Err(m) = nothing_held(self.books(), self.gpu.as_ref()) {
            panic!("{ctx}: {m}");
        }
    }

    /// Drop the engine (every other holder of it must be gone), keeping the device and the
    /// folder to check what it left.
    pub fn end(self) -> Ended {
        let Harness {
            e,
            sim,
            gpu,
            hip,
            dir,
            ..
        } = self;
        let e = Arc::try_unwrap(e)
            .unwrap_or_else(|_| panic!("the engine is still shared when the test ends it"));
        drop(e);
        Ended { sim, gpu, hip, dir }
    }
}

/// On the sim and the double no device memory, handle, mapping, reservation or page-locked
/// byte; on CUDA no device memory taken since the harness was made.
fn nothing_held(dev: Option<&dyn Books>, gpu: Option<&Gpu>) -> Result<(), String> {
    if let Some(dev) = dev {
        let live: Vec<u64> = (0..dev.devices()).map(|d| dev.live_bytes(d)).collect();
        let left = (
            dev.live_handles(),
            dev.live_mappings(),
            dev.live_reservations(),
            dev.pinned_bytes(),
        );
        if live.iter().any(|b| *b != 0) || left != (0, 0, 0, 0) {
            return Err(format!(
                "held: live bytes {live:?}, (handles, mappings, reservations, pinned bytes) \
                 {left:?}"
            ));
        }
    }
    if let Some(gpu) = gpu {
        for d in 0..gpu.baseline.len() as i32 {
            gpu.check_used(d, 0)?;
        }
    }
    Ok(())
}

/// Make `device`'s context, stream and the driver's first VMM structures, and return its free
/// memory after that: the baseline a test's memory is measured from.
fn warm_up(d: &dyn Driver, device: i32) -> tms::Result<u64> {
    let _scope = DeviceScope::enter(d, device)?;
    let s = d.stream(device)?;
    let ev = d.event_create(device)?;
    d.event_record(ev, s)?;
    d.event_sync(ev)?;
    d.event_destroy(ev);
    let g = d.granularity(device)?;
    let ptr = d.reserve(device, g)?;
    let h = d.create(device, g)?;
    d.map(ptr, g, h)?;
    d.set_access(device, ptr, g)?;
    d.synchronize(device)?;
    d.unmap(ptr, g)?;
    d.release(h)?;
    d.free_range(ptr, g)?;
    // The digest kernel and its scratch buffer stay loaded once a check first needs them (a
    // few MiB the registry does not count): in the baseline, not in the first test to check.
    d.prepare_digest(device)?;
    Ok(d.mem_info(device)?.free)
}

/// What is left once a test ended its engine.
pub struct Ended {
    sim: Option<Arc<SimDriver>>,
    gpu: Option<Gpu>,
    hip: Option<Arc<HipDouble>>,
    dir: Option<tempfile::TempDir>,
}

impl Ended {
    pub fn sim(&self) -> Option<&Arc<SimDriver>> {
        self.sim.as_ref()
    }

    /// The disk folder of the setup (the engine's files were to go with it).
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .expect("the setup has no disk folder")
            .path()
    }

    /// Files left in the disk folder.
    pub fn files(&self) -> usize {
        std::fs::read_dir(self.dir()).unwrap().count()
    }

    /// Everything the engine held is given back: on the sim and the double no device memory,
    /// handle, mapping, reservation or page-locked byte; on CUDA device memory back to where it
    /// began.
    pub fn released(&self) -> Result<(), String> {
        let dev: Option<&dyn Books> = match (&self.sim, &self.hip) {
            (Some(sim), _) => Some(&**sim),
            (None, Some(hip)) => Some(&**hip),
            (None, None) => None,
        };
        nothing_held(dev, self.gpu.as_ref())
    }

    pub fn assert_released(&self, ctx: &str) {
        if let Err(m) = self.released() {
            panic!("{ctx}: {m}");
        }
    }
}
