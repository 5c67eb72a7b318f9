//! Host memory as the simulated device sees it: page-locked (registered) ranges, the contexts
//! that registered them, and the host memory the sim may pretend is all there is.

use std::collections::BTreeMap;

use super::faults::{driver_err, invalid, Prim};
use super::SimDriver;
use crate::error::Result;
use crate::os::page_size;

/// Part of the driver's state.
#[derive(Default)]
pub(super) struct Host {
    /// Registered host ranges: start -> length.
    registered: BTreeMap<usize, u64>,
    /// Bytes in `registered`.
    pinned: u64,
    /// Registrations and unregistrations made in each device's context.
    calls_by_device: BTreeMap<i32, u64>,
    /// Host memory the sim pretends is available (see [`SimDriver::set_host_memory`]).
    pub(super) available: Option<u64>,
}

impl Host {
    /// Register `[ptr, ptr+len)` in `device`'s context (the call is counted even if refused).
    pub(super) fn register(&mut self, device: i32, ptr: *mut u8, len: u64) -> Result<()> {
        *self.calls_by_device.entry(device).or_default() += 1;
        let (start, page) = (ptr as usize, page_size());
        if len == 0 || !(start as u64).is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(invalid(
                Prim::HostRegister,
                format!("{len} bytes at {ptr:p}: not whole pages"),
            ));
        }
        let end = start as u64 + len;
        let overlaps = self
            .registered
            .range(..end as usize)
            .next_back()
            .is_some_and(|(s, l)| *s as u64 + l > start as u64);
        if overlaps {
            return Err(driver_err(
                Prim::HostRegister,
                712,
                format!("{len} bytes at {ptr:p} overlap a registered range"),
            ));
        }
        self.registered.insert(start, len);
        self.pinned += len;
        Ok(())
    }

    /// Unregister the range starting at `ptr`, in `device`'s context.
    pub(super) fn unregister(&mut self, device: i32, ptr: *mut u8) -> Result<()> {
        *self.calls_by_device.entry(device).or_default() += 1;
        match self.registered.remove(&(ptr as usize)) {
            Some(len) => {
                self.pinned -= len;
                Ok(())
            }
            None => Err(driver_err(
                Prim::HostUnregister,
                713,
                format!("{ptr:p} does not start a registered range"),
            )),
        }
    }

    /// Whether `[host, host+len)` lies in one registered range.
    pub(super) fn is_registered(&self, host: usize, len: u64) -> bool {
        self.registered
            .range(..=host)
            .next_back()
            .is_some_and(|(s, l)| host as u64 + len <= *s as u64 + l)
    }
}

impl SimDriver {
    /// Pretend the host has only `bytes` of memory available (`None`: the real figure). The
    /// engine's host-memory check and this device's own memory (host memory too) see it.
    pub fn set_host_memory(&self, bytes: Option<u64>) {
        self.inner.lock().host.available = bytes;
    }

    /// Host bytes registered (page-locked).
    pub fn pinned_bytes(&self) -> u64 {
        self.inner.lock().host.pinned
    }

    /// Host registrations and unregistrations made in each device's context (a GPU would have
    /// a context, and its memory, on each device listed).
    pub fn host_calls_by_device(&self) -> BTreeMap<i32, u64> {
        self.inner.lock().host.calls_by_device.clone()
    }

    /// Host ranges registered.
    pub fn registered_ranges(&self) -> usize {
        self.inner.lock().host.registered.len()
    }

    /// The registered host ranges, as (address, length).
    pub fn host_registrations(&self) -> Vec<(usize, u64)> {
        self.inner
            .lock()
            .host
            .registered
            .iter()
            .map(|(s, l)| (*s, *l))
            .collect()
    }
}
