//! End to end in preload mode: the C program `tests/c/e2e_prog.c`, linked against a fake CUDA
//! runtime, runs with `LD_PRELOAD=libtms.so` on the simulated device. Its own checks must all
//! pass; these tests add what only the parent can see (exit status, signals, stderr) and check
//! the JSON and messages it prints.

use serde_json::Value;
use tms_tests::{e2e_command, run, run_e2e, temp_dir, Run};

const MIB: u64 = 1 << 20;

fn tag<'a>(stats: &'a Value, name: &str) -> &'a Value {
    stats["tags"]
        .as_array()
        .expect("tags is an array")
        .iter()
        .find(|t| t["tag"] == name)
        .unwrap_or_else(|| panic!("no tag {name:?} in {stats}"))
}

fn assert_quiet(r: &Run) {
    assert_eq!(r.stderr, "", "nothing on stderr\n{}", r.dump());
}

#[test]
fn basic_flow_pauses_and_resumes_in_place() {
    let r = run_e2e("basic", &[]);
    r.assert_passed("basic");
    assert_quiet(&r);

    let kv = r.region("kv");
    assert_eq!(kv["enabled"], true);
    assert_eq!(kv["tag"], "kv");
    assert_eq!(kv["cpu_backup"], true);
    assert_eq!(kv["backend"], "pinned");
    assert_eq!(kv["depth"], 1);
    let w = r.region("weights");
    assert_eq!(
        (
            w["tag"].clone(),
            w["cpu_backup"].clone(),
            w["depth"].clone()
        ),
        ("weights".into(), false.into(), 2.into())
    );
    assert_eq!(r.region("back-in-kv"), kv);

    let active = r.stats("active");
    assert_eq!(active["backend"], "sim");
    let kv_a = tag(&active, "kv");
    assert_eq!(kv_a["allocations"], 1);
    assert_eq!(kv_a["active_allocations"], 1);
    assert_eq!(kv_a["bytes_requested"], MIB + 123);
    assert_eq!(
        kv_a["bytes_active"],
        2 * MIB,
        "rounded up to the 2 MiB granularity"
    );
    assert_eq!(tag(&active, "weights")["bytes_active"], 4 * MIB);

    let kv_paused = r.stats("kv-paused");
    let k = tag(&kv_paused, "kv");
    assert_eq!(
        (
            k["active_allocations"].clone(),
            k["paused_allocations"].clone()
        ),
        (0.into(), 1.into())
    );
    assert_eq!(k["bytes_active"], 0);
    assert_eq!(k["bytes_paused"], 2 * MIB);
    assert_eq!(
        k["host_backup_bytes"],
        MIB + 123,
        "the backup holds the requested bytes"
    );
    assert_eq!(k["last_pause"]["allocations"], 1);
    assert_eq!(k["last_pause"]["copied_bytes"], MIB + 123);
    assert_eq!(
        tag(&kv_paused, "weights")["bytes_active"],
        4 * MIB,
        "other tags untouched"
    );

    let all = r.stats("all-paused");
    let w = tag(&all, "weights");
    assert_eq!(w["bytes_paused"], 4 * MIB);
    assert_eq!(w["host_backup_bytes"], 0, "no backup was asked for weights");

    let resumed = r.stats("resumed");
    for t in ["kv", "weights"] {
        assert_eq!(tag(&resumed, t)["active_allocations"], 1, "{resumed}");
        assert_eq!(tag(&resumed, t)["paused_allocations"], 0, "{resumed}");
    }

    let freed = r.stats("freed");
    for t in freed["tags"].as_array().expect("tags") {
        assert_eq!(t["allocations"], 0, "everything was freed: {freed}");
        assert_eq!(t["bytes_active"], 0, "{freed}");
    }

    assert!(
        r.error("unmatched-exit")
            .contains("region exit without a matching region enter"),
        "{}",
        r.dump()
    );
    assert!(
        r.error("empty-tag").contains("tag must not be empty"),
        "{}",
        r.dump()
    );
}

