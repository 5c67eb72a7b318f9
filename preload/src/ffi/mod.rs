//! The C ABI of `libtms.so`, used by the Python shim (through ctypes) and by C callers.
//!
//! Conventions (see `include/tms.h`): every function returns a status code (`TMS_OK` = 0, else
//! a `TMS_ERR_*`); on failure the calling thread's last-error message says what and where
//! (`tms_last_error`). No panic crosses this boundary: each entry point runs inside [`catch`].
//! String arguments are NUL-terminated UTF-8; NULL where a tag is optional means "every tag".

use std::ffi::{c_char, c_int, c_void, CStr};

use crate::backup::BackupKind;
use crate::control;
use crate::engine::Pick;
use crate::error::{status, Error, Result};
use crate::process::boundary::{catch, set_last_error, set_last_message, with_last_error};
use crate::process::{runtime, settings};

mod upstream;

/// Run a fallible entry point: `Ok` is `TMS_OK`, an error its status with the message recorded.
fn entry(f: impl FnOnce() -> Result<()>) -> c_int {
    catch(status::INTERNAL, || match f() {
        Ok(()) => status::OK,
        Err(e) => {
            set_last_error(&e);
            e.status()
        }
    })
}

/// A required string argument.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for this call.
unsafe fn arg_str<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller vouches for NUL termination.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::InvalidArgument(format!("{what} is not valid UTF-8")))
}

/// An optional string argument (NULL = none).
///
/// # Safety
/// As [`arg_str`].
unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        Ok(None)
    } else {
        // SAFETY: `p` is not NULL here, and the caller promises a NUL-terminated string
        // valid for this call: arg_str's contract.
        unsafe { arg_str(p, what) }.map(Some)
    }
}

/// The length of a caller's buffer argument, checked so that a slice can be made of it: `None`
/// for an empty buffer (whose pointer may then be NULL).
fn buffer_len(is_null: bool, len: u64, what: &str) -> Result<Option<usize>> {
    let n = usize::try_from(len)
        .ok()
        .filter(|n| isize::try_from(*n).is_ok())
        .ok_or_else(|| Error::InvalidArgument(format!("length {len}")))?;
    if n == 0 {
        return Ok(None);
    }
    if is_null {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    Ok(Some(n))
}

/// Write `s` (with a NUL) into `buf` of `cap` bytes; `BUFFER_TOO_SMALL` when it does not fit.
///
/// # Safety
/// `buf` is NULL or writable for `cap` bytes; `out_len` is NULL or writable.
unsafe fn write_out(s: &str, buf: *mut c_char, cap: usize, out_len: *mut usize) -> Result<()> {
    if !out_len.is_null() {
        // SAFETY: caller vouches for out_len.
        unsafe { *out_len = s.len() };
    }
    if buf.is_null() || cap < s.len() + 1 {
        return Err(Error::InvalidArgument(format!(
            "output buffer of {cap} bytes is too small for {} bytes",
            s.len() + 1
        )));
    }
    // SAFETY: buf has room for s and the NUL (checked).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

fn write_status(r: Result<()>) -> c_int {
    match r {
        Err(Error::InvalidArgument(m)) if m.starts_with("output buffer") => {
            set_last_message(&m);
            status::BUFFER_TOO_SMALL
        }
        Err(e) => {
            set_last_error(&e);
            e.status()
        }
        Ok(()) => status::OK,
    }
}

/// Library version, a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn tms_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Symbolic name of a status code, a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn tms_status_name(code: c_int) -> *const c_char {
    catch(c"TMS_ERR_INTERNAL".as_ptr(), || {
        // The same names as status::name, NUL-terminated (tests/tests/header.rs checks both).
        static NAMES: [&CStr; 10] = [
            c"TMS_OK",
            c"TMS_ERR_OUT_OF_MEMORY",
            c"TMS_ERR_DRIVER",
            c"TMS_ERR_INVALID_ARGUMENT",
            c"TMS_ERR_INVALID_STATE",
            c"TMS_ERR_NOT_FOUND",
            c"TMS_ERR_UNSUPPORTED",
            c"TMS_ERR_IO",
            c"TMS_ERR_INTERNAL",
            c"TMS_ERR_BUFFER_TOO_SMALL",
        ];
        debug_assert_eq!(
            NAMES.get(1).map(|c| c.to_str().ok()),
            Some(Some(status::name(1)))
        );
        usize::try_from(code)
            .ok()
            .and_then(|i| NAMES.get(i))
            .map_or(c"TMS_ERR_UNKNOWN_STATUS".as_ptr(), |c| c.as_ptr())
    })
}

/// Copy this thread's last error message into `buf` (truncated to `cap - 1` bytes, always
/// NUL-terminated when `cap > 0`); returns the full message length.
///
/// # Safety
/// `buf` is NULL or writable for `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_last_error(buf: *mut c_char, cap: usize) -> usize {
    catch(0, || {
        with_last_error(|bytes| {
            if !buf.is_null() && cap > 0 {
                let n = bytes.len().min(cap - 1);
                // SAFETY: buf is writable for cap > n bytes (caller's contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                    *buf.add(n) = 0;
                }
            }
            bytes.len()
        })
        .unwrap_or(0)
    })
}

