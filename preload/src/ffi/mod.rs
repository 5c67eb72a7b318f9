//! The C ABI of `libtms.so`, used by the Python shim (through ctypes) and by C callers.
//!
//! Conventions (see `include/tms.h`): every function returns a status code (`TMS_OK` = 0, else
//! a `TMS_ERR_*`); on failure the calling thread's last-error message says what and where
//! (`tms_last_error`). No panic crosses this boundary: each entry point runs inside [`catch`].
//! String arguments are NUL-terminated UTF-8; NULL where a tag is optional means "every tag".

use std::ffi::{c_char, c_int, c_void};
use std::os::unix::ffi::OsStrExt;

use crate::backup::BackupKind;
use crate::control;
use crate::error::Error;
use crate::process::boundary::catch;
use crate::process::{runtime, settings};

use args::{buffer_len, opt_str, tag_or_all};
use status::{entry, write_bytes_out, write_out};

mod args;
mod checks;
mod chunks;
mod export;
mod nccl;
mod progress;
mod restore;
mod status;
mod upstream;

// Every export is also `tms::ffi::NAME` in Rust (tmsctl's demo checks its function types against
// them).
pub use self::{chunks::*, export::*, nccl::*, progress::*, restore::*, status::*, upstream::*};

/// Start the library now (it otherwise starts at the first pauseable allocation) and write the
/// driver's name (`cuda`, `hip` or `sim`) into `buf`.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_init(buf: *mut c_char, cap: usize, out_len: *mut usize) -> c_int {
    entry(|| {
        control::runtime().and_then(|rt| {
            // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
            // callers' promise), as write_out needs.
            unsafe { write_out(rt.engine.driver().name(), buf, cap, out_len) }
        })
    })
}

/// 1 if the library has started successfully in this process (and it is not a fork child), else
/// 0. Never starts it.
#[no_mangle]
pub extern "C" fn tms_is_active() -> c_int {
    catch(0, || c_int::from(runtime::get_if_started().is_some()))
}

/// Enter a region on the calling thread. With `enabled != 0`, allocations become pauseable
/// under `tag` (NULL: keep the enclosing region's tag), with a CPU backup when `cpu_backup != 0`
/// in `backend` host memory (`"pinned"`, `"mmap"`, or NULL for the process default; a backend
/// without `cpu_backup` is an invalid argument). `enabled = 0` opens a non-pauseable scope
/// (Python's `disable()`). Regions nest; leave with [`tms_region_exit`].
///
/// # Safety
/// `tag` and `backend` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn tms_region_enter(
    enabled: c_int,
    tag: *const c_char,
    cpu_backup: c_int,
    backend: *const c_char,
) -> c_int {
    entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as opt_str needs.
        let tag = unsafe { opt_str(tag, "tag") }?;
        // SAFETY: `backend` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as opt_str needs.
        let backend = unsafe { opt_str(backend, "backend") }?;
        let cur = settings::current_region()?;
        let backend = match backend {
            Some(b) => {
                let b = BackupKind::parse(b)?;
                if cpu_backup == 0 {
                    return Err(Error::invalid_argument(format!(
                        "CPU backup backend {:?} given without enabling CPU backup",
                        b.as_str()
                    )));
                }
                b
            }
            // A non-pauseable scope keeps the enclosing region's, with its CPU backup flag.
            None if enabled == 0 => cur.backend,
            None => settings::process()?.region.backend,
        };
        settings::push_region(settings::RegionSettings {
            enabled: enabled != 0,
            tag: tag.map_or(cur.tag, str::to_string),
            cpu_backup: if enabled != 0 {
                cpu_backup != 0
            } else {
                cur.cpu_backup
            },
            backend,
            // A new pauseable region asks for a disk backup with tms_set_enable_disk_backup.
            disk_backup: enabled == 0 && cur.disk_backup,
            // And a chunk size with tms_set_chunk_size.
            chunk: if enabled == 0 { cur.chunk } else { 0 },
        })
    })
}

/// Leave the innermost region of the calling thread (`TMS_ERR_INVALID_STATE` if none).
#[no_mangle]
pub extern "C" fn tms_region_exit() -> c_int {
    entry(|| settings::pop_region().map(|_| ()))
}

/// The calling thread's effective region settings as JSON:
/// `{"enabled":..,"tag":..,"cpu_backup":..,"backend":..,"depth":..}`.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_region_current(
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    entry(|| {
        settings::current_region().and_then(|r| {
            let j = serde_json::json!({
                "enabled": r.enabled,
                "tag": r.tag,
                "cpu_backup": r.cpu_backup,
                "backend": r.backend.as_str(),
                "depth": settings::region_depth(),
            })
            .to_string();
            // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
            // callers' promise), as write_out needs.
            unsafe { write_out(&j, buf, cap, out_len) }
        })
    })
}

