//! The HIP runtime's C interface as far as the driver uses it: the types, constants and entry
//! points of `hip_runtime_api.h`, and the library found and opened at run time (nothing links
//! `libamdhip64`). Every entry point is looked up when the library is opened, so a missing one
//! is an error then, never a crash later; the few only some features need are optional.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

use libloading::os::unix::Library;

use crate::error::{Error, Result};

/// `hipError_t`.
pub(super) type HipError = c_int;
pub(super) const HIP_SUCCESS: HipError = 0;
/// `hipErrorInvalidValue`.
pub(super) const HIP_ERROR_INVALID_VALUE: HipError = 1;

/// `hipMemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MemLocation {
    pub type_: c_int,
    pub id: c_int,
}

/// `hipMemAllocationProp`.
#[repr(C)]
pub(super) struct MemAllocationProp {
    pub type_: c_int,
    pub requested_handle_type: c_int,
    pub location: MemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
}

/// `hipMemAccessDesc`.
#[repr(C)]
pub(super) struct MemAccessDesc {
    pub location: MemLocation,
    pub flags: c_int,
}

/// `hipMemAllocationTypePinned`.
pub(super) const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `hipMemLocationTypeDevice`.
pub(super) const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `hipMemAccessFlagsProtReadWrite`.
pub(super) const MEM_ACCESS_READ_WRITE: c_int = 3;
/// `hipMemAllocationGranularityMinimum`, `hipMemAllocationGranularityRecommended`.
pub(super) const GRANULARITY_MINIMUM: c_int = 0;
pub(super) const GRANULARITY_RECOMMENDED: c_int = 1;
/// `hipDeviceAttributeVirtualMemoryManagementSupported` (the same number since HIP 5.3).
pub(super) const ATTR_VMM_SUPPORTED: c_int = 89;
/// `hipDeviceAttributeCanUseStreamWaitValue`.
pub(super) const ATTR_CAN_USE_STREAM_WAIT_VALUE: c_int = 10013;
/// `hipStreamNonBlocking`.
pub(super) const STREAM_NON_BLOCKING: c_uint = 1;
/// `hipStreamPerThread`, a handle every call takes in place of a stream.
pub(super) const STREAM_PER_THREAD: u64 = 2;
/// `hipEventDisableTiming`.
pub(super) const EVENT_DISABLE_TIMING: c_uint = 2;
/// `hipHostRegisterPortable`.
pub(super) const HOST_REGISTER_PORTABLE: c_uint = 1;
/// `hipHostMallocPortable | hipHostMallocMapped | hipHostMallocCoherent`: every device reads it
/// in place, and sees the host's stores without a fence.
pub(super) const HOST_MALLOC_GATE: c_uint = 0x1 | 0x2 | 0x4000_0000;
/// `hipStreamWaitValueGte`.
pub(super) const STREAM_WAIT_VALUE_GTE: c_uint = 0;
/// `hipStreamCaptureModeRelaxed`.
pub(super) const CAPTURE_MODE_RELAXED: c_int = 2;

type Handle = *mut c_void;

/// Declares [`Api`]: each field an entry point of that C type, found by its name at open.
macro_rules! api {
    (
        required { $($f:ident = $name:literal ($($a:ty),*);)* }
        optional { $($o:ident = $oname:literal ($($oa:ty),*);)* }
    ) => {
        /// The entry points, from the library kept open here.
        pub(super) struct Api {
            $(pub $f: unsafe extern "C" fn($($a),*) -> HipError,)*
            $(pub $o: Option<unsafe extern "C" fn($($oa),*) -> HipError>,)*
            pub get_error_name: unsafe extern "C" fn(HipError) -> *const c_char,
            /// Never closed (it was opened with `RTLD_NODELETE`): the entry points stay valid.
            _lib: Library,
        }

        impl Api {
            /// Every entry point of `lib`, or the name of the first one it lacks.
            fn new(lib: Library) -> std::result::Result<Api, &'static str> {
                Ok(Api {
                    $(
                        // SAFETY: the type is the entry point's prototype in hip_runtime_api.h
                        // (C types, enums as int, handles as pointers); the pointer stays valid
                        // while `_lib` is open, which is for good.
                        $f: *unsafe { lib.get::<unsafe extern "C" fn($($a),*) -> HipError>($name) }
                            .map_err(|_| $name)?,
                    )*
                    $(
                        // SAFETY: as above, for an entry point that may be missing.
                        $o: unsafe { lib.get::<unsafe extern "C" fn($($oa),*) -> HipError>($oname) }
                            .ok()
                            .map(|s| *s),
                    )*
                    // SAFETY: as above: `const char *hipGetErrorName(hipError_t)`.
                    get_error_name: *unsafe {
                        lib.get::<unsafe extern "C" fn(HipError) -> *const c_char>("hipGetErrorName")
                    }
                    .map_err(|_| "hipGetErrorName")?,
                    _lib: lib,
                })
            }
        }
    };
}

