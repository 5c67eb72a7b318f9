//! The HIP driver: AMD's HIP runtime (`libamdhip64.so`), opened at run time (nothing links it),
//! through its virtual memory calls (`hipMemAddressReserve`, `hipMemCreate`, `hipMemMap`,
//! `hipMemSetAccess`, `hipMemUnmap`, `hipMemRelease`, `hipMemAddressFree`). `api.rs` holds the
//! C interface and finds the library; `ranges.rs` the books for ROCm's known bugs.
//!
//! Devices: HIP has one context per device and a current device per thread
//! (`hipSetDevice`); [`Driver::push_device`] sets it and [`Driver::pop_device`] puts back the
//! caller's, so a user thread's device is never changed behind its back.
//!
//! Granularity: the larger of the minimum and recommended granularities (ROCm 7.2 answers the
//! minimum, 4 KiB, for both; newer runtimes recommend 2 MiB), a multiple of the minimum, which
//! `hipMemCreate` insists on for sizes; reservations ask for it as their alignment.
//!
//! Not run on AMD hardware: the tests run this driver over a test double of the runtime
//! (`preload/tests/hip/libamdhip64.c`).

mod api;
mod ranges;

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use parking_lot::{Mutex, MutexGuard};

use super::gate::{GateCell, GATED_WAIT};
use super::{check, DevPtr, DeviceToken, Driver, Event, Gate, GateWaits, MemInfo, PhysHandle};
use super::{DeviceScope, Stream};
use crate::error::{Error, Result};
use api::{Api, HipError, HIP_ERROR_INVALID_VALUE, HIP_SUCCESS};
use ranges::{Ranges, Recycle};

/// A device number that [`DeviceToken`] never holds for a device: "the device was not changed".
const UNCHANGED: u64 = u64::MAX;

/// The `TMS_HIP_*` settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HipSettings {
    /// `TMS_HIP_LIBRARY`: the runtime to open instead of looking for one.
    pub library: Option<String>,
    /// `TMS_HIP_RESERVE_AGAIN` (default on): give paused memory back by freeing its range and
    /// reserving it again (Note [ROCm's reserved ranges] in `ranges.rs`).
    pub reserve_again: bool,
}

impl HipSettings {
    /// Read `TMS_HIP_LIBRARY` and `TMS_HIP_RESERVE_AGAIN`, naming a malformed one.
    pub fn from_env() -> Result<Self> {
        use crate::units::{env_parsed, parse_flag};
        Ok(HipSettings {
            library: env_parsed("TMS_HIP_LIBRARY", |s| Ok(s.to_string()))?
                .filter(|s| !s.is_empty()),
            reserve_again: env_parsed("TMS_HIP_RESERVE_AGAIN", parse_flag)?.unwrap_or(true),
        })
    }
}

/// The HIP runtime as a [`Driver`].
pub struct HipDriver {
    api: Api,
    /// What the runtime was opened as (a path or a file name).
    library: String,
    devices: i32,
    version: i32,
    reserve_again: bool,
    granularity: Vec<OnceLock<u64>>,
    streams: Vec<OnceLock<usize>>,
    gate: GateCell,
    gate_waits: GateWaits,
    ranges: Ranges,
    /// Held across our reservations, and from freeing a range to reserving it again, so that
    /// none of ours takes the address in between.
    addresses: Mutex<()>,
}

impl HipDriver {
    /// Open the HIP runtime as `TMS_HIP_*` say (a copy already loaded in the process first,
    /// else `libamdhip64.so`), initialise it and check its devices. An `Unsupported` error
    /// where there is none.
    pub fn load() -> Result<Self> {
        match Self::find(&HipSettings::from_env()?)? {
            Some(d) => Ok(d),
            None => Err(Error::unsupported(
                "no HIP runtime (libamdhip64.so) could be opened; set TMS_HIP_LIBRARY to its \
                 path, or TMS_BACKEND=sim to use the simulated device",
            )),
        }
    }

