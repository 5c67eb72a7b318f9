//! `tms_get_progress`: the running pause or resume, copied out in the header's `tms_progress`
//! layout; and the calling thread's last pause or resume: its totals once it succeeded
//! (`tms_last_progress`), what it changed all the same where it failed (`tms_last_changed`).

use std::cell::Cell;
use std::ffi::{c_char, c_int};

use super::status::entry;
use crate::engine::OpReport;
use crate::error::{Changed, Error, Result};
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
        check_out(out, size, "tms_progress")?;
        let p = runtime::get_if_started().and_then(|rt| rt.engine.progress());
        // SAFETY: out is writable for size >= ours bytes (checked above).
        unsafe { copy_out(&TmsProgress::of(p.as_ref()), out, size) };
        Ok(())
    })
}

/// Refuse an `out` that cannot take a `T`, the header's struct `name`.
fn check_out<T>(out: *mut T, size: usize, name: &str) -> Result<()> {
    let ours = std::mem::size_of::<T>();
    if out.is_null() {
        return Err(Error::invalid_argument("out is NULL"));
    }
    if size < ours {
        return Err(Error::invalid_argument(format!(
            "a struct {name} of {size} bytes: it has {ours} (pass sizeof({name}))"
        )));
    }
    Ok(())
}

/// Copy `v` into the caller's `out` of `size` bytes, zeroing what lies past it.
///
/// # Safety
/// `out` is writable for `size` bytes, and `size` is at least `size_of::<T>()`.
unsafe fn copy_out<T: Copy>(v: &T, out: *mut T, size: usize) {
    let ours = std::mem::size_of::<T>();
    // SAFETY: out is writable for size >= ours bytes (our caller's contract); a byte copy
    // needs no alignment.
    unsafe {
        std::ptr::write_bytes(out.cast::<u8>(), 0, size);
        std::ptr::copy_nonoverlapping((v as *const T).cast::<u8>(), out.cast::<u8>(), ours);
    }
}

/// How this thread's last pause or resume through the C ABI ended.
#[derive(Clone, Copy)]
enum Last {
    /// It succeeded: which (1 pause, 2 resume), the bytes it copied to or from backups, and
    /// its seconds.
    Done(i32, u64, f64),
    /// It failed; what it changed all the same, where the engine said.
    Failed(Option<Changed>),
}

thread_local! {
    /// This thread's last pause or resume through the C ABI; `None` where there was none, or
    /// it was refused before it reached the engine.
    static LAST: Cell<Option<Last>> = const { Cell::new(None) };
}

/// [`entry`] for a pause or resume: what `tms_last_progress` and `tms_last_changed` say is
/// forgotten first, so that a call refused before it reaches the engine (a bad argument, a
/// chunk it does not have) shows `op` 0 and `said` 0 there, never an earlier call's.
pub(super) fn op_entry(f: impl FnOnce() -> Result<()>) -> c_int {
    entry(|| {
        LAST.with(|c| c.set(None));
        f()
    })
}

/// Remember the outcome of this thread's pause (`pause`) or resume for `tms_last_progress`
/// and `tms_last_changed`.
pub(super) fn noted(pause: bool, r: Result<OpReport>) -> Result<()> {
    let last = match &r {
        Ok(r) => Last::Done(if pause { 1 } else { 2 }, r.copied, r.seconds),
        Err(e) => Last::Failed(e.changed()),
    };
    LAST.with(|c| c.set(Some(last)));
    r.map(|_| ())
}

/// Remember the failure of a resume that reports no totals (a non-blocking one, which returns
/// before its copies end) for `tms_last_changed`.
pub(super) fn noted_failure<T>(r: Result<T>) -> Result<T> {
    if let Err(e) = &r {
        LAST.with(|c| c.set(Some(Last::Failed(e.changed()))));
    }
    r
}

