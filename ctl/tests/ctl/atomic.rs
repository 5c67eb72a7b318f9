//! `pause|resume --atomic`: every process or none.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;

/// Processes started one after another with `envs`, their pids increasing: tmsctl asks them
/// in pid order, which tells which one is asked last. Where the pids wrapped around between two
/// (`pid_max` can be 32768, which a busy test machine goes through), they exit and start again.
fn in_pid_order(sb: &Sandbox, envs: &[&[(&str, &str)]]) -> Vec<Proc> {
    for _ in 0..4 {
        let ps: Vec<Proc> = envs.iter().map(|env| Proc::start(sb, env)).collect();
        if ps.windows(2).all(|w| w[0].pid < w[1].pid) {
            return ps;
        }
        for p in ps {
            p.exit();
        }
    }
    panic!("pids not increasing in 4 tries");
}

/// [`in_pid_order`] of two processes.
fn two_in_pid_order(sb: &Sandbox, a: &[(&str, &str)], b: &[(&str, &str)]) -> (Proc, Proc) {
    let mut ps = in_pid_order(sb, &[a, b]);
    let b = ps.pop().expect("two processes");
    let a = ps.pop().expect("two processes");
    (a, b)
}

/// A process started by `start` whose pid is above this test process's, as which the tests' fake
/// servers listen: tmsctl asks it after them. Where the pids wrapped around since this process
/// started, it exits, the pids up to ours are used up, and it starts again.
pub(crate) fn started_after_us(start: impl Fn() -> Proc) -> Proc {
    let me = std::process::id();
    for _ in 0..4 {
        let p = start();
        if p.pid > me {
            return p;
        }
        p.exit();
        use_pids_up_to(me);
    }
    panic!("no pid above this process's ({me}) in 4 tries");
}

/// Use up pids (as the ids of threads that end at once, from the same numbers) until one above
/// `pid` came, or they wrapped around again, or 60 s passed (with a `pid_max` of millions).
fn use_pids_up_to(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = 0;
    while Instant::now() < deadline {
        let tid = std::thread::spawn(|| nix::unistd::gettid().as_raw())
            .join()
            .expect("a thread that only asks its id");
        let tid = u32::try_from(tid).expect("a thread id is positive");
        if tid > pid || tid < last {
            return;
        }
        last = tid;
    }
}

/// Three processes, the last (highest pid, asked last) made to fail; `--atomic` must bring the
/// first two back to where they were.
fn three_with_a_faulty_last(sb: &Sandbox, faults: &str) -> Vec<Proc> {
    in_pid_order(sb, &[&[], &[], &[("TMS_SIM_FAULTS", faults)]])
}

fn demo_bytes_active(sb: &Sandbox, p: &Proc) -> u64 {
    tag(&status(sb, p.pid), "demo")["bytes_active"]
        .as_u64()
        .expect("bytes_active")
}

/// `tmsctl OP --all --atomic --tag demo --json`, which must fail on process `failed` (exit 1)
/// and say whether every process is as before: the run and its document.
fn atomic_failure(sb: &Sandbox, op: &str, failed: u32, as_before: bool) -> (Ran, Value) {
    let r = ctl(sb, &[op, "--all", "--atomic", "--tag", "demo", "--json"]);
    let j = r.json_exit(1);
    assert_eq!(j["ok"], false, "{j}");
    assert_eq!(j["failed"]["pid"], failed, "{j}");
    assert_eq!(j["every_process_as_before"], as_before, "{j}");
    (r, j)
}

/// The item of process `pid` in an `--atomic` document.
pub(crate) fn item_of(j: &Value, pid: u32) -> &Value {
    j["processes"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["pid"] == pid))
        .unwrap_or_else(|| panic!("no item of {pid}: {j}"))
}

