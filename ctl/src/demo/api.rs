//! The preloaded library's entry points as the demo child calls them: found by name among the
//! process's own symbols (`dlopen(NULL)`, which sees what `LD_PRELOAD` put there), the way any
//! preloaded program's code would find them, and wrapped so that this is the one place of the
//! child that calls into C. Each function type is the export's (the test below).

use std::ffi::{c_char, c_int, c_void, CStr};

use libloading::os::unix::Library;

type OutStrFn = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;
type RegionEnterFn = unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char) -> c_int;
type RegionExitFn = unsafe extern "C" fn() -> c_int;
type SetFlagFn = unsafe extern "C" fn(c_int) -> c_int;
type TorchMallocFn = unsafe extern "C" fn(isize, c_int, *mut c_void) -> *mut c_void;
type TorchFreeFn = unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void);
type WriteFn = unsafe extern "C" fn(u64, *const c_void, u64) -> c_int;
type ReadFn = unsafe extern "C" fn(u64, *mut c_void, u64) -> c_int;
type LastErrorFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;
type CudaMallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type CudaFreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type SetChunkSizeFn = unsafe extern "C" fn(usize) -> c_int;
type KeepResidentFn = unsafe extern "C" fn(u64, *mut u64) -> c_int;

/// The library's function `name`, as a `T`.
///
/// # Safety
/// `T` is the type of the library's function `name`.
unsafe fn sym<T: Copy>(lib: &Library, name: &CStr) -> Result<T, String> {
    // SAFETY: T is the function's type (our caller's promise).
    match unsafe { lib.get::<T>(name) } {
        Ok(f) => Ok(*f),
        Err(_) => Err(format!(
            "{} not found among the process's symbols (LD_PRELOAD)",
            name.to_string_lossy()
        )),
    }
}

/// The library's function `$name`, typed as the place it goes to expects.
macro_rules! load {
    ($lib:expr, $name:literal) => {
        // SAFETY: the library's function of that name has exactly the type it is loaded as (the
        // C signature of tms.h, or the CUDA runtime's for cudaMalloc and cudaFree): the test
        // below checks each type against the export.
        unsafe { sym($lib, $name) }
    };
}

/// The preloaded library's entry points.
pub(super) struct Api {
    /// The process's own handle, which the functions below are found through.
    lib: Library,
    init: OutStrFn,
    control_socket: OutStrFn,
    region_enter: RegionEnterFn,
    region_exit: RegionExitFn,
    set_disk_backup: SetFlagFn,
    torch_malloc: TorchMallocFn,
    torch_free: TorchFreeFn,
    write: WriteFn,
    read: ReadFn,
    last_error: LastErrorFn,
    cuda_malloc: CudaMallocFn,
    cuda_free: CudaFreeFn,
}

/// `tms_set_chunk_size`, looked up only where it is used: a library that predates chunks still
/// runs the plain demo.
pub(super) struct SetChunkSize(SetChunkSizeFn);

/// `tms_keep_resident_ex`, looked up only where it is used.
pub(super) struct KeepResident(KeepResidentFn);

impl Api {
    pub(super) fn load() -> Result<Api, String> {
        let lib = Library::this();
        Ok(Api {
            init: load!(&lib, c"tms_init")?,
            control_socket: load!(&lib, c"tms_control_socket")?,
            region_enter: load!(&lib, c"tms_region_enter")?,
            region_exit: load!(&lib, c"tms_region_exit")?,
            set_disk_backup: load!(&lib, c"tms_set_enable_disk_backup")?,
            torch_malloc: load!(&lib, c"tms_torch_malloc")?,
            torch_free: load!(&lib, c"tms_torch_free")?,
            write: load!(&lib, c"tms_write_bytes")?,
            read: load!(&lib, c"tms_read_bytes")?,
            last_error: load!(&lib, c"tms_last_error")?,
            cuda_malloc: load!(&lib, c"cudaMalloc")?,
            cuda_free: load!(&lib, c"cudaFree")?,
            lib,
        })
    }

    pub(super) fn set_chunk_size(&self) -> Result<SetChunkSize, String> {
        load!(&self.lib, c"tms_set_chunk_size").map(SetChunkSize)
    }

    pub(super) fn keep_resident(&self) -> Result<KeepResident, String> {
        load!(&self.lib, c"tms_keep_resident_ex").map(KeepResident)
    }

    pub(super) fn last_error(&self) -> String {
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf is writable for its length; the function NUL-terminates within it.
        unsafe { (self.last_error)(buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    }

    pub(super) fn check(&self, rc: c_int) -> Result<(), String> {
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("status {rc}: {}", self.last_error()))
        }
    }