#[test]
fn oom_is_cuda_error_memory_allocation_with_a_clear_message() {
    let r = run_e2e("oom", &[("TMS_SIM_CAPACITY", "64MiB")]);
    r.assert_passed("oom");
    assert_quiet(&r);
    let msg = r.error("too-big");
    assert!(msg.starts_with("out of memory: "), "{msg}");
    assert!(
        msg.contains("128.00 MiB") && msg.contains("134217728 bytes"),
        "the size: {msg}"
    );
    assert!(msg.contains("\"big\""), "the tag: {msg}");
    assert!(msg.contains("cuMemCreate"), "the driver call: {msg}");
    let margin = r.error("margin");
    assert!(margin.contains("memory margin of 32.00 MiB"), "{margin}");
    let resume = r.error("resume");
    assert!(resume.starts_with("out of memory: "), "{resume}");
    assert!(
        resume.contains("'a'") || resume.contains("\"a\""),
        "the tag: {resume}"
    );
    let st = r.stats("resume-oom");
    let a = tag(&st, "a");
    assert_eq!(a["paused_allocations"], 1, "a stays paused: {st}");
    assert_eq!(a["host_backup_bytes"], 40 * MIB, "with its backup: {st}");
}

#[test]
fn injected_faults_give_clean_errors_and_no_crash() {
    let r = run_e2e("fault", &[("TMS_SIM_FAULTS", "map:1,copy_d2h:1")]);
    r.assert_passed("fault");
    assert_quiet(&r);
    let alloc = r.error("alloc");
    assert!(
        alloc.starts_with("cuMemMap failed with CUDA_ERROR_UNKNOWN (999): "),
        "{alloc}"
    );
    assert!(alloc.contains("(injected fault)"), "{alloc}");
    assert!(
        alloc.contains("1048576 bytes") && alloc.contains("\"f\""),
        "what failed: {alloc}"
    );
    let pause = r.error("pause");
    assert!(
        pause.starts_with("cuMemcpyDtoHAsync failed with CUDA_ERROR_UNKNOWN (999): "),
        "{pause}"
    );
    assert!(
        pause.contains("pause of") && pause.contains("(injected fault)"),
        "{pause}"
    );
    let st = r.stats("after-failed-pause");
    assert_eq!(tag(&st, "f")["active_allocations"], 1, "still active: {st}");
}

#[test]
fn touching_a_paused_range_dies_of_sigsegv() {
    let r = run_e2e("touch-paused", &[]);
    assert!(r.failed_checks().is_empty(), "{}", r.dump());
    assert!(
        r.stdout.contains("TOUCH: reading the paused allocation"),
        "{}",
        r.dump()
    );
    assert_eq!(
        r.signal(),
        Some(libc::SIGSEGV),
        "killed by SIGSEGV\n{}",
        r.dump()
    );
    assert!(!r.stdout.contains("RESULT"), "{}", r.dump());
}

#[test]
fn init_enable_makes_plain_cuda_malloc_pauseable() {
    let r = run_e2e(
        "init-enable",
        &[
            ("TMS_INIT_ENABLE", "1"),
            ("TMS_INIT_TAG", "boot"),
            ("TMS_INIT_ENABLE_CPU_BACKUP", "yes"),
        ],
    );
    r.assert_passed("init-enable");
    assert_quiet(&r);
    let reg = r.region("init");
    assert_eq!(reg["enabled"], true);
    assert_eq!(reg["tag"], "boot");
    assert_eq!(reg["cpu_backup"], true);
    assert_eq!(reg["depth"], 0, "no region was entered");
    let st = r.stats("paused");
    let boot = tag(&st, "boot");
    assert_eq!(
        boot["allocations"], 2,
        "main thread and second thread: {st}"
    );
    assert_eq!(boot["paused_allocations"], 2, "{st}");
    assert_eq!(boot["host_backup_bytes"], 2 * MIB + 17 + 64 * 1024, "{st}");
    assert_eq!(
        st["tags"].as_array().map(Vec::len),
        Some(1),
        "only the init tag: {st}"
    );
}

