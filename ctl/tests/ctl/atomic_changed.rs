//! `pause|resume --atomic` against fake servers whose pause or resume fails: the undo follows
//! what the failed call says it changed (`changed`), or, from an older server that does not
//! say, the tag's active bytes.

use serde_json::Value;

use crate::atomic::{assert_undo_refused_as_replaced, item_of};
use crate::common::*;

/// The numbers of tag "kv" in a [`failing_server`]'s status: active allocations and bytes,
/// paused allocations and bytes.
type KvState = (u64, u64, u64, u64);

/// A server of this test process (tag "kv") whose `op` (pause or resume) fails with an error
/// reply saying what it changed all the same (`changed`; left out, as by a server that predates
/// it, where `None`), while its program changes the tag meanwhile: its status shows `before`
/// until that failure, then `after`. Every other pause or resume succeeds.
fn failing_server(
    dir: &std::path::Path,
    op: &'static str,
    changed: Option<Value>,
    before: KvState,
    after: KvState,
) -> Fake {
    let answer = failing_answer(op, changed, before, after);
    let me = std::process::id();
    Fake::start_with_features(dir, &our_name(me), me, answer, &["chunks", "job_record"])
}

/// What a [`failing_server`] answers.
fn failing_answer(
    op: &'static str,
    changed: Option<Value>,
    before: KvState,
    after: KvState,
) -> Answer {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let me = std::process::id();
    let failed = Arc::new(AtomicBool::new(false));
    Arc::new(move |req: &Value| -> String {
        match req["op"].as_str() {
            Some("status") => {
                let (aa, ab, pa, pb) = if failed.load(Ordering::SeqCst) {
                    after
                } else {
                    before
                };
                serde_json::json!({
                    "reply": "status", "pid": me, "backend": "sim", "retain_cpu_backup": false,
                    "memory_margin_bytes": 0, "devices": [],
                    "tags": [{"tag": "kv", "allocations": aa + pa, "active_allocations": aa,
                              "paused_allocations": pa, "bytes_requested": ab + pb,
                              "bytes_active": ab, "bytes_paused": pb, "host_backup_bytes": pb}],
                })
                .to_string()
            }
            Some(o) if o == op && !failed.swap(true, Ordering::SeqCst) => {
                let mut e = serde_json::json!({
                    "reply": "error", "kind": "out_of_memory",
                    "message": format!("out of memory: {o} of tag \"kv\""),
                });
                if let Some(c) = &changed {
                    e["changed"] = c.clone();
                }
                e.to_string()
            }
            Some(o @ ("pause" | "resume")) => serde_json::json!({
                "reply": "done", "op": o, "tag": "kv", "allocations": 1,
                "bytes": 8u64 << 20, "copied_bytes": 8u64 << 20, "seconds": 0.01,
            })
            .to_string(),
            _ => "{\"reply\":\"error\",\"kind\":\"unsupported\",\"message\":\"no\"}".to_string(),
        }
    })
}

/// `tmsctl OP --pid <this process> --atomic --tag kv --json` of a [`failing_server`], which
/// fails there (exit 1): its document, and the item of the process.
fn atomic_on_failing(sb: &Sandbox, op: &str) -> (Value, Value) {
    let me = std::process::id().to_string();
    let r = ctl(sb, &[op, "--pid", &me, "--atomic", "--tag", "kv", "--json"]);
    let j = r.json_exit(1);
    let item = item_of(&j, std::process::id()).clone();
    (j, item)
}

/// A pause that failed having paused nothing (its reply says so) while the program allocated in
/// the tag meanwhile: nothing is undone, nothing is resumed. (tmsctl judged by the tag's active
/// bytes, which had changed, and restored the recorded state: a restore the failed pause never
/// called for.)
#[test]
fn an_atomic_pause_that_failed_having_paused_nothing_is_not_restored() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let changed = serde_json::json!({"allocations": 0, "bytes": 0});
    let fake = failing_server(
        dir,
        "pause",
        Some(changed),
        (1, 8 << 20, 0, 0),
        (2, 10 << 20, 0, 0),
    );
    let (j, item) = atomic_on_failing(&sb, "pause");
    assert_eq!(item["undo"]["skipped"], "nothing had changed", "{j}");
    assert_eq!(j["every_process_as_before"], true, "{j}");
    assert!(
        !fake.ops().contains(&"resume".to_string()),
        "{:?}",
        fake.ops()
    );
}

