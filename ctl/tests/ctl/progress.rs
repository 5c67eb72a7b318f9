//! Progress of a pause or resume while tmsctl waits: the lines it shows, and a wait that lasts
//! while the operation moves; a server without progress reports, waited for as before.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::atomic_slow::{assert_replaced_and_never_asked, slow_server, Replace};
use crate::common::*;

/// A disk-backed process on a slow device (a 4 MiB/s link: 2 s for its 8 MiB each way): `pause
/// --progress` prints progress lines on stderr while it runs (not a terminal: a line about
/// every second) in the words of what happens, `status` shows the running operation with its
/// bytes, and `--timeout 1.5` does not cut an operation that makes progress.
#[test]
fn pause_and_resume_show_progress_and_outlast_the_timeout_while_moving() {
    // Less than the 2 s each way takes; the first progress poll comes at 0.5 s and then every
    // 0.5 s, so bytes must move within 1 s of the request, however loaded the machine.
    const TIMEOUT: &str = "1.5";
    let sb = sandbox();
    let dir = sb.tmp.path().join("disk");
    std::fs::create_dir(&dir).unwrap();
    let d = dir.to_str().unwrap().to_string();
    let mut p = Proc::start_with(
        &sb,
        &[
            ("TMS_DISK_BACKUP_DIR", &d),
            ("TMS_SIM_BANDWIDTH", "4MiB"),
            // Copies in pieces of 1/16 s: progress many times within the timeout.
            ("TMS_STAGING_SLOT", "256KiB"),
        ],
        |c| {
            c.arg("--disk");
        },
    );
    let pid = p.pid.to_string();
    let t = Instant::now();
    let r = ctl(
        &sb,
        &[
            "pause",
            "--pid",
            &pid,
            "--tag",
            "demo",
            "--progress",
            "--timeout",
            TIMEOUT,
        ],
    );
    assert_eq!(r.code, 0, "{}", r.dump());
    assert!(
        t.elapsed() > Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    assert!(
        r.stdout.contains("8.00 MiB written to disk, in "),
        "{}",
        r.dump()
    );
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(!lines.is_empty(), "progress lines\n{}", r.dump());
    for l in &lines {
        assert!(l.starts_with("pause of tag \"demo\": "), "{}", r.dump());
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("8.0 MiB written to disk") && l.contains("/s, about ")),
        "{}",
        r.dump()
    );
    assert!(
        !r.stderr.contains('\r') && !r.stderr.contains('\u{1b}'),
        "{}",
        r.dump()
    );

    // While a resume runs (shown by nobody), status has it with its progress.
    let resume = [
        "resume",
        "--pid",
        &pid,
        "--tag",
        "demo",
        "--timeout",
        TIMEOUT,
    ];
    let bg = {
        let mut cmd = clean(Command::new(tmsctl()), &sb);
        cmd.args(resume);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.spawn().expect("tmsctl resume")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let op = loop {
        let s = status(&sb, p.pid);
        let op = s["operations"].as_array().and_then(|o| {
            o.iter()
                .find(|o| o["bytes_done"].as_u64().is_some_and(|b| b > 0 && b < SIZE))
                .cloned()
        });
        if let Some(op) = op {
            break op;
        }
        assert!(Instant::now() < deadline, "no progress seen: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(op["op"], "resume", "{op}");
    assert_eq!(op["tag"], "demo", "{op}");
    assert_eq!(op["phase"], "reading_from_disk", "{op}");
    assert_eq!(op["backing"], "disk", "{op}");
    assert_eq!(op["bytes_total"].as_u64(), Some(SIZE), "{op}");
    let text = ok(&sb, &["status", "--pid", &pid]).stdout;
    assert!(
        text.contains("in progress: resume of tag \"demo\", asked ")
            && (text.contains("8.0 MiB read from disk") || !text.contains("in progress")),
        "{text}"
    );
    let out = bg.wait_with_output().expect("tmsctl resume");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("8.00 MiB read from disk"), "{stdout}");
    assert_eq!(stderr, "", "no progress shown: stderr is not a terminal");
    p.verify();

    // --no-progress: nothing on stderr, and the wait still outlasts --timeout.
    let r = ctl(
        &sb,
        &[
            "pause",
            "--pid",
            &pid,
            "--tag",
            "demo",
            "--no-progress",
            "--timeout",
            TIMEOUT,
        ],
    );
    assert_eq!((r.code, r.stderr.as_str()), (0, ""), "{}", r.dump());
    ok(&sb, &resume);
    p.verify();
}

/// The progress of a tag longer than replies show whole (1 KiB) is shown too: tmsctl looked for
/// its operation in `status` by the whole tag, which `status` shows shortened, and showed none.
#[test]
fn the_progress_of_a_tag_longer_than_replies_show_is_shown() {
    let sb = sandbox();
    let long = "k".repeat(1500);
    let env = [
        ("TMS_SIM_BANDWIDTH", "4MiB"),
        ("TMS_STAGING_SLOT", "256KiB"),
    ];
    let p = Proc::start_tagged(&sb, &long, &env, |_| {});
    let pid = p.pid.to_string();
    let r = ctl(&sb, &["pause", "--pid", &pid, "--tag", &long, "--progress"]);
    assert_eq!(r.code, 0, "{}", r.dump());
    let start = format!("pause of tag \"{long}\": ");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(!lines.is_empty(), "progress lines\n{}", r.dump());
    assert!(lines.iter().all(|l| l.starts_with(&start)), "{}", r.dump());
}

/// A server that predates progress reports: tmsctl asks nothing more of it (no status polled
/// on a second connection, no progress shown) and --timeout bounds the whole wait, as before.
#[test]
fn a_server_without_progress_reports_is_waited_for_as_before() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let plain = honest(me);
    let slow: Answer = Arc::new(move |req: &Value| {
        if req["op"] == "pause" {
            std::thread::sleep(Duration::from_millis(2500));
        }
        plain(req)
    });
    let fake = Fake::start(dir, &our_name(me), me, slow);
    let t = Instant::now();
    let line = ctl(
        &sb,
        &["pause", "--tag", "kv", "--progress", "--timeout", "1"],
    )
    .failed(7)
    .to_string();
    assert!(
        t.elapsed() < Duration::from_millis(2400),
        "{:?}",
        t.elapsed()
    );
    assert!(line.contains("no reply came within 1.0 s"), "{line}");
    // The pause is logged once answered.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fake.ops().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(fake.ops(), ["pause"], "no status polled");
}

/// `pause --progress` of a process whose pause moves for 14 s; the process ends meanwhile, its
/// pid given to another process of the library on the same socket name (its start time
/// changes as the watch's first connection asks its 3rd status). The watch, which connects
/// again every 6 s, stops there: the new process is asked nothing, its progress never shown as
/// this one's, and with nothing seen moving the wait gives up after --timeout (exit 7). (Were
/// the watch to connect by the socket's name alone, it would show the new process's progress
/// to the end, exit 0.)
#[cfg(debug_assertions)]
#[test]
fn the_progress_watch_stops_at_another_process_given_the_pid() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let (proc_root, write) = fake_proc(&sb, me);
    let slow = slow_server(dir, &["chunks", "operations", "progress"], 0, 14000);
    *slow.replace.lock().unwrap() = Replace::after(3, move || write(2000));
    let me_s = me.to_string();
    let args = [
        "pause",
        "--pid",
        &me_s,
        "--tag",
        "kv",
        "--progress",
        "--timeout",
        "2",
    ];
    let r = ctl_with(&tmsctl(), &sb, &args, |c| {
        c.env("TMSCTL_TEST_PROC", &proc_root);
    });
    assert_replaced_and_never_asked(&slow, &r);
    assert_eq!(r.code, 7, "{}", r.dump());
    assert!(
        r.last_stderr_line().contains("nothing moved for 2.0 s"),
        "{}",
        r.dump()
    );
    assert!(
        r.stderr.contains("pause of tag \"kv\": "),
        "progress shown until then\n{}",
        r.dump()
    );
}
