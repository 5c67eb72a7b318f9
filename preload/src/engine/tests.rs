//! Engine unit tests that need the simulated device's fault injection. The engine's other
//! tests, which run on the sim or a GPU, are in `preload/tests/basics.rs` and its neighbours.

use std::sync::Arc;

use super::*;
use crate::driver::sim::{Prim, SimConfig, SimDriver};
use crate::driver::{DevPtr, Driver};
use crate::engine::stats::TagStats;
use crate::error::Changed;
use crate::test_data::pattern;

const G: u64 = 2 << 20;

fn setup(capacity: u64) -> (Arc<SimDriver>, Engine) {
    let sim = Arc::new(
        SimDriver::new(SimConfig {
            devices: 2,
            capacity,
            granularity: G,
        })
        .unwrap(),
    );
    let engine = Engine::new(sim.clone());
    (sim, engine)
}

fn req(size: u64, tag: &str, backup: Backup) -> AllocRequest {
    AllocRequest::new(size, tag, backup)
}

fn fill(sim: &SimDriver, ptr: DevPtr, data: &[u8]) {
    let s = sim.stream(0).unwrap();
    // SAFETY: tests pass active allocations at least data.len() long; data outlives the sync.
    unsafe {
        sim.copy_h2d(ptr, data.as_ptr(), data.len() as u64, s)
            .unwrap()
    }
    sim.stream_sync(s).unwrap();
}

fn read(sim: &SimDriver, ptr: DevPtr, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let s = sim.stream(0).unwrap();
    // SAFETY: as in fill.
    unsafe { sim.copy_d2h(v.as_mut_ptr(), ptr, len as u64, s).unwrap() }
    sim.stream_sync(s).unwrap();
    v
}

/// A byte copy that fails (its wait, or a later piece) returns only once nothing it queued is
/// left: the caller's memory is its own again, and no later synchronization writes into it or
/// reads from it.
#[test]
fn failed_byte_copies_leave_nothing_queued_on_the_callers_memory() {
    let (sim, e) = setup(64 * G);
    let p = e.alloc(&req(2 * G, "t", Backup::None)).unwrap();
    let data = pattern(2 * G as usize, 3);
    fill(&sim, p, &data);
    // The wait fails once.
    sim.arm_fault(Prim::StreamSync, 1, 999);
    let mut out = vec![0u8; data.len()];
    let err = e.read_bytes(p, &mut out).unwrap_err();
    assert!(err.to_string().contains("cuStreamSynchronize"), "{err}");
    assert_eq!(sim.queued_copies(), 0, "a read left its copy queued");
    // A later piece fails to queue, and the first wait after it fails too.
    sim.arm_fault(Prim::CopyH2D, 2, 999);
    sim.arm_fault(Prim::StreamSync, 1, 999);
    let err = e.write_bytes_in(p, &data, G as usize).unwrap_err();
    assert!(err.to_string().contains("cuMemcpyHtoDAsync"), "{err}");
    assert_eq!(
        sim.queued_copies(),
        0,
        "a write left its first piece queued"
    );
    assert_eq!(sim.pending_faults(), 0);
    e.read_bytes(p, &mut out).unwrap();
    assert!(out == data);
}

/// The staged copies (the C ABI's): even when every wait fails, what stays queued uses the
/// engine's own buffer, never the caller's memory.
#[test]
fn staged_byte_copies_never_leave_the_callers_memory_queued() {
    let (sim, e) = setup(64 * G);
    let p = e.alloc(&req(2 * G, "t", Backup::None)).unwrap();
    let data = pattern(2 * G as usize, 5);
    fill(&sim, p, &data);
    let fail_every_wait = || {
        for prim in [Prim::StreamSync, Prim::Synchronize] {
            for _ in 0..8 {
                sim.arm_fault(prim, 1, 999);
            }
        }
    };
    fail_every_wait();
    let mut out = vec![0u8; data.len()];
    let err = e.read_bytes_staged(p, &mut out).unwrap_err();
    assert!(err.to_string().contains("may still be queued"), "{err}");
    sim.clear_faults();
    // The caller reuses its memory; the queued copy runs at the next synchronization.
    out.fill(0xAA);
    sim.synchronize(0).unwrap();
    assert!(
        out.iter().all(|b| *b == 0xAA),
        "a late copy wrote into the caller's memory"
    );
    // And a write: the device gets what was asked for, never what the caller wrote later.
    let mut src = pattern(2 * G as usize, 6);
    fail_every_wait();
    let err = e.write_bytes_staged(p, &src).unwrap_err();
    assert!(err.to_string().contains("may still be queued"), "{err}");
    sim.clear_faults();
    let asked = src.clone();
    src.fill(0x55);
    sim.synchronize(0).unwrap();
    assert!(read(&sim, p, src.len()) == asked);
    // Working waits: both copy whole.
    e.write_bytes_staged(p, &data).unwrap();
    e.read_bytes_staged(p, &mut out).unwrap();
    assert!(out == data);
}

