//! How far the copy pipeline's coordinator has prepared its items, for the workers to wait on
//! (Note [The copy pipeline] in `pipeline.rs`): the coordinator publishes each item once it is
//! prepared in full, and the bytes of the one being prepared as they become usable (a resume
//! maps a large allocation segment by segment); a worker waits until the bytes it is to copy
//! are published, or until the work is stopped.
//!
//! What it promises, checked under the `loom` model checker (the tests below; `scripts/test`
//! runs them):
//! - No lost wakeup: a waiter whose bytes get published returns, whenever it started waiting.
//! - A waiter that returns true sees everything the coordinator did before publishing those
//!   bytes (the mappings the copy goes into).
//! - The bytes published of one item never count for the next: a waiter of item `i + 1`
//!   returns only once bytes of item `i + 1` itself are published.
//! - After [`Ready::stop`], every waiter returns false, those asleep included, and so does every
//!   later wait.
//!
//! The state is three atomics, read by a waiter without a lock; the lock (`gate`) only closes
//! the gap between a waiter's last look and its sleep. Every change is made first and then
//! announced with the lock held, so it lands either before the waiter's look under the lock
//! (which then sees it) or after the waiter is asleep on `wake` (which releases the lock
//! atomically), and then the announcement wakes it.

#[cfg(all(loom, test))]
use loom::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    Condvar, Mutex, MutexGuard,
};
#[cfg(not(all(loom, test)))]
use std::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    Condvar, Mutex, MutexGuard,
};

/// The publish/wait state of one pipeline.
pub(super) struct Ready {
    /// Items prepared in full: items `..ready`.
    ready: AtomicUsize,
    /// Bytes `..partial` of item `ready` (the one being prepared) are prepared; reset to 0 before
    /// `ready` moves on, so it never speaks of an earlier item.
    partial: AtomicU64,
    /// The work stopped (a failure): waiters give up.
    stopped: AtomicBool,
    /// Held to announce a change, and by a waiter from its last look until it sleeps.
    gate: Mutex<()>,
    wake: Condvar,
}

