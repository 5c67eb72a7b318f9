//! NCCL's communicators as the tag `nccl`, end to end on the simulated device: the C program
//! `tests/c/nccl_prog.c` runs against the NCCL test double (`tests/c/fake_nccl.c`, as an NCCL
//! with `ncclCommSuspend` and one without) with `LD_PRELOAD=libtms.so`, and tmsctl pauses its
//! communicators from outside. Its own checks must pass; these tests check what it printed.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;
use tms_tests::{
    libtms, preloaded_command, run, scrub_env, target_profile_dir, Run, BUILD_OUT_DIR,
};

const MIB: u64 = 1 << 20;

fn nccl_prog() -> PathBuf {
    PathBuf::from(BUILD_OUT_DIR).join("nccl_prog")
}

/// The folder of the NCCL double: with `ncclCommSuspend`, or without (`old`).
fn nccl_dir(old: bool) -> PathBuf {
    PathBuf::from(BUILD_OUT_DIR).join(if old { "nccl-old" } else { "nccl" })
}

/// The program in `mode`, as the end-to-end program runs (preloaded, on the sim, no socket).
fn command(mode: &str, old: bool) -> Command {
    let mut cmd = preloaded_command(&nccl_prog(), mode);
    cmd.env("LD_LIBRARY_PATH", nccl_dir(old));
    cmd
}

fn run_nccl(mode: &str, old: bool, env: &[(&str, &str)]) -> Run {
    let mut cmd = command(mode, old);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let r = run(cmd);
    r.assert_passed(mode);
    assert_eq!(r.stderr, "", "nothing on stderr\n{}", r.dump());
    r
}

fn tag<'a>(stats: &'a Value, name: &str) -> Option<&'a Value> {
    stats["tags"]
        .as_array()
        .expect("tags is an array")
        .iter()
        .find(|t| t["tag"] == name)
}

fn nccl(stats: &Value) -> &Value {
    tag(stats, "nccl").unwrap_or_else(|| panic!("no tag nccl in {stats}"))
}

/// Every way of making a communicator is seen, ending one removes it, and the tag suspends and
/// resumes them (memory given back and taken again, all-reduce right before and after) while
/// every tag leaves them; the stats show NCCL's numbers.
#[test]
fn the_tag_suspends_and_resumes_every_communicator() {
    let r = run_nccl("flow", false, &[]);
    assert!(
        tag(&r.stats("start"), "nccl").is_none(),
        "no entry before NCCL is used"
    );
    let made = r.stats("made");
    let n = nccl(&made);
    assert_eq!(n["allocations"], 3, "{n}");
    assert_eq!(n["nccl"]["communicators"], 3);
    assert_eq!(n["nccl"]["version"], "2.29.7");
    assert_eq!(n["nccl"]["unsupported"], Value::Null);
    assert_eq!(n["nccl"]["suspendable_bytes"], 3 * MIB);
    assert_eq!(n["nccl"]["persistent_bytes"], 3 * 4096);
    assert_eq!(n["nccl"]["total_bytes"], 3 * (MIB + 4096));
    assert_eq!(n["nccl"]["in_all_tags"], false);
    assert_eq!(n["nccl"]["registered_policy"], "keep");

    let s = r.stats("suspended");
    let n = nccl(&s);
    assert_eq!(
        (n["paused_allocations"].clone(), n["bytes_paused"].clone()),
        (3.into(), (3 * MIB).into())
    );
    assert_eq!(n["bytes_active"], 3 * 4096, "what NCCL keeps");
    assert_eq!(n["last_pause"]["bytes"], 3 * MIB);
    assert_eq!(
        tag(&s, "kv").unwrap()["active_allocations"],
        1,
        "memory untouched"
    );

    let n = nccl(&r.stats("resumed")).clone();
    assert_eq!(
        (n["paused_allocations"].clone(), n["bytes_paused"].clone()),
        (0.into(), 0.into())
    );
    assert_eq!(n["last_resume"]["bytes"], 3 * MIB);
    assert_eq!(nccl(&r.stats("destroyed"))["nccl"]["communicators"], 0);
}

/// With `TMS_NCCL_IN_ALL=1` a pause and resume of every tag include the communicators.
#[test]
fn every_tag_includes_them_when_asked() {
    let r = run_nccl("in_all", false, &[("TMS_NCCL_IN_ALL", "1")]);
    let s = r.stats("paused");
    assert_eq!(nccl(&s)["paused_allocations"], 1);
    assert_eq!(tag(&s, "kv").unwrap()["paused_allocations"], 1);
    assert_eq!(nccl(&s)["nccl"]["in_all_tags"], true);
}

