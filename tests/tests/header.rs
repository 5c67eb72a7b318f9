//! `preload/include/tms.h` is what the library's sources generate (`header/generate.rs`),
//! matches what `libtms.so` exports, compiles on its own (C and C++), and links: a C program
//! built against the header and `-ltms` gets the right answers.

use std::collections::BTreeSet;
use std::process::Command;

use tms_tests::{
    declared_functions, exported_functions, header_path, integer_defines, libtms, run, temp_dir,
};

#[path = "header/generate.rs"]
mod generate;

fn header() -> String {
    let p = header_path();
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// tms.h is generated: the checked-in file is what the Rust exports, their doc comments and the
/// status table make now. `TMS_UPDATE_HEADER=1` writes it instead of comparing.
#[test]
fn header_is_generated_from_the_sources() {
    let want = generate::header().unwrap_or_else(|e| panic!("{e}"));
    let path = header_path();
    if std::env::var_os("TMS_UPDATE_HEADER").is_some_and(|v| !v.is_empty()) {
        // Whole or not at all: the other tests of this file read it meanwhile.
        let tmp = path.with_extension("h.tmp");
        std::fs::write(&tmp, &want).expect("write tms.h");
        std::fs::rename(&tmp, &path).expect("replace tms.h");
        return;
    }
    let have = header();
    if have != want {
        let out = tms_tests::target_profile_dir().join("tms.h.generated");
        std::fs::write(&out, &want).expect("write the generated header");
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| have.lines().count().min(want.lines().count()));
        panic!(
            "{} is not what the sources generate (first difference at line {}: {:?} there, {:?} \
             generated; the whole generated header is in {}). Regenerate it with \
             TMS_UPDATE_HEADER=1 cargo test -p tms-tests --test header",
            path.display(),
            line + 1,
            have.lines().nth(line).unwrap_or(""),
            want.lines().nth(line).unwrap_or(""),
            out.display()
        );
    }
}

#[test]
fn header_declares_exactly_the_exported_functions() {
    let exported = exported_functions(&libtms());
    let declared = declared_functions(&header());
    let tms = |s: &BTreeSet<String>| -> BTreeSet<String> {
        s.iter()
            .filter(|n| n.starts_with("tms_"))
            .cloned()
            .collect()
    };
    assert!(
        tms(&exported).len() >= 19,
        "suspiciously few tms_* exports: {exported:?}"
    );
    let missing: Vec<_> = tms(&exported).difference(&declared).cloned().collect();
    assert!(
        missing.is_empty(),
        "exported but not declared in tms.h: {missing:?}"
    );
    let stale: Vec<_> = tms(&declared).difference(&exported).cloned().collect();
    assert!(
        stale.is_empty(),
        "declared in tms.h but not exported: {stale:?}"
    );
    // Everything else the library exports is the CUDA, HIP and NCCL interposers, declared (guarded)
    // too, and the existing library's one name without the prefix.
    assert_eq!(exported, declared, "exports and declarations differ");
    let others: BTreeSet<_> = exported.difference(&tms(&exported)).cloned().collect();
    let nccl: BTreeSet<String> = others
        .iter()
        .filter(|n| n.starts_with("nccl"))
        .cloned()
        .collect();
    assert_eq!(nccl.len(), 15, "the NCCL interposers: {nccl:?}");
    assert_eq!(
        others.difference(&nccl).cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from([
            "cudaFree".to_string(),
            "cudaMalloc".to_string(),
            "hipFree".to_string(),
            "hipMalloc".to_string(),
            "set_memory_margin_bytes".to_string()
        ])
    );
}

#[test]
fn header_status_codes_match_the_library() {
    let defs = integer_defines(&header(), "TMS_");
    let values: Vec<i64> = defs.iter().map(|(_, v)| *v).collect();
    assert_eq!(
        values,
        (0..=9).collect::<Vec<_>>(),
        "status codes: {defs:?}"
    );
    assert_eq!(defs.first().map(|d| d.0.as_str()), Some("TMS_OK"));
    assert_eq!(
        defs.last().map(|d| d.0.as_str()),
        Some("TMS_ERR_BUFFER_TOO_SMALL")
    );
    for (name, value) in &defs {
        assert_eq!(
            tms::error::status::name(*value as i32),
            name,
            "tms.h defines {name} as {value}"
        );
    }
}

