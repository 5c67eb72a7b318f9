//! The operations on a process: status, pause, resume, chunks, region; unknown tags, replies that
//! do not fit what was asked, servers that are busy, slow or gone.

use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;

#[test]
fn drives_a_preloaded_process_through_every_operation() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let pid = p.pid.to_string();
    assert_eq!(p.ready["backend"], "sim");

    // list, in both forms.
    let l = ok(&sb, &["list"]);
    assert!(
        l.stdout.contains(&pid) && l.stdout.contains("__demo-child"),
        "{}",
        l.stdout
    );
    let l = ok(&sb, &["list", "--json"]).json();
    assert_eq!(l[0]["pid"].as_u64(), Some(p.pid as u64));
    assert_eq!(l[0]["backend"], "sim");
    assert_eq!(l[0]["bytes_active"].as_u64(), Some(SIZE));

    assert!(ok(&sb, &["ping"]).stdout.contains("pong"));

    // status: live bytes as allocated.
    let s0 = status(&sb, p.pid);
    assert_eq!(s0["pid"].as_u64(), Some(p.pid as u64));
    assert_eq!(s0["backend"], "sim");
    assert_eq!(tag(&s0, "demo")["bytes_active"].as_u64(), Some(SIZE));
    assert_eq!(tag(&s0, "demo")["bytes_paused"].as_u64(), Some(0));
    let text = ok(&sb, &["status"]).stdout;
    assert!(text.contains("demo") && text.contains("8.00 MiB"), "{text}");

    // pause: the live bytes fall, the device's free memory rises, the backup holds the data.
    let r = ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert!(r.stdout.contains("paused tag \"demo\""), "{}", r.stdout);
    let s1 = status(&sb, p.pid);
    assert_eq!(tag(&s1, "demo")["bytes_active"].as_u64(), Some(0));
    assert_eq!(tag(&s1, "demo")["bytes_paused"].as_u64(), Some(SIZE));
    assert_eq!(tag(&s1, "demo")["host_backup_bytes"].as_u64(), Some(SIZE));
    assert_eq!(free(&s1), free(&s0) + SIZE);
    assert!(tag(&s1, "demo")["last_pause"]["seconds"].as_f64().is_some());
    // Pausing again is a no-op.
    let again = ok(&sb, &["pause", "--tag", "demo", "--json"]).json();
    assert_eq!(again["allocations"].as_u64(), Some(0));

    // resume: they rise again and the contents survived.
    let r = ok(&sb, &["resume", "--pid", &pid, "--tag", "demo", "--json"]).json();
    assert_eq!(r["op"], "resume");
    assert_eq!(r["bytes"].as_u64(), Some(SIZE));
    assert_eq!(r["copied_bytes"].as_u64(), Some(SIZE));
    let s2 = status(&sb, p.pid);
    assert_eq!(tag(&s2, "demo")["bytes_active"].as_u64(), Some(SIZE));
    assert_eq!(free(&s2), free(&s0));
    p.verify();

    // resume --verify: what came back is digested and compared with the backup.
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    let r = ok(&sb, &["resume", "--pid", &pid, "--tag", "demo", "--verify"]);
    assert!(r.stdout.contains("8.00 MiB verified"), "{}", r.stdout);
    p.verify();

    // resume --no-wait: answered once the memory is mapped; the contents land in the process
    // (its verify reads through the library, after the restore).
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    let r = ok(
        &sb,
        &[
            "resume",
            "--pid",
            &pid,
            "--tag",
            "demo",
            "--no-wait",
            "--json",
        ],
    )
    .json();
    assert_eq!(r["bytes"].as_u64(), Some(SIZE));
    assert!(r["pending_bytes"].as_u64().unwrap_or(0) <= SIZE, "{r}");
    p.verify();
    assert_eq!(
        tag(&status(&sb, p.pid), "demo")["bytes_active"].as_u64(),
        Some(SIZE)
    );

    // The default region: off at first, so a plain cudaMalloc passes through (to no CUDA
    // runtime at all here, so it fails); once tmsctl enables it, cudaMalloc is pauseable.
    let r = ok(&sb, &["region", "--json"]).json();
    assert_eq!(r["enabled"], false);
    assert_ne!(p.cmd("malloc 4MiB", "MALLOC").split(' ').next(), Some("0"));
    let r = ok(
        &sb,
        &[
            "region",
            "--enable",
            "--tag",
            "kv",
            "--cpu-backup",
            "--backend",
            "mmap",
            "--json",
        ],
    )
    .json();
    assert_eq!(
        (
            r["enabled"].as_bool(),
            r["tag"].as_str(),
            r["cpu_backup"].as_bool(),
            r["backend"].as_str()
        ),
        (Some(true), Some("kv"), Some(true), Some("mmap"))
    );
    let text = ok(&sb, &["region"]).stdout;
    assert!(
        text.contains("pauseable, tag \"kv\", CPU backup (mmap)"),
        "{text}"
    );
    assert!(p.cmd("malloc 4MiB", "MALLOC").starts_with("0 0x"));
    let s3 = status(&sb, p.pid);
    assert_eq!(tag(&s3, "kv")["bytes_active"].as_u64(), Some(4 << 20));
    assert_eq!(s3["default_region"]["tag"], "kv");

    // Tags are independent; no --tag means every tag.
    ok(&sb, &["pause", "--tag", "kv"]);
    let s4 = status(&sb, p.pid);
    assert_eq!(tag(&s4, "kv")["bytes_paused"].as_u64(), Some(4 << 20));
    assert_eq!(tag(&s4, "demo")["bytes_active"].as_u64(), Some(SIZE));
    let all = ok(&sb, &["pause", "--json"]).json();
    assert_eq!(all["allocations"].as_u64(), Some(1));
    let all = ok(&sb, &["resume"]);
    assert!(all.stdout.contains("every tag"), "{}", all.stdout);
    let s5 = status(&sb, p.pid);
    assert_eq!(tag(&s5, "kv")["bytes_active"].as_u64(), Some(4 << 20));
    assert_eq!(tag(&s5, "demo")["bytes_active"].as_u64(), Some(SIZE));
    p.verify();

    ok(&sb, &["region", "--disable", "--no-cpu-backup"]);
    assert_ne!(p.cmd("malloc 2MiB", "MALLOC").split(' ').next(), Some("0"));

    // An empty tag is a bad command line (exit code 2), never sent; an error reply: exit code
    // 1, one line.
    let line = ctl(&sb, &["pause", "--tag", ""]).failed(2).to_string();
    assert!(line.contains("tag must not be empty"), "{line}");
    let line = ctl(&sb, &["region", "--backend", "pinned"])
        .failed(1)
        .to_string();
    assert!(line.contains("without enabling CPU backup"), "{line}");

    // Its socket goes when it exits.
    let sock = p.socket();
    assert!(sock.exists());
    assert!(p.exit().success());
    assert!(!sock.exists(), "socket removed at exit");
    ctl(&sb, &["status"]).failed(3);
}

