//! The test harness itself (`common/`): the shared invariant check finds what the registry does
//! not account for; a harness test gets an engine of its own on the driver `TMS_TEST_DRIVER`
//! names; and a `TMS_TEST_DRIVER` that cannot be served ends the test binary at once with one
//! clear message and exit status 2, instead of failing (or hanging) test by test.

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::harness::{DRIVER_VAR, UNSERVED};
use common::{check_invariants, engine_test, pattern, sim_engine, Expect, Leaks, Setup};
use tms::driver::cuda::CudaDriver;
use tms::driver::Driver;
use tms::engine::AllocRequest;

const G: u64 = 2 << 20;

fn req(size: u64, tag: &str) -> AllocRequest {
    AllocRequest {
        size,
        device: 0,
        tag: tag.into(),
        backup: None,
        chunk: 0,
    }
}

fn err_of(r: Result<(), String>) -> String {
    r.expect_err("the check should fail")
}

#[test]
fn the_invariant_check_finds_what_the_registry_does_not_account_for() {
    let (sim, e) = sim_engine(&Setup::default());
    let p = e.alloc(&req(G + 1, "t")).unwrap();
    let clean = Expect::clean();
    check_invariants(&e, &sim, &clean).unwrap();

    // Physical memory behind the engine's back: its bytes and its handle.
    let h = sim.create(0, G).unwrap();
    let m = err_of(check_invariants(&e, &sim, &clean));
    assert!(m.contains("device 0: live bytes"), "{m}");
    let mut leaks = Leaks::default();
    leaks.handle(0, G);
    let allowed = Expect {
        leaks: leaks.clone(),
        copies_done: true,
    };
    check_invariants(&e, &sim, &allowed).unwrap();
    let unknown_bytes = Expect {
        leaks: Leaks {
            handles: 1,
            bytes: None,
            ..Leaks::default()
        },
        copies_done: true,
    };
    check_invariants(&e, &sim, &unknown_bytes).unwrap();
    sim.release(h).unwrap();

    // An address range nobody gave back.
    let r = sim.reserve(0, G).unwrap();
    let m = err_of(check_invariants(&e, &sim, &clean));
    assert!(m.contains("reservations"), "{m}");
    let allowed = Expect {
        leaks: Leaks {
            reservations: 1,
            ..Leaks::default()
        },
        copies_done: true,
    };
    check_invariants(&e, &sim, &allowed).unwrap();
    sim.free_range(r, G).unwrap();

    // Host memory page-locked outside the engine.
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    // SAFETY: a fresh anonymous mapping of one page; touches no existing memory.
    let buf = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(buf, libc::MAP_FAILED);
    let buf = buf as *mut u8;
    // SAFETY: buf is a page-aligned mapping of one page, unregistered below before it is
    // unmapped.
    unsafe { sim.host_register(0, buf, page as u64).unwrap() };
    let m = err_of(check_invariants(&e, &sim, &clean));
    assert!(m.contains("pinned bytes"), "{m}");
    // SAFETY: registered above; no copy uses it; then the page is ours to unmap.
    unsafe {
        sim.host_unregister(0, buf).unwrap();
        libc::munmap(buf.cast(), page);
    }

    // A copy left queued, then (once run) one that used pageable memory.
    let mut out = vec![0u8; 16];
    let s = sim.stream(0).unwrap();
    // SAFETY: p is an active allocation; out outlives the copy (the stream is synchronized
    // below).
    unsafe { sim.copy_d2h(out.as_mut_ptr(), p, 16, s).unwrap() };
    let m = err_of(check_invariants(&e, &sim, &clean));
    assert!(m.contains("left queued"), "{m}");
    sim.stream_sync(s).unwrap();
    let m = err_of(check_invariants(&e, &sim, &clean));
    assert!(m.contains("pageable"), "{m}");
    let counts_only = Expect::default();
    check_invariants(&e, &sim, &counts_only).unwrap();

    // A mapping the registry says is there, taken away.
    sim.unmap(p, 2 * G).unwrap();
    let m = err_of(check_invariants(&e, &sim, &counts_only));
    assert!(
        m.contains(&format!("{p:#x}")) && m.contains("Active in the registry but not accessible"),
        "{m}"
    );
}

