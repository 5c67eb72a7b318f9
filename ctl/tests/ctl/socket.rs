//! The control socket of a process: there only with pauseable memory and without TMS_CONTROL=0,
//! left alone by a fork child, removed once stale, and a refused folder that leaves the process
//! working.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

#[test]
fn a_fork_child_leaves_the_parents_socket_alone() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let sock = p.socket();
    // The child exits normally (running atexit handlers) after fork.
    let forked = p.cmd("fork", "FORKED");
    assert!(forked.ends_with(" 0"), "{forked}");
    assert!(sock.exists(), "the parent's socket is still there");
    let entries: Vec<_> = std::fs::read_dir(&sb.dir).expect("ls").flatten().collect();
    assert_eq!(entries.len(), 1, "no socket of the child: {entries:?}");
    let r = ok(&sb, &["ping", "--json"]).json();
    assert_eq!(r["pid"].as_u64(), Some(p.pid as u64));
    ok(&sb, &["pause"]);
    ok(&sb, &["resume"]);
    p.verify();
}

#[test]
fn stale_sockets_are_cleaned() {
    let sb = sandbox();
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let mut gone = Command::new("true").spawn().expect("true");
    let dead = gone.id();
    gone.wait().expect("wait");
    let stale = sb.dir.join(format!("{dead}.sock"));
    drop(UnixListener::bind(&stale).expect("bind"));
    assert!(stale.exists());
    let mut p = Proc::start(&sb, &[]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while stale.exists() {
        assert!(Instant::now() < deadline, "stale socket still there");
        std::thread::sleep(Duration::from_millis(20));
    }
    p.verify();
}

#[test]
fn no_socket_without_pauseable_memory_or_with_tms_control_0() {
    let sb = sandbox();
    let so = libtms();
    // Programs that never touch CUDA, preloaded, even told every allocation is pauseable.
    for (prog, args) in [
        ("/bin/true", vec![]),
        ("/bin/sh", vec!["-c", "echo hi"]),
        (tmsctl().to_str().expect("utf-8 path"), vec!["--version"]),
    ] {
        let mut cmd = Command::new(prog);
        cmd.args(&args);
        let mut cmd = clean(cmd, &sb);
        cmd.env("LD_PRELOAD", &so)
            .env("TMS_INIT_ENABLE", "1")
            .env("TMS_BACKEND", "sim")
            .env("TMS_LOG", "debug");
        let o = output_of(cmd);
        assert!(o.status.success(), "{prog}: {o:?}");
        assert!(
            o.stderr.is_empty(),
            "{prog}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!sb.dir.exists(), "{prog} created {}", sb.dir.display());
    }
    // TMS_CONTROL=0: pauseable memory, no socket (and no folder).
    let mut p = Proc::start(&sb, &[("TMS_CONTROL", "0")]);
    assert!(p.ready["socket"].is_null(), "{}", p.ready);
    assert!(
        p.ready["socket_error"]
            .as_str()
            .unwrap_or("")
            .contains("TMS_CONTROL"),
        "{}",
        p.ready
    );
    assert!(!sb.dir.exists());
    p.verify();
}

#[test]
fn a_refused_socket_folder_leaves_the_process_working() {
    let sb = sandbox();
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut p = Proc::start(&sb, &[]);
    assert!(p.ready["socket"].is_null(), "{}", p.ready);
    let why = p.ready["socket_error"].as_str().unwrap_or("").to_string();
    assert!(why.contains("refusing") && why.contains("0755"), "{why}");
    assert_eq!(std::fs::read_dir(&sb.dir).expect("ls").count(), 0);
    p.verify();
}

/// A sandbox whose socket folder (mode 0700) is too deep for a socket address (108 bytes).
fn too_deep_sandbox() -> Sandbox {
    let mut sb = sandbox();
    sb.dir = sb
        .tmp
        .path()
        .join("d".repeat(80))
        .join("e".repeat(80))
        .join("s");
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    sb
}

/// A socket folder too deep for a socket address (108 bytes): the process listens there all the
/// same, the server's sweep removes a stale socket there, `tmsctl` reaches it, and SIGTERM
/// removes it (a path too long for a removal slot: by the folder held open and the name).
#[test]
fn a_socket_folder_too_deep_for_a_socket_address_works_end_to_end() {
    let sb = too_deep_sandbox();
    let stale = sb.dir.join("4242.sock");
    drop(tms_proto::via_short_path(&stale, |p| UnixListener::bind(p)).expect("bind"));
    assert!(stale.exists());
    let mut p = Proc::start(&sb, &[]);
    let sock = p.socket();
    assert!(sock.as_os_str().len() > 128, "{}", sock.display());
    assert!(sock.exists(), "{}", sock.display());
    let deadline = Instant::now() + Duration::from_secs(5);
    while stale.exists() {
        assert!(Instant::now() < deadline, "stale socket still there");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = ok(&sb, &["ping", "--json"]).json();
    assert_eq!(r["pid"].as_u64(), Some(p.pid as u64));
    ok(&sb, &["pause", "--tag", "demo"]);
    ok(&sb, &["resume", "--tag", "demo"]);
    p.verify();
    p.terminate();
    assert!(!sock.exists(), "the socket was left");
}

/// A server in a socket folder too deep for a socket address binds through
/// `/proc/self/fd/<N>/`, and `/proc/<pid>/net/unix` goes on showing that path: its own
/// descriptor, which is no folder of tmsctl's. `--pid` reaches it all the same where tmsctl
/// has a descriptor of that number open (inherited from its caller, say).
#[test]
fn a_process_in_a_too_deep_folder_is_reached_by_pid_whatever_descriptors_tmsctl_has() {
    let sb = too_deep_sandbox();
    let mut p = Proc::start(&sb, &[]);
    // The descriptor the server bound through, as /proc shows it (other tests' socket names
    // need not be UTF-8).
    let table = std::fs::read(format!("/proc/{}/net/unix", p.pid)).expect("net/unix");
    let table = String::from_utf8_lossy(&table);
    let fd: u32 = table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter(|path| path.contains(&format!("/.{}.", p.pid)))
        .find_map(|path| {
            path.strip_prefix("/proc/self/fd/")?
                .split('/')
                .next()?
                .parse()
                .ok()
        })
        .expect("the server's socket, bound through /proc/self/fd");
    let pid = p.pid.to_string();
    // tmsctl run with a descriptor of that number open on a file.
    let script = format!("exec \"$0\" \"$@\" {fd}</dev/null");
    let ctl = tmsctl();
    let run = |args: &[&str]| {
        let mut all = vec!["-c", script.as_str(), ctl.to_str().expect("utf-8")];
        all.extend_from_slice(args);
        let r = ctl_with(Path::new("bash"), &sb, &all, |_| {});
        assert_eq!(r.code, 0, "tmsctl {args:?}\n{}", r.dump());
        r
    };
    let r = run(&["status", "--pid", &pid, "--json"]).json();
    assert_eq!(r["pid"].as_u64(), Some(p.pid as u64), "{r}");
    run(&["pause", "--pid", &pid, "--tag", "demo"]);
    run(&["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
}

/// The socket is removed at exit (normal or by SIGTERM) only while it is still the file the
/// process made: whatever was put at its name since is someone else's, and stays.
#[test]
fn a_socket_file_replaced_while_serving_is_left_alone_at_exit() {
    for by_signal in [false, true] {
        let sb = sandbox();
        let p = Proc::start(&sb, &[]);
        let sock = p.socket();
        std::fs::rename(&sock, sb.dir.join("moved")).expect("rename");
        std::fs::write(&sock, b"not the server's").expect("write");
        if by_signal {
            p.terminate();
        } else {
            assert!(p.exit().success());
        }
        let left = std::fs::read(&sock).unwrap_or_default();
        assert_eq!(left, b"not the server's", "by signal: {by_signal}");
    }
}
