//! The device primitives the engine needs, as one small trait (the platform contract), with three
//! implementations: [`cuda`] (the CUDA driver API, opened at run time), [`hip`] (AMD's HIP
//! runtime, opened at run time) and [`sim`] (host memory standing in for a device, with capacity
//! limits and fault injection).
//!
//! Preconditions are stated per method; the engine is the only caller and upholds them. Every
//! method reports failure as an [`Error`](crate::Error) naming the driver call.

pub mod cuda;
pub mod digest;
pub mod gate;
pub mod hip;
pub mod sim;

pub use gate::{Gate, GateWaits};

use crate::error::Result;

/// A device virtual address.
pub type DevPtr = u64;

/// Opaque handle of a piece of physical device memory (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

/// Opaque handle of a stream (`CUstream`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(pub u64);

/// Opaque handle of an event (`CUevent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// Free and total device memory in bytes, as `cuMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes free on the device.
    pub free: u64,
    /// Bytes the device has.
    pub total: u64,
}

/// Token returned by [`Driver::push_device`], handed back to [`Driver::pop_device`]: what was
/// current before (driver-specific words).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceToken(pub u64, pub u64);

/// The device primitives. Implementations are thread-safe.
pub trait Driver: Send + Sync {
    /// `"cuda"`, `"hip"` or `"sim"`.
    fn name(&self) -> &'static str;
    /// Number of devices.
    fn device_count(&self) -> Result<i32>;
    /// The device of the calling thread's current context (0 where none is current).
    fn current_device(&self) -> Result<i32>;
    /// Make `device` current on this thread (and let this thread's driver calls run while a
    /// stream is being captured); returns a token to restore what was before.
    fn push_device(&self, device: i32) -> Result<DeviceToken>;
    /// Restore what was current before the matching [`Driver::push_device`].
    fn pop_device(&self, token: DeviceToken);
    /// Allocation granularity of `device` (sizes and addresses are multiples of it).
    fn granularity(&self, device: i32) -> Result<u64>;
    /// Free and total memory of `device`.
    fn mem_info(&self, device: i32) -> Result<MemInfo>;
    /// Reserve `size` bytes of device address space (`size` a multiple of the granularity).
    fn reserve(&self, device: i32, size: u64) -> Result<DevPtr>;
    /// Give back a range from [`Driver::reserve`]; nothing may be mapped in it.
    fn free_range(&self, ptr: DevPtr, size: u64) -> Result<()>;
    /// Create `size` bytes of physical memory on `device`.
    fn create(&self, device: i32, size: u64) -> Result<PhysHandle>;
    /// Release physical memory; it is returned to the device once it is also unmapped.
    fn release(&self, handle: PhysHandle) -> Result<()>;
    /// Map `handle` (at least `size` bytes) at `ptr`, inside a reserved, unmapped range.
    fn map(&self, ptr: DevPtr, size: u64, handle: PhysHandle) -> Result<()>;
    /// Unmap `[ptr, ptr+size)`, a range mapped by [`Driver::map`]. No work may still use it.
    fn unmap(&self, ptr: DevPtr, size: u64) -> Result<()>;
    /// Allow read/write access to a mapped range from `device`.
    fn set_access(&self, device: i32, ptr: DevPtr, size: u64) -> Result<()>;
    /// Wait for all work on `device` to finish.
    fn synchronize(&self, device: i32) -> Result<()>;
    /// The engine's own stream on `device`, created on first use and kept. One per device: each
    /// CUDA stream costs device memory (about 0.5 MiB, seen on an H200), and one stream keeps
    /// the link busy; copy workers wait for their own copies with events.
    fn stream(&self, device: i32) -> Result<Stream>;
    /// The calling thread's own default stream, where the driver has one (CUDA's per-thread
    /// default stream). Only for experiments: `tms-bench`'s probe, and a pause's copy workers
    /// under `CopyConfig::save_streams` (off by default); otherwise the engine keeps to
    /// [`Driver::stream`].
    fn thread_stream(&self) -> Option<Stream> {
        None
    }
    /// Wait for all work queued on `stream`.
    fn stream_sync(&self, stream: Stream) -> Result<()>;
    /// A new event on `device` (no timing).
    fn event_create(&self, device: i32) -> Result<Event>;
    /// Mark the point of `stream`'s queue that `event` stands for.
    fn event_record(&self, event: Event, stream: Stream) -> Result<()>;
    /// Wait for the work queued before the last record of `event`.
    fn event_sync(&self, event: Event) -> Result<()>;
    /// Destroy an event from [`Driver::event_create`]; failures are logged.
    fn event_destroy(&self, event: Event);
    /// Queue a device-to-host copy of `len` bytes on `stream`.
    ///
    /// # Safety
    /// `src..src+len` is mapped and accessible; `dst..dst+len` is writable host memory that stays
    /// alive and untouched until `stream` has been synchronized.
    unsafe fn copy_d2h(&self, dst: *mut u8, src: DevPtr, len: u64, stream: Stream) -> Result<()>;
    /// Queue a host-to-device copy of `len` bytes on `stream`.
    ///
    /// # Safety
    /// `dst..dst+len` is mapped and accessible; `src..src+len` is readable host memory that stays
    /// alive and unchanged until `stream` has been synchronized.
    unsafe fn copy_h2d(&self, dst: DevPtr, src: *const u8, len: u64, stream: Stream) -> Result<()>;
    /// Page-lock `[ptr, ptr+len)` for the devices (`cuMemHostRegister`), so copies from and to it
    /// run at link speed and can be asynchronous.
    ///
    /// # Safety
    /// The range is page-aligned host memory mapped read/write by the caller, overlapping no range
    /// registered already, and it stays mapped until [`Driver::host_unregister`] of `ptr`.
    /// `device`'s context does the registration (the memory is usable from every context): the
    /// device whose memory the buffer backs up, so a helper thread never opens a context (and
    /// takes memory) on another GPU.
    unsafe fn host_register(&self, device: i32, ptr: *mut u8, len: u64) -> Result<()>;
    /// Undo [`Driver::host_register`] of the range starting at `ptr`, in `device`'s context.
    ///
    /// # Safety
    /// `ptr` starts a registered range, and no queued copy still uses it.
    unsafe fn host_unregister(&self, device: i32, ptr: *mut u8) -> Result<()>;
    /// The driver's gate, made on first use and kept for the process's life (an
    /// `Unsupported` error where streams cannot wait on host memory). While a stream waits
    /// for a value the gate has not reached, [`Driver::synchronize`],
    /// [`Driver::host_register`] and [`Driver::host_unregister`] first wait, holding up no
    /// other call, until it has: on a GPU they would wait for that stream while blocking the
    /// copies that raise the gate (engine Note [Non-blocking resume]).
    fn gate(&self) -> Result<Gate>;
    /// Make `stream` (a stream of `device`, 0 for its legacy default stream; not the engine's)
    /// wait, without blocking the host, until `gate` has reached `value` (cyclically, see
    /// [`Gate::reached`]): work queued on it afterwards runs only then.
    fn stream_wait_gate(&self, device: i32, stream: Stream, gate: Gate, value: u32) -> Result<()>;
    /// How much more host memory this process can fill (`None`: unknown). The system's answer
    /// ([`crate::os::host_memory`]); the simulated device can pretend to be a smaller host.
    fn host_memory(&self) -> Option<crate::os::HostMemory> {
        crate::os::host_memory()
    }
    /// Make the physical memory of later [`Driver::create`] calls as `flags` ask, where the
    /// device can (a driver that cannot ignores them: [`Driver::handle_props`] says what a
    /// handle got).
    fn set_memory_flags(&self, _flags: MemoryFlags) {}
    /// The digests ([`digest`]) of each `piece`-byte piece of `[ptr, ptr+len)` (the last may
    /// be shorter), computed on `device` once the work queued on `stream` before is done, keyed
    /// by `seed`. The range is mapped and accessible; `len` and `piece` are multiples of 8.
    /// Drivers that cannot say `Unsupported`, and the engine then copies everything.
    fn digest(
        &self,
        _device: i32,
        _ptr: DevPtr,
        _len: u64,
        _piece: u64,
        _seed: u64,
        _stream: Stream,
    ) -> Result<Vec<digest::Digest>> {
        Err(crate::error::Error::unsupported(format!(
            "the {} driver cannot digest device memory",
            self.name()
        )))
    }
    /// Make ready on `device` what [`Driver::digest`] needs (on CUDA the kernel, JIT-compiled,
    /// and its scratch memory), which may wait for the device's queued work: a non-blocking
    /// resume does it before its caller returns, since its digests then run while the
    /// caller's stream waits for the resume (Note [Non-blocking resume]). Drivers that cannot
    /// digest have nothing to make.
    fn prepare_digest(&self, _device: i32) -> Result<()> {
        Ok(())
    }
    /// What the physical memory of `handle` was made with.
    fn handle_props(&self, _handle: PhysHandle) -> Result<MemoryFlags> {
        Err(crate::error::Error::unsupported(format!(
            "the {} driver cannot read a handle's properties",
            self.name()
        )))
    }
    /// A POSIX file descriptor another process can import `handle`'s memory with (the memory
    /// stays alive while an importer holds it, pauses notwithstanding). Only for memory made
    /// with [`MemoryFlags::shareable`].
    fn export(&self, _handle: PhysHandle) -> Result<std::os::fd::OwnedFd> {
        Err(crate::error::Error::unsupported(format!(
            "the {} driver cannot export memory",
            self.name()
        )))
    }
}

