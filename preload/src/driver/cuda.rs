//! The CUDA driver, reached through `cudarc`'s raw bindings with the library opened at run time:
//! nothing links `libcuda`, so one build serves CUDA 12 and CUDA 13 installs.
//!
//! cudarc resolves each symbol on its first call and panics when one is missing, so
//! [`CudaDriver::load`] probes the library and every symbol this module calls before any call is
//! made; after a successful load no binding can panic.
//!
//! Contexts: the engine works in each device's *primary* context (the one the CUDA runtime and
//! PyTorch use), retained once here. [`Driver::push_device`] makes it current and
//! [`Driver::pop_device`] puts back whatever the calling thread had, so a user thread's context is
//! never changed behind its back.

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{check, DevPtr, DeviceToken, Driver, Event, MemInfo, PhysHandle, Stream};
use crate::error::{Error, Result};

/// Every driver entry point this module calls, by the symbol cudarc loads for it.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuThreadExchangeStreamCaptureMode",
    "cuGetErrorName",
    "cuMemGetAllocationGranularity",
    "cuMemGetInfo_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
];

/// The CUDA driver API.
pub struct CudaDriver {
    devices: i32,
    version: i32,
    contexts: Vec<OnceLock<usize>>,
    streams: Vec<OnceLock<usize>>,
}

fn error_name(code: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName was checked at load; it writes a pointer to a static string or
    // leaves it null for an unknown code.
    let r = unsafe { sys::cuGetErrorName(code, &mut p) };
    if r == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
        // SAFETY: the driver returns a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("CUresult {}", code as i32)
    }
}

fn cu(call: &'static str, r: sys::CUresult, context: impl FnOnce() -> String) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    check(call, r as i32, &error_name(r), context)
}

fn location(device: i32) -> sys::CUmemLocation {
    // SAFETY: CUmemLocation is plain old data; all-zero is a valid value to overwrite.
    let mut l: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    l.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    l.id = device;
    l
}

fn alloc_prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: plain old data; zero means no handle types, no flags, which is what we want.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    p
}