/// A suspend failing on the second communicator resumes the first (and a resume failing on
/// the second suspends the first again): all or nothing, and the message says what was undone.
#[test]
fn a_failure_on_one_communicator_undoes_the_others() {
    let r = run_nccl("rollback", false, &[]);
    let e = r.error("suspend");
    for want in [
        "ncclCommSuspend failed with ncclInvalidUsage (5)",
        "pause of tag \"nccl\": suspending communicator 0x",
        "(2 of 3)",
        "injected failure of suspend call 2",
        "the communicator it had suspended was resumed",
    ] {
        assert!(e.contains(want), "{want:?} not in {e}");
    }
    assert_eq!(
        nccl(&r.stats("after-suspend-failure"))["paused_allocations"],
        0
    );
    let e = r.error("resume");
    assert!(
        e.contains("ncclCommResume failed with ncclUnhandledCudaError"),
        "{e}"
    );
    assert!(e.contains("was suspended again"), "{e}");
}

/// `ncclCommAbort` of a communicator whose suspend waits for peers that are gone (PyTorch's
/// watchdog does this to end a hang) reaches NCCL at once: the pause fails and undoes, the
/// communicator leaves, and the survivor pauses again.
#[test]
fn an_abort_ends_a_suspend_that_waits_for_its_peers() {
    let r = run_nccl("abort_hung", false, &[]);
    let e = r.error("pause");
    for want in [
        "ncclCommSuspend failed with ncclRemoteError (6)",
        "(2 of 2)",
        "communicator aborted while suspending",
        "the communicator it had suspended was resumed",
    ] {
        assert!(e.contains(want), "{want:?} not in {e}");
    }
    assert_eq!(nccl(&r.stats("aborted"))["nccl"]["communicators"], 1);
}

/// An NCCL without `ncclCommSuspend`: the tag says so with the version found; nothing else
/// changes (every tag pauses its memory, with `TMS_NCCL_IN_ALL=1` too).
#[test]
fn an_nccl_without_suspend_is_named_and_changes_nothing_else() {
    let r = run_nccl("old", true, &[("TMS_NCCL_IN_ALL", "1")]);
    let why = "NCCL 2.21.5 has no ncclCommSuspend (needs \u{2265} 2.29.7)";
    assert_eq!(
        r.error("pause"),
        format!("unsupported: pause of tag \"nccl\": {why}")
    );
    let old = r.stats("old");
    let n = &nccl(&old)["nccl"];
    assert_eq!(n["unsupported"], why);
    assert_eq!(n["version"], "2.21.5");
    assert_eq!(n["communicators"], 1);
    let p = r.stats("paused");
    assert_eq!(tag(&p, "kv").unwrap()["paused_allocations"], 1);
    assert_eq!(nccl(&p)["paused_allocations"], 0);
}

/// Each entry point the NCCL below lacks is named on stderr, once: not only the first one
/// called (the program gets `ncclSystemError` from each, and no other word on why).
#[test]
fn each_entry_point_nccl_lacks_is_named_once() {
    let r = run(command("missing", false));
    r.assert_passed("missing");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(
        lines,
        [
            "torch-memory-saver: no NCCL library below it provides ncclCommShrink",
            "torch-memory-saver: no NCCL library below it provides ncclCommGrow",
        ],
        "{}",
        r.dump()
    );
}

/// A buffer NCCL registered keeps its allocation mapped (the default), or the pause is refused
/// naming the buffer, its allocation and tag, and both remedies; deregistered, or with its
/// communicator ended, it pauses again.
#[test]
fn registered_buffers_are_kept_resident_or_refused_by_name() {
    let r = run_nccl("registered", false, &[]);
    let kv = |label: &str| tag(&r.stats(label), "kv").unwrap().clone();
    assert_eq!(
        kv("kept")["paused_allocations"],
        1,
        "the registered one stays"
    );
    assert_eq!(
        kv("refused")["paused_allocations"],
        0,
        "a refusal changes nothing"
    );
    let e = r.error("refused");
    for want in [
        "invalid state: pause of tag \"kv\": allocation 0x",
        "(4194304 bytes, tag \"kv\") holds a buffer NCCL registered",
        ", 8192 bytes, ncclCommRegister on communicator 0x",
        "Deregister the buffer first (ncclCommDeregister",
        "TMS_NCCL_REGISTERED=keep",
    ] {
        assert!(e.contains(want), "{want:?} not in {e}");
    }
    assert!(r.error("window").contains("ncclCommWindowRegister"));
    assert_eq!(
        nccl(&r.stats("refused"))["nccl"]["registered_policy"],
        "refuse"
    );
    assert_eq!(nccl(&r.stats("kept"))["nccl"]["registered_buffers"], 1);
    assert_eq!(kv("window-kept")["paused_allocations"], 1);
    assert_eq!(kv("unregistered")["paused_allocations"], 2);
}

/// A deregistration NCCL goes on with in the background keeps its buffer's allocation mapped
/// until the communicator says its calls ended well, then lets it pause.
#[test]
fn a_deregistration_in_the_background_keeps_the_buffer_until_it_ends() {
    let r = run_nccl("deregistering", false, &[]);
    let kv = |label: &str| tag(&r.stats(label), "kv").unwrap().clone();
    assert_eq!(kv("running")["paused_allocations"], 0, "kept while it runs");
    assert_eq!(kv("ended")["paused_allocations"], 1, "paused once it ended");
    assert_eq!(nccl(&r.stats("ended"))["nccl"]["registered_buffers"], 0);
}