/// The `--atomic` document `j` reports the undo on process `pid` refused, that pid being another
/// process's now, and does not claim every process as before (`shown` with a failure).
pub(crate) fn assert_undo_refused_as_replaced(j: &Value, pid: u32, shown: &dyn std::fmt::Display) {
    assert_eq!(j["every_process_as_before"], false, "{shown}");
    assert_eq!(
        item_of(j, pid)["undo"]["error"]["message"],
        format!("process {pid} ended; pid {pid} is now another process: not undone"),
        "{shown}"
    );
}

/// `pause --all --atomic`: the third process's pause fails at its first copy (before anything
/// changed there); the two that
/// paused are resumed again from their backups, every process ends active with its pattern, and
/// the output says so. Without --atomic the same failure leaves the first two paused.
#[test]
fn atomic_pause_is_undone_everywhere_when_one_process_fails() {
    let sb = sandbox();
    let mut ps = three_with_a_faulty_last(&sb, "copy_d2h:1,copy_d2h:2");
    let (r, j) = atomic_failure(&sb, "pause", ps[2].pid, true);
    for p in &ps[..2] {
        let item = item_of(&j, p.pid);
        assert_eq!(item["done"]["op"], "pause", "{item}");
        assert_eq!(item["undo"]["op"], "resume", "{item}");
        assert_eq!(item["undo"]["bytes"], SIZE, "{item}");
        // No --pid: each result names its process, as when every process did it.
        let command = item["done"]["command"].as_str().unwrap_or_default();
        assert!(command.contains("__demo-child"), "{item}");
    }
    let summary = r.last_stderr_line();
    assert!(
        summary.contains("failed on process")
            && summary.contains("undone on 2 processes: every process is as before"),
        "{}",
        r.dump()
    );
    for p in ps.iter_mut() {
        assert_eq!(demo_bytes_active(&sb, p), SIZE, "pid {}", p.pid);
        p.verify();
    }
    // Without --atomic the first two stay paused.
    let r = ctl(&sb, &["pause", "--all", "--tag", "demo"]);
    assert_eq!(r.code, 1, "{}", r.dump());
    assert_eq!(demo_bytes_active(&sb, &ps[0]), 0);
}

/// `resume --all --atomic`: the third process cannot resume (out of memory at its create); the
/// two that resumed are paused again, so every process ends paused with its backup; the next
/// atomic resume succeeds everywhere with the patterns intact.
#[test]
fn atomic_resume_is_undone_everywhere_when_one_process_runs_out_of_memory() {
    let sb = sandbox();
    let mut ps = three_with_a_faulty_last(&sb, "create:2:oom");
    ok(&sb, &["pause", "--all", "--tag", "demo"]);
    let r = ctl(&sb, &["resume", "--all", "--atomic", "--tag", "demo"]);
    assert_eq!(r.code, 1, "{}", r.dump());
    assert!(
        r.stderr.contains("out of memory") || r.stderr.contains("OUT_OF_MEMORY"),
        "{}",
        r.dump()
    );
    assert!(
        r.stderr
            .contains("undone on 2 processes: every process is as before"),
        "{}",
        r.dump()
    );
    assert_eq!(
        r.stdout.matches(": undone: paused tag").count(),
        2,
        "{}",
        r.dump()
    );
    assert!(
        r.stdout.contains("nothing to undo (nothing had changed)"),
        "{}",
        r.dump()
    );
    for p in &ps {
        assert_eq!(demo_bytes_active(&sb, p), 0, "pid {}", p.pid);
    }
    let r = ok(
        &sb,
        &["resume", "--all", "--atomic", "--tag", "demo", "--json"],
    );
    let j = r.json();
    assert_eq!(
        (j["ok"].as_bool(), j["processes"].as_array().map(Vec::len)),
        (Some(true), Some(3)),
        "{j}"
    );
    for p in ps.iter_mut() {
        assert_eq!(demo_bytes_active(&sb, p), SIZE, "pid {}", p.pid);
        p.verify();
    }
}

