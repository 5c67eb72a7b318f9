//! The simulated device's memory, host memory standing in for GPU memory:
//!
//! - reserve: `mmap(PROT_NONE)` of address space;
//! - create: a `memfd` of the size (sparse until touched); counts against the device capacity;
//! - map: `mmap(MAP_FIXED | MAP_SHARED)` of the memfd over the reservation, still `PROT_NONE`;
//! - set access: `mprotect(READ | WRITE)`;
//! - unmap: put a `PROT_NONE` anonymous reservation back, so touching the range faults;
//! - release: close the memfd; its pages return to the system once no mapping holds them.
//!
//! The functions here act once the primitive was entered (counted, faults and device checked).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{FromRawFd, OwnedFd};

use super::faults::{driver_err, invalid, Prim};
use super::SimDriver;
use crate::driver::{DevPtr, MemoryFlags, PhysHandle};
use crate::error::{Error, Result};

struct Handle {
    fd: libc::c_int,
    size: u64,
    device: i32,
    released: bool,
    maps: u32,
    /// What it was made with (the simulated device supports both flags).
    flags: MemoryFlags,
}

struct Reservation {
    size: u64,
}

struct Mapping {
    size: u64,
    handle: u64,
    accessible: bool,
}

/// Part of the driver's state: what is reserved, created and mapped.
pub(super) struct Memory {
    /// Physical bytes live per device.
    live: Vec<u64>,
    handles: HashMap<u64, Handle>,
    reservations: BTreeMap<u64, Reservation>,
    mappings: BTreeMap<u64, Mapping>,
    next_handle: u64,
    /// What `create` gives memory.
    pub(super) flags: MemoryFlags,
}

impl Memory {
    pub(super) fn new(devices: i32) -> Self {
        Memory {
            live: vec![0; devices as usize],
            handles: HashMap::new(),
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            next_handle: 1,
            flags: MemoryFlags::default(),
        }
    }

    /// Physical bytes live on `device`.
    pub(super) fn live(&self, device: i32) -> u64 {
        self.live.get(device as usize).copied().unwrap_or(0)
    }

    /// Physical bytes live on every device together.
    pub(super) fn live_total(&self) -> u64 {
        self.live.iter().sum()
    }

