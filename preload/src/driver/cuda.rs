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
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::gate::{GateCell, GATED_WAIT};
use super::{
    check, DevPtr, DeviceToken, Driver, Event, Gate, GateWaits, MemInfo, PhysHandle, Stream,
};
use crate::error::{Error, Result};

mod digest_kernel;

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
    "cuDeviceGetAttribute",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemExportToShareableHandle",
    "cuModuleLoadDataEx",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuMemAlloc_v2",
];

/// Entry points only a non-blocking resume needs ([`Driver::gate`]): probed when it first asks,
/// so a driver without them still serves everything else.
const GATE_SYMBOLS: &[&str] = &[
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuStreamWaitValue32_v2",
];

/// The CUDA driver API.
pub struct CudaDriver {
    devices: i32,
    version: i32,
    contexts: Vec<OnceLock<usize>>,
    streams: Vec<OnceLock<usize>>,
    /// The gate, or why there is none (made once, on first use).
    gate: GateCell,
    /// Streams waiting for the gate, kept apart from device-wide calls.
    gate_waits: GateWaits,
    /// What `create` asks for (`MemoryFlags`, bit 0 rdma, bit 1 shareable).
    flags: AtomicU8,
    /// Per device: GPUDirect RDMA with VMM, and POSIX file descriptor handles, supported.
    rdma_ok: Vec<OnceLock<bool>>,
    fd_ok: Vec<OnceLock<bool>>,
    /// Per device: the digest kernel and its scratch buffer, made on first use.
    digests: Vec<parking_lot::Mutex<digest_kernel::Slot>>,
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

/// Device memory of `device`, RDMA-capable and exportable as a file descriptor as asked.
fn alloc_prop(device: i32, rdma: bool, fd: bool) -> sys::CUmemAllocationProp {
    // SAFETY: plain old data; zero means no handle types, no flags, the rest set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    p.allocFlags.gpuDirectRDMACapable = u8::from(rdma);
    if fd {
        p.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    p
}

impl CudaDriver {
    /// Whether the CUDA driver library can be opened (a machine with an NVIDIA driver).
    pub fn present() -> bool {
        // SAFETY: probing only dlopens candidate library names.
        unsafe { sys::is_culib_present() }
    }

    /// Open the driver, check every entry point, initialise it and count devices.
    pub fn load() -> Result<Self> {
        if !Self::present() {
            return Err(Error::unsupported(
                "no CUDA driver library (libcuda.so.1) could be opened; set TMS_BACKEND=sim to use the simulated device",
            ));
        }
        // SAFETY: the library is present (just probed), so culib() finds it and does not panic.
        let lib = unsafe { sys::culib() };
        for name in SYMBOLS {
            // SAFETY: we only look the symbol up; it is not called through this pointer.
            if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
                return Err(Error::unsupported(format!(
                    "the CUDA driver lacks {name}; a driver for CUDA 12.0 or newer is needed"
                )));
            }
        }
        // SAFETY: every symbol is present; cuInit has no other precondition.
        cu("cuInit", unsafe { sys::cuInit(0) }, || {
            "initialising the CUDA driver".into()
        })?;
        let mut version = 0;
        cu(
            "cuDriverGetVersion",
            // SAFETY: the symbol was checked above; &mut version is a valid int to write.
            unsafe { sys::cuDriverGetVersion(&mut version) },
            String::new,
        )?;
        let mut n = 0;
        cu(
            "cuDeviceGetCount",
            // SAFETY: cuInit succeeded above; &mut n is a valid int to write.
            unsafe { sys::cuDeviceGetCount(&mut n) },
            String::new,
        )?;
        if n <= 0 {
            return Err(Error::unsupported("the CUDA driver reports no device"));
        }
        Ok(CudaDriver {
            devices: n,
            version,
            contexts: (0..n).map(|_| OnceLock::new()).collect(),
            streams: (0..n).map(|_| OnceLock::new()).collect(),
            gate: GateCell::default(),
            gate_waits: GateWaits::new(GATED_WAIT),
            flags: AtomicU8::new(0),
            rdma_ok: (0..n).map(|_| OnceLock::new()).collect(),
            fd_ok: (0..n).map(|_| OnceLock::new()).collect(),
            digests: (0..n).map(|_| Default::default()).collect(),
        })
    }

    /// Whether `device` has `attr` (a yes/no attribute), asked once; an error is a no.
    fn has(&self, cache: &[OnceLock<bool>], device: i32, attr: sys::CUdevice_attribute) -> bool {
        let Ok(i) = self.check_device(device) else {
            return false;
        };
        *cache[i].get_or_init(|| {
            let mut v = 0;
            // SAFETY: the symbol was checked at load and the device index above; &mut v is a
            // valid int to write.
            let r = unsafe { sys::cuDeviceGetAttribute(&mut v, attr, device) };
            r == sys::CUresult::CUDA_SUCCESS && v != 0
        })
    }

    /// The properties `create` gives memory of `device` now.
    fn prop(&self, device: i32) -> sys::CUmemAllocationProp {
        use sys::CUdevice_attribute as A;
        let f = self.flags.load(Ordering::Relaxed);
        let rdma = f & 1 != 0
            && self.has(
                &self.rdma_ok,
                device,
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            );
        let fd = f & 2 != 0
            && self.has(
                &self.fd_ok,
                device,
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            );
        alloc_prop(device, rdma, fd)
    }

    /// The driver's CUDA version, e.g. 13000.
    pub fn version(&self) -> i32 {
        self.version
    }

    fn check_device(&self, device: i32) -> Result<usize> {
        super::device_index(device, self.devices)
    }

    fn primary_context(&self, device: i32) -> Result<sys::CUcontext> {
        let i = self.check_device(device)?;
        if let Some(c) = self.contexts[i].get() {
            return Ok(*c as sys::CUcontext);
        }
        let mut dev: sys::CUdevice = 0;
        cu(
            "cuDeviceGet",
            // SAFETY: check_device made the ordinal valid; &mut dev is a valid handle to write.
            unsafe { sys::cuDeviceGet(&mut dev, device) },
            || format!("device {device}"),
        )?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        cu(
            "cuDevicePrimaryCtxRetain",
            // SAFETY: dev came from cuDeviceGet; &mut ctx is a valid pointer to write. The
            // retain is never released, so the context outlives every use of it here.
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            || format!("device {device}"),
        )?;
        // Two threads may race here; both retained the same primary context, and one extra
        // retain count for the process lifetime is harmless.
        Ok(*self.contexts[i].get_or_init(|| ctx as usize) as sys::CUcontext)
    }
}

impl CudaDriver {
    /// Keep a call that waits for the whole device apart from streams waiting on the gate
    /// ([`GateWaits`]): the guard to hold across it.
    fn device_wide(&self, call: &str) -> Option<super::gate::DeviceWide<'_>> {
        self.gate_waits.device_wide_or_warn(self.gate.made(), call)
    }