/// How many errors this thread has recorded (each failure, also one inside a hook, counts one):
/// compare before and after a call to learn whether it failed in the library.
#[no_mangle]
pub extern "C" fn tms_error_count() -> u64 {
    catch(0, crate::process::boundary::error_count)
}

/// Start the library now (it otherwise starts at the first pauseable allocation) and write the
/// driver's name (`cuda` or `sim`) into `buf`.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_init(buf: *mut c_char, cap: usize, out_len: *mut usize) -> c_int {
    catch(status::INTERNAL, || {
        let r = control::runtime().and_then(|rt| {
            // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
            // callers' promise), as write_out needs.
            unsafe { write_out(rt.engine.driver().name(), buf, cap, out_len) }
        });
        write_status(r)
    })
}

/// 1 if the library has started successfully in this process (and it is not a fork child).
#[no_mangle]
pub extern "C" fn tms_is_active() -> c_int {
    catch(0, || c_int::from(runtime::get_if_started().is_some()))
}

/// Enter a region on this thread: allocations become pauseable under `tag` (when `enabled`),
/// with a CPU backup in `backend` memory (`"pinned"`, `"mmap"`, or NULL for the process
/// default) when `cpu_backup`. `enabled = 0` opens a non-pauseable scope (`disable()`).
/// Regions nest; leave with [`tms_region_exit`].
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
        let (backend, backend_named) = match backend {
            Some(b) => {
                let b = BackupKind::parse(b)?;
                if cpu_backup == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "CPU backup backend {:?} given without enabling CPU backup",
                        b.as_str()
                    )));
                }
                (b, true)
            }
            None => {
                let p = &settings::process()?.region;
                (p.backend, p.backend_named)
            }
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
            backend_named,
            // A new pauseable region asks for a disk backup with tms_set_enable_disk_backup.
            disk_backup: enabled == 0 && cur.disk_backup,
            // And a chunk size with tms_set_chunk_size.
            chunk: if enabled == 0 { cur.chunk } else { 0 },
        })
    })
}

/// Leave the innermost region of this thread.
#[no_mangle]
pub extern "C" fn tms_region_exit() -> c_int {
    entry(|| settings::pop_region().map(|_| ()))
}

/// This thread's effective region settings as JSON
/// (`{"enabled":..,"tag":..,"cpu_backup":..,"backend":..,"depth":..}`).
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_region_current(
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    catch(status::INTERNAL, || {
        let r = settings::current_region().and_then(|r| {
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
        });
        write_status(r)
    })
}

/// The tag argument of pause and resume: NULL or `""` is every tag (callers of the existing
/// library pass `""` for that).
///
/// # Safety
/// As [`arg_str`].
unsafe fn tag_or_all<'a>(p: *const c_char) -> Result<Option<&'a str>> {
    // SAFETY: `p` is NULL or a NUL-terminated string valid for this call (our
    // callers' promise), as opt_str needs.
    Ok(unsafe { opt_str(p, "tag") }?.filter(|t| !t.is_empty()))
}

/// Pause every active allocation of `tag` (NULL or `""`: every tag).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_pause(tag: *const c_char) -> c_int {
    entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        control::runtime()?.engine.pause(tag).map(|_| ())
    })
}

/// Resume every paused allocation of `tag` (NULL or `""`: every tag) at the same addresses.
/// Out of memory leaves the tag paused with its backups; call again once memory is free.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_resume(tag: *const c_char) -> c_int {
    entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        control::runtime()?.engine.resume(tag).map(|_| ())
    })
}

