//! Helper threads that may not be had. A container's pids limit makes thread creation fail, and
//! `std::thread::Scope::spawn` panics then, which inside a pause would leave the other helpers
//! waiting for work that never comes. Every helper the library starts for a pause, a resume or a
//! release goes through [`spawn_scoped`], which reports the failure instead: the caller then does
//! the work on fewer threads, or on its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::{Builder, Scope, ScopedJoinHandle};

static FAIL_SPAWNS: AtomicUsize = AtomicUsize::new(0);

/// Make the next `n` helper spawns fail as a pids limit would (for tests of that path).
#[doc(hidden)]
pub fn fail_next_spawns(n: usize) {
    FAIL_SPAWNS.store(n, Ordering::SeqCst);
}

/// A refusal injected by [`fail_next_spawns`], if one is due.
fn injected() -> Option<std::io::Error> {
    FAIL_SPAWNS
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
        .then(|| {
            std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "thread creation refused (injected)",
            )
        })
}

/// Start a helper named `name` in scope `s`; `None` (logged) where no thread can be had.
pub fn spawn_scoped<'scope, 'env, T: Send + 'scope>(
    s: &'scope Scope<'scope, 'env>,
    name: &str,
    f: impl FnOnce() -> T + Send + 'scope,
) -> Option<ScopedJoinHandle<'scope, T>> {
    let r = match injected() {
        Some(e) => Err(e),
        None => Builder::new().name(name.into()).spawn_scoped(s, f),
    };
    match r {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!("cannot start a {name} thread ({e}): its work is done on fewer threads");
            None
        }
    }
}

/// Start a detached helper named `name`; `false` (logged) where no thread can be had.
pub fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> bool {
    let r = match injected() {
        Some(e) => Err(e),
        None => Builder::new().name(name.into()).spawn(f),
    };
    match r {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!("cannot start a {name} thread ({e})");
            false
        }
    }
}

thread_local! {
    static INSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as inside the library: the interposers hand its `cudaMalloc` and
/// `cudaFree` calls to the runtime (those of NCCL while the library suspends or resumes its
/// communicators, say). `None` if it already was (or its locals are gone).
pub struct Reentry;

impl Reentry {
    /// Enter; the thread is outside again when the guard drops.
    pub fn enter() -> Option<Reentry> {
        match INSIDE.try_with(|f| f.replace(true)) {
            Ok(false) => Some(Reentry),
            _ => None,
        }
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|f| f.set(false));
    }
}
