//! Model-based property test: random sequences of engine operations, checked after every step
//! against a plain model of what each allocation should be (address, size, tag, backup, state,
//! contents or "undefined", host buffer held or not) and of what the simulated device should
//! hold. Capacity is small enough that allocations and resumes run out of memory now and then;
//! the model predicts those failures exactly (an out-of-memory resume leaves the tag paused).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{pattern, read_raw, write_raw};
use proptest::prelude::*;
use tms::backup::BackupKind;
use tms::backup::HostLayout;
use tms::driver::sim::{SimConfig, SimDriver};
use tms::engine::{AllocRequest, CopyConfig, Engine, PinMode, State};
use tms::Backup;

const G: u64 = 64 << 10;
/// Per device: about four allocations of average size, so out-of-memory happens.
const CAPACITY: u64 = 12 * G;
const TAGS: [&str; 3] = ["kv", "weights", "misc"];

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        tag: usize,
        backup: Backup,
        device: i32,
    },
    /// Fill the `pick`-th active allocation (modulo their number) with fresh data.
    Write {
        pick: usize,
        seed: u64,
    },
    /// Free the `pick`-th allocation (modulo their number).
    Free {
        pick: usize,
    },
    Pause(Option<usize>),
    Resume(Option<usize>),
    SetRetain(bool),
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        1..=5 * G,
        (1..=5u64).prop_map(|k| k * G),
        (1..=4u64, any::<bool>()).prop_map(|(k, up)| if up { k * G + 1 } else { k * G - 1 }),
        Just(1u64),
    ]
}

/// Copy settings from one worker and whole allocations per chunk to several workers cutting
/// allocations into many chunks and staging slots, page-locking or not.
fn copy_config_strategy() -> impl Strategy<Value = CopyConfig> {
    (
        1..=4usize,
        prop_oneof![Just(4096u64), Just(16 << 10), Just(64 << 20)],
        prop_oneof![Just(4096u64), Just(8 << 10), Just(1 << 20)],
        any::<bool>(),
        prop_oneof![
            Just(PinMode::Background),
            Just(PinMode::Inline),
            Just(PinMode::Never)
        ],
    )
        .prop_map(|(threads, chunk, slot, hugepages, pin)| CopyConfig {
            threads,
            layout: HostLayout { chunk, hugepages },
            slot,
            pin,
            disk_chunk: 0,
        })
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let backup = prop_oneof![
        Just(None),
        Just(Some(BackupKind::Pinned)),
        Just(Some(BackupKind::Mmap)),
        Just(Some(BackupKind::Disk))
    ];
    let tag = prop_oneof![Just(None), (0..3usize).prop_map(Some)];
    prop_oneof![
        5 => (size_strategy(), 0..3usize, backup, 0..2i32)
            .prop_map(|(size, tag, backup, device)| Op::Alloc { size, tag, backup, device }),
        3 => (any::<usize>(), any::<u64>()).prop_map(|(pick, seed)| Op::Write { pick, seed }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        3 => tag.clone().prop_map(Op::Pause),
        2 => tag.prop_map(Op::Resume),
        1 => any::<bool>().prop_map(Op::SetRetain),
    ]
}

#[derive(Clone, Debug)]
struct MAlloc {
    size: u64,
    mapped: u64,
    tag: usize,
    backup: Backup,
    device: i32,
    state: State,
    /// `None`: undefined (never written, or paused without a backup).
    contents: Option<Vec<u8>>,
    /// A host buffer (or, for a disk backup, a file) is held for the backup.
    host: bool,
    /// The backup holds a complete snapshot.
    valid: bool,
}

impl MAlloc {
    fn disk(&self) -> bool {
        self.backup == Some(BackupKind::Disk)
    }
}

#[derive(Default)]
struct Model {
    allocs: BTreeMap<u64, MAlloc>,
    retain: bool,
}

impl Model {
    fn live(&self, device: i32) -> u64 {
        self.allocs
            .values()
            .filter(|a| a.device == device && a.state == State::Active)
            .map(|a| a.mapped)
            .sum()
    }

    fn selected(&self, tag: Option<usize>, state: State) -> Vec<u64> {
        self.allocs
            .iter()
            .filter(|(_, a)| a.state == state && tag.is_none_or(|t| a.tag == t))
            .map(|(p, _)| *p)
            .collect()
    }
}

fn tag_name(t: Option<usize>) -> Option<&'static str> {
    t.map(|t| TAGS[t])
}

