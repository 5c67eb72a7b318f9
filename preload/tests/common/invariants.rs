//! The one check that the engine's registry tells the truth: every allocation settled (no call
//! left one in transition), and the device holding exactly what the registry implies
//! (accessible ranges, physical bytes, handles, mappings, reservations, page-locked host bytes),
//! no more: only the leaks a test says the engine may have made. The device is one whose books
//! a test can read: the simulated device, or the HIP test double ([`Books`]).

use std::collections::BTreeMap;

use tms::driver::sim::SimDriver;
use tms::engine::{AllocInfo, Engine, State};

/// What the engine may have leaked on top of what its registry implies.
#[derive(Clone, Debug)]
pub struct Leaks {
    /// Physical handles.
    pub handles: usize,
    /// Device bytes of leaked handles, per device; `None`: not known (live bytes unchecked).
    pub bytes: Option<BTreeMap<i32, u64>>,
    /// Address ranges.
    pub reservations: usize,
    /// Page-locked host bytes.
    pub pinned: u64,
}

impl Default for Leaks {
    fn default() -> Self {
        Leaks {
            handles: 0,
            bytes: Some(BTreeMap::new()),
            reservations: 0,
            pinned: 0,
        }
    }
}

impl Leaks {
    /// Record a leaked handle of `bytes` on `device`.
    pub fn handle(&mut self, device: i32, bytes: u64) {
        self.handles += 1;
        if let Some(b) = &mut self.bytes {
            *b.entry(device).or_default() += bytes;
        }
    }

    /// Leaked device bytes on `device` (`None`: not known).
    pub fn bytes_on(&self, device: i32) -> Option<u64> {
        self.bytes
            .as_ref()
            .map(|b| b.get(&device).copied().unwrap_or(0))
    }
}

/// A device whose books a test can read exactly.
pub trait Books {
    /// What it is, for messages.
    fn what(&self) -> &'static str;
    fn devices(&self) -> i32;
    /// Whether `addr` lies in a mapped, accessible range.
    fn accessible(&self, addr: u64) -> bool;
    fn live_bytes(&self, device: i32) -> u64;
    fn live_mappings(&self) -> usize;
    fn live_handles(&self) -> usize;
    fn live_reservations(&self) -> usize;
    fn pinned_bytes(&self) -> u64;
    /// Copies queued and not run yet.
    fn queued_copies(&self) -> usize;
    /// Copies whose host side was pageable.
    fn pageable_copies(&self) -> u64;
}

impl Books for SimDriver {
    fn what(&self) -> &'static str {
        "the sim"
    }
    fn devices(&self) -> i32 {
        self.config().devices
    }
    fn accessible(&self, addr: u64) -> bool {
        self.is_accessible(addr)
    }
    fn live_bytes(&self, device: i32) -> u64 {
        SimDriver::live_bytes(self, device)
    }
    fn live_mappings(&self) -> usize {
        SimDriver::live_mappings(self)
    }
    fn live_handles(&self) -> usize {
        SimDriver::live_handles(self)
    }
    fn live_reservations(&self) -> usize {
        SimDriver::live_reservations(self)
    }
    fn pinned_bytes(&self) -> u64 {
        SimDriver::pinned_bytes(self)
    }
    fn queued_copies(&self) -> usize {
        SimDriver::queued_copies(self)
    }
    fn pageable_copies(&self) -> u64 {
        SimDriver::pageable_copies(self)
    }
}

/// What to check besides the registry against the device.
#[derive(Clone, Debug, Default)]
pub struct Expect {
    pub leaks: Leaks,
    /// Nothing is left queued on the device, and no copy ever used pageable host memory.
    pub copies_done: bool,
}

impl Expect {
    /// No leaks, and every copy done and page-locked.
    pub fn clean() -> Self {
        Expect {
            leaks: Leaks::default(),
            copies_done: true,
        }
    }
}

/// Each allocation's ranges that must be mapped (`true`) or not, as (offset, length).
fn ranges(e: &Engine, dev: &dyn Books, i: &AllocInfo) -> Result<Vec<(u64, u64, bool)>, String> {
    if i.chunk > 0 {
        let c = e
            .chunk_info(i.addr)
            .map_err(|err| format!("{:#x}: chunk info: {err}", i.addr))?;
        return Ok(c
            .layout
            .iter()
            .zip(&c.active)
            .map(|(&(off, len), &on)| (off, len, on))
            .collect());
    }
    if i.state == State::Partial {
        // Not chunked: a failed pause left some of its segments paused. Which ones the engine
        // does not say; those the device maps must add up to what the registry counts.
        let seg = e.segment_bytes();
        let segs: Vec<(u64, u64, bool)> = (0..i.mapped.div_ceil(seg))
            .map(|k| {
                let (off, len) = (k * seg, seg.min(i.mapped - k * seg));
                (off, len, dev.accessible(i.addr + off))
            })
            .collect();
        let (n, bytes) = segs
            .iter()
            .filter(|s| s.2)
            .fold((0, 0), |(n, b), s| (n + 1, b + s.1));
        if (n, bytes) != (i.handles, i.active_bytes) {
            return Err(format!(
                "{:#x}: partial with {} handles and {} bytes mapped in the registry, {n} \
                 segments and {bytes} bytes in {}",
                i.addr,
                i.handles,
                i.active_bytes,
                dev.what()
            ));
        }
        return Ok(segs);
    }
    Ok(vec![(0, i.mapped, i.state == State::Active)])
}