/// Each `#define TMS_*` status of tms.h with the one-line comment above it.
fn documented_statuses(header: &str) -> Vec<(String, i64, String)> {
    let lines: Vec<&str> = header.lines().collect();
    let defs = integer_defines(header, "TMS_");
    defs.into_iter()
        .map(|(name, value)| {
            let at = lines
                .iter()
                .position(|l| {
                    let mut w = l.split_whitespace();
                    w.next() == Some("#define") && w.next() == Some(name.as_str())
                })
                .unwrap_or_else(|| panic!("tms.h: no line defines {name}"));
            let above = at.checked_sub(1).map_or("", |i| lines[i].trim());
            let meaning = above
                .strip_prefix("/* ")
                .and_then(|c| c.strip_suffix(" */"))
                .unwrap_or_else(|| panic!("tms.h: {name} lacks a one-line comment above it"));
            (name, value, meaning.to_string())
        })
        .collect()
}

/// tms.h's status codes are the library's table: the same codes, names and comments, in order.
#[test]
fn header_status_codes_and_comments_are_the_status_table() {
    let want: Vec<(String, i64, String)> = tms::error::status::TABLE
        .iter()
        .map(|s| {
            (
                s.name().to_string(),
                i64::from(s.code),
                s.meaning.to_string(),
            )
        })
        .collect();
    assert_eq!(documented_statuses(&header()), want);
}

/// `_BY_STATUS` of the Python package's errors.py: each code and the class it raises.
fn python_statuses(src: &str) -> Vec<(i32, String)> {
    let start = src
        .find("_BY_STATUS = {")
        .expect("errors.py has _BY_STATUS");
    let body = &src[start..];
    let body = &body[..body.find('}').expect("_BY_STATUS ends")];
    body.lines()
        .skip(1)
        .filter_map(|l| {
            let (code, class) = l.trim().trim_end_matches(',').split_once(':')?;
            Some((code.trim().parse().ok()?, class.trim().to_string()))
        })
        .collect()
}

/// The Python exceptions are the table's: every error code raises the class the table names,
/// and each such class is defined in errors.py (python/tests/test_status_codes.py checks the
/// same classes against tms.h from the Python side).
#[test]
fn python_exceptions_follow_the_status_table() {
    let p = tms_tests::workspace_root().join("python/torch_memory_saver/errors.py");
    let src = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    let want: Vec<(i32, String)> = tms::error::status::TABLE
        .iter()
        .filter_map(|s| Some((s.code, s.python?.to_string())))
        .collect();
    assert_eq!(python_statuses(&src), want);
    for (_, class) in &want {
        assert!(
            src.contains(&format!("\nclass {class}(")),
            "errors.py does not define {class}"
        );
    }
}

