//! Host memory work beside the transactions, which each one's prologue (`Txn::begin`) waits
//! for or holds back: the host memory earlier resumes are giving back ([`Releases`]: waited for),
//! and the background pinner ([`Pinner`]: held quiet while the transaction runs).
//!
//! # Note [Releases]
//!
//! Host memory given back after a resume has returned. A resume without retention no longer
//! needs its backups, and giving their memory back (the kernel frees every page, the driver
//! unregisters page-locked backups and the staging slots) takes 4–8% as long as the resume
//! itself (16 GiB on an H200 host: 14–23 ms). Nothing the caller does next needs the
//! unregistering done, so a blocking resume hands the page-locked backups and the staging slots
//! to a thread of its own and returns: the data is on the device by then, and the memory is
//! about to go. Pageable (`mmap`) backups and the pages of chunks resumed without retention go
//! before it returns: they exist so that the kernel gets their pages back, and a caller reading
//! its resident set right after the resume must see them gone (3–5 ms per 4 GiB on an H200 host,
//! docs/perf-notes.md). The next pause or resume waits for the thread first
//! ([`Releases::wait`] in `Txn::begin`, once it holds the operations lock; a transaction counts
//! its release as pending before it lets go of that lock, [`Releases::coming`]), so host memory
//! never holds two generations of backups at once, and `Engine::wait_released` (`inflight.rs`)
//! waits for it on request. Where no thread can be had, all of it is done before the resume
//! returns; a non-blocking resume's own thread does all of it itself.
//!
//! # Note [The background pinner]
//!
//! It page-locks retained pinned backups after the pause or resume that
//! kept them, so the next cycles copy them straight at link speed while no operation waits for
//! the page-locking (Note [The copy pipeline] in `pipeline.rs`).
//!
//! One thread, started when there is work and ending when there is none, so a process that
//! never retains a pinned backup never has it. It holds only weak references between chunks: a
//! buffer freed or released meanwhile is skipped, and a release in progress waits at most for
//! the one chunk being page-locked (`release_parallel`, `HostBuffer::discard`). It waits while a
//! pause or resume runs ([`Pinner::quiet`]): page-locking beside the copies slowed them down 2×
//! on an H200 host.
//! A failure (a memory-lock limit, say) is logged and leaves the rest of that buffer pageable,
//! which only costs speed.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::types::BufferRanges;
use crate::backup::{release_parallel, BackupKind, HostBuffer};

/// Releases running on their own threads.
#[derive(Default)]
pub(super) struct Releases {
    /// Releases started and not yet done.
    pending: Mutex<usize>,
    done: Condvar,
}

/// Ends one pending release when dropped, however its work ended.
pub(super) struct Pending(Arc<Releases>);

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
    /// A release that a transaction letting go of the operations lock may be about to start:
    /// pending from now until the token goes, so that the transaction taking the lock next
    /// waits for it too (Note [Releases]).
    pub(super) fn coming(self: &Arc<Self>) -> Pending {
        *self.pending.lock() += 1;
        Pending(self.clone())
    }

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

/// What a resume gives back once its transaction let go of the operations lock.
pub(super) struct GiveBack<R> {
    /// Host backups no longer needed, none of them leased.
    pub released: Vec<Arc<HostBuffer>>,
    /// Host memory of chunks resumed without retention, in buffers their paused neighbours
    /// still need.
    pub drop_pages: Vec<BufferRanges>,
    /// What goes with the page-locked backups (the staging slots the transaction took).
    pub with: Option<R>,
    /// Threads to release on (the copy workers').
    pub threads: usize,
}

impl Releases {
    /// Give back what a resume no longer needs, in parallel and without holding up anyone
    /// else: the pages of chunks now (while the transaction still holds the pinner quiet: it
    /// must not page-lock them meanwhile); pageable (mmap) backups now too, since they exist so
    /// that the kernel gets their pages back (a caller reading its resident set right after
    /// the resume sees them gone); page-locked ones, slower to unregister, and `with` on a
    /// thread of their own, or here if `here`. The seconds spent here.
    pub(super) fn give_back<R: Send + 'static>(
        self: &Arc<Self>,
        g: GiveBack<R>,
        here: bool,
    ) -> f64 {
        let t0 = Instant::now();
        drop_pages(g.drop_pages);
        let threads = g.threads;
        let (now, later): (Vec<_>, Vec<_>) = g
            .released
            .into_iter()
            .partition(|b| b.backend() == BackupKind::Mmap);
        let anything = !later.is_empty() || g.with.is_some();
        release_parallel(now, threads);
        let with = g.with;
        let rest = move || {
            release_parallel(later, threads);
            drop(with);
        };
        if here {
            rest();
        } else if anything {
            self.start(rest);
        }
        t0.elapsed().as_secs_f64()
    }
}