/// Apply `op` to the engine and the model, asserting the engine's answer where it is defined.
fn step(sim: &SimDriver, e: &Engine, m: &mut Model, op: &Op) -> Result<(), TestCaseError> {
    match op {
        Op::Alloc {
            size,
            tag,
            backup,
            device,
        } => {
            let mapped = size.next_multiple_of(G);
            let res = e.alloc(&AllocRequest {
                size: *size,
                device: *device,
                tag: TAGS[*tag].into(),
                backup: *backup,
                chunk: 0,
            });
            if m.live(*device) + mapped > CAPACITY {
                let err = res.expect_err("allocation beyond capacity must fail");
                prop_assert!(err.is_oom(), "{err}");
            } else {
                let p = res.map_err(|e| TestCaseError::fail(format!("alloc: {e}")))?;
                let overlaps = m
                    .allocs
                    .iter()
                    .any(|(q, a)| p < q + a.mapped && *q < p + mapped);
                prop_assert!(!overlaps, "new allocation {:#x} overlaps", p);
                m.allocs.insert(
                    p,
                    MAlloc {
                        size: *size,
                        mapped,
                        tag: *tag,
                        backup: *backup,
                        device: *device,
                        state: State::Active,
                        contents: None,
                        host: false,
                        valid: false,
                    },
                );
            }
        }
        Op::Write { pick, seed } => {
            let active = m.selected(None, State::Active);
            if !active.is_empty() {
                let p = active[pick % active.len()];
                let a = m.allocs.get_mut(&p).unwrap();
                let data = pattern(a.size as usize, *seed);
                write_raw(sim, p, &data);
                a.contents = Some(data);
            }
        }
        Op::Free { pick } => {
            let all: Vec<u64> = m.allocs.keys().copied().collect();
            if !all.is_empty() {
                let p = all[pick % all.len()];
                prop_assert!(e.free(p).map_err(|e| TestCaseError::fail(e.to_string()))?);
                m.allocs.remove(&p);
                prop_assert!(!e.owns(p));
            }
        }
        Op::Pause(tag) => {
            let sel = m.selected(*tag, State::Active);
            let r = e
                .pause(tag_name(*tag))
                .map_err(|e| TestCaseError::fail(format!("pause: {e}")))?;
            let (mut bytes, mut copied) = (0, 0);
            for p in &sel {
                let a = m.allocs.get_mut(p).unwrap();
                a.state = State::Paused;
                bytes += a.mapped;
                if a.backup.is_some() {
                    a.host = true;
                    a.valid = true;
                    copied += a.size;
                } else {
                    a.contents = None;
                }
            }
            prop_assert_eq!(
                (r.allocations, r.bytes, r.copied),
                (sel.len(), bytes, copied),
                "pause report"
            );
        }
        Op::Resume(tag) => {
            let sel = m.selected(*tag, State::Paused);
            let need = |d: i32| {
                sel.iter()
                    .filter(|p| m.allocs[*p].device == d)
                    .map(|p| m.allocs[p].mapped)
                    .sum::<u64>()
            };
            let oom = (0..2).any(|d| m.live(d) + need(d) > CAPACITY);
            let res = e.resume(tag_name(*tag));
            if oom {
                let err = res.expect_err("resume beyond capacity must fail");
                prop_assert!(err.is_oom(), "{err}");
                // The model stays paused, backups and all.
            } else {
                let r = res.map_err(|e| TestCaseError::fail(format!("resume: {e}")))?;
                let (mut bytes, mut copied) = (0, 0);
                for p in &sel {
                    let a = m.allocs.get_mut(p).unwrap();
                    a.state = State::Active;
                    bytes += a.mapped;
                    if a.backup.is_some() {
                        copied += a.size;
                    }
                    // A file stays (reused by the next pause); host memory only if retained.
                    a.host = a.backup.is_some() && (m.retain || a.disk());
                    a.valid = a.backup.is_some() && m.retain;
                }
                prop_assert_eq!(
                    (r.allocations, r.bytes, r.copied),
                    (sel.len(), bytes, copied),
                    "resume report"
                );
            }
        }
        Op::SetRetain(on) => {
            e.set_retain_cpu_backup(*on);
            m.retain = *on;
        }
    }
    Ok(())
}