#[test]
fn two_processes_at_once() {
    let sb = sandbox();
    let mut a = Proc::start(&sb, &[]);
    let mut b = Proc::start(&sb, &[]);
    let line = ctl(&sb, &["status"]).failed(2).to_string();
    assert!(line.contains("--pid") && line.contains("--all"), "{line}");

    let l = ok(&sb, &["list", "--json"]).json();
    assert_eq!(l.as_array().map(Vec::len), Some(2));

    let r = ok(&sb, &["pause", "--all", "--json"]).json();
    assert_eq!(r.as_array().map(Vec::len), Some(2), "{r}");
    for p in [a.pid, b.pid] {
        let s = status(&sb, p);
        assert_eq!(tag(&s, "demo")["bytes_paused"].as_u64(), Some(SIZE));
    }
    // Only one of them resumed.
    ok(&sb, &["resume", "--pid", &a.pid.to_string()]);
    assert_eq!(
        tag(&status(&sb, a.pid), "demo")["bytes_active"].as_u64(),
        Some(SIZE)
    );
    assert_eq!(
        tag(&status(&sb, b.pid), "demo")["bytes_paused"].as_u64(),
        Some(SIZE)
    );
    let text = ok(&sb, &["resume", "--all"]).stdout;
    assert_eq!(text.lines().count(), 2, "{text}");
    let s = ok(&sb, &["status", "--all", "--json"]).json();
    for item in s.as_array().expect("array") {
        assert_eq!(tag(item, "demo")["bytes_active"].as_u64(), Some(SIZE));
    }
    a.verify();
    b.verify();
    assert!(ok(&sb, &["ping", "--all"]).stdout.lines().count() == 2);
}