/// The converse: a pause that failed after pausing one allocation (its reply says so) while the
/// program allocated as much meanwhile, so that the tag's active bytes are what they were: the
/// restore runs. (tmsctl saw the same active bytes, called the process unchanged and left the
/// allocation paused.)
#[test]
fn an_atomic_pause_that_failed_part_way_is_restored_whatever_the_program_did() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let changed = serde_json::json!({"allocations": 1, "bytes": 8u64 << 20});
    let fake = failing_server(
        dir,
        "pause",
        Some(changed),
        (2, 16 << 20, 0, 0),
        (2, 16 << 20, 1, 8 << 20),
    );
    let (j, item) = atomic_on_failing(&sb, "pause");
    assert_eq!(item["undo"]["op"], "resume", "{j}");
    assert_eq!(j["every_process_as_before"], true, "{j}");
    let resumes: Vec<Value> = fake
        .requests
        .lock()
        .unwrap()
        .iter()
        .filter(|q| q["op"] == "resume")
        .cloned()
        .collect();
    assert_eq!(resumes.len(), 1, "{resumes:?}");
    assert_eq!(resumes[0]["chunk_state"], true, "{resumes:?}");
}

/// A server that predates the report (its failure reply says nothing of what changed): tmsctl
/// judges by the tag's active bytes, as it always did; here they changed, so it restores.
#[test]
fn an_atomic_pause_failed_on_an_older_server_is_judged_by_its_active_bytes() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let fake = failing_server(dir, "pause", None, (1, 8 << 20, 0, 0), (2, 10 << 20, 0, 0));
    let (j, item) = atomic_on_failing(&sb, "pause");
    assert_eq!(item["undo"]["op"], "resume", "{j}");
    assert!(
        fake.ops().contains(&"resume".to_string()),
        "{:?}",
        fake.ops()
    );
}

/// A resume of a tag wholly paused before, that failed having resumed nothing (its reply says
/// so) while the program allocated in the tag meanwhile: nothing is paused again. (tmsctl saw
/// active memory in the tag and paused it: the program's new allocation, which the failed
/// resume never touched.)
#[test]
fn an_atomic_resume_that_failed_having_resumed_nothing_is_not_paused_again() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let changed = serde_json::json!({"allocations": 0, "bytes": 0});
    let fake = failing_server(
        dir,
        "resume",
        Some(changed),
        (0, 0, 1, 8 << 20),
        (1, 2 << 20, 1, 8 << 20),
    );
    let (j, item) = atomic_on_failing(&sb, "resume");
    assert_eq!(item["undo"]["skipped"], "nothing had changed", "{j}");
    assert_eq!(j["every_process_as_before"], true, "{j}");
    assert!(
        !fake.ops().contains(&"pause".to_string()),
        "{:?}",
        fake.ops()
    );
}

/// A resume of a tag partly active before (which cannot be undone exactly) that failed after
/// resuming an allocation (its reply says so) while the program freed as much meanwhile: the
/// process is reported as left resumed, not as before. (tmsctl saw the same active bytes and
/// called it unchanged.)
#[test]
fn an_atomic_resume_that_failed_after_resuming_is_not_called_unchanged() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let changed = serde_json::json!({"allocations": 1, "bytes": 8u64 << 20});
    let fake = failing_server(
        dir,
        "resume",
        Some(changed),
        (1, 8 << 20, 1, 8 << 20),
        (1, 8 << 20, 0, 0),
    );
    let (j, item) = atomic_on_failing(&sb, "resume");
    let why = item["undo"]["skipped"].as_str().unwrap_or_default();
    assert!(why.contains("left resumed"), "{j}");
    assert_eq!(j["every_process_as_before"], false, "{j}");
    assert!(
        !fake.ops().contains(&"pause".to_string()),
        "{:?}",
        fake.ops()
    );
}

/// A chunk pause (of chunk 0 of tag "kv", 2 chunks) that fails, its program pausing chunk 0 itself
/// meanwhile; its error reply says it changed nothing (`changed` as given; left out where `None`).
fn failing_chunk_server(dir: &std::path::Path, changed: Option<Value>) -> Fake {
    use std::sync::{Arc, Mutex};
    let me = std::process::id();
    let states = Arc::new(Mutex::new(vec![true; 2]));
    let answer: Answer = Arc::new(move |req: &Value| -> String {
        let mut st = states.lock().unwrap();
        match req["op"].as_str() {
            Some("chunks") => serde_json::json!({
                "reply": "chunks", "tag": "kv", "addr": 1u64 << 32, "chunk_size": 2u64 << 20,
                "count": 2, "states": st.iter().map(|a| if *a { '1' } else { '0' })
                    .collect::<String>(),
            })
            .to_string(),
            Some("pause") => {
                st[0] = false;
                let mut e = serde_json::json!({
                    "reply": "error", "kind": "driver", "message": "cuMemcpyDtoH failed",
                });
                if let Some(c) = &changed {
                    e["changed"] = c.clone();
                }
                e.to_string()
            }
            Some("resume") => {
                st[0] = true;
                serde_json::json!({
                    "reply": "done", "op": "resume", "tag": "kv", "chunks": req["chunks"],
                    "allocations": 1, "bytes": 2u64 << 20, "copied_bytes": 0, "seconds": 0.01,
                })
                .to_string()
            }
            _ => "{\"reply\":\"error\",\"kind\":\"unsupported\",\"message\":\"no\"}".to_string(),
        }
    });
    Fake::start_with_features(dir, &our_name(me), me, answer, &["chunks"])
}