    fn out_str(&self, f: OutStrFn) -> Result<String, String> {
        let mut buf = vec![0u8; 4096];
        let mut len = 0usize;
        // SAFETY: buf is writable for its length, len for one usize.
        let rc = unsafe { f(buf.as_mut_ptr().cast(), buf.len(), &mut len) };
        self.check(rc)?;
        buf.truncate(len.min(buf.len()));
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// `tms_init`: the driver's name.
    pub(super) fn init(&self) -> Result<String, String> {
        self.out_str(self.init)
    }

    /// `tms_control_socket`: the socket's path.
    pub(super) fn control_socket(&self) -> Result<String, String> {
        self.out_str(self.control_socket)
    }

    /// `tms_region_enter` of a pauseable region of `tag`.
    pub(super) fn region_enter(
        &self,
        tag: &CStr,
        cpu_backup: bool,
        backend: Option<&CStr>,
    ) -> c_int {
        let backend = backend.map_or(std::ptr::null(), CStr::as_ptr);
        // SAFETY: tag is a NUL-terminated string, backend one or NULL.
        unsafe { (self.region_enter)(1, tag.as_ptr(), c_int::from(cpu_backup), backend) }
    }

    pub(super) fn region_exit(&self) -> c_int {
        // SAFETY: no arguments.
        unsafe { (self.region_exit)() }
    }

    /// `tms_set_enable_disk_backup`.
    pub(super) fn set_disk_backup(&self, on: bool) -> c_int {
        // SAFETY: a plain flag.
        unsafe { (self.set_disk_backup)(c_int::from(on)) }
    }

    /// `tms_torch_malloc` of `size` bytes on device 0: NULL on failure.
    pub(super) fn torch_malloc(&self, size: isize) -> *mut c_void {
        // SAFETY: a plain call of the pluggable-allocator entry point; NULL stream.
        unsafe { (self.torch_malloc)(size, 0, std::ptr::null_mut()) }
    }

    /// `tms_torch_free` of an allocation of `size` bytes on device 0.
    ///
    /// # Safety
    /// `p` came from [`Api::torch_malloc`] of `size` bytes, and is freed once.
    pub(super) unsafe fn torch_free(&self, p: *mut c_void, size: isize) {
        // SAFETY: p is an allocation of the library, freed once (our caller's promise).
        unsafe { (self.torch_free)(p, size, 0, std::ptr::null_mut()) }
    }

    /// `tms_write_bytes`: `data` into the allocation at `ptr`.
    pub(super) fn write(&self, ptr: u64, data: &[u8]) -> c_int {
        // SAFETY: data is readable for its length; the library checks the device range.
        unsafe { (self.write)(ptr, data.as_ptr().cast(), data.len() as u64) }
    }

    /// `tms_read_bytes`: the allocation at `ptr` into `out`.
    pub(super) fn read(&self, ptr: u64, out: &mut [u8]) -> c_int {
        // SAFETY: out is writable for its length; the library checks the device range.
        unsafe { (self.read)(ptr, out.as_mut_ptr().cast(), out.len() as u64) }
    }

    /// `cudaMalloc` of `n` bytes: its status and the pointer it gave.
    pub(super) fn cuda_malloc(&self, n: usize) -> (c_int, *mut c_void) {
        let mut q: *mut c_void = std::ptr::null_mut();
        // SAFETY: q is writable for one pointer.
        let rc = unsafe { (self.cuda_malloc)(&mut q, n) };
        (rc, q)
    }

    /// `cudaFree`.
    ///
    /// # Safety
    /// `q` came from [`Api::cuda_malloc`] and is freed once.
    pub(super) unsafe fn cuda_free(&self, q: *mut c_void) {
        // SAFETY: q came from cudaMalloc and is freed once (our caller's promise).
        unsafe { (self.cuda_free)(q) };
    }
}

impl SetChunkSize {
    pub(super) fn call(&self, bytes: usize) -> c_int {
        // SAFETY: a plain call with a number.
        unsafe { (self.0)(bytes) }
    }
}

impl KeepResident {
    /// Keep the allocation holding `ptr` resident; its size goes to `size`.
    pub(super) fn call(&self, ptr: u64, size: &mut u64) -> c_int {
        // SAFETY: size is writable; the library checks the address.
        unsafe { (self.0)(ptr, size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each function type above is the type of the library's export of that name: each line
    /// compiles only where the argument and result types are the export's (tms.h is generated
    /// from the same exports).
    #[test]
    fn the_function_types_are_the_exports() {
        let _: OutStrFn = tms::ffi::tms_init;
        let _: OutStrFn = tms::ffi::tms_control_socket;
        let _: RegionEnterFn = tms::ffi::tms_region_enter;
        let _: RegionExitFn = tms::ffi::tms_region_exit;
        let _: SetFlagFn = tms::ffi::tms_set_enable_disk_backup;
        let _: TorchMallocFn = tms::hooks::tms_torch_malloc;
        let _: TorchFreeFn = tms::hooks::tms_torch_free;
        let _: WriteFn = tms::ffi::tms_write_bytes;
        let _: ReadFn = tms::ffi::tms_read_bytes;
        let _: LastErrorFn = tms::ffi::tms_last_error;
        let _: CudaMallocFn = tms::hooks::cudaMalloc;
        let _: CudaFreeFn = tms::hooks::cudaFree;
        let _: SetChunkSizeFn = tms::ffi::tms_set_chunk_size;
        let _: KeepResidentFn = tms::ffi::tms_keep_resident_ex;
    }
}
