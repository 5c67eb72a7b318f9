//! Pause/resume throughput against the machine's own limits, measured in the same run.
//!
//! Limits: pinned and pageable host<->device copy bandwidth; how fast the host supplies fresh
//! memory (a parallel fill, in small and in huge pages), copies memory, and page-locks it; the
//! bare VMM calls (create+map+access, unmap+release) for the same allocations. Scenarios:
//! pause/resume with CPU backup (the first pause into fresh host memory, then cycles with the
//! host buffers retained, then a resume that releases them) for one large allocation and for
//! many small ones, pinned and mmap backends; pause/resume without backup against the bare VMM
//! calls; process RSS after a non-retaining resume; chunked allocations (64 of 512 chunks
//! resumed without backup against the bare calls for 64 chunks, half of a TOTAL allocation's
//! chunks of 64 MiB and 1 GiB with a pinned backup against the link). Every byte is verified
//! after each scenario.
//! Prints a table; asserts nothing about time.
//!
//! Usage: `tms-bench [TOTAL] [COUNT] [--no-limits] [--backend pinned|mmap] [--no-plain]
//! [--no-many] [--no-chunks | --chunks-only] [--checks | --checks-only] [--segment BYTES]
//! [--settle MS] [--disk DIR [--disk-only]]` (default 16GiB 512: one allocation of TOTAL, and
//! COUNT allocations of TOTAL/COUNT; `--no-many` skips the latter with backup; `--chunks-only`
//! runs only the limits and the chunked scenarios, `--checks-only` only the limits and the
//! skip-unchanged and verify ones; `--segment` sets the engine's physical segment size, for
//! experiments; `TMS_LOG=tms=debug` logs pipeline phases). The copy
//! settings come from the `TMS_COPY_*`/`TMS_STAGING_SLOT`/`TMS_HOST_HUGEPAGES`/`TMS_PIN`
//! variables. On the sim use small sizes, e.g. `tms-bench 64MiB 8`.

#[path = "bench_checks.rs"]
mod checks;
#[path = "bench_chunks.rs"]
mod chunks;
#[path = "bench_disk.rs"]
mod disk;

#[path = "bench_machine.rs"]
mod machine;

#[path = "common.rs"]
#[allow(dead_code)]
mod common;

use common::{gib_per_s, req, s};
use machine::{limits, Limits};

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use tms::backup::BackupKind;
use tms::driver::{DevPtr, Driver};
use tms::engine::{OpReport, PinMode};
use tms::process::settings::copy_config_from_env;
use tms::units::{human, parse_bytes};
use tms::Engine;

/// A limit to compare a row with, if it was measured (a limit not measured is 0).
fn vs(name: &'static str, v: f64) -> Option<(&'static str, f64)> {
    (v > 0.0).then_some((name, v))
}

struct Row {
    what: String,
    bytes: u64,
    seconds: f64,
    /// What to compare with: a rate in GiB/s, or (name ending in " s") a time in seconds.
    limit: Option<(String, f64)>,
}

#[derive(Default)]
struct Table {
    rows: Vec<Row>,
    problems: Vec<String>,
}

impl Table {
    fn add(&mut self, what: impl Into<String>, bytes: u64, seconds: f64) -> f64 {
        self.add_vs(what, bytes, seconds, None)
    }

    fn add_vs(
        &mut self,
        what: impl Into<String>,
        bytes: u64,
        seconds: f64,
        limit: Option<(&str, f64)>,
    ) -> f64 {
        let r = Row {
            what: what.into(),
            bytes,
            seconds,
            limit: limit.map(|(n, v)| (n.to_string(), v)),
        };
        let rate = gib_per_s(bytes, seconds);
        println!("  {:<56} {:>9.4} s {:>8.2} GiB/s", r.what, seconds, rate);
        self.rows.push(r);
        rate
    }

    /// Run a pause or resume and add its row; its report, for what else the caller prints.
    fn timed(
        &mut self,
        what: impl Into<String>,
        bytes: u64,
        limit: Option<(&str, f64)>,
        op: impl FnOnce() -> tms::Result<OpReport>,
    ) -> Result<OpReport, String> {
        let r = s(op())?;
        self.add_vs(what, bytes, r.seconds, limit);
        Ok(r)
    }
}

