//! An active allocation's physical memory, exported to another process (`TMS_SHAREABLE=1`)
//! and what its memory was made with (`TMS_RDMA`): one file descriptor per segment.
//!
//! An importer maps the same bytes (`cuMemImportFromShareableHandle`), and holds the memory
//! alive while it keeps its import: a pause of the allocation then unmaps and releases our
//! handles, but the device memory goes back only once every importer has released its own. A
//! resume maps new memory, which earlier exports do not reach: export again after a resume.

use std::os::fd::OwnedFd;

use super::base::Engine;
use super::segment::segments;
use crate::driver::{DevPtr, MemoryFlags, PhysHandle};
use crate::error::{Error, Result, ResultExt};

/// One segment of an exported allocation.
#[derive(Debug)]
pub struct Exported {
    /// Its offset in the allocation.
    pub offset: u64,
    /// Its bytes (the last segment may be shorter than the others).
    pub len: u64,
    /// The file descriptor another process imports it with.
    pub fd: OwnedFd,
}

impl Engine {
    /// The segments of the active allocation holding `addr`: where each lies, and its handle.
    /// No pause or resume runs meanwhile (the operations lock), so the handles stay live.
    fn with_segments<T>(
        &self,
        addr: DevPtr,
        f: impl FnOnce(DevPtr, &[(u64, u64, PhysHandle)]) -> Result<T>,
    ) -> Result<T> {
        let _ops = self.ops.exclusive(&self.registry);
        let (start, segs) = {
            let reg = self.registry.lock();
            let (start, a) = reg.containing(addr, 1)?;
            if a.in_transition() || a.handles.iter().any(Option::is_none) {
                return Err(Error::invalid_state(format!(
                    "allocation {start:#x} (tag {:?}) holding {addr:#x} is not wholly active: \
                     resume it first",
                    a.tag
                )));
            }
            let segs: Vec<(u64, u64, PhysHandle)> = segments(a.mapped, a.segment)
                .zip(&a.handles)
                .filter_map(|((off, len), h)| Some((off, len, (*h)?)))
                .collect();
            (start, segs)
        };
        f(start, &segs)
    }

    /// Export the memory of the active allocation holding `addr`, segment by segment, for
    /// another process to import (memory made with `TMS_SHAREABLE=1` only).
    pub fn export(&self, addr: DevPtr) -> Result<Vec<Exported>> {
        self.with_segments(addr, |start, segs| {
            segs.iter()
                .map(|&(offset, len, h)| {
                    let fd = self.driver.export(h).ctx(|| {
                        format!("exporting bytes {offset}..{} of {start:#x}", offset + len)
                    })?;
                    Ok(Exported { offset, len, fd })
                })
                .collect()
        })
    }

    /// What the memory of each segment of the active allocation holding `addr` was made with.
    pub fn memory_props(&self, addr: DevPtr) -> Result<Vec<MemoryFlags>> {
        self.with_segments(addr, |start, segs| {
            segs.iter()
                .map(|&(offset, _, h)| {
                    self.driver
                        .handle_props(h)
                        .ctx(|| format!("segment at {offset} of {start:#x}"))
                })
                .collect()
        })
    }
}
