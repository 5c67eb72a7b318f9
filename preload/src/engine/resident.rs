//! Allocations kept resident, and the devices a tag touches.
//!
//! NCCL's user-buffer registration (and CUDA graphs that captured it) hold the physical
//! backing of a buffer, not only its address: remapping new memory at the same address behind
//! them is undefined. `keep_resident` marks the whole allocation holding an address so that
//! pause and resume skip it (it stays mapped, on the same handles) until it is freed.

use super::base::Engine;
use super::txn::check_tag;
use crate::driver::DevPtr;
use crate::error::{Error, Result};

impl Engine {
    /// Keep the allocation holding `addr` mapped across every later pause and resume, until it
    /// is freed; returns its size in bytes (the same for any address in it, and when called
    /// again), or 0 when `addr` lies in no allocation of ours. Refused (InvalidState) while any
    /// of it is paused or a pause or resume is changing it: its backing would not be the one
    /// the caller registered.
    pub fn keep_resident(&self, addr: DevPtr) -> Result<u64> {
        let mut reg = self.registry.lock();
        let Ok((start, a)) = reg.containing(addr, 1) else {
            return Ok(0);
        };
        if a.resident {
            return Ok(a.size);
        }
        if a.in_transition() || a.handles.iter().any(Option::is_none) {
            return Err(Error::invalid_state(format!(
                "keep_resident requires an active allocation: allocation {start:#x} ({} bytes, \
                 tag {:?}) holding {addr:#x} is {} (resume it first)",
                a.size,
                a.tag,
                if a.in_transition() {
                    "being paused or resumed"
                } else {
                    "paused, in whole or in part"
                }
            )));
        }
        let a = reg
            .allocs
            .get_mut(&start)
            .expect("found above under the same lock");
        a.resident = true;
        tracing::debug!(
            "keep_resident {start:#x} ({} bytes, tag {:?})",
            a.size,
            a.tag
        );
        Ok(a.size)
    }

    /// The devices (ordinals, ascending, each once) of the allocations a pause or resume of
    /// `tag` (every tag if `None`) acts on: pauseable ones not kept resident.
    pub fn affected_devices(&self, tag: Option<&str>) -> Result<Vec<i32>> {
        check_tag(tag)?;
        let reg = self.registry.lock();
        let mut out: Vec<i32> = reg
            .allocs
            .values()
            .filter(|a| a.pauseable && !a.resident && tag.is_none_or(|t| &*a.tag == t))
            .map(|a| a.device)
            .collect();
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }
}
