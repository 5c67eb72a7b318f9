//! The machine's own limits for `tms-bench`, measured in the same run as the scenarios: the
//! host<->device link (pinned and pageable), how fast the host supplies, copies and page-locks
//! fresh memory, and the bare VMM calls. The host-fill limit is what a first pause into fresh
//! host memory is held to: fresh memory laid out as the library lays out a backup (its page
//! size choice), faulted in and filled by memcpy from a cached source, by 1 to N threads; the
//! best rate is the limit.

use std::sync::Arc;
use std::time::Instant;

use tms::backup::{BackupKind, HostBuffer, HostLayout};
use tms::driver::{DevPtr, Driver};
use tms::units::human;
use tms::Engine;

use super::common::{self, req, s};
use super::{host_threads, Opts, Table};

/// The machine's limits, measured first. Rates in GiB/s.
#[derive(Default)]
pub(crate) struct Limits {
    pub(crate) h2d: f64,
    pub(crate) d2h: f64,
    /// The host-fill limit (the sweep's best), and its thread count.
    pub(crate) fill: f64,
    pub(crate) fill_threads: usize,
    pub(crate) vmm_map_s: f64,
    pub(crate) vmm_unmap_s: f64,
}

impl Limits {
    /// What a pause into fresh host memory is held to: the host-fill limit, or the link where
    /// that is lower.
    pub(crate) fn cold_pause(&self) -> Option<(&'static str, f64)> {
        if self.d2h > 0.0 && self.d2h < self.fill {
            Some(("pinned D2H (link)", self.d2h))
        } else {
            (self.fill > 0.0).then_some(("host fill limit", self.fill))
        }
    }
}

/// Thread counts of the host-fill sweep: powers of two up to twice the cores (at most 64).
fn fill_threads() -> Vec<usize> {
    let most = (2 * host_threads()).clamp(1, 64);
    std::iter::successors(Some(1usize), |n| Some(n * 2))
        .take_while(|&n| n <= most)
        .collect()
}

/// The host-fill sweep: fresh memory in the library's backup layout (`layout`), mapped,
/// faulted in and filled by `memcpy` from a 1 MiB source each thread keeps in its cache, by
/// each thread count of [`fill_threads`]; the buffer's release is not timed. Returns the best
/// rate and its thread count.
fn host_fill_sweep(
    driver: &Arc<dyn Driver>,
    total: u64,
    layout: HostLayout,
    t: &mut Table,
) -> Result<(f64, usize), String> {
    let pages = if layout.hugepages { "huge" } else { "small" };
    let mut best = (0.0, 0);
    for n in fill_threads() {
        let t0 = Instant::now();
        let mut fresh = host_buffer(driver, BackupKind::Mmap, total, layout)?;
        par_chunks(fresh.as_mut_slice(), n, |i, c| {
            let mut src = vec![0u8; 1 << 20];
            common::fill_pattern(&mut src, i as u64);
            for piece in c.chunks_mut(src.len()) {
                piece.copy_from_slice(&src[..piece.len()]);
            }
        });
        let rate = t.add(
            format!("host fill limit: fresh memory, {pages} pages, memcpy ({n} thr)"),
            total,
            t0.elapsed().as_secs_f64(),
        );
        if rate > best.0 {
            best = (rate, n);
        }
        drop(fresh);
    }
    println!(
        "  host fill limit: {:.2} GiB/s with {} threads",
        best.0, best.1
    );
    Ok(best)
}

/// Seconds for the bare calls of device 0 over the reserved `(address, bytes)` pieces:
/// create+map+access of them all, then unmap+release of them all; and how long the first
/// create+map+access took.
pub(crate) fn bare_vmm(
    d: &dyn Driver,
    pieces: &[(DevPtr, u64)],
) -> Result<(f64, f64, f64), String> {
    let t0 = Instant::now();
    let mut handles = Vec::new();
    let mut first = 0.0;
    for &(p, len) in pieces {
        let h = s(d.create(0, len))?;
        s(d.map(p, len, h))?;
        s(d.set_access(0, p, len))?;
        handles.push(h);
        if handles.len() == 1 {
            first = t0.elapsed().as_secs_f64();
        }
    }
    let map_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for (&(p, len), h) in pieces.iter().zip(&handles) {
        s(d.unmap(p, len))?;
        s(d.release(*h))?;
    }
    Ok((map_s, t0.elapsed().as_secs_f64(), first))
}

