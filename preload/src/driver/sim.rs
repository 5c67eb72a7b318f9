//! The simulated device: host memory standing in for GPU memory, with the same primitives and
//! failure modes as the CUDA driver's virtual-memory API.
//!
//! - reserve: `mmap(PROT_NONE)` of address space;
//! - create: a `memfd` of the size (sparse until touched); counts against the device capacity;
//! - map: `mmap(MAP_FIXED | MAP_SHARED)` of the memfd over the reservation, still `PROT_NONE`;
//! - set access: `mprotect(READ | WRITE)`;
//! - unmap: put a `PROT_NONE` anonymous reservation back, so touching the range faults;
//! - release: close the memfd; its pages return to the system once no mapping holds them.
//!
//! Copies are `memcpy` after checking the device range is mapped and accessible, so an engine bug
//! shows as a driver error, not as a stray write. A fault injector fails the Nth call of a named
//! primitive with a chosen status (`2` = out of memory).

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;

use parking_lot::{Condvar, Mutex};

use super::{cuda_error_name, DevPtr, DeviceToken, Driver, Event, MemInfo, PhysHandle, Stream};
use crate::error::{Error, Result};
use crate::os::page_size;
use crate::units::{env_parsed, parse_bytes};

/// The primitives that can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Prim {
    /// [`Driver::reserve`]
    Reserve,
    /// [`Driver::free_range`]
    FreeRange,
    /// [`Driver::create`]
    Create,
    /// [`Driver::release`]
    Release,
    /// [`Driver::map`]
    Map,
    /// [`Driver::unmap`]
    Unmap,
    /// [`Driver::set_access`]
    SetAccess,
    /// [`Driver::synchronize`]
    Synchronize,
    /// [`Driver::stream_sync`]
    StreamSync,
    /// [`Driver::event_create`]
    EventCreate,
    /// [`Driver::event_record`]
    EventRecord,
    /// [`Driver::event_sync`]
    EventSync,
    /// [`Driver::copy_d2h`]
    CopyD2H,
    /// [`Driver::copy_h2d`]
    CopyH2D,
    /// [`Driver::host_register`]
    HostRegister,
    /// [`Driver::host_unregister`]
    HostUnregister,
    /// [`Driver::mem_info`]
    MemInfo,
}

impl Prim {
    /// Every primitive, for exhaustive fault-injection tests.
    pub const ALL: [Prim; 17] = [
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

/// Shape of the simulated machine.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of devices.
    pub devices: i32,
    /// Capacity of each device in bytes.
    pub capacity: u64,
    /// Allocation granularity in bytes (a multiple of the page size).
    pub granularity: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity: 8 << 30,
            granularity: 2 << 20,
        }
    }
}

