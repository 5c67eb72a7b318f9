//! Disk backups, on the simulated device or a GPU (`common::harness`): contents round-trip
//! bit-identical through files that are reused across cycles and removed on free; files of dead
//! processes are swept, live ones never; a file changed on disk while paused is refused; nothing
//! is lost when the disk fails.

mod common;

use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::{bounded, engine_test, pattern, wait_until, Harness, Setup};
use tms::backup::disk::{self, DiskOp};
use tms::backup::BackupKind;
use tms::driver::sim::Prim;
use tms::engine::{AllocRequest, State};

const MIB: u64 = 1 << 20;

/// Long enough for any call here on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(20);

/// The harness of [`Setup::disk_engine`]: two devices (as many as a GPU machine has), three
/// copy workers, small pieces, and a backup folder of the test's own.
struct Fx {
    h: Harness,
}

impl Fx {
    fn alloc(&self, size: u64, device: i32, seed: u64) -> (u64, Vec<u8>) {
        let p = self
            .h
            .e
            .alloc(&AllocRequest {
                size,
                device: self.h.device(device),
                tag: "opt".into(),
                backup: Some(BackupKind::Disk),
                chunk: 0,
            })
            .unwrap();
        let data = pattern(size as usize, seed);
        self.h.write(p, &data);
        (p, data)
    }

    fn files(&self) -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(self.h.dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    }
}

engine_test! {
    fn contents_round_trip_through_files_reused_across_cycles(h) [Setup::disk_engine(2, 3)] {
        let f = Fx { h };
        let a = f.alloc(5 * MIB + 123, 0, 1);
        let b = f.alloc(3 * MIB, 1, 2);
        let r = f.h.e.pause(None).unwrap();
        assert_eq!((r.allocations, r.copied), (2, 8 * MIB + 123));
        for d in 0..f.h.devices() {
            f.h.assert_live_bytes(d, 0, "paused");
        }
        let files = f.files();
        assert_eq!(files.len(), 2);
        let stats = f.h.e.stats();
        assert_eq!(stats.tags[0].disk_backup_bytes, 6 * MIB + 4 * MIB);
        assert_eq!(stats.tags[0].host_backup_bytes, 0);
        for cycle in 0..3u64 {
            f.h.e.resume(None).unwrap();
            for (p, d) in [&a, &b] {
                assert!(f.h.read(*p, d.len()) == *d, "cycle {cycle}: {p:#x}");
            }
            assert_eq!(f.files(), files, "the same files, reused");
            f.h.e.pause(None).unwrap();
        }
        f.h.e.resume(None).unwrap();
        // Not CPU backups: none is offered as one.
        let mut buf = vec![0u8; 16];
        assert!(!f.h.e.copy_cpu_backup(a.0, &mut buf).unwrap());
        assert!(f.h.e.free(a.0).unwrap());
        assert_eq!(f.files().len(), 1, "a freed allocation's file goes");
        let ended = f.h.end();
        assert_eq!(ended.files(), 0, "and every file with the engine");
    }
}

engine_test! {
    fn a_file_changed_while_paused_is_refused_and_the_tag_stays_paused(h)
        [Setup::disk_engine(2, 3)]
    {
        let f = Fx { h };
        let (p, data) = f.alloc(4 * MIB, 0, 3);
        f.h.e.pause(None).unwrap();
        let path = f.files().remove(0);
        // Overwrite one byte in the middle of the third chunk.
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let old = {
            let mut b = [0u8; 1];
            std::fs::File::open(&path)
                .unwrap()
                .read_exact_at(&mut b, 2 * MIB + 77)
                .unwrap();
            b[0]
        };
        file.write_all_at(&[old ^ 0xff], 2 * MIB + 77).unwrap();
        let err = f.h.e.resume(None).unwrap_err().to_string();
        assert!(
            err.contains("changed on disk") && err.contains(&*path.to_string_lossy()),
            "{err}"
        );
        assert!(err.contains("stays paused"), "{err}");
        assert_eq!(f.h.e.allocations()[0].state, State::Paused);
        f.h.assert_live_bytes(0, 0, "the resume was undone");
        // Put the byte back: the resume now restores every byte.
        file.write_all_at(&[old], 2 * MIB + 77).unwrap();
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);

        // Cut short: refused before anything is mapped.
        f.h.e.pause(None).unwrap();
        file.set_len(MIB).unwrap();
        let err = f.h.e.resume(None).unwrap_err().to_string();
        assert!(
            err.contains("changed on disk") && err.contains("stays paused"),
            "{err}"
        );
        assert_eq!(f.h.e.allocations()[0].state, State::Paused);
    }
}

