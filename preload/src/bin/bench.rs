//! Pause/resume throughput against the machine's own limits, measured in the same run.
//!
//! Limits: pinned and pageable host<->device copy bandwidth, a parallel fill of fresh host
//! memory, and the bare VMM calls (create+map+access, unmap+release) for the same allocations.
//! Scenarios: pause/resume with CPU backup (first cycle, then retained cycles) for one large
//! allocation and for many 32 MiB ones, pinned and mmap backends; resume without retention (the
//! share spent releasing host buffers); pause/resume without backup against the bare VMM calls;
//! process RSS after a non-retaining resume. Contents are verified. Prints a table; asserts
//! nothing about time.
//!
//! Usage: `tms-bench [TOTAL] [COUNT]` (default 16GiB and 512: one allocation of TOTAL, and COUNT
//! allocations of TOTAL/COUNT). On the sim use small sizes, e.g. `tms-bench 256MiB 16`.

#[path = "common.rs"]
#[allow(dead_code)]
mod common;

use common::{gib_per_s, req, s};

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use tms::driver::{Driver, HostBackend, HostBuffer};
use tms::units::{human, parse_bytes};
use tms::Engine;

struct Row {
    what: String,
    bytes: u64,
    seconds: f64,
    limit: Option<(String, f64)>,
}

struct Table {
    rows: Vec<Row>,
    problems: Vec<String>,
}

