//! The driver's books of reserved ranges and what is mapped in them, for two ROCm bugs the
//! engine need not know of (Note [ROCm's reserved ranges]).
//!
//! # Note [ROCm's reserved ranges]
//!
//! On ROCm 7.2, `hipMemRelease` of memory that was mapped does not give it back to the device
//! while the address range it was mapped in stays reserved: a pause, which unmaps and releases
//! but keeps the range so that the allocation comes back at its address, would free nothing.
//! So once a range has nothing mapped and holds released memory, the driver frees the range and
//! reserves it again at the same address (`hipMemAddressReserve` with that address), which
//! gives the memory back. Our own reservations wait meanwhile, so none of them takes the
//! address; another library's may. If the same address cannot be had, the range is *lost*: the
//! call that tried says so (a pause then leaves the allocation paused with its backup, as after
//! any failed release), a later map into the range tries to reserve it again first and fails
//! plainly while the address is taken, and freeing it frees nothing. `TMS_HIP_RESERVE_AGAIN=0`
//! turns this off, for a runtime that gives memory back at release.
//!
//! On ROCm 7.2, `hipMemSetAccess` of a mapped range that does not start its reservation may
//! also fail with `hipErrorInvalidValue` (its check adds up the range's mappings from the
//! reservation's first one). Where that happens and everything from the reservation's start to
//! the end of the range is mapped, the driver sets the access of that whole prefix instead: it
//! starts the reservation, and setting read/write again on mapped memory changes nothing.

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;

use crate::driver::DevPtr;

/// One reserved range.
#[derive(Debug)]
struct Range {
    size: u64,
    device: i32,
    /// Mappings in it now.
    mapped: usize,
    /// Released handles that were mapped in it: memory ROCm 7.2 keeps while it is reserved.
    held: usize,
    /// Freed to give that memory back, and not reserved again at its address.
    lost: bool,
}

/// Where a handle is mapped, or was last.
#[derive(Debug)]
struct Placed {
    range: DevPtr,
    mapped: bool,
    released: bool,
}

#[derive(Default)]
struct State {
    ranges: BTreeMap<DevPtr, Range>,
    /// Mappings: start -> (length, handle).
    maps: BTreeMap<DevPtr, (u64, u64)>,
    placed: HashMap<u64, Placed>,
}

impl State {
    /// The start of the range holding `[ptr, ptr+len)`.
    fn range_of(&self, ptr: DevPtr, len: u64) -> Option<DevPtr> {
        self.ranges
            .range(..=ptr)
            .next_back()
            .filter(|(s, r)| ptr + len <= **s + r.size)
            .map(|(s, _)| *s)
    }

    /// `range`'s memory to give back now, if it has some and nothing mapped: taken (its held
    /// count cleared) for the caller to free and reserve again.
    fn take_held(&mut self, range: DevPtr) -> Option<Recycle> {
        let r = self.ranges.get_mut(&range)?;
        if r.held == 0 || r.mapped > 0 || r.lost {
            return None;
        }
        r.held = 0;
        Some(Recycle {
            ptr: range,
            size: r.size,
            device: r.device,
        })
    }
}

/// A range to free and reserve again at its address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Recycle {
    pub ptr: DevPtr,
    pub size: u64,
    pub device: i32,
}

/// The books (a leaf lock, never held across a driver call).
#[derive(Default)]
pub(super) struct Ranges(Mutex<State>);

impl Ranges {
    /// `[ptr, ptr+size)` was reserved on `device`.
    pub fn reserved(&self, ptr: DevPtr, size: u64, device: i32) {
        self.0.lock().ranges.insert(
            ptr,
            Range {
                size,
                device,
                mapped: 0,
                held: 0,
                lost: false,
            },
        );
    }

    /// The range at `ptr` is to be freed: forgotten, with what was placed in it. True if it was
    /// lost (nothing reserved there any more: nothing to free).
    pub fn freeing(&self, ptr: DevPtr) -> bool {
        let mut s = self.0.lock();
        s.placed.retain(|_, p| p.range != ptr);
        s.ranges.remove(&ptr).is_some_and(|r| r.lost)
    }

    /// The lost range `[ptr, ptr+len)` lies in: its start, size and device.
    pub fn lost_range_of(&self, ptr: DevPtr, len: u64) -> Option<Recycle> {
        let s = self.0.lock();
        let start = s.range_of(ptr, len)?;
        let r = &s.ranges[&start];
        r.lost.then_some(Recycle {
            ptr: start,
            size: r.size,
            device: r.device,
        })
    }

    /// Whether the range at `ptr` was lost, and is no more (`lost` false: reserved again) or
    /// stays lost.
    pub fn set_lost(&self, ptr: DevPtr, lost: bool) {
        if let Some(r) = self.0.lock().ranges.get_mut(&ptr) {
            r.lost = lost;
        }
    }