    /// [`HipDriver::load`] with `settings`; `Ok(None)` where no runtime can be found.
    pub fn find(settings: &HipSettings) -> Result<Option<Self>> {
        match Api::find(settings.library.as_deref())? {
            Some((api, library)) => Self::start(api, library, settings.reserve_again).map(Some),
            None => Ok(None),
        }
    }

    /// The runtime at `path` (a test double, in the tests), with `reserve_again`.
    pub fn load_from(path: &str, reserve_again: bool) -> Result<Self> {
        let settings = HipSettings {
            library: Some(path.to_string()),
            reserve_again,
        };
        Self::find(&settings)?.ok_or_else(|| Error::internal("a named library is always found"))
    }

    fn start(api: Api, library: String, reserve_again: bool) -> Result<Self> {
        let mut d = HipDriver {
            api,
            library,
            devices: 0,
            version: 0,
            reserve_again,
            granularity: Vec::new(),
            streams: Vec::new(),
            gate: GateCell::default(),
            gate_waits: GateWaits::new(GATED_WAIT),
            ranges: Ranges::default(),
            addresses: Mutex::new(()),
        };
        // SAFETY: hipInit has no precondition; 0 is its only flag value.
        d.hip("hipInit", unsafe { (d.api.init)(0) }, || {
            format!("initialising the HIP runtime {}", d.library)
        })?;
        let mut v = 0;
        // SAFETY: &mut v is a valid int to write.
        let r = unsafe { (d.api.driver_get_version)(&mut v) };
        d.hip("hipDriverGetVersion", r, String::new)?;
        let mut n = 0;
        // SAFETY: &mut n is a valid int to write; the runtime is initialised.
        let r = unsafe { (d.api.get_device_count)(&mut n) };
        d.hip("hipGetDeviceCount", r, String::new)?;
        if n <= 0 {
            return Err(Error::unsupported("the HIP runtime reports no device"));
        }
        for dev in 0..n {
            if d.attribute(api::ATTR_VMM_SUPPORTED, dev)? != 1 {
                return Err(Error::unsupported(format!(
                    "device {dev} does not support virtual memory management \
                     (hipDeviceAttributeVirtualMemoryManagementSupported is 0), which pauseable \
                     memory is made of"
                )));
            }
        }
        d.devices = n;
        d.version = v;
        d.granularity = (0..n).map(|_| OnceLock::new()).collect();
        d.streams = (0..n).map(|_| OnceLock::new()).collect();
        tracing::debug!("HIP runtime {} (version {v}), {n} devices", d.library);
        Ok(d)
    }