engine_test! {
    /// A file cut short while the resume reads it (its length was whole at the check before
    /// anything is mapped), at a length no O_DIRECT read ends on: reading on from that end is
    /// refused as unaligned (EINVAL) before Linux 5.10, injected here, where newer kernels
    /// find the end. The resume fails saying the file was cut short, and the allocation stays
    /// paused with its file.
    sim_only fn a_file_cut_short_while_the_resume_reads_it_is_told_and_stays_paused(h)
        [Setup::disk_engine(1, 1)]
    {
        let f = Fx { h };
        let (p, _) = f.alloc(4 * MIB, 0, 6);
        f.h.e.pause(None).unwrap();
        let path = f.files().remove(0);
        let dir = f.h.dir().to_path_buf();
        let sim = f.h.simulated().clone();
        // The one worker reads its first slot (256 KiB), then waits to copy it to the device.
        sim.hold(Prim::CopyH2D, None);
        let resumer = {
            let e = f.h.e.clone();
            std::thread::spawn(move || e.resume(None))
        };
        wait_until("the resume reads the file", PATIENCE, || sim.held_calls() > 0);
        let cut = 256 * 1024 + 123;
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(cut).unwrap();
        disk::arm_fault(Some(&dir), DiskOp::Read, 1, libc::EINVAL);
        sim.unhold(Prim::CopyH2D, None);
        let err = bounded("the resume", PATIENCE, move || resumer.join().unwrap())
            .unwrap_err()
            .to_string();
        assert_eq!(disk::pending_faults(Some(&dir)), 0);
        assert!(
            err.contains(&*path.to_string_lossy())
                && err.contains(&format!("is {cut} bytes, not {}", 4 * MIB))
                && err.contains("cut short")
                && err.contains("stays paused")
                && !err.contains("Invalid argument"),
            "{err}"
        );
        assert_eq!(f.h.e.allocations()[0].state, State::Paused);
        f.h.assert_live_bytes(0, 0, "the resume was undone");
        assert_eq!(f.files(), vec![path.clone()], "its file is kept");
        // Never silently restored: the next resume is refused at the check of the length.
        let err = f.h.e.resume(None).unwrap_err().to_string();
        assert!(err.contains(&format!("is {cut} bytes")), "{err}");
        assert!(f.h.e.free(p).unwrap());
        assert!(!path.exists());
    }
}

engine_test! {
    fn disk_faults_lose_nothing_and_a_retry_works(h) [Setup::disk_engine(2, 3)] {
        let f = Fx { h };
        let (p, data) = f.alloc(6 * MIB, 0, 4);
        let dir = f.h.dir();
        // A full disk part-way through the writes: the pause fails naming the file, and the
        // allocation is active with its contents.
        disk::arm_fault(Some(dir), DiskOp::Write, 5, libc::ENOSPC);
        let e = f.h.e.pause(None).unwrap_err();
        assert!(e.is_oom(), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("full") && msg.contains(&*dir.to_string_lossy()),
            "{msg}"
        );
        assert_eq!(f.h.e.allocations()[0].state, State::Active);
        assert!(f.h.read(p, data.len()) == data);
        // A read error on resume: still paused with its file; the retry restores it.
        f.h.e.pause(None).unwrap();
        disk::arm_fault(Some(dir), DiskOp::Read, 3, libc::EIO);
        let msg = f.h.e.resume(None).unwrap_err().to_string();
        assert!(
            msg.contains("stays paused") && msg.contains("reading"),
            "{msg}"
        );
        assert_eq!(f.h.e.allocations()[0].state, State::Paused);
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
        assert_eq!(disk::pending_faults(Some(dir)), 0);
    }
}

