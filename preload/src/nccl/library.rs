//! The NCCL the process loaded: its entry points found when first needed, and the calls the
//! library makes of them. The only `unsafe` of the NCCL support besides the interposers' own
//! (`hooks/nccl.rs`).
//!
//! An entry point is the next definition after ours in link order (`dlsym(RTLD_NEXT)`: the
//! real one, when libtms.so is preloaded), else the one of an already loaded `libnccl.so.2`
//! (found by its soname with `RTLD_NOLOAD`, never loaded by us: the library is loaded locally,
//! as PyTorch's pluggable allocator loads it, or NCCL was opened by the program itself).
//! Nothing is looked up at load time, and an address inside libtms.so (our own interposer, met
//! when the library is loaded twice) is never taken for the real one.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;
use std::time::Duration;

use crate::error::{Error, Result};

/// `ncclSuccess`.
pub const NCCL_SUCCESS: c_int = 0;
/// `ncclSystemError`: what an interposer returns where no NCCL below it has the call.
pub const NCCL_SYSTEM_ERROR: c_int = 2;
/// `ncclInProgress`: a non-blocking communicator's call goes on in the background.
pub const NCCL_IN_PROGRESS: c_int = 7;
/// `NCCL_SUSPEND_MEM`.
const SUSPEND_MEM: c_int = 1;
/// The first NCCL with `ncclCommSuspend`, `ncclCommResume` and `ncclCommMemStats`.
pub const SUSPEND_SINCE: &str = "2.29.7";

/// `ncclCommMemStat_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemStat {
    /// `ncclStatGpuMemSuspend`: memory that can be suspended.
    Suspendable = 0,
    /// `ncclStatGpuMemPersist`: memory kept while suspended.
    Persistent = 2,
    /// `ncclStatGpuMemTotal`: all memory NCCL tracks.
    Total = 3,
}

/// What the library asks of NCCL (a trait, so the registry's logic is tested without one).
pub trait Library: Send + Sync {
    /// `ncclGetVersion`'s code; `None` where no NCCL is loaded.
    fn version(&self) -> Option<i32>;
    /// Whether it has `ncclCommSuspend`, `ncclCommResume` and `ncclCommMemStats`.
    fn can_suspend(&self) -> bool;
    /// `ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`, to its end.
    fn suspend(&self, comm: usize) -> Result<()>;
    /// `ncclCommResume(comm)`, to its end.
    fn resume(&self, comm: usize) -> Result<()>;
    /// `ncclCommMemStats(comm, stat)`.
    fn mem_stat(&self, comm: usize, stat: MemStat) -> Result<u64>;
    /// `ncclCommCuDevice(comm)`, where it answers.
    fn device(&self, comm: usize) -> Option<i32>;
    /// Where `comm`'s queued non-blocking calls stand (`ncclCommGetAsyncError`), without
    /// waiting: `Some(true)` all ended well, `Some(false)` still running, `None` one failed or
    /// this NCCL cannot say.
    fn settled(&self, comm: usize) -> Option<bool>;
}

/// `2.29.7` for NCCL's version code (`NCCL_VERSION(X,Y,Z)`: X*1000+Y*100+Z up to 2.8, then
/// X*10000+Y*100+Z).
pub fn version_words(code: i32) -> String {
    let (major, rest) = if code >= 20900 {
        (code / 10000, code % 10000)
    } else {
        (code / 1000, code % 1000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// The name of an `ncclResult_t`.
pub fn result_name(code: c_int) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "an unknown ncclResult_t",
    }
}

/// The base address of the object holding `addr` (0 where none).
fn object_of(addr: *const c_void) -> usize {
    // SAFETY: dladdr only reads the loader's tables; `info` is a plain out-parameter.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(addr, &mut info) == 0 {
            return 0;
        }
        info.dli_fbase as usize
    }
}

