//! Exporting an active allocation's memory to another process (`TMS_SHAREABLE=1`).

use std::ffi::c_int;
use std::os::fd::IntoRawFd;

use super::status::entry;
use crate::control;
use crate::error::{Error, ErrorKind};

/// Export the memory of the active allocation holding `addr` for another process to import
/// (`cuMemImportFromShareableHandle` with a POSIX file descriptor), one file descriptor per
/// physical segment: the first `capacity` go to `fds`, `offsets` and `lens` (each NULL or
/// writable for `capacity` entries), and `*out_count` (or NULL) says how many there are. With
/// too little room nothing is exported: `TMS_ERR_BUFFER_TOO_SMALL`, `*out_count` the room
/// needed. The descriptors are the caller's to close. Only for memory made while
/// `TMS_SHAREABLE=1`; an importer keeps the memory alive (a pause then gives it back only once
/// every importer released it), and a resume maps new memory that earlier exports do not reach.
///
/// # Safety
/// `fds`, `offsets` and `lens` are NULL or writable for `capacity` entries; `out_count` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn tms_export(
    addr: u64,
    fds: *mut c_int,
    offsets: *mut u64,
    lens: *mut u64,
    capacity: u64,
    out_count: *mut u64,
) -> c_int {
    entry(|| {
        if capacity > 0 && fds.is_null() {
            return Err(Error::invalid_argument(format!(
                "fds is NULL with a capacity of {capacity}"
            )));
        }
        let e = &control::runtime()?.engine;
        let segs = e.export(addr)?;
        let n = segs.len() as u64;
        if !out_count.is_null() {
            // SAFETY: out_count is NULL (checked) or writable (the caller's promise).
            unsafe { out_count.write(n) };
        }
        if n > capacity {
            // The descriptors made go as `segs` is dropped: nothing is exported.
            return Err(Error::new(
                ErrorKind::BufferTooSmall { needed: n as usize },
                format!("room for {capacity} exported segments, {n} needed"),
            ));
        }
        for (i, s) in segs.into_iter().enumerate() {
            // SAFETY: i < n <= capacity, and each array is NULL (skipped) or writable for
            // capacity entries (the caller's promise); fds is not NULL (checked above).
            unsafe {
                if !offsets.is_null() {
                    offsets.add(i).write(s.offset);
                }
                if !lens.is_null() {
                    lens.add(i).write(s.len);
                }
                fds.add(i).write(s.fd.into_raw_fd());
            }
        }
        Ok(())
    })
}
