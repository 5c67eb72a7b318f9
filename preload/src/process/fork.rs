//! Whether this process is a child of `fork` that must leave everything to the CUDA runtime:
//! forked after the library's first use began (semantics.md: the library disables itself there).
//!
//! The first use (reading the settings, starting the runtime) begins by recording its pid and
//! registering a `pthread_atfork` handler that flags a child, before any of its one-time locks
//! is taken: a fork while another thread is inside that first use copies the lock half-taken,
//! and a child that then waited for it would wait for ever. A child is told by its other pid:
//! the handler alone would miss the children of `_Fork` (glibc >= 2.34) and of a raw `clone`,
//! which run no `pthread_atfork` handler, and one forked before the handler was in place (other
//! threads may already be in the first use while the thread that recorded the pid registers it).
//! Nothing is stored on detection: a `vfork` child shares the parent's memory.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Set in a child by the handler.
static FORKED: AtomicBool = AtomicBool::new(false);
/// The pid that began the library's first use (0: not begun).
static FIRST_USE_PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn in_fork_child() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Called before the first use takes any one-time lock (the settings, the runtime); the first
/// caller registers the handler. Nothing here waits.
pub fn note_first_use() {
    let me = std::process::id();
    if FIRST_USE_PID
        .compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
    {
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(in_fork_child)) };
    }
}

/// True in a child created by `fork` (or `_Fork`, or `clone`) after the library's first use
/// began.
pub fn forked() -> bool {
    if FORKED.load(Ordering::Relaxed) {
        return true;
    }
    match FIRST_USE_PID.load(Ordering::Relaxed) {
        0 => false,
        first => first != std::process::id(),
    }
}