struct Opts {
    total: u64,
    count: u64,
    limits: bool,
    backends: Vec<BackupKind>,
    plain: bool,
    many: bool,
    segment: Option<u64>,
    /// Directory for the disk backup scenarios (none: skipped).
    disk: Option<std::path::PathBuf>,
    /// Only the disk scenarios (and their limits).
    disk_only: bool,
    /// The chunked-allocation scenarios.
    chunks: bool,
    /// The skip-unchanged and verify scenarios (`bench_checks.rs`).
    checks: bool,
    /// Idle time between a pause and the resume that follows it (the driver's own work after a
    /// release, such as clearing the memory given back, is over by then).
    settle: std::time::Duration,
}

fn usage() -> &'static str {
    "usage: tms-bench [TOTAL] [COUNT] [--no-limits] [--backend pinned|mmap] [--no-plain] [--no-many] \
     [--no-chunks | --chunks-only] [--checks | --checks-only] [--segment BYTES] [--settle MS] \
     [--disk DIR [--disk-only]]   (default 16GiB 512)"
}

fn parse_args() -> Result<Option<Opts>, String> {
    let mut o = Opts {
        total: 16 << 30,
        count: 512,
        limits: true,
        backends: vec![BackupKind::Pinned, BackupKind::Mmap],
        plain: true,
        many: true,
        segment: None,
        disk: None,
        disk_only: false,
        chunks: true,
        checks: false,
        settle: std::time::Duration::ZERO,
    };
    let mut positional = 0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-h" | "--help" => {
                println!("{}", usage());
                return Ok(None);
            }
            "--no-limits" => o.limits = false,
            "--no-plain" => o.plain = false,
            "--no-many" => o.many = false,
            "--no-chunks" => o.chunks = false,
            "--checks" => o.checks = true,
            "--checks-only" => {
                o.backends.clear();
                o.plain = false;
                o.chunks = false;
                o.checks = true;
            }
            "--chunks-only" => {
                o.backends.clear();
                o.plain = false;
            }
            "--disk" => o.disk = Some(args.next().ok_or("--disk needs a directory")?.into()),
            "--disk-only" => o.disk_only = true,
            "--settle" => {
                let ms = args.next().ok_or("--settle needs milliseconds")?;
                let ms: u64 = ms
                    .parse()
                    .map_err(|_| format!("--settle: {ms:?} is not a number of milliseconds"))?;
                o.settle = std::time::Duration::from_millis(ms);
            }
            "--segment" => {
                let b = args.next().ok_or("--segment needs a size")?;
                o.segment = Some(parse_bytes(&b).map_err(|e| e.to_string())?);
            }
            "--backend" => {
                let b = args.next().ok_or("--backend needs pinned or mmap")?;
                o.backends = vec![BackupKind::parse(&b).map_err(|e| e.to_string())?];
            }
            _ if positional == 0 => {
                o.total = parse_bytes(&a).map_err(|e| e.to_string())?;
                positional += 1;
            }
            _ if positional == 1 => {
                o.count = a
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or("COUNT must be a positive integer")?;
                positional += 1;
            }
            _ => return Err(format!("unexpected argument {a:?}\n{}", usage())),
        }
    }
    if o.total / o.count == 0 {
        return Err("TOTAL/COUNT must be at least one byte".into());
    }
    if o.disk_only && o.disk.is_none() {
        return Err("--disk-only needs --disk DIR".into());
    }
    Ok(Some(o))
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(Some(o)) => o,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tms-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let driver = match common::choose_driver(o.total.saturating_mul(3)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("tms-bench: {e}");
            return ExitCode::from(2);
        }
    };
    tms::process::runtime::init_logging();
    let e = Engine::new(driver.clone());
    if let Some(b) = o.segment {
        if let Err(err) = e.set_segment_bytes(b) {
            eprintln!("tms-bench: {err}");
            return ExitCode::from(2);
        }
    }
    let cfg = match copy_config_from_env().and_then(|c| e.set_copy_config(c).map(|()| c)) {
        Ok(c) => c,
        Err(err) => {
            eprintln!("tms-bench: {err}");
            return ExitCode::from(2);
        }
    };
    println!(
        "tms-bench on the {} driver: 1 x {} and {} x {}; {} copy threads, chunk {}, slot {} \
         ({} when saving), \
         huge pages {}, streaming stores {}, pin {:?}, slots kept after a resume {}, pauses on \
         the workers' own streams {}; {} host threads; {} ms between a pause and its resume\n",
        driver.name(),
        human(o.total),
        o.count,
        human(o.total / o.count),
        cfg.threads,
        human(cfg.layout.chunk),
        human(cfg.slot),
        human(cfg.save_slot.min(cfg.slot)),
        if cfg.layout.hugepages { "on" } else { "off" },
        if cfg.layout.streaming { "on" } else { "off" },
        cfg.pin,
        if cfg.keep_staging { "yes" } else { "no" },
        if cfg.save_streams { "yes" } else { "no" },
        host_threads(),
        o.settle.as_millis()
    );
    print_host_facts();
    let mut t = Table::default();
    if let Err(err) = run(&driver, &e, &o, &mut t) {
        t.problems.push(format!("error: {err}"));
    }
    print_table(&t);
    if t.problems.is_empty() {
        println!("\nbench OK (contents verified)");
        ExitCode::SUCCESS
    } else {
        for p in &t.problems {
            println!("PROBLEM {p}");
        }
        ExitCode::from(1)
    }
}