    /// A word of page-locked, device-mapped host memory usable from every context.
    fn make_gate(&self) -> Result<Gate> {
        // SAFETY: load() found the library, so culib() does not panic.
        let lib = unsafe { sys::culib() };
        for name in GATE_SYMBOLS {
            // SAFETY: we only look the symbol up; it is not called through this pointer.
            if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
                return Err(Error::unsupported(format!(
                    "the CUDA driver lacks {name}, which a non-blocking resume needs"
                )));
            }
        }
        let _scope = super::DeviceScope::enter(self, self.current_device()?)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // PORTABLE: every context may use it; DEVICEMAP: devices read it in place.
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        cu(
            "cuMemHostAlloc",
            // SAFETY: a context is current (_scope) and the symbol was probed; &mut p is a valid
            // pointer to write. The memory is never freed, so the reference below stays valid.
            unsafe { sys::cuMemHostAlloc(&mut p, 64, flags) },
            || "64 bytes for the resume gate".into(),
        )?;
        let mut dev: sys::CUdeviceptr = 0;
        cu(
            "cuMemHostGetDevicePointer",
            // SAFETY: p came from cuMemHostAlloc with DEVICEMAP; &mut dev is valid to write.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) },
            || format!("the resume gate at {p:p}"),
        )?;
        // SAFETY: p is a live, never freed, zero-able allocation of 64 bytes, aligned for a u32
        // (the driver's host allocations are page-aligned), that only atomics touch from now.
        let word = unsafe { &*(p as *const std::sync::atomic::AtomicU32) };
        word.store(0, std::sync::atomic::Ordering::Release);
        Ok(Gate::new(word, dev))
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
        cu(
            "cuCtxGetCurrent",
            // SAFETY: &mut ctx is a valid pointer to write; the call only reads this thread's
            // current context (null when there is none).
            unsafe { sys::cuCtxGetCurrent(&mut ctx) },
            String::new,
        )?;
        if ctx.is_null() {
            return Ok(0);
        }
        let mut dev: sys::CUdevice = 0;
        cu(
            "cuCtxGetDevice",
            // SAFETY: a context is current (ctx is not null); &mut dev is a valid int to write.
            unsafe { sys::cuCtxGetDevice(&mut dev) },
            String::new,
        )?;
        Ok(dev)
    }

    fn push_device(&self, device: i32) -> Result<DeviceToken> {
        let ctx = self.primary_context(device)?;
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        cu(
            "cuCtxGetCurrent",
            // SAFETY: &mut prev is a valid pointer to write; the call only reads this thread's
            // current context (null when there is none).
            unsafe { sys::cuCtxGetCurrent(&mut prev) },
            String::new,
        )?;
        if prev != ctx {
            cu(
                "cuCtxSetCurrent",
                // SAFETY: ctx is a primary context retained for the process lifetime, so it is
                // alive; pop_device puts the previous context back.
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
        let prop = self.prop(device);
        let mut g = 0usize;
        cu(
            "cuMemGetAllocationGranularity",
            // SAFETY: prop is a fully initialised property struct for a valid device (checked);
            // &mut g is a valid size to write.
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
        cu(
            "cuMemGetInfo",
            // SAFETY: _scope made the device's primary context current; both are valid sizes to
            // write.
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
        cu(
            "cuMemAddressReserve",
            // SAFETY: &mut p is a valid address to write; alignment 0 means the granularity and
            // address 0 means no placement hint. Reserving touches no existing memory.
            unsafe { sys::cuMemAddressReserve(&mut p, size as usize, 0, 0, 0) },
            || format!("device {device}, {size} bytes"),
        )?;
        Ok(p)
    }

    fn free_range(&self, ptr: DevPtr, size: u64) -> Result<()> {
        cu(
            "cuMemAddressFree",
            // SAFETY: the trait's contract: ptr..ptr+size came from reserve() and nothing is
            // mapped in it, so no live memory is given up.
            unsafe { sys::cuMemAddressFree(ptr, size as usize) },
            || format!("ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn create(&self, device: i32, size: u64) -> Result<PhysHandle> {
        self.check_device(device)?;
        let prop = self.prop(device);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        cu(
            "cuMemCreate",
            // SAFETY: prop is a fully initialised property struct for a valid device (checked);
            // &mut h is a valid handle to write; flags must be 0.
            unsafe { sys::cuMemCreate(&mut h, size as usize, &prop, 0) },
            || format!("device {device}, {size} bytes"),
        )?;
        Ok(PhysHandle(h))
    }

    fn set_memory_flags(&self, flags: super::MemoryFlags) {
        let bits = u8::from(flags.rdma) | u8::from(flags.shareable) << 1;
        self.flags.store(bits, Ordering::Relaxed);
    }

    fn digest(
        &self,
        device: i32,
        ptr: DevPtr,
        len: u64,
        piece: u64,
        seed: u64,
        stream: Stream,
    ) -> Result<Vec<super::digest::Digest>> {
        self.digest_pieces(device, ptr, len, piece, seed, stream)
    }

    fn prepare_digest(&self, device: i32) -> Result<()> {
        self.prepare_digest_kernel(device)
    }

    fn handle_props(&self, handle: PhysHandle) -> Result<super::MemoryFlags> {
        // SAFETY: plain old data the call overwrites.
        let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        cu(
            "cuMemGetAllocationPropertiesFromHandle",
            // SAFETY: the symbol was checked at load; handle came from create() and is not
            // released (the engine's contract); &mut p is a valid struct to write.
            unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut p, handle.0) },
            || format!("handle {:#x}", handle.0),
        )?;
        // A bit set of handle types.
        let fd = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
        Ok(super::MemoryFlags {
            rdma: p.allocFlags.gpuDirectRDMACapable != 0,
            shareable: p.requestedHandleTypes.0 & fd != 0,
        })
    }

    fn export(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        cu(
            "cuMemExportToShareableHandle",
            // SAFETY: the symbol was checked at load; handle came from create() and is not
            // released; for a POSIX file descriptor the driver writes an int at the pointer.
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut std::ffi::c_int).cast(),
                    handle.0,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            || {
                format!(
                    "handle {:#x} (memory is exportable only where TMS_SHAREABLE=1 made it so)",
                    handle.0
                )
            },
        )?;
        // SAFETY: the driver returned a new file descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        cu(
            "cuMemRelease",
            // SAFETY: the handle came from create() and the engine releases each handle exactly
            // once; memory still mapped stays until it is unmapped, so no mapping dangles.
            unsafe { sys::cuMemRelease(handle.0) },
            || format!("handle {:#x}", handle.0),
        )
    }

    fn map(&self, ptr: DevPtr, size: u64, handle: PhysHandle) -> Result<()> {
        cu(
            "cuMemMap",
            // SAFETY: the trait's contract: the range is reserved and unmapped and the handle is
            // live and at least size bytes, so the mapping covers no memory anything else uses.
            unsafe { sys::cuMemMap(ptr, size as usize, 0, handle.0, 0) },
            || format!("ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn unmap(&self, ptr: DevPtr, size: u64) -> Result<()> {
        cu(
            "cuMemUnmap",
            // SAFETY: the trait's contract: the range was mapped by map() and no work still
            // uses it (the engine synchronizes the device first).
            unsafe { sys::cuMemUnmap(ptr, size as usize) },
            || format!("ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn set_access(&self, device: i32, ptr: DevPtr, size: u64) -> Result<()> {
        let desc = sys::CUmemAccessDesc {
            location: location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        cu(
            "cuMemSetAccess",
            // SAFETY: the range is mapped (the trait's contract); &desc points to the one
            // descriptor the count of 1 says.
            unsafe { sys::cuMemSetAccess(ptr, size as usize, &desc, 1) },
            || format!("device {device}, ptr {ptr:#x}, {size} bytes"),
        )
    }

    fn synchronize(&self, device: i32) -> Result<()> {
        let _fence = self.device_wide("cuCtxSynchronize");
        let _scope = super::DeviceScope::enter(self, device)?;
        cu(
            "cuCtxSynchronize",
            // SAFETY: _scope made the device's primary context current; the call only waits.
            unsafe { sys::cuCtxSynchronize() },
            || format!("device {device}"),
        )
    }

    fn stream(&self, device: i32) -> Result<Stream> {
        let i = self.check_device(device)?;
        super::kept_stream(&self.streams[i], || {
            let _scope = super::DeviceScope::enter(self, device)?;
            let mut s: sys::CUstream = std::ptr::null_mut();
            cu(
                "cuStreamCreate",
                // SAFETY: _scope made the device's context current; &mut s is a valid handle to
                // write. Flag 1 (non-blocking) keeps the stream from serialising with the legacy
                // default stream that PyTorch's work may use.
                unsafe { sys::cuStreamCreate(&mut s, 1) },
                || format!("device {device}"),
            )?;
            Ok(s as usize)
        })
    }

    fn gate(&self) -> Result<Gate> {
        self.gate.get_or_make(|| self.make_gate())
    }

    fn stream_wait_gate(&self, device: i32, stream: Stream, gate: Gate, value: u32) -> Result<()> {
        let _scope = super::DeviceScope::enter(self, device)?;
        self.gate_waits.stream_wait((device, stream, value), || {
            cu(
                "cuStreamWaitValue32",
                // SAFETY: the gate's word is device-mapped host memory that is never freed; the
                // symbol was probed when the gate was made; the stream handle is the caller's
                // (a stream of this device, or 0), which the driver validates.
                unsafe {
                    sys::cuStreamWaitValue32_v2(
                        stream.0 as sys::CUstream,
                        gate.dev,
                        value,
                        sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                    )
                },
                || {
                    format!(
                        "stream {:#x} of device {device} waiting for the resume gate to reach {value}",
                        stream.0
                    )
                },
            )
        })
    }

    fn thread_stream(&self) -> Option<Stream> {
        // CU_STREAM_PER_THREAD, a handle every driver call takes in place of a stream.
        Some(Stream(0x2))
    }

    fn stream_sync(&self, stream: Stream) -> Result<()> {
        cu(
            "cuStreamSynchronize",
            // SAFETY: the stream came from stream() and is never destroyed, so the handle is
            // alive.
            unsafe { sys::cuStreamSynchronize(stream.0 as sys::CUstream) },
            || format!("engine stream {:#x}", stream.0),
        )
    }

    fn event_create(&self, device: i32) -> Result<Event> {
        let _scope = super::DeviceScope::enter(self, device)?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        cu(
            "cuEventCreate",
            // SAFETY: _scope made the device's context current; &mut e is a valid handle to
            // write. 2 = CU_EVENT_DISABLE_TIMING.
            unsafe { sys::cuEventCreate(&mut e, 2) },
            || format!("device {device}"),
        )?;
        Ok(Event(e as u64))
    }

    fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        cu(
            "cuEventRecord",
            // SAFETY: the event came from event_create and is not destroyed yet (the caller's
            // duty); the stream came from stream() and is never destroyed.
            unsafe { sys::cuEventRecord(event.0 as sys::CUevent, stream.0 as sys::CUstream) },
            || format!("event {:#x} on stream {:#x}", event.0, stream.0),
        )
    }

    fn event_sync(&self, event: Event) -> Result<()> {
        cu(
            "cuEventSynchronize",
            // SAFETY: the event came from event_create and is not destroyed yet (the caller's
            // duty); the call only waits.
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
        cu(
            "cuMemcpyDtoHAsync",
            // SAFETY: this fn's contract: src..src+len is mapped and accessible, and
            // dst..dst+len is writable host memory that stays alive and untouched until the
            // stream (from stream(), never destroyed) is synchronized.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len as usize, stream.0 as sys::CUstream)
            },
            || format!("{len} bytes from {src:#x}"),
        )
    }

    unsafe fn copy_h2d(&self, dst: DevPtr, src: *const u8, len: u64, stream: Stream) -> Result<()> {
        cu(
            "cuMemcpyHtoDAsync",
            // SAFETY: this fn's contract: dst..dst+len is mapped and accessible, and
            // src..src+len is readable host memory that stays alive and unchanged until the
            // stream (from stream(), never destroyed) is synchronized.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len as usize, stream.0 as sys::CUstream)
            },
            || format!("{len} bytes to {dst:#x}"),
        )
    }

    unsafe fn host_register(&self, device: i32, ptr: *mut u8, len: u64) -> Result<()> {
        let _fence = self.device_wide("cuMemHostRegister");
        // cuMemHostRegister needs a current context: the one of the device backed up.
        let _scope = super::DeviceScope::enter(self, device)?;
        cu(
            "cuMemHostRegister",
            // SAFETY: this fn's contract: the range is page-aligned host memory mapped
            // read/write, registered nowhere else, and stays mapped until host_unregister;
            // _scope made a context current. PORTABLE (1) pins it for every context.
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len as usize, 1) },
            || format!("{len} bytes of host memory at {ptr:p}"),
        )
    }

    unsafe fn host_unregister(&self, device: i32, ptr: *mut u8) -> Result<()> {
        let _fence = self.device_wide("cuMemHostUnregister");
        let _scope = super::DeviceScope::enter(self, device)?;
        cu(
            "cuMemHostUnregister",
            // SAFETY: this fn's contract: ptr starts a registered range and no queued copy uses
            // it any more; _scope made a context current.
            unsafe { sys::cuMemHostUnregister(ptr.cast()) },
            || format!("host memory at {ptr:p}"),
        )
    }
}