impl Ready {
    /// Nothing prepared yet.
    pub(super) fn new() -> Self {
        Ready {
            ready: AtomicUsize::new(0),
            partial: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            gate: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    /// Items `..ready` are prepared in full (called with 1, 2, ... in turn).
    pub(super) fn publish(&self, ready: usize) {
        // Relaxed: this store is ordered before the Release store of `ready` below, so a waiter
        // that sees the new `ready` (Acquire) sees this 0 or a later value, never the byte
        // count of the item before. A waiter that sees 0 with the old `ready` only waits on.
        self.partial.store(0, Ordering::Relaxed);
        // Release: the item's preparation (its mappings) happens before the copies of a waiter
        // that sees this value with Acquire.
        self.ready.store(ready, Ordering::Release);
        self.announce();
    }

    /// Bytes `..bytes` of item `ready` (the one being prepared) are prepared; `bytes` only
    /// grows between two [`Ready::publish`]es.
    pub(super) fn publish_partial(&self, bytes: u64) {
        // Release: as for `ready`, what was prepared of these bytes happens before the copies
        // of a waiter that sees this value with Acquire.
        self.partial.store(bytes, Ordering::Release);
        self.announce();
    }

    /// Stop the work: every waiter returns false, now and later.
    pub(super) fn stop(&self) {
        // Release: whoever sees the stop (Acquire) also sees what the stopper did before it
        // (the error it recorded). Waiters asleep are woken by the announcement.
        self.stopped.store(true, Ordering::Release);
        self.announce();
    }

    /// The work was stopped.
    pub(super) fn stopped(&self) -> bool {
        // Acquire: pairs with the Release store in `stop`.
        self.stopped.load(Ordering::Acquire)
    }

    /// Wait until bytes `..end` of item `i` are prepared: true then, false if the work was
    /// stopped first (or is stopped already).
    pub(super) fn wait(&self, i: usize, end: u64) -> bool {
        if let Some(go) = self.look(i, end) {
            return go;
        }
        let mut g = self.lock();
        loop {
            // Under the gate: a change announced after this look finds this thread asleep.
            if let Some(go) = self.look(i, end) {
                return go;
            }
            g = self
                .wake
                .wait(g)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Whether a waiter for bytes `..end` of item `i` may go (true), must give up (false), or
    /// waits on (`None`).
    fn look(&self, i: usize, end: u64) -> Option<bool> {
        if self.stopped() {
            return Some(false);
        }
        // Acquire, pairing with the Release stores in `publish` and `publish_partial`: the
        // preparation of what is published happens before this waiter's copies. `ready` is
        // read before `partial`, so a `partial` read after seeing `ready == i` is item i's.
        let ready = self.ready.load(Ordering::Acquire);
        if ready > i || (ready == i && self.partial.load(Ordering::Acquire) >= end) {
            Some(true)
        } else {
            None
        }
    }

    /// Wake every waiter, after a change: taking the gate means no waiter is between its last
    /// look and its sleep.
    fn announce(&self) {
        let _g = self.lock();
        self.wake.notify_all();
    }

    /// The gate guards no data (`()`), so a panic while it was held leaves nothing broken.
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.gate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    //! Under `--cfg loom` each test explores every interleaving of its threads (bounded in
    //! preemptions); without it, each runs a few hundred times on real threads.

    use super::Ready;

    #[cfg(loom)]
    use loom::{cell::UnsafeCell, sync::Arc, thread};
    #[cfg(not(loom))]
    use std::{sync::Arc, thread};

    #[cfg(loom)]
    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        if b.preemption_bound.is_none() {
            b.preemption_bound = Some(3);
        }
        b.check(f);
    }

    #[cfg(not(loom))]
    fn model(f: impl Fn()) {
        for _ in 0..200 {
            f();
        }
    }

    /// What the coordinator prepared, written before it publishes and read by a waiter once
    /// its wait returned true: loom fails the test if that read is not ordered after the
    /// write (a data race), so a publish that does not carry the preparation is caught.
    #[cfg(loom)]
    struct Prepared(UnsafeCell<u64>);
    #[cfg(not(loom))]
    struct Prepared(std::sync::atomic::AtomicU64);

    #[cfg(loom)]
    impl Prepared {
        fn new() -> Self {
            Prepared(UnsafeCell::new(0))
        }
        fn set(&self, v: u64) {
            // SAFETY: only the coordinator writes, and readers are ordered after it by the
            // primitive under test (loom checks that).
            self.0.with_mut(|p| unsafe { *p = v });
        }
        fn get(&self) -> u64 {
            // SAFETY: as in set.
            self.0.with(|p| unsafe { *p })
        }
    }

    #[cfg(not(loom))]
    impl Prepared {
        fn new() -> Self {
            Prepared(std::sync::atomic::AtomicU64::new(0))
        }
        fn set(&self, v: u64) {
            self.0.store(v, std::sync::atomic::Ordering::Relaxed);
        }
        fn get(&self) -> u64 {
            self.0.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    #[test]
    fn no_waiter_misses_a_publish() {
        model(|| {
            let r = Arc::new(Ready::new());
            let data = Arc::new(Prepared::new());
            let w = {
                let (r, data) = (r.clone(), data.clone());
                thread::spawn(move || {
                    assert!(r.wait(0, 10));
                    assert_eq!(data.get(), 1, "the preparation is seen");
                })
            };
            data.set(1);
            r.publish(1);
            w.join().unwrap();
        });
    }

    #[test]
    fn partial_then_full_publish() {
        model(|| {
            let r = Arc::new(Ready::new());
            // Bytes ..4 and 4..8 of the item, each written once before it is published.
            let halves = Arc::new([Prepared::new(), Prepared::new()]);
            let waiter = |end: u64| {
                let (r, halves) = (r.clone(), halves.clone());
                thread::spawn(move || {
                    assert!(r.wait(0, end));
                    for (k, h) in halves.iter().take(end as usize / 4).enumerate() {
                        assert_eq!(h.get(), 1, "bytes {}..{} are prepared", 4 * k, 4 * k + 4);
                    }
                })
            };
            let (a, b) = (waiter(4), waiter(8));
            halves[0].set(1);
            r.publish_partial(4);
            halves[1].set(1);
            r.publish(1);
            a.join().unwrap();
            b.join().unwrap();
        });
    }

    #[test]
    fn bytes_of_one_item_never_count_for_the_next() {
        model(|| {
            let r = Arc::new(Ready::new());
            // Bytes prepared of item 1 (item 0 is prepared in full before it starts).
            let data = Arc::new(Prepared::new());
            let w = {
                let (r, data) = (r.clone(), data.clone());
                thread::spawn(move || {
                    assert!(r.wait(1, 6));
                    assert!(data.get() >= 6, "item 1's bytes ..6 are prepared");
                })
            };
            r.publish_partial(8); // item 0's bytes
            r.publish(1);
            r.publish_partial(2);
            data.set(6);
            r.publish_partial(6);
            w.join().unwrap();
        });
    }

    #[test]
    fn stop_wakes_every_waiter() {
        model(|| {
            let r = Arc::new(Ready::new());
            let waiter = |i: usize| {
                let r = r.clone();
                thread::spawn(move || assert!(!r.wait(i, 1), "nothing was published"))
            };
            let (a, b) = (waiter(0), waiter(1));
            r.stop();
            a.join().unwrap();
            b.join().unwrap();
            assert!(r.stopped());
            assert!(!r.wait(0, 0), "a wait after the stop gives up at once");
        });
    }

    #[test]
    fn a_waiter_returns_true_only_for_published_bytes_or_false_after_a_stop() {
        model(|| {
            let r = Arc::new(Ready::new());
            let data = Arc::new(Prepared::new());
            let w = {
                let (r, data) = (r.clone(), data.clone());
                thread::spawn(move || {
                    if r.wait(0, 8) {
                        assert_eq!(data.get(), 8, "true only once the bytes are prepared");
                    }
                })
            };
            r.publish_partial(4);
            let stopper = {
                let r = r.clone();
                thread::spawn(move || r.stop())
            };
            data.set(8);
            r.publish(1);
            stopper.join().unwrap();
            w.join().unwrap();
        });
    }

    #[test]
    fn later_items_release_waiters_of_earlier_ones() {
        model(|| {
            let r = Arc::new(Ready::new());
            let w = {
                let r = r.clone();
                thread::spawn(move || assert!(r.wait(0, u64::MAX)))
            };
            r.publish_partial(1);
            r.publish(2);
            w.join().unwrap();
        });
    }
}