/// NCCL's definition of `name`, or 0. Not cached here: [`symbol`] caches what it finds.
fn lookup(name: &CStr) -> usize {
    let ours = object_of(lookup as *const c_void);
    let not_ours = |p: *mut c_void| (!p.is_null() && object_of(p) != ours).then_some(p as usize);
    // SAFETY: a lookup of a NUL-terminated name; nothing is called.
    if let Some(p) = not_ours(unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) }) {
        return p;
    }
    // SAFETY: RTLD_NOLOAD only hands out an object that is loaded already; the extra
    // reference is dropped at once (its owner keeps it loaded).
    unsafe {
        let h = libc::dlopen(
            c"libnccl.so.2".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        );
        if h.is_null() {
            return 0;
        }
        let p = libc::dlsym(h, name.as_ptr());
        libc::dlclose(h);
        not_ours(p).unwrap_or(0)
    }
}

/// NCCL's `name`, found once (an absent one is looked for again next time: NCCL may be loaded
/// later); 0 where there is none.
pub fn symbol(name: &'static CStr, slot: &'static OnceLock<usize>) -> usize {
    if let Some(p) = slot.get() {
        return *p;
    }
    match lookup(name) {
        0 => 0,
        p => *slot.get_or_init(|| p),
    }
}

type VersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type SuspendFn = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type CommFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type MemStatsFn = unsafe extern "C" fn(*mut c_void, c_int, *mut u64) -> c_int;
type CommIntFn = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;
type LastErrorFn = unsafe extern "C" fn(*mut c_void) -> *const c_char;

/// NCCL's `name` as a function of type `F`, where there is one.
///
/// # Safety
/// `F` is the function pointer type nccl.h gives `name`.
unsafe fn entry<F: Copy>(name: &CStr) -> Option<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<usize>()) };
    match lookup(name) {
        0 => None,
        // SAFETY: a non-null address of NCCL's `name`, whose type is `F` (our caller's promise).
        p => Some(unsafe { std::mem::transmute_copy::<usize, F>(&p) }),
    }
}

/// The calls the library makes of NCCL, as the NCCL loaded has them.
#[derive(Clone, Copy)]
struct Calls {
    version: Option<VersionFn>,
    suspend: Option<SuspendFn>,
    resume: Option<CommFn>,
    mem_stats: Option<MemStatsFn>,
    cu_device: Option<CommIntFn>,
    async_error: Option<CommIntFn>,
    last_error: Option<LastErrorFn>,
}

impl Calls {
    /// Found once NCCL is loaded (an NCCL that lacks some lacks them for good); looked for
    /// again at each use until then.
    fn get() -> Calls {
        static FOUND: OnceLock<Calls> = OnceLock::new();
        if let Some(c) = FOUND.get() {
            return *c;
        }
        // SAFETY: each name with its type in nccl.h.
        let c = unsafe {
            Calls {
                version: entry(c"ncclGetVersion"),
                suspend: entry(c"ncclCommSuspend"),
                resume: entry(c"ncclCommResume"),
                mem_stats: entry(c"ncclCommMemStats"),
                cu_device: entry(c"ncclCommCuDevice"),
                async_error: entry(c"ncclCommGetAsyncError"),
                last_error: entry(c"ncclGetLastError"),
            }
        };
        if c.version.is_some() {
            return *FOUND.get_or_init(|| c);
        }
        c
    }

    /// `call`, where this NCCL has it.
    fn need<F>(f: Option<F>, call: &str) -> Result<F> {
        f.ok_or_else(|| Error::unsupported(format!("the NCCL loaded has no {call}")))
    }

