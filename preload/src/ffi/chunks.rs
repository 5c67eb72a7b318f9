//! The C ABI of chunked allocations (Note [Chunked allocations] in the engine): pause and
//! resume of chunks or of byte ranges, chunk states saved and restored with a whole tag.

use std::ffi::{c_char, c_int};

use super::args::{buffer_len, indices, put_all, room, tag_or_all};
use super::progress::op_entry;
use super::status::entry;
use crate::control;
use crate::engine::{Pick, Record};
use crate::error::Result;

/// Pause (`pause`) or resume what `p` names.
pub(super) fn transact(pause: bool, p: &Pick<'_>) -> Result<()> {
    let e = &control::runtime()?.engine;
    let r = if pause {
        e.pause_pick(p)
    } else {
        e.resume_pick(p)
    };
    super::progress::noted(pause, r)
}

/// `chunk_state` naming the record a job-wide operation keeps for its undo (`Record::Job`);
/// any other non-zero value names the program's.
const JOB_RECORD: c_int = 2;

/// A whole-tag pause or resume that saves or restores the chunk states.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
unsafe fn tag_with_chunk_state(tag: *const c_char, chunk_state: c_int, pause: bool) -> c_int {
    op_entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        let p = Pick {
            chunk_state: chunk_state != 0,
            record: if chunk_state == JOB_RECORD {
                Record::Job
            } else {
                Record::Program
            },
            ..Pick::tag(tag)
        };
        transact(pause, &p)
    })
}

/// Pause every active allocation of `tag` (NULL or `""`: every tag); with `save_chunk_state`,
/// first record which allocations of the tag, and which chunks of chunked ones, are active,
/// for `tms_resume_ex(tag, 1)`. `save_chunk_state` 2 records in a second record, a job-wide
/// operation's for its undo (`tms_resume_ex(tag, 2)`), leaving the program's alone.
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
    chunk_size: *mut u64,
    count: *mut u64,
) -> c_int {
    entry(|| {
        let i = control::runtime()?.engine.chunk_info(addr)?;
        let outs = [
            (start, i.addr),
            (chunk_size, i.chunk),
            (count, i.active.len() as u64),
        ];
        // SAFETY: start, chunk_size and count are each NULL or writable (our callers' promise), as
        // put_all needs.
        unsafe { put_all(&outs) };
        Ok(())
    })
}

/// Each chunk's state (1 = active) of the chunked allocation holding `addr`, into `out` of `n`
/// bytes (at least the chunk count; bytes past it are left as they are).
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
    op_entry(|| {
        // SAFETY: `idx` is readable for `n` entries (our callers' promise), as indices needs.
        let v = unsafe { indices(idx, n) }?;
        let start = control::runtime()?.engine.chunk_info(addr)?.addr;
        transact(pause != 0, &Pick::chunks(start, &v))
    })
}

/// Pause (`pause != 0`) or resume the chunks lying wholly inside `[addr, addr + len)` of the
/// chunked allocation holding it (rounded inward: chunks only partly inside are left alone);
/// the first chunk and the count in that range go to `first` and `count` (each may be NULL)
/// before the operation runs, so also where it then fails: what it was to act on.
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
    op_entry(|| {
        let (start, idx) = control::runtime()?.engine.chunks_in(addr, len)?;
        let outs = [
            (first, idx.first().map_or(0, |&i| i as u64)),
            (count, idx.len() as u64),
        ];
        // SAFETY: first and count are each NULL or writable (our callers' promise), as put_all
        // needs.
        unsafe { put_all(&outs) };
        if idx.is_empty() {
            // Succeeded, acting on nothing: `tms_last_progress` says so rather than op 0.
            return super::progress::noted(pause != 0, Ok(crate::engine::OpReport::default()));
        }
        transact(pause != 0, &Pick::chunks(start, &idx))
    })
}