impl SimConfig {
    /// Read `TMS_SIM_DEVICES`, `TMS_SIM_CAPACITY` and `TMS_SIM_GRANULARITY`.
    pub fn from_env() -> Result<Self> {
        let mut c = SimConfig::default();
        if let Some(n) = env_parsed("TMS_SIM_DEVICES", |s| {
            s.trim()
                .parse::<i32>()
                .ok()
                .filter(|n| (1..=64).contains(n))
                .ok_or_else(|| {
                    Error::invalid_argument(format!("{s:?} is not a device count from 1 to 64"))
                })
        })? {
            c.devices = n;
        }
        if let Some(b) = env_parsed("TMS_SIM_CAPACITY", parse_bytes)? {
            c.capacity = b;
        }
        if let Some(g) = env_parsed("TMS_SIM_GRANULARITY", parse_bytes)? {
            c.granularity = g;
        }
        // Only the granularity is checked, and its default passes: a failure is the variable's.
        c.validate()
            .map_err(|e| e.context("environment variable TMS_SIM_GRANULARITY"))?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        let page = page_size();
        if self.granularity == 0
            || self.granularity % page != 0
            || !self.granularity.is_power_of_two()
        {
            return Err(Error::invalid_argument(format!(
                "sim granularity {} must be a power of two and a multiple of the page size {page}",
                self.granularity
            )));
        }
        Ok(())
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

struct Handle {
    fd: libc::c_int,
    size: u64,
    device: i32,
    released: bool,
    maps: u32,
}

struct Reservation {
    size: u64,
}

struct Mapping {
    size: u64,
    handle: u64,
    accessible: bool,
}

struct Fault {
    prim: Prim,
    remaining: u64,
    code: i32,
}

/// A copy queued on a stream: it runs when the stream (or its device) is synchronized, as a GPU
/// runs queued work later, so an engine that reuses a buffer before waiting sees wrong data.
struct Queued {
    to_host: bool,
    host: usize,
    dev: DevPtr,
    len: u64,
}

/// What a stream's queue holds: copies, and the marks events put between them.
enum Entry {
    Copy(Queued),
    Mark(u64),
}

#[derive(Default)]
struct Inner {
    live: Vec<u64>,
    handles: HashMap<u64, Handle>,
    reservations: BTreeMap<u64, Reservation>,
    mappings: BTreeMap<u64, Mapping>,
    next_handle: u64,
    faults: Vec<Fault>,
    calls: HashMap<Prim, u64>,
    pinned_live: u64,
    queued: HashMap<u64, VecDeque<Entry>>,
    /// Live events: id -> the stream of their last record.
    events: HashMap<u64, Option<u64>>,
    /// Events whose mark was dropped (with work queued ahead of it) when a queued copy hit an
    /// unmapped range: a wait for one fails (as on a GPU, where that error is sticky) until it
    /// is recorded again, so nobody takes work that never ran for done.
    lost: HashSet<u64>,
    next_event: u64,
    /// Registered host ranges: start -> length.
    registered: BTreeMap<usize, u64>,
    /// Registrations and unregistrations made in each device's context.
    host_calls_by_device: BTreeMap<i32, u64>,
    /// Host memory the sim pretends is available (see [`SimDriver::set_host_memory`]).
    host_memory: Option<u64>,
    pageable_copies: u64,
}

/// The `TMS_SIM_*` environment variables, read.
#[derive(Clone, Debug)]
pub struct SimEnv {
    /// The machine's shape.
    pub config: SimConfig,
    /// Faults to arm (`TMS_SIM_FAULTS`).
    pub faults: FaultPlan,
    /// Host memory to pretend is available (`TMS_SIM_HOST_MEMORY`).
    pub host_memory: Option<u64>,
    /// Delay of every device synchronization (`TMS_SIM_SYNC_DELAY_MS`).
    pub sync_delay: Option<std::time::Duration>,
    /// Bytes per second of the host-device link (`TMS_SIM_BANDWIDTH`).
    pub bandwidth: Option<u64>,
}

#[derive(Default)]
struct Holds {
    held: HashSet<(Prim, Option<i32>)>,
    waiting: usize,
}

/// The simulated driver.
pub struct SimDriver {
    cfg: SimConfig,
    inner: Mutex<Inner>,
    /// Primitives whose calls wait (see [`SimDriver::hold`]); apart from `inner`, so that a held
    /// call blocks no other.
    holds: Mutex<Holds>,
    holds_changed: Condvar,
    /// Added to every device synchronization: a device that takes its time (a long pause seen
    /// from another process, such as tmsctl's).
    sync_delay: Mutex<Option<std::time::Duration>>,
    /// The link's bytes per second (`None`: as fast as the host copies), and when it is free
    /// again: copies share it, so several workers do not add up to more (see
    /// [`SimDriver::set_bandwidth`]).
    link: Mutex<(Option<u64>, std::time::Instant)>,
}

thread_local! {
    static CURRENT: Cell<i32> = const { Cell::new(0) };
}

fn driver_err(prim: Prim, code: i32, context: String) -> Error {
    if code == 2 {
        Error::out_of_memory(format!(
            "{} returned CUDA_ERROR_OUT_OF_MEMORY: {context}",
            prim.call()
        ))
    } else {
        Error::driver(prim.call(), code, cuda_error_name(code), context)
    }
}

fn invalid(prim: Prim, context: String) -> Error {
    driver_err(prim, 1, context)
}

impl SimDriver {
    /// A simulated machine of the given shape.
    pub fn new(cfg: SimConfig) -> Result<Self> {
        cfg.validate()?;
        let inner = Inner {
            live: vec![0; cfg.devices as usize],
            next_handle: 1,
            ..Default::default()
        };
        Ok(SimDriver {
            cfg,
            inner: Mutex::new(inner),
            holds: Mutex::default(),
            holds_changed: Condvar::new(),
            sync_delay: Mutex::new(None),
            link: Mutex::new((None, std::time::Instant::now())),
        })
    }

    /// From `TMS_SIM_*` environment variables, faults from `TMS_SIM_FAULTS` armed.
    pub fn from_env() -> Result<Self> {
        let env = Self::settings_from_env()?;
        let d = SimDriver::new(env.config)?;
        for (p, n, c) in env.faults {
            d.arm_fault(p, n, c);
        }
        d.set_host_memory(env.host_memory);
        d.set_sync_delay(env.sync_delay);
        d.set_bandwidth(env.bandwidth);
        Ok(d)
    }

    /// The `TMS_SIM_*` settings, each malformed value an error naming its variable.
    pub fn settings_from_env() -> Result<SimEnv> {
        Ok(SimEnv {
            config: SimConfig::from_env()?,
            faults: env_parsed("TMS_SIM_FAULTS", parse_faults)?.unwrap_or_default(),
            host_memory: env_parsed("TMS_SIM_HOST_MEMORY", parse_bytes)?,
            sync_delay: env_parsed("TMS_SIM_SYNC_DELAY_MS", |v| {
                v.trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|ms| *ms <= 3_600_000)
                    .map(std::time::Duration::from_millis)
                    .ok_or_else(|| {
                        Error::invalid_argument(format!(
                            "{v:?} is not a number of milliseconds from 0 to 3600000"
                        ))
                    })
            })?,
            bandwidth: env_parsed("TMS_SIM_BANDWIDTH", |v| match parse_bytes(v)? {
                0 => Err(Error::invalid_argument(format!(
                    "{v:?}: the link's bytes per second must be above 0"
                ))),
                b => Ok(b),
            })?,
        })
    }

    /// Pretend the host has only `bytes` of memory available (`None`: the real figure). The
    /// engine's host-memory check and this device's own memory (host memory too) see it.
    pub fn set_host_memory(&self, bytes: Option<u64>) {
        self.inner.lock().host_memory = bytes;
    }

    /// Make every call of `prim` (on `device`, or on any device if `None`) wait, before it
    /// does anything, until [`SimDriver::unhold`] of it: a device stalled at a chosen point (say,
    /// on work that waits for a host thread).
    pub fn hold(&self, prim: Prim, device: Option<i32>) {
        self.holds.lock().held.insert((prim, device));
    }

    /// Let the calls held by [`SimDriver::hold`] of the same arguments go on.
    pub fn unhold(&self, prim: Prim, device: Option<i32>) {
        self.holds.lock().held.remove(&(prim, device));
        self.holds_changed.notify_all();
    }

    /// Calls waiting in [`SimDriver::hold`] now.
    pub fn held_calls(&self) -> usize {
        self.holds.lock().waiting
    }

    /// Make every device synchronization take at least `delay` longer (`None`: no delay).
    pub fn set_sync_delay(&self, delay: Option<std::time::Duration>) {
        *self.sync_delay.lock() = delay;
    }

    /// Make copies between host and device take time, as over a link of `bytes_per_s` (`None`:
    /// as fast as the host copies): a pause or resume long enough to be watched. Copies share
    /// the link, each one queued after those already on it; the time is spent when the copy is
    /// issued, outside every lock of the driver, so other calls go on meanwhile.
    pub fn set_bandwidth(&self, bytes_per_s: Option<u64>) {
        *self.link.lock() = (bytes_per_s.filter(|b| *b > 0), std::time::Instant::now());
    }

    /// Wait for `len` bytes' turn on the link, if it has a bandwidth.
    fn use_link(&self, len: u64) {
        let until = {
            let mut link = self.link.lock();
            let Some(bw) = link.0 else {
                return;
            };
            let start = link.1.max(std::time::Instant::now());
            let until = start + std::time::Duration::from_secs_f64(len as f64 / bw as f64);
            link.1 = until;
            until
        };
        std::thread::sleep(until.saturating_duration_since(std::time::Instant::now()));
    }

    fn wait_if_held(&self, prim: Prim, device: Option<i32>) {
        let mut h = self.holds.lock();
        let held = |h: &Holds| {
            h.held.contains(&(prim, None))
                || device.is_some_and(|d| h.held.contains(&(prim, Some(d))))
        };
        if !held(&h) {
            return;
        }
        h.waiting += 1;
        while held(&h) {
            self.holds_changed.wait(&mut h);
        }
        h.waiting -= 1;
    }

    /// The machine's shape.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// Make the `nth` call (1 = the next) of `prim` from now on fail with CUDA status `code`.
    pub fn arm_fault(&self, prim: Prim, nth: u64, code: i32) {
        self.inner.lock().faults.push(Fault {
            prim,
            remaining: nth.max(1),
            code,
        });
    }

    /// Disarm every fault not yet fired.
    pub fn clear_faults(&self) {
        self.inner.lock().faults.clear();
    }

    /// Faults armed and not yet fired.
    pub fn pending_faults(&self) -> usize {
        self.inner.lock().faults.len()
    }

    /// How many times `prim` has been called.
    pub fn calls(&self, prim: Prim) -> u64 {
        self.inner.lock().calls.get(&prim).copied().unwrap_or(0)
    }

    /// Physical bytes live on `device` (created and not yet both released and unmapped).
    pub fn live_bytes(&self, device: i32) -> u64 {
        self.inner
            .lock()
            .live
            .get(device as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Number of physical handles alive.
    pub fn live_handles(&self) -> usize {
        self.inner.lock().handles.len()
    }

    /// Number of address ranges reserved.
    pub fn live_reservations(&self) -> usize {
        self.inner.lock().reservations.len()
    }

    /// Number of ranges mapped.
    pub fn live_mappings(&self) -> usize {
        self.inner.lock().mappings.len()
    }

    /// Host bytes registered (page-locked).
    pub fn pinned_bytes(&self) -> u64 {
        self.inner.lock().pinned_live
    }

    /// Host registrations and unregistrations made in each device's context (a GPU would have
    /// a context, and its memory, on each device listed).
    pub fn host_calls_by_device(&self) -> BTreeMap<i32, u64> {
        self.inner.lock().host_calls_by_device.clone()
    }

    /// Host ranges registered.
    pub fn registered_ranges(&self) -> usize {
        self.inner.lock().registered.len()
    }

    /// The registered host ranges, as (address, length).
    pub fn host_registrations(&self) -> Vec<(usize, u64)> {
        self.inner
            .lock()
            .registered
            .iter()
            .map(|(s, l)| (*s, *l))
            .collect()
    }

    /// Copies queued whose host side was not registered memory (on a GPU such a copy goes
    /// through the driver's slow pageable path).
    pub fn pageable_copies(&self) -> u64 {
        self.inner.lock().pageable_copies
    }

    /// Copies queued and not yet run by a synchronization.
    pub fn queued_copies(&self) -> usize {
        self.inner
            .lock()
            .queued
            .values()
            .flat_map(|q| q.iter())
            .filter(|e| matches!(e, Entry::Copy(_)))
            .count()
    }

    /// True if `ptr` lies in a mapped, accessible range.
    pub fn is_accessible(&self, ptr: DevPtr) -> bool {
        let g = self.inner.lock();
        g.mappings
            .range(..=ptr)
            .next_back()
            .is_some_and(|(s, m)| ptr < s + m.size && m.accessible)
    }

    fn enter(&self, g: &mut Inner, prim: Prim, context: impl FnOnce() -> String) -> Result<()> {
        *g.calls.entry(prim).or_default() += 1;
        let mut fired = None;
        for (i, f) in g.faults.iter_mut().enumerate() {
            if f.prim == prim {
                f.remaining -= 1;
                if f.remaining == 0 {
                    fired = Some(i);
                    break;
                }
            }
        }
        if let Some(i) = fired {
            let f = g.faults.remove(i);
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

    fn check_device(&self, prim: Prim, device: i32) -> Result<()> {
        if device < 0 || device >= self.cfg.devices {
            return Err(driver_err(
                prim,
                101,
                format!("device {device} (the sim has {})", self.cfg.devices),
            ));
        }
        Ok(())
    }

    fn check_multiple(&self, prim: Prim, what: &str, v: u64) -> Result<()> {
        if v == 0 || v % self.cfg.granularity != 0 {
            return Err(invalid(
                prim,
                format!(
                    "{what} {v} is not a positive multiple of the granularity {}",
                    self.cfg.granularity
                ),
            ));
        }
        Ok(())
    }

    /// The accessible mapping that holds `[ptr, ptr+len)`, if any.
    /// Whether `[ptr, ptr+len)` is accessible: one mapping, or several back to back (a copy may
    /// span the segments of one allocation, as it may on a GPU).
    fn covered(g: &Inner, ptr: DevPtr, len: u64) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        let mut at = ptr;
        let Some((s, m)) = g.mappings.range(..=at).next_back() else {
            return false;
        };
        if !m.accessible || s + m.size <= at {
            return false;
        }
        at = s + m.size;
        while at < end {
            match g.mappings.get(&at) {
                Some(m) if m.accessible => at += m.size,
                _ => return false,
            }
        }
        true
    }

    fn is_registered(g: &Inner, host: usize, len: u64) -> bool {
        g.registered
            .range(..=host)
            .next_back()
            .is_some_and(|(s, l)| host as u64 + len <= *s as u64 + l)
    }

    fn queue(&self, g: &mut Inner, stream: Stream, q: Queued) -> Result<()> {
        let prim = if q.to_host {
            Prim::CopyD2H
        } else {
            Prim::CopyH2D
        };
        let device = Self::stream_device(stream);
        self.check_device(prim, device)?;
        if !Self::covered(g, q.dev, q.len) {
            return Err(invalid(
                prim,
                format!(
                    "device range {:#x}+{} is not mapped and accessible",
                    q.dev, q.len
                ),
            ));
        }
        if !Self::is_registered(g, q.host, q.len) {
            g.pageable_copies += 1;
        }
        g.queued
            .entry(stream.0)
            .or_default()
            .push_back(Entry::Copy(q));
        Ok(())
    }

    /// A queued copy of `stream` failed: it and the entries after it in its batch (`rest`) never
    /// run, and every event marked among them or still marked on the stream is lost (the work
    /// queued before it did not all happen).
    fn drop_after_failure(g: &mut Inner, stream: u64, rest: impl IntoIterator<Item = Entry>) {
        let queued = g.queued.get(&stream).into_iter().flatten();
        let marks: Vec<u64> = rest
            .into_iter()
            .filter_map(|e| match e {
                Entry::Mark(ev) => Some(ev),
                Entry::Copy(_) => None,
            })
            .chain(queued.filter_map(|e| match e {
                Entry::Mark(ev) => Some(*ev),
                Entry::Copy(_) => None,
            }))
            .collect();
        g.lost.extend(marks);
    }

    /// Run the first `n` entries queued on `stream` (all: `usize::MAX`); a device range
    /// unmapped meanwhile is an illegal address, as on a GPU, and the rest of those is dropped.
    fn run_queue(g: &mut Inner, stream: u64, n: usize) -> Result<()> {
        let Some(q) = g.queued.get_mut(&stream) else {
            return Ok(());
        };
        let mut batch: VecDeque<Entry> = q.drain(..n.min(q.len())).collect();
        while let Some(e) = batch.pop_front() {
            let Entry::Copy(q) = e else { continue };
            if !Self::covered(g, q.dev, q.len) {
                Self::drop_after_failure(g, stream, batch);
                return Err(driver_err(
                    Prim::StreamSync,
                    700,
                    format!(
                        "a queued copy touches {:#x}+{}, which is no longer mapped",
                        q.dev, q.len
                    ),
                ));
            }
            let (src, dst) = if q.to_host {
                (q.dev as *const u8, q.host as *mut u8)
            } else {
                (q.host as *const u8, q.dev as *mut u8)
            };
            // SAFETY: the device range is an accessible mapping (checked just now); the engine
            // keeps the host range alive and untouched until this synchronization (the copy
            // contract of Driver::copy_d2h / copy_h2d).
            unsafe { std::ptr::copy_nonoverlapping(src, dst, q.len as usize) };
        }
        Ok(())
    }

    fn stream_device(stream: Stream) -> i32 {
        stream.0 as i32 - 1
    }

    /// How many entries of `stream`'s queue come up to and including the last mark of `event`
    /// (0 if it has none).
    fn upto_mark(g: &Inner, stream: u64, event: u64) -> usize {
        g.queued.get(&stream).map_or(0, |q| {
            q.iter()
                .rposition(|e| matches!(e, Entry::Mark(m) if *m == event))
                .map_or(0, |i| i + 1)
        })
    }

    fn drop_handle_if_done(g: &mut Inner, id: u64) {
        let done = g
            .handles
            .get(&id)
            .is_some_and(|h| h.released && h.maps == 0);
        if done {
            if let Some(h) = g.handles.remove(&id) {
                g.live[h.device as usize] -= h.size;
            }
        }
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        let g = self.inner.get_mut();
        for (_, h) in g.handles.drain() {
            if !h.released {
                // SAFETY: fd is ours and open.
                unsafe { libc::close(h.fd) };
            }
        }
        for (start, r) in std::mem::take(&mut g.reservations) {
            // SAFETY: the reservation is ours; the driver is going away, so nothing uses it.
            unsafe { libc::munmap(start as *mut libc::c_void, r.size as usize) };
        }
    }
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> Result<i32> {
        Ok(self.cfg.devices)
    }

    fn current_device(&self) -> Result<i32> {
        Ok(CURRENT.with(|c| c.get()))
    }

    fn push_device(&self, device: i32) -> Result<DeviceToken> {
        self.check_device(Prim::Synchronize, device)?;
        let prev = CURRENT.with(|c| c.replace(device));
        Ok(DeviceToken(prev as u64, 0))
    }

    fn pop_device(&self, token: DeviceToken) {
        CURRENT.with(|c| c.set(token.0 as i32));
    }

    fn granularity(&self, device: i32) -> Result<u64> {
        self.check_device(Prim::Create, device)?;
        Ok(self.cfg.granularity)
    }

    fn mem_info(&self, device: i32) -> Result<MemInfo> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::MemInfo, || format!("device {device}"))?;
        self.check_device(Prim::MemInfo, device)?;
        let live = g.live[device as usize];
        Ok(MemInfo {
            free: self.cfg.capacity.saturating_sub(live),
            total: self.cfg.capacity,
        })
    }

    fn reserve(&self, device: i32, size: u64) -> Result<DevPtr> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::Reserve, || {
            format!("device {device}, {size} bytes")
        })?;
        self.check_device(Prim::Reserve, device)?;
        self.check_multiple(Prim::Reserve, "size", size)?;
        // Reserve size + granularity and trim both ends, so the range is aligned to the
        // granularity as cuMemAddressReserve's is.
        let align = self.cfg.granularity;
        let span = size + align;
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
        g.reservations.insert(p as u64, Reservation { size });
        Ok(p as u64)
    }