/// Pause every active allocation of `tag` (NULL or `""`: every tag): back up the contents where
/// a CPU backup was asked, then give the device memory back. Touching a paused range faults.
/// The tag `"nccl"` suspends NCCL's communicators instead (every tag includes them only where
/// `tms_nccl_set_in_all` asked); an allocation holding a buffer NCCL registered stays mapped
/// (or the pause fails: `tms_nccl_set_registered`).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_pause(tag: *const c_char) -> c_int {
    progress::op_entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        progress::noted(true, control::runtime()?.engine.pause(tag))
    })
}

/// Resume every paused allocation of `tag` (NULL or `""`: every tag) at the same addresses,
/// restoring backed-up contents. Out of memory leaves the tag paused with its backups; call
/// again once memory is free. The tag `"nccl"` resumes NCCL's communicators.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_resume(tag: *const c_char) -> c_int {
    progress::op_entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        progress::noted(false, control::runtime()?.engine.resume(tag))
    })
}

/// Keep host backups across resume (`on != 0`), so a later pause need not allocate them.
#[no_mangle]
pub extern "C" fn tms_set_retain_cpu_backup(on: c_int) -> c_int {
    entry(|| {
        control::runtime()?.engine.set_retain_cpu_backup(on != 0);
        Ok(())
    })
}

/// Whether host backups are kept across resume, into `*out` (0 or 1). (The existing library's
/// `bool tms_get_retain_cpu_backup(void)` cannot report a failure.)
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_query_retain_cpu_backup(out: *mut c_int) -> c_int {
    entry(|| {
        if out.is_null() {
            return Err(Error::invalid_argument("out is NULL"));
        }
        let v = control::runtime()?.engine.retain_cpu_backup();
        // SAFETY: non-null, caller vouches it is writable.
        unsafe { *out = c_int::from(v) };
        Ok(())
    })
}

/// Refuse pauseable allocations that would leave fewer than `bytes` free on the device.
#[no_mangle]
pub extern "C" fn tms_set_memory_margin(bytes: u64) -> c_int {
    entry(|| {
        control::runtime()?.engine.set_memory_margin(bytes);
        Ok(())
    })
}

/// The memory margin in bytes, into `*out`.
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_get_memory_margin(out: *mut u64) -> c_int {
    entry(|| {
        if out.is_null() {
            return Err(Error::invalid_argument("out is NULL"));
        }
        let v = control::runtime()?.engine.memory_margin();
        // SAFETY: non-null, caller vouches it is writable.
        unsafe { *out = v };
        Ok(())
    })
}

/// Address of the host backup of `[addr, addr + len)` in `*out`, or NULL where there is no
/// complete snapshot. `TMS_ERR_NOT_FOUND` if the range does not lie inside one pauseable
/// allocation. Unguarded: the bytes change with the next pause and go with a resume without
/// retention or a free. Prefer [`tms_acquire_cpu_backup`].
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_get_cpu_backup(addr: u64, len: u64, out: *mut *const c_void) -> c_int {
    entry(|| {
        if out.is_null() {
            return Err(Error::invalid_argument("out is NULL"));
        }
        let p = control::runtime()?.engine.cpu_backup_ptr(addr, len)?;
        // SAFETY: non-null, caller vouches it is writable.
        unsafe { *out = p.map_or(std::ptr::null(), |p| p.cast()) };
        Ok(())
    })
}

/// As [`tms_get_cpu_backup`], but the bytes at `*out` stay mapped and unchanged until
/// `tms_release_cpu_backup(*lease)`: a pause writes a new buffer instead, and a resume or free
/// leaves this one to the lease. `*out` is NULL (and `*lease` 0) where there is none.
///
/// # Safety
/// `out` and `lease` are writable.
#[no_mangle]
pub unsafe extern "C" fn tms_acquire_cpu_backup(
    addr: u64,
    len: u64,
    out: *mut *const c_void,
    lease: *mut u64,
) -> c_int {
    entry(|| {
        if out.is_null() || lease.is_null() {
            return Err(Error::invalid_argument("out or lease is NULL"));
        }
        let got = control::runtime()?.engine.acquire_cpu_backup(addr, len)?;
        let (p, l) = got.map_or((std::ptr::null(), 0), |g| (g.ptr.cast(), g.lease));
        // SAFETY: both non-null, caller vouches they are writable.
        unsafe {
            *out = p;
            *lease = l;
        }
        Ok(())
    })
}

/// End a lease from [`tms_acquire_cpu_backup`]. `TMS_ERR_NOT_FOUND` if it is not held.
#[no_mangle]
pub extern "C" fn tms_release_cpu_backup(lease: u64) -> c_int {
    entry(|| control::runtime()?.engine.release_cpu_backup(lease))
}

