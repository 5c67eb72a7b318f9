//! Model-based property test: random sequences of engine operations, checked after every step
//! against a plain model of what each allocation should be (address, size, tag, backup, state,
//! contents or "undefined", host buffer held or not) and of what the simulated device should
//! hold. Capacity is small enough that allocations and resumes run out of memory now and then;
//! the model predicts those failures exactly (an out-of-memory resume leaves the tag paused).
//!
//! The fault-free test also runs on a GPU (`common::harness`), in units of its granularity and
//! with its capacity (the model then predicts no out-of-memory), checking what the CUDA driver
//! can tell.

mod common;

use std::collections::BTreeMap;

use common::model::{poke, Fault, Units, FAULT_PRIMS};
use common::{engine_test, pattern, run_proptest, Expect, Harness, Setup};
use proptest::prelude::*;
use tms::backup::disk::{self, DiskOp, DIRECT_ALIGN};
use tms::backup::BackupKind;
use tms::backup::HostLayout;
use tms::engine::{AllocRequest, Checks, CopyConfig, Engine, Pick, PinMode, State};
use tms::Backup;

/// The sim's granularity: the model's unit of size (a GPU's own granularity there).
const G: u64 = 64 << 10;
/// Per device of the sim: about four allocations of average size, so out-of-memory happens.
const CAPACITY: u64 = 12 * G;

/// Two devices of [`CAPACITY`] in units of [`G`], and a disk backup folder.
fn model_setup() -> Setup {
    Setup::default()
        .devices(2)
        .capacity(CAPACITY)
        .granularity(G)
        .disk()
}

const TAGS: [&str; 3] = ["kv", "weights", "misc"];

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        tag: usize,
        backup: Backup,
        device: i32,
        /// Chunked in chunks of this many granules (0: not chunked); the size is then rounded
        /// to a multiple of the chunk.
        chunk: u64,
    },
    /// Fill the active chunks of the `pick`-th allocation with anything active (modulo their
    /// number) with fresh data.
    Write {
        pick: usize,
        seed: u64,
    },
    /// Free the `pick`-th allocation (modulo their number).
    Free {
        pick: usize,
    },
    /// Pause a tag (every tag if `None`), recording chunk states if asked.
    Pause(Option<usize>, bool),
    /// Resume a tag, bringing back only the recorded chunks if asked.
    Resume(Option<usize>, bool),
    /// Pause (true) or resume the chunks in `mask` of the `pick`-th chunked allocation.
    Chunks {
        pick: usize,
        mask: u64,
        pause: bool,
    },
    SetRetain(bool),
    /// Change a few bytes of a defined active unit of the `pick`-th allocation with anything
    /// so (the small changes that pauses skipping unchanged memory must never miss).
    Poke {
        pick: usize,
        at: u64,
        seed: u64,
    },
    /// What pauses and resumes of every tag check with digests: skip unchanged, verify.
    SetChecks(bool, bool),
}

/// Sizes around multiples of the granularity `g`.
fn size_strategy(g: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        1..=5 * g,
        (1..=5u64).prop_map(move |k| k * g),
        (1..=4u64, any::<bool>()).prop_map(move |(k, up)| if up { k * g + 1 } else { k * g - 1 }),
        Just(1u64),
    ]
}

/// Copy settings from one worker and whole allocations per chunk to several workers cutting
/// allocations into many chunks and staging slots, page-locking or not. Host chunks and slots
/// are multiples of the system's page size, disk chunks of the disk's unit.
fn copy_config_strategy() -> impl Strategy<Value = CopyConfig> {
    let page = tms::os::page_size();
    (
        1..=4usize,
        prop_oneof![Just(page), Just(4 * page), Just(64 << 20)],
        prop_oneof![Just(page), Just(2 * page), Just(1 << 20)],
        (
            any::<bool>(),
            any::<bool>(),
            prop_oneof![Just(page), Just(1 << 20)],
        ),
        prop_oneof![
            Just(PinMode::Background),
            Just(PinMode::Inline),
            Just(PinMode::Never)
        ],
        prop_oneof![Just(0u64), Just(DIRECT_ALIGN), Just(3 * DIRECT_ALIGN)],
    )
        .prop_map(
            |(threads, chunk, slot, (hugepages, streaming, save_slot), pin, disk_chunk)| {
                CopyConfig {
                    threads,
                    layout: HostLayout {
                        chunk,
                        hugepages,
                        streaming,
                    },
                    slot,
                    save_slot,
                    pin,
                    disk_chunk,
                    // Slots kept after resumes without retention where the threads are even.
                    keep_staging: threads % 2 == 0,
                    // Pauses on the workers' own streams (on a GPU) where the threads are a
                    // multiple of 3.
                    save_streams: threads % 3 == 0,
                }
            },
        )
}