fn syntax_check(compiler: &str, args: &[&str]) {
    let out = Command::new(compiler)
        .args(["-fsyntax-only", "-Wall", "-Wextra", "-Werror"])
        .args(args)
        .arg(header_path())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {compiler}: {e}"));
    assert!(
        out.status.success(),
        "{compiler} {args:?} -fsyntax-only tms.h failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn header_compiles_on_its_own() {
    syntax_check("cc", &["-x", "c", "-std=c99", "-pedantic"]);
    syntax_check("c++", &["-x", "c++", "-std=c++11", "-pedantic"]);
    // Each guarded section of interposers, declared.
    for define in [
        "-DTMS_DECLARE_CUDA_INTERPOSERS",
        "-DTMS_DECLARE_HIP_INTERPOSERS",
        "-DTMS_DECLARE_NCCL_INTERPOSERS",
    ] {
        syntax_check("cc", &["-x", "c", "-std=c11", "-pedantic", define]);
        syntax_check("c++", &["-x", "c++", "-std=c++17", define]);
    }
}

const LINK_PROG: &str = r#"
#include "tms.h"
#include <stdio.h>
#include <string.h>

int main(void) {
    const int codes[] = {TMS_OK, TMS_ERR_OUT_OF_MEMORY, TMS_ERR_DRIVER, TMS_ERR_INVALID_ARGUMENT,
                         TMS_ERR_INVALID_STATE, TMS_ERR_NOT_FOUND, TMS_ERR_UNSUPPORTED,
                         TMS_ERR_IO, TMS_ERR_INTERNAL, TMS_ERR_BUFFER_TOO_SMALL, 42};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        printf("%d %s\n", codes[i], tms_status_name(codes[i]));
    }
    printf("version %s\n", tms_version());
    printf("build %s\n", tms_build_info());
    char name[2];
    size_t len = 0;
    int rc = tms_init(name, sizeof name, &len);
    printf("init-small %d %zu\n", rc, len);
    char msg[256];
    size_t n = tms_last_error(msg, sizeof msg);
    printf("last-error %zu %s\n", n, msg);
    char big[16];
    rc = tms_init(big, sizeof big, &len);
    printf("init %d %s %zu\n", rc, big, len);
    printf("active %d\n", tms_is_active());
    rc = tms_region_exit();
    printf("exit %d\n", rc);

    /* The existing library's names, through the header's bool prototypes: they act on the
     * innermost region, opening one when none is open. */
    printf("upstream-start %d %s %d %s\n", tms_get_interesting_region(), tms_get_current_tag(),
           tms_get_enable_cpu_backup(), tms_get_cpu_backup_backend());
    rc = tms_set_interesting_region(false);
    printf("upstream-off %d %d\n", rc, tms_get_interesting_region());
    rc = tms_region_enter(1, "kv", 1, "mmap");
    printf("upstream-enter %d %d %s %d %s\n", rc, tms_get_interesting_region(),
           tms_get_current_tag(), tms_get_enable_cpu_backup(), tms_get_cpu_backup_backend());
    rc = tms_set_current_tag("weights") | tms_set_enable_cpu_backup(false) |
         tms_set_cpu_backup_backend("pinned");
    printf("upstream-set %d %s %d %s\n", rc, tms_get_current_tag(), tms_get_enable_cpu_backup(),
           tms_get_cpu_backup_backend());
    printf("upstream-bad %d %d\n", tms_set_current_tag(""), tms_set_cpu_backup_backend("disk"));
    rc = tms_region_exit();
    printf("upstream-exit %d %d %s\n", rc, tms_get_interesting_region(), tms_get_current_tag());
    rc = tms_region_exit();
    printf("upstream-closed %d %d %d\n", rc, tms_get_interesting_region(), tms_region_exit());
    rc = set_memory_margin_bytes(4096) | tms_set_retain_cpu_backup(true);
    uint64_t margin = 0;
    tms_get_memory_margin(&margin);
    printf("upstream-process %d %llu %d\n", rc, (unsigned long long)margin,
           tms_get_retain_cpu_backup());
    static const uint8_t nowhere[16];
    printf("upstream-backup %d\n", tms_get_cpu_backup_pointer(nowhere, sizeof nowhere) == NULL);
    return 0;
}
"#;

/// Build the C program `prog` against tms.h and `-ltms` (warnings are errors) and run it on the
/// simulated device; it must exit 0.
fn build_and_run(name: &str, prog: &str) -> tms_tests::Run {
    let so = libtms();
    let lib_dir = so.parent().expect("libtms.so has a folder");
    let dir = temp_dir("tms-header-");
    let src = dir.path().join(format!("{name}.c"));
    let exe = dir.path().join(name);
    std::fs::write(&src, prog).expect("write the C program");
    let include = header_path();
    let include = include.parent().expect("include dir");
    let out = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg(format!("-I{}", include.display()))
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-ltms")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "building {name}.c against tms.h and -ltms failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut cmd = Command::new(&exe);
    tms_tests::scrub_env(&mut cmd);
    cmd.env("TMS_BACKEND", "sim");
    let r = run(cmd);
    assert!(r.status.success(), "{}", r.dump());
    r
}