/// tms-bench's probe of the pause's device side counts every piece, refuses what it cannot
/// do with a clear error, and returns a failed copy's error only once nothing it queued is left
/// (its slots are freed when it returns).
#[test]
fn the_copy_probe_counts_its_pieces_and_fails_cleanly() {
    let (sim, e) = setup(64 * G);
    let p = e.alloc(&req(40 * G, "t", Backup::None)).unwrap();
    let r = e.probe_d2h_lanes(p, 40 * G, G / 2, 3, false).unwrap();
    // 80 MiB in two 64 MiB units, so that two of the three threads copy.
    assert_eq!(r.pieces, 80);
    assert!(r.seconds > 0.0);
    let r = e.probe_d2h_lanes(p, 40 * G + 1, G, 1, false).unwrap_err();
    assert!(r.to_string().contains(&format!("range {p:#x}")), "{r}");
    let r = e.probe_d2h_lanes(p, 40 * G, 0, 2, false).unwrap_err();
    assert!(r.to_string().contains("piece size"), "{r}");
    // The simulated device has no per-thread streams.
    let r = e.probe_d2h_lanes(p, 40 * G, G, 2, true).unwrap_err();
    assert!(r.to_string().contains("per-thread streams"), "{r}");
    sim.arm_fault(Prim::CopyD2H, 3, 1);
    let r = e.probe_d2h_lanes(p, 40 * G, G, 2, false).unwrap_err();
    assert!(r.to_string().contains("cuMemcpy"), "{r}");
    sim.clear_faults();
    // Paused memory is refused.
    e.pause(Some("t")).unwrap();
    let r = e.probe_d2h_lanes(p, 40 * G, G, 2, false).unwrap_err();
    assert!(r.to_string().contains("paused"), "{r}");
}

/// Communicators that count their suspends and resumes, with registrations given by the test.
#[derive(Default)]
struct FakeComms {
    regs: parking_lot::Mutex<Vec<Registration>>,
    suspended: std::sync::atomic::AtomicBool,
    fail: std::sync::atomic::AtomicBool,
    calls: std::sync::atomic::AtomicUsize,
}

impl Comms for FakeComms {
    fn seen(&self) -> bool {
        true
    }
    fn unsupported(&self) -> Option<String> {
        None
    }
    fn registrations(&self) -> Vec<Registration> {
        self.regs.lock().clone()
    }
    fn suspend(&self, _: &dyn Driver) -> crate::error::Result<CommsDone> {
        use std::sync::atomic::Ordering::SeqCst;
        self.calls.fetch_add(1, SeqCst);
        if self.fail.load(SeqCst) {
            // All or none, as the real ones: a refusal left none suspended.
            return Err(crate::error::Error::invalid_state("refused by the test").unchanged());
        }
        let n = usize::from(!self.suspended.swap(true, SeqCst));
        Ok(CommsDone {
            communicators: n,
            bytes: 100 * n as u64,
        })
    }
    fn resume(&self, _: &dyn Driver) -> crate::error::Result<CommsDone> {
        use std::sync::atomic::Ordering::SeqCst;
        self.calls.fetch_add(1, SeqCst);
        let n = usize::from(self.suspended.swap(false, SeqCst));
        Ok(CommsDone {
            communicators: n,
            bytes: 100 * n as u64,
        })
    }
    fn stats(&self, _: &dyn Driver) -> Option<CommStats> {
        let s = self.suspended.load(std::sync::atomic::Ordering::SeqCst);
        Some(CommStats {
            communicators: 1,
            suspended: usize::from(s),
            suspendable_bytes: 100,
            suspended_bytes: if s { 100 } else { 0 },
            total_bytes: 110,
            ..Default::default()
        })
    }
}

fn with_fake_comms() -> (Arc<Engine>, Arc<FakeComms>) {
    let (_, e) = setup(64 * G);
    let c = Arc::new(FakeComms::default());
    (Arc::new(e.with_comms(c.clone())), c)
}

fn nccl_stats(e: &Engine) -> TagStats {
    e.stats()
        .tags
        .into_iter()
        .find(|t| t.tag == NCCL_TAG)
        .expect("an entry for the tag")
}