/// `TMS_INIT_CPU_BACKUP_BACKEND` is read as the Python package reads it
/// (`resolve_cpu_backup_backend`: white space around it ignored, empty meaning `pinned`), not
/// taken for a malformed value that turns the whole library off.
#[test]
fn a_padded_or_empty_backup_backend_is_read_as_python_reads_it() {
    for (value, backend) in [(" mmap\n", "mmap"), ("", "pinned"), ("  ", "pinned")] {
        let r = run_e2e(
            "init-enable",
            &[
                ("TMS_INIT_ENABLE", "1"),
                ("TMS_INIT_TAG", "boot"),
                ("TMS_INIT_ENABLE_CPU_BACKUP", "yes"),
                ("TMS_INIT_CPU_BACKUP_BACKEND", value),
            ],
        );
        r.assert_passed("init-enable");
        assert_quiet(&r);
        assert_eq!(r.region("init")["backend"], backend, "{value:?}");
    }
}

/// One malformed variable: the library stays out of the way and says so once.
fn check_malformed(var: &str, value: &str, says: &str) {
    let r = run_e2e("malformed", &[(var, value)]);
    r.assert_passed("malformed");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr\n{}", r.dump());
    assert!(lines[0].starts_with("torch-memory-saver: "), "{}", r.dump());
    assert!(
        lines[0].contains(&format!("environment variable {var}")),
        "names {var}\n{}",
        r.dump()
    );
    assert!(lines[0].contains(says), "says {says:?}\n{}", r.dump());
    let e = r.error("region-enter");
    assert!(
        e.contains(&format!("environment variable {var}")) && e.contains(says),
        "{e}"
    );
}

/// Torch mode: PyTorch's allocator gets NULL and raises out-of-memory without reading
/// `tms_last_error`, so the line on stderr is all that names the variable.
#[test]
fn malformed_settings_met_by_the_torch_allocator_are_named_on_stderr() {
    let r = run_e2e("torch-malformed", &[("TMS_INIT_ENABLE", "maybe")]);
    r.assert_passed("torch-malformed");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(
        lines.len() == 1
            && lines[0].starts_with("torch-memory-saver: ")
            && lines[0].contains("environment variable TMS_INIT_ENABLE"),
        "{}",
        r.dump()
    );
}

#[test]
fn malformed_init_enable_passes_through() {
    check_malformed("TMS_INIT_ENABLE", "maybe", "\"maybe\" is not a flag");
}

#[test]
fn malformed_backup_backend_passes_through() {
    check_malformed(
        "TMS_INIT_CPU_BACKUP_BACKEND",
        "floppy",
        "unknown CPU backup backend \"floppy\"",
    );
}

#[test]
fn malformed_backend_passes_through() {
    check_malformed("TMS_BACKEND", "gpu", "unknown backend \"gpu\"");
}

#[test]
fn malformed_sim_settings_pass_through_naming_the_variable() {
    check_malformed("TMS_SIM_CAPACITY", "lots", "\"lots\" is not a byte size");
    check_malformed("TMS_SIM_DEVICES", "0", "not a device count");
    check_malformed("TMS_SIM_GRANULARITY", "3000", "must be a power of two");
    check_malformed("TMS_SIM_FAULTS", "teleport:1", "teleport");
}

#[test]
fn undecodable_init_tag_passes_through_naming_the_variable() {
    use std::os::unix::ffi::OsStrExt;
    let mut cmd = tms_tests::e2e_command("malformed");
    cmd.env("TMS_INIT_TAG", std::ffi::OsStr::from_bytes(b"kv\xff"));
    let r = tms_tests::run(cmd);
    r.assert_passed("malformed");
    assert!(
        r.stderr.lines().count() == 1
            && r.stderr
                .contains("environment variable TMS_INIT_TAG is not valid UTF-8"),
        "{}",
        r.dump()
    );
}