impl CudaDriver {
    /// Open the driver, check every entry point, initialise it and count devices.
    pub fn load() -> Result<Self> {
        // SAFETY: probing only dlopens candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "no CUDA driver library (libcuda.so.1) could be opened; set TMS_BACKEND=sim to use the simulated device".into(),
            ));
        }
        // SAFETY: the library is present (just probed), so culib() finds it and does not panic.
        let lib = unsafe { sys::culib() };
        for name in SYMBOLS {
            // SAFETY: we only look the symbol up; it is not called through this pointer.
            if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
                return Err(Error::Unsupported(format!(
                    "the CUDA driver lacks {name}; a driver for CUDA 12.0 or newer is needed"
                )));
            }
        }
        // SAFETY: every symbol is present; cuInit has no other precondition.
        cu("cuInit", unsafe { sys::cuInit(0) }, || {
            "initialising the CUDA driver".into()
        })?;
        let mut version = 0;
        // SAFETY: writes one int.
        cu(
            "cuDriverGetVersion",
            unsafe { sys::cuDriverGetVersion(&mut version) },
            String::new,
        )?;
        let mut n = 0;
        // SAFETY: writes one int.
        cu(
            "cuDeviceGetCount",
            unsafe { sys::cuDeviceGetCount(&mut n) },
            String::new,
        )?;
        if n <= 0 {
            return Err(Error::Unsupported(
                "the CUDA driver reports no device".into(),
            ));
        }
        Ok(CudaDriver {
            devices: n,
            version,
            contexts: (0..n).map(|_| OnceLock::new()).collect(),
            streams: (0..n).map(|_| OnceLock::new()).collect(),
        })
    }

    /// The driver's CUDA version, e.g. 13000.
    pub fn version(&self) -> i32 {
        self.version
    }

    fn check_device(&self, device: i32) -> Result<usize> {
        if device < 0 || device >= self.devices {
            return Err(Error::InvalidArgument(format!(
                "device {device} does not exist (this machine has {})",
                self.devices
            )));
        }
        Ok(device as usize)
    }

    fn primary_context(&self, device: i32) -> Result<sys::CUcontext> {
        let i = self.check_device(device)?;
        if let Some(c) = self.contexts[i].get() {
            return Ok(*c as sys::CUcontext);
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one device handle for a valid ordinal.
        cu(
            "cuDeviceGet",
            unsafe { sys::cuDeviceGet(&mut dev, device) },
            || format!("device {device}"),
        )?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: retains the primary context of a valid device; kept for the process lifetime.
        cu(
            "cuDevicePrimaryCtxRetain",
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            || format!("device {device}"),
        )?;
        // Two threads may race here; both retained the same primary context, and one extra
        // retain count for the process lifetime is harmless.
        Ok(*self.contexts[i].get_or_init(|| ctx as usize) as sys::CUcontext)
    }
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<i32> {
        Ok(self.devices)
    }

    fn current_device(&self) -> Result<i32> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        cu(
            "cuCtxGetCurrent",
            unsafe { sys::cuCtxGetCurrent(&mut ctx) },
            String::new,
        )?;
        if ctx.is_null() {
            return Ok(0);
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: a context is current; writes one int.
        cu(
            "cuCtxGetDevice",
            unsafe { sys::cuCtxGetDevice(&mut dev) },
            String::new,
        )?;
        Ok(dev)
    }

    fn push_device(&self, device: i32) -> Result<DeviceToken> {
        let ctx = self.primary_context(device)?;
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        cu(
            "cuCtxGetCurrent",
            unsafe { sys::cuCtxGetCurrent(&mut prev) },
            String::new,
        )?;
        if prev != ctx {
            // SAFETY: ctx is a retained primary context.
            cu(
                "cuCtxSetCurrent",
                unsafe { sys::cuCtxSetCurrent(ctx) },
                || format!("device {device}"),
            )?;
        }
        // PyTorch may allocate while this thread captures a CUDA graph (in "global" mode, which
        // forbids VMM calls); our calls are not captured work, so relax the mode meanwhile.
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's capture mode; restored in pop_device.
        let r = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("cuThreadExchangeStreamCaptureMode: {}", error_name(r));
            mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        }
        // The token keeps the previous context; 1 (contexts are aligned, so never a context)
        // marks "unchanged", so pop leaves the context alone then.
        Ok(DeviceToken(
            if prev == ctx { 1 } else { prev as u64 },
            mode as u64,
        ))
    }

    fn pop_device(&self, token: DeviceToken) {
        let mut mode = match token.1 {
            0 => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            1 => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            _ => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: restores the mode push_device replaced.
        let r = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("restoring the stream capture mode: {}", error_name(r));
        }
        if token.0 == 1 {
            return;
        }
        // SAFETY: restores the context that was current (possibly none) before push_device.
        let r = unsafe { sys::cuCtxSetCurrent(token.0 as sys::CUcontext) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("restoring the caller's CUDA context: {}", error_name(r));
        }
    }

    fn granularity(&self, device: i32) -> Result<u64> {
        self.check_device(device)?;
        let prop = alloc_prop(device);
        let mut g = 0usize;
        // SAFETY: prop is a valid property struct; writes one size.
        cu(
            "cuMemGetAllocationGranularity",
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut g,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            || format!("device {device}"),
        )?;
        Ok(g as u64)
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo> {
        let _scope = super::DeviceScope::enter(self, device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: a context of the device is current; writes two sizes.
        cu(
            "cuMemGetInfo",
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            || format!("device {device}"),
        )?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn reserve(&self, device: i32, size: u64) -> Result<DevPtr> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: writes one address; alignment 0 means the granularity.
        cu(
            "cuMemAddressReserve",
            unsafe { sys::cuMemAddressReserve(&mut p, size as usize, 0, 0, 0) },
            || format!("device {device}, {size} bytes"),
        )?;
        Ok(p)
    }

    fn free_range(&self, ptr: DevPtr, size: u64) -> Result<()> {
        // SAFETY: the engine passes a range it reserved and has unmapped.
        cu(
            "cuMemAddressFree",
            unsafe { sys::cuMemAddressFree(ptr, size as usize) },
            || format!("ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn create(&self, device: i32, size: u64) -> Result<PhysHandle> {
        self.check_device(device)?;
        let prop = alloc_prop(device);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: prop is valid; writes one handle.
        cu(
            "cuMemCreate",
            unsafe { sys::cuMemCreate(&mut h, size as usize, &prop, 0) },
            || format!("device {device}, {size} bytes"),
        )?;
        Ok(PhysHandle(h))
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        // SAFETY: the engine releases each handle it created exactly once.
        cu(
            "cuMemRelease",
            unsafe { sys::cuMemRelease(handle.0) },
            || format!("handle {:#x}", handle.0),
        )
    }

    fn map(&self, ptr: DevPtr, size: u64, handle: PhysHandle) -> Result<()> {
        // SAFETY: the range is reserved and unmapped; the handle is live and at least size bytes.
        cu(
            "cuMemMap",
            unsafe { sys::cuMemMap(ptr, size as usize, 0, handle.0, 0) },
            || format!("ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn unmap(&self, ptr: DevPtr, size: u64) -> Result<()> {
        // SAFETY: the range was mapped by map(); the engine synchronized the device first.
        cu(
            "cuMemUnmap",
            unsafe { sys::cuMemUnmap(ptr, size as usize) },
            || format!("ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn set_access(&self, device: i32, ptr: DevPtr, size: u64) -> Result<()> {
        let desc = sys::CUmemAccessDesc {
            location: location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one descriptor is passed.
        cu(
            "cuMemSetAccess",
            unsafe { sys::cuMemSetAccess(ptr, size as usize, &desc, 1) },
            || format!("device {device}, ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn synchronize(&self, device: i32) -> Result<()> {
        let _scope = super::DeviceScope::enter(self, device)?;
        // SAFETY: the device's primary context is current.
        cu(
            "cuCtxSynchronize",
            unsafe { sys::cuCtxSynchronize() },
            || format!("device {device}"),
        )
    }

    fn stream(&self, device: i32) -> Result<Stream> {
        let i = self.check_device(device)?;
        if let Some(s) = self.streams[i].get() {
            return Ok(Stream(*s as u64));
        }
        let _scope = super::DeviceScope::enter(self, device)?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the device's context is current; a non-blocking stream does not serialise with
        // the legacy default stream that PyTorch's work may use.
        cu(
            "cuStreamCreate",
            unsafe { sys::cuStreamCreate(&mut s, 1) },
            || format!("device {device}"),
        )?;
        // A racing thread may create a second stream; the loser's stream is kept alive unused.
        Ok(Stream(*self.streams[i].get_or_init(|| s as usize) as u64))
    }

    fn stream_sync(&self, stream: Stream) -> Result<()> {
        // SAFETY: the stream came from stream() and is never destroyed.
        cu(
            "cuStreamSynchronize",
            unsafe { sys::cuStreamSynchronize(stream.0 as sys::CUstream) },
            || format!("engine stream {:#x}", stream.0),
        )
    }

    fn event_create(&self, device: i32) -> Result<Event> {
        let _scope = super::DeviceScope::enter(self, device)?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the device's context is current; writes one handle. 2 = CU_EVENT_DISABLE_TIMING.
        cu(
            "cuEventCreate",
            unsafe { sys::cuEventCreate(&mut e, 2) },
            || format!("device {device}"),
        )?;
        Ok(Event(e as u64))
    }

    fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        // SAFETY: both handles came from this driver and are alive.
        cu(
            "cuEventRecord",
            unsafe { sys::cuEventRecord(event.0 as sys::CUevent, stream.0 as sys::CUstream) },
            || format!("event {:#x} on stream {:#x}", event.0, stream.0),
        )
    }

    fn event_sync(&self, event: Event) -> Result<()> {
        // SAFETY: the event came from event_create and is alive.
        cu(
            "cuEventSynchronize",
            unsafe { sys::cuEventSynchronize(event.0 as sys::CUevent) },
            || format!("event {:#x}", event.0),
        )
    }

    fn event_destroy(&self, event: Event) {
        // SAFETY: the event came from event_create; the caller does not use it again.
        let r = unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("cuEventDestroy: {}", error_name(r));
        }
    }

    unsafe fn copy_d2h(&self, dst: *mut u8, src: DevPtr, len: u64, stream: Stream) -> Result<()> {
        // SAFETY: the caller upholds the trait's contract on both ranges.
        cu(
            "cuMemcpyDtoHAsync",
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len as usize, stream.0 as sys::CUstream)
            },
            || format!("{len} bytes from {src:#x}"),
        )
    }

    unsafe fn copy_h2d(&self, dst: DevPtr, src: *const u8, len: u64, stream: Stream) -> Result<()> {
        // SAFETY: the caller upholds the trait's contract on both ranges.
        cu(
            "cuMemcpyHtoDAsync",
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len as usize, stream.0 as sys::CUstream)
            },
            || format!("{len} bytes to {dst:#x}"),
        )
    }

    unsafe fn host_register(&self, device: i32, ptr: *mut u8, len: u64) -> Result<()> {
        // cuMemHostRegister needs a current context: the one of the device backed up.
        let _scope = super::DeviceScope::enter(self, device)?;
        // SAFETY: the caller upholds the trait's contract; PORTABLE (1) makes the range pinned
        // for every context.
        cu(
            "cuMemHostRegister",
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len as usize, 1) },
            || format!("{len} bytes of host memory at {ptr:p}"),
        )
    }

    unsafe fn host_unregister(&self, device: i32, ptr: *mut u8) -> Result<()> {
        let _scope = super::DeviceScope::enter(self, device)?;
        // SAFETY: the caller passes the start of a registered range no copy uses any more.
        cu(
            "cuMemHostUnregister",
            unsafe { sys::cuMemHostUnregister(ptr.cast()) },
            || format!("host memory at {ptr:p}"),
        )
    }
}