    /// The outcome of `call` on `comm`, once it is over: a non-blocking communicator answers
    /// `ncclInProgress` and finishes in the background, which its async error tells.
    fn finished(self, call: &'static str, comm: usize, mut rc: c_int) -> Result<()> {
        if let (NCCL_IN_PROGRESS, Some(f)) = (rc, self.async_error) {
            loop {
                // SAFETY: comm is a live communicator (the registry keeps it so while it calls),
                // rc a plain out-parameter.
                let r = unsafe { f(comm as *mut c_void, &mut rc) };
                if r != NCCL_SUCCESS {
                    rc = r;
                }
                if rc != NCCL_IN_PROGRESS {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if rc == NCCL_SUCCESS {
            return Ok(());
        }
        // What NCCL said, if anything (the caller names the communicator).
        let said = self.last_error.map_or(String::new(), |f| {
            // SAFETY: ncclGetLastError returns NULL or a NUL-terminated string NCCL owns.
            let p = unsafe { f(comm as *mut c_void) };
            if p.is_null() {
                return String::new();
            }
            // SAFETY: as above; copied before anything else calls NCCL.
            unsafe { CStr::from_ptr(p) }
                .to_string_lossy()
                .trim()
                .to_string()
        });
        Err(Error::driver(call, rc, result_name(rc), said))
    }
}

/// The NCCL of this process.
pub struct Loaded;

impl Library for Loaded {
    fn version(&self) -> Option<i32> {
        let f = Calls::get().version?;
        let mut v: c_int = 0;
        // SAFETY: v is a plain out-parameter.
        (unsafe { f(&mut v) } == NCCL_SUCCESS).then_some(v)
    }

    fn can_suspend(&self) -> bool {
        let c = Calls::get();
        c.suspend.is_some() && c.resume.is_some() && c.mem_stats.is_some()
    }

    fn suspend(&self, comm: usize) -> Result<()> {
        let c = Calls::get();
        let f = Calls::need(c.suspend, "ncclCommSuspend")?;
        // NCCL's memory is NCCL's: its cudaFree calls go to the runtime.
        let _own = crate::threads::Reentry::enter();
        // SAFETY: comm is a live communicator (the registry keeps it so while it calls).
        let rc = unsafe { f(comm as *mut c_void, SUSPEND_MEM) };
        c.finished("ncclCommSuspend", comm, rc)
    }

    fn resume(&self, comm: usize) -> Result<()> {
        let c = Calls::get();
        let f = Calls::need(c.resume, "ncclCommResume")?;
        // The memory NCCL takes again is NCCL's, never pauseable (as when it made the
        // communicator): its cudaMalloc calls go to the runtime, also on a thread in a region.
        let _own = crate::threads::Reentry::enter();
        // SAFETY: as for suspend.
        let rc = unsafe { f(comm as *mut c_void) };
        c.finished("ncclCommResume", comm, rc)
    }

    fn mem_stat(&self, comm: usize, stat: MemStat) -> Result<u64> {
        let c = Calls::get();
        let f = Calls::need(c.mem_stats, "ncclCommMemStats")?;
        let mut v = 0u64;
        // SAFETY: as for suspend; v is a plain out-parameter.
        let rc = unsafe { f(comm as *mut c_void, stat as c_int, &mut v) };
        c.finished("ncclCommMemStats", comm, rc).map(|()| v)
    }

    fn settled(&self, comm: usize) -> Option<bool> {
        let f = Calls::get().async_error?;
        let mut rc: c_int = NCCL_SUCCESS;
        // SAFETY: comm is a live communicator (the registry forgets it before it ends), rc a
        // plain out-parameter.
        let r = unsafe { f(comm as *mut c_void, &mut rc) };
        match (r, rc) {
            (NCCL_SUCCESS, NCCL_SUCCESS) => Some(true),
            (NCCL_SUCCESS, NCCL_IN_PROGRESS) => Some(false),
            _ => None,
        }
    }

    fn device(&self, comm: usize) -> Option<i32> {
        let f = Calls::get().cu_device?;
        let mut d: c_int = -1;
        // SAFETY: as for suspend; d is a plain out-parameter.
        (unsafe { f(comm as *mut c_void, &mut d) } == NCCL_SUCCESS && d >= 0).then_some(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_read_as_nccl_writes_them() {
        assert_eq!(version_words(22907), "2.29.7");
        assert_eq!(version_words(23007), "2.30.7");
        assert_eq!(version_words(2804), "2.8.4");
        assert_eq!(version_words(21803), "2.18.3");
    }
}