/// The reserved tag suspends and resumes the communicators, and only it (unless asked): other
/// tags and every tag leave them; the stats show them as the tag's entry.
#[test]
fn the_reserved_tag_suspends_the_communicators_and_every_tag_only_when_asked() {
    use std::sync::atomic::Ordering::SeqCst;
    let (e, c) = with_fake_comms();
    let p = e.alloc(&req(G, "kv", Backup::None)).unwrap();
    assert!(e.tag_known(NCCL_TAG));
    let r = e.pause(None).unwrap();
    assert_eq!((r.allocations, r.communicators), (1, 0));
    assert_eq!(c.calls.load(SeqCst), 0, "every tag leaves them by default");
    e.resume(None).unwrap();
    let r = e.pause(Some(NCCL_TAG)).unwrap();
    assert_eq!((r.allocations, r.communicators, r.bytes), (0, 1, 100));
    assert_eq!(e.allocations()[0].state, State::Active, "memory untouched");
    let t = nccl_stats(&e);
    assert_eq!((t.allocations, t.paused_allocations), (1, 1));
    assert_eq!((t.bytes_paused, t.bytes_active), (100, 10));
    assert_eq!(t.last_pause.unwrap().bytes, 100);
    assert_eq!(t.nccl.as_ref().unwrap().registered_policy, "keep");
    e.resume(Some(NCCL_TAG)).unwrap();
    // With the setting: after the memory on pause, before it on resume.
    e.set_nccl_in_all(true);
    let r = e.pause(None).unwrap();
    assert_eq!((r.allocations, r.communicators, r.bytes), (1, 1, G + 100));
    let r = e.resume(None).unwrap();
    assert_eq!((r.allocations, r.communicators), (1, 1));
    // A failure of the communicators' step after the memory paused says so.
    c.fail.store(true, SeqCst);
    let err = e.pause(None).unwrap_err();
    // The memory stays paused, the communicators as they were: what the error says.
    let paused = Changed {
        allocations: 1,
        bytes: G,
        communicators: 0,
    };
    assert_eq!(err.changed(), Some(paused));
    let err = err.to_string();
    assert!(err.contains("refused by the test"), "{err}");
    assert!(err.contains("the allocations were paused"), "{err}");
    c.fail.store(false, SeqCst);
    let r = Engine::resume_nonblocking(e.clone(), None, &[], None).unwrap();
    assert_eq!(r.communicators, 0, "they were never suspended");
    e.wait_restored(None, None).unwrap();
    e.free(p).unwrap();
    // The tag is reserved.
    let err = e.alloc(&req(G, NCCL_TAG, Backup::None)).unwrap_err();
    assert!(err.to_string().contains("reserved"), "{err}");
}

/// A resume of every tag with the communicators resumes them first; when the memory then fails
/// (and undoes itself), its error says the communicators are what it left resumed.
#[test]
fn a_resume_of_every_tag_failing_after_the_communicators_says_they_were_resumed() {
    let (sim, e) = setup(64 * G);
    let c = Arc::new(FakeComms::default());
    let e = e.with_comms(c.clone());
    e.set_nccl_in_all(true);
    e.alloc(&req(G, "kv", Backup::None)).unwrap();
    e.pause(None).unwrap();
    sim.arm_fault(Prim::Create, 1, 999);
    let err = e.resume(None).unwrap_err();
    let resumed = Changed {
        allocations: 0,
        bytes: 100,
        communicators: 1,
    };
    assert_eq!(err.changed(), Some(resumed), "{err}");
    assert!(
        err.to_string().contains("communicators were resumed"),
        "{err}"
    );
    assert_eq!(e.allocations()[0].state, State::Paused);
    e.resume(None).unwrap();
}

