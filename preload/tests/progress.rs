//! The progress of a running pause or resume, seen from another thread while it runs: bytes
//! done of the total, what it is doing, where the copies go, its thread; and the report's split
//! of the copied bytes between host memory and disk. On the simulated device the link has a
//! bandwidth, so that the copies take time; on a GPU (`common::harness`) the allocation is large
//! enough to take time.

mod common;

use std::time::{Duration, Instant};

use common::{engine_test, pattern, Harness, Setup};
use tms::backup::BackupKind;
use tms::engine::{AllocRequest, Engine, Phase, Pick, Progress, Which};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;
/// On a GPU: about a tenth of a second of copies each way at link speed, more to disk.
const GPU_SIZE: u64 = 1 << 30;

/// The size of the allocation to watch; on the sim and the HIP double, the link's bandwidth set
/// to `bandwidth`.
fn watched(h: &Harness, bandwidth: u64) -> u64 {
    if let Some(sim) = h.sim() {
        sim.set_bandwidth(Some(bandwidth));
    }
    if let Some(hip) = h.hip() {
        hip.set_bandwidth(bandwidth);
    }
    h.pick(SIZE, GPU_SIZE)
}

/// Run `op` on a thread of its own and poll the engine's progress until it ends: the
/// snapshots seen, the thread's id, and what `op` returned.
fn watch<T: Send>(h: &Harness, op: impl FnOnce() -> T + Send) -> (Vec<Progress>, u64, T) {
    let e: &Engine = &h.e;
    let patience = Duration::from_secs(h.pick(30, 300));
    let mut seen = Vec::new();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let h = s.spawn(move || {
            tx.send(nix::unistd::gettid().as_raw() as u64).unwrap();
            op()
        });
        let tid = rx.recv().unwrap();
        let deadline = Instant::now() + patience;
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

engine_test! {
    fn a_pause_to_disk_and_its_resume_report_their_progress_while_they_run(h)
        [Setup::disk_engine(1, 2)]
    {
        // 16 MiB over a 64 MiB/s link: a quarter of a second each way; on a GPU, enough to watch.
        let (e, size) = (&h.e, watched(&h, 64 * MIB));
        let p = e
            .alloc(&AllocRequest {
                size,
                device: 0,
                tag: "opt".into(),
                backup: Some(BackupKind::Disk),
                chunk: 0,
            })
            .unwrap();
        let data = pattern(size as usize, 3);
        h.write(p, &data);
        assert!(e.progress().is_none(), "nothing runs");

        let t = Instant::now();
        let (seen, tid, r) = watch(&h, || e.pause(Some("opt")));
        let r = r.unwrap();
        if h.sim().is_some() {
            assert!(
                t.elapsed() >= Duration::from_millis(200),
                "{:?}",
                t.elapsed()
            );
        }
        assert!(e.progress().is_none(), "cleared when it ended");
        assert_eq!((r.copied, r.disk_copied), (size, size), "{r:?}");
        let mid = midway(&seen);
        assert!(mid.len() >= 3, "too few snapshots while copying: {seen:?}");
        for s in &mid {
            assert_eq!(s.which, Which::Pause);
            assert_eq!(s.tag.as_deref(), Some("opt"));
            assert_eq!(s.bytes_total, size);
            assert_eq!(s.phase, Phase::WritingToDisk, "{s:?}");
            assert!(s.backing.disk && !s.backing.host, "{s:?}");
            assert_eq!(s.thread, tid, "the thread that runs it");
            assert_eq!(s.label, None);
            assert!(s.copy_seconds > 0.0 && s.rate() > 0.0, "{s:?}");
        }
        // The bytes only go up.
        assert!(seen.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done));

        let (seen, _, r) = watch(&h, || e.resume(Some("opt")));
        let r = r.unwrap();
        assert_eq!((r.copied, r.disk_copied), (size, size), "{r:?}");
        let mid = midway(&seen);
        assert!(mid.len() >= 3, "too few snapshots while copying: {seen:?}");
        for s in &mid {
            assert_eq!(s.which, Which::Resume);
            assert_eq!(s.phase, Phase::ReadingFromDisk, "{s:?}");
            assert!(s.backing.disk && !s.backing.host, "{s:?}");
        }
        assert!(h.read(p, size as usize) == data, "contents after the resume");
    }
}

engine_test! {
    fn host_backups_report_copies_to_and_from_host_memory(h)
        [Setup::disk_engine(1, 2)]
    {
        let (e, size) = (&h.e, watched(&h, 64 * MIB));
        let p = e
            .alloc(&AllocRequest {
                size,
                device: 0,
                tag: "kv".into(),
                backup: Some(BackupKind::Pinned),
                chunk: 0,
            })
            .unwrap();
        let data = pattern(size as usize, 5);
        h.write(p, &data);
        // A label is reported with the operation (the control server numbers its requests so).
        let (seen, _, r) = watch(&h, || {
            e.pause_pick(&Pick {
                label: Some(41),
                ..Pick::tag(Some("kv"))
            })
        });
        let r = r.unwrap();
        assert_eq!((r.copied, r.disk_copied), (size, 0), "{r:?}");
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
        let (seen, _, r) = watch(&h, || e.resume(None));
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
        assert!(h.read(p, size as usize) == data, "contents after the resume");
    }
}

engine_test! {
    fn a_pause_without_backups_copies_nothing_and_reports_so(h)
        [Setup::disk_engine(1, 2)]
    {
        let (e, size) = (&h.e, watched(&h, 64 * MIB));
        e.alloc(&AllocRequest {
            size,
            device: 0,
            tag: "scratch".into(),
            backup: None,
            chunk: 0,
        })
        .unwrap();
        let r = e.pause(None).unwrap();
        assert_eq!((r.copied, r.disk_copied, r.bytes), (0, 0, size));
        assert!(e.progress().is_none());
    }
}

engine_test! {
    sim_only fn the_link_bandwidth_of_the_simulated_device_bounds_copies(h)
        [Setup::disk_engine(1, 2)]
    {
        let (sim, e) = (h.simulated(), &h.e);
        sim.set_bandwidth(Some(32 * MIB));
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
}