    /// Giving the memory of the range back failed before its range was freed: it is held still.
    pub fn held_again(&self, ptr: DevPtr) {
        if let Some(r) = self.0.lock().ranges.get_mut(&ptr) {
            r.held += 1;
        }
    }

    /// `handle` was mapped at `[ptr, ptr+len)`.
    pub fn mapped(&self, ptr: DevPtr, len: u64, handle: u64) {
        let mut s = self.0.lock();
        let Some(range) = s.range_of(ptr, len) else {
            return;
        };
        if let Some(r) = s.ranges.get_mut(&range) {
            r.mapped += 1;
        }
        s.maps.insert(ptr, (len, handle));
        s.placed.insert(
            handle,
            Placed {
                range,
                mapped: true,
                released: false,
            },
        );
    }

    /// The mapping at `ptr` was unmapped: a range to give memory back from, if any.
    pub fn unmapped(&self, ptr: DevPtr) -> Option<Recycle> {
        let mut s = self.0.lock();
        let (_, handle) = s.maps.remove(&ptr)?;
        let p = s.placed.get_mut(&handle)?;
        p.mapped = false;
        let (range, released) = (p.range, p.released);
        if released {
            s.placed.remove(&handle);
        }
        let r = s.ranges.get_mut(&range)?;
        r.mapped = r.mapped.saturating_sub(1);
        r.held += usize::from(released);
        s.take_held(range)
    }

    /// `handle` was released: a range to give memory back from, if any (memory still mapped
    /// goes back once unmapped).
    pub fn released(&self, handle: u64) -> Option<Recycle> {
        let mut s = self.0.lock();
        let p = s.placed.get_mut(&handle)?;
        if p.mapped {
            p.released = true;
            return None;
        }
        let range = p.range;
        s.placed.remove(&handle);
        s.ranges.get_mut(&range)?.held += 1;
        s.take_held(range)
    }

    /// Where `[ptr, ptr+len)` is mapped but does not start its reservation, and every byte from
    /// the reservation's start to its end is mapped: that start (see the Note).
    pub fn mapped_prefix(&self, ptr: DevPtr, len: u64) -> Option<DevPtr> {
        let s = self.0.lock();
        let start = s.range_of(ptr, len).filter(|st| *st < ptr)?;
        let mut at = start;
        for (&m, &(l, _)) in s.maps.range(start..ptr + len) {
            if m != at {
                return None;
            }
            at = m + l;
        }
        (at >= ptr + len).then_some(start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 21;

    #[test]
    fn a_range_gives_back_once_nothing_is_mapped_and_something_was_released() {
        let r = Ranges::default();
        r.reserved(0x1000_0000, 2 * G, 0);
        r.mapped(0x1000_0000, G, 7);
        r.mapped(0x1000_0000 + G, G, 8);
        assert_eq!(r.unmapped(0x1000_0000), None, "one mapping left");
        assert_eq!(r.released(7), None, "the other is still mapped");
        let want = Recycle {
            ptr: 0x1000_0000,
            size: 2 * G,
            device: 0,
        };
        // Released while mapped: counted when unmapped.
        assert_eq!(r.released(8), None);
        assert_eq!(r.unmapped(0x1000_0000 + G), Some(want));
        assert_eq!(r.unmapped(0x1000_0000 + G), None, "taken once");
        // Mapped again (a resume), then paused again: again.
        r.mapped(0x1000_0000, 2 * G, 9);
        assert_eq!(r.unmapped(0x1000_0000), None, "not released yet");
        assert_eq!(r.released(9), Some(want));
    }

    #[test]
    fn a_handle_never_mapped_or_a_lost_range_gives_nothing_back_here() {
        let r = Ranges::default();
        r.reserved(0x2000_0000, G, 1);
        assert_eq!(r.released(5), None, "never mapped");
        r.mapped(0x2000_0000, G, 6);
        r.set_lost(0x2000_0000, true);
        assert_eq!(r.unmapped(0x2000_0000), None);
        assert_eq!(r.released(6), None, "lost: nothing is reserved to free");
        assert_eq!(r.lost_range_of(0x2000_0000, G).map(|x| x.device), Some(1));
        assert!(r.freeing(0x2000_0000), "freeing a lost range frees nothing");
        assert!(!r.freeing(0x2000_0000), "and it is forgotten");
    }

    #[test]
    fn the_mapped_prefix_is_found_only_where_it_is_whole() {
        let r = Ranges::default();
        let p = 0x4000_0000;
        r.reserved(p, 3 * G, 0);
        r.mapped(p, G, 1);
        assert_eq!(r.mapped_prefix(p, G), None, "starts the reservation");
        r.mapped(p + 2 * G, G, 3);
        assert_eq!(r.mapped_prefix(p + 2 * G, G), None, "a hole before it");
        r.mapped(p + G, G, 2);
        assert_eq!(r.mapped_prefix(p + 2 * G, G), Some(p));
        assert_eq!(r.mapped_prefix(p + G, G), Some(p));
    }
}
