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
    array_len::<u8>(is_null, len, what)
}

/// As [`buffer_len`], for an array of `len` entries of `T`: their bytes, not only their count,
/// must fit `isize` (a slice of more is undefined behaviour, which a debug build aborts on).
pub(super) fn array_len<T>(is_null: bool, len: u64, what: &str) -> Result<Option<usize>> {
    let size = std::mem::size_of::<T>();
    let n = usize::try_from(len)
        .ok()
        .filter(|n| {
            n.checked_mul(size)
                .is_some_and(|b| isize::try_from(b).is_ok())
        })
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "{what}: length {len} (of {size}-byte entries) is more than memory can hold"
            ))
        })?;
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
    let Some(n) = array_len::<T>(idx.is_null(), n, "chunk index array")? else {
        return Ok(Vec::new());
    };
    // SAFETY: the caller vouches for n readable entries; array_len checked the pointer and
    // that their bytes fit isize.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A count whose entries would span more than `isize::MAX` bytes is refused before a slice
    /// is made of it (making one is undefined behaviour; a debug build aborts the process).
    #[test]
    fn an_array_count_too_large_for_its_entries_is_refused() {
        let one = [7u64];
        // SAFETY: the count is refused before the pointer is read past its one entry.
        let e = unsafe { indices(one.as_ptr(), 1 << 61) }.unwrap_err();
        assert!(e.to_string().contains("chunk index array"), "{e}");
        // SAFETY: as above.
        let v = unsafe { indices(one.as_ptr(), 1) }.unwrap();
        assert_eq!(v, [7]);
        let order = [0u64];
        // SAFETY: the count is refused before `order` is read.
        let s = unsafe {
            crate::ffi::tms_resume_nonblocking(
                std::ptr::null(),
                -1,
                0,
                order.as_ptr(),
                1 << 61,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(s, crate::error::status::INVALID_ARGUMENT);
        // SAFETY: as above.
        let s = unsafe { crate::ffi::tms_nccl_adopt(order.as_ptr(), 1 << 61) };
        assert_eq!(s, crate::error::status::INVALID_ARGUMENT);
    }
}
