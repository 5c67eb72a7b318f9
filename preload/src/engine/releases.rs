//! Host memory given back after a resume has returned.
//!
//! A resume without retention no longer needs its backups, and giving their memory back (the
//! kernel frees every page, the driver unregisters the staging slots) takes 4–8% as long as
//! the resume itself (16 GiB on an H200 host: 14–23 ms). Nothing the caller does next needs
//! it done, so a blocking resume hands that work to a thread of its own and returns: the data
//! is on the device by then, and the memory is about to go. The next pause or resume waits for
//! it first ([`Releases::wait`] in `Txn::begin`), so host memory never holds two generations of
//! backups at once, and `Engine::wait_released` (`inflight.rs`) waits for it on request. Where no
//! thread can be had, the work is done before the resume returns, as before.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Releases running on their own threads.
#[derive(Default)]
pub(super) struct Releases {
    /// Releases started and not yet done.
    pending: Mutex<usize>,
    done: Condvar,
}

/// Ends one pending release when dropped, however its work ended.
struct Pending(Arc<Releases>);

impl Drop for Pending {
    fn drop(&mut self) {
        let mut n = self.0.pending.lock();
        *n -= 1;
        if *n == 0 {
            self.0.done.notify_all();
        }
    }
}

impl Releases {
    /// Run `work` on a thread of its own, or here where no thread can be had.
    pub(super) fn start(self: &Arc<Self>, work: impl FnOnce() + Send + 'static) {
        *self.pending.lock() += 1;
        let slot = Arc::new(Mutex::new(Some(work)));
        let (theirs, pending) = (slot.clone(), Pending(self.clone()));
        let started = crate::threads::spawn("tms-release", move || {
            let _pending = pending;
            let t0 = Instant::now();
            if let Some(work) = theirs.lock().take() {
                work();
            }
            tracing::debug!(
                "host memory given back in {:.3}s",
                t0.elapsed().as_secs_f64()
            );
        });
        if !started {
            // The closure was dropped unrun, and with it the pending count it held.
            if let Some(work) = slot.lock().take() {
                work();
            }
        }
    }

    /// Wait until every release started is done; how long that took.
    pub(super) fn wait(&self) -> Duration {
        let t0 = Instant::now();
        let mut n = self.pending.lock();
        while *n > 0 {
            self.done.wait(&mut n);
        }
        t0.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_wait_sees_every_release_done_on_a_thread_or_inline() {
        let r = Arc::new(Releases::default());
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        r.start(move || {
            std::thread::sleep(Duration::from_millis(50));
            d.fetch_add(1, Ordering::SeqCst);
        });
        assert!(r.wait() >= Duration::from_millis(20));
        assert_eq!(done.load(Ordering::SeqCst), 1);
        // No thread to be had (unless a test running alongside took the refusal): done all
        // the same, and nothing left pending.
        crate::threads::fail_next_spawns(1);
        let d = done.clone();
        r.start(move || {
            d.fetch_add(1, Ordering::SeqCst);
        });
        r.wait();
        assert_eq!(done.load(Ordering::SeqCst), 2);
        assert_eq!(*r.pending.lock(), 0);
    }
}