engine_test! {
    /// A file system without O_DIRECT (ramfs, tmpfs before Linux 6.6) refuses it at open after
    /// making the file: the pause used to fail on that leftover ("File exists") and leave it
    /// behind. Now it goes, and the file is made again to be written through the page cache.
    fn a_folder_without_o_direct_gets_its_files_through_the_page_cache(h)
        [Setup::disk_engine(2, 3)]
    {
        let f = Fx { h };
        let (p, data) = f.alloc(4 * MIB, 0, 9);
        let dir = f.h.dir();
        disk::arm_fault(Some(dir), DiskOp::Create, 1, libc::EINVAL);
        f.h.e.pause(None).unwrap();
        assert_eq!(disk::pending_faults(Some(dir)), 0, "the open was refused once");
        let names = names_in(dir);
        assert_eq!(names.len(), 1, "{names:?}");
        assert!(names[0].starts_with("tms-backup-"), "{names:?}");
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
        f.h.e.pause(None).unwrap();
        assert_eq!(names_in(dir), names, "the file is reused");
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
    }
}

engine_test! {
    fn a_directory_that_cannot_take_the_backups_fails_the_pause_before_anything_moves(h)
        [Setup::disk_engine(2, 3)]
    {
        let f = Fx { h };
        let (p, data) = f.alloc(4 * MIB, 0, 5);
        let gone = f.h.dir().join("replaced");
        f.h.e.set_disk_backup_dir(Some(gone.clone())).unwrap();
        // The folder replaced by a plain file: it can be neither used nor made again.
        std::fs::remove_dir(&gone).unwrap();
        std::fs::write(&gone, b"x").unwrap();
        let msg = f.h.e.pause(None).unwrap_err().to_string();
        assert!(
            msg.contains(&*gone.to_string_lossy()) && msg.contains("not a directory"),
            "{msg}"
        );
        assert_eq!(f.h.e.allocations()[0].state, State::Active);
        assert!(f.h.read(p, data.len()) == data);
        let under_a_file = gone.join("sub");
        let err =
            f.h.e.set_disk_backup_dir(Some(under_a_file))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("replaced/sub") && err.contains("not a directory"),
            "a folder that cannot be made is refused: {err}"
        );
        let err = f.h.e.set_disk_backup_dir(Some(gone)).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
    }
}

/// Mode bits of `p`.
fn mode(p: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

engine_test! {
    /// Issue 35, item 1: a folder that does not exist when the library starts (miles makes its
    /// per-rank folder later) is made when first needed, with mode 0700 for what we make;
    /// `set_disk_backup_dir` makes its folder at once.
    fn a_folder_missing_at_start_is_made_when_first_needed(h) [Setup::disk_engine(2, 3)] {
        let f = Fx { h };
        let later = f.h.dir().join("job");
        let rank = later.join("rank0");
        f.h.e.set_default_disk_backup_dir(Some(rank.clone())).unwrap();
        assert!(!later.exists(), "not made before it is needed");
        let (p, data) = f.alloc(3 * MIB, 0, 11);
        f.h.e.pause(None).unwrap();
        assert_eq!((mode(&later), mode(&rank)), (0o700, 0o700));
        assert_eq!(names_in(&rank).len(), 1);
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);

        let set = f.h.dir().join("set").join("here");
        f.h.e.set_disk_backup_dir(Some(set.clone())).unwrap();
        assert_eq!(mode(&set), 0o700, "made by set_disk_backup_dir");
        let (q, more) = f.alloc(MIB, 1, 12);
        f.h.e.pause(None).unwrap();
        assert_eq!(names_in(&set).len(), 1, "the new allocation's file");
        assert_eq!(names_in(&rank).len(), 1, "the older file stays where it was made");
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
        assert!(f.h.read(q, more.len()) == more);
    }
}