fn op_strategy(g: u64) -> impl Strategy<Value = Op> {
    let backup = prop_oneof![
        Just(None),
        Just(Some(BackupKind::Pinned)),
        Just(Some(BackupKind::Mmap)),
        Just(Some(BackupKind::Disk))
    ];
    let tag = prop_oneof![Just(None), (0..3usize).prop_map(Some)];
    prop_oneof![
        5 => (size_strategy(g), 0..3usize, backup, 0..2i32, prop_oneof![2 => Just(0u64), 1 => Just(1u64), 1 => Just(2u64)])
            .prop_map(|(size, tag, backup, device, chunk)| Op::Alloc { size, tag, backup, device, chunk }),
        3 => (any::<usize>(), any::<u64>()).prop_map(|(pick, seed)| Op::Write { pick, seed }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        3 => (tag.clone(), any::<bool>()).prop_map(|(t, s)| Op::Pause(t, s)),
        2 => (tag, any::<bool>()).prop_map(|(t, r)| Op::Resume(t, r)),
        4 => (any::<usize>(), any::<u64>(), any::<bool>())
            .prop_map(|(pick, mask, pause)| Op::Chunks { pick, mask, pause }),
        1 => any::<bool>().prop_map(Op::SetRetain),
        3 => (any::<usize>(), any::<u64>(), any::<u64>()).prop_map(|(pick, at, seed)| Op::Poke { pick, at, seed }),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(s, v)| Op::SetChecks(s, v)),
    ]
}

/// An allocation as the model sees it: its units (`common::model::Units`), and what this
/// test follows besides.
#[derive(Clone, Debug)]
struct MAlloc {
    u: Units,
    tag: usize,
    device: i32,
    /// A host buffer (or, for a disk backup, a file) is held for the backup.
    host: bool,
    /// Unit states recorded by a pause that saved them.
    kept: Option<Vec<bool>>,
}

units_deref!(MAlloc);

impl MAlloc {
    fn disk(&self) -> bool {
        self.backup == Some(BackupKind::Disk)
    }

    /// Pause units `us` (active ones); returns (device bytes, copied bytes).
    fn pause(&mut self, us: &[usize]) -> (u64, u64) {
        let r = self.u.pause(us);
        if self.backup.is_some() {
            self.host = true;
        }
        r
    }

    /// Resume units `us` (paused ones); returns (device bytes, copied bytes).
    fn resume(&mut self, us: &[usize], retain: bool) -> (u64, u64) {
        let r = self.u.resume(us, retain);
        if self.state() == State::Active {
            // A file stays (reused by the next pause); host memory only if retained, and what
            // it held of the chunks resumed earlier goes with it.
            self.host = self.backup.is_some() && (retain || self.disk());
            if !self.host {
                self.saved.fill(false);
            }
        }
        r
    }
}

struct Model {
    allocs: BTreeMap<u64, MAlloc>,
    retain: bool,
    /// The granularity, and each device's capacity.
    g: u64,
    capacity: u64,
}

impl Model {
    /// Nothing allocated, on the harness's device (the sim's [`CAPACITY`], a GPU's own).
    fn new(h: &Harness) -> Model {
        Model {
            allocs: BTreeMap::new(),
            retain: false,
            g: h.g(),
            capacity: h.pick(CAPACITY, u64::MAX),
        }
    }

    fn live(&self, device: i32) -> u64 {
        self.allocs
            .values()
            .filter(|a| a.device == device)
            .map(|a| a.live())
            .sum()
    }