#[test]
fn header_links_against_libtms_and_the_answers_match() {
    let r = build_and_run("link", LINK_PROG);
    let lines: Vec<&str> = r.stdout.lines().collect();
    let mut expected: Vec<String> = (0..=9)
        .map(|c| format!("{c} {}", tms::error::status::name(c)))
        .collect();
    expected.push("42 TMS_ERR_UNKNOWN_STATUS".into());
    expected.push(format!("version {}", env!("CARGO_PKG_VERSION")));
    assert_eq!(lines[..12], expected[..], "{}", r.dump());
    // The implementation, version and commit, in tmsctl --version's words. The commit is the
    // one libtms.so was built at, which a commit since its last build leaves behind this
    // test's: only its form is checked.
    let head = format!(
        "build libtms {} (torch-memory-saver, Rust implementation; commit ",
        env!("CARGO_PKG_VERSION")
    );
    let commit = lines[12]
        .strip_prefix(&head)
        .and_then(|c| c.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{}", r.dump()));
    assert!(
        !commit.is_empty()
            && commit
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b)),
        "{}",
        r.dump()
    );
    assert_eq!(
        tms_proto::BUILD_INFO.strip_suffix(&format!("{})", tms_proto::BUILD_COMMIT)),
        head.strip_prefix("build libtms ")
    );
    // "sim" does not fit in 2 bytes: the needed length is reported.
    assert_eq!(lines[13], "init-small 9 3", "{}", r.dump());
    assert!(
        lines[14].starts_with("last-error ") && lines[14].contains("too small"),
        "{}",
        r.dump()
    );
    assert_eq!(
        lines[15..],
        [
            "init 0 sim 3",
            "active 1",
            "exit 4",
            "upstream-start 0 default 0 pinned",
            "upstream-off 0 0",
            "upstream-enter 0 1 kv 1 mmap",
            "upstream-set 0 weights 0 pinned",
            "upstream-bad 3 3",
            "upstream-exit 0 0 default",
            "upstream-closed 0 0 4",
            "upstream-process 0 4096 1",
            "upstream-backup 1",
        ],
        "{}",
        r.dump()
    );
    assert_eq!(r.stderr, "", "{}", r.dump());
}

const PROGRESS_PROG: &str = r#"
#include "tms.h"
#include <stddef.h>
#include <stdio.h>

int main(void) {
    tms_progress p;
    p.active = 7;
    int rc = tms_get_progress(&p, sizeof p);
    printf("size %zu phase-at %zu thread-at %zu\n", sizeof(tms_progress),
           offsetof(tms_progress, phase), offsetof(tms_progress, thread_id));
    printf("idle %d %d %d %s\n", rc, p.active, p.op, p.phase);
    printf("short %d\n", tms_get_progress(&p, 8));
    printf("null %d\n", tms_get_progress(NULL, sizeof p));
    return 0;
}
"#;

/// `tms_progress` has the layout the library writes (no padding, 88 bytes), and
/// `tms_get_progress` reports nothing running, refusing a struct too short or none.
#[test]
fn the_progress_struct_matches_the_library() {
    let r = build_and_run("progress", PROGRESS_PROG);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "size 88 phase-at 56 thread-at 40",
            "idle 0 0 0 ",
            "short 3",
            "null 3",
        ],
        "{}",
        r.dump()
    );
}

const CHANGED_PROG: &str = r#"
#define _POSIX_C_SOURCE 200809L
#include "tms.h"
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

static void show(const char *what, int rc) {
    tms_changed c;
    c.said = 7;
    int got = tms_last_changed(&c, sizeof c);
    printf("%s %d: %d said %d %llu %llu %llu\n", what, rc, got, c.said,
           (unsigned long long)c.allocations, (unsigned long long)c.bytes,
           (unsigned long long)c.communicators);
}

int main(void) {
    /* Read at the library's start: its first release fails. */
    setenv("TMS_SIM_FAULTS", "release:1", 1);
    tms_changed c;
    printf("size %zu bytes-at %zu\n", sizeof(tms_changed), offsetof(tms_changed, bytes));
    printf("short %d\n", tms_last_changed(&c, 8));
    printf("null %d\n", tms_last_changed(NULL, sizeof c));
    show("none", 0);
    int rc = tms_region_enter(1, "t", 1, NULL);
    void *p = tms_torch_malloc(2 << 20, 0, NULL);
    rc |= tms_region_exit();
    printf("alloc %d %d\n", rc, p != NULL);
    show("pause", tms_pause("t"));
    show("resume", tms_resume("t"));
    show("refused", tms_pause_ex("t", 0) | tms_pause_chunks(NULL, NULL, 0));
    tms_torch_free(p, 2 << 20, 0, NULL);
    return 0;
}
"#;

/// `tms_changed` has the layout the library writes (no padding, 32 bytes), `tms_last_changed`
/// refuses a struct too short or none, and says what the calling thread's failed pause changed
/// all the same (its allocation, whose memory could not be released, left paused), nothing
/// after a success or a call refused before it acted.
#[test]
fn the_changed_struct_matches_the_library() {
    let r = build_and_run("changed", CHANGED_PROG);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "size 32 bytes-at 16",
            "short 3",
            "null 3",
            "none 0: 0 said 0 0 0 0",
            "alloc 0 1",
            "pause 2: 0 said 1 1 2097152 0",
            "resume 0: 0 said 0 0 0 0",
            "refused 3: 0 said 0 0 0 0",
        ],
        "{}",
        r.dump()
    );
}