impl Table {
    fn add(
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
        println!("  {:<52} {:>9.4} s {:>8.2} GiB/s", r.what, seconds, rate);
        self.rows.push(r);
        rate
    }
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("usage: tms-bench [TOTAL] [COUNT]   (default 16GiB 512)");
        return ExitCode::SUCCESS;
    }
    let total = match args.first().map(|a| parse_bytes(a)).transpose() {
        Ok(v) => v.unwrap_or(16 << 30),
        Err(e) => {
            eprintln!("tms-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let count: u64 = match args.get(1).map(|a| a.parse::<u64>()) {
        None => 512,
        Some(Ok(n)) if n > 0 => n,
        _ => {
            eprintln!("tms-bench: COUNT must be a positive integer");
            return ExitCode::from(2);
        }
    };
    let driver = match common::choose_driver(total.saturating_mul(3)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("tms-bench: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "tms-bench on the {} driver: 1 x {} and {} x {}\n",
        driver.name(),
        human(total),
        count,
        human(total / count)
    );
    let mut t = Table {
        rows: Vec::new(),
        problems: Vec::new(),
    };
    if let Err(e) = run(&driver, total, count, &mut t) {
        t.problems.push(format!("error: {e}"));
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

fn run(driver: &Arc<dyn Driver>, total: u64, count: u64, t: &mut Table) -> Result<(), String> {
    let d = &**driver;
    let e = Engine::new(driver.clone());

    println!("machine limits");
    // Copy bandwidth, pinned and pageable, through one device allocation.
    let dev = s(e.alloc(&req(total, "limits", None)))?;
    let t0 = Instant::now();
    let mut pinned = s(HostBuffer::new(driver.clone(), HostBackend::Pinned, total))?;
    let pin_alloc = t0.elapsed().as_secs_f64();
    t.add("allocate fresh pinned host memory", total, pin_alloc, None);
    common::fill_pattern(pinned.as_mut_slice(), 1);
    let t0 = Instant::now();
    s(e.write_bytes(dev, pinned.as_slice()))?;
    let h2d = t.add(
        "copy H2D from pinned memory",
        total,
        t0.elapsed().as_secs_f64(),
        None,
    );
    let t0 = Instant::now();
    s(e.read_bytes(dev, pinned.as_mut_slice()))?;
    let d2h = t.add(
        "copy D2H to pinned memory",
        total,
        t0.elapsed().as_secs_f64(),
        None,
    );
    drop(pinned);
    let mut pageable = vec![0u8; total as usize];
    common::fill_pattern(&mut pageable, 2);
    let t0 = Instant::now();
    s(e.write_bytes(dev, &pageable))?;
    let h2d_page = t.add(
        "copy H2D from pageable memory",
        total,
        t0.elapsed().as_secs_f64(),
        None,
    );
    let t0 = Instant::now();
    s(e.read_bytes(dev, &mut pageable))?;
    let d2h_page = t.add(
        "copy D2H to pageable memory",
        total,
        t0.elapsed().as_secs_f64(),
        None,
    );
    drop(pageable);
    s(e.free(dev))?;
    // A parallel fill of fresh host memory: how fast the host supplies new pages.
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let t0 = Instant::now();
    let mut fresh = vec![0u8; total as usize];
    let chunk = fresh.len().div_ceil(threads);
    std::thread::scope(|sc| {
        for (i, c) in fresh.chunks_mut(chunk).enumerate() {
            sc.spawn(move || common::fill_pattern(c, i as u64));
        }
    });
    let fill = t.add(
        format!("parallel fill of fresh host memory ({threads} threads)"),
        total,
        t0.elapsed().as_secs_f64(),
        None,
    );
    drop(fresh);
    // Bare VMM calls for COUNT allocations of total/COUNT.
    let piece = (total / count).max(1);
    let g = s(d.granularity(0))?;
    let mapped = piece.div_ceil(g) * g;
    let mut ranges = Vec::new();
    for _ in 0..count {
        ranges.push(s(d.reserve(0, mapped))?);
    }
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for p in &ranges {
        let h = s(d.create(0, mapped))?;
        s(d.map(*p, mapped, h))?;
        s(d.set_access(0, *p, mapped))?;
        handles.push(h);
    }
    let vmm_map = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for (p, h) in ranges.iter().zip(&handles) {
        s(d.unmap(*p, mapped))?;
        s(d.release(*h))?;
    }
    let vmm_unmap = t0.elapsed().as_secs_f64();
    for p in &ranges {
        s(d.free_range(*p, mapped))?;
    }
    t.add(
        format!("bare create+map+access, {count} x {}", human(mapped)),
        count * mapped,
        vmm_map,
        None,
    );
    t.add(
        format!("bare unmap+release, {count} x {}", human(mapped)),
        count * mapped,
        vmm_unmap,
        None,
    );

    // Scenarios with CPU backup.
    for backend in [HostBackend::Pinned, HostBackend::Mmap] {
        let (lim_d2h, lim_h2d) = (d2h, h2d);
        for (n, size) in [(1u64, total), (count, piece)] {
            println!("\n{} backup, {n} x {}", backend.as_str(), human(size));
            let tag = format!("{}-{n}", backend.as_str());
            let mut ptrs = Vec::new();
            for i in 0..n {
                let p = s(e.alloc(&req(size, &tag, Some(backend))))?;
                let data = common::pattern(size.min(1 << 20) as usize, i);
                s(e.write_bytes(p, &data))?;
                ptrs.push((p, data));
            }
            let bytes = n * size;
            e.set_retain_cpu_backup(true);
            let rss0 = rss_bytes();
            let r = s(e.pause(Some(&tag)))?;
            t.add(
                format!("{tag}: first pause (fresh host memory)"),
                bytes,
                r.seconds,
                Some(("fill", fill)),
            );
            let r = s(e.resume(Some(&tag)))?;
            t.add(
                format!("{tag}: resume, retained"),
                bytes,
                r.seconds,
                Some(("pinned H2D", lim_h2d)),
            );
            for cycle in 2..=3 {
                let r = s(e.pause(Some(&tag)))?;
                t.add(
                    format!("{tag}: pause #{cycle}, buffers retained"),
                    bytes,
                    r.seconds,
                    Some(("pinned D2H", lim_d2h)),
                );
                let r = s(e.resume(Some(&tag)))?;
                t.add(
                    format!("{tag}: resume #{cycle}, retained"),
                    bytes,
                    r.seconds,
                    Some(("pinned H2D", lim_h2d)),
                );
            }
            s(e.pause(Some(&tag)))?;
            e.set_retain_cpu_backup(false);
            let r = s(e.resume(Some(&tag)))?;
            t.add(
                format!("{tag}: resume, releasing host buffers"),
                bytes,
                r.seconds,
                Some(("pinned H2D", lim_h2d)),
            );
            let rss1 = rss_bytes();
            println!(
                "  RSS before first pause {}, after non-retaining resume {} ({:+.1}%)",
                human(rss0),
                human(rss1),
                (rss1 as f64 - rss0 as f64) / rss0.max(1) as f64 * 100.0
            );
            for (p, data) in &ptrs {
                let mut back = vec![0u8; data.len()];
                s(e.read_bytes(*p, &mut back))?;
                if &back != data {
                    t.problems.push(format!("{tag}: contents differ at {p:#x}"));
                }
                s(e.free(*p))?;
            }
        }
    }
    let _ = (h2d_page, d2h_page);

    // Without backup: COUNT allocations against the bare VMM calls.
    println!("\nno backup, {count} x {}", human(piece));
    let mut ptrs = Vec::new();
    for _ in 0..count {
        ptrs.push(s(e.alloc(&req(piece, "plain", None)))?);
    }
    for cycle in 1..=3 {
        let r = s(e.pause(Some("plain")))?;
        t.add(
            format!("plain: pause #{cycle}"),
            count * mapped,
            r.seconds,
            Some(("bare unmap+release s", vmm_unmap)),
        );
        let r = s(e.resume(Some("plain")))?;
        t.add(
            format!("plain: resume #{cycle}"),
            count * mapped,
            r.seconds,
            Some(("bare create+map s", vmm_map)),
        );
    }
    for p in ptrs {
        s(e.free(p))?;
    }
    Ok(())
}

fn print_table(t: &Table) {
    println!("\nBENCH TABLE");
    println!(
        "{:<52} {:>10} {:>10} {:>12} {:>22}",
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
            None => "limit".to_string(),
        };
        println!(
            "{:<52} {:>10} {:>10.4} {:>12.2} {:>22}",
            r.what,
            human(r.bytes),
            r.seconds,
            gib_per_s(r.bytes, r.seconds),
            vs
        );
    }
}
