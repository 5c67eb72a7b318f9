//! The registry: a small index of allocations, their owners' questions answered at once.
//!
//! It holds what the hooks ask (is this address ours?) and each allocation's state; the work of
//! a pause or resume runs outside it, on copies of what it needs (Note [Pause and resume as
//! transactions] in `mod.rs`). Its lock is held only to read or change entries, never across a
//! driver call, a copy or a wait.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::segment::Span;
use super::{stats, Backup, State};
use crate::backup::{DiskFile, HostBuffer};
use crate::driver::{DevPtr, PhysHandle};
use crate::error::{Error, Result};

pub(super) struct Allocation {
    pub size: u64,
    pub mapped: u64,
    pub device: i32,
    pub tag: Arc<str>,
    pub backup: Backup,
    /// Bytes of each physical segment (the last may be shorter).
    pub segment: u64,
    pub state: State,
    /// One handle per segment while mapped (Active, Pausing); none otherwise.
    pub handles: Vec<PhysHandle>,
    pub host: Option<Arc<HostBuffer>>,
    /// The disk backup's file, kept from the first disk-backed pause until the allocation goes.
    pub disk: Option<Arc<DiskFile>>,
    /// The backup (host buffer or file) holds a complete snapshot: the contents while paused,
    /// the last pause's contents while active with the backup retained. False while a pause
    /// writes it.
    pub host_valid: bool,
    pub pauseable: bool,
}

impl Allocation {
    /// Where its segments lie, `ptr` being its address.
    pub fn span(&self, ptr: DevPtr) -> Span {
        Span {
            device: self.device,
            ptr,
            mapped: self.mapped,
            segment: self.segment,
        }
    }

    /// In the middle of a pause or resume: its owner waits before freeing it.
    pub fn in_transition(&self) -> bool {
        matches!(self.state, State::Pausing | State::Resuming)
    }

    /// The host backup as a complete snapshot, if there is one.
    pub fn snapshot(&self) -> Option<&Arc<HostBuffer>> {
        self.host.as_ref().filter(|_| self.host_valid)
    }
}

#[derive(Default)]
pub(super) struct Registry {
    pub allocs: BTreeMap<DevPtr, Allocation>,
    pub history: HashMap<Arc<str>, stats::History>,
    pub granularity: HashMap<i32, u64>,
    /// Allocations with a backup policy: the staging slots go when the last one does.
    pub backed: usize,
}

impl Registry {
    /// Pauseable allocations of `tag` (every tag if `None`) in `state`, in address order.
    pub fn selected(&self, tag: Option<&str>, state: State) -> Vec<DevPtr> {
        self.allocs
            .iter()
            .filter(|(_, a)| a.pauseable && a.state == state && tag.is_none_or(|t| &*a.tag == t))
            .map(|(p, _)| *p)
            .collect()
    }

    /// The allocation holding `[addr, addr+len)` within its asked size.
    pub fn containing(&self, addr: DevPtr, len: u64) -> Result<(DevPtr, &Allocation)> {
        let not_found = || {
            Error::NotFound(format!(
                "range {addr:#x}+{len} does not lie inside one pauseable allocation"
            ))
        };
        let (start, a) = self
            .allocs
            .range(..=addr)
            .next_back()
            .ok_or_else(not_found)?;
        let end = addr.checked_add(len).ok_or_else(not_found)?;
        if end <= start + a.size {
            Ok((*start, a))
        } else {
            Err(not_found())
        }
    }

    /// Start a transaction on the pauseable allocations of `tag` (every tag if `None`) in state
    /// `from`: mark each `during` and return what `f` copies out of it, in address order.
    pub fn begin<J>(
        &mut self,
        tag: Option<&str>,
        from: State,
        during: State,
        mut f: impl FnMut(DevPtr, &mut Allocation) -> J,
    ) -> Vec<J> {
        self.selected(tag, from)
            .into_iter()
            .map(|ptr| {
                let a = self.marked(ptr);
                a.state = during;
                f(ptr, a)
            })
            .collect()
    }

    /// The entry a transaction marked; it cannot be gone (frees wait for the transition).
    pub fn marked(&mut self, ptr: DevPtr) -> &mut Allocation {
        self.allocs
            .get_mut(&ptr)
            .expect("an allocation in transition is not freed")
    }
}
