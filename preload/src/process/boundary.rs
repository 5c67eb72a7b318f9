//! What every entry point called from C (the interposers, the pluggable allocator, the C ABI)
//! needs at the boundary: no panic crosses it ([`catch`]), and a failure leaves its message as
//! the calling thread's last error (read back by `tms_last_error`).

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{panic_message, Error};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// How many errors this thread has recorded: tells a caller whether a call it made set a
    /// new one, even when the message is the same as before.
    static ERRORS: Cell<u64> = const { Cell::new(0) };
}

/// How many errors this thread has recorded so far.
pub fn error_count() -> u64 {
    ERRORS.try_with(Cell::get).unwrap_or(0)
}

/// Record `e` as this thread's last error.
pub fn set_last_error(e: &Error) {
    set_last_message(&e.to_string());
}

/// Record `msg` as this thread's last error.
pub fn set_last_message(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = c);
    let _ = ERRORS.try_with(|n| n.set(n.get() + 1));
}

/// `f` applied to this thread's last error message (without its NUL); `None` once the
/// thread's locals are gone (it is exiting).
pub fn with_last_error<T>(f: impl FnOnce(&[u8]) -> T) -> Option<T> {
    LAST_ERROR.try_with(|l| f(l.borrow().as_bytes())).ok()
}

/// Run `f`, turning a panic into `fallback` and a recorded internal error.
pub fn catch<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = format!(
                "internal error (a bug in torch-memory-saver): {}",
                panic_message(&*p)
            );
            tracing::error!("{msg}");
            set_last_message(&msg);
            fallback
        }
    }
}
