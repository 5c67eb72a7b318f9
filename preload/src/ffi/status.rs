//! The status plumbing of the C ABI: every entry point's status code and the calling thread's
//! last error ([`entry`]), text written into a caller's buffer ([`write_out`]), and the entry
//! points that report on them (version, build information, status names, last error, error count).

use std::ffi::{c_char, c_int};

use crate::error::{status, Error, Result};
use crate::process::boundary::{catch, set_last_error, with_last_error};

/// Run a fallible entry point: `Ok` is `TMS_OK`, an error its status with the message recorded.
pub(super) fn entry(f: impl FnOnce() -> Result<()>) -> c_int {
    catch(status::INTERNAL, || match f() {
        Ok(()) => status::OK,
        Err(e) => {
            set_last_error(&e);
            e.status()
        }
    })
}

/// Write `s` (with a NUL) into `buf` of `cap` bytes; `BUFFER_TOO_SMALL` when it does not fit.
///
/// # Safety
/// `buf` is NULL or writable for `cap` bytes; `out_len` is NULL or writable.
pub(super) unsafe fn write_out(
    s: &str,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> Result<()> {
    // SAFETY: our caller's promises, which write_bytes_out needs.
    unsafe { write_bytes_out(s.as_bytes(), buf, cap, out_len) }
}

/// [`write_out`] of bytes that need not be UTF-8 (a path), without a NUL among them.
///
/// # Safety
/// As [`write_out`].
pub(super) unsafe fn write_bytes_out(
    s: &[u8],
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> Result<()> {
    if !out_len.is_null() {
        // SAFETY: caller vouches for out_len.
        unsafe { *out_len = s.len() };
    }
    if buf.is_null() {
        return Err(Error::no_buffer(s.len() + 1));
    }
    if cap < s.len() + 1 {
        return Err(Error::buffer_too_small(cap, s.len() + 1));
    }
    // SAFETY: buf has room for s and the NUL (checked).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

/// Library version, a static string.
#[no_mangle]
pub extern "C" fn tms_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// What this build is, a static string: `libtms 0.1.0 (torch-memory-saver, Rust implementation;
/// commit abc1234)`, with the git commit it was built from (`unknown` when the build could not
/// tell).
#[no_mangle]
pub extern "C" fn tms_build_info() -> *const c_char {
    tms_proto::LIBRARY_BUILD_INFO.as_ptr()
}

/// Symbolic name of a status code (`"TMS_OK"`, `"TMS_ERR_DRIVER"`, ...), a static string;
/// `"TMS_ERR_UNKNOWN_STATUS"` for a code that is not a status code (`TMS_OK`, `TMS_ERR_*`).
#[no_mangle]
pub extern "C" fn tms_status_name(code: c_int) -> *const c_char {
    let internal = status::c_name(status::INTERNAL).as_ptr();
    catch(internal, || status::c_name(code).as_ptr())
}

/// Copy this thread's last error message into `buf` (truncated to at most `cap - 1` bytes,
/// before a character it would split, so it stays UTF-8; always NUL-terminated when `cap > 0`;
/// `buf` may be NULL). Returns the full message length, 0 when there is none.
///
/// # Safety
/// `buf` is NULL or writable for `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn tms_last_error(buf: *mut c_char, cap: usize) -> usize {
    catch(0, || {
        with_last_error(|bytes| {
            if !buf.is_null() && cap > 0 {
                let mut n = bytes.len().min(cap - 1);
                // Back to the start of the character the cut falls in (a continuation byte
                // is 0b10xxxxxx): the message is UTF-8, and so must its start be.
                while n > 0 && bytes.get(n).is_some_and(|b| b & 0xC0 == 0x80) {
                    n -= 1;
                }
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

/// How many errors the calling thread has recorded (each failure counts one, also a refused
/// `cudaMalloc` inside a hook): compare before and after to learn whether the library failed.
#[no_mangle]
pub extern "C" fn tms_error_count() -> u64 {
    catch(0, crate::process::boundary::error_count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// A message cut short still is UTF-8, as every string of the header is: the cut falls
    /// before a character it would split, never inside it.
    #[test]
    fn a_truncated_last_error_never_splits_a_character() {
        let msg = "tag \"café\"";
        crate::process::boundary::set_last_message(msg);
        for cap in 1..=msg.len() + 1 {
            let mut buf = [0x55 as c_char; 32];
            // SAFETY: `buf` is writable for its 32 bytes, more than `cap`.
            let n = unsafe { tms_last_error(buf.as_mut_ptr(), cap) };
            assert_eq!(n, msg.len());
            // SAFETY: tms_last_error NUL-terminated it within `cap` bytes.
            let got = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_bytes();
            let want = (0..cap).rev().find(|&k| msg.is_char_boundary(k)).unwrap();
            assert_eq!(got, &msg.as_bytes()[..want], "cap {cap}");
        }
    }

    #[test]
    fn an_output_string_goes_in_a_buffer_that_fits_and_a_missing_one_is_told_as_missing() {
        let mut len = 0usize;
        // SAFETY: a NULL buffer, and `len` writable.
        let e = unsafe { write_out("hello", std::ptr::null_mut(), 64, &mut len) }.unwrap_err();
        assert_eq!(len, 5);
        assert!(matches!(e.kind(), ErrorKind::BufferTooSmall { needed: 6 }));
        assert!(e.to_string().contains("no output buffer (NULL)"), "{e}");
        let mut small = [0 as c_char; 4];
        // SAFETY: `small` is writable for its 4 bytes.
        let e =
            unsafe { write_out("hello", small.as_mut_ptr(), small.len(), &mut len) }.unwrap_err();
        assert!(
            e.to_string().contains("of 4 bytes is too small for 6"),
            "{e}"
        );
        let mut room = [1 as c_char; 8];
        // SAFETY: `room` is writable for its 8 bytes.
        unsafe { write_out("hello", room.as_mut_ptr(), room.len(), std::ptr::null_mut()) }.unwrap();
        let written: Vec<u8> = room[..6].iter().map(|&c| c as u8).collect();
        assert_eq!(written, b"hello\0");
    }
}