    fn with_tag(&self, tag: Option<usize>) -> Vec<u64> {
        self.allocs
            .iter()
            .filter(|(_, a)| tag.is_none_or(|t| a.tag == t))
            .map(|(p, _)| *p)
            .collect()
    }
}

fn tag_name(t: Option<usize>) -> Option<&'static str> {
    t.map(|t| TAGS[t])
}

fn fail(what: &str) -> impl Fn(tms::Error) -> TestCaseError + '_ {
    move |e| TestCaseError::fail(format!("{what}: {e}"))
}

/// Resume `units` of each allocation (all-or-nothing across them), predicting out of memory;
/// true if it succeeded.
fn resume_units(
    h: &Harness,
    m: &mut Model,
    sel: Vec<(u64, Vec<usize>)>,
    faulty: bool,
    call: impl FnOnce() -> tms::Result<tms::engine::OpReport>,
) -> Result<bool, TestCaseError> {
    let sel: Vec<(u64, Vec<usize>)> = sel.into_iter().filter(|(_, u)| !u.is_empty()).collect();
    let need = |d: i32| {
        sel.iter()
            .filter(|(p, _)| m.allocs[p].device == d)
            .map(|(p, u)| u.len() as u64 * m.allocs[p].unit())
            .sum::<u64>()
    };
    let oom = (0..h.devices()).any(|d| m.live(d).saturating_add(need(d)) > m.capacity);
    let res = call();
    if oom || (faulty && res.is_err()) {
        let err = res.expect_err("resume beyond capacity must fail");
        prop_assert!(faulty || err.is_oom(), "{err}");
        // Everything stays paused, backups and all.
        return Ok(false);
    }
    let r = res.map_err(fail("resume"))?;
    let (mut bytes, mut copied) = (0, 0);
    for (p, us) in &sel {
        let (b, c) = m.allocs.get_mut(p).unwrap().resume(us, m.retain);
        bytes += b;
        copied += c;
    }
    prop_assert_eq!(
        (r.allocations, r.bytes, r.copied),
        (sel.len(), bytes, copied),
        "resume report"
    );
    Ok(true)
}

fn fault_strategy() -> impl Strategy<Value = Option<Fault>> {
    prop_oneof![
        2 => Just(None),
        3 => (0..FAULT_PRIMS.len(), 1..=6u64).prop_map(|(p, n)| Some(Fault::Prim(FAULT_PRIMS[p], n))),
        1 => (prop_oneof![Just(DiskOp::Write), Just(DiskOp::Read), Just(DiskOp::Sync), Just(DiskOp::Allocate)], 1..=4u64)
            .prop_map(|(o, n)| Some(Fault::Disk(o, n))),
    ]
}

/// After a pause that failed: what the engine says, which may be any mix of the units it was
/// to pause paused (saved) or still active (not saved), and nothing else changed.
fn resync_failed_pause(
    e: &Engine,
    m: &mut Model,
    sel: &[(u64, Vec<usize>)],
) -> Result<(), TestCaseError> {
    let infos: BTreeMap<u64, tms::engine::AllocInfo> =
        e.allocations().into_iter().map(|i| (i.addr, i)).collect();
    for (p, us) in sel {
        let a = m.allocs.get_mut(p).unwrap();
        let i = &infos[p];
        let active: Vec<bool> = if a.chunk > 0 {
            e.chunk_info(*p).map_err(fail("chunk info"))?.active
        } else {
            vec![i.state == State::Active]
        };
        for (u, &now) in active.iter().enumerate() {
            if us.contains(&u) {
                if now {
                    a.saved[u] = false;
                } else {
                    a.pause(&[u]);
                }
            } else {
                prop_assert_eq!(
                    active[u],
                    a.active[u],
                    "{:#x} unit {} not in the pause",
                    p,
                    u
                );
            }
        }
        // A backup made for a pause that failed may be kept for the next one.
        a.host = i.host_bytes > 0 || i.host_pinned_bytes > 0 || i.disk_bytes > 0;
    }
    Ok(())
}

