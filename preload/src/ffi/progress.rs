//! `tms_get_progress`: the running pause or resume, copied out in the header's `tms_progress`
//! layout.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void};

use super::status::entry;
use crate::engine::OpReport;
use crate::error::{Error, Result};
use crate::process::runtime;

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
        check_out(out, size)?;
        let p = runtime::get_if_started().and_then(|rt| rt.engine.progress());
        // SAFETY: out is writable for size >= ours bytes (checked above).
        unsafe { copy_out(&TmsProgress::of(p.as_ref()), out, size) };
        Ok(())
    })
}

/// Refuse an `out` that cannot take a [`TmsProgress`].
fn check_out(out: *mut c_void, size: usize) -> Result<()> {
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
unsafe fn copy_out(v: &TmsProgress, out: *mut c_void, size: usize) {
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

/// Remember the outcome of this thread's pause (`pause`) or resume for `tms_last_progress`.
pub(super) fn noted(pause: bool, r: Result<OpReport>) -> Result<()> {
    let last = r
        .as_ref()
        .ok()
        .map(|r| (if pause { 1 } else { 2 }, r.copied, r.seconds));
    LAST.with(|c| c.set(last));
    r.map(|_| ())
}

/// Write the calling thread's last pause or resume through the C ABI, once it has succeeded,
/// into `*out` (`size` bytes, as for [`tms_get_progress`]): `active` 0, `phase` `"done"`,
/// `bytes_total` and `bytes_done` the bytes it copied to or from backups, `seconds`; `op` 0 when
/// its last one failed or there was none. The true totals of an operation too short for a
/// watcher to have seen.
///
/// # Safety
/// `out` is writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_last_progress(out: *mut c_void, size: usize) -> c_int {
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