engine_test! {
    /// Issue 35, item 1: a folder wiped (and made again, or not) between two pauses is found
    /// again by its path; an allocation whose file went with it gets a new one there, and a
    /// folder swapped under the same path is used, not the one held before.
    fn a_folder_wiped_between_pauses_is_found_again_by_its_path(h) [Setup::disk_engine(2, 3)] {
        let f = Fx { h };
        let d = f.h.dir().join("rank0");
        std::fs::create_dir(&d).unwrap();
        f.h.e.set_disk_backup_dir(Some(d.clone())).unwrap();
        let (p, data) = f.alloc(4 * MIB, 0, 13);
        f.h.e.pause(None).unwrap();
        f.h.e.resume(None).unwrap();
        assert_eq!(names_in(&d).len(), 1, "the file is kept for the next pause");

        std::fs::remove_dir_all(&d).unwrap();
        std::fs::create_dir(&d).unwrap();
        f.h.e.pause(None).unwrap();
        assert_eq!(names_in(&d).len(), 1, "a new file in the new folder");
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);

        // Wiped and not made again: made again.
        std::fs::remove_dir_all(&d).unwrap();
        let (q, more) = f.alloc(2 * MIB, 1, 14);
        f.h.e.pause(None).unwrap();
        assert_eq!(names_in(&d).len(), 2);
        f.h.e.resume(None).unwrap();

        // Renamed away and replaced: the old folder keeps its file, the new one gets new ones.
        let old = f.h.dir().join("rank0.old");
        std::fs::rename(&d, &old).unwrap();
        std::fs::create_dir(&d).unwrap();
        let (r, third) = f.alloc(MIB, 0, 15);
        f.h.e.pause(None).unwrap();
        assert_eq!((names_in(&old).len(), names_in(&d).len()), (2, 1));
        f.h.e.resume(None).unwrap();
        for (a, bytes) in [(p, &data), (q, &more), (r, &third)] {
            assert!(f.h.read(a, bytes.len()) == *bytes, "{a:#x}");
        }
        f.h.e.free(p).unwrap();
        assert_eq!(names_in(&old).len(), 1, "a file goes from where it is");
    }
}

engine_test! {
    /// Issue 35, item 1: a folder wiped while paused loses nothing: the files are the process's,
    /// held open, and read back at resume; the next pause makes new files where the path leads.
    /// A chunked allocation with chunks still paused in its file keeps writing to that file.
    fn a_folder_wiped_while_paused_loses_nothing(h) [Setup::disk_engine(2, 3)] {
        let f = Fx { h };
        let d = f.h.dir().join("rank1");
        std::fs::create_dir(&d).unwrap();
        f.h.e.set_disk_backup_dir(Some(d.clone())).unwrap();
        let (p, data) = f.alloc(5 * MIB, 0, 16);
        let g = f.h.g();
        let c = f
            .h
            .e
            .alloc(&AllocRequest {
                size: 4 * g,
                device: f.h.device(1),
                tag: "kv".into(),
                backup: Some(BackupKind::Disk),
                chunk: g,
            })
            .unwrap();
        let kv = pattern((4 * g) as usize, 17);
        f.h.write(c, &kv);
        f.h.e.pause(Some("opt")).unwrap();
        f.h.e
            .pause_pick(&tms::engine::Pick::chunks(c, &[0, 1]))
            .unwrap();
        assert_eq!(names_in(&d).len(), 2);
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::create_dir(&d).unwrap();
        f.h.e.resume(Some("opt")).unwrap();
        assert!(f.h.read(p, data.len()) == data, "restored from the unnamed file");
        // Chunks 0 and 1 are still in the old file: chunk 2 joins them there.
        f.h.e
            .pause_pick(&tms::engine::Pick::chunks(c, &[2]))
            .unwrap();
        f.h.e.pause(Some("opt")).unwrap();
        assert_eq!(names_in(&d).len(), 1, "only opt's new file is in the new folder");
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
        assert!(f.h.read(c, kv.len()) == kv);
        // Everything active: kv's next pause makes its file in the new folder.
        f.h.e.pause(None).unwrap();
        assert_eq!(names_in(&d).len(), 2);
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(c, kv.len()) == kv);
    }
}

