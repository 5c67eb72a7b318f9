//! The disk backup scenarios of `tms-bench`, against the disk's own limits measured in the same
//! run: sequential writes and reads with the library's I/O size (the staging slot) and queue
//! depth (the copy threads) through `O_DIRECT`, and `dd` with 64 MiB direct I/O as a plain
//! reference. Also reported: the process's RSS during the pause and the page cache's growth.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use tms::backup::BackupKind;
use tms::units::human;
use tms::Engine;

use super::common::{req, s};
use super::{device_pattern, rss_bytes, vs, Opts, Table};

/// Disk bandwidth in GiB/s.
struct DiskLimits {
    write: f64,
    read: f64,
}

pub fn run(e: &Engine, o: &Opts, dir: &Path, t: &mut Table) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
    s(e.set_disk_backup_dir(Some(dir.to_path_buf())))?;
    let cfg = e.copy_config();
    let lim = if o.limits {
        println!(
            "disk limits in {} ({} of writes and reads, {} at a time, O_DIRECT){}",
            dir.display(),
            human(cfg.slot),
            cfg.threads,
            if tms::backup::disk::is_ram_backed(dir) {
                " -- this directory is in RAM (tmpfs)"
            } else {
                ""
            }
        );
        let l = io_limits(dir, o.total, cfg.slot, cfg.threads, t)?;
        dd_reference(dir, o.total, t);
        l
    } else {
        DiskLimits {
            write: 0.0,
            read: 0.0,
        }
    };
    let piece = o.total / o.count;
    let many = o.many.then_some((o.count, piece));
    for (n, size) in std::iter::once((1u64, o.total)).chain(many) {
        scenario(e, n, size, &lim, dir, t)?;
    }
    Ok(())
}

/// An aligned piece of a buffer, as `O_DIRECT` needs.
fn aligned(v: &mut [u8], len: usize) -> &mut [u8] {
    let off = v.as_ptr().align_offset(4096);
    &mut v[off..off + len]
}