/// A copy setting that is not UTF-8 is malformed like any other (c-abi.md: "a value that is not
/// UTF-8 included"): named in one line, and the library stays out of the way; not taken for an
/// absent variable and silently replaced by the default.
#[test]
fn undecodable_copy_setting_passes_through_naming_the_variable() {
    use std::os::unix::ffi::OsStrExt;
    for var in ["TMS_PIN", "TMS_COPY_THREADS"] {
        let mut cmd = tms_tests::e2e_command("malformed");
        cmd.env(var, std::ffi::OsStr::from_bytes(b"4\xff"));
        let r = tms_tests::run(cmd);
        r.assert_passed("malformed");
        let says = format!("environment variable {var} is not valid UTF-8");
        assert!(
            r.stderr.lines().count() == 1 && r.stderr.contains(&says),
            "{}",
            r.dump()
        );
        assert!(r.error("region-enter").contains(&says), "{}", r.dump());
    }
}

#[test]
fn a_malformed_log_filter_is_named_and_nothing_else_changes() {
    let r = run_e2e("basic", &[("TMS_LOG", "garbage[")]);
    r.assert_passed("basic");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr\n{}", r.dump());
    assert!(
        lines[0].starts_with("torch-memory-saver: environment variable TMS_LOG: \"garbage[\"")
            && lines[0].ends_with("logging stays off"),
        "{}",
        r.dump()
    );
}

/// Every log line names the process (its pid) and, once it has allocated, the device its
/// memory is on: the lines of eight ranks on one stream can be told apart.
#[test]
fn log_lines_name_the_pid_and_the_device() {
    let r = run_e2e("basic", &[("TMS_LOG", "debug")]);
    r.assert_passed("basic");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(lines.len() > 3, "{}", r.dump());
    let pid = format!(" pid={}", r.pid);
    for l in &lines {
        assert!(
            l.contains(&format!("{pid}: ")) || l.contains(&format!("{pid} device=0: ")),
            "{l}\n{}",
            r.dump()
        );
    }
    assert!(
        lines[0].contains(&format!("{pid}: torch-memory-saver active")),
        "no device is known before the first allocation\n{}",
        r.dump()
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains(&format!("{pid} device=0: alloc "))),
        "{}",
        r.dump()
    );
}

#[test]
fn json_log_lines_are_objects_naming_the_pid_and_the_device() {
    let r = run_e2e("basic", &[("TMS_LOG", "debug"), ("TMS_LOG_FORMAT", "json")]);
    r.assert_passed("basic");
    let lines: Vec<Value> = r
        .stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{}", r.dump())))
        .collect();
    assert!(lines.len() > 3, "{}", r.dump());
    for l in &lines {
        assert_eq!(l["pid"], r.pid, "{l}");
        for key in ["timestamp", "level", "target", "message"] {
            assert!(l[key].is_string(), "{key}: {l}");
        }
        assert!(l["fields"].is_object(), "{l}");
    }
    assert_eq!(lines[0]["level"], "INFO", "{}", lines[0]);
    assert_eq!(lines[0]["device"], Value::Null, "{}", lines[0]);
    let alloc = lines
        .iter()
        .find(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("alloc "))
        })
        .unwrap_or_else(|| panic!("no alloc line\n{}", r.dump()));
    assert_eq!(alloc["level"], "DEBUG", "{alloc}");
    assert_eq!(alloc["device"], 0, "{alloc}");
    assert!(
        alloc["target"]
            .as_str()
            .is_some_and(|t| t.starts_with("tms::engine")),
        "{alloc}"
    );
}

