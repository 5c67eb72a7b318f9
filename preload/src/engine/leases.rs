//! The leases of host backups handed to callers (`Engine::acquire_cpu_backup` in
//! `backups.rs`): each keeps its snapshot alive and unchanged until it ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::types::BufferRanges;
use crate::backup::HostBuffer;

/// One lease: the buffer, and the bytes of it handed out (offset, length).
struct Held {
    host: Arc<HostBuffer>,
    off: u64,
    len: u64,
}

/// The backups handed out by `Engine::acquire_cpu_backup`, by lease number; a leaf lock.
pub(super) struct Leases {
    held: Mutex<HashMap<u64, Held>>,
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
    /// Hand out bytes `off..off + len` of `host`; the number of its lease.
    pub fn hand_out(&self, host: Arc<HostBuffer>, off: u64, len: u64) -> u64 {
        let lease = self.next.fetch_add(1, Ordering::Relaxed);
        self.held.lock().insert(lease, Held { host, off, len });
        lease
    }

    /// End a lease; its buffer (dropped by the caller, after the lock is let go).
    pub fn end(&self, lease: u64) -> Option<Arc<HostBuffer>> {
        self.held.lock().remove(&lease).map(|h| h.host)
    }

    /// Leases not yet ended.
    pub fn count(&self) -> usize {
        self.held.lock().len()
    }

    /// Of `bufs`, those no lease holds: a leased buffer is its holder's to free.
    pub fn unleased(&self, bufs: Vec<Arc<HostBuffer>>) -> Vec<Arc<HostBuffer>> {
        let held = self.held.lock();
        bufs.into_iter()
            .filter(|b| !held.values().any(|l| Arc::ptr_eq(&l.host, b)))
            .collect()
    }

    /// Of `parts` (byte ranges of buffers the registry keeps, which nobody is to read any
    /// more: chunks resumed without retention), those whose pages may go now: nothing holds
    /// the buffer but the registry, this list and leases of other bytes of it. A lease of any
    /// of those bytes keeps them; so does a reader of a moment, which may read any of it.
    pub fn unread(&self, parts: Vec<BufferRanges>) -> Vec<BufferRanges> {
        let held = self.held.lock();
        parts
            .into_iter()
            .filter(|(h, ranges)| {
                let mut others = 0;
                for l in held.values().filter(|l| Arc::ptr_eq(&l.host, h)) {
                    if ranges
                        .iter()
                        .any(|&(off, len)| off < l.off + l.len && l.off < off + len)
                    {
                        return false;
                    }
                    others += 1;
                }
                // Counted under the leases' lock: none of them ends meanwhile.
                Arc::strong_count(h) == 2 + others
            })
            .collect()
    }
}
