//! What pauses and resumes check with digests (Note [Skipping unchanged memory] in the engine):
//! skipping unchanged memory, verified resumes.

use std::ffi::{c_char, c_int};

use super::args::tag_or_all;
use super::progress::op_entry;
use super::status::entry;
use crate::control;
use crate::engine::{Checks, Pick};
use crate::error::Error;

/// A C flag: 0 or 1, anything else refused (naming `what`).
fn flag(v: c_int, what: &str) -> crate::error::Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(Error::invalid_argument(format!(
            "{what} must be 0 or 1, not {v}"
        ))),
    }
}

/// What pauses and resumes of `tag` check with digests (NULL or `""`: every tag without a
/// setting of its own; `TMS_SKIP_UNCHANGED`, `TMS_VERIFY_RESUME` at start), from the next on:
/// `skip_unchanged` 1: a pause with a retained CPU backup copies only the pieces of memory
/// that changed since that backup took them (found by digesting them on the device);
/// `verify` 1: a resume digests what it restored and fails, staying paused with the backups,
/// where it differs. Each 0 or 1. A driver that cannot digest (HIP) copies everything and
/// skips the checks.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_set_checks(
    tag: *const c_char,
    skip_unchanged: c_int,
    verify: c_int,
) -> c_int {
    entry(|| {
        // SAFETY: `tag` is NULL or a NUL-terminated string valid for this call (our
        // callers' promise), as tag_or_all needs.
        let tag = unsafe { tag_or_all(tag) }?;
        let checks = Checks {
            skip_unchanged: flag(skip_unchanged, "skip_unchanged")?,
            verify: flag(verify, "verify")?,
        };
        control::runtime()?.engine.set_checks(tag, checks);
        Ok(())
    })
}

/// What pauses and resumes of `tag` check (NULL or `""`: the default), into `*skip_unchanged`
/// and `*verify` (0 or 1; each NULL or writable).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string; the outputs are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tms_get_checks(
    tag: *const c_char,
    skip_unchanged: *mut c_int,
    verify: *mut c_int,
) -> c_int {
    entry(|| {
        // SAFETY: as in tms_set_checks.
        let tag = unsafe { tag_or_all(tag) }?;
        let c = control::runtime()?.engine.checks(tag.unwrap_or_default());
        for (out, v) in [(skip_unchanged, c.skip_unchanged), (verify, c.verify)] {
            if !out.is_null() {
                // SAFETY: `out` is writable (our callers' promise), checked non-NULL.
                unsafe { *out = c_int::from(v) };
            }
        }
        Ok(())
    })
}

/// `tms_resume(tag)` that checks what came back against the CPU backups whatever the tag's
/// setting: where it differs the resume fails (`TMS_ERR_DRIVER`, naming the allocation and the
/// bytes) and undoes itself, the memory staying paused with its backups; a driver that cannot
/// digest fails it with `TMS_ERR_UNSUPPORTED` the same way.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_resume_verified(tag: *const c_char) -> c_int {
    op_entry(|| {
        // SAFETY: as in tms_set_checks.
        let tag = unsafe { tag_or_all(tag) }?;
        let pick = Pick {
            verify: true,
            ..Pick::tag(tag)
        };
        super::progress::noted(false, control::runtime()?.engine.resume_pick(&pick))
    })
}