fn host_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

fn print_host_facts() {
    for f in [
        "/sys/kernel/mm/transparent_hugepage/enabled",
        "/sys/kernel/mm/transparent_hugepage/defrag",
    ] {
        if let Ok(v) = std::fs::read_to_string(f) {
            println!("{f}: {}", v.trim());
        }
    }
    println!();
}

fn run(driver: &Arc<dyn Driver>, e: &Engine, o: &Opts, t: &mut Table) -> Result<(), String> {
    if let Some(dir) = &o.disk {
        disk::run(e, o, dir, t)?;
        if o.disk_only {
            return Ok(());
        }
    }
    let lim = if o.limits {
        println!("machine limits");
        let l = limits(driver, e, o, t)?;
        // For scripts/bench: the torch benchmark compares against these.
        println!(
            "LIMITS_JSON {}",
            serde_json::json!({
                "h2d_gib_s": l.h2d, "d2h_gib_s": l.d2h, "fill_gib_s": l.fill,
                "vmm_map_s": l.vmm_map_s, "vmm_unmap_s": l.vmm_unmap_s, "count": o.count,
            })
        );
        l
    } else {
        Limits::default()
    };
    let piece = o.total / o.count;
    for &backend in &o.backends {
        let many = o.many.then_some((o.count, piece));
        for (n, size) in std::iter::once((1u64, o.total)).chain(many) {
            backup_scenario(e, backend, n, size, o.settle, &lim, t)?;
        }
    }
    if o.plain {
        plain_scenario(e, o.count, piece, &lim, t)?;
    }
    if o.chunks {
        chunks::chunk_scenarios(driver, e, o, &lim, t)?;
    }
    if o.checks {
        checks::run(driver, e, o, &lim, t)?;
    }
    Ok(())
}

/// Fill `[ptr, ptr+size)` with the pattern of `seed` (or compare it with that pattern), through
/// host buffers of 64 MiB generated in parallel.
fn device_pattern(
    e: &Engine,
    ptr: DevPtr,
    size: u64,
    seed: u64,
    check: bool,
) -> Result<bool, String> {
    const PIECE: u64 = 64 << 20;
    let threads = host_threads() as u64;
    let mut off = 0;
    let mut want = vec![0u8; (PIECE * threads).min(size) as usize];
    let mut got = if check {
        vec![0u8; want.len()]
    } else {
        Vec::new()
    };
    while off < size {
        let n = (want.len() as u64).min(size - off) as usize;
        let base = off / PIECE;
        std::thread::scope(|sc| {
            for (i, c) in want[..n].chunks_mut(PIECE as usize).enumerate() {
                sc.spawn(move || common::fill_pattern(c, seed ^ ((base + i as u64) << 20)));
            }
        });
        if check {
            s(e.read_bytes(ptr + off, &mut got[..n]))?;
            if got[..n] != want[..n] {
                return Ok(false);
            }
        } else {
            s(e.write_bytes(ptr + off, &want[..n]))?;
        }
        off += n as u64;
    }
    Ok(true)
}