    /// Reserve `size` bytes of address space aligned to `align`.
    pub(super) fn reserve(&mut self, align: u64, size: u64) -> Result<DevPtr> {
        // Reserve size + align and trim both ends, so the range is aligned to the granularity
        // as cuMemAddressReserve's is. Past the address space it is out of memory, as a mapping
        // too large for it is (not an overflow).
        let Some(span) = size.checked_add(align) else {
            return Err(driver_err(
                Prim::Reserve,
                2,
                format!("{size} bytes of address space: more than there is"),
            ));
        };
        // SAFETY: a fresh PROT_NONE anonymous mapping; touches no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(driver_err(
                Prim::Reserve,
                2,
                format!(
                    "{size} bytes of address space: {}",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        let start = raw as u64;
        let p = start.next_multiple_of(align);
        // SAFETY: both trimmed pieces lie inside the mapping just made and nothing uses them.
        unsafe {
            if p > start {
                libc::munmap(raw, (p - start) as usize);
            }
            let end = p + size;
            if start + span > end {
                libc::munmap(end as *mut libc::c_void, (start + span - end) as usize);
            }
        }
        self.reservations.insert(p, Reservation { size });
        Ok(p)
    }

    pub(super) fn free_range(&mut self, ptr: DevPtr, size: u64) -> Result<()> {
        match self.reservations.get(&ptr) {
            Some(r) if r.size == size => {}
            _ => {
                return Err(invalid(
                    Prim::FreeRange,
                    format!("ptr {ptr:#x}, {size} bytes is not a reservation"),
                ))
            }
        }
        if self.mappings.range(ptr..ptr + size).next().is_some() {
            return Err(invalid(
                Prim::FreeRange,
                format!("ptr {ptr:#x} still has mappings"),
            ));
        }
        self.reservations.remove(&ptr);
        // SAFETY: the reservation is ours and nothing is mapped in it.
        if unsafe { libc::munmap(ptr as *mut libc::c_void, size as usize) } != 0 {
            return Err(Error::last_os(format!("sim free_range munmap at {ptr:#x}")));
        }
        Ok(())
    }

    /// Create `size` bytes on `device`, whose capacity is `capacity`.
    pub(super) fn create(&mut self, capacity: u64, device: i32, size: u64) -> Result<PhysHandle> {
        let live = self.live[device as usize];
        if live.saturating_add(size) > capacity {
            return Err(driver_err(
                Prim::Create,
                2,
                format!(
                    "device {device}, {size} bytes asked, {} free of {capacity}",
                    capacity - live,
                ),
            ));
        }
        // SAFETY: the name is a valid C string; memfd_create has no other preconditions.
        let fd = unsafe { libc::memfd_create(c"tms-sim".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::last_os("sim create: memfd_create"));
        }
        // SAFETY: fd is the memfd just created.
        if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
            let e = Error::last_os(format!("sim create: ftruncate to {size} bytes"));
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let id = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(
            id,
            Handle {
                fd,
                size,
                device,
                released: false,
                maps: 0,
                flags: self.flags,
            },
        );
        self.live[device as usize] += size;
        Ok(PhysHandle(id))
    }

    /// What `handle`'s memory was made with.
    pub(super) fn props(&self, handle: PhysHandle) -> Result<MemoryFlags> {
        match self.handles.get(&handle.0) {
            Some(h) if !h.released => Ok(h.flags),
            _ => Err(invalid(
                Prim::Export,
                format!("handle {} is not live", handle.0),
            )),
        }
    }

    /// A file descriptor of `handle`'s memory (its memfd, duplicated), as an exported handle.
    pub(super) fn export(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let h = match self.handles.get(&handle.0) {
            Some(h) if !h.released => h,
            _ => {
                return Err(invalid(
                    Prim::Export,
                    format!("handle {} is not live", handle.0),
                ))
            }
        };
        if !h.flags.shareable {
            return Err(driver_err(
                Prim::Export,
                1,
                format!(
                    "handle {}: made without a shareable handle type (TMS_SHAREABLE=1 makes \
                     memory exportable)",
                    handle.0
                ),
            ));
        }
        // SAFETY: h.fd is the handle's open memfd; dup has no other preconditions.
        let fd = unsafe { libc::fcntl(h.fd, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Error::last_os("sim export: dup"));
        }
        // SAFETY: fd was just made and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(super) fn release(&mut self, handle: PhysHandle) -> Result<()> {
        let h = match self.handles.get_mut(&handle.0) {
            Some(h) if !h.released => h,
            _ => {
                return Err(invalid(
                    Prim::Release,
                    format!("handle {} is not live", handle.0),
                ))
            }
        };
        h.released = true;
        // SAFETY: fd is ours; mappings keep the pages alive on their own.
        unsafe { libc::close(h.fd) };
        self.drop_handle_if_done(handle.0);
        Ok(())
    }

    /// Map `handle` at `ptr` (`ptr` aligned to `granularity`).
    pub(super) fn map(
        &mut self,
        granularity: u64,
        ptr: DevPtr,
        size: u64,
        handle: PhysHandle,
    ) -> Result<()> {
        if !ptr.is_multiple_of(granularity) {
            return Err(invalid(
                Prim::Map,
                format!("ptr {ptr:#x} is not aligned to the granularity"),
            ));
        }
        let inside = self
            .reservations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(s, r)| ptr + size <= s + r.size);
        if !inside {
            return Err(invalid(
                Prim::Map,
                format!("ptr {ptr:#x}+{size} is not inside a reservation"),
            ));
        }
        let overlaps = self
            .mappings
            .range(..ptr + size)
            .next_back()
            .is_some_and(|(s, m)| s + m.size > ptr);
        if overlaps {
            return Err(invalid(
                Prim::Map,
                format!("ptr {ptr:#x}+{size} is already mapped"),
            ));
        }
        let fd = match self.handles.get(&handle.0) {
            Some(h) if !h.released && h.size >= size => h.fd,
            _ => {
                return Err(invalid(
                    Prim::Map,
                    format!("handle {} is not live or smaller than {size}", handle.0),
                ))
            }
        };
        // SAFETY: ptr..ptr+size lies inside our reservation and nothing is mapped there, so
        // MAP_FIXED replaces only our own PROT_NONE placeholder.
        let p = unsafe {
            libc::mmap(
                ptr as *mut libc::c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os(format!("sim map at {ptr:#x}")));
        }
        self.mappings.insert(
            ptr,
            Mapping {
                size,
                handle: handle.0,
                accessible: false,
            },
        );
        if let Some(h) = self.handles.get_mut(&handle.0) {
            h.maps += 1;
        }
        Ok(())
    }