/// `pause --all --atomic --tag demo --timeout 1 --json`, which a slow process makes end with
/// exit 7 (still running): the run and its document.
fn atomic_pause_with_a_1s_timeout(sb: &Sandbox) -> (Ran, Value) {
    let args = "pause --all --atomic --tag demo --timeout 1 --json";
    let r = ctl(sb, &args.split(' ').collect::<Vec<_>>());
    let j = r.json_exit(7);
    (r, j)
}

/// Issue 36, item 2: the third process's pause is still running at --timeout (exit 7; its
/// device synchronizes slowly). The undo waits for it to end, then restores it as the others:
/// every process is as before, and the document says so only then.
#[test]
fn an_atomic_pause_still_running_at_the_timeout_is_waited_for_and_undone() {
    let sb = sandbox();
    // The slow one is asked last.
    let mut ps = in_pid_order(&sb, &[&[], &[], &[("TMS_SIM_SYNC_DELAY_MS", "1800")]]);
    let (_, j) = atomic_pause_with_a_1s_timeout(&sb);
    assert_eq!(j["every_process_as_before"], true, "{j}");
    let last = ps.last().unwrap().pid;
    let item = item_of(&j, last);
    assert_eq!(item["undo"]["op"], "resume", "undone once it ended: {item}");
    for p in ps.iter_mut() {
        assert_eq!(demo_bytes_active(&sb, p), SIZE, "pid {}", p.pid);
        p.verify();
    }
}

/// A tag longer than replies show whole (1 KiB; beyond it, its first KiB, then its length and
/// hash): its pause still running at --timeout is waited for and undone as any other. (tmsctl
/// compared the whole tag with the one `status` shows: it saw neither the pause running nor the
/// tag's bytes, called the process as before at once, and the pause then left it paused.)
#[test]
fn an_atomic_pause_of_a_tag_longer_than_replies_show_is_waited_for_and_undone() {
    let sb = sandbox();
    let long = "k".repeat(1500);
    let mut p = Proc::start_tagged(&sb, &long, &[("TMS_SIM_SYNC_DELAY_MS", "1800")], |_| {});
    let args = [
        "pause",
        "--all",
        "--atomic",
        "--tag",
        &long,
        "--timeout",
        "1",
        "--json",
    ];
    let r = ctl(&sb, &args);
    let j = r.json_exit(7);
    assert_eq!(j["every_process_as_before"], true, "{}", r.dump());
    assert_eq!(item_of(&j, p.pid)["undo"]["op"], "resume", "{}", r.dump());
    let s = status(&sb, p.pid);
    assert!(s.get("operations").is_none(), "ended: {s}");
    assert_eq!(s["tags"][0]["bytes_active"], SIZE, "active again: {s}");
    p.verify();
}

