//! Memory really goes away on pause and comes back on resume:
//! - the simulated device's live bytes fall by exactly the mapped size, and so does the
//!   process's resident set (the sim's device memory is memfd pages of this process);
//! - with an mmap host backup, the resident set after a non-retaining resume is back near its
//!   pre-pause value (the backup is given back), and a retaining resume keeps it higher;
//! - contents survive pause/resume at many awkward sizes;
//! - touching a paused range faults (checked in a re-executed child process).
//!
//! The tests of this file that measure the resident set run one at a time (`SERIAL`). The
//! contents test also runs on a GPU (`common::harness`).

mod common;

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use common::{engine_test, Setup};
use tms::backup::BackupKind;
use tms::driver::sim::SimDriver;
use tms::engine::{AllocRequest, Engine, State};
use tms::Backup;

const MIB: u64 = 1 << 20;
/// Bytes made resident for the resident-set tests.
const BIG: u64 = 64 * MIB;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// One device of 1 GiB.
fn on_sim(granularity: u64) -> Setup {
    Setup::default().capacity(1 << 30).granularity(granularity)
}

fn alloc(e: &Engine, size: u64, tag: &str, backup: Backup) -> u64 {
    e.alloc(&AllocRequest {
        size,
        device: 0,
        tag: tag.into(),
        backup,
        chunk: 0,
    })
    .unwrap()
}

/// Resident set size of this process in bytes (`VmRSS` of `/proc/self/status`: anonymous, file
/// and shared memory, which is where the sim's memfd pages count). In kB, not pages: qemu-user
/// emulating a larger page size than its host's reports the host's pages.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap();
    let kib: u64 = line
        .trim()
        .strip_suffix("kB")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    kib * 1024
}

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            c.copy_from_slice(&self.0.to_le_bytes()[..c.len()]);
        }
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(seed).fill(&mut v);
    v
}

fn accessible(sim: &SimDriver, addr: u64, len: u64) -> bool {
    sim.is_accessible(addr) && sim.is_accessible(addr + len - 1)
}

/// Write `len` bytes of the stream of `seed` at `addr`, chunk by chunk (no big host copy).
fn fill_stream(sim: &SimDriver, addr: u64, len: u64, seed: u64) {
    assert!(accessible(sim, addr, len));
    let mut rng = Rng::new(seed);
    let mut chunk = vec![0u8; MIB as usize];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(MIB) as usize;
        rng.fill(&mut chunk[..n]);
        // SAFETY: addr..addr+len is mapped read/write (checked above).
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), (addr + off) as *mut u8, n) };
        off += n as u64;
    }
}