    pub(super) fn unmap(&mut self, ptr: DevPtr, size: u64) -> Result<()> {
        match self.mappings.get(&ptr) {
            Some(m) if m.size == size => {}
            _ => {
                return Err(invalid(
                    Prim::Unmap,
                    format!("ptr {ptr:#x}+{size} is not a mapping"),
                ))
            }
        }
        // SAFETY: ptr..ptr+size is our mapping; replacing it with a PROT_NONE placeholder keeps
        // the reservation and makes later touches fault, as on a GPU.
        let p = unsafe {
            libc::mmap(
                ptr as *mut libc::c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os(format!("sim unmap at {ptr:#x}")));
        }
        let m = self.mappings.remove(&ptr).expect("checked above");
        if let Some(h) = self.handles.get_mut(&m.handle) {
            h.maps -= 1;
        }
        self.drop_handle_if_done(m.handle);
        Ok(())
    }

    pub(super) fn set_access(&mut self, ptr: DevPtr, size: u64) -> Result<()> {
        match self.mappings.get(&ptr) {
            Some(m) if m.size == size => {}
            _ => {
                return Err(invalid(
                    Prim::SetAccess,
                    format!("ptr {ptr:#x}+{size} is not a mapping"),
                ))
            }
        }
        // SAFETY: the range is our mapping of a memfd opened read/write.
        if unsafe {
            libc::mprotect(
                ptr as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        } != 0
        {
            return Err(Error::last_os(format!(
                "sim set_access mprotect at {ptr:#x}"
            )));
        }
        if let Some(m) = self.mappings.get_mut(&ptr) {
            m.accessible = true;
        }
        Ok(())
    }

    /// True if `ptr` lies in a mapped, accessible range.
    pub(super) fn is_accessible(&self, ptr: DevPtr) -> bool {
        self.mappings
            .range(..=ptr)
            .next_back()
            .is_some_and(|(s, m)| ptr < s + m.size && m.accessible)
    }

    /// Whether `[ptr, ptr+len)` is accessible: one mapping, or several back to back (a copy may
    /// span the segments of one allocation, as it may on a GPU).
    pub(super) fn covered(&self, ptr: DevPtr, len: u64) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        let mut at = ptr;
        let Some((s, m)) = self.mappings.range(..=at).next_back() else {
            return false;
        };
        if !m.accessible || s + m.size <= at {
            return false;
        }
        at = s + m.size;
        while at < end {
            match self.mappings.get(&at) {
                Some(m) if m.accessible => at += m.size,
                _ => return false,
            }
        }
        true
    }

    fn drop_handle_if_done(&mut self, id: u64) {
        let done = self
            .handles
            .get(&id)
            .is_some_and(|h| h.released && h.maps == 0);
        if done {
            if let Some(h) = self.handles.remove(&id) {
                self.live[h.device as usize] -= h.size;
            }
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        for (_, h) in self.handles.drain() {
            if !h.released {
                // SAFETY: fd is ours and open.
                unsafe { libc::close(h.fd) };
            }
        }
        for (start, r) in std::mem::take(&mut self.reservations) {
            // SAFETY: the reservation is ours; the driver is going away, so nothing uses it.
            unsafe { libc::munmap(start as *mut libc::c_void, r.size as usize) };
        }
    }
}

impl SimDriver {
    /// Physical bytes live on `device` (created and not yet both released and unmapped).
    pub fn live_bytes(&self, device: i32) -> u64 {
        self.inner.lock().mem.live(device)
    }

    /// Number of physical handles alive.
    pub fn live_handles(&self) -> usize {
        self.inner.lock().mem.handles.len()
    }

    /// Number of address ranges reserved.
    pub fn live_reservations(&self) -> usize {
        self.inner.lock().mem.reservations.len()
    }

    /// Number of ranges mapped.
    pub fn live_mappings(&self) -> usize {
        self.inner.lock().mem.mappings.len()
    }

    /// True if `ptr` lies in a mapped, accessible range.
    pub fn is_accessible(&self, ptr: DevPtr) -> bool {
        self.inner.lock().mem.is_accessible(ptr)
    }
}
