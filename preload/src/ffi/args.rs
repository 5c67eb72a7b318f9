//! The C ABI's arguments: strings, buffers and arrays checked before use, so a bad one is an
//! `InvalidArgument` error rather than undefined behaviour.

use std::ffi::{c_char, CStr};

use crate::error::{Error, Result};

/// A required string argument.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for this call.
pub(super) unsafe fn arg_str<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::invalid_argument(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller vouches for NUL termination.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::invalid_argument(format!("{what} is not valid UTF-8")))
}

/// An optional string argument (NULL = none).
///
/// # Safety
/// As [`arg_str`].
pub(super) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
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
pub(super) fn buffer_len(is_null: bool, len: u64, what: &str) -> Result<Option<usize>> {
    let n = usize::try_from(len)
        .ok()
        .filter(|n| isize::try_from(*n).is_ok())
        .ok_or_else(|| Error::invalid_argument(format!("length {len}")))?;
    if n == 0 {
        return Ok(None);
    }
    if is_null {
        return Err(Error::invalid_argument(format!("{what} is NULL")));
    }
    Ok(Some(n))
}

/// The tag argument of pause and resume: NULL or `""` is every tag (callers of the existing
/// library pass `""` for that).
///
/// # Safety
/// As [`arg_str`].
pub(super) unsafe fn tag_or_all<'a>(p: *const c_char) -> Result<Option<&'a str>> {
    // SAFETY: `p` is NULL or a NUL-terminated string valid for this call (our
    // callers' promise), as opt_str needs.
    Ok(unsafe { opt_str(p, "tag") }?.filter(|t| !t.is_empty()))
}

/// The chunk indices of a C array, sorted and each once (an index that does not fit `usize`
/// reads as `usize::MAX`, which the engine refuses as a chunk the allocation lacks).
///
/// # Safety
/// `idx` is readable for `n` entries (or `n` is 0).
pub(super) unsafe fn indices<T: Copy + TryInto<usize>>(
    idx: *const T,
    n: u64,
) -> Result<Vec<usize>> {
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
pub(super) fn room(n: usize, count: usize, what: &str) -> Result<()> {
    if n < count {
        return Err(Error::invalid_argument(format!(
            "{what} has room for {n} entries, but the allocation has {count} chunks"
        )));
    }
    Ok(())
}

/// Write each value to its output, where the output is not NULL.
///
/// # Safety
/// Each output is NULL or writable.
pub(super) unsafe fn put_all(outs: &[(*mut u64, u64)]) {
    for &(p, v) in outs {
        if !p.is_null() {
            // SAFETY: the caller vouches for non-NULL outputs.
            unsafe { *p = v };
        }
    }
}