/// A process with a chunked allocation (4 chunks of 2 MiB): chunks paused and resumed from
/// outside, the tag partial in status meanwhile, chunk states shown and saved, the contents
/// kept; bad chunk lists are refused in one line each.
#[test]
fn chunks_of_a_preloaded_process() {
    const CHUNK: u64 = 2 << 20;
    let sb = sandbox();
    let mut p = Proc::start_with(&sb, &[], |c| {
        c.args(["--chunk", "2MiB"]);
    });
    let pid = p.pid.to_string();
    let chunks = |sb: &Sandbox| ok(sb, &["chunks", "--tag", "demo", "--json"]).json();

    let c = chunks(&sb);
    assert_eq!(c["pid"].as_u64(), Some(p.pid as u64));
    assert_eq!(c["chunk_size"].as_u64(), Some(CHUNK));
    assert_eq!(c["count"].as_u64(), Some(4));
    assert_eq!(c["addr"].as_u64(), p.ready["ptr"].as_u64());
    assert_eq!(
        (c["active"].as_str(), c["paused"].as_str()),
        (Some("0-3"), Some(""))
    );
    let text = ok(&sb, &["chunks", "--tag", "demo"]).stdout;
    assert!(
        text.contains("4 chunks of 2.00 MiB (8.00 MiB)")
            && text.contains("active: 4 chunks, 8.00 MiB: 0-3")
            && text.contains("paused: 0 chunks, 0 B"),
        "{text}"
    );

    // Chunks 1 and 2 go: the tag is partial, half its bytes paused, the device has them back.
    let s0 = status(&sb, p.pid);
    let r = ok(
        &sb,
        &["pause", "--pid", &pid, "--tag", "demo", "--chunks", "1-2"],
    );
    assert!(
        r.stdout
            .contains("paused chunks 1-2 of tag \"demo\": 4.00 MiB of device memory released"),
        "{}",
        r.stdout
    );
    let s1 = status(&sb, p.pid);
    let t = tag(&s1, "demo");
    assert_eq!(t["partial_allocations"].as_u64(), Some(1));
    assert_eq!(t["paused_allocations"].as_u64(), Some(0));
    assert_eq!(t["bytes_active"].as_u64(), Some(2 * CHUNK));
    assert_eq!(t["bytes_paused"].as_u64(), Some(2 * CHUNK));
    assert_eq!(free(&s1), free(&s0) + 2 * CHUNK);
    let text = ok(&sb, &["status"]).stdout;
    assert!(text.contains("PARTIAL"), "{text}");
    let c = chunks(&sb);
    assert_eq!(
        (c["active"].as_str(), c["paused"].as_str()),
        (Some("0,3"), Some("1-2"))
    );
    assert_eq!(c["states"], "1001");
    // The active chunks are still there to use.
    assert_eq!(p.cmd("verify 0 2MiB", "VERIFY"), "ok");
    assert_eq!(p.cmd("verify 6MiB 2MiB", "VERIFY"), "ok");
    // Again: nothing to do.
    let r = ok(
        &sb,
        &["pause", "--tag", "demo", "--chunks", "2,1", "--json"],
    )
    .json();
    assert_eq!(r["allocations"].as_u64(), Some(0));
    assert_eq!(r["chunks"], serde_json::json!([[1, 2]]));

    // Bad lists: out of range (the process names it), malformed, no tag (usage, one line).
    let line = ctl(&sb, &["resume", "--tag", "demo", "--chunks", "3-4"])
        .failed(1)
        .to_string();
    assert!(
        line.contains("chunk 4 ") && line.contains("it has 4 chunks (0 to 3)"),
        "{line}"
    );
    for (args, words) in [
        (
            &["pause", "--tag", "demo", "--chunks", "x"][..],
            "is not an index",
        ),
        (
            &["pause", "--tag", "demo", "--chunks", "3-1"],
            "runs backwards",
        ),
        (&["pause", "--tag", "demo", "--chunks", ""], "empty item"),
        (
            &["pause", "--tag", "demo", "--chunks", "0-99999999"],
            "more than 1048576",
        ),
        (&["pause", "--chunks", "1"], "--tag"),
        (&["resume", "--chunks", "1"], "--tag"),
        (
            &[
                "pause",
                "--tag",
                "demo",
                "--chunks",
                "1",
                "--save-chunk-state",
            ],
            "cannot be used with",
        ),
        (&["chunks"], "--tag"),
        (
            &["resume", "--tag", "demo", "--chunks", "1", "--no-wait"],
            "cannot be used with",
        ),
        (
            &["resume", "--no-wait", "--restore-chunk-state"],
            "cannot be used with",
        ),
        (&["resume", "--no-wait", "--atomic"], "cannot be used with"),
        (
            &["pause", "--all", "--atomic", "--save-chunk-state"],
            "cannot be used with",
        ),
        (&["resume", "--no-wait", "--verify"], "cannot be used with"),
    ] {
        let line = ctl(&sb, args).failed(2).to_string();
        assert!(
            line.contains(words) && line.contains("--help"),
            "{args:?}: {line}"
        );
    }
    // A tag without a chunked allocation; a tag no allocation ever had (exit 6, as for a
    // whole tag).
    ok(&sb, &["region", "--enable", "--tag", "kv", "--cpu-backup"]);
    assert!(p.cmd("malloc 2MiB", "MALLOC").starts_with("0 0x"));
    let line = ctl(&sb, &["pause", "--tag", "kv", "--chunks", "0"])
        .failed(1)
        .to_string();
    assert!(line.contains("\"kv\" has no chunked allocation"), "{line}");
    let line = ctl(&sb, &["chunks", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("no chunked allocation"), "{line}");
    let line = ctl(&sb, &["pause", "--tag", "demoo", "--chunks", "0"])
        .failed(6)
        .to_string();
    assert!(line.contains("ever had tag \"demoo\""), "{line}");
    // Nothing changed on the way.
    assert_eq!(chunks(&sb)["states"], "1001");

    // Back, and the pattern is whole.
    let r = ok(
        &sb,
        &["resume", "--tag", "demo", "--chunks", "1-2", "--json"],
    )
    .json();
    assert_eq!(r["bytes"].as_u64(), Some(2 * CHUNK));
    assert_eq!(r["copied_bytes"].as_u64(), Some(2 * CHUNK));
    p.verify();
    let t = tag(&status(&sb, p.pid), "demo").clone();
    assert_eq!(t["partial_allocations"].as_u64(), Some(0));
    assert_eq!(t["bytes_active"].as_u64(), Some(SIZE));

    // Saved chunk states: chunk 3 paused alone, then the whole tag with its states saved;
    // restoring them brings back 0 to 2 only, and a plain resume the rest.
    ok(&sb, &["pause", "--tag", "demo", "--chunks", "3"]);
    let r = ok(&sb, &["pause", "--tag", "demo", "--save-chunk-state"]);
    assert!(r.stdout.contains("(chunk states saved)"), "{}", r.stdout);
    assert_eq!(chunks(&sb)["states"], "0000");
    let r = ok(&sb, &["resume", "--tag", "demo", "--restore-chunk-state"]);
    assert!(
        r.stdout.contains("6.00 MiB of device memory re-taken"),
        "{}",
        r.stdout
    );
    assert_eq!(chunks(&sb)["paused"], "3");
    assert_eq!(p.cmd("verify 0 6MiB", "VERIFY"), "ok");
    ok(&sb, &["resume", "--tag", "demo"]);
    assert_eq!(chunks(&sb)["paused"], "");
    p.verify();
    assert!(p.exit().success());
}

/// A process started with a disk backup for its default region: `region` shows it, and asking
/// for a CPU backup as well is refused (the region unchanged) instead of reported as done.
#[test]
fn region_shows_a_disk_backup_and_refuses_a_second_backup() {
    let sb = sandbox();
    let disk = tempfile::tempdir().expect("tempdir");
    let p = Proc::start(
        &sb,
        &[
            ("TMS_INIT_ENABLE_DISK_BACKUP", "1"),
            ("TMS_DISK_BACKUP_DIR", disk.path().to_str().expect("utf-8")),
        ],
    );
    let pid = p.pid.to_string();
    let shown = ok(&sb, &["region", "--pid", &pid]).stdout;
    assert!(shown.contains("disk backup"), "{shown}");
    let line = ctl(&sb, &["region", "--pid", &pid, "--cpu-backup"])
        .failed(1)
        .to_string();
    assert!(line.contains("mutually exclusive"), "{line}");
    let r = ok(&sb, &["region", "--pid", &pid, "--json"]).json();
    assert_eq!(
        (r["disk_backup"].as_bool(), r["cpu_backup"].as_bool()),
        (Some(true), Some(false)),
        "{r}"
    );
    let r = ok(
        &sb,
        &[
            "region",
            "--pid",
            &pid,
            "--cpu-backup",
            "--no-disk-backup",
            "--json",
        ],
    )
    .json();
    assert_eq!(
        (r["disk_backup"].as_bool(), r["cpu_backup"].as_bool()),
        (Some(false), Some(true)),
        "{r}"
    );
}

#[test]
fn an_unknown_tag_is_exit_6_with_a_reason() {
    // The client's side, against a fake server that sets unknown_tag.
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let _fake = Fake::start(dir, &our_name(me), me, honest(me));
    let r = ctl(&sb, &["pause", "--tag", "kvv"]);
    let line = r.failed(6).to_string();
    assert!(
        line.contains(&format!("process {me}"))
            && line.contains("ever had tag \"kvv\"")
            && line.contains("nothing was paused"),
        "{line}"
    );
    assert_eq!(r.stdout, "", "{}", r.dump());
    let line = ctl(&sb, &["resume", "--tag", "kvv"]).failed(6).to_string();
    assert!(line.contains("nothing was resumed"), "{line}");
    let r = ctl(&sb, &["pause", "--tag", "kvv", "--json"]);
    r.failed(6);
    let j: Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(j["unknown_tag"], true, "{j}");
    // A tag it has, and every tag: fine.
    ok(&sb, &["pause", "--tag", "kv"]);
    ok(&sb, &["resume"]);
    // --all: 6 when the unknown tag is the only problem ...
    ctl(&sb, &["pause", "--all", "--tag", "kvv"]).failed(6);
    // ... but another failure (here a socket of a live process that another process serves)
    // takes precedence.
    let victim = Victim::start();
    let _impostor = UnixListener::bind(dir.join(our_name(victim.pid()))).expect("bind");
    let r = ctl(&sb, &["pause", "--all", "--tag", "kvv"]);
    assert_eq!(r.code, 4, "{}", r.dump());
    assert_eq!(
        r.stderr.lines().count(),
        2,
        "one line per process\n{}",
        r.dump()
    );
    assert!(
        r.stderr.contains("served by process") && r.stderr.contains("\"kvv\""),
        "{}",
        r.dump()
    );
    let r = ctl(&sb, &["pause", "--all", "--tag", "kvv", "--json"]);
    assert_eq!(r.code, 4, "{}", r.dump());
    let items: Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(items.as_array().map(Vec::len), Some(2), "{items}");
}

#[test]
fn an_unknown_tag_of_a_real_process_is_exit_6() {
    // Needs the server to set `unknown_tag` (libtms.so of this tree).
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let line = ctl(&sb, &["pause", "--tag", "dmeo"]).failed(6).to_string();
    assert!(
        line.contains(&format!("process {}", p.pid)) && line.contains("\"dmeo\""),
        "{line}"
    );
    ctl(&sb, &["resume", "--tag", "dmeo"]).failed(6);
    ctl(&sb, &["pause", "--all", "--tag", "dmeo"]).failed(6);
    // Nothing changed; the real tag still works.
    assert_eq!(
        tag(&status(&sb, p.pid), "demo")["bytes_active"].as_u64(),
        Some(SIZE)
    );
    ok(&sb, &["pause", "--tag", "demo"]);
    ok(&sb, &["resume", "--tag", "demo"]);
    p.verify();
}

/// A pause that outlasts --timeout (a slow device: every synchronization takes 3 s) is
/// reported as sent and still running (exit 7), not as "no answer" (5); `status` lists it
/// while it runs and no longer once it has ended, paused as asked.
#[test]
fn a_pause_longer_than_the_timeout_is_reported_running_and_seen_in_status() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[("TMS_SIM_SYNC_DELAY_MS", "3000")]);
    let pid = p.pid.to_string();
    let t = Instant::now();
    let r = ctl(
        &sb,
        &["pause", "--pid", &pid, "--tag", "demo", "--timeout", "1"],
    );
    let line = r.failed(7).to_string();
    assert!(
        t.elapsed() < Duration::from_millis(2900),
        "{:?}",
        t.elapsed()
    );
    assert!(
        line.contains("sent; still running in the process") && line.contains("tmsctl status"),
        "{line}"
    );
    let s = status(&sb, p.pid);
    let ops = s["operations"].as_array().expect("operations in progress");
    assert_eq!(ops.len(), 1, "{s}");
    assert_eq!(ops[0]["op"], "pause");
    assert_eq!(ops[0]["tag"], "demo");
    let text = ok(&sb, &["status", "--pid", &pid]).stdout;
    assert!(
        text.contains("in progress: pause of tag \"demo\""),
        "{text}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let s = loop {
        let s = status(&sb, p.pid);
        if s.get("operations").is_none() {
            break s;
        }
        assert!(Instant::now() < deadline, "still running: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(tag(&s, "demo")["bytes_paused"], SIZE, "{s}");
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
}

/// A reply about another operation than the one asked for is not printed as its outcome.
#[test]
fn a_reply_about_another_operation_is_refused() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let wrong: Answer = Arc::new(|req: &Value| {
        let op = if req["op"] == "pause" {
            "resume"
        } else {
            "pause"
        };
        format!(
            "{{\"reply\":\"done\",\"op\":\"{op}\",\"tag\":\"kv\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":0.1}}"
        )
    });
    let _fake = Fake::start(dir, &our_name(me), me, wrong);
    let line = ctl(&sb, &["pause", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("another operation"), "{line}");
    let other_tag: Answer = Arc::new(|_: &Value| {
        "{\"reply\":\"done\",\"op\":\"pause\",\"tag\":\"other\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":0.1}".to_string()
    });
    std::fs::remove_file(dir.join(our_name(me))).expect("rm");
    let _fake = Fake::start(dir, &our_name(me), me, other_tag);
    let line = ctl(&sb, &["pause", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("another operation"), "{line}");
    // A sign is not part of an index.
    let line = ctl(&sb, &["pause", "--tag", "kv", "--chunks", "+1"])
        .failed(2)
        .to_string();
    assert!(line.contains("not an index"), "{line}");
    // Issue 36, item 5: nor is a space.
    let line = ctl(&sb, &["pause", "--tag", "kv", "--chunks", " 1"])
        .failed(2)
        .to_string();
    assert!(line.contains("whitespace is not allowed"), "{line}");
    // Issue 36, item 5: a negative duration is no result to print (it used to be, exit 0).
    let negative: Answer = Arc::new(|_: &Value| {
        "{\"reply\":\"done\",\"op\":\"pause\",\"tag\":\"kv\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":-2.5}".to_string()
    });
    std::fs::remove_file(dir.join(our_name(me))).expect("rm");
    let _fake = Fake::start(dir, &our_name(me), me, negative);
    let line = ctl(&sb, &["pause", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("not a duration"), "{line}");
}