/// Keep host backups across resume (consulted at resume).
#[no_mangle]
pub extern "C" fn tms_set_retain_cpu_backup(on: c_int) -> c_int {
    entry(|| {
        control::runtime()?.engine.set_retain_cpu_backup(on != 0);
        Ok(())
    })
}

/// Whether host backups are kept across resume, with a status (`tms_get_retain_cpu_backup`
/// is the existing library's form, which cannot report a failure).
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_query_retain_cpu_backup(out: *mut c_int) -> c_int {
    entry(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
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

/// The memory margin in bytes.
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_get_memory_margin(out: *mut u64) -> c_int {
    entry(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let v = control::runtime()?.engine.memory_margin();
        // SAFETY: non-null, caller vouches it is writable.
        unsafe { *out = v };
        Ok(())
    })
}

/// Address of the host backup of `[addr, addr+len)` in `*out`, or NULL where there is no
/// complete snapshot ([`crate::engine::Engine::copy_cpu_backup`]). `TMS_ERR_NOT_FOUND` if the
/// range does not lie inside one pauseable allocation. Unguarded: the bytes change with the next
/// pause and go with a resume without retention or a free ([`tms_acquire_cpu_backup`] is the
/// guarded form).
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_get_cpu_backup(addr: u64, len: u64, out: *mut *const c_void) -> c_int {
    entry(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let p = control::runtime()?.engine.cpu_backup_ptr(addr, len)?;
        // SAFETY: non-null, caller vouches it is writable.
        unsafe { *out = p.map_or(std::ptr::null(), |p| p.cast()) };
        Ok(())
    })
}

/// As [`tms_get_cpu_backup`], but the bytes stay mapped and unchanged until
/// [`tms_release_cpu_backup`] of `*lease` (NULL and 0 where there is no snapshot).
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
            return Err(Error::InvalidArgument("out or lease is NULL".into()));
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

/// End a lease from [`tms_acquire_cpu_backup`].
#[no_mangle]
pub extern "C" fn tms_release_cpu_backup(lease: u64) -> c_int {
    entry(|| control::runtime()?.engine.release_cpu_backup(lease))
}

/// Copy the host backup of `[addr, addr+len)` into `dst`; `*found` is 0 where there is none.
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
            return Err(Error::InvalidArgument("dst or found is NULL".into()));
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

/// Statistics as JSON (`{"backend":..,"tags":[{"tag":..,"bytes_active":..},..]}`) into `buf`;
/// `TMS_ERR_BUFFER_TOO_SMALL` with the needed length (without NUL) in `*out_len` when it does
/// not fit.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_stats_json(
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    catch(status::INTERNAL, || {
        let r = control::runtime().and_then(|rt| {
            let j = serde_json::to_string(&rt.engine.stats())
                .map_err(|e| Error::InvalidState(format!("serialising stats: {e}")))?;
            // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
            // callers' promise), as write_out needs.
            unsafe { write_out(&j, buf, cap, out_len) }
        });
        write_status(r)
    })
}

/// Progress of the running pause or resume (`tms_progress` in tms.h; the field order and
/// types are the header's).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TmsProgress {
    active: i32,
    op: i32,
    bytes_total: u64,
    bytes_done: u64,
    seconds: f64,
    copy_seconds: f64,
    thread_id: u64,
    backing: u32,
    reserved: u32,
    phase: [c_char; 32],
}

// The header's layout: no padding, so the struct is copied out whole.
const _: () = assert!(std::mem::size_of::<TmsProgress>() == 88);

impl TmsProgress {
    fn of(p: Option<&crate::engine::Progress>) -> TmsProgress {
        let mut out = TmsProgress {
            active: 0,
            op: 0,
            bytes_total: 0,
            bytes_done: 0,
            seconds: 0.0,
            copy_seconds: 0.0,
            thread_id: 0,
            backing: 0,
            reserved: 0,
            phase: [0; 32],
        };
        let Some(p) = p else {
            return out;
        };
        out.active = 1;
        out.op = match p.which {
            crate::engine::Which::Pause => 1,
            crate::engine::Which::Resume => 2,
        };
        out.bytes_total = p.bytes_total;
        out.bytes_done = p.bytes_done.min(p.bytes_total);
        out.seconds = p.seconds;
        out.copy_seconds = p.copy_seconds;
        out.thread_id = p.thread;
        out.backing = u32::from(p.backing.host) | u32::from(p.backing.disk) << 1;
        // Names are short ASCII; the last byte stays NUL.
        for (o, b) in out.phase.iter_mut().zip(p.phase.as_str().bytes().take(31)) {
            *o = b as c_char;
        }
        out
    }
}