    fn free_range(&self, ptr: DevPtr, size: u64) -> Result<()> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::FreeRange, || {
            format!("ptr {ptr:#x}, {size} bytes")
        })?;
        match g.reservations.get(&ptr) {
            Some(r) if r.size == size => {}
            _ => {
                return Err(invalid(
                    Prim::FreeRange,
                    format!("ptr {ptr:#x}, {size} bytes is not a reservation"),
                ))
            }
        }
        if g.mappings.range(ptr..ptr + size).next().is_some() {
            return Err(invalid(
                Prim::FreeRange,
                format!("ptr {ptr:#x} still has mappings"),
            ));
        }
        g.reservations.remove(&ptr);
        // SAFETY: the reservation is ours and nothing is mapped in it.
        if unsafe { libc::munmap(ptr as *mut libc::c_void, size as usize) } != 0 {
            return Err(Error::last_os(format!("sim free_range munmap at {ptr:#x}")));
        }
        Ok(())
    }

    fn create(&self, device: i32, size: u64) -> Result<PhysHandle> {
        self.wait_if_held(Prim::Create, Some(device));
        // The sim's device memory is host memory: more than the host has would be killed by the
        // kernel once written, so it is refused like device memory beyond the capacity.
        let live: u64 = self.inner.lock().live.iter().sum();
        if let Some(h) = self
            .host_memory()
            .filter(|h| live.saturating_add(size) > h.available)
        {
            return Err(driver_err(
                Prim::Create,
                2,
                format!(
                    "device {device}, {size} bytes: the simulated device keeps its memory in host \
                     RAM, which has {} bytes available ({}) for its {live} bytes and these",
                    h.available, h.bound
                ),
            ));
        }
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::Create, || {
            format!("device {device}, {size} bytes")
        })?;
        self.check_device(Prim::Create, device)?;
        self.check_multiple(Prim::Create, "size", size)?;
        let live = g.live[device as usize];
        if live.saturating_add(size) > self.cfg.capacity {
            return Err(driver_err(
                Prim::Create,
                2,
                format!(
                    "device {device}, {size} bytes asked, {} free of {}",
                    self.cfg.capacity - live,
                    self.cfg.capacity
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
        let id = g.next_handle;
        g.next_handle += 1;
        g.handles.insert(
            id,
            Handle {
                fd,
                size,
                device,
                released: false,
                maps: 0,
            },
        );
        g.live[device as usize] += size;
        Ok(PhysHandle(id))
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::Release, || format!("handle {}", handle.0))?;
        let h = match g.handles.get_mut(&handle.0) {
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
        Self::drop_handle_if_done(&mut g, handle.0);
        Ok(())
    }

    fn map(&self, ptr: DevPtr, size: u64, handle: PhysHandle) -> Result<()> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::Map, || {
            format!("ptr {ptr:#x}, {size} bytes, handle {}", handle.0)
        })?;
        self.check_multiple(Prim::Map, "size", size)?;
        if ptr % self.cfg.granularity != 0 {
            return Err(invalid(
                Prim::Map,
                format!("ptr {ptr:#x} is not aligned to the granularity"),
            ));
        }
        let inside = g
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
        let overlaps = g
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
        let fd = match g.handles.get(&handle.0) {
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
        g.mappings.insert(
            ptr,
            Mapping {
                size,
                handle: handle.0,
                accessible: false,
            },
        );
        if let Some(h) = g.handles.get_mut(&handle.0) {
            h.maps += 1;
        }
        Ok(())
    }

    fn unmap(&self, ptr: DevPtr, size: u64) -> Result<()> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::Unmap, || {
            format!("ptr {ptr:#x}, {size} bytes")
        })?;
        match g.mappings.get(&ptr) {
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
        let m = g.mappings.remove(&ptr).expect("checked above");
        if let Some(h) = g.handles.get_mut(&m.handle) {
            h.maps -= 1;
        }
        Self::drop_handle_if_done(&mut g, m.handle);
        Ok(())
    }

    fn set_access(&self, device: i32, ptr: DevPtr, size: u64) -> Result<()> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::SetAccess, || {
            format!("device {device}, ptr {ptr:#x}, {size} bytes")
        })?;
        self.check_device(Prim::SetAccess, device)?;
        match g.mappings.get(&ptr) {
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
        if let Some(m) = g.mappings.get_mut(&ptr) {
            m.accessible = true;
        }
        Ok(())
    }

    fn synchronize(&self, device: i32) -> Result<()> {
        self.wait_if_held(Prim::Synchronize, Some(device));
        let delay = *self.sync_delay.lock();
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::Synchronize, || format!("device {device}"))?;
        self.check_device(Prim::Synchronize, device)?;
        let mine: Vec<u64> = g
            .queued
            .keys()
            .copied()
            .filter(|s| Self::stream_device(Stream(*s)) == device)
            .collect();
        for s in mine {
            Self::run_queue(&mut g, s, usize::MAX)?;
        }
        Ok(())
    }

    fn stream(&self, device: i32) -> Result<Stream> {
        self.check_device(Prim::StreamSync, device)?;
        Ok(Stream(device as u64 + 1))
    }

    fn stream_sync(&self, stream: Stream) -> Result<()> {
        let mut g = self.inner.lock();
        // A failed wait leaves the queued work alone, as on a GPU, where the work runs on
        // whatever the host's wait did; it runs at a later synchronization.
        self.enter(&mut g, Prim::StreamSync, || format!("stream {}", stream.0))?;
        Self::run_queue(&mut g, stream.0, usize::MAX)
    }

    fn event_create(&self, device: i32) -> Result<Event> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::EventCreate, || format!("device {device}"))?;
        self.check_device(Prim::EventCreate, device)?;
        g.next_event += 1;
        let id = g.next_event;
        g.events.insert(id, None);
        Ok(Event(id))
    }

    fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::EventRecord, || {
            format!("event {} on stream {}", event.0, stream.0)
        })?;
        g.lost.remove(&event.0);
        match g.events.get_mut(&event.0) {
            Some(at) => *at = Some(stream.0),
            None => {
                return Err(driver_err(
                    Prim::EventRecord,
                    400,
                    format!("event {} is not live", event.0),
                ))
            }
        }
        g.queued
            .entry(stream.0)
            .or_default()
            .push_back(Entry::Mark(event.0));
        Ok(())
    }

    fn event_sync(&self, event: Event) -> Result<()> {
        self.wait_if_held(Prim::EventSync, None);
        let mut g = self.inner.lock();
        let stream = match g.events.get(&event.0) {
            Some(s) => *s,
            None => {
                return Err(driver_err(
                    Prim::EventSync,
                    400,
                    format!("event {} is not live", event.0),
                ))
            }
        };
        // A failed wait leaves the queued work alone (see stream_sync).
        self.enter(&mut g, Prim::EventSync, || format!("event {}", event.0))?;
        if g.lost.contains(&event.0) {
            return Err(driver_err(
                Prim::EventSync,
                999,
                format!(
                    "event {}: the work queued before it was lost to an earlier failure",
                    event.0
                ),
            ));
        }
        match stream {
            Some(s) => {
                let n = Self::upto_mark(&g, s, event.0);
                Self::run_queue(&mut g, s, n)
            }
            None => Ok(()),
        }
    }

    fn event_destroy(&self, event: Event) {
        let mut g = self.inner.lock();
        g.events.remove(&event.0);
        g.lost.remove(&event.0);
    }

    unsafe fn copy_d2h(&self, dst: *mut u8, src: DevPtr, len: u64, stream: Stream) -> Result<()> {
        self.use_link(len);
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::CopyD2H, || {
            format!("{len} bytes from {src:#x}")
        })?;
        let q = Queued {
            to_host: true,
            host: dst as usize,
            dev: src,
            len,
        };
        self.queue(&mut g, stream, q)
    }

    unsafe fn copy_h2d(&self, dst: DevPtr, src: *const u8, len: u64, stream: Stream) -> Result<()> {
        self.use_link(len);
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::CopyH2D, || format!("{len} bytes to {dst:#x}"))?;
        let q = Queued {
            to_host: false,
            host: src as usize,
            dev: dst,
            len,
        };
        self.queue(&mut g, stream, q)
    }

    fn host_memory(&self) -> Option<crate::os::HostMemory> {
        match self.inner.lock().host_memory {
            Some(available) => Some(crate::os::HostMemory {
                available,
                bound: "TMS_SIM_HOST_MEMORY of the simulated device".into(),
            }),
            None => crate::os::host_memory(),
        }
    }

    unsafe fn host_register(&self, device: i32, ptr: *mut u8, len: u64) -> Result<()> {
        self.check_device(Prim::HostRegister, device)?;
        self.wait_if_held(Prim::HostRegister, Some(device));
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::HostRegister, || {
            format!("{len} bytes of host memory at {ptr:p}")
        })?;
        *g.host_calls_by_device.entry(device).or_default() += 1;
        let (start, page) = (ptr as usize, page_size());
        if len == 0 || start as u64 % page != 0 || len % page != 0 {
            return Err(invalid(
                Prim::HostRegister,
                format!("{len} bytes at {ptr:p}: not whole pages"),
            ));
        }
        let end = start as u64 + len;
        let overlaps = g
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
        g.registered.insert(start, len);
        g.pinned_live += len;
        Ok(())
    }

    unsafe fn host_unregister(&self, device: i32, ptr: *mut u8) -> Result<()> {
        self.check_device(Prim::HostUnregister, device)?;
        let mut g = self.inner.lock();
        self.enter(&mut g, Prim::HostUnregister, || {
            format!("host memory at {ptr:p}")
        })?;
        *g.host_calls_by_device.entry(device).or_default() += 1;
        match g.registered.remove(&(ptr as usize)) {
            Some(len) => {
                g.pinned_live -= len;
                Ok(())
            }
            None => Err(driver_err(
                Prim::HostUnregister,
                713,
                format!("{ptr:p} does not start a registered range"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim() -> SimDriver {
        SimDriver::new(SimConfig {
            devices: 2,
            capacity: 16 << 20,
            granularity: 2 << 20,
        })
        .unwrap()
    }

    #[test]
    fn map_write_unmap_release_accounts() {
        let d = sim();
        let g = d.granularity(0).unwrap();
        let va = d.reserve(0, 2 * g).unwrap();
        let h = d.create(0, 2 * g).unwrap();
        assert_eq!(d.live_bytes(0), 2 * g);
        d.map(va, 2 * g, h).unwrap();
        assert!(!d.is_accessible(va));
        d.set_access(0, va, 2 * g).unwrap();
        assert!(d.is_accessible(va + g));
        let data = vec![7u8; 4096];
        let s = d.stream(0).unwrap();
        // SAFETY: va is mapped and accessible; data outlives the copy (synchronized below).
        unsafe { d.copy_h2d(va + 100, data.as_ptr(), 4096, s).unwrap() };
        d.stream_sync(s).unwrap();
        let mut back = vec![0u8; 4096];
        // SAFETY: as above.
        unsafe { d.copy_d2h(back.as_mut_ptr(), va + 100, 4096, s).unwrap() };
        assert_eq!(
            back,
            vec![0u8; 4096],
            "nothing lands before the stream is synchronized"
        );
        d.stream_sync(s).unwrap();
        assert_eq!(back, data);
        d.release(h).unwrap();
        assert_eq!(d.live_bytes(0), 2 * g, "still mapped: pages held");
        d.unmap(va, 2 * g).unwrap();
        assert_eq!(d.live_bytes(0), 0);
        assert!(!d.is_accessible(va));
        d.free_range(va, 2 * g).unwrap();
        assert_eq!(
            (d.live_handles(), d.live_mappings(), d.live_reservations()),
            (0, 0, 0)
        );
    }

    #[test]
    fn capacity_gives_oom() {
        let d = sim();
        let h = d.create(1, 16 << 20).unwrap();
        let e = d.create(1, 2 << 20).unwrap_err();
        assert!(e.is_oom(), "{e}");
        assert!(d.create(0, 2 << 20).is_ok(), "devices are independent");
        d.release(h).unwrap();
        assert!(d.create(1, 2 << 20).is_ok());
    }

    #[test]
    fn misuse_is_a_driver_error() {
        let d = sim();
        assert!(
            d.create(0, 4096).is_err(),
            "not a multiple of the granularity"
        );
        assert!(d.create(5, 2 << 20).is_err(), "no such device");
        let va = d.reserve(0, 2 << 20).unwrap();
        let mut b = [0u8; 8];
        // SAFETY: the sim checks the range and refuses; nothing is touched.
        let e = unsafe { d.copy_d2h(b.as_mut_ptr(), va, 8, d.stream(0).unwrap()) }.unwrap_err();
        assert!(e.to_string().contains("not mapped"), "{e}");
        assert!(d.unmap(va, 2 << 20).is_err());
        assert!(d.release(PhysHandle(77)).is_err());
    }

    #[test]
    fn faults_fire_on_the_nth_call_once() {
        let d = sim();
        d.arm_fault(Prim::Create, 2, 2);
        let a = d.create(0, 2 << 20).unwrap();
        let e = d.create(0, 2 << 20).unwrap_err();
        assert!(e.is_oom() && e.to_string().contains("injected"), "{e}");
        let b = d.create(0, 2 << 20).unwrap();
        assert_eq!(d.pending_faults(), 0);
        d.release(a).unwrap();
        d.release(b).unwrap();
    }

    #[test]
    fn fault_plan_parses_and_rejects() {
        let f = parse_faults("map:2:oom, create:1 ,copy_d2h:3:700").unwrap();
        assert_eq!(
            f,
            vec![
                (Prim::Map, 2, 2),
                (Prim::Create, 1, 999),
                (Prim::CopyD2H, 3, 700)
            ]
        );
        assert!(parse_faults("mop:1")
            .unwrap_err()
            .to_string()
            .contains("unknown primitive"));
        assert!(parse_faults("map:0").is_err());
        assert!(parse_faults("map:1:x").is_err());
        assert!(parse_faults("map:1:2:3").is_err());
    }

    /// A mapped, accessible range of `2 * g` bytes on device 0 and its handle.
    fn mapped(d: &SimDriver) -> (DevPtr, PhysHandle, u64) {
        let size = 2 * d.granularity(0).unwrap();
        let va = d.reserve(0, size).unwrap();
        let h = d.create(0, size).unwrap();
        d.map(va, size, h).unwrap();
        d.set_access(0, va, size).unwrap();
        (va, h, size)
    }

    #[test]
    fn queued_copies_run_at_sync_and_fail_on_unmapped_ranges() {
        let d = sim();
        let (va, h, size) = mapped(&d);
        let mut back = vec![1u8; 64];
        let s = d.stream(0).unwrap();
        assert_ne!(s, d.stream(1).unwrap(), "one stream per device");
        // SAFETY: mapped range; back outlives the copies (synchronized or dropped below).
        unsafe { d.copy_d2h(back.as_mut_ptr(), va, 64, s).unwrap() };
        assert_eq!(d.queued_copies(), 1);
        d.synchronize(0).unwrap();
        assert_eq!(
            (d.queued_copies(), back[0]),
            (0, 0),
            "device sync runs the stream"
        );
        // SAFETY: as above.
        unsafe { d.copy_d2h(back.as_mut_ptr(), va, 64, s).unwrap() };
        d.unmap(va, size).unwrap();
        let e = d.stream_sync(s).unwrap_err();
        assert!(e.to_string().contains("no longer mapped"), "{e}");
        d.release(h).unwrap();
        d.free_range(va, size).unwrap();
    }

    #[test]
    fn an_event_waits_for_what_was_queued_before_it_only() {
        let d = sim();
        let (va, _, _) = mapped(&d);
        let (a, b) = ([1u8; 16], [2u8; 16]);
        let s = d.stream(0).unwrap();
        let (e1, e2) = (d.event_create(0).unwrap(), d.event_create(0).unwrap());
        // Never recorded: nothing to wait for.
        d.event_sync(e1).unwrap();
        // SAFETY: mapped() made va..va+32 mapped and accessible; a and b live until the end of
        // the test, after the event waits below have run both copies.
        unsafe {
            d.copy_h2d(va, a.as_ptr(), 16, s).unwrap();
            d.event_record(e1, s).unwrap();
            d.copy_h2d(va + 16, b.as_ptr(), 16, s).unwrap();
            d.event_record(e2, s).unwrap();
        }
        d.event_sync(e1).unwrap();
        assert_eq!(d.queued_copies(), 1, "the copy after the first mark waits");
        // SAFETY: the simulated device's addresses are host mappings, and mapped() made this
        // range readable and writable; no copy is running while the test thread reads.
        assert_eq!(unsafe { *(va as *const u8) }, 1);
        d.arm_fault(Prim::EventSync, 1, 999);
        assert!(d.event_sync(e2).is_err());
        assert_eq!(d.queued_copies(), 1, "a failed wait leaves the work queued");
        // SAFETY: as above.
        assert_eq!(unsafe { *((va + 16) as *const u8) }, 0, "not run yet");
        d.event_sync(e2).unwrap();
        assert_eq!(
            // SAFETY: as above.
            unsafe { *((va + 16) as *const u8) },
            2,
            "run by the next wait"
        );
        d.event_destroy(e1);
        d.event_destroy(e2);
        assert!(d.event_sync(e1).is_err(), "destroyed");
    }

    #[test]
    fn a_failed_stream_sync_leaves_the_work_for_the_next() {
        let d = sim();
        let (va, _, _) = mapped(&d);
        let data = [9u8; 32];
        let s = d.stream(0).unwrap();
        // SAFETY: mapped range; data outlives the copy.
        unsafe { d.copy_h2d(va, data.as_ptr(), 32, s).unwrap() };
        d.arm_fault(Prim::StreamSync, 1, 999);
        assert!(d.stream_sync(s).is_err());
        assert_eq!(d.queued_copies(), 1);
        d.stream_sync(s).unwrap();
        // SAFETY: the range is mapped read/write.
        let first = unsafe { *(va as *const u8) };
        assert_eq!(first, 9, "the copy ran at the next synchronization");
    }

    #[test]
    fn work_dropped_by_an_illegal_address_fails_every_wait_that_covers_it() {
        let d = sim();
        let (va, h, size) = mapped(&d);
        let mut back = [0u8; 16];
        let s = d.stream(0).unwrap();
        let (e1, e2) = (d.event_create(0).unwrap(), d.event_create(0).unwrap());
        // SAFETY: mapped range; back outlives the copies (dropped below, never run).
        unsafe {
            d.copy_d2h(back.as_mut_ptr(), va, 16, s).unwrap();
            d.event_record(e1, s).unwrap();
            d.copy_d2h(back.as_mut_ptr(), va + 16, 16, s).unwrap();
            d.event_record(e2, s).unwrap();
        }
        d.unmap(va, size).unwrap();
        let e = d.event_sync(e1).unwrap_err();
        assert!(e.to_string().contains("no longer mapped"), "{e}");
        // e2's mark was still queued when work ahead of it was dropped: it never completes.
        let e = d.event_sync(e2).unwrap_err();
        assert!(e.to_string().contains("lost to an earlier failure"), "{e}");
        assert!(d.stream_sync(s).is_err(), "the copy after it is as illegal");
        assert_eq!(d.queued_copies(), 0);
        d.event_record(e2, s).unwrap();
        d.event_sync(e2).unwrap();
        d.event_destroy(e1);
        d.event_destroy(e2);
        d.release(h).unwrap();
        d.free_range(va, size).unwrap();
    }

    #[test]
    fn host_registration_is_tracked_and_checked() {
        let d = sim();
        let page = page_size();
        let buf = crate::os::mmap_anonymous(4 * page).unwrap();
        // SAFETY: buf is our 4-page mapping, unregistered before it is unmapped.
        unsafe {
            d.host_register(0, buf, 2 * page).unwrap();
            let e = d
                .host_register(0, buf.add(page as usize), page)
                .unwrap_err();
            assert!(e.to_string().contains("ALREADY_REGISTERED"), "{e}");
            assert!(d.host_register(0, buf.add(1), page).is_err(), "unaligned");
            d.host_register(0, buf.add(2 * page as usize), 2 * page)
                .unwrap();
        }
        assert_eq!((d.pinned_bytes(), d.registered_ranges()), (4 * page, 2));
        let (va, _, _) = mapped(&d);
        let s = d.stream(0).unwrap();
        // SAFETY: both host ranges are inside our mapping; copies are synchronized below.
        unsafe {
            d.copy_h2d(va, buf, 2 * page, s).unwrap();
            d.copy_h2d(va, buf.add(page as usize), 2 * page, s).unwrap();
        }
        d.stream_sync(s).unwrap();
        assert_eq!(
            d.pageable_copies(),
            1,
            "a copy across two registrations is pageable"
        );
        // SAFETY: no copy is queued; the ranges were registered above.
        unsafe {
            assert!(d.host_unregister(0, buf.add(page as usize)).is_err());
            d.host_unregister(0, buf).unwrap();
            d.host_unregister(0, buf.add(2 * page as usize)).unwrap();
        }
        assert_eq!(d.pinned_bytes(), 0);
        crate::os::munmap(buf, 4 * page).unwrap();
    }
}