/// How physical memory is made (`TMS_RDMA`, `TMS_SHAREABLE`), and what a handle got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryFlags {
    /// Usable by GPUDirect RDMA (a NIC registers it for NCCL or UCX over InfiniBand), where the
    /// device supports it with virtual memory management.
    pub rdma: bool,
    /// Exportable as a POSIX file descriptor ([`Driver::export`]), where the device supports it.
    pub shareable: bool,
}

/// RAII scope that keeps a device current on this thread and restores the previous one.
pub struct DeviceScope<'a> {
    driver: &'a dyn Driver,
    token: DeviceToken,
}

impl<'a> DeviceScope<'a> {
    /// Make `device` current until the scope is dropped.
    pub fn enter(driver: &'a dyn Driver, device: i32) -> Result<Self> {
        let token = driver.push_device(device)?;
        Ok(DeviceScope { driver, token })
    }
}

impl Drop for DeviceScope<'_> {
    fn drop(&mut self) {
        self.driver.pop_device(self.token);
    }
}

/// `device` as an index, if it is one of the `devices` the machine has.
pub(crate) fn device_index(device: i32, devices: i32) -> Result<usize> {
    if device < 0 || device >= devices {
        return Err(crate::error::Error::invalid_argument(format!(
            "device {device} does not exist (this machine has {devices})"
        )));
    }
    Ok(device as usize)
}

