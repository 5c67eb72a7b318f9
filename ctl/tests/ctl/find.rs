//! Finding the process the user means: in other folders, by pid, of other users, named by its
//! command line, and what the messages say when there is none.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

/// tmsctl with its folder from the defaults: no TMS_SOCKET_DIR, XDG_RUNTIME_DIR `xdg`.
fn ctl_xdg(sb: &Sandbox, xdg: &Path, args: &[&str]) -> Ran {
    ctl_with(&tmsctl(), sb, args, |c| {
        c.env_remove("TMS_SOCKET_DIR").env("XDG_RUNTIME_DIR", xdg);
    })
}

/// A process whose XDG_RUNTIME_DIR is `run-a` (it listens in run-a/tms, no TMS_SOCKET_DIR),
/// and `run-b`, a private folder for tmsctl's own XDG_RUNTIME_DIR.
fn started_in_run_a(sb: &Sandbox) -> (Proc, PathBuf, PathBuf) {
    let run_a = private(sb, "run-a");
    let run_b = private(sb, "run-b");
    let p = Proc::start_with(sb, &[("XDG_RUNTIME_DIR", run_a.to_str().unwrap())], |c| {
        c.env_remove("TMS_SOCKET_DIR");
    });
    assert_eq!(
        p.socket().parent(),
        Some(run_a.join("tms").as_path()),
        "{}",
        p.ready
    );
    (p, run_a, run_b)
}