/// Write the progress of the pause or resume running in the process (whoever started it)
/// into `*out`, of which the caller has `size` bytes (`sizeof(tms_progress)`; a larger struct
/// of a later header gets this one's fields, the rest zeroed): `active` 0 when none runs.
/// Never starts the library and never waits for the operation, so a watcher thread may poll
/// it while another thread's pause runs.
///
/// # Safety
/// `out` is writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_get_progress(out: *mut c_void, size: usize) -> c_int {
    entry(|| {
        let ours = std::mem::size_of::<TmsProgress>();
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        if size < ours {
            return Err(Error::InvalidArgument(format!(
                "a progress struct of {size} bytes: tms_progress has {ours} (pass \
                 sizeof(tms_progress))"
            )));
        }
        let p = runtime::get_if_started().and_then(|rt| rt.engine.progress());
        let v = TmsProgress::of(p.as_ref());
        // SAFETY: out is writable for size >= ours bytes (the caller's contract, checked
        // above); a byte copy needs no alignment.
        unsafe {
            std::ptr::write_bytes(out.cast::<u8>(), 0, size);
            std::ptr::copy_nonoverlapping(
                (&v as *const TmsProgress).cast::<u8>(),
                out.cast::<u8>(),
                ours,
            );
        }
        Ok(())
    })
}

/// Copy `len` bytes from host memory `src` into the active pauseable allocation at `addr`
/// (the range must lie inside one allocation). For tools, demos and tests; device code writes
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

/// Start the library (if it has not started) and write the path of this process's control
/// socket into `buf`. `TMS_ERR_UNSUPPORTED` when there is none (`TMS_CONTROL=0`, or the socket
/// folder was refused), with the reason in the last error.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_control_socket(
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    catch(status::INTERNAL, || {
        let r = control::runtime().and_then(|_| {
            let p = control::socket_path()
                .map_err(|m| Error::Unsupported(format!("no control socket: {m}")))?;
            let s = p.to_string_lossy();
            // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
            // callers' promise), as write_out needs.
            unsafe { write_out(&s, buf, cap, out_len) }
        });
        write_status(r)
    })
}

/// Pause (`pause`) or resume what `p` names.
fn transact(pause: bool, p: &Pick<'_>) -> Result<()> {
    let e = &control::runtime()?.engine;
    if pause {
        e.pause_pick(p).map(|_| ())
    } else {
        e.resume_pick(p).map(|_| ())
    }
}

/// The chunk indices of a C array, sorted and each once (an index that does not fit `usize`
/// reads as `usize::MAX`, which the engine refuses as a chunk the allocation lacks).
///
/// # Safety
/// `idx` is readable for `n` entries (or `n` is 0).
unsafe fn indices<T: Copy + TryInto<usize>>(idx: *const T, n: u64) -> Result<Vec<usize>> {
    let Some(n) = buffer_len(idx.is_null(), n, "chunk index array")? else {
        return Ok(Vec::new());
    };
    // SAFETY: the caller vouches for n readable entries; buffer_len checked the pointer.
    let mut v: Vec<usize> = unsafe { std::slice::from_raw_parts(idx, n) }
        .iter()
        .map(|&i| i.try_into().unwrap_or(usize::MAX))
        .collect();
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

/// Refuse an output array shorter than the chunk count.
fn room(n: usize, count: usize, what: &str) -> Result<()> {
    if n < count {
        return Err(Error::InvalidArgument(format!(
            "{what} has room for {n} entries, but the allocation has {count} chunks"
        )));
    }
    Ok(())
}

/// Write each value to its output, where the output is not NULL.
///
/// # Safety
/// Each output is NULL or writable.
unsafe fn put_all(outs: &[(*mut u64, u64)]) {
    for &(p, v) in outs {
        if !p.is_null() {
            // SAFETY: the caller vouches for non-NULL outputs.
            unsafe { *p = v };
        }
    }
}

/// A whole-tag pause or resume that saves or restores the chunk states.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
unsafe fn tag_with_chunk_state(tag: *const c_char, chunk_state: c_int, pause: bool) -> c_int {
    entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        let p = Pick {
            chunk_state: chunk_state != 0,
            ..Pick::tag(tag)
        };
        transact(pause, &p)
    })
}