    /// The runtime's version (HIP's encoding: 70200000 for 7.2).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// What the runtime was opened as.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// `hipGetErrorName` of `code`.
    fn error_name(&self, code: HipError) -> String {
        // SAFETY: hipGetErrorName takes any code and returns a static string (or null).
        let p = unsafe { (self.api.get_error_name)(code) };
        if p.is_null() {
            return format!("hipError_t {code}");
        }
        // SAFETY: a NUL-terminated string the runtime keeps for the process's life.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The result of the HIP call `call`, which returned `code`: an error naming the call, the
    /// code and its name (out of memory is [`ErrorKind::OutOfMemory`]).
    ///
    /// [`ErrorKind::OutOfMemory`]: crate::error::ErrorKind::OutOfMemory
    fn hip(&self, call: &'static str, code: HipError, ctx: impl FnOnce() -> String) -> Result<()> {
        if code == HIP_SUCCESS {
            return Ok(());
        }
        check(call, code, &self.error_name(code), ctx)
    }

    fn check_device(&self, device: i32) -> Result<usize> {
        super::device_index(device, self.devices)
    }

    fn attribute(&self, attr: c_int, device: i32) -> Result<c_int> {
        let mut v = 0;
        // SAFETY: &mut v is a valid int to write; the runtime checks the device and attribute.
        let r = unsafe { (self.api.device_get_attribute)(&mut v, attr, device) };
        self.hip("hipDeviceGetAttribute", r, || {
            format!("attribute {attr} of device {device}")
        })?;
        Ok(v)
    }

    fn prop(device: i32) -> api::MemAllocationProp {
        api::MemAllocationProp {
            type_: api::MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_type: 0,
            location: api::MemLocation {
                type_: api::MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
        }
    }

    fn query_granularity(&self, device: i32, option: c_int) -> Result<u64> {
        let prop = Self::prop(device);
        let mut g = 0usize;
        // SAFETY: prop is a whole property struct for a valid device; &mut g is valid to write.
        let r = unsafe { (self.api.mem_get_allocation_granularity)(&mut g, &prop, option) };
        self.hip("hipMemGetAllocationGranularity", r, || {
            format!("device {device}, option {option}")
        })?;
        Ok(g as u64)
    }

    /// Keep a call that waits for the whole device apart from streams waiting on the gate.
    fn device_wide(&self, call: &str) -> Option<super::gate::DeviceWide<'_>> {
        self.gate_waits.device_wide_or_warn(self.gate.made(), call)
    }

    /// `hipMemAddressReserve` of `size` bytes aligned to `device`'s granularity, at `at` if
    /// given and free (a hint: the runtime may place it elsewhere). Callers hold `addresses`.
    fn reserve_at(&self, device: i32, size: u64, at: DevPtr) -> Result<DevPtr> {
        let align = self.granularity(device)?;
        let (mut p, hint): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), at as *mut c_void);
        // SAFETY: &mut p is a valid pointer to write; reserving touches no existing memory, and
        // an address asked for is only a request.
        let r = unsafe {
            (self.api.mem_address_reserve)(&mut p, size as usize, align as usize, hint, 0)
        };
        self.hip("hipMemAddressReserve", r, || {
            format!("device {device}, {size} bytes, at {at:#x}")
        })?;
        Ok(p as DevPtr)
    }

    fn address_free(&self, ptr: DevPtr, size: u64) -> Result<()> {
        // SAFETY: the range came from reserve_at and nothing is mapped in it (the trait's
        // contract, or the books' count), so no live memory is given up.
        let r = unsafe { (self.api.mem_address_free)(ptr as *mut c_void, size as usize) };
        self.hip("hipMemAddressFree", r, || {
            format!("ptr {ptr:#x}, {size} bytes")
        })
    }

    /// Reserve the lost range `r` again at its address; the error where it cannot be had.
    /// `_held` is the guard of `addresses`.
    fn reserve_lost(&self, r: Recycle, _held: &MutexGuard<'_, ()>) -> Result<()> {
        let err = match self.reserve_at(r.device, r.size, r.ptr) {
            Ok(p) if p == r.ptr => {
                self.ranges.set_lost(r.ptr, false);
                return Ok(());
            }
            Ok(p) => {
                if let Err(e) = self.address_free(p, r.size) {
                    tracing::error!("giving back a reservation at the wrong address: {e}");
                }
                Error::invalid_state(format!("the runtime reserved {p:#x} instead"))
            }
            Err(e) => e,
        };
        self.ranges.set_lost(r.ptr, true);
        Err(err.context(format!(
            "reserving again the address range {:#x} ({} bytes) of a paused allocation, given \
             up to return its memory (ROCm keeps released memory while its range is reserved): \
             something else holds that address now; the allocation stays paused with its \
             backup",
            r.ptr, r.size
        )))
    }

    /// Give back the memory `r`'s range holds: free the range and reserve it again at its
    /// address, none of our reservations in between (Note [ROCm's reserved ranges]).
    fn recycle(&self, r: Option<Recycle>) -> Result<()> {
        let Some(r) = r.filter(|_| self.reserve_again) else {
            return Ok(());
        };
        let held = self.addresses.lock();
        if let Err(e) = self.address_free(r.ptr, r.size) {
            self.ranges.held_again(r.ptr);
            return Err(e.context(format!(
                "freeing the address range {:#x} to return the memory released in it",
                r.ptr
            )));
        }
        self.reserve_lost(r, &held)
    }

    /// A word of page-locked, device-mapped host memory every device reads.
    fn make_gate(&self) -> Result<Gate> {
        let (Some(host_malloc), Some(device_pointer), Some(_)) = (
            self.api.host_malloc,
            self.api.host_get_device_pointer,
            self.api.stream_wait_value32,
        ) else {
            return Err(Error::unsupported(
                "the HIP runtime lacks hipHostMalloc, hipHostGetDevicePointer or \
                 hipStreamWaitValue32, which a non-blocking resume needs",
            ));
        };
        let device = self.current_device()?;
        if self.attribute(api::ATTR_CAN_USE_STREAM_WAIT_VALUE, device)? != 1 {
            return Err(Error::unsupported(format!(
                "device {device} cannot make streams wait on a value \
                 (hipDeviceAttributeCanUseStreamWaitValue is 0)"
            )));
        }
        let _scope = DeviceScope::enter(self, device)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: &mut p is a valid pointer to write. The memory is never freed, so the
        // reference below stays valid.
        let r = unsafe { host_malloc(&mut p, 64, api::HOST_MALLOC_GATE) };
        self.hip("hipHostMalloc", r, || "64 bytes for the resume gate".into())?;
        let mut dev: *mut c_void = std::ptr::null_mut();
        // SAFETY: p came from hipHostMalloc with the mapped flag; &mut dev is valid to write.
        let r = unsafe { device_pointer(&mut dev, p, 0) };
        self.hip("hipHostGetDevicePointer", r, || {
            format!("the resume gate at {p:p}")
        })?;
        // SAFETY: p is a live, never freed allocation of 64 bytes, page-aligned, that only
        // atomics touch from now.
        let word = unsafe { &*(p as *const std::sync::atomic::AtomicU32) };
        word.store(0, std::sync::atomic::Ordering::Release);
        Ok(Gate::new(word, dev as DevPtr))
    }
}