#[test]
fn a_process_with_another_xdg_runtime_dir_is_found() {
    let sb = sandbox();
    // The process's XDG_RUNTIME_DIR is not tmsctl's: it listens in run-a/tms.
    let (p, run_a, run_b) = started_in_run_a(&sb);
    let its_dir = run_a.join("tms");
    let pid = p.pid.to_string();

    // By --pid.
    let r = ctl_xdg(&sb, &run_b, &["status", "--pid", &pid, "--json"]);
    assert_eq!(r.json()["pid"].as_u64(), Some(p.pid as u64), "{}", r.dump());
    let r = ctl_xdg(&sb, &run_b, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert_eq!(r.code, 0, "{}", r.dump());
    assert!(
        r.stdout.starts_with(&format!("pid {pid}: paused")),
        "{}",
        r.dump()
    );

    // By list: its row, and where it listens.
    let l = ctl_xdg(&sb, &run_b, &["list", "--json"]).json();
    let row = l
        .as_array()
        .and_then(|rows| {
            rows.iter()
                .find(|r| r["pid"].as_u64() == Some(p.pid as u64))
        })
        .unwrap_or_else(|| panic!("no row of {pid} in {l}"));
    assert_eq!(row["socket"].as_str(), p.socket().to_str(), "{row}");
    assert_eq!(row["bytes_paused"].as_u64(), Some(SIZE), "{row}");
    let l = ctl_xdg(&sb, &run_b, &["list"]);
    assert!(
        l.stdout
            .contains(&format!("pid {pid} listens in {}", its_dir.display())),
        "{}",
        l.dump()
    );

    // By status without --pid: its status, or (other processes of this user listening at the
    // same time) the list of those it could be, naming it.
    status_reaches_or_names(&sb, &run_b, &pid, &its_dir);
}

/// `tmsctl status` without `--pid`, tmsctl's XDG_RUNTIME_DIR `run_b`: the status of process
/// `pid`, or (other processes of this user listening at the same time) the list of those it
/// could be, naming it and its folder `its_dir`.
fn status_reaches_or_names(sb: &Sandbox, run_b: &Path, pid: &str, its_dir: &Path) {
    let r = ctl_xdg(sb, run_b, &["status"]);
    if r.code == 0 {
        assert!(
            r.stdout.starts_with(&format!("pid {pid} (")),
            "{}",
            r.dump()
        );
    } else {
        let line = r.failed(2);
        assert!(
            line.contains(&format!("pid {pid} (")) && line.contains(&its_dir.display().to_string()),
            "{line}"
        );
    }
}

#[test]
fn a_process_with_another_tms_socket_dir_is_found_by_pid_and_named() {
    let sb = sandbox();
    let elsewhere = sb.tmp.path().join("elsewhere");
    let p = Proc::start(&sb, &[("TMS_SOCKET_DIR", elsewhere.to_str().unwrap())]);
    assert_eq!(
        p.socket().parent(),
        Some(elsewhere.as_path()),
        "{}",
        p.ready
    );
    let pid = p.pid.to_string();
    // tmsctl's folder (sb.dir, named by its TMS_SOCKET_DIR) holds nothing.
    let r = ok(&sb, &["status", "--pid", &pid, "--json"]).json();
    assert_eq!(r["pid"].as_u64(), Some(p.pid as u64));
    // Without --pid only the named folder counts; the message names the process elsewhere.
    let line = ctl(&sb, &["status"]).failed(3).to_string();
    assert!(
        line.contains(&format!("pid {pid} (")) && line.contains(&elsewhere.display().to_string()),
        "{line}"
    );
    assert!(line.contains("--pid"), "{line}");
}

#[test]
fn another_users_process_is_refused_by_pid() {
    if !is_root() {
        eprintln!("skipped: needs root to start a process as another user (the check itself is unit-tested in ctl/src/find.rs)");
        return;
    }
    let sb = sandbox();
    let mut other = Command::new("sleep");
    other.arg("60").uid(65534).gid(65534);
    let victim = Victim(other.spawn().expect("sleep as 65534"));
    let line = ctl(&sb, &["status", "--pid", &victim.pid().to_string()])
        .failed(4)
        .to_string();
    assert!(
        line.contains(&format!(
            "process {} belongs to uid 65534, not to uid 0",
            victim.pid()
        )),
        "{line}"
    );
}

#[test]
fn pause_and_resume_without_pid_name_the_process() {
    let sb = sandbox();
    let p = Proc::start(&sb, &[]);
    let pid = p.pid.to_string();
    let r = ok(&sb, &["pause", "--tag", "demo"]);
    assert!(
        r.stdout.starts_with(&format!("pid {pid} (")) && r.stdout.contains("__demo-child"),
        "{}",
        r.dump()
    );
    assert!(r.stdout.contains("): paused tag \"demo\""), "{}", r.dump());
    let j = ok(&sb, &["resume", "--tag", "demo", "--json"]).json();
    assert!(
        j["command"].as_str().unwrap_or("").contains("__demo-child"),
        "{j}"
    );
    // --pid named it already.
    let r = ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert!(
        r.stdout.starts_with(&format!("pid {pid}: paused")),
        "{}",
        r.dump()
    );
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);

    // Several: each is named, and nothing is done.
    let q = Proc::start(&sb, &[]);
    let line = ctl(&sb, &["pause"]).failed(2).to_string();
    for pid in [p.pid, q.pid] {
        assert!(line.contains(&format!("pid {pid} (")), "{line}");
    }
    assert!(line.contains("__demo-child"), "{line}");
    assert_eq!(
        tag(&status(&sb, p.pid), "demo")["bytes_paused"].as_u64(),
        Some(0)
    );
}