/// Give back the host memory of chunks resumed without retention, in buffers their paused
/// neighbours still need. Here, while the pinner is still held quiet by the transaction (it
/// must not page-lock these chunks meanwhile). Each is one nobody reads any more
/// (`Leases::unread`: no lease of those bytes and no reader from before the resume; later ones
/// only read chunks the backup holds, never these).
fn drop_pages(bufs: Vec<BufferRanges>) {
    for (h, ranges) in bufs {
        for (off, len) in ranges {
            h.drop_pages(off, len);
        }
    }
}

#[derive(Default)]
struct Queue {
    /// Buffers and which of their chunks to page-lock.
    buffers: VecDeque<(Weak<HostBuffer>, Vec<usize>)>,
    running: bool,
    /// Pauses and resumes under way: the pinner waits for them (page-locking slows the
    /// driver's copies down several times over, measured on an H200 host).
    ops: usize,
    /// The pinner holds a buffer (page-locking a chunk of it): a pause or resume waits for this
    /// to end, so that while it runs, the references it counts to a backup are all there are.
    busy: bool,
}

/// The pinner of one engine.
#[derive(Default)]
pub(super) struct Pinner {
    queue: Mutex<Queue>,
    idle: Condvar,
    ops_done: Condvar,
}

/// The pinner holds a buffer while this lives.
struct Busy<'a>(&'a Pinner);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.queue.lock().busy = false;
        self.0.ops_done.notify_all();
    }
}

/// Keeps the pinner waiting while a pause or resume runs.
pub(super) struct Quiet<'a>(&'a Pinner);

impl Drop for Quiet<'_> {
    fn drop(&mut self) {
        let mut q = self.0.queue.lock();
        q.ops -= 1;
        if q.ops == 0 {
            self.0.ops_done.notify_all();
        }
    }
}

impl Pinner {
    /// Page-lock these chunks of these buffers soon (those still wanted then:
    /// [`HostBuffer::want`]), starting the thread if it is not running.
    pub(super) fn enqueue(self: &Arc<Self>, bufs: Vec<(Weak<HostBuffer>, Vec<usize>)>) {
        if bufs.is_empty() {
            return;
        }
        let mut q = self.queue.lock();
        q.buffers.extend(bufs);
        if q.running {
            return;
        }
        let me = self.clone();
        match std::thread::Builder::new()
            .name("tms-pinner".into())
            .spawn(move || me.work())
        {
            Ok(_) => q.running = true,
            Err(e) => {
                tracing::warn!("cannot start the background pinner ({e}): backups stay pageable");
                q.buffers.clear();
            }
        }
    }

    /// Hold the pinner back until the guard is dropped; returns once a chunk being page-locked
    /// is done.
    pub(super) fn quiet(&self) -> Quiet<'_> {
        let mut q = self.queue.lock();
        q.ops += 1;
        while q.busy {
            self.ops_done.wait(&mut q);
        }
        Quiet(self)
    }

    /// Wait until no pause or resume runs, and mark the pinner busy until the guard is dropped
    /// (also by an unwind, so a panic never leaves a pause waiting).
    fn busy(&self) -> Busy<'_> {
        let mut q = self.queue.lock();
        while q.ops > 0 {
            self.ops_done.wait(&mut q);
        }
        q.busy = true;
        Busy(self)
    }

    fn work(self: Arc<Self>) {
        loop {
            let next = {
                let mut q = self.queue.lock();
                match q.buffers.pop_front() {
                    Some(w) => w,
                    None => {
                        q.running = false;
                        self.idle.notify_all();
                        return;
                    }
                }
            };
            if catch_unwind(AssertUnwindSafe(|| self.pin_buffer(&next.0, &next.1))).is_err() {
                tracing::error!("background pinner: a panic was caught; the buffer stays pageable");
            }
        }
    }

    /// Wait until nothing is queued or being page-locked; false on timeout.
    pub(super) fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue.lock();
        while q.running {
            if self.idle.wait_until(&mut q, deadline).timed_out() {
                return !q.running;
            }
        }
        true
    }

    fn pin_buffer(&self, w: &Weak<HostBuffer>, chunks: &[usize]) {
        for &i in chunks {
            let r = {
                let _busy = self.busy();
                w.upgrade()
                    .filter(|b| !b.retired())
                    .map(|b| b.pin_wanted(i))
            };
            let Some(r) = r else { return };
            if let Err(e) = r {
                tracing::warn!(
                "page-locking a host backup in the background: {e}; the rest of it stays pageable \
                 (its copies go through the staging slots)"
            );
                return;
            }
        }
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
