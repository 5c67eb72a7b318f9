//! The leases of host backups handed to callers (`Engine::acquire_cpu_backup` in
//! `backups.rs`): each keeps its snapshot alive and unchanged until it ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backup::HostBuffer;

/// The backups handed out by `Engine::acquire_cpu_backup`, by lease number; a leaf lock.
pub(super) struct Leases {
    held: Mutex<HashMap<u64, Arc<HostBuffer>>>,
    next: AtomicU64,
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            held: Mutex::default(),
            next: AtomicU64::new(1),
        }
    }
}

impl Leases {
    /// Hand `host` out; the number of its lease.
    pub fn hand_out(&self, host: Arc<HostBuffer>) -> u64 {
        let lease = self.next.fetch_add(1, Ordering::Relaxed);
        self.held.lock().insert(lease, host);
        lease
    }

    /// End a lease; its buffer (dropped by the caller, after the lock is let go).
    pub fn end(&self, lease: u64) -> Option<Arc<HostBuffer>> {
        self.held.lock().remove(&lease)
    }

    /// Leases not yet ended.
    pub fn count(&self) -> usize {
        self.held.lock().len()
    }

    /// Of `bufs`, those no lease holds: a leased buffer is its holder's to free.
    pub fn unleased(&self, bufs: Vec<Arc<HostBuffer>>) -> Vec<Arc<HostBuffer>> {
        let held = self.held.lock();
        bufs.into_iter()
            .filter(|b| !held.values().any(|l| Arc::ptr_eq(l, b)))
            .collect()
    }
}
