//! `LD_PRELOAD=libtms.so` on HIP: a program linked against the HIP test double calls hipMalloc
//! inside a region and gets pauseable memory, served by the library's HIP driver over the same
//! double (built by `build.rs`; no AMD GPU). The program (`tests/c/e2e_hip.c`) checks what it
//! can see; these tests check its verdict and what the library reported.

use std::process::Command;

use tms_tests::{libtms, run, scrub_env, Run, E2E_HIP};

/// The HIP program with a CPU backup in `backend` memory, preloaded with libtms.so, `env` added.
fn run_hip(backend: &str, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(E2E_HIP);
    cmd.arg(backend);
    scrub_env(&mut cmd);
    cmd.env("LD_PRELOAD", libtms()).env("TMS_CONTROL", "0");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(cmd)
}

fn assert_pauseable(r: &Run) {
    r.assert_passed("basic");
    assert_eq!(r.stderr, "", "nothing on stderr\n{}", r.dump());
    assert_eq!(r.stats("active")["backend"], "hip", "{}", r.dump());
    let oom = r.error("oom");
    assert!(
        oom.contains("hipMemCreate returned hipErrorOutOfMemory"),
        "{oom}\n{}",
        r.dump()
    );
}

#[test]
fn hip_malloc_in_a_region_is_pauseable_with_a_pinned_backup() {
    assert_pauseable(&run_hip("pinned", &[("TMS_BACKEND", "hip")]));
}

#[test]
fn hip_malloc_in_a_region_is_pauseable_with_a_pageable_backup() {
    assert_pauseable(&run_hip("mmap", &[("TMS_BACKEND", "hip")]));
}

#[test]
fn auto_picks_hip_where_no_cuda_driver_opens() {
    // SAFETY: dlopen with RTLD_NOLOAD | RTLD_LAZY only asks; a handle it returns is closed.
    let cuda = unsafe {
        let name = c"libcuda.so.1";
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY);
        if !h.is_null() {
            libc::dlclose(h);
        }
        !h.is_null()
    };
    if cuda {
        eprintln!("auto_picks_hip_where_no_cuda_driver_opens: skipped (a CUDA driver is here)");
        return;
    }
    assert_pauseable(&run_hip("pinned", &[]));
}

#[test]
fn without_the_workaround_the_paused_memory_stays_held() {
    let r = run_hip(
        "pinned",
        &[("TMS_BACKEND", "hip"), ("TMS_HIP_RESERVE_AGAIN", "0")],
    );
    let failed = r.failed_checks();
    assert_eq!(failed.len(), 1, "{}", r.dump());
    assert!(
        failed[0].contains("paused: the memory is back"),
        "{}",
        r.dump()
    );
}

#[test]
fn a_malformed_hip_setting_passes_through_naming_the_variable() {
    let r = run_hip(
        "pinned",
        &[("TMS_BACKEND", "hip"), ("TMS_HIP_RESERVE_AGAIN", "perhaps")],
    );
    assert!(
        r.stderr.contains("TMS_HIP_RESERVE_AGAIN"),
        "named once on stderr\n{}",
        r.dump()
    );
    assert!(
        r.stdout
            .contains("FAIL: hipMalloc inside the region is served by libtms.so"),
        "the allocation went to the runtime\n{}",
        r.dump()
    );
}