/// Run `f(i, chunk)` over `buf` cut into `threads` pieces, in parallel.
pub(crate) fn par_chunks(buf: &mut [u8], threads: usize, f: impl Fn(usize, &mut [u8]) + Sync) {
    let per = buf.len().div_ceil(threads.max(1)).max(1);
    let f = &f;
    std::thread::scope(|sc| {
        for (i, c) in buf.chunks_mut(per).enumerate() {
            sc.spawn(move || f(i, c));
        }
    });
}

pub(crate) fn limits(
    driver: &Arc<dyn Driver>,
    e: &Engine,
    o: &Opts,
    t: &mut Table,
) -> Result<Limits, String> {
    let d = &**driver;
    let total = o.total;
    let threads = host_threads();
    let chunk = e.copy_config().layout.chunk;
    let small = HostLayout {
        chunk: total.next_multiple_of(tms::os::page_size()),
        hugepages: false,
        streaming: false,
    };
    let mut lim = Limits::default();
    (lim.fill, lim.fill_threads) = host_fill_sweep(driver, total, e.copy_config().layout, t)?;
    let dev = s(e.alloc(&req(total, "limits", None)))?;

    // Page-locking fresh memory in one call: what allocating pinned memory costs.
    let t0 = Instant::now();
    let mut pinned = host_buffer(driver, BackupKind::Pinned, total, small)?;
    s(pinned.pin_all())?;
    t.add(
        "page-lock fresh memory, one call",
        total,
        t0.elapsed().as_secs_f64(),
    );
    common::fill_pattern(pinned.as_mut_slice(), 1);
    let t0 = Instant::now();
    s(e.write_bytes(dev, pinned.as_slice()))?;
    lim.h2d = t.add(
        "copy H2D from pinned memory (one copy)",
        total,
        t0.elapsed().as_secs_f64(),
    );
    let t0 = Instant::now();
    s(e.read_bytes(dev, pinned.as_mut_slice()))?;
    lim.d2h = t.add(
        "copy D2H to pinned memory (one copy)",
        total,
        t0.elapsed().as_secs_f64(),
    );
    // The device side of a pause into fresh memory without its host copies: what queueing
    // one small copy after another costs when every worker does it on the one stream.
    let cfg = e.copy_config();
    let piece = cfg.save_slot.min(cfg.slot);
    let has_own = driver.thread_stream().is_some();
    for (n, own) in [(1, false), (cfg.threads, false), (cfg.threads, true)] {
        if own && !has_own {
            continue;
        }
        let free0 = s(d.mem_info(0))?.free;
        let p = s(e.probe_d2h_lanes(dev, total, piece, n, own))?;
        // The threads have ended: what their streams took of the device and did not give back.
        let kept = free0 as i64 - s(d.mem_info(0))?.free as i64;
        t.add(
            format!(
                "copy D2H in {} pieces, {n} thr x 2 slots, {}",
                human(piece),
                if own { "a stream each" } else { "one stream" }
            ),
            total,
            p.seconds,
        );
        let per = |x: f64| x / p.pieces.max(1) as f64 * 1e6;
        println!(
            "    {} copies; per copy, summed over the threads: {:.1} us queueing it and its \
             event, {:.1} us waiting; device memory not given back after: {:.1} MiB",
            p.pieces,
            per(p.issue_s),
            per(p.wait_s),
            kept as f64 / (1 << 20) as f64
        );
    }
    let t0 = Instant::now();
    drop(pinned);
    t.add(
        "unregister and free pinned memory, one call",
        total,
        t0.elapsed().as_secs_f64(),
    );

    // Pageable copies: the driver's own staging path.
    let mut pageable = vec![0u8; total as usize];
    par_chunks(&mut pageable, threads, |i, c| {
        common::fill_pattern(c, i as u64)
    });
    let t0 = Instant::now();
    s(e.write_bytes(dev, &pageable))?;
    t.add(
        "copy H2D from pageable memory (driver)",
        total,
        t0.elapsed().as_secs_f64(),
    );
    let t0 = Instant::now();
    s(e.read_bytes(dev, &mut pageable))?;
    t.add(
        "copy D2H to pageable memory (driver)",
        total,
        t0.elapsed().as_secs_f64(),
    );

    // The host: a parallel memcpy between touched buffers.
    let mut other = vec![0u8; total as usize];
    par_chunks(&mut other, threads, |_, c| c.fill(1));
    let t0 = Instant::now();
    let per = pageable.len().div_ceil(threads);
    std::thread::scope(|sc| {
        for (dst, src) in other.chunks_mut(per).zip(pageable.chunks(per)) {
            sc.spawn(move || dst.copy_from_slice(src));
        }
    });
    t.add(
        format!("host memcpy, touched memory ({threads} threads)"),
        total,
        t0.elapsed().as_secs_f64(),
    );
    drop(other);
    let t0 = Instant::now();
    drop(pageable);
    t.add(
        "free touched pageable memory (munmap)",
        total,
        t0.elapsed().as_secs_f64(),
    );

    // Fresh memory: how fast the host hands out new pages.
    let t0 = Instant::now();
    let mut fresh = vec![0u8; total as usize];
    par_chunks(&mut fresh, threads, |i, c| {
        common::fill_pattern(c, i as u64)
    });
    t.add(
        format!("parallel fill of fresh memory, small pages ({threads} thr)"),
        total,
        t0.elapsed().as_secs_f64(),
    );
    drop(fresh);
    let huge = HostLayout {
        chunk: small.chunk,
        hugepages: true,
        streaming: false,
    };
    let t0 = Instant::now();
    let mut fresh = host_buffer(driver, BackupKind::Mmap, total, huge)?;
    par_chunks(fresh.as_mut_slice(), threads, |i, c| {
        common::fill_pattern(c, i as u64)
    });
    t.add(
        format!("parallel fill of fresh memory, huge pages ({threads} thr)"),
        total,
        t0.elapsed().as_secs_f64(),
    );
    // Page-locking touched memory in parallel chunks, then releasing it the same way.
    let layout = HostLayout { chunk, ..huge };
    let touched = host_buffer(driver, BackupKind::Pinned, total, layout)?;
    let t0 = Instant::now();
    pin_parallel(&touched, threads)?;
    t.add(
        format!(
            "page-lock fresh memory, {} chunks ({threads} thr)",
            human(chunk)
        ),
        total,
        t0.elapsed().as_secs_f64(),
    );
    // Memory laid out as a backup (huge pages, page-locked chunk by chunk), copied in one
    // chunk-sized copy after another on one stream: the pipeline's best case.
    let mut touched = touched;
    let piece = chunk as usize;
    let t0 = Instant::now();
    s(e.write_bytes_in(dev, touched.as_slice(), piece))?;
    t.add(
        format!("copy H2D, backup layout, {} copies queued", human(chunk)),
        total,
        t0.elapsed().as_secs_f64(),
    );
    let t0 = Instant::now();
    s(e.read_bytes_in(dev, touched.as_mut_slice(), piece))?;
    t.add(
        format!("copy D2H, backup layout, {} copies queued", human(chunk)),
        total,
        t0.elapsed().as_secs_f64(),
    );
    let t0 = Instant::now();
    tms::backup::release_parallel(vec![Arc::new(touched), Arc::new(fresh)], threads);
    t.add(
        format!(
            "release 2 x that memory, {} chunks ({threads} thr)",
            human(chunk)
        ),
        2 * total,
        t0.elapsed().as_secs_f64(),
    );
    s(e.free(dev))?;

    // Fresh memory populated in parallel (the kernel zeroes its pages), then page-locked in
    // parallel chunks: what a first pause straight into page-locked memory would cost.
    let pop = host_buffer(driver, BackupKind::Pinned, total, layout)?;
    let t0 = Instant::now();
    match each_chunk_parallel(&pop, threads, HostBuffer::populate) {
        Ok(()) => {
            t.add(
                format!("populate fresh memory, huge pages, no copy ({threads} thr)"),
                total,
                t0.elapsed().as_secs_f64(),
            );
            let t0 = Instant::now();
            pin_parallel(&pop, threads)?;
            t.add(
                format!(
                    "page-lock populated memory, {} chunks ({threads} thr)",
                    human(chunk)
                ),
                total,
                t0.elapsed().as_secs_f64(),
            );
        }
        Err(err) => println!("    (populating: {err})"),
    }
    tms::backup::release_parallel(vec![Arc::new(pop)], threads);

    // Bare VMM calls for COUNT allocations of TOTAL/COUNT.
    let piece = total / o.count;
    let g = s(d.granularity(0))?;
    let mapped = piece.div_ceil(g) * g;
    let mut ranges = Vec::new();
    for _ in 0..o.count {
        ranges.push(s(d.reserve(0, mapped))?);
    }
    let pieces: Vec<(DevPtr, u64)> = ranges.iter().map(|p| (*p, mapped)).collect();
    (lim.vmm_map_s, lim.vmm_unmap_s, _) = bare_vmm(d, &pieces)?;
    for p in &ranges {
        s(d.free_range(*p, mapped))?;
    }
    let what = format!("{} x {}", o.count, human(mapped));
    t.add(
        format!("bare create+map+access, {what}"),
        o.count * mapped,
        lim.vmm_map_s,
    );
    t.add(
        format!("bare unmap+release, {what}"),
        o.count * mapped,
        lim.vmm_unmap_s,
    );

    // The same calls for one allocation of TOTAL in the engine's segments: what a resume of it
    // must do before (and, overlapped, while) copying.
    let seg = e.segment_bytes().max(g);
    let mapped = o.total.div_ceil(g) * g;
    let base = s(d.reserve(0, mapped))?;
    let pieces: Vec<(DevPtr, u64)> = tms::engine::segments(mapped, seg)
        .map(|(off, len)| (base + off, len))
        .collect();
    let (map_s, unmap_s, first) = bare_vmm(d, &pieces)?;
    s(d.free_range(base, mapped))?;
    let what = format!("1 x {} in {} segments", human(mapped), pieces.len());
    t.add(format!("bare create+map+access, {what}"), mapped, map_s);
    println!("    (the first segment took {first:.4} s)");
    t.add(format!("bare unmap+release, {what}"), mapped, unmap_s);
    Ok(lim)
}

/// `len` bytes of fresh host memory of `kind` on device 0, laid out as `layout`.
fn host_buffer(
    driver: &Arc<dyn Driver>,
    kind: BackupKind,
    len: u64,
    layout: HostLayout,
) -> Result<HostBuffer, String> {
    s(HostBuffer::new(driver.clone(), 0, kind, len, layout))
}

pub(crate) fn pin_parallel(buf: &HostBuffer, threads: usize) -> Result<(), String> {
    each_chunk_parallel(buf, threads, HostBuffer::pin)
}

/// `f` on every chunk of `buf`, from up to `threads` threads; the first error.
fn each_chunk_parallel(
    buf: &HostBuffer,
    threads: usize,
    f: impl Fn(&HostBuffer, usize) -> tms::Result<()> + Sync,
) -> Result<(), String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let err = std::sync::Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..threads.min(buf.chunks()) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= buf.chunks() {
                    break;
                }
                if let Err(e) = f(buf, i) {
                    *err.lock().unwrap() = Some(e.to_string());
                    break;
                }
            });
        }
    });
    match err.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