/// A chunk pause that failed having paused nothing (its reply says so) while the program paused
/// that chunk itself meanwhile: the program's pause is left alone. (tmsctl saw the chunk go the
/// pause's way and resumed it.) Where the reply does not say, the chunk states decide, as they
/// always did.
#[test]
fn an_atomic_chunk_pause_that_failed_having_paused_nothing_leaves_the_programs_pause() {
    for (said, resumed) in [
        (
            Some(serde_json::json!({"allocations": 0, "bytes": 0})),
            false,
        ),
        (None, true),
    ] {
        let sb = sandbox();
        let dir = private_dir(&sb);
        let fake = failing_chunk_server(dir, said.clone());
        let me = std::process::id().to_string();
        let args = [
            "pause", "--pid", &me, "--atomic", "--tag", "kv", "--chunks", "0", "--json",
        ];
        let r = ctl(&sb, &args);
        let j = r.json_exit(1);
        let undo = &item_of(&j, std::process::id())["undo"];
        assert_eq!(
            fake.ops().contains(&"resume".to_string()),
            resumed,
            "{said:?}: {j}"
        );
        if !resumed {
            assert_eq!(undo["skipped"], "nothing had changed", "{j}");
        }
    }
}

/// `resume --atomic` of a [`failing_server`] whose resume fails having resumed tag "kv" (its
/// undo: a pause), where (`replaced`) the process then ended and its pid went to another
/// process of the library, listening on the same socket name, before the undo reconnects. A
/// pid cannot be reused on demand: tmsctl of a debug build reads start times under
/// `TMSCTL_TEST_PROC`, and the server changes its own as its resume fails. Its document and
/// the operations the server was asked for.
#[cfg(debug_assertions)]
fn resume_failing_then(sb: &Sandbox, replaced: bool) -> (Value, Vec<String>) {
    let me = std::process::id();
    let dir = private_dir(sb);
    let (proc_root, write) = fake_proc(sb, me);
    let changed = serde_json::json!({"allocations": 1, "bytes": 8u64 << 20});
    let inner = failing_answer(
        "resume",
        Some(changed),
        (0, 0, 1, 8 << 20),
        (1, 8 << 20, 0, 0),
    );
    let answer: Answer = std::sync::Arc::new(move |req: &Value| {
        if replaced && req["op"] == "resume" {
            write(2000);
        }
        inner(req)
    });
    let fake = Fake::start_with_features(dir, &our_name(me), me, answer, &["chunks", "job_record"]);
    let me_s = me.to_string();
    let args = [
        "resume", "--pid", &me_s, "--atomic", "--tag", "kv", "--json",
    ];
    let r = ctl_with(&tmsctl(), sb, &args, |c| {
        c.env("TMSCTL_TEST_PROC", &proc_root);
    });
    (r.json_exit(1), fake.ops())
}

/// The undo of a failed `resume --atomic` (a pause) never reaches another process given the
/// pid of the one that failed since it was asked, on the same socket name: it would pause that
/// program's memory. The process is reported as not undone, not as before. (tmsctl connected
/// again by the socket's name alone and paused whatever process served it.) Where the process
/// is the same, its undo runs.
#[cfg(debug_assertions)]
#[test]
fn an_atomic_undo_never_reaches_another_process_given_the_pid_since() {
    let me = std::process::id();
    let (j, ops) = resume_failing_then(&sandbox(), true);
    assert_eq!(ops, ["status", "resume"], "{j}");
    assert_undo_refused_as_replaced(&j, me, &j);
    let (j, ops) = resume_failing_then(&sandbox(), false);
    assert_eq!(ops, ["status", "resume", "status", "pause"], "{j}");
    assert_eq!(item_of(&j, me)["undo"]["op"], "pause", "{j}");
}
