//! The C names of the existing `torch_memory_saver` library, which its users call directly
//! through ctypes (`..._binary_wrapper.cdll.tms_set_interesting_region(False)` around an
//! allocation that must stay ordinary, for one). Same names and arguments; where the original
//! returns nothing, these return a status (a caller that ignores it loses nothing), and none of
//! them can end the process.
//!
//! The setters act on the calling thread's innermost region; with none open they open one from
//! the thread's effective settings (the original keeps one set of flags per thread, with no
//! enter/exit, so "the thread's region" is what its callers change). `tms_region_exit` closes it.
//!
//! Booleans: the original declares `bool`. Arguments are read as `int` and tested against 0,
//! and results are returned as an `int` of 0 or 1, which is what both a C caller of the `bool`
//! prototype (which widens its argument) and a ctypes caller without declared types (which
//! passes and reads an `int`) agree on.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};

use super::args::{arg_str, array_len, buffer_len, indices, opt_str, room};
use super::chunks::transact;
use super::progress::op_entry;
use super::status::entry;
use crate::backup::BackupKind;
use crate::control;
use crate::error::{Error, Result};
use crate::process::boundary::{catch, set_last_error};
use crate::process::settings;

/// The existing library's C `bool`, as an argument and as a result: an `int` of 0 or 1 here (see
/// above). tms.h declares it `bool`.
type CBool = c_int;

thread_local! {
    /// Storage behind the pointer `tms_get_current_tag` returns.
    static TAG_OUT: RefCell<CString> = RefCell::new(CString::default());
}

/// A boolean result for C: 1 or 0; a failure is 0 with the thread's last error set.
fn flag(r: Result<bool>) -> c_int {
    match r {
        Ok(b) => c_int::from(b),
        Err(e) => {
            set_last_error(&e);
            0
        }
    }
}

/// Allocations of this thread become pauseable (`is_interesting` true) or ordinary (false).
#[no_mangle]
pub extern "C" fn tms_set_interesting_region(is_interesting: CBool) -> c_int {
    entry(|| settings::update_region(|r| r.enabled = is_interesting != 0))
}

/// Whether this thread's allocations are pauseable now.
#[no_mangle]
pub extern "C" fn tms_get_interesting_region() -> CBool {
    catch(0, || flag(settings::in_region()))
}

/// Set the tag of this thread's region (non-empty).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_set_current_tag(tag: *const c_char) -> c_int {
    entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as opt_str needs.
        let tag = unsafe { opt_str(tag, "tag") }?
            .ok_or_else(|| Error::invalid_argument("tag is NULL"))?;
        if tag.is_empty() {
            return Err(Error::invalid_argument("a region's tag must not be empty"));
        }
        settings::update_region(|r| r.tag = tag.to_string())
    })
}

/// The tag of this thread's region. The string belongs to the calling thread and stays valid
/// until its next call of this function; NULL on failure (see `tms_last_error`).
#[no_mangle]
pub extern "C" fn tms_get_current_tag() -> *const c_char {
    catch(std::ptr::null(), || {
        let tag = match settings::current_region() {
            Ok(r) => r.tag,
            Err(e) => {
                set_last_error(&e);
                return std::ptr::null();
            }
        };
        // Tags come from C strings or the environment, so they hold no NUL; be safe anyway.
        let c = CString::new(tag.replace('\0', " ")).unwrap_or_default();
        TAG_OUT
            .try_with(|slot| {
                *slot.borrow_mut() = c;
                slot.borrow().as_ptr()
            })
            .unwrap_or(std::ptr::null())
    })
}

/// Keep a CPU backup of this thread's new pauseable allocations (`enable` true) or not.
#[no_mangle]
pub extern "C" fn tms_set_enable_cpu_backup(enable: CBool) -> c_int {
    entry(|| settings::update_region(|r| r.cpu_backup = enable != 0))
}

/// Whether this thread's new pauseable allocations keep a CPU backup.
#[no_mangle]
pub extern "C" fn tms_get_enable_cpu_backup() -> CBool {
    catch(0, || flag(settings::current_region().map(|r| r.cpu_backup)))
}

/// Keep a disk backup of this thread's new pauseable allocations (`enable` true) or not: each
/// one's contents go to a file of its own at pause and come back at resume. A disk backup and a
/// CPU backup are mutually exclusive: enabling one while the other is on is
/// `TMS_ERR_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn tms_set_enable_disk_backup(enable: CBool) -> c_int {
    entry(|| settings::update_region(|r| r.disk_backup = enable != 0))
}