/// The range holds the stream of `seed`.
fn check_stream(sim: &SimDriver, addr: u64, len: u64, seed: u64, what: &str) {
    assert!(accessible(sim, addr, len), "{what}: not accessible");
    let mut rng = Rng::new(seed);
    let mut chunk = vec![0u8; MIB as usize];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(MIB) as usize;
        rng.fill(&mut chunk[..n]);
        // SAFETY: as in fill_stream.
        let got = unsafe { std::slice::from_raw_parts((addr + off) as *const u8, n) };
        assert!(
            got == &chunk[..n],
            "{what}: contents differ in {off}..{}",
            off + n as u64
        );
        off += n as u64;
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

engine_test! {
    sim_only fn pause_gives_device_memory_and_resident_pages_back(h) [on_sim(2 * MIB)] {
        let _s = serial();
        let (sim, e) = (h.simulated(), &h.e);
        let p = alloc(e, BIG, "big", None);
        // A neighbour that stays: pausing one tag touches only it.
        let q = alloc(e, 3 * MIB + 1, "stay", None);
        fill_stream(sim, p, BIG, 1);
        fill_stream(sim, q, 3 * MIB + 1, 2);
        let live = sim.live_bytes(0);
        assert_eq!(live, BIG + 4 * MIB);
        let before = rss();

        let r = e.pause(Some("big")).unwrap();
        assert_eq!((r.allocations, r.bytes, r.copied), (1, BIG, 0));
        assert_eq!(
            sim.live_bytes(0),
            live - BIG,
            "device memory falls by exactly the mapped size"
        );
        let after = rss();
        let fell = before.saturating_sub(after);
        assert!(
            fell >= BIG * 9 / 10,
            "resident set fell by {:.1} MiB ({:.1} -> {:.1}), expected about {:.0}",
            mib(fell),
            mib(before),
            mib(after),
            mib(BIG)
        );
        check_stream(sim, q, 3 * MIB + 1, 2, "the neighbour");

        e.resume(Some("big")).unwrap();
        assert_eq!(sim.live_bytes(0), live);
        assert!(e.free(p).unwrap() && e.free(q).unwrap());
        assert_eq!(sim.live_bytes(0), 0);
    }
}

engine_test! {
    sim_only fn mmap_backup_is_given_back_after_a_non_retaining_resume(h) [on_sim(2 * MIB)] {
        let _s = serial();
        let (sim, e) = (h.simulated(), &h.e);
        let p = alloc(e, BIG, "big", Some(BackupKind::Mmap));
        // The cycles measured below, once unmeasured first: what grows on first use only (the
        // allocator's arenas, the copy workers, an emulator's translated code under qemu-user)
        // is then in the base, and the backup alone comes and goes.
        e.set_retain_cpu_backup(true);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        e.set_retain_cpu_backup(false);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        assert_eq!(e.allocations()[0].host_bytes, 0);
        fill_stream(sim, p, BIG, 3);
        let base = rss();
        let near = |x: u64| x.abs_diff(base) <= BIG / 10;

        let r = e.pause(None).unwrap();
        assert_eq!((r.bytes, r.copied), (BIG, BIG));
        assert_eq!(sim.live_bytes(0), 0, "device memory gone");
        // The mmap backup went through page-locked staging slots, which stay until a resume that
        // keeps no backups.
        let staging = e.staging_bytes();
        assert!(staging > 0 && staging < BIG, "staging slots: {staging}");
        let paused = rss();
        assert!(
            near(paused - staging),
            "paused: the backup replaces the device pages: {:.1} MiB (with {:.1} MiB staging) vs {:.1}",
            mib(paused),
            mib(staging),
            mib(base)
        );

        // Retaining resume: device pages come back and the backup stays.
        e.set_retain_cpu_backup(true);
        e.resume(None).unwrap();
        check_stream(sim, p, BIG, 3, "after a retaining resume");
        let retained = rss();
        assert!(
            retained >= base + BIG * 9 / 10,
            "retaining resume keeps the backup resident: {:.1} MiB vs base {:.1}",
            mib(retained),
            mib(base)
        );
        assert_eq!(e.allocations()[0].host_bytes, BIG);

        // Non-retaining resume: the backup is unmapped, the resident set returns to the base.
        e.set_retain_cpu_backup(false);
        fill_stream(sim, p, BIG, 4);
        e.pause(None).unwrap();
        e.resume(None).unwrap();
        // Read before any other call into the engine (one might wait for a release): a
        // pageable backup is gone when the resume returns.
        let back = rss();
        check_stream(sim, p, BIG, 4, "after a non-retaining resume");
        assert_eq!(e.allocations()[0].host_bytes, 0);
        assert_eq!(
            e.staging_bytes(),
            0,
            "staging slots go with the last backup"
        );
        // The page-locked staging slots may still be on their way out (a thread frees them).
        assert!(
            back <= base + staging + BIG / 10,
            "non-retaining resume: {:.1} MiB, pre-pause {:.1} (staging {:.1})",
            mib(back),
            mib(base),
            mib(staging)
        );
        assert!(near(rss()), "once the staging slots are gone too");
        assert!(retained - back >= BIG * 8 / 10);
        assert!(e.free(p).unwrap());
    }
}

engine_test! {
    fn contents_survive_pause_at_awkward_sizes(h) [on_sim(64 << 10)] {
        let _s = serial();
        let g = h.g();
        let sizes = [
            1,
            4095,
            4096,
            4097,
            g - 1,
            g,
            g + 1,
            3 * g + 4097,
            5 * g - 1,
            7 * g + 1,
        ];
        for backend in [BackupKind::Pinned, BackupKind::Mmap] {
            for retain in [false, true] {
                let h = h.again();
                let e = &h.e;
                e.set_retain_cpu_backup(retain);
                let mut seed = 0;
                let mut allocs: Vec<(u64, Vec<u8>)> = Vec::new();
                for &size in &sizes {
                    let p = alloc(e, size, "t", Some(backend));
                    seed += 1;
                    let data = pattern(size as usize, seed);
                    h.write(p, &data);
                    allocs.push((p, data));
                }
                // Two rounds: with retention the second reuses the host buffers.
                for round in 0..2 {
                    let what = format!("{backend:?} retain {retain} round {round}");
                    let r = e.pause(Some("t")).unwrap();
                    assert_eq!(r.copied, sizes.iter().sum::<u64>(), "{what}");
                    for (p, data) in &allocs {
                        let size = data.len() as u64;
                        h.assert_accessible(*p, 1, false, &format!("{what}: paused"));
                        let mut b = vec![0u8; data.len()];
                        assert!(e.copy_cpu_backup(*p, &mut b).unwrap());
                        assert!(&b == data, "{what}: backup of {size} bytes");
                        let mut last = [0u8];
                        assert!(e.copy_cpu_backup(p + size - 1, &mut last).unwrap());
                        assert_eq!(last[0], data[data.len() - 1], "{what}: last byte");
                    }
                    e.resume(Some("t")).unwrap();
                    for (p, data) in &mut allocs {
                        let size = data.len() as u64;
                        h.assert_accessible(*p, size, true, &what);
                        let got = h.read(*p, data.len());
                        assert!(got == data[..], "{what}: {size} bytes after resume");
                        // New contents for the next round.
                        seed += 1;
                        *data = pattern(data.len(), seed);
                        h.write(*p, data);
                    }
                }
                assert!(e.allocations().iter().all(|i| i.state == State::Active));
                h.end().assert_released(&format!("{backend:?} retain {retain}"));
            }
        }
    }
}

/// Environment variable that turns `touching_a_paused_range_faults` into the child's role.
const CHILD: &str = "TMS_TEST_TOUCH_PAUSED";

/// The child's role: pause an allocation, then touch it as `mode` says. Only "control" may
/// return; the others must die of the touch.
fn child(mode: &str) {
    // No core files from the expected crash.
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit with a valid struct.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    let g = 64 << 10;
    let (_sim, e) = common::sim_engine(&on_sim(g));
    let size = 3 * g + 5;
    let p = alloc(&e, size, "t", Some(BackupKind::Mmap));
    // SAFETY: active allocation of `size` bytes.
    unsafe { std::ptr::write_bytes(p as *mut u8, 0x5a, size as usize) };
    e.pause(Some("t")).unwrap();
    let mapped = e.allocations()[0].mapped;
    let target = match mode {
        "read" | "write" => p + g + 123,
        "read_end" => p + mapped - 1,
        "control" => {
            e.resume(Some("t")).unwrap();
            p + g + 123
        }
        other => panic!("unknown child mode {other}"),
    };
    eprintln!("child: touching {target:#x} ({mode})");
    std::io::stderr().flush().unwrap();
    // SAFETY: deliberately not: the range is paused (PROT_NONE), except in "control".
    let v = unsafe {
        if mode == "write" {
            std::ptr::write_volatile(target as *mut u8, 1);
            1
        } else {
            std::ptr::read_volatile(target as *const u8)
        }
    };
    if mode == "control" {
        assert_eq!(v, 0x5a, "control: restored from the backup");
        eprintln!("child: control ok");
        return;
    }
    eprintln!("child: survived touching a paused range ({mode}), read {v}");
    std::process::exit(3);
}

#[test]
fn touching_a_paused_range_faults() {
    if let Ok(mode) = std::env::var(CHILD) {
        child(&mode);
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let run = |mode: &str| {
        Command::new(&exe)
            .args([
                "--exact",
                "touching_a_paused_range_faults",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, mode)
            .output()
            .unwrap()
    };
    for mode in ["read", "write", "read_end"] {
        let out = run(mode);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("child: touching") && err.contains(mode),
            "{mode}: the child got as far as the touch: {err}"
        );
        let sig = out.status.signal();
        assert!(
            sig == Some(libc::SIGSEGV) || sig == Some(libc::SIGBUS),
            "{mode}: the child must die of SIGSEGV/SIGBUS, got {:?}: {err}",
            out.status
        );
    }
    let out = run("control");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("child: control ok"),
        "control: touching a resumed range works: {:?} {err}",
        out.status
    );
}
