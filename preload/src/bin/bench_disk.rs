//! The disk backup scenarios of `tms-bench`, against the disk's own limits measured in the same
//! run. A sweep writes and reads a short file at several request sizes and queue depths, direct
//! (`O_DIRECT`) and buffered (the page cache dropped for the file before each read, a write
//! timed with its `fdatasync`); the best write and the best read of the sweep are then measured
//! again over the scenarios' whole size, as are the library's own way (its staging slot as the
//! request size, its copy threads as the queue depth, each thread reading or writing a whole
//! disk chunk in order, as the copy workers do) and `dd` with 64 MiB direct I/O. The limit is
//! the best of those whole-size passes: a short pass can ride a burst (a drive's write cache,
//! say) that a long backup does not get, as one H200 machine showed (2.06 GiB/s reading 2 GiB,
//! 1.56-1.77 GiB/s reading 16 GiB). Also reported: the process's RSS during the pause and the
//! page cache's growth.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use tms::backup::BackupKind;
use tms::units::human;
use tms::Engine;

use super::common::{req, s};
use super::{check_and_free, device_patterns, rss_bytes, vs, Opts, Table};

/// Disk bandwidth in GiB/s: the best of the ways measured, and what achieved it.
#[derive(Default)]
struct DiskLimits {
    write: f64,
    read: f64,
    write_how: String,
    read_how: String,
}

impl DiskLimits {
    fn take(&mut self, write: bool, rate: f64, how: String) {
        let (best, best_how) = if write {
            (&mut self.write, &mut self.write_how)
        } else {
            (&mut self.read, &mut self.read_how)
        };
        if rate > *best {
            *best = rate;
            *best_how = how;
        }
    }
}

