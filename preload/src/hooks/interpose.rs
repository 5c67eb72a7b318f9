//! `cudaMalloc`/`cudaFree` interposers (preload mode) and PyTorch's pluggable-allocator entry
//! points (torch mode).
//!
//! Outside a region both interposers hand the call to the next definition in link order (the
//! real CUDA runtime), found with `dlsym(RTLD_NEXT)`. Inside one, allocations come from the
//! engine, which uses only the driver API, so it never calls back into `cudaMalloc`. A
//! per-thread reentrancy flag makes any nested call pass through regardless.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use libc::ssize_t;

use crate::control;
use crate::engine::AllocRequest;
use crate::error::{Error, ErrorKind};
use crate::process::boundary::{catch, set_last_error};
use crate::process::{runtime, settings};

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_MEMORY_ALLOCATION: c_int = 2;
const CUDA_ERROR_INITIALIZATION: c_int = 3;
const CUDA_ERROR_UNKNOWN: c_int = 999;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside the library; `None` if it already was (or its locals are gone).
pub(super) struct Reentry;

impl Reentry {
    pub(super) fn enter() -> Option<Reentry> {
        match INSIDE.try_with(|f| f.replace(true)) {
            Ok(false) => Some(Reentry),
            _ => None,
        }
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|f| f.set(false));
    }
}

fn next_symbol(name: &'static std::ffi::CStr, slot: &'static OnceLock<usize>) -> usize {
    if let Some(p) = slot.get() {
        return *p;
    }
    // Not cached when absent: the runtime may be loaded later (or promoted to global scope).
    match find_symbol(name) {
        0 => 0,
        p => *slot.get_or_init(|| p),
    }
}

/// The CUDA runtime's definition of `name`: the next one in link order, or, when the runtime
/// was loaded into a local scope (a dependency of a library opened with `RTLD_LOCAL`, as Python
/// extension modules are), the one in any loaded `libcudart`.
fn find_symbol(name: &'static std::ffi::CStr) -> usize {
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name only looks the symbol up.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    if p != 0 {
        return p;
    }
    let mut found: Vec<std::ffi::CString> = Vec::new();
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader passes a valid info record; data is the Vec passed below.
        let (info, out) = unsafe { (&*info, &mut *(data as *mut Vec<std::ffi::CString>)) };
        if !info.dlpi_name.is_null() {
            // SAFETY: dlpi_name is a NUL-terminated path owned by the loader.
            let n = unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) };
            if n.to_bytes().windows(9).any(|w| w == b"libcudart") {
                out.push(n.to_owned());
            }
        }
        0
    }
    // SAFETY: visit only reads the loader's records and pushes to the Vec we own.
    unsafe {
        libc::dl_iterate_phdr(
            Some(visit),
            (&mut found as *mut Vec<std::ffi::CString>).cast(),
        )
    };
    for lib in found {
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
        if p != 0 && p != cudaMalloc as *const () as usize && p != cudaFree as *const () as usize {
            return p;
        }
    }
    0
}

fn real_malloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    static SLOT: OnceLock<usize> = OnceLock::new();
    let p = next_symbol(c"cudaMalloc", &SLOT);
    if p == 0 {
        set_last_error(&Error::unsupported(
            "no CUDA runtime below torch-memory-saver provides cudaMalloc",
        ));
        return CUDA_ERROR_INITIALIZATION;
    }
    // SAFETY: p is the next cudaMalloc in link order, with the runtime's signature.
    unsafe { std::mem::transmute::<usize, MallocFn>(p)(dev_ptr, size) }
}

fn real_free(ptr: *mut c_void) -> c_int {
    static SLOT: OnceLock<usize> = OnceLock::new();
    let p = next_symbol(c"cudaFree", &SLOT);
    if p == 0 {
        set_last_error(&Error::unsupported(
            "no CUDA runtime below torch-memory-saver provides cudaFree",
        ));
        return CUDA_ERROR_INITIALIZATION;
    }
    // SAFETY: p is the next cudaFree in link order, with the runtime's signature.
    unsafe { std::mem::transmute::<usize, FreeFn>(p)(ptr) }
}

/// Print a failure the user must know about (bad settings, a runtime that cannot start) once
/// per kind; hooks cannot return a message, only a status.
fn report_once(once: &'static std::sync::Once, e: &Error) {
    once.call_once(|| eprintln!("torch-memory-saver: {e}"));
}

static SETTINGS_REPORTED: std::sync::Once = std::sync::Once::new();
static STARTUP_REPORTED: std::sync::Once = std::sync::Once::new();

/// Allocate from the engine with the thread's region settings; a CUDA runtime status.
fn engine_alloc(size: usize, device: Option<i32>) -> Result<*mut c_void, (c_int, Error)> {
    let fail = |code| move |e: Error| (code, e);
    let region = settings::current_region().map_err(fail(CUDA_ERROR_INVALID_VALUE))?;
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

fn malloc_impl(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    let Some(_guard) = Reentry::enter() else {
        return real_malloc(dev_ptr, size);
    };
    if dev_ptr.is_null() || runtime::forked() {
        return real_malloc(dev_ptr, size);
    }
    match settings::in_region() {
        Ok(true) => {}
        Ok(false) => return real_malloc(dev_ptr, size),
        Err(e) => {
            // Malformed TMS_* settings: say so once, then stay out of the way.
            report_once(&SETTINGS_REPORTED, &e);
            return real_malloc(dev_ptr, size);
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

fn free_impl(ptr: *mut c_void) -> c_int {
    let Some(_guard) = Reentry::enter() else {
        return real_free(ptr);
    };
    if ptr.is_null() {
        return real_free(ptr);
    }
    // Never start the runtime just to free: if it never started, nothing here is ours.
    let Some(rt) = runtime::get_if_started() else {
        return real_free(ptr);
    };
    match rt.engine.free(ptr as u64) {
        Ok(true) => CUDA_SUCCESS,
        Ok(false) => real_free(ptr),
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
    catch(CUDA_ERROR_UNKNOWN, || malloc_impl(dev_ptr, size))
}

/// Interposed `cudaFree`: frees pauseable allocations, hands every other pointer to the runtime.
///
/// # Safety
/// As the CUDA runtime's `cudaFree`.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    catch(CUDA_ERROR_UNKNOWN, || free_impl(ptr))
}

/// PyTorch's pluggable-allocator `malloc`: allocate `size` bytes of pauseable memory on `device`,
/// with the calling thread's region tag and backup settings (always pauseable, region or not).
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