/// Whether this thread's new pauseable allocations keep a disk backup.
#[no_mangle]
pub extern "C" fn tms_get_enable_disk_backup() -> CBool {
    catch(0, || {
        flag(settings::current_region().map(|r| r.disk_backup))
    })
}

/// Directory of the files of disk backups made from now on; NULL or `""` for the default
/// (`TMS_DISK_BACKUP_DIR`, else the system's temporary directory). It is made now if missing
/// (mode 0700), a relative path taken against the current folder now, and found again by its
/// path at each new file (engine Note [The disk backup folder] says why).
///
/// # Safety
/// `dir` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_set_disk_backup_dir(dir: *const c_char) -> c_int {
    entry(|| {
        // SAFETY: `dir` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as opt_str needs.
        let dir = unsafe { opt_str(dir, "dir") }?.filter(|d| !d.is_empty());
        control::runtime()?
            .engine
            .set_disk_backup_dir(dir.map(std::path::PathBuf::from))
    })
}

/// Host memory of this thread's CPU backups: `"pinned"`, `"mmap"`, or NULL for the process
/// default (`TMS_INIT_CPU_BACKUP_BACKEND`). Consulted only where a CPU backup is enabled.
///
/// # Safety
/// `backend` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_set_cpu_backup_backend(backend: *const c_char) -> c_int {
    entry(|| {
        // SAFETY: `backend` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as opt_str needs.
        let backend = match unsafe { opt_str(backend, "backend") }? {
            Some(b) => BackupKind::parse(b)?,
            None => settings::process()?.region.backend,
        };
        settings::update_region(|r| r.backend = backend)
    })
}

/// `"pinned"` or `"mmap"` (static strings): host memory of this thread's CPU backups, as a
/// region, a setter or `TMS_INIT_CPU_BACKUP_BACKEND` named it, else the default (`"pinned"`, as
/// the existing library reports it, with or without a CPU backup); NULL on failure.
#[no_mangle]
pub extern "C" fn tms_get_cpu_backup_backend() -> *const c_char {
    catch(std::ptr::null(), || match settings::current_region() {
        Ok(r) => {
            let name: &'static CStr = match r.backend {
                BackupKind::Mmap => c"mmap",
                // Never Disk: backends are parsed by BackupKind::parse, which refuses it.
                BackupKind::Pinned | BackupKind::Disk => c"pinned",
            };
            name.as_ptr()
        }
        Err(e) => {
            set_last_error(&e);
            std::ptr::null()
        }
    })
}

/// Refuse pauseable allocations that would leave fewer than `bytes` free on the device (the
/// existing library's name for `tms_set_memory_margin`).
#[no_mangle]
pub extern "C" fn set_memory_margin_bytes(bytes: u64) -> c_int {
    super::tms_set_memory_margin(bytes)
}

/// Whether host backups are kept across resume (`tms_set_retain_cpu_backup` sets it); false
/// also when the library cannot start (see `tms_last_error`, or use
/// `tms_query_retain_cpu_backup`).
#[no_mangle]
pub extern "C" fn tms_get_retain_cpu_backup() -> CBool {
    catch(0, || {
        flag(control::runtime().map(|rt| rt.engine.retain_cpu_backup()))
    })
}

/// The host backup of `[gpu_ptr, gpu_ptr + size)`, or NULL where there is none (no backup, the
/// allocation is active with its backup released, the range is not inside one pauseable
/// allocation, or the library cannot start; the last two set the last error). Valid as
/// `tms_get_cpu_backup`'s pointer is.
#[no_mangle]
pub extern "C" fn tms_get_cpu_backup_pointer(gpu_ptr: *const u8, size: u64) -> *mut u8 {
    catch(std::ptr::null_mut(), || {
        let r = control::runtime().and_then(|rt| rt.engine.cpu_backup_ptr(gpu_ptr as u64, size));
        match r {
            Ok(p) => p.map_or(std::ptr::null_mut(), |p| p.cast_mut()),
            Err(e) => {
                set_last_error(&e);
                std::ptr::null_mut()
            }
        }
    })
}

/// Make this thread's new pauseable allocations chunked, in chunks of `bytes` (0: not chunked;
/// else a multiple of the current device's granularity). Each allocation's size must then be a
/// multiple of it.
#[no_mangle]
pub extern "C" fn tms_set_chunk_size(bytes: usize) -> c_int {
    entry(|| {
        let bytes = bytes as u64;
        if bytes > 0 {
            control::runtime()?.engine.check_chunk_size(bytes)?;
        }
        settings::update_region(|r| r.chunk = bytes)
    })
}