/// The calling thread's last `tms_pause`, `tms_resume`, `tms_pause_ex`, `tms_resume_ex`,
/// `tms_resume_verified` or chunk pause or resume, once it has succeeded, into `*out` (`size`
/// as for `tms_get_progress`): `active` 0, `phase` `"done"`, `bytes_total` and `bytes_done` the
/// bytes it copied to or from backups, `seconds` its duration; `op` 0 when that call failed,
/// was a `tms_resume_nonblocking` (which returns before its copies end), or there was none. The
/// true totals of an operation too short to be watched.
///
/// # Safety
/// `out` is writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_last_progress(out: *mut TmsProgress, size: usize) -> c_int {
    entry(|| {
        check_out(out, size, "tms_progress")?;
        let mut v = TmsProgress::of(None);
        if let Some(Last::Done(op, copied, seconds)) = LAST.with(Cell::get) {
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

/// What the calling thread's last pause or resume changed all the same where it failed
/// (`tms_last_changed`): a client undoing that call asks it rather than judging from the state,
/// which the program's other threads may change meanwhile. Callers pass its size, so that
/// fields can be added at its end.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TmsChanged {
    /// 1 where that call failed and the library says what it changed and left so: the fields
    /// below (all 0: nothing, everything is as before the call). 0 where it succeeded, there
    /// was none, or it failed without saying (refused before it reached the engine, a caught
    /// panic): then the caller judges for itself.
    said: i32,
    /// Always 0.
    reserved: u32,
    /// Allocations whose memory (chunks) it left paused, or resumed, otherwise than before.
    allocations: u64,
    /// The device bytes of those chunks, and of those communicators (as NCCL counts them).
    bytes: u64,
    /// NCCL communicators it left suspended, or resumed.
    communicators: u64,
}

// The header's layout: no padding, so the struct is copied out whole.
const _: () = assert!(std::mem::size_of::<TmsChanged>() == 32);

impl TmsChanged {
    /// What `c` says; nothing said where it is `None`.
    fn of(c: Option<Changed>) -> TmsChanged {
        let said = i32::from(c.is_some());
        let c = c.unwrap_or_default();
        TmsChanged {
            said,
            reserved: 0,
            allocations: c.allocations as u64,
            bytes: c.bytes,
            communicators: c.communicators as u64,
        }
    }
}

/// What the calling thread's last pause or resume (the calls `tms_last_progress` names, and
/// `tms_resume_nonblocking`), where it failed, changed all the same and left so, into `*out`
/// (`size` as for `tms_get_progress`): `said` 1 and the allocations, device bytes and NCCL
/// communicators it left paused or resumed (0 each: it changed nothing); `said` 0 (all else
/// 0) where it succeeded, there was none, or the library cannot tell. Never starts the library.
///
/// # Safety
/// `out` is writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_last_changed(out: *mut TmsChanged, size: usize) -> c_int {
    entry(|| {
        check_out(out, size, "tms_changed")?;
        let said = match LAST.with(Cell::get) {
            Some(Last::Failed(c)) => c,
            Some(Last::Done(..)) | None => None,
        };
        // SAFETY: out is writable for size >= ours bytes (checked above).
        unsafe { copy_out(&TmsChanged::of(said), out, size) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::status;
    use crate::ffi::{tms_pause_chunks, tms_resume_nonblocking};

    /// `tms_last_changed` into a struct of `size` bytes (at most 64) filled with 0xAA first:
    /// its status, and the bytes it left.
    fn last_changed(size: usize) -> (c_int, [u8; 64]) {
        let mut buf = [0xAAu8; 64];
        // SAFETY: buf is writable for its 64 bytes, at least `size`.
        let rc = unsafe { tms_last_changed(buf.as_mut_ptr().cast(), size) };
        (rc, buf)
    }

    /// `said` and the three counts of a `tms_changed` read whole.
    fn read(buf: &[u8; 64]) -> (i32, u64, u64, u64) {
        let word = |at: usize| u64::from_ne_bytes(buf[at..at + 8].try_into().unwrap());
        let said = i32::from_ne_bytes(buf[..4].try_into().unwrap());
        (said, word(8), word(16), word(24))
    }

    fn said() -> (i32, u64, u64, u64) {
        let (rc, buf) = last_changed(32);
        assert_eq!(rc, status::OK);
        read(&buf)
    }

    #[test]
    fn a_struct_too_small_or_missing_is_refused_and_a_larger_one_zeroed_past_ours() {
        std::thread::spawn(|| {
            // SAFETY: NULL is refused before anything is written.
            let rc = unsafe { tms_last_changed(std::ptr::null_mut(), 32) };
            assert_eq!(rc, status::INVALID_ARGUMENT);
            let (rc, buf) = last_changed(31);
            assert_eq!(rc, status::INVALID_ARGUMENT);
            assert!(buf.iter().all(|&b| b == 0xAA), "written though refused");
            let (rc, buf) = last_changed(40);
            assert_eq!(rc, status::OK);
            assert_eq!(buf[..40], [0; 40], "nothing said, the rest zeroed");
            assert_eq!(buf[40..], [0xAA; 24], "written past the size given");
        })
        .join()
        .unwrap();
    }

    /// Each thread reads its own last pause or resume: what a failure said it changed, nothing
    /// said after a success, a failure that does not say, or a call refused before the engine
    /// (the next call forgets what the one before said, non-blocking resumes included).
    #[test]
    fn the_last_changed_is_the_threads_own_last_call_and_the_next_call_resets_it() {
        let changed = Changed {
            allocations: 2,
            bytes: 6 << 20,
            communicators: 1,
        };
        let failed = || Error::driver("cuMemRelease", 999, "CUDA_ERROR_UNKNOWN", "injected");
        std::thread::spawn(move || {
            assert_eq!(said(), (0, 0, 0, 0), "none yet");
            assert!(noted(true, Err(failed().with_changed(changed))).is_err());
            assert_eq!(said(), (1, 2, 6 << 20, 1));
            std::thread::spawn(|| assert_eq!(said(), (0, 0, 0, 0), "another thread's"))
                .join()
                .unwrap();
            // SAFETY: a NULL tag is refused before anything is read.
            let rc = unsafe { tms_pause_chunks(std::ptr::null(), std::ptr::null(), 0) };
            assert_eq!(rc, status::INVALID_ARGUMENT);
            assert_eq!(said(), (0, 0, 0, 0), "refused before the engine: not said");

            assert!(noted(false, Err(failed().unchanged())).is_err());
            assert_eq!(said(), (1, 0, 0, 0), "said: nothing changed");
            // SAFETY: a NULL order of 3 entries is refused before anything is read.
            let rc = unsafe {
                tms_resume_nonblocking(
                    std::ptr::null(),
                    -1,
                    0,
                    std::ptr::null(),
                    3,
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(rc, status::INVALID_ARGUMENT);
            assert_eq!(
                said(),
                (0, 0, 0, 0),
                "a non-blocking resume is a resume too"
            );

            assert!(noted(false, Err(failed().with_changed(changed))).is_err());
            assert!(noted_failure(Err::<(), _>(failed())).is_err());
            assert_eq!(said(), (0, 0, 0, 0), "a failure that does not say");
            assert!(noted_failure(Err::<(), _>(failed().unchanged())).is_err());
            assert_eq!(said(), (1, 0, 0, 0));
            assert!(noted(true, Ok(OpReport::default())).is_ok());
            assert_eq!(said(), (0, 0, 0, 0), "a success");
        })
        .join()
        .unwrap();
    }
}
