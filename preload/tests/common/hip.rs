//! The HIP test double (`tests/hip/libamdhip64.c`, a HIP-shaped runtime over host memory),
//! built with the system `cc` once per test binary, and one fresh copy of it per harness: each
//! copy is a library of its own to the loader, with its own machine, so tests run in parallel
//! as they do on the sim. The file of a copy is removed once it is loaded (the loader keeps its
//! mapping).

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use libloading::os::unix::Library;
use tms::driver::hip::HipDriver;

use super::invariants::Books;
use super::setup::Setup;

/// The double's source.
pub const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/hip/libamdhip64.c");

/// `hipMemRelease` keeps memory while its range stays reserved (ROCm 7.2).
pub const QUIRK_RELEASE_HOLDS: u32 = 1;
/// `hipMemAddressReserve` never gives the address asked for (as if another reservation had it).
pub const QUIRK_IGNORE_ADDRESS: u32 = 2;
/// `hipMemSetAccess` refuses a range that does not start its reservation (ROCm 7.2).
pub const QUIRK_TAIL_ACCESS: u32 = 4;

/// `hipDeviceAttributeVirtualMemoryManagementSupported`, `hipDeviceAttributeCanUseStreamWaitValue`.
pub const ATTR_VMM: c_int = 89;
pub const ATTR_STREAM_WAIT: c_int = 10013;

/// The double's books (`struct hipsim_counts`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub handles: u64,
    pub mappings: u64,
    pub reservations: u64,
    pub pinned_bytes: u64,
    pub host_allocs: u64,
    pub pageable: u64,
    pub malloc_live: u64,
    pub malloc_calls: u64,
    pub free_calls: u64,
    pub foreign_frees: u64,
}

/// The double's bytes, built once per test binary.
fn built() -> &'static [u8] {
    static BUILT: OnceLock<Vec<u8>> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let out = dir.path().join("libamdhip64.so");
        let r = Command::new("cc")
            .args([
                "-std=gnu11",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-O1",
                "-shared",
                "-fPIC",
            ])
            .args(["-Wl,-soname,libamdhip64.so", "-o"])
            .arg(&out)
            .arg(SOURCE)
            .output()
            .unwrap_or_else(|e| panic!("running `cc` to build the HIP test double: {e}"));
        assert!(
            r.status.success(),
            "cc failed to build the HIP test double {SOURCE}:\n{}",
            String::from_utf8_lossy(&r.stderr)
        );
        std::fs::read(&out).expect("read the built double")
    })
}

/// One copy of the double: its own state, shaped at creation.
pub struct HipDouble {
    lib: Library,
    path: PathBuf,
    /// Where the copy's file was (removed once a driver has loaded it).
    dir: Option<tempfile::TempDir>,
}

/// The double's function `name`, as a `T`.
///
/// # Safety
/// `T` is the C type of the double's function `name`.
unsafe fn func<T: Copy>(lib: &Library, name: &str) -> T {
    // SAFETY: our caller's promise.
    *unsafe { lib.get::<T>(name) }.unwrap_or_else(|e| panic!("the HIP double lacks {name}: {e}"))
}

impl HipDouble {
    /// A fresh copy with `setup`'s devices, capacity and granularity (its minimum and
    /// recommended granularity both), and `quirks`.
    pub fn new(setup: &Setup, quirks: u32) -> HipDouble {
        Self::with_granularity(setup, setup.granularity, quirks)
    }

    /// [`HipDouble::new`] recommending `recommended` bytes (a multiple of the minimum).
    pub fn with_granularity(setup: &Setup, recommended: u64, quirks: u32) -> HipDouble {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = tempfile::tempdir().expect("a temporary folder");
        let path = dir.path().join(format!(
            "libamdhip64-{}.so",
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, built()).expect("write a copy of the double");
        // SAFETY: the double's initialisers do nothing.
        let lib = unsafe { Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_LOCAL) }
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        let d = HipDouble {
            lib,
            path,
            dir: Some(dir),
        };
        type Configure = unsafe extern "C" fn(c_int, u64, u64, u64) -> c_int;
        // SAFETY: `int hipsim_configure(int, uint64_t, uint64_t, uint64_t)`.
        let configure: Configure = unsafe { func(&d.lib, "hipsim_configure") };
        // SAFETY: plain values; the copy is fresh, so not initialised yet.
        let bad = unsafe {
            configure(
                setup.devices,
                setup.capacity,
                setup.granularity,
                recommended,
            )
        };
        assert_eq!(bad, 0, "the double refused the shape {setup:?}");
        d.set_quirks(quirks);
        d
    }

    /// The library's path, for [`HipDriver::load_from`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The HIP driver over this copy (`reserve_again`: `TMS_HIP_RESERVE_AGAIN`); the copy's
    /// file goes once it is loaded.
    pub fn driver(&mut self, reserve_again: bool) -> tms::Result<Arc<HipDriver>> {
        let d = HipDriver::load_from(self.path.to_str().expect("UTF-8 path"), reserve_again);
        self.dir = None;
        d.map(Arc::new)
    }

