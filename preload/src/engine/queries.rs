//! Questions about allocations and operations: progress, chunks, the allocation list, stats.
//! None of them waits for a pause or resume.

use super::base::Engine;
use super::comms::{CommStats, NCCL_TAG};
use super::progress::Progress;
use super::segment::segments;
use super::stats::{self, Stats, TagStats};
use super::txn::check_tag;
use super::types::{AllocInfo, ChunkInfo};
use crate::backup::{DiskFile, HostBuffer};
use crate::driver::DevPtr;
use crate::error::{Error, Result};

impl Engine {
    /// The pause or resume running now, whoever started it, and how far it has got; `None`
    /// when none runs. Cheap, and never waits for the operation: a status or a progress
    /// display may ask as often as it likes.
    pub fn progress(&self) -> Option<Progress> {
        self.ops.progress()
    }

    /// Wait until the background pinner has page-locked what it was given (false on timeout).
    /// Only benchmarks and tests need this: copies never wait for it.
    pub fn wait_for_background_pinning(&self, timeout: std::time::Duration) -> bool {
        self.ops.wait_pinned(timeout)
    }

    /// The one chunked allocation of `tag`; an error if it has none, or several (named).
    pub fn chunked(&self, tag: &str) -> Result<DevPtr> {
        check_tag(Some(tag))?;
        let reg = self.registry.lock();
        let found: Vec<(DevPtr, u64)> = reg
            .allocs
            .iter()
            .filter(|(_, a)| a.pauseable && a.chunk > 0 && &*a.tag == tag)
            .map(|(p, a)| (*p, a.size))
            .collect();
        match found[..] {
            [(p, _)] => Ok(p),
            [] => Err(Error::not_found(format!(
                "tag {tag:?} has no chunked allocation (allocate in a region with a chunk size)"
            ))),
            _ => Err(Error::invalid_argument(format!(
                "tag {tag:?} has {} chunked allocations ({}); name one by its address (or, from Python, its tensor)",
                found.len(),
                found
                    .iter()
                    .map(|(p, n)| format!("{p:#x}, {n} bytes"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ))),
        }
    }

    /// The chunked allocation holding `[addr, addr+len)`, and the chunks wholly inside that
    /// range (rounded inward: a chunk only partly inside is left out).
    pub fn chunks_in(&self, addr: DevPtr, len: u64) -> Result<(DevPtr, Vec<usize>)> {
        let reg = self.registry.lock();
        let (start, a) = reg.chunked_containing(addr, len)?;
        let off = addr - start;
        let first = off.div_ceil(a.chunk);
        let end = (off + len) / a.chunk;
        Ok((start, (first..end.max(first)).map(|c| c as usize).collect()))
    }

    /// Layout and states of the chunked allocation at `addr` (its start or any address in it).
    pub fn chunk_info(&self, addr: DevPtr) -> Result<ChunkInfo> {
        let reg = self.registry.lock();
        let (start, a) = reg.chunked_containing(addr, 1)?;
        Ok(ChunkInfo {
            addr: start,
            tag: a.tag.to_string(),
            chunk: a.chunk,
            layout: segments(a.mapped, a.segment).collect(),
            active: a.shown_active(),
        })
    }

    /// Every allocation, in address order.
    pub fn allocations(&self) -> Vec<AllocInfo> {
        let reg = self.registry.lock();
        reg.allocs
            .iter()
            .map(|(p, a)| AllocInfo {
                addr: *p,
                size: a.size,
                mapped: a.mapped,
                device: a.device,
                tag: a.tag.to_string(),
                backup: a.backup,
                state: a.shown_state(),
                host_bytes: a.host_bytes(),
                host_pinned_bytes: a.host.as_deref().map_or(0, HostBuffer::pinned_bytes),
                disk_bytes: a.disk.as_deref().map_or(0, DiskFile::len),
                host_valid: a.fully_saved(),
                handles: a.handles.iter().flatten().count(),
                chunk: a.chunk,
                // What landed counts, as in `state` and `stats()`: mapped, contents there.
                active_bytes: a.shown_bytes().0,
                pauseable: a.pauseable,
                resident: a.resident,
            })
            .collect()
    }

    /// Per-tag statistics.
    pub fn stats(&self) -> Stats {
        let reg = self.registry.lock();
        // Under the registry's lock, as they are changed: a failure shows with its allocations.
        let failed = self.restores.failures();
        let mut s = stats::collect(
            reg.allocs.values().map(|a| {
                let (active, arriving, unrestored) = a.shown_bytes();
                stats::Row {
                    tag: &a.tag,
                    serial: a.serial,
                    size: a.size,
                    mapped: a.mapped,
                    active,
                    arriving,
                    unrestored,
                    resident: a.resident,
                    host: a.host_bytes(),
                    // Of those bytes: whole pages are locked, and the last one of a backup
                    // may hold less of it (or a chunk it no longer holds).
                    host_pinned: a
                        .host
                        .as_deref()
                        .map_or(0, HostBuffer::pinned_bytes)
                        .min(a.host_bytes()),
                    disk: a.disk.as_deref().map_or(0, DiskFile::len),
                }
            }),
            &reg.history,
        );
        for (msg, ptrs) in failed {
            for p in ptrs {
                let Some(a) = reg.allocs.get(&p) else {
                    continue;
                };
                if let Some(t) = s.tags.iter_mut().find(|t| t.tag == *a.tag) {
                    t.failed_restore.get_or_insert_with(|| msg.clone());
                }
            }
        }
        drop(reg);
        if let Some(c) = self.comm_stats() {
            nccl_entry(&mut s, c);
        }
        s.backend = self.driver.name().to_string();
        s.retain_cpu_backup = self.settings.retain();
        s.memory_margin_bytes = self.settings.margin();
        s
    }
}

/// The communicators' numbers as the reserved tag's entry (made where its history has none):
/// its allocations count communicators, its bytes NCCL's own.
fn nccl_entry(s: &mut Stats, c: CommStats) {
    let at = match s.tags.binary_search_by(|t| t.tag.as_str().cmp(NCCL_TAG)) {
        Ok(i) => i,
        Err(i) => {
            s.tags.insert(
                i,
                TagStats {
                    tag: NCCL_TAG.to_string(),
                    ..Default::default()
                },
            );
            i
        }
    };
    let t = &mut s.tags[at];
    t.allocations = c.communicators;
    t.active_allocations = c.communicators - c.suspended;
    t.paused_allocations = c.suspended;
    t.bytes_requested = c.total_bytes;
    t.bytes_paused = c.suspended_bytes;
    t.bytes_active = c.total_bytes.saturating_sub(c.suspended_bytes);
    t.nccl = Some(c);
}
