//! `cudaMalloc`/`cudaFree` and `hipMalloc`/`hipFree` interposers (preload mode) and PyTorch's
//! pluggable-allocator entry points (torch mode).
//!
//! Outside a region the interposers hand the call to the next definition in link order (the
//! real CUDA or HIP runtime), found with `dlsym(RTLD_NEXT)`. Inside one, allocations come from
//! the engine, which uses only the driver API, so it never calls back into `cudaMalloc` or
//! `hipMalloc`. A per-thread reentrancy flag makes any nested call pass through regardless.
//! The HIP runtime's status codes are the CUDA runtime's numbers for every status returned
//! here (success 0, invalid value 1, out of memory 2, not initialized 3, unknown 999).

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use libc::ssize_t;

use crate::control;
use crate::engine::AllocRequest;
use crate::error::{Error, ErrorKind};
use crate::process::boundary::{catch, set_last_error};
use crate::process::{logging, runtime, settings};

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_MEMORY_ALLOCATION: c_int = 2;
const CUDA_ERROR_INITIALIZATION: c_int = 3;
const CUDA_ERROR_UNKNOWN: c_int = 999;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;

pub(super) use crate::threads::Reentry;

/// The runtime whose allocation calls an interposer stands in for.
#[derive(Clone, Copy)]
enum Rt {
    Cuda,
    Hip,
}

/// The runtimes' `malloc` and `free`, once found.
static SLOTS: [[OnceLock<usize>; 2]; 2] = [
    [OnceLock::new(), OnceLock::new()],
    [OnceLock::new(), OnceLock::new()],
];

impl Rt {
    /// Its `malloc` and `free` entry points.
    fn names(self) -> [&'static CStr; 2] {
        match self {
            Rt::Cuda => [c"cudaMalloc", c"cudaFree"],
            Rt::Hip => [c"hipMalloc", c"hipFree"],
        }
    }

    /// What the library defining them is called (a part of its file name).
    fn library(self) -> &'static [u8] {
        match self {
            Rt::Cuda => b"libcudart",
            Rt::Hip => b"libamdhip64",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Rt::Cuda => "CUDA runtime",
            Rt::Hip => "HIP runtime",
        }
    }

    /// Our own interposers, never the answer of a look-up.
    fn ours(self) -> [usize; 2] {
        match self {
            Rt::Cuda => [
                cudaMalloc as *const () as usize,
                cudaFree as *const () as usize,
            ],
            Rt::Hip => [
                hipMalloc as *const () as usize,
                hipFree as *const () as usize,
            ],
        }
    }

    /// The runtime's entry point `k` (0: malloc, 1: free), 0 where none is loaded. Not cached
    /// when absent: the runtime may be loaded later (or promoted to global scope).
    fn next_symbol(self, k: usize) -> usize {
        let slot = &SLOTS[self as usize][k];
        if let Some(p) = slot.get() {
            return *p;
        }
        match self.find_symbol(self.names()[k]) {
            0 => 0,
            p => *slot.get_or_init(|| p),
        }
    }

    /// The runtime's definition of `name`: the next one in link order, or, when the runtime
    /// was loaded into a local scope (a dependency of a library opened with `RTLD_LOCAL`, as
    /// Python extension modules are), the one in any loaded copy of the runtime's library.
    fn find_symbol(self, name: &'static CStr) -> usize {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name only looks the symbol up.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        if p != 0 {
            return p;
        }
        for lib in crate::os::loaded_objects(self.library()) {
            // SAFETY: RTLD_NOLOAD only returns a handle to an object that is already loaded.
            let h = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            if h.is_null() {
                continue;
            }
            // SAFETY: h is a valid handle; the lookup has no side effects. The handle's extra
            // reference is dropped right after: the object stays loaded by its original owner.
            let p = unsafe {
                let p = libc::dlsym(h, name.as_ptr()) as usize;
                libc::dlclose(h);
                p
            };
            if p != 0 && !self.ours().contains(&p) {
                return p;
            }
        }
        0
    }

    /// No runtime below provides entry point `k`: say so, as the runtime would not start.
    fn missing(self, k: usize) -> c_int {
        set_last_error(&Error::unsupported(format!(
            "no {} below torch-memory-saver provides {}",
            self.what(),
            self.names()[k].to_string_lossy()
        )));
        CUDA_ERROR_INITIALIZATION
    }
}