/// The chunk size of this thread's new pauseable allocations (0: not chunked, or a failure; see
/// `tms_last_error`).
#[no_mangle]
pub extern "C" fn tms_get_chunk_size() -> usize {
    catch(0, || match settings::current_region() {
        Ok(r) => r.chunk as usize,
        Err(e) => {
            set_last_error(&e);
            0
        }
    })
}

/// Pause or resume chunks of the chunked allocation of `tag` (which must have exactly one).
///
/// # Safety
/// `idx` is readable for `n` entries; `tag` is a NUL-terminated string.
unsafe fn tag_chunks(tag: *const c_char, idx: *const usize, n: usize, pause: bool) -> c_int {
    op_entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as arg_str needs.
        let tag = unsafe { arg_str(tag, "tag") }?;
        // SAFETY: `idx` is readable for `n` entries (our callers' promise), as indices needs.
        let idx = unsafe { indices(idx, n as u64) }?;
        let start = control::runtime()?.engine.chunked(tag)?;
        transact(pause, &crate::engine::Pick::chunks(start, &idx))
    })
}

/// Pause chunks `idx[0..n]` of the chunked allocation of `tag` (saving them where its region
/// asked for a backup). Chunks already paused are skipped.
///
/// # Safety
/// `tag` is a NUL-terminated string; `idx` is readable for `n` entries.
#[no_mangle]
pub unsafe extern "C" fn tms_pause_chunks(
    tag: *const c_char,
    idx: *const usize,
    n: usize,
) -> c_int {
    // SAFETY: `tag` is NUL-terminated and `idx` readable for `n` entries (our callers'
    // promise), as tag_chunks needs.
    unsafe { tag_chunks(tag, idx, n, true) }
}

/// Resume chunks `idx[0..n]` of the chunked allocation of `tag`. Chunks already active are
/// skipped; out of memory leaves every one of them paused with its backup, and says which.
///
/// # Safety
/// As [`tms_pause_chunks`].
#[no_mangle]
pub unsafe extern "C" fn tms_resume_chunks(
    tag: *const c_char,
    idx: *const usize,
    n: usize,
) -> c_int {
    // SAFETY: `tag` is NUL-terminated and `idx` readable for `n` entries (our callers'
    // promise), as tag_chunks needs.
    unsafe { tag_chunks(tag, idx, n, false) }
}

/// The chunk layout of the chunked allocation of `tag`.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
unsafe fn tag_info(tag: *const c_char) -> Result<crate::engine::ChunkInfo> {
    // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
    // callers' promise), as arg_str needs.
    let tag = unsafe { arg_str(tag, "tag") }?;
    let e = &control::runtime()?.engine;
    e.chunk_info(e.chunked(tag)?)
}

/// Chunks of the chunked allocation of `tag`; 0 on failure (no such allocation, or several;
/// see `tms_last_error`).
///
/// # Safety
/// `tag` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_get_num_chunks_for_tag(tag: *const c_char) -> usize {
    catch(0, || {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_info needs.
        match unsafe { tag_info(tag) } {
            Ok(i) => i.active.len(),
            Err(e) => {
                set_last_error(&e);
                0
            }
        }
    })
}

/// Write each chunk's state of the chunked allocation of `tag` into `out` (1 = active, 0 =
/// paused; `n` at least the chunk count, bytes past it left as they are). True on success,
/// false on failure (see `tms_last_error`).
///
/// # Safety
/// `tag` is a NUL-terminated string; `out` is writable for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_get_chunk_states(tag: *const c_char, out: *mut u8, n: usize) -> CBool {
    catch(0, || {
        let r = (|| {
            // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
            // callers' promise), as tag_info needs.
            let info = unsafe { tag_info(tag) }?;
            room(n, info.active.len(), "the state array")?;
            let n = buffer_len(out.is_null(), n as u64, "the state array")?.unwrap_or(0);
            // SAFETY: the caller vouches for n writable bytes; buffer_len checked the pointer.
            let out = unsafe { std::slice::from_raw_parts_mut(out, n) };
            for (o, a) in out.iter_mut().zip(&info.active) {
                *o = u8::from(*a);
            }
            Ok(true)
        })();
        flag(r)
    })
}

