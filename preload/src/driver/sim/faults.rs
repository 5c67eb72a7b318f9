//! Fault injection: the primitives by name, fault plans (`TMS_SIM_FAULTS`), the armed faults
//! and the call counts, and the CUDA-like errors a simulated primitive fails with.

use std::collections::HashMap;
use std::fmt;

use super::SimDriver;
use crate::driver::cuda_error_name;
use crate::error::{Error, Result};

/// The primitives that can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Prim {
    /// [`Driver::reserve`](crate::driver::Driver::reserve)
    Reserve,
    /// [`Driver::free_range`](crate::driver::Driver::free_range)
    FreeRange,
    /// [`Driver::create`](crate::driver::Driver::create)
    Create,
    /// [`Driver::release`](crate::driver::Driver::release)
    Release,
    /// [`Driver::map`](crate::driver::Driver::map)
    Map,
    /// [`Driver::unmap`](crate::driver::Driver::unmap)
    Unmap,
    /// [`Driver::set_access`](crate::driver::Driver::set_access)
    SetAccess,
    /// [`Driver::synchronize`](crate::driver::Driver::synchronize)
    Synchronize,
    /// [`Driver::stream_sync`](crate::driver::Driver::stream_sync)
    StreamSync,
    /// [`Driver::event_create`](crate::driver::Driver::event_create)
    EventCreate,
    /// [`Driver::event_record`](crate::driver::Driver::event_record)
    EventRecord,
    /// [`Driver::event_sync`](crate::driver::Driver::event_sync)
    EventSync,
    /// [`Driver::copy_d2h`](crate::driver::Driver::copy_d2h)
    CopyD2H,
    /// [`Driver::copy_h2d`](crate::driver::Driver::copy_h2d)
    CopyH2D,
    /// [`Driver::host_register`](crate::driver::Driver::host_register)
    HostRegister,
    /// [`Driver::host_unregister`](crate::driver::Driver::host_unregister)
    HostUnregister,
    /// [`Driver::mem_info`](crate::driver::Driver::mem_info)
    MemInfo,
    /// [`Driver::gate`](crate::driver::Driver::gate) (its first call makes the gate)
    Gate,
    /// [`Driver::stream_wait_gate`](crate::driver::Driver::stream_wait_gate)
    StreamWait,
    /// [`Driver::export`](crate::driver::Driver::export) and
    /// [`Driver::handle_props`](crate::driver::Driver::handle_props)
    Export,
    /// [`Driver::digest`](crate::driver::Driver::digest)
    Digest,
}

impl Prim {
    /// Every primitive, for exhaustive fault-injection tests.
    pub const ALL: [Prim; 21] = [
        Prim::Reserve,
        Prim::FreeRange,
        Prim::Create,
        Prim::Release,
        Prim::Map,
        Prim::Unmap,
        Prim::SetAccess,
        Prim::Synchronize,
        Prim::StreamSync,
        Prim::EventCreate,
        Prim::EventRecord,
        Prim::EventSync,
        Prim::CopyD2H,
        Prim::CopyH2D,
        Prim::HostRegister,
        Prim::HostUnregister,
        Prim::MemInfo,
        Prim::Gate,
        Prim::StreamWait,
        Prim::Export,
        Prim::Digest,
    ];

    /// The name used in `TMS_SIM_FAULTS`.
    pub fn name(self) -> &'static str {
        match self {
            Prim::Reserve => "reserve",
            Prim::FreeRange => "free_range",
            Prim::Create => "create",
            Prim::Release => "release",
            Prim::Map => "map",
            Prim::Unmap => "unmap",
            Prim::SetAccess => "set_access",
            Prim::Synchronize => "synchronize",
            Prim::StreamSync => "stream_sync",
            Prim::EventCreate => "event_create",
            Prim::EventRecord => "event_record",
            Prim::EventSync => "event_sync",
            Prim::CopyD2H => "copy_d2h",
            Prim::CopyH2D => "copy_h2d",
            Prim::HostRegister => "host_register",
            Prim::HostUnregister => "host_unregister",
            Prim::MemInfo => "mem_info",
            Prim::Gate => "gate",
            Prim::StreamWait => "stream_wait",
            Prim::Export => "export",
            Prim::Digest => "digest",
        }
    }

    /// The CUDA call this primitive stands for (used in error messages).
    pub fn call(self) -> &'static str {
        match self {
            Prim::Reserve => "cuMemAddressReserve",
            Prim::FreeRange => "cuMemAddressFree",
            Prim::Create => "cuMemCreate",
            Prim::Release => "cuMemRelease",
            Prim::Map => "cuMemMap",
            Prim::Unmap => "cuMemUnmap",
            Prim::SetAccess => "cuMemSetAccess",
            Prim::Synchronize => "cuCtxSynchronize",
            Prim::StreamSync => "cuStreamSynchronize",
            Prim::EventCreate => "cuEventCreate",
            Prim::EventRecord => "cuEventRecord",
            Prim::EventSync => "cuEventSynchronize",
            Prim::CopyD2H => "cuMemcpyDtoHAsync",
            Prim::CopyH2D => "cuMemcpyHtoDAsync",
            Prim::HostRegister => "cuMemHostRegister",
            Prim::HostUnregister => "cuMemHostUnregister",
            Prim::MemInfo => "cuMemGetInfo",
            Prim::Gate => "cuMemHostAlloc",
            Prim::StreamWait => "cuStreamWaitValue32",
            Prim::Export => "cuMemExportToShareableHandle",
            Prim::Digest => "cuLaunchKernel",
        }
    }

    fn from_name(s: &str) -> Option<Prim> {
        Prim::ALL.into_iter().find(|p| p.name() == s)
    }
}

