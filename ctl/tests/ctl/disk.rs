//! Disk backups seen from outside: in status, through a folder made late or wiped, across fork and
//! SIGTERM, and what `tmsctl clean` removes.

use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use crate::common::*;

/// A process whose allocation is backed up on disk: status shows the file's bytes per tag (in
/// the table and in JSON), the pause and resume from outside keep the contents, and the file is
/// gone when the process exits.
#[test]
fn status_shows_disk_backups() {
    let sb = sandbox();
    let dir = sb.tmp.path().join("disk");
    std::fs::create_dir(&dir).unwrap();
    let d = dir.to_str().unwrap().to_string();
    let mut p = Proc::start_with(&sb, &[("TMS_DISK_BACKUP_DIR", &d)], |c| {
        c.arg("--disk");
    });
    let pid = p.pid.to_string();
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    let s = status(&sb, p.pid);
    assert_eq!(tag(&s, "demo")["disk_backup_bytes"].as_u64(), Some(SIZE));
    assert_eq!(tag(&s, "demo")["host_backup_bytes"].as_u64(), Some(0));
    let text = ok(&sb, &["status", "--pid", &pid]).stdout;
    assert!(
        text.contains("DISK BACKUP") && text.contains("8.00 MiB"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
    assert!(p.exit().success());
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "the file went with its process"
    );
}

/// Issue 35, item 1: a process whose `TMS_DISK_BACKUP_DIR` does not exist when it starts (as a
/// job's per-rank folder made later) is paused from outside: the folder is made. Wiped and made
/// again while paused, the resume still restores the contents (from the file the process holds),
/// and the next pause puts a new file in the new folder.
#[test]
fn a_disk_folder_missing_at_start_and_wiped_while_paused_works_through_tmsctl() {
    let sb = sandbox();
    let dir = sb.tmp.path().join("job").join("rank0");
    let d = dir.to_str().unwrap().to_string();
    let mut p = Proc::start_with(&sb, &[("TMS_DISK_BACKUP_DIR", &d)], |c| {
        c.arg("--disk");
    });
    assert!(!dir.exists(), "made only when needed");
    let pid = p.pid.to_string();
    let files = || std::fs::read_dir(&dir).unwrap().count();
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert_eq!(files(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir(&dir).unwrap();
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert_eq!(files(), 1, "a new file in the new folder");
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
    assert!(p.exit().success());
    assert_eq!(files(), 0, "the file went with its process");
}

/// A disk-backed demo child with its folder of backups, paused from outside (its file exists).
fn paused_on_disk(sb: &Sandbox) -> (Proc, PathBuf) {
    let dir = sb.tmp.path().join("disk");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap().to_string();
    let p = Proc::start_with(sb, &[("TMS_DISK_BACKUP_DIR", &d)], |c| {
        c.arg("--disk");
    });
    ok(sb, &["pause", "--pid", &p.pid.to_string(), "--tag", "demo"]);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    (p, dir)
}

/// Issue 23, item 5: a fork child that exits normally runs the atexit handlers it inherited;
/// they used to remove the parent's live backup files.
#[test]
fn a_fork_child_leaves_the_parents_disk_backups_alone() {
    let sb = sandbox();
    let (mut p, dir) = paused_on_disk(&sb);
    let forked = p.cmd("fork", "FORKED");
    assert!(forked.ends_with(" 0"), "{forked}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "the parent's backup file is still there"
    );
    ok(
        &sb,
        &["resume", "--pid", &p.pid.to_string(), "--tag", "demo"],
    );
    p.verify();
    assert!(p.exit().success());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// Issue 23, item 5: SIGTERM (how SLURM and Kubernetes stop jobs) removes the backup files and
/// the socket, and still ends the process by the signal.
#[test]
fn sigterm_removes_the_backup_files_and_the_socket() {
    let sb = sandbox();
    let (p, dir) = paused_on_disk(&sb);
    let sock = p.socket();
    assert!(sock.exists());
    p.terminate();
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert!(left.is_empty(), "backup files left: {left:?}");
    assert!(!sock.exists(), "the socket was left");
}

/// `tmsctl clean` removes a dead process's backup file and stale socket, and leaves a live
/// process's file and socket, and a FIFO under a backup file's name (without blocking on it).
#[test]
fn clean_removes_what_dead_processes_left() {
    let sb = sandbox();
    let (mut p, dir) = paused_on_disk(&sb);
    let live: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let dead = dir.join("tms-backup-4242-0-0.bin");
    std::fs::write(&dead, b"old").unwrap();
    let fifo = dir.join("tms-backup-4243-0-0.bin");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let mut gone = Command::new("true").spawn().expect("true");
    let dead_pid = gone.id();
    gone.wait().expect("wait");
    let stale = sb.dir.join(format!("{dead_pid}.sock"));
    drop(UnixListener::bind(&stale).expect("bind"));

    let r = ok(&sb, &["clean", "--disk-dir", dir.to_str().unwrap()]);
    assert!(
        r.stdout.contains("removed 1 disk backup file")
            && r.stdout.contains("removed 1 control socket"),
        "{}",
        r.dump()
    );
    assert!(!dead.exists() && !stale.exists(), "{}", r.dump());
    assert!(live[0].exists() && p.socket().exists() && fifo.exists());
    let j = ok(
        &sb,
        &["clean", "--disk-dir", dir.to_str().unwrap(), "--json"],
    )
    .json();
    assert_eq!(
        (
            j["backup_files_removed"].as_u64(),
            j["sockets_removed"].as_u64()
        ),
        (Some(0), Some(0)),
        "{j}"
    );
    let help = ok(&sb, &["clean", "--help"]).stdout;
    assert!(
        help.contains("--disk-dir") && help.contains("nobody listens"),
        "{help}"
    );
    ok(
        &sb,
        &["resume", "--pid", &p.pid.to_string(), "--tag", "demo"],
    );
    p.verify();
}

/// `tmsctl clean` takes only names of the form the library makes: a file of the user's own that
/// begins like a backup file's name is left alone, in a folder others can write to (where the
/// base folder is swept too, for files of older versions) as in one's own.
#[test]
fn clean_leaves_the_users_files_that_only_begin_like_backup_files() {
    use std::os::unix::fs::PermissionsExt;
    let sb = sandbox();
    let shared = sb.tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let mine = private(&sb, "mine");
    for dir in [&shared, &mine] {
        let dead = dir.join("tms-backup-4242-0-0.bin");
        std::fs::write(&dead, b"old").unwrap();
        let users: Vec<PathBuf> = ["tms-backup-weights.pt", "tms-backup-2024.tar"]
            .iter()
            .map(|n| dir.join(n))
            .collect();
        for u in &users {
            std::fs::write(u, b"the user's").unwrap();
        }
        let r = ok(&sb, &["clean", "--disk-dir", dir.to_str().unwrap()]);
        assert!(
            r.stdout.contains("removed 1 disk backup file "),
            "{}",
            r.dump()
        );
        assert!(!dead.exists(), "{}", r.dump());
        for u in &users {
            assert!(u.exists(), "{} was removed: {}", u.display(), r.dump());
        }
    }
}

/// Another user's subfolder under our name, closed to us (mode 0700): refused, saying whose it
/// is, as a readable one is (it used to be a bare "Permission denied", exit 1).
#[test]
fn clean_tells_whose_subfolder_took_our_name_even_when_closed_to_us() {
    use std::os::unix::fs::PermissionsExt;
    if !is_root() {
        eprintln!("skipped: needs root to run tmsctl as another user");
        return;
    }
    let sb = sandbox();
    std::os::unix::fs::chown(sb.tmp.path(), Some(65534), Some(65534)).expect("chown");
    let shared = sb.tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let squat = shared.join("tms-backups-65534");
    for mode in [0o700, 0o755] {
        let _ = std::fs::remove_dir(&squat);
        std::fs::create_dir(&squat).unwrap();
        std::fs::set_permissions(&squat, std::fs::Permissions::from_mode(mode)).unwrap();
        let r = ctl_with(
            &tmsctl(),
            &sb,
            &["clean", "--disk-dir", shared.to_str().unwrap()],
            |c| {
                c.uid(65534).gid(65534);
            },
        );
        assert_eq!(r.code, 4, "mode {mode:o}: {}", r.dump());
        assert!(
            r.stderr.contains("refusing") && r.stderr.contains("belongs to uid 0, not 65534"),
            "mode {mode:o}: {}",
            r.dump()
        );
    }
}

/// A reader that went away (`tmsctl clean | head -0`) is no failure: no panic, exit 0.
#[test]
fn a_closed_stdout_is_no_failure() {
    let sb = sandbox();
    let dir = private(&sb, "disk");
    for args in [
        &["clean", "--disk-dir", dir.to_str().unwrap()][..],
        &["list"][..],
        &["man"][..],
    ] {
        let (read, write) = nix::unistd::pipe().expect("pipe");
        drop(read);
        let mut cmd = clean(Command::new(tmsctl()), &sb);
        cmd.args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::from(write))
            .stderr(std::process::Stdio::piped());
        let o = cmd
            .spawn()
            .expect("spawn")
            .wait_with_output()
            .expect("wait");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A socket folder tmsctl refuses (open to others) fails `tmsctl clean` (exit 4) before it has
/// removed anything: it used to sweep the disk backup folder first, then fail, so the files it
/// had removed were said nowhere (neither in words nor in the JSON document, an error only).
#[test]
fn clean_with_a_refused_socket_folder_removes_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let sb = sandbox();
    std::fs::create_dir_all(&sb.dir).unwrap();
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = private(&sb, "disk");
    let dead = dir.join("tms-backup-4242-0-0.bin");
    std::fs::write(&dead, b"old").unwrap();
    for json in [false, true] {
        let mut args = vec!["clean", "--disk-dir", dir.to_str().unwrap()];
        if json {
            args.push("--json");
        }
        let r = ctl(&sb, &args);
        assert_eq!(r.code, 4, "{}", r.dump());
        assert!(
            r.stderr.contains("refusing the socket folder"),
            "{}",
            r.dump()
        );
        assert!(
            dead.exists(),
            "removed, and said nowhere (json: {json})\n{}",
            r.dump()
        );
    }
}