/// Copy the host backup of `[addr, addr + len)` into `dst` (`len` bytes); `*found` is 0 where
/// there is none (`dst` untouched), 1 when copied.
///
/// # Safety
/// `dst` is writable for `len` bytes; `found` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_copy_cpu_backup(
    addr: u64,
    len: u64,
    dst: *mut c_void,
    found: *mut c_int,
) -> c_int {
    entry(|| {
        if dst.is_null() || found.is_null() {
            return Err(Error::invalid_argument("dst or found is NULL"));
        }
        let len = buffer_len(false, len, "dst")?.unwrap_or(0);
        // SAFETY: caller vouches dst is writable for len bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) };
        let f = control::runtime()?.engine.copy_cpu_backup(addr, dst)?;
        // SAFETY: non-null, caller vouches it is writable.
        unsafe { *found = c_int::from(f) };
        Ok(())
    })
}

/// Statistics as JSON: `{"backend":..,"retain_cpu_backup":..,"memory_margin_bytes":..,
/// "tags":[{"tag":..,"allocations":..,"bytes_active":..,"bytes_paused":..,..},..]}`.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_stats_json(
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    entry(|| {
        control::runtime().and_then(|rt| {
            let j = serde_json::to_string(&rt.engine.stats())
                .map_err(|e| Error::invalid_state(format!("serialising stats: {e}")))?;
            // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
            // callers' promise), as write_out needs.
            unsafe { write_out(&j, buf, cap, out_len) }
        })
    })
}

/// Copy `len` bytes from host memory `src` into the active pauseable allocation at `addr`
/// (the range must lie inside one allocation). For tools, demos and tests; real workloads write
/// with kernels.
///
/// # Safety
/// `src` is readable for `len` bytes (or `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn tms_write_bytes(addr: u64, src: *const c_void, len: u64) -> c_int {
    entry(|| {
        let Some(len) = buffer_len(src.is_null(), len, "src")? else {
            return Ok(());
        };
        // SAFETY: non-null, and the caller vouches src is readable for len bytes.
        let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) };
        // Staged: the caller may free src as soon as we return, whatever we return.
        control::runtime()?.engine.write_bytes_staged(addr, data)
    })
}

/// Copy `len` bytes from the active pauseable allocation at `addr` into host memory `dst`.
///
/// # Safety
/// `dst` is writable for `len` bytes (or `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn tms_read_bytes(addr: u64, dst: *mut c_void, len: u64) -> c_int {
    entry(|| {
        let Some(len) = buffer_len(dst.is_null(), len, "dst")? else {
            return Ok(());
        };
        // SAFETY: non-null, and the caller vouches dst is writable for len bytes.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) };
        control::runtime()?.engine.read_bytes_staged(addr, out)
    })
}

/// Start the library if needed and write this process's control socket path into `buf`: the
/// path's own bytes, which are UTF-8 unless `TMS_SOCKET_DIR` names a folder whose name is not;
/// `TMS_ERR_UNSUPPORTED` when there is none (`TMS_CONTROL=0`, or the socket folder was
/// refused), with the reason in the last error.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_control_socket(
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    entry(|| {
        control::runtime().and_then(|_| {
            let p = control::socket_path()
                .map_err(|why| Error::unsupported(format!("no control socket: {why}")))?;
            // Not a lossy string: a lookalike of a name that is not UTF-8 is a path to nothing.
            let s = p.as_os_str().as_bytes();
            // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
            // callers' promise), as write_bytes_out needs.
            unsafe { write_bytes_out(s, buf, cap, out_len) }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::status;
    use std::ffi::CStr;

    /// A non-pauseable scope (`enabled = 0`, Python's `disable()`) keeps the enclosing region's
    /// backup settings, as it keeps its tag, CPU backup flag, disk backup and chunk size: the
    /// getters inside it report them, and a setter that makes the scope pauseable again
    /// (`tms_set_interesting_region(1)`) gets the region's host memory, not another one.
    #[test]
    fn a_disabled_scope_keeps_the_enclosing_regions_backend() {
        std::thread::spawn(|| {
            // SAFETY: NUL-terminated strings and NULLs, as tms_region_enter takes.
            let rc = unsafe { tms_region_enter(1, c"kv".as_ptr(), 1, c"mmap".as_ptr()) };
            assert_eq!(rc, status::OK);
            // SAFETY: as above.
            let rc = unsafe { tms_region_enter(0, std::ptr::null(), 0, std::ptr::null()) };
            assert_eq!(rc, status::OK);
            let r = settings::current_region().unwrap();
            assert!(!r.enabled && r.cpu_backup && r.tag == "kv", "{r:?}");
            assert_eq!(r.backend, BackupKind::Mmap, "{r:?}");
            // SAFETY: a static NUL-terminated string, or NULL (not here: the call succeeds).
            let name = unsafe { CStr::from_ptr(tms_get_cpu_backup_backend()) };
            assert_eq!(name, c"mmap");
            assert_eq!(tms_set_interesting_region(1), status::OK);
            assert_eq!(
                settings::current_region().unwrap().backup(),
                Some(BackupKind::Mmap)
            );
            assert_eq!(tms_region_exit(), status::OK);
            assert_eq!(tms_region_exit(), status::OK);
        })
        .join()
        .unwrap();
    }
}