engine_test! {
    fn files_of_dead_processes_are_swept_and_live_ones_kept(h) [Setup::disk_engine(2, 3)] {
        let dir = tempfile::tempdir().unwrap();
        // A dead process's file: the library's name, nobody holding its lock.
        let dead = dir.path().join("tms-backup-4242-0-0.bin");
        std::fs::write(&dead, vec![0u8; 8192]).unwrap();
        // A live process's file: made by a child that holds it until told to go.
        let live = dir.path().join("tms-backup-4243-0-0.bin");
        let mut child = std::process::Command::new("flock")
            .arg(&live)
            .arg("-c")
            .arg("read _")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("flock(1) runs");
        let t0 = std::time::Instant::now();
        while !live.exists() {
            assert!(t0.elapsed().as_secs() < 10);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        let f = Fx { h };
        f.h.e.set_disk_backup_dir(Some(dir.path().to_path_buf()))
            .unwrap();
        let (p, data) = f.alloc(2 * MIB, 0, 6);
        f.h.e.pause(None).unwrap();
        assert!(!dead.exists(), "swept at first use");
        assert!(live.exists(), "a live process's file is never touched");
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
        drop(child.stdin.take());
        child.wait().unwrap();
    }
}

/// Pause every tag of `f` on another thread; its result, or `None` if it has not returned
/// within 20 s (it is then blocked for good: the thread is left behind).
fn pause_within_20s(f: Fx) -> (Option<Result<(), String>>, Option<Fx>) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = f.h.e.pause(None).map(|_| ()).map_err(|e| e.to_string());
        let _ = tx.send((r, f));
    });
    match rx.recv_timeout(std::time::Duration::from_secs(20)) {
        Ok((r, f)) => (Some(r), Some(f)),
        Err(_) => (None, None),
    }
}

