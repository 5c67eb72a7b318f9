//! Whether this process is a child of `fork` that must leave everything to the CUDA runtime:
//! forked after the library was first used (semantics.md: the library disables itself there).
//!
//! Two signs, either enough. A `pthread_atfork` handler, registered when the runtime starts,
//! sets a flag in the child. And the pid that began the first use (reading the settings,
//! starting the runtime), recorded before any of its one-time locks is taken: a fork while
//! another thread was inside that first use copies the lock half-taken, and a child that then
//! waited for it would wait for ever. A child has another pid, so it never touches them.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

static FORKED: AtomicBool = AtomicBool::new(false);
static ATFORK: std::sync::Once = std::sync::Once::new();
/// The pid that began the library's first use (0: not begun).
static FIRST_USE_PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn in_fork_child() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Called before the first use takes any one-time lock (the settings, the runtime).
pub fn note_first_use() {
    let _ =
        FIRST_USE_PID.compare_exchange(0, std::process::id(), Ordering::SeqCst, Ordering::SeqCst);
}

/// Registers the handler that flags a child of `fork` (once the runtime starts).
pub fn watch_forks() {
    ATFORK.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(in_fork_child)) };
    });
}

/// True in a child created by `fork` after the library's first use began.
pub fn forked() -> bool {
    if FORKED.load(Ordering::Relaxed) {
        return true;
    }
    match FIRST_USE_PID.load(Ordering::Relaxed) {
        0 => false,
        first => first != std::process::id(),
    }
}