/// Pause every active allocation of `tag` (NULL or `""`: every tag); with `save_chunk_state`,
/// first record which allocations of the tag, and which chunks of chunked ones, are active,
/// for `tms_resume_ex(tag, 1)`.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_pause_ex(tag: *const c_char, save_chunk_state: c_int) -> c_int {
    // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
    // callers' promise), as tag_with_chunk_state needs.
    unsafe { tag_with_chunk_state(tag, save_chunk_state, true) }
}

/// Resume the paused allocations of `tag` (NULL or `""`: every tag); with
/// `restore_chunk_state`, only the chunks recorded active by `tms_pause_ex(tag, 1)` (all of
/// an allocation with nothing recorded).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_resume_ex(tag: *const c_char, restore_chunk_state: c_int) -> c_int {
    // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
    // callers' promise), as tag_with_chunk_state needs.
    unsafe { tag_with_chunk_state(tag, restore_chunk_state, false) }
}

/// The chunked allocation holding `addr`: its start, chunk size and chunk count (each output
/// may be NULL).
///
/// # Safety
/// Each output is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tms_chunks_of(
    addr: u64,
    start: *mut u64,
    chunk: *mut u64,
    count: *mut u64,
) -> c_int {
    entry(|| {
        let i = control::runtime()?.engine.chunk_info(addr)?;
        let outs = [
            (start, i.addr),
            (chunk, i.chunk),
            (count, i.active.len() as u64),
        ];
        // SAFETY: start, chunk and count are each NULL or writable (our callers' promise), as
        // put_all needs.
        unsafe { put_all(&outs) };
        Ok(())
    })
}

/// Each chunk's state (1 = active) of the chunked allocation holding `addr`, into `out` of `n`
/// bytes (at least the chunk count).
///
/// # Safety
/// `out` is writable for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_chunk_states_at(addr: u64, out: *mut u8, n: u64) -> c_int {
    entry(|| {
        let i = control::runtime()?.engine.chunk_info(addr)?;
        let k = buffer_len(out.is_null(), n, "the state array")?.unwrap_or(0);
        room(k, i.active.len(), "the state array")?;
        // SAFETY: the caller vouches for n writable bytes; buffer_len checked the pointer.
        let out = unsafe { std::slice::from_raw_parts_mut(out, k) };
        for (o, a) in out.iter_mut().zip(&i.active) {
            *o = u8::from(*a);
        }
        Ok(())
    })
}

/// Pause (`pause != 0`) or resume chunks `idx[0..n]` of the chunked allocation holding `addr`.
///
/// # Safety
/// `idx` is readable for `n` entries.
#[no_mangle]
pub unsafe extern "C" fn tms_chunks_at(addr: u64, pause: c_int, idx: *const u64, n: u64) -> c_int {
    entry(|| {
        // SAFETY: `idx` is readable for `n` entries (our callers' promise), as indices needs.
        let v = unsafe { indices(idx, n) }?;
        let start = control::runtime()?.engine.chunk_info(addr)?.addr;
        transact(pause != 0, &Pick::chunks(start, &v))
    })
}

/// Pause (`pause != 0`) or resume the chunks lying wholly inside `[addr, addr + len)` of the
/// chunked allocation holding it (rounded inward: chunks only partly inside are left alone);
/// the first chunk and the count acted on go to `first` and `count` (each may be NULL).
///
/// # Safety
/// `first` and `count` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tms_range(
    addr: u64,
    len: u64,
    pause: c_int,
    first: *mut u64,
    count: *mut u64,
) -> c_int {
    entry(|| {
        let (start, idx) = control::runtime()?.engine.chunks_in(addr, len)?;
        let outs = [
            (first, idx.first().map_or(0, |&i| i as u64)),
            (count, idx.len() as u64),
        ];
        // SAFETY: first and count are each NULL or writable (our callers' promise), as put_all
        // needs.
        unsafe { put_all(&outs) };
        if idx.is_empty() {
            return Ok(());
        }
        transact(pause != 0, &Pick::chunks(start, &idx))
    })
}