/// An allocation holding a buffer NCCL registered stays mapped (keep), or the pause fails
/// before it changes anything, naming the buffer and both remedies (refuse); deregistered, it
/// pauses again.
#[test]
fn registered_buffers_are_kept_resident_or_refused() {
    let (e, c) = with_fake_comms();
    let reg = e.alloc(&req(2 * G, "kv", Backup::None)).unwrap();
    let other = e.alloc(&req(G, "kv", Backup::None)).unwrap();
    *c.regs.lock() = vec![Registration {
        addr: reg + 4096,
        len: 8192,
        how: "ncclCommRegister on communicator 0x1".into(),
    }];
    let state = |p| {
        e.allocations()
            .into_iter()
            .find(|a| a.addr == p)
            .unwrap()
            .state
    };
    let r = e.pause(Some("kv")).unwrap();
    assert_eq!(r.allocations, 1);
    assert_eq!((state(reg), state(other)), (State::Active, State::Paused));
    e.resume(Some("kv")).unwrap();

    e.set_registered_policy(Registered::Refuse);
    let err = e.pause(None).unwrap_err();
    assert_eq!(*err.kind(), crate::error::ErrorKind::InvalidState);
    assert_eq!(
        err.changed(),
        Some(Changed::NOTHING),
        "a refusal changes nothing"
    );
    let m = err.to_string();
    for want in [
        format!("allocation {reg:#x} ({} bytes, tag \"kv\")", 2 * G),
        format!(
            "{:#x}, 8192 bytes, ncclCommRegister on communicator 0x1",
            reg + 4096
        ),
        "ncclCommDeregister".to_string(),
        "TMS_NCCL_REGISTERED=keep".to_string(),
    ] {
        assert!(m.contains(&want), "{want:?} not in {m}");
    }
    assert_eq!(state(other), State::Active, "a refusal changes nothing");

    e.set_registered_policy(Registered::Keep);
    c.regs.lock().clear();
    assert_eq!(e.pause(Some("kv")).unwrap().allocations, 2);
}

/// The staging slots go with the last allocation that has a backup, also when that allocation
/// is freed while a transaction holds them: the free only tries the operations lock and leaves
/// them, and the transaction, once it let go, sees no backup left and drops them, whether it
/// ends or fails (dropped). Before, a failed one left them page-locked until the next pause or
/// resume, as did one whose own look came before the free.
#[test]
fn the_staging_slots_go_with_the_last_backup_freed_during_a_transaction() {
    for ends in [true, false] {
        let (sim, e) = setup(64 * G);
        e.set_retain_cpu_backup(true);
        let p = e
            .alloc(&req(4 * G, "t", Some(crate::backup::BackupKind::Pinned)))
            .unwrap();
        e.pause(Some("t")).unwrap();
        e.resume(Some("t")).unwrap();
        assert!(e.staging_bytes() > 0, "retained: the slots are kept");
        let held = e.staging_bytes();

        let pick = Pick::tag(Some("other"));
        let tx = txn::Txn::begin(&e.ops, &e.registry, Which::Pause, &pick, None).unwrap();
        assert!(e.free(p).unwrap());
        // (`staging_bytes` would wait for the operations lock.)
        assert!(
            sim.pinned_bytes() >= held,
            "the free left the slots to the transaction"
        );
        if ends {
            tx.end(txn::Slots::KeepIfUsed, Default::default(), |_, _| 0.0);
        } else {
            drop(tx);
        }
        assert_eq!(e.staging_bytes(), 0, "ended: {ends}");
        e.wait_released();
        assert_eq!(sim.pinned_bytes(), 0, "ended: {ends}");
    }
}

/// A non-blocking resume that failed after its caller returned, its failure not kept with the
/// allocations it left unrestored (so the tracker raises it: `Tracker::wait_for`): a wait for
/// them raises it for as long as the tracker is followed, and with it the failures kept for
/// what the wait concerns, which must not go unsaid (one whose data all landed is raised only
/// once).
#[test]
fn a_wait_raises_a_trackers_failure_with_the_failures_kept() {
    use super::restoring::Tracker;
    use crate::driver::Gate;
    use crate::error::Error;
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    let (_sim, e) = setup(64 * G);
    let word: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
    let t = Arc::new(Tracker::new(
        Gate::new(word, 0x1000),
        "resume of tag 'a'".into(),
    ));
    t.begin(vec![(0x10_0000, 4096, 4096, 1)], 1, None);
    t.device_mapped(); // the caller may have returned: the data is promised
    t.finish(Err(Error::internal("injected: the restore".to_string())));
    e.restores.track(t);
    let landed = Error::internal("kept: an earlier restore".to_string());
    e.restores.keep_failure(&landed, std::iter::empty());
    let err = e.wait_restored(None, None).unwrap_err().to_string();
    assert!(err.contains("injected"), "{err}");
    assert!(
        err.contains("and: ") && err.contains("kept: an earlier"),
        "{err}"
    );
    for _ in 0..2 {
        let err = e.wait_restored(Some(0x10_0800), Some(Duration::ZERO));
        let err = err.unwrap_err().to_string();
        assert!(err.contains("injected") && !err.contains("kept"), "{err}");
    }
    assert!(
        e.wait_restored(Some(0x30_0000), None).unwrap(),
        "not one of its allocations"
    );
}