/// Waits tried after a copy or its wait failed, each on the stream and then on the device,
/// before the queue is given up on. A failed wait leaves the work queued (it runs at a later
/// synchronization, as on a GPU whose work goes on whatever the host's wait did), so the caller's
/// memory is handed back only once a wait has succeeded.
pub(crate) const SETTLE_TRIES: usize = 3;

/// Wait until nothing queued on `stream` is left; false if no wait succeeded.
pub(crate) fn settle(d: &dyn Driver, device: i32, stream: Stream) -> bool {
    (0..SETTLE_TRIES).any(|_| d.stream_sync(stream).is_ok() || d.synchronize(device).is_ok())
}

/// The engine's stream kept in `cell`, made by `make` on first use. A racing thread may make a
/// second one; the loser's stream is kept alive unused.
pub(crate) fn kept_stream(
    cell: &std::sync::OnceLock<usize>,
    make: impl FnOnce() -> Result<usize>,
) -> Result<Stream> {
    if let Some(s) = cell.get() {
        return Ok(Stream(*s as u64));
    }
    let s = make()?;
    Ok(Stream(*cell.get_or_init(|| s) as u64))
}

/// Symbolic name of a CUDA driver status, for the codes this library meets.
pub fn cuda_error_name(code: i32) -> &'static str {
    match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR_OTHER",
    }
}

/// Turn a driver status into a `Result`: out-of-memory becomes an error of kind
/// [`ErrorKind::OutOfMemory`](crate::error::ErrorKind::OutOfMemory), anything else
/// [`ErrorKind::Driver`](crate::error::ErrorKind::Driver).
pub(crate) fn check(
    call: &'static str,
    code: i32,
    name: &str,
    context: impl FnOnce() -> String,
) -> Result<()> {
    use crate::error::Error;
    match code {
        0 => Ok(()),
        2 => Err(Error::out_of_memory(format!(
            "{call} returned {name}: {}",
            context()
        ))),
        _ => Err(Error::driver(call, code, name, context())),
    }
}
