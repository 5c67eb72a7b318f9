//! `tms_get_progress`: the running pause or resume, copied out in the header's `tms_progress`
//! layout.

use std::cell::Cell;
use std::ffi::{c_char, c_int};

use super::status::entry;
use crate::engine::OpReport;
use crate::error::{Error, Result};
use crate::process::runtime;

/// Progress of the pause or resume running in the process, whoever started it (any thread, or
/// tmsctl through the control socket). Pauses and resumes run one at a time. Callers pass its
/// size, so that fields can be added at its end.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TmsProgress {
    /// 1 while a pause or resume runs; 0 when none does (all else 0).
    active: i32,
    /// 1: a pause, 2: a resume.
    op: i32,
    /// Bytes it copies to or from backups in all (0: nothing to copy; known once its backups
    /// are prepared).
    bytes_total: u64,
    /// Of those, copied so far.
    bytes_done: u64,
    /// Since it started (after waiting for another one to end).
    seconds: f64,
    /// Since its first bytes were copied (0 before): the rate so far is
    /// bytes_done / copy_seconds.
    copy_seconds: f64,
    /// The OS thread id (gettid) of the thread running it: a watcher tells its own thread's
    /// call from another thread's.
    thread_id: u64,
    /// Where the copies go or come from: bit 0 host memory (CPU backups), bit 1 disk files.
    backing: u32,
    /// Always 0.
    reserved: u32,
    /// What it does now, NUL-terminated: "preparing", "synchronizing" (waiting for the
    /// device's queued work), "mapping", "copying_to_host", "writing_to_disk",
    /// "reading_from_disk", "copying_to_device", "releasing".
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

/// Write the progress (`tms_progress`) into `*out`, of which the caller has `size` bytes (pass
/// `sizeof(tms_progress)`; less is `TMS_ERR_INVALID_ARGUMENT`; a larger struct of a later
/// header gets this one's fields, the rest zeroed): `active` 0 when none runs. Never starts the
/// library and never waits for the operation: a thread may poll it while another thread's
/// `tms_pause` runs.
///
/// # Safety
/// `out` is writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_get_progress(out: *mut TmsProgress, size: usize) -> c_int {
    entry(|| {
        check_out(out, size)?;
        let p = runtime::get_if_started().and_then(|rt| rt.engine.progress());
        // SAFETY: out is writable for size >= ours bytes (checked above).
        unsafe { copy_out(&TmsProgress::of(p.as_ref()), out, size) };
        Ok(())
    })
}

/// Refuse an `out` that cannot take a [`TmsProgress`].
fn check_out(out: *mut TmsProgress, size: usize) -> Result<()> {
    let ours = std::mem::size_of::<TmsProgress>();
    if out.is_null() {
        return Err(Error::invalid_argument("out is NULL"));
    }
    if size < ours {
        return Err(Error::invalid_argument(format!(
            "a progress struct of {size} bytes: tms_progress has {ours} (pass \
             sizeof(tms_progress))"
        )));
    }
    Ok(())
}

/// Copy `v` into the caller's `out` of `size` bytes, zeroing what lies past it.
///
/// # Safety
/// `out` is writable for `size` bytes, and `size` is at least `size_of::<TmsProgress>()`.
unsafe fn copy_out(v: &TmsProgress, out: *mut TmsProgress, size: usize) {
    let ours = std::mem::size_of::<TmsProgress>();
    // SAFETY: out is writable for size >= ours bytes (our caller's contract); a byte copy
    // needs no alignment.
    unsafe {
        std::ptr::write_bytes(out.cast::<u8>(), 0, size);
        std::ptr::copy_nonoverlapping(
            (v as *const TmsProgress).cast::<u8>(),
            out.cast::<u8>(),
            ours,
        );
    }
}

thread_local! {
    /// This thread's last pause or resume through the C ABI that succeeded: which (1 pause, 2
    /// resume), the bytes it copied to or from backups, and its seconds.
    static LAST: Cell<Option<(i32, u64, f64)>> = const { Cell::new(None) };
}

/// [`entry`] for a pause or resume: what `tms_last_progress` says is forgotten first, so that a
/// call refused before it reaches the engine (a bad argument, a chunk it does not have) shows
/// `op` 0 there, as one that fails later does.
pub(super) fn op_entry(f: impl FnOnce() -> Result<()>) -> c_int {
    entry(|| {
        LAST.with(|c| c.set(None));
        f()
    })
}

/// Remember the outcome of this thread's pause (`pause`) or resume for `tms_last_progress`.
pub(super) fn noted(pause: bool, r: Result<OpReport>) -> Result<()> {
    let last = r
        .as_ref()
        .ok()
        .map(|r| (if pause { 1 } else { 2 }, r.copied, r.seconds));
    LAST.with(|c| c.set(last));
    r.map(|_| ())
}

/// The calling thread's last `tms_pause`, `tms_resume`, `tms_pause_ex`, `tms_resume_ex` or chunk
/// pause or resume, once it has succeeded, into `*out` (`size` as for `tms_get_progress`):
/// `active` 0, `phase` `"done"`, `bytes_total` and `bytes_done` the bytes it copied to or from
/// backups, `seconds` its duration; `op` 0 when that call failed or there was none. The true
/// totals of an operation too short to be watched.
///
/// # Safety
/// `out` is writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_last_progress(out: *mut TmsProgress, size: usize) -> c_int {
    entry(|| {
        check_out(out, size)?;
        let mut v = TmsProgress::of(None);
        if let Some((op, copied, seconds)) = LAST.with(Cell::get) {
            v.op = op;
            v.bytes_total = copied;
            v.bytes_done = copied;
            v.seconds = seconds;
            for (o, b) in v.phase.iter_mut().zip(b"done") {
                *o = *b as c_char;
            }
        }
        // SAFETY: out is writable for size >= ours bytes (checked above).
        unsafe { copy_out(&v, out, size) };
        Ok(())
    })
}
