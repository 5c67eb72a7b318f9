//! The C ABI of the non-blocking resume (engine Note [Non-blocking resume]): resume without
//! waiting for the data, wait for it (host or stream), in the order the caller needs it.

use std::ffi::{c_char, c_int};
use std::time::Duration;

use super::args::{array_len, put_all, tag_or_all};
use super::progress::{noted_failure, op_entry};
use super::status::entry;
use crate::control;
use crate::driver::Stream;
use crate::engine::{Engine, StreamOf};

/// The caller's stream, or none where `device` is negative.
fn stream_of(device: c_int, stream: u64) -> Option<StreamOf> {
    (device >= 0).then_some(StreamOf {
        device,
        stream: Stream(stream),
    })
}

/// Resume `tag` (NULL or `""`: every tag) without waiting for the contents: returns once the
/// memory is mapped, with the restores running on a thread of the library. Work then queued on
/// `stream` (a `CUstream` of `device`'s primary context, 0 for its legacy default stream; none
/// if `device` < 0) runs after the restore. `order` (`n_order` addresses inside the tag's
/// allocations, NULL if 0) names what to restore first. `*out_pending` (or NULL): bytes still
/// being restored at return. A failure before the return is this call's; one after it leaves
/// the allocations paused with their backups, their memory held, and belongs to them:
/// `tms_wait_restored` for any of them returns it every time until they are paused, resumed or
/// freed, and if no wait did, the first pause or resume acting on them does its work and then
/// returns it. Where the driver cannot make streams wait, or no thread can be started, it
/// blocks until the data landed.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string; `order` is readable for `n_order` entries;
/// `out_pending` is NULL or writable; `stream` is a live stream of `device` (or 0).
#[no_mangle]
pub unsafe extern "C" fn tms_resume_nonblocking(
    tag: *const c_char,
    device: c_int,
    stream: u64,
    order: *const u64,
    n_order: u64,
    out_pending: *mut u64,
) -> c_int {
    op_entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our callers'
        // promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        let order = match array_len::<u64>(order.is_null(), n_order, "order array")? {
            // SAFETY: the caller vouches for n readable entries; array_len checked the pointer
            // and that their bytes fit isize.
            Some(n) => unsafe { std::slice::from_raw_parts(order, n) }.to_vec(),
            None => Vec::new(),
        };
        let e = &control::runtime()?.engine;
        let r = noted_failure(Engine::resume_nonblocking(
            e,
            tag,
            &order,
            stream_of(device, stream),
        ))?;
        // SAFETY: `out_pending` is NULL or writable (our callers' promise).
        unsafe { put_all(&[(out_pending, r.pending)]) };
        Ok(())
    })
}

/// Block until what non-blocking resumes are restoring into the allocation holding `addr`
/// (every allocation, if 0) has landed, for at most `timeout_ms` (negative: no limit).
/// `*out_done` (or NULL) is 1 if it landed, 0 if the time ran out. A resume that failed after
/// it returned is reported here for the allocations it left unrestored, every time, until they
/// are paused, resumed or freed; one that failed after everything landed is reported once, by
/// the next wait for every allocation.
///
/// # Safety
/// `out_done` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tms_wait_restored(
    addr: u64,
    timeout_ms: i64,
    out_done: *mut c_int,
) -> c_int {
    entry(|| {
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        let ptr = (addr != 0).then_some(addr);
        let done = control::runtime()?.engine.wait_restored(ptr, timeout)?;
        if !out_done.is_null() {
            // SAFETY: `out_done` is not NULL, so writable (our callers' promise).
            unsafe { *out_done = c_int::from(done) };
        }
        Ok(())
    })
}

/// Make `stream` (of `device`, 0 for its legacy default stream) wait, without blocking the
/// host, until the allocation holding `addr` (every allocation, if 0) is restored by the
/// non-blocking resumes in flight; nothing is queued when nothing is in flight. `device` need
/// not be the allocation's (every device reads the word the stream waits on); one that does
/// not exist is `TMS_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `stream` is a live stream of `device` (or 0).
#[no_mangle]
pub unsafe extern "C" fn tms_stream_wait_restored(addr: u64, device: c_int, stream: u64) -> c_int {
    entry(|| {
        let on = stream_of(device, stream).ok_or_else(|| {
            crate::error::Error::invalid_argument(format!("device {device}: expected 0 or more"))
        })?;
        let ptr = (addr != 0).then_some(addr);
        control::runtime()?.engine.stream_wait_restored(ptr, on)
    })
}