impl Driver for HipDriver {
    fn name(&self) -> &'static str {
        "hip"
    }

    fn device_count(&self) -> Result<i32> {
        Ok(self.devices)
    }

    fn current_device(&self) -> Result<i32> {
        let mut d = 0;
        // SAFETY: &mut d is a valid int to write; the call reads this thread's device.
        let r = unsafe { (self.api.get_device)(&mut d) };
        self.hip("hipGetDevice", r, String::new)?;
        Ok(d)
    }

    fn push_device(&self, device: i32) -> Result<DeviceToken> {
        self.check_device(device)?;
        let prev = self.current_device()?;
        if prev != device {
            // SAFETY: the device exists (checked); pop_device puts the previous one back.
            let r = unsafe { (self.api.set_device)(device) };
            self.hip("hipSetDevice", r, || format!("device {device}"))?;
        }
        // PyTorch may allocate while this thread captures a graph; our calls are not captured
        // work, so relax the capture mode meanwhile (where the runtime has the call).
        let mut mode = api::CAPTURE_MODE_RELAXED;
        if let Some(exchange) = self.api.exchange_capture_mode {
            // SAFETY: exchanges this thread's capture mode; restored in pop_device.
            let r = unsafe { exchange(&mut mode) };
            if r != HIP_SUCCESS {
                tracing::warn!("hipThreadExchangeStreamCaptureMode: {}", self.error_name(r));
                mode = api::CAPTURE_MODE_RELAXED;
            }
        }
        let was = if prev == device {
            UNCHANGED
        } else {
            prev as u64
        };
        Ok(DeviceToken(was, mode as u64))
    }

    fn pop_device(&self, token: DeviceToken) {
        if let Some(exchange) = self.api.exchange_capture_mode {
            let mut mode = token.1 as c_int;
            // SAFETY: restores the mode push_device replaced.
            let r = unsafe { exchange(&mut mode) };
            if r != HIP_SUCCESS {
                tracing::error!("restoring the stream capture mode: {}", self.error_name(r));
            }
        }
        if token.0 == UNCHANGED {
            return;
        }
        // SAFETY: restores the device that was current before push_device.
        let r = unsafe { (self.api.set_device)(token.0 as c_int) };
        if r != HIP_SUCCESS {
            tracing::error!("restoring the caller's HIP device: {}", self.error_name(r));
        }
    }

    fn granularity(&self, device: i32) -> Result<u64> {
        let i = self.check_device(device)?;
        if let Some(g) = self.granularity[i].get() {
            return Ok(*g);
        }
        let min = self.query_granularity(device, api::GRANULARITY_MINIMUM)?;
        if min == 0 {
            return Err(Error::unsupported(format!(
                "hipMemGetAllocationGranularity reports 0 bytes for device {device}"
            )));
        }
        // An older runtime may refuse the option: the minimum then.
        let g = match self.query_granularity(device, api::GRANULARITY_RECOMMENDED) {
            Ok(rec) if rec > min && rec % min == 0 => rec,
            _ => min,
        };
        Ok(*self.granularity[i].get_or_init(|| g))
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo> {
        let _scope = DeviceScope::enter(self, device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: _scope made the device current; both are valid sizes to write.
        let r = unsafe { (self.api.mem_get_info)(&mut free, &mut total) };
        self.hip("hipMemGetInfo", r, || format!("device {device}"))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn reserve(&self, device: i32, size: u64) -> Result<DevPtr> {
        self.check_device(device)?;
        let _a = self.addresses.lock();
        let p = self.reserve_at(device, size, 0)?;
        self.ranges.reserved(p, size, device);
        Ok(p)
    }

    fn free_range(&self, ptr: DevPtr, size: u64) -> Result<()> {
        let _a = self.addresses.lock();
        if self.ranges.freeing(ptr) {
            // Given up to return its memory and not had again: nothing is reserved there.
            return Ok(());
        }
        self.address_free(ptr, size)
    }

    fn create(&self, device: i32, size: u64) -> Result<PhysHandle> {
        self.check_device(device)?;
        let prop = Self::prop(device);
        let mut h: *mut c_void = std::ptr::null_mut();
        // SAFETY: prop is a whole property struct for a valid device (checked); &mut h is a
        // valid handle to write; flags must be 0.
        let r = unsafe { (self.api.mem_create)(&mut h, size as usize, &prop, 0) };
        self.hip("hipMemCreate", r, || {
            format!("device {device}, {size} bytes")
        })?;
        Ok(PhysHandle(h as u64))
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        // SAFETY: the handle came from create() and the engine releases each handle exactly
        // once; memory still mapped stays until it is unmapped.
        let r = unsafe { (self.api.mem_release)(handle.0 as *mut c_void) };
        self.hip("hipMemRelease", r, || format!("handle {:#x}", handle.0))?;
        self.recycle(self.ranges.released(handle.0))
    }

    fn map(&self, ptr: DevPtr, size: u64, handle: PhysHandle) -> Result<()> {
        {
            let held = self.addresses.lock();
            if let Some(lost) = self.ranges.lost_range_of(ptr, size) {
                self.reserve_lost(lost, &held)?;
            }
        }
        // SAFETY: the trait's contract: the range is reserved and unmapped and the handle is
        // live and at least size bytes, so the mapping covers no memory anything else uses.
        let r = unsafe {
            (self.api.mem_map)(
                ptr as *mut c_void,
                size as usize,
                0,
                handle.0 as *mut c_void,
                0,
            )
        };
        self.hip("hipMemMap", r, || format!("ptr {ptr:#x}, {size} bytes"))?;
        self.ranges.mapped(ptr, size, handle.0);
        Ok(())
    }

    fn unmap(&self, ptr: DevPtr, size: u64) -> Result<()> {
        // SAFETY: the trait's contract: the range was mapped by map() and no work still uses it.
        let r = unsafe { (self.api.mem_unmap)(ptr as *mut c_void, size as usize) };
        self.hip("hipMemUnmap", r, || format!("ptr {ptr:#x}, {size} bytes"))?;
        self.recycle(self.ranges.unmapped(ptr))
    }

    fn set_access(&self, device: i32, ptr: DevPtr, size: u64) -> Result<()> {
        let desc = api::MemAccessDesc {
            location: api::MemLocation {
                type_: api::MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            flags: api::MEM_ACCESS_READ_WRITE,
        };
        let set = |from: DevPtr, len: u64| {
            // SAFETY: the range is mapped (the trait's contract, or the books for a prefix);
            // &desc points to the one descriptor the count of 1 says.
            unsafe { (self.api.mem_set_access)(from as *mut c_void, len as usize, &desc, 1) }
        };
        let mut r = set(ptr, size);
        if r == HIP_ERROR_INVALID_VALUE {
            // Note [ROCm's reserved ranges]: the whole mapped prefix instead.
            if let Some(start) = self.ranges.mapped_prefix(ptr, size) {
                r = set(start, ptr + size - start);
            }
        }
        self.hip("hipMemSetAccess", r, || {
            format!("device {device}, ptr {ptr:#x}, {size} bytes")
        })
    }

    fn synchronize(&self, device: i32) -> Result<()> {
        let _fence = self.device_wide("hipDeviceSynchronize");
        let _scope = DeviceScope::enter(self, device)?;
        // SAFETY: _scope made the device current; the call only waits.
        let r = unsafe { (self.api.device_synchronize)() };
        self.hip("hipDeviceSynchronize", r, || format!("device {device}"))
    }

    fn stream(&self, device: i32) -> Result<Stream> {
        let i = self.check_device(device)?;
        super::kept_stream(&self.streams[i], || {
            let _scope = DeviceScope::enter(self, device)?;
            let mut s: *mut c_void = std::ptr::null_mut();
            // SAFETY: _scope made the device current; &mut s is a valid handle to write. A
            // non-blocking stream does not serialise with the null stream PyTorch's work uses.
            let r =
                unsafe { (self.api.stream_create_with_flags)(&mut s, api::STREAM_NON_BLOCKING) };
            self.hip("hipStreamCreateWithFlags", r, || format!("device {device}"))?;
            Ok(s as usize)
        })
    }

    fn thread_stream(&self) -> Option<Stream> {
        Some(Stream(api::STREAM_PER_THREAD))
    }

    fn stream_sync(&self, stream: Stream) -> Result<()> {
        // SAFETY: the stream came from stream() (never destroyed) or is hipStreamPerThread.
        let r = unsafe { (self.api.stream_synchronize)(stream.0 as *mut c_void) };
        self.hip("hipStreamSynchronize", r, || {
            format!("engine stream {:#x}", stream.0)
        })
    }

    fn event_create(&self, device: i32) -> Result<Event> {
        let _scope = DeviceScope::enter(self, device)?;
        let mut e: *mut c_void = std::ptr::null_mut();
        // SAFETY: _scope made the device current; &mut e is a valid handle to write.
        let r = unsafe { (self.api.event_create_with_flags)(&mut e, api::EVENT_DISABLE_TIMING) };
        self.hip("hipEventCreateWithFlags", r, || format!("device {device}"))?;
        Ok(Event(e as u64))
    }

    fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        // SAFETY: the event came from event_create and is not destroyed yet (the caller's
        // duty); the stream came from stream() and is never destroyed.
        let r = unsafe { (self.api.event_record)(event.0 as *mut c_void, stream.0 as *mut c_void) };
        self.hip("hipEventRecord", r, || {
            format!("event {:#x} on stream {:#x}", event.0, stream.0)
        })
    }

    fn event_sync(&self, event: Event) -> Result<()> {
        // SAFETY: the event came from event_create and is not destroyed yet; the call waits.
        let r = unsafe { (self.api.event_synchronize)(event.0 as *mut c_void) };
        self.hip("hipEventSynchronize", r, || format!("event {:#x}", event.0))
    }

    fn event_destroy(&self, event: Event) {
        // SAFETY: the event came from event_create; the caller does not use it again.
        let r = unsafe { (self.api.event_destroy)(event.0 as *mut c_void) };
        if r != HIP_SUCCESS {
            tracing::error!("hipEventDestroy: {}", self.error_name(r));
        }
    }

    unsafe fn copy_d2h(&self, dst: *mut u8, src: DevPtr, len: u64, stream: Stream) -> Result<()> {
        // SAFETY: this fn's contract: src..src+len is mapped and accessible, and dst..dst+len is
        // writable host memory that stays alive and untouched until the stream is synchronized.
        let r = unsafe {
            (self.api.memcpy_dtoh_async)(
                dst.cast(),
                src as *mut c_void,
                len as usize,
                stream.0 as *mut c_void,
            )
        };
        self.hip("hipMemcpyDtoHAsync", r, || {
            format!("{len} bytes from {src:#x}")
        })
    }

    unsafe fn copy_h2d(&self, dst: DevPtr, src: *const u8, len: u64, stream: Stream) -> Result<()> {
        // SAFETY: this fn's contract: dst..dst+len is mapped and accessible, and src..src+len is
        // readable host memory that stays alive and unchanged until the stream is synchronized
        // (the runtime only reads it, though its prototype is not const).
        let r = unsafe {
            (self.api.memcpy_htod_async)(
                dst as *mut c_void,
                src as *mut c_void,
                len as usize,
                stream.0 as *mut c_void,
            )
        };
        self.hip("hipMemcpyHtoDAsync", r, || {
            format!("{len} bytes to {dst:#x}")
        })
    }

    unsafe fn host_register(&self, device: i32, ptr: *mut u8, len: u64) -> Result<()> {
        let _fence = self.device_wide("hipHostRegister");
        let _scope = DeviceScope::enter(self, device)?;
        // SAFETY: this fn's contract: the range is page-aligned host memory mapped read/write,
        // registered nowhere else, that stays mapped until host_unregister.
        let r = unsafe {
            (self.api.host_register)(ptr.cast(), len as usize, api::HOST_REGISTER_PORTABLE)
        };
        self.hip("hipHostRegister", r, || {
            format!("{len} bytes of host memory at {ptr:p}")
        })
    }

    unsafe fn host_unregister(&self, device: i32, ptr: *mut u8) -> Result<()> {
        let _fence = self.device_wide("hipHostUnregister");
        let _scope = DeviceScope::enter(self, device)?;
        // SAFETY: this fn's contract: ptr starts a registered range no queued copy uses.
        let r = unsafe { (self.api.host_unregister)(ptr.cast()) };
        self.hip("hipHostUnregister", r, || format!("host memory at {ptr:p}"))
    }

    fn gate(&self) -> Result<Gate> {
        self.gate.get_or_make(|| self.make_gate())
    }

    fn stream_wait_gate(&self, device: i32, stream: Stream, gate: Gate, value: u32) -> Result<()> {
        let Some(wait) = self.api.stream_wait_value32 else {
            return Err(Error::unsupported(
                "the HIP runtime lacks hipStreamWaitValue32",
            ));
        };
        let _scope = DeviceScope::enter(self, device)?;
        self.gate_waits.stream_wait((device, stream, value), || {
            // HIP compares plainly (not cyclically, as the gate's counter would after 2^32
            // resumes): the word only grows, one step per restored allocation.
            // SAFETY: the gate's word is device-mapped host memory that is never freed; the
            // stream handle is the caller's (a stream of this device, or 0), which the runtime
            // checks.
            let r = unsafe {
                wait(
                    stream.0 as *mut c_void,
                    gate.dev as *mut c_void,
                    value,
                    api::STREAM_WAIT_VALUE_GTE,
                    u32::MAX,
                )
            };
            self.hip("hipStreamWaitValue32", r, || {
                format!(
                    "stream {:#x} of device {device} waiting for the resume gate to reach {value}",
                    stream.0
                )
            })
        })
    }
}
