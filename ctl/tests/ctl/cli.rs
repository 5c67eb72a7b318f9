//! The command line: help, usage errors, exit codes and their one-line reasons, the version.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;

#[test]
fn help_for_every_subcommand() {
    let sb = sandbox();
    let top = ok(&sb, &["--help"]);
    for word in [
        "list",
        "status",
        "pause",
        "resume",
        "chunks",
        "region",
        "ping",
        "demo",
        "Exit codes",
    ] {
        assert!(top.stdout.contains(word), "{word}\n{}", top.stdout);
    }
    assert!(!top.stdout.contains("__demo-child"));
    for sub in [
        "list", "status", "pause", "resume", "chunks", "region", "ping", "demo",
    ] {
        let r = ok(&sb, &[sub, "--help"]);
        assert!(r.stdout.contains("Exit codes"), "{sub}\n{}", r.stdout);
        assert!(r.stdout.contains("--json"), "{sub}\n{}", r.stdout);
    }
    assert!(ok(&sb, &["--version"]).stdout.starts_with("tmsctl "));
    assert_eq!(ctl(&sb, &["frobnicate"]).code, 2);
    assert_eq!(ctl(&sb, &["pause", "--pid", "1", "--all"]).code, 2);
    assert_eq!(ctl(&sb, &["region", "--enable", "--disable"]).code, 2);
    assert_eq!(ctl(&sb, &["status", "--timeout", "0"]).code, 2);
    // A timeout too short to wait at all (a zero Duration) is refused the same way.
    let r = ctl(&sb, &["status", "--timeout", "1e-10"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("at least 0.001"), "{}", r.stderr);
}

#[test]
fn failures_have_exit_codes_and_one_line_reasons() {
    let sb = sandbox();
    // Nothing there at all.
    assert!(ctl(&sb, &["status"]).failed(3).contains("no process"));
    assert!(ctl(&sb, &["pause", "--all"])
        .failed(3)
        .contains("no process"));
    let l = ok(&sb, &["list"]);
    assert!(l.stdout.contains("no process"), "{}", l.stdout);
    assert_eq!(ok(&sb, &["list", "--json"]).json(), Value::Array(vec![]));

    // A process that does not exist, and one without a socket (this test).
    let mut gone = Command::new("true").spawn().expect("true");
    let dead = gone.id();
    gone.wait().expect("wait");
    let line = ctl(&sb, &["status", "--pid", &dead.to_string()])
        .failed(3)
        .to_string();
    assert!(line.contains("no such process"), "{line}");
    let me = std::process::id().to_string();
    let line = ctl(&sb, &["ping", "--pid", &me]).failed(3).to_string();
    assert!(line.contains("no control socket"), "{line}");

    // A socket nobody answers on (bound, then the listener dropped): stale.
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let path = sb.dir.join(format!("{me}.sock"));
    drop(UnixListener::bind(&path).expect("bind"));
    let line = ctl(&sb, &["ping", "--pid", &me]).failed(3).to_string();
    assert!(line.contains("stale"), "{line}");
    std::fs::remove_file(&path).expect("rm");

    // A socket that accepts and never answers: a timeout.
    let listener = UnixListener::bind(&path).expect("bind");
    let held = std::thread::spawn(move || {
        let conns: Vec<UnixStream> = listener.incoming().take(1).flatten().collect();
        std::thread::sleep(Duration::from_millis(1500));
        drop(conns);
    });
    let t = Instant::now();
    let line = ctl(&sb, &["status", "--pid", &me, "--timeout", "0.5"])
        .failed(5)
        .to_string();
    assert!(line.contains("did not answer"), "{line}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    held.join().expect("join");
    std::fs::remove_file(&path).expect("rm");

    // tmsctl demo without a library to preload.
    let r = ctl(
        &sb,
        &["demo", "--lib", "/nonexistent/libtms.so", "--size", "4MiB"],
    );
    assert!(r.failed(1).contains("cannot find libtms.so"));
}

#[test]
fn usage_errors_are_one_line() {
    let sb = sandbox();
    for args in [
        &["frobnicate"][..],
        &[],
        &["pause", "--pid", "1", "--all"],
        &["region", "--enable", "--disable"],
        &["status", "--timeout", "0"],
        &["pause", "--pid", "x"],
        &["demo", "--backend", "auto"],
    ] {
        let line = ctl(&sb, args).failed(2).to_string();
        assert!(line.contains("--help"), "{args:?}: {line}");
    }
    let line = ctl(&sb, &["pause", "--tagg", "kv"]).failed(2).to_string();
    assert!(
        line.contains("'tmsctl pause --help'") && line.contains("'--tag'"),
        "{line}"
    );
    let line = ctl(&sb, &["demo", "--backend", "auto"])
        .failed(2)
        .to_string();
    assert!(
        line.contains("cuda-or-sim") && line.contains("'tmsctl demo --help'"),
        "{line}"
    );
    assert!(ctl(&sb, &[]).failed(2).contains("a command is needed"));
    // A negative number is a bad value of its option, said as such (not "unexpected argument",
    // as if the option had no value).
    for (args, option) in [
        (&["status", "--timeout", "-1"][..], "'--timeout <SECONDS>'"),
        (&["status", "--pid", "-1"], "'--pid <PID>'"),
        (
            &["pause", "--tag", "kv", "--chunks", "-1"],
            "'--chunks <LIST>'",
        ),
        (&["demo", "--size", "-5"], "'--size <SIZE>'"),
    ] {
        let line = ctl(&sb, args).failed(2).to_string();
        assert!(
            line.contains("invalid value '-") && line.contains(option),
            "{line}"
        );
    }
    // A tag too long for a request: refused here, its value shown by its start and length.
    let long = "k".repeat(70_000);
    let r = ctl(&sb, &["resume", "--tag", &long]);
    let line = r.failed(2).to_string();
    assert!(
        line.contains("longer than a request can carry") && line.contains("(70000 bytes)"),
        "{line}"
    );
    assert!(r.stderr.len() < 1000, "{}", r.stderr.len());
}

#[test]
fn version_names_the_implementation_and_commit() {
    let sb = sandbox();
    let r = ok(&sb, &["--version"]);
    let line = r.stdout.trim_end();
    let head = format!(
        "tmsctl {} (torch-memory-saver, Rust implementation; commit ",
        env!("CARGO_PKG_VERSION")
    );
    let commit = line
        .strip_prefix(&head)
        .and_then(|c| c.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{line:?}"));
    assert!(!commit.is_empty(), "{line:?}");
    // Built from a git checkout: its commit (`git` and `.git` there to say so).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if root.join(".git").exists() {
        if let Ok(o) = Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(["rev-parse", "--short", "HEAD"])
            .output()
        {
            if o.status.success() {
                assert_eq!(commit, String::from_utf8_lossy(&o.stdout).trim());
            }
        }
    }
}
