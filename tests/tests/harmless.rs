//! Preloading libtms.so into programs that never touch CUDA changes nothing: same exit status,
//! same stdout, nothing on stderr, and no file (or socket) created anywhere we can watch.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;

use tms_tests::{libtms, list_tree, run, scrub_env, temp_dir, Run};

/// Run `program args` in a fresh, empty working folder with fresh HOME, XDG_RUNTIME_DIR and
/// TMPDIR, with or without libtms.so preloaded; checks those folders stay empty.
fn run_isolated(program: &str, args: &[&str], preload: Option<&Path>) -> Run {
    let cwd = temp_dir("tms-cwd-");
    let home = temp_dir("tms-home-");
    let xdg = temp_dir("tms-xdg-");
    let tmp = temp_dir("tms-tmp-");
    let mut cmd = Command::new(program);
    cmd.args(args)
        .current_dir(cwd.path())
        .env("HOME", home.path())
        .env("XDG_RUNTIME_DIR", xdg.path())
        .env("TMPDIR", tmp.path());
    scrub_env(&mut cmd);
    if let Some(so) = preload {
        cmd.env("LD_PRELOAD", so);
    }
    let r = run(cmd);
    for (what, d) in [
        ("cwd", &cwd),
        ("HOME", &home),
        ("XDG_RUNTIME_DIR", &xdg),
        ("TMPDIR", &tmp),
    ] {
        let files = list_tree(d.path());
        assert!(files.is_empty(), "{what} got {files:?}\n{}", r.dump());
    }
    r
}

fn check_harmless(program: &str, args: &[&str], expect_stdout: &str) {
    let so = libtms();
    let plain = run_isolated(program, args, None);
    let pre = run_isolated(program, args, Some(&so));
    assert!(plain.status.success(), "{}", plain.dump());
    assert_eq!(plain.stdout, expect_stdout, "{}", plain.dump());
    assert_eq!(pre.status.code(), plain.status.code(), "{}", pre.dump());
    assert_eq!(pre.status.signal(), None, "{}", pre.dump());
    assert_eq!(pre.stdout, plain.stdout, "{}", pre.dump());
    assert_eq!(pre.stderr, "", "{}", pre.dump());
    assert_eq!(plain.stderr, "", "{}", plain.dump());
}

#[test]
fn true_is_unaffected() {
    check_harmless("/bin/true", &[], "");
}

#[test]
fn python_is_unaffected() {
    check_harmless("python3", &["-c", "print(1+1)"], "2\n");
}

#[test]
fn python_is_unaffected_with_tms_settings() {
    // Even with the library told to make every allocation pauseable, a process that never
    // allocates device memory does not start it.
    let so = libtms();
    let cwd = temp_dir("tms-cwd-");
    let mut cmd = Command::new("python3");
    cmd.args(["-c", "print(1+1)"]).current_dir(cwd.path());
    scrub_env(&mut cmd);
    cmd.env("LD_PRELOAD", &so)
        .env("TMS_INIT_ENABLE", "1")
        .env("TMS_BACKEND", "sim")
        .env("TMS_LOG", "debug");
    let r = run(cmd);
    assert!(r.status.success(), "{}", r.dump());
    assert_eq!(r.stdout, "2\n", "{}", r.dump());
    assert_eq!(r.stderr, "", "{}", r.dump());
    assert!(list_tree(cwd.path()).is_empty());
}

/// One build serves CUDA 12 and 13: the library links no CUDA library; the driver is opened at
/// run time.
#[test]
fn libtms_links_no_cuda_library() {
    let out = Command::new("readelf")
        .arg("-d")
        .arg(libtms())
        .output()
        .expect("readelf (binutils) is needed for this test");
    assert!(
        out.status.success(),
        "readelf failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dynamic = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(
        !needed.is_empty(),
        "no NEEDED entries parsed from:\n{dynamic}"
    );
    for l in &needed {
        let lower = l.to_ascii_lowercase();
        assert!(
            !lower.contains("cuda") && !lower.contains("nvidia"),
            "libtms.so links a CUDA library: {l}"
        );
    }
}