/// NCCL's own allocations (making a communicator, `ncclMemAlloc`) are never pauseable, even
/// with every thread in a region; the tag cannot be a region's.
#[test]
fn nccls_own_memory_passes_through_and_the_tag_is_reserved() {
    let r = run_nccl("own_memory", false, &[("TMS_INIT_ENABLE", "1")]);
    let s = r.stats("own");
    assert_eq!(tag(&s, "default").unwrap()["allocations"], 1, "{s}");
    assert!(r.error("reserved").contains("tag \"nccl\" is reserved"));
}

/// The memory NCCL takes again in `ncclCommResume`, which the library calls to resume the tag,
/// is NCCL's too: never pauseable, even with every thread in a region.
#[test]
fn nccls_memory_taken_again_at_resume_passes_through() {
    let r = run_nccl("own_memory_resume", false, &[("TMS_INIT_ENABLE", "1")]);
    let s = r.stats("resumed");
    assert!(tag(&s, "default").is_none(), "no pauseable allocation: {s}");
}

/// Loaded locally (torch mode), the library sees no communicator made; handed over, they
/// pause with the tag, and handing over none forgets them.
#[test]
fn communicators_handed_over_pause_with_the_tag() {
    let mut cmd = command("adopt", false);
    cmd.env_remove("LD_PRELOAD")
        .env("TMS_TEST_LIBTMS", libtms());
    let r = run(cmd);
    r.assert_passed("adopt");
    assert_eq!(nccl(&r.stats("adopted"))["nccl"]["communicators"], 2);
    assert_eq!(nccl(&r.stats("forgotten"))["nccl"]["communicators"], 0);
}

/// tmsctl pauses and resumes the communicators of a running process (`--tag nccl`), and its
/// status shows them.
#[test]
fn tmsctl_pauses_the_tag_from_outside() {
    let tmsctl = target_profile_dir().join("tmsctl");
    assert!(
        tmsctl.is_file(),
        "{} does not exist: run `cargo build --workspace` first",
        tmsctl.display()
    );
    let tmp = tms_tests::temp_dir("tms-nccl-sock-");
    // Made by the server, 0700, as tmsctl wants it.
    let sock = tmp.path().join("s");
    let mut cmd = command("serve", false);
    cmd.env("TMS_CONTROL", "1")
        .env("TMS_SOCKET_DIR", &sock)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut child = cmd.spawn().expect("start the NCCL program");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let mut next = |want: &str| -> String {
        loop {
            line.clear();
            assert!(
                out.read_line(&mut line).expect("read") > 0,
                "the program ended before {want}"
            );
            if let Some(rest) = line.trim_end().strip_prefix(want) {
                return rest.trim().to_string();
            }
        }
    };
    let pid = next("READY");
    let ctl = |args: &[&str]| {
        let mut c = Command::new(&tmsctl);
        scrub_env(&mut c);
        c.env("TMS_SOCKET_DIR", &sock).args(args);
        let o = c.output().expect("run tmsctl");
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "tmsctl {args:?}: {}\n{text}{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        text
    };
    let mut state = |stdin: &mut std::process::ChildStdin| {
        writeln!(stdin, "state").expect("write");
        next("STATE")
    };
    assert_eq!(
        state(&mut stdin),
        format!("suspended=0 live_memory=2 allreduce=1")
    );
    let text = ctl(&["pause", "--pid", &pid, "--tag", "nccl"]);
    assert!(
        text.contains(
            "paused tag \"nccl\": 2 NCCL communicators, 2.00 MiB of device memory released"
        ),
        "{text}"
    );
    assert_eq!(state(&mut stdin), "suspended=2 live_memory=0 allreduce=0");
    let text = ctl(&["status", "--pid", &pid]);
    assert!(
        text.contains(
            "tag \"nccl\": 2 NCCL communicators (2 suspended), NCCL 2.29.7: 2.00 MiB suspendable \
             (2.00 MiB given back), 8.00 KiB persistent"
        ),
        "{text}"
    );
    let j: Value = serde_json::from_str(ctl(&["status", "--pid", &pid, "--json"]).trim())
        .expect("status --json");
    assert_eq!(nccl(&j)["nccl"]["suspended"], 2, "{j}");
    let text = ctl(&["resume", "--pid", &pid, "--tag", "nccl"]);
    assert!(
        text.contains("resumed tag \"nccl\": 2 NCCL communicators"),
        "{text}"
    );
    assert_eq!(state(&mut stdin), "suspended=0 live_memory=2 allreduce=1");
    writeln!(stdin, "quit").expect("write");
    next("RESULT: PASS serve");
    assert!(child.wait().expect("wait").success());
}