/// Apply `op` to the engine and the model, asserting the engine's answer where it is defined.
/// With `faulty`, a pause or resume may fail (a fault was armed for it): a failed resume changes
/// nothing, a failed pause may have paused any of what it was to pause.
fn step(h: &Harness, m: &mut Model, op: &Op, faulty: bool) -> Result<(), TestCaseError> {
    let e: &Engine = &h.e;
    match op {
        Op::Alloc {
            size,
            tag,
            backup,
            device,
            chunk,
        } => {
            let (chunk, device) = (chunk * m.g, h.device(*device));
            let size = if chunk > 0 {
                size.next_multiple_of(chunk)
            } else {
                *size
            };
            let mapped = size.next_multiple_of(m.g);
            let res = e.alloc(&AllocRequest {
                size,
                device,
                tag: TAGS[*tag].into(),
                backup: *backup,
                chunk,
            });
            if m.live(device).saturating_add(mapped) > m.capacity {
                let err = res.expect_err("allocation beyond capacity must fail");
                prop_assert!(err.is_oom(), "{err}");
            } else {
                let p = res.map_err(fail("alloc"))?;
                let overlaps = m
                    .allocs
                    .iter()
                    .any(|(q, a)| p < q + a.mapped && *q < p + mapped);
                prop_assert!(!overlaps, "new allocation {:#x} overlaps", p);
                let units = size.checked_div(chunk).map_or(1, |n| n as usize);
                m.allocs.insert(
                    p,
                    MAlloc {
                        u: Units::new(size, mapped, *backup, chunk, units),
                        tag: *tag,
                        device,
                        host: false,
                        kept: None,
                    },
                );
            }
        }
        Op::Write { pick, seed } => {
            let some: Vec<u64> = m
                .allocs
                .iter()
                .filter(|(_, a)| a.active.iter().any(|x| *x))
                .map(|(p, _)| *p)
                .collect();
            if !some.is_empty() {
                let p = some[pick % some.len()];
                let a = m.allocs.get_mut(&p).unwrap();
                let data = pattern(a.size as usize, *seed);
                for u in 0..a.active.len() {
                    if a.active[u] {
                        let (off, len) = a.span(u);
                        let r = off as usize..(off + len) as usize;
                        h.write(p + off, &data[r.clone()]);
                        a.contents[r.clone()].copy_from_slice(&data[r]);
                        a.defined[u] = true;
                    }
                }
            }
        }
        Op::Free { pick } => {
            let all: Vec<u64> = m.allocs.keys().copied().collect();
            if !all.is_empty() {
                let p = all[pick % all.len()];
                prop_assert!(e.free(p).map_err(fail("free"))?);
                m.allocs.remove(&p);
                prop_assert!(!e.owns(p));
            }
        }
        Op::Pause(tag, save) => {
            let res = e.pause_pick(&Pick {
                chunk_state: *save,
                ..Pick::tag(tag_name(*tag))
            });
            if faulty && res.is_err() {
                let mut sel = Vec::new();
                for p in m.with_tag(*tag) {
                    let a = m.allocs.get_mut(&p).unwrap();
                    let us: Vec<usize> = (0..a.active.len()).filter(|&u| a.active[u]).collect();
                    if *save {
                        a.kept = Some(a.active.clone());
                    }
                    sel.push((p, us));
                }
                return resync_failed_pause(e, m, &sel);
            }
            let r = res.map_err(fail("pause"))?;
            let (mut n, mut bytes, mut copied) = (0, 0, 0);
            for p in m.with_tag(*tag) {
                let a = m.allocs.get_mut(&p).unwrap();
                // Recorded for every allocation of the tag (a whole one as its units), those
                // with nothing left to pause too: a restore brings back the state at this pause.
                if *save {
                    a.kept = Some(a.active.clone());
                }
                let us: Vec<usize> = (0..a.active.len()).filter(|&u| a.active[u]).collect();
                if us.is_empty() {
                    continue;
                }
                let (b, c) = a.pause(&us);
                n += 1;
                bytes += b;
                copied += c;
            }
            // Pieces found unchanged are not copied: they count as what the backup took.
            prop_assert_eq!(
                (r.allocations, r.bytes, r.copied + r.unchanged),
                (n, bytes, copied),
                "pause report"
            );
        }
        Op::Resume(tag, restore) => {
            let mut sel = Vec::new();
            for p in m.with_tag(*tag) {
                let a = &m.allocs[&p];
                let kept = a.kept.as_ref().filter(|_| *restore);
                let us: Vec<usize> = (0..a.active.len())
                    .filter(|&u| !a.active[u] && kept.is_none_or(|k| k[u]))
                    .collect();
                sel.push((p, us));
            }
            let pick = Pick {
                chunk_state: *restore,
                ..Pick::tag(tag_name(*tag))
            };
            // A record is used once, by every allocation of the tag.
            let chosen: Vec<u64> = sel.iter().map(|(p, _)| *p).collect();
            if resume_units(h, m, sel, faulty, || e.resume_pick(&pick))? && *restore {
                for p in chosen {
                    m.allocs.get_mut(&p).unwrap().kept = None;
                }
            }
        }
        Op::Chunks { pick, mask, pause } => {
            let chunked: Vec<u64> = m
                .allocs
                .iter()
                .filter(|(_, a)| a.chunk > 0)
                .map(|(p, _)| *p)
                .collect();
            if chunked.is_empty() {
                return Ok(());
            }
            let p = chunked[pick % chunked.len()];
            let n = m.allocs[&p].active.len();
            let idx: Vec<usize> = (0..n).filter(|u| mask >> (u % 64) & 1 == 1).collect();
            let call = Pick::chunks(p, &idx);
            if *pause {
                let res = e.pause_pick(&call);
                let a = m.allocs.get_mut(&p).unwrap();
                let us: Vec<usize> = idx.iter().copied().filter(|&u| a.active[u]).collect();
                if faulty && res.is_err() {
                    return resync_failed_pause(e, m, &[(p, us)]);
                }
                let r = res.map_err(fail("pause chunks"))?;
                let want = if us.is_empty() {
                    (0, 0, 0)
                } else {
                    let (b, c) = a.pause(&us);
                    (1, b, c)
                };
                prop_assert_eq!(
                    (r.allocations, r.bytes, r.copied + r.unchanged),
                    want,
                    "pause chunks report"
                );
            } else {
                let a = &m.allocs[&p];
                let us: Vec<usize> = idx.iter().copied().filter(|&u| !a.active[u]).collect();
                resume_units(h, m, vec![(p, us)], faulty, || e.resume_pick(&call))?;
            }
        }
        Op::SetRetain(on) => {
            e.set_retain_cpu_backup(*on);
            m.retain = *on;
        }
        Op::Poke { pick, at, seed } => {
            if let Some((p, o, data)) = poke(&mut m.allocs, *pick, *at, *seed) {
                h.write(p + o, &data);
            }
        }
        Op::SetChecks(skip_unchanged, verify) => e.set_checks(
            None,
            Checks {
                skip_unchanged: *skip_unchanged,
                verify: *verify,
            },
        ),
    }
    Ok(())
}

