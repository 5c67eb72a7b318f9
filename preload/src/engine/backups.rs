//! Host backups handed to callers: copies, unguarded views, and leases that keep a snapshot
//! alive and unchanged (Note [Pause and resume as transactions], *Backups*; the leases
//! themselves are kept in `leases.rs`).

use std::sync::Arc;

use super::base::Engine;
use super::types::BackupLease;
use crate::backup::{BackupKind, HostBuffer};
use crate::driver::DevPtr;
use crate::error::{Error, Result};

/// How long handing out a retained pinned backup waits for its background page-locking.
const PIN_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl Engine {
    /// Copy the host backup covering `[addr, addr+dst.len())` into `dst`. `Ok(false)` when there
    /// is no complete snapshot (no backup asked; active with the backup released; a pause
    /// writing it, or one that failed).
    pub fn copy_cpu_backup(&self, addr: DevPtr, dst: &mut [u8]) -> Result<bool> {
        // Holding a reference keeps a pause from writing into this buffer meanwhile.
        let Some((off, host)) = self.snapshot_at(addr, dst.len() as u64)? else {
            return Ok(false);
        };
        dst.copy_from_slice(&host.as_slice()[off..off + dst.len()]);
        Ok(true)
    }

    /// Address of the host backup covering `[addr, addr+len)`, or `None` (see
    /// [`Engine::copy_cpu_backup`]). Unguarded: the bytes change with the next pause and go with
    /// a resume without retention or a free. [`Engine::acquire_cpu_backup`] is the safe form.
    /// The caller may write through it at any time, so no pause skips any of the buffer again
    /// (Note [Skipping unchanged memory]): they copy it whole.
    pub fn cpu_backup_ptr(&self, addr: DevPtr, len: u64) -> Result<Option<*const u8>> {
        Ok(self.snapshot_at(addr, len)?.map(|(off, h)| {
            h.digests().expose();
            h.as_ptr().wrapping_add(off)
        }))
    }

    /// The complete snapshot covering `[addr, addr+len)` and the offset into it, or `None`.
    pub(super) fn snapshot_at(
        &self,
        addr: DevPtr,
        len: u64,
    ) -> Result<Option<(usize, Arc<HostBuffer>)>> {
        let reg = self.registry.lock();
        let (start, a) = reg.containing(addr, len)?;
        // Restored by a non-blocking resume without retention, not yet settled: shown active,
        // so its backup, which that resume gives back, is not offered.
        if matches!(a.arriving, Some((_, true))) && !self.settings.retain() {
            return Ok(None);
        }
        // containing() proved addr-start+len <= size == host.len().
        Ok(a.snapshot(addr - start, len)
            .map(|h| ((addr - start) as usize, h.clone())))
    }

    /// Hand out the host backup covering `[addr, addr+len)` (a complete snapshot, see
    /// [`Engine::copy_cpu_backup`]), or `None`. Until [`Engine::release_cpu_backup`] the bytes
    /// stay mapped and unchanged: a pause writes a new buffer instead, and a resume without
    /// retention or a free leaves this one to the lease. A retained pinned backup is handed out
    /// once its background page-locking has finished (bounded by `PIN_WAIT`).
    pub fn acquire_cpu_backup(&self, addr: DevPtr, len: u64) -> Result<Option<BackupLease>> {
        let Some((off, host)) = self.snapshot_at(addr, len)? else {
            return Ok(None);
        };
        if host.backend() == BackupKind::Pinned
            && self.settings.retain()
            && host.pinned_bytes() < host.len()
        {
            // A view of a retained pinned backup is page-locked memory, as the existing
            // library's is (callers copy from it asynchronously, or ask the driver about it):
            // let the page-locking queued for it finish first. Bounded: the pinner is ours.
            if !self.ops.wait_pinned(PIN_WAIT) {
                tracing::warn!(
                    "page-locking the backup of {addr:#x} did not finish within {PIN_WAIT:?}; \
                     handing it out pageable"
                );
            }
        }
        // The holder may write into what it is handed (Python's zero-copy view is writable): a
        // pause skips none of it until it copied it again (and none of the buffer, once let go).
        host.digests().distrust(off as u64, len);
        let ptr = host.as_ptr().wrapping_add(off);
        let lease = self.leases.hand_out(host, off as u64, len);
        Ok(Some(BackupLease { ptr, lease }))
    }

    /// End a lease from [`Engine::acquire_cpu_backup`]; the buffer goes if nothing else holds it.
    pub fn release_cpu_backup(&self, lease: u64) -> Result<()> {
        match self.leases.end(lease) {
            Some(h) => {
                h.digests().distrust_all();
                drop(h);
                Ok(())
            }
            None => Err(Error::not_found(format!(
                "CPU backup lease {lease} is not held (released already?)"
            ))),
        }
    }

    /// CPU backup leases not yet released.
    pub fn cpu_backup_leases(&self) -> usize {
        self.leases.count()
    }
}
