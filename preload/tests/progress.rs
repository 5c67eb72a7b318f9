//! The progress of a running pause or resume, seen from another thread while it runs (on a
//! simulated device whose link has a bandwidth, so that the copies take time): bytes done of
//! the total, what it is doing, where the copies go, its thread; and the report's split of the
//! copied bytes between host memory and disk.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{pattern, read_raw, write_raw};
use tms::backup::BackupKind;
use tms::driver::sim::SimDriver;
use tms::engine::{AllocRequest, Engine, Phase, Pick, Progress, Which};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

fn engine(bandwidth: u64) -> (Arc<SimDriver>, Engine, tempfile::TempDir) {
    let (sim, e, dir) = common::disk_engine(1, 2);
    sim.set_bandwidth(Some(bandwidth));
    (sim, e, dir)
}

/// Run `op` on a thread of its own and poll the engine's progress until it ends: the
/// snapshots seen, the thread's id, and what `op` returned.
fn watch<T: Send>(e: &Engine, op: impl FnOnce() -> T + Send) -> (Vec<Progress>, u64, T) {
    let mut seen = Vec::new();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let h = s.spawn(move || {
            tx.send(nix::unistd::gettid().as_raw() as u64).unwrap();
            op()
        });
        let tid = rx.recv().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !h.is_finished() {
            assert!(Instant::now() < deadline, "the operation did not end");
            if let Some(p) = e.progress() {
                seen.push(p);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        (seen, tid, h.join().unwrap())
    })
}

/// The snapshots taken while bytes were moving: some copied, not all.
fn midway(seen: &[Progress]) -> Vec<&Progress> {
    seen.iter()
        .filter(|p| p.bytes_done > 0 && p.bytes_done < p.bytes_total)
        .collect()
}

#[test]
fn a_pause_to_disk_and_its_resume_report_their_progress_while_they_run() {
    // 16 MiB over a 64 MiB/s link: a quarter of a second each way.
    let (sim, e, _dir) = engine(64 * MIB);
    let p = e
        .alloc(&AllocRequest {
            size: SIZE,
            device: 0,
            tag: "opt".into(),
            backup: Some(BackupKind::Disk),
            chunk: 0,
        })
        .unwrap();
    let data = pattern(SIZE as usize, 3);
    write_raw(&sim, p, &data);
    assert!(e.progress().is_none(), "nothing runs");

    let t = Instant::now();
    let (seen, tid, r) = watch(&e, || e.pause(Some("opt")));
    let r = r.unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    assert!(e.progress().is_none(), "cleared when it ended");
    assert_eq!((r.copied, r.disk_copied), (SIZE, SIZE), "{r:?}");
    let mid = midway(&seen);
    assert!(mid.len() >= 3, "too few snapshots while copying: {seen:?}");
    for s in &mid {
        assert_eq!(s.which, Which::Pause);
        assert_eq!(s.tag.as_deref(), Some("opt"));
        assert_eq!(s.bytes_total, SIZE);
        assert_eq!(s.phase, Phase::WritingToDisk, "{s:?}");
        assert!(s.backing.disk && !s.backing.host, "{s:?}");
        assert_eq!(s.thread, tid, "the thread that runs it");
        assert_eq!(s.label, None);
        assert!(s.copy_seconds > 0.0 && s.rate() > 0.0, "{s:?}");
    }
    // The bytes only go up.
    assert!(seen.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done));

    let (seen, _, r) = watch(&e, || e.resume(Some("opt")));
    let r = r.unwrap();
    assert_eq!((r.copied, r.disk_copied), (SIZE, SIZE), "{r:?}");
    let mid = midway(&seen);
    assert!(mid.len() >= 3, "too few snapshots while copying: {seen:?}");
    for s in &mid {
        assert_eq!(s.which, Which::Resume);
        assert_eq!(s.phase, Phase::ReadingFromDisk, "{s:?}");
        assert!(s.backing.disk && !s.backing.host, "{s:?}");
    }
    assert_eq!(read_raw(&sim, p, SIZE as usize), data);
}

#[test]
fn host_backups_report_copies_to_and_from_host_memory() {
    let (sim, e, _dir) = engine(64 * MIB);
    let p = e
        .alloc(&AllocRequest {
            size: SIZE,
            device: 0,
            tag: "kv".into(),
            backup: Some(BackupKind::Pinned),
            chunk: 0,
        })
        .unwrap();
    let data = pattern(SIZE as usize, 5);
    write_raw(&sim, p, &data);
    // A label is reported with the operation (the control server numbers its requests so).
    let (seen, _, r) = watch(&e, || {
        e.pause_pick(&Pick {
            label: Some(41),
            ..Pick::tag(Some("kv"))
        })
    });
    let r = r.unwrap();
    assert_eq!((r.copied, r.disk_copied), (SIZE, 0), "{r:?}");
    let mid = midway(&seen);
    assert!(mid.len() >= 3, "{seen:?}");
    for s in &mid {
        assert_eq!(
            (s.phase, s.label),
            (Phase::CopyingToHost, Some(41)),
            "{s:?}"
        );
        assert!(s.backing.host && !s.backing.disk, "{s:?}");
    }
    let (seen, _, r) = watch(&e, || e.resume(None));
    assert_eq!(r.unwrap().disk_copied, 0);
    let mid = midway(&seen);
    assert!(mid.len() >= 3, "{seen:?}");
    for s in &mid {
        assert_eq!(
            (s.phase, s.tag.as_deref()),
            (Phase::CopyingToDevice, None),
            "{s:?}"
        );
    }
    assert_eq!(read_raw(&sim, p, SIZE as usize), data);
}

#[test]
fn a_pause_without_backups_copies_nothing_and_reports_so() {
    let (_sim, e, _dir) = engine(64 * MIB);
    e.alloc(&AllocRequest {
        size: SIZE,
        device: 0,
        tag: "scratch".into(),
        backup: None,
        chunk: 0,
    })
    .unwrap();
    let r = e.pause(None).unwrap();
    assert_eq!((r.copied, r.disk_copied, r.bytes), (0, 0, SIZE));
    assert!(e.progress().is_none());
}

#[test]
fn the_link_bandwidth_of_the_simulated_device_bounds_copies() {
    let (sim, e, _dir) = engine(32 * MIB);
    let p = e
        .alloc(&AllocRequest {
            size: 8 * MIB,
            device: 0,
            tag: "t".into(),
            backup: None,
            chunk: 0,
        })
        .unwrap();
    let t = Instant::now();
    e.write_bytes(p, &pattern(8 * MIB as usize, 1)).unwrap();
    let took = t.elapsed();
    // 8 MiB at 32 MiB/s: a quarter of a second, however the copy is cut.
    assert!(took >= Duration::from_millis(240), "{took:?}");
    sim.set_bandwidth(None);
    let t = Instant::now();
    e.write_bytes(p, &pattern(8 * MIB as usize, 2)).unwrap();
    assert!(
        t.elapsed() < took,
        "no bandwidth: as fast as the host copies"
    );
}