/// `threads` threads writing, then reading, `total` bytes of one file in pieces of `io` bytes.
fn io_limits(
    dir: &Path,
    total: u64,
    io: u64,
    threads: usize,
    t: &mut Table,
) -> Result<DiskLimits, String> {
    let path = dir.join("tms-bench-limits.bin");
    let err = |what: &str, e: std::io::Error| format!("{what} {}: {e}", path.display());
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| err("creating", e))?;
    let pieces = total.div_ceil(io);
    let go = |write: bool| -> Result<f64, String> {
        let next = AtomicU64::new(0);
        let failed = AtomicBool::new(false);
        let t0 = Instant::now();
        std::thread::scope(|sc| {
            for k in 0..threads {
                let (f, next, failed) = (&f, &next, &failed);
                sc.spawn(move || {
                    let mut v = vec![0u8; io as usize + 4096];
                    let buf = aligned(&mut v, io as usize);
                    super::common::fill_pattern(buf, k as u64 + 1);
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= pieces || failed.load(Ordering::Relaxed) {
                            break;
                        }
                        let off = i * io;
                        let n = io.min(total - off) as usize;
                        let r = if write {
                            f.write_all_at(&buf[..n], off)
                        } else {
                            f.read_exact_at(&mut buf[..n], off)
                        };
                        if r.is_err() {
                            failed.store(true, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        if write {
            f.sync_data().map_err(|e| err("syncing", e))?;
        }
        if failed.load(Ordering::Relaxed) {
            return Err(format!(
                "{} {} failed",
                if write { "writing" } else { "reading" },
                path.display()
            ));
        }
        Ok(t0.elapsed().as_secs_f64())
    };
    let w = go(true)?;
    let r = go(false)?;
    drop(f);
    let _ = std::fs::remove_file(&path);
    let what = |d: &str| format!("disk {d}, {} I/Os x {threads} (O_DIRECT)", human(io));
    Ok(DiskLimits {
        write: t.add(what("write"), total, w),
        read: t.add(what("read"), total, r),
    })
}

/// `dd` with 64 MiB direct I/O, for reference (rows only; a missing `dd` is a note).
fn dd_reference(dir: &Path, total: u64, t: &mut Table) {
    let path = dir.join("tms-bench-dd.bin");
    let count = total.div_ceil(64 << 20);
    let run = |args: &[String]| -> Option<f64> {
        let t0 = Instant::now();
        let ok = std::process::Command::new("dd")
            .args(args)
            .stderr(std::process::Stdio::null())
            .status()
            .ok()?
            .success();
        ok.then(|| t0.elapsed().as_secs_f64())
    };
    let p = path.display().to_string();
    let w = run(&[
        "if=/dev/zero".into(),
        format!("of={p}"),
        "bs=64M".into(),
        format!("count={count}"),
        "oflag=direct".into(),
        "conv=fdatasync".into(),
    ]);
    let r = run(&[
        format!("if={p}"),
        "of=/dev/null".into(),
        "bs=64M".into(),
        "iflag=direct".into(),
    ]);
    let _ = std::fs::remove_file(&path);
    match (w, r) {
        (Some(w), Some(r)) => {
            t.add("dd write, bs=64M oflag=direct (reference)", count << 26, w);
            t.add("dd read, bs=64M iflag=direct (reference)", count << 26, r);
        }
        _ => println!("  (dd not available: no reference rows)"),
    }
}

/// `Cached:` of /proc/meminfo, in bytes.
fn page_cache() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cached:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |k| k * 1024)
}

/// Run `f` while sampling the process's RSS; returns its result and the highest RSS seen.
fn with_rss_peak<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let stop = AtomicBool::new(false);
    let peak = AtomicU64::new(rss_bytes());
    let out = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        let out = f();
        stop.store(true, Ordering::Relaxed);
        out
    });
    (out, peak.load(Ordering::Relaxed))
}

fn files_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn scenario(
    e: &Engine,
    n: u64,
    size: u64,
    lim: &DiskLimits,
    dir: &Path,
    t: &mut Table,
) -> Result<(), String> {
    println!("\ndisk backup, {n} x {}", human(size));
    let tag = format!("disk-{n}");
    let mut ptrs = Vec::new();
    for i in 0..n {
        let p = s(e.alloc(&req(size, &tag, Some(BackupKind::Disk))))?;
        device_pattern(e, p, size, i + 7, false)?;
        ptrs.push(p);
    }
    let bytes = n * size;
    for cycle in 1..=2 {
        let (cache0, rss0) = (page_cache(), rss_bytes());
        let (r, peak) = with_rss_peak(|| e.pause(Some(&tag)));
        let r = s(r)?;
        let what = if cycle == 1 {
            "new files"
        } else {
            "files reused"
        };
        t.add_vs(
            format!("{tag}: pause #{cycle} ({what})"),
            bytes,
            r.seconds,
            vs("disk write", lim.write),
        );
        println!(
            "  RSS peak during the pause {} above before; page cache {}; files {}",
            human(peak.saturating_sub(rss0)),
            human_signed(page_cache() as i64 - cache0 as i64),
            human(files_bytes(dir))
        );
        let cache1 = page_cache();
        t.timed(
            format!("{tag}: resume #{cycle}"),
            bytes,
            vs("disk read", lim.read),
            || e.resume(Some(&tag)),
        )?;
        println!(
            "  page cache {} during the resume; RSS after {}",
            human_signed(page_cache() as i64 - cache1 as i64),
            human(rss_bytes())
        );
    }
    for (i, p) in ptrs.iter().enumerate() {
        if !device_pattern(e, *p, size, i as u64 + 7, true)? {
            t.problems
                .push(format!("{tag}: contents of {p:#x} differ after the cycles"));
        }
        s(e.free(*p))?;
    }
    let left = files_bytes(dir);
    if left != 0 {
        t.problems.push(format!(
            "{tag}: {} of files left after the frees",
            human(left)
        ));
    }
    Ok(())
}

fn human_signed(v: i64) -> String {
    if v < 0 {
        format!("-{}", human(v.unsigned_abs()))
    } else {
        format!("+{}", human(v as u64))
    }
}