/// Write each chunk's offset and size (bytes) of the chunked allocation of `tag` into
/// `offsets` and `sizes` (`n` entries each, at least the chunk count; entries past it are left
/// as they are).
///
/// # Safety
/// `tag` is a NUL-terminated string; `offsets` and `sizes` are writable for `n` entries.
#[no_mangle]
pub unsafe extern "C" fn tms_get_chunk_layout(
    tag: *const c_char,
    offsets: *mut usize,
    sizes: *mut usize,
    n: usize,
) -> c_int {
    entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_info needs.
        let info = unsafe { tag_info(tag) }?;
        room(n, info.layout.len(), "the layout arrays")?;
        let k = array_len::<usize>(
            offsets.is_null() || sizes.is_null(),
            n as u64,
            "offsets or sizes",
        )?
        .unwrap_or(0);
        // SAFETY: the caller vouches for n writable entries each; array_len checked the
        // pointers and that their bytes fit isize.
        let (o, s) = unsafe {
            (
                std::slice::from_raw_parts_mut(offsets, k),
                std::slice::from_raw_parts_mut(sizes, k),
            )
        };
        for (i, (off, len)) in info.layout.iter().enumerate() {
            o[i] = *off as usize;
            s[i] = *len as usize;
        }
        Ok(())
    })
}

/// The engine if the library has started in this process; none of its allocations exist
/// otherwise, so queries about them need not start it.
fn started_engine() -> Option<&'static crate::engine::Engine> {
    crate::process::runtime::get_if_started().map(|rt| &rt.engine)
}

/// Keep the whole allocation holding `ptr` mapped, at the same physical memory, across every
/// later pause and resume until it is freed (what NCCL user-buffer registration needs). Returns
/// the allocation's size in bytes; 0 for an address outside every pauseable allocation, and 0
/// with the last error set when it is refused (some of it is paused, or a pause or resume is
/// changing it). [`tms_keep_resident_ex`] tells the two apart by its status.
#[no_mangle]
pub extern "C" fn tms_keep_resident(ptr: *const c_void) -> usize {
    catch(0, || {
        let r = started_engine().map_or(Ok(0), |e| e.keep_resident(ptr as u64));
        match r {
            Ok(n) => usize::try_from(n).unwrap_or(usize::MAX),
            Err(e) => {
                set_last_error(&e);
                0
            }
        }
    })
}

/// [`tms_keep_resident`] with a status: `*out_size` (may be NULL) receives the allocation's
/// size, 0 for an address outside every pauseable allocation.
///
/// # Safety
/// `out_size` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tms_keep_resident_ex(ptr: u64, out_size: *mut u64) -> c_int {
    entry(|| {
        let n = started_engine().map_or(Ok(0), |e| e.keep_resident(ptr))?;
        if !out_size.is_null() {
            // SAFETY: the caller vouches that a non-NULL out_size is writable.
            unsafe { out_size.write(n) };
        }
        Ok(())
    })
}

/// The devices a pause or resume of `tag` (NULL or `""`: every tag) acts on, ascending: the
/// first `capacity` of them go to `out`; returns how many there are (more than `capacity`
/// when `out` is too short), or -1 with the last error set.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string; `out` is writable for `capacity` entries (it may
/// be NULL when `capacity` is 0).
#[no_mangle]
pub unsafe extern "C" fn tms_affected_devices(
    tag: *const c_char,
    out: *mut c_int,
    capacity: c_int,
) -> c_int {
    catch(-1, || {
        let r = (|| {
            // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
            // callers' promise), as opt_str needs.
            let tag = unsafe { opt_str(tag, "tag") }?.filter(|t| !t.is_empty());
            let cap = usize::try_from(capacity)
                .map_err(|_| Error::invalid_argument(format!("capacity {capacity} is negative")))?;
            if cap > 0 && out.is_null() {
                return Err(Error::invalid_argument(format!(
                    "out is NULL with a capacity of {cap}"
                )));
            }
            let devices = match started_engine() {
                Some(e) => e.affected_devices(tag)?,
                None => Vec::new(),
            };
            for (i, d) in devices.iter().take(cap).enumerate() {
                // SAFETY: i < cap, and the caller vouches for cap writable entries.
                unsafe { out.add(i).write(*d) };
            }
            Ok(c_int::try_from(devices.len()).unwrap_or(c_int::MAX))
        })();
        r.unwrap_or_else(|e| {
            set_last_error(&e);
            -1
        })
    })
}