/// A server that reads the request and closes without a reply is reported at once as such
/// (exit 1), not as a timeout after the whole `--timeout`, and not as "still running".
#[test]
fn a_server_that_closes_without_replying_is_not_a_timeout() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let listener = UnixListener::bind(dir.join(our_name(me))).expect("bind");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let Some(mut lines) = greet(&mut conn, me) else {
                continue;
            };
            // Read the request whole, then hang up.
            let _request = lines.next();
        }
    });
    for args in [
        &["pause", "--tag", "kv", "--timeout", "60"][..],
        &["status", "--timeout", "60"][..],
    ] {
        let t0 = Instant::now();
        let r = ctl(&sb, args);
        let line = r.failed(1).to_string();
        assert!(
            line.contains("closed the connection without replying"),
            "{args:?}: {line}"
        );
        assert!(!line.contains("still running"), "{args:?}: {line}");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{args:?}: took {:?}, as if it waited for the timeout",
            t0.elapsed()
        );
    }
}

#[test]
fn a_busy_server_is_asked_again_until_the_timeout() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let fake = Fake::start_busy(dir, &our_name(me), me, honest(me), 3);
    assert!(ok(&sb, &["ping"]).stdout.contains("pong"));
    assert_eq!(fake.ops(), ["ping"]);
    std::fs::remove_file(&fake.path).expect("rm");

    let _always = Fake::start_busy(dir, &our_name(me), me, honest(me), usize::MAX);
    let t = Instant::now();
    let line = ctl(&sb, &["ping", "--timeout", "0.5"])
        .failed(5)
        .to_string();
    assert!(
        line.contains("no room") && line.contains("--timeout"),
        "{line}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

/// A server whose accept queue is full (a process stopped, or too slow to take its connections)
/// is no answer within `--timeout` (exit 5), not a tmsctl that waits in `connect` for ever.
#[test]
fn a_server_whose_accept_queue_is_full_is_a_timeout() {
    let sb = sandbox();
    let full = FullQueue::listen(private_dir(&sb));
    for args in [
        &["ping", "--timeout", "1"][..],
        &["pause", "--tag", "kv", "--timeout", "1"][..],
    ] {
        let t0 = Instant::now();
        let r = ctl(&sb, args);
        let line = r.failed(5).to_string();
        assert!(line.contains("--timeout"), "{args:?}: {line}");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{args:?}: took {:?}",
            t0.elapsed()
        );
    }
    drop(full);
}