pub fn run(e: &Engine, o: &Opts, dir: &Path, t: &mut Table) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|err| format!("{}: {err}", dir.display()))?;
    s(e.set_disk_backup_dir(Some(dir.to_path_buf())))?;
    let cfg = e.copy_config();
    // The size each copy worker reads or writes in order (a whole allocation where smaller).
    let file_chunk = cfg.disk_chunk_bytes();
    let lim = if o.limits {
        println!(
            "disk limits in {} (the library: {} writes and reads, {} at a time, O_DIRECT, each \
             thread a {} chunk in order){}",
            dir.display(),
            human(cfg.slot),
            cfg.threads,
            human(file_chunk),
            if tms::backup::disk::is_ram_backed(dir) {
                " -- this directory is in RAM (tmpfs)"
            } else {
                ""
            }
        );
        let best = io_sweep(dir, o.total, t)?;
        let mut l = DiskLimits::default();
        let ours = Way {
            io: cfg.slot.min(file_chunk),
            depth: cfg.threads,
            direct: true,
            run: file_chunk,
        };
        io_limits(dir, o.total, &best, ours, &mut l, t)?;
        dd_reference(dir, o.total, &mut l, t);
        println!(
            "  disk limits: write {:.2} GiB/s ({}), read {:.2} GiB/s ({})",
            l.write, l.write_how, l.read, l.read_how
        );
        l
    } else {
        DiskLimits::default()
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

/// Request sizes and queue depths of the sweep, and the bytes each pass moves (at most).
const SWEEP_IO: [u64; 4] = [1 << 20, 4 << 20, 16 << 20, 64 << 20];
const SWEEP_DEPTH: [usize; 3] = [1, 4, 16];
const SWEEP_BYTES: u64 = 2 << 30;

/// One way of moving bytes: request size, queue depth, direct or buffered, and how far each
/// thread goes on its own: the file is handed out in runs of `run` bytes (a multiple of `io`),
/// each walked by one thread in `io`-byte requests. The sweep hands out single requests
/// (`run == io`); the library hands out whole disk chunks, so that each copy worker reads a
/// stretch of the file in order.
#[derive(Clone, Copy, PartialEq)]
struct Way {
    io: u64,
    depth: usize,
    direct: bool,
    run: u64,
}

impl Way {
    fn describe(&self) -> String {
        let runs = if self.run > self.io {
            format!(", each thread {} in order", human(self.run))
        } else {
            String::new()
        };
        format!(
            "{} I/Os x {}, {}{runs}",
            human(self.io),
            self.depth,
            if self.direct { "O_DIRECT" } else { "buffered" }
        )
    }
}

/// The fastest ways the sweep found to write and to read.
struct Best {
    write: Way,
    read: Way,
}

/// Every request size and queue depth of the sweep, direct and buffered, writing then reading a
/// file of up to [`SWEEP_BYTES`]; returns the fastest way each way round.
fn io_sweep(dir: &Path, total: u64, t: &mut Table) -> Result<Best, String> {
    let bytes = total.min(SWEEP_BYTES);
    let (mut best, mut fastest) = (None::<Best>, (0.0f64, 0.0f64));
    for direct in [true, false] {
        for io in SWEEP_IO {
            for depth in SWEEP_DEPTH {
                let way = Way {
                    io,
                    depth,
                    direct,
                    run: io,
                };
                let (w, r) = io_pass(dir, bytes, way)?;
                let how = way.describe();
                let w = t.add(format!("disk write, {how} (sweep)"), bytes, w);
                let r = t.add(format!("disk read, {how} (sweep)"), bytes, r);
                let b = best.get_or_insert(Best {
                    write: way,
                    read: way,
                });
                if w > fastest.0 {
                    (fastest.0, b.write) = (w, way);
                }
                if r > fastest.1 {
                    (fastest.1, b.read) = (r, way);
                }
            }
        }
    }
    best.ok_or_else(|| "the disk sweep measured nothing".to_string())
}

/// Over the whole size: the library's own way (`ours`: its staging slot, copy threads and disk
/// chunks, `O_DIRECT`), then the sweep's fastest write and fastest read. Each is a limit
/// candidate.
fn io_limits(
    dir: &Path,
    total: u64,
    best: &Best,
    ours: Way,
    l: &mut DiskLimits,
    t: &mut Table,
) -> Result<(), String> {
    let (w, r) = io_pass(dir, total, ours)?;
    let how = format!("{} (the library's)", ours.describe());
    l.take(
        true,
        t.add(format!("disk write, {how}"), total, w),
        how.clone(),
    );
    l.take(false, t.add(format!("disk read, {how}"), total, r), how);
    // The sweep's best write and read; one pass where they are the same way.
    let mut ways = vec![(best.write, true, best.write == best.read)];
    if best.read != best.write {
        ways.push((best.read, false, true));
    }
    for (way, write, read) in ways {
        if way == ours {
            continue;
        }
        let (w, r) = io_pass(dir, total, way)?;
        let how = format!("{} (the sweep's best, whole size)", way.describe());
        if write {
            l.take(
                true,
                t.add(format!("disk write, {how}"), total, w),
                how.clone(),
            );
        }
        if read {
            l.take(false, t.add(format!("disk read, {how}"), total, r), how);
        }
    }
    Ok(())
}

/// Seconds to write `total` bytes of a new file (with its `fdatasync`) the `way` says, then to
/// read it back the same way, its pages dropped from the cache first.
fn io_pass(dir: &Path, total: u64, way: Way) -> Result<(f64, f64), String> {
    let Way {
        io,
        depth: threads,
        direct,
        run,
    } = way;
    // Whole requests per run (at least one).
    let per_run = (run / io).max(1);
    let path = dir.join("tms-bench-limits.bin");
    let err = |what: &str, e: std::io::Error| format!("{what} {}: {e}", path.display());
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(if direct { libc::O_DIRECT } else { 0 })
        .open(&path)
        .map_err(|e| err("creating", e))?;
    let pieces = total.div_ceil(io);
    let runs = pieces.div_ceil(per_run);
    // No more threads than runs; each one's buffer is made and touched before the clock starts.
    let threads = threads.min(runs as usize).max(1);
    let mut bufs: Vec<Vec<u8>> = (0..threads)
        .map(|k| {
            let mut v = vec![0u8; io as usize + 4096];
            super::common::fill_pattern(aligned(&mut v, io as usize), k as u64 + 1);
            v
        })
        .collect();
    let mut go = |write: bool| -> Result<f64, String> {
        let next = AtomicU64::new(0);
        let failed = AtomicBool::new(false);
        let t0 = Instant::now();
        std::thread::scope(|sc| {
            for v in bufs.iter_mut() {
                let (f, next, failed) = (&f, &next, &failed);
                sc.spawn(move || {
                    let buf = aligned(v, io as usize);
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= runs || failed.load(Ordering::Relaxed) {
                            break;
                        }
                        for i in k * per_run..((k + 1) * per_run).min(pieces) {
                            let off = i * io;
                            let n = io.min(total - off) as usize;
                            let r = if write {
                                f.write_all_at(&buf[..n], off)
                            } else {
                                f.read_exact_at(&mut buf[..n], off)
                            };
                            if r.is_err() {
                                failed.store(true, Ordering::Relaxed);
                                break;
                            }
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
    drop_cached(&f);
    let r = go(false)?;
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok((w, r))
}

/// Drop the file's clean pages from the page cache, so that a read comes from the disk.
fn drop_cached(f: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on an open descriptor we own; it only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        println!("  (posix_fadvise DONTNEED failed ({rc}): the buffered read may hit the cache)");
    }
}

/// `dd` with 64 MiB direct I/O: a plain tool's rate, a limit candidate too (a missing `dd` is a
/// note).
fn dd_reference(dir: &Path, total: u64, l: &mut DiskLimits, t: &mut Table) {
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
            let how = "dd, bs=64M, direct".to_string();
            let w = t.add("dd write, bs=64M oflag=direct", count << 26, w);
            l.take(true, w, how.clone());
            let r = t.add("dd read, bs=64M iflag=direct", count << 26, r);
            l.take(false, r, how);
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
    let ptrs: Vec<_> = (0..n)
        .map(|_| s(e.alloc(&req(size, &tag, Some(BackupKind::Disk)))))
        .collect::<Result<_, _>>()?;
    device_patterns(e, &ptrs, size, 7, false)?;
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
            vs("disk write limit", lim.write),
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
            vs("disk read limit", lim.read),
            || e.resume(Some(&tag)),
        )?;
        println!(
            "  page cache {} during the resume; RSS after {}",
            human_signed(page_cache() as i64 - cache1 as i64),
            human(rss_bytes())
        );
    }
    check_and_free(e, t, &tag, &ptrs, size, 7)?;
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
