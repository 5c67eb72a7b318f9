//! The disk backup folder of the process's runtime (issue 23, item 4): `TMS_DISK_BACKUP_DIR`
//! and `set_disk_backup_dir` are made absolute when given, so a relative folder followed by
//! `chdir` neither moves the files nor leaves them behind; and `None` (what the C ABI's NULL or
//! "" and Python's `set_disk_backup_dir(None)` become) means `TMS_DISK_BACKUP_DIR` again, not
//! the system's temporary directory. One test alone in its binary: it changes the current
//! folder and the environment of the whole process.

use std::path::Path;

use tms::backup::BackupKind;
use tms::engine::AllocRequest;

const MIB: u64 = 1 << 20;

fn count(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

#[test]
fn folders_are_resolved_once_and_none_means_the_environments() {
    let root = tempfile::tempdir().unwrap();
    for d in ["a/env", "a/set", "b/env", "b/set", "c"] {
        std::fs::create_dir_all(root.path().join(d)).unwrap();
    }
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    std::env::set_current_dir(&a).unwrap();
    std::env::set_var("TMS_BACKEND", "sim");
    std::env::set_var("TMS_SIM_CAPACITY", "256MiB");
    std::env::set_var("TMS_CONTROL", "0");
    std::env::set_var("TMS_DISK_BACKUP_DIR", "env");
    let e = &tms::control::runtime().unwrap().engine;
    let req = AllocRequest {
        size: 2 * MIB,
        device: 0,
        tag: "folder".into(),
        backup: Some(BackupKind::Disk),
        chunk: 0,
    };
    let cycle = |expect: &Path, not: &Path| {
        let p = e.alloc(&req).unwrap();
        e.pause(None).unwrap();
        assert_eq!(count(expect), 1, "the file is in {}", expect.display());
        assert_eq!(count(not), 0, "no file in {}", not.display());
        e.resume(None).unwrap();
        e.free(p).unwrap();
        assert_eq!(count(expect), 0, "the file went with its allocation");
    };

    // The environment's relative folder was resolved in a, at start.
    std::env::set_current_dir(&b).unwrap();
    cycle(&a.join("env"), &b.join("env"));

    // A relative folder set in b stays b's after a chdir to a.
    e.set_disk_backup_dir(Some("set".into())).unwrap();
    std::env::set_current_dir(&a).unwrap();
    cycle(&b.join("set"), &a.join("set"));

    // Elsewhere, then None: back to the environment's folder, not the temporary directory.
    e.set_disk_backup_dir(Some(root.path().join("c"))).unwrap();
    e.set_disk_backup_dir(None).unwrap();
    cycle(&a.join("env"), &root.path().join("c"));
    std::env::set_current_dir(root.path()).unwrap();
}