impl fmt::Display for Prim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Faults to inject: (primitive, nth call from now, status code or [`PANIC`]).
pub type FaultPlan = Vec<(Prim, u64, i32)>;

/// The fault code that makes the call panic instead of failing (a bug inside the call, to test
/// that no panic hangs or takes down the host).
pub const PANIC: i32 = i32::MIN;

/// Parse a fault plan: `prim:nth[:code]` items separated by commas, e.g. `map:2:oom,create:1`.
/// `code` is a CUDA status number, `oom`, or `panic` ([`PANIC`]) (default `999`,
/// CUDA_ERROR_UNKNOWN).
pub fn parse_faults(s: &str) -> Result<FaultPlan> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = |why: &str| {
            Error::invalid_argument(format!(
                "fault {item:?}: {why} (format prim:nth[:code], prims: {})",
                Prim::ALL.map(Prim::name).join(", ")
            ))
        };
        let mut parts = item.split(':');
        let prim = parts
            .next()
            .and_then(Prim::from_name)
            .ok_or_else(|| bad("unknown primitive"))?;
        let nth = parts
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .filter(|n| *n >= 1)
            .ok_or_else(|| bad("nth must be a whole number from 1"))?;
        let code = match parts.next() {
            None => 999,
            Some("oom") => 2,
            Some("panic") => PANIC,
            Some(c) => c
                .parse::<i32>()
                .ok()
                .filter(|c| *c != 0)
                .ok_or_else(|| bad("bad code"))?,
        };
        if parts.next().is_some() {
            return Err(bad("too many fields"));
        }
        out.push((prim, nth, code));
    }
    Ok(out)
}

/// The error a primitive returns with CUDA status `code` (`2` is out of memory).
pub(super) fn driver_err(prim: Prim, code: i32, context: String) -> Error {
    if code == 2 {
        Error::out_of_memory(format!(
            "{} returned CUDA_ERROR_OUT_OF_MEMORY: {context}",
            prim.call()
        ))
    } else {
        Error::driver(prim.call(), code, cuda_error_name(code), context)
    }
}

/// CUDA_ERROR_INVALID_VALUE: a call the real driver would refuse.
pub(super) fn invalid(prim: Prim, context: String) -> Error {
    driver_err(prim, 1, context)
}

struct Fault {
    prim: Prim,
    remaining: u64,
    code: i32,
}

/// The armed faults and how often each primitive was called (part of the driver's state).
#[derive(Default)]
pub(super) struct Faults {
    armed: Vec<Fault>,
    calls: HashMap<Prim, u64>,
}

impl Faults {
    /// Count a call of `prim`, and fail it if an armed fault says this is its call.
    pub(super) fn enter(&mut self, prim: Prim, context: impl FnOnce() -> String) -> Result<()> {
        *self.calls.entry(prim).or_default() += 1;
        let mut fired = None;
        for (i, f) in self.armed.iter_mut().enumerate() {
            if f.prim == prim {
                f.remaining -= 1;
                if f.remaining == 0 {
                    fired = Some(i);
                    break;
                }
            }
        }
        if let Some(i) = fired {
            let f = self.armed.remove(i);
            if f.code == PANIC {
                panic!("{} {} (injected panic)", prim.name(), context());
            }
            return Err(driver_err(
                prim,
                f.code,
                format!("{} (injected fault)", context()),
            ));
        }
        Ok(())
    }
}

impl SimDriver {
    /// Make the `nth` call (1 = the next) of `prim` from now on fail with CUDA status `code`.
    pub fn arm_fault(&self, prim: Prim, nth: u64, code: i32) {
        self.inner.lock().faults.armed.push(Fault {
            prim,
            remaining: nth.max(1),
            code,
        });
    }

    /// Disarm every fault not yet fired.
    pub fn clear_faults(&self) {
        self.inner.lock().faults.armed.clear();
    }

    /// Faults armed and not yet fired.
    pub fn pending_faults(&self) -> usize {
        self.inner.lock().faults.armed.len()
    }

    /// How many times `prim` has been called.
    pub fn calls(&self, prim: Prim) -> u64 {
        self.inner
            .lock()
            .faults
            .calls
            .get(&prim)
            .copied()
            .unwrap_or(0)
    }
}