/// The engine and the sim agree with the model.
fn check(sim: &SimDriver, e: &Engine, m: &Model) -> Result<(), TestCaseError> {
    let mode = e.copy_config().pin;
    prop_assert!(e.wait_for_background_pinning(std::time::Duration::from_secs(10)));
    let infos = e.allocations();
    prop_assert_eq!(
        infos.iter().map(|i| i.addr).collect::<Vec<_>>(),
        m.allocs.keys().copied().collect::<Vec<_>>(),
        "addresses"
    );
    let mut pinned = 0;
    for i in &infos {
        let a = &m.allocs[&i.addr];
        prop_assert_eq!(
            (
                i.size,
                i.mapped,
                i.device,
                i.tag.as_str(),
                i.backup,
                i.state
            ),
            (a.size, a.mapped, a.device, TAGS[a.tag], a.backup, a.state),
            "allocation {:#x}",
            i.addr
        );
        prop_assert_eq!(
            (i.host_bytes, i.disk_bytes),
            match (a.host, a.disk()) {
                (false, _) => (0, 0),
                (true, false) => (a.size, 0),
                (true, true) => (0, a.mapped),
            },
            "host and disk bytes of {:#x}",
            i.addr
        );
        // A held backup is a complete snapshot: paused with a backup, or its last pause's,
        // retained while active.
        prop_assert_eq!(i.host_valid, a.valid, "host_valid of {:#x}", i.addr);
        // Pinned backups are page-locked in whole pages: inline by the first pause; in the
        // background only once retained (all of it, once the pinner is idle); never otherwise.
        let whole = a.size.next_multiple_of(4096);
        let pinned_backup = a.host && a.backup == Some(BackupKind::Pinned);
        let locked = i.host_pinned_bytes;
        match mode {
            PinMode::Inline => prop_assert_eq!(
                locked,
                if pinned_backup { whole } else { 0 },
                "page-locked bytes of {:#x}",
                i.addr
            ),
            PinMode::Background => prop_assert!(
                locked == 0 || (pinned_backup && locked == whole),
                "page-locked bytes of {:#x}: {}",
                i.addr,
                locked
            ),
            PinMode::Never => prop_assert_eq!(locked, 0),
        }
        pinned += locked;
        let (first, last) = (i.addr, i.addr + i.mapped - 1);
        match a.state {
            State::Active => {
                prop_assert!(sim.is_accessible(first) && sim.is_accessible(last));
                let mut b = vec![0u8; a.size as usize];
                let has = e
                    .copy_cpu_backup(i.addr, &mut b)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let offered = a.valid && !a.disk();
                prop_assert_eq!(has, offered, "retained snapshot of active {:#x}", i.addr);
                if let Some(want) = &a.contents {
                    let got = read_raw(sim, i.addr, a.size as usize);
                    prop_assert!(&got == want, "contents of active {:#x}", i.addr);
                }
            }
            State::Paused => {
                prop_assert!(!sim.is_accessible(first) && !sim.is_accessible(last));
                let mut b = vec![0u8; a.size as usize];
                let has = e
                    .copy_cpu_backup(i.addr, &mut b)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(has, a.backup.is_some() && !a.disk());
                if let (true, Some(want)) = (has, &a.contents) {
                    prop_assert!(&b == want, "backup of paused {:#x}", i.addr);
                }
            }
            s => prop_assert!(false, "{:#x} left {:?} after the call returned", i.addr, s),
        }
    }
    for d in 0..2 {
        prop_assert_eq!(sim.live_bytes(d), m.live(d), "live bytes of device {}", d);
    }
    let active = m.selected(None, State::Active).len();
    let handles: usize = e.allocations().iter().map(|i| i.handles).sum();
    prop_assert!(
        handles >= active,
        "at least one handle per active allocation"
    );
    prop_assert_eq!(sim.live_mappings(), handles, "mappings");
    prop_assert_eq!(sim.live_handles(), handles, "handles");
    prop_assert_eq!(sim.live_reservations(), m.allocs.len(), "reservations");
    prop_assert_eq!(
        sim.pinned_bytes(),
        pinned + e.staging_bytes(),
        "pinned bytes"
    );
    prop_assert_eq!(
        sim.pageable_copies(),
        0,
        "every copy of a backup uses page-locked memory"
    );
    prop_assert_eq!(
        sim.queued_copies(),
        0,
        "nothing left queued after an operation"
    );
    Ok(())
}

proptest! {
    // 128 cases of up to 50 operations each: well under a few seconds in a debug build.
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_matches_the_model(
        ops in prop::collection::vec(op_strategy(), 1..=50),
        cfg in copy_config_strategy(),
        segment in prop_oneof![Just(G), Just(2 * G), Just(1u64 << 30)],
    ) {
        let sim = Arc::new(
            SimDriver::new(SimConfig { devices: 2, capacity: CAPACITY, granularity: G }).unwrap(),
        );
        let mut m = Model::default();
        let dir = tempfile::tempdir().unwrap();
        {
            let e = Engine::new(sim.clone());
            e.set_copy_config(cfg).unwrap();
            e.set_disk_backup_dir(Some(dir.path().to_path_buf())).unwrap();
            e.set_segment_bytes(segment).unwrap();
            for (n, op) in ops.iter().enumerate() {
                step(&sim, &e, &mut m, op)
                    .map_err(|err| TestCaseError::fail(format!("step {n} {op:?}: {err}")))?;
                check(&sim, &e, &m)
                    .map_err(|err| TestCaseError::fail(format!("after step {n} {op:?}: {err}")))?;
            }
        }
        // Dropping the engine frees everything it holds.
        prop_assert_eq!(
            (sim.live_bytes(0), sim.live_bytes(1), sim.live_handles(), sim.live_mappings()),
            (0, 0, 0, 0)
        );
        prop_assert_eq!((sim.live_reservations(), sim.pinned_bytes()), (0, 0));
        prop_assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "files removed");
    }
}

/// The driver contract (driver/mod.rs, `Driver::granularity`): "sizes and addresses are
/// multiples of it". cuMemAddressReserve with alignment 0 aligns to the granularity; the sim
/// must too, or engine code that relies on alignment is never tested.
#[test]
fn allocation_addresses_are_multiples_of_the_granularity() {
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            devices: 1,
            capacity: CAPACITY,
            granularity: G,
        })
        .unwrap(),
    );
    let e = Engine::new(sim.clone());
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
        .filter(|p| *p % G != 0)
        .map(|p| format!("{p:#x}"))
        .collect();
    assert!(
        misaligned.is_empty(),
        "addresses not multiples of the granularity {G:#x}: {misaligned:?}"
    );
}
