//! `tmsctl demo`: on the simulated device, where pip puts the library, which device it picks and
//! why, its table as it happens, a size the host cannot hold.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

#[test]
fn demo_on_the_sim() {
    let sb = sandbox();
    let r = ok(&sb, &["demo", "--backend", "sim", "--size", "6MiB"]);
    for want in ["driver sim", "paused", "resumed", "identical", "demo OK"] {
        assert!(r.stdout.contains(want), "{want}\n{}", r.dump());
    }
    // auto (TMS_BACKEND unset): CUDA where it can start, else the sim, saying why.
    let j = ok(&sb, &["demo", "--size", "4MiB", "--json"]).json();
    assert_eq!(j["ok"], true, "{j}");
    assert_eq!(j["steps"][1]["bytes_paused"].as_u64(), Some(4 << 20));
    if j["backend"] == "sim" {
        assert!(j["fallback_reason"].as_str().is_some(), "{j}");
        assert_eq!(j["given_back_bytes"].as_u64(), Some(4 << 20));
    }
    // The children are gone, and their sockets with them.
    assert_eq!(
        std::fs::read_dir(&sb.dir).map(|d| d.count()).unwrap_or(0),
        0
    );
}

/// A demo larger than the host's memory fails at once with the numbers (the sim's device memory
/// is host memory), instead of being killed by the kernel after filling it. The host is
/// pretended 64 GiB, so the answer does not depend on this machine's memory.
#[test]
fn demo_larger_than_the_host_fails_with_a_clear_error() {
    let sb = sandbox();
    let t0 = Instant::now();
    let r = ctl_with(
        &tmsctl(),
        &sb,
        &["demo", "--backend", "sim", "--size", "1TiB"],
        |c| {
            c.env("TMS_SIM_HOST_MEMORY", "64GiB");
        },
    );
    assert_ne!(r.code, 0, "{}", r.dump());
    assert!(t0.elapsed() < Duration::from_secs(20), "{}", r.dump());
    let all = format!("{}{}", r.stdout, r.stderr);
    for want in ["out of memory", "host RAM", "68719476736"] {
        assert!(all.contains(want), "{want:?}\n{}", r.dump());
    }
}

/// A copy of tmsctl at `root/bin/tmsctl` and of libtms.so at `root/<lib>` (as pip lays out).
fn install(root: &Path, lib: Option<&str>) -> PathBuf {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    let exe = bin.join("tmsctl");
    std::fs::copy(tmsctl(), &exe).expect("copy tmsctl");
    if let Some(lib) = lib {
        let to = root.join(lib);
        std::fs::create_dir_all(to.parent().expect("folder")).expect("mkdir");
        std::fs::copy(libtms(), &to).expect("copy libtms.so");
    }
    exe
}

#[test]
fn demo_finds_the_library_where_pip_puts_it() {
    let sb = sandbox();
    for (root, lib) in [
        // pip install . (in a venv, or --user)
        (
            "venv",
            "lib/python3.11/site-packages/torch_memory_saver/libtms.abi3.so",
        ),
        // pip install --target DIR
        ("target", "torch_memory_saver/libtms.abi3.so"),
        // only the existing library's name, beside the package
        (
            "upstream",
            "lib/python3.12/site-packages/torch_memory_saver_hook_mode_preload.abi3.so",
        ),
    ] {
        let root = sb.tmp.path().join(root);
        let exe = install(&root, Some(lib));
        let r = ctl_with(
            &exe,
            &sb,
            &["demo", "--backend", "sim", "--size", "8MiB"],
            |_| {},
        );
        assert_eq!(r.code, 0, "{lib}\n{}", r.dump());
        assert!(r.stdout.contains("demo OK"), "{}", r.dump());
        let used = std::fs::canonicalize(root.join(lib)).expect("canonical");
        assert!(
            r.stdout.contains(&format!("LD_PRELOAD={}", used.display())),
            "{}",
            r.dump()
        );
    }
    // Nowhere: the reason lists what was tried, patterns included.
    let exe = install(&sb.tmp.path().join("bare"), None);
    let line = ctl_with(&exe, &sb, &["demo", "--backend", "sim"], |_| {})
        .failed(1)
        .to_string();
    for want in [
        "cannot find libtms.so",
        "bare/bin/libtms.so",
        "bare/lib/libtms.so",
        "bare/lib/python3*/*-packages/torch_memory_saver/libtms*.so",
        "bare/torch_memory_saver/libtms*.so",
        "torch_memory_saver_hook_mode_preload*.so",
    ] {
        assert!(line.contains(want), "{want}: {line}");
    }
}

#[test]
fn demo_says_which_device_it_chose_and_why() {
    let sb = sandbox();
    let r = ok(&sb, &["demo", "--backend", "sim", "--size", "4MiB"]);
    assert!(
        r.stdout
            .contains("driver sim (the simulated device: --backend sim)"),
        "{}",
        r.dump()
    );
    let r = ctl_with(&tmsctl(), &sb, &["demo", "--size", "4MiB"], |c| {
        c.env("TMS_BACKEND", "sim");
    });
    assert!(r.stdout.contains("TMS_BACKEND=sim"), "{}", r.dump());
    // The default: CUDA if it starts, else the simulated device, named as such.
    let j = ok(&sb, &["demo", "--size", "4MiB", "--json"]).json();
    assert_eq!(j["backend_choice"], "cuda-or-sim", "{j}");
    assert!(
        j["backend_because"]
            .as_str()
            .unwrap_or("")
            .contains("default"),
        "{j}"
    );
    // TMS_BACKEND=auto is the library's: CUDA only.
    let r = ctl_with(&tmsctl(), &sb, &["demo", "--size", "4MiB"], |c| {
        c.env("TMS_BACKEND", "auto");
    });
    if r.code == 0 {
        assert!(
            r.stdout.contains("driver cuda (TMS_BACKEND=auto"),
            "{}",
            r.dump()
        );
    } else {
        let line = r.failed(1);
        assert!(line.contains("CUDA only"), "{line}");
    }
}