/// The engine and the device agree with the model.
fn check(h: &Harness, m: &Model) -> Result<(), TestCaseError> {
    let e: &Engine = &h.e;
    let mode = e.copy_config().pin;
    prop_assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
    let infos = e.allocations();
    prop_assert_eq!(
        infos.iter().map(|i| i.addr).collect::<Vec<_>>(),
        m.allocs.keys().copied().collect::<Vec<_>>(),
        "addresses"
    );
    for i in &infos {
        let a = &m.allocs[&i.addr];
        prop_assert_eq!(
            (
                i.size,
                i.mapped,
                i.device,
                i.tag.as_str(),
                i.backup,
                i.state,
                i.chunk,
                i.active_bytes
            ),
            (
                a.size,
                a.mapped,
                a.device,
                TAGS[a.tag],
                a.backup,
                a.state(),
                a.chunk,
                a.live()
            ),
            "allocation {:#x}",
            i.addr
        );
        if a.chunk > 0 {
            let c = e
                .chunk_info(i.addr + a.size - 1)
                .map_err(fail("chunk info"))?;
            prop_assert_eq!(&c.active, &a.active, "chunk states of {:#x}", i.addr);
        }
        prop_assert_eq!(
            (i.host_bytes, i.disk_bytes),
            match (a.host, a.disk()) {
                (false, _) => (0, 0),
                // A chunked allocation's host memory is that of the chunks the backup holds.
                (true, false) if a.chunk > 0 => (
                    (0..a.saved.len())
                        .filter(|&u| a.saved[u])
                        .map(|u| a.span(u).1)
                        .sum(),
                    0,
                ),
                (true, false) => (a.size, 0),
                (true, true) => (0, a.mapped),
            },
            "host and disk bytes of {:#x}",
            i.addr
        );
        // A held backup is a complete snapshot: paused with a backup, or its last pause's,
        // retained while active.
        let valid = a.saved.iter().all(|s| *s);
        prop_assert_eq!(i.host_valid, valid, "host_valid of {:#x}", i.addr);
        // Pinned backups are page-locked in whole pages: inline by the first pause; in the
        // background only once retained (all of it once the pinner is idle, or for a chunked
        // allocation the host chunks lying in saved chunks); never otherwise.
        let whole = a.size.next_multiple_of(tms::os::page_size());
        let pinned_backup = a.host && a.backup == Some(BackupKind::Pinned);
        let locked = i.host_pinned_bytes;
        match mode {
            PinMode::Inline => prop_assert!(
                locked <= whole && (pinned_backup || locked == 0),
                "page-locked bytes of {:#x}: {}",
                i.addr,
                locked
            ),
            // A chunked allocation's backup is page-locked where it holds saved chunks.
            PinMode::Background => prop_assert!(
                locked == 0
                    || (pinned_backup && (locked == whole || a.chunk > 0 && locked < whole)),
                "page-locked bytes of {:#x}: {}",
                i.addr,
                locked
            ),
            PinMode::Never => prop_assert_eq!(locked, 0),
        }
        if a.state() == State::Active {
            let mut b = vec![0u8; a.size as usize];
            let has = e.copy_cpu_backup(i.addr, &mut b).map_err(fail("copy"))?;
            let offered = valid && a.host && !a.disk();
            prop_assert_eq!(has, offered, "retained snapshot of active {:#x}", i.addr);
        }
        for u in 0..a.active.len() {
            let (off, len) = a.span(u);
            let (first, last) = (i.addr + off, i.addr + off + a.unit() - 1);
            let want = &a.contents[off as usize..(off + len) as usize];
            if a.active[u] {
                if let Some(sim) = h.sim() {
                    prop_assert!(sim.is_accessible(first) && sim.is_accessible(last));
                }
                if a.defined[u] {
                    let got = h.read(first, len as usize);
                    prop_assert!(got == want, "contents of active {:#x} unit {}", i.addr, u);
                }
            } else {
                if let Some(sim) = h.sim() {
                    prop_assert!(!sim.is_accessible(first) && !sim.is_accessible(last));
                }
                let mut b = vec![0u8; len as usize];
                let has = e.copy_cpu_backup(first, &mut b).map_err(fail("copy"))?;
                prop_assert_eq!(
                    has,
                    a.backup.is_some() && !a.disk(),
                    "backup of {:#x}",
                    first
                );
                if has && a.defined[u] {
                    prop_assert!(b == want, "backup of paused {:#x} unit {}", i.addr, u);
                }
            }
        }
    }
    for d in 0..h.devices() {
        h.check_live_bytes(d, m.live(d))
            .map_err(|err| TestCaseError::fail(format!("live bytes of device {d}: {err}")))?;
    }
    // Mappings, handles, reservations and page-locked bytes as the registry implies; no copy
    // from pageable memory, none left queued after an operation.
    h.check_invariants(&Expect::clean())
        .map_err(TestCaseError::fail)?;
    Ok(())
}