/// Issue 36, item 2: a pause that goes on without moving for --timeout after the others were
/// undone is reported as not undone, and the job as not as before; it then completes.
#[test]
fn an_atomic_pause_that_never_ends_in_time_is_reported_not_as_before() {
    let sb = sandbox();
    let (mut a, mut slow) = two_in_pid_order(&sb, &[], &[("TMS_SIM_SYNC_DELAY_MS", "6000")]);
    let (r, j) = atomic_pause_with_a_1s_timeout(&sb);
    assert_eq!(j["every_process_as_before"], false, "{j}");
    assert!(
        r.stderr.contains("NOT every process is as before") && r.stderr.contains("still running"),
        "{}",
        r.dump()
    );
    assert_eq!(demo_bytes_active(&sb, &a), SIZE, "the other is undone");
    a.verify();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(&sb, slow.pid);
        if s.get("operations").is_none() {
            assert_eq!(tag(&s, "demo")["bytes_paused"], SIZE, "as reported: {s}");
            break;
        }
        assert!(Instant::now() < deadline, "never ended: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
    ok(
        &sb,
        &["resume", "--pid", &slow.pid.to_string(), "--tag", "demo"],
    );
    slow.verify();
}

/// Issue 36, item 3: a tag with an allocation kept resident was active before the resume, but
/// a pause leaves that one mapped: the undo (a pause) is exact and runs.
#[test]
fn an_atomic_resume_is_undone_where_only_a_resident_allocation_was_active() {
    let sb = sandbox();
    // b's creates: the demo's, the resident one's, then the resume's: out of memory.
    let (mut a, mut b) = two_in_pid_order(&sb, &[], &[("TMS_SIM_FAULTS", "create:3:oom")]);
    for p in [&mut a, &mut b] {
        let r = p.cmd("resident 2MiB", "RESIDENT");
        assert!(r.starts_with("0 "), "{r}");
    }
    ok(&sb, &["pause", "--all", "--tag", "demo"]);
    assert_eq!(tag(&status(&sb, a.pid), "demo")["resident_allocations"], 1);
    let r = ctl(&sb, &["resume", "--all", "--atomic", "--tag", "demo"]);
    assert_eq!(r.code, 1, "{}", r.dump());
    assert!(
        r.stdout.contains(": undone: paused tag") && !r.stdout.contains("not undone"),
        "{}",
        r.dump()
    );
    assert!(
        r.stderr.contains("every process is as before"),
        "{}",
        r.dump()
    );
    for p in [&a, &b] {
        assert_eq!(
            demo_bytes_active(&sb, p),
            2 << 20,
            "only the resident one: {}",
            p.pid
        );
    }
}

/// Issue 36, item 4: `pause --atomic` records chunk states for its undo in the job's record:
/// the program's (here saved with `--save-chunk-state`) is still there for its restore.
#[test]
fn an_atomic_pause_keeps_the_programs_chunk_state_record() {
    let sb = sandbox();
    let _p = Proc::start_with(&sb, &[], |c| {
        c.args(["--chunk", "2MiB"]);
    });
    let states = |sb: &Sandbox| {
        ok(sb, &["chunks", "--tag", "demo", "--json"]).json()["states"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    ok(&sb, &["pause", "--tag", "demo", "--chunks", "1"]);
    ok(&sb, &["pause", "--tag", "demo", "--save-chunk-state"]);
    ok(&sb, &["resume", "--tag", "demo"]);
    assert_eq!(states(&sb), "1111");
    ok(&sb, &["pause", "--all", "--atomic", "--tag", "demo"]);
    ok(&sb, &["resume", "--tag", "demo"]);
    ok(&sb, &["pause", "--tag", "demo"]);
    ok(&sb, &["resume", "--tag", "demo", "--restore-chunk-state"]);
    assert_eq!(states(&sb), "1011", "the program's record, not the job's");
}

/// Two processes, tag "demo" paused in both; the second's `--no-wait` resume failed after the
/// answer (its first copy to the device wrote its pattern, the second, the restore, fails), so
/// its tag is unrestored. `more_faults` are the second's further faults (",prim:nth[:code]").
fn two_with_a_failed_restore(sb: &Sandbox, more_faults: &str) -> (Proc, Proc) {
    let faults = format!("copy_h2d:2{more_faults}");
    let (a, b) = two_in_pid_order(sb, &[], &[("TMS_SIM_FAULTS", faults.as_str())]);
    ok(sb, &["pause", "--all", "--tag", "demo"]);
    let bp = b.pid.to_string();
    ok(sb, &["resume", "--pid", &bp, "--tag", "demo", "--no-wait"]);
    let deadline = Instant::now() + Duration::from_secs(15);
    while tag(&status(sb, b.pid), "demo")["failed_restore"].is_null() {
        assert!(
            Instant::now() < deadline,
            "no failed restore in {}",
            status(sb, b.pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (a, b)
}

/// A process whose `--no-wait` restore failed after the answer (its tag unrestored: neither
/// active nor paused) is asked to resume under --atomic: its resume restores the memory, then
/// reports that earlier failure. It changed, so the undo pauses it again with the others (before,
/// it was left resumed, as "nothing had changed", in a job claimed as before). Paused is not
/// "unrestored" (the memory is given back, the failure settled): tmsctl says that process is not
/// as before. The next resume brings every pattern back.
#[test]
fn an_atomic_resume_that_reports_an_earlier_failed_restore_is_undone_too() {
    let sb = sandbox();
    let (mut a, mut b) = two_with_a_failed_restore(&sb, "");
    let (r, j) = atomic_failure(&sb, "resume", b.pid, false);
    let summary = r.last_stderr_line();
    assert!(
        summary.contains(&format!("process {}", b.pid)) && summary.contains("not as before"),
        "{}",
        r.dump()
    );
    assert_eq!(item_of(&j, b.pid)["undo"]["op"], "pause", "{j}");
    for p in [&a, &b] {
        assert_eq!(demo_bytes_active(&sb, p), 0, "pid {}: {}", p.pid, r.dump());
    }
    let r = ok(
        &sb,
        &["resume", "--all", "--atomic", "--tag", "demo", "--json"],
    );
    let j = r.json();
    assert_eq!(j["ok"], true, "{j}");
    assert!(
        j["failed"].is_null() && j["every_process_as_before"].is_null(),
        "{j}"
    );
    assert_eq!(j["not_asked"], Value::Array(Vec::new()), "{j}");
    for i in j["processes"].as_array().expect("processes") {
        assert_eq!(i["done"]["op"], "resume", "{j}");
        assert!(i["undo"].is_null(), "{j}");
    }
    a.verify();
    b.verify();
}

/// A process whose `--no-wait` restore is still under way when `resume --atomic` asks it: its
/// memory is being restored, neither paused nor active, and a pause would not bring it back to
/// that. When another process fails, its undo is skipped and said so, and tmsctl does not claim
/// every process as before (before, it paused the memory being restored and claimed so).
#[test]
fn an_atomic_resume_never_calls_a_process_restoring_memory_as_before() {
    let sb = sandbox();
    let (mut a, b) = two_in_pid_order(
        &sb,
        &[("TMS_SIM_BANDWIDTH", "4MiB")],
        &[("TMS_SIM_FAULTS", "create:2:oom")],
    );
    ok(&sb, &["pause", "--all", "--tag", "demo"]);
    ok(
        &sb,
        &[
            "resume",
            "--pid",
            &a.pid.to_string(),
            "--tag",
            "demo",
            "--no-wait",
        ],
    );
    let (r, _) = atomic_failure(&sb, "resume", b.pid, false);
    let summary = r.last_stderr_line();
    assert!(
        summary.contains("NOT every process is as before")
            && summary.contains(&format!("process {}", a.pid))
            && summary.contains("was restoring"),
        "{}",
        r.dump()
    );
    assert_eq!(demo_bytes_active(&sb, &a), SIZE, "a's restore went on");
    a.verify();
}

/// Each process's tag is partly active (a new allocation beside the paused one), so a resume
/// cannot be undone exactly: the processes that resumed are left resumed and said so. The one
/// whose resume failed (out of memory) undid it itself and is as before: "nothing to undo", not
/// "left resumed" (before, it was listed as not as before too).
#[test]
fn an_atomic_resume_that_failed_and_undid_itself_is_not_called_changed() {
    let sb = sandbox();
    let mut ps = three_with_a_faulty_last(&sb, "create:3:oom");
    ok(&sb, &["pause", "--all", "--tag", "demo"]);
    for p in ps.iter_mut() {
        let pid = p.pid.to_string();
        ok(
            &sb,
            &[
                "region",
                "--pid",
                &pid,
                "--enable",
                "--tag",
                "demo",
                "--cpu-backup",
            ],
        );
        assert!(p.cmd("malloc 2MiB", "MALLOC").starts_with("0 0x"));
    }
    let (r, j) = atomic_failure(&sb, "resume", ps[2].pid, false);
    let undo_of = |pid: u32| {
        item_of(&j, pid)["undo"]["skipped"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    for p in &ps[..2] {
        assert!(undo_of(p.pid).contains("left resumed"), "{j}");
    }
    assert_eq!(undo_of(ps[2].pid), "nothing had changed", "{j}");
    let summary = r.last_stderr_line();
    assert!(
        !summary.contains(&format!("process {}: not undone", ps[2].pid)),
        "{}",
        r.dump()
    );
    assert_eq!(
        demo_bytes_active(&sb, &ps[2]),
        2 << 20,
        "as before: the new allocation only"
    );
    ok(
        &sb,
        &["resume", "--pid", &ps[2].pid.to_string(), "--tag", "demo"],
    );
    for p in ps.iter_mut() {
        p.verify();
    }
}

/// A process whose tag a failed `--no-wait` restore left unrestored is asked to resume under
/// --atomic, and that resume fails too (out of memory) and undoes itself: its memory is now
/// paused, given back, not unrestored as before. tmsctl says so, and does not call that process
/// unchanged (before, it said "nothing had changed" and the job was claimed as before).
#[test]
fn an_atomic_resume_that_failed_over_unrestored_memory_is_not_called_unchanged() {
    let sb = sandbox();
    // Its third creation is the --atomic resume's.
    let (a, mut b) = two_with_a_failed_restore(&sb, ",create:3:oom");
    let bp = b.pid.to_string();
    let (r, j) = atomic_failure(&sb, "resume", b.pid, false);
    let undo_of_b = item_of(&j, b.pid)["undo"]["skipped"]
        .as_str()
        .unwrap_or_default();
    assert!(
        undo_of_b.contains("left unrestored") && undo_of_b.contains("not as before"),
        "{j}"
    );
    let summary = r.last_stderr_line();
    assert!(
        summary.contains("NOT every process is as before")
            && summary.contains(&format!("process {}", b.pid)),
        "{}",
        r.dump()
    );
    let s = status(&sb, b.pid);
    let t = tag(&s, "demo");
    assert_eq!(t["bytes_paused"], SIZE, "{s}");
    assert!(t["failed_restore"].is_null(), "{s}");
    // Paused with its backup: the next resume brings b's pattern back.
    ok(&sb, &["resume", "--pid", &bp, "--tag", "demo"]);
    b.verify();
    drop(a);
}

/// A server of this test process with tag "demo" of 4 chunks, all active, whose program pauses
/// chunk 2 itself as soon as a pause of chunks is answered (between tmsctl's pause and its
/// undo): its chunk states, and the requests it was asked.
fn chunked_server_whose_program_pauses_chunk_2(dir: &std::path::Path) -> Fake {
    use std::sync::{Arc, Mutex};
    let me = std::process::id();
    let states = Arc::new(Mutex::new(vec![true; 4]));
    let answer: Answer = Arc::new(move |req: &Value| -> String {
        let mut st = states.lock().unwrap();
        match req["op"].as_str() {
            Some("chunks") => serde_json::json!({
                "reply": "chunks", "tag": "demo", "addr": 1u64 << 32, "chunk_size": 2u64 << 20,
                "count": 4, "states": st.iter().map(|a| if *a { '1' } else { '0' })
                    .collect::<String>(),
            })
            .to_string(),
            Some(op @ ("pause" | "resume")) => {
                let ranges = req["chunks"].as_array().cloned().unwrap_or_default();
                let mut moved = 0u64;
                for r in &ranges {
                    let (a, b) = (r[0].as_u64().unwrap(), r[1].as_u64().unwrap());
                    for i in a..=b {
                        let s = &mut st[i as usize];
                        moved += u64::from(*s != (op == "resume"));
                        *s = op == "resume";
                    }
                }
                if op == "pause" {
                    st[2] = false;
                }
                serde_json::json!({
                    "reply": "done", "op": op, "tag": "demo", "chunks": ranges,
                    "allocations": 1, "bytes": moved * (2 << 20), "copied_bytes": 0,
                    "seconds": 0.01,
                })
                .to_string()
            }
            _ => "{\"reply\":\"error\",\"kind\":\"unsupported\",\"message\":\"no\"}".to_string(),
        }
    });
    Fake::start_with_features(dir, &our_name(me), me, answer, &["chunks"])
}

/// `pause --atomic --chunks 0` of two processes, the second's failing: the first's undo resumes
/// the chunk the pause took, and only that one; chunk 2, which the program paused itself
/// meanwhile, stays paused. (The undo resumed every chunk whose state had changed since before
/// the pause, chunk 2 included: it undid the program's own pause, and said it had undone the
/// job's.)
#[test]
fn an_atomic_chunk_pause_is_undone_on_the_chunks_it_paused_only() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let fake = chunked_server_whose_program_pauses_chunk_2(dir);
    let faulty = started_after_us(|| {
        Proc::start_with(&sb, &[("TMS_SIM_FAULTS", "copy_d2h:1,copy_d2h:2")], |c| {
            c.args(["--chunk", "2MiB"]);
        })
    });
    let args = [
        "pause", "--all", "--atomic", "--tag", "demo", "--chunks", "0", "--json",
    ];
    let r = ctl(&sb, &args);
    let j = r.json_exit(1);
    assert_eq!(j["failed"]["pid"], faulty.pid, "{}", r.dump());
    let undo = &item_of(&j, std::process::id())["undo"];
    assert_eq!(undo["op"], "resume", "{}", r.dump());
    assert_eq!(undo["chunks"], serde_json::json!([[0, 0]]), "{}", r.dump());
    let resumes = fake
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter(|q| q["op"] == "resume")
        .map(|q| q["chunks"].clone())
        .collect::<Vec<_>>();
    assert_eq!(resumes, vec![serde_json::json!([[0, 0]])], "{}", r.dump());
}

/// A tag no process ever had is exit 6 with `--atomic` as without it, told on stderr (it used to
/// be exit 0, "nothing to do"): a job-wide pause guarded by `--atomic` must notice a typo.
#[test]
fn an_atomic_pause_or_resume_of_an_unknown_tag_is_exit_6() {
    let sb = sandbox();
    let p = Proc::start(&sb, &[]);
    for op in ["pause", "resume"] {
        for sel in [&["--all"][..], &["--pid", &p.pid.to_string()][..]] {
            let mut args = vec![op, "--atomic", "--tag", "demoo"];
            args.extend_from_slice(sel);
            let r = ctl(&sb, &args);
            let line = r.failed(6).to_string();
            assert!(line.contains("ever had tag \"demoo\""), "{line}");
            assert_eq!(r.stdout, "", "{}", r.dump());
            args.push("--json");
            let j = ctl(&sb, &args).json_exit(6);
            assert_eq!(item_of(&j, p.pid)["done"]["unknown_tag"], true, "{j}");
        }
    }
    ok(&sb, &["pause", "--atomic", "--all", "--tag", "demo"]);
    ok(&sb, &["resume", "--atomic", "--all", "--tag", "demo"]);
    p.exit();
}

/// A process that fails before it is asked (a socket of a live pid that another process serves:
/// refused on connecting) is one of the processes of the document, with its failure, as any
/// other that failed.
#[test]
fn an_atomic_failure_before_asking_is_in_the_processes_too() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let victim = Victim::start();
    let _impostor =
        std::os::unix::net::UnixListener::bind(sb.dir.join(our_name(victim.pid()))).expect("bind");
    let r = ctl(
        &sb,
        &["pause", "--all", "--atomic", "--tag", "demo", "--json"],
    );
    let j = r.json_exit(4);
    assert_eq!(j["failed"]["pid"], victim.pid(), "{j}");
    let item = item_of(&j, victim.pid());
    assert_eq!(item["failed"]["error"]["name"], "permission", "{item}");
    assert_eq!(j["every_process_as_before"], true, "{j}");
    assert_eq!(demo_bytes_active(&sb, &p), SIZE);
    p.verify();
}