/// The engine's registry alone: every allocation settled, with handles where it is mapped.
pub fn check_registry(e: &Engine) -> Result<Vec<AllocInfo>, String> {
    let infos = e.allocations();
    for i in &infos {
        let a = i.addr;
        match i.state {
            State::Active => {
                if i.handles == 0 || i.active_bytes != i.mapped {
                    return Err(format!(
                        "{a:#x} is active with {} handles, {} of {} bytes mapped",
                        i.handles, i.active_bytes, i.mapped
                    ));
                }
            }
            State::Paused => {
                if i.handles != 0 || i.active_bytes != 0 {
                    return Err(format!(
                        "{a:#x} is paused with {} handles, {} bytes mapped",
                        i.handles, i.active_bytes
                    ));
                }
            }
            // Chunked allocations, and any other that a failed pause could not make whole again.
            State::Partial => {
                if i.handles == 0 || i.active_bytes >= i.mapped {
                    return Err(format!(
                        "{a:#x} is partial (chunk {}) with {} handles, {} of {} bytes mapped",
                        i.chunk, i.handles, i.active_bytes, i.mapped
                    ));
                }
            }
            s => return Err(format!("{a:#x} left {s:?} after the call returned")),
        }
    }
    Ok(infos)
}

/// The registry tells the truth and `sim` holds exactly what it implies, plus `expect`'s leaks.
pub fn check_invariants(e: &Engine, sim: &SimDriver, expect: &Expect) -> Result<(), String> {
    check_books(e, sim, expect)
}

/// [`check_invariants`] of any device `dev` with [`Books`].
pub fn check_books(e: &Engine, dev: &dyn Books, expect: &Expect) -> Result<(), String> {
    // Of an engine at rest: host memory a resume is giving back after it returned goes first.
    e.wait_released();
    let infos = check_registry(e)?;
    let mut active: BTreeMap<i32, u64> = BTreeMap::new();
    let (mut handles, mut pinned) = (0, 0);
    for i in &infos {
        for (off, len, mapped) in ranges(e, dev, i)? {
            let (first, last) = (i.addr + off, i.addr + off + len - 1);
            let seen = (dev.accessible(first), dev.accessible(last));
            if seen != (mapped, mapped) {
                return Err(format!(
                    "{:#x}+{off:#x} ({len} bytes) is {:?} in the registry but {} in {}",
                    i.addr,
                    i.state,
                    match seen {
                        (true, true) => "accessible",
                        (false, false) => "not accessible",
                        _ => "partly accessible",
                    },
                    dev.what()
                ));
            }
        }
        *active.entry(i.device).or_default() += i.active_bytes;
        handles += i.handles;
        pinned += i.host_pinned_bytes;
    }
    pinned += e.staging_bytes();
    let l = &expect.leaks;
    for d in 0..dev.devices() {
        let want = active.get(&d).copied().unwrap_or(0);
        if let Some(leaked) = l.bytes_on(d) {
            if dev.live_bytes(d) != want + leaked {
                return Err(format!(
                    "device {d}: live bytes {} != mapped bytes of active allocations {want} + \
                     leaks {l:?}",
                    dev.live_bytes(d)
                ));
            }
        }
    }
    let counts = [
        ("mappings", dev.live_mappings(), handles),
        ("handles", dev.live_handles(), handles + l.handles),
        (
            "reservations",
            dev.live_reservations(),
            infos.len() + l.reservations,
        ),
    ];
    for (what, got, want) in counts {
        if got != want {
            return Err(format!(
                "{what}: {} holds {got}, the registry implies {want} (leaks {l:?})",
                dev.what()
            ));
        }
    }
    if dev.pinned_bytes() != pinned + l.pinned {
        return Err(format!(
            "pinned bytes: {} holds {}, the registry implies {pinned} (backups and staging \
             slots; leaks {l:?})",
            dev.what(),
            dev.pinned_bytes()
        ));
    }
    if expect.copies_done {
        if dev.queued_copies() != 0 {
            return Err(format!(
                "{} copies left queued after an operation",
                dev.queued_copies()
            ));
        }
        if dev.pageable_copies() != 0 {
            return Err(format!(
                "{} copies of a backup used pageable memory",
                dev.pageable_copies()
            ));
        }
    }
    Ok(())
}

/// [`check_invariants`], failing the test with `ctx`.
pub fn assert_invariants(e: &Engine, sim: &SimDriver, expect: &Expect, ctx: &str) {
    if let Err(m) = check_invariants(e, sim, expect) {
        panic!("{ctx}: {m}");
    }
}