/// [`device_pattern`] of each of `ptrs` (seed `seed0 + i` for the i-th), several allocations at
/// a time: each pattern of a small allocation is made by one thread, so 512 of them one after
/// another kept the benchmark busy for a minute.
fn device_patterns(
    e: &Engine,
    ptrs: &[DevPtr],
    size: u64,
    seed0: u64,
    check: bool,
) -> Result<Vec<bool>, String> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Allocations of 64 MiB or more are filled by several threads each already.
    let at_once = if size >= 64 << 20 { 1 } else { host_threads() };
    let next = AtomicUsize::new(0);
    let out = std::sync::Mutex::new(vec![Ok(false); ptrs.len()]);
    std::thread::scope(|sc| {
        for _ in 0..at_once.min(ptrs.len()) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&p) = ptrs.get(i) else { break };
                let r = device_pattern(e, p, size, seed0 + i as u64, check);
                let failed = r.is_err();
                out.lock().unwrap()[i] = r;
                if failed {
                    // Leave the rest: the first error is the answer.
                    next.store(ptrs.len(), Ordering::Relaxed);
                    break;
                }
            });
        }
    });
    out.into_inner().unwrap().into_iter().collect()
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * tms::os::page_size())
}

/// How long the device is left alone between a pause and the resume of the rows that show what
/// a resume right after its pause loses (unless `--settle` leaves it alone before every resume).
const LEFT_ALONE: std::time::Duration = std::time::Duration::from_millis(500);

fn backup_scenario(
    e: &Engine,
    backend: BackupKind,
    n: u64,
    size: u64,
    settle: std::time::Duration,
    lim: &Limits,
    t: &mut Table,
) -> Result<(), String> {
    println!("\n{} backup, {n} x {}", backend.as_str(), human(size));
    let tag = format!("{}-{n}", backend.as_str());
    let ptrs: Vec<DevPtr> = (0..n)
        .map(|_| s(e.alloc(&req(size, &tag, Some(backend)))))
        .collect::<Result<_, _>>()?;
    device_patterns(e, &ptrs, size, 1, false)?;
    let bytes = n * size;
    // The host memory goes back after the resume returned: how much longer that took.
    let share = |r: &tms::engine::OpReport| {
        let after = e.wait_released().as_secs_f64();
        format!(
            "release {:.4} s in the resume's {:.4} s ({:.0}%), then {after:.4} s after it returned",
            r.release_seconds,
            r.seconds,
            r.release_seconds / r.seconds.max(1e-9) * 100.0
        )
    };
    // A pause, then a resume once the device was left alone for a moment: what the driver does
    // with the memory a pause gave back overlaps a resume that follows at once (the rows right
    // after this show that; none where `--settle` leaves it alone before every resume).
    let left_alone = |t: &mut Table, what: &str| -> Result<(), String> {
        if settle.is_zero() {
            s(e.pause(Some(&tag)))?;
            std::thread::sleep(LEFT_ALONE);
            t.timed(
                format!(
                    "{tag}: {what}, {} ms after its pause",
                    LEFT_ALONE.as_millis()
                ),
                bytes,
                vs("pinned H2D", lim.h2d),
                || e.resume(Some(&tag)),
            )?;
        }
        Ok(())
    };
    // Without retention: each pause takes fresh host memory, each resume gives it back.
    e.set_retain_cpu_backup(false);
    let rss0 = rss_bytes();
    t.timed(
        format!("{tag}: pause without retention (fresh memory)"),
        bytes,
        lim.cold_pause(),
        || e.pause(Some(&tag)),
    )?;
    std::thread::sleep(settle);
    let r = t.timed(
        format!("{tag}: resume without retention"),
        bytes,
        vs("pinned H2D", lim.h2d),
        || e.resume(Some(&tag)),
    )?;
    let released = share(&r);
    let rss1 = rss_bytes();
    println!(
        "  {released}; RSS before the pause {}, after the resume {} ({:+.1}%)",
        human(rss0),
        human(rss1),
        (rss1 as f64 - rss0 as f64) / rss0.max(1) as f64 * 100.0
    );
    left_alone(t, "resume without retention")?;
    e.wait_released();
    // With retention: the buffers stay, pinned ones get page-locked in the background.
    e.set_retain_cpu_backup(true);
    let r = s(e.pause(Some(&tag)))?;
    let paused_at = Instant::now();
    t.add_vs(
        format!("{tag}: first pause (fresh host memory)"),
        bytes,
        r.seconds,
        lim.cold_pause(),
    );
    t.timed(
        format!("{tag}: resume #1 right after, retained"),
        bytes,
        vs("pinned H2D", lim.h2d),
        || e.resume(Some(&tag)),
    )?;
    if !e.wait_for_background_pinning(std::time::Duration::from_secs(120)) {
        t.problems.push(format!(
            "{tag}: background page-locking did not finish in 120 s"
        ));
    }
    if backend == BackupKind::Pinned && e.copy_config().pin == PinMode::Background {
        println!(
            "  background page-locking done {:.2} s after the first pause",
            paused_at.elapsed().as_secs_f64()
        );
    }
    for cycle in 2..=3 {
        t.timed(
            format!("{tag}: pause #{cycle}, buffers retained"),
            bytes,
            vs("pinned D2H", lim.d2h),
            || e.pause(Some(&tag)),
        )?;
        std::thread::sleep(settle);
        t.timed(
            format!("{tag}: resume #{cycle}, retained"),
            bytes,
            vs("pinned H2D", lim.h2d),
            || e.resume(Some(&tag)),
        )?;
    }
    left_alone(t, "resume #4, retained")?;
    let pinned: u64 = e.allocations().iter().map(|a| a.host_pinned_bytes).sum();
    let staging = e.staging_bytes();
    s(e.pause(Some(&tag)))?;
    e.set_retain_cpu_backup(false);
    let r = t.timed(
        format!("{tag}: resume, retention turned off"),
        bytes,
        vs("pinned H2D", lim.h2d),
        || e.resume(Some(&tag)),
    )?;
    let released = share(&r);
    let rss2 = rss_bytes();
    println!(
        "  {released}; host page-locked while retained {}, staging {}; RSS after {} ({:+.1}%)",
        human(pinned),
        human(staging),
        human(rss2),
        (rss2 as f64 - rss0 as f64) / rss0.max(1) as f64 * 100.0
    );
    check_and_free(e, t, &tag, &ptrs, size, 1)?;
    Ok(())
}