engine_test! {
    /// 128 cases of up to 50 operations each on the sim (well under a few seconds in a debug
    /// build); 16 on a GPU.
    fn engine_matches_the_model(h) [model_setup()] {
        let g = h.g();
        let strategy = (
            prop::collection::vec(op_strategy(g), 1..=50),
            copy_config_strategy(),
            prop_oneof![Just(g), Just(2 * g), Just(1u64 << 30)],
            any::<bool>(),
        );
        run_proptest(h.pick(128, 16), strategy, |(ops, cfg, segment, checked)| {
            let h = h.again();
            let mut m = Model::new(&h);
            h.e.set_copy_config(cfg).unwrap();
            h.e.set_segment_bytes(segment).unwrap();
            if checked {
                // Half the cases start retaining and skipping unchanged memory, so that pauses
                // of retained backups after small changes (Poke) are common.
                step(&h, &mut m, &Op::SetRetain(true), false).unwrap();
                step(&h, &mut m, &Op::SetChecks(true, true), false).unwrap();
            }
            for (n, op) in ops.iter().enumerate() {
                step(&h, &mut m, op, false)
                    .map_err(|err| TestCaseError::fail(format!("step {n} {op:?}: {err}")))?;
                check(&h, &m)
                    .map_err(|err| TestCaseError::fail(format!("after step {n} {op:?}: {err}")))?;
            }
            // Dropping the engine frees everything it holds.
            let ended = h.end();
            ended.released().map_err(TestCaseError::fail)?;
            prop_assert_eq!(ended.files(), 0, "files removed");
            Ok(())
        });
    }
}