fn real_malloc(rt: Rt, dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    match rt.next_symbol(0) {
        0 => rt.missing(0),
        // SAFETY: p is the runtime's next malloc in link order, with the runtime's signature.
        p => unsafe { std::mem::transmute::<usize, MallocFn>(p)(dev_ptr, size) },
    }
}

fn real_free(rt: Rt, ptr: *mut c_void) -> c_int {
    match rt.next_symbol(1) {
        0 => rt.missing(1),
        // SAFETY: p is the runtime's next free in link order, with the runtime's signature.
        p => unsafe { std::mem::transmute::<usize, FreeFn>(p)(ptr) },
    }
}

/// Print a failure the user must know about (bad settings, a runtime that cannot start) once
/// per kind; hooks cannot return a message, only a status.
fn report_once(once: &'static std::sync::Once, e: &Error) {
    once.call_once(|| logging::say(&format!("torch-memory-saver: {e}")));
}

static SETTINGS_REPORTED: std::sync::Once = std::sync::Once::new();
static STARTUP_REPORTED: std::sync::Once = std::sync::Once::new();

/// Allocate from the engine with the thread's region settings; a CUDA runtime status.
fn engine_alloc(size: usize, device: Option<i32>) -> Result<*mut c_void, (c_int, Error)> {
    let fail = |code| move |e: Error| (code, e);
    // Said here too: PyTorch's allocator meets it first in torch mode, and reads no message.
    let region = settings::current_region().map_err(|e| {
        report_once(&SETTINGS_REPORTED, &e);
        (CUDA_ERROR_INVALID_VALUE, e)
    })?;
    let rt = control::runtime().map_err(|e| {
        report_once(&STARTUP_REPORTED, &e);
        (CUDA_ERROR_INITIALIZATION, e)
    })?;
    let torch_pool = device.is_some();
    let device = match device {
        Some(d) => d,
        None => rt
            .engine
            .driver()
            .current_device()
            .map_err(fail(CUDA_ERROR_UNKNOWN))?,
    };
    let req = AllocRequest {
        size: size as u64,
        device,
        tag: region.tag.clone(),
        backup: region.backup(),
        chunk: region.chunk,
    };
    // The pluggable allocator serves every allocation of its pool, also those made inside
    // `disable()`: those are real memory that pause leaves alone.
    let made = if torch_pool && !region.enabled {
        rt.engine.alloc_unpauseable(&req)
    } else {
        rt.engine.alloc(&req)
    };
    match made {
        Ok(p) => Ok(p as *mut c_void),
        Err(e) if e.is_oom() => Err((CUDA_ERROR_MEMORY_ALLOCATION, e)),
        Err(e) if *e.kind() == ErrorKind::InvalidArgument => Err((CUDA_ERROR_INVALID_VALUE, e)),
        Err(e) => {
            tracing::error!("{e}");
            Err((CUDA_ERROR_UNKNOWN, e))
        }
    }
}

fn malloc_impl(rt: Rt, dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    let Some(_guard) = Reentry::enter() else {
        return real_malloc(rt, dev_ptr, size);
    };
    if dev_ptr.is_null() || runtime::forked() {
        return real_malloc(rt, dev_ptr, size);
    }
    match settings::in_region() {
        Ok(true) => {}
        Ok(false) => return real_malloc(rt, dev_ptr, size),
        Err(e) => {
            // Malformed TMS_* settings: say so once, then stay out of the way.
            report_once(&SETTINGS_REPORTED, &e);
            return real_malloc(rt, dev_ptr, size);
        }
    }
    if size == 0 {
        // SAFETY: dev_ptr is non-null (checked) and points to the caller's out-parameter.
        unsafe { *dev_ptr = std::ptr::null_mut() };
        return CUDA_SUCCESS;
    }
    match engine_alloc(size, None) {
        Ok(p) => {
            // SAFETY: as above.
            unsafe { *dev_ptr = p };
            CUDA_SUCCESS
        }
        Err((code, e)) => {
            set_last_error(&e);
            code
        }
    }
}

