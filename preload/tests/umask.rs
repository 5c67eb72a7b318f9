//! Disk backups under a umask that takes the owner's bits (0777, 0477): every folder and file
//! the library makes is still usable, by it and by the sweep of a later process. Each test runs
//! its body in a child process of its own (the umask is process-wide), as uid 65534 (`nobody`)
//! when the suite runs as root: root ignores file modes, which would hide what is checked.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::sys::stat::{umask, Mode};
use tms::backup::disk::BackupDir;
use tms::backup::DiskFile;

/// Run test `name` again in a child process (as `nobody` when we are root, from a copy of this
/// executable in a folder `nobody` can read); true in the child, where the caller runs the body.
fn in_child(name: &str) -> bool {
    if std::env::var_os("TMS_UMASK_CHILD").is_some() {
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let args = ["--exact", name, "--test-threads=1", "--nocapture"];
    let copy = tempfile::tempdir().unwrap();
    let mut cmd = if nix::unistd::geteuid().is_root() {
        std::fs::set_permissions(copy.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let bin = copy.path().join("umask-test");
        std::fs::copy(&exe, &bin).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut c = std::process::Command::new("runuser");
        c.args(["-u", "nobody", "--"]).arg(&bin).args(args);
        c
    } else {
        let mut c = std::process::Command::new(&exe);
        c.args(args);
        c
    };
    let out = cmd
        .env("TMS_UMASK_CHILD", "1")
        .output()
        .expect("running the test again in a child (as root: with runuser, from util-linux)");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child failed:\n{text}"
    );
    false
}

/// A fresh folder of this test under /tmp.
fn folder(name: &str, mode: u32) -> PathBuf {
    let d = PathBuf::from(format!("/tmp/tms-review-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).unwrap();
    d
}

/// Make a backup file in `dir` under `mask` (the umask as it was after): the error, if any.
fn create_under(mask: u32, dir: &Path) -> Option<String> {
    let old = umask(Mode::from_bits_truncate(mask));
    let made = DiskFile::create(&BackupDir::new(dir).unwrap(), 4096, 4096);
    umask(old);
    made.err().map(|e| e.to_string())
}

/// The mode of the folder at `path`, in octal (for a failure's message); then mode 0700, so
/// that the test can remove it.
fn mode_then_open(path: &Path) -> Option<String> {
    let mode = std::fs::symlink_metadata(path)
        .map(|m| format!("{:o}", m.permissions().mode() & 0o7777))
        .ok();
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700));
    mode
}

/// A disk backup folder others can write to (as /tmp is): the files go to the private
/// subfolder `tms-backups-<uid>`, which the library makes. Under umask 0777 it is made with mode
/// 0000; the library gives it 0700 (it is ours, closed to others), so the pause works, and so
/// does the next one once the umask is back to normal.
#[test]
fn a_private_subfolder_made_under_umask_0777_stays_usable() {
    if !in_child("a_private_subfolder_made_under_umask_0777_stays_usable") {
        return;
    }
    let shared = folder("shared", 0o1777);
    let first = create_under(0o777, &shared);
    // The umask is normal again; a new BackupDir (another pause, another process).
    let second = create_under(0o022, &shared);
    let sub = shared.join(format!("tms-backups-{}", nix::unistd::geteuid()));
    let mode = mode_then_open(&sub);
    let _ = std::fs::remove_dir_all(&shared);
    assert_eq!(
        (first, second),
        (None, None),
        "the subfolder was left with mode {mode:?}"
    );
}

/// A disk backup folder of our own that does not exist yet (`TMS_DISK_BACKUP_DIR`): made under
/// umask 0777, it is given mode 0700, and the pause works.
#[test]
fn a_backup_folder_created_under_umask_0777_is_usable() {
    if !in_child("a_backup_folder_created_under_umask_0777_is_usable") {
        return;
    }
    let parent = folder("parent", 0o700);
    let dir = parent.join("backups");
    let err = create_under(0o777, &dir);
    let mode = mode_then_open(&dir);
    let _ = std::fs::remove_dir_all(&parent);
    assert_eq!(err, None, "the folder was made with mode {mode:?}");
}

/// A disk backup folder two levels below an existing one, made under umask 0777: each folder
/// made is given mode 0700 before the next is made in it (a folder of mode 0000 cannot take
/// one), and the pause works. It used to fail with "Permission denied" making the inner one.
#[test]
fn a_backup_folder_two_levels_deep_created_under_umask_0777_is_usable() {
    if !in_child("a_backup_folder_two_levels_deep_created_under_umask_0777_is_usable") {
        return;
    }
    let parent = folder("deep", 0o700);
    let dir = parent.join("job").join("backups");
    let err = create_under(0o777, &dir);
    let modes = (mode_then_open(&parent.join("job")), mode_then_open(&dir));
    let _ = std::fs::remove_dir_all(&parent);
    assert_eq!(err, None, "the folders were made with modes {modes:?}");
    assert_eq!(modes, (Some("700".into()), Some("700".into())));
}

/// A backup file made under umask 0777 gets mode 0600 all the same: once its process dies, the
/// sweep (the library's at a folder's first use, and `tmsctl clean`'s) can open it to take its
/// lock and removes it.
#[test]
fn a_file_left_by_a_dead_process_under_umask_0777_is_swept() {
    if !in_child("a_file_left_by_a_dead_process_under_umask_0777_is_swept") {
        return;
    }
    // A folder of our own, closed to others: the files go right in it.
    let dir = folder("sweep", 0o700);
    // SAFETY: the test runs alone on its thread (--test-threads=1); the child makes one file
    // and leaves with _exit, running no exit handler: it dies holding the file, as a crash does.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            umask(Mode::from_bits_truncate(0o777));
            let code = match DiskFile::create(&BackupDir::new(&dir).unwrap(), 4096, 4096) {
                Ok(f) => {
                    std::mem::forget(f);
                    0
                }
                Err(_) => 3,
            };
            // SAFETY: ends the child without running anything of the parent's.
            unsafe { libc::_exit(code) };
        }
        nix::unistd::ForkResult::Parent { child } => {
            let st = nix::sys::wait::waitpid(child, None).unwrap();
            assert_eq!(st, nix::sys::wait::WaitStatus::Exited(child, 0));
        }
    }
    let names = || -> Vec<(String, u32)> {
        std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let mode = e.metadata().unwrap().permissions().mode() & 0o777;
                (e.file_name().to_string_lossy().into_owned(), mode)
            })
            .collect()
    };
    let left = names();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].0.starts_with("tms-backup-"), "{left:?}");
    // The process that made it is gone: the sweep must take it (the folder's first use sweeps
    // once, so the call below may find nothing left to count).
    let swept = BackupDir::new(&dir).unwrap().sweep();
    let after = names();
    for (n, _) in &after {
        let p = dir.join(n);
        let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(swept.is_ok(), "{swept:?}");
    assert!(
        after.is_empty(),
        "file left by a dead process (name, mode): {left:?}; still there: {after:?}"
    );
}