/// Check that the allocations at `ptrs` hold the pattern of `seed` (a problem of the table
/// where not), then free them.
fn check_and_free(
    e: &Engine,
    t: &mut Table,
    tag: &str,
    ptrs: &[DevPtr],
    size: u64,
    seed: u64,
) -> Result<(), String> {
    for (p, same) in ptrs.iter().zip(device_patterns(e, ptrs, size, seed, true)?) {
        if !same {
            t.problems
                .push(format!("{tag}: contents of {p:#x} differ after the cycles"));
        }
        s(e.free(*p))?;
    }
    Ok(())
}

fn plain_scenario(
    e: &Engine,
    count: u64,
    piece: u64,
    lim: &Limits,
    t: &mut Table,
) -> Result<(), String> {
    println!("\nno backup, {count} x {}", human(piece));
    let mut ptrs = Vec::new();
    for _ in 0..count {
        ptrs.push(s(e.alloc(&req(piece, "plain", None)))?);
    }
    let mapped: u64 = e.allocations().iter().map(|a| a.mapped).sum();
    for cycle in 1..=3 {
        t.timed(
            format!("plain: pause #{cycle}"),
            mapped,
            vs("bare unmap+release s", lim.vmm_unmap_s),
            || e.pause(Some("plain")),
        )?;
        t.timed(
            format!("plain: resume #{cycle}"),
            mapped,
            vs("bare create+map s", lim.vmm_map_s),
            || e.resume(Some("plain")),
        )?;
    }
    for p in ptrs {
        s(e.free(p))?;
    }
    Ok(())
}

fn print_table(t: &Table) {
    println!("\nBENCH TABLE");
    println!(
        "{:<56} {:>10} {:>10} {:>10} {:>24}",
        "what", "bytes", "seconds", "GiB/s", "vs limit"
    );
    for r in &t.rows {
        let vs = match &r.limit {
            Some((name, v)) if name.ends_with(" s") => {
                format!("{:.2}x {name}", r.seconds / v.max(1e-9))
            }
            Some((name, v)) => format!(
                "{:.0}% of {name}",
                gib_per_s(r.bytes, r.seconds) / v.max(1e-9) * 100.0
            ),
            None => String::new(),
        };
        println!(
            "{:<56} {:>10} {:>10.4} {:>10.2} {:>24}",
            r.what,
            human(r.bytes),
            r.seconds,
            gib_per_s(r.bytes, r.seconds),
            vs
        );
    }
}