/// `tmsctl demo` prints each row of its table as soon as its step is done (a slow device: 4 s
/// per pause or resume of its 16 MiB), with the columns lined up.
#[test]
fn the_demo_prints_each_row_as_it_happens() {
    let sb = sandbox();
    let mut cmd = clean(Command::new(tmsctl()), &sb);
    cmd.args(["demo", "--backend", "sim", "--size", "16MiB"])
        .env("TMS_SIM_BANDWIDTH", "4MiB")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("tmsctl demo");
    let out = child.stdout.take().expect("stdout");
    let mut lines: Vec<(Duration, String)> = Vec::new();
    for l in BufReader::new(out).lines() {
        lines.push((t0.elapsed(), l.expect("a line")));
    }
    let st = child.wait().expect("wait");
    let end = t0.elapsed();
    let all: Vec<&str> = lines.iter().map(|l| l.1.as_str()).collect();
    assert!(st.success(), "{all:#?}");
    let at = |step: &str| {
        lines
            .iter()
            .find(|l| l.1.starts_with(step))
            .unwrap_or_else(|| panic!("no row {step}: {all:#?}"))
    };
    let (head, allocated, paused, resumed) =
        (at("step "), at("allocated "), at("paused "), at("resumed "));
    // Each row came when its step was done, seconds before the next and before the end.
    assert!(
        paused.0 > allocated.0 + Duration::from_secs(2),
        "{lines:#?}"
    );
    assert!(resumed.0 > paused.0 + Duration::from_secs(2), "{lines:#?}");
    assert!(
        end > resumed.0 + Duration::from_secs(2),
        "the check comes after: {lines:#?}"
    );
    assert!(
        lines[0].0 + Duration::from_secs(2) < allocated.0,
        "{lines:#?}"
    );
    // Lined up: every column ends where the header's does.
    for row in [allocated, paused, resumed] {
        let cut = head.1.find("  time").expect("time column") + 2;
        assert_eq!(&row.1[cut - 2..cut], "  ", "{all:#?}");
        assert!(!row.1[..cut].ends_with("   "), "{all:#?}");
    }
    assert!(
        all.contains(&"contents on pause          : 16.00 MiB copied to host memory"),
        "{all:#?}"
    );
    assert_eq!(all.last(), Some(&"demo OK"));
}

/// The files in the sandbox's socket folder.
fn sockets_left(sb: &Sandbox) -> Vec<String> {
    std::fs::read_dir(&sb.dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A child that does not answer within --timeout (its pattern takes 16 s at 1 MiB/s) is ended
/// so that its library removes its control socket: a SIGKILL left the socket behind.
#[test]
fn a_demo_child_that_times_out_leaves_no_socket() {
    let sb = sandbox();
    let r = ctl_with(
        &tmsctl(),
        &sb,
        &[
            "demo",
            "--backend",
            "sim",
            "--size",
            "16MiB",
            "--timeout",
            "1",
        ],
        |c| {
            c.env("TMS_SIM_BANDWIDTH", "1MiB");
        },
    );
    assert!(r.stderr.contains("no READY"), "{}", r.dump());
    // No answer within --timeout is exit code 5, as for every other command.
    assert_eq!(r.code, 5, "{}", r.dump());
    assert_eq!(sockets_left(&sb), Vec::<String>::new(), "{}", r.dump());
}

/// A demo stopped by a signal to it alone (`kill`, a supervisor) takes its child with it, and
/// the child's socket: the child wrote its pattern on, then died of SIGPIPE on its next line,
/// which leaves the socket file behind.
#[test]
fn a_demo_killed_takes_its_child_and_socket_with_it() {
    let sb = sandbox();
    let mut cmd = clean(Command::new(tmsctl()), &sb);
    cmd.args(["demo", "--backend", "sim", "--size", "64MiB"])
        .env("TMS_SIM_BANDWIDTH", "4MiB")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut demo = cmd.spawn().expect("tmsctl demo");
    let mut out = BufReader::new(demo.stdout.take().expect("stdout")).lines();
    let first = out.next().expect("a line").expect("a line");
    let child: i32 = first
        .split_whitespace()
        .nth(3)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no child pid in {first:?}"));
    // The child is writing its pattern (16 s at 4 MiB/s) when its parent goes.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(demo.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("kill");
    let _ = demo.wait();
    drop(out);
    let deadline = Instant::now() + Duration::from_secs(8);
    // A zombie (reparented where nothing reaps it) counts as gone.
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| !r.starts_with('Z'))
        })
    };
    while (alive(child) || !sockets_left(&sb).is_empty()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!alive(child), "demo child {child} still runs");
    assert_eq!(sockets_left(&sb), Vec::<String>::new());
}

/// A --lib that is not libtms.so (or lacks a function the demo calls) is named with the
/// loader's reason; the demo said "libtms.so is not preloaded (LD_PRELOAD)", though it was.
#[test]
fn a_lib_that_is_not_libtms_is_named_with_the_reason() {
    let sb = sandbox();
    let fake = sb.tmp.path().join("libfake.so");
    std::fs::write(&fake, "not an ELF file\n").expect("write");
    let fake = fake.to_str().expect("utf-8 path");
    let line = ctl(&sb, &["demo", "--backend", "sim", "--lib", fake])
        .failed(1)
        .to_string();
    for want in [fake, "is not libtms.so", "cannot be preloaded"] {
        assert!(line.contains(want), "{want:?}: {line}");
    }
    assert!(!line.contains("is not preloaded"), "{line}");
}