    pub fn set_quirks(&self, quirks: u32) {
        // SAFETY: `void hipsim_set_quirks(unsigned)`.
        let f: unsafe extern "C" fn(u32) = unsafe { func(&self.lib, "hipsim_set_quirks") };
        // SAFETY: a plain value.
        unsafe { f(quirks) }
    }

    /// Make every copy take as long as `bytes_per_second` says (0: no limit).
    pub fn set_bandwidth(&self, bytes_per_second: u64) {
        // SAFETY: `void hipsim_set_bandwidth(uint64_t)`.
        let f: unsafe extern "C" fn(u64) = unsafe { func(&self.lib, "hipsim_set_bandwidth") };
        // SAFETY: a plain value.
        unsafe { f(bytes_per_second) }
    }

    pub fn set_attribute(&self, attr: c_int, value: c_int) {
        // SAFETY: `void hipsim_set_attribute(int, int)`.
        let f: unsafe extern "C" fn(c_int, c_int) =
            unsafe { func(&self.lib, "hipsim_set_attribute") };
        // SAFETY: plain values.
        unsafe { f(attr, value) }
    }

    /// Make the `nth` call (1 = the next) of the HIP function `call` return `code`.
    pub fn fail(&self, call: &str, nth: i64, code: c_int) {
        // SAFETY: `void hipsim_fail(const char *, long, int)`.
        let f: unsafe extern "C" fn(*const c_char, i64, c_int) =
            unsafe { func(&self.lib, "hipsim_fail") };
        let c = CString::new(call).unwrap();
        // SAFETY: c is a NUL-terminated string that outlives the call, which copies it.
        unsafe { f(c.as_ptr(), nth, code) }
    }

    /// How often the HIP function `call` was called.
    pub fn calls(&self, call: &str) -> i64 {
        // SAFETY: `long hipsim_calls(const char *)`.
        let f: unsafe extern "C" fn(*const c_char) -> i64 =
            unsafe { func(&self.lib, "hipsim_calls") };
        let c = CString::new(call).unwrap();
        // SAFETY: c is a NUL-terminated string that outlives the call.
        unsafe { f(c.as_ptr()) }
    }

    pub fn counts(&self) -> Counts {
        // SAFETY: `void hipsim_counts(struct hipsim_counts *)`, which Counts mirrors.
        let f: unsafe extern "C" fn(*mut Counts) = unsafe { func(&self.lib, "hipsim_counts") };
        let mut c = Counts::default();
        // SAFETY: &mut c is a valid struct of the double's layout to write.
        unsafe { f(&mut c) };
        c
    }

    /// Physical bytes not given back on `device`.
    pub fn live(&self, device: i32) -> u64 {
        // SAFETY: `uint64_t hipsim_live_bytes(int)`.
        let f: unsafe extern "C" fn(c_int) -> u64 = unsafe { func(&self.lib, "hipsim_live_bytes") };
        // SAFETY: a plain value.
        unsafe { f(device) }
    }

    /// Whether `[addr, addr+len)` is mapped read/write.
    pub fn is_accessible(&self, addr: u64, len: u64) -> bool {
        // SAFETY: `int hipsim_accessible(uintptr_t, size_t)`.
        let f: unsafe extern "C" fn(usize, usize) -> c_int =
            unsafe { func(&self.lib, "hipsim_accessible") };
        // SAFETY: plain values; the double only looks the range up.
        unsafe { f(addr as usize, len as usize) != 0 }
    }

    /// Devices of the copy.
    pub fn devices(&self) -> i32 {
        let mut n = 0;
        // SAFETY: `hipError_t hipGetDeviceCount(int *)`.
        let f: unsafe extern "C" fn(*mut c_int) -> c_int =
            unsafe { func(&self.lib, "hipGetDeviceCount") };
        // SAFETY: &mut n is a valid int to write.
        unsafe { f(&mut n) };
        n
    }
}

impl Books for HipDouble {
    fn what(&self) -> &'static str {
        "the HIP double"
    }
    fn devices(&self) -> i32 {
        HipDouble::devices(self)
    }
    fn accessible(&self, addr: u64) -> bool {
        self.is_accessible(addr, 1)
    }
    fn live_bytes(&self, device: i32) -> u64 {
        self.live(device)
    }
    fn live_mappings(&self) -> usize {
        self.counts().mappings as usize
    }
    fn live_handles(&self) -> usize {
        self.counts().handles as usize
    }
    fn live_reservations(&self) -> usize {
        self.counts().reservations as usize
    }
    fn pinned_bytes(&self) -> u64 {
        self.counts().pinned_bytes
    }
    fn queued_copies(&self) -> usize {
        // Copies run when queued.
        0
    }
    fn pageable_copies(&self) -> u64 {
        self.counts().pageable
    }
}