#[test]
fn no_socket_messages_name_the_folders_and_what_decides_them() {
    let sb = sandbox();
    // Nothing in tmsctl's folder.
    let line = ctl(&sb, &["status"]).failed(3).to_string();
    assert!(
        line.contains(&sb.dir.display().to_string())
            && line.contains("TMS_SOCKET_DIR")
            && line.contains("XDG_RUNTIME_DIR"),
        "{line}"
    );
    // A process without the library.
    let me = std::process::id().to_string();
    let line = ctl(&sb, &["ping", "--pid", &me]).failed(3).to_string();
    assert!(
        line.contains("no control socket")
            && line.contains("libtms.so is not loaded")
            && line.contains("XDG_RUNTIME_DIR"),
        "{line}"
    );
    // The library, turned off (by a malformed value, which the library reads as off too): its
    // folder (by its environment) and TMS_CONTROL are named.
    let its = sb.tmp.path().join("its");
    let off = Proc::start(
        &sb,
        &[
            ("TMS_CONTROL", "maybe"),
            ("TMS_SOCKET_DIR", its.to_str().unwrap()),
        ],
    );
    let line = ctl(&sb, &["status", "--pid", &off.pid.to_string()])
        .failed(3)
        .to_string();
    assert!(
        line.contains(&format!("TMS_SOCKET_DIR={}", its.display()))
            && line.contains("its TMS_CONTROL (\"maybe\") keeps the socket off"),
        "{line}"
    );
    // A folder the library refused (others may enter it): the refusal is named.
    let open = sb.tmp.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let refused = Proc::start(&sb, &[("TMS_SOCKET_DIR", open.to_str().unwrap())]);
    assert!(refused.ready["socket"].is_null(), "{}", refused.ready);
    let line = ctl(&sb, &["status", "--pid", &refused.pid.to_string()])
        .failed(3)
        .to_string();
    assert!(
        line.contains(&open.display().to_string())
            && line.contains("refused")
            && line.contains("0755"),
        "{line}"
    );
    // tmsctl's own folder refused: where it came from is named.
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let line = ctl(&sb, &["status"]).failed(4).to_string();
    assert!(
        line.contains("from its TMS_SOCKET_DIR") && line.contains("0777"),
        "{line}"
    );
}

/// A socket file left in `dir` by a process that died (nobody listens on it): named `name`.
fn stale_socket(dir: &Path, name: &str) {
    let path = dir.join(name);
    drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
    assert!(path.exists(), "the file stays after its listener is gone");
}

#[test]
fn a_stale_socket_of_a_reused_pid_does_not_hide_where_the_process_listens() {
    let sb = sandbox();
    // The process listens in run-a/tms; tmsctl's folder (run-b/tms) holds a socket of its pid
    // left by an earlier process of that pid that died.
    let (p, run_a, run_b) = started_in_run_a(&sb);
    let ours = run_b.join("tms");
    std::fs::create_dir(&ours).expect("mkdir");
    std::fs::set_permissions(&ours, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    stale_socket(&ours, &our_name(p.pid));
    let pid = p.pid.to_string();

    let r = ctl_xdg(&sb, &run_b, &["status", "--pid", &pid, "--json"]);
    assert_eq!(r.code, 0, "{}", r.dump());
    assert_eq!(r.json()["pid"].as_u64(), Some(p.pid as u64), "{}", r.dump());

    // Without --pid: the process is reached where it listens (or, other processes of this
    // user listening at the same time, named with that folder).
    status_reaches_or_names(&sb, &run_b, &pid, &run_a.join("tms"));
}

#[test]
fn a_stale_socket_whose_pid_is_another_process_now_is_left_out() {
    let sb = sandbox();
    let p = Proc::start(&sb, &[]);
    // A socket left by a process that died, whose pid is now an unrelated process's.
    let other = Victim::start();
    stale_socket(&sb.dir, &our_name(other.pid()));

    let r = ctl(&sb, &["status", "--json"]);
    assert_eq!(r.code, 0, "{}", r.dump());
    assert_eq!(r.json()["pid"].as_u64(), Some(p.pid as u64), "{}", r.dump());
    let r = ctl(&sb, &["pause", "--all", "--tag", "demo", "--json"]);
    assert_eq!(r.code, 0, "{}", r.dump());
    let pids: Vec<u64> = r
        .json()
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|i| i["pid"].as_u64())
        .collect();
    assert_eq!(pids, [p.pid as u64], "{}", r.dump());
    let l = ctl(&sb, &["list", "--json"]).json();
    let rows: Vec<u64> = l
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|i| i["pid"].as_u64())
        .collect();
    assert_eq!(rows, [p.pid as u64], "{l}");
}