fn free_impl(rt: Rt, ptr: *mut c_void) -> c_int {
    let Some(_guard) = Reentry::enter() else {
        return real_free(rt, ptr);
    };
    if ptr.is_null() {
        return real_free(rt, ptr);
    }
    // Never start the runtime just to free: if it never started, nothing here is ours.
    let Some(run) = runtime::get_if_started() else {
        return real_free(rt, ptr);
    };
    match run.engine.free(ptr as u64) {
        Ok(true) => CUDA_SUCCESS,
        Ok(false) => real_free(rt, ptr),
        Err(e) => {
            tracing::error!("{e}");
            set_last_error(&e);
            CUDA_ERROR_UNKNOWN
        }
    }
}

/// Interposed `cudaMalloc`: pauseable memory inside a region, the real runtime's outside (2 =
/// `cudaErrorMemoryAllocation` when pauseable memory runs out, with the reason in
/// `tms_last_error()`).
///
/// # Safety
/// As the CUDA runtime's `cudaMalloc`: `dev_ptr` points to writable storage for one pointer.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    catch(CUDA_ERROR_UNKNOWN, || malloc_impl(Rt::Cuda, dev_ptr, size))
}

/// Interposed `cudaFree`: frees pauseable allocations, hands every other pointer to the runtime.
///
/// # Safety
/// As the CUDA runtime's `cudaFree`.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    catch(CUDA_ERROR_UNKNOWN, || free_impl(Rt::Cuda, ptr))
}

/// Interposed `hipMalloc`: pauseable memory inside a region, the real HIP runtime's outside (2 =
/// `hipErrorOutOfMemory` when pauseable memory runs out, with the reason in
/// `tms_last_error()`).
///
/// # Safety
/// As the HIP runtime's `hipMalloc`: `ptr` points to writable storage for one pointer.
#[no_mangle]
pub unsafe extern "C" fn hipMalloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    catch(CUDA_ERROR_UNKNOWN, || malloc_impl(Rt::Hip, ptr, size))
}

/// Interposed `hipFree`: frees pauseable allocations, hands every other pointer to the HIP
/// runtime.
///
/// # Safety
/// As the HIP runtime's `hipFree`.
#[no_mangle]
pub unsafe extern "C" fn hipFree(ptr: *mut c_void) -> c_int {
    catch(CUDA_ERROR_UNKNOWN, || free_impl(Rt::Hip, ptr))
}

/// PyTorch's pluggable-allocator `malloc`: allocate `size` bytes of pauseable memory on `device`,
/// with the calling thread's region tag and backup settings; outside a region (unless
/// `TMS_INIT_ENABLE` puts every thread in one) and inside a disabled scope, Python's
/// `disable()`, real memory that pause leaves alone.
/// Returns NULL on failure (PyTorch raises out-of-memory), with the reason in the thread's last
/// error. `stream` is ignored.
#[no_mangle]
pub extern "C" fn tms_torch_malloc(
    size: ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // The device's memory serves every stream.
    let _ = stream;
    catch(std::ptr::null_mut(), || {
        let Some(_guard) = Reentry::enter() else {
            return std::ptr::null_mut();
        };
        if size <= 0 {
            if size < 0 {
                set_last_error(&Error::invalid_argument(format!(
                    "allocation of {size} bytes"
                )));
            }
            return std::ptr::null_mut();
        }
        match engine_alloc(size as usize, Some(device)) {
            Ok(p) => p,
            Err((_, e)) => {
                set_last_error(&e);
                std::ptr::null_mut()
            }
        }
    })
}

/// PyTorch's pluggable-allocator `free`: free memory from `tms_torch_malloc`; `size`, `device`
/// and `stream` are ignored.
#[no_mangle]
pub extern "C" fn tms_torch_free(
    ptr: *mut c_void,
    size: ssize_t,
    device: c_int,
    stream: *mut c_void,
) {
    // The library's own record of the allocation is what counts.
    let _ = (size, device, stream);
    catch((), || {
        if ptr.is_null() {
            return;
        }
        let Some(_guard) = Reentry::enter() else {
            return;
        };
        match runtime::get_if_started().map(|rt| rt.engine.free(ptr as u64)) {
            Some(Ok(true)) => {}
            Some(Ok(false)) | None => {
                tracing::error!("tms_torch_free: {ptr:p} is not a pauseable allocation; ignored");
            }
            Some(Err(e)) => {
                tracing::error!("{e}");
                set_last_error(&e);
            }
        }
    })
}