api! {
    required {
        init = "hipInit" (c_uint);
        driver_get_version = "hipDriverGetVersion" (*mut c_int);
        get_device_count = "hipGetDeviceCount" (*mut c_int);
        get_device = "hipGetDevice" (*mut c_int);
        set_device = "hipSetDevice" (c_int);
        device_get_attribute = "hipDeviceGetAttribute" (*mut c_int, c_int, c_int);
        device_synchronize = "hipDeviceSynchronize" ();
        mem_get_allocation_granularity = "hipMemGetAllocationGranularity"
            (*mut usize, *const MemAllocationProp, c_int);
        mem_get_info = "hipMemGetInfo" (*mut usize, *mut usize);
        mem_address_reserve = "hipMemAddressReserve"
            (*mut *mut c_void, usize, usize, *mut c_void, c_ulonglong);
        mem_address_free = "hipMemAddressFree" (*mut c_void, usize);
        mem_create = "hipMemCreate" (*mut Handle, usize, *const MemAllocationProp, c_ulonglong);
        mem_release = "hipMemRelease" (Handle);
        mem_map = "hipMemMap" (*mut c_void, usize, usize, Handle, c_ulonglong);
        mem_unmap = "hipMemUnmap" (*mut c_void, usize);
        mem_set_access = "hipMemSetAccess" (*mut c_void, usize, *const MemAccessDesc, usize);
        stream_create_with_flags = "hipStreamCreateWithFlags" (*mut *mut c_void, c_uint);
        stream_synchronize = "hipStreamSynchronize" (*mut c_void);
        event_create_with_flags = "hipEventCreateWithFlags" (*mut *mut c_void, c_uint);
        event_record = "hipEventRecord" (*mut c_void, *mut c_void);
        event_synchronize = "hipEventSynchronize" (*mut c_void);
        event_destroy = "hipEventDestroy" (*mut c_void);
        memcpy_dtoh_async = "hipMemcpyDtoHAsync" (*mut c_void, *mut c_void, usize, *mut c_void);
        memcpy_htod_async = "hipMemcpyHtoDAsync" (*mut c_void, *mut c_void, usize, *mut c_void);
        host_register = "hipHostRegister" (*mut c_void, usize, c_uint);
        host_unregister = "hipHostUnregister" (*mut c_void);
    }
    optional {
        exchange_capture_mode = "hipThreadExchangeStreamCaptureMode" (*mut c_int);
        host_malloc = "hipHostMalloc" (*mut *mut c_void, usize, c_uint);
        host_get_device_pointer = "hipHostGetDevicePointer" (*mut *mut c_void, *mut c_void, c_uint);
        stream_wait_value32 = "hipStreamWaitValue32" (*mut c_void, *mut c_void, u32, c_uint, u32);
    }
}

/// The file names tried after `TMS_HIP_LIBRARY` and a copy already loaded: the development
/// link, the versioned names ROCm 5 to 7 install, and ROCm's default folder.
const NAMES: &[&str] = &[
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
    "/opt/rocm/lib/libamdhip64.so",
];

/// Open `name`; the runtime is never unloaded under the engine (`RTLD_NODELETE`).
fn open(name: &str) -> std::result::Result<Library, libloading::Error> {
    // SAFETY: opening runs the library's initialisers, which for the HIP runtime (or a test
    // double of it) have no preconditions on the caller.
    unsafe {
        Library::open(
            Some(name),
            libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE,
        )
    }
}

impl Api {
    /// The HIP runtime: `path` when given (an error if it cannot be opened), else a copy the
    /// process has loaded already (PyTorch's own, so that there is one runtime in the process),
    /// else the first of [`NAMES`] that opens. `Ok(None)`: no runtime anywhere. With the name
    /// it was opened by.
    pub(super) fn find(path: Option<&str>) -> Result<Option<(Api, String)>> {
        if let Some(p) = path {
            let lib = open(p).map_err(|e| {
                Error::unsupported(format!("TMS_HIP_LIBRARY={p:?} cannot be opened: {e}"))
            })?;
            return Self::with(lib, p.to_string()).map(Some);
        }
        let loaded = crate::os::loaded_objects(b"libamdhip64")
            .into_iter()
            .filter_map(|c| c.into_string().ok());
        for name in loaded.chain(NAMES.iter().map(|n| n.to_string())) {
            if let Ok(lib) = open(&name) {
                return Self::with(lib, name).map(Some);
            }
        }
        Ok(None)
    }

    fn with(lib: Library, name: String) -> Result<(Api, String)> {
        match Api::new(lib) {
            Ok(api) => Ok((api, name)),
            Err(missing) => Err(Error::unsupported(format!(
                "the HIP runtime {name} lacks {missing}; ROCm 5.3 or newer is needed"
            ))),
        }
    }
}