engine_test! {
    /// Chunk-level and whole-tag pauses and resumes with a fault armed for some of them, with
    /// several copy workers: whatever fails, no byte that was saved or still mapped is lost,
    /// and every later call works.
    sim_only fn chunk_operations_survive_faults(h) [model_setup()] {
        let strategy = (
            prop::collection::vec((op_strategy(G), fault_strategy()), 1..=40),
            copy_config_strategy(),
        );
        run_proptest(96, strategy, |(ops, cfg)| {
            let h = h.again();
            let (sim, dir) = (h.simulated(), h.dir());
            let mut m = Model::new(&h);
            h.e.set_copy_config(CopyConfig { threads: cfg.threads.max(2), ..cfg }).unwrap();
            for (n, (op, fault)) in ops.iter().enumerate() {
                let transaction = matches!(op, Op::Pause(..) | Op::Resume(..) | Op::Chunks { .. });
                let fault = fault.filter(|_| transaction);
                match fault {
                    Some(Fault::Prim(p, nth)) => sim.arm_fault(p, nth, 999),
                    Some(Fault::Disk(o, nth)) => disk::arm_fault(Some(dir), o, nth, libc::EIO),
                    None => {}
                }
                let r = step(&h, &mut m, op, fault.is_some());
                sim.clear_faults();
                disk::clear_faults(Some(dir));
                r.map_err(|err| TestCaseError::fail(format!("step {n} {op:?} {fault:?}: {err}")))?;
                check(&h, &m).map_err(|err| {
                    TestCaseError::fail(format!("after step {n} {op:?} {fault:?}: {err}"))
                })?;
            }
            let ended = h.end();
            let sim = ended.sim().unwrap();
            prop_assert_eq!(
                (sim.live_bytes(0), sim.live_bytes(1), sim.live_handles(), sim.live_mappings()),
                (0, 0, 0, 0)
            );
            prop_assert_eq!(ended.files(), 0, "files removed");
            Ok(())
        });
    }
}

engine_test! {
    /// The driver contract (driver/mod.rs, `Driver::granularity`): "sizes and addresses are
    /// multiples of it". cuMemAddressReserve with alignment 0 aligns to the granularity; the sim
    /// must too, or engine code that relies on alignment is never tested.
    fn allocation_addresses_are_multiples_of_the_granularity(h)
        [Setup::default().capacity(CAPACITY).granularity(G)]
    {
        let (e, g) = (&h.e, h.g());
        let addrs: Vec<u64> = (0..4)
            .map(|_| {
                e.alloc(&AllocRequest {
                    size: 1,
                    device: 0,
                    tag: "a".into(),
                    backup: None,
                    chunk: 0,
                })
                .unwrap()
            })
            .collect();
        let misaligned: Vec<String> = addrs
            .iter()
            .filter(|p| *p % g != 0)
            .map(|p| format!("{p:#x}"))
            .collect();
        assert!(
            misaligned.is_empty(),
            "addresses not multiples of the granularity {g:#x}: {misaligned:?}"
        );
    }
}