fn names_in(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

engine_test! {
    /// Issue 23, item 1: a FIFO under a backup file's name (or under a temporary name older than a
    /// minute) used to block the sweep's `open` for ever, under the operation lock. Now the sweep
    /// opens only regular files of ours, without waiting, and leaves the rest alone.
    fn a_fifo_or_a_link_in_the_backup_folder_never_blocks_a_pause(h) [Setup::disk_engine(2, 3)] {
        let f = Fx { h };
        let d = f.h.dir().to_path_buf();
        let fifo = d.join("tms-backup-1-0-0.bin");
        let old_tmp_fifo = d.join(".tms-backup-new-2-0-0.bin");
        for p in [&fifo, &old_tmp_fifo] {
            nix::unistd::mkfifo(p, nix::sys::stat::Mode::S_IRWXU).unwrap();
        }
        let old = nix::sys::time::TimeSpec::new(1, 0);
        nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            &old_tmp_fifo,
            &old,
            &old,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
        // A link under our name to a file of ours elsewhere: neither followed nor removed.
        let victim = tempfile::NamedTempFile::new().unwrap();
        let link = d.join("tms-backup-3-0-0.bin");
        std::os::unix::fs::symlink(victim.path(), &link).unwrap();
        let (p, data) = f.alloc(2 * MIB, 0, 7);
        let (r, f) = pause_within_20s(f);
        let r = r.expect("the pause returned (it used to block for ever on the FIFO)");
        r.unwrap();
        let f = f.unwrap();
        for kept in [&fifo, &old_tmp_fifo, &link] {
            assert!(
                kept.symlink_metadata().is_ok(),
                "{} was removed",
                kept.display()
            );
        }
        assert!(victim.path().exists());
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
    }
}

engine_test! {
    /// Issue 23, item 1: in a folder others can write to (here mode 1777, as /tmp), files go in our
    /// subfolder of mode 0700; a subfolder under that name that is a link, or another user's, is
    /// refused with a message and the pause changes nothing.
    fn a_folder_others_can_write_to_gets_a_private_subfolder(h) [Setup::disk_engine(2, 3)] {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let f = Fx { h };
        let shared = f.h.dir().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        // Planted by "another user" before we came: never opened, since it is not in our folder.
        nix::unistd::mkfifo(
            &shared.join("tms-backup-9-0-0.bin"),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        f.h.e.set_disk_backup_dir(Some(shared.clone())).unwrap();
        let (p, data) = f.alloc(2 * MIB, 0, 8);
        let (r, f) = pause_within_20s(f);
        r.expect("the pause returned").unwrap();
        let f = f.unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let sub = shared.join(disk::private_subfolder_name(uid));
        assert_eq!(
            names_in(&shared),
            vec![
                "tms-backup-9-0-0.bin".to_string(),
                disk::private_subfolder_name(uid)
            ]
        );
        let m = std::fs::symlink_metadata(&sub).unwrap();
        assert!(m.is_dir());
        assert_eq!((m.mode() & 0o777, m.uid()), (0o700, uid));
        let files = names_in(&sub);
        assert_eq!(files.len(), 1, "{files:?}");
        assert!(files[0].starts_with("tms-backup-"), "{files:?}");
        f.h.e.resume(None).unwrap();
        assert!(f.h.read(p, data.len()) == data);
        f.h.e.free(p).unwrap();
        assert!(
            names_in(&sub).is_empty(),
            "the file went with its allocation"
        );

        // Under our subfolder's name, a link to a folder of ours: refused, nothing paused.
        let linked = f.h.dir().join("linked");
        std::fs::create_dir(&linked).unwrap();
        std::fs::set_permissions(&linked, std::fs::Permissions::from_mode(0o777)).unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(
            elsewhere.path(),
            linked.join(disk::private_subfolder_name(uid)),
        )
        .unwrap();
        f.h.e.set_disk_backup_dir(Some(linked.clone())).unwrap();
        let (p, data) = f.alloc(2 * MIB, 0, 9);
        let msg = f.h.e.pause(None).unwrap_err().to_string();
        assert!(
            msg.contains("symbolic link") && msg.contains("refused"),
            "{msg}"
        );
        assert_eq!(f.h.e.allocations()[0].state, State::Active);
        assert!(f.h.read(p, data.len()) == data);
        assert!(names_in(elsewhere.path()).is_empty());

        // Another user's folder under that name (only root can make one to test with).
        if uid == 0 {
            let foreign = f.h.dir().join("foreign");
            std::fs::create_dir(&foreign).unwrap();
            std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o1777)).unwrap();
            let theirs = foreign.join(disk::private_subfolder_name(uid));
            std::fs::create_dir(&theirs).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
            std::os::unix::fs::chown(&theirs, Some(4242), Some(4242)).unwrap();
            f.h.e.set_disk_backup_dir(Some(foreign)).unwrap();
            let msg = f.h.e.pause(None).unwrap_err().to_string();
            assert!(msg.contains("belongs to uid 4242"), "{msg}");
            assert!(names_in(&theirs).is_empty());
        }
    }
}

/// A plan of two faults of one operation (`TMS_DISK_FAULTS=write:1,write:2`) fails the first
/// and the second write: each fault counts every call of its operation. The second used to
/// fire at the third write, as a fault was not counted on the call that fired another one.
#[test]
fn two_faults_of_one_operation_fire_at_the_calls_they_name() {
    #[repr(align(4096))]
    struct Page([u8; 4096]);
    let d = tempfile::tempdir().unwrap();
    let bd = disk::BackupDir::new(d.path()).unwrap();
    let f = disk::DiskFile::create(&bd, 4096, 4096).unwrap();
    let page = Box::new(Page([5u8; 4096]));
    for (op, nth) in disk::parse_faults("write:1,write:2")
        .unwrap()
        .iter()
        .map(|x| (x.0, x.1))
    {
        disk::arm_fault(Some(d.path()), op, nth, libc::EIO);
    }
    let fired: Vec<bool> = (0..3).map(|_| f.write_at(&page.0, 0).is_err()).collect();
    disk::clear_faults(Some(d.path()));
    assert_eq!(fired, [true, true, false], "calls that failed");
}