#[test]
fn a_malformed_log_format_is_named_and_the_lines_stay_text() {
    let r = run_e2e("basic", &[("TMS_LOG", "info"), ("TMS_LOG_FORMAT", "xml")]);
    r.assert_passed("basic");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some(
            "torch-memory-saver: environment variable TMS_LOG_FORMAT: \"xml\" is not a log \
             format (expected text or json); logging stays text"
        ),
        "{}",
        r.dump()
    );
    assert!(lines.len() > 1, "{}", r.dump());
    for l in &lines[1..] {
        assert!(
            l.contains(&format!(" pid={}", r.pid)) && !l.starts_with('{'),
            "{l}\n{}",
            r.dump()
        );
    }
    // Without TMS_LOG there is no line for it to shape: not even read.
    assert_quiet(&run_e2e("basic", &[("TMS_LOG_FORMAT", "xml")]));
}

#[test]
fn a_device_that_cannot_start_fails_region_allocations_cleanly() {
    // No CUDA device can be used: no driver here, or none visible where there is one.
    let r = run_e2e(
        "bad-device",
        &[("TMS_BACKEND", "cuda"), ("CUDA_VISIBLE_DEVICES", "")],
    );
    r.assert_passed("bad-device");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr\n{}", r.dump());
    assert!(
        lines[0].starts_with("torch-memory-saver: ")
            && lines[0].contains("starting torch-memory-saver"),
        "{}",
        r.dump()
    );
    for e in r.tagged("ERROR") {
        assert!(e.contains("starting torch-memory-saver"), "{e}");
    }
}

#[test]
fn fork_child_passes_through_and_parent_carries_on() {
    let r = run_e2e("fork", &[]);
    r.assert_passed("fork");
    assert_quiet(&r);
    assert!(
        r.stdout.contains("RESULT: PASS fork-child"),
        "the child ran its checks\n{}",
        r.dump()
    );
    let child = r.region("child");
    assert_eq!(child["tag"], "parent", "the child inherited the region");
    assert!(r.error("child-pause").contains("forked"), "{}", r.dump());
}

/// The hooks while `tms_pause` runs on another thread: a `cudaMalloc` in the tag being paused
/// does not wait for it and stays active; a `cudaFree` of an allocation being paused waits for
/// it and succeeds; nothing is lost.
#[test]
fn hooks_during_a_pause_on_another_thread() {
    let r = run_e2e("hooks-during-pause", &[("TMS_SIM_SYNC_DELAY_MS", "1500")]);
    r.assert_passed("hooks-during-pause");
}

/// A child of `_Fork()`, which runs no `pthread_atfork` handler, is told by its pid: its hooks
/// pass through, its API refuses, and it never waits for locks a thread of the parent held.
#[test]
fn a_child_of_raw_fork_passes_through_and_never_waits() {
    let r = run_e2e("fork-raw", &[("TMS_SIM_SYNC_DELAY_MS", "1500")]);
    r.assert_passed("fork-raw");
    for child in ["fork-raw-child", "fork-raw-busy-child"] {
        assert!(
            r.stdout.contains(&format!("RESULT: PASS {child}")),
            "{child} ran its checks\n{}",
            r.dump()
        );
    }
}

/// A socket folder whose name is not UTF-8 (TMS_SOCKET_DIR takes any path): the path
/// `tms_control_socket` gives is the socket's own bytes, one a program can connect to, not a
/// readable lookalike of it.
#[test]
fn the_control_socket_path_is_the_sockets_own_bytes() {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::DirBuilderExt;
    let tmp = temp_dir("tms-sock-");
    let dir = tmp.path().join(std::ffi::OsStr::from_bytes(b"caf\xe9"));
    std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
    let mut cmd = e2e_command("socket-path");
    cmd.env("TMS_CONTROL", "1").env("TMS_SOCKET_DIR", &dir);
    let r = run(cmd);
    r.assert_passed("socket-path");
    assert_quiet(&r);
}