engine_test! {
    /// Each harness, and each `again`, is an engine of its own; what it writes it reads back,
    /// and ending it gives everything back.
    fn a_harness_gives_each_test_an_engine_of_its_own(h) {
        let cuda_run = std::env::var(DRIVER_VAR).as_deref() == Ok("cuda");
        assert_eq!(h.is_cuda(), cuda_run && !h.is_hip());
        assert_eq!(h.pick(1, 2), if h.is_cuda() { 2 } else { 1 });
        let want = if h.is_hip() { "hip" } else { h.pick("sim", "cuda") };
        assert_eq!(h.driver().name(), want);
        let g = h.g();
        let p = h.e.alloc(&req(g + 5, "t")).unwrap();
        let data = pattern((g + 5) as usize, 3);
        h.write(p, &data);
        assert_eq!(h.read(p, data.len()), data);
        h.assert_live_bytes(0, 2 * g, "one allocation");
        h.assert_invariants(&Expect::default(), "one allocation");
        let other = h.again();
        assert!(other.e.allocations().is_empty(), "a fresh engine");
        assert!(!other.e.owns(p));
        drop(other);
        h.e.pause(None).unwrap();
        h.assert_accessible(p, g, false, "paused");
        h.assert_live_bytes(0, 0, "paused");
        h.e.resume(None).unwrap();
        h.assert_accessible(p, g, true, "resumed");
        assert!(h.e.owns(p));
        h.end().assert_released("ended");
    }
}

/// Run this test binary again with `TMS_TEST_DRIVER=value`, skipping this file's tests of that;
/// its exit status and standard error, or a failure if it does not end within a minute.
fn rerun_with_driver(value: &str) -> (Option<i32>, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--skip", "ends_the_binary", "--test-threads", "4"])
        .env(DRIVER_VAR, value)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("{DRIVER_VAR}={value}: the test binary did not end within a minute");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What every unserved run shows: exit status 2, the message once, no panic.
fn assert_one_clear_message(value: &str, code: Option<i32>, stderr: &str, says: &str) {
    assert_eq!(code, Some(UNSERVED), "{DRIVER_VAR}={value}: {stderr}");
    let lines: BTreeMap<&str, usize> =
        stderr
            .lines()
            .filter(|l| l.starts_with("error: "))
            .fold(BTreeMap::new(), |mut m, l| {
                *m.entry(l).or_default() += 1;
                m
            });
    assert_eq!(
        lines.len(),
        1,
        "{DRIVER_VAR}={value}: one message: {stderr}"
    );
    let (line, n) = lines.into_iter().next().unwrap();
    assert_eq!(n, 1, "{DRIVER_VAR}={value}: said once: {stderr}");
    assert!(line.contains(says), "{DRIVER_VAR}={value}: {line}");
    assert!(
        !stderr.contains("panicked"),
        "{DRIVER_VAR}={value}: {stderr}"
    );
}

#[test]
fn an_unknown_driver_ends_the_binary_with_one_message() {
    let (code, stderr) = rerun_with_driver("gpu");
    assert_one_clear_message(
        "gpu",
        code,
        &stderr,
        "TMS_TEST_DRIVER=\"gpu\": expected \"sim\" (the default) or \"cuda\"",
    );
}

#[test]
fn cuda_without_a_gpu_ends_the_binary_with_one_message() {
    if let Ok(d) = CudaDriver::load() {
        eprintln!(
            "skipped: this machine has a CUDA driver ({} devices), so the harness runs on it",
            d.device_count().unwrap_or(0)
        );
        return;
    }
    let (code, stderr) = rerun_with_driver("cuda");
    assert_one_clear_message(
        "cuda",
        code,
        &stderr,
        "TMS_TEST_DRIVER=cuda, but the CUDA driver cannot be used",
    );
}
